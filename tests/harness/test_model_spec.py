"""The ModelSpec protocol: both shipped families implement it, and a new family is one module, named by its
module path in the config (or by a short name, its line in ``trnkit.harness.families.FAMILIES``) -- the trainer
trains, checkpoints, resumes and exports it without knowing what it is."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trnkit.harness import families
from trnkit.harness.config import ConfigError, load_config
from trnkit.harness.models import build_spec
from trnkit.harness.train import run
from trnkit.model_spec import ModelSpec, StateDictAdapter

from . import bigram_family
from .helpers import REPO, tiny_config


@pytest.mark.parametrize("spec", ["qwen3:debug-moe", "hf:configs/hf/qwen3-moe-debug"])
def test_shipped_families_implement_the_protocol(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    s = build_spec(load_config(None, ["--model.spec", spec]))
    assert isinstance(s, ModelSpec) and isinstance(s.state_dict_adapter, StateDictAdapter)
    assert s.name == spec and s.vocab_size == 151936 and s.is_moe
    assert (s.shape.n_layers, s.shape.num_experts, s.shape.top_k, s.aux_coef) == (4, 8, 2, 0.001)


def test_unknown_family_names_the_known_forms() -> None:
    with pytest.raises(ConfigError, match=r"model\.spec: must be 'qwen3:<flavor>' or 'hf:<path>', got 'llama:7b'"):
        load_config(None, ["--model.spec", "llama:7b"])


@pytest.fixture()
def bigram(monkeypatch: pytest.MonkeyPatch) -> None:
    # a short name for the family: its line in the table (its module here is a test module)
    monkeypatch.setitem(families.FAMILIES, "bigram", (bigram_family.__name__, "<hidden size>"))


def test_a_new_family_trains_resumes_and_exports(bigram: None, tmp_path: Path, tiny_tokenizer: str,
                                                 corpus_dir: Path) -> None:
    def cfg(dump: Path, steps: int):
        return tiny_config(dump, tiny_tokenizer, corpus_dir, model={"spec": "bigram:32", "config": {"vocab": 384}},
                           training={"steps": steps}, optimizer={"lr": 1e-1}, lr_scheduler={"decay_type": "constant"},
                           checkpoint={"enable": True, "interval": 3, "export_hf": True})

    full = run(cfg(tmp_path / "full", 6))
    losses = [full.losses[s] for s in range(1, 7)]
    assert abs(losses[0] - math.log(384)) < 0.05  # std 0.02 init: ~ln(vocab)
    assert losses[-1] < losses[0] - 0.5
    # the export holds the trained weights, written by the family's own adapter
    exported = load_file(str(tmp_path / "full" / "hf_export" / "model.safetensors"))
    trained = full.model.state_dict()
    assert set(exported) == set(trained)
    for k, v in exported.items():
        torch.testing.assert_close(v.float(), trained[k].to(torch.bfloat16).float(), rtol=0, atol=0)

    # 3 steps, then a resume to 6: the same losses as the uninterrupted run
    part = tmp_path / "part"
    first = run(cfg(part, 3))
    resumed = run(cfg(part, 6))
    assert resumed.start_step == 3
    assert {**first.losses, **resumed.losses} == full.losses


def test_a_new_family_s_errors_reach_the_user(bigram: None, tmp_path: Path, tiny_tokenizer: str,
                                              corpus_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.spec: bigram:<hidden size> needs a number, got 'x'"):
        run(tiny_config(tmp_path, tiny_tokenizer, corpus_dir, model={"spec": "bigram:x", "config": {}}))


def test_a_family_of_your_own_is_named_by_its_module_path(tmp_path: Path, tiny_tokenizer: str,
                                                         corpus_dir: Path) -> None:
    """No change to trnkit: ``model.spec = "<package.module>:<argument>"`` builds the family that module offers."""
    spec = f"{bigram_family.__name__}:32"
    assert "bigram" not in families.FAMILIES
    res = run(tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, model={"spec": spec, "config": {"vocab": 384}},
                          training={"steps": 3}, optimizer={"lr": 1e-1}, lr_scheduler={"decay_type": "constant"}))
    assert isinstance(res.model, bigram_family.Bigram)
    assert abs(res.losses[1] - math.log(384)) < 0.05 and res.losses[3] < res.losses[1]
    with pytest.raises(ConfigError, match=r"model\.spec: no module 'no_such_pkg\.family' for the family of "
                                          r"'no_such_pkg\.family:1' \(No module named 'no_such_pkg'\)"):
        run(tiny_config(tmp_path / "a", tiny_tokenizer, corpus_dir, model={"spec": "no_such_pkg.family:1"}))
    with pytest.raises(ConfigError, match=r"model\.spec: module 'tests\.harness\.helpers' has no build_spec\("):
        run(tiny_config(tmp_path / "b", tiny_tokenizer, corpus_dir, model={"spec": "tests.harness.helpers:1"}))
    with pytest.raises(ConfigError, match=r"must be 'qwen3:<flavor>' or 'hf:<path>', got 'bigram:32' \(a family of "
                                          r"your own: '<package\.module>:<argument>'"):
        load_config(None, ["--model.spec", "bigram:32"])


@pytest.mark.parametrize("code, message", [
    ("import no_such_dependency_xyz\n",
     "config model.spec: cannot import the family module '{pkg}.fam' of '{pkg}.fam:1': ModuleNotFoundError: No "
     "module named 'no_such_dependency_xyz' (at {file}:1)"),
    ("def build_spec(arg, overrides, **kw):\n    raise RuntimeError('no device')\n",
     "config model.spec: {pkg}.fam.build_spec raised for '{pkg}.fam:1': RuntimeError: no device (at {file}:2)"),
    ("import sys\ndef build_spec(arg, overrides, **kw):\n    sys.exit(0)\n",
     "config model.spec: {pkg}.fam.build_spec raised for '{pkg}.fam:1': it called sys.exit(0) in build_spec "
     "(at {file}:3)"),
], ids=["import-fails", "build-spec-raises", "build-spec-exits"])
def test_a_family_of_your_own_that_fails_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           request: pytest.FixtureRequest, code: str,
                                                           message: str) -> None:
    """As for [overrides] plugins: an error in a family module of the user's (named by its module path) was a
    traceback (exit 1; a sys.exit(0) in build_spec ended the run as a success with nothing trained); now a
    ConfigError naming model.spec, the module, the error and the user's line."""
    pkg = "userfam_" + request.node.callspec.id.replace("-", "_")  # one package per case: no module cached
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "fam.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        build_spec(load_config(None, ["--model.spec", f"{pkg}.fam:1"]))
    assert str(e.value) == message.format(pkg=pkg, file=tmp_path / pkg / "fam.py")
