"""Config: TOML + CLI overrides, type checks and clear errors, parallel degrees, shipped configs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from trnkit.harness.config import (ConfigError, ParallelismConfig, TrainerConfig, load_config, parse_args,
                                   resolve_parallel_degrees, to_toml)

from trnkit.harness.models import build_spec

from .helpers import REPO


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_toml_and_cli_overrides(tmp_path: Path) -> None:
    p = _write(tmp_path, '[training]\nsteps = 7\nseq_len = 64\n[model]\nspec = "qwen3:debug"\n'
                         '[overrides]\nops = ["rope_hf"]\npolicy = "fallback"\n')
    cfg = parse_args(["--config", str(p), "--training.steps", "20", "--optimizer.lr=1e-3",
                      "--checkpoint.enable", "true", "--overrides.ops", "rope_hf,moe_experts",
                      "--model.config", '{"n_layers": 2}', "--training.moe_aux_loss_coef", "none"])
    assert cfg.training.steps == 20 and cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.checkpoint.enable is True
    assert cfg.overrides.ops == ["rope_hf", "moe_experts"] and cfg.overrides.policy == "fallback"
    assert cfg.model.config == {"n_layers": 2} and cfg.model.spec == "qwen3:debug"
    assert cfg.training.moe_aux_loss_coef is None
    # untouched fields keep their defaults
    assert cfg.training.local_batch_size == TrainerConfig().training.local_batch_size


def test_one_key_of_model_config_from_the_cli_keeps_the_rest(tmp_path: Path) -> None:
    """``--model.config.<key> value`` sets one key of the config file's table (before, the only command-line form
    was JSON for the whole table, which silently dropped the file's other keys); JSON still replaces it."""
    p = _write(tmp_path, '[model]\nspec = "qwen3:debug"\nconfig = {n_layers = 2, dim = 64}\n')
    cfg = parse_args(["--config", str(p), "--model.config.n_layers", "4", "--model.config.mlp_only_layers", "[0]",
                      "--model.config.hidden_act", "silu"])
    assert cfg.model.config == {"n_layers": 4, "dim": 64, "mlp_only_layers": [0], "hidden_act": "silu"}
    assert parse_args(["--config", str(p), "--model.config", '{"n_layers": 3}']).model.config == {"n_layers": 3}
    for cli, match in ((["--model.config.n_layers", "null"], r"config model\.config\.n_layers: null is not a value"),
                       (["--model.config.a.b", "1"], r"expected <section>\.<field> \(or, for a table field such as "
                                                     r"model\.config, <section>\.<field>\.<key>\)"),
                       (["--training.steps.x", "3"], r"config key 'training\.steps\.x': expected <section>\.<field>")):
        with pytest.raises(ConfigError, match=match):
            parse_args(["--config", str(p), *cli])


@pytest.mark.parametrize("cli, match", [
    (["--overrides.ops", "rope,moe_experts"], r"config overrides \(ops = \['rope', 'moe_experts'\], impl = 'nki'\): "
                                              r"OverrideConfig.ops: unknown op\(s\) \['rope'\]; swappable ops are"),
    (["--overrides.impl", "nkix"], r"impl = 'nkix'\): trnkit overrides: no implementation 'nkix' registered for op "
                                   r"'rope_hf'"),
])
def test_unknown_override_names_stop_the_run_before_it_starts(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                              cli: list[str], match: str) -> None:
    from trnkit.harness.train import main

    rc = main(["--config", str(REPO / "configs" / "debug_moe_nki.toml"), "--job.dump_folder", str(tmp_path), *cli])
    err = capsys.readouterr()
    assert rc == 2
    assert re.search(match, err.err), err.err
    assert "data:" not in err.out  # stopped before the data and the model were built


