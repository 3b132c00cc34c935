"""The trainer's console output, through :mod:`logging` (logger ``trnkit.harness``).

Rank 0 logs by default; ``--log_rank all`` (``metrics.log_rank = "all"``) lets every rank log, each line
prefixed with its rank, and ``--log_rank N`` picks rank N. Messages go to the current ``sys.stdout``
through ``tqdm.write``, which clears the progress bar (on stderr) and redraws it below the message, so
the two never garble each other. Records also propagate to the root logger (pytest's caplog, a user's
own handlers).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOGGER", "setup_logging"]

LOGGER = logging.getLogger("trnkit.harness")


class _ConsoleHandler(logging.Handler):
    """Writes to whatever ``sys.stdout`` is at emit time, around any live tqdm bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            try:
                from tqdm import tqdm
            except ImportError:  # no tqdm, no bar to step around
                print(msg, file=sys.stdout, flush=True)
                return
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must never stop training
            self.handleError(record)


class _Formatter(logging.Formatter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING and not msg.startswith(record.levelname):
            msg = f"{record.levelname}: {msg}"
        return f"{self.prefix} {msg}"


class _RankFilter(logging.Filter):
    def __init__(self, show: bool) -> None:
        super().__init__()
        self.show = show

    def filter(self, record: logging.LogRecord) -> bool:
        return self.show


def setup_logging(rank: int, world_size: int, log_rank: str = "0") -> logging.Logger:
    """Configure :data:`LOGGER` for this process (idempotent: one console handler, one rank filter)."""
    show = log_rank == "all" or int(log_rank) == rank
    prefix = f"[trnkit rank {rank}]" if log_rank == "all" and world_size > 1 else "[trnkit]"
    for f in [f for f in LOGGER.filters if isinstance(f, _RankFilter)]:
        LOGGER.removeFilter(f)
    LOGGER.addFilter(_RankFilter(show))
    handler = next((h for h in LOGGER.handlers if isinstance(h, _ConsoleHandler)), None)
    if handler is None:
        handler = _ConsoleHandler()
        LOGGER.addHandler(handler)
    handler.setFormatter(_Formatter(prefix))
    LOGGER.setLevel(logging.INFO)
    return LOGGER
