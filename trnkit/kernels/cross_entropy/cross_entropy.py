"""Fused linear cross-entropy NKI kernels: ``lce_fwd_kernel`` (loss and log-sum-exp per token) and
``lce_bwd_kernel`` (grad_hidden and grad_weight), both without a ``[T, V]`` tensor in HBM.

The logits ``hidden @ weight.T`` exist only as fp32 PSUM tiles. Every matmul contracts over H on the
partitions, so the host hands the kernels both layouts of each operand: ``hT [H, T]`` and ``wT [H, V]``
(H leading: the logits' operands) and ``h [T, H]`` / ``w [V, H]`` (the gradients' moving operands).

Forward, per group of up to four tiles of 128 tokens (tokens on partitions), which share each weight
tile load: for each 512-column vocabulary tile each token tile's logits ``[128, 512]`` accumulate over
the 128-row chunks of H in one PSUM bank; the Vector engine takes the
tile's row max and the target logit (a one-hot mask of ``iota == label - v0`` times the logits, summed),
the Scalar engine ``exp(logits - m_new)`` summed along the row (``activation_reduce``), and the
running ``(m, s)`` pair is rescaled online. At the end ``lse = m + ln s``, ``loss = lse - target``.

Backward, ``dl[t, v] = scale[t] * (exp(logit - lse[t]) - [v == label[t]])`` (``scale`` = the loss
gradient per token, 0 for ignored tokens), rounded to the operands' dtype like the reference:

* ``grad_hidden [T, H]``: per group of up to four 128-token tiles, over 128-row vocabulary tiles (each
  loaded once for the group) the logits are recomputed transposed (``[128 v, 128 t]``, vocabulary on
  partitions, so ``dl^T`` is directly the stationary operand), and each ``dl^T.T @ w[v0:v0+128, :]`` is
  summed on the Tensor engine into PSUM banks of 512 columns (two vocabulary tiles per sum) and added
  on the Vector engine into an fp32 ``[128, H]`` accumulator in SBUF.
* ``grad_weight [V, H]``: per group of up to four 128-row vocabulary tiles, over 128-token tiles (each
  loaded once for the group) the logits are recomputed in the forward's layout (tokens on partitions)
  and ``dl.T @ h[t0:t0+128, :]`` is accumulated likewise.

The two passes recompute the logits once each (4 matmul passes over ``T x V x H`` in all, against 3
for a backward that stored the logits): the price of no ``[T, V]`` buffer. LNC=2 splits the token tiles
(forward, grad_hidden) and the vocabulary tiles (grad_weight) between the two cores with the same
instruction stream on both (``program_share``: a core short of a tile computes a masked copy into a
scratch tensor).
"""

from __future__ import annotations

from trnkit.kernels._common import P_MAX, cdiv, program_share
from trnkit.nki_api import nisa, nki, nl

P = P_MAX
VF = 512  # vocabulary columns per forward logits tile (one fp32 PSUM bank)
HB = 512  # hidden columns per gradient PSUM bank
NEG_BIG = -3.0e38  # the running max before the first tile
GROUP = 4  # tiles sharing each load of the other operand (forward: one PSUM bank of logits each)
PAIR = 2  # backward: outer tiles whose products are summed in PSUM before one add into SBUF


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


def _load_cols(src, c0, cw, H, dtype):
    """SBUF ``[128, nH, cw]``: columns ``c0:c0+cw`` of ``src [H, N]`` (H leading), chunk c = rows
    ``c*128 ...`` of H (a short last chunk leaves the tail partitions unused)."""
    nH = cdiv(H, P)
    t = nl.ndarray((P, nH, cw), dtype=dtype, buffer=nl.sbuf)
    for c in range(nH):
        hk = min(P, H - c * P)
        nisa.dma_copy(dst=t[0:hk, c, :], src=src[c * P:c * P + hk, c0:c0 + cw])
    return t


