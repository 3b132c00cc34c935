"""The nki-library test cases the conformance run executes, written from nki-library's test files.

Every case states the test it comes from (``test/integration/nkilib/...`` at the measured commit), runs
at that test's own shape unless its ``note`` says otherwise, builds the inputs the way that test does
(same seeds, distributions and dtypes) and uses that test's tolerances and logical-core count (LNC).
Nothing here is copied from nki-library: kernels, references and config helpers are imported from
the checkout at run time (``module:function`` paths inside its ``src/``).
"""

from __future__ import annotations

import enum
import importlib
import math
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .cases_attention import attention_cases
from .cases_transformer import attention_block_cases, transformer_tkg_cases
from .cases_attention_tkg import attention_tkg_cases
from .cases_collectives import collective_cases
from .cases_conv import conv_cases
from .cases_dynamic_shapes import dynamic_shapes_cases
from .cases_loss import loss_cases
from .cases_mlp import mlp_cases
from .cases_mlp_quant import FP8, FP8_NOTE, mlp_quant_cases
from .cases_model_config import model_config_cases, reduced_cases
from .cases_moe_block import moe_block_cases
from .cases_moe_experimental import moe_experimental_cases
from .cases_max_utils import max_utils_cases
from .cases_moe_tkg import moe_tkg_cases
from .cases_projection import projection_cases
from .cases_qkv import qkv_cases
from .cases_qkv_quant import qkv_quant_cases
from .cases_qkv_sb2sb import qkv_sb2sb_cases
from .cases_rmsnorm_quant import rmsnorm_quant_cases
from .cases_rope import rope_cases
from .cases_subkernels import subkernel_cases
from .cases_tensor_view import tensor_view_cases
from .cases_utils import utils_cases
from . import harness
from .harness import Case, case_id, uniform_array

__all__ = ["all_cases", "case_id", "FAST", "SLOW_ONLY", "fast_cases"]

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core"


