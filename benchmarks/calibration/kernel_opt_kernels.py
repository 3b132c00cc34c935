"""The kernel-optimization tutorial's matmul kernels (v2 .. v5), as its text gives them.

Source: aws-neuron/aws-neuron-sdk ``nki/guides/tutorials/kernel-optimization.rst`` (commit 81ce03ae; the
kernels are written in the current NKI API, ``NEURON_PLATFORM_TARGET_OVERRIDE=trn2``, inputs
``rng.random((4096, 8192), dtype=np.float32)`` and ``(8192, 8192)``); its profile screenshots
(``nki/img/how-to/v{2,3,4,5}-full.png``) show one NeuronCore (nc0) running 39.89 / 28.20 / 28.41 /
28.30 ms. The code below is the tutorial's, with only what the interpreter needs changed: the result
is an ``nl.shared_hbm`` tensor (the tutorial's ``nl.hbm``), the ``os.environ`` line and the asserts'
messages are dropped. Loops, tiles, DMA shapes, dtypes and instruction order are unchanged.
"""

from __future__ import annotations

from trnkit.nki_api import nisa, nki, nl

TILE_M = 128  # nl.tile_size.gemm_stationary_fmax
TILE_K = 128  # nl.tile_size.pmax
TILE_N = 512  # nl.tile_size.gemm_moving_fmax


def _evict(result, result_tile, r0, c0):
    """The tutorial's PSUM -> SBUF ``tensor_copy`` and SBUF -> HBM ``dma_copy`` of one output tile."""
    result_tmp = nl.ndarray(shape=(TILE_M, TILE_N), dtype=result.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=result_tmp, src=result_tile)
    nisa.dma_copy(dst=result[r0:r0 + TILE_M, c0:c0 + TILE_N], src=result_tmp)


def _load(src, r0, c0, rows, cols):
    t = nl.ndarray(shape=(rows, cols), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src[r0:r0 + rows, c0:c0 + cols])
    return t


