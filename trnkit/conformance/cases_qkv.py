"""Conformance cases of nki-library's core/qkv kernel (CTE and TKG), written from its test files.

``test/integration/nkilib/core/qkv/test_qkv_cte.py``: ``qkv`` at rtol 2e-2 / atol 1e-5 with
``CompilerArgs(logical_nc_config=vnc)``, bf16 (every unquantized test passes ``dtype=nl.bfloat16``),
rows of its fused-RoPE, accuracy, BSD / NBSd performance and no-DMA-transpose tables. Inputs as
``test_qkv_common.build_qkv_input`` draws them from one normal generator: input, fused weights, the
two residuals (fused add), gamma (RMS / layer norm), the QKV bias, the layer-norm bias, the RoPE cos / sin caches
(half the head dim drawn, tiled twice). The RoPE rows use the test's own fresh generator
(``rope_gaussian_tensor_generator()``, seed 0); the other tests share one ``gaussian_tensor_generator()``
created when the test module is imported, so their draws depend on which tests ran before: each case
here starts a fresh ``default_rng(0)`` (the draws of that test when it runs first). The golden,
``golden_func_fused_add_qkv`` in the test module, is :func:`qkv_golden`, written from the test: fp32
residual add, RMS norm (over ``hidden_actual`` when given) or layer norm, ``x @ W`` plus the bias, rotate-half RoPE
on the q and k heads, the NBSd layout, rounded to bf16.

``test_qkv_tkg.py`` (``test_qkv_tkg_accuracy_unit`` and ``test_qkv_tkg_performance_bsd_unit``, their
unquantized rows): the same ``qkv`` entry point at token-generation shapes (it dispatches to
``qkv_tkg``), inputs from the same ``build_qkv_input`` and the CTE test's golden, bf16, rtol 2e-2 /
atol 1e-5. The performance rows give one KV head and ``fused_dim / d_head - 2`` q heads, as the test does.
With a fused residual add the kernel also returns the sum; the test's golden has ``out`` only, so only
``out`` is compared.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case, first_output

__all__ = ["cte_case", "qkv_cases", "qkv_golden", "qkv_projection"]

BF16 = np.dtype(ml_dtypes.bfloat16)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core/qkv"


def _qkv_inputs(b: int, s: int, h: int, fused_dim: int, norm: str, dma_t: bool, fused_add: bool, norm_bias: bool,
                layout: str, eps: float, hidden_actual: int | None, heads: tuple[int, int, int] | None,
                rope: bool, qkv_bias: bool = False, weight_dtype: np.dtype | None = None, dtype: np.dtype = BF16
                ) -> Callable[[], dict[str, Any]]:
    """``build_qkv_input``'s draws (see the module doc) in ``dtype``; ``weight_dtype``: fp8 for its quantized
    rows (default ``dtype``)."""
    def make() -> dict[str, Any]:
        types = importlib.import_module(f"{LIB}.utils.common_types")
        qkv_types = importlib.import_module(f"{LIB}.qkv.qkv")
        rng = np.random.default_rng(0)
        draw = lambda shape: rng.normal(size=shape).astype(dtype)  # noqa: E731
        x = draw((b, s, h))
        w = rng.normal(size=(h, fused_dim)).astype(weight_dtype or dtype)
        mlp_prev = draw((b, s, h)) if fused_add else None
        attn_prev = draw((b, s, h)) if fused_add else None
        gamma = draw((1, h)) if norm in ("RMS_NORM", "LAYER_NORM") else None
        bias = draw((1, fused_dim)) if qkv_bias else None
        ln_bias = draw((1, h)) if norm_bias else None
        cos = sin = None
        if rope:
            d = heads[2]
            cos, sin = (np.tile(draw((b, s, d // 2)), 2) for _ in range(2))
        q, kv, d = heads if heads else (None, None, None)
        return {"input": x, "fused_qkv_weights": w, "output_layout": getattr(qkv_types.QKVOutputLayout, layout),
                "bias": bias, "quantization_type": types.QuantizationType.NONE, "qkv_w_scale": None,
                "qkv_in_scale": None, "fused_residual_add": fused_add, "mlp_prev": mlp_prev,
                "attention_prev": attn_prev, "fused_norm_type": getattr(types.NormType, norm),
                "gamma_norm_weights": gamma, "layer_norm_bias": ln_bias, "norm_eps": eps,
                "hidden_actual": hidden_actual, "fused_rope": rope, "cos_cache": cos, "sin_cache": sin,
                "d_head": d, "num_q_heads": q, "num_kv_heads": kv, "store_output_in_sbuf": False, "sbm": None,
                "use_auto_allocation": False, "load_input_with_DMA_transpose": dma_t,
                "weight_layout": qkv_types.QKVWeightLayout.CONTIGUOUS, "is_h_dim_4h_transposed": False}
    return make


def _f32(t: Any) -> np.ndarray | None:
    return None if t is None else np.asarray(t.float().numpy() if hasattr(t, "float") else t, np.float32)


def qkv_golden(output_layout: Any = None, d_head: int | None = None, **kw: Any) -> dict[str, np.ndarray]:
    """The QKV golden of nki-library's QKV CTE test (see the module docstring): :func:`qkv_projection`,
    in the row's layout, rounded to bf16."""
    out = qkv_projection(d_head=d_head, **kw)
    if output_layout.name == "NBSd":
        b, s, i = out.shape
        out = out.reshape(b, s, i // d_head, d_head).transpose(2, 0, 1, 3)
    return {"out": out.astype(BF16).astype(np.float32)}


def qkv_projection(input: Any, fused_qkv_weights: Any, bias: Any = None, fused_residual_add: bool = False,
                   mlp_prev: Any = None, attention_prev: Any = None, fused_norm_type: Any = None,
                   gamma_norm_weights: Any = None, layer_norm_bias: Any = None, norm_eps: float = 1e-6,
                   hidden_actual: int | None = None, fused_rope: bool = False, cos_cache: Any = None,
                   sin_cache: Any = None, d_head: int | None = None, num_q_heads: int | None = None,
                   num_kv_heads: int | None = None, quantization_type: Any = None, qkv_w_scale: Any = None,
                   qkv_in_scale: Any = None, **_: Any) -> np.ndarray:
    """The golden's fp32 [B, S, I] projection: residual add, norm, (quantized) ``x @ W``, bias, RoPE.
    STATIC quantization (the test's ``norm_qkv_ref``): x / in_scale clipped to +-240 (not rounded to fp8),
    the product times the q / k / v weight scale and the input scale; ROW: times each column's scale."""
    x = _f32(input)
    if fused_residual_add:
        x = x + _f32(mlp_prev) + _f32(attention_prev)
    norm = fused_norm_type.name
    gamma, beta = _f32(gamma_norm_weights), _f32(layer_norm_bias)
    if norm in ("RMS_NORM", "RMS_NORM_SKIP_GAMMA"):
        n = hidden_actual if norm == "RMS_NORM" and hidden_actual is not None else x.shape[-1]
        rms = np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) / n + norm_eps).astype(np.float32)
        x = x * np.reciprocal(rms)
        x = x * gamma if gamma is not None else x
    elif norm == "LAYER_NORM":
        mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
        x = ((x - mean) * np.reciprocal(np.sqrt(var + norm_eps))).astype(np.float32)
        x = x * gamma if gamma is not None else x
        x = x + beta if beta is not None else x
    quant = quantization_type.name if quantization_type is not None else "NONE"
    if quant == "STATIC":
        in_scale = _f32(qkv_in_scale)[0, 0]
        x = np.clip(x / in_scale, -240.0, 240.0)
    out = x @ _f32(fused_qkv_weights)
    if quant == "STATIC":
        q_end, k_end = num_q_heads * d_head, (num_q_heads + num_kv_heads) * d_head
        for part, w_scale in zip((slice(0, q_end), slice(q_end, k_end), slice(k_end, None)), _f32(qkv_w_scale)[0]):
            out[..., part] *= w_scale
        out *= in_scale
    elif quant == "ROW":
        out = out * _f32(qkv_w_scale)[0]
    if bias is not None:
        out = out + _f32(bias)
    if fused_rope:  # rotate-half RoPE on every q and k head; v unchanged
        d, half = d_head, d_head // 2
        cos, sin = _f32(cos_cache)[:, :, None, :half], _f32(sin_cache)[:, :, None, :half]
        b, s, _ = out.shape
        qk = out[:, :, :(num_q_heads + num_kv_heads) * d].reshape(b, s, -1, d)
        x1, x2 = qk[..., :half], qk[..., half:]
        rotated = np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(b, s, -1)
        out = np.concatenate([rotated, out[:, :, (num_q_heads + num_kv_heads) * d:]], axis=-1)
    return out


