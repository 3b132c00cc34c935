"""Vector Engine instructions (and the engine checks shared with ``scalar.py`` / ``gpsimd.py``).

Every instruction is dst-first as in NKI 0.6 (``nki/api/nki/isa/__init__.py`` of the
aws-neuron-sdk docs): validate -> compute in vectorised numpy (fp32 for arithmetic, raw bits for
bitvec operators) -> round on write to ``dst.dtype`` (RNE, saturating float->int via
:func:`trnkit.nkisim.dtypes.cast`) -> emit one trace record.

Engine rules enforced for all compute engines (see ``nki-facts.md`` §2 and the docstrings cited there):
operands on chip (SBUF/PSUM), partition dim <= 128, matching partition counts and elements per
partition, free size <= 64K elements per SBUF operand and <= 4K per PSUM operand (Vector/Scalar,
``trainium_inferentia2_arch.rst``; broadcast dims not counted, see :func:`accessed_free_elems`), GpSimd never
touches PSUM, ``tensor_tensor`` inputs not both in
PSUM, bitvec operators only on integer dtypes.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from .. import controlflow as _cf
from .. import dtypes, trace
from .. import memory as _mem
from .. import ops as _ops
from ..errors import fail, require
from ..tensor import NkiTensor
from . import common

__all__ = [
    "tensor_tensor", "tensor_scalar", "scalar_tensor_tensor", "tensor_reduce", "tensor_copy",
    "tensor_copy_predicated", "memset", "reciprocal", "max8", "nc_find_index8", "nc_match_replace8",
    "tensor_scalar_reduce", "tensor_scalar_cumulative", "bn_stats", "bn_aggr", "tensor_tensor_scan",
    "select_reduce", "range_select",
]

PMAX = 128  # nl.tile_size.pmax
# elements per partition a Vector/Scalar operand may access ("up to 64K elements for SBUF or 4K
# elements for PSUM", nki/guides/architecture/trainium_inferentia2_arch.rst, VectorE and ScalarE)
SBUF_FREE_MAX = 64 * 1024
PSUM_FREE_MAX = 4 * 1024
TOPK_MIN, TOPK_MAX = 8, 16384  # max8 / nc_find_index8 / nc_match_replace8 elements per partition
_F32 = np.float32


# ---------------------------------------------------------------------------------------------
# helpers shared by the compute-engine modules
# ---------------------------------------------------------------------------------------------

def is_tile(x: Any) -> bool:
    return isinstance(x, NkiTensor)


def buf(t: NkiTensor) -> str:
    return t.buffer.name


def free_size(t: NkiTensor) -> int:
    return t.free_size


def engine_of(op: str, engine: Any, allowed: tuple[str, ...], default: str) -> str:
    """Trace engine name for an ``nisa.engine`` argument, checked against the engines ``op`` runs on."""
    name = common.engine_name(engine, default) if engine is not None else default
    if name not in allowed:
        fail(op, "engine must be one of {allowed}, got {engine}", allowed="/".join(allowed), engine=name)
    return name


def cmd_name(cmd: Any) -> str:
    """'idle' / 'reset' / 'reduce' / 'reset_reduce' / 'load_reduce' from an ``nisa.reduce_cmd`` member."""
    return str(getattr(cmd, "name", cmd)).lower()


def check_tile(op: str, role: str, t: Any, engine: str) -> None:
    """``t`` is an on-chip tile the engine may access, within the partition / free-size limits."""
    common.check_on_chip(op, role, t)
    b = t._st.buffer.name
    if engine == "gpsimd" and b == "psum":
        fail(op, "GpSimd engine cannot access PSUM ({role} is in PSUM)", role=role)
    if engine == "vector" or engine == "scalar":
        n = accessed_free_elems(t)
        limit = PSUM_FREE_MAX if b == "psum" else SBUF_FREE_MAX
        if n > limit:
            fail(op, "{role} accesses {n} elements per partition, over the {engine} engine limit "
                 "of {limit} for {buffer}", role=role, n=n, engine=engine, limit=limit, buffer=b)


def accessed_free_elems(t: NkiTensor) -> int:
    """Distinct elements per partition an operand reads or writes: stride-0 (broadcast) dims repeat
    elements and do not count. The free-size limits above bound the tile a Vector/Scalar instruction
    accesses ("the free dimension size can be up to 64K elements for SBUF or 4K elements for PSUM",
    trainium_inferentia2_arch.rst); AWS's layernorm_tkg (nki-library core/subkernels/layernorm_tkg.py,
    tested on hardware) streams a [128, 5] PSUM mean broadcast to [128, 5, 3072] = 15360 elements."""
    return math.prod(n for n, s in zip(t.shape[1:], t.strides[1:]) if s != 0)


def check_same_layout(op: str, ref_role: str, ref: NkiTensor, role: str, t: NkiTensor) -> None:
    """Same partition count and same number of elements per partition (shapes may differ)."""
    if t.shape[0] != ref.shape[0]:
        common.check_same_partitions(op, {ref_role: ref, role: t})  # raises
    if t.free_size != ref.free_size:
        common.check_same_free_size(op, {ref_role: ref, role: t})  # raises


def check_column(op: str, role: str, t: Any, partitions: int, engine: str) -> None:
    """A ``[P, 1]`` vector operand (scale, bias, operand0, reduce_res, ...)."""
    check_tile(op, role, t, engine)
    require(t.shape[0] == partitions and free_size(t) == 1, op,
            "{role} must have shape ({p}, 1), got {shape}", role=role, p=partitions,
            shape=tuple(t.shape))


def get_op(op: str, role: str, value: Any, *, alu: bool = False, activation: bool = False,
           arity: int | None = None) -> _ops.NkiOp:
    f = _ops.resolve(value, f"{op}.{role}")
    if f is None:
        fail(op, "{role} is required", role=role)
    if alu and not f.alu:
        fail(op, "{role}={f} is not an ALU operator (see nki-aluop)", role=role, f=f)
    if activation and not f.activation:
        fail(op, "{role}={f} is not an activation function (see nki-act-func)", role=role, f=f)
    if arity is not None and f.arity != arity:
        fail(op, "{role}={f} must be a {kind} operator", role=role, f=f,
             kind="binary" if arity == 2 else "unary")
    return f


def get_arith_pair(op: str, op0: Any, op1: Any) -> tuple[_ops.NkiOp, _ops.NkiOp]:
    """``op0`` / ``op1`` of a fused two-operator instruction: both binary arithmetic ALU operators."""
    f0 = get_op(op, "op0", op0, alu=True, arity=2)
    f1 = get_op(op, "op1", op1, alu=True, arity=2)
    require(not f0.is_bitvec and not f1.is_bitvec, op,
            "op0 and op1 must be arithmetic operators (got {f0}, {f1})", f0=f0, f1=f1)
    return f0, f1


def check_bitvec_dtypes(op: str, f: _ops.NkiOp, tiles: dict[str, Any]) -> None:
    if not f.is_bitvec:
        return
    for role, t in tiles.items():
        if is_tile(t):
            require(dtypes.is_int(t.dtype), op, "bitvec operator {f} needs integer dtypes, but {role} "
                    "is {dtype}", f=f, role=role, dtype=t.dtype.name)


def read(t: NkiTensor, flat: bool = True) -> np.ndarray:
    """The tile's values as fp32, ``[P, F]`` when ``flat``."""
    x = common.read_f32(t)
    return x.reshape(t.shape[0], -1) if flat else x


