"""``python -m trnkit.bench figures``: the job list covers every documented cost-model figure, bad job names
are refused, and the per-job outputs merge into the tracked data without losing other rows."""

from __future__ import annotations

import json

import pytest

from trnkit.bench import figures
from trnkit.bench.schema import Row, read_rows, write_rows


def _row(kernel: str, x: int, p50: float) -> Row:
    return Row(kernel=kernel, impl="nki", mode="forward", metric="est_time", unit="us", x_name="T", x_value=x,
               p50=p50, p20=p50, p80=p50, extra=json.dumps({"dtype": "bfloat16"}), device="trn2-model",
               timestamp="t", trnkit_version="0")


def test_jobs_cover_every_documented_figure():
    jobs = {j.name: j for j in figures.jobs()}
    commands = [" ".join(c) for j in jobs.values() for c in j.commands]
    for script in ("calibration/run.py --all", "attention_peak.py", "mlp_peak.py", "rmsnorm_peak.py",
                   "cross_entropy_peak.py", "blockwise_moe.py", "derived_figures.py"):
        assert any(script in c for c in commands), script
    assert {f"bench:{k}" for k in figures.SWEEP_KERNELS} <= set(jobs)
    assert {f"headline:{c}" for c in figures._headline_cases()} <= set(jobs)
    # the three step flavors write one CSV: one job, in sequence
    assert [c[c.index("--flavor") + 1] for c in jobs["step"].commands] == list(figures.STEP_FLAVORS)
    # jobs that would write the same file in parallel get their own output folder
    outs = [c[c.index("--out") + 1] for j in jobs.values() for c in j.commands if "--out" in c]
    assert len(outs) == len(set(outs))
    assert "--no-sensitivity" in jobs["headline:moe_bwd"].commands[0]
    assert "--no-sensitivity" not in jobs["headline:moe_fwd"].commands[0]


def test_unknown_job_is_refused(capsys):
    with pytest.raises(SystemExit):
        figures.main(["--only", "bench:nope"])
    assert "unknown job(s) ['bench:nope']" in capsys.readouterr().err


def test_jobs_that_trace_nki_library_are_refused_up_front_without_it(capsys, monkeypatch):
    monkeypatch.setattr(figures, "_nkilib_root", lambda: None)
    monkeypatch.setattr(figures, "_run_job", lambda *a: pytest.fail("a job ran"))
    with pytest.raises(SystemExit) as e:
        figures.main(["--only", "step", "mlp_peak", "nkilib_calibration", "-j", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "job(s) ['mlp_peak', 'nkilib_calibration'] trace nki-library's kernels" in err and "NKILIB_SRC" in err
    assert {j.name for j in figures.jobs() if j.nkilib} == {"attention_peak", "mlp_peak", "rmsnorm_peak",
                                                            "cross_entropy_peak", "nkilib_calibration",
                                                            "nkilib_whatif_lnc1"}


def test_list_prints_the_selected_jobs(capsys):
    assert figures.main(["--list", "--only", "step", "calibration"]) == 0
    out = capsys.readouterr().out
    assert "step:" in out and "calibration:" in out and "--flavor 30B-A3B" in out and "bench:" not in out


def test_merge_bench_replaces_only_the_rerun_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "DATA", tmp_path / "data")
    monkeypatch.setattr(figures, "SCRATCH", tmp_path / "scratch")
    monkeypatch.setattr(figures.subprocess, "check_call", lambda *a, **k: 0)  # no table / plot redraw here
    write_rows(tmp_path / "data" / "bench.csv", [_row("rope_hf", 1, 10.0), _row("mlp", 1, 5.0)])
    write_rows(tmp_path / "scratch" / "bench" / "rope_hf" / "bench.csv", [_row("rope_hf", 1, 7.0)])
    assert figures.merge_bench(["rope_hf", "router_topk"]) == 1  # router_topk: no output, nothing merged
    rows = {(r.kernel, r.x_value): r.p50 for r in read_rows(tmp_path / "data" / "bench.csv")}
    assert rows == {("rope_hf", 1): 7.0, ("mlp", 1): 5.0}


def test_merge_headline_keeps_the_cases_not_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "DATA", tmp_path / "data")
    monkeypatch.setattr(figures, "SCRATCH", tmp_path / "scratch")
    written = {}

    class FakeHeadline:
        @staticmethod
        def write_outputs(out, results):
            written.update(results)

    monkeypatch.setattr(figures, "load_script", lambda path, name: FakeHeadline)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "headline.json").write_text(json.dumps({"rope_fwd": {"v": 1}, "moe_fwd": {"v": 2}}))
    part = tmp_path / "scratch" / "headline" / "rope_fwd"
    part.mkdir(parents=True)
    part.joinpath("headline.json").write_text(json.dumps({"rope_fwd": {"v": 3}}))
    assert figures.merge_headline(["rope_fwd", "moe_bwd"]) == 1
    assert written == {"rope_fwd": {"v": 3}, "moe_fwd": {"v": 2}}
