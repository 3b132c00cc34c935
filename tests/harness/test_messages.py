"""Every bad input ends in one message naming the key, the rule and the value (exit 2), before anything
is written: config values checked against the typed schema (ranges, finite floats, seeds, booleans,
layer indices), the model config, --config itself, dataset entries file by file, log_rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trnkit.harness.config import ConfigError
from trnkit.harness.data import read_documents

from .helpers import REPO, assert_user_error, main_result, tiny_config, write_config


def _refused(tmp_path: Path, tiny_tokenizer: str, corpus: Path, capsys: pytest.CaptureFixture[str],
             cli: list[str], *fragments: str, **sections: dict) -> None:
    """The run is refused with `fragments` in its message, and its dump folder never appears."""
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus, **sections)
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml")), *cli], capsys)
    assert_user_error(code, err, *fragments)
    assert "step: " not in out and not (tmp_path / "run").exists()


@pytest.mark.parametrize("cli, message", [
    (["--optimizer.eps", "-1"], "config optimizer.eps: must be > 0 (AdamW divides by sqrt(v) + eps), got -1.0"),
    (["--optimizer.eps", "nan"], "config optimizer.eps: must be a finite number, got nan"),
    (["--optimizer.lr", "inf"], "config optimizer.lr: must be a finite number, got inf"),
    (["--training.max_norm", "nan"], "config training.max_norm: must be a finite number, got nan"),
    (["--lr_scheduler.min_lr_factor", "-inf"], "config lr_scheduler.min_lr_factor: must be a finite number, got -inf"),
    (["--job.seed", str(2**70)], f"config job.seed: must be in [0, 2**63 - 1] (torch and numpy seeds), got {2**70}"),
    (["--job.seed", "-5"], "config job.seed: must be in [0, 2**63 - 1] (torch and numpy seeds), got -5"),
    (["--metrics.log_rank", "3"], "config metrics.log_rank: must be 'all' or a rank in [0, 0] (world size 1), got '3'"),
    (["--model.config", '{"n_layers": 2.5}'], "config model.config.n_layers: expected an int, got float 2.5"),
    (["--model.config", '{"dim": true}'], "config model.config.dim: expected an int, got bool True"),
    (["--model.config", '{"rope_theta": "abc"}'], "config model.config.rope_theta: expected a number, got str 'abc'"),
    (["--model.config", '{"tie_word_embeddings": "yes"}'],
     "config model.config.tie_word_embeddings: expected a bool, got str 'yes'"),
    (["--model.config", '{"mlp_only_layers": [99]}'],
     "model.config: Qwen3Config: mlp_only_layers: layer indices must be in [0, n_layers - 1 = 1]; out of range: [99]"),
    (["--model.config", '{"rope_theta": 0}'], "model.config: Qwen3Config: rope_theta must be a finite number > 0 "
                                             "(the RoPE base), got 0.0"),
    (["--model.config", '{"norm_eps": -1}'], "model.config: Qwen3Config: norm_eps must be a finite number > 0 "
                                            "(RMSNorm divides by sqrt(mean(x^2) + eps)), got -1.0"),
], ids=["eps-negative", "eps-nan", "lr-inf", "max_norm-nan", "min_lr-inf", "seed-huge", "seed-negative",
        "log_rank-beyond-world", "n_layers-float", "dim-bool", "rope_theta-str", "tie-str", "mlp_only_layers-99",
        "rope_theta-0", "norm_eps-negative"])
def test_bad_values_are_refused_naming_key_rule_and_value(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                          capsys: pytest.CaptureFixture[str], cli: list[str],
                                                          message: str) -> None:
    if cli[0] == "--model.config":  # on top of the tiny model's sizes
        from .helpers import TINY_MOE
        cli = [cli[0], json.dumps({**TINY_MOE, **json.loads(cli[1])})]
    _refused(tmp_path, tiny_tokenizer, corpus_dir, capsys, cli, message)


@pytest.mark.parametrize("model, checkpoint, message", [
    ({}, {}, "config model.hf_pretrained: true loads the published weights of the model's folder (an hf: model.spec); "
             "model.spec 'qwen3:debug-moe' has none, so the run would start from random weights"),
    ({"spec": "hf:configs/hf/qwen3-moe-debug", "config": {}}, {"initial_load_path": "elsewhere"},
     "config model.hf_pretrained: true loads the weights of "),
], ids=["native-model", "with-initial_load_path"])
def test_hf_pretrained_where_it_loads_nothing_or_beside_other_weights(tmp_path: Path, tiny_tokenizer: str,
                                                                      corpus_dir: Path,
                                                                      capsys: pytest.CaptureFixture[str], model: dict,
                                                                      checkpoint: dict, message: str) -> None:
    """model.hf_pretrained = true on a native model was ignored: the run started from random weights, and its step-1
    note said that is as expected. Beside checkpoint.initial_load_path, the latter won silently."""
    _refused(tmp_path, tiny_tokenizer, corpus_dir, capsys, [], message,
             model={"hf_pretrained": True, **model}, checkpoint=checkpoint)


def test_hf_pretrained_on_a_folder_without_weights_names_its_key(tmp_path: Path, tiny_tokenizer: str,
                                                                 corpus_dir: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """model.hf_pretrained on an hf: folder holding only config.json was refused naming checkpoint.initial_load_path,
    a key the user had not set."""
    _refused(tmp_path, tiny_tokenizer, corpus_dir, capsys, [],
             "config model.hf_pretrained: true loads the weights of the model's folder 'configs/hf/qwen3-moe-debug', "
             "which holds no *.safetensors (set it false to start from random weights); got true",
             model={"spec": "hf:configs/hf/qwen3-moe-debug", "config": {}, "hf_pretrained": True})


@pytest.mark.parametrize("make, checkpoint, message", [
    (lambda t: None, {"initial_load_path": "{t}/gone"},
     "checkpoint.initial_load_path: must be an HF checkpoint folder (config.json and *.safetensors); no such folder, "
     "got '{t}/gone'"),
    (lambda t: (t / "weights.safetensors").touch(), {"initial_load_path": "{t}/weights.safetensors"},
     "checkpoint.initial_load_path: must be an HF checkpoint folder (config.json and *.safetensors); a file, not a "
     "folder, got '{t}/weights.safetensors'"),
    (lambda t: (t / "run").mkdir() or (t / "run" / "ckpt").touch(), {"enable": True, "folder": "ckpt"},
     "checkpoint.folder: {t}/run/ckpt is a file, not a folder; move it away or set checkpoint.folder to another "
     "folder"),
    (lambda t: (t / "run").mkdir() or (t / "run" / "disk").touch(), {"enable": True, "folder": "disk/ckpt"},
     "checkpoint.folder: {t}/run/disk is a file, not a folder (it would hold {t}/run/disk/ckpt); move it away"),
], ids=["initial-gone", "initial-a-file", "folder-a-file", "folder-under-a-file"])
def test_checkpoint_paths_are_checked_before_the_data_is_read(tmp_path: Path, tiny_tokenizer: str,
                                                              capsys: pytest.CaptureFixture[str], make,
                                                              checkpoint: dict, message: str) -> None:
    """Initial weights that are not an HF folder, and a checkpoint folder that a file blocks, were refused only after
    the corpus was tokenized and the model built (the checkpoint folder: as a FileExistsError); now before the data
    is read (here a dataset that does not exist would be refused next), naming the key, the rule and the value."""
    make(tmp_path)
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, tmp_path / "no-corpus",
                      checkpoint={k: v.format(t=tmp_path) if isinstance(v, str) else v for k, v in checkpoint.items()})
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, message.format(t=tmp_path))
    assert "data:" not in out


def test_toml_inf_and_nan_are_refused(tmp_path: Path) -> None:
    from trnkit.harness.config import load_config

    (tmp_path / "c.toml").write_text("[optimizer]\nlr = inf\n")
    with pytest.raises(ConfigError, match=r"config optimizer.lr: must be a finite number, got inf"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text("[training]\nmoe_aux_loss_coef = nan\n")
    with pytest.raises(ConfigError, match=r"config training.moe_aux_loss_coef: must be a finite number, got nan"):
        load_config(tmp_path / "c.toml")


@pytest.mark.parametrize("kind, message", [
    ("folder", "is a folder; pass a TOML file"),
    ("binary", "is not UTF-8 text (byte 0x80 at offset 0); a TOML file is UTF-8 text"),
    ("latin1", "is not UTF-8 text (byte 0xe9 at offset 17); a TOML file is UTF-8 text"),
])
def test_config_file_that_is_not_a_toml_text(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str,
                                             message: str) -> None:
    path = tmp_path / "c.toml"
    if kind == "folder":
        path.mkdir()
    else:
        latin1 = '[job]\nname = "caf\u00e9"\n'.encode("latin-1")
        path.write_bytes(bytes(range(128, 256)) if kind == "binary" else latin1)
    code, _, err = main_result(["--config", str(path)], capsys)
    assert_user_error(code, err, f"config: --config {path} {message}")


def test_hf_model_seq_len_beyond_max_position_embeddings(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = REPO / "configs" / "hf" / "qwen3-moe-debug"
    _refused(tmp_path, tiny_tokenizer, corpus_dir, capsys, ["--training.seq_len", "4096"],
             f"training.seq_len: 4096 exceeds the model's max_position_embeddings 2048 (hf:{folder}/config.json)",
             model={"spec": f"hf:{folder}", "config": {}})


@pytest.mark.parametrize("override, message", [
    ({"tie_word_embeddings": "yes"}, "config model.config.tie_word_embeddings: expected a bool, got str 'yes'"),
    ({"num_hidden_layers": 2.5}, "config model.config.num_hidden_layers: expected an int, got float 2.5"),
    ({"mlp_only_layers": [0, 7]}, "model.config.mlp_only_layers: layer indices must be in [0, num_hidden_layers - 1 "
                                  "= 3]; out of range: [7]"),
])
def test_hf_model_config_values_are_typed(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                          capsys: pytest.CaptureFixture[str], override: dict, message: str) -> None:
    folder = REPO / "configs" / "hf" / "qwen3-moe-debug"
    _refused(tmp_path, tiny_tokenizer, corpus_dir, capsys, [], message, model={"spec": f"hf:{folder}",
                                                                              "config": override})


# ------------------------------------------------------------------ dataset entries, file by file
def _folder_entry(d: Path) -> tuple[str, str]:
    (d / "a.txt").write_text("fine")
    (d / "b.txt").mkdir()
    return str(d / "*.txt"), f"data.dataset: {d / 'b.txt'} is a folder; data entries must be"


def _dangling(d: Path) -> tuple[str, str]:
    (d / "a.txt").write_text("fine")
    (d / "gone.txt").symlink_to(d / "deleted.txt")
    return str(d), f"data.dataset: {d / 'gone.txt'} is a dangling symbolic link (to {d / 'deleted.txt'})"


def _cycle(d: Path) -> tuple[str, str]:
    (d / "a.txt").write_text("fine")
    (d / "loop").symlink_to(d)
    return str(d), f"data.dataset: {d / 'loop'} is {d} again (a symbolic link to an enclosing folder: a cycle)"


def _jsonl(value: str, kind: str):
    def make(d: Path) -> tuple[str, str]:
        (d / "a.jsonl").write_text('{"text": "fine"}\n{"text": ' + value + "}\n")
        return str(d), f"data.text_field: {d / 'a.jsonl'}:2 field 'text' is {kind} ({json.loads(value)}), not a string"
    return make


@pytest.mark.parametrize("make", [_folder_entry, _dangling, _cycle, _jsonl("null", "null"),
                                  _jsonl("3", "a number"), _jsonl("[1, 2]", "a list")],
                         ids=["folder", "dangling-link", "cycle", "text-null", "text-number", "text-list"])
def test_dataset_entries_are_checked_file_by_file(tmp_path: Path, make) -> None:
    (tmp_path / "data").mkdir()
    dataset, message = make(tmp_path / "data")
    with pytest.raises(ConfigError) as e:
        read_documents(dataset)
    assert message in str(e.value), str(e.value)


def test_dataset_entry_error_through_the_cli(tmp_path: Path, tiny_tokenizer: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "data").mkdir()
    dataset, message = _cycle(tmp_path / "data")
    _refused(tmp_path, tiny_tokenizer, Path(dataset), capsys, [], message)


def test_recursive_glob_through_a_cycle_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("one")
    (tmp_path / "data" / "loop").symlink_to(tmp_path / "data")
    with pytest.raises(ConfigError, match=r"data\.dataset: .*/loop/a\.txt is the file .*/data/a\.txt again \(through "
                                          r"a symbolic link\)"):
        read_documents(str(tmp_path / "data" / "**" / "*.txt"))


def test_a_second_way_into_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data" / "x").mkdir(parents=True)
    (tmp_path / "data" / "x" / "a.txt").write_text("one")
    (tmp_path / "data" / "y").symlink_to(tmp_path / "data" / "x")
    with pytest.raises(ConfigError, match=r"y is .*/x again \(a symbolic link to a folder read already\)"):
        read_documents(str(tmp_path / "data"))
    os.remove(tmp_path / "data" / "y")
    assert read_documents(str(tmp_path / "data")) == ["one"]


def test_missing_validation_dataset_names_its_own_key(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-val"
    _refused(tmp_path, tiny_tokenizer, corpus_dir, capsys, [],
             f"validation.dataset: no .txt/.md/.jsonl/.parquet files found for {str(missing)!r}",
             validation={"enabled": True, "dataset": str(missing)})


@pytest.mark.parametrize("key", ["data.dataset", "validation.dataset"])
def test_a_dataset_holding_the_run_folder_is_refused(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                     capsys: pytest.CaptureFixture[str], key: str) -> None:
    """A dataset folder holding job.dump_folder (e.g. dataset '.' and the default dump folder 'outputs/trnkit'):
    the first run trained, its metrics.jsonl then became part of the corpus, and the resume was refused naming
    data.text_field ('metrics.jsonl:1 has no field 'text''). Now the first run is refused, naming both keys."""
    import shutil

    data = Path(shutil.copytree(corpus_dir, tmp_path / "data"))
    dump = data / "run"
    sections = ({"data": {"dataset": str(data)}} if key == "data.dataset" else
                {"validation": {"enabled": True, "dataset": str(data)}})
    cfg = tiny_config(dump, tiny_tokenizer, corpus_dir, **sections)
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, f"{key}: {str(data)!r} holds the run folder (job.dump_folder {str(dump)!r}): the "
                                 "files the run writes there (metrics.jsonl, ...) would become its data")
    assert not dump.exists()


def test_ops_under_policy_off_are_named_as_unused(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``overrides.policy`` defaults to "off": a run that names ops without a policy trains on the torch code and
    says that those ops were not swapped."""
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, overrides={"ops": ["rope_hf"]},
                      training={"steps": 1})
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert code == 0, err
    assert ("overrides: policy 'off' swaps nothing; overrides.ops ['rope_hf'] unused (overrides.policy = 'strict' "
            "or 'fallback' swaps them)") in out + err


def test_validation_keys_without_enabled_are_named_as_unused(tmp_path: Path, tiny_tokenizer: str,
                                                             corpus_dir: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """``validation.enabled`` defaults to false: a run that sets only validation.dataset (or freq, steps,
    split_fraction) evaluates nothing and says which keys it did not use."""
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, validation={"dataset": str(corpus_dir), "freq": 2},
                      training={"steps": 1})
    code, out, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert code == 0, err
    assert (f"validation: validation.enabled is false; validation.freq = 2, validation.dataset = {str(corpus_dir)!r} "
            "unused (validation.enabled = true evaluates)") in out + err


def test_a_config_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    """Some editors save UTF-8 with a byte-order mark, which tomllib refuses at line 1, column 1: it is read as
    the same config."""
    from trnkit.packaged import load_toml

    text = '[job]\nname = "caf\u00e9"\n\n[training]\nsteps = 3\n'
    plain, marked = tmp_path / "plain.toml", tmp_path / "marked.toml"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_toml(marked) == load_toml(plain) == {"job": {"name": "caf\u00e9"}, "training": {"steps": 3}}
