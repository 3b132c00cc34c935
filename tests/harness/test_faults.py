"""Fault injection: every way a user's mistake or a broken file can meet the trainer.

Each case ends in one clear message (exit 2 through the CLI, no traceback) or a documented recovery,
and never loses a run: truncated / corrupt / mismatched checkpoints, a full disk, an unwritable folder,
bad data files, bad model folders and configs, non-float weights, NaN activations.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trnkit.harness import checkpoint as ckpt_mod
from trnkit.harness.checkpoint import MANIFEST, list_checkpoints, read_manifest, verify_checkpoint
from trnkit.harness.config import ConfigError
from trnkit.harness.data import read_documents
from trnkit.harness.metrics import read_jsonl
from trnkit.harness.train import run

from .helpers import TINY_MOE, assert_user_error, ckpt_config, main_result, tiny_config, write_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: str, corpus_dir: Path):
    """A finished 3-step run with a checkpoint at every step (kept), as a pristine template to copy."""
    d = tmp_path_factory.mktemp("trained")
    cfg = ckpt_config(d / "run", tiny_tokenizer, corpus_dir)
    res = run(cfg)
    return d / "run", res.losses


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ a checkpoint knows its run
@pytest.mark.parametrize("change, field", [
    ({"n_layers": 1}, "n_layers: checkpoint 2, this run 1"),    # smaller: used to resume silently
    ({"n_layers": 3}, "n_layers: checkpoint 2, this run 3"),    # more layers: used to be "Missing key"
    ({"dim": 48}, "dim: checkpoint 32, this run 48"),            # other hidden size: "Size mismatch"
    ({"num_experts": 2}, "num_experts: checkpoint 4, this run 2"),
    ({"rope_theta": 10.0}, "rope_theta: checkpoint 1000000.0, this run 10.0"),  # same shapes, other model
], ids=["fewer-layers", "more-layers", "dim", "fewer-experts", "rope-theta"])
def test_resume_with_another_model_stops_before_writing(tmp_path: Path, trained, tiny_tokenizer: str,
                                                        corpus_dir: Path, change: dict, field: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy_run(trained[0], tmp_path / "run")
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=6, model={"config": {**TINY_MOE, **change}})
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"{run_dir / 'checkpoint' / 'step-3'} was written by another model", field,
                      "Nothing was written", "use another --job.dump_folder")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before  # not a byte touched


def test_resume_with_other_data_settings_changes_nothing(tmp_path: Path, trained, tiny_tokenizer: str,
                                                        corpus_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy_run(trained[0], tmp_path / "run")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3, training={"seq_len": 16})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, "data: the checkpoint's data position reads other samples in this run "
                      "(training.seq_len: checkpoint 32, this run 16)")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # config.toml included


def _swapped_plays(corpus_dir: Path, dst: Path) -> Path:
    """The same two plays in the other order: the same tokens, so the same number of samples, other samples."""
    dst.mkdir()
    (dst / "play0.txt").write_bytes((corpus_dir / "play1.txt").read_bytes())
    (dst / "play1.txt").write_bytes((corpus_dir / "play0.txt").read_bytes())
    return dst


def test_resume_with_another_corpus_of_the_same_size_changes_nothing(tmp_path: Path, trained, tiny_tokenizer: str,
                                                                    corpus_dir: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Used to resume silently: the data position was checked against the sample count alone."""
    run_dir = _copy_run(trained[0], tmp_path / "run")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    other = _swapped_plays(corpus_dir, tmp_path / "other")
    cfg = ckpt_config(run_dir, tiny_tokenizer, other, steps=4)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    saved = read_manifest(str(run_dir / "checkpoint" / "step-3"))["data"]
    tokens = f"{saved['tokens']:,} tokens"
    assert_user_error(code, err, "data: the checkpoint's data position reads other samples in this run (the training "
                      f"token stream: checkpoint {run_dir / 'checkpoint' / 'step-3'} {tokens}, sha256 "
                      f"{saved['sha256'][:16]}, this run {tokens}, sha256 ", "data.dataset's files or their contents",
                      "Nothing was written", "another --job.dump_folder, or --checkpoint.resume false")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # config.toml included


