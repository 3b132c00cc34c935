"""Rules for uses the NKI docs call invalid or undefined: runtime loops, registers, LNC=2 control flow,
DMA modes, the activation table. Each rule has a positive test (an AWS-style use that runs, with its
numbers checked) and a negative test (the documented-invalid use raises naming the instruction, the
rule, the values and the doc). ``strict=False`` turns undefined behaviour into a warning.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from trnkit.nkisim import isa as nisa
from trnkit.nkisim import jit, simulate
from trnkit.nkisim import language as nl
from trnkit.nkisim.controlflow import UndefinedBehaviourWarning
from trnkit.nkisim.errors import NkiValidationError

RNG = np.random.default_rng(22)
MIGRATION = r'NKI 0.6 migration guide, "Rules for migrated loops"'


def _register_from(hbm_1x1):
    """A register loaded at run time from a [1, 1] int32 HBM value (a runtime loop bound)."""
    sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sb, src=hbm_1x1)
    reg = nisa.register_alloc()
    nisa.register_load(reg, sb)
    return reg


# -- registers and runtime loops ------------------------------------------------------------------

@jit
def _rows_sum_sbuf_state(x, n):
    """Sum of rows 0..n-1 of x [R, F]: the running sum lives in SBUF (the migration guide's way)."""
    R, F = x.shape
    out = nl.ndarray((1, F), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((1, F), dtype=nl.float32, buffer=nl.sbuf)
    row = nl.ndarray((1, F), dtype=nl.float32, buffer=nl.sbuf)

    def body(i):
        nisa.dma_copy(dst=row, src=x.ap([[F, 1], [1, F]], scalar_offset=i, indirect_dim=0))
        nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)

    nl.fori_loop(0, _register_from(n), body)
    nisa.dma_copy(dst=out, src=acc)
    return out


def test_fori_loop_with_state_in_sbuf_runs():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    got = _rows_sum_sbuf_state(x, np.array([[4]], np.int32))
    np.testing.assert_allclose(got[0], x[:4].sum(0), rtol=1e-6)


@jit
def _previous_row_in_register(x, n):
    """Copies row i-1 in iteration i, the previous index carried in a register (moe_fused's old
    ``register_move(prev, i)``)."""
    R, F = x.shape
    out = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.shared_hbm)
    row = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.sbuf)
    prev = nisa.register_alloc(0)

    def body(i):
        nisa.dma_copy(dst=row, src=x.ap([[F, 1], [1, F]], scalar_offset=prev, indirect_dim=0))
        nisa.register_move(prev, i)

    nl.fori_loop(0, _register_from(n), body)
    nisa.dma_copy(dst=out, src=row)
    return out


def test_register_carried_across_fori_loop_iterations_raises():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    with pytest.raises(NkiValidationError, match=r"VirtualRegister: register VirtualRegister\(0\) was "
                       r"written in nl.fori_loop at test_strict_rules.py:\d+, iteration 0 and is read in "
                       r"iteration 1: loop state carried in a register across runtime-loop iterations \("
                       + MIGRATION + r': "Keep cross-iteration state in SBUF or HBM"'):
        _previous_row_in_register(x, np.array([[3]], np.int32))


@jit
def _register_read_after_loop(x, n):
    R, F = x.shape
    out = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.shared_hbm)
    row = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.sbuf)
    last = nisa.register_alloc(0)

    def body(i):
        nisa.register_move(last, i)  # a scratch register written and read in the same iteration: fine
        nisa.dma_copy(dst=row, src=x.ap([[F, 1], [1, F]], scalar_offset=last, indirect_dim=0))

    nl.fori_loop(0, _register_from(n), body)
    nisa.dma_copy(dst=row, src=x.ap([[F, 1], [1, F]], scalar_offset=last, indirect_dim=0))
    nisa.dma_copy(dst=out, src=row)
    return out


def test_register_written_in_loop_and_read_after_it_raises():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    with pytest.raises(NkiValidationError, match=r"written in nl.fori_loop at .*, iteration 2 and is "
                       r"read after that nl.fori_loop ended: loop state carried in a register"):
        _register_read_after_loop(x, np.array([[3]], np.int32))


