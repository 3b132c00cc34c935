"""Validation loss ([validation]): held-out split, the loss itself, log / metrics / plot, DP, resume, bad configs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trnkit.harness.data import build_loaders, load_tokenizer, read_documents, tokenize_stream
from trnkit.harness.metrics import read_jsonl
from trnkit.harness.train import main, run

from .helpers import losses_from_jsonl, run_cli, tiny_config, write_config

SEQ, LOCAL = 32, 2


def _cfg(tmp: Path, tok: str, corpus: Path, steps: int = 6, **sections: dict):
    val = {"enabled": True, "freq": 3, "steps": 2, "split_fraction": 0.1, **sections.pop("validation", {})}
    return tiny_config(tmp, tok, corpus, training={"steps": steps, **sections.pop("training", {})},
                       validation=val, **sections)


def _stream(cfg) -> np.ndarray:
    return tokenize_stream(read_documents(cfg.data.dataset), load_tokenizer(cfg.data.tokenizer))


# ------------------------------------------------------------------ the held-out split
@pytest.mark.parametrize("dp", [1, 2])
def test_held_out_part_is_the_corpus_tail_and_never_trained_on(tmp_path: Path, tiny_tokenizer: str,
                                                               corpus_dir: Path, dp: int) -> None:
    cfg = _cfg(tmp_path, tiny_tokenizer, corpus_dir, validation={"split_fraction": 0.2})
    full = _stream(cfg)
    n_val = round(0.2 * len(full))
    for rank in range(dp):
        train, val, _ = build_loaders(cfg.data, cfg.validation, SEQ, LOCAL, rank, dp, cfg.job.seed)
        # the two parts partition the stream: the training one is its head, the held-out one its tail
        assert np.array_equal(train.stream.numpy(), full[:len(full) - n_val])
        assert np.array_equal(val.stream.numpy(), full[len(full) - n_val:])
        # a whole epoch of training windows reads only positions below the cut (inputs and labels)
        last_end = max(train.sample_index(p) for p in range(train.num_samples)) * SEQ + SEQ + 1
        assert last_end <= len(full) - n_val
        # validation batches: corpus order, this rank's share of each global batch, the same every time
        first = val.next_batch()
        expect = torch.stack([torch.from_numpy(full[len(full) - n_val + i * SEQ:][:SEQ])
                              for i in range(rank * LOCAL, rank * LOCAL + LOCAL)])
        assert torch.equal(first.tokens, expect)
    again = build_loaders(cfg.data, cfg.validation, SEQ, LOCAL, 0, 1, cfg.job.seed)[1]
    assert torch.equal(again.stream, val.stream)  # deterministic


def test_separate_validation_dataset_leaves_the_training_corpus_whole(tmp_path: Path, tiny_tokenizer: str,
                                                                      corpus_dir: Path) -> None:
    (tmp_path / "val.txt").write_text("Some held-out prose that is not in the plays at all. " * 60)
    cfg = _cfg(tmp_path, tiny_tokenizer, corpus_dir, validation={"dataset": str(tmp_path / "val.txt")})
    train, val, tok = build_loaders(cfg.data, cfg.validation, SEQ, LOCAL, 0, 1)
    assert np.array_equal(train.stream.numpy(), _stream(cfg))
    assert np.array_equal(val.stream.numpy(), tokenize_stream(read_documents(str(tmp_path / "val.txt")), tok))


# ------------------------------------------------------------------ the loss, the log line, metrics.jsonl, the plot
def test_val_loss_is_the_mean_loss_over_the_held_out_batches(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    figures = []
    import matplotlib.figure

    orig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):  # keep what loss.png shows
        figures.append({ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()})
        return orig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    cfg = _cfg(tmp_path, tiny_tokenizer, corpus_dir, metrics={"log_freq": 4, "plot": True})
    res = run(cfg)
    assert sorted(res.val_losses) == [3, 6]  # every 3 steps and the last
    model = res.model
    assert model.training  # put back in train mode after the evaluation

    # independent: the held-out tail's first 2 x 2 windows, full logits, F.cross_entropy mean
    full = _stream(cfg)
    tail = torch.from_numpy(full[len(full) - round(0.1 * len(full)):])
    windows = torch.stack([tail[i * SEQ: i * SEQ + SEQ + 1] for i in range(2 * LOCAL)])
    model.eval()
    with torch.no_grad():
        logits = model(windows[:, :-1])
    model.train()
    expect = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten()).item()
    assert res.val_losses[6] == pytest.approx(expect, rel=1e-6, abs=1e-6)
    assert abs(res.val_losses[6] - res.losses[6]) > 1e-3  # not the training loss by another name

    recs = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in recs] == [3, 4, 6]  # log_freq 4, plus the validation steps
    assert {r["step"]: r.get("val_loss") for r in recs} == {3: res.val_losses[3], 4: None, 6: res.val_losses[6]}
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "step: " in ln]
    assert f"loss: {res.losses[3]:8.5f}  val_loss: {res.val_losses[3]:8.5f}  grad_norm:" in lines[0]
    assert "val_loss" not in lines[1] and f"val_loss: {res.val_losses[6]:8.5f}" in lines[2]
    assert "validation: every 3 steps and at the last, 2 batches of 2 x 32 tokens from the last 10% of" in out

    (plot,) = figures
    assert plot["training loss"] == ([3, 4, 6], [res.losses[s] for s in (3, 4, 6)])
    assert plot["validation loss"] == ([3, 6], [res.val_losses[3], res.val_losses[6]])


def test_validation_does_not_change_training(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    # a separate validation set keeps the training data whole: the run must train exactly as without one
    (tmp_path / "val.txt").write_text(Path(sorted(corpus_dir.glob("*.txt"))[0]).read_text()[-6000:])
    plain = run(tiny_config(tmp_path / "plain", tiny_tokenizer, corpus_dir, training={"steps": 5}))
    with_val = run(_cfg(tmp_path / "val", tiny_tokenizer, corpus_dir, steps=5,
                        validation={"freq": 1, "dataset": str(tmp_path / "val.txt")}))
    assert sorted(with_val.val_losses) == [1, 2, 3, 4, 5]
    assert with_val.losses == plain.losses and with_val.grad_norms == plain.grad_norms  # bit-exact


def test_resumed_run_matches_an_uninterrupted_one(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    sections = {"lr_scheduler": {"decay_type": "constant"}, "validation": {"freq": 2},
                "checkpoint": {"enable": True, "interval": 3}}
    whole = run(_cfg(tmp_path / "whole", tiny_tokenizer, corpus_dir, **json.loads(json.dumps(sections))))
    first = run(_cfg(tmp_path / "split", tiny_tokenizer, corpus_dir, steps=3, **json.loads(json.dumps(sections))))
    second = run(_cfg(tmp_path / "split", tiny_tokenizer, corpus_dir, **json.loads(json.dumps(sections))))
    assert second.start_step == 3
    assert {**first.losses, **second.losses} == whole.losses
    assert sorted(whole.val_losses) == [2, 4, 6] and sorted(second.val_losses) == [4, 6]
    assert first.val_losses[2] == whole.val_losses[2]
    assert {s: second.val_losses[s] for s in (4, 6)} == {s: whole.val_losses[s] for s in (4, 6)}  # bit-exact
    recs = {r["step"]: r for r in read_jsonl(str(tmp_path / "split" / "metrics.jsonl"))}
    assert recs[2]["val_loss"] == whole.val_losses[2] and recs[6]["val_loss"] == whole.val_losses[6]


def test_two_processes_give_the_single_process_val_loss(tmp_path: Path, tiny_tokenizer: str,
                                                        corpus_dir: Path) -> None:
    def val_losses(name: str, nproc: int, local: int, par: dict) -> dict[int, float]:
        cfg = _cfg(tmp_path / name, tiny_tokenizer, corpus_dir, steps=4,
                   training={"local_batch_size": local}, parallelism=par, validation={"freq": 2})
        proc = run_cli(["--config", str(write_config(cfg, tmp_path / f"{name}.toml"))], nproc=nproc)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return {r["step"]: r["val_loss"] for r in read_jsonl(str(tmp_path / name / "metrics.jsonl"))
                if "val_loss" in r}, losses_from_jsonl(tmp_path / name / "metrics.jsonl")

    one_val, one = val_losses("one", 1, 2, {})
    two_val, two = val_losses("two", 2, 1, {"data_parallel_shard_degree": 2})
    assert sorted(one_val) == sorted(two_val) == [2, 4]
    for s in one_val:  # each rank evaluates half of every global batch; the all-reduce gives the whole mean
        assert two_val[s] == pytest.approx(one_val[s], rel=1e-5, abs=1e-5), (s, one_val, two_val)
    for s in one:
        assert two[s] == pytest.approx(one[s], rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------ bad configurations: one message, exit 2
@pytest.mark.parametrize("val, fragment", [
    ({"freq": 0}, "config validation.freq: must be >= 1 (evaluate every N steps), got 0"),
    ({"steps": -1}, "config validation.steps: must be >= 1 (batches per evaluation), got -1"),
    ({"split_fraction": 1.0}, "config validation.split_fraction: must be in (0, 1)"),
    ({"split_fraction": 0.9999}, "validation.split_fraction: holding out 0.9999 of the corpus ("),
    ({"split_fraction": 0.0001}, "validation: the held-out last 0.0001 of the corpus ("),
    ({"steps": 100000}, "validation.steps (100000) x global batch (2) needs 200000; lower validation.steps"),
], ids=["freq", "steps", "fraction", "no-train-data", "no-val-data", "too-many-steps"])
def test_bad_validation_config_is_one_message(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path, val: dict,
                                              fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(tmp_path / "run", tiny_tokenizer, corpus_dir, validation=val)
    code = main(["--config", str(write_config(cfg, tmp_path / "c.toml"))])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert fragment in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training
