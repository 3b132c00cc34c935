"""Fused linear cross-entropy NKI kernels: ``lce_fwd_kernel`` (loss and log-sum-exp per token) and
``lce_bwd_kernel`` (grad_weight, and grad_hidden as one partial sum per program), both without a ``[T, V]``
tensor in HBM.

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
gradient per token, 0 for ignored tokens), rounded to the operands' dtype as the reference rounds it. Each
logits tile is computed once and gives both gradients (3 matmul passes over ``T x V x H``, ``6 T H V``
FLOPs, against 2 for a backward that stored the logits: the price of no ``[T, V]`` buffer). Per group of
512 vocabulary rows (the groups split between the programs), with the group's ``wT`` columns and ``w``
rows in SBUF, per chunk of token tiles (``hT`` columns and ``h`` rows, the next chunk's loaded ahead):

* logits ``[128 t, 512 v]`` per token tile; Scalar: ``exp`` with the per-token ``-lse`` bias; Vector:
  ``e * scale - scale * onehot`` into ``dl`` (tokens on partitions);
* grad_hidden: per token tile, ``dl`` transposed on TensorE (four ``[128, 128]`` transposes, copied out on
  the Scalar engine: the vocabulary on partitions), then ``dl^T[:, j].T @ w[j, :]`` summed in PSUM over the
  group's four 128-row vocabulary tiles j, added on leaving PSUM into this program's fp32 grad_hidden
  partial in HBM (read back at the chunk's start; the program's first group writes it). With the
  vocabulary split between the programs each has its own partial; the host adds them.
* grad_weight: per 128-row vocabulary tile, ``dl[:, tile].T @ h[t, :]`` summed in PSUM over the chunk's
  token tiles and into the group's fp32 SBUF accumulator over the chunks, stored after the last chunk.

Both gradients are summed in PSUM in a matmul accumulation group of ``ceil(H / 512)`` banks per 128-row
output tile (at most 6 banks next to the logits). What binds, besides TensorE: HBM traffic, since every
group re-reads all tokens' ``h`` (both layouts) and reads and writes the grad_hidden partial (about
``(4 + 8) T H`` bytes per 512 vocabulary rows); SBUF (the accumulators of 512 rows and the group's weights
hold about 80 KiB per partition at H = 2,560 in bf16), which caps the group at 512 rows and the chunk at
a few token tiles. A program short of a group (LNC=2 with an odd count) computes a masked copy of
another program's group with the loss scales set to 0 (so it adds nothing to its grad_hidden partial)
and stores its grad_weight to a scratch tensor: both programs run the same instruction stream.
"""

from __future__ import annotations

from trnkit.kernels._common import P_MAX, cdiv, program_share
from trnkit.kernels.tiles import accumulate, psum_tiles
from trnkit.nki_api import nisa, nki, nl

P = P_MAX
WIDE = 512  # vocabulary columns of a logits tile (one fp32 PSUM bank); the backward's vocabulary group
HB = 512  # hidden columns per gradient PSUM bank
FWD_GROUP = 8  # forward: token tiles sharing each load of WIDE weight columns
# SBUF bytes per partition the backward holds at once, at most (of the 208 KiB a kernel may allocate)
SBUF_BYTES = 200 * 1024


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


def _max_exp(ps, e, negm_row, es_col, k):
    """One logits tile ``ps`` of vocabulary tile ``k``: ``negm_row[:, k]`` = ``-max`` of its rows, running over
    tiles ``0..k`` (``negm_row[:, k - 1]`` the previous), and ``e = exp(ps - m_k)`` with its row sum into ``es_col``."""
    col = negm_row[:, k:k + 1]
    nisa.tensor_reduce(dst=col, op=nl.maximum, data=ps, axis=1, negate=True)
    if k > 0:
        nisa.tensor_tensor(dst=col, data1=col, data2=negm_row[:, k - 1:k], op=nl.minimum)
    nisa.activation_reduce(dst=e, op=nl.exp, data=ps, reduce_op=nl.add, reduce_res=es_col, bias=col)


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
                e = nl.ndarray((tw, vw), dtype=dt, buffer=nl.sbuf)  # only its row sum is kept
                _max_exp(ps, e, negm[0:tw, j, :], es[0:tw, j, k:k + 1], k)
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


