"""The scalar settings' constraints (attention scale, rmsnorm eps, router routed_scaling_factor, the MoE
experts' swiglu_clamped limit and alpha) written as comparisons, so that torch.compile(dynamic=True) can decide
them on symbolic floats (tests/overrides/test_compile.py), still refuse NaN, infinities and the out-of-range
values, and accept the rest."""

from __future__ import annotations

import math

import pytest
import torch

from trnkit.kernels.attention.constraints import attention_constraints
from trnkit.kernels.moe.constraints import variant_violations
from trnkit.kernels.rmsnorm.constraints import rmsnorm_constraints
from trnkit.kernels.router.constraints import constraints as router_constraints


def _rules(violations) -> list[str]:
    return [v.constraint for v in violations]


@pytest.mark.parametrize("scale, ok", [(None, True), (0.125, True), (2, True), (0.0, False), (-0.1, False),
                                       (math.nan, False), (math.inf, False), (-math.inf, False), (True, False)])
def test_attention_scale(scale, ok: bool) -> None:
    q = torch.empty(1, 2, 16, 64)
    got = _rules(attention_constraints(q, q, q, scale))
    assert got == ([] if ok else ["scale is None or a finite float > 0"])


@pytest.mark.parametrize("eps, ok", [(0.0, True), (1e-6, True), (1, True), (-1e-6, False), (math.nan, False),
                                     (math.inf, False), (False, False)])
def test_rmsnorm_eps(eps, ok: bool) -> None:
    got = _rules(rmsnorm_constraints(torch.empty(4, 64), torch.empty(64), eps))
    assert got == ([] if ok else ["eps is a finite float >= 0"])


@pytest.mark.parametrize("factor, ok", [(1.0, True), (2.5, True), (-1.0, True), (0, True), (math.nan, False),
                                        (math.inf, False), (-math.inf, False), (True, False)])
def test_router_routed_scaling_factor(factor, ok: bool) -> None:
    got = _rules(router_constraints(torch.empty(8, 64), torch.empty(8, 64), 2, routed_scaling_factor=factor))
    assert got == ([] if ok else ["routed_scaling_factor is a finite number"])


@pytest.mark.parametrize("name", ["limit", "alpha"])
@pytest.mark.parametrize("value, ok", [(7.0, True), (1.702, True), (2, True), (0.0, False), (-1.0, False),
                                       (math.nan, False), (math.inf, False), (-math.inf, False), (True, False)])
def test_moe_swiglu_limit_alpha(name: str, value, ok: bool) -> None:
    x, w_gate_up = torch.empty(4, 64), torch.empty(2, 64, 16)
    got = _rules(variant_violations(x, w_gate_up, "swiglu_clamped", **{name: value}))
    assert got == ([] if ok else [f"swiglu_clamped {name} is finite and > 0"])
