"""Nothing a run has written is lost: one run per folder, no non-finite checkpoint or export, disk-full
exports and metrics end in the save's message, a torn metrics.jsonl is repaired, an LR schedule is
never changed silently on resume."""

from __future__ import annotations

import collections
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trnkit.harness import checkpoint as ckpt_mod
from trnkit.harness.checkpoint import list_checkpoints, verify_checkpoint
from trnkit.harness.config import ConfigError
from trnkit.harness.metrics import read_jsonl
from trnkit.harness.rundir import LOCK_NAME, RunLock
from trnkit.harness.train import lr_lambda, run
from trnkit.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from .helpers import REPO, assert_user_error, ckpt_config, main_result, tiny_config, write_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: str, corpus_dir: Path):
    """A finished 3-step run with a checkpoint at every step (kept), and its losses."""
    d = tmp_path_factory.mktemp("trained") / "run"
    res = run(ckpt_config(d, tiny_tokenizer, corpus_dir))
    return d, res.losses


def _copy(trained, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained[0], tmp_path / "run"))


def _snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ------------------------------------------------------------------ one run per dump folder
def _hold_lock(dump: Path) -> subprocess.Popen:
    """Another process holding the run lock on `dump` (as a running trainer does) until killed."""
    code = ("import sys, time; from trnkit.harness.rundir import RunLock; RunLock(sys.argv[1], print).acquire(); "
            "print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(dump)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_on_a_locked_folder_is_refused_and_a_dead_holder_is_taken_over(
        tmp_path: Path, trained, tiny_tokenizer: str, corpus_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy(trained, tmp_path)
    holder = _hold_lock(run_dir)
    try:
        before = _snapshot(run_dir)
        cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3)
        code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
        assert_user_error(code, err, f"job.dump_folder: {run_dir} is in use by another run (pid {holder.pid} on "
                                     f"host {socket.gethostname()}, started 20", f"lock {run_dir / LOCK_NAME}",
                          "use another --job.dump_folder")
        assert _snapshot(run_dir) == before and "resumed" not in out  # refused before reading or writing
    finally:
        holder.kill()
        holder.wait()
    # killed: the kernel dropped its flock, the lock file with its pid stays behind
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == holder.pid
    res = run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3))
    out = capsys.readouterr().out
    assert f"WARNING: taking over the lock of a run that ended without releasing it (pid {holder.pid}" in out
    assert res.start_step == 3 and not (run_dir / LOCK_NAME).exists()  # released at the end


def test_a_run_holds_the_lock_for_its_whole_life(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real_save = ckpt_mod.Checkpointer.save

    def save(self, step):  # while the run saves, a second run's lock on the folder is refused
        with pytest.raises(ConfigError, match=f"is in use by another run \\(pid {os.getpid()} on host"):
            RunLock(str(tmp_path / "run"), print).acquire()  # its own open file: flock refuses it
        seen.append(step)
        return real_save(self, step)

    monkeypatch.setattr(ckpt_mod.Checkpointer, "save", save)
    run(ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=2))
    assert seen == [1, 2] and [r["step"] for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))] == [1, 2]


@pytest.mark.parametrize("make", ["link", "folder"])
def test_a_lock_file_that_is_a_link_or_a_folder_is_refused(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                           capsys: pytest.CaptureFixture[str], make: str) -> None:
    """The lock was opened through a symbolic link: the run wrote its pid, host and start over the file it named
    (outside the run folder). A folder there ended in IsADirectoryError's traceback."""
    dump, target = tmp_path / "run", tmp_path / "precious.txt"
    dump.mkdir()
    target.write_text("precious\n")
    lock = dump / LOCK_NAME
    if make == "link":
        lock.symlink_to(target)
    else:
        lock.mkdir()
    cfg = tiny_config(dump, tiny_tokenizer, corpus_dir, training={"steps": 1})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    what = f"a symbolic link (to {target})" if make == "link" else "a folder"
    assert_user_error(code, err, f"job.dump_folder: {lock} is {what}; the run keeps its lock file there")
    assert target.read_text() == "precious\n" and os.listdir(dump) == [LOCK_NAME]


def test_dump_folder_that_is_a_file(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").write_text("not a folder")
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"job.dump_folder: {tmp_path / 'run'} is a file, not a folder")
    assert (tmp_path / "run").read_text() == "not a folder"


