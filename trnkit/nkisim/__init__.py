"""trnkit's CPU interpreter of the NKI API (``nki``, ``nki.language``, ``nki.isa``).

``from trnkit.nkisim import jit, simulate, language as nl, isa as nisa``; kernels should import
through :mod:`trnkit.nki_api`. ``install_as_nki()`` makes ``import nki`` itself resolve here (users'
own unmodified kernels). See ``docs/interpreter.md``.
"""

import numpy as _np

from . import dtypes, errors, language, memory, tensor, trace
from . import collectives, isa
from . import nki_typing as typing  # nki.typing
from .dropin import install_as_nki, nki_installed
from .errors import NkiValidationError
from .jit import Kernel, jit, simulate
from .tensor import NkiTensor

# ``nki.dtype``: the type of every NKI dtype object (``nl.bfloat16`` is a numpy dtype here); AWS
# kernels use it in annotations (``compute_dtype: nki.dtype = nl.bfloat16``, nki-library
# experimental/loss/cross_entropy.py).
dtype = _np.dtype

__all__ = ["jit", "simulate", "Kernel", "language", "isa", "NkiTensor", "NkiValidationError",
           "trace", "dtypes", "memory", "errors", "tensor", "dtype", "collectives", "typing",
           "install_as_nki", "nki_installed"]
