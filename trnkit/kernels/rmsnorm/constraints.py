"""Declared input constraints of the RMSNorm kernels (shapes and dtypes only: no tensor values, so they
work on fake / meta tensors and under torch.compile)."""

from __future__ import annotations

import math
from typing import Any


from trnkit.kernels._common import dtype_name, shape
from trnkit.kernels.constraints import Violation

DTYPES = ("float32", "bfloat16")
# Widest row of the backward: it keeps ~8 row tiles of H elements per partition (inputs, gradients,
# products, one row ahead) plus the broadcast weight in 208 KiB of SBUF.
H_MAX = {"bfloat16": 8192, "float32": 4096}
# The forward splits a row wider than ROW_MAX_BYTES into f pieces (a power of two, one per partition),
# so H must divide into them; FWD_H_MAX bounds the weight and row tiles all the same.
ROW_MAX_BYTES = 16384
FWD_H_MAX = 65536


def row_pieces(H: int, dtype: str) -> int:
    """The fewest pieces (a power of two) that split a row of H ``dtype`` elements into pieces of at most
    ``ROW_MAX_BYTES``: the forward's partitions per row for wide rows."""
    isz = 4 if dtype == "float32" else 2
    f = 1
    while H * isz > f * ROW_MAX_BYTES:
        f *= 2
    return f


def out_dtype(x: Any, weight: Any) -> str:
    """The output dtype of ``weight * n`` (n in x's dtype): fp32 if either is fp32."""
    return "float32" if "float32" in (dtype_name(x), dtype_name(weight)) else dtype_name(x)


def _common(name: str, x: Any, weight: Any, bad: Any, backward: bool) -> bool:
    """Rules shared by the forward and the backward; True when the shapes are usable at all."""
    xs, ws = shape(x), shape(weight)
    if len(xs) < 1 or min(xs) < 1:
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
    if xd not in H_MAX:
        return True
    # the backward's rows are as wide as its widest operand: grad_y is fp32 when the weight is
    wide_dt = "float32" if wd == "float32" else xd
    if backward and H < 2:
        # y = w * x / sqrt(x^2 + eps): its gradient w * dy * eps * rstd^3 is the difference of two terms
        # (rstd * gw and the x term) equal to a part in x^2 / eps, finer than the backward's per-row
        # coefficient (bf16 hi + lo parts) and its dy * x product (x's dtype) resolve
        bad("H >= 2", H, "a one-element row's gradient is two terms that cancel to a part in x^2 / eps")
    elif backward and H > H_MAX[wide_dt]:
        bad(f"H <= {H_MAX[wide_dt]} for {wide_dt}", H, "the backward keeps whole rows of every operand in SBUF "
            "(float32 ones when x or the weight is float32)")
    elif not backward and H > FWD_H_MAX:
        bad(f"H <= {FWD_H_MAX}", H, "the forward keeps a row's pieces and the weight in SBUF")
    elif not backward and H % row_pieces(H, xd):
        f = row_pieces(H, xd)
        bad(f"H is a multiple of {f} (a {xd} row of H elements splits into {f} equal pieces)", H,
            f"the forward splits rows over {ROW_MAX_BYTES} bytes into pieces of at most that")
    return True


def rmsnorm_constraints(x: Any, weight: Any, eps: float = 1e-6, residual: Any = None,
                        backward: bool = False) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.rmsnorm.rmsnorm` / ``rmsnorm_residual``; with
    ``backward`` (the caller will need the gradient) also the backward's limit on H, reported under
    ``rmsnorm_bwd``."""
    name = "rmsnorm" if residual is None else "rmsnorm_residual"
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation(name, rule, value, reason))

    def bad_bwd(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation("rmsnorm_bwd", rule, value, reason))

    if not _common(name, x, weight, bad, backward=False):
        return v
    if backward:
        _common("rmsnorm_bwd", x, weight, bad_bwd, backward=True)
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) eps is a symbolic float (NaN fails both)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
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

    if not _common("rmsnorm_bwd", x, weight, bad, backward=True):
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


# rows narrower than this take the narrow-row path (rmsnorm_kernels.WIDE), the only one the q / k pair has
QK_H_LIMIT = 512


def _qk_pair(q: Any, k: Any, weight_q: Any, weight_k: Any, bad: Any) -> None:
    """What the q / k pair adds to each tensor's own rules: one H under the narrow-row limit, one dtype for
    q and k, one for the two weights."""
    qs, ks = shape(q), shape(k)
    if qs[-1:] != ks[-1:]:
        bad("q and k have one H (q.shape[-1] == k.shape[-1])", (qs, ks))
    elif qs and qs[-1] >= QK_H_LIMIT:
        bad(f"H < {QK_H_LIMIT} (the narrow-row path: head_dim)", qs[-1],
            "one launch runs the narrow-row pipeline over both tensors")
    if dtype_name(q) != dtype_name(k):
        bad("q.dtype == k.dtype", (dtype_name(q), dtype_name(k)))
    if dtype_name(weight_q) != dtype_name(weight_k):
        bad("weight_q.dtype == weight_k.dtype", (dtype_name(weight_q), dtype_name(weight_k)))


def _renamed(name: str, found: list[Violation], which: str) -> list[Violation]:
    """One tensor's violations under the pair's kernel name, the tensor named in the rule."""
    return [Violation(name, f"{which}: {v.constraint}", v.value, v.reason) for v in found]


def rmsnorm_qk_constraints(q: Any, k: Any, weight_q: Any, weight_k: Any, eps: float = 1e-6,
                           backward: bool = False) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.rmsnorm.rmsnorm_qk`: each head norm's own
    (:func:`rmsnorm_constraints`, the tensor named in the rule) and the pair's (one H below 512, q and k of one
    dtype, the weights of one dtype); with ``backward`` also the backward's, under ``rmsnorm_qk_bwd``."""
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation("rmsnorm_qk", rule, value, reason))

    for which, x, w in (("q", q, weight_q), ("k", k, weight_k)):
        for u in rmsnorm_constraints(x, w, eps, backward=backward):
            name = "rmsnorm_qk_bwd" if u.kernel == "rmsnorm_bwd" else "rmsnorm_qk"
            v.extend(_renamed(name, [u], which))
    if not v:
        _qk_pair(q, k, weight_q, weight_k, bad)
    return v


def rmsnorm_qk_bwd_constraints(grad_yq: Any, grad_yk: Any, q: Any, k: Any, weight_q: Any, weight_k: Any,
                               rstd_q: Any, rstd_k: Any) -> list[Violation]:
    """Violated constraints of :func:`trnkit.kernels.rmsnorm.rmsnorm_qk_bwd`: each head norm's
    (:func:`rmsnorm_bwd_constraints`, the tensor named in the rule) and the pair's."""
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation("rmsnorm_qk_bwd", rule, value, reason))

    for which, gy, x, w, r in (("q", grad_yq, q, weight_q, rstd_q), ("k", grad_yk, k, weight_k, rstd_k)):
        v.extend(_renamed("rmsnorm_qk_bwd", rmsnorm_bwd_constraints(gy, x, w, r), which))
    if not v:
        _qk_pair(q, k, weight_q, weight_k, bad)
    return v


__all__ = ["DTYPES", "FWD_H_MAX", "H_MAX", "QK_H_LIMIT", "ROW_MAX_BYTES", "out_dtype", "row_pieces",
           "rmsnorm_bwd_constraints", "rmsnorm_constraints", "rmsnorm_qk_bwd_constraints", "rmsnorm_qk_constraints"]
