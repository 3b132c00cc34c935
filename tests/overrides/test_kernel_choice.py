"""KernelChoice as configuration: checked when made, bound by the native model at build, passed to the ops."""

from __future__ import annotations

import copy

import pytest
import torch

import trnkit.kernels.moe as moe_kernels
from tests.helpers import expert_weights, host_reads, rand, routing
from tests.overrides.conftest import native_model
from tests.tolerances import assert_close
from trnkit.overrides import KernelChoice, OverrideConfig, bind_kernels, ops
from trnkit.qwen3 import GroupedExperts

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def test_a_choice_is_checked_when_it_is_made():
    with pytest.raises(ValueError, match=r"KernelChoice\.policy must be 'strict' or 'fallback'"):
        KernelChoice("nki", "off")
    with pytest.raises(ValueError, match=r"KernelChoice\.block_size must be one of \(32, 64, 128, 256, 512\), "
                                         r"got 100 \(or 0: the kernel's tuned sizes"):
        KernelChoice("nki", block_size=100)
    with pytest.raises(ValueError, match=r"KernelChoice\.lnc must be one of \(1, 2\) or None, got 3"):
        KernelChoice("nki", lnc=3)
    model = native_model()
    with pytest.raises(KeyError, match=r"no implementation 'fast' registered for op 'rope_hf'"):
        bind_kernels(model, {"rope_hf": KernelChoice("fast")})
    with pytest.raises(ValueError, match=r"kernels: unknown op 'rope'"):
        bind_kernels(model, {"rope": KernelChoice("nki")})
    with pytest.raises(TypeError, match=r"kernels\['rope_hf'\]: expected a KernelChoice, got dict"):
        bind_kernels(model, {"rope_hf": {"impl": "nki"}})


def test_ops_given_as_one_string_is_refused_by_name() -> None:
    """``ops="rope_hf"`` would iterate to its letters ('unknown op(s) ['r', 'o', ...]'): named as a type mistake."""
    from trnkit.overrides import OverrideConfig

    with pytest.raises(ValueError, match=r"^OverrideConfig\.ops must be a list of op names \(e\.g\. \['rope_hf'\]\), "
                                         r"got str 'rope_hf'$"):
        OverrideConfig(ops="rope_hf", policy="strict")
    assert OverrideConfig(ops=("rope_hf",), policy="strict").ops == ["rope_hf"]


def test_an_op_named_twice_is_refused() -> None:
    from trnkit.overrides import OverrideConfig

    with pytest.raises(ValueError, match=r"^OverrideConfig\.ops must name each op once, got \['rope_hf'\] more than "
                                         r"once in \['rope_hf', 'rmsnorm', 'rope_hf'\]$"):
        OverrideConfig(ops=["rope_hf", "rmsnorm", "rope_hf"], policy="strict")


def test_the_native_model_takes_its_kernels_from_its_config(monkeypatch: pytest.MonkeyPatch):
    """Qwen3Config.kernels: every swap point of the ops named is bound at build and calls its op with the
    choice's impl, block size and lnc; the logits and gradients are the torch model's."""
    plain = native_model(init_std=0.2)
    choices = OverrideConfig(impl="reference").kernels()
    choices["moe_experts"] = KernelChoice("nki", block_size=64, lnc=2)
    torch.manual_seed(0)
    model = type(plain)(plain.config.replace(kernels=choices))
    model.load_state_dict(plain.state_dict())
    bound = {name: m.kernel.choice for name, m in model.named_modules() if getattr(m, "kernel", None) is not None}
    assert bound == {"layers.0.attention.rope": choices["rope_hf"], "layers.1.attention.rope": choices["rope_hf"],
                     "layers.0.moe.router": choices["router_topk"], "layers.0.moe.experts": choices["moe_experts"]}
    seen = []
    real = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a, **kw: seen.append((a[5], a[6], kw["lnc"])) or real(*a, **kw))
    got = model(TOKENS)
    got.square().mean().backward()
    assert seen == [(64, "nki", 2)]
    want = plain(TOKENS)
    want.square().mean().backward()
    assert_close(got.detach(), want.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=name)


def test_switching_kernels_is_building_again_and_a_copy_keeps_its_choices():
    model = native_model()
    with_kernels = type(model)(model.config.replace(kernels={"rope_hf": KernelChoice("reference")}))
    assert model.layers[0].attention.rope.kernel is None  # the default config: the torch code
    twin = copy.deepcopy(with_kernels)
    assert twin.layers[0].attention.rope.kernel.choice == KernelChoice("reference")
    assert twin.layers[0].attention.rope.kernel is not with_kernels.layers[0].attention.rope.kernel


def test_the_moe_kernel_path_reads_the_host_once_per_call(monkeypatch: pytest.MonkeyPatch):
    """GroupedExperts through trnkit::moe_experts with the nki impl: the host side of the forward and of the
    backward (the choice's check, the op, the block layouts) reads the device once each, the expert-id range
    check; the kernel launches are the device's work and not counted (the torch path reads once, in its forward).
    Results are the torch path's."""
    T, H, inter, E, K = 24, 128, 64, 4, 2
    wgu, wd = expert_weights(E, H, inter, torch.float32)
    idx, tw = routing(T, E, K)
    x = rand(T, H, seed=3)
    results = {}
    for impl in (None, "nki"):
        ex = GroupedExperts(H, inter, E)
        ex.load_state_dict({"w_gate_up": wgu, "w_down": wd})
        if impl:
            assert bind_kernels(ex, {"moe_experts": KernelChoice(impl, lnc=1)}) == 1
        xi, twi = x.clone().requires_grad_(), tw.clone().requires_grad_()
        with host_reads() as r:
            real = moe_kernels.launch
            monkeypatch.setattr(moe_kernels, "launch", lambda kernel, lnc: r.outside(real(kernel, lnc)))
            y = ex(xi, idx, twi)
            forward = list(r.reads)
            y.square().mean().backward()
            monkeypatch.setattr(moe_kernels, "launch", real)
        assert forward == ["tolist"] and r.reads == ["tolist"] * (2 if impl else 1), (impl, r.reads)
        results[impl] = (y.detach(), xi.grad, twi.grad, ex.w_gate_up.grad, ex.w_down.grad)
    for got, want in zip(results["nki"], results[None], strict=True):
        assert_close(got, want)
