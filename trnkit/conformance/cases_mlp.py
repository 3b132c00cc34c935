"""Conformance cases of nki-library's core/mlp kernel (CTE and TKG modes), written from its test files.

``test/integration/nkilib/core/mlp/test_mlp_cte.py`` (``test_mlp_cte_unit``: every row of its unquantized
tables ``MLP_CTE_UNIT_TEST_CASES_GATE_BIAS_FALSE`` / ``_TRUE``) runs ``mlp`` at rtol 2e-2 / atol 1e-5 with
``CompilerArgs(logical_nc_config=<row>)``. Inputs as ``test_mlp_common.build_fused_norm_mlp`` draws
them: one ``gaussian_tensor_generator()`` (``default_rng(0)``, std 1) for the fused-add tensor, the
hidden states, the norm bias, the gate / up / down weights (the test passes ``quant_dtype=float8_e4m3``
even for unquantized rows, so the weights are fp8), the biases and the (unused) weight scales, in that
order; gamma from ``default_rng(42)`` uniform(-0.1, 0.1). The golden (``golden_mlp`` / ``norm_mlp_ref``
lives in nki-library's test package) is :func:`mlp_golden`, the same computation written from the test.

``test_mlp_tkg.py`` (``test_mlp_tkg_unit``) runs the same ``mlp`` entry point at token-generation shapes
with the same inputs and golden; its unquantized rows pass no ``quant_dtype``, so the weights are bf16
and no scales are drawn.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["mlp_cases", "mlp_golden", "swap_down_layout", "tkg_case"]

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3)
F32 = np.dtype(np.float32)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core/mlp"
SHORT_SEQLEN, TKG_THRESHOLD = 256, 96  # the test's thresholds (mlp.py's constants)
MLP_REPAIR_NOTE = ("mlp.py repaired: at d2ad3a5 it repeats its docstring's last 11 lines after the closing quotes "
                   "and does not parse; the run drops the repeat (harness.REPAIRED_MODULES)")


def _types() -> Any:
    return importlib.import_module(f"{LIB}.utils.common_types")


def _mlp_inputs(b: int, s: int, h: int, i: int, norm: str, fused: bool, store: bool, skip_gate: bool,
                act: str, gate_b: bool, up_b: bool, down_b: bool, norm_b: bool, weight_dtype: np.dtype = FP8,
                column_tiling: tuple[bool, bool] = (True, True), swapped_down_lnc: int = 0) -> Callable[[], dict]:
    """``build_fused_norm_mlp``'s draws; ``weight_dtype``: the test's ``quant_dtype`` (fp8 in the CTE
    test, which then also draws the weight scales) or, without one, the activation dtype (bf16, no
    scales). ``swapped_down_lnc``: the rows with ``use_tkg_down_proj_optimized_layout``, whose test
    builds its generator as ``gaussian_tensor_generator(0, 241, modifier_fn=..., lnc=...)`` (mean 0,
    std 241) and hands the kernel the down weights in its unit-stride layout (:func:`swap_down_layout`)."""
    def make() -> dict[str, Any]:
        import nki.language as nl  # the interpreter, inside nki_is_interpreter

        types = _types()
        gen = np.random.default_rng(0)
        std = 241.0 if swapped_down_lnc else 1.0
        draw = lambda shape, dt: (gen.normal(size=shape) * std).astype(dt)  # noqa: E731
        np.random.seed(42)
        rng = np.random.default_rng(42)
        fused_t = draw((b, s, h), BF16) if fused else None
        hidden = draw((b, s, h), BF16)
        gamma = beta = None
        if norm not in ("NO_NORM", "RMS_NORM_SKIP_GAMMA"):
            gamma = rng.uniform(low=-0.1, high=0.1, size=(1, h)).astype(BF16)
            if norm_b:
                beta = draw((1, h), BF16)
        gate_w, up_w, down_w = (draw(shape, weight_dtype) for shape in ((h, i), (h, i), (i, h)))
        if swapped_down_lnc:
            down_w = swap_down_layout(down_w, swapped_down_lnc)
        biases = [draw(shape, BF16) if on else None for shape, on in (((1, i), gate_b), ((1, i), up_b),
                                                                     ((1, h), down_b))]
        scales = [draw(shape, F32) if weight_dtype == FP8 else None for shape in ((128, i), (128, i), (128, h))]
        return {"hidden_tensor": hidden, "gate_proj_weights_tensor": gate_w, "up_proj_weights_tensor": up_w,
                "down_proj_weights_tensor": down_w, "normalization_weights_tensor": gamma,
                "gate_proj_bias_tensor": biases[0], "up_proj_bias_tensor": biases[1],
                "down_proj_bias_tensor": biases[2], "normalization_bias_tensor": beta,
                "fused_add_tensor": fused_t, "store_fused_add_result": store,
                "activation_fn": getattr(types.ActFnType, act), "normalization_type": getattr(types.NormType, norm),
                "quantization_type": types.QuantizationType.NONE, "gate_w_scale": scales[0],
                "up_w_scale": scales[1], "down_w_scale": scales[2], "gate_up_in_scale": None,
                "down_in_scale": None, "output_dtype": nl.bfloat16, "store_output_in_sbuf": False, "eps": 1e-6,
                "skip_gate_proj": skip_gate, "use_tkg_gate_up_proj_column_tiling": column_tiling[0],
                "use_tkg_down_proj_column_tiling": column_tiling[1],
                "use_tkg_down_proj_optimized_layout": bool(swapped_down_lnc),
                "gate_clamp_upper_limit": None, "gate_clamp_lower_limit": None, "up_clamp_upper_limit": None,
                "up_clamp_lower_limit": None}
    return make


def swap_down_layout(down: np.ndarray, lnc: int, inverse: bool = False) -> np.ndarray:
    """The down-projection weight ``[I, H]`` in mlp_tkg's optimized (unit-stride) layout: per core
    ``c``, the core's ``H / lnc`` columns as ``[128, H / 128 / lnc]`` transposed (the test's
    ``modify_down_proj_lhs_rhs_swap_unit_stride_layout``); ``inverse`` puts it back (its golden)."""
    i, h = down.shape
    inner = (h // 128 // lnc, 128) if inverse else (128, h // 128 // lnc)
    return down.reshape((i, lnc, *inner)).transpose((0, 1, 3, 2)).reshape((i, h))


def _np(t: Any) -> np.ndarray | None:
    return None if t is None else np.asarray(t.float().numpy() if hasattr(t, "float") else t, np.float32)


def _activation(name: str, x: np.ndarray) -> np.ndarray:
    from scipy.special import erf, expit

    return {"SiLU": lambda: x * expit(x), "GELU": lambda: 0.5 * x * (1 + erf(x / np.sqrt(2))),
            "GELU_Tanh_Approx": lambda: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
            "Swish": lambda: x / (1 + np.exp(-1.702 * x))}[name]()


def _normalize(name: str, x: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None,
               eps: float) -> np.ndarray:
    """The test's norms: RMS norm in fp32 (1 / rms rounded to fp32), layer norm with fp32 statistics."""
    if name == "NO_NORM":
        return x
    x32 = x.astype(np.float32)
    if name in ("RMS_NORM", "RMS_NORM_SKIP_GAMMA"):
        rms = np.sqrt(np.mean(np.square(x32), axis=-1, keepdims=True) + eps).astype(np.float32)
        out = x32 * np.reciprocal(rms)
        return out * gamma if gamma is not None else out
    mean, var = x32.mean(axis=-1, keepdims=True), x32.var(axis=-1, keepdims=True)
    out = ((x - mean) * np.reciprocal(np.sqrt(var + eps))).astype(x.dtype)
    out = out * gamma if gamma is not None else out
    return out + beta if beta is not None else out


