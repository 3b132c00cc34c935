"""trnkit::attention: the op (forward, autograd, fake, opcheck, torch.compile) and its swap into trnkit's
native Qwen3 (``layers[i].attention.core``) and transformers' Qwen3 / Qwen3-MoE attention (its
``AttentionInterface``: ``attn_implementation="trnkit"`` and ``apply_overrides``), against plain
causal softmax attention (transformers' eager attention math) and the models' own outputs."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.overrides.conftest import _logits_and_grads, assert_swap_parity, hf_dense_model, hf_moe_model, native_model
from tests.tolerances import assert_close, check_oracle
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.hf import apply_trnkit_to_qwen3, revert
from trnkit.overrides import (
    DEFAULT_OPS,
    KernelChoice,
    OverrideConfig,
    OverrideConstraintError,
    apply_overrides,
    bind_kernels,
    ops,
    register,
    register_hf_attention,
    select,
    unregister,
)

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' eager attention (repeat_kv, softmax in fp32, causal mask), [B, S, H, D] in and out."""
    G = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(G, 1), v.transpose(1, 2).repeat_interleave(G, 1)
    S = q.shape[1]
    s = (qh @ kh.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
    return (p @ vh).transpose(1, 2)


def _qkv(B, S, Hq, Hk, D, dtype, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g).to(dtype).requires_grad_(grad) for h in (Hq, Hk, Hk)]


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 9, 4, 2, 16), (1, 1, 2, 1, 8), (1, 130, 8, 1, 32)])
def test_op_forward_and_gradients_match_eager_attention(impl, dtype, shape):
    q, k, v = _qkv(*shape, dtype)
    scale = shape[-1] ** -0.5
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    o, lse = ops.attention(q, k, v, scale, impl)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = _eager(q2, k2, v2, scale)
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == (shape[0], shape[2], shape[1])
    _close(o, want, dtype)
    got_g = torch.autograd.grad(o, (q, k, v), go)
    want_g = torch.autograd.grad(want, (q2, k2, v2), go)
    for a, b in zip(got_g, want_g, strict=True):
        _close(a, b, dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to each side's own rounding: eager rounds the normalised probabilities to bf16, the kernel
    the unnormalised ones (the fp64-oracle tests of tests/kernels/attention hold the accuracy), and the
    gradients sum over up to S keys / S * G queries: a tolerance at the scale of the largest value."""
    scale = max(b.float().abs().max().item(), 1.0)  # (dq = dk = 0 exactly for one key)
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=(2e-2 if dtype == torch.bfloat16 else 1e-5) * scale)


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_opcheck(impl):
    q, k, v = _qkv(1, 5, 2, 1, 8, torch.float32, seed=3)
    torch.library.opcheck(torch.ops.trnkit.attention, (q, k, v, 0.3, impl))
    o, lse = ops.attention(q, k, v, 0.3, impl)
    args = (q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), torch.randn(q.shape), 0.3, impl)
    torch.library.opcheck(torch.ops.trnkit.attention_bwd, args)


def test_compiles_fullgraph():
    q, k, v = _qkv(1, 8, 4, 2, 16, torch.float32, seed=4)
    fn = lambda a, b, c: ops.attention(a, b, c, 0.25, "nki")[0]  # noqa: E731
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    got.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = fn(q, k, v)
    want.square().sum().backward()
    assert torch.equal(got, want) and all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v), strict=True))


def test_native_model_attention_swapped_matches_and_switches_back():
    model = native_model(init_std=0.2)
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = apply_overrides(model, OverrideConfig(ops=["attention"], impl="nki", seq_len=8))
    assert {(r.module, r.op, r.status) for r in report.rows} == {(f"layers.{i}.attention.core", "attention", "swapped")
                                                                 for i in (0, 1)}
    assert list(model.state_dict()) == keys
    assert_swap_parity(model, original)
    assert bind_kernels(model, {"attention": None}) == 2
    assert type(model.layers[0].attention.core) is type(original.layers[0].attention.core)


def test_default_ops_leave_attention_alone():
    assert "attention" not in DEFAULT_OPS
    report = apply_overrides(native_model(), OverrideConfig(impl="reference", seq_len=8))
    assert report.rows and all(r.op != "attention" for r in report.rows)


def test_transformers_qwen3_moe_attention_swapped_matches_and_reverts():
    model = hf_moe_model()
    original = copy.deepcopy(model)
    report = apply_overrides(model, OverrideConfig(ops=["attention", "rope_hf"], impl="nki", seq_len=8))
    swapped = sorted((r.module, r.op) for r in report.rows if r.status == "swapped")
    assert swapped == sorted((f"model.layers.{i}.self_attn", op) for i in (0, 1) for op in ("attention", "rope_hf"))
    assert model.model.layers[0].self_attn.config._attn_implementation == "trnkit"
    assert model.config._attn_implementation == original.config._attn_implementation  # the model's own: untouched
    assert_swap_parity(model, original)
    revert(model)
    assert model.model.layers[0].self_attn.config is model.config


def test_transformers_dense_qwen3_attn_implementation_trnkit():
    """``attn_implementation="trnkit"`` (after register_hf_attention) runs every layer through the
    kernel: same logits and gradients as sdpa; a padding mask falls back to sdpa with a warning."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    assert register_hf_attention() == "trnkit"
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=16)
    torch.manual_seed(0)
    ref = Qwen3ForCausalLM(Qwen3Config(**cfg, attn_implementation="sdpa"))
    model = Qwen3ForCausalLM(Qwen3Config(**cfg, attn_implementation="trnkit"))
    model.load_state_dict(ref.state_dict())
    calls = []
    orig = ops.attention
    try:
        ops.attention = lambda *a, **kw: calls.append(a[-1]) or orig(*a, **kw)
        assert_swap_parity(model, ref)
    finally:
        ops.attention = orig
    assert calls == ["nki"] * 2
    mask = torch.ones(TOKENS.shape, dtype=torch.long)
    mask[0, :2] = 0  # left padding: a real mask, which the kernel does not take
    with pytest.warns(UserWarning, match="attention_mask is None"):
        got = model(TOKENS, attention_mask=mask).logits
    assert_close(got, ref(TOKENS, attention_mask=mask).logits, torch.float32)


