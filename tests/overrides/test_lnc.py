"""The override config's LNC switch: the MoE kernels behind the swapped modules run on both cores."""

from __future__ import annotations

import pytest
import torch

from tests.overrides.conftest import native_model
from trnkit.harness.config import TrainerConfig
from trnkit.harness.train import override_config
from trnkit.kernels import lnc as lnc_mod
from trnkit.nkisim import trace
from trnkit.overrides import OverrideConfig, apply_overrides, revert

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _restore_lnc():
    yield
    lnc_mod.set_lnc(None)


def _run(lnc: int | None) -> tuple[torch.Tensor, list[torch.Tensor], set[int]]:
    model = native_model()
    apply_overrides(model, OverrideConfig(ops=["moe_experts"], lnc=lnc))
    try:
        model.zero_grad()
        with trace.record(trace_only=False) as tr:
            logits = model(TOKENS)
            logits.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    finally:
        revert(model)
    return logits.detach(), grads, {i.program_id for i in tr}


def test_lnc2_override_runs_both_cores_with_identical_results() -> None:
    out1, grads1, progs1 = _run(1)
    assert lnc_mod.default_lnc() == 1 and progs1 == {0}
    out2, grads2, progs2 = _run(2)
    assert lnc_mod.default_lnc() == 2 and progs2 == {0, 1}
    assert torch.equal(out1, out2)  # fp32 model: bit-identical
    assert all(torch.equal(a, b) for a, b in zip(grads1, grads2, strict=True))


def test_override_config_lnc_is_checked_and_the_trainer_passes_it() -> None:
    with pytest.raises(ValueError, match=r"OverrideConfig\.lnc must be one of \(1, 2\) or None, got 4"):
        OverrideConfig(ops=["moe_experts"], lnc=4)
    cfg = TrainerConfig()
    cfg.overrides.ops, cfg.overrides.policy = ["moe_experts"], "strict"
    assert override_config(cfg).lnc is None  # 0: the detected device's
    cfg.overrides.lnc = 2
    assert override_config(cfg).lnc == 2
