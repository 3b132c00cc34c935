"""Conformance cases of nki-library's experimental/moe kernels, written from their test files.

``test/integration/nkilib/experimental/moe/test_bwmm_bwd.py``: ``blockwise_mm_bwd`` (the MoE backward) at
LNC 2, rtol 2e-2 / atol 1e-5, on every row of its table (``_BWD``) at its shape.
Its input builder (routing, weights, upstream gradient and the forward activations it checkpoints) and its
golden live in the test's own module, ``test_bwmm_bwd_common.py``; the cases import that module from the
checkout and call both.

``test/integration/nkilib/experimental/moe/test_bwmm_shard_on_H.py``: ``blockwise_mm_baseline_shard_hidden``
(blockwise MoE, each core takes half of the hidden dimension) at LNC 2, rtol 2e-2 / atol 1e-5, on every row
of its table (``_SHARD_H`` at their shapes, ``_SHARD_H_REDUCED`` with fewer experts: not yet run at theirs). Routing as
the test's ``generate_token_position_to_id_and_experts`` (``np.random.seed(0)``, each token picks
``top_k`` distinct experts; experts get ceil(tokens / block) blocks in expert order, the padding blocks
go to the last expert), then ``np.random.seed(0)`` again for the hidden states and affinities
(``random_sample``; ``rand`` masked when tokens are skipped) and the weights (uniform +-0.1). The test's
golden is numpy in its module; :func:`shard_on_h_golden` is the same computation written from it:
per block, in block order, the gathered tokens' ``silu(x @ W_gate) * (x @ W_up) @ W_down`` in fp32,
scaled by the affinity before or after as the scaling mode says, added into the output in the
test dtype.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case, first_output, load_test_module, uniform_array

__all__ = ["moe_experimental_cases", "shard_on_h_golden"]

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
EXP = "nkilib_src.nkilib.experimental.moe"
TESTS = "test/integration/nkilib/experimental/moe"
HERE = "trnkit.conformance.cases_moe_experimental"
_DT = {BF16: "bf16", F32: "fp32"}


def _n_blocks(t: int, k: int, e: int, b: int) -> int:
    return math.ceil((t * k - (e - 1)) / b) + e - 1


def _routing(t: int, k: int, e: int, b: int, n: int, skip_token: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token x expert mask, token id per block slot, expert per block) as the test draws them."""
    np.random.seed(0)
    chosen = np.stack([np.random.choice(range(e), k, replace=False) for _ in range(t)])
    mask = np.zeros((t, e))
    for j in range(k):
        mask += chosen[:, j:j + 1] == np.arange(e)[None, :]
    blocks = np.ceil(mask.sum(0) / b).astype(np.int32)
    blocks[e - 1] += n - blocks.sum()
    block_to_expert = np.arange(e).repeat(blocks).astype(np.int32)
    slot = np.cumsum(mask, axis=0)  # 1-based rank of the token within its expert
    slot[:, 1:] += (np.cumsum(blocks) * b)[:-1]
    slot = np.where(mask > 0, slot, 0).astype(np.int64)
    token_of_slot = np.full(n * b + 1, -1 if skip_token else t, dtype=np.int32)
    token_of_slot[slot] = np.arange(t)[:, None]  # slot 0 collects the unrouted pairs and is dropped
    return mask, token_of_slot[1:], block_to_expert


def _shard_h_inputs(h: int, t: int, e: int, b: int, k: int, i: int, dt: np.dtype, skip: int, mode: str,
                    checkpoint: bool) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        mod = importlib.import_module(f"{EXP}.forward.bwmm_shard_on_H")
        scale_mode = importlib.import_module("nkilib_src.nkilib.core.utils.common_types").ExpertAffinityScaleMode
        skip_mode = mod.SkipMode(skip in (1, 3), skip in (2, 3))
        n = _n_blocks(t, k, e, b)
        mask, token_of_slot, block_to_expert = _routing(t, k, e, b, n, skip_mode.skip_token)
        np.random.seed(0)
        if skip_mode.skip_token:
            hidden = np.random.random_sample([t, h]).astype(dt)
            affinities = (np.random.rand(t, e) * mask).astype(dt)
        else:
            hidden = np.random.random_sample([t + 1, h]).astype(dt)
            affinities = np.random.random_sample([t + 1, e]).astype(dt)
            affinities[:t] = affinities[:t] * mask
            affinities[t] = 0
            hidden[t] = 0
        out = {"hidden_states": hidden, "expert_affinities_masked": affinities.reshape(-1, 1),
               "gate_up_proj_weight": uniform_array(-0.1, 0.1, [e, h, 2, i], dt),
               "down_proj_weight": uniform_array(-0.1, 0.1, [e, math.ceil(i / 16) * 16, h], dt),
               "block_size": b, "token_position_to_id": token_of_slot,
               "block_to_expert": block_to_expert.reshape(-1, 1),
               "skip_dma": skip_mode, "compute_dtype": dt, "is_tensor_update_accumulating": k != 1,
               "expert_affinities_scaling_mode": getattr(scale_mode, mode)}
        if checkpoint:
            out["gate_up_activations_T"] = np.zeros([n, 2, i, b], dtype=dt)
            out["down_activations"] = np.zeros([n, b, h], dtype=dt)
        return out
    return make