@jit
def _nested_loop_carry(x, n):
    """An inner runtime loop whose body carries a register between its iterations (NKI 0.4.0 known
    issue: nested runtime loops with loop-carried values fail to compile)."""
    R, F = x.shape
    out = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.shared_hbm)
    row = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.sbuf)
    hi = _register_from(n)

    def outer(i):
        prev = nisa.register_alloc(0)  # per outer iteration: fine there, carried by the inner loop

        def inner(j):
            nisa.dma_copy(dst=row, src=x.ap([[F, 1], [1, F]], scalar_offset=prev, indirect_dim=0))
            nisa.register_move(prev, j)

        nl.fori_loop(0, hi, inner)

    nl.fori_loop(0, 2, outer)
    nisa.dma_copy(dst=out, src=row)
    return out


def test_register_carried_in_nested_runtime_loop_raises():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    with pytest.raises(NkiValidationError, match=r"written in nl.fori_loop at .*, iteration 0 and is read "
                       r"in iteration 1"):
        _nested_loop_carry(x, np.array([[2]], np.int32))


@jit
def _write_loop_variable(x):
    out = nl.ndarray((1, 4), dtype=x.dtype, buffer=nl.shared_hbm)

    def body(i):
        nisa.register_move(i, 0)

    nl.fori_loop(0, 2, body)
    return out


def test_loop_variable_is_read_only():
    with pytest.raises(NkiValidationError, match=r"register_move: cannot write the loop variable of "
                       r"nl.fori_loop \(VirtualRegister\(0\)\): the loop variable is read-only \("
                       + MIGRATION):
        _write_loop_variable(np.zeros((2, 4), np.float32))


@jit
def _body_returns_value(x):
    out = nl.ndarray((1, 4), dtype=x.dtype, buffer=nl.shared_hbm)

    def body(i):
        return i

    nl.fori_loop(0, 2, body)
    return out


def test_fori_loop_body_returning_a_value_raises():
    with pytest.raises(NkiValidationError, match=r"nl.fori_loop: the body function returned "
                       r"VirtualRegister\(0\); a fori_loop body cannot return a value \(" + MIGRATION):
        _body_returns_value(np.zeros((2, 4), np.float32))


@jit
def _tile_used_after_loop(x):
    F = x.shape[1]
    out = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.shared_hbm)
    tiles = []

    def body(i):
        t = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.ap([[F, 1], [1, F]], scalar_offset=i, indirect_dim=0))
        tiles.append(t)

    nl.fori_loop(0, 2, body)
    nisa.dma_copy(dst=out, src=tiles[-1])
    return out


def test_tensor_allocated_in_loop_body_used_after_the_loop_raises():
    with pytest.raises(NkiValidationError, match=r"dma_copy: src 'sbuf_\d+' was allocated in nl.fori_loop "
                       r"at .*, iteration 1 and is used after that nl.fori_loop ended; tensors declared "
                       r"in a runtime loop body cannot be referenced outside of it \(" + MIGRATION):
        _tile_used_after_loop(np.zeros((2, 4), np.float32))


@jit
def _no_reorder_around_loop(x):
    out = nl.ndarray((1, 4), dtype=x.dtype, buffer=nl.shared_hbm)
    with nl.no_reorder():
        nl.fori_loop(0, 2, lambda i: None)
    return out


@jit
def _no_reorder_inside_body(x):
    F = x.shape[1]
    out = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.sbuf)

    def body(i):
        with nl.no_reorder():  # the dynamic loops guide's workaround
            nisa.dma_copy(dst=t, src=x.ap([[F, 1], [1, F]], scalar_offset=i, indirect_dim=0))

    nl.fori_loop(0, 2, body)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_runtime_loop_inside_no_reorder_raises_and_no_reorder_inside_body_runs():
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    with pytest.raises(NkiValidationError, match=r"nl.fori_loop: runtime loops cannot sit inside an "
                       r"nl.no_reorder\(\) block"):
        _no_reorder_around_loop(x)
    np.testing.assert_array_equal(_no_reorder_inside_body(x)[0], x[1])


@jit
def _documented_while_loop(data, count_input):
    """The nki.language.while_loop docstring example (NKI 0.6), as written there."""
    output = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    val = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=val, src=data)
    acc = nl.zeros((1, 1), dtype=nl.float32, buffer=nl.sbuf)

    count_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=count_sb, src=count_input)
    one_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=one_sb, value=1)

    reg = nisa.register_alloc()
    nisa.register_load(reg, count_sb)

    def body(r):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=val, op=nl.add)
        nisa.tensor_tensor(dst=count_sb, data1=count_sb, data2=one_sb, op=nl.subtract)
        nisa.register_load(r, count_sb)
        return r

    nl.while_loop(reg, body)
    nisa.dma_copy(dst=output, src=acc)
    return output


