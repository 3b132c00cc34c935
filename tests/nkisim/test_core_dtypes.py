"""dtypes.cast: hardware rounding/saturation semantics vs numpy/ml_dtypes/torch; errors.require."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from trnkit.nkisim import dtypes, language as nl
from trnkit.nkisim.errors import NkiValidationError, require


def test_dtype_objects_are_numpy_dtypes():
    assert nl.bfloat16 == np.dtype(ml_dtypes.bfloat16)
    assert np.random.default_rng(0).standard_normal(3).astype(nl.bfloat16).dtype == nl.bfloat16
    assert dtypes.resolve("float8_e4m3") == nl.float8_e4m3
    assert ml_dtypes.finfo(nl.float8_e4m3).max == 240 and ml_dtypes.finfo(nl.float8_e4m3fn).max == 448


def test_cast_float_narrowing_is_rne():
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100
    got = dtypes.cast(x, nl.bfloat16)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(got.view(np.int16), ref)
    # exact ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 in bf16 -> even (1.0)
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    np.testing.assert_array_equal(dtypes.cast(ties, nl.bfloat16).astype(np.float32), [1.0, 1 + 2**-6])
    f8 = dtypes.cast(x / 100, nl.float8_e4m3fn)
    np.testing.assert_array_equal(f8.view(np.uint8), (x / 100).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_cast_float_to_int_rne_saturate_nan_zero():
    x = np.array([0.5, 1.5, 2.5, -2.5, 126.6, 300.0, -300.0, np.nan, np.inf], np.float32)
    np.testing.assert_array_equal(dtypes.cast(x, nl.int8), [0, 2, 2, -2, 127, 127, -128, 0, 127])
    np.testing.assert_array_equal(dtypes.cast(x, nl.uint8), [0, 2, 2, 0, 127, 255, 0, 0, 255])
    big = np.array([3e9, -3e9], np.float32)
    np.testing.assert_array_equal(dtypes.cast(big, nl.int32), [2**31 - 1, -(2**31)])


def test_cast_int_to_int_saturates_and_same_dtype_is_identity():
    x = np.array([-5, 70000, 200], np.int32)
    np.testing.assert_array_equal(dtypes.cast(x, nl.int16), [-5, 32767, 200])
    np.testing.assert_array_equal(dtypes.cast(x, nl.uint8), [0, 255, 200])
    assert dtypes.cast(x, nl.int32) is x
    np.testing.assert_array_equal(dtypes.cast(np.array([0.0, 2.0]), nl.bool_), [False, True])


def test_require_message_names_op_rule_and_values():
    with pytest.raises(NkiValidationError, match=r"^nc_matmul: stationary free size 256 exceeds "
                                                 r"gemm_stationary_fmax \(128\)$"):
        require(False, "nc_matmul", "stationary free size {m} exceeds gemm_stationary_fmax (128)", m=256)
    with pytest.raises(AssertionError, match=r"^op: rule \(x=3, y='a'\)$"):
        require(0, "op", "rule", x=3, y="a")
    require(True, "op", "never shown")
