"""Declared input constraints shared by every kernel.

Each kernel module has ``constraints(...) -> list[Violation]`` (empty list = the kernel can serve these
inputs). The override registry calls it before training and at each call; the kernel's own entry check
raises :class:`KernelConstraintError` with the same messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trnkit.errors import TrnkitError


@dataclass(frozen=True)
class Violation:
    """One unmet constraint: which kernel, which rule, the offending value, and why it matters."""

    kernel: str
    constraint: str  # short rule, e.g. "D <= 128"
    value: Any  # what was seen, e.g. 192
    reason: str = ""  # why the kernel needs it / what to do

    def __str__(self) -> str:
        msg = f"{self.kernel}: constraint '{self.constraint}' violated (got {self.value!r})"
        return f"{msg}: {self.reason}" if self.reason else msg


class KernelConstraintError(TrnkitError, ValueError):
    """Raised by a kernel's entry check when its inputs violate declared constraints."""

    def __init__(self, violations: Iterable[Violation]) -> None:
        self.violations = list(violations)
        super().__init__("; ".join(str(v) for v in self.violations))


def check(violations: list[Violation]) -> None:
    """Raise :class:`KernelConstraintError` if ``violations`` is non-empty."""
    if violations:
        raise KernelConstraintError(violations)
