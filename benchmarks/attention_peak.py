"""trnkit's flash attention under the trn2 cost model: the fraction of TensorE's bf16 peak at S = 4096,
head_dim 128, and side by side with AWS nki-library's ``attention_cte`` (forward) and ``attention_bwd``
(backward) traced on trnkit's interpreter (the conformance harness's checkout: ``NKILIB_SRC`` or the
archive in ``shared/thirdparty``; nothing of nki-library is copied into trnkit).

FLOPs: causal counted once, ``4 * Hq * D * S^2 / 2`` forward (``Q K^T`` and ``P V``), 2.5 times that
backward (``S`` recomputed, ``dP``, ``dV``, ``dK``, ``dQ``). The peak is 79 TFLOPS bf16 per physical core
(LNC=2: two cores). Both kernels get the same shapes, bf16, one batch row, a Qwen3-4B-like group of
4 query heads per kv head by default, and Qwen3-4B's (32 / 8) and Qwen3-30B-A3B's (32 / 4) head counts and
nki-library's test shapes with ``--shapes``; trace-only interpreter runs.

trnkit's forward is traced twice: as shipped (pass ``"forward"``: the fixed shift per row, its default), and
with ``fixed_shift=False`` (pass ``"forward, exact row max"``: the exact forward alone, which is also the
shipped forward's fallback). ``--fallback`` adds a launch of the shipped forward that fails its certificate
and runs the exact forward as well (pass ``"forward, fallback"``: q and k scaled by 6, scores in the
hundreds; traced with its arithmetic, since whether it falls back depends on the scores). Each pairs with
nki-library's ``"forward"``.

Usage: ``python benchmarks/attention_peak.py [--shapes S:HQ:HK ...] [--lnc 1 2] [--no-nkilib] [--exact-only]
[--fallback | --fallback-only] [--save]`` (default ``4096:8:2``; ``--exact-only`` / ``--fallback-only``:
that pass of trnkit's alone, no nki-library);
``--save`` writes its rows to ``benchmarks/data/attention_peak.csv``, replacing the rows of the same kernel,
pass, shape and LNC and keeping the others.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from side_by_side import PEAK, Estimate, estimate, print_ratio, require_nkilib, stamp, write_csv

from trnkit.kernels.attention import attention, attention_bwd, attention_ref, fixed_shift_failures

CSV = Path(__file__).parent / "data" / "attention_peak.csv"
D = 128
# trnkit's forward as shipped has a fixed softmax shift per row: on these random inputs every launch keeps its
# fast pass (trace-only runs compute no scores, so its certificate sees l <= S and passes as well). EXACT: the
# exact forward alone (``attention(..., fixed_shift=False)``); both compared with nki-library's forward
EXACT = "forward, exact row max"
FALLBACK = "forward, fallback"
FALLBACK_INPUT_SCALE = 6.0  # q and k: every launch's certificate fails (tests/kernels/attention use the same)


def _fallback(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lnc: int) -> Estimate:
    """The shipped (fixed-shift) forward on inputs whose certificate fails in every launch: both passes."""
    qs, ks = q * FALLBACK_INPUT_SCALE, k * FALLBACK_INPUT_SCALE
    if not fixed_shift_failures(qs, ks).any():
        raise ValueError(f"attention_peak: the {FALLBACK!r} inputs (q, k x {FALLBACK_INPUT_SCALE}) pass the "
                         "certificate, so the launch would not fall back")
    return estimate(lambda: attention(qs, ks, v, lnc=lnc), trace_only=False)


def _trnkit(S: int, Hq: int, Hk: int, lnc: int, passes: tuple[str, ...]) -> dict[str, Estimate]:
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(1, S, h, D, generator=g).bfloat16() for h in (Hq, Hk, Hk, Hq))
    out = {}
    if "forward" in passes:
        out["forward"] = estimate(lambda: attention(q, k, v, lnc=lnc))
    if EXACT in passes:
        out[EXACT] = estimate(lambda: attention(q, k, v, lnc=lnc, fixed_shift=False))
    if FALLBACK in passes:
        out[FALLBACK] = _fallback(q, k, v, lnc)
    if "backward" in passes:
        o, lse = attention_ref(q, k, v)
        out["backward"] = estimate(lambda: attention_bwd(q, k, v, o, lse, go, lnc=lnc))
    return out


def _nkilib(S: int, Hq: int, Hk: int, lnc: int) -> dict[str, Estimate]:
    from trnkit.conformance import harness

    root = harness.nkilib_root()
    bf = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    out = {}
    with harness.nki_is_interpreter(root):
        cte = importlib.import_module("nkilib_src.nkilib.core.attention.attention_cte").attention_cte
        bwd = importlib.import_module("nkilib_src.nkilib.core.attention.attention_bwd").attention_bwd
        q = rng.standard_normal((Hq, S, D)).astype(bf)  # batch x heads folded, tp_q: [bs, S, d]
        k = rng.standard_normal((Hk, D, S)).astype(bf)  # [bs_kv, d, S]
        v = rng.standard_normal((Hk, S, D)).astype(bf)
        fwd_kernel = cte[lnc] if lnc > 1 else cte
        out["forward"] = estimate(lambda: fwd_kernel(q, k, v, scale=D ** -0.5, causal_mask=True, tp_q=True,
                                                     tp_k=False, cache_softmax=True))
        qb = rng.standard_normal((1, Hq, D, S)).astype(bf)  # attention_bwd: [bs, heads, d, S]
        kb, vb = (rng.standard_normal((1, Hk, D, S)).astype(bf) for _ in range(2))
        ob, dyb = (rng.standard_normal((1, Hq, D, S)).astype(bf) for _ in range(2))
        lse = rng.standard_normal((1, Hq, 128, S // 128)).astype(np.float32)
        bwd_kernel = bwd[lnc] if lnc > 1 else bwd
        out["backward"] = estimate(lambda: bwd_kernel(qb, kb, vb, ob, dyb, lse, use_causal_mask=True))
    return out


def _shape(text: str) -> tuple[int, int, int]:
    try:
        S, Hq, Hk = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: expected S:HQ:HK (three integers), got {text!r}") from None
    if S < 1 or Hk < 1 or Hq % Hk:
        raise argparse.ArgumentTypeError(f"--shapes: S >= 1 and HQ a multiple of HK >= 1, got {text!r}")
    return S, Hq, Hk


def _rows(S: int, Hq: int, Hk: int, lnc: int, with_nkilib: bool, passes: tuple[str, ...]) -> list[dict]:
    fwd_flops = 4 * Hq * D * S * S / 2  # the fallback's useful work is one forward's
    flops = {"forward": fwd_flops, EXACT: fwd_flops, FALLBACK: fwd_flops, "backward": 2.5 * fwd_flops}
    results = {"trnkit": _trnkit(S, Hq, Hk, lnc, passes)}
    if with_nkilib:
        results["nki-library"] = _nkilib(S, Hq, Hk, lnc)
    rows = []
    for mode in ("forward", EXACT, FALLBACK, "backward"):
        for who, res in results.items():
            if mode not in res:
                continue
            low, mid, high, secs = res[mode]
            frac = [flops[mode] / (t * 1e-9) / (PEAK * lnc) for t in (high, mid, low)]
            rows.append({"kernel": who, "mode": mode, "S": S, "Hq": Hq, "Hk": Hk, "D": D, "lnc": lnc,
                         "est_us_mid": round(mid / 1e3, 1), "est_us_low": round(low / 1e3, 1),
                         "est_us_high": round(high / 1e3, 1), "peak_frac_mid": round(frac[1], 3),
                         "peak_frac_pessimistic": round(frac[0], 3), "trace_s": round(secs, 1),
                         **stamp(who, "attention")})
            print(f"S={S} Hq={Hq} Hk={Hk} LNC={lnc} {mode:8s} {who:11s} {mid / 1e3:9.1f} us "
                  f"[{low / 1e3:.1f}-{high / 1e3:.1f}]  {100 * frac[1]:5.1f}% of bf16 peak "
                  f"(pessimistic {100 * frac[0]:.1f}%)")
        if results.get("nki-library") is not None and mode in results["trnkit"] and mode != FALLBACK:
            print_ratio(f"S={S} Hq={Hq} Hk={Hk} LNC={lnc} {mode:8s}", results["trnkit"][mode],
                        results["nki-library"][mode.split(",")[0]])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=_shape, nargs="+", default=[(4096, 8, 2)], metavar="S:HQ:HK",
                   help="sequence length, query heads, kv heads (default 4096:8:2)")
    p.add_argument("--lnc", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    p.add_argument("--no-nkilib", action="store_true", help="trnkit's kernels only")
    p.add_argument("--exact-only", action="store_true",
                   help=f"trnkit's {EXACT!r} pass only (the CSV's other rows are kept)")
    fallback = p.add_mutually_exclusive_group()
    fallback.add_argument("--fallback", action="store_true", help=f"also trnkit's {FALLBACK!r} pass")
    fallback.add_argument("--fallback-only", action="store_true",
                          help=f"trnkit's {FALLBACK!r} pass only (the CSV's other rows are kept)")
    p.add_argument("--save", action="store_true", help="write the rows to benchmarks/data/attention_peak.csv")
    args = p.parse_args()
    if args.exact_only and args.fallback_only:
        p.error("--exact-only and --fallback-only: choose one pass")
    if args.exact_only or args.fallback_only:
        passes = (EXACT,) if args.exact_only else (FALLBACK,)
    else:
        passes = ("forward", EXACT, "backward") + ((FALLBACK,) if args.fallback else ())
    with_nkilib = not (args.no_nkilib or args.exact_only or args.fallback_only)
    if with_nkilib:
        require_nkilib("attention_peak.py")
    rows = []
    for S, Hq, Hk in args.shapes:
        for lnc in args.lnc:
            rows += _rows(S, Hq, Hk, lnc, with_nkilib, passes)
            if args.save:  # each shape's rows as soon as they are estimated
                write_csv(rows, CSV, replace=("kernel", "mode", "S", "Hq", "Hk", "lnc"))


if __name__ == "__main__":
    main()
