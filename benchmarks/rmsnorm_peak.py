"""trnkit's RMSNorm forward side by side with AWS nki-library's RMSNorm kernels under the trn2 cost model, both at
LNC=2, bf16, the same ``[B, S, H]`` input.

What each computes (nki-library has no RMSNorm backward, so the forward only):

- trnkit ``rmsnorm``: ``y = w * (x * rstd)`` in x's ``[B, S, H]`` layout, plus ``rstd`` per row in fp32 (saved for
  its backward).
- nki-library ``rmsnorm_tkg`` (core/subkernels, a token-generation kernel): the same ``y``, written transposed
  as ``[128, B*S, H/128]`` for the matmul after it; no ``rstd``. Its output tile stays whole in SBUF, so it
  serves only a few thousand rows at these H.
- nki-library ``rmsnorm_quant_kernel`` (core/rmsnorm, row quantization as its tests run it): ``y`` then a
  per-row absmax and fp8 e4m3 quantization; it writes ``[B, S, H + 4]`` fp8 (values and an fp32 dequantization
  scale): half the output bytes of a bf16 ``y``, more Vector work. Its validation takes B <= 2 and S <= 32,768,
  so it gets the same rows as ``[1, B*S, H]`` (or ``[2, B*S/2, H]`` past 32,768 rows).

"Of bound" is the same job's HBM bound for all three, reading ``x`` and writing a bf16 ``y`` (``4 B S H`` bytes
plus the weight) at 362.5 GB/s per core, two cores, over the estimated time. Shapes: nki-library's test rows
(``test_rmsnorm_tkg.py`` at LNC 2; ``test_rmsnorm_quant.py``: B = 1, H = 16,384, which trnkit does not serve:
its H <= 8,192 in bf16), Qwen3-4B (H 2,560) and Qwen3-30B-A3B (H 2,048) at 8,192 and 2,048 tokens, and
Qwen3-4B's q head norm (2,048 tokens x 32 heads, H = head_dim 128). A shape a kernel refuses is a row with
its error.

Usage: ``python benchmarks/rmsnorm_peak.py [--no-nkilib | --nkilib-from-csv] [--save]``; ``--save`` writes
``benchmarks/data/rmsnorm_peak.csv``. ``--nkilib-from-csv`` traces trnkit's kernel only and carries nki-library's
figures (or errors) over from that CSV, for when only trnkit's kernel changed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from side_by_side import (HBM_BW, Estimate, add_side_args, estimate, print_ratio, require_nkilib, saved_estimate,
                          stamp, write_csv)

from trnkit.kernels.rmsnorm import rmsnorm

CSV = Path(__file__).parent / "data" / "rmsnorm_peak.csv"
LNC = 2
QUANT_S_MAX = 32768  # rmsnorm_quant's largest S
KERNELS = ("trnkit", "nki-library rmsnorm_tkg", "nki-library rmsnorm_quant")
# (case, B, S, H)
SHAPES = [
    ("nki-library rmsnorm_tkg test", 4, 8, 8192),
    ("nki-library rmsnorm_tkg test", 128, 5, 3072),
    ("nki-library rmsnorm_tkg test", 63, 32, 3072),
    ("nki-library rmsnorm_quant test", 1, 160, 16384),
    ("nki-library rmsnorm_quant test", 1, 2048, 16384),
    ("Qwen3-4B", 1, 2048, 2560),
    ("Qwen3-4B", 1, 8192, 2560),
    ("Qwen3-30B-A3B", 1, 8192, 2048),
    ("Qwen3-4B q head norm", 1, 2048 * 32, 128),
]


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:140]}"


def _trnkit(B: int, S: int, H: int) -> Estimate | str:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, generator=g).bfloat16()
    w = (torch.rand(H, generator=g) + 0.5).bfloat16()
    try:
        return estimate(lambda: rmsnorm(x, w, lnc=LNC))
    except Exception as exc:  # noqa: BLE001 - a shape it does not serve: reported, not fatal
        return _error(exc)


def _nkilib(B: int, S: int, H: int) -> dict[str, Estimate | str]:
    """Both nki-library kernels at LNC=2 (an estimate or the error each raised)."""
    from trnkit import nkisim
    from trnkit.conformance import harness

    root = harness.nkilib_root()
    bf = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, H)).astype(bf)
    gamma = (rng.random((1, H)) + 0.5).astype(bf)
    # rmsnorm_quant validates B <= 2 and S <= 32,768 but collapses the leading dimensions anyway: the same rows
    rows = B * S
    quant_shape = (1, rows, H) if rows <= QUANT_S_MAX else (rows // QUANT_S_MAX, QUANT_S_MAX, H)
    out = {}
    with harness.nki_is_interpreter(root):
        tkg = importlib.import_module("nkilib_src.nkilib.core.subkernels.rmsnorm_tkg").rmsnorm_tkg
        quant = importlib.import_module("nkilib_src.nkilib.core.rmsnorm.rmsnorm_quant")
        types = importlib.import_module("nkilib_src.nkilib.core.utils.common_types")
        kargs = quant.RmsNormQuantKernelArgs(quantization_type=types.QuantizationType.ROW,
                                             norm_type=types.NormType.RMS_NORM, eps=1e-6)
        runs = {
            "nki-library rmsnorm_tkg": lambda: nkisim.simulate(tkg)[LNC](
                input=x, gamma=gamma, output=np.zeros((128, B * S, H // 128), dtype=bf)),
            "nki-library rmsnorm_quant": lambda: quant.rmsnorm_quant_kernel[LNC](x.reshape(quant_shape), gamma, kargs,
                                                                                 None),
        }
        for name, run in runs.items():
            try:
                with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # its [WARN] lines about untested sizes
                    out[name] = estimate(run)
            except Exception as exc:  # noqa: BLE001
                out[name] = _error(exc)
    return out


def _saved_nkilib(case: str, B: int, S: int, H: int) -> dict[str, dict]:
    """nki-library's rows at this shape from the saved CSV (carried over as they are)."""
    with CSV.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["kernel"] in KERNELS[1:] and r["case"] == case
                and (int(r["B"]), int(r["S"]), int(r["H"])) == (B, S, H)]
    if len(rows) != len(KERNELS) - 1:
        raise SystemExit(f"--nkilib-from-csv: {CSV.name} has no nki-library figures for {case} x[{B},{S},{H}]; "
                         "run without it to trace nki-library's kernels")
    return {r["kernel"]: r for r in rows}