def test_the_manifest_records_the_training_datas_identity(trained, tiny_tokenizer: str, corpus_dir: Path) -> None:
    """tokens + SHA-256 of the packed stream (int64 little-endian), computed here with tokenizers and hashlib."""
    import hashlib

    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tiny_tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    ids = [t for f in sorted(corpus_dir.glob("*.txt")) for t in tok.encode(f.read_text()).ids + [eos]]
    stream = np.array(ids, dtype="<i8")
    for step in (1, 2, 3):
        data = read_manifest(str(trained[0] / "checkpoint" / f"step-{step}"))["data"]
        assert data == {"tokens": len(ids), "sha256": hashlib.sha256(stream.tobytes()).hexdigest()}


def test_a_checkpoint_without_a_data_identity_resumes_with_a_warning(tmp_path: Path, trained, tiny_tokenizer: str,
                                                                     corpus_dir: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Checkpoints written before the manifest recorded ``data``: resumed, the sample count alone compared."""
    run_dir = _copy_run(trained[0], tmp_path / "run")
    manifest = run_dir / "checkpoint" / "step-3" / MANIFEST
    m = json.loads(manifest.read_text())
    del m["data"]
    manifest.write_text(json.dumps(m))
    res = run(ckpt_config(run_dir, tiny_tokenizer, _swapped_plays(corpus_dir, tmp_path / "other"), steps=4,
                          checkpoint={"reschedule": True}))
    assert res.start_step == 3 and sorted(res.losses) == [4]
    assert any(r.getMessage() == f"WARNING: checkpoint {run_dir / 'checkpoint' / 'step-3'} records no identity of its "
               "training data (an older checkpoint): only its sample count is compared with this run's corpus"
               for r in caplog.records)


def test_resume_with_a_resumable_change_continues(tmp_path: Path, trained, tiny_tokenizer: str,
                                                  corpus_dir: Path) -> None:
    # the aux-loss coefficient is a training setting, not a different model
    run_dir = _copy_run(trained[0], tmp_path / "run")
    res = run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4, training={"moe_aux_loss_coef": 0.01},
                          checkpoint={"reschedule": True}))
    assert res.start_step == 3 and sorted(res.losses) == [4]


def test_pruning_keeps_other_models_checkpoints(tmp_path: Path, trained, tiny_tokenizer: str,
                                                corpus_dir: Path) -> None:
    run_dir = _copy_run(trained[0], tmp_path / "run")
    foreign = run_dir / "checkpoint" / "step-1" / MANIFEST
    m = json.loads(foreign.read_text())
    m["identity"]["fingerprint"] = "another-model"
    foreign.write_text(json.dumps(m))
    run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=5, keep=2, checkpoint={"reschedule": True}))
    # this model's 2, 3, 4, 5 -> the newest two; the other model's step-1 is never deleted
    assert [s for s, _ in list_checkpoints(str(run_dir / "checkpoint"))] == [1, 4, 5]


def test_manifest_records_the_run_and_the_tied_weight_is_stored_once(trained) -> None:
    step3 = trained[0] / "checkpoint" / "step-3"
    m = read_manifest(str(step3))
    ident = m["identity"]
    assert ident["model_config"]["n_layers"] == 2 and ident["params"]["tok_embeddings.weight"] == [384, 32]
    assert "lm_head.weight" not in ident["params"]                       # tied: one parameter
    assert m["tied"] == {"lm_head.weight": "tok_embeddings.weight"}      # ... stored once, restored on load
    files = {p.name: p.stat().st_size for p in step3.iterdir() if p.name != MANIFEST}
    assert {n: r["size"] for n, r in m["files"].items()} == files
    assert all(re.fullmatch(r"[0-9a-f]{8}", r["crc32"]) for r in m["files"].values())
    stored = {k.fqn for k in dcp.FileSystemReader(str(step3)).read_metadata().storage_data}
    assert "model.tok_embeddings.weight" in stored and not any("lm_head" in k for k in stored)


def test_each_save_logs_size_and_time(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    run(ckpt_config(tmp_path, tiny_tokenizer, corpus_dir, steps=2))
    out = capsys.readouterr().out
    for step in (1, 2):
        assert re.search(rf"saved checkpoint step-{step} \(\d+\.\d KiB, \d+\.\d s\) to .*step-{step}", out), out


# ------------------------------------------------------------------ corrupt or partial checkpoints
def _truncate(d: Path) -> str:
    f = sorted(d.glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f"{f} is truncated"


def _corrupt_metadata(d: Path) -> str:  # same size: only the CRC tells, before anything is unpickled
    f = d / ".metadata"
    f.write_bytes(b"\x80\x04garbage".ljust(f.stat().st_size, b"."))
    return f"{f} is corrupt (CRC-32"


def _flip_byte(d: Path) -> str:
    f = sorted(d.glob("*.distcp"))[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return f"{f} is corrupt (CRC-32"


@pytest.mark.parametrize("damage", [_truncate, _corrupt_metadata, _flip_byte], ids=["truncated", "metadata", "crc"])
def test_broken_newest_checkpoint_falls_back_to_the_older_one(tmp_path: Path, trained, tiny_tokenizer: str,
                                                              corpus_dir: Path, damage,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy_run(trained[0], tmp_path / "run")
    step3 = run_dir / "checkpoint" / "step-3"
    why = damage(step3)
    assert why in (verify_checkpoint(str(step3)) or "")
    damaged = _files(step3)
    res = run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3))
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {step3} is not usable: {why}" in out and "trying the next older" in out
    assert res.start_step == 2
    assert res.losses[3] == trained[1][3]  # step 3 redone from step-2: bit-exact with the original run
    # the new step-3 replaced the unusable one, which is moved aside byte for byte, not deleted
    assert verify_checkpoint(str(step3)) is None
    [aside] = (run_dir / "checkpoint").glob("step-3.replaced-*")
    assert _files(aside) == damaged
    assert f"checkpoint: {step3} was not a usable checkpoint of this run; moved to {aside}" in out


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_an_unreadable_checkpoint_file_falls_back_to_the_older_one(tmp_path: Path, trained, tiny_tokenizer: str,
                                                                   corpus_dir: Path, name: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint file the run may not open (mode 000, another user's) ended the resume in a PermissionError
    traceback from the CRC check (seen failing before the fix); now the checkpoint is not usable, named with the
    reason, and the next older one resumes."""
    run_dir = _copy_run(trained[0], tmp_path / "run")
    step3 = run_dir / "checkpoint" / "step-3"
    target = str(step3 / name)
    os.chmod(target, 0)  # what a user other than the file's owner meets; root still reads it, hence the patch
    real_open = open

    def unreadable(path, *args, **kwargs):
        if os.fspath(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "open", unreadable, raising=False)
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3)
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert code == 0, err
    assert (f"WARNING: checkpoint {step3} is not usable: {target} cannot be read (PermissionError: Permission "
            "denied); trying the next older checkpoint") in out
    assert f"resumed from {run_dir / 'checkpoint' / 'step-2'} (step 2)" in out


