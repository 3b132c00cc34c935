"""Conformance cases of nki-library's core/embeddings/rope (``RoPE``), written from its test file.

``test/integration/nkilib/core/embeddings/test_rope.py``: x_in [d_head, B, n_heads, S], cos and sin
[d_head / 2, B, S], bf16, drawn in that order from one ``gaussian_tensor_generator()`` (``default_rng(0)``
normal); ``lnc_shard=True`` under ``CompilerArgs()`` (LNC 2 on trn2); rtol 2^-7, atol 1e-3 against
nki-library's ``rope_torch_ref``. Its three tests: ``test_rope_fast``, ``test_rope_sweep`` and
``test_rope_manual`` (18 listed rows).

The fast and sweep tests take their rows from ``@pytest.mark.coverage_parametrize`` (nki-library's
``test/utils/coverage_parametrized_tests.py``): ``coverage="singles"`` zips the value lists cyclically,
``coverage="pairs"`` asks ``allpairspy`` for a covering of every pair of values among the combinations its
filter calls valid (d_head 64 or 128, S even, B * n_heads * S <= 73728). Both are deterministic; the rows
below are the ones they yield (allpairspy 2.5.1), in the test's order. The sweep's ``BoundedRange`` boundary
values (d_head 32, 63, 129, 256; S 15, 17, 51) are negative rows: the test puts each into three of its valid
rows drawn at random (unseeded); here they go into three rows spread over the sweep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .cases_conv import gaussian
from .harness import Case

__all__ = ["rope_cases"]

BF16 = np.dtype(ml_dtypes.bfloat16)
LIB = "nkilib_src.nkilib.core.embeddings"
TEST = "test/integration/nkilib/core/embeddings/test_rope.py"

# rows: d_head, B, n_heads, S, contiguous_layout, relayout_in_sbuf (the tests' parameter order)
_FAST = [(64, 1, 1, 16, True, True), (128, 8, 8, 128, False, False), (64, 64, 1, 16, True, True)]
_SWEEP = [
    (64, 1, 1, 16, True, True), (128, 3, 5, 50, False, True), (128, 8, 8, 128, True, False),
    (64, 32, 16, 128, False, False), (64, 100, 8, 50, False, True), (128, 100, 16, 16, True, False),
    (128, 32, 1, 300, True, True), (64, 8, 5, 512, True, True), (64, 3, 1, 512, False, False),
    (128, 1, 16, 512, False, True), (64, 1, 5, 300, False, False), (64, 3, 8, 16, False, True),
    (64, 8, 16, 50, False, False), (64, 32, 8, 50, True, True), (64, 100, 5, 128, False, True),
    (64, 3, 16, 300, True, True), (64, 100, 1, 50, False, True), (64, 32, 5, 16, False, True),
    (64, 8, 1, 16, False, True), (64, 1, 8, 50, False, True),
]
_SWEEP_BOUNDARIES = {0: (32, 63, 129, 256), 3: (15, 17, 51)}  # row position -> boundary values (d_head, S)
_MANUAL = [
    (128, 8192, 1, 8, True, False), (64, 8192, 1, 8, True, False), (128, 1, 1, 8192, True, False),
    (64, 1, 1, 8192, True, False), (128, 1, 512, 128, True, False), (64, 1, 512, 128, True, False),
    (128, 64, 8, 128, True, False), (64, 64, 8, 128, True, False), (128, 32, 4, 64, False, False),
    (64, 32, 4, 64, False, False), (128, 1, 32, 2048, True, False), (128, 4, 8, 1024, True, False),
    (128, 2, 128, 256, True, False), (64, 2, 128, 256, True, False),
    (128, 255, 2, 8, False, False), (64, 255, 8, 6, False, False), (128, 128, 4, 4, False, False),
    (128, 64, 8, 2, False, False),
]


def _boundary_rows(rows: list[tuple], boundaries: dict[int, tuple], per_value: int = 3) -> list[tuple]:
    """Each boundary value put into ``per_value`` rows spread evenly over ``rows`` (duplicates dropped)."""
    picks = [rows[k * len(rows) // per_value] for k in range(per_value)]
    out: list[tuple] = []
    for i, values in boundaries.items():
        for new in (row[:i] + (v,) + row[i + 1:] for v in values for row in picks):
            if new not in out:
                out.append(new)
    return out


def _inputs(d_head: int, b: int, heads: int, s: int, contiguous: bool, relayout: bool
            ) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        x, cos, sin = gaussian((d_head, b, heads, s), (d_head // 2, b, s), (d_head // 2, b, s), dtype=BF16)
        return {"x_in": x, "cos": cos, "sin": sin, "lnc_shard": True, "contiguous_layout": contiguous,
                "relayout_in_sbuf": relayout}
    return make


def _case(test: str, row: tuple, negative: bool = False) -> Case:
    d_head, b, heads, s, contiguous, relayout = row
    name = f"{test} {'contiguous' if contiguous else 'interleaved'}" + (" relayout_in_sbuf" if relayout else "") \
        + (" (must reject)" if negative else "")
    return Case(kernel="core/embeddings/rope", name=name, shapes=f"x[{d_head},{b},{heads},{s}] bf16",
                entry=f"{LIB}.rope:RoPE", reference=f"{LIB}.rope_torch:rope_torch_ref",
                inputs=_inputs(*row), outputs=("x_out",), lnc=2, rtol=2**-7, atol=1e-3, negative=negative,
                test_file=TEST)


def rope_cases() -> list[Case]:
    return ([_case("fast", r) for r in _FAST] + [_case("sweep", r) for r in _SWEEP]
            + [_case("sweep boundary", r, negative=True) for r in _boundary_rows(_SWEEP, _SWEEP_BOUNDARIES)]
            + [_case("manual", r) for r in _MANUAL])
