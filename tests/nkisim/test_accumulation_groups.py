"""At most eight outstanding matmul accumulation groups (trainium_inferentia2_arch.rst, "PSUM
accumulation"): a group is outstanding from its first matmul to its last; checked when the kernel
instance returns (``memory.Memory.check_accumulation_groups``)."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim.errors import NkiValidationError

K, M, N = 128, 128, 128


def _load(src, rows=slice(None)):
    t = nl.ndarray((K, src.shape[1]), src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src[rows, :])
    return t


def _store(out, acc, cols):
    res = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)
    nisa.dma_copy(dst=out[:, cols], src=res)


@nki.jit
def sequential_groups(a, b, n_tiles, k_steps):
    """AWS's pattern (attention_tkg, output_projection_tkg): one PSUM tile per output block kept in a
    list, each accumulated to the end before the next starts, all evacuated afterwards."""
    out = nl.ndarray((M, N * n_tiles), nl.float32, buffer=nl.shared_hbm)
    accs = []
    for j in range(n_tiles):
        acc = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
        for k in range(k_steps):
            nisa.nc_matmul(dst=acc, stationary=_load(a[k * K:(k + 1) * K, :]),
                           moving=_load(b[k * K:(k + 1) * K, j * N:(j + 1) * N]))
        accs.append(acc)
    for j, acc in enumerate(accs):
        _store(out, acc, slice(j * N, (j + 1) * N))
    return out


@nki.jit
def interleaved_groups(a, b, n_tiles, k_steps):
    """The contraction outermost: every tile's group stays open until the last k."""
    out = nl.ndarray((M, N * n_tiles), nl.float32, buffer=nl.shared_hbm)
    accs = [nl.ndarray((M, N), nl.float32, buffer=nl.psum) for _ in range(n_tiles)]
    for k in range(k_steps):
        lhs = _load(a[k * K:(k + 1) * K, :])
        for j, acc in enumerate(accs):
            nisa.nc_matmul(dst=acc, stationary=lhs, moving=_load(b[k * K:(k + 1) * K, j * N:(j + 1) * N]))
    for j, acc in enumerate(accs):
        _store(out, acc, slice(j * N, (j + 1) * N))
    return out


@nki.jit
def views_of_one_tile(a, b, n_other):
    """Four 128-column views of one [128, 512] tile (one bank, one group) interleaved with
    ``n_other`` other open groups."""
    out = nl.ndarray((M, 4 * N + n_other * N), nl.float32, buffer=nl.shared_hbm)
    big = nl.ndarray((M, 4 * N), nl.float32, buffer=nl.psum)
    others = [nl.ndarray((M, N), nl.float32, buffer=nl.psum) for _ in range(n_other)]
    lhs = _load(a[0:K, :])
    for q in range(4):
        nisa.nc_matmul(dst=big[:, q * N:(q + 1) * N], stationary=lhs, moving=_load(b[0:K, q * N:(q + 1) * N]))
        for acc in others:
            nisa.nc_matmul(dst=acc, stationary=lhs, moving=_load(b[0:K, 0:N]))
    _store(out, big, slice(0, 4 * N))
    for j, acc in enumerate(others):
        _store(out, acc, slice((4 + j) * N, (5 + j) * N))
    return out


@nki.jit
def reused_tile(a, b, n_other):
    """One PSUM tile accumulated, read out, then restarted (a second group) while ``n_other`` other
    groups stay open across the restart."""
    out = nl.ndarray((M, 2 * N), nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
    others = [nl.ndarray((M, N), nl.float32, buffer=nl.psum) for _ in range(n_other)]
    lhs, rhs = _load(a[0:K, :]), _load(b[0:K, 0:N])
    for o in others:
        nisa.nc_matmul(dst=o, stationary=lhs, moving=rhs)
    nisa.nc_matmul(dst=acc, stationary=lhs, moving=rhs)
    _store(out, acc, slice(0, N))
    nisa.nc_matmul(dst=acc, stationary=lhs, moving=rhs, accumulate=False)  # a new group
    for o in others:
        nisa.nc_matmul(dst=o, stationary=lhs, moving=rhs)
    _store(out, acc, slice(N, 2 * N))
    return out


def _inputs(k_steps, n_cols, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((K * k_steps, M)).astype(np.float32),
            rng.standard_normal((K * k_steps, n_cols)).astype(np.float32))


@pytest.mark.parametrize("n_tiles, k_steps", [(12, 1), (16, 3)])
def test_sequential_groups_into_many_kept_tiles_run(n_tiles, k_steps):
    """12 single-matmul groups, 16 three-matmul groups: never more than one outstanding."""
    a, b = _inputs(k_steps, n_tiles * N)
    np.testing.assert_allclose(sequential_groups(a, b, n_tiles, k_steps), a.T.astype(np.float64) @ b,
                               rtol=1e-4, atol=1e-3)


def test_eight_interleaved_groups_run_and_a_ninth_is_refused():
    a, b = _inputs(2, 9 * N)
    np.testing.assert_allclose(interleaved_groups(a, b[:, :8 * N], 8, 2), a.T.astype(np.float64) @ b[:, :8 * N],
                               rtol=1e-4, atol=1e-3)
    with pytest.raises(NkiValidationError, match=r"nc_matmul: the matmul accumulation group on 'psum_\d+' at "
                       r"instruction \d+ \(until instruction \d+\) would be the 9th outstanding one; TensorE "
                       r"has at most 8 \(trainium_inferentia2_arch.rst"):
        interleaved_groups(a, b, 9, 2)


def test_a_single_k_step_closes_each_group_at_once():
    a, b = _inputs(1, 9 * N)  # nine one-matmul groups, interleaving nothing
    np.testing.assert_allclose(interleaved_groups(a, b, 9, 1), a.T.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


def test_views_of_one_tile_are_one_group():
    a, b = _inputs(1, 4 * N)
    ref = a.T.astype(np.float64) @ b
    out = views_of_one_tile(a, b, 7)  # 1 + 7 groups
    np.testing.assert_allclose(out[:, :4 * N], ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(out[:, 4 * N:], np.tile(4 * ref[:, :N], (1, 7)), rtol=1e-4, atol=1e-3)  # 4 adds
    with pytest.raises(NkiValidationError, match="9th outstanding"):
        views_of_one_tile(a, b, 8)


def test_a_restarted_tile_opens_a_new_group():
    a, b = _inputs(1, N)
    ref = a.T.astype(np.float64) @ b
    np.testing.assert_allclose(reused_tile(a, b, 7), np.tile(ref, (1, 2)), rtol=1e-4, atol=1e-3)
    # 7 others + the first group + the restarted one: the first closed when it was read, so 8 at most;
    # with 8 others the restart is the 9th
    with pytest.raises(NkiValidationError, match="9th outstanding"):
        reused_tile(a, b, 8)
