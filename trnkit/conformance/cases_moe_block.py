"""Conformance cases of nki-library's core/moe_block kernel (token generation), written from its test file.

``test/integration/nkilib/core/moe_block/test_moe_block_tkg.py`` (``test_moe_block_kernel_unit``, the
``MANUAL_PARAMS`` rows whose expert weights are not MX, which only trn3 runs): ``moe_block_tkg``
(RMS norm, router top-k, the selected or all experts) against ``moe_block_tkg_torch_ref`` at rtol 1e-2
(5e-2 for low-precision fp8 weights) / atol 1e-5, LNC 2. Inputs as the test's ``generate_inputs``
draws them from ``default_rng(42)``: the input, gamma and router weights uniform in [-0.1, 0.1) (cast
to the input / router dtype), the expert gate-up and down weights normal (cast to the weight dtype),
then the router bias (uniform) and the expert biases (normal); with all experts on a rank, the rank
from ``RandomState(42).randint(0, ranks)``. Clamp limits as the test's ``_get_clamp_limits``: gate
at most 7, up in [-6, 8].
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .harness import BF16_UNIT, Case, TappedReference, TileCheck, _resolve, drawn_array

__all__ = ["moe_block_case", "moe_block_cases", "routed_as_kernel", "routing_projection"]

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core/moe_block"
_DT = {F16: "fp16", BF16: "bf16", FP8: "fp8"}


def _inputs(all_expert: bool, b: int, s: int, h: int, h_actual: int | None, i: int, e_global: int, e_local: int,
            k: int, act: str, w_dt: np.dtype, in_dt: np.dtype, bias: bool, clamp: bool, pre_norm: bool,
            norm_topk: bool, router_dt: np.dtype, router: str = "SOFTMAX") -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        types = importlib.import_module(f"{LIB}.utils.common_types")
        np.random.seed(42)
        rng = np.random.default_rng(42)
        uniform = lambda shape, dt: rng.uniform(low=-0.1, high=0.1, size=shape).astype(dt)  # noqa: E731
        out: dict[str, Any] = {"inp": uniform((b, s, h), in_dt), "gamma": uniform((1, h), in_dt),
                               "router_weights": uniform((h, e_global), router_dt)}
        # (drawn a chunk at a time: the same values and generator state as the one-shot draw, without its float64)
        out["expert_gate_up_weights"] = drawn_array(lambda n: rng.normal(size=n), (e_local, h, 2, i), w_dt, via=None)
        out["expert_down_weights"] = drawn_array(lambda n: rng.normal(size=n), (e_local, i, h), w_dt, via=None)
        out["expert_gate_up_weights_scale"] = out["expert_down_weights_scale"] = None
        out["router_bias"] = uniform((1, e_global), router_dt) if bias else None
        out["expert_gate_up_bias"] = rng.normal(size=(e_local, 2, i)).astype(in_dt) if bias else None
        out["expert_down_bias"] = rng.normal(size=(e_local, h)).astype(in_dt) if bias else None
        rank = np.random.RandomState(42).randint(0, e_global // e_local) if all_expert else None
        out.update(
            top_k=k, router_act_fn=getattr(types.RouterActFnType, router), router_pre_norm=pre_norm,
            norm_topk_prob=norm_topk, expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
            hidden_act_fn=getattr(types.ActFnType, act), gate_clamp_upper_limit=7.0 if clamp else None,
            gate_clamp_lower_limit=None, up_clamp_upper_limit=8.0 if clamp else None,
            up_clamp_lower_limit=-6.0 if clamp else None, router_mm_dtype=router_dt, hidden_actual=h_actual,
            skip_router_logits=False, is_all_expert=all_expert,
            rank_id=np.array([[rank]], dtype=np.uint32) if all_expert else None)
        return out
    return make


# MANUAL_PARAMS without MX weights: is_all_expert, batch, seqlen, hidden, hidden_actual, intermediate, global
# experts, local experts, top_k, activation, weight dtype, input dtype, bias, clamp, router_act_first,
# norm_topk_prob, router dtype (router softmax, post-scaling, no shared expert, router logits kept)
_SWISH = ("Swish", F16, F16, True, True, False, False, F16)
_SILU_BF16 = ("SiLU", BF16, BF16, False, False, True, True, BF16)
_SILU_FP8 = ("SiLU", FP8, BF16, False, False, True, True, BF16)
_ROWS = [
    (False, 1, 1, 3072, None, 384, 128, 128, 4, *_SWISH), (False, 1, 4, 3072, 2880, 384, 128, 128, 4, *_SWISH),
    (False, 1, 1, 3072, None, 192, 128, 128, 4, *_SWISH), (False, 1, 1, 3072, None, 576, 128, 128, 4, *_SWISH),
    (False, 1, 4, 3072, 2880, 192, 128, 128, 4, *_SWISH), (False, 1, 5, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 4, 1, 3072, 2880, 192, 128, 128, 4, *_SWISH), (False, 8, 1, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 16, 1, 3072, 2880, 128, 128, 128, 4, *_SWISH), (False, 19, 1, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 32, 1, 3072, None, 128, 128, 128, 4, *_SWISH), (False, 38, 1, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 120, 1, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 1, 1, 4096, None, 384, 128, 128, 8, *_SILU_BF16), (False, 1, 1, 4096, None, 384, 128, 128, 8, *_SILU_FP8),
    (True, 19, 1, 3072, None, 128, 128, 1, 4, *_SWISH), (True, 32, 1, 3072, None, 128, 128, 1, 4, *_SWISH),
    (True, 32, 1, 3072, None, 384, 128, 1, 4, *_SWISH), (True, 32, 1, 3072, None, 768, 128, 1, 4, *_SWISH),
    (True, 32, 1, 3072, None, 768, 128, 4, 4, *_SWISH), (True, 32, 1, 3072, None, 1536, 128, 1, 4, *_SWISH),
    (True, 32, 1, 3072, None, 1536, 128, 2, 4, *_SWISH), (True, 32, 1, 3072, None, 3072, 128, 1, 4, *_SWISH),
    (True, 16, 1, 4096, None, 1536, 128, 2, 8, *_SILU_BF16), (True, 16, 1, 4096, None, 384, 128, 128, 8, *_SILU_BF16),
    (True, 16, 1, 4096, None, 384, 128, 8, 8, *_SILU_FP8),
]


def moe_block_case(all_e: bool, b: int, s: int, h: int, ha: int | None, i: int, eg: int, el: int, k: int, act: str,
                   w_dt: np.dtype, in_dt: np.dtype, bias: bool, clamp: bool, pre: bool, norm_topk: bool,
                   r_dt: np.dtype, router: str = "SOFTMAX") -> Case:
    """One row of ``test_moe_block_tkg.py`` without MX weights (post-scaling, router logits kept).

    A row with a bf16 input and router has the routing check (:data:`ROUTING`), selective or all experts; an
    all-experts row without ``router_act_first`` reads the kernel's chosen experts off its nonzero affinities
    (:data:`ROUTING_BY_AFFINITIES`): there the kernel writes no chosen-experts tile (``_router_topk``'s
    ``skip_store_expert_index``, as ``moe_block_tkg`` sets it for all experts without ``router_pre_norm``)."""
    flags = ["all experts" if all_e else "selective", act, f"{_DT[w_dt]} weights", f"{_DT[in_dt]} input"] \
        + [f"{router.lower()} router"] * (router != "SOFTMAX") + ["bias"] * bias + ["clamp"] * clamp \
        + ["router_act_first"] * pre + ["norm_topk_prob"] * norm_topk + ([f"hidden_actual={ha}"] if ha else [])
    return Case(
        kernel="core/moe_block/moe_block_tkg", name=" ".join(flags),
        shapes=f"B={b} S={s} H={h} I={i} E={eg}/{el} k={k}",
        entry=f"{LIB}.moe_block.moe_block_tkg:moe_block_tkg",
        reference=f"{LIB}.moe_block.moe_block_tkg_torch:moe_block_tkg_torch_ref",
        inputs=_inputs(all_e, b, s, h, ha, i, eg, el, k, act, w_dt, in_dt, bias, clamp, pre, norm_topk, r_dt, router),
        outputs=("out", "router_logits"), lnc=2, rtol=5e-2 if w_dt == FP8 else 1e-2, atol=1e-5,
        test_file=f"{TESTS}/test_moe_block_tkg.py",
        tapped_reference=None if in_dt != BF16 or r_dt != BF16 else ROUTING if pre or not all_e
        else ROUTING_BY_AFFINITIES)


ROUTER_TAP = f"{LIB}.moe_block.moe_block_tkg:_router_topk"  # (router_logits, expert_index [T, K], affinities, ...)
REFERENCE = f"{LIB}.moe_block.moe_block_tkg_torch:moe_block_tkg_torch_ref"


def _router_tiles(taps: dict[str, list], by_affinities: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's router logits (bf16 [T, E]) and chosen experts ([T, K]) from the router tap: every program
    records the same (both LNC 2 programs hold every token's), else ValueError. Past 128 tokens (all experts) the
    chosen experts' SBUF tile is folded, [128, T/128, K], token ``n * 128 + p`` at ``[p, n]`` (``moe_block_tkg``'s
    ``get_sbuf_tensor_shape``; ``router_topk`` stores it to HBM through that view): unfolded here.

    ``by_affinities`` (all experts without ``router_pre_norm``, where ``router_topk`` leaves that tile unwritten,
    ``skip_store_expert_index``): each token's chosen experts are those with a nonzero affinity in the kernel's
    affinities ([T, E] float32 in HBM: its top-K values' softmax scattered into zeros), largest first; exactly K
    of them, else ValueError naming the token (K: the unwritten tile's last axis)."""
    calls = taps[ROUTER_TAP]

    def unfold(value: Any) -> np.ndarray:
        index = np.asarray(value[1], np.int64)
        if by_affinities:
            k, aff = index.shape[-1], np.asarray(value[2], np.float64)
            rows = []
            for tok, row in enumerate(aff):
                nonzero = np.flatnonzero(row)
                if len(nonzero) != k:
                    raise ValueError(f"moe_block_tkg router tap: token {tok} has {len(nonzero)} nonzero affinities, "
                                     f"not top_k = {k}: its chosen experts cannot be read off them")
                rows.append(nonzero[np.argsort(-row[nonzero], kind="stable")])
            return np.array(rows, np.int64).reshape(-1, k)
        return index.transpose(1, 0, 2).reshape(-1, index.shape[2]) if index.ndim == 3 else index

    logits, index = np.asarray(calls[0][2][0], np.float64), unfold(calls[0][2])
    for rank, program, value in calls[1:]:
        if not (np.array_equal(np.asarray(value[0], np.float64), logits)
                and np.array_equal(unfold(value), index)):
            raise ValueError(f"moe_block_tkg router tap: program {program} of rank {rank} holds other logits or "
                             "expert indices than program 0")
    if index.shape[0] != logits.shape[0]:
        raise ValueError(f"moe_block_tkg router tap: chosen experts of {index.shape[0]} tokens, logits of "
                         f"{logits.shape[0]}")
    return logits, index


