"""``nki.language`` of the interpreter: dtypes, buffers, allocation, tile sizes, loops, SPMD ids.

Names and semantics follow the NKI 0.6 API reference (``nki/api/nki/language/__init__.py`` in
aws-neuron-sdk). The ALU/activation function objects (``nl.add``, ``nl.exp``, ...) come from
:mod:`trnkit.nkisim.ops` and are re-exported here.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from . import controlflow as _cf
from . import dtypes as _dt
from . import memory as _mem
from .api_names import fill_missing
from .dtypes import (  # noqa: F401  (re-exported dtypes)
    bfloat16,
    bool_,
    float8_e4m3,
    float8_e4m3fn,
    float8_e5m2,
    float8_e8m0fnu,
    float4_e2m1fn_x4,
    float8_e4m3fn_x4,
    float8_e5m2_x4,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .errors import fail, require

from .tensor import (  # noqa: F401  (re-exported)
    BUFFERS,
    MemoryRegion,
    NkiTensor,
    VirtualRegister,
    allocate,
    hbm,
    place,
    private_hbm,
    psum,
    sbuf,
    shared_hbm,
)

from . import ops as _ops

bool = bool_  # noqa: A001  (nl.bool, as AWS kernels spell it: nki-library core/utils/kernel_helpers.py)

globals().update(_ops.ALL_OPS)  # the ALU / activation function objects (nl.add, nl.exp, ...)

# Experimental convenience wrappers (NKI 0.3+), lowered to nisa instructions; importing the module
# also routes nl.<op>(tile, ...) calls to it. These names shadow Python's sum/max/min here.
from .convenience import (  # noqa: E402, F401  (re-exported)
    broadcast_to,
    expand_dims,
    load,
    matmul,
    max,
    mean,
    min,
    prod,
    shared_constant,
    shared_identity_matrix,
    softmax,
    store,
    sum,
    transpose,
)


class NKIObject:
    """``nl.NKIObject``: base class of kernel dataclasses and configuration objects.

    ``__init__(**kwargs)`` (the documented signature) sets each keyword as an attribute, so a subclass
    that only declares annotated fields is built as ``Configs(compute_dtype=nl.bfloat16, ...)``
    (nki-library core/moe/moe_cte/moe_cte_utils.py ``Configs``); class-level defaults stay visible
    for fields not passed. A subclass may define its own ``__init__``. A ``@dataclass`` subclass keeps
    this constructor too (dataclasses never replace an ``__init__`` the class already has, and
    :meth:`__init_subclass__` gives it one), as AWS's tested kernels need: they build dataclass
    configs without a field that has no default and pass un-annotated attributes as keywords
    (mlp_tkg, moe_tkg, moe_block_tkg, attention_cte). Positional arguments fill the dataclass fields in
    order, fields not passed get their default or ``default_factory()``, ``__post_init__`` runs, and
    a field with no default that was not passed stays unset (reading it raises ``AttributeError``).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inherited = next(k for k in cls.__mro__[1:] if "__init__" in k.__dict__)
        if "__init__" not in cls.__dict__ and inherited.__dict__["__init__"] is _nki_object_init:
            cls.__init__ = _nki_object_init  # (before @dataclass runs, which then keeps it)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _nki_object_init(self, *args, **kwargs)


def _nki_object_init(self: Any, *args: Any, **kwargs: Any) -> None:
    fields = {f.name: f for f in dataclasses.fields(self)} if dataclasses.is_dataclass(self) else None
    if fields is None:
        if args:
            raise TypeError(f"{type(self).__name__}() takes keyword arguments only (nl.NKIObject)")
    else:
        names = [n for n, f in fields.items() if f.init]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes at most {len(names)} positional arguments "
                            f"({len(args)} given)")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"{type(self).__name__}() got multiple values for argument {name!r}")
            kwargs[name] = value
        for name, f in fields.items():
            if name in kwargs:
                continue
            if f.default_factory is not dataclasses.MISSING:
                kwargs[name] = f.default_factory()
            elif f.default is not dataclasses.MISSING:
                kwargs[name] = f.default
    for key, value in kwargs.items():
        object.__setattr__(self, key, value)  # (frozen dataclasses too)
    post_init = getattr(self, "__post_init__", None)
    if fields is not None and post_init is not None:
        post_init()