@pytest.mark.parametrize("older", [False, True], ids=["only-checkpoint", "older-one-usable"])
def test_a_checkpoint_folder_without_its_metadata_is_not_passed_over(tmp_path: Path, trained, tiny_tokenizer: str,
                                                                     corpus_dir: Path, older: bool,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A step-N folder only appears by a complete save's rename; one whose .metadata is gone (deleted, a partial
    copy of the run folder, or a folder the run may not read) was passed over in silence: with no other checkpoint
    the run started fresh from step 1, moving the run aside (seen failing before the fix). Now it is named as not
    usable: the older checkpoint resumes with the warning, or, with none, the run stops and changes nothing."""
    run_dir = _copy_run(trained[0], tmp_path / "run")
    folder = run_dir / "checkpoint"
    if not older:
        for step in (1, 2):
            shutil.rmtree(folder / f"step-{step}")
    (folder / "step-3" / ".metadata").unlink()
    why = f"{folder / 'step-3' / '.metadata'} is missing"
    before = _files(run_dir)
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3)
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    if older:
        assert code == 0, err
        assert f"WARNING: checkpoint {folder / 'step-3'} is not usable: {why}; trying the next older" in out
        assert f"resumed from {folder / 'step-2'} (step 2)" in out
    else:
        assert_user_error(code, err, f"checkpoint: no usable checkpoint in {folder}:\n  step-3: {why}")
        assert _files(run_dir) == before and not list(run_dir.glob("previous-*"))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_no_usable_checkpoint_is_a_clear_error(tmp_path: Path, trained, tiny_tokenizer: str, corpus_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy_run(trained[0], tmp_path / "run")
    whys = [_truncate(run_dir / "checkpoint" / "step-1"), _corrupt_metadata(run_dir / "checkpoint" / "step-2"),
            _flip_byte(run_dir / "checkpoint" / "step-3")]
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"checkpoint: no usable checkpoint in {run_dir / 'checkpoint'}", *whys)


# ------------------------------------------------------------------ disk full / unwritable folder
def test_disk_full_during_save_stops_cleanly(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    real_save = ckpt_mod.dcp.save
    calls = []

    def save(state, checkpoint_id):  # the first save works; the second runs out of space half-way
        calls.append(checkpoint_id)
        if len(calls) == 1:
            return real_save(state, checkpoint_id=checkpoint_id)
        os.makedirs(checkpoint_id, exist_ok=True)
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 64 vs 0")

    monkeypatch.setattr(ckpt_mod.dcp, "save", save)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    # keep_latest_k = 1: a prune before the new checkpoint is complete would delete step-1
    cfg = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=3, keep=1)
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    folder = tmp_path / "run" / "checkpoint"
    assert f"WARNING: checkpoint folder {folder} has 1000 B free; each checkpoint needs ~" in out  # up front
    assert_user_error(code, err, f"checkpoint: saving step-2 to {folder} failed (RuntimeError: [enforce fail",
                      "A checkpoint needs ~", "KiB; the disk has 1000 B free",
                      f"the previous checkpoint {folder / 'step-1'} is intact; the run stopped")
    assert [s for s, _ in list_checkpoints(str(folder))] == [1] and verify_checkpoint(str(folder / "step-1")) is None
    assert not (folder / "step-2.tmp").exists()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))] == [1, 2]


def test_unwritable_checkpoint_folder_is_refused_up_front(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "blocker").write_text("a file where the checkpoint folder should be")
    cfg = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, checkpoint={"folder": "blocker"})
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    # refused before the data is read (before: after the model build, as the FileExistsError of its makedirs)
    assert_user_error(code, err, f"checkpoint.folder: {tmp_path / 'run' / 'blocker'} is a file, not a folder; move it "
                                 "away or set checkpoint.folder to another folder")
    assert "step: " not in out and "data: " not in out


# ------------------------------------------------------------------ a fresh run keeps the old run's files
def test_fresh_run_moves_the_old_runs_files_aside(tmp_path: Path, trained, tiny_tokenizer: str,
                                                  corpus_dir: Path) -> None:
    run_dir = _copy_run(trained[0], tmp_path / "run")
    old_metrics = (run_dir / "metrics.jsonl").read_text()
    run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=1, checkpoint={"resume": False}))
    (archive,) = run_dir.glob("previous-*")
    assert (archive / "metrics.jsonl").read_text() == old_metrics
    assert [s for s, _ in list_checkpoints(str(archive / "checkpoint"))] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(str(run_dir / "metrics.jsonl"))] == [1]


def test_a_refused_fresh_run_leaves_the_old_run_in_place(tmp_path: Path, trained, tiny_tokenizer: str,
                                                        corpus_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fresh start refused while the model is built (here: initial weights without safetensors) moves nothing:
    the earlier run's files are moved aside only once nothing can refuse the run any more."""
    run_dir = _copy_run(trained[0], tmp_path / "run")
    (tmp_path / "no_weights").mkdir()
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=1,
                      checkpoint={"resume": False, "initial_load_path": str(tmp_path / "no_weights")})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, "checkpoint.initial_load_path: must be an HF checkpoint folder (config.json and "
                                 f"*.safetensors); no *.safetensors in it, got '{tmp_path / 'no_weights'}'")
    assert not list(run_dir.glob("previous-*"))
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------ bad data files
@pytest.mark.parametrize("name, content, match", [
    ("bin.txt", bytes(range(256)) * 4, r"bin\.txt is a binary file, not text; data files must be UTF-8"),
    ("latin.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"),
     r"latin\.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "no end\n',
     r"bad\.jsonl:2 is not valid JSON \(Invalid control character, column 17\)"),
    ("list.jsonl", b'{"text": "ok"}\n\n[1, 2]\n', r"list\.jsonl:3 is a JSON list, not an object"),
    ("latin.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"latin\.jsonl:2 is not UTF-8 text"),
], ids=["binary", "latin1", "jsonl-syntax", "jsonl-list", "jsonl-latin1"])
def test_bad_data_files_name_file_and_line(tmp_path: Path, name: str, content: bytes, match: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        read_documents(str(tmp_path / name))


def test_bad_data_file_through_the_cli(tmp_path: Path, tiny_tokenizer: str, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_bytes(b'{"text": "fine"}\n{"text": oops}\n')
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, tmp_path / "data")
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"{tmp_path / 'data' / 'a.jsonl'}:2 is not valid JSON")
    assert "--debug or TRNKIT_DEBUG=1 shows the traceback" in err
    code, _, err = main_result(["--config", str(tmp_path / "c.toml"), "--debug"], capsys)
    assert code == 2 and "Traceback" in err  # asked for
    monkeypatch.setenv("TRNKIT_DEBUG", "1")
    code, _, err = main_result(["--config", str(tmp_path / "c.toml")], capsys)
    assert code == 2 and "Traceback" in err and "a.jsonl:2 is not valid JSON" in err


