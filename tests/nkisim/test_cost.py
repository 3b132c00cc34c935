"""Cost model: analytical cases against the figures the hardware constants imply."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from tests.helpers import TRN2, dma_round_trip, matmul, opnd
from trnkit.nki_api import nisa, nl
from trnkit.nkisim import cost, hardware
from trnkit.nkisim.cost_params import LOW, MID
from trnkit.nkisim.trace import DMA, SCALAR, TENSOR, VECTOR, Instr



def dma_load(shape: tuple[int, ...], dtype: str = "bfloat16", deps=None, **attrs) -> Instr:
    dst, src = opnd("dst", "sbuf", shape, dtype), opnd("src", "hbm", shape, dtype)
    if deps:
        attrs.update(deps)
    return Instr("dma_copy", DMA, (dst, src), hbm_bytes=dst.nbytes, dma_bytes=dst.nbytes,
                 elems_per_partition=dst.free_elems, partitions=shape[0], attrs=attrs)


def vec(name: str, shape: tuple[int, ...], dtype: str = "float32", engine: str = VECTOR, src_buf: str = "sbuf",
        **attrs) -> Instr:
    ops = (opnd("dst", "sbuf", shape, dtype), opnd("data1", src_buf, shape, dtype),
           opnd("data2", "sbuf", shape, dtype))
    return Instr(name, engine, ops, elems_per_partition=math.prod(shape[1:]), partitions=shape[0], attrs=attrs)


def test_hardware_constants_are_consistent():
    # 128x128 PEs x 2 FLOP x 2.4 GHz is the documented 79 TFLOPS (within rounding)
    assert TRN2.tensor_flops_per_ns_bf16 * 1e-3 == pytest.approx(TRN2.tensor_tflops_bf16, rel=0.01)
    assert hardware.TRN1.tensor_flops_per_ns_bf16 * 1e-3 == pytest.approx(hardware.TRN1.tensor_tflops_bf16, rel=0.01)
    assert TRN2.dma.peak_bytes_per_ns == pytest.approx(368.0)
    assert TRN2.hbm_bytes_per_ns == pytest.approx(2900 / 8)
    assert TRN2.tensor_flops_per_ns("float8_e4m3") == 2 * TRN2.tensor_flops_per_ns("bfloat16")
    assert TRN2.tensor_flops_per_ns("float32") == TRN2.tensor_flops_per_ns("bfloat16") / 4
    assert TRN2.tensor_flops_per_ns("float32", transpose=True) == TRN2.tensor_flops_per_ns("bfloat16") / 2
    assert hardware.TRN1.tensor_flops_per_ns("float32", transpose=True) == \
        hardware.TRN1.tensor_flops_per_ns("bfloat16") / 4
    assert TRN2.sbuf_bytes_per_partition == 224 * 1024 and TRN2.psum_banks == 8
    with pytest.raises(ValueError, match="unknown chip 'trn9'"):
        hardware.get_chip("trn9")


def test_single_bf16_matmul_is_512_cycles_at_2_4_ghz():
    c = cost.instr_cost(matmul(128, 128, 512))
    assert c.cycles == 512
    assert c.busy_ns == pytest.approx(512 / 2.4)  # 213.33 ns
    assert c.busy_ns == pytest.approx(213.333, abs=1e-3)
    rep = cost.estimate([matmul(128, 128, 512)])
    assert rep.busy_ns == {TENSOR: pytest.approx(213.333, abs=1e-3)}
    # a lone instruction: busy plus its fixed latency (the measured 200-cycle dependent-instruction
    # overhead of cost_params, + pipeline fill)
    fixed = (200 + TRN2.mm_init_latency_cycles) / 2.4
    assert rep.total_ns == pytest.approx(512 / 2.4 + fixed)
    # 16.8 MFLOP at 78.6 TFLOPS is exactly the busy time: a full-size matmul runs at peak
    assert rep.compute_bound_ns == pytest.approx(rep.busy_ns[TENSOR])


def test_matmul_cycle_formula_small_and_fp32_and_fp8():
    assert cost.instr_cost(matmul(128, 128, 32)).cycles == 64  # max(min(64, 128), 32)
    assert cost.instr_cost(matmul(128, 16, 8)).cycles == 16  # max(min(64, 16), 8)
    assert cost.instr_cost(matmul(128, 128, 512, "float32")).cycles == 4 * 512
    assert cost.instr_cost(matmul(128, 128, 512, "float32")).busy_ns == pytest.approx(4 * 512 / 2.4)
    assert cost.instr_cost(matmul(128, 128, 512, "float8_e4m3", perf_mode="double_row")).cycles == 256
    # trn1: same cycles at 2.8 GHz
    assert cost.instr_cost(matmul(128, 128, 512), "trn1").busy_ns == pytest.approx(512 / 2.8)


def _pe_transpose(dtype: str, form: str) -> Instr:
    """A [128, 128] TensorE transpose, as ``nc_transpose`` or as ``nc_matmul(is_transpose=True)``."""
    if form == "nc_matmul":
        return matmul(128, 128, 128, dtype, is_transpose=True)
    ops = (opnd("dst", "psum", (128, 128), dtype), opnd("data", "sbuf", (128, 128), dtype))
    return Instr("nc_transpose", TENSOR, ops, flops=2 * 128 ** 3, elems_per_partition=128, partitions=128)


@pytest.mark.parametrize("form", ["nc_transpose", "nc_matmul"])
def test_an_fp32_pe_transpose_takes_twice_a_bf16_one_on_trn2_and_a_matmul_s_4x_on_trn1(form):
    # trn2 architecture guide, TensorE transpose mode: "2x speedup in FP32 transpose, vs. no transpose mode"
    # (no transpose mode: an fp32 matmul, 4x); nc_transpose "is equivalent to" nc_matmul(is_transpose=True)
    extra = MID.matmul_extra_cycles
    bf16 = cost.instr_cost(_pe_transpose("bfloat16", form)).cycles - extra
    assert bf16 == 128
    assert cost.instr_cost(_pe_transpose("float32", form)).cycles - extra == 2 * 128
    assert cost.instr_cost(_pe_transpose("float32", form), "trn1").cycles - extra == 4 * 128
    # an fp32 matmul that is not a transpose keeps its 4x
    assert cost.instr_cost(matmul(128, 128, 128, "float32")).cycles - extra == 4 * 128
    # the roofline's TensorE bound counts the transpose at the same rate: a full one runs at its peak
    rep = cost.estimate([_pe_transpose("float32", form)])
    assert rep.compute_bound_ns == pytest.approx(2 * 128 ** 3 / (TRN2.tensor_flops_per_ns_bf16 / 2))
    assert rep.compute_bound_ns == pytest.approx((2 * 128 + extra) / 2.4, rel=0.02)


def _mixed_fp8_matmul(n: int, **attrs) -> Instr:
    """mlp_tkg's projection: a bf16 token [128, 1] stationary, fp8 weights [128, n] moving."""
    ops = (opnd("dst", "psum", (1, n), "float32"), opnd("stationary", "sbuf", (128, 1), "bfloat16"),
           opnd("moving", "sbuf", (128, n), "float8_e4m3"))
    return Instr("nc_matmul", TENSOR, ops, flops=2 * n * 128, elems_per_partition=n, partitions=128, attrs=attrs)


