"""What :func:`~trnkit.overrides.apply.apply_overrides` did, per module."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OverrideRow:
    """One swap point: module path, op, the impl that will run, and why."""

    module: str
    op: str
    impl: str  # the impl that runs ("nki", "reference", a user's; "original" = the module's own forward)
    requested: str
    status: str  # "swapped" | "fallback" | "off"
    reason: str = ""
    code: str = ""  # whose code ``impl`` is when it is not trnkit's built-in (registry.foreign_code)


@dataclass
class OverrideReport:
    """Rows of :class:`OverrideRow`; ``table()`` renders them for logs (the trainer prints it)."""

    policy: str
    rows: list[OverrideRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what applied to every row (a skipped validation dry run)

    def table(self) -> str:
        header = ("module", "op", "impl", "status", "reason")
        body = [(r.module, r.op, r.impl if r.impl == r.requested else f"{r.impl} (requested {r.requested})",
                 r.status, r.reason or "-") for r in self.rows]
        widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h)
                  for i, h in enumerate(header[:-1])]
        lines = [f"trnkit overrides (policy {self.policy}): {self.summary()}"]
        for row in (header, *body):
            cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
            lines.append("  ".join((*cells, row[-1])).rstrip())
        lines.extend(f"  {line}" for line in (*self.code_lines(), *self.notes))
        return "\n".join(lines)

    def code_lines(self) -> list[str]:
        """One line per impl that runs code other than trnkit's built-ins, naming that code."""
        seen = dict.fromkeys((r.op, r.impl, r.code) for r in self.rows if r.code)
        return [f"{op}[{impl}] runs {code}" for op, impl, code in seen]

    def summary(self) -> str:
        counts = Counter(r.status for r in self.rows)
        return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no swap points found"

    def __str__(self) -> str:
        return self.table()
