"""The base class of every error that is the user's to fix (a leaf module: every layer may import it).

A :class:`TrnkitError` names what is wrong (the config key, the op, the file), the rule it breaks and
the value it saw, so its message alone tells the user what to change. The trainer's command line prints
any of them as one ``error: ...`` message and exits with status 2, without a traceback (``--debug`` or
``TRNKIT_DEBUG=1`` shows one); anything else is a bug and keeps its traceback.

Subclasses keep the built-in base they had (``ValueError``, ``RuntimeError``) so existing ``except``
clauses still catch them.
"""

from __future__ import annotations

import traceback

__all__ = ["ConfigError", "DiskWriteError", "TrnkitError", "raised_at"]


class TrnkitError(Exception):
    """A mistake the user can fix: bad config, data, model folder, checkpoint, disk, kernel inputs."""


class ConfigError(TrnkitError, ValueError):
    """A bad configuration value (trainer config, model config, override names, plugins)."""


class DiskWriteError(TrnkitError, RuntimeError):
    """A run's file (checkpoint, HF export, metrics) could not be written (disk full, folder gone); the
    message names what was kept."""


def raised_at(e: BaseException, source: str | None = None) -> str:
    """`` (at file:line)`` of the innermost frame of ``e``'s traceback (empty when it has none); with ``source``
    (a file name), of the innermost frame in that file when there is one (the user's line, not the library's)."""
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if source is not None and f.filename == source]
    frames = own or frames
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
