"""router_topk benchmarks: token sweep (Qwen3-30B-A3B router: H=2048, E=128, K=8) and flavor sweep
(30B-A3B, 235B-A22B) at T=2048, forward and backward. Same as ``python -m trnkit.bench router_topk``."""

import sys

from trnkit.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["router_topk", *sys.argv[1:]]))
