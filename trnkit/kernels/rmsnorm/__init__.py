"""RMSNorm (Qwen3's norms, the q/k head norm included) as NKI kernels: forward, forward fused with the
residual add, and the backward with the weight gradient.

``rmsnorm(x, weight, eps)`` -> ``(y, rstd)``; ``rmsnorm_residual(x, residual, weight, eps)`` ->
``(y, s, rstd)`` with ``s = x + residual`` normalised; ``rmsnorm_bwd(grad_y, x, weight, rstd, grad_s)``
-> ``(grad_x, grad_weight)``. ``x [..., H]`` (any leading shape; rows = tokens, or (token, head) for the
head norm), ``weight [H]``, ``rstd [rows]`` fp32. ``rmsnorm_qk(q, k, weight_q, weight_k, eps)`` ->
``(y_q, y_k, rstd_q, rstd_k)`` and ``rmsnorm_qk_bwd`` -> ``(grad_q, grad_k, grad_weight_q, grad_weight_k)``: the
q and k head norms (H < 512) in one launch, bit-identical to two. The torch references of the same signatures are in
:mod:`trnkit.kernels.rmsnorm.rmsnorm_torch`; the kernels and their design in
:mod:`trnkit.kernels.rmsnorm.rmsnorm_kernels` (imported, with the NKI backend, on the first call).
"""

from __future__ import annotations

from typing import Any

from trnkit.kernels._common import dense
from trnkit.kernels.constraints import check
from trnkit.kernels.lnc import launch, resolve_lnc
from trnkit.kernels.rmsnorm.constraints import (rmsnorm_bwd_constraints, rmsnorm_constraints,
                                                rmsnorm_qk_bwd_constraints, rmsnorm_qk_constraints)
from trnkit.kernels.rmsnorm.rmsnorm_torch import (rmsnorm_bwd_ref, rmsnorm_qk_bwd_ref, rmsnorm_qk_ref, rmsnorm_ref,
                                                  rmsnorm_residual_ref)

__all__ = ["rmsnorm", "rmsnorm_bwd", "rmsnorm_bwd_constraints", "rmsnorm_bwd_ref", "rmsnorm_constraints",
           "rmsnorm_qk", "rmsnorm_qk_bwd", "rmsnorm_qk_bwd_constraints", "rmsnorm_qk_bwd_ref",
           "rmsnorm_qk_constraints", "rmsnorm_qk_ref", "rmsnorm_ref", "rmsnorm_residual", "rmsnorm_residual_ref"]


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


def rmsnorm_qk(q: Any, k: Any, weight_q: Any, weight_k: Any, eps: float = 1e-6, lnc: int | None = None
               ) -> tuple[Any, Any, Any, Any]:
    """``(y_q [q.shape], y_k [k.shape], rstd_q [q rows] fp32, rstd_k [k rows] fp32)``: :func:`rmsnorm` of ``q``
    with ``weight_q`` and of ``k`` with ``weight_k`` (the q and k head norms, H = head_dim < 512) in one
    launch, each output bit-identical to its own :func:`rmsnorm` launch (NKI kernel)."""
    from trnkit.kernels.rmsnorm.rmsnorm_kernels import rmsnorm_qk_fwd_kernel

    check(rmsnorm_qk_constraints(q, k, weight_q, weight_k, eps))
    yq, yk, rq, rk = launch(rmsnorm_qk_fwd_kernel, resolve_lnc(lnc))(_rows(q), _rows(k), dense(weight_q),
                                                                      dense(weight_k), float(eps))
    return yq.reshape(q.shape), yk.reshape(k.shape), rq, rk


def rmsnorm_qk_bwd(grad_yq: Any, grad_yk: Any, q: Any, k: Any, weight_q: Any, weight_k: Any, rstd_q: Any,
                   rstd_k: Any, lnc: int | None = None) -> tuple[Any, Any, Any, Any]:
    """``(grad_q, grad_k, grad_weight_q, grad_weight_k)`` of :func:`rmsnorm_qk` with the forward's ``rstd_q``,
    ``rstd_k``, in one launch, each bit-identical to its own :func:`rmsnorm_bwd` launch (NKI kernel)."""
    from trnkit.kernels.rmsnorm.rmsnorm_kernels import rmsnorm_qk_bwd_kernel

    check(rmsnorm_qk_bwd_constraints(grad_yq, grad_yk, q, k, weight_q, weight_k, rstd_q, rstd_k))
    H = q.shape[-1]
    HP = -(-H // 128) * 128
    gq, gk, dw = launch(rmsnorm_qk_bwd_kernel, resolve_lnc(lnc))(
        _rows(grad_yq), _rows(grad_yk), _rows(q), _rows(k), dense(weight_q), dense(weight_k), dense(rstd_q),
        dense(rstd_k))
    return gq.reshape(q.shape), gk.reshape(k.shape), dw[:H].clone(), dw[HP:HP + H].clone()  # two tensors, no views
