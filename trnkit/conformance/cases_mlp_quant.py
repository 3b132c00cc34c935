"""Conformance cases of nki-library's core/mlp kernel with fp8 (ROW and STATIC quantization): TKG, fp8 weights; CTE,
fp8 input and weights.

``test/integration/nkilib/core/mlp/test_mlp_tkg.py`` (``test_mlp_tkg_unit``): the fp8 rows of its tables
(``..._vnc2_params``, ``..._row_quant_kernel_params``, ``..._row_quant_kernel_layout_swap_perms``,
``..._static_quant_kernel_params``, ``..._static_quant_kernel_layout_swap_perms``; a row the test lists twice
runs once) at rtol 2e-2 / atol 1e-5. Inputs as ``test_mlp_common.build_fused_norm_mlp`` draws them with the
test's ``random_lhs_and_random_bound_weight_tensor_generator(0, 241)`` (one ``default_rng(42)``): one hidden
row uniform(0, 241) repeated over batch and sequence, the gate / up / down weights uniform(0, 241) cast to
fp8 e4m3 (down in the optimized layout on its rows), each bias a constant ``random()``, then the scales, each
a constant ``random()`` (the down weight scale x 0.01): ROW [128, I] / [128, H] weight scales, STATIC [128, 1]
weight scales and input scales; gamma from the builder's own ``default_rng(42)`` uniform(-0.1, 0.1).

The golden (``golden_quant_mlp(quantize_activation=True)`` in nki-library's test package) is
:func:`mlp_quant_golden`, the same computation written from the test: the activations stay bf16 and each
projection is ``bf16(x @ w_fp8) * w_scale`` (the scale's first S rows broadcast over the batch, the test's
rule for B x S below 96).

``test_mlp_cte.py`` (``test_mlp_cte_unit``): the rows of ``MLP_CTE_UNIT_TEST_CASES_ROW_QUANT`` (rtol 4e-2, atol
1e-5), whose input arrives quantized: hidden ``[B, S, H + 4]`` fp8, the last 4 bytes of each row one fp32
dequantization scale. Drawn by the test's ``gaussian_tensor_generator(0, 10, modify_for_row_quant)`` (one
``default_rng(0)``, std 10): hidden, gate, up, down weights as fp8; its modifier (a fresh ``default_rng(0)``
per tensor) writes ``normal() * 0.001`` as the row scale bytes (redrawn while the 4 bytes are not finite fp8)
and makes every weight scale ``[128, F]`` one row ``normal(size=(1, F)) * 0.001`` repeated. The golden
(``golden_quant_mlp(quantize_activation=False)``) is :func:`mlp_cte_row_quant_golden`: each projection
``bf16(bf16(x @ w) * w_scale) * row_scale`` (the test rounds to bf16 before each scaling), the intermediate
row-quantized to fp8 (scale ``max(absmax / 240, 1e-5)``) before the down projection. The rows of
``MLP_CTE_UNIT_TEST_CASES_STATIC_QUANT`` (rtol 3e-2): hidden ``[B, S, H]`` fp8, drawn with std 5
(``modify_fp8_static_scale``: every weight and input scale ``[128, 1]`` the same ``normal() * 0.5`` of a fresh
``default_rng(0)``); golden :func:`mlp_cte_static_quant_golden`: each projection ``bf16(x @ w) * w_scale *
in_scale``, the intermediate ``bf16(x) / down_in_scale`` clipped to +-240 and cast to fp8.

The test's fp8 and bf16 casts are ``neuron_dtypes.static_cast`` (not installable, its rounding not
documented), taken here as round-to-nearest-even (ml_dtypes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .cases_mlp import LIB, MLP_REPAIR_NOTE, TESTS, _activation, _normalize, _np, _types, swap_down_layout
from .harness import Case

__all__ = ["mlp_quant_cases", "mlp_quant_golden", "mlp_cte_row_quant_golden",
           "mlp_cte_static_quant_golden", "tkg_quant_case"]

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3)
F32 = np.dtype(np.float32)
TKG_BS_SEQLEN_THRESHOLD = 96  # the test golden's threshold for broadcasting a scale's first S rows
FP8_NOTE = "fp8 / bf16 casts taken as round-to-nearest-even (ml_dtypes)"


def _quant_inputs(lnc: int, b: int, s: int, h: int, i: int, quant: str, norm: str, biases: tuple[bool, ...],
                  column_tiling: tuple[bool, bool], swapped_down: bool) -> Callable[[], dict]:
    """``build_fused_norm_mlp``'s draws with the test's bounded-weight generator (see the module doc)."""
    def make() -> dict[str, Any]:
        import nki.language as nl  # the interpreter, inside nki_is_interpreter

        types = _types()
        gen = np.random.default_rng(42)  # the generator's
        rng = np.random.default_rng(42)  # the builder's (gamma)
        hidden = np.repeat(np.repeat(gen.uniform(0, 241, size=(1, 1, h)).astype(BF16), b, axis=0), s, axis=1)
        gamma = rng.uniform(-0.1, 0.1, size=(1, h)).astype(BF16) if norm == "RMS_NORM" else None
        gate_w, up_w, down_w = (gen.uniform(0, 241, shape).astype(FP8) for shape in ((h, i), (h, i), (i, h)))
        if swapped_down:
            down_w = swap_down_layout(down_w, lnc)
        const = lambda shape, dt, k=1.0: np.full(shape, gen.random() * k, dt)  # noqa: E731
        bias = [const(shape, BF16) if on else None for shape, on in zip(((1, i), (1, i), (1, h)), biases)]
        if quant == "STATIC":
            w_scales = [const((128, 1), F32), const((128, 1), F32), const((128, 1), F32, 0.01)]
            in_scales = [const((128, 1), F32), const((128, 1), F32)]  # gate/up, down: unused by the TKG path
        else:
            w_scales = [const((128, i), F32), const((128, i), F32), const((128, h), F32, 0.01)]
            in_scales = [None, None]
        return {"hidden_tensor": hidden, "gate_proj_weights_tensor": gate_w, "up_proj_weights_tensor": up_w,
                "down_proj_weights_tensor": down_w, "normalization_weights_tensor": gamma,
                "gate_proj_bias_tensor": bias[0], "up_proj_bias_tensor": bias[1], "down_proj_bias_tensor": bias[2],
                "normalization_bias_tensor": None, "fused_add_tensor": None, "store_fused_add_result": False,
                "activation_fn": types.ActFnType.SiLU, "normalization_type": getattr(types.NormType, norm),
                "quantization_type": getattr(types.QuantizationType, quant), "gate_w_scale": w_scales[0],
                "up_w_scale": w_scales[1], "down_w_scale": w_scales[2], "gate_up_in_scale": in_scales[0],
                "down_in_scale": in_scales[1], "output_dtype": nl.bfloat16, "store_output_in_sbuf": False,
                "eps": 1e-6, "skip_gate_proj": False, "use_tkg_gate_up_proj_column_tiling": column_tiling[0],
                "use_tkg_down_proj_column_tiling": column_tiling[1],
                "use_tkg_down_proj_optimized_layout": swapped_down,
                "gate_clamp_upper_limit": None, "gate_clamp_lower_limit": None, "up_clamp_upper_limit": None,
                "up_clamp_lower_limit": None}
    return make


def _dequant_projection(x: np.ndarray, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The test's weight-only dequantized projection: ``bf16(x @ w) * scale[:S]`` (B x S < 96)."""
    b, s = x.shape[:2]
    if b * s >= TKG_BS_SEQLEN_THRESHOLD:
        raise ValueError(f"mlp_quant_golden: B x S = {b * s} >= {TKG_BS_SEQLEN_THRESHOLD}, the test's "
                         "scale-broadcast rule for it is not written here")
    return (x @ w).astype(BF16).astype(np.float32) * scale[:s]


