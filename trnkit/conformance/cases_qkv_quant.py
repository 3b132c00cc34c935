"""Conformance cases of nki-library's core/qkv kernel with fp8: quantized weights (CTE and TKG) and the fp8 KV cache.

``test/integration/nkilib/core/qkv/test_qkv_cte.py``: ``test_qkv_cte_static_quantization`` (rtol 5e-2, atol
2e-2), ``test_qkv_cte_fp8_kv_cache_quantization``, ``test_qkv_cte_fp8_extreme_values_clamping`` and
``test_qkv_cte_block_kv_cache`` (rtol 0.1, atol 1e-5); ``test_qkv_tkg.py``: the STATIC / ROW rows of
``test_qkv_tkg_accuracy_unit`` and ``test_qkv_tkg_performance_bsd_unit`` (rtol 4e-2, atol 1e-5). Inputs as
``test_qkv_common.build_qkv_input`` draws them (see :mod:`.cases_qkv`: one fresh ``default_rng(0)``, the
weights cast to fp8 e4m3 on the quantized rows), then: STATIC clips the input and the weights to [-1, 1] and
draws the [128, 3] weight and [128, 1] input scales as ``1/240 * uniform(0.995, 1.005)`` after
``np.random.seed(42)``; ROW divides each weight column by its scale, abs max / 240, and casts it to fp8 again.
The test computes that scale as an fp8 array divided by 240; with ml_dtypes' ``float8_e4m3`` (max 240) the
quotient rounds to fp8, the rescaled weights reach 256 and overflow to inf, so it is computed in fp32 here,
as the test's ``.astype(np.float32)`` of it intends. The extreme-values rows draw ``randn`` from
``np.random.seed(42)``: the input x 5 (x 10), the weights x 2 (x 3).

The goldens (``golden_func_fused_add_qkv`` of the CTE test, which the TKG test imports) are
:func:`.cases_qkv.qkv_golden` and :func:`qkv_kv_cache_golden` here, written from the test: the fp8 KV rows
return q in bf16 and k / v divided by their scale, clipped to [fp8_min, fp8_max] and cast to fp8 into a zeroed
cache ([B, max_seq_len, kv] from position 0, or the block cache at each token's slot). The tests' fp8 casts are
``neuron_dtypes.static_cast`` (not installable, its rounding not documented), taken here as round-to-nearest-
even (ml_dtypes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .cases_qkv import LIB, TESTS, _f32, _qkv_inputs, qkv_projection
from .harness import Case, first_output

__all__ = ["qkv_quant_cases", "qkv_kv_cache_golden"]

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3)
FP8_MAX = 240.0
NOTE = "fp8 casts taken as round-to-nearest-even (ml_dtypes)"
SHARED_NOTE = "inputs as the test draws them when it runs first (its generator is shared)"


def _quantized(make: Callable[[], dict], quant: str) -> Callable[[], dict[str, Any]]:
    """``make``'s inputs (fp8 weights) with ``build_qkv_input``'s STATIC / ROW steps applied."""
    def inputs() -> dict[str, Any]:
        kw = make()
        w = kw["fused_qkv_weights"]
        if quant == "STATIC":
            kw["input"] = np.clip(kw["input"], -1.0, 1.0).astype(kw["input"].dtype)
            w = np.clip(w, -1.0, 1.0).astype(FP8)
            np.random.seed(42)
            kw["qkv_w_scale"] = (1.0 / FP8_MAX) * np.random.uniform(0.995, 1.005, (128, 3)).astype(np.float32)
            kw["qkv_in_scale"] = (1.0 / FP8_MAX) * np.random.uniform(0.995, 1.005, (128, 1)).astype(np.float32)
        else:
            scale = np.abs(w.astype(np.float32)).max(axis=0, keepdims=True) / FP8_MAX
            w = (w.astype(np.float32) / scale).astype(FP8)
            kw["qkv_w_scale"] = np.broadcast_to(scale, (128, w.shape[1])).astype(np.float32)
        types = importlib.import_module(f"{LIB}.utils.common_types")
        kw["fused_qkv_weights"], kw["quantization_type"] = w, getattr(types.QuantizationType, quant)
        return kw
    return inputs


def _kv_cache(make: Callable[[], dict], b: int, kv_dim: int, scale: float, cache: tuple[int, int],
              block: bool) -> Callable[[], dict[str, Any]]:
    """``make``'s inputs plus the zeroed fp8 k / v caches (``cache``: [B, max_seq_len] or [blocks, block
    size] rows of ``kv_dim``), their [128, 1] scales, the clip bounds and, for the block cache, the test's
    slot mapping (tokens in reverse order)."""
    def inputs() -> dict[str, Any]:
        import nki.language as nl  # the interpreter, inside nki_is_interpreter

        kw = make()
        s = kw["input"].shape[1]
        for name in ("quantization_type", "qkv_w_scale", "qkv_in_scale"):  # the test pops them
            kw.pop(name)
        kw.update({"k_cache": np.zeros((*cache, kv_dim), FP8), "v_cache": np.zeros((*cache, kv_dim), FP8),
                   "k_scale": np.full((128, 1), scale, np.float32), "v_scale": np.full((128, 1), scale, np.float32),
                   "fp8_max": FP8_MAX, "fp8_min": -FP8_MAX, "kv_dtype": nl.float8_e4m3})
        if block:
            kw.update({"use_block_kv": True, "block_size": cache[1],
                       "slot_mapping": np.arange(s - 1, -1, -1, dtype=np.int32).reshape(b, s)})
        return kw
    return inputs


def _scaled_randn(make: Callable[[], dict], in_scale: float, w_scale: float) -> Callable[[], dict[str, Any]]:
    """The extreme-values test's generator: ``np.random.seed(42)``, input then weights ``randn * scale``."""
    def inputs() -> dict[str, Any]:
        kw = make()
        np.random.seed(42)
        kw["input"] = (np.random.randn(*kw["input"].shape) * in_scale).astype(BF16)
        kw["fused_qkv_weights"] = (np.random.randn(*kw["fused_qkv_weights"].shape) * w_scale).astype(BF16)
        return kw
    return inputs


