"""The figures the docs' ``<!-- derived: ... -->`` blocks read off cost-model traces, re-read on this tree.

docs/cost-model.md ("PSUM banks" and the ``kernel_opt`` v3 / v4 / v5 analysis under "Calibration") and
docs/kernel-design.md (rope_hf's and router_topk's busy times) quote totals, busy times, waits and spill
traffic of a few traces estimated under one changed parameter at a time. This script traces each kernel once
and writes every such figure as one row, so ``scripts/docs_tables.py --check`` can compare the pages with it
and ``python -m trnkit.bench figures --stale`` knows when a cost-model change makes them stale.

Traces (trace-only interpreter runs):

* ``rope_fwd``, ``router_fwd``, ``router_bwd``, ``moe_fwd``: the headline cases (``benchmarks/headline.py``);
  ``python -m trnkit demo``'s tiled matmul; the fixed-shift
  attention forward (``attention_peak.py``'s inputs at S = 4,096, 8 / 2 heads, LNC=1); Qwen3-0.6B's q head norm
  (``trnkit.bench``'s ``q-norm flavor`` case: 2,048 tokens x 16 heads, LNC=2); the one-pass cross-entropy
  (``linear_cross_entropy_fwd_bwd`` at N = 1,024, Qwen3-4B's H, V = 8,192, LNC=2). Each estimated as the
  headline does (inside a larger graph, no launch) at ``cost_params.MID`` and ``HIGH``; rope and router also
  with ``psum_banks`` ``"rotate"`` and ``"lowest"``, and ``DIDT_TRACES`` at MID with ``didt_throttle`` on;
* ``kernel_opt v2`` - ``v5``: the calibration's points (``benchmarks/calibration/run.py`` ``kernel_call``, the
  published fp32 [8192, 4096] x [8192, 8192]), in the standalone HBM condition without the start-up (the
  calibration's kernel-only figure), at MID, and at MID with one parameter changed (``WHATIFS``); at MID
  also TensorE's waits on ``cost.timeline`` and the spill traffic of ``cost.sbuf_plan``.

Rows: ``trace, setting, quantity, value`` (times in us) and the fingerprint fields
(:mod:`trnkit.bench.fingerprint`). ``setting`` is ``mid`` / ``high``, or ``mid <parameter>=<value>``.

Usage: ``python benchmarks/derived_figures.py [TRACE ...] [--save-reference | --out DIR]`` (about 10 minutes of
one idle core); ``--save-reference`` writes ``benchmarks/data/derived_figures.csv`` (the figures the docs
quote), otherwise ``outputs/bench/derived_figures.csv``; naming traces re-reads only those and keeps the other
traces' rows.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "calibration"))

import headline  # noqa: E402
import run as calibration  # noqa: E402
from points import POINTS  # noqa: E402

from trnkit.bench import cases, fingerprint  # noqa: E402
from trnkit.bench.paths import add_output_args, output_dir  # noqa: E402
from trnkit.nkisim import cost, cost_params, hardware, trace  # noqa: E402

CSV_NAME = "derived_figures.csv"
FIELDS = ("trace", "setting", "quantity", "value", *fingerprint.FIELDS)
KERNEL_OPT_VERSIONS = ("v2", "v3", "v4", "v5")
PSUM_RULES = ("rotate", "lowest")
# kernel_opt: one parameter changed at mid (docs/cost-model.md's candidate mechanisms for v3 -> v4 -> v5)
WHATIFS = {"dma_queues=1": {"dma_queues": 1}, "hoist_bounded_by_sbuf=True": {"hoist_bounded_by_sbuf": True},
           "didt_throttle=True": {"didt_throttle": True}, "psum_banks=rotate": {"psum_banks": "rotate"},
           "psum_banks=lowest": {"psum_banks": "lowest"}}
# the traces whose total with TensorE's dI/dt throttle on (at mid) docs/cost-model.md quotes ("Ranges")
DIDT_TRACES = ("demo_matmul", "rope_fwd", "router_fwd", "router_bwd")
GAP_NS = 1e-3  # a TensorE wait shorter than this (float noise between back-to-back matmuls) is none
LONG_GAP_NS = 1500.0  # the dI/dt throttle's reach: a gap of 1.5 us or more (docs/cost-model.md)

Row = tuple[str, float]  # (quantity, value)


def report_rows(rep: cost.CostReport) -> Iterator[Row]:
    """The total, each engine's busy time and instruction count, and TensorE's active share."""
    yield "total_us", rep.total_ns / 1e3
    for engine, ns in sorted(rep.busy_ns.items()):
        yield f"busy_us:{engine}", ns / 1e3
    for engine, n in sorted(rep.count.items()):
        yield f"count:{engine}", n
    if rep.total_ns:
        yield "active_pct:tensor", 100 * rep.active_ns.get("tensor", 0.0) / rep.total_ns


def _attention_fixed_shift() -> Callable[[], object]:
    """attention_peak.py's fixed-shift forward at S = 4,096, 8 / 2 heads, LNC=1 (its inputs)."""
    from trnkit.kernels.attention import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4096, h, 128, generator=g).bfloat16() for h in (8, 2, 2))
    return lambda: attention(q, k, v, lnc=1, fixed_shift=True)


