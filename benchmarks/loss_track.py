"""The all-kernels configs against the reference (torch) path: the training loss, step by step.

    python benchmarks/loss_track.py [--steps 20] [--configs debug_dense_nki debug_moe_nki] [--jobs 3] [--save-reference]

For each config, four runs of the same job (same seed, data, schedule; checkpoints off) in this process:

- ``nki``: the config as shipped: every kernel op swapped in under the strict policy;
- ``reference``: the same config with ``--overrides.policy off`` (the model's own torch ops);
- ``reference_reordered``: the reference again with ``training.loss_chunk_size`` = 64 instead of 256: the
  same arithmetic in fp32, summed in another order;
- ``reference_impls``: the config with ``--overrides.impl reference``: every swap point runs the torch
  reference op of its kernel (the same math in fp32 with other rounding points in every layer, no NKI).

The last two are kernel-free witnesses: how far they drift from the reference is the spread that fp32
rounding alone produces on this trajectory. The losses are compared at :func:`allowed_rtol` (derived in
:func:`tolerance`'s docstring). Writes ``loss_track.csv``: one row per config and step (the four losses, the
nki path's absolute and relative difference from the reference, the witnesses' relative differences, the
spread so far, the tolerance at that step) and one ``max`` row per config; a run replaces the rows of its
configs and keeps the others, so the configs can run in separate processes.
"""

from __future__ import annotations

import argparse
import csv
import math
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: use its trnkit

from trnkit.bench.paths import add_output_args, output_dir  # noqa: E402

CONFIGS = ("debug_dense_nki", "debug_moe_nki")
REORDERED_CHUNK = 64  # tokens per loss chunk of the reordered reference (the configs run 256 = one chunk)
SPREAD_FACTOR = 4  # how many times the kernel-free witnesses' spread the nki path may drift (see tolerance)
FIELDS = ["config", "step", "dtype", "loss_reference", "loss_nki", "loss_reference_reordered",
          "loss_reference_impls", "abs_diff", "rel_diff", "rel_diff_reordered", "rel_diff_impls", "spread", "rtol",
          "atol", "within"]


def tolerance(dtype: str, steps: int) -> tuple[float, float]:
    """(rtol floor, atol) for the loss of the nki path against the reference's at every step up to ``steps``.

    float32 (the configs' ``training.dtype``): both paths compute in fp32 and differ only in summation
    order. Each reduction of length n is off by about sqrt(n) units of fp32 roundoff (2**-24) in the
    relative sense: the loss at step 1 (a mean of 256 log-sum-exps over V = 151,936 logits, each a dot
    product over H = 256, through 4 layers) lands within 1e-6 (tests/tolerances.py's model-level rtol
    1e-5 covers it). From step 2 on the weights differ by the previous steps' updates, and AdamW's first
    steps divide each gradient by its own magnitude, so a gradient element near zero that rounds
    differently moves its weight by up to the learning rate, and the difference grows from step to step;
    a gradient-norm spike amplifies it by one to two orders of magnitude (the dense debug run's steps 5,
    9, 13 and 16). How far it grows depends on the trajectory, not on the kernels, so the bound is
    measured on the same trajectory: :func:`allowed_rtol` is the larger of this floor and
    ``SPREAD_FACTOR`` times the farthest either kernel-free witness (the reordered reference, the torch
    reference impls) has drifted from the reference by that step. The floor, 2**-13 = 1.2e-4 relative
    (about 1,000 fp32 ulps), holds alone until the witnesses drift past 3e-5, i.e. on the early steps
    and on calm trajectories; it is 32 times below one bf16 rounding of the loss (2**-8 relative), so a
    kernel that loses precision to bf16 anywhere, drops a token or an expert, or mis-scales a row fails
    at the first steps, where the witnesses agree with the reference to about 1e-7. The factor 4 allows
    for the kernels' rounding seed being another draw of the same chaotic growth: in the dense run the
    two witnesses' own maxima differ by a factor of 27, so no single witness is the spread.
    bfloat16 runs are not covered (the configs are fp32).
    """
    if dtype != "float32":
        raise ValueError(f"loss_track tolerance: training.dtype {dtype!r} has no stated tolerance (float32 only)")
    if steps > 20:
        raise ValueError(f"loss_track tolerance: stated for at most 20 steps, got {steps}")
    return 2.0 ** -13, 0.0


def allowed_rtol(floor: float, spread: float) -> float:
    """The relative tolerance at a step whose kernel-free witnesses have drifted at most ``spread`` so far."""
    return max(floor, SPREAD_FACTOR * spread)


