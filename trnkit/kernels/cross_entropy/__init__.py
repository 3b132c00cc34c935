"""Fused linear cross-entropy (the lm_head and the loss in one kernel) as NKI kernels: the logits
``[T, V]`` never exist in HBM.

``linear_cross_entropy(hidden [T, H], weight [V, H], labels [T], ignore_index=-100, reduction="mean")``
-> ``(loss [] f32, lse [T] f32)``; ``linear_cross_entropy_bwd(hidden, weight, labels, lse, grad_loss, ...)``
-> ``(grad_hidden [T, H], grad_weight [V, H])``. ``reduction`` is ``"mean"`` (over the tokens whose label
is not ``ignore_index``, as ``torch.nn.functional.cross_entropy``) or ``"sum"``; tied embeddings pass
the embedding table as ``weight``. The torch references of the same signatures are in
:mod:`trnkit.kernels.cross_entropy.cross_entropy_torch`; the design in
:mod:`trnkit.kernels.cross_entropy.cross_entropy` (imported, with the NKI backend, on the first call).
"""

from __future__ import annotations

from typing import Any

import torch

from trnkit.kernels._common import dtype_name
from trnkit.kernels.constraints import Violation, check
from trnkit.kernels.cross_entropy.constraints import linear_cross_entropy_constraints
from trnkit.kernels.cross_entropy.cross_entropy_torch import (
    linear_cross_entropy_bwd_ref,
    linear_cross_entropy_fwd_bwd_ref,
    linear_cross_entropy_ref,
    token_scale,
)
from trnkit.kernels.lnc import launch, resolve_lnc

__all__ = ["label_range_violations", "linear_cross_entropy", "linear_cross_entropy_bwd", "linear_cross_entropy_bwd_ref",
           "linear_cross_entropy_constraints", "linear_cross_entropy_fwd_bwd", "linear_cross_entropy_fwd_bwd_ref",
           "linear_cross_entropy_ref"]


def label_range_violations(labels: torch.Tensor, V: int, ignore_index: int, name: str) -> list[Violation]:
    """The labels rule (a value check: it reads the labels): every label that is not ``ignore_index`` is in
    [0, V). The kernels compare labels as fp32 values and would give such a token no target; the torch
    reference's gather would stop with an index error that names neither the op nor ``ignore_index``."""
    out = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if not bool(out.any()):
        return []
    return [Violation(name, f"0 <= label < V = {V} or label == ignore_index ({ignore_index})", int(labels[out][0]))]


def _labels_f32(labels: torch.Tensor, V: int, ignore_index: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels as fp32 with ignored tokens at -1, valid mask)``, after :func:`label_range_violations`."""
    check(label_range_violations(labels, V, ignore_index, name))
    valid = labels != ignore_index
    return torch.where(valid, labels, -1).to(torch.float32), valid


def linear_cross_entropy(hidden: Any, weight: Any, labels: Any, ignore_index: int = -100,
                         reduction: str = "mean", lnc: int | None = None) -> tuple[Any, Any]:
    """``(loss [] f32, lse [T] f32)``: the cross-entropy of ``hidden @ weight.T`` against ``labels`` (NKI kernel).

    Raises :class:`~trnkit.kernels.constraints.KernelConstraintError` on inputs outside the constraints.
    """
    from trnkit.kernels.cross_entropy.cross_entropy import lce_fwd_kernel

    check(linear_cross_entropy_constraints(hidden, weight, labels, ignore_index, reduction))
    lab, valid = _labels_f32(labels, weight.shape[0], ignore_index, "linear_cross_entropy")
    per_token, lse = launch(lce_fwd_kernel, resolve_lnc(lnc))(hidden.T.contiguous(), hidden.contiguous(),
                                                     weight.T.contiguous(), weight.contiguous(), lab)
    per_token = torch.where(valid, per_token, 0.0)
    loss = per_token.sum() / valid.sum() if reduction == "mean" else per_token.sum()
    return loss, lse


def linear_cross_entropy_bwd(hidden: Any, weight: Any, labels: Any, lse: Any, grad_loss: Any = 1.0,
                             ignore_index: int = -100, reduction: str = "mean", lnc: int | None = None
                             ) -> tuple[Any, Any]:
    """``(grad_hidden [T, H] hidden.dtype, grad_weight [V, H] weight.dtype)`` of :func:`linear_cross_entropy`
    given its ``lse`` and the loss gradient ``grad_loss`` (NKI kernel)."""
    from trnkit.kernels.cross_entropy.cross_entropy import lce_bwd_kernel

    name = "linear_cross_entropy_bwd"
    check(linear_cross_entropy_constraints(hidden, weight, labels, ignore_index, reduction, name=name))
    if tuple(lse.shape) != (hidden.shape[0],) or lse.dtype != torch.float32:
        check([Violation(name, "lse is [T] float32 (the forward's)", (tuple(lse.shape), dtype_name(lse)))])
    lab, _ = _labels_f32(labels, weight.shape[0], ignore_index, name)
    scale = token_scale(labels, ignore_index, reduction, grad_loss)
    gh, gw = launch(lce_bwd_kernel, resolve_lnc(lnc))(hidden.T.contiguous(), hidden.contiguous(),
                                                       weight.T.contiguous(), weight.contiguous(), lab,
                                                       lse.contiguous(), scale)
    return gh.sum(0).to(hidden.dtype), gw.to(weight.dtype)  # grad_hidden: one partial per program


def linear_cross_entropy_fwd_bwd(hidden: Any, weight: Any, labels: Any, ignore_index: int = -100,
                                 reduction: str = "mean", lnc: int | None = None
                                 ) -> tuple[Any, Any, Any, Any]:
    """``(loss [] f32, lse [T] f32, grad_hidden [T, H] f32, grad_weight [V, H] f32)``: the loss of
    :func:`linear_cross_entropy` and its gradients at a loss gradient of 1, in one launch with no logits
    computed twice (the one-pass schedule, ``cross_entropy_fused``). The gradients stay fp32 so that a
    backward only multiplies them by its loss gradient (and rounds them to the parameters' dtypes)."""
    from trnkit.kernels.cross_entropy.cross_entropy_fused import lce_fused_kernel

    name = "linear_cross_entropy_fwd_bwd"
    check(linear_cross_entropy_constraints(hidden, weight, labels, ignore_index, reduction, name=name))
    lab, valid = _labels_f32(labels, weight.shape[0], ignore_index, name)
    scale = token_scale(labels, ignore_index, reduction, 1.0)
    per_token, lse, gh, gw = launch(lce_fused_kernel, resolve_lnc(lnc))(
        hidden.T.contiguous(), hidden.contiguous(), weight.T.contiguous(), weight.contiguous(), lab, scale)
    per_token = torch.where(valid, per_token, 0.0)
    loss = per_token.sum() / valid.sum() if reduction == "mean" else per_token.sum()
    return loss, lse, gh.sum(0), gw  # grad_hidden: one partial per program
