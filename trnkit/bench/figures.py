"""``python -m trnkit.bench figures [-j N] [--only JOB ...] [--list] [--stale | --only-stale]``: re-run every
cost-model figure the docs quote.

Each job is one or more of the documented commands (docs/benchmarks.md, docs/cost-model.md); independent
jobs run in parallel processes (``-j``, default: the CPU count). Jobs that would write the same file run
in their own output folder and are merged here afterwards: one ``python -m trnkit.bench KERNEL`` sweep per
kernel (merged into ``benchmarks/data/bench.csv``, newest row per shape, then its table and plots are
redrawn) and one ``benchmarks/headline.py`` case per job (merged into ``benchmarks/data/headline.*``).
At the end ``scripts/docs_tables.py`` rewrites the docs' quoted figures and tables from the data.

Every row a job writes records what it was computed with (:mod:`trnkit.bench.fingerprint`); ``--stale`` lists
the jobs whose rows carry another fingerprint than the tree's (or none), ``--only-stale`` runs just those.

The sweeps run with ``--no-torch``: the torch reference's CPU wall times are measurements of this machine,
not cost-model figures, and stay as they were. Each job's output goes to ``outputs/figures/logs/JOB.log``.
A failing job is reported at the end (exit status 1); the other jobs' results are still merged.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trnkit.bench import fingerprint
from trnkit.bench.paths import load_script
from trnkit.bench.schema import latest_rows, merge_newest, read_rows, write_rows

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
    """Commands run one after the other (they write the same file), from the repository root; ``data``: the
    file its rows go to (relative to the root), ``select``: which of that file's rows are its own."""

    name: str
    commands: tuple[tuple[str, ...], ...]
    data: str = ""
    select: tuple[str, str] | None = None  # (column, value): the job's rows; None: every row
    nkilib: bool = False  # traces nki-library's kernels too (needs a checkout: NKILIB_SRC or its archive)


def job_rows(job: Job, root: Path | None = None) -> list[dict[str, str]]:
    """The rows ``job`` last wrote, each a dict with at least the fingerprint fields (``trnkit.bench.fingerprint``;
    empty where the row has none). bench.csv rows carry them in ``details``; only the cost-model rows count."""
    path = (root or ROOT) / job.data
    if not path.exists():
        return []
    if job.data.endswith("bench.csv"):
        return [{"kernel": r.kernel, "timestamp": r.timestamp,
                 **{k: str(r.details.get(k, "")) for k in fingerprint.FIELDS}}
                for r in latest_rows(read_rows(path))
                if r.kernel == job.select[1] and r.device.endswith("(cost model)")]
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if job.name == "calibration":  # appended: the newest row per point
        rows = list({r["name"]: r for r in rows}.values())
    if job.select:
        rows = [r for r in rows if r.get(job.select[0]) == job.select[1]]
    return rows


def stale_jobs(todo: Sequence[Job], root: Path | None = None, nkilib: str | None = None) -> list[tuple[Job, dict]]:
    """``(job, fingerprint.job_status(...))`` of the jobs whose data is not every row current (``root``: the tree
    and its data, default this checkout; ``nkilib``: nki-library's commit, None: not compared)."""
    root = root or ROOT
    out = []
    for job in todo:
        st = fingerprint.job_status(job_rows(job, root), root, nkilib)
        if not st["current"]:
            out.append((job, st))
    return out


def _headline_cases() -> list[str]:
    return list(load_script(ROOT / "benchmarks" / "headline.py", "headline").CASES)


