"""What the side-by-side benchmarks (trnkit's kernels against AWS nki-library's under the same trn2 cost
model: ``attention_peak.py``, ``mlp_peak.py``, ``cross_entropy_peak.py``, ``rmsnorm_peak.py``) share: a
trace-only estimate of one call, the time ratio line they print, and the CSV they save.

nki-library itself is reached through the conformance harness's checkout (``NKILIB_SRC`` or the archive in
``shared/thirdparty``); nothing of it is copied into trnkit.
"""

from __future__ import annotations

import argparse
import csv
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from trnkit.bench import fingerprint
from trnkit.nkisim import cost, trace

PEAK = 79e12  # TensorE bf16 FLOP/s per physical core (trn2)
HBM_BW = 362.5e9  # HBM bytes/s per physical core (trn2), the cost model's bandwidth


class Estimate(NamedTuple):
    """Estimated ns of one call at the optimistic (low), mid and pessimistic (high) end, and the trace seconds."""

    low: float
    mid: float
    high: float
    seconds: float


def saved_estimate(row: dict, prefix: str) -> Estimate:
    """The estimate a saved CSV row holds in its ``{prefix}low`` / ``mid`` / ``high`` columns (us), in ns."""
    return Estimate(*(float(row[f"{prefix}{k}"]) * 1e3 for k in ("low", "mid", "high")), 0.0)


def add_side_args(p: argparse.ArgumentParser, kernel: str, csv_name: str) -> None:
    """The options every side-by-side script shares: which side to trace, and whether to save its CSV."""
    side = p.add_mutually_exclusive_group()
    side.add_argument("--no-nkilib", action="store_true", help=f"trnkit's {kernel} only")
    side.add_argument("--nkilib-from-csv", action="store_true",
                      help=f"trace trnkit's {kernel} only; take nki-library's figures from the saved CSV")
    p.add_argument("--save", action="store_true", help=f"write benchmarks/data/{csv_name}")


def estimate(run: Callable[[], Any], chip: str = "trn2", trace_only: bool = True) -> Estimate:
    """Trace ``run()`` on the interpreter and estimate it (``trace_only``: large matmuls skip their arithmetic;
    False where the kernel's control flow depends on the values it computes)."""
    t = time.time()
    with trace.record(trace_only=trace_only) as tr:
        run()
    seconds = time.time() - t
    return Estimate(*cost.estimate(tr, chip).total_range_ns, seconds)


def line_at(x: float, points: Sequence[tuple[float, Estimate]]) -> Estimate:
    """The estimate at ``x`` on the straight line through two traced ``(size, Estimate)`` points (a launch
    whose work repeats per unit of size: its fixed part counted once); trace seconds summed."""
    (x1, e1), (x2, e2) = points
    low, mid, high = (a + (b - a) / (x2 - x1) * (x - x1) for a, b in zip(e1[:3], e2[:3]))
    return Estimate(low, mid, high, e1.seconds + e2.seconds)


def time_ratio(ours: Estimate, theirs: Estimate) -> tuple[float, float]:
    """trnkit's time over nki-library's at mid and at the pessimistic end (< 1: trnkit faster)."""
    return ours.mid / theirs.mid, ours.high / theirs.high


def print_ratio(label: str, ours: Estimate, theirs: Estimate) -> None:
    mid, pessimistic = time_ratio(ours, theirs)
    print(f"{label} trnkit / nki-library time: {mid:.2f}x mid, {pessimistic:.2f}x pessimistic", flush=True)


def require_nkilib(script: str) -> None:
    """Stop ``script`` with a message when the nki-library checkout is missing: its side-by-side would otherwise
    trace trnkit's side alone (and a save would hold no nki-library figures)."""
    from trnkit.conformance import harness

    if harness.nkilib_root() is None:
        dirs = ", ".join(str(d) for d in harness.TARBALL_DIRS)
        raise SystemExit(f"{script}: nki-library not found (NKILIB_SRC is unset and no nki-library-*.tar.gz in "
                         f"{dirs}): set NKILIB_SRC to a checkout, or pass --no-nkilib for trnkit's side only")


@functools.cache
def nkilib_commit() -> str:
    """The commit of the nki-library checkout the conformance harness finds (``NKILIB_SRC`` or the archive)."""
    from trnkit.conformance import harness

    root = harness.nkilib_root()
    return harness.nkilib_commit(root) if root is not None else "unknown"


def stamp(who: str, family: str) -> dict[str, str]:
    """The fingerprint fields of a row (:mod:`trnkit.bench.fingerprint`) estimated now: trnkit's kernel family
    ``trnkit/kernels/<family>`` for ``who == "trnkit"``, else nki-library's commit."""
    if who == "trnkit":
        return fingerprint.stamp([f"trnkit/kernels/{family}"])
    return fingerprint.stamp(nkilib=nkilib_commit())


def write_csv(rows: Sequence[dict], path: Path, replace: Sequence[str] = ()) -> None:
    """``rows`` (one dict each) to ``path``, the header the newest row's keys (then any other row's). Without
    ``replace`` the file is rewritten; with it, earlier rows are kept unless a new row has the same values in the
    ``replace`` columns (an earlier row without a newer column leaves it empty)."""
    if replace and path.exists():
        new = {tuple(str(r[k]) for k in replace) for r in rows}
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if tuple(r[k] for k in replace) not in new] + list(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in (rows[-1], *rows) for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(f"-> {path}")
