"""Cost-model rules that the published-measurement calibration (benchmarks/calibration/) led to:
dependencies on partition x free boxes, PSUM accumulation groups on TensorE, the trn1 sustained DMA rate,
the measured dependent-instruction overhead."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.helpers import dma_round_trip
from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import cost, cost_params, hardware, trace
from trnkit.nkisim.trace import TENSOR

MID = cost_params.MID


@nki.jit
def _slices(x, into_one_tile: bool, same_slice: bool = False):
    """Eight [128, 512] loads of ``x`` into one [128, 8, 512] tile (slice k) or into eight tiles."""
    out = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.shared_hbm)
    big = nl.ndarray((128, 8, 512), dtype=x.dtype, buffer=nl.sbuf)
    tiles = []
    for k in range(8):
        dst = big[:, 0 if same_slice else k, :] if into_one_tile else nl.ndarray((128, 512), dtype=x.dtype,
                                                                                  buffer=nl.sbuf)
        nisa.dma_copy(dst=dst, src=x[:, k * 512:(k + 1) * 512])
        tiles.append(dst)
    acc = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=acc, src=tiles[-1])
    nisa.dma_copy(dst=out, src=acc)
    return out


def _total(fn, *args, chip="trn2"):
    with trace.record() as tr:
        fn(*args)
    return cost.estimate(tr, chip, params=MID).total_ns, list(tr)


def test_dmas_into_disjoint_slices_of_one_tile_do_not_wait_for_each_other():
    x = np.random.default_rng(0).standard_normal((128, 8 * 512)).astype(np.float32)
    one_tile, tr = _total(_slices, x, True)
    separate, _ = _total(_slices, x, False)
    assert one_tile == pytest.approx(separate)
    # writing the same slice eight times is a chain of write-after-write waits
    same, _ = _total(_slices, x, True, True)
    load = cost.instr_cost(tr[0], "trn2")
    # disjoint slices share the DMA bandwidth (8 busy times) but overlap their fixed costs
    assert one_tile < 8 * load.latency_ns <= same


@nki.jit
def _accumulate(a, b, k: int):
    """``k`` matmuls accumulating into one PSUM tile, then a copy out (the tutorial's inner K loop)."""
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    at = nl.ndarray((128, 128), dtype=a.dtype, buffer=nl.sbuf)
    bt = nl.ndarray((128, 512), dtype=b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=at, src=a)
    nisa.dma_copy(dst=bt, src=b)
    acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
    for _ in range(k):
        nisa.nc_matmul(dst=acc, stationary=at, moving=bt)
    res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)
    nisa.dma_copy(dst=out, src=res)
    return out


def test_matmuls_of_one_psum_accumulation_group_issue_back_to_back():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((128, 128)).astype(np.float32)
    b = rng.standard_normal((128, 512)).astype(np.float32)
    with trace.record() as tr:
        y = _accumulate(a, b, 8)
    np.testing.assert_allclose(np.asarray(y), 8 * a.T @ b, rtol=1e-4, atol=1e-3)
    t1, _ = _total(_accumulate, a, b, 1)
    t8 = cost.estimate(tr, "trn2", params=MID).total_ns
    mm = cost.instr_cost(next(i for i in tr if i.engine == TENSOR), "trn2")
    # fp32 [128,512] moving: 4 x 512 cycles at 2.4 GHz each; 7 more matmuls add 7 busy times, not 7 latencies
    assert mm.busy_ns == pytest.approx(4 * 512 / 2.4)
    assert t8 - t1 == pytest.approx(7 * mm.busy_ns)
    assert mm.latency_ns > mm.busy_ns


