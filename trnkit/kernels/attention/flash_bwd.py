"""Flash attention backward NKI kernel (``attention_bwd_kernel``): dq, dk, dv of the causal GQA
attention of :mod:`trnkit.kernels.attention.flash_fwd` from its output ``o`` and log-sum-exp ``lse``.

The probabilities are recomputed, never stored: with ``delta_i = sum_d dO[i, d] O[i, d]``,
``P = exp(scale * Q K^T - lse)``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, then ``dV = P^T dO``,
``dK = scale * dS^T Q``, ``dQ = scale * dS K``.

A work unit is one kv head of one batch row with all its G query heads (LNC=2 splits the units, one
control flow on both cores). Its keys go in blocks of 512 (outer loop); every query tile that sees a
block (128 rows, the diagonal and below, last tile first) adds into the block's ``dK^T`` and ``dV^T``,
each ``[D, 512]`` in one PSUM bank for the whole block: with queries on partitions both are plain
matmuls (``dV^T += dO^T P``: ``dO`` stationary, ``P`` moving), no transpose. Per (query tile, key
block), 128 x 512 scores:

1. Tensor: ``S = Q K^T`` and ``dP = dO V^T`` (``Q^T``, ``dO^T`` stationary; the key block's ``K^T``,
   ``V^T`` moving).
2. Scalar: ``P = exp(scale * S - lse)`` from PSUM (per-row bias), in the input dtype; on the diagonal
   GpSimd zeroes ``P`` above it (``affine_select``). ``dP - delta`` on Scalar too, or left to stage 3,
   whichever of Scalar and Vector has less work so far.
3. Vector: ``dS = P * (dP - delta)`` (from the Scalar result, or from dP in PSUM in one instruction);
   Tensor: ``dV^T += dO^T P``.
4. Tensor: ``dK^T += Q^T dS`` and ``dS^T`` per 128 keys (PE transpose), copied to SBUF.
5. Tensor: ``dQ_blk = dS K`` (``dS^T`` stationary, ``K`` moving); Vector adds it into the fp32 dQ
   accumulator of the tile, kept in SBUF for all query tiles of the pass's heads.

After a key block, ``dK = scale * dK^T`` and ``dV^T`` are transposed back (PE) and stored (the block's
full 128-key tiles in one DMA). When the dQ accumulators of all G heads do not fit in SBUF (long S,
large G) the heads go in balanced passes, each adding its partial dK / dV into an fp32 HBM scratch
(``dma_compute``) that the last pass converts. When a head's ``Q``, ``dO``, ``Q^T``, ``dO^T`` fit next to
its accumulator (:func:`cache_q_side`) a pass loads them once instead of once per key block.
"""

from __future__ import annotations

from trnkit.kernels._common import cdiv
from trnkit.kernels.attention.tiling import (
    ACT_FIXED_NS,
    SCALAR_GHZ,
    VECTOR_GHZ,
    P,
    cheaper_engine,
    needs_scratch,
    rows,
    tiles_view,
    work_units,
)
from trnkit.kernels.tiles import accumulate, program_split
from trnkit.nki_api import nisa, nki, nl

KB = 512  # keys per block (one PSUM bank of fp32 dK^T / dV^T / scores)
DQ_BUDGET = 144 * 1024  # SBUF bytes per partition for the fp32 dQ accumulators (+ q-side cache) of one pass
QCHUNK = 8  # query tiles per O / dO load of the row statistics


def cache_q_side(S, D, itemsize):
    """Whether one head's fp32 dQ accumulator and its ``Q``, ``dO``, ``Q^T``, ``dO^T`` (``S * D * (4 + 4 *
    itemsize) / 128`` bytes per partition) fit DQ_BUDGET: then a pass loads them once, not per key block."""
    return cdiv(S, P) * D * (4 + 4 * itemsize) <= DQ_BUDGET