def jobs() -> list[Job]:
    """Every job, longest first (so a parallel run starts them early)."""
    out: list[Job] = []
    data = "benchmarks/data"
    for k in ("moe_experts", "grouped_mm", *[k for k in SWEEP_KERNELS if k not in ("moe_experts", "grouped_mm")]):
        out.append(Job(f"bench:{k}", ((PY, "-m", "trnkit.bench", k, "--no-torch", "--overwrite",
                                        "--out", str(SCRATCH / "bench" / k)),), f"{data}/bench.csv", ("kernel", k)))
    out.append(Job("calibration", ((PY, "benchmarks/calibration/run.py", "--all"),),
                   "benchmarks/calibration/calibration.csv"))
    for case in _headline_cases():
        # moe_bwd's sensitivity table takes over an hour of one core: its range only (docs/kernels.md)
        sens = ("--no-sensitivity",) if case in NO_SENSITIVITY else ()
        out.append(Job(f"headline:{case}", ((PY, "benchmarks/headline.py", case, *sens, "--out",
                                             str(SCRATCH / "headline" / case)),), f"{data}/headline.csv",
                       ("case", case)))
    out.append(Job("step", tuple((PY, "-m", "trnkit.bench", "step", "--flavor", f, "--seq", "4096", "--batch", "1",
                                  "--lnc", "2", "--save-reference") for f in STEP_FLAVORS), f"{data}/step.csv"))
    out.append(Job("attention_peak", ((PY, "benchmarks/attention_peak.py", "--shapes", "4096:8:2", "--lnc", "1", "2",
                                       "--fallback", "--save"),
                                      (PY, "benchmarks/attention_peak.py", "--shapes", *ATTENTION_SHAPES, "--lnc", "2",
                                       "--save")), f"{data}/attention_peak.csv", nkilib=True))
    for script in ("mlp_peak", "rmsnorm_peak", "cross_entropy_peak", "blockwise_moe"):
        out.append(Job(script, ((PY, f"benchmarks/{script}.py", "--save"),), f"{data}/{script}.csv",
                       nkilib=script != "blockwise_moe"))
    # what the docs' derived blocks read off traces (PSUM what-if, kernel_opt waits and spill, rope / router busy)
    out.append(Job("derived_figures", ((PY, "benchmarks/derived_figures.py", "--save-reference"),),
                   f"{data}/derived_figures.csv"))
    # nki-library's recorded device times (held-out check points), and the LNC 1 what-if of one table
    nkilib = "benchmarks/calibration/nkilib_run.py"
    out.append(Job("nkilib_calibration", ((PY, nkilib, "--all"),), "benchmarks/calibration/nkilib_calibration.csv",
                   nkilib=True))
    # every row of the table (the largest, size 3.4e10, traced in ~11 s at LNC 1 on an idle machine)
    whatif = "benchmarks/calibration/nkilib_whatif_lnc1.csv"
    out.append(Job("nkilib_whatif_lnc1", ((PY, nkilib, "--lnc", "1", "--table", "attention_cte_no_cp_unit_perms",
                                           "--max-size", "1e11", "--all", "--out", whatif),), whatif, nkilib=True))
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


def _nkilib_root() -> Path | None:
    """The nki-library checkout (``NKILIB_SRC``, else its archive extracted), None when there is none."""
    from trnkit.conformance import harness

    return harness.nkilib_root()


def _nkilib_commit() -> str | None:
    """The commit of the nki-library checkout (None when there is none: its rows' commits are not compared)."""
    from trnkit.conformance import harness

    root = _nkilib_root()
    return harness.nkilib_commit(root) if root is not None else None


def main(argv: Sequence[str] | None = None) -> int:
    all_jobs = jobs()
    names = [j.name for j in all_jobs]
    p = argparse.ArgumentParser(prog="python -m trnkit.bench figures", description=__doc__.split("\n\n")[0])
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="jobs run at once")
    p.add_argument("--only", nargs="+", metavar="JOB",
                   help="these jobs (or prefixes: 'bench', 'headline') instead of all of them")
    p.add_argument("--list", action="store_true", help="list the jobs and their commands")
    p.add_argument("--stale", action="store_true",
                   help="list the jobs whose data carries another fingerprint than the tree's (or none), and why")
    p.add_argument("--only-stale", action="store_true", help="run only the jobs --stale lists")
    args = p.parse_args(argv)
    todo = all_jobs
    if args.only:
        unknown = [o for o in args.only if not any(n == o or n.startswith(o + ":") for n in names)]
        if unknown:
            p.error(f"unknown job(s) {unknown}; jobs: {', '.join(names)}")
        todo = [j for j in all_jobs if any(j.name == o or j.name.startswith(o + ":") for o in args.only)]
    if args.stale or args.only_stale:
        stale = stale_jobs(todo, nkilib=_nkilib_commit())
        if args.stale:
            print(f"cost model {fingerprint.cost_model_hash()} (trnkit.bench.fingerprint); {len(stale)} of "
                  f"{len(todo)} jobs stale")
            for job, st in stale:
                why = ", ".join(st["reasons"])
                print(f"{job.name}: {st['stale_rows']} of {st['rows']} rows in {job.data} ({why}); last computed "
                      f"{st['computed'] or 'not recorded'}" if st["rows"] else f"{job.name}: no rows in {job.data}")
            return 0
        todo = [job for job, _ in stale]
    if args.list:
        for j in todo:
            print(j.name + ":\n" + "\n".join("  " + " ".join(c).replace(PY, "python") for c in j.commands))
        return 0
    if args.jobs < 1:
        p.error(f"-j must be at least 1 (got {args.jobs})")
    needs_nkilib = [j.name for j in todo if j.nkilib]
    if needs_nkilib and _nkilib_root() is None:  # say so before the other jobs run, not after them
        p.error(f"job(s) {needs_nkilib} trace nki-library's kernels, and no nki-library checkout was found: set "
                "NKILIB_SRC to one (or put its nki-library-*.tar.gz under shared/thirdparty), or leave those jobs out")
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
