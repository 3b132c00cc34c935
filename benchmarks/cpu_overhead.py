"""CPU overheads the docs quote: the trainer's AdamW step, the override guard's call-time check, a custom op's
``torch.library`` dispatch and the interpreter's cost per instruction, each measured against its alternative in
the same run.

* ``adamw``: one ``optimizer.step()`` over qwen3:debug-moe's parameters (random gradients) with
  ``fused=True`` (the trainer's choice on CPU, :func:`trnkit.harness.train.build_optimizer`),
  ``foreach=True`` and ``foreach=False``; ms per step.
* ``guard``: :meth:`trnkit.overrides.guard.BoundKernel.choose` (``select`` + the kernel's constraints) for
  ``rope_hf``, ``router_topk`` and ``moe_experts`` at Qwen3-30B-A3B's shapes (batch 2 x 2,048 tokens, bf16;
  the weights are allocated, never written); us per call. ``served`` says whether the kernel accepts them.
* ``dispatch``: ``trnkit::rope_hf_apply`` with the reference impl vs the same work called directly (two
  ``empty_like`` outputs + ``rope_hf_bshd_ref``) on a tiny input; us per call.
* ``instruction``: the interpreter's cost per instruction, a launch of 2,000 ``tensor_scalar`` adds on one
  ``[128, 64]`` fp32 tile without a trace, recording one, and trace-only; us per instruction.
* ``lockstep``: the same kernel as one program (LNC=1) and as a two-program launch (LNC=2, the programs issue
  in lockstep, each on its own rows); us per instruction.
* ``matmul``: 200 ``nc_matmul`` of ``[128, 128] x [128, 512]`` fp32 into one PSUM tile; us per instruction.
* ``train_kernels``: each kernel entry point the main job calls, at its debug-moe shapes
  (``benchmarks/interp_train_kernels.py``); ms per call, and us per instruction.
* ``blas``: the MoE forward of ``train_kernels`` with numpy's BLAS switched to one thread per launch (the
  interpreter's default, :mod:`trnkit.nkisim.blas`) and left at its own thread count; ms per call.

The variants of a case are timed in alternating rounds (round k times each variant once), so load from other
processes falls on all of them; each row gives the best and median round, and ``ratio``, its median over the
case's first variant's. One torch thread; ``--clock cpu`` (default) counts this process's CPU time, which other
processes' load disturbs less than the wall clock.

Writes ``cpu_overhead.csv`` to ``outputs/bench/`` (``--save-reference``: to the tracked ``benchmarks/data/``
that docs/trainer.md, docs/overrides.md and docs/interpreter.md quote). Run: ``python benchmarks/cpu_overhead.py``.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

import trnkit
from trnkit.bench.paths import add_output_args, output_dir

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("case", "variant", "shape", "unit", "best", "median", "ratio", "rounds", "calls_per_round", "served",
          "instructions", "us_per_instruction", "clock", "torch_threads", "torch_version", "machine", "trnkit_version",
          "timestamp")


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, calls: int,
                clock: Callable[[], float]) -> dict[str, list[float]]:
    """Seconds per call of each variant, one figure per round; each round times every variant once
    (``calls`` calls in a row), after one untimed warm-up call each."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = clock()
            for _ in range(calls):
                fn()
            times[name].append((clock() - t0) / calls)
    return times


def adamw_variants() -> tuple[str, dict[str, Callable[[], object]]]:
    """One AdamW step per variant over the same qwen3:debug-moe parameters (each optimizer keeps its own state)."""
    from trnkit.qwen3 import Qwen3Model, model_registry

    torch.manual_seed(0)
    model = Qwen3Model(model_registry("debug-moe").config)
    model.init_weights()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opts = {name: torch.optim.AdamW(params, lr=3e-4, **kw) for name, kw in (
        ("fused=True", {"fused": True}), ("foreach=True", {"foreach": True}), ("foreach=False", {"foreach": False}))}
    n = sum(p.numel() for p in params)
    return f"qwen3:debug-moe, {n:,} parameters, fp32", {name: opt.step for name, opt in opts.items()}


