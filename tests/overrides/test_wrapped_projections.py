"""Projections wrapped LoRA-style (``base(x) + B(A(x))``; peft-style with the weight on ``.base_layer``; an
``nn.Linear`` subclass with a forward of its own) where a swap point reads the weight instead of calling the
module: transformers' MLP (``gate_proj`` / ``up_proj`` / ``down_proj``), trnkit's native dense MLP (``w1`` /
``w2`` / ``w3``), its router's ``gate`` and its ``lm_head`` (read by the fused loss). The kernels computed the
bare projections and dropped the wrapper's part silently; now such a swap point refuses (``strict``, naming the
module and the rule) or runs the module's own forward, which calls the wrapper (``fallback``, warned), whether the
wrapper came before ``apply_overrides`` or after it. Wrappers around modules the adapters call (``q_proj``,
transformers' router module itself) run as they did."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.overrides.conftest import hf_dense_model, hf_moe_model, native_model
from tests.tolerances import assert_close
from trnkit.overrides import OverrideConfig, OverrideConstraintError, apply_overrides

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _delta(base: nn.Module, seed: int) -> tuple[nn.Linear, nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    a, b = nn.Linear(base.in_features, 2, bias=False), nn.Linear(2, base.out_features, bias=False)
    with torch.no_grad():
        a.weight.copy_(torch.randn(a.weight.shape, generator=g))
        b.weight.copy_(torch.randn(b.weight.shape, generator=g) * 0.5)
    return a, b


class PeftStyle(nn.Module):
    """peft's layout: the projection on ``.base_layer``, ``.weight`` forwarded to it, ``base(x) + B(A(x))``."""

    def __init__(self, base: nn.Module, seed: int = 0) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A, self.lora_B = _delta(base, seed)
        self.in_features, self.out_features = base.in_features, base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class LoRALinear(nn.Linear):
    """A hand-written LoRA linear: an ``nn.Linear`` (the same weight) whose forward adds ``B(A(x))``."""

    def __init__(self, base: nn.Linear, seed: int = 0) -> None:
        super().__init__(base.in_features, base.out_features, bias=False)
        self.weight = base.weight
        self.lora_A, self.lora_B = _delta(base, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(x))


WRAPPERS = {"peft-style": PeftStyle, "nn.Linear subclass": LoRALinear}


def _wrap(model: nn.Module, path: str, wrapper: type, seed: int = 0) -> None:
    parent, name = model.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2]
    setattr(parent, name, wrapper(getattr(parent, name), seed))


def _out(model: nn.Module) -> torch.Tensor:
    out = model(IDS)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("side, path, ops", [
    ("transformers", "model.layers.0.mlp.gate_proj", ["mlp"]),
    ("transformers", "model.layers.1.mlp.down_proj", ["mlp"]),
    ("native", "layers.1.feed_forward.w1", ["mlp"]),
    ("native", "layers.0.moe.router.gate", ["router_topk"]),
])
def test_a_projection_wrapped_after_the_swap_is_not_skipped(side, path, ops, wrapper):
    model = hf_dense_model() if side == "transformers" else native_model()
    want = copy.deepcopy(model)
    bare = _out(want)
    apply_overrides(model, OverrideConfig(ops=ops, impl="reference", seq_len=8))
    _wrap(model, path, WRAPPERS[wrapper])
    _wrap(want, path, WRAPPERS[wrapper])
    module = path.rsplit(".", 1)[0]
    with pytest.raises(OverrideConstraintError, match=rf"at {module} .*'{path.rsplit('.', 1)[1]} computes only "
                       r"F\.linear \(nn\.Linear's own forward, no wrapper\)' violated \(got '(PeftStyle|LoRALinear)"):
        _out(model)

    model = hf_dense_model() if side == "transformers" else native_model()
    apply_overrides(model, OverrideConfig(ops=ops, impl="reference", seq_len=8, policy="fallback"))
    _wrap(model, path, WRAPPERS[wrapper])
    with pytest.warns(UserWarning, match=rf"falls back .*first seen at {module}\).*no wrapper"):
        got = _out(model)
    assert not torch.allclose(got, bare)  # the wrapper's part is there
    assert_close(got, _out(want), torch.float32)


@pytest.mark.parametrize("side, path, op", [
    ("transformers", "model.layers.0.mlp.up_proj", "mlp"),
    ("native", "layers.1.feed_forward.w3", "mlp"),
    ("native", "layers.0.moe.router.gate", "router_topk"),
])
def test_a_projection_wrapped_before_the_swap_is_refused_when_applied(side, path, op):
    model = hf_dense_model() if side == "transformers" else native_model()
    _wrap(model, path, LoRALinear)
    module, proj = path.rsplit(".", 1)
    with pytest.raises(OverrideConstraintError, match=rf"{op}\[reference\] at {module} .*'{proj} computes only "
                       r"F\.linear .*\(got 'LoRALinear \(an nn\.Linear subclass with a forward of its own\)'\)"):
        apply_overrides(model, OverrideConfig(ops=[op], impl="reference", seq_len=8))
    want = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="no wrapper"):
        report = apply_overrides(model, OverrideConfig(ops=[op], impl="reference", seq_len=8, policy="fallback"))
    assert {r.module: r.status for r in report.rows}[module] == "fallback"
    assert_close(_out(model), _out(want), torch.float32)