def _logits(ps, stat, mov, H):
    """``ps = stat[:, c, :].T @ mov[:, c, :]`` summed over the H chunks (fp32 PSUM)."""
    nH = cdiv(H, P)
    for c in range(nH):
        hk = min(P, H - c * P)
        nisa.nc_matmul(dst=ps, stationary=stat[0:hk, c, :], moving=mov[0:hk, c, :], accumulate=c > 0)


def _column(src, t0, tw):
    """SBUF ``[tw, 1]`` fp32: ``src[t0:t0+tw]`` (one value per partition)."""
    t = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src.ap(pattern=[[1, tw], [1, 1]], offset=t0))
    return t


def _row(src, t0, tw, rows):
    """SBUF ``[rows, tw]`` fp32: ``src[t0:t0+tw]`` on every partition (partition step 0)."""
    t = nl.ndarray((rows, tw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src.ap(pattern=[[0, rows], [1, tw]], offset=t0))
    return t


def _fwd_tile_stats(ps, st, iota, v0):
    """Fold one ``[tw, vw]`` PSUM logits tile into a token tile's running ``(m, s, target)``."""
    tw, vw = ps.shape
    # target logit: sum(logits * (iota == label - v0))
    rel = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rel, data=st["lab"], op0=nl.subtract, operand0=float(v0))
    hit = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hit, data=iota[0:tw, 0:vw], op0=nl.equal, operand0=rel)
    nisa.tensor_tensor(dst=hit, data1=hit, data2=ps, op=nl.multiply)
    part = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=part, op=nl.add, data=hit, axis=1)
    nisa.tensor_tensor(dst=st["tgt"], data1=st["tgt"], data2=part, op=nl.add)
    # online log-sum-exp: m_new = max(m, max_row), s = s * exp(m - m_new) + sum(exp(logits - m_new))
    mx = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=mx, op=nl.maximum, data=ps, axis=1)
    nisa.tensor_tensor(dst=mx, data1=mx, data2=st["m"], op=nl.maximum)
    neg = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg, data=mx, op0=nl.multiply, operand0=-1.0)
    e = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
    es = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=e, op=nl.exp, data=ps, reduce_op=nl.add, reduce_res=es, bias=neg)
    corr = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=corr, op=nl.exp, data=st["m"], bias=neg)
    nisa.tensor_tensor(dst=st["s"], data1=st["s"], data2=corr, op=nl.multiply)
    nisa.tensor_tensor(dst=st["s"], data1=st["s"], data2=es, op=nl.add)
    nisa.tensor_copy(dst=st["m"], src=mx)


