"""NKI kernels of the fused SwiGLU expert MLP (forward) and its elementwise backward.

Forward, :func:`moe_experts_kernel` (per expert e, weights loaded once; per block of B slots of e at
run time):

1. the block's token rows ``x[tok] [B, H]`` were gathered by indirect DMA and transposed on the Tensor
   Engine into ``x.T [H (partitions, 128-chunks), B]`` by the block before it (see
   :func:`_expert_blocks`); four 128x128 transposes share one PSUM tile and one Vector Engine
   evacuation (:func:`~trnkit.kernels.tiles.transpose_rows_grouped`);
2. ``gate.T, up.T [I-chunk, B] = w_gate_up[e][:, chunk].T @ x.T``: the 128x128 weight tile is the
   stationary operand and the block's B tokens stream as moving columns, accumulating over the H
   chunks in at most 8 outstanding accumulation groups; ``h.T = silu(gate.T) * up.T`` comes
   out directly in the contraction layout of the down matmul (no transpose of h). The gate (and up)
   groups of a pass share one PSUM bank where they fit, so one Scalar Engine activation and one
   Vector Engine multiply cover the pass (:func:`swiglu_T`);
3. gather the next block's rows and, after the gate / up matmuls, transpose them;
4. ``y [B, H] = h @ w_down[e]``: ``h.T`` chunk stationary (M = tokens), 512-column pieces of w_down
   moving; the PSUM evacuation multiplies each row by its slot's affinity (Scalar Engine
   ``activation(copy, scale=[B, 1])``) and rounds to the input dtype;
5. scatter the rows to the slot buffer ``y [T*K, H]`` (slot t*K + k) by indirect DMA, one block later.

Gathers and scatters move only the rows their block runs at (:func:`move_block_rows`, flags in the
per-block tables), although the next block's width is only known at run time.

After all experts, :func:`trnkit.kernels.moe.moe_grouped_mm.combine` sums each token's K slots with a
0/1 selection-matrix matmul (fp32 PSUM) into ``out [T, H]``.

LNC=2 (``moe_experts_kernel[2]``): each core runs the experts of
:func:`~trnkit.kernels.tiles.owned_groups` (half the weights, half the blocks), writes its
slots of the shared ``y``, waits at one ``core_barrier`` (a token's K slots come from both cores) and
combines pairs of token tiles. The host's paired layout gives the j-th expert of either
core the same blocks per width class (padding blocks on the core with fewer), so both cores run the
same loops with the same trip counts.

No state is carried in registers from one run-time iteration to the next (NKI migration guide:
loop-carried state in SBUF or HBM): the block whose rows wait to be scattered is the one before the
current block, whose slot ids the host puts in a second page of the slot table.

The backward's data path is :mod:`trnkit.kernels.moe.moe_bwd`.
"""

from __future__ import annotations

from typing import Any

from trnkit.kernels.moe.layout import FLAG_FULL0, FLAG_HALF0, FLAG_MORE, HALF, NFLAGS, tail_widths
from trnkit.kernels.moe.moe_grouped_mm import combine
from trnkit.kernels.tiles import (
    P,
    accumulate,
    block_range,
    chunk_tile,
    chunks,
    load_bias_rows,
    load_block_start,
    load_weight,
    masked_group,
    owned_groups,
    program_split,
    psum_tiles,
    row_matmul,
    tiles,
    transpose_rows_grouped,
)
from trnkit.nki_api import nisa, nki, nl

SBUF_BYTES = 208 * 1024  # usable SBUF per partition (trnkit.nkisim.memory: the nki-library budget)


