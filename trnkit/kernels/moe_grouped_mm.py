"""NKI kernels of the grouped (per-expert) matmuls and the shared tile helpers of the MoE kernels.

Row layouts. A *row-indexed* HBM tensor is 2-D ``[R, W]``: a block reads / writes its rows through a
``[num_blocks, B]`` int32 table of row ids by indirect DMA (``.ap(vector_offset=ids)`` on the HBM
side); ids ``>= R`` mark padding and are skipped (``oob_mode.skip``). A *dispatch-order* tensor is 3-D
``[num_blocks, B, W]``: block ``i`` is its slab ``i`` (plain DMA with a run-time ``scalar_offset``).

Blocks of group ``g`` are ``block_start[0, g] .. block_start[0, g + 1] - 1``; kernels loop statically
over groups (each group's weights are loaded once, with big coalesced DMAs) and at run time
(``nl.fori_loop`` with register bounds) over the group's blocks.

LNC=2 (``kernel[2](...)``, one program per physical core): program p owns the p-th contiguous half of
the groups (:func:`owned_groups`), so each core loads only its experts' weights and runs only their
blocks; every block is computed exactly as on one core (results are bit-identical to LNC=1). Both
cores must take the same run-time control flow ("different control flow on the two cores is
undefined", NKI LNC guide), so the host lays the blocks out in pairs (``moe.block_layout(lnc=2)``):
group j of core 0 and group j of core 1 get the same number of blocks (the smaller one padding
blocks, whose rows are never stored), and an odd group count gets a last, all-padding group on core 1
(:func:`masked_group`: it loads the last real group's weights again and writes nowhere). Outputs
written per group / per row need no synchronisation (the cores write disjoint parts); only a K-way
combine of slots that both cores wrote waits at a ``core_barrier`` (or a new launch), and then the
cores sum pairs of equal token tiles (:func:`combine_pairs`).

Kernels:
* :func:`grouped_mm_kernel` ``out[rows] = x[rows] @ w[g]`` (or ``@ w[g].T``).
* :func:`grouped_wgrad_kernel` ``grad_w[g] = sum over row tiles of a[rows].T @ b[rows]`` (fp32, in PSUM);
  :func:`grouped_wgrad2_kernel` two such gradients of the same rows in one launch.
* :func:`combine` ``out[t] = sum_k y[t*K + k]`` (selection-matrix matmul on the Tensor Engine), called at
  the end of the forward and backward data-path kernels.
"""

from __future__ import annotations

from typing import Any

from trnkit.kernels._common import program_split
from trnkit.nki_api import nisa, nl, nki, nt

P = 128  # partitions (nl.tile_size.pmax); contraction chunk of nc_matmul
NMAX = 512  # nc_matmul moving free size (nl.tile_size.gemm_moving_fmax), one fp32 PSUM bank
PSUM_GROUPS = 4  # accumulation groups (PSUM banks) kept live per matmul pass


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """``[(start, width), ...]`` covering ``range(n)`` in pieces of at most ``size``."""
    out = []
    for s in range(0, n, size):
        out.append((s, min(size, n - s)))
    return out


def owned_groups(G: int) -> range:
    """The groups (experts) this program computes: all of them on a launch without a grid; on an
    LNC=2 launch program p takes the p-th contiguous half (``ceil(G / 2)`` groups for program 0)."""
    n_prog, pid = program_split()
    per = (G + n_prog - 1) // n_prog
    return range(min(G, pid * per), min(G, (pid + 1) * per))


def masked_group(g: int, G: int) -> int:
    """The group whose weights group g of a block layout loads: g itself, or for the all-padding group
    an LNC=2 layout adds to an odd group count (g == G) the last real one (so both cores issue the
    same loads; its blocks store nothing)."""
    return min(g, G - 1)


