"""NKI kernel of the router's forward, :func:`router_topk_kernel` (semantics: :mod:`trnkit.kernels.router`).

Kernel layout: tokens on partitions (128 per tile) for everything after the matmul, so softmax and
top-K are per-partition free-axis operations; partition p of a block holds R consecutive tokens, so
every per-partition HBM access (x rows, logits, top-K) is one contiguous run. The contraction over H
needs x^T (H on partitions), which comes from two sources so that neither the DMA queue nor the Tensor
engine carries it alone: most sub-tiles are loaded contiguously and transposed 128x128 on the Tensor
engine (PSUM -> SBUF copies split between Vector and Scalar); for bf16 with H a multiple of 128, one
full sub-tile in every sixteen comes straight from HBM by a hardware-DGE ``dma_transpose`` (the
documented hwdge form ``src [16, H/128, P/16, 128]``). ``w_router.T`` is transposed once on the Tensor
engine and kept in SBUF. The split keeps the kernel at >= 70% of the HBM bound across the cost model's
DMA-transpose rates (docs/kernel-design.md, "Why router_topk holds at both ends").
bf16 inputs: the PSUM logits are copied out in bf16 (the rounding ``x @ w.T`` returns in bf16, what the models
route from), the top-K reads them so, and GpSimd widens them to fp32 for the store.
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
"""

from __future__ import annotations

from trnkit.kernels._common import P_MAX, cdiv, row_chunks
from trnkit.kernels.router.constraints import SIGMOID_NORM_EPS
from trnkit.kernels.tiles import accumulate, program_split
from trnkit.nki_api import nisa, nki, nl

PSUM_FMAX = 512  # fp32 elements per partition in one PSUM bank (= max moving free size)
_NEG_BIG = -3.0e38  # pad value for E < 8 (never selected: K <= E)
_MARK = float("inf")  # nc_match_replace8 mark of the selected logits (no finite logit equals it)


# Vector also runs the top-K chain (max8, find_index8, the scalings: short dependent instructions whose
# latency is the pipeline's tail), so the copy balance counts its copies this much heavier than their
# estimated time. Cost model, router_fwd T=8192 H=2048 E=128 K=8 bf16, mid / pessimistic fraction of the
# HBM bound: 1.0 82.3 / 69.8%, 1.3 83.5 / 71.2%, 1.5 83.3 / 72.3%, 1.7 83.1 / 73.4%, 2.0 81.7 / 74.0%.
_VECTOR_COPY_WEIGHT = 1.5


def _copy_engine(load, n, two_byte=False):
    """Engine for a PSUM -> SBUF copy of ``n`` elements per partition: Vector or Scalar, whichever has less
    work queued (both read PSUM; GpSimd cannot). ``load`` = [vec, act] estimated busy ns: a Vector
    instruction pays ~60 cycles of access set-up at 0.96 GHz and copies 2-byte data at twice the rate
    (trn2 performance mode, one operand in PSUM), weighted by ``_VECTOR_COPY_WEIGHT``; a Scalar one pays
    the ~295 ns ACTIVATE fixed time at 1.2 GHz (docs/cost-model.md)."""
    v = load[0] + _VECTOR_COPY_WEIGHT * ((n / 2 if two_byte else n) + 60) / 0.96
    a = load[1] + 295 + n / 1.2
    if v <= a:
        load[0] = v
        return nisa.engine.vector
    load[1] = a
    return nisa.engine.scalar


def _charge(load, vector_elems, scalar_elems):
    """Add compute work that is not a PSUM copy to ``load`` (see :func:`_copy_engine`): one Vector / Scalar
    instruction per entry, of that many elements per partition (at least MIN_II = 64 cycles each)."""
    for n in vector_elems:
        load[0] = load[0] + (max(64, n) + 60) / 0.96
    for n in scalar_elems:
        load[1] = load[1] + 295 + max(64, n) / 1.2


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
                             engine=_copy_engine(load, (j1 - j0) * rows, itemsize == 2))
        ps = None
    if cols > n_full * P_MAX:
        cb = cols - n_full * P_MAX
        for i in range(len(pairs)):
            pt = nl.ndarray((cb, rows), dtype=dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=pt, data=pairs[i][1][0:rows, n_full * P_MAX:cols])
            nisa.tensor_copy(dst=pairs[i][0][0:cb, n_full, 0:rows], src=pt,
                             engine=_copy_engine(load, rows, itemsize == 2))