@nki.jit
def lce_fwd_kernel(hT, wT, labels):
    """``(loss [T] f32, lse [T] f32)`` of ``hT [H, T]``, ``wT [H, V]``, ``labels [T]`` fp32 (a vocabulary
    index, or -1 for an ignored token: its loss is ``lse``, masked by the host)."""
    H, T = hT.shape
    V = wT.shape[1]
    n_prog = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if nl.program_ndim() > 0 else 0
    loss = nl.ndarray((T,), dtype=nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((T,), dtype=nl.float32, buffer=nl.shared_hbm)
    scratch = nl.ndarray((2, P), dtype=nl.float32, buffer=nl.shared_hbm)  # masked tiles' results
    iota = nl.ndarray((P, VF), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=iota, pattern=[[1, VF]], offset=0, channel_multiplier=0)
    mine = _share(T, P, n_prog, pid)
    for g0 in range(0, len(mine), GROUP):
        group = []  # the token tiles that share each weight tile: their hidden columns and running stats
        for (t0, tw), masked in mine[g0:g0 + GROUP]:
            st = {"t0": t0, "masked": masked, "h": _load_cols(hT, t0, tw, H, hT.dtype), "lab": _column(labels, t0, tw)}
            for key, init in (("m", NEG_BIG), ("s", 0.0), ("tgt", 0.0)):
                st[key] = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=st[key], value=init)
            group.append(st)
        for v0, vw in _tiles(V, VF):
            w_sb = _load_cols(wT, v0, vw, H, wT.dtype)
            for j in range(len(group)):
                st = group[j]
                ps = nl.ndarray((st["lab"].shape[0], vw), dtype=nl.float32, buffer=nl.psum)
                _logits(ps, st["h"], w_sb, H)
                _fwd_tile_stats(ps, st, iota, v0)
        for j in range(len(group)):
            st = group[j]
            tw, t0 = st["lab"].shape[0], st["t0"]
            out = nl.ndarray((tw, 2), dtype=nl.float32, buffer=nl.sbuf)  # [lse | loss]
            nisa.activation(dst=out[:, 0:1], op=nl.log, data=st["s"])
            nisa.tensor_tensor(dst=out[:, 0:1], data1=out[:, 0:1], data2=st["m"], op=nl.add)
            nisa.tensor_tensor(dst=out[:, 1:2], data1=out[:, 0:1], data2=st["tgt"], op=nl.subtract)
            if st["masked"]:
                nisa.dma_copy(dst=scratch.ap(pattern=[[1, tw], [P, 2]], offset=0), src=out)
            else:
                nisa.dma_copy(dst=lse.ap(pattern=[[1, tw], [1, 1]], offset=t0), src=out[:, 0:1])
                nisa.dma_copy(dst=loss.ap(pattern=[[1, tw], [1, 1]], offset=t0), src=out[:, 1:2])
    return loss, lse


def _dlogits(dst, ps, lse_b, scale_b, hit):
    """``dst = scale * (exp(ps - lse) - hit)`` for PSUM logits ``ps`` with ``lse`` / ``scale`` / ``hit``
    laid out like ``ps`` (columns or broadcast rows); rounded once into ``dst``'s dtype."""
    rows, cols = ps.shape
    p = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=p, data1=ps, data2=lse_b, op=nl.subtract)
    nisa.activation(dst=p, op=nl.exp, data=p)
    nisa.tensor_tensor(dst=p, data1=p, data2=hit, op=nl.subtract)
    nisa.tensor_tensor(dst=dst, data1=p, data2=scale_b, op=nl.multiply)


def _banks(rows, H):
    """fp32 PSUM tiles ``[rows, <=512]`` covering H columns (one bank each)."""
    out = []
    for h0, hw in _tiles(H, HB):
        out.append(nl.ndarray((rows, hw), dtype=nl.float32, buffer=nl.psum))
    return out


def _matmul_banks(banks, stationary, moving_rows, first):
    """``banks (+)= stationary.T @ moving_rows``, 512 columns of ``moving_rows`` per bank."""
    for b in range(len(banks)):
        h0 = b * HB
        nisa.nc_matmul(dst=banks[b], stationary=stationary, moving=moving_rows[:, h0:h0 + banks[b].shape[1]],
                       accumulate=not first)


def _fold(acc, banks, first):
    """``acc (+)= banks`` (fp32 SBUF accumulator, Vector engine; ``first``: copied instead)."""
    for b in range(len(banks)):
        h0 = b * HB
        hw = banks[b].shape[1]
        if first:
            nisa.tensor_copy(dst=acc[:, h0:h0 + hw], src=banks[b])
        else:
            nisa.tensor_tensor(dst=acc[:, h0:h0 + hw], data1=acc[:, h0:h0 + hw], data2=banks[b], op=nl.add)


def _items(n_members, n_loads):
    """``[(member, load), ...]`` in member-major order."""
    out = []
    for j in range(n_members):
        for k in range(n_loads):
            out.append((j, k))
    return out


def _logits_h(st, load, H):
    """grad_hidden pass: the transposed logits ``[vw, tw]`` of a token tile ``st`` and a vocabulary load."""
    v0, w_sb, w_rows = load
    ps = nl.ndarray((w_rows.shape[0], st["acc"].shape[0]), dtype=nl.float32, buffer=nl.psum)
    _logits(ps, w_sb, st["h"], H)
    return ps


