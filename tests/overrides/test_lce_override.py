"""trnkit::linear_cross_entropy: the op (forward, autograd, fake, opcheck, torch.compile) and its swap into
trnkit's native Qwen3 (the ``loss`` module), against ``torch.nn.functional.cross_entropy``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.overrides.conftest import native_model
from tests.tolerances import assert_close
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.overrides import OverrideConfig, OverrideConstraintError, apply_overrides, bind_kernels, ops, select

IGNORE = -100


def _inputs(T: int, H: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::3] = IGNORE
    return h, w, labels


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8, 5), (37, 24, 130), (129, 40, 600)])
def test_op_loss_and_gradients_match_torch_cross_entropy(impl, dtype, shape):
    h, w, labels = _inputs(*shape, dtype, seed=sum(shape))
    loss, lse = ops.linear_cross_entropy(h, w, labels, IGNORE, impl)
    h2, w2 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = F.cross_entropy(h2 @ w2.T, labels, ignore_index=IGNORE, reduction="sum")
    assert loss.dtype == torch.float32 and loss.shape == () and lse.shape == (shape[0],)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    assert_close(lse, torch.logsumexp(h2 @ w2.T, -1).detach(), torch.float32)
    gh, gw = torch.autograd.grad(2.0 * loss, (h, w))
    wh, ww = torch.autograd.grad(2.0 * want, (h2, w2))
    assert gh.dtype == dtype and gw.dtype == dtype
    if dtype == torch.float32:
        assert_close(gh, wh, dtype)
        assert_close(gw, ww, dtype)
    else:  # dl is rounded to bf16 before the matmuls (as a bf16 lm_head backward would): sums of rounded terms
        for got, want in ((gh, wh), (gw, ww)):
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_opcheck(impl):
    h, w, labels = _inputs(9, 16, 40, torch.float32, seed=1)
    torch.library.opcheck(torch.ops.trnkit.linear_cross_entropy, (h, w, labels, IGNORE, impl))
    lse = torch.logsumexp(h.detach() @ w.detach().T, -1)
    torch.library.opcheck(torch.ops.trnkit.linear_cross_entropy_bwd,
                          (h.detach(), w.detach(), labels, lse, torch.tensor(1.5), IGNORE, impl))


def test_compiles_fullgraph():
    h, w, labels = _inputs(20, 16, 50, torch.float32, seed=2)
    fn = lambda a, b: ops.linear_cross_entropy(a, b, labels, IGNORE, "nki")[0]  # noqa: E731
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(h, w)
    got_g = torch.autograd.grad(got, (h, w))
    want = fn(h, w)
    want_g = torch.autograd.grad(want, (h, w))
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_g, want_g))


def test_native_model_loss_swapped_matches_and_switches_back():
    model = native_model(init_std=0.2)
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = apply_overrides(model, OverrideConfig(ops=["linear_cross_entropy"], impl="nki", seq_len=8))
    assert [(r.module, r.op, r.status) for r in report.rows] == [("loss", "linear_cross_entropy", "swapped")]
    assert list(model.state_dict()) == keys
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE
    results = []
    for m in (model, original):
        m.zero_grad()
        loss = m(tokens, labels=labels, loss_chunk_size=4)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (got, got_g), (want, want_g) = results
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    for name in want_g:
        assert_close(got_g[name], want_g[name], torch.float32, msg=name)
    assert bind_kernels(model, {"linear_cross_entropy": None}) == 1 and type(model.loss) is type(original.loss)


def test_width_beyond_the_kernel_names_op_rule_and_value():
    h, w, labels = torch.empty(4, 3073), torch.empty(9, 3073), torch.zeros(4, dtype=torch.long)
    with pytest.raises(OverrideConstraintError, match=r"linear_cross_entropy.*H <= 3072.*3073"):
        select("linear_cross_entropy", "nki", policy="strict", hidden=h, weight=w, labels=labels)
    assert select("linear_cross_entropy", "nki", hidden=h[:, :64], weight=w[:, :64], labels=labels).impl == "nki"


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_op_gradients_scale_by_the_loss_gradient(impl, dtype):
    """``trnkit::linear_cross_entropy_fused`` computes the gradients in its forward; its backward multiplies
    them by the loss gradient: the same loss and lse as the recompute op, gradients equal within the rounding
    of dl (the fused op rounds dl at a loss gradient of 1, the recompute op at 0.37)."""
    h, w, labels = _inputs(129, 40, 600, dtype, seed=4)
    loss, lse, gh1, gw1 = ops.linear_cross_entropy_fused(h, w, labels, IGNORE, impl)
    want_loss, want_lse = ops.linear_cross_entropy(h, w, labels, IGNORE, impl)
    assert torch.equal(loss, want_loss) and torch.equal(lse, want_lse)
    assert gh1.dtype == gw1.dtype == torch.float32
    gh, gw = torch.autograd.grad(0.37 * loss, (h, w))
    assert gh.dtype == gw.dtype == dtype
    g = torch.tensor(0.37)
    assert torch.equal(gh, (gh1 * g).to(dtype)) and torch.equal(gw, (gw1 * g).to(dtype))
    wh, ww = torch.autograd.grad(0.37 * want_loss, (h, w))
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for got, want in ((gh, wh), (gw, ww)):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()))


def test_fused_opcheck_and_compile_fullgraph():
    h, w, labels = _inputs(20, 16, 50, torch.float32, seed=2)
    for impl in ("reference", "nki"):
        torch.library.opcheck(torch.ops.trnkit.linear_cross_entropy_fused, (h, w, labels, IGNORE, impl))
    fn = lambda a, b: ops.linear_cross_entropy_fused(a, b, labels, IGNORE, "nki")[0]  # noqa: E731
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(h, w)
    got_g = torch.autograd.grad(got, (h, w))
    want = fn(h, w)
    want_g = torch.autograd.grad(want, (h, w))
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_g, want_g))


def test_native_model_runs_the_fused_op_when_asked_and_gradients_are_needed(monkeypatch):
    """The swapped ``loss`` module runs the recompute pair by default, the one-pass op under autograd with
    ``schedule="fused"`` and the forward-only op under no_grad; all give F.cross_entropy's loss."""
    model = native_model(init_std=0.2)
    apply_overrides(model, OverrideConfig(ops=["linear_cross_entropy"], impl="nki", seq_len=8))
    calls = []
    for name in ("linear_cross_entropy", "linear_cross_entropy_fused"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    h = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)) / 8
    labels = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    want = F.cross_entropy((h @ weight.T).reshape(-1, 64), labels.reshape(-1), reduction="sum")
    got_fused = model.loss(h, weight, labels, schedule="fused")
    got_recompute = model.loss(h, weight, labels)
    with torch.no_grad():
        got_nograd = model.loss(h, weight, labels, schedule="fused")
    assert calls == ["linear_cross_entropy_fused", "linear_cross_entropy", "linear_cross_entropy"]
    for got in (got_fused, got_recompute, got_nograd):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    g1, = torch.autograd.grad(got_fused, h)
    g2, = torch.autograd.grad(got_recompute, h)
    assert_close(g1, g2, torch.float32)
    with pytest.raises(ValueError, match=r"linear_cross_entropy: schedule must be one of \('fused', 'recompute'\), "
                                         r"got 'once'"):
        model.loss(h, weight, labels, schedule="once")
    # the model's forward passes its loss_schedule on
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    calls.clear()
    losses = [model(tokens, labels=tokens, loss_schedule="fused"), model(tokens, labels=tokens)]
    assert calls == ["linear_cross_entropy_fused", "linear_cross_entropy"]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_cross_entropy_fused"])
