"""The ``tpbSgCyclesSum`` values of nki-library's integration-test tables (commit d2ad3a5), read row by row.

nki-library's tests carry, in many parametrised rows, a ``tpbSgCyclesSum`` value that the tests themselves ignore
("FIXME: use qor once framework supports"). Its name is the metric ``test/utils/metrics_collector.py`` records from
a device run (``_parse_show_session_json_files``: per physical core the runtime's show-session ``CycleCount`` of
each graph, an IQR-filtered average over the runs, the max over the cores); the test README calls the column
"cycles". The rows were recorded on trn2 (the tests' ``--platform-target trn2``). What the unit is, and why it is
read here as picoseconds of device time, is in docs/cost-model.md ("nki-library's recorded device times").

This module only reads the tables: :func:`rows` parses each test file with ``ast`` (the files are data here; no
nki-library code is imported or copied) and returns one :class:`Row` per table row, with its file, line, table,
fields and value; :func:`classify` applies the written rule that decides which rows are calibration points
(docs/cost-model.md). The estimates of the rows are in ``nkilib_run.py``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMIT = "d2ad3a5"
TESTS = "test/integration/nkilib"

# Each table: (test file under TESTS, the variable holding the rows, the test function that runs them, the
# fields of a row in order, as the file's own parameter string or comment names them).
_MLP_CTE_FIELDS = ("vnc_degree", "batch", "seqlen", "hidden", "intermediate", "tpbSgCyclesSum", "rtol",
                   "norm_type", "quant_type", "fused_add", "store_add", "skip_gate", "act_fn_type", "gate_bias",
                   "up_bias", "down_bias", "norm_bias")
_MLP_TKG_FIELDS = ("vnc_degree", "batch", "seqlen", "hidden", "intermediate", "dtype", "quant_dtype", "quant_type",
                   "tpbSgCyclesSum", "norm_type", "fused_add", "store_add", "act_fn_type", "skip_gate",
                   "gate_bias", "up_bias", "down_bias", "norm_bias", "gate_up_column_tiling",
                   "down_column_tiling", "down_optimized_layout")
_ATTN = "core/attention/test_attention_cte.py"
_APC_FIELDS = ("vnc_degree", "bs", "seqlen_kv", "seqlen_q", "prior_len", "prior_used_len", "d", "softmax_scale",
               "dtype", "causal_mask", "tp_q", "tp_k", "tp_out", "sink", "sliding_window", "tpbSgCyclesSum")
_GQA_FIELDS = ("vnc_degree", "bs", "bs_kv", "seqlen_kv", "seqlen_q", "prior_len", "prior_used_len", "d",
               "softmax_scale", "dtype", "causal_mask", "tp_q", "tp_k", "tp_out", "sink", "sliding_window",
               "tpbSgCyclesSum")
TABLES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("core/rmsnorm/test_rmsnorm_quant.py", "rmsnorm_quant_lnc_perms", "test_rmsnorm_quant_lnc_unit",
     ("seqlen", "quant_only", "quant_type", "tpbSgCyclesSum", "tensor_gen", "lower_bound", "lnc_degree", "batch",
      "hidden")),
    *(("core/mlp/test_mlp_cte.py", f"MLP_CTE_UNIT_TEST_CASES_{t}", "test_mlp_cte_unit", _MLP_CTE_FIELDS)
      for t in ("GATE_BIAS_FALSE", "GATE_BIAS_TRUE", "ROW_QUANT", "STATIC_QUANT")),
    ("core/mlp/test_mlp_cte_model_config.py", "mlp_cte_model_configs", "test_mlp_cte_unit", _MLP_CTE_FIELDS),
    *(("core/mlp/test_mlp_tkg.py", v, "test_mlp_tkg_unit", _MLP_TKG_FIELDS) for v in (
        "nki_tkg_fused_norm_mlp_kernel_spmd_vnc2_params", "nki_tkg_fused_norm_mlp_kernel_spmd_vnc1_params",
        "nki_tkg_fused_norm_mlp_kernel_spmd_vnc2_swap_perms", "nki_tkg_fused_norm_mlp_kernel_spmd_skip_gate",
        "nki_tkg_fused_norm_mlp_row_quant_kernel_params", "nki_tkg_fused_norm_mlp_row_quant_kernel_layout_swap_perms",
        "nki_tkg_fused_norm_mlp_static_quant_kernel_params",
        "nki_tkg_fused_norm_mlp_static_quant_kernel_layout_swap_perms",
        "nki_tkg_fused_norm_mlp_mx_quant_kernel_params")),
    ("core/mlp/test_mlp_tkg.py", "nki_tkg_fused_norm_mlp_kernel_separation_pass_params", "test_mlp_tkg_separation_pass",
     _MLP_TKG_FIELDS),
    ("core/mlp/test_mlp_tkg_model_config.py", "mlp_tkg_model_configs", "test_mlp_tkg_unit", _MLP_TKG_FIELDS),
    (_ATTN, "attention_cte_no_cp_unit_perms", "test_attention_cte_no_cp_unit",
     ("bs", "seqlen_kv", "seqlen_q", "d", "softmax_scale", "dtype", "causal_mask", "tp_q", "tp_out", "tpbSgCyclesSum")),
    (_ATTN, "attention_cte_no_cp_vnc_apc_klr_unit_perms", "test_attention_cte_no_cp_vnc_apc_klr_unit", _APC_FIELDS),
    (_ATTN, "attention_cte_no_cp_vnc_param_unit_perms", "test_attention_cte_no_cp_vnc_param_unit",
     ("vnc_degree", "bs", "seqlen_kv", "seqlen_q", "d", "softmax_scale", "dtype", "causal_mask", "tp_q", "tp_out",
      "sink", "sliding_window", "tpbSgCyclesSum")),
    (_ATTN, "attention_cte_no_cp_vnc_gqa_unit_perms", "test_attention_cte_no_cp_vnc_gqa_unit", _GQA_FIELDS),
    (_ATTN, "attention_cte_no_cp_vnc_barometer_perms", "test_attention_cte_no_cp_vnc_barometer_unit", _GQA_FIELDS),
    ("experimental/benchmark/test_find_nonzero_indices_with_count.py", "find_nonzero_indices_perms",
     "test_find_nonzero_indices_unit", ("T", "pct_nonzero", "tpbSgCyclesSum")),
)

# the family each test file's rows belong to (the kernel nki-library's test runs)
FAMILY = {"test_rmsnorm_quant.py": "rmsnorm_quant", "test_mlp_cte.py": "mlp_cte",
          "test_mlp_cte_model_config.py": "mlp_cte", "test_mlp_tkg.py": "mlp_tkg",
          "test_mlp_tkg_model_config.py": "mlp_tkg", "test_attention_cte.py": "attention_cte",
          "test_find_nonzero_indices_with_count.py": "find_nonzero_indices_with_count"}


@dataclass(frozen=True)
class Row:
    file: str  # under TESTS
    line: int
    table: str
    test: str
    fields: dict = field(compare=False)  # name -> value (a literal, or the source text of a name such as "nl.bfloat16")
    value: Any  # the row's tpbSgCyclesSum as written (an int / float, None, or the first of a (value, None) pair)

    @property
    def family(self) -> str:
        return FAMILY[Path(self.file).name]

    @property
    def where(self) -> str:
        return f"nki-library {COMMIT} {TESTS}/{self.file}:{self.line} ({self.table})"

    def config(self) -> tuple:
        """The row's fields but its value: what a measurement of it depends on."""
        return tuple((k, repr(v)) for k, v in self.fields.items() if k != "tpbSgCyclesSum")


