"""``[overrides] plugins``: user modules imported before the override impls are resolved.

A plugin registers its kernels with :func:`trnkit.overrides.register` when imported, so the config can
name them in ``[overrides] impl``. Modules are found on ``sys.path`` (the launch directory is on it under
``python -m`` and ``torchrun -m``; otherwise set ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib
import types

from trnkit.errors import ConfigError, raised_at

__all__ = ["import_plugins"]


def import_plugins(names: list[str]) -> list[types.ModuleType]:
    """Import each module in ``names`` (in order); a failure is a :class:`ConfigError` naming the module.

    Any exception raised by the module's code counts, ``SystemExit`` included (a plugin calling
    ``sys.exit(0)`` must not end the run as a success with nothing trained).
    """
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except (Exception, SystemExit) as e:  # any error inside a user's module is theirs to fix
            raise ConfigError(f"config overrides.plugins: cannot import plugin module {name!r}: "
                              f"{_describe(e)}{_where(e, name)}") from e
    return modules


def _describe(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r}) while being imported"
    return f"{type(e).__name__}: {e}"


def _where(e: BaseException, name: str) -> str:
    """`` (at file:line)`` of the innermost frame, when the error was raised inside the plugin's code."""
    if isinstance(e, ModuleNotFoundError) and e.name is not None and name.startswith(e.name):
        return " (is it on sys.path / PYTHONPATH?)"
    return raised_at(e)
