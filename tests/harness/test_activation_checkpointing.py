"""training.activation_checkpointing = "full": every block recomputes its forward in the backward, the run's
losses and gradients are those of a run without it, and the shipped trn2 configs fit their device by the plan."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from trnkit.harness.config import ConfigError, load_config
from trnkit.harness.parallel import apply_activation_checkpointing
from trnkit.harness.plan import DEVICE_MEMORY, INSTANCE_RANKS, plan
from trnkit.harness.train import run
from trnkit.packaged import resolve_config

from .helpers import tiny_config
from .test_hf import hf_moe_dir  # noqa: F401  (the fixture)


def test_a_checkpointed_block_runs_its_forward_again_in_the_backward() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    plain = copy.deepcopy(block)
    apply_activation_checkpointing([block])
    calls: list[bool] = []
    block[0].register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    x = torch.randn(8, 16)
    block(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert len(calls) == 2  # the forward, then the recompute during the backward
    for (name, p), q in zip(block.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    assert [n for n, _ in block.named_parameters()] == [n for n, _ in plain.named_parameters()]  # names kept


def _forward_calls(model: nn.Module, path: str) -> list[int]:
    calls: list[int] = []
    model.get_submodule(path).register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("family", ["native", "hf"])
def test_runs_with_full_activation_checkpointing_train_as_without(
        tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path, family: str, request: pytest.FixtureRequest,
        caplog: pytest.LogCaptureFixture) -> None:
    model = {} if family == "native" else {"model": {"spec": f"hf:{request.getfixturevalue('hf_moe_dir')}",
                                                     "config": {}}}
    steps = 3
    base = run(tiny_config(tmp_path / "none", tiny_tokenizer, corpus_dir, training={"steps": steps}, **model))
    caplog.set_level("INFO", logger="trnkit.harness")
    ac = run(tiny_config(tmp_path / "full", tiny_tokenizer, corpus_dir,
                         training={"steps": steps, "activation_checkpointing": "full"}, **model))
    assert any(r.getMessage().startswith("activation checkpointing: full, 2 blocks") for r in caplog.records)
    for s in range(1, steps + 1):  # the same computation, recomputed: equal to fp32 rounding
        assert ac.losses[s] == pytest.approx(base.losses[s], rel=1e-6), s
        assert ac.grad_norms[s] == pytest.approx(base.grad_norms[s], rel=1e-5), s
    # the MoE block (layer 1) really recomputes: its router runs twice per forward + backward
    router = "layers.1.moe.router" if family == "native" else "model.layers.1.mlp.gate"
    for result, per_step in ((base, 1), (ac, 2)):
        calls = _forward_calls(result.model, router)
        result.model.train()
        tokens = torch.randint(0, 384, (1, 16))
        loss = result.model(tokens).sum() if family == "native" else result.model(input_ids=tokens).logits.sum()
        loss.backward()
        assert len(calls) == per_step


def test_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"training.activation_checkpointing.*'partial'"):
        load_config(None, ["--training.activation_checkpointing", "partial"])


@pytest.mark.parametrize("name", ["qwen3_0.6b", "qwen3_4b", "qwen3_30b_a3b"])
def test_the_shipped_trn2_configs_fit_a_trn2_rank(name: str) -> None:
    """Each says it runs on the 64 logical cores of a trn2.48xlarge: its plan fits 24 GiB per rank there.
    qwen3_4b and qwen3_30b_a3b fit with the activation checkpointing they set (29.8 / 53.7 GiB without)."""
    path = resolve_config(name)
    assert "trn2.48xlarge" in Path(path).read_text().split("\n[", 1)[0]  # the header names the instance
    cfg = load_config(path)
    p = plan(cfg, INSTANCE_RANKS["trn2.48xlarge"], "trn2")
    assert p.capacity == DEVICE_MEMORY["trn2"] and p.fits, p.verdict()
    if cfg.training.activation_checkpointing == "full":
        assert not plan(cfg, 64, "trn2", activation_checkpointing="none").fits  # why it is set


def test_the_value_none_is_a_string_on_the_command_line() -> None:
    """"none" is the null spelling of optional fields only; for a field of named choices it is a choice (it
    used to become None: 'must be one of ['none', 'full'], got None')."""
    cfg = load_config(resolve_config("qwen3_30b_a3b"), ["--training.activation_checkpointing", "none"])
    assert cfg.training.activation_checkpointing == "none"
    assert load_config(None, ["--training.moe_aux_loss_coef", "none"]).training.moe_aux_loss_coef is None
