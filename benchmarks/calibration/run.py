"""Run the published NKI kernel measurements (points.py) through trnkit's interpreter and cost model.

``python benchmarks/calibration/run.py [NAME ...] [--out DIR] [--sensitivity]`` appends one row per point
to ``DIR/calibration.csv`` (default: this folder) and rewrites ``DIR/calibration.md`` from the newest row
of every point (the table ``scripts/docs_tables.py`` also writes into docs/cost-model.md). Points already
in the CSV are skipped unless named (full-shape points take minutes on the interpreter); ``--all`` reruns
every point (after a model change). ``--sensitivity`` adds the one-at-a-time parameter table per point.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "scripts"))

import kernel_opt_kernels  # noqa: E402
import mamba_kernels  # noqa: E402
import matmul_kernels  # noqa: E402
import micro_kernels  # noqa: E402
from points import POINTS, Point  # noqa: E402

from trnkit.nkisim import cost, cost_params, memory, trace  # noqa: E402

FIELDS = ("name", "kernel", "shape", "device", "unit", "published", "low", "mid", "high", "error_mid", "role",
          "tolerance", "source", "note", "constrains", "sensitivity")
UNIT_NS = {"ms": 1e6, "ns": 1.0}
CHAIN = (64, 256)  # scalar_chain lengths whose difference gives the initiation interval


def mamba_inputs(d: dict) -> tuple[np.ndarray, ...]:
    """fp32 inputs of the tutorial's shapes (values do not change the trace)."""
    rng = np.random.default_rng(0)
    b, c, s, n = d["batch"], d["channels"], d["seq_len"], d["state_size"]
    delta = rng.random((b, c, s), dtype=np.float32) * 0.1
    u = rng.standard_normal((b, c, s), dtype=np.float32)
    A = -rng.random((c, n), dtype=np.float32)
    B = rng.standard_normal((b, n, s), dtype=np.float32)
    C = rng.standard_normal((b, n, s), dtype=np.float32)
    return delta, u, A, B, C


# The kernel-optimization tutorial's v4 and v5 keep more tiles live in program order than SBUF holds (v4:
# 2 x 64 rhs tiles of 2 KiB = 256 KiB per partition at K=8192). They ran on trn2 (the tutorial's profiles):
# the compiler fits them by scheduling or spilling, which the interpreter's liveness model does not see, so
# their time is estimated with the capacity check off (docs/cost-model.md, "Calibration").
OVER_CAPACITY_AS_WRITTEN = {("kernel_opt", "v4"), ("kernel_opt", "v5")}


def _matmul_call(p: Point, d: dict) -> Callable[[], object]:
    kernels = matmul_kernels.KERNELS if p.family == "matmul" else kernel_opt_kernels.KERNELS
    if p.dtype == "bfloat16":
        lhsT, rhs = torch.zeros(d["K"], d["M"], dtype=torch.bfloat16), torch.zeros(d["K"], d["N"], dtype=torch.bfloat16)
    else:
        lhsT, rhs = np.zeros((d["K"], d["M"]), np.float32), np.zeros((d["K"], d["N"]), np.float32)
    if (p.family, p.version) not in OVER_CAPACITY_AS_WRITTEN:
        return lambda: kernels[p.version](lhsT, rhs)

    def unchecked() -> object:
        with memory.capacity_check_off():
            return kernels[p.version](lhsT, rhs)
    return unchecked


def kernel_call(p: Point, dims: dict | None = None, n_chain: int = CHAIN[1]) -> Callable[[], object]:
    """The point's kernel on its inputs (``dims`` overrides the published sizes, e.g. in the tests)."""
    d = {**p.dims, **(dims or {})}
    if p.family == "mamba":
        args = mamba_inputs(d)
        return lambda: mamba_kernels.KERNELS[p.version](*args)
    if p.family in ("matmul", "kernel_opt"):
        return _matmul_call(p, d)
    if p.family == "scalar_chain":
        x = np.ones((128, 1), np.float32)
        return lambda: micro_kernels.scalar_dependent_chain(x, n_chain)
    raise ValueError(f"calibration: unknown family {p.family!r} of point {p.name!r}")


def trace_of(call: Callable[[], object]) -> trace.Trace:
    with trace.record(trace_only=True) as tr:
        call()
    return tr


