"""The side-by-side scripts (benchmarks/*_peak.py) without an nki-library checkout: they stop with a message
instead of tracing trnkit's side alone, and a trnkit-only save keeps the CSV's nki-library rows."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mlp_peak  # benchmarks/ is a script folder, not a package
import rmsnorm_peak
import side_by_side

from trnkit.conformance import harness


@pytest.mark.parametrize("script", [mlp_peak, rmsnorm_peak], ids=["mlp_peak", "rmsnorm_peak"])
def test_missing_checkout_stops_the_side_by_side(script, monkeypatch) -> None:
    monkeypatch.setattr(harness, "nkilib_root", lambda *a, **k: None)
    monkeypatch.setattr(sys, "argv", [script.__name__, "--save"])
    monkeypatch.setattr(script, "_trnkit", lambda *a: pytest.fail("traced trnkit's side without nki-library's"))
    with pytest.raises(SystemExit, match=r"nki-library not found \(NKILIB_SRC is unset .*--no-nkilib"):
        script.main()


def test_trnkit_only_save_keeps_the_nkilib_rows(tmp_path, monkeypatch) -> None:
    path = tmp_path / "mlp_peak.csv"
    keys = ["kernel", "case", "T", "H", "I", "est_us_mid"]
    old = [dict(zip(keys, (who, "c", "1", "2", "3", us), strict=True)) for who, us in (("trnkit", "9.0"),
                                                                                      ("nki-library", "7.0"))]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(old)
    monkeypatch.setattr(mlp_peak, "CSV", path)
    monkeypatch.setattr(mlp_peak, "SHAPES", [("c", 1, 2, 3)])
    monkeypatch.setattr(mlp_peak, "_trnkit", lambda *a: "an error string (a shape it does not serve)")
    monkeypatch.setattr(sys, "argv", ["mlp_peak", "--no-nkilib", "--save"])
    mlp_peak.main()
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["kernel"], r["est_us_mid"]) for r in rows] == [("nki-library", "7.0"), ("trnkit", "")]
    assert rows[1]["error"].startswith("an error string")


def test_require_nkilib_passes_with_a_checkout(monkeypatch) -> None:
    monkeypatch.setattr(harness, "nkilib_root", lambda *a, **k: Path("/somewhere"))
    side_by_side.require_nkilib("x.py")  # no exit