def _load_w_transposed(w, load):
    """``w_router [E, H]`` -> SBUF ``wT [128, ceil(H/128), E]`` (``wT[c, j, e] = w[e, j*128 + c]``): each block
    of 128 experts loaded contiguously and transposed on the Tensor engine (one 4 KiB row per expert,
    where 16-row DMA transposes would move 512 B per partition)."""
    E, H = w.shape
    n_h = cdiv(H, P_MAX)
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


def _scatter_affinities(aff, lg, top8, neg_max, rden, p_all, E, K):
    """Dense ``aff [P, E]`` fp32 of one token sub-tile: the selected experts' weights, 0 elsewhere.

    ``nc_match_replace8`` marks the K selected logits (the first occurrence of each of ``top8[:, :K]``,
    advancing on duplicates: the same experts ``nc_find_index8`` picked, ties included; the unused
    slots hold the mark itself, which no finite logit equals) with +inf; ``mask = (marked == inf)``
    (fp16, exact); the weights ``exp(lg - max) * (1/den)`` are computed over E exactly as for the K
    selected (the same ``exp`` on ScalarE and the same Vector multiply on the same fp32 values, so
    ``aff[t, idx_k] == weights[t, k]`` bit for bit) and multiplied by the mask on the GpSimd engine.
    Cost independent of K: three Vector passes over E, zero or one Scalar pass (the ``exp`` over E exists
    already without ``norm_topk_prob``) and one GpSimd pass."""
    P = aff.shape[0]
    vals = top8
    if K < 8:
        vals = nl.ndarray((P, 8), dtype=top8.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=vals[:, 0:K], src=top8[:, 0:K], engine=nisa.engine.gpsimd)
        nisa.memset(dst=vals[:, K:8], value=_MARK, engine=nisa.engine.gpsimd)
    # the whole (padded, >= 8 wide) row, as for max8; the -3e38 pads are never among the K values
    # data and vals in the logits' dtype (nki-library's forms); the marked row written as fp32 (bf16 operands: a
    # bf16 row would put the 2-byte mask pass on the SBUF port GpSimd's multiply shares, +29 us pessimistic)
    marked = nl.ndarray(lg.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.nc_match_replace8(dst=marked, data=lg, vals=vals, imm=_MARK)
    mask = nl.ndarray((P, E), dtype=nl.float16, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mask, data=marked[:, 0:E], op0=nl.equal, operand0=_MARK, engine=nisa.engine.vector)
    if p_all == None:  # noqa: E711 (the NKI compiler rejects `is`)
        p_all = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=p_all, op=nl.exp, data=lg[:, 0:E], bias=neg_max)
    p_w = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=p_w, data=p_all, op0=nl.multiply, operand0=rden, engine=nisa.engine.vector)
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
    top8 = nl.ndarray((P, 8), dtype=choice.dtype, buffer=nl.sbuf)
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
        nisa.tensor_scalar(dst=den, data=den, op0=nl.add, operand0=SIGMOID_NORM_EPS)
        nisa.reciprocal(dst=rden, data=den)
        if scale != 1.0:
            nisa.tensor_scalar(dst=rden, data=rden, op0=nl.multiply, operand0=scale)
        nisa.tensor_scalar(dst=top_w, data=s_k, op0=nl.multiply, operand0=rden, engine=nisa.engine.vector)
    else:
        nisa.tensor_scalar(dst=top_w, data=s_k, op0=nl.multiply, operand0=scale, engine=nisa.engine.vector)


