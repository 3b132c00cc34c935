"""trnkit's kernels as ``torch.library`` custom ops (namespace ``trnkit::``).

Each op takes a trailing ``impl: str`` naming the registered implementation (``"reference"``,
``"nki"`` or a user's, see :mod:`trnkit.overrides.registry`) and dispatches to it at run time; the
op itself is opaque to torch.compile (one graph node, shapes from ``register_fake``), and autograd is
registered on the functional ops with the impl's backward.

- ``trnkit::rope_hf(q, k, q_out!, k_out!, cos?, sin?, rope_cache?, backward, layout, impl, lnc) -> ()``:
  the kernel's own preallocated-output form (mutates exactly ``q_out`` and ``k_out``; no autograd —
  torch cannot differentiate through a mutating op).
- ``trnkit::rope_hf_apply(q, k, cos?, sin?, rope_cache?, layout, backward, impl, lnc) -> (q', k')``:
  functional, differentiable in ``q`` and ``k`` (``cos``/``sin``/``rope_cache`` are constants);
  ``layout="bshd"`` is the models' ``[B, S, H, D]``.
- ``trnkit::router_topk(x, w_router, top_k, norm_topk_prob, impl, scoring, selection_bias?,
  routed_scaling_factor, lnc) -> (weights f32, idx i32, logits f32)``; the variant arguments (DeepSeek-V3
  style sigmoid routers) reach the impl as keyword arguments only when they differ from the Qwen3
  defaults, so impls written for softmax routers keep working.
- ``trnkit::grouped_mm(x, w, group_offsets, impl) -> out``.
- ``trnkit::moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, impl, activation,
  limit, alpha, b_gate_up?, b_down?) -> out``; the expert variant (activation ``gelu_tanh`` /
  ``swiglu_clamped``, biases) reaches the impl as keyword arguments only when it differs from the
  default SwiGLU without biases, so impls written for Qwen3 experts keep working. Its backward op
  returns the bias gradients too (empty tensors for absent biases).
- ``trnkit::rmsnorm(x, weight, eps, impl) -> (y, rstd f32)``: HF's cast order, ``y`` in
  ``promote(x.dtype, weight.dtype)``, ``rstd`` one fp32 value per row (saved for the backward).
- ``trnkit::rmsnorm_qk(q, k, weight_q, weight_k, eps, impl) -> (y_q, y_k, rstd_q f32, rstd_k f32)``: the q and k
  head norms in one call (each as ``trnkit::rmsnorm``); the models run it when both head norms are swapped in
  with one impl that ``rmsnorm_qk`` also has (:func:`trnkit.overrides.guard.head_norm_pair`).
- ``trnkit::linear_cross_entropy(hidden, weight, labels, ignore_index, impl) -> (loss f32, lse f32)``: the
  lm_head fused with the cross-entropy summed over the labels that are not ``ignore_index``.
- ``trnkit::linear_cross_entropy_fused(hidden, weight, labels, ignore_index, impl) -> (loss, lse, grad_hidden f32,
  grad_weight f32)``: the same loss with its gradients at a loss gradient of 1, computed in the forward (an
  impl whose ``fn`` takes ``with_grad=True``; otherwise its backward at 1); the backward multiplies them by the
  loss gradient. The native model's loss module runs it when gradients are needed and ``schedule="fused"`` (opt-in).
- ``trnkit::attention(q, k, v, scale, impl, lnc, fixed_shift) -> (o, lse f32)``: causal GQA attention in the
  ``[B, S, H, D]`` layout (``lse [B, Hq, S]``, saved for the backward; it carries no gradient of its own and is
  marked non-differentiable, as are ``rstd`` and the cross-entropy's ``lse``);
  ``fixed_shift`` (None: the impl's own default) reaches the impl as its keyword ``fixed_shift`` when set
  (the ``nki`` forward: True, its default, the fixed softmax shift per row; False the exact row max); an
  impl without that parameter is refused when it is set. The backward is the same either way.
- ``trnkit::mlp(x, w_gate_up, w_down, impl) -> y``: the dense SwiGLU MLP ``(silu(x @ Wg) * (x @ Wu)) @ w_down``,
  ``x [..., H]``, ``w_gate_up [H, 2I]`` (gate columns first), ``w_down [I, H]``, ``y`` in x's dtype.
- ``trnkit::router_topk_bwd``, ``trnkit::grouped_mm_bwd``, ``trnkit::moe_experts_bwd``, ``trnkit::rmsnorm_bwd``,
  ``trnkit::rmsnorm_qk_bwd``,
  ``trnkit::linear_cross_entropy_bwd``, ``trnkit::attention_bwd``, ``trnkit::mlp_bwd``: the backward
  kernels as ops of their own, so the backward graph is opaque to torch.compile too.

The ops of kernels that split work over a trn2 logical core (``rope_hf``, ``rope_hf_apply``, ``router_topk``,
``grouped_mm``, ``moe_experts``, ``rmsnorm``, ``rmsnorm_qk``,
``linear_cross_entropy``, ``attention``, ``mlp`` and their backwards) take a trailing ``lnc: int`` (1 or 2 physical
cores; 0 = the device default, :func:`trnkit.kernels.lnc.default_lnc`); it reaches an impl as the keyword
``lnc`` when set and the impl declares that parameter, and the backward runs at the forward's ``lnc``.

Impls receive contiguous tensors. Outputs are normalised to the declared dtypes and made contiguous (as the fakes
declare them), so a user impl that
returns e.g. int64 indices still matches the fake (meta) implementation; an output of another shape than
declared is an :class:`ImplOutputError` (naming op, impl, output and both shapes), or where the op reshapes
it, torch's reshape error. A backward's outputs are checked the same way: one tensor per differentiable
input, of that input's shape (``_checked_grads``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from trnkit.errors import TrnkitError
from trnkit.kernels.constraints import check
from trnkit.kernels.moe import SWIGLU_ALPHA, SWIGLU_LIMIT
from trnkit.overrides.config import fixed_shift_problem
from trnkit.overrides.op_inputs import (check_attention_inputs, check_lce_inputs, check_mlp_inputs,
                                        check_rope_inputs, check_rope_outs, check_router_inputs, eps_violations,
                                        norm_violations)
from trnkit.overrides.registry import get_impl

__all__ = ["ImplOutputError", "attention", "attention_bwd", "grouped_mm", "grouped_mm_bwd", "linear_cross_entropy",
           "linear_cross_entropy_bwd", "linear_cross_entropy_fused",
           "moe_experts", "moe_experts_bwd", "rmsnorm", "rmsnorm_bwd", "rmsnorm_qk", "rmsnorm_qk_bwd", "rope_hf",
           "rope_hf_apply", "router_topk", "router_topk_bwd", "mlp", "mlp_bwd"]

_LAYOUTS = ("bhsd", "bshd")


def _c(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


class ImplOutputError(TrnkitError, RuntimeError):
    """An impl returned outputs of other shapes than its op declares (a user's impl: theirs to fix)."""


def _check_shapes(op: str, impl: str, got: tuple[Tensor, ...], want: tuple[tuple[int, ...], ...],
                  names: tuple[str, ...]) -> None:
    """Outputs the op does not reshape (an impl's wrong shape would otherwise be used as it is) must have the
    declared shapes."""
    for name, g, w in zip(names, got, want, strict=True):
        if tuple(g.shape) != tuple(w):
            raise ImplOutputError(f"trnkit::{op}: impl {impl!r} returned {name} of shape {list(g.shape)}, the op "
                                  f"declares {list(w)} for these inputs (trnkit.overrides.registry: call conventions)")


def _dense(*tensors: Tensor) -> tuple[Tensor, ...]:
    """An op's outputs, contiguous whatever the impl returned (the fakes declare them so, and inductor asserts the
    real strides against the fake's)."""
    return tuple(t.contiguous() for t in tensors)


def _empty_dense(*like: Tensor) -> tuple[Tensor, ...]:
    """A backward op's fake outputs: contiguous, shaped like ``like`` (``empty_like`` alone keeps a permuted
    input's strides, which the real outputs do not have, and inductor asserts the real strides against these)."""
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in like)