# ------------------------------------------------------------------ bad model folders and configs
def test_hf_folder_without_config_json(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, model={"spec": f"hf:{tmp_path / 'hf'}",
                                                                         "config": {}})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"model.spec: hf:{tmp_path / 'hf'} has no config.json", "model.safetensors")


def test_compile_backend_typo(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, compile={"enable": True, "backend": "inductr"})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, "config compile.backend: unknown torch.compile backend 'inductr' "
                                 "(did you mean 'inductor'?)")


@pytest.mark.parametrize("args", [
    ["--model.config", '{"n_layers": null}'],
])
def test_model_config_null_value(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = main_result(args, capsys)
    assert_user_error(code, err, "config model.config.n_layers: null is not a value")


def test_checkpoint_error_through_initial_load_path(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # truncated
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir,
                      checkpoint={"initial_load_path": str(tmp_path / "w")})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"Qwen3 checkpoint: {tmp_path / 'w' / 'model.safetensors'} is corrupt or truncated")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_non_float_weights_are_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file

    from trnkit.qwen3 import CheckpointError, Qwen3Model, load_hf_checkpoint, model_registry, save_hf_checkpoint

    cfg = model_registry("debug-moe", **TINY_MOE).config
    model = Qwen3Model(cfg)
    model.init_weights()
    save_hf_checkpoint(model, tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    key = "model.layers.0.self_attn.q_proj.weight"
    sd[key] = (sd[key] * 100).to(dtype)
    save_file(sd, f)
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)} in {re.escape(str(f))} has dtype "
                                              rf"{'I32' if dtype == torch.int32 else 'BOOL'}; its parameter needs a "
                                              "floating-point tensor"):
        load_hf_checkpoint(tmp_path)