NKIObject.__init__ = _nki_object_init  # the marker __init_subclass__ looks for


class _TileSize:
    """``nl.tile_size``: hardware tile limits (``nki/get-started/about/tiling-overview.rst``)."""

    pmax = 128  # partitions of any SBUF/PSUM tile
    psum_bank_fmax = 512  # fp32 elements per partition of one PSUM bank
    psum_fmax = 512  # deprecated name of psum_bank_fmax (NKI 0.4.0)
    psum_bank_fmax_bytes = _mem.PSUM_BANK_BYTES
    gemm_stationary_fmax = 128  # free size of nc_matmul's stationary operand
    gemm_moving_fmax = 512  # free size of nc_matmul's moving operand
    bn_stats_fmax = 512
    psum_min_align = 4  # bytes (fp32 PSUM words)
    sbuf_min_align = 2  # bytes
    psum_num_banks = _mem.PSUM_BANKS
    total_available_sbuf_size = _mem.SBUF_USABLE_BYTES  # bytes per partition (deprecated name)
    sbuf_fmax_bytes = _mem.SBUF_USABLE_BYTES

    def __repr__(self) -> str:
        return "nl.tile_size"


tile_size = _TileSize()


def _buffer(buffer: Any, op: str) -> MemoryRegion:
    if isinstance(buffer, MemoryRegion):
        return buffer
    fail(op, "buffer must be a memory region (nl.sbuf, nl.psum, nl.hbm, nl.shared_hbm, "
         "nl.private_hbm); got {buffer!r} (string buffer names are rejected since NKI 0.3.0)",
         buffer=buffer)


def ndarray(shape: Sequence[int], dtype: Any, buffer: MemoryRegion = sbuf, name: str = "",
            address: Any = None) -> NkiTensor:
    """Allocate a tensor. Memory is NOT initialised: it holds NaN (floats) / 4 (ints) sentinels.

    ``address=(partition, byte)`` on SBUF places the tile on those bytes of this kernel instance's SBUF
    (tensor.py, "manual placement"): tiles placed on the same bytes share them, and a placed tile reads what
    its bytes hold (the sentinel only where no placed tile has been before). On PSUM and HBM ``address`` is
    accepted and not modelled (each tile gets storage of its own; docs/interpreter.md). A launch with
    ``placement=False`` (``nki.simulate``, memory.LaunchRules) gives every placed tile storage of its own."""
    buf = _buffer(buffer, "nl.ndarray")
    dt = _dt.resolve(dtype, "nl.ndarray")
    if address is not None and buf.on_chip and _mem.current().rules.placement:
        return _cf.allocated(place(tuple(shape), dt, buf, name, address))
    return _cf.allocated(allocate(tuple(shape), dt, buf, name))


def _check_fill_value(op: str, value: Any, dt: np.dtype) -> None:
    """On the chip ``nl.zeros/ones/full`` are the ``nisa.memset`` they stand for, so the fill value follows
    memset's rule (NKI 0.2 -> 0.3 migration guide, "nisa.memset -- strict type matching": "NKI 0.3.0 enforces
    that the value argument must match the destination tensor's dtype ... For integer-typed tensors, pass an
    integer literal"): a compile-time scalar; into an integer dtype an integer in its range (or +0.0, the
    integer 0's bits, as ``isa/vector.py``'s memset accepts)."""
    require(isinstance(value, (int, float, bool, np.integer, np.floating)), op,
            "fill value must be a compile-time scalar, got {got}", got=type(value).__name__)
    if not _dt.is_int(dt):
        return
    zero = isinstance(value, (float, np.floating)) and value == 0 and np.copysign(1.0, value) > 0
    require(isinstance(value, (int, np.integer)) or zero, op, "fill value {value!r} ({type}) does not match "
            "integer dtype {dtype}: on the chip this is a nisa.memset, whose value must match the destination "
            "dtype; pass an integer literal (NKI 0.3.0 migration guide, \"nisa.memset -- strict type "
            "matching\")", value=value, type=type(value).__name__, dtype=dt.name)
    info = np.iinfo(dt)
    require(info.min <= int(value) <= info.max, op, "fill value {value} is out of range for {dtype} "
            "[{lo}, {hi}] (a nisa.memset on the chip; NKI 0.3.0 migration guide, \"nisa.memset -- strict "
            "type matching\")", value=value, dtype=dt.name, lo=int(info.min), hi=int(info.max))


