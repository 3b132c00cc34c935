"""apply_overrides on a tiny transformers GPT-OSS model: its experts (``GptOssExperts``: interleaved
gate / up columns, biases, clamped SwiGLU) are swapped for trnkit's moe_experts; parity of the module
and of the whole model (logits and every parameter gradient) with the unswapped transformers code.

The router (``GptOssTopKRouter``) is not swapped: its logits carry a bias (``router.bias``) that
router_topk has no term for (the rest, top-K of the logits then softmax over the K, is softmax + top-K +
renormalisation)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TOKENS, hf_logits_and_grads
from tests.tolerances import assert_close
from trnkit.hf import apply_trnkit_to_gpt_oss, revert
from trnkit.overrides import OverrideConstraintError, apply_overrides
from trnkit.overrides.hf_modules import deinterleave, swapped

def _model(**overrides):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
               max_position_embeddings=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
               swiglu_limit=1.5)  # a small limit: the clamps bind on these O(1) activations
    cfg.update(overrides)
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**cfg))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # transformers initialises the router and every bias to zeros: make them count
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5))
    return model


@pytest.mark.parametrize("entry_point", [False, True], ids=["apply_overrides", "trnkit.hf"])
def test_gpt_oss_experts_swapped_with_model_parity(entry_point: bool) -> None:
    model = _model()
    ref_out, ref_grads = hf_logits_and_grads(model)
    if entry_point:  # the family's entry point: experts only
        report = apply_trnkit_to_gpt_oss(model)
    else:
        report = apply_overrides(model, ops=["router_topk", "moe_experts"], policy="strict")
    try:
        rows = {(r.module, r.op): r.status for r in report.rows}
        assert rows == {(f"model.layers.{i}.mlp.experts", "moe_experts"): "swapped" for i in (0, 1)}, report.table()
        assert swapped(model.model.layers[0].mlp.experts)
        out, grads = hf_logits_and_grads(model)
    finally:
        revert(model)
    assert_close(out, ref_out, torch.float32)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:  # the biases' and the router's gradients included
        assert_close(grads[name], ref_grads[name], torch.float32, msg=name)
    assert not swapped(model.model.layers[0].mlp.experts)


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_gpt_oss_experts_module_parity(impl: str) -> None:
    """The experts module alone, on routing where every expert and both clamps are hit."""
    model = _model()
    experts = model.model.layers[1].mlp.experts
    T = 20
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, 32, generator=g) * 2
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(T)])
    tw = torch.softmax(torch.randn(T, 2, generator=g), -1)
    go = torch.randn(T, 32, generator=g)

    def run():
        xl, twl = x.clone().requires_grad_(), tw.clone().requires_grad_()
        experts.zero_grad()
        out = model.model.layers[1].mlp.experts(xl, idx, twl)
        out.backward(go)
        return [out.detach(), xl.grad, twl.grad] + [p.grad.clone() for p in experts.parameters()]

    want = run()
    report = apply_overrides(model, ops=["moe_experts"], impl=impl, policy="strict", dry_run=False)
    try:
        assert {r.status for r in report.rows} == {"swapped"}
        got = run()
    finally:
        revert(model)
    names = ["out", "grad_x", "grad_topk_weights"] + [n for n, _ in experts.named_parameters()]
    for name, a, b in zip(names, got, want, strict=True):
        assert_close(a, b, torch.float32, msg=name)


def test_clamps_bind_in_the_parity_input() -> None:
    """The module-parity input reaches both clamps (else swiglu_clamped would be tested as plain SwiGLU)."""
    model = _model()
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(3)) * 2
    gu = torch.einsum("th,ehi->tei", x, experts.gate_up_proj.detach()) + experts.gate_up_proj_bias.detach()
    gate, up = gu[..., ::2], gu[..., 1::2]
    assert bool((gate > experts.limit).any()) and bool((up.abs() > experts.limit).any())
    assert bool((gate < experts.limit).any()) and bool((up.abs() < experts.limit).any())


def test_deinterleave_splits_gate_and_up() -> None:
    t = torch.arange(12.0).view(1, 2, 6)  # columns g0 u0 g1 u1 g2 u2
    assert deinterleave(t)[0, 0].tolist() == [0, 2, 4, 1, 3, 5]


def test_unsupported_gpt_oss_shape_is_refused_by_the_kernel_rule() -> None:
    """top-K 9 > the kernel's 8: strict names the rule, fallback keeps transformers' code."""
    model = _model(num_local_experts=10, num_experts_per_tok=9)
    with pytest.raises(OverrideConstraintError, match=r"1 <= K <= min\(8, E\)"):
        apply_overrides(model, ops=["moe_experts"], policy="strict")
    with pytest.warns(UserWarning, match="falls back"):
        report = apply_overrides(model, ops=["moe_experts"], policy="fallback")
    revert(model)
    assert {r.status for r in report.rows} == {"fallback"}


def test_experts_interface_leaves_gpt_oss_to_its_own_code() -> None:
    """register_hf_experts serves fused [gate; up] SiLU experts only: GPT-OSS selecting it by name falls
    back (warned, naming the rule) to transformers' code, with the same logits."""
    from trnkit.overrides import register_hf_experts

    model = _model()
    with torch.no_grad():
        ref = model(TOKENS).logits
        model.set_experts_implementation(register_hf_experts("trnkit_gpt_oss_test", policy="fallback"))
        with pytest.warns(UserWarning, match="no expert bias"):
            out = model(TOKENS).logits
    assert_close(out, ref, torch.float32)