@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_bad_labels_refused_naming_op_rule_and_value(op, impl):
    """Float labels, labels not [T], and (a value check) a label outside [0, V) that is not ignore_index are
    refused before any work by both impls (the layout by the op and its fake, on meta tensors too); the
    reference truncated float labels to classes (1.7 -> 1) without a word and stopped in torch's gather with
    'index 5 is out of bounds for dimension 1 with size 5' for the others. Valid labels, -100 among them,
    still give F.cross_entropy's loss."""
    h, w, labels = _inputs(4, 8, 5, torch.float32)
    h, w = h.detach(), w.detach()
    fn = getattr(ops, op)
    want = F.cross_entropy(h @ w.T, labels, ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(fn(h, w, labels, IGNORE, impl)[0], want, rtol=1e-5, atol=1e-5)
    layout = [(labels.float() + 0.7, "'labels is an integer tensor' violated (got 'float32')"),
              (labels[None], "'labels is [T]' violated (got (1, 4)): T = 4")]
    for bad, rule in layout:
        for dev in ("cpu", "meta"):
            with pytest.raises(KernelConstraintError) as e:
                fn(h.to(dev), w.to(dev), bad.to(dev), IGNORE, impl)
            assert str(e.value) == f"trnkit::{op}: constraint {rule}"
    kernel = "linear_cross_entropy_fwd_bwd" if (op, impl) == ("linear_cross_entropy_fused", "nki") else \
        "linear_cross_entropy"
    for label in (5, -1):
        with pytest.raises(KernelConstraintError) as e:
            fn(h, w, torch.tensor([0, IGNORE, label, 1]), IGNORE, impl)
        assert str(e.value) == f"{kernel}: constraint '0 <= label < V = 5 or label == ignore_index (-100)' " \
                               f"violated (got {label})"
