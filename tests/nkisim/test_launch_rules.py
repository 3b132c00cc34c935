"""The launch rules (memory.LaunchRules): ``nki.simulate(kernel, strict=, capacity=, placement=)`` sets them
for every launch of the returned kernel, each kernel instance carries them in its context, and a launch made
inside a running kernel (an inlined call, a grid launch, or each rank of ``nki.collectives.run_ranks``) runs
under the rules it is given by its caller, not under anything module-wide. ``placement`` is tested in
test_placement.py (placed tiles sharing bytes see each other's writes, or not), the PSUM side of ``capacity``
in test_sbuf_spills.py."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import collectives as ncc
from trnkit.nkisim import controlflow
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import memory
from trnkit.nkisim.errors import NkiValidationError

# two [128, 30,720] fp32 tiles, 122,880 bytes per partition each, live together from instruction 1 (the second
# memset): 245,760 bytes, 32,768 more than the usable 212,992 (208 KiB)
TWO_TILES, CAPACITY = 2 * 30 * 1024 * 4, memory.SBUF_USABLE_BYTES
OVERFLOW = (r"SBUF overflow: 245760 bytes per partition live at instruction 1 \(memset\), capacity 212992")

contexts: list[memory.KernelContext] = []  # the instances of two_big, as they ran


@nki.jit
def two_big(x):
    """out[p, 0] = 1 + 2: read from two 120 KiB tiles live at once."""
    contexts.append(memory.current())
    a = nl.ndarray((128, 30 * 1024), nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((128, 30 * 1024), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=a, value=1.0)
    nisa.memset(dst=b, value=2.0)
    nisa.tensor_tensor(dst=a[:, 0:1], data1=a[:, 0:1], data2=b[:, 0:1], op=nl.add)
    out = nl.ndarray((128, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a[:, 0:1])
    return out


def _x() -> np.ndarray:
    return np.zeros((128, 1), np.float32)


def _spills(caught: list) -> list[int]:
    return [w.message.excess for w in caught if issubclass(w.category, memory.SbufSpillWarning)]


def test_capacity_checked_is_the_default_and_raises_at_the_overflow():
    assert TWO_TILES - CAPACITY == 32768
    with pytest.raises(NkiValidationError, match=OVERFLOW):
        two_big(_x())
    with pytest.raises(NkiValidationError, match=OVERFLOW):
        nki.simulate(two_big, capacity="checked")(_x())


def test_capacity_sbuf_spills_warns_with_the_excess_and_runs():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nki.simulate(two_big, capacity="sbuf_spills")(_x())
    np.testing.assert_array_equal(out, np.full((128, 1), 3.0, np.float32))
    assert _spills(caught) == [32768]
    assert "245760 bytes per partition live at the peak, 32768 more than the capacity 212992 (at instruction 1, " \
        "memset)" in str(caught[0].message)
    assert contexts[-1].memory.sbuf_spill == 32768 and contexts[-1].rules.capacity == "sbuf_spills"


def test_capacity_unchecked_runs_silently_and_records_the_peak():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = nki.simulate(two_big, capacity="unchecked")(_x())
    np.testing.assert_array_equal(out, np.full((128, 1), 3.0, np.float32))
    assert contexts[-1].memory.sbuf_peak == TWO_TILES and contexts[-1].memory.sbuf_spill == 0


def test_the_kernel_simulate_returns_keeps_its_rules_on_every_grid_and_call():
    unchecked = nki.simulate(two_big, capacity="unchecked", placement=False, strict=False)
    assert unchecked[2].rules == memory.LaunchRules(strict=False, capacity="unchecked", placement=False)
    for _ in range(2):
        np.testing.assert_array_equal(unchecked[2](_x()), np.full((128, 1), 3.0, np.float32))
    assert two_big.rules == memory.LaunchRules()  # the kernel it was made from is unchanged


@nki.jit
def calls_two_big(x, how):
    """Runs two_big inside this kernel: inlined (a plain call), or as a grid launch of 1 or 2 programs."""
    if how == "inline":
        return two_big(x)
    return two_big[int(how[-1])](x)


@pytest.mark.parametrize("how", ["inline", "grid 1", "grid 2"])
def test_a_launch_inside_a_running_kernel_runs_under_its_callers_rules(how):
    with pytest.raises(NkiValidationError, match=OVERFLOW):
        calls_two_big(_x(), how)
    del contexts[:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nki.simulate(calls_two_big, capacity="sbuf_spills")(_x(), how)
    np.testing.assert_array_equal(np.asarray(out), np.full((128, 1), 3.0, np.float32))
    programs = 2 if how == "grid 2" else 1
    assert _spills(caught) == [32768] * programs
    assert [c.rules.capacity for c in contexts] == ["sbuf_spills"] * programs


@pytest.mark.parametrize("how", ["inline", "grid 1", "grid 2"])
def test_a_one_program_launch_inside_a_kernel_is_part_of_its_callers_program(how):
    """Each kernel instance holds its control-flow record (``KernelContext.program``, the one
    ``controlflow.current()`` gives while it runs): an inlined call and a grid-1 launch inside a kernel count
    their instructions in the caller's record, a grid-2 launch runs two records of its own."""
    callers = []

    @nki.jit
    def records_and_calls(x, how):
        callers.append((memory.current(), controlflow.current()))
        return calls_two_big(x, how)

    del contexts[:]
    nki.simulate(records_and_calls, capacity="unchecked")(_x(), how)
    (caller, running), = callers
    assert caller.program is running and running is not None
    inner = [c.program for c in contexts]
    if how == "grid 2":
        assert len(inner) == 2 and inner[0] is not inner[1] and caller.program not in inner
        assert caller.program.counts["memset"] == 0 and [p.counts["memset"] for p in inner] == [2, 2]
    else:
        assert inner == [caller.program]
        assert caller.program.counts["memset"] == 2