def test_transformers_moe_dense_layer_mlp_wrapped_after_the_swap():
    model = hf_moe_model(mlp_only_layers=[1])
    want = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["mlp", "router_topk", "moe_experts"], impl="reference", seq_len=8,
                                          policy="fallback"))
    for m in (model, want):
        _wrap(m, "model.layers.1.mlp.gate_proj", PeftStyle)
    with pytest.warns(UserWarning, match=r"mlp\[reference\] falls back .*gate_proj computes only F\.linear"):
        assert_close(_out(model), _out(want), torch.float32)


def test_wrappers_around_modules_the_swaps_call_still_run():
    """transformers' attention forward calls q_proj (rope_hf / attention swaps), and its router module is itself
    the swap point (a wrapper around it calls the swapped forward); trnkit's native attention calls wq."""
    class ScaledRouting(nn.Module):
        def __init__(self, base: nn.Module) -> None:
            super().__init__()
            self.base_layer = base

        def forward(self, x: torch.Tensor):
            logits, weights, idx = self.base_layer(x)
            return logits, weights * 0.5, idx

    model = hf_moe_model()
    want = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["rope_hf", "attention", "router_topk", "moe_experts"],
                                          impl="reference", seq_len=8))
    for m in (model, want):
        _wrap(m, "model.layers.0.self_attn.q_proj", PeftStyle)
        m.model.layers[1].mlp.gate = ScaledRouting(m.model.layers[1].mlp.gate)
    assert_close(_out(model), _out(want), torch.float32)

    native = native_model()
    want = copy.deepcopy(native)
    apply_overrides(native, OverrideConfig(ops=["rope_hf", "attention"], impl="reference", seq_len=8))
    for m in (native, want):
        _wrap(m, "layers.0.attention.wq", PeftStyle)
    assert_close(_out(native), _out(want), torch.float32)


def test_a_wrapped_native_lm_head_reaches_the_loss():
    """The native model's loss reads ``lm_head.weight`` (the chunked torch loss as well as the loss kernel), so
    a wrapped lm_head's part was missing from the loss even with no kernel bound; the loss is now the
    cross-entropy of the wrapped lm_head's logits (warned), and a bound loss kernel follows its policy."""
    model = native_model()
    model.lm_head = PeftStyle(model.lm_head)
    logits = model(IDS)
    want = F.cross_entropy(logits.float().flatten(0, 1), IDS.flatten(), reduction="sum")
    with pytest.warns(UserWarning, match=r"lm_head computes only F\.linear .*got 'PeftStyle'"):
        assert_close(model(IDS, labels=IDS), want, torch.float32)

    model = native_model()
    model.lm_head = PeftStyle(model.lm_head)
    with pytest.warns(UserWarning, match=r"linear_cross_entropy\[reference\] falls back .*lm_head computes only"):
        report = apply_overrides(model, OverrideConfig(ops=["linear_cross_entropy"], impl="reference", seq_len=8,
                                                       policy="fallback"))  # the validation dry run saw it
    assert [(r.module, r.status) for r in report.rows] == [("loss", "fallback")]
    assert_close(model(IDS, labels=IDS), want, torch.float32)
    with pytest.raises(OverrideConstraintError, match=r"linear_cross_entropy\[reference\] at loss .*lm_head"):
        apply_overrides(model, OverrideConfig(ops=["linear_cross_entropy"], impl="reference", seq_len=8))
    apply_overrides(model, OverrideConfig(ops=["linear_cross_entropy"], impl="reference", dry_run=False))
    with pytest.raises(OverrideConstraintError, match=r"linear_cross_entropy\[reference\] at loss .*lm_head "
                       r"computes only F\.linear"):
        model(IDS, labels=IDS)


def test_linear_wrapper_tells_a_plain_projection_from_one_that_computes_more() -> None:
    from trnkit.overrides.guard import linear_wrapper
    from trnkit.qwen3.precision import Linear

    class OwnForward(Linear):  # a subclass of the native Linear with a forward of its own: not plain
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    class Inherits(Linear):  # inherits the native Linear's forward: plain
        pass

    assert linear_wrapper(nn.Linear(4, 3)) is None
    assert linear_wrapper(Linear(4, 3)) is None
    assert linear_wrapper(Inherits(4, 3)) is None
    assert linear_wrapper(OwnForward(4, 3)) == "OwnForward (an nn.Linear subclass with a forward of its own)"
    assert linear_wrapper(LoRALinear(nn.Linear(4, 3))) == "LoRALinear (an nn.Linear subclass with a forward of its own)"
    assert linear_wrapper(PeftStyle(nn.Linear(4, 3))) == "PeftStyle"
    patched = nn.Linear(4, 3)
    patched.forward = lambda x: x  # a forward set on the instance
    assert linear_wrapper(patched) == "Linear with a forward set on the instance"
