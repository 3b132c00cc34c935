"""Dense SwiGLU MLP NKI kernels: ``mlp_fwd_kernel``, the backward's data path ``mlp_bwd_kernel`` and its
weight gradients ``mlp_wgrad_kernel``.

``y = (silu(x @ Wg) * (x @ Wu)) @ Wd`` with ``w_gate_up [H, 2I]`` (gate columns first, the contraction dim H
leading, as the MoE experts' weights) and ``w_down [I, H]``. Tokens are contiguous rows, so nothing is
gathered or scattered; the weights of a Qwen3 dense layer (Qwen3-4B: 150 MB) do not fit SBUF, so they
stream through it in blocks of ``tiling.plan``'s ``IB`` columns of I for every token tile.

Forward, per tile of ``TB`` tokens (``TB`` from ``tiling.plan``, up to 512: the gate / up matmuls' moving
size): the rows are transposed on the Tensor Engine into ``x.T [H, TB]``; per I-block the block's gate /
up columns of ``w_gate_up`` load and the MoE experts' :func:`~trnkit.kernels.moe.moe_fused.swiglu_T` computes
``h.T = silu(gate.T) * up.T`` (weight tile stationary, the tokens moving), directly in the contraction
layout of the down matmul. ``h.T`` of the whole I stays in SBUF; the down matmul then streams ``w_down``
in ``[128, <= 512]`` pieces and accumulates each ``[<= 128 tokens, 512]`` output piece over all of I in
one PSUM bank (``h.T`` chunk stationary, ``w_down`` moving), rounded once to the input dtype.

Backward, data path per tile of up to 256 tokens (``tiling.plan``; 128-token sub-tiles in the gradients'
row layout, tokens on partitions, sharing each weight block load): ``x`` and ``grad_out`` rows are
transposed; per I-block and sub-tile, three PSUM groups ``gate``, ``up`` (the recompute) and
``dA = grad_out @ w_down.T`` (the host hands ``w_down.T [H, I]``) with the rows' transposes stationary and
512 weight columns moving; the MoE experts' :func:`~trnkit.kernels.moe.moe_bwd.activation_grad_rows` gives
``h`` and the SiLU derivative, ``dgu = [dA dh/dgate | dA dh/dup]``. ``h`` and ``dgu`` rows go to HBM (the
weight gradients' operands) and ``dgu`` is transposed into SBUF, where the whole tile's ``dgu.T`` waits for
``grad_x = dgu @ w_gate_up.T`` (the host hands ``w_gate_up.T [2I, H]``, streamed in pieces; each output
piece accumulates over all of 2I in one PSUM bank).

Weight gradients (:func:`mlp_wgrad_kernel`): ``grad_w_gate_up = x.T @ dgu`` and ``grad_w_down = h.T @
grad_out``, output tiles of ``[<= 128, <= 512]`` in passes of up to 4 x 2 tiles (eight PSUM banks), each
pass summing its tiles over every 128-token tile in fp32 PSUM and rounding once.

LNC=2: the forward and the data path give each program a contiguous half of the tokens, the weight
gradients every other pass. The kernels have no run-time loops, so the two programs' instruction streams
may differ (only run-time control flow must match on both cores).
"""

from __future__ import annotations


from trnkit.kernels._common import cdiv
from trnkit.kernels.moe.moe_bwd import activation_grad_rows
from trnkit.kernels.moe.moe_fused import expert_act, swiglu_T
from trnkit.kernels.tiles import (
    NMAX,
    P,
    accumulate,
    chunks,
    evacuate_tiles,
    program_split,
    psum_tiles,
    tiles,
    transpose_rows,
)
from trnkit.nki_api import nisa, nki, nl

DOWN_BANKS = 4  # PSUM banks of one down-projection / grad_x pass (the rest for the next tile's matmuls)
WG_K, WG_N = 4, 2  # weight-gradient pass: 128-row chunks x 512-column pieces (eight PSUM banks)


def _my_tiles(n, width):
    """This program's ``[(start, size), ...]``: its contiguous share of ``n`` rows (LNC=2: halves, the
    first one larger by at most one row) in tiles of ``width``. The kernels have no run-time loops, so
    the two programs' instruction streams may differ in length (only run-time control flow must match)."""
    n_prog, pid = program_split()
    per = cdiv(n, n_prog)
    start = min(n, pid * per)
    out = []
    for t0, tw in chunks(min(n, start + per) - start, width):
        out.append((start + t0, tw))
    return out


