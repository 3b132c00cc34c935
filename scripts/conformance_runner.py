"""Run the conformance rows not yet recorded (model-config and reduced tiers), one child process a row.

    python scripts/conformance_runner.py run --until 10:25   # UTC; from a snapshot worktree <tree>-snap
    python scripts/conformance_runner.py merge        # scratch rows -> benchmarks/data/conformance.csv + docs tables

What it does, and the caps it keeps to on the shared machine: docs/interpreter.md, "Conformance with AWS
nki-library" (the paragraph after the commands). The parent uses the standard library only; the case list, the
estimates and the rows come from the snapshot's trnkit, in child processes (``_plan``, ``_row``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CAP_GB, BIG_CAP_GB = 8.0, 14.0
BIG_MAX_LOAD, BIG_MIN_AVAILABLE_GB = 6.0, 16.0  # a 14 GB row starts only on a machine this idle
KILL_AVAILABLE_GB = 5.0  # any child is killed when MemAvailable falls under this
START_HEADROOM_GB = 1.0  # a row starts only while MemAvailable exceeds the kill line by its estimate (at least this)
PAUSE_LOAD, RESUME_LOAD, PAUSE_AFTER_S = 8.0, 6.0, 120.0
NICE = 5
AUTOGROUP_NICE = 10  # the runner's session's autogroup (lower_autogroup)
SCRATCH = Path("/tmp/conformance_runner")
EXTRA_FIELDS = ("tier", "snapshot", "peak_gb", "cpu_s", "est_cpu_s", "est_gb", "cap_gb", "row_ok", "finished")
STOP_FIELDS = ("case_id", "tier", "snapshot", "why", "peak_gb", "cpu_s", "est_cpu_s", "est_gb", "cap_gb", "finished")


# -- child side (imports trnkit: the snapshot's, through PYTHONPATH) -------------------------------------------------
def _case_key(case) -> tuple[str, str, str, str]:
    return case.kernel, case.name, str(case.lnc), case.shapes


def _reduced_values(shapes: str) -> str:
    """``S_ctx=131072->49152`` -> ``S_ctx=49152``: a reduced case's shapes as the estimates read them."""
    import re
    return re.sub(r"\d+->(\d+)", r"\1", shapes)


def child_plan(csv_path: str) -> None:
    """Print (JSON) the model-config and reduced cases with no row in ``csv_path``, with their estimates; rows
    nki-library's test skips for its memory limit are left out (the docs: not run)."""
    from trnkit.conformance import cases, harness, reduce

    with open(csv_path, newline="") as f:
        recorded = {_row_key(d) for d in csv.DictReader(f)}
    plan = []
    root = harness.nkilib_root(None)
    for c in cases.model_config_cases(root) + cases.reduced_cases(root):
        if _case_key(c) in recorded:
            continue
        if c.skipped_by.startswith("test_attn_blk_model"):
            continue
        shapes = _reduced_values(c.shapes)
        est_gb = reduce.estimate_peak_gb(c.kernel, c.name, shapes) if c.kernel.endswith("attention_block_tkg") else 0
        plan.append({"case_id": harness.case_id(c), "tier": c.tier, "est_gb": round(est_gb, 2),
                     "est_cpu_s": round(reduce.estimate_cpu_s(c.kernel, c.name, shapes), 1)})
    json.dump(plan, sys.stdout)


def child_row(case_id: str, tier: str, out: str) -> None:
    """Run the one case of ``tier`` whose :func:`harness.case_id` is ``case_id``; write its CSV row (and whether
    the run accepts it, :func:`harness.row_ok`) to ``out`` as JSON."""
    from trnkit.conformance import cases, harness

    root = harness.nkilib_root(None)
    tier_cases = cases.reduced_cases(root) if tier == harness.REDUCED else cases.model_config_cases(root)
    case = next(c for c in tier_cases if harness.case_id(c) == case_id)
    row = harness.run_case(case, root, harness.nkilib_commit(root))
    Path(out).write_text(json.dumps({"row": row.csv_row(), "row_ok": harness.row_ok(case, row)}))


# -- parent side (standard library only) -------------------------------------------------------------------------
def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def snapshot(path: Path, commit: str) -> str:
    """A detached worktree of ``commit`` at ``path`` (created, or moved there between rows); its full hash."""
    full = _git("rev-parse", commit)
    if not path.exists():
        _git("worktree", "add", "--detach", str(path), full)
    elif _git("rev-parse", "HEAD", cwd=path) != full:
        _git("checkout", "--detach", full, cwd=path)
    return full


