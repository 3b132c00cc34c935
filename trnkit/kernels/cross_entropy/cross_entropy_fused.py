"""Fused linear cross-entropy, the one-pass schedule (``lce_fused_kernel``): the loss, the log-sum-exp and
both gradients at a loss gradient of 1 in one launch, from one computation of each logits tile (``6 T H V``
matmul FLOPs: the lm_head's and the two gradient matmuls, as a backward that reads stored logits does).

The gradient of a logit needs its token's final log-sum-exp, known only after the whole vocabulary row.
So the kernel works per group of token tiles (``T_g <= 1,024`` tokens, both programs on the same group):

* **pass A** (the forward): per 512-column vocabulary tile, the logits ``[128 t, 512 v]`` in one fp32 PSUM
  bank per token tile; the Vector engine takes the negated running row max ``-m_k``, the Scalar engine
  ``e = exp(logits - m_k)`` with its row sum (as :func:`~.cross_entropy.lce_fwd_kernel`), and ``e``, rounded
  to the operands' dtype (values in ``(0, 1]``), goes to an HBM scratch of the group's ``[T_g, V]``
  (per program: its vocabulary tiles). At the group's end ``lse = m + ln(sum_k s_k exp(m_k - m))``; with
  LNC=2 (the vocabulary split between the programs) each program's ``(m, s)`` goes through a shared
  scratch and one ``core_barrier`` per group. ``loss = lse - h[t] . w[label[t]]`` (the rows gathered by
  label, products on GpSimd), and per (token, vocabulary tile) the factor ``c = scale * exp(m_k - lse)``.
* **pass B** (the gradients, no logits recomputed): per vocabulary tile, its ``e`` read back and
  ``dl = e * c - scale * onehot`` rounded to the operands' dtype (one Vector pass over the ``onehot``
  product made on the Vector engine); ``grad_hidden`` of the group's tokens summed in fp32 SBUF
  accumulators over the whole vocabulary (``dl`` transposed on TensorE as in the recompute backward, then
  ``dl @ w`` per token tile, summed over the tile's four 128-row pieces in PSUM); ``grad_weight`` of the
  tile's 512 rows, ``dl.T @ h`` summed over the group's token tiles in PSUM, added to the fp32 ``grad_weight``
  in HBM (read, added on leaving PSUM, written; the first group writes it). When SBUF cannot hold the
  accumulators of a full group, pass B runs over column pieces of H (``e`` read once per piece, ``dl``
  formed again: Vector work for fewer ``grad_weight`` round trips through HBM).

HBM holds no ``[T, V]`` tensor: the exp scratch is the group's ``T_g x V`` (``n_prog x n_tiles x 128 x 512``
elements), at most ``1,024 x V`` in the operands' dtype whatever T is, written and read back once per piece.
The gradients come out in fp32 (``grad_hidden`` one partial per program, which the host adds); the caller
scales them by the loss gradient.
"""

from __future__ import annotations

from trnkit.kernels._common import P_MAX, cdiv
from trnkit.kernels.cross_entropy.cross_entropy import (
    HB,
    SBUF_BYTES,
    WIDE,
    _banks,
    _cols,
    _leave_psum,
    _logits,
    _max_exp,
    _share,
    _stat_cols,
    _store_stats,
    _sum_products,
    _target_products,
    _tiles,
    _transposed,
)
from trnkit.nki_api import nisa, nki, nl

P = P_MAX
GROUP_MAX = 8  # token tiles per group at most (1,024 tokens)
PIECES_MAX = 3  # column pieces of H in pass B at most


