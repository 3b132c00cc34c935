"""Shared pieces of every ``nki.isa`` module: enums, operand checks, writes, trace emission.

Every instruction follows the same three steps: validate (the helpers below, which raise
:class:`NkiValidationError` naming the op, the operand role, the rule and the values) -> compute in
vectorised numpy (read with :func:`read_f32`, write with :func:`store`) -> :func:`emit` one
``trace.Instr``.
"""

from __future__ import annotations

import enum
import math
import weakref
from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import memory as _mem
from .. import trace
from ..errors import NkiValidationError, fail
from ..tensor import NkiTensor, psum, sbuf

__all__ = [
    "engine", "oob_mode", "dge_mode", "reduce_cmd", "nc_version", "get_nc_version", "dma_engine",
    "matmul_perf_mode",
    "TENSOR", "VECTOR", "SCALAR", "GPSIMD", "DMA",
    "check_tensor", "check_buffer", "check_on_chip", "check_partitions", "check_same_partitions",
    "check_same_free_size", "check_dtype", "read_f32", "store", "operand", "emit", "engine_name",
    "span", "box", "dependency_attrs", "contiguous_bytes", "value_initialised", "set_value_initialised",
]

TENSOR, VECTOR, SCALAR, GPSIMD, DMA = trace.TENSOR, trace.VECTOR, trace.SCALAR, trace.GPSIMD, trace.DMA


class engine(enum.Enum):  # noqa: N801  (NKI spelling)
    """``nki.isa.engine`` (values as in the NKI 0.6 stubs)."""

    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dma_engine(enum.Enum):  # noqa: N801
    """``nki.isa.dma_engine``: the transfer mechanism of ``sendrecv``."""

    dma = 1  # shared DMA with CoreBarrier synchronisation
    gpsimd_dma = 2  # GpSimd's internal DMA (small SBUF->SBUF swaps in LNC=2)


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"  # fp8 2x mode (trn3 in the interpreter's model)


class nc_version(enum.Enum):  # noqa: N801
    """NeuronCore generation. Ordered (``get_nc_version() >= nc_version.gen3``, as nki-library's
    attention_block_tkg.py / topk do) and comparable with the generation number
    (``get_nc_version() >= 3``, experimental/collectives/fgcc.py)."""

    gen2 = 2  # trn1 / inf2
    gen3 = 3  # trn2
    gen4 = 4  # trn3

    def _rank(self, other: Any) -> int | None:
        if isinstance(other, nc_version):
            return other.value
        if isinstance(other, int) and not isinstance(other, bool):
            return other
        return None

    def __lt__(self, other: Any) -> bool:
        r = self._rank(other)
        return NotImplemented if r is None else self.value < r

    def __le__(self, other: Any) -> bool:
        r = self._rank(other)
        return NotImplemented if r is None else self.value <= r

    def __gt__(self, other: Any) -> bool:
        r = self._rank(other)
        return NotImplemented if r is None else self.value > r

    def __ge__(self, other: Any) -> bool:
        r = self._rank(other)
        return NotImplemented if r is None else self.value >= r


def get_nc_version() -> nc_version:
    """The interpreter models trn2 (NeuronCore-v3)."""
    return nc_version.gen3


_ENGINE_NAMES = {engine.tensor: TENSOR, engine.vector: VECTOR, engine.scalar: SCALAR,
                 engine.gpsimd: GPSIMD, engine.dma: DMA}


def engine_name(e: engine, default: str) -> str:
    """Trace engine name for an ``nisa.engine`` argument (``unknown`` -> ``default``)."""
    if e is engine.unknown or e is None:
        return default
    name = _ENGINE_NAMES.get(e)
    if name is None:
        fail("engine", "engine {engine} cannot run this instruction", engine=e)
    return name


# -- validation ---------------------------------------------------------------------------------
def check_tensor(op: str, role: str, t: Any) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        fail(op, "{role} must be an NkiTensor, got {type}", role=role, type=type(t).__name__)
    return t


