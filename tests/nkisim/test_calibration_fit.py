"""The calibration's fit / check split (benchmarks/calibration/split.csv) and the fits that read it.

The split is fixed before fitting: every published point has exactly one role, the fit code sees fit
points only, and the model's fitted constants are what fit.py computes from those points.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CAL = ROOT / "benchmarks" / "calibration"
sys.path.insert(0, str(CAL))
import fit  # noqa: E402
from points import POINTS, SPLIT  # noqa: E402

from trnkit.nkisim import hardware  # noqa: E402
from trnkit.nkisim.cost_params import HIGH, LOW, MID  # noqa: E402

ROLES = {"fit", "check", "context"}


def test_every_point_has_one_role_in_the_split_file():
    names = [p.name for p in POINTS]
    assert len(names) == len(set(names))
    assert set(names) <= set(SPLIT)
    assert {r["role"] for r in SPLIT.values()} <= ROLES
    for r in SPLIT.values():  # a fit point names what it fits; a held-out point fits nothing
        assert bool(r["fits"]) == (r["role"] == "fit"), r


def test_held_out_points_outnumber_fit_points():
    roles = [r["role"] for r in SPLIT.values()]
    assert roles.count("check") >= 2 * roles.count("fit") > 0


@pytest.mark.parametrize("target", ["act_fixed_ns", "act_table_load_ns", "dma_fixed_ns", "dma_wake_ns",
                                    "dependent_overhead_cycles", "sustained_fraction"])
def test_the_fit_code_sees_fit_points_only(target):
    pts = fit.fit_points(target)
    assert pts and all(p.role == "fit" for p in pts)
    assert all(target in SPLIT[p.name]["fits"] for p in pts)


def test_a_fit_refuses_a_held_out_point():
    check = fit.ALL["dma_intro ex2 activation"]
    assert check.role == "check"
    with pytest.raises(ValueError, match="not fit points"):
        fit.act_fixed_ns([check])
    with pytest.raises(ValueError, match="not fit points"):
        fit.require_fit([fit.ALL["dma_intro ex1 activation"], check])
    with pytest.raises(ValueError, match="no fit point names"):
        fit.fit_points("no_such_constant")


def test_closed_form_fits_from_their_points():
    assert fit.act_fixed_ns() == pytest.approx(3708 - 4096 / 1.2)
    assert fit.act_table_load_ns() == 1283.0
    assert fit.dma_fixed_range_ns() == (619.0, 1013.0)
    assert fit.dependent_overhead_cycles() == pytest.approx(189 * 1.4 - 64)
    bw = 16 * 23 * 8 * 32768 / (8 * 32768 + MID.dma_knee_bytes)  # one core, its HBM stack to itself: the engines bind
    assert fit.dma_fixed_mid_ns() == pytest.approx((128 * 256 / 0.103 + 128 * 1024 / 0.424) / bw / 2)


def test_the_model_uses_the_fitted_values():
    assert hardware.TRN2.act_fixed_ns == pytest.approx(fit.act_fixed_ns(), abs=1.0)
    assert hardware.TRN2.act_table_load_ns == pytest.approx(fit.act_table_load_ns())
    assert (LOW.dma_fixed_ns, HIGH.dma_fixed_ns) == fit.dma_fixed_range_ns()
    assert MID.dma_fixed_ns == pytest.approx(fit.dma_fixed_mid_ns(), abs=1.0)
    assert LOW.dma_fixed_ns < MID.dma_fixed_ns < HIGH.dma_fixed_ns
    assert MID.dma_wake_ns == pytest.approx(fit.dma_wake_ns())
    assert MID.dependent_overhead_cycles == pytest.approx(fit.dependent_overhead_cycles(), abs=1.0)


def test_published_changes_name_split_points():
    with (CAL / "changes.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows
    for r in rows:
        assert r["before"] in SPLIT and r["after"] in SPLIT and r["role"] in ROLES


@pytest.mark.slow
@pytest.mark.parametrize("form", ["fixed", "scaled", "hidden"])
def test_trn1_dma_rate_is_the_fit_of_its_fit_points(form):
    """Refit from the model's own value under each packet-overhead form (cost_params.dma_overhead_form):
    the DMA-bound fit kernels land on the published times (their published shapes: ~2 min each on the
    interpreter)."""
    assert fit.trn1_dma_sustained_fraction(iterations=1, form=form) == pytest.approx(
        hardware.TRN1.dma.sustained(form), rel=0.02)


def test_trn1_dma_rate_lands_its_fit_points_on_their_published_times_in_the_calibration_rows():
    """The same fit read off calibration.csv (the model's rows at the published shapes): the fit points'
    mid errors have a geometric mean within 2 % of zero."""
    with (CAL / "calibration.csv").open(newline="") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}  # newest row per point
    pts = fit.fit_points("sustained_fraction")
    logs = [math.log(float(rows[p.name]["mid"]) / p.published) for p in pts]
    assert len(logs) == 2 and abs(sum(logs) / len(logs)) < 0.02
