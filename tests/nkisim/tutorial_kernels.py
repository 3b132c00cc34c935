"""The NKI tutorial kernels, written here in the current (dst-first) API.

Tensor add, 2-D transpose (free dims, and a full matrix transpose on the Tensor engine), basic and
tiled matmul, RMSNorm, LayerNorm and softmax — the programs of the official NKI tutorials, in our own words,
with tail tiles wherever a shape need not divide the tile size. They import NKI only through the
resolver, so the same code runs on trnkit's interpreter and on the real ``nki``.
"""

from __future__ import annotations

from trnkit.nki_api import nki, nisa, nl

P_MAX = 128  # nl.tile_size.pmax (kernels hard-code it, as nki-library does)
F_TILE = 512  # free-dim chunk for elementwise work (one PSUM bank of fp32)


@nki.jit
def tensor_add(a, b):
    """``a + b`` for 2-D HBM tensors of any shape: 128-row x 512-column tiles, tails included."""
    rows, cols = a.shape
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    for r0 in range(0, rows, P_MAX):
        pr = min(P_MAX, rows - r0)
        for c0 in range(0, cols, F_TILE):
            fc = min(F_TILE, cols - c0)
            ta = nl.ndarray((pr, fc), dtype=a.dtype, buffer=nl.sbuf)
            tb = nl.ndarray((pr, fc), dtype=b.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=ta, src=a[r0:r0 + pr, c0:c0 + fc])
            nisa.dma_copy(dst=tb, src=b[r0:r0 + pr, c0:c0 + fc])
            tc = nl.ndarray((pr, fc), dtype=a.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=tc, data1=ta, data2=tb, op=nl.add)
            nisa.dma_copy(dst=out[r0:r0 + pr, c0:c0 + fc], src=tc)
    return out


@nki.jit
def transpose2d(x):
    """``x [P, X, Y] -> [P, Y, X]``: each partition's X-by-Y block transposed on chip.

    The swap is a strided (permuted) view of the SBUF tile read by one ``tensor_copy``.
    """
    p, nx, ny = x.shape
    out = nl.ndarray((p, ny, nx), dtype=x.dtype, buffer=nl.shared_hbm)
    src = nl.ndarray((p, nx, ny), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=x)
    dst = nl.ndarray((p, ny, nx), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=dst, src=src.permute((0, 2, 1)))
    nisa.dma_copy(dst=out, src=dst)
    return out


@nki.jit
def transpose_matrix(x):
    """``x [M, N] -> [N, M]`` in 128 x 128 blocks on the Tensor engine (tail blocks included)."""
    m, n = x.shape
    out = nl.ndarray((n, m), dtype=x.dtype, buffer=nl.shared_hbm)
    for i0 in range(0, m, P_MAX):
        pi = min(P_MAX, m - i0)
        for j0 in range(0, n, P_MAX):
            pj = min(P_MAX, n - j0)
            blk = nl.ndarray((pi, pj), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=blk, src=x[i0:i0 + pi, j0:j0 + pj])
            blk_t = nl.ndarray((pj, pi), dtype=x.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=blk_t, data=blk)
            res = nl.ndarray((pj, pi), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=blk_t)
            nisa.dma_copy(dst=out[j0:j0 + pj, i0:i0 + pi], src=res)
    return out


@nki.jit
def matmul_basic(lhsT, rhs):
    """One Tensor-engine matmul: ``lhsT [K<=128, M<=128]``, ``rhs [K, N<=512]`` -> ``lhsT.T @ rhs``."""
    k, m = lhsT.shape
    _, n = rhs.shape
    out = nl.ndarray((m, n), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray((k, m), dtype=lhsT.dtype, buffer=nl.sbuf)
    b = nl.ndarray((k, n), dtype=rhs.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=lhsT)
    nisa.dma_copy(dst=b, src=rhs)
    acc = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=a, moving=b)
    res = nl.ndarray((m, n), dtype=lhsT.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)  # PSUM fp32 -> SBUF, rounded to the output dtype
    nisa.dma_copy(dst=out, src=res)
    return out


@nki.jit
def matmul_tiled(lhsT, rhs):
    """``lhsT.T @ rhs`` for any ``K x M`` and ``K x N``: M tiles of 128, N tiles of 512, K tiles of
    128 accumulated in one PSUM tile (``accumulate=None``: the first matmul overwrites)."""
    k, m = lhsT.shape
    _, n = rhs.shape
    out = nl.ndarray((m, n), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    tm, tn, tk = nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax, nl.tile_size.pmax
    for m0 in range(0, m, tm):
        pm = min(tm, m - m0)
        for n0 in range(0, n, tn):
            pn = min(tn, n - n0)
            acc = nl.ndarray((pm, pn), dtype=nl.float32, buffer=nl.psum)
            for k0 in range(0, k, tk):
                pk = min(tk, k - k0)
                a = nl.ndarray((pk, pm), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((pk, pn), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k0:k0 + pk, m0:m0 + pm])
                nisa.dma_copy(dst=b, src=rhs[k0:k0 + pk, n0:n0 + pn])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            res = nl.ndarray((pm, pn), dtype=lhsT.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m0:m0 + pm, n0:n0 + pn], src=res)
    return out