def _grad_both(hT, h, wT, w, gh_part, grad_w, scratch, lse, scale, labels, n_prog, pid):
    """Both gradients from each logits tile: groups of 512 vocabulary rows (split between the programs); per
    chunk of token tiles, ``dl [t, v]`` gives grad_weight (summed over the chunk's tokens in PSUM, over the
    chunks in an fp32 SBUF accumulator) and, transposed on TensorE, this group's part of grad_hidden per
    token tile (summed over the group's 128-row vocabulary tiles in PSUM), added into this program's
    grad_hidden partial in HBM (read back, added on leaving PSUM, stored; the group a program starts with
    writes it)."""
    H, T = hT.shape
    V = wT.shape[1]
    dt = hT.dtype
    isz = 4 if dt == nl.float32 else 2
    nw = WIDE // P
    tt = _tiles(T, P)
    # per token tile of a chunk: both layouts, dl and dl^T, its grad_hidden partial (fp32)
    # per token tile of a chunk: both layouts twice (the next chunk's loaded ahead), dl and dl^T, its
    # grad_hidden partial (fp32)
    per_tile = 2 * (cdiv(H, P) * P + H) * isz + 2 * WIDE * isz + H * 4
    # held besides the chunks: grad_weight's accumulators, the group's weight columns and rows, stats,
    # e / onehot tiles
    held = (nw * H + 4 * len(tt)) * 4 + (cdiv(H, P) * WIDE + nw * H) * isz + 3 * WIDE * 4
    chunks = _chunks(len(tt), per_tile, SBUF_BYTES - held)
    neg = _stat_cols(lse, T)
    nisa.tensor_scalar(dst=neg, data=neg, op0=nl.multiply, operand0=-1.0)
    sc = _stat_cols(scale, T)
    zero = nl.ndarray((P, len(tt)), dtype=nl.float32, buffer=nl.sbuf)  # a masked group's loss scales
    nisa.memset(dst=zero, value=0.0)
    lab = _stat_cols(labels, T)
    groups = _share(V, WIDE, n_prog, pid)
    x_next = _chunk_operands(hT, h, tt, chunks[0], dt)
    for gi in range(len(groups)):
        (v0, vw), masked = groups[gi]
        w_sb, w_rows = _cols(wT, v0, vw, dt), _rows(w, v0, vw, dt)
        # a masked group (another program's) adds nothing to this program's grad_hidden: scale 0, dl = 0
        gsc = zero if masked else sc
        vid = nl.ndarray((P, vw), dtype=nl.float32, buffer=nl.sbuf)  # vocabulary index of each column
        nisa.iota(dst=vid, pattern=[[1, vw]], offset=v0, channel_multiplier=0)
        subs = _tiles(vw, P)
        vtiles = []
        for j in range(len(subs)):
            vtiles.append((j, subs[j][1]))
        acc = []
        for s0, sw in subs:
            acc.append(nl.ndarray((sw, H), dtype=nl.float32, buffer=nl.sbuf))
        for ci in range(len(chunks)):
            i0, n = chunks[ci]
            c0 = tt[i0][0]
            xT, x = x_next
            parts = []  # this program's grad_hidden partial of the chunk's tokens, read back ahead of its sums
            for i in range(n):
                t0, tw = tt[i0 + i]
                parts.append(nl.ndarray((tw, H), dtype=nl.float32, buffer=nl.sbuf))
                if gi > 0:
                    nisa.dma_copy(dst=parts[i], src=gh_part[pid, t0:t0 + tw, :])
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
                                   op1=nl.multiply, operand1=gsc[0:tw, col:col + 1])
                nisa.scalar_tensor_tensor(dst=dl[0:tw, i, :], data=e, op0=nl.multiply, operand0=gsc[0:tw, col:col + 1],
                                          op1=nl.subtract, operand1=hs)
                inner.append((i, tw))
            if ci + 1 < len(chunks) or gi + 1 < len(groups):  # the next chunk's tokens ahead of the stores
                x_next = _chunk_operands(hT, h, tt, chunks[(ci + 1) % len(chunks)], dt)
            for i in range(n):
                t0, tw = tt[i0 + i]
                dlT = _transposed(dl, i, tw, subs, dt)
                banks = _banks(tw, H)
                _sum_products(banks, dlT, 0, tw, w_rows, vtiles)
                _leave_psum(parts[i], banks, gi > 0)
                nisa.dma_copy(dst=gh_part[pid, t0:t0 + tw, :], src=parts[i])
            for si in range(len(subs)):
                s0, sw = subs[si]
                banks = _banks(sw, H)
                _sum_products(banks, dl, s0, sw, x, inner)
                _leave_psum(acc[si], banks, ci > 0)
                if ci == len(chunks) - 1:
                    _store(grad_w, scratch, v0 + s0, acc[si], masked)


