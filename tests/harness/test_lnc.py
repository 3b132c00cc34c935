"""The run's LNC: resolved once at start-up (overrides.lnc, else TRNKIT_LNC, else the detected device), logged
with its source and passed to the kernels as an argument; a bad TRNKIT_LNC is refused naming the variable."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trnkit.errors import ConfigError
from trnkit.harness.lnc import resolve_run_lnc
from trnkit.harness.train import run
from trnkit.kernels import lnc as lnc_mod

from .helpers import assert_user_error, main_result, tiny_config, write_config


def test_each_source_in_order() -> None:
    assert resolve_run_lnc(2, {"TRNKIT_LNC": "1"}) == (2, "overrides.lnc")  # the config wins over the env
    assert resolve_run_lnc(1, {}) == (1, "overrides.lnc")
    assert resolve_run_lnc(0, {"TRNKIT_LNC": " 2 "}) == (2, "environment variable TRNKIT_LNC (overrides.lnc = 0)")
    assert resolve_run_lnc(None, {"TRNKIT_LNC": "1"})[0] == 1
    lnc, source = resolve_run_lnc(0, {"TRNKIT_LNC": ""})  # set but empty: unset
    assert lnc == lnc_mod.detected_lnc() == 1  # the interpreter runs one core per program
    assert source.startswith("detected device: the NKI interpreter") and "TRNKIT_LNC unset" in source


@pytest.mark.parametrize("value", ["3", "0", "two", "-1", "2.0"])
def test_a_bad_environment_value_names_variable_rule_and_value(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_run_lnc(0, {"TRNKIT_LNC": value})
    assert str(e.value) == (f"environment variable TRNKIT_LNC: must be one of (1, 2) (physical cores per kernel "
                            f"launch; read because overrides.lnc = 0), got {value!r}; unset it or set overrides.lnc "
                            "to 1 or 2")
    assert resolve_run_lnc(2, {"TRNKIT_LNC": value}) == (2, "overrides.lnc")  # not read when the config sets it


def _spy_experts_lnc(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The ``lnc`` each moe_experts call receives; the kernels' own environment default made to fail, so a
    kernel that still resolved lnc=None itself (reading TRNKIT_LNC during the run) fails the test."""
    from trnkit.overrides import ops

    seen: list[object] = []
    real = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a, **kw: seen.append(kw.get("lnc")) or real(*a, **kw))

    def no_env_reads() -> int:
        raise AssertionError("a kernel resolved lnc=None during the run")

    monkeypatch.setattr(lnc_mod, "default_lnc", no_env_reads)
    return seen


@pytest.mark.parametrize("configured, env, expected, source", [
    (0, "2", 2, "per launch, from environment variable TRNKIT_LNC (overrides.lnc = 0)"),
    (0, None, 1, "per launch, from detected device: the NKI interpreter"),
    (1, "2", 1, "per launch, from overrides.lnc"),
])
def test_the_trainer_passes_the_resolved_lnc_to_the_kernels(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture, configured: int,
                                                             env: str | None, expected: int, source: str) -> None:
    if env is None:
        monkeypatch.delenv("TRNKIT_LNC", raising=False)
    else:
        monkeypatch.setenv("TRNKIT_LNC", env)
    seen = _spy_experts_lnc(monkeypatch)
    caplog.set_level(logging.INFO, logger="trnkit.harness")
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir, training={"steps": 1},
                      overrides={"ops": ["moe_experts"], "policy": "strict", "lnc": configured})
    assert run(cfg).final_step == 1
    assert seen and set(seen) == {expected}, seen  # validation dry run and the training step alike
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: lnc")]
    assert len(lines) == 1 and lines[0].startswith(f"kernels: lnc {expected} physical core") and source in lines[0]
    depth = [lines[0][:i].count("(") - lines[0][:i].count(")") for i in range(len(lines[0]) + 1)]
    assert max(depth) <= 1 and depth[-1] == 0, lines[0]  # no parentheses inside parentheses
    assert f"\nlnc = {configured}\n" in (tmp_path / "config.toml").read_text()  # the config as the user wrote it


def test_a_bad_trnkit_lnc_stops_the_cli_before_anything_is_written(tmp_path: Path, tiny_tokenizer: str,
                                                                  corpus_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("TRNKIT_LNC", "4")
    dump = tmp_path / "run"
    cfg = tiny_config(dump, tiny_tokenizer, corpus_dir, overrides={"ops": ["moe_experts"], "policy": "strict"})
    code, _, err = main_result(["--config", str(write_config(cfg, tmp_path / "c.toml"))], capsys)
    assert_user_error(code, err, "environment variable TRNKIT_LNC: must be one of (1, 2)", "got '4'")
    assert not dump.exists() or not any(dump.iterdir())
    # without kernels the variable is not read
    off = tiny_config(tmp_path / "off", tiny_tokenizer, corpus_dir, training={"steps": 1})
    assert run(off).final_step == 1
