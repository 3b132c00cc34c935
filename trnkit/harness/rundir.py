"""The dump folder of a run: a fresh run never overwrites the files of an earlier run in the same folder.

A run that starts from step 0 (``--checkpoint.resume false``, checkpoints off, or nothing to resume)
in a folder that holds an earlier run's ``metrics.jsonl`` or checkpoints first moves that run's files
into ``<dump_folder>/previous-<UTC time>/``; nothing is deleted.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from trnkit.harness.checkpoint import list_checkpoints

# What a run writes directly under its dump folder (the checkpoint folder is added by the caller).
RUN_FILES = ("metrics.jsonl", "config.toml", "stack.lock", "loss.png", "hf_export")


def archive_previous_run(dump: str, checkpoint_folder: str, log: Callable[[str], None]) -> str | None:
    """Move an earlier run's files out of the way; returns the archive folder (None: nothing to move)."""
    ckpt_dir = os.path.join(dump, checkpoint_folder)
    if not (os.path.isfile(os.path.join(dump, "metrics.jsonl")) or list_checkpoints(ckpt_dir)):
        return None
    base = os.path.join(dump, "previous-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    dest, n = base, 1
    while os.path.exists(dest):
        n += 1
        dest = f"{base}-{n}"
    os.makedirs(dest)
    ckpt_name = "checkpoint" if os.path.isabs(checkpoint_folder) else os.path.normpath(checkpoint_folder)
    moves = [(os.path.join(dump, f), os.path.join(dest, f)) for f in RUN_FILES]
    moves.append((ckpt_dir, os.path.join(dest, ckpt_name)))
    for src, dst in moves:
        if os.path.exists(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
    log(f"fresh start: the earlier run's files in {dump} were moved to {dest} (nothing was deleted)")
    return dest


__all__ = ["RUN_FILES", "archive_previous_run"]
