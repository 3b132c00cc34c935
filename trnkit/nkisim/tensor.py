"""``NkiTensor``: flat storage per allocation plus a strided view, as in the NKI language guide.

Model (``nki/get-started/nki-language-guide.rst`` "Anatomy of a tensor", ``nki/deep-dives/nki-aps.rst``):

* every allocation owns a flat 1-D numpy array (:class:`Storage`); an on-chip (SBUF/PSUM) allocation
  of shape ``(P, f1, f2, ...)`` stores partition ``p`` at ``[p*F, (p+1)*F)`` with ``F = f1*f2*...``,
  so the partition stride of the storage is ``F`` (the first ``.ap`` pair's step);
* a view is ``(shape, strides, offset)`` in elements of its dtype: element ``(i0, i1, ...)`` lives at
  ``flat[offset + sum(strides[k] * i_k)]``. All views of an allocation share its storage;
* every view is bounds-checked when an instruction first accesses it, not when it is built (on-chip
  views must also stay inside their partitions): AWS's kernels build out-of-range views they only use
  under a guard (an ``.ap`` past the end, an empty ``nl.ds(0, 0)``), as the compiler only rejects an
  access. An access outside the storage raises :class:`NkiValidationError` naming the instruction,
  the tensor, the index and the bound. Structural rules (partition contiguity of an on-chip view, the
  ``.ap`` partition step, too many indices, negative steps) are still checked when the view is built;
* ``t.np()`` is a numpy array aliasing the storage (what the ISA ops read and write);
* dynamic offsets (``.ap(scalar_offset=...)``, ``select(dim, tensor)``) are resolved each time the
  view is used; ``vector_offset`` (per-partition row gather/scatter on HBM) views are only consumed
  by ``nisa.dma_copy`` through :meth:`NkiTensor.indirect_plan`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import dtypes as _dt
from . import memory as _memory
from .errors import NkiValidationError, fail, require

__all__ = [
    "MemoryRegion", "sbuf", "psum", "hbm", "shared_hbm", "private_hbm", "BUFFERS",
    "Storage", "NkiTensor", "VirtualRegister", "allocate", "from_array", "place", "PlacementSpace",
    "PlacedStorage",
]


class MemoryRegion:
    """A memory buffer kind (``nl.sbuf``, ``nl.psum``, ``nl.hbm``, ``nl.shared_hbm``, ``nl.private_hbm``)."""

    __slots__ = ("name", "on_chip")

    def __init__(self, name: str, on_chip: bool) -> None:
        self.name = name
        self.on_chip = on_chip

    @property
    def is_hbm(self) -> bool:
        return not self.on_chip

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    __str__ = __repr__


sbuf = MemoryRegion("sbuf", True)
psum = MemoryRegion("psum", True)
hbm = MemoryRegion("hbm", False)  # per instance (the docs treat it as private_hbm)
private_hbm = MemoryRegion("private_hbm", False)
shared_hbm = MemoryRegion("shared_hbm", False)  # one copy shared by all programs of a launch
BUFFERS = {b.name: b for b in (sbuf, psum, hbm, private_hbm, shared_hbm)}


class VirtualRegister:
    """A 32-bit runtime register (the loop variable of ``nl.fori_loop``, ``nisa.register_alloc``).

    Its value is only usable where the hardware reads registers: ``.ap(scalar_offset=reg)`` and the
    ``nisa.register_*`` instructions. Python arithmetic, ``int()`` and use as an index are refused
    (the real value does not exist at trace time on the device).
    """

    __slots__ = ("value",)

    def __init__(self, value: int = 0) -> None:
        self.value = int(value)

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"

    def _refuse(self, *_: Any) -> Any:
        fail("VirtualRegister", "a runtime register has no compile-time value; use it as "
             ".ap(scalar_offset=reg) or with nisa.register_* instructions")

    __index__ = __int__ = __bool__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __floordiv__ = __truediv__ = __mod__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse


_names = itertools.count()


_STORAGE_KEYS = itertools.count()


class Storage:
    """The flat backing array of one allocation (or of one kernel argument)."""

    __slots__ = ("data", "buffer", "shape", "dtype", "name", "free_bytes", "mm", "_flats", "key",
                 "alloc", "__weakref__")

    def __init__(self, data: np.ndarray, shape: tuple[int, ...], buffer: MemoryRegion, name: str) -> None:
        self.data = data  # 1-D, C-contiguous
        self.dtype = data.dtype
        self.shape = shape
        self.buffer = buffer
        self.name = name
        # bytes per partition (on-chip); the storage's partition stride in bytes
        self.free_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * data.dtype.itemsize
        self.mm: np.ndarray | None = None  # PSUM: which elements a matmul wrote (accumulate=None)
        self._flats: dict[np.dtype, np.ndarray] = {data.dtype: data}
        # unique for the process (id() is reused after a free): the trace's dependency key
        self.key = next(_STORAGE_KEYS)
        self.alloc: _memory.Allocation | None = None  # SBUF/PSUM liveness record (memory.py)

    def flat(self, dtype: np.dtype) -> np.ndarray:
        """The storage reinterpreted as a flat array of ``dtype``."""
        f = self._flats.get(dtype)
        if f is None:
            require(self.data.nbytes % dtype.itemsize == 0, self.name,
                    "storage of {nbytes} bytes cannot be reinterpreted as {dtype}",
                    nbytes=self.data.nbytes, dtype=dtype.name)
            f = self._flats[dtype] = self.data.view(dtype)
        return f

    @property
    def elements(self) -> int:
        """Elements of the storage's dtype it holds (the size of its per-element flag arrays)."""
        return self.data.size

    def matmul_flags(self) -> np.ndarray:
        if self.mm is None:
            self.mm = np.zeros(self.elements, dtype=np.bool_)
        return self.mm

    base_partition = 0  # physical partition of the storage's partition 0 (PlacedStorage: its placement)
    stable = True  # arrays from array() stay valid for the storage's life (so views may cache them)

    def array(self, shape: tuple[int, ...], dtype: np.dtype, offset: int, strides: tuple[int, ...]) -> np.ndarray:
        """The numpy array of a view: element ``i`` at ``offset + sum(strides * i)`` (elements of ``dtype``)."""
        isz = dtype.itemsize
        return np.ndarray(shape, dtype, buffer=self.flat(dtype), offset=offset * isz,
                          strides=tuple(s * isz for s in strides))


_C_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def _c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = _C_STRIDES.get(shape) if type(shape) is tuple else None
    if strides is not None:
        return strides
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    strides = tuple(reversed(out))
    if type(shape) is tuple and len(_C_STRIDES) < 4096:
        _C_STRIDES[shape] = strides
    return strides


def _norm_dim(op: str, dim: int, ndim: int) -> int:
    d = dim + ndim if dim < 0 else dim
    require(0 <= d < ndim, op, "dim {dim} out of range for a {ndim}-D tensor", dim=dim, ndim=ndim)
    return d


_OPERATOR_MSG = ("binary operators on tensors are not supported by NKI; use nki.isa instructions "
                 "(e.g. nisa.tensor_tensor, nisa.tensor_scalar) directly")


