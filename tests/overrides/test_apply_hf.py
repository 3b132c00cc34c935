"""apply_overrides on transformers v5 Qwen3-MoE / Qwen3: parity, scoping of the rotary swap, revert."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.overrides.conftest import hf_dense_model, hf_moe_model
from tests.tolerances import assert_close
from trnkit.hf import revert
from trnkit.overrides import OverrideConfig, OverrideConstraintError, apply_overrides
from trnkit.overrides.hf_modules import swapped

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _logits_and_grads(model, ids=IDS):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_qwen3_moe_swap_matches_transformers():
    model = hf_moe_model()
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))
    assert [(r.module, r.op, r.status) for r in report.rows] == [
        (f"model.layers.{i}.{p}", op, "swapped") for i in (0, 1)
        for p, op in (("self_attn", "rope_hf"), ("mlp.experts", "moe_experts"), ("mlp.gate", "router_topk"))]
    assert list(model.state_dict()) == keys
    assert isinstance(model.model.layers[0].mlp.experts, modeling_qwen3_moe.Qwen3MoeExperts)  # subclass
    assert swapped(model.model.layers[0].mlp.gate)
    assert type(model.model.layers[0].mlp.gate) is modeling_qwen3_moe.Qwen3MoeTopKRouter  # its class: unchanged

    got_logits, got_grads = _logits_and_grads(model)
    want_logits, want_grads = _logits_and_grads(original)
    assert_close(got_logits, want_logits)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], msg=name)

    revert(model)
    attn = model.model.layers[0].self_attn
    assert "forward" not in attn.__dict__ and not swapped(model.model.layers[0].mlp.gate)
    assert_close(model(input_ids=IDS).logits.detach(), want_logits)


def test_apply_twice_is_an_error_until_reverted():
    model = hf_moe_model()
    apply_overrides(model, OverrideConfig(impl="reference", seq_len=8))
    with pytest.raises(RuntimeError, match=r"already applied.*trnkit\.hf\.revert"):
        apply_overrides(model, OverrideConfig(impl="reference"))
    assert revert(model) == 6
    apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="reference", seq_len=8))


def test_rotary_swap_is_scoped_to_the_model():
    """transformers' module-level apply_rotary_pos_emb is untouched; only this model's attention
    modules call trnkit's version."""
    model, bystander = hf_moe_model(), hf_moe_model()
    global_fn = modeling_qwen3_moe.apply_rotary_pos_emb
    calls = []
    from trnkit.overrides import ops

    real = ops.rope_hf_apply
    try:
        ops.rope_hf_apply = lambda *a, **kw: calls.append(a[-1]) or real(*a, **kw)  # count trnkit rope calls
        apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="reference", seq_len=8))
        calls.clear()
        assert modeling_qwen3_moe.apply_rotary_pos_emb is global_fn
        bystander(input_ids=IDS)
        assert calls == []
        model(input_ids=IDS)
        assert calls == ["reference", "reference"]  # one per layer
    finally:
        ops.rope_hf_apply = real


def test_rope_swap_with_a_kv_cache_matches_transformers():
    """Decoding with transformers' cache: the swapped attention forward updates the cache as theirs does."""
    model = hf_moe_model()
    original = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="nki", seq_len=8))
    with torch.no_grad():
        got = model.generate(IDS[:, :5], max_new_tokens=3, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        want = original.generate(IDS[:, :5], max_new_tokens=3, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits, strict=True):
        assert_close(g, w)


def test_dense_qwen3_rope_swap():
    model = hf_dense_model()
    original = copy.deepcopy(model)
    report = apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))  # only rope exists here
    assert [(r.op, r.status) for r in report.rows] == [("rope_hf", "swapped")] * 2
    got, want = _logits_and_grads(model), _logits_and_grads(original)
    assert_close(got[0], want[0])
    for name in want[1]:
        assert_close(got[1][name], want[1][name], msg=name)