@pytest.mark.parametrize("side", ["native", "transformers"])
def test_bf16_autocast_gives_the_kernel_what_sdpa_would_get(side):
    """Under bf16 autocast Qwen3's q and k leave their fp32-weighted head norms in fp32 while v is bf16; autocast
    casts all three to bf16 for scaled_dot_product_attention, and the swap point does the same before the
    kernel's one-dtype constraint (strict: a refusal would raise). Logits and gradients then match the unswapped
    model's under autocast by the fp64-oracle rule (the fp64 model the oracle)."""
    if side == "native":
        model = native_model(num_experts=0, mlp_only_layers=[], init_std=0.2)
        ops = ["attention", "rmsnorm", "rope_hf"]
    else:
        model = hf_dense_model()
        ops = ["attention", "rope_hf"]
    original, oracle = copy.deepcopy(model), copy.deepcopy(model).double()
    apply_overrides(model, OverrideConfig(ops=ops, impl="nki", policy="strict", seq_len=8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_logits, got = _logits_and_grads(model, TOKENS)
        want_logits, want = _logits_and_grads(original, TOKENS)
    exact_logits, exact = _logits_and_grads(oracle, TOKENS)
    assert got_logits.dtype == want_logits.dtype == torch.bfloat16
    check_oracle("bf16 logits", got_logits, want_logits, exact_logits)
    for name in exact:
        check_oracle(f"bf16 grad {name}", got[name], want[name], exact[name])


def test_unsupported_shapes_name_op_rule_and_value():
    q, k = torch.empty(1, 8, 2, 256), torch.empty(1, 8, 1, 256)
    with pytest.raises(OverrideConstraintError, match=r"attention.*D <= 128.*256"):
        select("attention", "nki", policy="strict", q=q, k=k, v=k, scale=0.1)
    sel = select("attention", "nki", policy="fallback", q=q, k=k, v=k, scale=0.1)
    assert sel.impl == "reference" and "D <= 128" in str(sel.reasons[0])


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_layout_mismatch_refused_by_the_op_and_its_fake(impl):
    """q / k / v that break the op's layout (Hq not a multiple of Hk, Hk = 0, k of another S, v of another shape)
    are refused before any impl runs, naming the op, the rule and the shapes, on real and meta tensors (the
    reference stopped in an einsum, a broadcast or a division by zero; the fake declared outputs for them)."""
    cases = [((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8), "'Hq % Hk == 0 with Hk >= 1' violated (got (3, 2)): query "
              "head h reads kv head h // (Hq / Hk)"),
             ((1, 4, 2, 8), (1, 4, 0, 8), (1, 4, 0, 8), "'Hq % Hk == 0 with Hk >= 1' violated (got (2, 0)): query "
              "head h reads kv head h // (Hq / Hk)"),
             ((1, 4, 2, 8), (1, 5, 1, 8), (1, 5, 1, 8), "'k and v are [B, S, Hk, D] with q's B, S and D' violated "
              "(got ((1, 5, 1, 8), (1, 5, 1, 8))): q: (1, 4, 2, 8)"),
             ((1, 4, 2, 8), (1, 4, 1, 8), (1, 4, 2, 8), "'k and v are [B, S, Hk, D] with q's B, S and D' violated "
              "(got ((1, 4, 1, 8), (1, 4, 2, 8))): q: (1, 4, 2, 8)")]
    for qs, ks, vs, rule in cases:
        for dev in ("cpu", "meta"):
            q, k, v = (torch.randn(s, device=dev) for s in (qs, ks, vs))
            with pytest.raises(KernelConstraintError) as e:
                ops.attention(q, k, v, 0.3, impl)
            assert str(e.value) == f"trnkit::attention: constraint {rule}"


def test_reference_serves_zero_query_rows():
    """S = 0 gives the empty outputs (the reference's row max stopped with 'amax(): Expected reduction dim -1 to
    have non-zero size'); B = 0 already did. Gradients are empty too."""
    for shape in [(1, 0, 4, 2, 8), (0, 3, 4, 2, 8)]:
        q, k, v = _qkv(*shape, torch.float32)
        o, lse = ops.attention(q, k, v, 0.3, "reference")
        assert o.shape == q.shape and lse.shape == (shape[0], shape[2], shape[1])
        assert torch.equal(o, _eager(q, k, v, 0.3))
        grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_rope_and_attention_of_one_module_are_validated_apart():
    """``rope_hf`` and ``attention`` swap the same transformers module (``self_attn``); the dry run keeps what
    each op saw apart. Under ``eager`` every attention call has a mask, so the attention falls back while the
    rope, which takes any mask, is swapped, a strict rope included (it was refused for the attention's mask)."""
    model = hf_dense_model(attn_implementation="eager")
    original = copy.deepcopy(model)
    report = apply_trnkit_to_qwen3(model, rope=KernelChoice("nki", "strict"), attention=True, policy="fallback",
                                   seq_len=8)
    rows = {(r.module, r.op): (r.status, r.reason) for r in report.rows}
    for i in (0, 1):
        assert rows[(f"model.layers.{i}.self_attn", "rope_hf")] == ("swapped", "")
        status, reason = rows[(f"model.layers.{i}.self_attn", "attention")]
        assert status == "fallback" and "attention_mask is None" in reason
    assert_swap_parity(model, original)


def test_a_bidirectional_model_selecting_trnkit_gets_its_own_attention():
    """An encoder (BERT: ``is_causal`` False) selecting ``attn_implementation="trnkit"`` is served by sdpa, not
    by the causal kernel (which gave it causal attention, max |difference| 0.03 here); strict names the rule."""
    from transformers import BertConfig, BertModel

    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48)
    torch.manual_seed(0)
    ref = BertModel(BertConfig(**cfg, attn_implementation="sdpa")).eval()
    for policy in ("fallback", "strict"):
        model = BertModel(BertConfig(**cfg, attn_implementation=register_hf_attention(f"trnkit_{policy}",
                                                                                      policy=policy))).eval()
        model.load_state_dict(ref.state_dict())
        if policy == "strict":
            with pytest.raises(OverrideConstraintError, match=r"constraint 'is_causal' violated \(got False"):
                model(TOKENS)
            continue
        with pytest.warns(UserWarning, match="'is_causal' violated"):
            got = model(TOKENS).last_hidden_state
        assert_close(got, ref(TOKENS).last_hidden_state, torch.float32)


def test_a_kv_cache_decoding_step_is_not_handed_to_the_op():
    """``generate()``'s decoding steps call the attention with one query and the cached keys: not the op's
    contract (q, k and v of one length). A user's impl faithful to it (sdpa, causal, top-left aligned) gave
    the wrong step logits (max |difference| 2.9 here); the step now falls back to sdpa (or strict names the rule)."""
    from transformers import DynamicCache

    def sdpa_impl(q, k, v, scale):
        g = q.shape[2] // k.shape[2]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1),
            is_causal=True, scale=scale)
        return o.transpose(1, 2), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    register("attention", "sdpa_test", sdpa_impl, has_backward=False)
    try:
        original = hf_dense_model().requires_grad_(False)
        prompt, step = TOKENS[:, :6], TOKENS[:, 6:7]
        for policy in ("fallback", "strict"):
            model = copy.deepcopy(original)
            apply_trnkit_to_qwen3(model, rope=False, attention="sdpa_test", policy=policy, seq_len=8)
            caches = [DynamicCache(config=original.config) for _ in range(2)]
            assert_close(model(prompt, cache=caches[0]).logits, original(prompt, cache=caches[1]).logits,
                         torch.float32)
            if policy == "strict":
                with pytest.raises(OverrideConstraintError, match=r"one length .*'query': 1, 'key': 7"):
                    model(step, cache=caches[0])
                continue
            with pytest.warns(UserWarning, match="query and key of one length"):
                got = model(step, cache=caches[0]).logits
            assert_close(got, original(step, cache=caches[1]).logits, torch.float32)
    finally:
        unregister("attention", "sdpa_test")


