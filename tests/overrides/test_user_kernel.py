"""A user attaches their own rope_hf kernel in a few lines (the example of docs/overrides.md) and it is picked."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from tests.overrides.conftest import hf_moe_model, native_model
from tests.tolerances import assert_close
from trnkit.kernels.constraints import Violation
from trnkit.overrides import OverrideConfig, apply_overrides, register, unregister

CALLS: list[tuple[str, bool]] = []


# --- the example of docs/overrides.md, "Attach your own kernel" -------------------------------
def my_rope_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The user's kernel: its own layout x [N, S, D] (N = batch * heads), allocates its output."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def my_rope_constraints(q, k, layout="bhsd", **_):
    d = q.shape[-1]
    return [] if d % 2 == 0 and d <= 256 else [Violation("my_rope", "D even and <= 256", d)]


def my_rope(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False, layout="bhsd"):
    d = q.shape[-1]
    if rope_cache is not None:  # packed [S, 2D] = cos | sin
        cos, sin = rope_cache[..., :d], rope_cache[..., d:]
    seq = q.shape[1] if layout == "bshd" else q.shape[2]
    cos, sin = cos[..., :seq, :].float(), sin[..., :seq, :].float()
    if backward:  # the rotation is orthogonal: its transpose rotates by -angle
        sin = -sin
    CALLS.append((layout, backward))

    def run(x):
        xs = x.transpose(1, 2) if layout == "bshd" else x  # -> [B, H, S, D]
        b, heads = xs.shape[:2]
        c, s = (t.repeat_interleave(heads, 0) if t.dim() == 3 else t for t in (cos, sin))
        y = my_rope_kernel(xs.reshape(b * heads, seq, d).float(), c, s).to(x.dtype)
        y = y.view(b, heads, seq, d)
        return y.transpose(1, 2) if layout == "bshd" else y

    return run(q), run(k)  # new tensors: trnkit copies them into q_out / k_out
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def user_rope():
    register("rope_hf", "my_rope", my_rope, constraints=my_rope_constraints, has_backward=True)
    CALLS.clear()
    yield "my_rope"
    unregister("rope_hf", "my_rope")


def _run(model, ids):
    model.zero_grad()
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    (logits ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [native_model, hf_moe_model], ids=["native", "transformers"])
def test_user_rope_is_picked_and_matches(user_rope, build):
    model = build()
    original = copy.deepcopy(model)
    report = apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl=user_rope, seq_len=8))
    assert {(r.op, r.impl, r.status) for r in report.rows} == {("rope_hf", "my_rope", "swapped")}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    CALLS.clear()
    got, want = _run(model, ids), _run(original, ids)
    layers = 2
    assert CALLS == [("bshd", False)] * layers + [("bshd", True)] * layers  # forward, then backward
    assert_close(got[0], want[0])
    for name in want[1]:
        assert_close(got[1][name], want[1][name], msg=name)


def test_user_constraints_drive_the_policy(user_rope):
    model = native_model(head_dim=320, n_heads=2, n_kv_heads=1)
    with pytest.warns(UserWarning, match="my_rope: constraint 'D even and <= 256' violated"):
        report = apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl=user_rope, policy="fallback",
                                                       seq_len=8))
    assert {r.status for r in report.rows} == {"fallback"}


@pytest.mark.parametrize("op, extra", [("router_topk", "topk_weights of shape [5, 3], the op declares [5, 2]"),
                                       ("grouped_mm", "out of shape [6, 4], the op declares [6, 3]"),
                                       ("moe_experts", "out of shape [5, 7], the op declares [5, 8]")])
def test_a_user_impl_returning_other_shapes_is_named(op: str, extra: str) -> None:
    """Ops that use an impl's outputs as they are (no reshape) check their shapes: a router returning top_k + 1
    columns used to train on silently (probed through a trainer plugin)."""
    from trnkit.overrides import ops

    def bad_router(x, w, top_k, norm_topk_prob=True):
        t, e = x.shape[0], w.shape[0]
        return torch.zeros(t, top_k + 1), torch.zeros(t, top_k + 1, dtype=torch.int32), torch.zeros(t, e)

    impls = {"router_topk": bad_router, "grouped_mm": lambda x, w, offs: torch.zeros(x.shape[0], w.shape[2] + 1),
             "moe_experts": lambda x, *a, **kw: torch.zeros(x.shape[0], x.shape[1] - 1)}
    register(op, "badshape", impls[op])
    x = torch.randn(5, 8)
    calls = {"router_topk": lambda: ops.router_topk(x, torch.randn(4, 8), 2, True, "badshape"),
             "grouped_mm": lambda: ops.grouped_mm(torch.randn(6, 8), torch.randn(2, 8, 3),
                                                  torch.tensor([3, 6], dtype=torch.int32), "badshape"),
             "moe_experts": lambda: ops.moe_experts(x, torch.zeros(5, 2, dtype=torch.int32), torch.ones(5, 2),
                                                    torch.randn(4, 8, 6), torch.randn(4, 3, 8), impl="badshape")}
    want = rf"^trnkit::{op}: impl 'badshape' returned {re.escape(extra)} for these inputs \(trnkit.overrides.registry"
    try:
        with pytest.raises(ops.ImplOutputError, match=want + r": call conventions\)$"):
            calls[op]()
    finally:
        unregister(op, "badshape")


def test_a_user_backward_returning_a_broadcastable_shape_is_named_not_summed() -> None:
    """A router backward returning grad_x of shape [2, T, H] for x [T, H]: autograd would sum it over the extra
    dimension without a word (a gradient twice too large); the op names the impl, the output and both shapes."""
    from trnkit.overrides import get_impl, ops

    ref = get_impl("router_topk", "reference")

    def doubled_bwd(x, w, logits, idx, g_w, g_logits, norm_topk_prob):
        gx, gw = ref.backward(x, w, logits, idx, g_w, g_logits, norm_topk_prob)
        return gx.expand(2, *gx.shape), gw

    register("router_topk", "badbwd", ref.fn, backward=doubled_bwd, has_backward=True)
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    try:
        weights, _, logits = ops.router_topk(x, w, 2, True, "badbwd")
        with pytest.raises(ops.ImplOutputError, match=r"^trnkit::router_topk_bwd: impl 'badbwd' returned grad_x of "
                                                      r"shape \[2, 5, 8\], the op declares \[5, 8\] for these inputs"):
            (weights.sum() + logits.sum()).backward()
    finally:
        unregister("router_topk", "badbwd")


@pytest.mark.parametrize("op, bwd, extra", [
    ("grouped_mm", lambda x, w, offs, g: (torch.zeros_like(x), torch.zeros(w.shape[0], w.shape[1], 1)),
     r"returned grad_w of shape \[2, 8, 1\], the op declares \[2, 8, 3\]"),
    ("grouped_mm", lambda x, w, offs, g: (torch.zeros_like(x),),
     r"returned 1 output\(s\), the op declares 2 \(grad_x, grad_w\)"),
    ("grouped_mm", lambda x, w, offs, g: (torch.zeros_like(x), None),
     r"returned grad_w None, the op declares a tensor of shape \[2, 8, 3\]"),
    ("rmsnorm", lambda x, w, rstd, g, eps=1e-6: (torch.zeros_like(x), torch.zeros(1)),
     r"returned grad_weight of shape \[1\], the op declares \[8\]"),
    ("mlp", lambda x, wgu, wd, g: (torch.zeros_like(x), torch.zeros_like(wgu), torch.zeros_like(wd).T),
     r"returned grad_w_down of shape \[8, 3\], the op declares \[3, 8\]"),
])
def test_a_user_backward_returning_other_shapes_is_named(op: str, bwd, extra: str) -> None:
    from trnkit.overrides import get_impl, ops

    register(op, "badbwd", get_impl(op, "reference").fn, backward=bwd, has_backward=True)
    calls = {"grouped_mm": lambda: ops.grouped_mm_bwd(torch.randn(6, 8), torch.randn(2, 8, 3),
                                                      torch.tensor([3, 6], dtype=torch.int32), torch.randn(6, 3),
                                                      "badbwd"),
             "rmsnorm": lambda: ops.rmsnorm_bwd(torch.randn(5, 8), torch.randn(8), torch.rand(5), torch.randn(5, 8),
                                                impl="badbwd"),
             "mlp": lambda: ops.mlp_bwd(torch.randn(5, 8), torch.randn(8, 6), torch.randn(3, 8), torch.randn(5, 8),
                                        "badbwd")}
    try:
        with pytest.raises(ops.ImplOutputError, match=rf"^trnkit::{op}_bwd: impl 'badbwd' {extra}"):
            calls[op]()
    finally:
        unregister(op, "badbwd")


@pytest.mark.parametrize("backward", [False, True])
def test_a_user_rope_returning_other_shapes_is_named(backward: bool) -> None:
    """rope_hf's backward is its forward with backward=True: both directions check the returned q and k."""
    from trnkit.overrides import ops

    def short_rope(q, k, q_out, k_out, **_):
        return q[..., :-1], k

    register("rope_hf", "badshape", short_rope, has_backward=True)
    q, k, cos, sin = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(4, 8), torch.randn(4, 8)
    try:
        with pytest.raises(ops.ImplOutputError, match=r"^trnkit::rope_hf: impl 'badshape' returned q_out of shape "
                                                      r"\[1, 2, 4, 7\], the op declares \[1, 2, 4, 8\]"):
            ops.rope_hf_apply(q, k, cos, sin, layout="bhsd", backward=backward, impl="badshape")
    finally:
        unregister("rope_hf", "badshape")
