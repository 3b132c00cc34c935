"""The runtime control flow of a kernel program, and the rules NKI sets on it.

Each program instance of a launch (one ``@nki.jit`` call, or each program of ``kernel[2]``) runs with
a :class:`Program` record on its thread. It holds:

* the **runtime loops** being executed (``nl.fori_loop``, ``nl.while_loop``, ``nl.dynamic_range``:
  loops the compiler lowers to one hardware loop instruction, not unrolled), as a stack of
  :class:`Frame` objects with their current iteration. A *position* is the tuple of
  ``(frame, iteration)`` pairs active at a moment; registers and tensors remember the position they
  were produced at, so a value can be checked against the loop iteration that made it;
* the **control-flow events** in program order: each runtime loop with its trip count, each
  cross-core synchronisation (``core_barrier``, ``sendrecv``, collectives) with its arguments, each
  annotated with the instructions issued so far. An LNC=2 launch compares the two programs' events
  (:func:`compare`);
* ``strict``: whether undefined behaviour raises (default) or warns (:func:`undefined`).

The rules, with the NKI documentation they come from, are in the functions that check them:
:func:`check_register_read` (no loop state in registers), :meth:`Program.check_operands` (no tensor
used outside the loop iteration that allocated it), :func:`loop_body_result` (a ``fori_loop`` body
returns nothing), :func:`compare` (LNC=2 programs take the same runtime control flow).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import memory as _memory
from .errors import NkiValidationError, fail
from .tensor import NkiTensor, VirtualRegister

__all__ = ["Frame", "Program", "Register", "current", "undefined", "loop", "sync_event",
           "check_register_read", "write_register", "allocated", "loop_body_result", "compare",
           "instruction", "Rendezvous", "Turnstile", "parked", "UndefinedBehaviourWarning",
           "MIGRATION_LOOP_RULES", "LNC_DOC"]

# The migration guide's list for the runtime loops of NKI 0.6 (aws-neuron-sdk nki/migration/index.rst,
# "Migrating from NKI 0.5.0 to NKI 0.6.0", "Rules for migrated loops").
MIGRATION_LOOP_RULES = 'NKI 0.6 migration guide, "Rules for migrated loops"'
# nki/get-started/about/lnc.rst "Final Notes" and the NKI 0.3.0 release notes' known issues (Multi-Core).
LNC_DOC = ('NKI LNC guide (nki/get-started/about/lnc.rst, "Final Notes"): "if you use dynamic control '
           'flow, and this control-flow is different on the different cores, then the behavior is '
           'undefined"; NKI 0.3.0 known issues: "Programs with dynamic control flow that differs across '
           'cores may deadlock or produce incorrect results"')

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class UndefinedBehaviourWarning(RuntimeWarning):
    """Undefined behaviour on the hardware, reported as a warning under ``strict=False``."""


class Frame:
    """One execution of a runtime loop: its kind (``nl.fori_loop`` ...), call site and iteration."""

    __slots__ = ("kind", "site", "iteration", "active")

    def __init__(self, kind: str, site: str) -> None:
        self.kind = kind
        self.site = site
        self.iteration = -1  # before the first iteration
        self.active = True

    def describe(self, iteration: int) -> str:
        return f"{self.kind} at {self.site}, iteration {iteration}"

    def next_iteration(self) -> None:
        """The next iteration starts (the body is one block of code: nothing moves across it)."""
        self.iteration += 1
        _memory.current().memory.fence()


@dataclass(frozen=True)
class Event:
    """One control-flow step compared between the programs of an LNC=2 launch."""

    what: str  # "nl.fori_loop", "core_barrier", ...
    site: str  # file:line in the kernel
    detail: str  # "107 iterations", "pipe_id=0 send_to_rank=1 ..."
    instructions: int  # instructions this program had issued when the event happened

    def describe(self) -> str:
        return f"{self.what} at {self.site} ({self.detail}; after {self.instructions} instructions)"


class Program:
    """The runtime control flow of one program instance (see the module doc)."""

    def __init__(self, program_id: int = 0, strict: bool = True) -> None:
        self.program_id = program_id
        self.strict = strict
        self.frames: list[Frame] = []
        self.events: list[Event] = []
        self.counts: Counter = Counter()  # instructions issued, per op
        self.scoped: dict[int, tuple] = {}  # storage key -> position, tensors allocated in loop bodies
        self.no_reorder = 0  # depth of nl.no_reorder() blocks
        self.turnstile: Turnstile | None = None  # the launch's lockstep, with several programs
        self.slot = program_id  # this program's place in it

    def position(self) -> tuple:
        return tuple((f, f.iteration) for f in self.frames)

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())

    def check_operands(self, op: str, args: tuple, kwargs: dict) -> None:
        """No operand of ``op`` may be a tensor allocated in another iteration of a runtime loop, or
        in a loop that has ended.

        Migration guide, "Rules for migrated loops": "Tensors (``nl.ndarray``) declared inside a body
        function cannot be referenced outside of the loop. Any tensor that needs to be used outside of
        the body function must be declared outside the body." (The body is traced once, so a tensor of
        another iteration does not exist on the device either.)
        """
        for role, value in list(enumerate(args)) + list(kwargs.items()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for t in items:
                if isinstance(t, NkiTensor):
                    born = self.scoped.get(t._st.key)
                    if born is not None:
                        crossed = _crossed(born)
                        if crossed is not None:
                            fail(op, "{role} {name!r} was allocated in {where} and is used {when}; "
                                 "tensors declared in a runtime loop body cannot be referenced outside "
                                 "of it ({doc}: declare it outside the body)",
                                 role=role if isinstance(role, str) else f"argument {role}",
                                 name=t.name, where=crossed[0], when=crossed[1],
                                 doc=MIGRATION_LOOP_RULES)


def current() -> Program | None:
    """The program record of the kernel instance running on this thread (``memory.KernelContext.program``;
    None outside any kernel)."""
    ctx = _memory.running()
    return None if ctx is None else ctx.program


def undefined(op: str, rule: str, /, **values: Any) -> None:
    """Undefined behaviour on the hardware: raise :class:`NkiValidationError` (default), or warn
    when the launch runs with ``strict=False``."""
    program = current()
    _undefined(program is None or program.strict, 4, op, rule, **values)


def _undefined(strict: bool, stacklevel: int, op: str, rule: str, /, **values: Any) -> None:
    """:func:`undefined` under ``strict`` (the program's), the warning at ``stacklevel`` from here."""
    if strict:
        fail(op, rule, **values)
    try:
        fail(op, rule, **values)
    except NkiValidationError as exc:
        warnings.warn(f"{exc} [undefined behaviour, strict=False]", UndefinedBehaviourWarning,
                      stacklevel=stacklevel)


def user_site() -> str:
    """``file:line`` of the innermost caller outside the interpreter package."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PACKAGE_DIR):
        f = f.f_back
    if f is None:
        return "<interpreter>"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _crossed(born: tuple) -> tuple[str, str] | None:
    """Where a value produced at position ``born`` was made and how it left that loop iteration, or
    None when the current position is inside it (same iteration, or deeper)."""
    for frame, iteration in born:
        if not frame.active:
            return frame.describe(iteration), f"after that {frame.kind} ended"
        if frame.iteration != iteration:
            return frame.describe(iteration), f"in iteration {frame.iteration}"
    return None


class Register(VirtualRegister):
    """A :class:`VirtualRegister` that remembers the loop position its value was produced at.

    Reading it (``.value``: a register instruction, a loop bound, an ``.ap(scalar_offset=reg)`` being
    used) checks :func:`check_register_read`. ``loop_var`` names the loop whose variable it is
    (read-only).
    """

    __slots__ = ("_value", "made", "loop_var")

    def __init__(self, value: int = 0, loop_var: str = "") -> None:
        program = current()
        self.made = program.position() if program is not None else ()
        self.loop_var = loop_var
        self._value = int(value)

    @property
    def value(self) -> int:  # type: ignore[override]
        if self.made:
            check_register_read(self)
        return self._value

    @value.setter
    def value(self, v: int) -> None:
        self._value = int(v)

    def __repr__(self) -> str:
        return f"VirtualRegister({self._value})"


def check_register_read(reg: Register) -> None:
    """A register value produced inside a runtime-loop iteration is read only inside it.

    Migration guide, "Rules for migrated loops": "Keep cross-iteration state in SBUF or HBM. Carry
    running values (accumulators, counters, running max/sum) in SBUF/HBM and update them in place,
    rather than passing them between iterations"; ``nl.fori_loop`` docstring: "carry any other loop
    state through SBUF/HBM"; NKI 0.4.0 known issue: "Nested nl.dynamic_range loops with loop-carried
    values fail to compile with a 'Could not find register' error". So a value written into a register
    in one iteration and read in a later one, or after the loop, is refused.
    """
    crossed = _crossed(reg.made)
    if crossed is not None:
        fail("VirtualRegister", "register {reg} was written in {where} and is read {when}: loop state "
             "carried in a register across runtime-loop iterations ({doc}: \"Keep cross-iteration "
             "state in SBUF or HBM\"; nl.fori_loop: \"carry any other loop state through SBUF/HBM\")",
             reg=f"VirtualRegister({reg._value})", where=crossed[0], when=crossed[1],
             doc=MIGRATION_LOOP_RULES)


def write_register(op: str, reg: VirtualRegister) -> None:
    """``op`` writes ``reg``: a loop variable is read-only; otherwise remember where it was written.

    Migration guide, "Rules for migrated loops": "The loop variable is read-only. Do not write to it";
    NKI 0.4.0 release notes: writing the induction variable of ``nl.dynamic_range`` "now raise[s]
    AssertionError at trace time".
    """
    if isinstance(reg, Register):
        if reg.loop_var:
            fail(op, "cannot write the loop variable of {loop} (VirtualRegister({value})): the loop "
                 "variable is read-only ({doc})", loop=reg.loop_var, value=reg._value,
                 doc=MIGRATION_LOOP_RULES)
        program = current()
        reg.made = program.position() if program is not None else ()


def allocated(t: NkiTensor) -> NkiTensor:
    """Remember that ``t`` (just allocated) belongs to the current runtime-loop iteration, if any."""
    program = current()
    if program is not None and program.frames:
        program.scoped[t._st.key] = program.position()
    return t


def sync_event(op: str, detail: str, counted: bool = True) -> None:
    """Record a cross-core synchronisation (barrier, send/receive, collective) of this program;
    ``counted``: the call is an ``nki.isa`` instruction, already counted by :func:`instruction`."""
    program = current()
    if program is not None:
        program.events.append(Event(op, user_site(), detail, program.instructions - int(counted)))
    _memory.current().memory.pin(fence=True)  # nothing moves across a synchronisation (memory.py)


class loop:  # noqa: N801 - used as `with loop(kind, trips):`
    """``with loop(kind, trips) as frame:`` runs one runtime loop; the caller advances
    ``frame.iteration``. ``trips`` is None when unknown up front (``while_loop``: recorded at the end)."""

    def __init__(self, kind: str, trips: int | None) -> None:
        self.program = current()
        self.frame = Frame(kind, user_site())
        self.trips = trips
        if self.program is not None:
            if self.program.no_reorder:
                fail(kind, "runtime loops cannot sit inside an nl.no_reorder() block ({doc}; NKI "
                     "dynamic loops guide: dynamic loops inside no_reorder \"are not currently "
                     "supported\")", doc=MIGRATION_LOOP_RULES)

    def __enter__(self) -> Frame:
        if self.program is not None:
            if self.trips is not None:
                self._event(self.trips)
            self.program.frames.append(self.frame)
        _memory.current().memory.fence()  # the compiler reorders inside a loop body only (memory.py)
        return self.frame

    def _event(self, trips: int) -> None:
        self.program.events.append(Event(self.frame.kind, self.frame.site, f"{trips} iterations",
                                         self.program.instructions))

    def __exit__(self, *exc: Any) -> None:
        self.frame.active = False
        _memory.current().memory.fence()
        if self.program is not None:
            self.program.frames.pop()
            if self.trips is None and exc[0] is None:
                self._event(self.frame.iteration + 1)


def loop_body_result(kind: str, result: Any) -> None:
    """An ``nl.fori_loop`` body returns nothing.

    Migration guide, "Rules for migrated loops": "The fori_loop body function cannot return a value";
    ``nl.fori_loop`` docstring: ``body_fun`` is "function (i) -> None".
    """
    if result is not None:
        fail(kind, "the body function returned {value!r}; a fori_loop body cannot return a value "
             "({doc}); keep loop state in SBUF/HBM", value=result, doc=MIGRATION_LOOP_RULES)


def compare(programs: list[Program]) -> None:
    """The two programs of an LNC=2 launch took the same runtime control flow: the same runtime loops
    with the same trip counts and the same cross-core synchronisations, in the same order.

    Undefined otherwise (:data:`LNC_DOC`), so it raises (warns under ``strict=False``) at the first
    event where they differ. Instruction counts outside runtime loops may differ: code specialised per
    core by Python ``if``/``for`` compiles to per-core instruction streams (the LNC guide: "A NEFF
    compiled for LNC=2 contains PNC-specific instructions for each of the two PNCs"), and AWS's tested
    cascaded_max kernel issues 28 and 26 DMAs on its two cores at x[5, 5, 8192]; the message reports
    the counts at the point of difference.
    """
    a, b = programs[0], programs[1]
    for i in range(max(len(a.events), len(b.events))):
        ea = a.events[i] if i < len(a.events) else None
        eb = b.events[i] if i < len(b.events) else None
        if ea is not None and eb is not None and (ea.what, ea.site, ea.detail) == (eb.what, eb.site, eb.detail):
            continue
        # raises, or warns under the launch's strict=False
        _undefined(a.strict, 3, "LNC=2 divergence", "the two programs take different runtime control flow "
                   "at control-flow step {step}: program 0 runs {first}, program 1 runs {second} "
                   "(instructions issued by program 0: {counts0}; by program 1: {counts1}). {doc}",
                   step=i, first=ea.describe() if ea else "no further runtime loop or barrier",
                   second=eb.describe() if eb else "no further runtime loop or barrier",
                   counts0=_counts(a), counts1=_counts(b), doc=LNC_DOC)
        return


class Turnstile:
    """The programs of one grid launch issue their instructions in lockstep: round-robin, one
    instruction each in turn (``quantum`` instructions with another quantum), so two programs with
    the same control flow issue their k-th instructions together, as two cores started together run
    them. The LNC guide launches an LNC=2 kernel "on multiple cores at the same time"
    (nki/get-started/about/lnc.rst, NKI 0.3 / Neuron SDK 2.28); core_barrier's docs give the one
    documented order between the cores' writes (a barrier after both have written).

    Exactly one program runs at a time (the *holder*; each program's thread waits at its own gate
    otherwise), so a launch is deterministic: the same launch always interleaves the same way. A
    program that waits at a synchronisation (:meth:`parked`: a ``core_barrier``, ``sendrecv``, a
    collective) leaves the rotation; when every program has come back from it the rotation restarts
    at program 0, so the programs' first instructions after a barrier are issued together too. A
    program that returns or raises leaves for good (:meth:`finish`); after a failure the others stop
    at their next instruction (``threading.BrokenBarrierError``, not reported: the failure is)."""

    def __init__(self, n: int, quantum: int = 1) -> None:
        if quantum < 1:
            fail("nki.jit", "the lockstep quantum must be a positive number of instructions, got {quantum}",
                 quantum=quantum)
        self.quantum = quantum
        self._mu = threading.Lock()
        self._gates = [threading.Lock() for _ in range(n)]  # locked: that program waits for its turn
        for g in self._gates:
            g.acquire()
        self._active = list(range(n))  # programs in the rotation, in id order
        self._parked: set[int] = set()  # waiting at a synchronisation
        self._pending: list[int] = []  # back from one, waiting for the others to come back too
        self._holder: int | None = 0
        self._issued = 0  # instructions the holder has issued in its quantum
        self.failed = False
        self._gates[0].release()

    def start(self, i: int) -> None:
        """Program ``i``'s thread begins: wait for its first turn."""
        self._gates[i].acquire()
        self._issued = 0

    def step(self, i: int) -> None:
        """Program ``i`` (the holder) is about to issue an instruction: after its quantum, pass the turn."""
        if self.failed:
            raise threading.BrokenBarrierError  # a peer failed: stop here (as at a broken barrier)
        self._issued += 1
        if self._issued <= self.quantum:
            return
        with self._mu:
            nxt = self._next(i)
            if nxt == i:  # alone in the rotation
                self._issued = 1
                return
            self._holder = nxt
            self._gates[nxt].release()
        self._gates[i].acquire()
        self._issued = 1
        if self.failed:
            raise threading.BrokenBarrierError

    @contextlib.contextmanager
    def parked(self, i: int) -> Iterator[None]:
        """Program ``i`` blocks inside (a barrier, a collective's exchange): the others take turns
        meanwhile. Back from it normally, it waits until every parked program is back (the rotation
        then restarts at the lowest id); back with an exception, it takes the next turn at once."""
        with self._mu:
            self._active.remove(i)
            self._parked.add(i)
            self._pass_turn(i)
        try:
            yield
        except BaseException:
            self._rejoin(i, regroup=False)
            raise
        self._rejoin(i, regroup=True)

    def finish(self, i: int, failed: bool = False) -> None:
        """Program ``i`` returned (or raised: ``failed``, and the others stop)."""
        with self._mu:
            self.failed = self.failed or failed
            if i in self._active:
                self._active.remove(i)
            self._parked.discard(i)
            if self._holder == i:
                self._pass_turn(i)

    def _next(self, i: int) -> int:
        later = [p for p in self._active if p > i]
        return later[0] if later else self._active[0]

    def _pass_turn(self, i: int) -> None:  # under _mu; ``i`` has left the rotation
        if not self._active and self._pending and not self._parked:
            self._active, self._pending = sorted(self._pending), []
        if self._active:
            self._holder = self._next(i)
            self._gates[self._holder].release()
        else:
            self._holder = None

    def _rejoin(self, i: int, regroup: bool) -> None:
        with self._mu:
            self._parked.discard(i)
            if self._holder is not None:  # the others are running: join the rotation
                self._active = sorted(self._active + [i])
            else:
                self._pending.append(i)
                if not (regroup and self._parked):  # every program is back (or this one failed)
                    self._active, self._pending = sorted(self._active + self._pending), []
                    self._holder = self._active[0]
                    self._gates[self._holder].release()
        self._gates[i].acquire()
        self._issued = 0


@contextlib.contextmanager
def parked() -> Iterator[None]:
    """The running program blocks inside (a synchronisation): its launch's other programs take
    turns meanwhile (:class:`Turnstile`). No-op outside a multi-program launch."""
    program = current()
    turnstile = program.turnstile if program is not None else None
    if turnstile is None:
        yield
    else:
        with turnstile.parked(program.slot):
            yield


class Rendezvous:
    """The barrier of a launch's programs (``core_barrier``, ``sendrecv``): ``threading.Barrier``'s
    ``wait`` / ``abort``, plus :meth:`finish` (a program returned), which breaks the barrier for a
    program waiting on one its peer never reaches instead of leaving it blocked; :func:`compare` then
    names the difference. A program waiting here leaves its launch's :class:`Turnstile` rotation."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self._cond = threading.Condition()
        self._waiting = 0
        self._generation = 0
        self._broken = False
        self._finished = 0

    def wait(self) -> None:
        with self._cond:
            if self._broken or self._finished:
                raise threading.BrokenBarrierError
        with parked():
            self._wait()

    def _wait(self) -> None:
        with self._cond:
            if self._broken or self._finished:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._waiting += 1
            if self._waiting == self.parties:
                self._waiting = 0
                self._generation += 1
                self._cond.notify_all()
                return
            while generation == self._generation and not self._broken and not self._finished:
                self._cond.wait()
            if generation == self._generation:  # not released: broken, or a peer has returned
                raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._finished += 1
            self._cond.notify_all()


def _counts(p: Program) -> str:
    top = ", ".join(f"{op} {n}" for op, n in p.counts.most_common(6))
    return f"{p.instructions} ({top})"


def instruction(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``fn`` (a public ``nki.isa`` instruction) counted in its program's record, and check its
    operands against the runtime loop that allocated them (:meth:`Program.check_operands`)."""
    name = fn.__name__

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        program = current()
        if program is not None:
            if program.turnstile is not None:  # several programs: issue in lockstep
                program.turnstile.step(program.slot)
            program.counts[name] += 1
            if program.scoped:
                program.check_operands(name, args, kwargs)
            if program.no_reorder:  # kept in program order (memory.py, the reordered schedule)
                _memory.current().memory.pin(fence=True)
        return fn(*args, **kwargs)
    return run


def iterate(kind: str, values: range, loop_var: bool = True) -> Iterator[Register]:
    """The iterations of a counted runtime loop: one fresh register per value (passed by value)."""
    with loop(kind, len(values)) as frame:
        for i in values:
            frame.next_iteration()
            yield Register(i, loop_var=kind if loop_var else "")