def check_buffer(op: str, role: str, t: NkiTensor, allowed: tuple[str, ...]) -> None:
    """``t`` lives in one of the ``allowed`` buffers (names; 'hbm' covers all HBM kinds)."""
    name = t._st.buffer.name
    kind = "hbm" if not t._st.buffer.on_chip else name
    if kind not in allowed and name not in allowed:
        fail(op, "{role} must be in {allowed}, got {buffer} (tensor {name!r})", role=role,
             allowed="/".join(allowed), buffer=name, name=t.name)


def check_partitions(op: str, role: str, t: NkiTensor) -> None:
    """On-chip operand of a compute engine: <= 128 partitions with an aligned partition start.

    Start rules (``nki/guides/architecture/trainium_inferentia2_arch.rst``, "Accessing SBUF/PSUM
    tensors"): more than 64 partitions must start at 0; 33..64 at 0 or 64; up to 32 at 0/32/64/96.
    """
    p = t.shape[0]
    if p > 128:
        fail(op, "{role} partition dimension {p} exceeds maximum 128 (tensor {name!r})", role=role,
             p=p, name=t.name)
    start = t.partition_start
    if start == 0:
        return
    if p > 64:
        allowed = (0,)
    elif p > 32:
        allowed = (0, 64)
    else:
        allowed = (0, 32, 64, 96)
    if start not in allowed:
        fail(op, "{role} starts at partition {start} with {p} partitions; allowed starts for that "
             "size are {allowed} (tensor {name!r})", role=role, start=start, p=p, allowed=allowed,
             name=t.name)


def check_on_chip(op: str, role: str, t: Any, allowed: tuple[str, ...] = ("sbuf", "psum")) -> NkiTensor:
    """Tensor check + buffer in ``allowed`` + partition rules, in one call."""
    check_tensor(op, role, t)
    check_buffer(op, role, t, allowed)
    check_partitions(op, role, t)
    return t


def check_same_partitions(op: str, roles: dict[str, NkiTensor]) -> None:
    items = list(roles.items())
    r0, t0 = items[0]
    for r, t in items[1:]:
        if t.shape[0] != t0.shape[0]:
            fail(op, "{role} has {p} partitions but {role0} has {p0}", role=r, p=t.shape[0],
                 role0=r0, p0=t0.shape[0])


def check_same_free_size(op: str, roles: dict[str, NkiTensor]) -> None:
    items = list(roles.items())
    r0, t0 = items[0]
    for r, t in items[1:]:
        if t.free_size != t0.free_size:
            fail(op, "{role} has {n} elements per partition but {role0} has {n0}", role=r,
                 n=t.free_size, role0=r0, n0=t0.free_size)


def check_dtype(op: str, role: str, t: NkiTensor, allowed: Any) -> None:
    if t.dtype not in allowed:
        fail(op, "{role} dtype {dtype} not supported (allowed: {allowed})", role=role,
             dtype=t.dtype.name, allowed=", ".join(sorted(np.dtype(d).name for d in allowed)))


# -- data ---------------------------------------------------------------------------------------
def read_f32(t: NkiTensor) -> np.ndarray:
    """The operand's values as float32 (the engines' arithmetic precision); no copy if already fp32."""
    a = t.np()
    if a.dtype == np.float32:
        return a
    if a.dtype in _dt.PACKED_X4:
        fail("read", "tensor {name!r} is {dtype}: 4x packed MX dtypes are only moved and "
             "reinterpreted by trnkit's interpreter (no engine computes on them on trn2)",
             name=t.name, dtype=_dt.dtype_name(a.dtype))
    return a.astype(np.float32)