@nki.jit
def v2_tiled(lhsT, rhs):
    """"Writing the kernel": both tiles loaded before every matmul."""
    K, M = lhsT.shape
    K_, N = rhs.shape
    assert K == K_ and M % TILE_M == 0 and N % TILE_N == 0 and K % TILE_K == 0
    result = nl.ndarray(shape=(M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            result_tile = nl.ndarray(shape=(TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                lhsT_tile = _load(lhsT, k * TILE_K, m * TILE_M, TILE_K, TILE_M)
                rhs_tile = _load(rhs, k * TILE_K, n * TILE_N, TILE_K, TILE_N)
                nisa.nc_matmul(dst=result_tile, stationary=lhsT_tile, moving=rhs_tile)
            _evict(result, result_tile, m * TILE_M, n * TILE_N)
    return result


@nki.jit
def v3_hoisted(lhsT, rhs):
    """Loads hoisted: a K-column of lhsT tiles per m, of rhs tiles per (m, n)."""
    K, M = lhsT.shape
    K_, N = rhs.shape
    assert K == K_ and M % TILE_M == 0 and N % TILE_N == 0 and K % TILE_K == 0
    result = nl.ndarray(shape=(M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        lhsT_tiles = [_load(lhsT, k * TILE_K, m * TILE_M, TILE_K, TILE_M) for k in nl.affine_range(K // TILE_K)]
        for n in nl.affine_range(N // TILE_N):
            rhs_tiles = [_load(rhs, k * TILE_K, n * TILE_N, TILE_K, TILE_N) for k in nl.affine_range(K // TILE_K)]
            result_tile = nl.ndarray(shape=(TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                nisa.nc_matmul(dst=result_tile, stationary=lhsT_tiles[k], moving=rhs_tiles[k])
            _evict(result, result_tile, m * TILE_M, n * TILE_N)
    return result


@nki.jit
def v4_blocked_free(lhsT, rhs):
    """Free dims blocked: 2 M-tiles x 2 N-tiles share their K-columns of loads."""
    K, M = lhsT.shape
    K_, N = rhs.shape
    TILES_IN_BLOCK_M = 2
    TILES_IN_BLOCK_N = 2
    BLOCK_M = TILE_M * TILES_IN_BLOCK_M  # 256
    BLOCK_N = TILE_N * TILES_IN_BLOCK_N  # 1024
    assert K == K_ and M % BLOCK_M == 0 and N % BLOCK_N == 0
    result = nl.ndarray(shape=(M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // BLOCK_M):
        lhsT_tiles = [[_load(lhsT, k * TILE_K, (m * TILES_IN_BLOCK_M + bm) * TILE_M, TILE_K, TILE_M)
                       for k in nl.affine_range(K // TILE_K)] for bm in nl.affine_range(TILES_IN_BLOCK_M)]
        for n in nl.affine_range(N // BLOCK_N):
            rhs_tiles = [[_load(rhs, k * TILE_K, (n * TILES_IN_BLOCK_N + bn) * TILE_N, TILE_K, TILE_N)
                          for k in nl.affine_range(K // TILE_K)] for bn in nl.affine_range(TILES_IN_BLOCK_N)]
            for bm in nl.affine_range(TILES_IN_BLOCK_M):
                for bn in nl.affine_range(TILES_IN_BLOCK_N):
                    result_tile = nl.ndarray(shape=(TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(K // TILE_K):
                        nisa.nc_matmul(dst=result_tile, stationary=lhsT_tiles[bm][k], moving=rhs_tiles[bn][k])
                    _evict(result, result_tile, (m * TILES_IN_BLOCK_M + bm) * TILE_M,
                           (n * TILES_IN_BLOCK_N + bn) * TILE_N)
    return result


@nki.jit
def v5_blocked_all(lhsT, rhs, TILES_IN_BLOCK_M=16, TILES_IN_BLOCK_N=2, TILES_IN_BLOCK_K=8):
    """All three dims blocked; partial sums accumulated in SBUF tiles by VectorE."""
    K, M = lhsT.shape
    K_, N = rhs.shape
    BLOCK_M = TILE_M * TILES_IN_BLOCK_M
    BLOCK_N = TILE_N * TILES_IN_BLOCK_N
    BLOCK_K = TILE_K * TILES_IN_BLOCK_K
    assert K == K_ and M % BLOCK_M == 0 and N % BLOCK_N == 0 and K % BLOCK_K == 0
    result = nl.ndarray(shape=(M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    NUM_BLOCK_M = M // BLOCK_M
    NUM_BLOCK_N = N // BLOCK_N
    NUM_BLOCK_K = K // BLOCK_K
    for n in nl.affine_range(NUM_BLOCK_N):
        result_tmps = []
        for m_idx in range(NUM_BLOCK_M):
            block_m = []
            for bm_idx in range(TILES_IN_BLOCK_M):
                block_n = []
                for bn_idx in range(TILES_IN_BLOCK_N):
                    tile = nl.ndarray(shape=(TILE_M, TILE_N), dtype=lhsT.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=tile, value=0.0)
                    block_n.append(tile)
                block_m.append(block_n)
            result_tmps.append(block_m)
        for k in nl.sequential_range(NUM_BLOCK_K):
            rhs_tiles = [_load(rhs, (TILES_IN_BLOCK_K * k + bk_r) * TILE_K, BLOCK_N * n, TILE_K, BLOCK_N)
                         for bk_r in range(TILES_IN_BLOCK_K)]
            for m in nl.affine_range(NUM_BLOCK_M):
                lhsT_tiles = [_load(lhsT, (TILES_IN_BLOCK_K * k + bk_l) * TILE_K, BLOCK_M * m, TILE_K, BLOCK_M)
                              for bk_l in nl.affine_range(TILES_IN_BLOCK_K)]
                for bn in nl.affine_range(TILES_IN_BLOCK_N):
                    for bm in nl.affine_range(TILES_IN_BLOCK_M):
                        result_tile = nl.ndarray(shape=(TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                        for bk in nl.affine_range(TILES_IN_BLOCK_K):
                            nisa.nc_matmul(dst=result_tile,
                                           stationary=lhsT_tiles[bk][0:TILE_K, bm * TILE_M:(bm + 1) * TILE_M],
                                           moving=rhs_tiles[bk][0:TILE_K, bn * TILE_N:(bn + 1) * TILE_N])
                        nisa.tensor_tensor(dst=result_tmps[m][bm][bn], data1=result_tmps[m][bm][bn],
                                           data2=result_tile, op=nl.add)
        for m in nl.affine_range(NUM_BLOCK_M):
            for bm in nl.affine_range(TILES_IN_BLOCK_M):
                result_packed = nl.ndarray(shape=(TILE_M, BLOCK_N), dtype=nl.float32, buffer=nl.sbuf)
                for bn in nl.affine_range(TILES_IN_BLOCK_N):
                    nisa.tensor_copy(dst=result_packed[0:TILE_M, bn * TILE_N:(bn + 1) * TILE_N],
                                     src=result_tmps[m][bm][bn][0:TILE_M, 0:TILE_N])
                r0 = (TILES_IN_BLOCK_M * m + bm) * TILE_M
                nisa.dma_copy(dst=result[r0:r0 + TILE_M, BLOCK_N * n:BLOCK_N * (n + 1)],
                              src=result_packed[0:TILE_M, 0:BLOCK_N])
    return result


KERNELS = {"v2": v2_tiled, "v3": v3_hoisted, "v4": v4_blocked_free, "v5": v5_blocked_all}
