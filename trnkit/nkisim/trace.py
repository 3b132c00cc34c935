"""Instruction trace recorded by the interpreter and read by the cost model.

Every ``nisa.*`` call appends one :class:`Instr` to the active :class:`Trace` (if any). The record holds
what a cost model needs and nothing it could derive: the engine, the operand tiles, the bytes that
crossed HBM, and the arithmetic work. ``trnkit.nkisim.cost`` turns a trace into time per engine.

Usage::

    from trnkit.nkisim import trace
    with trace.record() as tr:
        kernel(a, b)
    print(len(tr), tr.by_op())

``trace.record(trace_only=True)`` also tells the interpreter to skip the arithmetic of large
``nc_matmul`` calls (shapes, checks and bookkeeping still run), so big shapes estimate quickly.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

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


_state = threading.local()
_global: list[Trace] = []  # stack of active traces, shared by SPMD threads of one launch


def active() -> Trace | None:
    """The innermost active trace, or None when nothing is recording."""
    return _global[-1] if _global else None


def trace_only() -> bool:
    """True when the active trace asked to skip large-matmul arithmetic."""
    tr = active()
    return tr is not None and tr.trace_only  # an empty Trace is falsy (__len__)


def emit(instr: Instr) -> None:
    """Record ``instr`` on the active trace (no-op when none is active)."""
    tr = active()
    if tr is not None:
        tr.append(instr)


@contextlib.contextmanager
def record(trace_only: bool = False) -> Iterator[Trace]:
    """Record every ISA instruction executed inside the block."""
    tr = Trace(trace_only=trace_only)
    _global.append(tr)
    try:
        yield tr
    finally:
        _global.remove(tr)
