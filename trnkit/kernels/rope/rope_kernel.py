"""NKI kernel of HF rotate-half RoPE, :func:`rope_hf_kernel` (forward and backward; semantics:
:mod:`trnkit.kernels.rope`).

Tiling (both layouts): sequence rows on partitions, and each partition holds ``NT`` *consecutive* rows,
so every DMA moves one contiguous run of ``NT * D`` (bhsd) or ``NT * H * D`` (bshd) elements per
partition (8 KiB per head tile in bhsd); the next head tiles' loads are issued ahead of the current one.
cos/sin are loaded once per group of rows of a chunk (and batch, when they are per-batch) and reused by
every head of q and k. A short tail chunk uses fewer partitions (any S works).
Engines: with ``y = x*cos + swap_halves(x*t)``, ``t = [sin[h:], -sin[:h]]`` (forward) or
``[-sin[:h], sin[h:]]`` (backward), the Vector engine forms the two products over whole contiguous rows
(bf16: all operands bf16 in SBUF, VectorE's trn2 performance mode); the Tensor engine sums them as
identity matmuls accumulating in an fp32 PSUM bank (the swapped halves are just the matmuls' operand
views); the Scalar engine copies the sum out of PSUM (the one rounding) and builds the tables (copies,
one negation) once per row group. No engine relies on a PSUM-operand or GpSimd rate assumption.
The [B, S, H, D] layout reads one ``[NT, H, D]`` slab per partition; its tables hold each row once per
head of a slab, so no transposed copy of q/k is ever made and every Vector operand stays contiguous.
"""

from __future__ import annotations

from trnkit.kernels._common import P_MAX, program_share, row_chunks
from trnkit.kernels.rope.constraints import BSHD_SLAB_BYTES
from trnkit.kernels.tiles import identity, program_split
from trnkit.nki_api import nisa, nki, nl, nt

# Bytes per partition per head tile moved by one DMA: 8 KiB (4096 bf16 / 2048 fp32 elements), 94 % of
# the DMA peak even at the pessimistic 512 B efficiency knee (cost_params.dma_knee_bytes).
TILE_BYTES = 8192
# Head tiles whose loads are issued ahead of the one being computed (the loads are then in flight while
# the previous tiles compute and store).
PREFETCH = 2
PSUM_FMAX = 512  # fp32 elements per partition in one PSUM bank


def _load_tables(cos, sin, packed, b, s0, P, NT, D, j0, nj, dtype, backward, G=1):
    """Tables of rows ``s0 + p*NT + j``, ``j0 <= j < j0 + nj`` (batch ``b`` if 3-D) in ``dtype``:
    ``cos`` and ``t`` = ``[sin[h:], -sin[:h]]`` (forward) or ``[-sin[:h], sin[h:]]`` (backward), each
    ``[P, nj, G*D]``: every row repeated for ``G`` heads (the [B, S, H, D] layout's slabs span G heads;
    contiguous operands keep the Vector engine's products in its performance mode). One DMA per HBM
    table (the packed cache's ``cos | sin`` rows are one contiguous run per partition), then three
    Scalar-engine passes: copies (rounding to bf16 for bf16 activations, as transformers does with
    cos/sin) and a negation (exact)."""
    h = D // 2
    rows = cos.shape[-2]
    width = cos.shape[-1]  # D, or 2D for the packed cache (cos | sin per row)
    base = ((b * rows + s0) * width if len(cos.shape) == 3 else s0 * width) + j0 * width
    pat = [[NT * width, P], [width, nj], [1, width]]
    raw_c = nl.ndarray((P, nj, width), dtype=cos.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=raw_c, src=cos.ap(pattern=pat, offset=base))
    raw_s, s_off = raw_c, D
    if not packed:
        raw_s = nl.ndarray((P, nj, width), dtype=sin.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=raw_s, src=sin.ap(pattern=pat, offset=base))
        s_off = 0
    act = nisa.engine.scalar
    c_t = nl.ndarray((P, nj, G * D), dtype=dtype, buffer=nl.sbuf)
    t_t = nl.ndarray((P, nj, G * D), dtype=dtype, buffer=nl.sbuf)
    pos, neg = (h, 0) if backward else (0, h)  # where sin[h:] and -sin[:h] go in t
    # [P, nj, G, n] views: the raw rows with a stride-0 head axis, the tables' G copies of a row
    raw = [[nj * width, P], [width, nj], [0, G]]
    tab = [[nj * G * D, P], [G * D, nj], [D, G]]
    nisa.tensor_copy(dst=c_t.ap(pattern=tab + [[1, D]], offset=0),
                     src=raw_c.ap(pattern=raw + [[1, D]], offset=0), engine=act)
    nisa.tensor_copy(dst=t_t.ap(pattern=tab + [[1, h]], offset=pos),
                     src=raw_s.ap(pattern=raw + [[1, h]], offset=s_off + h), engine=act)
    nisa.tensor_scalar(dst=t_t.ap(pattern=tab + [[1, h]], offset=neg),
                       data=raw_s.ap(pattern=raw + [[1, h]], offset=s_off), op0=nl.multiply, operand0=-1.0,
                       engine=act)
    return c_t, t_t


