"""Conformance cases of nki-library's ``qkv_tkg`` with its input and output in SBUF, written from its test file.

``test/integration/nkilib/core/qkv/test_qkv_tkg.py`` (``test_qkv_tkg_sb2sb_accuracy_unit``: every row, fp16
activations; unquantized, STATIC and ROW fp8 weights) runs its own kernel, ``qkv_tkg_sb2sb_wrapper_kernel``, at
rtol 2e-2 (quantized: 4e-2), atol 1e-5. That kernel lives in the test module, which cannot be imported here (its
``tensor_generators`` helper does ``from neuron_dtypes import static_cast`` at import time, and AWS's
``neuron_dtypes`` is not installable), so :func:`_sb2sb_wrapper` is written here from its description. Inputs
as ``build_qkv_input`` draws them (:mod:`.cases_qkv`, :mod:`.cases_qkv_quant`: one fresh
``default_rng(0)``, the weights fp8 on the quantized rows). Its golden, the library's ``qkv_tkg_torch_ref``
(which imports nki-library's test package), computes what :func:`.cases_qkv.qkv_golden` does (residual add,
norm, the STATIC / ROW dequantization, bias, layout); the output is rounded to fp16 as the test's
``convert_to_numpy(out, dtype)``. The NBSd output is ``[N, B x S, d]``, the golden's ``[N, B, S, d]``: the same
elements in the same order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .cases_qkv import LIB, TESTS, _qkv_inputs, qkv_golden
from .cases_qkv_quant import FP8, NOTE, SHARED_NOTE, _quantized
from .harness import Case

__all__ = ["qkv_sb2sb_cases", "qkv_sb2sb_golden"]

F16 = np.dtype(np.float16)


def _sb2sb_wrapper(qkv_tkg: Callable[..., Any]) -> Callable[..., Any]:
    """The test's kernel: an SBUF manager over the usable SBUF (less 16 KiB for the compiler), the input
    ``[B, S, H]`` loaded into an SBUF heap tensor ``[128, B x S, H / 128]`` (H split as ``[cores, 128, H /
    128 / cores]``, each core's part contiguous), ``qkv_tkg`` with its output in SBUF (``[B x S, I]``), stored
    to HBM as ``[B x S, I]`` (BSD) or head by head as ``[N, B x S, d]`` (NBSd)."""
    import nki.isa as nisa  # the interpreter, inside nki_is_interpreter
    import nki.language as nl

    sbuf_manager = importlib.import_module(f"{LIB}.utils.allocator").SbufManager
    logger = importlib.import_module(f"{LIB}.utils.logging").Logger
    sharding = importlib.import_module(f"{LIB}.utils.kernel_helpers").get_verified_program_sharding_info
    view = importlib.import_module(f"{LIB}.utils.tensor_view").TensorView

    def wrapper(input, fused_qkv_weights, output_layout, bias=None, quantization_type=None, qkv_w_scale=None,
                qkv_in_scale=None, fused_residual_add=False, mlp_prev=None, attention_prev=None,
                fused_norm_type=None, gamma_norm_weights=None, layer_norm_bias=None, norm_eps=1e-6,
                hidden_actual=None, d_head=None, num_q_heads=None, num_kv_heads=None, **_):
        b, s, h = input.shape
        bxs, h1, i = b * s, h // 128, fused_qkv_weights.shape[1]
        sbm = sbuf_manager(0, nl.tile_size.total_available_sbuf_size - 16 * 1024, logger=logger("sb2sb"),
                           use_auto_alloc=False)
        sbm.open_scope()
        _, shards, _ = sharding()
        hidden_sb = sbm.alloc_heap(shape=(128, bxs, h1), dtype=input.dtype, buffer=nl.sbuf, name="hidden_sb")
        src = view(input).flatten_dims(start_dim=0, end_dim=1).reshape_dim(dim=1, shape=[shards, 128, h1 // shards])
        dst = view(hidden_sb).reshape_dim(dim=2, shape=[shards, h1 // shards])
        nisa.dma_copy(dst=dst.get_view(), src=src.permute(dims=[2, 0, 1, 3]).get_view())
        out_sb = qkv_tkg(hidden=hidden_sb, qkv_w=fused_qkv_weights, norm_w=gamma_norm_weights,
                         fused_add=fused_residual_add, mlp_prev=mlp_prev, attn_prev=attention_prev, d_head=d_head,
                         num_kv_heads=num_kv_heads, num_q_heads=num_q_heads, output_layout=output_layout,
                         eps=norm_eps, norm_type=fused_norm_type, quantization_type=quantization_type,
                         qkv_w_scale=qkv_w_scale, qkv_in_scale=qkv_in_scale, output_in_sbuf=True, qkv_bias=bias,
                         norm_bias=layer_norm_bias, hidden_actual=hidden_actual, sbm=sbm)
        if output_layout.name == "BSD":
            out = nl.ndarray((bxs, i), dtype=hidden_sb.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out.ap(pattern=[[i, bxs], [1, i]], offset=0), src=out_sb)
        else:
            out = nl.ndarray((i // d_head, bxs, d_head), dtype=hidden_sb.dtype, buffer=nl.shared_hbm)
            for head in range(i // d_head):
                nisa.dma_copy(dst=out.ap(pattern=[[d_head, bxs], [1, d_head]], offset=head * bxs * d_head),
                              src=out_sb.ap(pattern=[[i, bxs], [1, d_head]], offset=head * d_head))
        sbm.close_scope()
        return out
    return wrapper


def qkv_sb2sb_golden(**kw: Any) -> dict[str, np.ndarray]:
    """:func:`.cases_qkv.qkv_golden` rounded to fp16 (the test's dtype), in the kernel's output shape."""
    out = qkv_golden(**kw)["out"]
    if kw["output_layout"].name == "NBSd":
        out = out.reshape(out.shape[0], -1, out.shape[-1])
    else:
        out = out.reshape(-1, out.shape[-1])
    return {"out": out.astype(F16).astype(np.float32)}


# test_qkv_tkg_sb2sb_accuracy_unit: vnc, batch, seqlen, hidden, hidden_actual, fused dim, q heads, kv heads, d_head,
# norm, quantization, norm bias, qkv bias, eps, layout
_ROWS = [
    (1, 1, 4, 16384, None, 384, 1, 1, 128, "RMS_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 4, 1, 32768, None, 384, 1, 1, 128, "NO_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 1, 4, 4096, None, 512, 2, 1, 128, "NO_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 4, 1, 4096, None, 896, 5, 1, 128, "RMS_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 4, 1, 4096, 4096, 896, 5, 1, 128, "RMS_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 4, 1, 4096, 3072, 896, 5, 1, 128, "RMS_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 1, 7, 8192, None, 384, 1, 1, 128, "RMS_NORM", "NONE", False, False, 1e-5, "BSD"),
    (1, 1, 5, 8192, None, 384, 1, 1, 128, "LAYER_NORM", "NONE", True, False, 1e-6, "BSD"),
    (1, 1, 5, 8192, None, 384, 1, 1, 128, "LAYER_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 1, 3, 16384, None, 896, 5, 1, 128, "NO_NORM", "NONE", False, True, 1e-6, "BSD"),
    (2, 1, 1, 16384, None, 512, 2, 1, 128, "NO_NORM", "NONE", False, False, 1e-6, "NBSd"),
    (2, 1, 1, 8192, None, 768, 2, 2, 128, "NO_NORM", "NONE", False, False, 1e-6, "NBSd"),
    (2, 1, 1, 8448, None, 1920, 5, 5, 128, "NO_NORM", "NONE", False, False, 1e-6, "NBSd"),
    (2, 1, 1, 8192, None, 512, 2, 1, 128, "RMS_NORM", "NONE", False, False, 77.0, "BSD"),
    (2, 1, 5, 8192, None, 1280, 8, 1, 128, "RMS_NORM", "STATIC", False, False, 1e-6, "BSD"),
    (2, 4, 1, 16384, None, 3200, 15, 5, 128, "NO_NORM", "STATIC", False, True, 1e-6, "NBSd"),
    (1, 1, 1, 8192, None, 1408, 7, 2, 128, "RMS_NORM", "STATIC", False, True, 1e-6, "NBSd"),
    (1, 1, 4, 8192, None, 4608, 34, 1, 128, "RMS_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 4, 1, 8192, None, 8192, 56, 4, 128, "NO_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 1, 1, 16384, None, 7168, 48, 4, 128, "RMS_NORM", "NONE", False, True, 1e-6, "NBSd"),
    (2, 1, 1, 16384, None, 4608, 34, 1, 128, "RMS_NORM", "NONE", False, False, 1e-6, "BSD"),
    (1, 1, 4, 8192, None, 5120, 32, 4, 128, "RMS_NORM", "STATIC", False, False, 1e-6, "BSD"),
    (2, 1, 5, 8192, None, 1280, 8, 1, 128, "RMS_NORM", "ROW", False, False, 1e-6, "BSD"),
    (2, 1, 1, 8192, None, 1408, 7, 2, 128, "NO_NORM", "ROW", False, True, 1e-6, "NBSd"),
]


def qkv_sb2sb_cases() -> list[Case]:
    cases = []
    for lnc, b, s, h, actual, dim, q, kv, d, norm, quant, nb, qb, eps, layout in _ROWS:
        flags = [norm.lower(), layout] + ["norm_bias"] * nb + ["qkv_bias"] * qb + [f"eps={eps:g}"] * (eps != 1e-6) \
            + [f"hidden_actual={actual}"] * bool(actual)
        fp8 = quant != "NONE"
        inputs = _qkv_inputs(b, s, h, dim, norm, True, False, nb, layout, eps, actual, (q, kv, d), False, qb,
                             FP8 if fp8 else None, F16)
        name = "sb2sb fp16 " + (f"x fp8 {quant.lower()} " if fp8 else "") + " ".join(flags)
        cases.append(Case(
            kernel="core/qkv/qkv_tkg", name=name,
            shapes=f"B={b} S={s} H={h} heads={q}/{kv} d={d}", entry=f"{LIB}.qkv.qkv_tkg:qkv_tkg",
            wrap_kernel=_sb2sb_wrapper, reference="trnkit.conformance.cases_qkv_sb2sb:qkv_sb2sb_golden",
            inputs=_quantized(inputs, quant) if fp8 else inputs, outputs=("out",), lnc=lnc,
            rtol=4e-2 if fp8 else 2e-2, atol=1e-5, note=f"{NOTE}; {SHARED_NOTE}" if fp8 else SHARED_NOTE,
            test_file=f"{TESTS}/test_qkv_tkg.py"))
    return cases
