"""GpSimd Engine instructions: ``iota`` and ``affine_select`` (NKI 0.6 signatures).

Both evaluate the affine expression ``offset + channel_multiplier * partition + sum(step_i * idx_i)``
over a pattern ``[[step, num], ...]`` (up to 4-D; the product of the ``num``s must equal the tile's
elements per partition) in 32-bit integer arithmetic. Their ``dst`` (and ``on_true_tile``) must be in
SBUF: GpSimd cannot access PSUM.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes
from .. import ops as _ops
from ..errors import require
from ..tensor import NkiTensor
from . import common
from .vector import check_same_layout, emit, free_size, get_op, read, read_raw, write

__all__ = ["iota", "affine_select"]


def _affine(op: str, dst: Any, pattern: Any, offset: Any, channel_multiplier: Any) -> np.ndarray:
    """The int32 affine values, ``[P, F]``, for ``dst``'s partitions and the pattern."""
    require(isinstance(pattern, (list, tuple)) and 1 <= len(pattern) <= 4, op,
            "pattern must be a list of 1 to 4 [step, num] pairs, got {pattern!r}", pattern=pattern)
    for pair in pattern:
        require(isinstance(pair, (list, tuple)) and len(pair) == 2, op,
                "each pattern entry must be [step, num], got {pair!r}", pair=pair)
        require(int(pair[1]) >= 1, op, "pattern num must be >= 1, got {pair!r}", pair=pair)
    for name_, v in (("offset", offset), ("channel_multiplier", channel_multiplier)):
        require(isinstance(v, (int, np.integer)), op, "{name} must be an int32 value, got {v!r}",
                name=name_, v=v)
    nums = [int(n) for _, n in pattern]
    n = math.prod(nums)
    F = free_size(dst)
    require(n == F, op, "pattern covers {n} elements but dst has {f} elements per partition "
            "(pattern={pattern})", n=n, f=F, pattern=[list(p) for p in pattern])
    vals = np.zeros(nums, dtype=np.int64)
    for axis, (step, num) in enumerate(pattern):
        shape = [1] * len(nums)
        shape[axis] = int(num)
        vals = vals + int(step) * np.arange(int(num), dtype=np.int64).reshape(shape)
    P = dst.shape[0]
    chan = int(channel_multiplier) * np.arange(P, dtype=np.int64)[:, None]
    full = int(offset) + chan + vals.reshape(1, -1)
    return full.astype(np.int32)  # 32-bit integer arithmetic (wraps like the engine's ALU)


def iota(dst: NkiTensor, pattern: Any, offset: int = 0, channel_multiplier: int = 0,
         name: str | None = None) -> None:
    """``dst[c, ...] = offset + c * channel_multiplier + sum(step_i * idx_i)``, cast to ``dst.dtype``."""
    OP = "iota"
    common.check_on_chip(OP, "dst", dst, common.SBUF)
    write(dst, _affine(OP, dst, pattern, offset, channel_multiplier))
    emit(OP, "gpsimd", {"dst": dst})


def affine_select(dst: NkiTensor, pattern: Any, channel_multiplier: int, on_true_tile: NkiTensor,
                  on_false_value: float, cmp_op: Any = _ops.equal, offset: int = 0,
                  name: str | None = None) -> None:
    """``dst = on_true_tile`` where ``cmp_op(affine_value, 0)`` holds, else ``on_false_value``."""
    OP = "affine_select"
    for role, t in (("dst", dst), ("on_true_tile", on_true_tile)):
        common.check_on_chip(OP, role, t, common.SBUF)
    check_same_layout(OP, "on_true_tile", on_true_tile, "dst", dst)
    f = get_op(OP, "cmp_op", cmp_op, alu=True, arity=2)
    require(f.name in ("equal", "not_equal", "greater", "greater_equal", "less", "less_equal"), OP,
            "cmp_op must be a comparison operator, got {f}", f=f)
    require(isinstance(on_false_value, (int, float, np.integer, np.floating)), OP,
            "on_false_value must be a float32 scalar, got {got}", got=type(on_false_value).__name__)
    aff = _affine(OP, dst, pattern, offset, channel_multiplier)
    pred = f.apply(aff.astype(np.float64), 0.0) != 0  # exact compare of int32 values
    # Selected inputs keep their bits when dtypes match, else go through fp32.
    src = read_raw(on_true_tile) if on_true_tile.dtype == dst.dtype else read(on_true_tile)
    fill = np.float32(on_false_value)
    if on_true_tile.dtype == dst.dtype:
        fill = dtypes.cast(np.asarray(fill), dst.dtype)
    write(dst, np.where(pred, src, fill))
    emit(OP, "gpsimd", {"dst": dst, "on_true_tile": on_true_tile}, cmp_op=f.name)
