"""The LNC (physical cores per kernel launch) of a run's kernels, resolved once at start-up.

``[overrides] lnc`` 1 or 2 is used as given; 0 (the default) takes the environment variable ``TRNKIT_LNC``
when it is set, else the detected device (:func:`trnkit.kernels.lnc.detected_lnc`). The trainer resolves
it here, once, logs where it came from, and passes the number to every swap point (``KernelChoice.lnc``),
so no kernel reads the environment during the run.
"""

from __future__ import annotations

from collections.abc import Mapping

from trnkit.errors import ConfigError
from trnkit.kernels.lnc import ENV, LNC_VALUES, detected_lnc

__all__ = ["resolve_run_lnc"]


def resolve_run_lnc(configured: int | None, environ: Mapping[str, str]) -> tuple[int, str]:
    """``(lnc, source)``: ``configured`` when it is 1 or 2, else ``TRNKIT_LNC`` from ``environ`` when set,
    else the detected device. A ``TRNKIT_LNC`` other than 1 or 2 is a ConfigError naming the variable, the
    rule and the value."""
    if configured:
        return configured, "overrides.lnc"
    text = environ.get(ENV, "").strip()
    if text:
        if text not in {str(v) for v in LNC_VALUES}:
            raise ConfigError(f"environment variable {ENV}: must be one of {LNC_VALUES} (physical cores per kernel "
                              f"launch; read because overrides.lnc = 0), got {text!r}; unset it or set "
                              "overrides.lnc to 1 or 2")
        return int(text), f"environment variable {ENV} (overrides.lnc = 0)"
    from trnkit.nki_api import REAL_NKI

    how = "the Neuron runtime / instance type" if REAL_NKI else "the NKI interpreter runs one core per program"
    return detected_lnc(), f"detected device: {how} (overrides.lnc = 0, {ENV} unset)"
