"""Cost model: the programs of an LNC=2 grid synchronise at core_barrier and at launch boundaries."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.helpers import TRN2, matmul
from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import cost, trace
from trnkit.nkisim.trace import GPSIMD, Instr, Operand


def _barrier(program_id: int, launch: int, n_rows: int) -> Instr:
    data = Operand("data", "shared_hbm", (n_rows, 2048), "bfloat16", 1, n_rows * 2048, n_rows * 4096)
    return Instr("core_barrier", GPSIMD, (data,), program_id=program_id, attrs={"launch": launch})


def _mm(program_id: int, launch: int) -> Instr:
    return replace(matmul(128, 128, 512), program_id=program_id, attrs={"launch": launch})


def test_core_barrier_costs_a_semaphore_round_trip_not_a_pass_over_data():
    small, big = cost.instr_cost(_barrier(0, 0, 1)), cost.instr_cost(_barrier(0, 0, 4096))
    assert small == big
    assert big.fixed_ns == TRN2.dma.fixed_ns
    assert big.busy_ns == pytest.approx(TRN2.static_overhead_cycles / TRN2.clocks.ghz(GPSIMD))


def test_phases_wait_for_the_slowest_program():
    """Program 0: 9 matmuls | barrier | 1 matmul; program 1: 1 matmul | barrier | 9 matmuls. Without
    the sync each core would take 10 matmuls; with it, 9 + 9 (each phase its slowest program; without
    data dependencies the barrier's ~1.3 us latency overlaps the Tensor Engine's work of its phase)."""
    p0 = [_mm(0, 7)] * 9 + [_barrier(0, 7, 8)] + [_mm(0, 7)]
    p1 = [_mm(1, 7)] + [_barrier(1, 7, 8)] + [_mm(1, 7)] * 9
    rep = cost.estimate(p0 + p1)
    nine = cost.estimate([_mm(0, 0)] * 9).total_ns
    assert nine > TRN2.dma.fixed_ns
    assert rep.total_ns == pytest.approx(2 * nine)
    unsynced = cost.estimate([_mm(0, 0)] * 10).total_ns
    assert rep.total_ns > unsynced


def test_a_new_launch_is_a_sync_point_for_a_grid_but_not_for_one_core():
    two_launches = [_mm(0, 1)] * 3 + [_mm(1, 1)] + [_mm(0, 2)] + [_mm(1, 2)] * 3
    rep = cost.estimate(two_launches)
    three = cost.estimate([_mm(0, 0)] * 3).total_ns
    assert rep.total_ns == pytest.approx(2 * three)
    # one program: consecutive launches stay one list schedule (they overlap where data allows)
    one = [_mm(0, 1)] * 3 + [_mm(0, 2)] * 3
    assert cost.estimate(one).total_ns == pytest.approx(cost.estimate([_mm(0, 0)] * 6).total_ns)


@nki.jit
def _exchange(a):
    """Each program writes its half of a shared buffer, waits, then reads the other half."""
    n_prog, pid = nl.num_programs(0), nl.program_id(0)
    buf = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    half = a.shape[0] // n_prog
    t = nl.ndarray((half, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[pid * half:(pid + 1) * half, :])
    nisa.dma_copy(dst=buf[pid * half:(pid + 1) * half, :], src=t)
    nisa.core_barrier(buf, (0, 1))
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    o = 1 - pid
    nisa.dma_copy(dst=t, src=buf[o * half:(o + 1) * half, :])
    nisa.dma_copy(dst=out[o * half:(o + 1) * half, :], src=t)
    return out


def test_interpreter_traces_carry_the_launch_and_the_barrier():
    a = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    with trace.record() as tr:
        out = _exchange[2](a)
        _exchange[2](a)
    np.testing.assert_array_equal(out, a)
    launches = sorted({i.attrs["launch"] for i in tr})
    assert len(launches) == 2
    assert [i.program_id for i in tr if i.op == "core_barrier"].count(0) == 2
    rep = cost.estimate(tr)
    assert rep.n_programs == 2
    # 2 launches x 2 phases, each at least one DMA fixed cost
    assert rep.total_ns > 4 * TRN2.dma.fixed_ns
