"""Cost model: the compiler's schedule around an instruction stream (DMA queues and their fixed costs,
semaphores, activation tables, SBUF-bounded hoisting, spills, engine-active time), on interpreted kernels
and hand-computed cases."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import cost, hardware, trace
from trnkit.nkisim.cost_params import LOW, MID
from trnkit.nkisim.trace import DMA, SCALAR

# the mid setting with each engine in the kernel's program order (compute_reorder off, the pessimistic end's)
IN_ORDER = replace(MID, compute_reorder=False)

TRN2 = hardware.TRN2


def _trace(fn, *args):
    with trace.record() as tr:
        out = fn(*args)
    return list(tr), out


@nki.jit
def _activations(x, funcs: tuple):
    """One load, then one ScalarE activation per function in ``funcs`` (each on the loaded tile)."""
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    y = t
    for f in funcs:
        y = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.activation(dst=y, op=f, data=t)
    nisa.dma_copy(dst=out, src=y)
    return out


def test_activation_table_loads_when_the_function_changes():
    x = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
    instrs, out = _trace(_activations, x, (nl.exp, nl.exp, nl.tanh, nl.exp, nl.copy))
    np.testing.assert_allclose(np.asarray(out), x, rtol=1e-6)  # the last activation is a copy
    times = [t for t in cost.timeline(instrs) if t.engine == SCALAR]
    loads = [t.table_load for t in times]
    # exp loads its table, the second exp reuses it, tanh and exp again load theirs, copy needs none
    assert [tl is not None for tl in loads] == [True, False, True, True, False]
    assert all(tl[1] - tl[0] == pytest.approx(TRN2.act_table_load_ns) for tl in loads if tl)
    # each ACTIVATE holds ScalarE for N / clock plus its fixed time
    assert times[1].end - times[1].start == pytest.approx(64 / 1.2 + TRN2.act_fixed_ns)


def test_the_dma_overview_example_1_step_by_step():
    """[4, 4096] bf16: load on one DMA engine, exp (table load first), store: every step's time."""
    import torch
    a = torch.ones(4, 4096, dtype=torch.bfloat16)

    @nki.jit
    def roundtrip(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        y = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.activation(dst=y, op=nl.exp, data=t)
        nisa.dma_copy(dst=out, src=y)
        return out

    instrs, _ = _trace(roundtrip, a)
    load, act, store = cost.timeline(instrs)
    # one engine at 23 B/ns (a lone engine is not held to a sixteenth of the HBM share), one 32 KiB payload;
    # its bytes outlast the 16 engines' staggered semaphore writes
    one_engine = 32768 / (23.0 * 32768 / (32768 + MID.dma_knee_bytes))
    assert one_engine > 15 * MID.dma_engine_stagger_ns
    assert load.first_byte == MID.dma_fixed_ns and load.end - load.first_byte == pytest.approx(one_engine)
    assert act.table_load[0] == pytest.approx(load.end + MID.dma_wake_ns)  # the completion semaphore
    assert act.end - act.start == pytest.approx(4096 / 1.2 + TRN2.act_fixed_ns)
    # the store's queue is ScalarE's (the second of the compiler's two): no cross-engine semaphore
    assert store.start == pytest.approx(act.ready)
    assert cost.estimate(instrs, params=MID).total_ns == pytest.approx(store.end)


def test_a_trigger_on_another_engine_waits_for_a_semaphore():
    import torch
    a = torch.ones(4, 4096, dtype=torch.bfloat16)
    instrs, _ = _trace(_activations, a, (nl.exp,))
    one_queue = replace(MID, dma_queues=1)  # both DMAs on SyncE's queue: the store waits for ScalarE
    load, act, store = cost.timeline(instrs, params=one_queue)
    assert store.start == pytest.approx(act.ready + MID.dma_wake_ns)


def test_engine_active_is_the_union_of_its_busy_spans():
    import torch
    a = torch.ones(128, 2048, dtype=torch.bfloat16)
    instrs, _ = _trace(_activations, a, (nl.exp,))
    rep = cost.estimate(instrs, params=MID)
    load, act, store = cost.timeline(instrs)
    # DMA (mid): trigger to last byte of the load, and of the store; narrow: first to last byte; wide: to
    # the completion semaphore's wake-up
    dma_active = (load.end - load.start) + (store.end - store.start)
    assert rep.active_ns[DMA] == pytest.approx(dma_active)
    bytes_moving = (load.end - load.first_byte) + (store.end - store.first_byte)
    to_wake = (load.ready - load.start) + (store.ready - store.start)
    assert rep.active_range_ns[DMA] == pytest.approx((bytes_moving, to_wake))
    # ScalarE (mid, narrow): the table load and the ACTIVATE's busy time; wide: to its result
    assert rep.active_ns[SCALAR] == pytest.approx(act.end - act.table_load[0])
    assert rep.active_range_ns[SCALAR] == pytest.approx((act.end - act.table_load[0], act.ready - act.table_load[0]))
    assert rep.active[DMA] == pytest.approx(dma_active / rep.total_ns)
    assert 0 < rep.active[SCALAR] < 1


@nki.jit
def _running_sum(x, n: int):
    """``n`` iterations of: load x [128, F] into a new tile, add it to the running sum."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    acc = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    for _ in range(n):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nxt = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=nxt, data1=acc, data2=t, op=nl.add)
        acc = nxt
    nisa.dma_copy(dst=out, src=acc)
    return out


def test_hoisting_is_bounded_by_sbuf_when_asked():
    """Every load is independent, so unbounded they all run ahead of the (slower) adds; bounded, a load
    waits until the tiles dead before it are freed enough for it to fit the 224 KiB per partition."""
    x = np.ones((128, 8192), np.float32)  # 32 KiB per partition per tile
    instrs, out = _trace(_running_sum, x, 12)
    np.testing.assert_array_equal(np.asarray(out), 12 * x)
    plan = cost.sbuf_plan(instrs, TRN2.sbuf_bytes_per_partition)
    loads = [k for k, i in enumerate(instrs) if i.op == "dma_copy"][:-1]
    assert all(plan.allocates[k] == 32768 for k in loads) and plan.spill == {}
    bounded = cost.timeline(instrs, params=replace(MID, hoist_bounded_by_sbuf=True))
    free = cost.timeline(instrs, params=replace(MID, hoist_bounded_by_sbuf=False))
    adds = [t for t, i in zip(bounded, instrs) if i.op == "tensor_tensor"]
    # unbounded, every load runs ahead; bounded, the last one waits for the adds to free the tiles of
    # earlier iterations (the dead tiles not yet freed plus the running sum and it must fit 224 KiB)
    assert all(bounded[k].start >= free[k].start for k in loads)
    assert free[loads[-1]].start < adds[0].end <= bounded[loads[-1]].start
    assert bounded[loads[0]].start == free[loads[0]].start == 0.0
    assert cost.estimate(instrs, params=replace(MID, hoist_bounded_by_sbuf=True)).total_ns >= \
        cost.estimate(instrs, params=replace(MID, hoist_bounded_by_sbuf=False)).total_ns


@nki.jit
def _all_live(x, n: int):
    """``n`` tiles computed from one load (not reloadable), all stored at the end."""
    out = nl.ndarray((n, *x.shape), dtype=x.dtype, buffer=nl.shared_hbm)
    src = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=x)
    tiles = []
    for k in range(n):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=t, data=src, op0=nl.add, operand0=float(k))
        tiles.append(t)
    for k, t in enumerate(tiles):
        nisa.dma_copy(dst=out[k], src=t)
    return out


def test_computed_tiles_that_overflow_sbuf_are_spilled_and_reloaded():
    x = np.zeros((128, 8192), np.float32)
    instrs, out = _trace(nki.simulate(_all_live, capacity="unchecked"), x, 8)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8, dtype=np.float32)[:, None, None] + x)
    plan = cost.sbuf_plan(instrs, TRN2.sbuf_bytes_per_partition)
    # the source and 8 computed tiles of 32 KiB, all live at the last tensor_scalar: 288 KiB, 224 KiB fit
    assert plan.peak_bytes == 9 * 32768
    assert sum(plan.spill.values()) == plan.peak_bytes - TRN2.sbuf_bytes_per_partition
    assert cost.sbuf_plan(instrs, 9 * 32768).spill == {}
    # the spill's store + reload occupy the DMA engines: at least that much longer than without it
    spill_ns = 2 * 128 * sum(plan.spill.values()) / TRN2.hbm_bytes_per_ns
    no_spill = replace(TRN2, sbuf_bytes_per_partition=1 << 30, sbuf_usable_bytes_per_partition=1 << 30)
    assert cost.estimate(instrs, params=MID).total_ns >= cost.estimate(instrs, no_spill, params=MID).total_ns \
        + 0.5 * spill_ns


@nki.jit
def _reload_after_others(x, y):
    """Load x and store it; load every y[k] (all held to the end); load x again and store it; store the
    y tiles."""
    n = y.shape[0]
    out = nl.ndarray((n + 2,) + x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=out[0], src=a)
    held = []
    for k in range(n):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=y[k])
        held.append(t)
    b = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=b, src=x)
    nisa.dma_copy(dst=out[1], src=b)
    for k, t in enumerate(held):
        nisa.dma_copy(dst=out[k + 2], src=t)
    return out


def _reload_trace(n: int) -> list:
    x = np.ones((128, 8192), np.float32)  # 32 KiB per partition per tile
    y = np.arange(n, dtype=np.float32)[:, None, None] + np.zeros((n, 128, 8192), np.float32)
    instrs, out = _trace(nki.simulate(_reload_after_others, capacity="unchecked"), x, y)
    np.testing.assert_array_equal(np.asarray(out)[1], x)
    np.testing.assert_array_equal(np.asarray(out)[2:], y)
    return instrs


def test_a_reload_of_unchanged_hbm_data_is_dropped_when_keeping_it_fits():
    """reuse_loads (the fused-Mamba tutorial: the compiler reloads delta/u because they do not fit): the
    second load of x can reuse the first one's data if 32 KiB more fit next to the 6 y tiles live between."""
    instrs = _reload_trace(6)
    first, again = 0, 8  # load x, store it, 6 loads of y, load x again
    assert instrs[again].attrs["reads"] == instrs[first].attrs["reads"]
    assert cost.reused_loads(instrs, 7 * 32768, program_order=True) == {again: first}
    assert cost.reused_loads(instrs, 7 * 32768 - 1, program_order=True) == {}
    on, off = replace(MID, reuse_loads="fits"), replace(MID, reuse_loads="none")
    # the device's 224 KiB holds 7 tiles, nki-library's budget (the default sbuf_reserved) does not
    assert cost.estimate(instrs, params=replace(on, sbuf_reserved=False)).busy_ns[DMA] == pytest.approx(
        cost.estimate(instrs, params=off).busy_ns[DMA] - cost.instr_cost(instrs[again]).busy_ns)
    assert cost.estimate(instrs, params=on).busy_ns[DMA] == cost.estimate(instrs, params=off).busy_ns[DMA]


def test_reloads_are_dropped_at_mid_only_when_every_reloaded_input_stays_resident():
    """reuse_loads "resident" (mid; the fused-Mamba tutorial reloads delta/u "due to a large total memory
    size"): x (32 KiB per partition) is kept for the whole kernel when it fits next to the peak of live
    tiles, 7 x 32 KiB in program order (the 6 y tiles and x's second tile), and then its reload is dropped;
    one byte less and nothing is dropped."""
    instrs = _reload_trace(6)
    first, again = 0, 8
    assert cost.resident_loads(instrs, 8 * 32768, program_order=True) == {again: first}
    assert cost.resident_loads(instrs, 8 * 32768 - 1, program_order=True) == {}
    # the greedy rule ("fits", optimistic) keeps x only from its store to its reload: one tile less
    assert cost.reused_loads(instrs, 8 * 32768 - 1, program_order=True) == {again: first}
    resident, none = replace(MID, reuse_loads="resident"), replace(MID, reuse_loads="none")
    device = TRN2.sbuf_bytes_per_partition  # 224 KiB = 7 x 32 KiB: x does not stay resident there
    assert cost.resident_loads(instrs, device, program_order=True) == {}
    assert cost.estimate(instrs, params=resident).busy_ns[DMA] == cost.estimate(instrs, params=none).busy_ns[DMA]
    with pytest.raises(ValueError, match="reuse_loads must be one of .* got True"):
        cost.estimate(instrs, params=replace(MID, reuse_loads=True))


def test_matmul_tutorials_tiled_kernel_keeps_its_lhsT_reloads_at_mid():
    """The tiled matmul (trn1 tutorial, 17 % slower than with its loads hoisted) reloads each lhsT tile for
    every N-tile and each rhs tile for every M-tile. With 2 M-tiles x 2 N-tiles at K = 8192 the distinct
    data (lhsT 2 x 64 x 256 B, rhs 2 x 64 x 1 KiB: 160 KiB per partition) stays resident and every reload
    is dropped; with 24 M-tiles (lhsT 384 KiB) it does not and none is, although the greedy rule ("fits")
    would keep each lhsT tile the 16 KiB-per-partition while it is needed again."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "calibration"))
    import matmul_kernels

    def reloads(M: int) -> tuple[int, int]:
        lhsT, rhs = np.zeros((8192, M), np.float32), np.zeros((8192, 1024), np.float32)
        with trace.record(trace_only=True) as tr:
            matmul_kernels.matmul_tiled(lhsT.astype(np.float16), rhs.astype(np.float16))
        instrs = list(tr)
        cap = hardware.TRN1.sbuf_usable_bytes_per_partition
        return len(cost.resident_loads(instrs, cap)), len(cost.reused_loads(instrs, cap))
    resident, fits = reloads(2 * 128)
    assert resident == fits == 2 * 64 + 2 * 64  # lhsT again for the second N-tile, rhs for the second M-tile
    resident, fits = reloads(24 * 128)
    assert resident == 0 and fits >= 24 * 64


def test_spills_follow_program_order_liveness_unless_loads_are_sunk():
    """7 y tiles held to the end plus x's second tile: 8 x 32 KiB live in program order, 32 KiB over the
    device's 224 KiB; sunk to their first read (the stores) the y loads never overflow."""
    instrs = _reload_trace(7)
    cap = TRN2.sbuf_bytes_per_partition
    assert sum(cost.sbuf_plan(instrs, cap, program_order=True).spill.values()) == 32768
    assert cost.sbuf_plan(instrs, cap, program_order=False).spill == {}
    device = replace(MID, sbuf_reserved=False)
    po = cost.estimate(instrs, params=replace(device, spill_in_program_order=True))
    sunk = cost.estimate(instrs, params=replace(device, spill_in_program_order=False))
    # the spill's store and reload keep the DMA engines busy: at least one of them adds to the DMA active time
    spill_ns = 128 * 32768 / TRN2.hbm_bytes_per_ns
    assert po.active_ns[DMA] >= sunk.active_ns[DMA] + spill_ns
    assert po.total_ns >= sunk.total_ns


def test_a_transfer_named_to_an_engine_goes_to_that_engines_queue():
    """``dma_copy(..., dge_mode=hwdge, engine=...)`` records its trigger engine, and the model puts the
    transfer in that engine's queue: two independent loads named to ScalarE and SyncE both trigger at once
    even where the compiler's transfers share one queue (dma_queues=1), while unnamed they go one fixed
    cost apart."""
    import torch
    a = torch.ones(128, 512, dtype=torch.bfloat16)

    def loads(named):
        @nki.jit
        def two_loads(a):
            out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray((128, 256), dtype=a.dtype, buffer=nl.sbuf)
            u = nl.ndarray((128, 256), dtype=a.dtype, buffer=nl.sbuf)
            if named:
                nisa.dma_copy(dst=t, src=a[:, 0:256], dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar)
                nisa.dma_copy(dst=u, src=a[:, 256:512], dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)
            else:
                nisa.dma_copy(dst=t, src=a[:, 0:256])
                nisa.dma_copy(dst=u, src=a[:, 256:512])
            return out

        return _trace(two_loads, a)[0]

    one_queue = replace(MID, dma_queues=1)
    named = loads(True)
    assert [i.attrs.get("engine") for i in named] == ["scalar", "sync"]
    first, second = cost.timeline(named, params=one_queue)
    assert first.start == second.start == 0.0
    first, second = cost.timeline(loads(False), params=one_queue)
    assert second.start == pytest.approx(MID.dma_fixed_ns)


def _named_store_kernel(named: bool, then_load: bool = False):
    """[4, 4096] bf16: load, exp on ScalarE, the exp's store (triggered from ScalarE when ``named``), a
    second exp of the loaded tile; with ``then_load`` a named ScalarE load of an independent HBM tensor
    takes the store's place in program order."""

    @nki.jit
    def kernel(a, b):
        out = nl.ndarray((8, 4096), dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        u = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        y = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        z = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.activation(dst=y, op=nl.exp, data=t)
        if then_load:
            nisa.dma_copy(dst=u, src=b, dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar)
        elif named:
            nisa.dma_copy(dst=out[0:4, :], src=y, dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar)
        else:
            nisa.dma_copy(dst=out[0:4, :], src=y)
        nisa.activation(dst=z, op=nl.exp, data=t)
        nisa.dma_copy(dst=out[4:8, :], src=z)
        return out

    import torch
    a = torch.ones(4, 4096, dtype=torch.bfloat16)
    return _trace(kernel, a, a.clone())[0]


def test_a_named_trigger_holds_its_engines_instruction_stream():
    """A transfer named to ScalarE is an instruction of ScalarE's in-order stream (DMA overview: "The
    sequencer instruction to trigger the transfer may wait on any semaphore condition"; trainium2_arch:
    a DGE instruction "takes about 600 ns to execute"): the store of an exp triggers when the exp's result
    is ready, and the next exp (independent of it) waits until the trigger has waited and executed; the
    same store on the compiler's queue costs ScalarE nothing, and with compute_reorder (mid, LOW) the compiler
    moves the next exp ahead of it."""
    named = _named_store_kernel(True)
    load, act1, store, act2, _ = cost.timeline(named, params=IN_ORDER)
    # hand-computed: the load on one DMA engine (32 KiB at 23 B/ns x b/(b + knee)), its completion semaphore,
    # exp's table load, exp (N / 1.2 GHz + fixed), exp's result latency
    one_engine = 32768 / (23.0 * 32768 / (32768 + MID.dma_knee_bytes))
    loaded = MID.dma_fixed_ns + one_engine + MID.dma_wake_ns
    exp_ns = 4096 / 1.2 + TRN2.act_fixed_ns
    assert act1.table_load == pytest.approx((loaded, loaded + TRN2.act_table_load_ns))
    assert act1.end == pytest.approx(loaded + TRN2.act_table_load_ns + exp_ns)
    exp_ready = act1.start + cost.instr_cost(named[1], params=MID).latency_ns
    assert act1.ready == pytest.approx(exp_ready) and exp_ready > act1.end
    # the trigger waits for the exp's result (same engine: no cross-engine semaphore); ScalarE's next
    # instruction waits for the trigger to issue and execute (600 ns), not just for the first exp's end
    assert store.start == pytest.approx(exp_ready)
    assert act2.start == pytest.approx(exp_ready + 600.0)
    # the compiler's queue: nothing in ScalarE's stream, the second exp follows the first
    _, act1_u, _, act2_u, _ = cost.timeline(_named_store_kernel(False), params=IN_ORDER)
    assert act2_u.start == pytest.approx(act1_u.end) == pytest.approx(act1.end)
    # compute_reorder: the compiler places the trigger where its data is ready and ScalarE's pipeline runs on
    for params in (MID, LOW):
        _, act1_r, store_r, act2_r, _ = cost.timeline(named, params=params)
        assert act2_r.start == pytest.approx(act1_r.end)
        assert store_r.start == pytest.approx(act1_r.ready)


def test_a_named_trigger_is_not_issued_before_its_engines_earlier_instructions():
    """With ScalarE in program order (compute_reorder off), a load named to ScalarE after an exp waits until
    ScalarE's sequencer has taken the exp (its table load starts when the first load's data is in), though its
    own data is in HBM at 0; ScalarE's next exp waits for the load's trigger to execute (600 ns) after that,
    and the exp that started first is not delayed (the DGE instruction "could be hidden behind earlier compute
    instructions", trainium2_arch). With compute_reorder (mid, optimistic) the trigger issues at 0."""
    instrs = _named_store_kernel(True, then_load=True)
    load, act1, named_load, act2, _ = cost.timeline(instrs, params=IN_ORDER)
    loaded = load.end + MID.dma_wake_ns
    assert act1.table_load[0] == pytest.approx(loaded)
    assert named_load.start == pytest.approx(loaded)
    assert act2.start == pytest.approx(max(act1.end, loaded + 600.0)) == pytest.approx(act1.end)
    for params in (MID, LOW):  # compute_reorder: the trigger goes where its data is ready
        assert cost.timeline(instrs, params=params)[2].start == 0.0


def test_a_start_that_rounding_moves_back_by_one_ulp_ends_the_search():
    """The search for the first time the engine and its shared resources are free compared ``t2 == t``;
    a resource's answer ``(t + pre) - pre`` can be one ulp below ``t`` (an activation with a table load,
    pre = 1,283 ns), and the search then never ended (the q/k head norm with a residual, 16 heads x 2,048
    rows, LNC=2, hung in ``cost.estimate``). It ends now, at the time every timeline is free."""
    import torch

    from trnkit.kernels.rmsnorm import rmsnorm_residual

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(32768, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    with trace.record() as tr:
        rmsnorm_residual(x, r, torch.ones(128, dtype=torch.bfloat16), lnc=2)
    instrs = [i for i in tr if i.program_id == 0]
    times = cost.timeline(instrs, params=MID)
    loads = [t for t in times if t.table_load is not None]
    assert loads and all(t.start - t.table_load[0] == pytest.approx(TRN2.act_table_load_ns) for t in loads)
    low, mid, high = cost.estimate(list(tr)).total_range_ns
    assert low <= mid <= high