def _grad_h_step(st, load, ps, k, n_loads, first_chunk, iota_p, dt):
    """grad_hidden pass: ``dl^T`` from the logits ``ps`` and its product with the vocabulary rows into the
    token tile's PSUM banks (opened at the chunk's first load, folded into ``acc`` after its last)."""
    v0, w_sb, w_rows = load
    vw, tw = ps.shape
    if k == 0:
        st["banks"] = _banks(tw, st["acc"].shape[1])
    hit = nl.ndarray((vw, tw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hit, data=st["lab"][0:vw, :], op0=nl.subtract, operand0=float(v0))
    nisa.tensor_tensor(dst=hit, data1=hit, data2=iota_p[0:vw, 0:tw], op=nl.equal)
    dlT = nl.ndarray((vw, tw), dtype=dt, buffer=nl.sbuf)
    _dlogits(dlT, ps, st["lse"][0:vw, :], st["scale"][0:vw, :], hit)
    _matmul_banks(st["banks"], dlT, w_rows, k == 0)
    if k == n_loads - 1:
        _fold(st["acc"], st["banks"], first_chunk)


def _logits_w(st, load, H):
    """grad_weight pass: the logits ``[tw, vw]`` of a token load and a vocabulary tile ``st``."""
    h_sb, h_rows, neg, scale_c, lab_c = load
    ps = nl.ndarray((h_rows.shape[0], st["acc"].shape[0]), dtype=nl.float32, buffer=nl.psum)
    _logits(ps, h_sb, st["w"], H)
    return ps


def _grad_w_step(st, load, ps, k, n_loads, first_chunk, iota_f, dt):
    """grad_weight pass: ``dl`` from the logits ``ps`` and ``dl.T @ h`` into the vocabulary tile's PSUM banks."""
    h_sb, h_rows, neg, scale_c, lab_c = load
    tw, vw = ps.shape
    if k == 0:
        st["banks"] = _banks(vw, st["acc"].shape[1])
    rel = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rel, data=lab_c, op0=nl.subtract, operand0=float(st["v0"]))
    hit = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hit, data=iota_f[0:tw, 0:vw], op0=nl.equal, operand0=rel)
    p = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p, op=nl.exp, data=ps, bias=neg)
    nisa.tensor_tensor(dst=p, data1=p, data2=hit, op=nl.subtract)
    dl = nl.ndarray((tw, vw), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=dl, data=p, op0=nl.multiply, operand0=scale_c)
    _matmul_banks(st["banks"], dl, h_rows, k == 0)
    if k == n_loads - 1:
        _fold(st["acc"], st["banks"], first_chunk)


def _store(dst_hbm, scratch, r0, acc, masked):
    """An accumulated ``[rows, H]`` gradient tile to ``dst_hbm[r0:r0+rows, :]`` (a masked one to scratch)."""
    rows = acc.shape[0]
    if masked:
        nisa.dma_copy(dst=scratch[0:rows, :], src=acc)
    else:
        nisa.dma_copy(dst=dst_hbm[r0:r0 + rows, :], src=acc)


