"""Built-in implementations: ``reference`` (the kernels' torch ``*_ref``) and ``nki`` (the kernels).

Registered when :mod:`trnkit.overrides` is imported. The kernel modules are imported at registration (a
missing one only fails when its impl is used). ``nki`` on a CPU tensor runs trnkit's NKI interpreter, on
a ``neuron`` tensor the real NKI kernel (the resolver in :mod:`trnkit.nki_api` decides which).

The ``nki`` impls of the kernels that split work over a trn2 logical core take ``lnc`` (None: the
device default); the ops pass it from the override configuration.

The reference backward is the kernels' ``*_bwd_ref`` (``rope_hf_ref(..., backward=True)`` for RoPE).
The MoE references enforce the kernels' input domain themselves (they ``check`` the same
constraints), so ``reference`` declares those constraints too and selection sees them up front.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from trnkit.kernels.constraints import Violation, check
from trnkit.overrides.ops import autograd_enabled
from trnkit.overrides.registry import REFERENCE, mark_builtin, register

__all__ = ["NKI", "register_builtins"]

NKI = "nki"
NKI_DEVICES = ("cpu", "neuron")


_KERNEL_MODULES: dict[str, ModuleType] = {}


def _kernel(name: str) -> ModuleType:
    # A dict lookup (traceable by torch.compile); the import happens once, eagerly, see register_builtins.
    mod = _KERNEL_MODULES.get(name)
    if mod is None:
        mod = _KERNEL_MODULES[name] = importlib.import_module(f"trnkit.kernels.{name}")
    return mod


def _attr(module: str, name: str) -> Callable[..., Any]:
    return getattr(_kernel(module), name)


# ---------------------------------------------------------------------------------------------- rope


def _rope_fn(layout: str, suffix: str = "") -> Callable[..., Any]:
    return _attr("rope", ("rope_hf" if layout == "bhsd" else "rope_hf_bshd") + suffix)


def _rope_ref(q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor, cos: Tensor | None = None,
              sin: Tensor | None = None, rope_cache: Tensor | None = None, backward: bool = False,
              layout: str = "bhsd") -> Any:
    return _rope_fn(layout, "_ref")(q, k, q_out, k_out, cos=cos, sin=sin, rope_cache=rope_cache, backward=backward)


def _rope_nki(q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor, cos: Tensor | None = None,
              sin: Tensor | None = None, rope_cache: Tensor | None = None, backward: bool = False,
              layout: str = "bhsd", lnc: int | None = None) -> Any:
    return _rope_fn(layout)(q, k, q_out, k_out, cos=cos, sin=sin, rope_cache=rope_cache, backward=backward, lnc=lnc)


def _rope_constraints(q: Tensor, k: Tensor, cos: Tensor | None = None, sin: Tensor | None = None,
                      rope_cache: Tensor | None = None, layout: str = "bhsd", **_: Any) -> list[Violation]:
    return _attr("rope", "constraints")(q, k, cos=cos, sin=sin, rope_cache=rope_cache, layout=layout)


# -------------------------------------------------------------------------------------------- router


def _router_ref(x: Tensor, w_router: Tensor, top_k: int, norm_topk_prob: bool = True, **variant: Any):
    return _attr("router", "router_topk_ref")(x, w_router, top_k, norm_topk_prob, **variant)


def _router_nki(x: Tensor, w_router: Tensor, top_k: int, norm_topk_prob: bool = True, lnc: int | None = None,
                **variant: Any):
    weights, idx, logits = _attr("router", "router_topk")(x, w_router, top_k, norm_topk_prob, lnc=lnc, **variant)
    return _nonfinite_tokens_as_reference(x, w_router, top_k, norm_topk_prob, weights, idx, logits, variant)


def _nonfinite_tokens_as_reference(x: Tensor, w_router: Tensor, top_k: int, norm_topk_prob: bool,
                                   weights: Tensor, idx: Tensor, logits: Tensor,
                                   variant: dict) -> tuple[Tensor, Tensor, Tensor]:
    """A token whose router logits are not all finite gets the reference's outcome.

    The kernel's max8 / find_index8 selection has no defined answer for NaN logits (it returned expert
    ids outside [0, E), which the experts then reject with a misleading range error). The reference's
    stable sort gives valid ids (an all-NaN row: experts 0..K-1) with NaN weights, so the token's output
    is NaN and the trainer stops with its non-finite-loss message. Finite tokens keep the kernel's
    results; the check is one reduction over the [T, E] logits.
    """
    bad = ~torch.isfinite(logits).all(dim=-1)
    if not bool(bad.any()):
        return weights, idx, logits
    ref_w, ref_idx, _ = _router_ref(x[bad], w_router, top_k, norm_topk_prob, **variant)
    weights, idx = weights.clone(), idx.clone()
    weights[bad] = ref_w.to(weights.dtype)
    idx[bad] = ref_idx.to(idx.dtype)
    return weights, idx, logits


def _router_ref_bwd(x, w_router, router_logits, topk_idx, grad_topk_weights, grad_router_logits,
                    norm_topk_prob=True, **variant: Any):
    with autograd_enabled():  # router_topk_bwd_ref differentiates the reference with autograd
            return _attr("router", "router_topk_bwd_ref")(x, w_router, router_logits, topk_idx,
                                                           grad_topk_weights, grad_router_logits,
                                                           norm_topk_prob=norm_topk_prob, **variant)


def _router_nki_bwd(x, w_router, router_logits, topk_idx, grad_topk_weights, grad_router_logits,
                    norm_topk_prob=True, lnc: int | None = None, **variant: Any):
    return _attr("router", "router_topk_bwd")(x, w_router, router_logits, topk_idx, grad_topk_weights,
                                              grad_router_logits, norm_topk_prob=norm_topk_prob, lnc=lnc, **variant)


def _router_constraints(x: Tensor, w_router: Tensor, top_k: int, scoring: str = "softmax",
                        selection_bias: Tensor | None = None, routed_scaling_factor: float = 1.0,
                        **_: Any) -> list[Violation]:
    return _attr("router", "constraints")(x, w_router, top_k, scoring=scoring, selection_bias=selection_bias,
                                               routed_scaling_factor=routed_scaling_factor)


# ----------------------------------------------------------------------------------------------- moe


def _moe_constraints_fn(op: str) -> Callable[..., list[Violation]]:
    """The moe kernel module's constraint function for ``op`` (``<op>_constraints`` or ``constraints``)."""
    mod = _kernel("moe")
    return getattr(mod, f"{op}_constraints", None) or getattr(mod, "constraints")