def _filled(shape: Sequence[int], dtype: Any, buffer: Any, name: str, value: Any, op: str) -> NkiTensor:
    buf = _buffer(buffer, op)
    dt = _dt.resolve(dtype, op)
    if buf.on_chip:
        _check_fill_value(op, value, dt)
    t = _cf.allocated(allocate(tuple(shape), dt, buf, name, fill=_dt.cast(np.asarray(value), dt)))
    if buf.on_chip:  # on the chip this is a memset instruction
        from .isa import common  # isa imports language

        if t.storage.alloc is not None:  # the memset writes it: live from here (memory.py)
            t.storage.alloc.touch()
        if buf is psum:
            common.set_value_initialised(t, True)
        common.emit("memset", common.VECTOR, dst=t, attrs={"value": value, "via": op})
        _mem.tick(op)
    return t


def zeros(shape: Sequence[int], dtype: Any, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    """A tensor filled with 0 (a memset on the chip)."""
    return _filled(shape, dtype, buffer, name, 0, "nl.zeros")


def ones(shape: Sequence[int], dtype: Any, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    return _filled(shape, dtype, buffer, name, 1, "nl.ones")


def full(shape: Sequence[int], fill_value: Any, dtype: Any, buffer: MemoryRegion = sbuf,
         name: str = "") -> NkiTensor:
    return _filled(shape, dtype, buffer, name, fill_value, "nl.full")


def zeros_like(a: NkiTensor, dtype: Any = None, buffer: MemoryRegion | None = None,
               name: str = "") -> NkiTensor:
    return zeros(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def empty_like(a: NkiTensor, dtype: Any = None, buffer: MemoryRegion | None = None,
               name: str = "") -> NkiTensor:
    return ndarray(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def ds(start: int, size: int) -> slice:
    """``nl.ds(start, size)``: the slice ``start:start+size``."""
    return slice(start, start + size)


# NKI 0.3+: affine_range / sequential_range / static_range are deprecated aliases of Python's range
# (fully unrolled at trace time), so executing them sequentially is exact.
def affine_range(*args: int) -> range:
    return range(*args)


def sequential_range(*args: int) -> range:
    return range(*args)


def static_range(*args: int) -> range:
    return range(*args)


def _reg_value(v: Any) -> int:
    return v.value if isinstance(v, VirtualRegister) else int(v)


def dynamic_range(start: int | VirtualRegister, stop: int | VirtualRegister | None = None,
                  step: int = 1) -> Iterator[VirtualRegister]:
    """``nl.dynamic_range`` (deprecated in NKI 0.6 for ``fori_loop``): a runtime loop with (possibly
    register) bounds.

    ``start`` / ``stop`` may be :class:`VirtualRegister` values (read once, when the loop starts);
    ``step`` must be a compile-time positive int. The loop variable is a read-only VirtualRegister,
    usable as a register (``.ap(scalar_offset=i)``) but not as a Python int, like ``fori_loop``'s.
    The rules of runtime loops apply (:mod:`trnkit.nkisim.controlflow`).
    """
    if stop is None:
        start, stop = 0, start
    require(isinstance(step, int) and not isinstance(step, builtins.bool) and step > 0,
            "nl.dynamic_range", "step must be a compile-time positive int, got {step!r}", step=step)
    yield from _cf.iterate("nl.dynamic_range", range(_reg_value(start), _reg_value(stop), step))


def fori_loop(lower: int | VirtualRegister, upper: int | VirtualRegister,
              body_fun: Callable[[VirtualRegister], None], step: int = 1) -> None:
    """``for i in range(lower, upper, step): body_fun(i)`` as one runtime (hardware) loop.

    ``i`` is a fresh read-only :class:`VirtualRegister` per iteration ("passed by value"), usable only
    as ``.ap(scalar_offset=i)`` or in ``nisa.register_*`` reads; Python arithmetic on it raises, as
    the compiler would. The body returns nothing, keeps loop state in SBUF/HBM, and tensors it
    allocates stay inside its iteration (NKI 0.6 migration guide, "Rules for migrated loops"; checked
    in :mod:`trnkit.nkisim.controlflow`).
    """
    require(isinstance(step, int) and not isinstance(step, builtins.bool) and step > 0,
            "nl.fori_loop", "step must be a compile-time positive int, got {step!r}", step=step)
    for i in _cf.iterate("nl.fori_loop", range(_reg_value(lower), _reg_value(upper), step)):
        _cf.loop_body_result("nl.fori_loop", body_fun(i))


def while_loop(init: VirtualRegister, body_fun: Callable[[VirtualRegister], VirtualRegister]) -> None:
    """Run ``body_fun(r)`` while the condition register is non-zero (checked before each iteration).

    As documented (``nki.language.while_loop``): "The body receives the current condition value ``r``
    as a VirtualRegister, passed by value ... The loop's next condition is the register the body
    **returns**"; the migration guide: "The while_loop body can only return the condition for the
    next iteration".
    """
    op = "nl.while_loop"
    require(isinstance(init, VirtualRegister), op, "init must be a VirtualRegister (the condition), "
            "got {type}", type=type(init).__name__)
    with _cf.loop(op, None) as frame:
        cond = init.value
        while cond:
            frame.next_iteration()
            nxt = body_fun(_cf.Register(cond))
            require(isinstance(nxt, VirtualRegister), op, "the body must return the next condition "
                    "register (a VirtualRegister), got {got!r} ({doc}: the while_loop body can only "
                    "return the condition for the next iteration)", got=nxt,
                    doc=_cf.MIGRATION_LOOP_RULES)
            cond = nxt._value if isinstance(nxt, _cf.Register) else nxt.value  # the loop's own read


def program_id(axis: int = 0) -> int:
    """This instance's index along grid ``axis`` (0 without a grid)."""
    pid = _mem.current().program_id
    require(axis >= 0, "nl.program_id", "axis must be >= 0, got {axis}", axis=axis)
    if axis >= len(pid):
        require(not pid, "nl.program_id", "axis {axis} out of range for a {ndim}-D grid",
                axis=axis, ndim=len(pid))
        return 0
    return pid[axis]


def num_programs(axes: int | Sequence[int] | None = 0) -> int:
    """Grid size along ``axes`` (default axis 0 as in the NKI signature; all axes when None; 1
    without a grid)."""
    grid = _mem.current().launch.grid
    if axes is None:
        axes = tuple(range(len(grid)))
    elif isinstance(axes, int):
        axes = (axes,)
    n = 1
    for a in axes:
        if a < len(grid):
            n *= grid[a]
        else:
            require(not grid, "nl.num_programs", "axis {axis} out of range for a {ndim}-D grid",
                    axis=a, ndim=len(grid))
    return n


def program_ndim() -> int:
    """Number of grid dimensions of the launch (0 without a grid)."""
    return len(_mem.current().launch.grid)


class _NoReorder:
    def __enter__(self) -> None:
        program = _cf.current()
        if program is not None:
            program.no_reorder += 1
        _mem.current().memory.fence()

    def __exit__(self, *exc: Any) -> None:
        program = _cf.current()
        if program is not None:
            program.no_reorder -= 1
        _mem.current().memory.fence()


def no_reorder() -> _NoReorder:
    """``with nl.no_reorder():`` keeps program order (the interpreter is always in order); runtime
    loops may not start inside it."""
    return _NoReorder()


def _removed(name: str) -> Callable[..., Any]:
    def f(*_: Any, **__: Any) -> Any:
        fail(f"nl.{name}", "removed in NKI 0.2.0 (with masks and affine index expressions); index with "
             "ints, slices and nl.ds(start, size), or use .ap() access patterns")

    f.__name__ = name
    return f


arange = _removed("arange")
mgrid = _removed("mgrid")
par_dim = _removed("par_dim")


def device_print(prefix: str, x: NkiTensor) -> None:
    print(prefix, x.np())


def is_hbm(buffer: MemoryRegion) -> bool:
    return isinstance(buffer, MemoryRegion) and not buffer.on_chip


def is_on_chip(buffer: MemoryRegion) -> bool:
    return isinstance(buffer, MemoryRegion) and buffer.on_chip


def is_psum(buffer: MemoryRegion) -> bool:
    return buffer is psum


def is_sbuf(buffer: MemoryRegion) -> bool:
    return buffer is sbuf


# documented names not implemented here: placeholders raising NotImplementedError on use
fill_missing(globals(), "nki.language")
