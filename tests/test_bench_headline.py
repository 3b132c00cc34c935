"""benchmarks/headline.py: case selection, ranges and sensitivity against an independent estimate, and the
tracked reference figures (benchmarks/data/headline*.csv) ordered and consistent with each other."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from trnkit.bench.paths import load_script
from trnkit.demo import matmul_tiled
from trnkit.nkisim import cost, hardware, trace
from trnkit.nkisim.cost_params import HIGH, LOW, MID, PARAM_NAMES

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"


headline = load_script(ROOT / "benchmarks" / "headline.py", "headline")


def _read(name: str, folder: Path = DATA) -> list[dict[str, str]]:
    with (folder / name).open(newline="") as f:
        return list(csv.DictReader(f))


def test_case_names_and_groups_resolve_in_table_order():
    assert headline.resolve(["router_bwd", "rope"]) == [*headline.GROUPS["rope"], "router_bwd"]
    assert headline.resolve(["all"]) == list(headline.CASES)
    assert headline.resolve(["moe_bwd", "moe"]) == ["moe_fwd", "moe_bwd"]
    assert set(headline.HEADLINE) <= set(headline.CASES)
    with pytest.raises(ValueError, match=r"unknown case\(s\) \['nope'\].*groups: rope, router"):
        headline.resolve(["nope"])


def test_moe_bound_counts_useful_flops_only():
    T, H, I, K = 8192, 2048, 768, 8  # noqa: E741 - Qwen3-30B-A3B experts
    fwd, bwd = headline.CASES["moe_fwd"], headline.CASES["moe_bwd"]
    assert fwd.useful_flops == 3 * 2 * T * K * H * I  # gate, up, down: 2 FLOPs per multiply-add
    assert bwd.useful_flops == 2 * fwd.useful_flops and headline.moe_flops(4) == 2 * 2 * T * K * H * I
    assert fwd.bound_kind == "useful 0.618 TFLOP / 78.6 TFLOPS"
    assert headline.CASES["rope_fwd"].bound_kind == "HBM bytes / 362.5 GB/s"


@pytest.fixture
def tiny_cases(monkeypatch):
    """Two cheap cases (the tutorial matmul) standing in for the kernel cases: one HBM-bound bound, one
    useful-FLOP bound."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 128, generator=g).bfloat16(), torch.randn(128, 512, generator=g).bfloat16()
    cases = {"mm_hbm": headline.HeadlineCase("matmul_tiled", "forward", "128x128x512 bf16",
                                             lambda: lambda: matmul_tiled(a, b)),
             "mm_flops": headline.HeadlineCase("matmul_tiled", "forward", "128x128x512 bf16",
                                               lambda: lambda: matmul_tiled(a, b), useful_flops=2 * 128 * 128 * 512)}
    monkeypatch.setattr(headline, "CASES", cases)
    monkeypatch.setattr(headline, "HEADLINE", ("mm_flops",))
    with trace.record(trace_only=True) as tr:
        matmul_tiled(a, b)
    return tr


def test_run_case_matches_an_independent_estimate(tiny_cases):
    rep = cost.estimate(tiny_cases, "trn2")
    low, mid, high = (t / 1e3 for t in rep.total_range_ns)
    assert low < mid < high  # the tutorial matmul moves with the DMA knee
    r = headline.run_case("mm_hbm")
    assert r["time_us"] == pytest.approx({"low": low, "mid": mid, "high": high})
    assert r["bound_us"] == pytest.approx(rep.memory_bound_ns / 1e3)
    assert r["fraction"] == pytest.approx({"low_end": r["bound_us"] / high, "mid": r["bound_us"] / mid,
                                           "high_end": r["bound_us"] / low})
    assert "sensitivity_us" not in r and "trn2 cost model" in r["assumptions"]
    assert list(r["busy_us"]) == sorted(rep.busy_ns, key=lambda e: -rep.busy_ns[e])
    f = headline.run_case("mm_flops")  # a HEADLINE case: sensitivity too
    assert f["bound_us"] == pytest.approx(2 * 128 * 128 * 512 / hardware.TRN2.tensor_flops_per_ns_bf16 / 1e3)
    sens = cost.sensitivity(tiny_cases, "trn2")
    assert list(f["sensitivity_us"]) == list(sens) and set(sens) == set(PARAM_NAMES)
    assert f["sensitivity_us"]["dma_knee_bytes"] == pytest.approx([t / 1e3 for t in sens["dma_knee_bytes"]])
    assert f["parameter_values"]["dma_knee_bytes"] == [LOW.dma_knee_bytes, MID.dma_knee_bytes, HIGH.dma_knee_bytes]


