"""HF rotate-half rotary position embedding (``rope_hf``) as an NKI kernel, forward and backward.

Math (per row ``s`` and head, ``h = D // 2``; pairs element ``i`` with ``i + h``)::

    forward   y  = x * cos + rotate_half(x) * sin,      rotate_half(x)   = cat(-x[h:], x[:h])
    backward  dx = dy * cos + rotate_half_T(dy * sin),  rotate_half_T(z) = cat(z[h:], -z[:h])

Shapes: ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]`` (kernel layout ``bhsd``; :func:`rope_hf_bshd` takes the
model's ``[B, S, H, D]``), ``cos``/``sin`` ``[S', D]`` or ``[B, S', D]``, or the packed
``rope_cache [S', 2D]`` / ``[B, S', 2D]`` (cos in the first D columns, sin in the last D) with
``S' >= S`` (only the first S rows are read). ``q_out``/``k_out`` are preallocated by the caller, written
in place and returned. fp32 or bf16 activations; cos/sin/cache fp32 or bf16. Arithmetic: transformers'
``apply_rotary_pos_emb`` in the activation dtype, bit for bit: the tables rounded to it, each product
rounded to it, the sum computed in fp32 and rounded once (what torch's bf16 ops do).

The kernel: :mod:`~trnkit.kernels.rope.rope_kernel` (imported, with the NKI backend, on the first call);
the torch references :mod:`~trnkit.kernels.rope.rope_torch`, the constraints
:mod:`~trnkit.kernels.rope.constraints`.
"""

from __future__ import annotations

from typing import Any

from trnkit.kernels._common import dense
from trnkit.kernels.constraints import check
from trnkit.kernels.lnc import launch, resolve_lnc
from trnkit.kernels.rope.constraints import constraints
from trnkit.kernels.rope.rope_torch import rope_hf_bshd_ref, rope_hf_ref

__all__ = ["constraints", "rope_hf", "rope_hf_bshd", "rope_hf_bshd_ref", "rope_hf_ref"]


def _launch(layout: str, q: Any, k: Any, q_out: Any, k_out: Any, cos: Any, sin: Any, rope_cache: Any,
            backward: bool, lnc: int | None) -> tuple[Any, Any]:
    from trnkit.kernels.rope.rope_kernel import rope_hf_kernel

    check(constraints(q, k, cos, sin, rope_cache, layout=layout, q_out=q_out, k_out=k_out))
    lnc = resolve_lnc(lnc)
    packed = rope_cache is not None
    c, s = (dense(rope_cache),) * 2 if packed else (dense(cos), dense(sin))
    return launch(rope_hf_kernel, lnc)(dense(q), dense(k), q_out, k_out, c, s, packed=packed, backward=bool(backward),
                          bshd=layout == "bshd")


def rope_hf(q: Any, k: Any, q_out: Any, k_out: Any, cos: Any = None, sin: Any = None,
            rope_cache: Any = None, backward: bool = False, lnc: int | None = None) -> tuple[Any, Any]:
    """HF rotate-half RoPE on ``q [B, Hq, S, D]`` and ``k [B, Hk, S, D]`` (NKI kernel).

    Either ``cos``/``sin`` (``[S', D]`` or ``[B, S', D]``) or the packed ``rope_cache [S', 2D]``
    (``[B, S', 2D]``; cos | sin), ``S' >= S``. ``q_out``/``k_out`` (same shape/dtype as q/k, contiguous)
    are written in place and returned. ``backward=True``: q/k are the output gradients and
    q_out/k_out receive the input gradients. ``lnc=2``: the rows split over the two cores of a trn2
    logical core (bit-identical to ``lnc=1``). Raises :class:`KernelConstraintError` on bad inputs.
    """
    return _launch("bhsd", q, k, q_out, k_out, cos, sin, rope_cache, backward, lnc)


def rope_hf_bshd(q: Any, k: Any, q_out: Any, k_out: Any, cos: Any = None, sin: Any = None,
                 rope_cache: Any = None, backward: bool = False, lnc: int | None = None) -> tuple[Any, Any]:
    """:func:`rope_hf` for the model's ``[B, S, H, D]`` layout (read and written in place by DMA
    access patterns; no transposed copy)."""
    return _launch("bshd", q, k, q_out, k_out, cos, sin, rope_cache, backward, lnc)
