"""scripts/conformance_runner.py: the memory watch kills a child past its cap, the caps follow the machine's
state, reduced shapes read as their reduced values, and the merge keeps one row per case in the case list's order."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trnkit.bench.paths import load_script

ROOT = Path(__file__).resolve().parent.parent
runner = load_script(ROOT / "scripts" / "conformance_runner.py", "conformance_runner")


def _row(kernel: str, case: str, result: str = "PASS", message: str = "") -> dict[str, str]:
    return {"kernel": kernel, "case": case, "shapes": "B=1", "lnc": "2", "result": result, "max_abs_err": "0",
            "allowed_err": "0.1", "rtol": "0.01", "atol": "0.01", "seconds": "1.00", "message": message,
            "nkilib_commit": "d2ad3a5"}


ORDER = [("k", c, "2", "B=1") for c in ("a", "b", "c", "d")]


def test_merge_places_new_rows_in_case_order():
    merged = runner.merge_rows([_row("k", "a"), _row("k", "d")], [_row("k", "c"), _row("k", "b")], ORDER)
    assert [r["case"] for r in merged] == ["a", "b", "c", "d"]


def test_merge_drops_scratch_columns_and_accepts_an_identical_row_again():
    again = {**_row("k", "a"), "case_id": "k|a|lnc2|B=1", "peak_gb": "0.2"}
    merged = runner.merge_rows([_row("k", "a")], [again], ORDER)
    assert merged == [_row("k", "a")]


def test_merge_refuses_a_second_result_for_a_case():
    with pytest.raises(ValueError, match=r"already has a row with another result \(PASS.*vs ERROR"):
        runner.merge_rows([_row("k", "a")], [_row("k", "a", "ERROR", "boom")], ORDER)
    with pytest.raises(ValueError, match="another result"):  # twice among the scratch rows, differently
        runner.merge_rows([], [_row("k", "b"), _row("k", "b", "MISMATCH")], ORDER)


def test_merge_refuses_rows_of_no_listed_case_and_duplicates_in_the_file():
    with pytest.raises(ValueError, match="1 rows of no listed case, e.g. \\('k', 'z'"):
        runner.merge_rows([], [_row("k", "z")], ORDER)
    with pytest.raises(ValueError, match="holds a case twice"):
        runner.merge_rows([_row("k", "a"), _row("k", "a")], [], ORDER)


def test_restated_rows_replace_the_message_and_seconds_of_their_recorded_row():
    restated = {**_row("k", "b", "GOLDEN_GAP", "attention: within"), "seconds": "7.5", "case_id": "k|b|lnc2|B=1"}
    rows = runner.restate_rows([_row("k", "a"), _row("k", "b", "GOLDEN_GAP", "old text")], [restated])
    assert [(r["case"], r["message"], r["seconds"]) for r in rows] == [
        ("a", "", "1.00"), ("b", "attention: within", "7.5")]
    assert "case_id" not in rows[1]


def test_a_restated_row_that_changes_its_verdict_or_has_no_recorded_row_is_refused():
    with pytest.raises(ValueError, match=r"changes result, max_abs_err \('GOLDEN_GAP' -> 'MISMATCH', '0' -> '3'\)"):
        runner.restate_rows([_row("k", "a", "GOLDEN_GAP")], [{**_row("k", "a", "MISMATCH"), "max_abs_err": "3"}])
    with pytest.raises(ValueError, match=r"restated row \('k', 'b', '2', 'B=1'\) has no recorded row"):
        runner.restate_rows([_row("k", "a")], [_row("k", "b")])


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no sched_autogroup")
def test_lower_autogroup_sets_the_sessions_autogroup_nice():
    code = ("from pathlib import Path; from trnkit.bench.paths import load_script; "
            f"r = load_script(Path({str(ROOT / 'scripts' / 'conformance_runner.py')!r}), 'conformance_runner'); "
            "print(r.lower_autogroup(7), Path('/proc/self/autogroup').read_text().split()[-1])")
    own = Path("/proc/self/autogroup").read_text()
    # a new session: its own autogroup, so the test's own group keeps its nice
    out = subprocess.run([sys.executable, "-c", code], start_new_session=True, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    assert out == ["True", "7"]
    assert Path("/proc/self/autogroup").read_text() == own


def test_reduced_shapes_read_as_reduced_values():
    assert runner._reduced_values("B=512->256 q_heads=8/rank S_ctx=131072->49152/131072->49152 S=1") == \
        "B=256 q_heads=8/rank S_ctx=49152/49152 S=1"


@pytest.mark.parametrize("est, load, avail, cap", [
    (0.3, 12.0, 6.1, 8.0),  # within 8 GB: at any load, at 8 ...
    (8.0, 12.0, 13.1, 8.0),
    (0.3, 0.0, 5.9, None),  # ... but only with MemAvailable 1 GB over the 5 GB kill line
    (7.0, 0.0, 11.9, None),  # ... or the row's estimate over it
    (9.5, 5.9, 16.1, 14.0),  # 8-14 GB on an idle machine: at 14
    (9.5, 6.0, 20.0, None),  # ... not while the load average is 6 or more
    (9.5, 1.0, 16.0, None),  # ... nor with 16 GB available or less
    (14.1, 0.0, 24.0, None),  # over 14 GB: never
])
def test_cap_follows_the_estimate_and_the_machine(est, load, avail, cap):
    assert runner.cap_for(est, load, avail) == cap


def test_watch_kills_a_child_past_its_memory_cap(tmp_path):
    hog = "import numpy as np, time; a = np.ones(75_000_000); time.sleep(60)"  # 0.6 GB of anonymous memory
    t0 = time.time()
    o = runner.watch([sys.executable, "-c", hog], {}, tmp_path, tmp_path / "log", cap_gb=0.3,
                     deadline=time.time() + 120)
    assert o.rc is None and o.why == "stopped at 0.3 GB"
    assert 0.3 < o.peak_gb < 0.7 and time.time() - t0 < 30


def test_watch_reports_exit_status_cpu_and_peak(tmp_path):
    work = "import numpy as np; a = np.ones(25_000_000); s = sum(range(3_000_000)); raise SystemExit(3)"
    o = runner.watch([sys.executable, "-c", work], {}, tmp_path, tmp_path / "log", cap_gb=8.0,
                     deadline=time.time() + 120)
    assert o.rc == 3 and o.why == ""
    assert o.cpu_s > 0.05
    assert o.peak_gb < 0.25  # the 0.2 GB array, seen only if a poll fell while it lived


def test_watch_kills_a_child_at_the_deadline(tmp_path):
    o = runner.watch([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path, tmp_path / "log",
                     cap_gb=8.0, deadline=time.time() + 1)
    assert o.rc is None and o.why == "the runner's --until"


def test_next_runnable_takes_the_first_row_that_may_start_and_its_cap(monkeypatch):
    todo = [{"case_id": "big", "est_gb": 9.5}, {"case_id": "small", "est_gb": 2.0}, {"case_id": "huge", "est_gb": 20.0}]
    monkeypatch.setattr(runner, "_meminfo_gb", lambda field: 20.0)
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    assert runner._next_runnable(todo) == (todo[0], 14.0)  # idle: the 8-14 GB row first, at 14 GB
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    assert runner._next_runnable(todo) == (todo[1], 8.0)  # busy: it waits, the next row starts at 8 GB
    assert runner._next_runnable([todo[0], todo[2]]) is None


def _entry(kernel: str, tier: str, est: float) -> dict:
    return {"case_id": f"{kernel}|case {est}|lnc2|B=1", "tier": tier, "est_cpu_s": est, "est_gb": 0.0}


def test_coverage_order_takes_one_row_of_each_kernel_and_tier_in_turn_cheapest_first():
    attn = [_entry("attn", "model_config", s) for s in (30.0, 10.0, 20.0, 40.0)]
    attn_reduced = [_entry("attn", "reduced", s) for s in (90.0, 60.0)]
    moe = [_entry("moe", "model_config", 50.0)]
    order = runner.coverage_order(attn + moe + attn_reduced)
    assert [(e["case_id"].split("|")[0], e["tier"], e["est_cpu_s"]) for e in order] == [
        ("attn", "model_config", 10.0), ("moe", "model_config", 50.0), ("attn", "reduced", 60.0),  # round 1
        ("attn", "model_config", 20.0), ("attn", "reduced", 90.0),  # round 2: moe has no row left
        ("attn", "model_config", 30.0), ("attn", "model_config", 40.0)]
    assert sorted(map(id, order)) == sorted(map(id, attn + moe + attn_reduced))  # every row once
    assert runner.coverage_order([]) == []
    big, small = {**_entry("red", "reduced", 5.0), "est_gb": 9.0}, _entry("red", "reduced", 80.0)
    later = [_entry("red", "reduced", s) | {"est_gb": 9.0} for s in (6.0, 7.0)]
    # rows needing the 14 GB cap are a group of their own: a busy machine skips them, not the kernel's small rows
    assert runner.coverage_order([big, small, *later, *moe]) == [big, moe[0], small, *later]
    assert [e["est_cpu_s"] for e in runner.ORDERS["cheapest"](attn + moe)] == [10.0, 20.0, 30.0, 40.0, 50.0]


def test_a_row_stopped_at_8_gb_is_retried_as_a_14_gb_row_and_one_stopped_at_14_gb_is_not():
    plan = [_entry("attn", "reduced", s) | {"est_gb": 7.2} for s in (1.0, 2.0, 3.0)]
    stopped = [{"case_id": plan[0]["case_id"], "why": "stopped at 8 GB", "peak_gb": "8.03"},
               {"case_id": plan[1]["case_id"], "why": "stopped at 8 GB", "peak_gb": "8.01"},
               {"case_id": plan[1]["case_id"], "why": "stopped at 14 GB", "peak_gb": "14.02"},
               {"case_id": plan[2]["case_id"], "why": "MemAvailable under 5 GB", "peak_gb": "9.5"}]
    after = runner.after_stops(plan, stopped)
    assert [(e["est_cpu_s"], e["est_gb"]) for e in after] == [(1.0, 8.03), (3.0, 7.2)]
    assert runner.cap_for(after[0]["est_gb"], load=1.0, available_gb=20.0) == 14.0
    assert plan[0]["est_gb"] == 7.2  # the plan itself is not changed


def test_until_is_the_next_such_utc_time_and_a_bad_value_is_refused():
    from datetime import datetime, timedelta, timezone

    evening = datetime(2026, 12, 6, 23, 36, 16, tzinfo=timezone.utc)
    # past midnight: tomorrow's 00:08, not today's (which had passed, so the runner ran nothing)
    assert runner.until_deadline("00:08", evening) == (evening.replace(hour=0, minute=8, second=0)
                                                       + timedelta(days=1)).timestamp()
    assert runner.until_deadline("23:50", evening) == evening.replace(minute=50, second=0).timestamp()
    for bad in ("25:00", "9.30", "noon"):
        with pytest.raises(SystemExit, match=f"--until must be UTC HH:MM .*got '{bad}'"):
            runner.until_deadline(bad, evening)


def test_shards_split_the_rows_without_overlap_and_a_bad_shard_is_refused():
    ids = [f"core/k{i}|case {i}|lnc2|B={i}" for i in range(200)]
    parts = [[c for c in ids if runner.in_shard(c, (k, 3))] for k in range(3)]
    assert sorted(sum(parts, [])) == sorted(ids)  # every row in exactly one shard
    assert all(40 < len(p) < 95 for p in parts)  # and spread over them
    assert all(runner.in_shard(c, (0, 1)) for c in ids)  # the default takes every row
    assert runner.parse_shard("1/2") == (1, 2)
    for bad in ("2/2", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(SystemExit, match=rf"--shard must be K/N with 0 <= K < N .*got {bad!r}"):
            runner.parse_shard(bad)