@pytest.mark.parametrize("count", [0, 1, 5])
def test_documented_while_loop_example(count):
    got = _documented_while_loop(np.array([[2.5]], np.float32), np.array([[count]], np.int32))
    assert got[0, 0] == 2.5 * count  # a true while: zero iterations when the count starts at 0


@jit
def _while_body_returns_nothing(count_input):
    out = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.shared_hbm)
    nl.while_loop(_register_from(count_input), lambda r: None)
    return out


def test_while_loop_body_must_return_the_condition_register():
    with pytest.raises(NkiValidationError, match=r"nl.while_loop: the body must return the next condition "
                       r"register \(a VirtualRegister\), got None \(" + MIGRATION):
        _while_body_returns_nothing(np.array([[1]], np.int32))


# -- LNC=2: both programs take the same runtime control flow ---------------------------------------

@jit
def _per_core_rows(x, counts):
    """Each core sums its own rows with a runtime loop bounded by counts[core] (different trip counts
    when the counts differ: our MoE kernels' old per-core expert loops)."""
    R, F = x.shape
    pid = nl.program_id(0)
    out = nl.ndarray((2, F), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((1, F), dtype=nl.float32, buffer=nl.sbuf)
    row = nl.ndarray((1, F), dtype=nl.float32, buffer=nl.sbuf)

    def body(i):
        nisa.dma_copy(dst=row, src=x.ap([[F, 1], [1, F]], scalar_offset=i, indirect_dim=0))
        nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)

    nl.fori_loop(0, _register_from(counts[pid:pid + 1, :]), body)
    nisa.dma_copy(dst=out[pid:pid + 1, :], src=acc)
    nisa.core_barrier(out, (0, 1))
    return out


def test_lnc2_same_trip_counts_run():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    got = _per_core_rows[2](x, np.array([[3], [3]], np.int32))
    np.testing.assert_allclose(got, np.stack([x[:3].sum(0)] * 2), rtol=1e-6)


def test_lnc2_different_trip_counts_raise_naming_the_loop_and_counts():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    with pytest.raises(NkiValidationError, match=r"LNC=2 divergence: the two programs take different "
                       r"runtime control flow at control-flow step 0: program 0 runs nl.fori_loop at "
                       r"test_strict_rules.py:\d+ \(4 iterations; after 3 instructions\), program 1 runs "
                       r"nl.fori_loop at test_strict_rules.py:\d+ \(2 iterations; after 3 instructions\) "
                       r".*lnc.rst, \"Final Notes\"\): \"if you use dynamic control flow, and this "
                       r"control-flow is different on the different cores, then the behavior is undefined"):
        _per_core_rows[2](x, np.array([[4], [2]], np.int32))


def test_lnc2_divergence_is_a_warning_under_strict_false():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    with pytest.warns(UndefinedBehaviourWarning, match=r"LNC=2 divergence: .*4 iterations.*2 iterations"):
        got = simulate(_per_core_rows[2], strict=False)(x, np.array([[4], [2]], np.int32))
    np.testing.assert_allclose(got, np.stack([x[:4].sum(0), x[:2].sum(0)]), rtol=1e-6)


@jit
def _barrier_on_one_core(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    if nl.program_id(0) == 0:
        nisa.core_barrier(out, (0, 1))
    return out


def test_lnc2_barrier_only_one_core_reaches_raises_instead_of_hanging():
    with pytest.raises(NkiValidationError, match=r"LNC=2 divergence: .* at control-flow step 0: program 0 "
                       r"runs core_barrier at .*\(cores=\(0, 1\); after 0 instructions\), program 1 runs no "
                       r"further runtime loop or barrier"):
        _barrier_on_one_core[2](np.zeros((2, 4), np.float32))


@jit
def _static_work_split(x):
    """Static per-core specialisation (Python if on program_id, different instruction counts), no
    runtime loop: what AWS's cascaded_max does (28 / 26 DMAs on its two cores at x[5, 5, 8192])."""
    R, F = x.shape
    pid = nl.program_id(0)
    out = nl.ndarray((R, F), dtype=x.dtype, buffer=nl.shared_hbm)
    rows = range(0, 3) if pid == 0 else range(3, R)
    for r in rows:
        t = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r:r + 1, :])
        nisa.dma_copy(dst=out[r:r + 1, :], src=t)
    nisa.core_barrier(out, (0, 1))
    return out


