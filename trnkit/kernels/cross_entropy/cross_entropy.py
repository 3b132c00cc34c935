"""Fused linear cross-entropy NKI kernels: ``lce_fwd_kernel`` (loss and log-sum-exp per token) and
``lce_bwd_kernel`` (grad_hidden and grad_weight), both without a ``[T, V]`` tensor in HBM.

The logits ``hidden @ weight.T`` exist only as fp32 PSUM tiles. Every matmul contracts over H on the
partitions, so the host hands the kernels both layouts of each operand: ``hT [H, T]`` and ``wT [H, V]``
(H leading: the logits' operands) and ``h [T, H]`` / ``w [V, H]`` (the gradients' moving operands, and
the rows gathered by label). Every logits tile is ``[128, 512]``: a 128-column stationary operand
against a 512-column moving one, one fp32 PSUM bank, summed over the 128-row chunks of H.

Forward, per group of up to 1,024 tokens (eight 128-token tiles, tokens on partitions), which share each
load of 512 vocabulary columns: the Vector engine takes each logits tile's negated row max and the running
``-m = min(-m, -rowmax)``; the Scalar engine sums ``exp(logits - m)`` along the row
(``activation_reduce``) into one column per vocabulary tile. Nothing waits on the sum inside the loop:
at the end ``s = sum_k s_k * exp(m_k - m)`` over the columns, ``lse = m + ln s``. The target logit is
``h[t] . w[label[t]]``, from the rows gathered by label (one indirect DMA per token tile; the products on
GpSimd, spread over the vocabulary loop, the row sums on Vector at the end), so the vocabulary loop
carries no one-hot work; ``loss = lse - target``.

Backward, ``dl[t, v] = scale[t] * (exp(logit - lse[t]) - [v == label[t]])`` (``scale`` = the loss
gradient per token, 0 for ignored tokens). Both gradients are summed in PSUM over the tiles of the
contracted dimension (a matmul accumulation group of ``ceil(H / 512)`` banks per 128-row output tile,
at most 6 banks next to the logits) and leave PSUM once per chunk of those tiles:

* ``grad_weight [V, H]``: per group of 512 vocabulary rows, logits ``[128 t, 512 v]`` per token tile;
  ``dl`` in the operands' dtype (Scalar: ``exp`` with the per-token ``-lse`` bias; Vector: ``e * scale
  - scale * onehot``), then for each 128-row vocabulary tile ``dl[:, tile].T @ h[t, :]`` summed over
  the chunk's token tiles. When all tokens' ``h`` and ``hT`` fit in SBUF they are loaded once and every
  sum runs over all tokens; otherwise the tokens go in chunks and each chunk's sum is added into an fp32
  SBUF accumulator.
* ``grad_hidden [T, H]``: per group of up to 512 tokens, logits ``[128 v, 512 t]`` per vocabulary tile (the
  vocabulary on partitions, so ``p^T = exp(logit - lse)`` is directly the stationary operand; the
  per-token ``lse`` is a broadcast row subtracted on the Vector engine), then for each 128-token tile
  ``p^T[:, tile].T @ w[v, :]`` summed over a chunk of vocabulary tiles and added into an fp32 SBUF
  accumulator. The one-hot part and ``scale`` come after the vocabulary loop: ``grad_h[t] = scale[t] *
  (acc[t] - w[label[t]])`` with the rows gathered by label. (``p`` is rounded to the operands' dtype
  where the reference rounds ``scale * (p - onehot)``.)

Each pass loads the next group's operands ahead of this group's stores (one DMA queue in program order
still keeps TensorE fed). The two passes recompute the logits once each (4 matmul passes over ``T x V x
H`` in all, against 3 for a backward that stored the logits): the price of no ``[T, V]`` buffer. LNC=2
splits the token groups (forward, grad_hidden; cut narrower when that gives both cores equal groups) and the 512-row
vocabulary groups (grad_weight) between the two cores with the same instruction stream on both
(``program_share``: a core short of an item computes a masked copy into a scratch tensor).
"""