def test_trn1_dma_runs_at_its_fitted_sustained_fraction_trn2_at_the_documented_rate():
    trn1, trn2 = hardware.TRN1, hardware.TRN2
    assert trn2.dma.sustained_fraction == 1.0
    assert 0.3 < trn1.dma.sustained_fraction < 0.7
    x = np.zeros((128, 1024), np.float32)  # 4 KiB per partition row

    with trace.record() as tr:
        dma_round_trip(x)
    payload = 512 * 1024 / 16  # contiguous in HBM: one engine's 8 rows of 4 KiB
    for chip, rate in ((trn1, 16 * 17.0 * trn1.dma.sustained_fraction), (trn2, 16 * 23.0)):
        # the packet overhead is a fixed time: at trn1's sustained rate it is worth knee x fraction bytes
        eff = payload / (payload + MID.dma_knee_bytes * chip.dma.sustained_fraction)
        c = cost.instr_cost(list(tr)[0], chip, MID)
        assert c.busy_ns == pytest.approx(max(512 * 1024 / (rate * eff), 512 * 1024 / (chip.hbm_bytes_per_ns * eff)))
    # the documented trn1 rate would make the same load about twice as fast
    doc = replace(trn1, dma=replace(trn1.dma, sustained_fraction=1.0))
    first = list(tr)[0]
    assert cost.instr_cost(first, doc, MID).busy_ns < 0.5 * cost.instr_cost(first, trn1, MID).busy_ns


def test_trn1_packet_overhead_is_a_fixed_time_its_sustained_fraction_slows_the_bytes():
    """Per byte, trn1's 256 B rows cost ~1.2x its 1 KiB rows (the matrix-multiplication tutorial's tiled
    kernel moves its 256 B lhsT rows at about the 1 KiB rows' cost per byte), trn2's 1.6x (the knee)."""
    trn1, trn2 = hardware.TRN1, hardware.TRN2
    rows = {b: _row_load(b) for b in (256, 1024)}  # b bytes per packet
    per_byte = {chip.name: [cost.instr_cost(rows[b], chip, MID).busy_ns / b for b in (256, 1024)]
                for chip in (trn1, trn2)}
    knee = MID.dma_knee_bytes
    assert per_byte["trn2"][0] / per_byte["trn2"][1] == pytest.approx((256 + knee) / 256 / ((1024 + knee) / 1024))
    f = trn1.dma.sustained_fraction
    assert per_byte["trn1"][0] / per_byte["trn1"][1] == pytest.approx(
        (256 + knee * f) / 256 / ((1024 + knee * f) / 1024))
    # each engine's 8 packets: their bytes at the sustained rate, plus the knee at the documented 17 B/ns each
    for b in (256, 1024):
        bytes_ns = 8 * b / (17.0 * f)
        assert cost.instr_cost(rows[b], trn1, MID).transfer_ns == pytest.approx(bytes_ns + 8 * knee / 17.0)


