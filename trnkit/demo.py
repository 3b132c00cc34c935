"""``python -m trnkit demo``: one NKI kernel on the active backend, checked against torch, with its
estimated trn2 time per engine (``--kernel rope_hf`` runs the project's RoPE kernel instead).

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


def _run_traced(fn, chip: str):
    """Call ``fn`` (recording its trace on the interpreter); returns (output, CostReport or None, wall s)."""
    t0 = time.perf_counter()
    if REAL_NKI:  # on Trainium: no trace; the kernel runs on the device
        return fn(), None, time.perf_counter() - t0
    from trnkit.nkisim import cost, trace  # interpreter only

    with trace.record() as tr:
        out = fn()
    return out, cost.estimate(tr, chip), time.perf_counter() - t0


def _as_torch(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def run(m: int = 256, n: int = 1024, k: int = 512, chip: str = "trn2", dtype: torch.dtype = torch.bfloat16,
        seed: int = 0) -> dict:
    """Run :func:`matmul_tiled` once, compare with torch, estimate its time on ``chip``."""
    g = torch.Generator().manual_seed(seed)
    lhsT = torch.randn(k, m, generator=g).to(dtype)
    rhs = torch.randn(k, n, generator=g).to(dtype)
    out, report, wall = _run_traced(lambda: matmul_tiled(lhsT, rhs), chip)
    ref = (lhsT.float().T @ rhs.float()).to(dtype)
    err = (_as_torch(out).float().cpu() - ref.float()).abs().max().item()
    # fp32 accumulation then one bf16 rounding vs torch's fp32 product rounded once: at most 1 bf16 ulp
    tol = 2.0 ** -7 * ref.float().abs().max().item()
    return {
        "title": f"tiled matmul [{m}x{k}] @ [{k}x{n}]", "dtype": str(dtype).replace("torch.", ""),
        "backend": "nki" if REAL_NKI else "nkisim", "max_abs_err": err, "tol": tol,
        "ok": bool(np.isfinite(err) and err <= tol), "wall_s": wall, "report": report,
    }


def run_rope(seq: int = 256, heads: int = 8, kv_heads: int = 2, head_dim: int = 128, chip: str = "trn2",
             seed: int = 0) -> dict:
    """Run the project's ``rope_hf`` kernel once (bf16, [1, H, S, D]), compare with ``rope_hf_ref``."""
    from trnkit.kernels import rope as mod
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq, head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(1, kv_heads, seq, head_dim, generator=g).to(torch.bfloat16)
    inv = 1e6 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.arange(seq, dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos().to(q.dtype), torch.cat([ang, ang], -1).sin().to(q.dtype)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    out, report, wall = _run_traced(lambda: mod.rope_hf(q, k, q_out, k_out, cos=cos, sin=sin), chip)
    rq, rk = mod.rope_hf_ref(q, k, torch.empty_like(q), torch.empty_like(k), cos=cos, sin=sin)
    errs, ok = [], True
    for got, ref in zip(out, (rq, rk)):
        got, ref = _as_torch(got).float(), ref.float()
        errs.append((got - ref).abs().max().item())
        ok &= bool(torch.all((got - ref).abs() <= 1e-3 + 2.0 ** -7 * ref.abs()))  # tests/tolerances.py bf16
    return {
        "title": f"rope_hf q [1, {heads}, {seq}, {head_dim}], k [1, {kv_heads}, {seq}, {head_dim}]",
        "dtype": "bfloat16", "backend": "nki" if REAL_NKI else "nkisim", "max_abs_err": max(errs),
        "tol": "1e-3 + 2^-7 |ref| per element", "ok": ok, "wall_s": wall, "report": report,
    }


def format_result(res: dict) -> str:
    tol = res["tol"] if isinstance(res["tol"], str) else f"{res['tol']:.3g}"
    lines = [
        f"trnkit demo: {res['title']} {res['dtype']} on {res['backend']} ({res['wall_s']:.2f} s wall)",
        f"check vs torch: max |err| = {res['max_abs_err']:.3g} (tolerance {tol}) -> "
        f"{'OK' if res['ok'] else 'MISMATCH'}",
    ]
    if res["report"] is not None:
        lines.append(str(res["report"]))
    return "\n".join(lines)