def _gmm_ref(x: Tensor, w: Tensor, group_offsets: Tensor) -> Tensor:
    return _attr("moe", "grouped_mm_ref")(x, w, group_offsets)


def _gmm_nki(x: Tensor, w: Tensor, group_offsets: Tensor, lnc: int | None = None) -> Tensor:
    return _attr("moe", "grouped_mm")(x, w, group_offsets, lnc=lnc)


def _gmm_ref_bwd(x: Tensor, w: Tensor, group_offsets: Tensor, grad_out: Tensor):
    return _attr("moe", "grouped_mm_bwd_ref")(x, w, group_offsets, grad_out)


def _gmm_nki_bwd(x: Tensor, w: Tensor, group_offsets: Tensor, grad_out: Tensor, lnc: int | None = None):
    return _attr("moe", "grouped_mm_bwd")(x, w, group_offsets, grad_out, lnc=lnc)


def _gmm_constraints(x: Tensor, w: Tensor, group_offsets: Tensor, **_: Any) -> list[Violation]:
    return _moe_constraints_fn("grouped_mm")(x, w, group_offsets)


# the nki impls' extra rule, widths >= 1 (the kernels' entry checks refuse a 0; the reference computes it)
def _gmm_nki_constraints(x: Tensor, w: Tensor, group_offsets: Tensor, **_: Any) -> list[Violation]:
    return _gmm_constraints(x, w, group_offsets) + _attr("moe", "zero_width_violations")("grouped_mm", x, w)


# block_size (and the expert variant) reach the kernels as keywords only when the op sets them: the
# kernels' own defaults are their tuned block sizes (forward 512, backward 128).
def _moe_ref(x, topk_idx, topk_weights, w_gate_up, w_down, **kw: Any) -> Tensor:
    return _attr("moe", "moe_experts_ref")(x, topk_idx, topk_weights, w_gate_up, w_down, **kw)


def _moe_nki(x, topk_idx, topk_weights, w_gate_up, w_down, lnc=None, **kw: Any) -> Tensor:
    return _attr("moe", "moe_experts")(x, topk_idx, topk_weights, w_gate_up, w_down, lnc=lnc, **kw)


