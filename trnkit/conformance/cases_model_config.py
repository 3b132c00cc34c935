"""Conformance cases from nki-library's model-configuration tables (``test_*_model_config.py``).

Each core kernel test may import a table of rows taken from real models (``gemma3_27b``, ``llama3_70b``,
``qwen3_32b``, ``deepseek_v31``, ``gptoss_120b``, ...) from a sibling ``test_<kernel>_model_config.py``
(``try: ... except ImportError: <table> = []``) and runs it through the same test body as its unit table:
the same input builder, golden and tolerance. The tables are read from the checkout when the cases are
built (``import nki`` resolved to the interpreter, whose dtypes they name; ``ModelTestType``, from
nki-library's test infrastructure, a named token): nothing is copied, and every row becomes a case of
tier :data:`~trnkit.conformance.harness.MODEL_CONFIG` built by its kernel's family builder, with the
row's parameters as the test reads them and the model-test type (``OPTIMAL`` / ``GENERALITY``, the
keys of the dict-shaped tables) in its name. Without a checkout there are no such cases.

Tables and the tests that read them (nki-library d2ad3a5):

- ``mlp/test_mlp_tkg_model_config.py``: ``test_mlp_tkg_unit`` (``create_mlp_tkg_test_config``: model
  rows are never negative; like its unit rows, every row with B x S > 96 is skipped by the test body,
  ``pytest.skip("TKG mode requires B*S <= 96, got ...")``, before any kernel runs: here those rows run anyway
  and are SKIPPED, ``Case.skipped_by``); the ``ROW_MX`` / ``STATIC_MX`` rows need trn3 and are not built.
- ``qkv/test_qkv_cte_model_config.py``: ``test_qkv_cte_model_unit`` (``run_qkv_cte_test``, bf16).
- ``moe/moe_tkg/test_moe_tkg_model_config.py``: ``test_moe_tkg_model`` (``xfail(strict=False)``, "Model
  coverage test", asserting its rows are not negative), the unit test's builder and rtol 2e-2; a mismatch is
  XFAIL only when :func:`~trnkit.conformance.cases_moe_tkg.fp16_overflow_check` confirms the float16 overflow.
- ``moe_block/test_moe_block_tkg_model_config.py``: ``test_moe_block_kernel_model`` (the unit test's
  body; it skips the MX-weight rows off trn3 and does not read ``has_shared_expert``).
- ``experimental/transformer/test_attention_block_tkg_model_config.py``: ``test_attn_blk_model`` (the unit
  test's ``_run_attention_block_test``: single-rank or KV-data-parallel by the row's ``KVDP``); its rows are
  ``AttnBlkTestConfig`` objects, read field by field, and built by
  :func:`~trnkit.conformance.cases_transformer.attention_block_case`.
- ``output_projection/test_output_proj_cte_model_config.py``: read only by
  ``test_output_proj_cte_static_mxfp8_unit`` (excluded from trn1/trn2): no trn2 case.
- ``mlp/test_mlp_cte_model_config.py``, ``attention/test_attention_cte_model_config.py``,
  ``attention/test_attention_tkg_model_config.py``, ``moe/moe_cte/test_moe_cte_model_config.py``: empty.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import posixpath
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import harness, reduce
from .cases_mlp import tkg_case as mlp_tkg_case
from .cases_mlp_quant import tkg_quant_case as mlp_tkg_quant_case
from .cases_moe_block import moe_block_case
from .cases_moe_tkg import fp16_overflow_check, moe_tkg_case
from .cases_qkv import cte_case as qkv_cte_case
from .cases_transformer import attention_block_case
from .harness import MODEL_CONFIG, Case

__all__ = ["TABLES", "model_config_cases", "read_table", "reduced_cases"]

TESTS = "test/integration/nkilib/core"
EXPERIMENTAL = "../experimental"  # (table paths are relative to TESTS)
TKG_BS_SEQLEN_THRESHOLD = 96  # mlp() runs mlp_tkg up to this many tokens, mlp_cte above (mlp_parameters.py)
# nki.isa.nc_transpose: "The output dst tile must have the same data type as that of data."
MLP_CTE_FP8_RULE = "nc_transpose: dst dtype float8_e4m3 must equal data dtype bfloat16"
# test_mlp_tkg_unit skips every row above the threshold before running anything (test_mlp_tkg.py, d2ad3a5)
MLP_TKG_SKIP = "test_mlp_tkg_unit: pytest.skip('TKG mode requires B*S <= 96, got {}')"
# (H, I) of the bf16-weight rows above 96 tokens whose SBUF plan nki-library's own allocator refuses
# (core/utils/allocator.py, SbufManager.alloc_heap: kernel_assert "Heap out of memory"), found by running them
MLP_CTE_BF16_HEAP_OOM = {(5120, 3200)}
HEAP_OOM = "Heap out of memory"
# what the planner computes (its debug log, NKILIB_LOG_LEVEL=DEBUG): the bound is nki-library's own constant
# MAX_AVAILABLE_SBUF_SIZE = 224 * 1024 - 16384 - 8 - 256 (mlp_cte_constants.py), not a value the interpreter gives
MLP_CTE_BF16_HEAP_NOTE = ("mlp_cte's SBUF plan does not fit its own bound: nki-library's allocator "
                          "(SbufManager.alloc_heap) wants 4 source-projection weight buffers of [128, 8, 3200] bf16 "
                          "(51,200 B a partition each; src_proj_weights_buffer_count = 4) on top of 10,406 B of "
                          "heap and a 7,168 B stack tile, 222,374 B against its MAX_AVAILABLE_SBUF_SIZE of "
                          "212,728 B: the 4th buffer finds 41,552 B free; its kernel_assert, the same on a device")
MLP_CTE_FP8_NOTE = ("B x S > 96 runs mlp_cte, whose fp8-weight path expects fp8 input; with this test's bf16 input "
                    "its Tensor Engine transpose writes bf16 data into an fp8 PSUM tile, which nki.isa.nc_transpose "
                    "forbids (dst dtype must equal data dtype)")
MX = "MX"  # a row value naming an MX dtype (the x4-packed ones) or an MX quantization type
# mlp_cte's intermediate-sharded path (nki-library d2ad3a5) reads past its hidden input when B > 1:
# _mlp_cte_single_shard loops batch_idx over B when the shards are on I (mlp_cte.py, "the outer loop range is the
# batch size"), while each of its token tiles still spans all B x S tokens (MLPCTEConstants.get_bxs_size,
# mlp_cte_tile_info.py), so load_hidden_tensor_tile reads B x S rows from batch_idx x S x H (mlp_cte_tensor_io.py):
# batch 1 of B = 128, S = 1, H = 8,192 reads elements [8,192, 1,056,767] of 1,048,576. The interpreter's DMA bound
# check refuses it; on a device an out-of-bounds DMA access surfaces at execution as an NrtError from the runtime
# (AWS Neuron docs, "Tutorial: Test and debug a NKI kernel end-to-end with nrtpy": "Not all kernel bugs are caught at
# compile time. Some produce valid NEFFs that only fail at execution - for example, out-of-bounds memory access").
MLP_CTE_I_SHARD_OOB = "tensor 'hidden_tensor': access ["
MLP_CTE_I_SHARD_OOB_NOTE = ("mlp_cte shards these rows on I (mlp_cte_sharding.calculate_sharding) and on that path "
                            "loops batch_idx over B while each token tile spans all B x S tokens, so batch 1 on reads "
                            "past the end of hidden_tensor: nki-library's kernel, not the interpreter (an "
                            "out-of-bounds DMA, which the Neuron runtime refuses at execution); nki-library's test "
                            "skips these rows and no mlp_cte unit row takes that path with B > 1")


def mlp_cte_shards_on_intermediate(lnc: int, bxs: int, h: int, i: int, bias: bool) -> bool:
    """mlp_cte's choice of sharding on I rather than on B x S (``mlp_cte_sharding.calculate_sharding``, nki-library
    d2ad3a5): with 2 cores, at most 256 tokens and no projection bias, or I above 2,048 and a multiple of 256; never
    below H = 7,168 or I = 1,024; always above I = 4,096."""
    on_i = (lnc == 2 and bxs <= 256 and not bias) or (i > 2048 and i % 256 == 0)
    if h < 7168 or i < 1024:
        on_i = False
    return on_i or i > 4096


def _mlp_tkg(r: list) -> Case | None:
    (lnc, b, s, h, i, dtype, _qdt, quant, _cycles, norm, fused, store, act, skip, gb, ub, db, nb, gate_col,
     down_col, swapped) = r
    if MX in (quant, _qdt):
        return None
    _expect(r, dtype == np.dtype("bfloat16") and act == "SiLU" and not nb, "bf16, SiLU, no norm bias")
    if quant == "NONE":
        _expect(r, not swapped, "the optimized down layout only with fp8 weights")
        case = mlp_tkg_case(lnc, b, s, h, i, norm, fused, store, skip, gb, ub, db, gate_col, down_col, negative=False)
        if b * s <= TKG_BS_SEQLEN_THRESHOLD:
            return case
        case = dataclasses.replace(case, skipped_by=MLP_TKG_SKIP.format(b * s))
        if (h, i) in MLP_CTE_BF16_HEAP_OOM:
            return dataclasses.replace(case, rejected_by=HEAP_OOM, note=f"{case.note}; {MLP_CTE_BF16_HEAP_NOTE}")
        if b > 1 and mlp_cte_shards_on_intermediate(lnc, b * s, h, i, gb or ub or db):
            return dataclasses.replace(case, rejected_by=MLP_CTE_I_SHARD_OOB,
                                       note="; ".join(n for n in (case.note, MLP_CTE_I_SHARD_OOB_NOTE) if n))
        return case
    _expect(r, not (fused or skip) and gb == ub == db, "no fused add or skip_gate, all or no biases")
    case = mlp_tkg_quant_case(lnc, b, s, h, i, quant, norm, gb, gate_col, down_col, swapped)
    if b * s <= TKG_BS_SEQLEN_THRESHOLD:
        return case
    # above the threshold mlp() runs mlp_cte, whose fp8 path takes its input already quantized to fp8
    # (test_mlp_cte.py's ROW / STATIC tables); this test hands it bf16, and skips the row itself
    return dataclasses.replace(case, rejected_by=MLP_CTE_FP8_RULE, note=f"{case.note}; {MLP_CTE_FP8_NOTE}",
                               skipped_by=MLP_TKG_SKIP.format(b * s))


def _qkv_cte(r: list) -> Case | None:
    lnc, b, s, h, q, kv, d, norm, dma_t, fused, qkv_bias, nb, layout, eps = r
    _expect(r, not qkv_bias, "no QKV bias")
    return qkv_cte_case(lnc, b, s, h, (q, kv, d), norm, dma_t, fused, nb, layout, eps, None, False, "model")


def _moe_tkg(r: list) -> Case | None:
    lnc, t, h, i, e, k, act, mode, all_e, qdt, quant, dtype, clamp, bias = r
    if MX in (quant, qdt):
        return None
    _expect(r, dtype == np.dtype("float16") and quant in ("NONE", "ROW"), "fp16, unquantized or fp8 ROW")
    case = moe_tkg_case(t, h, i, e, k, act, mode, all_e, quant == "ROW", clamp, bias, lnc=lnc, negative=False)
    return dataclasses.replace(case, xfail_check=fp16_overflow_check(case.rtol, case.atol))


# nki-library's own checks refuse the ROW rows' weight scales: the test draws ROW weights as it draws STATIC ones,
# with per-tensor scales, and the first ROW-scale kernel_assert the row reaches refuses them: qkv_tkg's (a [1, I] or
# [128, I] QKV scale, I = (q_heads + 2) x d_head), or, where qkv() routes to qkv_cte (B x S_tkg > 128, S_tkg > 96 or
# fused RoPE: qkv_cte checks no scale), output_projection_tkg's ([128, H], core/output_projection/
# output_projection_tkg.py). Trace-time Python, the same on a device; the substring is in both messages.
ATTN_ROW_SCALE = "weight scale for row quantization, expected ("
ATTN_ROW_NOTE = ("the test's generate_kernel_inputs draws ROW weights as STATIC ones (per-tensor scales), and "
                 "nki-library's ROW-scale kernel_assert (qkv_tkg's [128, I]; on the qkv_cte route the output "
                 "projection's [128, H]) refuses them: nki-library's own check refuses the test's inputs")
# attention_block_tkg's _rms_norm_inplace (the QK norms, before and after RoPE) sums x^2 over d_head with one nc_matmul
# whose moving operand is the whole [d_head, B_tile * heads * S_tkg] tile of a batch tile (B_tile * S_tkg =
# min(B * S_tkg, pmax // S_tkg * S_tkg), _QKV_processing's bxs_tile); for Q (heads = q_heads, a rank's with KVDP) that
# passes 512 columns in 164 runnable model rows (no unit row), which nki.isa.nc_matmul forbids: "the free axis sizes of
# stationary and moving tiles must be <= 128 and <= 512, respectively" (nl.tile_size.gemm_moving_fmax = 512)
ATTN_NORM_MOVING = "nc_matmul: moving free size {} exceeds gemm_moving_fmax (512)"
ATTN_NORM_MOVING_NOTE = ("attention_block_tkg's _rms_norm_inplace sums Q^2 over d_head with one nc_matmul over the "
                         "whole [d_head, B_tile x q_heads x S_tkg] Q tile ({} columns), past the 512 nki.isa.nc_matmul "
                         "allows a moving tile: the kernel, not the test's inputs; no unit row reaches it")


def attention_block_norm_columns(b: int, q_heads: int, s_tkg: int, norm: bool) -> int:
    """The free size of the moving tile of attention_block_tkg's QK-norm matmul for Q (0 without a QK norm)."""
    pmax = 128
    return min(b * s_tkg, pmax // s_tkg * s_tkg) * q_heads if norm else 0


# AttnBlkTestConfig's fields that give the row's sizes, in the builder's order; the rest are its flags
ATTN_SIZES = ("batch", "q_heads", "d_head", "H", "H_actual", "S_ctx", "S_max_ctx", "S_tkg")


def _attention_block_tkg(r: list) -> Case | None:
    fields = dict(r)  # (field, value) pairs of an AttnBlkTestConfig
    dtype, skip_out, dcp, skip_attn = (fields.pop(k) for k in ("dtype", "skip_output_projection", "DCP",
                                                                "skip_attention"))
    _expect(r, dtype == np.dtype("bfloat16") and not skip_out and dcp == 1 and not skip_attn,
            "bf16, with the output projection and attention, no DCP")
    if fields["kv_scale"] == "DEFAULT":  # KVScaleTest.DEFAULT: the test's standard scale, 240 / 2.3
        fields["kv_scale"] = None
    sizes = [fields.pop(k) for k in ATTN_SIZES]
    case = attention_block_case(*sizes, **fields)
    if fields["quantization_type"] != "ROW":  # (ROW rows fail first: qkv_tkg's check comes before the QK norms)
        n = attention_block_norm_columns(sizes[0], sizes[1], sizes[7],
                                         fields["qk_norm_pre_rope"] or fields["qk_norm_post_rope"])
        if n <= 512:
            return case
        return dataclasses.replace(case, rejected_by=ATTN_NORM_MOVING.format(n),
                                   note="; ".join(x for x in (case.note, ATTN_NORM_MOVING_NOTE.format(n)) if x))
    return dataclasses.replace(case, rejected_by=ATTN_ROW_SCALE, note="; ".join(n for n in (case.note, ATTN_ROW_NOTE)
                                                                                 if n))


# _run_attention_block_test (which test_attn_blk_model runs) skips a row before anything else when the test's
# estimate of what it allocates exceeds its limit (test_attention_block_tkg.py, d2ad3a5):
#   if estimated_bytes > _MAX_MEMORY_BYTES: pytest.skip(f"Estimated memory ... GiB exceeds limit ... GiB (set
#   TEST_ATTN_BLK_TKG_MAX_MEMORY_GB to override)"), _MAX_MEMORY_BYTES = TEST_ATTN_BLK_TKG_MAX_MEMORY_GB or
#   _DEFAULT_MAX_MEMORY_GB (20) GiB.
# The cases apply the test's default limit; the estimate is the test file's own function, evaluated from the checkout
ATTN_TEST = f"{EXPERIMENTAL}/transformer/test_attention_block_tkg.py"
ATTN_MEMORY_SKIP = ("test_attn_blk_model: pytest.skip('Estimated memory {:.1f} GiB exceeds limit {:.1f} GiB (set "
                    "TEST_ATTN_BLK_TKG_MAX_MEMORY_GB to override)'), at the test's default limit")


@functools.lru_cache(maxsize=4)
def attention_block_memory_estimate(root: Path) -> tuple[Callable[[Any], int], int]:
    """nki-library's ``estimate_test_memory_bytes(cfg)`` and its default limit in bytes
    (``_DEFAULT_MAX_MEMORY_GB * 1024**3``), both read from ``test_attention_block_tkg.py`` in the checkout
    ``root``: the function's definition and the constant's expression are evaluated on their own (the test
    module itself is not imported: it needs AWS's neuron_dtypes); the function is given a
    ``QuantizationType`` whose members are their names, as the cases' rows carry them."""
    rel = posixpath.normpath(f"{TESTS}/{ATTN_TEST}")
    tree = ast.parse((root / rel).read_text())
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "estimate_test_memory_bytes"]
    gb = [n.value for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
          and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "_DEFAULT_MAX_MEMORY_GB"]
    if len(fn) != 1 or len(gb) != 1:
        raise ValueError(f"{rel}: expected one estimate_test_memory_bytes and one _DEFAULT_MAX_MEMORY_GB, found "
                         f"{len(fn)} and {len(gb)}")
    quant = types.SimpleNamespace(NONE="NONE", STATIC="STATIC", ROW="ROW")
    scope: dict[str, Any] = {"QuantizationType": quant, "__builtins__": {}}
    exec(compile(ast.Module(body=fn, type_ignores=[]), rel, "exec"), scope)  # noqa: S102  (the checkout's code)
    limit = eval(compile(ast.Expression(gb[0]), rel, "eval"), {"__builtins__": {}}) * 1024**3
    return scope["estimate_test_memory_bytes"], int(limit)


