"""Trace-only mode (large matmuls not computed) on kernels whose DMA addresses depend on computed
values: router_topk-style top-k indices used as scatter addresses (nki-library core/router_topk)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import trnkit.nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import memory
from trnkit.nkisim import trace
from trnkit.nkisim.errors import NkiValidationError

RNG = np.random.default_rng(5)
T, H, E = 128, 128, 128  # one 128^3 matmul: at the trace-only skip threshold


@nki.jit
def _route_and_scatter(xT, w):
    """logits = x @ w; scatter each token's top-1 logit to out[t, argmax] through a flat
    vector_offset address t * E + argmax (the address depends on the matmul's result)."""
    xs = nl.ndarray((H, T), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=xT)
    ws = nl.ndarray((H, E), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=ws, src=w)
    acc = nl.ndarray((T, E), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=xs, moving=ws)
    logits = nl.ndarray((T, E), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=logits, src=acc)
    top = nl.ndarray((T, 8), nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=top, src=logits)
    idx = nl.ndarray((T, 8), nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=idx, data=logits, vals=top)
    row = nl.ndarray((T, 1), nl.int32, buffer=nl.sbuf)
    nisa.iota(row, [[0, 1]], offset=0, channel_multiplier=E)
    addr = nl.ndarray((T, 1), nl.int32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=addr, data1=row, data2=idx[:, 0:1], op=nl.add)
    out = nl.ndarray((T, E), nl.float32, buffer=nl.shared_hbm)
    zeros = nl.ndarray((T, E), nl.float32, buffer=nl.sbuf)
    nisa.memset(zeros, 0.0)
    nisa.dma_copy(dst=out, src=zeros)
    flat = out.reshape((T * E,))
    nisa.dma_copy(dst=flat.ap([[1, T], [1, 1]], offset=0, vector_offset=addr), src=top[:, 0:1])
    return out


def test_router_scatter_is_exact_normally_and_runs_trace_only() -> None:
    x = RNG.standard_normal((T, H)).astype(np.float32)
    w = RNG.standard_normal((H, E)).astype(np.float32)
    xb, wb = x.astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16)
    out = _route_and_scatter(np.ascontiguousarray(xb.T), wb)
    logits = xb.astype(np.float32) @ wb.astype(np.float32)
    want = np.zeros((T, E), np.float32)
    want[np.arange(T), logits.argmax(axis=1)] = logits.max(axis=1)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    with trace.record() as full:
        _route_and_scatter(np.ascontiguousarray(xb.T), wb)
    with trace.record(trace_only=True) as fast:
        _route_and_scatter(np.ascontiguousarray(xb.T), wb)
    assert [i.op for i in fast] == [i.op for i in full]
    assert fast.hbm_bytes == full.hbm_bytes


def test_trace_only_skips_out_of_bounds_computed_addresses_at_full_size() -> None:
    table = np.zeros((4, 8), np.float32)

    @nki.jit
    def scatter(t, rows):
        r = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=r, src=rows)
        v = nl.ndarray((2, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(v, 1.0)
        nisa.dma_copy(dst=t.ap([[8, 2], [1, 8]], offset=0, vector_offset=r), src=v)
        return t

    bad = np.array([[1], [9]], np.int32)  # row 9 of 4: garbage, as a skipped matmul could give
    with pytest.raises(NkiValidationError, match="indirect index 9"):
        scatter(table, bad)
    with trace.record(trace_only=True) as tr:
        scatter(table, bad)
    assert tr.instrs[-1].op == "dma_copy" and tr.instrs[-1].dma_bytes == 2 * 8 * 4
    assert table[1].tolist() == [1.0] * 8  # the in-bounds row still moved


def test_trace_only_matmul_still_reads_its_operands_for_liveness() -> None:
    """A skipped matmul still accesses its SBUF operands: a tile whose last use is a big matmul stays
    live until it, so the on-chip memory check sees the same peak with and without trace-only."""
    contexts = []

    @nki.jit
    def k(xT, w):
        contexts.append(memory.current())
        xs = nl.ndarray((H, T), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs, src=xT)
        ws = nl.ndarray((H, E), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=ws, src=w)
        big = nl.ndarray((H, 4096), nl.float32, buffer=nl.sbuf)  # allocated after the loads
        nisa.memset(dst=big, value=0.0)
        acc = nl.ndarray((T, E), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=xs, moving=ws)  # the operands' last use
        out = nl.ndarray((T, E), nl.float32, buffer=nl.shared_hbm)
        res = nl.ndarray((T, E), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        nisa.dma_copy(dst=out, src=res)
        return out

    xT = RNG.standard_normal((H, T)).astype(ml_dtypes.bfloat16)
    w = RNG.standard_normal((H, E)).astype(ml_dtypes.bfloat16)
    k(xT, w)
    with trace.record(trace_only=True):
        k(xT, w)
    peaks = [c.memory.sbuf_peak for c in contexts]
    # xs, ws and big are live together at the matmul (res is allocated after xs / ws are dead)
    assert peaks[0] == (T * 2 + E * 2 + 4096 * 4)
    assert peaks == [peaks[0], peaks[0]]
