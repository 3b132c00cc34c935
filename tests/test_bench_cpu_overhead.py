"""benchmarks/cpu_overhead.py: a short run writes one row per variant with the kernels' verdicts and consistent
ratios (the figures themselves are measurements, quoted from benchmarks/data/cpu_overhead.csv, not asserted)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from trnkit.bench.paths import load_script

ROOT = Path(__file__).resolve().parent.parent
cpu_overhead = load_script(ROOT / "benchmarks" / "cpu_overhead.py", "cpu_overhead")


def test_short_run_writes_every_variant(tmp_path: Path):
    cpu_overhead.main(["--cases", "guard", "dispatch", "--rounds", "3", "--out", str(tmp_path)])
    with open(tmp_path / "cpu_overhead.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["case"], r["variant"]) for r in rows] == [
        ("guard", "rope_hf"), ("guard", "router_topk"), ("guard", "moe_experts"),
        ("dispatch", "trnkit::rope_hf_apply[reference]"), ("dispatch", "rope_hf_bshd_ref direct")]
    assert [r["served"] for r in rows[:3]] == ["True"] * 3  # the kernels accept Qwen3-30B-A3B's shapes
    for r in rows:
        first = next(x for x in rows if x["case"] == r["case"])
        assert float(r["ratio"]) == pytest.approx(float(r["median"]) / float(first["median"]), rel=1e-3)
        assert 0 < float(r["best"]) <= float(r["median"])
        assert r["rounds"] == "3" and r["torch_threads"] == "1"


def test_interpreter_cases_count_their_instructions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A load, the chain and a store per program; LNC=2 issues both programs' (the kernels' results are checked
    inside the script, exactly)."""
    monkeypatch.setattr(cpu_overhead, "CHAIN", 50)
    monkeypatch.setattr(cpu_overhead, "MATMULS", 5)
    cpu_overhead.main(["--cases", "instruction", "lockstep", "matmul", "--rounds", "3", "--out", str(tmp_path)])
    with open(tmp_path / "cpu_overhead.csv", newline="") as f:
        rows = {(r["case"], r["variant"]): r for r in csv.DictReader(f)}
    counts = {key: int(r["instructions"]) for key, r in rows.items()}
    assert counts == {("instruction", "no trace"): 52, ("instruction", "traced"): 52, ("instruction", "trace-only"): 52,
                      ("lockstep", "LNC=1"): 52, ("lockstep", "LNC=2"): 104, ("matmul", "nc_matmul"): 9}
    for r in rows.values():  # ms per call -> us per instruction
        assert float(r["us_per_instruction"]) == pytest.approx(1e3 * float(r["median"]) / int(r["instructions"]),
                                                               rel=1e-3)


def test_interleaved_times_each_variant_once_per_round():
    calls: list[str] = []
    ticks = iter(range(100))
    times = cpu_overhead.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3,
                                     calls=2, clock=lambda: float(next(ticks)))
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3  # one warm-up each, then alternating rounds
    assert times == {"a": [0.5] * 3, "b": [0.5] * 3}  # one clock tick per round of 2 calls


def test_too_few_rounds_is_refused(capsys):
    with pytest.raises(SystemExit):
        cpu_overhead.main(["--rounds", "2"])
    assert "--rounds must be at least 3 (a median of rounds), got 2" in capsys.readouterr().err
