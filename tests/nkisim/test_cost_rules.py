"""Cost model rules added for calibration: engine access rules, GpSimd rates, software DGE,
DMA transfers in flight, the recompute check, and the low / mid / high ranges (core_barrier: test_cost_sync)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import cost, cost_params, hardware, trace
from trnkit.nkisim.trace import DMA, GPSIMD, SCALAR, VECTOR, Instr, Operand

TRN1, TRN2 = hardware.TRN1, hardware.TRN2
MID = cost_params.MID


def opnd(role: str, buffer: str, shape: tuple[int, ...], dtype: str = "float32") -> Operand:
    n = math.prod(shape)
    item = 2 if dtype in ("bfloat16", "float16") else 4
    return Operand(role, buffer, shape, dtype, shape[0], n // shape[0], n * item)


def op(name: str, engine: str, dst: str, srcs: list[str], bufs: tuple[str, ...] = ("sbuf", "sbuf", "sbuf"),
       n: int = 512, dtype: str = "float32", **attrs) -> Instr:
    """A compute instruction writing storage ``dst`` and reading ``srcs`` (deps for the list schedule)."""
    keys = [dst, *srcs]
    ops = tuple(opnd(r, b, (128, n), dtype) for r, b in zip(("dst", "data1", "data2"), bufs[:len(keys)]))
    return Instr(name, engine, ops, elems_per_partition=n, partitions=128,
                 attrs={"reads": tuple((k, 0, 1) for k in srcs), "writes": ((dst, 0, 1),), **attrs})


def test_tensor_tensor_scan_is_2n_cycles_as_in_the_beta1_table():
    scan = op("tensor_tensor_scan", VECTOR, "o", ["a", "b"])
    assert cost.instr_cost(scan, "trn1", replace(MID, access_init_cycles=0)).cycles == 1024
    assert cost.instr_cost(scan, "trn1").cycles == 1024 + MID.access_init_cycles


def test_gpsimd_has_its_own_rate_not_vectors_table():
    tt = op("tensor_tensor", GPSIMD, "o", ["a", "b"], dtype="bfloat16", op="add")
    # VectorE would run this bf16 add in one pass (N/2 in trn2 perf mode); GpSimd: 2 inputs / 0.5 per cycle
    a = MID.access_init_cycles
    assert cost.instr_cost(tt, "trn2").cycles == 2 * 512 / MID.gpsimd_elems_per_cycle + a
    assert cost.instr_cost(replace(tt, engine=VECTOR), "trn2").cycles == 256 + a
    fast = replace(MID, gpsimd_elems_per_cycle=1.0)
    assert cost.instr_cost(tt, "trn2", fast).busy_ns == pytest.approx((1024 + a) / 1.2)
    one_input = op("tensor_copy", GPSIMD, "o", ["a"])
    assert cost.instr_cost(one_input, "trn2").cycles == 512 / MID.gpsimd_elems_per_cycle + a


def _run(instrs: list[Instr], chip: str, params=MID) -> float:
    return cost.estimate(instrs, chip, params=params).total_ns


def test_trn1_vector_and_gpsimd_cannot_touch_sbuf_together_trn2_can():
    v = op("tensor_copy", VECTOR, "o1", ["a"])
    g = op("tensor_copy", GPSIMD, "o2", ["b"])
    cv, cg = (cost.instr_cost(i, "trn1") for i in (v, g))
    fixed = cv.fixed_ns  # both engines' last instruction ends with its fixed latency
    # trn1: serialised (the later one starts when the first one's busy time ends)
    assert _run([v, g], "trn1") == pytest.approx(cv.busy_ns + cg.busy_ns + cost.instr_cost(g, "trn1").fixed_ns)
    assert _run([v, g], "trn1") > max(cv.latency_ns, cg.latency_ns)
    # trn2: independent ...
    cv2, cg2 = (cost.instr_cost(i, "trn2") for i in (v, g))
    assert _run([v, g], "trn2") == pytest.approx(max(cv2.latency_ns, cg2.latency_ns))
    # ... except VectorE's bf16 perf mode, which uses the bus it shares with GpSimd
    vb = op("tensor_copy", VECTOR, "o1", ["a"], dtype="bfloat16")
    gb = op("tensor_copy", GPSIMD, "o2", ["b"], dtype="bfloat16")
    cvb, cgb = cost.instr_cost(vb, "trn2"), cost.instr_cost(gb, "trn2")
    assert _run([vb, gb], "trn2") == pytest.approx(cvb.busy_ns + cgb.latency_ns)
    assert fixed > 0


def test_vector_and_scalar_collide_on_one_psum_bank_trn2_and_on_any_psum_trn1():
    v = op("tensor_copy", VECTOR, "s1", ["bank0"], bufs=("sbuf", "psum"))
    s_same = op("activation", SCALAR, "s2", ["bank0"], bufs=("sbuf", "psum"))
    s_other = op("activation", SCALAR, "s3", ["bank1"], bufs=("sbuf", "psum"))
    cv, cs = cost.instr_cost(v, "trn2"), cost.instr_cost(s_same, "trn2")
    assert _run([v, s_same], "trn2") == pytest.approx(cv.busy_ns + cs.latency_ns)  # same bank: one after the other
    assert _run([v, s_other], "trn2") == pytest.approx(max(cv.latency_ns, cs.latency_ns))  # different banks
    cv1, cs1 = cost.instr_cost(v, "trn1"), cost.instr_cost(s_other, "trn1")
    assert _run([v, s_other], "trn1") == pytest.approx(cv1.busy_ns + cs1.latency_ns)  # v2: never in parallel
    # SBUF-only Scalar work does not wait for VectorE's PSUM reads
    s_sbuf = op("activation", SCALAR, "s4", ["x"])
    assert _run([v, s_sbuf], "trn1") == pytest.approx(max(cv1.latency_ns, cost.instr_cost(s_sbuf, "trn1").latency_ns))


def _dma(dst: str, src: str, rows: int = 128, row_bytes: int = 512, **attrs) -> Instr:
    o = (Operand("dst", "sbuf", (rows, row_bytes // 4), "float32", rows, row_bytes // 4, rows * row_bytes),
         Operand("src", "hbm", (rows, row_bytes // 4), "float32", 1, rows * row_bytes // 4, rows * row_bytes))
    return Instr("dma_copy", DMA, o, hbm_bytes=rows * row_bytes, dma_bytes=rows * row_bytes,
                 elems_per_partition=row_bytes // 4, partitions=rows,
                 attrs={"reads": ((src, 0, 1),), "writes": ((dst, 0, 1),), **attrs})


def test_indirect_dma_generates_descriptors_on_gpsimd_first():
    plain, gather = _dma("a", "x"), _dma("a", "x", indirect=True)
    c = cost.instr_cost(gather, "trn2")
    assert c.gpsimd_ns == pytest.approx(128 * MID.swdge_cycles_per_row / 1.2)
    assert cost.instr_cost(plain, "trn2").gpsimd_ns == 0
    rep = cost.estimate([gather], "trn2", params=MID)
    span = c.transfer_ns + 15 * MID.dma_engine_stagger_ns  # 16 engines, started one after another
    assert rep.total_ns == pytest.approx(c.gpsimd_ns + c.fixed_ns + span)
    assert rep.busy_ns[GPSIMD] == pytest.approx(c.gpsimd_ns)
    # the descriptors wait for GpSimd work queued before them
    g = op("tensor_copy", GPSIMD, "o", ["b"])
    assert _run([g, gather], "trn2") == pytest.approx(cost.instr_cost(g, "trn2").busy_ns + c.gpsimd_ns + c.fixed_ns
                                                 + span)


def test_dma_queues_issue_one_transfer_per_fixed_cost_each():
    """A queue holds each transfer from trigger to first byte (DMA overview: a queue executes in order):
    64 tiny independent transfers take about 64 fixed costs on one queue and a quarter of that on four."""
    small = [_dma(f"t{k}", f"x{k}", rows=128, row_bytes=64) for k in range(64)]
    c = cost.instr_cost(small[0], "trn2")
    one, four = replace(MID, dma_queues=1), replace(MID, dma_queues=4)
    stagger = 15 * MID.dma_engine_stagger_ns  # the last transfer's 16 engines start one after another
    assert _run(small, "trn2", one) == pytest.approx(64 * c.fixed_ns + c.transfer_ns + stagger)
    # four queues trigger together: their transfers share the 16 engines, one after another
    assert _run(small, "trn2", four) == pytest.approx(16 * c.fixed_ns + 4 * c.transfer_ns + stagger)


def test_hoisting_lets_a_ready_load_pass_a_waiting_store_of_its_queue():
    """store (waits on a 64-element-per-partition chain of compute) then an independent load, one queue:
    program order makes the load wait for the store's trigger; hoisted, it goes first."""
    slow = op("tensor_copy", VECTOR, "s", ["a"])
    store = _dma("y", "s")
    store = replace(store, operands=store.operands[::-1], attrs={"reads": (("s", 0, 1),), "writes": (("y", 0, 1),)})
    load = _dma("b", "x")
    in_order = replace(MID, dma_queues=1, dma_hoist=False)
    hoisted = replace(MID, dma_queues=1, dma_hoist=True)
    c = cost.instr_cost(load, "trn2")
    t_in_order = _run([slow, store, load], "trn2", in_order)
    t_hoisted = _run([slow, store, load], "trn2", hoisted)
    assert t_hoisted < t_in_order
    # hoisted: the load runs under the copy; in order: it is triggered after the store's fixed cost
    assert t_in_order >= cost.instr_cost(slow, "trn2").latency_ns + c.fixed_ns + c.fixed_ns + c.transfer_ns - 1e-6