def mlp_quant_golden(hidden_tensor: Any, gate_proj_weights_tensor: Any, up_proj_weights_tensor: Any,
                     down_proj_weights_tensor: Any, gate_w_scale: Any, up_w_scale: Any, down_w_scale: Any,
                     normalization_weights_tensor: Any = None, gate_proj_bias_tensor: Any = None,
                     up_proj_bias_tensor: Any = None, down_proj_bias_tensor: Any = None,
                     normalization_type: Any = None, eps: float = 1e-6,
                     use_tkg_down_proj_optimized_layout: bool = False, swapped_down_lnc: int = 0,
                     **_: Any) -> dict[str, np.ndarray]:
    """nki-library's TKG fp8 MLP golden: norm -> silu(deq(x @ gate) + b) * (deq(x @ up) + b) -> deq(@ down)
    + b, with ``deq(y) = bf16(y) * weight scale``; the output rounded to bf16."""
    x = _normalize(normalization_type.name, _np(hidden_tensor).astype(np.float64),
                   _np(normalization_weights_tensor), None, eps)
    gate = _dequant_projection(x, _np(gate_proj_weights_tensor), _np(gate_w_scale))
    up = _dequant_projection(x, _np(up_proj_weights_tensor), _np(up_w_scale))
    for t, bias in ((gate, gate_proj_bias_tensor), (up, up_proj_bias_tensor)):
        if bias is not None:
            t += _np(bias)
    down = _np(down_proj_weights_tensor)
    if use_tkg_down_proj_optimized_layout:
        down = swap_down_layout(down, swapped_down_lnc, inverse=True)
    out = _dequant_projection(_activation("SiLU", gate) * up, down, _np(down_w_scale))
    if down_proj_bias_tensor is not None:
        out = out + _np(down_proj_bias_tensor)
    return {"out": out.astype(BF16).astype(np.float32)}