def _from_row(row: dict) -> Estimate | str:
    """A saved row's estimate (ns) or its error."""
    return row["error"] or saved_estimate(row, "est_us_")


def _row(kernel: str, case: str, B: int, S: int, H: int, res: Estimate | str) -> dict:
    row = {"kernel": kernel, "case": case, "B": B, "S": S, "H": H, "lnc": LNC, "est_us_mid": "", "est_us_low": "",
           "est_us_high": "", "bound_us": "", "bound_frac_mid": "", "bound_frac_pessimistic": "", "error": "",
           **stamp("trnkit" if kernel == "trnkit" else "nki-library", "rmsnorm")}
    if isinstance(res, str):
        row["error"] = res
        return row
    bound = (4 * B * S * H + 2 * H) / (HBM_BW * LNC) * 1e9
    row.update(est_us_mid=round(res.mid / 1e3, 2), est_us_low=round(res.low / 1e3, 2),
               est_us_high=round(res.high / 1e3, 2), bound_us=round(bound / 1e3, 2),
               bound_frac_mid=round(bound / res.mid, 3), bound_frac_pessimistic=round(bound / res.high, 3))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_side_args(p, "kernel", CSV.name)
    args = p.parse_args()
    if not (args.no_nkilib or args.nkilib_from_csv):
        require_nkilib("rmsnorm_peak.py")
    rows = []
    for case, B, S, H in SHAPES:
        results = {"trnkit": _trnkit(B, S, H)}
        saved = _saved_nkilib(case, B, S, H) if args.nkilib_from_csv else {}
        if saved:
            results.update({kernel: _from_row(r) for kernel, r in saved.items()})
        elif not args.no_nkilib:
            results.update(_nkilib(B, S, H))
        for kernel, res in results.items():
            row = saved.get(kernel) or _row(kernel, case, B, S, H, res)
            rows.append(row)
            shown = row["error"] or (f"{float(row['est_us_mid']):9.2f} us [{row['est_us_low']}-{row['est_us_high']}]  "
                                     f"{100 * float(row['bound_frac_mid']):5.1f}% of the HBM bound "
                                     f"(pessimistic {100 * float(row['bound_frac_pessimistic']):.1f}%)")
            print(f"{case:30s} x[{B},{S},{H}] {kernel:26s} {shown}", flush=True)
        for kernel in KERNELS[1:]:
            if isinstance(results["trnkit"], Estimate) and isinstance(results.get(kernel), Estimate):
                print_ratio(f"{case:30s} x[{B},{S},{H}] vs {kernel:26s}", results["trnkit"], results[kernel])
    if args.save:
        write_csv(rows, CSV, replace=("kernel", "case", "B", "S", "H"))


if __name__ == "__main__":
    main()