def test_unwritable_dump_folder(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from trnkit.harness import rundir

    def makedirs(path, *args, **kwargs):  # a read-only parent (the tests may run as root, who could write)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(rundir.os, "makedirs", makedirs)
    cfg = tiny_config(tmp_path / "ro" / "run", tiny_tokenizer, corpus_dir)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"job.dump_folder: cannot write to {tmp_path / 'ro' / 'run'} (PermissionError: "
                                 "Permission denied); point job.dump_folder at a writable folder")


def test_two_runs_creating_the_dump_folder_at_once_meet_at_the_lock(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs started together on a dump folder that did not exist: the one whose os.makedirs came second was
    refused with 'cannot write to <dump> (FileExistsError: File exists); point job.dump_folder at a writable folder'
    (seen failing before the fix), though the folder was fine. Now it goes on to the lock, which decides."""
    from trnkit.harness import rundir

    dump = tmp_path / "run"
    real_makedirs = os.makedirs

    def made_by_the_other_run_first(path, *args, **kwargs):
        if os.fspath(path) == str(dump):
            real_makedirs(path)  # the other run, between this run's isdir check and its makedirs
        return real_makedirs(path, *args, **kwargs)

    monkeypatch.setattr(rundir.os, "makedirs", made_by_the_other_run_first)
    lock = RunLock(str(dump), print)
    lock.acquire()
    assert (dump / LOCK_NAME).is_file()
    lock.release()
    assert dump.is_dir()  # made by the other run: not removed


def test_the_write_check_never_writes_through_a_link(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    """The start's write check wrote 'ok' into <dump>/.write-test-<pid> with open('w'): a symbolic link of that name
    (a pid is easy to guess) made it empty a file outside the run folder and write 'ok' there (seen failing before the
    fix). Now the link is removed and a new file made."""
    dump = tmp_path / "run"
    dump.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    (dump / f".write-test-{os.getpid()}").symlink_to(outside)
    run(tiny_config(dump, tiny_tokenizer, corpus_dir, training={"steps": 1}))
    assert outside.read_text() == "not the run's\n"
    assert not os.path.lexists(dump / f".write-test-{os.getpid()}")


def test_refused_run_leaves_no_dump_folder(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, training={"seq_len": 1000})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, "training.seq_len: 1000 exceeds the model's max_seq_len 64")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the files a run writes in its folder
def test_a_fresh_run_moves_a_config_toml_it_did_not_write_aside(tmp_path: Path, tiny_tokenizer: str,
                                                                corpus_dir: Path) -> None:
    """A folder holding a config.toml and a stack.lock but no metrics.jsonl or checkpoint (the user's own files
    beside the run's outputs, or a run's that stopped before its first step) was no earlier run to a fresh start,
    which overwrote both."""
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "config.toml").write_text("# my experiment\n")
    (dump / "stack.lock").write_text("# my lock\n")
    run(tiny_config(dump, tiny_tokenizer, corpus_dir, training={"steps": 1}))
    (archive,) = dump.glob("previous-*")
    assert (archive / "config.toml").read_text() == "# my experiment\n"
    assert (archive / "stack.lock").read_text() == "# my lock\n"
    assert "[training]" in (dump / "config.toml").read_text()


def test_a_fresh_start_with_another_checkpoint_folder_moves_the_earlier_runs_checkpoints_too(
        tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    """A run resumed without its --checkpoint.folder override found nothing to resume and started fresh, moving
    the earlier run's metrics.jsonl and config.toml to previous-<time>/ but leaving its checkpoints beside the new
    run (seen failing before the fix); a later run with that checkpoint.folder then resumed them, keeping the new
    run's metrics.jsonl records as theirs. Now the earlier run's checkpoint folder (named by its config.toml) is
    moved with its other files."""
    dump = tmp_path / "run"
    run(ckpt_config(dump, tiny_tokenizer, corpus_dir, steps=2, checkpoint={"folder": "ckA"}))
    earlier = {p.name: p.read_bytes() for p in (dump / "ckA" / "step-2").iterdir()}
    res = run(ckpt_config(dump, tiny_tokenizer, corpus_dir, steps=2))
    assert res.start_step == 0
    (archive,) = dump.glob("previous-*")
    assert not (dump / "ckA").exists()
    assert {p.name: p.read_bytes() for p in (archive / "ckA" / "step-2").iterdir()} == earlier
    assert (archive / "metrics.jsonl").is_file() and (archive / "config.toml").is_file()
    assert [s for s, _ in list_checkpoints(str(dump / "checkpoint"))] == [1, 2]


def _another_filesystem(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp_path")
    other = shm / f"trnkit-test-{os.getpid()}-{tmp_path.name}"
    other.mkdir()
    return other


def test_a_fresh_start_over_checkpoints_on_another_filesystem_moves_nothing(tmp_path: Path, tiny_tokenizer: str,
                                                                            corpus_dir: Path,
                                                                            capsys: pytest.CaptureFixture[str]):
    """checkpoint.folder 'disk/ckpt' with 'disk' a link to a bigger disk: a fresh start (--checkpoint.resume false)
    moved metrics.jsonl and config.toml into previous-<time>/, then os.replace of the checkpoints raised EXDEV
    (a traceback), leaving the run split. Now refused before anything is moved."""
    other = _another_filesystem(tmp_path)
    try:
        dump = tmp_path / "run"
        dump.mkdir()
        (dump / "disk").symlink_to(other)
        cfg = ckpt_config(dump, tiny_tokenizer, corpus_dir, steps=2, checkpoint={"folder": "disk/ckpt"})
        run(cfg)
        before = _snapshot(dump)
        toml = write_config(cfg, tmp_path / "c.toml")
        code, _, err = main_result(["--config", str(toml), "--checkpoint.resume", "false"], capsys)
        assert_user_error(code, err, f"checkpoint.folder: {dump / 'disk' / 'ckpt'} is on another filesystem than "
                                     f"job.dump_folder {dump} (through a symbolic link)", "Nothing was moved")
        assert _snapshot(dump) == before and not list(dump.glob("previous-*"))
    finally:
        shutil.rmtree(other)


@pytest.mark.parametrize("name, make", [("stack.lock", "link"), ("metrics.jsonl", "link"), ("config.toml", "folder"),
                                        ("config_history", "file")])
def test_a_run_file_that_is_a_link_or_of_another_kind_is_refused(tmp_path: Path, trained, tiny_tokenizer: str,
                                                                 corpus_dir: Path, capsys: pytest.CaptureFixture[str],
                                                                 name: str, make: str) -> None:
    """A resume wrote stack.lock and appended to metrics.jsonl through a symbolic link, changing a file outside its
    folder; a folder where it writes a file (or a file where it keeps config_history) ended in a traceback after the
    checkpoint was loaded. Now one message before anything is written."""
    run_dir = _copy(trained, tmp_path)
    target = run_dir / name
    outside = tmp_path / "outside"
    outside.write_bytes(target.read_bytes() if target.is_file() else b"not the run's\n")
    target.unlink(missing_ok=True)
    if make == "link":
        target.symlink_to(outside)
        what = f"a symbolic link (to {outside})"
    elif make == "folder":
        target.mkdir()
        what = "a folder"
    else:
        target.write_text("a file")
        what = "not a folder"
    before, outside_before = _snapshot(run_dir), outside.read_bytes()
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4, checkpoint={"reschedule": True})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    kind = "folder" if name == "config_history" else "file"
    assert_user_error(code, err, f"job.dump_folder: {target} is {what}; the run writes its {name} there, which must "
                                 f"be a {kind} of its own in {run_dir}: move it away and rerun. Nothing was written")
    assert _snapshot(run_dir) == before and outside.read_bytes() == outside_before


@pytest.mark.parametrize("name", ["metrics.jsonl", "stack.lock", "config.toml", "config_history"])
def test_a_read_only_run_file_is_refused_before_anything_is_written(tmp_path: Path, trained, tiny_tokenizer: str,
                                                                   corpus_dir: Path, name: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A resume in a folder whose metrics.jsonl, stack.lock or config.toml is read-only (chmod 444) ended in a
    PermissionError traceback (seen as uid 65534 and failing here before the fix), stack.lock's after config.toml
    had been rewritten. Now one message naming the file and its mode, before anything is written."""
    from trnkit.harness import rundir

    run_dir = _copy(trained, tmp_path)
    target = run_dir / name
    if name == "config_history":
        target.mkdir()
    target.chmod(0o555 if target.is_dir() else 0o444)
    real_access = os.access  # root may write a read-only file: the check is what a user other than root meets

    def access(path, mode, *args, **kwargs):
        return False if os.fspath(path) == str(target) else real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(rundir.os, "access", access)
    before = _snapshot(run_dir)
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4, checkpoint={"reschedule": True})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    mode = "dr-xr-xr-x" if name == "config_history" else "-r--r--r--"
    assert_user_error(code, err, f"job.dump_folder: {target} is not writable (mode {mode}); the run writes its {name} "
                                 "there: make it writable (chmod u+w) or move it away, and rerun. Nothing was written")
    assert _snapshot(run_dir) == before


