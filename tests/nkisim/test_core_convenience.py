"""nki.language convenience wrappers (nl.load/store/matmul/transpose/sum/max/mean/softmax, nl.<op>(tile))."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import trace
from trnkit.nkisim.errors import NkiValidationError

RNG = np.random.default_rng(5)


@nki.jit
def rmsnorm(a, g):
    """RMSNorm with the wrappers; rows on partitions, g broadcast to every row by a stride-0 DMA."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    rows, hidden = a.shape
    g_rows = nl.load(g.reshape((1, hidden)).broadcast(0, 128), dtype=nl.float32)  # [128, H]
    for r0 in range(0, rows, 128):
        x = nl.load(a[r0:r0 + 128, :], dtype=nl.float32)
        inv = nl.rsqrt(nl.add(nl.mean(nl.square(x), axis=1), 1e-6))  # [128, 1]
        y = nl.ndarray((128, hidden), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=x, op0=nl.multiply, operand0=inv)
        nl.store(out[r0:r0 + 128, :], nl.multiply(y, g_rows, dtype=a.dtype))
    return out


def test_rmsnorm_with_wrappers_matches_numpy():
    a = RNG.standard_normal((256, 64)).astype(np.float32)
    g = RNG.standard_normal(64).astype(np.float32)
    out = rmsnorm(a, g)
    ref = a / np.sqrt((a**2).mean(1, keepdims=True) + 1e-6) * g
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_softmax_sum_max_and_trace():
    x = RNG.standard_normal((64, 100)).astype(np.float32) * 4
    t = nl.ndarray(x.shape, nl.float32)
    t.np()[...] = x
    with trace.record() as tr:
        s = nl.softmax(t)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(s.np(), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert [i.op for i in tr] == ["tensor_reduce", "activation", "reciprocal", "tensor_scalar"]
    np.testing.assert_allclose(nl.sum(t, axis=1).np()[:, 0], x.sum(1), rtol=1e-5, atol=1e-4)
    assert nl.max(t, axis=[1], keepdims=True).shape == (64, 1)
    np.testing.assert_array_equal(nl.max(t, axis=1).np()[:, 0], x.max(1))
    with pytest.raises(NkiValidationError, match="must be the last contiguous free dims"):
        nl.sum(t, axis=0)


def test_matmul_transpose_and_binary_wrappers():
    a = RNG.standard_normal((64, 96)).astype(np.float32)   # [M, K]
    b = RNG.standard_normal((96, 128)).astype(np.float32)  # [K, N]
    ta, tb = nl.ndarray(a.shape, nl.float32), nl.ndarray(b.shape, nl.float32)
    ta.np()[...] = a
    tb.np()[...] = b
    ta_t = nl.ndarray((96, 64), nl.float32)
    ta_t.np()[...] = a.T
    p = nl.matmul(ta_t, tb, transpose_x=True)  # x given as [K, M]
    assert p.buffer is nl.psum and p.dtype == nl.float32
    np.testing.assert_allclose(p.np(), a @ b, rtol=1e-5, atol=1e-4)
    # NKI 0.4.0 release notes, Known Issues (carried forward to 0.6.0): "Calling nl.matmul(x, y) without setting
    # transpose_x=True will fail" (before, the interpreter inserted the transpose)
    with pytest.raises(NkiValidationError, match=r"nl.matmul: transpose_x=False: nl.matmul without transpose_x="
                       r"True is not supported \(NKI 0.4.0 release notes, Known Issues"):
        nl.matmul(ta, tb)
    at = nl.transpose(ta)
    assert at.buffer is nl.psum and at.shape == (96, 64)
    np.testing.assert_array_equal(at.np(), a.T)
    bt = nl.transpose(ta, dtype=nl.bfloat16)
    np.testing.assert_array_equal(bt.np(), a.T.astype(ml_dtypes.bfloat16))
    np.testing.assert_allclose(nl.subtract(1.0, ta).np(), 1.0 - a, rtol=1e-6)  # scalar first
    np.testing.assert_allclose(nl.exp(ta).np(), np.exp(a), rtol=1e-5)
    with pytest.raises(NkiValidationError):
        nl.add(ta, tb)  # no broadcasting / different element counts


def test_removed_old_api_names_explain():
    with pytest.raises(NkiValidationError, match="removed in NKI 0.2.0"):
        nl.arange(128)


def test_constants_and_identity():
    c = nl.shared_constant(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert c.buffer is nl.shared_hbm
    np.testing.assert_array_equal(c.np(), np.arange(6).reshape(2, 3))
    eye = nl.shared_identity_matrix(64, dtype=nl.bfloat16)
    assert eye.buffer is nl.sbuf and eye.dtype == nl.bfloat16
    np.testing.assert_array_equal(eye.np().astype(np.float32), np.eye(64))
    x = nl.ndarray((64, 32), nl.bfloat16)
    x.np()[...] = RNG.standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
    out = nl.ndarray((32, 64), nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(out, x, eye, is_transpose=True)  # the usual PE transpose idiom
    np.testing.assert_array_equal(out.np(), x.np().T)
    assert nl.expand_dims(x, 1).shape == (64, 1, 32)


def test_divide_and_a_scalar_power_wrapper_are_refused():
    """NKI 0.4.0 release notes, Known Issues, "NKI Language (experimental)" (carried forward to 0.6.0):
    "nki.language.divide is not supported -- Division is not available as a hardware instruction" and
    "nl.power(tile, scalar) is not supported. Use nl.power(tile, tile)"."""
    t = nl.ndarray((4, 8), nl.float32)
    t.np()[...] = 2.0
    with pytest.raises(NkiValidationError, match=r"nl.divide: nl.divide on tiles is not supported: division is "
                       r"not available as a hardware instruction; multiply by the reciprocal"):
        nl.divide(t, t)
    with pytest.raises(NkiValidationError, match=r"nl.divide: .*operands='tile \(4, 8\), scalar 2.0'"):
        nl.divide(t, 2.0)
    with pytest.raises(NkiValidationError, match=r"nl.power: nl.power\(tile, scalar\) is not supported: the "
                       r"exponent must be a tile too.*operands='tile \(4, 8\), scalar 3.0'"):
        nl.power(t, 3.0)
    assert (nl.power(t, t).np() == 4.0).all()                        # the documented form
    assert (nl.multiply(t, nl.reciprocal(t)).np() == 1.0).all()      # the documented workaround


@nki.jit
def _constant_per_core(x, diverge):
    pid = nl.program_id(0)
    c = nl.shared_constant(np.arange(8, dtype=np.float32).reshape(2, 4) + (pid if diverge else 0))
    t = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=c)
    out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
    if pid == 0:
        nisa.dma_copy(dst=out, src=t)
    return out


def test_shared_constant_element_types_and_lnc2_divergence():
    """nl.shared_constant (NKI 0.6 API reference): "Supported element types: float32, float16, bfloat16, int32,
    int16, int8, uint32, uint16, uint8, float8_e4m3fn, float8_e5m2, float8_e8m0fnu" and "With LNC=2, both cores
    share the same constant; the data must not diverge across cores". Before, both were accepted and program 1's
    data silently replaced program 0's in the one shared tensor."""
    x = np.zeros((2, 4), np.float32)
    np.testing.assert_array_equal(_constant_per_core[2](x, False), np.arange(8).reshape(2, 4))
    with pytest.raises(NkiValidationError, match=r"nl.shared_constant: constant '\w+' differs between the programs "
                       r"of the launch: program \(0,\) made it with 0.0 at \(0, 0\), program \(1,\) with 1.0; .*"
                       r"\"the data must not diverge across cores\""):
        _constant_per_core[2](x, True)
    np.testing.assert_array_equal(_constant_per_core(x, True), np.arange(8).reshape(2, 4))  # one program: fine
    for dt in (np.bool_, ml_dtypes.float8_e4m3):
        with pytest.raises(NkiValidationError, match=r"nl.shared_constant: element type (bool|float8_e4m3) is not "
                           r"supported \(the docs list float32, .*float8_e4m3fn"):
            nl.shared_constant(np.ones((2, 2), dt))
    assert nl.shared_constant(np.ones((2, 2), ml_dtypes.float8_e4m3fn)).dtype == nl.float8_e4m3fn