def test_lnc2_static_per_core_instruction_streams_run():
    x = RNG.standard_normal((5, 8)).astype(np.float32)
    np.testing.assert_array_equal(_static_work_split[2](x), x)


@jit
def _documented_dynamic_loop_per_core(x, stop):
    """AWS bwmm_shard_on_I's hybrid loop: both cores run nl.dynamic_range to the same register bound,
    the block index in SBUF, a barrier per iteration."""
    R, F = x.shape
    pid = nl.program_id(0)
    out = nl.ndarray((2, F), dtype=x.dtype, buffer=nl.shared_hbm)
    block_idx = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(block_idx, value=0)
    row = nl.ndarray((1, F), dtype=x.dtype, buffer=nl.sbuf)
    for _ in nl.dynamic_range(0, _register_from(stop)):
        nisa.dma_copy(dst=row, src=x.ap([[F, 1], [1, F]], scalar_offset=block_idx, indirect_dim=0))
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=row)
        nisa.core_barrier(out, (0, 1))
        nisa.tensor_scalar(dst=block_idx, data=block_idx, op0=nl.add, operand0=1)
    return out


def test_lnc2_dynamic_range_with_sbuf_state_and_barriers_runs():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    got = _documented_dynamic_loop_per_core[2](x, np.array([[4]], np.int32))
    np.testing.assert_array_equal(got, np.stack([x[3], x[3]]))


# -- instruction rules ----------------------------------------------------------------------------

def test_activation_outside_the_documented_table_raises():
    x = RNG.uniform(-3, 3, (4, 16)).astype(np.float32)
    src = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
    src.np()[...] = x
    dst = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=dst, op=nl.sin, data=src)  # in the table (AWS rope kernels use it)
    np.testing.assert_allclose(dst.np(), np.sin(x), rtol=1e-6)
    with pytest.raises(NkiValidationError, match=r"activation: op=nl.cos is not in the Scalar Engine's "
                       r"activation function table \(NKI ISA reference, \"Supported Activation Functions "
                       r"for NKI ISA\": abs, arctan, copy, "):
        nisa.activation(dst=dst, op=nl.cos, data=src)