@nki.jit
def lce_bwd_kernel(hT, h, wT, w, labels, lse, scale):
    """``(grad_h [T, H] f32, grad_w [V, H] f32)``: ``hT [H, T]``, ``h [T, H]``, ``wT [H, V]``, ``w [V, H]``,
    ``labels`` / ``lse`` / ``scale`` ``[T]`` fp32 (``scale`` = d loss / d loss_t, 0 for ignored tokens)."""
    H, T = hT.shape
    V = wT.shape[1]
    dt = hT.dtype
    n_prog = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    pid = nl.program_id(0) if nl.program_ndim() > 0 else 0
    grad_h = nl.ndarray((T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    grad_w = nl.ndarray((V, H), dtype=nl.float32, buffer=nl.shared_hbm)
    scratch = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.shared_hbm)  # masked tiles' results
    iota_p = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)  # partition index
    nisa.iota(dst=iota_p, pattern=[[0, P]], offset=0, channel_multiplier=1)
    iota_f = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)  # free index
    nisa.iota(dst=iota_f, pattern=[[1, P]], offset=0, channel_multiplier=0)

    # grad_hidden: groups of token tiles share each vocabulary tile's loads; vocabulary on partitions
    mine = _share(T, P, n_prog, pid)
    for g0 in range(0, len(mine), GROUP):
        group = []
        for (t0, tw), masked in mine[g0:g0 + GROUP]:
            group.append({"t0": t0, "masked": masked, "h": _load_cols(hT, t0, tw, H, dt),
                          "lse": _row(lse, t0, tw, P), "scale": _row(scale, t0, tw, P), "lab": _row(labels, t0, tw, P),
                          "acc": nl.ndarray((tw, H), dtype=nl.float32, buffer=nl.sbuf)})
        vt = _tiles(V, P)
        for c0 in range(0, len(vt), PAIR):
            loads = []  # this chunk's vocabulary tiles: (v0, wT columns, w rows), shared by the group
            for v0, vw in vt[c0:c0 + PAIR]:
                w_rows = nl.ndarray((vw, H), dtype=dt, buffer=nl.sbuf)
                nisa.dma_copy(dst=w_rows, src=w[v0:v0 + vw, :])
                loads.append((v0, _load_cols(wT, v0, vw, H, dt), w_rows))
            items = _items(len(group), len(loads))
            ahead = _logits_h(group[items[0][0]], loads[items[0][1]], H)
            for i in range(len(items)):
                ps = ahead
                if i + 1 < len(items):  # the next logits first: TensorE computes them while dl forms
                    ahead = _logits_h(group[items[i + 1][0]], loads[items[i + 1][1]], H)
                _grad_h_step(group[items[i][0]], loads[items[i][1]], ps, items[i][1], len(loads), c0 == 0, iota_p, dt)
        for j in range(len(group)):
            _store(grad_h, scratch, group[j]["t0"], group[j]["acc"], group[j]["masked"])

    # grad_weight: groups of vocabulary tiles share each token tile's loads; tokens on partitions
    mine = _share(V, P, n_prog, pid)
    for g0 in range(0, len(mine), GROUP):
        group = []
        for (v0, vw), masked in mine[g0:g0 + GROUP]:
            group.append({"v0": v0, "masked": masked, "w": _load_cols(wT, v0, vw, H, dt),
                          "acc": nl.ndarray((vw, H), dtype=nl.float32, buffer=nl.sbuf)})
        tt = _tiles(T, P)
        for c0 in range(0, len(tt), PAIR):
            loads = []  # this chunk's token tiles: (hT columns, h rows, -lse, scale, label), shared by the group
            for t0, tw in tt[c0:c0 + PAIR]:
                h_rows = nl.ndarray((tw, H), dtype=dt, buffer=nl.sbuf)
                nisa.dma_copy(dst=h_rows, src=h[t0:t0 + tw, :])
                neg = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=neg, data=_column(lse, t0, tw), op0=nl.multiply, operand0=-1.0)
                loads.append((_load_cols(hT, t0, tw, H, dt), h_rows, neg, _column(scale, t0, tw),
                              _column(labels, t0, tw)))
            items = _items(len(group), len(loads))
            ahead = _logits_w(group[items[0][0]], loads[items[0][1]], H)
            for i in range(len(items)):
                ps = ahead
                if i + 1 < len(items):  # the next logits first: TensorE computes them while dl forms
                    ahead = _logits_w(group[items[i + 1][0]], loads[items[i + 1][1]], H)
                _grad_w_step(group[items[i][0]], loads[items[i][1]], ps, items[i][1], len(loads), c0 == 0, iota_f, dt)
        for j in range(len(group)):
            _store(grad_w, scratch, group[j]["v0"], group[j]["acc"], group[j]["masked"])
    return grad_h, grad_w
