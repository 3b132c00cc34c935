"""benchmarks/attention_peak.py's fallback pass: a launch of the default (fixed-shift) forward whose certificate
fails pays the fast pass and the exact forward, and inputs that would keep the fast pass are refused for that
row."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_peak  # benchmarks/ is a script folder, not a package
from side_by_side import estimate

from trnkit.kernels.attention import attention, fixed_shift_failures


def _inputs(S: int = 640, Hq: int = 2, Hk: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, S, h, attention_peak.D, generator=g).bfloat16() for h in (Hq, Hk, Hk))


def test_fallback_costs_both_passes():
    q, k, v = _inputs()
    scaled = q * attention_peak.FALLBACK_INPUT_SCALE, k * attention_peak.FALLBACK_INPUT_SCALE
    assert fixed_shift_failures(*scaled).any() and not fixed_shift_failures(q, k).any()
    fallback = attention_peak._fallback(q, k, v, lnc=1)
    fast = estimate(lambda: attention(q, k, v, lnc=1, fixed_shift=True))
    exact = estimate(lambda: attention(q, k, v, lnc=1, fixed_shift=False))
    # both passes run: more than the exact forward alone, less than the two launches' sum (one launch's ends)
    assert exact.mid < fallback.mid < exact.mid + fast.mid
    assert fallback.low <= fallback.mid <= fallback.high


def test_inputs_that_keep_the_fast_pass_are_refused():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"attention_peak: the 'forward, fallback' inputs .* pass the "
                                         r"certificate"):
        attention_peak._fallback(q * 0, k * 0, v, lnc=1)