def _per_row(op: str, impl: str, name: str, t: Tensor, rows: int) -> Tensor:
    """A per-row fp32 output of an impl (``rstd``, ``lse``), flattened and checked to hold the op's ``rows`` values
    (``reshape(-1)`` alone took any length: a user impl's rstd of 2T values came back as the op's)."""
    flat = t.to(torch.float32).reshape(-1)
    _check_shapes(op, impl, (flat,), ((rows,),), (name,))
    return flat


def _like(op: str, impl: str, name: str, y: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """An impl's output of x's shape or of its rows ``[N, H]``, reshaped to x's shape in ``dtype``; another shape of
    the same size (``[H, N]``) would be reshaped into scrambled values, so it is an :class:`ImplOutputError`."""
    if tuple(y.shape) not in (tuple(x.shape), (_rows(x), x.shape[-1])):
        _check_shapes(op, impl, (y,), (tuple(x.shape),), (name,))
    return y.to(dtype).reshape(x.shape)


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"trnkit::rope_hf: layout must be one of {_LAYOUTS}, got {layout!r}")


# Positions of each op's differentiable inputs in its backward's arguments (x, weights, ...).
_PRIMALS: dict[str, tuple[int, ...]] = {"router_topk": (0, 1), "grouped_mm": (0, 1), "moe_experts": (0, 2, 3, 4),
                                        "rmsnorm": (0, 1), "rmsnorm_qk": (0, 1, 2, 3), "linear_cross_entropy": (0, 1),
                                        "attention": (0, 1, 2), "mlp": (0, 1, 2)}
