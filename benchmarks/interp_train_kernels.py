"""Interpreter time per kernel call at the debug-moe training shapes (the main job's kernels).

    python benchmarks/interp_train_kernels.py [--reps 5] [--only moe] [--profile DIR]

Shapes of ``configs/debug_moe_nki.toml`` (qwen3:debug-moe, 2 x 128 tokens): RoPE q [2, 128, 4, 64] /
k [2, 128, 2, 64] with a packed rope cache, router x [256, 256] -> 8 experts top-2, MoE experts H=256,
I=128, fp32. Prints best-of-``reps`` CPU and wall time per call and the instruction count (from one
traced call). The machine is shared: compare variants side by side (e.g. an older ``trnkit/nkisim``
copy first on ``PYTHONPATH``), read CPU time first. ``TRNKIT_NKISIM_BLAS_THREADS=0`` turns off the
per-launch single-threaded BLAS switch (trnkit/nkisim/blas.py) to see what it buys.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import time

import torch

from trnkit.nkisim import trace


def cases() -> dict:
    rope, router, moe = (importlib.import_module(f"trnkit.kernels.{n}") for n in ("rope", "router", "moe"))
    torch.manual_seed(0)
    B, S, Hq, Hk, D = 2, 128, 4, 2, 64
    T, H, E, K, I = B * S, 256, 8, 2, 128  # noqa: E741
    q, k = torch.randn(B, S, Hq, D), torch.randn(B, S, Hk, D)
    cache = torch.randn(S, 2 * D)
    x = torch.randn(T, H)
    w_router = torch.randn(E, H) * 0.05
    w_gu, w_d = torch.randn(E, H, 2 * I) * 0.05, torch.randn(E, I, H) * 0.05
    tw, ti, logits = router.router_topk(x, w_router, K, True)
    g_w, g_logits, g_out = torch.randn(T, K), torch.randn(T, E), torch.randn(T, H)
    return {
        "rope fwd": lambda: rope.rope_hf_bshd(q, k, torch.empty_like(q), torch.empty_like(k), rope_cache=cache),
        "rope bwd": lambda: rope.rope_hf_bshd(q, k, torch.empty_like(q), torch.empty_like(k), rope_cache=cache,
                                              backward=True),
        "router fwd": lambda: router.router_topk(x, w_router, K, True),
        "router bwd": lambda: router.router_topk_bwd(x, w_router, logits, ti, g_w, g_logits, norm_topk_prob=True),
        "moe fwd": lambda: moe.moe_experts(x, ti, tw, w_gu, w_d),
        "moe bwd": lambda: moe.moe_experts_bwd(x, ti, tw, w_gu, w_d, g_out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=[], help="substrings of case names to run")
    ap.add_argument("--profile", default=None, help="write a CPU-time cProfile per case into this folder")
    args = ap.parse_args()
    for name, fn in cases().items():
        if args.only and not any(o in name for o in args.only):
            continue
        fn()  # warm-up (imports, caches)
        with trace.record() as tr:
            fn()
        prof = cProfile.Profile(time.process_time) if args.profile else None
        walls, cpus = [], []
        for _ in range(args.reps):
            if prof:
                prof.enable()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
            if prof:
                prof.disable()
        if prof:
            os.makedirs(args.profile, exist_ok=True)
            prof.dump_stats(os.path.join(args.profile, name.replace(" ", "_") + ".prof"))
        cpu, wall = min(cpus), min(walls)
        print(f"{name:11s} {len(tr):5d} instr  cpu {cpu * 1e3:7.1f} ms  wall {wall * 1e3:7.1f} ms  "
              f"({cpu / max(len(tr), 1) * 1e6:.0f} us/instr cpu)", flush=True)


if __name__ == "__main__":
    main()