def _row_scale_bytes(b: int, s: int) -> np.ndarray:
    """``modify_for_row_quant``'s hidden tail: ``normal() * 0.001`` (fresh ``default_rng(0)``) as the 4 fp8
    bytes of an fp32, redrawn while any byte is not a finite fp8, repeated over [B, S]."""
    rng = np.random.default_rng(0)
    while True:
        tail = (rng.normal(size=(1, 1, 1)) * 0.001).astype(np.float32).view(FP8)
        if np.isfinite(tail.astype(np.float32)).all():
            return np.repeat(np.repeat(tail, b, axis=0), s, axis=1)


def _cte_quant_inputs(b: int, s: int, h: int, i: int, quant: str) -> Callable[[], dict]:
    """``build_fused_norm_mlp(is_input_quantized=True)`` with the ROW / STATIC test's generator (see the
    module doc)."""
    def make() -> dict[str, Any]:
        import nki.language as nl  # the interpreter, inside nki_is_interpreter

        types = _types()
        gen, std = np.random.default_rng(0), 10.0 if quant == "ROW" else 5.0
        hidden = (gen.normal(size=(b, s, h + 4 if quant == "ROW" else h)) * std).astype(FP8)
        gate_w, up_w, down_w = ((gen.normal(size=shape) * std).astype(FP8) for shape in ((h, i), (h, i), (i, h)))
        if quant == "ROW":
            hidden[:, :, -4:] = _row_scale_bytes(b, s)
            w_scale = lambda f: np.repeat(np.random.default_rng(0).normal(size=(1, f)) * 0.001, 128,  # noqa: E731
                                          axis=0).astype(F32)
            scales = [w_scale(i), w_scale(i), w_scale(h), None, None]
        else:
            scales = [np.full((128, 1), np.random.default_rng(0).normal() * 0.5, F32) for _ in range(5)]
        return {"hidden_tensor": hidden, "gate_proj_weights_tensor": gate_w, "up_proj_weights_tensor": up_w,
                "down_proj_weights_tensor": down_w, "normalization_weights_tensor": None,
                "gate_proj_bias_tensor": None, "up_proj_bias_tensor": None, "down_proj_bias_tensor": None,
                "normalization_bias_tensor": None, "fused_add_tensor": None, "store_fused_add_result": False,
                "activation_fn": types.ActFnType.SiLU, "normalization_type": types.NormType.NO_NORM,
                "quantization_type": getattr(types.QuantizationType, quant), "gate_w_scale": scales[0],
                "up_w_scale": scales[1], "down_w_scale": scales[2], "gate_up_in_scale": scales[3],
                "down_in_scale": scales[4], "output_dtype": nl.bfloat16,
                "store_output_in_sbuf": False, "eps": 1e-6, "skip_gate_proj": False}
    return make


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(BF16).astype(np.float32)


def mlp_cte_row_quant_golden(hidden_tensor: Any, gate_proj_weights_tensor: Any, up_proj_weights_tensor: Any,
                             down_proj_weights_tensor: Any, gate_w_scale: Any, up_w_scale: Any, down_w_scale: Any,
                             **_: Any) -> dict[str, np.ndarray]:
    """nki-library's CTE ROW golden for a quantized input (see the module doc); the reference gets the fp8
    hidden bytes as fp32 values, so the row scale is read back from the values' fp8 bytes."""
    values = _np(hidden_tensor)
    x = values[..., :-4].astype(np.float64)
    row_scale = np.ascontiguousarray(values[..., -4:].astype(FP8)).view(np.float32)  # [B, S, 1]

    def project(t: np.ndarray, w: Any, w_scale: Any, in_scale: np.ndarray) -> np.ndarray:
        return _bf16(_bf16(t @ _np(w)) * _np(w_scale)[0]) * in_scale

    gate = project(x, gate_proj_weights_tensor, gate_w_scale, row_scale)
    inter = _activation("SiLU", gate) * project(x, up_proj_weights_tensor, up_w_scale, row_scale)
    inter_scale = np.maximum(np.abs(inter).max(axis=-1, keepdims=True) / 240.0, 1e-5)
    inter_q = (inter / inter_scale).astype(FP8).astype(np.float32)
    return {"out": _bf16(project(inter_q, down_proj_weights_tensor, down_w_scale, inter_scale))}