def _row_load(b: int) -> trace.Instr:
    """A [128, b / 4] fp32 load cut from rows twice as wide: one b-byte packet per partition row."""
    x = np.zeros((128, 2 * b), np.float32)

    @nki.jit
    def load(x):
        t = nl.ndarray((128, b // 4), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[:, 0:b // 4])
        out = nl.ndarray((128, b // 4), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    with trace.record() as tr:
        load(x)
    return list(tr)[0]


def test_packet_overhead_form_is_a_range_parameter_with_its_own_trn1_fraction():
    """cost_params.dma_overhead_form: "fixed" (mid) knee x f on top of the slower bytes, "scaled" the knee
    slowed with the bytes, "hidden" the slower of bytes at f and bytes + knee at the documented rate; each
    with trn1's fraction refitted under it (0.44 / 0.51 / 0.38). The ends take the fastest / slowest of the
    three per transfer. trn2 (f = 1): every choice gives the same time."""
    trn1, trn2 = hardware.TRN1, hardware.TRN2
    assert [trn1.dma.sustained(f) for f in ("scaled", "fixed", "hidden")] == [0.51, 0.44, 0.38]
    assert MID.dma_overhead_form == "fixed" and trn1.dma.sustained("fixed") == trn1.dma.sustained_fraction
    # the range ends take the fastest / slowest form per transfer
    assert (cost_params.LOW.dma_overhead_form, cost_params.HIGH.dma_overhead_form) == ("fastest", "slowest")
    for knee in (256, 512):
        for b in (256, 1024, 4096):
            ins = _row_load(b)
            per_engine = 8 * b  # each engine's 8 packets of b bytes
            want = {"fixed": per_engine / (17.0 * 0.44) + 8 * knee / 17.0,
                    "scaled": (per_engine + 8 * knee) / (17.0 * 0.51),
                    "hidden": max(per_engine / (17.0 * 0.38), (per_engine + 8 * knee) / 17.0)}
            want["fastest"], want["slowest"] = min(want.values()), max(want.values())
            for form, ns in want.items():
                params = replace(MID, dma_knee_bytes=knee, dma_overhead_form=form)
                assert cost.instr_cost(ins, trn1, params).transfer_ns == pytest.approx(ns), (knee, b, form)
            trn2_ns = {cost.instr_cost(ins, trn2, replace(MID, dma_knee_bytes=knee, dma_overhead_form=form)
                                       ).transfer_ns for form in want}
            assert len(trn2_ns) == 1
            assert trn2_ns.pop() == pytest.approx(per_engine / min(23.0, trn2.hbm_bytes_per_ns / 16) * (b + knee) / b)
    # which form is slowest depends on the row: at the pessimistic knee 512, 1 KiB rows are slowest scaled
    # (0.51 x 1024 / 1536 = 0.34 of 17 B/ns), 4 KiB rows hidden (0.38)
    assert cost.dma_efficiency(1024, replace(MID, dma_knee_bytes=512, dma_overhead_form="hidden"), 0.38) == 1.0
    assert cost.dma_efficiency(256, replace(MID, dma_overhead_form="scaled"), 0.51) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dma_overhead_form must be one of .*'sustained'"):
        cost.dma_efficiency(256, replace(MID, dma_overhead_form="sustained"), 0.44)
    with pytest.raises(ValueError, match="dma_overhead_form must be one of .*'sustained'"):
        cost.instr_cost(_row_load(256), trn1, replace(MID, dma_overhead_form="sustained"))


def test_dependent_overhead_mid_is_the_perf_guides_measured_interval():
    # 264 ScalarE cycles between dependent one-element instructions on NC-v2 = MIN_II 64 + overhead
    assert hardware.TRN1.min_ii_cycles + MID.dependent_overhead_cycles == 264
    lo, hi = cost_params.one_at_a_time("dependent_overhead_cycles")
    assert lo.dependent_overhead_cycles == 160  # the documented 100 static + 60 access init
    assert hi.dependent_overhead_cycles > MID.dependent_overhead_cycles


@nki.jit
def _perf_mode_cases(x):
    """bf16 VectorE instructions meeting some of the trn2 perf-mode conditions (trainium2_arch)."""
    out = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    wide = nl.ndarray((128, 1024), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=wide[:, 0:512], src=x)
    nisa.dma_copy(dst=wide[:, 512:1024], src=x)
    p = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.psum)
    b = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=b, src=a)  # 1a + 1b + 1c: 4x
    c = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=c, src=wide[:, 0:1024:2])  # strided inner dim (not 1c): 2x
    nisa.tensor_copy(dst=p, src=a)  # contiguous, output in PSUM: 2x
    d = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=d, data1=wide[:, 0:1024:2], data2=a, op=nl.add)  # both inputs SBUF: 2x
    e = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=e, data1=p, data2=a, op=nl.add)  # one input in PSUM: no perf mode
    nisa.tensor_tensor(dst=e, data1=e, data2=d, op=nl.add)
    nisa.tensor_tensor(dst=e, data1=e, data2=c, op=nl.add)
    nisa.tensor_tensor(dst=e, data1=e, data2=b, op=nl.add)
    nisa.dma_copy(dst=out, src=e)
    return out


def test_trn2_vector_perf_mode_follows_the_architecture_guides_conditions():
    import ml_dtypes

    x = np.ones((128, 512), dtype=ml_dtypes.bfloat16)
    with trace.record() as tr:
        _perf_mode_cases(x)
    vec = [i for i in tr if i.engine == "vector"]
    cycles = [cost.instr_cost(i, "trn2", MID).cycles - MID.access_init_cycles for i in vec[:5]]
    # 512 elements: copy 4x = 128; strided copy 2x = 256; copy into PSUM 2x = 256; SBUF add 2x = 256
    # (a bf16 add is one pass); PSUM add 1x = 512 (each + the per-instruction access set-up)
    assert cycles == [128, 256, 256, 256, 512]
    # trn1 has no perf mode
    assert [cost.instr_cost(i, "trn1", MID).cycles - MID.access_init_cycles for i in vec[:5]] == [512] * 5


