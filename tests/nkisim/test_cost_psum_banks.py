"""Cost model: a kernel's PSUM tiles share the core's 8 PSUM banks (cost_params.psum_banks,
cost.psum_bank_plan), so a tile that takes a bank another tile held waits for that tile's accesses."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import cost, hardware, trace
from trnkit.nkisim.cost_params import HIGH, LOW, MID
from trnkit.nkisim.memory import PsumReorderWarning
from trnkit.nkisim.trace import TENSOR, VECTOR

TRN2 = hardware.TRN2
BANK = TRN2.psum_bytes_per_partition // TRN2.psum_banks  # 2 KiB per partition


@nki.jit
def _matmul_then_copy(a, b, n: int):
    """``n`` times: a [128, 128] x [128, 512] matmul into a fresh PSUM tile (512 fp32 = one bank), then
    VectorE reads it three times (times 1, 2 and 3, each into its own SBUF tile: three results, none a
    recomputation), the first stored to HBM row block ``i``."""
    out = nl.ndarray((n * 128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    sa = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
    sb = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=sa, src=a)
    nisa.dma_copy(dst=sb, src=b)
    for i in range(n):
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=sa, moving=sb)
        res = []
        for scale in (1.0, 2.0, 3.0):
            res.append(nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf))
            nisa.tensor_scalar(dst=res[-1], data=acc, op0=nl.multiply, operand0=scale)
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=res[0])
    return out


@nki.jit
def _all_matmuls_first(a, b, n: int):
    """``n`` PSUM tiles all written before any is read: ``n`` banks live at once in program order."""
    out = nl.ndarray((n * 128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    sa = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
    sb = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=sa, src=a)
    nisa.dma_copy(dst=sb, src=b)
    accs = []
    for _ in range(n):
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=sa, moving=sb)
        accs.append(acc)
    for i, acc in enumerate(accs):
        res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=res)
    return out


def _run(kernel, n):
    """bf16 operands: a matmul holds TensorE 512 cycles at 2.4 GHz (213 ns), each fp32 read of its tile out
    of PSUM VectorE 512 cycles at 0.96 GHz (533 ns), so the reads fall behind the matmuls."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(128, 128, generator=g).to(torch.bfloat16)
    b = torch.randn(128, 512, generator=g).to(torch.bfloat16)
    with trace.record() as tr:
        out = np.asarray(kernel(a, b, n), dtype=np.float64)
    ref = a.double().T.numpy() @ b.double().numpy()
    np.testing.assert_allclose(out, np.tile(ref, (n, 1)), rtol=1e-5, atol=1e-4)
    return list(tr)


def _psum_keys(instrs):
    """The PSUM tiles' storage keys in the order their matmuls write them."""
    return [i.attrs["write_boxes"][0][0] for i in instrs if i.op == "nc_matmul"]


def test_bank_plans_by_hand():
    instrs = _run(_matmul_then_copy, 10)
    keys = _psum_keys(instrs)
    # each tile is dead (its copy done, in program order) before the next matmul takes a bank
    rotate = cost.psum_bank_plan(instrs, TRN2, "rotate")
    assert [rotate[k][0] // BANK for k in keys] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    lowest = cost.psum_bank_plan(instrs, TRN2, "lowest")
    assert [lowest[k][0] // BANK for k in keys] == [0] * 10
    assert all(item == 4 for _, item in rotate.values())  # fp32 PSUM tiles
    assert cost.psum_bank_plan(instrs, TRN2, "unbounded") == {}
    # nine tiles live at once: the ninth finds no free bank in program order and keeps its own storage
    with pytest.warns(PsumReorderWarning, match="9 banks live at once in program order"):  # the interpreter agrees
        nine = _run(_all_matmuls_first, 9)
    plan = cost.psum_bank_plan(nine, TRN2, "rotate")
    assert [plan[k][0] // BANK for k in _psum_keys(nine)[:8]] == list(range(8))
    assert _psum_keys(nine)[8] not in plan


def test_a_tile_waits_for_the_tile_that_held_its_bank():
    instrs = _run(_matmul_then_copy, 10)

    def engine_times(rule):
        times = cost.timeline(instrs, "trn2", replace(MID, psum_banks=rule))
        return ([t for t in times if t.engine == TENSOR], [t for t in times if t.engine == VECTOR])

    mm, cp = engine_times("unbounded")
    # every tile its own storage: TensorE runs its ten matmuls back to back, VectorE's reads (three per
    # tile, cp[3k + 2] the last read of tile k) fall behind
    assert all(b.start == pytest.approx(a.end) for a, b in zip(mm, mm[1:]))
    assert cp[2].end > mm[8].start
    mm, cp = engine_times("rotate")
    # the ninth matmul takes bank 0 again: it starts only once tile 0's last read has read bank 0 (WAR);
    # the second to eighth wait for no read
    assert mm[8].start >= cp[2].end
    assert all(b.start == pytest.approx(a.end) for a, b in zip(mm[:8], mm[1:8]))
    mm, cp = engine_times("lowest")
    # one bank for every tile: each matmul waits for the previous tile's last read
    assert all(mm[k + 1].start >= cp[3 * k + 2].end for k in range(9))
    totals = [cost.estimate(instrs, params=replace(MID, psum_banks=r)).total_ns
              for r in ("unbounded", "rotate", "lowest")]
    assert totals[0] <= totals[1] <= totals[2] and totals[0] < totals[2]


def test_the_settings_and_a_bad_rule():
    assert (LOW.psum_banks, MID.psum_banks, HIGH.psum_banks) == ("unbounded",) * 3  # a what-if (docs)
    instrs = _run(_matmul_then_copy, 2)
    with pytest.raises(ValueError, match=r"psum_banks must be one of \('unbounded', 'rotate', 'lowest'\), "
                                         r"got 'round_robin'"):
        cost.estimate(instrs, params=replace(MID, psum_banks="round_robin"))
