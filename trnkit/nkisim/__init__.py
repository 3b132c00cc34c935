"""trnkit's CPU interpreter of the NKI API (``nki``, ``nki.language``, ``nki.isa``).

``from trnkit.nkisim import jit, simulate, language as nl, isa as nisa``; kernels should import
through :mod:`trnkit.nki_api`. See ``docs/interpreter.md``.

Users' own, unmodified NKI code (``import nki``) runs here too:

* :func:`install_as_nki` puts this package into ``sys.modules`` under the public module names
  (``nki``, ``nki.language``, ``nki.isa``, ``nki.isa.constants``, ``nki.collectives``,
  ``nki.typing``) and the legacy toolchain paths kernels still import (``neuronxcc.nki``,
  ``neuronxcc.nki.language``, ``neuronxcc.nki.isa``, ``neuronxcc.nki.typing``: the NKI docs' own
  example tests import ``from neuronxcc.nki.typing import tensor``). It returns a callable that
  restores the previous entries; :func:`nki_installed` is the same as a context manager.
* ``python -m trnkit.nkisim run script.py [args]`` (or ``run -m package.module``) installs it and
  runs the script as ``__main__``.
* ``python -m pytest -p trnkit.nkisim.pytest_plugin ...`` installs it for a whole test session.

The installer lives here, not in a submodule, because what it installs is this package itself.
"""

import contextlib as _contextlib
import sys as _sys
import types as _types
from collections.abc import Callable as _Callable
from collections.abc import Iterator as _Iterator

import numpy as _np

from . import dtypes, errors, language, memory, tensor, trace
from . import collectives, isa
from . import nki_typing as typing  # nki.typing
from .errors import NkiValidationError
from .jit import Kernel, jit, simulate
from .tensor import NkiTensor



class _DtypeModule(_types.ModuleType):
    """``nki.dtype``: AWS's tested code both imports it as a module holding the dtypes
    (``import nki.dtype as nt; x.astype(nt.float8_e4m3)``, nki-library test/.../qkv/test_qkv_common.py)
    and annotates with it (``compute_dtype: nki.dtype = nl.bfloat16``, experimental/loss/cross_entropy.py).
    Here it is a module whose attributes are ``nl``'s dtypes (numpy dtypes) and which answers
    ``isinstance(nl.bfloat16, nki.dtype)``."""

    def __instancecheck__(self, instance: object) -> bool:
        return isinstance(instance, _np.dtype)


dtype = _DtypeModule("nki.dtype", "NKI data types (the same objects as nki.language's)")
for _name in dtypes.__all__:
    if isinstance(getattr(dtypes, _name), _np.dtype):
        setattr(dtype, _name, getattr(dtypes, _name))
dtype.bool = dtypes.bool_
del _name


def _nki_modules() -> dict[str, _types.ModuleType]:
    """``sys.modules`` name -> interpreter module, for every name :func:`install_as_nki` binds."""
    package = _sys.modules[__name__]  # ``nki`` is this package
    public = {"": package, ".language": language, ".isa": isa, ".isa.constants": isa.constants,
              ".collectives": collectives, ".typing": typing, ".dtype": dtype}
    mapping = {f"nki{suffix}": mod for suffix, mod in public.items()}
    mapping.update({f"neuronxcc.nki{suffix}": mod for suffix, mod in public.items()})
    neuronxcc = _types.ModuleType("neuronxcc", "trnkit.nkisim standing in for the Neuron compiler "
                                  "package (only neuronxcc.nki is provided)")
    neuronxcc.__path__ = []  # a package, so 'import neuronxcc.nki' works
    neuronxcc.nki = package
    mapping["neuronxcc"] = neuronxcc
    return mapping


def install_as_nki() -> _Callable[[], None]:
    """Make ``import nki`` (and the names above) resolve to the interpreter in this process.

    Returns ``uninstall()``, which restores whatever those ``sys.modules`` entries were before
    (a real ``nki`` package included). Installing twice is harmless.
    """
    mapping = _nki_modules()
    saved = {name: _sys.modules.get(name) for name in mapping}
    _sys.modules.update(mapping)

    def uninstall() -> None:
        for name, previous in saved.items():
            if previous is None:
                _sys.modules.pop(name, None)
            else:
                _sys.modules[name] = previous

    return uninstall


@_contextlib.contextmanager
def nki_installed() -> _Iterator[None]:
    """``with nki_installed(): import nki ...`` — :func:`install_as_nki` for the block."""
    uninstall = install_as_nki()
    try:
        yield
    finally:
        uninstall()


__all__ = ["jit", "simulate", "Kernel", "language", "isa", "NkiTensor", "NkiValidationError",
           "trace", "dtypes", "memory", "errors", "tensor", "dtype", "collectives", "typing",
           "install_as_nki", "nki_installed"]