from __future__ import annotations

from trnkit.kernels._common import P_MAX, cdiv, program_share
from trnkit.kernels.tiles import accumulate, psum_tiles
from trnkit.nki_api import nisa, nki, nl

P = P_MAX
WIDE = 512  # moving columns of a logits tile (one fp32 PSUM bank): vocabulary (forward, grad_w) or tokens
HB = 512  # hidden columns per gradient PSUM bank
FWD_GROUP = 8  # forward: token tiles sharing each load of WIDE weight columns
# SBUF bytes per partition for the contracted tiles of one chunk (both layouts and their dl tiles), at
# most; for keeping all tokens resident through the grad_weight pass (no reload, no SBUF accumulator);
# and for everything a backward pass holds at once (the next group's operands loaded ahead included)
CHUNK_BYTES = 64 * 1024
RESIDENT_BYTES = 144 * 1024
SBUF_BYTES = 192 * 1024


def _tiles(n, width):
    """``[(start, size), ...]`` covering ``n`` in tiles of ``width`` (a short last one)."""
    out = []
    for i in range(cdiv(n, width)):
        out.append((i * width, min(width, n - i * width)))
    return out


def _share(n, width, n_prog, pid):
    """This program's tiles of ``_tiles(n, width)`` as ``[((start, size), masked), ...]``."""
    tiles = _tiles(n, width)
    keys = []
    for i in range(len(tiles)):
        keys.append(tiles[i][1])
    return program_share(tiles, keys, n_prog, pid)


def _group_share(n, width, n_prog, pid):
    """This program's groups of at most ``width`` of ``n`` as ``_share`` gives them, the group width cut
    so that the number of groups is a multiple of the programs (no core idles on a masked copy when
    ``n`` allows an even split: 512 tokens at LNC=2 are two groups of 256)."""
    k = cdiv(cdiv(n, width), n_prog) * n_prog
    return _share(n, cdiv(n, k), n_prog, pid)