class NkiTensor:
    """A view ``(shape, strides, offset, dtype)`` of a :class:`Storage` in some memory buffer."""

    __slots__ = ("_st", "shape", "strides", "offset", "dtype", "name", "_np", "_dyn", "_vec", "_meta",
                 "_unchecked")

    # -- construction --------------------------------------------------------------------------
    def __init__(self, shape: Sequence[int], dtype: Any, storage: Any = None,
                 buffer: MemoryRegion = sbuf, name: str = "") -> None:
        """Bind a tensor to ``storage`` (a numpy array, a :class:`Storage`, or None to allocate)."""
        dt = _dt.resolve(dtype, "NkiTensor")
        shape = tuple(int(s) for s in shape)
        if storage is None:
            t = allocate(shape, dt, buffer, name)
        elif isinstance(storage, Storage):
            t = NkiTensor._make(storage, shape, _c_strides(shape), 0, dt, name or storage.name)
            t._check_bounds("NkiTensor")
        else:
            t = from_array(np.asarray(storage).reshape(shape).astype(dt, copy=False), buffer, name)
        for slot in NkiTensor.__slots__:
            object.__setattr__(self, slot, getattr(t, slot))

    @staticmethod
    def _make(st: Storage, shape: tuple[int, ...], strides: tuple[int, ...], offset: int,
              dtype: np.dtype, name: str, dyn: Any = None, vec: Any = None) -> NkiTensor:
        t = object.__new__(NkiTensor)
        t._st = st
        t.shape = shape
        t.strides = strides
        t.offset = offset
        t.dtype = dtype
        t.name = name
        t._np = None
        t._dyn = dyn  # (scalar source: NkiTensor | VirtualRegister, multiplier)
        t._vec = vec  # (index tensor [P,1], row stride)
        t._meta = None  # trace description of a static view, cached by isa.common.describe
        # bounds not yet checked: None = in bounds; "" = check at the first access; else the reason
        # it is out of range (raised at the first access)
        t._unchecked = None
        return t

    def _derive(self, shape: tuple[int, ...], strides: tuple[int, ...], offset: int, op: str,
                dtype: np.dtype | None = None) -> NkiTensor:
        t = NkiTensor._make(self._st, shape, strides, offset, dtype or self.dtype, self.name,
                            self._dyn, self._vec)
        t._structure(op)
        t._unchecked = ""  # in range or not: checked when accessed
        return t

    # -- basic attributes ----------------------------------------------------------------------
    @property
    def buffer(self) -> MemoryRegion:
        return self._st.buffer

    @property
    def storage(self) -> Storage:
        return self._st

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def on_chip(self) -> bool:
        return self._st.buffer.on_chip

    @property
    def partition_stride(self) -> int:
        """Elements (of this view's dtype) between partitions of an on-chip storage."""
        return self._st.free_bytes // self.dtype.itemsize

    @property
    def partition_start(self) -> int:
        """First physical partition an on-chip view touches (a placed tile's partition offset included;
        0 for HBM)."""
        if not self._st.buffer.on_chip:
            return 0
        return self._st.base_partition + self.offset // self.partition_stride

    @property
    def free_size(self) -> int:
        """Elements per partition (on-chip: product of dims 1..; HBM: all elements)."""
        if self._st.buffer.on_chip:
            return math.prod(self.shape[1:])
        return math.prod(self.shape)

    def __repr__(self) -> str:
        extra = " indirect" if self.is_indirect() else ""
        return (f"NkiTensor({self.name!r}, shape={self.shape}, dtype={self.dtype.name}, "
                f"buffer={self._st.buffer.name}, strides={self.strides}, offset={self.offset}{extra})")

    # -- bounds --------------------------------------------------------------------------------
    def _extent(self) -> tuple[int, int]:
        lo = hi = 0
        for n, s in zip(self.shape, self.strides):
            if s > 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return lo, hi

    def _structure(self, op: str) -> None:
        """The rules a view breaks however it is used: contiguous partition access on chip."""
        if self._st.buffer.on_chip and len(self.shape) > 0 and self.shape[0] > 1 and self._vec is None \
                and self.strides[0] != self.partition_stride:
            fail(op, "tensor {name!r}: partition access must be contiguous (partition step "
                 "{step} elements, storage partition stride {pstride})",
                 name=self.name, step=self.strides[0], pstride=self.partition_stride)

    def _checked(self) -> None:
        """Bounds of a static view at its first access (by the running instruction)."""
        why = self._unchecked
        op = _memory.current().memory.running
        if why:
            fail(op, "{why} (tensor {name!r}, accessed)", why=why, name=self.name)
        self._check_bounds(op)
        self._unchecked = None

    def _check_bounds(self, op: str, offset: int | None = None) -> None:
        off = self.offset if offset is None else offset
        for n in self.shape:
            if n <= 0:
                fail(op, "tensor {name!r}: empty or negative dimension in shape {shape}",
                     name=self.name, shape=self.shape)
        st = self._st
        if self._vec is not None:
            return  # row offsets are only known per use; dma_copy checks them (oob_mode)
        if st.buffer.on_chip and len(self.shape) > 0:
            ps = self.partition_stride
            p0, base = divmod(off, ps)
            if self.shape[0] > 1 and self.strides[0] != ps:
                fail(op, "tensor {name!r}: partition access must be contiguous (partition step "
                     "{step} elements, storage partition stride {pstride})",
                     name=self.name, step=self.strides[0], pstride=ps)
            nparts = st.shape[0]
            if p0 < 0 or p0 + self.shape[0] > nparts:
                fail(op, "tensor {name!r}: partitions [{start}, {stop}) out of bounds for {bound} "
                     "partitions", name=self.name, start=p0, stop=p0 + self.shape[0], bound=nparts)
            lo = hi = base
            for n, s in zip(self.shape[1:], self.strides[1:]):
                if s > 0:
                    hi += (n - 1) * s
                else:
                    lo += (n - 1) * s
            if lo < 0 or hi >= ps:
                fail(op, "tensor {name!r}: free-dim access [{lo}, {hi}] out of bounds for {bound} "
                     "elements per partition (shape {shape}, strides {strides}, offset {offset})",
                     name=self.name, lo=lo, hi=hi, bound=ps, shape=self.shape,
                     strides=self.strides, offset=off)
        else:
            lo, hi = self._extent()
            size = st.data.nbytes // self.dtype.itemsize
            if off + lo < 0 or off + hi >= size:
                fail(op, "tensor {name!r}: access [{lo}, {hi}] out of bounds for storage of {bound} "
                     "elements (shape {shape}, strides {strides}, offset {offset})",
                     name=self.name, lo=off + lo, hi=off + hi, bound=size, shape=self.shape,
                     strides=self.strides, offset=off)

    # -- numpy access --------------------------------------------------------------------------
    def np(self) -> np.ndarray:
        """A numpy array of shape ``self.shape`` / dtype ``self.dtype`` aliasing the storage.

        Every call is an access by the running instruction (on-chip liveness, ``memory.py``)."""
        rec = self._st.alloc
        if rec is not None:
            rec.touch()
        else:  # HBM: not tracked by allocation, so the instruction keeps its place (memory.Memory.pin)
            _memory.current().memory.pin()
        a = self._np
        if a is not None:
            return a
        if self._vec is not None:
            fail("np", "tensor {name!r} is an indirect (vector_offset) view; only nisa.dma_copy "
                 "can read or write it", name=self.name)
        if self._dyn is None:
            if self._unchecked is not None:
                self._checked()
            off = self.offset
        else:
            off = self.resolve_offset(_memory.current().memory.running)
        a = self._st.array(self.shape, self.dtype, off, self.strides)
        if self._dyn is None and self._st.stable:
            self._np = a
        return a

    def peek(self) -> np.ndarray:
        """A copy of the tensor's value now, for a test harness's tap (``trnkit.conformance.harness.tap``): read
        without recording an access (no liveness touch, no HBM pin, nothing traced), so a run with taps computes,
        checks and costs exactly what one without them does. Direct views only."""
        if self._vec is not None or self._dyn is not None:
            fail("peek", "tensor {name!r} is an indirect or dynamic view: a tap reads direct views only",
                 name=self.name)
        if self._unchecked is not None:
            self._checked()
        return np.array(self._st.array(self.shape, self.dtype, self.offset, self.strides))

    def resolve_offset(self, op: str) -> int:
        """The view's start element now (reads a dynamic ``scalar_offset``), bounds-checked."""
        if self._dyn is None:
            if self._unchecked is not None:
                self._checked()
            return self.offset
        src, mult = self._dyn
        if isinstance(src, VirtualRegister):
            _memory.current().memory.pin()  # reads a register: keeps its place (memory.Memory.pin)
            value = src.value
        else:
            value = int(src.np().reshape(-1)[0])
        off = self.offset + value * mult
        try:
            self._check_bounds(op, off)
        except NkiValidationError as exc:
            raise NkiValidationError(f"{exc} [dynamic scalar_offset value {value} x {mult}]") from None
        return off

    def matmul_flags(self) -> np.ndarray:
        """Bool view (same shape) of which elements a matmul has written (PSUM accumulate=None)."""
        isz = self.dtype.itemsize
        flags = self._st.matmul_flags()
        # the flags array has one bool per storage element of the storage dtype
        ratio = self._st.dtype.itemsize
        require(isz == ratio, "nc_matmul", "PSUM tile {name!r} viewed as {dtype} (itemsize {isz}) "
                "cannot track accumulation; use the allocation's dtype", name=self.name,
                dtype=self.dtype, isz=isz)
        off = self.resolve_offset("nc_matmul")
        return np.ndarray(self.shape, np.bool_, buffer=flags, offset=off, strides=self.strides)

    # -- indexing ------------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> NkiTensor:
        if self._vec is not None:
            fail("__getitem__", "tensor {name!r} is an indirect (vector_offset) view and cannot be "
                 "sliced further", name=self.name)
        if type(key) is not tuple:
            key = (key,)
        shape_in = self.shape
        ndim = len(shape_in)
        for k in key:
            if k is Ellipsis:
                n_ell = sum(1 for k2 in key if k2 is Ellipsis)
                require(n_ell == 1, "__getitem__", "an index can only have a single ellipsis ('...')")
                i = next(j for j, k2 in enumerate(key) if k2 is Ellipsis)
                key = key[:i] + (slice(None),) * (ndim - len(key) + 1) + key[i + 1:]
                break
        if len(key) > ndim:
            fail("__getitem__", "too many indices for tensor {name!r}: {n} indices, {ndim} dims",
                 name=self.name, n=len(key), ndim=ndim)
        on_chip = self._st.buffer.on_chip
        shape: list[int] = []
        strides: list[int] = []
        off = self.offset
        dropped_stride = None
        # A sub-view of an in-bounds view taken with in-range ints / non-empty slices of step >= 1
        # stays inside it, so it is in bounds; the one structural rule a sub-view can newly break is
        # partition contiguity (an on-chip partition slice with step > 1), checked below. Anything
        # out of range is only recorded: an access raises (see the module doc).
        check = False
        why = None if self._unchecked is None else ""  # a sub-view of an unchecked view: check it
        self_strides = self.strides
        for d, k in enumerate(key):
            n = shape_in[d]
            s = self_strides[d]
            if type(k) is slice:
                start, stop, step = k.start, k.stop, k.step
                if start is None and stop is None and step is None:
                    shape.append(n)
                    strides.append(s)
                    continue
                if step is None:
                    step = 1
                elif step < 1:
                    fail("__getitem__", "slice step must be >= 1, got {step} (tensor {name!r} dim "
                         "{dim})", step=step, name=self.name, dim=d)
                elif step != 1 and d == 0 and on_chip:
                    check = True
                if start is None:
                    start = 0
                elif start < 0:
                    start += n
                if stop is None:
                    stop = n
                elif stop < 0:
                    stop += n
                if not 0 <= start < stop <= n and not why:
                    why = (f"slice {k.start}:{k.stop} out of bounds (or empty) for dim {d} of size {n}")
                shape.append(max(0, (stop - start + step - 1) // step))
                strides.append(s * step)
                off += start * s
            elif isinstance(k, (NkiTensor, VirtualRegister)):
                others = [x for j, x in enumerate(key) if j != d]
                require(all(type(x) is slice and x == slice(None) for x in others), "__getitem__",
                        "a dynamic index must be the only non-':' index (tensor {name!r})",
                        name=self.name)
                return self.select(d, k)
            else:
                try:
                    i = k.__index__()
                except (AttributeError, TypeError):
                    fail("__getitem__", "unsupported index {key!r} for tensor {name!r} (use ints, "
                         "slices, nl.ds or .ap())", key=k, name=self.name)
                if i < 0:
                    i += n
                if not 0 <= i < n and not why:
                    why = f"index {k} out of bounds for dim {d} of size {n}"
                off += i * s
                if on_chip and d == 0:  # on-chip: an int on the partition dim keeps a size-1 dim
                    shape.append(1)
                    strides.append(s)
                else:
                    dropped_stride = s
        for d in range(len(key), ndim):  # trailing dims not indexed: kept whole
            shape.append(shape_in[d])
            strides.append(self_strides[d])
        if on_chip and len(shape) < 2 and dropped_stride is not None:
            shape.append(1)  # on-chip results stay >= 2-D: the last int-indexed free dim stays
            strides.append(dropped_stride)
        elif not shape:
            shape.append(1)  # HBM results are >= 1-D
            strides.append(1)
        t = NkiTensor._make(self._st, tuple(shape), tuple(strides), off, self.dtype, self.name,
                            self._dyn, None)
        if check:
            t._structure("__getitem__")
        t._unchecked = why
        return t

    def __setitem__(self, key: Any, value: Any) -> None:
        fail("__setitem__", "tensors are written only by nki.isa instructions (every nisa.* call "
             "writes its dst); got an assignment to {name!r}", name=self.name)

    def __iter__(self):  # without this, Python would iterate through __getitem__
        fail("__iter__", "NkiTensor {name!r} is not iterable", name=self.name)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        fail("__array__", "NkiTensor {name!r} cannot be converted to a numpy array inside a kernel; "
             "tests can read it with t.np()", name=self.name)

    def _no_operator(self, *_: Any) -> Any:
        fail("NkiTensor", _OPERATOR_MSG)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_operator
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __pow__ = _no_operator
    __matmul__ = __rmatmul__ = __neg__ = __pos__ = __abs__ = __invert__ = _no_operator
    __and__ = __or__ = __xor__ = __lshift__ = __rshift__ = _no_operator
    __lt__ = __le__ = __gt__ = __ge__ = _no_operator
    __iadd__ = __isub__ = __imul__ = __itruediv__ = _no_operator
    __hash__ = object.__hash__

    # -- view primitives -----------------------------------------------------------------------
    def _static_only(self, op: str) -> None:
        if self._vec is not None or self._dyn is not None:
            fail(op, "tensor {name!r} already uses indirect addressing", name=self.name)

    def _not_partition(self, op: str, dim: int) -> None:
        if self._st.buffer.on_chip and dim == 0:
            fail(op, "on-chip tensor {name!r}: dim 0 is the partition dim and cannot be changed "
                 "by {op}", name=self.name, op=op)

    def is_indirect(self) -> bool:
        return self._dyn is not None or self._vec is not None

    def is_contiguous(self) -> bool:
        start = 1 if self._st.buffer.on_chip else 0
        acc = 1
        for n, s in zip(reversed(self.shape[start:]), reversed(self.strides[start:])):
            if n != 1 and s != acc:
                return False
            acc *= n
        return True

    def get_pattern(self) -> list[list[int]]:
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        d = _norm_dim("slice", dim, self.ndim)
        key = [slice(None)] * self.ndim
        key[d] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index: int | NkiTensor | VirtualRegister) -> NkiTensor:
        """Pick one index along ``dim`` and drop the dim; a tensor/register index is dynamic."""
        d = _norm_dim("select", dim, self.ndim)
        if isinstance(index, (NkiTensor, VirtualRegister)):
            self._static_only("select")
            self._not_partition("select", d)
            shape = self.shape[:d] + self.shape[d + 1:]
            strides = self.strides[:d] + self.strides[d + 1:]
            _check_scalar_index("select", index)
            t = NkiTensor._make(self._st, shape or (1,), strides or (1,), self.offset, self.dtype,
                                self.name, (index, self.strides[d]), None)
            t._check_bounds("select")  # the view at index 0
            return t
        i = int(index)
        n = self.shape[d]
        shape = self.shape[:d] + self.shape[d + 1:]
        strides = self.strides[:d] + self.strides[d + 1:]
        if self._st.buffer.on_chip and d == 0:
            fail("select", "on-chip tensor {name!r}: cannot select away the partition dim",
                 name=self.name)
        t = self._derive(shape or (1,), strides or (1,), self.offset + i * self.strides[d], "select")
        if not 0 <= i < n:
            t._unchecked = f"select index {i} out of bounds for dim {d} of size {n}"
        return t

    def permute(self, dims: Sequence[int]) -> NkiTensor:
        dims = tuple(dims)
        require(sorted(dims) == list(range(self.ndim)), "permute",
                "dims {dims} is not a permutation of range({ndim})", dims=dims, ndim=self.ndim)
        if self._st.buffer.on_chip or self._vec is not None:
            require(dims[0] == 0, "permute", "tensor {name!r}: dims[0] must be 0 (partition dim "
                    "stays outermost), got {dims}", name=self.name, dims=dims)
        return self._derive(tuple(self.shape[d] for d in dims), tuple(self.strides[d] for d in dims),
                            self.offset, "permute")

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        d = _norm_dim("broadcast", dim, self.ndim)
        self._not_partition("broadcast", d)
        require(self.shape[d] == 1, "broadcast", "tensor {name!r}: dim {dim} has size {size}, "
                "only size-1 dims can be broadcast", name=self.name, dim=d, size=self.shape[d])
        return self._derive(self.shape[:d] + (int(size),) + self.shape[d + 1:],
                            self.strides[:d] + (0,) + self.strides[d + 1:], self.offset, "broadcast")

    def expand_dim(self, dim: int) -> NkiTensor:
        d = dim + self.ndim + 1 if dim < 0 else dim
        require(0 <= d <= self.ndim, "expand_dim", "dim {dim} out of range for a {ndim}-D tensor",
                dim=dim, ndim=self.ndim)
        self._not_partition("expand_dim", d)
        return self._derive(self.shape[:d] + (1,) + self.shape[d:],
                            self.strides[:d] + (0,) + self.strides[d:], self.offset, "expand_dim")

    def squeeze_dim(self, dim: int) -> NkiTensor:
        d = _norm_dim("squeeze_dim", dim, self.ndim)
        self._not_partition("squeeze_dim", d)
        require(self.shape[d] == 1, "squeeze_dim", "tensor {name!r}: dim {dim} has size {size}, "
                "not 1", name=self.name, dim=d, size=self.shape[d])
        return self._derive(self.shape[:d] + self.shape[d + 1:], self.strides[:d] + self.strides[d + 1:],
                            self.offset, "squeeze_dim")

    def reshape_dim(self, dim: int, shape: Sequence[int]) -> NkiTensor:
        d = _norm_dim("reshape_dim", dim, self.ndim)
        shape = _infer_shape("reshape_dim", tuple(shape), self.shape[d])
        if len(shape) != 1:
            self._not_partition("reshape_dim", d)
        strides = tuple(s * self.strides[d] for s in _c_strides(shape))
        return self._derive(self.shape[:d] + shape + self.shape[d + 1:],
                            self.strides[:d] + strides + self.strides[d + 1:], self.offset,
                            "reshape_dim")

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        a = _norm_dim("flatten_dims", start_dim, self.ndim)
        b = _norm_dim("flatten_dims", end_dim, self.ndim)
        require(a <= b, "flatten_dims", "start_dim {start} > end_dim {end}", start=a, end=b)
        if self._st.buffer.on_chip:
            require(a > 0, "flatten_dims", "on-chip tensor {name!r}: start_dim must be > 0",
                    name=self.name)
        for k in range(a, b):
            if self.shape[k + 1] != 1 and self.shape[k] != 1 and \
                    self.strides[k] != self.strides[k + 1] * self.shape[k + 1]:
                fail("flatten_dims", "tensor {name!r}: dims {start}..{end} are not contiguous "
                     "(shape {shape}, strides {strides})", name=self.name, start=a, end=b,
                     shape=self.shape, strides=self.strides)
        n = math.prod(self.shape[a:b + 1])
        inner = [s for m, s in zip(self.shape[a:b + 1], self.strides[a:b + 1]) if m != 1]
        stride = inner[-1] if inner else 1
        return self._derive(self.shape[:a] + (n,) + self.shape[b + 1:],
                            self.strides[:a] + (stride,) + self.strides[b + 1:], self.offset,
                            "flatten_dims")

    def reshape(self, shape: Sequence[int] | int, *more: int) -> NkiTensor:
        """A view with a new shape (same element count; on-chip: same partition dim), no copy."""
        if isinstance(shape, int):
            shape = (shape, *more)
        new = _infer_shape("reshape", tuple(int(s) for s in shape), self.size)
        if self._st.buffer.on_chip or self._vec is not None:
            require(new[0] == self.shape[0], "reshape", "tensor {name!r}: shape[0] must stay "
                    "{p} (partition dim), got {shape}", name=self.name, p=self.shape[0], shape=new)
            free = _nocopy_strides(self.shape[1:], self.strides[1:], new[1:])
            if free is None:
                fail("reshape", "tensor {name!r}: layout (shape {shape}, strides {strides}) cannot be "
                     "viewed as {new} without a copy", name=self.name, shape=self.shape,
                     strides=self.strides, new=new)
            strides = (self.strides[0],) + free
        else:
            strides = _nocopy_strides(self.shape, self.strides, new)
            if strides is None:
                fail("reshape", "tensor {name!r}: layout (shape {shape}, strides {strides}) cannot be "
                     "viewed as {new} without a copy", name=self.name, shape=self.shape,
                     strides=self.strides, new=new)
        return self._derive(new, strides, self.offset, "reshape")

    def rearrange(self, src_pattern: tuple, dst_pattern: tuple,
                  fixed_sizes: dict[str, int] | None = None) -> NkiTensor:
        """einops-style split / reorder / merge of dims, e.g. ``(('b', ('h', 'w')), ('b', 'w', 'h'))``."""
        fixed = dict(fixed_sizes or {})
        require(len(src_pattern) == self.ndim, "rearrange", "src_pattern {pattern} has {n} entries "
                "for a {ndim}-D tensor", pattern=src_pattern, n=len(src_pattern), ndim=self.ndim)
        t = self
        names: list[str] = []
        dim = 0
        for entry in src_pattern:
            if isinstance(entry, tuple):
                known = math.prod(fixed[e] for e in entry if e in fixed)
                sizes = [fixed.get(e, -1) for e in entry]
                if sizes.count(-1) == 1:
                    sizes[sizes.index(-1)] = t.shape[dim] // max(known, 1)
                t = t.reshape_dim(dim, tuple(sizes))
                for e, s in zip(entry, t.shape[dim:dim + len(entry)]):
                    fixed[e] = s
                names.extend(entry)
                dim += len(entry)
            else:
                fixed[entry] = t.shape[dim]
                names.append(entry)
                dim += 1
        flat_dst = [e for entry in dst_pattern for e in (entry if isinstance(entry, tuple) else (entry,))]
        require(sorted(flat_dst) == sorted(names), "rearrange", "dst_pattern {dst} must use the "
                "names of src_pattern {src}", dst=dst_pattern, src=src_pattern)
        t = t.permute(tuple(names.index(e) for e in flat_dst))
        dim = 0
        for entry in dst_pattern:
            if isinstance(entry, tuple):
                if len(entry) > 1:
                    t = t.flatten_dims(dim, dim + len(entry) - 1)
            dim += 1
        return t

    def view(self, dtype: Any) -> NkiTensor:
        """Reinterpret the bytes as ``dtype``; the last dim is scaled by the itemsize ratio."""
        self._static_only("view")
        dt = _dt.resolve(dtype, "view")
        old, new = self.dtype.itemsize, dt.itemsize
        if old == new:
            return self._derive(self.shape, self.strides, self.offset, "view", dt)
        last_n, last_s = self.shape[-1], self.strides[-1]
        require(last_s == 1 or last_n == 1, "view", "tensor {name!r}: the last dim must be contiguous "
                "to reinterpret as {dtype} (stride {stride})", name=self.name, dtype=dt.name,
                stride=last_s)
        nbytes = last_n * old
        require(nbytes % new == 0, "view", "tensor {name!r}: last dim of {n} x {old} bytes is not "
                "divisible into {dtype} ({new} bytes)", name=self.name, n=last_n, old=old,
                dtype=dt.name, new=new)
        strides = []
        for s in self.strides[:-1]:
            require((s * old) % new == 0, "view", "tensor {name!r}: stride {stride} x {old} bytes is "
                    "not a multiple of {new}", name=self.name, stride=s, old=old, new=new)
            strides.append(s * old // new)
        require((self.offset * old) % new == 0, "view", "tensor {name!r}: offset {offset} is not "
                "aligned to {dtype}", name=self.name, offset=self.offset, dtype=dt.name)
        return self._derive(self.shape[:-1] + (nbytes // new,), tuple(strides) + (1,),
                            self.offset * old // new, "view", dt)

    reinterpret_cast = view

    def ap(self, pattern: Sequence[Sequence[int]], offset: int | None = None,
           scalar_offset: NkiTensor | VirtualRegister | int | None = None,
           vector_offset: NkiTensor | None = None, indirect_dim: int = 0,
           dtype: Any = None) -> NkiTensor:
        """Access pattern over the allocation's flat storage (``nki/deep-dives/nki-aps.rst``).

        ``pattern = [[step, num], ...]`` (outermost first) gives the view's shape (the nums) and
        strides (the steps); ``offset`` is the start element from the beginning of the storage
        (None: this view's offset). The view this is called on is otherwise ignored. On SBUF/PSUM
        the first pair addresses partitions and its step must equal the storage's free-element
        count. ``scalar_offset`` (1x1 SBUF int tensor, VirtualRegister or int) adds
        ``value * prod(self.shape[indirect_dim+1:])``; ``vector_offset`` (``[P,1]`` SBUF int tensor,
        HBM tensors only, ``indirect_dim=0``) makes partition ``p`` start at element
        ``vector_offset[p] * prod(self.shape[1:])`` (the first pair's step is then ignored, as on
        hardware). Both strides come from the shape of the tensor ``.ap`` is called on (a reshaped
        view's rows, not the allocation's), as ``nki-aps.rst`` defines them.
        """
        op = "ap"
        st = self._st
        dt = self.dtype if dtype is None else _dt.resolve(dtype, op)
        pairs = [tuple(p) for p in pattern]
        require(len(pairs) >= 1 and all(len(p) == 2 for p in pairs), op,
                "pattern must be a non-empty list of [step, num] pairs, got {pattern}", pattern=pattern)
        shape = tuple(int(n) for _, n in pairs)
        strides = tuple(int(s) for s, _ in pairs)
        if offset is None:
            off = self.offset * self.dtype.itemsize
            require(off % dt.itemsize == 0, op, "offset of tensor {name!r} not aligned to {dtype}",
                    name=self.name, dtype=dt.name)
            off //= dt.itemsize
        else:
            off = int(offset)
        ratio_num, ratio_den = self.dtype.itemsize, dt.itemsize  # base elements -> dt elements
        if st.buffer.on_chip:
            ps = st.free_bytes // dt.itemsize
            require(shape[0] <= 128, op, "partition count {num} exceeds pmax (128) for tensor {name!r}",
                    num=shape[0], name=self.name)
            view_free = self._row_window()
            if (strides[0] != ps and shape[0] > 1 and view_free is not None and strides[0] == view_free
                    and dt == self.dtype and scalar_offset is None and vector_offset is None):
                off = self._view_relative_offset(op, shape, strides, offset, view_free, ps)
            else:
                # nki-aps.rst "Restriction on SBUF/PSUM Tensors": "the access on the partition
                # dimension must be continuous, meaning that the step of the leading dimension must
                # be the element count of the entire free dimension of the tensor"
                require(strides[0] == ps or shape[0] == 1, op, "on-chip tensor {name!r}: the first "
                        "pattern pair's step must equal the free-element count of the storage ({pstride}) "
                        "or of the view .ap is called on ({view}), got {step} (nki-aps.rst: the access on "
                        "the partition dimension must be continuous)",
                        name=self.name, pstride=ps, view=view_free, step=strides[0])
            strides = (ps,) + strides[1:]
        require(scalar_offset is None or vector_offset is None, op,
                "scalar_offset and vector_offset are mutually exclusive")
        # "the dimension is relative to the base tensor": the tensor .ap is called on (its shape,
        # not the allocation's), nki-aps.rst "prod(A.shape[indirect_dim+1:])"
        base_shape = self.shape
        dyn = vec = None
        if scalar_offset is not None:
            d = _norm_dim(op, indirect_dim, len(base_shape))
            if st.buffer.on_chip:
                require(d != 0, op, "on-chip tensor {name!r}: a dynamic offset cannot be on the "
                        "partition dim (indirect_dim=0)", name=self.name)
            mult = math.prod(base_shape[d + 1:]) * ratio_num
            require(mult % ratio_den == 0, op, "scalar_offset stride not aligned to {dtype}",
                    dtype=dt.name)
            mult //= ratio_den
            if isinstance(scalar_offset, (NkiTensor, VirtualRegister)):
                _check_scalar_index(op, scalar_offset)
                dyn = (scalar_offset, mult)
            else:
                off += int(scalar_offset) * mult
        if vector_offset is not None:
            require(not st.buffer.on_chip, op, "vector_offset needs an HBM tensor, {name!r} is in "
                    "{buffer}", name=self.name, buffer=st.buffer.name)
            require(indirect_dim == 0, op, "vector_offset supports only indirect_dim=0, got "
                    "{indirect_dim}", indirect_dim=indirect_dim)
            require(isinstance(vector_offset, NkiTensor), op, "vector_offset must be an SBUF "
                    "tensor, got {type}", type=type(vector_offset).__name__)
            require(vector_offset.buffer is sbuf, op, "vector_offset must be in SBUF, got {buffer}",
                    buffer=vector_offset.buffer.name)
            require(_dt.is_int(vector_offset.dtype), op, "vector_offset must be an integer tensor, "
                    "got {dtype}", dtype=vector_offset.dtype)
            require(vector_offset.size == vector_offset.shape[0], op, "vector_offset must be [P, 1], "
                    "got shape {shape}", shape=vector_offset.shape)
            require(vector_offset.shape[0] == shape[0], op, "vector_offset has {n} partitions, the "
                    "pattern's first pair has {num}", n=vector_offset.shape[0], num=shape[0])
            rows = math.prod(base_shape[1:]) * ratio_num
            require(rows % ratio_den == 0, op, "row stride not aligned to {dtype}", dtype=dt.name)
            vec = (vector_offset, rows // ratio_den)
        t = NkiTensor._make(st, shape, strides, off, dt, self.name, dyn, vec)
        if vec is None:
            t._unchecked = ""  # checked when accessed (an out-of-range .ap may sit under a guard)
        else:
            for n in shape:
                require(n > 0, op, "empty dimension in pattern {pattern}", pattern=pattern)
        return t

    def _row_window(self) -> int | None:
        """Free-element count of this on-chip view when it is a window of whole partitions whose
        free elements are contiguous within each partition (a column range of the allocation, e.g.
        a ``.ap`` or slice of some of its columns); None otherwise."""
        if len(self.shape) < 2 or self.strides[0] != self._st.free_bytes // self.dtype.itemsize:
            return None
        expect = 1
        for n, s in zip(reversed(self.shape[1:]), reversed(self.strides[1:])):
            if n > 1 and s != expect:
                return None
            expect *= n
        return expect

    def _view_relative_offset(self, op: str, shape: tuple[int, ...], strides: tuple[int, ...],
                              offset: int | None, view_free: int, ps: int) -> int:
        """Storage offset of a pattern laid over this view as a ``[P, view_free]`` tensor.

        nki-aps.rst defines the pattern over "the tensor" ``.ap`` is called on: its first step is
        "the number of elements in the free dimension of the tensor" and ``offset`` counts "from
        the beginning of the tensor". The same page says ``.ap`` "cannot be called on a tile
        produced by it", but AWS's tested nki-library kernels do exactly that on a column range of
        an SBUF tile (core/mlp/mlp_tkg gate/up projection: ``TensorView(tile_view).slice(...)``,
        whose ``.ap`` steps by the view's own row), so such a view is accepted as a tensor of its
        own: partition ``w`` is the view's row ``w``, free offsets count from the view's first
        column and must stay inside the view's row (the hardware pattern is per partition)."""
        rel = 0 if offset is None else int(offset)
        row, col = divmod(rel, view_free)
        reach = col + sum((n - 1) * s for n, s in zip(shape[1:], strides[1:]))
        require(rel >= 0 and min(strides[1:], default=0) >= 0 and reach < view_free, op,
                "tensor {name!r}: a pattern laid over a view of {view} free elements per partition must "
                "stay inside the view's row; offset {offset} with free pattern {free} reaches element "
                "{reach}", name=self.name, view=view_free, offset=rel,
                free=[[s, n] for s, n in zip(strides[1:], shape[1:])], reach=reach)
        require(row + shape[0] <= self.shape[0], op, "tensor {name!r}: partitions [{lo}, {hi}) of a view "
                "with {p} partitions", name=self.name, lo=row, hi=row + shape[0], p=self.shape[0])
        return self.offset + row * ps + col

    def vector_select(self, dim: int, vector_offset: NkiTensor) -> NkiTensor:
        """Per-partition row gather/scatter view: partition ``p`` uses row ``vector_offset[p]``."""
        require(dim == 0, "vector_select", "dim must be 0, got {dim}", dim=dim)
        self._static_only("vector_select")
        pattern = [[self.strides[0], vector_offset.shape[0]]] + self.get_pattern()[1:]
        t = self.ap(pattern, offset=self.offset, vector_offset=vector_offset, indirect_dim=0)
        t._vec = (vector_offset, self.strides[0])  # row p of this view (a sliced view keeps its step)
        return t

    def indirect(self, index: NkiTensor, num_elem: int | None = None) -> NkiTensor:
        fail("indirect", "tensor indirection (.indirect) needs NeuronCore-v4 (trn3); the "
             "interpreter targets trn2")

    # -- indirect (vector_offset) support for dma_copy -----------------------------------------
    @property
    def indirect_info(self) -> tuple[NkiTensor, int] | None:
        """``(index tensor [P,1], row stride)`` for vector_offset views, else None."""
        return self._vec

    def _indirect_rows_valid(self, op: str, skip_oob: bool, flat_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``(row index per partition [P] int64, valid [P])`` of a vector_offset view; raises for
        out-of-bounds rows unless ``skip_oob`` (shared by :meth:`indirect_plan` / :meth:`indirect_rows`)."""
        idx_t, row = self._vec
        rows = idx_t.np().reshape(-1).astype(np.int64)
        lo = hi = self.offset  # extent of one row's free pattern (elements)
        for n, s in zip(self.shape[1:], self.strides[1:]):
            if s > 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        starts = rows * row
        valid = (starts + lo >= 0) & (starts + hi < flat_size)
        if not skip_oob and not valid.all():
            bad = int(np.flatnonzero(~valid)[0])
            n_rows = flat_size // row if row else 0  # rows of the tensor .ap was called on
            fail(op, "indirect index {index} (partition {p}) out of bounds for {bound} rows of tensor "
                 "{name!r} (oob_mode=error)", index=int(rows[bad]), p=bad, bound=n_rows, name=self.name)
        return rows, valid

    def _flat_access(self) -> np.ndarray:
        """The whole storage as a flat array of this view's dtype, recorded as an access."""
        if self._st.alloc is not None:
            self._st.alloc.touch()
        else:
            _memory.current().memory.pin()
        return self._st.flat(self.dtype)

    def indirect_rows(self, op: str, skip_oob: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """For a vector_offset view: ``(table, local rows [P], valid [P])`` with ``table[local[p]]``
        the ``shape[1:]`` elements partition ``p`` addresses (a strided view of the storage, one
        table row per base-tensor row between the lowest and highest valid index). The same
        elements as :meth:`indirect_plan`, moved row by row instead of through an address array
        (~5x faster for a [128, 256] gather). None when a free stride is negative (then use
        :meth:`indirect_plan`)."""
        if any(s < 0 for s in self.strides[1:]):
            return None
        flat = self._flat_access()
        rows, valid = self._indirect_rows_valid(op, skip_oob, flat.size)
        _, row = self._vec
        isz = self.dtype.itemsize
        used = rows[valid]
        r0, n = (int(used.min()), int(used.max() - used.min()) + 1) if used.size else (0, 0)
        base = self.offset + r0 * row if n else 0  # in bounds: row r0 is a valid row
        table = np.ndarray((n,) + self.shape[1:], self.dtype, buffer=flat, offset=base * isz,
                           strides=(row * isz,) + tuple(s * isz for s in self.strides[1:]))
        return table, rows - r0, valid

    def indirect_plan(self, op: str, skip_oob: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a vector_offset view: ``(flat, addresses [shape], valid rows [P])``.

        ``addresses[p, ...]`` are flat element indices into ``flat``; rows whose index falls outside
        the base tensor's rows raise (``oob_mode.error``) or are marked invalid (``oob_mode.skip``).
        """
        _, row = self._vec
        flat = self._flat_access()
        rows, valid = self._indirect_rows_valid(op, skip_oob, flat.size)
        free = np.zeros((), dtype=np.int64)
        for n, s in zip(self.shape[1:], self.strides[1:]):
            free = np.add.outer(free, np.arange(n, dtype=np.int64) * s)
        addr = (rows * row).reshape((-1,) + (1,) * (len(self.shape) - 1)) + (free + self.offset)
        return flat, addr, valid


def _check_scalar_index(op: str, idx: NkiTensor | VirtualRegister) -> None:
    if isinstance(idx, VirtualRegister):
        return
    require(idx.buffer is sbuf, op, "a dynamic scalar index must be a 1x1 SBUF tensor, got buffer "
            "{buffer}", buffer=idx.buffer.name)
    require(idx.size == 1, op, "a dynamic scalar index must be a 1x1 SBUF tensor, got shape {shape}",
            shape=idx.shape)
    require(_dt.is_int(idx.dtype), op, "a dynamic scalar index must have an integer dtype, got "
            "{dtype}", dtype=idx.dtype)


def _infer_shape(op: str, shape: tuple[int, ...], total: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        fail(op, "at most one -1 in shape {shape}", shape=shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        require(known > 0 and total % known == 0, op, "cannot infer -1 in {shape} for {total} "
                "elements", shape=shape, total=total)
        shape = tuple(total // known if s == -1 else s for s in shape)
    require(math.prod(shape) == total and all(s > 0 for s in shape), op,
            "shape {shape} has {n} elements, the tensor has {total}", shape=shape,
            n=math.prod(shape), total=total)
    return shape


def _nocopy_strides(shape: Sequence[int], strides: Sequence[int],
                    new: Sequence[int]) -> tuple[int, ...] | None:
    """Strides viewing (shape, strides) as ``new`` without a copy, or None (numpy's own rule)."""
    probe = np.lib.stride_tricks.as_strided(np.empty(1, np.int8), tuple(shape), tuple(strides))
    try:
        probe.shape = tuple(new)  # numpy refuses exactly when a copy would be needed
    except AttributeError:
        return None
    return tuple(int(s) for s in probe.strides)


# -- allocation ----------------------------------------------------------------------------------
def _checked_shape(op: str, shape: Sequence[int], name: str) -> tuple[int, ...]:
    shape = tuple(shape)
    if not shape:
        fail(op, "tensor {name!r}: shape must have at least one dim, got {shape}", name=name,
             shape=shape)
    for s in shape:
        is_int = type(s) is int or (isinstance(s, (int, np.integer)) and not isinstance(s, bool))
        if not is_int or s <= 0:
            fail(op, "tensor {name!r}: shape {shape} must be positive ints", name=name, shape=shape)
    return tuple(int(s) for s in shape)


def allocate(shape: Sequence[int], dtype: np.dtype, buffer: MemoryRegion, name: str = "",
             fill: Any = None) -> NkiTensor:
    """A fresh allocation (sentinel-filled unless ``fill`` is given), accounted in the current kernel."""
    op = "nl.ndarray"
    if not name:
        name = f"{buffer.name}_{next(_names)}"
    shape = _checked_shape(op, shape, name)
    size = math.prod(shape)
    ctx = _memory.current()
    if buffer is shared_hbm and ctx.launch.num_instances > 1:
        return _shared_allocation(ctx, shape, dtype, name, fill)
    data = _filled(size, dtype, _dt.sentinel(dtype) if fill is None else fill)
    st = Storage(data, shape, buffer, name)
    if buffer.on_chip:
        if shape[0] > _memory.NUM_PARTITIONS:
            fail(op, "tensor {name!r}: partition dim {p} exceeds pmax ({pmax})", name=name,
                 p=shape[0], pmax=_memory.NUM_PARTITIONS)
        st.alloc = ctx.memory.allocate(buffer.name, st.free_bytes, name)
    return NkiTensor._make(st, shape, _c_strides(shape), 0, dtype, name)


# -- manual placement (nl.ndarray(..., address=(partition, byte))) ---------------------------------
# Sources (NKI docs, aws-neuron-sdk 81ce03ae):
# * nki/get-started/about/data-representation-overview.rst: "for SBUF and PSUM tensors there are two offsets
#   and two sizes because those memories are two-dimensional. The two offsets and sizes describe a rectangle in
#   the underlying memory within which the tensor data will live ... the second offset and size could be, for
#   instance, 1024 and 128, indicating that each matrix row start 1024 bytes from the beginning of each
#   partition, and consumes 128 bytes (2 bytes for each 16-bit float), within each partition."
# * nki/migration/index.rst, "Improved allocation API": "``address`` argument to ``nl.ndarray`` that allows the
#   offset of each tensor to be specified: ``(partition_offset, free_offset)`` ... the partition offset
#   corresponds to a physical partition lane on the hardware". The same paragraph calls the free offset "the
#   element offset within each partition", but its own examples (``sca + (i % n) * n_k * 2`` for bf16 tiles,
#   ``bank_id * PSUM_BANK_SIZE``) and every tested nki-library kernel (core/utils/modular_allocator.py,
#   allocator.py ``SbufManager``: addresses advance by ``tile_size_bytes``) count bytes, as the data
#   representation page does: the tested kernels win, the free offset is a byte offset.
# * nki.language.tile_size: ``sbuf_min_align`` is the "Minimum byte alignment requirement for SBUF free dimension
#   address" (2 bytes, language.py), but a tested nki-library kernel places SBUF tiles at odd bytes (core/qkv/
#   qkv_cte.py with fp8 static quantization: ``SbufManager.alloc_stack`` without ``align`` puts a [128, 1] fp8
#   tile at byte 0 and the next at byte 1): the tested kernel wins, any non-negative byte offset is accepted.
# A placed tile's bytes are the rectangle [partition, partition + P) x [byte, byte + F) of its kernel instance's
# SBUF (F: the tile's free bytes); every tile placed on overlapping bytes sees the same bytes, reinterpreted with
# its own dtype. Each kernel instance (each program of an LNC=2 or grid launch) has its own SBUF.
class PlacementSpace:
    """The bytes of one kernel instance's SBUF that manually placed tiles live in: ``data[p, b]`` is byte ``b``
    of partition ``p``. Grown on demand to the widest placement so far (a kernel placing a few KiB per
    partition holds a few KiB x 128, not 224 KiB x 128); growing copies the bytes into a wider array, so
    arrays of placed tiles are built per access (:attr:`PlacedStorage.stable` is False). ``claimed`` marks the
    bytes some placed tile has covered: bytes never covered get the first covering tile's dtype sentinel (NaN
    for floats, 4 for ints, as any fresh allocation), bytes already covered keep what they hold (a device's
    SBUF keeps its bytes; a new tile on an old slot reads the old tile's data until something writes it)."""

    _STEP = 4096  # width granularity in bytes

    def __init__(self, buffer: MemoryRegion, row_bytes: int) -> None:
        self.buffer = buffer
        self.key = ("placed", buffer.name, next(_STORAGE_KEYS))  # its storage key in trace slot boxes
        self.row_bytes = row_bytes  # the physical partition size: no placement reaches past it
        self.data = np.empty((_memory.NUM_PARTITIONS, 0), np.uint8)
        self.claimed = np.zeros((_memory.NUM_PARTITIONS, 0), np.bool_)
        # the tiles whose last write is still what their bytes hold, by rectangle (p0, p1, byte0, byte1):
        # a write to overlapping bytes by another tile takes them from it (:meth:`written`)
        self.holders: dict[tuple[int, int, int, int], list[PlacedStorage]] = {}

    def written(self, st: PlacedStorage, instr: str) -> None:
        """``instr`` wrote tile ``st``: every other placed tile on overlapping bytes no longer holds its own data
        (a later read of it is reported by :func:`memory.instruction`), and ``st`` holds its bytes again."""
        p0, p1, b0, b1 = rect = st.rect
        for r in [r for r in self.holders if r[0] < p1 and p0 < r[1] and r[2] < b1 and b0 < r[3]]:
            tiles = self.holders[r]
            for other in tiles:
                if other is not st:
                    other.overwritten = (st.name, instr)
            if st in tiles:
                self.holders[r] = [st]
            else:
                del self.holders[r]
        st.overwritten = None
        self.holders.setdefault(rect, [st])

    def claim(self, p0: int, nparts: int, byte0: int, nbytes: int, dtype: np.dtype) -> None:
        stop = byte0 + nbytes
        width = self.data.shape[1]
        if stop > width:
            new = min(self.row_bytes, -(-max(stop, 2 * width) // self._STEP) * self._STEP)
            data = np.empty((_memory.NUM_PARTITIONS, new), np.uint8)
            data[:, :width] = self.data
            claimed = np.zeros((_memory.NUM_PARTITIONS, new), np.bool_)
            claimed[:, :width] = self.claimed
            self.data, self.claimed = data, claimed
        done = self.claimed[p0:p0 + nparts, byte0:stop]
        if done.all():
            return
        fill = _filled(nparts * (nbytes // dtype.itemsize), dtype, _dt.sentinel(dtype))
        np.copyto(self.data[p0:p0 + nparts, byte0:stop], fill.view(np.uint8).reshape(nparts, nbytes),
                  where=~done)
        done[...] = True


class PlacedStorage(Storage):
    """The storage of a placed tile: the rectangle ``[base_partition, +P) x [byte0, +free_bytes)`` of a
    :class:`PlacementSpace`. Views address it in the tile's own terms (partition stride = its free elements,
    as for any allocation); :meth:`array` maps them onto the space's rows."""

    __slots__ = ("space", "base_partition", "byte0", "rect", "overwritten")
    stable = False

    def __init__(self, space: PlacementSpace, p0: int, byte0: int, shape: tuple[int, ...], dtype: np.dtype,
                 name: str) -> None:  # (no Storage.__init__: the bytes are the space's)
        self.space = space
        self.base_partition = p0
        self.byte0 = byte0
        self.dtype = dtype
        self.shape = shape
        self.buffer = space.buffer
        self.name = name
        self.free_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * dtype.itemsize
        self.mm = None
        self._flats = {}
        self.key = next(_STORAGE_KEYS)
        self.alloc = None
        self.rect = (p0, p0 + shape[0], byte0, byte0 + self.free_bytes)
        # (tile, instruction) of the last write by another tile over these bytes since this tile's own last
        # write (PlacementSpace.written); None while the bytes hold this tile's data, or once a read reported it
        self.overwritten: tuple[str, str] | None = None

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def data(self) -> np.ndarray:  # type: ignore[override]  (the tile's rows as one byte range)
        row = self.space.data.shape[1]
        start = self.base_partition * row + self.byte0
        return self.space.data.reshape(-1)[start:start + (self.shape[0] - 1) * row + self.free_bytes]

    def flat(self, dtype: np.dtype) -> np.ndarray:
        fail("nl.ndarray", "placed tile {name!r}: its partitions are not one flat range of the space; read it "
             "through a view", name=self.name)

    def array(self, shape: tuple[int, ...], dtype: np.dtype, offset: int, strides: tuple[int, ...]) -> np.ndarray:
        isz = dtype.itemsize
        p, col = divmod(offset, self.free_bytes // isz)  # views stay inside their partitions (bounds checks)
        mem = self.space.data
        row = mem.shape[1]
        return np.ndarray(shape, dtype, buffer=mem, offset=(self.base_partition + p) * row + self.byte0 + col * isz,
                          strides=(row,) + tuple(s * isz for s in strides[1:]))


def place(shape: Sequence[int], dtype: np.dtype, buffer: MemoryRegion, name: str, address: Any) -> NkiTensor:
    """``nl.ndarray(shape, dtype, buffer=nl.sbuf | nl.psum, address=(partition, byte))``: a tile on fixed SBUF /
    PSUM bytes of the current kernel instance (see the sources above). Not initialised: it reads what those
    bytes hold."""
    op = "nl.ndarray"
    if not name:
        name = f"{buffer.name}_{next(_names)}"
    shape = _checked_shape(op, shape, name)
    ok = isinstance(address, (tuple, list)) and len(address) == 2 and all(
        isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in address)
    if not ok:
        fail(op, "tensor {name!r}: address must be a (partition_offset, free_offset) pair of ints, got "
             "{address!r} (nki.language.ndarray: \"address - optional memory address (partition_offset, "
             "free_offset)\")", name=name, address=address)
    p0, byte0 = int(address[0]), int(address[1])
    nparts = shape[0]
    nbytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * dtype.itemsize
    doc = "migration guide, Improved allocation API: the partition offset is a physical partition lane"
    what = buffer.name.upper()
    if p0 < 0 or p0 + nparts > _memory.NUM_PARTITIONS:
        fail(op, "tensor {name!r} placed at address=({p0}, {byte0}) spans partitions [{p0}, {stop}); {what} has "
             "partitions [0, {pmax}) ({doc})", name=name, p0=p0, byte0=byte0, stop=p0 + nparts, what=what,
             pmax=_memory.NUM_PARTITIONS, doc=doc)
    if buffer is psum:
        cap, bank = _memory.PSUM_PARTITION_BYTES, _memory.PSUM_BANK_BYTES
        if byte0 < 0 or byte0 % bank:
            fail(op, "PSUM tensor {name!r} placed at address=({p0}, {byte0}): the free offset must be a bank "
                 "boundary, a multiple of {bank} bytes (migration guide, Improved allocation API: \"The "
                 "allocation for PSUM tensors must start at the beginning of each bank\")", name=name, p0=p0,
                 byte0=byte0, bank=bank)
        size_doc = ("migration guide, Improved allocation API: \"PSUM ... is organized into 128 partitions, each "
                    "consisting of 16KB of memory ... 8 PSUM banks, with each bank holding up to 2KB\"")
    else:
        cap = _memory.SBUF_PARTITION_BYTES
        if byte0 < 0:
            fail(op, "tensor {name!r} placed at address=({p0}, {byte0}): the free offset must be >= 0 (bytes "
                 "from the beginning of each partition, data-representation-overview.rst)", name=name, p0=p0,
                 byte0=byte0)
        size_doc = ("trainium2_arch.rst: \"NeuronCore-v3 SBUF capacity is 28MiB (or, 128 partitions of "
                    "224KiB)\"; data-representation-overview.rst: the free offset counts bytes from the "
                    "beginning of each partition")
    if byte0 + nbytes > cap:
        fail(op, "tensor {name!r} placed at address=({p0}, {byte0}) needs bytes [{byte0}, {stop}) of each "
             "partition; {what} has {cap} bytes per partition ({doc})", name=name, p0=p0, byte0=byte0,
             stop=byte0 + nbytes, what=what, cap=cap, doc=size_doc)
    ctx = _memory.current()
    space = ctx.placed.get(buffer.name)
    if space is None:
        space = ctx.placed[buffer.name] = PlacementSpace(buffer, cap)
    space.claim(p0, nparts, byte0, nbytes, dtype)
    st = PlacedStorage(space, p0, byte0, shape, dtype, name)
    st.alloc = ctx.memory.place(buffer.name, p0, nparts, byte0, nbytes, name)
    return NkiTensor._make(st, shape, _c_strides(shape), 0, dtype, name)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


_BITS_FILL: dict[np.dtype, bool] = {}


def _filled(size: int, dtype: np.dtype, value: Any) -> np.ndarray:
    """``np.full(size, value, dtype)``; ml_dtypes fills go through the same-size uint bit pattern
    (``np.full`` on bfloat16 is ~15x slower than filling its bits)."""
    data = np.empty(size, dtype=dtype)
    bits_fill = _BITS_FILL.get(dtype)
    if bits_fill is None:
        bits_fill = _BITS_FILL[dtype] = (dtype.kind == "V"
                                         or dtype.type.__module__.startswith("ml_dtypes"))
    if bits_fill:
        bits = np.asarray(value, dtype=dtype).view(_UINT[dtype.itemsize])
        data.view(_UINT[dtype.itemsize]).fill(bits)
    else:
        data.fill(value)
    return data


def _shared_allocation(ctx: Any, shape: tuple[int, ...], dtype: np.dtype, name: str,
                       fill: Any) -> NkiTensor:
    """The k-th shared_hbm allocation of every program of a launch is the same storage. The launch
    lets go of it once every program has it (it then lives as long as their tensors do: a kernel that
    allocates a shared buffer per block in a loop does not keep every block's buffer to the end)."""
    launch = ctx.launch
    k = ctx.shared_count
    ctx.shared_count += 1
    with launch.lock:
        if k == len(launch.shared):
            data = _filled(math.prod(shape), dtype, _dt.sentinel(dtype) if fill is None else fill)
            launch.shared.append(Storage(data, shape, shared_hbm, name))
            launch.shared_fetches.append(0)
        st = launch.shared[k]
        launch.shared_fetches[k] += 1
        if launch.shared_fetches[k] == launch.num_instances:
            launch.shared[k] = None
    require(st.shape == shape and st.dtype == dtype, "nl.ndarray", "shared_hbm allocation #{k} differs "
            "between programs: {shape}/{dtype} vs {other_shape}/{other_dtype}", k=k, shape=shape,
            dtype=dtype, other_shape=st.shape, other_dtype=st.dtype)
    return NkiTensor._make(st, shape, _c_strides(shape), 0, dtype, st.name)


def from_array(arr: np.ndarray, buffer: MemoryRegion = hbm, name: str = "") -> NkiTensor:
    """Wrap a C-contiguous numpy array (no copy) as a tensor in ``buffer`` (HBM kernel arguments)."""
    require(arr.flags.c_contiguous, "from_array", "array for {name!r} must be C-contiguous",
            name=name)
    dt = _dt.resolve(arr.dtype, f"kernel argument {name!r}")
    shape = arr.shape if arr.ndim else (1,)
    st = Storage(arr.reshape(-1), tuple(shape), buffer, name or f"{buffer.name}_{next(_names)}")
    return NkiTensor._make(st, tuple(shape), _c_strides(shape), 0, dt, st.name)
