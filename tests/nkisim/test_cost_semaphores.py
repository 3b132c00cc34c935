"""Cost model: a dependency between two compute engines costs a semaphore wake-up
(cost_params.compute_semaphores), and an instruction's operands are paired with their own boxes
(cost._paired: the interpreter lists writes, then reads; an operand list is dst first)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import cost, hardware, trace
from trnkit.nkisim.cost_params import HIGH, LOW, MID
from trnkit.nkisim.trace import SCALAR, TENSOR, VECTOR

TRN2 = hardware.TRN2


@nki.jit
def _matmul_copy_scale(a, b):
    """A [128, 128] x [128, 512] bf16 matmul (TensorE), its PSUM result copied out by VectorE, then scaled on
    VectorE again (a same-engine dependency) and on ScalarE (a cross-engine one)."""
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    sa = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
    sb = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=sa, src=a)
    nisa.dma_copy(dst=sb, src=b)
    acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=sa, moving=sb)
    c = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=c, src=acc)
    d = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=d, data=c, op0=nl.multiply, operand0=2.0)
    e = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e, op=nl.copy, data=d, scale=0.5)
    nisa.dma_copy(dst=out, src=e)
    return out


def _trace():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(128, 128, generator=g).to(torch.bfloat16)
    b = torch.randn(128, 512, generator=g).to(torch.bfloat16)
    with trace.record() as tr:
        out = np.asarray(_matmul_copy_scale(a, b), dtype=np.float64)
    ref = a.double().T.numpy() @ b.double().numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    return list(tr)


def test_cross_engine_dependency_waits_for_the_semaphore():
    instrs = _trace()
    k_mm = next(k for k, i in enumerate(instrs) if i.op == "nc_matmul")
    k_copy = next(k for k, i in enumerate(instrs) if i.op == "tensor_copy")
    k_scale = next(k for k, i in enumerate(instrs) if i.op == "tensor_scalar")
    k_act = next(k for k, i in enumerate(instrs) if i.op == "activation")
    assert [instrs[k].engine for k in (k_mm, k_copy, k_scale, k_act)] == [TENSOR, VECTOR, VECTOR, SCALAR]
    for params in (MID, HIGH):
        off = cost.timeline(instrs, "trn2", replace(params, compute_semaphores=False))
        on = cost.timeline(instrs, "trn2", replace(params, compute_semaphores=True))
        # off: the copy starts at the matmul's dependent-instruction latency: its 512 cycles + 64 (matmul
        # fill) + dependent_overhead_cycles at 2.4 GHz
        mm = off[k_mm]
        assert off[k_copy].start == pytest.approx(
            mm.start + (512 + 64 + params.dependent_overhead_cycles + params.matmul_extra_cycles) / 2.4)
        # on: the matmul's end + the semaphore wake-up, by hand
        assert on[k_mm].start == pytest.approx(mm.start)
        assert on[k_mm].end == pytest.approx(mm.start + (512 + params.matmul_extra_cycles) / 2.4)
        assert on[k_copy].start == pytest.approx(on[k_mm].end + params.dma_wake_ns)
        # the same engine's dependent instruction does not pay it: it follows the copy as before
        shift = on[k_copy].start - off[k_copy].start
        assert on[k_scale].start - off[k_scale].start == pytest.approx(shift)
        # VectorE -> ScalarE does: its end + the wake-up (ScalarE's table-free copy starts then)
        assert on[k_act].start == pytest.approx(max(on[k_scale].end + params.dma_wake_ns, off[k_act].start + shift))
        assert on[k_act].start - on[k_scale].end == pytest.approx(params.dma_wake_ns)


def test_compute_semaphores_off_is_the_former_schedule():
    """Off, every start equals the schedule without the parameter's code path (same-engine streaming on and
    off): only cross-engine compute edges change."""
    instrs = _trace()
    for params in (LOW, MID, HIGH):
        off = cost.timeline(instrs, "trn2", replace(params, compute_semaphores=False))
        on = cost.timeline(instrs, "trn2", replace(params, compute_semaphores=True))
        dmas = [k for k, i in enumerate(instrs) if i.engine == "dma"]
        # the two loads do not depend on compute: identical
        assert [on[k].start for k in dmas[:2]] == [off[k].start for k in dmas[:2]]
        assert on[-1].end > off[-1].end


@nki.jit
def _reduce_after_read(x):
    """activation with a reduce_res written after its sources in the operand list: the interpreter lists
    writes (dst, reduce_res) then reads (data), the operands are dst, data, reduce_res."""
    out = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    sx = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=sx, src=x)
    sq = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    acc = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=sq, op=nl.square, data=sx, reduce_op=nl.add, reduce_res=acc)
    nisa.dma_copy(dst=out, src=acc)
    return out


def test_accesses_pair_each_operand_with_its_own_box():
    x = torch.randn(128, 2048).to(torch.bfloat16)  # bf16 data, fp32 reduce_res: a positional pairing sizes
    # the reduce tile with the data's item size (2 B) and the data tile with the reduce's (4 B)
    with trace.record() as tr:
        out = np.asarray(_reduce_after_read(x), dtype=np.float64)
    np.testing.assert_allclose(out[:, 0], (x.double() ** 2).sum(1).numpy(), rtol=2e-2)
    act = next(i for i in tr if i.op == "activation_reduce")
    assert [o.role for o in act.operands][0] == "dst" and "reduce_res" in [o.role for o in act.operands]
    keys = {o.role: b[0] for o, b, _ in cost._paired(act, act.attrs["write_boxes"], act.attrs["read_boxes"])}
    writes, reads = act.attrs["write_boxes"], act.attrs["read_boxes"]
    assert keys["dst"] == writes[0][0] and keys["reduce_res"] == writes[1][0] and keys["data"] == reads[0][0]
    # bytes per partition: sq 2,048 bf16 = 4 KiB, acc one fp32 = 4 B, sx 2,048 bf16 = 4 KiB
    got = {key: (n, w) for key, n, w in cost._accesses(act)}
    assert got == {writes[0][0]: (4096, True), writes[1][0]: (4, True), reads[0][0]: (4096, False)}
    tiles = cost._sbuf_tiles(list(tr))
    assert {k: t.nbytes for k, t in tiles.items()} == {writes[0][0]: 4096, writes[1][0]: 4, reads[0][0]: 4096}
