"""nisa.nc_matmul / nc_transpose against numpy, accumulate semantics, and every Tensor Engine rule."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import trace
from trnkit.nkisim.errors import NkiValidationError

RNG = np.random.default_rng(2)
BF16 = np.dtype(ml_dtypes.bfloat16)


def tile(values: np.ndarray, dtype=None, buffer=nl.sbuf):
    dt = np.dtype(dtype) if dtype is not None else values.dtype
    t = nl.ndarray(values.shape, dt, buffer=buffer)
    t.np()[...] = values.astype(dt)
    return t


def psum_tile(m: int, n: int, dtype=nl.float32):
    return nl.ndarray((m, n), dtype, buffer=nl.psum)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16, ml_dtypes.float8_e4m3])
@pytest.mark.parametrize("k, m, n", [(128, 128, 512), (64, 32, 100), (1, 1, 1)])
def test_matmul_matches_numpy(dtype, k, m, n):
    a = RNG.standard_normal((k, m)).astype(dtype)
    b = RNG.standard_normal((k, n)).astype(dtype)
    dst = psum_tile(m, n)
    nisa.nc_matmul(dst, tile(a), tile(b))
    ref = a.astype(np.float64).T @ b.astype(np.float64)  # products of low-precision inputs are exact
    np.testing.assert_allclose(dst.np(), ref, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_matmul_multi_dim_free_operands_copy_all_elements():
    # 0.4 release-note fix: 3-D+ operands must use all their elements (free dims flattened)
    a = RNG.standard_normal((32, 4, 8)).astype(np.float32)
    b = RNG.standard_normal((32, 2, 16)).astype(np.float32)
    dst = nl.ndarray((32, 2, 16), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=dst, stationary=tile(a), moving=tile(b))
    np.testing.assert_allclose(dst.np().reshape(32, 32), a.reshape(32, 32).T @ b.reshape(32, 32),
                               rtol=1e-5, atol=1e-5)


def test_accumulate_none_first_write_overwrites_then_adds():
    a = [RNG.standard_normal((128, 64)).astype(np.float32) for _ in range(3)]
    b = [RNG.standard_normal((128, 256)).astype(np.float32) for _ in range(3)]
    dst = psum_tile(64, 256)  # NaN sentinel: an add onto it would leave NaN
    for x, y in zip(a, b):
        nisa.nc_matmul(dst=dst, stationary=tile(x), moving=tile(y))
    ref = sum(x.T @ y for x, y in zip(a, b))
    np.testing.assert_allclose(dst.np(), ref, rtol=1e-5, atol=1e-3)


def test_accumulate_none_is_per_location():
    # first matmul writes only the left half; the second covers everything: left adds, right overwrites
    a = RNG.standard_normal((16, 8)).astype(np.float32)
    b = RNG.standard_normal((16, 32)).astype(np.float32)
    dst = psum_tile(8, 32)
    nisa.nc_matmul(dst=dst[:, 0:16], stationary=tile(a), moving=tile(b[:, 0:16]))
    nisa.nc_matmul(dst=dst, stationary=tile(a), moving=tile(b))
    ref = a.T @ b
    ref[:, 0:16] *= 2
    np.testing.assert_allclose(dst.np(), ref, rtol=1e-5, atol=1e-5)


def test_accumulate_false_overwrites_true_adds():
    a = RNG.standard_normal((32, 16)).astype(np.float32)
    b = RNG.standard_normal((32, 64)).astype(np.float32)
    ref = a.T @ b
    dst = psum_tile(16, 64)
    nisa.nc_matmul(dst, tile(a), tile(b))
    nisa.nc_matmul(dst, tile(a), tile(b), accumulate=False)
    np.testing.assert_allclose(dst.np(), ref, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nisa.nc_matmul(dst, tile(a), tile(b), accumulate=True)  # matmul-written: defined
    np.testing.assert_allclose(dst.np(), 2 * ref, rtol=1e-5, atol=1e-5)
    # after a non-matmul write, accumulate=False starts a new group (overwrites)
    nisa.tensor_copy(dst=dst, src=tile(np.full((16, 64), 5.0, np.float32)))
    np.testing.assert_array_equal(dst.np(), 5.0)
    nisa.nc_matmul(dst, tile(a), tile(b), accumulate=False)
    np.testing.assert_allclose(dst.np(), ref, rtol=1e-5, atol=1e-5)
    nisa.nc_matmul(dst, tile(a), tile(b))  # matmul-written: accumulate=None adds
    np.testing.assert_allclose(dst.np(), 2 * ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accumulate", [None, True])
def test_accumulating_onto_a_memset_psum_tile_is_undefined(accumulate):
    """nc_matmul docs: accumulating into PSUM value-initialised by a non-matmul instruction is
    undefined on NeuronCore-v2/v3 (trn2); accumulate=None leaves the start to the compiler."""
    a = RNG.standard_normal((32, 16)).astype(np.float32)
    b = RNG.standard_normal((32, 64)).astype(np.float32)
    fresh = psum_tile(16, 64)
    nisa.memset(fresh, 1.5)
    what = "values" if accumulate else "non-zero values"
    with pytest.raises(NkiValidationError, match=rf"nc_matmul: accumulate={accumulate} onto PSUM tile "
                       rf"'.*' whose elements hold {what} written by a non-matmul instruction .*value-"
                       r"initialized by a non-matmul instruction.*accumulate=False"):
        nisa.nc_matmul(fresh, tile(a), tile(b), accumulate=accumulate)
    nisa.nc_matmul(fresh, tile(a), tile(b), accumulate=False)  # the defined way
    np.testing.assert_allclose(fresh.np(), a.T @ b, rtol=1e-5, atol=1e-5)


def test_accumulate_none_onto_a_zeroed_psum_tile_runs():
    """AWS's tested depthwise_conv1d (nki-library experimental/conv) memsets its PSUM tile to 0 and
    accumulates onto it with accumulate=None: starting or continuing the group gives the same sum."""
    a = RNG.standard_normal((32, 16)).astype(np.float32)
    b = RNG.standard_normal((32, 64)).astype(np.float32)
    acc = psum_tile(16, 64)
    nisa.memset(acc, 0.0)
    nisa.nc_matmul(acc, tile(a[:16]), tile(b[:16]))
    nisa.nc_matmul(acc, tile(a[16:]), tile(b[16:]))
    np.testing.assert_allclose(acc.np(), a.T @ b, rtol=1e-5, atol=1e-5)
    zeroed = psum_tile(16, 64)
    nisa.memset(zeroed, 0.0)
    with pytest.raises(NkiValidationError, match=r"accumulate=True onto PSUM tile '.*' whose elements "
                       r"hold values written by a non-matmul instruction"):
        nisa.nc_matmul(zeroed, tile(a), tile(b), accumulate=True)  # explicitly accumulating: unsupported


def test_accumulate_true_onto_unwritten_psum_is_undefined():
    a = RNG.standard_normal((32, 16)).astype(np.float32)
    b = RNG.standard_normal((32, 64)).astype(np.float32)
    with pytest.raises(NkiValidationError, match=r"nc_matmul: accumulate=True onto PSUM tile '.*' "
                       r"elements no matmul has written .*uninitialized PSUM location is undefined"):
        nisa.nc_matmul(psum_tile(16, 64), tile(a), tile(b), accumulate=True)


def test_matmul_after_tensor_engine_transpose_is_defined():
    """A TensorE nc_transpose is a matmul (is_transpose), not a value initialisation: a later
    accumulate=None matmul on the tile is defined (and starts a new accumulation)."""
    a = RNG.standard_normal((16, 16)).astype(np.float32)
    dst = psum_tile(16, 16)
    nisa.nc_transpose(dst, tile(a))
    nisa.nc_matmul(dst, tile(np.eye(16, dtype=np.float32)), tile(a))
    np.testing.assert_allclose(dst.np(), a, rtol=1e-6)



def test_matmul_trace_and_trace_only():
    a = tile(RNG.standard_normal((128, 128)).astype(BF16))
    b = tile(RNG.standard_normal((128, 512)).astype(BF16))
    dst = psum_tile(128, 512)
    with trace.record() as tr:
        nisa.nc_matmul(dst, a, b)
    (ins,) = tr.instrs
    assert ins.engine == "tensor" and ins.flops == 2 * 128 * 128 * 512
    roles = {o.role: o for o in ins.operands}
    assert roles["stationary"].free_elems == 128 and roles["moving"].free_elems == 512
    assert roles["dst"].buffer == "psum" and roles["moving"].dtype == "bfloat16"
    assert ins.attrs["acc_group"] == "start"
    with trace.record() as tr:
        nisa.nc_matmul(dst, a, b)
        nisa.nc_matmul(dst, a, b, accumulate=False)
    assert [i.attrs["acc_group"] for i in tr] == ["continue", "start"]
    fresh = psum_tile(128, 512)
    with trace.record(trace_only=True) as tr:
        nisa.nc_matmul(fresh, a, b)
    # arithmetic skipped, instruction recorded; the fresh accumulation reads as zeros (finite values
    # for whatever the kernel derives from it, e.g. DMA addresses)
    assert len(tr) == 1 and (fresh.np() == 0).all()


@pytest.mark.parametrize("case, msg", [
    ("stationary_free", "stationary free size 256 exceeds gemm_stationary_fmax (128)"),
    ("moving_free", "moving free size 1024 exceeds gemm_moving_fmax (512)"),
    ("k_mismatch", "stationary has 128 partitions, moving has 64"),
    ("dst_sbuf", "dst must be in psum, got sbuf"),
    ("stationary_psum", "stationary must be in sbuf, got psum"),
    ("dst_bf16", "dst must be float32 in PSUM on trn2, got bfloat16"),
    ("fp32_pairing", "if one input is fp32/tf32 both must be: stationary float32, moving bfloat16"),
    ("int_input", "stationary dtype int32 not supported"),
    ("dst_shape", "dst partition dim 64 must equal the stationary free size 128"),
    ("partitions", "stationary partition dimension 129 exceeds maximum 128"),
])
def test_matmul_rules(case, msg):
    f32, bf = nl.float32, nl.bfloat16
    st = nl.ndarray((128, 128), f32, buffer=nl.sbuf)
    mv = nl.ndarray((128, 512), f32, buffer=nl.sbuf)
    dst = psum_tile(128, 512)
    if case == "stationary_free":
        st = nl.ndarray((128, 256), f32, buffer=nl.sbuf)
    elif case == "moving_free":
        mv = nl.ndarray((128, 1024), f32, buffer=nl.sbuf)
    elif case == "k_mismatch":
        mv = nl.ndarray((64, 512), f32, buffer=nl.sbuf)
    elif case == "dst_sbuf":
        dst = nl.ndarray((128, 512), f32, buffer=nl.sbuf)
    elif case == "stationary_psum":
        st = nl.ndarray((128, 128), f32, buffer=nl.psum)
    elif case == "dst_bf16":
        dst = psum_tile(128, 512, bf)
    elif case == "fp32_pairing":
        mv = nl.ndarray((128, 512), bf, buffer=nl.sbuf)
    elif case == "int_input":
        st = nl.ndarray((128, 128), nl.int32, buffer=nl.sbuf)
    elif case == "dst_shape":
        dst = psum_tile(64, 512)
    elif case == "partitions":
        from trnkit.nkisim.tensor import Storage, NkiTensor  # a 129-partition view is not allocatable

        st = NkiTensor._make(Storage(np.zeros(129 * 128, np.float32), (129, 128), nl.sbuf, "big"),
                             (129, 128), (128, 1), 0, np.dtype(np.float32), "big")
    with pytest.raises(NkiValidationError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        nisa.nc_matmul(dst=dst, stationary=st, moving=mv)


def test_partition_start_alignment_rule():
    big = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    mv = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.memset(big, 1.0)
    nisa.memset(mv, 1.0)
    ok = psum_tile(32, 64)
    nisa.nc_matmul(ok, big[32:64, 0:32], mv[32:64])  # 32 partitions starting at 32: allowed
    with pytest.raises(NkiValidationError, match=r"stationary starts at partition 16 with 32 "
                                                 r"partitions; allowed starts .* \(0, 32, 64, 96\)"):
        nisa.nc_matmul(ok, big[16:48, 0:32], mv[16:48])
    with pytest.raises(NkiValidationError, match=r"starts at partition 32 with 64 partitions; "
                                                 r"allowed starts for that size are \(0, 64\)"):
        nisa.nc_matmul(psum_tile(32, 64), big[32:96, 0:32], mv[32:96])
    with pytest.raises(NkiValidationError,
                       match=r"starts at partition 63 with 65 partitions; allowed starts for that size are \(0,\)"):
        nisa.nc_matmul(psum_tile(32, 64), big[63:128, 0:32], mv[63:128])


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_transpose_tensor_engine(dtype):
    a = RNG.standard_normal((128, 96)).astype(dtype)
    dst = nl.ndarray((96, 128), dtype, buffer=nl.psum)
    with trace.record() as tr:
        nisa.nc_transpose(dst=dst, data=tile(a))
    np.testing.assert_array_equal(dst.np(), a.T)  # bit-exact
    assert tr.instrs[0].engine == "tensor"


def test_transpose_vector_engine_and_multi_free_dims():
    a = RNG.standard_normal((16, 2, 8)).astype(np.float32)
    dst = nl.ndarray((16, 16), np.float32, buffer=nl.sbuf)
    with trace.record() as tr:
        nisa.nc_transpose(dst=dst, data=tile(a))
    np.testing.assert_array_equal(dst.np(), a.reshape(16, 16).T)
    assert tr.instrs[0].engine == "vector"


@pytest.mark.parametrize("case, msg", [
    ("tensor_big", "Tensor Engine transpose supports up to 128x128, data is 128x256"),
    ("vector_big", "Vector Engine transpose supports up to 32x32, data is 64x64"),
    ("dtype", "dst dtype float32 must equal data dtype bfloat16"),
    ("shape", r"dst must be \[64, 128\] for data \[128, 64\]"),
    ("tensor_psum_src", "data must be in sbuf, got psum"),
])
def test_transpose_rules(case, msg):
    if case == "tensor_big":
        # (a [256, 128] dst cannot even be allocated: 256 partitions)
        data, dst, eng = nl.ndarray((128, 256), nl.float32), psum_tile(128, 256), nisa.engine.unknown
    elif case == "vector_big":
        data, dst, eng = nl.ndarray((64, 64), nl.float32), nl.ndarray((64, 64), nl.float32), nisa.engine.vector
    elif case == "dtype":
        data, dst, eng = nl.ndarray((128, 64), nl.bfloat16), psum_tile(64, 128), nisa.engine.tensor
    elif case == "shape":
        data, dst, eng = nl.ndarray((128, 64), nl.float32), psum_tile(128, 64), nisa.engine.tensor
    else:
        data, dst, eng = nl.ndarray((64, 64), nl.float32, buffer=nl.psum), psum_tile(64, 64), nisa.engine.tensor
    with pytest.raises(NkiValidationError, match=msg):
        nisa.nc_transpose(dst=dst, data=data, engine=eng)


@pytest.mark.parametrize("kwargs, msg", [
    ({"accumulate": 1}, "accumulate must be None, True or False, got 1"),
    ({"perf_mode": nisa.matmul_perf_mode.double_row}, r"double_row needs stationary shaped \[K, 2, ...\]"),
    ({"perf_mode": "fast"}, "perf_mode must be matmul_perf_mode.none or .double_row, got 'fast'"),
    ({"tile_position": (0, 64)}, "tiling mode needs both tile_position"),
    ({"tile_position": (0, 48), "tile_size": (128, 64)}, "start column 48 must be a multiple of the "
                                                         "column size 64"),
    ({"tile_position": (0, 0), "tile_size": (128, 96)}, "tile_size column size 96 must be 32, 64 or 128"),
    ({"tile_position": (0, 64), "tile_size": (128, 64)}, "stationary free size 128 exceeds the PE "
                                                         "tile's 64 columns"),
    ({"is_transpose": True}, r"is_transpose=True needs a square identity moving tile \[128, 128\]"),
])
def test_matmul_argument_rules(kwargs, msg):
    st = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
    mv = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    with pytest.raises(NkiValidationError, match=msg):
        nisa.nc_matmul(psum_tile(128, 512), st, mv, **kwargs)


def test_matmul_row_column_tiling_and_transpose_mode():
    a = RNG.standard_normal((64, 32)).astype(BF16)
    b = RNG.standard_normal((64, 256)).astype(BF16)
    dst = psum_tile(32, 256)
    nisa.nc_matmul(dst, tile(a), tile(b), tile_position=(64, 32), tile_size=(64, 32))
    np.testing.assert_allclose(dst.np(), a.astype(np.float32).T @ b.astype(np.float32), rtol=1e-5,
                               atol=1e-4)
    with pytest.raises(NkiValidationError, match="contraction size 64 exceeds the PE tile's 32 rows"):
        nisa.nc_matmul(dst, tile(a), tile(b), tile_position=(0, 0), tile_size=(32, 32))
    # transpose mode: identity moving tile, bit-exact incl. NaN / Inf, dst in the input dtype
    x = RNG.standard_normal((96, 64)).astype(BF16)
    x[3, 5], x[7, 1] = np.nan, np.inf
    out = nl.ndarray((64, 96), nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(out, tile(x), tile(np.eye(96, dtype=BF16)), is_transpose=True)
    np.testing.assert_array_equal(out.np().view(np.uint16), x.T.view(np.uint16))
    with pytest.raises(NkiValidationError, match="needs the identity matrix"):
        nisa.nc_matmul(out, tile(x), tile(np.ones((96, 96), BF16)), is_transpose=True)
    with pytest.raises(NkiValidationError, match="float8_e4m3fn not supported"):
        nisa.nc_matmul(psum_tile(16, 16), tile(np.zeros((16, 16), ml_dtypes.float8_e4m3fn)),
                       tile(np.zeros((16, 16), ml_dtypes.float8_e4m3fn)))


def test_accumulate_random_sequences_match_reference_model():
    """Random mixes of accumulate=None/True/False and region writes vs an explicit per-element model."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        dst = psum_tile(8, 16)
        ref = np.zeros((8, 16), np.float32)
        written = np.zeros((8, 16), bool)
        for _ in range(4):
            c0 = int(rng.integers(0, 15))
            c1 = int(rng.integers(c0 + 1, 17))
            acc = [None, True, False][int(rng.integers(0, 3))]
            if acc is True and not written[:, c0:c1].all():
                acc = None  # (True onto unwritten elements is undefined; covered elsewhere)
            a = rng.standard_normal((4, 8)).astype(np.float32)
            b = rng.standard_normal((4, c1 - c0)).astype(np.float32)
            nisa.nc_matmul(dst[:, c0:c1], tile(a), tile(b), accumulate=acc)
            r = a.T @ b
            w = written[:, c0:c1]
            region = ref[:, c0:c1]
            if acc is False:
                region[...] = r
            elif acc is True:
                region += r
            else:
                region[...] = np.where(w, region + r, r)
            w[...] = True
        np.testing.assert_allclose(dst.np()[written], ref[written], rtol=1e-5, atol=1e-5)
        assert np.isnan(dst.np()[~written]).all()