def _last_step_bytes(T, H, n, hw, isz):
    """SBUF per partition live during pass B's last step when a next group's first operands load there
    (:func:`_pass_a`'s, loaded ahead by :func:`_pass_b`): the last H piece's h rows and fp32 grad_hidden
    columns, the step's ``dl`` and weight rows, and the next group's ``hT`` columns and first ``wT`` tile. 0
    for a single group."""
    if T <= n * P:
        return 0
    cw = H - (cdiv(H, hw) - 1) * hw  # the last column piece
    ahead = cdiv(H, P) * (min(n * P, T - n * P) + WIDE) * isz
    return n * cw * (4 + isz) + n * WIDE * isz + (WIDE // P) * cw * isz + ahead


def plan(T, H, V, isz, n_prog):
    """``(token tiles per group, column pieces of H in pass B)``: of the sizes whose pass B fits
    ``SBUF_BYTES`` per partition, the one with the least estimated HBM traffic per program (``grad_weight``'s
    fp32 round trips, the weights' two layouts per group, the exp scratch written once and read once per
    piece)."""
    nv = cdiv(cdiv(V, WIDE), n_prog)
    vc = nv * WIDE
    best = None
    for hp in range(1, PIECES_MAX + 1):
        hw = cdiv(cdiv(H, HB), hp) * HB
        # per token tile: grad_hidden accumulators (fp32), h rows, e and dl (twice, the next ahead), and the
        # (token, vocabulary tile) statistics (-m_k, s_k, c)
        per_tile = hw * 4 + hw * isz + 3 * WIDE * isz + 3 * nv * 4
        # held: the step's weight rows (this step's and the next's, loaded ahead), two 128-row pieces of
        # grad_weight in and out of PSUM, the onehot product and vocabulary indices
        held = 2 * (WIDE // P) * hw * isz + 2 * hw * 4 + 3 * WIDE * 4
        n = min(GROUP_MAX, cdiv(T, P), (SBUF_BYTES - held) // per_tile)
        while n > 1 and _last_step_bytes(T, H, n, hw, isz) > SBUF_BYTES:
            n -= 1
        if n < 1:
            continue
        g = cdiv(T, n * P)
        traffic = (2 * g - 1) * vc * H * 4 + 2 * g * vc * H * isz + T * vc * isz * (1 + hp)
        if best is None or traffic < best[0]:
            best = (traffic, n, hp)
    return best[1], best[2]


def _masks(V, n_prog, pid):
    """``(this program's vocabulary tiles [((v0, vw), masked)], positions masked on some program)``: at a
    position masked on another program this one runs the same instructions with other immediates."""
    vt = _share(V, WIDE, n_prog, pid)
    any_masked = []
    for k in range(len(vt)):
        m = False
        for q in range(n_prog):
            m = m or _share(V, WIDE, n_prog, q)[k][1]
        any_masked.append(m)
    return vt, any_masked


def _first_operands(hT, wT, vt, t0, gw, dt):
    """A group's first pass-A operands ``[its hT columns, the first vocabulary tile's wT columns]``."""
    return [_cols(hT, t0, gw, dt), _cols(wT, vt[0][0][0], vt[0][0][1], dt)]


def _pass_a(hT, h, wT, w, labels, e_scr, vt, any_masked, t0, subs, first, pid, dt):
    """Pass A of the group of token tiles ``subs`` (``[(offset, size)]`` from ``t0``): ``(negm [P, n, nv]``
    (the running ``-m_k``), ``es [P, n, nv]`` (``sum exp(logits - m_k)``, 0 at a masked tile), ``tgt [P, n]``
    (the target logits))``; ``e`` per (token tile, vocabulary tile) to ``e_scr[pid, k, :, j, :]``. ``first``:
    :func:`_first_operands`, loaded ahead by the caller; each tile's weight columns are loaded one tile
    ahead, before this tile's stores (a DMA queue runs its transfers in order)."""
    H = hT.shape[0]
    n, nv = len(subs), len(vt)
    x_sb, w_next = first
    negm = nl.ndarray((P, n, nv), dtype=nl.float32, buffer=nl.sbuf)
    es = nl.ndarray((P, n, nv), dtype=nl.float32, buffer=nl.sbuf)
    tgt = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)
    for k in range(nv):
        (v0, vw), masked = vt[k]
        w_sb = w_next
        if k + 1 < nv:
            w_next = _cols(wT, vt[k + 1][0][0], vt[k + 1][0][1], dt)
        for j in range(n):
            s0, tw = subs[j]
            ps = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.psum)
            _logits(ps, x_sb, s0, tw, w_sb, 0, vw, H)
            e = nl.ndarray((tw, vw), dtype=dt, buffer=nl.sbuf)
            esc = es[0:tw, j, k:k + 1]
            _max_exp(ps, e, negm[0:tw, j, :], esc, k)
            if any_masked[k]:  # another program's tile computed again: it adds nothing to this one's sum
                nisa.tensor_scalar(dst=esc, data=esc, op0=nl.multiply, operand0=0.0 if masked else 1.0)
            nisa.dma_copy(dst=e_scr[pid, k, 0:tw, j, 0:vw], src=e)
        for j in range(k, n, nv):  # the target logits spread over the loop (GpSimd, otherwise idle)
            s0, tw = subs[j]
            lab = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=lab, src=labels.ap(pattern=[[1, tw], [1, 1]], offset=t0 + s0))
            prod = _target_products(h, w, t0 + s0, tw, lab, dt)
            nisa.tensor_reduce(dst=tgt[0:tw, j:j + 1], op=nl.add, data=prod, axis=1)
    return negm, es, tgt


