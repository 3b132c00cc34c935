"""The derived bound of a token-generation attention output (``trnkit.conformance.attention_bound``) against an
emulation of nki-library's attention_tkg arithmetic (float32 scores, bf16 softmax weights, float32 sums, a bf16
output), a hand-computed cancellation, and kernels that round more than attention_tkg does."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from trnkit.conformance.attention_bound import attention_exact_and_bound, attention_tile_check
from trnkit.conformance.harness import BF16_UNIT

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3)


def _kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, keep: np.ndarray, weights: np.dtype = BF16) -> np.ndarray:
    """attention_tkg's arithmetic in numpy: float32 scores and exp, the weights rounded to ``weights`` (bf16 in the
    kernel's qk_io_type tile), the weighted sum and the weights' sum in float32, the ratio rounded to bf16."""
    s = q.astype(np.float32) @ k.astype(np.float32)
    s = np.where(keep, s, -np.inf).astype(np.float32)
    w = np.exp(s - s.max()).astype(np.float32).astype(weights).astype(np.float32)
    o = (w @ v.astype(np.float32)) * (np.float32(1) / w.sum(dtype=np.float32))
    return o.astype(np.float32).astype(BF16).astype(np.float64)


def _cancelling() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Two positions whose terms cancel: weights 40/41.5 and 1.5/41.5 on V rows -1.5 and 40 (o = 0 exactly), as an
    element of the 8-head, 262,144-position attention_block_tkg row (0.964 x -1.5 + 0.036 x 40 = -0.0011)."""
    q = np.array([1.0])
    k = np.array([[0.0, np.log(1.5 / 40.0)]])
    v = np.array([[-1.5, 1.0], [40.0, 1.0]])
    return q, k, v, np.ones(2, bool)


def test_a_cancelling_element_is_bounded_by_its_terms_not_by_its_value():
    """Hand-computed: o = 0; the weights' bf16 rounding reaches it as u x sum_i p_i |v_i - o| = 2^-8 x (40 x 1.5 +
    1.5 x 40) / 41.5 = 2^-8 x 2.8916 (divided by 1 - max R); the float32 sums and the final rounding add under 2 %
    of that. The second column (all V 1) is exact: its bound is the final rounding's u x 1 and the float32 sums'.
    attention_tkg's arithmetic is 0.33 of the way to the bound there."""
    o, bound = attention_exact_and_bound(*_cancelling())
    assert abs(o[0]) < 1e-15 and o[1] == pytest.approx(1.0, abs=1e-15)
    terms = 120.0 / 41.5
    assert BF16_UNIT * terms <= bound[0] <= BF16_UNIT * terms * 1.02
    assert BF16_UNIT <= bound[1] <= BF16_UNIT * 1.02
    check = attention_tile_check("attention", _kernel(*_cancelling()), o, bound)
    assert check.ok and 0.3 < check.worst < 0.35, check.figures


def test_the_kernels_arithmetic_lies_within_the_bound_and_the_bound_is_not_loose():
    """Random rows (scores of standard deviation 1.2, 3.4 and 6.5: tens to a few hundred positions weigh in;
    4,096 positions, 100 masked): attention_tkg's arithmetic within the bound everywhere, its worst element at least
    a fifth of the way to it (the bound is that arithmetic's, not a blanket tolerance)."""
    rng = np.random.default_rng(7)
    worst = 0.0
    for scale in (0.002, 0.005, 0.01):
        q = (rng.normal(0, 1, 128) * scale).astype(BF16).astype(np.float64)
        k = rng.normal(0, 60, (128, 4096)).clip(-240, 240).astype(FP8).astype(np.float64)
        v = rng.normal(0, 60, (4096, 128)).clip(-240, 240).astype(FP8).astype(np.float64)
        keep = np.ones(4096, bool)
        keep[rng.choice(4096, 100, replace=False)] = False
        o, bound = attention_exact_and_bound(q, k, v, keep)
        check = attention_tile_check("attention", _kernel(q, k, v, keep), o, bound)
        assert check.ok, check.figures
        worst = max(worst, check.worst)
    assert worst > 0.2


def test_a_kernel_with_narrower_weights_is_beyond_the_bound():
    """The cancelling element computed with fp8 weights (3 mantissa bits, not bf16's 7): exp(s - max) = 1 and
    1.5/40 = 0.0375, which rounds to 0.0390625 (fp8 step 2^-8 there), so the kernel gives (-1.5 + 40 x 0.0390625) /
    1.0390625 = 0.0602, 5.3 times the bound (0.0114); the same arithmetic with bf16 weights stays within it."""
    q, k, v, keep = _cancelling()
    o, bound = attention_exact_and_bound(q, k, v, keep)
    good = attention_tile_check("attention", _kernel(q, k, v, keep), o, bound)
    assert good.ok, good.figures
    coarse = attention_tile_check("attention", _kernel(q, k, v, keep, weights=FP8), o, bound)
    assert not coarse.ok and 5.2 < coarse.worst < 5.4, coarse.figures
    assert coarse.figures.startswith(f"max|err| {coarse.worst:.2f} of the bound (bf16 softmax weights, float32 "
                                     "sums; derived per element at its terms' magnitude): at (0,) ")


def test_the_tile_check_refuses_a_wrong_shape_or_non_finite_values_and_an_all_masked_query_raises():
    o, bound = attention_exact_and_bound(*_cancelling())
    assert attention_tile_check("a", np.zeros(3), o, bound).figures == "shape (3,) vs (2,)"
    bad = attention_tile_check("a", np.array([np.nan, 1.0]), o, bound)
    assert not bad.ok and bad.figures == "non-finite values"
    q, k, v, _ = _cancelling()
    with pytest.raises(ValueError, match="every position of the query is masked"):
        attention_exact_and_bound(q, k, v, np.zeros(2, bool))
