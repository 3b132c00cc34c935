"""Run users' own NKI code on the interpreter, unmodified: ``import nki`` resolves to trnkit.nkisim.

* :func:`install_as_nki` puts the interpreter into ``sys.modules`` under the public module names
  (``nki``, ``nki.language``, ``nki.isa``, ``nki.isa.constants``, ``nki.collectives``,
  ``nki.typing``) and the legacy toolchain paths kernels still import (``neuronxcc.nki``,
  ``neuronxcc.nki.language``, ``neuronxcc.nki.isa``, ``neuronxcc.nki.typing``: the NKI docs' own
  example tests import ``from neuronxcc.nki.typing import tensor``). It returns a callable that
  restores the previous entries; :func:`nki_installed` is the same as a context manager.
* ``python -m trnkit.nkisim run script.py [args]`` (or ``run -m package.module``) installs it and
  runs the script as ``__main__``.
* ``python -m pytest -p trnkit.nkisim.pytest_plugin ...`` installs it for a whole test session.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator

__all__ = ["install_as_nki", "nki_installed", "module_map"]


def module_map() -> dict[str, types.ModuleType]:
    """``sys.modules`` name -> interpreter module, for every name :func:`install_as_nki` binds."""
    from trnkit import nkisim  # this module is imported by trnkit.nkisim itself
    from trnkit.nkisim import collectives, isa, language, nki_typing

    public = {"": nkisim, ".language": language, ".isa": isa, ".isa.constants": isa.constants,
              ".collectives": collectives, ".typing": nki_typing}
    mapping = {f"nki{suffix}": mod for suffix, mod in public.items()}
    mapping.update({f"neuronxcc.nki{suffix}": mod for suffix, mod in public.items()})
    neuronxcc = types.ModuleType("neuronxcc", "trnkit.nkisim standing in for the Neuron compiler "
                                 "package (only neuronxcc.nki is provided)")
    neuronxcc.__path__ = []  # a package, so 'import neuronxcc.nki' works
    neuronxcc.nki = nkisim
    mapping["neuronxcc"] = neuronxcc
    return mapping


def install_as_nki() -> Callable[[], None]:
    """Make ``import nki`` (and the names above) resolve to the interpreter in this process.

    Returns ``uninstall()``, which restores whatever those ``sys.modules`` entries were before
    (a real ``nki`` package included). Installing twice is harmless.
    """
    mapping = module_map()
    saved = {name: sys.modules.get(name) for name in mapping}
    sys.modules.update(mapping)

    def uninstall() -> None:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous

    return uninstall


@contextlib.contextmanager
def nki_installed() -> Iterator[None]:
    """``with nki_installed(): import nki ...`` — :func:`install_as_nki` for the block."""
    uninstall = install_as_nki()
    try:
        yield
    finally:
        uninstall()
