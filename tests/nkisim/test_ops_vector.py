"""Vector Engine instructions against numpy references, for each dtype they support."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trnkit.nkisim import ops as nl
from trnkit.nkisim import trace
from trnkit.nkisim.errors import NkiValidationError
from trnkit.nkisim.isa import vector as nisa
from trnkit.nkisim.isa.common import engine, reduce_cmd

from ._tiles import BF16, F16, F32, FLOATS, as_f32, empty, psum, ref_round, tile

ARITH_BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
    "minimum": np.minimum, "equal": np.equal, "not_equal": np.not_equal,
    "greater": np.greater, "greater_equal": np.greater_equal, "less": np.less,
    "less_equal": np.less_equal, "logical_and": np.logical_and, "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator of its own for each test, seeded from the test's name and parameters (crc32: stable across runs,
    unlike the salted hash()), so a test draws the same inputs whatever order or worker runs it."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _rand(rng: np.random.Generator, shape, dtype, lo=-4.0, hi=4.0) -> np.ndarray:
    """Random values exactly representable in ``dtype`` (so the reference sees the same inputs)."""
    return rng.uniform(lo, hi, size=shape).astype(np.float32).astype(dtype).astype(np.float32)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(ARITH_BINARY))
def test_tensor_tensor_arithmetic(name: str, dtype: np.dtype, rng: np.random.Generator) -> None:
    a = _rand(rng, (128, 3, 40), dtype)
    b = _rand(rng, (128, 120), dtype)  # same elements per partition, different shape
    b[:, :20] = a.reshape(128, -1)[:, :20]  # equal pairs for the comparisons
    b[b == 0] = 0.5
    dst = empty((128, 120), dtype)
    nisa.tensor_tensor(dst, tile(a, dtype), tile(b, dtype), op=getattr(nl, name))
    want = ref_round(ARITH_BINARY[name](a.reshape(128, -1), b).astype(np.float32), dtype)
    np.testing.assert_array_equal(as_f32(dst), want)


def test_tensor_tensor_bf16_rounds_to_nearest_even() -> None:
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: RNE picks 1.0 (even mantissa);
    # 1 + 3*2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: RNE picks 1 + 2^-6.
    a = np.array([[1.0, 1.0, -1.0]], np.float32)
    b = np.array([[2.0**-8, 3 * 2.0**-8, -(2.0**-8)]], np.float32)
    dst = empty((1, 3), BF16)
    nisa.tensor_tensor(dst, tile(a), tile(b), op=nl.add)
    np.testing.assert_array_equal(as_f32(dst), [[1.0, 1.0 + 2.0**-6, -1.0]])


def test_tensor_tensor_mixed_dtypes_and_psum_operand(rng: np.random.Generator) -> None:
    a = _rand(rng, (64, 32), BF16)
    b = _rand(rng, (64, 32), F32)
    dst = empty((64, 32), F32, psum)
    nisa.tensor_tensor(dst, tile(a, BF16), tile(b, F32, psum), op=nl.multiply)
    np.testing.assert_array_equal(as_f32(dst), a * b)


def test_tensor_tensor_in_place_on_strided_views(rng: np.random.Generator) -> None:
    # The rope pattern: dst aliases data1, halves of the free dim.
    x = _rand(rng, (16, 2, 8), F32)
    t = tile(x)
    nisa.tensor_tensor(t[:, :, :4], t[:, :, :4], t[:, :, 4:], op=nl.subtract)
    want = x.copy()
    want[:, :, :4] = x[:, :, :4] - x[:, :, 4:]
    np.testing.assert_array_equal(as_f32(t), want)


def test_tensor_tensor_int32_is_exact_on_gpsimd() -> None:
    a = np.array([[2**30, -(2**31), 123456789, 7]], np.int32)
    b = np.array([[2**30 - 1, 1, 987654321, -9]], np.int32)
    dst = empty((1, 4), np.int32)
    with trace.record() as tr:
        nisa.tensor_tensor(dst, tile(a), tile(b), op=nl.add)
    want = (a.astype(np.int64) + b).astype(np.int32)  # native 32-bit wrap, no fp32 rounding
    np.testing.assert_array_equal(dst.np(), want)
    assert tr.instrs[0].engine == "gpsimd"
    # forced onto the Vector engine, int32 goes through fp32 (123456789 + 987654321 is not exact)
    nisa.tensor_tensor(dst, tile(a), tile(b), op=nl.add, engine=engine.vector)
    assert dst.np()[0, 2] == np.int32(np.float32(123456789.0) + np.float32(987654321.0))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,ref", [("bitwise_and", np.bitwise_and), ("bitwise_or", np.bitwise_or),
                                      ("bitwise_xor", np.bitwise_xor)])
def test_tensor_tensor_bitvec(name: str, ref, dtype, rng: np.random.Generator) -> None:
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, size=(32, 64), endpoint=True).astype(dtype)
    b = rng.integers(info.min, info.max, size=(32, 64), endpoint=True).astype(dtype)
    dst = empty((32, 64), dtype)
    nisa.tensor_tensor(dst, tile(a), tile(b), op=getattr(nl, name))
    np.testing.assert_array_equal(dst.np(), ref(a, b))


def test_tensor_tensor_shifts() -> None:
    a = np.array([[0x80000001, 0x00000003]], np.uint32)
    s = np.array([[1, 4]], np.uint32)
    dst = empty((1, 2), np.uint32)
    nisa.tensor_tensor(dst, tile(a), tile(s), op=nl.left_shift)
    np.testing.assert_array_equal(dst.np(), [[0x00000002, 0x00000030]])
    nisa.tensor_tensor(dst, tile(a), tile(s), op=nl.right_shift)
    np.testing.assert_array_equal(dst.np(), [[0x40000000, 0x0]])


def test_tensor_tensor_power_runs_on_gpsimd(rng: np.random.Generator) -> None:
    a = _rand(rng, (8, 16), F32, 0.5, 3.0)
    b = _rand(rng, (8, 16), F32, -2.0, 2.0)
    dst = empty((8, 16), F32)
    with trace.record() as tr:
        nisa.tensor_tensor(dst, tile(a), tile(b), op=nl.power)
    np.testing.assert_allclose(as_f32(dst), np.power(a, b), rtol=1e-6)
    assert tr.instrs[0].engine == "gpsimd"


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_tensor_scalar_two_ops_scalars_and_columns(dtype: np.dtype, rng: np.random.Generator) -> None:
    x = _rand(rng, (100, 7, 9), dtype)
    col = _rand(rng, (100, 1), F32)
    dst = empty((100, 63), dtype)
    nisa.tensor_scalar(dst, tile(x, dtype), op0=nl.subtract, operand0=tile(col), op1=nl.multiply,
                       operand1=0.5)
    want = (x.reshape(100, -1) - col) * np.float32(0.5)
    np.testing.assert_array_equal(as_f32(dst), ref_round(want, dtype))


def test_tensor_scalar_reverse_operands(rng: np.random.Generator) -> None:
    x = _rand(rng, (4, 8), F32, 0.5, 4)
    dst = empty((4, 8), F32)
    nisa.tensor_scalar(dst, tile(x), op0=nl.subtract, operand0=1.0, reverse0=True,
                       op1=nl.subtract, operand1=2.0, reverse1=True)
    np.testing.assert_array_equal(as_f32(dst), np.float32(2.0) - (np.float32(1.0) - x))


@pytest.mark.parametrize("how", ["tensor_tensor", "tensor_scalar", "tensor_reduce"])
def test_divide_is_not_an_alu_operator(how: str) -> None:
    """NKI's ALU operator table has no divide ("Division is not available as a hardware instruction", 0.4.0
    known issues): an instruction given op=nl.divide is refused, naming it (it ran as an exact division)."""
    x = tile(np.ones((4, 8), np.float32))
    dst = empty((4, 8), F32)
    with pytest.raises(NkiValidationError, match=r"divide"):
        if how == "tensor_tensor":
            nisa.tensor_tensor(dst=dst, data1=x, data2=x, op=nl.divide)
        elif how == "tensor_scalar":
            nisa.tensor_scalar(dst, x, op0=nl.divide, operand0=2.0)
        else:
            nisa.tensor_reduce(dst=empty((4, 1), F32), op=nl.divide, data=x, axis=1)


def test_tensor_scalar_unary_and_single_op(rng: np.random.Generator) -> None:
    x = _rand(rng, (4, 8), F32, 0.1, 9)
    dst = empty((4, 8), F32)
    nisa.tensor_scalar(dst, tile(x), op0=nl.rsqrt, operand0=None)
    np.testing.assert_allclose(as_f32(dst), 1 / np.sqrt(x), rtol=1e-6)
    nisa.tensor_scalar(dst, tile(x), op0=nl.maximum, operand0=2.0)
    np.testing.assert_array_equal(as_f32(dst), np.maximum(x, 2.0))
    nisa.tensor_scalar(dst, tile(x), np.multiply, 3.0)  # numpy functions (old style) and positional
    np.testing.assert_array_equal(as_f32(dst), x * np.float32(3.0))


def test_tensor_scalar_bitvec_with_int_operands(rng: np.random.Generator) -> None:
    x = rng.integers(0, 2**16, size=(8, 32)).astype(np.int32)
    dst = empty((8, 32), np.int32)
    nisa.tensor_scalar(dst, tile(x), op0=nl.bitwise_and, operand0=0xFF, op1=nl.left_shift, operand1=4)
    np.testing.assert_array_equal(dst.np(), (x & 0xFF) << 4)


def test_scalar_tensor_tensor(rng: np.random.Generator) -> None:
    x, y = _rand(rng, (64, 48), BF16), _rand(rng, (64, 48), F32)
    col = _rand(rng, (64, 1), F32)
    dst = empty((64, 48), BF16)
    nisa.scalar_tensor_tensor(dst, tile(x, BF16), nl.multiply, tile(col), nl.add, tile(y, F32, psum))
    np.testing.assert_array_equal(as_f32(dst), ref_round(x * col + y, BF16))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("name", ["add", "maximum", "minimum", "multiply"])
def test_tensor_reduce_last_axes(name: str, dtype: np.dtype, rng: np.random.Generator) -> None:
    x = _rand(rng, (128, 4, 6, 10), dtype, 0.5, 1.5)
    op = getattr(nl, name)
    for axis, kept in (((3,), (128, 4, 6)), ((2, 3), (128, 4)), ((1, 2, 3), (128, 1)), (-1, (128, 4, 6))):
        dst = empty(kept, dtype)
        nisa.tensor_reduce(dst, op, tile(x, dtype), axis=axis)
        ax = axis if isinstance(axis, tuple) else (axis,)
        want = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}[name](
            x.astype(np.float64), axis=ax).reshape(kept)
        # a float16 product of 240 factors can land below 6.1e-5, where float16 is subnormal: spacing 2^-24
        atol = 2.0 ** -24 if dtype == np.float16 else 0.0
        np.testing.assert_allclose(as_f32(dst), ref_round(want, dtype), rtol=2e-3 if dtype != F32 else 1e-5,
                                   atol=atol)


def test_tensor_reduce_negate_keepdims_and_dst_layout(rng: np.random.Generator) -> None:
    x = _rand(rng, (32, 5, 16), F32)
    dst = empty((32, 5, 1), F32)
    nisa.tensor_reduce(dst, nl.maximum, tile(x), axis=2, negate=True, keepdims=True)
    np.testing.assert_array_equal(as_f32(dst), -x.max(axis=2, keepdims=True))
    dst2 = empty((32, 5), F32)  # keepdims only changes the logical shape, not the element count
    nisa.tensor_reduce(dst2, nl.add, tile(x), axis=(2,))
    np.testing.assert_allclose(as_f32(dst2), x.sum(axis=2), rtol=1e-6)


def test_tensor_reduce_bitvec_and_logical(rng: np.random.Generator) -> None:
    x = rng.integers(0, 2**20, size=(16, 12)).astype(np.int32)
    dst = empty((16, 1), np.int32)
    nisa.tensor_reduce(dst, nl.bitwise_or, tile(x), axis=1)
    np.testing.assert_array_equal(dst.np()[:, 0], np.bitwise_or.reduce(x, axis=1))
    f = np.array([[1, 2, 0], [1, 1, 1]], np.float32)
    dstf = empty((2, 1), F32)
    nisa.tensor_reduce(dstf, nl.logical_and, tile(f), axis=1)
    np.testing.assert_array_equal(dstf.np()[:, 0], [0.0, 1.0])


def test_tensor_copy_bit_exact_same_dtype() -> None:
    bits = np.array([[0x7FC00001, 0xFF800000, 0x00000001, 0x3F800000]], np.uint32)  # NaN payload, -inf, denormal
    src = tile(bits.view(np.float32))
    dst = empty((1, 4), F32)
    nisa.tensor_copy(dst, src)
    np.testing.assert_array_equal(dst.np().view(np.uint32), bits)
    i = np.array([[2**31 - 1, -(2**31), 16777217]], np.int32)  # not representable in fp32
    dsti = empty((1, 3), np.int32)
    nisa.tensor_copy(dsti, tile(i))
    np.testing.assert_array_equal(dsti.np(), i)


def test_tensor_copy_casts_psum_to_bf16_and_saturates_ints(rng: np.random.Generator) -> None:
    x = _rand(rng, (128, 512), F32, -300, 300)
    dst = empty((128, 512), BF16)
    nisa.tensor_copy(dst, tile(x, F32, psum))
    np.testing.assert_array_equal(dst.np(), x.astype(BF16))
    d8 = empty((1, 5), np.int8)
    nisa.tensor_copy(d8, tile(np.array([[1.5, 2.5, -200.0, 300.0, np.nan]], np.float32)))
    np.testing.assert_array_equal(d8.np(), [[2, 2, -128, 127, 0]])  # RNE, saturate, NaN -> 0
    d16 = empty((2, 4), F16)
    nisa.tensor_copy(d16, tile(np.arange(8, dtype=np.int32).reshape(2, 4)), engine=engine.gpsimd)
    np.testing.assert_array_equal(d16.np(), np.arange(8).reshape(2, 4))


def test_tensor_copy_predicated(rng: np.random.Generator) -> None:
    src = _rand(rng, (8, 16), F32)
    old = _rand(rng, (8, 16), F32)
    pred = rng.integers(0, 2, size=(8, 16)).astype(np.uint8)
    dst = tile(old)
    nisa.tensor_copy_predicated(dst, tile(src), tile(pred))
    np.testing.assert_array_equal(as_f32(dst), np.where(pred != 0, src, old))
    dst = tile(old)
    nisa.tensor_copy_predicated(dst, -1.0, tile(pred), reverse_pred=True)
    np.testing.assert_array_equal(as_f32(dst), np.where(pred == 0, -1.0, old))


@pytest.mark.parametrize("dtype,value", [(F32, 0.1), (BF16, 0.1), (F16, -2.5), (np.int32, -7),
                                         (np.uint8, 255), (np.float32, 0)])
def test_memset(dtype, value) -> None:
    dst = empty((16, 3, 5), dtype)
    nisa.memset(dst, value)
    np.testing.assert_array_equal(dst.np(), np.full((16, 3, 5), value).astype(dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_reciprocal(dtype, rng: np.random.Generator) -> None:
    x = _rand(rng, (64, 40), dtype, 0.25, 8)
    dst = empty((64, 40), dtype)
    nisa.reciprocal(dst, tile(x, dtype))
    np.testing.assert_array_equal(as_f32(dst), ref_round(np.float32(1) / x, dtype))


def test_tensor_scalar_reduce_accumulates_across_calls(rng: np.random.Generator) -> None:
    x1, x2 = _rand(rng, (8, 32), F32), _rand(rng, (8, 32), F32)
    dst, res = empty((8, 32), F32), empty((8, 1), F32)
    nisa.tensor_scalar_reduce(dst, tile(x1), nl.multiply, 2.0, nl.add, res)
    np.testing.assert_allclose(res.np()[:, 0], (2 * x1).sum(1), rtol=1e-5)
    nisa.tensor_scalar_reduce(dst, tile(x2), nl.multiply, 2.0, nl.add, res, reduce_cmd=reduce_cmd.reduce)
    np.testing.assert_allclose(res.np()[:, 0], (2 * x1).sum(1) + (2 * x2).sum(1), rtol=1e-5, atol=1e-5)
    nisa.tensor_scalar_reduce(dst, tile(x2), nl.add, 1.0, nl.maximum, res, reduce_cmd=reduce_cmd.load_reduce,
                              reduce_init=100.0)
    np.testing.assert_array_equal(res.np()[:, 0], np.full(8, 100.0))
    np.testing.assert_array_equal(as_f32(dst), x2 + 1)


def test_trace_records_engine_sizes_and_dependencies(rng: np.random.Generator) -> None:
    a, b = tile(_rand(rng, (96, 2, 256), BF16), BF16), tile(_rand(rng, (96, 512), BF16), BF16)
    dst = empty((96, 512), BF16)
    with trace.record() as tr:
        nisa.tensor_tensor(dst, a, b, op=nl.add)
        nisa.tensor_scalar(dst, dst, op0=nl.multiply, operand0=2.0)
    i0, i1 = tr.instrs
    assert (i0.op, i0.engine, i0.partitions, i0.elems_per_partition) == ("tensor_tensor", "vector", 96, 512)
    assert i0.attrs["op"] == "add"
    assert [o.role for o in i0.operands] == ["dst", "data1", "data2"]
    assert i0.operands[0].nbytes == 96 * 512 * 2
    # the second instruction reads what the first wrote (same storage key and range)
    assert i1.attrs["reads"][0] == i0.attrs["writes"][0]
    key, lo, hi = i0.attrs["writes"][0]
    assert (lo, hi) == (0, 96 * 512)


def test_memset_into_psum_needs_accumulate_false_to_restart_matmuls() -> None:
    # A memset PSUM tile is no longer "written by nc_matmul": accumulating onto it is undefined on
    # trn2 (nc_matmul docs), accumulate=False overwrites it.
    from trnkit.nkisim.errors import NkiValidationError
    from trnkit.nkisim.isa.tensor_engine import nc_matmul

    a, b = tile(np.ones((4, 2), np.float32)), tile(np.ones((4, 3), np.float32))
    acc = empty((2, 3), F32, psum)
    nc_matmul(acc, a, b)
    nisa.memset(acc, 100.0)
    with pytest.raises(NkiValidationError, match="value-initialized by a non-matmul instruction"):
        nc_matmul(acc, a, b)
    nc_matmul(acc, a, b, accumulate=False)
    np.testing.assert_array_equal(acc.np(), np.full((2, 3), 4.0))


def test_tensor_scalar_cumulative_scan_continues_across_tiles(rng: np.random.Generator) -> None:
    x = _rand(rng, (16, 64), F32)
    d1, d2 = empty((16, 32), F32), empty((16, 32), F32)
    nisa.tensor_scalar_cumulative(d1, tile(x[:, :32]), nl.multiply, nl.add, 2.0)
    nisa.tensor_scalar_cumulative(d2, tile(x[:, 32:]), nl.multiply, nl.add, 2.0,
                                  reduce_cmd=reduce_cmd.reduce)
    want = np.cumsum((2 * x).astype(np.float64), axis=1)
    # an fp32 running sum of n terms is off by up to n roundings of its largest partial sum (near a zero
    # crossing of the sum, far more than 1e-5 of the value)
    atol = x.shape[1] * 2.0 ** -24 * np.abs(want).max()
    np.testing.assert_allclose(np.concatenate([d1.np(), d2.np()], axis=1), want, rtol=1e-5, atol=atol)
    dm = empty((16, 64), BF16)
    nisa.tensor_scalar_cumulative(dm, tile(x), nl.add, nl.maximum, 0.0, imm1=1.0,
                                  reduce_cmd=reduce_cmd.load_reduce)
    np.testing.assert_array_equal(as_f32(dm), ref_round(np.maximum.accumulate(np.maximum(x, 1.0), axis=1), BF16))


@pytest.mark.parametrize("name", ["float8_e4m3", "float8_e5m2"])
def test_fp8_tiles_compute_in_fp32_and_round_on_write(name: str, rng: np.random.Generator) -> None:
    from trnkit.nkisim import dtypes

    dt = getattr(dtypes, name)
    a, b = _rand(rng, (32, 16), dt, -8, 8), _rand(rng, (32, 16), dt, -8, 8)
    dst = empty((32, 16), dt)
    nisa.tensor_tensor(dst, tile(a, dt), tile(b, dt), op=nl.multiply)
    np.testing.assert_array_equal(as_f32(dst), ref_round(a * b, dt))
    up = empty((32, 16), BF16)
    nisa.tensor_copy(up, dst)  # fp8 -> bf16 is exact
    np.testing.assert_array_equal(as_f32(up), as_f32(dst))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: d.name)
def test_bn_stats_and_aggr_mean_variance_over_tiles(dtype, rng: np.random.Generator) -> None:
    x = _rand(rng, (128, 1100), dtype, -2, 5)  # 3 bn_stats tiles: 512 + 512 + 76 (tail, odd split)
    xt = tile(x, dtype)
    stats = empty((128, 18), F32)
    for i, c0 in enumerate(range(0, 1100, 512)):
        nisa.bn_stats(stats[:, 6 * i:6 * i + 6], xt[:, c0:min(c0 + 512, 1100)])
    mv = empty((128, 2), F32)
    nisa.bn_aggr(mv, stats)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mv.np()[:, 0], x64.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mv.np()[:, 1], x64.var(1), rtol=1e-4)
    # the per-tile layout: (count, mean, var*count) of even then odd elements
    first = x64[:, :512]
    np.testing.assert_allclose(stats.np()[:, :3], np.stack(
        [np.full(128, 256.0), first[:, 0::2].mean(1), first[:, 0::2].var(1) * 256], 1), rtol=1e-4)


def test_bn_stats_single_element_tile() -> None:
    st = empty((4, 6), F32)
    nisa.bn_stats(st, tile(np.arange(4, dtype=np.float32).reshape(4, 1)))
    np.testing.assert_array_equal(st.np()[:, [0, 1, 2, 3, 4, 5]],
                                  np.stack([np.ones(4), np.arange(4), np.zeros(4)] + [np.zeros(4)] * 3, 1))


def test_tensor_tensor_scan_linear_recurrence_and_reverse(rng: np.random.Generator) -> None:
    a, b = _rand(rng, (8, 50), F32, 0.5, 1.0), _rand(rng, (8, 50), F32)
    init = _rand(rng, (8, 1), F32)
    dst = empty((8, 50), F32)
    nisa.tensor_tensor_scan(dst, tile(a), tile(b), tile(init), nl.multiply, nl.add)
    r, want = init[:, 0].copy(), np.empty_like(a)
    for i in range(50):  # the documented pseudo code, in fp32
        r = (a[:, i] * r + b[:, i]).astype(np.float32)
        want[:, i] = r
    np.testing.assert_array_equal(dst.np(), want)
    nisa.tensor_tensor_scan(dst, tile(a), tile(b), 1.0, nl.subtract, nl.subtract, reverse0=True, reverse1=True)
    r = np.float32(1.0)
    for i in range(50):
        r = b[:, i] - (r - a[:, i])
        want[:, i] = r
    np.testing.assert_allclose(dst.np(), want, rtol=1e-6, atol=1e-6)


def test_select_reduce_and_range_select(rng: np.random.Generator) -> None:
    x = _rand(rng, (16, 40), BF16)
    pred = rng.integers(0, 2, size=(16, 40)).astype(np.uint8)
    dst, res = empty((16, 40), BF16), empty((16, 1), F32)
    nisa.select_reduce(dst, tile(pred), tile(x, BF16), -5.0, reduce_res=res,
                       reduce_cmd=reduce_cmd.reset_reduce)
    want = np.where(pred != 0, x, -5.0)
    np.testing.assert_array_equal(as_f32(dst), want)
    np.testing.assert_array_equal(res.np()[:, 0], want.max(1))
    # range_select: keep columns lo <= range_start + i < hi (a sliding attention window)
    lo = rng.integers(0, 30, size=(16, 1)).astype(np.float32)
    hi = lo + 8
    dst2, res2 = empty((16, 40), F32), empty((16, 1), F32)
    nisa.range_select(dst2, tile(x, BF16), nl.greater_equal, nl.less, tile(lo), tile(hi),
                      reduce_res=res2, range_start=10)
    cols = 10 + np.arange(40)[None, :]
    want2 = np.where((cols >= lo) & (cols < hi), x, nisa.FP32_MIN)
    np.testing.assert_array_equal(dst2.np(), want2)
    np.testing.assert_array_equal(res2.np()[:, 0], want2.max(1))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 16), f=st.integers(1, 12), step=st.integers(1, 3), start=st.integers(0, 1),
       name=st.sampled_from(["add", "subtract", "maximum", "multiply"]), seed=st.integers(0, 2**32 - 1))
def test_tensor_tensor_on_strided_views_matches_numpy(p, f, step, start, name, seed) -> None:
    # Operands are strided / offset views of bigger tiles; dst is a strided view of another shape. The values
    # come from a seed hypothesis draws, so a failing example replays with its inputs.
    rng = np.random.default_rng(seed)
    big_a = _rand(rng, (p, 2, f * step), F32)
    big_b = _rand(rng, (p, f * step * 2), F32)
    a_t, b_t = tile(big_a), tile(big_b)
    a_view = a_t[:, 1, ::step]
    b_view = b_t[:, start::2 * step]
    a_np = big_a[:, 1, ::step]
    b_np = big_b[:, start::2 * step]
    dst_t = empty((p, f, 3), F32)
    dst_view = dst_t[:, :, 1]
    nisa.tensor_tensor(dst_view, a_view, b_view, op=getattr(nl, name))
    want = getattr(np, name)(a_np, b_np)
    np.testing.assert_array_equal(dst_t.np()[:, :, 1], want)
    assert np.isnan(dst_t.np()[:, :, 0]).all()  # neighbours untouched (fresh tiles are NaN-filled)


def test_trace_marks_contiguous_operands(rng: np.random.Generator) -> None:
    t = tile(_rand(rng, (8, 4, 6), BF16), BF16)
    with trace.record() as tr:
        nisa.tensor_copy(empty((8, 24), BF16), t)
        nisa.tensor_copy(empty((8, 4), BF16), t[:, :, 0])
    assert [i.attrs["contiguous"] for i in tr.instrs] == [True, False]
