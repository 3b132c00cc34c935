"""Reproduce the cost-model headline figures of docs/kernels.md, one named recipe per figure.

    python benchmarks/headline.py                 # list the recipes
    python benchmarks/headline.py rope_fwd router_fwd ...   # run some (or: all)

Each recipe builds its inputs exactly as the docs state them (e.g. rope: q [1,32,4096,128] + k [1,8,4096,128]
bf16 with the packed fp32 cache [4096, 256]), runs the kernel once on the interpreter in trace-only mode and
prints the trn2 cost-model estimate, the bound the docs quote (HBM bound, or for moe the useful-FLOP TensorE
bound), the fraction and the busiest engines; results go to benchmarks/data/headline.json. These are
estimates of the cost model (docs/cost-model.md), not measurements.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from trnkit.nkisim import cost, trace

OUT = Path(__file__).with_name("data") / "headline.json"
BF16 = torch.bfloat16
TENSOR_BF16_FLOPS_PER_NS = 79e3  # trn2 TensorE dense bf16, 79 TFLOPS (docs/kernels.md MoE table)


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _rope(Hq: int = 32, Hk: int = 8, dtype: torch.dtype = BF16, bshd: bool = False, backward: bool = False,
          lnc: int = 1) -> Callable[[], object]:
    mod = importlib.import_module("trnkit.kernels.rope_hf")  # (trnkit.kernels.rope_hf is also a function)
    B, S, D = 1, 4096, 128
    g = _g()
    qs, ks = ((B, S, Hq, D), (B, S, Hk, D)) if bshd else ((B, Hq, S, D), (B, Hk, S, D))
    q, k = torch.randn(qs, generator=g).to(dtype), torch.randn(ks, generator=g).to(dtype)
    ang = torch.arange(S, dtype=torch.float32)[:, None] * 1e6 ** (-torch.arange(0, D, 2) / D)
    ang = torch.cat([ang, ang], -1)
    cache = torch.cat([ang.cos(), ang.sin()], -1)  # packed fp32 [S, 2D] = cos | sin
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if lnc > 1:
        return lambda: mod.rope_hf_kernel[lnc](q, k, q_out, k_out, cache, cache, packed=True, backward=backward,
                                               bshd=bshd)
    fn = mod.rope_hf_bshd if bshd else mod.rope_hf
    return lambda: fn(q, k, q_out, k_out, rope_cache=cache, backward=backward)


def _router(T: int = 8192, dtype: torch.dtype = BF16, norm: bool = True, affinities: bool = False,
            backward: bool = False, lnc: int = 1) -> Callable[[], object]:
    mod = importlib.import_module("trnkit.kernels.router_topk")
    rt = mod.router_topk
    H, E, K = 2048, 128, 8
    g = _g()
    x, w = torch.randn(T, H, generator=g).to(dtype), (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype)
    if backward:
        weights, idx, logits = rt(x, w, K, norm)
        gw = torch.randn(T, K, generator=g)
        return lambda: mod.router_topk_bwd(x, w, logits, idx, gw, None, norm)
    if lnc > 1:
        return lambda: mod.router_topk_kernel[lnc](x, w, K, norm, affinities)
    return lambda: rt(x, w, K, norm, return_affinities=affinities)


def _moe(T: int = 8192, backward: bool = False) -> Callable[[], object]:
    from trnkit.kernels import moe  # noqa: PLC0415

    H, inter, E, K = 2048, 768, 128, 8
    g = _g()
    x = torch.randn(T, H, generator=g).to(BF16)
    p = torch.softmax(torch.randn(T, E, generator=g), -1)
    tw, idx = p.topk(K, -1)
    tw, idx = (tw / tw.sum(-1, keepdim=True)).float(), idx.to(torch.int32)
    wgu = (torch.randn(E, H, 2 * inter, generator=g) * H ** -0.5).to(BF16)
    wd = (torch.randn(E, inter, H, generator=g) * inter ** -0.5).to(BF16)
    if backward:
        go = torch.randn(T, H, generator=g).to(BF16)
        return lambda: moe.moe_experts_bwd(x, idx, tw, wgu, wd, go)
    return lambda: moe.moe_experts(x, idx, tw, wgu, wd)


def _moe_bound(T: int, backward: bool) -> float:
    """Useful-FLOP TensorE bound (ns): gate/up and down matmuls of the T*K slots (x3 for the backward)."""
    flops = 6 * T * 8 * 2048 * 768 * (3 if backward else 1)
    return flops / TENSOR_BF16_FLOPS_PER_NS


RECIPES: dict[str, tuple[str, Callable[[], Callable[[], object]], str]] = {
    "rope_fwd": ("rope_hf q [1,32,4096,128] + k [1,8,4096,128] bf16, packed fp32 cache, fwd", _rope, "hbm"),
    "rope_bwd": ("same, backward", lambda: _rope(backward=True), "hbm"),
    "rope_bshd_fwd": ("same, rope_hf_bshd ([B,S,H,D]) fwd", lambda: _rope(bshd=True), "hbm"),
    "rope_hk32_fwd": ("same, q and k both [1,32,4096,128] bf16 fwd", lambda: _rope(Hk=32), "hbm"),
    "rope_fp32_fwd": ("same shapes (Hk=8) fp32 fwd", lambda: _rope(dtype=torch.float32), "hbm"),
    "rope_lnc2_fwd": ("same, LNC=2 (rope_hf_kernel[2]) bf16 fwd", lambda: _rope(lnc=2), "hbm"),
    "router_fwd": ("router_topk T=8192, H=2048, E=128, K=8 bf16", _router, "hbm"),
    "router_nonorm_fwd": ("same, norm_topk_prob=False", lambda: _router(norm=False), "hbm"),
    "router_lnc2_fwd": ("same, LNC=2 (router_topk_kernel[2])", lambda: _router(lnc=2), "hbm"),
    "router_aff_fwd": ("same, return_affinities=True", lambda: _router(affinities=True), "hbm"),
    "router_bwd": ("router_topk_bwd same shapes, bf16", lambda: _router(backward=True), "hbm"),
    "router_fp32_bwd": ("router_topk_bwd fp32", lambda: _router(dtype=torch.float32, backward=True), "hbm"),
    "moe_fwd": ("moe_experts fwd, Qwen3-30B-A3B T=8192 bf16 (TensorE bound)", _moe, "tensor_fwd"),
    "moe_bwd": ("moe_experts_bwd, same shapes (TensorE bound; minutes)", lambda: _moe(backward=True),
                "tensor_bwd"),
}


def run(name: str) -> dict:
    title, build, bound_kind = RECIPES[name]
    call = build()
    t0 = time.perf_counter()
    with trace.record(trace_only=True) as tr:
        call()
    rep = cost.estimate(tr, "trn2")
    if bound_kind == "hbm":
        bound = rep.memory_bound_ns
    else:
        bound = _moe_bound(8192, bound_kind == "tensor_bwd")
    busy = sorted(rep.busy_ns.items(), key=lambda kv: -kv[1])[:4]
    res = {"recipe": name, "case": title, "estimate_us": rep.total_ns / 1e3, "bound_us": bound / 1e3,
           "bound": "HBM" if bound_kind == "hbm" else "TensorE useful FLOPs", "fraction": bound / rep.total_ns,
           "busy_us": {k: round(v / 1e3, 1) for k, v in busy}, "interp_s": round(time.perf_counter() - t0, 1)}
    print(f"{name}: {title}: {res['estimate_us']:.1f} us, {res['bound']} bound {res['bound_us']:.1f} us, "
          f"{100 * res['fraction']:.1f} %, busy {res['busy_us']} ({res['interp_s']} s)", flush=True)
    return res


def main(argv: list[str]) -> int:
    if not argv:
        for name, (title, _, _) in RECIPES.items():
            print(f"{name:18s} {title}")
        return 0
    names = list(RECIPES) if argv == ["all"] else argv
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        print(f"unknown recipe(s) {unknown}; known: {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    for n in names:
        old[n] = run(n)
    OUT.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
