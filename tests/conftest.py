import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Interpreter-heavy tests issue thousands of small matmuls; a multi-threaded BLAS on this 2-core machine
# (with two pytest workers) only adds thread hand-off contention. See trnkit/nkisim/blas.py.
from trnkit.nkisim import blas

blas.set_num_threads(1)