def _rotate_slab(y_v, x_v, c_v, t_v, ident, P, pipe, store, load):
    """One slab (<= 512 elements per partition, last dim D; ``c_v``/``t_v`` views of x's shape): the
    products ``a = x*cos`` and ``p = x*t`` on the Vector engine, then the sum ``a + swap_halves(p)`` on
    the Tensor engine. ``swap_halves(p)`` holds ``x[h:]*sin[h:]`` / ``-x[:h]*sin[:h]`` (backward) or
    ``-x[h:]*sin[:h]`` / ``x[:h]*sin[h:]`` (forward) in its halves: the reference's products bit for bit.
    The accumulating matmuls are pipelined by one slab (``pipe[0]`` holds the previous slab's, with its
    copy and store), so TensorE never waits on the accumulation it has just started and the Scalar engine
    never on a matmul in flight. ``load``: see :func:`_product_engine`."""
    dtype = x_v.dtype
    shape = x_v.shape
    n = 1  # elements per partition
    for d in range(1, len(shape)):
        n = n * shape[d]
    eng = _product_engine(load, n, dtype)
    a_t = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    p_t = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=a_t, data1=x_v, data2=c_v, op=nl.multiply, engine=eng)
    nisa.tensor_tensor(dst=p_t, data1=x_v, data2=t_v, op=nl.multiply, engine=eng)
    y_ps = nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=y_ps, stationary=ident[0:P, 0:P], moving=a_t, accumulate=False)  # opens the group
    _finish(pipe, ident)
    pipe[0] = (y_ps, p_t, y_v, P, store)


# fp32 products, ns per element per partition (two per element): Vector at 2 cycles per element
# (fp32 operands: no single pass, no performance mode) and 0.96 GHz; GpSimd at 2 inputs / 0.25 elements per
# cycle at 1.2 GHz, the slowest GpSimd rate trnkit's cost model considers (no public figure), so the share
# never makes GpSimd the bottleneck and a faster GpSimd only leaves it idle.
_VECTOR_FP32_NS = 2 * 2 / 0.96
_GPSIMD_FP32_NS = 2 * 2 / 0.25 / 1.2


def _product_engine(load, n, dtype):
    """Engine of a slab's ``n`` elements (per partition) of products: bf16 always Vector (its performance mode uses
    the SBUF bus it shares with GpSimd, so a GpSimd share would only slow it); fp32 greedily balanced
    with GpSimd (``load`` = [vector_ns, gpsimd_ns], updated)."""
    if dtype != nl.float32:
        return nisa.engine.vector
    v, g = load[0] + n * _VECTOR_FP32_NS, load[1] + n * _GPSIMD_FP32_NS
    if v <= g:
        load[0] = v
        return nisa.engine.vector
    load[1] = g
    return nisa.engine.gpsimd


