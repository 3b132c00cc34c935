"""The trainer's console output, through :mod:`logging` (logger ``trnkit.harness``).

Rank 0 logs by default; ``--log_rank all`` (``metrics.log_rank = "all"``) lets every rank log, each line
prefixed with its rank, and ``--log_rank N`` picks rank N. Messages go to the current ``sys.stdout``
through ``tqdm.write``, which clears the progress bar (on stderr) and redraws it below the message, so
the two never garble each other. Records also propagate to the root logger (pytest's caplog, a user's
own handlers).
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, TextIO

__all__ = ["LOGGER", "ProgressLine", "interrupt_message", "setup_logging", "trnkit_warnings_logged"]

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


_PACKAGE = Path(__file__).resolve().parents[1]  # the trnkit package folder


@contextlib.contextmanager
def trnkit_warnings_logged() -> Iterator[None]:
    """Within it, a warning that trnkit's own code issues (e.g. an override falling back to the module's code)
    is a ``WARNING:`` line of :data:`LOGGER` like the trainer's other warnings; other warnings show as usual.
    The process's warning display is restored on exit."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
            if Path(filename).resolve().is_relative_to(_PACKAGE):
                LOGGER.warning(str(message))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLine:
    """The progress bar's content as a plain line every ``every`` steps, for a stderr that is not a terminal
    (a log file, a scheduler's capture): ``step 10/50 (20%)  loss 5.1234  tokens/s 1,234  elapsed 0:00:42  ETA
    0:02:48``. tokens/s is over the steps since the previous line; the ETA is the mean step time of this
    run so far times the steps left."""

    def __init__(self, total_steps: int, start_step: int, every: int, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.start, self.every = total_steps, start_step, every
        self.stream, self.clock = stream, clock
        self._t0 = self._t_last = clock()
        self._tokens = 0

    def update(self, step: int, loss: float, tokens: int) -> str | None:
        """Count this step's ``tokens``; on every ``every``-th step (and the last) write and return the line."""
        self._tokens += tokens
        if step % self.every and step != self.total:
            return None
        now = self.clock()
        tps = self._tokens / max(now - self._t_last, 1e-9)
        per_step = (now - self._t0) / max(step - self.start, 1)
        line = (f"[trnkit] step {step}/{self.total} ({step / self.total:.0%})  loss {loss:.4f}  "
                f"tokens/s {tps:,.0f}  elapsed {_clock(now - self._t0)}  ETA {_clock(per_step * (self.total - step))}")
        print(line, file=self.stream or sys.stderr, flush=True)
        self._t_last, self._tokens = now, 0
        return line


def interrupt_message(signal_name: str, kept: tuple[int, str] | None, checkpoint_enabled: bool, resume: bool,
                      dump_folder: str, argv: list[str], started: bool = True,
                      outputs: tuple[str, ...] = ("metrics.jsonl", "loss.png")) -> str:
    """What the trainer prints when Ctrl-C (or SIGTERM) stops it: what was kept and the command that resumes.
    ``started``: false when it stopped the run while starting (checks, data, model, loading a checkpoint).
    ``outputs``: the files the run keeps in ``dump_folder`` (those metrics.jsonl / metrics.plot turn on)."""
    command = "python -m trnkit.harness.train " + shlex.join(argv)  # under torchrun: the same torchrun command
    if not started:  # the run folder's checkpoints are as they were: the same command resumes from them
        return (f"interrupted ({signal_name}) while the run was starting, before its first step: nothing was "
                f"trained; rerun with:\n  {command}")
    head = f"interrupted ({signal_name})"
    if outputs:
        head += f"; {' and '.join(outputs)} {'is' if len(outputs) == 1 else 'are'} kept in {dump_folder}"
    if kept is not None:
        step, path = kept
        flag = "" if resume else " --checkpoint.resume true"
        return f"{head}; kept checkpoint {path} (step {step}); resume with:\n  {command}{flag}"
    if checkpoint_enabled:
        return (f"{head}; no checkpoint was written yet, so a rerun starts from step 1:\n  {command}")
    return (f"{head}; checkpoints are off (checkpoint.enable = false), so nothing can be resumed; a rerun starts "
            f"from step 1 (add --checkpoint.enable true to keep checkpoints):\n  {command}")
