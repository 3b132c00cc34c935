"""DMA instructions: ``dma_copy`` (incl. indirect gather / scatter through ``.ap(vector_offset=...)``),
``dma_transpose``, ``dma_compute``.

Semantics (``nki/api/nki/isa/__init__.py`` ``dma_copy``, NKI 0.6): HBM<->SBUF, SBUF->SBUF, HBM->HBM;
no PSUM source (since 0.3.0); total element counts of src and dst must match (shapes need not: the
elements are copied in row-major order of each view); different dtypes convert through fp32;
``dge_mode=hwdge`` needs equal dtypes. A ``vector_offset`` view on the HBM side makes partition ``p``
read / write row ``idx[p]``; out-of-bounds rows raise (``oob_mode.error``) or are skipped
(``oob_mode.skip``). A dynamic ``scalar_offset`` out of bounds likewise raises or skips the transfer.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes as _dt
from .. import trace
from ..errors import NkiValidationError, fail, require
from ..tensor import NkiTensor
from . import common
from .common import dge_mode, engine, oob_mode

__all__ = ["dma_copy", "dma_compute", "dma_transpose"]


def _convert(values: np.ndarray, dst_dtype: np.dtype) -> np.ndarray:
    """DMA dtype conversion: src -> float32 -> dst (identity when the dtypes match)."""
    if values.dtype == dst_dtype:
        return values
    return _dt.cast(values.astype(np.float32, copy=False), dst_dtype)


def _check_endpoints(op: str, dst: NkiTensor, src: NkiTensor) -> None:
    """Buffer rules shared by the DMA copies: no PSUM side, on-chip sides <= 128 partitions."""
    # (plain ifs: require()'s keyword values would be built on every call)
    if src.buffer.name == "psum":
        fail(op, "src cannot be in PSUM (copy it to SBUF with nisa.tensor_copy first); src {name!r}",
             name=src.name)
    if dst.buffer.name == "psum":
        fail(op, "dst cannot be in PSUM (DMA moves HBM<->SBUF, SBUF->SBUF, HBM->HBM); dst {name!r}",
             name=dst.name)
    for role, t in (("dst", dst), ("src", src)):
        if t.on_chip and t.shape[0] > 128:
            fail(op, "{role} partition dimension {p} exceeds maximum 128 (tensor {name!r})", role=role,
                 p=t.shape[0], name=t.name)


def _views(dst: NkiTensor, src: NkiTensor, skip: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(src values, dst array)`` of a plain (not indirect) DMA; ``(None, None)`` when a dynamic
    start is out of bounds and ``oob_mode=skip`` (the transfer is skipped); otherwise OOB raises."""
    try:
        return src.np(), dst.np()
    except NkiValidationError:
        if skip and (src._dyn is not None or dst._dyn is not None):
            return None, None
        raise


def _emit_dma(op: str, dst: NkiTensor, src: NkiTensor, moved: int, attrs: dict) -> None:
    """Trace record of a DMA moving ``moved`` elements from ``src`` to ``dst``."""
    nbytes = moved * dst.dtype.itemsize
    src_bytes = moved * src.dtype.itemsize
    hbm = (0 if src.on_chip else src_bytes) + (0 if dst.on_chip else nbytes)
    attrs.setdefault("contiguous_bytes", min(common.contiguous_bytes(dst), common.contiguous_bytes(src)))
    common.emit(op, common.DMA, dst=dst, srcs={"src": src}, hbm_bytes=hbm,
                dma_bytes=max(nbytes, src_bytes), attrs=attrs)


def _gather(op: str, dst: NkiTensor, store: np.ndarray, index: np.ndarray, valid: np.ndarray,
            moved: int) -> int:
    """``dst = store[index]`` (rows or elements); with oob_mode=skip only the valid partitions are
    written and the rest of ``dst`` is left untouched. Returns the elements moved."""
    if valid.all():
        _write(dst, _convert(store[index], dst.dtype))
        return moved
    out = dst.np()
    require(out.shape[0] == index.shape[0], op, "oob_mode=skip gathers need dst with the "
            "same partition count as the index ({p}), got {shape}", p=index.shape[0], shape=out.shape)
    vals = _convert(store[index[valid]], dst.dtype)
    out[valid] = vals.reshape(out[valid].shape)
    return int(vals.size)


