"""The matrix-multiplication tutorial's four kernels, ported to the current NKI API.

Adapted from the AWS Neuron SDK example ``general/nki/examples/matrix_multiplication/
matrix_multiplication_nki_kernels.py`` as published with **Neuron SDK 2.20.0** (aws-neuron/aws-neuron-sdk
commit 72825d50, Sept 2024; Copyright (C) 2024 Amazon.com, the SDK examples are meant to be adapted):
the version whose latencies the tutorial ``general/nki/tutorials/matrix_multiplication.rst`` first
published (the table is unchanged up to the 2.27 docs) for ``[4096, 8192] @ [8192, 8192]`` bf16 on
trn1.32xlarge.

What the port changes, and only that (same loops, same tiling, same shapes, same dtypes):

* ``nl.load`` / ``nl.store`` become ``nisa.dma_copy`` into / out of ``nl.ndarray`` tiles, and every
  ``nisa`` call writes an explicit ``dst`` (the 0.6 API).
* ``nl.matmul(lhsT_tile, rhs_tile, transpose_x=True)`` accumulated into a PSUM tile from ``nl.zeros`` is
  ``nisa.nc_matmul(dst=psum, stationary=lhsT_tile, moving=rhs_tile)``: the first matmul into a PSUM
  tile overwrites, later ones accumulate (what the zero-initialised ``+=`` computes; no separate PSUM
  memset is issued).
* ``nl.copy(res_psum, dtype=result.dtype)`` is ``nisa.tensor_copy`` (Vector, the interpreter's default
  engine for it); ``result_tiles[...] += res_tile`` (SBUF bf16 += PSUM fp32) is a Vector
  ``tensor_tensor`` add; ``nl.zeros`` in SBUF is ``nisa.memset``.
* ``nki_matmul_hoist_load_`` declares its lhsT buffer ``(K // 128, par_dim(128), 512)`` but loads and
  reads only ``[:, :, 0:128]`` of it; the port declares the same shape.
* The kernels return ``result`` (an ``nl.shared_hbm`` tensor) instead of writing a caller's array.
"""

from __future__ import annotations

from trnkit.nki_api import nisa, nki, nl

TILE_M = 128  # nl.tile_size.gemm_stationary_fmax
TILE_K = 128  # nl.tile_size.pmax
TILE_N = 512  # nl.tile_size.gemm_moving_fmax


def _shapes(lhsT, rhs):
    K, M = lhsT.shape
    K_, N = rhs.shape
    assert K == K_, "lhsT and rhs must have the same contraction dimension"
    return K, M, N, nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)


def _evict(result, res_psum, r0, c0):
    """PSUM tile -> SBUF in the result dtype -> HBM at ``result[r0:r0+128, c0:c0+512]``."""
    res_sb = nl.ndarray((TILE_M, TILE_N), dtype=result.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res_sb, src=res_psum)
    nisa.dma_copy(dst=result[r0:r0 + TILE_M, c0:c0 + TILE_N], src=res_sb)


