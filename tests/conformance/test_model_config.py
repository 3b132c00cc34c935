"""The model-config tier: nki-library's ``test_*_model_config.py`` tables read from the checkout and built
into cases by the kernels' family builders."""

from __future__ import annotations

import math
import re
import textwrap

import numpy as np
import pytest

from trnkit.conformance import cases, cases_model_config, cases_moe_tkg, harness

TABLE = '''
import enum

import nki.language as nl
from test.utils.common_dataclasses import ModelTestType


class Quant(enum.Enum):
    NONE = 0
    ROW = 1
    ROW_MX = 2


flat = [[2, 1, nl.bfloat16, Quant.ROW], [1, 4, nl.float8_e4m3fn_x4, Quant.NONE]]
by_type = {
    ModelTestType.OPTIMAL: [[2, 8, nl.float16, Quant.ROW_MX]],
    ModelTestType.GENERALITY: [[2, 16, nl.float16, Quant.NONE], [2, 32, nl.bfloat16, Quant.ROW]],
}
'''


@pytest.fixture
def table_checkout(tmp_path):
    (tmp_path / "src").mkdir()
    rel = "fake/test_fake_model_config.py"
    path = tmp_path / cases_model_config.TESTS / rel
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(TABLE))
    return tmp_path, rel


def test_a_flat_table_reads_in_file_order_with_enums_by_name_and_mx_dtypes_marked(table_checkout):
    root, rel = table_checkout
    rows = cases_model_config.read_table(root, rel, "flat")
    assert rows == (("", (2, 1, np.dtype("bfloat16"), "ROW")), ("", (1, 4, cases_model_config.MX, "NONE")))


def test_a_table_keyed_by_model_test_type_gives_each_row_its_type(table_checkout):
    """``ModelTestType`` comes from nki-library's test infrastructure (a stand-in here): its members are named
    tokens, so the dict's keys survive as OPTIMAL / GENERALITY; an MX quantization type reads as MX."""
    root, rel = table_checkout
    rows = cases_model_config.read_table(root, rel, "by_type")
    assert [kind for kind, _ in rows] == ["OPTIMAL", "GENERALITY", "GENERALITY"]
    assert [row for _, row in rows] == [(2, 8, np.dtype("float16"), "MX"), (2, 16, np.dtype("float16"), "NONE"),
                                        (2, 32, np.dtype("bfloat16"), "ROW")]


def test_an_infrastructure_stand_in_names_upper_case_members_and_still_refuses_other_uses():
    stand_in = harness._TestInfraStandIn("ModelTestType")
    assert stand_in.OPTIMAL is stand_in.OPTIMAL and repr(stand_in.OPTIMAL) == "ModelTestType.OPTIMAL"
    assert stand_in.OPTIMAL != stand_in.BROAD
    with pytest.raises(NotImplementedError, match=r"ModelTestType\.test_id_prefix: nki-library's test"):
        stand_in.test_id_prefix
    with pytest.raises(NotImplementedError, match="ModelTestType.OPTIMAL: nki-library's test infrastructure"):
        stand_in.OPTIMAL("x")


def test_no_checkout_no_model_config_cases():
    assert cases_model_config.model_config_cases(None) == []


ROOT = harness.nkilib_root()
needs_checkout = pytest.mark.skipif(ROOT is None, reason="no nki-library checkout or archive")


@needs_checkout
def test_every_non_mx_row_of_the_trn2_tables_becomes_one_slow_case():
    """nki-library d2ad3a5: mlp_tkg 513 rows (171 MX), qkv_cte 81, moe_tkg 308, moe_block_tkg 818 (498 with MX
    weights), experimental attention_block_tkg 2,724 (none MX, all distinct); output_proj_cte's table is read only
    by a trn3 test, mlp_cte / attention / moe_cte's are empty."""
    model = [c for c in cases.all_cases(ROOT) if c.tier == harness.MODEL_CONFIG]
    counts = {k: sum(c.kernel == k for c in model) for k in cases_model_config.TABLES}
    assert counts == {"core/mlp/mlp_tkg": 342, "core/qkv/qkv_cte": 81, "core/moe/moe_tkg": 308,
                      "core/moe_block/moe_block_tkg": 320, "experimental/transformer/attention_block_tkg": 2724}
    assert not {cases.case_id(c) for c in model} & set(cases.FAST)
    assert all(" model_config" in c.name and not c.negative for c in model)


