"""trnkit's fused linear cross-entropy side by side with AWS nki-library's experimental ``cross_entropy_forward``
/ ``cross_entropy_backward`` under the trn2 cost model, both at LNC=2, bf16, the same token count and vocabulary.

The two do different amounts of work, and the table says which:

- trnkit's fused kernels take hidden ``[N, H]`` and the lm_head ``[V, H]``, in two schedules (``--schedules``):
  ``fused`` (opt-in: the trainer's ``training.loss_schedule = "fused"``; its default is ``recompute``): the forward,
  ``linear_cross_entropy_fwd_bwd``, computes the logits once and from them the loss, the lse and both gradients
  (``6 N H V`` FLOPs; each token group's exp values go through an HBM scratch of at most 1,024 x V between its two
  passes), and the backward only scales the stored fp32 gradients into bf16 (a torch elementwise op, counted at its
  HBM bound); ``recompute``: the forward ``linear_cross_entropy`` computes the logits, their log-sum-exp and the loss
  (``2 N H V``), and the backward ``linear_cross_entropy_bwd`` recomputes the logits and produces both gradients
  (``6 N H V``). fp32 accumulation throughout; no ``[N, V]`` tensor in HBM.
- nki-library's kernels take the logits ``[N, V]`` from HBM: the forward computes lse and loss (internal dtype
  bf16, as its tests run it), the backward ``grad_logits`` (written over the logits). The lm_head matmul before
  it and the two gradient matmuls after it are someone else's job, and the ``[N, V]`` logits live in HBM.

With the fused schedule the forward does the backward's matmuls, so only forward + backward together compare
like with like (the table adds that row per schedule). Each nki-library row is shown twice: its kernel alone, and
"the same job": its kernel plus the lm_head
matmul(s) at their lower bound (the larger of TensorE's bf16 peak time for ``2 N H V`` FLOPs forward,
``4 N H V`` backward, and the HBM time of their operands and the logits), the most any matmul kernel could
give it. The ratio against the same job is the fair one; the ratio against the kernel alone is a floor.

Tracing: trnkit's kernel at two vocabulary sizes, read on the straight line through the two at V, the sizes
doubled from 2,048 and 4,096 rows until the line's slopes are a steady state's (as ``python -m trnkit.bench step``
does: :func:`trnkit.bench.step._steady`); nki-library's at 2 and 4 batches of positions per core, read on the
line at N (its position batches run one after another with the same instructions). Shapes: nki-library's
test row for Qwen3's 151,936 vocabulary (``test_cross_entropy_forward.py`` / ``_backward.py``, B=2, T=4096: N =
8,192; its tests have no H, its kernel none either) with the hidden size of Qwen3-4B (2,560) and of
Qwen3-30B-A3B (2,048). nki-library's position batch and vocabulary chunk are its tests' (forward chunk 32,768
instead of the test's 65,535: two 65,535-wide bf16 tiles are live at once, 262,140 bytes per partition, more
than SBUF holds).

Usage: ``python benchmarks/cross_entropy_peak.py [--cases Qwen3-4B ...] [--modes forward backward]
[--schedules fused recompute] [--no-nkilib | --nkilib-from-csv] [--save]``; ``--save`` writes
``benchmarks/data/cross_entropy_peak.csv``, each (case, schedule, pass) row replacing its earlier one as soon as
it is estimated. ``--nkilib-from-csv`` traces trnkit's side
only and carries nki-library's figures over from that CSV (same position batch and chunk), for when only trnkit's
kernel changed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
from pathlib import Path

import ml_dtypes
import numpy as np
from side_by_side import (HBM_BW, PEAK, Estimate, add_side_args, estimate, line_at, nkilib_commit, print_ratio,
                          require_nkilib, saved_estimate, stamp, write_csv)

from trnkit.bench import fingerprint
from trnkit.bench.step import estimate_op, loss_op

CSV = Path(__file__).parent / "data" / "cross_entropy_peak.csv"
LNC = 2
# (case, N positions, H, V, nki-library (positions per batch, chunk) forward, backward)
SHAPES = [
    ("Qwen3-4B", 8192, 2560, 151936, (64, 32768), (128, 16384)),
    ("Qwen3-30B-A3B", 8192, 2048, 151936, (64, 32768), (128, 16384)),
]
MODES = ("forward", "backward")


SCHEDULES = ("fused", "recompute")


def _trnkit(N: int, H: int, V: int, mode: str, schedule: str) -> Estimate:
    e = estimate_op(loss_op(N, H, V, mode, LNC, full=False, schedule=schedule), "trn2", {})
    return Estimate(e.low_ns, e.mid_ns, e.high_ns, e.trace_s)


def _nkilib(N: int, V: int, mode: str, pb: int, cs: int) -> Estimate:
    """nki-library's kernel for ``N`` positions, on the line through traces of 2 and 4 batches per core."""
    from trnkit.conformance import harness

    root = harness.nkilib_root()
    bf = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    points = []
    with harness.nki_is_interpreter(root):
        nl = importlib.import_module("nki.language")
        ce = importlib.import_module("nkilib_src.nkilib.experimental.loss.cross_entropy")
        for n in (2 * LNC * pb, 4 * LNC * pb):
            logits = rng.standard_normal((n, V)).astype(bf)
            targets = rng.integers(0, V, n).astype(np.int32)
            if mode == "forward":
                def run():
                    return ce.cross_entropy_forward[LNC](logits, targets, positions_per_batch=pb, chunk_size=cs,
                                                         dtype=nl.bfloat16)
            else:
                lse = (rng.random(n) + np.log(V)).astype(bf)

                def run():
                    return ce.cross_entropy_backward[LNC](logits, targets, lse, reduction="mean",
                                                          positions_per_batch=pb, chunk_size=cs, dtype=nl.bfloat16)
            with contextlib.redirect_stdout(io.StringIO()):
                points.append((n, estimate(run)))
    return line_at(N, points)


