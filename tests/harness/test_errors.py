"""Every user error derives from trnkit.errors.TrnkitError, and the trainer's CLI maps any of them to exit 2."""

from __future__ import annotations

import pytest
import torch

from trnkit.errors import ConfigError, TrnkitError
from trnkit.harness import train
from trnkit.harness.checkpoint import CheckpointSaveError
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.overrides.registry import ConstraintFunctionError, OverrideConstraintError, RegistrationError
from trnkit.qwen3 import Qwen3Config
from trnkit.qwen3.checkpoint import parse_size
from trnkit.qwen3.state_dict import CheckpointError
from trnkit.qwen3.tp_experts import shard_experts_on_i

from .helpers import main_result


@pytest.mark.parametrize("cls", [ConfigError, KernelConstraintError, OverrideConstraintError, CheckpointError,
                                 CheckpointSaveError, RegistrationError, ConstraintFunctionError])
def test_user_errors_share_one_base(cls: type) -> None:
    assert issubclass(cls, TrnkitError)


def test_harness_config_error_is_the_shared_class() -> None:
    from trnkit.harness import config

    assert config.ConfigError is ConfigError and issubclass(ConfigError, ValueError)  # old except clauses hold


class _PluginsOwnError(TrnkitError):
    """A user error class defined outside trnkit (e.g. by a plugin)."""


@pytest.mark.parametrize("exc, code", [(_PluginsOwnError("my_pkg: bad block size 3"), 2),
                                       (train.TrainingDiverged("train: step 1: loss nan"), 3)])
def test_cli_maps_any_trnkit_error_to_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                             exc: Exception, code: int) -> None:
    def fail(cfg: object) -> None:
        raise exc

    monkeypatch.setattr(train, "run", fail)
    assert train.main([]) == code
    err = capsys.readouterr().err
    assert err == f"error: {exc} (--debug or TRNKIT_DEBUG=1 shows the traceback)\n"


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(cfg: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(train, "run", fail)
    with pytest.raises(ZeroDivisionError):
        train.main([])



class _Experts:  # what shard_experts_on_i reads before it refuses: the down projection's shape [E, I, H]
    w_down = torch.zeros(2, 3, 4)


class _Mesh:
    def size(self) -> int:
        return 2


@pytest.mark.parametrize("call, match", [
    (lambda: Qwen3Config(n_heads=3, n_kv_heads=2), r"Qwen3Config: n_heads \(3\) must be a multiple of n_kv_heads"),
    (lambda: Qwen3Config.from_hf({"model_type": "llama"}),
     r"Qwen3Config\.from_hf: model_type must be 'qwen3' or 'qwen3_moe', got 'llama'"),
    (lambda: parse_size("5 parsecs"), r"save_hf_checkpoint: cannot parse max_shard_size '5 parsecs'"),
    (lambda: shard_experts_on_i(_Experts(), _Mesh()),
     r"parallelism\.tp_experts 'shard_i': moe_inter_dim 3 is not divisible by tensor_parallel_degree 2"),
])
def test_library_input_errors_are_trnkit_errors(call, match: str) -> None:
    # the native model's config and checkpoint arguments: ConfigError (still a ValueError for old except clauses)
    with pytest.raises(TrnkitError, match=match) as e:
        call()
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("environ, message", [
    ({"WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE: must be an integer >= 1 (torchrun sets it), got 'abc'"),
    ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE: must be an integer >= 1 (torchrun sets it), got '0'"),
    ({"WORLD_SIZE": "2", "RANK": "x"},
     "environment variable RANK: must be an integer in [0, WORLD_SIZE - 1 = 1] (torchrun sets it), got 'x'"),
    ({"WORLD_SIZE": "2", "RANK": "2"},
     "environment variable RANK: must be an integer in [0, WORLD_SIZE - 1 = 1] (torchrun sets it), got '2'"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"},
     "environment variable LOCAL_RANK: must be an integer in [0, RANK = 1] (torchrun sets it), got '-1'"),
    # digits str.isdigit passes and int refuses: they ended in int()'s ValueError
    ({"WORLD_SIZE": "\u00b2"},
     "environment variable WORLD_SIZE: must be an integer >= 1 (torchrun sets it), got '\u00b2'"),
    ({"WORLD_SIZE": "1_0"},  # int() reads 10
     "environment variable WORLD_SIZE: must be an integer >= 1 (torchrun sets it), got '1_0'"),
    ({"WORLD_SIZE": "2", "RANK": "--1"},
     "environment variable RANK: must be an integer in [0, WORLD_SIZE - 1 = 1] (torchrun sets it), got '--1'"),
])
def test_launch_environment_errors_name_the_variable(environ: dict[str, str], message: str) -> None:
    """torchrun's variables are user input too: a bad one is a ConfigError (exit 2), not a ValueError traceback."""
    from trnkit.harness.parallel import launch_ranks

    with pytest.raises(ConfigError) as exc:
        launch_ranks(environ)
    assert str(exc.value) == message


def test_launch_environment_values() -> None:
    from trnkit.harness.parallel import launch_ranks

    assert launch_ranks({}) == (0, 1, 0)
    assert launch_ranks({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1"}) == (5, 8, 1)


@pytest.mark.parametrize("value, error, message", [
    ("foo", ConfigError, "environment variable TRNKIT_NKI: must be 'sim', 'real' or unset (real NKI when importable, "
                         "else the interpreter), got 'foo'"),
    ("real", ImportError, "environment variable TRNKIT_NKI: 'real' needs the Neuron 'nki' package, which is not "
                          "importable ("),
])
def test_nki_backend_variable_errors_are_user_errors(monkeypatch: pytest.MonkeyPatch, value: str, error: type,
                                                     message: str) -> None:
    """A bad TRNKIT_NKI is the user's to fix: a TrnkitError (exit 2 in the CLI), still the built-in class it was."""
    from trnkit import nki_api

    monkeypatch.setenv("TRNKIT_NKI", value)
    monkeypatch.setattr(nki_api, "_load_real", lambda: (_ for _ in ()).throw(ImportError("No module named 'nki'")))
    with pytest.raises(error) as exc:
        nki_api._resolve()
    assert isinstance(exc.value, TrnkitError) and str(exc.value).startswith(message)


@pytest.mark.parametrize("value, traceback_shown", [("1", True), ("TRUE", True), ("on", True), ("0", False),
                                                    ("false", False), ("off", False), ("", False)])
def test_trnkit_debug_values(value: str, traceback_shown: bool, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """TRNKIT_DEBUG=false used to turn tracebacks on (any value but '' and '0' did)."""
    monkeypatch.setenv("TRNKIT_DEBUG", value)
    code, _, err = main_result(["--training.steps", "abc"], capsys)
    assert code == 2 and ("Traceback" in err) == traceback_shown, err
    assert err.rstrip().endswith("expected an int, got str 'abc'" + ("" if traceback_shown else
                                 " (--debug or TRNKIT_DEBUG=1 shows the traceback)"))


def test_a_trnkit_debug_value_that_is_neither_on_nor_off_is_named(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRNKIT_DEBUG", "maybe")
    code, _, err = main_result(["--training.steps", "1"], capsys)
    assert code == 2 and err.startswith("error: environment variable TRNKIT_DEBUG: must be one of ['1', 'true', "
                                        "'yes', 'on'] (tracebacks on) or ['0', 'false', 'no', 'off'] (off), got "
                                        "'maybe'"), err
