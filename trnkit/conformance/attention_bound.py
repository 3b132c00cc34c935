"""A derived bound of a token-generation attention output computed as nki-library's ``attention_tkg`` computes it
(bf16 softmax weights, float32 elsewhere), against its exact value: for a tapped check
(:class:`.harness.TappedReference`) of the attention tile an output projection reads.

The kernel (nki-library d2ad3a5, ``core/attention/attention_tkg.py``) computes an output element
``o = sum_i p_i v_i`` (``p`` the softmax of the scores ``s_i = k_i . q`` over the unmasked positions) as:

- the scores in float32: ``d`` exact products (bf16 Q x bf16 or fp8 K) summed in PSUM, each off by at most
  ``gamma_d A_i``, ``A_i = sum_j |q_j k_ij|`` (Higham, Accuracy and Stability of Numerical Algorithms, section 3.1);
- ``exp(s_i - m)`` in float32 (``_compute_exp_qk``: the subtraction and the exp each one float32 rounding; ``m``
  the running max, the same for every position it scales, so it cancels in the normalisation but for its
  subtraction's rounding, at most ``2^-24 |s_i - m|``) written into a bf16 tile (``qk_io_type``): one bf16 rounding;
- with flash attention (``_fa_*``: 8,192-position tiles), each tile's weights rescaled by float32 correction factors
  ``exp(m_old - m_new)``, each an exp, a subtraction and a multiply; the arguments' roundings add up to at most
  ``2^-24 |s_i - M|`` (the maxes between ``s_i`` and the final max ``M``), the rest at most 3 float32 roundings per
  tile, at most ``ceil(S / 128)`` tiles of 128 positions;
- the numerator ``sum_i w_i v_i`` and the denominator ``sum_i w_i`` (the same bf16 weights ``w_i``) in float32:
  matmuls over 128 positions accumulated in PSUM, partial sums added in SBUF, the other core's half added: each
  term through at most ``D = 128 + 2 ceil(S / 128) + 4`` float32 roundings, the ratio's reciprocal and multiply
  included;
- the result written into the bf16 output tile: one bf16 rounding;
- a value below float32's (and bf16's) smallest normal, ``2^-126``, may underflow or flush to zero: a weight
  ``exp(s_i - m)`` of a position far below the max, a weight times V, the output: each off by at most ``2^-126``.

With ``w_i = p_i (1 + r_i)`` (up to a common factor, which cancels), ``|r_i| <= R_i = (1 + u)(1 + f)^F
exp(gamma_d A_i + 2 f |s_i - M|) - 1`` (``u = 2^-8``, bf16; ``f = 2^-24``, float32; ``F = 3 ceil(S / 128) + 2``):

    sum_i w_i v_i / sum_i w_i - o = sum_i p_i r_i (v_i - o) / (1 + sum_i p_i r_i)        (exactly)

so before the float32 sums the value is within ``sum_i p_i R_i |v_i - o| / (1 - max R)`` of ``o``; the float32 sums
add at most ``2 gamma_D (1 + max R) sum_i p_i |v_i|``; underflow at most ``2^-126 (sum_i |v_i - o| + 2 S + 1)``; the
final bf16 rounding ``u`` times the value's magnitude.
An element near zero whose terms cancel (``o`` small against ``sum_i p_i |v_i|``) can so be far from ``o`` relative
to itself while the tile is right: the bound is per element, at its own terms' magnitude.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .harness import BF16_UNIT, FP32_UNIT, TileCheck

__all__ = ["attention_exact_and_bound", "attention_tile_check"]


FP32_TINY = 2.0 ** -126  # float32's (and bf16's) smallest normal value
CHUNK = 16384  # positions read in float64 at a time


def _gamma(n: int) -> float:
    return n * FP32_UNIT / (1 - n * FP32_UNIT)


def attention_exact_and_bound(q: np.ndarray, k: np.ndarray, v: np.ndarray, keep: np.ndarray
                              ) -> tuple[np.ndarray, np.ndarray]:
    """One query's attention over ``S`` positions, exactly (float64), and the bound of the module doc on the kernel's
    bf16 value of it, per element: ``q`` ``[d]`` (as the kernel's score matmul reads it: softmax-scaled, bf16),
    ``k`` ``[d, S]``, ``v`` ``[S, d_v]`` (any float dtype: read in float64, :data:`CHUNK` positions at a time, so a
    long context adds no whole float64 copy of its caches), ``keep`` ``[S]`` (False: a masked position, weight 0).
    Returns ``(o, bound)``, each ``[d_v]``."""
    q = np.asarray(q, np.float64)
    keep = np.asarray(keep, bool)
    if not keep.any():
        raise ValueError("attention bound: every position of the query is masked (no softmax)")
    d, n_pos = k.shape
    chunks = [slice(c, min(c + CHUNK, n_pos)) for c in range(0, n_pos, CHUNK)]
    col = lambda c: np.asarray(k[:, c], np.float64)  # noqa: E731
    row = lambda c: np.asarray(v[c], np.float64)  # noqa: E731
    s_parts, term_parts = [], []
    for c in chunks:  # one float64 read of each K chunk
        k_c = col(c)
        s_parts.append(q @ k_c)
        term_parts.append(np.abs(q) @ np.abs(k_c))  # sum_j |q_j k_ij|
    s, terms = np.concatenate(s_parts), np.concatenate(term_parts)
    m = s[keep].max()
    p = np.where(keep, np.exp(np.where(keep, s - m, 0.0)), 0.0)
    p /= p.sum()
    o = sum(p[c] @ row(c) for c in chunks)
    tiles = math.ceil(n_pos / 128)
    exponent = _gamma(d) * terms + 2 * FP32_UNIT * np.where(keep, m - s, 0.0)
    r = np.where(keep, (1 + BF16_UNIT) * (1 + FP32_UNIT) ** (3 * tiles + 2) * np.exp(exponent) - 1, 0.0)
    r_max = float(r.max())
    if r_max >= 1:
        raise ValueError(f"attention bound: a softmax weight's relative error bound {r_max:.3g} is not below 1")
    # the second read of V (the first gave o): sum_i p_i R_i |v_i - o|, sum_i p_i |v_i| and sum_i |v_i - o|, each
    # summed over the chunks in order
    weighted = magnitude = off = 0.0
    for c in chunks:
        v_c = row(c)
        dev = np.abs(v_c - o)
        weighted = weighted + (p[c] * r[c]) @ dev
        magnitude = magnitude + p[c] @ np.abs(v_c)
        off = off + dev[keep[c]].sum(axis=0)
    weighted = weighted / (1 - r_max)
    summed = 2 * _gamma(128 + 2 * tiles + 4) * (1 + r_max) * magnitude
    # (underflow: a weight, a product or the output below float32's smallest normal, each off by at most that)
    underflow = FP32_TINY * (off + 2 * int(keep.sum()) + 1)
    return o, weighted + summed + underflow + BF16_UNIT * (np.abs(o) + weighted + summed)


def attention_tile_check(label: str, tapped: Any, exact: np.ndarray, bound: np.ndarray) -> TileCheck:
    """``tapped`` (the kernel's attention tile, ``exact``'s shape) against ``exact`` within ``bound`` (both from
    :func:`attention_exact_and_bound`), element by element, as a :class:`.harness.TileCheck`: ``worst`` the largest
    error as a share of its element's bound; the figures name the element nearest to (or beyond) it."""
    t = np.asarray(tapped, np.float64)
    if t.shape != exact.shape or not np.all(np.isfinite(t)):
        what = f"shape {t.shape} vs {exact.shape}" if t.shape != exact.shape else "non-finite values"
        return TileCheck(label, False, float("inf"), what)
    err = np.abs(t - exact)
    share = np.divide(err, bound, out=np.where(err > 0, np.inf, 0.0), where=bound > 0)
    at = np.unravel_index(int(np.argmax(share)), share.shape)
    worst = float(share[at])
    return TileCheck(label, worst <= 1.0, worst, (
        f"max|err| {worst:.2f} of the bound (bf16 softmax weights, float32 sums; derived per element at its terms' "
        f"magnitude): at {tuple(int(i) for i in at)} {t[at]:.6g} for the exact {exact[at]:.6g}, bound "
        f"{bound[at]:.3g}"))
