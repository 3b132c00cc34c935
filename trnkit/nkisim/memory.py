"""On-chip memory accounting by liveness, and the per-kernel-instance context.

Each kernel instance (one ``@nki.jit`` call, or one program of a grid launch) gets a fresh
:class:`KernelContext` holding an empty :class:`Memory`. ``nl.ndarray`` registers every SBUF/PSUM
allocation there as an :class:`Allocation`; every instruction that reads or writes the allocation
(``NkiTensor.np()`` and the indirect-DMA accessors) stamps it with the current instruction number
(:attr:`Memory.clock`; every public ``nki.isa`` function is wrapped by :func:`instruction`, which
advances the clock when the call returns, so each call is one instruction). An allocation
therefore occupies memory from its first access to its last, as the compiler's allocator sees it
(data liveness), not for the lifetime of the Python object: nki-library keeps dead PSUM tiles
referenced in lists and enclosing scopes (``core/moe/moe_cte/bwmm_shard_on_block.py``,
``bwmm_shard_on_I.py``, ``core/attention/attention_cte.py``) and those kernels compile and pass on
Trainium. :meth:`Memory.check` sweeps the intervals when the kernel instance returns and raises at the
first instruction where the live bytes exceed capacity, naming every live allocation and the
``file:line`` that allocated it. The official simulator does not model capacity at all (NKI simulator
guide, "not modelled: SBUF/PSUM capacity"); these checks are trnkit's own.

Capacities (trn2 = NeuronCore-v3), per partition:

* SBUF: 224 KiB physical (``nki/guides/architecture/trainium2_arch.rst``: 28 MiB = 128 partitions x
  224 KiB; ``../shared/notes/hardware.md``). Usable: 208 KiB, what nki-library budgets after the
  compiler's reserved region (``nkilib core/mlp/mlp_cte/mlp_cte_constants.py``:
  ``224*1024 - 16384 - ...``; ``nki-facts.md`` section 3).
* PSUM: 16 KiB = 8 banks x 2 KiB (512 fp32) per partition (trn2 arch guide; ``nl.tile_size.rst``
  ``psum_bank_fmax``, ``psum_num_banks``). A PSUM tile may span up to all 8 banks (16 KiB per partition,
  checked when the tile is allocated); a tile over one bank occupies whole, consecutive banks that no other
  tile shares (``ceil(bytes / 2 KiB)`` banks, its start on a bank boundary, as the manual-placement API's
  ``address=(0, bank_id * 2048)`` puts it), while tiles of at most one bank each sit inside one bank
  (first-fit decreasing, several small tiles may share a bank). Only the number of banks is checked: the
  compiler places the tiles after tracing and the interpreter does not model which consecutive banks are
  free. Sources: Neuron SDK 2.33's ``nki.language.tile_size`` page calls ``psum_fmax`` (512) the "Maximum
  free dimension per PSUM bank per partition ... Deprecated since version 0.4.0: Despite the name, this does
  not represent the free-dim size per partition. Use psum_bank_fmax instead." (up to 2.30 it read "Maximum
  free dimension of a tile on PSUM buffer"; the tested kernel wins over that wording: nki-library's
  ``core/topk/rotational_topk.py`` ``_topk_rotated_core`` at k = 2,048 allocates [P, 1024] fp32 PSUM tiles,
  two banks, each written by two 512-column matmuls, one per bank); the architecture guide's "free dimension
  size can be up to ... 4K elements for PSUM" per Vector / Scalar instruction (``isa/vector.py``) lets one
  instruction read several banks (4,096 fp32 are all 8). The ``nki.compiler.psum.alloc`` reference's "In
  current release, fdim_size cannot exceed 2KiB" is about that manual-placement API, which the interpreter
  does not implement. What stays inside one bank is one TensorE write: a matmul (or TensorE transpose) whose output
  range crosses a bank boundary of a multi-bank tile is rejected (``isa/tensor_engine.py``; accumulation
  groups below: "the first one writing to a PSUM bank and more subsequent instructions accumulating into the
  same PSUM bank", and ``nc_matmul``'s output is at most ``psum_bank_fmax`` = ``gemm_moving_fmax`` = 512
  fp32). At every instruction the live PSUM tiles must pack into the 8 banks, in program order or else in
  the reordered schedule below.

PSUM and the compiler's reordering. The order of the trace is not the order the hardware runs:
neuronx-cc "makes both decisions [where each tensor goes in SBUF, PSUM and HBM, and the order in which
the engines run the instructions] after NKI traces the kernel" (``nki/deep-dives/nki-compile-config.rst``,
Overview), and "without [``nl.no_reorder``] the compiler scheduler is free to reorder independent
operations" (``nki.language.no_reorder``). A tile's address is held "at its first write" and released
"after its last read" (``nki.compiler.Allocation``, LINEAR). So PSUM tiles that need more than the 8 banks
in program order are judged again on one schedule the compiler may legally produce: every instruction
that reads or rewrites PSUM tiles written earlier (an evacuation: ``tensor_copy``, ``activation``,
``tensor_tensor`` ... reading PSUM, and no first write of a PSUM tile) moves up to right after the last
instruction it depends on, i.e. the last earlier instruction that touched any allocation it touches
(reads and writes are not told apart: every shared allocation is a dependence, which only forbids more
moves). Each such move can only end a PSUM tile's life earlier, never start one earlier, so this
schedule needs at most the banks of program order. The kernel is rejected only if it overflows there
too: then at least nine tiles are live at once in every order that keeps these dependences (nine tiles
written before a value that every read of them needs, for example). The docs do not say how neuronx-cc
picks among legal orders; the interpreter assumes it finds this one when the program order does not fit.
What does not move (its dependences are not all visible to the interpreter, or the docs forbid it): a
matmul (its accumulation group keeps its order), an instruction that reads a register or touches HBM, one
inside ``nl.no_reorder()`` ("guarantee that operations inside the block execute in program order"), a
cross-core synchronisation (nothing moves above it either), and nothing moves across the start or end of
a runtime-loop iteration (the body is compiled once; ``NkiInstruction.depends_on``: an edge cannot be
wired "into or out of a dynamic loop"). The schedule is built as the kernel runs (:meth:`Memory.tick`
places each instruction) and used only for the PSUM capacity: SBUF and the accumulation groups stay in
program order. :class:`PsumReorderWarning` reports a kernel that fits only reordered.

Matmul accumulation groups (:meth:`Memory.matmul_write`, checked with the capacities): "A series of
TensorE matmul instructions with the first one writing to a PSUM bank and more subsequent instructions
accumulating into the same PSUM bank data is called a matmul accumulation group ... with 8 PSUM banks
per partition, TensorE can have up to eight outstanding matmul accumulation groups"
(``nki/guides/architecture/trainium_inferentia2_arch.rst``, "PSUM accumulation"). A group is
outstanding from its first matmul to its last one; after that its result is plain PSUM data (bounded
by the PSUM capacity, not by this rule). Groups are counted per bank of a tile: a tile of at most one bank
carries one group at a time, a multi-bank tile one per bank (each matmul's output lies inside one bank).
Matmuls into any view of a tile's bank extend that bank's current group, and a matmul that starts a
fresh accumulation after another instruction read or wrote the tile opens a new group. At no
instruction may more than eight groups be outstanding. AWS's tested kernels rely on exactly this:
sequential and single-matmul groups into many PSUM tiles kept in lists (attention_tkg,
output_projection_tkg, mlp_tkg, moe_cte shard_on_block) run on trn2.

Outside any kernel (the per-thread default context, e.g. ``nl.ndarray`` at the top level of a
script) nothing is recorded: there is no end of kernel to check at, and a long-running process would
accumulate records. Push a :class:`KernelContext` and call :meth:`Memory.check` to check such code.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import fail, require

__all__ = [
    "SBUF_PARTITION_BYTES", "SBUF_USABLE_BYTES", "PSUM_BANKS", "PSUM_BANK_BYTES",
    "PSUM_PARTITION_BYTES", "NUM_PARTITIONS", "Allocation", "Memory", "KernelContext",
    "LaunchContext", "current", "push_context", "pop_context", "tick", "instruction",
    "MAX_ACCUMULATION_GROUPS", "SbufSpillWarning", "PsumReorderWarning", "LaunchRules", "CAPACITY_MODES",
    "running",
]

NUM_PARTITIONS = 128
SBUF_PARTITION_BYTES = 224 * 1024  # trn2 physical SBUF per partition
SBUF_USABLE_BYTES = 208 * 1024  # what a kernel may allocate (nki-library budget, see module doc)
PSUM_BANKS = 8
PSUM_BANK_BYTES = 2048
PSUM_PARTITION_BYTES = PSUM_BANKS * PSUM_BANK_BYTES
MAX_ACCUMULATION_GROUPS = PSUM_BANKS  # outstanding matmul accumulation groups (module doc)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class Allocation:
    """One SBUF/PSUM allocation: its size and the instructions that first and last touched it."""

    __slots__ = ("name", "buffer", "nbytes", "site", "memory", "first", "last", "groups", "reach", "span")

    def __init__(self, name: str, buffer: str, nbytes: int, site: str, memory: Memory) -> None:
        self.name = name
        self.buffer = buffer  # "sbuf" | "psum"
        self.nbytes = nbytes  # per partition
        self.site = site  # "file.py:line" of the nl.ndarray call in user code
        self.memory = memory
        self.first = -1  # instruction numbers (Memory.clock) of the first / last access; -1: none
        self.last = -1
        # PSUM: bank of the tile -> [first, last] matmul of each accumulation group in that bank
        self.groups: dict[int, list[list[int]]] = {}
        self.reach: tuple[int, int, int] | None = None  # slot of its last access in the reordered schedule
        self.span: tuple[int, int] | None = None  # manually placed SBUF: its bytes [start, stop) per partition

    def touch(self) -> None:
        """An instruction running now reads or writes this allocation."""
        memory = self.memory
        t = memory.clock
        if self.last != t or self.first < 0:
            memory.touching.append(self)
        if self.first < 0:
            self.first = t
        self.last = t

    def describe(self, reordered: bool = False) -> str:
        span = f"instructions {self.first}..{self.last}" if self.first >= 0 else "never accessed"
        if reordered and self.reach is not None and self.reach[1]:
            span += f" (instruction {self.last} can run right after instruction {self.reach[0]})"
        return f"{self.name!r} {self.nbytes} B allocated at {self.site}, {span}"


def _user_site() -> str:
    """``file:line`` of the innermost caller outside the interpreter package."""
    f = sys._getframe(2)
    while f is not None and os.path.dirname(os.path.abspath(f.f_code.co_filename)).startswith(_PACKAGE_DIR):
        f = f.f_back
    if f is None:
        return "<interpreter>"
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def _whole_banks(nbytes: int) -> int:
    """Banks a PSUM tile takes to itself: ``ceil(nbytes / 2 KiB)`` over one bank, else 0 (it may share)."""
    return -(-nbytes // PSUM_BANK_BYTES) if nbytes > PSUM_BANK_BYTES else 0


def _bank_bound(nbytes: int) -> int:
    """Most banks a PSUM tile can add to a packing (1 for a tile of at most one bank)."""
    return max(1, _whole_banks(nbytes))


def _pack_banks(sizes: list[int]) -> list[int]:
    """Bytes used per bank after placing ``sizes``: a tile over one bank fills ``ceil(n / 2 KiB)`` whole
    banks of its own (module doc), the others go first-fit decreasing, each inside one bank."""
    banks: list[int] = []
    for n in sizes:
        if n > PSUM_BANK_BYTES:
            banks += [PSUM_BANK_BYTES] * _whole_banks(n)
    for n in sorted((n for n in sizes if n <= PSUM_BANK_BYTES), reverse=True):
        for i, used in enumerate(banks):
            if used + n <= PSUM_BANK_BYTES:
                banks[i] = used + n
                break
        else:
            banks.append(n)
    return banks


class Memory:
    """SBUF/PSUM allocations of one kernel instance, checked by liveness (see the module doc)."""

    def __init__(self, sbuf_capacity: int = SBUF_USABLE_BYTES, track: bool = True) -> None:
        self.sbuf_capacity = sbuf_capacity
        self.track = track
        self.clock = 0  # number of the instruction running now
        self.allocations: list[Allocation] = []
        self.slots: dict[tuple, Allocation] = {}  # placed SBUF slots (place())
        self.ops: list[str] = []  # ops[t]: name of instruction t (for the overflow message)
        self.running = "access"  # name of the instruction running now (for access errors)
        self.sbuf_peak = 0  # set by check(): most SBUF bytes per partition live at once
        self.psum_peak_banks = 0  # set by check(): most PSUM banks needed at once
        self.sbuf_spill = 0  # set by check("sbuf_spills"): most bytes over capacity
        self.sbuf_spill_at = -1  # ... and the instruction where that excess is live
        self.psum_reordered_banks = 0  # set by check(): banks needed with PSUM reads moved up; 0: in order
        # the reordered schedule (module doc, "PSUM and the compiler's reordering"), built as it runs:
        self.touching: list[Allocation] = []  # allocations the running instruction accessed so far
        self.pinned = False  # the running instruction keeps its place (matmul, register, HBM, sync)
        self.fencing = False  # ... and nothing after it may move above it (sync, nl.no_reorder)
        self.fence_slot: tuple[int, int, int] = (-1, 0, -1)  # no moved instruction goes before this
        self._lock = threading.Lock()

    def allocate(self, buffer: str, nbytes: int, name: str) -> Allocation | None:
        """Register an SBUF/PSUM allocation of ``nbytes`` per partition (None when not tracking)."""
        if buffer == "psum" and nbytes > PSUM_PARTITION_BYTES:
            fail("nl.ndarray", "PSUM tile {name!r} needs {requested} bytes per partition, more "
                 "than the whole PSUM ({banks} banks x {bank} bytes = {capacity} bytes; "
                 "nl.tile_size.psum_num_banks x psum_bank_fmax_bytes)", name=name, requested=nbytes,
                 banks=PSUM_BANKS, bank=PSUM_BANK_BYTES, capacity=PSUM_PARTITION_BYTES)
        if buffer not in ("sbuf", "psum"):
            return None
        if buffer == "sbuf" and nbytes > self.sbuf_capacity:  # can never fit: say so at once
            fail("nl.ndarray", "SBUF tile {name!r} needs {requested} bytes per partition, more "
                 "than the SBUF capacity ({capacity})", name=name, requested=nbytes,
                 capacity=self.sbuf_capacity)
        if not self.track:
            return None
        a = Allocation(name, buffer, nbytes, _user_site(), self)
        with self._lock:
            self.allocations.append(a)
        return a

    def place(self, buffer: str, p0: int, nparts: int, byte0: int, nbytes: int, name: str) -> Allocation | None:
        """The liveness record of the placed slot ``[p0, p0 + nparts) x [byte0, byte0 + nbytes)`` (None when
        not tracking): one per slot, shared by every tile placed there, so the slot is live from the first
        access through any of them to the last, and the capacity check counts its bytes once (module doc)."""
        if not self.track:
            return None
        if buffer == "psum":  # the banks it covers: accumulation groups and liveness follow the bank (module doc)
            key = (buffer, byte0 // PSUM_BANK_BYTES, -(-(byte0 + nbytes) // PSUM_BANK_BYTES))
        else:
            key = (buffer, p0, nparts, byte0, nbytes)
        a = self.slots.get(key)
        if a is None:
            a = Allocation(f"{name}@({p0}, {byte0})", buffer, nbytes, _user_site(), self)
            if buffer == "sbuf":
                a.span = (byte0, byte0 + nbytes)
            with self._lock:
                self.slots[key] = a
                self.allocations.append(a)
        a.nbytes = max(a.nbytes, nbytes)
        return a

    def matmul_write(self, alloc: Allocation | None, starts: bool, bank: int = 0) -> None:
        """A matmul running now writes bank ``bank`` (counted from the tile's start) of PSUM
        ``alloc``; ``starts``: it overwrites rather than accumulates. Call before the instruction
        touches ``alloc`` (see the module doc)."""
        if alloc is None:
            return
        self.pinned = True  # a matmul stays in its accumulation group's order
        t = self.clock
        groups = alloc.groups.setdefault(bank, [])
        if groups and (not starts or alloc.last <= groups[-1][1]):
            groups[-1][1] = t  # accumulates, or nothing else used the tile since: the same group
        else:
            groups.append([t, t])

    def check_accumulation_groups(self) -> None:
        """Raise at the first instruction where more than eight matmul accumulation groups are
        outstanding (from their first to their last matmul)."""
        events = sorted((g[0], 1, g[1], a.name if a.nbytes <= PSUM_BANK_BYTES else f"{a.name}[bank {b}]")
                        for a in self.allocations for b, gs in a.groups.items() for g in gs)
        ends: list[tuple[int, str, int]] = []  # (last, name, first) of the open groups
        for first, _, last, name in events:
            ends = [e for e in ends if e[0] >= first]
            if len(ends) >= MAX_ACCUMULATION_GROUPS:
                open_groups = ", ".join(f"{n!r} (instructions {f}..{e})"
                                        for e, n, f in sorted(ends, key=lambda x: x[2]))
                fail("nc_matmul", "the matmul accumulation group on {name!r} at instruction {t} "
                     "(until instruction {last}) would be the {n}th outstanding one; TensorE has at "
                     "most {limit} (trainium_inferentia2_arch.rst, PSUM accumulation: one per PSUM "
                     "bank); outstanding: {open}", name=name, t=first, last=last, n=len(ends) + 1,
                     limit=MAX_ACCUMULATION_GROUPS, open=open_groups)
            ends.append((last, name, first))

    def tick(self, op: str) -> None:
        """Instruction ``op`` (number :attr:`clock`) is done; the next one starts."""
        if self.track:
            self._place(self.clock)
            self.ops.append(op)
            self.clock += 1

    def pin(self, fence: bool = False) -> None:
        """The running instruction may not move up in the reordered schedule (it reads a register or
        HBM, or synchronises); ``fence``: neither may any later instruction move above it."""
        self.pinned = True
        self.fencing = self.fencing or fence

    def fence(self) -> None:
        """No instruction from here on moves above the instructions before (a runtime-loop iteration
        starts or ends, an ``nl.no_reorder`` block opens or closes)."""
        if self.track:
            self.fence_slot = (self.clock - 1, 0, self.clock - 1)

    def _place(self, t: int) -> None:
        """Slot of instruction ``t`` in the reordered schedule (module doc): ``(t, 0, t)`` where it
        stands, or ``(a, 1, t)``, right after instruction ``a``, for an instruction that reads PSUM
        tiles written earlier and moves up to the last instruction it depends on."""
        touched = self.touching
        movable = not self.pinned and touched and any(a.buffer == "psum" for a in touched) \
            and all(a.first < t for a in touched if a.buffer == "psum")
        if movable:
            after = max([self.fence_slot] + [a.reach for a in touched if a.reach is not None])
            slot = (after[0], 1, t)
        else:
            slot = (t, 0, t)
        for a in touched:
            a.reach = slot
        if self.fencing:
            self.fence_slot = slot
        self.touching = []
        self.pinned = self.fencing = False

    def _op_at(self, t: int) -> str:
        return self.ops[t] if t < len(self.ops) else "the kernel's return"

    def check(self, capacity: str = "checked") -> None:
        """Raise at the first instruction where the live SBUF bytes or PSUM banks exceed capacity; then
        check the matmul accumulation groups (always). ``capacity`` (:class:`LaunchRules`): "sbuf_spills"
        records and warns about SBUF beyond capacity instead (PSUM stays checked), "unchecked" only measures.

        Also sets :attr:`sbuf_peak`, :attr:`psum_peak_banks` (in program order) and
        :attr:`psum_reordered_banks`. Never-accessed allocations take no space (the compiler drops
        them).
        PSUM that overflows in program order is judged on the reordered schedule
        (:meth:`check_psum_reordered`).
        """
        _require_capacity("Memory.check", "capacity", capacity)
        strict, spills = capacity != "unchecked", capacity == "sbuf_spills"
        events = []  # (time, 0 = dies / 1 = becomes live, index, allocation); deaths first
        for i, a in enumerate(self.allocations):
            if a.first >= 0:
                events.append((a.first, 1, i, a))
                events.append((a.last + 1, 0, i, a))
        events.sort()
        sbuf_live: dict[int, Allocation] = {}
        psum_live: dict[int, Allocation] = {}
        placed: dict[int, tuple[int, int]] = {}  # live placed slots' byte spans: counted as their union
        auto_bytes = placed_bytes = psum_bound = 0  # psum_bound: sum of _bank_bound over the live PSUM tiles
        self.sbuf_peak = self.psum_peak_banks = self.sbuf_spill = self.psum_reordered_banks = 0
        for t, born, i, a in events:
            live = sbuf_live if a.buffer == "sbuf" else psum_live
            if not born:
                del live[i]
                if a.span is not None:
                    del placed[i]
                    placed_bytes = _union_bytes(placed.values())
                elif a.buffer == "sbuf":
                    auto_bytes -= a.nbytes
                else:
                    psum_bound -= _bank_bound(a.nbytes)
                continue
            live[i] = a
            if a.buffer == "sbuf":
                if a.span is not None:
                    placed[i] = a.span
                    placed_bytes = _union_bytes(placed.values())
                else:
                    auto_bytes += a.nbytes
                sbuf_bytes = auto_bytes + placed_bytes
                self.sbuf_peak = max(self.sbuf_peak, sbuf_bytes)
                if strict and sbuf_bytes > self.sbuf_capacity and spills:
                    if sbuf_bytes - self.sbuf_capacity > self.sbuf_spill:
                        self.sbuf_spill, self.sbuf_spill_at = sbuf_bytes - self.sbuf_capacity, t
                elif strict and sbuf_bytes > self.sbuf_capacity:
                    fail("SBUF overflow", "{used} bytes per partition live at instruction {t} "
                         "({op}), capacity {capacity}; becoming live: {new}; live allocations: "
                         "{live}", used=sbuf_bytes, t=t, op=self._op_at(t),
                         capacity=self.sbuf_capacity, new=a.describe(), live=_listing(sbuf_live))
                continue
            psum_bound += _bank_bound(a.nbytes)
            if psum_bound <= self.psum_peak_banks:  # cannot need more banks than the peak so far
                continue
            banks = _pack_banks([x.nbytes for x in psum_live.values()])
            self.psum_peak_banks = max(self.psum_peak_banks, len(banks))
            if strict and len(banks) > PSUM_BANKS and not self.psum_reordered_banks:
                self.psum_reordered_banks = self.check_psum_reordered()  # raises unless that fits
        if self.sbuf_spill:
            warnings.warn(SbufSpillWarning(
                f"SBUF spill: {self.sbuf_peak} bytes per partition live at the peak, "
                f"{self.sbuf_spill} more than the capacity {self.sbuf_capacity} (at instruction "
                f"{self.sbuf_spill_at}, {self._op_at(self.sbuf_spill_at)}); compiled with neuronx-cc's "
                "default allocation the excess goes to the HBM scratchpad (capacity='sbuf_spills')", self.sbuf_spill),
                stacklevel=2)
        if self.psum_reordered_banks:
            warnings.warn(PsumReorderWarning(
                f"PSUM: {self.psum_peak_banks} banks live at once in program order, "
                f"{self.psum_reordered_banks} with each PSUM read moved up to the instructions it depends on "
                "(neuronx-cc orders the instructions after tracing)", self.psum_peak_banks,
                self.psum_reordered_banks), stacklevel=2)
        self.check_accumulation_groups()

    def check_psum_reordered(self) -> int:
        """Raise at the first instruction where the live PSUM tiles need more than eight banks in
        the reordered schedule (module doc, "PSUM and the compiler's reordering"): a tile is live from
        its first access to the slot its last access moves up to. Returns the most banks needed."""
        events = []  # (slot, 0 = becomes live / 1 = dies, index, allocation); births first
        for i, a in enumerate(self.allocations):
            if a.buffer == "psum" and a.first >= 0:
                events.append(((a.first, 0, a.first), 0, i, a))
                ends = a.reach if a.reach is not None and a.reach[2] == a.last else (a.last, 0, a.last)
                events.append((ends, 1, i, a))
        events.sort(key=lambda e: e[:3])
        live: dict[int, Allocation] = {}
        peak = bound = 0  # bound: sum of _bank_bound over the live tiles
        for slot, dies, i, a in events:
            if dies:
                del live[i]
                bound -= _bank_bound(a.nbytes)
                continue
            live[i] = a
            bound += _bank_bound(a.nbytes)
            if bound <= peak:
                continue
            banks = _pack_banks([x.nbytes for x in live.values()])
            peak = max(peak, len(banks))
            if len(banks) > PSUM_BANKS:
                t = slot[0]
                fail("PSUM overflow", "{n} live PSUM tiles ({used} bytes per partition) need "
                     "{need} banks of {bank} bytes at instruction {t} ({op}), capacity {banks} "
                     "banks, also with every instruction that reads PSUM moved up to the last "
                     "instruction it depends on (nki.language.no_reorder: without it \"the compiler "
                     "scheduler is free to reorder independent operations\"); becoming live: {new}; "
                     "live allocations: {live}",
                     n=len(live), used=sum(x.nbytes for x in live.values()), need=len(banks), bank=PSUM_BANK_BYTES, t=t,
                     op=self._op_at(t), banks=PSUM_BANKS, new=a.describe(True),
                     live=_listing(live, reordered=True))
        return peak


def _union_bytes(spans: Any) -> int:
    """Bytes per partition covered by the byte ranges ``spans`` (placed slots that overlap count once)."""
    total = end = 0
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _listing(live: dict[int, Allocation], reordered: bool = False) -> str:
    items = sorted(live.values(), key=lambda a: -a.nbytes)
    return "; ".join(a.describe(reordered) for a in items)


_launch_counter = itertools.count()


@dataclass
class LaunchContext:
    """State shared by all program instances of one launch: the grid, ``shared_hbm`` storage."""

    grid: tuple[int, ...] = ()
    # k-th shared_hbm allocation of the launch (None once every program has it) and how many programs have it
    shared: list[Any] = field(default_factory=list)
    shared_fetches: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    barrier: threading.Barrier | None = None  # for core_barrier / sendrecv style ops
    mailbox: dict = field(default_factory=dict)  # sendrecv: (pipe_id, from, to) -> data
    seq: int = field(default_factory=_launch_counter.__next__)  # launch order, for the cost model
    # the device this launch runs on in a multi-rank run (collectives.run_ranks); None: a lone device
    rank: Any = None
    # the trace.Trace its instructions are recorded in: the recording open where the launch was made
    # (trace.record; a nested launch: its caller's); None: nothing records
    trace: Any = None

    @property
    def num_instances(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n


CAPACITY_MODES = ("checked", "sbuf_spills", "unchecked")  # LaunchRules.capacity


@dataclass(frozen=True)
class LaunchRules:
    """The rules a launch's kernel instances run under: the launch arguments of
    ``nki.simulate(kernel, strict=, capacity=, placement=)`` (:func:`trnkit.nkisim.jit.simulate`), which the
    returned kernel carries to every launch. Each kernel instance holds them in its :class:`KernelContext`
    (:attr:`KernelContext.rules`), where :meth:`Memory.check` and ``nl.ndarray`` read them. A launch made inside
    a running kernel (a grid launch of another jit kernel) is part of its caller and runs under the caller's
    rules; ``nki.collectives.run_ranks`` launches every rank under the rules of the kernel it is given.

    ``strict`` (default True): undefined behaviour on the hardware (LNC=2 programs taking different runtime
    control flow, ...) raises; False reports it as
    :class:`~trnkit.nkisim.controlflow.UndefinedBehaviourWarning` (a trnkit extension, for exploring kernels).
    Invalid uses raise either way.

    ``capacity``: what :meth:`Memory.check` does when a kernel instance's live tiles exceed SBUF or PSUM in
    program order.

    * ``"checked"`` (default): an SBUF overflow raises, and so does PSUM that overflows in program order and in
      the reordered schedule (module doc). trnkit's own kernels are held to this.
    * ``"sbuf_spills"``: SBUF beyond capacity is recorded (:attr:`Memory.sbuf_spill`) and warned about
      (:class:`SbufSpillWarning`), not raised; PSUM stays checked. How the compiler handles it: by default
      neuronx-cc, not NKI, allocates SBUF/PSUM and orders the instructions after NKI traces the kernel
      (``nki/deep-dives/nki-compile-config.rst``, Overview: "By default, neuronx-cc makes both decisions after
      NKI traces the kernel"; ``nki.compiler.Allocation.COLORING``: "allocates the tiles with graph coloring
      after it traces the kernel"), and the runtime gives every program an HBM scratchpad, "additional space
      used to store intermediary SBUF" (``neuron-runtime/explore/device-memory.rst``). A kernel whose live
      tiles exceed SBUF in program order therefore compiles: the allocator reorders or spills to the
      scratchpad (extra DMA the cost model does not price). Only NKI's own allocator (``Allocation.LINEAR``)
      fails "out of memory" instead. The conformance run launches AWS's kernels this way. PSUM cannot spill
      (matmuls write only PSUM).
    * ``"unchecked"``: neither SBUF nor PSUM overflow raises; the peaks are still recorded (the accumulation
      groups stay checked). For published kernels that compile on Trainium although their tiles overflow in
      program order (the compiler schedules or spills them; the liveness model does not): the calibration's
      ports of the kernel-optimization tutorial. trnkit's own kernels never use it.

    ``placement`` (default True): ``nl.ndarray(..., address=)`` on SBUF / PSUM places the tile on those bytes of
    the kernel instance's memory (tensor.py, "manual placement"). False gives each placed tile storage of its
    own, as if unplaced: a trnkit diagnostic, not a model of anything; the conformance run uses it to check that
    a mismatch of a kernel that read overwritten placed tiles (:class:`PlacedTileOverwrittenWarning`) comes
    from those reads.

    ``trace_only`` (default False): a launch for the cost model, which needs the instruction trace and not the
    results. ``nc_matmul`` calls of 128 x 128 x 128 multiply-adds or more skip their arithmetic (a fresh
    accumulation reads as zeros; shapes, rules, operand reads and the trace are as in a full run), and a DMA
    whose computed address (from such results) falls out of bounds is skipped instead of raising, traced at its
    full size. The launch's outputs are not meaningful. ``trace.record(trace_only=True)`` sets it for the
    launches made inside its block (the cost-model callers: ``trnkit.bench`` and the calibration); the
    trace is identical to a full run's wherever the skipped values do not steer the kernel
    (``tests/nkisim/test_trace_only.py``, ``tests/test_bench.py``)."""

    strict: bool = True
    capacity: str = "checked"
    placement: bool = True
    trace_only: bool = False

    def __post_init__(self) -> None:
        for name in ("strict", "placement", "trace_only"):
            value = getattr(self, name)
            require(isinstance(value, bool), "nki.simulate", "argument {name} must be True or False, got "
                    "{value!r}", name=name, value=value)
        _require_capacity("nki.simulate", "argument capacity", self.capacity)


def _require_capacity(op: str, name: str, value: Any) -> None:
    require(value in CAPACITY_MODES, op, "{name} must be one of {allowed}, got {value!r}", name=name,
            allowed=", ".join(map(repr, CAPACITY_MODES)), value=value)


@dataclass
class KernelContext:
    """One kernel instance: its program id, its on-chip memory, its launch and the rules it runs under."""

    program_id: tuple[int, ...] = ()
    launch: LaunchContext = field(default_factory=LaunchContext)
    memory: Memory = field(default_factory=Memory)
    shared_count: int = 0  # shared_hbm allocations made so far by this instance
    placed: dict = field(default_factory=dict)  # buffer name -> tensor.PlacementSpace (manual placement)
    collective_seq: int = 0  # nki.collectives calls made so far by this instance
    flat_program_id: int = 0
    rules: LaunchRules = field(default_factory=LaunchRules)  # its launch's (jit.simulate's arguments)
    program: Any = None  # its controlflow.Program (runtime control-flow record); None: not launched by jit
    # engine name -> isa.vector.Accumulators: the reduce_cmd accumulation registers of this instance's
    # Vector / Scalar Engine (each core has its own; a launch starts with none set)
    accumulators: dict = field(default_factory=dict)


_tls = threading.local()


class PsumReorderWarning(RuntimeWarning):
    """A kernel instance's PSUM tiles overflow the eight banks in program order and fit once each PSUM
    read moves up to the instructions it depends on (module doc): ``program_order`` and ``reordered``
    are the banks needed at the peak."""

    def __init__(self, message: str, program_order: int = 0, reordered: int = 0) -> None:
        super().__init__(message)
        self.program_order = program_order
        self.reordered = reordered


class SbufSpillWarning(RuntimeWarning):
    """A kernel instance launched with ``capacity="sbuf_spills"`` (:class:`LaunchRules`) needed more SBUF in
    program order than the capacity; ``excess``: the most bytes per partition over the capacity."""

    def __init__(self, message: str, excess: int = 0) -> None:
        super().__init__(message)
        self.excess = excess


def running() -> KernelContext | None:
    """The kernel instance running on this thread; None outside any kernel."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


def current() -> KernelContext:
    """The kernel instance running on this thread (a per-thread default outside any kernel)."""
    ctx = running()
    if ctx is not None:
        return ctx
    default = getattr(_tls, "default", None)
    if default is None:  # outside any kernel: no liveness records (see the module doc)
        default = _tls.default = KernelContext(memory=Memory(track=False))
    return default


def push_context(ctx: KernelContext) -> None:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(ctx)


def pop_context() -> None:
    _tls.stack.pop()


def tick(op: str) -> None:
    """The instruction ``op`` of the current kernel instance is done (called by every ISA op)."""
    current().memory.tick(op)


class PlacedTileOverwrittenWarning(RuntimeWarning):
    """An instruction read a manually placed tile (``nl.ndarray(..., address=)``) after another tile placed on
    overlapping bytes was written: the bytes are shared, so it read the other tile's data, as a device does.
    Not an error: no NKI doc calls it invalid, and a kernel may mean it; it is almost always an allocation that
    gave two live tiles one slot. Once per tile and overwrite."""


# the parameters through which an nki.isa instruction writes (every other tensor argument is read)
_WRITTEN_PARAMS = frozenset(("dst", "dst_idx", "reduce_res"))


def _placed_operands(params: tuple[str, ...], args: tuple, kwargs: dict) -> tuple[list, list]:
    """The storages of the placed tiles an instruction reads and writes (tensor.PlacedStorage: those with a
    ``space``), from its arguments by parameter name; lists and tuples of tensors are read."""
    reads, writes = [], []
    for key, value in itertools.chain(zip(params, args), kwargs.items()):
        for v in value if isinstance(value, (list, tuple)) else (value,):
            st = getattr(v, "_st", None)
            if getattr(st, "space", None) is not None:
                (writes if key in _WRITTEN_PARAMS else reads).append(st)
    return reads, writes


def _report_overwritten(reads: list, instr: str) -> None:
    for st in reads:
        if st.overwritten is not None:
            tile, by = st.overwritten
            p0, p1, b0, b1 = st.rect
            warnings.warn(PlacedTileOverwrittenWarning(
                f"{instr} reads placed tile {st.name!r} ({st.buffer.name} partitions [{p0}, {p1}), bytes [{b0}, "
                f"{b1})) after {by} wrote tile {tile!r} over its bytes: placed tiles share their bytes "
                "(nl.ndarray address=), so it reads that tile's data, as a device does"), stacklevel=4)
            st.overwritten = None  # reported: once per overwrite (PlacementSpace.written sets it again)


def instruction(fn: Any) -> Any:
    """Make ``fn`` (a public ``nki.isa`` function) one instruction for liveness: the clock advances
    when it returns or raises, whatever path it took (traced or not, skipped DMA, ...). In a kernel
    instance that places tiles, it also reports reads of placed tiles another tile overwrote
    (:class:`PlacedTileOverwrittenWarning`) and records its writes of placed tiles."""
    name = fn.__name__
    params = tuple(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        ctx = current()
        mem = ctx.memory
        mem.running = name
        placed = _placed_operands(params, args, kwargs) if ctx.placed else None
        if placed:
            _report_overwritten(placed[0], name)
        try:
            out = fn(*args, **kwargs)
        finally:
            mem = current().memory  # (the same unless fn pushed a context)
            mem.running = "access"
            mem.tick(name)
        for st in placed[1] if placed else ():
            st.space.written(st, name)
        return out
    return run
