"""trnkit::moe_experts with the expert variants (activation, limit / alpha, biases): the variant reaches
impls only when it is not the default, autograd covers the biases, opcheck passes, and selection sees
the variant's constraints."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import torch_experts
from tests.tolerances import assert_close
from trnkit.overrides import ops, register, select, unregister

T, H, INTER, E, K = 12, 64, 32, 4, 2


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    wgu = torch.randn(E, H, 2 * INTER, generator=g) * H ** -0.5
    wd = torch.randn(E, INTER, H, generator=g) * INTER ** -0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    tw = torch.rand(T, K, generator=g)
    return x, idx, tw, wgu, wd, torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g)


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_variant_op_forward_and_grads_match_fp64_oracle(impl: str) -> None:
    x, idx, tw, wgu, wd, bgu, bd = _inputs()
    leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd, bgu, bd)]
    xl, twl, wgul, wdl, bgul, bdl = leaves
    out = ops.moe_experts(xl, idx, twl, wgul, wdl, 32, impl, "swiglu_clamped", 1.0, 1.702, bgul, bdl)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    o64 = [t.double().requires_grad_() for t in (x, tw, wgu, wd, bgu, bd)]
    want = torch_experts(o64[0], idx, *o64[1:], torch.float64, activation="swiglu_clamped", limit=1.0, alpha=1.702)
    want_grads = torch.autograd.grad(want.square().sum(), o64)
    assert_close(out, want.detach(), torch.float32)
    for name, a, b in zip(("x", "tw", "w_gate_up", "w_down", "b_gate_up", "b_down"), grads, want_grads):
        assert_close(a, b, torch.float32, msg=name)


def test_default_variant_calls_impls_without_variant_arguments() -> None:
    """A user impl written for Qwen3's experts (no variant parameters) keeps working; a variant reaches
    it as keyword arguments."""
    seen = []

    def plain(x, topk_idx, topk_weights, w_gate_up, w_down, block_size=128, **variant):
        seen.append(sorted(variant))
        return torch.zeros_like(x)

    register("moe_experts", "plain_user", plain)
    try:
        x, idx, tw, wgu, wd, bgu, bd = _inputs()
        ops.moe_experts(x, idx, tw, wgu, wd, 32, "plain_user")
        ops.moe_experts(x, idx, tw, wgu, wd, 32, "plain_user", "gelu_tanh")
        ops.moe_experts(x, idx, tw, wgu, wd, 32, "plain_user", "swiglu_clamped", 3.0, 1.0, bgu, None)
    finally:
        unregister("moe_experts", "plain_user")
    assert seen == [[], ["activation"], ["activation", "alpha", "b_gate_up", "limit"]]


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_variant_ops_opcheck(impl: str) -> None:
    x, idx, tw, wgu, wd, bgu, bd = _inputs()
    torch.library.opcheck(ops.moe_experts, (x, idx, tw, wgu, wd, 32, impl, "gelu_tanh", 7.0, 1.702, bgu, bd),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.moe_experts_bwd, (x, idx, tw, wgu, wd, torch.randn_like(x), 32, impl,
                                                "swiglu_clamped", 2.0, 1.5, None, bd),
                          test_utils=("test_schema", "test_faketensor"))
    grads = ops.moe_experts_bwd(x, idx, tw, wgu, wd, torch.randn_like(x), 32, impl, "silu", 7.0, 1.702, None, bd)
    assert grads[4].numel() == 0 and grads[5].shape == bd.shape  # absent bias: empty gradient


def test_selection_sees_the_variant_constraints() -> None:
    x, idx, tw, wgu, wd, bgu, bd = _inputs()
    sel = select("moe_experts", "nki", policy="fallback", x=x, topk_idx=idx, topk_weights=tw, w_gate_up=wgu,
                 w_down=wd, block_size=32, activation="relu", b_down=bd[:, :8])
    assert sel.fell_back
    text = "; ".join(str(v) for v in sel.reasons)
    assert "activation in ('silu', 'gelu_tanh', 'swiglu_clamped')" in text and "b_down.shape == (E, H)" in text