def store(dst: NkiTensor, values: Any) -> None:
    """Write ``values`` (broadcastable / same element count) into ``dst`` with the hardware cast.

    Use this for every write an instruction makes: it casts (RNE, saturating ints) and, for PSUM,
    marks the elements as no longer matmul-accumulated (so ``nc_matmul(accumulate=None)`` overwrites
    them and ``accumulate=True`` warns).
    """
    out = dst.np()
    v = _dt.cast(values, dst.dtype)
    if v.shape != out.shape and v.size == out.size:
        v = v.reshape(out.shape)
    out[...] = v
    st = dst._st
    if st.mm is not None:
        dst.matmul_flags()[...] = False
    if st.buffer is psum:
        set_value_initialised(dst, True)


# PSUM storage -> which elements hold a value written by a non-matmul instruction (memset,
# tensor_copy, activation, ...; TensorE transposes are matmuls and clear it): nc_matmul may not
# accumulate onto those on trn2 (tensor_engine.py)
_value_init: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def value_initialised(t: NkiTensor) -> np.ndarray | None:
    """Bool view (``t``'s shape) of the PSUM elements last written by a non-matmul instruction (None
    for a view in another element size than its allocation's, which matmuls cannot use anyway)."""
    st = t._st
    if t.dtype.itemsize != st.dtype.itemsize:
        return None
    flags = _value_init.get(st)
    if flags is None:
        flags = _value_init[st] = np.zeros(st.elements, dtype=np.bool_)
    return np.ndarray(t.shape, np.bool_, buffer=flags, offset=t.resolve_offset("psum"),
                      strides=t.strides)


def set_value_initialised(t: NkiTensor, written_by_non_matmul: bool) -> None:
    flags = value_initialised(t)
    if flags is not None:
        flags[...] = written_by_non_matmul


# -- trace --------------------------------------------------------------------------------------
def operand(role: str, t: NkiTensor) -> trace.Operand:
    m = describe(t)
    return trace.Operand(role, m[0], t.shape, m[1], m[2], m[3], m[4])


def describe(t: NkiTensor) -> tuple:
    """``(buffer name, dtype name, partitions, free elems, nbytes, on_chip, span, box, slot box)`` of ``t`` for
    its trace records (:func:`operand`, :func:`span`, :func:`box`, :func:`slot_box`); cached on static views (a
    view's shape / strides / offset / dtype never change; dynamic-offset views are described per use)."""
    m = t._meta
    if m is not None:
        return m
    st = t._st
    on_chip = st.buffer.on_chip
    size = math.prod(t.shape)
    parts = t.shape[0] if on_chip else 1
    sp, bx = _span_box(t)
    m = (st.buffer.name, _dt.dtype_name(t.dtype), parts, size // parts, size * t.dtype.itemsize,
         on_chip, sp, bx, _slot_box(st, bx))
    if t._dyn is None:
        t._meta = m
    return m


