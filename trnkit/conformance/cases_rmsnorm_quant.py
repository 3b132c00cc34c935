"""Conformance cases of nki-library's core/rmsnorm rmsnorm_quant kernel, written from its test file.

``test/integration/nkilib/core/rmsnorm/test_rmsnorm_quant.py`` (``test_rmsnorm_quant_lnc_unit``, its
``gaussian_tensor_generator()`` ROW rows): hidden [B, S, H] then gamma from one fresh normal generator
(seed 0), bf16, LNC 2. The kernel writes fp8 e4m3 values, and with ROW quantization each row's fp32
dequantization scale in 4 trailing bytes. The test's validator (``rmsnorm_quant_ref`` in the test
module, :func:`rmsnorm_quant_golden` here) compares the fp8 values as fp32 at rtol 0.072 and the
scales at rtol 0.007 (atol 1e-8, maxAllClose's default); the golden's fp8 cast is nki-library's
``neuron_dtypes.static_cast``, taken here as round-to-nearest-even (ml_dtypes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["rmsnorm_quant_cases", "rmsnorm_quant_golden"]

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core/rmsnorm"
FP8_RANGE = 240.0
VALUES_RTOL, SCALE_RTOL = 0.072, 0.007


def _inputs(b: int, s: int, h: int, quant_only: bool, lower_bound: float) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        types = importlib.import_module(f"{LIB}.utils.common_types")
        kargs_cls = importlib.import_module(f"{LIB}.rmsnorm.rmsnorm_quant").RmsNormQuantKernelArgs
        rng = np.random.default_rng(0)
        hidden = rng.normal(size=(b, s, h)).astype(BF16)
        gamma = rng.normal(size=(1, h)).astype(BF16)  # [1, H] at LNC 2
        kargs = kargs_cls(quantization_type=types.QuantizationType.ROW, lower_bound=lower_bound,
                          norm_type=types.NormType.NO_NORM if quant_only else types.NormType.RMS_NORM, eps=1e-6)
        return {"hidden": hidden, "ln_w": gamma, "kargs": kargs, "input_dequant_scale": None}
    return make


def rmsnorm_quant_golden(hidden: Any, ln_w: Any, kargs: Any, **_: Any) -> dict[str, np.ndarray]:
    """The test's reference (ROW): RMS norm (unless NO_NORM) in fp32, per-row absmax (clipped to
    ``lower_bound`` when > 0) / 240 as the dequantization scale, values * 240 / absmax cast to fp8."""
    x = hidden.float().numpy()
    if kargs.norm_type.name != "NO_NORM":
        rms = np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True))
        x = x * np.reciprocal(rms + kargs.eps) * ln_w.float().numpy()
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    if kargs.lower_bound > 0:
        absmax = np.clip(absmax, None, kargs.lower_bound)
        x = np.clip(x, -kargs.lower_bound, kargs.lower_bound)
    scale = (absmax / FP8_RANGE).astype(np.float32)
    # fp8, so the harness hands the kernel's fp8 bytes to _compare unconverted
    return {"values": (x * np.reciprocal(scale)).astype(FP8), "dequant_scale": scale}


def _compare(inputs: dict, actual: dict, expected: dict) -> tuple[dict, dict]:
    """The validator's view of the kernel's bytes: [B, S, H + 4] fp8, the first H values, the last 4
    bytes one fp32 scale. The kernel has one output, so both checks become one comparison: the
    values as they are (allowed: 1e-8 + 0.072 * max|golden value|), then each scale's error rescaled
    so that it stays within that allowance exactly when it is within 0.007 * max|golden scale|."""
    b, s, h = inputs["hidden"].shape
    raw = np.ascontiguousarray(np.asarray(actual["values"])).view(np.uint8).reshape(b, s, h + 4)
    values = raw[:, :, :h].view(FP8).astype(np.float32)
    scale = np.ascontiguousarray(raw[:, :, h:]).view(np.float32).reshape(b, s, 1)
    want_values = expected["values"].astype(np.float32)
    want_scale = expected["dequant_scale"]
    allowed = 1e-8 + VALUES_RTOL * float(np.abs(want_values).max())
    scale_err = (scale - want_scale) * (allowed / (SCALE_RTOL * float(np.abs(want_scale).max())))
    return ({"values": np.concatenate([values.ravel(), scale_err.ravel()])},
            {"values": np.concatenate([want_values.ravel(), np.zeros(scale_err.size, np.float32)])})


# seqlen, quant_only, lower_bound (B = 1, H = 16384, LNC 2; the ROW rows drawn by gaussian_tensor_generator)
_ROWS = [(2, True, 0.0), (2, True, 0.5), (2, False, 0.0), (2, False, 0.5), (2048, False, 0.0), (160, False, 0.0),
         (160, True, 0.0)]


def rmsnorm_quant_cases() -> list[Case]:
    return [Case(
        kernel="core/rmsnorm/rmsnorm_quant", name="row fp8" + (" quant only" if qo else " rmsnorm")
        + (f" lower_bound={lb:g}" if lb else ""), shapes=f"B=1 S={s} H=16384",
        entry=f"{LIB}.rmsnorm.rmsnorm_quant:rmsnorm_quant_kernel",
        reference="trnkit.conformance.cases_rmsnorm_quant:rmsnorm_quant_golden", inputs=_inputs(1, s, 16384, qo, lb),
        outputs=("values",), lnc=2, rtol=VALUES_RTOL, atol=1e-8, postprocess=_compare,
        test_file=f"{TESTS}/test_rmsnorm_quant.py") for s, qo, lb in _ROWS]