# ----------------------------------------------------------------------------------------- movement
def load_ids(table: Any, i: Any, sub: int, rows: int) -> Any:
    """Ids ``table[i, sub*P : sub*P + rows]`` (block ``i`` a run-time register) -> SBUF ``[rows, 1]``."""
    ids = nl.ndarray((rows, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids, src=table.ap(pattern=[[1, rows], [1, 1]], offset=sub * P,
                                        scalar_offset=i, indirect_dim=0))
    return ids


def load_rows(dst: Any, src: Any, table: Any, i: Any, sub: int, zero_pad: bool, col0: int = 0,
              ids: Any = None) -> None:
    """Rows of block ``i`` / sub-tile ``sub`` of ``src``, columns ``col0 ..``, into SBUF ``dst [rows, W]``.

    2-D ``src``: gather by the ids in ``table`` (padding ids skipped; ``zero_pad`` clears the tile
    first so padding rows are exact zeros, needed wherever rows are summed over). 3-D ``src``:
    dispatch-order slab ``i``. ``ids``: the block's ids already in SBUF (:func:`load_ids`), else loaded here.
    """
    rows, width = dst.shape
    full = src.shape[-1]
    if len(src.shape) == 3:
        nisa.dma_copy(dst=dst, src=src.ap(pattern=[[full, rows], [1, width]], offset=sub * P * full + col0,
                                          scalar_offset=i, indirect_dim=0))
        return
    if ids == None:  # noqa: E711
        ids = load_ids(table, i, sub, rows)
    if zero_pad:
        nisa.memset(dst=dst, value=0.0, engine=nisa.engine.gpsimd)
    nisa.dma_copy(dst=dst, src=src.ap(pattern=[[full, rows], [1, width]], offset=col0,
                                      vector_offset=ids, indirect_dim=0), oob_mode=nisa.oob_mode.skip)


def store_rows(dst: Any, src: Any, table: Any, i: Any, sub: int) -> None:
    """SBUF ``src [rows, W]`` -> rows of block ``i`` / sub-tile ``sub`` of ``dst`` (scatter for 2-D
    ``dst``, padding ids skipped; slab ``i`` for 3-D ``dst``)."""
    rows, width = src.shape
    if len(dst.shape) == 3:
        nisa.dma_copy(dst=dst.ap(pattern=[[width, rows], [1, width]], offset=sub * P * width,
                                 scalar_offset=i, indirect_dim=0), src=src)
        return
    ids = load_ids(table, i, sub, rows)
    nisa.dma_copy(dst=dst.ap(pattern=[[dst.shape[1], rows], [1, width]], offset=0, vector_offset=ids,
                             indirect_dim=0), src=src, oob_mode=nisa.oob_mode.skip)


def load_weight(w: Any, g: int) -> list:
    """``w[g] [R, C]`` (HBM, row-major) -> SBUF tiles ``[P, C]``, one per 128-row chunk c (row
    ``c*P + p`` on partition p of tile c), each loaded by its own DMA (one contiguous run of C
    elements per partition). Separate tiles: DMAs into one tile would each wait for the last, and
    chunk-sized transfers share the DMA queues with the block loads instead of waiting for a long
    free stretch.
    """
    _, R, C = w.shape
    out = []
    for r0, rw in chunks(R, P):
        t = nl.ndarray((P, C), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:rw, :], src=w.ap(pattern=[[C, rw], [1, C]], offset=(g * R + r0) * C))
        out.append(t)
    return out


def load_bias_rows(b: Any, g: int) -> Any:
    """Row ``b[g]`` of a bias ``[G, N]`` (HBM) broadcast to every partition: SBUF ``[P, N]`` (one DMA
    whose partition step is 0), the addend of a row-layout matmul output ``[rows, N]``."""
    _, N = b.shape
    t = nl.ndarray((P, N), dtype=b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=b.ap(pattern=[[0, P], [1, N]], offset=g * N))
    return t


def moving_view(w_sb: Any, grid: Any, c: int, ck: int, n0: int, nw: int) -> Any:
    """The moving operand of contraction chunk c, columns n0..n0+nw: a slice of the :func:`load_weight`
    tile ``w_sb``, or (``grid`` != None) of the :func:`transposed_weight` tile of that 512-column piece."""
    if grid == None:  # noqa: E711 (the NKI compiler rejects `is`)
        return w_sb[c][:ck, n0:n0 + nw]
    return grid[c][n0 // NMAX][:ck, :nw]


def evacuate(dst: Any, src: Any, k: int, scale: Any = None, bias: Any = None) -> None:
    """PSUM -> SBUF copy (with cast, optional per-partition ``scale [rows, 1]``), alternating the
    Vector and Scalar engines by ``k`` so neither becomes the bottleneck. ``bias`` (an SBUF tile of
    dst's shape) is added before the scaling: ``dst = (src + bias) * scale``."""
    if bias != None:  # noqa: E711
        if scale == None:  # noqa: E711
            nisa.tensor_tensor(dst=dst, data1=src, data2=bias, op=nl.add)
            return
        biased = nl.ndarray(dst.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=biased, data1=src, data2=bias, op=nl.add)
        nisa.activation(dst=dst, op=nl.copy, data=biased, scale=scale)
        return
    if scale != None or k % 2:  # noqa: E711 (NKI rejects is / is not)
        nisa.activation(dst=dst, op=nl.copy, data=src, scale=1.0 if scale == None else scale)  # noqa: E711 (the NKI compiler rejects `is`)
    else:
        nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.vector)


