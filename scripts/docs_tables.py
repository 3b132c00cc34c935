"""Write the tables in README.md and docs/*.md that come from benchmark outputs (benchmarks/data/*.csv).

A generated table sits between two markers, the first naming its generator:

    <!-- generated: interp_speed -->
    ...table written by this script...
    <!-- end generated -->

    python scripts/docs_tables.py           # rewrite every generated region from the CSVs
    python scripts/docs_tables.py --check   # exit 1 and name the stale regions (tests/test_docs.py runs this)

Edit the CSV (by re-running its benchmark with --save-reference), never the table.

Figures quoted in running text are listed in QUOTES: the sentence as a template and the CSV cell that
fills it; the check fails when the filled sentence is not in the page (the figure or the CSV changed).
Without --check the script also rewrites the numbers of a stale quote in place when its sentence (the
template with any numbers) occurs exactly once in the page; otherwise it warns.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: use its trnkit

from trnkit.bench.paths import load_script  # noqa: E402
from trnkit.bench.schema import latest_rows, read_rows  # noqa: E402
from trnkit.bench.table import markdown_table  # noqa: E402

DATA = ROOT / "benchmarks" / "data"
SIDE_BY_SIDE = ROOT / "benchmarks" / "side_by_side.py"  # PEAK: TensorE's bf16 peak the side-by-sides use
REGION = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def read_csv(name: str) -> list[dict[str, str]]:
    with open(DATA / name, newline="") as f:
        return list(csv.DictReader(f))


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def interp_speed() -> str:
    """benchmarks/interp_speed.py: tiled matmul 2048^3 on the interpreter vs numpy."""
    rows = []
    for r in read_csv("interp_speed.csv"):
        rows.append([
            r["dtype"], f"{float(r['interp_s']):.2f} s", f"{float(r['interp_traced_s']):.2f} s",
            f"{float(r['interp_trace_only_s']):.2f} s", f"{float(r['instr_per_s']):,.0f}",
            f"{float(r['numpy_s']):.2f} s", f"**{float(r['ratio']):.1f}x**", f"{float(r['target_ratio']):.0f}x",
            r["timestamp"][:16],
        ])
    header = ["inputs", "interpreter", "traced", "trace-only", "instructions/s (traced)",
              "numpy fp32 `A.T @ B`", "ratio", "target", "measured (UTC)"]
    return _table(header, rows)


def _step_ms(row: dict[str, str]) -> str:
    """A qwen3_step.csv side's best step time; a side timed by one cold step says so."""
    cold = " (1 cold step)" if "cold" in row.get("reps", "") else ""
    return f"{float(row['best_ms']):,.0f}{cold}"


def qwen3_step() -> str:
    """benchmarks/qwen3_step.py: a full train step, trnkit's native Qwen3 vs transformers (min of the timed steps)."""
    by_case: dict[tuple[str, ...], dict[str, dict[str, str]]] = {}
    for r in read_csv("qwen3_step.csv"):
        key = (r["flavor"], r["dtype"], r["batch"], r["seq"], r["vocab_size"], r["deterministic"])
        by_case.setdefault(key, {})[r["impl"]] = r
    rows = []
    for (flavor, dtype, batch, seq, vocab, det), impls in sorted(by_case.items(), key=lambda kv: (
            int(kv[0][3]), kv[0][0], kv[0][1] != "float32", kv[0][5])):
        ours = impls.pop("trnkit")
        fastest = min(impls.values(), key=lambda r: float(r["best_ms"]))
        theirs = ", ".join(f"{name.removeprefix('transformers[').rstrip(']')} {_step_ms(r)}"
                           for name, r in impls.items())
        rows.append([f"`{flavor}`", dtype, f"{batch}×{seq}", f"{int(vocab):,}", det, _step_ms(ours),
                     theirs, f"**{float(ours['speedup']):.2f}×** (median {float(ours['speedup_median']):.2f}×)",
                     f"{float(ours['peak_mib']):,.0f} / {float(fastest['peak_mib']):,.0f}",
                     f"**{float(ours['memory_ratio']):.2f}×**", f"{float(ours['loss_step1']):.4f}",
                     f"{float(fastest['max_loss_diff']):.1e}"])
    header = ["flavor", "dtype", "batch×seq", "vocab", "deterministic", "trnkit ms",
              "transformers ms (per experts backend)", "speed-up vs fastest", "step peak MiB (trnkit / transformers)",
              "memory", "loss step 1", "max loss diff"]
    return _table(header, rows)


# (kernel, mode, x_name, x_value) of the headline rows in docs/benchmarks.md (all bf16, the full sweeps)
HEADLINE = (
    ("rope_hf", "forward", "S", 2048), ("rope_hf", "backward", "S", 2048),
    ("rope_hf", "forward", "flavor", "235B-A22B"),
    ("router_topk", "forward", "T", 2048), ("router_topk", "backward", "T", 2048),
    ("router_topk", "forward", "flavor", "235B-A22B"), ("moe_experts", "forward", "T", 512),
    ("moe_experts", "backward", "T", 512), ("grouped_mm", "forward", "M", 4096), ("grouped_mm", "backward", "M", 4096),
    ("matmul_tiled", "forward", "M=N=K", 2048),
)


def bench_headline() -> str:
    """python -m trnkit.bench --save-reference: one line per headline shape (trnkit.bench's own table)."""
    rows = [r for r in latest_rows(read_rows(DATA / "bench.csv"))
            if (r.kernel, r.mode, r.x_name, r.x_value) in HEADLINE and r.config.get("dtype") == "bfloat16"]
    return markdown_table(rows) + "\n"


def moe_lnc() -> str:
    """moe_experts on one core vs a trn2 logical core (the ``E (LNC=n)`` sweeps of trnkit.bench, bf16):
    mid estimates [low-high end of the range]; the speed-up at mid."""
    est = {(r.mode, r.x_name, r.x_value): r for r in latest_rows(read_rows(DATA / "bench.csv"))
           if r.kernel == "moe_experts" and r.impl == "nki" and r.metric == "est_time"
           and r.x_name.startswith("E (LNC=") and r.config.get("dtype") == "bfloat16"}
    targets = {"forward": 1.6, "backward": 1.5}
    rows = []
    for mode, target in targets.items():
        for E in sorted({x for m, _, x in est if m == mode}):
            one, two = est[(mode, "E (LNC=1)", E)], est[(mode, "E (LNC=2)", E)]
            rows.append([mode, str(E), *(f"{r.p50:,.1f} [{r.p20:,.1f}-{r.p80:,.1f}]" for r in (one, two)),
                         f"**{one.p50 / two.p50:.2f}x**", f">= {target}x"])
    return _table(["moe_experts", "E", "LNC=1 (est. trn2, us)", "LNC=2 (est. trn2, us)", "speed-up (mid)", "target"],
                  rows)


def blockwise_moe() -> str:
    """benchmarks/blockwise_moe.py: trnkit's moe_experts forward vs a blockwise design (trn2 cost model)."""
    by = {(r["design"], r["E"], r["lnc"]): r for r in read_csv("blockwise_moe.csv")}
    rows = []
    for (design, E, lnc), bw in by.items():
        if design != "blockwise":
            continue
        tk = by[("trnkit", E, lnc)]
        t_tk, t_bw = float(tk["est_us"]), float(bw["est_us"])
        rows.append([E, lnc, f"{t_tk:,.1f} us ({float(tk['est_low_us']):,.0f}-{float(tk['est_high_us']):,.0f})",
                     f"{t_bw:,.1f} us ({float(bw['est_low_us']):,.0f}-{float(bw['est_high_us']):,.0f})",
                     f"**{t_bw / t_tk:.2f}x**", f"{int(bw['flops']) / int(tk['flops']):.2f}x",
                     f"{int(bw['hbm_bytes']) / int(tk['hbm_bytes']):.2f}x", f"{tk['bottleneck']} / {bw['bottleneck']}"])
    header = ["E", "LNC", "trnkit moe_experts (mid, range)", "blockwise (mid, range)", "blockwise / trnkit time",
              "FLOPs ratio", "HBM bytes ratio", "bottleneck (trnkit / blockwise)"]
    return _table(header, rows)


def _attention_pairs() -> list[tuple[dict[str, str], dict[str, str]]]:
    """attention_peak.csv's (trnkit row, nki-library row of the same pass and shape) pairs, in CSV order
    (each of trnkit's forward passes, "forward, ..." included, pairs with nki-library's "forward")."""
    by = {(r["kernel"], r["mode"], r["S"], r["Hq"], r["Hk"], r["lnc"]): r for r in read_csv("attention_peak.csv")}
    pairs = []
    for (kernel, mode, S, Hq, Hk, lnc), tk in by.items():
        aws = by.get(("nki-library", mode.split(",")[0], S, Hq, Hk, lnc))
        if kernel == "trnkit" and aws is not None:
            pairs.append((tk, aws))
    return pairs


def _peak_pairs(name: str, shape: tuple[str, ...], theirs: tuple[str, ...]) -> list[tuple[dict, dict]]:
    """(trnkit row, nki-library row) pairs of a side-by-side CSV: the same ``shape`` columns, a kernel of
    ``theirs``, neither refused (``error`` empty)."""
    by = {(r["kernel"], *(r[c] for c in shape)): r for r in read_csv(name) if not r.get("error")}
    return [(tk, by[(k, *key[1:])]) for key, tk in by.items() if key[0] == "trnkit"
            for k in theirs if (k, *key[1:]) in by]


def _min_max(label: str, values: Callable[[], list[float]], fmt: str = "{:.2f}"
             ) -> tuple[Callable[[], str], Callable[[], str]]:
    """The smallest and largest of ``values()`` (as ``fmt`` writes them); ``label`` names them in the error when
    there are none."""
    def found() -> list[float]:
        got = values()
        if not got:
            raise LookupError(f"{label}: no trnkit row with an nki-library partner")
        return got
    return (lambda: fmt.format(min(found()))), (lambda: fmt.format(max(found())))


def _ratio_range(label: str, pairs: Callable[[], list[tuple[dict, dict]]], column: str
                 ) -> tuple[Callable[[], str], Callable[[], str]]:
    """The smallest and largest trnkit / nki-library ``column`` ratio (e.g. est_us_mid, est_us_high) over
    ``pairs()``."""
    return _min_max(label, lambda: [float(tk[column]) / float(aws[column]) for tk, aws in pairs()])


def _attention_ratio_range(mode: str, column: str) -> tuple[Callable[[], str], Callable[[], str]]:
    """:func:`_ratio_range` over the attention_peak.csv shapes of trnkit's pass ``mode``."""
    return _ratio_range(f"attention_peak.csv {mode}",
                        lambda: [(tk, aws) for tk, aws in _attention_pairs() if tk["mode"] == mode], column)


def _attention_cell(column: str, mode: str, lnc: str, fmt: str = "{:.1f}", S: str = "4096", Hq: str = "8",
                    Hk: str = "2") -> Callable[[], str]:
    """:func:`csv_cell` of trnkit's row of pass ``mode`` in attention_peak.csv at one shape and LNC (default
    S = 4,096, 8 / 2 heads)."""
    return csv_cell("attention_peak.csv", column,
                    {"kernel": "trnkit", "mode": mode, "S": S, "Hq": Hq, "Hk": Hk, "lnc": lnc}, fmt)


def _attention_mid(mode: str, lnc: str, S: str = "4096", Hq: str = "8", Hk: str = "2") -> float:
    """trnkit's mid estimate (us) of pass ``mode`` in attention_peak.csv at one shape and LNC."""
    return float(_attention_cell("est_us_mid", mode, lnc, "{}", S, Hq, Hk)())


def _attention_frac(mode: str, lnc: str, end: str, Hq: str = "8", Hk: str = "2") -> Callable[[], str]:
    """trnkit's fraction of TensorE's peak (``end``: mid or pessimistic) of pass ``mode`` in attention_peak.csv
    at S = 4,096, one head count and LNC."""
    return _attention_cell(f"peak_frac_{end}", mode, lnc, "{:.1%}", Hq=Hq, Hk=Hk)


ATTENTION_EXACT = "forward, exact row max"  # attention_peak.csv's pass of the exact forward alone


def _fallback_cost(lnc: str) -> tuple[Callable[[], str], Callable[[], str]]:
    """The (fixed-shift) forward's fallback launch at 4096 / 8 / 2 heads: its mid (us) and its ratio to the
    exact forward's mid."""
    fallback = "forward, fallback"
    return (lambda: f"{_attention_mid(fallback, lnc):,.1f}",
            lambda: f"{_attention_mid(fallback, lnc) / _attention_mid(ATTENTION_EXACT, lnc):.2f}")


def attention_peak() -> str:
    """benchmarks/attention_peak.py: trnkit's flash attention vs nki-library's attention_cte / attention_bwd."""
    rows = []
    for tk, aws in _attention_pairs():
        S, Hq, Hk, lnc, mode = tk["S"], tk["Hq"], tk["Hk"], tk["lnc"], tk["mode"]
        cells = []
        for r in (tk, aws):
            cells += [f"{float(r['est_us_mid']):,.1f} us "
                      f"({float(r['est_us_low']):,.1f}–{float(r['est_us_high']):,.1f})",
                      f"{float(r['peak_frac_mid']):.1%} / {float(r['peak_frac_pessimistic']):.1%}"]
        ratio = [float(tk[c]) / float(aws[c]) for c in ("est_us_mid", "est_us_high")]
        rows.append([f"{int(S):,}", f"{Hq} / {Hk}", lnc, mode, *cells, f"{ratio[0]:.2f}x / {ratio[1]:.2f}x"])
    header = ["S", "query / kv heads", "LNC", "pass", "trnkit (mid, range)", "of peak (mid / pessimistic)",
              "nki-library (mid, range)", "of peak (mid / pessimistic)",
              "trnkit / nki-library time (mid / pessimistic)"]
    return _table(header, rows)


def mlp_peak() -> str:
    """benchmarks/mlp_peak.py: trnkit's dense MLP forward vs nki-library's mlp_cte (LNC=2)."""
    rows = read_csv("mlp_peak.csv")
    by = {(r["kernel"], r["case"], r["T"], r["H"], r["I"]): r for r in rows}

    def cells(r: dict | None) -> list[str]:
        if r is None:
            return ["", ""]
        if r["error"]:
            return [f"not served: {r['error']}", ""]
        return [f"{float(r['est_us_mid']):,.1f} us ({float(r['est_us_low']):,.1f}–{float(r['est_us_high']):,.1f})",
                f"{float(r['peak_frac_mid']):.1%} / {float(r['peak_frac_pessimistic']):.1%}"]

    body = []
    for (kernel, case, T, H, I), tk in by.items():  # noqa: E741
        if kernel != "trnkit":
            continue
        aws = by.get(("nki-library", case, T, H, I))
        ratio = ""
        if aws is not None and not aws["error"]:
            ratio = " / ".join(f"{float(tk[c]) / float(aws[c]):.2f}x" for c in ("est_us_mid", "est_us_high"))
        body.append([case, f"{int(T):,}", f"{int(H):,}", f"{int(I):,}", *cells(tk), *cells(aws), ratio])
    header = ["shape", "T", "H", "I", "trnkit (mid, range)", "of peak (mid / pessimistic)",
              "nki-library mlp_cte (mid, range)", "of peak (mid / pessimistic)",
              "trnkit / nki-library time (mid / pessimistic)"]
    return _table(header, body)


def _us_range(r: dict[str, str], prefix: str) -> str:
    """``mid us (low–high)`` of the ``{prefix}_mid / _low / _high`` columns (us)."""
    return (f"{float(r[prefix + '_mid']):,.1f} us "
            f"({float(r[prefix + '_low']):,.1f}–{float(r[prefix + '_high']):,.1f})")


def _ratio(num: dict[str, str], num_prefix: str, den: dict[str, str], den_prefix: str) -> str:
    """``mid / pessimistic`` time ratio of two ``{prefix}_mid / _high`` column sets."""
    return " / ".join(f"{float(num[num_prefix + end]) / float(den[den_prefix + end]):.2f}x"
                      for end in ("_mid", "_high"))


def _lce_rows() -> list[dict[str, str]]:
    """cross_entropy_peak.csv's rows per (case, schedule): forward, backward and "forward + backward" (each end
    summed over the two passes), each with ``schedule`` and the same job's ``job_mid / _low / _high`` (nki-library's
    kernel plus the lm_head matmul bound), fused schedule first."""
    ends = ("_mid", "_low", "_high")
    by: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
    for r in read_csv("cross_entropy_peak.csv"):
        by.setdefault((r["case"], r["schedule"]), {})[r["mode"]] = r
    out = []
    for case, schedule in sorted(by, key=lambda k: (k[0], k[1] != "fused")):
        passes = by[(case, schedule)]
        both = {"case": case, "mode": "forward + backward", **{k: passes["forward"][k] for k in ("N", "H", "V")}}
        for col in ("trnkit_us", "nkilib_us"):
            for end in ends:
                both[col + end] = str(sum(float(passes[m][col + end]) for m in ("forward", "backward")))
        both["matmul_bound_us"] = str(sum(float(passes[m]["matmul_bound_us"]) for m in ("forward", "backward")))
        for r in (passes["forward"], passes["backward"], both):
            mm = float(r["matmul_bound_us"])
            out.append({**r, "schedule": schedule, **{f"job{end}": str(float(r["nkilib_us" + end]) + mm)
                                                        for end in ends}})
    return out


def _lce_passes(case: str, schedule: str, mode: str) -> dict[str, dict[str, str]]:
    """:func:`_lce_rows`' rows of one case and schedule by pass (``mode`` must be among them)."""
    rows = {r["mode"]: r for r in _lce_rows() if (r["case"], r["schedule"]) == (case, schedule)}
    if mode not in rows:
        raise LookupError(f"cross_entropy_peak.csv: no {case} {schedule} {mode} row")
    return rows


def _lce_job_ratio(case: str, schedule: str, mode: str, end: str) -> Callable[[], str]:
    """trnkit / the same job's time of one cross_entropy_peak row at ``end`` (_mid, _high)."""
    def value() -> str:
        r = _lce_passes(case, schedule, mode)[mode]
        return f"{float(r['trnkit_us' + end]) / float(r['job' + end]):.2f}"
    return value


def _lce_over(case: str, schedule: str, mode: str, over: str) -> Callable[[], str]:
    """How far trnkit's mid of one cross_entropy_peak row is over ``over`` (a percentage): ``"bound"``, the
    ``6 N H V`` TensorE bound (the lm_head and gradient matmuls, forward + backward), or ``"mid"`` (the row's
    pessimistic end over its mid)."""
    def value() -> str:
        rows = _lce_passes(case, schedule, mode)
        if over == "mid":
            return f"{float(rows[mode]['trnkit_us_high']) / float(rows[mode]['trnkit_us_mid']) - 1:.1%}"
        bound = float(rows["forward + backward"]["matmul_bound_us"])
        return f"{float(rows[mode]['trnkit_us_mid']) / bound - 1:.1%}"
    return value


def _lce_fused_fraction(case: str, end: str) -> Callable[[], str]:
    """The one-pass kernel's forward at ``end`` (_mid, _high) as a fraction of its ``6 N H V`` TensorE bound (the
    lm_head and gradient matmuls' bound, forward + backward) in cross_entropy_peak.csv."""
    def value() -> str:
        rows = _lce_passes(case, "fused", "forward")
        return f"{float(rows['forward + backward']['matmul_bound_us']) / float(rows['forward']['trnkit_us' + end]):.1%}"
    return value


