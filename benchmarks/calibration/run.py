"""Run the published NKI kernel measurements (points.py) through trnkit's interpreter and cost model.

``python benchmarks/calibration/run.py [NAME ...] [--out DIR]`` appends one row per point to
``DIR/calibration.csv`` (default: this folder) and rewrites ``DIR/calibration.md`` from the newest row of
every point: kernel, shape, device, published, estimate low / mid / high, error of mid, role. Points
already in the CSV are skipped unless named (each full-shape Mamba point takes minutes on the
interpreter). ``--sensitivity`` adds the one-at-a-time parameter table per point.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mamba_kernels  # noqa: E402
from points import NOT_MODELLED, POINTS, Point  # noqa: E402

from trnkit.nkisim import cost, trace  # noqa: E402

FIELDS = ("name", "kernel", "shape", "device", "published_ms", "low_ms", "mid_ms", "high_ms", "error_mid",
          "role", "source", "note", "sensitivity")


def mamba_inputs(p: Point) -> tuple[np.ndarray, ...]:
    """fp32 inputs of the tutorial's shapes (values do not change the trace)."""
    rng = np.random.default_rng(0)
    delta = rng.random((p.batch, p.channels, p.seq_len), dtype=np.float32) * 0.1
    u = rng.standard_normal((p.batch, p.channels, p.seq_len), dtype=np.float32)
    A = -rng.random((p.channels, p.state_size), dtype=np.float32)
    B = rng.standard_normal((p.batch, p.state_size, p.seq_len), dtype=np.float32)
    C = rng.standard_normal((p.batch, p.state_size, p.seq_len), dtype=np.float32)
    return delta, u, A, B, C


def trace_point(p: Point) -> trace.Trace:
    with trace.record(trace_only=True) as tr:
        mamba_kernels.KERNELS[p.version](*mamba_inputs(p))
    return tr


def run_point(p: Point, with_sensitivity: bool = False) -> dict:
    tr = trace_point(p)
    rep = cost.estimate(tr, p.device)
    low, mid, high = (t * 1e-6 for t in rep.total_range_ns)
    sens = ""
    if with_sensitivity:
        sens = "; ".join(f"{k} {lo * 1e-6:.3g}..{hi * 1e-6:.3g}" for k, (lo, hi) in
                         cost.sensitivity(tr, p.device).items())
    return {"name": p.name, "kernel": f"mamba_{p.version}", "shape": p.shape, "device": p.device,
            "published_ms": p.published_ms, "low_ms": round(low, 4), "mid_ms": round(mid, 4),
            "high_ms": round(high, 4), "error_mid": round(mid / p.published_ms - 1, 4), "role": p.role,
            "source": p.source, "note": p.note, "sensitivity": sens}


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def markdown(rows: list[dict]) -> str:
    latest = {r["name"]: r for r in rows}
    lines = ["| kernel | shape | device | published (ms) | estimate low / mid / high (ms) | error (mid) | "
             "published within range | role |", "|---|---|---|---|---|---|---|---|"]
    for p in POINTS:
        r = latest.get(p.name)
        if r is None:
            continue
        lo, mid, hi, pub = (float(r[k]) for k in ("low_ms", "mid_ms", "high_ms", "published_ms"))
        lines.append(f"| {p.name} | {r['shape']} | {r['device']} | {pub:g} | {lo:.3g} / {mid:.3g} / {hi:.3g} | "
                     f"{float(r['error_mid']):+.1%} | {'yes' if lo <= pub <= hi else 'no'} | {r['role']} |")
    lines += ["", "Published figures: " + "; ".join(sorted({p.source for p in POINTS})) + ".",
              "Not modelled: " + "; ".join(NOT_MODELLED) + "."]
    sens = [(p.name, latest[p.name]["sensitivity"]) for p in POINTS if latest.get(p.name, {}).get("sensitivity")]
    if sens:
        lines += ["", "Sensitivity (ms with one parameter at its optimistic..pessimistic value, others mid):", ""]
        lines += [f"- {name}: {s}" for name, s in sens]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="points to (re)run; default: those not in the CSV yet")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--sensitivity", action="store_true")
    args = ap.parse_args(argv)
    known = {p.name for p in POINTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        ap.error(f"unknown point(s) {unknown}; known: {sorted(known)}")
    csv_path = args.out / "calibration.csv"
    done = {r["name"] for r in read_csv(csv_path)}
    todo = [p for p in POINTS if (p.name in args.names if args.names else p.name not in done)]
    for p in todo:
        t0 = time.perf_counter()
        row = run_point(p, args.sensitivity)
        new = not csv_path.exists()
        args.out.mkdir(parents=True, exist_ok=True)
        with csv_path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)
        print(f"{p.name}: published {p.published_ms} ms, estimate {row['low_ms']} / {row['mid_ms']} / "
              f"{row['high_ms']} ms ({row['error_mid']:+.1%}) [{time.perf_counter() - t0:.0f} s]", flush=True)
    table = markdown(read_csv(csv_path))
    (args.out / "calibration.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
