"""Asynchronous checkpoints (checkpoint.async_mode = "async"): the step loop goes on while a save is
written, the checkpoint equals a synchronous one, a SIGKILL mid-write loses nothing, a write error is
reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trnkit.harness.checkpoint import list_checkpoints, read_manifest, verify_checkpoint
from trnkit.harness.metrics import MetricsLogger, read_jsonl
from trnkit.harness.train import main, run

from .helpers import REPO, losses_from_jsonl, run_cli, tiny_config, write_config


def _cfg(tmp: Path, tok: str, corpus: Path, mode: str, steps: int = 6, interval: int = 3, **sections: dict):
    return tiny_config(tmp, tok, corpus, training={"steps": steps, **sections.pop("training", {})},
                       checkpoint={"enable": True, "interval": interval, "keep_latest_k": 0, "async_mode": mode},
                       **sections)


def _hold_write(monkeypatch: pytest.MonkeyPatch, ckpt_name: str, action) -> None:
    """Run `action(writer)` in the background writer before it writes `ckpt_name` (e.g. 'step-3.tmp')."""
    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if str(self.path).endswith(ckpt_name):
            action(self)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


def _contents(path: Path, tmp: Path) -> dict:
    tmp.mkdir(exist_ok=True)
    out = tmp / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_step_loop_runs_while_the_save_is_written(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # the step-3 write is held in the writer thread until step 5 has been logged: if the loop waited for
    # the write, step 5 would never come and the held write would give up (and fail the run)
    writing, release = threading.Event(), threading.Event()
    seen = {}

    def hold(writer) -> None:
        writing.set()
        if not release.wait(timeout=300):
            raise RuntimeError("the step loop never reached step 5 while step-3 was being written")

    _hold_write(monkeypatch, "step-3.tmp", hold)
    real_log = MetricsLogger.log

    def log(self, step, *args, **kwargs):
        rec = real_log(self, step, *args, **kwargs)
        if step == 4:  # the writer thread may still be staging/planning: let it reach the held write first
            writing.wait(timeout=300)
        if step in (4, 5):
            seen[step] = (writing.is_set(), release.is_set(), (tmp_path / "checkpoint" / "step-3").exists())
        if step == 5:
            release.set()
        return rec

    monkeypatch.setattr(MetricsLogger, "log", log)
    res = run(_cfg(tmp_path, tiny_tokenizer, corpus_dir, "async"))
    # steps 4 and 5 trained while the step-3 write was held, before step-3 was committed
    assert seen == {4: (True, False, False), 5: (True, False, False)}
    assert sorted(res.losses) == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in list_checkpoints(str(tmp_path / "checkpoint"))] == [3, 6]
    assert not list((tmp_path / "checkpoint").glob("*.tmp"))
    out = capsys.readouterr().out
    assert "saved checkpoint step-3 (" in out and "in the background, the step loop waited" in out


def test_async_checkpoint_equals_the_sync_one(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    # training goes on (and changes the weights) while the async checkpoint is written: it must hold the
    # state of its own step, exactly as the synchronous save does
    sync = run(_cfg(tmp_path / "sync", tiny_tokenizer, corpus_dir, "disabled", steps=5, interval=2))
    asyn = run(_cfg(tmp_path / "async", tiny_tokenizer, corpus_dir, "async", steps=5, interval=2))
    assert asyn.losses == sync.losses
    for step in (2, 4, 5):
        a, s = tmp_path / "async" / "checkpoint" / f"step-{step}", tmp_path / "sync" / "checkpoint" / f"step-{step}"
        assert verify_checkpoint(str(a)) is None
        _assert_same(_contents(a, tmp_path / "a"), _contents(s, tmp_path / "s"), f"step-{step}")
        ma, ms = read_manifest(str(a)), read_manifest(str(s))
        assert ma["identity"] == ms["identity"] and ma["tied"] == ms["tied"]
        assert ma["files"].keys() == ms["files"].keys()


@pytest.mark.parametrize("mode", ["async", "disabled"])
def test_a_write_error_is_reported_not_lost(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path, mode: str,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    def disk_full(writer) -> None:
        Path(writer.path, "__0_0.distcp").write_bytes(b"x" * 100)  # a partial file, then ENOSPC
        raise OSError(28, "No space left on device")

    _hold_write(monkeypatch, "step-4.tmp", disk_full)
    cfg = _cfg(tmp_path / "run", tiny_tokenizer, corpus_dir, mode, interval=2)
    code = main(["--config", str(write_config(cfg, tmp_path / "c.toml"))])
    err = capsys.readouterr().err
    folder = tmp_path / "run" / "checkpoint"
    where = "in the background " if mode == "async" else ""
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert (f"checkpoint: saving step-4 {where}to {folder} failed (OSError: [Errno 28] No space left on device)"
            in err), err
    assert f"the previous checkpoint {folder / 'step-2'} is intact; the run stopped" in err
    assert [s for s, _ in list_checkpoints(str(folder))] == [2] and verify_checkpoint(str(folder / "step-2")) is None
    assert not (folder / "step-4.tmp").exists()
    steps = [r["step"] for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))]
    # async: reported at the first poll after the background write fails: step 5's, or step 6's when the writer
    # thread is slower than one step (the step-6 save waits for the step-4 one); sync: at once
    assert steps[-1] in ((5, 6) if mode == "async" else (4,)), steps


def _logged_steps(metrics: Path) -> list[int]:
    """Steps in a metrics.jsonl another process is writing (a line still being written is skipped)."""
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().split("\n")[:-1]]


_HELD_WRITER = textwrap.dedent("""
    # the trainer's CLI with the background write of one checkpoint held forever (for a SIGKILL)
    import os, sys, time
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    real = FileSystemWriter.write_data
    def write_data(self, plan, planner):
        if str(self.path).endswith(os.environ["HOLD"]):
            open(os.environ["MARKER"], "w").close()
            time.sleep(3600)
        return real(self, plan, planner)
    FileSystemWriter.write_data = write_data
    from trnkit.harness.train import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigkill_during_an_async_save_keeps_the_previous_checkpoint(tmp_path: Path, tiny_tokenizer: str,
                                                                     corpus_dir: Path) -> None:
    steps = 9
    ref = run_cli(["--config", str(write_config(_cfg(tmp_path / "ref", tiny_tokenizer, corpus_dir, "disabled",
                                                     steps=steps), tmp_path / "ref.toml"))], timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses = losses_from_jsonl(tmp_path / "ref" / "metrics.jsonl")

    cfg = write_config(_cfg(tmp_path / "run", tiny_tokenizer, corpus_dir, "async", steps=steps), tmp_path / "a.toml")
    (tmp_path / "held.py").write_text(_HELD_WRITER)
    marker, metrics = tmp_path / "writing-step-6", tmp_path / "run" / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HOLD": "step-6.tmp",
           "MARKER": str(marker), "PYTHONPATH": str(REPO)}
    log = tmp_path / "held.log"  # a file, not a pipe nobody reads (a full pipe would stall the run)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "held.py"), "--config", str(cfg)], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        # wait until step-6 is being written AND the loop has trained step 7 meanwhile
        while time.time() < deadline and proc.poll() is None:
            if marker.exists() and 7 in _logged_steps(metrics):
                break
            time.sleep(0.05)
        assert proc.poll() is None, log.read_text()[-3000:]
        assert marker.exists() and 7 in _logged_steps(metrics), log.read_text()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    folder = tmp_path / "run" / "checkpoint"
    assert [s for s, _ in list_checkpoints(str(folder))] == [3], log.read_text()[-3000:]  # step-6 never committed
    assert (folder / "step-6.tmp").is_dir() and verify_checkpoint(str(folder / "step-3")) is None

    resumed = run_cli(["--config", str(cfg)], timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"resumed from {folder / 'step-3'} (step 3)" in resumed.stdout
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, steps + 1))
    assert losses_from_jsonl(metrics) == ref_losses  # bit-exact with the uninterrupted (synchronous) run
    assert [s for s, _ in list_checkpoints(str(folder))] == [3, 6, 9] and not list(folder.glob("*.tmp"))


