"""RMSNorm (Qwen3's norms, the q/k head norm included) as NKI kernels: forward, forward fused with the
residual add, and the backward with the weight gradient.

``rmsnorm(x, weight, eps)`` -> ``(y, rstd)``; ``rmsnorm_residual(x, residual, weight, eps)`` ->
``(y, s, rstd)`` with ``s = x + residual`` normalised; ``rmsnorm_bwd(grad_y, x, weight, rstd, grad_s)``
-> ``(grad_x, grad_weight)``. ``x [..., H]`` (any leading shape; rows = tokens, or (token, head) for the
head norm), ``weight [H]``, ``rstd [rows]`` fp32. The torch references of the same signatures are in
:mod:`trnkit.kernels.rmsnorm.rmsnorm_torch`; the kernels and their design in
:mod:`trnkit.kernels.rmsnorm.rmsnorm_kernels` (imported, with the NKI backend, on the first call).
"""

from __future__ import annotations

from typing import Any

from trnkit.kernels._common import dense
from trnkit.kernels.constraints import check
from trnkit.kernels.lnc import launch, resolve_lnc
from trnkit.kernels.rmsnorm.constraints import rmsnorm_bwd_constraints, rmsnorm_constraints
from trnkit.kernels.rmsnorm.rmsnorm_torch import rmsnorm_bwd_ref, rmsnorm_ref, rmsnorm_residual_ref

__all__ = ["rmsnorm", "rmsnorm_bwd", "rmsnorm_bwd_constraints", "rmsnorm_bwd_ref", "rmsnorm_constraints",
           "rmsnorm_ref", "rmsnorm_residual", "rmsnorm_residual_ref"]


def _rows(t: Any) -> Any:
    return dense(t).reshape(-1, t.shape[-1])


def rmsnorm(x: Any, weight: Any, eps: float = 1e-6, lnc: int | None = None) -> tuple[Any, Any]:
    """``(y [x.shape], rstd [rows] fp32)``, ``y = weight * (x * rstd).to(x.dtype)`` (NKI kernel).

    Raises :class:`~trnkit.kernels.constraints.KernelConstraintError` on inputs outside the constraints.
    """
    from trnkit.kernels.rmsnorm.rmsnorm_kernels import rmsnorm_fwd_kernel

    check(rmsnorm_constraints(x, weight, eps))
    y, rstd = launch(rmsnorm_fwd_kernel, resolve_lnc(lnc))(_rows(x), dense(weight), float(eps))
    return y.reshape(x.shape), rstd


def rmsnorm_residual(x: Any, residual: Any, weight: Any, eps: float = 1e-6, lnc: int | None = None
                     ) -> tuple[Any, Any, Any]:
    """``(y, s, rstd)``: ``s = x + residual`` (x's dtype) and ``y, rstd = rmsnorm(s, weight, eps)`` in one pass."""
    from trnkit.kernels.rmsnorm.rmsnorm_kernels import rmsnorm_fwd_kernel

    check(rmsnorm_constraints(x, weight, eps, residual))
    y, s, rstd = launch(rmsnorm_fwd_kernel, resolve_lnc(lnc))(_rows(x), dense(weight), float(eps),
                                                              _rows(residual))
    return y.reshape(x.shape), s.reshape(x.shape), rstd


def rmsnorm_bwd(grad_y: Any, x: Any, weight: Any, rstd: Any, grad_s: Any = None, lnc: int | None = None
                ) -> tuple[Any, Any]:
    """``(grad_x [x.shape] x.dtype, grad_weight [H] weight.dtype)`` of :func:`rmsnorm` at ``x`` (the residual
    form: at ``s``) with the forward's ``rstd``; ``grad_s`` (the gradient reaching ``s`` through the residual
    stream) is added to ``grad_x``."""
    from trnkit.kernels.rmsnorm.rmsnorm_kernels import rmsnorm_bwd_kernel

    check(rmsnorm_bwd_constraints(grad_y, x, weight, rstd, grad_s))
    gs = None if grad_s is None else _rows(grad_s)
    dx, dw = launch(rmsnorm_bwd_kernel, resolve_lnc(lnc))(_rows(grad_y), _rows(x), dense(weight), dense(rstd), gs)
    return dx.reshape(x.shape), dw[: x.shape[-1]]