def test_outputs_merge_case_by_case_and_carry_the_range(tiny_cases, tmp_path, capsys):
    assert headline.main(["mm_hbm", "--out", str(tmp_path)]) == 0
    assert [r["case"] for r in _read("headline.csv", tmp_path)] == ["mm_hbm"]
    assert _read("headline_sensitivity.csv", tmp_path) == []
    assert headline.main(["mm_flops", "--out", str(tmp_path)]) == 0  # merged with the first run's case
    rows = {r["case"]: r for r in _read("headline.csv", tmp_path)}
    saved = json.loads((tmp_path / "headline.json").read_text())
    assert list(rows) == ["mm_hbm", "mm_flops"] and set(saved) == set(rows)
    for name, r in rows.items():
        t = saved[name]["time_us"]
        times = [float(r[k]) for k in ("low_us", "mid_us", "high_us")]
        assert times == [round(t[k], 2) for k in ("low", "mid", "high")]
        assert r["bound_kind"] == headline.CASES[name].bound_kind
    sens = _read("headline_sensitivity.csv", tmp_path)
    assert [s["parameter"] for s in sens] == list(saved["mm_flops"]["sensitivity_us"])
    knee = next(s for s in sens if s["parameter"] == "dma_knee_bytes")
    assert (knee["optimistic_value"], knee["mid_value"], knee["pessimistic_value"]) == (
        str(LOW.dma_knee_bytes), str(MID.dma_knee_bytes), str(HIGH.dma_knee_bytes))
    assert "mm_flops: " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        headline.main(["nope", "--out", str(tmp_path)])


# --- the tracked reference figures -------------------------------------------------------------------------

REF_ROWS = _read("headline.csv")
REF_SENS = _read("headline_sensitivity.csv")


@pytest.mark.parametrize("row", REF_ROWS, ids=lambda r: r["case"])
def test_reference_ranges_are_ordered_and_fractions_follow_from_them(row):
    case = headline.CASES[row["case"]]
    assert (row["kernel"], row["mode"], row["shape"]) == (case.kernel, case.mode, case.shape)
    assert row["bound_kind"] == case.bound_kind and row["bound_kind"] in row["assumptions"]
    low, mid, high, bound = (float(row[k]) for k in ("low_us", "mid_us", "high_us", "bound_us"))
    assert 0 < bound <= low <= mid <= high
    fractions = [float(row[k]) for k in ("fraction_low_end", "fraction_mid", "fraction_high_end")]
    assert fractions == pytest.approx([bound / high, bound / mid, bound / low], abs=1e-4)
    assert fractions == sorted(fractions) and fractions[-1] <= 1.0
    if case.useful_flops:
        assert bound == pytest.approx(case.useful_flops / hardware.TRN2.tensor_flops_per_ns_bf16 / 1e3, abs=0.01)


def test_reference_sensitivity_is_from_the_same_run_as_the_range():
    """A parameter whose optimistic (pessimistic) value is its mid value leaves the mid estimate unchanged:
    the sensitivity CSV and the range CSV must agree there, else one of them is stale."""
    mids = {r["case"]: float(r["mid_us"]) for r in REF_ROWS}
    by_case: dict[str, list[dict[str, str]]] = {}
    for s in REF_SENS:
        by_case.setdefault(s["case"], []).append(s)
    assert by_case, "headline_sensitivity.csv has the headline cases"
    for case, rows in by_case.items():
        assert case in headline.HEADLINE and case in mids
        assert sorted(s["parameter"] for s in rows) == sorted(PARAM_NAMES)
        for s in rows:
            if s["optimistic_value"] == s["mid_value"]:
                assert float(s["optimistic_us"]) == pytest.approx(mids[case], abs=0.011), s
            if s["pessimistic_value"] == s["mid_value"]:
                assert float(s["pessimistic_us"]) == pytest.approx(mids[case], abs=0.011), s
