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