def _finish(negm, es, tgt, stat_scr, gi, subs, n_prog, pid):
    """``out [P, n, 2] = [lse | loss]`` of the group's token tiles from each program's running max and
    rescaled sums (exchanged through ``stat_scr`` and one barrier when there are two programs)."""
    n, nv = len(subs), negm.shape[2]
    part = nl.ndarray((P, n, 2), dtype=nl.float32, buffer=nl.sbuf)  # [-m | s] of this program's tiles
    for j in range(n):
        tw = subs[j][1]
        last = negm[0:tw, j, nv - 1:nv]
        corr = nl.ndarray((tw, nv), dtype=nl.float32, buffer=nl.sbuf)  # s_k * exp(m_k - m)
        nisa.activation(dst=corr, op=nl.exp, data=negm[0:tw, j, :], bias=last, scale=-1.0)
        nisa.tensor_tensor(dst=corr, data1=corr, data2=es[0:tw, j, :], op=nl.multiply)
        nisa.tensor_reduce(dst=part[0:tw, j, 1:2], op=nl.add, data=corr, axis=1)
        nisa.tensor_copy(dst=part[0:tw, j, 0:1], src=last)
    if n_prog > 1:
        nt = stat_scr.shape[3]
        base = gi * n_prog * P * nt * 2
        for j in range(n):
            tw = subs[j][1]
            nisa.dma_copy(dst=stat_scr.ap(pattern=[[nt * 2, tw], [1, 2]], offset=base + pid * P * nt * 2 + j * 2),
                          src=part[0:tw, j, :])
        nisa.core_barrier(stat_scr, (0, 1))
    out = nl.ndarray((P, n, 2), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(n):
        tw = subs[j][1]
        if n_prog > 1:
            o = nl.ndarray((tw, n_prog, 2), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=o, src=stat_scr.ap(pattern=[[nt * 2, tw], [P * nt * 2, n_prog], [1, 2]],
                                                 offset=base + j * 2))
        else:
            o = part[0:tw, j:j + 1, :]
        nm = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)  # -m over the programs
        nisa.tensor_reduce(dst=nm, op=nl.minimum, data=o[:, :, 0], axis=1)
        f = nl.ndarray((tw, n_prog), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=f, op=nl.exp, data=o[:, :, 0], bias=nm, scale=-1.0)
        nisa.tensor_tensor(dst=f, data1=f, data2=o[:, :, 1], op=nl.multiply)
        s = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s, op=nl.add, data=f, axis=1)
        nisa.activation(dst=out[0:tw, j, 0:1], op=nl.log, data=s)
        nisa.tensor_tensor(dst=out[0:tw, j, 0:1], data1=out[0:tw, j, 0:1], data2=nm, op=nl.subtract)
        nisa.tensor_tensor(dst=out[0:tw, j, 1:2], data1=out[0:tw, j, 0:1], data2=tgt[0:tw, j:j + 1], op=nl.subtract)
    return out


