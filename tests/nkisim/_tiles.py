"""Small helpers for the ISA op tests: make on-chip tiles from numpy arrays."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from trnkit.nkisim.tensor import allocate, psum, sbuf

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
FLOATS = [F32, BF16, F16]


def tile(values: np.ndarray, dtype: np.dtype | None = None, buffer=sbuf):
    """A fresh tile in ``buffer`` holding ``values`` (cast to ``dtype`` with numpy/ml_dtypes)."""
    values = np.asarray(values)
    dt = np.dtype(dtype) if dtype is not None else values.dtype
    t = allocate(values.shape, dt, buffer)
    t.np()[...] = values.astype(dt)
    return t


def empty(shape, dtype, buffer=sbuf):
    return allocate(tuple(shape), np.dtype(dtype), buffer)


def as_f32(t) -> np.ndarray:
    return np.array(t.np()).astype(np.float32)


def ref_round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Independent reference for the output stage: fp32 result rounded (RNE) to dtype, back to fp32."""
    return np.asarray(x, dtype=np.float32).astype(dtype).astype(np.float32)


__all__ = ["tile", "empty", "as_f32", "ref_round", "sbuf", "psum", "BF16", "F32", "F16", "FLOATS"]
