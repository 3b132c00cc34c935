"""Qwen3-MoE router: logits, softmax over experts, top-K and renormalisation as NKI kernels (+ backward).


Forward (per token ``t``)::

    logits[t]  = x[t] @ w_router.T                       (fp32 accumulation, rounded to x's dtype)
    p[t]       = softmax(logits[t])                      (fp32)
    idx[t]     = top-K experts of p[t]                   (descending; ties -> lower expert index)
    weights[t] = p[t, idx] / sum_k p[t, idx_k]   if norm_topk_prob else  p[t, idx]

Shapes/dtypes: ``x [T, H]``, ``w_router [E, H]`` (same dtype, fp32 or bf16) -> ``topk_weights [T, K]``
fp32, ``topk_idx [T, K]`` int32, ``router_logits [T, E]`` fp32 (bf16 inputs: values exact in bf16, the
logits ``x @ w.T`` returns in bf16, so experts equal there tie), and with ``return_affinities=True`` also
``affinities [T, E]`` fp32: ``affinities[t, idx[t, k]] = weights[t, k]``, zeros elsewhere (nki-library's
``expert_affinities``; the dense form of the routing weights). ``K <= 8`` (one hardware max8), ``E <= 512``
(one PSUM bank of fp32 per token tile), any H (a short last H block uses fewer partitions), any T.

The kernels: :mod:`~trnkit.kernels.router.router_fwd` (forward, and the design of both) and
:mod:`~trnkit.kernels.router.router_bwd`; the torch references :mod:`~trnkit.kernels.router.router_torch`,
the constraints :mod:`~trnkit.kernels.router.constraints`. The kernel modules (and with them the NKI
backend) are imported on the first call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trnkit.kernels._common import dense
from trnkit.kernels.constraints import Violation, check
from trnkit.kernels.lnc import launch, resolve_lnc
from trnkit.kernels.router.constraints import SCORINGS, constraints
from trnkit.kernels.router.router_torch import router_topk_bwd_ref, router_topk_ref

__all__ = ["SCORINGS", "constraints", "router_topk", "router_topk_bwd", "router_topk_bwd_ref", "router_topk_ref"]


def router_topk(x: Any, w_router: Any, top_k: int, norm_topk_prob: bool = True,
                return_affinities: bool = False, scoring: str = "softmax", selection_bias: Any = None,
                routed_scaling_factor: float = 1.0, lnc: int | None = None) -> tuple[Any, ...]:
    """Qwen3 router on ``x [T, H]`` with ``w_router [E, H]`` (NKI kernel; ``lnc=2``: the tokens split
    over the two cores of a trn2 logical core, results bit-identical to ``lnc=1``).

    Returns ``(topk_weights [T, K] fp32, topk_idx [T, K] int32, router_logits [T, E] fp32)``; experts
    sorted by descending probability, ties broken toward the lower expert index. With
    ``return_affinities=True`` a fourth output ``affinities [T, E] fp32``: the top-K weights (renormalised
    when ``norm_topk_prob``) in their expert columns, zeros elsewhere. ``scoring="sigmoid"``,
    ``selection_bias [E]`` fp32 and ``routed_scaling_factor``: the DeepSeek-V3 variants (module
    docstring). Raises :class:`KernelConstraintError` on unsupported inputs.
    """
    check(constraints(x, w_router, top_k, return_affinities, scoring, selection_bias, routed_scaling_factor))
    lnc = resolve_lnc(lnc)
    from trnkit.kernels.router.router_fwd import router_topk_kernel

    return launch(router_topk_kernel, lnc)(dense(x), dense(w_router), int(top_k), norm_topk_prob=bool(norm_topk_prob),
                              return_affinities=bool(return_affinities), scoring=scoring,
                              selection_bias=dense(selection_bias),
                              routed_scaling_factor=float(routed_scaling_factor))


def router_topk_bwd(x: Any, w_router: Any, router_logits: Any, topk_idx: Any, grad_topk_weights: Any,
                    grad_router_logits: Any = None, norm_topk_prob: bool = True, scoring: str = "softmax",
                    routed_scaling_factor: float = 1.0, lnc: int | None = None) -> tuple[Any, Any]:
    """Input gradients of :func:`router_topk`: ``(grad_x [T, H] x.dtype, grad_w_router [E, H] w.dtype)``
    from ``grad_topk_weights [T, K]`` (and ``grad_router_logits [T, E]`` if the logits are used too).
    ``lnc=2``: the tokens split over two cores; ``grad_x`` bit-identical to ``lnc=1``, ``grad_w`` the sum
    of the two cores' fp32 partials (another summation order)."""
    K = int(topk_idx.shape[1]) if len(topk_idx.shape) == 2 else -1
    v = constraints(x, w_router, K, scoring=scoring, routed_scaling_factor=routed_scaling_factor)
    T = int(x.shape[0]) if len(x.shape) == 2 else -1
    E = int(w_router.shape[0]) if len(w_router.shape) == 2 else -1
    for tname, t, shp in (("router_logits", router_logits, (T, E)), ("topk_idx", topk_idx, (T, K)),
                          ("grad_topk_weights", grad_topk_weights, (T, K)),
                          ("grad_router_logits", grad_router_logits, (T, E))):
        if t is not None and tuple(t.shape) != shp:
            v.append(Violation("router_topk_bwd", f"{tname}.shape == {shp}", tuple(t.shape)))
    check(v)
    lnc = resolve_lnc(lnc)
    to_f32 = (lambda t: t.float()) if isinstance(x, torch.Tensor) else (lambda t: np.asarray(t, np.float32))
    to_i32 = (lambda t: t.to(torch.int32)) if isinstance(x, torch.Tensor) else (lambda t: np.asarray(t, np.int32))
    gl = grad_router_logits
    from trnkit.kernels.router.router_bwd import router_topk_bwd_kernel

    return launch(router_topk_bwd_kernel, lnc)(
        dense(x), dense(w_router), dense(to_f32(router_logits)), dense(to_i32(topk_idx)),
        dense(to_f32(grad_topk_weights)), None if gl is None else dense(to_f32(gl)),
        has_grad_logits=gl is not None, norm_topk_prob=bool(norm_topk_prob), scoring=scoring,
        routed_scaling_factor=float(routed_scaling_factor))
