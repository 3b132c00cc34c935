"""Flash attention (causal, GQA) as NKI kernels: forward with the log-sum-exp saved, and the backward.

``attention(q, k, v, scale)`` -> ``(o, lse)``; ``attention_bwd(q, k, v, o, lse, grad_o, scale)`` ->
``(grad_q, grad_k, grad_v)``. Layout ``[B, S, H, D]`` (q ``Hq`` heads, k / v ``Hk``, ``Hq % Hk == 0``),
``lse [B, Hq, S]`` fp32, ``scale`` defaults to ``D ** -0.5``. The torch references of the same
signatures are in :mod:`trnkit.kernels.attention.attention_torch`; the designs in
:mod:`trnkit.kernels.attention.flash_fwd_shift` (the forward: a fixed shift per row, certified, with the
exact forward of :mod:`trnkit.kernels.attention.flash_fwd` as its fallback) and
:mod:`trnkit.kernels.attention.flash_bwd` (imported, with the NKI backend, on the first call).
"""

from __future__ import annotations

from typing import Any

from trnkit.kernels._common import dense
from trnkit.kernels.attention.attention_torch import attention_bwd_ref, attention_ref, fixed_shift_failures
from trnkit.kernels.attention.constraints import attention_bwd_constraints, attention_constraints
from trnkit.kernels.constraints import check
from trnkit.kernels.lnc import launch, resolve_lnc

__all__ = ["attention", "attention_bwd", "attention_bwd_constraints", "attention_bwd_ref", "attention_constraints",
           "attention_ref", "fixed_shift_failures"]


def _scale(q: Any, scale: float | None) -> float:
    return float(q.shape[-1]) ** -0.5 if scale is None else float(scale)


def attention(q: Any, k: Any, v: Any, scale: float | None = None, lnc: int | None = None,
              fixed_shift: bool = True) -> tuple[Any, Any]:
    """``(o [B, S, Hq, D] q.dtype, lse [B, Hq, S] fp32)``: causal GQA attention (NKI kernel).

    ``fixed_shift`` (default): the forward with a fixed softmax shift per row and a per-launch fallback to
    the exact one (:mod:`trnkit.kernels.attention.flash_fwd_shift`; the same results to fp32 precision,
    faster); :func:`fixed_shift_failures` says in torch which rows of given inputs would make a launch fall
    back. ``fixed_shift=False``: the exact forward alone (:mod:`trnkit.kernels.attention.flash_fwd`, a
    running row max).
    Raises :class:`~trnkit.kernels.constraints.KernelConstraintError` on inputs outside the constraints.
    """
    if not isinstance(fixed_shift, bool):
        raise TypeError(f"attention: argument fixed_shift must be a bool, got {fixed_shift!r}")
    if fixed_shift:
        from trnkit.kernels.attention.flash_fwd_shift import attention_fwd_shift_kernel as kernel
    else:
        from trnkit.kernels.attention.flash_fwd import attention_fwd_kernel as kernel

    check(attention_constraints(q, k, v, scale))
    return launch(kernel, resolve_lnc(lnc))(dense(q), dense(k), dense(v), _scale(q, scale))


def attention_bwd(q: Any, k: Any, v: Any, o: Any, lse: Any, grad_o: Any, scale: float | None = None,
                  lnc: int | None = None) -> tuple[Any, Any, Any]:
    """``(grad_q, grad_k, grad_v)`` of :func:`attention` from its ``o`` and ``lse`` and the output gradient
    ``grad_o`` (q's shape and dtype) (NKI kernel)."""
    from trnkit.kernels.attention.flash_bwd import attention_bwd_kernel

    check(attention_bwd_constraints(q, k, v, o, lse, grad_o, scale))
    return launch(attention_bwd_kernel, resolve_lnc(lnc))(dense(q), dense(k), dense(v), dense(o),
                                                          dense(grad_o), dense(lse), _scale(q, scale))
