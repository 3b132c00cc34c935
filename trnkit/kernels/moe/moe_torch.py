"""Torch references of the MoE kernels (the oracles of the parity tests and the ``reference`` impl of
the override registry), same signatures as :mod:`trnkit.kernels.moe`.

Same rounding points as the kernels (bf16): matmuls accumulate in fp32; ``h = act(gate) * up`` is rounded
to the input dtype, each slot's scaled output ``w * y`` too, and a token's K contributions are summed in
fp32 and rounded once. The references check the kernels' constraints themselves (the same input domain).
"""

from __future__ import annotations

from typing import Any

import torch

from trnkit.kernels._common import GELU_A, GELU_C
from trnkit.kernels.moe.constraints import SWIGLU_ALPHA, SWIGLU_LIMIT, check_grouped_mm, check_moe_experts


def _per_group_f32(x: torch.Tensor, w: torch.Tensor, counts: list[int], transpose_w: bool = False) -> torch.Tensor:
    """fp32 ``x_g @ w[g]`` (or ``@ w[g].T``) over consecutive row groups of sizes ``counts``."""
    n_out = w.shape[1] if transpose_w else w.shape[2]
    out = x.new_zeros(x.shape[0], n_out, dtype=torch.float32)
    start = 0
    for g, c in enumerate(counts):
        if c:
            wg = w[g].float()
            out[start:start + c] = x[start:start + c].float() @ (wg.T if transpose_w else wg)
        start += c
    return out


def _group_counts(group_offsets: torch.Tensor) -> list[int]:
    offs = [0] + group_offsets.long().tolist()
    return [b - a for a, b in zip(offs[:-1], offs[1:])]


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`grouped_mm`: fp32 accumulation, output in x.dtype, zero rows past the end."""
    check_grouped_mm(x, w, group_offsets)
    counts = _group_counts(group_offsets)
    return _per_group_f32(x, w, counts).to(x.dtype)


def grouped_mm_bwd_ref(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor,
                       grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`grouped_mm_bwd`: ``grad_x = grad_out_g @ w[g].T``, ``grad_w[g] = x_g.T @ grad_out_g``."""
    check_grouped_mm(x, w, group_offsets, grad_out)
    counts = _group_counts(group_offsets)
    grad_x = _per_group_f32(grad_out, w, counts, transpose_w=True).to(x.dtype)
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    start = 0
    for g, c in enumerate(counts):
        grad_w[g] = x[start:start + c].float().T @ grad_out[start:start + c].float()
        start += c
    return grad_x, grad_w.to(w.dtype)


