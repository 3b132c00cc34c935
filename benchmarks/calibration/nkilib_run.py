"""Estimate nki-library's recorded device times (nkilib_points.csv) with its kernels traced on the interpreter.

``python benchmarks/calibration/nkilib_run.py [--family F] [--table T] [--max-size N]
[--points NAME ... | --all] [--list] [--out CSV] [--lnc N]``
traces each check / context point's kernel the way the conformance harness runs nki-library's test row (its
inputs, LNC, entry point; trace only: large matmuls skip their arithmetic) and appends ``low / mid / high`` of
the cost model's estimate of a standalone launch (each test row runs its kernel as its own NEFF:
``cost.estimate(..., launch=cost_params.STANDALONE_LAUNCH)``) to ``nkilib_calibration.csv`` (one row per
point, the newest kept), with its two parts: the kernel's own instructions (``kernel_*_us``, in the standalone
launch's HBM condition: what the kernel costs inside a larger graph at LNC 2; at LNC 1 its core has its HBM stack
to itself at low / mid, ``cost.hbm_per_core``) and the launch's start-up / tear-down and LNC 2 core skew
(``launch_*_us``). Points already
in the CSV are skipped unless named (or ``--all``); rows run smallest first (``--max-size``: skip rows whose work
measure, :func:`size`, is larger). Nothing here is fitted: these are check points (split.csv). Run it under
``nice -n 15``: the larger rows trace for minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import io
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import nkilib_rows  # noqa: E402

from trnkit.bench import fingerprint  # noqa: E402

OUT_CSV = HERE / "nkilib_calibration.csv"
FIELDS = ("point", "family", "shape", "lnc", "published_us", "low_us", "mid_us", "high_us", "error_mid", "inside",
          "role", "status", "trace_s", "kernel_low_us", "kernel_mid_us", "kernel_high_us", "launch_low_us",
          "launch_mid_us", "launch_high_us", "cost_model", "sources", "computed")  # + trnkit.bench.fingerprint's


def _dtype(text: str) -> Any:
    from trnkit.conformance import cases_attention as ca

    return {"np.float32": ca.F32, "nl.float32": ca.F32, "nl.bfloat16": ca.BF16, "np.float16": ca.F16}[text]


def _enum(text: str) -> str:
    """``NormType.RMS_NORM`` -> ``RMS_NORM``."""
    return text.rsplit(".", 1)[-1]


def size(p: dict) -> float:
    """A measure of a row's work, to run the small rows first: tokens x hidden x intermediate (MLP), batch x Sq x
    Skv x d (attention), tokens x hidden (rmsnorm)."""
    f = p["fields"]
    if p["family"] == "rmsnorm_quant":
        return f["batch"] * f["seqlen"] * f["hidden"]
    if p["family"] in ("mlp_cte", "mlp_tkg"):
        return f["batch"] * f["seqlen"] * f["hidden"] * f["intermediate"]
    if p["family"] == "attention_cte":
        return f["bs"] * f["seqlen_q"] * (f["seqlen_kv"] + (f.get("prior_len") or 0)) * f["d"]
    return float("inf")


def lnc_of(p: dict) -> int:
    """The row's logical-core count: its ``vnc_degree`` / ``lnc_degree``; attention_cte's no-cp table passes
    ``CompilerArgs()``, LNC 2 on trn2 (as the conformance harness runs it); ``p["lnc"]`` (a what-if) overrides."""
    f = p["fields"]
    return int(p.get("lnc") or f.get("vnc_degree") or f.get("lnc_degree") or 2)


def case_of(p: dict) -> Any:
    """The conformance :class:`~trnkit.conformance.harness.Case` of the point's test row, or a string saying why
    there is none."""
    from trnkit.conformance import cases_attention, cases_mlp, cases_mlp_quant, cases_rmsnorm_quant
    from trnkit.conformance.harness import Case

    fam, lnc = p["family"], lnc_of(p)
    f = {**p["fields"], "vnc_degree": lnc} if "vnc_degree" in p["fields"] else p["fields"]
    if fam == "rmsnorm_quant":
        if lnc != 2:
            return f"the conformance cases of rmsnorm_quant's LNC table run at LNC 2, not {lnc}"
        gen = {"gaussian_tensor_generator()": cases_rmsnorm_quant.GAUSSIAN,
               "duplicate_row_rmsnorm_inp_generator()": cases_rmsnorm_quant.DUPLICATE,
               "duplicate_row_rmsnorm_inp_generator(all_ones=True)": cases_rmsnorm_quant.ONES}[f["tensor_gen"]]
        static = _enum(f["quant_type"]) == "STATIC"
        name = cases_rmsnorm_quant._name(f["quant_only"], f["lower_bound"], static, gen)
        return next(c for c in cases_rmsnorm_quant.rmsnorm_quant_cases()
                    if c.name == name and c.shapes == f"B=1 S={f['seqlen']} H=16384")
    if fam == "mlp_cte":
        quant = _enum(f["quant_type"])
        b, s, h, i = f["batch"], f["seqlen"], f["hidden"], f["intermediate"]
        if quant == "NONE":
            inputs = cases_mlp._mlp_inputs(b, s, h, i, _enum(f["norm_type"]), f["fused_add"], f["store_add"],
                                           f["skip_gate"], _enum(f["act_fn_type"]), f["gate_bias"], f["up_bias"],
                                           f["down_bias"], f["norm_bias"])
        elif quant in ("ROW", "STATIC"):
            inputs = cases_mlp_quant._cte_quant_inputs(b, s, h, i, quant)
        else:
            return f"no conformance inputs for quantization {quant}"
        return Case(kernel="core/mlp/mlp_cte", name=p["point"], shapes=f"B={b} S={s} H={h} I={i}",
                    entry=f"{cases_mlp.LIB}.mlp.mlp:mlp", reference="", inputs=inputs, outputs=("out",), lnc=lnc)
    if fam == "mlp_tkg":
        quant = _enum(f["quant_type"])
        row = (lnc, f["batch"], f["seqlen"], f["hidden"], f["intermediate"])
        norm, cols = _enum(f["norm_type"]), (f["gate_up_column_tiling"], f["down_column_tiling"])
        if _enum(f["act_fn_type"]) != "SiLU":
            return f"activation {f['act_fn_type']}: no conformance inputs"
        if quant == "NONE" and f["down_optimized_layout"]:
            return Case(kernel="core/mlp/mlp_tkg", name=p["point"], shapes=str(row[1:]),
                        entry=f"{cases_mlp.LIB}.mlp.mlp:mlp", reference="", outputs=("out",), lnc=lnc,
                        inputs=cases_mlp._mlp_inputs(*row[1:], norm, False, False, False, "SiLU", False, False, False,
                                                     False, cases_mlp.BF16, (False, False), swapped_down_lnc=lnc))
        if quant == "NONE":
            return cases_mlp.tkg_case(*row, norm, f["fused_add"], f["store_add"], f["skip_gate"], f["gate_bias"],
                                      f["up_bias"], f["down_bias"], *cols, negative=False)
        if quant in ("ROW", "STATIC"):
            on = (f["gate_bias"], f["up_bias"], f["down_bias"])
            biases = {(False,) * 3: False, (True,) * 3: True, (True, True, False): "gate_up"}.get(on)
            if biases is None or f["fused_add"] or f["skip_gate"]:
                return "biases / fused add / skip_gate combination without conformance inputs"
            return cases_mlp_quant.tkg_quant_case(*row, quant, norm, biases, *cols, f["down_optimized_layout"])
        return f"no conformance inputs for quantization {quant}"
    if fam == "attention_cte":
        bs = f["bs"]
        bs_kv = f.get("bs_kv", bs)
        prior, used = f.get("prior_len"), f.get("prior_used_len")
        inputs = cases_attention._cte_inputs(
            bs, bs_kv, f["d"], _dtype(f["dtype"]), f["seqlen_q"], f["seqlen_kv"], prior, used, f["tp_q"],
            f.get("tp_k", False), f["tp_out"], f.get("sink", False), f["softmax_scale"], f["causal_mask"],
            f.get("sliding_window", 0), None, False, None)
        return Case(kernel="core/attention/attention_cte", name=p["point"],
                    shapes=f"bs={bs}/{bs_kv} Sq={f['seqlen_q']} Skv={f['seqlen_kv']} d={f['d']}",
                    entry=f"{cases_attention.LIB}.attention.attention_cte:attention_cte", reference="",
                    inputs=inputs, outputs=("out",), lnc=lnc)
    return f"no conformance inputs for family {fam}"


def estimate_case(case: Any, root: Path) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """``((low, mid, high), (launch low, mid, high))`` ns of the case's kernel run as a standalone launch
    (the first includes the second), traced by :func:`trace_case`."""
    from trnkit.nkisim import cost
    from trnkit.nkisim.cost_params import STANDALONE_LAUNCH

    rep = cost.estimate(trace_case(case, root), "trn2", launch=STANDALONE_LAUNCH)
    return rep.total_range_ns, rep.launch_ns


def trace_case(case: Any, root: Path) -> Any:
    """The instruction trace of the case's kernel, traced (trace only) the way the harness launches it; SBUF
    beyond capacity in program order is allowed (the compiler's allocator spills), as in the conformance run."""
    from trnkit import nkisim
    from trnkit.conformance import harness
    from trnkit.nkisim import trace

    with harness.nki_is_interpreter(root):
        with contextlib.redirect_stdout(io.StringIO()):
            for module in harness.REPAIRED_MODULES:
                harness._load_repaired(module)
            inputs = case.inputs()
        kernel = harness._resolve(case.entry, root)
        if case.wrap_kernel is not None:
            kernel = case.wrap_kernel(kernel)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with trace.record(trace_only=True) as tr:
                nkisim.simulate(kernel, capacity="sbuf_spills")[case.lnc](**inputs)
    return tr


def shape_of(p: dict) -> str:
    f = p["fields"]
    keep = [k for k in f if k not in ("rtol", "dtype", "quant_dtype") and f[k] not in (False, None, 0, "")]
    return " ".join(f"{k}={_enum(str(f[k])) if isinstance(f[k], str) else f[k]}" for k in keep)


def read_out(path: Path = OUT_CSV) -> dict[str, dict]:
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        return {r["point"]: r for r in csv.DictReader(f)}


def write_row(row: dict, path: Path = OUT_CSV) -> None:
    """``row`` into the CSV at ``path``, replacing the point's earlier row; written to a temporary file and moved
    over the CSV, so a run that dies while writing (a memory limit) leaves the previous CSV whole."""
    rows = read_out(path)
    rows[row["point"]] = row
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows.values())
    os.replace(tmp, path)