# ------------------------------------------------------------------ deepcopy after a forward
def test_deepcopy_after_a_training_forward() -> None:
    from trnkit.qwen3 import Qwen3Model, model_registry

    model = Qwen3Model(model_registry("debug-moe", **TINY_MOE).config)
    model.init_weights()
    model.train()
    model(torch.randint(0, 384, (2, 8)))
    assert model.aux_loss is not None and model.aux_loss.grad_fn is not None
    twin = copy.deepcopy(model)
    assert twin.aux_loss is None and all(b.moe is None or b.moe.aux_stats is None for b in twin.layers)
    tokens = torch.randint(0, 384, (2, 8))
    model.eval(), twin.eval()
    torch.testing.assert_close(twin(tokens), model(tokens), rtol=0, atol=0)
    assert twin.lm_head.weight is twin.tok_embeddings.weight  # the tie survives the copy


# ------------------------------------------------------------------ NaN activations
def test_nki_router_gives_a_nan_token_the_reference_outcome() -> None:
    from trnkit.kernels.router import router_topk, router_topk_ref
    from trnkit.overrides.registry import get_impl

    torch.manual_seed(0)
    x, w = torch.randn(8, 32), torch.randn(4, 32) * 0.1
    x[3, 5] = float("nan")
    raw_idx = router_topk(x, w, 2, True)[1]
    assert not bool(((raw_idx[3] >= 0) & (raw_idx[3] < 4)).all())  # the bare kernel: ids outside [0, E)
    weights, idx, logits = get_impl("router_topk", "nki").fn(x, w, 2, True)
    ref_w, ref_idx, _ = router_topk_ref(x, w, 2, True)
    assert idx[3].tolist() == ref_idx[3].tolist() == [0, 1] and torch.isnan(weights[3]).all()
    ok = torch.arange(8) != 3
    kern_w, kern_idx, _ = router_topk(x, w, 2, True)
    assert torch.equal(idx[ok], kern_idx[ok]) and torch.equal(weights[ok], kern_w[ok])  # finite rows untouched


