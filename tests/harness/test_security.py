"""Nothing runs code from a file, and nothing is read or written outside its folder.

Checkpoints are verified against their manifest before anything in them is parsed, DCP's metadata and
values go through restricted unpicklers, a checkpoint without a valid manifest is refused unless the
user trusts it explicitly, HF index paths and exports stay inside their folders, pruning never follows
a link, and transformers never runs a model folder's code.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trnkit.harness.checkpoint import MANIFEST, list_checkpoints, root_error, verify_checkpoint
from trnkit.harness.dcp_safe import SafeLoadPlanner, SafeReader, UnsafeCheckpointError
from trnkit.harness.train import run

from .helpers import assert_user_error, ckpt_config, main_result, tiny_config, write_config


class _Payload:
    """Unpickling this creates the folder `marker`: what a crafted checkpoint file could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return os.mkdir, (self.marker,)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: str, corpus_dir: Path) -> Path:
    """A finished 3-step run with a checkpoint at every step (kept), as a pristine template to copy."""
    d = tmp_path_factory.mktemp("trained") / "run"
    run(ckpt_config(d, tiny_tokenizer, corpus_dir))
    return d


def _copy(trained: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "run"))


def _set_manifest(step_dir: Path, edit) -> None:
    f = step_dir / MANIFEST
    m = json.loads(f.read_text())
    edit(m)
    f.write_text(json.dumps(m))


# ------------------------------------------------------------------ a crafted .metadata executes nothing
@pytest.mark.parametrize("manifest_too", [False, True], ids=["metadata-only", "manifest-rewritten"])
def test_crafted_metadata_executes_nothing(tmp_path: Path, trained: Path, tiny_tokenizer: str, corpus_dir: Path,
                                           manifest_too: bool, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    with pytest.raises(FileNotFoundError):  # the payload is real: a plain unpickler would run it ...
        pickle.loads(pickle.dumps(_Payload(tmp_path / "no" / "such" / "dir")))
    run_dir = _copy(trained, tmp_path)
    step3 = run_dir / "checkpoint" / "step-3"
    (step3 / ".metadata").write_bytes(payload)
    if manifest_too:  # whoever can write the checkpoint can rewrite its manifest as well
        _set_manifest(step3, lambda m: m["files"].update(
            {".metadata": {"size": len(payload), "crc32": f"{zlib.crc32(payload):08x}"}}))
        why = f"{step3 / '.metadata'} refers to posix.mkdir, which DCP never writes into checkpoint metadata"
    else:
        why = f"{step3 / '.metadata'} is truncated ({len(payload)} bytes"  # refused before it is parsed
    res = run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=3))
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {step3} is not usable: {why}" in out, out
    assert res.start_step == 2 and sorted(res.losses) == [3]  # resumed from the intact step-2
    assert not marker.exists()