def transpose_rows(src: Any, dst: list, col0: int = 0, vector_every: int = 0) -> None:
    """SBUF ``src [rows, W]`` -> column chunk c of src on the partitions of ``dst[c][:, col0:col0+rows]``
    (the contraction layout of nc_matmul). One Tensor Engine transpose (own PSUM tile) and one
    evacuation per chunk; separate tiles per chunk keep the chunks independent.

    ``vector_every = n > 0``: every n-th chunk (whose sizes are multiples of 32) is transposed by the
    Vector Engine instead, in 32x32 blocks straight into SBUF -- for kernels whose Tensor Engine is
    the bottleneck while the Vector Engine has time to spare.
    """
    rows, width = src.shape
    cks = chunks(width, P)
    for c in range(len(cks)):
        w0, cw = cks[c]
        if vector_every and c % vector_every == vector_every - 1 and rows % 32 == 0 and cw % 32 == 0:
            for r0 in range(0, rows, 32):
                for k0 in range(0, cw, 32):
                    nisa.nc_transpose(dst=dst[c][k0:k0 + 32, col0 + r0:col0 + r0 + 32],
                                      data=src[r0:r0 + 32, w0 + k0:w0 + k0 + 32], engine=nisa.engine.vector)
            continue
        ps = nl.ndarray((cw, rows), dtype=src.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=src[:rows, w0:w0 + cw])
        evacuate(dst[c][:cw, col0:col0 + rows], ps, c)


def tiles(n: int, shape: tuple, dtype: Any, buffer: Any = None) -> list:
    """``n`` separate tiles (the current-NKI replacement of a block dimension)."""
    out = []
    for _ in range(n):
        out.append(nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf if buffer == None else buffer))  # noqa: E711 (the NKI compiler rejects `is`)
    return out