def _sorted_slots(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Slots ``t*K + k`` sorted (stably) by expert, the slot count of each expert, and the expert of
    each sorted slot."""
    flat = topk_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist(), flat[order]


def activation_ref(a: torch.Tensor, u: torch.Tensor, activation: str = "silu", limit: float = SWIGLU_LIMIT,
                   alpha: float = SWIGLU_ALPHA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, dh/da, dh/du)`` in fp32 for gate pre-activations ``a`` and up projections ``u`` (biases
    included), with the kernels' association order.

    * ``silu``: ``h = a sigmoid(a) * u``; ``gelu_tanh``: ``h = gelu_tanh(a) * u`` (written as
      ``a sigmoid(2C (a + A a^3))``, the same function); derivative ``u (s + g (1 - s) z')``.
    * ``swiglu_clamped`` (GPT-OSS): ``ac = min(a, limit)``, ``uc = clamp(u, -limit, limit)``,
      ``h = (uc + 1) * ac sigmoid(alpha ac)``; the clamps pass gradient where the bound is not
      exceeded (bounds inclusive, as ``torch.clamp``).
    """
    a, u = a.float(), u.float()
    if activation == "swiglu_clamped":
        ac = a.clamp(max=limit)
        s = torch.sigmoid(alpha * ac)
        g = ac * s
        up1 = u.clamp(-limit, limit) + 1
        dg = (g * (1 - s) * alpha + s) * (a <= limit)
        return g * up1, up1 * dg, g * ((u >= -limit) & (u <= limit))
    if activation == "gelu_tanh":
        s = torch.sigmoid(a * (a * a * GELU_A + 1) * (2 * GELU_C))
        dz = a * a * (6 * GELU_A * GELU_C) + 2 * GELU_C
    else:
        s, dz = torch.sigmoid(a), 1.0
    g = a * s
    return g * u, u * (g * (1 - s) * dz + s), g


def _variant_kw(activation: str, limit: float, alpha: float) -> dict[str, Any]:
    return {"activation": activation, "limit": limit, "alpha": alpha}


def moe_experts_ref(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, block_size: int = 128,
                    activation: str = "silu", limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA,
                    b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`moe_experts` (same rounding points as the kernel; block_size is ignored:
    padding does not change the result). Biases are added in fp32 before the activation / before the
    affinity scaling: ``out[t] = sum_k w * (act(x W_gu + b_gu) @ W_d + b_d)``."""
    var = _variant_kw(activation, limit, alpha)
    check_moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, b_gate_up=b_gate_up,
                       b_down=b_down, **var)
    T, H = x.shape
    K = topk_idx.shape[1]
    inter = w_down.shape[1]
    order, counts, exp = _sorted_slots(topk_idx, w_gate_up.shape[0])
    xs = x[order // K]
    gu = _per_group_f32(xs, w_gate_up, counts)
    if b_gate_up is not None:
        gu = gu + b_gate_up[exp].float()
    h = activation_ref(gu[:, :inter], gu[:, inter:], **var)[0].to(x.dtype)
    y = _per_group_f32(h, w_down, counts)
    if b_down is not None:
        y = y + b_down[exp].float()
    ys = (topk_weights.reshape(-1)[order].float()[:, None] * y).to(x.dtype)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    out.index_add_(0, order // K, ys.float())
    return out.to(x.dtype)


def _sum_per_group(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """fp32 ``[G, W]``: the sum of each group's consecutive rows."""
    return torch.stack([part.sum(0) for part in rows.float().split(counts)])


def moe_experts_bwd_ref(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        w_gate_up: torch.Tensor, w_down: torch.Tensor, grad_out: torch.Tensor,
                        block_size: int = 128, activation: str = "silu", limit: float = SWIGLU_LIMIT,
                        alpha: float = SWIGLU_ALPHA, b_gate_up: torch.Tensor | None = None,
                        b_down: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """Reference of :func:`moe_experts_bwd` -> (grad_x, grad_topk_weights, grad_w_gate_up, grad_w_down)
    and, when a bias is given, (grad_b_gate_up, grad_b_down) after them (None for an absent bias).

    Mirrors the kernels' rounding points: the recomputed gate/up (bias added), ``grad_out @ w_down.T``,
    ``h``, ``w * h`` and the gate/up gradients are rounded to the input dtype (the data-path kernel
    rounds them there too; ``<grad_out, b_down>``, rounded here, stays fp32 in the kernel); ``grad_b_down``
    sums ``w * grad_out`` with ``w`` in the input dtype.
    """
    var = _variant_kw(activation, limit, alpha)
    check_moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, grad_out, b_gate_up=b_gate_up,
                       b_down=b_down, **var)
    T, H = x.shape
    K = topk_idx.shape[1]
    inter = w_down.shape[1]
    dt = x.dtype
    order, counts, exp = _sorted_slots(topk_idx, w_gate_up.shape[0])
    tok = order // K
    xs, gs = x[tok], grad_out[tok]
    ws = topk_weights.reshape(-1)[order].float()[:, None]
    gu = _per_group_f32(xs, w_gate_up, counts)
    if b_gate_up is not None:
        gu = gu + b_gate_up[exp].float()
    gu = gu.to(dt).float()
    ghp = _per_group_f32(gs, w_down, counts, transpose_w=True).to(dt).float()  # grad_out @ w_down[e].T
    h, dh_da, dh_du = activation_ref(gu[:, :inter], gu[:, inter:], **var)
    h = h.to(dt).float()
    gw = (ghp * h).sum(-1)  # d out / d w = <grad_out, y> = <grad_out @ w_down.T, h> (+ <grad_out, b_down>)
    if b_down is not None:
        gw = gw + (gs.float() * b_down[exp].float()).sum(-1).to(dt).float()
    hw = (ws * h).to(dt).float()
    gh = ws * ghp
    dgu = torch.cat([(gh * dh_da).to(dt), (gh * dh_du).to(dt)], dim=1).float()
    grad_wd = torch.zeros(w_down.shape, dtype=torch.float32, device=x.device)
    grad_wgu = torch.zeros(w_gate_up.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        sl = slice(start, start + c)
        grad_wd[e] = hw[sl].T @ gs[sl].float()
        grad_wgu[e] = xs[sl].float().T @ dgu[sl]
        start += c
    gxs = _per_group_f32(dgu, w_gate_up, counts, transpose_w=True).to(dt)
    grad_x = torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, tok, gxs.float()).to(dt)
    grad_tw = torch.empty(T * K, dtype=torch.float32, device=x.device)
    grad_tw[order] = gw
    grads = (grad_x, grad_tw.view(T, K).to(topk_weights.dtype), grad_wgu.to(w_gate_up.dtype),
             grad_wd.to(w_down.dtype))
    if b_gate_up is None and b_down is None:
        return grads
    grad_bgu = None if b_gate_up is None else _sum_per_group(dgu, counts).to(b_gate_up.dtype)
    grad_bd = None if b_down is None else _sum_per_group(ws.to(dt).float() * gs.float(), counts).to(b_down.dtype)
    return (*grads, grad_bgu, grad_bd)
