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
every head of q and k. A short tail chunk uses fewer partitions (any S works). With ``t = sin``
(backward ``cat(sin[h:], sin[:h])``), ``y = x*cos + sign*swap_halves(x)*t`` with the minus sign on one
half: three elementwise passes per tile, split between the Vector engine (single-pass thanks to exact
fp32 copies of x and of its half-swapped, half-negated image in PSUM made by the Scalar engine) and the
GpSimd engine (against a half table ``-t`` negated once per chunk on the Scalar engine). The tables are
loaded per slab of rows, so the first slabs start before a chunk's whole tables have arrived, and each
engine's last sum of a tile is issued after the next tile's first products (pipelined across tiles).
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
from trnkit.nki_api import nisa, nki, nl, nt

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


def _load_tables(cos, sin, packed, b, s0, P, NT, D, backward, j0=0, nj=None):
    """fp32 SBUF tiles ``[P, nj, D]`` of ``cos`` and of the (unsigned) table ``t`` for rows
    ``s0 + p*NT + j``, ``j0 <= j < j0 + nj`` (default: all NT; batch ``b`` if 3-D): forward ``t = sin``,
    backward ``t = cat(sin[h:], sin[:h])``. With the sign of :func:`_neg_half` applied to one half of
    ``swap_halves(x)*t``, ``y = x*cos + sign*swap_halves(x)*t`` (no compute on the tables at all).
    """
    h = D // 2
    if nj == None:  # noqa: E711 (the NKI compiler rejects `is`)
        nj = NT
    rows = cos.shape[-2]
    width = cos.shape[-1]  # D, or 2D for the packed cache (cos | sin per row)
    base = ((b * rows + s0) * width if len(cos.shape) == 3 else s0 * width) + j0 * width
    sin_base = base + D if packed else base
    c_t = nl.ndarray((P, nj, D), dtype=nl.float32, buffer=nl.sbuf)
    t_t = nl.ndarray((P, nj, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=c_t, src=cos.ap(pattern=[[NT * width, P], [width, nj], [1, D]], offset=base))
    half = [[NT * width, P], [width, nj], [1, h]]
    if backward:
        nisa.dma_copy(dst=t_t[:, :, 0:h], src=sin.ap(pattern=half, offset=sin_base + h))
        nisa.dma_copy(dst=t_t[:, :, h:D], src=sin.ap(pattern=half, offset=sin_base))
    else:
        nisa.dma_copy(dst=t_t, src=sin.ap(pattern=[[NT * width, P], [width, nj], [1, D]], offset=sin_base))
    return c_t, t_t


def _neg_half(D, backward):
    """``(lo, hi)``: the half of ``swap_halves(x)*t`` that enters y with a minus sign (forward the
    first half, ``-x[h:]*sin[:h]``; backward the second, ``-x[:h]*sin[:h]``)."""
    h = D // 2
    return (h, D) if backward else (0, h)


def _rotate_slabs(slabs, on_vector, backward, pipe, store):
    """``y = x*cos + sign*swap_halves(x)*t`` for each ``(y, x, cos, t, tn)`` slab (<= 512 elements per
    partition, last dim D; cos/t views of x's shape; the sign is -1 on :func:`_neg_half`); fp32 math,
    one rounding into y's dtype. ``tn`` = ``-t`` on the negated half (GpSimd path only, else unused).
    ``(-u)*t = u*(-t) = -(u*t)`` exactly, so this is the reference's arithmetic bit for bit.

    Vector path: the Scalar engine (otherwise idle) copies x and its half-swapped, half-negated image
    exactly to fp32 PSUM tiles, so each of the three Vector passes has a PSUM operand and runs
    single-pass. GpSimd path (no PSUM access): the swapped product is two half passes into SBUF, one of
    them against ``tn``.
    Instructions are software-pipelined (slab j+1's products are issued before slab j's sum), across
    tiles too: ``pipe[0 if on_vector else 1]`` holds the engine's last unsummed slab, and ``store``
    (``(dst AP, y tile)``) is issued right after the sum of this tile's last slab, so an in-order engine
    never waits on the result of the instruction just before it. :func:`_flush` ends both pipelines.
    """
    e = 0 if on_vector else 1
    pending = pipe[e]  # (y, a, bx, store or None) of the engine's previous slab
    for y_v, x_v, c_v, t_v, tn_v in slabs:
        D = x_v.shape[-1]
        h = D // 2
        n0, n1 = _neg_half(D, backward)
        p0, p1 = (h, D) if n0 == 0 else (0, h)  # the other half (plus sign)
        shape = x_v.shape
        if on_vector:
            eng = nisa.engine.vector
            x_ps = nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)
            xs_ps = nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)
            nisa.tensor_copy(dst=x_ps, src=x_v, engine=nisa.engine.scalar)
            # swap_halves(x): xs[0:h] = x[h:D], xs[h:D] = x[0:h]; times -1 (exact) on the negated half
            nisa.tensor_scalar(dst=xs_ps[..., n0:n1], data=x_v[..., p0:p1], op0=nl.multiply, operand0=-1.0,
                               engine=nisa.engine.scalar)
            nisa.tensor_copy(dst=xs_ps[..., p0:p1], src=x_v[..., n0:n1], engine=nisa.engine.scalar)
            a_t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=a_t, data1=x_ps, data2=c_v, op=nl.multiply, engine=eng)
            nisa.tensor_tensor(dst=xs_ps, data1=xs_ps, data2=t_v, op=nl.multiply, engine=eng)
            if pending != None:  # noqa: E711 (the NKI compiler rejects `is`)
                _finish(pending, eng)
            pending = (y_v, a_t, xs_ps, None)
        else:
            eng = nisa.engine.gpsimd
            a_t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
            bx_t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=a_t, data1=x_v, data2=c_v, op=nl.multiply, engine=eng)
            # swap_halves(x)*t, the negated half against the pre-negated table half tn
            nisa.tensor_tensor(dst=bx_t[..., n0:n1], data1=x_v[..., p0:p1], data2=tn_v, op=nl.multiply,
                               engine=eng)
            if pending != None:  # noqa: E711
                _finish(pending, eng)
            nisa.tensor_tensor(dst=bx_t[..., p0:p1], data1=x_v[..., n0:n1], data2=t_v[..., p0:p1],
                               op=nl.multiply, engine=eng)
            pending = (y_v, a_t, bx_t, None)
    pipe[e] = (pending[0], pending[1], pending[2], store)