def test_registering_the_attention_name_again_reaches_the_modules_that_already_ran():
    """As for the experts: a padding mask falls back under ``fallback``; the same name registered again with
    ``strict`` raises for the same model (its modules kept their first guard)."""
    from transformers import Qwen3ForCausalLM

    name = register_hf_attention("trnkit_again", policy="fallback")
    original = hf_dense_model()
    model = Qwen3ForCausalLM(original.config)
    model.load_state_dict(original.state_dict())
    model.set_attn_implementation(name)
    mask = torch.ones(TOKENS.shape, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.warns(UserWarning, match="attention_mask is None"):
        model(TOKENS, attention_mask=mask)
    register_hf_attention(name, policy="strict")
    with pytest.raises(OverrideConstraintError, match=r"attention\[nki\].*attention_mask is None"):
        model(TOKENS, attention_mask=mask)


def test_applying_the_attention_to_a_model_that_selected_trnkit_falls_back_to_sdpa():
    """A model built with ``attn_implementation="trnkit"`` and then given ``apply_trnkit_to_qwen3(attention=True)``:
    the swap's fallback was the module's own implementation, "trnkit", i.e. itself (RecursionError on a padded
    batch); it is sdpa now, and the padded batch matches transformers'."""
    from transformers import Qwen3ForCausalLM

    original = hf_dense_model()
    model = Qwen3ForCausalLM(original.config)
    model.load_state_dict(original.state_dict())
    model.set_attn_implementation(register_hf_attention())
    apply_trnkit_to_qwen3(model, attention=True, policy="fallback", seq_len=8)
    mask = torch.ones(TOKENS.shape, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.warns(UserWarning, match="attention_mask is None"):
        got = model(TOKENS, attention_mask=mask).logits
    assert_close(got, original(TOKENS, attention_mask=mask).logits, torch.float32)
    assert_swap_parity(model, original)


def test_attention_terms_the_kernel_lacks_are_not_dropped():
    """Calls whose math the kernel does not have were served without it: GPT-OSS's attention sinks (``s_aux``;
    logits off by 0.10 under strict), a logit ``softcap``, a ``position_bias``, and ``output_attentions=True``
    (no weights, no word). Sinks now raise (sdpa, the fallback, ignores them too); the others are violations."""
    from transformers import GptOssConfig, GptOssForCausalLM

    strict = register_hf_attention("trnkit_terms", policy="strict")
    cfg = GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, layer_types=["full_attention"], attn_implementation=strict)
    with pytest.raises(ValueError, match=r"GptOssAttention passes attention sinks \(s_aux\)"):
        GptOssForCausalLM(cfg).eval()(TOKENS[:1])
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module = hf_dense_model().model.layers[0].self_attn
    q, k, v = (torch.randn(1, h, 8, 16) for h in (4, 2, 2))
    bias = torch.zeros(1, 4, 8, 8)
    for kwargs, rule in [({"softcap": 30.0}, r"softcap is None' violated \(got 30.0\)"),
                         ({"position_bias": bias}, r"position_bias is None' violated \(got 'a \(1, 4, 8, 8\) tensor'"),
                         ({"output_attentions": True}, r"output_attentions is False' violated \(got True\)")]:
        with pytest.raises(OverrideConstraintError, match=rule):
            ALL_ATTENTION_FUNCTIONS[strict](module, q, k, v, None, scaling=0.25, **kwargs)


def test_attention_dropout_is_refused_when_applied_not_at_the_first_training_call():
    """A transformers model with ``attention_dropout > 0`` passed a strict ``apply_overrides`` (the dry run runs in
    eval mode, without dropout) and was refused only at its first training call; now the module's configuration
    is checked when the swap is applied: strict raises there naming the op, the modules, the rule and the value
    and leaves the model unswapped; fallback reports the modules as fallback and their calls (training ones drop
    out) run transformers' own attention."""
    model = hf_dense_model(attention_dropout=0.1)
    with pytest.raises(OverrideConstraintError, match=r"attention\[reference\] at model\.layers\.0\.self_attn, "
                       r"model\.layers\.1\.self_attn .*'attention_dropout == 0' violated \(got 0\.1\)"):
        apply_overrides(model, OverrideConfig(ops=["attention"], impl="reference", seq_len=8))
    assert model.model.layers[0].self_attn.config is model.config  # nothing swapped

    original = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"attention\[reference\] falls back .*attention_dropout == 0"):
        report = apply_overrides(model, OverrideConfig(ops=["attention"], impl="reference", seq_len=8,
                                                       policy="fallback"))
    assert [(r.module, r.status) for r in report.rows] == [(f"model.layers.{i}.self_attn", "fallback") for i in (0, 1)]
    assert "attention_dropout == 0' violated (got 0.1)" in report.rows[0].reason
    calls = []
    orig = ops.attention
    try:
        ops.attention = lambda *a, **kw: calls.append(a[-1]) or orig(*a, **kw)
        for mode in (model.train, model.eval):
            mode(), original.train(model.training)
            torch.manual_seed(1)
            got = model(TOKENS).logits
            torch.manual_seed(1)
            assert torch.equal(got, original(TOKENS).logits)  # the same dropout masks in training mode
    finally:
        ops.attention = orig
    assert calls == []


def test_attention_dropout_set_to_zero_serves_an_eval_only_model():
    """Eval never drops: a model used for evaluation only gets the kernel once its modules' attention_dropout is 0
    (the documented way), with the logits of the model as it was."""
    model = hf_dense_model(attention_dropout=0.1).eval()
    original = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    report = apply_overrides(model, OverrideConfig(ops=["attention"], impl="reference", seq_len=8))
    assert {r.status for r in report.rows} == {"swapped"}
    with torch.no_grad():
        assert_close(model(TOKENS).logits, original(TOKENS).logits, torch.float32)
