"""On-chip memory accounting and the per-kernel-instance context.

Each kernel instance (one ``@nki.jit`` call, or one program of a grid launch) gets a fresh
:class:`KernelContext` holding an empty :class:`Memory`. ``nl.ndarray`` registers every SBUF/PSUM
allocation there; the bytes come back when the last view of the allocation is garbage-collected
(a ``weakref`` callback), so the accounting is over LIVE allocations, as a compiler's allocator would
see them. The official simulator does not model capacity at all (NKI simulator guide, "not modelled:
SBUF/PSUM capacity"); these checks are trnkit's own.

Capacities (trn2 = NeuronCore-v3), per partition:

* SBUF: 224 KiB physical (``nki/guides/architecture/trainium2_arch.rst``: 28 MiB = 128 partitions x
  224 KiB; ``../shared/notes/hardware.md``). Usable: 208 KiB, what nki-library budgets after the
  compiler's reserved region (``nkilib core/mlp/mlp_cte/mlp_cte_constants.py``:
  ``224*1024 - 16384 - ...``; ``nki-facts.md`` section 3).
* PSUM: 16 KiB = 8 banks x 2 KiB (512 fp32) per partition (trn2 arch guide; ``nl.tile_size.rst``
  ``psum_bank_fmax``). A PSUM tile must fit inside one bank (a matmul accumulation group lives in one
  bank); tiles are placed first-fit into the banks, several small tiles may share a bank.
"""

from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from .errors import fail

__all__ = [
    "SBUF_PARTITION_BYTES", "SBUF_USABLE_BYTES", "PSUM_BANKS", "PSUM_BANK_BYTES",
    "PSUM_PARTITION_BYTES", "NUM_PARTITIONS", "Memory", "KernelContext", "LaunchContext",
    "current", "push_context", "pop_context",
]

NUM_PARTITIONS = 128
SBUF_PARTITION_BYTES = 224 * 1024  # trn2 physical SBUF per partition
SBUF_USABLE_BYTES = 208 * 1024  # what a kernel may allocate (nki-library budget, see module doc)
PSUM_BANKS = 8
PSUM_BANK_BYTES = 2048
PSUM_PARTITION_BYTES = PSUM_BANKS * PSUM_BANK_BYTES


class Memory:
    """Live SBUF bytes and PSUM bank occupancy (bytes per partition) of one kernel instance."""

    def __init__(self, sbuf_capacity: int = SBUF_USABLE_BYTES) -> None:
        self.sbuf_capacity = sbuf_capacity
        self.sbuf_used = 0
        self.sbuf_peak = 0
        self.psum_bank_used = [0] * PSUM_BANKS
        self._live: dict[weakref.ref, tuple[int, int]] = {}  # live allocation -> (bank or -1, bytes)
        self._lock = threading.RLock()

    @property
    def psum_used(self) -> int:
        return sum(self.psum_bank_used)

    def allocate(self, owner: object, buffer: str, nbytes: int, name: str) -> None:
        """Account ``nbytes`` per partition for ``owner``; freed automatically when ``owner`` dies.

        On overflow, unreachable tensors still waiting for the cycle collector are collected and
        the allocation is retried once before the error (only live tensors count).
        """
        if buffer == "psum" and nbytes > PSUM_BANK_BYTES:
            fail("nl.ndarray", "PSUM tile {name!r} needs {requested} bytes per partition, more "
                 "than one PSUM bank ({bank} bytes = 512 fp32)",
                 name=name, requested=nbytes, bank=PSUM_BANK_BYTES)
        if buffer not in ("sbuf", "psum") or self._try(owner, buffer, nbytes):
            return
        gc.collect()
        if self._try(owner, buffer, nbytes):
            return
        if buffer == "sbuf":
            fail("nl.ndarray", "SBUF overflow allocating {name!r}: requested {requested} bytes "
                 "per partition, {used} in use, capacity {capacity}",
                 name=name, requested=nbytes, used=self.sbuf_used, capacity=self.sbuf_capacity)
        fail("nl.ndarray", "PSUM overflow allocating {name!r}: requested {requested} bytes per "
             "partition, {used} in use over {banks} banks, capacity {capacity} "
             "(bank use {bank_use})", name=name, requested=nbytes, used=self.psum_used,
             banks=PSUM_BANKS, capacity=PSUM_PARTITION_BYTES, bank_use=list(self.psum_bank_used))

    def _try(self, owner: object, buffer: str, nbytes: int) -> bool:
        with self._lock:
            if buffer == "sbuf":
                if self.sbuf_used + nbytes > self.sbuf_capacity:
                    return False
                self.sbuf_used += nbytes
                if self.sbuf_used > self.sbuf_peak:
                    self.sbuf_peak = self.sbuf_used
                self._live[weakref.ref(owner, self._release)] = (-1, nbytes)
                return True
            for bank, used in enumerate(self.psum_bank_used):  # first fit, a tile stays in one bank
                if used + nbytes <= PSUM_BANK_BYTES:
                    self.psum_bank_used[bank] = used + nbytes
                    self._live[weakref.ref(owner, self._release)] = (bank, nbytes)
                    return True
            return False

    def _release(self, ref: weakref.ref) -> None:
        """Weakref callback: the allocation ``ref`` pointed to died; give its bytes back.

        (A plain ``weakref.ref`` kept in ``_live`` costs a third of a ``weakref.finalize``; the lock
        is re-entrant because a garbage collection inside ``_try`` may free a tile of this memory.)
        """
        with self._lock:
            bank, nbytes = self._live.pop(ref)
            if bank < 0:
                self.sbuf_used -= nbytes
            else:
                self.psum_bank_used[bank] -= nbytes


@dataclass
class LaunchContext:
    """State shared by all program instances of one launch: the grid, ``shared_hbm`` storage."""

    grid: tuple[int, ...] = ()
    shared: list[Any] = field(default_factory=list)  # k-th shared_hbm allocation of the launch
    lock: threading.Lock = field(default_factory=threading.Lock)
    barrier: threading.Barrier | None = None  # for core_barrier / sendrecv style ops
    mailbox: dict = field(default_factory=dict)  # sendrecv: (pipe_id, from, to) -> data

    @property
    def num_instances(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n


@dataclass
class KernelContext:
    """One kernel instance: its program id, its on-chip memory, its launch."""

    program_id: tuple[int, ...] = ()
    launch: LaunchContext = field(default_factory=LaunchContext)
    memory: Memory = field(default_factory=Memory)
    shared_count: int = 0  # shared_hbm allocations made so far by this instance
    flat_program_id: int = 0


_tls = threading.local()


def current() -> KernelContext:
    """The kernel instance running on this thread (a per-thread default outside any kernel)."""
    stack = getattr(_tls, "stack", None)
    if stack:
        return stack[-1]
    default = getattr(_tls, "default", None)
    if default is None:
        default = _tls.default = KernelContext()
    return default


def push_context(ctx: KernelContext) -> None:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(ctx)


def pop_context() -> None:
    _tls.stack.pop()