def _np(v: Any) -> np.ndarray:
    return v.float().numpy() if hasattr(v, "float") else np.asarray(v, dtype=np.float32)


def shard_on_h_golden(hidden_states: Any, expert_affinities_masked: Any, gate_up_proj_weight: Any,
                      down_proj_weight: Any, block_size: int, token_position_to_id: Any, block_to_expert: Any,
                      skip_dma: Any, compute_dtype: Any, expert_affinities_scaling_mode: Any,
                      **_: Any) -> dict[str, np.ndarray]:
    """The test's numpy golden (see the module docstring); ``output`` in the test dtype."""
    dt = np.dtype(compute_dtype)
    x_all = _np(hidden_states)
    e, h, _, i = gate_up_proj_weight.shape
    t = x_all.shape[0] - (0 if skip_dma.skip_token else 1)
    affinities = _np(expert_affinities_masked).reshape(-1, e)
    w_gate_up = _np(gate_up_proj_weight).reshape(e, h, 2 * i)
    w_down = _np(down_proj_weight)[:, :i, :]
    ids_per_block = _np(token_position_to_id).astype(np.int64).reshape(-1, block_size)
    mode = expert_affinities_scaling_mode.name
    output = np.zeros((t if skip_dma.skip_token else t + 1, h), dtype=dt)
    for ids, expert in zip(ids_per_block, _np(block_to_expert).astype(np.int64).flatten()):
        x = x_all[ids]
        scale = affinities[ids, expert].reshape(-1, 1).astype(dt).astype(np.float32)
        if mode == "PRE_SCALE":
            x = scale * x
        gate_up = (x @ w_gate_up[expert]).reshape(-1, 2, i)
        gate, up = gate_up[:, 0], gate_up[:, 1]
        down = (gate / (1 + np.exp(-gate)) * up) @ w_down[expert]
        if mode == "POST_SCALE":
            down = down * scale
        output[ids] += down.astype(dt)  # fancy-index add: a repeated id is written once
    return {"output": output}