def test_the_caller_rules_win_over_the_inner_kernels_own():
    """A grid launch inside a kernel is part of that kernel: an inner kernel made unchecked by nki.simulate is
    checked when a checked kernel launches it."""
    inner = nki.simulate(two_big, capacity="unchecked")

    @nki.jit
    def calls_inner(x):
        return inner[2](x)

    with pytest.raises(NkiValidationError, match=OVERFLOW):
        calls_inner(_x())


def test_run_ranks_launches_every_rank_and_program_under_the_kernels_rules():
    with pytest.raises(NkiValidationError, match=OVERFLOW):
        ncc.run_ranks(two_big, 2, lambda r: {"x": _x()}, grid=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = ncc.run_ranks(nki.simulate(two_big, capacity="sbuf_spills"), 2, lambda r: {"x": _x()}, grid=2)
    for out in outs:
        np.testing.assert_array_equal(out, np.full((128, 1), 3.0, np.float32))
    assert _spills(caught) == [32768] * 4  # 2 ranks x 2 programs


def test_two_launches_at_once_keep_their_own_rules():
    """An unchecked launch is running (parked inside its kernel) while another thread launches the same kernel
    checked: the second raises. (A module-wide switch set around the first launch would let it pass.)"""
    started, done = threading.Event(), threading.Event()

    @nki.jit
    def waits(x, park):
        out = two_big(x)
        if park:
            started.set()
            assert done.wait(timeout=60)
        return out

    got = {}

    def unchecked() -> None:
        got["unchecked"] = nki.simulate(waits, capacity="unchecked")(_x(), True)

    thread = threading.Thread(target=unchecked)
    thread.start()
    try:
        assert started.wait(timeout=60)
        with pytest.raises(NkiValidationError, match=OVERFLOW):
            nki.simulate(waits, capacity="checked")(_x(), False)
    finally:
        done.set()
        thread.join()
    np.testing.assert_array_equal(got["unchecked"], np.full((128, 1), 3.0, np.float32))


@pytest.mark.parametrize("arg, value, message", [
    ("capacity", "spill", "argument capacity must be one of 'checked', 'sbuf_spills', 'unchecked', got 'spill'"),
    ("capacity", None, "argument capacity must be one of 'checked', 'sbuf_spills', 'unchecked', got None"),
    ("placement", "off", "argument placement must be True or False, got 'off'"),
    ("strict", 0, "argument strict must be True or False, got 0"),
])
def test_a_bad_rule_raises_naming_the_argument_the_allowed_values_and_the_value(arg, value, message):
    with pytest.raises(NkiValidationError, match=f"^nki.simulate: {message}$"):
        nki.simulate(two_big, **{arg: value})