def _factors(negm, out, sc, col0, subs, any_masked, vt):
    """``c [P, n, nv] = scale * exp(m_k - lse)`` per (token, vocabulary tile), 0 at a masked tile."""
    n, nv = len(subs), negm.shape[2]
    c = nl.ndarray((P, n, nv), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(n):
        tw = subs[j][1]
        nlse = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=nlse, data=out[0:tw, j, 0:1], op0=nl.multiply, operand0=-1.0)
        nisa.activation(dst=c[0:tw, j, :], op=nl.exp, data=negm[0:tw, j, :], bias=nlse, scale=-1.0)
        nisa.tensor_scalar(dst=c[0:tw, j, :], data=c[0:tw, j, :], op0=nl.multiply,
                           operand0=sc[0:tw, col0 + j:col0 + j + 1])
        for k in range(nv):
            if any_masked[k]:
                nisa.tensor_scalar(dst=c[0:tw, j, k:k + 1], data=c[0:tw, j, k:k + 1], op0=nl.multiply,
                                   operand0=0.0 if vt[k][1] else 1.0)
    return c


def _row_piece(src, r0, n, c0, cw, dtype):
    """SBUF ``[128, ceil(n/128), cw]``: rows ``r0:r0+n``, columns ``c0:c0+cw`` of ``src [N, H]``, row
    ``r0 + i*128 + p`` at ``[p, i]`` (the full tiles in one DMA)."""
    H = src.shape[1]
    nt, nfull = cdiv(n, P), n // P
    t = nl.ndarray((P, nt, cw), dtype=dtype, buffer=nl.sbuf)
    if nfull > 0:
        nisa.dma_copy(dst=t[:, 0:nfull, :], src=src.ap(pattern=[[H, P], [P * H, nfull], [1, cw]],
                                                       offset=r0 * H + c0))
    if nfull < nt:
        nisa.dma_copy(dst=t[0:n - nfull * P, nfull, :], src=src[r0 + nfull * P:r0 + n, c0:c0 + cw])
    return t


def _b_loads(h, w, e_scr, grad_w, gw_scr, vt, item, gi, t0, subs, pid, dt):
    """One pass-B step's loads ``[w rows, e, h rows of the piece (its first step only)]`` for ``item =
    (c0, cw, k, first)``."""
    c0, cw, k, first = item
    (v0, vw), masked = vt[k]
    n = len(subs)
    gw = subs[n - 1][0] + subs[n - 1][1]
    nfull = gw // P
    w_rows = _row_piece(w, v0, vw, c0, cw, dt)
    eb = nl.ndarray((P, n, WIDE), dtype=dt, buffer=nl.sbuf)
    if nfull > 0:
        nisa.dma_copy(dst=eb[:, 0:nfull, 0:vw], src=e_scr[pid, k, :, 0:nfull, 0:vw])
    if nfull < n:
        tw = subs[n - 1][1]
        nisa.dma_copy(dst=eb[0:tw, n - 1, 0:vw], src=e_scr[pid, k, 0:tw, n - 1, 0:vw])
    x = _row_piece(h, t0, gw, c0, cw, dt) if first else None
    return [w_rows, eb, x]


def _gw_rows(grad_w, gw_scr, v0, s0, sw, c0, cw, masked, gi):
    """SBUF ``[sw, cw]`` fp32 for a vocabulary piece's grad_weight columns: their sum so far read back (none
    for the first group, which writes them)."""
    g = nl.ndarray((sw, cw), dtype=nl.float32, buffer=nl.sbuf)
    if gi > 0:
        nisa.dma_copy(dst=g, src=_gw_dst(grad_w, gw_scr, v0 + s0, sw, c0, cw, masked))
    return g


def _gw_dst(grad_w, gw_scr, r0, rows, c0, cw, masked):
    """Where a vocabulary piece's grad_weight columns live: ``grad_w`` (a masked tile's: the scratch)."""
    if masked:
        return gw_scr[0:rows, c0:c0 + cw]
    return grad_w[r0:r0 + rows, c0:c0 + cw]


