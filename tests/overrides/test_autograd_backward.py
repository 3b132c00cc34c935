"""A user's backward may be written with torch.autograd.grad or torch.func.vjp: both run inside the op.

Each backward differentiates an independent torch reference (tests/overrides/_refs.py); the gradients
through the ``trnkit::`` op must equal plain autograd through that reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.overrides import _refs
from tests.tolerances import assert_close
from trnkit.overrides import ops, register, unregister


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 8, generator=g)
    w = torch.randn(3, 8, 5, generator=g)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # an empty group in the middle
    wgu = torch.randn(4, 8, 6, generator=g) * 0.3
    wd = torch.randn(4, 3, 8, generator=g) * 0.3
    idx = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3], [2, 0]])
    tw = torch.rand(7, 2, generator=g)
    return x, w, offs, wgu, wd, idx, tw


def _register_gmm(name: str, style: str, autograd_backward: bool = True) -> None:
    if style == "grad":
        def bwd(x, w, offs, grad_out):
            return torch.autograd.grad(_refs.grouped_mm(x, w, offs), (x, w), grad_out)
    else:
        def bwd(x, w, offs, grad_out):
            return torch.func.vjp(lambda a, b: _refs.grouped_mm(a, b, offs), x, w)[1](grad_out)
    register("grouped_mm", name, _refs.grouped_mm, backward=bwd, autograd_backward=autograd_backward)


def _register_moe(name: str, style: str) -> None:
    def fwd(x, idx, tw, wgu, wd, block_size=128):
        return _refs.moe_experts(x, idx, tw, wgu, wd)

    if style == "grad":
        def bwd(x, idx, tw, wgu, wd, grad_out, block_size=128):
            return torch.autograd.grad(_refs.moe_experts(x, idx, tw, wgu, wd), (x, tw, wgu, wd), grad_out)
    else:
        def bwd(x, idx, tw, wgu, wd, grad_out, block_size=128):
            return torch.func.vjp(lambda a, b, c, d: _refs.moe_experts(a, idx, b, c, d), x, tw, wgu, wd)[1](grad_out)
    register("moe_experts", name, fwd, backward=bwd)


def _register_router(name: str, style: str) -> None:
    def weights_logits(x, w, idx, norm):
        logits = x.float() @ w.float().T
        wts = torch.softmax(logits, -1).gather(1, idx.long())
        return (wts / wts.sum(-1, keepdim=True) if norm else wts), logits

    def bwd(x, w, logits, idx, g_w, g_logits, norm):
        if style == "grad":
            return torch.autograd.grad(weights_logits(x, w, idx, norm), (x, w), (g_w, g_logits))
        return torch.func.vjp(lambda a, b: weights_logits(a, b, idx, norm), x, w)[1]((g_w, g_logits))
    register("router_topk", name, _refs.router, backward=bwd)


@pytest.fixture
def user_impls():
    registered = []

    def add(op: str, style: str, **kw):
        name = f"user_{style}"
        {"grouped_mm": _register_gmm, "moe_experts": _register_moe, "router_topk": _register_router}[op](
            name, style, **kw)
        registered.append((op, name))
        return name
    yield add
    for op, name in registered:
        unregister(op, name)


@pytest.mark.parametrize("style", ["grad", "vjp"])
def test_grouped_mm_user_backward(user_impls, style: str) -> None:
    x, w, offs, *_ = _cases()
    name = user_impls("grouped_mm", style)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    (ops.grouped_mm(xa, wa, offs, name) ** 2).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (_refs.grouped_mm(xr, wr, offs) ** 2).sum().backward()
    assert_close(xa.grad, xr.grad)
    assert_close(wa.grad, wr.grad)
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("style", ["grad", "vjp"])
def test_moe_experts_user_backward(user_impls, style: str) -> None:
    x, _, _, wgu, wd, idx, tw = _cases()
    name = user_impls("moe_experts", style)
    got = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
    want = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
    (ops.moe_experts(got[0], idx, got[1], got[2], got[3], 128, name) ** 2).sum().backward()
    (_refs.moe_experts(want[0], idx, want[1], want[2], want[3]) ** 2).sum().backward()
    for a, b in zip(got, want):
        assert_close(a.grad, b.grad)


@pytest.mark.parametrize("style", ["grad", "vjp"])
def test_router_user_backward_inside_a_graph(user_impls, style: str) -> None:
    """x comes from an upstream op (a non-leaf): the backward still sees a leaf it may differentiate."""
    x, *_ = _cases()
    w = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    name = user_impls("router_topk", style)
    scale = torch.tensor(1.5, requires_grad=True)
    wa = w.clone().requires_grad_()
    weights, _, logits = ops.router_topk(x * scale, wa, 2, True, name)
    (weights.square().sum() + logits.sin().sum()).backward()
    scale_r, wr = torch.tensor(1.5, requires_grad=True), w.clone().requires_grad_()
    rw, _, rl = _refs.router(x * scale_r, wr, 2, True)
    (rw.square().sum() + rl.sin().sum()).backward()
    assert_close(scale.grad, scale_r.grad)
    assert_close(wa.grad, wr.grad)


def test_autograd_backward_off_reproduces_the_torch_error(user_impls) -> None:
    """Without trnkit's help (autograd_backward=False) torch records no graph inside a custom op."""
    x, w, offs, *_ = _cases()
    name = user_impls("grouped_mm", "grad", autograd_backward=False)
    y = ops.grouped_mm(x.clone().requires_grad_(), w.clone().requires_grad_(), offs, name)
    with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad"):
        y.sum().backward()


def test_rope_user_backward_with_autograd_grad() -> None:
    """rope_hf's backward is the same call with backward=True (dy in): it may use autograd.grad too."""
    def rotate(x, cos, sin):
        return _refs.rope_bshd(x, cos, sin)

    def my_rope(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False, layout="bshd"):
        if not backward:
            return rotate(q, cos, sin), rotate(k, cos, sin)
        at = [torch.zeros_like(t, requires_grad=True) for t in (q, k)]  # linear: any point will do
        return torch.autograd.grad((rotate(at[0], cos, sin), rotate(at[1], cos, sin)), at, (q, k))

    register("rope_hf", "user_grad", my_rope, has_backward=True)
    try:
        g = torch.Generator().manual_seed(2)
        q, k = torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 5, 1, 8, generator=g)
        ang = torch.randn(5, 4, generator=g)
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
        qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = ops.rope_hf_apply(qa, ka, cos, sin, None, "bshd", False, "user_grad")
        (qo.sin().sum() + ko.square().sum()).backward()
        qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
        (rotate(qr, cos, sin).sin().sum() + rotate(kr, cos, sin).square().sum()).backward()
        assert_close(qa.grad, qr.grad)
        assert_close(ka.grad, kr.grad)
    finally:
        unregister("rope_hf", "user_grad")