def qkv_kv_cache_golden(k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any, fp8_max: float, fp8_min: float,
                        num_q_heads: int, num_kv_heads: int, d_head: int, slot_mapping: Any = None,
                        use_block_kv: bool = False, block_size: int | None = None,
                        **kw: Any) -> dict[str, np.ndarray]:
    """The fp8-KV-cache golden: q in bf16; k and v divided by their scale, clipped, cast to fp8 into the
    zeroed caches (the first S positions of each batch row, or each token's slot of the block cache)."""
    out = qkv_projection(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, d_head=d_head, **kw)
    b, s, _ = out.shape
    q_dim, kv_dim = num_q_heads * d_head, num_kv_heads * d_head
    caches = []
    for cache, scale, part in ((k_cache, k_scale, slice(q_dim, q_dim + kv_dim)),
                               (v_cache, v_scale, slice(q_dim + kv_dim, None))):
        values = np.clip(out[:, :, part] / _f32(scale)[0, 0], fp8_min, fp8_max).astype(FP8)
        golden = np.zeros(tuple(cache.shape), FP8)
        if use_block_kv:
            slots = np.asarray(slot_mapping).reshape(-1)
            golden[slots // block_size, slots % block_size] = values.reshape(b * s, kv_dim)
        else:
            golden[:, :s] = values
        caches.append(golden)
    return {"q_tensor_hbm": out[:, :, :q_dim].astype(BF16).astype(np.float32), "k_cache": caches[0],
            "v_cache": caches[1]}


# test_qkv_cte_static_quantization: vnc, batch, seqlen, hidden, (q heads, kv heads, d_head), norm, DMA transpose,
# fused add, qkv bias (layout BSD, eps 1e-6)
_CTE_STATIC = [
    (2, 1, 128, 8192, (8, 1, 128), "NO_NORM", True, False, False),
    (2, 1, 1024, 8192, (8, 1, 128), "NO_NORM", True, False, False),
    (2, 1, 16384, 8192, (8, 1, 128), "NO_NORM", True, False, False),
    (2, 1, 1024, 8192, (8, 1, 128), "NO_NORM", False, False, True),
    (2, 1, 128, 8192, (8, 1, 128), "NO_NORM", False, False, True),
    (2, 1, 1024, 8192, (8, 1, 128), "RMS_NORM", False, False, False),
    (2, 1, 128, 8192, (8, 1, 128), "RMS_NORM", False, True, False),
]
# the fp8 KV-cache tests (vnc 2, B = 1, H = 2048, 1 q and 1 kv head of 128, NO_NORM): test, seqlen, cache rows
# (max_seq_len, or blocks x block size), k = v scale, input / weight randn scales (the extreme-values test)
_CTE_KV = [
    ("fp8_kv_cache", 1024, (8192,), 1.67, None), ("fp8_kv_cache", 512, (4096,), 1.67, None),
    ("fp8_kv_cache", 2048, (8192,), 1.67, None), ("fp8_kv_cache", 1024, (8192,), 1.0, None),
    ("fp8_kv_cache", 1024, (8192,), 2.5, None),
    ("fp8_extreme_values_clamping", 1024, (8192,), 0.01, (5.0, 2.0)),
    ("fp8_extreme_values_clamping", 512, (4096,), 0.01, (5.0, 2.0)),
    ("fp8_extreme_values_clamping", 1024, (8192,), 0.005, (10.0, 3.0)),
    ("block_kv_cache", 512, (64, 128), 1.67, None), ("block_kv_cache", 1024, (64, 128), 1.67, None),
    ("block_kv_cache", 512, (128, 64), 1.67, None), ("block_kv_cache", 512, (64, 128), 1.0, None),
]
# test_qkv_tkg_accuracy_unit's STATIC / ROW rows, then test_qkv_tkg_performance_bsd_unit's STATIC row: test,
# vnc, batch, seqlen, hidden, q heads, kv heads, d_head, norm, quantization, fused add, qkv bias, layout
_TKG = [
    ("accuracy", 2, 1, 5, 8192, 8, 1, 128, "RMS_NORM", "STATIC", False, False, "BSD"),
    ("accuracy", 2, 4, 1, 16384, 24, 5, 128, "NO_NORM", "STATIC", False, True, "NBSd"),
    ("accuracy", 1, 1, 1, 8192, 32, 4, 128, "RMS_NORM", "STATIC", False, False, "NBSd"),
    ("accuracy", 2, 1, 5, 8192, 8, 1, 128, "RMS_NORM", "ROW", False, False, "BSD"),
    ("accuracy", 2, 4, 1, 16384, 24, 5, 128, "NO_NORM", "ROW", False, True, "NBSd"),
    ("accuracy", 1, 1, 1, 8192, 32, 4, 128, "RMS_NORM", "ROW", False, False, "NBSd"),
    ("accuracy", 2, 1, 3, 8192, 8, 1, 128, "RMS_NORM", "ROW", True, False, "BSD"),
    ("accuracy", 2, 2, 1, 16384, 2, 1, 128, "NO_NORM", "ROW", False, False, "BSD"),
    ("accuracy", 2, 1, 1, 8192, 64, 8, 128, "RMS_NORM", "ROW", False, False, "BSD"),
    ("performance_bsd", 2, 14, 5, 8192, 8, 1, 128, "RMS_NORM", "STATIC", False, False, "BSD"),
]


def _cte_cases() -> list[Case]:
    cases = []
    for lnc, b, s, h, heads, norm, dma_t, fused, qkv_bias in _CTE_STATIC:
        dim = (heads[0] + 2 * heads[1]) * heads[2]
        flags = [norm.lower(), "BSD"] + ["dma_transpose"] * dma_t + ["fused_add"] * fused + ["qkv_bias"] * qkv_bias
        make = _qkv_inputs(b, s, h, dim, norm, dma_t, fused, False, "BSD", 1e-6, None, heads, False, qkv_bias, FP8)
        cases.append(Case(
            kernel="core/qkv/qkv_cte", name="static_quantization bf16 x fp8 " + " ".join(flags),
            shapes=f"B={b} S={s} H={h} heads={heads[0]}/{heads[1]} d={heads[2]}", entry=f"{LIB}.qkv.qkv:qkv",
            reference="trnkit.conformance.cases_qkv:qkv_golden", inputs=_quantized(make, "STATIC"),
            outputs=("out",), lnc=lnc, rtol=5e-2, atol=2e-2, note=f"{NOTE}; {SHARED_NOTE}",
            test_file=f"{TESTS}/test_qkv_cte.py"))
    for test, s, cache, scale, randn in _CTE_KV:
        block = len(cache) == 2
        make = _qkv_inputs(1, s, 2048, 384, "NO_NORM", True, False, False, "BSD", 1e-6, None, (1, 1, 128), False)
        if randn:
            make = _scaled_randn(make, *randn)
        cache_rows = cache if block else (1, *cache)
        shape = f"blocks={cache[0]}x{cache[1]}" if block else f"max_seq_len={cache[0]}"
        cases.append(Case(
            kernel="core/qkv/qkv_cte", name=f"{test} bf16 fp8 kv scale={scale:g}"
            + (f" input x{randn[0]:g} weights x{randn[1]:g}" if randn else ""),
            shapes=f"B=1 S={s} H=2048 heads=1/1 d=128 {shape}", entry=f"{LIB}.qkv.qkv:qkv",
            reference="trnkit.conformance.cases_qkv_quant:qkv_kv_cache_golden",
            inputs=_kv_cache(make, 1, 128, scale, cache_rows, block), outputs=("q_tensor_hbm", "k_cache", "v_cache"),
            lnc=2, rtol=0.1, atol=1e-5, note=NOTE if randn else f"{NOTE}; {SHARED_NOTE}",
            test_file=f"{TESTS}/test_qkv_cte.py"))
    return cases


def _tkg_cases() -> list[Case]:
    cases = []
    for test, lnc, b, s, h, q, kv, d, norm, quant, fused, qkv_bias, layout in _TKG:
        dim = (q + 2 * kv) * d
        flags = [norm.lower(), layout] + ["fused_add"] * fused + ["qkv_bias"] * qkv_bias
        make = _qkv_inputs(b, s, h, dim, norm, True, fused, False, layout, 1e-6, None, (q, kv, d), False, qkv_bias,
                           FP8)
        cases.append(Case(
            kernel="core/qkv/qkv_tkg", name=f"{test} bf16 x fp8 {quant.lower()} " + " ".join(flags),
            shapes=f"B={b} S={s} H={h} heads={q}/{kv} d={d}", entry=f"{LIB}.qkv.qkv:qkv",
            wrap_kernel=first_output if fused else None,  # with a fused add it also returns the sum
            reference="trnkit.conformance.cases_qkv:qkv_golden", inputs=_quantized(make, quant),
            outputs=("out",), lnc=lnc, rtol=4e-2, atol=1e-5, note=f"{NOTE}; {SHARED_NOTE}",
            test_file=f"{TESTS}/test_qkv_tkg.py"))
    return cases


def qkv_quant_cases() -> list[Case]:
    return _cte_cases() + _tkg_cases()