def _lce_job_ratio_range(schedule: str, mode: str) -> tuple[Callable[[], str], Callable[[], str]]:
    """The smallest and largest trnkit / same-job ratio of ``schedule``'s ``mode`` rows, over cases and both ends."""
    return _min_max(f"cross_entropy_peak.csv {schedule} {mode}", lambda: [
        float(r["trnkit_us" + end]) / float(r["job" + end]) for r in _lce_rows()
        if (r["schedule"], r["mode"]) == (schedule, mode) for end in ("_mid", "_high")])


def cross_entropy_peak() -> str:
    """benchmarks/cross_entropy_peak.py: trnkit's fused linear cross-entropy (both schedules) vs nki-library's
    cross_entropy (LNC=2), per pass and forward + backward (each end of the range summed over the two passes)."""
    body = []
    for r in _lce_rows():
        mm = float(r["matmul_bound_us"])
        bold = "**" if r["mode"] == "forward + backward" else ""
        body.append([r["case"], f"{int(r['N']):,}", f"{int(r['H']):,}", f"{int(r['V']):,}", r["schedule"], r["mode"],
                     _us_range(r, "trnkit_us"), _us_range(r, "nkilib_us"), f"{mm:,.1f} us", _us_range(r, "job"),
                     _ratio(r, "trnkit_us", r, "nkilib_us"), f"{bold}{_ratio(r, 'trnkit_us', r, 'job')}{bold}"])
    header = ["shape", "N", "H", "V", "trnkit schedule", "pass", "trnkit (mid, range)",
              "nki-library kernel alone (mid, range)", "+ lm_head matmul bound", "nki-library same job (mid, range)",
              "trnkit / kernel alone (mid / pessimistic)", "trnkit / same job (mid / pessimistic)"]
    return _table(header, body)


def _short_error(message: str) -> str:
    """A kernel's refusal as the rule and the value: no exception class, no advice, no reason after the rule."""
    message = message.split(": ", 1)[-1]
    message = re.sub(r"^\[INTERNAL_ERROR\] \[\w+\] Kernel validation exception: ", "", message)
    message = re.sub(r"\): .*", ")", message.split(" - Please")[0])
    return message.replace("|", "/")


def rmsnorm_peak() -> str:
    """benchmarks/rmsnorm_peak.py: trnkit's RMSNorm forward vs nki-library's rmsnorm_tkg and rmsnorm_quant (LNC=2)."""
    by: dict[tuple[str, ...], dict[str, dict[str, str]]] = {}
    for r in read_csv("rmsnorm_peak.csv"):
        by.setdefault((r["case"], r["B"], r["S"], r["H"]), {})[r["kernel"]] = r

    def cell(r: dict[str, str] | None) -> str:
        if r is None:
            return ""
        if r["error"]:
            return "not served: " + _short_error(r["error"])
        return (f"{float(r['est_us_mid']):,.1f} us ({float(r['est_us_low']):,.1f}–{float(r['est_us_high']):,.1f}), "
                f"{float(r['bound_frac_mid']):.0%} / {float(r['bound_frac_pessimistic']):.0%}")

    def ratio(ours: dict[str, str], theirs: dict[str, str] | None) -> str:
        if theirs is None or ours["error"] or theirs["error"]:
            return ""
        return _ratio(ours, "est_us", theirs, "est_us")

    body = []
    for (case, B, S, H), k in by.items():
        ours, tkg, quant = k["trnkit"], k.get("nki-library rmsnorm_tkg"), k.get("nki-library rmsnorm_quant")
        body.append([case, f"[{B}, {int(S):,}, {int(H):,}]", cell(ours), cell(tkg), cell(quant), ratio(ours, tkg),
                     ratio(ours, quant)])
    header = ["shape", "x [B, S, H]", "trnkit rmsnorm: mid (range), of bound mid / pessimistic",
              "nki-library rmsnorm_tkg", "nki-library rmsnorm_quant (row fp8)",
              "trnkit / rmsnorm_tkg time (mid / pessimistic)", "trnkit / rmsnorm_quant time (mid / pessimistic)"]
    return _table(header, body)


def loss_track() -> str:
    """benchmarks/loss_track.py: the all-kernels configs against the reference path, per config over all steps."""
    rows = read_csv("loss_track.csv")
    body = []
    for r in rows:
        if r["step"] != "max":
            continue
        steps = [s for s in rows if s["config"] == r["config"] and s["step"] != "max"]
        first, last = steps[0], steps[-1]
        refused = [s["step"] for s in steps if s["control_within"] == "False"]
        body.append([f"`{r['config']}`", str(len(steps)), r["dtype"],
                     f"{float(first['loss_reference']):.4f} → {float(last['loss_reference']):.4f}",
                     f"{float(first['loss_nki']):.4f} → {float(last['loss_nki']):.4f}",
                     f"{float(r['abs_diff']):.1e}", f"**{float(r['rel_diff']):.1e}**",
                     f"{float(r['rel_diff_reordered']):.1e}", f"{float(r['rel_diff_impls']):.1e}",
                     f"{float(r['rel_diff_threads']):.1e}", f"{float(r['rtol']):.1e}",
                     "yes" if r["within"] == "True" else "**no**",
                     f"`{r['control_op']}`: " + (f"refused at step {refused[0]} ({len(refused)} of {len(steps)} steps)"
                                                 if refused else "**not refused**")])
    header = ["config", "steps", "dtype", "loss, reference (step 1 → last)", "loss, all kernels (step 1 → last)",
              "max abs diff", "max rel diff", "witness: reordered reference, max rel diff",
              "witness: reference impls, max rel diff", "witness: reference on other threads, max rel diff",
              "tolerance at the closest step (rel)", "within", "control (that op's output in bf16)"]
    return _table(header, body)


def conformance() -> str:
    """python -m trnkit conformance --save-reference: AWS nki-library kernels on the interpreter."""
    rows = read_csv("conformance.csv")
    passed = sum(r["result"] == "PASS" for r in rows)
    others = collections.Counter(r["result"] for r in rows if r["result"] != "PASS")
    commits = ", ".join(sorted({r["nkilib_commit"] for r in rows}))
    body = [[r["kernel"].removeprefix("core/"), r["case"], r["lnc"], r["shapes"], f"**{r['result']}**",
             f"{r['max_abs_err']} / {r['allowed_err']}" if r["max_abs_err"] else "", r["seconds"],
             re.sub(r"\S*/nkilib_src/nkilib/", "", r["message"]).replace("|", "/")[:160]] for r in rows]
    header = ["kernel (core/ unless named)", "case", "LNC", "shapes", "result", "max abs err / allowed",
              "interpreter s", "message"]
    rest = "".join(f", {n} {result}" for result, n in sorted(others.items()))
    return f"{passed} of {len(rows)} cases pass{rest} (nki-library commit {commits}).\n\n" + _table(header, body)


# the model-config tier at nki-library d2ad3a5 per kernel: its cases and its flag combinations (case names without
# " model_config <type>") (tests/conformance/test_model_config.py checks them against the checkout)
MODEL_CONFIG_TABLES = {"core/mlp/mlp_tkg": (342, 3), "core/qkv/qkv_cte": (81, 1), "core/moe/moe_tkg": (308, 1),
                       "core/moe_block/moe_block_tkg": (320, 4),
                       "experimental/transformer/attention_block_tkg": (2724, 88)}


def _reduced(r: dict[str, str]) -> bool:
    """A reduced model-config row (trnkit.conformance.reduce: token counts reduced for CPU time, both shapes in its
    shapes): counted apart from the tier's full rows."""
    return " reduced model_config" in r["case"]


def conformance_model_config() -> str:
    """The rows of the tests' model-config tables in conformance.csv, per kernel: how many ran of the tier's cases and
    their results (a SKIPPED row, which nki-library's test skips, with how it ran), the flag combinations with a row
    recorded, and the largest shape that passed (by the product of its sizes); then the reduced rows run (token counts
    reduced for CPU time) and their results, apart."""
    every = [r for r in read_csv("conformance.csv") if re.search(r" model_config( \w+)?$", r["case"])]
    rows = [r for r in every if not _reduced(r)]
    body = []
    for kernel, (n_cases, n_paths) in MODEL_CONFIG_TABLES.items():
        mine = [r for r in rows if r["kernel"] == kernel]
        red = collections.Counter(r["result"] for r in every if r["kernel"] == kernel and _reduced(r))
        results = collections.Counter(r["result"] for r in mine)
        verdicts = collections.Counter(_run_anyway(r) for r in mine if r["result"] == "SKIPPED")
        size = lambda r: math.prod(int(v) for v in re.findall(r"=(\d+)", r["shapes"]))  # noqa: E731
        passed = [r for r in mine if r["result"] == "PASS"]
        largest = max(passed, key=size)["shapes"] if passed else "-"
        paths = len({re.sub(r" model_config( \w+)?$", "", r["case"]) for r in mine})
        counts = [f"{n} {k}" + (f" (run anyway: {', '.join(f'{m} {v}' for v, m in sorted(verdicts.items()))})"
                                  if k == "SKIPPED" else "") for k, n in sorted(results.items())]
        body.append([kernel.removeprefix("core/"), f"{len(mine)} of {n_cases}", ", ".join(counts) or "-",
                     f"{paths} of {n_paths}", largest,
                     f"{sum(red.values())}: " + ", ".join(f"{n} {k}" for k, n in sorted(red.items())) if red else "-"])
    unknown = {r["kernel"] for r in every} - set(MODEL_CONFIG_TABLES)
    if unknown:
        raise ValueError(f"conformance.csv: model-config rows of kernels not in MODEL_CONFIG_TABLES: {sorted(unknown)}")
    return _table(["kernel", "rows run (of the tier's cases)", "results", "flag combinations run",
                   "largest shape passed", "reduced rows run (apart)"], body)


# the case-name label of each table of test_attention_cte.py / test_attention_bwd.py (cases_attention) and its rows
# at nki-library d2ad3a5 (tests/conformance/test_attention_cases.py checks them against the checkout)
ATTENTION_TABLES = {
    "core/attention/attention_cte": {
        "no_cp": ("test_attention_cte_no_cp_unit", 17), "apc": ("..._no_cp_vnc_apc_klr_unit (prefix caching)", 40),
        "vnc": ("..._no_cp_vnc_unit (45 cases: a row repeats another)", 46), "gqa": ("..._no_cp_vnc_gqa_unit", 22),
        "barometer": ("..._no_cp_vnc_barometer_unit", 8), "cp_apc": ("..._cp_apc_klr_unit x 2 Q slicings", 26),
        "cp_bk": ("..._cp_bk_klr_unit x 2", 42), "cp_gqa": ("..._cp_gqa_klr_unit x 2", 34),
        "cp_barometer": ("..._cp_barometer_klr_unit x 2", 10),
        "sweep_nocp_manual": ("test_ranged_attn_cte_sweep_nocp_manual", 12),
        "sweep_cp_manual": ("test_ranged_attn_cte_sweep_cp_manual x LNC 2 x slicing 2 x cache 2", 72),
        "seq_pack": ("test_attention_cte_seq_pack_unit", 15)},
    "core/attention/attention_bwd": {
        "fast": ("test_attention_bwd_fast (32 base, 4 negative)", 36),
        "full": ("test_attention_bwd (model configs)", 27),
        "packed": ("test_attention_bwd_sequence_packing", 24)},
}


def conformance_attention() -> str:
    """attention_cte's and attention_bwd's test tables: rows, cases recorded in conformance.csv and their results, the
    longest interpreter time among them."""
    rows = read_csv("conformance.csv")
    body = []
    for kernel, tables in ATTENTION_TABLES.items():
        for label, (test, n) in tables.items():
            mine = [r for r in rows if r["kernel"] == kernel and r["case"].split(" ")[0] == label]
            results = collections.Counter(r["result"] for r in mine)
            slowest = max(mine, key=lambda r: float(r["seconds"] or 0), default=None)
            body.append([kernel.removeprefix("core/attention/"), f"`{label}`", test, str(n), str(len(mine)),
                         ", ".join(f"{k} {v}" for k, v in sorted(results.items())) or "-",
                         f"{float(slowest['seconds']):.0f} s ({slowest['shapes']})" if slowest else "-"])
    return _table(["kernel", "case label", "test (table)", "rows", "recorded", "results", "longest (interpreter)"],
                  body)


def conformance_unit_by_kernel() -> str:
    """The unit tier's rows recorded in conformance.csv per kernel (the rows of model-config tables apart) and their
    results: set against the cases each family has (docs/interpreter.md's table above it), the rows not yet run."""
    rows = [r for r in read_csv("conformance.csv") if not re.search(r" model_config( \w+)?$", r["case"])]
    by_kernel: dict[str, list[dict[str, str]]] = collections.defaultdict(list)
    for r in rows:
        by_kernel[r["kernel"]].append(r)
    body = [[kernel.removeprefix("core/"), str(len(mine)),
             ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(r["result"] for r in mine).items()))]
            for kernel, mine in by_kernel.items()]
    return _table(["kernel (core/ unless named)", "rows recorded", "results"], body)


def _run_anyway(r: dict[str, str]) -> str:
    """How a SKIPPED conformance row ran: the result its message starts with (``run anyway: PASS; ...``)."""
    m = re.match(r"run anyway: ([A-Z]+( API)?)", r["message"])
    if m is None:
        raise ValueError(f"conformance.csv: SKIPPED row {r['kernel']} {r['case']} {r['shapes']} does not say how "
                         "it ran")
    return m.group(1)


HEADLINE_CSV = "headline.csv"  # benchmarks/headline.py: one row per case, low / mid / high
SENSITIVITY_CSV = "headline_sensitivity.csv"  # the same: one row per headline case and parameter
MODE = {"forward": "fwd", "backward": "bwd"}


def _triple(r: dict[str, str], columns: tuple[str, str, str], fmt: str) -> str:
    return " / ".join(fmt.format(float(r[c])) for c in columns)


def _times(r: dict[str, str]) -> str:
    return _triple(r, ("low_us", "mid_us", "high_us"), "{:,.1f}")


def _fractions(r: dict[str, str]) -> str:
    return _triple(r, ("fraction_low_end", "fraction_mid", "fraction_high_end"), "{:.1%}")


def headline() -> str:
    """benchmarks/headline.py: every case's time and fraction of its bound as a range (low / mid / high =
    the optimistic / mid / pessimistic settings of trnkit.nkisim.cost_params) and its top parameters."""
    rows = [[f"`{r['case']}`", f"{r['kernel']} {MODE[r['mode']]} {r['shape']}",
             f"{float(r['bound_us']):,.1f} us ({r['bound_kind']})", _times(r), _fractions(r),
             r["top_sensitivity"] or "-"] for r in read_csv(HEADLINE_CSV)]
    header = ["case", "kernel, shape", "bound", "time low / mid / high (us)", "of bound at low end / mid / high end",
              "most sensitive parameters (us at optimistic..pessimistic)"]
    return _table(header, rows)


def headline_for(*kernels: str) -> Callable[[], str]:
    """The headline cases of ``kernels`` (docs/kernels.md): range, bound, busiest engines at mid."""
    def table() -> str:
        rows = [[f"{r['kernel']} {MODE[r['mode']]}, {r['shape']}", _times(r), f"{float(r['bound_us']):,.1f}",
                 _fractions(r), r["busiest_mid_us"], f"`{r['case']}`"]
                for r in read_csv(HEADLINE_CSV) if r["kernel"] in kernels]
        header = ["case", "est. time low / mid / high (us)", "bound (us)", "of bound at low end / mid / high end",
                  "busiest engines at mid (busy us)", "`headline.py` case"]
        return _table(header, rows)
    return table


def _span(by_case: dict[str, dict[str, str]], case: str, columns: tuple[str, str, str]) -> str:
    """``low..high (mid)`` of a headline.csv case."""
    r = by_case.get(case)
    if r is None:
        return "-"
    low, mid, high = (float(r[c]) for c in columns)
    return f"{low:,.0f}..{high:,.0f} (mid {mid:,.0f})"


def headline_sensitivity() -> str:
    """benchmarks/headline.py: per headline case, the time with one parameter at its optimistic and at its
    pessimistic value (the rest at mid); the parameter that moves a case most is in bold."""
    rows = read_csv(SENSITIVITY_CSV)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["case"], r["parameter"]): r for r in rows}
    swing = {c: max(float(r["pessimistic_us"]) - float(r["optimistic_us"]) for r in rows if r["case"] == c)
             for c in cases}
    by_case = {r["case"]: r for r in read_csv(HEADLINE_CSV)}
    body = [["**all at once** (the range)", "optimistic / mid / pessimistic",
             *(_span(by_case, c, ("low_us", "mid_us", "high_us")) for c in cases)]]
    for param in dict.fromkeys(r["parameter"] for r in rows):
        any_row = next(r for r in rows if r["parameter"] == param)
        line = [f"`{param}`", " / ".join(any_row[k] for k in ("optimistic_value", "mid_value", "pessimistic_value"))]
        for c in cases:
            r = cell.get((c, param))
            if r is None:
                line.append("-")
                continue
            lo, hi = float(r["optimistic_us"]), float(r["pessimistic_us"])
            text = f"{lo:,.0f}..{hi:,.0f}"
            line.append(f"**{text}**" if hi - lo == swing[c] and swing[c] > 0 else text)
        body.append(line)
    header = ["parameter", "optimistic / mid / pessimistic value", *(f"`{c}` (us)" for c in cases)]
    return _table(header, body)


# (case, which end of its range, target fraction of its bound, where the target comes from)
PESSIMISTIC, FIRST = "pessimistic-end targets", "first kernel targets"
TARGETS = (("rope_fwd", "low_end", 0.70, PESSIMISTIC), ("rope_bwd", "low_end", 0.70, PESSIMISTIC),
           ("router_fwd", "low_end", 0.70, PESSIMISTIC), ("moe_fwd", "low_end", 0.70, PESSIMISTIC),
           ("moe_bwd", "mid", 0.50, f"{PESSIMISTIC} (useful FLOPs)"), ("rope_fwd", "mid", 0.80, FIRST),
           ("router_fwd", "mid", 0.80, FIRST), ("moe_fwd", "mid", 0.75, FIRST))


def headline_targets() -> str:
    """The kernel targets against headline.csv: met when the fraction of the bound at the named end of
    the range reaches the target."""
    by_case = {r["case"]: r for r in read_csv(HEADLINE_CSV)}
    rows = []
    for case, end, target, source in TARGETS:
        r = by_case.get(case)
        where = {"low_end": "at the low end (pessimistic)", "mid": "at mid"}[end]
        if r is None:
            rows.append([f"`{case}`", f">= {target:.0%} {where}", "not estimated", "-", source])
            continue
        value = float(r[f"fraction_{end}"])
        rows.append([f"`{case}`", f">= {target:.0%} {where}", f"{value:.1%} ({_fractions(r)})",
                     "**yes**" if value >= target else "**no**", source])
    return _table(["case", "target (fraction of bound)", "figure (low end / mid / high end)", "met?", "target from"],
                  rows)


CALIBRATION_CSV = ROOT / "benchmarks" / "calibration" / "calibration.csv"


def calibration_markdown(rows: list[dict[str, str]]) -> str:
    """The calibration table from benchmarks/calibration/calibration.csv rows (newest row per point, in
    the CSV's order of first appearance): published figure vs the model's low / mid / high estimate."""
    latest: dict[str, dict[str, str]] = {}
    for r in rows:
        latest.pop(r["name"], None)
        latest[r["name"]] = r
    body = []
    for r in latest.values():
        pub, lo, mid, hi = (float(r[k]) for k in ("published", "low", "mid", "high"))
        err = float(r["error_mid"])
        body.append([r["name"], r["shape"], r["device"], f"{pub:g} {r['unit']}", f"{lo:.3g} / {mid:.3g} / {hi:.3g}",
                     f"{err:+.1%}", f"±{float(r['tolerance']):.0%}", "yes" if lo <= pub <= hi else "no", r["role"],
                     r["constrains"], r["source"].replace("|", "/")])
    header = ["point", "shape", "device", "published", "estimate low / mid / high", "error (mid)", "tolerance",
              "published within range", "role", "constrains", "source (version, quote)"]
    return _table(header, body)


