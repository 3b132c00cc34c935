"""Scalar Engine instructions: ``activation`` and ``activation_reduce`` (NKI 0.6 signatures).

``dst = op(data * scale + bias)`` in fp32, rounded to ``dst.dtype`` on write. ``scale`` is an fp32
scalar or a ``[P, 1]`` fp32 tile; ``bias`` a scalar (NeuronCore-v3+) or a ``[P, 1]`` tile. The optional
free-axis reduction goes into 128 per-lane ``reduce_regs`` controlled by ``reduce_cmd``
(idle / reset / reduce / reset_reduce) and is read out into ``reduce_res`` when one is passed; the
registers persist across instructions of the same kernel instance (one set per kernel instance,
``memory.KernelContext.accumulators``; see ``vector.registers``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import ops as _ops
from ..errors import fail, require
from ..tensor import NkiTensor
from . import common
from .vector import (
    _accumulate,
    check_column,
    check_same_layout,
    check_tile,
    cmd_name,
    emit,
    get_op,
    is_tile,
    read,
    registers,
    scalar_or_column,
    write,
)

__all__ = ["activation", "activation_reduce"]

_F32 = np.float32

# "Supported Activation Functions for NKI ISA" (aws-neuron-sdk nki/api/nki.api.shared.rst, the table
# "Accepted op by Scalar Engine" for nki.isa.activation / activate2): nothing else is accepted (e.g.
# nl.cos, which nki.language provides but the table does not list). prelu is activate2-only (trn3).
ACTIVATION_TABLE = frozenset({
    "copy", "square", "sigmoid", "relu", "gelu", "gelu_dx", "gelu_apprx_tanh", "gelu_apprx_sigmoid",
    "gelu_apprx_sigmoid_dx", "silu", "silu_dx", "tanh", "softplus", "mish", "erf", "erf_dx", "exp",
    "log", "sin", "arctan", "sqrt", "rsqrt", "reciprocal", "sign", "abs"})


def _activate(OP: str, dst: Any, op: Any, data: Any, bias: Any,
              scale: Any) -> tuple[_ops.NkiOp, np.ndarray]:
    f = get_op(OP, "op", op, activation=True, arity=1)
    if f.name not in ACTIVATION_TABLE:
        fail(OP, "op=nl.{name} is not in the Scalar Engine's activation function table (NKI ISA "
             "reference, \"Supported Activation Functions for NKI ISA\": {table})", name=f.name,
             table=", ".join(sorted(ACTIVATION_TABLE)))
    check_tile(OP, "dst", dst, "scalar")
    check_tile(OP, "data", data, "scalar")
    check_same_layout(OP, "data", data, "dst", dst)
    P = data.shape[0]
    s = scalar_or_column(OP, "scale", scale, P, "scalar", fp32=True)
    x = read(data)
    if bias is None:
        y = x * s if (is_tile(scale) or s != 1.0) else x
    else:
        y = x * s + scalar_or_column(OP, "bias", bias, P, "scalar", fp32=False)
    out = f.apply(y)
    write(dst, out)
    return f, out  # the reduction sees the fp32 results (before the output cast)


def activation(dst: NkiTensor, op: Any, data: NkiTensor, bias: Any = None, scale: Any = 1.0,
               reduce_op: Any = None, reduce_res: NkiTensor | None = None,
               reduce_cmd: Any = common.reduce_cmd.idle, name: str | None = None) -> None:
    """``dst = op(data * scale + bias)`` on Scalar Engine, with optional per-partition add-reduce."""
    OP = "activation"
    cmd = cmd_name(reduce_cmd)
    require(cmd in ("idle", "reset", "reduce", "reset_reduce"), OP,
            "reduce_cmd must be idle, reset, reduce or reset_reduce, got {cmd}", cmd=cmd)
    fr = None
    if reduce_op is not None:
        fr = get_op(OP, "reduce_op", reduce_op)
        require(fr.name == "add", OP, "reduce_op must be nl.add, got {fr}", fr=fr)
    require(fr is not None or cmd in ("idle", "reset"), OP,
            "reduce_cmd={cmd} needs reduce_op=nl.add", cmd=cmd)
    common.check_tensor(OP, "data", data)
    if reduce_res is not None:
        check_column(OP, "reduce_res", reduce_res, data.shape[0], "scalar")
    _, out = _activate(OP, dst, op, data, bias, scale)
    P = data.shape[0]
    part = _ops.add.reduce(out, (1,), keepdims=True) if fr is not None else np.zeros((P, 1), _F32)
    regs = _accumulate("scalar", OP, _ops.add, cmd, part)
    if reduce_res is not None:  # idle reads the registers as they are (AccumulatorNotSetWarning if never set)
        write(reduce_res, registers("scalar").read(OP, cmd, P, 0.0) if cmd == "idle" else regs)
    emit(OP, "scalar", {"dst": dst, "data": data, "bias": bias, "scale": scale, "reduce_res": reduce_res},
         op=_ops.resolve(op).name, reduce_cmd=cmd, reduce_res=reduce_res is not None)


def activation_reduce(dst: NkiTensor, op: Any, data: NkiTensor, reduce_op: Any,
                      reduce_res: NkiTensor, bias: Any = None, scale: Any = 1.0,
                      name: str | None = None) -> None:
    """``activation`` + a reduction over all free dims into ``reduce_res`` (registers reset first)."""
    OP = "activation_reduce"
    fr = get_op(OP, "reduce_op", reduce_op)
    # NKI 2.33 nki.isa.activation_reduce (Trn2, Trn3): "The reduce_op must be nl.add: the Scalar Engine
    # reduction registers can only sum the activated data" (max / min: a separate tensor_reduce, or
    # activate2 on NeuronCore-v4+). Every nki-library call passes nl.add.
    require(fr.name == "add", OP, "reduce_op must be nl.add (the Scalar Engine reduction registers only sum; "
            "NKI docs, nki.isa.activation_reduce), got {fr}", fr=fr)
    require(reduce_res is not None, OP, "reduce_res is required")
    common.check_tensor(OP, "data", data)
    check_column(OP, "reduce_res", reduce_res, data.shape[0], "scalar")
    _, out = _activate(OP, dst, op, data, bias, scale)
    part = fr.reduce(out, (1,), keepdims=True)
    write(reduce_res, _accumulate("scalar", OP, fr, "reset_reduce", part))
    emit(OP, "scalar", {"dst": dst, "data": data, "bias": bias, "scale": scale, "reduce_res": reduce_res},
         op=_ops.resolve(op).name, reduce_op=fr.name, reduce_res=True)