def transposed_weight(w_sb: Any, R: int, C: int, scalar_rows: int = 0) -> list:
    """``w.T [C, R]`` built from the :func:`load_weight` tiles ``[P, C]`` (read with :func:`moving_view`).

    Tiles ``[P, 512]`` per (C-chunk d, 512-column piece q of R); the up to 4 transposes of a piece
    share one PSUM tile and one evacuation (alternately Vector and Scalar; those of the first
    ``scalar_rows`` C-chunks all on Scalar, for a caller whose Vector Engine is still busy when the
    first matmuls need them).
    """
    grid = []
    k = 0
    for c0, cw in chunks(C, P):
        row = []
        for q0, qn in chunks(R, NMAX):
            ps = nl.ndarray((cw, qn), dtype=w_sb[0].dtype, buffer=nl.psum)
            for r0, rw in chunks(qn, P):
                nisa.nc_transpose(dst=ps[:, r0:r0 + rw], data=w_sb[(q0 + r0) // P][:rw, c0:c0 + cw])
            t = nl.ndarray((P, qn), dtype=w_sb[0].dtype, buffer=nl.sbuf)
            evacuate(t[:cw, :], ps, k, 1.0 if len(grid) < scalar_rows else None)  # a scale: on Scalar
            k += 1
            row.append(t)
        grid.append(row)
    return grid


def block_range(block_start: Any, g: int, bs_sb: Any) -> tuple[Any, Any]:
    """Registers holding ``block_start[0, g]`` and ``block_start[0, g + 1]`` (bs_sb: SBUF copy)."""
    lo = nisa.register_alloc()
    hi = nisa.register_alloc()
    nisa.register_load(lo, bs_sb[0:1, g:g + 1])
    nisa.register_load(hi, bs_sb[0:1, g + 1:g + 2])
    return lo, hi


def load_block_start(block_start: Any) -> Any:
    """HBM ``block_start [1, n]`` int32 -> an SBUF copy ``[1, n]`` (one partition row) for register loads."""
    bs = nl.ndarray(block_start.shape, dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=bs, src=block_start)
    return bs


def row_matmul(out_sb: Any, lhs_T: list, rows: int, w_sb: Any, contract: int, col0: int = 0,
               scale: Any = None, grid: Any = None, bias: Any = None) -> None:
    """``out_sb [rows, N] = lhs [rows, contract] @ rhs [contract, N]``.

    ``lhs_T[c]`` holds chunk c of lhs transposed (contraction on partitions, lhs rows at columns
    col0..col0+rows); rhs is the weight tile ``w_sb`` (or its transposed ``grid``), read with
    :func:`moving_view`. The lhs chunk is the stationary operand (M = rows <= 128) and feeds up to
    PSUM_GROUPS moving pieces of 512 columns (separate PSUM accumulation groups). ``scale [rows, 1]``
    multiplies each output row while PSUM is evacuated; ``bias`` (a :func:`load_bias_rows` tile
    ``[P, N]``) is added to every row before that.
    """
    pieces = chunks(out_sb.shape[1], NMAX)
    for q0 in range(0, len(pieces), PSUM_GROUPS):
        _row_matmul_pass(out_sb, lhs_T, rows, w_sb, grid, contract, col0, scale, pieces[q0:q0 + PSUM_GROUPS], q0,
                         bias)


def _row_matmul_pass(out_sb: Any, lhs_T: list, rows: int, w_sb: Any, grid: Any, contract: int, col0: int,
                     scale: Any, group: list, q0: int, bias: Any = None) -> None:
    """One pass of :func:`row_matmul` over the 512-column pieces in ``group`` (its PSUM tiles are
    local, so their banks are free again when the pass returns)."""
    ps = []
    for _, nw in group:
        ps.append(nl.ndarray((rows, nw), dtype=nl.float32, buffer=nl.psum))
    cks = chunks(contract, P)
    for c in range(len(cks)):
        ck = cks[c][1]
        for j in range(len(group)):
            n0, nw = group[j]
            nisa.nc_matmul(dst=ps[j], stationary=lhs_T[c][:ck, col0:col0 + rows],
                           moving=moving_view(w_sb, grid, c, ck, n0, nw), accumulate=c > 0)
    for j in range(len(group)):
        n0, nw = group[j]
        piece_bias = None
        if bias != None:  # noqa: E711
            piece_bias = bias[:rows, n0:n0 + nw]
        evacuate(out_sb[:rows, n0:n0 + nw], ps[j], q0 + j, scale, piece_bias)


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
WGRAD_MAX_SLOTS = 8  # cached row tiles per group; the bounds row has WGRAD_MAX_SLOTS + 3 entries per group
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

    Row tiles: ``table [NT, rows]`` int32 (rows <= 128) holds the row ids of tile ``t``; an operand is
    either ``[R, W]`` (tile t gathers rows ``table[t]`` by indirect DMA) or ``[NT, rows, W]`` (slab t,
    dispatch order). ``bounds [1, G * (WGRAD_MAX_SLOTS + 3)]`` int32, per group g: ``e_0 .. e_MAX``
    (``e_j = lo + min(j, n)`` for g's n tiles ``lo .. lo + n - 1``), ``hi = lo + n`` and ``z = lo + (n == 0)``
    (``moe._wgrad_bounds``). Padding rows of a partial tile must contribute zero: with ``zero_pad`` the
    gathered tiles are zero-filled and padding ids skipped (ids >= R); without it the padding ids must
    name a finite row and the other operand's padding rows be zeros (the MoE backward's ``w * h`` and
    gate/up gradients are, since their affinity is 0).

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
    ps = []
    for k0, kw, n0, nw in tl:
        ps.append(nl.ndarray((kw, nw), dtype=nl.float32, buffer=nl.psum))
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
    for t in range(len(tl)):
        k0, kw, n0, nw = tl[t]
        nisa.nc_matmul(dst=ps[t], stationary=a_t[:rows, k0 - k_lo:k0 - k_lo + kw],
                       moving=b_t[:rows, n0 - n_lo:n0 - n_lo + nw], accumulate=not start)


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
        for u in range(t, end):
            c0 = tl[u][2] - n0
            evacuate(res[:, c0:c0 + tl[u][3]], ps[u], evac + u)
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
    ps = []
    for _, nw in group:
        ps.append(nl.ndarray((nt, nw), dtype=nl.float32, buffer=nl.psum))
    for j in range(len(parts)):
        c0 = (nch - 1 - j) * n_tok
        rows = parts[j][1] * K
        for q in range(len(group)):
            n0, nw = group[q]
            nisa.nc_matmul(dst=ps[q], stationary=sel[:rows, c0:c0 + nt], moving=y_sb[j][:rows, n0:n0 + nw],
                           accumulate=j > 0)
    for q in range(len(group)):
        n0, nw = group[q]
        evacuate(o_sb[:, n0:n0 + nw], ps[q], q0 + q)