def mlp_golden(hidden_tensor: Any, gate_proj_weights_tensor: Any, up_proj_weights_tensor: Any,
               down_proj_weights_tensor: Any, normalization_weights_tensor: Any = None,
               gate_proj_bias_tensor: Any = None, up_proj_bias_tensor: Any = None,
               down_proj_bias_tensor: Any = None, normalization_bias_tensor: Any = None,
               fused_add_tensor: Any = None, store_fused_add_result: bool = False, activation_fn: Any = None,
               normalization_type: Any = None, skip_gate_proj: bool = False, eps: float = 1e-6,
               swapped_down_lnc: int = 0, **_: Any) -> dict[str, np.ndarray]:
    """The unquantized MLP golden of nki-library's MLP tests: (fused add) -> norm -> act(x @ gate + b)
    * (x @ up + b) (act(x @ up + b) with the gate skipped) -> @ down + b, in float64/fp32 numpy; outputs
    rounded to bf16 (``out`` and, with a stored fused add, ``add_out``). ``swapped_down_lnc``: the down
    weights come in the optimized layout and are put back first, as the test's golden does."""
    hidden_sum = np.zeros(tuple(hidden_tensor.shape))
    for t in ([fused_add_tensor] if fused_add_tensor is not None else []) + [hidden_tensor]:
        hidden_sum += _np(t)
    x = _normalize(normalization_type.name, hidden_sum, _np(normalization_weights_tensor),
                   _np(normalization_bias_tensor), eps)
    up = x @ _np(up_proj_weights_tensor)
    if up_proj_bias_tensor is not None:
        up = up + _np(up_proj_bias_tensor)
    if skip_gate_proj:
        mult = _activation(activation_fn.name, up)
    else:
        gate = x @ _np(gate_proj_weights_tensor)
        if gate_proj_bias_tensor is not None:
            gate = gate + _np(gate_proj_bias_tensor)
        mult = _activation(activation_fn.name, gate) * up
    down = _np(down_proj_weights_tensor)
    out = mult @ (swap_down_layout(down, swapped_down_lnc, inverse=True) if swapped_down_lnc else down)
    if down_proj_bias_tensor is not None:
        out = out + _np(down_proj_bias_tensor)
    result = {"out": out.astype(BF16).astype(np.float32)}
    if fused_add_tensor is not None and store_fused_add_result:
        result["add_out"] = hidden_sum.astype(BF16).astype(np.float32)
    return result


