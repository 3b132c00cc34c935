"""Tile helpers shared by the NKI kernels (trace-time Python functions called from kernel code; they
follow the same source rules as the kernels).

Row layouts. A *row-indexed* HBM tensor is 2-D ``[R, W]``: a block reads / writes its rows through a
``[num_blocks, B]`` int32 table of row ids by indirect DMA (``.ap(vector_offset=ids)`` on the HBM
side); ids ``>= R`` mark padding and are skipped (``oob_mode.skip``). A *dispatch-order* tensor is 3-D
``[num_blocks, B, W]``: block ``i`` is its slab ``i`` (plain DMA with a run-time ``scalar_offset``).
Blocks of group ``g`` are ``block_start[0, g] .. block_start[0, g + 1] - 1`` (:func:`block_range`).

Weights: :func:`load_weight` puts ``w[g]`` in SBUF as 128-row tiles, :func:`transposed_weight` builds
its transpose on the Tensor Engine, :func:`row_matmul` multiplies rows by it (PSUM accumulation,
evacuated by :func:`evacuate`).
"""

from __future__ import annotations

from typing import Any

from trnkit.nki_api import nisa, nl

P = 128  # partitions (nl.tile_size.pmax); contraction chunk of nc_matmul
NMAX = 512  # nc_matmul moving free size (nl.tile_size.gemm_moving_fmax), one fp32 PSUM bank
PSUM_GROUPS = 4  # accumulation groups (PSUM banks) kept live per matmul pass


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """``[(start, width), ...]`` covering ``range(n)`` in pieces of at most ``size``."""
    out = []
    for s in range(0, n, size):
        out.append((s, min(size, n - s)))
    return out


def program_split() -> tuple:
    """``(number of programs, this program's id)`` along grid axis 0 inside a kernel: ``(2, 0|1)`` for
    ``kernel[2](...)`` (LNC=2), ``(1, 0)`` for a launch without a grid, where the program queries are
    not asked (nki-library's ``get_program_sharding_info`` does the same)."""
    if nl.program_ndim() == 0:
        return 1, 0
    return nl.num_programs(0), nl.program_id(0)


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


TRANSPOSE_GROUP = 4  # Tensor Engine transposes sharing one PSUM tile and one evacuation


def chunk_tile(n: int, width: int, dtype: Any) -> tuple[Any, list]:
    """One SBUF tile ``[P, n, width]`` and its n chunk views ``[P, width]`` (chunk c at ``[:, c, :]``): the
    contraction layout of :func:`transpose_rows`, in one tile so that one instruction can fill
    several chunks (:func:`transpose_rows_grouped`)."""
    t = nl.ndarray((P, n, width), dtype=dtype, buffer=nl.sbuf)
    views = []
    for c in range(n):
        views.append(t[:, c, :])
    return t, views


def transpose_rows_grouped(src: Any, dst: Any, col0: int = 0, scalar: bool = False) -> None:
    """:func:`transpose_rows` into a :func:`chunk_tile` ``dst [P, n, W']``: column chunk c of ``src [rows,
    W]`` on the partitions of ``dst[:, c, col0:col0+rows]``. Up to TRANSPOSE_GROUP chunks of equal width
    share one PSUM tile and one evacuation (a quarter of the per-instruction fixed costs), on the
    Vector Engine, or with ``scalar`` on the Scalar Engine (for a kernel whose Vector Engine is busier)."""
    rows, width = src.shape
    cks = chunks(width, P)
    g0 = 0
    while g0 < len(cks):
        cw = cks[g0][1]
        n = 1
        while n < TRANSPOSE_GROUP and g0 + n < len(cks) and cks[g0 + n][1] == cw:
            n += 1
        ps = nl.ndarray((cw, n, rows), dtype=src.dtype, buffer=nl.psum)
        for j in range(n):
            w0 = cks[g0 + j][0]
            nisa.nc_transpose(dst=ps[:, j, :], data=src[:rows, w0:w0 + cw])
        out = dst[:cw, g0:g0 + n, col0:col0 + rows]
        if scalar:
            nisa.activation(dst=out, op=nl.copy, data=ps)
        else:
            nisa.tensor_copy(dst=out, src=ps, engine=nisa.engine.vector)
        g0 += n


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
    cks = chunks(contract, P)
    operands = []
    for c in range(len(cks)):
        ck = cks[c][1]
        row = []
        for n0, nw in group:
            row.append((lhs_T[c][:ck, col0:col0 + rows], moving_view(w_sb, grid, c, ck, n0, nw)))
        operands.append(row)
    dsts = []
    biases = None
    if bias != None:  # noqa: E711
        biases = []
    for n0, nw in group:
        dsts.append(out_sb[:rows, n0:n0 + nw])
        if bias != None:  # noqa: E711
            biases.append(bias[:rows, n0:n0 + nw])
    accumulate_evacuate(dsts, operands, q0, scale, biases)


