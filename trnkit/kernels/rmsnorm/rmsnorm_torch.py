"""Torch references of the RMSNorm kernels, same signatures as :mod:`trnkit.kernels.rmsnorm`.

transformers' Qwen3 cast order: normalise in fp32, cast to the input dtype, then multiply by the
weight (``y = weight * (x * rstd).to(x.dtype)``, so ``y`` has ``promote(x.dtype, weight.dtype)``).
The backward rounds where the kernel does: the gradient of the normalised value, ``gw = dy * weight``,
is rounded to ``x.dtype`` (as autograd's cast backward does); the row sum ``D = sum(gw * x)`` adds
products rounded to ``x.dtype``; ``dx = rstd * gw - x * rstd^3 * D / H`` is fp32 and rounded once.
``grad_weight = sum_rows rstd * (dy * x)`` with the product rounded to the output dtype and ``rstd``
too (the Tensor engine's operands), summed in fp32 and rounded once to ``weight.dtype`` (autograd
through the module sums ``dy * n`` with ``n`` rounded instead: the same value up to rounding).
These are the wide-row kernels' rounding points; for rows under 512 elements (the q / k head norm) the
kernel's forward multiplies by ``rstd`` rounded to bf16 for bf16 rows, its backward sums
``D = sum(weight * (dy * x))`` with ``dy * x`` rounded to the output dtype and adds ``grad_s`` after
``dx``'s rounding (docs/kernels.md, RMSNorm numerics).
"""

from __future__ import annotations

import torch


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [..., H], rstd [N] fp32)``: ``y = weight * (x * rstd).to(x.dtype)``, ``rstd = rsqrt(mean(x^2) + eps)``
    per row (fp32), N = the number of rows (``x.numel() // H``)."""
    xf = _rows(x).float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    n = (xf * rstd[:, None]).to(x.dtype)
    return (weight * n).view(*x.shape[:-1], x.shape[-1]), rstd


def rmsnorm_residual_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, s, rstd)`` with ``s = x + residual`` (in x.dtype, the new residual stream) and
    ``y, rstd = rmsnorm_ref(s, weight, eps)``."""
    s = x + residual
    y, rstd = rmsnorm_ref(s, weight, eps)
    return y, s, rstd


def rmsnorm_bwd_ref(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                    grad_s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x [x.shape] x.dtype, grad_weight [H] weight.dtype)`` of :func:`rmsnorm_ref` at ``x`` (for the
    residual form: at ``s``), given the forward's ``rstd``. ``grad_s`` (the gradient reaching ``s``
    through the residual stream) is added to ``grad_x``; in the residual form ``grad_x`` is then the
    gradient of both ``x`` and ``residual``."""
    H = x.shape[-1]
    xf, r = _rows(x).float(), rstd.reshape(-1, 1).float()
    dy = _rows(grad_y)
    out_dt = torch.promote_types(x.dtype, weight.dtype)
    gw = (dy * weight).to(x.dtype).float()
    prod = (dy.float() * xf).to(out_dt).float()
    grad_w = (prod * r.to(out_dt).float()).sum(0).to(weight.dtype)
    d = (gw * xf).to(x.dtype).float().sum(-1, keepdim=True)
    dx = r * gw - xf * (r.pow(3) * d / H)
    if grad_s is not None:
        dx = dx + _rows(grad_s).float()
    return dx.to(x.dtype).view(x.shape), grad_w


def rmsnorm_qk_ref(q: torch.Tensor, k: torch.Tensor, weight_q: torch.Tensor, weight_k: torch.Tensor,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y_q, y_k, rstd_q, rstd_k)``: the q and k head norms, :func:`rmsnorm_ref` of ``q`` with ``weight_q`` and
    of ``k`` with ``weight_k``."""
    y_q, rstd_q = rmsnorm_ref(q, weight_q, eps)
    y_k, rstd_k = rmsnorm_ref(k, weight_k, eps)
    return y_q, y_k, rstd_q, rstd_k


def rmsnorm_qk_bwd_ref(grad_yq: torch.Tensor, grad_yk: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       weight_q: torch.Tensor, weight_k: torch.Tensor, rstd_q: torch.Tensor, rstd_k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_q, grad_k, grad_weight_q, grad_weight_k)`` of :func:`rmsnorm_qk_ref`: :func:`rmsnorm_bwd_ref` of
    each head norm."""
    grad_q, grad_wq = rmsnorm_bwd_ref(grad_yq, q, weight_q, rstd_q)
    grad_k, grad_wk = rmsnorm_bwd_ref(grad_yk, k, weight_k, rstd_k)
    return grad_q, grad_k, grad_wq, grad_wk


__all__ = ["rmsnorm_bwd_ref", "rmsnorm_qk_bwd_ref", "rmsnorm_qk_ref", "rmsnorm_ref", "rmsnorm_residual_ref"]