def _saved_nkilib(case: str, mode: str, pb: int, cs: int) -> tuple[Estimate, dict]:
    """nki-library's figures for ``case``/``mode`` from the saved CSV (traced with the same position batch and
    chunk), for re-running trnkit's side alone, and the saved row (its fingerprint)."""
    rows = []
    if CSV.exists():
        with CSV.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if (r["case"], r["mode"]) == (case, mode)]
    same_config = bool(rows) and (rows[0]["nkilib_pb"], rows[0]["nkilib_cs"]) == (str(pb), str(cs))
    if not same_config or not rows[0].get("nkilib_us_mid"):
        raise SystemExit(f"--nkilib-from-csv: {CSV.name} has no nki-library figures for case={case} mode={mode} "
                         f"positions_per_batch={pb} chunk_size={cs}; run without it to trace nki-library's kernel")
    return saved_estimate(rows[0], "nkilib_us_"), rows[0]


def _fingerprint(saved: dict | None) -> dict[str, str]:
    """The row's fingerprint fields: trnkit's kernel family and nki-library's commit, computed now; with
    nki-library's figures carried over from ``saved``, its commit is the saved row's and the row keeps the
    saved row's cost model unless that is the tree's (a carried figure is as current as its row was)."""
    if saved is None:
        return fingerprint.stamp(["trnkit/kernels/cross_entropy"], nkilib=nkilib_commit())
    nkilib = fingerprint.parse_sources(saved.get("sources") or "").get(fingerprint.NKILIB, "unknown")
    fp = fingerprint.stamp(["trnkit/kernels/cross_entropy"], nkilib=nkilib)
    if saved.get("cost_model") != fp["cost_model"]:
        fp["cost_model"] = saved.get("cost_model") or ""
    return fp


def matmul_bound_ns(N: int, H: int, V: int, mode: str) -> float:
    """The least time of the lm_head matmul(s) nki-library's kernel needs around it, LNC=2: forward
    ``logits = hidden @ W^T`` (writes [N, V]), backward ``grad_hidden = grad_logits @ W`` and
    ``grad_W = grad_logits^T @ hidden`` (reads [N, V]); bf16 operands, TensorE peak or HBM, whichever binds."""
    flops = 2 * N * H * V * (1 if mode == "forward" else 2)
    hbm_bytes = 2 * (N * V + (N * H + V * H) * (1 if mode == "forward" else 2))
    return max(flops / PEAK, hbm_bytes / HBM_BW) / LNC * 1e9


def _fmt(e: Estimate) -> str:
    return f"{e.mid / 1e3:11,.1f} us [{e.low / 1e3:,.1f}-{e.high / 1e3:,.1f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    add_side_args(p, "kernels", CSV.name)
    args = p.parse_args()
    if not (args.no_nkilib or args.nkilib_from_csv):
        require_nkilib("cross_entropy_peak.py")
    for case, N, H, V, fwd_cfg, bwd_cfg in SHAPES:
        if case not in args.cases:
            continue
        for schedule, (mode, (pb, cs)) in ((s, m) for s in args.schedules for m in zip(MODES, (fwd_cfg, bwd_cfg))):
            if mode not in args.modes:
                continue
            tk = _trnkit(N, H, V, mode, schedule)
            print(f"{case:14s} {mode:8s} trnkit {schedule:9s} {_fmt(tk)}", flush=True)
            row = {"case": case, "schedule": schedule, "mode": mode, "N": N, "H": H, "V": V, "lnc": LNC,
                   "trnkit_us_mid": round(tk.mid / 1e3, 1), "trnkit_us_low": round(tk.low / 1e3, 1),
                   "trnkit_us_high": round(tk.high / 1e3, 1), "nkilib_pb": pb, "nkilib_cs": cs}
            saved = None
            if args.nkilib_from_csv:
                aws, saved = _saved_nkilib(case, mode, pb, cs)
            else:
                aws = None if args.no_nkilib else _nkilib(N, V, mode, pb, cs)
            row.update(_fingerprint(saved) if aws is not None else stamp("trnkit", "cross_entropy"))
            if aws is not None:
                mm = matmul_bound_ns(N, H, V, mode)
                job = Estimate(aws.low + mm, aws.mid + mm, aws.high + mm, aws.seconds)
                print(f"{case:14s} {mode:8s} nki-library alone {_fmt(aws)}; + lm_head matmul bound "
                      f"{mm / 1e3:,.1f} us = {_fmt(job)}", flush=True)
                print_ratio(f"{case:14s} {mode:8s} (kernel alone)", tk, aws)
                print_ratio(f"{case:14s} {mode:8s} (same job)    ", tk, job)
                row.update(nkilib_us_mid=round(aws.mid / 1e3, 1), nkilib_us_low=round(aws.low / 1e3, 1),
                           nkilib_us_high=round(aws.high / 1e3, 1), matmul_bound_us=round(mm / 1e3, 1))
            if args.save:
                write_csv([row], CSV, replace=("case", "schedule", "mode"))


if __name__ == "__main__":
    main()