def _finish(pending, eng):
    """The sum ``y = a + bx`` of a pending slab, then its tile's store if it was the tile's last slab."""
    y_v, a_t, bx_t, store = pending
    nisa.tensor_tensor(dst=y_v, data1=bx_t, data2=a_t, op=nl.add, engine=eng)
    if store != None:  # noqa: E711
        nisa.dma_copy(dst=store[0], src=store[1])


def _flush(pipe):
    """Sum the last pending slab of each engine (and store its tile)."""
    for e in range(2):
        if pipe[e] != None:  # noqa: E711
            _finish(pipe[e], nisa.engine.vector if e == 0 else nisa.engine.gpsimd)
            pipe[e] = None


def _neg_table(t_t, D, backward):
    """``-t`` on the :func:`_neg_half` of a table tile ``[P, nj, D]``: a ``[P, nj, D/2]`` tile for the GpSimd
    path (exact; on the lightly loaded Scalar engine)."""
    n0, n1 = _neg_half(D, backward)
    tn = nl.ndarray((t_t.shape[0], t_t.shape[1], D // 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=tn, data=t_t[:, :, n0:n1], op0=nl.multiply, operand0=-1.0, engine=nisa.engine.scalar)
    return tn


# Elementwise cost per element of a slab: Vector 3 single passes at 0.96 GHz (trn2 ISA cost table);
# GpSimd 3 two-input passes at 1.2 GHz at 0.25 elements per cycle per input, the slow end of the GpSimd
# rates trnkit's cost model considers (no public figure): the split then never makes GpSimd the
# bottleneck, and a faster GpSimd only leaves it idle. Each slab goes to the engine that finishes first.
_VECTOR_NS_PER_ELEM = 3 / 0.96
_GPSIMD_NS_PER_ELEM = 3 * 2 / 0.25 / 1.2


def _pick_vector(load, n):
    """Greedy balance of slabs over Vector/GpSimd; ``load`` = [vector_ns, gpsimd_ns], updated."""
    v, g = load[0] + n * _VECTOR_NS_PER_ELEM, load[1] + n * _GPSIMD_NS_PER_ELEM
    if v <= g:
        load[0] = v
        return True
    load[1] = g
    return False


def _chunk_bhsd(q, k, q_out, k_out, cos, sin, packed, backward, s0, P, NT, load, pipe):
    B, _, S, D = q.shape
    per_batch = len(cos.shape) == 3
    pat = [[NT * D, P], [D, NT], [1, D]]
    ns = max(1, PSUM_FMAX // D)  # rows per slab
    for bt in range(B if per_batch else 1):
        heads = []  # (x, x_out, HBM offset) of every head tile that uses these tables
        b_lo, b_hi = (bt, bt + 1) if per_batch else (0, B)
        for b in range(b_lo, b_hi):
            for x, x_out in ((q, q_out), (k, k_out)):
                H = x.shape[1]
                for hd in range(H):
                    heads.append((x, x_out, ((b * H + hd) * S + s0) * D))
        # one (cos, t) pair per slab of rows, and the first two heads' loads (one per engine) issued
        # right after the first pair, so the first slabs start before the whole chunk's tables arrive
        tabs = [_load_tables(cos, sin, packed, bt, s0, P, NT, D, backward, 0, min(NT, ns))]
        early = []
        for i in range(min(2, len(heads))):
            x_e = nl.ndarray((P, NT, D), dtype=q.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_e, src=heads[i][0].ap(pattern=pat, offset=heads[i][2]))
            early.append(x_e)
        for t0 in range(ns, NT, ns):
            tabs.append(_load_tables(cos, sin, packed, bt, s0, P, NT, D, backward, t0, min(NT, t0 + ns) - t0))
        negs = None  # -t on the negated half, per piece: built when the first GpSimd tile needs it
        for i in range(len(heads)):
            x, x_out, off = heads[i]
            if i < len(early):
                x_t = early[i]
            else:
                x_t = nl.ndarray((P, NT, D), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_t, src=x.ap(pattern=pat, offset=off))
            y_t = nl.ndarray((P, NT, D), dtype=x.dtype, buffer=nl.sbuf)
            # one engine per tile: slabs of one tile on two engines would order each other
            on_vector = _pick_vector(load, NT * D)
            if not on_vector and negs == None:  # noqa: E711
                negs = []
                for tab in tabs:
                    negs.append(_neg_table(tab[1], D, backward))
            slabs = []
            for t0 in range(0, NT, ns):
                t1 = min(NT, t0 + ns)
                c_v, t_v = tabs[t0 // ns]
                tn_v = None if on_vector else negs[t0 // ns]
                slabs.append((y_t[:, t0:t1, :], x_t[:, t0:t1, :], c_v, t_v, tn_v))
            _rotate_slabs(slabs, on_vector, backward, pipe, (x_out.ap(pattern=pat, offset=off), y_t))


def _chunk_bshd(q, k, q_out, k_out, cos, sin, packed, backward, s0, P, NT, load, pipe):
    B, S, _, D = q.shape
    per_batch = len(cos.shape) == 3
    for b in range(B):
        if per_batch or b == 0:
            c_t, s_t = _load_tables(cos, sin, packed, b, s0, P, NT, D, backward)
            tn_t = None
        for x, x_out in ((q, q_out), (k, k_out)):
            H = x.shape[2]
            off = (b * S + s0) * H * D
            pat = [[NT * H * D, P], [H * D, NT], [D, H], [1, D]]
            x_t = nl.ndarray((P, NT, H, D), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_t, src=x.ap(pattern=pat, offset=off))
            y_t = nl.ndarray((P, NT, H, D), dtype=x.dtype, buffer=nl.sbuf)
            on_vector = _pick_vector(load, NT * H * D)
            if not on_vector and tn_t == None:  # noqa: E711
                tn_t = _neg_table(s_t, D, backward)
            G = max(1, min(H, PSUM_FMAX // D))  # heads per slab
            ns = max(1, PSUM_FMAX // (G * D))  # rows per slab
            slabs = []
            for t0 in range(0, NT, ns):
                t1 = min(NT, t0 + ns)
                for g0 in range(0, H, G):
                    g1 = min(H, g0 + G)
                    # cos/sin rows t0:t1 seen as [P, rows, heads, D] with a stride-0 head axis
                    bcast = [[NT * D, P], [D, t1 - t0], [0, g1 - g0], [1, D]]
                    tn_v = None
                    if not on_vector:
                        h = D // 2
                        tn_v = tn_t.ap(pattern=[[NT * h, P], [h, t1 - t0], [0, g1 - g0], [1, h]], offset=t0 * h)
                    slabs.append((y_t[:, t0:t1, g0:g1, :], x_t[:, t0:t1, g0:g1, :],
                                  c_t.ap(pattern=bcast, offset=t0 * D), s_t.ap(pattern=bcast, offset=t0 * D),
                                  tn_v))
            _rotate_slabs(slabs, on_vector, backward, pipe, (x_out.ap(pattern=pat, offset=off), y_t))
            x_t, y_t, slabs = None, None, None  # release the row slabs before the next tile's allocation


@nki.jit
def rope_hf_kernel(q, k, q_out: nt.mutable_tensor, k_out: nt.mutable_tensor, cos, sin, packed=False,
                   backward=False, bshd=False):
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
    pipe = [None, None]  # per engine (Vector, GpSimd): the last slab whose sum is not yet issued
    for ci in range(len(chunks)):
        if ci % n_prog == pid:
            s0, P, NT = chunks[ci]
            if bshd:
                _chunk_bshd(q, k, q_out, k_out, cos, sin, packed, backward, s0, P, NT, load, pipe)
            else:
                _chunk_bhsd(q, k, q_out, k_out, cos, sin, packed, backward, s0, P, NT, load, pipe)
    _flush(pipe)
    return q_out, k_out


def _launch(layout: str, q: Any, k: Any, q_out: Any, k_out: Any, cos: Any, sin: Any, rope_cache: Any,
            backward: bool) -> tuple[Any, Any]:
    check(constraints(q, k, cos, sin, rope_cache, layout=layout, q_out=q_out, k_out=k_out))
    packed = rope_cache is not None
    c, s = (_dense(rope_cache),) * 2 if packed else (_dense(cos), _dense(sin))
    return rope_hf_kernel(_dense(q), _dense(k), q_out, k_out, c, s, packed=packed, backward=bool(backward),
                          bshd=layout == "bshd")


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