def _latest_calibration_rows() -> dict[str, dict[str, str]]:
    with open(CALIBRATION_CSV, newline="") as f:
        return {r["name"]: r for r in csv.DictReader(f)}  # newest row per point


def calibration() -> str:
    """benchmarks/calibration/run.py: published NKI kernel device figures vs the cost model."""
    with open(CALIBRATION_CSV, newline="") as f:
        return calibration_markdown(list(csv.DictReader(f)))


def plan_check() -> str:
    """benchmarks/plan_check.py: the memory planner against the measured CPU peak and torchtitan's MemTracker."""
    rows = read_csv("plan_check.csv")
    body = [[r["case"], f"{float(r['plan_gib']):.3f}", r["peak_phase"], f"{float(r['measured_gib']):.3f}",
             f"**{float(r['plan_error']):+.1%}**", f"{float(r['torchtitan_gib']):.3f}",
             f"{float(r['torchtitan_error']):+.1%}"] for r in rows]
    header = ["case (3 steps, one process)", "plan GiB", "plan's peak", "measured peak GiB", "plan error",
              "MemTracker GiB", "MemTracker error"]
    return _table(header, body)


def plan_layouts() -> str:
    """python -m trnkit.harness.plan --config qwen3_30b_a3b --layouts 64x1,32x2,16x4,8x8: with the config's
    activation checkpointing ("full"), then without it (``--activation-checkpointing none``)."""
    from trnkit.harness.config import load_config  # the planner itself, not a CSV
    from trnkit.harness.plan import layouts_table, parse_layouts, plan
    from trnkit.packaged import resolve_config

    out = []
    for ac in ("full", "none"):
        plans = []
        for dp, tp in parse_layouts("64x1,32x2,16x4,8x8"):
            cfg = load_config(resolve_config("qwen3_30b_a3b"), [  # TP needs every rank to init the full model
                "--parallelism.data_parallel_shard_degree", str(dp), "--parallelism.tensor_parallel_degree", str(tp),
                "--parallelism.replicated_init", "true"])
            plans.append(plan(cfg, dp * tp, "trn2", activation_checkpointing=ac))
        lines = layouts_table(plans).splitlines()
        title = ('as the trainer runs it (the config\'s `training.activation_checkpointing = "full"`)' if ac == "full"
                 else "what-if: without activation checkpointing (`--activation-checkpointing none`)")
        out += [f"{title}:", "", *lines[1:-1], ""]
    return "\n".join(out[:-1])


def calibration_changes_rows(rows: dict[str, dict[str, str]]) -> list[dict]:
    """Each published version-to-version change (benchmarks/calibration/changes.csv) with the model's:
    published and predicted relative change of the mid estimate, right direction, within half its size."""
    with open(CALIBRATION_CSV.parent / "changes.csv", newline="") as f:
        changes = list(csv.DictReader(f))
    out = []
    for c in changes:
        b, a = rows[c["before"]], rows[c["after"]]
        pub = float(a["published"]) / float(b["published"]) - 1
        pred = float(a["mid"]) / float(b["mid"]) - 1
        out.append({"before": c["before"], "after": c["after"], "why": c["why"], "published": pub,
                    "predicted": pred, "direction": (pub > 0) == (pred > 0),
                    "within_half": abs(pred - pub) <= 0.5 * abs(pub)})
    return out


def predicted_change(before: str, after: str) -> Callable[[], str]:
    """The model's predicted change (mid) from calibration point ``before`` to ``after``, as "+0.25 %"."""
    def value() -> str:
        row = next((r for r in calibration_changes_rows(_latest_calibration_rows())
                    if (r["before"], r["after"]) == (before, after)), None)
        if row is None:
            raise LookupError(f"changes.csv: no change {before} -> {after}")
        return f"{100 * row['predicted']:+.2f} %"
    return value


def calibration_changes() -> str:
    """The published version-to-version changes and the model's prediction of each."""
    body = [[f"{r['before']} -> {r['after']}", r["why"], f"{r['published']:+.1%}", f"{r['predicted']:+.1%}",
             "yes" if r["direction"] else "no", "yes" if r["within_half"] else "no"]
            for r in calibration_changes_rows(_latest_calibration_rows())]
    return _table(["change", "what changed", "published", "predicted (mid)", "right direction",
                   "within half its size"], body)


def calibration_summary() -> str:
    """Per role: points, how many within their tolerance at mid and inside low..high, the largest |error|."""
    rows = _latest_calibration_rows().values()
    body = []
    for role in ("fit", "check", "context"):
        rs = [r for r in rows if r["role"] == role]
        if not rs:
            continue
        errs = [abs(float(r["error_mid"])) for r in rs]
        inside = sum(float(r["low"]) <= float(r["published"]) <= float(r["high"]) for r in rs)
        within = sum(e <= float(r["tolerance"]) for e, r in zip(errs, rs))
        worst = max(rs, key=lambda r: abs(float(r["error_mid"])))
        body.append([role, str(len(rs)), f"{within} / {len(rs)}", f"{inside} / {len(rs)}",
                     f"{max(errs):.1%} ({worst['name']})"])
    return _table(["role", "points", "within tolerance (mid)", "published inside low..high",
                   "largest error (mid)"], body)


def calibration_checks_outside() -> str:
    """The check points whose published figure is outside the model's low..high, each with its figures."""
    out = [f"`{r['name']}` ({float(r['published']):g} {r['unit']} published, "
           f"{float(r['low']):.3g} / {float(r['mid']):.3g} / {float(r['high']):.3g} {r['unit']} estimated)"
           for r in _latest_calibration_rows().values()
           if r["role"] == "check" and not float(r["low"]) <= float(r["published"]) <= float(r["high"])]
    return "; ".join(out) or "none"


NKILIB_CSV = CALIBRATION_CSV.parent / "nkilib_calibration.csv"