def run_point(p: dict, root: Path) -> dict:
    from trnkit.conformance import harness

    row = {"point": p["point"], "family": p["family"], "shape": shape_of(p), "lnc": lnc_of(p),
           "published_us": p["published_us"], "low_us": "", "mid_us": "", "high_us": "", "error_mid": "",
           "inside": "", "role": p["role"], "status": "", "trace_s": "", **{f"{part}_{k}_us": "" for part in
                                                                              ("kernel", "launch")
                                                                              for k in ("low", "mid", "high")},
           **fingerprint.stamp(nkilib=harness.nkilib_commit(root))}
    case = case_of(p)
    if isinstance(case, str):
        row["status"] = f"not run: {case}"
        return row
    t0 = time.perf_counter()
    try:
        total, launch = estimate_case(case, root)
    except MemoryError:  # the run's own memory limit (ulimit -v on a shared machine): not a result of the row
        gc.collect()  # (the trace is gone with the frame: room to write the row)
        row["status"] = "not run: out of memory under the run's limit"
        return row
    except Exception as exc:  # noqa: BLE001 - a row the interpreter refuses is a result, reported with its message
        row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        row["trace_s"] = f"{time.perf_counter() - t0:.1f}"
        return row
    row.update(status="ok", trace_s=f"{time.perf_counter() - t0:.1f}")
    return with_estimate(row, [t - x for t, x in zip(total, launch)], launch)


