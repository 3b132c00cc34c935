"""Plain-torch oracles of every kernel, for the fp64-oracle rule (tests/tolerances.py).

Each function computes a kernel's outputs with ordinary torch ops at dtype ``dt``: in float64 it is the
oracle, in the test dtype it is "torch's own" result the kernel is held to. They are written here,
independent of the kernels' ``*_ref`` functions (which copy the kernels' rounding points). Gradients are
autograd's. The MoE and grouped-matmul backward checks stream over experts / groups and compare each
weight-gradient slice as it is made (tests/tolerances.py ``OracleErr``), so a production layer never
holds fp64 copies of its weights or weight gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.tolerances import F64, OracleErr, check_oracle

SIGMOID_NORM_EPS = 1e-20  # DeepSeek-V3's renormalisation: sum + 1e-20


def leaves(ts: list[torch.Tensor], dt: torch.dtype) -> list[torch.Tensor]:
    return [t.detach().to(dt).requires_grad_(True) for t in ts]


def check_all(names: tuple[str, ...], results, fn, dtype: torch.dtype) -> None:
    """The rule on each output of ``fn(dt)`` (a tensor or a tuple): ``fn(dtype)`` is torch's, ``fn(F64)`` the oracle."""
    base, orc = fn(dtype), fn(F64)
    if isinstance(base, torch.Tensor):
        base, orc, results = (base,), (orc,), (results,)
    for name, r, b, o in zip(names, results, base, orc, strict=True):
        check_oracle(name, r, b, o)