# ------------------------------------------------------------------------- PSUM accumulation groups
def identity(dtype: Any) -> Any:
    """``[P, P]`` identity in ``dtype`` (1 where column == partition): the stationary operand of transposes
    and of summing matmuls."""
    ones = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    ident = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
    nisa.affine_select(dst=ident, pattern=[[1, P]], channel_multiplier=-1, on_true_tile=ones,
                       on_false_value=0.0, cmp_op=nl.equal)
    return ident


def psum_tiles(shapes: list) -> list:
    """One fp32 PSUM tile per shape, each the home of one matmul accumulation group."""
    out = []
    for shape in shapes:
        out.append(nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum))
    return out


def accumulate(ps: list, operands: list, start: bool = True) -> None:
    """Matmul accumulation groups ``ps[j] += operands[c][j][0].T @ operands[c][j][1]`` over the
    contraction chunks c (each entry a ``(stationary, moving)`` pair), issued chunk-major: for each
    chunk every group in order, so consecutive matmuls write different PSUM tiles. ``start``: chunk 0
    opens each group (``accumulate=False``); False continues groups opened by an earlier call (a sum
    over loads that arrive one by one)."""
    for c in range(len(operands)):
        for j in range(len(ps)):
            nisa.nc_matmul(dst=ps[j], stationary=operands[c][j][0], moving=operands[c][j][1],
                           accumulate=c > 0 or not start)


def evacuate_tiles(dsts: list, ps: list, k0: int = 0, scale: Any = None, biases: Any = None,
                   engines: Any = None) -> None:
    """PSUM tiles ``ps[j]`` -> ``dsts[j]``: by :func:`evacuate` (engines alternating from ``k0``, the
    optional per-row ``scale`` and per-tile ``biases``) or, with ``engines`` given, by one
    ``tensor_copy`` each on ``engines[j]``."""
    for j in range(len(ps)):
        if engines != None:  # noqa: E711 (the NKI compiler rejects `is`)
            nisa.tensor_copy(dst=dsts[j], src=ps[j], engine=engines[j])
        else:
            b = None
            if biases != None:  # noqa: E711
                b = biases[j]
            evacuate(dsts[j], ps[j], k0 + j, scale, b)


def accumulate_evacuate(dsts: list, operands: list, k0: int = 0, scale: Any = None, biases: Any = None,
                        engines: Any = None) -> None:
    """``dsts[j] = sum over c of operands[c][j][0].T @ operands[c][j][1]``: the accumulation groups of
    :func:`accumulate` in fp32 PSUM tiles of the dsts' shapes (local: their banks are free again when
    this returns), then evacuated by :func:`evacuate_tiles` (the rounding to the dsts' dtype)."""
    shapes = []
    for d in dsts:
        shapes.append(d.shape)
    ps = psum_tiles(shapes)
    accumulate(ps, operands)
    evacuate_tiles(dsts, ps, k0, scale, biases, engines)