def _chunk_operands(hT, h, tt, chunk, dt):
    """A chunk ``(first, count)`` of token tiles in both layouts: ``[hT columns, h rows]``."""
    i0, n = chunk
    c0, cn = tt[i0][0], min(hT.shape[1], tt[i0 + n - 1][0] + P) - tt[i0][0]
    return [_cols(hT, c0, cn, dt), _rows(h, c0, cn, dt)]


def _transposed(dl, i, tw, subs, dt):
    """SBUF ``[128, len(subs), tw]``: ``dl[0:tw, i, :]`` with the vocabulary on partitions (vocabulary tile j
    at ``[:, j, :]``), by TensorE transposes into one PSUM tile, copied out on the Scalar engine."""
    nv = len(subs)
    ps = nl.ndarray((P, nv, tw), dtype=dt, buffer=nl.psum)
    for j in range(nv):
        s0, sw = subs[j]
        nisa.nc_transpose(dst=ps[0:sw, j, :], data=dl[0:tw, i, s0:s0 + sw])
    out = nl.ndarray((P, nv, tw), dtype=dt, buffer=nl.sbuf)
    nfull = nv if subs[nv - 1][1] == P else nv - 1
    if nfull > 0:
        nisa.activation(dst=out[:, 0:nfull, :], op=nl.copy, data=ps[:, 0:nfull, :])
    if nfull < nv:
        sw = subs[nv - 1][1]
        nisa.activation(dst=out[0:sw, nv - 1, :], op=nl.copy, data=ps[0:sw, nv - 1, :])
    return out


@nki.jit
def lce_bwd_kernel(hT, h, wT, w, labels, lse, scale):
    """``(grad_h [programs, T, H] f32, grad_w [V, H] f32)``: ``hT [H, T]``, ``h [T, H]``, ``wT [H, V]``, ``w [V, H]``,
    ``labels`` / ``lse`` / ``scale`` ``[T]`` fp32 (``scale`` = d loss / d loss_t, 0 for ignored tokens).
    grad_hidden comes as one partial sum per program (its vocabulary groups' part); the host adds them."""
    H, T = hT.shape
    V = wT.shape[1]
    n_prog = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if nl.program_ndim() > 0 else 0
    gh_part = nl.ndarray((n_prog, T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    grad_w = nl.ndarray((V, H), dtype=nl.float32, buffer=nl.shared_hbm)
    scratch = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.shared_hbm)  # masked tiles' results
    _grad_both(hT, h, wT, w, gh_part, grad_w, scratch, lse, scale, labels, n_prog, pid)
    return gh_part, grad_w