# --------------------------------------------------------------------------------------------- rope
def rope_tables(cos: torch.Tensor, sin: torch.Tensor, S: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[S', D]`` or ``[B, S', D]`` -> the first S rows, broadcastable against x in ``layout``."""
    def fit(t: torch.Tensor) -> torch.Tensor:
        t = t[..., :S, :]
        if t.dim() == 2:
            t = t[None]
        return t[:, None] if layout == "bhsd" else t[:, :, None]

    return fit(cos), fit(sin)


def unpack(rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    D = rope_cache.shape[-1] // 2
    return rope_cache[..., :D], rope_cache[..., D:]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dt: torch.dtype, backward: bool = False,
         layout: str = "bhsd") -> torch.Tensor:
    """HF rotate-half RoPE at dtype dt (tables cast to dt, as transformers does); backward: x is the
    output gradient and the result the input gradient (the transposed rotation)."""
    c, s = rope_tables(cos.to(dt), sin.to(dt), x.shape[2 if layout == "bhsd" else 1], layout)
    x = x.to(dt)
    h = x.shape[-1] // 2
    if not backward:
        return x * c + torch.cat([-x[..., h:], x[..., :h]], -1) * s
    xs = x * s
    return x * c + torch.cat([xs[..., h:], -xs[..., :h]], -1)


# ------------------------------------------------------------------------------------------- router
def router_weights(x, w, idx, dt, norm=True, scoring="softmax", scale=1.0):
    """``(logits, weights of the experts idx)``: softmax | sigmoid, renormalised (sigmoid: + 1e-20), scaled."""
    logits = x.to(dt) @ w.to(dt).T
    p = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    sel = p.gather(1, idx.long())
    if norm:
        den = sel.sum(-1, keepdim=True)
        sel = sel / (den + SIGMOID_NORM_EPS if scoring == "sigmoid" else den)
    return logits, sel * scale if scale != 1.0 else sel


def router_grads(x, w, idx, grad_weights, grad_logits, dt, norm=True, scoring="softmax", scale=1.0):
    """``(grad_x, grad_w)`` by autograd of :func:`router_weights` (and of the logits if grad_logits)."""
    xl, wl = leaves([x, w], dt)
    logits, sel = router_weights(xl, wl, idx, dt, norm, scoring, scale)
    outs, grads = [sel], [grad_weights.to(dt)]
    if grad_logits is not None:
        outs.append(logits)
        grads.append(grad_logits.to(dt))
    return torch.autograd.grad(outs, (xl, wl), grads)


# ---------------------------------------------------------------------------------------------- moe
def _expert(x_rows, w_up, w_down, inter):
    gu = x_rows @ w_up
    return (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w_down


def experts(x, idx, tw, wgu, wd, dt):
    """``out[t] = sum_k tw[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, transformers-style: one
    ``index_add_`` per expert at dtype dt."""
    inter = wd.shape[1]
    out = torch.zeros(x.shape, dtype=dt)
    xd, twd = x.to(dt), tw.to(dt)
    for e in idx.unique().tolist():
        t, kk = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, t, twd[t, kk][:, None] * _expert(xd[t], wgu[e].to(dt), wd[e].to(dt), inter))
    return out


def _expert_grads(x, tw, w_up, w_down, go, dt):
    """Autograd of one expert's weighted output ``tw * down(swiglu(x @ w_up))`` at dtype dt."""
    xl, twl, wul, wdl = leaves([x, tw, w_up, w_down], dt)
    y = twl[:, None] * _expert(xl, wul, wdl, w_down.shape[0])
    return torch.autograd.grad(y, (xl, twl, wul, wdl), go.to(dt))


def check_experts_bwd(kernel_grads, x, idx, tw, wgu, wd, go, dtype) -> None:
    """The rule on ``(grad_x, grad_topk_weights, grad_w_gate_up, grad_w_down)``, streamed per expert:
    the gradient through the sum over experts is each expert's own (index_add's backward is a gather),
    grad_x sums the experts' contributions with ``index_add_`` at each dtype."""
    gx_k, gtw_k, gwgu_k, gwd_k = kernel_grads
    errs = {n: OracleErr(f"moe {n}", g.dtype) for n, g in zip(("grad_w_gate_up", "grad_w_down"), (gwgu_k, gwd_k))}
    gx = {dt: torch.zeros(x.shape, dtype=dt) for dt in (dtype, F64)}
    gtw = {dt: torch.zeros(tw.shape, dtype=dt) for dt in (dtype, F64)}
    used = set(idx.unique().tolist())
    for e in range(wgu.shape[0]):
        if e not in used:  # no tokens: zero gradients
            zu, zd = torch.zeros_like(gwgu_k[e], dtype=F64), torch.zeros_like(gwd_k[e], dtype=F64)
            errs["grad_w_gate_up"].add(gwgu_k[e], zu, zu)
            errs["grad_w_down"].add(gwd_k[e], zd, zd)
            continue
        t, kk = (idx == e).nonzero(as_tuple=True)
        per_dt = {}
        for dt in (dtype, F64):
            g = _expert_grads(x[t], tw[t, kk], wgu[e], wd[e], go[t], dt)
            gx[dt].index_add_(0, t, g[0])
            gtw[dt][t, kk] = g[1]
            per_dt[dt] = g
        errs["grad_w_gate_up"].add(gwgu_k[e], per_dt[dtype][2], per_dt[F64][2])
        errs["grad_w_down"].add(gwd_k[e], per_dt[dtype][3], per_dt[F64][3])
    check_oracle("moe grad_x", gx_k, gx[dtype], gx[F64])
    check_oracle("moe grad_topk_weights", gtw_k, gtw[dtype], gtw[F64])
    for err in errs.values():
        err.check()


def routing(T: int, E: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random softmax routing: ``(topk_idx [T, K] int32, renormalised topk_weights [T, K] fp32)``."""
    p = torch.softmax(torch.randn(T, E, generator=g), -1)
    tw, idx = p.topk(K, -1)
    return idx.to(torch.int32), tw / tw.sum(-1, keepdim=True)


# ----------------------------------------------------------------------------------------- grouped_mm
def _bounds(offs: torch.Tensor) -> list[int]:
    return [0] + offs.tolist()


def grouped_mm(x, w, offs, dt):
    """One ``x[rows of g] @ w[g]`` per group at dtype dt; rows past ``offs[-1]`` are zero."""
    b = _bounds(offs)
    out = torch.zeros(x.shape[0], w.shape[2], dtype=dt)
    for i in range(w.shape[0]):
        if b[i + 1] > b[i]:
            out[b[i]:b[i + 1]] = x[b[i]:b[i + 1]].to(dt) @ w[i].to(dt)
    return out


def check_grouped_mm_bwd(kernel_grads, x, w, offs, go, dtype) -> None:
    """The rule on ``(grad_x, grad_w)``, grad_w streamed per group (torch's: ``x_g.T @ go_g``, by autograd)."""
    gx_k, gw_k = kernel_grads
    b = _bounds(offs)
    gx = {dt: torch.zeros(x.shape, dtype=dt) for dt in (dtype, F64)}
    err_w = OracleErr("grouped_mm grad_w", gw_k.dtype)
    for i in range(w.shape[0]):
        rows = slice(b[i], b[i + 1])
        per_dt = {}
        for dt in (dtype, F64):
            xl, wl = leaves([x[rows], w[i]], dt)
            gx[dt][rows], per_dt[dt] = torch.autograd.grad(xl @ wl, (xl, wl), go[rows].to(dt))
        err_w.add(gw_k[i], per_dt[dtype], per_dt[F64])
    check_oracle("grouped_mm grad_x", gx_k, gx[dtype], gx[F64])
    err_w.check()
