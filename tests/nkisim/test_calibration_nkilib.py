"""nki-library's recorded device times (tpbSgCyclesSum) as calibration points: the frozen table and its split.

benchmarks/calibration/nkilib_points.csv is read from nki-library's test files (nkilib_rows.py); every row with a
figure is a check point (or context, where its value is another configuration's), fixed in split.csv before any
estimate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "calibration"))

import nkilib_rows  # noqa: E402
from points import SPLIT  # noqa: E402


def test_points_csv_is_the_test_tables_as_read_now():
    from trnkit.conformance import harness

    root = harness.nkilib_root()
    if root is None:
        pytest.skip("no nki-library checkout or archive (NKILIB_SRC)")
    frozen = nkilib_rows.read_points()
    fresh = nkilib_rows.point_rows(root)
    assert [(r["point"], r["role"], r["published_us"]) for r in frozen] == \
        [(r["point"], r["role"], r["published_us"]) for r in fresh]


def test_every_nkilib_point_is_in_the_split_and_nothing_is_fitted_to_them():
    pts = nkilib_rows.read_points()
    split = {n: r for n, r in SPLIT.items() if n.startswith("nkilib ")}
    assert {r["point"]: r for r in nkilib_rows.split_rows(pts)} == split
    assert {r["role"] for r in split.values()} == {"check", "context"}
    assert all(r["fits"] == "" for r in split.values())
    roles = [p["role"] for p in pts]
    # the counts docs/cost-model.md gives
    assert (len(pts), roles.count("check"), roles.count("context"), roles.count("none")) == (978, 334, 50, 594)


def test_the_written_rule_on_made_up_rows():
    mk = lambda line, v, **f: nkilib_rows.Row("core/mlp/test_mlp_cte.py", line, "t", "test", {"a": 1, **f,  # noqa: E731
                                                                                             "tpbSgCyclesSum": v}, v)
    got = [(role, why.split(":")[0]) for _, role, why in nkilib_rows.classify([
        mk(1, 80_453_957), mk(2, 80_453_957), mk(3, 80_453_957, b=2), mk(4, None), mk(5, 0), mk(6, 520e6),
        mk(7, 520e6, b=3)])]
    assert [g[0] for g in got] == ["check", "none", "context", "none", "none", "check", "check"]
    assert got[5][1].startswith("written to 2 significant digits")
    assert nkilib_rows.significant_digits(89_102_777) == 8 and nkilib_rows.significant_digits(125e7) == 3


# "LNC 2" rows whose kernel issues every instruction on program 0 (checked: one program in the trace), so the
# launch has no second core to wait for
ONE_PROGRAM_AT_LNC2 = {"nkilib test_attention_cte:598", "nkilib test_attention_cte:692",
                       "nkilib test_attention_cte:693"}


def test_recorded_estimates_cover_the_points_and_compute_their_errors():
    import nkilib_run

    pts = {p["point"]: p for p in nkilib_rows.read_points()}
    for r in nkilib_run.read_out().values():
        p = pts[r["point"]]
        assert r["role"] == p["role"] in ("check", "context") and r["published_us"] == p["published_us"]
        assert float(p["published_us"]) == pytest.approx(float(p["value"]) / 1e6)  # the value read as ps
        if r["status"] == "ok":
            low, mid, high = (float(r[k]) for k in ("low_us", "mid_us", "high_us"))
            assert low <= mid <= high
            # a standalone launch: the kernel's own estimate plus the launch's (cost_params.STANDALONE_LAUNCH),
            # by hand: start-up 0 / 16.9 / 37.7 us, and at LNC 2 a core skew of 0 / 0 / 33.3 us when the trace
            # has two programs (a few small attention_cte rows give the second core no work)
            two = r["lnc"] == "2" and r["point"] not in ONE_PROGRAM_AT_LNC2
            launch = (0.0, 16.9, 37.7 + (33.3 if two else 0.0))
            assert [float(r[f"launch_{k}_us"]) for k in ("low", "mid", "high")] == pytest.approx(launch)
            for k, total in zip(("low", "mid", "high"), (low, mid, high)):
                assert float(r[f"kernel_{k}_us"]) + float(r[f"launch_{k}_us"]) == pytest.approx(total, abs=0.011)
            # (mid is written to 0.01 us)
            assert float(r["error_mid"]) == pytest.approx(mid / float(p["published_us"]) - 1, abs=1e-3)
            assert (r["inside"] == "yes") == (low <= float(p["published_us"]) <= high)
        else:
            assert r["status"].startswith(("not run: ", "error: ")) and not r["mid_us"]


def test_a_row_traced_as_the_conformance_harness_builds_it():
    """nki-library's rmsnorm_quant at S = 2 (test_rmsnorm_quant.py:290, 89.10 us recorded): the runner's case is
    the conformance case of that row, and its estimate is the cost model's of that trace."""
    from trnkit.conformance import harness
    from trnkit.conformance.cases_rmsnorm_quant import rmsnorm_quant_cases

    import nkilib_run

    root = harness.nkilib_root()
    if root is None:
        pytest.skip("no nki-library checkout or archive (NKILIB_SRC)")
    p = next(p for p in nkilib_rows.read_points() if p["point"] == "nkilib test_rmsnorm_quant:290")
    case = nkilib_run.case_of(p)
    assert (case.name, case.shapes, case.entry, case.lnc) in {(c.name, c.shapes, c.entry, c.lnc)
                                                              for c in rmsnorm_quant_cases()}
    assert (case.name, case.shapes, case.lnc) == ("row fp8 rmsnorm", "B=1 S=2 H=16384", 2)
    row = nkilib_run.run_point(p, root)
    assert row["status"] == "ok" and row["published_us"] == "89.102777"
    (low, mid, high), launch = nkilib_run.estimate_case(case, root)
    assert launch == (0.0, 16_900.0, 37_700.0 + 33_300.0)  # LNC 2: start-up and core skew
    assert float(row["mid_us"]) == pytest.approx(mid / 1e3, abs=0.01)
    assert float(row["kernel_mid_us"]) == pytest.approx((mid - 16_900.0) / 1e3, abs=0.01)
    assert low <= mid <= high


