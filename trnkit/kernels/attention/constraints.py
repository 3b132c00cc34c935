"""Declared input constraints of the flash attention kernels (shapes, dtypes and the scale only: no
tensor values, so they work on fake / meta tensors and under torch.compile)."""

from __future__ import annotations

import math
from typing import Any

from trnkit.kernels._common import dtype_name, shape
from trnkit.kernels.constraints import Violation

DTYPES = ("float32", "bfloat16")
D_MAX = 128  # the head dim is the contraction (partition) dim of q . k: one pass of the PE array
# Longest sequence per dtype: the forward keeps one kv head's K^T and V resident in SBUF
# (S * D * itemsize * 2 / 128 bytes per partition, 128 KiB at D = 128), the rest for the working tiles.
S_MAX = {"bfloat16": 32768, "float32": 16384}


def _common(name: str, q: Any, k: Any, v: Any, scale: Any, bad: Any) -> bool:
    """Rules shared by the forward and the backward; True when the shapes are usable at all."""
    qs, ks, vs = shape(q), shape(k), shape(v)
    if len(qs) != 4 or min(qs) < 1:
        bad("q is [B, S, Hq, D], all >= 1", qs)
        return False
    B, S, Hq, D = qs
    if len(ks) != 4 or ks[0] != B or ks[1] != S or ks[3] != D or ks[2] < 1:
        bad("k is [B, S, Hk, D] with q's B, S and D", ks, f"q: {qs}")
        return False
    if vs != ks:
        bad("v has k's shape", vs, f"k: {ks}")
        return False
    if Hq % ks[2]:
        bad("Hq % Hk == 0 (each kv head serves Hq / Hk query heads)", (Hq, ks[2]))
    dts = (dtype_name(q), dtype_name(k), dtype_name(v))
    if dts[0] not in DTYPES:
        bad(f"q.dtype in {DTYPES}", dts[0])
    elif dts[1] != dts[0] or dts[2] != dts[0]:
        bad("q, k, v share one dtype", dts)
    if D > D_MAX:
        bad(f"D <= {D_MAX}", D, "the head dim is one pass of the 128-row Tensor engine")
    if dts[0] in S_MAX and S > S_MAX[dts[0]]:
        bad(f"S <= {S_MAX[dts[0]]} for {dts[0]}", S, "one kv head's K and V stay resident in SBUF")
    # a comparison, not math.isfinite: under torch.compile(dynamic=True) scale is a symbolic float (NaN fails it)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not 0 < scale < math.inf):
        bad("scale is None or a finite float > 0", scale)
    return True


def attention_constraints(q: Any, k: Any, v: Any, scale: float | None = None) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.attention.attention` (causal GQA attention)."""
    v_: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v_.append(Violation("attention", rule, value, reason))

    _common("attention", q, k, v, scale, bad)
    return v_


def attention_bwd_constraints(q: Any, k: Any, v: Any, o: Any, lse: Any, grad_o: Any,
                              scale: float | None = None) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.attention.attention_bwd`."""
    v_: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v_.append(Violation("attention_bwd", rule, value, reason))

    if not _common("attention_bwd", q, k, v, scale, bad):
        return v_
    B, S, Hq, _ = shape(q)
    for nm, t in (("o", o), ("grad_o", grad_o)):
        if shape(t) != shape(q) or dtype_name(t) != dtype_name(q):
            bad(f"{nm} has q's shape and dtype", (shape(t), dtype_name(t)), f"q: {(shape(q), dtype_name(q))}")
    if shape(lse) != (B, Hq, S) or dtype_name(lse) != "float32":
        bad("lse is [B, Hq, S] float32 (the forward's)", (shape(lse), dtype_name(lse)))
    return v_


__all__ = ["DTYPES", "D_MAX", "S_MAX", "attention_bwd_constraints", "attention_constraints"]