def _attention_block_memory_skip(root: Path, row: list, case: Case) -> Case:
    """``case`` SKIPPED (``Case.skipped_by``, the test's own reason) when nki-library's test skips ``row`` for its
    memory estimate at the default limit."""
    estimate, limit = attention_block_memory_estimate(root)
    need = estimate(types.SimpleNamespace(**dict(row)))
    if need <= limit:
        return case
    return dataclasses.replace(case, skipped_by=ATTN_MEMORY_SKIP.format(need / 1024**3, limit / 1024**3))


def _moe_block_tkg(r: list) -> Case | None:
    (lnc, all_e, b, s, h, ha, i, eg, el, k, router, act, mode, w_dt, in_dt, _shared, bias, clamp, pre, norm_topk,
     skip_logits, r_dt) = r
    if w_dt == MX:
        return None
    _expect(r, lnc == 2 and mode == "POST_SCALE" and not skip_logits, "LNC 2, post-scaling, router logits kept")
    return moe_block_case(all_e, b, s, h, ha, i, eg, el, k, act, w_dt, in_dt, bias, clamp, pre, norm_topk, r_dt,
                          router)


MOE_TKG_XFAIL = "nki-library runs this table as xfail(strict=False), 'Model coverage test'"

# kernel: (table file, table name, row -> Case or None for an MX row, xfail reason of the test that reads it)
TABLES: dict[str, tuple[str, str, Callable[[list], Case | None], str]] = {
    "core/mlp/mlp_tkg": ("mlp/test_mlp_tkg_model_config.py", "mlp_tkg_model_configs", _mlp_tkg, ""),
    "core/qkv/qkv_cte": ("qkv/test_qkv_cte_model_config.py", "qkv_cte_model_configs", _qkv_cte, ""),
    "core/moe/moe_tkg": ("moe/moe_tkg/test_moe_tkg_model_config.py", "moe_tkg_model_configs", _moe_tkg,
                         MOE_TKG_XFAIL),
    "core/moe_block/moe_block_tkg": ("moe_block/test_moe_block_tkg_model_config.py", "moe_block_tkg_model_configs",
                                     _moe_block_tkg, ""),
    "experimental/transformer/attention_block_tkg": (
        f"{EXPERIMENTAL}/transformer/test_attention_block_tkg_model_config.py", "attention_block_tkg_model_configs",
        _attention_block_tkg, ""),
}