def _topk_tiles(lg, tw, ti, E, K, norm_topk_prob, aff=None, scale=1.0):
    """Softmax top-K of the NT token sub-tiles of one chunk: ``lg [P, NT, >=8]`` logits in x's dtype (padded when
    E < 8) -> ``tw [P, NT, K]`` fp32 (times ``scale``), ``ti [P, NT, K]`` int32 (and the dense
    ``aff [P, NT, E]`` fp32 when given). Every step is issued for all sub-tiles before the next one
    (independent instructions between dependent ones hide the engines' fixed latency); the per-token
    steps that are not per-sub-tile reductions (the negated max, the index cast, the reciprocal) are one
    instruction for the whole chunk. ScalarE only computes the exponentials (its fixed time per
    instruction is the largest); the small scalings run on Vector (GpSimd's tensor_scalar is rsqrt only)."""
    P, NT = lg.shape[0], lg.shape[1]
    f32 = nl.float32
    top8 = nl.ndarray((P, NT, 8), dtype=lg.dtype, buffer=nl.sbuf)  # max8 / find_index8 / match_replace8: one dtype
    idx8 = nl.ndarray((P, NT, 8), dtype=nl.uint32, buffer=nl.sbuf)
    neg_max = nl.ndarray((P, NT, 1), dtype=f32, buffer=nl.sbuf)
    e_k = nl.ndarray((P, NT, K), dtype=f32, buffer=nl.sbuf)
    denom = nl.ndarray((P, NT), dtype=f32, buffer=nl.sbuf)
    rden = nl.ndarray((P, NT), dtype=f32, buffer=nl.sbuf)
    p_all = [None] * NT
    for j in range(NT):
        nisa.max8(dst=top8[:, j, :], src=lg[:, j, :])
    nisa.tensor_scalar(dst=neg_max, data=top8[:, :, 0:1], op0=nl.multiply, operand0=-1.0,
                       engine=nisa.engine.vector)
    for j in range(NT):
        nisa.nc_find_index8(dst=idx8[:, j, :], data=lg[:, j, :], vals=top8[:, j, :])
    for j in range(NT):
        if norm_topk_prob:  # sum over the selected K only: the softmax denominator cancels
            nisa.activation(dst=e_k[:, j, :], op=nl.exp, data=top8[:, j, 0:K], bias=neg_max[:, j, :],
                            reduce_op=nl.add, reduce_res=denom[:, j:j + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        else:
            p_all[j] = nl.ndarray((P, E), dtype=f32, buffer=nl.sbuf)
            nisa.activation(dst=p_all[j], op=nl.exp, data=lg[:, j, 0:E], bias=neg_max[:, j, :], reduce_op=nl.add,
                            reduce_res=denom[:, j:j + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            nisa.activation(dst=e_k[:, j, :], op=nl.exp, data=top8[:, j, 0:K], bias=neg_max[:, j, :])
    nisa.tensor_copy(dst=ti, src=idx8[:, :, 0:K], engine=nisa.engine.gpsimd)
    nisa.reciprocal(dst=rden, data=denom)
    if scale != 1.0:  # routed_scaling_factor folded into the normaliser (weights and affinities alike)
        nisa.tensor_scalar(dst=rden, data=rden, op0=nl.multiply, operand0=scale, engine=nisa.engine.vector)
    for j in range(NT):
        nisa.tensor_scalar(dst=tw[:, j, :], data=e_k[:, j, :], op0=nl.multiply, operand0=rden[:, j:j + 1],
                           engine=nisa.engine.vector)
    if aff != None:  # noqa: E711 (the NKI compiler rejects `is not`)
        for j in range(NT):
            _scatter_affinities(aff[:, j, :], lg[:, j, :], top8[:, j, :], neg_max[:, j, :], rden[:, j:j + 1],
                                p_all[j], E, K)


# Rows per partition of a token block: partition p of a block starting at token t0 holds tokens
# t0 + p*R ... t0 + p*R + R - 1, so each chunk's x rows, logits and top-K outputs are one contiguous run
# per partition in HBM, whatever the chunk's row count.
_BLOCK_ROWS = 64
# One full 128-token sub-tile in every _DMA_T_EVERY gets its x^T by DMA transpose (8 hardware-DGE
# transposes of 16 rows); the Tensor engine transposes the others. The split balances the DMA queue
# against the Tensor engine at both ends of the cost model's range (docs/kernel-design.md "router_topk").
_DMA_T_EVERY = 16


def _fwd_chunks(T0, T1, nt):
    """Chunks ``(t0, P, R, r0, NT)`` of tokens ``[T0, T1)``: token ``t0 + p*R + r0 + j`` is partition ``p``
    of sub-tile ``j < NT`` (blocks of ``R`` rows per partition, see ``_BLOCK_ROWS``; a short tail uses
    ``P < 128`` partitions)."""
    chunks = []
    for b0, P, R in row_chunks(T1 - T0, _BLOCK_ROWS):
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
    n_h = cdiv(H, P_MAX)
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
    n_prog, pid = program_split()
    share = min(T, cdiv(cdiv(T, n_prog), P_MAX) * P_MAX)
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
    lg_all = [None] * n  # the logits the top-K reads (x's dtype), padded to >= 8 per sub-tile
    lg_out = [None] * n  # the logits stored (fp32)
    lg_dt = nl.float32 if x.dtype == nl.float32 else x.dtype
    outs = [None] * n  # stage C -> S: (logits, weights, indices, affinities) of a chunk
    for step in range(n + 6):
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
        c = step - 6
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
            # bf16 operands: the logits rounded to bf16 (x @ w.T's own dtype) are what the top-K reads
            lg_all[c] = nl.ndarray((P, NT, Ep), dtype=lg_dt, buffer=nl.sbuf)
            if E < 8:  # pad with a value no logit can lose to (K <= E)
                nisa.memset(dst=lg_all[c][:, :, E:8], value=_NEG_BIG)
            # sub-tiles whose [P, E] fp32 logits share one PSUM bank share one tile, evacuated by one copy
            per_bank = max(1, PSUM_FMAX // E)
            for j0 in range(0, NT, per_bank):
                j1 = min(NT, j0 + per_bank)
                ps = nl.ndarray((P, j1 - j0, E), dtype=nl.float32, buffer=nl.psum)
                operands = []
                for h in range(n_h):
                    hb = min(P_MAX, H - h * P_MAX)
                    row = []
                    for j in range(j0, j1):
                        row.append((xT[c][j][0:hb, h, :], wT[0:hb, h, :]))
                    operands.append(row)
                views = []
                for j in range(j1 - j0):
                    views.append(ps[:, j, :])
                accumulate(views, operands)
                nisa.tensor_copy(dst=lg_all[c][:, j0:j1, 0:E], src=ps, engine=_copy_engine(load, (j1 - j0) * E))
            lg_out[c] = lg_all[c]
            if lg_dt != nl.float32:  # the stored logits: fp32 (exact), widened on GpSimd beside the top-K
                lg_out[c] = nl.ndarray((P, NT, E), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=lg_out[c], src=lg_all[c][:, :, 0:E], engine=nisa.engine.gpsimd)
            xT[c] = None
        c = step - 3
        if 0 <= c < n:  # stage C: top-K
            t0, P, R, r0, NT = chunks[c]
            outs[c] = [lg_out[c], nl.ndarray((P, NT, K), dtype=nl.float32, buffer=nl.sbuf),
                       nl.ndarray((P, NT, K), dtype=nl.int32, buffer=nl.sbuf), None]
            if return_affinities:
                outs[c][3] = nl.ndarray((P, NT, E), dtype=nl.float32, buffer=nl.sbuf)
            if scoring == "sigmoid":
                for j in range(NT):
                    _sigmoid_topk_subtile(lg_all[c][:, j, :], outs[c][1][:, j, :], outs[c][2][:, j, :], E, K,
                                          norm_topk_prob, routed_scaling_factor, bias_sb, iota_e)
            else:
                _topk_tiles(lg_all[c], outs[c][1], outs[c][2], E, K, norm_topk_prob, outs[c][3],
                            routed_scaling_factor)
                # max8, find_index8 and the weight scaling per sub-tile, the chunk's negated max and
                # reciprocal on Vector; the exponentials on Scalar
                _charge(load, [Ep] * (2 * NT) + [K] * NT + [NT, 8 * NT], [K if norm_topk_prob else E] * NT)
            lg_all[c] = lg_out[c] = None
    if return_affinities:
        return topk_w, topk_i, logits, affinities
    return topk_w, topk_i, logits