def _q_norm_0_6b() -> Callable[[], object]:
    """trnkit.bench's ``q-norm flavor (LNC=2)`` forward case at Qwen3-0.6B (16 heads, head_dim 128)."""
    return cases._rmsnorm_build(2048 * 16, 128, False, torch.bfloat16, 2)().nki


def _demo_matmul() -> Callable[[], object]:
    """``python -m trnkit demo``'s tiled matmul: [256x512] @ [512x1024] bf16 (lhsT [512, 256], rhs [512, 1024])."""
    from trnkit.demo import matmul_tiled

    g = torch.Generator().manual_seed(0)
    lhsT, rhs = torch.randn(512, 256, generator=g).bfloat16(), torch.randn(512, 1024, generator=g).bfloat16()
    return lambda: matmul_tiled(lhsT, rhs)


def _lce_fused() -> Callable[[], object]:
    """The one-pass cross-entropy at N = 1,024, Qwen3-4B's H (2,560), V = 8,192, bf16, LNC=2."""
    from trnkit.kernels.cross_entropy import linear_cross_entropy_fwd_bwd

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1024, 2560, generator=g).bfloat16()
    weight = (torch.randn(8192, 2560, generator=g) * 2560 ** -0.5).bfloat16()
    labels = torch.randint(0, 8192, (1024,), generator=g)
    return lambda: linear_cross_entropy_fwd_bwd(hidden, weight, labels, lnc=2)


# name -> (the kernel call's builder, its sources (trnkit.bench.fingerprint), PSUM bank rules estimated too)
TRACES: dict[str, tuple[Callable[[], Callable[[], object]], tuple[str, ...], tuple[str, ...]]] = {
    **{name: (headline.CASES[name].build, headline.CASES[name].sources, rules)
       for name, rules in (("rope_fwd", PSUM_RULES), ("router_fwd", PSUM_RULES), ("moe_fwd", ()),
                           ("router_bwd", ()))},
    "demo_matmul": (_demo_matmul, ("trnkit/demo.py",), ()),
    "attention_fixed_shift_fwd": (_attention_fixed_shift, ("trnkit/kernels/attention",), ()),
    "rmsnorm_q_norm_0.6B_fwd": (_q_norm_0_6b, ("trnkit/kernels/rmsnorm",), ()),
    "cross_entropy_fused_fwd": (_lce_fused, ("trnkit/kernels/cross_entropy",), ()),
}


