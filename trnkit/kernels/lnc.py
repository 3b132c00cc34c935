"""Logical NeuronCore size (LNC) of the kernels' launches.

LNC=1 runs a kernel on one physical NeuronCore; LNC=2 (trn2's default logical core) launches it as
``kernel[2](...)``, one program per physical core of the pair (``nl.program_id(0)`` = 0 | 1), and the
kernel splits the work between them. The wrappers take ``lnc: int | None``; ``None`` resolves to the
environment variable ``TRNKIT_LNC`` when set, else the detected device (:func:`detected_lnc`). There is
no process-wide setting: the override configuration passes its ``lnc`` to each op as an argument.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trnkit.kernels.constraints import Violation, check

__all__ = ["LNC_VALUES", "default_lnc", "detected_lnc", "launch", "lnc_violations", "resolve_lnc"]

LNC_VALUES = (1, 2)
ENV = "TRNKIT_LNC"
_INSTANCE_TYPE = Path("/sys/devices/virtual/dmi/id/product_name")  # EC2 (Nitro): the instance type


def _instance_type() -> str:
    try:
        return _INSTANCE_TYPE.read_text().strip()
    except OSError:
        return ""


def detected_lnc() -> int:
    """The device's logical core size: on real NKI the Neuron runtime's ``NEURON_LOGICAL_NC_CONFIG``
    when set, else 2 on a trn2 host (its default) and 1 elsewhere; 1 on the interpreter (which runs
    both when asked)."""
    from trnkit.nki_api import REAL_NKI  # resolving imports the backend

    if not REAL_NKI:
        return 1
    env = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if env in ("1", "2"):
        return int(env)
    return 2 if _instance_type().startswith("trn2") else 1


def _violations(lnc: Any, source: str) -> list[Violation]:
    if isinstance(lnc, bool) or lnc not in LNC_VALUES:
        return [Violation("lnc", f"{source} in {LNC_VALUES}", lnc,
                          "1 = one physical core, 2 = a trn2 logical core of two")]
    return []


def lnc_violations(lnc: Any) -> list[Violation]:
    """``lnc`` outside (None, 1, 2): one violation naming the value."""
    return [] if lnc is None else _violations(lnc, "lnc")


def default_lnc() -> int:
    """The LNC a wrapper uses when called with ``lnc=None`` (see the module docstring)."""
    env = os.environ.get(ENV, "").strip()
    if env:
        value = int(env) if env.isdigit() else env
        check(_violations(value, ENV))
        return value
    return detected_lnc()


def resolve_lnc(lnc: int | None) -> int:
    """``lnc`` checked (1 or 2), or :func:`default_lnc` for None."""
    if lnc is None:
        return default_lnc()
    check(_violations(lnc, "lnc"))
    return lnc


def launch(kernel: Any, lnc: int) -> Any:
    """``kernel`` as launched on ``lnc`` physical cores: ``kernel[2]`` (SPMD grid) or ``kernel``."""
    return kernel[lnc] if lnc > 1 else kernel
