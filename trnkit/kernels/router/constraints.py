"""Declared input constraints of the router top-k kernels (shapes, dtypes and settings only: no tensor
values, so they work on fake / meta tensors and under torch.compile), and the SBUF estimate they use."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trnkit.kernels._common import P_MAX, cdiv, dtype_name
from trnkit.kernels.constraints import Violation

K_MAX = 8  # one max8 instruction
E_MAX = 512
DTYPES = ("float32", "bfloat16")
SBUF_BUDGET = 200 * 1024  # of the ~208 KiB usable per partition (trn2)
SCORINGS = ("softmax", "sigmoid")
SIGMOID_NORM_EPS = 1e-20  # transformers' DeepSeek-V3 / GLM-4-MoE routers: sum + 1e-20


# Token tiles whose backward g_logits steps are issued in lockstep (latency hiding), at most 4 and
# within ~96 KiB of SBUF per partition (~4K + 24 bytes per expert per tile: K fp32 one-hot products, the
# dense sum, its bf16 parts, ...). Cost model, T=8192 H=2048 E=128 K=8 bf16, optimistic / mid /
# pessimistic: 4 tiles 267 / 272 / 294 us, 2 tiles 254 / 271 / 310 us, 8 tiles 286 / 293 / 320 us.
def bwd_group(E, K):
    return max(1, min(4, 96 * 1024 // ((6 * K + 24) * E)))


def sbuf_bytes(H: int, E: int, K: int, itemsize: int, return_affinities: bool = False,
                sigmoid: bool = False) -> int:
    """Peak SBUF bytes per partition of the kernels at their smallest tiling: forward = w^T
    (ceil(H/128)*E) + x slabs of two pipeline stages and their transposes (4*H) + one w row block (H)
    (+ with affinities: up to 4 sub-tiles of fp32 affinities and one sub-tile's marked logits, mask,
    exponentials and weights, 14*E bytes);
    backward = w (ceil(E/128)*H) + x / grad_x rows (2*H) + one group of g_logits tiles."""
    fwd = (cdiv(H, P_MAX) * E + 5 * H) * itemsize
    if return_affinities:
        fwd += 4 * 4 * E + 14 * E
    if sigmoid:  # the broadcast bias, the scores, s + bias and one one-hot product (fp32)
        fwd += 16 * E
    bwd = (cdiv(E, P_MAX) * H + 2 * H) * itemsize + bwd_group(E, K) * (6 * K + 24) * E
    return max(fwd, bwd)


def constraints(x: Any, w_router: Any, top_k: int, return_affinities: bool = False, scoring: str = "softmax",
                selection_bias: Any = None, routed_scaling_factor: float = 1.0) -> list[Violation]:
    """Violated input constraints of :func:`router_topk` / :func:`router_topk_bwd` (empty = supported);
    ``return_affinities`` adds the SBUF of the dense affinities to the estimate."""
    name = "router_topk"
    v: list[Violation] = variant_violations(w_router, return_affinities, scoring, selection_bias,
                                             routed_scaling_factor)
    xs, ws = tuple(x.shape), tuple(w_router.shape)
    if len(xs) != 2:
        v.append(Violation(name, "x is 2-D [T, H]", xs))
    if len(ws) != 2:
        v.append(Violation(name, "w_router is 2-D [E, H]", ws))
    if v:
        return v
    T, H = xs
    E, Hw = ws
    if Hw != H:
        v.append(Violation(name, "w_router.shape[1] == H", Hw, f"x has H = {H}"))
    if T < 1 or H < 1 or E < 1:
        v.append(Violation(name, "T, H, E >= 1", {"T": T, "H": H, "E": E}))
    if E > E_MAX:
        v.append(Violation(name, "E <= 512", E, "the logits of a token tile must fit one PSUM bank"))
    k_ok = False
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        v.append(Violation(name, "top_k is an int", type(top_k).__name__, f"value {top_k!r}"))
    elif not 1 <= top_k <= K_MAX:
        v.append(Violation(name, "1 <= top_k <= 8", int(top_k), "top-K is one hardware max8"))
    elif top_k > E:
        v.append(Violation(name, "top_k <= E", int(top_k), f"E = {E}"))
    else:
        k_ok = True
    for tname, t in (("x", x), ("w_router", w_router)):
        if dtype_name(t) not in DTYPES:
            v.append(Violation(name, f"{tname}.dtype in {DTYPES}", dtype_name(t)))
    if dtype_name(w_router) != dtype_name(x):
        v.append(Violation(name, "w_router.dtype == x.dtype", (dtype_name(x), dtype_name(w_router)),
                           "the Tensor engine needs both operands fp32 or both bf16"))
    if k_ok:
        need = sbuf_bytes(H, E, int(top_k), 4 if dtype_name(x) == "float32" else 2, bool(return_affinities),
                           scoring == "sigmoid")
        if need > SBUF_BUDGET:
            v.append(Violation(name, "SBUF per partition <= 200 KiB", need,
                               "w_router stays resident in SBUF next to at least one x slab per pipeline "
                               "stage (about ceil(H/128)*E + ceil(E/128)*H + 5*H elements); reduce H or E"))
    return v


def variant_violations(w_router: Any, return_affinities: bool, scoring: str, selection_bias: Any,
                        routed_scaling_factor: float) -> list[Violation]:
    """The scoring / selection-bias / scaling rules (shapes and types only, no tensor values)."""
    name = "router_topk"
    v: list[Violation] = []
    if scoring not in SCORINGS:
        return [Violation(name, f"scoring in {SCORINGS}", scoring)]
    # a comparison, not math.isfinite: under torch.compile(dynamic=True) the factor is a symbolic float
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) \
            or not -math.inf < routed_scaling_factor < math.inf:
        v.append(Violation(name, "routed_scaling_factor is a finite number", routed_scaling_factor))
    if scoring == "sigmoid" and return_affinities:
        v.append(Violation(name, "return_affinities with scoring='softmax'", scoring,
                           "the dense affinities are built for softmax scores only"))
    if selection_bias is None:
        return v
    if scoring != "sigmoid":
        v.append(Violation(name, "selection_bias with scoring='sigmoid'", scoring,
                           "choosing by softmax + bias would need the probabilities over E first"))
    E = w_router.shape[0] if len(w_router.shape) == 2 else None
    if tuple(selection_bias.shape) != (E,):
        v.append(Violation(name, "selection_bias.shape == (E,)", tuple(selection_bias.shape)))
    if dtype_name(selection_bias) != "float32":
        v.append(Violation(name, "selection_bias.dtype == float32", dtype_name(selection_bias)))
    return v
