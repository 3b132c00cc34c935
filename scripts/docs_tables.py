"""Write the tables in README.md and docs/*.md that come from benchmark outputs (benchmarks/data/*.csv).

A generated table sits between two markers, the first naming its generator:

    <!-- generated: interp_speed -->
    ...table written by this script...
    <!-- end generated -->

    python scripts/docs_tables.py           # rewrite every generated region from the CSVs
    python scripts/docs_tables.py --check   # exit 1 and name the stale regions (tests/test_docs.py runs this)

Edit the CSV (by re-running its benchmark with --save-reference), never the table.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
REGION = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def read_csv(name: str) -> list[dict[str, str]]:
    with open(DATA / name, newline="") as f:
        return list(csv.DictReader(f))


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def interp_speed() -> str:
    """benchmarks/interp_speed.py: tiled matmul 2048^3 on the interpreter vs numpy."""
    rows = []
    for r in read_csv("interp_speed.csv"):
        rows.append([
            r["dtype"], f"{float(r['interp_s']):.2f} s", f"{float(r['interp_traced_s']):.2f} s",
            f"{float(r['interp_trace_only_s']):.2f} s", f"{float(r['instr_per_s']):,.0f}",
            f"{float(r['numpy_s']):.2f} s", f"**{float(r['ratio']):.1f}x**", f"{float(r['target_ratio']):.0f}x",
            r["timestamp"][:16],
        ])
    header = ["inputs", "interpreter", "traced", "trace-only", "instructions/s (traced)",
              "numpy fp32 `A.T @ B`", "ratio", "target", "measured (UTC)"]
    return _table(header, rows)


def _step_table(csv_name: str) -> list[list[str]]:
    by_case: dict[tuple[str, str, str, str], dict[str, dict[str, str]]] = {}
    for r in read_csv(csv_name):
        by_case.setdefault((r["flavor"], r["vocab_size"], r["batch"], r["seq"]), {})[r["impl"]] = r
    rows = []
    for (flavor, vocab, batch, seq), impls in by_case.items():
        ours = impls.pop("trnkit")
        best = min(impls.values(), key=lambda r: float(r["best_ms"]))
        fastest_median = min(float(r["median_ms"]) for r in impls.values())
        theirs = ", ".join(f"{name.removeprefix('transformers[').rstrip(']')} {float(r['best_ms']):.0f}"
                           for name, r in impls.items())
        ratio = float(best["best_ms"]) / float(ours["best_ms"])
        ratio_median = fastest_median / float(ours["median_ms"])
        rows.append([f"`{flavor}`", f"{int(vocab):,}", f"{batch}×{seq}", f"{float(ours['best_ms']):.0f}",
                     theirs, f"**{ratio:.2f}×** (median {ratio_median:.2f}×)"])
    return rows


def qwen3_step() -> str:
    """benchmarks/qwen3_step.py: one train step, trnkit's native Qwen3 vs transformers (best of 5, ms)."""
    rows = _step_table("qwen3_step.csv") + _step_table("qwen3_step_vocab2048.csv")
    header = ["flavor", "vocab", "batch×seq", "trnkit ms", "transformers ms (per experts backend)",
              "speed vs fastest transformers"]
    return _table(header, rows)


GENERATORS: dict[str, Callable[[], str]] = {"interp_speed": interp_speed, "qwen3_step": qwen3_step}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def regenerate(text: str, where: str = "") -> str:
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise SystemExit(f"{where}: unknown generated region '{name}'; known: {sorted(GENERATORS)}")
        return m.group(1) + GENERATORS[name]() + m.group(4)

    return REGION.sub(fill, text)


def stale_regions() -> list[str]:
    """Files whose generated regions differ from what the CSVs give now."""
    stale = []
    for path in doc_files():
        text = path.read_text()
        if regenerate(text, str(path)) != text:
            stale.append(str(path.relative_to(ROOT)))
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale regions (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_regions()
        for name in stale:
            print(f"stale generated table in {name}: run python scripts/docs_tables.py", file=sys.stderr)
        return 1 if stale else 0
    for path in doc_files():
        text = path.read_text()
        new = regenerate(text, str(path))
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