def _span_box(t: NkiTensor) -> tuple[tuple[int, int, int], tuple[int, int, int, int, int]]:
    st = t._st
    key = st.key
    if t._vec is not None:  # indirect rows: anywhere in the storage
        return (key, 0, st.data.size), (key, 0, 1, 0, st.data.size)
    try:
        off = t.resolve_offset("trace")
    except NkiValidationError:  # a skipped out-of-bounds dynamic DMA
        off = t.offset
    isz, ssz = t.dtype.itemsize, st.dtype.itemsize
    lo = hi = 0  # extent over the free dims (dims 1.. on chip)
    shape, strides = t.shape, t.strides
    for n, s in zip(shape[1:], strides[1:]):
        if s > 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    d0 = (shape[0] - 1) * strides[0]
    flat_lo, flat_hi = lo + min(d0, 0), hi + max(d0, 0)
    span_ = (key, (off + flat_lo) * isz // ssz, ((off + flat_hi + 1) * isz + ssz - 1) // ssz)
    if not st.buffer.on_chip:
        return span_, _hbm_box(t, off, span_)
    ps = st.free_bytes // ssz  # partition stride in storage elements
    first = (off + lo) * isz // ssz
    p0 = first // ps
    base = p0 * ps
    return span_, (key, p0, p0 + shape[0], first - base,
                   ((off + hi + 1) * isz + ssz - 1) // ssz - base)


def _hbm_box(t: NkiTensor, off: int, span_: tuple[int, int, int]) -> tuple[int, int, int, int, int]:
    """An HBM access's box as rows x columns of its tensor's last dimension (``(key, row0, row1, col0, col1)``),
    so strided accesses to disjoint column windows (one q group's columns of every row of an output) do not
    look dependent; where the access's columns leave one row window (or its dtype differs from the storage's)
    the whole rows its flat span touches (a superset, as the flat span is)."""
    st = t._st
    key, lo, hi = span_
    row = st.shape[-1] if len(st.shape) > 1 else st.elements
    whole_rows = (key, lo // row, (hi - 1) // row + 1, 0, row)
    if t.dtype.itemsize != st.dtype.itemsize:
        return whole_rows
    r_lo = r_hi = c_lo = c_hi = 0
    for n, s in zip(t.shape, t.strides):
        ext = (n - 1) * s
        if s % row == 0:
            r_lo, r_hi = r_lo + min(ext, 0), r_hi + max(ext, 0)
        else:
            c_lo, c_hi = c_lo + min(ext, 0), c_hi + max(ext, 0)
    col0, row0 = off % row, off // row
    if col0 + c_lo < 0 or col0 + c_hi >= row:
        return whole_rows
    return (key, row0 + r_lo // row, row0 + r_hi // row + 1, col0 + c_lo, col0 + c_hi + 1)


def _slot_box(st: Any, bx: tuple) -> tuple | None:
    """A placed tile's box on its kernel instance's placement space (``nl.ndarray(..., address=)``):
    ``(space key, partitions [p0, p1) counted from partition 0, bytes [lo, hi) of each partition)``; None for
    any other storage. Tiles placed on overlapping bytes get overlapping slot boxes (the cost model's
    dependencies between tiles that share a slot)."""
    space = getattr(st, "space", None)
    if space is None:
        return None
    _, p0, p1, lo, hi = bx
    isz = st.dtype.itemsize
    return (space.key, st.base_partition + p0, st.base_partition + p1, st.byte0 + lo * isz, st.byte0 + hi * isz)


def slot_box(t: NkiTensor) -> tuple | None:
    """``t``'s box on the placement space its tile is placed in (:func:`_slot_box`), None for an unplaced tile."""
    return describe(t)[8]


def span(t: NkiTensor) -> tuple[int, int, int]:
    """``(storage key, lo, hi)``: half-open range of storage elements (storage dtype) ``t`` touches."""
    return describe(t)[6]


def box(t: NkiTensor) -> tuple[int, int, int, int, int]:
    """``(storage key, p0, p1, lo, hi)``: partitions ``[p0, p1)`` x per-partition free elements
    ``[lo, hi)`` (storage dtype) that ``t`` touches; on HBM the "partitions" are the rows of the tensor's last
    dimension and ``[lo, hi)`` a column window of them (:func:`_hbm_box`). Two accesses overlap only if both
    intervals overlap, so writes to disjoint slices of one tile (``y[:, :h]`` / ``y[:, h:]``, different
    partition slabs) or of one HBM output (``o[b, :, 128g:128(g+1)]`` for each ``g``) do not look dependent."""
    return describe(t)[7]


def dependency_attrs(reads: list[NkiTensor], writes: list[NkiTensor]) -> dict:
    """Trace attrs for the cost model's schedule: flat ``reads``/``writes`` spans and the finer
    ``read_boxes``/``write_boxes`` (:func:`box`)."""
    r = [describe(t) for t in reads]
    w = [describe(t) for t in writes]
    out = {"reads": tuple(x[6] for x in r), "writes": tuple(x[6] for x in w),
           "read_boxes": tuple(x[7] for x in r), "write_boxes": tuple(x[7] for x in w)}
    if any(x[8] is not None for x in (*r, *w)):
        out["slot_read_boxes"] = tuple(x[8] or x[7] for x in r)
        out["slot_write_boxes"] = tuple(x[8] or x[7] for x in w)
    return out


def contiguous_bytes(t: NkiTensor) -> int:
    """Bytes of the longest contiguous innermost run of ``t`` (a DMA descriptor row)."""
    run = 1
    for n, s in zip(reversed(t.shape), reversed(t.strides)):
        if n == 1:
            continue
        if s != run:
            break
        run *= n
    return run * t.dtype.itemsize


def emit(op: str, engine: str, dst: NkiTensor | None = None,
         srcs: dict[str, NkiTensor | None] | None = None, flops: int = 0, hbm_bytes: int = 0,
         dma_bytes: int = 0, attrs: dict | None = None) -> None:
    """Append one ``trace.Instr`` to the active trace (cheap no-op when nothing records).

    ``elems_per_partition`` is the largest on-chip operand's free size and ``partitions`` the largest
    on-chip partition count; ``program_id`` is this instance's flat id. ``attrs`` gets ``reads`` /
    ``writes`` (:func:`span` of each source / of dst) for the cost model's dependency schedule.
    """
    tr = trace.active()
    if tr is None:
        return
    attrs = dict(attrs) if attrs else {}
    ops = []
    reads, read_boxes, writes, write_boxes = [], [], [], []
    slots = False  # an operand is a placed tile: the boxes on its placement space too (slot_*_boxes)
    elems = parts = any_elems = 0  # largest on-chip free size / partition count; largest of all
    Operand = trace.Operand
    roles = [(True, "dst", dst)] if dst is not None else []  # (written?, role, tensor)
    if srcs:
        roles.extend((False, r, t) for r, t in srcs.items() if isinstance(t, NkiTensor))
    for written, r, t in roles:
        m = t._meta or describe(t)
        ops.append(Operand(r, m[0], t.shape, m[1], m[2], m[3], m[4]))
        if written:
            writes.append(m[6])
            write_boxes.append(m[7])
        else:
            reads.append(m[6])
            read_boxes.append(m[7])
        if m[8] is not None:
            slots = True
        if m[3] > any_elems:
            any_elems = m[3]
        if m[5]:  # on-chip operand
            if m[3] > elems:
                elems = m[3]
            if m[2] > parts:
                parts = m[2]
    preset = "read_boxes" in attrs  # the caller's own dependency attrs (dependency_attrs: slots included)
    attrs.setdefault("reads", tuple(reads))
    attrs.setdefault("writes", tuple(writes))
    attrs.setdefault("read_boxes", tuple(read_boxes))
    attrs.setdefault("write_boxes", tuple(write_boxes))
    if slots and not preset:
        ms = [(w, t._meta or describe(t)) for w, _, t in roles]
        attrs["slot_read_boxes"] = tuple(m[8] or m[7] for w, m in ms if not w)
        attrs["slot_write_boxes"] = tuple(m[8] or m[7] for w, m in ms if w)
    if not parts and ops:  # HBM -> HBM copies
        elems, parts = any_elems, 1
    ctx = _mem.current()
    attrs.setdefault("launch", ctx.launch.seq)  # the cost model syncs the programs of a grid per launch
    tr.append(trace.Instr(op=op, engine=engine, operands=tuple(ops), flops=int(flops),
                          hbm_bytes=int(hbm_bytes), dma_bytes=int(dma_bytes),
                          elems_per_partition=int(elems), partitions=int(parts),
                          program_id=ctx.flat_program_id, attrs=attrs))


# Buffers as tuples of names, for check_buffer
SBUF = (sbuf.name,)
PSUM = (psum.name,)
ON_CHIP = ("sbuf", "psum")
HBM = ("hbm",)