def _stt_cases(x):
    """scalar_tensor_tensor on [128, 512] tiles: (data * col) op1 operand1 in four placements / dtypes."""
    f32 = np.float32
    col = nl.ndarray((128, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=col, value=2.0)
    a = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=a, value=1.0)
    b = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=b, value=3.0)
    p = nl.ndarray((128, 512), dtype=f32, buffer=nl.psum)
    nisa.memset(dst=p, value=0.5)
    w = nl.ndarray((128, 512), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=w, value=4.0)
    out = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=out, data=a, op0=nl.multiply, operand0=col, op1=nl.add, operand1=b)
    nisa.scalar_tensor_tensor(dst=out, data=a, op0=nl.multiply, operand0=col, op1=nl.multiply, operand1=p)
    nisa.scalar_tensor_tensor(dst=w, data=w, op0=nl.multiply, operand0=col, op1=nl.add, operand1=w)
    nisa.scalar_tensor_tensor(dst=w, data=w, op0=nl.subtract, operand0=col, op1=nl.maximum, operand1=p)
    nisa.scalar_tensor_tensor(dst=out, data=a, op0=nl.subtract, operand0=col, op1=nl.multiply, operand1=b)
    return out


def test_scalar_tensor_tensor_costs_a_tensor_tensor_of_its_two_tiles_except_at_the_pessimistic_end():
    """cost_params.stt_as_tensor_tensor: the current ISA reference's "approximately the same latency as a
    regular tensor_tensor" (the fp32 column operand0 costs nothing) at low / mid; the beta-1 table (N for
    bf16 subtract / multiply, else 2N) at high."""
    import ml_dtypes

    x = np.ones((128, 512), dtype=ml_dtypes.bfloat16)
    with trace.record() as tr:
        _stt_cases(x)
    stt = [i for i in tr if i.op == "scalar_tensor_tensor"]
    assert len(stt) == 5

    def cycles(params):
        return [cost.instr_cost(i, "trn2", params).cycles - params.access_init_cycles
                - params.psum_access_cycles * any(o.buffer == "psum" for o in i.operands) for i in stt]

    # bf16 add, both tiles in SBUF: one pass, perf mode 2x = 256; bf16 x PSUM fp32 multiply: one pass
    # (an input in PSUM) = 512; fp32 add in SBUF: two passes = 1024; fp32 max with PSUM: one pass = 512;
    # bf16 (x - col) * b in SBUF: one pass, 2x = 256
    assert cycles(MID) == cycles(cost_params.LOW) == [256, 512, 1024, 512, 256]
    # beta-1: N only for bf16 data and operand1 with op0 subtract and op1 multiply (the last), else 2N
    assert cycles(cost_params.HIGH) == [1024, 1024, 1024, 1024, 512]
    assert not cost_params.HIGH.stt_as_tensor_tensor and MID.stt_as_tensor_tensor
    # the performance mode shares VectorE's SBUF bus with GpSimd (hardware.Chip access rules)
    assert cost._vector_perf_mode(stt[0], hardware.TRN2, MID)
    assert not cost._vector_perf_mode(stt[0], hardware.TRN2, cost_params.HIGH)


def _work_by(limit, t_end: float, dt: float = 0.05) -> float:
    """Full-rate work done by t_end under a utilization limit ``limit(t)`` (midpoint sum, dt ns)."""
    n = int(round(t_end / dt))
    return sum(limit((j + 0.5) * dt) for j in range(n)) * dt


def _time_for(limit, work: float, dt: float = 0.05) -> float:
    """First time the work done under ``limit`` reaches ``work`` (stepping dt ns)."""
    done, t = 0.0, 0.0
    while done < work:
        done += limit(t + 0.5 * dt) * dt
        t += dt
    return t - (done - work) / limit(t - 0.5 * dt)