def _child_env(snap: Path, nkilib: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(snap), "NKILIB_SRC": nkilib, "OMP_WAIT_POLICY": "PASSIVE"}


def _meminfo_gb(field: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1e6
    raise KeyError(field)


def _rss_anon_gb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 0.0


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def _log(scratch: Path, text: str) -> None:
    line = f"{_now()} {text}"
    print(line, flush=True)
    with open(scratch / "runner.log", "a") as f:
        f.write(line + "\n")


def _append(path: Path, fields: tuple[str, ...], row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        if new:
            w.writeheader()
        w.writerow(row)


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@dataclass
class Outcome:
    rc: int | None  # None: killed by the runner
    why: str  # why it was killed ("" when it exited)
    peak_gb: float
    cpu_s: float


def watch(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, cap_gb: float, deadline: float) -> Outcome:
    """Run ``cmd`` at nice :data:`NICE`, polling its memory and the machine's each second (see the module doc); the
    child is killed if the runner itself stops (SIGTERM, an exception)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, NICE))
    peak, why, paused, loaded_since = 0.0, "", False, None
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rc = None if why else os.waitstatus_to_exitcode(status)
                return Outcome(rc, why, peak, usage.ru_utime + usage.ru_stime)
            peak = max(peak, _rss_anon_gb(proc.pid))
            if not why:
                why = _why_kill(peak, cap_gb, deadline)
                if why:
                    os.kill(proc.pid, signal.SIGKILL)
            load = os.getloadavg()[0]
            if not why and not paused and load > PAUSE_LOAD:
                loaded_since = loaded_since or time.time()
                if time.time() - loaded_since > PAUSE_AFTER_S:
                    os.kill(proc.pid, signal.SIGSTOP)
                    paused = True
                    print(f"{_now()} paused (load {load:.1f})", flush=True)
            elif paused and load < RESUME_LOAD:
                os.kill(proc.pid, signal.SIGCONT)
                paused, loaded_since = False, None
                print(f"{_now()} resumed (load {load:.1f})", flush=True)
            elif load <= PAUSE_LOAD:
                loaded_since = None
            time.sleep(1.0)
    finally:
        if not why and proc.poll() is None:  # the runner is stopping: take the child with it
            proc.kill()
            proc.wait()


def lower_autogroup(nice: int) -> bool:
    """Set the nice value of this process's autogroup (its session's task group; the children share it) to ``nice``;
    False where the kernel has no autogroups. Under sched_autogroup a nice value orders a process only against
    others of its own group, and the machine's groups share the CPU equally (sched(7), "The autogroup feature" and
    "The nice value and group scheduling"), so the children's nice alone does not yield to other sessions' jobs."""
    try:
        Path("/proc/self/autogroup").write_text(f"{nice}\n")
    except OSError:
        return False
    return True


def _why_kill(peak_gb: float, cap_gb: float, deadline: float) -> str:
    """Why a child at this peak must be killed now ("" when it may go on); SIGKILL ends a stopped child too."""
    if peak_gb > cap_gb:
        return f"stopped at {cap_gb:g} GB"
    if _meminfo_gb("MemAvailable") < KILL_AVAILABLE_GB:
        return f"MemAvailable under {KILL_AVAILABLE_GB:g} GB"
    if time.time() > deadline:
        return "the runner's --until"
    return ""


def cap_for(est_gb: float, load: float, available_gb: float) -> float | None:
    """The memory cap (GB) a row estimated at ``est_gb`` starts under on a machine at this load average and
    MemAvailable, or None: not now (an 8-14 GB row on a busy machine; any row whose estimate, or
    :data:`START_HEADROOM_GB`, would take MemAvailable under the kill line) or never (estimated over 14 GB)."""
    if est_gb > BIG_CAP_GB:
        return None
    if available_gb < KILL_AVAILABLE_GB + max(est_gb, START_HEADROOM_GB):
        return None
    if est_gb <= CAP_GB:
        return CAP_GB
    if load < BIG_MAX_LOAD and available_gb > BIG_MIN_AVAILABLE_GB:  # (an 8-14 GB row: over 14 returned above)
        return BIG_CAP_GB
    return None


def _next_runnable(todo: list[dict]) -> tuple[dict, float] | None:
    """The first row of ``todo`` that may start now, with the cap it starts under (:func:`cap_for` on the machine's
    load average and MemAvailable now), or None."""
    load, available = os.getloadavg()[0], _meminfo_gb("MemAvailable")
    for entry in todo:
        cap = cap_for(entry["est_gb"], load, available)
        if cap is not None:
            return entry, cap
    return None


def _group(entry: dict) -> tuple[str, str, bool]:
    """A plan entry's kernel (its case id's first field), tier, and whether it needs the 14 GB cap (such rows wait
    for an idle machine, so they form their own group rather than hold back their kernel's smaller rows)."""
    return entry["case_id"].split("|", 1)[0], entry["tier"], entry["est_gb"] > CAP_GB


def coverage_order(plan: list[dict]) -> list[dict]:
    """``plan`` round-robin over its (kernel, tier, 14 GB cap) groups (:func:`_group`), each group cheapest first;
    in each round the groups go in the order of their cheapest remaining row. So a kernel with few rows left gets run
    time while another has hours of cheaper rows."""
    groups: dict[tuple[str, str, bool], list[dict]] = {}
    for e in sorted(plan, key=lambda e: e["est_cpu_s"]):
        groups.setdefault(_group(e), []).append(e)
    queues = list(groups.values())  # already in the order of their cheapest row
    out = []
    for i in range(max(map(len, queues), default=0)):
        out += sorted((q[i] for q in queues if i < len(q)), key=lambda e: e["est_cpu_s"])
    return out


ORDERS = {"cheapest": lambda plan: sorted(plan, key=lambda e: e["est_cpu_s"]), "coverage": coverage_order}


def after_stops(plan: list[dict], stopped: list[dict]) -> list[dict]:
    """``plan`` less the rows killed at the 14 GB cap; a row killed at the 8 GB cap stays, estimated at no less than
    the peak it was killed at, so that it is retried under the 14 GB cap on an idle machine (:func:`cap_for`)."""
    peaks: dict[str, float] = {}
    for r in stopped:
        if r["why"].startswith("stopped at"):
            peaks[r["case_id"]] = max(peaks.get(r["case_id"], 0.0), float(r["peak_gb"]))
    return [{**e, "est_gb": max(e["est_gb"], peaks[e["case_id"]])} if e["case_id"] in peaks else e
            for e in plan if peaks.get(e["case_id"], 0.0) <= BIG_CAP_GB]


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard K/N`` as ``(K, N)``: this runner takes the rows :func:`in_shard` gives shard K of N."""
    try:
        k, n = map(int, text.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise SystemExit(f"conformance_runner: --shard must be K/N with 0 <= K < N (e.g. 0/2), got {text!r}")
    return k, n


def in_shard(case_id: str, shard: tuple[int, int]) -> bool:
    """Whether ``case_id`` belongs to shard ``(K, N)``: its CRC-32 modulo N is K (stable across processes and
    sessions, unlike ``hash``), so N runners with their own ``--scratch`` split the rows without overlap."""
    k, n = shard
    return zlib.crc32(case_id.encode()) % n == k


def _todo(scratch: Path, snap: Path, env: dict[str, str], order: str, shard: tuple[int, int] = (0, 1)) -> list[dict]:
    """The rows to run, in ``order`` (:data:`ORDERS`): this shard's (:func:`in_shard`), unrecorded in the tracked CSV,
    not in the scratch rows, not stopped at the 14 GB cap (:func:`after_stops`), estimated within
    :data:`BIG_CAP_GB`."""
    out = subprocess.run([PYTHON, __file__, "_plan", str(REPO / "benchmarks/data/conformance.csv")], env=env,
                         cwd=snap, check=True, capture_output=True, text=True).stdout
    done = {r["case_id"] for r in _read(scratch / "rows.csv")}
    plan = after_stops([e for e in json.loads(out) if e["case_id"] not in done and in_shard(e["case_id"], shard)],
                       _read(scratch / "stopped.csv"))
    todo = ORDERS[order]([e for e in plan if e["est_gb"] <= BIG_CAP_GB])
    part = f", shard {shard[0]}/{shard[1]}" if shard[1] > 1 else ""
    _log(scratch, f"snapshot {_git('rev-parse', '--short', 'HEAD', cwd=snap)}: {len(todo)} rows to run, {order} "
                  f"order{part} ({len(plan) - len(todo)} more estimated over {BIG_CAP_GB:g} GB, not run)")
    return todo


def until_deadline(until: str, now: datetime) -> float:
    """``--until HH:MM`` (UTC) as a timestamp: the next such time after ``now``, so an evening run told to stop
    at 00:08 stops after midnight (it used to read today's 00:08, already past, and run nothing)."""
    try:
        h, m = map(int, until.split(":"))
        at = now.replace(hour=h, minute=m, second=0, microsecond=0)
    except ValueError:
        raise SystemExit(f"conformance_runner: --until must be UTC HH:MM (00:00 to 23:59), got {until!r}") from None
    if at <= now:
        at += timedelta(days=1)
    return at.timestamp()


def run(args: argparse.Namespace) -> int:
    scratch, snap = Path(args.scratch), Path(args.snapshot)
    scratch.mkdir(parents=True, exist_ok=True)
    if not args.nkilib:
        raise SystemExit("conformance_runner: set NKILIB_SRC (or --nkilib) to the nki-library checkout")
    shard = parse_shard(args.shard)
    commit = snapshot(snap, args.commit)
    env = _child_env(snap, args.nkilib)
    deadline = until_deadline(args.until, datetime.now(timezone.utc))
    move = []  # SIGHUP: move the snapshot to --commit's current tip before the next row
    signal.signal(signal.SIGHUP, lambda *_: move.append(True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # watch() then kills the running child
    if lower_autogroup(AUTOGROUP_NICE):
        _log(scratch, f"autogroup nice {AUTOGROUP_NICE}")
    todo = _todo(scratch, snap, env, args.order, shard)
    while todo and time.time() < deadline:
        if move:
            move.clear()
            commit = snapshot(snap, args.commit)
            todo = _todo(scratch, snap, env, args.order, shard)
        runnable = _next_runnable(todo)
        if runnable is None:  # the machine is short of memory, or only 14 GB rows are left and it is busy
            time.sleep(60)
            continue
        entry, cap = runnable
        todo.remove(entry)
        _log(scratch, f"start {entry['case_id']} (est {entry['est_cpu_s']} s, {entry['est_gb']} GB; cap {cap:g} GB)")
        result = scratch / "row.json"
        result.unlink(missing_ok=True)
        o = watch([PYTHON, __file__, "_row", entry["case_id"], entry["tier"], str(result)], env, snap,
                  scratch / "child.log", cap, deadline)
        common = {"tier": entry["tier"], "snapshot": commit[:7], "peak_gb": f"{o.peak_gb:.2f}",
                  "cpu_s": f"{o.cpu_s:.0f}", "est_cpu_s": entry["est_cpu_s"], "est_gb": entry["est_gb"],
                  "cap_gb": cap, "finished": _now()}
        if o.rc == 0 and result.exists():
            got = json.loads(result.read_text())
            _append(scratch / "rows.csv", ("case_id", *CSV_FIELDS, *EXTRA_FIELDS),
                    {"case_id": entry["case_id"], **got["row"], **common, "row_ok": got["row_ok"]})
            _log(scratch, f"done {got['row']['result']} ok={got['row_ok']} cpu {o.cpu_s:.0f} s peak {o.peak_gb:.2f} GB")
        else:
            why = o.why or f"exit {o.rc}: " + (scratch / "child.log").read_text()[-300:].replace("\n", " | ")
            _append(scratch / "stopped.csv", STOP_FIELDS, {"case_id": entry["case_id"], "why": why, **common})
            _log(scratch, f"not recorded: {why} (cpu {o.cpu_s:.0f} s, peak {o.peak_gb:.2f} GB)")
    return 0


# -- merge (imports trnkit: this tree's) -----------------------------------------------------------------------------
CSV_FIELDS = ("kernel", "case", "shapes", "lnc", "result", "max_abs_err", "allowed_err", "rtol", "atol", "seconds",
              "message", "nkilib_commit")  # harness.CSV_FIELDS (checked in merge)


def _row_key(d: dict) -> tuple[str, str, str, str]:
    """A CSV row's case key, as :func:`_case_key` gives a case's."""
    return d["kernel"], d["case"], str(d["lnc"]), d["shapes"]


def merge_rows(existing: list[dict], new: list[dict], order: list[tuple[str, str, str, str]]) -> list[dict]:
    """``existing`` with ``new`` added, in the order of ``order`` (the case list's keys). Refuses a key twice among
    ``new`` with different rows, a new row whose case already has another row, and a row of no listed case."""
    rows = {_row_key(d): d for d in existing}
    if len(rows) != len(existing):
        raise ValueError("conformance_runner merge: the CSV holds a case twice")
    for d in new:
        d = {f: d[f] for f in CSV_FIELDS}
        old = rows.get(_row_key(d))
        if old is not None and old != d:
            raise ValueError(f"conformance_runner merge: {_row_key(d)} already has a row with another result "
                             f"({old['result']}: {old['message'][:80]!r} vs {d['result']}: {d['message'][:80]!r})")
        rows[_row_key(d)] = d
    place = {k: i for i, k in enumerate(order)}
    missing = [k for k in rows if k not in place]
    if missing:
        raise ValueError(f"conformance_runner merge: {len(missing)} rows of no listed case, e.g. {missing[0]}")
    return sorted(rows.values(), key=lambda d: place[_row_key(d)])


RESTATED_FIELDS = ("message", "seconds")  # what a re-run of a recorded case may change (its verdict stays)


def restate_rows(existing: list[dict], restated: list[dict]) -> list[dict]:
    """``existing`` with each row of ``restated`` (recorded cases run again under a newer check of the same
    verdict) in place of its case's row. Refuses a restated row of no recorded case, and one that changes more
    than :data:`RESTATED_FIELDS` (a changed result, max|err|, allowed error or tolerance is a new result, not a
    restatement)."""
    rows = {_row_key(d): d for d in existing}
    for d in restated:
        d = {f: d[f] for f in CSV_FIELDS}
        old = rows.get(_row_key(d))
        if old is None:
            raise ValueError(f"conformance_runner merge: restated row {_row_key(d)} has no recorded row")
        changed = [f for f in CSV_FIELDS if f not in RESTATED_FIELDS and old[f] != d[f]]
        if changed:
            raise ValueError(f"conformance_runner merge: restated row {_row_key(d)} changes {', '.join(changed)} "
                             f"({', '.join(f'{old[f]!r} -> {d[f]!r}' for f in changed)}), not only its message")
        rows[_row_key(d)] = d
    return list(rows.values())


def merge(args: argparse.Namespace) -> int:
    """Merge the scratch rows the run accepts (:func:`harness.row_ok`); the others are findings, listed and left
    out (their case needs a fix, or a ``Case.rejected_by`` with a cited rule, before its row is recorded). The
    scratch's ``restated.csv`` (rows.csv's columns), if any, restates recorded rows (:func:`restate_rows`)."""
    from trnkit.conformance import cases, harness

    assert tuple(harness.CSV_FIELDS) == CSV_FIELDS, harness.CSV_FIELDS
    target = REPO / "benchmarks/data/conformance.csv"
    existing = _read(target)
    scratch = _read(Path(args.scratch) / "rows.csv")
    new = [r for r in scratch if r["row_ok"] == "True"]
    restated = _read(Path(args.scratch) / "restated.csv")
    order = [_case_key(c) for c in cases.all_cases(harness.nkilib_root(None))]
    rows = merge_rows(restate_rows(existing, restated), new, order)
    with open(target, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(f"{target}: {len(existing)} -> {len(rows)} rows ({len(new)} of {len(scratch)} scratch rows accepted, "
          f"{len(restated)} recorded rows restated)")
    for r in scratch:
        if r["row_ok"] != "True":
            print(f"left out (a finding): {r['case_id']}: {r['result']}: {r['message'][:200]}")
    subprocess.run([PYTHON, str(REPO / "scripts/docs_tables.py")], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run unrecorded rows from a snapshot worktree")
    r.add_argument("--snapshot", default=str(REPO.parent / f"{REPO.name}-snap"), help="worktree path")
    r.add_argument("--commit", default="main", help="the snapshot's commit (moved there if it exists)")
    r.add_argument("--until", default="23:59", help="UTC HH:MM, the next such time (past midnight: tomorrow): "
                   "the running row is killed and no row starts after")
    r.add_argument("--scratch", default=str(SCRATCH))
    r.add_argument("--order", choices=sorted(ORDERS), default="cheapest",
                   help="cheapest: cheapest first; coverage: round-robin over (kernel, tier), cheapest first in each")
    r.add_argument("--nkilib", default=os.environ.get("NKILIB_SRC", ""), help="nki-library checkout ($NKILIB_SRC)")
    r.add_argument("--shard", default="0/1", help="K/N: this runner's share of the rows (N runners, each its own "
                   "--scratch, split them without overlap; default 0/1: all)")
    g = sub.add_parser("merge", help="merge the scratch rows into benchmarks/data/conformance.csv")
    g.add_argument("--scratch", default=str(SCRATCH))
    sub.add_parser("_plan").add_argument("csv")
    c = sub.add_parser("_row")
    c.add_argument("case_id")
    c.add_argument("tier")
    c.add_argument("out")
    args = p.parse_args(argv)
    if args.cmd == "_plan":
        return child_plan(args.csv) or 0
    if args.cmd == "_row":
        return child_row(args.case_id, args.tier, args.out) or 0
    return {"run": run, "merge": merge}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