def launch_rows(name: str) -> Iterator[tuple[str, str, float]]:
    """``(setting, quantity, value)`` of launch ``name`` of :data:`TRACES` at MID and HIGH (and under its PSUM
    bank rules)."""
    build, _, rules = TRACES[name]
    call = build()
    with trace.record(trace_only=True) as tr:
        call()
    instrs = list(tr)
    programs: dict[int, list] = {}
    for ins in instrs:
        programs.setdefault(ins.program_id, []).append(ins)
    # the PSUM tiles the bank rules place (cost._psum_tiles: bytes per partition first), per program
    tiles = [cost._psum_tiles(p) for p in programs.values()]
    bank = hardware.get_chip("trn2").psum_bytes_per_partition // hardware.get_chip("trn2").psum_banks
    yield "", "psum_tiles", max(len(t) for t in tiles)
    yield "", "psum_banks_per_tile_max", max(-(-t[0] // bank) for p in tiles for t in p.values())
    for setting, base in (("mid", cost_params.MID), ("high", cost_params.HIGH)):
        rep = cost.estimate(tr, "trn2", params=base)
        yield setting, "memory_bound_us", rep.memory_bound_ns / 1e3
        for quantity, value in report_rows(rep):
            yield setting, quantity, value
        for rule in rules:
            rep = cost.estimate(tr, "trn2", params=replace(base, psum_banks=rule))
            yield f"{setting} psum_banks={rule}", "total_us", rep.total_ns / 1e3
    if name in DIDT_TRACES:
        rep = cost.estimate(tr, "trn2", params=replace(cost_params.MID, didt_throttle=True))
        yield "mid didt_throttle=True", "total_us", rep.total_ns / 1e3


def tensor_waits(tr: trace.Trace, device: str, launch: cost_params.LaunchParams) -> Iterator[Row]:
    """TensorE's idle time on the list schedule at MID: before its first instruction, between two of its
    instructions (the waits: count, sum, longest, when the last one ends, how many reach ``LONG_GAP_NS``)
    and after its last one until the kernel ends."""
    timings = cost.timeline(tr, device, params=cost_params.MID, launch=launch)
    te = sorted((t for t in timings if t.engine == "tensor"), key=lambda t: t.start)
    gaps = [(a.end, b.start - a.end) for a, b in zip(te, te[1:]) if b.start - a.end > GAP_NS]
    yield "tensor_before_us", te[0].start / 1e3
    yield "tensor_after_us", (max(t.end for t in timings) - te[-1].end) / 1e3
    yield "tensor_waits", len(gaps)
    yield "tensor_waits_us", sum(g for _, g in gaps) / 1e3
    yield "tensor_wait_longest_us", max((g for _, g in gaps), default=0.0) / 1e3
    yield "tensor_last_wait_at_us", max((t for t, _ in gaps), default=0.0) / 1e3
    yield "tensor_waits_over_1500ns", sum(g >= LONG_GAP_NS for _, g in gaps)


def kernel_opt_rows(version: str) -> Iterator[tuple[str, str, float]]:
    """``(setting, quantity, value)`` of the calibration's ``kernel_opt <version>`` trace (kernel only)."""
    point = next(p for p in POINTS if p.name == f"kernel_opt {version}")
    tr = calibration.trace_of(calibration.kernel_call(point))
    launch = calibration.standalone_hbm("mid")
    chip = hardware.get_chip(point.device)
    instrs = list(tr)
    # spill traffic: every spilled byte is stored once and reloaded once, on every partition
    plan = cost.sbuf_plan(instrs, cost._sbuf_capacity(chip, cost_params.MID),
                          cost_params.MID.spill_in_program_order)
    yield "mid", "spill_GB", 2 * chip.sbuf_partitions * sum(plan.spill.values()) / 1e9
    for quantity, value in report_rows(cost.estimate(tr, point.device, params=cost_params.MID, launch=launch)):
        yield "mid", quantity, value
    for quantity, value in tensor_waits(tr, point.device, launch):
        yield "mid", quantity, value
    for name, change in WHATIFS.items():
        rep = cost.estimate(tr, point.device, params=replace(cost_params.MID, **change), launch=launch)
        for quantity, value in report_rows(rep):
            yield f"mid {name}", quantity, value


def all_rows(names: Sequence[str] = ()) -> Iterator[dict[str, object]]:
    """Every trace's rows, or only those of ``names``."""
    jobs = [(name, sources, lambda n=name: launch_rows(n)) for name, (_, sources, _) in TRACES.items()]
    jobs += [(f"kernel_opt {v}", calibration.KERNEL_SOURCES, lambda v=v: kernel_opt_rows(v))
             for v in KERNEL_OPT_VERSIONS]
    for name, sources, rows in jobs:
        if names and name not in names:
            continue
        t0 = time.perf_counter()
        stamp = fingerprint.stamp(sources)
        n = 0
        for setting, quantity, value in rows():
            n += 1
            yield {"trace": name, "setting": setting, "quantity": quantity, "value": f"{value:.7g}", **stamp}
        print(f"{name}: {n} figures in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    known = [*TRACES, *(f"kernel_opt {v}" for v in KERNEL_OPT_VERSIONS)]
    ap.add_argument("traces", nargs="*", metavar="TRACE",
                    help=f"re-read only these, keeping the other traces' rows in the CSV; known: {', '.join(known)}")
    add_output_args(ap, CSV_NAME)
    args = ap.parse_args(argv)
    unknown = [n for n in args.traces if n not in known]
    if unknown:
        ap.error(f"unknown trace(s) {unknown}; known: {', '.join(known)}")
    path = output_dir(args, ROOT) / CSV_NAME
    kept = []
    if args.traces and path.exists():
        with path.open(newline="") as f:
            kept = [r for r in csv.DictReader(f) if r["trace"] not in args.traces]
    rows = kept + list(all_rows(args.traces))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