_PRIMAL_KWARGS = ("b_gate_up", "b_down")  # differentiable keyword arguments (the experts' biases)
# The backward's outputs, one per differentiable input of _PRIMALS (then of the _PRIMAL_KWARGS passed), its shape.
_GRADS: dict[str, tuple[str, ...]] = {"router_topk": ("grad_x", "grad_w_router"), "grouped_mm": ("grad_x", "grad_w"),
                                      "moe_experts": ("grad_x", "grad_topk_weights", "grad_w_gate_up", "grad_w_down"),
                                      "rmsnorm": ("grad_x", "grad_weight"),
                                      "rmsnorm_qk": ("grad_q", "grad_k", "grad_weight_q", "grad_weight_k"),
                                      "linear_cross_entropy": ("grad_hidden", "grad_weight"),
                                      "attention": ("grad_q", "grad_k", "grad_v"),
                                      "mlp": ("grad_x", "grad_w_gate_up", "grad_w_down")}
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView)


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Grad mode on and autograd dispatch back inside a custom op's kernel.

    torch.library runs an op's kernel with the autograd dispatch keys excluded (and the backward under
    no_grad), so ``torch.autograd.grad`` there fails with "element 0 of tensors does not require grad";
    ``torch.func.vjp`` works only because functorch re-enables them for its own level. This restores
    the exclude set without the autograd keys for the duration of a user's backward.
    """
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@functools.cache
def _takes_lnc(fn: Any) -> bool:
    return "lnc" in inspect.signature(fn).parameters


def _lnc_kw(fn: Any, lnc: int) -> dict[str, int]:
    """``lnc`` as the impl's keyword argument: passed when set (1 or 2; 0 = the device default) and the
    impl declares an ``lnc`` parameter (the ``nki`` impls do; a reference or a user's impl need not)."""
    return {"lnc": lnc} if lnc and _takes_lnc(fn) else {}


def block_size_kw(block_size: int) -> dict[str, int]:
    """``moe_experts``' ``block_size`` as an impl's keyword argument: passed when set; 0 = the impl's own
    default (the ``nki`` kernels' tuned sizes: forward 512, backward 128 slots per expert block)."""
    return {"block_size": block_size} if block_size else {}


def _forward_impl(op: str, impl: str) -> Any:
    """The registered impl of a forward op, refused under forward-mode AD (``torch.func.jvp`` / ``jacfwd``,
    ``torch.autograd.forward_ad``): the ops register only a reverse-mode derivative, and torch gives a custom op
    without a forward one a zero tangent (``jvp``) or none (``forward_ad``) without a word."""
    if torch.autograd.forward_ad._current_level >= 0:
        raise RuntimeError(f"trnkit::{op}: forward-mode AD (torch.func.jvp / jacfwd, torch.autograd.forward_ad) is "
                           "not supported: the op has a reverse-mode derivative only, and torch would return a zero "
                           "tangent through it; use reverse mode (backward, torch.autograd.grad)")
    return get_impl(op, impl)


def _run_backward(op: str, impl: str, *args: Any, lnc: int = 0, **kwargs: Any) -> tuple[Tensor, ...]:
    """Call the impl's backward (see ``autograd_backward`` in :func:`trnkit.overrides.register`)."""
    entry = get_impl(op, impl)
    if entry.backward is None:
        raise RuntimeError(f"trnkit::{op}: impl {impl!r} has no backward (has_backward=False)")
    kwargs.update(_lnc_kw(entry.backward, lnc))
    if not entry.autograd_backward:
        return _checked_grads(op, impl, tuple(entry.backward(*args, **kwargs)), args, kwargs)
    leaves = [a.detach().requires_grad_() if i in _PRIMALS[op] and a.is_floating_point() else a
              for i, a in enumerate(args)]
    kwargs = {k: v.detach().requires_grad_() if k in _PRIMAL_KWARGS and isinstance(v, Tensor) else v
              for k, v in kwargs.items()}
    with autograd_enabled():
        grads = _checked_grads(op, impl, tuple(entry.backward(*leaves, **kwargs)), leaves, kwargs)
    return tuple(g.detach() for g in grads)


def _checked_grads(op: str, impl: str, grads: tuple[Any, ...], args: Any, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """An impl's backward outputs, checked: one tensor per differentiable input, of that input's shape (autograd
    would sum a broadcastable gradient over its extra dimensions without a word). With an expert bias given, both
    bias gradients follow (anything, e.g. None, for the absent one)."""
    biases = [kwargs.get(k) for k in _PRIMAL_KWARGS] if any(isinstance(kwargs.get(k), Tensor)
                                                            for k in _PRIMAL_KWARGS) else []
    names = _GRADS[op] + tuple(f"grad_{k}" for k in _PRIMAL_KWARGS[:len(biases)])
    want = [tuple(args[i].shape) for i in _PRIMALS[op]] + [None if b is None else tuple(b.shape) for b in biases]
    if len(grads) != len(names):
        raise ImplOutputError(f"trnkit::{op}_bwd: impl {impl!r} returned {len(grads)} output(s), the op declares "
                              f"{len(names)} ({', '.join(names)})")
    for name, g, w in zip(names, grads, want, strict=True):
        if w is None:
            continue
        if not isinstance(g, Tensor):
            raise ImplOutputError(f"trnkit::{op}_bwd: impl {impl!r} returned {name} {g!r:.60}, the op declares a "
                                  f"tensor of shape {list(w)} (trnkit.overrides.registry: call conventions)")
        _check_shapes(f"{op}_bwd", impl, (g,), (w,), (name,))
    return grads


def _direct_out(out: Tensor, own: Tensor, other: Tensor) -> Tensor:
    """``out`` itself where the impl may write it while it reads the inputs: contiguous, overlapping neither the
    other input nor its own input unless it is that input (``q_out is q``: in place); else a fresh buffer that
    :func:`_run_rope` copies into ``out`` after the call (the reference wrote q's result over a k it then
    rotated, for ``q_out`` a view of k)."""
    in_place = out.data_ptr() == own.data_ptr() and out.stride() == own.stride() and out.shape == own.shape
    if out.is_contiguous() and not torch._C._overlaps(out, other) and (in_place or not torch._C._overlaps(out, own)):
        return out
    return torch.empty_like(out, memory_format=torch.contiguous_format)


def _run_rope(impl: str, q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor, cos: Tensor | None,
              sin: Tensor | None, rope_cache: Tensor | None, backward: bool, layout: str, lnc: int = 0) -> None:
    """Call the impl on contiguous buffers and make sure the results land in ``q_out``/``k_out``."""
    _check_layout(layout)
    check_rope_inputs(q, k, cos, sin, rope_cache, layout)
    check_rope_outs(q, k, q_out, k_out)
    entry = _forward_impl("rope_hf", impl)
    if backward and not entry.has_backward:
        raise RuntimeError(f"trnkit::rope_hf: impl {impl!r} has no backward (has_backward=False)")
    qo, ko = _direct_out(q_out, q, k), _direct_out(k_out, k, q)
    # rope's backward is the forward call with backward=True (dy in): a user's may use autograd too
    with autograd_enabled() if backward and entry.autograd_backward else contextlib.nullcontext():
        res = entry.fn(q.contiguous(), k.contiguous(), qo, ko, cos=_c(cos), sin=_c(sin),
                       rope_cache=_c(rope_cache), backward=backward, layout=layout, **_lnc_kw(entry.fn, lnc))
    # An impl may allocate and return its own outputs instead of writing the given ones.
    results = (qo, ko) if res is None else tuple(r.detach() if r.requires_grad else r for r in res)
    for name, dst, got in zip(("q_out", "k_out"), (q_out, k_out), results, strict=True):
        if got is not dst:
            _check_shapes("rope_hf", impl, (got,), (tuple(dst.shape),), (name,))
            dst.copy_(got)


# ---------------------------------------------------------------------------------------------- rope


@torch.library.custom_op("trnkit::rope_hf", mutates_args=("q_out", "k_out"))
def rope_hf(q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor, cos: Tensor | None = None,
            sin: Tensor | None = None, rope_cache: Tensor | None = None, backward: bool = False,
            layout: str = "bhsd", impl: str = "reference", lnc: int = 0) -> None:
    """RoPE (rotate-half) of ``q``/``k`` written into ``q_out``/``k_out`` by the chosen impl."""
    _run_rope(impl, q, k, q_out, k_out, cos, sin, rope_cache, backward, layout, lnc)


@rope_hf.register_fake
def _rope_hf_fake(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False,
                  layout="bhsd", impl="reference", lnc=0) -> None:
    _check_layout(layout)
    check_rope_inputs(q, k, cos, sin, rope_cache, layout)
    check_rope_outs(q, k, q_out, k_out)


@torch.library.custom_op("trnkit::rope_hf_apply", mutates_args=())
def rope_hf_apply(q: Tensor, k: Tensor, cos: Tensor | None = None, sin: Tensor | None = None,
                  rope_cache: Tensor | None = None, layout: str = "bshd", backward: bool = False,
                  impl: str = "reference", lnc: int = 0) -> tuple[Tensor, Tensor]:
    """Functional RoPE: returns new ``(q', k')`` (contiguous, same shape/dtype/layout as q/k)."""
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    _run_rope(impl, q, k, q_out, k_out, cos, sin, rope_cache, backward, layout, lnc)
    return q_out, k_out


@rope_hf_apply.register_fake
def _rope_hf_apply_fake(q, k, cos=None, sin=None, rope_cache=None, layout="bshd", backward=False,
                        impl="reference", lnc=0):
    _check_layout(layout)
    check_rope_inputs(q, k, cos, sin, rope_cache, layout)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


def _rope_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    _, _, cos, sin, rope_cache, layout, backward, impl, lnc = inputs
    ctx.save_for_backward(cos, sin, rope_cache)
    ctx.layout, ctx.backward, ctx.impl, ctx.lnc = layout, backward, impl, lnc


def _rope_backward(ctx: Any, grad_q: Tensor, grad_k: Tensor):
    cos, sin, rope_cache = ctx.saved_tensors
    # The rotation is orthogonal: its vjp is the inverse rotation (the kernels' backward=True).
    gq, gk = rope_hf_apply(grad_q, grad_k, cos, sin, rope_cache, ctx.layout, not ctx.backward, ctx.impl, ctx.lnc)
    return gq, gk, None, None, None, None, None, None, None


rope_hf_apply.register_autograd(_rope_backward, setup_context=_rope_setup)


# -------------------------------------------------------------------------------------------- router


def _router_variant(scoring: str, selection_bias: Tensor | None, routed_scaling_factor: float,
                    forward: bool = True) -> dict[str, Any]:
    """The router variant as impl keyword arguments; empty for the Qwen3 default (softmax, no bias, x1)."""
    kw: dict[str, Any] = {}
    if scoring != "softmax":
        kw["scoring"] = scoring
    if forward and selection_bias is not None:
        kw["selection_bias"] = selection_bias.contiguous()
    if routed_scaling_factor != 1.0:
        kw["routed_scaling_factor"] = routed_scaling_factor
    return kw


@torch.library.custom_op("trnkit::router_topk", mutates_args=())
def router_topk(x: Tensor, w_router: Tensor, top_k: int, norm_topk_prob: bool = True,
                impl: str = "reference", scoring: str = "softmax", selection_bias: Tensor | None = None,
                routed_scaling_factor: float = 1.0, lnc: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Router logits, scores and top-k: ``(topk_weights [T,K] f32, topk_idx [T,K] i32, logits [T,E] f32)``."""
    check_router_inputs(x, w_router, top_k)
    fn = _forward_impl("router_topk", impl).fn
    w, idx, logits = fn(x.contiguous(), w_router.contiguous(), top_k, norm_topk_prob,
                        **_router_variant(scoring, selection_bias, routed_scaling_factor), **_lnc_kw(fn, lnc))
    t, e = x.shape[0], w_router.shape[0]
    _check_shapes("router_topk", impl, (w, idx, logits), ((t, top_k), (t, top_k), (t, e)),
                  ("topk_weights", "topk_idx", "router_logits"))
    return _dense(w.to(torch.float32), idx.to(torch.int32), logits.to(torch.float32))


@router_topk.register_fake
def _router_topk_fake(x, w_router, top_k, norm_topk_prob=True, impl="reference", scoring="softmax",
                      selection_bias=None, routed_scaling_factor=1.0, lnc=0):
    check_router_inputs(x, w_router, top_k)
    t, e = x.shape[0], w_router.shape[0]
    return (x.new_empty((t, top_k), dtype=torch.float32), x.new_empty((t, top_k), dtype=torch.int32),
            x.new_empty((t, e), dtype=torch.float32))


def _router_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, w_router, _, norm_topk_prob, impl, scoring, _, routed_scaling_factor, lnc = inputs
    _, idx, logits = output
    ctx.save_for_backward(x, w_router, logits, idx)
    ctx.norm, ctx.impl, ctx.scoring, ctx.scale, ctx.lnc = norm_topk_prob, impl, scoring, routed_scaling_factor, lnc


@torch.library.custom_op("trnkit::router_topk_bwd", mutates_args=())
def router_topk_bwd(x: Tensor, w_router: Tensor, router_logits: Tensor, topk_idx: Tensor,
                    grad_topk_weights: Tensor, grad_router_logits: Tensor, norm_topk_prob: bool = True,
                    impl: str = "reference", scoring: str = "softmax",
                    routed_scaling_factor: float = 1.0, lnc: int = 0) -> tuple[Tensor, Tensor]:
    """Backward of ``trnkit::router_topk``: ``(grad_x, grad_w_router)`` (the selection bias has none)."""
    gx, gw = _run_backward(
        "router_topk", impl, x.contiguous(), w_router.contiguous(), router_logits.contiguous(), topk_idx.contiguous(),
        grad_topk_weights.contiguous(), grad_router_logits.contiguous(), norm_topk_prob, lnc=lnc,
        **_router_variant(scoring, None, routed_scaling_factor, forward=False))
    return _dense(gx.to(x.dtype), gw.to(w_router.dtype))


@router_topk_bwd.register_fake
def _router_topk_bwd_fake(x, w_router, router_logits, topk_idx, grad_topk_weights, grad_router_logits,
                          norm_topk_prob=True, impl="reference", scoring="softmax", routed_scaling_factor=1.0,
                          lnc=0):
    return _empty_dense(x, w_router)


def _router_backward(ctx: Any, grad_w: Tensor, grad_idx: Tensor | None, grad_logits: Tensor):
    x, w_router, logits, idx = ctx.saved_tensors
    gx, gw = router_topk_bwd(x, w_router, logits, idx, grad_w, grad_logits, ctx.norm, ctx.impl, ctx.scoring,
                             ctx.scale, ctx.lnc)
    return gx, gw, None, None, None, None, None, None, None


router_topk.register_autograd(_router_backward, setup_context=_router_setup)


# ---------------------------------------------------------------------------------------- grouped mm


@torch.library.custom_op("trnkit::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, group_offsets: Tensor, impl: str = "reference", lnc: int = 0) -> Tensor:
    """``out[rows of group g] = x[rows of group g] @ w[g]``; ``group_offsets`` are exclusive ends."""
    fn = _forward_impl("grouped_mm", impl).fn
    out = fn(x.contiguous(), w.contiguous(), group_offsets.contiguous(), **_lnc_kw(fn, lnc))
    _check_shapes("grouped_mm", impl, (out,), ((x.shape[0], w.shape[2]),), ("out",))
    return out.to(x.dtype).contiguous()


@grouped_mm.register_fake
def _grouped_mm_fake(x, w, group_offsets, impl="reference", lnc=0):
    return x.new_empty((x.shape[0], w.shape[2]))


def _gmm_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, w, offs, impl, lnc = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.impl, ctx.lnc = impl, lnc


@torch.library.custom_op("trnkit::grouped_mm_bwd", mutates_args=())
def grouped_mm_bwd(x: Tensor, w: Tensor, group_offsets: Tensor, grad_out: Tensor,
                   impl: str = "reference", lnc: int = 0) -> tuple[Tensor, Tensor]:
    """Backward of ``trnkit::grouped_mm``: ``(grad_x, grad_w)``."""
    gx, gw = _run_backward("grouped_mm", impl, x.contiguous(), w.contiguous(), group_offsets.contiguous(),
                           grad_out.contiguous(), lnc=lnc)
    return _dense(gx.to(x.dtype), gw.to(w.dtype))


@grouped_mm_bwd.register_fake
def _grouped_mm_bwd_fake(x, w, group_offsets, grad_out, impl="reference", lnc=0):
    return _empty_dense(x, w)


def _gmm_backward(ctx: Any, grad_out: Tensor):
    x, w, offs = ctx.saved_tensors
    gx, gw = grouped_mm_bwd(x, w, offs, grad_out, ctx.impl, ctx.lnc)
    return gx, gw, None, None, None


grouped_mm.register_autograd(_gmm_backward, setup_context=_gmm_setup)


# --------------------------------------------------------------------------------------- moe experts


def _expert_variant(activation: str, limit: float, alpha: float, b_gate_up: Tensor | None,
                    b_down: Tensor | None) -> dict[str, Any]:
    """The expert variant as impl keyword arguments; empty for the Qwen3 default (SwiGLU, no biases)."""
    kw: dict[str, Any] = {}
    if activation != "silu":
        kw["activation"] = activation
    if (limit, alpha) != (SWIGLU_LIMIT, SWIGLU_ALPHA):
        kw.update(limit=limit, alpha=alpha)
    if b_gate_up is not None:
        kw["b_gate_up"] = b_gate_up.contiguous()
    if b_down is not None:
        kw["b_down"] = b_down.contiguous()
    return kw


@torch.library.custom_op("trnkit::moe_experts", mutates_args=())
def moe_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                block_size: int = 0, impl: str = "reference", activation: str = "silu",
                limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA, b_gate_up: Tensor | None = None,
                b_down: Tensor | None = None, lnc: int = 0) -> Tensor:
    """Gated experts, routed: ``out[t] = sum_k w[t,k] * (down_e(act(gate_e(x_t)) * up_e(x_t)) + b_down[e])``."""
    fn = _forward_impl("moe_experts", impl).fn
    out = fn(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate_up.contiguous(),
             w_down.contiguous(), **block_size_kw(block_size), **_lnc_kw(fn, lnc),
             **_expert_variant(activation, limit, alpha, b_gate_up, b_down))
    _check_shapes("moe_experts", impl, (out,), (tuple(x.shape),), ("out",))
    return out.to(x.dtype).contiguous()


@moe_experts.register_fake
def _moe_experts_fake(x, topk_idx, topk_weights, w_gate_up, w_down, block_size=0, impl="reference",
                      activation="silu", limit=SWIGLU_LIMIT, alpha=SWIGLU_ALPHA, b_gate_up=None, b_down=None,
                      lnc=0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _moe_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, idx, tw, wgu, wd, block_size, impl, activation, limit, alpha, b_gate_up, b_down, lnc = inputs
    ctx.save_for_backward(x, idx, tw, wgu, wd, b_gate_up, b_down)
    ctx.block_size, ctx.impl, ctx.act, ctx.lnc = block_size, impl, (activation, limit, alpha), lnc


def _bias_grad(g: Tensor | None, bias: Tensor | None, like: Tensor) -> Tensor:
    """A bias gradient as the op returns it: empty when the op had no such bias."""
    if bias is None:
        return like.new_empty(0)
    return g.to(bias.dtype)


@torch.library.custom_op("trnkit::moe_experts_bwd", mutates_args=())
def moe_experts_bwd(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                    grad_out: Tensor, block_size: int = 0, impl: str = "reference", activation: str = "silu",
                    limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA, b_gate_up: Tensor | None = None,
                    b_down: Tensor | None = None,
                    lnc: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward of ``trnkit::moe_experts``: ``(grad_x, grad_topk_weights, grad_w_gate_up, grad_w_down,
    grad_b_gate_up, grad_b_down)``; a bias gradient is an empty tensor when that bias is None."""
    grads = _run_backward(
        "moe_experts", impl, x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), w_gate_up.contiguous(),
        w_down.contiguous(), grad_out.contiguous(), **block_size_kw(block_size), lnc=lnc,
        **_expert_variant(activation, limit, alpha, b_gate_up, b_down))
    gx, gtw, gwgu, gwd = grads[:4]
    gbgu, gbd = grads[4:] if len(grads) > 4 else (None, None)
    return _dense(gx.to(x.dtype), gtw.to(topk_weights.dtype), gwgu.to(w_gate_up.dtype), gwd.to(w_down.dtype),
                  _bias_grad(gbgu, b_gate_up, x), _bias_grad(gbd, b_down, x))


@moe_experts_bwd.register_fake
def _moe_experts_bwd_fake(x, topk_idx, topk_weights, w_gate_up, w_down, grad_out, block_size=0,
                          impl="reference", activation="silu", limit=SWIGLU_LIMIT, alpha=SWIGLU_ALPHA,
                          b_gate_up=None, b_down=None, lnc=0):
    biases = tuple(x.new_empty(0) if b is None else _empty_dense(b)[0] for b in (b_gate_up, b_down))
    return _empty_dense(x, topk_weights, w_gate_up, w_down) + biases


def _moe_backward(ctx: Any, grad_out: Tensor):
    x, idx, tw, wgu, wd, b_gate_up, b_down = ctx.saved_tensors
    gx, gtw, gwgu, gwd, gbgu, gbd = moe_experts_bwd(x, idx, tw, wgu, wd, grad_out, ctx.block_size, ctx.impl,
                                                    *ctx.act, b_gate_up, b_down, ctx.lnc)
    return (gx, None, gtw, gwgu, gwd, None, None, None, None, None,
            None if b_gate_up is None else gbgu, None if b_down is None else gbd, None)


moe_experts.register_autograd(_moe_backward, setup_context=_moe_setup)


# ------------------------------------------------------------------------------------------- rmsnorm


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


@torch.library.custom_op("trnkit::rmsnorm", mutates_args=())
def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-6, impl: str = "reference",
            lnc: int = 0) -> tuple[Tensor, Tensor]:
    """``(y, rstd)``: ``y = weight * (x * rstd).to(x.dtype)``, ``rstd = rsqrt(mean(x^2) + eps)`` per row (fp32)."""
    check(eps_violations("rmsnorm", eps) + norm_violations("rmsnorm", x, weight))
    fn = _forward_impl("rmsnorm", impl).fn
    y, rstd = fn(x.contiguous(), weight.contiguous(), eps, **_lnc_kw(fn, lnc))
    return _dense(_like("rmsnorm", impl, "y", y, x, torch.promote_types(x.dtype, weight.dtype)),
                  _per_row("rmsnorm", impl, "rstd", rstd, _rows(x)))


@rmsnorm.register_fake
def _rmsnorm_fake(x, weight, eps=1e-6, impl="reference", lnc=0):
    check(eps_violations("rmsnorm", eps) + norm_violations("rmsnorm", x, weight))
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty((_rows(x),), dtype=torch.float32))


