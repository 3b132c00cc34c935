"""NKI kernels of the grouped (per-expert) matmuls; their tile helpers (row layouts, weight loads, the
row matmul) are in :mod:`trnkit.kernels.tiles`.

Blocks of group ``g`` are ``block_start[0, g] .. block_start[0, g + 1] - 1``; kernels loop statically
over groups (each group's weights are loaded once, with big coalesced DMAs) and at run time
(``nl.fori_loop`` with register bounds) over the group's blocks.

LNC=2 (``kernel[2](...)``, one program per physical core): program p owns the p-th contiguous half of the
groups (:func:`~trnkit.kernels.tiles.owned_groups`), so each core loads only its experts' weights and runs
only their blocks; every block is computed exactly as on one core (results are bit-identical to LNC=1). Both
cores must take the same run-time control flow ("different control flow on the two cores is undefined", NKI
LNC guide), so the host lays the blocks out in pairs (:func:`~trnkit.kernels.moe.layout.block_layout` with
``lnc=2``): group j of core 0 and group j of core 1 get the same number of blocks (the smaller one padding
blocks, whose rows are never stored), and an odd group count gets a last, all-padding group on core 1
(:func:`~trnkit.kernels.tiles.masked_group`: it loads the last real group's weights again and writes nowhere).
Outputs written per group / per row need no synchronisation (the cores write disjoint parts); only a K-way
combine of slots that both cores wrote waits at a ``core_barrier`` (or a new launch), and then the cores sum
pairs of equal token tiles (:func:`combine_pairs`).

Kernels:
* :func:`grouped_mm_kernel` ``out[rows] = x[rows] @ w[g]`` (or ``@ w[g].T``).
* :func:`grouped_wgrad_kernel` ``grad_w[g] = sum over row tiles of a[rows].T @ b[rows]`` (fp32, in PSUM);
  :func:`grouped_wgrad2_kernel` two such gradients of the same rows in one launch.
* :func:`combine` ``out[t] = sum_k y[t*K + k]`` (selection-matrix matmul on the Tensor Engine), called at
  the end of the forward and backward data-path kernels.
"""

from __future__ import annotations

from typing import Any

from trnkit.kernels.moe.layout import WGRAD_MAX_SLOTS
from trnkit.kernels.tiles import (
    NMAX,
    P,
    PSUM_GROUPS,
    accumulate,
    accumulate_evacuate,
    block_range,
    chunks,
    evacuate_tiles,
    load_bias_rows,
    load_block_start,
    load_ids,
    load_rows,
    load_weight,
    masked_group,
    owned_groups,
    program_split,
    psum_tiles,
    row_matmul,
    store_rows,
    tiles,
    transpose_rows,
    transposed_weight,
)
from trnkit.nki_api import nisa, nki, nl, nt


# ------------------------------------------------------------------------------------------ kernels
@nki.jit
def grouped_mm_kernel(x, w, src_table, dst_table, block_start, out: nt.mutable_tensor, transpose_w, bias=None):
    """``out[dst rows] = x[src rows] @ w[g]`` (``@ w[g].T`` when ``transpose_w``) ``+ bias[g]`` for
    every block.

    x: ``[R, C]`` row-indexed or ``[NB, B, C]`` dispatch order; w: ``[G, Kw, Nw]`` with C = Kw
    (C = Nw when transposed); out: ``[R', N]`` or ``[NB, B, N]`` (preallocated, written in place);
    tables ``[NB, B]`` int32; block_start ``[1, G' + 1]`` int32 (G' = G, or G + 1 in an LNC=2 layout
    of an odd G, see :func:`masked_group`); optional bias ``[G, N]`` (added in
    fp32 before the output is rounded). Gathered padding rows are zeros (plus the bias).
    """
    G, Kw, Nw = w.shape
    C, N = (Nw, Kw) if transpose_w else (Kw, Nw)
    bs = load_block_start(block_start)
    for g in owned_groups(block_start.shape[1] - 1):
        w_sb = load_weight(w, masked_group(g, G))
        grid = None
        if transpose_w:
            grid = transposed_weight(w_sb, Kw, Nw)
        b_sb = None
        if bias != None:  # noqa: E711
            b_sb = load_bias_rows(bias, masked_group(g, G))
        lo, hi = block_range(block_start, g, bs)
        _grouped_mm_blocks(lo, hi, x, src_table, dst_table, out, w_sb, grid, C, N, b_sb)
    return out