def _moe_ref_bwd(x, topk_idx, topk_weights, w_gate_up, w_down, grad_out, **kw: Any):
    return _attr("moe", "moe_experts_bwd_ref")(x, topk_idx, topk_weights, w_gate_up, w_down, grad_out, **kw)


def _moe_nki_bwd(x, topk_idx, topk_weights, w_gate_up, w_down, grad_out, lnc=None, **kw: Any):
    return _attr("moe", "moe_experts_bwd")(x, topk_idx, topk_weights, w_gate_up, w_down, grad_out, lnc=lnc, **kw)


class _IndexSpec:
    """Shape/dtype stand-in for ``topk_idx`` handed to the kernel's constraint function.

    Selection must not read tensor values (they are fake during the dry run and symbolic under
    torch.compile); the index *range* is data, checked by the kernel's own entry check at run time.
    """

    def __init__(self, t: Tensor) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()


_VARIANT_ARGS = ("activation", "limit", "alpha", "b_gate_up", "b_down")


def _moe_constraints(x, topk_idx, topk_weights, w_gate_up, w_down, block_size=128, **rest: Any) -> list[Violation]:
    variant = {k: v for k, v in rest.items() if k in _VARIANT_ARGS}
    # the backward holds a weight and its transpose in SBUF: its limit applies once a gradient will be asked for
    # (x stands in for grad_out: same shape and dtype)
    backward = any(getattr(t, "requires_grad", False) for t in (x, topk_weights, w_gate_up, w_down))
    return _moe_constraints_fn("moe_experts")(x, _IndexSpec(topk_idx), topk_weights, w_gate_up, w_down,
                                              block_size=block_size, grad_out=x if backward else None, **variant)


def _moe_nki_constraints(x, topk_idx, topk_weights, w_gate_up, w_down, **rest: Any) -> list[Violation]:
    return (_moe_constraints(x, topk_idx, topk_weights, w_gate_up, w_down, **rest)
            + _attr("moe", "zero_width_violations")("moe_experts", x, w_gate_up))


# ------------------------------------------------------------------------------------------- rmsnorm


