"""Declared input constraints of the fused linear cross-entropy kernels (shapes, dtypes and settings
only: no tensor values, so they work on fake / meta tensors and under torch.compile)."""

from __future__ import annotations

from typing import Any

from trnkit.kernels._common import dtype_name, shape
from trnkit.kernels.constraints import Violation

DTYPES = ("float32", "bfloat16")
REDUCTIONS = ("mean", "sum")
# The backward sums each [128, H] gradient product in PSUM banks of 512 fp32 columns (one accumulation group
# each) next to a bank of logits and one of dl's transposes: ceil(H / 512) + 2 <= 8 banks (Qwen3 up to 4B:
# H 2560; 30B-A3B: 2048).
H_MAX = 3072
# labels are compared as fp32 values: every index below 2^24 is exact.
V_MAX = 1 << 24


def linear_cross_entropy_constraints(hidden: Any, weight: Any, labels: Any, ignore_index: int = -100,
                                     reduction: str = "mean", name: str = "linear_cross_entropy"
                                     ) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.cross_entropy.linear_cross_entropy` (and its backward)."""
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation(name, rule, value, reason))

    hs, ws, ls = shape(hidden), shape(weight), shape(labels)
    if len(hs) != 2 or min(hs) < 1:
        bad("hidden is [T, H], T and H >= 1", hs)
        return v
    if len(ws) != 2 or ws[1] != hs[1] or ws[0] < 1:
        bad("weight is [V, H] with hidden's H, V >= 1", ws, f"hidden: {hs}")
        return v
    if ls != (hs[0],):
        bad("labels is [T]", ls, f"T = {hs[0]}")
    hd, wd = dtype_name(hidden), dtype_name(weight)
    if hd not in DTYPES:
        bad(f"hidden.dtype in {DTYPES}", hd)
    if wd != hd:
        bad("weight.dtype == hidden.dtype", wd, f"hidden.dtype = {hd}")
    if not dtype_name(labels).startswith(("int", "uint")):
        bad("labels is an integer tensor", dtype_name(labels))
    if hs[1] > H_MAX:
        bad(f"H <= {H_MAX}", hs[1],
            "the backward sums a [128, H] product in ceil(H/512) PSUM banks + 2 for logits and transposes")
    if ws[0] >= V_MAX:
        bad("V < 2**24", ws[0], "labels are compared as fp32 values")
    if reduction not in REDUCTIONS:
        bad(f"reduction in {REDUCTIONS}", reduction)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        bad("ignore_index is an int", ignore_index)
    return v


__all__ = ["DTYPES", "H_MAX", "REDUCTIONS", "linear_cross_entropy_constraints"]
