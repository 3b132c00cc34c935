"""The kernels' headline cost-model figures, as ranges (README, docs/kernels.md, docs/benchmarks.md).

    python benchmarks/headline.py --list                      # the cases and groups
    python benchmarks/headline.py rope router_bwd             # some cases (or groups: rope, router, moe, all)
    python benchmarks/headline.py router --save-reference     # into benchmarks/data + regenerate the docs tables

Each case builds the inputs its docs state (e.g. rope: q [1,32,4096,128] + k [1,8,4096,128] bf16 with the
packed fp32 cache [4096, 256]), runs the kernel once on the interpreter in trace-only mode and estimates
the trace under the low / mid / high settings of ``trnkit.nkisim.cost_params`` (optimistic / mid /
pessimistic values of the model's uncertain parameters; low / high are the smallest / largest of the three
totals, as a list schedule is not monotone in its parameters). The headline cases (``HEADLINE``) also get a
sensitivity table: each parameter alone at its optimistic and pessimistic value, the rest at mid.

Bounds: HBM bytes / per-core HBM bandwidth for rope and router (per core for LNC=2); useful FLOPs at
TensorE's bf16 peak for MoE (forward 6·T·K·H·I, backward 12·T·K·H·I = 2x forward; the backward's
recompute of gate/up, 4·T·K·H·I, is reported separately, not counted as useful). The fraction of the
bound "at the low end" is the one at the pessimistic end of the range.

Outputs (merged case by case with what the folder already holds): ``headline.json`` (everything),
``headline.csv`` (one row per case) and ``headline_sensitivity.csv`` (one row per headline case and
parameter), in ``outputs/bench/`` or, with ``--save-reference``, in ``benchmarks/data/``; then
``scripts/docs_tables.py`` rewrites the docs' generated tables from them.
All figures are estimates of trnkit's cost model (docs/cost-model.md), not measurements.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trnkit.bench import fingerprint
from trnkit.bench.cases import kernel_sources
from trnkit.bench.harness import estimate_range
from trnkit.bench.paths import REFERENCE_DIR, add_output_args, load_script, output_dir
from trnkit.nkisim import cost, hardware, trace
from trnkit.nkisim.cost_params import HIGH, LOW, MID

ROOT = Path(__file__).resolve().parents[1]
TRN2 = hardware.TRN2
BF16 = torch.bfloat16
MOE = dict(T=8192, H=2048, I=768, E=128, K=8)  # Qwen3-30B-A3B experts
ROPE_SHAPE = "q [1,32,4096,128] + k [1,8,4096,128]"
ROUTER_SHAPE = "T=8192 H=2048 E=128 K=8"
MOE_SHAPE = "Qwen3-30B-A3B T=8192 H=2048 I=768 E=128 K=8"
MODEL = ("trn2 cost model on the interpreter's trace-only instruction trace (list schedule), one NeuronCore "
         "per program; low / mid / high = every uncertain parameter of trnkit.nkisim.cost_params at its "
         "optimistic / mid / pessimistic value")
CSV_FIELDS = ("case", "kernel", "mode", "shape", "bound_kind", "bound_us", "low_us", "mid_us", "high_us",
              "fraction_low_end", "fraction_mid", "fraction_high_end", "busiest_mid_us", "top_sensitivity",
              "assumptions", "timestamp", *fingerprint.FIELDS)
SENS_FIELDS = ("case", "parameter", "optimistic_value", "mid_value", "pessimistic_value", "optimistic_us",
               "pessimistic_us", *fingerprint.FIELDS)  # a sensitivity row carries its case's fingerprint


@dataclass(frozen=True)
class HeadlineCase:
    kernel: str
    mode: str  # "forward" | "backward"
    shape: str  # the shape as the docs state it
    build: Callable[[], Callable[[], object]]  # returns the kernel call on ready inputs
    useful_flops: int = 0  # > 0: the bound is these FLOPs at TensorE's bf16 peak; 0: the HBM bound
    notes: str = ""  # assumptions beyond MODEL (routing, layout, ...)
    extra_sources: tuple[str, ...] = ()  # what the call runs besides the kernel's family (trnkit.bench.fingerprint)

    @property
    def sources(self) -> tuple[str, ...]:
        return (*kernel_sources(self.kernel), *self.extra_sources)

    @property
    def bound_kind(self) -> str:
        if self.useful_flops:
            return (f"useful {self.useful_flops / 1e12:.3f} TFLOP / "
                    f"{TRN2.tensor_flops_per_ns_bf16 / 1e3:.1f} TFLOPS")
        return f"HBM bytes / {TRN2.hbm_bytes_per_ns:.1f} GB/s"


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _rope(Hk: int = 8, dtype: torch.dtype = BF16, bshd: bool = False, backward: bool = False,
          lnc: int = 1) -> Callable[[], Callable[[], object]]:
    def build() -> Callable[[], object]:
        from trnkit.kernels import rope as mod
        from trnkit.kernels.rope.rope_kernel import rope_hf_kernel
        B, Hq, S, D = 1, 32, 4096, 128
        g = _g()
        qs, ks = ((B, S, Hq, D), (B, S, Hk, D)) if bshd else ((B, Hq, S, D), (B, Hk, S, D))
        q, k = torch.randn(qs, generator=g).to(dtype), torch.randn(ks, generator=g).to(dtype)
        ang = torch.arange(S, dtype=torch.float32)[:, None] * 1e6 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        ang = torch.cat([ang, ang], -1)
        cache = torch.cat([ang.cos(), ang.sin()], -1)  # packed fp32 [S, 2D] = cos | sin
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        if lnc > 1:
            return lambda: rope_hf_kernel[lnc](q, k, q_out, k_out, cache, cache, packed=True, backward=backward,
                                               bshd=bshd)
        fn = mod.rope_hf_bshd if bshd else mod.rope_hf
        return lambda: fn(q, k, q_out, k_out, rope_cache=cache, backward=backward)
    return build


def _router(dtype: torch.dtype = BF16, norm: bool = True, affinities: bool = False, backward: bool = False,
            lnc: int = 1) -> Callable[[], Callable[[], object]]:
    def build() -> Callable[[], object]:
        from trnkit.kernels import router as mod
        from trnkit.kernels.router.router_fwd import router_topk_kernel
        T, H, E, K = 8192, 2048, 128, 8
        g = _g()
        x, w = torch.randn(T, H, generator=g).to(dtype), (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype)
        if backward:
            weights, idx, logits = mod.router_topk(x, w, K, norm)
            gw = torch.randn(T, K, generator=g)
            return lambda: mod.router_topk_bwd(x, w, logits, idx, gw, None, norm, lnc=lnc)
        if lnc > 1:
            return lambda: router_topk_kernel[lnc](x, w, K, norm, affinities)
        return lambda: mod.router_topk(x, w, K, norm, return_affinities=affinities)
    return build


def _moe_inputs() -> tuple[torch.Tensor, ...]:
    T, H, I, E, K = (MOE[k] for k in "THIEK")  # noqa: E741
    g = _g()
    x = torch.randn(T, H, generator=g).to(BF16)
    tw, idx = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, -1)
    tw, idx = (tw / tw.sum(-1, keepdim=True)).float(), idx.to(torch.int32)
    wgu = (torch.randn(E, H, 2 * I, generator=g) * H ** -0.5).to(BF16)
    wd = (torch.randn(E, I, H, generator=g) * I ** -0.5).to(BF16)
    return x, idx, tw, wgu, wd


def _moe(backward: bool = False, block_size: int | None = None) -> Callable[[], Callable[[], object]]:
    """The kernel called directly, at its default (tuned) block sizes unless ``block_size`` is given."""
    def build() -> Callable[[], object]:
        from trnkit.kernels import moe

        x, idx, tw, wgu, wd = _moe_inputs()
        sized = {} if block_size is None else {"block_size": block_size}
        if not backward:
            return lambda: moe.moe_experts(x, idx, tw, wgu, wd, **sized)
        go = torch.randn(MOE["T"], MOE["H"], generator=_g()).to(BF16)
        return lambda: moe.moe_experts_bwd(x, idx, tw, wgu, wd, go, **sized)
    return build


def _moe_training_path() -> Callable[[], object]:
    """The forward as training runs it: the native model's experts module with the kernel choice of the
    trainer's default ``[overrides]`` (block_size 0: the kernel's tuned sizes), through trnkit::moe_experts."""
    from trnkit.overrides import OverrideConfig, bind_kernels
    from trnkit.qwen3.model import GroupedExperts

    x, idx, tw, wgu, wd = _moe_inputs()
    with torch.device("meta"):
        experts = GroupedExperts(MOE["H"], MOE["I"], MOE["E"])
    experts.w_gate_up, experts.w_down = torch.nn.Parameter(wgu), torch.nn.Parameter(wd)
    bind_kernels(experts, OverrideConfig(ops=["moe_experts"], impl="nki").kernels())

    def call() -> object:
        with torch.no_grad():
            return experts(x, idx, tw)
    return call


def moe_flops(mult: int) -> int:
    """``mult``·T·K·H·I at the Qwen3-30B-A3B expert shapes (6: forward, 12: backward, 4: gate/up recompute)."""
    return mult * MOE["T"] * MOE["K"] * MOE["H"] * MOE["I"]


ROPE_NOTES = "packed fp32 cache [4096, 256], fp32 math"
MOE_ROUTING = "routing: top-8 of a softmax over random logits (near-uniform, ~512 slots per expert)"
MOE_NOTES = MOE_ROUTING + ", the kernels' default block sizes (forward 512, backward 128)"
CASES: dict[str, HeadlineCase] = {
    "rope_fwd": HeadlineCase("rope_hf", "forward", f"{ROPE_SHAPE} bf16", _rope(), notes=ROPE_NOTES),
    "rope_bwd": HeadlineCase("rope_hf", "backward", f"{ROPE_SHAPE} bf16", _rope(backward=True), notes=ROPE_NOTES),
    "rope_bshd_fwd": HeadlineCase("rope_hf", "forward", f"{ROPE_SHAPE} bf16, rope_hf_bshd ([B,S,H,D])",
                                  _rope(bshd=True), notes=ROPE_NOTES),
    "rope_hk32_fwd": HeadlineCase("rope_hf", "forward", "q, k [1,32,4096,128] bf16", _rope(Hk=32), notes=ROPE_NOTES),
    "rope_fp32_fwd": HeadlineCase("rope_hf", "forward", f"{ROPE_SHAPE} fp32", _rope(dtype=torch.float32),
                                  notes=ROPE_NOTES),
    "rope_lnc2_fwd": HeadlineCase("rope_hf", "forward", f"{ROPE_SHAPE} bf16, LNC=2 (rope_hf_kernel[2])",
                                  _rope(lnc=2), notes=ROPE_NOTES + "; bound per core"),
    "router_fwd": HeadlineCase("router_topk", "forward", f"{ROUTER_SHAPE} bf16", _router()),
    "router_nonorm_fwd": HeadlineCase("router_topk", "forward", f"{ROUTER_SHAPE} bf16, norm_topk_prob=False",
                                      _router(norm=False)),
    "router_lnc2_fwd": HeadlineCase("router_topk", "forward", f"{ROUTER_SHAPE} bf16, LNC=2 (router_topk_kernel[2])",
                                    _router(lnc=2), notes="bound per core"),
    "router_aff_fwd": HeadlineCase("router_topk", "forward", f"{ROUTER_SHAPE} bf16, return_affinities=True",
                                   _router(affinities=True)),
    "router_bwd": HeadlineCase("router_topk", "backward", f"{ROUTER_SHAPE} bf16", _router(backward=True)),
    "router_lnc2_bwd": HeadlineCase("router_topk", "backward", f"{ROUTER_SHAPE} bf16, LNC=2 (router_topk_bwd(lnc=2))",
                                    _router(backward=True, lnc=2), notes="bound per core"),
    "router_fp32_bwd": HeadlineCase("router_topk", "backward", f"{ROUTER_SHAPE} fp32",
                                    _router(dtype=torch.float32, backward=True)),
    "moe_fwd": HeadlineCase("moe_experts", "forward", f"{MOE_SHAPE} bf16", _moe(), moe_flops(6), MOE_NOTES),
    "moe_bwd": HeadlineCase("moe_experts", "backward", f"{MOE_SHAPE} bf16", _moe(backward=True), moe_flops(12),
                            MOE_NOTES + "; useful FLOPs = 2x forward, gate/up recompute not counted"),
    "moe_train_fwd": HeadlineCase("moe_experts", "forward", f"{MOE_SHAPE} bf16, the training path",
                                  _moe_training_path, moe_flops(6),
                                  "the native GroupedExperts with the trainer's default [overrides] choice "
                                  "(impl nki, block_size 0 = the tuned sizes) through trnkit::moe_experts; "
                                  + MOE_ROUTING, ("trnkit/overrides",)),
    "moe_b128_fwd": HeadlineCase("moe_experts", "forward", f"{MOE_SHAPE} bf16, block_size=128",
                                 _moe(block_size=128), moe_flops(6),
                                 "block_size 128 (what the override path passed before its default became the "
                                 "tuned sizes); " + MOE_ROUTING),
}
HEADLINE = ("rope_fwd", "rope_bwd", "router_fwd", "moe_fwd", "moe_bwd")  # README figures: + sensitivity
GROUPS = {"rope": [c for c in CASES if c.startswith("rope_")], "router": [c for c in CASES if c.startswith("router_")],
          "moe": ["moe_fwd", "moe_bwd"], "headline": list(HEADLINE), "all": list(CASES)}


def assumptions(name: str) -> str:
    case = CASES[name]
    return f"{MODEL}; bound: {case.bound_kind}" + (f"; {case.notes}" if case.notes else "")


def run_case(name: str, sensitivity: bool | None = None) -> dict:
    """Trace case ``name`` once and estimate it; ``sensitivity`` (default: for the HEADLINE cases) adds the
    one-parameter-at-a-time totals."""
    case = CASES[name]
    call = case.build()
    t0 = time.perf_counter()
    with trace.record(trace_only=True) as tr:
        call()
    rep = cost.estimate(tr, "trn2")
    bound = case.useful_flops / TRN2.tensor_flops_per_ns_bf16 if case.useful_flops else rep.memory_bound_ns
    low, mid, high = estimate_range(rep.total_range_ns)
    settings = dict(zip(("optimistic", "mid", "pessimistic"), rep.total_range_ns))
    notes = assumptions(name)
    if (settings["optimistic"], settings["pessimistic"]) != (low, high):
        notes += ("; not monotone in the parameters: " + ", ".join(f"{k} setting {t / 1e3:,.1f} us" for k, t in
                  settings.items()) + ", so the range is the smallest to the largest of the three")
    out = {"kernel": case.kernel, "mode": case.mode, "shape": case.shape, "bound": case.bound_kind,
           "bound_us": bound / 1e3, "time_us": {"low": low / 1e3, "mid": mid / 1e3, "high": high / 1e3},
           "fraction": {"low_end": bound / high, "mid": bound / mid, "high_end": bound / low},
           "busy_us": {e: b / 1e3 for e, b in sorted(rep.busy_ns.items(), key=lambda kv: -kv[1])},
           "setting_us": {k: t / 1e3 for k, t in settings.items()},
           "n_instrs": rep.n_instrs, "n_programs": rep.n_programs, "assumptions": notes}
    if sensitivity or (sensitivity is None and name in HEADLINE):
        out["sensitivity_us"] = {k: [lo / 1e3, hi / 1e3] for k, (lo, hi) in cost.sensitivity(tr, "trn2").items()}
        # the parameter values of this run (cost_params may change before the next one)
        out["parameter_values"] = {k: [getattr(setting, k) for setting in (LOW, MID, HIGH)]
                                   for k in out["sensitivity_us"]}
    if case.kernel == "moe_experts" and case.mode == "backward":
        out["recompute_flops"] = moe_flops(4)
        out["recompute_us_at_peak"] = moe_flops(4) / TRN2.tensor_flops_per_ns_bf16 / 1e3
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["timestamp"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    out.update(fingerprint.stamp(case.sources))
    return out


def _top(r: dict, n: int = 3, fmt: str = "{:.1f}") -> str:
    sens = list(r.get("sensitivity_us", {}).items())[:n]
    return "; ".join(f"{k} {fmt.format(lo)}..{fmt.format(hi)}" for k, (lo, hi) in sens)


def csv_rows(results: dict) -> list[dict]:
    rows = []
    for name in CASES:
        r = results.get(name)
        if r is None:
            continue
        t, f = r["time_us"], r["fraction"]
        busiest = "; ".join(f"{e} {b:,.1f}" for e, b in list(r["busy_us"].items())[:3])
        rows.append({"case": name, "kernel": r["kernel"], "mode": r["mode"], "shape": r["shape"],
                     "bound_kind": r["bound"], "bound_us": round(r["bound_us"], 2), "low_us": round(t["low"], 2),
                     "mid_us": round(t["mid"], 2), "high_us": round(t["high"], 2),
                     "fraction_low_end": round(f["low_end"], 4), "fraction_mid": round(f["mid"], 4),
                     "fraction_high_end": round(f["high_end"], 4), "busiest_mid_us": busiest,
                     "top_sensitivity": _top(r), "assumptions": r["assumptions"], "timestamp": r["timestamp"],
                     **{k: r.get(k, "") for k in fingerprint.FIELDS}})
    return rows


def sensitivity_rows(results: dict) -> list[dict]:
    rows = []
    for name in CASES:
        r = results.get(name, {})
        for param, (lo, hi) in r.get("sensitivity_us", {}).items():
            # a case saved under an earlier model may name a parameter the model no longer has
            values = r.get("parameter_values", {}).get(param, [getattr(s, param, "") for s in (LOW, MID, HIGH)])
            rows.append({"case": name, "parameter": param, "optimistic_value": values[0], "mid_value": values[1],
                         "pessimistic_value": values[2], "optimistic_us": round(lo, 2), "pessimistic_us": round(hi, 2),
                         **{k: r.get(k, "") for k in fingerprint.FIELDS}})
    return rows


def _write_csv(path: Path, field_names: tuple[str, ...], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=field_names, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def write_outputs(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "headline.json").write_text(json.dumps(results, indent=1) + "\n")
    _write_csv(out / "headline.csv", CSV_FIELDS, csv_rows(results))
    _write_csv(out / "headline_sensitivity.csv", SENS_FIELDS, sensitivity_rows(results))


def resolve(names: list[str]) -> list[str]:
    """Case names from case and group names, in CASES order; unknown names raise ValueError."""
    unknown = [n for n in names if n not in CASES and n not in GROUPS]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}; groups: {', '.join(GROUPS)}")
    wanted = {c for n in names for c in GROUPS.get(n, [n])}
    return [c for c in CASES if c in wanted]


def regenerate_docs() -> int:
    """Rewrite the docs' generated tables from benchmarks/data (scripts/docs_tables.py)."""
    return load_script(ROOT / "scripts" / "docs_tables.py", "docs_tables").main([])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help="case or group names (see --list)")
    ap.add_argument("--list", action="store_true", help="list the cases and groups")
    sens = ap.add_mutually_exclusive_group()
    sens.add_argument("--sensitivity", action="store_true", help="sensitivity table for every case run")
    sens.add_argument("--no-sensitivity", action="store_true", help="no sensitivity table, not even for HEADLINE")
    add_output_args(ap, "headline.{json,csv} and headline_sensitivity.csv")
    args = ap.parse_args(argv)
    if args.list or not args.cases:
        for name, case in CASES.items():
            print(f"{name:18s} {case.kernel} {case.mode}, {case.shape}{' (headline)' if name in HEADLINE else ''}")
        print("groups: " + "; ".join(f"{g} = {' '.join(c)}" for g, c in GROUPS.items()))
        return 0
    try:
        names = resolve(args.cases)
    except ValueError as exc:
        ap.error(str(exc))
    out = output_dir(args, ROOT)
    path = out / "headline.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    with_sens = True if args.sensitivity else False if args.no_sensitivity else None
    for name in names:
        results[name] = run_case(name, with_sens)
        write_outputs(out, results)  # case by case: an interrupted run keeps what it finished
        r = results[name]
        print(f"{name}: {r['time_us']['low']:,.1f} / {r['time_us']['mid']:,.1f} / {r['time_us']['high']:,.1f} us, "
              f"{r['fraction']['low_end']:.1%} / {r['fraction']['mid']:.1%} / {r['fraction']['high_end']:.1%} of "
              f"{r['bound']} ({r['seconds']} s)", flush=True)
    if out.resolve() == (ROOT / REFERENCE_DIR).resolve():
        return regenerate_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
