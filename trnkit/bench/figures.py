"""``python -m trnkit.bench figures [-j N] [--only JOB ...] [--list]``: re-run every cost-model figure the docs quote.

Each job is one or more of the documented commands (docs/benchmarks.md, docs/cost-model.md); independent
jobs run in parallel processes (``-j``, default: the CPU count). Jobs that would write the same file run
in their own output folder and are merged here afterwards: one ``python -m trnkit.bench KERNEL`` sweep per
kernel (merged into ``benchmarks/data/bench.csv``, newest row per shape, then its table and plots are
redrawn) and one ``benchmarks/headline.py`` case per job (merged into ``benchmarks/data/headline.*``).
At the end ``scripts/docs_tables.py`` rewrites the docs' quoted figures and tables from the data.

The sweeps run with ``--no-torch``: the torch reference's CPU wall times are measurements of this machine,
not cost-model figures, and stay as they were. Each job's output goes to ``outputs/figures/logs/JOB.log``.
A failing job is reported at the end (exit status 1); the other jobs' results are still merged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trnkit.bench.paths import load_script
from trnkit.bench.schema import merge_newest, read_rows, write_rows

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data"
SCRATCH = ROOT / "outputs" / "figures"
PY = sys.executable
# the kernels of benchmarks/data/bench.csv (docs/benchmarks.md "Per-shape sweeps"), one job each
SWEEP_KERNELS = ("rope_hf", "router_topk", "rmsnorm", "attention", "cross_entropy", "mlp", "matmul_tiled",
                 "moe_experts", "grouped_mm")
NO_SENSITIVITY = ("moe_bwd",)  # headline cases run without their sensitivity table
# benchmarks/data/attention_peak.csv at LNC=2 besides 4096:8:2: Qwen3-4B's and 30B-A3B's heads, nki-library's
# attention_cte test shapes (causal bf16, head_dim 128; batch x heads folded)
ATTENTION_SHAPES = ("4096:32:8", "4096:32:4", "1024:2:2", "8192:3:3")
STEP_FLAVORS = ("0.6B", "4B", "30B-A3B")  # benchmarks/data/step.csv: seq 4096, batch 1, LNC=2


@dataclass(frozen=True)
class Job:
    """Commands run one after the other (they write the same file), from the repository root."""

    name: str
    commands: tuple[tuple[str, ...], ...]


def _headline_cases() -> list[str]:
    return list(load_script(ROOT / "benchmarks" / "headline.py", "headline").CASES)


def jobs() -> list[Job]:
    """Every job, longest first (so a parallel run starts them early)."""
    out: list[Job] = []
    for k in ("moe_experts", "grouped_mm", *[k for k in SWEEP_KERNELS if k not in ("moe_experts", "grouped_mm")]):
        out.append(Job(f"bench:{k}", ((PY, "-m", "trnkit.bench", k, "--no-torch", "--overwrite",
                                        "--out", str(SCRATCH / "bench" / k)),)))
    out.append(Job("calibration", ((PY, "benchmarks/calibration/run.py", "--all"),)))
    for case in _headline_cases():
        # moe_bwd's sensitivity table takes over an hour of one core: its range only (docs/kernels.md)
        sens = ("--no-sensitivity",) if case in NO_SENSITIVITY else ()
        out.append(Job(f"headline:{case}", ((PY, "benchmarks/headline.py", case, *sens, "--out",
                                             str(SCRATCH / "headline" / case)),)))
    out.append(Job("step", tuple((PY, "-m", "trnkit.bench", "step", "--flavor", f, "--seq", "4096", "--batch", "1",
                                  "--lnc", "2", "--save-reference") for f in STEP_FLAVORS)))
    out.append(Job("attention_peak", ((PY, "benchmarks/attention_peak.py", "--shapes", "4096:8:2", "--lnc", "1", "2",
                                       "--save"),
                                      (PY, "benchmarks/attention_peak.py", "--shapes", *ATTENTION_SHAPES, "--lnc", "2",
                                       "--save"))))
    for script in ("mlp_peak", "rmsnorm_peak", "cross_entropy_peak", "blockwise_moe"):
        out.append(Job(script, ((PY, f"benchmarks/{script}.py", "--save"),)))
    return out


def _run_job(job: Job, env: dict[str, str]) -> tuple[str, int, float]:
    log = SCRATCH / "logs" / f"{job.name.replace(':', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rc = 0
    with log.open("w") as f:
        for cmd in job.commands:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            if rc:
                break
    return job.name, rc, time.perf_counter() - t0


def merge_bench(kernels: Sequence[str]) -> int:
    """Merge the per-kernel sweeps into benchmarks/data/bench.csv (newest row per shape) and redraw its table
    and plots. Returns the rows merged."""
    new = []
    for k in kernels:
        path = SCRATCH / "bench" / k / "bench.csv"
        if path.exists():
            new += read_rows(path)
    if not new:
        return 0
    target = DATA / "bench.csv"
    write_rows(target, new)  # appended: newer than every row already there
    merge_newest(target)
    subprocess.check_call((PY, "-m", "trnkit.bench", "--report-only", "--save-reference"), cwd=ROOT)
    return len(new)


def merge_headline(cases: Sequence[str]) -> int:
    """Merge the per-case headline runs into benchmarks/data/headline.{json,csv}. Returns the cases merged."""
    headline = load_script(ROOT / "benchmarks" / "headline.py", "headline")
    path = DATA / "headline.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    merged = 0
    for case in cases:
        part = SCRATCH / "headline" / case / "headline.json"
        if part.exists():
            results.update({k: v for k, v in json.loads(part.read_text()).items() if k == case})
            merged += 1
    if merged:
        headline.write_outputs(DATA, results)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    all_jobs = jobs()
    names = [j.name for j in all_jobs]
    p = argparse.ArgumentParser(prog="python -m trnkit.bench figures", description=__doc__.split("\n\n")[0])
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="jobs run at once")
    p.add_argument("--only", nargs="+", metavar="JOB",
                   help="these jobs (or prefixes: 'bench', 'headline') instead of all of them")
    p.add_argument("--list", action="store_true", help="list the jobs and their commands")
    args = p.parse_args(argv)
    todo = all_jobs
    if args.only:
        unknown = [o for o in args.only if not any(n == o or n.startswith(o + ":") for n in names)]
        if unknown:
            p.error(f"unknown job(s) {unknown}; jobs: {', '.join(names)}")
        todo = [j for j in all_jobs if any(j.name == o or j.name.startswith(o + ":") for o in args.only)]
    if args.list:
        for j in todo:
            print(j.name + ":\n" + "\n".join("  " + " ".join(c).replace(PY, "python") for c in j.commands))
        return 0
    if args.jobs < 1:
        p.error(f"-j must be at least 1 (got {args.jobs})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    t0 = time.perf_counter()
    failed: list[str] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for name, rc, secs in pool.map(lambda j: _run_job(j, env), todo):
            print(f"{name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {secs:.0f} s", flush=True)
            if rc:
                failed.append(name)
    done = [j.name for j in todo if j.name not in failed]
    n_rows = merge_bench([n.split(":", 1)[1] for n in done if n.startswith("bench:")])
    n_cases = merge_headline([n.split(":", 1)[1] for n in done if n.startswith("headline:")])
    print(f"merged {n_rows} sweep rows into {DATA / 'bench.csv'}, {n_cases} headline cases into "
          f"{DATA / 'headline.json'}")
    rc = subprocess.call((PY, "scripts/docs_tables.py"), cwd=ROOT, env=env)
    print(f"figures: {len(todo)} jobs in {time.perf_counter() - t0:.0f} s; logs in {SCRATCH / 'logs'}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (see their logs)")
    return 1 if failed or rc else 0