@jit
def _gather(data, indices, mode):
    P, F = indices.shape[0], data.shape[1]
    output = nl.ndarray((P, F), dtype=data.dtype, buffer=nl.shared_hbm)
    idx = nl.ndarray((P, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    dst = nl.ndarray((P, F), dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=dst, src=data.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0),
                  dge_mode=mode)
    nisa.dma_copy(dst=output, src=dst)
    return output


@pytest.mark.parametrize("mode", ["unknown", "swdge"])
def test_indirect_dma_copy_with_software_dge_runs(mode):
    data = RNG.standard_normal((10, 8)).astype(np.float32)
    idx = np.array([[7], [2], [9], [0]], np.uint32)
    got = _gather(data, idx, getattr(nisa.dge_mode, mode))  # the dma_copy docstring's gather
    np.testing.assert_array_equal(got, data[idx[:, 0]])


@pytest.mark.parametrize("mode", ["hwdge", "none"])
def test_indirect_dma_copy_with_hardware_or_no_dge_raises(mode):
    with pytest.raises(NkiValidationError, match=rf"dma_copy: a vector_offset \(gather/scatter\) view needs "
                       rf"dge_mode unknown or swdge, got dge_mode.{mode} \(NKI DGE guide, \"How .ap\(\) "
                       r"Affects DGE Mode\""):
        _gather(np.zeros((10, 8), np.float32), np.zeros((4, 1), np.uint32), getattr(nisa.dge_mode, mode))


@jit
def _transpose_rows(x, start, skip):
    """dma_transpose of rows start..start+A-1 of x [R, F] (a scalar_offset src), optionally oob skip."""
    R, F = x.shape
    A = 4
    out = nl.ndarray((F, A), dtype=x.dtype, buffer=nl.shared_hbm)
    dst = nl.ndarray((F, A), dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=dst, value=0)
    src = x.ap([[F, A], [1, F]], scalar_offset=_register_from(start), indirect_dim=0) if start is not None \
        else x[0:A, :]
    nisa.dma_transpose(dst=dst, src=src, oob_mode=nisa.oob_mode.skip if skip else nisa.oob_mode.error)
    nisa.dma_copy(dst=out, src=dst)
    return out


def test_dma_transpose_oob_skip_needs_an_indirect_src():
    x = RNG.standard_normal((8, 16)).astype(np.float32)
    np.testing.assert_array_equal(_transpose_rows(x, np.array([[2]], np.int32), True), x[2:6].T)
    # out of bounds at run time: skipped (dst keeps its memset zeros)
    np.testing.assert_array_equal(_transpose_rows(x, np.array([[6]], np.int32), True), 0.0)
    with pytest.raises(NkiValidationError, match=r"dma_transpose: oob_mode=skip is only valid with indirect "
                       r"indexing .*\"Only valid when src uses indirect indexing\""):
        _transpose_rows(x, None, True)


def test_dma_compute_oob_skip_needs_an_indirect_operand():
    a = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    a.np()[...] = 1.0
    b = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    b.np()[...] = 2.0
    dst = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_compute(dst=dst, srcs=[a, b], reduce_op=nl.add)
    np.testing.assert_array_equal(dst.np(), 3.0)
    with pytest.raises(NkiValidationError, match=r"dma_compute: oob_mode=skip is only valid with indirect "
                       r"indexing .*NKI 0.4.0 release notes"):
        nisa.dma_compute(dst=dst, srcs=[a, b], reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)


def test_strict_false_does_not_relax_invalid_uses():
    """strict=False turns only undefined behaviour into warnings; invalid uses still raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NkiValidationError, match="a fori_loop body cannot return a value"):
            simulate(_body_returns_value, strict=False)(np.zeros((2, 4), np.float32))


# -- NaN / Inf through the Tensor Engine (trn2 = NeuronCore-v3) ----------------------------------

def _nan_inf_tile():
    x = RNG.standard_normal((8, 8)).astype(np.float32)
    x[1, 2], x[5, 0] = np.nan, np.inf
    t = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.sbuf)
    t.np()[...] = x
    return x, t


def test_tensor_engine_transposes_are_bit_exact_with_nan_and_inf():
    """nc_transpose docs: "Starting NeuronCore-v3, all Tensor Engine transpose is bit-accurate"; the
    trn2 architecture guide: the transpose mode "can correctly transpose input tensors with NaN/Inf"."""
    x, t = _nan_inf_tile()
    on_tensor = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=on_tensor, data=t, engine=nisa.engine.tensor)
    np.testing.assert_array_equal(on_tensor.np(), x.T)  # NaN / Inf stay where they were
    eye = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.sbuf)
    eye.np()[...] = np.eye(8, dtype=np.float32)
    mode = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=mode, stationary=t, moving=eye, is_transpose=True)
    np.testing.assert_array_equal(mode.np(), x.T)


def test_identity_matmul_spreads_nan_and_inf_like_the_hardware():
    """trn2 architecture guide: a transpose computed as a plain matmul with an identity matrix
    multiplies every element by 1.0 or 0.0 and accumulates, so "the NaN/Inf values will propagate
    through the accumulation chain and spread across the output tensor" (0 * NaN, 0 * Inf = NaN)."""
    x, t = _nan_inf_tile()
    eye = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.sbuf)
    eye.np()[...] = np.eye(8, dtype=np.float32)
    out = nl.ndarray((8, 8), dtype=nl.float32, buffer=nl.psum)
    with np.errstate(invalid="ignore"):  # (kernels run so; here we call the instruction directly)
        nisa.nc_matmul(dst=out, stationary=t, moving=eye)
    got = out.np()
    assert np.isnan(got[2]).all()  # x[1, 2] = NaN reaches every column of output row 2
    assert np.isinf(got[0, 5]) and np.isnan(np.delete(got[0], 5)).all()  # x[5, 0] = Inf: 0 * Inf = NaN
    clean = [r for r in range(8) if r not in (0, 2)]
    np.testing.assert_allclose(got[clean], x.T[clean], rtol=1e-6)