def _load_rows_T(src, t0, tw, dst_T):
    """Rows ``t0 .. t0+tw`` of ``src [T, W]`` transposed into ``dst_T[c] [P, tw]`` (W in 128-chunks), one
    128-row sub-tile at a time (a DMA of whole rows, then Tensor Engine transposes)."""
    W = src.shape[1]
    for r0, rw in chunks(tw, P):
        rows = nl.ndarray((rw, W), dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=src[t0 + r0:t0 + r0 + rw, :])
        transpose_rows(rows, dst_T, col0=r0)


def _gate_up_block(w_gate_up, i0, ib):
    """Columns ``i0 .. i0+ib`` of the gate and of the up half of ``w_gate_up [H, 2I]``: per 128-row chunk of
    H a tile ``[P, 2 ib]`` (gate columns, then up columns), the layout :func:`swiglu_T` reads."""
    H, I2 = w_gate_up.shape
    inter = I2 // 2
    out = []
    for h0, hk in chunks(H, P):
        t = nl.ndarray((P, 2 * ib), dtype=w_gate_up.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:hk, 0:ib], src=w_gate_up[h0:h0 + hk, i0:i0 + ib])
        nisa.dma_copy(dst=t[:hk, ib:2 * ib], src=w_gate_up[h0:h0 + hk, inter + i0:inter + i0 + ib])
        out.append(t)
    return out


def _col_block(w, c0, cw):
    """Columns ``c0 .. c0+cw`` of ``w [R, C]`` as one tile ``[P, cw]`` per 128-row chunk."""
    R = w.shape[0]
    out = []
    for r0, rk in chunks(R, P):
        t = nl.ndarray((P, cw), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:rk, :], src=w[r0:r0 + rk, c0:c0 + cw])
        out.append(t)
    return out