def test_to_toml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["--training.steps", "3", "--model.config", '{"dim": 64, "mlp_only_layers": [0]}',
                             "--overrides.ops", "rope_hf", "--job.name", 'a "quoted" name'])
    again = load_config(_write(tmp_path, to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("text, cli, match", [
    ("[training]\nstpes = 3\n", [], r"unknown key training\.stpes \(did you mean 'steps'\?\)"),
    ("[trainng]\nsteps = 3\n", [], r"unknown section \[trainng\] \(did you mean 'training'\?\)"),
    ('[training]\nsteps = "ten"\n', [], r"training\.steps: expected an int, got str 'ten'"),
    ("[training]\nsteps = 2.5\n", [], r"training\.steps: expected an int, got float 2\.5"),
    ("", ["--training.steps", "abc"], r"training\.steps: expected an int, got str 'abc'"),
    ("", ["--checkpoint.enable", "maybe"], r"checkpoint\.enable: expected a bool"),
    # command-line numbers and booleans are TOML's, checked as strictly as in a file (pydantic's lax string
    # parsing took 2.0 for 2, and yes / 1 / on for true)
    ("", ["--training.steps", "2.0"], r"^config training\.steps: expected an int, got float 2\.0$"),
    ("", ["--checkpoint.enable", "yes"], r"^config checkpoint\.enable: expected a bool, got str 'yes'$"),
    ("", ["--checkpoint.enable=1"], r"^config checkpoint\.enable: expected a bool, got int 1$"),
    ("", ["--overrides.dry_run", "True"], r"^config overrides\.dry_run: expected a bool, got str 'True'$"),
    ('[training]\ndtype = "float16"\n', [], r"training\.dtype: must be one of \['float32', 'bfloat16'\]"),
    ("", ["--training.steps", "0"], r"training\.steps: must be >= 1, got 0"),
    ("", ["--model.spec", "llama:7b"], r"model\.spec: must be 'qwen3:<flavor>' or 'hf:<path>'"),
    ("", ["--overrides.policy", "strict"], r"overrides\.ops: must name at least one op"),
    ("", ["--overrides.lnc", "3"], r"overrides\.lnc: must be 0 \(detected device\), 1 or 2, got 3"),
    ("", ["--overrides.block_size", "100"],
     r"overrides\.block_size: must be one of \(32, 64, 128, 256, 512\), got 100"),
    ("", ["--lr_scheduler.warmup_steps", "-1"], r"warmup_steps: must be >= 0, got -1"),
    ("", ["--job.dump_folder", ""], r"^config job\.dump_folder: must name a folder \(everything the run writes goes "
     r"there\), got ''$"),
    ("", ["--job.name", "  "], r"^config job\.name: must not be blank \(it names the run in the log, the loss curve "
     r"and the checkpoints' manifests\), got '  '$"),
    ("", ["--overrides.impl", '{"rope_hf": '], r"^config overrides\.impl: expected JSON on the command line"),
    ("[overrides]\nseq_len = 999\n", [], r"^config overrides\.seq_len: is set from training\.seq_len by the trainer "
     r"\(the validation dry run sees the run's own shapes\); leave it out, got 999$"),
    ("", ["--overrides.batch_size", "8"], r"^config overrides\.batch_size: is set from training\.local_batch_size "
     r"by the trainer .*; leave it out, got 8$"),
    ("", ["--training.steps"], r"--training.steps needs a value"),
    ("", ["--parallelism.replicated_init", "false", "--parallelism.tensor_parallel_degree", "2"],
     r"parallelism\.replicated_init: false \(sharded init\) needs tensor_parallel_degree 1"),
    ("", ["training.steps", "3"], r"expected --<section>\.<field> <value>"),
    ("[training]\nsteps = \n", [], r"not valid TOML"),
])
def test_config_errors_are_clear(tmp_path: Path, text: str, cli: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, text), cli)


@pytest.mark.parametrize("cli, match", [
    (["--training.loss_schedule", "once"],
     r"^config training\.loss_schedule: must be one of \['recompute', 'fused'\], got 'once'$"),
    (["--training.loss_schedule", "fused"],  # the default [overrides] swaps nothing
     r"^config training\.loss_schedule: 'fused' is a schedule of the linear_cross_entropy kernel and needs it swapped "
     r"in \(overrides\.ops including 'linear_cross_entropy' and overrides\.policy not 'off'; now ops = \[\], "
     r"policy = 'off'\); without it the chunked torch loss runs, which has one schedule; got 'fused'$"),
    (["--training.loss_schedule", "fused", "--overrides.ops", "rmsnorm", "--overrides.policy", "strict"],
     r"needs it swapped in .*now ops = \['rmsnorm'\], policy = 'strict'\).*got 'fused'$"),
    (["--training.loss_schedule", "fused", "--overrides.ops", "linear_cross_entropy", "--overrides.policy", "strict",
      "--training.loss_chunk_size", "0"],
     r"^config training\.loss_schedule: 'fused' needs the chunked loss \(training\.loss_chunk_size > 0; 0 computes "
     r"full logits and no loss kernel runs\), got 'fused'$"),
    (["--training.loss_schedule", "fused", "--model.spec", "hf:configs/hf/qwen3-moe-debug"],
     r"^config training\.loss_schedule: 'fused' is a schedule of trnkit's linear_cross_entropy kernel, which "
     r"transformers models do not run \(model\.spec 'hf:configs/hf/qwen3-moe-debug' computes full logits and "
     r"F\.cross_entropy outside any module\); use 'recompute', got 'fused'$"),
])
def test_loss_schedule_errors_name_the_key_rule_and_value(cli: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, cli)


def test_loss_schedule_default_and_accepted_values(tmp_path: Path) -> None:
    assert load_config(None, []).training.loss_schedule == "recompute"
    cfg = load_config(_write(tmp_path, '[training]\nloss_schedule = "fused"\n[overrides]\n'
                                       'ops = ["linear_cross_entropy"]\npolicy = "strict"\n'))
    assert cfg.training.loss_schedule == "fused"
    assert load_config(_write(tmp_path, to_toml(cfg))) == cfg  # the resolved config.toml keeps it


@pytest.mark.parametrize("folder", ["/tmp/ckpt", "../ckpt", "ckpt/../../x", "", ".", "   "])
def test_checkpoint_folder_must_stay_inside_the_dump_folder(folder: str) -> None:
    """The run's lock covers its dump folder: a checkpoint folder outside it (or the dump folder itself, which a
    fresh start would have to move into its own previous-<time>/) is refused, naming key, rule and value."""
    with pytest.raises(ConfigError, match=rf"^config checkpoint\.folder: must be a subfolder of job\.dump_folder, "
                                          rf"given relative to it .*, got {re.escape(repr(folder))}$"):
        load_config(None, ["--checkpoint.folder", folder])


@pytest.mark.parametrize("folder", ["config.toml", "metrics.jsonl/x", ".trnkit.lock", "hf_export", "previous-1",
                                    "hf_export.old", "hf_export.tmp/ckpt", "metrics.jsonl.tmp"])
def test_checkpoint_folder_is_none_of_the_runs_own_files(folder: str) -> None:
    """A checkpoint folder named like a run file would be created as a folder where the run writes that file; named
    like one of their temporary copies, the run would delete it (the HF export removes hf_export.old / .tmp)."""
    with pytest.raises(ConfigError, match=rf"^config checkpoint\.folder: must not be a file or folder the run "
                                          rf"itself keeps in job\.dump_folder \(metrics\.jsonl, config\.toml, "
                                          rf".*\.trnkit\.lock, previous-<time>\) nor one of their temporary copies "
                                          rf"\(<name>\.tmp, <name>\.old, \.\.\.: the run deletes those\), "
                                          rf"got {re.escape(repr(folder))}$"):
        load_config(None, ["--checkpoint.folder", folder])


def test_a_log_rank_of_a_digit_int_refuses_is_named() -> None:
    """'²'.isdigit() is true, int('²') a ValueError: it passed the check and ended the run in a traceback."""
    with pytest.raises(ConfigError, match=r"^config metrics\.log_rank: must be 'all' or a rank number, got '\u00b2'$"):
        load_config(None, ["--metrics.log_rank", "\u00b2"])


@pytest.mark.parametrize("key", ["job.dump_folder", "checkpoint.folder", "job.stack", "data.dataset", "job.name"])
def test_a_nul_character_in_a_string_setting_is_refused(tmp_path: Path, key: str) -> None:
    """TOML can write a NUL (\\u0000); in a path the operating system refuses it with a ValueError, which ended the
    run in a traceback (dump folder, checkpoint folder, stack lock)."""
    section, name = key.split(".")
    (tmp_path / "c.toml").write_text(f'[{section}]\n{name} = "a\\u0000b"\n')
    with pytest.raises(ConfigError, match=rf"^config {re.escape(key)}: must not contain a NUL character, "
                                          rf"got 'a\\x00b'$"):
        load_config(tmp_path / "c.toml")


@pytest.mark.parametrize("folder", ["checkpoint", "ckpt/nested", "./ckpt", "a/../ckpt"])
def test_checkpoint_folder_subfolders_are_accepted(folder: str) -> None:
    assert load_config(None, ["--checkpoint.folder", folder]).checkpoint.folder == folder


def test_cli_numbers_and_booleans_read_as_toml() -> None:
    cfg = load_config(None, ["--training.steps", "1_000", "--optimizer.lr", "1", "--training.max_norm", "0.5e1",
                             "--checkpoint.enable=true", "--overrides.dry_run", "none"])
    assert (cfg.training.steps, cfg.optimizer.lr, cfg.training.max_norm) == (1000, 1.0, 5.0)
    assert cfg.checkpoint.enable is True and cfg.overrides.dry_run is None


def test_cli_table_for_a_field_that_is_a_string_or_a_table() -> None:
    """overrides.impl is ``str | dict``: a JSON table on the command line is the per-op table, anything else the
    one name (TOML already types both)."""
    cfg = load_config(None, ["--overrides.ops", "rope_hf,rmsnorm", "--overrides.policy", "strict",
                             "--overrides.impl", '{"rope_hf": "reference"}'])
    assert cfg.overrides.impl == {"rope_hf": "reference"}
    assert load_config(None, ["--overrides.impl", "reference"]).overrides.impl == "reference"


@pytest.mark.parametrize("text, message", [
    # a union's member whose shape the value has: before, 'expected a string, got dict {...}' for a table
    ('impl = {rope_hf = 5}', "config overrides.impl.rope_hf: expected a string, got int 5"),
    ('impl = {rope_hf = ["nki"]}', "config overrides.impl.rope_hf: expected a string, got list ['nki']"),
    ('ops = ["rope_hf", 5]', "config overrides.ops[1]: expected a string, got int 5"),
])
def test_a_wrong_value_inside_a_table_or_list_is_named(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "c.toml").write_text(f"[overrides]\n{text}\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "c.toml")
    assert str(e.value) == message


@pytest.mark.parametrize("key, value, path", [
    ("job.dump_folder", "~/runs/x", "~/runs/x"),  # before: a folder named '~' in the launch directory
    ("data.dataset", "~/corpus", "~/corpus"),
    ("checkpoint.initial_load_path", "~", "~"),
    ("model.spec", "hf:~/models/qwen3", "~/models/qwen3"),
])
def test_a_path_starting_with_a_tilde_is_refused(key: str, value: str, path: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--{key}", value])
    assert str(e.value) == (f"config {key}: trnkit does not expand '~' in a path (a config value is no shell word); "
                            f"write it out, e.g. {os.path.expanduser(path)!r}, got {value!r}")


@pytest.mark.parametrize("section, value, message", [
    ("training", {"steps": "3"}, "config training.steps: expected an int, got str '3'"),  # before: TypeError
    ("training", {"steps": True}, "config training.steps: expected an int, got bool True"),  # before: 1 step
    ("optimizer", {"lr": "1e-3"}, "config optimizer.lr: expected a number, got str '1e-3'"),
    ("checkpoint", {"enable": "false"}, "config checkpoint.enable: expected a bool, got str 'false'"),  # truthy
])
def test_a_config_built_in_python_has_its_types_checked(section: str, value: dict, message: str) -> None:
    import dataclasses

    cfg = TrainerConfig()
    setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **value))
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert str(e.value) == message


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="file not found: /nonexistent.toml"):
        load_config("/nonexistent.toml")


