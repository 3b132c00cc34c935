"""Benchmark harness: schema round trip, timing quantiles, estimate rows, table, CLI --quick output."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trnkit.bench import COLUMNS, Case, Prepared, Row, markdown_table, read_rows, run_case, time_quantiles, write_rows
from trnkit.bench.schema import latest_rows
from trnkit.bench import cases as bench_cases
from trnkit.demo import matmul_tiled
from trnkit.nkisim import cost, trace

ROOT = Path(__file__).resolve().parents[1]


def _row(**kw) -> Row:
    base = dict(kernel="k", impl="nki", mode="forward", metric="est_time", unit="us", x_name="S", x_value=128,
                p50=2.0, p20=1.0, p80=3.0, extra="{}", device="trn2 (cost model)", timestamp="t",
                trnkit_version="0")
    return Row(**{**base, **kw})


def test_schema_round_trip_and_validation(tmp_path):
    rows = [_row(), _row(x_value="0.6B", x_name="flavor", p50=1.5, extra=json.dumps({"B": 1}))]
    path = write_rows(tmp_path / "b.csv", rows[:1], append=True)
    write_rows(path, rows[1:], append=True)  # header written once
    with path.open() as f:
        lines = list(csv.reader(f))
    assert tuple(lines[0]) == COLUMNS and len(lines) == 3
    back = read_rows(path)
    assert back == rows and back[1].config == {"B": 1} and back[0].x_value == 128
    with pytest.raises(ValueError, match="p50 must be a number.*k/nki/est_time at S=128"):
        _row(p50=float("nan"))
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="does not have the trnkit benchmark columns"):
        read_rows(tmp_path / "bad.csv")


def test_time_quantiles_measure_wall_time():
    info: dict = {}
    p50, p20, p80 = time_quantiles(lambda: time.sleep(0.002), min_reps=5, budget_s=0.05, info=info)
    assert 2000 <= p20 <= p50 <= p80 < 200_000  # microseconds; the machine may be busy
    assert info["reps"] >= 5 and not info["cold"]
    # a call slower than max_total_s / 2 is measured once, cold
    calls = []
    p = time_quantiles(lambda: (calls.append(1), time.sleep(0.03)), max_total_s=0.04, info=info)
    assert len(calls) == 1 and info == {"reps": 1, "cold": True} and p[0] == p[1] == p[2] >= 30_000
    # otherwise the total time cap stops the repetitions early (but after at least one timed call)
    calls.clear()
    # (0.2 s cap: a loaded machine may stretch one 10 ms sleep past 25 ms, which would count as "slow")
    time_quantiles(lambda: (calls.append(1), time.sleep(0.01)), min_reps=50, max_total_s=0.2, info=info)
    assert 2 <= len(calls) < 25 and info["reps"] == len(calls) - 1


def _matmul_case(n: int = 512) -> Case:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(n, n, generator=g).to(torch.bfloat16)
    b = torch.randn(n, n, generator=g).to(torch.bfloat16)
    return Case("matmul_tiled", "forward", "M=N=K", n, lambda: Prepared(lambda: matmul_tiled(a, b), lambda: a.T @ b),
                {"dtype": "bfloat16"}), a, b


def test_run_case_rows_match_an_independent_estimate():
    case, a, b = _matmul_case()
    rows = run_case(case, budget_s=0.05)
    by = {(r.impl, r.metric): r for r in rows}
    with trace.record() as tr:  # full arithmetic this time: the estimate must not depend on trace_only
        matmul_tiled(a, b)
    rep = cost.estimate(tr)
    assert by[("nki", "est_time")].p50 == pytest.approx(rep.total_ns / 1e3)
    # the model's low / high ends in the p20 / p80 columns, and the fraction's ends the other way round
    low, _, high = rep.total_range_ns
    est, frac = by[("nki", "est_time")], by[("nki", "fraction_of_roofline")]
    assert (est.p20, est.p80) == (pytest.approx(low / 1e3), pytest.approx(high / 1e3)) and low < high
    assert (frac.p20, frac.p80) == (pytest.approx(rep.roofline_ns / high), pytest.approx(rep.roofline_ns / low))
    assert by[("roofline", "est_time")].p50 == pytest.approx(rep.roofline_ns / 1e3)
    assert by[("nki", "busy_tensor")].p50 == pytest.approx(4 * 4 * 512 / 2.4 / 1e3)  # 16 full matmuls
    assert by[("nki", "fraction_of_roofline")].p50 == pytest.approx(rep.roofline_ns / rep.total_ns)
    assert by[("roofline", "est_time")].p50 < by[("nki", "est_time")].p50 < by[("nki", "serial_time")].p50
    torch_row = by[("torch", "wall_time")]
    assert torch_row.device.startswith("cpu") and 0 < torch_row.p20 <= torch_row.p50 <= torch_row.p80
    assert by[("nki", "est_time")].details["n_instrs"] == len(tr) == 56
    assert by[("nki", "est_time")].config == {"dtype": "bfloat16"} == torch_row.config
    table = markdown_table(rows)
    assert table.count("\n") == 2 and "| matmul_tiled | forward | M=N=K=512 |" in table
    def us(v: float) -> str:  # the table's rule: one decimal from 10 us up, two below
        return f"{v:,.1f}" if v >= 10 else f"{v:.2f}"
    assert f"{us(est.p50)} [{us(est.p20)}-{us(est.p80)}]" in table


def test_unknown_or_missing_kernels_are_reported():
    assert "unknown kernel 'nope'" in bench_cases.unavailable("nope")
    assert bench_cases.unavailable("matmul_tiled") is None
    with pytest.raises(ValueError, match="cannot benchmark nope"):
        bench_cases.cases_for("nope", quick=True)


def _run_cli(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trnkit.bench", *args, "--quick", "--budget", "0.02",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MPLBACKEND": "Agg"})


def _check_outputs(out: Path, kernels: set[str]) -> None:
    rows = read_rows(out / "bench.csv")
    assert {r.kernel for r in rows} == kernels
    for r in rows:
        assert all(math.isfinite(v) and v > 0 for v in (r.p50, r.p20, r.p80)), r
        assert r.p20 <= r.p50 <= r.p80
    for k in kernels:
        est = [r for r in rows if r.kernel == k and r.impl == "nki" and r.metric == "est_time"]
        roof = {(r.mode, r.x_value, r.config_key): r.p50 for r in rows if r.kernel == k and r.impl == "roofline"}
        assert est and all(r.p50 >= roof[(r.mode, r.x_value, r.config_key)] for r in est)
        assert any(r.impl == "torch" for r in rows if r.kernel == k)
        pngs = list((out / "plots").glob(f"{k}_*.png"))
        assert len(pngs) >= 2
        for p in pngs:
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    md = (out / "bench.md").read_text()
    assert "Estimated = trnkit's trn2 cost model" in md and all(f"| {k} |" in md for k in kernels)


def test_cli_quick_writes_csv_table_and_plots(tmp_path):
    r = _run_cli(tmp_path, "matmul_tiled", "--dtype", "bfloat16", "float32")
    assert r.returncode == 0, r.stdout + r.stderr
    _check_outputs(tmp_path, {"matmul_tiled"})
    rows = read_rows(tmp_path / "bench.csv")
    est = {(r.config["dtype"], r.x_value): r.p50 for r in rows if r.impl == "nki" and r.metric == "est_time"}
    assert est[("float32", 512)] > est[("bfloat16", 512)]  # fp32: 4x TensorE cycles, 2x the bytes
    names = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert "matmul_tiled_forward_M-N-K_float32_time.png" in names
    md = (tmp_path / "bench.md").read_text()
    assert md.count("| matmul_tiled | forward |") == 4  # 2 sizes x 2 dtypes
    # --report-only rebuilds the table and plots from the CSV alone
    from trnkit.bench.__main__ import main

    (tmp_path / "bench.md").unlink()
    for p in (tmp_path / "plots").glob("*.png"):
        p.unlink()
    assert main(["--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bench.md").read_text() == md
    assert {p.name for p in (tmp_path / "plots").glob("*.png")} == names
    assert len(read_rows(tmp_path / "bench.csv")) == len(rows)


def test_cli_rejects_unknown_kernel(tmp_path):
    r = _run_cli(tmp_path, "nope")
    assert r.returncode == 2 and "cannot benchmark nope" in r.stderr


@pytest.mark.slow
def test_cli_quick_all_available_kernels(tmp_path):
    r = _run_cli(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    available = {k for k in bench_cases.KERNELS if bench_cases.unavailable(k) is None}
    _check_outputs(tmp_path, available)


def test_cases_outside_kernel_constraints_are_skipped_not_fatal():
    from trnkit.bench import run_cases
    from trnkit.kernels.constraints import KernelConstraintError, Violation

    def unsupported() -> Prepared:
        raise KernelConstraintError([Violation("k", "S % 128 == 0", 100)])

    ok, _, _ = _matmul_case(512)
    logs: list[str] = []
    rows = run_cases([Case("k", "forward", "S", 100, unsupported), ok], measure_torch=False, log=logs.append)
    assert {r.kernel for r in rows} == {"matmul_tiled"}
    assert "skipped, outside the kernel's constraints: k: constraint 'S % 128 == 0' violated (got 100)" in logs[0]

    def broken() -> Prepared:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_cases([Case("k", "forward", "S", 1, broken)], measure_torch=False, log=None)
    failures: list[str] = []  # keep going: the failure is recorded, later cases still run
    rows = run_cases([Case("k", "forward", "S", 1, broken), ok], measure_torch=False, log=None, failures=failures)
    assert failures == ["k/forward S=1: RuntimeError: boom"] and {r.kernel for r in rows} == {"matmul_tiled"}


def test_real_nki_path_reports_measured_device_rows(monkeypatch):
    # With the real nki (not installable here) the harness times the kernel instead of estimating it.
    # Exercise that branch with the interpreter standing in for the device.
    import trnkit.nki_api

    monkeypatch.setattr(trnkit.nki_api, "REAL_NKI", True)
    case, _, _ = _matmul_case(512)
    rows = run_case(case, budget_s=0.02)
    assert {(r.impl, r.metric, r.device) for r in rows} == {("nki", "wall_time", "trainium"),
                                                            ("torch", "wall_time", rows[-1].device)}
    dev = next(r for r in rows if r.device == "trainium")
    assert 0 < dev.p20 <= dev.p50 <= dev.p80 and "host perf_counter" in dev.details["timer"]
    assert "| matmul_tiled | forward | M=N=K=512 | dtype=bfloat16 | - | - | - | - |" in markdown_table(rows)


# --- where outputs go: outputs/bench/ by default, the tracked benchmarks/data/ only with --save-reference ---
def test_bench_cli_writes_to_outputs_bench_unless_save_reference(tmp_path, monkeypatch, capsys):
    from trnkit.bench.__main__ import main

    monkeypatch.chdir(tmp_path)  # the defaults are relative to the working directory (the repo root)
    assert main(["--report-only"]) == 1
    assert f"no results in {Path('outputs/bench/bench.csv')}" in capsys.readouterr().out
    assert main(["--report-only", "--quick"]) == 1
    assert f"no results in {Path('outputs/bench/quick/bench.csv')}" in capsys.readouterr().out
    assert main(["--report-only", "--save-reference"]) == 1
    assert f"no results in {Path('benchmarks/data/bench.csv')}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--quick", "--save-reference"])
    assert "--save-reference with --quick" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--save-reference", "--out", "x"])
    assert "not allowed with argument" in capsys.readouterr().err


def _copy_script(name: str, root: Path) -> Path:
    """The benchmark script placed in a throw-away tree: its defaults are anchored at its own repo root."""
    (root / "benchmarks").mkdir()
    script = root / "benchmarks" / name
    script.write_text((ROOT / "benchmarks" / name).read_text())
    return script


def _run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, str(script), *args], cwd=script.parent.parent, env=env,
                          capture_output=True, text=True, timeout=600)


def test_interp_speed_leaves_reference_data_alone_by_default(tmp_path):
    script = _copy_script("interp_speed.py", tmp_path)
    r = _run_script(script, "--size", "512", "--dtype", "float32", "--repeat", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = list(csv.DictReader((tmp_path / "outputs" / "bench" / "interp_speed.csv").open()))
    assert [row["M"] for row in rows] == ["512"] and float(rows[0]["interp_s"]) > 0
    assert not (tmp_path / "benchmarks" / "data").exists()


def test_qwen3_step_leaves_reference_data_alone_by_default(tmp_path):
    script = _copy_script("qwen3_step.py", tmp_path)
    tiny = ("--flavors", "debug", "--vocab", "256", "--batch", "1", "--seqs", "8", "--dtypes", "float32",
            "--repeat", "1", "--warmup", "0")
    r = _run_script(script, *tiny)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = list(csv.DictReader((tmp_path / "outputs" / "bench" / "qwen3_step_vocab256.csv").open()))
    assert {row["impl"] for row in rows} == {"trnkit", "transformers[default]"}
    assert {row["reps"] for row in rows} == {"1"}
    setup = {row["impl"]: row["setup"] for row in rows}
    assert setup == {"trnkit": "fp32; chunked loss 256", "transformers[default]": "fp32; labels=; sdpa"}
    assert not (tmp_path / "benchmarks" / "data").exists()
    # a side slower than --slow-step-s is timed by its first step alone (here: every side)
    r = _run_script(script, *tiny[:-4], "--repeat", "2", "--warmup", "1", "--slow-step-s", "0", "--name", "cold")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = list(csv.DictReader((tmp_path / "outputs" / "bench" / "cold.csv").open()))
    assert [row["reps"] for row in rows] == ["1 cold", "1 cold"]


def test_output_dir_anchors_scripts_at_their_repo_root(tmp_path):
    import argparse

    from trnkit.bench.paths import add_output_args, output_dir

    p = argparse.ArgumentParser()
    add_output_args(p, "figures")
    assert output_dir(p.parse_args([]), root=tmp_path) == tmp_path / "outputs" / "bench"
    assert output_dir(p.parse_args(["--save-reference"]), root=tmp_path) == tmp_path / "benchmarks" / "data"
    assert output_dir(p.parse_args(["--out", "x"]), root=tmp_path) == Path("x")
    assert output_dir(p.parse_args([]), scratch_sub="quick") == Path("outputs/bench/quick")


def test_plan_check_writes_outputs_bench_unless_save_reference(tmp_path, monkeypatch):
    """benchmarks/plan_check.py follows the rule above: its tracked CSV (which tests/harness/test_plan.py
    checks) is rewritten only with --save-reference."""
    from trnkit.bench.paths import load_script

    script = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "plan_check.py", "plan_check_out")
    row = {"case": "c", "plan_gib": 1.0, "measured_gib": 1.0, "plan_error": 0.0, "torchtitan_gib": 1.0,
           "torchtitan_error": 0.0, "peak_phase": "forward"}
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "CASES", [("c", "debug_moe", [])])
    monkeypatch.setattr(script, "check", lambda *a: dict(row))
    assert script.main([]) == 0
    assert (tmp_path / "outputs" / "bench" / "plan_check.csv").exists()
    assert not (tmp_path / "benchmarks").exists()
    assert script.main(["--save-reference"]) == 0
    rows = list(csv.DictReader((tmp_path / "benchmarks" / "data" / "plan_check.csv").open()))
    assert [r["case"] for r in rows] == ["c"]


def test_merge_newest_replaces_only_rows_of_the_same_shape_metric_and_config(tmp_path):
    from trnkit.bench.schema import merge_newest

    old = [_row(kernel="a", x_value=1, p50=5.0, p20=4.0, p80=6.0), _row(kernel="a", x_value=2),
           _row(kernel="b", x_value=1), _row(kernel="a", x_value=1, extra=json.dumps({"dtype": "float32"}))]
    path = write_rows(tmp_path / "b.csv", old)
    assert merge_newest(path) == 0 and read_rows(path) == old  # nothing to replace: file unchanged
    new = _row(kernel="a", x_value=1, p50=9.0, p20=8.0, p80=10.0,
               extra=json.dumps({"details": {"bottleneck": "dma"}}), timestamp="t2")  # details are not config
    write_rows(path, [new])
    assert merge_newest(path) == 1
    assert read_rows(path) == [new, *old[1:]]  # the newer row in the older one's place, the rest kept


def test_cli_rerun_of_one_kernel_replaces_its_rows(tmp_path):
    from trnkit.bench.__main__ import main

    args = ["matmul_tiled", "--quick", "--budget", "0.02", "--out", str(tmp_path)]
    assert main(args) == 0
    first = read_rows(tmp_path / "bench.csv")
    write_rows(tmp_path / "bench.csv", [_row(kernel="other")])  # another kernel's row: kept as it is
    assert main([*args, "--no-torch"]) == 0
    rows = read_rows(tmp_path / "bench.csv")
    assert len(rows) == len(first) + 1 and _row(kernel="other") in rows
    torch_rows = [r for r in rows if r.impl == "torch"]
    assert torch_rows == [r for r in first if r.impl == "torch"]  # not re-run: the earlier timing stays
    est = [r for r in rows if r.kernel == "matmul_tiled" and r.impl == "nki" and r.metric == "est_time"]
    assert sorted(r.x_value for r in est) == [512, 1024]  # re-estimated, not duplicated



def test_estimate_range_spans_the_three_settings():
    from trnkit.bench.harness import estimate_range

    assert estimate_range((1.0, 2.0, 3.0)) == (1.0, 2.0, 3.0)
    # a list schedule is not monotone in its parameters: the optimistic setting may finish after mid
    assert estimate_range((2.86, 2.78, 3.05)) == (2.78, 2.78, 3.05)
    assert estimate_range((2.0, 2.5, 2.4)) == (2.0, 2.5, 2.5)


def _reference_estimates() -> dict[tuple, dict[tuple[str, str], Row]]:
    groups: dict[tuple, dict[tuple[str, str], Row]] = {}
    for r in latest_rows(read_rows(ROOT / "benchmarks" / "data" / "bench.csv")):
        if r.device.endswith("(cost model)"):
            groups.setdefault((r.kernel, r.mode, r.x_name, r.x_value, r.config_key), {})[(r.impl, r.metric)] = r
    return groups


def test_reference_bench_csv_carries_ordered_ranges():
    """The cost-model estimates of benchmarks/data/bench.csv: p20 / p50 / p80 = low / mid / high end of the
    time, and the fraction of roofline = roofline / time at the other end; every estimate has its range.
    The roofline counts the kernel's own HBM traffic; at the optimistic end the compiler may drop reloads of
    unchanged HBM data (cost_params ``reuse_loads``), so only the mid and pessimistic ends are bounded by it."""
    groups = _reference_estimates()
    assert groups
    for key, g in groups.items():
        est, frac, roof = g[("nki", "est_time")], g[("nki", "fraction_of_roofline")], g[("roofline", "est_time")]
        assert "range" in est.details, f"estimate without its range: {key}"
        assert 0 < est.p20 <= est.p50 <= est.p80 and 0 < roof.p50 <= est.p50, key
        assert (frac.p20, frac.p50, frac.p80) == pytest.approx(
            (roof.p50 / est.p80, roof.p50 / est.p50, roof.p50 / est.p20), rel=1e-6), key
    assert any(k[0] == "rope_hf" for k in groups)


@pytest.mark.parametrize("args, message", [
    (["--budget", "-1"], "--budget: seconds of timing per measured quantity must be a finite number > 0, got -1.0"),
    (["--budget", "nan"], "--budget: seconds of timing per measured quantity must be a finite number > 0, got nan"),
    (["--torch-threads", "-3"], "--torch-threads must be >= 0 (0: torch's default), got -3"),
    (["--out", "FILE"], "--out: cannot write to FILE (File exists)"),
    (["--mode", "backward", "--kernels-only", "matmul_tiled"],
     "no cases of matmul_tiled for --mode backward --dtype bfloat16"),
])
def test_cli_refuses_bad_flags_before_running(tmp_path, capsys, args, message):
    """Probed: --budget -1 / nan ran the sweep, --torch-threads -3 and an --out that is a file ended in
    tracebacks after the first case, matmul_tiled --mode backward said only 'no results'."""
    from trnkit.bench.__main__ import main

    afile = tmp_path / "afile"
    afile.write_text("x")
    args = [str(afile) if a == "FILE" else a for a in args]
    kernels = ["matmul_tiled"] if "--kernels-only" in args else ["rope_hf"]
    args = [a for a in args if a not in ("--kernels-only", "matmul_tiled")]
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        main([*kernels, "--quick", "--no-torch", *out, *args])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message.replace('FILE', str(afile))}")
