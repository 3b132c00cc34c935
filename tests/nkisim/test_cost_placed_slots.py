"""Cost model: tiles a kernel places itself on overlapping bytes (``nl.ndarray(..., address=)``) are one storage
for the schedule's dependencies (cost_params.placed_slots_shared): the trace gives each access to a placed tile its
box on the kernel instance's placement space (isa.common.slot_box, bytes), and a tile written on a slot waits for
the earlier tile's last read there. Expected boxes are computed by hand from the byte layout."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import cost, trace
from trnkit.nkisim.cost_params import HIGH, LOW, MID
from trnkit.nkisim.trace import DMA, SCALAR


@nki.jit
def _two_tiles_one_slot(x, y, second_at):
    """Load x into tile A placed at (0, 0), square it on ScalarE into an unplaced tile, then load y into tile B
    placed at ``second_at`` (A's bytes, or bytes of its own) and square it too; both results stored."""
    p, f = x.shape
    a = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf, address=(0, 0))
    b = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf, address=second_at)
    ra = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf)
    rb = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf)
    out = nl.ndarray((2, p, f), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=a, src=x)
    nisa.activation(dst=ra, op=nl.square, data=a)
    nisa.dma_copy(dst=b, src=y)
    nisa.activation(dst=rb, op=nl.square, data=b)
    nisa.dma_copy(dst=out[0], src=ra)
    nisa.dma_copy(dst=out[1], src=rb)
    return out


def _trace(second_at):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 1024, generator=g)
    y = torch.randn(128, 1024, generator=g)
    with trace.record() as tr:
        out = np.asarray(_two_tiles_one_slot(x, y, second_at))
    np.testing.assert_allclose(out, np.stack([x.numpy() ** 2, y.numpy() ** 2]), rtol=1e-6)
    return list(tr)


def _index(instrs, op, n):
    return [k for k, i in enumerate(instrs) if i.op == op][n]


def test_slot_boxes_are_the_tiles_bytes():
    """A [128, 1024] fp32 tile placed at (0, 0) holds bytes [0, 4096) of partitions [0, 128); one placed at
    (0, 4096) bytes [4096, 8192). Unplaced tiles and HBM tensors have no slot box of their own."""
    for second_at, expect in (((0, 0), (0, 128, 0, 4096)), ((0, 4096), (0, 128, 4096, 8192))):
        instrs = _trace(second_at)
        load_a, load_b = _index(instrs, "dma_copy", 0), _index(instrs, "dma_copy", 1)
        wa = instrs[load_a].attrs["slot_write_boxes"][0]
        wb = instrs[load_b].attrs["slot_write_boxes"][0]
        assert wa[0] == wb[0] and wa[0][0] == "placed"  # one placement space
        assert wa[1:] == (0, 128, 0, 4096) and wb[1:] == expect
        # the tile's own box stays in its own elements (the SBUF plan sizes tiles from it)
        assert instrs[load_b].attrs["write_boxes"][0][1:] == (0, 128, 0, 1024)
        # the HBM source is not placed: its slot box is its own box
        assert instrs[load_b].attrs["slot_read_boxes"] == instrs[load_b].attrs["read_boxes"]
        store = _index(instrs, "dma_copy", 2)  # unplaced SBUF -> HBM: no slot boxes
        assert "slot_read_boxes" not in instrs[store].attrs


@nki.jit
def _placed_at_partition_64(x):
    p, f = x.shape
    a = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf, address=(64, 256))
    nisa.dma_copy(dst=a, src=x)
    out = nl.ndarray((p, f), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)
    return out


def test_slot_box_counts_partitions_and_bytes_from_the_placement():
    x = torch.randn(64, 32)
    with trace.record() as tr:
        out = np.asarray(_placed_at_partition_64(x))
    np.testing.assert_array_equal(out, x.numpy())
    load = list(tr)[0]
    assert load.attrs["slot_write_boxes"][0][1:] == (64, 128, 256, 256 + 32 * 4)


@pytest.mark.parametrize("params", [LOW, MID, HIGH], ids=["low", "mid", "high"])
def test_second_load_on_the_slot_waits_for_the_first_tiles_reader(params):
    """Shared slot: B's load overwrites A's bytes, so it starts (its trigger) no earlier than the ScalarE square
    that reads A is done with them (WAR: the reader's finish). With the tiles on their own bytes, or with
    ``placed_slots_shared`` off (every placed tile its own storage), B's load does not wait for it."""
    for second_at, shared, waits in (((0, 0), True, True), ((0, 4096), True, False), ((0, 0), False, False)):
        instrs = _trace(second_at)
        load_b, act_a = _index(instrs, "dma_copy", 1), _index(instrs, "activation", 0)
        assert instrs[load_b].engine == DMA and instrs[act_a].engine == SCALAR
        times = cost.timeline(instrs, "trn2", replace(params, placed_slots_shared=shared))
        if waits:
            assert times[load_b].start >= times[act_a].ready
        else:
            assert times[load_b].start < times[act_a].end
    # shared bytes cost more in total; own bytes the same with the rule on or off
    tot = {(at, sh): cost.estimate(_trace(at), params=replace(params, placed_slots_shared=sh)).total_ns
           for at in ((0, 0), (0, 4096)) for sh in (True, False)}
    assert tot[(0, 0), True] > tot[(0, 0), False] == pytest.approx(tot[(0, 4096), False])
    assert tot[(0, 4096), True] == tot[(0, 4096), False]


def test_on_at_every_setting():
    assert LOW.placed_slots_shared and MID.placed_slots_shared and HIGH.placed_slots_shared


