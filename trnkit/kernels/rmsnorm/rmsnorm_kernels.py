"""RMSNorm forward and backward NKI kernels (``rmsnorm_fwd_kernel``, ``rmsnorm_bwd_kernel``).

Rows (tokens; Qwen3's q/k head norm: one row per (token, head)) go on partitions: partition ``p`` of
a chunk holds ``NT`` consecutive rows, so every DMA moves one contiguous run of ``NT * H`` elements
per partition (about 8 KiB), and the next two chunks' loads are issued before the current chunk's stores.
H is the free dimension, so every per-row statistic is a free-axis reduction and every per-row scale
a per-partition scalar. LNC=2 (``kernel[2]``) gives each core a contiguous half of the rows.

Forward (``y = w * (x * rstd).to(x.dtype)``, ``rstd = rsqrt(mean(x^2) + eps)``, HF's cast order), rows of
``WIDE`` elements or more: Scalar squares and sums each row (``activation_reduce``), then ``rstd`` in two
Vector ``tensor_scalar`` passes over the chunk's ``[P, NT]`` sums (so Scalar keeps one activation table);
Vector forms ``n = x * rstd`` (rounded to x's dtype) and ``y = n * w`` (``w`` broadcast to every partition
once). With a residual, Vector first adds ``s = x + residual`` (stored: the new residual stream) and
normalises ``s``. The forward splits rows wider than 16 KiB, and spreads a few rows (fewer than 64 per
core), over ``f`` partitions each (:func:`split_factor`): it then works on the ``[N*f, H/f]`` sub-rows, one
per partition, and each row's f partial sums of squares add up on the Tensor engine (a ``[P, P/f]`` 0/1
matrix as the stationary operand), which also sends ``rstd`` back to the row's partitions. A Scalar
square of one element first loads the activation table while the first rows load.

Forward, narrower rows (Qwen3's q/k head norm, H = 128; :func:`_narrow_forward`): a per-row instruction would
cost mostly its fixed time, so every pass covers a whole chunk (4 KiB per partition, 8 KiB past 64 KiB of a
core's rows; the first two and the last two smaller). The Tensor engine transposes each slot of 128 rows into
PSUM, Scalar squares a PSUM bank of slots per instruction, and per slot a matmul against a ``1/H`` column adds
the squares over the partitions into a PSUM tile of sums that a matmul opened with eps (one tile per run of up
to three equal chunks). Vector takes the chunk's rsqrt straight into x's dtype (so ``n = x * rstd``, rstd
broadcast along H, and ``y = n * w`` run in Vector's 2-byte mode; fp32 rows read an fp32 rsqrt in PSUM), in
the order rsqrt of chunk i, y of chunk i-1, n of chunk i; the stored fp32 rstd is one more rsqrt per run (the
last runs' on Scalar, after its last square). Loads go through the Scalar engine's DMA queue, stores through
the Sync engine's.

Backward (``gw = (dy * w).to(x.dtype)``, ``dx = rstd * gw - x * rstd^3 * sum(gw * x) / H``,
``dw = sum_rows dy * n``): Vector forms ``gw`` and ``prod = dy * x``; for wide rows the row sum
``D = sum(gw * x)`` is a Vector product summed on Scalar. ``dw = sum_rows rstd * prod``'s sum over
rows is a sum over partitions, done on the Tensor engine: each 128-column piece c of
a row of ``prod`` is the stationary operand of a matmul whose moving operand is the rows' ``rstd``
column (rounded to prod's dtype), accumulating into column c of one ``[128, NC]`` fp32 PSUM tile across
all chunks (one accumulation group for the whole kernel). The per-row statistics (``rstd^3``, the bf16
parts of the diagonal scalars) are tiny ``[P, NT]`` instructions, issued on the otherwise idle GpSimd
engine so Vector's queue keeps to the passes over the rows (the head norm's 2-byte rows: on Vector, where
with an fp32 operand they leave GpSimd's SBUF port to its diagonals, :func:`_stats_engine`). For wide rows
(H >= 512) ``dx`` is summed on the Tensor engine too: ``dx = diag(rstd) @ gw + diag(-c) @ x (+ I @ grad_s)``
into an fp32 PSUM bank, the per-row scalars split into bf16 hi + lo parts for bf16 operands (so the sum is as exact as
fp32 arithmetic), copied out by Scalar (the one rounding). Narrow rows (Qwen3's head norm, H = 128;
:func:`_narrow_backward`) keep NT rows per partition, so every pass covers a whole chunk: Vector forms
``prod = dy * x``; the Tensor engine transposes each 128-row slot of ``prod`` into PSUM, Scalar copies a
bank of slots out, and a matmul against the weight column sums over H: ``D = sum(w * dy * x)``; for 2-byte
rows and weights the Tensor engine transposes ``dy``'s slots too and Scalar's copy multiplies them by w
(``gw^T``; fp32 rows: Vector forms ``gw``); GpSimd writes ``diag(b)`` (``b = -rstd^2 D / H`` as bf16 hi + lo
parts) for the chunk's slots; the Tensor engine sums ``y = gw + diag(b_hi) @ x + diag(b_lo) @ x`` in fp32 PSUM
(``gw`` as ``gw^T``'s slot against the identity, or ``I @ gw``) and one Vector pass per bank forms
``dx = rstd * y`` (rounded once). LNC=2: each core's partial ``dw`` goes to a shared
HBM scratch, one ``core_barrier``, then each core sums half of the partitions.

NaN: the Tensor engine multiplies, so a NaN in one row's ``gw`` / ``x`` makes every row of its chunk
NaN in ``dx`` (``0 * NaN``), and any NaN reaches ``dw`` (as in the reference).
"""

from __future__ import annotations

from trnkit.kernels._common import P_MAX, cdiv, row_chunks
from trnkit.kernels.rmsnorm.constraints import ROW_MAX_BYTES
from trnkit.kernels.tiles import accumulate, identity, program_split
from trnkit.nki_api import nisa, nki, nl

P = P_MAX
ROW_BYTES = 8192  # bytes per partition per operand DMA (several rows per partition for narrow rows)
WIDE = 512  # H from which per-row instructions are long enough (>= one PSUM bank of columns)
PIECE = 512  # columns per PSUM bank (fp32)
# chunks whose loads are issued ahead of the one being computed: two, so that a load goes ahead of the
# store of the chunk before even where the DMA queue keeps program order; one for rows over ROW_BYTES
PREFETCH = 2
SPREAD_MIN = 512  # narrowest sub-row a spread of few rows over the partitions makes
# bytes per partition of a full chunk of narrow rows in the forward: its statistics, normalisation passes and
# DMAs cover whole chunks, and the next chunk's normalisation waits for all of a chunk's statistics, so a
# full chunk is a trade of fixed costs against that lag (the first and last ones are smaller, _narrow_sizes)
NARROW_ROW_BYTES = 4096
# bytes per partition of a core's narrow rows above which full forward chunks are twice as large: with many
# chunks the DMA's per-packet efficiency (4 KiB runs per partition against 8 KiB) outweighs the ends' lag
NARROW_LONG_FROM = 65536
# the same for the backward's narrow rows: its pipeline keeps about four chunks' tiles live
BWD_NARROW_ROW_BYTES = 6144


def _out_dtype(x, w):
    """``w * n``'s dtype: fp32 if either operand is."""
    if x.dtype == nl.float32 or w.dtype == nl.float32:
        return nl.float32
    return x.dtype


def split_factor(N, H, dtype):
    """Partitions per row ``f`` of the forward (a power of two dividing H): the kernel works on the
    ``[N*f, H/f]`` sub-rows of x (one contiguous run each) and sums each row's f partial statistics on
    the Tensor engine. Rows wider than ``ROW_MAX_BYTES`` are split to fit SBUF; few rows are spread
    until the rows of one core fill the partitions (pieces of at least ``SPREAD_MIN`` elements), since a
    DMA or an instruction over a few partitions uses a few of the 16 DMA engines and lanes. The rows of
    one core are counted as at LNC=2 whatever the launch, so LNC=1 and LNC=2 normalise every row the
    same way (bit-identical results)."""
    isz = 4 if dtype == nl.float32 else 2
    f = 1
    while H * isz > f * ROW_MAX_BYTES and H % (2 * f) == 0 and f < P:
        f = 2 * f
    per_core = cdiv(N, 2)
    while per_core * 2 * f <= P and H % (2 * f) == 0 and H // (2 * f) >= SPREAD_MIN:
        f = 2 * f
    return f


def _prefetch(W, dtype):
    """Chunks loaded ahead for (sub-)rows of W elements: :data:`PREFETCH`, or one for rows over
    ``ROW_BYTES`` per partition (the backward's ~8 row tiles per chunk would not fit SBUF twice ahead, and
    the forward's wide pieces would have to wait for SBUF to free up)."""
    if W * (4 if dtype == nl.float32 else 2) > ROW_BYTES:
        return 1
    return PREFETCH