def _finish(pipe, ident):
    """The pending slab's accumulating matmuls, its PSUM -> SBUF copy on the Scalar engine
    (the one rounding of the sum) and, after its tile's last slab, the tile's store."""
    if pipe[0] != None:  # noqa: E711 (the NKI compiler rejects `is`)
        y_ps, p_t, y_v, P, store = pipe[0]
        D = p_t.shape[-1]
        h = D // 2
        # y += swap_halves(p): the two halves of p accumulate into the opposite halves of y
        nisa.nc_matmul(dst=y_ps[..., 0:h], stationary=ident[0:P, 0:P], moving=p_t[..., h:D], accumulate=True)
        nisa.nc_matmul(dst=y_ps[..., h:D], stationary=ident[0:P, 0:P], moving=p_t[..., 0:h], accumulate=True)
        nisa.tensor_copy(dst=y_v, src=y_ps, engine=nisa.engine.scalar)
        if store != None:  # noqa: E711
            nisa.dma_copy(dst=store[0], src=store[1])
        pipe[0] = None


def _my_chunks(chunks, n_prog, pid):
    """This program's row chunks (:func:`program_share`: pairs of equal chunks, masked work where a
    chunk has no partner)."""
    keys = []
    for c in chunks:
        keys.append((c[1], c[2]))
    return program_share(list(chunks), keys, n_prog, pid)


def _masked_outputs(q, k, mine, shapes):
    """Scratch tensors (private HBM, ``shapes`` for q and k) where this program stores masked work
    instead of q_out / k_out: ``[for q, for k]``, empty without masked chunks. Each tile of a masked
    chunk has its own place, so the stores do not wait for each other."""
    scratch = []
    for i in range(len(mine)):
        if mine[i][1] and len(scratch) == 0:
            scratch.append(nl.ndarray(shapes[0], dtype=q.dtype, buffer=nl.private_hbm))
            scratch.append(nl.ndarray(shapes[1], dtype=k.dtype, buffer=nl.private_hbm))
    return scratch


def _bhsd_tiles(q, k, q_out, k_out, cos, chunks, n_prog, pid):
    """This program's head tiles, in order: ``(x, (out, out offset), HBM offset, (s0, P, NT), table batch,
    first)``; ``first`` marks the first tile of each set of tiles sharing one (chunk, table batch) of
    tables. A masked chunk's tiles store to a scratch tensor, each head tile to its own place."""
    B, _, S, D = q.shape
    per_batch = len(cos.shape) == 3
    mine = _my_chunks(chunks, n_prog, pid)
    tile = P_MAX * chunks[0][2] * D  # elements of the largest chunk's head tile
    scratch = _masked_outputs(q, k, mine, ((B * q.shape[1], tile), (B * k.shape[1], tile)))
    tiles = []
    for chunk, masked in mine:
        s0 = chunk[0]
        for bt in range(B if per_batch else 1):
            b_lo, b_hi = (bt, bt + 1) if per_batch else (0, B)
            first = True
            for b in range(b_lo, b_hi):
                for w in range(2):
                    x, x_out = ((q, q_out), (k, k_out))[w]
                    H = x.shape[1]
                    for hd in range(H):
                        off = ((b * H + hd) * S + s0) * D
                        dst = (scratch[w], (b * H + hd) * tile) if masked else (x_out, off)
                        tiles.append((x, dst, off, chunk, bt, first))
                        first = False
    return tiles