def _grouped_mm_blocks(lo: Any, hi: Any, x: Any, src_table: Any, dst_table: Any, out: Any, w_sb: Any,
                       grid: Any, C: int, N: int, b_sb: Any = None) -> None:
    """Run-time loop over blocks lo..hi-1 of one group of :func:`grouped_mm_kernel`."""
    B = src_table.shape[1]
    rows = min(B, P)

    def block(i):
        for sub in range(B // rows):
            x_sb = nl.ndarray((rows, C), dtype=x.dtype, buffer=nl.sbuf)
            load_rows(x_sb, x, src_table, i, sub, zero_pad=True)
            x_T = tiles((C + P - 1) // P, (P, rows), x.dtype)
            transpose_rows(x_sb, x_T)
            o_sb = nl.ndarray((rows, N), dtype=out.dtype, buffer=nl.sbuf)
            row_matmul(o_sb, x_T, rows, w_sb, C, grid=grid, bias=b_sb)
            store_rows(out, o_sb, dst_table, i, sub)

    nl.fori_loop(lo, hi, block)


# ----------------------------------------------------------------------------------- weight gradients
WGRAD_PASS_TILES = 4  # fp32 output tiles [128, 512] (one PSUM bank each) per pass; two passes in flight: 8 banks
WGRAD_CACHE_BYTES = 64 * 1024  # SBUF bytes per partition for one group's cached row tiles (two groups live)
WGRAD_ZERO_COLS = 2048  # width of the zero tile written to the gradient of an empty group


def wgrad_slots(row_bytes: int) -> int:
    """Row tiles of one group that the weight-gradient kernels keep in SBUF, for tiles taking
    ``row_bytes`` per partition (every operand's row + its id). 0: none fit, every pass gathers."""
    return min(WGRAD_MAX_SLOTS, WGRAD_CACHE_BYTES // row_bytes)


@nki.jit
def grouped_wgrad_kernel(a, b, table, bounds, grad_w: nt.mutable_tensor, zero_pad=False):
    """``grad_w[g] = sum over the row tiles of g of a[rows].T @ b[rows]`` (fp32 in PSUM), see
    :func:`wgrad_products`."""
    wgrad_products([a, b], [grad_w], table, bounds, zero_pad)
    return grad_w


@nki.jit
def grouped_wgrad2_kernel(a1, b1, a2, b2, table, bounds, grad_w1: nt.mutable_tensor, grad_w2: nt.mutable_tensor,
                          zero_pad=False):
    """Two weight gradients of the same rows in one launch: ``grad_w1[g] = sum a1.T @ b1``, ``grad_w2[g]
    = sum a2.T @ b2`` (each row tile is loaded once for both), see :func:`wgrad_products`."""
    wgrad_products([a1, b1, a2, b2], [grad_w1, grad_w2], table, bounds, zero_pad)
    return grad_w1, grad_w2


def wgrad_products(operands: list, grads: list, table: Any, bounds: Any, zero_pad: bool) -> None:
    """``grads[p][g] = sum over g's row tiles of operands[2p][rows].T @ operands[2p + 1][rows]``.

    Row tiles: ``table [NT, rows]`` int32 (rows <= 128) holds the row ids of tile ``t``; an operand is either
    ``[R, W]`` (tile t gathers rows ``table[t]`` by indirect DMA) or ``[NT, rows, W]`` (slab t, dispatch
    order). ``bounds [1, G * (WGRAD_MAX_SLOTS + 3)]`` int32, per group g: ``e_0 .. e_MAX`` (``e_j = lo +
    min(j, n)`` for g's n tiles ``lo .. lo + n - 1``), ``hi = lo + n`` and ``z = lo + (n == 0)``
    (:func:`~trnkit.kernels.moe.layout.wgrad_bounds`). Padding rows of a partial tile must contribute zero:
    with ``zero_pad`` the gathered tiles are zero-filled and padding ids skipped (ids >= R); without it the
    padding ids must name a finite row and the other operand's padding rows be zeros (the MoE backward's ``w *
    h`` and gate/up gradients are, since their affinity is 0).

    Per group: its first ``S = wgrad_slots`` tiles are loaded into SBUF once (0/1-trip run-time loops,
    one per cache slot), while the previous group computes. The output tiles ``[128, 512]`` go in
    passes of up to WGRAD_PASS_TILES PSUM tiles (:func:`wgrad_passes`; two passes in flight fill the 8
    banks), each summed over all of g's row tiles (cached slots first,
    then tiles past the cache, gathered again per pass with only the pass's columns) in fp32, in a fixed
    order (deterministic, LNC=2 bit-identical). The first matmul of each group opens it (no zero
    matmul); a non-empty group evacuates and stores each pass once, an empty one writes zeros.
    """
    width = WGRAD_MAX_SLOTS + 3
    G = bounds.shape[1] // width  # the layout's groups (LNC=2, odd G: + the masked group)
    row_bytes = 4  # the tile's row id
    for op in operands:
        row_bytes += op.shape[-1] * (4 if op.dtype == nl.float32 else 2)
    slots = wgrad_slots(row_bytes)
    assert bounds.shape[1] == G * width, "wgrad bounds: WGRAD_MAX_SLOTS + 3 entries per group"
    assert G in (grads[0].shape[0], grads[0].shape[0] + 1), "wgrad bounds: one group per gradient (+ a masked one)"
    b_sb = load_block_start(bounds)  # (any [1, n] int32 row: the bound registers load from it)
    passes = wgrad_passes(grads)
    zeros = []
    for grad in grads:
        z = nl.ndarray((P, min(grad.shape[2], WGRAD_ZERO_COLS)), dtype=grad.dtype, buffer=nl.sbuf)
        nisa.memset(dst=z, value=0.0, engine=nisa.engine.vector)
        zeros.append(z)
    groups = list(owned_groups(G))
    scratch = _masked_scratch(grads, G)
    nxt = None
    if len(groups) > 0:
        nxt = _wgrad_prefetch(operands, table, b_sb, groups[0] * width, slots, zero_pad)
    for q in range(len(groups)):
        cur = nxt
        if q + 1 < len(groups):  # the next group's rows load while this one computes
            nxt = _wgrad_prefetch(operands, table, b_sb, groups[q + 1] * width, slots, zero_pad)
        regs, cache = cur
        evac = 0  # evacuations alternate between the Vector and Scalar engines across passes
        dst, g = grads, groups[q]
        if g >= grads[0].shape[0]:
            dst, g = scratch, 0  # the masked group's gradient goes to the scratch copy
        for pas in passes:
            _wgrad_pass(operands, dst, table, g, regs, cache, pas, zero_pad, evac)
            evac += len(pas[1])
        _wgrad_zero_empty(dst, g, regs, zeros)


def _masked_scratch(grads: list, G: int) -> Any:
    """One group of each gradient in private HBM, where the masked group (:func:`masked_group`) writes,
    so it runs the same instructions as its partner on the other core and writes no real gradient
    (None when the layout has no masked group)."""
    if G == grads[0].shape[0]:
        return None
    scratch = []
    for grad in grads:
        scratch.append(nl.ndarray((1, grad.shape[1], grad.shape[2]), dtype=grad.dtype, buffer=nl.private_hbm))
    return scratch


def wgrad_passes(grads: list) -> list:
    """``[(p, [(k0, kw, n0, nw), ...]), ...]``: the output tiles of every gradient (128 rows x 512
    columns) in passes of up to WGRAD_PASS_TILES tiles of one gradient. A pass holds whole 128-row
    chunks (all their 512-column pieces, so each chunk is stored as one DMA of full rows) when a chunk
    has at most WGRAD_PASS_TILES pieces, else up to WGRAD_PASS_TILES pieces of one chunk."""
    out = []
    for p in range(len(grads)):
        _, Ka, Nb = grads[p].shape
        rows = chunks(Ka, P)
        pieces = chunks(Nb, NMAX)
        per_pass = max(1, WGRAD_PASS_TILES // len(pieces))  # whole chunks per pass
        for r in range(0, len(rows), per_pass):
            cur = []
            for k0, kw in rows[r:r + per_pass]:
                for n0, nw in pieces:
                    cur.append((k0, kw, n0, nw))
                    if len(cur) == WGRAD_PASS_TILES:
                        out.append((p, cur))
                        cur = []
            if len(cur) > 0:
                out.append((p, cur))
    return out


def _wgrad_prefetch(operands: list, table: Any, b_sb: Any, base: int, slots: int, zero_pad: bool) -> tuple:
    """The group's bound registers ``[e_0 .. e_max(S,1), hi, z]`` and its cache: slot j (a tile per
    operand) loaded with row tile ``e_j`` when the group has more than j tiles."""
    regs = []
    for j in range(max(slots, 1) + 1):
        regs.append(_reg(b_sb, base + j))
    regs.append(_reg(b_sb, base + WGRAD_MAX_SLOTS + 1))
    regs.append(_reg(b_sb, base + WGRAD_MAX_SLOTS + 2))
    cache = []
    for j in range(slots):
        slot = []
        for op in operands:
            slot.append(nl.ndarray((table.shape[1], op.shape[-1]), dtype=op.dtype, buffer=nl.sbuf))

        def load(i):
            _wgrad_load(slot, operands, table, i, None, zero_pad)

        nl.fori_loop(regs[j], regs[j + 1], load)
        cache.append(slot)
    return regs, cache


def _reg(b_sb: Any, k: int) -> Any:
    """A register holding ``b_sb[0, k]``."""
    r = nisa.register_alloc()
    nisa.register_load(r, b_sb[0:1, k:k + 1])
    return r


def _wgrad_load(dst: list, operands: list, table: Any, i: Any, cols: Any, zero_pad: bool) -> None:
    """Row tile ``i`` of every operand into ``dst`` (one tile each; the tile's ids load once for all
    gathered operands); ``cols[o] = (c0, width)`` restricts operand o to those columns."""
    ids = None
    for o in range(len(operands)):
        op = operands[o]
        c0 = 0
        if cols != None:  # noqa: E711
            c0 = cols[o][0]
        if len(op.shape) == 2 and ids == None:  # noqa: E711
            ids = load_ids(table, i, 0, table.shape[1])
        load_rows(dst[o], op, table, i, 0, zero_pad, col0=c0, ids=ids)


def _wgrad_pass(operands: list, grads: list, table: Any, g: int, regs: list, cache: list, pas: tuple,
                zero_pad: bool, evac: int) -> None:
    """One pass of :func:`wgrad_products` for group g: its tiles' PSUM sums over g's row tiles, then
    (when g has rows) evacuated (``evac``: the group's evacuations before this pass) and stored."""
    p, tl = pas
    a, b = operands[2 * p], operands[2 * p + 1]
    grad = grads[p]
    rows = table.shape[1]
    slots = len(cache)
    shapes = []
    for k0, kw, n0, nw in tl:
        shapes.append((kw, nw))
    ps = psum_tiles(shapes)
    for j in range(slots):
        a_t, b_t = cache[j][2 * p], cache[j][2 * p + 1]
        start = j == 0

        def cached(i):
            _wgrad_matmuls(ps, tl, a_t, b_t, rows, 0, 0, start)

        nl.fori_loop(regs[j], regs[j + 1], cached)
    # tiles past the cache: gathered again with only this pass's columns
    k_lo, k_hi, n_lo, n_hi = tl[0][0], tl[0][0], tl[0][2], tl[0][2]
    for k0, kw, n0, nw in tl:
        k_lo, k_hi, n_lo, n_hi = min(k_lo, k0), max(k_hi, k0 + kw), min(n_lo, n0), max(n_hi, n0 + nw)
    first = regs[slots]
    if slots == 0:  # no cache: the group's first tile opens the accumulation groups
        first = regs[1]

        def opening(i):
            _wgrad_gathered(ps, tl, a, b, table, i, (k_lo, k_hi, n_lo, n_hi), zero_pad, True)

        nl.fori_loop(regs[0], regs[1], opening)

    def gathered(i):
        _wgrad_gathered(ps, tl, a, b, table, i, (k_lo, k_hi, n_lo, n_hi), zero_pad, False)

    nl.fori_loop(first, regs[-2], gathered)

    def store(i):
        _wgrad_store(grad, g, ps, tl, evac)

    nl.fori_loop(regs[0], regs[1], store)  # once, when the group has rows


def _wgrad_gathered(ps: list, tl: list, a: Any, b: Any, table: Any, i: Any, box: tuple, zero_pad: bool,
                    start: bool) -> None:
    """Row tile i, columns ``box = (k_lo, k_hi, n_lo, n_hi)`` of a / b only, into the pass's PSUM tiles."""
    k_lo, k_hi, n_lo, n_hi = box
    rows = table.shape[1]
    a_t = nl.ndarray((rows, k_hi - k_lo), dtype=a.dtype, buffer=nl.sbuf)
    b_t = nl.ndarray((rows, n_hi - n_lo), dtype=b.dtype, buffer=nl.sbuf)
    _wgrad_load([a_t, b_t], [a, b], table, i, [(k_lo, k_hi - k_lo), (n_lo, n_hi - n_lo)], zero_pad)
    _wgrad_matmuls(ps, tl, a_t, b_t, rows, k_lo, n_lo, start)


def _wgrad_matmuls(ps: list, tl: list, a_t: Any, b_t: Any, rows: int, k_lo: int, n_lo: int, start: bool) -> None:
    """``ps[t] (+)= a_t[:, k-chunk].T @ b_t[:, n-piece]`` for the pass's tiles (a_t / b_t hold columns
    from k_lo / n_lo); ``start`` opens the accumulation groups."""
    row = []
    for k0, kw, n0, nw in tl:
        row.append((a_t[:rows, k0 - k_lo:k0 - k_lo + kw], b_t[:rows, n0 - n_lo:n0 - n_lo + nw]))
    accumulate(ps, [row], start=start)


def _wgrad_store(grad: Any, g: int, ps: list, tl: list, evac: int) -> None:
    """Evacuate the pass's PSUM tiles (Vector / Scalar alternately) and store them into ``grad[g]``, one
    DMA per run of tiles that are contiguous in one 128-row chunk."""
    _, Ka, Nb = grad.shape
    t = 0
    while t < len(tl):
        k0, kw, n0, _ = tl[t]
        end = t + 1
        while end < len(tl) and tl[end][0] == k0 and tl[end][2] == tl[end - 1][2] + tl[end - 1][3]:
            end += 1
        run_w = tl[end - 1][2] + tl[end - 1][3] - n0
        res = nl.ndarray((kw, run_w), dtype=grad.dtype, buffer=nl.sbuf)
        dsts = []
        for u in range(t, end):
            c0 = tl[u][2] - n0
            dsts.append(res[:, c0:c0 + tl[u][3]])
        evacuate_tiles(dsts, ps[t:end], evac + t)
        nisa.dma_copy(dst=grad.ap(pattern=[[Nb, kw], [1, run_w]], offset=(g * Ka + k0) * Nb + n0), src=res)
        t = end


def _wgrad_zero_empty(grads: list, g: int, regs: list, zeros: list) -> None:
    """Zeros into every ``grads[p][g]`` when group g has no rows (a 0/1-trip loop)."""
    for p in range(len(grads)):
        grad = grads[p]
        z = zeros[p]

        def zero(i):
            _, Ka, Nb = grad.shape
            for k0, kw in chunks(Ka, P):
                for n0, nw in chunks(Nb, z.shape[1]):
                    nisa.dma_copy(dst=grad.ap(pattern=[[Nb, kw], [1, nw]], offset=(g * Ka + k0) * Nb + n0),
                                  src=z[:kw, :nw])

        nl.fori_loop(regs[0], regs[-1], zero)


def selection_matrix(K: int, dtype: Any) -> Any:
    """SBUF ``Z [S, W]`` holding the 0/1 selection matrices of :func:`combine`: S = n*K slots of n =
    128 // K tokens (a chunk), c = 128 // n chunks per tile of M = c*n tokens, W = M + (c-1)*n;
    ``Z[s, col] = 1`` iff ``col == s // K + (c-1)*n``, so ``Z[:, (c-1-j)*n : (c-1-j)*n + M]`` maps the
    slots of chunk j to their tokens j*n + s // K of the tile. Built once with iota and two compares."""
    n_tok = P // K
    n_slot = n_tok * K
    nch = P // n_tok
    width = nch * n_tok + (nch - 1) * n_tok
    v = nl.ndarray((n_slot, width), dtype=nl.float32, buffer=nl.sbuf)
    # v[s, col] = s - K*(col - (c-1)*n)
    nisa.iota(dst=v, pattern=[[-K, width]], offset=K * (nch - 1) * n_tok, channel_multiplier=1)
    ge = nl.ndarray((n_slot, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ge, data=v, op0=nl.greater_equal, operand0=0.0)
    lt = nl.ndarray((n_slot, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lt, data=v, op0=nl.less, operand0=float(K))
    sel = nl.ndarray((n_slot, width), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sel, data1=ge, data2=lt, op=nl.multiply)
    return sel


def combine(y: Any, out: Any, K: int) -> None:
    """``out[t] = sum_k y[t*K + k]`` for ``y [T*K, H]``, ``out [T, H]`` (HBM).

    A tile of M = c*n tokens (n = 128 // K per chunk of n*K slot rows, c = 128 // n chunks, so M is
    ~128) loads its M*K contiguous slot rows, one DMA per chunk (:func:`_combine_load`, issued one tile
    ahead so the loads never queue behind a store that waits for compute), and sums them on the
    Tensor Engine: per 512-column piece, c selection-matrix matmuls (see :func:`selection_matrix`)
    accumulate into one ``[M, 512]`` fp32 PSUM tile (the K-way sum in fp32, rounded once), evacuated
    once; up to PSUM_GROUPS pieces at a time, fed chunk by chunk (:func:`_combine_pass`). On an LNC=2
    launch the programs take the tiles in pairs of equal size (:func:`combine_pairs`); where a tile
    has no partner, the second program sums a copy of it into a private scratch tensor (masked work,
    so both run the same instructions).
    """
    T, H = out.shape
    sel = selection_matrix(K, y.dtype)
    n_tok = P // K
    nch = P // n_tok
    work = []  # (token tile, masked: summed into the scratch tensor)
    n_prog, pid = program_split()
    scratch = None
    for pair in combine_pairs(chunks(T, nch * n_tok), n_prog):
        if pair[pid] != None:  # noqa: E711
            work.append((pair[pid], False))
            continue
        if scratch == None:  # noqa: E711
            scratch = nl.ndarray((nch * n_tok, H), dtype=out.dtype, buffer=nl.private_hbm)
        work.append((pair[0], True))
    if len(work) == 0:
        return
    nxt = _combine_load(y, work[0][0], K)
    for k in range(len(work)):
        (t0, nt), masked = work[k]
        parts = chunks(nt, n_tok)  # (first token, tokens) per chunk
        y_sb = nxt
        if k + 1 < len(work):  # the next tile's loads go first: the store below waits for compute
            nxt = _combine_load(y, work[k + 1][0], K)
        o_sb = nl.ndarray((nt, H), dtype=out.dtype, buffer=nl.sbuf)
        hcs = chunks(H, NMAX)
        for q0 in range(0, len(hcs), PSUM_GROUPS):
            _combine_pass(o_sb, y_sb, sel, parts, hcs[q0:q0 + PSUM_GROUPS], q0, K)
        if masked:
            nisa.dma_copy(dst=scratch[0:nt, :], src=o_sb)
        else:
            nisa.dma_copy(dst=out[t0:t0 + nt, :], src=o_sb)


def combine_pairs(tiles: list, n_prog: int) -> list:
    """The :func:`combine` token tiles ``(t0, nt)`` as each program takes them: ``[(tile,), ...]`` without a
    grid; on LNC=2 ``[(tile of program 0, tile of program 1 or None), ...]``, consecutive tiles of equal
    size paired (so both programs' tiles have the same chunks), a tile without such a partner paired
    with None (program 1 then sums a masked copy of it)."""
    if n_prog == 1:
        out = []
        for t in tiles:
            out.append((t,))
        return out
    out = []
    i = 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i + 1][1] == tiles[i][1]:
            out.append((tiles[i], tiles[i + 1]))
            i += 2
        else:
            out.append((tiles[i], None))
            i += 1
    return out


def _combine_load(y: Any, tile: tuple, K: int) -> list:
    """The slot rows of the :func:`combine` token tile ``(t0, nt)``: one ``[n*K, H]`` SBUF tile per
    chunk of n = 128 // K tokens (one DMA each)."""
    t0, nt = tile
    n_tok = P // K
    out = []
    for c0, cn in chunks(nt, n_tok):
        t = nl.ndarray((n_tok * K, y.shape[1]), dtype=y.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:cn * K, :], src=y[(t0 + c0) * K:(t0 + c0 + cn) * K, :])
        out.append(t)
    return out


def _combine_pass(o_sb: Any, y_sb: list, sel: Any, parts: list, group: list, q0: int, K: int) -> None:
    """The 512-column pieces in ``group`` of one :func:`combine` tile, one PSUM accumulation group
    each, fed chunk by chunk (chunk-major: a piece's sum grows as the chunks' loads arrive, so the
    tile is done soon after its last load; each piece still adds the chunks in order 0, 1, ...)."""
    nt = o_sb.shape[0]
    n_tok = P // K
    nch = P // n_tok
    operands = []
    for j in range(len(parts)):
        c0 = (nch - 1 - j) * n_tok
        rows = parts[j][1] * K
        row = []
        for n0, nw in group:
            row.append((sel[:rows, c0:c0 + nt], y_sb[j][:rows, n0:n0 + nw]))
        operands.append(row)
    dsts = []
    for n0, nw in group:
        dsts.append(o_sb[:, n0:n0 + nw])
    accumulate_evacuate(dsts, operands, q0)