def _assert_close(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor) and a.is_floating_point():
        # 2 ranks reduce in another order than 1 (weights differ by <= 2e-5 after 4 AdamW steps); one
        # step's update is ~lr = 1e-2, so a checkpoint of another step would be far outside
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=where)


def test_two_processes_write_the_single_process_checkpoint(tmp_path: Path, tiny_tokenizer: str,
                                                           corpus_dir: Path) -> None:
    # FSDP2 over 2 gloo ranks, each writing its shards in a background thread on the checkpoint's own group
    one = run(_cfg(tmp_path / "one", tiny_tokenizer, corpus_dir, "disabled", steps=4, interval=2))
    cfg = _cfg(tmp_path / "two", tiny_tokenizer, corpus_dir, "async", steps=4, interval=2,
               training={"local_batch_size": 1}, parallelism={"data_parallel_shard_degree": 2})
    proc = run_cli(["--config", str(write_config(cfg, tmp_path / "two.toml"))], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "in the background, the step loop waited" in proc.stdout
    two = losses_from_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert two == pytest.approx(one.losses, rel=1e-5, abs=1e-5)
    folder = tmp_path / "two" / "checkpoint"
    assert [s for s, _ in list_checkpoints(str(folder))] == [2, 4] and not list(folder.glob("*.tmp"))
    got = _contents(folder / "step-4", tmp_path / "t")
    ref = _contents(tmp_path / "one" / "checkpoint" / "step-4", tmp_path / "o")
    _assert_close(got["model"], ref["model"], "model")
    _assert_close(got["optimizer"], ref["optimizer"], "optimizer")
    assert got["data"] == ref["data"] and got["train"] == ref["train"]


def test_ctrl_c_with_a_save_in_flight_commits_it(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # Ctrl-C at step 4, before the loop has polled the step-3 save started at step 3: one process waits
    # for the write and commits it, so the run keeps the checkpoint it had started
    real_log = MetricsLogger.log

    def log(self, step, *args, **kwargs):
        if step == 4:
            raise KeyboardInterrupt
        return real_log(self, step, *args, **kwargs)

    monkeypatch.setattr(MetricsLogger, "log", log)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tmp_path, tiny_tokenizer, corpus_dir, "async"))
    folder = tmp_path / "checkpoint"
    assert [s for s, _ in list_checkpoints(str(folder))] == [3] and verify_checkpoint(str(folder / "step-3")) is None
    assert not list(folder.glob("*.tmp"))
    out = capsys.readouterr().out
    assert "waiting for the background save of checkpoint step-3" in out and "saved checkpoint step-3 (" in out