def _lib(path: str) -> Any:
    """``module:attr`` from the checkout (imported when a case runs, with ``nki`` = the interpreter)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(f"{LIB}.{module}"), attr)


def _randn(seed: int, *shapes: tuple[int, ...], dtype: np.dtype) -> list[np.ndarray]:
    """``np.random.seed(seed)`` then one ``randn`` per shape, in order (nki-library's generators)."""
    np.random.seed(seed)
    return [np.random.randn(*s).astype(dtype) for s in shapes]


def _dt_name(dt: np.dtype) -> str:
    return {BF16: "bf16", F16: "fp16", F32: "fp32"}[np.dtype(dt)]


# -- core/embeddings/rope_hf (test_rope_hf.py) ---------------------------------------------------
_ROPE_SHAPES = [  # batch, q heads, kv heads, seq, head dim, dtype, backward
    (1, 32, 8, 256, 128, BF16, False), (1, 32, 8, 256, 128, F32, False),
    (2, 16, 4, 512, 128, BF16, False), (4, 1, 1, 512, 128, BF16, False),
    (1, 32, 8, 512, 64, F32, False), (1, 32, 8, 256, 128, F32, True),
]


def _rope_inputs(b: int, h: int, kv: int, s: int, d: int, dt: np.dtype, backward: bool,
                 packed: bool) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        q = np.random.randn(b, h, s, d).astype(dt)
        k = np.random.randn(b, kv, s, d).astype(dt)
        out = {"q": q, "k": k, "q_out": np.zeros_like(q), "k_out": np.zeros_like(k),
               "backward": backward}
        if packed:
            out["rope_cache"] = np.random.randn(s, 2 * d).astype(dt)
        else:
            out["cos"] = np.random.randn(b, s, d).astype(dt)
            out["sin"] = np.random.randn(b, s, d).astype(dt)
        return out
    return make


def _rope_cases() -> list[Case]:
    cases = []
    variants = [("cos/sin", False, 1), ("cos/sin", False, 2), ("packed cache", True, 2)]
    for b, h, kv, s, d, dt, bwd in _ROPE_SHAPES + [(1, 32, 8, 64, 128, F32, False)]:
        for fmt, packed, lnc in variants:  # test_rope_hf_lnc at LNC 1 and 2, test_rope_hf_cache at LNC 2
            negative = s % (128 * lnc) != 0  # the test's negative case: seq_len not a multiple of 128 * LNC
            name = f"{'bwd' if bwd else 'fwd'} {fmt} {_dt_name(dt)}" + (" (must reject)" if negative else "")
            cases.append(Case(
                kernel="core/embeddings/rope_hf", name=name,
                shapes=f"q[{b},{h},{s},{d}] k[{b},{kv},{s},{d}]",
                entry=f"{LIB}.embeddings.rope_hf:rope_hf",
                reference=f"{LIB}.embeddings.rope_hf_torch:rope_hf_torch_ref",
                inputs=_rope_inputs(b, h, kv, s, d, dt, bwd, packed), outputs=("q_out", "k_out"),
                lnc=lnc, rtol=1e-6, atol=1e-6, keep_low_precision=True, negative=negative,
                test_file=f"{TESTS}/embeddings/test_rope_hf.py"))
    return cases


# -- core/cumsum (test_cumsum.py, test_cumsum_fast) ----------------------------------------------
def _cumsum_cases() -> list[Case]:
    cases = []
    for batch, hidden, ndim, seq, dt in [(1, 256, 2, 1, F32), (64, 1024, 3, 4, BF16),
                                         (128, 2048, 2, 1, F32)]:
        shape = (batch, seq, hidden) if ndim == 3 else (batch, hidden)
        cases.append(Case(
            kernel="core/cumsum", name=f"{ndim}-D {_dt_name(dt)}", shapes=f"x[{','.join(map(str, shape))}]",
            entry=f"{LIB}.cumsum:cumsum", reference=f"{LIB}.cumsum.cumsum_torch:cumsum_torch_ref",
            inputs=lambda shape=shape, dt=dt: {"x": _randn(42, shape, dtype=dt)[0]},
            outputs=("output_0",), lnc=2,  # CompilerArgs() on trn2: LNC 2
            rtol=1e-2 if dt == BF16 else 1e-3, atol=1e-2 if hidden > 5000 else 1e-3,
            test_file=f"{TESTS}/cumsum/test_cumsum.py"))
    return cases


# -- core/subkernels rmsnorm_tkg / layernorm_tkg -------------------------------------------------
def _norm_inputs(b: int, s: int, h: int, extra: dict[str, Any], beta: bool) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        out = {"input": np.random.randn(b, s, h).astype(F16),
               "gamma": np.random.randn(1, h).astype(F16),
               "output": np.zeros((128, b * s, h // 128), dtype=F16)}
        if beta:
            out["beta"] = np.random.randn(1, h).astype(F16)
        out.update(extra)
        return out
    return make


# lnc, batch, seqlen, hidden, hidden_actual, hidden_dim_tp, shard_on_h: all 27 rows of RMSNORM_TKG_TEST_CASES (fp16)
_RMSNORM_TKG = [
    (1, 1, 1, 8192, None, False, False), (1, 1, 8, 8192, None, False, False), (1, 1, 1, 4096, 3072, False, False),
    (1, 1, 4, 2048, 2048, False, False), (1, 1, 4, 2048, 1920, False, False), (2, 1, 1, 5120, None, False, False),
    (2, 1, 1, 8192, None, False, False), (2, 2, 8, 8192, None, False, False), (2, 4, 8, 8192, None, False, False),
    (2, 128, 1, 8192, None, False, False), (2, 4, 1, 5120, None, False, False), (2, 128, 5, 3072, None, False, False),
    (2, 256, 5, 3072, None, False, False), (2, 63, 32, 3072, None, False, False),
    (2, 1, 1, 16384, None, False, False), (2, 1, 1, 4096, 3072, False, False), (2, 2, 8, 16384, None, False, False),
    (2, 2, 8, 3072, 2880, False, False), (1, 1, 1, 4096, 3072, True, False), (2, 1, 1, 5120, None, True, False),
    (2, 128, 1, 8192, None, True, False), (2, 2, 8, 3072, 2880, True, False), (2, 1, 1, 8192, None, False, True),
    (2, 2, 8, 8192, None, False, True), (2, 1, 1, 5120, None, False, True), (2, 4, 1, 3072, None, False, True),
    (2, 1, 1, 16384, None, False, True)]
# lnc, batch, seqlen, hidden, shard_on_h: all 19 rows of LAYERNORM_TKG_TEST_CASES (fp16)
_LAYERNORM_TKG = [
    (1, 1, 1, 8192, False), (1, 1, 8, 8192, False), (2, 1, 1, 5120, False), (2, 1, 1, 8192, False),
    (2, 2, 8, 8192, False), (2, 4, 8, 8192, False), (2, 128, 1, 8192, False), (2, 128, 1, 8192, True),
    (2, 4, 1, 5120, False), (2, 128, 5, 3072, False), (2, 256, 5, 3072, False), (2, 63, 32, 3072, False),
    (2, 1, 1, 16384, False), (2, 2, 5, 16384, False), (2, 1, 1, 8192, True), (2, 2, 8, 8192, True),
    (2, 1, 1, 5120, True), (2, 4, 1, 3072, True), (2, 1, 1, 16384, True)]


def _rmsnorm_cases() -> list[Case]:
    cases = []
    for lnc, b, s, h, actual, tp, shard in _RMSNORM_TKG:
        ref = "rmsnorm_tkg_torch_ref" if lnc == 2 and not tp else "rmsnorm_tkg_torch_ref_lnc1"
        name = "rmsnorm" + (f" hidden_actual={actual}" if actual else "") + (" hidden_dim_tp" if tp else "") \
            + (" shard_on_h" if shard else "")
        cases.append(Case(
            kernel="core/subkernels/rmsnorm_tkg", name=name, shapes=f"x[{b},{s},{h}] fp16",
            entry=f"{LIB}.subkernels.rmsnorm_tkg:rmsnorm_tkg",
            reference=f"{LIB}.subkernels.rmsnorm_torch:{ref}",
            inputs=_norm_inputs(b, s, h, {"hidden_actual": actual, "hidden_dim_tp": tp,
                                          "shard_on_h": shard}, beta=False),
            outputs=("out",), lnc=lnc, rtol=2e-2, atol=1e-5,
            test_file=f"{TESTS}/subkernels/test_rmsnorm_tkg.py"))
    return cases


def _layernorm_cases() -> list[Case]:
    cases = []
    for lnc, b, s, h, shard in _LAYERNORM_TKG:
        ref = "layernorm_tkg_torch_ref" if lnc == 2 or shard else "layernorm_tkg_torch_ref_lnc1"
        cases.append(Case(
            kernel="core/subkernels/layernorm_tkg", name="layernorm" + (" shard_on_h" if shard else ""),
            shapes=f"x[{b},{s},{h}] fp16", entry=f"{LIB}.subkernels.layernorm_tkg:layernorm_tkg",
            reference=f"{LIB}.subkernels.layernorm_torch:{ref}",
            inputs=_norm_inputs(b, s, h, {"shard_on_h": shard}, beta=True),
            outputs=("out",), lnc=lnc, rtol=2e-2, atol=1e-5,
            test_file=f"{TESTS}/subkernels/test_layernorm_tkg.py"))
    return cases


# -- core/max/cascaded_max (test_cascaded_max.py, test_cascaded_max_unit) -----------------------
# lnc, batch, seqlen, vocab: all 28 rows of cascaded_max_unit_perms (fp32)
_CASCADED_MAX = [
    (1, 8, 5, 4058), (2, 8, 5, 4058), (1, 4, 5, 4058), (2, 5, 5, 4058), (1, 4, 5, 8192), (1, 8, 5, 8192),
    (2, 8, 5, 8192), (2, 5, 5, 8192), (1, 1, 1, 3168), (2, 1, 1, 3168), (2, 1, 1, 256), (2, 1, 1, 16000),
    (2, 3, 1, 3168), (2, 7, 1, 3168), (2, 8, 1, 3168), (2, 10, 1, 3168), (2, 16, 1, 3168), (2, 32, 1, 3168),
    (2, 63, 1, 3168), (2, 65, 1, 3168), (2, 99, 1, 3168), (2, 128, 1, 3168), (2, 256, 1, 3168), (2, 1, 1, 3168),
    (1, 1, 7, 3999), (1, 1, 63, 3999), (2, 1, 127, 3999), (1, 1, 127, 3999)]


def _cascaded_max_cases() -> list[Case]:
    cases = []
    for lnc, b, s, v in dict.fromkeys(_CASCADED_MAX):  # the table lists [2, 1, 1, 3168] twice: it runs once
        cases.append(Case(
            kernel="core/max/cascaded_max", name="max fp32", shapes=f"x[{b},{s},{v}]",
            entry=f"{LIB}.max.cascaded_max:cascaded_max",
            reference=f"{LIB}.max.cascaded_max_torch:cascaded_max_torch_ref",
            inputs=lambda b=b, s=s, v=v: {"input_tensor": _randn(42, (b, s, v), dtype=F32)[0]},
            outputs=("max_values", "max_indices"), lnc=lnc, rtol=1e-5, atol=1e-5,
            test_file=f"{TESTS}/max/test_cascaded_max.py"))
    return cases


# -- core/topk rotational_topk (test_topk.py) ----------------------------------------------------
def _topk_inputs(lnc: int, b: int, s: int, v: int, k: int, dt: np.dtype, is_sorted: bool
                 ) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        inp = _randn(42, (b * s, v), dtype=dt)[0]
        topk_config = _lib("topk.rotational_topk:create_topk_config")(
            inp_shape=(b, s, v), inp_dtype=dt, k=k, sorted=is_sorted, num_programs=lnc)
        config = _lib("topk.rotational_topk:create_rotational_topk_config")(
            inp_shape=(topk_config.BxS, topk_config.vocab_size), topk_config=topk_config)
        config = _lib("topk.rotational_topk:prepare_rotational_constants")(config)
        return {"inp": inp, "config": config}
    return make


def _topk_compare(inputs: dict, actual: dict, expected: dict) -> tuple[dict, dict]:
    """test_topk.py's validators: the sorted values against the sorted reference values, and the
    input values the returned indices point at (sorted) against them too (ties may pick other
    indices)."""
    ref_sorted = np.sort(expected["topk_values"].astype(np.float32), axis=-1)
    idx = np.asarray(actual["topk_indices"]).astype(np.int64)
    picked = np.take_along_axis(inputs["inp"].astype(np.float32), idx, axis=-1)
    return ({"topk_values": np.sort(np.asarray(actual["topk_values"], np.float32), axis=-1),
             "topk_indices": np.sort(picked, axis=-1)},
            {"topk_values": ref_sorted, "topk_indices": ref_sorted})


# lnc, batch, seqlen, vocab, K, dtype, sorted: all 45 rows of topk_unit_perms and the 3 of large_batch_perms
# (test_topk_unit runs both), then the 3 of topk_unsorted_perms
_TOPK = [(lnc, b, s, v, k, dt, True) for lnc, b, s, v, k, dt in (
    (2, 8, 5, 4058, 256, F32), (2, 5, 5, 4058, 256, F32), (1, 4, 5, 8192, 256, F32), (1, 8, 5, 8192, 256, F32),
    (2, 8, 5, 8192, 256, F32), (2, 5, 5, 8192, 256, F32), (2, 1, 1, 3168, 256, F32), (2, 1, 1, 16000, 256, F32),
    (2, 3, 1, 3168, 256, F32), (2, 7, 1, 3168, 256, F32), (2, 8, 1, 3168, 256, F32), (2, 10, 1, 3168, 256, F32),
    (2, 16, 1, 3168, 256, F32), (2, 32, 1, 3168, 256, F32), (2, 63, 1, 3168, 256, F32),
    (2, 65, 1, 3168, 256, F32), (2, 99, 1, 3168, 256, F32), (2, 128, 1, 3168, 256, F32),
    (2, 256, 1, 3168, 256, F32), (2, 1, 1, 3168, 8, F32), (2, 1, 1, 3168, 64, F32), (2, 1, 1, 3168, 192, F32),
    (2, 1, 1, 3168, 1, F32), (2, 1, 1, 3168, 7, F32), (2, 1, 1, 3168, 60, F32), (2, 1, 1, 3168, 99, F32),
    (1, 1, 7, 3999, 256, F32), (1, 1, 63, 3999, 20, F32), (2, 1, 127, 3999, 256, F32), (2, 1, 127, 3999, 1, F32),
    (1, 1, 127, 3999, 20, F32), (2, 1, 1, 3168, 256, BF16), (2, 8, 5, 4058, 256, BF16),
    (2, 1, 1, 16000, 256, BF16), (2, 32, 1, 3168, 256, BF16), (2, 1, 1, 25600, 256, F32),
    (2, 8, 1, 25600, 256, F32), (2, 1, 1, 2048, 256, F32), (2, 1, 1, 8192, 2048, F32), (2, 8, 1, 8192, 2048, F32),
    (1, 4, 5, 8192, 2048, F32), (2, 1, 1, 25600, 2048, F32), (2, 2, 1, 151936, 256, F32),
    (2, 1024, 1, 8192, 2048, F32), (2, 1024, 1, 3568, 2048, F32),
    (2, 150, 1, 1000, 50, F32), (2, 200, 1, 2000, 64, F32), (2, 1024, 1, 5000, 128, F32))] \
    + [(2, 1, 1, 25136, 256, F32, False), (2, 8, 5, 4058, 256, F32, False), (2, 5, 5, 4058, 256, F32, False)]


def _topk_cases() -> list[Case]:
    cases = []
    # k = 2,048 over 1,024 rows: _topk_rotated_core's rotated tiles are [P, 1024] fp32 in PSUM, two banks, each
    # written by one matmul per bank (the multi-bank rule, docs/interpreter.md "Memory and hardware rules")
    for lnc, b, s, v, k, dt, srt in _TOPK:
        cases.append(Case(
            kernel="core/topk", name=f"rotational k={k} {_dt_name(dt)}" + ("" if srt else " unsorted"),
            shapes=f"x[{b}x{s},{v}]", entry=f"{LIB}.topk.rotational_topk:rotational_topk",
            reference=f"{LIB}.topk.torch_ref:topk_torch_ref",
            inputs=_topk_inputs(lnc, b, s, v, k, dt, srt), outputs=("topk_values", "topk_indices"),
            lnc=lnc, rtol=1e-5, atol=1e-8,  # the validators' maxAllClose defaults
            postprocess=_topk_compare, cleanup=f"{LIB}.topk.rotational_topk:cleanup_rotational_constants",
            test_file=f"{TESTS}/topk/test_topk.py"))
    return cases


# -- core/router_topk (test_router_topk.py) -------------------------------------------------------
def _router_tensor(shape: tuple[int, ...]) -> np.ndarray:
    """Uniform in [-0.1, 0.1) from a torch generator seeded 0, cast to bf16 (the test's generator)."""
    import torch

    g = torch.Generator()
    g.manual_seed(0)
    return torch.empty(shape, dtype=torch.float32).uniform_(-0.1, 0.1, generator=g).numpy().astype(BF16)


def _router_wrapper(router_topk: Callable[..., Any]) -> Callable[..., Any]:
    """The test's SBUF I/O wrapper: x optionally loaded to SBUF first, outputs optionally in SBUF
    (copied back to HBM afterwards); returns the three outputs."""
    import nki.isa as nisa  # the interpreter, inside nki_is_interpreter
    import nki.language as nl

    x_load = _lib("router_topk.router_topk:router_topk_input_x_load")

    def wrapper(x, w, w_bias, router_logits, expert_affinities, expert_index, act_fn, k, x_hbm_layout,
                x_sb_layout, output_in_sbuf=False, x_input_in_sbuf=False, **options):
        x_in = x_load(x, hbm_layout=1, sb_layout=x_sb_layout) if x_input_in_sbuf else x
        idx, aff = expert_index, expert_affinities
        if output_in_sbuf:
            t, e = expert_affinities.shape
            idx = nl.ndarray((t, k), dtype=nl.uint32, buffer=nl.sbuf)
            aff = nl.ndarray((t, e), dtype=nl.float32, buffer=nl.sbuf)
        router_topk(x=x_in, w=w, w_bias=w_bias, router_logits=router_logits, expert_affinities=aff,
                    expert_index=idx, act_fn=act_fn, k=k, x_hbm_layout=x_hbm_layout,
                    x_sb_layout=x_sb_layout, **options)
        if output_in_sbuf:
            nisa.dma_copy(src=idx, dst=expert_index)
            nisa.dma_copy(src=aff, dst=expert_affinities)
        return [router_logits, expert_index, expert_affinities]
    return wrapper


# every flag the test passes explicitly (its rows name each one; the kernel's own defaults differ)
_ROUTER_FLAGS = dict.fromkeys(("router_pre_norm", "norm_topk_prob", "use_column_tiling", "use_indirect_dma_scatter",
                               "use_PE_broadcast_w_bias", "shard_on_tokens", "output_in_sbuf"), False)


def _router_inputs(t: int, h: int, e: int, k: int, act: str, bias: bool, options: dict[str, Any],
                   x_in_sb: bool, x_hbm_layout: int, x_sb_layout: int) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        act_fn = getattr(_lib("utils.common_types:RouterActFnType"), act)
        out_sb = options.get("output_in_sbuf", False)
        x_shape = (t, h) if (x_in_sb or x_hbm_layout == 1) else (h, t)
        return {"x": _router_tensor(x_shape), "w": _router_tensor((h, e)),
                "w_bias": _router_tensor((1, e)) if bias else None,
                "router_logits": np.zeros((t, e), dtype=BF16),
                "expert_affinities": np.zeros((t, e), dtype=F32 if out_sb else BF16),
                "expert_index": np.zeros((t, k), dtype=np.uint32), "act_fn": act_fn, "k": k,
                "x_hbm_layout": x_hbm_layout, "x_sb_layout": x_sb_layout,
                "x_input_in_sbuf": x_in_sb, **_ROUTER_FLAGS, **options}
    return make


def _router_ref_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k != "output_in_sbuf"}


# base_configs of test_router_topk.py (all 50; the gptoss_120b row repeats the T=32 basic row and runs once):
# T, H, E, k, act, bias, the flags set
_ROUTER_BASE = [
    *[(t, 3072, 128, 4, "SOFTMAX", True, ()) for t in (4, 16, 32, 64, 128)],
    (4, 3072, 128, 4, "SOFTMAX", False, ()), (4, 3072, 128, 4, "SOFTMAX", True, ("use_PE_broadcast_w_bias",)),
    (4, 3072, 256, 4, "SOFTMAX", True, ()),
    *[(t, 3072, 128, 4, "SOFTMAX", True, ()) for t in (640, 1024, 320)],
    *[(t, 3072, 128, 4, "SOFTMAX", True, ("shard_on_tokens",)) for t in (48, 80, 96, 160, 192, 320, 640)],
    (16, 3072, 128, 4, "SOFTMAX", True, ("use_column_tiling",)),
    *[(t, 3072, 128, 4, "SOFTMAX", True, ("use_indirect_dma_scatter",)) for t in (4, 640)],
    (8, 8192, 128, 8, "SIGMOID", True, ("use_indirect_dma_scatter",)),
    *[(t, 8192, 128, 8, "SOFTMAX", True, ("router_pre_norm", "use_indirect_dma_scatter")) for t in (8, 640, 1024)],
    (8, 8192, 128, 8, "SIGMOID", True, ("router_pre_norm", "use_indirect_dma_scatter")),
    *[(8, 8192, 128, 8, act, True, ("router_pre_norm", "norm_topk_prob", "use_indirect_dma_scatter"))
      for act in ("SOFTMAX", "SIGMOID")],
    *[(t, 3072, 128, 4, "SOFTMAX", True, ("router_pre_norm",)) for t in (8, 32, 64)],
    *[(t, 3072, 128, 4, "SOFTMAX", True, ("router_pre_norm", "norm_topk_prob")) for t in (8, 32)],
    (4, 3072, 128, 1, "SOFTMAX", False, ()),
    (32, 3072, 128, 4, "SOFTMAX", True, ()), (32, 3072, 128, 4, "SOFTMAX", True, ("router_pre_norm",
                                                                                 "use_indirect_dma_scatter")),
    *[(2, h, e, k, "SOFTMAX", False, flags) for h, e, k in ((4096, 128, 8), (5120, 128, 1), (5120, 16, 1))
      for flags in ((), ("router_pre_norm", "use_indirect_dma_scatter"))],
    (32, 256, 128, 4, "SIGMOID", True, ("use_column_tiling", "use_indirect_dma_scatter")),
    *[(t, 512, 128, 4, "SOFTMAX", False, ("shard_on_tokens", "output_in_sbuf")) for t in (2, 4, 5, 8, 32, 64, 128)],
]


def _router_rows() -> list[tuple]:
    """Each base config under the layouts test_router_topk runs (x in HBM as [H, T] or [T, H]; x in SBUF in
    each of the three SBUF layouts) but the ones it skips: T per core above 128 and not a multiple of 128
    with the indirect-DMA scatter, output in SBUF with T above 128."""
    rows = []
    for t, h, e, k, act, bias, flags in dict.fromkeys(_ROUTER_BASE):
        t_local = t // 2 if "shard_on_tokens" in flags else t
        if (t_local > 128 and t_local % 128 and "use_indirect_dma_scatter" in flags) \
                or ("output_in_sbuf" in flags and t > 128):
            continue
        opts = dict.fromkeys(flags, True)
        rows += [(t, h, e, k, act, bias, opts, False, 0, xhbm) for xhbm in (0, 1)]
        rows += [(t, h, e, k, act, bias, opts, True, xsbl, 0) for xsbl in (0, 1, 2)]
    return rows


def _router_cases() -> list[Case]:
    cases = []
    for t, h, e, k, act, bias, opts, x_in_sb, xsbl, xhbm in _router_rows():
        flags = [n for n, v in opts.items() if v] + ([f"x in SBUF layout {xsbl}"] if x_in_sb else []) \
            + (["x [T,H]"] if xhbm else [])
        name = f"{act.lower()}{' bias' if bias else ''} k={k}" + (f" {' '.join(flags)}" if flags else "")
        cases.append(Case(
            kernel="core/router_topk", name=name, shapes=f"x[{t},{h}] w[{h},{e}]",
            entry=f"{LIB}.router_topk.router_topk:router_topk", wrap_kernel=_router_wrapper,
            reference=f"{LIB}.router_topk.router_topk_torch:router_topk_torch_ref",
            ref_inputs=_router_ref_inputs,
            inputs=_router_inputs(t, h, e, k, act, bias, opts, x_in_sb, xhbm, xsbl),
            outputs=("router_logits", "expert_index", "expert_affinities"), lnc=2,
            rtol=2e-2, atol=1e-5, test_file=f"{TESTS}/router_topk/test_router_topk.py"))
    return cases


# -- core/moe/moe_cte (test_moe_cte.py, test_moe_cte_common.py) ---------------------------------
class BWMMFunc(enum.Enum):
    """The kernel variants of nki-library's MoE CTE test (same names and values).

    nki-library's own torch reference (``moe_cte_torch.moe_cte_torch_ref``) imports this enum from
    its test package (``test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common``), which needs
    nki-library's test infrastructure; :func:`_moe_test_enum` serves this one instead.
    """

    SHARD_ON_BLOCK = 1
    SHARD_ON_HIDDEN = 2
    SHARD_ON_INTERMEDIATE = 3
    SHARD_ON_INTERMEDIATE_AFFINITY_ON_INTERMEDIATE = 4
    SHARD_ON_INTERMEDIATE_HW = 5
    SHARD_ON_INTERMEDIATE_DROPPING = 6


_MOE_ENTRY = {BWMMFunc.SHARD_ON_BLOCK: "moe.moe_cte.bwmm_shard_on_block:bwmm_shard_on_block",
              BWMMFunc.SHARD_ON_INTERMEDIATE:
                  "moe.moe_cte.bwmm_shard_on_I:blockwise_mm_baseline_shard_intermediate",
              BWMMFunc.SHARD_ON_INTERMEDIATE_HW:
                  "moe.moe_cte.bwmm_shard_on_I:blockwise_mm_baseline_shard_intermediate_hybrid",
              BWMMFunc.SHARD_ON_INTERMEDIATE_DROPPING:
                  "moe.moe_cte.bwmm_shard_on_I:blockwise_mm_shard_intermediate_dropping"}


def _moe_test_enum() -> None:
    """Make ``test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common.BWMMFunc`` importable."""
    name = "test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sys.modules.get(sub) is None or not hasattr(sys.modules[sub], "__path__"):
            mod = types.ModuleType(sub)
            mod.__path__ = []  # a package, so the next level imports from sys.modules
            sys.modules[sub] = mod
    sys.modules[name].BWMMFunc = BWMMFunc


def _moe_blocks(t: int, top_k: int, e: int, b: int, per_iter: int) -> int:
    """Blocks the dispatch needs in the worst case (rounded up to ``per_iter``), as the test sizes it."""
    n = math.ceil((t * top_k - (e - 1)) / b) + e - 1
    return per_iter * math.ceil(n / per_iter)


def _moe_dispatch(t: int, top_k: int, e: int, b: int, n: int, skip_token: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Routing and block metadata like the test's: each token picks ``min(top_k, e)`` distinct experts
    at random (seed 0); experts get ceil(tokens / b) blocks in expert order, the padding blocks go to
    the last expert. Returns (token x expert mask, token id per block slot (-1 or t when empty),
    expert per block, dynamic-loop conditions)."""
    np.random.seed(0)
    k = min(top_k, e)
    mask = np.zeros((t, e))
    for i in range(t):
        mask[i, np.random.choice(range(e), k, replace=False)] = 1
    blocks = np.ceil(mask.sum(0) / b).astype(np.int32)
    padding = n - int(blocks.sum())
    blocks[e - 1] += padding
    block_to_expert = np.arange(e).repeat(blocks).astype(np.int32)
    first_slot = np.concatenate([[0], np.cumsum(blocks)[:-1]]) * b  # expert's first block slot
    slot_of = (np.cumsum(mask, axis=0) - 1 + first_slot).astype(np.int64)  # rank within the expert
    token_of_slot = np.full(n * b, -1 if skip_token else t, dtype=np.int32)
    rows, experts = np.nonzero(mask)
    token_of_slot[slot_of[rows, experts]] = rows
    conditions = np.ones(n + 1, dtype=np.int32)
    conditions[-(padding + 1):] = 0
    return mask, token_of_slot, block_to_expert, conditions


def _moe_dropping_dispatch(t: int, top_k: int, e: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Routing of the dropping kernel's test (one block per expert, every token may go to any expert):
    each expert in turn takes ``b`` distinct tokens at random among those picked fewer than ``top_k``
    times so far (all that are left when fewer remain; the rest of its block is token ``t``, the zero
    row). Returns (token x expert mask: all ones, as the test's, token id per block slot, expert per
    block). The test draws from numpy's global generator unseeded; this draws after seed 0."""
    np.random.seed(0)
    uses = np.zeros(t, dtype=np.int32)
    token_of_slot = np.full(e * b, t, dtype=np.int32)
    for expert in range(e):
        free = np.flatnonzero(uses < top_k)
        chosen = np.random.choice(free, b, replace=False) if len(free) >= b else free
        uses[chosen] += 1
        token_of_slot[expert * b:expert * b + len(chosen)] = chosen
    return np.ones((t, e)), token_of_slot, np.arange(e, dtype=np.int32)


def _moe_inputs(func: BWMMFunc, t: int, h: int, e: int, b: int, top_k: int, i_size: int, skip: int,
                bias: bool, training: bool, act: str, clamps: tuple, lnc: int, multiply_on_i: bool = False,
                fp8: bool = False, scaling: str = "POST_SCALE") -> Callable[[], dict[str, Any]]:
    """The test's ``build_bwmm_inputs`` draws. ``fp8``: its ``quantize=nl.float8_e4m3`` (scale strategy 6),
    integer weights drawn in [-240, 240) and cast to fp8 e4m3, then fp32 dequantization scales per expert and
    column ([E, 1, 2I] gate/up, [E, 1, H] down) uniform(-0.1, 0.1). ``scaling``: the ExpertAffinityScaleMode."""
    def make() -> dict[str, Any]:
        skip_mode = _lib("moe.moe_cte.moe_cte_utils:SkipMode")(skip in (1, 3), skip in (2, 3))
        if func is BWMMFunc.SHARD_ON_INTERMEDIATE_DROPPING:
            mask, token_of_slot, block_to_expert = _moe_dropping_dispatch(t, top_k, e, b)
        else:
            n = _moe_blocks(t, top_k, e, b, lnc if func is BWMMFunc.SHARD_ON_BLOCK else 1)
            mask, token_of_slot, block_to_expert, conditions = _moe_dispatch(t, top_k, e, b, n,
                                                                             skip_mode.skip_token)
        np.random.seed(0)
        rows = t if skip_mode.skip_token else t + 1  # without token skipping: one zero row at t
        affinities = np.random.random_sample([rows, e]).astype(BF16)
        hidden = np.random.random_sample([rows, h]).astype(BF16)
        affinities[:t] = affinities[:t] * mask.astype(BF16)
        affinities[t:] = 0
        hidden[t:] = 0
        out = {}
        if bias:
            out["down_proj_bias"] = np.random.uniform(-1.632, 1.4375, size=[e, h]).astype(BF16)
            out["gate_and_up_proj_bias"] = np.random.uniform(-1, 1, size=[e, 2, i_size]).astype(BF16)
        i_padded = math.ceil(i_size / 16) * 16
        if fp8:
            down = np.random.randint(-240, 240, size=[e, i_padded, h]).astype(FP8)
            gate_up = np.random.randint(-240, 240, size=[e, h, 2, i_size]).astype(FP8)
            out["gate_up_proj_scale"] = np.random.uniform(-0.1, 0.1, size=[e, 1, 2 * i_size]).astype(F32)
            out["down_proj_scale"] = np.random.uniform(-0.1, 0.1, size=[e, 1, h]).astype(F32)
        else:
            down = uniform_array(-0.1, 0.1, [e, i_padded, h], BF16)
            gate_up = uniform_array(-0.1, 0.1, [e, h, 2, i_size], BF16)
        common_types = "utils.common_types"
        out.update({
            "hidden_states": hidden, "expert_affinities_masked": affinities.reshape(-1, 1),
            "gate_up_proj_weight": gate_up, "down_proj_weight": down,
            "token_position_to_id": token_of_slot, "block_to_expert": block_to_expert, "block_size": b,
            "skip_dma": skip_mode, "compute_dtype": BF16, "is_tensor_update_accumulating": top_k != 1,
            "expert_affinities_scaling_mode": getattr(_lib(f"{common_types}:ExpertAffinityScaleMode"), scaling),
            "activation_function": getattr(_lib(f"{common_types}:ActFnType"), act)})
        for key, v in zip(("gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit",
                           "up_clamp_lower_limit"), clamps):
            if v is not None:
                out[key] = v
        out.update(_moe_flags(func, training, multiply_on_i))
        if func is BWMMFunc.SHARD_ON_INTERMEDIATE_HW:
            out["conditions"] = conditions
        return out
    return make


def _moe_flags(func: BWMMFunc, training: bool, multiply_on_i: bool) -> dict[str, bool]:
    """The kernel's activation-checkpoint flags (shard_on_I kernels only)."""
    if func is BWMMFunc.SHARD_ON_INTERMEDIATE:
        return {"checkpoint_activation": training, "expert_affinity_multiply_on_I": multiply_on_i}
    if func is BWMMFunc.SHARD_ON_INTERMEDIATE_DROPPING:  # checkpoints always, takes no flag for it
        return {"expert_affinity_multiply_on_I": multiply_on_i}
    return {}


def _moe_unified_inputs(func: BWMMFunc, training: bool, multiply_on_i: bool,
                        kernel_inputs: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """The unified entry point's arguments (test_moe_cte_unified.py's ``build_moe_cte_unified_inputs``: the same
    draws as ``kernel_inputs``): the checkpoint flags go into the spec's ``ShardOnIConfig`` (default for the
    hybrid kernel, as the test's), ``ShardOnBlockConfig()`` for shard_on_block (its rows are not quantized)."""
    def make() -> dict[str, Any]:
        inputs = kernel_inputs()
        for key in _moe_flags(func, training, multiply_on_i):
            del inputs[key]
        module = "moe.moe_cte.moe_cte"
        impl = {BWMMFunc.SHARD_ON_BLOCK: "shard_on_block", BWMMFunc.SHARD_ON_INTERMEDIATE: "shard_on_i",
                BWMMFunc.SHARD_ON_INTERMEDIATE_HW: "shard_on_i_hybrid",
                BWMMFunc.SHARD_ON_INTERMEDIATE_DROPPING: "shard_on_i_dropping"}[func]
        config = {}
        if func is BWMMFunc.SHARD_ON_BLOCK:
            config["shard_on_block"] = _lib(f"{module}:ShardOnBlockConfig")()
        elif func is BWMMFunc.SHARD_ON_INTERMEDIATE_HW:
            config["shard_on_I"] = _lib(f"{module}:ShardOnIConfig")()
        else:
            config["shard_on_I"] = _lib(f"{module}:ShardOnIConfig")(
                checkpoint_activation=training, expert_affinity_multiply_on_I=multiply_on_i)
        inputs["spec"] = _lib(f"{module}:MoECTESpec")(
            implementation=getattr(_lib(f"{module}:MoECTEImplementation"), impl), **config)
        return inputs
    return make


def _moe_ref_inputs(func: BWMMFunc, lnc: int, top_k: int, unified_flags: dict[str, bool] | None = None
                    ) -> Callable[[dict], dict]:
    """``moe_cte_torch_ref``'s arguments; ``unified_flags``: the kernel's checkpoint flags, for the unified
    entry point's arguments (its spec taken apart again)."""
    def ref_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
        _moe_test_enum()
        if unified_flags is not None:
            inputs = {k: v for k, v in inputs.items() if k != "spec"} | unified_flags
        return {**inputs, "bwmm_func": func, "lnc_degree": lnc, "top_k": top_k}
    return ref_inputs


# rows of test_moe_cte.py's BWMM_LNC2_TEST_CASES (func, H, T, E, B, top_k, I, skip, bias, training, activation,
# clamps, expert_affinity_multiply_on_I): 35 of its 48 enabled rows at their shapes (its fp8 row is
# _MOE_FP8_ROW), covering each kernel path its table tests
# (shard_on_block with token / weight skipping and I up to 3072, shard_on_I with bias, with activation
# checkpointing and with the affinity multiplied on I, at I=2048 and I=3072, and the dropping kernel). Its
# shard_on_I rows at I=3072 and its dropping rows fill more PSUM tiles than PSUM holds before reading any: they
# run because each read may move up to its tile's last matmul (docs/interpreter.md, "Memory and hardware
# rules"). Its T=10240 shard_on_I and hybrid rows (83-87 blocks) take about two minutes each here. Its 12 E=64
# rows are _MOE_E64_ROWS.
_CLAMP, _NO_CLAMP = (7, None, 8, -9), (None, None, None, None)
_B, _I, _HW = BWMMFunc.SHARD_ON_BLOCK, BWMMFunc.SHARD_ON_INTERMEDIATE, BWMMFunc.SHARD_ON_INTERMEDIATE_HW
_D = BWMMFunc.SHARD_ON_INTERMEDIATE_DROPPING
_MOE_ROWS = [
    (_B, 3072, 1024, 8, 512, 4, 384, 1, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 512, 4, 192, 1, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 256, 4, 384, 1, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 256, 4, 192, 3, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 256, 4, 1536, 1, True, False, "Swish", _CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 2048, 0, True, False, "SiLU", _NO_CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 2048, 1, False, True, "Swish", _NO_CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 2048, 0, False, True, "Swish", _NO_CLAMP, True),
    (_B, 3072, 1024, 8, 512, 4, 384, 3, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 512, 4, 3072, 1, True, False, "Swish", _CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 2048, 0, True, False, "Swish", _NO_CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 2048, 1, True, False, "Swish", _NO_CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 2048, 0, False, True, "Swish", _NO_CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 2048, 1, False, True, "Swish", _NO_CLAMP, True),
    (_B, 3072, 1024, 8, 256, 4, 192, 1, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 512, 4, 192, 3, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 256, 4, 384, 3, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 512, 4, 1536, 1, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 1024, 8, 256, 4, 3072, 1, True, False, "Swish", _CLAMP, False),
    (_B, 3072, 10240, 128, 256, 4, 192, 3, True, False, "Swish", _CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 3072, 0, True, False, "Swish", _NO_CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 3072, 1, True, False, "Swish", _NO_CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 3072, 0, False, True, "Swish", _NO_CLAMP, True),
    (_I, 3072, 1024, 8, 512, 4, 3072, 1, False, True, "Swish", _NO_CLAMP, True),
    (_I, 3072, 1024, 8, 512, 4, 3072, 0, False, True, "Swish", _NO_CLAMP, False),
    (_I, 3072, 1024, 8, 512, 4, 3072, 1, False, True, "Swish", _NO_CLAMP, False),
    (_D, 1536, 8192, 2, 4096, 2, 6144, 0, False, True, "SiLU", _NO_CLAMP, True),
    (_D, 2048, 2048, 2, 1024, 2, 8192, 0, False, True, "SiLU", _NO_CLAMP, True),
    (_D, 4096, 4096, 2, 2048, 8, 1536, 0, False, True, "SiLU", _NO_CLAMP, True),
    (_D, 1536, 8192, 2, 4096, 2, 6144, 0, False, True, "SiLU", _NO_CLAMP, False),
    (_D, 2048, 2048, 2, 1024, 2, 8192, 0, False, True, "SiLU", _NO_CLAMP, False),
    (_D, 4096, 4096, 2, 2048, 8, 1536, 0, False, True, "SiLU", _NO_CLAMP, False),
    (_I, 3072, 10240, 8, 512, 4, 1536, 1, True, False, "Swish", (7, None, 7, -7), False),
    (_I, 4096, 10240, 4, 512, 8, 768, 1, False, False, "SiLU", _NO_CLAMP, False),
    (_HW, 4096, 10240, 4, 512, 8, 768, 1, False, False, "SiLU", _NO_CLAMP, False),
]
# one of the hybrid rows the test lists commented out, with its NO_SCALE (its enabled hybrid row, T=10240, is in
# _MOE_ROWS)
_MOE_REDUCED = (_HW, 3072, 1024, 8, 512, 4, 2048, 0, False, False, "SiLU", _NO_CLAMP, False)
_MOE_REDUCED_NOTE = ("reduced shape: the test's hybrid row (T=10240 H=4096 E=4 k=8 I=768) takes minutes here; "
                     "this is a hybrid row it lists commented out")


# The test's 12 E=64 top-8 rows (T=1024, 79 blocks; 2.4-3.6 GB of bf16 weights, E x H x 3I, and twice that as the
# reference's float32 copies, all kept on disk: harness.LARGE_ARRAY_BYTES). Those in _MOE_E64_AT_TEST_SHAPE
# (bias, training, multiply_on_I, skip, I) run at the test's shape (about 12 minutes each here); the others, not
# yet measured at it, at a reduced shape that takes the same kernel path (func, block size, top-k, H, I, skip,
# bias, training, activation, clamps, multiply_on_I).
_MOE_E64_AT_TEST_SHAPE = {(True, False, False, 0, 2048)}
_MOE_E64_NOTE = ("reduced shape: the test's row has T=1024 E=64 (79 blocks, 2.4-3.6 GB of bf16 weights); run "
                 "with T=256 E=16 (19 blocks), keeping its top-8 and its ~128 tokens per expert")
_MOE_E64_ROWS = [((_I, 3072, 1024, 64, 512, 8, i_size, skip, bias, training, "SiLU", _NO_CLAMP, on_i), "")
                 if (bias, training, on_i, skip, i_size) in _MOE_E64_AT_TEST_SHAPE else
                 ((_I, 3072, 256, 16, 512, 8, i_size, skip, bias, training, "SiLU", _NO_CLAMP, on_i), _MOE_E64_NOTE)
                 for bias, training, on_i in ((True, False, False), (False, True, True), (False, True, False))
                 for skip in (0, 1) for i_size in (2048, 3072)]
# The test's one fp8-weight row (quantize=nl.float8_e4m3, at its shape): the bf16 row before it in _MOE_ROWS with
# quantized gate/up and down weights and their scales, at the test's quantized tolerance (rtol 5e-2).
_MOE_FP8_ROW = (_I, 3072, 10240, 8, 512, 4, 1536, 1, True, False, "Swish", (7, None, 7, -7), False)


# test_moe_cte_unified.py's non-MX rows (moe_cte_test_params: func, H, T, E, B, top_k, I, skip, bias, training,
# activation, clamps, multiply_on_I; and the ExpertAffinityScaleMode), through the moe_cte() entry point and its
# MoECTESpec, all at their shapes. The test's golden (golden_bwmm, numpy) lives in its test package; these compare
# with nki-library's torch reference of the same kernels, as test_moe_cte.py does. Its MX row needs trn3.
_MOE_UNIFIED_ROWS = [
    ((_HW, 3072, 1024, 8, 512, 4, 2048, 0, False, False, "SiLU", _NO_CLAMP, False), "NO_SCALE"),
    ((_I, 3072, 1024, 8, 512, 4, 2048, 0, True, False, "SiLU", _NO_CLAMP, False), "POST_SCALE"),
    ((_B, 3072, 1024, 8, 512, 4, 384, 1, True, False, "Swish", _CLAMP, False), "POST_SCALE"),
    ((_D, 1536, 8192, 2, 4096, 2, 6144, 0, False, True, "SiLU", _NO_CLAMP, True), "POST_SCALE"),
]


def _moe_case(row: tuple, note: str = "", fp8: bool = False, scaling: str = "POST_SCALE",
              unified: bool = False) -> Case:
    """One moe_cte row (see _MOE_ROWS); ``unified``: through the moe_cte() entry point (test_moe_cte_unified.py)."""
    func, h, t, e, b, k, i_size, skip, bias, training, act, clamps, on_i = row
    outputs = ("output",) + (("gate_up_activations_T",) + ("down_activations",) * (not on_i)) * training
    flags = [f"skip={skip}"] + (["bias"] if bias else []) + (["training"] if training else []) \
        + (["clamp"] if clamps != _NO_CLAMP else []) + (["multiply_on_I"] if on_i else []) \
        + (["fp8 weights"] if fp8 else []) + ([scaling.lower()] if scaling != "POST_SCALE" else [])
    inputs = _moe_inputs(func, t, h, e, b, k, i_size, skip, bias, training, act, clamps, 2, on_i, fp8, scaling)
    if unified:
        inputs = _moe_unified_inputs(func, training, on_i, inputs)
    return Case(
        kernel="core/moe/moe_cte", name=f"{'moe_cte() ' * unified}{func.name.lower()} {act} {' '.join(flags)}",
        shapes=f"T={t} H={h} E={e} B={b} k={k} I={i_size}",
        entry=f"{LIB}.{'moe.moe_cte.moe_cte:moe_cte' if unified else _MOE_ENTRY[func]}",
        reference=f"{LIB}.moe.moe_cte.moe_cte_torch:moe_cte_torch_ref", inputs=inputs,
        ref_inputs=_moe_ref_inputs(func, 2, k, _moe_flags(func, training, on_i) if unified else None),
        outputs=outputs, lnc=2, rtol=5e-2 if fp8 else 2e-2, atol=1e-5, note=note,
        test_file=f"{TESTS}/moe/moe_cte/test_moe_cte{'_unified' * unified}.py")


def _moe_cases() -> list[Case]:
    cases = [_moe_case(row) for row in _MOE_ROWS]
    return (cases[:7] + [_moe_case(_MOE_REDUCED, _MOE_REDUCED_NOTE, scaling="NO_SCALE")] + cases[7:]
            + [_moe_case(_MOE_FP8_ROW, FP8_NOTE, fp8=True)] + [_moe_case(row, note) for row, note in _MOE_E64_ROWS]
            + [_moe_case(row, scaling=scaling, unified=True) for row, scaling in _MOE_UNIFIED_ROWS])


def all_cases(root: Path | None = None) -> list[Case]:
    """Every conformance case, kernel by kernel, then the rows of the model-config tables of the checkout
    ``root`` (default :func:`harness.nkilib_root`; none without one), then the reduced ones (tier ``reduced``,
    :mod:`trnkit.conformance.reduce`)."""
    return (_rope_cases() + rope_cases() + _router_cases() + _cumsum_cases() + _rmsnorm_cases() + _layernorm_cases()
            + _topk_cases() + _cascaded_max_cases() + max_utils_cases() + _moe_cases() + conv_cases()
            + projection_cases()
            + attention_cases(root) + attention_tkg_cases() + mlp_cases() + mlp_quant_cases() + moe_block_cases()
            + loss_cases() + moe_tkg_cases()
            + qkv_cases() + qkv_quant_cases() + qkv_sb2sb_cases() + subkernel_cases() + utils_cases()
            + tensor_view_cases()
            + rmsnorm_quant_cases() + collective_cases() + moe_experimental_cases() + attention_block_cases()
            + transformer_tkg_cases() + dynamic_shapes_cases()
            + model_config_cases(root if root is not None else harness.nkilib_root())
            + reduced_cases(root if root is not None else harness.nkilib_root()))


# The fast tier (CI's `-m "not slow"` run): at least one case of every kernel, each a few seconds at
# most, covering LNC 1 and 2, a negative case, SBUF/HBM I/O variants and one MoE kernel with
# sequential PSUM accumulation groups. The rest runs in the slow tier.
FAST = (
    "core/embeddings/rope_hf|fwd cos/sin bf16|lnc2|q[1,32,256,128] k[1,8,256,128]",
    "core/embeddings/rope_hf|bwd packed cache fp32|lnc2|q[1,32,256,128] k[1,8,256,128]",
    "core/embeddings/rope_hf|fwd cos/sin fp32 (must reject)|lnc2|q[1,32,64,128] k[1,8,64,128]",
    "core/embeddings/rope|fast interleaved|lnc2|x[128,8,8,128] bf16",
    "core/embeddings/rope|sweep interleaved relayout_in_sbuf|lnc2|x[64,8,1,16] bf16",
    "core/embeddings/rope|sweep boundary contiguous relayout_in_sbuf (must reject)|lnc2|x[64,1,1,15] bf16",
    "core/router_topk|softmax bias k=4|lnc2|x[4,3072] w[3072,128]",
    "core/max/cascaded_max_utils|partial_batch fold=2 rows 0:7|lnc2|x[16,256]",
    "core/router_topk|softmax bias k=4 use_indirect_dma_scatter x [T,H]|lnc2|x[640,3072] w[3072,128]",
    "core/router_topk|softmax k=4 shard_on_tokens output_in_sbuf|lnc2|x[32,512] w[512,128]",
    "core/cumsum|3-D bf16|lnc2|x[64,4,1024]",
    "core/subkernels/rmsnorm_tkg|rmsnorm hidden_actual=1920|lnc1|x[1,4,2048] fp16",
    "core/subkernels/rmsnorm_tkg|rmsnorm shard_on_h|lnc2|x[2,8,8192] fp16",
    "core/subkernels/layernorm_tkg|layernorm|lnc2|x[4,8,8192] fp16",
    "core/topk|rotational k=256 fp32|lnc2|x[65x1,3168]",
    "core/max/cascaded_max|max fp32|lnc2|x[65,1,3168]",
    "core/moe/moe_cte|shard_on_block Swish skip=3 bias clamp|lnc2|T=1024 H=3072 E=8 B=256 k=4 I=192",
    "experimental/conv/conv1d|conv1d fp32 stride=2 pad=2,2 dilation=2 bias GELU|lnc2|x[2,64,40] w[5,64,128]",
    "experimental/conv/conv1d|conv1d bf16 bias SiLU|lnc2|x[1,16,20] w[3,16,32]",
    "experimental/conv/depthwise_conv1d|depthwise bf16 stride=2 pad=5,5|lnc2|img[1,256,1,512] k=64",
    "core/output_projection/tkg|bf16 bias TRANSPOSE_OUT|lnc2|B=4 heads=8 S=4 d=64 H=3072",
    "core/output_projection/tkg|bf16 bias TRANSPOSE_OUT (must reject)|lnc2|B=4 heads=10 S=8 d=128 H=602",
    "core/attention/attention_cte|apc bf16 causal tp_q tp_k tp_out prior=2048/1920|lnc2|bs=1/1 Sq=256 Skv=256 d=128",
    "core/attention/attention_cte|vnc fp32 tp_q|lnc2|bs=2/2 Sq=577 Skv=577 d=88",
    "core/attention/attention_bwd|packed bf16 seqs=128+384 causal sw=64|lnc1|b=1 heads=1/1 S=512 d=128",
    "core/attention/gen_mask_tkg_hbm|block_len=16 active_mask|lnc2|bs=8 q_head=8 s_prior=4096 s_active=5",
    "core/attention/gen_mask_tkg|block_len=16 active_mask batch 4 of 16|lnc2|bs=4 q_head=8 s_prior=4096 s_active=5",
    "core/attention/attention_tkg|bf16 tp_k_prior use_pos_id fuse_rope|lnc2"
    "|bs=4 q_head=2 s_active=7 s_prior=256/16384 d=128 block_len=0",
    "core/attention/attention_tkg|fp8_kv tp_k_prior qk_in_sb k_out_in_sb out_in_sb no_strided_mm1|lnc2"
    "|bs=4 q_head=8 s_active=7 s_prior=4096/10240 d=64 block_len=16",
    "core/qkv/qkv_tkg|accuracy bf16 rms_norm BSD qkv_bias|lnc2|B=8 S=5 H=3072 heads=8/1 d=64",
    "core/mlp/mlp_tkg|bf16 rms_norm gate_b up_b down_b gate_up_column_tiling down_column_tiling|lnc2"
    "|B=8 S=5 H=8192 I=512",
    "core/moe_block/moe_block_tkg|all experts Swish fp16 weights fp16 input bias clamp|lnc2"
    "|B=19 S=1 H=3072 I=128 E=128/1 k=4",
    "core/utils/cross_partition_copy|fp32 partitions 5..24 -> 28..47|lnc1|[128,8]",
    "core/utils/tp_broadcast|fp32 column 9 x 12 select 2|lnc1|[13,3,13]",
    "core/attention/attention_bwd|packed bf16 seqs=128+128 causal wrong_dtype (must reject)|lnc1"
    "|b=1 heads=1/1 S=256 d=128",
    "core/output_projection/cte|bf16 bias|lnc2|B=1 S=128 H=3072 heads=17 d=10",
    "core/output_projection/cte|bf16 x fp8 static bias|lnc2|B=1 S=128 H=3072 heads=8 d=32",
    "core/output_projection/tkg|bf16 x fp8 static|lnc2|B=8 heads=8 S=1 d=128 H=8192",
    "core/output_projection/tkg|bf16 x fp8 row TRANSPOSE_OUT|lnc2|B=16 heads=8 S=1 d=128 H=3072",
    "experimental/loss/cross_entropy_forward|switch_transformers_fast bfloat16 PB=1 CS=32128|lnc2|B=1 T=1 V=32128",
    "experimental/loss/cross_entropy_backward|switch_transformers_fast bfloat16 PB=1 CS=16384 mean|lnc2"
    "|B=1 T=1 V=32128",
    "core/moe/moe_tkg|all experts Swish post_scale clamp bias|lnc2|T=4 H=3072 I=192 E=4",
    "core/moe/moe_tkg|top-1 Swish post_scale clamp bias|lnc2|T=3 H=512 I=128 E=2",
    "core/qkv/qkv_cte|accuracy bf16 rms_norm BSD dma_transpose fused_add|lnc1|B=1 S=128 H=512 I=512",
    "core/qkv/qkv_cte|static_quantization bf16 x fp8 no_norm BSD qkv_bias|lnc2|B=1 S=128 H=8192 heads=8/1 d=128",
    "core/qkv/qkv_cte|block_kv_cache bf16 fp8 kv scale=1.67|lnc2|B=1 S=512 H=2048 heads=1/1 d=128 blocks=128x64",
    "core/qkv/qkv_tkg|accuracy bf16 x fp8 row rms_norm BSD fused_add|lnc2|B=1 S=3 H=8192 heads=8/1 d=128",
    "core/qkv/qkv_tkg|sb2sb fp16 x fp8 static rms_norm BSD|lnc2|B=1 S=5 H=8192 heads=8/1 d=128",
    "core/qkv/qkv_tkg|sb2sb fp16 no_norm NBSd|lnc2|B=1 S=1 H=8192 heads=2/2 d=128",
    "core/mlp/mlp_cte|fp8 row input x fp8 no_norm SiLU|lnc2|B=1 S=256 H=16384 I=896",
    "core/subkernels/find_nonzero_indices|float32 chunk=10240 columns 120+8|lnc2|T=10240 E=128 top_k=4",
    "core/subkernels/indexed_flatten|f_len=128 rows=5 from 1|lnc2|T=4096 E=3",
    "experimental/collectives/topk_reduce|bf16 from 8 ranks|lnc1|T=4 K=4 H=2880",
    "core/rmsnorm/rmsnorm_quant|row fp8 rmsnorm lower_bound=0.5|lnc2|B=1 S=2 H=16384",
    "core/rmsnorm/rmsnorm_quant|static fp8 rmsnorm|lnc2|B=1 S=2 H=16384",
    "core/mlp/mlp_tkg|bf16 x fp8 static rms_norm gate_up_column_tiling|lnc2|B=4 S=5 H=1024 I=512",
    "core/mlp/mlp_tkg|bf16 x fp8 row rms_norm down_w optimized layout|lnc2|B=4 S=1 H=8192 I=1024",
    "core/mlp/mlp_cte|bf16 x fp8 no_norm GELU skip_gate|lnc2|B=1 S=578 H=1408 I=352",
    "experimental/collectives/sb2sb_allgather|allgather_sb2sb bf16|lnc1|m=128 k=512 tp=8",
    "experimental/collectives/sb2sb_allgather|allgather_sb2sb_tiled bf16|lnc2|m=128 k=512 tp=4",
    "experimental/collectives/test_collectives|reduce_scatter add dim 0 fp32|lnc2|[256,512] ranks=2",
    "experimental/dynamic_shapes/dynamic_elementwise_add|add bf16|lnc2|[256,1024]",
    "experimental/dynamic_shapes/dynamic_elementwise_add|add(b, a) == a + b exactly|lnc2|[128,512]",
    "experimental/benchmark/find_nonzero_indices_with_count|fp32 320 non-zero|lnc2|[1,2048]",
    "core/utils/tensor_view|dynamic_select reshape_dim(0,(128,2)) -> vector_select(0,)|lnc1|[256,8]",
    "core/utils/tensor_view|negative_chain permute((0,2,1),) -> reshape((128,24),) hbm (must reject: non-contiguous "
    "layout)|lnc1|[128,4,6]",
    "experimental/collectives/test_collectives|attn_q_batch_shard TP2DP2 dBnS input_rank|lnc2"
    "|ranks=4 G=2 heads=1 B=8 S=1 d=64",
    "experimental/transformer/attention_block_tkg|bf16 K_cache_transposed no_rmsnorm_X test_bias|lnc2"
    "|B=1 q_heads=1 d=64 H=3072 S_ctx=128/128 S=1",
    "experimental/transformer/transformer_tkg|bf16 4 layers, layers 1-2 scaled|lnc2"
    "|tp=32 B=4 S_ctx=1024 H=8192 I=28672 ranks=4",
)
# kernels whose every case is too slow for the fast tier (the fast tier covers all other kernels)
SLOW_ONLY = {
    "experimental/collectives/fgcc": "its one test row multiplies 4096x4096x4096 over 4 ranks (~40 s)",
    "experimental/collectives/fg_allgather": "its one test row gathers [4096, 4096] on 4 ranks x 2 cores "
                                            "(~4.4 GB resident)",
    "experimental/moe/bwmm_shard_on_H": "its smallest test row runs 47 blocks of 256 tokens x H=5120 (~35 s)",
    "experimental/moe/bwd": "its smallest test row runs 8 blocks of 512 tokens x H=6144 after its test's numpy "
                            "forward pass builds the checkpointed activations (~20 s)",
}


def fast_cases() -> list[Case]:
    """The cases of :data:`FAST`, in :func:`all_cases` order."""
    fast = set(FAST)
    return [c for c in all_cases() if case_id(c) in fast]
