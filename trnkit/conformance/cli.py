"""``python -m trnkit conformance``: run the nki-library conformance cases and print one row each."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import cases as _cases
from . import harness

REFERENCE_CSV = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "conformance.csv"
FETCH_HINT = ("set NKILIB_SRC (or --nkilib) to a checkout of AWS nki-library: "
              "git clone https://github.com/aws-neuron/nki-library (or NKILIB_TARBALL to its git archive, "
              "nki-library-<commit>.tar.gz)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nkilib", help="nki-library checkout (default: $NKILIB_SRC)")
    p.add_argument("-k", "--filter", action="append", default=[],
                   help="only cases whose 'kernel case shapes' text contains this (repeatable: any)")
    p.add_argument("--csv", help="also write the table as CSV to this path")
    p.add_argument("--save-reference", action="store_true",
                   help=f"write the rows to {REFERENCE_CSV.relative_to(REFERENCE_CSV.parents[2])} (the tracked "
                        "figures quoted in docs/interpreter.md; with -k, only the selected cases' rows "
                        "change), each as it finishes")
    p.add_argument("--tier", choices=("unit", harness.MODEL_CONFIG, harness.REDUCED, "all"), default="unit",
                   help="the cases of the tests' unit tables (default), of their model-config tables (3775 rows, "
                        "hours of CPU; listed only with a checkout), the model-config rows run with token counts "
                        "reduced for CPU time (trnkit.conformance.reduce), or all")
    p.add_argument("--list", action="store_true", help="list the cases without running them")


def csv_path_problem(path: str) -> str | None:
    """Why ``--csv path`` cannot be written (None when it can): the table goes to ``path`` through a sibling
    ``<name>.tmp`` and ``<name>.lock``, so ``path`` must name a file in a folder that exists or can be made."""
    p = Path(path)
    if not p.name or p.is_dir():
        return "must name a file, not a folder"
    parent = next((q for q in (p.parent, *p.parent.parents) if q.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"its folder {str(parent)!r} is a file"
    return None


def run(args: argparse.Namespace) -> int:
    """Exit status 0 when every selected case ends as the run accepts (:func:`harness.row_ok`: a pass, a checked
    xfail, the refusal the case names), 1 otherwise, 2 before anything runs: no checkout, a ``--csv`` path that
    cannot be written, or ``-k`` text that selects no case."""
    if args.csv is not None and (why := csv_path_problem(args.csv)):
        print(f"conformance: --csv {args.csv!r}: {why}; nothing was run", file=sys.stderr)
        return 2
    root = harness.nkilib_root(args.nkilib)
    tier = {"unit": "", "all": None}.get(args.tier, args.tier)
    order = _cases.all_cases(root)
    in_tier = [c for c in order if tier is None or c.tier == tier]
    selected = [c for c in in_tier
                if not args.filter or any(f in f"{c.kernel} {c.name} {c.shapes}" for f in args.filter)]
    if root is None and not args.list:
        print(f"conformance: no nki-library checkout found; {FETCH_HINT}", file=sys.stderr)
        return 2
    if args.filter and not selected:
        print(f"conformance: -k {' -k '.join(repr(f) for f in args.filter)}: no case of the {args.tier!r} tier "
              f"({len(in_tier)} cases) has this text in its 'kernel case shapes'; --list shows them", file=sys.stderr)
        return 2
    if args.list:
        for c in selected:
            print(f"{c.kernel:<30} {c.name:<40} lnc{c.lnc} {c.shapes}  ({c.test_file})")
        return 0
    print(f"nki-library {harness.nkilib_commit(root)} at {root}; {len(selected)} cases", flush=True)
    done: list[harness.Row] = []

    def echo(row: harness.Row) -> None:
        print(harness.format_row(row), flush=True)
        done.append(row)
        if args.save_reference:  # row by row (an interrupted run keeps what ran); the other rows stay
            harness.write_csv(done, REFERENCE_CSV, merge_order=order)

    rows = harness.run_cases(selected, root, echo=echo)
    print(harness.format_table(rows).splitlines()[-1])
    if args.csv:
        harness.write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    if args.save_reference:
        print(f"updated {REFERENCE_CSV}")
    return 0 if all(harness.row_ok(c, r) for c, r in zip(selected, rows)) else 1
