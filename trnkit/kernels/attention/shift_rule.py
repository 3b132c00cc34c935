"""The fixed-shift forward's certificate bound, shared by the kernel (:mod:`.flash_fwd_shift`) and its torch
twin (:func:`.attention_torch.fixed_shift_failures`); plain Python, no NKI and no torch.

A launch keeps its fast pass when every row's ``l_i = sum_j exp(s_ij - c_i) <= S * e^nats``. The bound is a
precision rule, set by the input dtype and measured against the fp64 oracle on rows whose maximum lies
``delta`` nats past their first 512 keys with many keys sharing it (the backward's ``dP - delta`` then
cancels), against the exact forward's error. bf16 inputs: the probabilities enter ``P V`` rounded to 8
significant bits on either path, and the fast pass's outputs and gradients stay within 1.33x of the exact
forward's error (``lse``, fp32, 1.56x) at 8 to 32 nats (``tests/kernels/attention/test_attention_shift.py``),
so the bound is ``S e^32`` (every exponential and ``l_i`` at most 2.6e18 at S = 32,768, far inside fp32's
range). fp32 inputs: the fast pass's own roundings show (``lse`` formed from a larger ``log l_i``, the row's
largest terms away from 1, where the exact forward's largest term is exactly 1): 1.3x the exact forward's
gradient error at 8 nats, 2.6x at 24, so the bound is ``4 S`` (``delta <= log 4S``, 9.7 at S = 4,096).
"""

from __future__ import annotations

import math

NATS_2BYTE = 32.0  # bf16 inputs: l <= S * e^32
NATS_FP32 = math.log(4.0)  # fp32 inputs: l <= 4 S


def certificate_nats(itemsize: int) -> float:
    """``nats`` of the bound ``l <= S * e^nats`` for inputs of ``itemsize`` bytes (2: bf16, 4: fp32)."""
    return NATS_2BYTE if itemsize == 2 else NATS_FP32


def certificate_bound(S: int, itemsize: int) -> float:
    """The largest row sum ``l`` a launch of ``S`` keys with ``itemsize``-byte inputs may hold and keep its
    fast pass."""
    return S * math.exp(certificate_nats(itemsize))