def _scatter(src: NkiTensor, dtype: np.dtype, store: np.ndarray, index: np.ndarray,
             valid: np.ndarray) -> int:
    """``store[index] = src`` for the valid partitions. Returns the elements moved."""
    vals = _convert(src.np(), dtype).reshape(index.shape + store.shape[1:])
    # rows are written in partition order, so duplicate indices keep the last partition's row
    store[index[valid]] = vals[valid]
    return int(vals[valid].size)


def dma_copy(dst: NkiTensor, src: NkiTensor, priority: int | None = None,
             oob_mode: oob_mode = oob_mode.error, dge_mode: dge_mode = dge_mode.unknown,
             engine: engine = engine.unknown, name: str | None = None) -> None:
    """Copy ``src`` into ``dst`` with DMA engines (see module doc for the rules)."""
    op = "dma_copy"
    dge_mode = _dge_mode(op, dge_mode)
    common.check_tensor(op, "dst", dst)
    common.check_tensor(op, "src", src)
    _check_endpoints(op, dst, src)
    n_dst, n_src = dst.size, src.size
    if n_dst != n_src:
        fail(op, "element counts differ: dst {dst_shape} has {n_dst}, src {src_shape} has {n_src}",
             dst_shape=dst.shape, n_dst=n_dst, src_shape=src.shape, n_src=n_src)
    if dge_mode is common.dge_mode.hwdge:
        if dst.dtype != src.dtype:
            fail(op, "dge_mode=hwdge needs equal dtypes, got dst {dst_dtype} and src {src_dtype} (use "
                 ".view() to reinterpret)", dst_dtype=dst.dtype, src_dtype=src.dtype)
    elif engine is not common.engine.unknown:
        fail(op, "engine= is only valid with dge_mode=hwdge, got {engine}", engine=engine)
    # A trace-only launch (memory.LaunchRules.trace_only) does not compute large matmuls, so addresses
    # derived from their results (router_topk's scatter indices) are not meaningful: an out-of-bounds
    # dynamic address is skipped instead of raising, and the transfer is still traced at its full size.
    trace_only = trace.trace_only()
    skip = oob_mode is common.oob_mode.skip or trace_only
    src_vec, dst_vec = src.indirect_info, dst.indirect_info
    if src_vec is not None and dst_vec is not None:
        fail(op, "only one side of a dma_copy can use vector_offset")
    if (src_vec is not None or dst_vec is not None) and dge_mode not in _INDIRECT_DGE:
        # DGE deep dive (nki/deep-dives/nki-dge.rst, "How .ap() Affects DGE Mode"): with
        # vector_offset "the DGE mode is constrained to swdge" (table: unknown or swdge), "the only
        # mode that supports indirect (gather/scatter) operations with dynamic indices from SBUF"
        fail(op, "a vector_offset (gather/scatter) view needs dge_mode unknown or swdge, got {mode} "
             "(NKI DGE guide, \"How .ap() Affects DGE Mode\": software DGE is the only mode that "
             "supports indirect gather/scatter)", mode=f"dge_mode.{dge_mode.name}")

    moved = n_dst
    if src_vec is not None or dst_vec is not None:
        side = src if src_vec is not None else dst
        # whole rows through a strided row table where the view allows it, else a flat address array
        store, index, valid = side.indirect_rows(op, skip) or side.indirect_plan(op, skip)
        if src_vec is not None:
            moved = _gather(op, dst, store, index, valid, moved)
        else:
            moved = _scatter(src, dst.dtype, store, index, valid)
    else:
        src_np, out = _views(dst, src, skip)
        if src_np is None:
            moved = 0  # dynamic start out of bounds: the transfer is skipped
        else:
            vals = _convert(src_np, dst.dtype)
            out[...] = vals if vals.shape == out.shape else vals.reshape(out.shape)
    if trace.active() is None:
        return
    if trace_only:
        moved = n_dst
    attrs = {"dge_mode": dge_mode.name, "indirect": src_vec is not None or dst_vec is not None, "name": name}
    if engine is not common.engine.unknown:  # the trigger engine, whose queue the cost model puts it in
        attrs["engine"] = engine.name
    _emit_dma(op, dst, src, moved, attrs)


