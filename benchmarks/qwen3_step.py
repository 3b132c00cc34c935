"""A full training step on CPU, trnkit's native Qwen3 vs transformers v5, run the way users run each.

One step = zero_grad + forward + causal-LM loss + backward + grad-norm clip (1.0) + AdamW(fused=True).step().
Both sides get the same config, the same weights (trnkit's init, copied into the transformers model),
the same token batch and the same optimizer settings:

- transformers: `model(input_ids, labels=input_ids).loss` (its standard loss path: full logits, `.float()`,
  mean cross-entropy), `attn_implementation="sdpa"`, for MoE each experts backend in `--hf-experts`
  (default `eager` and `grouped_mm`; `batched_mm` was 2x slower in every earlier run) and the ratio uses
  the fastest; `torch.nn.utils.clip_grad_norm_`; `torch.optim.AdamW(fused=True)` (torch's fastest CPU
  AdamW). bf16 = `torch.autocast("cpu", bfloat16)` over fp32 weights, which is what the HF Trainer's
  `bf16=True` does on CPU. No `torch.compile` on either side.
- trnkit: `model(tokens, labels=..., loss_chunk_size=...)` (the chunked linear cross-entropy), the trainer's
  clip (`trnkit.harness.parallel.clip_grad_norm`) and the trainer's CPU AdamW (fused=True); bf16 as the
  trainer runs it (autocast over fp32 weights). On a CPU without native bf16 matmul its linear layers and
  chunked loss multiply the bf16-rounded operands in fp32 (`trnkit.qwen3.precision`); the `setup` column
  says which.

How the figures repeat: one thread (`--threads 1`), process CPU time (other jobs' CPU time does not count, but
they share the caches and memory bandwidth: a memory-bound step, transformers' with its [tokens, V] logits,
takes more CPU time on a loaded machine, docs/benchmarks.md), fixed seeds for weights and tokens, the two
sides interleaved (trnkit, transformers, trnkit, ...) so that slow phases of the machine hit both, the min of
`--repeat` steps for the ratio (median reported too). A side whose first step takes longer than
`--slow-step-s` (transformers' bf16 step on a CPU without native bf16 matmul) is timed by that step alone,
cold, and stepped no more; its row says `reps` "1 cold".
Deterministic algorithms (`torch.use_deterministic_algorithms`) are set the same on both sides:
`--deterministic off` is transformers' default, `on` the trainer's default; the CSV says which.

Step peak memory: for each side a fresh process builds that side alone, runs one step (so AdamW's state
exists), frees the gradients and reports the peak RSS the next step adds (Linux /proc VmHWM).

Writes `<name>.csv` and `.json` (default `qwen3_step`, `qwen3_step_vocab<N>` with `--vocab N`) to `outputs/bench/`,
`--save-reference`: the tracked `benchmarks/data/` that the docs quote; case by case, a case's new rows
replacing its old ones. Run: `python benchmarks/qwen3_step.py [--seqs 512] [--dtypes bfloat16]`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from trnkit.bench.paths import add_output_args, output_dir
from trnkit.harness.parallel import clip_grad_norm
from trnkit.qwen3 import Qwen3Model, model_registry
from trnkit.qwen3.precision import native_matmul
from trnkit.qwen3.state_dict import to_hf

ROOT = Path(__file__).resolve().parent.parent
LR, MAX_NORM = 3e-4, 1.0


def build_native(flavor: str, seed: int = 0, vocab: int | None = None) -> Qwen3Model:
    """trnkit's model of ``flavor`` (``vocab``: another vocabulary size), initialised from ``seed``."""
    torch.manual_seed(seed)
    native = Qwen3Model(model_registry(flavor, **({"vocab_size": vocab} if vocab else {})).config)
    native.init_weights()
    return native.train()


def build_hf(native: Qwen3Model, experts: str | None):
    """A transformers model with ``native``'s weights (``experts``: its experts_implementation, MoE only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = native.config
    kw = {"attn_implementation": "sdpa"} | ({"experts_implementation": experts} if experts else {})
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg.to_hf()), **kw)
    missing, unexpected = hf.load_state_dict(to_hf(native.state_dict(), cfg, fused_experts=True), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf.train()


def tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def step_fn(model, toks: torch.Tensor, is_hf: bool, dtype: str, loss_chunk: int) -> Callable[[], float]:
    """One full training step of ``model`` on ``toks``; returns the loss (mean next-token cross-entropy)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, fused=True)
    labels = torch.roll(toks, -1, 1)
    labels[:, -1] = -100
    n = toks.shape[0] * (toks.shape[1] - 1)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
        with amp:
            if is_hf:
                loss = model(input_ids=toks, labels=toks).loss
            else:
                loss = model(toks, labels=labels, loss_chunk_size=loss_chunk) / n
        loss.backward()
        if is_hf:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        else:
            clip_grad_norm(params, MAX_NORM)
        opt.step()
        return loss.item()
    return step


