"""``[overrides] plugins``: a user's kernel module named in the config trains the model (examples/my_kernels.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.tolerances import tol
from trnkit.harness.config import ConfigError, load_config
from trnkit.harness.plugins import import_plugins
from trnkit.harness.train import run
from trnkit.overrides import unregister

from .helpers import run_cli, tiny_config, write_config

OPS = ["router_topk", "moe_experts"]


@pytest.fixture
def example_plugin():
    import examples.my_kernels as plugin  # noqa: F401 - the run imports it; this is only for CALLS

    plugin.CALLS.clear()
    yield plugin
    for op in OPS:
        unregister(op, "example")
    sys.modules.pop("examples.my_kernels")  # so that a later import registers them again


def test_plugin_from_toml_trains_like_the_reference(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                                    example_plugin) -> None:
    steps = 4
    ref = run(tiny_config(tmp_path / "ref", tiny_tokenizer, corpus_dir, training={"steps": steps}))
    toml = write_config(tiny_config(tmp_path / "mine", tiny_tokenizer, corpus_dir, training={"steps": steps},
                                    overrides={"plugins": ["examples.my_kernels"], "ops": OPS,
                                               "policy": "strict", "impl": "example"}), tmp_path / "mine.toml")
    assert 'plugins = ["examples.my_kernels"]' in toml.read_text()
    mine = run(load_config(toml))
    rows = sorted(tuple(line.split()[1:4]) for line in mine.override_table.splitlines()[2:])
    assert rows == [("moe_experts", "example", "swapped"), ("router_topk", "example", "swapped")]
    # every step ran the plugin's forwards and both backward styles (autograd.grad router, vjp experts)
    calls = example_plugin.CALLS
    assert calls["router_bwd"] == steps and calls["experts_bwd"] == steps
    assert calls["router_fwd"] >= steps and calls["experts_fwd"] >= steps
    rtol, atol = tol(torch.float32)
    for s in range(1, steps + 1):
        assert mine.losses[s] == pytest.approx(ref.losses[s], rel=rtol, abs=atol), s
        assert mine.grad_norms[s] == pytest.approx(ref.grad_norms[s], rel=1e-4), s
    assert mine.losses[steps] < mine.losses[1]


def test_unknown_impl_without_plugin_names_the_registered_ones(tmp_path: Path, tiny_tokenizer: str,
                                                                corpus_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir,
                      overrides={"ops": OPS, "policy": "strict", "impl": "example"})
    with pytest.raises(ConfigError, match=r"no implementation 'example' registered for op 'router_topk'"):
        run(cfg)


def test_plugin_errors_name_the_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_kernels.py").write_text("import torch\n\nraise RuntimeError('no device here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"config overrides.plugins: cannot import plugin module "
                                          r"'broken_kernels': RuntimeError: no device here \(at .*broken_kernels.py:3\)"):
        import_plugins(["broken_kernels"])
    with pytest.raises(ConfigError, match=r"'no_such_pkg.kernels': ModuleNotFoundError: No module named "
                                          r"'no_such_pkg' \(is it on sys.path / PYTHONPATH\?\)"):
        import_plugins(["no_such_pkg.kernels"])
    with pytest.raises(ConfigError, match=r"overrides.plugins\[1\]: must be a dotted Python module name"):
        load_config(cli=["--overrides.plugins", "ok.mod,my-kernels.py"])


def test_missing_plugin_is_exit_2_with_one_paragraph(tmp_path: Path) -> None:
    proc = run_cli(["--overrides.plugins", "no_such_pkg.kernels", "--job.dump_folder", str(tmp_path / "run")],
                   timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: config overrides.plugins: cannot import plugin module 'no_such_pkg.kernels'")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before anything was written
