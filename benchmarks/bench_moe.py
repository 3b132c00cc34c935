"""MoE benchmarks: ``moe_experts`` (token sweep at Qwen3-30B-A3B expert sizes, flavor sweep) and
``grouped_mm`` (token-slot sweep), forward and backward. Same as
``python -m trnkit.bench moe_experts grouped_mm``."""

import sys

from trnkit.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["moe_experts", "grouped_mm", *sys.argv[1:]]))