def test_hf_experts_with_another_activation_are_rejected_from_the_config():
    model = hf_moe_model(hidden_act="gelu")
    with pytest.raises(OverrideConstraintError, match=r"hidden_act == 'silu'.*got 'gelu'"):
        apply_overrides(model, OverrideConfig(ops=["moe_experts"], impl="reference", seq_len=8))
    with pytest.warns(UserWarning, match="falls back"):
        report = apply_overrides(model, OverrideConfig(ops=["moe_experts"], impl="reference",
                                                       policy="fallback", seq_len=8))
    assert {r.status for r in report.rows} == {"fallback"}


def test_top_k_9_under_each_policy():
    """K = 9 exceeds the router's hardware max8 and the experts kernel's K limit."""
    model = hf_moe_model(num_experts=10, num_experts_per_tok=9)
    with pytest.raises(OverrideConstraintError) as err:
        apply_overrides(model, OverrideConfig(impl="nki", policy="strict", seq_len=8))
    assert "'1 <= top_k <= 8' violated (got 9)" in str(err.value)
    assert "model.layers.0.mlp.gate" in str(err.value)
    assert not any(swapped(m) for m in model.modules())

    original = copy.deepcopy(model)
    with pytest.warns(UserWarning) as caught:
        report = apply_overrides(model, OverrideConfig(impl="nki", policy="fallback", seq_len=8))
        logits = model(input_ids=IDS).logits
        model(input_ids=IDS)
    ours = [str(w.message) for w in caught if "trnkit override" in str(w.message)]
    assert len(ours) == 2  # one per distinct reason (router, experts), not per layer or call
    assert any("router_topk[nki]" in m and "top_k <= 8" in m for m in ours)
    assert any("moe_experts[nki]" in m and "K <= min(8, E)" in m for m in ours)
    status = {(r.module.split(".", 3)[-1], r.status) for r in report.rows}
    assert status == {("self_attn", "swapped"), ("mlp.gate", "fallback"), ("mlp.experts", "fallback")}
    assert torch.equal(logits, original(input_ids=IDS).logits)

    report = apply_overrides(copy.deepcopy(original), OverrideConfig(impl="nki", policy="off"))
    assert {r.status for r in report.rows} == {"off"}


def test_per_sequence_positions_use_batched_cos_sin():
    """position_ids differing per sequence give cos/sin [B, S, D]; the kernel reads them per batch."""
    model = hf_moe_model()
    original = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="nki", seq_len=8))
    positions = torch.stack([torch.arange(8), torch.arange(8) + 5])
    got = model(input_ids=IDS, position_ids=positions).logits
    assert_close(got.detach(), original(input_ids=IDS, position_ids=positions).logits.detach())


def test_router_logits_still_feed_transformers_aux_loss():
    """transformers records router logits from every *TopKRouter instance (the swapped one too)."""
    model = hf_moe_model(output_router_logits=True, router_aux_loss_coef=0.01)
    original = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))
    got, want = model(input_ids=IDS, labels=IDS), original(input_ids=IDS, labels=IDS)
    assert_close(got.aux_loss.detach(), want.aux_loss.detach())
    assert_close(got.loss.detach(), want.loss.detach())
    got.loss.backward()
    want.loss.backward()
    gate, gate0 = model.model.layers[0].mlp.gate.weight, original.model.layers[0].mlp.gate.weight
    assert_close(gate.grad, gate0.grad)


def test_the_dry_run_leaves_nothing_of_its_own_in_the_model():
    """transformers' longrope rotary embedding caches ``long_inv_freq`` in its first forward: the dry run's was
    a FakeTensor left on the module, so sequences past ``original_max_position_embeddings`` got the short
    factors (logits off by 2.9 here), after ``revert`` too. The dry run now restores every module's attributes,
    parameters and buffers: logits and every gradient match transformers' on 12 tokens (> 8)."""
    from tests.overrides.conftest import assert_swap_parity, spread_weights

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 8}
    original = spread_weights(hf_dense_model(rope_parameters=rope, max_position_embeddings=16))
    model = copy.deepcopy(original)
    apply_overrides(model, OverrideConfig(ops=["rmsnorm"], impl="nki", seq_len=12))
    fake = torch._subclasses.fake_tensor.FakeTensor
    assert not [(p, n) for p, m in model.named_modules() for n, v in vars(m).items() if isinstance(v, fake)]
    assert "long_inv_freq" not in vars(model.model.rotary_emb)
    assert_swap_parity(model, original, torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0)))