def _nkilib_points(role: str | None = None) -> list[dict[str, str]]:
    """benchmarks/calibration/nkilib_points.csv (nki-library's recorded rows and their fit / check role), in its
    order; with ``role``, only the points of that role."""
    with open(CALIBRATION_CSV.parent / "nkilib_points.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if role is None or r["role"] == role]


def _nkilib_rows() -> list[dict[str, str]]:
    """benchmarks/calibration/nkilib_calibration.csv (nkilib_run.py), in nkilib_points.csv's order."""
    if not NKILIB_CSV.exists():
        return []
    with open(NKILIB_CSV, newline="") as f:
        got = {r["point"]: r for r in csv.DictReader(f)}
    return [got[r["point"]] for r in _nkilib_points() if r["point"] in got]


def calibration_nkilib_summary() -> str:
    """nki-library's recorded device times vs the cost model, per family and LNC: the check points estimated, the
    median and mean |error| of the mid estimate, how many within +-20 % and inside low..high."""
    points = _nkilib_points("check")
    fields = {r["point"]: json.loads(r["fields"]) for r in points}
    lnc = {p: str(f.get("vnc_degree") or f.get("lnc_degree") or 2) for p, f in fields.items()}
    ran = {r["point"]: r for r in _nkilib_rows() if r["role"] == "check" and r["status"] == "ok"}
    body = []
    for fam in dict.fromkeys(r["family"] for r in points):
        for n in sorted({lnc[r["point"]] for r in points if r["family"] == fam}):
            pts = [r["point"] for r in points if r["family"] == fam and lnc[r["point"]] == n]
            rs = [ran[p] for p in pts if p in ran]
            if not rs:
                body.append([fam, n, f"0 / {len(pts)}", "—", "—", "—", "—", "—"])
                continue
            errs = [float(r["error_mid"]) for r in rs]
            med = statistics.median(errs)
            dmed = statistics.median(float(r["published_us"]) - float(r["mid_us"]) for r in rs)
            worst = max(rs, key=lambda r: abs(float(r["error_mid"])))
            body.append([fam, n, f"{len(rs)} / {len(pts)}", f"{med:+.1%}", f"{dmed:+.1f}",
                         f"{sum(abs(e) for e in errs) / len(errs):.1%}",
                         f"{sum(abs(e) <= 0.2 for e in errs)} / {len(rs)}",
                         f"{sum(r['inside'] == 'yes' for r in rs)} / {len(rs)}",
                         f"{float(worst['error_mid']):+.1%} ({worst['point'].removeprefix('nkilib ')})"])
    return _table(["family", "LNC", "check points estimated", "median error (mid)", "median published - mid (us)",
                   "mean abs error", "within +-20 %", "published inside low..high", "largest error"],
                  [r if len(r) == 9 else r + ["—"] for r in body])


def calibration_nkilib_launch() -> str:
    """The estimated nki-library check points per family and LNC, the kernel's own estimate (kernel_*_us: its
    instructions in the standalone launch's HBM condition, without the start-up) against the standalone launch the
    figure is of (low / mid / high_us: with
    cost_params.STANDALONE_LAUNCH): median error of the mid, within +-20 %, published inside low..high."""
    rows = [r for r in _nkilib_rows() if r["role"] == "check" and r["status"] == "ok"]

    def stats(rs: list[dict], prefix: str) -> list[str]:
        pub = [float(r["published_us"]) for r in rs]
        lo, mid, hi = ([float(r[f"{prefix}{k}_us"]) for r in rs] for k in ("low", "mid", "high"))
        errs = [m / p - 1 for m, p in zip(mid, pub)]
        return [f"{statistics.median(errs):+.1%}", f"{sum(abs(e) <= 0.2 for e in errs)}",
                f"{sum(a <= p <= b for a, p, b in zip(lo, pub, hi))}"]

    body = []
    for fam in dict.fromkeys(r["family"] for r in rows):
        for n in sorted({r["lnc"] for r in rows if r["family"] == fam}):
            rs = [r for r in rows if r["family"] == fam and r["lnc"] == n]
            body.append([fam, n, str(len(rs)), *stats(rs, "kernel_"), *stats(rs, "")])
    if rows:
        body.append(["all", "1, 2", str(len(rows)), *stats(rows, "kernel_"), *stats(rows, "")])
    return _table(["family", "LNC", "check points", "kernel only: median error (mid)", "within +-20 %",
                   "inside low..high", "standalone launch: median error (mid)", "within +-20 %",
                   "inside low..high"], body)


NKILIB_BINS = ((0, 60), (60, 100), (100, 200), (200, 500), (500, 2000), (2000, math.inf))  # recorded time, us


def calibration_nkilib_by_time() -> str:
    """The estimated nki-library check points per family, LNC and recorded time: the median error of the mid
    estimate and the median of recorded time minus mid, to tell a fixed offset from a proportional one."""
    rows = [r for r in _nkilib_rows() if r["role"] == "check" and r["status"] == "ok"]
    body = []
    for fam in dict.fromkeys(r["family"] for r in rows):
        for n in sorted({r["lnc"] for r in rows if r["family"] == fam}):
            for lo, hi in NKILIB_BINS:
                rs = [r for r in rows if r["family"] == fam and r["lnc"] == n and lo <= float(r["published_us"]) < hi]
                if not rs:
                    continue
                errs = [float(r["error_mid"]) for r in rs]
                diff = statistics.median(float(r["published_us"]) - float(r["mid_us"]) for r in rs)
                span = f"{lo:,} - {hi:,}" if hi != math.inf else f">= {lo:,}"
                body.append([fam, n, span, str(len(rs)), f"{statistics.median(errs):+.1%}", f"{diff:+.1f}",
                             f"{sum(abs(e) <= 0.2 for e in errs)} / {len(rs)}",
                             f"{sum(r['inside'] == 'yes' for r in rs)} / {len(rs)}"])
    return _table(["family", "LNC", "recorded time (us)", "points", "median error (mid)",
                   "median recorded - mid (us)", "within +-20 %", "inside low..high"], body)


def _nkilib_lnc_pairs() -> list[tuple[str, dict, dict[int, dict[str, str]]]]:
    """nki-library's check points recorded at LNC 1 and at LNC 2 with every other field equal: (family, the other
    fields, {1: LNC 1 point, 2: LNC 2 point}) in nkilib_points.csv's order."""
    points = _nkilib_points("check")
    pairs: dict[tuple, dict] = {}
    for r in points:
        fields = json.loads(r["fields"])
        lnc = fields.pop("vnc_degree", None)
        if lnc in (1, 2):
            pairs.setdefault((r["family"], json.dumps(fields, sort_keys=True)), {})[lnc] = r
    return [(fam, json.loads(key), by) for (fam, key), by in pairs.items() if set(by) == {1, 2}]


def calibration_nkilib_lnc_pairs() -> str:
    """nki-library's rows recorded at LNC 1 and at LNC 2 with every other field equal: the recorded LNC 2 time
    minus half the LNC 1 time (what LNC 2 adds to a perfect split), and the model's mid for the same rows."""
    est = {r["point"]: r for r in _nkilib_rows() if r["status"] == "ok"}
    body = []
    for fam, f, by in _nkilib_lnc_pairs():
        shape = " ".join(f"{k}={f[k]}" for k in ("batch", "bs", "bs_kv", "seqlen", "seqlen_q", "seqlen_kv", "hidden",
                                                 "intermediate", "d") if k in f)
        one, two = (float(by[n]["published_us"]) for n in (1, 2))
        model = "—"
        if by[1]["point"] in est and by[2]["point"] in est:
            m1, m2 = (float(est[by[n]["point"]]["mid_us"]) for n in (1, 2))
            model = f"{m1:.1f} / {m2:.1f} / {m2 - m1 / 2:+.1f}"
        body.append([fam, f"{by[1]['point'].removeprefix('nkilib ')}, {by[2]['line']}", shape, f"{one:.1f}",
                     f"{two:.1f}", f"{two / one:.2f}", f"{two - one / 2:+.1f}", model])
    return _table(["family", "rows (LNC 1, LNC 2)", "shape", "recorded LNC 1 (us)", "recorded LNC 2 (us)",
                   "LNC 2 / LNC 1", "LNC 2 - LNC 1 / 2 (us)", "model mid LNC 1 / LNC 2 / LNC 2 - LNC 1 / 2"], body)


def _nkilib_estimated() -> dict[str, dict[str, str]]:
    """The estimated nki-library rows of nkilib_calibration.csv by test file:line (``test_mlp_cte:246``)."""
    return {r["point"].removeprefix("nkilib "): r for r in _nkilib_rows() if r["status"] == "ok"}


def _nkilib_error(r: dict[str, str], prefix: str = "") -> float:
    """The relative error of row ``r``'s mid: the standalone launch's (prefix "") or the kernel's own ("kernel_")."""
    return float(r[f"{prefix}mid_us"]) / float(r["published_us"]) - 1


def nkilib_cell(row: str, column: str, fmt: str = "{:,.1f}") -> Callable[[], str]:
    """``column`` of the estimated nki-library row ``row`` (test file:line); column "error" / "kernel_error" is the
    mid's error in percent."""
    def value() -> str:
        rows = _nkilib_estimated()
        if row not in rows:
            raise LookupError(f"nkilib_calibration.csv: no estimated row {row}")
        r = rows[row]
        if column.endswith("error"):
            return fmt.format(100 * _nkilib_error(r, column.removesuffix("error")))
        return fmt.format(float(r[column]))
    return value


def _nkilib_checks(family: str, lnc: str) -> list[dict[str, str]]:
    """The estimated check points of ``family`` at ``lnc``."""
    return [r for r in _nkilib_estimated().values() if r["role"] == "check" and r["family"] == family
            and r["lnc"] == lnc]


def _nkilib_select(family: str, lnc: str, *parts: str) -> Callable[[], list[dict[str, str]]]:
    """The estimated check points of ``family`` at ``lnc`` whose configuration holds every one of ``parts``
    (``"seqlen=578"``, ``"quant_type=ROW"``, a leading ``!`` for "does not hold")."""
    def select() -> list[dict[str, str]]:
        config = lambda r: set(r["shape"].split())  # noqa: E731
        rows = [r for r in _nkilib_checks(family, lnc)
                if all((p[1:] not in config(r)) if p.startswith("!") else (p in config(r)) for p in parts)]
        if not rows:
            raise LookupError(f"nkilib_calibration.csv: no {family} LNC {lnc} check point with {parts}")
        return rows
    return select


def nkilib_error_span(select: Callable[[], list[dict[str, str]]], prefix: str = "",
                      scale: float = 100.0) -> tuple[Callable[[], str], Callable[[], str]]:
    """The smallest and largest mid error (percent times ``scale`` / 100, "{:+.1f}"; "{:.1f}" for a negative
    scale, as in "short by 31.2 - 47.4 %") of the rows ``select`` gives."""
    return _min_max("nkilib_calibration.csv error span", lambda: [scale * _nkilib_error(r, prefix) for r in select()],
                    "{:+.1f}" if scale > 0 else "{:.1f}")


def nkilib_count(select: Callable[[], list[dict[str, str]]], within: float | None = None) -> Callable[[], str]:
    """How many rows ``select`` gives (with ``within``: how many of them have |mid error| <= within)."""
    return lambda: str(sum(within is None or abs(_nkilib_error(r)) <= within for r in select()))


def nkilib_offset(family: str, lo: float, hi: float, prefix: str = "") -> Callable[[], str]:
    """The median of recorded minus mid (us) of ``family``'s LNC 2 check points recorded in [lo, hi) us."""
    def value() -> str:
        rows = [r for r in _nkilib_checks(family, "2") if lo <= float(r["published_us"]) < hi]
        return f"{statistics.median(float(r['published_us']) - float(r[f'{prefix}mid_us']) for r in rows):+.1f}"
    return value


def _nkilib_estimated_pairs(families: tuple[str, ...]) -> list[tuple[dict[str, str], dict[str, str]]]:
    """(LNC 1 row, LNC 2 row) of nkilib_calibration.csv for ``families``' LNC pairs with both rows estimated."""
    est = _nkilib_estimated()
    out = []
    for fam, _, by in _nkilib_lnc_pairs():
        one, two = (est.get(by[n]["point"].removeprefix("nkilib ")) for n in (1, 2))
        if fam in families and one and two:
            out.append((one, two))
    return out


def _lnc2_excess(one: dict[str, str], two: dict[str, str], column: str) -> float:
    """LNC 2 - LNC 1 / 2 of ``column`` (us) for an LNC pair's rows."""
    return float(two[column]) - float(one[column]) / 2


def nkilib_pairs_left(families: tuple[str, ...], prefix: str = "") -> Callable[[], str]:
    """The median over ``families``' LNC pairs of what the recorded LNC 2 - LNC 1 / 2 leaves beyond the model's
    (the standalone launch's, prefix "", or the kernel's own, "kernel_")."""
    def value() -> str:
        left = [_lnc2_excess(one, two, "published_us") - _lnc2_excess(one, two, f"{prefix}mid_us")
                for one, two in _nkilib_estimated_pairs(families)]
        return f"{statistics.median(left):.1f}"
    return value


def nkilib_pair_span(families: tuple[str, ...], column: str, fmt: str) -> tuple[Callable[[], str], Callable[[], str]]:
    """The smallest and largest LNC 2 - LNC 1 / 2 of ``column`` (us) over ``families``' estimated LNC pairs."""
    return _min_max(f"nkilib_calibration.csv {families} LNC pairs",
                    lambda: [_lnc2_excess(one, two, column) for one, two in _nkilib_estimated_pairs(families)], fmt)


def nkilib_difference(first: tuple[str, str], second: tuple[str, str]) -> Callable[[], str]:
    """(row, column) ``first`` minus ``second`` of the estimated nki-library rows, us."""
    def value() -> str:
        rows = _nkilib_estimated()
        return f"{float(rows[first[0]][first[1]]) - float(rows[second[0]][second[1]]):,.1f}"
    return value


def _nkilib_small_lnc2(family: str) -> Callable[[], list[dict[str, str]]]:
    """``family``'s estimated LNC 2 check points recorded below 100 us."""
    return lambda: [r for r in _nkilib_checks(family, "2") if float(r["published_us"]) < 100]


def _nkilib_table_checks(table: str) -> Callable[[], list[dict[str, str]]]:
    """The estimated check points of nki-library's test table ``table`` (nkilib_points.csv's ``table``)."""
    def select() -> list[dict[str, str]]:
        names = [r["point"].removeprefix("nkilib ") for r in _nkilib_points("check") if r["table"] == table]
        est = _nkilib_estimated()
        return [est[n] for n in names if n in est]
    return select


_NO_CP = _nkilib_table_checks("attention_cte_no_cp_unit_perms")


TKG_ATTN = ("mlp_tkg", "attention_cte")
MLP_CTE_578 = ("batch=1", "seqlen=578")  # the small mlp_cte rows recorded at both "LNC 1" and "LNC 2"
MLP_CTE_1024_BF16 = ("seqlen=1024", "hidden=16384", "quant_type=NONE")


def calibration_nkilib_whatif() -> str:
    """A what-if, not the check: rows re-estimated at another LNC than the check's (nkilib_run.py --lnc N --out
    benchmarks/calibration/nkilib_whatif_lnc1.csv), next to the check's estimate at the row's own LNC."""
    path = NKILIB_CSV.parent / "nkilib_whatif_lnc1.csv"
    if not path.exists():
        return ""
    check = {r["point"]: r for r in _nkilib_rows()}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    body = []
    for r in rows:
        c = check.get(r["point"])
        at = "—" if c is None or c["status"] != "ok" else f"{float(c['mid_us']):.1f} ({float(c['error_mid']):+.1%})"
        body.append([r["point"].removeprefix("nkilib "), r["shape"], f"{float(r['published_us']):.1f}",
                     f"LNC {c['lnc']}: {at}" if c else "—",
                     f"{float(r['low_us']):.1f} / {float(r['mid_us']):.1f} / {float(r['high_us']):.1f}",
                     f"{float(r['error_mid']):+.1%}", r["inside"]])
    return _table(["row", "configuration", "recorded (us)", "the check: mid (error)",
                   f"what-if LNC {rows[0]['lnc']}: low / mid / high (us)", "error (mid)", "inside"], body)


def calibration_nkilib() -> str:
    """Every estimated nki-library row (benchmarks/calibration/nkilib_calibration.csv): published (tpbSgCyclesSum
    read as ps) vs the model's low / mid / high."""
    body = []
    for r in _nkilib_rows():
        est = "—" if r["status"] != "ok" else f"{float(r['low_us']):.1f} / {float(r['mid_us']):.1f} / " \
            f"{float(r['high_us']):.1f}"
        err = "—" if r["status"] != "ok" else f"{float(r['error_mid']):+.1%}"
        body.append([r["point"].removeprefix("nkilib "), r["role"], r["shape"].replace("|", "/"), r["lnc"],
                     f"{float(r['published_us']):.1f}", est, err, r["inside"] or "—",
                     "" if r["status"] == "ok" else r["status"].replace("|", "/")])
    return _table(["row (test file:line)", "role", "configuration", "LNC", "published (us)",
                   "estimate low / mid / high (us)", "error (mid)", "inside", "not estimated"], body)


def _step_span(r: dict[str, str], scale: float = 1.0, fmt: str = "{:,.1f}") -> str:
    """``mid (low..high)`` of a step.csv row's estimate (us, times ``scale``)."""
    lo, mid, hi = (float(r[c]) * scale for c in ("est_low_us", "est_mid_us", "est_high_us"))
    return f"{fmt.format(mid)} ({fmt.format(lo)}..{fmt.format(hi)})"


def _step_configs() -> dict[tuple[str, ...], list[dict[str, str]]]:
    """step.csv's rows per (flavor, batch, seq, LNC), smallest flavor first (the registry's order)."""
    from trnkit.qwen3 import flavors

    by: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for r in read_csv("step.csv"):
        by.setdefault((r["flavor"], r["batch"], r["seq"], r["lnc"]), []).append(r)
    known = flavors()

    def rank(cfg: tuple[str, ...]) -> tuple:
        return (known.index(cfg[0]) if cfg[0] in known else len(known), cfg[0], *map(int, cfg[1:]))

    return {cfg: by[cfg] for cfg in sorted(by, key=rank)}


def step_estimate() -> str:
    """python -m trnkit.bench step --save-reference: per flavor, the layer, the head and the step (trn2 cost model)."""
    body = []
    for (flavor, batch, seq, lnc), rows in _step_configs().items():
        totals = {r["part"]: r for r in rows if r["op"] == "total"}
        st = totals.pop("step")
        head = totals.pop("head")
        layers = " + ".join(f"{r['count']} × {_step_span(r, 1e-3, '{:,.2f}')}" for r in totals.values())
        busy = {e: float(st[f"busy_{e}_us"]) for e in ("tensor", "vector", "scalar", "gpsimd", "dma")}
        top = ", ".join(f"{e} {b / float(st['est_mid_us']):.0%}" for e, b in
                        sorted(busy.items(), key=lambda kv: -kv[1])[:3])
        mfu = f"**{float(st['mfu_mid']):.1%}** ({float(st['mfu_low']):.1%}..{float(st['mfu_high']):.1%})"
        body.append([f"`{flavor}`", f"{batch}×{seq}", lnc, layers, _step_span(head, 1e-3, "{:,.2f}"),
                     f"**{_step_span(st, 1e-3, '{:,.1f}')}**", f"{float(st['model_gflop']) / 1e3:,.1f}", mfu, top])
    return _table(["flavor", "batch×seq", "LNC", "layers (ms each)", "head: norm + loss (ms)", "step (ms)",
                   "model TFLOP", "MFU", "busiest engines (busy / step)"], body)


def step_ops() -> str:
    """The same CSV, per op of a layer and of the head: mid estimate (low..high) per configuration, in us."""
    configs = _step_configs()
    cols = list(configs)
    ops: dict[tuple[str, str, str], dict[tuple[str, ...], dict[str, str]]] = {}
    order: list[tuple[str, str, str]] = []  # each configuration's op sequence merged in (MoE ops after ffn_norm)
    for cfg, rows in configs.items():
        at = -1
        kinds = {r["part"] for r in rows} - {"head", "step"}  # a flavor with dense and MoE layers keeps both
        for r in rows:
            if r["op"] != "total":
                key = ("layer" if len(kinds) == 1 and r["part"] != "head" else r["part"], r["op"], r["mode"])
                if key not in ops:
                    order.insert(at + 1, key)
                at = order.index(key)
                ops.setdefault(key, {})[cfg] = r
    body = []
    for part, op, mode in order:
        by_cfg = ops[(part, op, mode)]
        kernel = next(iter(by_cfg.values()))["kernel"]
        cells = []
        for c in cols:
            r = by_cfg.get(c)
            cells.append("—" if r is None else _step_span(r) + (" *" if r["traced"] else ""))
        body.append([part, op, mode, f"`{kernel}`", *cells])
    return _table(["part", "op", "mode", "kernel", *(f"`{f}` {b}×{s} LNC={n} (us)" for f, b, s, n in cols)], body)


def figure_jobs() -> str:
    """Every job of ``python -m trnkit.bench figures``: the file it writes, its rows, when its newest row was
    computed and whether every row's fingerprint (trnkit.bench.fingerprint) is this tree's; nki-library's commit is
    not compared here (``figures --stale`` compares it with the checkout it finds)."""
    from trnkit.bench import figures, fingerprint

    body = []
    for job in figures.jobs():
        rows = figures.job_rows(job, ROOT)
        st = fingerprint.job_status(rows, ROOT)
        models = sorted({r.get("cost_model") or "" for r in rows} - {""})
        if st["current"]:
            verdict = "yes"
        elif not rows:
            verdict = "**no**: no rows"
        else:
            why = ["no fingerprint" if v == "none" else v for v in st["reasons"]]
            n = st["stale_rows"]
            verdict = f"**no** ({n} row{'s' if n != 1 else ''}): " + "; ".join(why)
        dates = sorted({(r.get("timestamp") or "")[:10] for r in rows} - {""})
        computed = st["computed"] or ("not recorded" + (f" (rows dated {dates[-1]})" if dates else ""))
        body.append([f"`{job.name}`", f"`{job.data}`", str(st["rows"]), computed,
                     ", ".join(f"`{m}`" for m in models) or "—", verdict])
    return (f"Cost model now: `{fingerprint.cost_model_hash(ROOT)}`.\n\n"
            + _table(["job", "writes", "rows", "newest row computed (UTC, commit)", "cost model", "current?"], body))


GENERATORS: dict[str, Callable[[], str]] = {
    "figure_jobs": figure_jobs,
    "plan_check": plan_check, "plan_layouts": plan_layouts,
    "calibration": calibration, "calibration_changes": calibration_changes,
    "calibration_summary": calibration_summary,
    "calibration_nkilib_summary": calibration_nkilib_summary, "calibration_nkilib": calibration_nkilib,
    "calibration_nkilib_launch": calibration_nkilib_launch,
    "calibration_nkilib_by_time": calibration_nkilib_by_time,
    "calibration_nkilib_lnc_pairs": calibration_nkilib_lnc_pairs,
    "calibration_nkilib_whatif": calibration_nkilib_whatif,
    "interp_speed": interp_speed, "qwen3_step": qwen3_step, "bench_headline": bench_headline,
    "moe_lnc": moe_lnc, "blockwise_moe": blockwise_moe, "attention_peak": attention_peak, "mlp_peak": mlp_peak,
    "cross_entropy_peak": cross_entropy_peak, "rmsnorm_peak": rmsnorm_peak, "loss_track": loss_track,
    "conformance": conformance, "conformance_model_config": conformance_model_config,
    "conformance_attention": conformance_attention, "conformance_unit_by_kernel": conformance_unit_by_kernel,
    "headline": headline, "headline_sensitivity": headline_sensitivity,
    "headline_targets": headline_targets, "headline_rope_router": headline_for("rope_hf", "router_topk"),
    "headline_moe": headline_for("moe_experts"),
    "step_estimate": step_estimate, "step_ops": step_ops,
}


@dataclass(frozen=True)
class Quote:
    """A figure in running text: ``template`` with ``{}`` where ``value()`` goes; ``source`` names it."""

    page: str  # README.md or docs/...
    template: str
    source: str
    value: Callable[[], str] | tuple[Callable[[], str], ...]  # one per {} of the template

    def text(self) -> str:
        values = self.value if isinstance(self.value, tuple) else (self.value,)
        return self.template.format(*(value() for value in values))


def csv_cell(name: str, column: str, where: dict[str, str], fmt: str = "{:.1f}") -> Callable[[], str]:
    """``column`` of the last row of benchmarks/data/``name`` whose cells equal ``where``."""
    def value() -> str:
        rows = [r for r in read_csv(name) if all(r[k] == v for k, v in where.items())]
        if not rows:
            raise LookupError(f"{name}: no row with {where}")
        return fmt.format(float(rows[-1][column]))
    return value


def json_value(name: str, path: str, fmt: str = "{:.1f}") -> Callable[[], str]:
    """The number at key path ``a/b/c`` of benchmarks/data/``name``."""
    def value() -> str:
        node = json.loads((DATA / name).read_text())
        for key in path.split("/"):
            node = node[key]
        return fmt.format(float(node))
    return value


def csv_count(name: str, where: dict[str, str]) -> Callable[[], str]:
    """How many rows of benchmarks/data/``name`` have cells equal to ``where`` (all rows when empty)."""
    def value() -> str:
        return str(sum(all(r[k] == v for k, v in where.items()) for r in read_csv(name)))
    return value


def model_config_count(kernel: str, test: Callable[[dict[str, str]], bool]) -> Callable[[], str]:
    """How many model-config rows of ``kernel`` in conformance.csv satisfy ``test``."""
    def value() -> str:
        return str(sum(r["kernel"] == kernel and bool(re.search(r" model_config( \w+)?$", r["case"]))
                       and not _reduced(r) and test(r) for r in read_csv("conformance.csv")))
    return value


ATTN_BLOCK = "experimental/transformer/attention_block_tkg"


def _static_fp8_kv(r: dict[str, str]) -> bool:
    """An attention_block_tkg row with STATIC fp8 weights and an fp8 KV cache."""
    return r["case"].startswith("fp8 static") and " kv_quant" in r["case"]


def _qkv_cte_route(r: dict[str, str]) -> bool:
    """A STATIC-fp8 x fp8-KV attention_block_tkg row above 128 tokens (B * S_tkg), whose qkv() runs qkv_cte, that
    ran (not refused at the QK norm, not skipped by the test's memory limit)."""
    sizes = dict(re.findall(r"\b(B|S)=(\d+)\b", r["shapes"]))
    return _static_fp8_kv(r) and int(sizes["B"]) * int(sizes["S"]) > 128 and r["result"] not in ("REJECTED", "SKIPPED")


def _qkv_cte_combinations() -> str:
    """How many flag combinations (a case name without OPTIMAL / GENERALITY) the qkv_cte-route rows run cover."""
    return str(len({re.sub(r" (OPTIMAL|GENERALITY)$", "", r["case"]) for r in read_csv("conformance.csv")
                    if r["kernel"] == ATTN_BLOCK and re.search(r" model_config( \w+)?$", r["case"])
                    and not _reduced(r) and _qkv_cte_route(r)}))


def _mlp_bf16_skipped(r: dict[str, str]) -> bool:
    """An mlp_tkg model row with bf16 weights that its test skips and that no documented rule refuses here."""
    return r["case"].startswith("bf16 rms_norm") and r["result"] == "SKIPPED" and _run_anyway(r) != "ERROR"


def _step(flavor: str, dtype: str, seq: int = 512) -> dict[str, str]:
    """trnkit's row of a benchmarks/qwen3_step.py case (batch 2, deterministic algorithms off)."""
    return {"flavor": flavor, "dtype": dtype, "batch": "2", "seq": str(seq), "deterministic": "off", "impl": "trnkit"}


def _step_quote(dtype: str) -> tuple[Callable[[], str], ...]:
    """Speed-up and memory ratio of the dense, then the MoE case of benchmarks/qwen3_step.py at seq 512."""
    return tuple(csv_cell("qwen3_step.csv", column, _step(flavor, dtype), "{:.2f}")
                 for flavor in ("debug", "debug-moe") for column in ("speedup", "memory_ratio"))


def _bench(kernel: str, mode: str, metric: str, x_name: str, x_value: str) -> dict[str, str]:
    return {"kernel": kernel, "impl": "nki", "mode": mode, "metric": metric, "x_name": x_name, "x_value": x_value}


def _bench_range(kernel: str, mode: str, x_name: str, x_value: str) -> tuple[Callable[[], str], ...]:
    """mid, low, high of a bench.csv estimate, then of its fraction of roofline (low = pessimistic end)."""
    time, frac = (_bench(kernel, mode, m, x_name, x_value) for m in ("est_time", "fraction_of_roofline"))
    return (*(csv_cell("bench.csv", c, time, "{:,.0f}") for c in ("p50", "p20", "p80")),
            *(csv_cell("bench.csv", c, frac, "{:.1%}") for c in ("p50", "p20", "p80")))


def _bench_min(kernel: str, mode: str, x_name: str, metric: str = "fraction_of_roofline",
               column: str = "p20", fmt: str = "{:.1%}") -> Callable[[], str]:
    """The smallest ``column`` of a bench.csv sweep (every x value of ``x_name``): e.g. the lowest
    pessimistic-end fraction over the flavors."""
    def value() -> str:
        where = {"kernel": kernel, "impl": "nki", "mode": mode, "metric": metric, "x_name": x_name}
        rows = [r for r in read_csv("bench.csv") if all(r[k] == v for k, v in where.items())]
        if not rows:
            raise LookupError(f"bench.csv: no row with {where}")
        return fmt.format(min(float(r[column]) for r in rows))
    return value


QK_NORM = "qk-norm flavor (one launch, LNC=2)"  # bench.csv: the q and k head norms in one rmsnorm_qk launch
Q_NORM = "q-norm flavor (LNC=2)"  # bench.csv: the q head norm alone


def _bench_frac(kernel: str, mode: str, x_name: str, x_value: str, column: str = "p20") -> Callable[[], str]:
    """A bench.csv fraction of roofline (p20: the pessimistic end, p50: mid)."""
    return csv_cell("bench.csv", column, _bench(kernel, mode, "fraction_of_roofline", x_name, x_value), "{:.1%}")


FLAVORS = ("0.6B", "4B", "30B-A3B")


def _head_norm_end(mode: str, x_name: str, flavor: str) -> tuple[Callable[[], str], ...]:
    """A bench.csv head-norm launch's pessimistic-end time (us) and fraction of the bound, then its mid time and
    fraction."""
    time = _bench("rmsnorm", mode, "est_time", x_name, flavor)
    return (csv_cell("bench.csv", "p80", time, "{:.1f}"), _bench_frac("rmsnorm", mode, x_name, flavor),
            csv_cell("bench.csv", "p50", time, "{:.1f}"), _bench_frac("rmsnorm", mode, x_name, flavor, "p50"))


def _mid_then_high(ends: tuple[Callable[[], str], ...]) -> tuple[Callable[[], str], ...]:
    """:func:`_head_norm_end`'s values in the order "mid time, pessimistic time (mid fraction / pessimistic
    fraction)"."""
    high, high_frac, mid, mid_frac = ends
    return mid, high, mid_frac, high_frac


def _head_norm_row(x_name: str, flavor: str) -> tuple[Callable[[], str], ...]:
    """A bench.csv head-norm launch (rmsnorm, 2,048 tokens, LNC=2) as kernels.md's table row gives it: forward
    low / mid / high (us) and its fraction of the bound at the pessimistic end, then the same of the backward."""
    out: list[Callable[[], str]] = []
    for mode in ("forward", "backward"):
        time = _bench("rmsnorm", mode, "est_time", x_name, flavor)
        out += [csv_cell("bench.csv", c, time, "{:.1f}") for c in ("p20", "p50", "p80")]
        out.append(_bench_frac("rmsnorm", mode, x_name, flavor))
    return tuple(out)


def _low_mid_high(case: str) -> tuple[Callable[[], str], ...]:
    """A headline.csv case's times low, mid, high (us), then its fractions at the low end, mid, high end."""
    where = {"case": case}
    return (*(csv_cell(HEADLINE_CSV, c, where, "{:,.1f}") for c in ("low_us", "mid_us", "high_us")),
            *(csv_cell(HEADLINE_CSV, c, where, "{:.1%}") for c in ("fraction_low_end", "fraction_mid",
                                                                    "fraction_high_end")))


def _range(case: str, kind: str) -> tuple[Callable[[], str], ...]:
    """mid, low end, high end of a headline.csv case: kind "us" (times) or "fraction"."""
    where = {"case": case}
    if kind == "us":
        return tuple(csv_cell(HEADLINE_CSV, c, where, "{:,.0f}") for c in ("mid_us", "low_us", "high_us"))
    return tuple(csv_cell(HEADLINE_CSV, c, where, "{:.1%}")
                 for c in ("fraction_mid", "fraction_low_end", "fraction_high_end"))


def _moe_busy(engine: str, lnc: int, E: int) -> Callable[[], str]:
    """Mid busy time (us) of one engine in the moe_experts forward LNC sweep of bench.csv (T=512, bf16)."""
    return csv_cell("bench.csv", "p50", _bench("moe_experts", "forward", f"busy_{engine}", f"E (LNC={lnc})", str(E)),
                    "{:,.0f}")


def step_cell(flavor: str, column: str, scale: float = 1.0, fmt: str = "{:,.0f}") -> Callable[[], str]:
    """``column`` of the step total of ``flavor`` at 1 x 4096 tokens, LNC=2 in benchmarks/data/step.csv,
    times ``scale``."""
    def value() -> str:
        where = {"flavor": flavor, "batch": "1", "seq": "4096", "lnc": "2", "part": "step"}
        rows = [r for r in read_csv("step.csv") if all(r[k] == v for k, v in where.items())]
        if not rows:
            raise LookupError(f"step.csv: no row with {where}")
        return fmt.format(float(rows[-1][column]) * scale)
    return value


def _loss_track(config: str, column: str) -> Callable[[], str]:
    return csv_cell("loss_track.csv", column, {"config": config, "step": "max"}, "{:.1e}")


def _lce_cell(case: str, schedule: str, mode: str, column: str, scale: float = 1e-3,
              fmt: str = "{:.1f}") -> Callable[[], str]:
    """``column`` of one of :func:`_lce_rows`' rows (``mode`` may be "forward + backward") times ``scale``
    (default: us to ms)."""
    return lambda: fmt.format(float(_lce_passes(case, schedule, mode)[mode][column]) * scale)


def _attention_70pct_us(lnc: int, fmt: str, S: int = 4096, Hq: int = 8, D: int = 128) -> Callable[[], str]:
    """The time (us) at which attention_peak.py's forward at S, Hq heads, head_dim D reaches 70 % of TensorE's
    bf16 peak (causal FLOPs counted once, benchmarks/side_by_side.py's PEAK per core)."""
    def value() -> str:
        peak = load_script(SIDE_BY_SIDE, "side_by_side").PEAK
        return fmt.format(4 * Hq * D * S * S / 2 / (0.7 * peak * lnc) * 1e6)
    return value


DERIVED_CSV = "derived_figures.csv"  # benchmarks/derived_figures.py: figures the derived blocks read off traces


def derived(trace: str, setting: str, quantity: str) -> float:
    """One figure of derived_figures.csv (times in us)."""
    rows = [r for r in read_csv(DERIVED_CSV)
            if (r["trace"], r["setting"], r["quantity"]) == (trace, setting, quantity)]
    if not rows:
        raise LookupError(f"{DERIVED_CSV}: no row {trace} / {setting or '(trace)'} / {quantity}")
    return float(rows[-1]["value"])


def derived_cell(trace: str, setting: str, quantity: str, fmt: str = "{:,.1f}",
                 scale: float = 1.0) -> Callable[[], str]:
    """:func:`derived` times ``scale``, as ``fmt`` writes it (``scale`` 1e-3: us to ms)."""
    return lambda: fmt.format(derived(trace, setting, quantity) * scale)


def derived_change(before: tuple[str, str], after: tuple[str, str], quantity: str = "total_us",
                   fmt: str = "{:+.2f}") -> Callable[[], str]:
    """The % change of ``quantity`` from the (trace, setting) ``before`` to ``after``."""
    return lambda: fmt.format(100 * (derived(*after, quantity) / derived(*before, quantity) - 1))


def derived_claim(holds: Callable[[], bool], words: str, otherwise: Callable[[], str]) -> Callable[[], str]:
    """``words`` while ``holds()`` (a sentence's claim, e.g. "do not move"), else ``otherwise()``: the quote then
    fails --check with what the figures say."""
    return lambda: words if holds() else otherwise()


def unmoved(setting: str, traces: tuple[str, ...], words: str = "do not move", base: str = "mid",
            digits: int = 1) -> Callable[[], str]:
    """``words`` while each trace's total under ``setting`` equals its total at ``base`` to ``digits`` decimals of
    a us."""
    def totals() -> list[tuple[float, float]]:
        return [(round(derived(t, base, "total_us"), digits), round(derived(t, setting, "total_us"), digits))
                for t in traces]
    return derived_claim(lambda: all(a == b for a, b in totals()), words,
                         lambda: "move (" + ", ".join(f"{t} {a} -> {b} us" for t, (a, b) in
                                                      zip(traces, totals())) + ")")


def kernel_opt_all_three(setting: str, quantity: str, fmt: str, scale: float) -> Callable[[], str]:
    """The figure v3, v4 and v5 share (as ``fmt`` writes it), else the three."""
    def values() -> list[str]:
        return [fmt.format(derived(f"kernel_opt {v}", setting, quantity) * scale) for v in ("v3", "v4", "v5")]
    return lambda: values()[0] if len(set(values())) == 1 else " / ".join(values()) + " (v3 / v4 / v5)"


def _ko(version: str, setting: str = "mid", quantity: str = "total_us", fmt: str = "{:.3f}",
        scale: float = 1e-3) -> Callable[[], str]:
    """A kernel_opt figure of derived_figures.csv (default: its total in ms)."""
    return derived_cell(f"kernel_opt {version}", setting, quantity, fmt, scale)


def _ko_totals(setting: str) -> tuple[Callable[[], str], ...]:
    return tuple(_ko(v, setting) for v in ("v3", "v4", "v5"))


def derived_diff(trace: str, before: str, after: str, quantity: str, fmt: str) -> Callable[[], str]:
    """How far ``quantity`` of ``trace`` moves from setting ``before`` to ``after`` (us for times)."""
    return lambda: fmt.format(derived(trace, after, quantity) - derived(trace, before, quantity))


DIDT_ON = "mid didt_throttle=True"  # derived_figures.csv: the total with TensorE's dI/dt throttle on


def didt_change(trace: str) -> Callable[[], str]:
    """How far (%) TensorE's dI/dt throttle moves ``trace``'s total at mid (derived_figures.csv)."""
    return derived_change((trace, "mid"), (trace, DIDT_ON), fmt="{:+.1f}")


def didt_totals(trace: str) -> tuple[Callable[[], str], Callable[[], str]]:
    """``trace``'s total at mid without and with TensorE's dI/dt throttle (us, derived_figures.csv)."""
    return tuple(derived_cell(trace, setting, "total_us", "{:.2f}") for setting in ("mid", DIDT_ON))


def _hoist_moves_v4() -> Callable[[], str]:
    """How far (us) ``hoist_bounded_by_sbuf`` moves kernel_opt v4's total at mid."""
    return derived_diff("kernel_opt v4", "mid", "mid hoist_bounded_by_sbuf=True", "total_us", "{:.0f}")


def _over_published(trace: str, setting: str) -> Callable[[], str]:
    """How far (%) the total of ``trace`` at ``setting`` is over its calibration point's published time (ms)."""
    return lambda: f"{100 * (derived(trace, setting, 'total_us') / 1e3 / _calibration_published(trace) - 1):.0f}"


def _router_fraction(setting: str) -> Callable[[], str]:
    """router_fwd's HBM bound (as the headline takes it: the mid report's) over its total at ``setting``, %."""
    def value() -> str:
        bound = derived("router_fwd", "mid", "memory_bound_us")
        return f"{100 * bound / derived('router_fwd', setting, 'total_us'):.1f}"
    return value


def _count_or_no(trace: str, quantity: str) -> Callable[[], str]:
    """"no" when the count is 0, else the count."""
    return lambda: "no" if derived(trace, "mid", quantity) == 0 else f"{derived(trace, 'mid', quantity):.0f}"


def _calibration_published(name: str) -> float:
    row = _latest_calibration_rows().get(name)
    if row is None:
        raise LookupError(f"{CALIBRATION_CSV.name}: no point {name!r}")
    return float(row["published"])


def trn2_constant(value: Callable[[], float], fmt: str = "{:.0f}") -> Callable[[], str]:
    """A figure the trn2 model's constants give (``value`` reads trnkit.nkisim.hardware / cost_params)."""
    return lambda: fmt.format(value())


def _chip(name: str = "trn2") -> object:
    from trnkit.nkisim import hardware

    return hardware.get_chip(name)


def _trn2() -> object:
    return _chip("trn2")


def model_param(name: str, fmt: str = "{:,.0f}", scale: float = 1.0) -> tuple[Callable[[], str], ...]:
    """A cost-model range parameter at its optimistic, mid and pessimistic values (trnkit.nkisim.cost_params),
    times ``scale``."""
    from trnkit.nkisim import cost_params

    return tuple(trn2_constant(lambda end=end: getattr(getattr(cost_params, end), name) * scale, fmt)
                 for end in ("LOW", "MID", "HIGH"))  # looked up when read: a changed parameter shows


def launch_us(value: Callable[[], float]) -> Callable[[], str]:
    """A standalone-launch time (ns) in us as the page writes it: 0, else one decimal."""
    return lambda: "0" if value() == 0 else f"{value() / 1e3:,.1f}"


def launch_param(name: str) -> tuple[Callable[[], str], ...]:
    """A standalone-launch parameter (cost_params.STANDALONE_LAUNCH) at its optimistic, mid and pessimistic
    ends, in us."""
    from trnkit.nkisim import cost_params

    return tuple(launch_us(lambda end=end: getattr(getattr(cost_params.STANDALONE_LAUNCH, end), name))
                 for end in ("low", "mid", "high"))


def launch_lnc2() -> tuple[Callable[[], str], ...]:
    """The standalone launch's cost at LNC 2 at its three ends (us): start-up plus the second core's skew."""
    from trnkit.nkisim import cost_params

    ends = [getattr(cost_params.STANDALONE_LAUNCH, end) for end in ("low", "mid", "high")]
    return tuple(launch_us(lambda e=e: e.startup_ns + e.core_skew_ns) for e in ends)


ACT_FIXED_NS = trn2_constant(lambda: _trn2().act_fixed_ns)  # ScalarE's fixed time per ACTIVATE
ACT_TABLE_LOAD_NS = trn2_constant(lambda: _trn2().act_table_load_ns, "{:,.0f}")  # ScalarE's table load


CPU_CSV = "cpu_overhead.csv"  # benchmarks/cpu_overhead.py: host-side costs measured on this machine (CPU time)


def cpu_median(case: str, variant: str, fmt: str = "{:.1f}") -> Callable[[], str]:
    """The median round of one cpu_overhead.csv variant (in its row's unit)."""
    return csv_cell(CPU_CSV, "median", {"case": case, "variant": variant}, fmt)


def cpu_per_instruction(case: str, variant: str, fmt: str = "{:.1f}") -> Callable[[], str]:
    """The median round of one cpu_overhead.csv variant per instruction it issues (us)."""
    return csv_cell(CPU_CSV, "us_per_instruction", {"case": case, "variant": variant}, fmt)


def cpu_per_instruction_range(case: str) -> tuple[Callable[[], str], Callable[[], str]]:
    """The smallest and largest us per instruction of a cpu_overhead.csv case's variants."""
    return _min_max(f"{CPU_CSV} {case}", lambda: [float(r["us_per_instruction"]) for r in read_csv(CPU_CSV)
                                                   if r["case"] == case], "{:.0f}")


def cpu_difference(case: str, first: str, second: str, fmt: str = "{:.0f}") -> Callable[[], str]:
    """How much longer ``first``'s median round is than ``second``'s in cpu_overhead.csv."""
    return lambda: fmt.format(float(cpu_median(case, first, "{}")()) - float(cpu_median(case, second, "{}")()))


def cpu_all_served(words: str) -> Callable[[], str]:
    """``words`` while every guard row of cpu_overhead.csv says its kernel accepted the shapes, else which did not."""
    def refused() -> list[str]:
        return [r["variant"] for r in read_csv(CPU_CSV) if r["case"] == "guard" and r["served"] != "True"]
    return derived_claim(lambda: not refused(), words, lambda: "do not all accept these shapes: refused by "
                         + ", ".join(refused()))


GUARD_OPS = ("rope_hf", "router_topk", "moe_experts")


def published(name: str, fmt: str = "{:,.0f}", scale: float = 1.0) -> Callable[[], str]:
    """Calibration point ``name``'s published figure (benchmarks/calibration/calibration.csv) times ``scale``."""
    return lambda: fmt.format(_calibration_published(name) * scale)


QUOTES = (
    Quote("README.md", "Over 20 steps their losses differ from the same configs' with the reference ops by at most {} "
          "(MoE) and {} (dense) relative, while runs of the same configs with no kernel drift by up to {} and {}",
          "loss_track.csv max rows",
          (_loss_track("debug_moe_nki", "rel_diff"), _loss_track("debug_dense_nki", "rel_diff"),
           _loss_track("debug_moe_nki", "spread"), _loss_track("debug_dense_nki", "spread"))),
    Quote("README.md", "LNC=2: an estimated {} ms per step ({}–{}), {}% MFU", "step.csv 30B-A3B step total",
          (step_cell("30B-A3B", "est_mid_us", 1e-3), step_cell("30B-A3B", "est_low_us", 1e-3),
           step_cell("30B-A3B", "est_high_us", 1e-3), step_cell("30B-A3B", "mfu_mid", 100, "{:.1f}"))),
    Quote("README.md", "runs at {}× numpy's own matmul time in bf16", "interp_speed.csv bf16 ratio",
          csv_cell("interp_speed.csv", "ratio", {"dtype": "bfloat16"})),
    Quote("README.md", "in bf16 and {}× in fp32", "interp_speed.csv fp32 ratio",
          csv_cell("interp_speed.csv", "ratio", {"dtype": "float32"})),
    Quote("README.md", "it passes {} of their", "conformance.csv PASS rows",
          csv_count("conformance.csv", {"result": "PASS"})),
    Quote("README.md", "of their {} test cases", "conformance.csv rows", csv_count("conformance.csv", {})),
    Quote("README.md", "; rows that mismatch: {}.", "conformance.csv MISMATCH rows",
          csv_count("conformance.csv", {"result": "MISMATCH"})),
    Quote("README.md", "fp32 cache: fwd {} µs ({}–{}), {} ({}–{}) of the HBM bound", "headline.csv rope_fwd",
          _range("rope_fwd", "us") + _range("rope_fwd", "fraction")),
    Quote("README.md", "K=8: {} µs ({}–{}), {} ({}–{}) of the HBM bound", "headline.csv router_fwd",
          _range("router_fwd", "us") + _range("router_fwd", "fraction")),
    Quote("README.md", "T=8192: fwd {} µs ({}–{}), {} ({}–{}) of the TensorE bound", "headline.csv moe_fwd",
          _range("moe_fwd", "us") + _range("moe_fwd", "fraction")),
    Quote("README.md", "trnkit's train step is {}× faster than transformers' with {}× its peak memory on the dense "
          "debug model and {}× faster with {}× the memory on the MoE one in fp32",
          "qwen3_step.csv fp32 seq 512, deterministic off", _step_quote("float32")),
    Quote("README.md", "M=4096: fwd {} µs ({}–{}), {} ({}–{}) of the roofline",
          "bench.csv grouped_mm forward M=4096 est_time, fraction_of_roofline (p50 mid, p20 / p80 the range)",
          _bench_range("grouped_mm", "forward", "M", "4096")),
    Quote("README.md", "T=8192, LNC=2: fwd {} µs ({}–{}), {} ({}–{}) of the HBM bound; bwd {} µs ({}–{}), {} ({}–{})",
          "bench.csv rmsnorm T (LNC=2)=8192 forward, backward",
          _bench_range("rmsnorm", "forward", "T (LNC=2)", "8192")
          + _bench_range("rmsnorm", "backward", "T (LNC=2)", "8192")),
    # "(time linear in V), " makes the sentence unique: the mlp and attention rows also say "LNC=2: fwd ..."
    Quote("README.md", "(time linear in V), LNC=2: fwd {} µs ({}–{}), {} ({}–{}) of its roofline; "
                       "bwd {} µs ({}–{}), {} ({}–{})",
          "bench.csv cross_entropy T (LNC=2)=2048 forward, backward",
          _bench_range("cross_entropy", "forward", "T (LNC=2)", "2048")
          + _bench_range("cross_entropy", "backward", "T (LNC=2)", "2048")),
    Quote("README.md", "I=9728, T=2048, LNC=2: fwd {} µs ({}–{}), {} ({}–{}) of its roofline; bwd {} µs ({}–{}), "
          "{} ({}–{})", "bench.csv mlp T (4B, LNC=2)=2048 forward, backward",
          _bench_range("mlp", "forward", "T (4B, LNC=2)", "2048")
          + _bench_range("mlp", "backward", "T (4B, LNC=2)", "2048")),
    Quote("README.md", "S=4096, LNC=2: fwd {} µs ({}–{}), {} ({}–{}) of its roofline; bwd {} µs ({}–{}), {} ({}–{})",
          "bench.csv attention S (4B heads, LNC=2)=4096 forward, backward",
          _bench_range("attention", "forward", "S (4B heads, LNC=2)", "4096")
          + _bench_range("attention", "backward", "S (4B heads, LNC=2)", "4096")),
    Quote("docs/kernels.md", "S=4096, LNC=2: fwd {} µs ({}–{}), {} ({}–{}) of its roofline; bwd {} µs ({}–{}), {} "
          "({}–{})", "bench.csv attention S (4B heads, LNC=2)=4096 forward, backward",
          _bench_range("attention", "forward", "S (4B heads, LNC=2)", "4096")
          + _bench_range("attention", "backward", "S (4B heads, LNC=2)", "4096")),
    Quote("docs/kernel-design.md", "forward {} / {} / {} µs (optimistic / mid / pessimistic parameters): **{}** of the "
          "bound at the pessimistic end, {} mid, {} at the optimistic end", "headline.csv rope_fwd",
          _low_mid_high("rope_fwd")),
    Quote("docs/kernels.md", "DMA {} us busy vs Tensor {} us on one core at mid", "bench.csv moe_experts E (LNC=1)=128",
          (_moe_busy("dma", 1, 128), _moe_busy("tensor", 1, 128))),
    Quote("docs/kernels.md", "E=8 is compute-bound (Tensor {} → {} us busy per core at mid); E=128 weight-bound "
          "(DMA {} → {} us per core)", "bench.csv moe_experts E (LNC=n) sweeps",
          (_moe_busy("tensor", 1, 8), _moe_busy("tensor", 2, 8), _moe_busy("dma", 1, 128), _moe_busy("dma", 2, 128))),
    Quote("docs/kernel-design.md", "under the current model the forward reaches {} of the bound at the pessimistic end "
          "({} mid)", "headline.csv moe_fwd",
          (csv_cell(HEADLINE_CSV, "fraction_low_end", {"case": "moe_fwd"}, "{:.1%}"),
           csv_cell(HEADLINE_CSV, "fraction_mid", {"case": "moe_fwd"}, "{:.1%}"))),
    Quote("docs/benchmarks.md", "`trnkit::moe_experts`: {} µs ({}–{}), {} ({}–{}) of the bound",
          "headline.csv moe_train_fwd", _range("moe_train_fwd", "us") + _range("moe_train_fwd", "fraction")),
    Quote("docs/benchmarks.md", "`block_size = 128`: {} µs ({}–{}), {} ({}–{}), ahead at mid",
          "headline.csv moe_b128_fwd", _range("moe_b128_fwd", "us") + _range("moe_b128_fwd", "fraction")),
    Quote("docs/benchmarks.md", "The backward ({} us at mid against the forward's {} us) is Scalar-bound under the "
          "current model ({} us of Scalar busy time)", "bench.csv moe_experts T=512 est_time, busy_scalar", (
              csv_cell("bench.csv", "p50", _bench("moe_experts", "backward", "est_time", "T", "512"), "{:,.0f}"),
              csv_cell("bench.csv", "p50", _bench("moe_experts", "forward", "est_time", "T", "512"), "{:,.0f}"),
              csv_cell("bench.csv", "p50", _bench("moe_experts", "backward", "busy_scalar", "T", "512"), "{:,.0f}"))),
    Quote("docs/benchmarks.md", "tokens at Qwen3-4B's H, T=8192: fwd {} (mid {}), bwd {} (mid {}); residual form at "
          "the flavors: fwd ≥ {}, bwd ≥ {}; the q and k head norms as the models run them (one launch, "
          "`rmsnorm_qk`, 2,048 tokens): fwd {} (0.6B, 16 + 8 heads; mid {}), {} (4B, 32 + 8), {} (30B-A3B, 32 + 4), "
          "bwd {} (mid {}), {}, {}; the q head norm alone (H = 128): fwd {} (0.6B) – {} (4B, 30B-A3B), bwd {} – {}",
          "bench.csv rmsnorm fraction_of_roofline (p20 pessimistic end, p50 mid)", (
              _bench_frac("rmsnorm", "forward", "T (LNC=2)", "8192"),
              _bench_frac("rmsnorm", "forward", "T (LNC=2)", "8192", "p50"),
              _bench_frac("rmsnorm", "backward", "T (LNC=2)", "8192"),
              _bench_frac("rmsnorm", "backward", "T (LNC=2)", "8192", "p50"),
              _bench_min("rmsnorm", "forward", "flavor (residual, LNC=2)"),
              _bench_min("rmsnorm", "backward", "flavor (residual, LNC=2)"),
              _bench_frac("rmsnorm", "forward", QK_NORM, "0.6B"),
              _bench_frac("rmsnorm", "forward", QK_NORM, "0.6B", "p50"),
              _bench_frac("rmsnorm", "forward", QK_NORM, "4B"),
              _bench_frac("rmsnorm", "forward", QK_NORM, "30B-A3B"),
              _bench_frac("rmsnorm", "backward", QK_NORM, "0.6B"),
              _bench_frac("rmsnorm", "backward", QK_NORM, "0.6B", "p50"),
              _bench_frac("rmsnorm", "backward", QK_NORM, "4B"),
              _bench_frac("rmsnorm", "backward", QK_NORM, "30B-A3B"),
              _bench_frac("rmsnorm", "forward", "q-norm flavor (LNC=2)", "0.6B"),
              _bench_frac("rmsnorm", "forward", "q-norm flavor (LNC=2)", "4B"),
              _bench_frac("rmsnorm", "backward", "q-norm flavor (LNC=2)", "0.6B"),
              _bench_frac("rmsnorm", "backward", "q-norm flavor (LNC=2)", "4B"))),
    Quote("docs/benchmarks.md", "attention forward {}×–{}× / {}×–{}× ({}×–{}× / {}×–{}× the exact forward alone), "
          "backward {}×–{}× / {}×–{}×", "attention_peak.csv trnkit / nki-library time, every shape",
          tuple(f for mode in ("forward", ATTENTION_EXACT, "backward")
                for column in ("est_us_mid", "est_us_high") for f in _attention_ratio_range(mode, column))),
    Quote("docs/benchmarks.md", "dense MLP {}×–{}× / {}×–{}× (mlp_cte;", "mlp_peak.csv trnkit / mlp_cte time",
          tuple(f for column in ("est_us_mid", "est_us_high") for f in _ratio_range(
              "mlp_peak.csv", lambda: _peak_pairs("mlp_peak.csv", ("case", "T", "H", "I"), ("nki-library",)), column))),
    Quote("docs/benchmarks.md", "RMSNorm forward {}×–{}× / {}×–{}× (rmsnorm_tkg, rmsnorm_quant;",
          "rmsnorm_peak.csv trnkit / rmsnorm_tkg and rmsnorm_quant time",
          tuple(f for column in ("est_us_mid", "est_us_high") for f in _ratio_range(
              "rmsnorm_peak.csv", lambda: _peak_pairs("rmsnorm_peak.csv", ("case", "B", "S", "H"),
                                                      ("nki-library rmsnorm_tkg", "nki-library rmsnorm_quant")),
              column))),
    Quote("docs/benchmarks.md", "{}× / {}× (30B-A3B's H) and {}× / {}× (4B's), one-pass schedule {}× / {}× and "
          "{}× / {}×", "cross_entropy_peak.csv trnkit / same job, forward + backward",
          tuple(_lce_job_ratio(case, schedule, "forward + backward", end)
                for schedule in ("recompute", "fused") for case in ("Qwen3-30B-A3B", "Qwen3-4B")
                for end in ("_mid", "_high"))),
    Quote("docs/benchmarks.md", "of its `6 N H V` TensorE bound: {} (mid {}) at 30B-A3B's H, {} (mid {}) at 4B's",
          "cross_entropy_peak.csv fused forward against the forward + backward matmul bound",
          tuple(_lce_fused_fraction(case, end) for case in ("Qwen3-30B-A3B", "Qwen3-4B") for end in ("_high", "_mid"))),
    Quote("docs/benchmarks.md", "the recompute schedule's backward is {}×–{}× the same job's backward (its forward "
          "{}×–{}×)", "cross_entropy_peak.csv trnkit / same job per pass, recompute schedule",
          _lce_job_ratio_range("recompute", "backward") + _lce_job_ratio_range("recompute", "forward")),
    Quote("docs/benchmarks.md", "the exact forward alone (`fixed_shift=False`, the fallback) {} (LNC=1) and {} "
          "(LNC=2) at mid ({} / {} at the pessimistic end)", "attention_peak.csv trnkit exact forward, S=4096, 8 / 2 "
          "heads, fraction of peak",
          tuple(_attention_frac(ATTENTION_EXACT, lnc, end) for end in ("mid", "pessimistic") for lnc in ("1", "2"))),
    Quote("docs/benchmarks.md", "shift per row) **{} (LNC=1) and {} (LNC=2)** at mid ({} / {} pessimistic), at LNC=2 "
          "with Qwen3-4B's 32 / 8 and 30B-A3B's 32 / 4 heads {} and {} ({} / {}); backward {} (LNC=1) and {} (LNC=2) "
          "at mid ({} / {} pessimistic)", "attention_peak.csv trnkit forward and backward, fraction of peak",
          (*(_attention_frac("forward", lnc, end) for end in ("mid", "pessimistic") for lnc in ("1", "2")),
           *(_attention_frac("forward", "2", end, Hq, Hk) for end in ("mid", "pessimistic")
             for Hq, Hk in (("32", "8"), ("32", "4"))),
           *(_attention_frac("backward", lnc, end) for end in ("mid", "pessimistic") for lnc in ("1", "2")))),
    Quote("docs/benchmarks.md", "the dense and MoE fp32 cases at seq 512, {}× and {}×",
          "qwen3_step.csv fp32 seq 512, deterministic off",
          tuple(csv_cell("qwen3_step.csv", "speedup", _step(flavor, "float32"), "{:.2f}")
                for flavor in ("debug", "debug-moe"))),
    Quote("docs/benchmarks.md", "the forward (LNC=1 {} us against the 621 us of 70%, LNC=2 {} us against 310.7 us)",
          "attention_peak.csv trnkit forward, S=4096, 8 / 2 heads",
          tuple(_attention_cell("est_us_mid", "forward", lnc) for lnc in ("1", "2"))),
    Quote("docs/benchmarks.md", "the q head norm alone at 0.6B ({} us at the pessimistic end against 33.4 us for 70%",
          "bench.csv rmsnorm q-norm flavor (LNC=2) 0.6B forward est_time p80",
          csv_cell("bench.csv", "p80", _bench("rmsnorm", "forward", "est_time", "q-norm flavor (LNC=2)", "0.6B"))),
    Quote("docs/benchmarks.md", "T=2048, LNC=2: fwd {} (mid {}), bwd {} (mid {})",
          "bench.csv cross_entropy T (LNC=2)=2048 fraction_of_roofline", (
              _bench_frac("cross_entropy", "forward", "T (LNC=2)", "2048"),
              _bench_frac("cross_entropy", "forward", "T (LNC=2)", "2048", "p50"),
              _bench_frac("cross_entropy", "backward", "T (LNC=2)", "2048"),
              _bench_frac("cross_entropy", "backward", "T (LNC=2)", "2048", "p50"))),
    # (a row with STATIC fp8 weights and an fp8 KV cache has a tapped reference: GOLDEN_GAP only by that check)
    Quote("docs/interpreter.md", "of the {} run (the QK-norm rows above apart), {} pass, {} are GOLDEN_GAP (all on "
          "the kernel's tapped tiles, {} by the rounded reference alone) and {} MISMATCH",
          "conformance.csv attention_block_tkg model rows, STATIC fp8 weights, fp8 KV cache", (
              model_config_count(ATTN_BLOCK, lambda r: _static_fp8_kv(r) and r["result"] != "REJECTED"),
              model_config_count(ATTN_BLOCK, lambda r: _static_fp8_kv(r) and r["result"] == "PASS"),
              model_config_count(ATTN_BLOCK, lambda r: _static_fp8_kv(r) and r["result"] == "GOLDEN_GAP"
                                 and "out of reach of the kernel's own QKV projection" in r["message"]),
              model_config_count(ATTN_BLOCK, lambda r: _static_fp8_kv(r) and r["result"] == "GOLDEN_GAP"
                                 and "out of reach of the kernel's tile dtypes" in r["message"]),
              model_config_count(ATTN_BLOCK, lambda r: _static_fp8_kv(r) and r["result"] == "MISMATCH"))),
    Quote("docs/interpreter.md", "past the {} run ({} of the 11 flag combinations with a row neither refused at the "
          "QK norm nor skipped by the test's memory limit, cheapest rows first: {} PASS, {} GOLDEN_GAP on the tapped "
          "tiles, {} MISMATCH",
          "conformance.csv attention_block_tkg model rows on the qkv_cte route (STATIC fp8, fp8 KV, B * S > 128)", (
              model_config_count(ATTN_BLOCK, _qkv_cte_route), _qkv_cte_combinations,
              model_config_count(ATTN_BLOCK, lambda r: _qkv_cte_route(r) and r["result"] == "PASS"),
              model_config_count(ATTN_BLOCK, lambda r: _qkv_cte_route(r) and r["result"] == "GOLDEN_GAP"
                                 and "out of reach of the kernel's own QKV projection" in r["message"]),
              model_config_count(ATTN_BLOCK, lambda r: _qkv_cte_route(r) and r["result"] == "MISMATCH"))),
    Quote("docs/interpreter.md", "of the other 78 (bf16 weights), {} ran here and {} of them pass",
          "conformance.csv mlp_tkg SKIPPED model rows with bf16 weights not refused by the SBUF planner",
          (model_config_count("core/mlp/mlp_tkg", _mlp_bf16_skipped),
           model_config_count("core/mlp/mlp_tkg", lambda r: _mlp_bf16_skipped(r) and _run_anyway(r) == "PASS"))),
    Quote("docs/interpreter.md", "**ERROR, {} rows** (all `attention_block_tkg` model-config rows with ROW fp8 weights",
          "conformance.csv ERROR rows", csv_count("conformance.csv", {"result": "ERROR"})),
    Quote("docs/interpreter.md", "**SKIPPED, {} rows**, each skipped by nki-library's own test",
          "conformance.csv SKIPPED rows", csv_count("conformance.csv", {"result": "SKIPPED"})),
    Quote("docs/interpreter.md", "run anyway: {} `mlp_tkg` model rows", "conformance.csv mlp_tkg SKIPPED rows",
          model_config_count("core/mlp/mlp_tkg", lambda r: r["result"] == "SKIPPED")),
    Quote("docs/interpreter.md", "run anyway {} PASS, {} REJECTED by the `nc_transpose` dtype rule and {} refused by "
          "nki-library's SBUF planner", "conformance.csv mlp_tkg SKIPPED rows by how they ran", tuple(
              model_config_count("core/mlp/mlp_tkg", lambda r, v=v: r["result"] == "SKIPPED" and _run_anyway(r) == v)
              for v in ("PASS", "REJECTED", "ERROR"))),
    Quote("docs/interpreter.md", "**XFAIL, {} rows** (all `moe_tkg` model rows)", "conformance.csv XFAIL rows",
          csv_count("conformance.csv", {"result": "XFAIL"})),
    Quote("docs/interpreter.md", "**GOLDEN_GAP, {} rows**: nki-library's golden, checked per row",
          "conformance.csv attention_block_tkg GOLDEN_GAP rows",
          csv_count("conformance.csv", {"result": "GOLDEN_GAP", "kernel": ATTN_BLOCK})),
    Quote("docs/interpreter.md", "**GOLDEN_GAP on the kernel's routing, {} rows**",
          "conformance.csv moe_block_tkg GOLDEN_GAP rows",
          csv_count("conformance.csv", {"result": "GOLDEN_GAP", "kernel": "core/moe_block/moe_block_tkg"})),
    Quote("docs/interpreter.md", "**REJECTED, {} rows** (all `attention_block_tkg` model-config rows with a QK norm",
          "conformance.csv REJECTED rows", csv_count("conformance.csv", {"result": "REJECTED"})),
    Quote("docs/interpreter.md", "**STALE_READ, {} rows** (`attention_cte` sweep rows",
          "conformance.csv STALE_READ rows", csv_count("conformance.csv", {"result": "STALE_READ"})),
    Quote("docs/cost-model.md", "published; TensorE-bound kernels): predicted {} (the one change off by more than "
          "half its size) and {} (within half)", "calibration.csv kernel_opt v3 / v4 / v5 mids",
          (predicted_change("kernel_opt v3", "kernel_opt v4"), predicted_change("kernel_opt v4", "kernel_opt v5"))),
    Quote("docs/cost-model.md", "The check points whose published figure is outside the model's range: {}.",
          "calibration.csv check points outside low..high", calibration_checks_outside),
    Quote("docs/cost-model.md", "exceeds the recorded {} us; its kernel estimate is {} us and the standalone one {} us "
          "(low {} us, inside)", "nkilib_calibration.csv test_mlp_tkg:257",
          tuple(nkilib_cell("test_mlp_tkg:257", c) for c in ("published_us", "kernel_mid_us", "mid_us", "low_us"))),
    Quote("docs/cost-model.md", "I = 896) are the largest errors, {} to {} %", "nkilib_calibration.csv mlp_tkg "
          "LNC 1 fp8 column-tiled rows", nkilib_error_span(_nkilib_select(
              "mlp_tkg", "1", "!quant_type=NONE", "gate_up_column_tiling=True"))),
    Quote("docs/cost-model.md", "the median of recorded minus the kernel's mid is {} us for mlp_tkg ({} rows) and "
          "{} us for attention_cte ({} rows); the standalone launch leaves {} / {} us there, and {} / {} us from 100 "
          "to 500 us", "nkilib_calibration.csv LNC 2 fixed offsets", (
              nkilib_offset("mlp_tkg", 0, 100, "kernel_"), nkilib_count(_nkilib_small_lnc2("mlp_tkg")),
              nkilib_offset("attention_cte", 0, 100, "kernel_"), nkilib_count(_nkilib_small_lnc2("attention_cte")),
              nkilib_offset("mlp_tkg", 0, 100), nkilib_offset("attention_cte", 0, 100),
              nkilib_offset("mlp_tkg", 100, 500), nkilib_offset("attention_cte", 100, 500))),
    Quote("docs/cost-model.md", "the LNC 2 time is half the LNC 1 time plus {} - {} us for every mlp_tkg and "
          "attention_cte pair", "nkilib_points.csv LNC pairs, recorded",
          nkilib_pair_span(TKG_ATTN, "published_us", "{:.1f}")),
    Quote("docs/cost-model.md", "where the kernel's own LNC 2 - LNC 1 / 2 is {} to {} us. The standalone launch",
          "nkilib_calibration.csv LNC pairs, kernel mid", nkilib_pair_span(TKG_ATTN, "kernel_mid_us", "{:+.1f}")),
    Quote("docs/cost-model.md", "What is left, {} us at the median of the 10 pairs ({} us without the launch)",
          "nkilib_calibration.csv LNC pairs, recorded minus mid",
          (nkilib_pairs_left(TKG_ATTN), nkilib_pairs_left(TKG_ATTN, "kernel_"))),
    Quote("docs/cost-model.md", "the rows recorded at \"LNC 1\" are within {} / {} % with the standalone launch ({} "
          "rows, all inside their range), those at \"LNC 2\" {} to {} % ({} rows, {} within ±20 %, all inside)",
          "nkilib_calibration.csv mlp_cte 578 tokens", (
              *nkilib_error_span(_nkilib_select("mlp_cte", "1", *MLP_CTE_578)),
              nkilib_count(_nkilib_select("mlp_cte", "1", *MLP_CTE_578)),
              *nkilib_error_span(_nkilib_select("mlp_cte", "2", *MLP_CTE_578)),
              nkilib_count(_nkilib_select("mlp_cte", "2", *MLP_CTE_578)),
              nkilib_count(_nkilib_select("mlp_cte", "2", *MLP_CTE_578), within=0.2))),
    Quote("docs/cost-model.md", "(578 x 1,408 x 352, LNC 1, {} us recorded)", "nkilib_calibration.csv test_mlp_cte:277",
          nkilib_cell("test_mlp_cte:277", "published_us")),
    Quote("docs/cost-model.md", "its kernel estimate is {} us, and no single parameter",
          "nkilib_calibration.csv test_mlp_cte:277 kernel mid", nkilib_cell("test_mlp_cte:277", "kernel_mid_us")),
    Quote("docs/cost-model.md", "the standalone launch brings it to {} us ({} %). The same row recorded \"at LNC 2\" "
          "(`:279`, {} us) is {} us of kernel", "nkilib_calibration.csv test_mlp_cte:277 / 279", (
              nkilib_cell("test_mlp_cte:277", "mid_us"), nkilib_cell("test_mlp_cte:277", "error", "{:+.1f}"),
              nkilib_cell("test_mlp_cte:279", "published_us"), nkilib_cell("test_mlp_cte:279", "kernel_mid_us"))),
    Quote("docs/cost-model.md", "and {} us standalone at mid, {} us short", "nkilib_calibration.csv test_mlp_cte:279",
          (nkilib_cell("test_mlp_cte:279", "mid_us"),
           nkilib_difference(("test_mlp_cte:279", "published_us"), ("test_mlp_cte:279", "mid_us")))),
    Quote("docs/cost-model.md", "`372`: {} / {} us recorded at 512 / 256 tokens, the fewer tokens the slower; "
          "{} / {} us at mid", "nkilib_calibration.csv test_mlp_cte:371 / 372", tuple(
              nkilib_cell(f"test_mlp_cte:{n}", c) for c in ("published_us", "mid_us") for n in (371, 372))),
    Quote("docs/cost-model.md", "the two fp8 rows without column tiling (`:343`, `:402`, DMA-bound) are at {} / {} %",
          "nkilib_calibration.csv test_mlp_tkg:343 / 402",
          tuple(nkilib_cell(f"test_mlp_tkg:{n}", "error", "{:+.1f}") for n in (343, 402))),
    Quote("docs/cost-model.md", "and by {} - {} % at 1,024 tokens (`:370`, `:373`, `:374`, 1 - 4 batches)",
          "nkilib_calibration.csv mlp_cte ROW 1,024 x 16,384", nkilib_error_span(
              _nkilib_select("mlp_cte", "2", "seqlen=1024", "hidden=16384", "quant_type=ROW"), scale=-100.0)),
    Quote("docs/cost-model.md", "rows at 1,024 tokens are within {} / {} % at LNC 1 and {} / {} % at LNC 2.",
          "nkilib_calibration.csv mlp_cte bf16 1,024 x 16,384", (
              *nkilib_error_span(_nkilib_select("mlp_cte", "1", *MLP_CTE_1024_BF16)),
              *nkilib_error_span(_nkilib_select("mlp_cte", "2", *MLP_CTE_1024_BF16)))),
    Quote("docs/cost-model.md", "the device adds {} us and the model {} us", "nkilib_calibration.csv "
          "test_mlp_cte:249 - :250", tuple(
              nkilib_difference(("test_mlp_cte:249", c), ("test_mlp_cte:250", c)) for c in ("published_us", "mid_us"))),
    Quote("docs/cost-model.md", "3,784.8 us recorded, {} / {} / {} us, {} % and above its range",
          "nkilib_calibration.csv test_mlp_cte:246", (
              *(nkilib_cell("test_mlp_cte:246", c) for c in ("low_us", "mid_us", "high_us")),
              nkilib_cell("test_mlp_cte:246", "error", "{:+.1f}"))),
    Quote("docs/cost-model.md", "The kernel's own estimate is short of every recorded time: of the norm rows up to 160 "
          "tokens by {} - {} %, of the quantize-only rows by {} - {} %, of the norm row at 2,048 tokens (`:292`) by {} "
          "%; with the launch's 16.9 us start-up at mid the norm rows up to 160 tokens come out {} to {} %, the "
          "quantize-only ones {} to {} %, and `:292` {} %", "nkilib_calibration.csv rmsnorm_quant", (
              *nkilib_error_span(_nkilib_select("rmsnorm_quant", "2", "!quant_only=True", "!seqlen=2048"), "kernel_",
                                 scale=-100.0),
              *nkilib_error_span(_nkilib_select("rmsnorm_quant", "2", "quant_only=True"), "kernel_", scale=-100.0),
              nkilib_error_span(_nkilib_select("rmsnorm_quant", "2", "seqlen=2048"), "kernel_", scale=-100.0)[0],
              *nkilib_error_span(_nkilib_select("rmsnorm_quant", "2", "!quant_only=True", "!seqlen=2048")),
              *nkilib_error_span(_nkilib_select("rmsnorm_quant", "2", "quant_only=True")),
              nkilib_cell("test_rmsnorm_quant:292", "error", "{:+.1f}"))),
    Quote("docs/cost-model.md", "is short by {} - {} % at LNC 2 (all {} rows)",
          "nkilib_calibration.csv attention_cte no-cp rows", (
              *nkilib_error_span(_NO_CP, scale=-100.0), nkilib_count(_NO_CP))),
    Quote("docs/cost-model.md", "(8,192 x 8,192, d = 64, not causal: 520 / 524 us recorded, {} / {} % at LNC 2)",
          "nkilib_calibration.csv test_attention_cte:665 / 715",
          tuple(nkilib_cell(f"test_attention_cte:{n}", "error", "{:+.1f}") for n in (665, 715))),
    Quote("docs/cost-model.md", "(H 4,096, I 128: 25.6 us recorded, the kernel's own mid {} us)",
          "nkilib_calibration.csv test_mlp_tkg:271", nkilib_cell("test_mlp_tkg:271", "kernel_mid_us")),
    Quote("docs/benchmarks.md", "arithmetic): {} us at LNC=1 and {} us at LNC=2 at mid, {}× and {}× the exact "
          "forward's time", "attention_peak.csv forward, fallback",
          (_fallback_cost("1")[0], _fallback_cost("2")[0], _fallback_cost("1")[1], _fallback_cost("2")[1])),
    Quote("docs/benchmarks.md", "the forward at 8,192² with 3 heads reaches {} of peak at mid",
          "attention_peak.csv forward 8192 3 / 3 LNC=2",
          _attention_cell("peak_frac_mid", "forward", "2", "{:.1%}", S="8192", Hq="3", Hk="3")),
    Quote("docs/benchmarks.md", "**Whole job, fused schedule**: {}× (30B-A3B) and {}× (4B) the same job's time at "
          "mid, {}× and {}× at the pessimistic end, against {}× and {}× at mid, {}× and {}× pessimistic for the "
          "recompute schedule", "cross_entropy_peak.csv forward + backward rows", tuple(
              _lce_job_ratio(case, schedule, "forward + backward", end) for schedule in ("fused", "recompute")
              for end in ("_mid", "_high") for case in ("Qwen3-30B-A3B", "Qwen3-4B"))),
    Quote("docs/benchmarks.md", "kernel's mid estimate is {} (30B-A3B) and {} (4B) over that",
          "cross_entropy_peak.csv fused forward vs 6 N H V", tuple(
              _lce_over(case, "fused", "forward", "bound") for case in ("Qwen3-30B-A3B", "Qwen3-4B"))),
    Quote("docs/benchmarks.md", "reordering) is {} over mid", "cross_entropy_peak.csv 4B fused forward",
          _lce_over("Qwen3-4B", "fused", "forward", "mid")),
    Quote("docs/benchmarks.md", "Its backward takes {}× (30B-A3B) and {}× (4B) the same job's backward at mid ({}× "
          "and {}× pessimistic)", "cross_entropy_peak.csv recompute backward rows", tuple(
              _lce_job_ratio(case, "recompute", "backward", end) for end in ("_mid", "_high")
              for case in ("Qwen3-30B-A3B", "Qwen3-4B"))),
    Quote("docs/benchmarks.md", "it runs {} (30B-A3B) and {} (4B) over that TensorE time at mid",
          "cross_entropy_peak.csv recompute backward vs 6 N H V", tuple(
              _lce_over(case, "recompute", "backward", "bound") for case in ("Qwen3-30B-A3B", "Qwen3-4B"))),
    Quote("docs/kernels.md", "0.6B / 4B / 30B-A3B: forward {} / {} / {} µs at mid, {} / {} / {} of the HBM bound at "
          "the pessimistic end; backward {} / {} / {} µs, {} / {} / {}.", "bench.csv rmsnorm qk-norm",
          tuple(_head_norm_row(QK_NORM, f)[k] for k in (1, 3, 5, 7) for f in FLAVORS)),
    Quote("docs/kernel-design.md", "| q, 16 heads (0.6B) | {} / {} / {} | {} | {} / {} / {} | {} |",
          "bench.csv rmsnorm q-norm 0.6B", _head_norm_row(Q_NORM, "0.6B")),
    Quote("docs/kernel-design.md", "| q, 32 heads (4B, 30B-A3B) | {} / {} / {} | {} | {} / {} / {} | {} |",
          "bench.csv rmsnorm q-norm 4B", _head_norm_row(Q_NORM, "4B")),
    *(Quote("docs/kernel-design.md", f"| **`rmsnorm_qk`, {flavor} ({heads})** | {{}} / {{}} / {{}} | **{{}}** | "
            "{} / {} / {} | {} |", f"bench.csv rmsnorm qk-norm {flavor}", _head_norm_row(QK_NORM, flavor))
      for flavor, heads in (("0.6B", "16 + 8 heads"), ("4B", "32 + 8"), ("30B-A3B", "32 + 4"))),
    Quote("docs/kernel-design.md", "The estimate is {} µs at the pessimistic end ({}), {} µs mid ({}); at 32 heads "
          "(Qwen3-4B, 30B-A3B) {} µs ({}), {} µs mid", "bench.csv rmsnorm q-norm forward 0.6B, 4B",
          _head_norm_end("forward", Q_NORM, "0.6B") + _head_norm_end("forward", Q_NORM, "4B")[:3]),
    Quote("docs/kernel-design.md", "The estimate is {} µs mid, {} µs at the pessimistic end ({} / {})",
          "bench.csv rmsnorm q-norm backward 0.6B", _mid_then_high(_head_norm_end("backward", Q_NORM, "0.6B"))),
    Quote("docs/kernel-design.md", "add: {} / {} / {} µs ({} / {} / {}; mid {} / {} / {})",
          "bench.csv rmsnorm qk-norm backward",
          tuple(_head_norm_end("backward", QK_NORM, f)[k] for k in (0, 1, 3) for f in FLAVORS)),
    # the derived blocks' figures read off traces (benchmarks/derived_figures.py)
    Quote("docs/cost-model.md", "`router_fwd` ({} PSUM tiles of {} bank) {} -> {} us at mid, {} -> {} us at the "
          "pessimistic end, where its fraction of the HBM bound drops from {} to {} %", "derived_figures.csv "
          "router_fwd psum_banks", (
              derived_cell("router_fwd", "", "psum_tiles", "{:.0f}"),
              derived_claim(lambda: derived("router_fwd", "", "psum_banks_per_tile_max") == 1, "one",
                            derived_cell("router_fwd", "", "psum_banks_per_tile_max", "up to {:.0f}")),
              *(derived_cell("router_fwd", s, "total_us") for s in ("mid", "mid psum_banks=rotate", "high",
                                                                    "high psum_banks=rotate")),
              _router_fraction("high"), _router_fraction("high psum_banks=rotate"))),
    Quote("docs/cost-model.md", "`rope_fwd` and `kernel_opt` v4 / v5 {} at mid.", "derived_figures.csv "
          "psum_banks=rotate", unmoved("mid psum_banks=rotate", ("rope_fwd", "kernel_opt v4", "kernel_opt v5"))),
    Quote("docs/cost-model.md", "serialises rope's tiles in one bank at the pessimistic end ({} -> {} us) and adds {} "
          "us of bank waits to `kernel_opt v5` at mid ({} -> {} ms)", "derived_figures.csv psum_banks=lowest", (
              derived_cell("rope_fwd", "high", "total_us"), derived_cell("rope_fwd", "high psum_banks=lowest",
                                                                         "total_us"),
              derived_diff("kernel_opt v5", "mid", "mid psum_banks=lowest", "total_us", "{:.0f}"),
              _ko("v5"), _ko("v5", "mid psum_banks=lowest"))),
    Quote("docs/cost-model.md", "TensorE is busy {} ms in all three.", "derived_figures.csv kernel_opt busy",
          kernel_opt_all_three("mid", "busy_us:tensor", "{:.2f}", 1e-3)),
    Quote("docs/cost-model.md", "v3 {} us before the first matmul, {} us after the last, {} wait in between; v4 {} "
          "us before, {} us in {} waits between matmuls (the longest {} us, the last at {} ms, while the DMA engines "
          "catch up with the start-up), {} us after; v5 {} us before, {} us in {} waits, {} us after. Totals {} / {} "
          "/ {} ms. The model's v4 spills {} GB of stores and reloads (v5 {} GB)", "derived_figures.csv kernel_opt "
          "TensorE waits", (
              _ko("v3", quantity="tensor_before_us", fmt="{:.1f}", scale=1),
              _ko("v3", quantity="tensor_after_us", fmt="{:.1f}", scale=1),
              _count_or_no("kernel_opt v3", "tensor_waits"),
              *(_ko("v4", quantity=q, fmt=f, scale=s) for q, f, s in (
                  ("tensor_before_us", "{:.1f}", 1), ("tensor_waits_us", "{:.1f}", 1), ("tensor_waits", "{:.0f}", 1),
                  ("tensor_wait_longest_us", "{:.2f}", 1), ("tensor_last_wait_at_us", "{:.2f}", 1e-3),
                  ("tensor_after_us", "{:.1f}", 1))),
              *(_ko("v5", quantity=q, fmt=f, scale=1) for q, f in (
                  ("tensor_before_us", "{:.1f}"), ("tensor_waits_us", "{:.1f}"), ("tensor_waits", "{:.0f}"),
                  ("tensor_after_us", "{:.1f}"))),
              *_ko_totals("mid"),
              *(_ko(v, quantity="spill_GB", fmt="{:.1f}", scale=1) for v in ("v4", "v5")))),
    Quote("docs/cost-model.md", "alone at mid gives v3 / v4 / v5 {} / {} / {} ms: v4 -> v5 {} % for the published "
          "-0.39 %, but v3 {} % slower than published and v3 -> v4 {} % for the published +0.7 %",
          "derived_figures.csv kernel_opt dma_queues=1", (
              *_ko_totals("mid dma_queues=1"),
              derived_change(("kernel_opt v4", "mid dma_queues=1"), ("kernel_opt v5", "mid dma_queues=1")),
              _over_published("kernel_opt v3", "mid dma_queues=1"),
              derived_change(("kernel_opt v3", "mid dma_queues=1"), ("kernel_opt v4", "mid dma_queues=1"),
                             fmt="{:+.1f}"))),
    Quote("docs/cost-model.md", "alone at mid): v4 {} ms (+{} us: its bound is skipped", "derived_figures.csv "
          "kernel_opt hoist_bounded_by_sbuf v4", (_ko("v4", "mid hoist_bounded_by_sbuf=True"), _hoist_moves_v4())),
    Quote("docs/cost-model.md", "v5 {} ms (v4 -> v5 {} %, the wrong direction", "derived_figures.csv kernel_opt "
          "hoist_bounded_by_sbuf v5", (_ko("v5", "mid hoist_bounded_by_sbuf=True"), derived_change(
              ("kernel_opt v4", "mid hoist_bounded_by_sbuf=True"), ("kernel_opt v5", "mid hoist_bounded_by_sbuf=True"),
              fmt="{:+.1f}"))),
    Quote("docs/cost-model.md", "(with `hoist_bounded_by_sbuf` on too: v4's total moves by {} us)",
          "derived_figures.csv kernel_opt hoist_bounded_by_sbuf v4", _hoist_moves_v4()),
    Quote("docs/cost-model.md", "TensorE's busy time +{} / +{} / +{} us in v3 / v4 / v5, totals {} / {} / {} ms: v4 -> "
          "v5 {} %, v3 -> v4 {} %; v2 {} ms {} (its {} waits between matmuls are all shorter than {} us)",
          "derived_figures.csv kernel_opt didt_throttle", (
              *(derived_diff(f"kernel_opt {v}", "mid", "mid didt_throttle=True", "busy_us:tensor", "{:.1f}")
                for v in ("v3", "v4", "v5")),
              *_ko_totals("mid didt_throttle=True"),
              derived_change(("kernel_opt v4", "mid didt_throttle=True"), ("kernel_opt v5", "mid didt_throttle=True")),
              derived_change(("kernel_opt v3", "mid didt_throttle=True"), ("kernel_opt v4", "mid didt_throttle=True")),
              _ko("v2", "mid didt_throttle=True"),
              unmoved("mid didt_throttle=True", ("kernel_opt v2",), "unchanged"),
              _ko("v2", quantity="tensor_waits", fmt="{:,.0f}", scale=1),
              derived_claim(lambda: derived("kernel_opt v2", "mid", "tensor_wait_longest_us") < 1.1, "1.1",
                            _ko("v2", quantity="tensor_wait_longest_us", fmt="{:.2f} (longest)", scale=1)))),
    Quote("docs/cost-model.md", "The model's v4 has {} gap of 1.5 us or more", "derived_figures.csv kernel_opt v4 "
          "waits", _count_or_no("kernel_opt v4", "tensor_waits_over_1500ns")),
    Quote("docs/cost-model.md", "a what-if, \"PSUM banks\" above): v4 and v5 {} at mid.", "derived_figures.csv "
          "kernel_opt psum_banks=rotate", unmoved("mid psum_banks=rotate", ("kernel_opt v4", "kernel_opt v5"))),
    Quote("docs/kernel-design.md", "the trace's busy times at HIGH are Vector {} µs ({} instructions' access set-up on "
          "top), TensorE {}, DMA {} and Scalar {} (ACTIVATE's fixed time and the PSUM access bubble on each of its {} "
          "instructions on top): Scalar binds at the pessimistic end, DMA and Scalar together at mid ({} / {} µs "
          "busy)",
          "derived_figures.csv rope_fwd busy", (
              derived_cell("rope_fwd", "high", "busy_us:vector"),
              derived_cell("rope_fwd", "high", "count:vector", "{:.0f}"),
              *(derived_cell("rope_fwd", "high", f"busy_us:{e}") for e in ("tensor", "dma", "scalar")),
              derived_cell("rope_fwd", "high", "count:scalar", "{:.0f}"),
              *(derived_cell("rope_fwd", "mid", f"busy_us:{e}") for e in ("dma", "scalar")))),
    Quote("docs/kernel-design.md", "the router_fwd trace's busy times at HIGH (benchmarks/derived_figures.py), DMA {} "
          "and TensorE {} us", "derived_figures.csv router_fwd busy",
          tuple(derived_cell("router_fwd", "high", f"busy_us:{e}") for e in ("dma", "tensor"))),
    Quote("docs/kernel-design.md", "the trace's busy times there: TensorE {} µs, the sum above, DMA {} µs and "
          "GpSimd {} µs with their per-instruction costs", "derived_figures.csv moe_fwd busy at HIGH",
          tuple(derived_cell("moe_fwd", "high", f"busy_us:{e}") for e in ("tensor", "dma", "gpsimd"))),
    Quote("docs/kernel-design.md", "128 us of Vector: {} → {} us, still under Scalar's {} us", "derived_figures.csv "
          "attention_fixed_shift_fwd busy at mid (with the 128 us added)",
          (derived_cell("attention_fixed_shift_fwd", "mid", "busy_us:vector", "{:.0f}"),
           lambda: f"{derived('attention_fixed_shift_fwd', 'mid', 'busy_us:vector') + 128:.0f}",
           derived_cell("attention_fixed_shift_fwd", "mid", "busy_us:scalar", "{:.0f}"))),
    *(Quote("docs/kernel-design.md", f"{row} | {{}} µs |", f"derived_figures.csv q-norm 0.6B busy_us:{engine} "
            "at HIGH", derived_cell("rmsnorm_q_norm_0.6B_fwd", "high", f"busy_us:{engine}"))
      for engine, row in (("dma", "six `rstd` stores of 16–64-byte runs"),
                          ("vector", "(284 cycles each, 3.9 µs); constants"), ("tensor", "at 2.4 GHz; `eps` per run"),
                          ("scalar", "the last runs' `rsqrt`"))),
    Quote("docs/benchmarks.md", "Scalar becomes the one busy engine ({} of {} us at LNC=1), Tensor and DMA follow at "
          "{}–{}%", "derived_figures.csv attention_fixed_shift_fwd busy at mid", (
              derived_cell("attention_fixed_shift_fwd", "mid", "busy_us:scalar"),
              derived_cell("attention_fixed_shift_fwd", "mid", "total_us"),
              *_min_max("attention_fixed_shift_fwd busy", lambda: [
                  100 * derived("attention_fixed_shift_fwd", "mid", f"busy_us:{e}")
                  / derived("attention_fixed_shift_fwd", "mid", "total_us") for e in ("tensor", "dma")], "{:.0f}"))),
    Quote("docs/benchmarks.md", "the `6 N H V` FLOPs at TensorE's peak take {} ms at 30B-A3B's H and {} ms at 4B's",
          "cross_entropy_peak.csv 6 N H V bound", tuple(
              _lce_cell(case, "fused", "forward + backward", "matmul_bound_us")
              for case in ("Qwen3-30B-A3B", "Qwen3-4B"))),
    Quote("docs/benchmarks.md", "The backward, the scaling of the stored gradients, is {} ms (30B-A3B) and {} ms (4B)",
          "cross_entropy_peak.csv fused backward", tuple(
              _lce_cell(case, "fused", "backward", "trnkit_us_mid") for case in ("Qwen3-30B-A3B", "Qwen3-4B"))),
    Quote("docs/benchmarks.md", "are {} ms at 4B's H and {} ms at 30B-A3B's, against the same job's {} ms and {} ms",
          "cross_entropy_peak.csv recompute backward bound and job", (
              *(_lce_cell(case, "fused", "forward + backward", "matmul_bound_us")
                for case in ("Qwen3-4B", "Qwen3-30B-A3B")),
              *(_lce_cell(case, "recompute", "backward", "job_mid") for case in ("Qwen3-4B", "Qwen3-30B-A3B")))),
    Quote("docs/benchmarks.md", "(traced at N = 1,024, 4B's H, V = 8,192: DMA busy {} µs, TensorE {} µs per core)",
          "derived_figures.csv cross_entropy_fused_fwd busy at mid", tuple(
              derived_cell("cross_entropy_fused_fwd", "mid", f"busy_us:{e}", "{:.0f}") for e in ("dma", "tensor"))),
    Quote("docs/benchmarks.md", "(LNC=1 {} us against the {} us of 70%, LNC=2 {} us against {} us)",
          "attention_peak.csv forward 4096 8 / 2", (
              _attention_cell("est_us_mid", "forward", "1"), _attention_70pct_us(1, "{:.0f}"),
              _attention_cell("est_us_mid", "forward", "2"), _attention_70pct_us(2, "{:.1f}"))),
    Quote("docs/kernel-design.md", "the HBM bound is {} µs", "derived_figures.csv rope_fwd memory bound",
          derived_cell("rope_fwd", "mid", "memory_bound_us")),
    Quote("docs/kernel-design.md", "The HBM bound is {} µs (38.8 MB); 70 % of it is {} µs.", "derived_figures.csv "
          "router_fwd memory bound", (derived_cell("router_fwd", "mid", "memory_bound_us"),
                                      derived_cell("router_fwd", "mid", "memory_bound_us", scale=1 / 0.7))),
    Quote("docs/trainer.md", "one thread, median of 15 steps: {} ms per step vs {} ms `foreach=True` and {} ms "
          "`foreach=False`", "cpu_overhead.csv adamw medians",
          tuple(cpu_median("adamw", v, "{:.0f}") for v in ("fused=True", "foreach=True", "foreach=False"))),
    Quote("docs/overrides.md", "{} µs per call for `rope_hf`, {} µs for `router_topk` and {} µs for `moe_experts`, "
          "which {} these shapes", "cpu_overhead.csv guard medians",
          (*(cpu_median("guard", op) for op in GUARD_OPS), cpu_all_served("all accept"))),
    Quote("docs/overrides.md", "`trnkit::rope_hf_apply[reference]` {} µs vs {} µs for the same work called directly "
          "(two `empty_like` outputs and `rope_hf_bshd_ref`) on a tiny input, so about {} µs of dispatch per op call",
          "cpu_overhead.csv dispatch medians",
          (cpu_median("dispatch", "trnkit::rope_hf_apply[reference]", "{:.0f}"),
           cpu_median("dispatch", "rope_hf_bshd_ref direct", "{:.0f}"),
           cpu_difference("dispatch", "trnkit::rope_hf_apply[reference]", "rope_hf_bshd_ref direct"))),
    Quote("docs/interpreter.md", "{} us per instruction without a trace, {} us recording one and {} us trace-only",
          "cpu_overhead.csv instruction medians per instruction",
          tuple(cpu_per_instruction("instruction", v) for v in ("no trace", "traced", "trace-only"))),
    Quote("docs/interpreter.md", "An `nc_matmul` of `[128, 128] x [128, 512]` fp32 takes {} us",
          "cpu_overhead.csv matmul per instruction", cpu_per_instruction("matmul", "nc_matmul", "{:.0f}")),
    Quote("docs/interpreter.md", "{} ms of CPU per call with the BLAS left alone against {} ms with one thread",
          "cpu_overhead.csv blas medians", (cpu_median("blas", "BLAS left alone", "{:.0f}"),
                                            cpu_median("blas", "1 BLAS thread per launch", "{:.0f}"))),
    Quote("docs/interpreter.md", "{} us of CPU per instruction as one program and {} us per instruction (of twice as "
          "many) as two programs in lockstep", "cpu_overhead.csv lockstep medians per instruction",
          (cpu_per_instruction("lockstep", "LNC=1"), cpu_per_instruction("lockstep", "LNC=2"))),
    Quote("docs/interpreter.md", "At {}-{} us of CPU per instruction at these shapes",
          "cpu_overhead.csv train_kernels per instruction", cpu_per_instruction_range("train_kernels")),
    Quote("docs/kernels.md", "(the grad_x PSUM evacuations, ~{} ns fixed time each)", "hardware.TRN2.act_fixed_ns",
          ACT_FIXED_NS),
    Quote("docs/kernel-design.md", "ACTIVATE fixed time (~{} ns)", "hardware.TRN2.act_fixed_ns", ACT_FIXED_NS),
    Quote("docs/kernel-design.md", "or {} ns + {} ns on Scalar", "hardware.TRN2: act_fixed_ns, 1,024 / Scalar clock",
          (ACT_FIXED_NS, trn2_constant(lambda: 1024 / _trn2().clocks.scalar))),
    Quote("docs/tests.md", "one 128x128x512 bf16 matmul = 512 cycles = {} ns", "hardware.TRN2: 512 / TensorE clock",
          trn2_constant(lambda: 512 / _trn2().clocks.tensor, "{:.1f}")),

    Quote("docs/cost-model.md", "**plus a fixed {} ns** (trn2)", "hardware.TRN2.act_fixed_ns", ACT_FIXED_NS),
    Quote("docs/cost-model.md", "**plus the same fixed {} ns** (trn2)", "hardware.TRN2.act_fixed_ns", ACT_FIXED_NS),
    Quote("docs/cost-model.md", "| activation-table load | {} ns of ScalarE", "hardware.TRN2.act_table_load_ns",
          ACT_TABLE_LOAD_NS),
    Quote("docs/cost-model.md", "plus a {} us wait (one cross-core semaphore exchange)", "hardware.TRN2.dma.fixed_ns",
          trn2_constant(lambda: _trn2().dma.fixed_ns / 1e3, "{:.1f}")),
    Quote("docs/cost-model.md", "`dma_fixed_ns`, {} / {} / {} ns.", "cost_params dma_fixed_ns",
          model_param("dma_fixed_ns")),
    Quote("docs/cost-model.md", "(one transfer per {} ns at 256 B and 1 KiB per partition",
          "cost_params.MID.dma_fixed_ns", model_param("dma_fixed_ns")[1]),
    Quote("docs/cost-model.md", "`dma_engine_stagger_ns` ({} / {} / {} ns) apart", "cost_params dma_engine_stagger_ns",
          model_param("dma_engine_stagger_ns")),
    Quote("docs/cost-model.md", "`dma_wake_ns` ({} / {} / {} ns; {} profiled in Example 1)", "cost_params dma_wake_ns",
          (*model_param("dma_wake_ns"), model_param("dma_wake_ns")[1])),
    Quote("docs/cost-model.md", "| ScalarE ACTIVATE fixed time / activation-table load | {} ns / {} ns (fitted on the "
          "DMA overview's profile) | none / {} ns (assumed) |", "hardware TRN2 / TRN1 ScalarE fixed times",
          (ACT_FIXED_NS, ACT_TABLE_LOAD_NS,
           trn2_constant(lambda: _chip("trn1").act_table_load_ns, "{:,.0f}"))),
    Quote("docs/cost-model.md", "ramps to full over {} us; re-engages below 50 % over a {} us window",
          "hardware.TRN2.didt_ramp_ns", (trn2_constant(lambda: _trn2().didt_ramp_ns / 1e3),) * 2),
    Quote("docs/cost-model.md", "| `dma_fixed_ns` | {} / {} / {} ns per transfer", "cost_params dma_fixed_ns",
          model_param("dma_fixed_ns")),
    Quote("docs/cost-model.md", "| `dma_wake_ns` | {} / {} / {} ns | {} profiled", "cost_params dma_wake_ns",
          (*model_param("dma_wake_ns"), model_param("dma_wake_ns")[1])),
    Quote("docs/cost-model.md", "| `dma_engine_stagger_ns` | {} / {} / {} ns between",
          "cost_params dma_engine_stagger_ns", model_param("dma_engine_stagger_ns")),
    Quote("docs/cost-model.md", "| `act_fixed_offset_ns` | {} / {} / +{} ns on the ACTIVATE fixed time",
          "cost_params act_fixed_offset_ns", model_param("act_fixed_offset_ns")),
    Quote("docs/cost-model.md", "| `startup_ns` (per launch) | {} / {} / {} us |", "cost_params.STANDALONE_LAUNCH",
          launch_param("startup_ns")),
    Quote("docs/cost-model.md", "| `core_skew_ns` (a launch of 2 programs, LNC 2) | {} / {} / {} us |",
          "cost_params.STANDALONE_LAUNCH", launch_param("core_skew_ns")),
    Quote("docs/cost-model.md", "| `hardware.TRN2.act_fixed_ns` | {} ns |", "hardware.TRN2.act_fixed_ns", ACT_FIXED_NS),
    Quote("docs/cost-model.md", "| `hardware.TRN2.act_table_load_ns` | {} ns |", "hardware.TRN2.act_table_load_ns",
          ACT_TABLE_LOAD_NS),
    Quote("docs/cost-model.md", "| `cost_params.dma_fixed_ns` low / high | {} / {} ns |", "cost_params dma_fixed_ns",
          model_param("dma_fixed_ns")[::2]),
    Quote("docs/cost-model.md", "| `cost_params.dma_fixed_ns` mid | {} ns |", "cost_params.MID.dma_fixed_ns",
          model_param("dma_fixed_ns")[1]),
    Quote("docs/cost-model.md", "| `cost_params.dma_wake_ns` mid | {} ns |", "cost_params.MID.dma_wake_ns",
          model_param("dma_wake_ns")[1]),
    Quote("docs/cost-model.md", "| `cost_params.dma_engine_stagger_ns` mid | {} ns (read off", "cost_params.MID."
          "dma_engine_stagger_ns", model_param("dma_engine_stagger_ns")[1]),
    Quote("docs/cost-model.md", "| `cost_params.STANDALONE_LAUNCH` mid `startup_ns` | {} us (read off, not fitted)",
          "cost_params.STANDALONE_LAUNCH", launch_param("startup_ns")[1]),
    Quote("docs/cost-model.md", "(`launch_low_us` ..: {} / {} / {} us at LNC 1, {} / {} / {} us at LNC 2)",
          "cost_params.STANDALONE_LAUNCH", (*launch_param("startup_ns"), *launch_lnc2())),
    Quote("docs/cost-model.md", "`core_skew_ns` ({} / {} / {} us)", "cost_params.STANDALONE_LAUNCH",
          launch_param("core_skew_ns")),
    Quote("docs/cost-model.md", "`startup_ns` ({} / {} / {} us)", "cost_params.STANDALONE_LAUNCH",
          launch_param("startup_ns")),
    Quote("docs/cost-model.md", "(measured at mid: the demo matmul {} -> {} us, {} %; `rope_fwd` {} -> {} us, {} %; "
          "`router_bwd` {} %; `router_fwd` {} %)", "derived_figures.csv mid and mid didt_throttle=True totals", (
              *didt_totals("demo_matmul"), didt_change("demo_matmul"), *didt_totals("rope_fwd"),
              didt_change("rope_fwd"), didt_change("router_bwd"), didt_change("router_fwd"))),
    Quote("docs/cost-model.md", "`test_attention_cte:875` (LNC 1, 3 x 12,345 tokens, d = 127, window 128; {} us "
          "recorded)", "nkilib_calibration.csv test_attention_cte:875",
          nkilib_cell("test_attention_cte:875", "published_us", "{:,.0f}")),
    Quote("docs/cost-model.md", "(`:721`: 4 x 10,240 tokens a core in {} us)", "nkilib_calibration.csv "
          "test_attention_cte:721", nkilib_cell("test_attention_cte:721", "published_us", "{:,.0f}")),
    Quote("docs/cost-model.md", "above the {} us recorded for the whole launch",
          "nkilib_calibration.csv test_mlp_tkg:302", nkilib_cell("test_mlp_tkg:302", "published_us")),
    Quote("docs/cost-model.md", "e.g. `:302` 167.4 -> {} us", "nkilib_calibration.csv test_mlp_tkg:302 low",
          nkilib_cell("test_mlp_tkg:302", "low_us")),
    Quote("docs/cost-model.md", "LNC 1; {} us recorded, {} / {} / {} us, {} % and above its range",
          "nkilib_calibration.csv test_mlp_cte:246", (
              *(nkilib_cell("test_mlp_cte:246", c) for c in ("published_us", "low_us", "mid_us", "high_us")),
              nkilib_cell("test_mlp_cte:246", "error", "{:+.1f}"))),
    Quote("docs/cost-model.md", "(`:735`: {} us recorded, {} / {} / {} us, inside its range)",
          "nkilib_calibration.csv test_attention_cte:735", (
              nkilib_cell("test_attention_cte:735", "published_us", "{:,.0f}"),
              *(nkilib_cell("test_attention_cte:735", c) for c in ("low_us", "mid_us", "high_us")))),
    Quote("docs/cost-model.md", "counterparts here are recorded at {} us (`:468`", "nkilib_calibration.csv "
          "test_attention_cte:468", nkilib_cell("test_attention_cte:468", "published_us", "{:,.0f}")),
    Quote("docs/cost-model.md", "moved 32 KiB in {} ns = 23.1 B/ns)", "calibration.csv dma_intro ex1 load engine",
          published("dma_intro ex1 load engine")),
    Quote("docs/cost-model.md", "moving 32 KiB in {} ns, 23.1 B/ns", "calibration.csv dma_intro ex1 load engine",
          published("dma_intro ex1 load engine")),
    Quote("docs/cost-model.md", "moves 2 KiB per engine in {} ns, \"a single 2KiB read\"",
          "calibration.csv dma_intro ex2 load engine", published("dma_intro ex2 load engine")),
    Quote("docs/cost-model.md", "shows one 2 KiB packet holding its engine {} ns", "calibration.csv dma_intro ex2 load "
          "engine", published("dma_intro ex2 load engine")),
    Quote("docs/cost-model.md", "VectorE {} ms of \"instruction time\" and 10.55 % active of {} ms",
          "calibration.csv kernel_opt v5 VectorE / kernel_opt v5",
          (published("kernel_opt v5 VectorE", "{:.2f}"), published("kernel_opt v5", "{:.2f}"))),
    Quote("docs/cost-model.md", "v2's 38.06 % of {} ms is 10.87 GB", "calibration.csv kernel_opt v2",
          published("kernel_opt v2", "{:.2f}")),
    Quote("docs/cost-model.md", "v4's 42.55 % of {} ms is 8.7 GB", "calibration.csv kernel_opt v4",
          published("kernel_opt v4", "{:.2f}")),
    Quote("docs/cost-model.md", "v5's 8.96 % of {} ms is 1.8 GB", "calibration.csv kernel_opt v5",
          published("kernel_opt v5", "{:.2f}")),
    Quote("docs/cost-model.md", "about a tenth of `mamba_v1 small`'s {} us", "calibration.csv mamba_v1 small",
          published("mamba_v1 small", "{:.2f}", 1e3)),
    Quote("docs/cost-model.md", "(35.45 -> 30.02 ms for {} published; tolerance", "calibration.csv kernel_opt v2",
          published("kernel_opt v2", "{:.2f}")),
    Quote("docs/cost-model.md", "v2 is 29.996 ms for 30.008 without it ({} published)", "calibration.csv kernel_opt v2",
          published("kernel_opt v2", "{:.2f}")),
    Quote("docs/cost-model.md", "would give 39.96 ms ({} published)", "calibration.csv kernel_opt v2",
          published("kernel_opt v2", "{:.2f}")),
    Quote("docs/cost-model.md", "of a {} us run, from VectorE's first instruction", "calibration.csv mamba_v1 small",
          published("mamba_v1 small", "{:.2f}", 1e3)),
    Quote("docs/cost-model.md", "Example 1 profile ({} ns for N = 4,096) |", "calibration.csv dma_intro ex1 activation",
          published("dma_intro ex1 activation")),
    Quote("docs/cost-model.md", "`dma_intro ex1 activation` ({} ns for N = 4,096 at 1.2 GHz)",
          "calibration.csv dma_intro ex1 activation", published("dma_intro ex1 activation")),
    Quote("docs/cost-model.md", "(its VectorE formulas add up to 1.45 ms of a {} ms kernel", "calibration.csv mamba_v2",
          published("mamba_v2", "{:.2f}")),
    Quote("docs/cost-model.md", "99.63 % active in {} ms while its formulas add up to 1.45 ms",
          "calibration.csv mamba_v2", published("mamba_v2", "{:.2f}")),
    Quote("docs/cost-model.md", "model's v4 has its {} us of waits only in its first block",
          "derived_figures.csv kernel_opt v4 tensor_waits_us", _ko("v4", quantity="tensor_waits_us", fmt="{:.0f}",
                                                                    scale=1.0)),
)


def quote_problem(q: Quote) -> str | None:
    """Why quote ``q`` is not in its page as its CSV gives it (None when it is)."""
    page = " ".join((ROOT / q.page).read_text().split())  # line breaks in the page are spaces
    try:
        text = q.text()
    except LookupError as exc:  # the CSV lost the row (e.g. a case not re-run yet)
        return f"{q.page}: '{q.template}': {exc} (from {q.source})"
    return None if text in page else f"{q.page}: expected '{text}' (from {q.source})"


def wrong_quotes() -> list[str]:
    """Quoted figures that are not in their page as their CSV gives them."""
    return [problem for problem in map(quote_problem, QUOTES) if problem]


NUMBER = r"([-+]?[\d,]*\.?\d+(?:e[-+]\d+)?%?)"  # a quoted value as the formats write: 1,234.5 / 95.3% / 7 / 3.4e-06


def refresh_quote(text: str, q: Quote) -> str | None:
    """``text`` with the values of quote ``q`` replaced by what its CSV gives now (line breaks kept), or
    None when the template's sentence is not found exactly once."""
    chunks = q.template.split("{}")
    pattern = NUMBER.join(r"\s+".join(re.escape(w) for w in chunk.split(" ")) for chunk in chunks)
    matches = list(re.finditer(pattern, text))
    if len(matches) != 1:
        return None
    values = (q.value if isinstance(q.value, tuple) else (q.value,))
    m = matches[0]
    out, pos = [], m.start()
    for i, value in enumerate(values, start=1):
        out += [text[pos:m.start(i)], value()]
        pos = m.end(i)
    return text[:m.start()] + "".join(out) + text[pos:]


def refresh_quotes() -> list[str]:
    """Rewrite every stale quoted figure in its page; returns the quotes that could not be rewritten."""
    left = []
    for q in QUOTES:
        problem = quote_problem(q)
        if problem is None:
            continue
        path = ROOT / q.page
        try:
            new = refresh_quote(path.read_text(), q)
        except LookupError:
            new = None
        if new is None:
            left.append(problem)
        else:
            path.write_text(new)
            print(f"updated quote in {q.page}: {q.text()}")
    return left


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def regenerate(text: str, where: str = "") -> str:
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise SystemExit(f"{where}: unknown generated region '{name}'; known: {sorted(GENERATORS)}")
        return m.group(1) + GENERATORS[name]() + m.group(4)

    return REGION.sub(fill, text)


def stale_regions() -> list[str]:
    """Files whose generated regions differ from what the CSVs give now."""
    stale = []
    for path in doc_files():
        text = path.read_text()
        if regenerate(text, str(path)) != text:
            stale.append(str(path.relative_to(ROOT)))
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale regions (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale, wrong = stale_regions(), wrong_quotes()
        for name in stale:
            print(f"stale generated table in {name}: run python scripts/docs_tables.py", file=sys.stderr)
        for line in wrong:
            print(f"quoted figure disagrees with its CSV: {line}", file=sys.stderr)
        return 1 if stale or wrong else 0
    for line in refresh_quotes():
        print(f"warning: quoted figure disagrees with its CSV and its sentence was not found once (edit the "
              f"text): {line}", file=sys.stderr)
    for path in doc_files():
        text = path.read_text()
        new = regenerate(text, str(path))
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
