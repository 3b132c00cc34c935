"""Pinned stacks: every run writes stack.lock; ``[job] stack`` refuses to start when the installed stack differs."""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

import pytest
import torch

from trnkit import envinfo
from trnkit.errors import ConfigError
from trnkit.harness.config import load_toml
from trnkit.harness.train import run

from .helpers import run_cli, tiny_config, write_config


def test_run_writes_its_stack_and_a_run_checked_against_it_starts(tmp_path: Path, tiny_tokenizer: str,
                                                                  corpus_dir: Path) -> None:
    first = tmp_path / "first"
    run(tiny_config(first, tiny_tokenizer, corpus_dir, training={"steps": 1}))
    lock = load_toml(first / "stack.lock")["stack"]
    assert lock["torch"] == torch.__version__ and lock["python"] == platform.python_version()
    assert lock["transformers"] == importlib.metadata.version("transformers")
    assert lock["nki"] == "not installed" and set(lock) == set(envinfo.LOCK_COMPONENTS)
    # the lock a run wrote is accepted by the next run
    second = run(tiny_config(tmp_path / "second", tiny_tokenizer, corpus_dir, training={"steps": 1},
                             job={"stack": str(first / "stack.lock")}))
    assert second.final_step == 1


def test_changed_versions_stop_the_run_naming_each(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    stack = envinfo.current_stack()
    stack["torch"] = "2.12.0+cpu"
    stack["nki"] = "0.6.0"
    lock = tmp_path / "stack.lock"
    lock.write_text(envinfo.lock_text(stack))
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, job={"stack": str(lock)})
    with pytest.raises(ConfigError) as exc:
        run(cfg)
    msg = str(exc.value)
    assert f"torch: locked 2.12.0+cpu, installed {torch.__version__}" in msg
    assert "nki: locked 0.6.0, installed not installed" in msg and "in 2 components" in msg
    assert "transformers" not in msg  # only the differences
    assert not (tmp_path / "run").exists()  # refused before anything was written

    r = run_cli(["--config", str(write_config(cfg, tmp_path / "c.toml"))], timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"torch: locked 2.12.0+cpu, installed {torch.__version__}" in r.stderr


def test_bad_lock_files_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.lock").write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"job.stack: .*empty.lock has no \[stack\] table"):
        envinfo.check_stack(tmp_path / "empty.lock")
    with pytest.raises(ConfigError, match=rf"^job\.stack: file not found: {tmp_path / 'missing.lock'}$"):
        envinfo.check_stack(tmp_path / "missing.lock")
    (tmp_path / "bad.lock").write_text("[stack\n")
    with pytest.raises(ConfigError, match=rf"^job\.stack: {tmp_path / 'bad.lock'} is not valid TOML"):
        envinfo.check_stack(tmp_path / "bad.lock")
    # before: named --config, a setting the user had not used for it ("--config <lock> is a folder; ...")
    (tmp_path / "folder.lock").mkdir()
    with pytest.raises(ConfigError) as e:
        envinfo.check_stack(tmp_path / "folder.lock")
    assert str(e.value) == f"job.stack: {tmp_path / 'folder.lock'} is a folder; pass a TOML file"
    (tmp_path / "latin1.lock").write_bytes(b"[stack]\ntorch = \"caf\xe9\"\n")
    with pytest.raises(ConfigError) as e:
        envinfo.check_stack(tmp_path / "latin1.lock")
    assert str(e.value) == (f"job.stack: {tmp_path / 'latin1.lock'} is not UTF-8 text (byte 0xe9 at offset 20); a TOML "
                            "file is UTF-8 text")


def test_stack_differences_lists_components_missing_from_this_install() -> None:
    assert envinfo.stack_differences({"torch": "2.13.0", "newpkg": "1.0"}, {"torch": "2.13.0"}) == \
        ["newpkg: locked 1.0, installed not installed"]
    assert envinfo.stack_differences({"torch": "2.13.0"}, {"torch": "2.13.0", "extra": "1"}) == []