def _value(node: ast.AST) -> Any:
    """A literal, arithmetic on literals (``128 // 64``, ``1/32``, ``16 * 1024 + 16``, ``ceilalign(1600, 128)``), a
    tuple of those, or
    else the node's source text (``nl.bfloat16``, ``NormType.RMS_NORM``, ``gaussian_tensor_generator()``)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_value(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _value(node.operand)
        return -v if isinstance(v, (int, float)) else ast.unparse(node)
    if isinstance(node, ast.BinOp):
        a, b = _value(node.left), _value(node.right)
        ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b, ast.Div: lambda: a / b,
               ast.FloorDiv: lambda: a // b}
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and type(node.op) in ops:
            return ops[type(node.op)]()
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "ceilalign" and len(node.args) == 2:
        n, a = (_value(x) for x in node.args)  # test_mlp_cte.py's ceilalign(n, a): n rounded up to a multiple of a
        if isinstance(n, int) and isinstance(a, int):
            return -(-n // a) * a
    return ast.unparse(node)


def _row_nodes(value: ast.AST) -> list[ast.AST]:
    """The row nodes of a table: a list of lists / tuples, or a dict of such lists (model-config tables)."""
    if isinstance(value, ast.Dict):
        return [r for v in value.values for r in _row_nodes(v)]
    if isinstance(value, (ast.List, ast.Tuple)):
        return [e for e in value.elts if isinstance(e, (ast.List, ast.Tuple))]
    return []


def rows(root: Path) -> list[Row]:
    """Every row of :data:`TABLES` in the checkout ``root`` (nki-library's repository root)."""
    out = []
    trees: dict[str, ast.Module] = {}
    for rel, var, test, names in TABLES:
        if rel not in trees:
            trees[rel] = ast.parse((root / TESTS / rel).read_text())
        assigns = [n for n in ast.walk(trees[rel]) if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == var for t in n.targets)]
        if len(assigns) != 1:
            raise ValueError(f"nkilib_rows: {rel} has {len(assigns)} assignments of table {var!r}, expected 1")
        for node in _row_nodes(assigns[0].value):
            vals = [_value(e) for e in node.elts]
            if len(vals) != len(names):
                raise ValueError(f"nkilib_rows: {rel}:{node.lineno} ({var}) has {len(vals)} fields, expected "
                                 f"{len(names)} ({', '.join(names)})")
            fields = dict(zip(names, vals))
            value = fields["tpbSgCyclesSum"]
            if isinstance(value, tuple):  # attention_cte writes (value, None)
                value = value[0]
            out.append(Row(rel, node.lineno, var, test, fields, value))
    return out