def test_didt_throttle_follows_the_documented_ramp_and_window():
    """hardware.Chip.didt_*: TensorE starts at 50 % of its maximum and ramps to full over ~3 us after work
    begins, and re-engages after a ~3 us window below 50 % (Neuron Explorer, "Understanding throttling").
    The instruction times are checked against the limit integrated numerically."""
    chip = hardware.TRN2
    assert (chip.didt_threshold, chip.didt_start_limit, chip.didt_ramp_ns) == (0.5, 0.5, 3000.0)
    assert hardware.TRN1.didt_threshold == 0.0  # the page names Trn2 and Trn3

    def ramp_from(r):
        return lambda t: 1.0 if t - r >= 3000.0 else 0.5 + 0.5 * (t - r) / 3000.0

    d = cost._Didt(0.5, 0.5, 3000.0)
    assert d.engages(0.0)  # the kernel's first TensorE instruction
    first = d.duration(0.0, 853.3)
    assert first == pytest.approx(_time_for(ramp_from(0.0), 853.3), abs=0.1)
    d.place(0.0, first, 853.3)
    # back to back: the ramp goes on; an instruction that crosses the ramp's end finishes at full rate
    second = d.duration(first, 2000.0)
    assert second == pytest.approx(_time_for(lambda t: ramp_from(0.0)(t + first), 2000.0), abs=0.1)
    d.place(first, second, 2000.0)
    end = first + second
    assert end > 3000.0
    # after the ramp: full rate
    assert d.duration(end, 5000.0) == 5000.0
    d.place(end, 5000.0, 5000.0)
    end += 5000.0
    # a gap of 1.4 us after full-rate work leaves the 3 us window above 50 %, 1.6 us does not
    assert not d.engages(end + 1400.0)
    assert d.duration(end + 1400.0, 853.3) == pytest.approx(853.3)
    assert d.engages(end + 1600.0)
    assert d.duration(end + 1600.0, 853.3) == pytest.approx(_time_for(ramp_from(0.0), 853.3), abs=0.1)
    # utilization counts work: a ramp held busy (2.25 us of work in 3 us) then a 0.5 us gap stays above
    # 50 % over the window (1,875 ns of work in [0.5, 3.5] us), a 1.1 us gap does not
    d2 = cost._Didt(0.5, 0.5, 3000.0)
    d2.place(0.0, 3000.0, 2250.0)
    assert not d2.engages(3500.0)
    assert d2.engages(4100.0)  # 2250 x 1900 / 3000 = 1,425 ns of work in [1.1, 4.1] us
    # the lost time of one whole ramp: (1 - 0.5) / 2 x 3 us = 750 ns, integrated
    assert 3000.0 - _work_by(ramp_from(0.0), 3000.0) == pytest.approx(750.0, abs=0.01)


def test_didt_throttle_is_a_parameter_off_at_every_setting_that_costs_a_ramp_per_burst():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((128, 128)).astype(np.float32)
    b = rng.standard_normal((128, 512)).astype(np.float32)
    with trace.record() as tr:
        _accumulate(a, b, 8)
    instrs = list(tr)
    on = replace(MID, didt_throttle=True)
    assert not any(s.didt_throttle for s in cost_params.SETTINGS.values())
    off_ns = cost.estimate_total(instrs, "trn2", MID)
    # 8 fp32 matmuls back to back (6.8 us of work) on TensorE's critical path: one ramp, 750 ns lost
    assert cost.estimate_total(instrs, "trn2", on) - off_ns == pytest.approx(750.0, abs=0.5)
    times = cost.timeline(instrs, "trn2", on)
    assert sum(t.throttled_ns for t in times) == pytest.approx(750.0, abs=0.5)
    rep = cost.estimate(instrs, "trn2", params=on)
    assert rep.busy_ns["tensor"] == pytest.approx(8 * 4 * 512 / 2.4 + 750.0, abs=0.5)
    # trn1 has no such throttle
    assert cost.estimate_total(instrs, "trn1", on) == cost.estimate_total(instrs, "trn1", MID)