def _own_chunks(N, H, dtype, n_prog, pid, f=1):
    """This program's chunks ``(s0, Pc, NT)`` of sub-rows (``[N*f, H/f]``; sub-rows ``s0 + p*NT + j``): a
    contiguous share of the rows. With ``f > 1`` a chunk is ``Pc / f`` whole rows, one sub-row per
    partition."""
    per = cdiv(N, n_prog)
    lo = min(N, pid * per)
    hi = min(N, lo + per)
    out = []
    if f > 1:
        for r in range(lo, hi, P // f):
            out.append((r * f, min(P // f, hi - r) * f, 1))
        return out
    isz = 4 if dtype == nl.float32 else 2
    nt = max(1, ROW_BYTES // (H * isz))
    if hi - lo >= P:
        nt = max(1, min(nt, (hi - lo) // P))
    if hi > lo:
        local = row_chunks(hi - lo, nt)
        for i in range(len(local)):
            out.append((lo + local[i][0], local[i][1], local[i][2]))
    return out


def _rows(t, r0, Pc, NT, W):
    """HBM ``t [N, W]`` rows ``r0 + p*NT + j`` as a ``[Pc, NT, W]`` access pattern."""
    return t.ap(pattern=[[NT * W, Pc], [W, NT], [1, W]], offset=r0 * W)


def _row_stats(t, r0, Pc, NT):
    """HBM ``t [N]`` (one value per row) for the rows of a chunk as ``[Pc, NT]``."""
    return t.ap(pattern=[[NT, Pc], [1, NT]], offset=r0)


def _dma_in(dst, src, queue=None):
    """``dma_copy`` (into SBUF, or a store): through ``queue``'s hardware DGE when named, else where the
    compiler puts it."""
    if queue != None:  # noqa: E711 (NKI rejects `is`)
        _hwdge(dst, src, queue)
    else:
        nisa.dma_copy(dst=dst, src=src)


def _load_chunk(srcs, chunk, H, queues=None):
    """SBUF copies ``[Pc, NT, H]`` of the chunk's rows of each HBM tensor in ``srcs`` (None stays None), each
    on its entry of ``queues`` (:func:`_dma_in`; default: the compiler's queues)."""
    r0, Pc, NT = chunk
    out = []
    for i in range(len(srcs)):
        t = None
        if srcs[i] != None:  # noqa: E711 (NKI rejects `is`)
            t = nl.ndarray((Pc, NT, H), dtype=srcs[i].dtype, buffer=nl.sbuf)
            _dma_in(t, _rows(srcs[i], r0, Pc, NT, H), None if queues == None else queues[i])  # noqa: E711
        out.append(t)
    return out


def _weight_rows(w, H, f=1):
    """``w [H]`` (HBM) as SBUF ``[P, H/f]``: partition p holds piece ``p % f`` of w, the weight of the
    sub-rows there (one DMA; partition step 0 for f = 1)."""
    Hf = H // f
    t = nl.ndarray((P, Hf), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=w.ap(pattern=[[0, P // f], [Hf, f], [1, Hf]], offset=0))
    return t


def _group_matrices(f):
    """``(E [P, P/f], ET [P/f, P])`` fp32, ``E[k, r] = ET[r, k] = 1`` where sub-row k belongs to row r
    (``k // f == r``): the stationary operands that sum a row's f partial statistics (``E``) and send a
    per-row value back to its f partitions (``ET``)."""
    R = P // f
    ones = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    e1 = nl.ndarray((P, R), dtype=nl.float32, buffer=nl.sbuf)
    nisa.affine_select(dst=e1, pattern=[[-f, R]], channel_multiplier=1, on_true_tile=ones[:, 0:R],
                       on_false_value=0.0, cmp_op=nl.greater_equal)  # k - f*r >= 0
    e = nl.ndarray((P, R), dtype=nl.float32, buffer=nl.sbuf)
    nisa.affine_select(dst=e, pattern=[[f, R]], channel_multiplier=-1, on_true_tile=e1, on_false_value=0.0,
                       cmp_op=nl.greater_equal, offset=f - 1)  # f*r + f - 1 - k >= 0
    t1 = nl.ndarray((R, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.affine_select(dst=t1, pattern=[[1, P]], channel_multiplier=-f, on_true_tile=ones[0:R, :],
                       on_false_value=0.0, cmp_op=nl.greater_equal)
    et = nl.ndarray((R, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.affine_select(dst=et, pattern=[[-1, P]], channel_multiplier=f, on_true_tile=t1, on_false_value=0.0,
                       cmp_op=nl.greater_equal, offset=f - 1)
    return e, et


def _per_col(w_sb, Pc, NT, H):
    """The broadcast weight ``[P, H]`` as a ``[Pc, NT, H]`` view (step 0 over the rows of a partition)."""
    return w_sb.ap(pattern=[[H, Pc], [0, NT], [1, H]], offset=0)


# Engine time of one per-row scaling pass (ns per element per partition): Vector ``tensor_scalar`` with an
# fp32 scalar column (no 2-byte performance mode) at 0.96 GHz, Scalar ``activation`` at 1.2 GHz; the
# rows of a chunk go to whichever engine has less work so far (``load`` = [Vector ns, Scalar ns]).
# A Scalar ACTIVATE also takes a fixed time per instruction (trn2 profiles: about 295 ns), so a short
# row costs Scalar about three times what it costs Vector.
VECTOR_NS, SCALAR_NS = 1.0 / 0.96, 1.0 / 1.2
ACTIVATE_FIXED_NS = 295.0
MIN_CYCLES = 64  # an instruction's minimum initiation interval (cycles)


def _on_scalar(n, load):
    """Whether a per-row scaling of n elements goes to Scalar (less loaded with it than Vector would be);
    charges ``load`` (``[Vector ns, Scalar ns]``) with it."""
    n = max(MIN_CYCLES, n)
    on_scalar = n * SCALAR_NS + ACTIVATE_FIXED_NS
    if load[1] + on_scalar <= load[0] + n * VECTOR_NS:
        load[1] = load[1] + on_scalar
        return True
    load[0] = load[0] + n * VECTOR_NS
    return False


def _scale_row(dst, src, col, load, on_scalar=None):
    """``dst = src * col`` (a per-partition fp32 scalar column) on Vector or Scalar, whichever is less
    loaded (``load`` is updated), or as ``on_scalar`` says when given."""
    if on_scalar == None:  # noqa: E711
        on_scalar = _on_scalar(src.shape[1], load)
    if on_scalar:
        nisa.activation(dst=dst, op=nl.copy, data=src, scale=col)
    else:
        nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=col)


def _tt_ns(n, dtype):
    """Vector time of a ``tensor_tensor`` over n elements per partition: 2-byte operands in SBUF run
    single-pass at twice the rate (trn2 performance mode), fp32 in two passes."""
    return max(MIN_CYCLES, n / 2 if dtype != nl.float32 else 2 * n) * VECTOR_NS


def _normalise(n_t, src, rstd_t, NT, load):
    """``n = src * rstd`` per row, rounded to n's dtype (rows balanced between Vector and Scalar)."""
    for j in range(NT):
        _scale_row(n_t[:, j, :], src[:, j, :], rstd_t[:, j:j + 1], load)


def _row_sums(dst, data, Pc, NT, H, op, load):
    """``dst [Pc, NT] = sum_h op(data)`` per (wide) row, fp32: one Scalar ``activation_reduce`` per row
    (``load`` is charged)."""
    junk = nl.ndarray((Pc, H), dtype=data.dtype, buffer=nl.sbuf)
    for j in range(NT):
        nisa.activation_reduce(dst=junk, op=op, data=data[:, j, :], reduce_op=nl.add, reduce_res=dst[:, j:j + 1])
    load[1] = load[1] + NT * (H + MIN_CYCLES) * SCALAR_NS


def _warm_square_table():
    """One-element square on Scalar before the first load arrives: the activation-table load it needs
    (about 1.3 us on trn2) then overlaps the first DMA instead of delaying the first chunk's squares."""
    z = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0)
    sq = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=z)


def _fwd_squares(x_t, r_t, s, chunk, out_dt, load):
    """Stage A of a (wide-row) forward chunk: ``src = x (+ residual)`` (stored as ``s``) and the row sums of
    squares, on Scalar."""
    r0, Pc, NT = chunk
    H = x_t.shape[2]
    src = x_t
    if r_t != None:  # noqa: E711
        src = nl.ndarray((Pc, NT, H), dtype=x_t.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=src, data1=x_t, data2=r_t, op=nl.add)
        load[0] = load[0] + _tt_ns(NT * H, x_t.dtype)
        nisa.dma_copy(dst=_rows(s, r0, Pc, NT, H), src=src)
    ss = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.sbuf)
    _row_sums(ss, src, Pc, NT, H, nl.square, load)
    load[0] = load[0] + _tt_ns(NT * H, out_dt)  # stage C's y = n * w
    return [src, ss, None, None, chunk]


def _fwd_rstd(state, eps, H, groups):
    """Stage B2: ``rstd = rsqrt(sum / H + eps)`` per row, on Vector: Scalar keeps the square's activation
    table loaded (an rsqrt activation between the chunks' squares would switch tables twice per chunk).
    Split rows (``groups = (f, E, ET)``): the f partial sums of each row add up on the Tensor engine
    (``E``), and ``rstd`` goes back to the row's partitions the same way (``ET``, exact: one 1.0 term)."""
    src, ss, sq, _, chunk = state
    r0, Pc, NT = chunk
    rows, src_sums = Pc, ss
    if groups != None:  # noqa: E711
        f, e, et = groups
        rows = Pc // f
        src_sums = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=src_sums, stationary=e[:Pc, :rows], moving=ss, accumulate=False)
    ms = nl.ndarray((rows, NT), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ms, data=src_sums, op0=nl.multiply, operand0=1.0 / H, op1=nl.add, operand1=eps)
    rstd_rows = nl.ndarray((rows, NT), dtype=nl.float32, buffer=nl.sbuf)
    # rsqrt is a documented unary ALU op of tensor_scalar (NKI API reference, nki.api.shared "Supported
    # Math Operators": ALU unary abs, square, relu, rsqrt, reciprocal); nki-library computes it with
    # activation(op=nl.rsqrt) instead.
    nisa.tensor_scalar(dst=rstd_rows, data=ms, op0=nl.rsqrt, operand0=None)
    rstd_t = rstd_rows
    if groups != None:  # noqa: E711
        back = nl.ndarray((Pc, 1), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=back, stationary=et[:rows, :Pc], moving=rstd_rows, accumulate=False)
        rstd_t = nl.ndarray((Pc, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=rstd_t, src=back)
    return [src, rstd_rows, None, rstd_t, chunk]


def _fwd_norm(state, load):
    """Stage C: ``n = src * rstd`` per row (rounded to src's dtype; rows balanced between Vector and Scalar)."""
    src, rstd_rows, _, rstd_t, chunk = state
    r0, Pc, NT = chunk
    n_t = nl.ndarray((Pc, NT, src.shape[2]), dtype=src.dtype, buffer=nl.sbuf)
    _normalise(n_t, src, rstd_t, NT, load)
    return [None, rstd_rows, n_t, rstd_t, chunk]


def _fwd_output(state, y, rstd, w_sb, out_dt, f):
    """Stage D: ``y = n * w`` and the stores of y and rstd (rows ``r0 / f ..`` for split rows)."""
    _, rstd_rows, n_t, _, chunk = state
    r0, Pc, NT = chunk
    H = n_t.shape[2]
    y_t = nl.ndarray((Pc, NT, H), dtype=out_dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y_t, data1=n_t, data2=_per_col(w_sb, Pc, NT, H), op=nl.multiply)
    nisa.dma_copy(dst=_row_stats(rstd, r0 // f, Pc // f, NT), src=rstd_rows)
    nisa.dma_copy(dst=_rows(y, r0, Pc, NT, H), src=y_t)


def _bank_slots(Pc, NT, dtype):
    """Row slots j whose transposed ``[<=128, Pc]`` blocks share one 2 KiB PSUM bank."""
    isz = 4 if dtype == nl.float32 else 2
    return max(1, min(NT, 2048 // (Pc * isz)))


def _narrow_consts(H, eps):
    """``(inv_h [P, 1], eps_row [1, P], ones_row [1, PIECE])`` fp32: the moving column ``1/H`` that turns a
    matmul sum of squares into the mean, and the operands of the matmul that opens each run's PSUM sums with
    eps (one column per row slot, up to a bank of them)."""
    inv_h = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=inv_h, value=1.0 / H)
    eps_row = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_row, value=eps)
    ones_row = nl.ndarray((1, PIECE), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_row, value=1.0)
    return inv_h, eps_row, ones_row


def _per_row(t, Pc, NT, H):
    """``[Pc, NT]`` per-row values broadcast along H: a ``[Pc, NT, H]`` view (step 0 on the last axis)."""
    return t.ap(pattern=[[NT, Pc], [1, NT], [0, H]], offset=0)


def _ramp(slots, nt):
    """Row slots per chunk, at most ``nt``: small chunks at both ends (``nt / 4``) and each next one towards
    the middle as large as all the slots before it at its end (taken from the head and the tail in
    turn), so the first chunk's statistics are ready early and the last store comes soon after the
    statistics end, while the few, large middle chunks keep the number of DMAs (each with its fixed
    cost) low."""
    first = max(1, nt // 4)
    head = []
    tail = []
    done = [0, 0]
    side = 0
    while done[0] + done[1] < slots:
        size = min(nt, first + done[side], slots - done[0] - done[1])
        if side == 0:
            head.append(size)
        else:
            tail.append(size)
        done[side] = done[side] + size
        side = 1 - side
    sizes = list(head)
    for k in range(len(tail)):
        sizes.append(tail[len(tail) - 1 - k])
    return sizes


def _chunk_list(lo, hi, sizes):
    """Chunks ``(r0, Pc, NT)`` of rows ``lo .. hi``: 128 partitions x ``sizes[k]`` consecutive rows each, then
    the rows left on fewer partitions with NT = 1."""
    out = []
    r0 = lo
    for k in range(len(sizes)):
        out.append((r0, P, sizes[k]))
        r0 = r0 + P * sizes[k]
    if r0 < hi:
        out.append((r0, hi - r0, 1))
    return out


def _narrow_chunks(N, H, dtype, n_prog, pid, row_bytes):
    """This program's chunks ``(r0, Pc, NT)`` of narrow rows: a contiguous share of the rows, 128 partitions x
    NT consecutive rows each (NT from :func:`_ramp`), a short tail on fewer partitions with NT = 1."""
    per = cdiv(N, n_prog)
    lo = min(N, pid * per)
    hi = min(N, lo + per)
    isz = 4 if dtype == nl.float32 else 2
    nt = max(1, row_bytes // (H * isz))
    sizes = _ramp_down(_ramp((hi - lo) // P, nt), nt)
    return _chunk_list(lo, hi, sizes)


def _ramp_down(sizes, nt):
    """:func:`_ramp`'s chunks with the partial ones after the full ones, largest first: the rising head, every
    full chunk, then the rest in decreasing size (the ramp leaves its remainder between head and tail, where a
    small chunk makes the backward's pipeline stall mid-way and a large one follows the tail's small ones)."""
    out = []
    k = 0
    while k < len(sizes) and sizes[k] < nt and (len(out) == 0 or sizes[k] > out[len(out) - 1]):
        out.append(sizes[k])
        k = k + 1
    rest = []
    for j in range(k, len(sizes)):
        if sizes[j] == nt:
            out.append(sizes[j])
        else:
            rest.append(sizes[j])
    while len(rest) > 0:
        m = 0
        for j in range(1, len(rest)):
            if rest[j] > rest[m]:
                m = j
        out.append(rest.pop(m))
    return out


# Forward, narrow rows (the q / k head norm). DMA queues: nisa.dma_copy's hardware DGE mode, "Sync Engine or
# Scalar Engine sequencers invoke DGE hardware block to generate DMA descriptors as part of the
# nisa.dma_copy instruction" (NKI API reference, nki.isa.dma_copy), and "DMA transfers within a queue on the
# same DMA engine are executed in order" (NKI DMA overview). Loads, which wait on nothing, are triggered
# from the Scalar engine's queue; stores, which wait on Vector's results, from the otherwise idle Sync
# engine's, so a store waiting for its data never holds up a load (nor Scalar's instruction stream: "The
# sequencer instruction to trigger the transfer may wait on any semaphore condition", NKI DMA overview).
LOAD_QUEUE = nisa.engine.scalar
STORE_QUEUE = nisa.engine.sync
NARROW_AHEAD = 4  # chunks whose loads are issued ahead of the one whose statistics are formed
NARROW_SPLIT = 5  # the loads issued before Scalar's first squares: on Sync's queue but chunk 1's (_narrow_load)
NARROW_DEPTH = 2  # transposed groups issued ahead of their squares and sums (PSUM banks in flight)
NARROW_RUN = 3  # chunks at most per run: one PSUM tile of sums, one fp32 rstd instruction and one store
NARROW_BWD_SPLIT = 3  # the backward's first chunks' loads on both hardware-DGE queues (_load_narrow_bwd_chunk)
NARROW_TAIL = 3  # runs ending in the last chunks get their fp32 rstd on Scalar after its last square


def _hwdge(dst, src, queue):
    """``dma_copy`` through the hardware DGE of ``queue``'s sequencer (equal dtypes, as hwdge needs)."""
    nisa.dma_copy(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge, engine=queue)


def _narrow_sizes(R, nt):
    """Row slots per chunk for ``R`` slots per partition and full chunks of ``nt``: a quarter and a half chunk
    first (the first statistics start early), full chunks (and the remainder as one more), three quarters
    and a half last (the last normalisation and store follow the statistics closely); few slots: the
    ramp of :func:`_ramp`."""
    q = max(1, nt // 4)
    head = [q, 2 * q]
    tail = [3 * q, 2 * q]
    if R < 3 * q + 5 * q + nt:  # the head's and the tail's slots and one full chunk
        return _ramp(R, nt)
    mid = R - 3 * q - 5 * q
    sizes = list(head)
    for _ in range(mid // nt):
        sizes.append(nt)
    if mid % nt:
        sizes.append(mid % nt)
    return sizes + tail


def _narrow_fwd_chunks(N, H, dtype, n_prog, pid):
    """This program's forward chunks ``(r0, Pc, NT)``: a contiguous share of the rows, 128 partitions x NT
    consecutive rows each (NT from :func:`_narrow_sizes`, full chunks of :data:`NARROW_ROW_BYTES` per partition,
    twice that past :data:`NARROW_LONG_FROM` of rows), a short tail on fewer partitions with NT = 1."""
    per = cdiv(N, n_prog)
    lo = min(N, pid * per)
    hi = min(N, lo + per)
    isz = 4 if dtype == nl.float32 else 2
    R = (hi - lo) // P
    row_bytes = NARROW_ROW_BYTES
    if R * H * isz > NARROW_LONG_FROM:  # many chunks: the DMA's packet efficiency outweighs the ends' lag
        row_bytes = 2 * NARROW_ROW_BYTES
    sizes = _narrow_sizes(R, max(1, row_bytes // (H * isz)))
    return _chunk_list(lo, hi, sizes)


def _runs(chunks, segs):
    """``(first chunk, count)``: runs of up to :data:`NARROW_RUN` consecutive chunks of one shape and one
    segment (``segs[k]``: chunk k's tensor). A run's rows ``r0 + c*Pc*NT + p*NT + j`` are column ``c*NT + j``
    of partition p in one PSUM tile of sums, so one instruction forms their fp32 rstd and one DMA stores it."""
    out = []
    k = 0
    while k < len(chunks):
        n = 1
        while (k + n < len(chunks) and n < NARROW_RUN and chunks[k + n][1] == chunks[k][1]
               and chunks[k + n][2] == chunks[k][2] and segs[k + n] == segs[k]
               and (n + 1) * chunks[k][2] <= PIECE):
            n = n + 1
        out.append((k, n))
        k = k + n
    return out


def _fwd_transposes(src, ms, col0, consts, pending, tag):
    """The Tensor engine transposes each row slot's ``[Pc, <=128]`` column piece of ``src`` into PSUM (H on the
    partitions, a bank's worth of slots per group); each group's squares and sums (:func:`_fwd_sums`) are
    issued once :data:`NARROW_DEPTH` later groups are transposed, across chunks too, so the Tensor engine
    transposes while Scalar squares. ``pending``: the groups transposed and not yet summed, ``(xt, first
    column piece, slot count, first ms column, chunk)``; returns it."""
    Pc, NT, H = src.shape
    G = _bank_slots(Pc, NT, src.dtype)
    for h0 in range(0, H, P):
        hw = min(P, H - h0)
        for j0 in range(0, NT, G):
            gn = min(G, NT - j0)
            xt = nl.ndarray((hw, gn, Pc), dtype=src.dtype, buffer=nl.psum)
            for g in range(gn):
                nisa.nc_transpose(dst=xt[:, g, :], data=src[:, j0 + g, h0:h0 + hw])
            if len(pending) >= NARROW_DEPTH:
                _fwd_sums(pending[0], consts)
                pending = pending[1:]
            pending = pending + [(xt, h0, gn, col0 + j0, ms, tag)]
    return pending


def _fwd_sums(group, consts):
    """Scalar squares a transposed group (PSUM -> SBUF fp32), then per row slot a matmul against the ``1/H``
    column adds its squares over the partitions into the slot's column of the run's sums (opened with eps,
    :func:`_narrow_forward`; the products of a power-of-two 1/H are exact)."""
    inv_h = consts[0]
    xt, h0, gn, c0, ms, _ = group
    hw, _, Pc = xt.shape
    sq = nl.ndarray((hw, gn, Pc), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=xt)
    for g in range(gn):
        nisa.nc_matmul(dst=ms[:, c0 + g:c0 + g + 1], stationary=sq[:, g, :], moving=inv_h[:hw, :], accumulate=True)


def _finish_sums(pending, consts, last_tag):
    """Issue the squares and sums of every pending group of chunks up to ``last_tag``; returns the rest."""
    keep = []
    for k in range(len(pending)):
        if pending[k][5] <= last_tag:
            _fwd_sums(pending[k], consts)
        else:
            keep.append(pending[k])
    return keep


def _store_run_rstd(rstd, chunks, run, rs, queue):
    """The fp32 rstd ``[Pc, n, NT]`` of a run (chunk c's row slot j of partition p) -> ``rstd``."""
    k0, n = run
    r0, Pc, NT = chunks[k0]
    _hwdge(rstd.ap(pattern=[[NT, Pc], [Pc * NT, n], [1, NT]], offset=r0), rs, queue)


def _narrow_load(x, residual, chunks, k):
    """Chunk ``k``'s ``x`` (and ``residual``) tiles, loaded on Scalar's DMA queue; the first
    :data:`NARROW_SPLIT` chunks' loads but chunk 1's on Sync's (no store is pending yet). A named trigger is
    an instruction of its engine's in-order stream that waits for its queue, so those loads, all issued
    before Scalar's first squares, would hold Scalar one queue slot each; two queues still take the first
    two chunks side by side."""
    queue = LOAD_QUEUE
    if k < NARROW_SPLIT and k != 1:
        queue = STORE_QUEUE
    return _load_chunk([x, residual], chunks[k], x.shape[1], [queue, queue])


def _segment_chunks(xs, n_prog, pid, backward):
    """The chunks of every segment (tensor) of a launch, one segment after the other, and each chunk's
    segment: the forward's (:func:`_narrow_fwd_chunks`) or the backward's chunks of each ``xs[g] [N_g, H]``, so
    each segment's chunks (and every row's arithmetic, the backward's dw sums included) are those of a launch
    on that tensor alone."""
    chunks = []
    segs = []
    for g in range(len(xs)):
        N, H = xs[g].shape
        if backward:
            own = _narrow_chunks(N, H, xs[g].dtype, n_prog, pid, BWD_NARROW_ROW_BYTES)
        else:
            own = _narrow_fwd_chunks(N, H, xs[g].dtype, n_prog, pid)
        for k in range(len(own)):
            chunks.append(own[k])
            segs.append(g)
    return chunks, segs


def _narrow_forward(xs, residual, s, ys, rstds, ws, eps, out_dt, n_prog, pid):
    """The forward for rows narrower than ``WIDE`` (the q/k head norm). Per chunk: loads (Scalar's DMA queue,
    :data:`NARROW_AHEAD` chunks ahead), statistics (Tensor transposes, Scalar squares, Tensor sums into the
    run's PSUM tile, which a matmul opened with eps), Vector's ``rsqrt`` of the chunk's sums straight into
    x's dtype (the normalisation's operand; fp32 rows: into PSUM), ``n = x * rstd`` and ``y = n * w`` over the
    whole chunk, and the store (Sync's queue). Vector's order per step is rsqrt of chunk i, y of chunk i-1,
    n of chunk i, so each instruction's input was produced an instruction earlier or more. A run's fp32
    rstd (the stored one) is one more Vector ``rsqrt`` after its last chunk's n, or for the last runs one
    Scalar ``rsqrt`` activation after the last square (one activation-table switch, when Scalar is idle).
    ``xs``, ``ys``, ``rstds``, ``ws``: one entry per segment (the q and k head norms of one launch: each
    segment's rows normalised with its own weight, its chunks those of a launch on it alone,
    :func:`_segment_chunks`); ``residual`` only with one segment. The late runs are those of each segment's last
    chunks, so every row's stored rstd comes from the same instruction as in a launch on its tensor alone; the
    earlier segments' late runs are stored after the last y (their small stores would otherwise hold the last
    y stores back on the DMA engines)."""
    x = xs[0]
    H = x.shape[1]
    chunks, segs = _segment_chunks(xs, n_prog, pid, False)
    L = len(chunks)
    runs = _runs(chunks, segs)
    run_of = []  # per chunk: (its run, its position in the run)
    late = []  # per run: fp32 rstd on Scalar at the end
    ends = []  # per chunk: one past its segment's last chunk
    for k in range(L):
        e = k + 1
        while e < L and segs[e] == segs[k]:
            e = e + 1
        ends.append(e)
    for r in range(len(runs)):
        for c in range(runs[r][1]):
            run_of.append((r, c))
        late.append(runs[r][0] + runs[r][1] > ends[runs[r][0]] - NARROW_TAIL)
    consts = _narrow_consts(H, eps)
    ms = [None] * len(runs)
    srcs = []

    for k in range(min(L, NARROW_AHEAD)):
        srcs.append(_narrow_load(xs[segs[k]], residual, chunks, k))
    w_sbs = []  # each weight on every partition, needed last
    for g in range(len(ws)):
        w_sb = nl.ndarray((P, H), dtype=ws[g].dtype, buffer=nl.sbuf)
        _hwdge(w_sb, ws[g].ap(pattern=[[0, P], [1, H]], offset=0), STORE_QUEUE)
        w_sbs.append(w_sb)
    pending = []
    deferred = []  # the late rstd of segments before the last: stored after the last y
    normed = None  # (chunk i-2, its n)
    for u in range(L + 1):
        if u < L:
            for k in range(len(srcs), min(L, u + 1 + NARROW_AHEAD)):
                srcs.append(_narrow_load(xs[segs[k]], residual, chunks, k))
            r0, Pc, NT = chunks[u]
            ri, ci = run_of[u]
            if ci == 0:  # the run's sums, opened with eps (one column per row slot)
                cols = runs[ri][1] * NT
                ms[ri] = nl.ndarray((Pc, cols), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=ms[ri], stationary=consts[1][:, :Pc], moving=consts[2][:, :cols], accumulate=False)
            if residual != None:  # noqa: E711
                src = nl.ndarray((Pc, NT, H), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=src, data1=srcs[u][0], data2=srcs[u][1], op=nl.add)
                _hwdge(_rows(s, r0, Pc, NT, H), src, STORE_QUEUE)
                srcs[u] = [src, None]
            pending = _fwd_transposes(srcs[u][0], ms[ri], ci * NT, consts, pending, u)
        else:
            pending = _finish_sums(pending, consts, L)
            for g in range(len(xs) - 1, -1, -1):
                deferred = deferred + _late_rstds(chunks, segs, runs, late, ms, rstds, g, g == len(xs) - 1)
        if u == 0:
            continue
        i = u - 1  # the chunk whose sums are now all issued
        pending = _finish_sums(pending, consts, i)
        r0, Pc, NT = chunks[i]
        ri, ci = run_of[i]
        # rsqrt is a documented unary ALU op of tensor_scalar (NKI API reference, nki.api.shared "Supported
        # Math Operators"); an rsqrt activation here would switch Scalar's table away from the squares'.
        if x.dtype == nl.float32:
            r_i = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.psum)
        else:  # rounded once to x's dtype: the normalisation runs in Vector's 2-byte mode
            r_i = nl.ndarray((Pc, NT), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=r_i, data=ms[ri][:, ci * NT:(ci + 1) * NT], op0=nl.rsqrt, operand0=None)
        if normed != None:  # noqa: E711
            _narrow_y(normed, chunks, ys[segs[normed[0]]], w_sbs[segs[normed[0]]], out_dt)
        n_t = nl.ndarray((Pc, NT, H), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=n_t, data1=srcs[i][0], data2=_per_row(r_i, Pc, NT, H), op=nl.multiply)
        srcs[i] = None
        normed = (i, n_t)
        if ci == runs[ri][1] - 1 and not late[ri]:
            k0, n = runs[ri]
            rs = nl.ndarray((Pc, n, NT), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=rs, data=ms[ri], op0=nl.rsqrt, operand0=None)
            _store_run_rstd(rstds[segs[k0]], chunks, runs[ri], rs, STORE_QUEUE)
    if normed != None:  # noqa: E711
        _narrow_y(normed, chunks, ys[segs[normed[0]]], w_sbs[segs[normed[0]]], out_dt)
    for d in range(len(deferred)):
        g, ri, rs = deferred[d]
        _store_run_rstd(rstds[g], chunks, runs[ri], rs, LOAD_QUEUE)


def _late_rstds(chunks, segs, runs, late, ms, rstds, g, store):
    """Segment g's late runs' fp32 rstd: one Scalar ``rsqrt`` activation of each run's sums, stored from Scalar's
    DMA queue now (``store``) or returned as ``(g, run, tile)`` to store later."""
    later = []
    for ri in range(len(runs)):
        k0, n = runs[ri]
        if late[ri] and segs[k0] == g:
            rs = nl.ndarray((chunks[k0][1], n, chunks[k0][2]), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=rs, op=nl.rsqrt, data=ms[ri])
            if store:
                _store_run_rstd(rstds[g], chunks, runs[ri], rs, LOAD_QUEUE)
            else:
                later.append((g, ri, rs))
    return later


def _narrow_y(normed, chunks, y, w_sb, out_dt):
    """``y = n * w`` over a whole chunk (the weight broadcast along the rows) and its store."""
    i, n_t = normed
    r0, Pc, NT = chunks[i]
    H = n_t.shape[2]
    y_t = nl.ndarray((Pc, NT, H), dtype=out_dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y_t, data1=n_t, data2=_per_col(w_sb, Pc, NT, H), op=nl.multiply)
    _hwdge(_rows(y, r0, Pc, NT, H), y_t, STORE_QUEUE)


@nki.jit
def rmsnorm_fwd_kernel(x, w, eps, residual=None):
    """``(y [N, H], rstd [N] fp32)``, or ``(y, s, rstd)`` with ``s = x + residual`` normalised instead of x.

    ``x`` (and ``residual``) ``[N, H]`` fp32 / bf16, ``w [H]`` of x's dtype or fp32; ``y`` has
    ``promote(x.dtype, w.dtype)``.
    """
    N, H = x.shape
    out_dt = _out_dtype(x, w)
    y = nl.ndarray((N, H), dtype=out_dt, buffer=nl.shared_hbm)
    rstd = nl.ndarray((N,), dtype=nl.float32, buffer=nl.shared_hbm)
    s = None
    if residual != None:  # noqa: E711
        s = nl.ndarray((N, H), dtype=x.dtype, buffer=nl.shared_hbm)
    n_prog, pid = program_split()
    f = split_factor(N, H, x.dtype)
    Hf = H // f  # the kernel works on the [N*f, Hf] sub-rows
    if H < WIDE:  # narrow rows (never split)
        _warm_square_table()
        _narrow_forward([x], residual, s, [y], [rstd], [w], float(eps), out_dt, n_prog, pid)
        if residual != None:  # noqa: E711
            return y, s, rstd
        return y, rstd
    chunks = _own_chunks(N, H, x.dtype, n_prog, pid, f)
    loads = []
    if len(chunks) > 0:  # the first rows' load goes first: the weight is needed last
        loads.append(_load_chunk([x, residual], chunks[0], Hf))
    _warm_square_table()
    groups = None
    if f > 1:
        e, et = _group_matrices(f)
        groups = (f, e, et)
    w_sb = _weight_rows(w, H, f)
    ahead = _prefetch(Hf, x.dtype)
    load = [0.0, 0.0]  # Vector / Scalar ns so far (row balancing of the n pass)
    # A software pipeline of four stages, chunk i in stage A while chunk i-1 is in B, i-2 in C and i-3 in
    # D, issued so that no engine's in-order queue waits on work issued in the same iteration: Vector
    # forms y of chunk i-3 (D) while Scalar squares chunk i (A) and normalises chunk i-2 (C), and the
    # rsqrt of chunk i-1 (B, Vector) comes last.
    pipe = [None, None, None]  # chunk i-1 after A, i-2 after B, i-3 after C
    for i in range(len(chunks) + 3):
        b_in, c_in, d_in = pipe[0], pipe[1], pipe[2]
        cur = None
        if i < len(chunks):
            for k in range(len(loads), min(len(chunks), i + 1 + ahead)):
                loads.append(_load_chunk([x, residual], chunks[k], Hf))
            cur = _fwd_squares(loads[i][0], loads[i][1], s, chunks[i], out_dt, load)
            loads[i] = None
        if d_in != None:  # noqa: E711
            _fwd_output(d_in, y, rstd, w_sb, out_dt, f)
        if c_in != None:  # noqa: E711
            c_in = _fwd_norm(c_in, load)
        if b_in != None:  # noqa: E711
            b_in = _fwd_rstd(b_in, float(eps), H, groups)
        pipe = [cur, b_in, c_in]
    if residual != None:  # noqa: E711
        return y, s, rstd
    return y, rstd


@nki.jit
def rmsnorm_qk_fwd_kernel(xq, xk, wq, wk, eps):
    """``(yq [Nq, H], yk [Nk, H], rstd_q [Nq] fp32, rstd_k [Nk] fp32)``: the q and k head norms in one launch,
    ``xq`` normalised with ``wq`` and ``xk`` with ``wk`` (H < ``WIDE``; xq, xk of one dtype, wq, wk of one
    dtype). One pipeline over q's chunks then k's (:func:`_narrow_forward`), each row's arithmetic and each
    tensor's chunks those of :func:`rmsnorm_fwd_kernel` on it alone, so the outputs are bit-identical to two
    launches; the launch's fixed costs and its pipeline's ends are paid once."""
    H = xq.shape[1]
    out_dt = _out_dtype(xq, wq)
    ys = []
    rstds = []
    for x in [xq, xk]:
        ys.append(nl.ndarray((x.shape[0], H), dtype=out_dt, buffer=nl.shared_hbm))
        rstds.append(nl.ndarray((x.shape[0],), dtype=nl.float32, buffer=nl.shared_hbm))
    n_prog, pid = program_split()
    _warm_square_table()
    _narrow_forward([xq, xk], None, None, ys, rstds, [wq, wk], float(eps), out_dt, n_prog, pid)
    return ys[0], ys[1], rstds[0], rstds[1]


def _split(col, dtype, hi16=None):
    """fp32 ``[Pc, NT]`` -> ``(col, lo)`` where ``lo = col - round_dtype(col)`` (fp32): scaling a ``dtype``
    operand by ``col`` and by ``lo``, each rounded to ``dtype``, gives ``round(col) + round(lo)``, within
    fp32 rounding of col (``lo`` is None for fp32, which the Tensor engine takes whole). ``hi16``:
    ``round_dtype(col)`` when the caller has it already."""
    if dtype == nl.float32:
        return col, None
    Pc, NT = col.shape
    if hi16 == None or hi16.dtype != dtype:  # noqa: E711
        hi16 = nl.ndarray((Pc, NT), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=hi16, src=col, engine=nisa.engine.gpsimd)
    lo = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lo, data1=col, data2=hi16, op=nl.subtract, engine=nisa.engine.gpsimd)
    return col, lo


def _diags(ident, parts, j, Pc, dtype):
    """``diag(part[:, j])`` ``[Pc, Pc]`` in ``dtype`` for each fp32 part (the stationary operands)."""
    out = []
    for i in range(len(parts)):
        if parts[i] != None:  # noqa: E711
            d = nl.ndarray((Pc, Pc), dtype=dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=d, data=ident[:Pc, :Pc], op0=nl.multiply, operand0=parts[i][:, j:j + 1])
            out.append(d)
    return out


def _dx_wide(dx_t, gw_t, x_t, gs_t, rstd_t, negc_t, ident, Pc, NT, H, rstd16):
    """``dx = diag(rstd) @ gw + diag(-c) @ x (+ I @ grad_s)`` per row, summed in an fp32 PSUM bank per 512
    columns and copied out by Scalar (the one rounding)."""
    dt = x_t.dtype
    r_parts = _split(rstd_t, dt, rstd16)
    c_parts = _split(negc_t, dt)
    for j in range(NT):
        dr = _diags(ident, [r_parts[0], r_parts[1]], j, Pc, dt)
        dc = _diags(ident, [c_parts[0], c_parts[1]], j, Pc, dt)
        for c0 in range(0, H, PIECE):
            cw = min(PIECE, H - c0)
            ps = nl.ndarray((Pc, cw), dtype=nl.float32, buffer=nl.psum)
            operands = []  # one accumulation group: the diagonal products of gw, then x, then gs
            for k in range(len(dr)):
                operands.append([(dr[k], gw_t[:, j, c0:c0 + cw])])
            for k in range(len(dc)):
                operands.append([(dc[k], x_t[:, j, c0:c0 + cw])])
            if gs_t != None:  # noqa: E711
                operands.append([(ident[:Pc, :Pc], gs_t[:, j, c0:c0 + cw])])
            accumulate([ps], operands)
            nisa.activation(dst=dx_t[:, j, c0:c0 + cw], op=nl.copy, data=ps)


def _dw_partial(dw_ps, n_prog, pid, NC, named=False):
    """This core's ``[P, NC]`` column sums out of PSUM (fp32): the SBUF copy on LNC=1; on LNC=2 also stored to
    the shared scratch that :func:`_store_dw` combines, which is returned. ``named`` (the narrow backward,
    which issues this right after its last dw matmuls, while the Tensor engine, Vector and GpSimd still work
    on the last chunks' dx): the copy on the Scalar engine, idle by then (an fp32 copy, exact), and its store
    triggered from Scalar's own DMA queue, so it waits on no other engine and on no dx store."""
    part = nl.ndarray((P, NC), dtype=nl.float32, buffer=nl.sbuf)
    queue = None
    if named:
        queue = LOAD_QUEUE
        nisa.tensor_copy(dst=part, src=dw_ps, engine=nisa.engine.scalar)
    else:
        nisa.tensor_copy(dst=part, src=dw_ps)
    if n_prog == 1:
        return part
    scratch = nl.ndarray((n_prog, P, NC), dtype=nl.float32, buffer=nl.shared_hbm)
    _dma_in(scratch.ap(pattern=[[NC, P], [1, NC]], offset=pid * P * NC), part, queue)
    return scratch


def _store_dw(dw, dw_ps, n_prog, pid, NC, partial=None):
    """The ``[P, NC]`` column sums (``dw[c*P + m]`` on partition m, column c) -> ``dw [NC*P]``; on LNC=2
    through a shared scratch and one barrier, each core summing half of the partitions. ``partial``: what
    :func:`_dw_partial` returned when the kernel issued it earlier (named queues); then the two halves load
    on the Sync and Scalar engines' queues side by side, the sum is rounded to dw's dtype by the add itself
    (one instruction fewer after the barrier) and the result is stored from Sync's, instead of one after another
    on the compiler's queues behind the last dx stores."""
    queues = [None, None, None]
    named = partial != None  # noqa: E711
    if not named:
        partial = _dw_partial(dw_ps, n_prog, pid, NC)
    else:
        queues = [STORE_QUEUE, LOAD_QUEUE, STORE_QUEUE]
    if n_prog == 1:
        out = nl.ndarray((P, NC), dtype=dw.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=partial)
        _dma_in(dw.ap(pattern=[[1, P], [P, NC]], offset=0), out, queues[2])
        return
    nisa.core_barrier(partial, (0, 1))
    half = P // n_prog
    acc = nl.ndarray((half, NC), dtype=nl.float32, buffer=nl.sbuf)
    _dma_in(acc, partial.ap(pattern=[[NC, half], [1, NC]], offset=pid * half * NC), queues[0])
    out = nl.ndarray((half, NC), dtype=dw.dtype, buffer=nl.sbuf)
    for q in range(1, n_prog):
        other = nl.ndarray((half, NC), dtype=nl.float32, buffer=nl.sbuf)
        _dma_in(other, partial.ap(pattern=[[NC, half], [1, NC]], offset=(q * P + pid * half) * NC), queues[1])
        if named and q == n_prog - 1:  # the last sum rounded straight to dw's dtype (fp32 add, one rounding)
            nisa.tensor_tensor(dst=out, data1=acc, data2=other, op=nl.add)
        else:
            nisa.tensor_tensor(dst=acc, data1=acc, data2=other, op=nl.add)
    if not named:
        nisa.tensor_copy(dst=out, src=acc)
    _dma_in(dw.ap(pattern=[[1, half], [P, NC]], offset=pid * half), out, queues[2])


def _dw_matmuls(dw_ps, prod, rstd_t, Pc, NT, NC, opens=False, engine=nisa.engine.gpsimd, r=None):
    """The chunk's rows into the dw column sums: ``dw_ps[m, c] += sum_p prod[p, j, c*P + m] * rstd[p, j]``
    for every row j and 128-column piece c (its own column of the PSUM tile). The moving operand is rstd's
    column j itself, rounded to prod's dtype once for the whole chunk (an error of each row's weight that
    averages out over the rows, far below dw's own rounding); the program's first row opens each column;
    ``engine`` rounds rstd, unless the caller passes it rounded as ``r``. Returns that rounded rstd."""
    if r == None:  # noqa: E711
        r = nl.ndarray((Pc, NT), dtype=prod.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=rstd_t, engine=engine)
    for j in range(NT):
        for c in range(NC):
            nisa.nc_matmul(dst=dw_ps[:, c:c + 1], stationary=prod[:, j, c * P:(c + 1) * P], moving=r[:, j:j + 1],
                           accumulate=not (opens and j == 0))
    return r


def _load_narrow_bwd_chunk(dy, x, grad_s, rstd, chunks, k):
    """Chunk ``k``'s backward tiles (:func:`_load_bwd_chunk`). The first :data:`NARROW_BWD_SPLIT` chunks' loads
    name the two hardware-DGE queues (``dy`` on the Sync engine's, the others on the Scalar engine's), so they
    land side by side instead of each behind the previous one's fixed cost on one queue; no store is pending
    yet that they could wait behind. Later loads and the stores go where the compiler puts them."""
    queues = None
    if k < NARROW_BWD_SPLIT:
        queues = [STORE_QUEUE, LOAD_QUEUE, LOAD_QUEUE, LOAD_QUEUE]
    return _load_bwd_chunk(dy, x, grad_s, rstd, chunks[k], queues)


def _load_bwd_chunk(dy, x, grad_s, rstd, chunk, queues=None):
    """SBUF ``[dy, x, grad_s (or None), rstd [Pc, NT] fp32]`` of a backward chunk, each load on its entry of
    ``queues`` (:func:`_dma_in`; default: the compiler's queues)."""
    r0, Pc, NT = chunk
    if queues == None:  # noqa: E711 (NKI rejects `is`)
        queues = [None, None, None, None]
    tiles = _load_chunk([dy, x, grad_s], chunk, x.shape[1], queues)
    r_t = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.sbuf)
    _dma_in(r_t, _row_stats(rstd, r0, Pc, NT), queues[3])
    tiles.append(r_t)
    return tiles


def _bwd_sums(tiles, chunk, w_sb, dw_ps, out_dt, first=False):
    """Stage 1 of a wide-row backward chunk: ``gw = dy * w``, the dw matmuls, ``D = sum(gw * x)`` per row
    (Scalar row sums)."""
    gw_t, x_t, gs_t, rstd_t, prod, _ = _dy_products(tiles, chunk, w_sb, out_dt)
    r0, Pc, NT = chunk
    H = x_t.shape[2]
    # dw: sum over rows of rstd * (dy * x), the row sums on the Tensor engine
    rstd16 = _dw_matmuls(dw_ps, prod, rstd_t, Pc, NT, cdiv(H, P), first)
    t_t = nl.ndarray((Pc, NT, H), dtype=x_t.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=t_t, data1=gw_t, data2=x_t, op=nl.multiply)
    d_t = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.sbuf)
    _row_sums(d_t, t_t, Pc, NT, H, nl.copy, [0.0, 0.0])
    return (gw_t, x_t, gs_t, rstd_t, d_t, chunk, rstd16)


def _neg_c(rstd_t, d_t, H):
    """``-c = -rstd^3 * D / H`` per row ``[Pc, NT]``."""
    Pc, NT = rstd_t.shape
    r3 = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=r3, data1=rstd_t, data2=rstd_t, op=nl.multiply, engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=r3, data1=r3, data2=rstd_t, op=nl.multiply, engine=nisa.engine.gpsimd)
    negc = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=negc, data=d_t, op0=nl.multiply, operand0=-1.0 / H, op1=nl.multiply,
                              operand1=r3)
    return negc


def _bwd_dx(state, dx, ident):
    """Stage 2 of a wide-row backward chunk: ``dx = rstd * gw - c * x (+ grad_s)``."""
    gw_t, x_t, gs_t, rstd_t, d_t, chunk, rstd16 = state
    r0, Pc, NT = chunk
    H = x_t.shape[2]
    dx_t = nl.ndarray((Pc, NT, H), dtype=x_t.dtype, buffer=nl.sbuf)
    _dx_wide(dx_t, gw_t, x_t, gs_t, rstd_t, _neg_c(rstd_t, d_t, H), ident, Pc, NT, H, rstd16)
    nisa.dma_copy(dst=_rows(dx, r0, Pc, NT, H), src=dx_t)


# ------------------------------------------------------------------------------ narrow-row backward


def _w_columns(w, H, dtype):
    """``w [H]`` as columns ``[P, NC]`` in ``dtype``: ``w[c*P + h]`` on partition h of column c (zero past
    H), the moving operand that sums a transposed ``[h, rows]`` block over H weighted by w."""
    NC = cdiv(H, P)
    raw = nl.ndarray((P, NC), dtype=w.dtype, buffer=nl.sbuf)
    if H % P:
        nisa.memset(dst=raw, value=0.0)
    for c in range(NC):
        hw = min(P, H - c * P)
        nisa.dma_copy(dst=raw[0:hw, c:c + 1], src=w.ap(pattern=[[1, hw], [1, 1]], offset=c * P))
    if w.dtype == dtype:
        return raw
    cols = nl.ndarray((P, NC), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=cols, src=raw, engine=nisa.engine.gpsimd)
    return cols


def _dy_products(tiles, chunk, w_sb, out_dt):
    """Stage A of a wide-row backward chunk, on Vector: ``gw = dy * w`` (x's dtype, HF's rounding point) and
    ``prod = dy * x`` (zero-padded to whole 128-column pieces)."""
    dy_t, x_t, gs_t, rstd_t = tiles[0], tiles[1], tiles[2], tiles[3]
    r0, Pc, NT = chunk
    H = x_t.shape[2]
    gw_t = nl.ndarray((Pc, NT, H), dtype=x_t.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=gw_t, data1=dy_t, data2=_per_col(w_sb, Pc, NT, H), op=nl.multiply)
    prod = _dy_x(dy_t, x_t, chunk, out_dt)
    return (gw_t, x_t, gs_t, rstd_t, prod, chunk)


def _dy_x(dy_t, x_t, chunk, out_dt):
    """``prod = dy * x`` on Vector, ``[Pc, NT, HP]`` in ``out_dt``, zero past H up to whole 128-column pieces."""
    r0, Pc, NT = chunk
    H = x_t.shape[2]
    HP = cdiv(H, P) * P
    prod = nl.ndarray((Pc, NT, HP), dtype=out_dt, buffer=nl.sbuf)
    if HP > H:
        nisa.memset(dst=prod[:, :, H:HP], value=0.0)
    nisa.tensor_tensor(dst=prod[:, :, 0:H], data1=dy_t, data2=x_t, op=nl.multiply)
    return prod


def _stats_engine(dtype):
    """The engine of the narrow backward's per-row statistics (``[P, NT]`` instructions: rstd², the bf16 parts
    of b, rstd rounded for the dw matmuls). For 2-byte rows, Vector: with an fp32 operand they do not run in
    Vector's 2-byte mode, so they leave free the SBUF port that GpSimd's diagonals share with Vector's 2-byte
    passes (trn2 arch guide "memory hierarchy", docs/cost-model.md), which bounds this kernel. For fp32 rows
    (no 2-byte passes, no bf16 parts), GpSimd, which is otherwise idle there while Vector is not."""
    if dtype == nl.float32:
        return nisa.engine.gpsimd
    return nisa.engine.vector


def _narrow_products(tiles, chunk, w_sb, out_dt):
    """Stage A of a narrow chunk: ``prod = dy * x`` on Vector, ``gw = dy * w`` there too unless ``w_sb`` is None
    (2-byte rows: :func:`_narrow_transposes` forms gw on the Tensor and Scalar engines, and the state keeps
    ``dy`` in gw's place), then the chunk's per-row statistics of its rstd: rounded to prod's dtype (the dw
    matmuls' moving operand) and ``rstd^2`` (fp32, for :func:`_narrow_stats`), formed a stage ahead so the
    Tensor engine's dw matmuls never wait for them."""
    dy_t, x_t, gs_t, rstd_t = tiles[0], tiles[1], tiles[2], tiles[3]
    r0, Pc, NT = chunk
    gw_t = dy_t
    if w_sb != None:  # noqa: E711
        H = x_t.shape[2]
        gw_t = nl.ndarray((Pc, NT, H), dtype=x_t.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gw_t, data1=dy_t, data2=_per_col(w_sb, Pc, NT, H), op=nl.multiply)
    prod = _dy_x(dy_t, x_t, chunk, out_dt)
    eng = _stats_engine(x_t.dtype)
    r16 = nl.ndarray((Pc, NT), dtype=prod.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r16, src=rstd_t, engine=eng)
    r2 = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=r2, data1=rstd_t, data2=rstd_t, op=nl.multiply, engine=eng)
    return (gw_t, x_t, gs_t, (rstd_t, r16, r2), prod, chunk)


def _transposed_groups(src, Pc, NT, H, scale=None):
    """Each 128-row slot of ``src`` transposed into PSUM by the Tensor engine (H on the partitions, a bank's
    worth of slots per group) and copied out to SBUF by the Scalar engine, multiplied there by the fp32
    column ``scale`` (one value per partition, i.e. per column of ``src``) when given. Returns the groups
    ``(tile [hw, gn, Pc], piece, first slot)``."""
    NC = cdiv(H, P)
    G = _bank_slots(Pc, NT, src.dtype)
    groups = []
    for c in range(NC):
        hw = min(P, H - c * P)
        for j0 in range(0, NT, G):
            gn = min(G, NT - j0)
            pt = nl.ndarray((hw, gn, Pc), dtype=src.dtype, buffer=nl.psum)
            for g in range(gn):
                nisa.nc_transpose(dst=pt[:, g, :], data=src[:, j0 + g, c * P:c * P + hw])
            ptc = nl.ndarray((hw, gn, Pc), dtype=src.dtype, buffer=nl.sbuf)
            if scale == None:  # noqa: E711
                nisa.activation(dst=ptc, op=nl.copy, data=pt)
            else:
                nisa.activation(dst=ptc, op=nl.copy, data=pt, scale=scale[0:hw, c:c + 1])
            groups.append((ptc, c, j0))
    return groups


def _narrow_transposes(state, dw_ps, first, wf_cols=None):
    """Stage B: the Tensor engine adds ``rstd * prod`` into the dw column sums and transposes each 128-row
    slot of ``prod`` into PSUM; Scalar copies each group out to SBUF (exact: the same dtype), where a matmul can
    read it (the groups, for :func:`_narrow_d_sums`). ``wf_cols`` (2-byte rows: w's fp32 columns): ``dy``'s
    slots are transposed too and Scalar's copy multiplies each by w's value on its partition, ``gw^T`` (the
    fp32 product ``dy * w`` rounded once to x's dtype, as Vector's ``tensor_tensor`` rounds it), so ``gw``
    leaves the SBUF port that Vector's 2-byte passes share with GpSimd's diagonals (:func:`_narrow_dx` sums
    ``gw^T``'s slot against the identity, which gives gw exactly)."""
    gw_t, x_t, gs_t, rstats, prod, chunk = state
    rstd_t, r16, r2 = rstats
    r0, Pc, NT = chunk
    H = x_t.shape[2]
    NC = cdiv(H, P)
    _dw_matmuls(dw_ps, prod, rstd_t, Pc, NT, NC, first, r=r16)
    groups = _transposed_groups(prod, Pc, NT, H)
    if wf_cols != None:  # noqa: E711
        gw_t = _transposed_groups(gw_t, Pc, NT, H, wf_cols)
    return (gw_t, x_t, gs_t, rstd_t, groups, chunk, r2)


def _narrow_d_sums(state, w_cols):
    """Stage C: ``D = sum_h w * prod`` per row, fp32 in PSUM ``[Pc, NT]``: a matmul of each transposed slot
    against the weight's column sums it over the partitions, each product exact (the first piece opens
    column j); so ``D`` is ``sum(w * dy * x)`` with one rounding per term (``prod``'s)."""
    gw_t, x_t, gs_t, rstd_t, groups, chunk, r2 = state
    r0, Pc, NT = chunk
    d_ps = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.psum)
    for k in range(len(groups)):
        ptc, c, j0 = groups[k]
        hw, gn = ptc.shape[0], ptc.shape[1]
        for g in range(gn):
            nisa.nc_matmul(dst=d_ps[:, j0 + g:j0 + g + 1], stationary=ptc[:, g, :], moving=w_cols[0:hw, c:c + 1],
                           accumulate=c > 0)
    return (gw_t, x_t, gs_t, rstd_t, d_ps, chunk, r2)


def _narrow_stats(state, H):
    """Stage D1 (Vector): ``b = -rstd^2 * D / H`` per row, for 2-byte rows as a hi + lo pair of parts in x's
    dtype (so ``b * x`` summed in PSUM is exact to fp32 rounding): hi straight from the sums (the same fp32
    product rounded once to x's dtype, as rounding b), then b in fp32 and ``lo = b - hi``."""
    gw_t, x_t, gs_t, rstd_t, d_ps, chunk, r2 = state
    r0, Pc, NT = chunk
    dt = x_t.dtype
    hi = None
    if dt != nl.float32:
        hi = nl.ndarray((Pc, NT), dtype=dt, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=hi, data=d_ps, op0=nl.multiply, operand0=-1.0 / H, op1=nl.multiply,
                                  operand1=r2)
    b = nl.ndarray((Pc, NT), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=b, data=d_ps, op0=nl.multiply, operand0=-1.0 / H, op1=nl.multiply,
                              operand1=r2)
    parts = [b]
    if dt != nl.float32:
        lo = nl.ndarray((Pc, NT), dtype=dt, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=lo, data1=b, data2=hi, op=nl.subtract, engine=_stats_engine(dt))
        parts = [hi, lo]
    return (gw_t, x_t, gs_t, rstd_t, parts, chunk)


def _narrow_diags(state):
    """Stage D2 (GpSimd): ``diag(part)`` for every slot and part of b, ``[Pc, NT, Pc]`` in x's dtype, one
    ``affine_select`` per part."""
    gw_t, x_t, gs_t, rstd_t, parts, chunk = state
    r0, Pc, NT = chunk
    diags = []
    for k in range(len(parts)):
        dg = nl.ndarray((Pc, NT, Pc), dtype=x_t.dtype, buffer=nl.sbuf)
        # dg[p, j, q] = part[p, j] where p == q (p - q == 0), else 0
        nisa.affine_select(dst=dg, pattern=[[0, NT], [-1, Pc]], channel_multiplier=1,
                           on_true_tile=_per_row(parts[k], Pc, NT, Pc), on_false_value=0.0, cmp_op=nl.equal)
        diags.append(dg)
    return (gw_t, x_t, gs_t, rstd_t, diags, chunk)


def _narrow_dx(state, dx, ident):
    """Stage E: ``y = gw + b * x`` per slot on the Tensor engine (``I @ gw`` or, with gw transposed, ``gw^T``'s
    slot against the identity, then ``diag(b) @ x`` per part; fp32 PSUM, a bank's worth of slots at a time),
    then one Vector pass per bank ``dx = rstd * y`` (fp32 product, rstd broadcast along H, rounded once),
    ``+ grad_s`` (after the rounding, as autograd adds the two) and the store."""
    gw_t, x_t, gs_t, rstd_t, diags, chunk = state
    r0, Pc, NT = chunk
    H = x_t.shape[2]
    transposed = isinstance(gw_t, list)
    dx_t = nl.ndarray((Pc, NT, H), dtype=x_t.dtype, buffer=nl.sbuf)
    S = max(1, PIECE // H)  # slots per fp32 PSUM bank
    for j0 in range(0, NT, S):
        sn = min(S, NT - j0)
        yb = nl.ndarray((Pc, sn, H), dtype=nl.float32, buffer=nl.psum)
        for s in range(sn):
            j = j0 + s
            if transposed:  # out[r, h] = sum_k gw^T[k, r] * I[k, h] = gw[r, h]: one exact product each
                for k in range(len(gw_t)):
                    gt, c, g0 = gw_t[k]
                    hw, gn = gt.shape[0], gt.shape[1]
                    if g0 <= j and j < g0 + gn:
                        nisa.nc_matmul(dst=yb[:, s, c * P:c * P + hw], stationary=gt[:, j - g0, :],
                                       moving=ident[0:hw, 0:hw], accumulate=False)
            else:
                nisa.nc_matmul(dst=yb[:, s, :], stationary=ident[0:Pc, 0:Pc], moving=gw_t[:, j, :],
                               accumulate=False)
            for k in range(len(diags)):
                nisa.nc_matmul(dst=yb[:, s, :], stationary=diags[k][:, j, :], moving=x_t[:, j, :], accumulate=True)
        nisa.tensor_tensor(dst=dx_t[:, j0:j0 + sn, :], data1=yb,
                           data2=rstd_t.ap(pattern=[[NT, Pc], [1, sn], [0, H]], offset=j0), op=nl.multiply)
    if gs_t != None:  # noqa: E711
        nisa.tensor_tensor(dst=dx_t, data1=dx_t, data2=gs_t, op=nl.add)
    nisa.dma_copy(dst=_rows(dx, r0, Pc, NT, H), src=dx_t)


def _narrow_weights(w, H, out_dt, transposed):
    """A segment's weight in SBUF: ``[rows [P, H] for Vector's gw or None, columns [P, NC] in out_dt for the
    sums over H, None]``; the third entry, the fp32 columns for Scalar's gw^T, is formed by
    :func:`_fp32_columns` (2-byte rows)."""
    cols = _w_columns(w, H, out_dt)
    if not transposed:
        return [_weight_rows(w, H), cols, None]
    return [None, cols, None]


def _fp32_columns(wts):
    """``wts[2]``, the weight's columns widened to fp32 (exact: w in a 2-byte dtype), on Vector: issued just
    before the segment's first transposes, so Vector's first products do not wait for the weight's load."""
    if wts[2] == None:  # noqa: E711
        wf = nl.ndarray(wts[1].shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wf, src=wts[1], engine=nisa.engine.vector)
        wts[2] = wf
    return wts[2]


def _narrow_backward(dys, xs, ws, rstds, grad_ss, dxs, dw_ps, ident, out_dt, chunks, segs, n_prog=1, pid=0):
    """The backward pipeline for rows narrower than ``WIDE`` (the q/k head norm): six stages per chunk,
    issued in an order in which no engine's in-order queue waits on work issued after it. Iteration i:
    chunk i-3's diagonals (GpSimd), chunk i-4's dx (Tensor engine, Vector, store), chunk i-2's sums over H
    and chunk i-1's dw matmuls and transposes (Tensor engine; Scalar copies the transposes out), chunk
    i-2's coefficients (Vector, three ``[P, NT]`` instructions, so the next iteration's diagonals find them
    ready), chunk i's products and per-row statistics (Vector). 2-byte rows (x and w of one 2-byte dtype) take
    ``gw`` off Vector: the Tensor engine transposes dy's slots too and Scalar's copy out of PSUM multiplies by
    w (:func:`_narrow_transposes`), so the SBUF port that GpSimd's diagonals share with Vector's 2-byte mode
    carries only ``dy * x`` and the diagonals. A segment's weights load after its first chunk's tiles (the
    first loads are not queued behind them). Once the last chunk's dw matmuls are issued, this core's dw
    column sums go out of PSUM and, on LNC=2, to the shared scratch (:func:`_dw_partial`) while the last
    chunks' dx are formed; returns that for :func:`_store_dw`. ``dys``, ``xs``, ``ws``, ``rstds``,
    ``grad_ss``, ``dxs``: one entry per segment (the q and k head norms of one launch), ``segs[k]`` chunk k's;
    segment g's dw sums go to columns ``g*NC ..`` of ``dw_ps`` (opened by its first chunk), so each segment's
    dw adds the same slots in the same order as a launch on it alone."""
    H = xs[0].shape[1]
    NC = cdiv(H, P)
    transposed = out_dt != nl.float32
    wts = [None] * len(ws)
    ahead = _prefetch(H, xs[0].dtype)
    n = len(chunks)
    loads = []
    st = [None] * n  # each chunk's state between stages
    partial = None
    for i in range(n + 4):
        if i == n + 1:  # the last chunk's dw matmuls were issued in iteration n
            partial = _dw_partial(dw_ps, n_prog, pid, NC * len(xs), True)
        for k in range(len(loads), min(n, i + 1 + ahead)):
            g = segs[k]
            loads.append(_load_narrow_bwd_chunk(dys[g], xs[g], grad_ss[g], rstds[g], chunks, k))
            if wts[g] == None:  # noqa: E711
                wts[g] = _narrow_weights(ws[g], H, out_dt, transposed)
        if 0 <= i - 3 < n:
            st[i - 3] = _narrow_diags(st[i - 3])
        if 0 <= i - 4 < n:
            _narrow_dx(st[i - 4], dxs[segs[i - 4]], ident)
            st[i - 4] = None
        if 0 <= i - 2 < n:
            st[i - 2] = _narrow_d_sums(st[i - 2], wts[segs[i - 2]][1])
        if 0 <= i - 1 < n:
            g = segs[i - 1]
            opens = i == 1 or segs[i - 2] != g
            wf = None
            if transposed:
                wf = _fp32_columns(wts[g])
            st[i - 1] = _narrow_transposes(st[i - 1], dw_ps[:, g * NC:(g + 1) * NC], opens, wf)
        if 0 <= i - 2 < n:
            st[i - 2] = _narrow_stats(st[i - 2], H)
        if i < n:
            st[i] = _narrow_products(loads[i], chunks[i], wts[segs[i]][0], out_dt)
            loads[i] = None
    return partial


@nki.jit
def rmsnorm_bwd_kernel(dy, x, w, rstd, grad_s=None):
    """``(dx [N, H] x.dtype, dw [ceil(H/128)*128] w.dtype)`` (``dw``'s first H entries are the gradient;
    the padding is zero) of :func:`rmsnorm_fwd_kernel` at ``x`` with its ``rstd``; ``grad_s`` (x's
    shape and dtype) is added to ``dx``. ``dy`` has the forward output's dtype."""
    N, H = x.shape
    NC = cdiv(H, P)
    HP = NC * P
    out_dt = _out_dtype(x, w)
    dx = nl.ndarray((N, H), dtype=x.dtype, buffer=nl.shared_hbm)
    dw = nl.ndarray((HP,), dtype=w.dtype, buffer=nl.shared_hbm)
    n_prog, pid = program_split()
    if H < WIDE:
        chunks = _narrow_chunks(N, H, x.dtype, n_prog, pid, BWD_NARROW_ROW_BYTES)
    else:
        chunks = _own_chunks(N, H, x.dtype, n_prog, pid)
    w_sb = None
    if H >= WIDE:  # the narrow rows load their weight after their first chunk (_narrow_backward)
        w_sb = _weight_rows(w, H)
    ident = identity(x.dtype)
    dw_ps = nl.ndarray((P, NC), dtype=nl.float32, buffer=nl.psum)
    if len(chunks) == 0:  # no rows here: zero partial sums
        nisa.memset(dst=dw_ps, value=0.0)
    partial = None
    if H < WIDE:
        partial = _narrow_backward([dy], [x], [w], [rstd], [grad_s], [dx], dw_ps, ident, out_dt, chunks,
                                   [0] * len(chunks), n_prog, pid)
    else:
        ahead = _prefetch(H, x.dtype)
        loads = []
        pending = None  # the previous chunk: its dx is formed after this chunk's first stage
        for i in range(len(chunks) + 1):
            cur = None
            if i < len(chunks):
                for k in range(len(loads), min(len(chunks), i + 1 + ahead)):
                    loads.append(_load_bwd_chunk(dy, x, grad_s, rstd, chunks[k]))
                cur = _bwd_sums(loads[i], chunks[i], w_sb, dw_ps, out_dt, i == 0)
                loads[i] = None
            if pending != None:  # noqa: E711
                _bwd_dx(pending, dx, ident)
            pending = cur
    _store_dw(dw, dw_ps, n_prog, pid, NC, partial)
    return dx, dw


@nki.jit
def rmsnorm_qk_bwd_kernel(dyq, dyk, xq, xk, wq, wk, rstd_q, rstd_k):
    """``(dxq, dxk, dw [2*ceil(H/128)*128])`` of :func:`rmsnorm_qk_fwd_kernel`: ``dw``'s first ``ceil(H/128)*128``
    entries are ``wq``'s gradient, the next ones ``wk``'s (each: the first H entries, zero padding). One
    pipeline over q's chunks then k's (:func:`_narrow_backward`), each tensor's chunks and dw sums those of
    :func:`rmsnorm_bwd_kernel` on it alone (bit-identical results); the LNC=2 dw combine of both weights is
    one."""
    H = xq.shape[1]
    NC = cdiv(H, P)
    out_dt = _out_dtype(xq, wq)
    dxs = []
    for x in [xq, xk]:
        dxs.append(nl.ndarray((x.shape[0], H), dtype=x.dtype, buffer=nl.shared_hbm))
    dw = nl.ndarray((2 * NC * P,), dtype=wq.dtype, buffer=nl.shared_hbm)
    n_prog, pid = program_split()
    chunks, segs = _segment_chunks([xq, xk], n_prog, pid, True)
    ident = identity(xq.dtype)
    dw_ps = nl.ndarray((P, 2 * NC), dtype=nl.float32, buffer=nl.psum)
    for g in range(2):
        rows_here = 0
        for k in range(len(segs)):
            if segs[k] == g:
                rows_here = rows_here + 1
        if rows_here == 0:  # no rows of this tensor here: zero partial sums
            nisa.memset(dst=dw_ps[:, g * NC:(g + 1) * NC], value=0.0)
    partial = _narrow_backward([dyq, dyk], [xq, xk], [wq, wk], [rstd_q, rstd_k], [None, None], dxs, dw_ps, ident,
                               out_dt, chunks, segs, n_prog, pid)
    _store_dw(dw, dw_ps, n_prog, pid, 2 * NC, partial)
    return dxs[0], dxs[1], dw