def _expect(row: list, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"model-config row {row}: the family builder takes {what}")


def _row(row: Any, mx_dtypes: tuple) -> tuple:
    """A table row as the builders take it: a list's values, or a config object's (field, value) pairs."""
    if dataclasses.is_dataclass(row):
        return tuple((f.name, _plain(getattr(row, f.name), mx_dtypes)) for f in dataclasses.fields(row))
    return tuple(_plain(v, mx_dtypes) for v in row)


def _plain(value: Any, mx_dtypes: tuple) -> Any:
    """A table value as the cases take it: enum members by name, MX dtypes as :data:`MX`."""
    if isinstance(value, enum.Enum):
        return MX if value.name.endswith("MX") else value.name
    if isinstance(value, np.dtype) and value in mx_dtypes:
        return MX
    return value


@functools.lru_cache(maxsize=8)
def read_table(root: Path, rel_path: str, name: str) -> tuple[tuple[str, tuple], ...]:
    """The rows of table ``name`` in ``test/integration/nkilib/core/<rel_path>``: (model-test type, row) pairs
    in file order; the type is "" for a flat list, else the key (``OPTIMAL``, ``GENERALITY``, ``BROAD``)."""
    with harness.nki_is_interpreter(root):
        import nki.language as nl  # the interpreter

        mx_dtypes = tuple(getattr(nl, n) for n in dir(nl) if n.endswith("_x4"))
        table = getattr(harness.load_test_module(root, posixpath.normpath(f"{TESTS}/{rel_path}")), name)
        groups = [(repr(k).rpartition(".")[2], rows) for k, rows in table.items()] if isinstance(table, dict) \
            else [("", table)]
        return tuple((kind, _row(row, mx_dtypes)) for kind, rows in groups for row in rows)


