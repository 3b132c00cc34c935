"""rope_hf benchmarks: sequence-length sweep (Qwen3-0.6B heads) and Qwen3 flavor sweep at S=2048,
forward and backward. Same as ``python -m trnkit.bench rope_hf [--quick] ...``."""

import sys

from trnkit.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["rope_hf", *sys.argv[1:]]))