def mlp_cte_static_quant_golden(hidden_tensor: Any, gate_proj_weights_tensor: Any, up_proj_weights_tensor: Any,
                                down_proj_weights_tensor: Any, gate_w_scale: Any, up_w_scale: Any,
                                down_w_scale: Any, gate_up_in_scale: Any, down_in_scale: Any,
                                **_: Any) -> dict[str, np.ndarray]:
    """nki-library's CTE STATIC golden for a quantized input (see the module doc)."""
    x = _np(hidden_tensor).astype(np.float64)
    in_scale, down_in = _np(gate_up_in_scale)[0, 0], _np(down_in_scale)[0, 0]

    def project(t: np.ndarray, w: Any, w_scale: Any, scale_in: float) -> np.ndarray:
        return _bf16(t @ _np(w)) * (_np(w_scale)[0, 0] * scale_in)

    inter = _activation("SiLU", project(x, gate_proj_weights_tensor, gate_w_scale, in_scale)) \
        * project(x, up_proj_weights_tensor, up_w_scale, in_scale)
    inter_q = np.clip(_bf16(inter) * (1.0 / down_in), -240.0, 240.0).astype(FP8).astype(np.float32)
    return {"out": _bf16(project(inter_q, down_proj_weights_tensor, down_w_scale, down_in))}


# lnc, batch, seqlen, hidden, intermediate, quant, norm, gate/up/down biases, gate/up column tiling, down column
# tiling, down weights in the optimized layout: the fp8 rows of test_mlp_tkg_unit's tables, in the test's order
_ROWS = [
    # nki_tkg_fused_norm_mlp_kernel_spmd_vnc2_params
    (2, 4, 7, 32768, 896, "ROW", "RMS_NORM", False, True, True, False),
    (2, 1, 1, 16384, 4986, "ROW", "NO_NORM", True, True, True, False),
]
for _q in ("ROW", "STATIC"):
    _ROWS += [  # nki_tkg_fused_norm_mlp_{row,static}_quant_kernel_params
        (2, 1, 1, 16384, 896, _q, "NO_NORM", False, True, True, False),
        (1, 1, 1, 16384, 896, _q, "NO_NORM", False, True, True, False),
        (1, 1, 5, 16384, 896, _q, "NO_NORM", False, True, True, False),
        (2, 1, 5, 16384, 896, _q, "NO_NORM", False, True, True, False),
        (2, 1, 7, 16384, 896, _q, "RMS_NORM", False, True, True, False),
        (2, 2, 7, 16384, 896, _q, "RMS_NORM", False, True, True, False),
        (1, 4, 7, 16384, 896, _q, "RMS_NORM", False, True, True, False),
        (2, 8, 7, 16384, 896, _q, "RMS_NORM", False, True, True, False),
        (2, 14, 5, 8192, 128, _q, "NO_NORM", False, True, True, False),
        (2, 16, 5, 8192, 128, _q, "NO_NORM", False, True, True, False),
        (2, 4, 5, 8192, 512, _q, "RMS_NORM", False, True, True, False),
        (2, 8, 5, 8192, 512, _q, "RMS_NORM", False, True, True, False),
        (2, 4, 7, 20480, 896, _q, "NO_NORM", False, True, True, False),
        (2, 2, 7, 20480, 896, _q, "RMS_NORM", False, True, True, False),
        (2, 4, 7, 20480, 896, _q, "RMS_NORM", False, True, True, False),
        # (the STATIC table's llama3-2T row has gate and up biases but no down bias)
        (2, 4, 7, 32768, 896, _q, "NO_NORM", "gate_up" if _q == "STATIC" else True, True, True, False),
        (2, 2, 7, 32768, 896, _q, "RMS_NORM", False, True, True, False),
    ] + ([(2, 4, 7, 32768, 896, _q, "RMS_NORM", False, True, True, False),
          (2, 4, 7, 8192, 5120, _q, "RMS_NORM", True, True, True, False)] if _q == "STATIC" else []) + [
        # nki_tkg_fused_norm_mlp_{row,static}_quant_kernel_layout_swap_perms (its repeated rows once)
        (2, 8, 5, 8192, 512, _q, "RMS_NORM" if _q == "ROW" else "NO_NORM", False, False, False, False),
        (2, 4, 5, 8192, 896, _q, "RMS_NORM", False, False, False, False),
        (2, 8, 5, 8192, 512, _q, "RMS_NORM", False, False, True, False),
        (2, 4, 5, 8192, 896, _q, "RMS_NORM", False, False, True, False),
        (2, 4, 5, 1024, 512, _q, "RMS_NORM", False, True, True, False),
        (2, 4, 5, 1024, 512, _q, "RMS_NORM", False, True, False, False),
        (2, 4, 5, 1024, 512, _q, "RMS_NORM", False, False, True, False),
        (2, 4, 5, 1024, 512, _q, "RMS_NORM", False, False, False, False),
        (1, 4, 1, 8192, 1024, _q, "RMS_NORM", False, False, False, True),
        (2, 4, 1, 8192, 1024, _q, "RMS_NORM", False, False, False, True),
        (2, 4, 1, 8192, 893, _q, "RMS_NORM", True, True, True, False),
        (2, 4, 1, 8192, 893, _q, "RMS_NORM", True, True, False, False),
        (2, 4, 1, 8192, 893, _q, "RMS_NORM", True, False, True, False),
        (2, 4, 1, 8192, 893, _q, "NO_NORM", True, False, False, False),
        (2, 4, 1, 8192, 1560, _q, "NO_NORM", True, False, False, False),
    ]