def model_config_cases(root: Path | None) -> list[Case]:
    """Every non-MX row of the model-config tables under ``root`` (none without a checkout), kernel by kernel,
    in table order; a row that repeats an earlier one of its kernel once."""
    if root is None:
        return []
    return [case for case, _ in _cases_and_rows(root)]


def _build(root: Path, rel_path: str, build: Callable[[list], Case | None], xfail: str, kind: str,
           row: tuple) -> Case | None:
    """The case of one table row, as :func:`model_config_cases` lists it."""
    case = build(list(row))
    if case is None:
        return None
    if case.kernel == "experimental/transformer/attention_block_tkg":
        case = _attention_block_memory_skip(root, list(row), case)
    notes = [n for n in (case.note, xfail, f"row of {rel_path.rpartition('/')[2]}") if n]
    return dataclasses.replace(case, name=f"{case.name} {MODEL_CONFIG}" + f" {kind}" * bool(kind),
                               tier=MODEL_CONFIG, note="; ".join(notes), xfail=xfail)


def _cases_and_rows(root: Path | None) -> list[tuple[Case, tuple[str, str, Callable, str, str, tuple]]]:
    """Each model-config case with what built it (table file, table, builder, xfail reason, type, row)."""
    if root is None:
        return []
    cases: dict[str, tuple[Case, tuple]] = {}
    for rel_path, name, build, xfail in TABLES.values():
        for kind, row in read_table(root, rel_path, name):
            case = _build(root, rel_path, build, xfail, kind, row)
            if case is not None:
                cases.setdefault(f"{case.kernel}|{case.name}|lnc{case.lnc}|{case.shapes}",
                                 (case, (rel_path, name, build, xfail, kind, row)))
    return list(cases.values())


def reduced_cases(root: Path | None, cap_s: float = reduce.CAP_S) -> list[Case]:
    """The reduced model-config cases (:mod:`trnkit.conformance.reduce`): one for each case of
    :func:`model_config_cases` that runs (neither skipped by its test nor refused by a named rule) whose estimate
    exceeds ``cap_s`` and that a route-keeping reduction brings within it, in the same order."""
    out = []
    for case, (rel_path, _name, build, xfail, kind, row) in _cases_and_rows(root):
        if case.skipped_by or case.rejected_by:
            continue
        red = reduce.reduction(case.kernel, case.name, case.shapes, row, cap_s)
        if not red.reduced:
            continue
        built = _build(root, rel_path, build, xfail, kind, reduce.reduced_row(row, red.sizes))
        if built is None or built.skipped_by or built.rejected_by:
            continue
        out.append(reduce.reduced_case(case, built, red, cap_s))
    return out
