"""Matplotlib PNGs of benchmark rows, one pair per (kernel, mode):

* ``<kernel>_<mode>_<x_name>[_<dtype>]_time.png`` — estimated trn2 time (mid, low-high range shaded) vs the swept
  shape, the roofline bound (dashed) and,
  on the same axis, the measured torch reference on this host (dotted; a different device, labelled).
* ``<kernel>_<mode>_<x_name>[_<dtype>]_engines.png`` — per-engine busy time / estimated total and the fraction of
  roofline.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from trnkit.bench.schema import Row


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in name)


def _series(rows: list[Row], impl: str, metric: str) -> dict:
    return {r.x_value: r for r in rows if r.impl == impl and r.metric == metric}


def _xs(values: Iterable) -> tuple[list, list, bool]:
    vals = list(dict.fromkeys(values))
    numeric = all(isinstance(v, (int, float)) for v in vals)
    if numeric:
        vals.sort()
        return vals, vals, True
    return vals, list(range(len(vals))), False


def plot_rows(rows: Iterable[Row], out_dir: str | Path) -> list[Path]:
    """Write the PNGs for every (kernel, mode) that has cost-model estimates; returns their paths."""
    import matplotlib  # optional dependency, imported only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # one plot per sweep and dtype (in a flavor sweep the other config values change with x by design)
    groups: dict[tuple[str, str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.kernel, r.mode, r.x_name, str(r.config.get("dtype", ""))), []).append(r)
    sweep_cfgs: dict[tuple[str, str, str], list[str]] = {}
    for key in groups:
        sweep_cfgs.setdefault(key[:3], []).append(key[3])
    written: list[Path] = []
    for (kernel, mode, x_name, dtype), g in sorted(groups.items()):
        est = _series(g, "nki", "est_time")
        if not est:
            continue
        labels, pos, numeric = _xs(est)
        at = dict(zip(labels, pos))
        dev = next(iter(est.values())).device

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for (impl, metric, style, name) in (("nki", "est_time", "o-", f"NKI kernel, estimated ({dev})"),
                                            ("roofline", "est_time", "k--", "roofline bound (trn2)"),
                                            ("nki", "wall_time", "s-", "NKI kernel, measured (Trainium)"),
                                            ("torch", "wall_time", "^:", None)):
            s = _series(g, impl, metric)
            if not s:
                continue
            xs = [x for x in labels if x in s]
            if name is None:
                name = f"torch reference, measured ({next(iter(s.values())).device})"
            ax.plot([at[x] for x in xs], [s[x].p50 for x in xs], style, label=name)
            if impl == "torch" or (impl, metric) == ("nki", "est_time"):  # measured spread / model range
                ax.fill_between([at[x] for x in xs], [s[x].p20 for x in xs], [s[x].p80 for x in xs], alpha=0.2)
        ax.set_yscale("log")
        if numeric and len(labels) > 1 and max(labels) / max(min(labels), 1e-12) >= 8:
            ax.set_xscale("log", base=2)
        if not numeric:
            ax.set_xticks(pos, [str(x) for x in labels])
        ax.set_xlabel(x_name)
        ax.set_ylabel("time (us)")
        ax.set_title(f"{kernel} {mode}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        stem = "_".join(_safe(t) for t in (kernel, mode, x_name))
        if len(sweep_cfgs[(kernel, mode, x_name)]) > 1:
            stem += f"_{_safe(dtype)}"
        p = out_dir / f"{stem}_time.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        engines = sorted({r.metric[5:] for r in g if r.impl == "nki" and r.metric.startswith("busy_")})
        for eng in engines:
            s = _series(g, "nki", f"busy_{eng}")
            xs = [x for x in labels if x in s and x in est]
            ax.plot([at[x] for x in xs], [s[x].p50 / est[x].p50 for x in xs], "o-", label=f"{eng} busy / total")
        frac = _series(g, "nki", "fraction_of_roofline")
        xs = [x for x in labels if x in frac]
        ax.plot([at[x] for x in xs], [frac[x].p50 for x in xs], "k*--",
                label="fraction of roofline (mid, range shaded)")
        ax.fill_between([at[x] for x in xs], [frac[x].p20 for x in xs], [frac[x].p80 for x in xs], color="k", alpha=0.1)
        if numeric and len(labels) > 1 and max(labels) / max(min(labels), 1e-12) >= 8:
            ax.set_xscale("log", base=2)
        if not numeric:
            ax.set_xticks(pos, [str(x) for x in labels])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel(x_name)
        ax.set_ylabel("fraction (estimated, trn2 cost model)")
        ax.set_title(f"{kernel} {mode}: engine utilisation")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"{stem}_engines.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written
