"""Fused linear cross-entropy NKI kernels: ``lce_fwd_kernel`` (loss and log-sum-exp per token) and
``lce_bwd_kernel`` (grad_hidden and grad_weight), both without a ``[T, V]`` tensor in HBM.

The logits ``hidden @ weight.T`` exist only as fp32 PSUM tiles. Every matmul contracts over H on the
partitions, so the host hands the kernels both layouts of each operand: ``hT [H, T]`` and ``wT [H, V]``
(H leading: the logits' operands) and ``h [T, H]`` / ``w [V, H]`` (the gradients' moving operands).

Forward, per tile of 128 tokens (tokens on partitions): for each 512-column vocabulary tile the logits
``[128, 512]`` accumulate over the 128-row chunks of H in one PSUM bank; the Vector engine takes the
tile's row max and the target logit (a one-hot mask of ``iota == label - v0`` times the logits, summed),
the Scalar engine ``exp(logits - m_new)`` summed along the row (``activation_reduce``), and the
running ``(m, s)`` pair is rescaled online. At the end ``lse = m + ln s``, ``loss = lse - target``.

Backward, ``dl[t, v] = scale[t] * (exp(logit - lse[t]) - [v == label[t]])`` (``scale`` = the loss
gradient per token, 0 for ignored tokens), rounded to the operands' dtype like the reference:

* ``grad_hidden [T, H]``: per tile of 128 tokens, over 128-row vocabulary tiles the logits are recomputed
  transposed (``[128 v, 128 t]``, vocabulary on partitions, so ``dl^T`` is directly the stationary
  operand), and ``dl^T.T @ w[v0:v0+128, :]`` accumulates in up to five PSUM banks (H <= 2560).
* ``grad_weight [V, H]``: per 128-row vocabulary tile, over 128-token tiles the logits are recomputed
  in the forward's layout (tokens on partitions) and ``dl.T @ h[t0:t0+128, :]`` accumulates likewise.

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
    for (t0, tw), masked in _share(T, P, n_prog, pid):
        h_sb = _load_cols(hT, t0, tw, H, hT.dtype)
        lab = _column(labels, t0, tw)
        m = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
        tgt = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=NEG_BIG)
        nisa.memset(dst=s, value=0.0)
        nisa.memset(dst=tgt, value=0.0)
        for v0, vw in _tiles(V, VF):
            w_sb = _load_cols(wT, v0, vw, H, wT.dtype)
            ps = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.psum)
            _logits(ps, h_sb, w_sb, H)
            # target logit: sum(logits * (iota == label - v0))
            rel = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=rel, data=lab, op0=nl.subtract, operand0=float(v0))
            hit = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=hit, data=iota[0:tw, 0:vw], op0=nl.equal, operand0=rel)
            nisa.tensor_tensor(dst=hit, data1=hit, data2=ps, op=nl.multiply)
            part = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=part, op=nl.add, data=hit, axis=1)
            nisa.tensor_tensor(dst=tgt, data1=tgt, data2=part, op=nl.add)
            # online log-sum-exp: m_new = max(m, max_row), s = s * exp(m - m_new) + sum(exp(logits - m_new))
            mx = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=mx, op=nl.maximum, data=ps, axis=1)
            nisa.tensor_tensor(dst=mx, data1=mx, data2=m, op=nl.maximum)
            neg = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg, data=mx, op0=nl.multiply, operand0=-1.0)
            e = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
            es = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation_reduce(dst=e, op=nl.exp, data=ps, reduce_op=nl.add, reduce_res=es, bias=neg)
            corr = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=corr, op=nl.exp, data=m, bias=neg)
            nisa.tensor_tensor(dst=s, data1=s, data2=corr, op=nl.multiply)
            nisa.tensor_tensor(dst=s, data1=s, data2=es, op=nl.add)
            nisa.tensor_copy(dst=m, src=mx)
        out = nl.ndarray((tw, 2), dtype=nl.float32, buffer=nl.sbuf)  # [lse | loss]
        nisa.activation(dst=out[:, 0:1], op=nl.log, data=s)
        nisa.tensor_tensor(dst=out[:, 0:1], data1=out[:, 0:1], data2=m, op=nl.add)
        nisa.tensor_tensor(dst=out[:, 1:2], data1=out[:, 0:1], data2=tgt, op=nl.subtract)
        if masked:
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


def _evacuate(dst_hbm, r0, rw, banks, H):
    """Copy the PSUM banks of one ``[rw, H]`` gradient tile to ``dst_hbm[r0:r0+rw, :]`` (fp32)."""
    g = nl.ndarray((rw, H), dtype=nl.float32, buffer=nl.sbuf)
    for b in range(len(banks)):
        h0 = b * HB
        nisa.tensor_copy(dst=g[:, h0:h0 + banks[b].shape[1]], src=banks[b])
    nisa.dma_copy(dst=dst_hbm[r0:r0 + rw, :], src=g)


def _grad_banks(rows, H):
    banks = []
    for h0, hw in _tiles(H, HB):
        banks.append(nl.ndarray((rows, hw), dtype=nl.float32, buffer=nl.psum))
    return banks


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

    # grad_hidden: token tiles; vocabulary on partitions (logits transposed)
    for (t0, tw), masked in _share(T, P, n_prog, pid):
        h_sb = _load_cols(hT, t0, tw, H, dt)
        lse_r, scale_r, lab_r = _row(lse, t0, tw, P), _row(scale, t0, tw, P), _row(labels, t0, tw, P)
        banks = _grad_banks(tw, H)
        vt = _tiles(V, P)
        for i in range(len(vt)):
            v0, vw = vt[i]
            w_sb = _load_cols(wT, v0, vw, H, dt)
            ps = nl.ndarray((vw, tw), dtype=nl.float32, buffer=nl.psum)
            _logits(ps, w_sb, h_sb, H)
            rel = nl.ndarray((vw, tw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=rel, data=lab_r[0:vw, :], op0=nl.subtract, operand0=float(v0))
            nisa.tensor_tensor(dst=rel, data1=rel, data2=iota_p[0:vw, 0:tw], op=nl.equal)
            dlT = nl.ndarray((vw, tw), dtype=dt, buffer=nl.sbuf)
            _dlogits(dlT, ps, lse_r[0:vw, :], scale_r[0:vw, :], rel)
            w_rows = nl.ndarray((vw, H), dtype=dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=w_rows, src=w[v0:v0 + vw, :])
            for b in range(len(banks)):
                h0 = b * HB
                nisa.nc_matmul(dst=banks[b], stationary=dlT, moving=w_rows[:, h0:h0 + banks[b].shape[1]],
                               accumulate=i > 0)
        if masked:
            _evacuate(scratch, 0, tw, banks, H)
        else:
            _evacuate(grad_h, t0, tw, banks, H)

    # grad_weight: vocabulary tiles; tokens on partitions (the forward's layout)
    for (v0, vw), masked in _share(V, P, n_prog, pid):
        w_sb = _load_cols(wT, v0, vw, H, dt)
        banks = _grad_banks(vw, H)
        tt = _tiles(T, P)
        for i in range(len(tt)):
            t0, tw = tt[i]
            h_sb = _load_cols(hT, t0, tw, H, dt)
            ps = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.psum)
            _logits(ps, h_sb, w_sb, H)
            lse_c, scale_c, lab_c = _column(lse, t0, tw), _column(scale, t0, tw), _column(labels, t0, tw)
            rel = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=rel, data=lab_c, op0=nl.subtract, operand0=float(v0))
            hit = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=hit, data=iota_f[0:tw, 0:vw], op0=nl.equal, operand0=rel)
            p = nl.ndarray((tw, vw), dtype=nl.float32, buffer=nl.sbuf)
            neg = nl.ndarray((tw, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg, data=lse_c, op0=nl.multiply, operand0=-1.0)
            nisa.activation(dst=p, op=nl.exp, data=ps, bias=neg)
            nisa.tensor_tensor(dst=p, data1=p, data2=hit, op=nl.subtract)
            dl = nl.ndarray((tw, vw), dtype=dt, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=dl, data=p, op0=nl.multiply, operand0=scale_c)
            h_rows = nl.ndarray((tw, H), dtype=dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=h_rows, src=h[t0:t0 + tw, :])
            for b in range(len(banks)):
                h0 = b * HB
                nisa.nc_matmul(dst=banks[b], stationary=dl, moving=h_rows[:, h0:h0 + banks[b].shape[1]],
                               accumulate=i > 0)
        if masked:
            _evacuate(scratch, 0, vw, banks, H)
        else:
            _evacuate(grad_w, v0, vw, banks, H)
    return grad_h, grad_w
