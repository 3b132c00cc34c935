"""Overlay the loss curves of several runs: ``python -m trnkit.harness.plot A/metrics.jsonl B/metrics.jsonl -o
cmp.png``.

Labels default to each run's folder name; pass ``--labels a,b`` to choose them. A run's validation loss
(records with ``val_loss``) is drawn dashed in its colour.
"""

from __future__ import annotations

import argparse
import os
import sys

from trnkit.errors import ConfigError, TrnkitError
from trnkit.harness.metrics import read_jsonl


def plot_runs(paths: list[str], out: str, labels: list[str] | None = None, title: str = "loss") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    if len(labels) != len(paths):
        raise ConfigError(f"plot_runs: --labels must name one label per run: {len(labels)} labels for "
                          f"{len(paths)} runs, got {labels!r}")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ConfigError(f"plot_runs: each run must be a metrics.jsonl file; not a file: {missing}")
    runs = [read_jsonl(p) for p in paths]
    empty = [p for p, recs in zip(paths, runs) if not recs]
    if empty:
        raise ConfigError(f"plot_runs: {', '.join(empty)} holds no loss records")
    for path, recs in zip(paths, runs):
        bad = next((i for i, r in enumerate(recs) if not isinstance(r.get("loss"), (int, float))), None)
        if bad is not None:
            raise ConfigError(f"plot_runs: record {bad + 1} of {path} has no numeric loss, got {recs[bad]!r:.120}")
    _check_out(out)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for recs, label, marker in zip(runs, labels, "o.s^v"):
        (line,) = ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], marker=marker, ms=3, lw=1,
                          label=label)
        val = [r for r in recs if r.get("val_loss") is not None]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], ls="--", marker=marker, ms=3, lw=1,
                    color=line.get_color(), label=f"{label} (validation)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out)
    except OSError as e:
        raise ConfigError(f"plot_runs -o: cannot write {out} ({type(e).__name__}: {e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out


def _check_out(out: str) -> None:
    """The image path: not a folder (matplotlib would write '<folder>.png' beside it), with an image format
    matplotlib writes as its extension."""
    if os.path.isdir(out):
        raise ConfigError(f"plot_runs -o: {out} is a folder; name the image file, e.g. {os.path.join(out, 'cmp.png')}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = sorted(FigureCanvasAgg.get_supported_filetypes())
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if ext not in formats:
        raise ConfigError(f"plot_runs -o: the image format must be one of {formats} (the file's extension), "
                          f"got {out!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trnkit.harness.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    p.add_argument("-o", "--out", default="loss_compare.png")
    p.add_argument("--labels", default="", help="comma-separated, one per run")
    p.add_argument("--title", default="loss")
    a = p.parse_args(argv)
    try:
        print(plot_runs(a.metrics, a.out, [x for x in a.labels.split(",") if x] or None, a.title))
    except TrnkitError as e:  # a missing or malformed metrics file, a label count: one message, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
