"""Qwen3-MoE router: logits, softmax over experts, top-K and renormalisation as an NKI kernel (+ backward).

Forward (per token ``t``)::

    logits[t]  = x[t] @ w_router.T                       (fp32 accumulation)
    p[t]       = softmax(logits[t])                      (fp32)
    idx[t]     = top-K experts of p[t]                   (descending; ties -> lower expert index)
    weights[t] = p[t, idx] / sum_k p[t, idx_k]   if norm_topk_prob else  p[t, idx]

Shapes/dtypes: ``x [T, H]``, ``w_router [E, H]`` (same dtype, fp32 or bf16) -> ``topk_weights [T, K]``
fp32, ``topk_idx [T, K]`` int32, ``router_logits [T, E]`` fp32, and with ``return_affinities=True`` also
``affinities [T, E]`` fp32: ``affinities[t, idx[t, k]] = weights[t, k]``, zeros elsewhere (nki-library's
``expert_affinities``; the dense form of the routing weights). ``K <= 8`` (one hardware max8), ``E <= 512``
(one PSUM bank of fp32 per token tile), any H (a short last H block uses fewer partitions), any T.

Kernel layout: tokens on partitions (128 per tile) for everything after the matmul, so softmax and
top-K are per-partition free-axis operations. The contraction over H needs H on partitions: for bf16 with
H a multiple of 128 each chunk's x^T is loaded straight from HBM by hardware-DGE ``dma_transpose`` s, one
per sub-tile (the documented hwdge form ``src [16, H/128, P/16, 128]``: 16 rows; ``w_router.T`` by DMA
transposes too, once, kept in SBUF); otherwise (fp32, other H, a tail chunk of a partition count that is
not a multiple of 16) each x tile is loaded once, contiguously, and transposed 128x128 on the Tensor
engine (PSUM -> SBUF copies split between Vector and Scalar).
Top-K uses ``max8`` + ``nc_find_index8`` on the logits (softmax is monotonic, so the selection is that of
the probabilities); ``nc_find_index8`` returns the first occurrence of each value and advances on
duplicates, which gives the documented tie rule. With ``norm_topk_prob`` the softmax denominator
cancels, so only the K selected exponentials are computed; without it one ``exp`` pass with a fused sum
over E gives the denominator. Affinities are scattered on-chip from the selected indices (so they follow
the same tie rule): ``nc_match_replace8`` marks the K selected logits, and the mask of the marks times
``exp(logits - max) / den`` over E (the same ops as for the K weights, so each entry is bit-identical to
its weight) gives the dense row, at a cost independent of K; the ``[T, E]`` store is one contiguous run
per partition like the logits.

Variants (DeepSeek-V3 / GLM-4-MoE style routers): ``scoring="sigmoid"`` scores ``s = sigmoid(logits)``
instead of the softmax; an optional ``selection_bias [E]`` fp32 (sigmoid only) is added to the scores
for *choosing* the experts (``idx = top-K of s + bias``) but not to the weights (``s[idx]``); with
``norm_topk_prob`` the sigmoid weights are divided by ``sum_k s[idx_k] + 1e-20`` (as transformers
does); ``routed_scaling_factor`` multiplies the final weights. Without a bias the sigmoid top-K is chosen
by logit (sigmoid is monotonic; same tie rule), the K weights are ``sigmoid`` of the selected logits;
with a bias ``s + bias`` goes through max8 / nc_find_index8, and each weight is gathered from ``s`` with
a one-hot mask (``(iota == idx_k) * s`` and a sum over E, K Vector passes).

Backward (``router_topk_bwd``): ``g_p = scatter(idx, g_s)`` with ``g_s`` the gradient of the selected
probabilities (through the renormalisation when ``norm_topk_prob``), ``g_logits = p * (g_p - <g_p, p>)
(+ grad_router_logits)`` in fp32 (the per-token one-hot scatter is iota + compare on the Vector engine,
in any order of ``topk_idx``), then ``grad_x = g_logits @ w_router`` and ``grad_w = g_logits.T @ x`` on the
Tensor engine with fp32 accumulation. fp32 inputs: fp32 matmuls. bf16 inputs: ``g_logits`` is split into
two bf16 parts (``hi + lo``, ~16 significant bits) multiplied against the exact bf16 x / w, so the
gradients are as accurate as fp32 math rounded once to bf16, at 2x the bf16 matmul cost (still 2x
cheaper than fp32 matmuls). Sigmoid scoring: ``g_logits = m * s(1 - s) * (G - c) / D`` with
``D = <m, s> + 1e-20``, ``c = <G, m*s> / D`` (``norm_topk_prob``), else ``G * s(1 - s)``; the
routed scaling factor scales the upstream gradient; the selection bias has no gradient (a buffer).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from trnkit.kernels._common import P_MAX, cdiv as _cdiv, dense as _dense, dtype_name as _dtype_name
from trnkit.kernels._common import program_split as _program_split, row_chunks as _token_chunks
from trnkit.kernels.constraints import Violation, check
from trnkit.nki_api import nisa, nki, nl

__all__ = ["router_topk", "router_topk_bwd", "router_topk_ref", "router_topk_bwd_ref", "constraints",
           "router_topk_kernel", "router_topk_bwd_kernel"]

PSUM_FMAX = 512  # fp32 elements per partition in one PSUM bank (= max moving free size)
K_MAX = 8  # one max8 instruction
E_MAX = 512
_DTYPES = ("float32", "bfloat16")
_NEG_BIG = -3.0e38  # pad value for E < 8 (never selected: K <= E)
_MARK = float("inf")  # nc_match_replace8 mark of the selected logits (no finite logit equals it)
_SBUF_BUDGET = 200 * 1024  # of the ~208 KiB usable per partition (trn2)
SCORINGS = ("softmax", "sigmoid")
_SIGMOID_NORM_EPS = 1e-20  # transformers' DeepSeek-V3 / GLM-4-MoE routers: sum + 1e-20


def _sbuf_bytes(H: int, E: int, K: int, itemsize: int, return_affinities: bool = False,
                sigmoid: bool = False) -> int:
    """Peak SBUF bytes per partition of the kernels at their smallest tiling: forward = w^T
    (ceil(H/128)*E) + x slabs of two pipeline stages and their transposes (4*H) + one w row block (H)
    (+ with affinities: up to 4 sub-tiles of fp32 affinities and one sub-tile's marked logits, mask,
    exponentials and weights, 14*E bytes);
    backward = w (ceil(E/128)*H) + x / grad_x rows (2*H) + one group of g_logits tiles."""
    fwd = (_cdiv(H, P_MAX) * E + 5 * H) * itemsize
    if return_affinities:
        fwd += 4 * 4 * E + 14 * E
    if sigmoid:  # the broadcast bias, the scores, s + bias and one one-hot product (fp32)
        fwd += 16 * E
    bwd = (_cdiv(E, P_MAX) * H + 2 * H) * itemsize + _bwd_group(E, K) * (6 * K + 24) * E
    return max(fwd, bwd)


# ---------------------------------------------------------------------------------------------------
# constraints


def constraints(x: Any, w_router: Any, top_k: int, return_affinities: bool = False, scoring: str = "softmax",
                selection_bias: Any = None, routed_scaling_factor: float = 1.0) -> list[Violation]:
    """Violated input constraints of :func:`router_topk` / :func:`router_topk_bwd` (empty = supported);
    ``return_affinities`` adds the SBUF of the dense affinities to the estimate."""
    name = "router_topk"
    v: list[Violation] = _variant_violations(w_router, return_affinities, scoring, selection_bias,
                                             routed_scaling_factor)
    xs, ws = tuple(x.shape), tuple(w_router.shape)
    if len(xs) != 2:
        v.append(Violation(name, "x is 2-D [T, H]", xs))
    if len(ws) != 2:
        v.append(Violation(name, "w_router is 2-D [E, H]", ws))
    if v:
        return v
    T, H = xs
    E, Hw = ws
    if Hw != H:
        v.append(Violation(name, "w_router.shape[1] == H", Hw, f"x has H = {H}"))
    if T < 1 or H < 1 or E < 1:
        v.append(Violation(name, "T, H, E >= 1", {"T": T, "H": H, "E": E}))
    if E > E_MAX:
        v.append(Violation(name, "E <= 512", E, "the logits of a token tile must fit one PSUM bank"))
    k_ok = False
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        v.append(Violation(name, "top_k is an int", type(top_k).__name__, f"value {top_k!r}"))
    elif not 1 <= top_k <= K_MAX:
        v.append(Violation(name, "1 <= top_k <= 8", int(top_k), "top-K is one hardware max8"))
    elif top_k > E:
        v.append(Violation(name, "top_k <= E", int(top_k), f"E = {E}"))
    else:
        k_ok = True
    for tname, t in (("x", x), ("w_router", w_router)):
        if _dtype_name(t) not in _DTYPES:
            v.append(Violation(name, f"{tname}.dtype in {_DTYPES}", _dtype_name(t)))
    if _dtype_name(w_router) != _dtype_name(x):
        v.append(Violation(name, "w_router.dtype == x.dtype", (_dtype_name(x), _dtype_name(w_router)),
                           "the Tensor engine needs both operands fp32 or both bf16"))
    if k_ok:
        need = _sbuf_bytes(H, E, int(top_k), 4 if _dtype_name(x) == "float32" else 2, bool(return_affinities),
                           scoring == "sigmoid")
        if need > _SBUF_BUDGET:
            v.append(Violation(name, "SBUF per partition <= 200 KiB", need,
                               "w_router stays resident in SBUF next to at least one x slab per pipeline "
                               "stage (about ceil(H/128)*E + ceil(E/128)*H + 5*H elements); reduce H or E"))
    return v


def _variant_violations(w_router: Any, return_affinities: bool, scoring: str, selection_bias: Any,
                        routed_scaling_factor: float) -> list[Violation]:
    """The scoring / selection-bias / scaling rules (shapes and types only, no tensor values)."""
    name = "router_topk"
    v: list[Violation] = []
    if scoring not in SCORINGS:
        return [Violation(name, f"scoring in {SCORINGS}", scoring)]
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) \
            or not math.isfinite(routed_scaling_factor):
        v.append(Violation(name, "routed_scaling_factor is a finite number", routed_scaling_factor))
    if scoring == "sigmoid" and return_affinities:
        v.append(Violation(name, "return_affinities with scoring='softmax'", scoring,
                           "the dense affinities are built for softmax scores only"))
    if selection_bias is None:
        return v
    if scoring != "sigmoid":
        v.append(Violation(name, "selection_bias with scoring='sigmoid'", scoring,
                           "choosing by softmax + bias would need the probabilities over E first"))
    E = w_router.shape[0] if len(w_router.shape) == 2 else None
    if tuple(selection_bias.shape) != (E,):
        v.append(Violation(name, "selection_bias.shape == (E,)", tuple(selection_bias.shape)))
    if _dtype_name(selection_bias) != "float32":
        v.append(Violation(name, "selection_bias.dtype == float32", _dtype_name(selection_bias)))
    return v


# ---------------------------------------------------------------------------------------------------
# torch references


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    return torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)


def _weights_of(scores: torch.Tensor, idx: torch.Tensor, norm_topk_prob: bool, scoring: str,
                routed_scaling_factor: float) -> torch.Tensor:
    """The routing weights of the chosen experts: renormalised (sigmoid: + 1e-20) and scaled."""
    vals = scores.gather(1, idx)
    if norm_topk_prob:
        den = vals.sum(dim=-1, keepdim=True)
        vals = vals / (den + _SIGMOID_NORM_EPS if scoring == "sigmoid" else den)
    return vals * routed_scaling_factor if routed_scaling_factor != 1.0 else vals


def router_topk_ref(x: torch.Tensor, w_router: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
                    return_affinities: bool = False, scoring: str = "softmax",
                    selection_bias: torch.Tensor | None = None,
                    routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, ...]:
    """Torch reference: ``(topk_weights [T,K] f32, topk_idx [T,K] int32, router_logits [T,E] f32)``, plus
    ``affinities [T,E] f32`` (the weights scattered into their expert columns) when ``return_affinities``.
    ``scoring`` / ``selection_bias`` / ``routed_scaling_factor``: see the module docstring."""
    check(_variant_violations(w_router, return_affinities, scoring, selection_bias, routed_scaling_factor))
    logits = x.float() @ w_router.float().T
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
        logits = xf @ wf.T
        vals = _weights_of(_scores(logits, scoring), topk_idx.long(), norm_topk_prob, scoring, routed_scaling_factor)
        outs, grads = [vals], [grad_topk_weights.float()]
        if grad_router_logits is not None:
            outs.append(logits)
            grads.append(grad_router_logits.float())
        gx, gw = torch.autograd.grad(outs, (xf, wf), grads)
    return gx.to(x.dtype), gw.to(w_router.dtype)


# ---------------------------------------------------------------------------------------------------
# NKI kernels


def _copy_engine(load, n):
    """Engine for a PSUM -> SBUF copy of ``n`` elements per partition: Vector (0.96 GHz) or Scalar
    (1.2 GHz), whichever has less work queued (both read PSUM; GpSimd cannot). ``load`` = [vec, act] ns."""
    v, a = load[0] + n / 0.96, load[1] + n / 1.2
    if v <= a:
        load[0] = v
        return nisa.engine.vector
    load[1] = a
    return nisa.engine.scalar


def _transpose_blocks(pairs, rows, cols, dtype, load):
    """For each ``(dst, src)``: ``dst[c, j, r] = src[r, j*128 + c]``, i.e. ``src [rows, cols]`` (SBUF)
    transposed in 128-column blocks into ``dst [128, ceil(cols/128), >= rows]`` (SBUF) on the Tensor
    engine, one PSUM bank-full of blocks per PSUM -> SBUF copy (a short last block, ``cols % 128``,
    alone). Blocks of the different pairs are interleaved so consecutive transposes never target the
    same PSUM tile."""
    n_full = cols // P_MAX
    itemsize = 4 if dtype == nl.float32 else 2  # fp32 or bf16 (see constraints)
    per_bank = max(1, 2048 // (P_MAX * itemsize))  # [128, 128] blocks per 2 KiB bank
    for j0 in range(0, n_full, per_bank):
        j1 = min(n_full, j0 + per_bank)
        ps = []
        for _ in pairs:
            ps.append(nl.ndarray((P_MAX, j1 - j0, rows), dtype=dtype, buffer=nl.psum))
        for j in range(j0, j1):
            for i in range(len(pairs)):
                nisa.nc_transpose(dst=ps[i][:, j - j0, :], data=pairs[i][1][0:rows, j * P_MAX:(j + 1) * P_MAX])
        for i in range(len(pairs)):
            nisa.tensor_copy(dst=pairs[i][0][:, j0:j1, 0:rows], src=ps[i],
                             engine=_copy_engine(load, (j1 - j0) * rows))
        ps = None
    if cols > n_full * P_MAX:
        cb = cols - n_full * P_MAX
        for i in range(len(pairs)):
            pt = nl.ndarray((cb, rows), dtype=dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=pt, data=pairs[i][1][0:rows, n_full * P_MAX:cols])
            nisa.tensor_copy(dst=pairs[i][0][0:cb, n_full, 0:rows], src=pt, engine=_copy_engine(load, rows))


def _load_w_transposed(w, load, dma_t=False):
    """``w_router [E, H]`` -> SBUF ``wT [128, ceil(H/128), E]`` (``wT[c, j, e] = w[e, j*128 + c]``), by DMA
    transpose when ``dma_t`` (bf16, H a multiple of 128) for each block of 128 experts whose size is a
    multiple of 16, else on the Tensor engine."""
    E, H = w.shape
    n_h = _cdiv(H, P_MAX)
    wT = nl.ndarray((P_MAX, n_h, E), dtype=w.dtype, buffer=nl.sbuf)
    for e0 in range(0, E, P_MAX):
        ec = min(P_MAX, E - e0)
        if dma_t and ec % _DMA_T_ROWS == 0:
            for r0 in range(e0, e0 + ec, _DMA_T_ROWS):
                _dma_transpose_rows(wT[:, :, r0:r0 + _DMA_T_ROWS],
                                    w.ap(pattern=[[H, _DMA_T_ROWS], [P_MAX, n_h], [1, P_MAX]], offset=r0 * H))
            continue
        w_sb = nl.ndarray((ec, H), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_sb, src=w[e0:e0 + ec, :])
        _transpose_blocks([(wT[:, :, e0:e0 + ec], w_sb)], ec, H, w.dtype, load)
    return wT


# Rows per hardware-DGE DMA transpose: the documented 3-D / 4-D form needs src.shape[0] in {1, 2, 4, 8, 16}
# and src.shape[0] * src.shape[-2] % 16 == 0 (nisa.dma_transpose docstring, NKI 0.6); 16 rows always fit.
_DMA_T_ROWS = 16


def _dma_transpose_rows(dst, src):
    """One hardware-DGE transpose ``src [16, a, b, 128]`` -> ``dst [128, a, b, 16]`` (or 3-D)."""
    nisa.dma_transpose(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge)


# Token sub-tiles per chunk: each partition holds NT consecutive tokens, so the logits store is one
# contiguous NT*E*4-byte run per partition and the x load NT*H elements. Longer inputs amortise a deeper
# chunk; shorter ones fill the pipeline sooner with NT=2 (cost model, H=2048: T=2048 61% vs 57% of the
# HBM bound with NT=4; T=8192 77.5% vs 73%; with the DMA transpose of x, T=8192: NT=4 80.7%, NT=2 79.0%,
# NT=8 79.4%).
def _sub_tiles(T, H, itemsize):
    nt = 4 if T >= 4096 else 2
    # x slabs of two pipeline stages + their transposes: 4 * NT * H elements per partition
    return max(1, min(nt, (120 * 1024) // (4 * H * itemsize)))
# Token tiles whose backward g_logits steps are issued in lockstep (latency hiding), at most 8 and
# within ~96 KiB of SBUF per partition (~72 bytes per expert per tile: K fp32 products, K fp16 masks, ...)
def _bwd_group(E, K):
    return max(1, min(8, 96 * 1024 // ((6 * K + 24) * E)))


def _scatter_affinities(aff, lg, top8, neg_max, rden, p_all, E, K):
    """Dense ``aff [P, E]`` fp32 of one token sub-tile: the selected experts' weights, 0 elsewhere.

    ``nc_match_replace8`` marks the K selected logits (the first occurrence of each of ``top8[:, :K]``,
    advancing on duplicates: the same experts ``nc_find_index8`` picked, ties included; the unused
    slots hold the mark itself, which no finite logit equals) with +inf; ``mask = (marked == inf)``
    (fp16, exact); the weights ``exp(lg - max) * (1/den)`` are computed over E exactly as for the K
    selected (same Scalar-engine ops on the same fp32 values, so ``aff[t, idx_k] == weights[t, k]``
    bit for bit) and multiplied by the mask on the GpSimd engine. Cost independent of K: two Vector
    passes over E, one or two Scalar passes (the ``exp`` over E exists already without
    ``norm_topk_prob``) and one GpSimd pass."""
    P = aff.shape[0]
    vals = top8
    if K < 8:
        vals = nl.ndarray((P, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=vals[:, 0:K], src=top8[:, 0:K], engine=nisa.engine.gpsimd)
        nisa.memset(dst=vals[:, K:8], value=_MARK, engine=nisa.engine.gpsimd)
    # the whole (padded, >= 8 wide) row, as for max8; the -3e38 pads are never among the K values
    marked = nl.ndarray(lg.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.nc_match_replace8(dst=marked, data=lg, vals=vals, imm=_MARK)
    mask = nl.ndarray((P, E), dtype=nl.float16, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mask, data=marked[:, 0:E], op0=nl.equal, operand0=_MARK, engine=nisa.engine.vector)
    if p_all == None:  # noqa: E711 (the NKI compiler rejects `is`)
        p_all = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=p_all, op=nl.exp, data=lg[:, 0:E], bias=neg_max)
    p_w = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=p_w, data=p_all, op0=nl.multiply, operand0=rden, engine=nisa.engine.scalar)
    nisa.tensor_tensor(dst=aff, data1=p_w, data2=mask, op=nl.multiply, engine=nisa.engine.gpsimd)


def _sigmoid_topk_subtile(lg, top_w, top_i, E, K, norm_topk_prob, scale, bias_sb, iota_e):
    """Sigmoid top-K of one token sub-tile (see :func:`_topk_subtile`): chosen by logit, or by
    ``sigmoid + bias`` when ``bias_sb [128, E]`` (the bias on every partition) is given."""
    P = lg.shape[0]
    f32 = nl.float32
    choice = lg
    s = None
    if bias_sb != None:  # noqa: E711 (the NKI compiler rejects `is not`)
        s = nl.ndarray((P, E), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=s, op=nl.sigmoid, data=lg[:, 0:E])
        choice = nl.ndarray(lg.shape, dtype=f32, buffer=nl.sbuf)
        if lg.shape[1] > E:  # E < 8: pads that are never chosen
            nisa.memset(dst=choice[:, E:lg.shape[1]], value=_NEG_BIG)
        nisa.tensor_tensor(dst=choice[:, 0:E], data1=s, data2=bias_sb[0:P, :], op=nl.add)
    top8 = nl.ndarray((P, 8), dtype=f32, buffer=nl.sbuf)
    nisa.max8(dst=top8, src=choice)
    idx8 = nl.ndarray((P, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=idx8, data=choice, vals=top8)
    nisa.tensor_copy(dst=top_i, src=idx8[:, 0:K], engine=nisa.engine.gpsimd)
    s_k = nl.ndarray((P, K), dtype=f32, buffer=nl.sbuf)
    den = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    if s == None:  # noqa: E711  the K selected logits: the same Scalar op as over E would give
        nisa.activation(dst=s_k, op=nl.sigmoid, data=top8[:, 0:K], reduce_op=nl.add, reduce_res=den,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
    else:  # gather s[idx_k]: one-hot (iota == idx_k) times s, summed over E
        idx_f = nl.ndarray((P, K), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=idx_f, src=idx8[:, 0:K], engine=nisa.engine.gpsimd)
        for k in range(K):
            sel = nl.ndarray((P, E), dtype=f32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=sel, data=iota_e[0:P, :], op0=nl.equal, operand0=idx_f[:, k:k + 1],
                                      op1=nl.multiply, operand1=s)
            nisa.tensor_reduce(dst=s_k[:, k:k + 1], op=nl.add, data=sel, axis=1)
        nisa.tensor_reduce(dst=den, op=nl.add, data=s_k, axis=1)
    if norm_topk_prob:
        rden = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=den, data=den, op0=nl.add, operand0=_SIGMOID_NORM_EPS)
        nisa.reciprocal(dst=rden, data=den)
        if scale != 1.0:
            nisa.tensor_scalar(dst=rden, data=rden, op0=nl.multiply, operand0=scale)
        nisa.tensor_scalar(dst=top_w, data=s_k, op0=nl.multiply, operand0=rden, engine=nisa.engine.scalar)
    else:
        nisa.tensor_scalar(dst=top_w, data=s_k, op0=nl.multiply, operand0=scale, engine=nisa.engine.scalar)


def _topk_subtile(lg, top_w, top_i, E, K, norm_topk_prob, aff=None, scale=1.0):
    """Softmax top-K of one token sub-tile: ``lg [P, >=8]`` fp32 logits (padded when E < 8) ->
    ``top_w [P, K]`` fp32 (times ``scale``), ``top_i [P, K]`` int32 (and the dense ``aff [P, E]`` fp32
    when given)."""
    P = lg.shape[0]
    top8 = nl.ndarray((P, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=top8, src=lg)
    idx8 = nl.ndarray((P, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=idx8, data=lg, vals=top8)
    nisa.tensor_copy(dst=top_i, src=idx8[:, 0:K], engine=nisa.engine.gpsimd)
    neg_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_max, data=top8[:, 0:1], op0=nl.multiply, operand0=-1.0,
                       engine=nisa.engine.scalar)
    e_k = nl.ndarray((P, K), dtype=nl.float32, buffer=nl.sbuf)
    denom = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    p_all = None
    if norm_topk_prob:  # sum over the selected K only: the softmax denominator cancels
        nisa.activation(dst=e_k, op=nl.exp, data=top8[:, 0:K], bias=neg_max, reduce_op=nl.add,
                        reduce_res=denom, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    else:
        p_all = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=p_all, op=nl.exp, data=lg[:, 0:E], bias=neg_max, reduce_op=nl.add,
                        reduce_res=denom, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=e_k, op=nl.exp, data=top8[:, 0:K], bias=neg_max)
    rden = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=rden, data=denom)
    if scale != 1.0:  # routed_scaling_factor folded into the normaliser (weights and affinities alike)
        nisa.tensor_scalar(dst=rden, data=rden, op0=nl.multiply, operand0=scale)
    nisa.tensor_scalar(dst=top_w, data=e_k, op0=nl.multiply, operand0=rden, engine=nisa.engine.scalar)
    if aff != None:  # noqa: E711 (the NKI compiler rejects `is not`)
        _scatter_affinities(aff, lg, top8, neg_max, rden, p_all, E, K)


@nki.jit
def router_topk_kernel(x, w_router, top_k, norm_topk_prob=True, return_affinities=False, scoring="softmax",
                       selection_bias=None, routed_scaling_factor=1.0):
    """NKI kernel behind :func:`router_topk` (inputs already validated).

    Per token sub-tile three stages, software-pipelined so every engine has independent work queued:
    A) Tensor-engine transposes of x (H onto partitions) + PSUM -> SBUF copies (skipped when x^T comes
    by DMA transpose), B) the H-contraction
    matmuls into a PSUM ``[P, E]`` tile + copy out, C) max8 / find_index8 / exp / normalise (+ the
    affinity scatter when ``return_affinities``); sigmoid scoring: :func:`_sigmoid_topk_subtile`.
    Returns ``(topk_w, topk_i, logits)``, or ``(topk_w, topk_i, logits, affinities)``.
    """
    T, H = x.shape
    E = w_router.shape[0]
    K = top_k
    n_h = _cdiv(H, P_MAX)
    Ep = max(E, 8)  # max8 needs >= 8 elements per partition
    topk_w = nl.ndarray((T, K), dtype=nl.float32, buffer=nl.shared_hbm)
    topk_i = nl.ndarray((T, K), dtype=nl.int32, buffer=nl.shared_hbm)
    logits = nl.ndarray((T, E), dtype=nl.float32, buffer=nl.shared_hbm)
    affinities = None
    if return_affinities:
        affinities = nl.ndarray((T, E), dtype=nl.float32, buffer=nl.shared_hbm)
    load = [0.0, 0.0]
    # H a multiple of 128: x^T tiles come straight from HBM by DMA transpose (the Tensor engine then only
    # runs the matmuls); otherwise x is loaded and transposed on the Tensor engine.
    dma_t = H % P_MAX == 0 and x.dtype != nl.float32  # the hardware-DGE transpose moves 2-byte elements
    wT = _load_w_transposed(w_router, load, dma_t)
    bias_sb = iota_e = None
    if selection_bias != None:  # noqa: E711  the bias on every partition (stride-0 DMA), expert ids
        bias_sb = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias_sb, src=selection_bias.ap(pattern=[[0, P_MAX], [1, E]], offset=0))
        iota_e = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=iota_e, pattern=[[1, E]], offset=0, channel_multiplier=0)
    chunks = _token_chunks(T, _sub_tiles(T, H, 4 if x.dtype == nl.float32 else 2))
    # SPMD (``router_topk_kernel[2]`` on LNC=2): program i takes every n_prog-th chunk
    n_prog, pid = _program_split()
    mine = []
    for i in range(pid, len(chunks), n_prog):
        mine.append(chunks[i])
    chunks = mine
    n = len(chunks)
    x_dma = []  # whether chunk i's x^T comes by DMA transpose (its partition count a multiple of 16)
    for i in range(n):
        x_dma.append(dma_t and chunks[i][1] % _DMA_T_ROWS == 0)
    x_sb = [None] * n
    xT = [None] * n
    lg_all = [None] * n
    for step in range(n + 3):
        if step < n:  # stage L: load x one stage ahead (the DMA queue stays ahead of the transposes)
            t0, P, NT = chunks[step]
            if x_dma[step]:  # x^T straight from HBM: xT[c_, j, h, p] = x[t0 + p*NT + j, h*128 + c_]
                xT[step] = nl.ndarray((P_MAX, NT, n_h, P), dtype=x.dtype, buffer=nl.sbuf)
                for j in range(NT):  # sub-tile j: token p = 16 g + r of the chunk is row t0 + p*NT + j
                    _dma_transpose_rows(xT[step][:, j, :, :].reshape_dim(2, (P // _DMA_T_ROWS, _DMA_T_ROWS)),
                                        x.ap(pattern=[[NT * H, _DMA_T_ROWS], [P_MAX, n_h],
                                                      [_DMA_T_ROWS * NT * H, P // _DMA_T_ROWS], [1, P_MAX]],
                                             offset=(t0 + j) * H))
            else:
                x_sb[step] = nl.ndarray((P, NT, H), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb[step], src=x.ap(pattern=[[NT * H, P], [H, NT], [1, H]], offset=t0 * H))
        c = step - 1
        if 0 <= c < n and not x_dma[c]:  # stage A: transpose every sub-tile (interleaved)
            t0, P, NT = chunks[c]
            xT[c] = nl.ndarray((P_MAX, NT, n_h, P), dtype=x.dtype, buffer=nl.sbuf)
            pairs = []
            for j in range(NT):
                pairs.append((xT[c][:, j, :, :], x_sb[c][:, j, :]))
            _transpose_blocks(pairs, P, H, x.dtype, load)
            x_sb[c] = None
        c = step - 2
        if 0 <= c < n:  # stage B: logits, the NT accumulation chains interleaved
            t0, P, NT = chunks[c]
            lg_all[c] = nl.ndarray((P, NT, Ep), dtype=nl.float32, buffer=nl.sbuf)
            if E < 8:  # pad with a value no logit can lose to (K <= E)
                nisa.memset(dst=lg_all[c][:, :, E:8], value=_NEG_BIG)
            lg_ps = []
            for j in range(NT):
                lg_ps.append(nl.ndarray((P, E), dtype=nl.float32, buffer=nl.psum))
            for h in range(n_h):
                hb = min(P_MAX, H - h * P_MAX)
                for j in range(NT):
                    nisa.nc_matmul(dst=lg_ps[j], stationary=xT[c][0:hb, j, h, :], moving=wT[0:hb, h, :],
                                   accumulate=(h > 0))
            for j in range(NT):
                nisa.tensor_copy(dst=lg_all[c][:, j, 0:E], src=lg_ps[j], engine=_copy_engine(load, E))
            xT[c] = None
        c = step - 3
        if 0 <= c < n:  # stage C: top-K, then one contiguous store per partition per output
            t0, P, NT = chunks[c]
            w_all = nl.ndarray((P, NT, K), dtype=nl.float32, buffer=nl.sbuf)
            i_all = nl.ndarray((P, NT, K), dtype=nl.int32, buffer=nl.sbuf)
            a_all = None
            if return_affinities:
                a_all = nl.ndarray((P, NT, E), dtype=nl.float32, buffer=nl.sbuf)
            for j in range(NT):
                a_j = None
                if return_affinities:
                    a_j = a_all[:, j, :]
                if scoring == "sigmoid":
                    _sigmoid_topk_subtile(lg_all[c][:, j, :], w_all[:, j, :], i_all[:, j, :], E, K, norm_topk_prob,
                                          routed_scaling_factor, bias_sb, iota_e)
                else:
                    _topk_subtile(lg_all[c][:, j, :], w_all[:, j, :], i_all[:, j, :], E, K, norm_topk_prob, a_j,
                                  routed_scaling_factor)
            nisa.dma_copy(dst=logits.ap(pattern=[[NT * E, P], [E, NT], [1, E]], offset=t0 * E),
                          src=lg_all[c][:, :, 0:E])
            nisa.dma_copy(dst=topk_w.ap(pattern=[[NT * K, P], [K, NT], [1, K]], offset=t0 * K), src=w_all)
            nisa.dma_copy(dst=topk_i.ap(pattern=[[NT * K, P], [K, NT], [1, K]], offset=t0 * K), src=i_all)
            if return_affinities:
                nisa.dma_copy(dst=affinities.ap(pattern=[[NT * E, P], [E, NT], [1, E]], offset=t0 * E),
                              src=a_all)
            lg_all[c] = None
    if return_affinities:
        return topk_w, topk_i, logits, affinities
    return topk_w, topk_i, logits


def _tiles(group, dtype, width=0):
    """One SBUF tile per token tile of ``group``: ``[P_i, width]``, or the shape of its logits when
    ``width`` is 0 (a module-level helper, not a closure: kernel code stays plain calls)."""
    out = []
    for g in group:
        out.append(nl.ndarray((g[0].shape[0], width if width > 0 else g[0].shape[1]), dtype=dtype, buffer=nl.sbuf))
    return out


def _logit_grad_tiles(group, iota_e, norm_topk_prob, scoring="softmax"):
    """fp32 ``g_logits [P, E]`` for each token tile of ``group``: a list of ``(lg [P, E] fp32 logits,
    ik [P, K] int32 expert ids, gk [P, K] fp32 upstream top-K weight gradients, gl_in [P, E] or None
    (gradient of the logits themselves))``.

    With ``e = exp(lg - max)`` and ``G = sum_k onehot(ik_k) * gk_k`` (dense scatter, any order of ik):
    norm_topk_prob: ``g = m*e/S_sel * (G - c)``, ``m`` the selection mask, ``S_sel = <m, e>``,
    ``c = <G, m*e> / S_sel`` (the softmax Jacobian term cancels exactly);
    else: ``g = e/S * (G - <G, e>/S)``, ``S = sum(e)``.
    Every step is issued for all tiles of the group before the next step (independent instructions
    between dependent ones hide the engines' latency); the K one-hot products are summed as a tree on
    the otherwise idle GpSimd engine. One-hot masks are fp16 (exact small integers). Sigmoid scoring:
    ``e`` is ``s = sigmoid(lg)``, the normaliser ``S_sel + 1e-20`` (none without norm_topk_prob) and
    the Jacobian factor ``s(1 - s)`` (see :func:`_sigmoid_jacobian`).
    """
    n = len(group)
    P, E = group[0][0].shape
    K = group[0][1].shape[1]
    f32 = nl.float32

    sigmoid = scoring == "sigmoid"
    neg_max, s_all, e = _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32)
    ikf = _tiles(group, f32, K)
    for i in range(n):
        if not sigmoid:
            nisa.tensor_reduce(dst=neg_max[i], op=nl.maximum, data=group[i][0], axis=1, negate=True)
        nisa.tensor_copy(dst=ikf[i], src=group[i][1], engine=nisa.engine.gpsimd)
    for i in range(n):
        if sigmoid:
            nisa.activation(dst=e[i], op=nl.sigmoid, data=group[i][0])
        else:
            nisa.activation(dst=e[i], op=nl.exp, data=group[i][0], bias=neg_max[i], reduce_op=nl.add,
                            reduce_res=s_all[i], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    # products[i][k] = onehot(ik_k) * gk_k, masks[i][k] = onehot(ik_k)
    prods = []
    masks = []
    for i in range(n):
        prods.append([None] * K)
        masks.append([None] * K)
    for k in range(K):
        for i in range(n):
            rows = group[i][0].shape[0]
            prods[i][k] = nl.ndarray((rows, E), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=prods[i][k], data=iota_e[0:rows, :], op0=nl.equal, operand0=ikf[i][:, k:k + 1],
                               op1=nl.multiply, operand1=group[i][2][:, k:k + 1])
            if norm_topk_prob:
                masks[i][k] = nl.ndarray((rows, E), dtype=nl.float16, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=masks[i][k], data=iota_e[0:rows, :], op0=nl.equal,
                                   operand0=ikf[i][:, k:k + 1])
    width = 1
    while width < K:  # pairwise tree sums on GpSimd
        for k in range(0, K - width, 2 * width):
            for i in range(n):
                nisa.tensor_tensor(dst=prods[i][k], data1=prods[i][k], data2=prods[i][k + width], op=nl.add,
                                   engine=nisa.engine.gpsimd)
                if norm_topk_prob:
                    nisa.tensor_tensor(dst=masks[i][k], data1=masks[i][k], data2=masks[i][k + width], op=nl.add,
                                       engine=nisa.engine.gpsimd)
        width = width * 2
    G = []
    m0 = []
    for i in range(n):
        G.append(prods[i][0])
        m0.append(masks[i][0])
    if sigmoid:
        return _sigmoid_logit_grads(group, G, m0, e, norm_topk_prob)
    den, dot, rden, neg_c = _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32, 1)
    tmp, g = _tiles(group, f32), _tiles(group, f32)
    if norm_topk_prob:
        weight = _tiles(group, f32)  # m * e
        for i in range(n):
            nisa.tensor_tensor(dst=weight[i], data1=e[i], data2=masks[i][0], op=nl.multiply)
        for i in range(n):
            nisa.tensor_reduce(dst=den[i], op=nl.add, data=weight[i], axis=1)
    else:
        weight = e
        den = s_all
    for i in range(n):
        nisa.reciprocal(dst=rden[i], data=den[i])
        nisa.tensor_tensor(dst=tmp[i], data1=G[i], data2=weight[i], op=nl.multiply)
    for i in range(n):
        nisa.tensor_reduce(dst=dot[i], op=nl.add, data=tmp[i], axis=1)
    for i in range(n):  # -<G, weight> / den
        nisa.tensor_scalar(dst=neg_c[i], data=dot[i], op0=nl.multiply, operand0=rden[i], op1=nl.multiply,
                           operand1=-1.0)
    for i in range(n):  # g = ((G - c) * (1/den)) * weight
        nisa.tensor_scalar(dst=g[i], data=G[i], op0=nl.add, operand0=neg_c[i], op1=nl.multiply, operand1=rden[i])
    for i in range(n):
        nisa.tensor_tensor(dst=g[i], data1=g[i], data2=weight[i], op=nl.multiply)
    return _plus_logit_grads(group, g)


def _plus_logit_grads(group, g):
    """``g += grad_router_logits`` for the tiles that have one (the logits are an output too)."""
    for i in range(len(group)):
        if group[i][3] != None:  # noqa: E711 (the NKI compiler rejects `is`)
            nisa.tensor_tensor(dst=g[i], data1=g[i], data2=group[i][3], op=nl.add)
    return g


def _sigmoid_jacobian(s):
    """``s * (1 - s)`` of each tile (the derivative of the sigmoid, from its output)."""
    out = []
    for t in s:
        d = nl.ndarray(t.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=d, data=t, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=d, data1=d, data2=t, op=nl.multiply)
        out.append(d)
    return out


def _sigmoid_logit_grads(group, G, masks, s, norm_topk_prob):
    """``g_logits`` for sigmoid scores ``s`` (see :func:`_logit_grad_tiles`): norm_topk_prob:
    ``m * s(1-s) * (G - c) / D``, ``D = <m, s> + 1e-20``, ``c = <G, m*s> / D``; else ``G * s(1-s)``
    (``G`` is zero off the selection)."""
    n = len(group)
    f32 = nl.float32
    jac = _sigmoid_jacobian(s)
    g = _tiles(group, f32)
    if norm_topk_prob:
        ms, tmp = _tiles(group, f32), _tiles(group, f32)
        den, dot, rden, neg_c = _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32, 1)
        for i in range(n):
            nisa.tensor_tensor(dst=ms[i], data1=s[i], data2=masks[i], op=nl.multiply)
            nisa.tensor_tensor(dst=jac[i], data1=jac[i], data2=masks[i], op=nl.multiply)
        for i in range(n):
            nisa.tensor_reduce(dst=den[i], op=nl.add, data=ms[i], axis=1)
            nisa.tensor_tensor(dst=tmp[i], data1=G[i], data2=ms[i], op=nl.multiply)
        for i in range(n):
            nisa.tensor_scalar(dst=den[i], data=den[i], op0=nl.add, operand0=_SIGMOID_NORM_EPS)
            nisa.tensor_reduce(dst=dot[i], op=nl.add, data=tmp[i], axis=1)
        for i in range(n):
            nisa.reciprocal(dst=rden[i], data=den[i])
        for i in range(n):  # -<G, m s> / D
            nisa.tensor_scalar(dst=neg_c[i], data=dot[i], op0=nl.multiply, operand0=rden[i], op1=nl.multiply,
                               operand1=-1.0)
        for i in range(n):  # g = ((G - c) * (1/D)) * m s(1-s)
            nisa.tensor_scalar(dst=g[i], data=G[i], op0=nl.add, operand0=neg_c[i], op1=nl.multiply,
                               operand1=rden[i])
            nisa.tensor_tensor(dst=g[i], data1=g[i], data2=jac[i], op=nl.multiply)
    else:
        for i in range(n):
            nisa.tensor_tensor(dst=g[i], data1=G[i], data2=jac[i], op=nl.multiply)
    return _plus_logit_grads(group, g)


@nki.jit
def router_topk_bwd_kernel(x, w_router, router_logits, topk_idx, grad_topk_weights, grad_router_logits,
                           has_grad_logits=False, norm_topk_prob=True, scoring="softmax",
                           routed_scaling_factor=1.0):
    """NKI kernel behind :func:`router_topk_bwd`. Phase 1 (per token tile): ``g_logits`` and
    ``grad_x = g_logits @ w``; ``grad_w = g_logits.T @ x`` accumulated over token tiles in PSUM, during
    phase 1 when it fits 4 PSUM banks, else in a phase 2 over a g_logits scratch.
    The matmuls take ``x.dtype`` operands (bf16 like autograd of a bf16 linear; fp32 accumulation)."""
    T, H = x.shape
    E = w_router.shape[0]
    K = topk_idx.shape[1]
    n_e = _cdiv(E, P_MAX)
    mm = x.dtype
    grad_x = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    grad_w = nl.ndarray((E, H), dtype=w_router.dtype, buffer=nl.shared_hbm)
    split = mm != nl.float32
    # grad_w fits 4 PSUM banks (E <= 128, H <= 2048, e.g. Qwen3-30B-A3B): accumulate it during phase 1
    # (no second pass over x, no g_logits scratch); else phase 2 re-reads g_logits from an HBM scratch
    fused_w = n_e == 1 and H <= 4 * PSUM_FMAX
    n_parts = 2 if split else 1
    if fused_w:
        w_accs = []
        for h0 in range(0, H, PSUM_FMAX):
            w_accs.append(nl.ndarray((E, min(PSUM_FMAX, H - h0)), dtype=nl.float32, buffer=nl.psum))
    else:
        g_hbm = nl.ndarray((n_parts, T, E), dtype=mm, buffer=nl.shared_hbm)  # bf16: hi and lo parts
    load = [0.0, 0.0]
    # w resident in SBUF [128, n_e, H]: E on partitions = the contraction of grad_x
    w_sb = nl.ndarray((P_MAX, n_e, H), dtype=mm, buffer=nl.sbuf)
    for c in range(n_e):
        ec = min(P_MAX, E - c * P_MAX)
        nisa.dma_copy(dst=w_sb[0:ec, c, :], src=w_router[c * P_MAX:c * P_MAX + ec, :])
    iota_e = nl.ndarray((P_MAX, E), dtype=nl.float16, buffer=nl.sbuf)  # 0..E-1 on every partition (exact)
    nisa.iota(dst=iota_e, pattern=[[1, E]], offset=0, channel_multiplier=0)
    tiles = []
    for t0 in range(0, T, P_MAX):
        tiles.append((t0, min(P_MAX, T - t0)))
    gs = _bwd_group(E, K)
    groups = []
    for g0 in range(0, len(tiles), gs):
        groups.append(list(range(g0, min(len(tiles), g0 + gs))))
    n = len(groups)
    ins = [None] * n  # stage L -> G
    glT = [None] * n  # stage G -> M
    # phase 1, software-pipelined over groups of token tiles: L(i) loads, G(i-1) g_logits + transposes,
    # M(i-2) grad_x matmuls (so the Vector work of one group overlaps the matmuls of the previous)
    for step in range(n + 2):
        if step < n:
            ins[step] = []
            for ti in groups[step]:
                t0, tp = tiles[ti]
                lg = nl.ndarray((tp, E), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=lg, src=router_logits[t0:t0 + tp, :])
                ik = nl.ndarray((tp, K), dtype=nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=ik, src=topk_idx[t0:t0 + tp, :])
                gk = nl.ndarray((tp, K), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=gk, src=grad_topk_weights[t0:t0 + tp, :])
                if routed_scaling_factor != 1.0:  # weights = scale * w': the upstream gradient of w'
                    nisa.tensor_scalar(dst=gk, data=gk, op0=nl.multiply, operand0=routed_scaling_factor)
                gl_in = None
                if has_grad_logits:
                    gl_in = nl.ndarray((tp, E), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=gl_in, src=grad_router_logits[t0:t0 + tp, :])
                ins[step].append((lg, ik, gk, gl_in))
        i_g = step - 1
        if 0 <= i_g < n:
            g_ls = _logit_grad_tiles(ins[i_g], iota_e, norm_topk_prob, scoring)
            ins[i_g] = None
            glT[i_g] = []
            for gi in range(len(g_ls)):
                t0, tp = tiles[groups[i_g][gi]]
                g_l = g_ls[gi]
                if split:  # g = hi + lo, both bf16: ~16 significant bits through bf16 matmuls
                    hi = nl.ndarray((tp, E), dtype=mm, buffer=nl.sbuf)
                    parts = [hi, nl.ndarray((tp, E), dtype=mm, buffer=nl.sbuf)]
                    nisa.tensor_copy(dst=parts[0], src=g_l, engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=parts[1], data1=g_l, data2=parts[0], op=nl.subtract,
                                       engine=nisa.engine.gpsimd)
                else:
                    parts = [g_l]
                x_sb = None
                if fused_w:
                    x_sb = nl.ndarray((tp, H), dtype=mm, buffer=nl.sbuf)
                    nisa.dma_copy(dst=x_sb, src=x[t0:t0 + tp, :])
                else:
                    for i in range(len(parts)):
                        nisa.dma_copy(dst=g_hbm[i, t0:t0 + tp, :], src=parts[i])
                # grad_x needs g_l^T (E on partitions: the contraction)
                gT = []
                pairs = []
                for i in range(len(parts)):
                    gT.append(nl.ndarray((P_MAX, n_e, tp), dtype=mm, buffer=nl.sbuf))
                    pairs.append((gT[i], parts[i]))
                _transpose_blocks(pairs, tp, E, mm, load)
                glT[i_g].append((gT, parts, x_sb))
        i_m = step - 2
        if 0 <= i_m < n:  # grad_x [tp, H] = g_l [tp, E] @ w [E, H]; the H blocks' chains interleaved
            for gi in range(len(groups[i_m])):
                ti = groups[i_m][gi]
                t0, tp = tiles[ti]
                gT, parts, x_sb = glT[i_m][gi]
                gx_sb = nl.ndarray((tp, H), dtype=x.dtype, buffer=nl.sbuf)
                nb = 2 if fused_w else 4  # grad_x PSUM banks in flight (fused: 4 hold grad_w)
                for hq in range(0, H, nb * PSUM_FMAX):
                    blocks = []
                    gx_ps = []
                    for h0 in range(hq, min(H, hq + nb * PSUM_FMAX), PSUM_FMAX):
                        blocks.append((h0, min(PSUM_FMAX, H - h0)))
                        gx_ps.append(nl.ndarray((tp, min(PSUM_FMAX, H - h0)), dtype=nl.float32, buffer=nl.psum))
                    for c in range(n_e):
                        ec = min(P_MAX, E - c * P_MAX)
                        for i in range(len(gT)):
                            for b in range(len(blocks)):
                                h0, hc = blocks[b]
                                nisa.nc_matmul(dst=gx_ps[b], stationary=gT[i][0:ec, c, :],
                                               moving=w_sb[0:ec, c, h0:h0 + hc], accumulate=(c > 0 or i > 0))
                    for b in range(len(blocks)):
                        h0, hc = blocks[b]
                        nisa.tensor_copy(dst=gx_sb[:, h0:h0 + hc], src=gx_ps[b], engine=_copy_engine(load, hc))
                nisa.dma_copy(dst=grad_x[t0:t0 + tp, :], src=gx_sb)
                if fused_w:  # grad_w [E, H] += g_l^T x: contraction over this tile's tokens
                    for i in range(len(parts)):
                        for a in range(len(w_accs)):
                            h0 = a * PSUM_FMAX
                            nisa.nc_matmul(dst=w_accs[a], stationary=parts[i],
                                           moving=x_sb[:, h0:h0 + w_accs[a].shape[1]], accumulate=(ti > 0 or i > 0))
            glT[i_m] = None
    if fused_w:
        gw_sb = nl.ndarray((E, H), dtype=w_router.dtype, buffer=nl.sbuf)
        for a in range(len(w_accs)):
            h0 = a * PSUM_FMAX
            nisa.tensor_copy(dst=gw_sb[:, h0:h0 + w_accs[a].shape[1]], src=w_accs[a],
                             engine=_copy_engine(load, w_accs[a].shape[1]))
        nisa.dma_copy(dst=grad_w, src=gw_sb)
        return grad_x, grad_w
    # phase 2: grad_w [E, H] = sum over token tiles of g_l^T x; groups of 4 PSUM banks per E chunk
    for c in range(n_e):
        e0 = c * P_MAX
        ec = min(P_MAX, E - e0)
        for hg in range(0, H, 4 * PSUM_FMAX):
            hw = min(4 * PSUM_FMAX, H - hg)
            accs = []
            for h0 in range(hg, hg + hw, PSUM_FMAX):
                accs.append(nl.ndarray((ec, min(PSUM_FMAX, hg + hw - h0)), dtype=nl.float32, buffer=nl.psum))
            for t0 in range(0, T, P_MAX):
                tp = min(P_MAX, T - t0)
                g_sb = []
                for i in range(n_parts):
                    g_sb.append(nl.ndarray((tp, ec), dtype=mm, buffer=nl.sbuf))
                for i in range(len(g_sb)):
                    nisa.dma_copy(dst=g_sb[i], src=g_hbm[i, t0:t0 + tp, e0:e0 + ec])
                x_sb = nl.ndarray((tp, hw), dtype=mm, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb, src=x[t0:t0 + tp, hg:hg + hw])
                for i in range(len(g_sb)):  # consecutive matmuls go to different accumulators
                    for a in range(len(accs)):
                        h0 = a * PSUM_FMAX
                        hc = accs[a].shape[1]
                        nisa.nc_matmul(dst=accs[a], stationary=g_sb[i], moving=x_sb[:, h0:h0 + hc],
                                       accumulate=(t0 > 0 or i > 0))
            gw_sb = nl.ndarray((ec, hw), dtype=w_router.dtype, buffer=nl.sbuf)
            for a in range(len(accs)):
                h0 = a * PSUM_FMAX
                nisa.tensor_copy(dst=gw_sb[:, h0:h0 + accs[a].shape[1]], src=accs[a],
                                 engine=_copy_engine(load, accs[a].shape[1]))
            nisa.dma_copy(dst=grad_w[e0:e0 + ec, hg:hg + hw], src=gw_sb)
    return grad_x, grad_w


# ---------------------------------------------------------------------------------------------------
# public entry points


def router_topk(x: Any, w_router: Any, top_k: int, norm_topk_prob: bool = True,
                return_affinities: bool = False, scoring: str = "softmax", selection_bias: Any = None,
                routed_scaling_factor: float = 1.0) -> tuple[Any, ...]:
    """Qwen3 router on ``x [T, H]`` with ``w_router [E, H]`` (NKI kernel).

    Returns ``(topk_weights [T, K] fp32, topk_idx [T, K] int32, router_logits [T, E] fp32)``; experts
    sorted by descending probability, ties broken toward the lower expert index. With
    ``return_affinities=True`` a fourth output ``affinities [T, E] fp32``: the top-K weights (renormalised
    when ``norm_topk_prob``) in their expert columns, zeros elsewhere. ``scoring="sigmoid"``,
    ``selection_bias [E]`` fp32 and ``routed_scaling_factor``: the DeepSeek-V3 variants (module
    docstring). Raises :class:`KernelConstraintError` on unsupported inputs.
    """
    check(constraints(x, w_router, top_k, return_affinities, scoring, selection_bias, routed_scaling_factor))
    return router_topk_kernel(_dense(x), _dense(w_router), int(top_k), norm_topk_prob=bool(norm_topk_prob),
                              return_affinities=bool(return_affinities), scoring=scoring,
                              selection_bias=_dense(selection_bias),
                              routed_scaling_factor=float(routed_scaling_factor))


def router_topk_bwd(x: Any, w_router: Any, router_logits: Any, topk_idx: Any, grad_topk_weights: Any,
                    grad_router_logits: Any = None, norm_topk_prob: bool = True, scoring: str = "softmax",
                    routed_scaling_factor: float = 1.0) -> tuple[Any, Any]:
    """Input gradients of :func:`router_topk`: ``(grad_x [T, H] x.dtype, grad_w_router [E, H] w.dtype)``
    from ``grad_topk_weights [T, K]`` (and ``grad_router_logits [T, E]`` if the logits are used too)."""
    K = int(topk_idx.shape[1]) if len(topk_idx.shape) == 2 else -1
    v = constraints(x, w_router, K, scoring=scoring, routed_scaling_factor=routed_scaling_factor)
    T = int(x.shape[0]) if len(x.shape) == 2 else -1
    E = int(w_router.shape[0]) if len(w_router.shape) == 2 else -1
    for tname, t, shp in (("router_logits", router_logits, (T, E)), ("topk_idx", topk_idx, (T, K)),
                          ("grad_topk_weights", grad_topk_weights, (T, K)),
                          ("grad_router_logits", grad_router_logits, (T, E))):
        if t is not None and tuple(t.shape) != shp:
            v.append(Violation("router_topk_bwd", f"{tname}.shape == {shp}", tuple(t.shape)))
    check(v)
    to_f32 = (lambda t: t.float()) if isinstance(x, torch.Tensor) else (lambda t: np.asarray(t, np.float32))
    to_i32 = (lambda t: t.to(torch.int32)) if isinstance(x, torch.Tensor) else (lambda t: np.asarray(t, np.int32))
    gl = grad_router_logits
    return router_topk_bwd_kernel(
        _dense(x), _dense(w_router), _dense(to_f32(router_logits)), _dense(to_i32(topk_idx)),
        _dense(to_f32(grad_topk_weights)), None if gl is None else _dense(to_f32(gl)),
        has_grad_logits=gl is not None, norm_topk_prob=bool(norm_topk_prob), scoring=scoring,
        routed_scaling_factor=float(routed_scaling_factor))