def swiglu_T(h_T: list, x_T: list, wgu: Any, H: int, inter: int, B: int, act: dict, h_tile: Any = None) -> None:
    """``h_T[j] [P, B] = act(gate.T) * up.T`` for I-chunk j, ``gate.T = w_gate_up[:, chunk j].T @ x.T``
    (``act``: :func:`expert_act`, the activation and the expert's bias columns).

    One PSUM accumulation group per (chunk, gate|up); :func:`swiglu_chunks_per_pass` chunks per pass
    over H, so each moving x.T chunk feeds 2 * (chunks per pass) matmuls. ``h_tile``: the
    :func:`~trnkit.kernels.tiles.chunk_tile` whose views ``h_T`` are; given, the full chunks of
    a pass whose gate (and up) groups fit one PSUM bank together share it, and one activation and one
    multiply cover them all (:func:`_grouped_pass`).
    """
    ichunks = chunks(inter, P)
    for j0, nj in chunks(len(ichunks), swiglu_chunks_per_pass(B)):
        group = ichunks[j0:j0 + nj]
        if _grouped_pass(h_tile, group, B, act):
            _swiglu_pass_grouped(h_tile, x_T, wgu, H, inter, B, group, j0, act)
        else:
            _swiglu_pass(h_T, x_T, wgu, H, inter, B, group, j0, act)


def _grouped_pass(h_tile: Any, group: list, B: int, act: dict) -> bool:
    """Whether a :func:`swiglu_T` pass over the I-chunks ``group`` runs grouped: an ``h_tile`` given, no
    bias (its columns differ per chunk), one Scalar Engine activation (silu / gelu_tanh), every chunk
    full and all gate groups ``[P, B]`` fp32 within one 2 KiB PSUM bank."""
    if h_tile == None or act["cols"] != None or act["activation"] == "swiglu_clamped":  # noqa: E711
        return False
    full = True
    for _, iw in group:
        full = full and iw == P
    return full and len(group) > 1 and len(group) * B * 4 <= 2048


def expert_act(activation: str, limit: float, alpha: float, b_gate_up: Any, e: int, inter: int) -> dict:
    """The expert activation of expert e: its name, the clamp ``limit`` and slope ``alpha`` of
    ``swiglu_clamped``, and (``b_gate_up`` given) the gate / up bias as fp32 per-partition columns
    ``[P, 2 IC]`` (column j: gate chunk j, column IC + j: up chunk j), the ``[P, 1]`` operands the
    transposed layout ``[I-chunk, B]`` needs."""
    cols = None
    if b_gate_up != None:  # noqa: E711
        IC = (inter + P - 1) // P
        raw = nl.ndarray((P, 2 * IC), dtype=b_gate_up.dtype, buffer=nl.sbuf)
        nisa.memset(dst=raw, value=0.0)
        I2 = 2 * inter
        full = inter // P
        for half in range(2):
            base = e * I2 + half * inter
            if full > 0:
                nisa.dma_copy(dst=raw[:, half * IC:half * IC + full],
                              src=b_gate_up.ap(pattern=[[1, P], [P, full]], offset=base))
            if inter % P:
                r = inter % P
                nisa.dma_copy(dst=raw[:r, half * IC + full:half * IC + full + 1],
                              src=b_gate_up.ap(pattern=[[1, r], [1, 1]], offset=base + full * P))
        cols = nl.ndarray((P, 2 * IC), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=cols, src=raw)
    return {"activation": activation, "limit": limit, "alpha": alpha, "cols": cols}