def _chunks(n, per_tile, budget):
    """``n`` tiles in balanced chunks ``[(first, count), ...]`` of at most ``budget // per_tile`` tiles."""
    k = cdiv(n, max(1, budget // per_tile))
    base, extra = divmod(n, k)
    out = []
    first = 0
    for i in range(k):
        count = base + (1 if i < extra else 0)
        out.append((first, count))
        first = first + count
    return out


def _cols(src, c0, cw, dtype):
    """SBUF ``[128, nH, cw]``: columns ``c0:c0+cw`` of ``src [H, N]``, chunk c = rows ``c*128 ...`` of H
    (the full chunks in one DMA; a short last chunk leaves the tail partitions unused)."""
    H, N = src.shape
    nH, nfull = cdiv(H, P), H // P
    t = nl.ndarray((P, nH, cw), dtype=dtype, buffer=nl.sbuf)
    if nfull > 0:
        nisa.dma_copy(dst=t[:, 0:nfull, :], src=src.ap(pattern=[[N, P], [P * N, nfull], [1, cw]], offset=c0))
    if nfull < nH:
        nisa.dma_copy(dst=t[0:H - nfull * P, nfull, :], src=src[nfull * P:H, c0:c0 + cw])
    return t


def _rows(src, r0, n, dtype):
    """SBUF ``[128, ceil(n/128), H]``: rows ``r0:r0+n`` of ``src [N, H]``, row ``r0 + i*128 + p`` at
    ``[p, i]`` (the full tiles in one DMA)."""
    H = src.shape[1]
    nt, nfull = cdiv(n, P), n // P
    t = nl.ndarray((P, nt, H), dtype=dtype, buffer=nl.sbuf)
    if nfull > 0:
        nisa.dma_copy(dst=t[:, 0:nfull, :], src=src.ap(pattern=[[H, P], [P * H, nfull], [1, H]], offset=r0 * H))
    if nfull < nt:
        nisa.dma_copy(dst=t[0:n - nfull * P, nfull, :], src=src[r0 + nfull * P:r0 + n, :])
    return t


def _stat_cols(src, n):
    """SBUF ``[128, ceil(n/128)]`` fp32: ``src[i*128 + p]`` at ``[p, i]`` (one value per token tile column)."""
    nt, nfull = cdiv(n, P), n // P
    t = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    if nfull > 0:
        nisa.dma_copy(dst=t[:, 0:nfull], src=src.ap(pattern=[[1, P], [P, nfull]], offset=0))
    if nfull < nt:
        nisa.dma_copy(dst=t[0:n - nfull * P, nfull:nt], src=src.ap(pattern=[[1, n - nfull * P], [1, 1]],
                                                                    offset=nfull * P))
    return t


def _row(src, t0, tw, rows):
    """SBUF ``[rows, tw]`` fp32: ``src[t0:t0+tw]`` on every partition (partition step 0)."""
    t = nl.ndarray((rows, tw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src.ap(pattern=[[0, rows], [1, tw]], offset=t0))
    return t


def _logits(ps, stat, s0, sw, mov, m0, mw, H):
    """``ps = stat[:, c, s0:s0+sw].T @ mov[:, c, m0:m0+mw]`` summed over the H chunks c (fp32 PSUM)."""
    operands = []
    for c in range(cdiv(H, P)):
        hk = min(P, H - c * P)
        operands.append([(stat[0:hk, c, s0:s0 + sw], mov[0:hk, c, m0:m0 + mw])])
    accumulate([ps], operands)


def _label_rows(w, lab, tw, dtype):
    """SBUF ``[tw, H]``: ``w[max(label, 0)]`` per token (an ignored token's label -1 reads row 0), one
    indirect DMA."""
    H = w.shape[1]
    idx = nl.ndarray((tw, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=idx, data=lab, op0=nl.maximum, operand0=0.0)
    rows = nl.ndarray((tw, H), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows, src=w.ap(pattern=[[H, tw], [1, H]], offset=0, vector_offset=idx, indirect_dim=0))
    return rows


def _column(src, t0, tw):
    """SBUF ``[tw, 1]`` fp32: ``src[t0:t0+tw]`` (one value per partition)."""
    t = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src.ap(pattern=[[1, tw], [1, 1]], offset=t0))
    return t


def _target_products(h, w, t0, tw, lab, dt):
    """SBUF ``[tw, H]`` fp32: ``h[t] * w[label[t]]`` for tokens ``t0:t0+tw``, whose row sums are the target
    logits (on GpSimd, otherwise idle in the forward, while the vocabulary loop runs)."""
    H = h.shape[1]
    h_rows = nl.ndarray((tw, H), dtype=dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=h_rows, src=h[t0:t0 + tw, :])
    prod = nl.ndarray((tw, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod, data1=h_rows, data2=_label_rows(w, lab, tw, dt), op=nl.multiply,
                       engine=nisa.engine.gpsimd)
    return prod


def _fwd_finish(out, negm_cols, es_cols, prod):
    """``out [tw, 2] = [lse | loss]`` of a token tile from its per-vocabulary-tile columns ``negm_cols``
    (``-m_k``, the running max negated) and ``es_cols`` (``sum exp(logits - m_k)``) and its target products."""
    tw, nv = es_cols.shape
    tgt = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=tgt, op=nl.add, data=prod, axis=1)
    negm = negm_cols[:, nv - 1:nv]
    corr = nl.ndarray((tw, nv), dtype=nl.float32, buffer=nl.sbuf)  # exp(m_k - m)
    nisa.activation(dst=corr, op=nl.exp, data=negm_cols, bias=negm, scale=-1.0)
    nisa.tensor_tensor(dst=corr, data1=corr, data2=es_cols, op=nl.multiply)
    s = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=s, op=nl.add, data=corr, axis=1)
    nisa.activation(dst=out[:, 0:1], op=nl.log, data=s)
    nisa.tensor_tensor(dst=out[:, 0:1], data1=out[:, 0:1], data2=negm, op=nl.subtract)
    nisa.tensor_tensor(dst=out[:, 1:2], data1=out[:, 0:1], data2=tgt, op=nl.subtract)


def _store_stats(loss, lse, scratch, t0, gw, out, masked):
    """A group's ``out [128, n, 2]`` (``[lse | loss]`` of token ``t0 + i*128 + p`` at ``[p, i]``) to HBM: the
    full tiles in one DMA per output, a short last tile in one more (a masked group: to scratch)."""
    nfull = gw // P
    if masked:
        nisa.dma_copy(dst=scratch.ap(pattern=[[2, P], [2 * P, 1], [1, 2]], offset=0), src=out[:, 0:1, :])
        return
    for k in range(2):
        dst = lse if k == 0 else loss
        if nfull > 0:
            nisa.dma_copy(dst=dst.ap(pattern=[[1, P], [P, nfull], [1, 1]], offset=t0),
                          src=out[:, 0:nfull, k:k + 1])
        if nfull * P < gw:
            rem = gw - nfull * P
            nisa.dma_copy(dst=dst.ap(pattern=[[1, rem], [1, 1], [1, 1]], offset=t0 + nfull * P),
                          src=out[0:rem, nfull:nfull + 1, k:k + 1])


@nki.jit
def lce_fwd_kernel(hT, h, wT, w, labels):
    """``(loss [T] f32, lse [T] f32)`` of ``hT [H, T]`` / ``h [T, H]``, ``wT [H, V]`` / ``w [V, H]``, ``labels
    [T]`` fp32 (a vocabulary index, or -1 for an ignored token: its loss is masked by the host)."""
    H, T = hT.shape
    V = wT.shape[1]
    dt = hT.dtype
    n_prog = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if nl.program_ndim() > 0 else 0
    loss = nl.ndarray((T,), dtype=nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((T,), dtype=nl.float32, buffer=nl.shared_hbm)
    scratch = nl.ndarray((2 * P,), dtype=nl.float32, buffer=nl.shared_hbm)  # masked groups' results
    vt = _tiles(V, WIDE)
    groups = _group_share(T, FWD_GROUP * P, n_prog, pid)
    nxt = [_cols(wT, vt[0][0], vt[0][1], dt), _cols(hT, groups[0][0][0], groups[0][0][1], dt)]
    for gi in range(len(groups)):
        (t0, gw), masked = groups[gi]
        # the group's tokens share each weight load; token tile j = columns j*128 ... of x_sb
        w_sb, x_sb = nxt
        subs = _tiles(gw, P)
        negm = nl.ndarray((P, len(subs), len(vt)), dtype=nl.float32, buffer=nl.sbuf)
        es = nl.ndarray((P, len(subs), len(vt)), dtype=nl.float32, buffer=nl.sbuf)
        tgt = []
        for j in range(len(subs)):
            tgt.append(None)
        for k in range(len(vt)):
            v0, vw = vt[k]
            if k > 0:
                w_sb = _cols(wT, v0, vw, dt)
            for j in range(len(subs)):
                s0, tw = subs[j]
                ps = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.psum)
                _logits(ps, x_sb, s0, tw, w_sb, 0, vw, H)
                col = negm[0:tw, j, k:k + 1]
                nisa.tensor_reduce(dst=col, op=nl.maximum, data=ps, axis=1, negate=True)
                if k > 0:
                    nisa.tensor_tensor(dst=col, data1=col, data2=negm[0:tw, j, k - 1:k], op=nl.minimum)
                e = nl.ndarray((tw, vw), dtype=dt, buffer=nl.sbuf)  # only its row sum is kept
                nisa.activation_reduce(dst=e, op=nl.exp, data=ps, reduce_op=nl.add, reduce_res=es[0:tw, j, k:k + 1],
                                       bias=col)
            for j in range(k, len(subs), len(vt)):  # spread over the loop: GpSimd (and its DMA queue) never long busy
                s0, tw = subs[j]
                tgt[j] = _target_products(h, w, t0 + s0, tw, _column(labels, t0 + s0, tw), dt)
        if gi + 1 < len(groups):  # the next group's first operands ahead of this group's stores
            nxt = [_cols(wT, vt[0][0], vt[0][1], dt), _cols(hT, groups[gi + 1][0][0], groups[gi + 1][0][1], dt)]
        out = nl.ndarray((P, len(subs), 2), dtype=nl.float32, buffer=nl.sbuf)  # [lse | loss] per token
        for j in range(len(subs)):
            tw = subs[j][1]
            _fwd_finish(out[0:tw, j, :], negm[0:tw, j, :], es[0:tw, j, :], tgt[j])
        _store_stats(loss, lse, scratch, t0, gw, out, masked)
    return loss, lse


def _banks(rows, H):
    """fp32 PSUM tiles ``[rows, <=512]`` covering H columns (one bank each)."""
    shapes = []
    for h0, hw in _tiles(H, HB):
        shapes.append((rows, hw))
    return psum_tiles(shapes)


def _sum_products(banks, dl, s0, sw, rows, tiles):
    """``banks = sum_i dl[:, i, s0:s0+sw].T @ rows[:, i, :]`` over the contracted tiles ``[(i, size), ...]``
    (one accumulation group per bank; the tiles outermost, so the last tile's ``dl`` is needed last)."""
    operands = []
    for i, k in tiles:
        row = []
        for b in range(len(banks)):
            h0 = b * HB
            row.append((dl[0:k, i, s0:s0 + sw], rows[0:k, i, h0:h0 + banks[b].shape[1]]))
        operands.append(row)
    accumulate(banks, operands)


def _leave_psum(dst, banks, add):
    """``dst (+)= banks`` (fp32 SBUF ``[rows, H]``): an add on the Vector engine, or a copy alternating
    between the Vector and Scalar engines."""
    for b in range(len(banks)):
        h0 = b * HB
        hw = banks[b].shape[1]
        if add:
            nisa.tensor_tensor(dst=dst[:, h0:h0 + hw], data1=dst[:, h0:h0 + hw], data2=banks[b], op=nl.add)
        elif b % 2 == 0:
            nisa.tensor_copy(dst=dst[:, h0:h0 + hw], src=banks[b])
        else:
            nisa.activation(dst=dst[:, h0:h0 + hw], op=nl.copy, data=banks[b])


def _store(dst_hbm, scratch, r0, src, masked):
    """A finished ``[rows, H]`` gradient tile to ``dst_hbm[r0:r0+rows, :]`` (a masked one to scratch)."""
    rows = src.shape[0]
    if masked:
        nisa.dma_copy(dst=scratch[0:rows, :], src=src)
    else:
        nisa.dma_copy(dst=dst_hbm[r0:r0 + rows, :], src=src)


def _grad_weight(hT, h, wT, grad_w, scratch, lse, scale, labels, n_prog, pid):
    """grad_weight: groups of 512 vocabulary rows; tokens on partitions, summed over token chunks."""
    H, T = hT.shape
    V = wT.shape[1]
    dt = hT.dtype
    isz = 4 if dt == nl.float32 else 2
    tt = _tiles(T, P)
    per_tile = (cdiv(H, P) * P + H + WIDE) * isz
    chunks = [(0, len(tt))]
    if len(tt) * per_tile > RESIDENT_BYTES:
        # held besides a chunk: the accumulators, two groups' weight columns, stats, e / onehot tiles
        held = (4 * H + 3 * len(tt)) * 4 + 2 * cdiv(H, P) * WIDE * isz + 3 * WIDE * 4
        chunks = _chunks(len(tt), per_tile, min(CHUNK_BYTES, SBUF_BYTES - held))
    neg = _stat_cols(lse, T)
    nisa.tensor_scalar(dst=neg, data=neg, op0=nl.multiply, operand0=-1.0)
    sc = _stat_cols(scale, T)
    lab = _stat_cols(labels, T)
    resident = []
    if len(chunks) == 1:
        resident = [_cols(hT, 0, T, dt), _rows(h, 0, T, dt)]
    groups = _share(V, WIDE, n_prog, pid)
    w_next = _cols(wT, groups[0][0][0], groups[0][0][1], dt)
    for gi in range(len(groups)):
        (v0, vw), masked = groups[gi]
        w_sb = w_next
        vid = nl.ndarray((P, vw), dtype=nl.float32, buffer=nl.sbuf)  # vocabulary index of each column
        nisa.iota(dst=vid, pattern=[[1, vw]], offset=v0, channel_multiplier=0)
        subs = _tiles(vw, P)
        acc = []
        if len(chunks) > 1:
            for s0, sw in subs:
                acc.append(nl.ndarray((sw, H), dtype=nl.float32, buffer=nl.sbuf))
        for ci in range(len(chunks)):
            i0, n = chunks[ci]
            c0, cn = tt[i0][0], min(T, tt[i0 + n - 1][0] + P) - tt[i0][0]
            xT, x = resident if len(chunks) == 1 else [_cols(hT, c0, cn, dt), _rows(h, c0, cn, dt)]
            dl = nl.ndarray((P, n, vw), dtype=dt, buffer=nl.sbuf)
            inner = []
            for i in range(n):
                t0, tw = tt[i0 + i]
                col = i0 + i
                ps = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.psum)
                _logits(ps, xT, t0 - c0, tw, w_sb, 0, vw, H)
                e = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=e, op=nl.exp, data=ps, bias=neg[0:tw, col:col + 1])
                hs = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)  # scale * onehot
                nisa.tensor_scalar(dst=hs, data=vid[0:tw, :], op0=nl.equal, operand0=lab[0:tw, col:col + 1],
                                   op1=nl.multiply, operand1=sc[0:tw, col:col + 1])
                nisa.scalar_tensor_tensor(dst=dl[0:tw, i, :], data=e, op0=nl.multiply, operand0=sc[0:tw, col:col + 1],
                                          op1=nl.subtract, operand1=hs)
                inner.append((i, tw))
            if ci == len(chunks) - 1 and gi + 1 < len(groups):  # the next group's columns ahead of the stores
                w_next = _cols(wT, groups[gi + 1][0][0], groups[gi + 1][0][1], dt)
            for si in range(len(subs)):
                s0, sw = subs[si]
                banks = _banks(sw, H)
                _sum_products(banks, dl, s0, sw, x, inner)
                if len(chunks) == 1:
                    out = nl.ndarray((sw, H), dtype=nl.float32, buffer=nl.sbuf)
                    _leave_psum(out, banks, False)
                    _store(grad_w, scratch, v0 + s0, out, masked)
                else:
                    _leave_psum(acc[si], banks, ci > 0)
                    if ci == len(chunks) - 1:
                        _store(grad_w, scratch, v0 + s0, acc[si], masked)


