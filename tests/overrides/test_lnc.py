"""The override config's LNC switch: the MoE kernels behind the swapped modules run on both cores."""

from __future__ import annotations

import pytest
import torch

from tests.overrides.conftest import native_model
from trnkit.harness.config import TrainerConfig
from trnkit.harness.train import override_config
from trnkit.kernels import lnc as lnc_mod
from trnkit.nkisim import trace
from trnkit.overrides import OverrideConfig, apply_overrides

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _run(lnc: int | None) -> tuple[torch.Tensor, list[torch.Tensor], set[int]]:
    model = native_model()
    apply_overrides(model, OverrideConfig(ops=["moe_experts"], lnc=lnc))
    model.zero_grad()
    with trace.record(trace_only=False) as tr:
        logits = model(TOKENS)
        logits.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logits.detach(), grads, {i.program_id for i in tr}


def test_lnc2_override_runs_both_cores_with_identical_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lnc_mod.ENV, raising=False)
    out1, grads1, progs1 = _run(1)
    assert progs1 == {0}
    out2, grads2, progs2 = _run(2)
    assert progs2 == {0, 1}
    assert torch.equal(out1, out2)  # fp32 model: bit-identical
    assert all(torch.equal(a, b) for a, b in zip(grads1, grads2, strict=True))
    # the setting belonged to the models' modules: nothing is left in the process
    assert lnc_mod.default_lnc() == 1
    _, _, progs = _run(None)
    assert progs == {0}


@pytest.mark.parametrize("op", ["rope_hf", "router_topk", "rmsnorm", "linear_cross_entropy", "attention", "mlp"])
def test_lnc_reaches_every_lnc_kernel_of_the_native_model(op: str) -> None:
    """RoPE, the router, the norms, the fused loss, attention and the dense MLP also run on both cores at lnc=2
    (fwd and bwd), same numbers."""
    runs = {}
    for lnc in (1, 2):
        model = native_model()
        apply_overrides(model, OverrideConfig(ops=[op], lnc=lnc))
        with trace.record(trace_only=False) as tr:
            loss = model(TOKENS, labels=TOKENS) if op == "linear_cross_entropy" else model(TOKENS).square().mean()
            loss.backward()
        runs[lnc] = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None],
                     {i.program_id for i in tr})
    assert runs[1][2] == {0} and runs[2][2] == {0, 1}
    torch.testing.assert_close(runs[2][0], runs[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(runs[2][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_override_config_lnc_is_checked_and_the_trainer_passes_it() -> None:
    with pytest.raises(ValueError, match=r"OverrideConfig\.lnc must be one of \(1, 2\) or None, got 4"):
        OverrideConfig(ops=["moe_experts"], lnc=4)
    cfg = TrainerConfig()
    cfg.overrides.ops, cfg.overrides.policy = ["moe_experts"], "strict"
    assert override_config(cfg).lnc is None  # 0: the detected device's
    cfg.overrides.lnc = 2
    assert override_config(cfg).lnc == 2
    assert override_config(cfg).block_size == 0  # the kernel's tuned sizes (forward 512, backward 128)
    cfg.overrides.block_size = 512
    assert override_config(cfg).block_size == 512
    with pytest.raises(ValueError,
                       match=r"OverrideConfig\.block_size must be one of \(32, 64, 128, 256, 512\), got 100"):
        OverrideConfig(ops=["moe_experts"], block_size=100)


def test_block_size_reaches_the_experts_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from trnkit.overrides import ops

    seen = []
    real = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a, **kw: seen.append((a[5], kw.get("lnc"))) or real(*a, **kw))
    model = native_model()
    apply_overrides(model, OverrideConfig(ops=["moe_experts"], block_size=64, lnc=2, dry_run=False))
    model(TOKENS)
    assert seen == [(64, 2)]  # one MoE layer: its block size and lnc from the config


def test_the_tuned_block_sizes_reach_the_kernels_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """block_size 0 (the default of the library's and the trainer's config): the nki kernels run at their
    tuned sizes, forward 512 and backward 128 slots per expert block."""
    import inspect

    from trnkit.kernels import moe

    seen = []
    for name in ("moe_experts", "moe_experts_bwd"):
        real = getattr(moe, name)

        def spy(*a, _real=real, _name=name, **kw):
            bound = inspect.signature(_real).bind(*a, **kw)
            bound.apply_defaults()
            seen.append((_name, bound.arguments["block_size"]))
            return _real(*a, **kw)

        monkeypatch.setattr(moe, name, spy)
    model = native_model()
    apply_overrides(model, OverrideConfig(ops=["moe_experts"], seq_len=8))
    model(TOKENS).square().mean().backward()
    assert seen == [("moe_experts", 512), ("moe_experts_bwd", 128)]
