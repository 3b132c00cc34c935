"""The programs of a grid launch run in lockstep (controlflow.Turnstile): one instruction each in turn,
as two cores started together issue them; deterministic; barriers and failures release the turn."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import collectives as ncc
from trnkit.nkisim import controlflow
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim.errors import NkiValidationError

RNG = np.random.default_rng(22)


@nki.jit
def zero_fill_then_rows(x):
    """nki-library's folded_load_store_dst_kernel pattern (test_cascaded_max_utils.py): every core
    zero-fills the whole shared output, then writes its own half of the rows, with no barrier."""
    rows, n = x.shape
    out = nl.ndarray((rows, n), dtype=x.dtype, buffer=nl.shared_hbm)
    zeros = nl.ndarray((rows, n), dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(zeros, 0)
    nisa.dma_copy(dst=out, src=zeros)
    pid, half = nl.program_id(0), rows // nl.num_programs(0)
    mine = nl.ndarray((half, n), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x[pid * half : (pid + 1) * half, :])
    nisa.dma_copy(dst=out[pid * half : (pid + 1) * half, :], src=mine)
    return out


def test_zero_fill_then_per_core_rows_gives_the_concurrent_result():
    # Run core after core, core 1's zero fill (its 2nd instruction) would erase the rows core 0 wrote
    # (its 4th): the result would be zeros in rows 0-7. In lockstep both fills land first.
    x = RNG.standard_normal((16, 64)).astype(np.float32)
    np.testing.assert_array_equal(zero_fill_then_rows[2](x), x)
    np.testing.assert_array_equal(zero_fill_then_rows(x), x)  # one program: unchanged


def _probe(order: list, counts: tuple[int, ...], barrier_after: int | None = None):
    """A kernel whose program p issues counts[p] memsets (a core_barrier after the first
    ``barrier_after`` of each), appending (p, k) to ``order`` after its k-th."""

    @nki.jit
    def probe(x):
        out = nl.ndarray((2, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        pid = nl.program_id(0)
        t = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        for k in range(counts[pid]):
            if k == barrier_after:
                nisa.core_barrier(out, (0, 1))
                order.append((pid, "barrier"))
            nisa.memset(t, k)
            order.append((pid, k))
        nisa.dma_copy(dst=out[pid : pid + 1, :], src=t)
        return out

    return probe


def test_programs_issue_their_kth_instructions_together():
    order: list = []
    _probe(order, (3, 5))[2](np.zeros(1, np.float32))
    # one instruction each in turn; program 1 goes on alone once program 0 has returned
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (1, 4)]


def test_after_a_barrier_the_rotation_restarts_at_program_0():
    order: list = []
    # program 1 reaches the barrier last; after it program 0 issues first again (the Python code
    # between the barrier and a program's next instruction runs in that program's turn)
    _probe(order, (3, 3), barrier_after=1)[2](np.zeros(1, np.float32))
    assert order == [(0, 0), (1, 0), (0, "barrier"), (0, 1), (1, "barrier"), (1, 1), (0, 2), (1, 2)]


@nki.jit
def last_writer(x, delay0, delay1):
    """Both cores write their id into the same shared element, core p after ``delay_p`` other
    instructions: a cross-core write-write race (no barrier)."""
    out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    t = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    for _ in range(delay1 if pid else delay0):
        nisa.memset(t, -1.0)
    nisa.memset(t, float(pid))
    nisa.dma_copy(dst=out, src=t)
    return out


@pytest.mark.parametrize(("delays", "winner"), [((0, 0), 1), ((2, 0), 0), ((0, 3), 1), ((5, 4), 0)])
def test_a_racy_kernel_gives_the_same_result_every_time(delays, winner):
    # the later write in issue order lands last; equal positions: program 1 after program 0
    x = np.zeros(1, np.float32)
    results = {float(last_writer[2](x, *delays)[0, 0]) for _ in range(40)}
    assert results == {float(winner)}


def test_a_failing_program_stops_the_other_and_its_error_is_raised():
    issued: list = []

    @nki.jit
    def fails_early(x):
        pid = nl.program_id(0)
        t = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        for k in range(200):
            if pid == 1 and k == 2:
                nl.ndarray((129, 4), nl.float32, buffer=nl.sbuf)  # partition dim over 128
            nisa.memset(t, k)
            issued.append(pid)
        return x

    with pytest.raises(NkiValidationError, match="partition dim 129 exceeds pmax") as e:
        fails_early[2](np.zeros(4, np.float32))
    assert any("program (1,)" in n for n in getattr(e.value, "__notes__", []))
    # program 0 was waiting to issue its 3rd instruction when program 1 failed: it stops there
    assert issued == [0, 1, 0, 1]


def test_a_barrier_only_one_program_reaches_still_raises_without_hanging():
    @nki.jit
    def one_sided(x):
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 0.0)
        if nl.program_id(0) == 0:
            nisa.core_barrier(out, (0, 1))
        for _ in range(3):
            nisa.memset(t, 1.0)
        return out

    with pytest.raises(NkiValidationError, match="LNC=2 divergence"):
        one_sided[2](np.zeros(1, np.float32))


def test_collectives_release_the_turn_and_stay_deterministic():
    # 2 ranks x LNC 2: each program writes its id, then after an all-reduce the element holds the
    # last writer's in issue order; four programs block in the exchange together.
    groups = [[0, 1]]

    @nki.jit
    def reduce_then_race(x):
        s = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        d = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[x], dsts=[d], replica_group=ncc.ReplicaGroup(groups), op=nl.add)
        pid = nl.program_id(0)
        t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=d)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(pid))
        nisa.dma_copy(dst=s, src=t)
        return s

    for _ in range(10):
        outs = ncc.run_ranks(reduce_then_race, 2, lambda r: {"x": np.full((1, 4), r + 1.0, np.float32)}, grid=2)
        for o in outs:
            np.testing.assert_array_equal(o, np.full((1, 4), 3.0 + 1.0))  # program 1's write lands last


def test_turnstile_quantum_must_be_positive():
    with pytest.raises(NkiValidationError, match="quantum must be a positive number of instructions, got 0"):
        controlflow.Turnstile(2, quantum=0)


def test_quantum_lets_a_program_issue_several_instructions_per_turn():
    t = controlflow.Turnstile(2, quantum=2)
    order: list = []

    def run(i: int) -> None:
        t.start(i)
        for k in range(3):
            t.step(i)
            order.append((i, k))
        t.finish(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    assert order == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