# moe_bwmm_shard_h_test_params rows run here: hidden, tokens, experts, block, top_k, intermediate, dtype, skip,
# scaling, checkpoint activations (the kernel then also returns the activations; the test compares the output
# only). Every row of its table runs, 29 at their shapes (the E=128 ones: 4-6.4 GB of bf16 weights, kept on disk,
# and 191-255 blocks, 10-13 minutes each here) and 1 with fewer experts (_SHARD_H_REDUCED).
_SHARD_H = [
    (5120, 8192, 16, 256, 1, 128, BF16, 2, "POST_SCALE", False),
    (5120, 8192, 16, 256, 1, 128, BF16, 0, "NO_SCALE", False),
    (5120, 8192, 16, 256, 1, 128, BF16, 0, "PRE_SCALE", False),
    (1536, 4096, 234, 128, 7, 288, BF16, 1, "POST_SCALE", False),
    (5120, 8192, 128, 256, 1, 128, F32, 0, "POST_SCALE", True),
    (5120, 8192, 128, 256, 1, 128, BF16, 0, "POST_SCALE", True),
    (5120, 8192, 16, 256, 1, 512, BF16, 0, "NO_SCALE", False),
    (5120, 8192, 16, 256, 1, 512, BF16, 0, "PRE_SCALE", False),
    (6144, 4096, 16, 512, 1, 336, BF16, 0, "POST_SCALE", False),
    (6144, 4096, 16, 512, 4, 336, BF16, 0, "POST_SCALE", False),
    (6144, 4096, 16, 512, 4, 336, BF16, 1, "POST_SCALE", False),
    (6144, 4096, 16, 512, 4, 336, BF16, 2, "POST_SCALE", False),
    (6144, 4096, 16, 1024, 4, 336, BF16, 1, "POST_SCALE", False),
    (5120, 8192, 128, 128, 2, 64, BF16, 0, "NO_SCALE", False),
    (5120, 8192, 128, 128, 2, 64, BF16, 0, "POST_SCALE", False),
    (5120, 8192, 128, 128, 2, 64, BF16, 0, "PRE_SCALE", False),
    (6144, 4096, 16, 512, 4, 336, F32, 0, "POST_SCALE", False),
    (5120, 8192, 128, 128, 4, 64, BF16, 0, "PRE_SCALE", False),
    (5120, 8192, 128, 128, 4, 64, BF16, 0, "NO_SCALE", False),
    (5120, 8192, 128, 128, 4, 64, BF16, 0, "POST_SCALE", False),
    (6144, 4096, 16, 512, 4, 1024, BF16, 0, "POST_SCALE", False),
    (6144, 4096, 16, 512, 4, 1024, F32, 0, "POST_SCALE", False),
    (7168, 1024, 256, 512, 8, 32, BF16, 0, "POST_SCALE", False),
    (7168, 1024, 256, 256, 8, 32, BF16, 0, "POST_SCALE", False),
    (7168, 1024, 256, 256, 8, 32, BF16, 2, "POST_SCALE", False),
    (5120, 8192, 16, 256, 4, 1024, BF16, 0, "POST_SCALE", True),
    (5120, 8192, 16, 256, 4, 1024, F32, 0, "POST_SCALE", True),
    (5120, 8192, 128, 256, 4, 1024, BF16, 0, "POST_SCALE", True),
    (2880, 8192, 128, 512, 4, 2880, BF16, 0, "POST_SCALE", False),
]
# (the test's row, the row run, why): the same kernel paths (block size, top-k, H, I, dtype, skip and scaling
# modes, checkpointing) with fewer experts, hence fewer blocks; not yet run at the test's shape (its 4-6.4 GB of
# weights, kept on disk, fit: harness.LARGE_ARRAY_BYTES; not measured yet at its 191 blocks)
_SHARD_H_REDUCED = [
    ((2880, 8192, 128, 512, 4, 2880, BF16, 0, "POST_SCALE", True),
     (2880, 2048, 16, 512, 4, 2880, BF16, 0, "POST_SCALE", True),
     "reduced shape: the test's row has T=8192, E=128 (191 blocks; 6.4 GB of bf16 weights); run with T=2048, "
     "E=16 (31 blocks)"),
]


# -- experimental/moe/bwd (test_bwmm_bwd.py): the backward kernel, inputs and golden from its test's module ----
BWD_COMMON = f"{TESTS}/test_bwmm_bwd_common.py"


def _checkout() -> Path:
    """The nki-library checkout the run imports ``nkilib_src`` from."""
    return Path(importlib.import_module("nkilib_src").__file__).resolve().parents[2]


def _bwd_inputs(h: int, t: int, e: int, b: int, k: int, i: int, skip: int, clamps: tuple, bias: bool,
                act: str) -> Callable[[], dict[str, Any]]:
    """The kernel's arguments as ``test_bwmm_bwd.py`` builds them: its module's ``build_bwmm_bwd_inputs``
    (routing, weights, upstream gradient and the forward pass's checkpointed activations), run from the
    checkout."""
    def make() -> dict[str, Any]:
        params = importlib.import_module(f"{EXP}.bwd.moe_bwd_parameters")
        common = load_test_module(_checkout(), BWD_COMMON)
        inputs, _, _ = common.build_bwmm_bwd_inputs(
            tokens=t, hidden=h, intermediate=i, expert=e, block_size=b, top_k=k, dtype=BF16,
            dma_skip=params.SkipMode(skip in (1, 3), skip in (2, 3)), bias_flag=bias,
            clamp_limits=params.ClampLimits(*clamps), activation_type=getattr(params.ActFnType, act))
        return inputs
    return make


