"""The experimental ``nki.language`` convenience wrappers (NKI 0.3+), lowered to ``nki.isa`` calls.

``nl.load``, ``nl.store``, ``nl.matmul``, ``nl.transpose``, ``nl.sum/max/min/mean/prod``,
``nl.softmax``, and the operator objects called on tiles (``nl.exp(t)``, ``nl.add(a, b, dtype=...)``)
allocate their result and issue the instruction(s) the wrapper stands for, so they are validated
and traced like hand-written ``nisa`` code. Semantics from the NKI 0.6 API reference
(``nki/api/nki/language/__init__.py``): no broadcasting in the binary wrappers, reductions over the
last contiguous free dims, ``nl.matmul`` / ``nl.transpose`` return PSUM tiles.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

from . import dtypes as _dt
from . import memory as _mem
from . import ops as _ops
from .errors import require
import numpy as np

from .tensor import NkiTensor, allocate, psum, sbuf, shared_hbm

__all__ = ["load", "store", "matmul", "transpose", "sum", "max", "min", "mean", "prod", "softmax",
           "expand_dims", "broadcast_to", "shared_constant", "shared_identity_matrix", "tile_call"]


def _isa():  # nki.isa imports nki.language; resolve lazily
    from . import isa

    return isa


def _new(shape: Sequence[int], dtype: Any, buffer: Any = sbuf) -> NkiTensor:
    return allocate(tuple(shape), _dt.resolve(dtype, "nki.language"), buffer)


def tile_call(op: _ops.NkiOp, *args: Any, dtype: Any = None, **kwargs: Any) -> NkiTensor:
    """``nl.<op>(tile, ...)``: unary -> ``activation`` (or ``tensor_scalar`` for ALU-only unary ops),
    tile/tile -> ``tensor_tensor``, tile/scalar -> ``tensor_scalar``; result in SBUF."""
    nisa = _isa()
    require(not kwargs, f"nl.{op.name}", "unexpected keyword arguments {names}", names=sorted(kwargs))
    if op.arity == 1:
        require(len(args) == 1, f"nl.{op.name}", "takes one tile, got {n} arguments", n=len(args))
        (x,) = args
        out = _new(x.shape, dtype or x.dtype)
        if op.activation:
            nisa.activation(dst=out, op=op, data=x)
        else:
            nisa.tensor_scalar(dst=out, data=x, op0=op, operand0=None)
        return out
    require(len(args) == 2, f"nl.{op.name}", "takes two operands, got {n}", n=len(args))
    a, b = args
    # NKI 0.4.0 release notes, Known Issues, "NKI Language (experimental)" (carried forward to 0.5.0 and
    # 0.6.0): the wrapper forms the hardware has no instruction for.
    require(op.name != "divide", "nl.divide", "nl.divide on tiles is not supported: division is not "
            "available as a hardware instruction; multiply by the reciprocal, nl.multiply(x, "
            "nl.reciprocal(y)) (NKI 0.4.0 release notes, Known Issues, \"NKI Language (experimental)\")",
            operands=_operand_kinds(a, b))
    require(op.name != "power" or (isinstance(a, NkiTensor) and isinstance(b, NkiTensor)), "nl.power",
            "nl.power(tile, scalar) is not supported: the exponent must be a tile too, nl.power(tile, "
            "tile) (NKI 0.4.0 release notes, Known Issues, \"NKI Language (experimental)\")",
            operands=_operand_kinds(a, b))
    if isinstance(a, NkiTensor) and isinstance(b, NkiTensor):
        out = _new(a.shape, dtype or a.dtype)
        nisa.tensor_tensor(dst=out, data1=a, data2=b, op=op)  # no broadcasting, as documented
        return out
    t, s, reverse = (a, b, False) if isinstance(a, NkiTensor) else (b, a, True)
    out = _new(t.shape, dtype or t.dtype)
    nisa.tensor_scalar(dst=out, data=t, op0=op, operand0=s, reverse0=reverse)
    return out


def _operand_kinds(a: Any, b: Any) -> str:
    """``"tile, scalar 2.0"``: the two operands of a binary wrapper call, for its error message."""
    return ", ".join(f"tile {x.shape}" if isinstance(x, NkiTensor) else f"scalar {x!r}" for x in (a, b))


_ops.set_tile_wrapper(tile_call)


def load(src: NkiTensor, dtype: Any = None) -> NkiTensor:
    """A new SBUF tile holding ``src`` (``dma_copy``; casts through fp32 when ``dtype`` differs)."""
    out = _new(src.shape, dtype or src.dtype)
    _isa().dma_copy(dst=out, src=src)
    return out


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """Write tile ``value`` into ``dst`` (``dma_copy``; a PSUM value must be copied to SBUF first)."""
    _isa().dma_copy(dst=dst, src=value)


def transpose(x: NkiTensor, dtype: Any = None) -> NkiTensor:
    """Swap the partition and free dims of a 2-D tile (Tensor Engine, result in PSUM)."""
    nisa = _isa()
    require(x.ndim == 2, "nl.transpose", "needs a 2-D tile, got shape {shape}", shape=x.shape)
    out = _new((x.shape[1], x.shape[0]), x.dtype, psum)
    nisa.nc_transpose(dst=out, data=x)
    if dtype is None or _dt.resolve(dtype) == x.dtype:
        return out
    cast = _new(out.shape, dtype)
    nisa.tensor_copy(dst=cast, src=out)
    return cast


def matmul(x: NkiTensor, y: NkiTensor, transpose_x: bool = False) -> NkiTensor:
    """``x.T @ y`` as an fp32 PSUM tile, ``x`` given as ``[K, M]`` (``transpose_x=True``). The API reference
    describes ``transpose_x=False`` (a transpose inserted), but the NKI 0.4.0 release notes' known issue, carried
    forward to 0.6.0, says it fails: "nki.language.matmul without transpose_x=True is not supported -- Calling
    nl.matmul(x, y) without setting transpose_x=True will fail"; refused, as on the real stack."""
    nisa = _isa()
    require(bool(transpose_x), "nl.matmul", "transpose_x={transpose_x}: nl.matmul without transpose_x=True is "
            "not supported (NKI 0.4.0 release notes, Known Issues, \"Calling nl.matmul(x, y) without setting "
            "transpose_x=True will fail\", carried forward to 0.6.0); pass x as [K, M] with transpose_x=True "
            "(nl.transpose(x) gives it)", transpose_x=transpose_x, x_shape=tuple(x.shape), y_shape=tuple(y.shape))
    stationary = x
    out = _new((stationary.free_size, y.free_size), _dt.float32, psum)
    nisa.nc_matmul(dst=out, stationary=stationary, moving=y)
    return out