# -- which rows are calibration points ---------------------------------------------------------------
NOT_A_FIGURE = "no value (None or 0): the test records nothing for this row"
REPEAT = "the same configuration and value as {where}: one measurement, counted once"
COPY = "the value of {where}, a different configuration: a copied value, not this row's measurement"
ROUNDED = "written to {n} significant digits"


def significant_digits(v: float) -> int:
    """Digits of ``v``'s integer part without trailing zeros: 580e6 -> 2, 89_102_777 -> 8."""
    return len(str(int(round(v))).rstrip("0") or "0")


def classify(all_rows: list[Row]) -> list[tuple[Row, str, str]]:
    """``(row, role, why)`` per row, by the rule written before any estimate (docs/cost-model.md):

    - no value (None, 0): not a figure, no point (``role`` "none");
    - the same value as an earlier row of the same family: the same configuration is a repeat (``"none"``, counted
      once); at a different configuration, a value of 4 or more significant digits is a copied value
      (``"context"``: shown, not tested; at most one of the two rows can have measured it, and the earlier is
      kept), while two values rounded to 3 or fewer digits (attention_cte writes ``580e6``) may agree by chance
      and stay check points;
    - every other row: a ``"check"`` point (nothing is fitted to these figures). ``why`` says when a check
      point's value is rounded (3 or fewer significant digits).
    """
    seen: dict[tuple[str, float], Row] = {}
    out = []
    for r in all_rows:
        v = r.value
        if v is None or not isinstance(v, (int, float)) or v == 0:
            out.append((r, "none", NOT_A_FIGURE))
            continue
        key = (r.family, float(v))
        first = seen.get(key)
        digits = significant_digits(v)
        rounded = ROUNDED.format(n=digits) if digits <= 3 else ""
        if first is None:
            seen[key] = r
            out.append((r, "check", rounded))
        elif first.config() == r.config():
            out.append((r, "none", REPEAT.format(where=f"line {first.line}")))
        elif digits <= 3:
            out.append((r, "check", f"{rounded}; the same value as line {first.line}"))
        else:
            out.append((r, "context", COPY.format(where=f"{Path(first.file).name}:{first.line}")))
    return out


# -- the frozen table (nkilib_points.csv) and its rows of split.csv ----------------------------------
HERE = Path(__file__).resolve().parent
POINTS_CSV = HERE / "nkilib_points.csv"
POINT_FIELDS = ("point", "family", "role", "why", "file", "line", "table", "test", "value", "published_us", "fields")
UNIT = "tpbSgCyclesSum read as picoseconds (docs/cost-model.md)"


def point_name(r: Row) -> str:
    return f"nkilib {Path(r.file).stem}:{r.line}"


def point_rows(root: Path) -> list[dict]:
    """One dict per table row, as nkilib_points.csv stores it (published_us: the value / 1e6, empty without one)."""
    import json

    out = []
    for r, role, why in classify(rows(root)):
        fields = {k: v for k, v in r.fields.items() if k != "tpbSgCyclesSum"}
        published = "" if role == "none" else f"{float(r.value) / 1e6:.6f}"
        out.append({"point": point_name(r), "family": r.family, "role": role, "why": why, "file": f"{TESTS}/{r.file}",
                    "line": r.line, "table": r.table, "test": r.test, "value": repr(r.value),
                    "published_us": published, "fields": json.dumps(fields)})
    return out


def read_points() -> list[dict]:
    """nkilib_points.csv's rows, fields decoded."""
    import csv
    import json

    with POINTS_CSV.open(newline="") as f:
        rows_ = list(csv.DictReader(f))
    for r in rows_:
        r["fields"] = json.loads(r["fields"])
        r["line"] = int(r["line"])
    return rows_


def split_rows(points: list[dict]) -> list[dict]:
    """The rows these points add to split.csv (check and context; a row without a figure is no point)."""
    return [{"point": p["point"], "role": p["role"], "fits": "",
             "why": (f"{p['file']}:{p['line']} tpbSgCyclesSum {p['value']} at nki-library {COMMIT}; {UNIT}"
                     + (f"; {p['why']}" if p["why"] else ""))}
            for p in points if p["role"] in ("check", "context")]


def main() -> int:
    """``python nkilib_rows.py [NKILIB_ROOT]``: (re)writes nkilib_points.csv and the nkilib rows of split.csv."""
    import csv
    import sys

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if root is None:
        from trnkit.conformance import harness

        root = harness.nkilib_root()
    pts = point_rows(root)
    with POINTS_CSV.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=POINT_FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(pts)
    split_path = HERE / "split.csv"
    with split_path.open(newline="") as f:
        kept = [r for r in csv.DictReader(f) if not r["point"].startswith("nkilib ")]
    with split_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=("point", "role", "fits", "why"), lineterminator="\n")
        w.writeheader()
        w.writerows(kept + split_rows(pts))
    print(f"{len(pts)} rows -> {POINTS_CSV.name}; {len(split_rows(pts))} points -> split.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