def with_estimate(row: dict, kernel_ns: Sequence[float], launch_ns: Sequence[float]) -> dict:
    """``row`` with its estimate columns filled from the kernel's own (low, mid, high) and the launch's, ns:
    ``low_us`` / ``mid_us`` / ``high_us`` are their sums (the standalone launch the recorded figure is of),
    rounded to 0.01 us after adding."""
    pub = float(row["published_us"])
    low, mid, high = ((k + x) / 1e3 for k, x in zip(kernel_ns, launch_ns))
    row = {**row, "low_us": f"{low:.2f}", "mid_us": f"{mid:.2f}", "high_us": f"{high:.2f}",
           "error_mid": f"{mid / pub - 1:.4f}", "inside": "yes" if low <= pub <= high else "no"}
    for part, vals in (("kernel", kernel_ns), ("launch", launch_ns)):
        row.update({f"{part}_{k}_us": f"{v / 1e3:.2f}" for k, v in zip(("low", "mid", "high"), vals)})
    return row


def main(argv: list[str] | None = None) -> int:
    from trnkit.conformance import harness

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", help="only these families (rmsnorm_quant, mlp_cte, ...)")
    ap.add_argument("--points", nargs="*", default=[], help="(re)run these points")
    ap.add_argument("--all", action="store_true", help="re-run the selected points already in the CSV too")
    ap.add_argument("--table", action="append", help="only the rows of these nki-library tables (variable names)")
    ap.add_argument("--max-size", type=float, default=float("inf"), help="skip rows whose size() is larger")
    ap.add_argument("--list", action="store_true", help="list the points in run order with their size")
    ap.add_argument("--out", type=Path, default=OUT_CSV, help=f"the CSV to append to (default {OUT_CSV.name} here)")
    ap.add_argument("--lnc", type=int, choices=(1, 2), help="a what-if: every row at this LNC (needs another --out)")
    args = ap.parse_args(argv)
    if args.lnc and args.out.resolve() == OUT_CSV.resolve():
        ap.error(f"--lnc {args.lnc} is a what-if: give it its own --out, not {OUT_CSV.name} (the rows' own LNC)")
    root = harness.nkilib_root()
    if root is None:
        ap.error("no nki-library checkout (NKILIB_SRC) or archive")
    pts = [{**p, "lnc": args.lnc} for p in nkilib_rows.read_points() if p["role"] in ("check", "context")]
    if args.family:
        pts = [p for p in pts if p["family"] in args.family]
    if args.table:
        pts = [p for p in pts if p["table"] in args.table]
    if args.points:
        pts = [p for p in pts if p["point"] in args.points]
    elif not args.all:
        done = read_out(args.out)
        pts = [p for p in pts if p["point"] not in done]
    pts = sorted((p for p in pts if size(p) <= args.max_size), key=size)
    for p in pts:
        if args.list:
            print(f"{p['point']:40s} {p['family']:14s} {size(p):.3g}  {shape_of(p)}")
            continue
        row = run_point(p, root)
        write_row(row, args.out)
        print(f"{row['point']}: {row['shape']} published {float(row['published_us']):.1f} us, "
              f"estimate {row['low_us']} / {row['mid_us']} / {row['high_us']} ({row['status']}, {row['trace_s']} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