@needs_checkout
def test_model_config_rows_carry_their_parameters_through_the_family_builders():
    model = {cases.case_id(c): c for c in cases_model_config.model_config_cases(ROOT)}
    # mlp_tkg's first OPTIMAL row: gemma3_27b, fp8 ROW, B=1 S=1 H=5376 I=336, column tiling on
    first = model["core/mlp/mlp_tkg|bf16 x fp8 row rms_norm gate_up_column_tiling down_column_tiling model_config "
                  "OPTIMAL|lnc2|B=1 S=1 H=5376 I=336"]
    assert (first.rtol, first.atol, first.rejected_by, first.xfail) == (2e-2, 1e-5, "", "")
    with harness.nki_is_interpreter(ROOT):
        kw = first.inputs()
        assert kw["hidden_tensor"].shape == (1, 1, 5376) and kw["gate_proj_weights_tensor"].shape == (5376, 336)
        assert kw["quantization_type"].name == "ROW" and kw["use_tkg_gate_up_proj_column_tiling"] is True
    # above 96 tokens mlp() runs mlp_cte, whose fp8 path needs fp8 input: these rows must be rejected
    cte = [c for c in model.values() if c.kernel == "core/mlp/mlp_tkg" and c.rejected_by]
    fp8 = [c for c in cte if c.rejected_by == cases_model_config.MLP_CTE_FP8_RULE]
    assert len(fp8) == 83 and all("x fp8" in c.name for c in fp8)
    assert all("x fp8" not in c.name and c.rejected_by in (cases_model_config.HEAP_OOM,
                                                           cases_model_config.MLP_CTE_I_SHARD_OOB)
               for c in cte if c not in fp8)
    assert all(c.xfail == cases_model_config.MOE_TKG_XFAIL and c.xfail_check is not None
               for c in model.values() if c.kernel == "core/moe/moe_tkg")
    # test_mlp_tkg_unit skips every row above 96 tokens (pytest.skip before the kernel): 83 bf16, 83 fp8
    mlp = [c for c in model.values() if c.kernel == "core/mlp/mlp_tkg"]
    tokens = {c: math.prod(int(v) for v in re.findall(r"[BS]=(\d+)", c.shapes)) for c in mlp}
    skipped = [c for c in mlp if c.skipped_by]
    assert len(skipped) == 166 and all(tokens[c] > 96 for c in skipped) and set(cte) <= set(skipped)
    assert all(c.skipped_by == f"test_mlp_tkg_unit: pytest.skip('TKG mode requires B*S <= 96, got {tokens[c]}')"
               for c in skipped) and all(tokens[c] <= 96 for c in mlp if not c.skipped_by)
    # attention_block_tkg's rows are AttnBlkTestConfig objects: gemma3_27b's first OPTIMAL row, ROW fp8 weights
    # (the test draws them as for STATIC: per-tensor scales) and an fp8 KV cache at the test's default scale
    attn = model["experimental/transformer/attention_block_tkg|fp8 row qk_norm_pre_rope qk_norm_pre_rope_gamma "
                 "transposed_out kv_quant block_len=32 model_config OPTIMAL|lnc2|B=16 q_heads=1 d=128 H=5376 "
                 "S_ctx=1024/1024 S=1"]
    assert (attn.rtol, attn.atol, attn.ranks, attn.min_cosine, attn.min_pass_rate) == (0.07, 16.0, 0, 0.99,
                                                                                      (("X_out", 0.99),))
    with harness.nki_is_interpreter(ROOT):
        kw = attn.inputs()
    assert kw["quantization_type_qkv"].name == "ROW" and kw["W_qkv"].shape == (5376, 3 * 128)
    assert kw["K_cache"].shape == (16 * 1024 // 32, 32, 128) and str(kw["K_cache"].dtype) == "float8_e4m3"
    assert kw["k_scale"][0, 0] == np.float32(240.0 / 2.3) and kw["transposed_out"]
    # the test hands ROW rows per-tensor scales, which qkv_tkg refuses for ROW: nki-library's own check, named
    assert kw["weight_dequant_scale_qkv"].shape == (128, 3) and attn.rejected_by == cases_model_config.ATTN_ROW_SCALE
    rows = [c for c in model.values() if c.kernel.endswith("attention_block_tkg")]
    assert sum(c.rejected_by == cases_model_config.ATTN_ROW_SCALE for c in rows) == 537
    assert all((c.rejected_by == cases_model_config.ATTN_ROW_SCALE) == c.name.startswith("fp8 row") for c in rows)
    kvdp = [c for c in model.values() if c.kernel.endswith("attention_block_tkg") and c.ranks]
    assert len(kvdp) == 1510 and {c.ranks for c in kvdp} == {2, 4, 8, 16, 32}
    qkv = model["core/qkv/qkv_cte|model bf16 no_norm BSD dma_transpose model_config|lnc2|B=1 S=1024 H=8192 "
                "heads=16/2 d=128"]
    with harness.nki_is_interpreter(ROOT):
        kw = qkv.inputs()
    assert kw["fused_qkv_weights"].shape == (8192, (16 + 2 * 2) * 128) and kw["load_input_with_DMA_transpose"]


def _overflow_row(weights_dtype=np.float16, all_expert=True):
    """One token, H = 2, I = 1, two experts: expert 0's activation is silu(100) * 100 = 10,000 and its down
    projection [100,000, 10] (the first past float16's 65,504), expert 1's [0.731, 0.731]; affinities 1/2 each."""
    import types

    gu = np.zeros((2, 2, 2, 1), weights_dtype)
    gu[0, 0] = [[1.0], [1.0]]  # expert 0: g = u = x0 = 100
    gu[1, 0] = [[0.01], [0.01]]  # expert 1: g = u = 1
    wd = np.array([[[10.0, 0.001]], [[1.0, 1.0]]], weights_dtype)
    inputs = {"hidden_input": np.array([[100.0, 0.0]], np.float16), "expert_gate_up_weights": gu,
              "expert_down_weights": wd, "expert_affinities": np.array([[0.5, 0.5]], np.float32),
              "is_all_expert": all_expert, "expert_affinities_scaling_mode": types.SimpleNamespace(name="POST_SCALE"),
              "activation_fn": types.SimpleNamespace(name="SiLU"), "expert_gate_up_bias": None,
              "expert_down_bias": None, "gate_clamp_upper_limit": None, "up_clamp_lower_limit": None,
              "up_clamp_upper_limit": None}
    silu1 = 1.0 / (1.0 + np.exp(-1.0))
    final = np.array([[0.5 * 100_000.0 + 0.5 * silu1, 0.5 * 10.0 + 0.5 * silu1]], np.float32)
    return inputs, final


@needs_checkout
def test_attention_block_rows_over_the_tests_memory_limit_are_skipped_with_the_tests_reason():
    """_run_attention_block_test skips a row whose memory estimate (its own estimate_test_memory_bytes) exceeds
    _DEFAULT_MAX_MEMORY_GB (20 GiB) before anything runs: 185 of the 2,724 model rows at d2ad3a5. The same rows
    come out of nki-library's own AttnBlkTestConfig objects with its real QuantizationType (the cases' rows carry
    enum members by name), with the same sizes; one row's KV caches alone, worked out by hand, reach the limit."""
    import ast

    _, limit = cases_model_config.attention_block_memory_estimate(ROOT)
    assert limit == 20 * 1024**3
    model = [c for c in cases_model_config.model_config_cases(ROOT) if c.kernel.endswith("attention_block_tkg")]
    skipped = {(c.name, c.shapes) for c in model if c.skipped_by}
    assert len(model) == 2724 and len(skipped) == 185
    row = next(c for c in model if (c.name, c.shapes) == (
        "bf16 block_len=32 KVDP=8 model_config OPTIMAL",
        "B=2048 q_heads=8/rank d=128 H=8192 S_ctx=10240/10240 S=1 ranks=8"))
    assert row.skipped_by.startswith("test_attn_blk_model: pytest.skip('Estimated memory 33.6 GiB exceeds limit "
                                     "20.0 GiB")
    kv_cache = 2 * 2048 * 10240 * 128 * 2  # K and V block caches, bf16: the inputs' and the ranks' copies
    assert 2 * kv_cache == 20 * 1024**3  # (the rest of the estimate lifts it past the limit)
    # independently: the table's own objects, the test file's function bound to the real enum
    path = ROOT / "test/integration/nkilib/experimental/transformer/test_attention_block_tkg.py"
    fn = [n for n in ast.parse(path.read_text()).body
          if isinstance(n, ast.FunctionDef) and n.name == "estimate_test_memory_bytes"]
    with harness.nki_is_interpreter(ROOT):
        from nkilib_src.nkilib.core.utils.common_types import QuantizationType

        scope = {"QuantizationType": QuantizationType}
        exec(compile(ast.Module(body=fn, type_ignores=[]), str(path), "exec"), scope)  # noqa: S102
        table = harness.load_test_module(
            ROOT, "test/integration/nkilib/experimental/transformer/test_attention_block_tkg_model_config.py")
        objects = [c for rows in table.attention_block_tkg_model_configs.values() for c in rows]
        over = [c for c in objects if scope["estimate_test_memory_bytes"](c) > limit]
    assert len(objects) == 2724 and len(over) == 185
    sizes = sorted(f"{scope['estimate_test_memory_bytes'](c) / 1024**3:.1f}" for c in over)  # (as the skip prints)
    assert sizes == sorted(re.search(r"memory ([0-9.]+) GiB", c.skipped_by).group(1) for c in model if c.skipped_by)


def test_the_fp16_overflow_check_confirms_inf_only_where_a_float16_value_overflows():
    check = cases_moe_tkg.fp16_overflow_check(2e-2, 1e-5)
    inputs, final = _overflow_row()
    assert final[0, 0] == pytest.approx(50_000.37, rel=1e-6) and final[0, 1] == pytest.approx(5.37, rel=1e-3)
    expected = {"out": final}
    cause = check(inputs, {"out": np.array([[np.inf, final[0, 1]]], np.float16)}, expected)
    assert cause.startswith("float16 overflow: all 1 output elements outside the tolerance are inf / NaN")
    assert "expert output before the affinity up to 1e+05" in cause and "activation up to 1e+04" in cause
    assert "past its range (65,504)" in cause
    # NaN where the overflowing expert meets another: still the overflow
    assert check(inputs, {"out": np.array([[np.nan, final[0, 1]]], np.float16)}, expected)
    # inf where nothing overflows, a finite wrong value, or no mismatch at all: not this cause
    assert check(inputs, {"out": np.array([[np.inf, np.inf]], np.float16)}, expected) == ""
    assert check(inputs, {"out": np.array([[np.inf, 2000.0]], np.float16)}, expected) == ""  # (allowed: 1,000)
    assert check(inputs, {"out": final.astype(np.float32)}, expected) == ""
    # outside the checked path (bf16 weights, selective experts): never confirmed
    import ml_dtypes

    for other in (_overflow_row(np.dtype(ml_dtypes.bfloat16))[0], _overflow_row(all_expert=False)[0]):
        assert check(other, {"out": np.array([[np.inf, final[0, 1]]], np.float16)}, expected) == ""


@needs_checkout
@pytest.mark.slow
@pytest.mark.model_config
def test_a_moe_tkg_model_row_is_xfail_with_the_overflow_checked():
    """T=1 H=4096 I=768 E=4 (nki-library d2ad3a5): expert outputs before the affinity reach 3.47e5, the
    reference's own output 1.46e5 (float32); the kernel's down_sbuf is float16."""
    case = next(c for c in cases_model_config.model_config_cases(ROOT)
                if c.kernel == "core/moe/moe_tkg" and c.shapes == "T=1 H=4096 I=768 E=4")
    row = harness.run_case(case, ROOT)
    assert (row.result, row.verdict) == (harness.XFAIL, harness.MISMATCH), harness.format_row(row)
    assert "expert output before the affinity up to 3.47e+05" in row.message and harness.row_ok(case, row)


@needs_checkout
def test_the_docs_model_config_table_counts_the_tiers_cases_and_flag_combinations():
    """scripts/docs_tables.py's MODEL_CONFIG_TABLES (the "of N" figures of docs/interpreter.md's model-config
    results table): per kernel, the tier's cases and its case names without " model_config <type>", as built."""
    from pathlib import Path

    from trnkit.bench.paths import load_script

    docs_tables = load_script(Path(__file__).resolve().parents[2] / "scripts" / "docs_tables.py", "docs_tables")
    model = [c for c in cases_model_config.model_config_cases(ROOT)]
    built = {k: (sum(c.kernel == k for c in model),
                 len({re.sub(r" model_config( \w+)?$", "", c.name) for c in model if c.kernel == k}))
             for k in cases_model_config.TABLES}
    assert docs_tables.MODEL_CONFIG_TABLES == built


@needs_checkout
def test_attention_block_rows_whose_qk_norm_matmul_passes_512_columns_carry_that_refusal():
    """attention_block_tkg's _rms_norm_inplace runs one nc_matmul over a batch tile's whole Q tile, [d_head,
    B_tile * q_heads * S_tkg] with B_tile * S_tkg = min(B * S_tkg, 128 // S_tkg * S_tkg): past 512 columns (the
    documented gemm_moving_fmax) in 223 model rows with a QK norm (164 not skipped by the test's memory limit; 50
    on one device), in no unit row. Worked by hand: B = 128, 8 q heads a rank, S_tkg = 1 -> 128 x 8 = 1,024;
    B = 512, 4 a rank -> 512 (allowed: the unit KVDP=4 row passes); B = 255, 2 heads, S_tkg = 3 -> 126 x 2."""
    assert cases_model_config.attention_block_norm_columns(128, 8, 1, True) == 1024
    assert cases_model_config.attention_block_norm_columns(512, 4, 1, True) == 512
    assert cases_model_config.attention_block_norm_columns(255, 2, 3, True) == 252
    assert cases_model_config.attention_block_norm_columns(128, 8, 1, False) == 0
    every = [c for c in cases.all_cases(ROOT) if c.kernel.endswith("attention_block_tkg")]
    norm = [c for c in every if c.rejected_by.startswith("nc_matmul: moving free size")]
    assert not [c for c in norm if c.tier != harness.MODEL_CONFIG]
    assert len(norm) == 223 and sum(not c.skipped_by for c in norm) == 164
    assert sum(not c.skipped_by and not c.ranks for c in norm) == 50
    assert all({"qk_norm_pre_rope", "qk_norm_post_rope"} & set(c.name.split()) for c in norm)
    row = next(c for c in norm if c.shapes == "B=128 q_heads=8/rank d=128 H=4096 S_ctx=1024/1024 S=1 ranks=16"
               and c.name.startswith("bf16"))
    assert row.rejected_by == "nc_matmul: moving free size 1024 exceeds gemm_moving_fmax (512)"
    assert "1024 columns" in row.note
    # rows at or under 512 columns keep no refusal (ROW rows keep theirs: qkv_tkg's check comes first)
    assert all(not c.rejected_by for c in every if not c.name.startswith("fp8 row") and c not in norm)


def test_mlp_cte_shards_on_intermediate_as_calculate_sharding_decides():
    """nki-library's calculate_sharding, worked by hand: 2 cores, <= 256 tokens, no bias -> on I (H = 8,192, I =
    1,792); a projection bias or 257 tokens -> on B x S (I = 1,792 is not above 2,048); I = 2,304 (> 2,048, a
    multiple of 256) -> on I with any tokens or cores; H = 5,120 or I = 896 -> never; I = 4,352 (> 4,096) -> always,
    even at H = 4,096."""
    on_i = cases_model_config.mlp_cte_shards_on_intermediate
    assert on_i(2, 128, 8192, 1792, False) and on_i(2, 256, 8192, 3584, False)
    assert not on_i(2, 128, 8192, 1792, True) and not on_i(2, 257, 8192, 1792, False)
    assert not on_i(1, 128, 8192, 1792, False)
    assert on_i(1, 512, 8192, 2304, True)
    assert not on_i(2, 128, 5120, 1792, False) and not on_i(2, 128, 8192, 896, False)
    assert on_i(1, 4096, 4096, 4352, True)


@needs_checkout
def test_mlp_tkg_rows_on_mlp_ctes_intermediate_sharded_path_with_b_over_1_carry_its_out_of_bounds_read():
    """Exactly the 6 bf16 model rows above 96 tokens whose mlp_cte run shards on I with B > 1 (H = 8,192, I = 1,792
    or 3,584; B x S = 128, 160 or 256 on 2 cores): mlp_cte loops batch_idx over B there while each token tile spans
    all B x S tokens, and reads past hidden_tensor. The same sizes at B = 1 or on B x S (320 tokens) carry none."""
    model = [c for c in cases_model_config.model_config_cases(ROOT) if c.kernel == "core/mlp/mlp_tkg"]
    oob = [c for c in model if c.rejected_by == cases_model_config.MLP_CTE_I_SHARD_OOB]
    assert sorted(c.shapes for c in oob) == sorted(f"B={b} S={s} H=8192 I={i}" for b, s in ((32, 5), (128, 1),
                                                                                             (256, 1))
                                                   for i in (1792, 3584))
    assert all(c.lnc == 2 and c.name.startswith("bf16 ") and c.skipped_by for c in oob)
    assert all(cases_model_config.MLP_CTE_I_SHARD_OOB_NOTE in c.note for c in oob)
    wide = next(c for c in model if c.shapes == "B=64 S=5 H=8192 I=1792" and c.name.startswith("bf16 rms_norm"))
    assert not wide.rejected_by


@needs_checkout
@pytest.mark.slow
@pytest.mark.model_config
def test_an_intermediate_sharded_mlp_cte_row_is_refused_at_its_out_of_bounds_read():
    """B = 128, S = 1, H = 8,192, I = 1,792: batch 1's read of hidden_tensor spans elements [8,192, 1,056,767] of its
    1,048,576 (128 tokens from token 1): REJECTED with the refusal the case names, which the run accepts; a case
    without it (the same row, rejected_by taken away) is not accepted."""
    import dataclasses

    case = next(c for c in cases_model_config.model_config_cases(ROOT) if c.kernel == "core/mlp/mlp_tkg"
                and c.shapes == "B=128 S=1 H=8192 I=1792" and c.name.startswith("bf16 rms_norm"))
    row = harness.run_case(case, ROOT)
    assert (row.result, row.verdict) == (harness.SKIPPED, harness.REJECTED), harness.format_row(row)
    assert "dma_copy: tensor 'hidden_tensor': access [8192, 1056767] out of bounds for storage of 1048576 " \
        "elements" in row.message, row.message
    assert harness.row_ok(case, row)
    assert not harness.row_ok(dataclasses.replace(case, rejected_by=""), row)