def _form_dl(eb, c, k, vt, sc, zero, lab, col0, subs, dt):
    """``dl [P, n, 512] = e * c - scale * onehot`` of vocabulary tile ``k`` for the group's token tiles,
    rounded to ``dt`` (a masked tile: scale 0 and c 0, so dl = 0)."""
    (v0, vw), masked = vt[k]
    n = len(subs)
    vid = nl.ndarray((P, vw), dtype=nl.float32, buffer=nl.sbuf)  # vocabulary index of each column
    nisa.iota(dst=vid, pattern=[[1, vw]], offset=v0, channel_multiplier=0)
    gsc = zero if masked else sc  # a masked tile (another program's): no onehot term either
    dl = nl.ndarray((P, n, WIDE), dtype=dt, buffer=nl.sbuf)
    for j in range(n):
        tw = subs[j][1]
        col = col0 + j
        hs = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)  # scale * onehot
        nisa.tensor_scalar(dst=hs, data=vid[0:tw, :], op0=nl.equal, operand0=lab[0:tw, col:col + 1],
                           op1=nl.multiply, operand1=gsc[0:tw, col:col + 1])
        nisa.scalar_tensor_tensor(dst=dl[0:tw, j, 0:vw], data=eb[0:tw, j, 0:vw], op0=nl.multiply,
                                  operand0=c[0:tw, j, k:k + 1], op1=nl.subtract, operand1=hs)
    return dl


def _pass_b(h, w, e_scr, c, sc, zero, lab, vt, gh_part, grad_w, gw_scr, gi, t0, col0, subs, pieces, pid, dt,
            next_group):
    """Pass B of a group: both gradients from the stored ``e`` (see the module doc). Written in the order the
    engines should run it, since each runs its instructions in program order: each step's loads one step
    ahead (before this step's stores), and the next group's first operands (``next_group = (hT, wT, (t0,
    size))``, None after the last group) with the last step's, which this returns; the next step's ``dl``
    formed (Vector) before this step's grad_weight sums leave PSUM; each token tile's transposes one tile
    ahead of its grad_hidden matmuls (TensorE never waits on the Scalar engine's copy out of PSUM)."""
    n, nv = len(subs), len(vt)
    inner = []
    for j in range(n):
        inner.append((j, subs[j][1]))
    items = []
    for c0, cw in pieces:
        for k in range(nv):
            items.append((c0, cw, k, k == 0))
    nxt = _b_loads(h, w, e_scr, grad_w, gw_scr, vt, items[0], gi, t0, subs, pid, dt)
    dl_next = _form_dl(nxt[1], c, 0, vt, sc, zero, lab, col0, subs, dt)
    ahead = None
    for it in range(len(items)):
        c0, cw, k, first = items[it]
        (v0, vw), masked = vt[k]
        w_rows, eb, xk = nxt
        dl = dl_next
        vsubs = _tiles(vw, P)
        old = _gw_rows(grad_w, gw_scr, v0, vsubs[0][0], vsubs[0][1], c0, cw, masked, gi)
        if first:
            x = xk
            acc = nl.ndarray((P, n, cw), dtype=nl.float32, buffer=nl.sbuf)  # the group's grad_hidden columns
        if it + 1 < len(items):
            nxt = _b_loads(h, w, e_scr, grad_w, gw_scr, vt, items[it + 1], gi, t0, subs, pid, dt)
        elif next_group != None:  # noqa: E711 (the NKI compiler rejects `is`)
            hT, wT, (g0, gw) = next_group
            ahead = _first_operands(hT, wT, vt, g0, gw, dt)
        vtiles = []
        for si in range(len(vsubs)):
            vtiles.append((si, vsubs[si][1]))
        dlT_next = _transposed(dl, 0, subs[0][1], vsubs, dt)
        for j in range(n):
            tw = subs[j][1]
            dlT = dlT_next
            if j + 1 < n:
                dlT_next = _transposed(dl, j + 1, subs[j + 1][1], vsubs, dt)
            banks = _banks(tw, cw)
            _sum_products(banks, dlT, 0, tw, w_rows, vtiles)
            _leave_psum(acc[0:tw, j, :], banks, k > 0)
        if it + 1 < len(items):
            dl_next = _form_dl(nxt[1], c, items[it + 1][2], vt, sc, zero, lab, col0, subs, dt)
        for si in range(len(vsubs)):
            s0, sw = vsubs[si]
            banks = _banks(sw, cw)
            _sum_products(banks, dl, s0, sw, x, inner)
            g = old
            if si + 1 < len(vsubs):  # the next piece's rows ahead of this one's store
                old = _gw_rows(grad_w, gw_scr, v0, vsubs[si + 1][0], vsubs[si + 1][1], c0, cw, masked, gi)
            _leave_psum(g, banks, gi > 0)
            nisa.dma_copy(dst=_gw_dst(grad_w, gw_scr, v0 + s0, sw, c0, cw, masked), src=g)
        if k == nv - 1:
            for j in range(n):
                s0, tw = subs[j]
                nisa.dma_copy(dst=gh_part[pid, t0 + s0:t0 + s0 + tw, c0:c0 + cw], src=acc[0:tw, j, :])
    return ahead