@nki.jit
def rmsnorm(x, gamma, eps=1e-6):
    """``x / sqrt(mean(x**2, -1) + eps) * gamma`` for ``x [T, D]`` (rows on partitions), ``gamma [D]``."""
    t, d = x.shape
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    # gamma broadcast to every partition by the DMA access pattern (partition step 0 on HBM).
    g = nl.ndarray((P_MAX, d), dtype=gamma.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=g, src=gamma.ap(pattern=[[0, P_MAX], [1, d]], offset=0))
    for r0 in range(0, t, P_MAX):
        pr = min(P_MAX, t - r0)
        xt = nl.ndarray((pr, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x[r0:r0 + pr, :])
        sq = nl.ndarray((pr, d), dtype=nl.float32, buffer=nl.sbuf)
        ssum = nl.ndarray((pr, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq, op=nl.square, data=xt, reduce_op=nl.add, reduce_res=ssum,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        rstd = nl.ndarray((pr, 1), dtype=nl.float32, buffer=nl.sbuf)
        # rsqrt(ssum / d + eps) on the Scalar engine: scale then bias, one instruction
        nisa.activation(dst=rstd, op=nl.rsqrt, data=ssum, scale=1.0 / d, bias=eps)
        yt = nl.ndarray((pr, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=yt, data=xt, op0=nl.multiply, operand0=rstd)
        ot = nl.ndarray((pr, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=ot, data1=yt, data2=g[0:pr, :], op=nl.multiply)
        nisa.dma_copy(dst=out[r0:r0 + pr, :], src=ot)
    return out


@nki.jit
def softmax(x):
    """Row softmax of ``x [T, C]`` (rows on partitions): max, exp(x - max) with a fused row sum,
    reciprocal, scale."""
    t, c = x.shape
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for r0 in range(0, t, P_MAX):
        pr = min(P_MAX, t - r0)
        xt = nl.ndarray((pr, c), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x[r0:r0 + pr, :])
        neg_max = nl.ndarray((pr, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=xt, axis=1, negate=True)
        e = nl.ndarray((pr, c), dtype=nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((pr, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=xt, bias=neg_max, reduce_op=nl.add, reduce_res=s,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        rs = nl.ndarray((pr, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=rs, data=s)
        ot = nl.ndarray((pr, c), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ot, data=e, op0=nl.multiply, operand0=rs)
        nisa.dma_copy(dst=out[r0:r0 + pr, :], src=ot)
    return out


@nki.jit
def layernorm(x, gamma, beta, eps=1e-5):
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` over the last dim of ``x [T, D]``, with the
    Vector engine's ``bn_stats`` / ``bn_aggr`` (512-element statistics tiles, tail included)."""
    t, d = x.shape
    fmax = nl.tile_size.bn_stats_fmax
    n_stats = (d + fmax - 1) // fmax
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    g = nl.ndarray((P_MAX, d), dtype=gamma.dtype, buffer=nl.sbuf)
    b = nl.ndarray((P_MAX, d), dtype=beta.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=g, src=gamma.ap(pattern=[[0, P_MAX], [1, d]], offset=0))
    nisa.dma_copy(dst=b, src=beta.ap(pattern=[[0, P_MAX], [1, d]], offset=0))
    for r0 in range(0, t, P_MAX):
        pr = min(P_MAX, t - r0)
        xt = nl.ndarray((pr, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x[r0:r0 + pr, :])
        stats = nl.ndarray((pr, 6 * n_stats), dtype=nl.float32, buffer=nl.sbuf)
        for i in range(n_stats):
            c0 = i * fmax
            nisa.bn_stats(dst=stats[:, 6 * i:6 * i + 6], data=xt[:, c0:min(c0 + fmax, d)])
        mv = nl.ndarray((pr, 2), dtype=nl.float32, buffer=nl.sbuf)  # mean | variance
        nisa.bn_aggr(dst=mv, data=stats)
        rstd = nl.ndarray((pr, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd, op=nl.rsqrt, data=mv[:, 1:2], bias=eps)
        xn = nl.ndarray((pr, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=xn, data=xt, op0=nl.subtract, operand0=mv[:, 0:1], op1=nl.multiply,
                           operand1=rstd)
        nisa.tensor_tensor(dst=xn, data1=xn, data2=g[0:pr, :], op=nl.multiply)
        ot = nl.ndarray((pr, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=ot, data1=xn, data2=b[0:pr, :], op=nl.add)
        nisa.dma_copy(dst=out[r0:r0 + pr, :], src=ot)
    return out