def read_raw(t: NkiTensor) -> np.ndarray:
    """The tile's values in its own dtype, ``[P, F]`` (a copy: safe when dst aliases the source)."""
    return np.array(t.np()).reshape(t.shape[0], -1)


def write(dst: NkiTensor, values: np.ndarray, *, bits: bool = False) -> None:
    """Store ``values`` (any shape with dst's element count) into ``dst`` via ``common.store``.

    ``bits=True`` writes integer results by truncating to dst's width (bitvec semantics); otherwise
    the value is rounded/saturated to ``dst.dtype`` like an engine's output stage.
    """
    values = np.asarray(values).reshape(dst.shape)
    common.store(dst, values.astype(dst.dtype) if bits else values)


def scalar_or_column(op: str, role: str, value: Any, partitions: int, engine: str,
                     *, fp32: bool, integer: bool = False) -> Any:
    """A compile-time scalar, or the values of a ``[P, 1]`` tile as a ``[P, 1]`` array."""
    if is_tile(value):
        check_column(op, role, value, partitions, engine)
        if fp32:
            require(value.dtype == dtypes.float32, op, "{role} tile must be float32, got {dtype}",
                    role=role, dtype=value.dtype.name)
        return read_raw(value) if integer else read(value)
    require(isinstance(value, (int, float, np.integer, np.floating, bool)), op,
            "{role} must be a scalar or a ({p}, 1) tile, got {got}", role=role, p=partitions,
            got=type(value).__name__)
    return np.int64(value) if integer else _F32(value)


_WRITE_ROLES = frozenset({"dst", "dst_idx", "reduce_res"})


def emit(opname: str, engine: str, operands: dict[str, Any], /, **attrs: Any) -> None:
    """One trace record via ``common.emit``; every output role (dst, dst_idx, reduce_res) is a write."""
    if trace.active() is None:
        return
    tiles = {r: t for r, t in operands.items() if is_tile(t)}
    attrs.update(common.dependency_attrs([t for r, t in tiles.items() if r not in _WRITE_ROLES],
                                         [t for r, t in tiles.items() if r in _WRITE_ROLES]))
    # free dims of every operand contiguous: the condition of the Vector engine's fast modes
    attrs["contiguous"] = all(t.is_contiguous() for t in tiles.values())
    # inner-most free dim contiguous (condition 1c of the trn2 perf mode for tensor_copy / tensor_scalar)
    attrs["inner_contiguous"] = all(t.ndim < 2 or t.shape[-1] == 1 or t.strides[-1] == 1 for t in tiles.values())
    # scalar operands (floats, ints), so the cost model can tell x*2 from x*3 (its recompute check)
    attrs["scalars"] = tuple((r, repr(v)) for r, v in operands.items() if v is not None and not is_tile(v))
    dst = tiles.pop("dst", None)
    common.emit(opname, engine, dst=dst, srcs=tiles, attrs=attrs)


def _binary(f: _ops.NkiOp, a: Any, b: Any, reverse: bool) -> np.ndarray:
    return f.apply(b, a) if reverse else f.apply(a, b)


def _apply_stage(opname: str, f: _ops.NkiOp, x: np.ndarray, operand: Any, reverse: bool) -> np.ndarray:
    if f.arity == 1:
        require(operand is None or (not is_tile(operand) and operand == 0), opname,
                "operand of unary operator {f} must be None or 0, got {v!r}", f=f, v=operand)
        return f.apply(x)
    require(operand is not None, opname, "binary operator {f} needs an operand", f=f)
    return _binary(f, x, operand, reverse)


def _int32_native(*tiles: Any) -> bool:
    return all(t.dtype in (dtypes.int32, dtypes.uint32) for t in tiles)


# ---------------------------------------------------------------------------------------------
# instructions
# ---------------------------------------------------------------------------------------------

def tensor_tensor(dst: NkiTensor, data1: NkiTensor, data2: NkiTensor, op: Any,
                  engine: Any = common.engine.unknown, name: str | None = None) -> None:
    """``dst = op(data1, data2)`` elementwise on Vector (or GpSimd) Engine; no broadcasting."""
    OP = "tensor_tensor"
    f = get_op(OP, "op", op, alu=True, arity=2)
    eng = engine_of(OP, engine, ("unknown", "vector", "gpsimd"), "unknown")
    tiles = {"dst": dst, "data1": data1, "data2": data2}
    for role, t in tiles.items():
        common.check_tensor(OP, role, t)
    any_psum = any(buf(t) == "psum" for t in tiles.values())
    native_int = _int32_native(dst, data1, data2) and not f.is_bitvec
    if f.name == "power":
        require(eng in ("unknown", "gpsimd"), OP, "nl.power runs on GpSimd engine, not {engine}",
                engine=eng)
        eng = "gpsimd"
    elif eng == "unknown":
        # int32/uint32 everywhere defaults to GpSimd's native integer ALU unless PSUM is involved.
        eng = "gpsimd" if native_int and not any_psum else "vector"
    for role, t in tiles.items():
        check_tile(OP, role, t, eng)
    check_same_layout(OP, "data1", data1, "data2", data2)
    check_same_layout(OP, "data1", data1, "dst", dst)
    require(not (buf(data1) == "psum" and buf(data2) == "psum"), OP,
            "data1 and data2 cannot both be in PSUM")
    check_bitvec_dtypes(OP, f, tiles)

    if f.is_bitvec:
        write(dst, f.apply(read_raw(data1), read_raw(data2)), bits=True)
    elif native_int and eng == "gpsimd":
        r = f.apply_native(read_raw(data1).astype(np.int64), read_raw(data2).astype(np.int64))
        write(dst, r, bits=r.dtype.kind in "iu")  # integer results wrap to 32 bits like the ALU
    else:
        write(dst, f.apply(read(data1), read(data2)))
    emit(OP, eng, tiles, op=f.name)


