"""Thread count of numpy's BLAS, for interpreter-heavy runs.

Kernels issue thousands of small matmuls (``nc_matmul`` is at most 128 x 128 x 512). A multi-threaded
BLAS gains little on them and, on a busy machine, loses a lot: on the 2-core CI box a 128x128x512
fp32 matmul took 0.2-0.4 ms with one BLAS thread and 0.4-25 ms with two (thread hand-off under
contention), and the tiled 2048^3 matmul kernel ran at 2.5x numpy's own matmul instead of 7-60x.
At the debug-moe training shapes the MoE forward kernel took 706 ms with the default thread count
and 53 ms with one thread (backward 1758 ms vs 203 ms), on a loaded machine.

Nothing here runs on import. Kernel launches (``trnkit.nkisim.jit``) run inside
:func:`launch_threads`, which switches numpy's BLAS to :data:`LAUNCH_THREADS` threads (default 1;
``TRNKIT_NKISIM_BLAS_THREADS=<n>`` changes it, ``0`` leaves the BLAS alone) for the duration of the
outermost launch and restores the previous count afterwards. Callers can also set it process-wide
(``set_num_threads(1)``) or set ``OPENBLAS_NUM_THREADS=1`` before numpy is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import threading
from collections.abc import Iterator

import numpy as np

__all__ = ["set_num_threads", "get_num_threads", "launch_threads", "threads", "LAUNCH_THREADS"]

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_", "openblas_get_num_threads")


def _launch_threads_from_env() -> int:
    raw = os.environ.get("TRNKIT_NKISIM_BLAS_THREADS", "1").strip()
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"TRNKIT_NKISIM_BLAS_THREADS must be an integer >= 0, got {raw!r}") from None
    if n < 0:
        raise ValueError(f"TRNKIT_NKISIM_BLAS_THREADS must be an integer >= 0, got {raw!r}")
    return n


#: BLAS threads while a kernel runs in the interpreter (0: leave numpy's BLAS as it is).
LAUNCH_THREADS: int = _launch_threads_from_env()


@functools.cache
def _openblas() -> ctypes.CDLL | None:
    """numpy's bundled OpenBLAS (the wheels ship it in ``numpy.libs``), or None."""
    here = os.path.dirname(np.__file__)
    for path in sorted(glob.glob(os.path.join(here, os.pardir, "numpy.libs", "*openblas*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@functools.cache
def _function(names: tuple[str, ...], setter: bool) -> ctypes._CFuncPtr | None:
    # (Only numpy wheels' bundled OpenBLAS is handled; other BLAS builds report None.)
    lib = _openblas()
    if lib is None:
        return None
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = None if setter else ctypes.c_int
            fn.argtypes = [ctypes.c_int] if setter else []
            return fn
    return None


def set_num_threads(n: int) -> bool:
    """Use ``n`` BLAS threads for numpy from now on; False if numpy's BLAS could not be reached."""
    if n < 1:
        raise ValueError(f"blas.set_num_threads: n must be >= 1, got {n}")
    fn = _function(_SETTERS, True)
    if fn is None:
        return False
    fn(int(n))
    return True


def get_num_threads() -> int | None:
    """numpy's current BLAS thread count (None if unknown)."""
    fn = _function(_GETTERS, False)
    return None if fn is None else int(fn())


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the body with numpy's BLAS on ``n`` threads and restore the previous count after (one caller at a
    time: concurrent kernel launches share :func:`launch_threads` instead)."""
    before = get_num_threads()
    if before is None or before == n:
        yield
        return
    set_num_threads(n)
    try:
        yield
    finally:
        set_num_threads(before)


_lock = threading.Lock()
_depth = 0
_saved: int | None = None


@contextlib.contextmanager
def launch_threads() -> Iterator[None]:
    """Run the body with numpy's BLAS on :data:`LAUNCH_THREADS` threads (nested / concurrent launches
    share one switch: the outermost entry sets it, the last exit restores the previous count)."""
    global _depth, _saved  # noqa: PLW0603 - numpy's BLAS thread count is process state
    if LAUNCH_THREADS < 1:
        yield
        return
    with _lock:
        if _depth == 0:
            before = get_num_threads()
            if before is not None and before != LAUNCH_THREADS:
                set_num_threads(LAUNCH_THREADS)
                _saved = before
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                set_num_threads(_saved)
                _saved = None