def routing_projection(inputs: dict[str, Any], taps: dict[str, list], run: Callable[..., dict],
                       by_affinities: bool = False) -> list:
    """The kernel's router logits against the exact logits of its own inputs, and its routing against the golden's.

    Exact logits (float64): RMS norm of ``inp`` over ``hidden_actual`` (eps 1e-6, as the kernel's default) times
    ``gamma``, times ``router_weights``, plus ``router_bias``. The kernel rounds the normalized input to a bf16 tile
    (the router's matmul input, ``router_mm_dtype`` bf16) and the logits to bf16 (its ``router_logits`` tile has
    the input's dtype), accumulating over H in float32 PSUM and adding the bias in float32: 2 bf16 roundings +
    (H + 1) float32 ones (2^-16 of a bf16 one each; :func:`~trnkit.conformance.harness.within_roundings`).

    The routing (a :class:`TileCheck`): each token's chosen experts are K distinct experts and a top-K of the
    kernel's own logits (none unchosen above a chosen one); where the chosen set differs from the golden's
    (top-K of nki-library's float32 logits), every expert in the difference has an exact logit within the logits'
    bound (``roundings * 2^-8 * max|exact|`` of its token) of the token's K-th largest exact logit: a near tie
    the kernel's roundings can decide either way. Every other token is routed as the golden routes.

    All experts (``is_all_expert``): the same conditions on every token and expert, the rank's own or not (a swap
    between two other ranks' experts changes only the top-K normalization of the rank's affinities); each differing
    token's message names the experts of the difference that are the rank's own, the ones whose MLPs change its
    ``out``. ``by_affinities``: the chosen experts read off the kernel's nonzero affinities (:func:`_router_tiles`).
    """
    x = np.asarray(inputs["inp"], np.float64)
    t, h = x.shape[0] * x.shape[1], x.shape[2]
    x = x.reshape(t, h)
    h_actual = inputs.get("hidden_actual") or h
    rms = np.sqrt((x ** 2).sum(axis=1, keepdims=True) / h_actual + 1e-6)
    norm = x / rms * np.asarray(inputs["gamma"], np.float64).reshape(1, h)
    exact = norm @ np.asarray(inputs["router_weights"], np.float64)
    if inputs.get("router_bias") is not None:
        exact = exact + np.asarray(inputs["router_bias"], np.float64).reshape(1, -1)
    roundings = 2 + (h + 1) * 2.0 ** -16
    logits, index = _router_tiles(taps, by_affinities)
    k = index.shape[1]
    golden = np.asarray(run(lambda kw: kw)["router_logits"], np.float64).reshape(t, -1)
    gold_sel = np.argsort(-golden, axis=1, kind="stable")[:, :k]
    bound = roundings * BF16_UNIT * np.abs(exact).max(axis=1)
    kth = -np.sort(-exact, axis=1)[:, k - 1]
    worst, differ = 0.0, []
    local = range(0)  # all experts: the rank's own experts, the only ones whose MLPs add to its out
    if inputs.get("is_all_expert"):
        e_local = np.asarray(inputs["expert_gate_up_weights"]).shape[0]
        rank = int(np.asarray(inputs["rank_id"]).reshape(-1)[0])
        local = range(rank * e_local, (rank + 1) * e_local)
    for tok in range(t):
        chosen = set(index[tok].tolist())
        if len(chosen) != k or not all(0 <= e < logits.shape[1] for e in chosen):
            return [("router logits", logits, exact, roundings, False),
                    TileCheck("routing", False, float("inf"), f"token {tok}: chosen experts {index[tok].tolist()} "
                              f"are not {k} distinct experts of {logits.shape[1]}")]
        rest = np.setdiff1d(np.arange(logits.shape[1]), index[tok])
        if logits[tok, index[tok]].min() < logits[tok, rest].max():
            return [("router logits", logits, exact, roundings, False),
                    TileCheck("routing", False, float("inf"), f"token {tok}: the kernel's experts "
                              f"{index[tok].tolist()} are not a top-{k} of its own router logits (chosen min "
                              f"{logits[tok, index[tok]].min():.5g} < unchosen max {logits[tok, rest].max():.5g})")]
        swapped = sorted(chosen ^ set(gold_sel[tok].tolist()))
        if swapped:
            gaps = {e: abs(exact[tok, e] - kth[tok]) for e in swapped}
            share = max(gaps.values()) / bound[tok]
            worst = max(worst, share)
            differ.append(f"token {tok}: golden {sorted(set(gold_sel[tok].tolist()) - chosen)} -> kernel "
                          f"{sorted(chosen - set(gold_sel[tok].tolist()))}, exact logits "
                          + ", ".join(f"{exact[tok, e]:.5f}" for e in swapped) + f" against the K-th {kth[tok]:.5f}"
                          f" ({share:.2f} of the bound {bound[tok]:.2g})"
                          + (f", of them on this rank {[e for e in swapped if e in local]}" if local else ""))
            if share > 1:
                return [("router logits", logits, exact, roundings, False),
                        TileCheck("routing", False, share, "not a near tie: " + differ[-1])]
    figures = (f"{len(differ)} of {t} tokens routed otherwise than the golden, each a near tie: " + "; ".join(differ)
               if differ else f"all {t} tokens routed as the golden")
    return [("router logits", logits, exact, roundings, False), TileCheck("routing", True, worst, figures)]


