"""Where benchmark outputs go: a scratch folder by default, the tracked reference data only on request.

``benchmarks/data/`` holds the reference figures that the docs quote (``scripts/docs_tables.py`` builds
tables from them), so a run changes them only when asked with ``--save-reference``; every other run
writes under ``outputs/bench/``, which git ignores. ``--out DIR`` picks any other folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REFERENCE_DIR = Path("benchmarks") / "data"
SCRATCH_DIR = Path("outputs") / "bench"


def add_output_args(parser: argparse.ArgumentParser, what: str) -> None:
    """``--save-reference`` and ``--out DIR`` (mutually exclusive) for a benchmark writing ``what``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--save-reference", action="store_true",
                       help=f"write {what} to {REFERENCE_DIR}/, the tracked figures the docs quote "
                            f"(default: {SCRATCH_DIR}/, ignored by git)")
    group.add_argument("--out", type=Path, default=None, help=f"write {what} to this folder instead")


def output_dir(args: argparse.Namespace, root: Path | None = None, scratch_sub: str = "") -> Path:
    """The folder a run writes to: ``--out``, else the reference folder with ``--save-reference``, else
    the scratch folder (``scratch_sub`` below it). ``root`` anchors the defaults (default: the cwd)."""
    if args.out is not None:
        return args.out
    base = root if root is not None else Path()
    if args.save_reference:
        return base / REFERENCE_DIR
    return base / SCRATCH_DIR / scratch_sub


def load_script(path: Path, name: str) -> ModuleType:
    """Import the script at ``path`` (e.g. ``scripts/docs_tables.py``, not a package module) as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
