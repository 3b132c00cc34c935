"""``python -m trnkit.bench [KERNEL ...] [--quick] [--mode forward backward] [--save-reference | --out DIR]``.

Runs the sweeps of :mod:`trnkit.bench.cases`, appends rows to ``DIR/bench.csv`` (the one schema of
:mod:`trnkit.bench.schema`) case by case and at the end drops the earlier rows they replace (same kernel,
impl, mode, metric, shape and config: a kernel can be re-run alone), writes ``DIR/bench.md`` (markdown
table) and PNG plots under ``DIR/plots/`` — table and plots over every kernel in the CSV, so kernels can
be run one at a time.
Without kernel names it runs every kernel that is importable and skips (with the reason) those that
are not. ``--report-only`` rebuilds the table and plots without running anything. DIR is
``outputs/bench`` (``outputs/bench/quick`` with ``--quick``) unless ``--save-reference`` (the tracked
``benchmarks/data``) or ``--out`` says otherwise (:mod:`trnkit.bench.paths`).

``--device`` (a Trainium host with the real ``nki``): the same cases, each kernel's measured wall time
(host timer around a synchronised call: ``nki.benchmark`` is gone since nki 0.2) in the same CSV.
``python -m trnkit.bench calibrate measured.csv`` refits the cost model to such a CSV
(:mod:`trnkit.bench.calibrate`). Neither has run on hardware: only their guards and a synthetic CSV
are tested.

``python -m trnkit.bench step --flavor F --seq N --batch B --lnc 2``: the estimated trn2 time of one Qwen3
train step from its NKI kernels (:mod:`trnkit.bench.step`).

``python -m trnkit.bench figures [-j N]``: re-runs every cost-model figure the docs quote, in parallel
processes, then rewrites the docs' tables (:mod:`trnkit.bench.figures`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence

from trnkit.bench import cases as cases_mod
from trnkit.bench.harness import run_cases
from trnkit.bench.paths import add_output_args, output_dir
from trnkit.bench.plots import plot_rows
from trnkit.bench.schema import latest_rows, merge_newest, read_rows, write_rows
from trnkit.bench.table import markdown_table


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trnkit.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("kernels", nargs="*",
                   help=f"kernels to run (default: all available of {', '.join(cases_mod.KERNELS)})")
    p.add_argument("--quick", action="store_true", help="CI-size shapes")
    p.add_argument("--mode", nargs="+", choices=cases_mod.MODES, default=list(cases_mod.MODES))
    add_output_args(p, "the CSV, markdown table and plots")
    p.add_argument("--keep-going", action="store_true",
                   help="log a failing case and continue (exit status 1 at the end) instead of stopping")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing; rebuild the table and plots from the CSV in --out")
    p.add_argument("--dtype", nargs="+", choices=cases_mod.DTYPES, default=["bfloat16"],
                   help="input dtypes to sweep")
    p.add_argument("--chip", default="trn2", choices=("trn2", "trn1"))
    p.add_argument("--no-torch", action="store_true", help="skip timing the torch reference ops")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timing per measured quantity")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads while timing reference ops (0: torch's default)")
    p.add_argument("--overwrite", action="store_true", help="start a fresh CSV instead of merging into it")
    p.add_argument("--device", action="store_true",
                   help="measure the kernels on this Trainium host (needs the real nki; NOT TESTED ON HARDWARE)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["step"]:  # python -m trnkit.bench step --flavor 0.6B --seq 4096
        from trnkit.bench.step import main as step_main

        return step_main(argv[1:])
    if argv[:1] == ["figures"]:  # python -m trnkit.bench figures -j 2: every cost-model figure the docs quote
        from trnkit.bench.figures import main as figures_main

        return figures_main(argv[1:])
    if argv[:1] == ["calibrate"]:  # python -m trnkit.bench calibrate measured.csv
        from trnkit.bench.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    args = p.parse_args(argv)
    if not (math.isfinite(args.budget) and args.budget > 0):
        p.error(f"--budget: seconds of timing per measured quantity must be a finite number > 0, got {args.budget}")
    if args.torch_threads < 0:
        p.error(f"--torch-threads must be >= 0 (0: torch's default), got {args.torch_threads}")
    if args.save_reference and args.quick:
        p.error("--save-reference with --quick: the quick CI-size shapes are not reference figures")
    if args.device:
        from trnkit.nki_api import REAL_NKI

        if not REAL_NKI:
            p.error("--device needs the real nki (a Trainium host with the Neuron SDK); here trnkit.nki_api "
                    "resolves to its CPU interpreter")

    names = args.kernels or list(cases_mod.KERNELS)
    modes = tuple(args.mode)
    selected = []
    for k in names:
        why = cases_mod.unavailable(k)
        if why and args.kernels:  # asked for explicitly: an error
            p.error(f"cannot benchmark {k}: {why}")
        if why:
            print(f"skipping {k}: {why}")
            continue
        selected.append(k)
    if args.report_only:
        selected = []
    t0 = time.perf_counter()
    out = output_dir(args, scratch_sub="quick" if args.quick else "")
    try:  # before any case runs: a bad --out must not cost a sweep
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out: cannot write to {out} ({e.strerror})")
    empty = [k for k in selected if not any(cases_mod.cases_for(k, args.quick, modes, dt) for dt in args.dtype)]
    if empty and args.kernels:  # asked for explicitly: say so instead of "no results"
        p.error(f"no cases of {', '.join(empty)} for --mode {' '.join(modes)} --dtype {' '.join(args.dtype)}")
    csv_path = out / "bench.csv"
    if args.overwrite and not args.report_only:  # a fresh CSV
        csv_path.unlink(missing_ok=True)
    rows = []
    failures: list[str] = []
    for k in selected:
        print(f"{k} ({'quick' if args.quick else 'full'}, {', '.join(modes)}):")
        k_cases = [c for dt in args.dtype for c in cases_mod.cases_for(k, args.quick, modes, dt)]
        k_rows = run_cases(k_cases, chip=args.chip,
                           measure_torch=not args.no_torch, budget_s=args.budget,
                           torch_threads=args.torch_threads or None,
                           sink=lambda case_rows: write_rows(csv_path, case_rows),  # saved case by case
                           failures=failures if args.keep_going else None)
        rows += k_rows
    if not csv_path.exists():
        print(f"no results in {csv_path}")
        return 1
    if rows:  # this run's rows replace the earlier rows of the same shape, metric and config
        dropped = merge_newest(csv_path)
        print(f"{dropped} earlier rows replaced by this run's in {csv_path}")
    # the table and plots cover the whole CSV: the newest row per (kernel, impl, mode, metric, x, config)
    every = latest_rows(read_rows(csv_path))
    (out / "bench.md").write_text(
        "Estimated = trnkit's trn2 cost model on the interpreter's instruction trace (not a measurement); "
        "measured = wall time on the named device.\n\n" + markdown_table(every) + "\n")
    pngs = plot_rows(every, out / "plots")  # every plot is redrawn from the CSV
    for stale in set((out / "plots").glob("*.png")) - set(pngs):  # drawn first: a failed plot loses nothing
        stale.unlink()
    print(markdown_table([r for r in every if r.kernel in selected] if rows else every))
    print(f"{len(rows)} new rows -> {csv_path}; table of all {len({r.kernel for r in every})} kernels -> "
          f"{out / 'bench.md'}; {len(pngs)} plots -> {out / 'plots'} ({time.perf_counter() - t0:.1f} s)")
    if failures:
        print(f"{len(failures)} case(s) FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
