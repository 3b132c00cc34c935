"""``[overrides] plugins``: user modules imported before the override impls are resolved.

A plugin registers its kernels with :func:`trnkit.overrides.register` when imported, so the config can
name them in ``[overrides] impl``. Modules are found on ``sys.path`` (the launch directory is on it under
``python -m`` and ``torchrun -m``; otherwise set ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib
import importlib.util
import types

from trnkit.errors import ConfigError, raised_at

__all__ = ["import_plugins", "user_code_error"]


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
                              f"{user_code_error(e, name)}") from e
    return modules


def user_code_error(e: BaseException, name: str, when: str = "while being imported") -> str:
    """What went wrong in the user's module ``name`` and where: ``RuntimeError: boom (at /path/mod.py:3)``
    (``when``: what the module was doing, for a ``sys.exit``)."""
    return f"{_describe(e, when)}{_where(e, name)}"


def _describe(e: BaseException, when: str) -> str:
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r}) {when}"
    return f"{type(e).__name__}: {e}"


def _where(e: BaseException, name: str) -> str:
    """`` (at file:line)`` of the plugin's own innermost frame (else the innermost one): the line of the
    plugin that failed, not the library's line that raised."""
    if isinstance(e, ModuleNotFoundError) and e.name is not None and name.startswith(e.name):
        return " (is it on sys.path / PYTHONPATH?)"
    return raised_at(e, _origin(name))


def _origin(name: str) -> str | None:
    """The plugin's file, as the import system found it (None when it cannot tell)."""
    try:
        spec = importlib.util.find_spec(name)
    except Exception:  # noqa: BLE001 - a parent package that fails to import: no file to name
        return None
    return spec.origin if spec is not None else None