_TRACES: dict[tuple, trace.Trace] = {}  # points that read the same run (a kernel's time, its engines' times)


def _kernel_trace(p: Point, dims: dict | None) -> trace.Trace:
    key = (p.family, p.version, tuple(sorted({**p.dims, **(dims or {})}.items())))
    if key not in _TRACES:
        _TRACES.clear()  # keep one full-shape trace in memory at a time
        _TRACES[key] = trace_of(kernel_call(p, dims))
    return _TRACES[key]


def estimate_point(p: Point, dims: dict | None = None, with_sensitivity: bool = False) -> tuple[
        tuple[float, float, float], dict[str, tuple[float, float]]]:
    """``((low, mid, high), sensitivity)`` of the point's published quantity, in ns.

    Kernel points: the estimated kernel time. ``scalar_chain``: the per-instruction interval, the
    difference of two chain lengths over the length difference (cancels the loads and the store)."""
    if p.family == "scalar_chain":
        short, long_ = (trace_of(kernel_call(p, dims, n)) for n in CHAIN)
        span = CHAIN[1] - CHAIN[0]
        rs = cost.estimate(short, p.device).total_range_ns
        rl = cost.estimate(long_, p.device).total_range_ns
        rng = tuple((b - a) / span for a, b in zip(rs, rl))
        sens = {}
        if with_sensitivity:
            ss, sl = cost.sensitivity(short, p.device), cost.sensitivity(long_, p.device)
            sens = {k: ((sl[k][0] - ss[k][0]) / span, (sl[k][1] - ss[k][1]) / span) for k in sl}
        return rng, sens
    tr = _kernel_trace(p, dims)
    if p.metric.startswith("busy:"):  # one engine's summed instruction time under each setting
        engine = p.metric.removeprefix("busy:")
        rng = tuple(cost.estimate(tr, p.device, params=cost_params.SETTINGS[s]).busy_ns.get(engine, 0.0)
                    for s in ("low", "mid", "high"))
        return tuple(sorted(rng)), {}
    rng = cost.estimate(tr, p.device).total_range_ns
    return rng, (cost.sensitivity(tr, p.device) if with_sensitivity else {})


def run_point(p: Point, with_sensitivity: bool = False) -> dict:
    (low, mid, high), sens = estimate_point(p, with_sensitivity=with_sensitivity)
    k = UNIT_NS[p.unit]
    text = "; ".join(f"{name} {lo / k:.3g}..{hi / k:.3g}" for name, (lo, hi) in
                     sorted(sens.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])))
    return {"name": p.name, "kernel": f"{p.family} {p.version}", "shape": f"{p.shape} {p.dtype}", "device": p.device,
            "unit": p.unit, "published": p.published, "low": round(low / k, 4), "mid": round(mid / k, 4),
            "high": round(high / k, 4), "error_mid": round(mid / k / p.published - 1, 4), "role": p.role,
            "tolerance": p.tolerance, "source": p.source, "note": p.note, "constrains": p.constrains,
            "sensitivity": text}


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def main(argv: list[str] | None = None) -> int:
    from docs_tables import calibration_markdown  # noqa: PLC0415 - scripts/ on sys.path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="points to (re)run; default: those not in the CSV yet")
    ap.add_argument("--all", action="store_true", help="rerun every point")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--sensitivity", action="store_true")
    args = ap.parse_args(argv)
    known = {p.name for p in POINTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        ap.error(f"unknown point(s) {unknown}; known: {sorted(known)}")
    csv_path = args.out / "calibration.csv"
    done = {r["name"] for r in read_csv(csv_path)}
    todo = [p for p in POINTS if args.all or (p.name in args.names if args.names else p.name not in done)]
    for p in todo:
        t0 = time.perf_counter()
        row = run_point(p, args.sensitivity)
        rows = [r for r in read_csv(csv_path) if set(r) == set(FIELDS)] + [row]
        args.out.mkdir(parents=True, exist_ok=True)
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
        print(f"{p.name}: published {p.published} {p.unit}, estimate {row['low']} / {row['mid']} / {row['high']} "
              f"({row['error_mid']:+.1%}) [{time.perf_counter() - t0:.0f} s]", flush=True)
    table = calibration_markdown(read_csv(csv_path))
    (args.out / "calibration.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
