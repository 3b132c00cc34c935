"""Thread count of numpy's BLAS, for interpreter-heavy runs.

Kernels issue thousands of small matmuls (``nc_matmul`` is at most 128 x 128 x 512). A multi-threaded
BLAS gains little on them and, on a busy machine, loses a lot: on the 2-core CI box a 128x128x512
fp32 matmul took 0.2-0.4 ms with one BLAS thread and 0.4-25 ms with two (thread hand-off under
contention), and the tiled 2048^3 matmul kernel ran at 2.5x numpy's own matmul instead of 7-60x.
Nothing here runs on import; callers opt in (``set_num_threads(1)``) or set ``OPENBLAS_NUM_THREADS=1``
before numpy is imported.
"""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np

__all__ = ["set_num_threads", "get_num_threads"]

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_", "openblas_get_num_threads")


def _openblas() -> ctypes.CDLL | None:
    """numpy's bundled OpenBLAS (the wheels ship it in ``numpy.libs``), or None."""
    here = os.path.dirname(np.__file__)
    for path in sorted(glob.glob(os.path.join(here, os.pardir, "numpy.libs", "*openblas*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _call(names: tuple[str, ...], *args: int) -> int | None:
    # (Only numpy wheels' bundled OpenBLAS is handled; other BLAS builds report None.)
    lib = _openblas()
    if lib is None:
        return None
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int if not args else None
            out = fn(*(ctypes.c_int(a) for a in args))
            return args[0] if args else int(out)
    return None


def set_num_threads(n: int) -> bool:
    """Use ``n`` BLAS threads for numpy from now on; False if numpy's BLAS could not be reached."""
    if n < 1:
        raise ValueError(f"blas.set_num_threads: n must be >= 1, got {n}")
    return _call(_SETTERS, int(n)) is not None


def get_num_threads() -> int | None:
    """numpy's current BLAS thread count (None if unknown)."""
    return _call(_GETTERS)