def activate_T(h: Any, g_ps: Any, u_ps: Any, j: int, act: dict) -> None:
    """``h [iw, B] = act(gate + b_gate) * (up + b_up)`` for I-chunk j from the gate / up PSUM tiles (or
    ``[iw, n, B]`` for n chunks, without biases).

    silu / gelu_tanh: one Scalar Engine activation with the gate bias as its per-partition ``bias``,
    one Vector op (up bias as a ``[P, 1]`` operand). swiglu_clamped (GPT-OSS): ``gc = min(gate + b,
    limit)``, ``glu = gc * sigmoid(alpha gc)``, ``h = (clamp(up + b, -limit, limit) + 1) * glu``.
    """
    iw = g_ps.shape[0]
    f32 = nl.float32
    cols = act["cols"]
    b_gate = 0.0
    b_up = 0.0
    if cols != None:  # noqa: E711
        IC = cols.shape[1] // 2
        b_gate = cols[:iw, j:j + 1]
        b_up = cols[:iw, IC + j:IC + j + 1]
    limit = act["limit"]
    if act["activation"] == "swiglu_clamped":
        gc = nl.ndarray(g_ps.shape, dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=gc, data=g_ps, op0=nl.add, operand0=b_gate, op1=nl.minimum, operand1=limit)
        sig = nl.ndarray(g_ps.shape, dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=sig, op=nl.sigmoid, data=gc, scale=act["alpha"])
        glu = nl.ndarray(g_ps.shape, dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=glu, data1=gc, data2=sig, op=nl.multiply)
        uc = nl.ndarray(g_ps.shape, dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=uc, data=u_ps, op0=nl.add, operand0=b_up, op1=nl.maximum, operand1=-limit)
        nisa.tensor_scalar(dst=uc, data=uc, op0=nl.minimum, operand0=limit, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=h, data1=uc, data2=glu, op=nl.multiply)
        return
    fn = nl.gelu_apprx_tanh if act["activation"] == "gelu_tanh" else nl.silu
    a = nl.ndarray(g_ps.shape, dtype=f32, buffer=nl.sbuf)
    if cols == None:  # noqa: E711
        nisa.activation(dst=a, op=fn, data=g_ps)
        nisa.tensor_tensor(dst=h, data1=a, data2=u_ps, op=nl.multiply)
        return
    nisa.activation(dst=a, op=fn, data=g_ps, bias=b_gate)
    nisa.scalar_tensor_tensor(dst=h, data=u_ps, op0=nl.add, operand0=b_up, op1=nl.multiply, operand1=a)


MAX_GROUPS = 8  # outstanding matmul accumulation groups on TensorE