def test_an_lnc_what_if_never_writes_the_rows_own_csv():
    import nkilib_run

    with pytest.raises(SystemExit):
        nkilib_run.main(["--lnc", "1", "--list"])
    p = next(p for p in nkilib_rows.read_points() if p["point"] == "nkilib test_mlp_tkg:271")
    assert p["fields"]["vnc_degree"] == 2 and nkilib_run.case_of(p).lnc == 2
    assert nkilib_run.case_of({**p, "lnc": 1}).lnc == 1
    rms = next(p for p in nkilib_rows.read_points() if p["family"] == "rmsnorm_quant" and p["role"] == "check")
    assert "LNC 2, not 1" in nkilib_run.case_of({**rms, "lnc": 1})


def test_the_lnc_1_what_if_is_apart_from_the_check():
    import nkilib_run

    whatif = nkilib_run.read_out(nkilib_run.HERE / "nkilib_whatif_lnc1.csv")
    check = nkilib_run.read_out()
    pts = {p["point"]: p for p in nkilib_rows.read_points()}
    assert whatif and all(r["lnc"] == "1" and r["status"] == "ok" for r in whatif.values())
    for name, r in whatif.items():
        assert pts[name]["table"] == "attention_cte_no_cp_unit_perms" and r["published_us"] == pts[name]["published_us"]
        assert check[name]["lnc"] == "2"  # the check keeps the table's CompilerArgs() default
        mid = float(r["mid_us"])
        assert float(r["error_mid"]) == pytest.approx(mid / float(r["published_us"]) - 1, abs=1e-3)


def test_a_row_replaces_its_earlier_row_and_leaves_no_partial_file(tmp_path):
    import nkilib_run

    out = tmp_path / "rows.csv"
    blank = dict.fromkeys(nkilib_run.FIELDS, "")
    nkilib_run.write_row({**blank, "point": "a", "mid_us": "1.00"}, out)
    nkilib_run.write_row({**blank, "point": "b", "mid_us": "2.00"}, out)
    nkilib_run.write_row({**blank, "point": "a", "mid_us": "3.00"}, out)
    assert {k: r["mid_us"] for k, r in nkilib_run.read_out(out).items()} == {"a": "3.00", "b": "2.00"}
    assert [p.name for p in tmp_path.iterdir()] == ["rows.csv"]
