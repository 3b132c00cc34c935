"""The unit tier runs every row of the families whose tables it copies: counted here from nki-library's test
files themselves (their table literals read with ``ast``, not imported), against the cases the run lists."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

from trnkit.conformance import cases, harness

ROOT = harness.nkilib_root()
TESTS = "test/integration/nkilib"
pytestmark = pytest.mark.skipif(ROOT is None, reason="no nki-library checkout or archive")


def _table(rel: str, name: str, drop: tuple[int, ...] = ()) -> list[str]:
    """The rows of the list literal assigned to ``name`` in ``TESTS/rel`` (module or class level), each as its
    source text without the columns ``drop`` (positions the test does not pass on to the kernel)."""
    tree = ast.parse(Path(ROOT, TESTS, rel).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return [repr([ast.unparse(e) for k, e in enumerate(row.elts) if k not in drop]) for row in node.value.elts]
    raise AssertionError(f"{rel}: no table {name}")


def _listed(kernel: str) -> int:
    return sum(c.kernel == kernel and c.tier == "" for c in cases.all_cases(ROOT))


@pytest.mark.parametrize(
    "kernel, rel, tables, per_row",
    [
        ("core/subkernels/rmsnorm_tkg", "core/subkernels/test_rmsnorm_tkg.py", ["RMSNORM_TKG_TEST_CASES"], 1),
        ("core/subkernels/layernorm_tkg", "core/subkernels/test_layernorm_tkg.py", ["LAYERNORM_TKG_TEST_CASES"], 1),
        (
            "core/subkernels/find_nonzero_indices",
            "core/subkernels/test_find_nonzero_indices.py",
            ["FULL_TEST_PARAMS", "SUBSET_TEST_PARAMS"],
            1,
        ),
        (
            "core/subkernels/indexed_flatten",
            "core/subkernels/test_indexed_flatten.py",
            ["FAST_TEST_PARAMS", "ROW_OFFSET_TEST_PARAMS"],
            1,
        ),
        ("core/max/cascaded_max", "core/max/test_cascaded_max.py", ["cascaded_max_unit_perms"], 1),
        (
            "core/max/cascaded_max_utils",
            "core/max/test_cascaded_max_utils.py",
            ["full_batch_perms", "partial_batch_perms", "dst_batch_perms", "oversized_sb_perms"],
            1,
        ),
        ("core/topk", "core/topk/test_topk.py", ["topk_unit_perms", "large_batch_perms", "topk_unsorted_perms"], 1),
        (
            "experimental/collectives/topk_reduce",
            "experimental/subkernels/test_topk_reduce.py",
            ["TOPK_REDUCE_PARAMS"],
            1,
        ),
        # the same table in test_output_proj_cte_bf16_unit and test_output_proj_cte_static_fp8_unit
        (
            "core/output_projection/cte",
            "core/output_projection/test_output_proj_cte.py",
            ["OUTPUT_PROJ_CTE_UNIT_CASES"],
            2,
        ),
    ],
)
def test_every_distinct_row_is_a_case(kernel, rel, tables, per_row):
    # a row a table lists twice (cascaded_max's [2, 1, 1, 3168]) runs once; the tables are different tests (topk's
    # unsorted rows repeat sorted ones) but for test_topk_unit, which runs large_batch_perms appended to its table
    assert _listed(kernel) == sum(len(set(_table(rel, t))) for t in tables) * per_row


def test_mlp_cte_rows():
    rel = "core/mlp/test_mlp_cte.py"
    # columns: vnc, batch, seqlen, hidden, intermediate, tpbSgCyclesSum (a performance target, not passed on), ...
    unquantized = [
        r
        for t in ("MLP_CTE_UNIT_TEST_CASES_GATE_BIAS_FALSE", "MLP_CTE_UNIT_TEST_CASES_GATE_BIAS_TRUE")
        for r in _table(rel, t, drop=(5,))
    ]
    quantized = [
        r
        for t in ("MLP_CTE_UNIT_TEST_CASES_ROW_QUANT", "MLP_CTE_UNIT_TEST_CASES_STATIC_QUANT")
        for r in _table(rel, t, drop=(5,))
    ]
    assert (len(unquantized), len(set(unquantized)), len(quantized)) == (131, 130, 11)
    assert _listed("core/mlp/mlp_cte") == len(set(unquantized)) + len(set(quantized))


def test_qkv_cte_rows():
    rel = "core/qkv/test_qkv_cte.py"
    # the columns the tests do not pass on: the accuracy table's dtype (it runs bf16), the add_bias columns
    tables = {
        "qkv_cte_kernel_fused_rope_test_perms": (10,),
        "qkv_cte_kernel_accuracy_test_perms": (6,),
        "qkv_cte_kernel_performance_bsd_test_perms": (8,),
        "qkv_cte_kernel_performance_nbsd_test_perms": (10,),
        "qkv_cte_kernel_no_dma_transpose_test_perms": (10,),
        "qkv_cte_non_quantized_test_perms": (),
    }
    per_test = {t: _table(rel, t, drop) for t, drop in tables.items()}
    quantized = [
        "qkv_cte_kernel_static_quantization_test_perms",
        "qkv_cte_fp8_kv_cache_test_perms",
        "qkv_cte_fp8_extreme_test_perms",
        "qkv_cte_block_kv_test_perms",
    ]
    n_quant = sum(len(_table(rel, t)) for t in quantized)
    assert sum(map(len, per_test.values())) == 100 and n_quant == 19
    assert _listed("core/qkv/qkv_cte") == sum(len(set(rows)) for rows in per_test.values()) + n_quant


def test_router_topk_rows():
    """test_router_topk runs each base config under x in HBM ([H, T] or [T, H]) and x in SBUF (three layouts)
    and skips T per core above 128 and not a multiple of 128 with the indirect-DMA scatter, and output in SBUF
    above 128 tokens; one base config is listed twice."""
    src = Path(ROOT, TESTS, "core/router_topk/test_router_topk.py").read_text()
    tree = ast.parse(src)
    base = next(
        n for n in ast.walk(tree) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "base_configs"
    ).value.elts
    runs = collections.Counter()
    for row in base:
        t, _h, _e, _k, _act, _bias, _pre, _norm, _col, scatter, _pe, shard, out_sb = (ast.unparse(e) for e in row.elts)
        t_local = int(t) // 2 if shard == "True" else int(t)
        if (t_local > 128 and t_local % 128 and scatter == "True") or (out_sb == "True" and int(t) > 128):
            continue
        runs[ast.unparse(row)] += 5
    assert (len(base), sum(runs.values()), len(runs) * 5) == (50, 250, 245)
    assert _listed("core/router_topk") == len(runs) * 5


def test_moe_tkg_sweep_rows():
    """MOE_TKG_SWEEP_PARAMS as nki-library's test module builds it: its generator functions and tables run from
    the checkout's source (the enums stand in as their member names); one sweep row repeats a unit-table row."""

    class Names:
        def __getattr__(self, name: str) -> str:
            return name

    tree = ast.parse(Path(ROOT, TESTS, "core/moe/moe_tkg/test_moe_tkg.py").read_text())
    wanted = {"_po2", "_make_sweep_params", "_ALL_BASIC", "_ALL_FULL", "_SEL_BASIC", "_SEL_FULL", "_STD_CONFIGS"}
    body = [
        n
        for n in tree.body
        if (isinstance(n, ast.FunctionDef) and n.name in wanted)
        or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) in wanted | {"MOE_TKG_SWEEP_PARAMS"})
    ]
    namespace = {"ActFnType": Names(), "ExpertAffinityScaleMode": Names(), "nl": Names()}
    # nki-library's own generator code (the checkout under test), not input from elsewhere
    exec(compile(ast.Module(body=body, type_ignores=[]), "test_moe_tkg.py", "exec"), namespace)  # noqa: S102
    sweep = namespace["MOE_TKG_SWEEP_PARAMS"]
    unit = _table("core/moe/moe_tkg/test_moe_tkg.py", "MOE_TKG_TEST_PARAMS")
    sbuf_io = _table("core/moe/moe_tkg/test_moe_tkg.py", "MOE_TKG_SBUF_IO_PARAMS")
    assert (len(sweep), len(unit), len(sbuf_io)) == (304, 49, 10)
    assert _listed("core/moe/moe_tkg") == len(unit) + len(sweep) - 1 + len(sbuf_io)


def test_attention_tkg_rows():
    """test_attn_tkg_fast runs its table at LNC 1 and 2, test_attn_tkg_slow its own at the platform's (2)."""
    rel = "core/attention/test_attention_tkg.py"
    fast, slow = _table(rel, "attention_tkg_fast_configs"), _table(rel, "attention_tkg_slow_configs")
    assert (len(fast), len(slow)) == (107, 44)
    assert _listed("core/attention/attention_tkg") == 2 * len(set(fast)) + len(set(slow) - set(fast))