def _rmsnorm_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, weight, eps, impl, lnc = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.eps, ctx.impl, ctx.lnc = eps, impl, lnc


@torch.library.custom_op("trnkit::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(x: Tensor, weight: Tensor, rstd: Tensor, grad_y: Tensor, eps: float = 1e-6,
                impl: str = "reference", lnc: int = 0) -> tuple[Tensor, Tensor]:
    """Backward of ``trnkit::rmsnorm``: ``(grad_x, grad_weight)`` (``rstd`` is the forward's, not differentiated)."""
    gx, gw = _run_backward("rmsnorm", impl, x.contiguous(), weight.contiguous(), rstd.contiguous(),
                           grad_y.contiguous(), eps=eps, lnc=lnc)
    return _dense(gx.to(x.dtype).reshape(x.shape), gw.to(weight.dtype))


@rmsnorm_bwd.register_fake
def _rmsnorm_bwd_fake(x, weight, rstd, grad_y, eps=1e-6, impl="reference", lnc=0):
    return _empty_dense(x, weight)


def _rmsnorm_backward(ctx: Any, grad_y: Tensor | None, grad_rstd: Tensor | None):
    x, weight, rstd = ctx.saved_tensors
    if grad_y is None:  # only rstd was used downstream: it carries no gradient
        return torch.zeros_like(x), torch.zeros_like(weight), None, None, None
    gx, gw = rmsnorm_bwd(x, weight, rstd, grad_y, ctx.eps, ctx.impl, ctx.lnc)
    return gx, gw, None, None, None