_INDIRECT_DGE = (dge_mode.unknown, dge_mode.swdge)


def _check_skip_is_indirect(op: str, oob_mode: oob_mode, tensors: list[NkiTensor], doc: str) -> None:
    """``oob_mode=skip`` only where an operand's address is dynamic (vector_offset / scalar_offset)."""
    if oob_mode is common.oob_mode.skip and not any(t.indirect_info is not None or t._dyn is not None
                                                     for t in tensors):
        fail(op, "oob_mode=skip is only valid with indirect indexing (a vector_offset or scalar_offset "
             "view), and no operand uses one ({doc})", doc=doc)


# Permutation per source rank (NKI ``dma_transpose`` docs: 2-D [1, 0], 3-D [2, 1, 0], 4-D [3, 1, 2, 0])
_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst: NkiTensor, src: NkiTensor, axes: tuple[int, ...] | None = None,
                  priority: int | None = None, dge_mode: dge_mode = dge_mode.unknown,
                  oob_mode: oob_mode = oob_mode.error, name: str | None = None) -> None:
    """``dst = src.transpose(axes)`` through the DMA engines.

    Rules (``nki.isa.dma_transpose`` docstring, NKI 0.6 = aws-neuron-sdk@81ce03ae
    ``nki/api/nki/isa/__init__.py``, "DMA Direct Transpose Constraints"): the permutation is fixed by
    the rank of ``src`` (2-D ``(1, 0)``, 3-D ``(2, 1, 0)``, 4-D ``(3, 1, 2, 0)``), ``axes`` may only
    restate it; src in HBM or SBUF, dst in SBUF; ``dge_mode`` ``unknown`` or ``hwdge`` (and ``none``,
    which nki-library's tested mlp_tkg passes; checked as ``unknown``); ``src.shape[-1]
    <= 128``. ``hwdge`` (the hardware-DGE lowering) further needs 16 source rows, 128 columns and a
    2-byte dtype (see :func:`_hwdge_violation`). ``unknown`` lets the compiler pick the lowering, and
    the docs describe no other direct one, so trnkit accepts there a src that meets the hwdge rules or
    the forms AWS's tested kernels use with ``unknown`` (``[A, F]``, ``[A, 1, F]`` or
    ``[A, 1, B, F]``, any dtype: nki-library ``experimental/collectives/fgcc.py``, ``topk_reduce.py``,
    ``core/qkv/qkv_cte.py``, ``core/attention/attention_cte.py``) and rejects the rest as not known
    to compile. dst must have the permuted shape and src's dtype;
    no conversion. An indirect src (an HBM ``vector_offset`` view: partition ``p`` reads row
    ``vector_offset[p]``) is gathered, then transposed; it needs ``dge_mode`` ``unknown`` or
    ``swdge`` as every indirect DMA does (see :func:`dma_copy`).
    """
    op = "dma_transpose"
    dge_mode = _dge_mode(op, dge_mode)
    common.check_tensor(op, "dst", dst)
    common.check_tensor(op, "src", src)
    _check_endpoints(op, dst, src)
    common.check_buffer(op, "src", src, ("hbm", "sbuf"))
    common.check_buffer(op, "dst", dst, common.SBUF)
    perm = _TRANSPOSE_AXES.get(len(src.shape))
    if perm is None:
        fail(op, "src must be 2-D, 3-D or 4-D (permutations (1, 0), (2, 1, 0), (3, 1, 2, 0)), got "
             "shape {shape}", shape=src.shape)
    if axes is not None and tuple(axes) != perm:
        fail(op, "axes must be {perm} for a {n}-D src (supported: (1, 0), (2, 1, 0), (3, 1, 2, 0)), "
             "got {axes}", perm=perm, n=len(src.shape), axes=tuple(axes))
    # The docstring lists unknown and hwdge. nki-library's mlp_tkg gate/up projection (run by moe_tkg's
    # all-expert path, tested on trn2) transposes its bias with dge_mode=3, none ("Use STATIC DMA mode":
    # descriptors built at compile time); the tested kernel wins, so none runs under unknown's shape
    # rules. swdge (descriptors built by software at run time) only with an indirect src: the DGE deep
    # dive (nki-dge.rst, "How .ap() Affects DGE Mode") calls software DGE "the only mode that supports
    # indirect (gather/scatter) operations with dynamic indices from SBUF", and nki-library's tested
    # attention_tkg loads block-KV K^T with an indirect dma_transpose at dge_mode=swdge.
    indirect = src.indirect_info is not None
    allowed = (common.dge_mode.unknown, common.dge_mode.swdge) if indirect else \
        (common.dge_mode.unknown, common.dge_mode.hwdge, common.dge_mode.none)
    if dge_mode not in allowed:
        fail(op, "the only valid dge_modes are {valid}, got {mode}", mode=dge_mode,
             valid="unknown and swdge for an indirect (vector_offset) src" if indirect
             else "unknown, hwdge and none (static); swdge needs an indirect (vector_offset) src")
    # dma_transpose docstring (NKI 0.6): "oob_mode.skip: ... Only valid when src uses indirect
    # indexing"; NKI 0.5.0 release notes: "dma_transpose with scalar_offset now supports oob_mode.skip"
    _check_skip_is_indirect(op, oob_mode, [src], "nki.isa.dma_transpose: oob_mode.skip is \"Only valid "
                            "when src uses indirect indexing\"")
    _check_transpose_shape(op, src, dge_mode)
    if dst.indirect_info is not None:
        fail(op, "dst cannot be indirect (vector_offset); only the src of a transpose may gather rows")
    want = tuple(src.shape[a] for a in perm)
    if tuple(dst.shape) != want:
        fail(op, "dst shape must be src shape {src_shape} permuted by {perm} = {want}, got {dst_shape}",
             src_shape=src.shape, perm=perm, want=want, dst_shape=dst.shape)
    if dst.dtype != src.dtype:
        fail(op, "dst dtype must equal src dtype, got dst {dst_dtype} and src {src_dtype}",
             dst_dtype=dst.dtype, src_dtype=src.dtype)
    if indirect:
        moved = _indirect_transpose(op, dst, src, perm, oob_mode is common.oob_mode.skip or trace.trace_only())
    else:
        src_np, out = _views(dst, src, oob_mode is common.oob_mode.skip)
        moved = 0
        if src_np is not None:
            out[...] = np.transpose(src_np, perm)
            moved = dst.size
    if trace.active() is None:
        return
    _emit_dma(op, dst, src, moved, {"dge_mode": dge_mode.name, "transpose": True, "indirect": indirect,
                                    "name": name})


