"""Torch references of the flash attention kernels, same signatures as :mod:`trnkit.kernels.attention`.

Causal GQA attention in the ``[B, S, H, D]`` layout: query head ``h`` reads key / value head
``h // (Hq // Hk)`` (transformers' ``repeat_kv``). Scores, softmax and the log-sum-exp are fp32; the
probabilities are rounded to the input dtype before the ``P @ V`` product (the kernel's rounding
point: the Tensor engine takes them in the input dtype) unnormalised, ``exp(scale * s - max)``, and the
output divided by the row sum and rounded once. (The kernel takes the max over the keys seen so far,
up to 4,096 per step: for rows past one step its earlier probabilities are rounded against an older max.)
``lse[b, h, i] = log(sum_j exp(scale * q_i . k_j))`` over ``j <= i`` (fp32).

The backward is the flash attention one: ``P = exp(scale * S - lse)`` recomputed from the saved
``lse``, ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)`` with
``delta_i = sum_d dO[i, d] * O[i, d]`` (fp32), ``dQ = scale * dS K``, ``dK = scale * dS^T Q``, summed over
the query heads of a group for ``dK`` and ``dV``. ``P`` and ``dS`` are rounded to the input dtype (the
Tensor engine's operands); ``dP - delta`` is not (the kernel rounds it only on the blocks whose
``dP - delta`` it computes on the Scalar engine, a one-ulp difference in ``dS`` there); every product
accumulates in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from trnkit.kernels.attention.shift_rule import certificate_nats


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, S, Hk, D]`` -> ``[B, Hk * groups, S, D]`` fp32 (each kv head repeated for its group)."""
    return x.float().transpose(1, 2).repeat_interleave(groups, dim=1)


def _causal(S: int) -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool).tril()


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, S, Hq, D] q.dtype, lse [B, Hq, S] fp32)`` of causal attention over ``q [B, S, Hq, D]``,
    ``k, v [B, S, Hk, D]``; ``scale`` defaults to ``D ** -0.5``."""
    B, S, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q.float().transpose(1, 2), _heads(k, G)) * scale
    s = s.masked_fill(~_causal(S), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    o = torch.einsum("bhij,bhjd->bhid", p.to(q.dtype).float(), _heads(v, G)) / denom
    return o.transpose(1, 2).to(q.dtype), (m + denom.log()).squeeze(-1)


def attention_bwd_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                      grad_o: torch.Tensor, scale: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_q, grad_k, grad_v)`` of :func:`attention_ref` (inputs' shapes and dtypes) from the forward's
    ``o`` and ``lse`` and the output gradient ``grad_o [B, S, Hq, D]``."""
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    G = Hq // Hk
    scale = D ** -0.5 if scale is None else scale
    dt = q.dtype
    qf, kf, vf = q.float().transpose(1, 2), _heads(k, G), _heads(v, G)
    do = grad_o.float().transpose(1, 2)
    s = torch.einsum("bhid,bhjd->bhij", qf, kf) * scale
    p = torch.exp(s - lse[..., None]).masked_fill(~_causal(S), 0.0)
    delta = (do * o.float().transpose(1, 2)).sum(-1, keepdim=True)
    dp = torch.einsum("bhid,bhjd->bhij", do, vf)
    p = p.to(dt).float()
    ds = (p * (dp - delta)).to(dt).float()
    dq = torch.einsum("bhij,bhjd->bhid", ds, kf) * scale
    dk = torch.einsum("bhij,bhid->bhjd", ds, qf) * scale
    dv = torch.einsum("bhij,bhid->bhjd", p, do)
    dk = dk.view(B, Hk, G, S, D).sum(2)
    dv = dv.view(B, Hk, G, S, D).sum(2)
    return dq.transpose(1, 2).to(dt), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


def causal_score_rows(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, rows: int = 256
                      ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(r0, r1, s)`` per block of ``rows`` query rows: ``s [B, Hq, r1 - r0, r1]`` the fp32 scores
    ``scale * q_i . k_j`` of rows ``r0 .. r1 - 1`` over keys ``0 .. r1 - 1``, ``-inf`` past the diagonal
    (q ``[B, S, Hq, D]``, k ``[B, S, Hk, D]``; ``scale`` defaults to ``D ** -0.5``): one block's scores at a
    time, never the ``[S, S]`` matrix of every head."""
    S, D = q.shape[1], q.shape[3]
    kf = _heads(k, q.shape[2] // k.shape[2])
    scale = D ** -0.5 if scale is None else scale
    for r0 in range(0, S, rows):
        r1 = min(S, r0 + rows)
        s = torch.einsum("bhid,bhjd->bhij", q[:, r0:r1].float().transpose(1, 2), kf[:, :, :r1]) * scale
        yield r0, r1, s.masked_fill(~_causal(r1)[r0:r1], float("-inf"))


def fixed_shift_failures(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, shift_keys: int = 512,
                         nats: float | None = None, rows: int = 256) -> torch.Tensor:
    """``[B, Hq, S]`` bool: the rows that fail the fixed-shift forward's certificate
    (:mod:`trnkit.kernels.attention.flash_fwd_shift`), computed in torch (fp32 scores, ``rows`` query rows at
    a time): row ``i``'s shift is ``c_i = max_{j <= min(i, shift_keys - 1)} scale * q_i . k_j`` and it fails
    when ``l_i = sum_{j <= i} exp(scale * q_i . k_j - c_i) > S * e^nats`` (an ``inf`` fails too; ``nats``
    None: the kernel's rule for q's dtype, :func:`~trnkit.kernels.attention.shift_rule.certificate_nats`).
    ``1 / l_i`` is the largest softmax probability among the row's first ``shift_keys`` keys, so a row fails
    exactly when each of those keys gets less than ``e^-nats / S`` of its attention. A launch of the kernel
    falls back to the exact forward when any of its rows fails (up to the rounding of ``l_i`` near the
    bound: the kernel sums its exponentials in another order)."""
    B, S, Hq, _ = q.shape
    if nats is None:
        nats = certificate_nats(q.element_size())
    bound = S * math.exp(nats)
    out = torch.zeros(B, Hq, S, dtype=torch.bool)
    for r0, r1, s in causal_score_rows(q, k, scale, rows):
        lsum = torch.exp(s - s[..., :shift_keys].amax(-1, keepdim=True)).sum(-1)
        out[:, :, r0:r1] = ~(lsum <= bound) & ~lsum.isnan()
    return out


__all__ = ["attention_bwd_ref", "attention_ref", "causal_score_rows", "fixed_shift_failures"]