def test_fp8_moving_without_double_row_streams_at_the_setting_s_rate():
    # fp8_moving_cols_per_cycle: 1 column a cycle at mid and high (the 2x named only for double_row), 2 at low
    # (the 158 cFP8 TFLOPS figure); the 64-cycle issue floor stays; double_row and trn1 are not affected
    assert cost.instr_cost(_mixed_fp8_matmul(512)).cycles == 512
    assert cost.instr_cost(_mixed_fp8_matmul(512), params=LOW).cycles == 256
    assert cost.instr_cost(_mixed_fp8_matmul(384), params=LOW).busy_ns == pytest.approx(192 / 2.4)
    assert cost.instr_cost(_mixed_fp8_matmul(96), params=LOW).cycles == 48  # max(min(64, 1), 96 / 2)
    assert cost.instr_cost(matmul(128, 128, 96, "float8_e4m3"), params=LOW).cycles == 64  # the floor
    assert cost.instr_cost(matmul(128, 128, 512, "float8_e4m3", perf_mode="double_row"), params=LOW).cycles == 256
    assert cost.instr_cost(matmul(128, 128, 512), params=LOW).cycles == 512  # bf16 moving: not fp8
    assert cost.instr_cost(_mixed_fp8_matmul(512), "trn1", params=LOW).cycles == 512  # cFP8 at the BF16 rate


