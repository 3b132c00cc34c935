"""trnkit::rmsnorm_qk (the q and k head norms in one call): the op (forward, autograd, fake, opcheck,
torch.compile) bit-identical to two trnkit::rmsnorm calls, and its use in trnkit's native Qwen3 and in
transformers' Qwen3 / Qwen3-MoE when both head norms are swapped in: every logit and gradient equal to the
same model running the two norms as two calls."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.overrides.conftest import assert_swap_parity, hf_dense_model, hf_moe_model, native_model
from trnkit.overrides import OverrideConfig, OverrideConstraintError, apply_overrides, bind_kernels, ops, select
from trnkit.overrides import guard as guard_mod


def _pair_inputs(dtype, seed=0, T=5, hq=4, hk=2, D=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, T, hq, D, generator=g).to(dtype).requires_grad_()
    k = (3 * torch.randn(2, T, hk, D, generator=g)).to(dtype).requires_grad_()
    wq = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).requires_grad_()
    wk = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).requires_grad_()
    return q, k, wq, wk


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_two_rmsnorm_calls_forward_and_gradients(impl, dtype):
    q, k, wq, wk = _pair_inputs(dtype)
    yq, yk, rq, rk = ops.rmsnorm_qk(q, k, wq, wk, 1e-6, impl)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, wq, wk)]
    sq, srq = ops.rmsnorm(leaves[0], leaves[2], 1e-6, impl)
    sk, srk = ops.rmsnorm(leaves[1], leaves[3], 1e-6, impl)
    for a, b in zip((yq, yk, rq, rk), (sq, sk, srq, srk)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    g = torch.Generator().manual_seed(9)
    dq, dk = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)
    got = torch.autograd.grad((yq, yk), (q, k, wq, wk), (dq, dk))
    want = torch.autograd.grad((sq, sk), leaves, (dq, dk))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # k's output unused: its gradient is zero, q's as before
    yq2, _, _, _ = ops.rmsnorm_qk(q, k, wq, wk, 1e-6, impl)
    gq, gk = torch.autograd.grad(yq2, (q, k), dq)
    assert torch.equal(gq, want[0]) and not gk.any()


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_opcheck(impl):
    q, k, wq, wk = _pair_inputs(torch.float32, seed=3, T=3, hq=2, hk=1)
    torch.library.opcheck(torch.ops.trnkit.rmsnorm_qk, (q, k, wq, wk, 1e-5, impl))
    g = torch.Generator().manual_seed(4)
    rq, rk = torch.rand(12, generator=g) + 0.5, torch.rand(6, generator=g) + 0.5
    torch.library.opcheck(torch.ops.trnkit.rmsnorm_qk_bwd,
                          (q.detach(), k.detach(), wq.detach(), wk.detach(), rq, rk, torch.randn(q.shape),
                           torch.randn(k.shape), 1e-5, impl))


def test_compiles_fullgraph():
    q, k, wq, wk = _pair_inputs(torch.float32, seed=5)

    def fn(a, b, c, d):
        ya, yb, _, _ = ops.rmsnorm_qk(a, b, c, d, 1e-6, "nki")
        return ya.square().sum() + yb.sum()

    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, wq, wk)
    got_grads = torch.autograd.grad(got, (q, k, wq, wk))
    want = fn(q, k, wq, wk)
    want_grads = torch.autograd.grad(want, (q, k, wq, wk))
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


def _pair_calls(monkeypatch) -> list:
    """Count trnkit::rmsnorm_qk calls made through ``ops``."""
    calls = []
    real = ops.rmsnorm_qk

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "rmsnorm_qk", counted)
    return calls


def _logits_and_grads(model, tokens):
    model.zero_grad()
    out = model(tokens)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_bit_identical_to_two_calls(model, monkeypatch):
    """The model's logits and gradients with the pair equal, bit for bit, those with the pair turned off."""
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    calls = _pair_calls(monkeypatch)
    logits, grads = _logits_and_grads(model, tokens)
    assert len(calls) == 2  # one per layer
    monkeypatch.setattr(guard_mod, "head_norm_pair", lambda *a, **k: None)
    logits2, grads2 = _logits_and_grads(model, tokens)
    assert len(calls) == 2
    assert torch.equal(logits, logits2) and grads.keys() == grads2.keys()
    assert all(torch.equal(grads[n], grads2[n]) for n in grads), [n for n in grads if not torch.equal(grads[n],
                                                                                                      grads2[n])]


def test_native_model_runs_the_pair_bit_identical_to_two_calls(monkeypatch):
    model = native_model(init_std=0.2)
    with torch.no_grad():
        for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
            layer.attention.q_norm.weight.add_(0.1 * torch.randn(16))
            layer.attention.k_norm.weight.add_(0.1 * torch.randn(16))
    original = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["rmsnorm"], impl="nki", seq_len=8))
    assert_swap_parity(model, original)
    _assert_bit_identical_to_two_calls(model, monkeypatch)


def test_native_model_with_one_head_norm_swapped_runs_two_calls(monkeypatch):
    model = native_model(init_std=0.2)
    apply_overrides(model, OverrideConfig(ops=["rmsnorm"], impl="nki", seq_len=8))
    for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        bind_kernels(layer.attention.k_norm, {"rmsnorm": None})
    calls = _pair_calls(monkeypatch)
    model(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)))
    assert calls == []


@pytest.mark.parametrize("build", [hf_dense_model, hf_moe_model], ids=["qwen3", "qwen3_moe"])
def test_transformers_models_run_the_pair_bit_identical_to_two_calls(build, monkeypatch):
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from 1
    original = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["rmsnorm", "rope_hf"], impl="nki", seq_len=8))
    assert_swap_parity(model, original)
    _assert_bit_identical_to_two_calls(model, monkeypatch)


def test_pair_constraints_name_op_rule_and_value():
    q, k = torch.empty(2, 4, 16), torch.empty(2, 2, 16, dtype=torch.bfloat16)
    w = torch.empty(16)
    with pytest.raises(OverrideConstraintError,
                       match=r"rmsnorm_qk\[nki\].*rmsnorm_qk: constraint 'q.dtype == k.dtype' violated "
                             r"\(got \('float32', 'bfloat16'\)\)"):
        select("rmsnorm_qk", "nki", policy="strict", q=q, k=k, weight_q=w, weight_k=w.bfloat16(), eps=1e-6)
    wide = torch.empty(2, 512)
    sel = select("rmsnorm_qk", "nki", policy="fallback", q=wide, k=wide, weight_q=torch.empty(512),
                 weight_k=torch.empty(512), eps=1e-6)
    assert sel.impl == "reference" and [(v.kernel, v.value) for v in sel.reasons] == [("rmsnorm_qk", 512)]
    assert "H < 512" in sel.reasons[0].constraint
    assert select("rmsnorm_qk", "nki", q=q, k=k.float(), weight_q=w, weight_k=w, eps=1e-6).impl == "nki"
