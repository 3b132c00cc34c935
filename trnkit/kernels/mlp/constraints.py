"""Declared input constraints of the dense SwiGLU MLP kernels (shapes, dtypes and settings only: no tensor
values, so they work on fake / meta tensors and under torch.compile)."""

from __future__ import annotations

import math
from typing import Any

from trnkit.kernels._common import dtype_name, shape
from trnkit.kernels.constraints import Violation
from trnkit.kernels.mlp.tiling import plan

DTYPES = ("float32", "bfloat16")


def mlp_constraints(x: Any, w_gate_up: Any, w_down: Any, grad_y: Any = None) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.mlp.mlp` (``grad_y`` given: of ``mlp_bwd``)."""
    name = "mlp" if grad_y is None else "mlp_bwd"
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation(name, rule, value, reason))

    xs, gs, ds = shape(x), shape(w_gate_up), shape(w_down)
    if len(xs) < 1 or min(xs) < 1:
        bad("x is [..., H], every dimension >= 1", xs)
        return v
    H = xs[-1]
    if len(gs) != 2 or gs[0] != H or gs[1] < 2 or gs[1] % 2:
        bad("w_gate_up is [H, 2I] with x's H, I >= 1", gs, f"H = {H}")
        return v
    inter = gs[1] // 2
    if ds != (inter, H):
        bad("w_down is [I, H]", ds, f"I = {inter}, H = {H}")
        return v
    xd = dtype_name(x)
    if xd not in DTYPES:
        bad(f"x.dtype in {DTYPES}", xd)
    for wname, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if dtype_name(w) != xd:
            bad(f"{wname}.dtype == x.dtype", dtype_name(w), f"x.dtype = {xd}: nc_matmul takes one precision")
    if grad_y is not None and (shape(grad_y) != xs or dtype_name(grad_y) != xd):
        bad("grad_y has x's shape and dtype", (shape(grad_y), dtype_name(grad_y)), f"x: {(xs, xd)}")
    if xd in DTYPES and plan(H, inter, 4 if xd == "float32" else 2) is None:
        bad("a token tile's working set fits SBUF (128 tokens, 128-column I-blocks)", f"H={H}, I={inter}, {xd}",
            "the backward keeps a tile's dgu.T (2I x 128) and its rows of H in SBUF: use bfloat16 or smaller H / I")
    rows = math.prod(xs[:-1])
    if rows >= 1 << 31:
        bad("rows < 2**31", rows)
    return v


__all__ = ["DTYPES", "mlp_constraints"]