def _transfer_ns(nbytes: int, row: float, engines: int = 16, hbm_crossings: int = 1) -> float:
    """First to last byte of a transfer on ``engines`` DMA engines (23 B/ns each, capped at the core's HBM
    share over the engines it uses)."""
    rate = min(23.0, TRN2.hbm_bytes_per_ns / engines / hbm_crossings)
    return nbytes / (engines * rate * row / (row + MID.dma_knee_bytes))


@pytest.mark.parametrize("nbytes_row", [64, 256, 2048, 4096, 16384])
def test_pure_dma_copy_is_fixed_plus_bytes_over_bandwidth(nbytes_row):
    shape = (128, nbytes_row // 2)  # bf16
    n = 128 * nbytes_row
    rep = cost.estimate([dma_load(shape)], params=MID)
    # HBM traffic: 16 engines, each capped at its share of the core's HBM (362.5 GB/s < 16 x 23 B/ns)
    transfer = _transfer_ns(n, nbytes_row)
    assert rep.busy_ns[DMA] == pytest.approx(transfer)
    assert rep.total_ns == pytest.approx(MID.dma_fixed_ns + transfer)  # trigger to last byte
    assert rep.memory_bound_ns == pytest.approx(n / TRN2.hbm_bytes_per_ns)
    assert rep.fraction_of_roofline < 1.0


def test_dma_payload_efficiency_knee_matches_the_bandwidth_guide():
    assert cost.dma_efficiency(256, MID) == pytest.approx(0.5)  # "<256 B severely overhead-bound"
    assert cost.dma_efficiency(2048, MID) > 0.88  # ">=2 KiB approaches peak"
    assert cost.dma_efficiency(4096, MID) > 0.94  # ">=4 KiB" saturates


def test_a_packet_is_the_hbm_contiguous_run_up_to_one_engines_share():
    """[128, 128] bf16 from a contiguous HBM tensor: 256 B partition rows, but each engine's 8 rows are
    adjacent in HBM, one 2 KiB payload (the DMA overview: 2 KiB per engine in 97 ns); from a strided
    source (rows 16 KiB apart) each 256 B row is its own packet."""
    adjacent = cost.instr_cost(dma_load((128, 128), contiguous_bytes=32768))
    strided = cost.instr_cost(dma_load((128, 128), contiguous_bytes=256))
    assert adjacent.transfer_ns == pytest.approx(_transfer_ns(32768, 2048))
    assert strided.transfer_ns == pytest.approx(_transfer_ns(32768, 256))
    assert strided.transfer_ns > 1.7 * adjacent.transfer_ns


@pytest.mark.parametrize("rows, engines", [(1, 1), (4, 1), (8, 1), (9, 2), (64, 8), (128, 16)])
def test_a_transfer_uses_the_dma_engines_of_its_partitions(rows, engines):
    """8 partitions per DMA engine (DMA overview): a [4, 4096] load runs on one engine at 23 B/ns."""
    c = cost.instr_cost(dma_load((rows, 4096)))
    assert c.dma_engines == (0, engines)
    assert c.transfer_ns == pytest.approx(_transfer_ns(rows * 8192, 8192, engines))
    assert c.busy_ns == pytest.approx(c.transfer_ns * engines / 16)  # its share of the core's bandwidth
    # completion: the last of its engines (started MID.dma_engine_stagger_ns apart) and every one of the 16
    # engines' semaphore writes
    span = max(c.transfer_ns + (engines - 1) * MID.dma_engine_stagger_ns, 15 * MID.dma_engine_stagger_ns)
    assert c.latency_ns == pytest.approx(MID.dma_fixed_ns + span + MID.dma_wake_ns)


def test_a_transfer_into_upper_partitions_uses_their_engines():
    i = dma_load((4, 4096), write_boxes=(("a", 100, 104, 0, 4096),), read_boxes=(("x", 0, 1, 0, 16384),))
    assert cost.instr_cost(i).dma_engines == (12, 13)  # partitions 100..103 -> engine 12


def test_a_store_side_dma_compute_uses_its_sbuf_sources_engines():
    """out[0:8] += tile[64:72] (a dma_compute whose reads are an HBM view and an SBUF tile): the engines of the
    SBUF tile's partitions 64..71 (engine 8), not of the HBM view's first row."""
    from trnkit.nkisim import trace
    from trnkit.nkisim.tensor import from_array

    out = from_array(np.zeros((8, 256), np.float32), nl.hbm, "out")
    t = nl.ndarray((128, 256), nl.float32, buffer=nl.sbuf)
    with trace.record() as tr:
        nisa.dma_compute(dst=out[0:8, :], srcs=[out[0:8, :], t[64:72, :]], reduce_op=nl.add)
    assert cost.instr_cost(tr.instrs[0]).dma_engines == (8, 9)


def test_sbuf_to_sbuf_dma_uses_the_engine_rate():
    dst, src = opnd("dst", "sbuf", (128, 2048), "bfloat16"), opnd("src", "sbuf", (128, 2048), "bfloat16")
    i = Instr("dma_copy", DMA, (dst, src), dma_bytes=dst.nbytes, partitions=128)
    c = cost.instr_cost(i)
    eff = 4096 / (4096 + MID.dma_knee_bytes)
    assert c.busy_ns == pytest.approx(dst.nbytes / (368 * eff))  # no HBM cap


def test_vector_scalar_gpsimd_formulas():
    a = MID.access_init_cycles  # Vector / GpSimd: + the per-instruction access set-up (cost_params)
    # fp32 tensor_tensor: max(MIN_II, 2N) at 0.96 GHz
    assert cost.instr_cost(vec("tensor_tensor", (128, 512))).cycles == 1024 + a
    assert cost.instr_cost(vec("tensor_tensor", (128, 512))).busy_ns == pytest.approx((1024 + a) / 0.96)
    formula_only = replace(MID, access_init_cycles=0)
    assert cost.instr_cost(vec("tensor_tensor", (128, 512)), params=formula_only).cycles == 1024
    assert cost.instr_cost(vec("tensor_tensor", (128, 16))).cycles == 64 + a  # MIN_II floor
    # one input in PSUM: single pass
    assert cost.instr_cost(vec("tensor_tensor", (128, 512), src_buf="psum")).cycles == 512 + a
    # bf16 add in SBUF: single pass, then the trn2 2x perf mode
    assert cost.instr_cost(vec("tensor_tensor", (128, 512), "bfloat16", op="add")).cycles == 256 + a
    assert cost.instr_cost(vec("tensor_tensor", (128, 512), "bfloat16", op="add"), "trn1").cycles == 512 + a
    assert cost.instr_cost(vec("tensor_copy", (128, 512), "bfloat16")).cycles == 128 + a  # 4x perf mode
    assert cost.instr_cost(vec("reciprocal", (128, 512))).cycles == 8 * 512 + a
    assert cost.instr_cost(vec("iota", (128, 512), "int32", engine="gpsimd")).busy_ns == pytest.approx(
        (662 + a) / 1.2)
    act = cost.instr_cost(vec("activation", (128, 512), engine=SCALAR))
    assert act.busy_ns == pytest.approx(512 / 1.2 + TRN2.act_fixed_ns)  # + the ACTIVATE's fixed time
    assert cost.instr_cost(vec("activation", (128, 512), engine=SCALAR), "trn1").busy_ns == pytest.approx(512 / 1.4)
    assert cost.instr_cost(vec("activation", (128, 512), engine=SCALAR, reduce_res=True)).cycles == 512 + 64


def test_every_scalar_instruction_pays_the_activate_fixed_time():
    # a copy or tensor_scalar on ScalarE runs through the same ACTIVATE pipeline (nki.isa.activate2's
    # three stages): it cannot dodge the profiled fixed time by not being an ``activation``
    for op in ("tensor_copy", "tensor_scalar", "activation"):
        c = cost.instr_cost(vec(op, (128, 512), engine=SCALAR))
        assert c.busy_ns == pytest.approx(512 / 1.2 + TRN2.act_fixed_ns), op
    assert cost.instr_cost(vec("tensor_copy", (128, 512), engine=SCALAR), "trn1").busy_ns == pytest.approx(512 / 1.4)
    # VectorE pays no ACTIVATE time, only its access set-up
    v = cost.instr_cost(vec("tensor_copy", (128, 512)))
    assert v.busy_ns == pytest.approx((512 + MID.access_init_cycles) / 0.96)


def test_unknown_engine_is_a_clear_error():
    bad = Instr("nc_matmul", "warp", ())
    with pytest.raises(ValueError, match="nc_matmul.*unknown engine 'warp'"):
        cost.instr_cost(bad)


def _tiled_matmul_trace(M: int, N: int, K: int, deps: bool) -> list[Instr]:
    """The tiled-matmul tutorial's instruction stream, built by hand (what the interpreter records)."""
    out: list[Instr] = []
    key = iter(range(10**9))
    for m in range(M // 128):
        for n in range(N // 512):
            psum = next(key)
            for k in range(K // 128):
                a, b = next(key), next(key)

                def d(reads, writes):
                    return {"reads": reads, "writes": writes} if deps else None

                out.append(dma_load((128, 128), deps=d([("lhsT", 0, 1)], [(a, 0, 128 * 128)])))
                out.append(dma_load((128, 512), deps=d([("rhs", 0, 1)], [(b, 0, 128 * 512)])))
                out.append(matmul(128, 128, 512, deps=d([(a, 0, 1 << 14), (b, 0, 1 << 16)], [(psum, 0, 1 << 16)])))
            sb = next(key)
            cp = vec("tensor_copy", (128, 512), "bfloat16", src_buf="psum")
            if deps:
                cp.attrs.update(reads=[(psum, 0, 1 << 16)], writes=[(sb, 0, 1 << 16)])
            out.append(cp)
            st = Instr("dma_copy", DMA, (opnd("dst", "hbm", (128, 512)), opnd("src", "sbuf", (128, 512))),
                       hbm_bytes=128 * 512 * 2, dma_bytes=128 * 512 * 2, partitions=128,
                       attrs={"reads": [(sb, 0, 1 << 16)], "writes": [("out", m * 4 + n, m * 4 + n + 1)]}
                       if deps else {})
            out.append(st)
    return out


@pytest.mark.parametrize("deps", [False, True])
def test_tiled_matmul_lies_between_roofline_and_serialized_sum(deps):
    trace = _tiled_matmul_trace(512, 1024, 1024, deps)
    rep = cost.estimate(trace)
    assert rep.model == ("list-schedule" if deps else "overlap-bound")
    assert rep.roofline_ns < rep.total_ns < rep.serial_ns
    assert 0 < rep.fraction_of_roofline < 1
    assert rep.flops == 2 * 512 * 1024 * 1024
    n_mm = 4 * 2 * 8
    assert rep.count == {DMA: 2 * n_mm + 8, TENSOR: n_mm, VECTOR: 8}
    assert rep.busy_ns[TENSOR] == pytest.approx(n_mm * 512 / 2.4)
    # engines overlap: the total is far below the sum of all engines' busy time plus fixed costs
    assert rep.total_ns < 0.5 * rep.serial_ns
    assert rep.total_ns >= max(rep.busy_ns.values())
    d = rep.as_dict()
    assert d["total_ns"] == rep.total_ns and d["busy_ns"][TENSOR] == rep.busy_ns[TENSOR]
    text = str(rep)
    assert "tensor" in text and "roofline" in text and "serialized" in text


def _group_closed_by_a_ready_matmul() -> list[Instr]:
    """A PSUM accumulation group whose last matmul (covering the whole tile) has its inputs at once while
    the first waits for a long VectorE result, then a ScalarE read of the sums (the head-norm forward's
    ``eps`` matmul closing each chunk's group)."""
    full = [("p", 0, 1 << 16)]
    v0 = vec("tensor_copy", (128, 4096), reads=[("x", 0, 1)], writes=[("a", 0, 1)])
    mm1 = matmul(128, 128, 512, deps={"reads": [("a", 0, 1), ("w", 0, 1)], "writes": full})
    mm2 = matmul(128, 128, 512, deps={"reads": [("e", 0, 1), ("w", 0, 1)], "writes": full})
    rd = vec("tensor_copy", (128, 512), engine=SCALAR, src_buf="psum", reads=full, writes=[("s", 0, 1)])
    return [v0, mm1, mm2, rd]


def test_a_reader_of_an_accumulation_group_waits_for_every_matmul_even_one_moved_after_the_last():
    # By hand at the optimistic setting (trn2; LOW: access_init 0, dependent overhead 160 cycles,
    # compute_reorder on, same_engine_streaming on):
    #   v0  VectorE fp32 copy, 4,096 elements: busy 4096 / 0.96 GHz, result + 160 / 0.96 -> 4,433.33 ns
    #   mm1 waits for v0: starts 4,433.33, busy 512 / 2.4 = 213.33, result + (160 + 64) / 2.4 -> 4,740 ns
    #   mm2 waits for no one (an accumulating matmul does not wait for its group's earlier results) and
    #       takes TensorE's first gap: [0, 213.33], result 306.67 ns
    #   rd  reads the tile: its sums exist when mm1's result does, 4,740 ns (not mm2's 306.67)
    times = cost.timeline(_group_closed_by_a_ready_matmul(), "trn2", LOW)
    v0, mm1, mm2, rd = times
    assert v0.ready == pytest.approx(4096 / 0.96 + 160 / 0.96)
    assert mm2.start == pytest.approx(0.0) and mm2.ready == pytest.approx(512 / 2.4 + 224 / 2.4)
    assert mm1.start == pytest.approx(v0.ready)
    assert mm1.ready == pytest.approx(4740.0)
    assert rd.start == pytest.approx(4740.0)
    # in program order (mid) the same trace already had the reader after both matmuls
    mid = cost.timeline(_group_closed_by_a_ready_matmul(), "trn2", MID)
    assert mid[3].start == pytest.approx(max(mid[1].ready, mid[2].ready))


def test_list_schedule_follows_dependencies_and_engine_queues():
    # load -> matmul -> copy chain: fully serial when each depends on the previous
    ld = dma_load((128, 512), deps={"reads": [("x", 0, 1)], "writes": [("a", 0, 1)]})
    mm = matmul(128, 128, 512, deps={"reads": [("a", 0, 1)], "writes": [("p", 0, 1)]})
    cp = vec("tensor_copy", (128, 512), src_buf="psum")
    cp.attrs.update(reads=[("p", 0, 1)], writes=[("s", 0, 1)])
    chain = cost.estimate([ld, mm, cp])
    lat = [cost.instr_cost(i).latency_ns for i in (ld, mm, cp)]
    assert chain.total_ns == pytest.approx(sum(lat))
    # the same three instructions on independent data overlap: the total is the longest one
    mm2 = matmul(128, 128, 512, deps={"reads": [("b", 0, 1)], "writes": [("q", 0, 1)]})
    cp2 = vec("tensor_copy", (128, 512), src_buf="psum")
    cp2.attrs.update(reads=[("r", 0, 1)], writes=[("t", 0, 1)])
    par = cost.estimate([ld, mm2, cp2])
    # the kernel ends at the load's last byte (its completion semaphore wakes no one)
    assert par.total_ns == pytest.approx(max(lat[0] - MID.dma_wake_ns, lat[1], lat[2]))
    # two matmuls on one engine queue serialise their busy time even when independent
    two = cost.estimate([mm2, matmul(128, 128, 512, deps={"reads": [("c", 0, 1)], "writes": [("u", 0, 1)]})])
    assert two.total_ns == pytest.approx(2 * 512 / 2.4 + (lat[1] - 512 / 2.4))
    # write-after-read: overwriting a tile waits for its reader
    war = cost.estimate([mm, dma_load((128, 512), deps={"reads": [("x", 0, 1)], "writes": [("a", 0, 1)]})])
    mm_alone = cost.estimate([mm])
    assert war.total_ns > mm_alone.total_ns + MID.dma_fixed_ns


def test_program_instances_run_on_separate_cores():
    from dataclasses import replace

    one = [matmul(128, 128, 512) for _ in range(8)]
    two = [replace(i, program_id=k % 2) for k, i in enumerate(one)]
    r1, r2 = cost.estimate(one), cost.estimate(two)
    assert r2.n_programs == 2
    assert r2.busy_ns[TENSOR] == pytest.approx(r1.busy_ns[TENSOR] / 2)
    assert r2.total_ns < r1.total_ns


def test_empty_trace():
    rep = cost.estimate([])
    assert rep.total_ns == 0 and rep.model == "empty" and rep.fraction_of_roofline == 0.0
    assert np.isfinite(rep.roofline_ns)


def test_dma_bandwidth_timeline_fills_gaps_first_fit():
    tl = cost._Timeline()
    assert tl.place(100.0, 50.0) == 100.0  # [100, 150)
    assert tl.place(0.0, 60.0) == 0.0  # fits before it
    assert tl.place(0.0, 60.0) == 150.0  # gap [60, 100) too small -> after the last
    assert tl.place(60.0, 40.0) == 60.0  # exactly fills the gap; everything merges
    assert tl.starts == [0.0] and tl.ends == [210.0]


def test_interpreted_tiled_matmul_between_roofline_and_serial_and_trace_only_invariant():
    import torch

    from trnkit.demo import matmul_tiled
    from trnkit.nkisim import trace

    g = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 512, generator=g).to(torch.bfloat16)  # lhsT [K, M]
    b = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)  # rhs [K, N]
    reports = []
    for trace_only in (False, True):
        with trace.record(trace_only=trace_only) as tr:
            matmul_tiled(a, b)
        reports.append(cost.estimate(tr))
    rep, rep_to = reports
    assert rep.model == "list-schedule"
    n_mm = (512 // 128) * (1024 // 512) * (1024 // 128)
    assert rep.count[TENSOR] == n_mm and rep.count[DMA] == 2 * n_mm + 8
    assert rep.busy_ns[TENSOR] == pytest.approx(n_mm * 512 / 2.4)
    assert rep.flops == 2 * 512 * 1024 * 1024
    # as written, inputs read once per (m, n) tile pair: lhsT N/512 times, rhs M/128 times; output written
    # once. Their 24 KiB per partition stay resident at mid (reuse_loads "resident"): each is read once,
    # and the roofline counts that traffic
    assert sum(i.hbm_bytes for i in tr) == 2 * (1024 * 512 * 2 + 1024 * 1024 * 4) + 512 * 1024 * 2
    assert rep.hbm_bytes == 1024 * 512 * 2 + 1024 * 1024 * 2 + 512 * 1024 * 2
    assert rep.roofline_ns < rep.total_ns < rep.serial_ns
    assert rep_to.as_dict() == rep.as_dict()  # skipping matmul arithmetic must not change the estimate
    reloading = cost.estimate(tr, params=replace(MID, reuse_loads="none"))
    assert rep.busy_ns[DMA] < reloading.busy_ns[DMA] and rep.total_ns < reloading.total_ns


def test_hbm_to_hbm_dma_spreads_rows_over_all_engines():
    # 64 rows of 8 KiB, HBM -> HBM: no on-chip side; rows come from the contiguous run
    dst, src = opnd("dst", "hbm", (64, 4096)), opnd("src", "hbm", (64, 4096))
    i = Instr("dma_copy", DMA, (dst, src), hbm_bytes=2 * dst.nbytes, dma_bytes=dst.nbytes, partitions=1,
              attrs={"contiguous_bytes": 8192})
    c = cost.instr_cost(i)
    # read + write both cross HBM: the HBM share, not the 368 GB/s of the DMA engines, is the limit
    assert c.dma_engines == (0, 16)  # 64 rows use all 16 engines
    assert c.transfer_ns == pytest.approx(_transfer_ns(dst.nbytes, 8192, hbm_crossings=2))
    assert c.busy_ns == pytest.approx(c.transfer_ns)


def test_interpreted_dma_copy_is_fixed_plus_bytes_over_bandwidth():
    # one HBM -> SBUF -> HBM round trip through the interpreter: the trace's own fields drive the figures
    from trnkit.nkisim import trace

    x = np.random.default_rng(0).standard_normal((128, 1024)).astype(np.float32)
    with trace.record() as tr:
        out = dma_round_trip(x)
    np.testing.assert_array_equal(np.asarray(out), x)
    rep = cost.estimate(tr, params=MID)
    n = x.nbytes
    payload = n / 16  # contiguous in HBM: each engine's 8 rows are one 32 KiB payload
    # trigger to completion: the fixed cost, the bytes, the 16 engines' staggered starts
    one = MID.dma_fixed_ns + _transfer_ns(n, payload) + 15 * MID.dma_engine_stagger_ns
    assert rep.count == {DMA: 2} and rep.hbm_bytes == 2 * n
    assert rep.busy_ns[DMA] == pytest.approx(2 * _transfer_ns(n, payload))
    # the store is triggered once the load's completion semaphore has woken its queue
    assert rep.total_ns == pytest.approx(2 * one + MID.dma_wake_ns)


def test_core_barrier_is_a_fixed_synchronisation_not_a_data_pass():
    chip = hardware.get_chip("trn2")
    costs = []
    for buf, shape in (("sbuf", (1, 1)), ("shared_hbm", (4096, 2, 4096))):  # a counter; [T, 2, H]
        op = opnd("data", buf, shape, "float32")
        instr = Instr("core_barrier", "gpsimd", (op,), elems_per_partition=op.free_elems,
                      partitions=op.partitions)
        costs.append(cost.instr_cost(instr, "trn2"))
    assert costs[0] == costs[1]
    # the engine only issues it; the wait is one cross-core semaphore latency (1300 ns)
    assert costs[0].busy_ns < 100.0
    assert costs[0].latency_ns == pytest.approx(costs[0].busy_ns + chip.dma.fixed_ns)
    assert chip.dma.fixed_ns == 1300.0


def test_the_dma_rate_and_packet_size_range_ends():
    """Optimistic: the DMA overview's 27.2 GB/s per engine (the bandwidth guide's 23 B/ns is mid); a [4, 4096]
    load runs on one engine at that rate. Pessimistic: one packet per partition row, not per engine's rows."""
    one = dma_load((4, 4096), contiguous_bytes=32768)
    fast = cost.instr_cost(one, params=replace(MID, dma_engine_rate_factor=27.2 / 23.0))
    assert fast.transfer_ns == pytest.approx(32768 / (27.2 * 32768 / (32768 + MID.dma_knee_bytes)))
    rows = dma_load((128, 2048), contiguous_bytes=128 * 4096)  # [128, 4 KiB] of a contiguous HBM tensor
    assert cost.instr_cost(rows).transfer_ns == pytest.approx(_transfer_ns(128 * 4096, 8 * 4096))
    per_row = cost.instr_cost(rows, params=replace(MID, dma_merge_rows=False))
    assert per_row.transfer_ns == pytest.approx(_transfer_ns(128 * 4096, 4096))


def test_the_activate_fixed_time_range_applies_where_the_chip_has_one():
    a = vec("activation", (128, 64), engine=SCALAR)
    plus = replace(MID, act_fixed_offset_ns=10.0)
    assert cost.instr_cost(a, params=plus).busy_ns == pytest.approx(cost.instr_cost(a).busy_ns + 10.0)
    assert cost.instr_cost(a, "trn1", params=plus).busy_ns == cost.instr_cost(a, "trn1").busy_ns