# ------------------------------------------------------------------ a non-finite update is never saved
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_non_finite_update_is_never_saved_or_exported(tmp_path: Path, trained, tiny_tokenizer: str,
                                                      corpus_dir: Path, async_mode: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # lr 1e39 is a finite float (config accepts it) whose fp32 update overflows the weights to inf; the
    # loss and gradients of that step are finite, so only a check after the update catches it
    run_dir = _copy(trained, tmp_path)
    before = _snapshot(run_dir / "checkpoint")
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4, optimizer={"lr": 1e39},
                      checkpoint={"export_hf": True, "reschedule": True, "async_mode": async_mode})
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert code == 3 and "Traceback" not in err, err
    step3 = run_dir / "checkpoint" / "step-3"
    assert re.search(r"train: step 4: after the update \(lr 5\.\d+e\+38\) \d+ parameter / optimizer-state tensors on "
                     r"rank 0 are not finite \(first: [a-z_.0-9]+weight", err), err
    assert f"step 4 is neither saved nor exported; last good checkpoint: {step3} (step 3)" in err
    assert [s for s, _ in list_checkpoints(str(run_dir / "checkpoint"))] == [1, 2, 3]
    assert _snapshot(run_dir / "checkpoint") == before and not (run_dir / "hf_export").exists()


