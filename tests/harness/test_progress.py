"""Progress bar every step, output through logging (rank filter), loss plot on every exit, warmup warning."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trnkit.harness.config import ConfigError, load_config
from trnkit.harness.logs import setup_logging
from trnkit.harness.metrics import MetricsLogger
from trnkit.harness.train import TrainingDiverged, run

from .helpers import REPO, tiny_config, write_config


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _messages(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trnkit.harness" and r.levelno >= level]


def test_bar_advances_every_step_and_logs_do_not_garble_it(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir, training={"steps": 4},
                      lr_scheduler={"warmup_steps": 6},
                      metrics={"progress_bar": True, "plot": True, "log_freq": 10})  # logs step 4 only
    run(cfg)
    bar = terminal.getvalue()
    states = [s.strip() for s in bar.split("\r") if "/4" in s]
    for step in range(1, 5):  # a redraw per step, each with an ETA and the step's tokens/s
        drawn = [s for s in states if f" {step}/4 [" in s]
        assert drawn, (step, states)
        assert "<" in drawn[-1] and "tok/s, loss " in drawn[-1], drawn[-1]
    out = capsys.readouterr().out
    # every stdout line is a whole log line: the bar (stderr) is cleared around each message
    lines = out.splitlines()
    assert lines and all(line.startswith("[trnkit] ") for line in lines), out
    assert any("step-1 loss" in line and "as expected for random init" in line for line in lines)
    assert sum("step:  4  loss:" in line for line in lines) == 1
    assert not any("step:  1  loss:" in line for line in lines)  # log_freq 10: the bar alone shows step 1
    assert "[trnkit] WARNING: lr_scheduler.warmup_steps (6) > training.steps (4): the learning rate never " \
           "reaches optimizer.lr (it ends at 67% of it) and never decays" in out
    assert any("warmup_steps (6)" in m for m in _messages(caplog, logging.WARNING))
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert "loss curve (finished at step 4)" in out


def test_diverged_run_writes_the_plot(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir, training={"steps": 6, "max_norm": 0.0},
                      optimizer={"lr": 1e30, "weight_decay": 0.0},
                      lr_scheduler={"warmup_steps": 0, "decay_type": "constant"}, metrics={"plot": True})
    with pytest.raises(TrainingDiverged, match="step 2"):
        run(cfg)
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert f"loss curve (diverged at step 1): {tmp_path / 'loss.png'}" in _messages(caplog)
    assert any(m.startswith("step-1 loss") for m in _messages(caplog))
    assert _messages(caplog, logging.WARNING) == []  # warmup_steps 0 <= steps: no warning


def test_keyboard_interrupt_writes_the_plot(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    original = MetricsLogger.progress

    def ctrl_c_at_step_3(self: MetricsLogger, step: int, loss: float) -> None:
        original(self, step, loss)
        if step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(MetricsLogger, "progress", ctrl_c_at_step_3)
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir, training={"steps": 8}, metrics={"plot": True})
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert any(m.startswith("loss curve (interrupted (SIGINT) at step 2)") for m in _messages(caplog))


def test_sigterm_stops_the_cli_with_a_plot(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir, training={"steps": 10_000}, metrics={"plot": True})
    toml = write_config(cfg, tmp_path / "c.toml")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "trnkit.harness.train", "--config", str(toml)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        jsonl = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (jsonl.exists() and len(jsonl.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM)" in err and "Traceback" not in err
    assert "[trnkit] loss curve (interrupted (SIGTERM) at step" in out
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_log_rank_filter_and_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    log = setup_logging(rank=1, world_size=2, log_rank="0")
    try:
        log.info("from rank 1")
        assert capsys.readouterr().out == ""
        setup_logging(rank=1, world_size=2, log_rank="all")
        log.info("from rank 1")
        assert capsys.readouterr().out == "[trnkit rank 1] from rank 1\n"
        setup_logging(rank=1, world_size=2, log_rank="1")
        log.warning("only rank 1")
        assert capsys.readouterr().out == "[trnkit] WARNING: only rank 1\n"
    finally:
        setup_logging(rank=0, world_size=1)


def test_log_rank_from_the_command_line() -> None:
    assert load_config(cli=["--log_rank", "all"]).metrics.log_rank == "all"
    assert load_config(cli=["--log_rank=1"]).metrics.log_rank == "1"
    with pytest.raises(ConfigError, match=r"config metrics.log_rank: must be 'all' or a rank number, got 'every'"):
        load_config(cli=["--log_rank", "every"])
