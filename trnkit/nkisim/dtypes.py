"""NKI data types (numpy dtypes, low precision via ``ml_dtypes``) and hardware-style casts.

``nl.bfloat16`` is ``np.dtype(ml_dtypes.bfloat16)`` etc., so ``np.random.randn(4).astype(nl.bfloat16)``
works as in the official tests. Casting follows the hardware: narrowing float casts round to nearest
even (ml_dtypes does RNE); float -> int rounds to nearest even and saturates (NKI 0.6.0 release notes:
"fp32->int casts are RNE with saturation like hardware"); NaN -> 0 for ints.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .errors import fail

__all__ = [
    "bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32",
    "float16", "bfloat16", "tfloat32", "float32",
    "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
    "float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4", "PACKED_X4",
    "NKI_DTYPES", "resolve", "cast", "is_float", "is_int", "dtype_name", "sentinel",
]

bool_ = np.dtype(np.bool_)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
# tf32 has fp32 storage on the chip (the Tensor engine truncates the mantissa internally); the
# interpreter stores and computes it as fp32.
tfloat32 = float32
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)  # legacy NKI fp8 (IEEE-like, max 240)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)  # OCP (max 448, no inf)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)  # MX scale (trn3)


def _packed(name: str, bits: str) -> np.dtype:
    """A 4x packed MX dtype: one opaque ``bits``-wide element holding 4 values (a one-field record
    dtype named after the NKI type, so the three types compare unequal and keep their itemsize)."""
    return np.dtype([(name, bits)])


# "4x packed ... elements, custom data type for nki.isa.nc_matmul_mx on NeuronCore-v4" (NKI 0.6
# nki/api/nki/language/__init__.py). Sizes as nki-library's allocator.sizeinbytes: fp8 x4 = 4 bytes,
# fp4 x4 = 2 bytes. The interpreter models trn2: it allocates, DMA-copies and reinterprets them,
# and no engine computes on them (nc_matmul_mx / quantize_mx are NeuronCore-v4 instructions).
float8_e4m3fn_x4 = _packed("float8_e4m3fn_x4", "<u4")
float8_e5m2_x4 = _packed("float8_e5m2_x4", "<u4")
float4_e2m1fn_x4 = _packed("float4_e2m1fn_x4", "<u2")
PACKED_X4: frozenset[np.dtype] = frozenset({float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4})

NKI_DTYPES: frozenset[np.dtype] = frozenset(
    {bool_, int8, int16, int32, uint8, uint16, uint32, float16, bfloat16, float32,
     float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu}
) | PACKED_X4
_LOW_FLOATS = frozenset({bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu})
_INT_INFO = {d: np.iinfo(d) for d in (int8, int16, int32, uint8, uint16, uint32)}


_RESOLVED: dict[Any, np.dtype] = {}  # resolve() results by argument (dtype objects, types, names)


def resolve(dtype: Any, op: str = "dtype") -> np.dtype:
    """``dtype`` as an NKI numpy dtype (accepts dtype objects, numpy types and names like 'bfloat16')."""
    try:
        return _RESOLVED[dtype]
    except (KeyError, TypeError):  # not seen yet / unhashable
        pass
    try:
        dt = np.dtype(dtype)
    except TypeError:
        fail(op, "{dtype!r} is not an NKI dtype", dtype=dtype)
    if dt not in NKI_DTYPES:
        fail(op, "dtype {dtype} is not an NKI dtype (supported: {names})", dtype=dt.name,
             names=", ".join(sorted(_NAMES[d] for d in NKI_DTYPES)))
    try:
        _RESOLVED[dtype] = dt
    except TypeError:
        pass
    return dt


def is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt in _LOW_FLOATS


def is_int(dt: np.dtype) -> bool:
    return dt.kind in "iu"


_NAMES: dict[np.dtype, str] = {d: d.names[0] if d in PACKED_X4 else d.name for d in NKI_DTYPES}


def dtype_name(dt: np.dtype) -> str:
    """``dt.name``, cached (numpy computes the name of builtin dtypes on every access, ~4 us)."""
    name = _NAMES.get(dt)
    if name is None:
        name = _NAMES[dt] = dt.name
    return name


def sentinel(dt: np.dtype) -> Any:
    """Fill value of fresh allocations, as the official simulator: NaN for floats, 4 for ints."""
    value = _SENTINELS.get(dt, _SENTINELS)
    if value is _SENTINELS:
        value = _SENTINELS[dt] = _sentinel(dt)
    return value


_SENTINELS: dict[np.dtype, Any] = {}


def _sentinel(dt: np.dtype) -> Any:
    if dt in PACKED_X4:
        return np.zeros((), dt)  # opaque bits: no NaN pattern is defined
    if dt == float8_e8m0fnu:
        return np.nan  # e8m0 has NaN (0xFF)
    if is_float(dt):
        return np.nan
    if dt == bool_:
        return True
    return 4


def cast(values: Any, dtype: np.dtype) -> np.ndarray:
    """``values`` converted to ``dtype`` the way the engines write their output.

    float -> narrower float: round to nearest even (ml_dtypes / numpy). float -> int: RNE, saturate to
    the int range, NaN -> 0. int -> int: saturate. Anything -> bool: non-zero. Same dtype: returned
    as is (no copy).
    """
    arr = np.asarray(values)
    src = arr.dtype
    if src == dtype:
        return arr
    if dtype in PACKED_X4 or src in PACKED_X4:
        fail("cast", "{src} -> {dst}: 4x packed MX dtypes are only moved and reinterpreted by "
             "trnkit's interpreter (no engine converts them on trn2)", src=dtype_name(src),
             dst=dtype_name(dtype))
    if dtype.kind in "iu":
        info = _INT_INFO[dtype]
        if src.kind in "iu" or src == bool_:
            if src == bool_ or (np.iinfo(src).min >= info.min and np.iinfo(src).max <= info.max):
                return arr.astype(dtype)
            return np.clip(arr, info.min, info.max).astype(dtype)
        f = arr.astype(np.float64) if src != np.float64 else arr
        f = np.rint(f)
        f = np.clip(f, info.min, info.max)
        f = np.nan_to_num(f, nan=0.0, copy=not isinstance(f, np.ndarray))  # a 0-d value comes back a scalar
        return f.astype(dtype)
    if dtype == bool_:
        return arr != 0
    if src.kind in "iu" or src == bool_:
        return arr.astype(np.float32).astype(dtype) if dtype in _LOW_FLOATS else arr.astype(dtype)
    if dtype in _LOW_FLOATS and src != float32:
        # Engines compute in fp32; going through fp32 first matches the hardware's two-step cast.
        arr = arr.astype(np.float32)
    return arr.astype(dtype)
