"""Conformance cases of nki-library's core/rmsnorm rmsnorm_quant kernel, written from its test file.

``test/integration/nkilib/core/rmsnorm/test_rmsnorm_quant.py`` (``test_rmsnorm_quant_lnc_unit``: every row,
ROW and STATIC quantization), bf16, B = 1, H = 16384, LNC 2; and every row of ``test_rmsnorm_quant_vnc_unit``
(fp16, ROW, RMS norm, LNC 1 and 2, H 8192 / 16384, S up to 32,768; hidden then gamma drawn uniform in [0, 10)
from one ``default_rng(0)``; gamma [H] at LNC 1). The rows draw hidden [B, S, H] then gamma
[1, H] from one of the test's generators, each fresh per row: ``gaussian_tensor_generator()`` (one normal
generator, seed 0), ``duplicate_row_rmsnorm_inp_generator()`` (one normal row [B, 1, H] from a seed-0
generator, repeated over S and divided by 100 in bf16; gamma ``np.random.seed(0)`` then ``random_sample``)
or its ``all_ones`` form (hidden and gamma ones). A STATIC row's input dequantization scale, [128, 1] fp32,
is one value drawn by the test's ``static_scale_wrapper`` (a seed-0 generator's ``normal(0.5, 0.1)``).

The kernel writes fp8 e4m3 values; with ROW quantization each row's fp32 dequantization scale follows in 4
trailing bytes. The test's validator (``rmsnorm_quant_ref`` in the test module, :func:`rmsnorm_quant_golden`
here) compares the fp8 values as fp32 at rtol 0.072 and the ROW scales at rtol 0.007 (atol 1e-8,
maxAllClose's default). The golden's fp8 cast and the generators' bf16 casts are nki-library's
``neuron_dtypes.static_cast`` (not installable, its rounding not documented), taken here as
round-to-nearest-even (ml_dtypes).
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
GAUSSIAN, DUPLICATE, ONES = "gaussian", "duplicate rows", "all ones"  # the test's tensor generators
UNIFORM = "uniform 0-10"  # test_rmsnorm_quant_vnc_unit's quant_input_tensor_generator()
F16 = np.dtype(np.float16)


def _hidden_gamma(gen: str, b: int, s: int, h: int, lnc: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """hidden [b, s, h] and gamma ([1, h] at LNC 2, [h] at LNC 1) as the test's generator ``gen`` draws them."""
    if gen == UNIFORM:  # one default_rng(0), uniform in [0, 10), fp16
        rng = np.random.default_rng(0)
        return (rng.uniform(0, 10, (b, s, h)).astype(F16),
                rng.uniform(0, 10, (1, h) if lnc > 1 else (h,)).astype(F16))
    if gen == ONES:
        return np.ones((b, s, h), BF16), np.ones((1, h), BF16)
    rng = np.random.default_rng(0)
    if gen == GAUSSIAN:
        return rng.normal(size=(b, s, h)).astype(BF16), rng.normal(size=(1, h)).astype(BF16)
    row = rng.normal(size=(b, 1, h)).astype(BF16)
    hidden = (np.broadcast_to(row, (b, s, h)) / BF16.type(100.0)).astype(BF16)
    np.random.seed(0)  # np_random_sample() reseeds the global generator for gamma
    return hidden, np.random.random_sample((1, h)).astype(BF16)


def _inputs(s: int, quant_only: bool, lower_bound: float, static: bool, gen: str, h: int = 16384, lnc: int = 2
            ) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        types = importlib.import_module(f"{LIB}.utils.common_types")
        kargs_cls = importlib.import_module(f"{LIB}.rmsnorm.rmsnorm_quant").RmsNormQuantKernelArgs
        hidden, gamma = _hidden_gamma(gen, 1, s, h, lnc)
        scale = None
        if static:
            scale = np.full((128, 1), np.random.default_rng(0).normal(loc=0.5, scale=0.1), np.float32)
        qtype = types.QuantizationType.STATIC if static else types.QuantizationType.ROW
        kargs = kargs_cls(quantization_type=qtype, lower_bound=lower_bound,
                          norm_type=types.NormType.NO_NORM if quant_only else types.NormType.RMS_NORM, eps=1e-6)
        return {"hidden": hidden, "ln_w": gamma, "kargs": kargs, "input_dequant_scale": scale}
    return make


def rmsnorm_quant_golden(hidden: Any, ln_w: Any, kargs: Any, input_dequant_scale: Any = None,
                         **_: Any) -> dict[str, np.ndarray]:
    """The test's reference. RMS norm (unless NO_NORM) in fp32; ROW: per-row absmax (clipped to
    ``lower_bound`` when > 0) / 240 as the dequantization scale, values * 240 / absmax; STATIC: values
    divided by the input dequantization scale, clipped to +-240. Values cast to fp8 e4m3."""
    x = hidden.float().numpy()
    if kargs.norm_type.name != "NO_NORM":
        rms = np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True))
        x = x * np.reciprocal(rms + kargs.eps) * ln_w.float().numpy()
    if kargs.quantization_type.name == "STATIC":
        quant = np.reciprocal(input_dequant_scale.numpy()[0, 0])
        return {"values": np.clip(x * quant, -FP8_RANGE, FP8_RANGE).astype(FP8)}
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    if kargs.lower_bound > 0:
        absmax = np.clip(absmax, None, kargs.lower_bound)
        x = np.clip(x, -kargs.lower_bound, kargs.lower_bound)
    scale = (absmax / FP8_RANGE).astype(np.float32)
    # fp8, so the harness hands the kernel's fp8 bytes to _compare unconverted
    return {"values": (x * np.reciprocal(scale)).astype(FP8), "dequant_scale": scale}


