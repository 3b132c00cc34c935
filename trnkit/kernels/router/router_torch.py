"""Torch references of the router top-k kernels, same signatures as :mod:`trnkit.kernels.router` (the
oracles of the parity tests and the ``reference`` impl of the override registry)."""

from __future__ import annotations

import torch

from trnkit.kernels.constraints import check
from trnkit.kernels.router.constraints import SIGMOID_NORM_EPS, variant_violations


def _rounded(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``logits`` rounded to ``dtype`` (the dtype ``x @ w.T`` returns) and back, with the gradient passed
    straight through the rounding (autograd of a model's ``F.linear`` output cast to fp32)."""
    if dtype == torch.float32:
        return logits
    return logits + (logits.detach().to(dtype).float() - logits.detach())


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    return torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)


def _weights_of(scores: torch.Tensor, idx: torch.Tensor, norm_topk_prob: bool, scoring: str,
                routed_scaling_factor: float) -> torch.Tensor:
    """The routing weights of the chosen experts: renormalised (sigmoid: + 1e-20) and scaled."""
    vals = scores.gather(1, idx)
    if norm_topk_prob:
        den = vals.sum(dim=-1, keepdim=True)
        vals = vals / (den + SIGMOID_NORM_EPS if scoring == "sigmoid" else den)
    return vals * routed_scaling_factor if routed_scaling_factor != 1.0 else vals


def router_topk_ref(x: torch.Tensor, w_router: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
                    return_affinities: bool = False, scoring: str = "softmax",
                    selection_bias: torch.Tensor | None = None,
                    routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, ...]:
    """Torch reference: ``(topk_weights [T,K] f32, topk_idx [T,K] int32, router_logits [T,E] f32)``, plus
    ``affinities [T,E] f32`` (the weights scattered into their expert columns) when ``return_affinities``.
    ``scoring`` / ``selection_bias`` / ``routed_scaling_factor``: see the module docstring."""
    check(variant_violations(w_router, return_affinities, scoring, selection_bias, routed_scaling_factor))
    logits = _rounded(x.float() @ w_router.float().T, x.dtype)
    probs = _scores(logits, scoring)
    # The documented tie rule: experts are chosen by logit (softmax is monotonic, and a logit still
    # orders experts whose probabilities underflowed to 0), ties to the lower index (a stable sort;
    # torch.topk does not promise an order among ties). The kernel and the native model do the same.
    # With a selection bias the choice is by sigmoid score + bias (DeepSeek-V3), same tie rule.
    key = logits if selection_bias is None else probs + selection_bias.float()
    idx = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    vals = _weights_of(probs, idx, norm_topk_prob, scoring, routed_scaling_factor)
    if return_affinities:
        aff = torch.zeros_like(logits).scatter_(1, idx, vals)
        return vals, idx.to(torch.int32), logits, aff
    return vals, idx.to(torch.int32), logits


def router_topk_bwd_ref(x: torch.Tensor, w_router: torch.Tensor, router_logits: torch.Tensor,
                        topk_idx: torch.Tensor, grad_topk_weights: torch.Tensor,
                        grad_router_logits: torch.Tensor | None = None, norm_topk_prob: bool = True,
                        scoring: str = "softmax", routed_scaling_factor: float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference backward (autograd through softmax | sigmoid -> gather -> renorm -> scale -> matmul)."""
    xf = x.detach().float().requires_grad_(True)
    wf = w_router.detach().float().requires_grad_(True)
    with torch.enable_grad():
        logits = _rounded(xf @ wf.T, x.dtype)
        vals = _weights_of(_scores(logits, scoring), topk_idx.long(), norm_topk_prob, scoring, routed_scaling_factor)
        outs, grads = [vals], [grad_topk_weights.float()]
        if grad_router_logits is not None:
            outs.append(logits)
            grads.append(grad_router_logits.float())
        gx, gw = torch.autograd.grad(outs, (xf, wf), grads)
    return gx.to(x.dtype), gw.to(w_router.dtype)