@nki.jit
def _twice(x, scale_a, scale_b):
    """y = x*x (computed twice from the same tile) + x*scale_a + x*scale_b."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    sq1 = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sq1, data1=t, data2=t, op=nl.multiply)
    sq2 = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sq2, data1=t, data2=t, op=nl.multiply)  # same inputs: recomputation
    a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=a, data=t, op0=nl.multiply, operand0=scale_a)
    b = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=b, data=t, op0=nl.multiply, operand0=scale_b)  # different scalar: not a recompute
    nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
    nisa.tensor_tensor(dst=a, data1=a, data2=sq2, op=nl.add)
    nisa.tensor_tensor(dst=sq1, data1=sq1, data2=a, op=nl.add)
    nisa.dma_copy(dst=out, src=sq1)
    return out


def test_recompute_from_unchanged_inputs_is_dropped_only_with_compiler_cse():
    x = np.random.default_rng(0).standard_normal((128, 512)).astype(np.float32)
    with trace.record() as tr:
        y = _twice(x, 2.0, 3.0)
    np.testing.assert_allclose(np.asarray(y), 2 * x * x + 5 * x, rtol=1e-5, atol=1e-5)
    on = cost.estimate(tr, "trn1", params=MID)
    off = cost.estimate(tr, "trn1", params=replace(MID, compiler_cse=False))
    tt = cost.instr_cost(next(i for i in tr if i.op == "tensor_tensor"), "trn1")
    # exactly one tensor_tensor (the second x*x) is dropped; x*2.0 and x*3.0 both stay
    assert off.busy_ns[VECTOR] - on.busy_ns[VECTOR] == pytest.approx(tt.busy_ns)
    assert on.total_ns < off.total_ns


def test_estimate_gives_ordered_ranges_and_sensitivity_names_every_parameter():
    x = np.ones((128, 512), np.float32)
    with trace.record() as tr:
        _twice(x, 2.0, 3.0)
    rep = cost.estimate(tr, "trn1")
    low, mid, high = rep.total_range_ns
    assert low <= mid <= high and low < high
    assert mid == rep.total_ns == cost.estimate(tr, "trn1", params=MID).total_ns
    assert rep.total_range_ns[0] == cost.estimate(tr, "trn1", params=cost_params.LOW).total_ns
    assert rep.total_range_ns[2] == cost.estimate(tr, "trn1", params=cost_params.HIGH).total_ns
    f_low, f_mid, f_high = rep.fraction_range
    assert f_low <= f_mid <= f_high
    sens = cost.sensitivity(tr, "trn1")
    assert set(sens) == set(cost_params.PARAM_NAMES)
    swings = [abs(hi - lo) for lo, hi in sens.values()]
    assert swings == sorted(swings, reverse=True)
    assert sens["compiler_cse"][1] > mid  # without the pass the recompute costs time
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        cost_params.one_at_a_time("nope")


def test_hbm_column_windows_are_independent_unless_they_overlap():
    """An HBM access's box is rows x a column window of its tensor's last dimension (isa/common.py
    ``_hbm_box``): a load of ``out[:, 128:256]`` does not wait for a store to ``out[:, 0:128]`` (their flat
    spans interleave, row by row, as attention_cte's per-q-group output slices do), a load of
    ``out[:, 64:192]`` waits for the store to finish."""
    from trnkit.nkisim.tensor import from_array

    def store_then_load(cols: slice) -> tuple[float, list[Instr]]:
        out = from_array(np.zeros((64, 256), np.float32), nl.hbm, "out")
        a = nl.ndarray((64, 128), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((64, 128), nl.float32, buffer=nl.sbuf)
        with trace.record() as tr:
            nisa.dma_copy(dst=out[:, 0:128], src=a)
            nisa.dma_copy(dst=b, src=out[:, cols])
        return _run(list(tr), "trn2"), list(tr)

    disjoint, instrs = store_then_load(slice(128, 256))
    overlapping, _ = store_then_load(slice(64, 192))
    store, load = (cost.instr_cost(i, "trn2") for i in instrs)
    # independent: the two transfers overlap (under one latency and a transfer); dependent: the load's
    # transfer starts after the store has finished
    assert disjoint < store.latency_ns + load.transfer_ns
    assert overlapping > store.latency_ns + load.transfer_ns + 0.5 * load.fixed_ns