@contextlib.contextmanager
def routed_as_kernel(root: Path, taps: dict[str, list], by_affinities: bool = False) -> Iterator[None]:
    """Inside the block nki-library's router reference (``router_topk_torch_ref``, as ``moe_block_tkg_torch_ref``
    calls it) takes each token's experts as the kernel chose them: its one ``torch.argsort`` of the logits returns,
    per token, the kernel's K experts first (in the kernel's order), then the others in the reference's own order.
    Everything after the selection (the affinities from the float32 logits, the experts' MLPs) is the reference's
    own arithmetic: exact for any token and any number of tokens, where nudging a shared router bias would move
    other tokens' logits too."""
    import torch

    router = _resolve(REFERENCE, root).__globals__["router_topk_torch_ref"]
    module = router.__globals__
    _, index = _router_tiles(taps, by_affinities)

    class Routed:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def argsort(values: Any, dim: int = -1, **kw: Any) -> Any:
            order = torch.argsort(values, dim=dim, **kw)
            if dim not in (-1, 1) or tuple(order.shape) != (index.shape[0], order.shape[-1]):
                raise ValueError(f"moe_block_tkg routed reference: argsort of shape {tuple(order.shape)} on dim "
                                 f"{dim}, expected [{index.shape[0]}, E] on the experts' axis")
            rows = []
            for tok, first in enumerate(index.tolist()):
                rest = [e for e in order[tok].tolist() if e not in first]
                rows.append(first + rest)
            return torch.tensor(rows, dtype=order.dtype)

    saved = module["torch"]
    module["torch"] = Routed()
    try:
        yield
    finally:
        module["torch"] = saved


ROUTING = TappedReference(
    what="router logits and routing (the reference routed each token as the kernel routes it)",
    taps=(ROUTER_TAP,), projection=routing_projection, ref_inputs=lambda kw, taps: kw, during=routed_as_kernel)
# all experts without router_act_first: the kernel's chosen experts read off its nonzero affinities
ROUTING_BY_AFFINITIES = TappedReference(
    what="router logits and routing (the kernel's chosen experts read off its nonzero affinities; the reference "
         "routed each token as the kernel routes it)",
    taps=(ROUTER_TAP,), projection=functools.partial(routing_projection, by_affinities=True),
    ref_inputs=lambda kw, taps: kw, during=functools.partial(routed_as_kernel, by_affinities=True))


def moe_block_cases() -> list[Case]:
    return [moe_block_case(*row) for row in _ROWS]