# MLP_CTE_UNIT_TEST_CASES_ROW_QUANT: lnc, batch, seqlen, hidden, intermediate (NO_NORM, SiLU, no biases)
_CTE_ROW = [(2, 1, 1024, 16384, 896), (2, 1, 512, 16384, 896), (2, 1, 256, 16384, 896), (2, 4, 1024, 16384, 896),
            (2, 2, 1024, 16384, 896)]


# MLP_CTE_UNIT_TEST_CASES_STATIC_QUANT: the same columns (I as the test aligns it: ceilalign(1600, 128) = 1664)
_CTE_STATIC = [(2, 1, 10240, 8192, 7168), (2, 1, 10240, 8192, 3584), (2, 1, 10240, 8192, 1792),
               (2, 1, 10240, 5120, 6400), (2, 1, 10240, 5120, 3200), (2, 1, 10240, 5120, 1664)]


def mlp_quant_cases() -> list[Case]:
    cases = [Case(
        kernel="core/mlp/mlp_cte", name=f"fp8 {quant.lower()} input x fp8 no_norm SiLU",
        shapes=f"B={b} S={s} H={h} I={i}", entry=f"{LIB}.mlp.mlp:mlp",
        reference=f"trnkit.conformance.cases_mlp_quant:mlp_cte_{quant.lower()}_quant_golden",
        inputs=_cte_quant_inputs(b, s, h, i, quant), outputs=("out",), lnc=lnc, rtol=rtol, atol=1e-5,
        note=f"{FP8_NOTE}; {MLP_REPAIR_NOTE}", test_file=f"{TESTS}/test_mlp_cte.py")
        for quant, rows, rtol in (("ROW", _CTE_ROW, 4e-2), ("STATIC", _CTE_STATIC, 3e-2))
        for lnc, b, s, h, i in rows]
    return cases + [tkg_quant_case(*row) for row in _ROWS]


def tkg_quant_case(lnc: int, b: int, s: int, h: int, i: int, quant: str, norm: str, biases: bool | str,
                   gate_col: bool, down_col: bool, swapped: bool) -> Case:
    """One fp8-weight row of ``test_mlp_tkg.py`` (ROW or STATIC scales; ``biases``: all three, none, or
    ``"gate_up"``)."""
    on = {False: (False,) * 3, True: (True,) * 3, "gate_up": (True, True, False)}[biases]
    flags = [norm.lower()] + [n for n, o in zip(("gate_b", "up_b", "down_b"), on) if o] \
        + ["gate_up_column_tiling"] * gate_col + ["down_column_tiling"] * down_col \
        + ["down_w optimized layout"] * swapped
    return Case(
        kernel="core/mlp/mlp_tkg", name=f"bf16 x fp8 {quant.lower()} " + " ".join(flags),
        shapes=f"B={b} S={s} H={h} I={i}", entry=f"{LIB}.mlp.mlp:mlp",
        reference="trnkit.conformance.cases_mlp_quant:mlp_quant_golden",
        inputs=_quant_inputs(lnc, b, s, h, i, quant, norm, on, (gate_col, down_col), swapped),
        ref_inputs=lambda kw, lnc=lnc: {**kw, "swapped_down_lnc": lnc},
        outputs=("out",), lnc=lnc, rtol=2e-2, atol=1e-5, note=f"{FP8_NOTE}; {MLP_REPAIR_NOTE}",
        test_file=f"{TESTS}/test_mlp_tkg.py")
