"""Interpreter speed: the tiled matmul kernel (``trnkit.demo.matmul_tiled``) at 2048 x 2048 x 2048.

Reports, per input dtype (bf16 and fp32; both accumulate in fp32 like the hardware):
* the interpreter's wall time for one kernel call (best of ``--repeat``), with and without tracing,
  and in trace-only mode (matmul arithmetic skipped),
* instructions simulated per second,
* numpy's own fp32 matmul of the same shape (``A.T @ B``; the interpreter sums each product in fp64 and rounds once;
  numpy has no fast bf16 matmul), and the ratio interpreter / numpy. Target: within 20x.

Writes ``interp_speed.json`` and ``.csv`` to ``outputs/bench/`` (``--save-reference``: to the tracked
``benchmarks/data/`` that docs/interpreter.md quotes). Run: ``python benchmarks/interp_speed.py``.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import time
from pathlib import Path

import torch

import trnkit
from trnkit.bench.paths import add_output_args, output_dir
from trnkit.demo import matmul_tiled
from trnkit.nkisim import trace

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 20.0


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(size: int, dtype: torch.dtype, repeat: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lhsT = torch.randn(size, size, generator=g).to(dtype)
    rhs = torch.randn(size, size, generator=g).to(dtype)
    a32, b32 = lhsT.float().numpy(), rhs.float().numpy()

    out = matmul_tiled(lhsT, rhs)  # warm-up + correctness check
    ref = (lhsT.float().T @ rhs.float()).to(dtype)
    err = (torch.as_tensor(out).float() - ref.float()).abs().max().item()

    interp_s = _best(lambda: matmul_tiled(lhsT, rhs), repeat)
    n_instr = 0

    def traced(trace_only: bool) -> None:
        nonlocal n_instr
        with trace.record(trace_only=trace_only) as tr:
            matmul_tiled(lhsT, rhs)
        n_instr = len(tr)

    traced_s = _best(lambda: traced(False), repeat)
    trace_only_s = _best(lambda: traced(True), repeat)
    numpy_s = _best(lambda: a32.T @ b32, repeat)
    return {
        "kernel": "matmul_tiled", "M": size, "N": size, "K": size,
        "dtype": str(dtype).replace("torch.", ""), "numpy_dtype": "float32",
        "interp_s": interp_s, "interp_traced_s": traced_s, "interp_trace_only_s": trace_only_s,
        "instructions": n_instr, "instr_per_s": n_instr / traced_s,
        "numpy_s": numpy_s, "ratio": interp_s / numpy_s, "target_ratio": TARGET_RATIO,
        "meets_target": interp_s / numpy_s <= TARGET_RATIO, "max_abs_err": err,
        "repeat": repeat, "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "trnkit_version": trnkit.__version__,
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--dtype", choices=("bfloat16", "float32", "both"), default="both")
    p.add_argument("--repeat", type=int, default=3)
    add_output_args(p, "interp_speed.json and .csv")
    args = p.parse_args(argv)
    out = output_dir(args, root=ROOT) / "interp_speed"
    dtypes = [torch.bfloat16, torch.float32] if args.dtype == "both" else [getattr(torch, args.dtype)]
    rows = []
    for dt in dtypes:
        r = measure(args.size, dt, args.repeat)
        rows.append(r)
        print(f"{r['kernel']} {r['M']}x{r['N']}x{r['K']} {r['dtype']}: interpreter {r['interp_s']:.3f} s "
              f"(traced {r['interp_traced_s']:.3f} s, trace-only {r['interp_trace_only_s']:.3f} s), "
              f"{r['instructions']} instructions, {r['instr_per_s']:.0f} instr/s; numpy fp32 matmul "
              f"{r['numpy_s']:.3f} s; ratio {r['ratio']:.1f}x (target <= {TARGET_RATIO:.0f}x: "
              f"{'met' if r['meets_target'] else 'MISSED'}); max |err| vs torch {r['max_abs_err']:.3g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(f"saved {out.with_suffix('.json')} and .csv")
    return rows


if __name__ == "__main__":
    main()
