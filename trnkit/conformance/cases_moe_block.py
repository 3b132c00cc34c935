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

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["moe_block_case", "moe_block_cases"]

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
        out["expert_gate_up_weights"] = rng.normal(size=(e_local, h, 2, i)).astype(w_dt)
        out["expert_down_weights"] = rng.normal(size=(e_local, i, h)).astype(w_dt)
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
    """One row of ``test_moe_block_tkg.py`` without MX weights (post-scaling, router logits kept)."""
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
        test_file=f"{TESTS}/test_moe_block_tkg.py")


def moe_block_cases() -> list[Case]:
    return [moe_block_case(*row) for row in _ROWS]
