"""trnkit::mlp: the op (forward, autograd, fake, opcheck, torch.compile) and its swap into trnkit's native
Qwen3 dense layers and transformers' Qwen3MLP / Qwen3MoeMLP, against the plain-torch SwiGLU of
``nn.Linear`` projections (transformers' Qwen3MLP.forward written out)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.overrides.conftest import assert_swap_parity, hf_dense_model, hf_moe_model, native_model, spread_weights
from tests.tolerances import assert_close
from trnkit.overrides import (
    DEFAULT_OPS,
    OverrideConfig,
    OverrideConstraintError,
    apply_overrides,
    bind_kernels,
    ops,
    select,
)


def _swiglu(x, gate, up, down):
    """transformers' Qwen3MLP.forward: down_proj(silu(gate_proj(x)) * up_proj(x))."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _weights(H: int, I: int, dtype: torch.dtype, seed: int):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) / shape[1] ** 0.5).to(dtype).requires_grad_()
            for shape in ((I, H), (I, H), (H, I))]


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, inter", [((2, 5, 32), 48), ((1, 1, 8), 3), ((130, 24), 70)])
def test_op_forward_and_gradients_match_linear_swiglu(impl, dtype, shape, inter):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    gate, up, down = _weights(shape[-1], inter, dtype, sum(shape) + 1)
    dy = torch.randn(shape, generator=g).to(dtype)
    y = ops.mlp(x, torch.cat([gate, up]).T, down.T, impl)
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate, up, down)]
    want = _swiglu(*leaves)
    assert y.dtype == want.dtype and y.shape == want.shape
    got_g = torch.autograd.grad(y, (x, gate, up, down), dy)
    want_g = torch.autograd.grad(want, leaves, dy)
    if dtype == torch.float32:
        assert_close(y, want, dtype)
        for a, b in zip(got_g, want_g, strict=True):
            assert_close(a, b, dtype)
        return
    # bf16: torch rounds gate, up and silu(gate) to bf16 where the kernel keeps fp32: a few bf16 ulps of
    # the largest value (tests/kernels/mlp holds the kernel to the fp64-oracle rule)
    for a, b in zip((y, *got_g), (want, *want_g), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=4 * 2 ** -8 * float(b.detach().abs().max()))


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_opcheck(impl):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 16, generator=g, requires_grad=True)
    wgu, wd = torch.randn(16, 20, generator=g, requires_grad=True), torch.randn(10, 16, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.trnkit.mlp, (x, wgu, wd, impl))
    torch.library.opcheck(torch.ops.trnkit.mlp_bwd,
                          (x.detach(), wgu.detach(), wd.detach(), torch.randn(3, 4, 16), impl))


def test_compiles_fullgraph():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 32, generator=g, requires_grad=True)
    wgu, wd = torch.randn(32, 40, generator=g, requires_grad=True), torch.randn(20, 32, generator=g, requires_grad=True)
    fn = lambda a, b, c: ops.mlp(a, b, c, "nki")  # noqa: E731
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, wgu, wd)
    got.square().sum().backward()
    grads = [t.grad.clone() for t in (x, wgu, wd)]
    x.grad = wgu.grad = wd.grad = None
    want = fn(x, wgu, wd)
    want.square().sum().backward()
    assert torch.equal(got, want) and all(torch.equal(a, t.grad) for a, t in zip(grads, (x, wgu, wd), strict=True))


def test_native_dense_layer_swapped_matches_and_switches_back():
    model = native_model(init_std=0.2)
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = apply_overrides(model, OverrideConfig(ops=["mlp"], impl="nki", seq_len=8))
    assert [(r.module, r.op, r.status) for r in report.rows] == [("layers.1.feed_forward", "mlp", "swapped")]
    assert list(model.state_dict()) == keys
    assert_swap_parity(model, original)
    assert bind_kernels(model, {"mlp": None}) == 1
    assert type(model.layers[1].feed_forward) is type(original.layers[1].feed_forward)


def test_default_ops_leave_the_mlp_alone():
    assert "mlp" not in DEFAULT_OPS
    report = apply_overrides(native_model(), OverrideConfig(impl="reference", seq_len=8))
    assert report.rows and all(r.op != "mlp" for r in report.rows)


def test_transformers_dense_qwen3_mlp_swapped_match():
    model = spread_weights(hf_dense_model())
    original = copy.deepcopy(model)
    report = apply_overrides(model, OverrideConfig(ops=["mlp"], impl="nki", seq_len=8))
    assert {r.module for r in report.rows if r.status == "swapped"} == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert_swap_parity(model, original)


def test_transformers_qwen3_moe_dense_layer_swapped_match():
    model = hf_moe_model(mlp_only_layers=[1])
    original = copy.deepcopy(model)
    report = apply_overrides(model, OverrideConfig(ops=["mlp"], impl="nki", seq_len=8))
    assert [(r.module, r.status) for r in report.rows] == [("model.layers.1.mlp", "swapped")]
    assert_swap_parity(model, original)


def test_non_silu_activation_is_not_served():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    from trnkit.overrides.hf_modules import mlp_static

    rules = [v.constraint for v in mlp_static(Qwen3MLP(Qwen3Config(hidden_size=8, intermediate_size=4,
                                                                   hidden_act="gelu")))]
    assert rules == ["hidden_act == 'silu'"]


def test_too_large_for_sbuf_names_op_rule_and_value():
    x = torch.empty(2, 5120, dtype=torch.bfloat16)
    wgu, wd = torch.empty(5120, 51200, dtype=torch.bfloat16), torch.empty(25600, 5120, dtype=torch.bfloat16)
    with pytest.raises(OverrideConstraintError, match=r"mlp.*working set fits SBUF.*H=5120, I=25600"):
        select("mlp", "nki", policy="strict", x=x, w_gate_up=wgu, w_down=wd)
    sel = select("mlp", "nki", policy="fallback", x=x, w_gate_up=wgu, w_down=wd)
    assert sel.impl == "reference"
    assert select("mlp", "nki", x=x[:, :2560], w_gate_up=wgu[:2560, :19456], w_down=wd[:9728, :2560]).impl == "nki"