rmsnorm.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)


@torch.library.custom_op("trnkit::rmsnorm_qk", mutates_args=())
def rmsnorm_qk(q: Tensor, k: Tensor, weight_q: Tensor, weight_k: Tensor, eps: float = 1e-6,
               impl: str = "reference", lnc: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y_q, y_k, rstd_q, rstd_k)``: ``trnkit::rmsnorm`` of ``q`` with ``weight_q`` and of ``k`` with ``weight_k``
    in one call (the q and k head norms)."""
    check(eps_violations("rmsnorm_qk", eps) + norm_violations("rmsnorm_qk", q, weight_q, "q: ")
          + norm_violations("rmsnorm_qk", k, weight_k, "k: "))
    fn = _forward_impl("rmsnorm_qk", impl).fn
    yq, yk, rq, rk = fn(q.contiguous(), k.contiguous(), weight_q.contiguous(), weight_k.contiguous(), eps,
                        **_lnc_kw(fn, lnc))
    return _dense(_like("rmsnorm_qk", impl, "y_q", yq, q, torch.promote_types(q.dtype, weight_q.dtype)),
                  _like("rmsnorm_qk", impl, "y_k", yk, k, torch.promote_types(k.dtype, weight_k.dtype)),
                  _per_row("rmsnorm_qk", impl, "rstd_q", rq, _rows(q)),
                  _per_row("rmsnorm_qk", impl, "rstd_k", rk, _rows(k)))


@rmsnorm_qk.register_fake
def _rmsnorm_qk_fake(q, k, weight_q, weight_k, eps=1e-6, impl="reference", lnc=0):
    check(eps_violations("rmsnorm_qk", eps) + norm_violations("rmsnorm_qk", q, weight_q, "q: ")
          + norm_violations("rmsnorm_qk", k, weight_k, "k: "))
    return (q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, weight_q.dtype)),
            k.new_empty(k.shape, dtype=torch.promote_types(k.dtype, weight_k.dtype)),
            q.new_empty((_rows(q),), dtype=torch.float32), k.new_empty((_rows(k),), dtype=torch.float32))


def _rmsnorm_qk_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, weight_q, weight_k, eps, impl, lnc = inputs
    ctx.save_for_backward(q, k, weight_q, weight_k, output[2], output[3])
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.eps, ctx.impl, ctx.lnc = eps, impl, lnc


@torch.library.custom_op("trnkit::rmsnorm_qk_bwd", mutates_args=())
def rmsnorm_qk_bwd(q: Tensor, k: Tensor, weight_q: Tensor, weight_k: Tensor, rstd_q: Tensor, rstd_k: Tensor,
                   grad_yq: Tensor, grad_yk: Tensor, eps: float = 1e-6, impl: str = "reference",
                   lnc: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of ``trnkit::rmsnorm_qk``: ``(grad_q, grad_k, grad_weight_q, grad_weight_k)``."""
    gq, gk, gwq, gwk = _run_backward("rmsnorm_qk", impl, q.contiguous(), k.contiguous(), weight_q.contiguous(),
                                     weight_k.contiguous(), rstd_q.contiguous(), rstd_k.contiguous(),
                                     grad_yq.contiguous(), grad_yk.contiguous(), eps=eps, lnc=lnc)
    return _dense(gq.to(q.dtype).reshape(q.shape), gk.to(k.dtype).reshape(k.shape), gwq.to(weight_q.dtype),
            gwk.to(weight_k.dtype))


