"""The one CSV schema every trnkit benchmark writes (modelled on Liger-Kernel's benchmark CSV).

A row is one number for one (kernel, impl, mode, metric, x): ``p50`` with ``p20``/``p80`` quantiles for
measured times. For cost-model estimates ``p50`` is the mid estimate and ``p20`` / ``p80`` the low / high
end of its range (the optimistic / pessimistic parameter settings of ``trnkit.nkisim.cost_params``;
for a fraction of roofline, low = the pessimistic end); rows without a range repeat the value. ``device`` says where the
number comes from: ``"trn2 (cost model)"`` for estimates, the host CPU for measured torch / interpreter
times, ``"trainium"`` for real-device measurements.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

COLUMNS = ("kernel", "impl", "mode", "metric", "unit", "x_name", "x_value", "p50", "p20", "p80",
           "extra", "device", "timestamp", "trnkit_version")


@dataclass(frozen=True)
class Row:
    kernel: str  # "rope_hf"
    impl: str  # "nki" (the kernel), "roofline", "torch" (reference op), ...
    mode: str  # "forward" | "backward"
    metric: str  # "est_time", "busy_tensor", "fraction_of_roofline", "wall_time", ...
    unit: str  # "us" | "ratio"
    x_name: str  # swept quantity: "S", "T", "flavor", ...
    x_value: float | int | str
    p50: float
    p20: float
    p80: float
    extra: str  # JSON: the rest of the configuration (+ estimate details)
    device: str
    timestamp: str
    trnkit_version: str

    def __post_init__(self) -> None:
        for q in ("p50", "p20", "p80"):
            v = getattr(self, q)
            if not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"bench Row: {q} must be a number, got {v!r} "
                                 f"({self.kernel}/{self.impl}/{self.metric} at {self.x_name}={self.x_value})")

    @property
    def config(self) -> dict:
        """The case configuration (``extra`` without the per-number ``details``)."""
        cfg = json.loads(self.extra) if self.extra else {}
        cfg.pop("details", None)
        return cfg

    @property
    def details(self) -> dict:
        """What the harness recorded with this number (estimate model, bottleneck, ...)."""
        return json.loads(self.extra).get("details", {}) if self.extra else {}

    @property
    def config_key(self) -> str:
        return json.dumps(self.config, sort_keys=True)


assert tuple(f.name for f in fields(Row)) == COLUMNS


def write_rows(path: str | Path, rows: Iterable[Row], append: bool = True) -> Path:
    """Append (or overwrite) rows to a CSV file with the header written once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not (append and path.exists() and path.stat().st_size > 0)
    with path.open("a" if append else "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    return path


def _parse_x(v: str) -> float | int | str:
    for typ in (int, float):
        try:
            return typ(v)
        except ValueError:
            pass
    return v


def read_rows(path: str | Path) -> list[Row]:
    """Read a benchmark CSV back into rows (numbers parsed)."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"bench: {path} does not have the trnkit benchmark columns "
                             f"(got {reader.fieldnames}, expected {list(COLUMNS)})")
        return [Row(**{**d, "x_value": _parse_x(d["x_value"]), "p50": float(d["p50"]), "p20": float(d["p20"]),
                       "p80": float(d["p80"])}) for d in reader]


def latest_rows(rows: Iterable[Row]) -> list[Row]:
    """The newest row per (kernel, impl, mode, metric, x, config): later rows of an appended CSV win."""
    latest = {}
    for r in rows:
        latest[(r.kernel, r.impl, r.mode, r.metric, r.x_name, r.x_value, r.config_key)] = r
    return list(latest.values())


def merge_newest(path: str | Path) -> int:
    """Rewrite the CSV at ``path`` keeping only the newest row per (kernel, impl, mode, metric, x, config)
    (:func:`latest_rows`): a re-run of some kernels or shapes replaces their earlier rows and leaves the
    other rows as they were. Returns how many rows were dropped."""
    rows = read_rows(path)
    newest = latest_rows(rows)
    if len(newest) < len(rows):
        write_rows(path, newest, append=False)
    return len(rows) - len(newest)