def _proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def step_peak_mib(side: str, flavor: str, dtype: str, batch: int, seq: int, loss_chunk: int,
                  vocab: int | None = None) -> float:
    """In this (fresh) process: build one side, run a step, then the peak RSS the next step adds, MiB."""
    native = build_native(flavor, vocab=vocab)
    vocab, is_hf = native.config.vocab_size, side != "trnkit"
    if is_hf:
        experts = side.removeprefix("transformers[").rstrip("]")
        model = build_hf(native, experts if native.config.is_moe else None)
        del native  # its weights are not part of this side's footprint
    else:
        model = native
    fn = step_fn(model, tokens(batch, seq, vocab), is_hf, dtype, loss_chunk)
    fn()
    model.zero_grad(set_to_none=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _proc_status_mib("VmRSS")
    fn()
    return _proc_status_mib("VmHWM") - base


def fresh_process_peak(side: str, flavor: str, dtype: str, seq: int, args: argparse.Namespace) -> float:
    cmd = [sys.executable, __file__, "--peak-of", side, "--flavors", flavor, "--dtypes", dtype, "--batch",
           str(args.batch), "--seqs", str(seq), "--loss-chunk", str(args.loss_chunk),
           "--threads", str(args.threads), "--deterministic", args.deterministic]
    cmd += ["--vocab", str(args.vocab)] if args.vocab else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def setup(side: str, dtype: str, loss_chunk: int) -> str:
    """How ``side`` runs its step (the CSV's ``setup`` column)."""
    amp = "autocast bf16" if dtype == "bfloat16" else "fp32"
    if side == "trnkit":
        loss = f"chunked loss {loss_chunk}" if loss_chunk else "full logits"
        return f"{amp}; {loss}; bf16 linears in {matmul_dtype_name()}" if dtype == "bfloat16" else f"{amp}; {loss}"
    experts = side.removeprefix("transformers[").rstrip("]")
    return f"{amp}; labels=; sdpa" + ("" if experts == "default" else f"; experts {experts}")


def matmul_dtype_name() -> str:
    """Where a bf16 autocast matmul of trnkit's model runs on this CPU (trnkit.qwen3.precision)."""
    return "bf16" if native_matmul(torch.bfloat16) else "fp32 (no native bf16)"


def run_case(flavor: str, dtype: str, seq: int, args: argparse.Namespace, clock) -> list[dict]:
    native = build_native(flavor, vocab=args.vocab)
    experts = args.hf_experts if native.config.is_moe else [None]
    hf = {f"transformers[{e or 'default'}]": build_hf(native, e) for e in experts}
    vocab = native.config.vocab_size
    toks = tokens(args.batch, seq, vocab)
    steps = {"trnkit": step_fn(native, toks, False, dtype, args.loss_chunk)}
    steps |= {k: step_fn(m, toks, True, dtype, args.loss_chunk) for k, m in hf.items()}
    losses: dict[str, list[float]] = {k: [] for k in steps}
    times: dict[str, list[float]] = {k: [] for k in steps}
    cold: set[str] = set()  # sides whose first step took over --slow-step-s: that step is their only timing
    for rep in range(args.warmup + args.repeat):  # interleaved; every side sees the same batches and updates
        for k, fn in steps.items():
            if k in cold:
                continue
            t0 = clock()
            losses[k].append(fn())
            dt = clock() - t0
            if rep >= args.warmup:
                times[k].append(dt)
            elif rep == 0 and dt > args.slow_step_s:
                times[k], cold = [dt], cold | {k}
    del native, hf, steps
    best = {k: min(v) for k, v in times.items()}
    fastest_hf = min((k for k in best if k != "trnkit"), key=best.get)
    peak = {k: fresh_process_peak(k, flavor, dtype, seq, args) for k in ("trnkit", fastest_hf)}
    loss_diff = max(abs(a - b) for a, b in zip(losses["trnkit"], losses[fastest_hf]))
    rows = []
    for k in times:
        rows.append({"flavor": flavor, "dtype": dtype, "batch": args.batch, "seq": seq,
                     "vocab_size": vocab,
                     "deterministic": args.deterministic, "impl": k, "setup": setup(k, dtype, args.loss_chunk),
                     "reps": f"{len(times[k])} cold" if k in cold else len(times[k]),
                     "best_ms": round(best[k] * 1e3, 1), "median_ms": round(statistics.median(times[k]) * 1e3, 1),
                     "peak_mib": round(peak[k], 1) if k in peak else "",
                     "loss_step1": round(losses[k][0], 6),
                     "max_loss_diff": f"{max(abs(a - b) for a, b in zip(losses['trnkit'], losses[k])):.2e}",
                     "speedup": round(best[fastest_hf] / best["trnkit"], 3) if k == "trnkit" else "",
                     "speedup_median": round(statistics.median(times[fastest_hf]) / statistics.median(times["trnkit"]),
                                             3) if k == "trnkit" else "",
                     "memory_ratio": round(peak["trnkit"] / peak[fastest_hf], 3) if k == "trnkit" else ""})
    r = rows[0]
    print(f"  {flavor:9s} {dtype:8s} seq {seq:5d}: trnkit {r['best_ms']:8.0f} ms vs {fastest_hf} "
          f"{best[fastest_hf] * 1e3:8.0f} ms -> {r['speedup']:.2f}x (median {r['speedup_median']:.2f}x); "
          f"peak {peak['trnkit']:.0f} vs {peak[fastest_hf]:.0f} MiB -> {r['memory_ratio']:.2f}x; "
          f"max |loss diff| over {min(len(v) for v in losses.values())} steps {loss_diff:.1e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavors", nargs="+", default=["debug", "debug-moe"])
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--slow-step-s", type=float, default=120.0,
                    help="a side whose first step takes longer (clock seconds) is timed by that step alone "
                         "(its row: reps '1 cold'); for transformers' bf16 step on CPUs without native bf16")
    ap.add_argument("--hf-experts", nargs="+", default=["eager", "grouped_mm"],
                    choices=["eager", "grouped_mm", "batched_mm"], help="transformers experts backends (MoE)")
    ap.add_argument("--deterministic", choices=["off", "on"], default="off",
                    help="torch.use_deterministic_algorithms for both sides (off: transformers' default, "
                         "on: the trainer's)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: process CPU time (one thread; other jobs' CPU time does not count, their "
                         "memory traffic does); wall: perf_counter")
    ap.add_argument("--loss-chunk", type=int, default=256,
                    help="trnkit's chunked linear cross-entropy: tokens per chunk (0 = full logits)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="override vocab_size (e.g. 2048 like torchtitan's debugmodel) to time the model body")
    ap.add_argument("--name", default="", help="output file stem (default qwen3_step[_vocab<N>])")
    ap.add_argument("--no-save", action="store_true", help="print only, write no files")
    ap.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)  # internal: the fresh-process peak
    add_output_args(ap, "<name>.json and .csv")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(args.deterministic == "on")
    if args.peak_of:
        print(step_peak_mib(args.peak_of, args.flavors[0], args.dtypes[0], args.batch, args.seqs[0], args.loss_chunk,
                            args.vocab))
        return
    import transformers

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
          f"{args.clock} clock, batch {args.batch}, deterministic {args.deterministic}, "
          f"min / median of {args.repeat} interleaved steps after {args.warmup} warm-up", flush=True)
    name = args.name or "qwen3_step" + (f"_vocab{args.vocab}" if args.vocab else "")
    out = output_dir(args, root=ROOT)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor()}
    for seq in args.seqs:
        for dtype in args.dtypes:
            for flavor in args.flavors:
                rows = run_case(flavor, dtype, seq, args, clock)
                if not args.no_save:
                    save_case(out, name, rows, meta | {"argv": sys.argv[1:]})


CASE = ("flavor", "dtype", "batch", "seq", "vocab_size", "deterministic")  # the columns naming a case


def save_case(out: Path, name: str, rows: list[dict], meta: dict) -> None:
    """Write one case's rows into ``<name>.csv`` / ``.json`` in ``out``, replacing that case's old rows and
    keeping the others (so an interrupted run keeps its finished cases and runs of different cases add up)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.csv"
    case = {tuple(str(r[k]) for k in CASE) for r in rows}
    old = list(csv.DictReader(path.open())) if path.exists() else []
    merged = [r for r in old if tuple(r[k] for k in CASE) not in case] + rows
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(merged)
    (out / f"{name}.json").write_text(json.dumps({"meta_of_last_run": meta, "rows": merged}, indent=2))
    print(f"saved {path} (and .json)", flush=True)

if __name__ == "__main__":
    main()
