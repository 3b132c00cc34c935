"""``[overrides] plugins``: a user's kernel module named in the config trains the model (examples/my_kernels.py)."""

from __future__ import annotations

import re
import sys
import tomllib
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
    import examples.my_kernels as plugin  # the run imports it; this is only for CALLS

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
    assert tomllib.loads(toml.read_text())["overrides"]["plugins"] == ["examples.my_kernels"]
    mine = run(load_config(toml))
    rows = sorted(tuple(line.split()[1:4]) for line in mine.override_table.splitlines()[2:4])
    assert rows == [("moe_experts", "example", "swapped"), ("router_topk", "example", "swapped")]
    assert mine.override_table.splitlines()[4:] == [  # whose code the impl name "example" is
        "  router_topk[example] runs examples.my_kernels.router_fwd, backward examples.my_kernels.router_bwd",
        "  moe_experts[example] runs examples.my_kernels.experts_fwd, backward examples.my_kernels.experts_bwd"]
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
                                          r"'broken_kernels': RuntimeError: no device here "
                                          r"\(at .*broken_kernels.py:3\)"):
        import_plugins(["broken_kernels"])
    # an error raised inside the library the plugin calls: the plugin's own line is named, not the library's
    (tmp_path / "bad_op_kernels.py").write_text("from trnkit.overrides import register\n\n"
                                                "register('rope', 'mine', lambda *a, **k: None)\n")
    with pytest.raises(ConfigError, match=r"'bad_op_kernels': RegistrationError: trnkit overrides: unknown op 'rope'; "
                                          r"known ops: .* \(at .*bad_op_kernels.py:3\)$"):
        import_plugins(["bad_op_kernels"])
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


def _plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> str:
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_plugin_calling_sys_exit_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for code in (0, 3):
        name = _plugin(tmp_path, monkeypatch, f"exiting_kernels_{code}", f"import sys\n\nsys.exit({code})\n")
        with pytest.raises(ConfigError, match=rf"cannot import plugin module '{name}': it called sys.exit\({code}\) "
                                              rf"while being imported \(at .*{name}.py:3\)"):
            import_plugins([name])


def test_plugin_sys_exit_0_through_the_cli_is_exit_2_and_writes_nothing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "exit_zero_kernels.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    proc = run_cli(["--overrides.plugins", "exit_zero_kernels", "--job.dump_folder", str(tmp_path / "run")],
                   timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)  # not 0: nothing was trained
    assert proc.stderr.startswith("error: config overrides.plugins: cannot import plugin module 'exit_zero_kernels': "
                                  "it called sys.exit(0) while being imported")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


_BAD_CONSTRAINTS = """
import re
import sys

import examples.my_kernels as ex
from trnkit.overrides import register


def bad_constraints(x, w_router, top_k, **_):
    {body}


register("router_topk", "{impl}", ex.router_fwd, backward=ex.router_bwd, constraints=bad_constraints,
         has_backward=True)
"""


@pytest.mark.parametrize("impl, body, what", [
    ("raising", "raise RuntimeError('cannot tell')", r"raised RuntimeError: cannot tell \(at .*\.py:10\)"),
    ("exiting", "sys.exit(0)", r"called sys.exit\(0\) \(at .*\.py:10\)"),
    ("nolist", "return None", r"must return a list of Violation, got NoneType None"),
    # reading a value of the dry run's fake tensors: the plugin's own line, not torch's, and why it failed
    ("values", "return [] if float(x.abs().max()) < 1e9 else []",
     r"raised DataDependentOutputException: .* \(at .*bad_constraints_values\.py:10\); constraint functions also get "
     r"fake tensors \(the validation dry run, torch.compile\): read shapes, dtypes and devices only, never values"),
])
def test_plugin_constraint_function_that_fails_is_exit_2_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_tokenizer: str, corpus_dir: Path,
        capsys: pytest.CaptureFixture[str], example_plugin, impl: str, body: str, what: str) -> None:
    from trnkit.harness.train import main

    name = _plugin(tmp_path, monkeypatch, f"bad_constraints_{impl}", _BAD_CONSTRAINTS.format(body=body, impl=impl))
    dump = tmp_path / "run"
    cfg = tiny_config(dump, tiny_tokenizer, corpus_dir, overrides={"plugins": [name], "ops": ["router_topk"],
                                                                   "policy": "fallback", "impl": impl})
    try:
        rc = main(["--config", str(write_config(cfg, tmp_path / "c.toml"))])
    finally:
        unregister("router_topk", impl)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.match(rf"error: trnkit overrides: the constraint function {name}\.bad_constraints of "
                    rf"router_topk\[{impl}\] {what}", err), err
    assert "Traceback" not in err
    assert not (dump / "metrics.jsonl").exists()  # stopped before the first step


_REPLACING_PLUGIN = """
import examples.my_kernels as ex
from trnkit.overrides import register

register("router_topk", "nki", ex.router_fwd, backward=ex.router_bwd, has_backward=True, replace=True)
"""


def test_a_plugin_replacing_a_builtin_impl_is_named_in_the_report_and_the_run_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_tokenizer: str, corpus_dir: Path,
        example_plugin) -> None:
    """``register(..., replace=True)`` under the name ``nki``: the report and config.toml name the plugin's code,
    not only the impl name (the run folder must tell what ran). The example plugin's own impl is named too."""
    from trnkit.overrides import get_impl, register

    builtin = get_impl("router_topk", "nki")
    name = _plugin(tmp_path, monkeypatch, "replacing_kernels", _REPLACING_PLUGIN)
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, training={"steps": 1},
                      overrides={"plugins": [name], "ops": OPS, "policy": "strict",
                                 "impl": {"router_topk": "nki", "moe_experts": "example"}})
    try:
        res = run(cfg)
    finally:  # trnkit's built-in back, for the rest of the session
        register("router_topk", "nki", builtin.fn, constraints=builtin.constraints, devices=builtin.devices,
                 has_backward=True, compile_ok=builtin.compile_ok, backward=builtin.backward,
                 description=builtin.description, autograd_backward=builtin.autograd_backward, replace=True)
    assert example_plugin.CALLS["router_fwd"] >= 1  # the plugin's router ran under the name nki
    replaced = ("router_topk[nki] runs examples.my_kernels.router_fwd, backward examples.my_kernels.router_bwd "
                "(registered with replace=True in place of trnkit's built-in 'nki')")
    own = "moe_experts[example] runs examples.my_kernels.experts_fwd, backward examples.my_kernels.experts_bwd"
    table = res.override_table.splitlines()
    assert [line.strip() for line in table[-2:]] == [replaced, own], res.override_table
    recorded = (tmp_path / "run" / "config.toml").read_text()
    assert recorded.endswith(f"# {replaced}\n# {own}\n"), recorded
    assert tomllib.loads(recorded)["overrides"]["impl"] == {"router_topk": "nki", "moe_experts": "example"}
    # trnkit's own impls add no line
    ref = run(tiny_config(tmp_path / "ref", tiny_tokenizer, corpus_dir, training={"steps": 1},
                          overrides={"ops": ["router_topk"], "policy": "strict", "impl": "nki"}))
    assert "runs" not in ref.override_table and "#" not in (tmp_path / "ref" / "config.toml").read_text()
