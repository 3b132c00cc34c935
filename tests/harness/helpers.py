"""Helpers for the trainer tests: tiny configs, CLI runs (single process or torchrun), metrics reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from trnkit.harness.config import TrainerConfig, from_dict, to_toml

REPO = Path(__file__).resolve().parents[2]

# A Qwen3-MoE small enough to train in milliseconds per step: 2 layers (layer 0 dense, layer 1 MoE
# as in the debug-moe flavor), 4 experts top-2, vocab 384 (the tiny BPE of conftest.py).
TINY_MOE = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "hidden_dim": 64,
            "vocab_size": 384, "num_experts": 4, "top_k": 2, "moe_inter_dim": 32, "max_seq_len": 64}


def tiny_config(dump: Path, tokenizer: str, corpus: Path, **sections: dict[str, Any]) -> TrainerConfig:
    base: dict[str, dict[str, Any]] = {
        "job": {"name": "tiny", "dump_folder": str(dump)},
        "model": {"spec": "qwen3:debug-moe", "config": dict(TINY_MOE)},
        "data": {"tokenizer": tokenizer, "dataset": str(corpus)},
        "training": {"steps": 8, "local_batch_size": 2, "seq_len": 32},
        "optimizer": {"lr": 1e-2},
        "lr_scheduler": {"warmup_steps": 2},
        # quiet runs: no bar, and no progress lines on stderr (not a terminal under pytest), so a test reads
        # the run's own messages there; the progress tests turn them on
        "metrics": {"plot": False, "progress_bar": False, "progress_freq": 0},
    }
    for sec, vals in sections.items():
        base.setdefault(sec, {}).update(vals)
    return from_dict(base)


def write_config(cfg: TrainerConfig, path: Path) -> Path:
    path.write_text(to_toml(cfg))
    return path


def run_cli(args: list[str], nproc: int = 1, timeout: float = 240, **popen: Any) -> subprocess.CompletedProcess:
    """`python -m trnkit.harness.train ARGS` (nproc == 1) or under torchrun with `nproc` processes."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "trnkit.harness.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "trnkit.harness.train", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **popen)


def losses_from_jsonl(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]  # (a resumed run rewrites the file: one record per step)
    return out


def ckpt_config(tmp: Path, tok: str, corpus: Path, steps: int = 3, keep: int = 0, **sections: dict) -> TrainerConfig:
    """:func:`tiny_config` with a checkpoint at every step (``keep`` newest kept, 0 = all)."""
    return tiny_config(tmp, tok, corpus, training={"steps": steps, **sections.pop("training", {})},
                       checkpoint={"enable": True, "interval": 1, "keep_latest_k": keep,
                                   **sections.pop("checkpoint", {})}, **sections)


def main_result(args: list[str], capsys: Any) -> tuple[int, str, str]:
    """The trainer's command line in this process: ``(exit code, stdout, stderr)`` (``capsys``: pytest's)."""
    from trnkit.harness.train import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *fragments: str) -> None:
    """A user's mistake: exit 2, one ``error: ...`` message with every fragment, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error: "), err
    for f in fragments:
        assert f in err, (f, err)