# vnc, batch, seqlen, hidden, fused dim or (q heads, kv heads, d_head), norm, DMA transpose, fused add,
# norm bias, layout, eps, hidden_actual, fused RoPE, test: every row of the unquantized unit tables, in their order
# (the accuracy table's dtype column and the add_bias columns are not passed on by the tests, so rows that differ
# only there run once: qkv_cases() drops the repeats)
_ROWS = [
    # test_qkv_cte_fused_rope_unit
    (2, 1, 128, 8192, (1, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (2, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (8, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (1, 1, 128), "NO_NORM", True, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (2, 1, 128), "NO_NORM", True, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (8, 1, 128), "NO_NORM", True, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 192, 8192, (8, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 192, 8320, (8, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (1, 1, 128), "RMS_NORM", False, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (2, 1, 128), "RMS_NORM", False, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (8, 1, 128), "RMS_NORM", False, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (1, 1, 128), "NO_NORM", True, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (2, 1, 128), "NO_NORM", True, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    (2, 1, 128, 8192, (8, 1, 64), "NO_NORM", True, False, False, "BSD", 1e-06, None, True, "fused_rope"),
    # test_qkv_cte_accuracy_unit
    (1, 1, 128, 512, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 128, 512, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 128, 512, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 1024, 256, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 1024, 256, "RMS_NORM", True, True, False, "BSD", 1e-06, 1024, False, "accuracy"),
    (1, 1, 512, 1024, 256, "RMS_NORM", True, True, False, "BSD", 1e-06, 768, False, "accuracy"),
    (1, 1, 512, 1024, 384, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 127, 512, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 128, 512, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 1000, 512, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 1024, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 1024, 512, "NO_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 1024, 512, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 1024, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 1024, 512, "RMS_NORM", True, True, False, "BSD", 77.0, None, False, "accuracy"),
    (1, 1, 128, 16384, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 128, 16384, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 256, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 384, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 768, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 128, 16384, 512, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 128, 16384, 512, "RMS_NORM", True, False, False, "BSD", 1e-06, 16384, False, "accuracy"),
    (1, 1, 128, 16384, 512, "RMS_NORM", True, False, False, "BSD", 1e-06, 15104, False, "accuracy"),
    (1, 1, 8192, 16384, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 512, "NO_NORM", True, True, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 512, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "accuracy"),
    (1, 1, 512, 16384, 512, "RMS_NORM", True, True, False, "BSD", 77.0, None, False, "accuracy"),
    # test_qkv_cte_performance_bsd_unit
    (1, 1, 128, 3072, 1280, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 1024, 3072, 1280, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 2048, 3072, 1280, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 1024, 16384, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 8192, 16384, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 1, 1024, 16384, 384, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 1, 8192, 16384, 384, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 2, 1024, 16384, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 2, 1024, 16384, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 16384, 8192, 512, "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 1024, 16384, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 8192, 16384, 512, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 1, 1024, 16384, 384, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 1, 8192, 16384, 384, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 256, 7168, 384, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 256, 7168, 384, "RMS_NORM_SKIP_GAMMA", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 128, 8192, 384, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 1, 578, 1408, 264, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 1, 578, 1408, 264, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 1, 578, 1408, 264, "LAYER_NORM", True, True, True, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 12, 578, 1408, 264, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (1, 12, 578, 1408, 264, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 578, 1408, 264, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 578, 1408, 264, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 1, 578, 1408, 264, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 12, 578, 1408, 264, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 12, 578, 1408, 264, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 12, 578, 1408, 264, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 14, 578, 1408, 264, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 14, 578, 1408, 264, "RMS_NORM", True, True, False, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 14, 578, 1408, 264, "LAYER_NORM", True, True, True, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 14, 578, 1408, 264, "LAYER_NORM", True, False, True, "BSD", 1e-06, None, False, "performance_bsd"),
    (2, 8, 2048, 12288, 640, "RMS_NORM", True, False, False, "BSD", 1e-06, None, False, "performance_bsd"),
    # test_qkv_cte_performance_nbsd_unit
    (2, 1, 1024, 16384, (2, 1, 128), "NO_NORM", True, False, False, "NBSd", 1e-06, None, False, "performance_nbsd"),
    (2, 1, 1024, 8192, (2, 2, 128), "NO_NORM", True, False, False, "NBSd", 1e-06, None, False, "performance_nbsd"),
    (2, 1, 2048, 8448, (5, 5, 128), "NO_NORM", True, False, False, "NBSd", 1e-06, None, False, "performance_nbsd"),
    (2, 1, 35520, 4096, (2, 2, 128), "NO_NORM", True, False, False, "NBSd", 1e-06, None, False, "performance_nbsd"),
    (2, 1, 512, 256, (2, 2, 128), "NO_NORM", True, False, False, "NBSd", 1e-06, None, False, "performance_nbsd"),
    (2, 4, 512, 256, (8, 2, 128), "NO_NORM", True, False, False, "NBSd", 1e-06, None, False, "performance_nbsd"),
    (2, 1, 1024, 20480, (3, 1, 128), "RMS_NORM", True, False, False, "NBSd", 1e-06, None, False, "performance_nbsd"),
    # test_qkv_cte_no_dma_transpose_unit
    (2, 1, 1024, 16384, (2, 1, 128), "NO_NORM", False, False, False, "NBSd", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 1024, 16384, (2, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 8192, 16384, (2, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 1024, 8192, (2, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 16384, 8192, (1, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 128, 8192, (1, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 16384, 8192, (2, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 128, 8192, (2, 1, 128), "NO_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 2048, 8448, (5, 5, 128), "NO_NORM", False, False, False, "NBSd", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 35520, 4096, (2, 2, 128), "NO_NORM", False, False, False, "NBSd", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 512, 256, (2, 2, 128), "NO_NORM", False, False, False, "NBSd", 1e-06, None, False, "no_dma_transpose"),
    (2, 4, 512, 256, (8, 2, 128), "NO_NORM", False, False, False, "NBSd", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 1024, 20480, (3, 1, 128), "NO_NORM", False, False, False, "NBSd", 1e-06, None, False, "no_dma_transpose"),
    (2, 1, 578, 1408, (1, 1, 88), "RMS_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    (2, 12, 578, 1408, (1, 1, 88), "RMS_NORM", False, False, False, "BSD", 1e-06, None, False, "no_dma_transpose"),
    # test_qkv_cte_non_quantized
    (2, 1, 1024, 2048, (1, 1, 128), "NO_NORM", True, False, False, "BSD", 1e-06, None, False, "non_quantized"),
]


# test_qkv_tkg_accuracy_unit (QuantizationType.NONE rows): vnc, batch, seqlen, hidden, hidden_actual, fused dim,
# q heads, kv heads, d_head, norm, fused add, norm bias, qkv bias, eps, layout
_TKG_ROWS = [
    (1, 1, 4, 16384, None, 384, 1, 1, 128, "RMS_NORM", True, False, False, 1e-6, "BSD"),
    (1, 4, 1, 32768, None, 384, 1, 1, 128, "NO_NORM", True, False, False, 1e-6, "BSD"),
    (1, 1, 4, 4096, None, 512, 2, 1, 128, "NO_NORM", True, False, False, 1e-6, "BSD"),
    (1, 4, 1, 4096, None, 896, 5, 1, 128, "RMS_NORM", True, False, False, 1e-6, "BSD"),
    (1, 4, 1, 4096, 4096, 896, 5, 1, 128, "RMS_NORM", True, False, False, 1e-6, "BSD"),
    (1, 4, 1, 4096, 3072, 896, 5, 1, 128, "RMS_NORM", True, False, False, 1e-6, "BSD"),
    (2, 2, 1, 3840, None, 10240, 64, 8, 128, "NO_NORM", False, False, False, 1e-6, "BSD"),
    (1, 1, 1, 128, None, 512, 2, 1, 128, "NO_NORM", False, False, False, 1e-6, "BSD"),
    (1, 1, 7, 8192, None, 384, 1, 1, 128, "RMS_NORM", False, False, False, 1e-5, "BSD"),
    (1, 1, 5, 8192, None, 384, 1, 1, 128, "LAYER_NORM", False, True, False, 1e-6, "BSD"),
    (1, 1, 5, 8192, None, 384, 1, 1, 128, "LAYER_NORM", False, False, False, 1e-6, "BSD"),
    (1, 1, 3, 16384, None, 896, 5, 1, 128, "NO_NORM", False, False, True, 1e-6, "BSD"),
    (2, 8, 5, 3072, None, 640, 8, 1, 64, "RMS_NORM", False, False, True, 1e-6, "BSD"),
    (2, 1, 1, 16384, None, 512, 2, 1, 128, "NO_NORM", False, False, False, 1e-6, "NBSd"),
    (2, 1, 1, 8192, None, 768, 2, 2, 128, "NO_NORM", False, False, False, 1e-6, "NBSd"),
    (2, 1, 1, 8448, None, 4352, 24, 5, 128, "NO_NORM", False, False, False, 1e-6, "NBSd"),
    (1, 1, 1, 8192, None, 5120, 32, 4, 128, "RMS_NORM", False, False, False, 1e-6, "NBSd"),
    (2, 1, 1, 8192, None, 10240, 64, 8, 128, "RMS_NORM", False, False, False, 1e-6, "BSD"),
    (2, 1, 1, 8448, None, 1920, 5, 5, 128, "NO_NORM", False, False, False, 1e-6, "NBSd"),
    (2, 1, 1, 8192, None, 512, 2, 1, 128, "RMS_NORM", True, False, False, 77.0, "BSD"),
]
# test_qkv_tkg_performance_bsd_unit (QuantizationType.NONE rows): vnc, batch, seqlen, hidden, fused dim, d_head,
# norm, fused add, norm bias, qkv bias
_TKG_PERF_ROWS = [
    (2, 2, 4, 8448, 1408, 128, 'LAYER_NORM', False, False, False),
    (2, 4, 2, 4096, 1024, 128, 'LAYER_NORM', False, False, False),
    (2, 16, 5, 8192, 104, 26, 'RMS_NORM', False, False, False),
    (2, 14, 5, 8192, 104, 26, 'RMS_NORM', False, False, False),
    (2, 3, 1, 2048, 104, 26, 'RMS_NORM', False, False, False),
    (2, 1, 1, 2048, 104, 26, 'RMS_NORM', False, False, False),
    (2, 5, 1, 4096, 512, 128, 'RMS_NORM', False, False, False),
    (2, 1, 5, 4096, 512, 128, 'RMS_NORM', False, False, False),
    (2, 3, 1, 16384, 384, 128, 'RMS_NORM', True, False, False),
    (2, 5, 1, 16384, 384, 128, 'RMS_NORM', True, False, False),
    (2, 1, 6, 16384, 896, 128, 'RMS_NORM', True, False, False),
    (2, 1, 6, 16384, 384, 128, 'RMS_NORM', True, False, False),
    (2, 1, 3, 16384, 384, 128, 'RMS_NORM', True, False, False),
    (2, 1, 5, 16384, 384, 128, 'RMS_NORM', True, False, False),
    (2, 4, 1, 16384, 512, 128, 'RMS_NORM', False, False, False),
    (2, 8, 7, 16384, 512, 128, 'RMS_NORM', True, False, False),
    (2, 4, 7, 16384, 512, 128, 'RMS_NORM', False, False, False),
    (2, 3, 1, 8192, 512, 128, 'NO_NORM', True, False, False),
    (2, 1, 1, 8192, 896, 128, 'NO_NORM', True, False, False),
    (2, 8, 5, 8192, 384, 128, 'RMS_NORM', False, False, False),
    (2, 4, 5, 8192, 384, 128, 'RMS_NORM', False, False, False),
    (2, 1, 3, 8192, 512, 128, 'NO_NORM', True, False, False),
    (2, 8, 5, 8192, 5120, 1024, 'RMS_NORM', False, False, False),
    (2, 4, 5, 8192, 10240, 1024, 'RMS_NORM', False, False, False),
    (2, 1, 1, 32768, 896, 128, 'NO_NORM', False, False, False),
    (2, 1, 1, 20480, 896, 128, 'NO_NORM', False, False, False),
    (2, 1, 3, 32768, 896, 128, 'RMS_NORM', False, False, False),
    (2, 1, 3, 20480, 896, 128, 'RMS_NORM', False, False, False),
    (2, 1, 5, 32768, 896, 128, 'RMS_NORM', True, False, False),
    (2, 1, 5, 20480, 896, 128, 'RMS_NORM', True, False, False),
    (2, 4, 4, 3072, 640, 64, 'RMS_NORM', False, False, True),
    (2, 4, 1, 3072, 640, 64, 'RMS_NORM', False, False, True),
    (2, 1, 1, 8448, 1920, 128, 'NO_NORM', False, False, False),
    (2, 1, 1, 8448, 1920, 128, 'LAYER_NORM', False, False, False),
]


def _tkg_cases() -> list[Case]:
    rows = [(*r, "accuracy") for r in _TKG_ROWS] + [
        (lnc, b, s, h, None, dim, dim // d - 2, 1, d, norm, fused, nb, qb, 1e-6, "BSD", "performance_bsd")
        for lnc, b, s, h, dim, d, norm, fused, nb, qb in _TKG_PERF_ROWS]
    cases = []
    for lnc, b, s, h, actual, dim, q, kv, d, norm, fused, nb, qb, eps, layout, test in rows:
        flags = [norm.lower(), layout] + ["fused_add"] * fused + ["norm_bias"] * nb + ["qkv_bias"] * qb \
            + [f"eps={eps:g}"] * (eps != 1e-6) + [f"hidden_actual={actual}"] * bool(actual)
        cases.append(Case(
            kernel="core/qkv/qkv_tkg", name=f"{test} bf16 " + " ".join(flags),
            shapes=f"B={b} S={s} H={h} heads={q}/{kv} d={d}", entry=f"{LIB}.qkv.qkv:qkv",
            wrap_kernel=first_output if fused else None,  # with a fused add it also returns the sum
            reference="trnkit.conformance.cases_qkv:qkv_golden",
            inputs=_qkv_inputs(b, s, h, dim, norm, True, fused, nb, layout, eps, actual, (q, kv, d), False, qb),
            outputs=("out",), lnc=lnc, rtol=2e-2, atol=1e-5, test_file=f"{TESTS}/test_qkv_tkg.py",
            note="inputs as the test draws them when it runs first (its generator is shared)"))
    return cases


def cte_case(lnc: int, b: int, s: int, h: int, dim: int | tuple[int, int, int], norm: str, dma_t: bool, fused: bool,
             nb: bool, layout: str, eps: float, actual: int | None, rope: bool, test: str) -> Case:
    """One bf16 row of ``test_qkv_cte.py``; ``dim``: the fused QKV width or (q heads, kv heads, d_head)."""
    heads = dim if isinstance(dim, tuple) else None
    fused_dim = (heads[0] + 2 * heads[1]) * heads[2] if heads else dim
    flags = [norm.lower(), layout] + ["dma_transpose"] * dma_t + ["fused_add"] * fused + ["norm_bias"] * nb \
        + [f"eps={eps:g}"] * (eps != 1e-6) + [f"hidden_actual={actual}"] * bool(actual) + ["rope"] * rope
    shapes = f"B={b} S={s} H={h} " + (f"heads={heads[0]}/{heads[1]} d={heads[2]}" if heads else f"I={fused_dim}")
    return Case(
        kernel="core/qkv/qkv_cte", name=f"{test} bf16 " + " ".join(flags), shapes=shapes,
        entry=f"{LIB}.qkv.qkv:qkv", reference="trnkit.conformance.cases_qkv:qkv_golden",
        inputs=_qkv_inputs(b, s, h, fused_dim, norm, dma_t, fused, nb, layout, eps, actual, heads, rope),
        outputs=("out",), lnc=lnc, rtol=2e-2, atol=1e-5, test_file=f"{TESTS}/test_qkv_cte.py",
        note="" if rope else "inputs as the test draws them when it runs first (its generator is shared)")


def qkv_cases() -> list[Case]:
    return [cte_case(*row) for row in dict.fromkeys(_ROWS)] + _tkg_cases()
