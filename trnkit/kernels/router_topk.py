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
top-K are per-partition free-axis operations; partition p of a block holds R consecutive tokens, so
every per-partition HBM access (x rows, logits, top-K) is one contiguous run. The contraction over H
needs x^T (H on partitions), which comes from two sources so that neither the DMA queue nor the Tensor
engine carries it alone: most sub-tiles are loaded contiguously and transposed 128x128 on the Tensor
engine (PSUM -> SBUF copies split between Vector and Scalar); for bf16 with H a multiple of 128, one
full sub-tile in every sixteen comes straight from HBM by a hardware-DGE ``dma_transpose`` (the
documented hwdge form ``src [16, H/128, P/16, 128]``). ``w_router.T`` is transposed once on the Tensor
engine and kept in SBUF. The split keeps the kernel at >= 70% of the HBM bound across the cost model's
DMA-transpose rates (docs/kernels.md).
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
(+ grad_router_logits)`` in fp32. It is computed on the K selected logits first (gathered per partition
with ``nc_n_gather``; ``[tokens, K]`` arithmetic), then scattered to ``[tokens, E]`` by K one-hot
products (iota == id, any order of ``topk_idx``; repeated ids add up like autograd's scatter); then
``grad_x = g_logits @ w_router`` and ``grad_w = g_logits.T @ x`` on the
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


def _load_w_transposed(w, load):
    """``w_router [E, H]`` -> SBUF ``wT [128, ceil(H/128), E]`` (``wT[c, j, e] = w[e, j*128 + c]``): each block
    of 128 experts loaded contiguously and transposed on the Tensor engine (one 4 KiB row per expert,
    where 16-row DMA transposes would move 512 B per partition)."""
    E, H = w.shape
    n_h = _cdiv(H, P_MAX)
    wT = nl.ndarray((P_MAX, n_h, E), dtype=w.dtype, buffer=nl.sbuf)
    for e0 in range(0, E, P_MAX):
        ec = min(P_MAX, E - e0)
        w_sb = nl.ndarray((ec, H), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_sb, src=w[e0:e0 + ec, :])
        _transpose_blocks([(wT[:, :, e0:e0 + ec], w_sb)], ec, H, w.dtype, load)
    return wT


# Rows per hardware-DGE DMA transpose: the documented 3-D / 4-D form needs src.shape[0] in {1, 2, 4, 8, 16}
# and src.shape[0] * src.shape[-2] % 16 == 0 (nisa.dma_transpose docstring, NKI 0.6); 16 rows always fit.
_DMA_T_ROWS = 16


# Token sub-tiles per chunk: partition p holds NT consecutive tokens of the chunk, so the x load is one
# NT*H-element run per partition and the logits store one NT*E*4-byte run. Cost model, H=2048 E=128 K=8
# bf16, low / mid / high fraction of the HBM bound: T=8192 NT=4 88.3 / 83.9 / 74.2%, NT=2 86 / 74 / 58%,
# NT=8 84 / 81 / 71%; T=2048 NT=4 69 / 67 / 58%, NT=2 73 / 64 / 51%; T=1024 NT=2 62 / 55 / 45%.
def _sub_tiles(T, H, itemsize):
    nt = 4 if T >= 2048 else 2
    # x slabs of two pipeline stages + their transposes: 4 * NT * H elements per partition
    return max(1, min(nt, (120 * 1024) // (4 * H * itemsize)))
# Token tiles whose backward g_logits steps are issued in lockstep (latency hiding), at most 4 and
# within ~96 KiB of SBUF per partition (~4K + 24 bytes per expert per tile: K fp32 one-hot products, the
# dense sum, its bf16 parts, ...). Cost model, T=8192 H=2048 E=128 K=8 bf16, optimistic / mid /
# pessimistic: 4 tiles 267 / 272 / 294 us, 2 tiles 254 / 271 / 310 us, 8 tiles 286 / 293 / 320 us.
def _bwd_group(E, K):
    return max(1, min(4, 96 * 1024 // ((6 * K + 24) * E)))


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


def _topk_tiles(lgs, tws, tis, E, K, norm_topk_prob, affs=None, scale=1.0):
    """Softmax top-K of the token sub-tiles of one chunk: ``lgs[j] [P, >=8]`` fp32 logits (padded when
    E < 8) -> ``tws[j] [P, K]`` fp32 (times ``scale``), ``tis[j] [P, K]`` int32 (and the dense
    ``affs[j] [P, E]`` fp32 when given). Every step is issued for all sub-tiles before the next one
    (independent instructions between dependent ones hide the engines' fixed latency)."""
    n = len(lgs)
    P = lgs[0].shape[0]
    f32 = nl.float32
    top8, idx8, neg_max, e_k, denom, rden, p_all = [], [], [], [], [], [], []
    for j in range(n):
        top8.append(nl.ndarray((P, 8), dtype=f32, buffer=nl.sbuf))
        idx8.append(nl.ndarray((P, 8), dtype=nl.uint32, buffer=nl.sbuf))
        neg_max.append(nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf))
        e_k.append(nl.ndarray((P, K), dtype=f32, buffer=nl.sbuf))
        denom.append(nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf))
        rden.append(nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf))
        p_all.append(None)
    for j in range(n):
        nisa.max8(dst=top8[j], src=lgs[j])
    for j in range(n):
        nisa.tensor_scalar(dst=neg_max[j], data=top8[j][:, 0:1], op0=nl.multiply, operand0=-1.0,
                           engine=nisa.engine.scalar)
    for j in range(n):
        nisa.nc_find_index8(dst=idx8[j], data=lgs[j], vals=top8[j])
    for j in range(n):
        if norm_topk_prob:  # sum over the selected K only: the softmax denominator cancels
            nisa.activation(dst=e_k[j], op=nl.exp, data=top8[j][:, 0:K], bias=neg_max[j], reduce_op=nl.add,
                            reduce_res=denom[j], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        else:
            p_all[j] = nl.ndarray((P, E), dtype=f32, buffer=nl.sbuf)
            nisa.activation(dst=p_all[j], op=nl.exp, data=lgs[j][:, 0:E], bias=neg_max[j], reduce_op=nl.add,
                            reduce_res=denom[j], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            nisa.activation(dst=e_k[j], op=nl.exp, data=top8[j][:, 0:K], bias=neg_max[j])
    for j in range(n):
        nisa.tensor_copy(dst=tis[j], src=idx8[j][:, 0:K], engine=nisa.engine.gpsimd)
    for j in range(n):
        nisa.reciprocal(dst=rden[j], data=denom[j])
    for j in range(n):
        if scale != 1.0:  # routed_scaling_factor folded into the normaliser (weights and affinities alike)
            nisa.tensor_scalar(dst=rden[j], data=rden[j], op0=nl.multiply, operand0=scale)
        nisa.tensor_scalar(dst=tws[j], data=e_k[j], op0=nl.multiply, operand0=rden[j], engine=nisa.engine.scalar)
    if affs != None:  # noqa: E711 (the NKI compiler rejects `is not`)
        for j in range(n):
            _scatter_affinities(affs[j], lgs[j], top8[j], neg_max[j], rden[j], p_all[j], E, K)


# Rows per partition of a token block: partition p of a block starting at token t0 holds tokens
# t0 + p*R ... t0 + p*R + R - 1, so each chunk's x rows, logits and top-K outputs are one contiguous run
# per partition in HBM, whatever the chunk's row count.
_BLOCK_ROWS = 64
# One full 128-token sub-tile in every _DMA_T_EVERY gets its x^T by DMA transpose (8 hardware-DGE
# transposes of 16 rows); the Tensor engine transposes the others. The split balances the DMA queue
# against the Tensor engine at both ends of the cost model's range (docs/kernels.md "router_topk").
_DMA_T_EVERY = 16


def _fwd_chunks(T0, T1, nt):
    """Chunks ``(t0, P, R, r0, NT)`` of tokens ``[T0, T1)``: token ``t0 + p*R + r0 + j`` is partition ``p``
    of sub-tile ``j < NT`` (blocks of ``R`` rows per partition, see ``_BLOCK_ROWS``; a short tail uses
    ``P < 128`` partitions)."""
    chunks = []
    for b0, P, R in _token_chunks(T1 - T0, _BLOCK_ROWS):
        for r0 in range(0, R, nt):
            chunks.append((T0 + b0, P, R, r0, min(nt, R - r0)))
    return chunks


def _store_rows(dst, src, base, R):
    """``src [P, NT, F]`` (SBUF) -> rows ``base + p*R + j`` of ``dst [T, F]`` (HBM): one contiguous run of
    NT*F elements per partition."""
    P, NT, F = src.shape
    nisa.dma_copy(dst=dst.ap(pattern=[[R * F, P], [F, NT], [1, F]], offset=base * F), src=src,
                  dge_mode=nisa.dge_mode.hwdge)


@nki.jit
def router_topk_kernel(x, w_router, top_k, norm_topk_prob=True, return_affinities=False, scoring="softmax",
                       selection_bias=None, routed_scaling_factor=1.0):
    """NKI kernel behind :func:`router_topk` (inputs already validated).

    Per chunk of token sub-tiles five stages, software-pipelined so every engine has independent work
    queued: L) x loads (one sub-tile in every ``_DMA_T_EVERY`` as x^T straight from HBM by DMA transpose
    when the layout allows), A) Tensor-engine transposes of the other sub-tiles (H onto partitions) +
    PSUM -> SBUF copies, B) the H-contraction matmuls into PSUM ``[P, E]`` tiles + copy out, C) max8 /
    find_index8 / exp / normalise for all sub-tiles in lockstep (+ the affinity scatter when
    ``return_affinities``; sigmoid scoring: :func:`_sigmoid_topk_subtile`), S) the stores, issued one
    step later behind the next load. Returns ``(topk_w, topk_i, logits)``, or ``(topk_w, topk_i,
    logits, affinities)``.
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
    # the hardware-DGE transpose moves 2-byte elements in 128-column blocks
    dma_t = H % P_MAX == 0 and x.dtype != nl.float32
    bias_sb = iota_e = None
    if selection_bias != None:  # noqa: E711  the bias on every partition (stride-0 DMA), expert ids
        bias_sb = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias_sb, src=selection_bias.ap(pattern=[[0, P_MAX], [1, E]], offset=0))
        iota_e = nl.ndarray((P_MAX, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=iota_e, pattern=[[1, E]], offset=0, channel_multiplier=0)
    # SPMD (``router_topk_kernel[2]`` on LNC=2): program i takes the i-th contiguous share of the tokens
    # (a multiple of 128), so each program's blocks keep long per-partition runs. Every program takes
    # as many tokens (the last one's share ends at T and overlaps the one before it), so both run the
    # same instructions (both cores must take the same control flow, NKI LNC guide); tokens in the overlap
    # are computed by both and written twice with the same values (each token's result is its own row's).
    n_prog, pid = _program_split()
    share = min(T, _cdiv(_cdiv(T, n_prog), P_MAX) * P_MAX)
    T0 = min(T - share, pid * share)
    chunks = _fwd_chunks(T0, T0 + share, _sub_tiles(T, H, 4 if x.dtype == nl.float32 else 2))
    n = len(chunks)
    # x^T of one full sub-tile in every _DMA_T_EVERY by DMA transpose (the last one of its chunk)
    n_dma_t = []
    seen = 0
    for i in range(n):
        t0, P, R, r0, NT = chunks[i]
        full = dma_t and P == P_MAX
        n_dma_t.append(1 if full and (seen + NT) // _DMA_T_EVERY > seen // _DMA_T_EVERY else 0)
        if full:
            seen = seen + NT
    wT = None
    x_sb = [None] * n
    xT = [None] * n
    lg_all = [None] * n
    outs = [None] * n  # stage C -> S: (logits, weights, indices, affinities) of a chunk
    for step in range(n + 4):
        if step < n:  # stage L: load x one stage ahead (the DMA queue stays ahead of the transposes)
            t0, P, R, r0, NT = chunks[step]
            base = t0 + r0
            n_pe = NT - n_dma_t[step]  # sub-tiles 0..n_pe-1 by copy (Tensor-engine transposes), the rest x^T
            xT[step] = []
            for j in range(NT):
                xT[step].append(nl.ndarray((P_MAX, n_h, P), dtype=x.dtype, buffer=nl.sbuf))
            if n_pe > 0:
                x_sb[step] = nl.ndarray((P, n_pe, H), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb[step], src=x.ap(pattern=[[R * H, P], [H, n_pe], [1, H]], offset=base * H),
                              dge_mode=nisa.dge_mode.hwdge)
            for j in range(n_pe, NT):  # xT[c_, h, 16g + r] = x[base + (16g + r)*R + j, h*128 + c_]
                nisa.dma_transpose(dst=xT[step][j].reshape_dim(2, (P // _DMA_T_ROWS, _DMA_T_ROWS)),
                                   src=x.ap(pattern=[[R * H, _DMA_T_ROWS], [P_MAX, n_h], [_DMA_T_ROWS * R * H,
                                                                                           P // _DMA_T_ROWS],
                                                     [1, P_MAX]], offset=(base + j) * H),
                                   dge_mode=nisa.dge_mode.hwdge)
            if step == 0:  # w^T (on the Tensor engine) after the first x load
                wT = _load_w_transposed(w_router, load)
        c = step - 4
        if 0 <= c < n:  # stage S: the stores of the chunk whose top-K was issued one step before (queued
            # behind the next load, so a store still waiting for its data never holds up a load)
            t0, P, R, r0, NT = chunks[c]
            base = t0 + r0
            lg_c, w_c, i_c, a_c = outs[c]
            _store_rows(logits, lg_c[:, :, 0:E], base, R)
            _store_rows(topk_w, w_c, base, R)
            _store_rows(topk_i, i_c, base, R)
            if return_affinities:
                _store_rows(affinities, a_c, base, R)
            outs[c] = None
        c = step - 1
        if 0 <= c < n and x_sb[c] != None:  # noqa: E711  stage A: transpose the copied sub-tiles
            pairs = []
            for j in range(x_sb[c].shape[1]):
                pairs.append((xT[c][j], x_sb[c][:, j, :]))
            _transpose_blocks(pairs, x_sb[c].shape[0], H, x.dtype, load)
            x_sb[c] = None
        c = step - 2
        if 0 <= c < n:  # stage B: logits, the NT accumulation chains interleaved
            t0, P, R, r0, NT = chunks[c]
            lg_all[c] = nl.ndarray((P, NT, Ep), dtype=nl.float32, buffer=nl.sbuf)
            if E < 8:  # pad with a value no logit can lose to (K <= E)
                nisa.memset(dst=lg_all[c][:, :, E:8], value=_NEG_BIG)
            lg_ps = []
            for j in range(NT):
                lg_ps.append(nl.ndarray((P, E), dtype=nl.float32, buffer=nl.psum))
            for h in range(n_h):
                hb = min(P_MAX, H - h * P_MAX)
                for j in range(NT):
                    nisa.nc_matmul(dst=lg_ps[j], stationary=xT[c][j][0:hb, h, :], moving=wT[0:hb, h, :],
                                   accumulate=(h > 0))
            for j in range(NT):
                nisa.tensor_copy(dst=lg_all[c][:, j, 0:E], src=lg_ps[j], engine=_copy_engine(load, E))
            xT[c] = None
        c = step - 3
        if 0 <= c < n:  # stage C: top-K
            t0, P, R, r0, NT = chunks[c]
            outs[c] = [lg_all[c], nl.ndarray((P, NT, K), dtype=nl.float32, buffer=nl.sbuf),
                       nl.ndarray((P, NT, K), dtype=nl.int32, buffer=nl.sbuf), None]
            if return_affinities:
                outs[c][3] = nl.ndarray((P, NT, E), dtype=nl.float32, buffer=nl.sbuf)
            lgs, tws, tis, affs = [], [], [], []
            for j in range(NT):
                lgs.append(lg_all[c][:, j, :])
                tws.append(outs[c][1][:, j, :])
                tis.append(outs[c][2][:, j, :])
                if return_affinities:
                    affs.append(outs[c][3][:, j, :])
            if scoring == "sigmoid":
                for j in range(NT):
                    _sigmoid_topk_subtile(lgs[j], tws[j], tis[j], E, K, norm_topk_prob, routed_scaling_factor,
                                          bias_sb, iota_e)
            else:
                _topk_tiles(lgs, tws, tis, E, K, norm_topk_prob, affs if return_affinities else None,
                            routed_scaling_factor)
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


def _gather_selected(group):
    """``(ikf, lg_k)`` per token tile of ``group`` (see :func:`_selected_logit_grads`): the expert ids as
    fp32 and the K selected logits ``lg[idx_k]`` (one per-partition ``nc_n_gather`` on GpSimd)."""
    n = len(group)
    K = group[0][1].shape[1]
    idx_u, ikf, lg_k = _tiles(group, nl.uint32, K), _tiles(group, nl.float32, K), _tiles(group, nl.float32, K)
    for i in range(n):
        nisa.tensor_copy(dst=idx_u[i], src=group[i][1], engine=nisa.engine.gpsimd)
        nisa.tensor_copy(dst=ikf[i], src=group[i][1], engine=nisa.engine.gpsimd)
    for i in range(n):
        nisa.nc_n_gather(dst=lg_k[i], data=group[i][0], indices=idx_u[i])
    return ikf, lg_k


def _selected_logit_grads(group, gathered, norm_topk_prob, scoring="softmax"):
    """First half of the backward's ``g_logits`` for each token tile of ``group``: a list of ``(lg [P, E]
    fp32 logits, ik [P, K] int32 expert ids, gk [P, K] fp32 upstream top-K weight gradients, gl_in [P, E]
    or None (gradient of the logits themselves))``, with ``gathered`` from :func:`_gather_selected`.
    Returns ``(ikf, v, dense)`` per tile for :func:`_logit_grad_tiles`.

    The gradient of the K selected weights lives on the K selected logits, so it is computed there
    ("K-space", ``[P, K]`` tiles): ``lg_k = lg[idx_k]``, then (softmax) ``q = softmax_k(lg_k)``, ``v_k = q_k (g_k -
    <g, q>)`` with norm_topk_prob
    (the softmax Jacobian term over E cancels exactly); without it ``p_k = exp(lg_k - max)/S`` over all E
    and ``g_logits = scatter(g * p) - <g, p> p``; sigmoid: ``s_k = sigmoid(lg_k)``, ``v_k = s_k(1 - s_k)
    (g_k - c) / D`` with ``D = sum s_k + 1e-20``, ``c = <g, s> / D`` (norm), else ``g_k s_k(1 - s_k)``.
    Every step is issued for all tiles of the group before the next step (independent instructions
    between dependent ones hide the engines' latency).
    """
    n = len(group)
    ikf, lg_k = gathered
    dense = [None] * n  # a dense [P, E] term added to the scatter (softmax without norm_topk_prob)
    if scoring == "sigmoid":
        v = _sigmoid_selected_grads(group, lg_k, norm_topk_prob)
    elif norm_topk_prob:
        v = _softmax_selected_grads(group, lg_k)
    else:
        v, dense = _softmax_full_grads(group, lg_k)
    return ikf, v, dense


def _logit_grad_tiles(group, selected, iota_e):
    """fp32 ``g_logits [P, E]`` per tile of ``group`` from :func:`_selected_logit_grads`' ``(ikf, v,
    dense)``: ``sum_k onehot(idx_k) * v_k + dense (+ grad_router_logits)``; repeated ids add up, as
    autograd's scatter does."""
    ikf, v, dense = selected
    return _plus_logit_grads(group, _scatter_selected(group, iota_e, ikf, v, dense))


def _k_space_tiles(group, K):
    """Scratch per token tile of ``group``: five fp32 ``[P, 1]`` tiles, then three fp32 ``[P, K]``."""
    out = []
    for _ in range(5):
        out.append(_tiles(group, nl.float32, 1))
    for _ in range(3):
        out.append(_tiles(group, nl.float32, K))
    return out


def _softmax_selected_grads(group, lg_k):
    """norm_topk_prob: ``v_k = q_k (g_k - <g, q>)``, ``q = softmax over the K selected logits``."""
    n = len(group)
    neg_m, den, rden, dot, neg_c, e_k, ge, v = _k_space_tiles(group, lg_k[0].shape[1])
    for i in range(n):
        nisa.tensor_reduce(dst=neg_m[i], op=nl.maximum, data=lg_k[i], axis=1, negate=True)
    for i in range(n):
        nisa.activation(dst=e_k[i], op=nl.exp, data=lg_k[i], bias=neg_m[i], reduce_op=nl.add, reduce_res=den[i],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
    for i in range(n):
        nisa.reciprocal(dst=rden[i], data=den[i])
        nisa.tensor_tensor(dst=ge[i], data1=group[i][2], data2=e_k[i], op=nl.multiply)
    for i in range(n):
        nisa.tensor_reduce(dst=dot[i], op=nl.add, data=ge[i], axis=1)
    for i in range(n):  # -<g, q> = -<g, e> / den
        nisa.tensor_scalar(dst=neg_c[i], data=dot[i], op0=nl.multiply, operand0=rden[i], op1=nl.multiply,
                           operand1=-1.0)
    for i in range(n):  # v = ((g - c) / den) * e
        nisa.tensor_scalar(dst=v[i], data=group[i][2], op0=nl.add, operand0=neg_c[i], op1=nl.multiply,
                           operand1=rden[i])
        nisa.tensor_tensor(dst=v[i], data1=v[i], data2=e_k[i], op=nl.multiply)
    return v


def _softmax_full_grads(group, lg_k):
    """Without norm_topk_prob: ``g_logits = scatter(g * p_sel) - <g, p_sel> p`` with ``p`` the softmax over
    all E; returns the K-space ``g * p_sel`` and the dense ``-<g, p_sel> p`` tiles."""
    n = len(group)
    neg_m, den, rden, dot, coef, e_k, ge, v = _k_space_tiles(group, lg_k[0].shape[1])
    e_all, dense = _tiles(group, nl.float32), _tiles(group, nl.float32)
    for i in range(n):
        nisa.tensor_reduce(dst=neg_m[i], op=nl.maximum, data=group[i][0], axis=1, negate=True)
    for i in range(n):
        nisa.activation(dst=e_all[i], op=nl.exp, data=group[i][0], bias=neg_m[i], reduce_op=nl.add,
                        reduce_res=den[i], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=e_k[i], op=nl.exp, data=lg_k[i], bias=neg_m[i])
    for i in range(n):
        nisa.reciprocal(dst=rden[i], data=den[i])
        nisa.tensor_tensor(dst=ge[i], data1=group[i][2], data2=e_k[i], op=nl.multiply)
    for i in range(n):
        nisa.tensor_reduce(dst=dot[i], op=nl.add, data=ge[i], axis=1)
        nisa.tensor_scalar(dst=v[i], data=ge[i], op0=nl.multiply, operand0=rden[i])  # g * p_sel
    for i in range(n):  # -<g, p_sel> / den = -dot / den^2
        nisa.tensor_scalar(dst=coef[i], data=dot[i], op0=nl.multiply, operand0=rden[i], op1=nl.multiply,
                           operand1=-1.0)
        nisa.tensor_scalar(dst=coef[i], data=coef[i], op0=nl.multiply, operand0=rden[i])
    for i in range(n):
        nisa.tensor_scalar(dst=dense[i], data=e_all[i], op0=nl.multiply, operand0=coef[i], engine=nisa.engine.scalar)
    return v, dense


def _sigmoid_selected_grads(group, lg_k, norm_topk_prob):
    """Sigmoid scores: ``v_k = s_k(1 - s_k) (g_k - c) / D`` (norm_topk_prob; ``D = sum_k s_k + 1e-20``,
    ``c = <g, s> / D``), else ``g_k s_k(1 - s_k)``."""
    n = len(group)
    K = lg_k[0].shape[1]
    f32 = nl.float32
    s_k, jac, v = _tiles(group, f32, K), _tiles(group, f32, K), _tiles(group, f32, K)
    den = _tiles(group, f32, 1)
    for i in range(n):
        nisa.activation(dst=s_k[i], op=nl.sigmoid, data=lg_k[i], reduce_op=nl.add, reduce_res=den[i],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
    for i in range(n):  # s (1 - s)
        nisa.tensor_scalar(dst=jac[i], data=s_k[i], op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=jac[i], data1=jac[i], data2=s_k[i], op=nl.multiply)
    if not norm_topk_prob:
        for i in range(n):
            nisa.tensor_tensor(dst=v[i], data1=group[i][2], data2=jac[i], op=nl.multiply)
        return v
    rden, dot, neg_c, gs = _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32, K)
    for i in range(n):
        nisa.tensor_scalar(dst=den[i], data=den[i], op0=nl.add, operand0=_SIGMOID_NORM_EPS)
        nisa.tensor_tensor(dst=gs[i], data1=group[i][2], data2=s_k[i], op=nl.multiply)
    for i in range(n):
        nisa.reciprocal(dst=rden[i], data=den[i])
        nisa.tensor_reduce(dst=dot[i], op=nl.add, data=gs[i], axis=1)
    for i in range(n):  # -<g, s> / D
        nisa.tensor_scalar(dst=neg_c[i], data=dot[i], op0=nl.multiply, operand0=rden[i], op1=nl.multiply,
                           operand1=-1.0)
    for i in range(n):  # v = ((g - c) / D) * s(1 - s)
        nisa.tensor_scalar(dst=v[i], data=group[i][2], op0=nl.add, operand0=neg_c[i], op1=nl.multiply,
                           operand1=rden[i])
        nisa.tensor_tensor(dst=v[i], data1=v[i], data2=jac[i], op=nl.multiply)
    return v


def _scatter_selected(group, iota_e, ikf, v, dense):
    """Dense ``[P, E]`` fp32 ``sum_k onehot(idx_k) * v_k (+ dense)`` per tile: the K one-hot products on
    Vector, summed as a pairwise tree whose first level alternates between GpSimd and Vector (so
    GpSimd's unknown rate never carries more than a quarter of the adds), the rest on Vector."""
    n = len(group)
    K = v[0].shape[1]
    f32 = nl.float32
    prods = []
    for i in range(n):
        prods.append([None] * K)
    for k in range(K):
        for i in range(n):
            rows, E = group[i][0].shape
            prods[i][k] = nl.ndarray((rows, E), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=prods[i][k], data=iota_e[0:rows, :], op0=nl.equal, operand0=ikf[i][:, k:k + 1],
                               op1=nl.multiply, operand1=v[i][:, k:k + 1])
    width = 1
    while width < K:
        m = 0
        for k in range(0, K - width, 2 * width):
            eng = nisa.engine.gpsimd if width == 1 and m % 2 == 0 else nisa.engine.vector
            for i in range(n):
                nisa.tensor_tensor(dst=prods[i][k], data1=prods[i][k], data2=prods[i][k + width], op=nl.add,
                                   engine=eng)
            m = m + 1
        width = width * 2
    g = []
    for i in range(n):
        g.append(prods[i][0])
        if dense[i] != None:  # noqa: E711 (the NKI compiler rejects `is not`)
            nisa.tensor_tensor(dst=g[i], data1=g[i], data2=dense[i], op=nl.add)
    return g


def _plus_logit_grads(group, g):
    """``g += grad_router_logits`` for the tiles that have one (the logits are an output too)."""
    for i in range(len(group)):
        if group[i][3] != None:  # noqa: E711 (the NKI compiler rejects `is`)
            nisa.tensor_tensor(dst=g[i], data1=g[i], data2=group[i][3], op=nl.add)
    return g


@nki.jit
def router_topk_bwd_kernel(x, w_router, router_logits, topk_idx, grad_topk_weights, grad_router_logits,
                           has_grad_logits=False, norm_topk_prob=True, scoring="softmax",
                           routed_scaling_factor=1.0):
    """NKI kernel behind :func:`router_topk_bwd`. Phase 1 (per group of token tiles, see the loop):
    ``g_logits`` and ``grad_x = g_logits @ w``; ``grad_w = g_logits.T @ x`` accumulated over token tiles in PSUM, during
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
    sel = [None] * n  # stage K -> G
    glT = [None] * n  # stage G -> M
    # phase 1, software-pipelined over groups of token tiles: L(i) loads + gathers of the selected logits,
    # K(i-1) the gradient on them, G(i-2) its dense scatter + transposes, M(i-3) grad_x / grad_w matmuls; each engine
    # works on a different group than the one its inputs are still being produced for (in-order queues)
    stores = []  # (t0, tp, grad_x tile) of the last M stage
    for step in range(n + 4):
        if step < n:
            ins[step] = []
            for ti in groups[step]:
                t0, tp = tiles[ti]
                lg = nl.ndarray((tp, E), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=lg, src=router_logits[t0:t0 + tp, :], dge_mode=nisa.dge_mode.hwdge)
                ik = nl.ndarray((tp, K), dtype=nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=ik, src=topk_idx[t0:t0 + tp, :], dge_mode=nisa.dge_mode.hwdge)
                gk = nl.ndarray((tp, K), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=gk, src=grad_topk_weights[t0:t0 + tp, :], dge_mode=nisa.dge_mode.hwdge)
                if routed_scaling_factor != 1.0:  # weights = scale * w': the upstream gradient of w'
                    nisa.tensor_scalar(dst=gk, data=gk, op0=nl.multiply, operand0=routed_scaling_factor)
                gl_in = None
                if has_grad_logits:
                    gl_in = nl.ndarray((tp, E), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=gl_in, src=grad_router_logits[t0:t0 + tp, :])
                ins[step].append((lg, ik, gk, gl_in))
            sel[step] = _gather_selected(ins[step])
        for t0, tp, gx_sb in stores:  # the previous step's grad_x tiles, queued behind this step's loads
            nisa.dma_copy(dst=grad_x[t0:t0 + tp, :], src=gx_sb, dge_mode=nisa.dge_mode.hwdge)
        stores = []
        i_k = step - 1
        if 0 <= i_k < n:
            sel[i_k] = _selected_logit_grads(ins[i_k], sel[i_k], norm_topk_prob, scoring)
        i_m = step - 3
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
                        nisa.tensor_copy(dst=gx_sb[:, h0:h0 + hc], src=gx_ps[b], engine=nisa.engine.scalar)
                stores.append((t0, tp, gx_sb))
                if fused_w:  # grad_w [E, H] += g_l^T x: contraction over this tile's tokens
                    for i in range(len(parts)):
                        for a in range(len(w_accs)):
                            h0 = a * PSUM_FMAX
                            nisa.nc_matmul(dst=w_accs[a], stationary=parts[i],
                                           moving=x_sb[:, h0:h0 + w_accs[a].shape[1]], accumulate=(ti > 0 or i > 0))
            glT[i_m] = None
        i_g = step - 2
        if 0 <= i_g < n:
            g_ls = _logit_grad_tiles(ins[i_g], sel[i_g], iota_e)
            ins[i_g] = None
            sel[i_g] = None
            glT[i_g] = []
            for gi in range(len(g_ls)):
                t0, tp = tiles[groups[i_g][gi]]
                g_l = g_ls[gi]
                if split:  # g = hi + lo, both bf16: ~16 significant bits through bf16 matmuls
                    hi = nl.ndarray((tp, E), dtype=mm, buffer=nl.sbuf)
                    parts = [hi, nl.ndarray((tp, E), dtype=mm, buffer=nl.sbuf)]
                    nisa.tensor_copy(dst=parts[0], src=g_l, engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=parts[1], data1=g_l, data2=parts[0], op=nl.subtract)
                else:
                    parts = [g_l]
                x_sb = None
                if fused_w:
                    x_sb = nl.ndarray((tp, H), dtype=mm, buffer=nl.sbuf)
                    nisa.dma_copy(dst=x_sb, src=x[t0:t0 + tp, :], dge_mode=nisa.dge_mode.hwdge)
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