@nki.jit
def lce_fused_kernel(hT, h, wT, w, labels, scale):
    """``(loss [T] f32, lse [T] f32, grad_h [programs, T, H] f32, grad_w [V, H] f32)``: ``hT [H, T]``, ``h [T, H]``,
    ``wT [H, V]``, ``w [V, H]``, ``labels`` / ``scale`` ``[T]`` fp32 (a vocabulary index or -1; ``scale`` = d
    loss / d loss_t at a loss gradient of 1, 0 for ignored tokens). grad_hidden comes as one partial sum per
    program (its vocabulary tiles' part); the host adds them."""
    H, T = hT.shape
    V = wT.shape[1]
    dt = hT.dtype
    isz = 4 if dt == nl.float32 else 2
    n_prog = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if nl.program_ndim() > 0 else 0
    loss = nl.ndarray((T,), dtype=nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((T,), dtype=nl.float32, buffer=nl.shared_hbm)
    gh_part = nl.ndarray((n_prog, T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    grad_w = nl.ndarray((V, H), dtype=nl.float32, buffer=nl.shared_hbm)
    stat_out = nl.ndarray((2 * P,), dtype=nl.float32, buffer=nl.shared_hbm)  # a second program's [lse | loss]
    gw_scr = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.shared_hbm)  # masked tiles' grad_weight
    vt, any_masked = _masks(V, n_prog, pid)
    nt, hp = plan(T, H, V, isz, n_prog)
    groups = _tiles(T, nt * P)
    e_scr = nl.ndarray((n_prog, len(vt), P, nt, WIDE), dtype=dt, buffer=nl.shared_hbm)
    stat_scr = nl.ndarray((len(groups), n_prog, P, nt, 2), dtype=nl.float32, buffer=nl.shared_hbm)
    pieces = _tiles(H, cdiv(cdiv(H, HB), hp) * HB)
    sc = _stat_cols(scale, T)
    lab = _stat_cols(labels, T)
    zero = nl.ndarray((P, cdiv(T, P)), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    first = _first_operands(hT, wT, vt, groups[0][0], groups[0][1], dt)
    for gi in range(len(groups)):
        t0, gw = groups[gi]
        subs = _tiles(gw, P)
        col0 = t0 // P
        negm, es, tgt = _pass_a(hT, h, wT, w, labels, e_scr, vt, any_masked, t0, subs, first, pid, dt)
        out = _finish(negm, es, tgt, stat_scr, gi, subs, n_prog, pid)
        _store_stats(loss, lse, stat_out, t0, gw, out, pid > 0)
        c = _factors(negm, out, sc, col0, subs, any_masked, vt)
        next_group = None
        if gi + 1 < len(groups):
            next_group = (hT, wT, groups[gi + 1])
        first = _pass_b(h, w, e_scr, c, sc, zero, lab, vt, gh_part, grad_w, gw_scr, gi, t0, col0, subs, pieces,
                        pid, dt, next_group)
    return loss, lse, gh_part, grad_w
