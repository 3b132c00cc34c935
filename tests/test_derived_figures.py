"""benchmarks/derived_figures.py: TensorE's waits read off a schedule (a hand-built one), and a run that names
some traces keeps the other traces' rows."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from trnkit.bench.paths import load_script
from trnkit.nkisim import cost

ROOT = Path(__file__).resolve().parent.parent
derived = load_script(ROOT / "benchmarks" / "derived_figures.py", "derived_figures")


def _timing(index: int, engine: str, start: float, end: float) -> cost.Timing:
    return cost.Timing(index=index, engine=engine, start=start, end=end, ready=end)


def test_tensor_waits_of_a_hand_built_schedule(monkeypatch: pytest.MonkeyPatch):
    # TensorE: 100-300, 300-500 (back to back), 1,100-1,300 (a 600 ns wait), 3,300-3,400 (2,000 ns); a DMA to 3,900
    timings = [_timing(0, "dma", 0, 100), _timing(1, "tensor", 100, 300), _timing(2, "tensor", 300, 500),
               _timing(3, "tensor", 1100, 1300), _timing(4, "tensor", 3300, 3400), _timing(5, "dma", 3400, 3900)]
    monkeypatch.setattr(derived.cost, "timeline", lambda *a, **k: timings)
    got = dict(derived.tensor_waits(None, "trn2", None))
    assert got == {"tensor_before_us": 0.1, "tensor_after_us": 0.5, "tensor_waits": 2, "tensor_waits_us": 2.6,
                   "tensor_wait_longest_us": 2.0, "tensor_last_wait_at_us": 1.3, "tensor_waits_over_1500ns": 1}


def test_named_traces_replace_only_their_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    out = tmp_path / derived.CSV_NAME
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=derived.FIELDS)
        w.writeheader()
        w.writerows([{"trace": t, "setting": "mid", "quantity": "total_us", "value": v}
                     for t, v in (("rope_fwd", "1"), ("moe_fwd", "2"))])
    monkeypatch.setattr(derived, "all_rows", lambda names: iter(
        [{"trace": n, "setting": "mid", "quantity": "total_us", "value": "3"} for n in names]))
    assert derived.main(["moe_fwd", "--out", str(tmp_path)]) == 0
    with out.open(newline="") as f:
        assert [(r["trace"], r["value"]) for r in csv.DictReader(f)] == [("rope_fwd", "1"), ("moe_fwd", "3")]
    with pytest.raises(SystemExit):
        derived.main(["no_such_trace", "--out", str(tmp_path)])
