"""Conformance cases of nki-library's core/output_projection kernels, written from their test files.

``test/integration/nkilib/core/output_projection/test_output_proj_tkg.py``: output_projection_tkg
against ``output_projection_tkg_torch_ref`` at rtol 2e-2 / atol 1e-5, ``CompilerArgs()`` (LNC 2). The
rows without quantization (``OUTPUT_PROJ_TKG_TEST_CASES`` with ``QuantizationType.NONE`` and the two
manual rows); inputs from the test's ``gaussian_tensor_generator()`` (attention, then weight, from one
``default_rng(0)``; the bias from a fresh one with std 100). Not run: the STATIC / ROW fp8 rows, whose
inputs go through nki-library's ``neuron_dtypes.static_cast`` to float8_e4m3 (its rounding is not
documented, so trnkit cannot rebuild the test's bytes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["projection_cases"]

BF16 = np.dtype(ml_dtypes.bfloat16)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core/output_projection"

# B, n_heads, S_tkg, d_head, H, test_bias, transpose_out (the QuantizationType.NONE rows, in order)
_TKG = [
    (512, 8, 4, 32, 3072, True, True), (4, 8, 4, 32, 3072, True, True), (4, 8, 4, 64, 3072, False, False),
    (4, 8, 4, 64, 5376, False, False), (4, 8, 4, 64, 5378, False, False), (4, 2, 4, 64, 7168, False, True),
    (4, 8, 4, 64, 3072, True, False), (4, 2, 4, 64, 8192, True, False), (4, 2, 4, 64, 16384, True, False),
    (4, 2, 4, 128, 8192, True, False), (4, 2, 4, 128, 16384, True, False), (4, 4, 8, 128, 8192, True, False),
    (4, 4, 8, 128, 16384, True, False), (4, 8, 8, 128, 8192, True, False), (4, 8, 8, 128, 16384, True, False),
    (4, 10, 8, 128, 8192, True, False), (4, 16, 8, 128, 16384, True, False), (4, 8, 4, 64, 3072, True, True),
    (4, 8, 4, 64, 8192, True, True), (4, 8, 4, 64, 16384, True, True), (4, 8, 4, 128, 16384, True, True),
    (4, 8, 8, 128, 16384, True, True), (4, 8, 5, 128, 10240, True, True), (4, 8, 5, 128, 16384, True, True),
    (192, 8, 3, 128, 3072, True, False), (128, 8, 3, 128, 3072, True, True),
    # MANUAL_TEST_CASES: H=602 transposed is not a multiple of 128 * LNC, a negative case
    (4, 10, 8, 128, 602, True, False), (4, 10, 8, 128, 602, True, True),
]


def _tkg_inputs(b: int, heads: int, s: int, d: int, h: int, bias: bool, transpose: bool
                ) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        rng = np.random.default_rng(0)
        attention = rng.normal(size=(d, b, heads, s)).astype(BF16)
        weight = rng.normal(size=(d * heads, h)).astype(BF16)
        quant = importlib.import_module(f"{LIB}.utils.common_types").QuantizationType.NONE
        return {"attention": attention, "weight": weight,
                "bias": (np.random.default_rng(0).normal(size=(1, h)) * 100).astype(BF16) if bias else None,
                "quantization_type": quant, "weight_scale": None, "input_scale": None,
                "TRANSPOSE_OUT": transpose, "OUT_IN_SB": False}
    return make


def _tkg_cases() -> list[Case]:
    cases = []
    for b, heads, s, d, h, bias, transpose in _TKG:
        negative = transpose and h % (128 * 2) != 0
        name = "bf16" + (" bias" if bias else "") + (" TRANSPOSE_OUT" if transpose else "") \
            + (" (must reject)" if negative else "")
        cases.append(Case(
            kernel="core/output_projection/tkg", name=name, shapes=f"B={b} heads={heads} S={s} d={d} H={h}",
            entry=f"{LIB}.output_projection.output_projection_tkg:output_projection_tkg",
            reference=f"{LIB}.output_projection.output_projection_tkg_torch:output_projection_tkg_torch_ref",
            inputs=_tkg_inputs(b, heads, s, d, h, bias, transpose), outputs=("out",), lnc=2,
            rtol=2e-2, atol=1e-5, negative=negative, test_file=f"{TESTS}/test_output_proj_tkg.py"))
    return cases


# -- output_projection_cte (test_output_proj_cte.py, test_output_proj_cte_bf16_unit) ----------------
# batch, seqlen, hidden, n_head, d_head, test_bias (rows of OUTPUT_PROJ_CTE_UNIT_CASES)
_CTE = [
    (1, 16, 5120, 10, 128, True), (1, 128, 3072, 16, 64, True), (1, 1024, 3072, 16, 64, True),
    (1, 2048, 3072, 16, 64, True), (1, 128, 3072, 16, 10, True), (1, 128, 3072, 17, 10, True),
    (1, 128, 3072, 8, 32, True), (1, 128, 8192, 1, 128, False), (1, 512, 8192, 2, 128, False),
    (1, 2048, 8192, 1, 128, False), (1, 1024, 1024, 1, 64, False), (1, 1024, 8192, 1, 64, False),
    (1, 1024, 20480, 3, 128, False), (1, 10240, 3072, 8, 64, True),
]


def _cte_inputs(b: int, s: int, h: int, n: int, d: int, bias: bool) -> Callable[[], dict[str, Any]]:
    """The test's ``generate_output_proj_cte_inputs`` (unquantized): ``np_random_sample()`` (seed 0)
    draws the attention then the weight, cast to bf16; the bias from ``default_rng(0)`` x 100."""
    def make() -> dict[str, Any]:
        np.random.seed(0)
        attention = np.random.random_sample((b, n, d, s)).astype(BF16)
        bias_t = (np.random.default_rng(0).normal(size=(1, h)) * 100).astype(BF16) if bias else None
        weight = np.random.random_sample((n * d, h)).astype(BF16)
        quant = importlib.import_module(f"{LIB}.utils.common_types").QuantizationType.NONE
        return {"attention": attention, "weight": weight, "bias": bias_t, "quantization_type": quant,
                "input_scales": None, "weight_scales": None}
    return make


def _cte_cases() -> list[Case]:
    module = f"{LIB}.output_projection.output_projection_cte"
    return [Case(
        kernel="core/output_projection/cte", name="bf16" + (" bias" if bias else ""),
        shapes=f"B={b} S={s} H={h} heads={n} d={d}", entry=f"{module}:output_projection_cte",
        reference=f"{module}.output_projection_cte_torch:output_projection_cte_torch_ref",
        inputs=_cte_inputs(b, s, h, n, d, bias), outputs=("out",), lnc=2, rtol=2e-2, atol=1e-5,
        test_file=f"{TESTS}/test_output_proj_cte.py") for b, s, h, n, d, bias in _CTE]


def projection_cases() -> list[Case]:
    return _tkg_cases() + _cte_cases()