def test_nkilib_mlp_cte_row_pays_for_its_one_slot_per_tile():
    """nki-library's mlp_cte places every tile itself (SbufManager), one slot set per B x S tile at H >= 8,192
    (test_mlp_cte:244, 1,024 x 8,192 x 448, no norm, LNC 2; 278.0 us recorded): its recorded estimate
    (nkilib_calibration.csv, standalone launch) is the shared-slot one, and the earlier model (each placed tile
    its own storage) gives the earlier row's 202.73 / 221.38 / 290.33 us."""
    import sys
    from pathlib import Path

    from trnkit.conformance import harness
    from trnkit.nkisim.cost_params import STANDALONE_LAUNCH

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "calibration"))
    import nkilib_rows
    import nkilib_run

    root = harness.nkilib_root()
    if root is None:
        pytest.skip("no nki-library checkout or archive (NKILIB_SRC)")
    p = next(p for p in nkilib_rows.read_points() if p["point"] == "nkilib test_mlp_cte:244")
    recorded = nkilib_run.read_out()[p["point"]]
    tr = nkilib_run.trace_case(nkilib_run.case_of(p), root)
    shared = cost.estimate(tr, "trn2", launch=STANDALONE_LAUNCH).total_range_ns
    assert [f"{t / 1e3:.2f}" for t in shared] == [recorded[k] for k in ("low_us", "mid_us", "high_us")]
    own = [cost.estimate(tr, "trn2", params=replace(s, placed_slots_shared=False),
                         launch=STANDALONE_LAUNCH.setting(k)).total_ns
           for k, s in (("low", LOW), ("mid", MID), ("high", HIGH))]
    assert [f"{t / 1e3:.2f}" for t in own] == ["202.73", "221.38", "290.33"]
    assert shared[1] > own[1]


@nki.jit
def _square_onto_slots(x, y, plan):
    """For each ``(source, address)`` of ``plan`` (source 0: x, 1: y), the source loaded into a tile placed at
    that address, squared on ScalarE into an unplaced tile and stored."""
    p, f = x.shape
    out = nl.ndarray((len(plan), p, f), nl.float32, buffer=nl.shared_hbm)
    for n, (which, at) in enumerate(plan):
        src = (x, y)[which]
        t = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf, address=at)
        r = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src)
        nisa.activation(dst=r, op=nl.square, data=t)
        nisa.dma_copy(dst=out[n], src=r)
    return out


def _reload_slots_trace(b_at, c_at):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 1024, generator=g)
    y = torch.randn(128, 1024, generator=g)
    with trace.record() as tr:
        # x into tile A placed at (0, 0), y into B at b_at, x again into C at c_at
        out = np.asarray(_square_onto_slots(x, y, ((0, (0, 0)), (1, b_at), (0, c_at))))
    np.testing.assert_allclose(out, np.stack([x.numpy() ** 2, y.numpy() ** 2, x.numpy() ** 2]), rtol=1e-6)
    instrs = list(tr)
    first, again = _index(instrs, "dma_copy", 0), _index(instrs, "dma_copy", 4)  # load x, ..., load x again
    assert instrs[again].attrs["reads"] == instrs[first].attrs["reads"]
    return instrs, first, again


@pytest.mark.parametrize("b_at, c_at, dropped", [
    ((0, 4096), (0, 0), True),      # x's slot untouched since its load: the data is still there
    ((0, 0), (0, 0), False),        # y's tile was written on x's slot: x is gone, the reload moves its bytes
    ((0, 4096), (0, 8192), False),  # the reload's consumer reads another slot, which x never reached
], ids=["same-slot-intact", "slot-overwritten", "other-slot"])
def test_a_reload_into_a_placed_tile_is_dropped_only_onto_its_intact_slot(b_at, c_at, dropped):
    """reuse_loads drops a reload of unchanged HBM data (the fused-Mamba tutorial); for placed tiles the kernel
    fixed the addresses, so only a reload onto exactly the slot an earlier load of the data went to, with no
    write on that slot since, can be dropped (``placed_slots_shared``); off, tiles are matched by object as
    before (every reload dropped while the data fits). Capacity is no limit here (1 GiB)."""
    instrs, first, again = _reload_slots_trace(b_at, c_at)
    expect = {again: first} if dropped else {}
    for fn in (cost.resident_loads, cost.reused_loads):
        assert fn(instrs, 1 << 30) == expect
        assert fn(instrs, 1 << 30, by_slot=False) == {again: first}
    # at mid ("resident") a reload that stays moves its bytes: DMA busy and HBM bytes grow by that load's
    on, off = (cost.estimate(instrs, params=replace(MID, placed_slots_shared=s)) for s in (True, False))
    extra = 0.0 if dropped else cost.instr_cost(instrs[again]).busy_ns
    assert on.busy_ns[DMA] == pytest.approx(off.busy_ns[DMA] + extra)
    # the report's HBM traffic is the mid setting's: less the reload only where it is dropped
    assert on.hbm_bytes == sum(i.hbm_bytes for i in instrs) - (instrs[again].hbm_bytes if dropped else 0)


def test_a_dropped_reload_leaves_its_slot_holding_the_data():
    """Two reloads of x onto A's intact slot: both are dropped, the second against the first load (the dropped
    reload's own write on the slot is the same data, not an overwrite)."""
    x, y = torch.randn(128, 1024), torch.randn(128, 1024)
    with trace.record() as tr:
        _square_onto_slots(x, y, ((0, (0, 0)), (1, (0, 4096)), (0, (0, 0)), (0, (0, 0))))
    instrs = list(tr)
    loads = [_index(instrs, "dma_copy", n) for n in (0, 4, 6)]
    assert cost.resident_loads(instrs, 1 << 30) == {loads[1]: loads[0], loads[2]: loads[0]}