def tensor_scalar(dst: NkiTensor, data: NkiTensor, op0: Any, operand0: Any, reverse0: bool = False,
                  op1: Any = None, operand1: Any = None, reverse1: bool = False,
                  engine: Any = common.engine.unknown, name: str | None = None) -> None:
    """``dst = (data op0 operand0) op1 operand1``; operands are scalars or ``[P, 1]`` tiles."""
    OP = "tensor_scalar"
    f0 = get_op(OP, "op0", op0, alu=True)
    f1 = _ops.resolve(op1, f"{OP}.op1")
    if f1 is None:
        require(operand1 is None, OP, "operand1 must be None when op1 is None, got {v!r}", v=operand1)
    else:
        f1 = get_op(OP, "op1", f1, alu=True)
        require(f0.is_bitvec == f1.is_bitvec, OP, "op0 ({f0}) and op1 ({f1}) must both be bitvec or "
                "both arithmetic", f0=f0, f1=f1)
    eng = engine_of(OP, engine, ("vector", "scalar", "gpsimd"), "vector")
    if f0.is_bitvec:
        require(eng == "vector", OP, "bitvec operators run on the vector engine only, not {engine}",
                engine=eng)
    if eng == "scalar":
        combo = (f0.name, f1.name if f1 else None)
        require(combo in (("multiply", "add"), ("multiply", None), ("add", None)), OP,
                "Scalar engine supports only (multiply, add), (multiply, None), (add, None); got "
                "{combo}", combo=combo)
    if eng == "gpsimd":
        require(f0.name == "rsqrt" and f1 is None, OP, "engine=gpsimd is only allowed for rsqrt, got "
                "op0={f0}, op1={f1}", f0=f0, f1=f1)
    check_tile(OP, "dst", dst, eng)
    check_tile(OP, "data", data, eng)
    check_same_layout(OP, "data", data, "dst", dst)
    check_bitvec_dtypes(OP, f0, {"dst": dst, "data": data})
    P = data.shape[0]
    bits = f0.is_bitvec

    def operand(role: str, v: Any, f: _ops.NkiOp) -> Any:
        if f.arity == 1:
            return v
        return scalar_or_column(OP, role, v, P, eng, fp32=not bits, integer=bits)

    o0 = operand("operand0", operand0, f0)
    x = read_raw(data) if bits else read(data)
    x = _apply_stage(OP, f0, x, o0, reverse0)
    if f1 is not None:
        x = _apply_stage(OP, f1, x, operand("operand1", operand1, f1), reverse1)
    write(dst, x, bits=bits)
    emit(OP, eng, {"dst": dst, "data": data, "operand0": operand0, "operand1": operand1},
         op=f0.name, op0=f0.name, op1=f1.name if f1 else None)


def scalar_tensor_tensor(dst: NkiTensor, data: NkiTensor, op0: Any, operand0: Any, op1: Any,
                         operand1: Any, reverse0: bool = False, reverse1: bool = False,
                         name: str | None = None) -> None:
    """``dst = (data op0 operand0) op1 operand1``: operand0 scalar / ``[P, 1]``, operand1 a full tile."""
    OP = "scalar_tensor_tensor"
    f0, f1 = get_arith_pair(OP, op0, op1)
    for role, t in (("dst", dst), ("data", data), ("operand1", operand1)):
        check_tile(OP, role, t, "vector")
    check_same_layout(OP, "data", data, "dst", dst)
    check_same_layout(OP, "data", data, "operand1", operand1)
    require(not (buf(data) == "psum" and buf(operand1) == "psum"), OP,
            "data and operand1 cannot both be in PSUM")
    o0 = scalar_or_column(OP, "operand0", operand0, data.shape[0], "vector", fp32=False)
    x = _binary(f0, read(data), o0, reverse0)
    write(dst, _binary(f1, x, read(operand1), reverse1))
    emit(OP, "vector", {"dst": dst, "data": data, "operand0": operand0, "operand1": operand1},
         op=f1.name, op0=f0.name, op1=f1.name)


def _reduce_axes(op: str, data: Any, axis: Any) -> tuple[int, ...]:
    nd = len(data.shape)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    require(len(axes) > 0, op, "axis must name at least one free dimension")
    norm = []
    for a in axes:
        require(-nd <= int(a) < nd, op, "axis {a} is out of range for a {nd}-D tile", a=a, nd=nd)
        norm.append(int(a) % nd)
    norm = tuple(sorted(set(norm)))
    require(0 not in norm, op, "axis 0 (the partition dim) cannot be reduced (axis={axis})", axis=axis)
    require(norm == tuple(range(nd - len(norm), nd)), op,
            "axis {axis} must be the last contiguous free dims ending at dim {last}", axis=axis,
            last=nd - 1)
    return norm


def tensor_reduce(dst: NkiTensor, op: Any, data: NkiTensor, axis: Any, negate: bool = False,
                  keepdims: bool = False, name: str | None = None) -> None:
    """Reduce the last contiguous free dims of ``data`` with ``op`` (fp32, or raw bits for bitvec)."""
    OP = "tensor_reduce"
    f = get_op(OP, "op", op, alu=True)
    require(f.reducible, OP, "op={f} is not a legal reduction operator", f=f)
    check_tile(OP, "dst", dst, "vector")
    check_tile(OP, "data", data, "vector")
    axes = _reduce_axes(OP, data, axis)
    kept = math.prod(data.shape[1:axes[0]])
    require(dst.shape[0] == data.shape[0], OP, "dst has {p} partitions but data has {q}",
            p=dst.shape[0], q=data.shape[0])
    require(free_size(dst) == kept, OP, "dst has {n} elements per partition, but reducing axis {axis} "
            "of {shape} leaves {kept}", n=free_size(dst), axis=axis, shape=tuple(data.shape), kept=kept)
    check_bitvec_dtypes(OP, f, {"dst": dst, "data": data})
    require(not (negate and f.is_bitvec), OP, "negate is only applicable to arithmetic operators "
            "(op={f})", f=f)
    x = np.array(data.np()) if f.is_bitvec else read(data, flat=False)
    r = f.reduce(x, axes, keepdims=keepdims)
    if negate:
        r = -r
    write(dst, r, bits=f.is_bitvec)
    emit(OP, "vector", {"dst": dst, "data": data}, op=f.name, axis=axes)


