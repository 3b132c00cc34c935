"""Markdown tables of benchmark rows: one line per (kernel, mode, x), the numbers side by side."""

from __future__ import annotations

from collections.abc import Iterable

from trnkit.bench.schema import Row


def _key(r: Row) -> tuple:
    x = r.x_value
    mode = (0 if r.mode == "forward" else 1, r.mode)
    return (r.kernel, mode, r.x_name, (0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)),
            r.config_key)


def _fmt(v: float | None, unit: str = "us") -> str:
    if v is None:
        return "-"
    if unit == "ratio":
        return f"{v:.1%}"
    return f"{v:,.1f}" if v >= 10 else f"{v:.2f}"


def _span(r: Row | None, unit: str = "us") -> str:
    """``mid [low-high]`` of an estimate row (just the value when it has no range)."""
    if r is None:
        return "-"
    if r.p20 == r.p50 == r.p80:
        return _fmt(r.p50, unit)
    return f"{_fmt(r.p50, unit)} [{_fmt(r.p20, unit)}-{_fmt(r.p80, unit)}]"


def markdown_table(rows: Iterable[Row]) -> str:
    """Estimated kernel time, roofline, fraction, bottleneck and the measured torch reference per shape.

    Columns say which numbers are cost-model estimates (trn2) and which are measured (torch on this host,
    or the kernel on Trainium when the real ``nki`` ran)."""
    groups: dict[tuple, dict[tuple[str, str], Row]] = {}
    for r in rows:
        groups.setdefault(_key(r), {})[(r.impl, r.metric)] = r
    header = ("| kernel | mode | shape | config | est. trn2 (us) mid [low-high] | roofline (us) | "
              "fraction of roofline mid [low-high] | bottleneck | measured nki (us) | "
              "measured torch ref (us, p50 [p20-p80]) | torch device |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for key in sorted(groups):
        g = groups[key]
        kernel, (_, mode), x_name = key[:3]
        any_row = next(iter(g.values()))
        est, roof = g.get(("nki", "est_time")), g.get(("roofline", "est_time"))
        frac = g.get(("nki", "fraction_of_roofline"))
        real, ref = g.get(("nki", "wall_time")), g.get(("torch", "wall_time"))
        cfg_s = ", ".join(f"{k}={v}" for k, v in sorted(any_row.config.items()))
        ref_s = f"{_fmt(ref.p50)} [{_fmt(ref.p20)}-{_fmt(ref.p80)}]" if ref else "-"
        lines.append(
            f"| {kernel} | {mode} | {x_name}={any_row.x_value} | {cfg_s} | {_span(est)} | "
            f"{_fmt(roof.p50 if roof else None)} | {_span(frac, 'ratio')} | "
            f"{est.details.get('bottleneck', '-') if est else '-'} | {_fmt(real.p50 if real else None)} | "
            f"{ref_s} | {ref.device if ref else '-'} |")
    return "\n".join(lines)
