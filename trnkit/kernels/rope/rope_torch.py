"""Torch references of the rope_hf kernels, same signatures as :mod:`trnkit.kernels.rope` (transformers'
``apply_rotary_pos_emb`` arithmetic in the activation dtype)."""

from __future__ import annotations

from typing import Any

import torch


def _rope_tables(cos: Any, sin: Any, rope_cache: Any, S: int, D: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) in ``dtype``, each [S, D] or [B, S, D], cut to the first S rows."""
    if rope_cache is not None:
        cos, sin = rope_cache[..., :D], rope_cache[..., D:]
    return cos[..., :S, :].to(dtype), sin[..., :S, :].to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    h = x.shape[-1] // 2
    if backward:  # dy*cos + rotate_half^T(dy*sin)
        z = x * sin
        return x * cos + torch.cat((z[..., h:], -z[..., :h]), dim=-1)
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _ref(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: Any, sin: Any,
         rope_cache: Any, backward: bool, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    D = q.shape[-1]
    S = q.shape[2] if layout == "bhsd" else q.shape[1]
    c, s = _rope_tables(cos, sin, rope_cache, S, D, q.dtype)
    head_dim = 1 if layout == "bhsd" else 2  # where the heads axis goes in [B, ., ., D]
    if c.dim() == 2:
        c, s = c[None], s[None]
    c, s = c.unsqueeze(head_dim), s.unsqueeze(head_dim)
    for x, out in ((q, q_out), (k, k_out)):
        out.copy_(_rotate(x, c, s, backward))
    return q_out, k_out


def rope_hf_ref(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                rope_cache: torch.Tensor | None = None, backward: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rope_hf` (``[B, H, S, D]``): transformers' arithmetic in the activation
    dtype (tables cast to it, as ``Qwen3RotaryEmbedding`` returns them); writes q_out/k_out and returns them."""
    return _ref(q, k, q_out, k_out, cos, sin, rope_cache, backward, "bhsd")


def rope_hf_bshd_ref(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     rope_cache: torch.Tensor | None = None, backward: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rope_hf_bshd` (``[B, S, H, D]``)."""
    return _ref(q, k, q_out, k_out, cos, sin, rope_cache, backward, "bshd")
