"""``nki.typing`` (and the legacy ``neuronxcc.nki.typing``): tensor annotations for kernel parameters.

``nt.tensor[128, 512]`` declares a parameter's shape (NKI migration guide, "nki.typing module");
``nt.mutable_tensor`` marks a tensor the kernel writes (nki-library router_topk's outputs, documented in
``nki/library/api/router-topk.rst``); the NKI dtypes are available here too (nki-library tests use
``nt.float8_e4m3``). Annotations only: the interpreter does not check them.
"""

from __future__ import annotations

from typing import Any

from . import dtypes as _dt

# the NKI dtypes under their nl names (nl.bool_ / nl.tfloat32 spelled out: their numpy names differ)
globals().update({_dt.dtype_name(d): d for d in _dt.NKI_DTYPES}, bool_=_dt.bool_, tfloat32=_dt.tfloat32)

__all__ = ["tensor", "mutable_tensor", "TensorAnnotation"]


class TensorAnnotation:
    """``tensor`` / ``mutable_tensor``, optionally subscripted with a shape: ``tensor[128, 512]``."""

    __slots__ = ("kind", "shape")

    def __init__(self, kind: str, shape: tuple[Any, ...] | None = None) -> None:
        self.kind = kind
        self.shape = shape

    def __getitem__(self, shape: Any) -> TensorAnnotation:
        return TensorAnnotation(self.kind, shape if isinstance(shape, tuple) else (shape,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorAnnotation) and (self.kind, self.shape) == (other.kind, other.shape)

    def __hash__(self) -> int:
        return hash((self.kind, self.shape))

    def __repr__(self) -> str:
        return f"nt.{self.kind}" + ("" if self.shape is None else f"[{', '.join(map(str, self.shape))}]")


tensor = TensorAnnotation("tensor")
mutable_tensor = TensorAnnotation("mutable_tensor")
