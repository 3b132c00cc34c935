"""Trace-only launches (large matmuls not computed): a launch argument (``memory.LaunchRules.trace_only``, set by
``nki.simulate(kernel, trace_only=True)`` or for the launches inside ``trace.record(trace_only=True)``), never a
module-wide switch; and kernels whose DMA addresses depend on computed values: router_topk-style top-k indices
used as scatter addresses (nki-library core/router_topk)."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

import trnkit.nkisim as nki
from trnkit.nkisim import collectives as ncc
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


# -------------------------------------------------------------------------------- the launch argument

started, done = threading.Event(), threading.Event()
rules_seen: list[memory.LaunchRules] = []


@nki.jit
def _matmul(xT, w, park=False):
    """out = x @ w, one 128^3 matmul (at the skip threshold); ``park``: wait inside the kernel, after the
    matmul, until the test lets it go (so another launch runs while this one is in progress)."""
    rules_seen.append(memory.current().rules)
    xs = nl.ndarray((H, T), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=xT)
    ws = nl.ndarray((H, E), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=ws, src=w)
    acc = nl.ndarray((T, E), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=xs, moving=ws)
    res = nl.ndarray((T, E), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)
    out = nl.ndarray((T, E), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res)
    if park:
        started.set()
        assert done.wait(timeout=60)
    return out


def _operands() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x^T, w (small integers: every product and sum exact in fp32) and x @ w by numpy."""
    x = RNG.integers(-3, 4, (T, H)).astype(np.float32)
    w = RNG.integers(-3, 4, (H, E)).astype(np.float32)
    want = x @ w
    assert np.abs(want).max() > 10  # not all zeros: a skipped matmul (zeros) differs from it
    return np.ascontiguousarray(x.T).astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16), want


def test_a_launch_outside_the_trace_only_block_computes_in_full_while_one_inside_runs():
    """A thread's launch inside ``trace.record(trace_only=True)`` is in progress (parked inside its kernel after
    its matmul) while this thread launches the same kernel outside any block: this one computes x @ w in full
    and is not recorded in the other's trace; the other's matmul was skipped (zeros). (The module-wide switch
    this replaced made the second launch trace-only too, and recorded it in the first one's trace.)"""
    xT, w, want = _operands()
    with trace.record() as one:  # one launch's trace, for the count
        _matmul(xT, w)
    started.clear()
    done.clear()
    got: dict = {}

    def fast() -> None:
        with trace.record(trace_only=True) as tr:
            got["fast"] = _matmul(xT, w, True)
        got["trace"] = tr

    thread = threading.Thread(target=fast)
    thread.start()
    try:
        assert started.wait(timeout=60)
        rules_seen.clear()
        full = _matmul(xT, w)
        assert rules_seen == [memory.LaunchRules(trace_only=False)]
    finally:
        done.set()
        thread.join()
    np.testing.assert_array_equal(full, want)
    np.testing.assert_array_equal(got["fast"], np.zeros((T, E), np.float32))
    assert len(got["trace"]) == len(one) == 5  # 2 loads, matmul, copy, store: of its own launch only
    assert got["trace"].by_op() == one.by_op()


def test_trace_only_is_a_launch_argument_of_nki_simulate():
    """``nki.simulate(kernel, trace_only=True)``: every launch of the returned kernel skips the matmul, recorded
    or not; the kernel itself, launched plainly meanwhile, computes; the instance's rules say which."""
    xT, w, want = _operands()
    fast = nki.simulate(_matmul, trace_only=True)
    assert fast.rules == memory.LaunchRules(trace_only=True)
    rules_seen.clear()
    np.testing.assert_array_equal(fast(xT, w), np.zeros((T, E), np.float32))
    np.testing.assert_array_equal(_matmul(xT, w), want)
    with trace.record() as tr:
        np.testing.assert_array_equal(fast(xT, w), np.zeros((T, E), np.float32))
    assert [r.trace_only for r in rules_seen] == [True, False, True]
    assert tr.by_op()["nc_matmul"] == 1
    # a block asking for trace-only makes a plain launch trace-only, never the reverse
    with trace.record(trace_only=True):
        np.testing.assert_array_equal(_matmul(xT, w), np.zeros((T, E), np.float32))


def test_every_rank_of_run_ranks_runs_under_the_callers_trace_only_block():
    """``run_ranks`` launches each rank on a thread of its own: each still belongs to the caller's block
    (recorded, trace-only), and outside a block each computes in full."""
    xT, w, want = _operands()
    with trace.record(trace_only=True) as tr:
        outs = ncc.run_ranks(_matmul, 2, lambda r: {"xT": xT, "w": w}, grid=2)
    assert [o.tolist() for o in outs] == [np.zeros((T, E), np.float32).tolist()] * 2
    assert tr.by_op()["nc_matmul"] == 4  # 2 ranks x 2 programs
    outs = ncc.run_ranks(_matmul, 2, lambda r: {"xT": xT, "w": w})
    for o in outs:
        np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("call, message", [
    (lambda: nki.simulate(_matmul, trace_only="yes"),
     "^nki.simulate: argument trace_only must be True or False, got 'yes'$"),
    (lambda: trace.record(trace_only=1).__enter__(),
     "^trace.record: argument trace_only must be True or False, got 1$"),
])
def test_a_bad_trace_only_names_the_argument_the_allowed_values_and_the_value(call, message):
    with pytest.raises(NkiValidationError, match=message):
        call()
