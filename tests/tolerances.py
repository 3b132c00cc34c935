"""Kernel parity tolerances, in one place.

Kernel outputs are compared with ``assert_close(actual, expected, dtype)``: element-wise
``|a - e| <= atol + rtol * |e|``. Justification:
- float32: kernels accumulate in fp32 like the reference but in a different order (tiled matmul,
  per-tile reductions), so errors are a few ulps times sqrt(reduction length): rtol 1e-5, atol 1e-5.
- bfloat16: outputs are rounded once to bf16 (unit roundoff 2**-8 = 3.9e-3), and a reference computed
  from the same bf16 inputs in fp32 may round the other way at a tie, i.e. differ by one bf16 ulp
  (2**-7 relative): rtol 2**-7 = 7.8e-3, plus a small atol for values near zero.
Kernel modules may tighten these for specific outputs; they never loosen them here silently.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # dtype: (rtol, atol)
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2**-7, 1e-3),
}


def tol(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 msg: str = "") -> None:
    """Compare in fp32 with the tolerance of ``dtype`` (default: ``expected.dtype``)."""
    rtol, atol = tol(dtype or expected.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=msg or None)
