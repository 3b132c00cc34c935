"""Independent torch references for the override tests (written from the math, not from trnkit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_bshd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D]; cos/sin [S, D] or [B, S, D]; transformers' arithmetic: tables cast to x.dtype,
    products and sum in x.dtype (what apply_rotary_pos_emb does, and the rope_hf contract)."""
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    if c.dim() == 2:
        c, s = c[None], s[None]
    c, s = c[:, :, None, :], s[:, :, None, :]
    return x * c + rotate_half(x) * s


def router(x: torch.Tensor, w: torch.Tensor, k: int, norm: bool = True):
    logits = x.float() @ w.float().T
    p = torch.softmax(logits, dim=-1)
    wts, idx = torch.topk(p, k, dim=-1)
    if norm:
        wts = wts / wts.sum(-1, keepdim=True)
    return wts, idx, logits


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(x[start:end].float() @ w[g].float())
        start = end
    return torch.cat(out).to(x.dtype)


def moe_experts(x, idx, tw, w_gate_up, w_down) -> torch.Tensor:
    """Per-token loop over its K experts: sum_k tw * down(silu(gate) * up), kernel layout weights."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w_down.shape[1]
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = x[t].float() @ w_gate_up[e].float()
            a = F.silu(h[:inter]) * h[inter:]
            out[t] += tw[t, j].float() * (a @ w_down[e].float())
    return out.to(x.dtype)