# lnc, batch, seqlen, hidden, intermediate, norm, fused_add, store_add, skip_gate, act, gate_b, up_b, down_b, norm_b:
# every row of both unquantized tables, in their order (rows that differ only in the tables' cycle-count column
# run once: _cte_cases() drops the repeats)
_CTE = [
    # MLP_CTE_UNIT_TEST_CASES_GATE_BIAS_FALSE
    (2, 1, 128, 8192, 896, "LAYER_NORM", False, False, False, "SiLU", False, False, False, False),
    (1, 1, 512, 1024, 448, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 512, 1024, 448, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 1024, 448, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 1024, 448, "NO_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 1024, 448, "RMS_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 1024, 448, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (1, 1, 768, 1024, 896, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 768, 1024, 896, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (1, 1, 8192, 8192, 448, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 8192, 8192, 448, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 16384, 832, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 16384, 832, "RMS_NORM", False, False, False, "SiLU", False, False, False, False),
    (1, 1, 1024, 16384, 416, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (1, 1, 1024, 16384, 416, "RMS_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 8192, 448, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (1, 1, 8192, 8192, 448, "RMS_NORM", True, True, False, "SiLU", False, False, False, False),
    (1, 1, 8192, 8192, 448, "NO_NORM", True, True, False, "SiLU", False, False, False, False),
    (1, 1, 1024, 16384, 416, "NO_NORM", True, True, False, "SiLU", False, False, False, False),
    (1, 1, 1024, 16384, 416, "RMS_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 1, 8192, 8192, 448, "RMS_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 1, 8192, 8192, 448, "NO_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 16384, 416, "NO_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 1, 1024, 16384, 416, "RMS_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 2, 8192, 8192, 448, "RMS_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 4, 8192, 8192, 448, "NO_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 2, 1024, 16384, 416, "NO_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 4, 1024, 16384, 416, "RMS_NORM", True, True, False, "SiLU", False, False, False, False),
    (1, 1, 128, 8192, 896, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 128, 8192, 896, "RMS_NORM", True, True, False, "SiLU", False, False, False, False),
    (1, 1, 128, 8192, 896, "NO_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 128, 8192, 896, "NO_NORM", True, True, False, "SiLU", False, False, False, False),
    (1, 1, 512, 1024, 448, "RMS_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 512, 1024, 448, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (1, 1, 128, 8192, 896, "RMS_NORM", False, False, False, "SiLU", False, False, False, False),
    (1, 1, 128, 8192, 896, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 2048, 8448, 1408, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 2048, 8448, 1408, "LAYER_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 4096, 8192, 448, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 4096, 8192, 448, "RMS_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 4096, 8192, 448, "LAYER_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 128, 7168, 364, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 128, 7168, 364, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 256, 7168, 364, "RMS_NORM", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 256, 7168, 364, "RMS_NORM_SKIP_GAMMA", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 256, 7168, 1536, "RMS_NORM", True, True, False, "SiLU", False, False, False, False),
    (2, 1, 256, 7168, 1536, "RMS_NORM_SKIP_GAMMA", True, False, False, "SiLU", False, False, False, False),
    (2, 1, 256, 7168, 1536, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (1, 1, 578, 1408, 352, "NO_NORM", False, False, True, "SiLU", False, False, False, False),
    (1, 1, 578, 1408, 352, "NO_NORM", False, False, True, "GELU", False, False, False, False),
    (2, 1, 578, 1408, 352, "NO_NORM", False, False, True, "SiLU", False, False, False, False),
    (2, 1, 578, 1408, 352, "NO_NORM", False, False, True, "GELU", False, False, False, False),
    (1, 1, 578, 1408, 352, "NO_NORM", False, False, True, "SiLU", False, True, True, False),
    (1, 1, 578, 1408, 352, "NO_NORM", False, False, True, "GELU", False, True, True, False),
    (2, 1, 578, 1408, 352, "NO_NORM", False, False, True, "SiLU", False, True, True, False),
    (2, 1, 578, 1408, 352, "NO_NORM", False, False, True, "GELU", False, True, True, False),
    (1, 1, 578, 1408, 352, "NO_NORM", False, False, False, "SiLU", False, True, True, False),
    (2, 1, 578, 1408, 352, "NO_NORM", False, False, False, "SiLU", False, True, True, False),
    (1, 1, 578, 1408, 352, "NO_NORM", False, False, False, "GELU", False, False, False, False),
    (2, 1, 578, 1408, 352, "NO_NORM", False, False, False, "GELU", False, False, False, False),
    (1, 1, 578, 1408, 352, "RMS_NORM", True, False, True, "SiLU", False, True, True, False),
    (2, 1, 578, 1408, 352, "RMS_NORM", True, False, True, "SiLU", False, True, True, False),
    (1, 1, 578, 1408, 352, "RMS_NORM", True, False, False, "GELU", False, True, True, False),
    (2, 1, 578, 1408, 352, "RMS_NORM", True, False, False, "GELU", False, True, True, False),
    (1, 1, 578, 1408, 352, "RMS_NORM", False, False, True, "GELU_Tanh_Approx", False, True, True, False),
    (2, 1, 578, 1408, 352, "RMS_NORM", False, False, True, "GELU_Tanh_Approx", False, True, True, False),
    (1, 1, 578, 1408, 352, "RMS_NORM", False, False, True, "GELU", False, True, False, False),
    (2, 1, 578, 1408, 352, "RMS_NORM", True, False, True, "GELU", False, True, False, False),
    (1, 1, 578, 1408, 352, "RMS_NORM", True, False, True, "GELU", False, False, True, False),
    (2, 1, 578, 1408, 352, "RMS_NORM", False, False, True, "GELU", False, False, True, False),
    (1, 14, 578, 1408, 352, "NO_NORM", False, False, True, "GELU", False, True, False, False),
    (2, 14, 578, 1408, 352, "NO_NORM", False, False, True, "GELU", False, True, False, False),
    (1, 1, 578, 1408, 352, "LAYER_NORM", False, False, True, "GELU", False, True, True, True),
    (1, 1, 578, 1408, 352, "LAYER_NORM", True, True, True, "GELU", False, True, True, True),
    (2, 1, 578, 1408, 352, "LAYER_NORM", False, False, True, "GELU", False, True, True, True),
    (2, 1, 578, 1408, 352, "LAYER_NORM", True, True, True, "GELU", False, True, True, True),
    (2, 1, 36864, 8192, 512, "NO_NORM", False, False, False, "GELU", False, False, False, False),
    (2, 1, 512, 8192, 3584, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    # MLP_CTE_UNIT_TEST_CASES_GATE_BIAS_TRUE (its first two rows have no gate bias)
    (2, 1, 10240, 3072, 112, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 10240, 3072, 2160, "NO_NORM", False, False, False, "SiLU", False, False, False, False),
    (2, 1, 128, 8192, 896, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (1, 1, 512, 1024, 448, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 512, 1024, 448, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 1024, 448, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 1024, 448, "NO_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 1024, 448, "RMS_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 1024, 448, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (1, 1, 768, 1024, 896, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 768, 1024, 896, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (1, 1, 8192, 8192, 448, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 8192, 8192, 448, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 16384, 832, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 16384, 832, "RMS_NORM", False, False, False, "SiLU", True, False, False, False),
    (1, 1, 1024, 16384, 416, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (1, 1, 1024, 16384, 416, "RMS_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 8192, 448, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (1, 1, 8192, 8192, 448, "RMS_NORM", True, True, False, "SiLU", True, False, False, False),
    (1, 1, 8192, 8192, 448, "NO_NORM", True, True, False, "SiLU", True, False, False, False),
    (1, 1, 1024, 16384, 416, "NO_NORM", True, True, False, "SiLU", True, False, False, False),
    (1, 1, 1024, 16384, 416, "RMS_NORM", True, True, False, "SiLU", True, False, False, False),
    (2, 1, 8192, 8192, 448, "RMS_NORM", True, True, False, "SiLU", True, False, False, False),
    (2, 1, 8192, 8192, 448, "NO_NORM", True, True, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 16384, 416, "NO_NORM", True, True, False, "SiLU", True, False, False, False),
    (2, 1, 1024, 16384, 416, "RMS_NORM", True, True, False, "SiLU", True, False, False, False),
    (2, 2, 8192, 8192, 448, "RMS_NORM", True, True, False, "SiLU", True, False, False, False),
    (2, 4, 8192, 8192, 448, "NO_NORM", True, True, False, "SiLU", True, False, False, False),
    (2, 2, 1024, 16384, 416, "NO_NORM", True, True, False, "SiLU", True, False, False, False),
    (2, 4, 1024, 16384, 416, "RMS_NORM", True, True, False, "SiLU", True, False, False, False),
    (1, 1, 128, 8192, 896, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 128, 8192, 896, "RMS_NORM", True, True, False, "SiLU", True, False, False, False),
    (1, 1, 128, 8192, 896, "NO_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 128, 8192, 896, "NO_NORM", True, True, False, "SiLU", True, False, False, False),
    (1, 1, 512, 1024, 448, "RMS_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 512, 1024, 448, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (1, 1, 128, 8192, 896, "RMS_NORM", False, False, False, "SiLU", True, False, False, False),
    (1, 1, 128, 8192, 896, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 2048, 8448, 1408, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 2048, 8448, 1408, "LAYER_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 4096, 8192, 448, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 4096, 8192, 448, "RMS_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 4096, 8192, 448, "LAYER_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 128, 7168, 364, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 128, 7168, 364, "NO_NORM", False, False, False, "SiLU", True, False, False, False),
    (2, 1, 256, 7168, 364, "RMS_NORM", True, False, False, "SiLU", True, False, False, False),
    (2, 1, 256, 7168, 364, "RMS_NORM_SKIP_GAMMA", True, False, False, "SiLU", True, False, False, False),
    (1, 1, 578, 1408, 352, "NO_NORM", False, False, False, "SiLU", True, True, True, False),
    (2, 1, 578, 1408, 352, "NO_NORM", False, False, False, "SiLU", True, True, True, False),
    (1, 1, 578, 1408, 352, "NO_NORM", False, False, False, "GELU", True, False, False, False),
    (2, 1, 578, 1408, 352, "NO_NORM", False, False, False, "GELU", True, False, False, False),
    (1, 1, 578, 1408, 352, "RMS_NORM", True, False, False, "GELU", True, True, True, False),
    (2, 1, 578, 1408, 352, "RMS_NORM", True, False, False, "GELU", True, True, True, False),
]


def _cte_cases() -> list[Case]:
    cases = []
    for lnc, b, s, h, i, norm, fused, store, skip, act, gb, ub, db, nb in dict.fromkeys(_CTE):
        shard_on_i = b * s <= SHORT_SEQLEN and i % 256 == 0 and not (gb or ub or nb) and lnc > 1
        negative = lnc > 1 and b * s > TKG_THRESHOLD and not shard_on_i and (b * s) % lnc != 0
        flags = [norm.lower(), act] + ["fused_add"] * fused + ["store_add"] * (fused and store) \
            + ["skip_gate"] * skip + [n for n, on in (("gate_b", gb), ("up_b", ub), ("down_b", db),
                                                        ("norm_b", nb)) if on]
        cases.append(Case(
            kernel="core/mlp/mlp_cte", name="bf16 x fp8 " + " ".join(flags) + " (must reject)" * negative,
            shapes=f"B={b} S={s} H={h} I={i}", entry=f"{LIB}.mlp.mlp:mlp",
            reference="trnkit.conformance.cases_mlp:mlp_golden",
            inputs=_mlp_inputs(b, s, h, i, norm, fused, store, skip, act, gb, ub, db, nb),
            outputs=("out", "add_out") if fused and store else ("out",), lnc=lnc, rtol=2e-2, atol=1e-5,
            negative=negative, note=MLP_REPAIR_NOTE, test_file=f"{TESTS}/test_mlp_cte.py"))
    return cases


# test_mlp_tkg.py (test_mlp_tkg_unit), the unquantized rows without use_tkg_down_proj_optimized_layout (whose
# generator permutes the down weights): lnc, batch, seqlen, hidden, intermediate, norm, fused_add, store_add,
# skip_gate, gate_b, up_b, down_b, gate/up column tiling, down column tiling (activation SiLU throughout)
_TKG = [
    # nki_tkg_fused_norm_mlp_kernel_spmd_vnc2_params
    (2, 2, 4, 8448, 1408, "LAYER_NORM", False, False, False, False, False, False, True, True),
    (2, 4, 2, 4096, 1024, "LAYER_NORM", False, False, False, False, False, False, True, True),
    (2, 1, 1, 8448, 1408, "NO_NORM", False, False, False, False, False, False, True, True),
    (2, 1, 1, 8192, 448, "RMS_NORM", False, False, False, False, False, False, True, True),
    (2, 4, 5, 8192, 896, "RMS_NORM", True, True, False, False, False, False, True, True),
    (2, 1, 5, 16384, 832, "NO_NORM", False, False, False, False, False, False, True, True),
    (2, 4, 7, 16384, 832, "RMS_NORM", False, False, False, False, False, False, True, True),
    (2, 64, 1, 3072, 135, "RMS_NORM", False, False, False, False, False, False, True, True),
    (2, 4, 1, 3072, 2160, "RMS_NORM", False, False, False, False, False, False, True, True),
    (2, 8, 5, 8192, 896, "RMS_NORM", False, False, False, False, False, False, True, True),
    (2, 8, 5, 16384, 896, "RMS_NORM", True, True, False, False, False, False, True, True),
    (2, 1, 1, 2048, 512, "RMS_NORM", False, False, False, False, False, False, True, True),
    (2, 1, 1, 4096, 896, "RMS_NORM", False, False, False, False, False, False, True, True),
    (2, 1, 1, 7168, 364, "NO_NORM", False, False, False, False, False, False, True, True),
    (2, 1, 5, 32768, 896, "NO_NORM", False, False, False, False, False, False, True, True),
    (2, 1, 5, 32768, 896, "RMS_NORM", True, True, False, False, False, False, True, True),
    (2, 1, 5, 20480, 832, "NO_NORM", False, False, False, False, False, False, True, True),
    (2, 2, 7, 20480, 832, "RMS_NORM", True, True, False, False, False, False, True, True),
    (2, 4, 1, 5120, 128, "NO_NORM", False, False, False, False, False, False, True, True),
    (2, 8, 7, 16384, 896, "RMS_NORM", False, False, False, True, True, True, True, True),
    (2, 8, 5, 8192, 512, "RMS_NORM", False, False, False, True, True, True, True, True),
    (2, 4, 1, 8192, 5120, "NO_NORM", False, False, False, True, True, True, True, True),
    (2, 4, 1, 8192, 512, "RMS_NORM", True, False, False, False, False, False, True, True),
    (2, 4, 8, 8192, 512, "RMS_NORM", True, False, False, False, False, False, True, True),
    (2, 4, 1, 8192, 512, "LAYER_NORM", True, False, False, False, False, False, True, True),
    (2, 4, 8, 8192, 512, "LAYER_NORM", True, False, False, False, False, False, True, True),
    (2, 1, 1, 5376, 336, "RMS_NORM", False, False, False, False, False, False, True, True),
    # nki_tkg_fused_norm_mlp_kernel_spmd_vnc1_params
    (1, 1, 1, 8192, 448, "RMS_NORM", True, True, False, False, False, False, True, True),
    (1, 1, 1, 7168, 896, "RMS_NORM", True, True, False, False, False, False, True, True),
    (1, 1, 1, 16384, 416, "NO_NORM", False, False, False, False, False, False, True, True),
    (1, 1, 1, 16384, 832, "NO_NORM", False, False, False, False, False, False, True, True),
    (1, 3, 8, 8192, 832, "LAYER_NORM", False, False, False, False, False, False, True, True),
    (1, 4, 2, 16384, 832, "RMS_NORM", False, False, False, False, False, False, True, True),
    (1, 4, 2, 16384, 832, "RMS_NORM", False, False, False, True, True, True, True, True),
    (1, 32, 2, 8192, 512, "RMS_NORM", False, False, False, True, True, True, True, True),
    (1, 1, 1, 256, 448, "NO_NORM", False, False, False, False, False, False, True, True),
    # nki_tkg_fused_norm_mlp_kernel_spmd_vnc2_swap_perms (the column-tiling variants)
    (2, 1, 1, 4096, 128, "NO_NORM", False, False, False, False, False, False, False, True),
    (2, 4, 1, 5120, 256, "NO_NORM", False, False, False, False, False, False, False, False),
    (2, 8, 1, 5120, 128, "NO_NORM", False, False, False, False, False, False, False, False),
    (2, 16, 1, 5120, 128, "NO_NORM", False, False, False, False, False, False, False, False),
    (2, 32, 1, 5120, 128, "NO_NORM", False, False, False, False, False, False, False, False),
    (2, 4, 1, 8192, 512, "NO_NORM", False, False, False, False, False, False, False, False),
    (2, 4, 5, 8192, 1024, "NO_NORM", False, False, False, False, False, False, False, False),
    (2, 4, 5, 8192, 1560, "NO_NORM", False, False, False, True, True, True, False, False),
    (2, 4, 1, 16384, 832, "NO_NORM", False, False, False, False, False, False, True, True),
    (2, 4, 1, 16384, 832, "NO_NORM", False, False, False, False, False, False, True, False),
    (2, 4, 1, 16384, 832, "NO_NORM", False, False, False, False, False, False, False, True),
    (2, 4, 1, 16384, 832, "NO_NORM", False, False, False, False, False, False, False, False),
    # nki_tkg_fused_norm_mlp_kernel_spmd_skip_gate
    (2, 4, 1, 16384, 832, "NO_NORM", False, False, True, False, False, False, True, True),
    (2, 4, 1, 16384, 832, "NO_NORM", False, False, True, False, False, False, True, False),
    (2, 4, 1, 16384, 832, "NO_NORM", False, False, True, False, False, False, False, True),
    (2, 4, 1, 16384, 832, "NO_NORM", False, False, True, False, False, False, False, False),
]


# nki_tkg_fused_norm_mlp_kernel_spmd_vnc2_swap_perms's two "Llama 3 TP32 all projections swapped, down_w layout
# optimized for unit stride loading" rows (use_tkg_down_proj_optimized_layout): lnc, batch, seqlen, hidden,
# intermediate, norm (no fused add, no biases, no column tiling)
_TKG_SWAPPED = [(1, 4, 1, 8192, 1024, "RMS_NORM"), (2, 4, 1, 8192, 1024, "RMS_NORM")]


def _tkg_negative(lnc: int, b: int, s: int, h: int, down_col: bool) -> bool:
    """The test's expected rejections: more than 128 tokens, H / 128 not split evenly over the cores,
    or (without down-projection column tiling) more than 8 PSUM banks for the down projection."""
    t, h1_shard = b * s, h // 128 // lnc
    return t > 128 or (h // 128) % lnc != 0 or (h // lnc) % 128 != 0 \
        or (not down_col and -(-h1_shard // (512 // t)) > 8)


def tkg_case(lnc: int, b: int, s: int, h: int, i: int, norm: str, fused: bool, store: bool, skip: bool, gb: bool,
             ub: bool, db: bool, gate_col: bool, down_col: bool, negative: bool | None = None) -> Case:
    """One unquantized row of ``test_mlp_tkg.py`` (SiLU, bf16 weights); ``negative``: the test's verdict
    (default :func:`_tkg_negative`; its model-config rows are never negative)."""
    if negative is None:
        negative = _tkg_negative(lnc, b, s, h, down_col)
    flags = [norm.lower()] + ["fused_add"] * fused + ["store_add"] * (fused and store) + ["skip_gate"] * skip \
        + [n for n, on in (("gate_b", gb), ("up_b", ub), ("down_b", db)) if on] \
        + ["gate_up_column_tiling"] * gate_col + ["down_column_tiling"] * down_col
    return Case(
        kernel="core/mlp/mlp_tkg", name="bf16 " + " ".join(flags) + " (must reject)" * negative,
        shapes=f"B={b} S={s} H={h} I={i}", entry=f"{LIB}.mlp.mlp:mlp",
        reference="trnkit.conformance.cases_mlp:mlp_golden",
        inputs=_mlp_inputs(b, s, h, i, norm, fused, store, skip, "SiLU", gb, ub, db, False, BF16,
                           (gate_col, down_col)),
        outputs=("out", "add_out") if fused and store else ("out",), lnc=lnc, rtol=2e-2, atol=1e-5,
        negative=negative, note=MLP_REPAIR_NOTE, test_file=f"{TESTS}/test_mlp_tkg.py")


def _tkg_cases() -> list[Case]:
    cases = [tkg_case(*row) for row in _TKG]
    for lnc, b, s, h, i, norm in _TKG_SWAPPED:
        cases.append(Case(
            kernel="core/mlp/mlp_tkg", name=f"bf16 {norm.lower()} down_w optimized layout std=241",
            shapes=f"B={b} S={s} H={h} I={i}", entry=f"{LIB}.mlp.mlp:mlp",
            reference="trnkit.conformance.cases_mlp:mlp_golden",
            inputs=_mlp_inputs(b, s, h, i, norm, False, False, False, "SiLU", False, False, False, False, BF16,
                               (False, False), swapped_down_lnc=lnc),
            ref_inputs=lambda kw, lnc=lnc: {**kw, "swapped_down_lnc": lnc},
            outputs=("out",), lnc=lnc, rtol=2e-2, atol=1e-5, note=MLP_REPAIR_NOTE,
            test_file=f"{TESTS}/test_mlp_tkg.py"))
    return cases


def mlp_cases() -> list[Case]:
    return _cte_cases() + _tkg_cases()
