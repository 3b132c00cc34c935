"""Conformance cases of nki-library's core/output_projection kernels, written from their test files.

``test/integration/nkilib/core/output_projection/test_output_proj_tkg.py``: output_projection_tkg
against ``output_projection_tkg_torch_ref`` at rtol 2e-2 / atol 1e-5, ``CompilerArgs()`` (LNC 2). The
rows of ``OUTPUT_PROJ_TKG_TEST_CASES`` and the two manual rows. Unquantized inputs from the test's
``gaussian_tensor_generator()`` (attention, then weight, from one ``default_rng(0)``; the bias from a fresh
one with std 100). The STATIC / ROW fp8 rows (rtol 5e-2) draw as the test's ``build_output_proj_tkg_input``:
``np_random_sample()`` (``np.random.seed(0)``) draws the attention uniform in [0, 1) as bf16, mapped to
[-1, 1) in bf16 arithmetic; STATIC then draws the input scale's perturbation (abs max / 240 times
uniform(0.995, 1.005)); then the weight the same way, divided in bf16 by its scale (abs max / 240, per
column for ROW) and cast to fp8 e4m3. Those casts are nki-library's ``neuron_dtypes.static_cast`` (not
installable, its rounding not documented), taken here as round-to-nearest-even (ml_dtypes).
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
FP8 = np.dtype(ml_dtypes.float8_e4m3)
FP8_MAX = 240.0
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


# B, n_heads, S_tkg, d_head, H, quantization, test_bias, transpose_out (the STATIC and ROW rows, in order)
_TKG_FP8 = [
    (16, 8, 1, 128, 8192, "STATIC", True, True), (16, 8, 1, 128, 8192, "STATIC", False, True),
    (16, 8, 1, 128, 8192, "STATIC", True, False), (8, 8, 1, 128, 8192, "STATIC", False, False),
    (64, 8, 5, 128, 8192, "STATIC", True, True), (32, 8, 3, 128, 3072, "STATIC", False, False),
    (128, 8, 3, 128, 3072, "STATIC", True, False), (512, 8, 7, 128, 3072, "STATIC", True, False),
    (32, 6, 3, 128, 3072, "STATIC", False, False), (64, 8, 5, 128, 8192, "STATIC", False, True),
    (32, 6, 3, 128, 3072, "STATIC", False, True), (128, 6, 1, 128, 3072, "STATIC", True, True),
    (16, 8, 1, 128, 3072, "ROW", True, False), (16, 8, 1, 128, 3072, "ROW", False, False),
    (16, 8, 1, 128, 3072, "ROW", True, True), (16, 8, 1, 128, 3072, "ROW", False, True),
    (128, 8, 1, 128, 3072, "ROW", True, False), (128, 8, 1, 128, 3072, "ROW", True, True),
    (256, 8, 1, 128, 3072, "ROW", True, False), (256, 8, 1, 128, 3072, "ROW", True, True),
    (512, 8, 1, 128, 3072, "ROW", True, False), (1024, 8, 1, 128, 3072, "ROW", True, False),
    (1024, 8, 1, 128, 3072, "ROW", True, True), (64, 8, 1, 128, 8192, "ROW", True, False),
    (64, 8, 1, 128, 8192, "ROW", True, True),
]


def _tkg_fp8_inputs(b: int, heads: int, s: int, d: int, h: int, quant: str, bias: bool, transpose: bool
                    ) -> Callable[[], dict[str, Any]]:
    """``build_output_proj_tkg_input`` for STATIC / ROW (see the module doc)."""
    def make() -> dict[str, Any]:
        np.random.seed(0)
        to_range = lambda shape: 2 * np.random.random_sample(shape).astype(BF16) - 1  # noqa: E731  (in bf16)
        attention = to_range((d, b, heads, s))
        in_scale = None
        if quant == "STATIC":
            in_scale = np.full((128, 1), np.abs(attention).max() / FP8_MAX * np.random.uniform(0.995, 1.005),
                               np.float32)
        weight = to_range((d * heads, h))
        w_scale = np.abs(weight).max(**({"axis": 0, "keepdims": True} if quant == "ROW" else {})) / FP8_MAX
        qtype = getattr(importlib.import_module(f"{LIB}.utils.common_types").QuantizationType, quant)
        return {"attention": attention, "weight": (weight / w_scale).astype(FP8),
                "bias": (np.random.default_rng(0).normal(size=(1, h)) * 100).astype(BF16) if bias else None,
                "quantization_type": qtype,
                "weight_scale": np.broadcast_to(np.asarray(w_scale, np.float32).reshape(1, -1),
                                                (128, h if quant == "ROW" else 1)).copy(),
                "input_scale": in_scale, "TRANSPOSE_OUT": transpose, "OUT_IN_SB": False}
    return make


def _tkg_cases() -> list[Case]:
    cases = []
    rows = [(*r[:5], "NONE", *r[5:]) for r in _TKG] + _TKG_FP8
    for b, heads, s, d, h, quant, bias, transpose in rows:
        negative = transpose and h % (128 * 2) != 0
        name = ("bf16" if quant == "NONE" else f"bf16 x fp8 {quant.lower()}") + (" bias" if bias else "") \
            + (" TRANSPOSE_OUT" if transpose else "") + (" (must reject)" if negative else "")
        inputs = (_tkg_inputs(b, heads, s, d, h, bias, transpose) if quant == "NONE"
                  else _tkg_fp8_inputs(b, heads, s, d, h, quant, bias, transpose))
        cases.append(Case(
            kernel="core/output_projection/tkg", name=name, shapes=f"B={b} heads={heads} S={s} d={d} H={h}",
            entry=f"{LIB}.output_projection.output_projection_tkg:output_projection_tkg",
            reference=f"{LIB}.output_projection.output_projection_tkg_torch:output_projection_tkg_torch_ref",
            inputs=inputs, outputs=("out",), lnc=2, rtol=2e-2 if quant == "NONE" else 5e-2, atol=1e-5,
            negative=negative, note="" if quant == "NONE" else "fp8 / bf16 casts taken as round-to-nearest-even "
            "(ml_dtypes)", test_file=f"{TESTS}/test_output_proj_tkg.py"))
    return cases


# -- output_projection_cte (test_output_proj_cte.py, test_output_proj_cte_bf16_unit) ----------------
# batch, seqlen, hidden, n_head, d_head, test_bias: all 46 rows of OUTPUT_PROJ_CTE_UNIT_CASES, in its order
_CTE = [
    (1, 16, 5120, 10, 128, True), (1, 128, 3072, 16, 64, True), (1, 1024, 3072, 16, 64, True),
    (1, 2048, 3072, 16, 64, True), (1, 10240, 3072, 8, 64, True), (1, 128, 3072, 16, 10, True),
    (1, 128, 3072, 17, 10, True), (1, 128, 3072, 8, 32, True), (1, 128, 8192, 1, 128, False),
    (1, 256, 8192, 1, 128, False), (1, 512, 8192, 1, 128, False), (1, 2048, 8192, 1, 128, False),
    (1, 4096, 8192, 1, 128, False), (1, 8192, 8192, 1, 128, False), (1, 16384, 8192, 1, 128, False),
    (1, 512, 8192, 2, 128, False), (1, 1024, 8192, 2, 128, False), (1, 2048, 8192, 2, 128, False),
    (1, 4096, 8192, 2, 128, False), (1, 8192, 8192, 2, 128, False), (1, 10240, 8192, 2, 128, False),
    (1, 16384, 8192, 2, 128, False), (1, 512, 16384, 1, 128, False), (1, 1024, 16384, 1, 128, False),
    (1, 2048, 16384, 1, 128, False), (1, 4096, 16384, 1, 128, False), (1, 8192, 16384, 1, 128, False),
    (1, 10240, 16384, 1, 128, False), (1, 16384, 16384, 1, 128, False), (1, 1024, 1024, 1, 64, False),
    (1, 1024, 2048, 1, 64, False), (1, 1024, 3072, 1, 64, False), (1, 1024, 8192, 1, 64, False),
    (1, 1024, 20480, 3, 128, False), (4, 256, 7168, 4, 128, False), (4, 256, 7168, 1, 128, False),
    (1, 256, 7168, 1, 128, False), (1, 192, 1024, 1, 128, False), (1, 320, 2048, 2, 128, False),
    (1, 576, 3072, 3, 128, False), (1, 1088, 7168, 4, 128, False), (1, 2168, 8192, 5, 128, False),
    (1, 5096, 16384, 6, 128, False), (1, 9312, 16384, 7, 128, False), (1, 11474, 16384, 8, 128, False),
    (1, 20705, 16384, 9, 128, False),
]


def _cte_inputs(b: int, s: int, h: int, n: int, d: int, bias: bool, static_fp8: bool
                ) -> Callable[[], dict[str, Any]]:
    """The test's ``generate_output_proj_cte_inputs``: ``np_random_sample()`` (seed 0) draws the attention,
    cast to bf16; the bias from ``default_rng(0)`` x 100; then the weight: unquantized, the same generator's
    next draw as bf16; STATIC (``np_random_sample_static_quantize_inp()``, which reseeds 0), uniform in
    [-240, 240) cast to fp8 e4m3, then the weight and input scales, each ``random_sample() / 256`` as fp32."""
    def make() -> dict[str, Any]:
        np.random.seed(0)
        attention = np.random.random_sample((b, n, d, s)).astype(BF16)
        bias_t = (np.random.default_rng(0).normal(size=(1, h)) * 100).astype(BF16) if bias else None
        types = importlib.import_module(f"{LIB}.utils.common_types")
        if not static_fp8:
            return {"attention": attention, "weight": np.random.random_sample((n * d, h)).astype(BF16),
                    "bias": bias_t, "quantization_type": types.QuantizationType.NONE,
                    "input_scales": None, "weight_scales": None}
        np.random.seed(0)
        weight = (np.random.random_sample((n * d, h)) * 480.0 - 240.0).astype(FP8)
        w_scale, in_scale = (np.full((128, 1), np.random.random_sample() / 256.0, np.float32) for _ in range(2))
        return {"attention": attention, "weight": weight, "bias": bias_t,
                "quantization_type": types.QuantizationType.STATIC, "input_scales": in_scale,
                "weight_scales": w_scale}
    return make


def _cte_cases() -> list[Case]:
    """The 46 rows of ``_CTE`` from ``test_output_proj_cte_bf16_unit`` (rtol 2e-2) and from
    ``test_output_proj_cte_static_fp8_unit`` (the same table, STATIC fp8 weights, rtol 0.036)."""
    module = f"{LIB}.output_projection.output_projection_cte"
    return [Case(
        kernel="core/output_projection/cte", name=("bf16 x fp8 static" if fp8 else "bf16") + (" bias" if bias else ""),
        shapes=f"B={b} S={s} H={h} heads={n} d={d}", entry=f"{module}:output_projection_cte",
        reference=f"{module}.output_projection_cte_torch:output_projection_cte_torch_ref",
        inputs=_cte_inputs(b, s, h, n, d, bias, fp8), outputs=("out",), lnc=2, rtol=0.036 if fp8 else 2e-2,
        atol=1e-5, note="fp8 casts taken as round-to-nearest-even (ml_dtypes)" if fp8 else "",
        test_file=f"{TESTS}/test_output_proj_cte.py") for fp8 in (False, True) for b, s, h, n, d, bias in _CTE]


def projection_cases() -> list[Case]:
    return _tkg_cases() + _cte_cases()