def _compare(inputs: dict, actual: dict, expected: dict) -> tuple[dict, dict]:
    """The validator's view of the kernel's bytes. STATIC: [B, S, H] fp8 values. ROW: [B, S, H + 4] fp8,
    the first H values, the last 4 bytes one fp32 scale; the kernel has one output, so both checks
    become one comparison: the values as they are (allowed: 1e-8 + 0.072 * max|golden value|), then
    each scale's error rescaled so that it stays within that allowance exactly when it is within
    0.007 * max|golden scale|."""
    b, s, h = inputs["hidden"].shape
    want_values = expected["values"].astype(np.float32)
    if "dequant_scale" not in expected:
        return {"values": np.asarray(actual["values"]).astype(np.float32)}, {"values": want_values}
    raw = np.ascontiguousarray(np.asarray(actual["values"])).view(np.uint8).reshape(b, s, h + 4)
    values = raw[:, :, :h].view(FP8).astype(np.float32)
    scale = np.ascontiguousarray(raw[:, :, h:]).view(np.float32).reshape(b, s, 1)
    want_scale = expected["dequant_scale"]
    allowed = 1e-8 + VALUES_RTOL * float(np.abs(want_values).max())
    scale_err = (scale - want_scale) * (allowed / (SCALE_RTOL * float(np.abs(want_scale).max())))
    return ({"values": np.concatenate([values.ravel(), scale_err.ravel()])},
            {"values": np.concatenate([want_values.ravel(), np.zeros(scale_err.size, np.float32)])})


# seqlen, quant_only, lower_bound, static, generator: the rows of test_rmsnorm_quant_lnc_unit in its order
_ROWS = [(2, True, 0.0, False, GAUSSIAN), (2, True, 0.5, False, GAUSSIAN), (2, False, 0.0, False, GAUSSIAN),
         (2, False, 0.5, False, GAUSSIAN), (2048, False, 0.0, False, GAUSSIAN), (160, False, 0.0, False, GAUSSIAN),
         (160, False, 0.0, False, DUPLICATE), (160, False, 0.0, False, ONES), (160, True, 0.0, False, GAUSSIAN),
         (2, True, 0.0, True, GAUSSIAN), (2, False, 0.0, True, GAUSSIAN), (2048, False, 0.0, True, GAUSSIAN),
         (160, False, 0.0, True, GAUSSIAN), (160, False, 0.0, True, DUPLICATE), (160, False, 0.0, True, ONES),
         (160, True, 0.0, True, GAUSSIAN)]
# seqlen, lower_bound, lnc, hidden: the 9 rows of test_rmsnorm_quant_vnc_unit (fp16, uniform [0, 10) inputs, ROW,
# RMS norm; its intermediate column is not used by the test)
_VNC_ROWS = [(128, 0.0, 1, 16384), (128, 0.5, 1, 16384), (128, 0.0, 2, 16384), (128, 0.5, 2, 16384),
             (256, 0.0, 2, 8192), (2048, 0.0, 2, 8192), (2048, 0.0, 2, 16384), (32768, 0.0, 2, 8192),
             (32768, 0.0, 2, 16384)]


def _name(quant_only: bool, lower_bound: float, static: bool, gen: str) -> str:
    return (("static" if static else "row") + " fp8" + (" quant only" if quant_only else " rmsnorm")
            + (f" lower_bound={lower_bound:g}" if lower_bound else "") + ("" if gen == GAUSSIAN else f" {gen}"))


def rmsnorm_quant_cases() -> list[Case]:
    vnc = [Case(
        kernel="core/rmsnorm/rmsnorm_quant", name="fp16 " + _name(False, lb, False, UNIFORM), shapes=f"B=1 S={s} H={h}",
        entry=f"{LIB}.rmsnorm.rmsnorm_quant:rmsnorm_quant_kernel",
        reference="trnkit.conformance.cases_rmsnorm_quant:rmsnorm_quant_golden",
        inputs=_inputs(s, False, lb, False, UNIFORM, h, lnc), outputs=("values",), lnc=lnc, rtol=VALUES_RTOL,
        atol=1e-8, postprocess=_compare, test_file=f"{TESTS}/test_rmsnorm_quant.py") for s, lb, lnc, h in _VNC_ROWS]
    return [Case(
        kernel="core/rmsnorm/rmsnorm_quant", name=_name(qo, lb, st, gen), shapes=f"B=1 S={s} H=16384",
        entry=f"{LIB}.rmsnorm.rmsnorm_quant:rmsnorm_quant_kernel",
        reference="trnkit.conformance.cases_rmsnorm_quant:rmsnorm_quant_golden", inputs=_inputs(s, qo, lb, st, gen),
        outputs=("values",), lnc=2, rtol=VALUES_RTOL, atol=1e-8, postprocess=_compare,
        note="fp8 casts taken as round-to-nearest-even (ml_dtypes)" if st or gen != GAUSSIAN else "",
        test_file=f"{TESTS}/test_rmsnorm_quant.py") for s, qo, lb, st, gen in _ROWS] + vnc
