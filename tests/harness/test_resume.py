"""Checkpoints: a run SIGKILLed mid-training and resumed reproduces the uninterrupted run exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from trnkit.harness.checkpoint import latest_checkpoint, list_checkpoints

from .helpers import REPO, losses_from_jsonl, run_cli, tiny_config, write_config

STEPS = 24


def _cfg(tmp: Path, name: str, tok: str, corpus: Path) -> Path:
    cfg = tiny_config(tmp / name, tok, corpus, training={"steps": STEPS},
                      checkpoint={"enable": True, "interval": 3, "keep_latest_k": 2})
    return write_config(cfg, tmp / f"{name}.toml")


def test_resume_after_sigkill_reproduces_losses_exactly(tmp_path: Path, tiny_tokenizer: str,
                                                        corpus_dir: Path) -> None:
    ref_cfg = _cfg(tmp_path, "ref", tiny_tokenizer, corpus_dir)
    ref = run_cli(["--config", str(ref_cfg)])
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses = losses_from_jsonl(tmp_path / "ref" / "metrics.jsonl")
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    # keep_latest_k = 2: only the two newest checkpoints survive
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ref" / "checkpoint"))] == [21, 24]

    # a rerun of the finished job resumes step 24, trains nothing, and says how to go on or start fresh
    again = run_cli(["--config", str(ref_cfg)])
    assert again.returncode == 0, again.stderr[-3000:]
    ckpt24 = tmp_path / "ref" / "checkpoint" / f"step-{STEPS}"
    assert (f"nothing to train: checkpoint {ckpt24} is at step {STEPS} and training.steps = {STEPS}"
            in again.stdout), again.stdout
    assert "--training.steps N with N > 24 and --checkpoint.reschedule true (the learning rate then follows the " \
           "schedule of N steps from step 25 on)" in again.stdout
    assert ("to start fresh:   use another --job.dump_folder, or --checkpoint.resume false (trains from step 1; "
            f"this run's files are first moved to {tmp_path / 'ref'}/previous-<time>/)") in again.stdout
    assert "step: " not in again.stdout
    assert losses_from_jsonl(tmp_path / "ref" / "metrics.jsonl") == ref_losses  # history kept as it was

    # --checkpoint.resume false in the same folder trains from step 1 (same seed: the same first losses,
    # steps 1-2 being warmup, whose lr does not depend on training.steps); the old run's files are moved
    # aside, never overwritten
    fresh = run_cli(["--config", str(ref_cfg), "--checkpoint.resume", "false", "--training.steps", "2"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "resumed from" not in fresh.stdout
    assert losses_from_jsonl(tmp_path / "ref" / "metrics.jsonl") == {1: ref_losses[1], 2: ref_losses[2]}
    (archive,) = (tmp_path / "ref").glob("previous-*")
    assert f"the earlier run's files in {tmp_path / 'ref'} were moved to {archive}" in fresh.stdout
    assert losses_from_jsonl(archive / "metrics.jsonl") == ref_losses
    assert [s for s, _ in list_checkpoints(str(archive / "checkpoint"))] == [21, 24]
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ref" / "checkpoint"))] == [2]

    cfg = _cfg(tmp_path, "killed", tiny_tokenizer, corpus_dir)
    ckpt_dir = tmp_path / "killed" / "checkpoint"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "trnkit.harness.train", "--config", str(cfg)], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        got = latest_checkpoint(str(ckpt_dir))
        if got is not None and got[0] >= 6:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = latest_checkpoint(str(ckpt_dir))
    assert killed_at is not None and killed_at[0] < STEPS

    resumed = run_cli(["--config", str(cfg)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed_at[1]} (step {killed_at[0]})" in resumed.stdout
    # the resumed run rewrote metrics.jsonl: the steps up to the checkpoint, then its own, no duplicates
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    losses = losses_from_jsonl(tmp_path / "killed" / "metrics.jsonl")
    for s in range(1, STEPS + 1):
        assert losses[s] == ref_losses[s], (s, losses[s], ref_losses[s])  # bit-exact


def test_the_kernel_choice_does_not_change_the_run_identity() -> None:
    """A checkpoint resumes under other [overrides] (or one written before Qwen3Config had kernels): the
    kernels decide which code computes the model, not the model."""
    import torch

    from trnkit.harness.checkpoint import RunIdentity
    from trnkit.overrides import KernelChoice
    from trnkit.qwen3 import Qwen3Model, model_registry

    plain = model_registry("debug-moe").config
    chosen = plain.replace(kernels={"rope_hf": KernelChoice("reference")})
    with torch.device("meta"):
        ident = RunIdentity.of("qwen3:debug-moe", chosen, Qwen3Model(chosen))
        saved = RunIdentity.of("qwen3:debug-moe", plain, Qwen3Model(plain)).to_dict()
    saved["model_config"].pop("kernels")  # as written before the field existed
    assert ident.model_config["kernels"] == {"rope_hf": {"impl": "reference", "policy": "strict", "block_size": 0,
                                                          "lnc": 0, "fixed_shift": None}}
    assert ident.differences(saved) == []
    saved["model_config"]["n_layers"] = 3  # a real difference is still one
    assert ident.differences(saved)[0].startswith("n_layers: checkpoint 3")


def test_a_resume_with_changed_settings_keeps_the_earlier_config(tmp_path: Path, tiny_tokenizer: str,
                                                                 corpus_dir: Path, caplog) -> None:
    """config.toml used to be overwritten by the resuming run's settings, so the run folder no longer said what
    its first steps ran with; now the earlier file is kept under config_history/ and each change is logged."""
    import logging
    import tomllib

    from trnkit.harness.train import run

    from .helpers import ckpt_config

    run(ckpt_config(tmp_path, tiny_tokenizer, corpus_dir, steps=2, optimizer={"weight_decay": 0.1}))
    first = (tmp_path / "config.toml").read_text()
    caplog.set_level(logging.INFO, logger="trnkit.harness")
    res = run(ckpt_config(tmp_path, tiny_tokenizer, corpus_dir, steps=3, optimizer={"weight_decay": 0.5},
                          training={"max_norm": 0.5}))
    assert res.start_step == 2 and res.final_step == 3
    assert (tmp_path / "config_history" / "until-step-2.toml").read_text() == first
    assert tomllib.loads((tmp_path / "config.toml").read_text())["optimizer"]["weight_decay"] == 0.5
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config: ")]
    assert logged == [f"config: this run resumes step 2 with 3 settings changed: optimizer.weight_decay 0.1 -> "
                      f"0.5, training.max_norm 1.0 -> 0.5, training.steps 2 -> 3; the earlier config.toml is kept as "
                      f"{tmp_path / 'config_history' / 'until-step-2.toml'}"], logged
    # a resume with the same settings keeps nothing more
    run(ckpt_config(tmp_path, tiny_tokenizer, corpus_dir, steps=3, optimizer={"weight_decay": 0.5},
                    training={"max_norm": 0.5}))
    assert sorted(os.listdir(tmp_path / "config_history")) == ["until-step-2.toml"]
