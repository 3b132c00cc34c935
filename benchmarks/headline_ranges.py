"""Headline kernel figures as ranges, with a sensitivity table per kernel (trn2 cost model, estimates).

``python benchmarks/headline_ranges.py [CASE ...]`` traces each case once on the interpreter (trace-only),
then estimates it under the low / mid / high parameter settings of ``trnkit.nkisim.cost_params`` and
with each parameter alone at its optimistic / pessimistic value. Writes ``headline_ranges.json``
(merged case by case), ``headline_ranges.csv`` (one row per case) and ``headline_ranges.md`` to
``outputs/bench/`` (``benchmarks/data/`` with ``--save-reference``, see ``trnkit.bench.paths``). Cases: rope_fwd, rope_bwd
(q [1,32,4096,128] + k [1,8,4096,128] bf16, packed fp32 cache), router (T=8192, H=2048, E=128, K=8
bf16), moe_fwd, moe_bwd (Qwen3-30B-A3B experts, T=8192, bf16). Bounds: HBM bytes / per-core bandwidth
for rope and router; useful FLOPs / 79 TFLOPS for MoE (forward 6·T·K·H·I, backward 12·T·K·H·I = 2x
forward; the backward's recompute of gate/up, 4·T·K·H·I, is reported separately, not counted as useful).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trnkit.bench.paths import add_output_args, output_dir
from trnkit.nkisim import cost, hardware, trace

ROOT = Path(__file__).resolve().parents[1]
CSV_FIELDS = ("case", "kernel", "mode", "shape", "bound_kind", "bound_us", "low_us", "mid_us", "high_us",
              "fraction_low_end", "fraction_mid", "fraction_high_end", "top_sensitivity", "assumptions")
ASSUMPTIONS = ("trn2 cost model, one NeuronCore; low/mid/high = optimistic/mid/pessimistic settings of "
               "trnkit.nkisim.cost_params (DMA transpose rate, DMA efficiency knee, DMA in flight, GpSimd rate, "
               "software-DGE cost, PSUM single pass, dependent-instruction overhead, matmul overhead, compiler CSE)")
TRN2 = hardware.TRN2
MOE = dict(T=8192, H=2048, I=768, E=128, K=8)  # Qwen3-30B-A3B experts


def _rope(backward: bool) -> Callable[[], object]:
    from trnkit.kernels.rope_hf import rope_hf  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 4096, 128, generator=g).bfloat16()
    k = torch.randn(1, 8, 4096, 128, generator=g).bfloat16()
    pos = torch.arange(4096, dtype=torch.float32)[:, None]
    ang = pos * 1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    ang = torch.cat([ang, ang], -1)
    cache = torch.cat([ang.cos(), ang.sin()], -1)  # [S, 2D] fp32
    return lambda: rope_hf(q, k, torch.empty_like(q), torch.empty_like(k), rope_cache=cache, backward=backward)


def _router() -> Callable[[], object]:
    from trnkit.kernels.router_topk import router_topk  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 2048, generator=g).bfloat16()
    w = (torch.randn(128, 2048, generator=g) * 2048 ** -0.5).bfloat16()
    return lambda: router_topk(x, w, 8, True)


def _moe(backward: bool) -> Callable[[], object]:
    from trnkit.kernels import moe  # noqa: PLC0415

    T, H, I, E, K = (MOE[k] for k in "THIEK")  # noqa: E741
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16()
    tw, idx = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, -1)
    wgu = (torch.randn(E, H, 2 * I, generator=g) * H ** -0.5).bfloat16()
    wd = (torch.randn(E, I, H, generator=g) * I ** -0.5).bfloat16()
    if not backward:
        return lambda: moe.moe_experts(x, idx, tw, wgu, wd)
    go = torch.randn(T, H, generator=g).bfloat16()
    return lambda: moe.moe_experts_bwd(x, idx, tw, wgu, wd, go)


def _moe_flops(mult: int) -> int:
    return mult * MOE["T"] * MOE["K"] * MOE["H"] * MOE["I"]


# case -> (kernel, mode, shape) for the CSV
META = {"rope_fwd": ("rope_hf", "forward", "q [1,32,4096,128] + k [1,8,4096,128] bf16, fp32 cache"),
        "rope_bwd": ("rope_hf", "backward", "q [1,32,4096,128] + k [1,8,4096,128] bf16, fp32 cache"),
        "router": ("router_topk", "forward", "T=8192 H=2048 E=128 K=8 bf16"),
        "moe_fwd": ("moe_experts", "forward", "Qwen3-30B-A3B T=8192 H=2048 I=768 E=128 K=8 bf16"),
        "moe_bwd": ("moe_experts", "backward", "Qwen3-30B-A3B T=8192 H=2048 I=768 E=128 K=8 bf16")}

CASES: dict[str, tuple[str, Callable[[], Callable[[], object]], str]] = {
    "rope_fwd": ("rope_hf fwd q [1,32,4096,128] + k [1,8,4096,128] bf16, fp32 cache", lambda: _rope(False), "hbm"),
    "rope_bwd": ("rope_hf bwd, same shapes", lambda: _rope(True), "hbm"),
    "router": ("router_topk T=8192 H=2048 E=128 K=8 bf16", _router, "hbm"),
    "moe_fwd": ("moe_experts fwd, Qwen3-30B-A3B T=8192 bf16", lambda: _moe(False), "useful_flops:6"),
    "moe_bwd": ("moe_experts_bwd, Qwen3-30B-A3B T=8192 bf16", lambda: _moe(True), "useful_flops:12"),
}


def run_case(name: str) -> dict:
    title, build, bound_kind = CASES[name]
    fn = build()
    t0 = time.perf_counter()
    with trace.record(trace_only=True) as tr:
        fn()
    rep = cost.estimate(tr, "trn2")
    if bound_kind == "hbm":
        bound, bound_name = rep.memory_bound_ns, "HBM bytes / 362.5 GB/s"
    else:
        flops = _moe_flops(int(bound_kind.split(":")[1]))
        bound, bound_name = flops / TRN2.tensor_flops_per_ns_bf16, f"useful {flops / 1e12:.3f} TFLOP / 78.6 TFLOPS"
    low, mid, high = rep.total_range_ns
    sens = cost.sensitivity(tr, "trn2")
    out = {"title": title, "bound": bound_name, "bound_us": bound / 1e3,
           "time_us": {"low": low / 1e3, "mid": mid / 1e3, "high": high / 1e3},
           "fraction": {"low_end": bound / high, "mid": bound / mid, "high_end": bound / low},
           "busy_us": {e: b / 1e3 for e, b in rep.busy_ns.items()},
           "sensitivity_us": {k: [lo / 1e3, hi / 1e3] for k, (lo, hi) in sens.items()},
           "seconds": round(time.perf_counter() - t0, 1)}
    if name == "moe_bwd":
        out["recompute_flops"] = _moe_flops(4)
        out["recompute_us_at_peak"] = _moe_flops(4) / TRN2.tensor_flops_per_ns_bf16 / 1e3
    return out


def markdown(results: dict) -> str:
    lines = ["| case | bound | time low / mid / high (us) | of bound at low end / mid / high end | "
             "most sensitive parameters (us at optimistic..pessimistic) |", "|---|---|---|---|---|"]
    for name in CASES:
        r = results.get(name)
        if r is None:
            continue
        t, f = r["time_us"], r["fraction"]
        top = [f"{k} {lo:,.0f}..{hi:,.0f}" for k, (lo, hi) in list(r["sensitivity_us"].items())[:3]]
        lines.append(f"| {r['title']} | {r['bound_us']:,.1f} us ({r['bound']}) | {t['low']:,.1f} / {t['mid']:,.1f} / "
                     f"{t['high']:,.1f} | {f['low_end']:.1%} / {f['mid']:.1%} / {f['high_end']:.1%} | "
                     f"{'; '.join(top)} |")
    if "moe_bwd" in results:
        r = results["moe_bwd"]
        lines.append(f"\nmoe_experts_bwd also recomputes gate/up ({r['recompute_flops'] / 1e12:.3f} TFLOP, "
                     f"{r['recompute_us_at_peak']:,.0f} us at TensorE peak), not counted as useful work.")
    return "\n".join(lines) + "\n"


def csv_rows(results: dict) -> list[dict]:
    rows = []
    for name in CASES:
        r = results.get(name)
        if r is None:
            continue
        kernel, mode, shape = META[name]
        t, f = r["time_us"], r["fraction"]
        top = "; ".join(f"{k} {lo:.1f}..{hi:.1f}" for k, (lo, hi) in list(r["sensitivity_us"].items())[:3])
        rows.append({"case": name, "kernel": kernel, "mode": mode, "shape": shape, "bound_kind": r["bound"],
                     "bound_us": round(r["bound_us"], 2), "low_us": round(t["low"], 2), "mid_us": round(t["mid"], 2),
                     "high_us": round(t["high"], 2), "fraction_low_end": round(f["low_end"], 4),
                     "fraction_mid": round(f["mid"], 4), "fraction_high_end": round(f["high_end"], 4),
                     "top_sensitivity": top, "assumptions": ASSUMPTIONS})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    add_output_args(ap, "headline_ranges.{json,csv,md}")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    out = output_dir(args, ROOT)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "headline_ranges.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for name in args.cases or list(CASES):
        results[name] = run_case(name)
        path.write_text(json.dumps(results, indent=1))
        print(name, json.dumps(results[name]["time_us"]), json.dumps(results[name]["fraction"]), flush=True)
    md = markdown(results)
    (out / "headline_ranges.md").write_text(md)
    with (out / "headline_ranges.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(csv_rows(results))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
