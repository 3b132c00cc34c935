"""What every impl of a ``trnkit::`` op may be called with: the ops' input domains, checked before any work by the
op and by its fake (so ``torch.compile`` and the validation dry run refuse the same calls). Each check raises
:class:`trnkit.kernels.constraints.KernelConstraintError` through :func:`~trnkit.kernels.constraints.check`, naming the
op, the rule and the value; a kernel's own constraints (tile sizes, SBUF) stay with its family and the registry."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trnkit.kernels.constraints import Violation, check


def float_violations(op: str, **tensors: Tensor | None) -> list[Violation]:
    """The inputs whose dtype the outputs take must be floating point, for every impl (the reference computed an
    integer or bool x in fp32 and cast the result back, truncating it: an rmsnorm of int64 rows gave 0 / +-1)."""
    return [Violation(f"trnkit::{op}", f"{name} is floating point", str(t.dtype).removeprefix("torch."))
            for name, t in tensors.items() if t is not None and not t.is_floating_point()]

def check_rope_inputs(q: Tensor, k: Tensor, cos: Tensor | None, sin: Tensor | None, rope_cache: Tensor | None,
                       layout: str) -> None:
    """Every impl's domain, checked before any work (and by the fakes): floating-point 4-D q, k and tables; cos and
    sin together or the packed rope_cache, not both (the reference read rope_cache and ignored the given cos / sin
    without a word, and stopped with a TypeError on neither or on cos without sin); tables of D (cache: 2D)
    columns and at least S rows (the reference stopped in a broadcast)."""
    check(float_violations("rope_hf", q=q, k=k, cos=cos, sin=sin, rope_cache=rope_cache))
    given = (cos is not None, sin is not None, rope_cache is not None)
    problem = {(True, True, False): "", (False, False, True): "", (False, False, False): "neither",
               (True, False, False): "cos without sin", (False, True, False): "sin without cos"}.get(given, "both")
    if problem:
        check([Violation("trnkit::rope_hf", "exactly one of (cos, sin) or rope_cache", problem)])
    if q.dim() != 4 or k.dim() != 4:
        check([Violation("trnkit::rope_hf", f"q and k are 4-D ({layout})", (tuple(q.shape), tuple(k.shape)))])
    seq, width = q.shape[2 if layout == "bhsd" else 1], q.shape[-1]
    tables = {"rope_cache": (rope_cache, 2 * width, "2D")} if rope_cache is not None else \
        {"cos": (cos, width, "D"), "sin": (sin, width, "D")}
    check([Violation("trnkit::rope_hf", f"{name} is [S', {cols}] or [B, S', {cols}] with S' >= S", tuple(t.shape),
                     f"S = {seq}, D = {width}")
           for name, (t, n, cols) in tables.items() if t.dim() not in (2, 3) or t.shape[-1] != n or t.shape[-2] < seq])


def check_rope_outs(q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor) -> None:
    """``trnkit::rope_hf``'s preallocated outputs have q's and k's shapes, for every impl (the reference stopped in
    its copy with a broadcast error, and the fake let them through)."""
    check([Violation("trnkit::rope_hf", f"{name} has {src}'s shape", tuple(out.shape), f"{src}: {tuple(t.shape)}")
           for name, src, out, t in (("q_out", "q", q_out, q), ("k_out", "k", k_out, k)) if out.shape != t.shape])


def check_router_inputs(x: Tensor, w_router: Tensor, top_k: int) -> None:
    """Every impl's domain, checked before any work (and by the fake): ``x [T, H]``, ``w_router [E, H]`` (the
    reference otherwise stopped in its matmul), and 1 to E experts picked. A torch top-K of another width (the
    reference's sort slices to min(K, E) columns, or E - 1 for K = -1) would otherwise come back as an impl's
    wrong output shape."""
    if x.dim() != 2 or w_router.dim() != 2 or w_router.shape[1] != x.shape[1]:
        check([Violation("trnkit::router_topk", "x is [T, H] and w_router [E, H]",
                         (tuple(x.shape), tuple(w_router.shape)))])
    experts = w_router.shape[0]
    if not 1 <= top_k <= experts:
        check([Violation("trnkit::router_topk", "1 <= top_k <= E", top_k, f"E = {experts} experts (w_router rows)")])


def eps_violations(op: str, eps: float) -> list[Violation]:
    """A finite ``eps >= 0``, every impl's domain (the reference computed ``rsqrt(mean(x^2) + eps)`` with a negative
    or NaN eps: NaN rows, or a silently different scale)."""
    if math.isfinite(eps) and eps >= 0:
        return []
    return [Violation(f"trnkit::{op}", "eps is a finite float >= 0", eps)]


def norm_violations(op: str, x: Tensor, weight: Tensor, prefix: str = "") -> list[Violation]:
    """Floating-point x and ``weight [H]`` with ``H = x.shape[-1]``, every impl's domain (the reference otherwise
    broadcast a ``[1]`` weight without a word and stopped in a broadcast on other shapes); ``prefix`` names the
    tensor of a pair (``"q: "``)."""
    v = float_violations(op, **{f"{prefix}x": x, f"{prefix}weight": weight})
    if x.dim() < 1 or tuple(weight.shape) != (x.shape[-1],):
        v.append(Violation(f"trnkit::{op}", f"{prefix}weight is [H] with H = x.shape[-1]", tuple(weight.shape),
                           f"x: {tuple(x.shape)}"))
    return v


def check_lce_inputs(op: str, hidden: Tensor, weight: Tensor, labels: Tensor) -> None:
    """The op's layout, every impl's domain, checked before any work (and by the fake): ``hidden [T, H]``,
    ``weight [V, H]``, integer ``labels [T]`` (the reference otherwise truncated float labels to classes
    without a word, and stopped in torch's gather or broadcast on other shapes)."""
    v: list[Violation] = []
    name = f"trnkit::{op}"
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        v.append(Violation(name, "hidden is [T, H] and weight [V, H]", (tuple(hidden.shape), tuple(weight.shape))))
    elif tuple(labels.shape) != (hidden.shape[0],):
        v.append(Violation(name, "labels is [T]", tuple(labels.shape), f"T = {hidden.shape[0]}"))
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        v.append(Violation(name, "labels is an integer tensor", str(labels.dtype).removeprefix("torch.")))
    check(v)


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """The op's layout, every impl's domain, checked before any work (and by the fake): floating-point
    ``q [B, S, Hq, D]``, ``k`` and ``v [B, S, Hk, D]`` with ``Hq`` a multiple of ``Hk >= 1`` (otherwise the
    reference stopped in an einsum, a broadcast or a division by zero, and the fake declared outputs for them)."""
    v_ = float_violations("attention", q=q, k=k, v=v)
    if q.dim() != 4:
        v_.append(Violation("trnkit::attention", "q is [B, S, Hq, D]", tuple(q.shape)))
    elif tuple(k.shape) != tuple(v.shape) or k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != \
            (q.shape[0], q.shape[1], q.shape[3]):
        v_.append(Violation("trnkit::attention", "k and v are [B, S, Hk, D] with q's B, S and D",
                            (tuple(k.shape), tuple(v.shape)), f"q: {tuple(q.shape)}"))
    elif k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        v_.append(Violation("trnkit::attention", "Hq % Hk == 0 with Hk >= 1", (q.shape[2], k.shape[2]),
                            "query head h reads kv head h // (Hq / Hk)"))
    check(v_)


def check_mlp_inputs(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> None:
    """``x [..., H]``, ``w_gate_up [H, 2I]``, ``w_down [I, H]``, every impl's domain, checked before any work (and
    by the fake; the reference otherwise stopped in a broadcast or a matmul), floating point."""
    check(float_violations("mlp", x=x, w_gate_up=w_gate_up, w_down=w_down))
    h = x.shape[-1] if x.dim() else -1
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] != h or w_gate_up.shape[1] % 2 or \
            tuple(w_down.shape) != (w_gate_up.shape[1] // 2, h):
        check([Violation("trnkit::mlp", "x is [..., H], w_gate_up [H, 2I] and w_down [I, H]",
                         (tuple(x.shape), tuple(w_gate_up.shape), tuple(w_down.shape)))])
