"""trnkit's dense SwiGLU MLP under the trn2 cost model: the fraction of TensorE's bf16 peak, and the
forward side by side with AWS nki-library's ``mlp_cte`` traced on trnkit's interpreter (the conformance
harness's checkout: ``NKILIB_SRC`` or the archive in ``shared/thirdparty``; nothing of nki-library is
copied into trnkit: its ``MLPParameters`` and ``mlp_cte`` are called as they are).

FLOPs: ``6 T H I`` (gate, up, down). The peak is 79 TFLOPS bf16 per physical core (LNC=2: two cores).
Both kernels get the same shapes, bf16, LNC=2, trace-only interpreter runs: nki-library's unit-test
shapes and Qwen3-4B's (H 2560, I 9728) split over 2 and 4 tensor-parallel ranks (``mlp_cte`` is an
inference kernel for one rank's I) and whole. A shape ``mlp_cte`` refuses is a row with its error.
nki-library has no dense MLP backward; trnkit's is in ``python -m trnkit.bench mlp``.

Usage: ``python benchmarks/mlp_peak.py [--no-nkilib] [--save]``; ``--save`` writes
``benchmarks/data/mlp_peak.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from side_by_side import PEAK, Estimate, estimate, print_ratio, require_nkilib, stamp, write_csv

from trnkit.kernels.mlp import mlp

CSV = Path(__file__).parent / "data" / "mlp_peak.csv"
LNC = 2
# (case, T, H, I): nki-library test_mlp_cte.py unit shapes (B = 1), Qwen3-4B per TP rank and whole
SHAPES = [("nki-library unit", 1024, 1024, 448), ("nki-library unit", 768, 1024, 896),
          ("Qwen3-4B, TP=4", 2048, 2560, 2432), ("Qwen3-4B, TP=2", 2048, 2560, 4864),
          ("Qwen3-4B", 2048, 2560, 9728)]


def _trnkit(T: int, H: int, I: int) -> Estimate:  # noqa: E741
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16()
    wgu = (torch.randn(H, 2 * I, generator=g) * H ** -0.5).bfloat16()
    wd = (torch.randn(I, H, generator=g) * I ** -0.5).bfloat16()
    return estimate(lambda: mlp(x, wgu, wd, lnc=LNC))


def _nkilib(T: int, H: int, I: int) -> Estimate | str:  # noqa: E741
    """nki-library's mlp_cte forward at LNC=2 (an estimate tuple) or its error message."""
    from trnkit.conformance import harness

    root = harness.nkilib_root()
    bf = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    with harness.nki_is_interpreter(root):
        nki = importlib.import_module("nki")
        nl = importlib.import_module("nki.language")
        params = importlib.import_module("nkilib_src.nkilib.core.mlp.mlp_parameters")
        mlp_cte = importlib.import_module("nkilib_src.nkilib.core.mlp.mlp_cte.mlp_cte").mlp_cte

        def entry(x, w_gate, w_up, w_down):
            """nki-library's own mlp() entry does for CTE: the parameters, a shared-HBM output, mlp_cte."""
            p = params.MLPParameters(hidden_tensor=x, gate_proj_weights_tensor=w_gate, up_proj_weights_tensor=w_up,
                                     down_proj_weights_tensor=w_down, force_cte_mode=True)
            out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
            mlp_cte(p, out, None)
            return out

        kernel = nki.jit(entry)[LNC]
        x = rng.standard_normal((1, T, H)).astype(bf)
        wg, wu = ((rng.standard_normal((H, I)) * H ** -0.5).astype(bf) for _ in range(2))
        wd = (rng.standard_normal((I, H)) * I ** -0.5).astype(bf)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its allocator's [INFO] lines
                return estimate(lambda: kernel(x, wg, wu, wd))
        except Exception as exc:  # noqa: BLE001 - a shape it does not serve: reported, not fatal
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _row(who: str, case: str, T: int, H: int, I: int, res: Estimate | str) -> dict:  # noqa: E741
    row = {"kernel": who, "case": case, "T": T, "H": H, "I": I, "lnc": LNC, "est_us_mid": "",
           "est_us_low": "", "est_us_high": "", "peak_frac_mid": "", "peak_frac_pessimistic": "", "trace_s": "",
           "error": "", **stamp(who, "mlp")}
    if isinstance(res, str):
        row["error"] = res
        return row
    low, mid, high, secs = res
    flops = 6 * T * H * I
    frac = [flops / (t * 1e-9) / (PEAK * LNC) for t in (high, mid)]
    row.update(est_us_mid=round(mid / 1e3, 1), est_us_low=round(low / 1e3, 1), est_us_high=round(high / 1e3, 1),
               peak_frac_mid=round(frac[1], 3), peak_frac_pessimistic=round(frac[0], 3), trace_s=round(secs, 1))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-nkilib", action="store_true", help="trnkit's kernels only")
    p.add_argument("--save", action="store_true", help="write benchmarks/data/mlp_peak.csv")
    args = p.parse_args()
    if not args.no_nkilib:
        require_nkilib("mlp_peak.py")
    rows = []
    for case, T, H, I in SHAPES:  # noqa: E741
        results = {"trnkit": _trnkit(T, H, I)}
        if not args.no_nkilib:
            results["nki-library"] = _nkilib(T, H, I)
        for who, res in results.items():
            row = _row(who, case, T, H, I, res)
            rows.append(row)
            shown = row["error"] or (f"{row['est_us_mid']:9.1f} us [{row['est_us_low']}-{row['est_us_high']}]  "
                                     f"{100 * row['peak_frac_mid']:5.1f}% of bf16 peak "
                                     f"(pessimistic {100 * row['peak_frac_pessimistic']:.1f}%)")
            print(f"{case:16s} T={T} H={H} I={I} {who:11s} {shown}", flush=True)
        tk, aws = results["trnkit"], results.get("nki-library")
        if isinstance(aws, Estimate):
            print_ratio(f"{case:16s} forward", tk, aws)
    if args.save:
        write_csv(rows, CSV, replace=("kernel", "case", "T", "H", "I"))


if __name__ == "__main__":
    main()
