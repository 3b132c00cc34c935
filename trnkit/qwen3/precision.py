"""Where trnkit's Qwen3 multiplies low-precision (bf16 / fp16) matrices on CPU.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a linear layer rounds its operands to bf16 and
multiplies them, accumulating in fp32, with a bf16 result. On a CPU with native bf16 matmul (AVX512-BF16
or AMX: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``) torch does that in oneDNN. Without it (e.g. AVX2
only, AMD EPYC before Zen 4) torch falls back to a scalar bf16 GEMM that is 3-90x slower than its fp32
GEMM, depending on the operands' layout: on such a CPU a bf16 step of a small model spends most of its
time there.

:func:`matmul_dtype` is the one place that choice is made: the compute dtype itself where the CPU
multiplies it natively (and on every other device), else fp32. Multiplying the rounded operands in fp32
computes the same products (a product of two bf16 / fp16 numbers is exact in fp32) and accumulates them in
fp32 as the low-precision GEMM does, in another order; the result is rounded to the compute dtype as the
low-precision GEMM's output is. So a linear layer differs from torch's bf16 one by summation order only
(an output element can round to the neighbouring bf16 value), at fp32 GEMM speed. The chunked loss
(:mod:`.loss`) and every linear layer of the model (:class:`Linear`) follow it. The attention core does
not: torch's CPU bf16 attention kernel (about 5x its fp32 time on such a CPU) rounds the softmax
probabilities to bf16 before their product with v, which fp32 attention of the rounded q, k, v would not
do, and keeping them fp32 moved the bf16 logits' error past transformers' own bf16 error in a parity test
(``tests/qwen3/test_model.py``). Where the CPU has native bf16 matmul, or on any other device, torch's
bf16 path runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)


def native_matmul(dt: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dt`` matrices natively (oneDNN with AVX512-BF16 / AMX / AVX512-FP16)."""
    if dt == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dt == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, weight)`` computes and returns: the autocast dtype while autocast is on for x's
    device, else the operands' promoted dtype (also what a kernel standing in for a linear layer gets)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, weight.dtype)


def matmul_dtype(dt: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype matmuls of compute dtype ``dt`` run in on ``device``: ``dt``, or fp32 for a low-precision
    ``dt`` on a CPU without native matmul for it (operands rounded to ``dt`` first, outputs rounded after)."""
    if device.type != "cpu" or dt not in LOW_PRECISION or native_matmul(dt):
        return dt
    return torch.float32


def upcasts_matmul(dt: torch.dtype, device: torch.device) -> bool:
    """Whether matmuls of compute dtype ``dt`` run in fp32 on ``device`` (:func:`matmul_dtype`)."""
    return matmul_dtype(dt, device) != dt


class _RoundedLinear(torch.autograd.Function):
    """``x @ w.T`` for ``x``, ``w`` already rounded to a low-precision dtype: multiplied in fp32, the output
    and both gradients rounded to that dtype (what the low-precision GEMM returns), the inputs saved in it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        with torch.autocast("cpu", enabled=False):
            return F.linear(x.float(), w.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w = ctx.saved_tensors
        g32 = g.float()
        dx = dw = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                dx = (g32 @ w.float()).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = (g32.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]).float()).to(w.dtype)
        return dx, dw


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias). Its compute dtype (the autocast dtype under autocast, else the
    operands' dtype) multiplied as :func:`matmul_dtype` says: on a CPU without native matmul for it, the
    operands rounded to it and multiplied in fp32. Distributed (DTensor) weights take ``F.linear``."""
    if x.device.type != "cpu" or hasattr(weight, "to_local"):
        return F.linear(x, weight)
    dt = compute_dtype(x, weight)
    if upcasts_matmul(dt, x.device):
        return _RoundedLinear.apply(x.to(dt), weight.to(dt))
    return F.linear(x, weight)


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose matmul follows :func:`matmul_dtype` (an ``nn.Linear``: tensor
    parallel plans, the override registry and the state dict see the same module)."""

    # its forward is F.linear of its weight (in its matmul dtype): what a kernel that reads the weight computes
    # (trnkit.overrides.guard.linear_wrapper; a string, not an import: overrides sits below qwen3)
    _trnkit_plain_linear = True

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


__all__ = ["Linear", "linear", "matmul_dtype", "native_matmul", "upcasts_matmul"]
