"""trnkit.hf's per-family entry points on tiny transformers v5 Qwen3 / Qwen3-MoE: parity, per-op choices,
the family check, revert."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.overrides.conftest import assert_swap_parity, hf_dense_model, hf_moe_model, spread_weights
from trnkit.hf import apply_trnkit_to_qwen3, apply_trnkit_to_qwen3_moe, revert
from trnkit.overrides.hf_modules import swapped
from trnkit.overrides import KernelChoice, OverrideConstraintError

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def test_qwen3_moe_entry_point_swaps_the_named_ops_with_their_own_choices():
    model = hf_moe_model()
    original = copy.deepcopy(model)
    report = apply_trnkit_to_qwen3_moe(model, router=KernelChoice("reference"), seq_len=8)
    assert [(r.module, r.op, r.impl, r.status) for r in report.rows] == [
        (f"model.layers.{i}.{p}", op, impl, "swapped") for i in (0, 1)
        for p, op, impl in (("self_attn", "rope_hf", "nki"), ("mlp.experts", "moe_experts", "nki"),
                            ("mlp.gate", "router_topk", "reference"))]
    assert_swap_parity(model, original, IDS)
    assert revert(model) == 6
    assert not any(swapped(m) for m in model.modules())
    assert "forward" not in model.model.layers[0].self_attn.__dict__


def test_qwen3_moe_entry_point_leaves_ops_set_to_false_alone():
    model = hf_moe_model()
    report = apply_trnkit_to_qwen3_moe(model, rope=False, experts=False, impl="reference", seq_len=8)
    assert {(r.op, r.impl) for r in report.rows} == {("router_topk", "reference")}
    assert len(report.rows) == 2


def test_qwen3_dense_entry_point_matches_transformers():
    model = spread_weights(hf_dense_model())
    original = copy.deepcopy(model)
    report = apply_trnkit_to_qwen3(model, rmsnorm="reference", seq_len=8)
    ops = sorted({(r.op, r.impl, r.status) for r in report.rows})
    assert ops == [("rmsnorm", "reference", "swapped"), ("rope_hf", "nki", "swapped")]
    assert sum(r.op == "rmsnorm" for r in report.rows) == 2 * 4 + 1  # 4 norms per layer + the final norm
    assert_swap_parity(model, original, IDS)


def test_an_entry_point_refuses_another_family():
    with pytest.raises(ValueError, match=r"apply_trnkit_to_qwen3: expects a transformers model of type \['qwen3'\], "
                                         r"got Qwen3MoeForCausalLM \(model_type 'qwen3_moe'\); use "
                                         r"trnkit.hf.apply_trnkit_to_qwen3_moe"):
        apply_trnkit_to_qwen3(hf_moe_model())
    with pytest.raises(ValueError, match=r"model_type None"):
        apply_trnkit_to_qwen3_moe(torch.nn.Linear(2, 2))


def test_an_op_argument_of_another_type_is_named_by_its_keyword():
    with pytest.raises(TypeError, match=r"^trnkit\.hf\.apply_trnkit_to_qwen3_moe: router expects True / False, an impl "
                                        r"name or a KernelChoice, got dict \{'impl': 'nki'\}$"):
        apply_trnkit_to_qwen3_moe(hf_moe_model(), router={"impl": "nki"}, seq_len=8)
    with pytest.raises(TypeError, match=r"^trnkit\.hf\.apply_trnkit_to_qwen3: rmsnorm expects .*, got int 1$"):
        apply_trnkit_to_qwen3(hf_dense_model(), rmsnorm=1, seq_len=8)


def test_a_strict_choice_raises_and_leaves_the_model_unchanged():
    model = hf_moe_model(num_experts_per_tok=9, num_experts=12)  # the router kernel's top-K is one max8
    with pytest.raises(OverrideConstraintError, match=r"router_topk: constraint '1 <= top_k <= 8' violated \(got 9\)"):
        apply_trnkit_to_qwen3_moe(model, rope=False, experts=KernelChoice("reference", "fallback"), seq_len=8)
    assert not any(swapped(m) for m in model.modules())


def test_a_strict_refusal_of_several_ops_names_each_ops_own_modules_and_rules():
    """fp16 (no kernel takes it) under strict: the error is the first refused op's, at its own modules, with its
    own rules, and its message goes on with each other refused op, its modules and rules (it was 'rope_hf[nki]'
    at every refused module of every op, self_attn twice, then the rules of all five kernels in one list)."""
    model = hf_moe_model().half()
    with pytest.raises(OverrideConstraintError) as info:
        apply_trnkit_to_qwen3_moe(model, rmsnorm=True, attention=True, seq_len=8)
    assert info.value.op == "rope_hf" and info.value.where == "model.layers.0.self_attn, model.layers.1.self_attn"
    assert {v.kernel for v in info.value.violations} == {"rope_hf_bshd"}
    message = str(info.value)
    assert message.startswith("trnkit override rope_hf[nki] at model.layers.0.self_attn, model.layers.1.self_attn "
                              "cannot serve these inputs (policy 'strict'): rope_hf_bshd: constraint 'q.dtype in "
                              "('float32', 'bfloat16')' violated (got 'float16')")
    assert ". Also refused under strict: attention[nki] at model.layers.0.self_attn, model.layers.1.self_attn: " \
           "attention: constraint 'q.dtype in ('float32', 'bfloat16')' violated (got 'float16')." in message
    assert ". Also refused under strict: router_topk[nki] at model.layers.0.mlp.gate, model.layers.1.mlp.gate: " \
           "router_topk: constraint 'x.dtype in ('float32', 'bfloat16')' violated (got 'float16')" in message
    assert not any(swapped(m) for m in model.modules())


def test_a_swapped_model_saved_whole_loads_back_swapped_and_revertible():
    """``torch.save(model)`` of a swapped model (every op of the entry point) loads with ``torch.load``: the
    swapped forwards were bound methods, which pickle as ``getattr(module, '_rmsnorm_forward')`` and made the
    load fail (AttributeError); the loaded model matches transformers' logits and gradients, and reverts."""
    import io

    original = hf_moe_model(mlp_only_layers=[1])
    model = copy.deepcopy(original)
    n = len(apply_trnkit_to_qwen3_moe(model, rmsnorm=True, mlp=True, attention=True, seq_len=8).rows)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert swapped(loaded.model.norm) and swapped(loaded.model.layers[1].mlp)
    assert_swap_parity(loaded, original)
    assert revert(loaded) == n and not any(swapped(m) for m in loaded.modules())
    assert torch.equal(loaded(IDS).logits, original(IDS).logits)


def test_a_refusal_at_the_default_dry_run_length_says_where_that_length_came_from():
    """seq_len unset: the dry run runs the config's max_position_embeddings (20,000 here, past the fp32 attention
    kernel's 16,384), which the refusal printed as 'got 20000' with no word of where 20,000 came from; the error
    and the report now end with a note naming it and seq_len. Given seq_len, no note."""
    model = hf_dense_model(max_position_embeddings=20000)
    note = ("the validation dry run ran tokens [1, 20000] (seq_len unset: the model config's max_position_embeddings); "
            "pass seq_len, the length the model will run, to validate that (calls are checked again at their own "
            "shapes)")
    with pytest.raises(OverrideConstraintError) as info:
        apply_trnkit_to_qwen3(model, attention=True)
    assert str(info.value).endswith("violated (got 20000): one kv head's K and V stay resident in SBUF. Note: " + note)
    report = apply_trnkit_to_qwen3(model, attention=True, policy="fallback")
    assert report.notes == [note] and report.table().endswith("\n  " + note)
    revert(model)
    assert apply_trnkit_to_qwen3(model, attention=True, seq_len=8).notes == []
