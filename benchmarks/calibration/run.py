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
import functools
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import replace
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

from trnkit import nkisim  # noqa: E402
from trnkit.bench import fingerprint  # noqa: E402
from trnkit.nkisim import cost, cost_params, trace  # noqa: E402

FIELDS = ("name", "kernel", "shape", "device", "unit", "published", "low", "mid", "high", "error_mid", "role",
          "tolerance", "source", "note", "constrains", "sensitivity", *fingerprint.FIELDS)
# the calibration's kernels (trnkit.bench.fingerprint sources of every point)
KERNEL_SOURCES = tuple(f"benchmarks/calibration/{m}.py" for m in ("kernel_opt_kernels", "mamba_kernels",
                                                                   "matmul_kernels", "micro_kernels"))
UNIT_NS = {"ms": 1e6, "us": 1e3, "ns": 1.0, "%": 1.0, "x": 1.0}  # "%" and "x" points are not times
CHAIN = (64, 256)  # scalar_chain lengths whose difference gives the initiation interval
STREAM = (8, 24)  # dma_curve stream lengths whose difference gives the time per transfer
SETTINGS = ("low", "mid", "high")


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
    unchecked = nkisim.simulate(kernels[p.version], capacity="unchecked")
    return lambda: unchecked(lhsT, rhs)


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
    if p.family == "dma_intro":
        a = torch.ones(d["rows"], d["cols"], dtype=torch.bfloat16)
        return lambda: micro_kernels.dma_exp_roundtrip(a)
    if p.family == "dma_curve":  # each load into its own tile, as a stream of independent transfers
        a = torch.ones(128, d["bytes"] // 2, dtype=torch.bfloat16)
        stream = nkisim.simulate(micro_kernels.dma_load_stream, capacity="unchecked")
        return lambda: stream(a, n_chain)
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


def _range(vals: list[float]) -> tuple[float, float, float]:
    """(lowest, the mid setting's, highest) of a quantity's values under the low / mid / high settings
    (a share or a throughput need not move with the kernel time's direction)."""
    return min(vals), vals[1], max(vals)


def standalone_hbm(setting: str) -> cost_params.LaunchParams:
    """The standalone launch's HBM condition at ``setting`` ("low" / "mid" / "high"; any other setting, a
    parameter alone at one end, takes mid's), without its start-up and core skew. Every published figure here
    is of a kernel run on its own (the tutorials' profiles and ``nki.benchmark``, the DMA overview's one-core
    examples), so an LNC 1 kernel has its HBM stack to itself (cost.hbm_per_core); the start-up is added only to
    the points whose figure is a whole execution (``Point.standalone``, :func:`estimate_point`)."""
    setting = HBM_ALONE.get(setting, setting)
    lp = cost_params.STANDALONE_LAUNCH.setting(setting if setting in SETTINGS else "mid")
    return replace(lp, startup_ns=0.0, core_skew_ns=0.0)


# The launch's HBM condition alone at its optimistic / pessimistic end (the parameters at mid): one more
# one-at-a-time "parameter" of a share's range (:func:`estimate_point`), as the curve's range counts it
HBM_ALONE = {"hbm:0": "low", "hbm:1": "high"}


def _per_transfer_ns(nbytes: int, params: cost_params.ModelParams, launch: cost_params.LaunchParams) -> float:
    """Time per transfer of back-to-back [128, nbytes] loads from one queue (the difference of two stream
    lengths: cancels the first trigger and the last transfer's tail)."""
    # every load of the stream moves its bytes (the figure measures transfers): no reload is dropped
    one_queue = replace(params, dma_queues=1, reuse_loads="none")
    short, long_ = (cost.estimate_total(list(_stream_trace(nbytes, n)), "trn2", one_queue, launch) for n in STREAM)
    return (long_ - short) / (STREAM[1] - STREAM[0])


@functools.lru_cache(maxsize=8)
def _stream_trace(nbytes: int, n: int) -> tuple:
    """The instructions of a stream of ``n`` [128, nbytes] loads (traced once, estimated under many settings)."""
    p = Point("curve", "dma_curve", str(nbytes), "", {"bytes": nbytes})
    return tuple(trace_of(kernel_call(p, None, n)))


def _relative_throughput(nbytes: int, params: cost_params.ModelParams, launch: cost_params.LaunchParams) -> float:
    """Throughput of back-to-back loads of ``nbytes`` per partition over that of 32 KiB per partition."""
    return (nbytes / _per_transfer_ns(nbytes, params, launch)) / (32768 / _per_transfer_ns(32768, params, launch))


def _curve_range(nbytes: int) -> tuple[float, float, float]:
    """(lowest, mid, highest) relative throughput of ``nbytes`` over the parameters' ends.

    A ratio of two estimated times need not move with the parameters the way either time does (a faster
    engine speeds up the 32 KiB reference more than a small transfer), so the three settings do not bound
    it. Its range is taken over every combination of the optimistic and pessimistic ends of the
    parameters that move either time (a parameter moves it if either end alone changes the small or the
    32 KiB transfer's time; the standalone launch's HBM condition counts as one more two-ended parameter);
    the mid is the all-mid value (docs/cost-model.md, "Calibration")."""
    mid_p, launches = cost_params.MID, (standalone_hbm("low"), standalone_hbm("high"))

    def times(params: cost_params.ModelParams, launch: cost_params.LaunchParams) -> tuple[float, float]:
        return _per_transfer_ns(nbytes, params, launch), _per_transfer_ns(32768, params, launch)

    base = times(mid_p, standalone_hbm("mid"))
    moving = [name for name in cost_params.PARAM_NAMES
              if any(times(p, standalone_hbm("mid")) != base for p in cost_params.one_at_a_time(name))]
    hbm_moves = any(times(mid_p, lp) != base for lp in launches)
    values = [_relative_throughput(nbytes, mid_p, standalone_hbm("mid"))]
    for ends in itertools.product((cost_params.LOW, cost_params.HIGH), repeat=len(moving)):
        params = replace(mid_p, **{name: getattr(end, name) for name, end in zip(moving, ends)})
        for lp in launches if hbm_moves else (standalone_hbm("mid"),):
            values.append(_relative_throughput(nbytes, params, lp))
    return min(values), values[0], max(values)


def _timeline_metric(p: Point, tr: trace.Trace, params: cost_params.ModelParams,
                     launch: cost_params.LaunchParams) -> float:
    """One instruction's time in the list schedule, as the point's profile shows it (ns)."""
    instrs = list(tr)
    times = cost.timeline(instrs, p.device, params, launch)
    dmas = [t for t in times if t.engine == "dma"]
    if p.metric == "dma_engine":  # the first load on one of its engines: first to last byte of its share
        first = next(i for i in instrs if i.engine == "dma")
        return cost.instr_cost(first, p.device, params, cost.hbm_per_core(p.device, launch, 1)).transfer_ns
    if p.metric.startswith("dma_issue:"):  # trigger to first byte of DMA k
        k = int(p.metric.split(":")[1])
        return dmas[k].first_byte - dmas[k].start
    scalar = [t for t in times if t.engine == "scalar"]
    if p.metric == "dma_wake":  # the load's last byte to ScalarE's first instruction (the table load)
        first = scalar[0].table_load[0] if scalar[0].table_load else scalar[0].start
        return first - dmas[0].end
    if p.metric == "op:act_table_load":
        return scalar[0].table_load[1] - scalar[0].table_load[0]
    if p.metric.startswith("op:"):
        op = p.metric.split(":")[1]
        t = next(t for t, i in zip(times, instrs) if i.op == op)
        return t.end - t.start
    raise ValueError(f"calibration: unknown metric {p.metric!r} of point {p.name!r}")


def _selection_shares(times: list, instrs: list, engine: str) -> tuple[float, float]:
    """(mid, wide definition) of ``engine``'s active share, %, over "the actual execution period" as the
    fused-Mamba tutorial selects it in neuron-profile's Selection Summary: from the engine's first
    instruction on loaded data (its first read of a tile a DMA wrote) to its last instruction's end. The
    tutorial's toy profile (nki/img/mamba_v1_profile_zoomed.png: Start Time 16.92 us, End Time 167.84 us,
    98.71 %) leaves out the NEFF's start-up, VectorE's instructions before the loaded data arrives and
    the last stores."""
    loaded = {key for i in instrs if i.engine == "dma" for key, _, _ in i.attrs["writes"]}
    mine = [t for t in times if t.engine == engine and not t.dropped]
    first = next((t for t in mine if any(key in loaded for key, _, _ in instrs[t.index].attrs["reads"])), None)
    if first is None:
        return 0.0, 0.0
    lo, hi = first.start, max(t.end for t in mine)
    mine = [t for t in mine if t.start >= lo]
    busy = [(t.start, t.end) for t in mine] + [t.table_load for t in mine if t.table_load]
    wide = busy + [(t.start, min(hi, max(t.end, t.ready))) for t in mine]
    span = hi - lo
    return 100 * cost._union(busy) / span, 100 * cost._union(wide) / span


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
    if p.family == "dma_curve":  # a ratio: its range over the parameters' ends, not the three settings
        return _curve_range(int(p.version)), {}
    tr = _kernel_trace(p, dims)
    if p.metric.startswith("active:"):  # the profiler's engine-active share, %
        # the range spans the narrow / wide active definitions (cost.ACTIVE_DEFINITIONS) under the three
        # settings and under each parameter alone at each end, the launch's HBM condition counted as one
        # more parameter (HBM_ALONE): a share of the total does not move with the parameters
        # monotonically, so the all-optimistic / all-pessimistic corners do not bound it
        engine = p.metric.removeprefix("active:")
        reports = [_report(p, dims, tr, k) for k in SETTINGS]
        reports += [_report(p, dims, tr, f"{name}:{end}") for name in cost_params.PARAM_NAMES for end in (0, 1)]
        reports += [_report(p, dims, tr, k) for k in HBM_ALONE if standalone_hbm(k) != standalone_hbm("mid")]
        shares = [100 * r.active.get(engine, 0.0) for r in reports]
        ends = [100 * a / r.total_ns for r in reports for a in r.active_range_ns.get(engine, (0.0, 0.0))]
        return (min(shares + ends), shares[1], max(shares + ends)), {}
    if p.metric.startswith("selection:"):  # the engine's active share of its own first-to-last span, %
        engine = p.metric.removeprefix("selection:")
        settings = [cost_params.SETTINGS[k] for k in SETTINGS]
        settings += [v for name in cost_params.PARAM_NAMES for v in cost_params.one_at_a_time(name)]
        shares = [_selection_shares(cost.timeline(list(tr), p.device, s), list(tr), engine) for s in settings]
        mids = [m for m, _ in shares]
        return (min(mids + [w for _, w in shares]), mids[1], max(mids + [w for _, w in shares])), {}
    if p.metric != "total" and not p.metric.startswith("busy:"):
        vals = [_timeline_metric(p, tr, cost_params.SETTINGS[k], standalone_hbm(k)) for k in SETTINGS]
        return _range(vals), {}
    if p.metric.startswith("busy:"):  # one engine's summed instruction time under each setting
        engine = p.metric.removeprefix("busy:")
        return _range([_report(p, dims, tr, k).busy_ns.get(engine, 0.0) for k in SETTINGS]), {}
    rng = tuple(_report(p, dims, tr, k).total_ns for k in SETTINGS)  # = estimate(tr).total_range_ns
    sens = cost.sensitivity(tr, p.device, standalone_hbm("mid")) if with_sensitivity else {}
    if p.standalone and not dims:  # the published figure holds the launch; a slice (dims) is the kernel alone
        per_launch = cost.programs_per_launch(list(tr))
        launch = [cost.launch_overhead_ns(per_launch, cost_params.STANDALONE_LAUNCH.setting(k)) for k in SETTINGS]
        rng = tuple(t + x for t, x in zip(rng, launch))
        sens = {k: (lo + launch[1], hi + launch[1]) for k, (lo, hi) in sens.items()}
    return rng, sens


_REPORTS: dict[tuple, cost.CostReport] = {}  # (kernel, setting) -> report: the points of one run share it


# The points whose kernel, at its published shape, reloads data that does not stay resident at mid
# (cost_params.reuse_loads "resident": all of it would have to fit in SBUF at once), so that no reload is
# dropped there; tests/nkisim/test_calibration_points.py checks the full shapes. A slice of one (fewer
# M-tiles or channel tiles: the tests, fit.py) reloads less, which could stay resident.
RELOADS_NOT_RESIDENT = frozenset((
    "mamba_v1", "mamba_v3 s2048", "mamba_v3 s4096", "mamba_v3", "matmul tiled", "matmul hoist_load",
    "matmul block_free_dimension", "matmul fully_optimized", "kernel_opt v2", "kernel_opt v3", "kernel_opt v4",
    "kernel_opt v5"))


def slice_params(p: Point, params: cost_params.ModelParams) -> cost_params.ModelParams:
    """The parameters a slice of point ``p``'s kernel is estimated with: its published shape's reload
    decision, every reload kept at mid where that shape's reloaded data does not stay resident."""
    name = next((q.name for q in POINTS if q.metric == "total" and (q.family, q.version, q.dims)
                 == (p.family, p.version, p.dims)), p.name)
    if name in RELOADS_NOT_RESIDENT and params.reuse_loads == "resident":
        return replace(params, reuse_loads="none")
    return params


def _report(p: Point, dims: dict | None, tr: trace.Trace, setting: str) -> cost.CostReport:
    key = (p.family, p.version, p.device, tuple(sorted({**p.dims, **(dims or {})}.items())), setting)
    if key not in _REPORTS:
        if _REPORTS and all(k[:4] != key[:4] for k in _REPORTS):
            _REPORTS.clear()  # another kernel: keep one kernel's reports
        if setting in cost_params.SETTINGS:
            params = cost_params.SETTINGS[setting]
        elif setting in HBM_ALONE:  # the HBM condition alone at one end (standalone_hbm), parameters at mid
            params = cost_params.MID
        else:  # "<parameter>:<0|1>": that parameter alone at its optimistic (0) / pessimistic (1) value
            name, end = setting.split(":")
            params = cost_params.one_at_a_time(name)[int(end)]
        _REPORTS[key] = cost.estimate(tr, p.device, params=slice_params(p, params) if dims else params,
                                      launch=standalone_hbm(setting))
    return _REPORTS[key]


def run_point(p: Point, with_sensitivity: bool = False) -> dict:
    (low, mid, high), sens = estimate_point(p, with_sensitivity=with_sensitivity)
    k = UNIT_NS[p.unit]
    text = "; ".join(f"{name} {lo / k:.3g}..{hi / k:.3g}" for name, (lo, hi) in
                     sorted(sens.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])))
    return {"name": p.name, "kernel": f"{p.family} {p.version}", "shape": f"{p.shape} {p.dtype}", "device": p.device,
            "unit": p.unit, "published": p.published, "low": round(low / k, 4), "mid": round(mid / k, 4),
            "high": round(high / k, 4), "error_mid": round(mid / k / p.published - 1, 4), "role": p.role,
            "tolerance": p.tolerance, "source": p.source, "note": p.note, "constrains": p.constrains,
            "sensitivity": text, **fingerprint.stamp(KERNEL_SOURCES)}


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def main(argv: list[str] | None = None) -> int:
    from docs_tables import calibration_markdown  # scripts/ on sys.path

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
        # the other points' rows as they are (a column they lack stays empty), the point's own replaced
        rows = [r for r in read_csv(csv_path) if r["name"] != p.name and set(r) <= set(FIELDS)] + [row]
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
