import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import settings

# Interpreter-heavy tests issue thousands of small matmuls; a multi-threaded BLAS on this 2-core machine
# (with two pytest workers) only adds thread hand-off contention. See trnkit/nkisim/blas.py.
from trnkit.nkisim import blas

blas.set_num_threads(1)

# Property tests draw the same examples on every run (hypothesis' derandomize: a seed per test), so the suite
# cannot fail on a draw no earlier run made; HYPOTHESIS_PROFILE=explore draws new ones (docs/tests.md).
settings.register_profile("trnkit", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "trnkit"))
