"""The interpreter's error type and the one helper every rule check goes through.

Messages always name the op (or tensor), the rule and the offending values, e.g.
``"nc_matmul: stationary free size 256 exceeds gemm_stationary_fmax (128)"``.
"""

from __future__ import annotations

import string
from typing import Any

__all__ = ["NkiValidationError", "require", "fail"]


class NkiValidationError(AssertionError):
    """A kernel broke an NKI/hardware rule (shape, dtype, buffer, bounds, capacity).

    Subclasses ``AssertionError`` because the official simulator raises ``AssertionError`` for the
    same checks (``nki.isa.NkiValidationError`` is the documented name).
    """


_FMT = string.Formatter()


def _message(op: str, rule: str, values: dict[str, Any]) -> str:
    used = {field for _, field, _, _ in _FMT.parse(rule) if field}
    text = rule.format(**values) if used else rule
    extra = {k: v for k, v in values.items() if k not in used}
    if extra:
        text += " (" + ", ".join(f"{k}={v!r}" for k, v in extra.items()) + ")"
    return f"{op}: {text}"


def fail(op: str, rule: str, /, **values: Any) -> None:
    """Raise :class:`NkiValidationError` for ``op`` breaking ``rule``.

    ``rule`` may use ``{name}`` placeholders filled from ``values``; values it does not mention are
    appended as ``(name=value, ...)`` so the message always shows them.
    """
    raise NkiValidationError(_message(op, rule, values))


def require(cond: Any, op: str, rule: str, /, **values: Any) -> None:
    """Raise :class:`NkiValidationError` unless ``cond`` holds (see :func:`fail` for the message)."""
    if not cond:
        raise NkiValidationError(_message(op, rule, values))