# ------------------------------------------------------------------ disk full on export and metrics
_usage = collections.namedtuple("usage", "total used free")


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints-on", "checkpoints-off"])
def test_disk_full_during_the_hf_export(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path, checkpoints: bool,
                                        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = Qwen3StateDictAdapter.save_hf

    def save_hf(self, sd, path, dtype):  # writes the files, then the disk fills up
        real(self, sd, path, dtype)
        _disk_full()

    monkeypatch.setattr(Qwen3StateDictAdapter, "save_hf", save_hf)
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda path: _usage(10**6, 10**6 - 1000, 1000))
    cfg = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=2,
                      checkpoint={"export_hf": True, "enable": checkpoints})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    out = tmp_path / "run" / "hf_export"
    kept = (f"the last checkpoint {tmp_path / 'run' / 'checkpoint' / 'step-2'} holds the trained weights (a rerun "
            "resumes from it and writes the export)" if checkpoints else
            "checkpoints are off (checkpoint.enable = false), so the trained weights were not saved anywhere")
    assert_user_error(code, err, f"checkpoint.export_hf: writing the HF export to {out} failed (OSError: [Errno 28] "
                                 "No space left on device). The export needs ~", "KiB; the disk has 1000 B free.",
                      f"The partial export was removed; {kept}; the run stopped.")
    assert not out.exists() and not (tmp_path / "run" / "hf_export.tmp").exists()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))] == [1, 2]
    if checkpoints:  # the rerun (space freed) trains nothing and writes the export
        monkeypatch.setattr(Qwen3StateDictAdapter, "save_hf", real)
        res = run(cfg)
        assert res.start_step == 2 and not res.losses and (out / "model.safetensors").is_file()