def _rmsnorm_ref(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    return _attr("rmsnorm", "rmsnorm_ref")(x, weight, eps)


def _rmsnorm_nki(x: Tensor, weight: Tensor, eps: float = 1e-6, lnc: int | None = None) -> tuple[Tensor, Tensor]:
    return _attr("rmsnorm", "rmsnorm")(x, weight, eps, lnc=lnc)


def _rmsnorm_ref_bwd(x: Tensor, weight: Tensor, rstd: Tensor, grad_y: Tensor, eps: float = 1e-6):
    return _attr("rmsnorm", "rmsnorm_bwd_ref")(grad_y, x, weight, rstd)


def _rmsnorm_nki_bwd(x: Tensor, weight: Tensor, rstd: Tensor, grad_y: Tensor, eps: float = 1e-6,
                     lnc: int | None = None):
    return _attr("rmsnorm", "rmsnorm_bwd")(grad_y, x, weight, rstd, lnc=lnc)


def _rmsnorm_constraints(x: Tensor, weight: Tensor, eps: float = 1e-6, **_: Any) -> list[Violation]:
    # the backward serves narrower rows than the forward: its limits apply once a gradient will be asked for
    backward = any(getattr(t, "requires_grad", False) for t in (x, weight))
    return _attr("rmsnorm", "rmsnorm_constraints")(x, weight, eps, backward=backward)


def _rmsnorm_qk_ref(q: Tensor, k: Tensor, weight_q: Tensor, weight_k: Tensor, eps: float = 1e-6):
    return _attr("rmsnorm", "rmsnorm_qk_ref")(q, k, weight_q, weight_k, eps)


def _rmsnorm_qk_nki(q: Tensor, k: Tensor, weight_q: Tensor, weight_k: Tensor, eps: float = 1e-6,
                    lnc: int | None = None):
    return _attr("rmsnorm", "rmsnorm_qk")(q, k, weight_q, weight_k, eps, lnc=lnc)


def _rmsnorm_qk_ref_bwd(q: Tensor, k: Tensor, weight_q: Tensor, weight_k: Tensor, rstd_q: Tensor, rstd_k: Tensor,
                        grad_yq: Tensor, grad_yk: Tensor, eps: float = 1e-6):
    return _attr("rmsnorm", "rmsnorm_qk_bwd_ref")(grad_yq, grad_yk, q, k, weight_q, weight_k, rstd_q, rstd_k)


def _rmsnorm_qk_nki_bwd(q: Tensor, k: Tensor, weight_q: Tensor, weight_k: Tensor, rstd_q: Tensor, rstd_k: Tensor,
                        grad_yq: Tensor, grad_yk: Tensor, eps: float = 1e-6, lnc: int | None = None):
    return _attr("rmsnorm", "rmsnorm_qk_bwd")(grad_yq, grad_yk, q, k, weight_q, weight_k, rstd_q, rstd_k, lnc=lnc)


def _rmsnorm_qk_constraints(q: Tensor, k: Tensor, weight_q: Tensor, weight_k: Tensor, eps: float = 1e-6,
                            **_: Any) -> list[Violation]:
    backward = any(getattr(t, "requires_grad", False) for t in (q, k, weight_q, weight_k))
    return _attr("rmsnorm", "rmsnorm_qk_constraints")(q, k, weight_q, weight_k, eps, backward=backward)


# ------------------------------------------------------------------------------ linear cross-entropy


def _lce_ref(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100, with_grad: bool = False):
    # the kernels' label rule (theirs is in their wrappers); the reference's gather would stop on an index error
    check(_attr("cross_entropy", "label_range_violations")(labels, weight.shape[0], ignore_index,
                                                         "linear_cross_entropy"))
    if with_grad:  # (loss, lse, grad_hidden f32, grad_weight f32) at a loss gradient of 1
        return _attr("cross_entropy", "linear_cross_entropy_fwd_bwd_ref")(hidden, weight, labels, ignore_index, "sum")
    return _attr("cross_entropy", "linear_cross_entropy_ref")(hidden, weight, labels, ignore_index, "sum")


def _lce_ref_bwd(hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, grad_loss: Tensor,
                 ignore_index: int = -100):
    return _attr("cross_entropy", "linear_cross_entropy_bwd_ref")(hidden, weight, labels, lse, grad_loss,
                                                                  ignore_index, "sum")


def _lce_nki(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100, lnc: int | None = None,
             with_grad: bool = False):
    if with_grad:  # the one-pass kernel: (loss, lse, grad_hidden f32, grad_weight f32) at a loss gradient of 1
        return _attr("cross_entropy", "linear_cross_entropy_fwd_bwd")(hidden, weight, labels, ignore_index, "sum",
                                                                      lnc=lnc)
    return _attr("cross_entropy", "linear_cross_entropy")(hidden, weight, labels, ignore_index, "sum", lnc=lnc)


def _lce_nki_bwd(hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, grad_loss: Tensor,
                 ignore_index: int = -100, lnc: int | None = None):
    return _attr("cross_entropy", "linear_cross_entropy_bwd")(hidden, weight, labels, lse, grad_loss,
                                                              ignore_index, "sum", lnc=lnc)


def _lce_constraints(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                     **_: Any) -> list[Violation]:
    return _attr("cross_entropy", "linear_cross_entropy_constraints")(hidden, weight, labels, ignore_index, "sum")
# ----------------------------------------------------------------------------------------- attention


def _attention_ref(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    if q.shape[1] == 0:  # no query rows: attention_ref's row max would reduce over no keys
        return q.clone(), q.new_empty((q.shape[0], q.shape[2], 0), dtype=torch.float32)
    return _attr("attention", "attention_ref")(q, k, v, scale)


def _attention_nki(q: Tensor, k: Tensor, v: Tensor, scale: float, lnc: int | None = None,
                   fixed_shift: bool = True) -> tuple[Tensor, Tensor]:
    return _attr("attention", "attention")(q, k, v, scale, lnc=lnc, fixed_shift=fixed_shift)


def _attention_ref_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, grad_o: Tensor, scale: float):
    return _attr("attention", "attention_bwd_ref")(q, k, v, o, lse, grad_o, scale)


def _attention_nki_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, grad_o: Tensor, scale: float,
                       lnc: int | None = None):
    return _attr("attention", "attention_bwd")(q, k, v, o, lse, grad_o, scale, lnc=lnc)


def _attention_constraints(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, **_: Any) -> list[Violation]:
    return _attr("attention", "attention_constraints")(q, k, v, scale)


# ----------------------------------------------------------------------------------------------- mlp