def _axes(x: NkiTensor, axis: int | Sequence[int], op: str) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(sorted(a % x.ndim for a in axes))
    require(axes and axes[0] > 0 and axes == tuple(range(axes[0], x.ndim)), op,
            "axis {axis} must be the last contiguous free dims of a {ndim}-D tile", axis=axis,
            ndim=x.ndim)
    return axes


def _reduce(op: _ops.NkiOp, name: str, x: NkiTensor, axis: Any, dtype: Any, keepdims: bool) -> NkiTensor:
    axes = _axes(x, axis, name)
    kept = x.shape[:axes[0]]
    shape = kept + (1,) * len(axes) if keepdims else (kept if len(kept) >= 2 else kept + (1,))
    out = _new(shape, dtype or x.dtype)
    _isa().tensor_reduce(dst=out, op=op, data=x, axis=axes, keepdims=keepdims)
    return out


def sum(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:  # noqa: A001
    return _reduce(_ops.ALL_OPS["add"], "nl.sum", x, axis, dtype, keepdims)


def max(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:  # noqa: A001
    return _reduce(_ops.ALL_OPS["maximum"], "nl.max", x, axis, dtype, keepdims)


def min(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:  # noqa: A001
    return _reduce(_ops.ALL_OPS["minimum"], "nl.min", x, axis, dtype, keepdims)


def prod(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:
    return _reduce(_ops.ALL_OPS["multiply"], "nl.prod", x, axis, dtype, keepdims)


def mean(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:
    """Sum in fp32, then scale by 1/n (``tensor_scalar``) into ``dtype``."""
    s = _reduce(_ops.ALL_OPS["add"], "nl.mean", x, axis, _dt.float32, keepdims)
    n = math.prod(x.shape[a] for a in _axes(x, axis, "nl.mean"))
    out = _new(s.shape, dtype or x.dtype)
    _isa().tensor_scalar(dst=out, data=s, op0=_ops.ALL_OPS["multiply"], operand0=1.0 / n)
    return out


def softmax(x: NkiTensor, axis: Any = -1, dtype: Any = None) -> NkiTensor:
    """``exp(x - max) / sum(exp(x - max))`` over the last free dim of a 2-D tile, fp32 inside."""
    nisa = _isa()
    require(x.ndim == 2, "nl.softmax", "needs a 2-D tile, got shape {shape}", shape=x.shape)
    _axes(x, axis, "nl.softmax")
    p = x.shape[0]
    neg_max = _new((p, 1), _dt.float32)
    nisa.tensor_reduce(dst=neg_max, op=_ops.ALL_OPS["maximum"], data=x, axis=(1,), negate=True)
    e = _new(x.shape, _dt.float32)
    total = _new((p, 1), _dt.float32)
    nisa.activation(dst=e, op=_ops.ALL_OPS["exp"], data=x, bias=neg_max,
                    reduce_op=_ops.ALL_OPS["add"], reduce_res=total,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.reciprocal(dst=total, data=total)
    out = _new(x.shape, dtype or x.dtype)
    nisa.tensor_scalar(dst=out, data=e, op0=_ops.ALL_OPS["multiply"], operand0=total)
    return out



def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    """A view of ``x`` with a size-1 dim inserted at ``axis`` (not before the partition dim)."""
    return x.expand_dim(axis)


def broadcast_to(x: NkiTensor, shape: Sequence[int], dtype: Any = None) -> NkiTensor:
    """A new SBUF tile of ``shape`` holding ``x`` broadcast numpy-style (same rank; each dim equal or
    from 1). ``x`` itself when nothing changes. Free dims broadcast through a stride-0 view copied
    by ``tensor_copy``; a 1-partition ``x`` is spread over the partitions by ``nc_stream_shuffle``
    (mask ``[0] * 32`` per 32-partition quadrant, as nki-library's moe_cte_utils.py
    ``stream_shuffle_broadcast`` does)."""
    nisa = _isa()
    op = "nl.broadcast_to"
    shape = tuple(int(s) for s in shape)
    out_dtype = x.dtype if dtype is None else _dt.resolve(dtype, op)
    require(len(shape) == x.ndim, op, "shape {shape} must have the rank of x {x_shape}", shape=shape,
            x_shape=x.shape)
    for d, (n, m) in enumerate(zip(x.shape, shape)):
        require(n == m or n == 1, op, "dim {dim} of x has size {n}, cannot broadcast to {m}", dim=d,
                n=n, m=m)
    if shape == x.shape and out_dtype == x.dtype:
        return x
    view = x
    for d in range(1, x.ndim):
        if x.shape[d] != shape[d]:
            view = view.broadcast(d, shape[d])
    out = _new(shape, out_dtype)
    if shape[0] == x.shape[0]:
        nisa.tensor_copy(dst=out, src=view)
        return out
    row = _new((1,) + shape[1:], out_dtype)
    nisa.tensor_copy(dst=row, src=view)
    for q in range(0, shape[0], 32):
        stop = q + 32 if q + 32 < shape[0] else shape[0]  # (min is nl.min in this module)
        nisa.nc_stream_shuffle(dst=out[q:stop], src=row, shuffle_mask=[0] * 32)
    return out


# nl.shared_constant's docstring (NKI 0.6 API reference): "Supported element types: float32, float16, bfloat16,
# int32, int16, int8, uint32, uint16, uint8, float8_e4m3fn, float8_e5m2, float8_e8m0fnu. Packed types
# (float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4) and tfloat32 are supported at the MLIR level but not yet
# tested end-to-end on hardware" (accepted). Not listed, refused: bool and the legacy float8_e4m3.
_CONSTANT_UNSUPPORTED = ("bool", "float8_e4m3")
# a shared_constant's storage -> (program that wrote it first, its data): the cores of an LNC=2 launch share one
# constant ("With LNC=2, both cores share the same constant; the data must not diverge across cores")
_constant_writers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_constant(constant: Any) -> NkiTensor:
    """A ``shared_hbm`` tensor holding ``constant`` (numpy array or ``.npy`` path), loaded with the
    program (no instruction). In a launch of several programs the k-th ``shared_hbm`` allocation of each is
    the same tensor, so the programs' constants must hold the same data (checked)."""
    op = "nl.shared_constant"
    arr = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    name = _dt.dtype_name(_dt.resolve(arr.dtype, op))
    require(name not in _CONSTANT_UNSUPPORTED, op, "element type {dtype} is not supported (the docs list "
            "float32, float16, bfloat16, int32, int16, int8, uint32, uint16, uint8, float8_e4m3fn, float8_e5m2, "
            "float8_e8m0fnu; nl.shared_constant, NKI 0.6 API reference)", dtype=name)
    out = _new(arr.shape if arr.ndim else (1,), arr.dtype, shared_hbm)
    data = arr.reshape(out.shape)
    ctx = _mem.current()
    if ctx.launch.num_instances > 1:
        first = _constant_writers.get(out.storage)
        if first is None:
            _constant_writers[out.storage] = (ctx.program_id, data.copy())
        else:
            pid, seen = first
            same = seen.view(np.uint8).reshape(-1) == data.view(np.uint8).reshape(-1)
            if not same.all():
                at = int(np.argmin(same)) // data.dtype.itemsize
                idx = tuple(int(i) for i in np.unravel_index(at, data.shape))
                require(False, op, "constant {name!r} differs between the programs of the launch: program "
                        "{pid} made it with {a!r} at {idx}, program {pid2} with {b!r}; the programs share one "
                        "constant and \"the data must not diverge across cores\" (nl.shared_constant, NKI 0.6 "
                        "API reference)", name=out.name, pid=pid, pid2=ctx.program_id, idx=idx,
                        a=seen[idx].item(), b=data[idx].item())
    out.np()[...] = data
    return out


def shared_identity_matrix(n: int, dtype: Any = _dt.uint8, dst: NkiTensor | None = None) -> NkiTensor:
    """An ``[n, n]`` identity matrix in SBUF (or written into ``dst``), copied from a constant."""
    ident = shared_constant(np.eye(n, dtype=_dt.resolve(dtype, "nl.shared_identity_matrix")))
    out = dst if dst is not None else _new((n, n), ident.dtype)
    _isa().dma_copy(dst=out, src=ident)
    return out