def test_ctrl_c_during_the_hf_export_removes_the_partial_export(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while the export wrote its safetensors left the partial hf_export.tmp (as large as the model) in the run
    folder, where a disk-full failure removes it (seen failing before the fix). Now it is removed the same way; the
    message names the last checkpoint, and a rerun writes the export."""
    real = Qwen3StateDictAdapter.save_hf

    def save_hf(self, sd, path, dtype):  # writes the files, then Ctrl-C
        real(self, sd, path, dtype)
        raise KeyboardInterrupt

    monkeypatch.setattr(Qwen3StateDictAdapter, "save_hf", save_hf)
    cfg = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=2, checkpoint={"export_hf": True})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert code == 130
    assert f"kept checkpoint {tmp_path / 'run' / 'checkpoint' / 'step-2'} (step 2); resume with:" in err
    assert not (tmp_path / "run" / "hf_export").exists() and not (tmp_path / "run" / "hf_export.tmp").exists()
    monkeypatch.setattr(Qwen3StateDictAdapter, "save_hf", real)
    assert run(cfg).start_step == 2 and (tmp_path / "run" / "hf_export" / "model.safetensors").is_file()


def test_disk_full_while_appending_metrics(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from trnkit.harness import metrics as metrics_mod

    real = metrics_mod.MetricsLogger._append

    def append(self, rec):
        if rec["step"] == 3:
            self._jsonl.write = _disk_full
        real(self, rec)

    monkeypatch.setattr(metrics_mod.MetricsLogger, "_append", append)
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda path: _usage(10**6, 10**6 - 1000, 1000))
    cfg = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=4)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    path = tmp_path / "run" / "metrics.jsonl"
    assert_user_error(code, err, f"metrics: appending the record of step 3 to {path} failed (OSError: [Errno 28] "
                                 "No space left on device). The disk has 1000 B free.",
                      f"{path} keeps the records up to step 2; the run stopped")
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2]
    assert [s for s, _ in list_checkpoints(str(tmp_path / "run" / "checkpoint"))] == [1, 2]


# ------------------------------------------------------------------ metrics.jsonl cut by a kill
def test_torn_metrics_tail_is_repaired_on_resume(tmp_path: Path, trained, tiny_tokenizer: str, corpus_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy(trained, tmp_path)
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][:25])  # killed while writing step 3's record
    shutil.rmtree(run_dir / "checkpoint" / "step-3")
    res = run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3))
    out = capsys.readouterr().out
    assert f"metrics: the last line of {path} was cut off" in out
    assert res.start_step == 2 and res.losses[3] == trained[1][3]
    recs = read_jsonl(str(path))
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[2]["loss"] == trained[1][3]


def test_the_metrics_rewrite_never_writes_through_a_link(tmp_path: Path, trained, tiny_tokenizer: str,
                                                          corpus_dir: Path) -> None:
    """A resume that drops records rewrites metrics.jsonl through metrics.jsonl.tmp; a symbolic link of that name in
    the run folder made it overwrite the file the link points to, outside the folder, and then renamed the link
    into metrics.jsonl, so every later record went there too (seen failing before the fix). Now the link is removed
    and a new file written."""
    run_dir = _copy(trained, tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    (run_dir / "metrics.jsonl.tmp").symlink_to(outside)
    shutil.rmtree(run_dir / "checkpoint" / "step-3")  # the resume drops step 3's record: the file is rewritten
    res = run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3))
    assert res.start_step == 2
    assert outside.read_text() == "not the run's\n"
    path = run_dir / "metrics.jsonl"
    assert not path.is_symlink() and [r["step"] for r in read_jsonl(str(path))] == [1, 2, 3]
    assert not os.path.lexists(run_dir / "metrics.jsonl.tmp")


def test_an_interruption_while_writing_stack_lock_keeps_the_earlier_one(tmp_path: Path, trained, tiny_tokenizer: str,
                                                                         corpus_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """config.toml and stack.lock were opened with 'w' (emptied) before their text was made: stack.lock's while the
    installed stack was read (~10 ms), so a Ctrl-C, SIGTERM or kill then left an empty stack.lock, the earlier
    part of the run's record lost (seen failing before the fix). Now each is written to <name>.tmp and renamed."""
    from trnkit import envinfo

    run_dir = _copy(trained, tmp_path)
    before = (run_dir / "stack.lock").read_bytes()

    def interrupted() -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(envinfo, "current_stack", interrupted)
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert code == 130 and "interrupted (SIGINT) while the run was starting" in err
    assert (run_dir / "stack.lock").read_bytes() == before and before
    assert "[training]" in (run_dir / "config.toml").read_text()
    assert not list(run_dir.glob("*.tmp"))


def test_bad_metrics_line_in_the_middle_is_named(tmp_path: Path, trained, tiny_tokenizer: str, corpus_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy(trained, tmp_path)
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    before = _snapshot(run_dir)
    # a changed setting: the refused resume had already moved config.toml to config_history and written its own
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3, optimizer={"weight_decay": 0.3})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"metrics: {path}:2 is not a metrics record", "move the file away")
    assert _snapshot(run_dir) == before


