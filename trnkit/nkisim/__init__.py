"""trnkit's CPU interpreter of the NKI API (``nki``, ``nki.language``, ``nki.isa``).

``from trnkit.nkisim import jit, simulate, language as nl, isa as nisa``; kernels should import
through :mod:`trnkit.nki_api`. See ``docs/interpreter.md``.
"""

from . import dtypes, errors, language, memory, tensor, trace  # noqa: F401
from . import isa  # noqa: F401
from .errors import NkiValidationError
from .jit import Kernel, jit, simulate
from .tensor import NkiTensor

__all__ = ["jit", "simulate", "Kernel", "language", "isa", "NkiTensor", "NkiValidationError",
           "trace", "dtypes", "memory", "errors", "tensor"]