def tensor_copy(dst: NkiTensor, src: NkiTensor, engine: Any = common.engine.unknown,
                name: str | None = None) -> None:
    """Copy ``src`` to ``dst``: bit-exact for equal dtypes, else through fp32 with RNE on write."""
    OP = "tensor_copy"
    eng = engine_of(OP, engine, ("vector", "scalar", "gpsimd"), "vector")
    check_tile(OP, "dst", dst, eng)
    check_tile(OP, "src", src, eng)
    check_same_layout(OP, "src", src, "dst", dst)
    if src.dtype == dst.dtype:
        write(dst, read_raw(src))
    else:
        write(dst, read(src))
    emit(OP, eng, {"dst": dst, "src": src})


def tensor_copy_predicated(dst: NkiTensor, src: NkiTensor | float, predicate: NkiTensor,
                           reverse_pred: bool = False, name: str | None = None) -> None:
    """Copy ``src`` (tile or scalar) into ``dst`` where ``predicate`` is non-zero (zero if reversed)."""
    OP = "tensor_copy_predicated"
    check_tile(OP, "dst", dst, "vector")
    check_tile(OP, "predicate", predicate, "vector")
    check_same_layout(OP, "dst", dst, "predicate", predicate)
    require(predicate.dtype in (dtypes.uint8, dtypes.uint16, dtypes.uint32), OP,
            "predicate must be uint8, uint16 or uint32, got {dtype}", dtype=predicate.dtype.name)
    if is_tile(src):
        check_tile(OP, "src", src, "vector")
        check_same_layout(OP, "dst", dst, "src", src)
        require(src.dtype == dst.dtype, OP, "src and dst must share a dtype, got {a} and {b}",
                a=src.dtype.name, b=dst.dtype.name)
        require(not (buf(src) == "psum" and buf(predicate) == "psum"), OP,
                "src and predicate cannot both be in PSUM")
        vals = read_raw(src)
    else:
        vals = dtypes.cast(np.full((dst.shape[0], free_size(dst)), src), dst.dtype)
    mask = read_raw(predicate) != 0
    if reverse_pred:
        mask = ~mask
    cur = read_raw(dst)
    write(dst, np.where(mask, vals, cur))
    emit(OP, "vector", {"dst": dst, "src": src, "predicate": predicate})


def memset(dst: NkiTensor, value: Any, engine: Any = common.engine.unknown,
           name: str | None = None) -> None:
    """Fill ``dst`` with a compile-time constant (its type must suit ``dst.dtype``)."""
    OP = "memset"
    eng = engine_of(OP, engine, ("vector", "gpsimd"), "vector")
    check_tile(OP, "dst", dst, eng)
    require(isinstance(value, (int, float, bool, np.integer, np.floating)), OP,
            "value must be a compile-time scalar, got {got}", got=type(value).__name__)
    if dtypes.is_int(dst.dtype):
        # NKI 0.2 -> 0.3 migration guide, "nisa.memset -- strict type matching": "NKI 0.3.0 enforces
        # that the value argument must match the destination tensor's dtype ... For integer-typed
        # tensors, pass an integer literal." One float is accepted: +0.0, whose fill bits are the
        # integer 0's -- AWS's tested router_topk (nki-library core/router_topk, shard_on_tokens
        # output_in_sbuf) memsets a uint32 tile with value=0.0.
        zero = isinstance(value, (float, np.floating)) and value == 0 and math.copysign(1.0, value) > 0
        require(isinstance(value, (int, np.integer)) or zero, OP, "value {value!r} ({type}) does not "
                "match integer dst dtype {dtype}: pass an integer literal (NKI 0.3.0 migration guide, "
                "\"nisa.memset -- strict type matching\")", value=value, type=type(value).__name__,
                dtype=dst.dtype.name)
        info = np.iinfo(dst.dtype)
        require(info.min <= int(value) <= info.max, OP, "value {value} is out of range for {dtype}",
                value=value, dtype=dst.dtype.name)
        common.store(dst, np.asarray(int(value), dtype=dst.dtype))
    else:
        common.store(dst, np.asarray(value, dtype=_F32))  # the immediate is an fp32 value
    emit(OP, eng, {"dst": dst}, value=float(value))


def reciprocal(dst: NkiTensor, data: NkiTensor, name: str | None = None) -> None:
    """``dst = 1 / data`` on Vector Engine (fp32; more precise than ``activation(nl.reciprocal)``)."""
    OP = "reciprocal"
    check_tile(OP, "dst", dst, "vector")
    check_tile(OP, "data", data, "vector")
    check_same_layout(OP, "data", data, "dst", dst)
    write(dst, _ops.reciprocal.apply(read(data)))
    emit(OP, "vector", {"dst": dst, "data": data})


# ---------------------------------------------------------------------------------------------
# top-8 primitives
# ---------------------------------------------------------------------------------------------

def _check_topk_src(op: str, role: str, t: Any, max_ndim: int, lo: int = TOPK_MIN) -> None:
    check_tile(op, role, t, "vector")
    require(len(t.shape) <= max_ndim, op, "{role} must be at most {nd}-D, got shape {shape}", role=role,
            nd=max_ndim, shape=tuple(t.shape))
    n = free_size(t)
    require(lo <= n <= TOPK_MAX, op, "{role} has {n} elements per partition, must be between "
            "{lo} and {hi}", role=role, n=n, lo=lo, hi=TOPK_MAX)


def _check_eight(op: str, role: str, t: Any, partitions: int, *, index: bool = False) -> None:
    check_tile(op, role, t, "vector")
    require(t.shape[0] == partitions and free_size(t) == 8, op,
            "{role} must hold 8 elements on each of {p} partitions, got shape {shape}", role=role,
            p=partitions, shape=tuple(t.shape))
    if index:
        require(t.dtype in (dtypes.uint32, dtypes.uint16), op, "{role} must be uint32 or uint16, got "
                "{dtype}", role=role, dtype=t.dtype.name)


def _not_found(dt: np.dtype) -> int:
    return int(np.iinfo(dt).max)  # all-ones sentinel (0xFFFF / 0xFFFFFFFF)