@rmsnorm_qk_bwd.register_fake
def _rmsnorm_qk_bwd_fake(q, k, weight_q, weight_k, rstd_q, rstd_k, grad_yq, grad_yk, eps=1e-6, impl="reference",
                         lnc=0):
    return _empty_dense(q, k, weight_q, weight_k)


def _rmsnorm_qk_backward(ctx: Any, grad_yq: Tensor | None, grad_yk: Tensor | None, grad_rq: Tensor | None,
                         grad_rk: Tensor | None):
    q, k, weight_q, weight_k, rstd_q, rstd_k = ctx.saved_tensors
    if grad_yq is None and grad_yk is None:  # only the rstds were used downstream: they carry no gradient
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(weight_q), torch.zeros_like(weight_k),
                None, None, None)
    dt_q, dt_k = torch.promote_types(q.dtype, weight_q.dtype), torch.promote_types(k.dtype, weight_k.dtype)
    grad_yq = torch.zeros(q.shape, dtype=dt_q, device=q.device) if grad_yq is None else grad_yq
    grad_yk = torch.zeros(k.shape, dtype=dt_k, device=k.device) if grad_yk is None else grad_yk
    gq, gk, gwq, gwk = rmsnorm_qk_bwd(q, k, weight_q, weight_k, rstd_q, rstd_k, grad_yq, grad_yk, ctx.eps,
                                      ctx.impl, ctx.lnc)
    return gq, gk, gwq, gwk, None, None, None