def test_bad_metrics_line_stops_every_rank(tmp_path: Path, trained, tiny_tokenizer: str, corpus_dir: Path) -> None:
    """Rank 0 reads metrics.jsonl: its refusal reaches the other ranks, which stop with the same message instead of
    waiting for rank 0 in the first step's collectives (they did, until the launcher's timeout)."""
    from .helpers import run_cli

    run_dir = _copy(trained, tmp_path)
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    shutil.rmtree(run_dir / "checkpoint" / "step-3")  # as if stopped after step 2
    before = _snapshot(run_dir)
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3, training={"local_batch_size": 1},
                      parallelism={"data_parallel_shard_degree": 2})
    proc = run_cli(["--config", str(write_config(cfg, tmp_path / "two.toml"))], nproc=2, timeout=150)
    assert proc.returncode != 0
    message = f"metrics: {path}:2 is not a metrics record"
    assert proc.stderr.count(message) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]  # both ranks
    assert _snapshot(run_dir) == before


def test_resume_appends_to_metrics(tmp_path: Path, trained, tiny_tokenizer: str, corpus_dir: Path) -> None:
    run_dir = _copy(trained, tmp_path)
    path = run_dir / "metrics.jsonl"
    inode, head = path.stat().st_ino, path.read_text()
    run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4, checkpoint={"reschedule": True}))
    assert path.stat().st_ino == inode and path.read_text().startswith(head)  # appended, not rewritten
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2, 3, 4]


# ------------------------------------------------------------------ pruning and the optimizer's settings on resume
def _flip_a_bit(step_dir: Path) -> None:
    data = next(step_dir.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))


def test_pruning_never_deletes_the_new_checkpoint_for_a_later_unusable_one(tmp_path: Path, trained,
                                                                            tiny_tokenizer: str,
                                                                            corpus_dir: Path) -> None:
    """keep_latest_k counted a later checkpoint that resume had skipped as unusable (here a flipped bit in step-3)
    among the newest, so it deleted the checkpoint just written and every good one: the run was left with only the
    broken one, and its next start with nothing to resume from."""
    run_dir = _copy(trained, tmp_path)
    ckpts = run_dir / "checkpoint"
    shutil.rmtree(ckpts / "step-2")
    _flip_a_bit(ckpts / "step-3")
    run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=2, keep=1, checkpoint={"reschedule": True}))
    assert [s for s, _ in list_checkpoints(str(ckpts))] == [2, 3]  # step-1 pruned, step-3 left as it was
    assert verify_checkpoint(str(ckpts / "step-2")) is None and "is corrupt" in verify_checkpoint(str(ckpts / "step-3"))


