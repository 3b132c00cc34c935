"""``[overrides] plugins``: user modules imported before the override impls are resolved.

A plugin registers its kernels with :func:`trnkit.overrides.register` when imported, so the config can
name them in ``[overrides] impl``. Modules are found on ``sys.path`` (the launch directory is on it under
``python -m`` and ``torchrun -m``; otherwise set ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib
import traceback
import types

from trnkit.harness.config import ConfigError

__all__ = ["import_plugins"]


def import_plugins(names: list[str]) -> list[types.ModuleType]:
    """Import each module in ``names`` (in order); a failure is a :class:`ConfigError` naming the module."""
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except Exception as e:  # noqa: BLE001 - any error inside a user's module is theirs to fix
            raise ConfigError(f"config overrides.plugins: cannot import plugin module {name!r}: "
                              f"{type(e).__name__}: {e}{_where(e, name)}") from e
    return modules


def _where(e: BaseException, name: str) -> str:
    """`` (at file:line)`` of the innermost frame, when the error was raised inside the plugin's code."""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, ModuleNotFoundError) and e.name is not None and name.startswith(e.name):
        return " (is it on sys.path / PYTHONPATH?)"
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