def test_crafted_value_in_a_data_file_executes_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dcp.save({"x": _Payload(marker), "w": torch.ones(3)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert not marker.exists()
    state = {"x": None, "w": torch.zeros(3)}
    with pytest.raises(BaseException) as e:  # noqa: PT011 - DCP wraps the rank's error in a BaseException
        dcp.load(state, storage_reader=SafeReader(str(tmp_path / "ck")), planner=SafeLoadPlanner(), no_dist=True)
    err = root_error(e.value)
    assert isinstance(err, UnsafeCheckpointError) and "the value 'x' is not plain data" in str(err), err
    assert not marker.exists()
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)  # DCP's own planner runs it
    assert marker.is_dir()


# ------------------------------------------------------------------ no manifest, no load
def _drop_manifest(d: Path) -> None:
    (d / MANIFEST).unlink()


def _empty_file_list(d: Path) -> None:
    _set_manifest(d, lambda m: m.update(files={}))


def _no_metadata_record(d: Path) -> None:
    _set_manifest(d, lambda m: m["files"].pop(".metadata"))


def _outside_name(d: Path) -> None:
    _set_manifest(d, lambda m: m["files"].update({"../../outside.bin": {"size": 1}}))


def _identity_a_string(d: Path) -> None:
    _set_manifest(d, lambda m: m.update(identity="x"))


def _params_a_list(d: Path) -> None:
    _set_manifest(d, lambda m: m["identity"].update(params=[1]))


def _manifest_not_an_object(d: Path) -> None:
    (d / MANIFEST).write_text("null")


@pytest.mark.parametrize("damage, why", [
    (_drop_manifest, "it has no manifest trnkit.json, so its files cannot be verified"),
    (_identity_a_string, "step-3/trnkit.json is unreadable (ValueError: its identity must be a JSON object, "
                         "got str 'x')"),
    (_params_a_list, "step-3/trnkit.json is unreadable (ValueError: its identity.params must be a JSON object, "
                     "got list '[1]')"),
    (_manifest_not_an_object, "step-3/trnkit.json is unreadable (ValueError: not a JSON object but NoneType 'None')"),
    (_empty_file_list, "step-3/trnkit.json lists no files, so nothing can be verified"),
    (_no_metadata_record, "step-3/trnkit.json does not list .metadata"),
    (_outside_name, "step-3/trnkit.json lists the file '../../outside.bin', which is outside the checkpoint folder"),
], ids=["no-manifest", "identity-a-string", "params-a-list", "manifest-null", "empty-file-list", "no-metadata-record",
        "outside-name"])
def test_unverifiable_checkpoint_is_refused(tmp_path: Path, trained: Path, tiny_tokenizer: str, corpus_dir: Path,
                                            damage, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _copy(trained, tmp_path)
    folder = run_dir / "checkpoint"
    for step in (1, 2, 3):
        damage(folder / f"step-{step}")
    # a corrupted data file that the manifest would have caught, so an unverified load is a real risk
    f = sorted((folder / "step-3").glob("*.distcp"))[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    cfg = ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4)
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"checkpoint: no usable checkpoint in {folder}", "step-3: ", why,
                      "(--checkpoint.trust_unverified true loads it unverified)")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing written or moved


def test_a_manifest_nested_too_deeply_is_an_unusable_checkpoint(tmp_path: Path, trained: Path) -> None:
    """json.load of a manifest nested 100,000 arrays deep raises RecursionError, which ended the run in a traceback
    instead of skipping the checkpoint for the next older one."""
    step3 = _copy(trained, tmp_path) / "checkpoint" / "step-3"
    (step3 / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    assert verify_checkpoint(str(step3)) == (f"{step3 / MANIFEST} is unreadable (ValueError: its JSON is nested "
                                             "too deeply to parse) (--checkpoint.trust_unverified true loads it "
                                             "unverified)")


def test_a_renamed_checkpoint_folder_is_not_resumed_under_its_name(tmp_path: Path, trained: Path) -> None:
    """step-3 renamed step-9 was the newest checkpoint by its name: a resume trained on from step 3 while checking
    the learning-rate schedule from step 9, and kept resuming from it after saving steps 4 to 8."""
    folder = _copy(trained, tmp_path) / "checkpoint"
    (folder / "step-3").rename(folder / "step-9")
    assert verify_checkpoint(str(folder / "step-9")) == (f"{folder / 'step-9' / MANIFEST} records step 3, not 9 "
                                                         "(a renamed folder)")


def test_trust_unverified_loads_a_checkpoint_without_manifest(tmp_path: Path, trained: Path, tiny_tokenizer: str,
                                                              corpus_dir: Path) -> None:
    run_dir = _copy(trained, tmp_path)
    step3 = run_dir / "checkpoint" / "step-3"
    _drop_manifest(step3)
    assert "no manifest" in verify_checkpoint(str(step3))
    assert verify_checkpoint(str(step3), trust_unverified=True) is None
    reference = run(ckpt_config(tmp_path / "ref", tiny_tokenizer, corpus_dir, steps=4, checkpoint={"interval": 100}))
    res = run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=4,
                          checkpoint={"trust_unverified": True, "reschedule": True}))
    assert res.start_step == 3 and res.losses[4] == reference.losses[4]  # the exact state was restored


# ------------------------------------------------------------------ exports and pruning stay in the run folder
def test_symlinked_export_folder_is_refused_up_front(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model-00001-of-00002.safetensors").write_bytes(b"someone else's file")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "hf_export").symlink_to(outside)
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, checkpoint={"export_hf": True})
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"checkpoint.export_hf: {tmp_path / 'run' / 'hf_export'} is a symbolic link "
                                 f"(to {outside})", "remove the link")
    assert "step: " not in out  # refused before training
    assert [p.name for p in outside.iterdir()] == ["model-00001-of-00002.safetensors"]


def test_pruning_never_follows_a_link(tmp_path: Path, trained: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    run_dir = _copy(trained, tmp_path)
    outside = tmp_path / "outside-step-1"
    shutil.move(run_dir / "checkpoint" / "step-1", outside)  # this run's own checkpoint, same fingerprint
    (run_dir / "checkpoint" / "step-1").symlink_to(outside)
    run(ckpt_config(run_dir, tiny_tokenizer, corpus_dir, steps=5, keep=1, checkpoint={"reschedule": True}))
    assert [s for s, _ in list_checkpoints(str(run_dir / "checkpoint"))] == [1, 5]  # the link is left alone
    assert verify_checkpoint(str(outside)) is None and (run_dir / "checkpoint" / "step-1").is_symlink()


# ------------------------------------------------------------------ transformers never runs a folder's code
def test_hf_model_with_custom_code_is_refused(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "pwned"
    (folder / "config.json").write_text(json.dumps({"model_type": "evil_model", "auto_map": {
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}}))
    (folder / "configuration_evil.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, model={"spec": f"hf:{folder}", "config": {}})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"model.spec: transformers cannot read the config of hf:{folder}",
                      "contains custom code which must be executed")
    assert not marker.exists()


def test_hf_folder_pickle_weights_are_never_read(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.hf_pretrained`` reads safetensors only: a folder whose weights are a pickle (pytorch_model.bin,
    here a valid state dict next to an unrelated .safetensors file) is refused, and nothing is unpickled."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    hf_cfg = transformers.Qwen3Config(vocab_size=384, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                      max_position_embeddings=64)
    hf_cfg.save_pretrained(folder)
    torch.save(transformers.Qwen3ForCausalLM(hf_cfg).state_dict(), folder / "pytorch_model.bin")
    save_file({"unrelated": torch.zeros(2)}, str(folder / "extra.safetensors"))

    def no_unpickling(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"torch.load called on {args[0]!r}")

    monkeypatch.setattr(torch, "load", no_unpickling)
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir,
                      model={"spec": f"hf:{folder}", "config": {}, "hf_pretrained": True})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"checkpoint.initial_load_path: transformers cannot load {folder}")
    assert not (tmp_path / "run").exists()
