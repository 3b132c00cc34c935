"""The cost model's fitted constants, recomputed from the fit points of ``split.csv`` only.

``python benchmarks/calibration/fit.py`` prints every fitted value next to the one the model uses
(``trnkit/nkisim/hardware.py``, ``cost_params.py``); ``tests/nkisim/test_calibration_fit.py`` checks they
agree and that no fit sees a check or context point. The split was written before any fitting: a point's
role is never changed to make a fit or a check come out better (docs/cost-model.md, "Calibration").

Each fit names the split.csv ``fits`` entry it serves and takes its points through :func:`fit_points`,
which refuses anything but fit points.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from points import DMA_POINTS, POINTS, SPLIT, Point  # noqa: E402

from trnkit.nkisim import cost, cost_params, hardware  # noqa: E402

ALL = {p.name: p for p in (*POINTS, *DMA_POINTS)}


def fit_points(target: str) -> list[Point]:
    """The fit points whose split.csv ``fits`` entry names ``target`` (e.g. ``"dma_fixed_ns"``)."""
    rows = [r for r in SPLIT.values() if r["role"] == "fit" and target in r["fits"]]
    if not rows:
        raise ValueError(f"calibration fit: no fit point names {target!r} in split.csv")
    return require_fit(ALL[r["point"]] for r in rows)


def require_fit(points: Iterable[Point]) -> list[Point]:
    """``points`` as a list, after checking every one is a fit point (a fit never sees a held-out point)."""
    out = list(points)
    bad = [p.name for p in out if p.role != "fit"]
    if bad:
        raise ValueError(f"calibration fit: {bad} are not fit points in split.csv (roles: "
                         f"{[ALL[n].role for n in bad]})")
    return out


def _ns(p: Point) -> float:
    return p.published * {"ns": 1.0, "us": 1e3, "ms": 1e6}[p.unit]


def act_fixed_ns(points: Iterable[Point] | None = None) -> float:
    """ScalarE ACTIVATE fixed cost: the profiled instruction's duration minus N / clock (N = its free size)."""
    pts = require_fit(points if points is not None else fit_points("act_fixed_ns"))
    chip = hardware.TRN2
    return sum(_ns(p) - p.dims["cols"] / chip.clocks.scalar for p in pts) / len(pts)


def act_table_load_ns(points: Iterable[Point] | None = None) -> float:
    """ScalarE activation-table load: the profiled ACT_TABLE_LOAD's duration."""
    pts = require_fit(points if points is not None else fit_points("act_table_load_ns"))
    return sum(_ns(p) for p in pts) / len(pts)


def dma_fixed_range_ns(points: Iterable[Point] | None = None) -> tuple[float, float]:
    """The range of a DMA's trigger-to-first-byte time over the profiled transfers: (shortest, longest)."""
    pts = require_fit(points if points is not None else
                      [p for p in fit_points("dma_fixed_ns") if p.metric.startswith("dma_issue")])
    vals = [_ns(p) for p in pts]
    return min(vals), max(vals)


def dma_fixed_mid_ns(points: Iterable[Point] | None = None) -> float:
    """The per-transfer time of back-to-back loads from one queue in the overhead-bound part of the DMA
    overview's throughput curve: a transfer of ``b`` bytes per partition at relative throughput ``r`` takes
    ``128 b / (r * BW)``, BW the 32 KiB-per-partition throughput (16 engines at the HBM bandwidth the core
    has, the payloads' efficiency at 32 KiB per partition). One transfer per fixed cost: the queue's
    trigger-to-first-byte time. The curve is a one-core run (the overview's examples ran "on a single
    NeuronCore-v3"), so the core has its HBM stack to itself, as every standalone trn2 calibration point is
    estimated (``run.standalone_hbm``, ``cost.hbm_per_core`` at ``STANDALONE_LAUNCH``'s mid): the 16 engines'
    16 x 23 B/ns bind, not HBM."""
    pts = require_fit(points if points is not None else
                      [p for p in fit_points("dma_fixed_ns") if p.metric == "rel_throughput"])
    chip, knee = hardware.TRN2, cost_params.MID.dma_knee_bytes
    payload = 32768 * chip.dma.partitions_per_engine  # one engine's contiguous share of a [128, 32 KiB] load
    hbm = cost.hbm_per_core(chip, cost_params.STANDALONE_LAUNCH.mid, 1)
    bw = min(chip.dma.peak_bytes_per_ns, hbm) * payload / (payload + knee)
    return sum(128 * p.dims["bytes"] / (p.published * bw) for p in pts) / len(pts)


def dma_wake_ns(points: Iterable[Point] | None = None) -> float:
    """A DMA's completion to the start of the instruction waiting on it (semaphore wake-up)."""
    pts = require_fit(points if points is not None else fit_points("dma_wake_ns"))
    return sum(_ns(p) for p in pts) / len(pts)


def dependent_overhead_cycles(points: Iterable[Point] | None = None) -> float:
    """Fixed latency of a dependent instruction: the measured interval of dependent one-element
    activations (trn1 ScalarE cycles) minus the instruction's own MIN_II cycles."""
    pts = require_fit(points if points is not None else fit_points("dependent_overhead_cycles"))
    chip = hardware.TRN1
    return sum(_ns(p) * chip.clocks.scalar - chip.min_ii_cycles for p in pts) / len(pts)


def trn1_dma_sustained_fraction(points: Iterable[Point] | None = None, iterations: int = 4,
                                form: str = "fixed") -> float:
    """trn1's sustained fraction of the documented DMA rate under packet-overhead form ``form``
    (cost_params.dma_overhead_form): the value at which the model's time of the DMA-bound fit kernels at
    their published shapes matches their published times (geometric mean). Their time scales about as
    1 / fraction, so each step multiplies by the remaining ratio. (A slice of each kernel is not the same
    fit: one M-tile row reloads less and starts with empty DMA queues; at the fitted value the slices
    come out ~4 % off the full shapes.)"""
    import run  # runs the interpreter; only this fit needs it

    pts = require_fit(points if points is not None else fit_points("sustained_fraction"))
    traces = [(list(run.trace_of(run.kernel_call(p))), _ns(p)) for p in pts]
    chip = hardware.TRN1
    params = replace(cost_params.MID, dma_overhead_form=form)
    frac = chip.dma.sustained(form)
    for _ in range(iterations):
        if form == "fixed":
            dma = replace(chip.dma, sustained_fraction=frac)
        else:
            dma = replace(chip.dma, sustained_fraction_by_form=((form, frac),))
        logs = [math.log(cost.estimate_total(tr, replace(chip, dma=dma), params) / target) for tr, target in traces]
        frac *= math.exp(sum(logs) / len(logs))
    return frac


CLOSED_FORM = {
    "hardware.Chip.act_fixed_ns": act_fixed_ns,
    "hardware.Chip.act_table_load_ns": act_table_load_ns,
    "cost_params.dma_fixed_ns (low / high)": dma_fixed_range_ns,
    "cost_params.dma_fixed_ns (mid)": dma_fixed_mid_ns,
    "cost_params.dma_wake_ns (mid)": dma_wake_ns,
    "cost_params.dependent_overhead_cycles (mid)": dependent_overhead_cycles,
}


def main() -> int:
    for name, f in CLOSED_FORM.items():
        print(f"{name}: {f()}")
    print(f"hardware.TRN1.dma.sustained_fraction: {trn1_dma_sustained_fraction()} "
          f"(the model uses {hardware.TRN1.dma.sustained_fraction})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