def guard_variants() -> tuple[str, dict[str, Callable[[], object]], dict[str, bool]]:
    """The call-time check of three swap points at Qwen3-30B-A3B's shapes, and whether each kernel serves them."""
    from trnkit.overrides.config import KernelChoice
    from trnkit.overrides.guard import BoundKernel
    from trnkit.qwen3 import model_registry

    c = model_registry("30B-A3B").config
    B, S, bf16 = 2, 2048, torch.bfloat16
    T = B * S
    tokens = torch.empty(T, c.dim, dtype=bf16)
    inputs = {
        "rope_hf": dict(q=torch.empty(B, S, c.n_heads, c.head_dim, dtype=bf16),
                        k=torch.empty(B, S, c.n_kv_heads, c.head_dim, dtype=bf16),
                        cos=torch.empty(S, c.head_dim, dtype=bf16), sin=torch.empty(S, c.head_dim, dtype=bf16),
                        layout="bshd"),
        "router_topk": dict(x=tokens, w_router=torch.empty(c.num_experts, c.dim, dtype=bf16), top_k=c.top_k,
                            norm_topk_prob=c.norm_topk_prob),
        "moe_experts": dict(x=tokens, topk_idx=torch.zeros(T, c.top_k, dtype=torch.int64),
                            topk_weights=torch.empty(T, c.top_k, dtype=bf16),
                            w_gate_up=torch.empty(c.num_experts, c.dim, 2 * c.moe_inter_dim, dtype=bf16),
                            w_down=torch.empty(c.num_experts, c.moe_inter_dim, c.dim, dtype=bf16)),
    }
    guards = {op: BoundKernel(op, KernelChoice(impl="nki", policy="fallback"), f"bench.{op}") for op in inputs}
    served = {op: guards[op].choose(**kw) == "nki" for op, kw in inputs.items()}
    shape = (f"Qwen3-30B-A3B, batch {B} x {S}, bf16: q [{B}, {S}, {c.n_heads}, {c.head_dim}], "
             f"x [{T}, {c.dim}], {c.num_experts} experts, top-{c.top_k}")
    return shape, {op: (lambda g=guards[op], kw=kw: g.choose(**kw)) for op, kw in inputs.items()}, served


def dispatch_variants() -> tuple[str, dict[str, Callable[[], object]]]:
    """``trnkit::rope_hf_apply`` (reference impl) and the same work without the custom op, on a tiny input."""
    from trnkit.kernels.rope.rope_torch import rope_hf_bshd_ref
    from trnkit.overrides import ops

    g = torch.Generator().manual_seed(0)
    B, S, H, D = 1, 8, 2, 64
    q, k = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    cos, sin = torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)

    def direct() -> tuple[torch.Tensor, torch.Tensor]:
        return rope_hf_bshd_ref(q, k, torch.empty_like(q), torch.empty_like(k), cos, sin)

    via_op = ops.rope_hf_apply(q, k, cos, sin, None, "bshd", False, "reference")
    torch.testing.assert_close(via_op, direct(), rtol=0, atol=0)  # the same work
    return (f"q, k [{B}, {S}, {H}, {D}] fp32", {
        "trnkit::rope_hf_apply[reference]": lambda: ops.rope_hf_apply(q, k, cos, sin, None, "bshd", False,
                                                                      "reference"),
        "rope_hf_bshd_ref direct": direct})


CHAIN = 2000  # tensor_scalar instructions per program of the instruction / lockstep kernel
MATMULS = 200  # nc_matmul instructions of the matmul kernel