def test_after_the_dry_run_transformers_records_each_router_once():
    """The dry run is the model's first forward, where transformers installs its output-capturing hooks and sets
    the flag saying so; restoring every attribute after it (once) dropped the flag and kept the hooks, so the
    next forward installed them again and ``router_logits`` held each layer twice. Restoring only the tensors it
    cached keeps both: one entry per layer, each equal to transformers'."""
    original = hf_moe_model(output_router_logits=True)
    model = copy.deepcopy(original)
    apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))
    got, want = model(input_ids=IDS), original(input_ids=IDS)
    assert len(got.router_logits) == len(want.router_logits) == 2
    for a, b in zip(got.router_logits, want.router_logits, strict=True):
        assert_close(a, b, torch.float32)
    assert_close(got.aux_loss, want.aux_loss, torch.float32)


def test_a_dynamic_rope_model_passes_the_dry_run():
    """transformers' dynamic-NTK rotary embedding compares a value of ``position_ids`` before it computes
    cos / sin, which a fake-tensor dry run cannot read: applying failed ('DataDependentOutputException ...
    Pass OverrideConfig(dry_run=False)'). The dry run now runs it without that update (same shapes), and
    leaves its forward alone after: logits and every gradient match transformers' past the grown length."""
    from tests.overrides.conftest import assert_swap_parity, spread_weights
    from trnkit.hf import apply_trnkit_to_qwen3

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    original = spread_weights(hf_dense_model(rope_parameters=rope, max_position_embeddings=16))
    model = copy.deepcopy(original)
    report = apply_trnkit_to_qwen3(model, rmsnorm=True, mlp=True, attention=True, seq_len=32)
    assert {r.status for r in report.rows} == {"swapped"}
    assert "forward" not in vars(model.model.rotary_emb)
    assert_swap_parity(model, original, torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("compute", ["bf16 autocast", "bf16 weights"])
def test_router_in_bf16_routes_as_transformers_near_ties_included(compute):
    """transformers' Qwen3-MoE router computes its logits with ``F.linear`` in the compute dtype (bf16 under bf16
    autocast or with bf16 weights), softmax in fp32 from those rounded logits, top-K, and returns logits and
    weights in bf16. The swapped router routed from fp32 logits (fp32 operands under autocast; fp32 logits
    from bf16 operands with bf16 weights) and returned fp32 under autocast: other weights, and near-ties at bf16
    resolution chose other experts. Here expert 1's router row is expert 0's times 1 + 2^-10, so their logits
    are equal in bf16 for most tokens; the swapped router returns transformers' logits, weights and indices
    exactly, and the gradients match."""
    model = hf_moe_model()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[1] = layer.mlp.gate.weight[0] * (1 + 2 ** -10)
    if compute == "bf16 weights":
        model = model.to(torch.bfloat16)
    original = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["router_topk"], impl="nki", seq_len=8))

    def captured(m):
        outs = []
        for layer in m.model.layers:
            layer.mlp.gate.register_forward_hook(lambda mod, args, out: outs.append((mod, args[0], out)))
        return outs

    got, want = captured(model), captured(original)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == "bf16 autocast"):
        got_logits, got_grads = _logits_and_grads(model)
        want_logits, want_grads = _logits_and_grads(original)
    assert_close(got_logits, want_logits, torch.bfloat16)
    fp32_selection_differs = 0
    for (_, _, g), (gate, x, w) in zip(got, want, strict=True):
        assert [t.dtype for t in g] == [t.dtype for t in w] == [torch.bfloat16, torch.bfloat16, torch.int64]
        assert torch.equal(g[2], w[2]) and torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
        # the case is a near-tie: choosing from the fp32 logits of the same bf16 operands picks otherwise
        exact = x.to(torch.bfloat16).float() @ gate.weight.to(torch.bfloat16).float().T
        idx = torch.sort(exact, dim=-1, descending=True, stable=True).indices[:, :gate.top_k]
        fp32_selection_differs += int((idx != w[2]).any(1).sum())
    assert fp32_selection_differs > 0
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], torch.bfloat16, msg=name)
