"""Declared input constraints of the rope_hf kernels (shapes, dtypes and settings only: no tensor values,
so they work on fake / meta tensors and under torch.compile)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trnkit.kernels._common import P_MAX, dtype_name, shape
from trnkit.kernels.constraints import Violation

DTYPES = ("float32", "bfloat16")
BSHD_SLAB_BYTES = 192 * 1024  # SBUF per partition for bshd row slabs (x, y, the previous y; the next x)


def is_contiguous(t: Any) -> bool:
    if isinstance(t, torch.Tensor):
        return t.is_contiguous()
    if isinstance(t, np.ndarray):
        return bool(t.flags.c_contiguous)
    return True  # device / NKI tensors: HBM tensors are dense


def constraints(q: Any, k: Any, cos: Any = None, sin: Any = None, rope_cache: Any = None,
                layout: str = "bhsd", q_out: Any = None, k_out: Any = None) -> list[Violation]:
    """Violated input constraints of :func:`rope_hf` (``layout="bhsd"``) / :func:`rope_hf_bshd` (``"bshd"``).

    Empty list = the kernel serves these inputs. ``q_out``/``k_out`` are checked when given.
    """
    name = "rope_hf" if layout != "bshd" else "rope_hf_bshd"
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation(name, rule, value, reason))

    if layout not in ("bhsd", "bshd"):
        bad("layout in ('bhsd', 'bshd')", layout)
        return v
    dims = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    if len(shape(q)) != 4:
        bad(f"q is 4-D {dims}", shape(q))
    if len(shape(k)) != 4:
        bad(f"k is 4-D {dims}", shape(k))
    if v:
        return v
    if layout == "bhsd":
        (B, Hq, S, D), (Bk, Hk, Sk, Dk) = shape(q), shape(k)
    else:
        (B, S, Hq, D), (Bk, Sk, Hk, Dk) = shape(q), shape(k)
    if (Bk, Sk, Dk) != (B, S, D):
        bad("q and k share B, S and D", {"q": shape(q), "k": shape(k)})
    if min(B, Hq, Hk, S, D) < 1:
        bad("all dimensions >= 1", {"q": shape(q), "k": shape(k)})
    if D % 2:
        bad("D even", D, "rotate-half pairs element i with i + D/2")
    if D > P_MAX:
        bad("D <= 128", D, "the kernel keeps a whole head row in one tile row")
    for tname, t in (("q", q), ("k", k)):
        if dtype_name(t) not in DTYPES:
            bad(f"{tname}.dtype in {DTYPES}", dtype_name(t))
    if dtype_name(k) != dtype_name(q):
        bad("k.dtype == q.dtype", (dtype_name(q), dtype_name(k)))
    isz = 4 if dtype_name(q) == "float32" else 2
    if layout == "bshd" and 3 * max(Hq, Hk) * D * isz > BSHD_SLAB_BYTES:
        bad("3 * max(Hq, Hk) * D * itemsize <= 192 KiB", 3 * max(Hq, Hk) * D * isz,
            "the [B, S, H, D] layout keeps all heads of a row in SBUF (input, output and the previous "
            "output still being stored)")

    have_cs = cos is not None or sin is not None
    if have_cs == (rope_cache is not None):
        bad("exactly one of (cos, sin) or rope_cache", "both" if have_cs else "neither")
        return v
    if have_cs:
        if cos is None or sin is None:
            bad("cos and sin given together", "cos" if sin is None else "sin")
            return v
        if shape(cos) != shape(sin):
            bad("cos.shape == sin.shape", (shape(cos), shape(sin)))
        tabs, width = (("cos", cos), ("sin", sin)), D
    else:
        tabs, width = (("rope_cache", rope_cache),), 2 * D
    for tname, t in tabs:
        shp = shape(t)
        if len(shp) not in (2, 3):
            bad(f"{tname} is 2-D [S, {'D' if have_cs else '2D'}] or 3-D [B, S, ...]", shp)
            continue
        if shp[-1] != width:
            bad(f"{tname}.shape[-1] == {'D' if have_cs else '2*D'}", shp[-1], f"D = {D}")
        if shp[-2] < S:
            bad(f"{tname} rows >= S", shp[-2], f"S = {S}")
        if len(shp) == 3 and shp[0] != B:
            bad(f"{tname}.shape[0] == B", shp[0], f"B = {B}")
        if dtype_name(t) not in DTYPES:
            bad(f"{tname}.dtype in {DTYPES}", dtype_name(t))
    for tname, t, ref in (("q_out", q_out, q), ("k_out", k_out, k)):
        if t is None:
            continue
        if shape(t) != shape(ref) or dtype_name(t) != dtype_name(ref):
            bad(f"{tname} has the shape and dtype of {tname[0]}", (shape(t), dtype_name(t)),
                f"expected {(shape(ref), dtype_name(ref))}")
        if not is_contiguous(t):
            bad(f"{tname} is contiguous", "strided", "the kernel writes it in place as a dense tensor")
    return v
