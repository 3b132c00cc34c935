"""``python -m trnkit env|demo|conformance``.

* ``env``  — versions and install paths of trnkit's dependencies and the active NKI backend;
  ``env --lock`` prints them as a lock file that ``[job] stack`` checks before a run.
* ``demo`` — runs a tiled matmul NKI kernel (or ``--kernel rope_hf``) on the active backend, checks it
  against torch and prints its estimated trn2 time per engine (cost model).
* ``conformance`` — runs AWS nki-library's kernels on the interpreter against nki-library's own
  references and tolerances (needs a checkout: ``NKILIB_SRC``), one row per case.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from trnkit.errors import TrnkitError


def _cmd_env(args: argparse.Namespace) -> int:
    from trnkit import envinfo

    if args.lock:
        print(envinfo.lock_text(envinfo.current_stack()), end="")
        return 0
    info = envinfo.collect()
    print(json.dumps(info, indent=2) if args.json else envinfo.format_env(info))
    return 0


DEMO_MAX = 16384  # per dimension: the demo runs on the interpreter, where larger ones take minutes and GiBs


def _demo_size_problem(flag: str, value: int, multiple: int) -> str | None:
    """Why ``value`` cannot be the demo's ``flag`` (an integer in [multiple, DEMO_MAX], a multiple of the tile
    size ``multiple``), or None."""
    if multiple <= value <= DEMO_MAX and value % multiple == 0:
        return None
    rule = f"a multiple of {multiple} in [{multiple}, {DEMO_MAX}]" if multiple > 1 else f"in [1, {DEMO_MAX}]"
    return f"python -m trnkit demo {flag}: must be {rule}, got {value}"


def _cmd_demo(args: argparse.Namespace) -> int:
    from trnkit import demo

    sizes = ([("--seq", args.seq, 1)] if args.kernel == "rope_hf" else
             [("--m", args.m, demo.TILE_M), ("--n", args.n, demo.TILE_N), ("--k", args.k, demo.TILE_K)])
    problems = [p for p in (_demo_size_problem(*size) for size in sizes) if p]
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        return 2
    if args.kernel == "rope_hf":
        result = demo.run_rope(seq=args.seq, chip=args.chip)
    else:
        result = demo.run(m=args.m, n=args.n, k=args.k, chip=args.chip)
    print(demo.format_result(result))
    return 0 if result["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trnkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_env = sub.add_parser("env", help="versions, install paths and the active NKI backend")
    p_env_out = p_env.add_mutually_exclusive_group()
    p_env_out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_env_out.add_argument("--lock", action="store_true", help="print the stack as a lock file "
                           "(python -m trnkit env --lock > stack.lock; checked by [job] stack)")
    p_env.set_defaults(fn=_cmd_env)
    p_demo = sub.add_parser("demo", help="run a tiled matmul kernel, check it, print its trn2 estimate")
    p_demo.add_argument("--kernel", choices=("matmul", "rope_hf"), default="matmul",
                        help="the tutorial tiled matmul, or the project's rope_hf kernel")
    p_demo.add_argument("--seq", type=int, default=256, help="rope_hf: sequence length")
    p_demo.add_argument("--m", type=int, default=256, help="rows of the result (multiple of 128)")
    p_demo.add_argument("--n", type=int, default=1024, help="columns of the result (multiple of 512)")
    p_demo.add_argument("--k", type=int, default=512, help="contraction size (multiple of 128)")
    p_demo.add_argument("--chip", default="trn2", choices=("trn2", "trn1"))
    p_demo.set_defaults(fn=_cmd_demo)
    p_conf = sub.add_parser("conformance", help="run nki-library's kernels on the interpreter "
                            "against nki-library's references (needs NKILIB_SRC)")
    from trnkit.conformance import cli as conformance_cli

    conformance_cli.add_arguments(p_conf)
    p_conf.set_defaults(fn=conformance_cli.run)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except TrnkitError as e:  # a mistake to fix (trnkit.errors): one line, exit 2, as the trainer does
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