def _rope_bhsd(tiles, cos, sin, packed, backward, ident, pipe, load):
    """Every head tile of :func:`_bhsd_tiles`; the loads run PREFETCH tiles ahead, across chunks: a new
    chunk's tables are loaded with its first tile's prefetch (the very first chunk's slab by slab, as the
    first tile needs them)."""
    D = tiles[0][0].shape[3]
    ns = max(1, PSUM_FMAX // D)  # rows per slab (and per table group)
    tab_sets = []  # per table set: per slab of rows (cos, t)
    cur = -1  # the table set of tile i
    x_tiles = []
    for i in range(len(tiles)):
        for j in range(len(x_tiles), min(len(tiles), i + 1 + PREFETCH)):
            x, _, off, (s0, P, NT), bt, first = tiles[j]
            x_j = nl.ndarray((P, NT, D), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_j, src=x.ap(pattern=[[NT * D, P], [D, NT], [1, D]], offset=off))
            x_tiles.append(x_j)
            if first:
                tab_sets.append([])
                for t0 in range(0, NT if j > 0 else 0, ns):
                    tab_sets[-1].append(_load_tables(cos, sin, packed, bt, s0, P, NT, D, t0, min(NT, t0 + ns) - t0,
                                                     x.dtype, backward))
        x, (x_out, out_off), off, (s0, P, NT), bt, first = tiles[i]
        if first:
            cur = cur + 1
        tabs = tab_sets[cur]
        pat = [[NT * D, P], [D, NT], [1, D]]
        x_t = x_tiles[i]
        x_tiles[i] = None  # (released once its slabs are issued)
        y_t = nl.ndarray((P, NT, D), dtype=x.dtype, buffer=nl.sbuf)
        for t0 in range(0, NT, ns):
            t1 = min(NT, t0 + ns)
            if len(tabs) == t0 // ns:
                tabs.append(_load_tables(cos, sin, packed, bt, s0, P, NT, D, t0, t1 - t0, x.dtype, backward))
            c_v, t_v = tabs[t0 // ns]
            store = (x_out.ap(pattern=pat, offset=out_off), y_t) if t1 == NT else None
            _rotate_slab(y_t[:, t0:t1, :], x_t[:, t0:t1, :], c_v, t_v, ident, P, pipe, store, load)


def _bshd_rows(x, NT, P, off, r0, r1):
    """HBM view of rows ``r0:r1`` of every partition's NT-row slab of ``x [B, S, H, D]`` (from ``off``)."""
    H, D = x.shape[2], x.shape[3]
    return x.ap(pattern=[[NT * H * D, P], [H * D, r1 - r0], [D, H], [1, D]], offset=off + r0 * H * D)


def _rope_bshd(q, k, q_out, k_out, cos, sin, packed, backward, chunks, n_prog, pid, ident, pipe, load):
    """The [B, S, H, D] layout: per chunk and batch one ``[NT, H, D]`` slab per partition of q, then of k,
    each one load and one store. The next slab's load, and a new chunk's tables, are issued one slab
    ahead (across chunks) when four slabs fit in SBUF. (Storing a slab in row groups as soon as they are
    done models slower: the stores' fixed costs fragment the DMA queue between the large loads.)"""
    B, S, _, D = q.shape
    per_batch = len(cos.shape) == 3
    isz = 4 if q.dtype == nl.float32 else 2
    tg = max(1, PSUM_FMAX // D)  # rows per table group
    tiles = []  # (x, (out, out offset), HBM offset, (s0, P, NT), batch); masked chunks store to scratch
    mine = _my_chunks(chunks, n_prog, pid)
    rows = P_MAX * chunks[0][2]
    scratch = _masked_outputs(q, k, mine, ((B, rows, q.shape[2], D), (B, rows, k.shape[2], D)))
    for chunk, masked in mine:
        for b in range(B):
            for w in range(2):
                x, x_out = ((q, q_out), (k, k_out))[w]
                off = (b * S + chunk[0]) * x.shape[2] * D
                dst = (scratch[w], b * rows * x.shape[2] * D) if masked else (x_out, off)
                tiles.append((x, dst, off, chunk, b))
    # the next slab's load in flight too when four row slabs (x, the next x, y, the previous y) fit
    ahead = 1 if 4 * chunks[0][2] * max(q.shape[2], k.shape[2]) * D * isz <= BSHD_SLAB_BYTES else 0
    tab_keys = []  # (s0, table batch, heads per row) of each table set
    tab_sets = []  # per table set: per group of rows (cos, t), each row repeated for G heads
    x_tiles = []
    for i in range(len(tiles)):
        for j in range(len(x_tiles), min(len(tiles), i + 1 + ahead)):
            x, _, off, (s0, P, NT), b = tiles[j]
            H = x.shape[2]
            G = max(1, min(H, PSUM_FMAX // D))  # heads per slab
            x_j = nl.ndarray((P, NT, H, D), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_j, src=_bshd_rows(x, NT, P, off, 0, NT))
            x_tiles.append(x_j)
            key = (s0, b if per_batch else 0, G)
            if key not in tab_keys:
                tab_keys.append(key)
                tab_sets.append([])
                for j0 in range(0, NT if j > 0 else 0, tg):  # (the first set: group by group, as needed)
                    tab_sets[-1].append(_load_tables(cos, sin, packed, b, s0, P, NT, D, j0, min(NT, j0 + tg) - j0,
                                                     x.dtype, backward, G))
        x, (x_out, out_off), off, (s0, P, NT), b = tiles[i]
        H = x.shape[2]
        G = max(1, min(H, PSUM_FMAX // D))
        ns = max(1, PSUM_FMAX // (G * D))  # rows per slab
        tabs = tab_sets[tab_keys.index((s0, b if per_batch else 0, G))]
        x_t = x_tiles[i]
        x_tiles[i] = None
        y_t = nl.ndarray((P, NT, H, D), dtype=x.dtype, buffer=nl.sbuf)
        for j0 in range(0, NT, tg):
            j1 = min(NT, j0 + tg)
            nj = j1 - j0
            if len(tabs) == j0 // tg:
                tabs.append(_load_tables(cos, sin, packed, b, s0, P, NT, D, j0, nj, x.dtype, backward, G))
            c_t, t_t = tabs[j0 // tg]
            for t0 in range(j0, j1, ns):
                t1 = min(j1, t0 + ns)
                for g0 in range(0, H, G):
                    g1 = min(H, g0 + G)
                    # the group's rows t0:t1, first g1 - g0 of its G copies per row: [P, rows, heads, D]
                    view = [[nj * G * D, P], [G * D, t1 - t0], [D, g1 - g0], [1, D]]
                    c_v = c_t.ap(pattern=view, offset=(t0 - j0) * G * D)
                    t_v = t_t.ap(pattern=view, offset=(t0 - j0) * G * D)
                    last = t1 == NT and g1 == H
                    store = (_bshd_rows(x_out, NT, P, out_off, 0, NT), y_t) if last else None
                    _rotate_slab(y_t[:, t0:t1, g0:g1, :], x_t[:, t0:t1, g0:g1, :], c_v, t_v, ident, P, pipe,
                                 store, load)
        x_t, y_t = None, None  # release the row slabs before the next tile's allocation


@nki.jit
def rope_hf_kernel(q, k, q_out: nt.mutable_tensor, k_out: nt.mutable_tensor, cos, sin, packed=False,
                   backward=False, bshd=False):
    """The NKI kernel behind :func:`rope_hf` / :func:`rope_hf_bshd` (inputs already validated).

    ``packed=True``: ``cos`` and ``sin`` are both the packed ``rope_cache`` (cos | sin per row).
    Row chunks are split across SPMD programs (``rope_hf_kernel[2](...)`` on LNC=2), in pairs of equal
    chunks; a chunk without a partner (the short ones at the end of S) is computed by the second program
    too, into a private scratch tensor, so both programs run the same instructions.
    """
    D = q.shape[3]
    n_prog, pid = program_split()
    free = TILE_BYTES // (4 if q.dtype == nl.float32 else 2)  # elements per partition per head tile
    if bshd:
        S = q.shape[1]
        # ~free elements per partition for the smaller of q / k, at most 4x that for the larger one (SBUF)
        h_lo, h_hi = min(q.shape[2], k.shape[2]), max(q.shape[2], k.shape[2])
        nt_max = max(1, min(free // D, free // (h_lo * D), 4 * free // (h_hi * D)))
    else:
        S = q.shape[2]
        nt_max = max(1, free // D)
    # at least one full chunk per program when S allows it (LNC=2 splits chunks)
    nt_max = max(1, min(nt_max, S // (P_MAX * n_prog)))
    chunks = row_chunks(S, nt_max)
    ident = identity(q.dtype)
    pipe = [None]  # the last slab whose accumulating matmuls, copy and store are not yet issued
    load = [0.0, 0.0]  # fp32 product time given to Vector and GpSimd (ns per partition)
    if bshd:
        _rope_bshd(q, k, q_out, k_out, cos, sin, packed, backward, chunks, n_prog, pid, ident, pipe, load)
    else:
        tiles = _bhsd_tiles(q, k, q_out, k_out, cos, chunks, n_prog, pid)
        if len(tiles) > 0:
            _rope_bhsd(tiles, cos, sin, packed, backward, ident, pipe, load)
    _finish(pipe, ident)
    return q_out, k_out
