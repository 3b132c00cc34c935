"""Torch references of the fused linear cross-entropy kernels, same signatures as
:mod:`trnkit.kernels.cross_entropy`.

The logits are ``hidden @ weight.T`` with fp32 accumulation (the kernels' PSUM); the loss per token
is ``logsumexp(logits) - logits[label]``, reduced like ``torch.nn.functional.cross_entropy`` (``mean``
over the tokens whose label is not ``ignore_index``, or ``sum``). The backward rounds where the kernel
does: ``dl = scale * (softmax - onehot)`` is formed in fp32 and rounded once to the operands' dtype
(the Tensor engine's input), then ``grad_hidden = dl @ weight`` and ``grad_weight = dl.T @ hidden``
accumulate in fp32 and are rounded to the parameters' dtypes.
"""

from __future__ import annotations

import torch

from trnkit.kernels.constraints import Violation, check
from trnkit.kernels.cross_entropy.constraints import REDUCTIONS


def _check_reduction(name: str, reduction: str) -> None:
    if reduction not in REDUCTIONS:  # "none" would otherwise give the sum
        check([Violation(name, f"reduction in {REDUCTIONS}", reduction)])


def token_scale(labels: torch.Tensor, ignore_index: int, reduction: str, grad_loss: torch.Tensor | float = 1.0
                ) -> torch.Tensor:
    """``d loss / d loss_t`` per token (fp32): ``grad_loss / n_valid`` (mean) or ``grad_loss`` (sum), 0 for
    ignored tokens. With every token ignored the mean loss is 0 / 0 (NaN) and every scale 0, as in torch
    (``F.cross_entropy``'s gradients are then 0, not NaN)."""
    valid = (labels != ignore_index).to(torch.float32)
    g = torch.as_tensor(grad_loss, dtype=torch.float32)
    if reduction == "mean":
        return valid * (g / valid.sum().clamp_min(1.0))
    return valid * g


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             ignore_index: int = -100, reduction: str = "mean"
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [] f32, lse [T] f32)`` of ``hidden [T, H] @ weight [V, H].T`` against ``labels [T]``."""
    _check_reduction("linear_cross_entropy_ref", reduction)
    logits = hidden.float() @ weight.float().T
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != ignore_index
    tgt = logits.gather(1, torch.where(valid, labels, 0).long()[:, None])[:, 0]
    per_token = torch.where(valid, lse - tgt, 0.0)
    loss = per_token.sum() / valid.sum() if reduction == "mean" else per_token.sum()
    return loss, lse


def linear_cross_entropy_bwd_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 lse: torch.Tensor, grad_loss: torch.Tensor | float = 1.0,
                                 ignore_index: int = -100, reduction: str = "mean"
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_hidden [T, H] hidden.dtype, grad_weight [V, H] weight.dtype)`` of
    :func:`linear_cross_entropy_ref` given its ``lse`` and the loss gradient ``grad_loss``."""
    _check_reduction("linear_cross_entropy_bwd_ref", reduction)
    logits = hidden.float() @ weight.float().T
    valid = labels != ignore_index
    onehot = torch.zeros_like(logits)
    onehot[valid.nonzero()[:, 0], labels[valid].long()] = 1.0
    scale = token_scale(labels, ignore_index, reduction, grad_loss)
    dl = ((torch.exp(logits - lse[:, None]) - onehot) * scale[:, None]).to(hidden.dtype).float()
    return (dl @ weight.float()).to(hidden.dtype), (dl.T @ hidden.float()).to(weight.dtype)


def linear_cross_entropy_fwd_bwd_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                     ignore_index: int = -100, reduction: str = "mean"
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, grad_hidden f32, grad_weight f32)``: :func:`linear_cross_entropy_ref` and the fp32 sums of
    :func:`linear_cross_entropy_bwd_ref` at a loss gradient of 1 (``dl`` rounded to the operands' dtype)."""
    loss, lse = linear_cross_entropy_ref(hidden, weight, labels, ignore_index, reduction)
    logits = hidden.float() @ weight.float().T
    valid = labels != ignore_index
    onehot = torch.zeros_like(logits)
    onehot[valid.nonzero()[:, 0], labels[valid].long()] = 1.0
    scale = token_scale(labels, ignore_index, reduction, 1.0)
    dl = ((torch.exp(logits - lse[:, None]) - onehot) * scale[:, None]).to(hidden.dtype).float()
    return loss, lse, dl @ weight.float(), dl.T @ hidden.float()


__all__ = ["linear_cross_entropy_bwd_ref", "linear_cross_entropy_fwd_bwd_ref", "linear_cross_entropy_ref",
           "token_scale"]