def max8(dst: NkiTensor, src: NkiTensor, name: str | None = None) -> None:
    """The 8 largest values of each partition of ``src``, in descending order (fp32 compare)."""
    OP = "max8"
    _check_topk_src(OP, "src", src, max_ndim=3)
    check_tile(OP, "dst", dst, "vector")
    require(len(dst.shape) == 2 and tuple(dst.shape) == (src.shape[0], 8), OP,
            "dst must have shape ({p}, 8), got {shape}", p=src.shape[0], shape=tuple(dst.shape))
    x = read(src)
    top = -np.sort(-np.partition(x, x.shape[1] - 8, axis=1)[:, -8:], axis=1)
    write(dst, top)
    emit(OP, "vector", {"dst": dst, "src": src})


def _first_unused_match(cur: np.ndarray, v: np.ndarray,
                        used: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Per partition: index of the first element equal to ``v`` (and not ``used``), and found-mask."""
    eq = cur == v[:, None]
    if used is not None:
        eq &= ~used
    idx = np.argmax(eq, axis=1)
    found = eq[np.arange(cur.shape[0]), idx]
    return idx, found


def nc_find_index8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, name: str | None = None) -> None:
    """Index of the first occurrence of each of the 8 ``vals`` in each partition of ``data``.

    A value repeated in ``vals`` gets successive occurrences (ascending). A value with no (remaining)
    occurrence gets the all-ones sentinel of ``dst.dtype`` (NKI 0.6.0 simulator fix).
    """
    OP = "nc_find_index8"
    _check_topk_src(OP, "data", data, max_ndim=5)
    P = data.shape[0]
    _check_eight(OP, "vals", vals, P)
    require(len(vals.shape) <= 3, OP, "vals must be at most 3-D, got shape {shape}",
            shape=tuple(vals.shape))
    _check_eight(OP, "dst", dst, P, index=True)
    x, v = read(data), read(vals)
    used = np.zeros(x.shape, dtype=bool)
    out = np.empty((P, 8), dtype=np.int64)
    rows = np.arange(P)
    for k in range(8):  # 8 vectorised passes over [P, N]
        idx, found = _first_unused_match(x, v[:, k], used)
        used[rows[found], idx[found]] = True
        out[:, k] = np.where(found, idx, _not_found(dst.dtype))
    write(dst, out)
    emit(OP, "vector", {"dst": dst, "data": data, "vals": vals})


def nc_match_replace8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, imm: float,
                      dst_idx: NkiTensor | None = None, name: str | None = None) -> None:
    """Replace the first occurrence of each of the 8 ``vals`` in ``data`` with ``imm``.

    The hardware processes vals[7] first, down to vals[0]; each takes the first not-yet-replaced
    match, so among duplicate vals the highest slot gets the earliest occurrence. ``dst_idx`` (optional)
    receives the matched indices (all-ones when a value is not found).
    """
    OP = "nc_match_replace8"
    _check_topk_src(OP, "data", data, max_ndim=5, lo=1)  # "no more than 16,384" is the only bound
    P = data.shape[0]
    check_tile(OP, "dst", dst, "vector")
    check_same_layout(OP, "data", data, "dst", dst)
    _check_eight(OP, "vals", vals, P)
    require(len(vals.shape) <= 3, OP, "vals must be at most 3-D, got shape {shape}",
            shape=tuple(vals.shape))
    if dst_idx is not None:
        _check_eight(OP, "dst_idx", dst_idx, P, index=True)
    require(isinstance(imm, (int, float, np.integer, np.floating)), OP,
            "imm must be a float scalar, got {got}", got=type(imm).__name__)
    x, v = read(data), read(vals)
    replaced = np.zeros(x.shape, dtype=bool)
    idxs = np.empty((P, 8), dtype=np.int64)
    rows = np.arange(P)
    sentinel = _not_found(dst_idx.dtype) if dst_idx is not None else -1
    for k in range(7, -1, -1):
        idx, found = _first_unused_match(x, v[:, k], replaced)
        replaced[rows[found], idx[found]] = True
        idxs[:, k] = np.where(found, idx, sentinel)
    out = np.where(replaced, _F32(imm), x)
    write(dst, out)
    if dst_idx is not None:
        write(dst_idx, idxs)
    emit(OP, "vector", {"dst": dst, "data": data, "vals": vals, "dst_idx": dst_idx}, imm=float(imm))


# ---------------------------------------------------------------------------------------------
# accumulation registers (reduce_cmd): one set per engine per kernel instance
# ---------------------------------------------------------------------------------------------

# What the NKI docs say about the registers' value before a kernel sets them: nothing. nki.isa.reduce_cmd:
# "reset: Resets the accumulator registers to its initial state", "reduce: Keeps accumulating over the
# current value of the accumulator registers"; nki.isa.activation: "nisa.reduce_cmd.idle: Do not modify
# reduce_regs"; tensor_scalar_cumulative's pseudocode: "elif reduce_cmd == reduce: reg = reg". No sentence
# gives their value at kernel start or calls it undefined, so a read before any set is a warning
# (AccumulatorNotSetWarning), not an undefined-behaviour error.
REDUCE_CMD_DOC = ('nki.isa.reduce_cmd: "reduce: Keeps accumulating over the current value of the accumulator '
                  'registers"; no NKI doc gives their value at kernel start')


class AccumulatorNotSetWarning(RuntimeWarning):
    """An instruction read an engine's ``reduce_cmd`` accumulation registers on partitions that nothing in
    its kernel instance had set (``reset`` / ``reset_reduce`` / ``load_reduce`` / an earlier ``reduce``):
    a device's registers hold whatever the core left there, and the NKI docs say nothing of their value at
    kernel start. The interpreter reads the reduce operator's identity there. A warning, in ``strict`` mode
    too: no doc calls it undefined. ``op``, ``engine``, ``partitions`` (the unset ones)."""

    def __init__(self, message: str, op: str = "", engine: str = "", partitions: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.op = op
        self.engine = engine
        self.partitions = partitions


class Accumulators:
    """One engine's 128 per-partition fp32 accumulation registers in one kernel instance
    (``memory.KernelContext.accumulators``; see :func:`registers`) and which partitions it has set."""

    __slots__ = ("engine", "value", "is_set")

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.value = np.zeros((PMAX, 1), dtype=_F32)
        self.is_set = np.zeros(PMAX, dtype=bool)

    def read(self, op: str, cmd: str, P: int, unset: float) -> np.ndarray:
        """Registers ``[:P]`` as ``op`` (``reduce_cmd=cmd``) reads them; partitions never set read as
        ``unset`` and raise :class:`AccumulatorNotSetWarning`."""
        missing = ~self.is_set[:P]
        if missing.any():
            lanes = tuple(int(i) for i in np.flatnonzero(missing))
            shown = f"[{lanes[0]}, {lanes[-1] + 1})" if len(lanes) == lanes[-1] + 1 - lanes[0] else str(list(lanes))
            warnings.warn(AccumulatorNotSetWarning(
                f"{op} at {_cf.user_site()}: reduce_cmd={cmd} reads the {self.engine.capitalize()} Engine "
                f"accumulation registers of partitions {shown} before anything in this kernel instance set "
                f"them (reduce_cmd reset / reset_reduce / load_reduce); they hold what the core left there "
                f"({REDUCE_CMD_DOC}); the interpreter reads {float(unset)!r}, the reduce operator's identity",
                op=op, engine=self.engine, partitions=lanes), stacklevel=4)
            self.value[:P][missing] = _F32(unset)
        return self.value[:P]

    def store(self, P: int, value: np.ndarray) -> None:
        self.value[:P] = value
        self.is_set[:P] = True


def registers(engine: str) -> Accumulators:
    """The running kernel instance's accumulation registers of ``engine`` ("vector" / "scalar"): created
    fresh, none set, the first time the instance uses them, so every program of a launch (each LNC=2 core,
    each grid point) has its own and a launch sees nothing of an earlier one. Outside any kernel: this
    thread's default context's."""
    regs = _mem.current().accumulators
    acc = regs.get(engine)
    if acc is None:
        acc = regs[engine] = Accumulators(engine)
    return acc


def _accumulate(engine: str, op: str, f: _ops.NkiOp, cmd: str, part: np.ndarray,
                init: Any = None) -> np.ndarray:
    """Apply ``reduce_cmd`` semantics to ``engine``'s per-partition registers and return their new value."""
    P = part.shape[0]
    regs = registers(engine)
    ident = _F32(f.reduce_identity)
    if cmd in ("reset", "reset_reduce"):
        regs.store(P, ident)
    elif cmd == "load_reduce":
        regs.store(P, init)
    if cmd == "reduce":
        regs.store(P, f.apply(regs.read(op, cmd, P, ident), part))
    elif cmd in ("reset_reduce", "load_reduce"):
        regs.store(P, f.apply(regs.value[:P], part))
    elif cmd not in ("idle", "reset"):
        fail(op, "unknown reduce_cmd {cmd}", cmd=cmd)
    return regs.value[:P]


def tensor_scalar_reduce(dst: NkiTensor, data: NkiTensor, op0: Any, operand0: Any, reduce_op: Any,
                         reduce_res: NkiTensor, reverse0: bool = False,
                         reduce_cmd: Any = common.reduce_cmd.reset_reduce, reduce_init: Any = None,
                         name: str | None = None) -> None:
    """``dst = data op0 operand0`` and ``reduce_res = reduce_op`` over its free dims (Vector Engine)."""
    OP = "tensor_scalar_reduce"
    f0 = get_op(OP, "op0", op0, alu=True)
    require(not f0.is_bitvec, OP, "op0 must be an arithmetic operator, got {f0}", f0=f0)
    fr = get_op(OP, "reduce_op", reduce_op, alu=True, arity=2)
    require(fr.name in ("add", "multiply", "maximum", "minimum"), OP,
            "reduce_op must be add, multiply, maximum or minimum, got {fr}", fr=fr)
    require(not reverse0, OP, "reverse0 is not supported yet (per the NKI docs)")
    cmd = cmd_name(reduce_cmd)
    require(cmd in ("reset_reduce", "reduce", "load_reduce"), OP,
            "reduce_cmd must be reset_reduce, reduce or load_reduce, got {cmd}", cmd=cmd)
    require((reduce_init is not None) == (cmd == "load_reduce"), OP,
            "reduce_init must be given exactly when reduce_cmd is load_reduce (cmd={cmd})", cmd=cmd)
    check_tile(OP, "dst", dst, "vector")
    check_tile(OP, "data", data, "vector")
    check_same_layout(OP, "data", data, "dst", dst)
    P = data.shape[0]
    check_column(OP, "reduce_res", reduce_res, P, "vector")
    o0 = None if f0.arity == 1 else scalar_or_column(OP, "operand0", operand0, P, "vector", fp32=True)
    x = _apply_stage(OP, f0, read(data), o0 if f0.arity == 2 else operand0, False)
    init = None
    if reduce_init is not None:
        init = scalar_or_column(OP, "reduce_init", reduce_init, P, "vector", fp32=True)
    part = fr.reduce(x, (1,), keepdims=True)
    write(dst, x)
    write(reduce_res, _accumulate("vector", OP, fr, cmd, part, init))
    emit(OP, "vector", {"dst": dst, "data": data, "operand0": operand0, "reduce_res": reduce_res},
         op=f0.name, reduce_op=fr.name)


def tensor_scalar_cumulative(dst: NkiTensor, src: NkiTensor, op0: Any, op1: Any, imm0: Any,
                             imm1: Any = None, reduce_cmd: Any = common.reduce_cmd.reset_reduce,
                             name: str | None = None) -> None:
    """Running scan along the free dims: ``reg = op1(op0(src[i], imm0), reg); dst[i] = reg``.

    The accumulator starts at op1's identity (``reset_reduce``), at the register value left by the
    previous accumulation instruction (``reduce``) or at ``imm1`` (``load_reduce``); it keeps the last
    value afterwards. Scans run in order in fp32 (numpy ``accumulate`` is sequential).
    """
    OP = "tensor_scalar_cumulative"
    f0 = get_op(OP, "op0", op0, alu=True, arity=2)
    require(not f0.is_bitvec, OP, "op0 must be an arithmetic operator, got {f0}", f0=f0)
    f1 = get_op(OP, "op1", op1, alu=True, arity=2)
    # subtract would need reg = x - reg (not a numpy accumulate); the docs list it, trnkit does not.
    require(f1.name in ("add", "multiply", "maximum", "minimum"), OP,
            "op1 must be add, multiply, maximum or minimum, got {f1}", f1=f1)
    cmd = cmd_name(reduce_cmd)
    require(cmd in ("reset_reduce", "reduce", "load_reduce"), OP,
            "reduce_cmd must be reset_reduce, reduce or load_reduce, got {cmd}", cmd=cmd)
    require((imm1 is not None) == (cmd == "load_reduce"), OP,
            "imm1 must be given exactly when reduce_cmd is load_reduce (cmd={cmd})", cmd=cmd)
    check_tile(OP, "dst", dst, "vector")
    check_tile(OP, "src", src, "vector")
    check_same_layout(OP, "src", src, "dst", dst)
    for role, t in (("src", src), ("dst", dst)):
        require(t.dtype not in (dtypes.int32, dtypes.uint32), OP,
                "{role} dtype {dtype} is not supported (int32/uint32 are an ISA limitation)", role=role,
                dtype=t.dtype.name)
    P = src.shape[0]
    y = f0.apply(read(src), scalar_or_column(OP, "imm0", imm0, P, "vector", fp32=True))
    regs = registers("vector")
    if cmd == "reset_reduce":
        init = np.full((P, 1), f1.reduce_identity, dtype=_F32)
    elif cmd == "load_reduce":
        init = np.broadcast_to(scalar_or_column(OP, "imm1", imm1, P, "vector", fp32=True), (P, 1))
    else:
        init = regs.read(OP, cmd, P, f1.reduce_identity).copy()
    with np.errstate(all="ignore"):
        scan = f1.reduce_ufunc.accumulate(np.concatenate([init.astype(_F32), y], axis=1), axis=1)[:, 1:]
    regs.store(P, scan[:, -1:])
    write(dst, scan)
    emit(OP, "vector", {"dst": dst, "src": src, "imm0": imm0, "imm1": imm1}, op=f1.name, op0=f0.name)


# ---------------------------------------------------------------------------------------------
# mean / variance statistics (layer norm)
# ---------------------------------------------------------------------------------------------

BN_STATS_FMAX = 512  # nl.tile_size.bn_stats_fmax


def _count_mean_m2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = np.full((x.shape[0], 1), x.shape[1], dtype=_F32)
    if x.shape[1] == 0:
        z = np.zeros((x.shape[0], 1), dtype=_F32)
        return n, z, z
    mean = x.mean(axis=1, keepdims=True, dtype=_F32)
    m2 = np.square(x - mean).sum(axis=1, keepdims=True, dtype=_F32)
    return n, mean, m2


def bn_stats(dst: NkiTensor, data: NkiTensor, name: str | None = None) -> None:
    """Per partition: ``(count, mean, variance * count)`` of the even- and of the odd-indexed elements
    (6 values), for :func:`bn_aggr`; fp32 math, at most ``bn_stats_fmax`` (512) elements."""
    OP = "bn_stats"
    check_tile(OP, "dst", dst, "vector")
    check_tile(OP, "data", data, "vector")
    n = free_size(data)
    require(1 <= n <= BN_STATS_FMAX, OP, "data has {n} elements per partition, must be at most "
            "bn_stats_fmax ({fmax})", n=n, fmax=BN_STATS_FMAX)
    require(dst.shape[0] == data.shape[0] and free_size(dst) == 6, OP,
            "dst must hold 6 elements on each of {p} partitions, got shape {shape}", p=data.shape[0],
            shape=tuple(dst.shape))
    x = read(data)
    write(dst, np.concatenate(_count_mean_m2(x[:, 0::2]) + _count_mean_m2(x[:, 1::2]), axis=1))
    emit(OP, "vector", {"dst": dst, "data": data})


def bn_aggr(dst: NkiTensor, data: NkiTensor, name: str | None = None) -> None:
    """Combine ``(count, mean, variance * count)`` triples (one or more :func:`bn_stats` outputs) into
    the per-partition ``(mean, variance)`` (population variance), fp32 math."""
    OP = "bn_aggr"
    check_tile(OP, "dst", dst, "vector")
    check_tile(OP, "data", data, "vector")
    n = free_size(data)
    require(n % 3 == 0, OP, "data has {n} elements per partition, not a multiple of 3", n=n)
    require(dst.shape[0] == data.shape[0] and free_size(dst) == 2, OP,
            "dst must hold 2 elements on each of {p} partitions, got shape {shape}", p=data.shape[0],
            shape=tuple(dst.shape))
    t = read(data).reshape(data.shape[0], -1, 3)
    cnt, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
    total = cnt.sum(axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        mu = (cnt * mean).sum(axis=1, keepdims=True) / total
        var = (m2 + cnt * np.square(mean - mu)).sum(axis=1, keepdims=True) / total
    write(dst, np.concatenate([mu, var], axis=1))
    emit(OP, "vector", {"dst": dst, "data": data})


# ---------------------------------------------------------------------------------------------
# scans and predicated selects
# ---------------------------------------------------------------------------------------------

FP32_MIN = float(np.finfo(np.float32).min)  # -3.4028235e38, range_select's only legal fill


def tensor_tensor_scan(dst: NkiTensor, data0: NkiTensor, data1: NkiTensor, initial: Any, op0: Any,
                       op1: Any, reverse0: bool = False, reverse1: bool = False,
                       name: str | None = None) -> None:
    """``r[i] = op1(op0(data0[i], r[i-1]), data1[i])`` along the (flattened) free dims, ``r[-1] = initial``.

    ``reverse0`` makes ``data0`` the rhs of op0, ``reverse1`` makes ``data1`` the lhs of op1. The
    recurrence is sequential by definition, so the interpreter steps along the free axis with each
    step vectorised over the partitions (fp32, like the engine).
    """
    OP = "tensor_tensor_scan"
    f0, f1 = get_arith_pair(OP, op0, op1)
    for role, t in (("dst", dst), ("data0", data0), ("data1", data1)):
        check_tile(OP, role, t, "vector")
    check_same_layout(OP, "data0", data0, "data1", data1)
    check_same_layout(OP, "data0", data0, "dst", dst)
    require(not (buf(data0) == "psum" and buf(data1) == "psum"), OP,
            "data0 and data1 cannot both be in PSUM")
    r = np.broadcast_to(scalar_or_column(OP, "initial", initial, data0.shape[0], "vector", fp32=False),
                        (data0.shape[0], 1))[:, 0].astype(_F32)
    a, b = read(data0), read(data1)
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        for i in range(a.shape[1]):
            t = f0.apply(r, a[:, i]) if reverse0 else f0.apply(a[:, i], r)
            r = f1.apply(b[:, i], t) if reverse1 else f1.apply(t, b[:, i])
            out[:, i] = r
    write(dst, out)
    emit(OP, "vector", {"dst": dst, "data0": data0, "data1": data1, "initial": initial},
         op=f1.name, op0=f0.name, op1=f1.name)


def _max_into_registers(op: str, fr: _ops.NkiOp, cmd: str, values: np.ndarray,
                        reduce_res: NkiTensor | None) -> None:
    """Shared tail of the select instructions: max-reduce into the Vector accumulator, read out."""
    if cmd != "idle":
        _accumulate("vector", op, fr, cmd, fr.reduce(values, (1,), keepdims=True))
    if reduce_res is not None:
        write(reduce_res, registers("vector").read(op, cmd, values.shape[0], fr.reduce_identity))


def _check_select_reduce_args(op: str, reduce_op: Any, reduce_cmd: Any, reduce_res: Any, partitions: int,
                              cmds: tuple[str, ...]) -> tuple[_ops.NkiOp, str]:
    fr = get_op(op, "reduce_op", reduce_op, alu=True, arity=2)
    require(fr.name == "maximum", op, "reduce_op must be nl.maximum, got {fr}", fr=fr)
    cmd = cmd_name(reduce_cmd)
    require(cmd in cmds, op, "reduce_cmd must be one of {cmds}, got {cmd}", cmds="/".join(cmds), cmd=cmd)
    if reduce_res is not None:
        check_column(op, "reduce_res", reduce_res, partitions, "vector")
        require(dtypes.is_float(reduce_res.dtype), op, "reduce_res must have a float dtype, got {dtype}",
                dtype=reduce_res.dtype.name)
    return fr, cmd


def select_reduce(dst: NkiTensor, predicate: NkiTensor, on_true: NkiTensor, on_false: Any,
                  reduce_res: NkiTensor | None = None, reduce_cmd: Any = common.reduce_cmd.idle,
                  reduce_op: Any = _ops.maximum, reverse_pred: bool = False,
                  name: str | None = None) -> None:
    """``dst = where(predicate, on_true, on_false)`` with an optional per-partition max into
    ``reduce_res`` (Vector accumulator: ``reset_reduce`` starts at -inf, ``reduce`` continues)."""
    OP = "select_reduce"
    for role, t in (("dst", dst), ("predicate", predicate), ("on_true", on_true)):
        check_tile(OP, role, t, "vector")
    check_same_layout(OP, "on_true", on_true, "dst", dst)
    check_same_layout(OP, "on_true", on_true, "predicate", predicate)
    require(not (buf(on_true) == "psum" and buf(predicate) == "psum"), OP,
            "on_true and predicate cannot both be in PSUM")
    require(predicate.dtype in (dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16), OP,
            "predicate must be int8, uint8, int16 or uint16, got {dtype}", dtype=predicate.dtype.name)
    require(on_true.dtype not in (dtypes.int32, dtypes.uint32), OP,
            "on_true dtype {dtype} is not supported (no int32/uint32)", dtype=on_true.dtype.name)
    P = on_true.shape[0]
    fr, cmd = _check_select_reduce_args(OP, reduce_op, reduce_cmd, reduce_res, P,
                                        ("idle", "reset_reduce", "reduce"))
    fill = scalar_or_column(OP, "on_false", on_false, P, "vector", fp32=False)
    mask = read_raw(predicate) != 0
    if reverse_pred:
        mask = ~mask
    res = np.where(mask, read(on_true), fill).astype(_F32)
    write(dst, res)
    _max_into_registers(OP, fr, cmd, res, reduce_res)
    emit(OP, "vector", {"dst": dst, "predicate": predicate, "on_true": on_true, "on_false": on_false,
                        "reduce_res": reduce_res}, op="maximum")


def range_select(dst: NkiTensor, on_true_tile: NkiTensor, comp_op0: Any, comp_op1: Any, bound0: NkiTensor,
                 bound1: NkiTensor, reduce_cmd: Any = common.reduce_cmd.reset_reduce,
                 reduce_res: NkiTensor | None = None, reduce_op: Any = _ops.maximum, range_start: int = 0,
                 on_false_value: float = FP32_MIN, name: str | None = None) -> None:
    """Keep ``on_true_tile[p, i]`` where ``comp_op0(range_start + i, bound0[p])`` and
    ``comp_op1(range_start + i, bound1[p])`` hold (fp32 compares), else ``on_false_value``
    (must be FP32_MIN); plus the per-partition max (Vector accumulator) into ``reduce_res``."""
    OP = "range_select"
    comparisons = ("equal", "less", "less_equal", "greater", "greater_equal")
    c0 = get_op(OP, "comp_op0", comp_op0, alu=True, arity=2)
    c1 = get_op(OP, "comp_op1", comp_op1, alu=True, arity=2)
    for role, c in (("comp_op0", c0), ("comp_op1", c1)):
        require(c.name in comparisons, OP, "{role} must be one of {ok}, got {c}", role=role,
                ok="/".join(comparisons), c=c)
    check_tile(OP, "dst", dst, "vector")
    check_tile(OP, "on_true_tile", on_true_tile, "vector")
    check_same_layout(OP, "on_true_tile", on_true_tile, "dst", dst)
    require(dtypes.is_float(on_true_tile.dtype), OP, "on_true_tile must have a float dtype, got {dtype}",
            dtype=on_true_tile.dtype.name)
    # NKI ISA reference (range_select): on_false_value "must be FP32_MIN". The field is an fp32
    # immediate, so a Python float that rounds to it in fp32 is that value: nki-library's attention
    # kernels (tested on trn2) pass the literal -3.4028235e38, one double away from finfo's.
    require(_F32(on_false_value) == _F32(FP32_MIN), OP, "on_false_value must be FP32_MIN ({fmin}) as an "
            "fp32 immediate, got {v!r}", fmin=FP32_MIN, v=on_false_value)
    require(isinstance(range_start, (int, np.integer)), OP, "range_start must be a compile-time int, "
            "got {v!r}", v=range_start)
    P = on_true_tile.shape[0]
    fr, cmd = _check_select_reduce_args(OP, reduce_op, reduce_cmd, reduce_res, P,
                                        ("idle", "reset_reduce", "reduce"))
    lo = scalar_or_column(OP, "bound0", bound0, P, "vector", fp32=True)
    hi = scalar_or_column(OP, "bound1", bound1, P, "vector", fp32=True)
    idx = (int(range_start) + np.arange(free_size(on_true_tile), dtype=np.float64)).astype(_F32)[None, :]
    mask = (c0.apply(idx, lo) != 0) & (c1.apply(idx, hi) != 0)
    res = np.where(mask, read(on_true_tile), _F32(FP32_MIN)).astype(_F32)
    write(dst, res)
    _max_into_registers(OP, fr, cmd, res, reduce_res)
    emit(OP, "vector", {"dst": dst, "on_true_tile": on_true_tile, "bound0": bound0, "bound1": bound1,
                        "reduce_res": reduce_res}, op="maximum")
