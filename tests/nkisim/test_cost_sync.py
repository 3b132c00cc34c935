"""Cost model: the programs of an LNC=2 grid synchronise at core_barrier and at launch boundaries; a sendrecv's
readers wait for the other core's transfer."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.helpers import TRN2, matmul
from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import cost, trace
from trnkit.nkisim.cost_params import MID
from trnkit.nkisim.trace import DMA, GPSIMD, VECTOR, Instr, Operand


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


def _tile(name: str, shape: tuple[int, int]) -> Operand:
    return Operand(name, "sbuf", shape, "float32", shape[0], shape[1], shape[0] * shape[1] * 4)


def _vcopy(program_id: int, cols: int, src: str, dst: str) -> Instr:
    """A VectorE fp32 copy of a [128, cols] tile: reads ``src``, writes ``dst``."""
    ops = (_tile("dst", (128, cols)), _tile("data1", (128, cols)))
    return Instr("tensor_copy", VECTOR, ops, elems_per_partition=cols, partitions=128, program_id=program_id,
                 attrs={"launch": 0, "reads": [(src, 0, 1)], "writes": [(dst, 0, 1)]})


def _sr(program_id: int, src: str, dst: str) -> Instr:
    """sendrecv of a [128, 64] fp32 tile on pipe 0: sends ``src``, receives into ``dst``."""
    ops = (_tile("dst", (128, 64)), _tile("src", (128, 64)))
    return Instr("sendrecv", DMA, ops, dma_bytes=128 * 64 * 4, partitions=128, elems_per_partition=64,
                 program_id=program_id, attrs={"launch": 0, "pipe_id": 0, "reads": [(src, 0, 1)],
                                               "writes": [(dst, 0, 1)]})


def _mm_free(program_id: int, k: int) -> Instr:
    return replace(matmul(128, 128, 512, deps={"reads": [(f"w{k}", 0, 1)], "writes": [(f"p{k}", 0, 1)]}),
                   program_id=program_id, attrs={"launch": 0, "reads": [(f"w{k}", 0, 1)],
                                                 "writes": [(f"p{k}", 0, 1)]})


def test_a_sendrecv_reader_waits_for_the_other_cores_send_and_nothing_else_does():
    """nki.isa.sendrecv: "Operations with the same pipe_id form a logical group where all operations in the
    group must complete before any can proceed". Core 0 sends a tile it first computes (a [128, 4096] VectorE
    copy), core 1 one it has at once; each then reads what it received (core 0 a [128, 512], core 1 a [128, 2048]
    VectorE copy).

    By hand from the two programs' own schedules (mid): core 0's transfer completes at G = its timeline's
    ready time (the copy's result, the wake-up, the transfer); core 1's alone completes long before. Core 1's
    reader waits for G, so the kernel ends at G + that reader's latency, not at core 1's own send + latency
    (each core scheduled alone) nor at core 0's G + its shorter reader."""
    p0 = [_vcopy(0, 4096, "x", "a"), _sr(0, "a", "r"), _vcopy(0, 512, "r", "o")]
    p1 = [_sr(1, "b", "r"), _vcopy(1, 2048, "r", "o")]
    t0 = cost.timeline([replace(i, attrs=dict(i.attrs)) for i in p0], "trn2", MID)
    g = t0[1].ready  # core 0's transfer: its last byte + the completion wake-up
    assert g == pytest.approx(t0[1].end + MID.dma_wake_ns)
    t1 = cost.timeline([replace(i, program_id=0) for i in p1], "trn2", MID)
    assert t1[0].ready < g / 2  # core 1 alone: its transfer done well before core 0 has sent
    lat = cost.instr_cost(p1[1]).latency_ns
    rep = cost.estimate(p0 + p1)
    assert rep.total_ns == pytest.approx(g + lat)
    assert t0[2].start == pytest.approx(g)  # core 0's reader: its own transfer is the group's last
    assert t0[2].ready < g + lat and t1[1].ready < g + lat  # neither core alone reaches it

    # core 1's independent work (60 matmuls on TensorE after its sendrecv in program order) is not held:
    # the kernel ends when that chain does, as it would on core 1 alone; a phase boundary at the sendrecv
    # (everything after it waiting for both cores) would have ended at about g + the chain
    chain = [_mm_free(1, k) for k in range(60)]
    alone = cost.estimate([replace(i, program_id=0) for i in chain]).total_ns
    assert alone > g + lat
    rep2 = cost.estimate(p0 + [p1[0], *chain, p1[1]])
    assert rep2.total_ns == pytest.approx(alone)
    assert rep2.total_ns < g + alone - 1_000


def test_a_sendrecv_group_is_the_nth_transfer_of_each_core_on_its_pipe():
    segs = [[_sr(0, "a", "r"), _vcopy(0, 64, "r", "o"), _sr(0, "o", "s")],
            [_sr(1, "b", "r"), _sr(1, "c", "s")],
            [_vcopy(2, 64, "x", "y")]]
    assert cost._sendrecv_groups(segs) == [[(0, 0), (1, 0)], [(0, 2), (1, 1)]]
