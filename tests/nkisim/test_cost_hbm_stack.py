"""Cost model: HBM is a per-stack resource (trn2: 4 stacks of 725 GB/s, two physical cores to a stack), so a
core's HBM bandwidth depends on how many of its stack's cores stream at once. In a graph every core streams
(362.5 GB/s a core, as before); a standalone LNC 1 launch has its stack to itself at low / mid (725 GB/s: the
DMA engines bind), a standalone LNC 2 launch shares it between its two cores (362.5 GB/s). Every expected
number is written out from the documented figures: 2,900 GB/s / 4 stacks, 16 engines x 23 B/ns (x 27.2 / 23 at
the optimistic end), the packet efficiency b / (b + knee)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import dma_round_trip
from trnkit.nkisim import cost, hardware, trace
from trnkit.nkisim.cost_params import HIGH, LOW, MID, STANDALONE_LAUNCH, LaunchParams
from trnkit.nkisim.trace import DMA

TRN2, TRN1 = hardware.TRN2, hardware.TRN1
MIB = 1024 * 1024


def test_stack_bandwidth_from_the_documented_figures():
    assert TRN2.hbm_stacks == 4 and TRN2.cores_per_hbm_stack == 2
    assert TRN2.hbm_bytes_per_ns_streaming(1) == pytest.approx(2900.0 / 4)  # 725 GB/s: partner idle
    assert TRN2.hbm_bytes_per_ns_streaming(2) == pytest.approx(2900.0 / 8)  # 362.5 GB/s: both stream
    assert TRN2.hbm_bytes_per_ns_streaming(8) == TRN2.hbm_bytes_per_ns_streaming(2)  # at most the stack's 2
    assert TRN2.hbm_bytes_per_ns == pytest.approx(362.5)  # every core of the chip streaming (a graph)
    # trn1: 2 stacks for 2 cores, one core a stack: 410 GB/s whatever the other core does
    assert TRN1.cores_per_hbm_stack == 1
    assert TRN1.hbm_bytes_per_ns_streaming(1) == TRN1.hbm_bytes_per_ns == pytest.approx(410.0)
    with pytest.raises(ValueError, match="at least 1 streaming core, got 0"):
        TRN2.hbm_bytes_per_ns_streaming(0)


def test_hbm_per_core_by_launch():
    assert cost.hbm_per_core("trn2", None, 1) == pytest.approx(362.5)  # in a graph
    assert cost.hbm_per_core("trn2", None, 2) == pytest.approx(362.5)
    assert cost.hbm_per_core("trn2", STANDALONE_LAUNCH.mid, 1) == pytest.approx(725.0)  # LNC 1 alone
    assert cost.hbm_per_core("trn2", STANDALONE_LAUNCH.mid, 2) == pytest.approx(362.5)  # LNC 2 pair
    assert cost.hbm_per_core("trn2", STANDALONE_LAUNCH.high, 1) == pytest.approx(362.5)  # partner streaming
    assert cost.hbm_per_core("trn1", STANDALONE_LAUNCH.mid, 1) == pytest.approx(410.0)
    with pytest.raises(ValueError, match="hbm_stack_cores must be None .* got 0"):
        LaunchParams(hbm_stack_cores=0)


def _trace(grid: int = 1) -> list:
    """[128, 2048] fp32 HBM -> SBUF -> HBM: 1 MiB each way, contiguous (one 64 KiB packet per engine)."""
    x = np.zeros((128, 2048), np.float32)
    with trace.record() as tr:
        dma_round_trip[grid](x) if grid > 1 else dma_round_trip(x)
    return list(tr)


def _transfer(rate_per_engine: float, knee: float) -> float:
    """1 MiB on 16 engines, one 64 KiB packet each: bytes / (16 x rate x b / (b + knee))."""
    b = MIB / 16
    return MIB / (16 * rate_per_engine * b / (b + knee))


def test_one_transfer_at_each_hbm_bandwidth():
    load = _trace()[0]
    assert load.engine == DMA
    # in a graph: 362.5 / 16 = 22.656 B/ns an engine, below the engines' 23
    assert cost.instr_cost(load, "trn2", MID).transfer_ns == pytest.approx(_transfer(362.5 / 16, 256))
    # standalone LNC 1: 725 / 16 = 45.3 B/ns of HBM an engine, so the engines' 23 B/ns binds (+1.5 %)
    alone = cost.hbm_per_core("trn2", STANDALONE_LAUNCH.mid, 1)
    assert cost.instr_cost(load, "trn2", MID, alone).transfer_ns == pytest.approx(_transfer(23.0, 256))
    # optimistic end: 27.2 B/ns an engine (the DMA overview's rate, 435 GB/s a core) no longer capped at 362.5
    assert cost.instr_cost(load, "trn2", LOW, alone).transfer_ns == pytest.approx(_transfer(27.2, 128))
    assert cost.instr_cost(load, "trn2", LOW).transfer_ns == pytest.approx(_transfer(362.5 / 16, 128))
    # trn1 is unchanged by any launch (one core a stack)
    assert cost.instr_cost(load, "trn1", MID, cost.hbm_per_core("trn1", STANDALONE_LAUNCH.mid, 1)).transfer_ns \
        == cost.instr_cost(load, "trn1", MID).transfer_ns


def test_standalone_lnc1_moves_its_dma_busy_and_roofline_lnc2_and_graph_do_not():
    """Busy DMA time = the two transfers (load and store, 16 engines each, so busy = transfer); the launch's
    start-up is separate (launch_ns)."""
    instrs = _trace()
    graph = cost.estimate(instrs)
    alone = cost.estimate(instrs, launch=STANDALONE_LAUNCH)
    assert graph.busy_ns[DMA] == pytest.approx(2 * _transfer(362.5 / 16, 256))
    assert alone.busy_ns[DMA] == pytest.approx(2 * _transfer(23.0, 256))
    assert alone.total_ns - alone.launch_ns[1] < graph.total_ns  # the kernel part is faster
    # roofline: 2 MiB over the most HBM a core has at any setting (725 standalone LNC 1, 362.5 in a graph)
    assert graph.memory_bound_ns == pytest.approx(2 * MIB / 362.5)
    assert alone.memory_bound_ns == pytest.approx(2 * MIB / 725.0)
    # the pessimistic end (partner core streaming) prices the kernel as in a graph, plus its start-up
    assert alone.total_range_ns[2] - alone.launch_ns[2] == pytest.approx(graph.total_range_ns[2])
    assert cost.estimate_total(instrs, "trn2", HIGH, STANDALONE_LAUNCH.high) == pytest.approx(
        cost.estimate_total(instrs, "trn2", HIGH))

    # LNC 2: the pair shares one stack, 362.5 GB/s a core: the kernel part is the graph's at every setting
    two = _trace(grid=2)
    graph2 = cost.estimate(two)
    alone2 = cost.estimate(two, launch=STANDALONE_LAUNCH)
    assert [t - x for t, x in zip(alone2.total_range_ns, alone2.launch_ns)] == pytest.approx(
        list(graph2.total_range_ns))
    assert alone2.busy_ns == pytest.approx(graph2.busy_ns)
    assert alone2.memory_bound_ns == pytest.approx(graph2.memory_bound_ns)