def _streamed_rows(out_rows, lhs_T, w, row_of_chunk, tw):
    """``out_rows[s] [rows_s, N] = lhs[tw, K] @ w`` with ``lhs_T[k] [P, tw]`` the 128-chunks of lhs
    transposed (K on partitions) and ``w`` in HBM, its rows of chunk k from ``row_of_chunk[k]`` (the
    chunk's width is lhs_T's partitions used: ``row_of_chunk[k] = (row0, width)``).

    ``w`` streams in ``[width, <= 512]`` pieces; each ``[<= 128 rows, 512]`` output piece accumulates over
    every chunk in one PSUM bank (``DOWN_BANKS`` banks per pass: sub-tiles x pieces), then is evacuated
    (rounded once) into ``out_rows``."""
    N = w.shape[1]
    subs = chunks(tw, P)
    per_pass = max(1, DOWN_BANKS // len(subs))
    pieces = chunks(N, NMAX)
    evac = 0
    for q0 in range(0, len(pieces), per_pass):
        group = pieces[q0:q0 + per_pass]
        n0 = group[0][0]
        gw = group[-1][0] + group[-1][1] - n0
        dsts, shapes = [], []  # (sub-tile, piece), sub-tile-major: one accumulation group each
        for s in range(len(subs)):
            for c0, nw in group:
                dsts.append(out_rows[s][:, c0:c0 + nw])
                shapes.append((subs[s][1], nw))
        ps = psum_tiles(shapes)
        for k in range(len(row_of_chunk)):  # each chunk's weight rows load, then feed every group
            r0, rk = row_of_chunk[k]
            w_t = nl.ndarray((P, gw), dtype=w.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=w_t[:rk, :], src=w[r0:r0 + rk, n0:n0 + gw])
            row = []
            for s0, sw in subs:
                for c0, nw in group:
                    row.append((lhs_T[k][:rk, s0:s0 + sw], w_t[:rk, c0 - n0:c0 - n0 + nw]))
            accumulate(ps, [row], start=k == 0)
        evacuate_tiles(dsts, ps, evac)
        evac += len(dsts)


def _store_rows(dst, t0, rows_sb):
    """The tile's row sub-tiles ``rows_sb[s]`` to ``dst[t0 + s*128 ...]``."""
    for s in range(len(rows_sb)):
        rw = rows_sb[s].shape[0]
        nisa.dma_copy(dst=dst[t0 + s * P:t0 + s * P + rw, :], src=rows_sb[s])


@nki.jit
def mlp_fwd_kernel(x, w_gate_up, w_down, tb, ib):
    """``y [T, H] = (silu(x @ Wg) * (x @ Wu)) @ w_down`` in x's dtype: x ``[T, H]``, w_gate_up ``[H, 2I]``
    (gate columns first), w_down ``[I, H]``; ``tb`` / ``ib``: the token tile and I-block widths (``tiling.plan``)."""
    T, H = x.shape
    inter = w_down.shape[0]
    dt = x.dtype
    y = nl.ndarray((T, H), dtype=dt, buffer=nl.shared_hbm)
    act = expert_act("silu", 7.0, 1.702, None, 0, inter)
    HC = cdiv(H, P)
    i_rows = chunks(inter, P)
    mine = _my_tiles(T, tb)
    for m in range(len(mine)):
        t0, tw = mine[m]
        x_T = tiles(HC, (P, tw), dt)
        _load_rows_T(x, t0, tw, x_T)
        h_T = tiles(len(i_rows), (P, tw), dt)
        for i0, iw in chunks(inter, ib):
            wgu = _gate_up_block(w_gate_up, i0, iw)
            swiglu_T(h_T[i0 // P:i0 // P + cdiv(iw, P)], x_T, wgu, H, iw, tw, act)
        y_rows = []
        for _, sw in chunks(tw, P):
            y_rows.append(nl.ndarray((sw, H), dtype=dt, buffer=nl.sbuf))
        _streamed_rows(y_rows, h_T, w_down, i_rows, tw)
        _store_rows(y, t0, y_rows)
    return y


def _grad_block(x_T, go_T, wgu, wd_T, H, s0, sw, dt):
    """One I-block of the backward's data path for the tokens ``s0 .. s0+sw`` (<= 128) of a tile: ``(h,
    dgate, dup)`` rows ``[sw, ib]`` in dt from the gate / up recompute and ``dA = grad_out @ w_down.T``
    (three PSUM groups over H)."""
    ib = wd_T[0].shape[1]
    hcs = chunks(H, P)
    f32 = nl.float32
    g_ps, u_ps, d_ps = psum_tiles([(sw, ib), (sw, ib), (sw, ib)])
    gate_up, down = [], []
    for c in range(len(hcs)):
        hk = hcs[c][1]
        rows_T = x_T[c][:hk, s0:s0 + sw]
        gate_up.append([(rows_T, wgu[c][:hk, 0:ib]), (rows_T, wgu[c][:hk, ib:2 * ib])])
        down.append([(go_T[c][:hk, s0:s0 + sw], wd_T[c][:hk, :])])
    accumulate([g_ps, u_ps], gate_up)
    accumulate([d_ps], down)
    a = nl.ndarray((sw, ib), dtype=f32, buffer=nl.sbuf)
    u = nl.ndarray((sw, ib), dtype=f32, buffer=nl.sbuf)
    d = nl.ndarray((sw, ib), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=a, op=nl.copy, data=g_ps)  # Scalar evacuates: Vector runs the chain below
    nisa.activation(dst=u, op=nl.copy, data=u_ps)
    nisa.activation(dst=d, op=nl.copy, data=d_ps)
    h, dh_da, dh_du = activation_grad_rows(a, u, dt, "silu", 7.0, 1.702)
    dg = nl.ndarray((sw, ib), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dg, data1=d, data2=dh_da, op=nl.multiply)
    du = nl.ndarray((sw, ib), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=du, data1=d, data2=dh_du, op=nl.multiply)
    return h, dg, du


@nki.jit
def mlp_bwd_kernel(x, grad_out, w_gate_up, w_down_T, w_gate_up_T, tb, ib):
    """Data path of the MLP backward -> ``(grad_x [T, H], h [T, I], dgu [T, 2I])`` in x's dtype (h and dgu:
    the operands of :func:`mlp_wgrad_kernel`). x, grad_out ``[T, H]``; w_gate_up ``[H, 2I]``; w_down_T
    ``[H, I]`` (w_down transposed); w_gate_up_T ``[2I, H]``; ``tb`` / ``ib``: the token tile (128-row
    sub-tiles sharing each weight block) and I-block widths (``tiling.plan``)."""
    T, H = x.shape
    inter = w_down_T.shape[1]
    dt = x.dtype
    grad_x = nl.ndarray((T, H), dtype=dt, buffer=nl.shared_hbm)
    h_out = nl.ndarray((T, inter), dtype=dt, buffer=nl.shared_hbm)
    dgu_out = nl.ndarray((T, 2 * inter), dtype=dt, buffer=nl.shared_hbm)
    HC = cdiv(H, P)
    ic = cdiv(inter, P)
    # dgu.T chunk k: gate rows then up rows of w_gate_up.T
    dgu_rows = []
    for half in range(2):
        for r0, rk in chunks(inter, P):
            dgu_rows.append((half * inter + r0, rk))
    mine = _my_tiles(T, tb)
    for m in range(len(mine)):
        t0, tw = mine[m]
        subs = chunks(tw, P)
        x_T = tiles(HC, (P, tw), dt)
        _load_rows_T(x, t0, tw, x_T)
        go_T = tiles(HC, (P, tw), dt)
        _load_rows_T(grad_out, t0, tw, go_T)
        dgu_T = tiles(2 * ic, (P, tw), dt)
        for i0, iw in chunks(inter, ib):
            wgu = _gate_up_block(w_gate_up, i0, iw)
            wd_T = _col_block(w_down_T, i0, iw)
            for s0, sw in subs:
                h, dg, du = _grad_block(x_T, go_T, wgu, wd_T, H, s0, sw, dt)
                r0 = t0 + s0
                nisa.dma_copy(dst=h_out[r0:r0 + sw, i0:i0 + iw], src=h)
                nisa.dma_copy(dst=dgu_out[r0:r0 + sw, i0:i0 + iw], src=dg)
                nisa.dma_copy(dst=dgu_out[r0:r0 + sw, inter + i0:inter + i0 + iw], src=du)
                transpose_rows(dg, dgu_T[i0 // P:i0 // P + cdiv(iw, P)], col0=s0)
                transpose_rows(du, dgu_T[ic + i0 // P:ic + i0 // P + cdiv(iw, P)], col0=s0)
        gx = []
        for _, sw in subs:
            gx.append(nl.ndarray((sw, H), dtype=dt, buffer=nl.sbuf))
        _streamed_rows(gx, dgu_T, w_gate_up_T, dgu_rows, tw)
        _store_rows(grad_x, t0, gx)
    return grad_x, h_out, dgu_out


def _wgrad_passes(K, N, which):
    """Output tiles of a ``[K, N]`` weight gradient in passes ``(which, k0, kn, n0, nn)`` of up to
    ``WG_K`` 128-row chunks x ``WG_N`` 512-column pieces."""
    out = []
    for k0, kn in chunks(K, WG_K * P):
        for n0, nn in chunks(N, WG_N * NMAX):
            out.append((which, k0, kn, n0, nn))
    return out


def _wgrad_pass(a, b, grad, pas):
    """``grad[k0:k0+kn, n0:n0+nn] = a[:, k0:k0+kn].T @ b[:, n0:n0+nn]`` summed over every 128-token tile
    in fp32 PSUM (one bank per 128 x 512 tile), rounded once and stored."""
    _, k0, kn, n0, nn = pas
    T = a.shape[0]
    kcs = chunks(kn, P)
    ncs = chunks(nn, NMAX)
    shapes = []  # (row chunk, column piece), chunk-major: one accumulation group each
    for _, kw in kcs:
        for _, nw in ncs:
            shapes.append((kw, nw))
    ps = psum_tiles(shapes)
    tts = chunks(T, P)
    for t in range(len(tts)):  # each token tile's rows load, then add to every group
        t0, tw = tts[t]
        a_t = nl.ndarray((tw, kn), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_t, src=a[t0:t0 + tw, k0:k0 + kn])
        b_t = nl.ndarray((tw, nn), dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b_t, src=b[t0:t0 + tw, n0:n0 + nn])
        row = []
        for c0, kw in kcs:
            for q0, nw in ncs:
                row.append((a_t[:, c0:c0 + kw], b_t[:, q0:q0 + nw]))
        accumulate(ps, [row], start=t == 0)
    for i in range(len(kcs)):
        c0, kw = kcs[i]
        res = nl.ndarray((kw, nn), dtype=grad.dtype, buffer=nl.sbuf)
        dsts = []
        for q0, nw in ncs:
            dsts.append(res[:, q0:q0 + nw])
        evacuate_tiles(dsts, ps[i * len(ncs):(i + 1) * len(ncs)], i * len(ncs))
        nisa.dma_copy(dst=grad[k0 + c0:k0 + c0 + kw, n0:n0 + nn], src=res)


@nki.jit
def mlp_wgrad_kernel(x, dgu, h, grad_out):
    """``(grad_w_gate_up [H, 2I] = x.T @ dgu, grad_w_down [I, H] = h.T @ grad_out)`` in x's dtype, fp32
    sums over all T tokens: x, grad_out ``[T, H]``, dgu ``[T, 2I]``, h ``[T, I]`` (of :func:`mlp_bwd_kernel`)."""
    T, H = x.shape
    inter = h.shape[1]
    dt = x.dtype
    grad_wgu = nl.ndarray((H, 2 * inter), dtype=dt, buffer=nl.shared_hbm)
    grad_wd = nl.ndarray((inter, H), dtype=dt, buffer=nl.shared_hbm)
    passes = _wgrad_passes(H, 2 * inter, 0) + _wgrad_passes(inter, H, 1)
    n_prog, pid = program_split()
    for m in range(pid, len(passes), n_prog):  # LNC=2: every other pass
        pas = passes[m]
        if pas[0] == 0:
            _wgrad_pass(x, dgu, grad_wgu, pas)
        else:
            _wgrad_pass(h, grad_out, grad_wd, pas)
    return grad_wgu, grad_wd
