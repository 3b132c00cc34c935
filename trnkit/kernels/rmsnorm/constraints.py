"""Declared input constraints of the RMSNorm kernels (shapes and dtypes only: no tensor values, so they
work on fake / meta tensors and under torch.compile)."""

from __future__ import annotations

import math
from typing import Any


from trnkit.kernels._common import dtype_name, shape
from trnkit.kernels.constraints import Violation

DTYPES = ("float32", "bfloat16")
# Widest row each dtype supports: the backward keeps ~8 row tiles of H elements per partition (inputs,
# gradients, products, one row ahead) plus the broadcast weight in 208 KiB of SBUF.
H_MAX = {"bfloat16": 8192, "float32": 4096}


def out_dtype(x: Any, weight: Any) -> str:
    """The output dtype of ``weight * n`` (n in x's dtype): fp32 if either is fp32."""
    return "float32" if "float32" in (dtype_name(x), dtype_name(weight)) else dtype_name(x)


def _common(name: str, x: Any, weight: Any, bad: Any) -> bool:
    """Rules shared by the forward and the backward; True when the shapes are usable at all."""
    xs, ws = shape(x), shape(weight)
    if len(xs) < 1 or min(xs, default=0) < 1:
        bad("x has >= 1 dimension, all >= 1 (rows x H)", xs)
        return False
    if ws != (xs[-1],):
        bad("weight is [H] with H = x.shape[-1]", ws, f"x: {xs}")
        return False
    xd, wd = dtype_name(x), dtype_name(weight)
    if xd not in DTYPES:
        bad(f"x.dtype in {DTYPES}", xd)
    if wd not in (xd, "float32"):
        bad("weight.dtype == x.dtype or float32", wd, f"x.dtype = {xd}")
    H = xs[-1]
    if xd in H_MAX and H > H_MAX[xd]:
        bad(f"H <= {H_MAX[xd]} for {xd}", H, "the backward keeps whole rows of every operand in SBUF")
    return True


def rmsnorm_constraints(x: Any, weight: Any, eps: float = 1e-6, residual: Any = None) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.rmsnorm.rmsnorm` / ``rmsnorm_residual``."""
    name = "rmsnorm" if residual is None else "rmsnorm_residual"
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation(name, rule, value, reason))

    if not _common(name, x, weight, bad):
        return v
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        bad("eps is a finite float >= 0", eps)
    if residual is not None and (shape(residual) != shape(x) or dtype_name(residual) != dtype_name(x)):
        bad("residual has x's shape and dtype", (shape(residual), dtype_name(residual)),
            f"x: {(shape(x), dtype_name(x))}")
    return v


def rmsnorm_bwd_constraints(grad_y: Any, x: Any, weight: Any, rstd: Any, grad_s: Any = None) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.rmsnorm.rmsnorm_bwd`."""
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation("rmsnorm_bwd", rule, value, reason))

    if not _common("rmsnorm_bwd", x, weight, bad):
        return v
    want = out_dtype(x, weight)
    if shape(grad_y) != shape(x) or dtype_name(grad_y) != want:
        bad("grad_y has x's shape and the output dtype", (shape(grad_y), dtype_name(grad_y)),
            f"expected {(shape(x), want)}")
    rows = math.prod(shape(x)[:-1])
    if shape(rstd) != (rows,) or dtype_name(rstd) != "float32":
        bad("rstd is [rows] float32 (the forward's)", (shape(rstd), dtype_name(rstd)), f"rows = {rows}")
    if grad_s is not None and (shape(grad_s) != shape(x) or dtype_name(grad_s) != dtype_name(x)):
        bad("grad_s has x's shape and dtype", (shape(grad_s), dtype_name(grad_s)))
    return v


__all__ = ["DTYPES", "H_MAX", "out_dtype", "rmsnorm_bwd_constraints", "rmsnorm_constraints"]