def _interpreter_kernels() -> tuple[Callable, Callable]:
    """(scalar_chain, matmul_chain): nki.jit kernels of the instruction / lockstep and matmul cases."""
    from trnkit.nki_api import nisa, nki, nl

    @nki.jit
    def scalar_chain(x):
        """Program p adds 1 to rows [128 p, 128 p + 128) of x, CHAIN times, on one SBUF tile."""
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        rows = nl.program_id(0) * 128
        t = nl.ndarray((128, x.shape[1]), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[rows:rows + 128, :])
        for _ in range(CHAIN):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=out[rows:rows + 128, :], src=t)
        return out

    @nki.jit
    def matmul_chain(lhsT, rhs):
        """MATMULS times lhsT.T @ rhs summed in one PSUM tile."""
        out = nl.ndarray((lhsT.shape[1], rhs.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
        a = nl.ndarray(lhsT.shape, nl.float32, buffer=nl.sbuf)
        b = nl.ndarray(rhs.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=lhsT)
        nisa.dma_copy(dst=b, src=rhs)
        acc = nl.ndarray(out.shape, nl.float32, buffer=nl.psum)
        for i in range(MATMULS):
            nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=i > 0)
        res = nl.ndarray(out.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        nisa.dma_copy(dst=out, src=res)
        return out

    return scalar_chain, matmul_chain


def small_integers(shape: tuple[int, ...]) -> np.ndarray:
    """fp32 integers in [-100, 100): sums of them and of ones are exact, so a kernel's result is checked exactly."""
    return np.random.default_rng(0).integers(-100, 100, shape).astype(np.float32)


def instruction_count(fn: Callable[[], object]) -> int:
    """Instructions one call of ``fn`` issues on the interpreter (every program's)."""
    from trnkit.nkisim import trace

    with trace.record(trace_only=True) as tr:
        fn()
    return len(tr)


def instruction_variants() -> tuple[str, dict[str, Callable[[], object]], dict[str, int]]:
    """One launch of the scalar chain without a trace, recording one, and trace-only."""
    from trnkit.nkisim import trace

    scalar_chain, _ = _interpreter_kernels()
    x = small_integers((128, 64))
    np.testing.assert_array_equal(scalar_chain(x), x + CHAIN)  # the adds happen

    def recorded(trace_only: bool) -> None:
        with trace.record(trace_only=trace_only):
            scalar_chain(x)

    n = instruction_count(lambda: scalar_chain(x))
    variants = {"no trace": lambda: scalar_chain(x), "traced": lambda: recorded(False),
                "trace-only": lambda: recorded(True)}
    return f"{CHAIN:,} tensor_scalar on [128, 64] fp32", variants, dict.fromkeys(variants, n)


def lockstep_variants() -> tuple[str, dict[str, Callable[[], object]], dict[str, int]]:
    """The scalar chain as one program and as two programs in lockstep (twice the instructions)."""
    scalar_chain, _ = _interpreter_kernels()
    x = small_integers((256, 64))
    np.testing.assert_array_equal(scalar_chain[2](x), x + CHAIN)  # both programs' rows
    variants = {"LNC=1": lambda: scalar_chain(x), "LNC=2": lambda: scalar_chain[2](x)}
    return (f"{CHAIN:,} tensor_scalar per program on [128, 64] fp32",
            variants, {name: instruction_count(fn) for name, fn in variants.items()})


def matmul_variants() -> tuple[str, dict[str, Callable[[], object]], dict[str, int]]:
    _, matmul_chain = _interpreter_kernels()
    g = np.random.default_rng(0)
    lhsT, rhs = g.standard_normal((128, 128)).astype(np.float32), g.standard_normal((128, 512)).astype(np.float32)
    np.testing.assert_allclose(matmul_chain(lhsT, rhs), MATMULS * (lhsT.T.astype(np.float64) @ rhs), rtol=1e-4,
                               atol=1e-2)
    variants = {"nc_matmul": lambda: matmul_chain(lhsT, rhs)}
    return f"{MATMULS} nc_matmul [128, 128] x [128, 512] fp32", variants, {"nc_matmul": instruction_count(
        variants["nc_matmul"])}


def _train_kernels() -> dict[str, Callable[[], object]]:
    """benchmarks/interp_train_kernels.py's cases (the main job's kernel calls at the debug-moe shapes)."""
    from trnkit.bench.paths import load_script

    return load_script(ROOT / "benchmarks" / "interp_train_kernels.py", "interp_train_kernels").cases()


def train_kernel_variants() -> tuple[str, dict[str, Callable[[], object]], dict[str, int]]:
    """The main job's kernel calls and the instructions each issues."""
    variants = _train_kernels()
    return ("configs/debug_moe_nki.toml shapes (2 x 128 tokens, H 256, 8 experts top-2, I 128), fp32",
            variants, {name: instruction_count(fn) for name, fn in variants.items()})


def blas_variants() -> tuple[str, dict[str, Callable[[], object]]]:
    """The MoE forward with the per-launch single-threaded BLAS switch on and off."""
    from trnkit.nkisim import blas

    moe_fwd = _train_kernels()["moe fwd"]  # no instruction counts: this case is timed per call

    def with_launch_threads(n: int) -> Callable[[], object]:
        def run() -> object:
            saved, blas.LAUNCH_THREADS = blas.LAUNCH_THREADS, n
            try:
                return moe_fwd()
            finally:
                blas.LAUNCH_THREADS = saved
        return run

    return (f"moe fwd at the debug-moe shapes, numpy BLAS {blas.get_num_threads()} threads outside launches",
            {"1 BLAS thread per launch": with_launch_threads(1), "BLAS left alone": with_launch_threads(0)})


def rows_of(case: str, shape: str, unit: str, scale: float, times: dict[str, list[float]], calls: int,
            meta: dict[str, str], served: dict[str, bool] | None = None,
            instructions: dict[str, int] | None = None) -> list[dict[str, str]]:
    """One CSV row per variant: best and median in ``unit`` (seconds times ``scale``), median over the first's,
    and with ``instructions`` (per call) the median per instruction in us."""
    first = statistics.median(next(iter(times.values())))
    out = []
    for name, ts in times.items():
        med = statistics.median(ts)
        out.append({"case": case, "variant": name, "shape": shape, "unit": unit, "best": f"{min(ts) * scale:.4g}",
                    "median": f"{med * scale:.4g}", "ratio": f"{med / first:.4g}", "rounds": str(len(ts)),
                    "calls_per_round": str(calls), "served": "" if served is None else str(served[name]),
                    "instructions": "" if instructions is None else str(instructions[name]),
                    "us_per_instruction": "" if instructions is None else f"{med * 1e6 / instructions[name]:.4g}",
                    **meta})
    return out


def save(rows: list[dict[str, str]], folder: Path) -> Path:
    """Write ``rows`` as ``folder/cpu_overhead.csv`` (a fresh file: one run's rows are compared side by side)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cpu_overhead.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return path


CASES = ("adamw", "guard", "dispatch", "instruction", "lockstep", "matmul", "train_kernels", "blas")


def main(argv: list[str] | None = None) -> list[dict[str, str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per case (each runs every variant)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: this process's CPU time (time.process_time); wall: time.perf_counter")
    add_output_args(p, "cpu_overhead.csv")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error(f"--rounds must be at least 3 (a median of rounds), got {args.rounds}")
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    meta = {"clock": args.clock, "torch_threads": str(torch.get_num_threads()), "torch_version": torch.__version__,
            "machine": platform.machine(), "trnkit_version": trnkit.__version__,
            "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")}
    rows: list[dict[str, str]] = []
    if "adamw" in args.cases:
        shape, variants = adamw_variants()
        rows += rows_of("adamw", shape, "ms", 1e3, interleaved(variants, args.rounds, 1, clock), 1, meta)
    if "guard" in args.cases:
        shape, variants, served = guard_variants()
        rows += rows_of("guard", shape, "us", 1e6, interleaved(variants, args.rounds, 200, clock), 200, meta, served)
    if "dispatch" in args.cases:
        shape, variants = dispatch_variants()
        rows += rows_of("dispatch", shape, "us", 1e6, interleaved(variants, args.rounds, 500, clock), 500, meta)
    for case, per_instruction in (("instruction", instruction_variants), ("lockstep", lockstep_variants),
                                  ("matmul", matmul_variants), ("train_kernels", train_kernel_variants)):
        if case in args.cases:
            shape, variants, n = per_instruction()
            rows += rows_of(case, shape, "ms", 1e3, interleaved(variants, args.rounds, 1, clock), 1, meta,
                            instructions=n)
    if "blas" in args.cases:
        shape, variants = blas_variants()
        rows += rows_of("blas", shape, "ms", 1e3, interleaved(variants, args.rounds, 1, clock), 1, meta)
    for r in rows:
        print(f"{r['case']:9} {r['variant']:34} best {r['best']:>8} {r['unit']}  median {r['median']:>8} {r['unit']}"
              f"  x{r['ratio']}" + (f"  served={r['served']}" if r["served"] else "")
              + (f"  {r['us_per_instruction']} us/instruction" if r["instructions"] else ""))
    print(f"wrote {save(rows, output_dir(args, ROOT))}")
    return rows


if __name__ == "__main__":
    main()
