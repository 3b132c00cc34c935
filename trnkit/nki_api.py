"""The one place kernels get NKI from.

``nki``, ``nl`` (``nki.language``) and ``nisa`` (``nki.isa``) are the real Neuron modules when
``import nki`` works, and trnkit's CPU interpreter (:mod:`trnkit.nkisim`) otherwise. The environment
variable ``TRNKIT_NKI=sim|real`` forces one (``real`` raises if the real package is missing).

Kernels import only from here::

    from trnkit.nki_api import nki, nl, nisa, nt

(``nt`` = ``nki.typing``: the ``nt.mutable_tensor`` annotation of outputs passed in.)
"""

from __future__ import annotations

import os
from types import ModuleType

from trnkit.errors import ConfigError, TrnkitError

__all__ = ["nki", "nl", "nisa", "nt", "REAL_NKI", "NkiUnavailableError", "backend_name"]


class NkiUnavailableError(TrnkitError, ImportError):
    """``TRNKIT_NKI=real`` without an importable Neuron ``nki`` package (a setting to fix: exit 2 in the CLI)."""


def _load_real() -> tuple[ModuleType, ModuleType, ModuleType]:
    import nki as real_nki  # optional Neuron dependency
    import nki.isa as real_isa
    import nki.language as real_nl

    return real_nki, real_nl, real_isa


def _load_sim() -> tuple[ModuleType, ModuleType, ModuleType]:
    try:
        from trnkit import nkisim
    except ValueError as exc:  # a bad interpreter setting read at import (TRNKIT_NKISIM_BLAS_THREADS)
        raise ConfigError(f"the NKI interpreter: {exc}") from exc
    from trnkit.nkisim import isa as sim_isa
    from trnkit.nkisim import language as sim_nl

    return nkisim, sim_nl, sim_isa


def _resolve() -> tuple[ModuleType, ModuleType, ModuleType, bool]:
    choice = os.environ.get("TRNKIT_NKI", "").strip().lower()
    if choice not in ("", "sim", "real"):
        raise ConfigError(f"environment variable TRNKIT_NKI: must be 'sim', 'real' or unset (real NKI when "
                          f"importable, else the interpreter), got {choice!r}")
    if choice == "sim":
        return (*_load_sim(), False)
    try:
        real = _load_real()
        if getattr(real[0], "__name__", "") == "trnkit.nkisim":  # trnkit.nkisim.install_as_nki()
            if choice == "real":
                raise ImportError("'nki' is trnkit's interpreter (trnkit.nkisim.install_as_nki)")
            return (*real, False)
        return (*real, True)
    except ImportError as exc:  # the PyPI placeholder wheels raise ImportError too
        if choice == "real":
            raise NkiUnavailableError(
                "environment variable TRNKIT_NKI: 'real' needs the Neuron 'nki' package, which is not importable "
                f"({exc}); install trnkit[neuron] from the Neuron pip repository"
            ) from exc
        return (*_load_sim(), False)


nki, nl, nisa, REAL_NKI = _resolve()
if REAL_NKI:
    import nki.typing as nt
else:
    from trnkit.nkisim import nki_typing as nt


def backend_name() -> str:
    """'nki' (real Neuron compiler/runtime) or 'nkisim' (trnkit's CPU interpreter)."""
    return "nki" if REAL_NKI else "nkisim"