@nki.jit
def matmul_tiled(lhsT, rhs):
    """2.20 ``nki_matmul_tiled_``: both input tiles loaded for every matmul."""
    K, M, N, result = _shapes(lhsT, rhs)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            res_psum = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                lhsT_tile = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                rhs_tile = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=lhsT_tile, src=lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                nisa.dma_copy(dst=rhs_tile, src=rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                nisa.nc_matmul(dst=res_psum, stationary=lhsT_tile, moving=rhs_tile)
            _evict(result, res_psum, m * TILE_M, n * TILE_N)
    return result


@nki.jit
def matmul_hoist_load(lhsT, rhs):
    """2.20 ``nki_matmul_hoist_load_``: a K-column of lhsT loaded once per m, of rhs once per (m, n)."""
    K, M, N, result = _shapes(lhsT, rhs)
    for m in nl.affine_range(M // TILE_M):
        lhsT_tiles = nl.ndarray((TILE_K, K // TILE_K, TILE_N), dtype=lhsT.dtype, buffer=nl.sbuf)
        for k in nl.affine_range(K // TILE_K):
            nisa.dma_copy(dst=lhsT_tiles[:, k, 0:TILE_M],
                          src=lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
        for n in nl.affine_range(N // TILE_N):
            rhs_tiles = nl.ndarray((TILE_K, K // TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
            for k in nl.affine_range(K // TILE_K):
                nisa.dma_copy(dst=rhs_tiles[:, k, :],
                              src=rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
            res_psum = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                nisa.nc_matmul(dst=res_psum, stationary=lhsT_tiles[:, k, 0:TILE_M], moving=rhs_tiles[:, k, :])
            _evict(result, res_psum, m * TILE_M, n * TILE_N)
    return result


@nki.jit
def matmul_block_free_dimension(lhsT, rhs):
    """2.20 ``nki_matmul_block_free_dimension_``: blocks of 2 M-tiles x 2 N-tiles share their loads."""
    K, M, N, result = _shapes(lhsT, rhs)
    TILES_IN_BLOCK_M = 2
    TILES_IN_BLOCK_N = 2
    BLOCK_M = TILE_M * TILES_IN_BLOCK_M  # 256
    BLOCK_N = TILE_N * TILES_IN_BLOCK_N  # 1024
    assert M % BLOCK_M == 0 and N % BLOCK_N == 0
    for m in nl.affine_range(M // BLOCK_M):
        lhsT_tiles = nl.ndarray((TILE_K, TILES_IN_BLOCK_M, K // TILE_K, TILE_M), dtype=lhsT.dtype,
                                buffer=nl.sbuf)
        for bm in nl.affine_range(TILES_IN_BLOCK_M):
            for k in nl.affine_range(K // TILE_K):
                c0 = (m * TILES_IN_BLOCK_M + bm) * TILE_M
                nisa.dma_copy(dst=lhsT_tiles[:, bm, k, :], src=lhsT[k * TILE_K:(k + 1) * TILE_K, c0:c0 + TILE_M])
        for n in nl.affine_range(N // BLOCK_N):
            rhs_tiles = nl.ndarray((TILE_K, TILES_IN_BLOCK_N, K // TILE_K, TILE_N), dtype=rhs.dtype,
                                   buffer=nl.sbuf)
            for bn in nl.affine_range(TILES_IN_BLOCK_N):
                for k in nl.affine_range(K // TILE_K):
                    c0 = (n * TILES_IN_BLOCK_N + bn) * TILE_N
                    nisa.dma_copy(dst=rhs_tiles[:, bn, k, :], src=rhs[k * TILE_K:(k + 1) * TILE_K, c0:c0 + TILE_N])
            for bm in nl.affine_range(TILES_IN_BLOCK_M):
                for bn in nl.affine_range(TILES_IN_BLOCK_N):
                    res_psum = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(K // TILE_K):
                        nisa.nc_matmul(dst=res_psum, stationary=lhsT_tiles[:, bm, k, :], moving=rhs_tiles[:, bn, k, :])
                    _evict(result, res_psum, (m * TILES_IN_BLOCK_M + bm) * TILE_M,
                           (n * TILES_IN_BLOCK_N + bn) * TILE_N)
    return result


@nki.jit
def matmul_fully_optimized(lhsT, rhs, TILES_IN_BLOCK_M=16, TILES_IN_BLOCK_N=2, TILES_IN_BLOCK_K=8):
    """2.20 ``nki_matmul_fully_optimized_``: all three dims blocked, results accumulated in SBUF."""
    K, M, N, result = _shapes(lhsT, rhs)
    BLOCK_M = TILE_M * TILES_IN_BLOCK_M
    BLOCK_N = TILE_N * TILES_IN_BLOCK_N
    BLOCK_K = TILE_K * TILES_IN_BLOCK_K
    assert M % BLOCK_M == 0 and N % BLOCK_N == 0 and K % BLOCK_K == 0
    NUM_BLOCK_M = M // BLOCK_M
    NUM_BLOCK_N = N // BLOCK_N
    NUM_BLOCK_K = K // BLOCK_K
    for n in nl.affine_range(NUM_BLOCK_N):
        result_tiles = nl.ndarray((TILE_M, NUM_BLOCK_M, TILES_IN_BLOCK_M, TILES_IN_BLOCK_N, TILE_N),
                                  dtype=lhsT.dtype, buffer=nl.sbuf)
        nisa.memset(dst=result_tiles, value=0.0)
        for k in nl.sequential_range(NUM_BLOCK_K):
            rhs_tiles = nl.ndarray((TILE_K, TILES_IN_BLOCK_K, BLOCK_N), dtype=rhs.dtype, buffer=nl.sbuf)
            for bk_r in nl.affine_range(TILES_IN_BLOCK_K):
                r0 = (TILES_IN_BLOCK_K * k + bk_r) * TILE_K
                nisa.dma_copy(dst=rhs_tiles[:, bk_r, :], src=rhs[r0:r0 + TILE_K, BLOCK_N * n:BLOCK_N * (n + 1)])
            for m in nl.affine_range(NUM_BLOCK_M):
                lhsT_tiles = nl.ndarray((TILE_K, TILES_IN_BLOCK_K, BLOCK_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                for bk_l in nl.affine_range(TILES_IN_BLOCK_K):
                    r0 = (TILES_IN_BLOCK_K * k + bk_l) * TILE_K
                    nisa.dma_copy(dst=lhsT_tiles[:, bk_l, :], src=lhsT[r0:r0 + TILE_K, BLOCK_M * m:BLOCK_M * (m + 1)])
                for bn in nl.affine_range(TILES_IN_BLOCK_N):
                    for bm in nl.affine_range(TILES_IN_BLOCK_M):
                        res_tile = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                        for bk in nl.affine_range(TILES_IN_BLOCK_K):
                            nisa.nc_matmul(dst=res_tile, stationary=lhsT_tiles[:, bk, bm * TILE_M:(bm + 1) * TILE_M],
                                           moving=rhs_tiles[:, bk, bn * TILE_N:(bn + 1) * TILE_N])
                        acc = result_tiles[:, m, bm, bn, :]
                        nisa.tensor_tensor(dst=acc, data1=acc, data2=res_tile, op=nl.add)
        for m in nl.affine_range(NUM_BLOCK_M):
            for bm in nl.affine_range(TILES_IN_BLOCK_M):
                result_packed = nl.ndarray((TILE_K, BLOCK_N), dtype=result_tiles.dtype, buffer=nl.sbuf)
                for bn in nl.affine_range(TILES_IN_BLOCK_N):
                    nisa.tensor_copy(dst=result_packed[:, bn * TILE_N:(bn + 1) * TILE_N],
                                     src=result_tiles[:, m, bm, bn, :])
                r0 = (TILES_IN_BLOCK_M * m + bm) * TILE_K
                nisa.dma_copy(dst=result[r0:r0 + TILE_K, BLOCK_N * n:BLOCK_N * (n + 1)], src=result_packed)
    return result


KERNELS = {"tiled": matmul_tiled, "hoist_load": matmul_hoist_load,
           "block_free_dimension": matmul_block_free_dimension, "fully_optimized": matmul_fully_optimized}
