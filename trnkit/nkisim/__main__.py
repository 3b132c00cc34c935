"""``python -m trnkit.nkisim run script.py [args...]`` / ``run -m module [args...]``: run unmodified
NKI code (``import nki``) on trnkit's CPU interpreter."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from . import install_as_nki


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trnkit.nkisim",
        description="Run NKI code with 'import nki' resolved to trnkit's CPU interpreter.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script (or -m module) as __main__")
    run.add_argument("-m", dest="module", help="run a module, like python -m")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args...] (or the module's args)")
    args = parser.parse_args(argv)
    if args.module is None and not args.target:
        parser.error("run: give a script path or -m module")
    install_as_nki()
    if args.module is not None:
        sys.argv = [args.module, *args.target]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        script, *rest = args.target
        sys.argv = [script, *rest]
        sys.path.insert(0, str(Path(script).resolve().parent))  # as 'python script.py' does
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