def test_an_interruption_while_pruning_names_the_new_checkpoint_and_leaves_no_partial_one(
        tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while keep_latest_k = 1 deleted step-1 (after step-2 was committed) printed 'kept checkpoint
    .../step-1 (step 1)', the half-deleted folder, and left that partial step-1 in place (seen failing before the
    fix). Now the message names step-2, the checkpoint being deleted was renamed step-1.pruned first, and the next
    prune removes what is left of it."""
    cfg = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=4, keep=1)
    args = ["--config", str(write_config(cfg, tmp_path / "c.toml"))]
    ckpts = tmp_path / "run" / "checkpoint"
    real_rmtree = shutil.rmtree

    def interrupted_rmtree(path, *a, **kw):
        if os.path.basename(os.fspath(path)).startswith("step-1") and os.path.isdir(path):
            os.remove(os.path.join(path, ".metadata"))  # part of the folder is gone when Ctrl-C comes
            raise KeyboardInterrupt
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", interrupted_rmtree)
    code, _, err = main_result(args, capsys)
    assert code == 130
    assert f"kept checkpoint {ckpts / 'step-2'} (step 2); resume with:" in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1.pruned", "step-2"]
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", real_rmtree)
    code, out, err = main_result(args, capsys)
    assert code == 0, err
    assert f"resumed from {ckpts / 'step-2'} (step 2)" in out
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-4"]


def test_a_file_named_like_a_saves_scratch_folder_does_not_stop_the_save(tmp_path: Path, trained,
                                                                          tiny_tokenizer: str,
                                                                          corpus_dir: Path) -> None:
    """A save clears its step-N.tmp first: a file of that name ended the run in NotADirectoryError's traceback
    (shutil.rmtree) at the save, after the step had trained."""
    run_dir = _copy(trained, tmp_path)
    (run_dir / "checkpoint" / "step-4.tmp").write_text("x")
    run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4, checkpoint={"reschedule": True}))
    assert [s for s, _ in list_checkpoints(str(run_dir / "checkpoint"))] == [1, 2, 3, 4]
    assert not (run_dir / "checkpoint" / "step-4.tmp").exists()


def test_a_resume_trains_with_the_changed_optimizer_settings(tmp_path: Path, trained, tiny_tokenizer: str,
                                                             corpus_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's optimizer param groups carry the settings that wrote it: loading them kept its weight decay,
    betas and eps, although the resume logged them as changed (``config: ... optimizer.weight_decay 0.1 -> 0.5``)."""
    from trnkit.harness.train import Trainer

    used = []
    train_step = Trainer.train_step

    def spy(self: Trainer, step: int):
        used.append({(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in self.optimizer.param_groups})
        return train_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", spy)
    run_dir = _copy(trained, tmp_path)
    shutil.rmtree(run_dir / "checkpoint" / "step-3")
    run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, optimizer={"weight_decay": 0.5, "beta2": 0.99, "eps": 1e-6}))
    assert used == [{(0.5, (0.9, 0.99), 1e-6)}]  # step 3, resumed from step-2 (0.1, (0.9, 0.95), 1e-8)


def test_a_resume_does_not_read_the_initial_weights_again(tmp_path: Path, tiny_tokenizer: str,
                                                          corpus_dir: Path) -> None:
    """A run started from checkpoint.initial_load_path read those weights again at every resume, only for the
    checkpoint to replace them, and was refused once the folder had moved ('no *.safetensors in ...'). Now the
    resume skips them (saying so) and trains as the uninterrupted run did."""
    hf = tmp_path / "hf"
    run(tiny_config(tmp_path / "export", tiny_tokenizer, corpus_dir, training={"steps": 1},
                    checkpoint={"export_hf": True, "export_dtype": "float32"}))
    shutil.move(tmp_path / "export" / "hf_export", hf)
    cfg = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, checkpoint={"initial_load_path": str(hf)})
    uninterrupted = run(cfg)
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-3")
    shutil.move(hf, tmp_path / "moved")
    resumed = run(cfg)
    assert resumed.start_step == 2 and resumed.losses[3] == uninterrupted.losses[3]


# ------------------------------------------------------------------ a changed LR schedule is explicit
def test_resume_with_more_steps_is_refused_without_reschedule(tmp_path: Path, trained, tiny_tokenizer: str,
                                                              corpus_dir: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy(trained, tmp_path)
    before = _snapshot(run_dir)
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=8)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    # the finished cosine ended at lr 1e-3 (min_lr_factor 0.1); the 8-step one re-warms step 4 to 7.5e-3
    fn = lr_lambda(cfg.lr_scheduler, 8)
    assert_user_error(code, err, f"checkpoint: {run_dir / 'checkpoint' / 'step-3'} (step 3) was written with "
                                 "another learning-rate schedule (training.steps: checkpoint 3, this run 8): step 4 "
                                 f"would train at lr {1e-2 * fn(3):.3g} instead of 0.001. Nothing was written.",
                      "pass --checkpoint.reschedule true to follow this run's schedule from step 4 on")
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("key, value, rule", [
    ("training.steps", "3", "training.steps: expected an int, got str '3'"),
    ("optimizer.lr", None, "optimizer.lr: expected a number, got NoneType None"),
    ("lr_scheduler.decay_type", "exp", "lr_scheduler.decay_type: must be one of ['cosine', 'linear', 'constant'], "
                                       "got 'exp'"),
])
def test_a_manifest_schedule_of_the_wrong_type_is_refused(tmp_path: Path, trained, tiny_tokenizer: str,
                                                          corpus_dir: Path, capsys: pytest.CaptureFixture[str],
                                                          key: str, value: object, rule: str) -> None:
    """The manifest carries no checksum: a recorded schedule value of the wrong type (an edited or damaged
    trnkit.json) ended the resume in a TypeError traceback (exit 1; a decay type of no schedule was read as
    cosine). Now: exit 2 naming the manifest, the key, the rule and the value, nothing written;
    --checkpoint.reschedule true follows this run's schedule instead, with a warning."""
    run_dir = _copy(trained, tmp_path)
    manifest = run_dir / "checkpoint" / "step-3" / "trnkit.json"
    m = json.loads(manifest.read_text())
    m["schedule"][key] = value
    manifest.write_text(json.dumps(m))
    before = _snapshot(run_dir)
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"checkpoint: {manifest} records a learning-rate schedule that cannot be read "
                                 f"({rule}). Nothing was written. Pass --checkpoint.reschedule true to follow this "
                                 "run's schedule from step 4 on")
    assert _snapshot(run_dir) == before
    res = run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4, checkpoint={"reschedule": True}))
    assert res.start_step == 3 and sorted(res.losses) == [4]
    assert f"WARNING: checkpoint.reschedule: {manifest} records a learning-rate schedule that cannot be read " \
           f"({rule}); the learning rate follows this run's schedule from step 4 on" in capsys.readouterr().out


