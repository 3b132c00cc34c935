"""nisa.dma_transpose: values vs numpy transpose, the documented rules, OOB, trace record and its cost."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from trnkit.nkisim import cost, cost_params, trace
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim.errors import NkiValidationError
from trnkit.nkisim.tensor import from_array

RNG = np.random.default_rng(7)
BF16 = np.dtype(ml_dtypes.bfloat16)


def hb(values: np.ndarray, name: str = "x"):
    return from_array(np.ascontiguousarray(values), nl.hbm, name)


def sb(shape, dtype=nl.bfloat16):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


@pytest.mark.parametrize("shape,axes", [((64, 128), (1, 0)), ((16, 3, 128), (2, 1, 0)),
                                        ((16, 2, 4, 128), (3, 1, 2, 0)), ((128, 1, 1, 96), (3, 1, 2, 0))])
def test_values_match_numpy_transpose(shape, axes):
    a = RNG.standard_normal(shape).astype(BF16)
    dst = sb(tuple(shape[i] for i in axes))
    nisa.dma_transpose(dst=dst, src=hb(a))  # axes=None: the rank's permutation
    np.testing.assert_array_equal(dst.np(), np.transpose(a, axes))
    dst2 = sb(tuple(shape[i] for i in axes))
    nisa.dma_transpose(dst=dst2, src=hb(a), axes=axes, dge_mode=nisa.dge_mode.unknown)
    np.testing.assert_array_equal(dst2.np(), np.transpose(a, axes))


def test_sbuf_source_fp32_and_strided_hbm_view():
    a = RNG.standard_normal((256, 384)).astype(np.float32)
    x = hb(a)
    s = sb((96, 128), nl.float32)
    nisa.dma_copy(dst=s, src=x[0:96, 128:256])
    d = sb((128, 96), nl.float32)
    nisa.dma_transpose(dst=d, src=s)  # SBUF -> SBUF, fp32 (2-byte rule only with hwdge)
    np.testing.assert_array_equal(d.np(), a[0:96, 128:256].T)
    # a strided 4-D view in the plain form [A, 1, 1, F]: rows 1, 3, 5, ... columns 128..255
    v = x.ap(pattern=[[2 * 384, 64], [1, 1], [1, 1], [1, 128]], offset=384 + 128)
    d4 = sb((128, 1, 1, 64), nl.float32)
    nisa.dma_transpose(dst=d4, src=v, axes=(3, 1, 2, 0))
    np.testing.assert_array_equal(d4.np()[:, 0, 0, :], a[1:129:2, 128:256].T)


def test_hwdge_accepts_documented_shapes():
    a = RNG.standard_normal((16, 256)).astype(BF16)
    d = sb((128, 16))
    nisa.dma_transpose(dst=d, src=hb(a[:, 0:128]), dge_mode=nisa.dge_mode.hwdge)
    np.testing.assert_array_equal(d.np(), a[:, 0:128].T)
    # 4-D: 16 rows, any middle dims, 128 columns (router_topk's x^T load)
    b = RNG.standard_normal((16 * 4, 3 * 128)).astype(BF16)  # rows r*4 + j, columns h*128 + c
    v = hb(b).ap(pattern=[[4 * 384, 16], [384, 4], [128, 3], [1, 128]], offset=0)
    d4 = sb((128, 4, 3, 16))
    nisa.dma_transpose(dst=d4, src=v, dge_mode=nisa.dge_mode.hwdge)
    np.testing.assert_array_equal(d4.np(), b.reshape(16, 4, 3, 128).transpose(3, 1, 2, 0))


@pytest.mark.parametrize("make,match", [
    (lambda: (sb((128, 32)), hb(np.zeros((32, 128), BF16)), {"dge_mode": nisa.dge_mode.hwdge}),
     r"hwdge: needs src.shape\[0\] == 16, got 32"),
    (lambda: (sb((128, 2, 4, 8)), hb(np.zeros((8, 2, 4, 128), BF16)), {"dge_mode": nisa.dge_mode.hwdge}),
     r"hwdge: needs src.shape\[0\] == 16, got 8"),
    (lambda: (sb((64, 2, 16)), hb(np.zeros((16, 2, 64), BF16)), {"dge_mode": nisa.dge_mode.hwdge}),
     r"hwdge: needs src.shape\[-1\] == 128 .* got 64"),
    (lambda: (sb((128, 16), nl.float32), hb(np.zeros((16, 128), np.float32)), {"dge_mode": nisa.dge_mode.hwdge}),
     r"hwdge: needs a 2-byte src dtype, got float32 \(4 bytes\)"),
    (lambda: (sb((128, 16, 16)), hb(np.zeros((16, 16, 256), BF16)), {}),
     r"src.shape\[-1\] must be <= 128 .* got 256"),
    # router_topk's former x^T load: 128 rows and non-trivial middle dims under dge_mode=unknown
    (lambda: (sb((128, 2, 3, 128)), hb(np.zeros((128, 2, 3, 128), BF16)), {}),
     r"dge_mode=unknown: src shape \(128, 2, 3, 128\) meets neither the hardware-DGE rules"),
    (lambda: (sb((128, 3, 16), nl.float32), hb(np.zeros((16, 3, 128), np.float32)), {}),
     r"meets neither the hardware-DGE rules \(needs a 2-byte src dtype"),
    (lambda: (sb((128, 16)), hb(np.zeros((16, 128), BF16)), {"dge_mode": nisa.dge_mode.swdge}),
     "only valid dge_modes are unknown, hwdge and none \\(static\\); swdge needs an indirect "
     "\\(vector_offset\\) src, got dge_mode.swdge"),
    (lambda: (sb((128, 16)), hb(np.zeros((16, 128), BF16)), {"axes": (0, 1)}),
     r"axes must be \(1, 0\) for a 2-D src .* got \(0, 1\)"),
    (lambda: (sb((4, 3, 2)), hb(np.zeros((2, 3, 4), BF16)), {"axes": (1, 0, 2)}),
     r"axes must be \(2, 1, 0\) for a 3-D src"),
    (lambda: (sb((8,)), hb(np.zeros((8,), BF16)), {}), r"src must be 2-D, 3-D or 4-D .* got shape \(8,\)"),
    (lambda: (sb((64, 32)), hb(np.zeros((64, 32), BF16)), {}),
     r"dst shape must be src shape \(64, 32\) permuted by \(1, 0\) = \(32, 64\), got \(64, 32\)"),
    (lambda: (sb((32, 64), nl.float32), hb(np.zeros((64, 32), BF16)), {}), "dst dtype must equal src dtype"),
    (lambda: (hb(np.zeros((32, 64), BF16), "o"), hb(np.zeros((64, 32), BF16)), {}), "dst must be in sbuf"),
    (lambda: (nl.ndarray((32, 64), nl.bfloat16, buffer=nl.psum), sb((64, 32)), {}), "dst cannot be in PSUM"),
    (lambda: (sb((32, 64)), nl.ndarray((64, 32), nl.bfloat16, buffer=nl.psum), {}), "src cannot be in PSUM"),
])
def test_rules_raise_with_rule_and_values(make, match):
    dst, src, kw = make()
    with pytest.raises(NkiValidationError, match=match):
        nisa.dma_transpose(dst=dst, src=src, **kw)


def test_oob_error_and_skip():
    a = RNG.standard_normal((512, 128)).astype(BF16)
    x = hb(a)
    b = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.memset(b, 128)
    d = sb((128, 128))
    nisa.dma_transpose(dst=d, src=x.ap(pattern=[[128, 128], [1, 128]], offset=0, scalar_offset=b))
    np.testing.assert_array_equal(d.np(), a[128:256].T)
    nisa.memset(b, 500)
    with pytest.raises(NkiValidationError, match="dynamic scalar_offset value 500"):
        nisa.dma_transpose(dst=d, src=x.ap(pattern=[[128, 128], [1, 128]], scalar_offset=b))
    before = d.np().copy()
    with trace.record() as tr:
        nisa.dma_transpose(dst=d, src=x.ap(pattern=[[128, 128], [1, 128]], scalar_offset=b),
                           oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(d.np(), before)
    assert tr.instrs[-1].dma_bytes == 0


def test_trace_record_and_cost_factor():
    a = RNG.standard_normal((16, 2048)).astype(BF16)
    x = hb(a)
    with trace.record() as tr:
        c = sb((16, 2048))
        nisa.dma_copy(dst=c, src=x)
        t = sb((128, 16, 16))
        nisa.dma_transpose(dst=t, src=x.ap(pattern=[[2048, 16], [128, 16], [1, 128]], offset=0),
                           name="xT")
        t2 = sb((128, 16, 16))
        nisa.dma_transpose(dst=t2, src=c.ap(pattern=[[2048, 16], [128, 16], [1, 128]], offset=0))
    cp, tx, ts = tr.instrs[-3:]
    assert (tx.op, tx.engine, tx.dma_bytes, tx.hbm_bytes) == ("dma_transpose", "dma", a.nbytes, a.nbytes)
    assert tx.attrs["transpose"] and tx.attrs["name"] == "xT" and tx.attrs["dge_mode"] == "unknown"
    assert (ts.dma_bytes, ts.hbm_bytes) == (a.nbytes, 0)
    # trn2 arch guide: transpose throughput <= 90% of a copy's from HBM (the optimistic end of the model's
    # range; 70% mid, 50% pessimistic: cost_params.dma_transpose_factor), <= 50% SBUF -> SBUF
    # (against a copy of the same operand geometry)
    ctx, cts = cost.instr_cost(tx), cost.instr_cost(ts)
    # a copy of the same geometry: the transpose's operands and partition boxes, without transpose
    plain = {k: v for k, v in tx.attrs.items() if k not in ("transpose", "contiguous_bytes")}
    same = cp.__class__(**{**cp.__dict__, "operands": tx.operands, "attrs": plain})
    ch = cost.instr_cost(same)
    assert ctx.busy_ns == pytest.approx(ch.busy_ns / 0.7)
    best = cost.instr_cost(tx, params=cost_params.LOW)
    assert best.busy_ns == pytest.approx(cost.instr_cost(same, params=cost_params.LOW).busy_ns / 0.9)
    plain_s = {k: v for k, v in ts.attrs.items() if k not in ("transpose", "contiguous_bytes")}
    cs = cost.instr_cost(cp.__class__(**{**cp.__dict__, "hbm_bytes": 0, "operands": ts.operands, "attrs": plain_s}))
    assert cts.busy_ns == pytest.approx(cs.busy_ns / 0.5)