def _mlp_ref(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    return _attr("mlp", "mlp_ref")(x, w_gate_up, w_down)


def _mlp_nki(x: Tensor, w_gate_up: Tensor, w_down: Tensor, lnc: int | None = None) -> Tensor:
    return _attr("mlp", "mlp")(x, w_gate_up, w_down, lnc=lnc)


def _mlp_ref_bwd(x: Tensor, w_gate_up: Tensor, w_down: Tensor, grad_y: Tensor):
    return _attr("mlp", "mlp_bwd_ref")(x, w_gate_up, w_down, grad_y)


def _mlp_nki_bwd(x: Tensor, w_gate_up: Tensor, w_down: Tensor, grad_y: Tensor, lnc: int | None = None):
    return _attr("mlp", "mlp_bwd")(x, w_gate_up, w_down, grad_y, lnc=lnc)


def _mlp_constraints(x: Tensor, w_gate_up: Tensor, w_down: Tensor, **_: Any) -> list[Violation]:
    return _attr("mlp", "mlp_constraints")(x, w_gate_up, w_down)


def _builtin(op: str, name: str, fn: Callable[..., Any], **kwargs: Any) -> None:
    mark_builtin(register(op, name, fn, **kwargs))


def register_builtins() -> None:
    """Register ``reference`` and ``nki`` for every op (idempotent)."""
    for name in ("rope", "router", "moe", "rmsnorm", "cross_entropy", "attention", "mlp"):
        try:
            _kernel(name)
        except ImportError:  # reported when the impl is first used
            pass
    # their backwards are explicit formulas/kernels: no autograd needed inside the op
    ref = {"has_backward": True, "compile_ok": True, "autograd_backward": False,
           "description": "torch reference (trnkit.kernels *_ref)"}
    nki = {"has_backward": True, "compile_ok": True, "autograd_backward": False, "devices": NKI_DEVICES,
           "description": "NKI kernel (interpreter on CPU, real NKI on neuron)"}
    _builtin("rope_hf", REFERENCE, _rope_ref, **ref)
    _builtin("rope_hf", NKI, _rope_nki, constraints=_rope_constraints, **nki)
    _builtin("router_topk", REFERENCE, _router_ref, backward=_router_ref_bwd, **ref)
    _builtin("router_topk", NKI, _router_nki, backward=_router_nki_bwd, constraints=_router_constraints, **nki)
    _builtin("grouped_mm", REFERENCE, _gmm_ref, backward=_gmm_ref_bwd, constraints=_gmm_constraints, **ref)
    _builtin("grouped_mm", NKI, _gmm_nki, backward=_gmm_nki_bwd, constraints=_gmm_nki_constraints, **nki)
    _builtin("moe_experts", REFERENCE, _moe_ref, backward=_moe_ref_bwd, constraints=_moe_constraints, **ref)
    _builtin("moe_experts", NKI, _moe_nki, backward=_moe_nki_bwd, constraints=_moe_nki_constraints, **nki)
    _builtin("rmsnorm", REFERENCE, _rmsnorm_ref, backward=_rmsnorm_ref_bwd, **ref)
    _builtin("rmsnorm", NKI, _rmsnorm_nki, backward=_rmsnorm_nki_bwd, constraints=_rmsnorm_constraints, **nki)
    _builtin("rmsnorm_qk", REFERENCE, _rmsnorm_qk_ref, backward=_rmsnorm_qk_ref_bwd, **ref)
    _builtin("rmsnorm_qk", NKI, _rmsnorm_qk_nki, backward=_rmsnorm_qk_nki_bwd, constraints=_rmsnorm_qk_constraints,
             **nki)
    _builtin("linear_cross_entropy", REFERENCE, _lce_ref, backward=_lce_ref_bwd, **ref)
    _builtin("linear_cross_entropy", NKI, _lce_nki, backward=_lce_nki_bwd, constraints=_lce_constraints, **nki)
    _builtin("attention", REFERENCE, _attention_ref, backward=_attention_ref_bwd, **ref)
    _builtin("attention", NKI, _attention_nki, backward=_attention_nki_bwd, constraints=_attention_constraints,
             **nki)
    _builtin("mlp", REFERENCE, _mlp_ref, backward=_mlp_ref_bwd, **ref)
    _builtin("mlp", NKI, _mlp_nki, backward=_mlp_nki_bwd, constraints=_mlp_constraints, **nki)

