"""pytest plugin: ``python -m pytest -p trnkit.nkisim.pytest_plugin tests/`` runs a test suite that
does ``import nki`` on trnkit's CPU interpreter (see :func:`trnkit.nkisim.install_as_nki`)."""

from __future__ import annotations

from typing import Any

from . import install_as_nki

_uninstall = None


def pytest_configure(config: Any) -> None:
    global _uninstall  # noqa: PLW0603 - pytest's configure / unconfigure pair
    _uninstall = install_as_nki()


def pytest_unconfigure(config: Any) -> None:
    global _uninstall  # noqa: PLW0603
    if _uninstall is not None:
        _uninstall()
        _uninstall = None


def pytest_report_header(config: Any) -> str:
    return "nki: trnkit.nkisim (CPU interpreter, installed by trnkit.nkisim.pytest_plugin)"
