"""The ``reduce_cmd`` accumulation registers of the Vector Engine (tensor_scalar_reduce, tensor_scalar_cumulative,
select_reduce, range_select) and of the Scalar Engine (activation, activation_reduce) belong to a kernel instance
(``memory.KernelContext.accumulators``): each launch starts with none set, each program of a grid / LNC=2 launch
has its own, an inlined ``@nki.jit`` helper shares its caller's. A read of registers nothing in the instance has
set raises ``isa.vector.AccumulatorNotSetWarning`` (the NKI docs give no value at kernel start) and reads the
reduce operator's identity. Every expected value is computed by hand from integer-valued data (exact in fp32)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import memory
from trnkit.nkisim.isa.vector import Accumulators, AccumulatorNotSetWarning

F32 = nl.float32
P = 128
RNG = np.random.default_rng(22)


def _ints(rows: int, cols: int, lo: int = -8, hi: int = 9) -> np.ndarray:
    return RNG.integers(lo, hi, size=(rows, cols)).astype(np.float32)


def _load(x, r0: int = 0, p: int = P, cols: int = 96):
    t = nl.ndarray((p, cols), F32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[r0:r0 + p, 0:cols])
    return t


def _store(t):
    out = nl.ndarray(t.shape, F32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def _no_warnings(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


def _warned(fn, *args) -> tuple[np.ndarray, list[AccumulatorNotSetWarning]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [w.message for w in caught if issubclass(w.category, AccumulatorNotSetWarning)]


@nki.jit
def aws_style(x):
    """reset_reduce first, then reduce across instructions (Vector sums, a Vector scan, Scalar sums)."""
    t = _load(x)
    junk = nl.ndarray((P, 32), F32, buffer=nl.sbuf)
    res = nl.ndarray((P, 5), F32, buffer=nl.sbuf)
    scan = nl.ndarray((P, 64), F32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=junk, data=t[:, 0:32], op0=nl.multiply, operand0=1.0, reduce_op=nl.add,
                              reduce_res=res[:, 0:1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.tensor_scalar_reduce(dst=junk, data=t[:, 32:64], op0=nl.multiply, operand0=1.0, reduce_op=nl.add,
                              reduce_res=res[:, 1:2], reduce_cmd=nisa.reduce_cmd.reduce)
    nisa.tensor_scalar_cumulative(dst=scan[:, 0:32], src=t[:, 0:32], op0=nl.multiply, op1=nl.add, imm0=1.0,
                                  reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.tensor_scalar_cumulative(dst=scan[:, 32:64], src=t[:, 32:64], op0=nl.multiply, op1=nl.add, imm0=1.0,
                                  reduce_cmd=nisa.reduce_cmd.reduce)
    nisa.activation(dst=junk, op=nl.copy, data=t[:, 64:96], reduce_op=nl.add, reduce_res=res[:, 2:3],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.activation(dst=junk, op=nl.copy, data=t[:, 0:32], reduce_res=res[:, 3:4])  # idle: read only
    nisa.activation(dst=junk, op=nl.copy, data=t[:, 0:32], reduce_op=nl.add, reduce_res=res[:, 4:5],
                    reduce_cmd=nisa.reduce_cmd.reduce)
    return _store(res), _store(scan)


def _aws_style_want(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b, c = x[:, 0:32].sum(1), x[:, 32:64].sum(1), x[:, 64:96].sum(1)
    return np.stack([a, a + b, c, c, c + a], axis=1), np.cumsum(x[:, 0:64], axis=1)


def test_aws_style_reset_then_reduce_runs_silently_with_the_sums_by_hand():
    x = _ints(P, 96)
    res, scan = _no_warnings(aws_style, x)
    want_res, want_scan = _aws_style_want(x)
    np.testing.assert_array_equal(res, want_res)
    np.testing.assert_array_equal(scan, want_scan)


@nki.jit
def first_read(x, what):
    """One read of registers nothing in this kernel has set."""
    t = _load(x, cols=32)
    dst = nl.ndarray((P, 32), F32, buffer=nl.sbuf)
    res = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
    if what == "tensor_scalar_reduce":
        nisa.tensor_scalar_reduce(dst=dst, data=t, op0=nl.multiply, operand0=1.0, reduce_op=nl.maximum,
                                  reduce_res=res, reduce_cmd=nisa.reduce_cmd.reduce)
    elif what == "tensor_scalar_cumulative":
        nisa.tensor_scalar_cumulative(dst=dst, src=t, op0=nl.multiply, op1=nl.add, imm0=1.0,
                                      reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.tensor_copy(dst=res, src=dst[:, 31:32])
    elif what == "activation reduce":
        nisa.activation(dst=dst, op=nl.copy, data=t, reduce_op=nl.add, reduce_res=res,
                        reduce_cmd=nisa.reduce_cmd.reduce)
    elif what == "activation idle":
        nisa.activation(dst=dst, op=nl.copy, data=t, reduce_res=res)
    else:  # select_reduce idle: reads the Vector registers into reduce_res
        pred = nl.ndarray((P, 32), nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=pred, value=1)
        nisa.select_reduce(dst=dst, predicate=pred, on_true=t, on_false=0.0, reduce_res=res)
    return _store(res)


# (what, engine, the value read by hand): the reduce operator's identity where no register was set
FIRST_READS = [
    ("tensor_scalar_reduce", "Vector", lambda x: x.max(1)),  # max(-inf, part); the old thread state gave max(0, part)
    ("tensor_scalar_cumulative", "Vector", lambda x: x.sum(1)),  # the scan starts at 0
    ("activation reduce", "Scalar", lambda x: x.sum(1)),
    ("activation idle", "Scalar", lambda x: np.zeros(P, np.float32)),
    ("select_reduce", "Vector", lambda x: np.full(P, -np.inf, np.float32)),
]


@pytest.mark.parametrize("what,engine,want", FIRST_READS, ids=[w[0] for w in FIRST_READS])
def test_a_first_read_without_reset_warns_naming_instruction_register_and_doc(what, engine, want):
    x = _ints(P, 32, -9, -1)  # all negative: a zero start would show in the max
    out, ws = _warned(first_read, x, what)
    op = what.split()[0]
    assert [(w.op, w.engine, w.partitions) for w in ws] == [(op, engine.lower(), tuple(range(P)))]
    msg = str(ws[0])
    assert msg.startswith(f"{op} at test_accumulators.py:")
    assert f"reads the {engine} Engine accumulation registers of partitions [0, 128) before anything in this " \
        "kernel instance set them (reduce_cmd reset / reset_reduce / load_reduce)" in msg
    assert 'nki.isa.reduce_cmd: "reduce: Keeps accumulating over the current value of the accumulator ' \
        'registers"; no NKI doc gives their value at kernel start' in msg
    np.testing.assert_array_equal(out[:, 0], want(x))


def test_the_warning_is_not_an_error_under_strict_and_the_same_under_strict_false():
    x = _ints(P, 32)
    for kernel in (first_read, nki.simulate(first_read, strict=False)):
        out, ws = _warned(kernel, x, "activation reduce")
        assert len(ws) == 1
        np.testing.assert_array_equal(out[:, 0], x.sum(1))


@nki.jit
def half_set(x):
    """reset_reduce on partitions [0, 64), then reduce on all 128: only [64, 128) were never set."""
    t = _load(x, cols=64)
    junk = nl.ndarray((P, 32), F32, buffer=nl.sbuf)
    res = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=junk[0:64], data=t[0:64, 0:32], op0=nl.multiply, operand0=1.0,
                              reduce_op=nl.add, reduce_res=res[0:64], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.tensor_scalar_reduce(dst=junk, data=t[:, 32:64], op0=nl.multiply, operand0=1.0, reduce_op=nl.add,
                              reduce_res=res, reduce_cmd=nisa.reduce_cmd.reduce)
    return _store(res)


def test_registers_are_tracked_per_partition():
    x = _ints(P, 64)
    out, ws = _warned(half_set, x)
    assert [w.partitions for w in ws] == [tuple(range(64, P))]
    assert "partitions [64, 128)" in str(ws[0])
    a, b = x[:, 0:32].sum(1), x[:, 32:64].sum(1)
    np.testing.assert_array_equal(out[:, 0], np.where(np.arange(P) < 64, a + b, b))


def test_two_launches_in_a_row_on_one_thread_do_not_see_each_others_registers():
    x = _ints(P, 96, 100, 200)  # the first launch leaves large sums in both engines' registers
    _no_warnings(aws_style, x)
    y = _ints(P, 32)
    for what in ("tensor_scalar_reduce", "activation reduce"):
        out, ws = _warned(first_read, y, what)
        assert len(ws) == 1  # a fresh launch: nothing set
        want = y.max(1) if what == "tensor_scalar_reduce" else y.sum(1)
        np.testing.assert_array_equal(out[:, 0], want)


contexts: list[memory.KernelContext] = []


@nki.jit
def per_program(x):
    """Each program (LNC=2 core) sums its own 128 rows: reset_reduce, then reduce, on both engines."""
    pid = nl.program_id(0)
    contexts.append(memory.current())
    t = _load(x, r0=pid * P, cols=64)
    junk = nl.ndarray((P, 32), F32, buffer=nl.sbuf)
    res = nl.ndarray((P, 2), F32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=junk, data=t[:, 0:32], op0=nl.multiply, operand0=1.0, reduce_op=nl.add,
                              reduce_res=res[:, 0:1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.activation(dst=junk, op=nl.copy, data=t[:, 32:64], reduce_op=nl.add, reduce_res=res[:, 1:2],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.tensor_scalar_reduce(dst=junk, data=t[:, 32:64], op0=nl.multiply, operand0=1.0, reduce_op=nl.add,
                              reduce_res=res[:, 0:1], reduce_cmd=nisa.reduce_cmd.reduce)
    nisa.activation(dst=junk, op=nl.copy, data=t[:, 0:32], reduce_op=nl.add, reduce_res=res[:, 1:2],
                    reduce_cmd=nisa.reduce_cmd.reduce)
    return _store(res)


def test_lnc2_programs_each_have_their_own_registers():
    x = np.concatenate([_ints(P, 64, 1, 9), _ints(P, 64, -9, -1)])
    contexts.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        per_program[2](x)
    assert len(contexts) == 2
    regs = [(c.flat_program_id, c.accumulators) for c in contexts]
    for pid, acc in regs:
        rows = x[pid * P:(pid + 1) * P]
        total = rows[:, 0:64].sum(1)
        assert isinstance(acc["vector"], Accumulators) and acc["vector"].is_set.all()
        np.testing.assert_array_equal(acc["vector"].value[:, 0], total)
        np.testing.assert_array_equal(acc["scalar"].value[:, 0], total)
    assert regs[0][1]["vector"] is not regs[1][1]["vector"]


@nki.jit
def continue_sum(t, junk, res):
    """A helper kernel: inlined into its caller's program, it continues the caller's registers."""
    nisa.tensor_scalar_reduce(dst=junk, data=t[:, 32:64], op0=nl.multiply, operand0=1.0, reduce_op=nl.add,
                              reduce_res=res, reduce_cmd=nisa.reduce_cmd.reduce)


@nki.jit
def calls_helper(x):
    t = _load(x, cols=64)
    junk = nl.ndarray((P, 32), F32, buffer=nl.sbuf)
    res = nl.ndarray((P, 1), F32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=junk, data=t[:, 0:32], op0=nl.multiply, operand0=1.0, reduce_op=nl.add,
                              reduce_res=res, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    continue_sum(t, junk, res)
    return _store(res)


def test_an_inlined_helper_shares_its_callers_registers():
    x = _ints(P, 64)
    out = _no_warnings(calls_helper, x)
    np.testing.assert_array_equal(out[:, 0], x[:, 0:64].sum(1))
