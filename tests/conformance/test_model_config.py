"""The model-config tier: nki-library's ``test_*_model_config.py`` tables read from the checkout and built
into cases by the kernels' family builders."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from trnkit.conformance import cases, cases_model_config, harness

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
    weights); output_proj_cte's table is read only by a trn3 test, mlp_cte / attention / moe_cte's are empty."""
    model = [c for c in cases.all_cases(ROOT) if c.tier == harness.MODEL_CONFIG]
    counts = {k: sum(c.kernel == k for c in model) for k in cases_model_config.TABLES}
    assert counts == {"core/mlp/mlp_tkg": 342, "core/qkv/qkv_cte": 81, "core/moe/moe_tkg": 308,
                      "core/moe_block/moe_block_tkg": 320}
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
    assert all("x fp8" not in c.name and c.rejected_by == cases_model_config.HEAP_OOM for c in cte if c not in fp8)
    assert all(c.xfail == cases_model_config.MOE_TKG_XFAIL for c in model.values() if c.kernel == "core/moe/moe_tkg")
    qkv = model["core/qkv/qkv_cte|model bf16 no_norm BSD dma_transpose model_config|lnc2|B=1 S=1024 H=8192 "
                "heads=16/2 d=128"]
    with harness.nki_is_interpreter(ROOT):
        kw = qkv.inputs()
    assert kw["fused_qkv_weights"].shape == (8192, (16 + 2 * 2) * 128) and kw["load_input_with_DMA_transpose"]