@pytest.mark.parametrize("ops", [[], ["rope_hf", "router_topk", "moe_experts"]], ids=["reference", "nki"])
def test_nan_activation_ends_in_the_non_finite_stop(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                    ops: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from trnkit.harness.data import build_loader
    from trnkit.qwen3 import Qwen3Model, model_registry, save_hf_checkpoint

    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, training={"steps": 2})
    first = build_loader(cfg.data, 32, 2, 0, 1, cfg.job.seed)[0].next_batch().tokens[0, 0]
    model = Qwen3Model(model_registry("debug-moe", **TINY_MOE).config)
    model.init_weights()
    with torch.no_grad():
        model.tok_embeddings.weight[first] = float("nan")  # one token's activations are NaN from layer 0 on
    save_hf_checkpoint(model, tmp_path / "w")
    overrides = {"ops": ops, "policy": "strict"} if ops else {}
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, training={"steps": 2}, overrides=overrides,
                      checkpoint={"initial_load_path": str(tmp_path / "w")})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert code == 3 and "Traceback" not in err, err
    assert "train: step 1: loss nan / grad_norm nan is not finite -- stopping without applying the update" in err


# ------------------------------------------------------------------ a resume names the run it continues
def test_resume_names_the_run_that_wrote_the_checkpoint(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    constant = {"lr_scheduler": {"warmup_steps": 0, "decay_type": "constant"}}  # more steps keep every lr
    first = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=2, job={"name": "first"}, **constant)
    assert main_result(["--config", str(write_config(first, tmp_path / "a.toml"))], capsys)[0] == 0
    step2 = tmp_path / "run" / "checkpoint" / "step-2"
    m = read_manifest(str(step2))
    assert m["run"]["job.name"] == "first" and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", m["run"]["started"])
    second = ckpt_config(tmp_path / "run", tiny_tokenizer, corpus_dir, steps=3, job={"name": "second"}, **constant)
    code, out, err = main_result(["--config", str(write_config(second, tmp_path / "b.toml"))], capsys)
    assert code == 0, err
    assert (f"resumed from {step2} (step 2): saved {m['time']} by job 'first' (run started {m['run']['started']})"
            in out), out
    assert read_manifest(str(tmp_path / "run" / "checkpoint" / "step-3"))["run"]["job.name"] == "second"
