"""Each kernel family's constraints, references and host API import without the NKI backend: the
interpreter (``trnkit.nkisim``) and ``trnkit.nki_api`` load only when a kernel module is imported, which
the host API does on its first call."""

from __future__ import annotations

import subprocess
import sys

TORCH_MODULES = {"attention": "attention_torch", "cross_entropy": "cross_entropy_torch", "mlp": "mlp_torch",
                 "moe": "moe_torch", "rmsnorm": "rmsnorm_torch", "rope": "rope_torch", "router": "router_torch"}
BACKEND = ("trnkit.nkisim", "trnkit.nki_api")
SHARED = ("constraints", "lnc", "_common")  # kernels/ modules every family's host side imports


def test_constraints_references_and_host_api_do_not_load_the_interpreter() -> None:
    lines = ["import importlib, sys", f"backend = {BACKEND!r}"]
    for module in SHARED:  # first, alone: trnkit.kernels.constraints is what users import to check shapes
        lines.append(f"importlib.import_module('trnkit.kernels.{module}')")
        lines.append(f"print('{module}', sorted(m for m in sys.modules if m.startswith(backend)))")
    for family, torch_module in TORCH_MODULES.items():
        for module in (f"{family}.constraints", f"{family}.{torch_module}", family):
            lines.append(f"importlib.import_module('trnkit.kernels.{module}')")
            lines.append(f"print('{module}', sorted(m for m in sys.modules if m.startswith(backend)))")
    # a kernel module does load them (so the check above can fail)
    lines += ["import trnkit.kernels.router.router_fwd",
              "print('router.router_fwd', sorted(m for m in sys.modules if m.startswith(backend)))"]
    out = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, check=True)
    loaded = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert len(loaded) == len(SHARED) + 3 * len(TORCH_MODULES) + 1
    assert {m: v for m, v in loaded.items() if m != "router.router_fwd" and v != "[]"} == {}
    assert "'trnkit.nki_api'" in loaded["router.router_fwd"]


def test_no_host_function_is_shadowed_by_a_kernel_module() -> None:
    """A family's public names stay what its ``__init__`` defines after all its modules are imported: a
    submodule named like a host function (``attention/attention_bwd.py`` next to ``attention_bwd()``)
    would replace the function by the module the first time a host function imports it."""
    import importlib
    import pkgutil
    import types

    for family in TORCH_MODULES:
        pkg = importlib.import_module(f"trnkit.kernels.{family}")
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{info.name}")
        shadowed = [name for name in pkg.__all__ if isinstance(getattr(pkg, name), types.ModuleType)]
        assert shadowed == [], (family, shadowed)
