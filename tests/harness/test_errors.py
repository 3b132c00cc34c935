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
