"""Instruction trace recorded by the interpreter and read by the cost model.

Every ``nisa.*`` call appends one :class:`Instr` to the active :class:`Trace` (if any). The record holds
what a cost model needs and nothing it could derive: the engine, the operand tiles, the bytes that
crossed HBM, and the arithmetic work. ``trnkit.nkisim.cost`` turns a trace into time per engine.

Usage::

    from trnkit.nkisim import trace
    with trace.record() as tr:
        kernel(a, b)
    print(len(tr), tr.by_op())

A recording belongs to the code that opens it: it records the launches made inside the block on this
thread (their programs, nested launches and ``nki.collectives.run_ranks``' ranks included), never a launch
another thread makes meanwhile. Each launch takes the recording when it starts and keeps it in its
:class:`~trnkit.nkisim.memory.LaunchContext`, where its instructions find it.

``trace.record(trace_only=True)`` makes those launches *trace-only* launches: each carries
``trace_only=True`` in its :class:`~trnkit.nkisim.memory.LaunchRules` (as ``nki.simulate(kernel,
trace_only=True)`` does), so large ``nc_matmul`` calls skip their arithmetic (shapes, checks and
bookkeeping still run) and big shapes estimate quickly; the outputs of such a launch are not meaningful.
The instructions read the setting from their kernel instance's rules, never from module state, so a launch
outside the block computes in full while one inside it is trace-only.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import memory as _mem
from .errors import require

# Engine names, as the NKI ISA enum spells them (nki.isa.engine: tensor, vector, scalar, gpsimd, dma).
TENSOR = "tensor"
VECTOR = "vector"
SCALAR = "scalar"
GPSIMD = "gpsimd"
DMA = "dma"
ENGINES = (TENSOR, VECTOR, SCALAR, GPSIMD, DMA)


@dataclass(frozen=True)
class Operand:
    """One tile or tensor an instruction touches."""

    role: str  # "dst", "src", "data1", "stationary", ...
    buffer: str  # "sbuf" | "psum" | "hbm" | "shared_hbm" | "private_hbm"
    shape: tuple[int, ...]
    dtype: str  # numpy / ml_dtypes name, e.g. "bfloat16"
    partitions: int  # dim 0 for on-chip tiles; 1 for HBM tensors
    free_elems: int  # elements per partition (HBM: total elements)
    nbytes: int


@dataclass(frozen=True)
class Instr:
    """One executed ISA instruction."""

    op: str  # "nc_matmul", "dma_copy", "tensor_tensor", ...
    engine: str  # one of ENGINES
    operands: tuple[Operand, ...]
    flops: int = 0  # 2*M*N*K for matmul; elementwise ops count 0 (cost is per element, not per flop)
    hbm_bytes: int = 0  # bytes read from + written to HBM by this instruction (DMA only)
    dma_bytes: int = 0  # bytes moved by a DMA (any direction, incl. SBUF->SBUF)
    elems_per_partition: int = 0  # N in the ISA cost formulas (largest operand's free size)
    partitions: int = 0  # active partitions
    program_id: int = 0  # SPMD instance that issued it
    attrs: dict = field(default_factory=dict, compare=False)  # op-specific: dtype class, perf mode, ...


class Trace:
    """An ordered list of :class:`Instr`, with a few summaries."""

    def __init__(self, trace_only: bool = False) -> None:
        self.instrs: list[Instr] = []
        self.trace_only = trace_only
        self._lock = threading.Lock()

    def append(self, instr: Instr) -> None:
        with self._lock:
            self.instrs.append(instr)

    def __len__(self) -> int:
        return len(self.instrs)

    def __iter__(self) -> Iterator[Instr]:
        return iter(self.instrs)

    def by_op(self) -> Counter:
        return Counter(i.op for i in self.instrs)

    def by_engine(self) -> Counter:
        return Counter(i.engine for i in self.instrs)

    @property
    def flops(self) -> int:
        return sum(i.flops for i in self.instrs)

    @property
    def hbm_bytes(self) -> int:
        return sum(i.hbm_bytes for i in self.instrs)


# the recording the code running in this context opened (contextvars: a thread starts with none)
_recording: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("trnkit_nkisim_recording", default=None)


def recording() -> Trace | None:
    """The innermost :func:`record` block open in the calling code (this thread's context), or None. A launch
    takes it when it starts (``jit._launch``)."""
    return _recording.get()


def active() -> Trace | None:
    """The trace the running instruction is recorded in: its launch's, or outside any kernel the calling
    code's open :func:`record` block; None when nothing records."""
    ctx = _mem.running()
    return ctx.launch.trace if ctx is not None else _recording.get()


def trace_only() -> bool:
    """True when the running kernel instance's launch is trace-only (``LaunchRules.trace_only``); outside any
    kernel, when the calling code's open :func:`record` block asked for it."""
    ctx = _mem.running()
    if ctx is not None:
        return ctx.rules.trace_only
    tr = _recording.get()
    return tr is not None and tr.trace_only  # an empty Trace is falsy (__len__)


def emit(instr: Instr) -> None:
    """Record ``instr`` on the active trace (no-op when none is active)."""
    tr = active()
    if tr is not None:
        tr.append(instr)


@contextlib.contextmanager
def record(trace_only: bool = False) -> Iterator[Trace]:
    """Record every ISA instruction of the launches made inside the block by this thread (module doc);
    ``trace_only=True`` makes those launches trace-only."""
    require(isinstance(trace_only, bool), "trace.record", "argument trace_only must be True or False, got "
            "{value!r}", value=trace_only)
    tr = Trace(trace_only=trace_only)
    token = _recording.set(tr)
    try:
        yield tr
    finally:
        _recording.reset(token)