def _hidden_group(hT, lse, scale, labels, t0, tw, dt):
    """A grad_hidden token group's operands: its hidden columns ``[128, nH, tw]``, ``lse`` as a broadcast row,
    and per 128-token tile (column i) its labels and loss scales."""
    n = cdiv(tw, P)
    g = {"x": _cols(hT, t0, tw, dt), "lse": _row(lse, t0, tw, P),
         "lab": nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf),
         "scale": nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)}
    for key, src in (("lab", labels), ("scale", scale)):
        for i in range(n):
            sw = min(P, tw - i * P)
            nisa.dma_copy(dst=g[key][0:sw, i:i + 1], src=src.ap(pattern=[[1, sw], [1, 1]], offset=t0 + i * P))
    return g


def _grad_hidden(hT, wT, w, grad_h, scratch, lse, scale, labels, n_prog, pid):
    """grad_hidden: groups of up to 512 tokens; the vocabulary on partitions, summed over vocabulary chunks."""
    H, T = hT.shape
    V = wT.shape[1]
    dt = hT.dtype
    isz = 4 if dt == nl.float32 else 2
    vt = _tiles(V, P)
    # held besides a chunk: the accumulators, two groups' hidden columns and lse rows, a gathered row tile
    held = 4 * H * 4 + 2 * (cdiv(H, P) * WIDE * isz + WIDE * 4) + H * isz + 2 * WIDE * 4
    chunks = _chunks(len(vt), (cdiv(H, P) * P + H + WIDE) * isz, min(CHUNK_BYTES, SBUF_BYTES - held))
    groups = _group_share(T, WIDE, n_prog, pid)
    nxt = _hidden_group(hT, lse, scale, labels, groups[0][0][0], groups[0][0][1], dt)
    for gi in range(len(groups)):
        (t0, tw), masked = groups[gi]
        g = nxt
        subs = _tiles(tw, P)
        acc = []
        for s0, sw in subs:
            acc.append(nl.ndarray((sw, H), dtype=nl.float32, buffer=nl.sbuf))
        for ci in range(len(chunks)):
            i0, n = chunks[ci]
            c0, cn = vt[i0][0], min(V, vt[i0 + n - 1][0] + P) - vt[i0][0]
            wT_c, w_c = _cols(wT, c0, cn, dt), _rows(w, c0, cn, dt)
            if ci == len(chunks) - 1 and gi + 1 < len(groups):  # the next group's operands ahead of the stores
                nxt = _hidden_group(hT, lse, scale, labels, groups[gi + 1][0][0], groups[gi + 1][0][1], dt)
            pT = nl.ndarray((P, n, tw), dtype=dt, buffer=nl.sbuf)  # exp(logits - lse), vocabulary on partitions
            inner = []
            for i in range(n):
                v0, vw = vt[i0 + i]
                ps = nl.ndarray((vw, tw), dtype=nl.float32, buffer=nl.psum)
                _logits(ps, wT_c, v0 - c0, vw, g["x"], 0, tw, H)
                x = nl.ndarray((vw, tw), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=x, data1=ps, data2=g["lse"][0:vw, :], op=nl.subtract)
                nisa.activation(dst=pT[0:vw, i, :], op=nl.exp, data=x)
                inner.append((i, vw))
            for si in range(len(subs)):
                s0, sw = subs[si]
                banks = _banks(sw, H)
                _sum_products(banks, pT, s0, sw, w_c, inner)
                _leave_psum(acc[si], banks, ci > 0)
        for si in range(len(subs)):
            s0, sw = subs[si]
            nisa.tensor_tensor(dst=acc[si], data1=acc[si], data2=_label_rows(w, g["lab"][0:sw, si:si + 1], sw, dt),
                               op=nl.subtract)
            nisa.activation(dst=acc[si], op=nl.copy, data=acc[si], scale=g["scale"][0:sw, si:si + 1])
            _store(grad_h, scratch, t0 + s0, acc[si], masked)


@nki.jit
def lce_bwd_kernel(hT, h, wT, w, labels, lse, scale):
    """``(grad_h [T, H] f32, grad_w [V, H] f32)``: ``hT [H, T]``, ``h [T, H]``, ``wT [H, V]``, ``w [V, H]``,
    ``labels`` / ``lse`` / ``scale`` ``[T]`` fp32 (``scale`` = d loss / d loss_t, 0 for ignored tokens)."""
    H, T = hT.shape
    V = wT.shape[1]
    n_prog = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if nl.program_ndim() > 0 else 0
    grad_h = nl.ndarray((T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    grad_w = nl.ndarray((V, H), dtype=nl.float32, buffer=nl.shared_hbm)
    scratch = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.shared_hbm)  # masked tiles' results
    _grad_hidden(hT, wT, w, grad_h, scratch, lse, scale, labels, n_prog, pid)
    _grad_weight(hT, h, wT, grad_w, scratch, lse, scale, labels, n_prog, pid)
    return grad_h, grad_w