def test_matmul_double_row_fp8():
    # perf_mode=double_row (fp8, NeuronCore-v3+): contraction over partitions x a free dim of 2
    a = RNG.standard_normal((128, 2, 64)).astype(ml_dtypes.float8_e4m3)
    b = RNG.standard_normal((128, 2, 256)).astype(ml_dtypes.float8_e5m2)
    dst = psum_tile(64, 256)
    with trace.record() as tr:
        nisa.nc_matmul(dst, tile(a), tile(b), perf_mode=nisa.matmul_perf_mode.double_row)
    ref = a.astype(np.float64).reshape(256, 64).T @ b.astype(np.float64).reshape(256, 256)
    np.testing.assert_allclose(dst.np(), ref, rtol=1e-5, atol=1e-3)
    assert tr.instrs[0].attrs["perf_mode"] == "double_row"
    assert tr.instrs[0].flops == 2 * 256 * 64 * 256
    with pytest.raises(NkiValidationError, match="double_row needs fp8"):
        nisa.nc_matmul(dst, tile(a.astype(BF16)), tile(b.astype(BF16)), perf_mode="double_row")
    with pytest.raises(NkiValidationError, match="cannot be combined with column tiling"):
        nisa.nc_matmul(psum_tile(32, 256), tile(a[:, :, :32]), tile(b), perf_mode="double_row",
                       tile_position=(0, 0), tile_size=(128, 32))