# TEST_PARAMS rows of test_bwmm_bwd.py run here: hidden, tokens, experts, block, top_k, intermediate, skip,
# clamp limits (gate upper, gate lower, up upper, up lower), bias, activation. All bf16, LNC 2. Every row of
# its table runs at its shape; the last one holds 1.6 GB of bf16 weights and its reference 3.2 GB of float32
# weight gradients (kept on disk: harness.LARGE_ARRAY_BYTES) and takes about half an hour here.
_NO_CLAMPS, _CLAMPS = (None, None, None, None), (7, -7, 7, -7)
_BWD = [
    (6144, 4096, 1, 512, 1, 128, 0, _CLAMPS, False, "SiLU"),
    (4096, 4096, 2, 512, 2, 384, 0, _NO_CLAMPS, False, "SiLU"),
    (4096, 4096, 4, 512, 2, 384, 0, _NO_CLAMPS, False, "SiLU"),
    (6144, 4096, 16, 512, 4, 128, 0, _NO_CLAMPS, False, "SiLU"),
    (5120, 8192, 16, 512, 1, 256, 0, _NO_CLAMPS, False, "SiLU"),
    (2880, 4096, 2, 512, 2, 2880, 0, _CLAMPS, True, "Swish"),
    (2880, 4096, 2, 512, 2, 2880, 1, _CLAMPS, True, "Swish"),
    (2880, 4096, 2, 1024, 2, 2880, 0, _CLAMPS, True, "Swish"),
    (2880, 4096, 2, 256, 2, 2880, 1, _CLAMPS, True, "Swish"),
    (5120, 8192, 128, 256, 1, 128, 0, _NO_CLAMPS, False, "SiLU"),
    (6144, 4096, 16, 512, 4, 1024, 0, _NO_CLAMPS, False, "SiLU"),
    (5120, 8192, 16, 256, 4, 1024, 0, _NO_CLAMPS, False, "SiLU"),
    (2880, 4096, 32, 1024, 4, 2880, 1, _CLAMPS, True, "Swish"),
]
_BWD_OUTPUTS = ("hidden_states_grad", "expert_affinities_masked_grad", "gate_up_proj_weight_grad",
                "down_proj_weight_grad")


def _bwd_cases() -> list[Case]:
    cases = []
    for row in _BWD:
        h, t, e, b, k, i, skip, clamps, bias, act = row
        flags = [f"skip={skip}", act] + ["clamp"] * (clamps[0] is not None) + ["bias"] * bias
        cases.append(Case(
            kernel="experimental/moe/bwd", name=" ".join(flags), shapes=f"T={t} H={h} E={e} B={b} k={k} I={i}",
            entry=f"{EXP}.bwd.blockwise_mm_backward:blockwise_mm_bwd",
            reference=f"{BWD_COMMON}:blockwise_mm_bwd_torch_ref", inputs=_bwd_inputs(h, t, e, b, k, i, skip, clamps,
                                                                                     bias, act),
            outputs=_BWD_OUTPUTS + ("gate_and_up_proj_bias_grad", "down_proj_bias_grad") * bias, lnc=2,
            rtol=2e-2, atol=1e-5, test_file=f"{TESTS}/test_bwmm_bwd.py"))
    return cases


def moe_experimental_cases() -> list[Case]:
    cases = _bwd_cases()
    for row, note in [(r, "") for r in _SHARD_H] + [(run, why) for _, run, why in _SHARD_H_REDUCED]:
        h, t, e, b, k, i, dt, skip, mode, ckpt = row
        flags = [_DT[dt], f"skip={skip}", mode] + ["checkpoint_activation"] * ckpt
        cases.append(Case(
            kernel="experimental/moe/bwmm_shard_on_H", name=" ".join(flags),
            shapes=f"T={t} H={h} E={e} B={b} k={k} I={i}",
            entry=f"{EXP}.forward.bwmm_shard_on_H:blockwise_mm_baseline_shard_hidden",
            wrap_kernel=first_output if ckpt else None, reference=f"{HERE}:shard_on_h_golden",
            inputs=_shard_h_inputs(h, t, e, b, k, i, dt, skip, mode, ckpt), outputs=("output",), lnc=2,
            rtol=2e-2, atol=1e-5, note=note, test_file=f"{TESTS}/test_bwmm_shard_on_H.py"))
    return cases