@dataclass
class Track:
    config: str
    dtype: str
    reference: dict[int, float]
    nki: dict[int, float]
    reordered: dict[int, float]
    impls: dict[int, float]
    override_table: str

    def rows(self, steps: int) -> list[dict]:
        floor, atol = tolerance(self.dtype, steps)
        out, spread = [], 0.0
        for s in range(1, steps + 1):
            ref, nki, reo, imp = self.reference[s], self.nki[s], self.reordered[s], self.impls[s]
            diff = abs(nki - ref)
            rel_reo, rel_imp = abs(reo - ref) / abs(ref), abs(imp - ref) / abs(ref)
            spread = max(spread, rel_reo, rel_imp)
            rtol = allowed_rtol(floor, spread)
            out.append({"config": self.config, "step": s, "dtype": self.dtype, "loss_reference": ref, "loss_nki": nki,
                        "loss_reference_reordered": reo, "loss_reference_impls": imp, "abs_diff": diff,
                        "rel_diff": diff / abs(ref), "rel_diff_reordered": rel_reo, "rel_diff_impls": rel_imp,
                        "spread": spread, "rtol": rtol, "atol": atol, "within": diff <= atol + rtol * abs(ref)})
        worst = max(out, key=lambda r: r["rel_diff"] / r["rtol"])  # the step closest to (or furthest past) its bound
        out.append({**{k: "" for k in FIELDS}, "config": self.config, "step": "max", "dtype": self.dtype,
                    **{k: max(r[k] for r in out) for k in ("abs_diff", "rel_diff", "rel_diff_reordered",
                                                           "rel_diff_impls", "spread")},
                    "rtol": worst["rtol"], "atol": atol, "within": all(r["within"] for r in out)})
        return out


PATHS = {"reference": ("--overrides.policy", "off"),
         "reference_reordered": ("--overrides.policy", "off", "--training.loss_chunk_size", str(REORDERED_CHUNK)),
         "reference_impls": ("--overrides.impl", "reference"),
         "nki": ()}


def run_path(config: str, steps: int, dump: Path, extra: tuple[str, ...]) -> tuple[dict[int, float], str, str, float]:
    """One training run of ``config``: (losses per step, the override table, training.dtype, CPU seconds)."""
    from trnkit.harness.config import parse_args  # the trainer loads only when a run starts
    from trnkit.harness.train import run

    cfg = parse_args(["--config", config, "--training.steps", str(steps), "--job.dump_folder", str(dump),
                      "--checkpoint.enable", "false", "--metrics.plot", "false", "--metrics.progress_bar", "false",
                      "--metrics.progress_freq", "0", *extra])
    t = time.process_time()
    result = run(cfg)
    return result.losses, result.override_table, cfg.training.dtype, time.process_time() - t


def track(config: str, steps: int, workdir: Path, jobs: int = 1, log=print) -> Track:
    """Run ``config`` (a shipped config name or path) ``steps`` steps on the four paths, ``jobs`` processes
    at a time (1: one after the other in this process)."""
    args = {path: (config, steps, workdir / f"{Path(config).stem}_{path}", extra) for path, extra in PATHS.items()}
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {path: pool.submit(run_path, *a) for path, a in args.items()}
            out = {path: f.result() for path, f in futures.items()}
    else:
        out = {path: run_path(*a) for path, a in args.items()}
    for path, (*_, cpu_s) in out.items():
        log(f"{config} {path}: {steps} steps in {cpu_s:.0f} s CPU")
    return Track(Path(config).stem, out["nki"][2], out["reference"][0], out["nki"][0],
                 out["reference_reordered"][0], out["reference_impls"][0], out["nki"][1])


def write_csv(rows: list[dict], path: Path) -> None:
    """``rows`` into ``path``, replacing the rows of their configs and keeping every other config's."""
    configs = {r["config"] for r in rows}
    if path.exists():
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["config"] not in configs] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    p.add_argument("--jobs", type=int, default=1, help="run the four paths of a config in this many processes")
    add_output_args(p, "loss_track.csv")
    args = p.parse_args(argv)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            tr = track(config, args.steps, Path(tmp), args.jobs)
            print(tr.override_table)
            config_rows = tr.rows(args.steps)
            for r in config_rows:
                if r["step"] == "max":
                    print(f"{tr.config}: max |nki - reference| {r['abs_diff']:.3e} ({r['rel_diff']:.2e} relative; "
                          f"witnesses: reordered {r['rel_diff_reordered']:.2e}, reference impls "
                          f"{r['rel_diff_impls']:.2e}), tolerance at the closest step {r['rtol']:.2e}: "
                          f"{'within' if r['within'] else 'OUTSIDE'}")
                    ok = ok and r["within"]
                else:
                    print(f"{tr.config} step {r['step']:2d}: reference {r['loss_reference']:.6f} nki "
                          f"{r['loss_nki']:.6f} rel {r['rel_diff']:.2e} (witnesses {r['rel_diff_reordered']:.2e} / "
                          f"{r['rel_diff_impls']:.2e}, tolerance {r['rtol']:.2e})")
            rows += config_rows
    out = output_dir(args, ROOT) / "loss_track.csv"
    write_csv(rows, out)
    print(f"-> {out}")
    return 0 if ok and all(math.isfinite(r["abs_diff"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
