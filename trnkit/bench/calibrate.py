"""``python -m trnkit.bench calibrate measured.csv``: refit the cost model's uncertain parameters to
device measurements and print the error before and after.

``measured.csv`` is a benchmark CSV written on a Trainium host by ``python -m trnkit.bench --device``
(rows ``impl=nki, metric=wall_time``). Each measured case is found again in :mod:`trnkit.bench.cases`
(same kernel, mode, swept value and configuration), traced once on trnkit's interpreter (so this command
runs where ``trnkit.nki_api`` resolves to the interpreter, e.g. with ``TRNKIT_NKI=sim``), and estimated
under candidate settings of :mod:`trnkit.nkisim.cost_params` by coordinate descent over each parameter's
range, minimising the mean |log(estimate / measured)|. Writes the fitted setting as JSON (``--out``).

NOT TESTED ON HARDWARE: no Trainium was available; the unit test feeds a synthetic CSV.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path

from trnkit.bench import cases as cases_mod
from trnkit.bench.schema import Row, read_rows
from trnkit.nkisim import cost, cost_params
from trnkit.nkisim.cost_params import ModelParams
from trnkit.nkisim.trace import Instr


def candidates(name: str, steps: int = 5) -> list:
    """Values tried for one parameter: both ends and evenly spaced values between (booleans: both; named
    rules: the three settings')."""
    lo, hi = getattr(cost_params.LOW, name), getattr(cost_params.HIGH, name)
    if isinstance(lo, bool):
        return [lo, hi]
    if isinstance(lo, str):  # a named rule: its optimistic, mid and pessimistic choice
        return list(dict.fromkeys((lo, getattr(cost_params.MID, name), hi)))
    vals = [lo + (hi - lo) * k / (steps - 1) for k in range(steps)]
    return [round(v) for v in vals] if isinstance(lo, int) else vals


def log_error(points: Sequence[tuple[list[Instr], float]], chip: str, params: ModelParams) -> float:
    """Mean |log(estimate / measured)| over (trace, measured ns) points."""
    errs = [abs(math.log(cost.estimate_total(instrs, chip, params) / measured))
            for instrs, measured in points]
    return sum(errs) / len(errs)


def fit(points: Sequence[tuple[list[Instr], float]], chip: str = "trn2", sweeps: int = 2,
        start: ModelParams = cost_params.MID) -> tuple[ModelParams, float, float]:
    """Coordinate descent over every parameter's candidates: (fitted params, error before, error after)."""
    if not points:
        raise ValueError("calibrate: no measured points to fit")
    best, before = start, log_error(points, chip, start)
    best_err = before
    for _ in range(sweeps):
        for f in fields(ModelParams):
            for v in candidates(f.name):
                trial = replace(best, **{f.name: v})
                err = log_error(points, chip, trial)
                if err < best_err - 1e-12:
                    best, best_err = trial, err
    return best, before, best_err


def _match(row: Row) -> cases_mod.Case | None:
    """The benchmark case a measured row came from (same kernel, mode, x and configuration)."""
    dtype = str(row.config.get("dtype", "bfloat16"))
    for quick in (True, False):
        for case in cases_mod.cases_for(row.kernel, quick, (row.mode,), dtype):
            if (case.x_name, case.x_value) == (row.x_name, row.x_value) and case.config == row.config:
                return case
    return None


def measured_points(csv_path: Path) -> tuple[list[tuple[str, list[Instr], float]], list[str]]:
    """(label, trace, measured ns) per measured row, and the rows that match no case."""
    from trnkit.nki_api import REAL_NKI
    from trnkit.nkisim import trace

    if REAL_NKI:
        raise RuntimeError("calibrate traces kernels on trnkit's interpreter, but trnkit.nki_api resolves to "
                           "the real nki here: run it with TRNKIT_NKI=sim")
    rows = [r for r in read_rows(csv_path) if r.impl == "nki" and r.metric == "wall_time"]
    if not rows:
        raise ValueError(f"calibrate: {csv_path} has no measured kernel rows (impl=nki, metric=wall_time); "
                         "write one with `python -m trnkit.bench --device` on a Trainium host")
    points, unmatched = [], []
    for r in rows:
        case = _match(r)
        if case is None:
            unmatched.append(f"{r.kernel}/{r.mode} {r.x_name}={r.x_value} {r.config}")
            continue
        prepared = case.build()
        with trace.record(trace_only=True) as tr:
            prepared.nki()
        points.append((case.label, list(tr), r.p50 * 1e3))
    return points, unmatched


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trnkit.bench calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", type=Path, help="benchmark CSV with measured kernel rows (from --device)")
    ap.add_argument("--chip", default="trn2", choices=("trn2", "trn1"))
    ap.add_argument("--out", type=Path, default=Path("fitted_params.json"))
    args = ap.parse_args(argv)
    try:
        labelled, unmatched = measured_points(args.measured)
    except (OSError, ValueError, RuntimeError) as e:  # no such file, no measured rows, the real nki
        ap.error(str(e))
    for u in unmatched:
        print(f"no benchmark case matches {u}: skipped")
    points = [(instrs, ns) for _, instrs, ns in labelled]
    fitted, before, after = fit(points, args.chip)
    chip = cost.hardware.get_chip(args.chip)
    print(f"{'case':<48} {'measured us':>12} {'before us':>10} {'after us':>10}")
    for label, instrs, ns in labelled:
        b, a = cost.estimate_total(instrs, chip, cost_params.MID), cost.estimate_total(instrs, chip, fitted)
        print(f"{label:<48} {ns / 1e3:>12.1f} {b / 1e3:>10.1f} {a / 1e3:>10.1f}")
    print(f"mean |log(estimate / measured)|: before {before:.3f}, after {after:.3f}")
    changed = {k: v for k, v in asdict(fitted).items() if v != getattr(cost_params.MID, k)}
    print("fitted (changed from mid):", changed or "nothing")
    args.out.write_text(json.dumps(asdict(fitted), indent=1))
    print(f"-> {args.out} (NOT TESTED ON HARDWARE: fitted from {len(points)} measured points)")
    return 0