def swiglu_chunks_per_pass(B: int) -> int:
    """I-chunks per pass over H: each needs two accumulation groups (gate, up) of ``[128, B]`` fp32, and
    TensorE has at most eight outstanding (trainium_inferentia2_arch.rst "PSUM accumulation"; trnkit
    counts groups, not banks): 4 chunks; at B > 128 the 4 PSUM banks of 2 * chunks * B fp32 columns
    limit it further (B = 512: 2 chunks)."""
    return min(MAX_GROUPS // 2, max(1, 1024 // B))


def _swiglu_pass(h_T: list, x_T: list, wgu: Any, H: int, inter: int, B: int, group: list, j0: int,
                 act: dict) -> None:
    """One pass of :func:`swiglu_T` over the I-chunks in ``group`` (its PSUM tiles are local, so their
    banks and accumulation groups are free again when the pass returns)."""
    shapes = []
    for _, iw in group:
        shapes.append((iw, B))
        shapes.append((iw, B))
    ps = psum_tiles(shapes)  # gate and up of each chunk, interleaved
    accumulate(ps, _gate_up_operands(x_T, wgu, H, inter, B, group))
    for jj in range(len(group)):
        iw = group[jj][1]
        activate_T(h_T[j0 + jj][:iw, :], ps[2 * jj], ps[2 * jj + 1], j0 + jj, act)


def _gate_up_operands(x_T: list, wgu: Any, H: int, inter: int, B: int, group: list) -> list:
    """:func:`accumulate`'s operands for the gate and up projections of the I-chunks ``(i0, width)`` in
    ``group``: per H-chunk, the gate then the up weight columns of each I-chunk against ``x_T``."""
    hcs = chunks(H, P)
    operands = []
    for c in range(len(hcs)):
        hk = hcs[c][1]
        row = []
        for i0, iw in group:
            row.append((wgu[c][:hk, i0:i0 + iw], x_T[c][:hk, :B]))
            row.append((wgu[c][:hk, inter + i0:inter + i0 + iw], x_T[c][:hk, :B]))
        operands.append(row)
    return operands


def _swiglu_pass_grouped(h_tile: Any, x_T: list, wgu: Any, H: int, inter: int, B: int, group: list, j0: int,
                         act: dict) -> None:
    """:func:`_swiglu_pass` with the pass's gate groups in one PSUM tile ``[P, nj, B]`` and its up groups
    in another, activated together into ``h_tile[:, j0:j0+nj, :]`` (:func:`_grouped_pass`)."""
    nj = len(group)
    g_ps, u_ps = psum_tiles([(P, nj, B), (P, nj, B)])
    ps = []
    for jj in range(nj):
        ps.append(g_ps[:, jj, :])
        ps.append(u_ps[:, jj, :])
    full = []  # the grouped pass holds whole P-wide chunks
    for i0, _ in group:
        full.append((i0, P))
    accumulate(ps, _gate_up_operands(x_T, wgu, H, inter, B, full))
    activate_T(h_tile[:, j0:j0 + nj, :], g_ps, u_ps, j0, act)


def _expert_blocks(lo: Any, hi: Any, width: int, x: Any, rows_in: dict, token_table: Any, block_weights: Any,
                   wgu: Any, wd: Any, y: Any, y_prev: list, slot_table: Any, act: dict, bd: Any) -> None:
    """Run-time loop over one expert's blocks lo..hi-1 of ``width`` rows (see moe_experts_kernel).

    Software-pipelined on both sides of the compute. Block i finds its token rows transposed in
    ``rows_in["x_T"]`` (chunk views of ``rows_in["x_big"]``, :func:`transpose_next`, done by block i-1 or
    the kernel's prologue); it gathers block i+1's rows into ``rows_in["x_next"]`` first, and
    transposes them after its gate / up matmuls (the last readers of x.T), so their evacuations run
    while the Tensor Engine computes the down projection -- across expert boundaries, since the blocks
    of consecutive experts are consecutive rows of the tables. Scatters run one block behind: block
    i's scaled rows stay in ``y_prev`` until block i+1 has issued its gather; block i+1 scatters them by
    its row of the second page of ``slot_table`` (the ids of the block before it on this core), so no
    block id is carried from one iteration to the next. The descriptors of both indirect DMAs are
    written by one in-order engine (GpSimd, software DGE), so the gather goes first: behind the
    scatter it would wait for the previous block's last evacuation. The affinities load first: a
    load behind the next expert's weight prefetch would hold the evacuations (and with them the
    Scalar Engine's queue) until the prefetch is done.
    """
    H = x.shape[1]
    inter = wgu[0].shape[1] // 2
    IC = (inter + P - 1) // P
    subs = chunks(width, P)
    page = slot_table.shape[0] // 2  # slot_table's second page: the previous block's ids

    def block(i):
        w = block_row(block_weights, i, 0)  # fp32 affinities
        nxt = block_row(token_table, i, 1)  # block i + 1 (any expert's)
        move_block_rows(x, rows_in["x_next"], nxt, True)
        move_block_rows(y, y_prev, block_row(slot_table, i, page), False)  # the previous block's rows
        h_big, h_T = chunk_tile(IC, width, x.dtype)
        swiglu_T(h_T, rows_in["x_T"], wgu, H, inter, width, act, h_big)
        transpose_next(rows_in, nxt)  # block i + 1's rows, for the next iteration
        for s in range(len(subs)):
            r0, rw = subs[s]
            row_matmul(y_prev[s], h_T, rw, wd, inter, col0=r0, scale=w[:rw, s:s + 1], bias=bd)

    nl.fori_loop(lo, hi, block)


def transpose_next(rows_in: dict, ids: Any) -> None:
    """The sub-tiles of ``rows_in["x_next"]`` that the next block's gather filled (by the flags in its
    row ``ids`` of the token table: sub-tile 0 always, whole; the others when it is wider than one
    sub-tile, as :func:`move_block_rows`), transposed into ``rows_in["x_big"]``. Rows past the block's
    width are never read."""
    x_next = rows_in["x_next"]
    rows = x_next[0].shape[0]
    transpose_rows_grouped(x_next[0], rows_in["x_big"])
    if len(x_next) == 1:
        return
    more = nisa.register_alloc()
    col = ids.shape[1] - NFLAGS + FLAG_MORE
    nisa.register_load(more, ids[0:1, col:col + 1])

    def rest(j):
        for s in range(1, len(x_next)):
            transpose_rows_grouped(x_next[s], rows_in["x_big"], col0=s * rows)

    nl.fori_loop(0, more, rest)


def block_row(table: Any, blk: Any, ahead: int, ids: Any = None) -> Any:
    """Row ``blk + ahead`` of a per-block table ``[NB (+ 1), rows, ncol]`` (``blk`` a register) -> SBUF
    ``[rows, ncol]`` in the table's dtype (a new tile, or ``ids``): a flagged id table's ids, then its
    flags (ncol = nsub + NFLAGS), or one value per position of the block (ids, affinities: ncol = nsub)."""
    _, rows, ncol = table.shape
    if ids == None:  # noqa: E711
        ids = nl.ndarray((rows, ncol), dtype=table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids, src=table.ap(pattern=[[ncol, rows], [1, ncol]], offset=ahead * rows * ncol,
                                        scalar_offset=blk, indirect_dim=0))
    return ids


def move_block_rows(hbm: Any, sb: list, ids: Any, gather: bool) -> None:
    """Gather (``gather``) or scatter the rows of one block between HBM ``hbm [R, H]`` and its
    sub-tiles ``sb[s] [rows, H]``, only as many as the block runs at, by the flags in ``ids`` (see
    :func:`block_row`): sub-tile 0 whole or only its first HALF rows, then (flag) the other sub-tiles.

    Each flag becomes a register bounding a run-time loop of 0 or 1 trips (the block's width is a
    run-time value: the next block may be another expert's). Gathers write the rows the current block
    may still be transposing (the top of sub-tile 0) last, scatters read the rows the current block
    overwrites first, so neither waits on the in-order GpSimd for more than it must. Scatters skip
    padding ids (>= R).
    """
    rows = sb[0].shape[0]
    nsub = ids.shape[1] - NFLAGS
    half = HALF if rows > HALF else rows
    pieces = [(FLAG_MORE, 1, nsub, rows), (FLAG_FULL0, 0, 1, rows), (FLAG_HALF0, 0, 1, half)]
    if not gather:
        pieces = [pieces[2], pieces[1], pieces[0]]
    for k in range(len(pieces)):
        flag, s0, s1, r = pieces[k]
        if s0 >= s1 or (flag == FLAG_FULL0 and r == half):
            continue  # no sub-tile beyond the first / sub-tile 0 has no half piece (rows <= HALF)
        _move_flagged(hbm, sb, ids, nsub + flag, s0, s1, r, gather)


def _move_flagged(hbm: Any, sb: list, ids: Any, col: int, s0: int, s1: int, r: int, gather: bool) -> None:
    """Rows 0..r-1 of sub-tiles s0..s1-1, one indirect DMA each, when flag column ``col`` is 1."""
    flag = nisa.register_alloc()
    nisa.register_load(flag, ids[0:1, col:col + 1])

    def move(j):
        for s in range(s0, s1):
            move_rows(hbm, sb[s], ids, s, r, gather)

    nl.fori_loop(0, flag, move)


def move_rows(hbm: Any, t: Any, ids: Any, s: int, r: int, gather: bool) -> None:
    """Rows 0..r-1 of sub-tile s: ``t[p] = hbm[ids[p, s]]`` (gather) or ``hbm[ids[p, s]] = t[p]``."""
    H = hbm.shape[1]
    view = hbm.ap(pattern=[[H, r], [1, H]], offset=0, vector_offset=ids[:r, s:s + 1], indirect_dim=0)
    if gather:
        nisa.dma_copy(dst=t[:r, :], src=view)
    else:
        nisa.dma_copy(dst=view, src=t[:r, :], oob_mode=nisa.oob_mode.skip)


def scatter_rows(y: Any, y_sb: list, ids: Any) -> None:
    """Scatter the sub-tiles ``y_sb[s] [rows, H]`` of a block to the slot rows of ``y [S, H]`` named by
    its row ``ids [rows, nsub]`` of a slot table (:func:`block_row`; ids >= S, padding and the
    all-padding row NB, are skipped)."""
    rows, nsub = ids.shape
    for s in range(nsub):
        move_rows(y, y_sb[s], ids, s, rows, False)


def _prefetch_fits(H: int, inter: int, B: int, dtype: Any) -> bool:
    """Whether two experts' weights fit SBUF next to a block's working tiles (x.T, h.T, the pending
    output rows, the next block's gathered rows), so the next expert's weights can load during this one."""
    isz = 4 if dtype == nl.float32 else 2
    weights = ((H + P - 1) // P * 2 * inter + (inter + P - 1) // P * H) * isz
    work = ((H + P - 1) // P * B + (inter + P - 1) // P * B + 2 * (max(B, P) // P) * H) * isz
    return 2 * weights + work + 8 * 1024 <= SBUF_BYTES


@nki.jit
def moe_experts_kernel(x, w_gate_up, w_down, token_table, slot_table, block_start, block_weights, top_k,
                       activation="silu", limit=7.0, alpha=1.702, b_gate_up=None, b_down=None):
    """Fused gated experts: ``out [T, H] = sum_k w[t,k] * (down_e(act(gate_e(x_t)) * up_e(x_t)) + b_d)``.

    x ``[T, H]``; w_gate_up ``[E, H, 2I]``; w_down ``[E, I, H]``. Per block of B positions, laid out
    ``[NB, rows, B // rows]`` (position ``sub*rows + p`` at ``[p, sub]``, rows = min(B, 128), so a
    block's values load with one DMA, one column per 128-row sub-tile): block_weights ``[NB, rows, nsub]``
    fp32 (the slot's affinity); token_table ``[NB + 1, rows, nsub + NFLAGS]`` int32, the ids followed by
    the block's width flags (:func:`move_block_rows`), token ids (padding positions name any valid token,
    their results are never stored), row NB padding (the last block's look-ahead gather); slot_table
    ``[2 (NB + 1), rows, nsub + NFLAGS]`` int32 in two pages of that layout, slot ids t*K+k (T*K for
    padding): page 0 block r's, page 1 (rows NB + 1 + r) those of the block before r on the same core
    (the padding row NB for each core's first block), which block r scatters. block_start
    ``[1, (n + 1)(E' + 1)]`` int32 (E' = E, or E + 1 in an LNC=2 layout of an odd E, see
    :func:`~trnkit.kernels.tiles.masked_group`) for the n = len(tail_widths(B)) narrower
    widths: ``[start | b_1 | .. | b_n]``, start[e] the first block of expert e (start[E] the total);
    blocks ``start[e] .. b_1[e]-1`` run at full width B, ``b_j[e] .. b_{j+1}[e]-1`` (0 or 1 block:
    the expert's last) at ``tail_widths(B)[j-1]`` (b_{n+1} = start[e+1]), so a partly used last
    block costs about what it uses. top_k: K. activation ``silu | gelu_tanh | swiglu_clamped``
    (limit, alpha: see :func:`activate_T`); optional biases b_gate_up ``[E, 2I]`` (on gate / up before
    the activation) and b_down ``[E, H]``.
    """
    T, H = x.shape
    E_w = w_gate_up.shape[0]
    NB, rows, nsub = block_weights.shape  # the tables: [NB + 1, rows, nsub + NFLAGS]
    K = top_k
    B = rows * nsub
    widths = tail_widths(B)
    E = block_start.shape[1] // (len(widths) + 1) - 1  # the layout's experts (E_w, or + 1 masked one)
    dt = x.dtype
    # per-slot scaled expert outputs; shared: on LNC=2 the combine reads slots of both cores
    y = nl.ndarray((T * K, H), dtype=dt, buffer=nl.shared_hbm)
    y_prev = tiles(nsub, (rows, H), dt)  # the last computed block's rows, not yet scattered
    # the next block's token rows, gathered one block ahead, and transposed (chunk views of one tile)
    x_big, x_T = chunk_tile((H + P - 1) // P, B, dt)
    rows_in = {"x_next": tiles(nsub, (rows, H), dt), "x_big": x_big, "x_T": x_T}
    bs = load_block_start(block_start)
    mine = owned_groups(E)
    prefetch = _prefetch_fits(H, w_down.shape[1], B, x.dtype)
    nxt = None
    if len(mine):
        first = nisa.register_alloc()
        nisa.register_load(first, bs[0:1, mine.start:mine.start + 1])
        # the first block, while its weights load
        ids = block_row(token_table, first, 0)
        move_block_rows(x, rows_in["x_next"], ids, True)
        transpose_next(rows_in, ids)
        nxt = (load_weight(w_gate_up, masked_group(mine.start, E_w)),
               load_weight(w_down, masked_group(mine.start, E_w)))
    for e in mine:
        wgu, wd = nxt  # HC tiles [P, 2I], IC tiles [P, H]
        ew = masked_group(e, E_w)
        act = expert_act(activation, limit, alpha, b_gate_up, ew, w_down.shape[1])
        bd = None
        if b_down != None:  # noqa: E711
            bd = load_bias_rows(b_down, ew)  # [P, H]: added to every output row
        lo, hi = block_range(block_start, e, bs)
        bounds = [lo]
        for j in range(1, len(widths) + 1):
            r = nisa.register_alloc()
            nisa.register_load(r, bs[0:1, j * (E + 1) + e:j * (E + 1) + e + 1])
            bounds.append(r)
        bounds.append(hi)
        seg_widths = (B,) + widths
        for seg in range(len(seg_widths)):
            if seg == 1 and prefetch and e + 1 < mine.stop:
                # the next expert's weights, issued after this expert's full-width blocks and before its
                # narrower last one: a load issued after all its transfers starts too late to hide
                # when few DMAs are in flight; one issued before them delays this expert's gathers
                nxt = (load_weight(w_gate_up, masked_group(e + 1, E_w)), load_weight(w_down, masked_group(e + 1, E_w)))
            _expert_blocks(bounds[seg], bounds[seg + 1], seg_widths[seg], x, rows_in, token_table, block_weights,
                           wgu, wd, y, y_prev, slot_table, act, bd)
        if e + 1 < mine.stop and not (prefetch and len(seg_widths) > 1):
            nxt = (load_weight(w_gate_up, masked_group(e + 1, E_w)), load_weight(w_down, masked_group(e + 1, E_w)))
    # the last block: row end - 1 of the first page, end = the block after this core's last one
    last = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=last, data=bs[0:1, mine.stop:mine.stop + 1], op0=nl.subtract, operand0=1)
    last_blk = nisa.register_alloc()
    nisa.register_load(last_blk, last)
    move_block_rows(y, y_prev, block_row(slot_table, last_blk, 0), False)
    out = nl.ndarray((T, H), dtype=dt, buffer=nl.shared_hbm)
    if program_split()[0] > 1:
        nisa.core_barrier(y, (0, 1))  # both cores' slots are in y before any token is combined
    combine(y, out, K)
    return out