@pytest.mark.parametrize("dp, tp, world, expect", [(-1, 1, 2, (2, 1)), (-1, 2, 2, (1, 2)), (2, 2, 4, (2, 2)),
                                                  (1, 1, 1, (1, 1))])
def test_parallel_degrees(dp: int, tp: int, world: int, expect: tuple[int, int]) -> None:
    p = ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp)
    assert resolve_parallel_degrees(p, world) == expect


def test_parallel_degrees_must_multiply_to_world() -> None:
    with pytest.raises(ConfigError, match=r"data_parallel_shard_degree \(2\) x tensor_parallel_degree \(2\) = 4 "
                                          r"must equal the world size \(2\)"):
        resolve_parallel_degrees(ParallelismConfig(2, 2), 2)
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree 3 does not divide the world size 4"):
        resolve_parallel_degrees(ParallelismConfig(-1, 3), 4)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # hf: paths in the configs are relative to the repository root
    cfg = load_config(path)
    spec = build_spec(cfg)  # the flavor / HF config.json exists and accepts the config's fields
    assert spec.vocab_size == 151936  # every shipped config uses the real Qwen3 tokenizer
    assert cfg.data.tokenizer == "qwen3"


def test_cli_main_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from trnkit.harness.train import main

    assert main(["--training.steps", "0"]) == 2
    assert "error: config training.steps: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m trnkit.harness.train") and "[parallelism]" in out


@pytest.mark.parametrize("model_cfg, match", [
    ('{"n_layerz": 2}', r"model\.config: unknown Qwen3Config field 'n_layerz' \(did you mean 'n_layers'\?\)"),
    ('{"n_heads": 3, "n_kv_heads": 2}', r"model\.config: Qwen3Config: n_heads \(3\) must be a multiple of n_kv_heads"),
])
def test_bad_model_config_is_a_config_error(model_cfg: str, match: str) -> None:
    cfg = load_config(None, ["--model.spec", "qwen3:debug", "--model.config", model_cfg])
    with pytest.raises(ConfigError, match=match):
        build_spec(cfg)


def test_unknown_flavor_and_long_seq() -> None:
    with pytest.raises(ConfigError, match=r"model\.spec: model_registry: unknown Qwen3 flavor 'tiny'"):
        build_spec(load_config(None, ["--model.spec", "qwen3:tiny"]))
    with pytest.raises(ConfigError, match=r"training\.seq_len: 4096 exceeds the model's max_seq_len 2048"):
        build_spec(load_config(None, ["--model.spec", "qwen3:debug", "--training.seq_len", "4096"]))