def test_more_steps_at_a_constant_rate_resume_as_they_are(tmp_path: Path, tiny_tokenizer: str,
                                                          corpus_dir: Path) -> None:
    constant = {"warmup_steps": 2, "decay_type": "constant"}
    run(ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=3, lr_scheduler=constant))
    res = run(ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=5, lr_scheduler=constant))
    assert res.start_step == 3 and [r["lr"] for r in res.records] == [1e-2, 1e-2]  # no step's lr changes


def test_reschedule_follows_the_new_schedule(tmp_path: Path, trained, tiny_tokenizer: str, corpus_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy(trained, tmp_path)
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=8, optimizer={"lr": 5e-3},
                      checkpoint={"reschedule": True})
    res = run(cfg)
    fn = lr_lambda(cfg.lr_scheduler, 8)
    assert "WARNING: checkpoint.reschedule: the learning rate follows this run's schedule from step 4 on " \
           "(training.steps: checkpoint 3, this run 8; optimizer.lr: checkpoint 0.01, this run 0.005): step 4 " \
           f"would train at lr {5e-3 * fn(3):.3g} instead of 0.001" in capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in res.records}
    assert res.start_step == 3 and sorted(lrs) == [4, 5, 6, 7, 8]
    for step, lr in lrs.items():  # step s uses multiplier s - 1 of the new schedule, on the new base lr
        assert math.isclose(lr, 5e-3 * fn(step - 1), rel_tol=1e-12), (step, lr)


# ------------------------------------------------------------------ another world size on resume
def test_resume_on_another_world_size_is_resharded(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    from .helpers import losses_from_jsonl, run_cli

    one = run(ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=4, checkpoint={"interval": 2},
                          training={"local_batch_size": 2}))
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-4")  # as if stopped after step 3
    # the same global batch on 2 FSDP2 ranks: resumed from the 1-process step-2 checkpoint
    cfg = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=4, checkpoint={"interval": 2},
                      training={"local_batch_size": 1}, parallelism={"data_parallel_shard_degree": 2})
    proc = run_cli(["--config", str(write_config(cfg, tmp_path / "two.toml"))], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step2 = tmp_path / "run" / "checkpoint" / "step-2"
    assert (f"WARNING: checkpoint {step2} was written by a world size of 1 process(es), this run has world size 2: "
            "model and optimizer state are resharded") in proc.stdout
    assert f"resumed from {step2} (step 2)" in proc.stdout
    two = losses_from_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert sorted(two) == [1, 2, 3, 4]
    for s in (3, 4):  # FSDP2 over 2 ranks gives the 1-process losses (reduction order: 1e-5)
        assert two[s] == pytest.approx(one.losses[s], rel=1e-5, abs=1e-5), (s, two, one.losses)
    # the FSDP2-sharded step-4 passes the restricted metadata unpickler (DTensor shards' metadata included)
    assert verify_checkpoint(str(tmp_path / "run" / "checkpoint" / "step-4")) is None
