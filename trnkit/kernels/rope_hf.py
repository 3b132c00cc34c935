"""HF rotate-half rotary position embedding (``rope_hf``) as an NKI kernel, forward and backward.

Math (per row ``s`` and head, ``h = D // 2``; pairs element ``i`` with ``i + h``)::

    forward   y  = x * cos + rotate_half(x) * sin,      rotate_half(x)   = cat(-x[h:], x[:h])
    backward  dx = dy * cos + rotate_half_T(dy * sin),  rotate_half_T(z) = cat(z[h:], -z[:h])

Shapes: ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]`` (kernel layout ``bhsd``; :func:`rope_hf_bshd` takes the
model's ``[B, S, H, D]``), ``cos``/``sin`` ``[S', D]`` or ``[B, S', D]``, or the packed
``rope_cache [S', 2D]`` / ``[B, S', 2D]`` (cos in the first D columns, sin in the last D) with
``S' >= S`` (only the first S rows are read). ``q_out``/``k_out`` are preallocated by the caller, written
in place and returned. fp32 or bf16 activations; cos/sin/cache fp32 or bf16. All arithmetic is fp32
(each product and the sum are fp32 values; one rounding to the activation dtype at the end).

Tiling (both layouts): sequence rows on partitions, and each partition holds ``NT`` *consecutive* rows,
so every DMA moves one contiguous run of ``NT * D`` (bhsd) or ``NT * H * D`` (bshd) elements per
partition; cos/sin are loaded once per row chunk (and batch, when they are per-batch) and reused by
every head of q and k. A short tail chunk uses fewer partitions (any S works). The rotate-half sign
lives in a table built once per chunk, ``t = cat(-sin[:h], sin[h:])`` (backward ``cat(sin[h:], -sin[:h])``),
so ``y = x*cos + swap_halves(x)*t``: three elementwise passes per tile, split between the Vector engine
(single-pass thanks to exact fp32 copies of x in PSUM made by the Scalar engine) and the GpSimd engine.
The [B, S, H, D] layout reads one ``[NT, H, D]`` slab per partition and broadcasts cos/t over the heads
with a stride-0 access pattern, so no transposed copy of q/k is ever made.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trnkit.kernels._common import P_MAX, dense as _dense, dtype_name as _dtype_name, program_split as _program_split
from trnkit.kernels._common import row_chunks as _row_chunks
from trnkit.kernels.constraints import Violation, check
from trnkit.nki_api import nisa, nki, nl

__all__ = ["rope_hf", "rope_hf_bshd", "rope_hf_ref", "rope_hf_bshd_ref", "constraints",
           "rope_hf_kernel"]

# Elements per partition per head moved by one DMA: 4 KiB of bf16 / 8 KiB of fp32, past the DMA
# efficiency knee (>= 2-4 KiB per partition), small enough to keep several heads in flight in SBUF.
FREE_TARGET = 2048
PSUM_FMAX = 512  # fp32 elements per partition in one PSUM bank
_BSHD_SLAB_BYTES = 192 * 1024  # SBUF per partition for bshd row slabs (x, y and the previous y)
_DTYPES = ("float32", "bfloat16")


# ---------------------------------------------------------------------------------------------------
# constraints


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


def _is_contiguous(t: Any) -> bool:
    if isinstance(t, torch.Tensor):
        return t.is_contiguous()
    if isinstance(t, np.ndarray):
        return bool(t.flags.c_contiguous)
    return True  # device / NKI tensors: HBM tensors are dense


def constraints(q: Any, k: Any, cos: Any = None, sin: Any = None, rope_cache: Any = None,
                layout: str = "bhsd", q_out: Any = None, k_out: Any = None) -> list[Violation]:
    """Violated input constraints of :func:`rope_hf` (``layout="bhsd"``) / :func:`rope_hf_bshd` (``"bshd"``).

    Empty list = the kernel serves these inputs. ``q_out``/``k_out`` are checked when given.
    """
    name = "rope_hf" if layout != "bshd" else "rope_hf_bshd"
    v: list[Violation] = []

    def bad(rule: str, value: Any, reason: str = "") -> None:
        v.append(Violation(name, rule, value, reason))

    if layout not in ("bhsd", "bshd"):
        bad("layout in ('bhsd', 'bshd')", layout)
        return v
    dims = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    if len(_shape(q)) != 4:
        bad(f"q is 4-D {dims}", _shape(q))
    if len(_shape(k)) != 4:
        bad(f"k is 4-D {dims}", _shape(k))
    if v:
        return v
    if layout == "bhsd":
        (B, Hq, S, D), (Bk, Hk, Sk, Dk) = _shape(q), _shape(k)
    else:
        (B, S, Hq, D), (Bk, Sk, Hk, Dk) = _shape(q), _shape(k)
    if (Bk, Sk, Dk) != (B, S, D):
        bad("q and k share B, S and D", {"q": _shape(q), "k": _shape(k)})
    if min(B, Hq, Hk, S, D) < 1:
        bad("all dimensions >= 1", {"q": _shape(q), "k": _shape(k)})
    if D % 2:
        bad("D even", D, "rotate-half pairs element i with i + D/2")
    if D > P_MAX:
        bad("D <= 128", D, "the kernel keeps a whole head row in one tile row")
    for tname, t in (("q", q), ("k", k)):
        if _dtype_name(t) not in _DTYPES:
            bad(f"{tname}.dtype in {_DTYPES}", _dtype_name(t))
    if _dtype_name(k) != _dtype_name(q):
        bad("k.dtype == q.dtype", (_dtype_name(q), _dtype_name(k)))
    isz = 4 if _dtype_name(q) == "float32" else 2
    if layout == "bshd" and 3 * max(Hq, Hk) * D * isz > _BSHD_SLAB_BYTES:
        bad("3 * max(Hq, Hk) * D * itemsize <= 192 KiB", 3 * max(Hq, Hk) * D * isz,
            "the [B, S, H, D] layout keeps all heads of a row in SBUF (input, output and the previous "
            "output still being stored)")

    have_cs = cos is not None or sin is not None
    if have_cs == (rope_cache is not None):
        bad("exactly one of (cos, sin) or rope_cache", "both" if have_cs else "neither")
        return v
    if have_cs:
        if cos is None or sin is None:
            bad("cos and sin given together", "cos" if sin is None else "sin")
            return v
        if _shape(cos) != _shape(sin):
            bad("cos.shape == sin.shape", (_shape(cos), _shape(sin)))
        tabs, width = (("cos", cos), ("sin", sin)), D
    else:
        tabs, width = (("rope_cache", rope_cache),), 2 * D
    for tname, t in tabs:
        shp = _shape(t)
        if len(shp) not in (2, 3):
            bad(f"{tname} is 2-D [S, {'D' if have_cs else '2D'}] or 3-D [B, S, ...]", shp)
            continue
        if shp[-1] != width:
            bad(f"{tname}.shape[-1] == {'D' if have_cs else '2*D'}", shp[-1], f"D = {D}")
        if shp[-2] < S:
            bad(f"{tname} rows >= S", shp[-2], f"S = {S}")
        if len(shp) == 3 and shp[0] != B:
            bad(f"{tname}.shape[0] == B", shp[0], f"B = {B}")
        if _dtype_name(t) not in _DTYPES:
            bad(f"{tname}.dtype in {_DTYPES}", _dtype_name(t))
    for tname, t, ref in (("q_out", q_out, q), ("k_out", k_out, k)):
        if t is None:
            continue
        if _shape(t) != _shape(ref) or _dtype_name(t) != _dtype_name(ref):
            bad(f"{tname} has the shape and dtype of {tname[0]}", (_shape(t), _dtype_name(t)),
                f"expected {(_shape(ref), _dtype_name(ref))}")
        if not _is_contiguous(t):
            bad(f"{tname} is contiguous", "strided", "the kernel writes it in place as a dense tensor")
    return v


# ---------------------------------------------------------------------------------------------------
# torch references


def _rope_tables(cos: Any, sin: Any, rope_cache: Any, S: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin), each [S, D] or [B, S, D], cut to the first S rows."""
    if rope_cache is not None:
        cos, sin = rope_cache[..., :D], rope_cache[..., D:]
    return cos[..., :S, :].float(), sin[..., :S, :].float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    h = x.shape[-1] // 2
    if backward:  # dy*cos + rotate_half^T(dy*sin)
        z = x * sin
        return x * cos + torch.cat((z[..., h:], -z[..., :h]), dim=-1)
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _ref(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: Any, sin: Any,
         rope_cache: Any, backward: bool, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    D = q.shape[-1]
    S = q.shape[2] if layout == "bhsd" else q.shape[1]
    c, s = _rope_tables(cos, sin, rope_cache, S, D)
    head_dim = 1 if layout == "bhsd" else 2  # where the heads axis goes in [B, ., ., D]
    if c.dim() == 2:
        c, s = c[None], s[None]
    c, s = c.unsqueeze(head_dim), s.unsqueeze(head_dim)
    for x, out in ((q, q_out), (k, k_out)):
        out.copy_(_rotate(x.float(), c, s, backward).to(out.dtype))
    return q_out, k_out


def rope_hf_ref(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                rope_cache: torch.Tensor | None = None, backward: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rope_hf` (``[B, H, S, D]``): fp32 math, writes q_out/k_out and returns them."""
    return _ref(q, k, q_out, k_out, cos, sin, rope_cache, backward, "bhsd")


def rope_hf_bshd_ref(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     rope_cache: torch.Tensor | None = None, backward: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rope_hf_bshd` (``[B, S, H, D]``)."""
    return _ref(q, k, q_out, k_out, cos, sin, rope_cache, backward, "bshd")


# ---------------------------------------------------------------------------------------------------
# NKI kernel


def _load_tables(cos, sin, packed, b, s0, P, NT, D, backward):
    """fp32 SBUF tiles ``[P, NT, D]`` of ``cos`` and of the signed table ``t`` for rows
    ``s0 + p*NT + j`` (batch ``b`` if 3-D), such that ``y = x*cos + swap_halves(x)*t``:
    forward ``t = cat(-sin[:h], sin[h:])``, backward ``t = cat(sin[h:], -sin[:h])``.
    """
    h = D // 2
    rows = cos.shape[-2]
    width = cos.shape[-1]  # D, or 2D for the packed cache (cos | sin per row)
    base = (b * rows + s0) * width if len(cos.shape) == 3 else s0 * width
    sin_base = base + D if packed else base
    c_t = nl.ndarray((P, NT, D), dtype=nl.float32, buffer=nl.sbuf)
    t_t = nl.ndarray((P, NT, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=c_t, src=cos.ap(pattern=[[NT * width, P], [width, NT], [1, D]], offset=base))
    half = [[NT * width, P], [width, NT], [1, h]]
    if backward:
        nisa.dma_copy(dst=t_t[:, :, 0:h], src=sin.ap(pattern=half, offset=sin_base + h))
        nisa.dma_copy(dst=t_t[:, :, h:D], src=sin.ap(pattern=half, offset=sin_base))
        neg = t_t[:, :, h:D]
    else:
        nisa.dma_copy(dst=t_t, src=sin.ap(pattern=[[NT * width, P], [width, NT], [1, D]], offset=sin_base))
        neg = t_t[:, :, 0:h]
    nisa.tensor_scalar(dst=neg, data=neg, op0=nl.multiply, operand0=-1.0)  # exact, once per chunk
    return c_t, t_t


def _rotate_slabs(slabs, on_vector):
    """``y = x*cos + swap_halves(x)*t`` for each ``(y, x, cos, t)`` slab (<= 512 elements per partition,
    last dim D; cos/t views of x's shape); fp32 math, one rounding into y's dtype.

    Vector path: the Scalar engine (otherwise idle) copies x and its half-swapped image exactly to
    fp32 PSUM tiles, so each of the three Vector passes has a PSUM operand and runs single-pass.
    GpSimd path (no PSUM access): the swapped product is two half passes into SBUF.
    Instructions are software-pipelined (slab j+1's products are issued before slab j's sum) so an
    in-order engine never waits on the result of the instruction just before it.
    """
    pending = None  # (y, a, bx) of the previous slab
    for y_v, x_v, c_v, t_v in slabs:
        D = x_v.shape[-1]
        h = D // 2
        shape = x_v.shape
        if on_vector:
            eng = nisa.engine.vector
            x_ps = nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)
            xs_ps = nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)
            nisa.tensor_copy(dst=x_ps, src=x_v, engine=nisa.engine.scalar)
            nisa.tensor_copy(dst=xs_ps[..., 0:h], src=x_v[..., h:D], engine=nisa.engine.scalar)
            nisa.tensor_copy(dst=xs_ps[..., h:D], src=x_v[..., 0:h], engine=nisa.engine.scalar)
            a_t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=a_t, data1=x_ps, data2=c_v, op=nl.multiply, engine=eng)
            nisa.tensor_tensor(dst=xs_ps, data1=xs_ps, data2=t_v, op=nl.multiply, engine=eng)
            if pending != None:  # noqa: E711 (the NKI compiler rejects `is`)
                nisa.tensor_tensor(dst=pending[0], data1=pending[2], data2=pending[1], op=nl.add, engine=eng)
            pending = (y_v, a_t, xs_ps)
        else:
            eng = nisa.engine.gpsimd
            a_t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
            bx_t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=a_t, data1=x_v, data2=c_v, op=nl.multiply, engine=eng)
            nisa.tensor_tensor(dst=bx_t[..., 0:h], data1=x_v[..., h:D], data2=t_v[..., 0:h], op=nl.multiply,
                               engine=eng)
            if pending != None:  # noqa: E711
                nisa.tensor_tensor(dst=pending[0], data1=pending[1], data2=pending[2], op=nl.add, engine=eng)
            nisa.tensor_tensor(dst=bx_t[..., h:D], data1=x_v[..., 0:h], data2=t_v[..., h:D], op=nl.multiply,
                               engine=eng)
            pending = (y_v, a_t, bx_t)
    if pending != None:  # noqa: E711
        eng = nisa.engine.vector if on_vector else nisa.engine.gpsimd
        nisa.tensor_tensor(dst=pending[0], data1=pending[2], data2=pending[1], op=nl.add, engine=eng)


# Elementwise cost per element of a slab (trn2 ISA cost table): Vector 3 single passes at 0.96 GHz,
# GpSimd 3 double passes (fp32, SBUF) at 1.2 GHz. Each slab goes to the engine that finishes first.
_VECTOR_NS_PER_ELEM = 3 / 0.96
_GPSIMD_NS_PER_ELEM = 6 / 1.2


def _pick_vector(load, n):
    """Greedy balance of slabs over Vector/GpSimd; ``load`` = [vector_ns, gpsimd_ns], updated."""
    v, g = load[0] + n * _VECTOR_NS_PER_ELEM, load[1] + n * _GPSIMD_NS_PER_ELEM
    if v <= g:
        load[0] = v
        return True
    load[1] = g
    return False


def _chunk_bhsd(q, k, q_out, k_out, cos, sin, packed, backward, s0, P, NT, load):
    B, _, S, D = q.shape
    per_batch = len(cos.shape) == 3
    pat = [[NT * D, P], [D, NT], [1, D]]
    ns = max(1, PSUM_FMAX // D)  # rows per slab
    for bt in range(B if per_batch else 1):
        c_t, s_t = _load_tables(cos, sin, packed, bt, s0, P, NT, D, backward)
        for b in (range(bt, bt + 1) if per_batch else range(B)):
            for x, x_out in ((q, q_out), (k, k_out)):
                H = x.shape[1]
                for hd in range(H):
                    off = ((b * H + hd) * S + s0) * D
                    x_t = nl.ndarray((P, NT, D), dtype=x.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=x_t, src=x.ap(pattern=pat, offset=off))
                    y_t = nl.ndarray((P, NT, D), dtype=x.dtype, buffer=nl.sbuf)
                    # one engine per tile: slabs of one tile on two engines would order each other
                    slabs = []
                    for t0 in range(0, NT, ns):
                        t1 = min(NT, t0 + ns)
                        slabs.append((y_t[:, t0:t1, :], x_t[:, t0:t1, :], c_t[:, t0:t1, :], s_t[:, t0:t1, :]))
                    _rotate_slabs(slabs, _pick_vector(load, NT * D))
                    nisa.dma_copy(dst=x_out.ap(pattern=pat, offset=off), src=y_t)


def _chunk_bshd(q, k, q_out, k_out, cos, sin, packed, backward, s0, P, NT, load):
    B, S, _, D = q.shape
    per_batch = len(cos.shape) == 3
    for b in range(B):
        if per_batch or b == 0:
            c_t, s_t = _load_tables(cos, sin, packed, b, s0, P, NT, D, backward)
        for x, x_out in ((q, q_out), (k, k_out)):
            H = x.shape[2]
            off = (b * S + s0) * H * D
            pat = [[NT * H * D, P], [H * D, NT], [D, H], [1, D]]
            x_t = nl.ndarray((P, NT, H, D), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_t, src=x.ap(pattern=pat, offset=off))
            y_t = nl.ndarray((P, NT, H, D), dtype=x.dtype, buffer=nl.sbuf)
            G = max(1, min(H, PSUM_FMAX // D))  # heads per slab
            ns = max(1, PSUM_FMAX // (G * D))  # rows per slab
            slabs = []
            for t0 in range(0, NT, ns):
                t1 = min(NT, t0 + ns)
                for g0 in range(0, H, G):
                    g1 = min(H, g0 + G)
                    # cos/sin rows t0:t1 seen as [P, rows, heads, D] with a stride-0 head axis
                    bcast = [[NT * D, P], [D, t1 - t0], [0, g1 - g0], [1, D]]
                    slabs.append((y_t[:, t0:t1, g0:g1, :], x_t[:, t0:t1, g0:g1, :],
                                  c_t.ap(pattern=bcast, offset=t0 * D), s_t.ap(pattern=bcast, offset=t0 * D)))
            _rotate_slabs(slabs, _pick_vector(load, NT * H * D))
            nisa.dma_copy(dst=x_out.ap(pattern=pat, offset=off), src=y_t)
            x_t, y_t, slabs = None, None, None  # release the row slabs before the next tile's allocation


@nki.jit
def rope_hf_kernel(q, k, q_out, k_out, cos, sin, packed=False, backward=False, bshd=False):
    """The NKI kernel behind :func:`rope_hf` / :func:`rope_hf_bshd` (inputs already validated).

    ``packed=True``: ``cos`` and ``sin`` are both the packed ``rope_cache`` (cos | sin per row).
    Row chunks are split across SPMD programs (``rope_hf_kernel[2](...)`` on LNC=2).
    """
    D = q.shape[3]
    if bshd:
        S = q.shape[1]
        # ~FREE_TARGET elements per partition for the smaller of q / k, but at most 4*FREE_TARGET for the
        # larger one (SBUF, and enough tiles to balance the engines)
        h_lo, h_hi = min(q.shape[2], k.shape[2]), max(q.shape[2], k.shape[2])
        nt_max = max(1, min(FREE_TARGET // D, FREE_TARGET // (h_lo * D), 4 * FREE_TARGET // (h_hi * D)))
    else:
        S = q.shape[2]
        nt_max = max(1, FREE_TARGET // D)
    chunks = _row_chunks(S, nt_max)
    n_prog, pid = _program_split()
    load = [0.0, 0.0]
    for ci in range(len(chunks)):
        if ci % n_prog == pid:
            s0, P, NT = chunks[ci]
            if bshd:
                _chunk_bshd(q, k, q_out, k_out, cos, sin, packed, backward, s0, P, NT, load)
            else:
                _chunk_bhsd(q, k, q_out, k_out, cos, sin, packed, backward, s0, P, NT, load)
    return q_out, k_out


def _launch(layout: str, q: Any, k: Any, q_out: Any, k_out: Any, cos: Any, sin: Any, rope_cache: Any,
            backward: bool) -> tuple[Any, Any]:
    check(constraints(q, k, cos, sin, rope_cache, layout=layout, q_out=q_out, k_out=k_out))
    packed = rope_cache is not None
    c, s = (_dense(rope_cache),) * 2 if packed else (_dense(cos), _dense(sin))
    rope_hf_kernel(_dense(q), _dense(k), q_out, k_out, c, s, packed=packed, backward=bool(backward),
                   bshd=layout == "bshd")
    return q_out, k_out


def rope_hf(q: Any, k: Any, q_out: Any, k_out: Any, cos: Any = None, sin: Any = None,
            rope_cache: Any = None, backward: bool = False) -> tuple[Any, Any]:
    """HF rotate-half RoPE on ``q [B, Hq, S, D]`` and ``k [B, Hk, S, D]`` (NKI kernel).

    Either ``cos``/``sin`` (``[S', D]`` or ``[B, S', D]``) or the packed ``rope_cache [S', 2D]``
    (``[B, S', 2D]``; cos | sin), ``S' >= S``. ``q_out``/``k_out`` (same shape/dtype as q/k, contiguous)
    are written in place and returned. ``backward=True``: q/k are the output gradients and
    q_out/k_out receive the input gradients. Raises :class:`KernelConstraintError` on bad inputs.
    """
    return _launch("bhsd", q, k, q_out, k_out, cos, sin, rope_cache, backward)


def rope_hf_bshd(q: Any, k: Any, q_out: Any, k_out: Any, cos: Any = None, sin: Any = None,
                 rope_cache: Any = None, backward: bool = False) -> tuple[Any, Any]:
    """:func:`rope_hf` for the model's ``[B, S, H, D]`` layout (read and written in place by DMA
    access patterns; no transposed copy)."""
    return _launch("bshd", q, k, q_out, k_out, cos, sin, rope_cache, backward)