def _indirect_transpose(op: str, dst: NkiTensor, src: NkiTensor, perm: tuple[int, ...], skip: bool) -> int:
    """Gather the rows of an indirect src, then write them transposed; with ``oob_mode=skip`` the dst
    elements that an out-of-range row would fill keep their values. Returns the elements moved."""
    store, index, valid = src.indirect_rows(op, skip) or src.indirect_plan(op, skip)
    out = dst.np()
    inverse = tuple(np.argsort(perm))
    rows = np.transpose(out, inverse).copy()  # dst in src's layout: row p is src partition p
    rows[valid] = store[index[valid]].reshape(rows[valid].shape)
    out[...] = np.transpose(rows, perm)
    return int(valid.sum()) * (dst.size // max(len(valid), 1))


def _hwdge_violation(src: NkiTensor) -> str | None:
    """The first documented hardware-DGE transpose rule ``src`` breaks (None: it meets them all).

    Two NKI 0.6 pages state the rules differently (aws-neuron-sdk@81ce03ae): the ``dma_transpose``
    docstring (``nki/api/nki/isa/__init__.py``) wants 2-D ``src.shape[0] == 16``, 3-D / 4-D
    ``src.shape[0]`` in {1, 2, 4, 8, 16} with ``src.shape[0] * src.shape[-2] % 16 == 0``, and
    ``src.shape[-1] <= 128``; the DGE deep dive (``nki/deep-dives/nki-dge.rst``, "Hardware DGE
    constraints for dma_transpose") wants ``src.shape[0] == 16`` and ``src.shape[-1] % 128 == 0``.
    Both want a 2-byte dtype. trnkit accepts only what both allow: 16 rows, 128 columns.
    """
    shape = tuple(src.shape)
    if shape[0] != 16:
        return f"needs src.shape[0] == 16, got {shape[0]}"
    if shape[-1] != 128:
        return f"needs src.shape[-1] == 128 (<= 128 and a multiple of 128), got {shape[-1]}"
    if src.dtype.itemsize != 2:
        return f"needs a 2-byte src dtype, got {src.dtype} ({src.dtype.itemsize} bytes)"
    return None


def _check_transpose_shape(op: str, src: NkiTensor, mode: dge_mode) -> None:
    """The documented shape rules of a direct DMA transpose (see :func:`dma_transpose`)."""
    hwdge = mode is common.dge_mode.hwdge
    shape = tuple(src.shape)
    if shape[-1] > 128:
        fail(op, "src.shape[-1] must be <= 128 (it becomes dst's partition dim), got {f} (src shape "
             "{shape})", f=shape[-1], shape=shape)
    why = _hwdge_violation(src)
    if hwdge and why is not None:
        fail(op, "dge_mode=hwdge: {why} (src shape {shape})", why=why, shape=shape)
    # the forms AWS's tested kernels compile with the default DGE mode: [A, F], [A, 1, F] and
    # [A, 1, B, F] (nki-library core/qkv/qkv_cte.py loads [s, 1, H/128, 128] tiles of the input,
    # core/attention/attention_cte.py [s, 1, 1, d]; test_qkv_cte.py / test_attention_cte.py run on trn2)
    plain = len(shape) == 2 or shape[1] == 1
    if why is not None and not plain:
        fail(op, "dge_mode={mode}: src shape {shape} meets neither the hardware-DGE rules ({why}) nor "
             "a form AWS's tested kernels use ([A, F], [A, 1, F], [A, 1, B, F]; no other direct "
             "lowering is documented)", mode=mode.name, shape=shape, why=why)


def _dge_mode(op: str, value: object) -> dge_mode:
    """``dge_mode`` as the enum; its raw value is accepted too (nki-library passes ``dge_mode=3``,
    ``_DGE_MODE_NONE = 3  # Use STATIC DMA mode``, in norm_tkg_utils.py, qkv_tkg.py, mlp_tkg)."""
    if isinstance(value, common.dge_mode):
        return value
    try:
        return common.dge_mode(value)
    except ValueError:
        fail(op, "dge_mode must be one of {valid}, got {value!r}", value=value,
             valid=", ".join(f"{m.name} ({m.value})" for m in common.dge_mode))


def _write(dst: NkiTensor, vals: np.ndarray) -> None:
    out = dst.np()
    out[...] = vals if vals.shape == out.shape else vals.reshape(out.shape)


def _same_view(a: NkiTensor, b: NkiTensor) -> bool:
    return (a.storage is b.storage and a.shape == b.shape and a.strides == b.strides
            and a.offset == b.offset and a.dtype == b.dtype and a.indirect_info == b.indirect_info)


def dma_compute(dst: NkiTensor, srcs: list[NkiTensor] | tuple[NkiTensor, ...], reduce_op: object,
                scales: list[float] | None = None, unique_indices: bool = True,
                oob_mode: oob_mode = oob_mode.error, name: str | None = None) -> None:
    """``dst = srcs[0] + srcs[1] + ...`` computed in fp32 inside the DMA engines.

    With a ``vector_offset`` view it is a read-modify-write (NKI 0.6 ``dma_compute`` docs): scatter
    ``dst(HBM)[idx] += src(SBUF)`` (dst and one src are the same indirect HBM view) or gather
    ``dst(SBUF) += src(HBM)[idx]`` (one src is the indirect HBM view, the other is dst). Only
    ``reduce_op=nl.add``, scales of 1.0 and unique indices are supported, as on the hardware.
    """
    op = "dma_compute"
    from .. import ops as _ops

    common.check_tensor(op, "dst", dst)
    srcs = list(srcs)
    require(1 <= len(srcs) <= 16, op, "srcs must hold 1 to 16 tensors, got {n}", n=len(srcs))
    for i, s in enumerate(srcs):
        common.check_tensor(op, f"srcs[{i}]", s)
    f = _ops.resolve(reduce_op, f"{op}.reduce_op")
    require(f is not None and f.name == "add", op, "only reduce_op=nl.add is supported, got {op_}",
            op_=reduce_op)
    require(scales is None or all(float(x) == 1.0 for x in scales), op, "all scales must be 1.0, got "
            "{scales}", scales=scales)
    require(unique_indices is True, op, "unique_indices=False (non-unique indices) is not supported")
    for role, t in [("dst", dst)] + [(f"srcs[{i}]", s) for i, s in enumerate(srcs)]:
        require(t.buffer.name != "psum", op, "{role} cannot be in PSUM (tensor {name!r})", role=role,
                name=t.name)
        require(t.size == dst.size, op, "element counts differ: {role} has {n}, dst has {n_dst}",
                role=role, n=t.size, n_dst=dst.size)
    # NKI 0.4.0 release notes: "Validation ensures oob_mode.skip is used only with indirect indexing"
    _check_skip_is_indirect(op, oob_mode, [dst] + srcs, "NKI 0.4.0 release notes: dma_compute "
                            "\"Validation ensures oob_mode.skip is used only with indirect indexing\"")
    skip = oob_mode is common.oob_mode.skip
    indirect = [i for i, s in enumerate(srcs) if s.indirect_info is not None]
    if dst.indirect_info is not None or indirect:
        require(len(srcs) == 2, op, "read-modify-write (vector_offset) needs exactly 2 srcs, got {n}",
                n=len(srcs))
        if dst.indirect_info is not None:  # scatter RMW: dst(HBM)[idx] += src(SBUF)
            require(any(_same_view(s, dst) for s in srcs), op, "scatter read-modify-write needs one "
                    "src to be the same indirect HBM view as dst")
            data = next(s for s in srcs if not _same_view(s, dst))
            require(data.buffer.name == "sbuf", op, "scatter read-modify-write data must be in SBUF, "
                    "got {buffer}", buffer=data.buffer.name)
            flat, addr, valid = dst.indirect_plan(op, skip)
            rows = dst.indirect_info[0].np().reshape(-1)[valid]
            require(np.unique(rows).size == rows.size, op, "indices must be unique "
                    "(unique_indices=True), got duplicates in {rows}", rows=rows.tolist())
            vals = data.np().astype(np.float32).reshape(addr.shape)[valid]
            a = addr[valid]
            flat[a] = _dt.cast(flat[a].astype(np.float32) + vals, dst.dtype)
        else:  # gather RMW: dst(SBUF) += src(HBM)[idx]
            src = srcs[indirect[0]]
            other = srcs[1 - indirect[0]]
            require(_same_view(other, dst), op, "gather read-modify-write needs the other src to be dst")
            require(dst.buffer.name == "sbuf", op, "gather read-modify-write dst must be in SBUF, got "
                    "{buffer}", buffer=dst.buffer.name)
            flat, addr, valid = src.indirect_plan(op, skip)
            out = dst.np()
            require(out.shape[0] == addr.shape[0], op, "gather dst needs {p} partitions (one per "
                    "index), got shape {shape}", p=addr.shape[0], shape=out.shape)
            g = flat[addr[valid]].astype(np.float32)
            cur = out[valid].astype(np.float32)
            out[valid] = _dt.cast(cur + g.reshape(cur.shape), dst.dtype)
    else:
        total = None
        for s in srcs:
            x = s.np().astype(np.float32).reshape(dst.shape)
            total = x if total is None else total + x
        common.store(dst, total)
    if trace.active() is None:
        return
    n_bytes = dst.size * dst.dtype.itemsize
    hbm = sum(s.size * s.dtype.itemsize for s in srcs if not s.on_chip)
    hbm += 0 if dst.on_chip else n_bytes
    common.emit(op, common.DMA, dst=dst, srcs={f"srcs[{i}]": s for i, s in enumerate(srcs)},
                hbm_bytes=hbm, dma_bytes=sum(s.size * s.dtype.itemsize for s in srcs) + n_bytes,
                attrs={"reduce_op": "add", "indirect": dst.indirect_info is not None or bool(indirect),
                       "dge_mode": "swdge" if (dst.indirect_info is not None or indirect) else "none",
                       "name": name})