rmsnorm_qk.register_autograd(_rmsnorm_qk_backward, setup_context=_rmsnorm_qk_setup)


# ------------------------------------------------------------------------------ linear cross-entropy


@torch.library.custom_op("trnkit::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                         impl: str = "reference", lnc: int = 0) -> tuple[Tensor, Tensor]:
    """``(loss, lse [T])``: ``cross_entropy(hidden @ weight.T, labels, reduction="sum")`` (fp32) and the
    log-sum-exp of each token's logits (saved for the backward)."""
    check_lce_inputs("linear_cross_entropy", hidden, weight, labels)
    fn = _forward_impl("linear_cross_entropy", impl).fn
    loss, lse = fn(hidden.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index=ignore_index,
                   **_lnc_kw(fn, lnc))
    return _dense(loss.to(torch.float32).reshape(()),
                  _per_row("linear_cross_entropy", impl, "lse", lse, hidden.shape[0]))


@linear_cross_entropy.register_fake
def _linear_cross_entropy_fake(hidden, weight, labels, ignore_index=-100, impl="reference", lnc=0):
    check_lce_inputs("linear_cross_entropy", hidden, weight, labels)
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty((hidden.shape[0],), dtype=torch.float32)


def _lce_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    hidden, weight, labels, ignore_index, impl, lnc = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.ignore_index, ctx.impl, ctx.lnc = ignore_index, impl, lnc


@torch.library.custom_op("trnkit::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, grad_loss: Tensor,
                             ignore_index: int = -100, impl: str = "reference",
                             lnc: int = 0) -> tuple[Tensor, Tensor]:
    """Backward of ``trnkit::linear_cross_entropy``: ``(grad_hidden, grad_weight)`` for the loss gradient
    ``grad_loss`` (a scalar tensor)."""
    gh, gw = _run_backward("linear_cross_entropy", impl, hidden.contiguous(), weight.contiguous(),
                           labels.contiguous(), lse.contiguous(), grad_loss.detach().reshape(()),
                           ignore_index=ignore_index, lnc=lnc)
    return _dense(gh.to(hidden.dtype), gw.to(weight.dtype))


@linear_cross_entropy_bwd.register_fake
def _linear_cross_entropy_bwd_fake(hidden, weight, labels, lse, grad_loss, ignore_index=-100, impl="reference",
                                   lnc=0):
    return _empty_dense(hidden, weight)


def _lce_backward(ctx: Any, grad_loss: Tensor | None, grad_lse: Tensor | None):
    hidden, weight, labels, lse = ctx.saved_tensors
    if grad_loss is None:  # only lse was used downstream: it carries no gradient
        return torch.zeros_like(hidden), torch.zeros_like(weight), None, None, None, None
    gh, gw = linear_cross_entropy_bwd(hidden, weight, labels, lse, grad_loss, ctx.ignore_index, ctx.impl, ctx.lnc)
    return gh, gw, None, None, None, None


linear_cross_entropy.register_autograd(_lce_backward, setup_context=_lce_setup)


@functools.cache
def _takes_with_grad(fn: Any) -> bool:
    return "with_grad" in inspect.signature(fn).parameters


@torch.library.custom_op("trnkit::linear_cross_entropy_fused", mutates_args=())
def linear_cross_entropy_fused(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                               impl: str = "reference", lnc: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, lse [T], grad_hidden [T, H] f32, grad_weight [V, H] f32)``: ``trnkit::linear_cross_entropy`` and
    its gradients at a loss gradient of 1, computed in the forward (the one-pass schedule: no logits computed
    twice). Its backward only multiplies the stored fp32 gradients by the loss gradient (a scalar: the loss
    is a sum) and rounds them to the inputs' dtypes. An impl whose ``fn`` takes ``with_grad`` computes them
    in one call (``fn(..., with_grad=True) -> (loss, lse, grad_hidden, grad_weight)``); for any other, its
    backward runs at a loss gradient of 1."""
    check_lce_inputs("linear_cross_entropy_fused", hidden, weight, labels)
    entry = _forward_impl("linear_cross_entropy", impl)
    fn = entry.fn
    args = (hidden.contiguous(), weight.contiguous(), labels.contiguous())
    if _takes_with_grad(fn):
        loss, lse, gh, gw = fn(*args, ignore_index=ignore_index, with_grad=True, **_lnc_kw(fn, lnc))
        _check_shapes("linear_cross_entropy_fused", impl, (gh, gw), (tuple(hidden.shape), tuple(weight.shape)),
                      ("grad_hidden", "grad_weight"))
        lse = _per_row("linear_cross_entropy_fused", impl, "lse", lse, hidden.shape[0])
    else:
        loss, lse = fn(*args, ignore_index=ignore_index, **_lnc_kw(fn, lnc))
        lse = _per_row("linear_cross_entropy_fused", impl, "lse", lse, hidden.shape[0])
        gh, gw = _run_backward("linear_cross_entropy", impl, *args, lse, torch.ones((), dtype=torch.float32),
                               ignore_index=ignore_index, lnc=lnc)
    return _dense(loss.to(torch.float32).reshape(()), lse, gh.to(torch.float32),
                  gw.to(torch.float32))


@linear_cross_entropy_fused.register_fake
def _linear_cross_entropy_fused_fake(hidden, weight, labels, ignore_index=-100, impl="reference", lnc=0):
    check_lce_inputs("linear_cross_entropy_fused", hidden, weight, labels)
    f32 = torch.float32
    return (hidden.new_empty((), dtype=f32), hidden.new_empty((hidden.shape[0],), dtype=f32),
            hidden.new_empty(hidden.shape, dtype=f32), weight.new_empty(weight.shape, dtype=f32))


def _lce_fused_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    hidden, weight = inputs[0], inputs[1]
    ctx.save_for_backward(output[2], output[3])
    ctx.mark_non_differentiable(*output[1:])
    ctx.dtypes = (hidden.dtype, weight.dtype)
    ctx.set_materialize_grads(False)


def _lce_fused_backward(ctx: Any, grad_loss: Tensor | None, grad_lse: Tensor | None, grad_gh: Tensor | None,
                        grad_gw: Tensor | None):
    gh, gw = ctx.saved_tensors
    if grad_loss is None:  # only lse (or the stored gradients) used downstream: they carry no gradient
        return torch.zeros_like(gh, dtype=ctx.dtypes[0]), torch.zeros_like(gw, dtype=ctx.dtypes[1]), None, None, \
            None, None
    g = grad_loss.reshape(()).to(torch.float32)
    return (gh * g).to(ctx.dtypes[0]), (gw * g).to(ctx.dtypes[1]), None, None, None, None


linear_cross_entropy_fused.register_autograd(_lce_fused_backward, setup_context=_lce_fused_setup)


# ----------------------------------------------------------------------------------------- attention


def _fixed_shift_kw(impl: str, fixed_shift: bool | None) -> dict[str, bool]:
    """``fixed_shift`` as the attention impl's keyword argument: passed when set (None: the impl's default);
    an impl that does not declare it cannot honour it, so the op refuses (the rule of
    :func:`~trnkit.overrides.config.fixed_shift_problem`, which checks a :class:`~trnkit.overrides.KernelChoice`
    earlier)."""
    if fixed_shift is None:
        return {}
    problem = fixed_shift_problem("attention", impl)
    if problem:
        raise ValueError(f"trnkit::attention: fixed_shift={fixed_shift} {problem}")
    return {"fixed_shift": fixed_shift}


@torch.library.custom_op("trnkit::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, impl: str = "reference",
              lnc: int = 0, fixed_shift: bool | None = None) -> tuple[Tensor, Tensor]:
    """Causal GQA attention ``(o [B, S, Hq, D], lse [B, Hq, S] f32)`` of ``q [B, S, Hq, D]``, ``k, v [B, S, Hk, D]``."""
    check_attention_inputs(q, k, v)
    B, S, H, _ = q.shape
    fn = _forward_impl("attention", impl).fn
    o, lse = fn(q.contiguous(), k.contiguous(), v.contiguous(), scale, **_lnc_kw(fn, lnc),
                **_fixed_shift_kw(impl, fixed_shift))
    # exact shapes, not a reshape: an impl's o in [B, Hq, S, D] (the other common layout) would be scrambled
    _check_shapes("attention", impl, (o, lse), (tuple(q.shape), (B, H, S)), ("o", "lse"))
    return _dense(o.to(q.dtype), lse.to(torch.float32))


@attention.register_fake
def _attention_fake(q, k, v, scale, impl="reference", lnc=0, fixed_shift=None):
    check_attention_inputs(q, k, v)
    B, S, H, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, H, S), dtype=torch.float32)


def _attention_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, v, scale, impl, lnc, _ = inputs  # (fixed_shift: the backward is the same)
    ctx.save_for_backward(q, k, v, *output)
    ctx.mark_non_differentiable(output[1])
    ctx.scale, ctx.impl, ctx.lnc = scale, impl, lnc


@torch.library.custom_op("trnkit::attention_bwd", mutates_args=())
def attention_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, grad_o: Tensor, scale: float,
                  impl: str = "reference", lnc: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``trnkit::attention``: ``(grad_q, grad_k, grad_v)`` from the forward's ``o`` and ``lse``."""
    dq, dk, dv = _run_backward("attention", impl, q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                               lse.contiguous(), grad_o.contiguous(), scale=scale, lnc=lnc)
    return (dq.to(q.dtype).reshape(q.shape).contiguous(), dk.to(k.dtype).reshape(k.shape).contiguous(),
            dv.to(v.dtype).reshape(v.shape).contiguous())


@attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, o, lse, grad_o, scale, impl="reference", lnc=0):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _attention_backward(ctx: Any, grad_o: Tensor | None, grad_lse: Tensor | None):
    q, k, v, o, lse = ctx.saved_tensors
    if grad_o is None:  # only lse was used downstream: it carries no gradient
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None, None
    dq, dk, dv = attention_bwd(q, k, v, o, lse, grad_o, ctx.scale, ctx.impl, ctx.lnc)
    return dq, dk, dv, None, None, None, None


attention.register_autograd(_attention_backward, setup_context=_attention_setup)


# ----------------------------------------------------------------------------------------------- mlp


@torch.library.custom_op("trnkit::mlp", mutates_args=())
def mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, impl: str = "reference", lnc: int = 0) -> Tensor:
    """The dense SwiGLU MLP ``y = (silu(x @ Wg) * (x @ Wu)) @ w_down`` of ``x [..., H]``, ``w_gate_up [H, 2I]``,
    ``w_down [I, H]``."""
    check_mlp_inputs(x, w_gate_up, w_down)
    fn = _forward_impl("mlp", impl).fn
    y = fn(x.contiguous(), w_gate_up.contiguous(), w_down.contiguous(), **_lnc_kw(fn, lnc))
    return _like("mlp", impl, "y", y, x, x.dtype).contiguous()


@mlp.register_fake
def _mlp_fake(x, w_gate_up, w_down, impl="reference", lnc=0):
    check_mlp_inputs(x, w_gate_up, w_down)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _mlp_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, w_gate_up, w_down, impl, lnc = inputs
    ctx.save_for_backward(x, w_gate_up, w_down)
    ctx.impl, ctx.lnc = impl, lnc


@torch.library.custom_op("trnkit::mlp_bwd", mutates_args=())
def mlp_bwd(x: Tensor, w_gate_up: Tensor, w_down: Tensor, grad_y: Tensor,
            impl: str = "reference", lnc: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``trnkit::mlp``: ``(grad_x, grad_w_gate_up, grad_w_down)`` (activations recomputed)."""
    gx, gwgu, gwd = _run_backward("mlp", impl, x.contiguous(), w_gate_up.contiguous(), w_down.contiguous(),
                                  grad_y.contiguous(), lnc=lnc)
    return (gx.to(x.dtype).reshape(x.shape).contiguous(), gwgu.to(w_gate_up.dtype).contiguous(),
            gwd.to(w_down.dtype).contiguous())


@mlp_bwd.register_fake
def _mlp_bwd_fake(x, w_gate_up, w_down, grad_y, impl="reference", lnc=0):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, w_gate_up, w_down))


def _mlp_backward(ctx: Any, grad_y: Tensor):
    x, w_gate_up, w_down = ctx.saved_tensors
    gx, gwgu, gwd = mlp_bwd(x, w_gate_up, w_down, grad_y, ctx.impl, ctx.lnc)
    return gx, gwgu, gwd, None, None


mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup)
