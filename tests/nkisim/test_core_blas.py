"""trnkit.nkisim.blas: numpy's BLAS thread count can be read and set (numpy wheels' OpenBLAS)."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit.nkisim import blas


def test_set_and_restore_blas_threads():
    before = blas.get_num_threads()
    if before is None:
        pytest.skip("numpy is not linked against its bundled OpenBLAS here")
    try:
        assert blas.set_num_threads(1) is True
        assert blas.get_num_threads() == 1
        a = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
        np.testing.assert_allclose(a @ np.eye(64, dtype=np.float32), a)  # BLAS still works
    finally:
        blas.set_num_threads(before)
    assert blas.get_num_threads() == before
    with pytest.raises(ValueError, match="n must be >= 1"):
        blas.set_num_threads(0)


def test_kernel_launch_runs_single_threaded_and_restores(monkeypatch):
    """jit launches switch numpy's BLAS to LAUNCH_THREADS (1) and restore the caller's count after."""
    from trnkit.nki_api import nisa, nki, nl

    before = blas.get_num_threads()
    if before is None:
        pytest.skip("numpy is not linked against its bundled OpenBLAS here")
    seen = []

    @nki.jit
    def probe(x):
        seen.append(blas.get_num_threads())
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    try:
        blas.set_num_threads(2)
        np.testing.assert_array_equal(probe(x), x)
        np.testing.assert_array_equal(probe[2](x), x)  # grid: both programs see one thread
        assert seen == [1, 1, 1]
        assert blas.get_num_threads() == 2
        monkeypatch.setattr(blas, "LAUNCH_THREADS", 0)  # 0: the launch leaves the BLAS alone
        probe(x)
        assert seen[-1] == 2
    finally:
        blas.set_num_threads(before)


def test_threads_runs_the_body_on_n_threads_and_restores():
    before = blas.get_num_threads()
    if before is None:
        pytest.skip("numpy is not linked against its bundled OpenBLAS here")
    try:
        blas.set_num_threads(2)
        with blas.threads(1):
            assert blas.get_num_threads() == 1
        assert blas.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"), blas.threads(1):
            raise RuntimeError("inside")
        assert blas.get_num_threads() == 2  # restored after an exception too
    finally:
        blas.set_num_threads(before)
