"""``python -m trnkit demo``: one NKI kernel on the active backend, checked against torch, with its
estimated trn2 time per engine.

The kernel is the tiled matmul of the NKI tutorials (``result[M, N] = lhsT[K, M].T @ rhs[K, N]``),
written in the current NKI API (explicit ``dst``, ``nl.ndarray`` tiles, ``nisa.dma_copy``): for each
128 x 512 output tile, K/128 matmuls accumulate into one PSUM bank, then the tile is cast to the output
dtype on the Vector engine and stored. It is also the kernel of ``benchmarks/interp_speed.py``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from trnkit.nki_api import REAL_NKI, nisa, nki, nl

TILE_K = 128  # nl.tile_size.pmax: contraction on the partition dim
TILE_M = 128  # nl.tile_size.gemm_stationary_fmax
TILE_N = 512  # nl.tile_size.gemm_moving_fmax (one 2 KiB PSUM bank of fp32)


@nki.jit
def matmul_tiled(lhsT, rhs):
    """``lhsT [K, M] @ rhs [K, N] -> [M, N]`` in ``lhsT.dtype`` (fp32 accumulation in PSUM)."""
    K, M = lhsT.shape
    K2, N = rhs.shape
    assert K == K2, f"matmul_tiled: contraction sizes differ (lhsT K={K}, rhs K={K2})"
    assert M % TILE_M == 0 and N % TILE_N == 0 and K % TILE_K == 0, (
        f"matmul_tiled: shapes must be multiples of the tile sizes: M={M} % {TILE_M}, N={N} % {TILE_N}, "
        f"K={K} % {TILE_K}"
    )
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                a = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                nisa.dma_copy(dst=b, src=rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                # first write to the PSUM tile overwrites, later ones accumulate (accumulate=None)
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            out = nl.ndarray((TILE_M, TILE_N), dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=acc)  # PSUM fp32 -> SBUF, cast to the output dtype
            nisa.dma_copy(dst=result[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], src=out)
    return result


def run(m: int = 256, n: int = 1024, k: int = 512, chip: str = "trn2", dtype: torch.dtype = torch.bfloat16,
        seed: int = 0) -> dict:
    """Run :func:`matmul_tiled` once, compare with torch, estimate its time on ``chip``."""
    g = torch.Generator().manual_seed(seed)
    lhsT = torch.randn(k, m, generator=g).to(dtype)
    rhs = torch.randn(k, n, generator=g).to(dtype)
    report = None
    t0 = time.perf_counter()
    if REAL_NKI:  # on Trainium: no trace; the kernel runs on the device
        out = matmul_tiled(lhsT, rhs)
    else:
        from trnkit.nkisim import cost, trace  # noqa: PLC0415 - interpreter only

        with trace.record() as tr:
            out = matmul_tiled(lhsT, rhs)
        report = cost.estimate(tr, chip)
    wall = time.perf_counter() - t0
    ref = (lhsT.float().T @ rhs.float()).to(dtype)
    out_t = torch.as_tensor(out) if not isinstance(out, torch.Tensor) else out
    err = (out_t.float().cpu() - ref.float()).abs().max().item()
    # fp32 accumulation then one bf16 rounding vs torch's fp32 product rounded once: at most 1 bf16 ulp
    tol = 2.0 ** -7 * ref.float().abs().max().item()
    return {
        "shape": {"M": m, "N": n, "K": k}, "dtype": str(dtype).replace("torch.", ""),
        "backend": "nki" if REAL_NKI else "nkisim", "max_abs_err": err, "tol": tol,
        "ok": bool(np.isfinite(err) and err <= tol), "wall_s": wall, "report": report,
    }


def format_result(res: dict) -> str:
    s = res["shape"]
    lines = [
        f"trnkit demo: tiled matmul [{s['M']}x{s['K']}] @ [{s['K']}x{s['N']}] {res['dtype']} "
        f"on {res['backend']} ({res['wall_s']:.2f} s wall)",
        f"check vs torch: max |err| = {res['max_abs_err']:.3g} (tolerance {res['tol']:.3g}) -> "
        f"{'OK' if res['ok'] else 'MISMATCH'}",
    ]
    if res["report"] is not None:
        lines.append(str(res["report"]))
    return "\n".join(lines)
