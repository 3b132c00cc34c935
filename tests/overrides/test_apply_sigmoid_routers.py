"""apply_overrides on tiny transformers DeepSeek-V3 and GLM-4-MoE models: their sigmoid routers
(``TopkRouter``) and experts are swapped for trnkit's kernels, with parity of logits and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import hf_logits_and_grads
from tests.tolerances import assert_close
from trnkit.hf import apply_trnkit_to_deepseek_v3, apply_trnkit_to_glm4_moe, apply_trnkit_to_qwen3_moe, revert
from trnkit.overrides import OverrideConstraintError, apply_overrides


def _model(family: str, **overrides):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                  norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=16)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config as Config, DeepseekV3ForCausalLM as Model

        common.update(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    else:
        from transformers import Glm4MoeConfig as Config, Glm4MoeForCausalLM as Model

        common.update(head_dim=8)
    common.update(overrides)
    torch.manual_seed(0)
    model = Model(Config(**common))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # transformers initialises routers (and their bias) to zeros: make routing non-trivial
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


ENTRY_POINTS = {"deepseek_v3": apply_trnkit_to_deepseek_v3, "glm4_moe": apply_trnkit_to_glm4_moe}


@pytest.mark.parametrize("entry_point", [False, True], ids=["apply_overrides", "trnkit.hf"])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_router_and_experts_swapped_with_parity(family: str, entry_point: bool) -> None:
    model = _model(family)
    ref_out, ref_grads = hf_logits_and_grads(model)
    if entry_point:  # the family's own entry point: router and experts by default
        report = ENTRY_POINTS[family](model)
    else:
        report = apply_overrides(model, ops=["router_topk", "moe_experts"], policy="strict")
    try:
        rows = {(r.module, r.op): r.status for r in report.rows}
        for layer in (0, 1):
            assert rows[(f"model.layers.{layer}.mlp.gate", "router_topk")] == "swapped", report.table()
            assert rows[(f"model.layers.{layer}.mlp.experts", "moe_experts")] == "swapped", report.table()
        assert "swapped" in report.table()
        out, grads = hf_logits_and_grads(model)
    finally:
        revert(model)
    assert_close(out, ref_out, torch.float32)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], torch.float32, msg=name)


def test_group_limited_routing_is_refused_with_the_reason() -> None:
    model = _model("deepseek_v3", n_group=4, topk_group=2)
    with pytest.raises(OverrideConstraintError, match=r"n_group == 1 or topk_group == n_group.*"
                                                      r"group-limited routing"):
        apply_overrides(model, ops=["router_topk"], policy="strict")
    with pytest.warns(UserWarning, match="falls back to the original module code.*group-limited routing"):
        report = apply_overrides(model, ops=["router_topk"], policy="fallback")
    try:
        assert {r.status for r in report.rows if r.op == "router_topk"} == {"fallback"}
    finally:
        revert(model)
    # every group searched: the plain top-K, served by the kernel
    model = _model("glm4_moe", n_group=2, topk_group=2)
    report = apply_overrides(model, ops=["router_topk"], policy="strict")
    revert(model)
    assert {r.status for r in report.rows if r.op == "router_topk"} == {"swapped"}


def test_an_entry_point_refuses_another_family() -> None:
    model = _model("glm4_moe")
    with pytest.raises(ValueError, match=r"trnkit\.hf\.apply_trnkit_to_deepseek_v3: expects a transformers model of "
                                         r"type \['deepseek_v3'\], got Glm4MoeForCausalLM \(model_type 'glm4_moe'\); "
                                         r"use trnkit\.hf\.apply_trnkit_to_glm4_moe"):
        apply_trnkit_to_deepseek_v3(model)
    with pytest.raises(ValueError, match=r"use trnkit\.hf\.apply_trnkit_to_glm4_moe"):
        apply_trnkit_to_qwen3_moe(model)
    assert revert(model) == 0  # nothing was swapped