def heads_per_pass(S, D, G, itemsize=4):
    """Query heads per pass: as many as fit DQ_BUDGET (with their q-side cache when one fits), the
    passes balanced."""
    per_head = cdiv(S, P) * D * 4
    if cache_q_side(S, D, itemsize):
        per_head = cdiv(S, P) * D * (4 + 4 * itemsize)
    fit = max(1, min(G, DQ_BUDGET // per_head))
    return cdiv(G, cdiv(G, fit))


def _load_tiles(dst, x, b, h, t0, nt):
    """``x``'s head h, query tiles ``t0 .. t0 + nt`` into ``dst [P, nt, D]`` (full tiles in one DMA, a
    short last tile in another)."""
    S = x.shape[1]
    nfull = min(nt, S // P - t0)
    if nfull > 0:
        nisa.dma_copy(dst=dst[:, 0:nfull, :], src=tiles_view(x, b, t0 * P, nfull, h))
    if nfull < nt:
        r0 = (t0 + nfull) * P
        nisa.dma_copy(dst=dst[0:S - r0, nfull, :], src=rows(x, b, r0, S - r0, h))


def _delta(negdelta, o_t, do_t, t0, nt, S):
    """``-delta = -rowsum(dO * O)`` of query tiles ``t0 .. t0 + nt`` (``o_t``, ``do_t`` ``[P, nt, D]``) into
    columns ``t0 ..`` of ``negdelta``."""
    D = o_t.shape[2]
    for t in range(nt):
        nq = min(P, S - (t0 + t) * P)
        prod = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[0:nq, :], data1=o_t[0:nq, t, :], data2=do_t[0:nq, t, :], op=nl.multiply)
        nisa.tensor_reduce(dst=negdelta[0:nq, t0 + t:t0 + t + 1], op=nl.add, data=prod[0:nq, :], axis=1, negate=True)


def _head_setup(ins, b, h, nqt, cache):
    """Head h's loads for a pass: ``lse`` ``[P, nqt]`` fp32 (row ``t*P + p`` at ``[p, t]``) and, with
    ``cache``, its ``O``, ``Q``, ``dO`` ``[P, nqt, D]`` and ``Q^T``, ``dO^T`` ``[D, S]`` (per QCHUNK tiles, the
    last chunk first: the order the blocks use them); the row statistics ``-lse``, ``-delta`` are formed
    by :func:`_head_stats` when the blocks first need them (so the engines' in-order queues do not wait on
    loads the current blocks do not use). Without ``cache`` the statistics are formed here, chunk by chunk."""
    q, do, o, lse = ins[0], ins[4], ins[3], ins[5]
    S, D = o.shape[1], o.shape[3]
    hd = {"stats": None, "qs": None, "o": None, "done": None}
    nfull = S // P
    lse_t = nl.ndarray((P, nqt), dtype=nl.float32, buffer=nl.sbuf)
    base = (b * lse.shape[1] + h) * S
    if nfull > 0:
        nisa.dma_copy(dst=lse_t[:, 0:nfull], src=lse.ap(pattern=[[1, P], [P, nfull]], offset=base))
    if nfull < nqt:
        rem = S - nfull * P
        nisa.dma_copy(dst=lse_t[0:rem, nfull:nqt], src=lse.ap(pattern=[[1, rem], [1, 1]], offset=base + nfull * P))
    hd["lse"] = lse_t
    negdelta = None
    if cache:
        hd["o"] = nl.ndarray((P, nqt, D), dtype=o.dtype, buffer=nl.sbuf)
        qs = []
        for x in (q, do):
            qs.append([nl.ndarray((P, nqt, D), dtype=x.dtype, buffer=nl.sbuf),
                       nl.ndarray((D, nqt * P), dtype=x.dtype, buffer=nl.sbuf)])
        hd["qs"] = qs
    else:
        negdelta = nl.ndarray((P, nqt), dtype=nl.float32, buffer=nl.sbuf)
    nchunk = cdiv(nqt, QCHUNK)
    for ci in range(nchunk):
        t0 = (nchunk - 1 - ci) * QCHUNK
        nt = min(QCHUNK, nqt - t0)
        r0 = t0 * P
        if cache:
            _load_tiles(hd["o"][:, t0:t0 + nt, :], o, b, h, t0, nt)
            for xi in range(2):
                x = (q, do)[xi]
                _load_tiles(hd["qs"][xi][0][:, t0:t0 + nt, :], x, b, h, t0, nt)
                nrows = min(nt * P, S - r0)
                nisa.dma_transpose(dst=hd["qs"][xi][1][:, r0:r0 + nrows], src=rows(x, b, r0, nrows, h))
        else:
            o_c = nl.ndarray((P, QCHUNK, D), dtype=o.dtype, buffer=nl.sbuf)
            _load_tiles(o_c, o, b, h, t0, nt)
            do_c = nl.ndarray((P, QCHUNK, D), dtype=do.dtype, buffer=nl.sbuf)
            _load_tiles(do_c, do, b, h, t0, nt)
            _delta(negdelta, o_c, do_c, t0, nt, S)
    if not cache:
        hd["stats"] = [_neg_lse(lse_t, S), negdelta]
    return hd


def _neg_lse(lse_t, S):
    """``-lse`` (``[P, nqt]`` fp32) of the loaded ``lse_t``."""
    nqt = lse_t.shape[1]
    nfull = S // P
    neglse = nl.ndarray((P, nqt), dtype=nl.float32, buffer=nl.sbuf)
    if nfull > 0:
        nisa.tensor_scalar(dst=neglse[:, 0:nfull], data=lse_t[:, 0:nfull], op0=nl.multiply, operand0=-1.0)
    if nfull < nqt:
        rem = S - nfull * P
        nisa.tensor_scalar(dst=neglse[0:rem, nfull:nqt], data=lse_t[0:rem, nfull:nqt], op0=nl.multiply,
                           operand0=-1.0)
    return neglse


def _head_stats(hd, S, qt):
    """A cached head's row statistics ``[-lse, -delta]``, ``-delta`` formed per QCHUNK tiles when a block of
    query tile ``qt``'s chunk first needs it."""
    nqt = hd["lse"].shape[1]
    if hd["stats"] == None:  # noqa: E711 (NKI rejects `is`)
        hd["stats"] = [_neg_lse(hd["lse"], S), nl.ndarray((P, nqt), dtype=nl.float32, buffer=nl.sbuf)]
        hd["done"] = []
        for c in range(cdiv(nqt, QCHUNK)):
            hd["done"].append(False)
    c = qt // QCHUNK
    if not hd["done"][c]:
        t0 = c * QCHUNK
        nt = min(QCHUNK, nqt - t0)
        _delta(hd["stats"][1], hd["o"][:, t0:t0 + nt, :], hd["qs"][1][0][:, t0:t0 + nt, :], t0, nt, S)
        hd["done"][c] = True
    return hd["stats"]


def _load_kv_block(k, v, b, j, kb0, w):
    """The key block's ``K^T``, ``V^T`` ``[D, w]`` (DMA transpose) and ``K`` ``[P, nsub, D]`` (key
    ``kb0 + c*P + p`` at ``[p, c]``): DMAs only, so the next block's can be issued ahead of this one's work."""
    D = k.shape[3]
    kT = nl.ndarray((D, KB), dtype=k.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=kT[:, 0:w], src=rows(k, b, kb0, w, j))
    vT = nl.ndarray((D, KB), dtype=v.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=vT[:, 0:w], src=rows(v, b, kb0, w, j))
    k_nat = nl.ndarray((P, cdiv(w, P), D), dtype=k.dtype, buffer=nl.sbuf)
    views = _key_views(k, b, kb0, w, j, k_nat)
    for vi in range(len(views)):
        nisa.dma_copy(dst=views[vi][1], src=views[vi][0])
    return kT, vT, k_nat


def _blocks(S, kb0, heads, nqt):
    """The (head index, query tile) blocks that see keys ``kb0 ..``: per head, the last tile first."""
    out = []
    for hi in range(len(heads)):
        for t in range(nqt - 1, kb0 // P - 1, -1):
            r0 = t * P
            nq = min(P, S - r0)
            out.append({"hi": hi, "h": heads[hi], "qt": t, "r0": r0, "nq": nq, "w": min(KB, r0 + nq - kb0, S - kb0),
                        "open": len(out) == 0})
    return out


def _st_scores(blk, ctx):
    """Stage 1: the block's q-side tiles and ``S``, ``dP`` in PSUM."""
    q, do, b, kv = ctx["q"], ctx["do"], ctx["b"], ctx["kv"]
    h, r0, nq, w = blk["h"], blk["r0"], blk["nq"], blk["w"]
    D = q.shape[3]
    qs = ctx["heads"][blk["hi"]]["qs"]
    if qs != None:  # noqa: E711 (the pass's cached q-side tiles)
        qT, doT = qs[0][1][:, r0:r0 + nq], qs[1][1][:, r0:r0 + nq]
        q_t, do_t = qs[0][0][:, blk["qt"], :], qs[1][0][:, blk["qt"], :]
    else:
        qT_sb = nl.ndarray((D, P), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=qT_sb[:, 0:nq], src=rows(q, b, r0, nq, h))
        doT_sb = nl.ndarray((D, P), dtype=do.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=doT_sb[:, 0:nq], src=rows(do, b, r0, nq, h))
        q_t = nl.ndarray((P, D), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_t[0:nq, :], src=rows(q, b, r0, nq, h))
        do_t = nl.ndarray((P, D), dtype=do.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=do_t[0:nq, :], src=rows(do, b, r0, nq, h))
        qT, doT = qT_sb[:, 0:nq], doT_sb[:, 0:nq]
    s_ps = nl.ndarray((nq, w), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=s_ps, stationary=qT, moving=kv[0][:, 0:w], accumulate=False)
    dp_ps = nl.ndarray((nq, w), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=dp_ps, stationary=doT, moving=kv[1][:, 0:w], accumulate=False)
    blk["q_t"], blk["do_t"], blk["s"], blk["dp"] = q_t, do_t, s_ps, dp_ps


def _st_probs(blk, ctx):
    """Stage 2: ``P = exp(scale * S - lse)`` (zero above the diagonal) and ``dP - delta`` (Scalar, or left
    to stage 3)."""
    nq, w, t, hi = blk["nq"], blk["w"], blk["qt"], blk["hi"]
    pdt = ctx["pdt"]
    neglse, negdelta = ctx["heads"][hi]["stats"]
    p_sb = nl.ndarray((nq, w), dtype=pdt, buffer=nl.sbuf)
    nisa.activation(dst=p_sb, op=nl.exp, data=blk["s"], bias=neglse[0:nq, t:t + 1], scale=ctx["scale"])
    load = ctx["load"]
    load[1] = load[1] + ACT_FIXED_NS + w / SCALAR_GHZ
    # dP - delta: on Scalar (then dS = P * dpm on Vector), or folded into one Vector op at stage 3,
    # whichever engine would finish first
    tt = (w / 2 if pdt != nl.float32 else 2 * w) / VECTOR_GHZ
    # the stt at the beta-1 table's 2N, not the current ISA reference's one pass with dP in PSUM: the one-pass
    # price leans to the single Vector instruction and loses at the pessimistic end (measured: S = 4,096,
    # 8 / 2 heads, LNC 1, 2,601 -> 2,808 us there, +0.5 % at mid)
    stt = 2 * w / VECTOR_GHZ
    dpm = None
    if max(load[1] + ACT_FIXED_NS + w / SCALAR_GHZ, load[0] + tt) <= max(load[1], load[0] + stt):
        dpm = nl.ndarray((nq, w), dtype=pdt, buffer=nl.sbuf)
        nisa.activation(dst=dpm, op=nl.copy, data=blk["dp"], bias=negdelta[0:nq, t:t + 1])
        load[0], load[1] = load[0] + tt, load[1] + ACT_FIXED_NS + w / SCALAR_GHZ
        blk["dp"] = None
    else:
        load[0] = load[0] + stt
    blk["s"] = None
    c0 = blk["r0"] - ctx["kb0"]
    if 0 <= c0 and c0 < w:  # the diagonal: keys past each row's own position get probability 0
        p_m = nl.ndarray((nq, w), dtype=pdt, buffer=nl.sbuf)
        nisa.affine_select(dst=p_m, pattern=[[1, w]], channel_multiplier=-1, on_true_tile=p_sb, on_false_value=0.0,
                           cmp_op=nl.less_equal, offset=-c0)
        p_sb = p_m
    blk["p"], blk["dpm"] = p_sb, dpm


def _st_ds(blk, ctx):
    """Stage 3: ``dS = P * (dP - delta)`` (Vector; from dP in PSUM when stage 2 left it) and
    ``dV^T += dO^T P``."""
    nq, w = blk["nq"], blk["w"]
    ds = nl.ndarray((nq, w), dtype=ctx["pdt"], buffer=nl.sbuf)
    if blk["dpm"] != None:  # noqa: E711 (NKI rejects `is`)
        nisa.tensor_tensor(dst=ds, data1=blk["p"], data2=blk["dpm"], op=nl.multiply)
    else:
        negdelta = ctx["heads"][blk["hi"]]["stats"][1]
        nisa.scalar_tensor_tensor(dst=ds, data=blk["dp"], op0=nl.add, operand0=negdelta[0:nq, blk["qt"]:blk["qt"] + 1],
                                  op1=nl.multiply, operand1=blk["p"])
        blk["dp"] = None
    # the block list starts with the widest block (the last query tile): it opens the group
    nisa.nc_matmul(dst=ctx["dvT"][:, 0:w], stationary=blk["do_t"][0:nq, :], moving=blk["p"], accumulate=not blk["open"])
    blk["ds"], blk["p"], blk["dpm"], blk["do_t"] = ds, None, None, None


def _st_dk(blk, ctx):
    """Stage 4: ``dK^T += Q^T dS`` and ``dS^T`` per 128 keys (PE transpose), copied to SBUF."""
    nq, w, ds = blk["nq"], blk["w"], blk["ds"]
    pdt = ctx["pdt"]
    nisa.nc_matmul(dst=ctx["dkT"][:, 0:w], stationary=blk["q_t"][0:nq, :], moving=ds, accumulate=not blk["open"])
    nsub = cdiv(w, P)
    dsT_ps = nl.ndarray((P, nsub, nq), dtype=pdt, buffer=nl.psum)
    for c in range(nsub):
        kc = min(P, w - c * P)
        nisa.nc_transpose(dst=dsT_ps[0:kc, c, :], data=ds[:, c * P:c * P + kc])
    dsT = nl.ndarray((P, nsub, nq), dtype=pdt, buffer=nl.sbuf)
    nfull = w // P
    parts = []
    if nfull > 0:
        parts.append([P, 0, nfull])
    if nfull < nsub:
        parts.append([w - nfull * P, nfull, nsub])
    for pi in range(len(parts)):
        kc, c0, c1 = parts[pi]
        if cheaper_engine(ctx["load"], (c1 - c0) * nq, pdt != nl.float32) == 0:
            nisa.tensor_copy(dst=dsT[0:kc, c0:c1, :], src=dsT_ps[0:kc, c0:c1, :])
        else:
            nisa.activation(dst=dsT[0:kc, c0:c1, :], op=nl.copy, data=dsT_ps[0:kc, c0:c1, :])
    blk["dsT"], blk["ds"], blk["q_t"] = dsT, None, None


def _st_dq(blk, ctx):
    """Stage 5: ``dQ_blk = dS K`` over the block's keys; added into the tile's fp32 dQ accumulator."""
    nq, w, dsT = blk["nq"], blk["w"], blk["dsT"]
    k_nat = ctx["kv"][2]
    D = k_nat.shape[2]
    dq_ps = nl.ndarray((nq, D), dtype=nl.float32, buffer=nl.psum)
    operands = []
    for c in range(cdiv(w, P)):
        kc = min(P, w - c * P)
        operands.append([(dsT[0:kc, c, :], k_nat[0:kc, c, :])])
    accumulate([dq_ps], operands)
    acc = ctx["dq_acc"][0:nq, blk["hi"] * ctx["nqt"] + blk["qt"], :]
    if ctx["kb0"] == 0:
        nisa.tensor_copy(dst=acc, src=dq_ps)
    else:
        nisa.tensor_tensor(dst=acc, data1=acc, data2=dq_ps, op=nl.add)
    ctx["load"][0] = ctx["load"][0] + max(64, D) / VECTOR_GHZ
    blk["dsT"] = None


def _transpose_out(src_ps, w, scale, dt):
    """``[D, w]`` fp32 PSUM (times scale) -> ``[P, nsub, D]`` in dt (key ``c*P + p`` at ``[p, c]``; PE
    transposes). The scaled copy already rounds to dt: the transpose is exact, so the values are the same
    as transposing in fp32, and a bf16 transpose takes half an fp32 one's TensorE time (trn2 arch guide,
    transpose mode)."""
    D = src_ps.shape[0]
    t_sb = nl.ndarray((D, KB), dtype=dt, buffer=nl.sbuf)
    nisa.activation(dst=t_sb[:, 0:w], op=nl.copy, data=src_ps[:, 0:w], scale=scale)
    nsub = cdiv(w, P)
    out = nl.ndarray((P, nsub, D), dtype=dt, buffer=nl.sbuf)
    for c in range(nsub):
        kc = min(P, w - c * P)
        tp = nl.ndarray((P, D), dtype=dt, buffer=nl.psum)
        nisa.nc_transpose(dst=tp[0:kc, :], data=t_sb[:, c * P:c * P + kc])
        nisa.tensor_copy(dst=out[0:kc, c, :], src=tp[0:kc, :])
    return out


def _key_views(t, ob, kb0, w, j, tile):
    """``[(HBM view, SBUF view)]`` of keys ``kb0 .. kb0 + w`` of kv head j: the full 128-key tiles in one
    pair, a short last tile in another."""
    nfull = w // P
    out = []
    if nfull > 0:
        out.append([tiles_view(t, ob, kb0, nfull, j), tile[:, 0:nfull, :]])
    if nfull * P < w:
        out.append([rows(t, ob, kb0 + nfull * P, w - nfull * P, j), tile[0:w - nfull * P, nfull, :]])
    return out


def _store_dkv(ctx, outs, kb0, w, first_pass, last_pass):
    """The key block's dK (= scale * dK^T transposed) and dV: stored, or added into the fp32 scratch
    of a multi-pass unit (converted by its last pass)."""
    dk, dv, scr = outs[1], outs[2], outs[3]
    j, ob = ctx["j"], ctx["ob"]
    pairs = [[ctx["dkT"], ctx["scale"], dk, 0], [ctx["dvT"], 1.0, dv, 1]]
    for i in range(2):
        src_ps, sc, dst, which = pairs[i]
        D = src_ps.shape[0]
        dt = dst.dtype if scr == None else nl.float32  # noqa: E711 (NKI rejects `is`)
        tile = _transpose_out(src_ps, w, sc, dt)
        if scr == None:  # noqa: E711
            views = _key_views(dst, ob, kb0, w, j, tile)
            for vi in range(len(views)):
                nisa.dma_copy(dst=views[vi][0], src=views[vi][1])
        else:
            views = _key_views(scr, 2 * ob + which, kb0, w, j, tile)
            fin = nl.ndarray((P, cdiv(w, P), D), dtype=dst.dtype, buffer=nl.sbuf)
            outv = _key_views(dst, ob, kb0, w, j, fin)
            for vi in range(len(views)):
                view, part = views[vi]
                if first_pass:
                    nisa.dma_copy(dst=view, src=part)
                else:
                    nisa.dma_compute(dst=view, srcs=[view, part], reduce_op=nl.add)
                if last_pass:
                    nisa.dma_copy(dst=outv[vi][1], src=view)
                    nisa.dma_copy(dst=outv[vi][0], src=outv[vi][1])


def _store_dq(ctx, dq, heads):
    """The pass's dQ = scale * accumulator, in dq's dtype, per QCHUNK query tiles (full tiles in one
    instruction and DMA, a short last tile in another)."""
    S, D = dq.shape[1], dq.shape[3]
    nqt = ctx["nqt"]
    for hi in range(len(heads)):
        for c in range(cdiv(nqt, QCHUNK)):
            t0 = c * QCHUNK
            nt = min(QCHUNK, nqt - t0)
            nfull = min(nt, S // P - t0)
            out = nl.ndarray((P, QCHUNK, D), dtype=dq.dtype, buffer=nl.sbuf)
            col = hi * nqt + t0
            if nfull > 0:
                nisa.activation(dst=out[:, 0:nfull, :], op=nl.copy, data=ctx["dq_acc"][:, col:col + nfull, :],
                                scale=ctx["scale"])
                nisa.dma_copy(dst=tiles_view(dq, ctx["ob"], t0 * P, nfull, heads[hi]), src=out[:, 0:nfull, :])
            if nfull < nt:
                r0 = (t0 + nfull) * P
                nq = S - r0
                nisa.activation(dst=out[0:nq, nfull, :], op=nl.copy, data=ctx["dq_acc"][0:nq, col + nfull, :],
                                scale=ctx["scale"])
                nisa.dma_copy(dst=rows(dq, ctx["ob"], r0, nq, heads[hi]), src=out[0:nq, nfull, :])


def _at(blocks, t):
    """``blocks[t]`` when t is a block index, else None (pipeline fill and drain)."""
    if 0 <= t and t < len(blocks):
        return blocks[t]
    return None


def _run_blocks(blocks, ctx):
    """The software pipeline over a key block's (head, query tile) blocks. Iteration t issues, per
    engine in this order: Tensor S, dP (t), dV^T (t-2), dQ (t-4), dK^T and dS^T (t-3); Scalar P and
    dP - delta (t-1), dS^T copies (t-3); Vector dS (t-2), the dQ sum (t-4), dS^T copies (t-3)."""
    for t in range(len(blocks) + 4):
        if _at(blocks, t) != None:  # noqa: E711
            if ctx["heads"][blocks[t]["hi"]]["o"] != None:  # noqa: E711 (a cached head: statistics on first use)
                _head_stats(ctx["heads"][blocks[t]["hi"]], ctx["q"].shape[1], blocks[t]["qt"])
            _st_scores(blocks[t], ctx)
        if _at(blocks, t - 1) != None:  # noqa: E711
            _st_probs(blocks[t - 1], ctx)
        if _at(blocks, t - 2) != None:  # noqa: E711
            _st_ds(blocks[t - 2], ctx)
        if _at(blocks, t - 4) != None:  # noqa: E711
            _st_dq(blocks[t - 4], ctx)
        if _at(blocks, t - 3) != None:  # noqa: E711
            _st_dk(blocks[t - 3], ctx)


def _bwd_unit(unit, ins, outs, scale):
    """One work unit (one kv head, all its query heads), its heads in passes that fit SBUF."""
    q, k, v, o, do, lse = ins
    b, j, g0, ng, _ = unit
    S, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    G = Hq // k.shape[2]
    nqt = cdiv(S, P)
    itemsize = 4 if q.dtype == nl.float32 else 2
    hpp = heads_per_pass(S, D, G, itemsize)
    npass = cdiv(ng, hpp)
    ctx = {"q": q, "do": do, "b": b, "j": j, "ob": b if outs[0].shape[0] > 1 else 0, "scale": scale,
           "pdt": q.dtype, "nqt": nqt, "load": [0.0, 0.0]}
    for pi in range(npass):
        heads = []
        for g in range(g0 + pi * hpp, min(g0 + ng, g0 + (pi + 1) * hpp)):
            heads.append(j * G + g)
        cache = cache_q_side(S, D, itemsize)
        nkb = cdiv(S, KB)
        kv_next = _load_kv_block(k, v, b, j, 0, min(KB, S))  # first: the first block needs it
        hds = []
        for hi in range(len(heads)):
            hds.append(_head_setup(ins, b, heads[hi], nqt, cache))
        ctx["heads"] = hds
        ctx["dq_acc"] = nl.ndarray((P, len(heads) * nqt, D), dtype=nl.float32, buffer=nl.sbuf)
        for kb in range(nkb):
            kb0 = kb * KB
            w = min(KB, S - kb0)
            ctx["kb0"] = kb0
            ctx["kv"] = kv_next
            if kb + 1 < nkb:  # the next key block's loads go ahead of this block's work and stores
                kv_next = _load_kv_block(k, v, b, j, kb0 + KB, min(KB, S - kb0 - KB))
            ctx["dkT"] = nl.ndarray((D, w), dtype=nl.float32, buffer=nl.psum)
            ctx["dvT"] = nl.ndarray((D, w), dtype=nl.float32, buffer=nl.psum)
            _run_blocks(_blocks(S, kb0, heads, nqt), ctx)
            _store_dkv(ctx, outs, kb0, w, pi == 0, pi == npass - 1)
            ctx["dkT"], ctx["dvT"], ctx["kv"] = None, None, None  # (their PSUM accumulation groups close)
        _store_dq(ctx, outs[0], heads)


@nki.jit
def attention_bwd_kernel(q, k, v, o, do, lse, scale):
    """``(dq, dk, dv)`` (the inputs' shapes and dtype) of
    :func:`~trnkit.kernels.attention.flash_fwd.attention_fwd_kernel` at ``q [B, S, Hq, D]``, ``k, v [B, S, Hk,
    D]`` given its output ``o``, log-sum-exp ``lse [B, Hq, S]`` and the output gradient ``do`` (q's shape and
    dtype)."""
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    G = Hq // Hk
    dq = nl.ndarray((B, S, Hq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray((B, S, Hk, D), dtype=k.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((B, S, Hk, D), dtype=v.dtype, buffer=nl.shared_hbm)
    n_prog, pid = program_split()
    scr = None
    # several head passes: fp32 dK / dV partial sums
    if cdiv(G, heads_per_pass(S, D, G, 4 if q.dtype == nl.float32 else 2)) > 1:
        scr = nl.ndarray((2 * B, S, Hk, D), dtype=nl.float32, buffer=nl.private_hbm)
    dup = None
    if needs_scratch(B, Hk, G, n_prog, False):
        dup = (nl.ndarray((1, S, Hq, D), dtype=q.dtype, buffer=nl.private_hbm),
               nl.ndarray((1, S, Hk, D), dtype=k.dtype, buffer=nl.private_hbm),
               nl.ndarray((1, S, Hk, D), dtype=v.dtype, buffer=nl.private_hbm), scr)
    units = work_units(B, Hk, G, n_prog, pid, False)
    for u in range(len(units)):
        outs = (dq, dk, dv, scr) if units[u][4] else dup
        _bwd_unit(units[u], (q, k, v, o, do, lse), outs, float(scale))
    return dq, dk, dv
