"""Register instructions (``nisa.register_alloc`` / ``register_move`` / ``register_load`` /
``register_store``): 32-bit engine registers that hold runtime values, e.g. the bounds of
``nl.fori_loop`` or a ``.ap(scalar_offset=reg)``. Modelled as :class:`VirtualRegister` objects.
"""

from __future__ import annotations

import numpy as np

from .. import controlflow as _cf
from .. import dtypes as _dt
from ..errors import require
from ..tensor import NkiTensor, VirtualRegister
from . import common

__all__ = ["register_alloc", "register_move", "register_load", "register_store", "VirtualRegister"]


def _check_reg(op: str, role: str, r: object) -> VirtualRegister:
    require(isinstance(r, VirtualRegister), op, "{role} must be a VirtualRegister, got {type}",
            role=role, type=type(r).__name__)
    return r  # type: ignore[return-value]


def _check_scalar_tile(op: str, role: str, t: object) -> NkiTensor:
    common.check_on_chip(op, role, t, common.SBUF)
    require(t.size == 1, op, "{role} must be a 1x1 SBUF tensor, got shape {shape}", role=role,
            shape=t.shape)
    require(t.dtype.itemsize == 4 or _dt.is_int(t.dtype), op, "{role} must hold a 32-bit value, "
            "got {dtype}", role=role, dtype=t.dtype)
    return t


def register_alloc(x: int | None = None) -> VirtualRegister:
    """A new register, initialised to ``x`` (0 when None)."""
    return _cf.Register(0 if x is None else int(x))


def register_move(dst: VirtualRegister, src: VirtualRegister | int) -> None:
    """``dst = src`` (a register or an immediate)."""
    op = "register_move"
    _check_reg(op, "dst", dst)
    value = src.value if isinstance(src, VirtualRegister) else int(src)
    _cf.write_register(op, dst)
    dst.value = value


def register_load(dst: VirtualRegister, src: NkiTensor) -> None:
    """``dst = src[0, 0]`` (a 1x1 SBUF tensor)."""
    op = "register_load"
    _check_reg(op, "dst", dst)
    _check_scalar_tile(op, "src", src)
    _cf.write_register(op, dst)
    dst.value = int(np.asarray(src.np()).reshape(-1)[0])
    common.emit(op, common.GPSIMD, srcs={"src": src})


def register_store(dst: NkiTensor, src: VirtualRegister) -> None:
    """``dst[0, 0] = src`` (a 1x1 SBUF tensor)."""
    op = "register_store"
    _check_scalar_tile(op, "dst", dst)
    _check_reg(op, "src", src)
    common.store(dst, np.full(dst.shape, src.value))
    common.emit(op, common.GPSIMD, dst=dst)
