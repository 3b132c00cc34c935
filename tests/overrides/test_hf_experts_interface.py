"""trnkit's moe_experts selected through transformers' experts-implementation registry."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.overrides.conftest import hf_moe_model
from tests.tolerances import assert_close
from trnkit.overrides import OverrideConstraintError
from trnkit.overrides.hf import register_hf_experts

pytest.importorskip("transformers")
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))


def _run(model):
    model.zero_grad()
    logits = model(input_ids=IDS).logits
    (logits ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_experts_implementation_trnkit_matches_eager():
    name = register_hf_experts("trnkit_test", impl="nki")
    model = hf_moe_model()
    original = copy.deepcopy(model)
    model.set_experts_implementation(name)
    assert model.config._experts_implementation == name
    got, want = _run(model), _run(original)
    assert_close(got[0], want[0])
    for n in want[1]:
        assert_close(got[1][n], want[1][n], msg=n)
    guards = model.model.layers[0].mlp.experts.__dict__["_trnkit_interface_guards"]
    assert guards[name].impl == "nki"


def test_experts_implementation_policies():
    strict = register_hf_experts("trnkit_strict", impl="nki", policy="strict")
    fallback = register_hf_experts("trnkit_fallback", impl="nki", policy="fallback")
    model = hf_moe_model(num_experts=10, num_experts_per_tok=9)  # K = 9 > the kernel's 8
    original = copy.deepcopy(model)
    model.set_experts_implementation(strict)
    with pytest.raises(OverrideConstraintError, match=r"moe_experts\[nki\].*K <= min\(8, E\)"):
        model(input_ids=IDS)
    model.set_experts_implementation(fallback)
    with pytest.warns(UserWarning, match="falls back"):
        logits = model(input_ids=IDS).logits
    # the fallback is the class's eager forward; the original model runs transformers' grouped_mm one
    assert_close(logits.detach(), original(input_ids=IDS).logits.detach())
    with pytest.raises(ValueError, match="policy must be"):
        register_hf_experts("x", policy="off")


def test_registering_a_name_again_reaches_the_modules_that_already_ran():
    """A model keeps one guard per experts module and name; registering the name again with another policy
    (impl, ...) now gives the modules a new guard: the model that fell back under ``fallback`` raises under
    ``strict`` (each module kept its first guard: the fallback went on, and an impl change was ignored)."""
    name = register_hf_experts("trnkit_again", impl="nki", policy="fallback")
    model = hf_moe_model(num_experts=10, num_experts_per_tok=9)  # K = 9 > the kernel's 8
    model.set_experts_implementation(name)
    with pytest.warns(UserWarning, match="falls back"):
        model(input_ids=IDS)
    register_hf_experts(name, impl="nki", policy="strict")
    with pytest.raises(OverrideConstraintError, match=r"moe_experts\[nki\].*K <= min\(8, E\)"):
        model(input_ids=IDS)
