"""ALU operators and activation functions: the objects kernels pass as ``op=`` to ``nki.isa`` calls.

Each object is an :class:`NkiOp` with a ``.name`` (the ``nki.language`` spelling, e.g. ``"add"``), an
``arity``, a ``kind`` and a vectorised numpy implementation that computes in float32 (or on raw
integer bits for bitvec operators). ``nki.language`` re-exports every object defined here.

Two families, as in the NKI docs (``nki/api/nki.api.shared.rst``, tables "Supported Math Operators
for NKI ISA" and "Supported Activation Functions for NKI ISA"):

* **ALU operators** (``op.alu``) — valid in ``tensor_tensor``, ``tensor_scalar``, ``tensor_reduce``
  and the other Vector/GpSimd instructions:
  - bitvec (integer dtypes only, bit patterns, no casting): ``invert``, ``bitwise_and``,
    ``bitwise_or``, ``bitwise_xor``, ``left_shift``, ``right_shift`` (logical);
  - arithmetic (inputs cast to fp32): ``add``, ``subtract``, ``multiply``, ``maximum``, ``minimum``,
    ``equal``, ``not_equal``, ``greater``, ``greater_equal``, ``less``, ``less_equal``,
    ``logical_and``, ``logical_or``, ``logical_xor``, ``power``, unary ``rsqrt``, ``reciprocal``,
    ``abs``; plus ``abs_max``/``abs_min`` (trn3) and ``bypass``. ``divide`` is not in the ISA table
    ("Division is not available as a hardware instruction"): an instruction given ``op=nl.divide`` is
    refused (a kernel multiplies by ``nisa.reciprocal``'s result instead).
  Comparisons and logical operators return 1.0 / 0.0. Legal reduction operators (``op.reducible``):
  bitwise and/or/xor, add, subtract, multiply, maximum, minimum, logical and/or/xor.
* **Activation functions** (``op.activation``) — valid as ``nisa.activation(op=...)`` on the Scalar
  Engine: ``copy``, ``square``, ``sigmoid``, ``relu``, ``gelu``, ``gelu_dx``, ``gelu_apprx_tanh``,
  ``gelu_apprx_sigmoid``, ``gelu_apprx_sigmoid_dx``, ``silu``, ``silu_dx``, ``tanh``, ``softplus``,
  ``mish``, ``erf``, ``erf_dx``, ``exp``, ``log``, ``sin``, ``arctan``, ``sqrt``, ``rsqrt``,
  ``reciprocal``, ``sign``, ``abs`` (and ``cos``, which ``nl.cos`` provides though the ISA table does
  not list it). The hardware approximates them with piece-wise polynomials; the interpreter computes
  the exact fp32 function (``sin`` here is ``np.sin``, i.e. it does not reproduce the hardware's lack
  of range reduction outside ``[-pi, pi]``).

Old-style kernels pass numpy functions (``np.add``, ``np.exp``); :func:`resolve` maps those to the
objects here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .api_names import MissingApi

__all__ = [
    "NkiOp",
    "resolve",
    "ALL_OPS",
    "ALU_OPS",
    "ACTIVATION_OPS",
]

BITVEC = "bitvec"
ARITH = "arithmetic"
ACT = "activation"  # activation-only (not an ALU operator)

_F32 = np.float32


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=_F32)


# The hardware produces inf/nan silently, so every evaluation runs under np.errstate(all="ignore").
# Entering np.errstate costs ~4 us (a context variable), as much as the arithmetic of a small tile:
# kernel launches enter it once per program (jit, via fp_errors_ignored) and set this flag.
_fp_quiet = threading.local()


@contextlib.contextmanager
def fp_errors_ignored() -> Iterator[None]:
    """numpy floating-point errors ignored for the block (this thread), and the operator objects told
    so; the interpreter runs each kernel program inside it."""
    before = getattr(_fp_quiet, "on", False)
    with np.errstate(all="ignore"):
        _fp_quiet.on = True
        try:
            yield
        finally:
            _fp_quiet.on = before


class NkiOp:
    """One operator / activation function object (``nl.add``, ``nl.exp``, ...)."""


    def __init__(self, name: str, kind: str, arity: int, fn: Callable[..., np.ndarray], *,
                 alu: bool, activation: bool, reduce_ufunc: np.ufunc | None = None,
                 reduce_identity: float | int | None = None, doc: str = "") -> None:
        self.name = name
        self.kind = kind
        self.arity = arity
        self._fn = fn
        self.alu = alu
        self.activation = activation
        self.reduce_ufunc = reduce_ufunc
        self.reduce_identity = reduce_identity
        self.__doc__ = doc or f"nki.language.{name}"

    @property
    def is_bitvec(self) -> bool:
        return self.kind == BITVEC

    @property
    def reducible(self) -> bool:
        """True when the op is a legal reduction operator (``tensor_reduce``)."""
        return self.reduce_ufunc is not None

    def apply(self, *args: Any) -> np.ndarray:
        """Evaluate on numpy values: float32 math for arithmetic/activation, raw integers for bitvec."""
        if len(args) != self.arity:
            raise TypeError(f"nl.{self.name}: takes {self.arity} operand(s), got {len(args)}")
        if self.kind == BITVEC:
            return self._fn(*(np.asarray(a) for a in args))
        if getattr(_fp_quiet, "on", False):  # inside a kernel launch: errors already ignored
            return self._fn(*map(_f, args))
        with np.errstate(all="ignore"):  # hardware produces inf/nan silently
            return self._fn(*map(_f, args))

    def apply_native(self, *args: np.ndarray) -> np.ndarray:
        """Evaluate on the arrays as given (e.g. int64 for GpSimd's exact 32-bit integer ALU)."""
        if len(args) != self.arity:
            raise TypeError(f"nl.{self.name}: takes {self.arity} operand(s), got {len(args)}")
        if getattr(_fp_quiet, "on", False):
            return np.asarray(self._fn(*args))
        with np.errstate(all="ignore"):
            return np.asarray(self._fn(*args))

    def reduce(self, x: np.ndarray, axis: tuple[int, ...], keepdims: bool = False) -> np.ndarray:
        """Reduce ``x`` over ``axis`` with this operator (fp32 for arithmetic, raw bits for bitvec)."""
        if self.reduce_ufunc is None:
            raise ValueError(f"nl.{self.name} is not a legal reduction operator")
        x = np.asarray(x) if self.kind == BITVEC else _f(x)
        with contextlib.nullcontext() if getattr(_fp_quiet, "on", False) else np.errstate(all="ignore"):
            if self.name.startswith("logical_"):
                x = x != 0
            # Flatten the reduced axes into one trailing axis: non-reorderable ufuncs (subtract)
            # reduce over a single axis only, and it fixes the left-to-right element order.
            axis = tuple(sorted(a % x.ndim for a in axis))
            kept = [a for a in range(x.ndim) if a not in axis]
            flat = np.transpose(x, kept + list(axis)).reshape([x.shape[a] for a in kept] + [-1])
            out = self.reduce_ufunc.reduce(flat, axis=-1)
            if keepdims:
                out = np.reshape(out, [1 if a in axis else n for a, n in enumerate(x.shape)])
        return out if self.kind == BITVEC else np.asarray(out, dtype=_F32)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """On numpy values / scalars: :meth:`apply`. On NKI tiles: the ``nki.language`` convenience
        wrapper, if the language module installed one via :func:`set_tile_wrapper`."""
        if _tile_wrapper is not None and any(_is_tile(a) for a in args):
            return _tile_wrapper(self, *args, **kwargs)
        if any(_is_tile(a) for a in args):
            raise TypeError(
                f"nl.{self.name}: calling an operator on NKI tiles is not supported by trnkit's "
                f"interpreter; use an nki.isa instruction with dst= (e.g. nisa.tensor_tensor(dst, a, b, "
                f"op=nl.{self.name}))")
        if kwargs:
            raise TypeError(f"nl.{self.name}: unexpected keyword arguments {sorted(kwargs)}")
        return self.apply(*args)

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __reduce__(self) -> str:  # pickle by name (module-level singleton)
        return self.name


_tile_wrapper: Callable[..., Any] | None = None


def set_tile_wrapper(fn: Callable[..., Any] | None) -> None:
    """Let ``nki.language`` route ``nl.exp(tile)``-style calls to its convenience wrappers."""
    global _tile_wrapper  # noqa: PLW0603 - the one hook nki.language sets at import
    _tile_wrapper = fn


def _is_tile(a: Any) -> bool:
    # Duck-typed so this module does not import the tensor module (ops must stay a leaf module).
    return hasattr(a, "buffer") and hasattr(a, "np") and not isinstance(a, np.ndarray)


# ---------------------------------------------------------------------------------------------
# numpy implementations
# ---------------------------------------------------------------------------------------------

def _bool(x: np.ndarray) -> np.ndarray:
    return x.astype(_F32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Stable for large |x|: exp of a non-positive number only.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(_F32)


def _erf(x: np.ndarray) -> np.ndarray:
    # numpy has no vectorised erf; torch (a base dependency) does, zero-copy on fp32 arrays.
    import torch

    x = np.ascontiguousarray(x, dtype=_F32)
    return torch.special.erf(torch.from_numpy(x)).numpy()


_SQRT1_2 = _F32(1.0 / np.sqrt(2.0))
_INV_SQRT_2PI = _F32(1.0 / np.sqrt(2.0 * np.pi))
_SQRT_2_PI = _F32(np.sqrt(2.0 / np.pi))
_TWO_SQRT_PI = _F32(2.0 / np.sqrt(np.pi))


def _gelu(x: np.ndarray) -> np.ndarray:
    return (_F32(0.5) * x * (_F32(1.0) + _erf(x * _SQRT1_2))).astype(_F32)


def _gelu_dx(x: np.ndarray) -> np.ndarray:
    cdf = _F32(0.5) * (_F32(1.0) + _erf(x * _SQRT1_2))
    pdf = _INV_SQRT_2PI * np.exp(_F32(-0.5) * x * x)
    return (cdf + x * pdf).astype(_F32)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return (_F32(0.5) * x * (_F32(1.0) + np.tanh(_SQRT_2_PI * (x + _F32(0.044715) * x * x * x)))).astype(_F32)


def _gelu_sigmoid(x: np.ndarray) -> np.ndarray:
    return (x * _sigmoid(_F32(1.702) * x)).astype(_F32)


def _gelu_sigmoid_dx(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(_F32(1.702) * x)
    return (s + _F32(1.702) * x * s * (_F32(1.0) - s)).astype(_F32)


def _silu(x: np.ndarray) -> np.ndarray:
    return (x * _sigmoid(x)).astype(_F32)


def _silu_dx(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return (s * (_F32(1.0) + x * (_F32(1.0) - s))).astype(_F32)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(_F32(0.0), x).astype(_F32)


def _mish(x: np.ndarray) -> np.ndarray:
    return (x * np.tanh(_softplus(x))).astype(_F32)


def _erf_dx(x: np.ndarray) -> np.ndarray:
    return (_TWO_SQRT_PI * np.exp(-x * x)).astype(_F32)


def _unsigned(x: np.ndarray) -> np.ndarray:
    """The same bits viewed as the unsigned integer type of the same width (for logical shifts)."""
    x = np.asarray(x)
    if x.dtype.kind == "b":
        x = x.astype(np.uint8)
    if x.dtype.kind == "i":
        return x.view(np.dtype(f"u{x.dtype.itemsize}"))
    return x


def _shift_amount(b: np.ndarray) -> np.ndarray:
    return np.asarray(b).astype(np.int64)


def _left_shift(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ua = _unsigned(a)
    bits = ua.dtype.itemsize * 8
    s = _shift_amount(b)
    out = np.left_shift(ua.astype(np.uint64), np.clip(s, 0, 63).astype(np.uint64))
    out = np.where(s >= bits, 0, out)
    return out.astype(ua.dtype).view(np.asarray(a).dtype) if np.asarray(a).dtype.kind in "iu" else out


def _right_shift(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # Logical shift: the sign bit is not replicated (arithmetic right shift is not supported on HW).
    ua = _unsigned(a)
    bits = ua.dtype.itemsize * 8
    s = _shift_amount(b)
    out = np.right_shift(ua.astype(np.uint64), np.clip(s, 0, 63).astype(np.uint64))
    out = np.where(s >= bits, 0, out)
    return out.astype(ua.dtype).view(np.asarray(a).dtype) if np.asarray(a).dtype.kind in "iu" else out


def _bitwise(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    def fn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return ufunc(np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64))
    return fn


def _invert(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return np.invert(a.astype(np.uint8) if a.dtype.kind == "b" else a)


def _abs_max(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(a), np.abs(b))


def _abs_min(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.minimum(np.abs(a), np.abs(b))


# ---------------------------------------------------------------------------------------------
# the objects
# ---------------------------------------------------------------------------------------------

ALL_OPS: dict[str, NkiOp] = {}


def _op(name: str, kind: str, arity: int, fn: Callable[..., np.ndarray], *, alu: bool = False,
        activation: bool = False, reduce_ufunc: np.ufunc | None = None,
        reduce_identity: float | int | None = None, doc: str = "") -> NkiOp:
    op = NkiOp(name, kind, arity, fn, alu=alu, activation=activation, reduce_ufunc=reduce_ufunc,
               reduce_identity=reduce_identity, doc=doc)
    ALL_OPS[name] = op
    return op


# bitvec ALU operators (integer dtypes, raw bits)
invert = _op("invert", BITVEC, 1, _invert, alu=True, doc="bitwise not (bitvec, unary)")
bitwise_and = _op("bitwise_and", BITVEC, 2, _bitwise(np.bitwise_and), alu=True,
                  reduce_ufunc=np.bitwise_and, reduce_identity=-1)
bitwise_or = _op("bitwise_or", BITVEC, 2, _bitwise(np.bitwise_or), alu=True,
                 reduce_ufunc=np.bitwise_or, reduce_identity=0)
bitwise_xor = _op("bitwise_xor", BITVEC, 2, _bitwise(np.bitwise_xor), alu=True,
                  reduce_ufunc=np.bitwise_xor, reduce_identity=0)
left_shift = _op("left_shift", BITVEC, 2, _left_shift, alu=True, doc="logical shift left (bitvec)")
right_shift = _op("right_shift", BITVEC, 2, _right_shift, alu=True, doc="logical shift right (bitvec)")

# arithmetic ALU operators (fp32 math)
add = _op("add", ARITH, 2, np.add, alu=True, reduce_ufunc=np.add, reduce_identity=0.0)
subtract = _op("subtract", ARITH, 2, np.subtract, alu=True, reduce_ufunc=np.subtract, reduce_identity=0.0)
multiply = _op("multiply", ARITH, 2, np.multiply, alu=True, reduce_ufunc=np.multiply, reduce_identity=1.0)
divide = _op("divide", ARITH, 2, np.divide,
             doc="x / y (the nl.divide wrapper's; not an ALU operator: not in the ISA operator table, and "
                 "'Division is not available as a hardware instruction', NKI 0.4.0 release notes, known issues)")
maximum = _op("maximum", ARITH, 2, np.maximum, alu=True, reduce_ufunc=np.maximum, reduce_identity=-np.inf)
minimum = _op("minimum", ARITH, 2, np.minimum, alu=True, reduce_ufunc=np.minimum, reduce_identity=np.inf)
equal = _op("equal", ARITH, 2, lambda a, b: _bool(a == b), alu=True)
not_equal = _op("not_equal", ARITH, 2, lambda a, b: _bool(a != b), alu=True)
greater = _op("greater", ARITH, 2, lambda a, b: _bool(a > b), alu=True)
greater_equal = _op("greater_equal", ARITH, 2, lambda a, b: _bool(a >= b), alu=True)
less = _op("less", ARITH, 2, lambda a, b: _bool(a < b), alu=True)
less_equal = _op("less_equal", ARITH, 2, lambda a, b: _bool(a <= b), alu=True)
logical_and = _op("logical_and", ARITH, 2, lambda a, b: _bool((a != 0) & (b != 0)), alu=True,
                  reduce_ufunc=np.logical_and, reduce_identity=1.0)
logical_or = _op("logical_or", ARITH, 2, lambda a, b: _bool((a != 0) | (b != 0)), alu=True,
                 reduce_ufunc=np.logical_or, reduce_identity=0.0)
logical_xor = _op("logical_xor", ARITH, 2, lambda a, b: _bool((a != 0) ^ (b != 0)), alu=True,
                  reduce_ufunc=np.logical_xor, reduce_identity=0.0)
logical_not = _op("logical_not", ARITH, 1, lambda a: _bool(a == 0), alu=True)
power = _op("power", ARITH, 2, np.power, alu=True, doc="x ** y (runs on GpSimd in tensor_tensor)")
abs_max = _op("abs_max", ARITH, 2, _abs_max, alu=True, doc="max(|x|, |y|) (NeuronCore-v4)")
abs_min = _op("abs_min", ARITH, 2, _abs_min, alu=True, doc="min(|x|, |y|) (NeuronCore-v4)")
bypass = _op("bypass", ARITH, 1, lambda a: a, alu=True, doc="no-op stage (returns the input)")
# nl.average: a reduction operator of nisa.tensor_partition_reduce (documented op list there); not an
# ALU operator of the element-wise instructions.
average = _op("average", ARITH, 2, lambda a, b: (a + b) * _F32(0.5),
              doc="mean reduction (nisa.tensor_partition_reduce's op)")

# unary operators that are both ALU ops and activation functions
rsqrt = _op("rsqrt", ARITH, 1, lambda x: _F32(1.0) / np.sqrt(x), alu=True, activation=True)
reciprocal = _op("reciprocal", ARITH, 1, lambda x: _F32(1.0) / x, alu=True, activation=True)
abs = _op("abs", ARITH, 1, np.abs, alu=True, activation=True)  # noqa: A001  (nl.abs)

# activation functions (Scalar Engine)
copy = _op("copy", ACT, 1, lambda x: x, activation=True, doc="identity")
square = _op("square", ACT, 1, np.square, activation=True)
sigmoid = _op("sigmoid", ACT, 1, _sigmoid, activation=True)
relu = _op("relu", ACT, 1, lambda x: np.maximum(x, _F32(0.0)), activation=True)
gelu = _op("gelu", ACT, 1, _gelu, activation=True, doc="x * Phi(x) (exact, erf based)")
gelu_dx = _op("gelu_dx", ACT, 1, _gelu_dx, activation=True)
gelu_apprx_tanh = _op("gelu_apprx_tanh", ACT, 1, _gelu_tanh, activation=True)
gelu_apprx_sigmoid = _op("gelu_apprx_sigmoid", ACT, 1, _gelu_sigmoid, activation=True,
                         doc="x * sigmoid(1.702 x)")
gelu_apprx_sigmoid_dx = _op("gelu_apprx_sigmoid_dx", ACT, 1, _gelu_sigmoid_dx, activation=True)
silu = _op("silu", ACT, 1, _silu, activation=True)
silu_dx = _op("silu_dx", ACT, 1, _silu_dx, activation=True)
tanh = _op("tanh", ACT, 1, np.tanh, activation=True)
softplus = _op("softplus", ACT, 1, _softplus, activation=True)
mish = _op("mish", ACT, 1, _mish, activation=True)
erf = _op("erf", ACT, 1, _erf, activation=True)
erf_dx = _op("erf_dx", ACT, 1, _erf_dx, activation=True)
exp = _op("exp", ACT, 1, np.exp, activation=True)
log = _op("log", ACT, 1, np.log, activation=True)
sin = _op("sin", ACT, 1, np.sin, activation=True)
cos = _op("cos", ACT, 1, np.cos, activation=True, doc="cos (nl.cos; not in the ISA activation table)")
arctan = _op("arctan", ACT, 1, np.arctan, activation=True)
sqrt = _op("sqrt", ACT, 1, np.sqrt, activation=True)
sign = _op("sign", ACT, 1, np.sign, activation=True)

ALU_OPS: dict[str, NkiOp] = {k: v for k, v in ALL_OPS.items() if v.alu}
ACTIVATION_OPS: dict[str, NkiOp] = {k: v for k, v in ALL_OPS.items() if v.activation}

# Old-style kernels pass numpy functions as op=.
_NUMPY_ALIASES: dict[Any, NkiOp] = {
    np.add: add, np.subtract: subtract, np.multiply: multiply, np.divide: divide,
    np.true_divide: divide, np.maximum: maximum, np.minimum: minimum, np.equal: equal,
    np.not_equal: not_equal, np.greater: greater, np.greater_equal: greater_equal, np.less: less,
    np.less_equal: less_equal, np.logical_and: logical_and, np.logical_or: logical_or,
    np.logical_xor: logical_xor, np.logical_not: logical_not, np.power: power,
    np.bitwise_and: bitwise_and, np.bitwise_or: bitwise_or, np.bitwise_xor: bitwise_xor,
    np.invert: invert, np.left_shift: left_shift, np.right_shift: right_shift, np.abs: abs,
    np.absolute: abs, np.reciprocal: reciprocal, np.square: square, np.tanh: tanh, np.exp: exp,
    np.log: log, np.sin: sin, np.cos: cos, np.arctan: arctan, np.sqrt: sqrt, np.sign: sign,
    np.copy: copy,
}


def resolve(op: Any, where: str = "op") -> NkiOp | None:
    """``op`` as an :class:`NkiOp`: the object itself, a numpy alias (``np.add``), or None."""
    if op is None or isinstance(op, NkiOp):
        return op
    if isinstance(op, MissingApi):  # a documented operator the interpreter lacks (nl.prelu)
        op.fail()
    try:
        found = _NUMPY_ALIASES.get(op)
    except TypeError:  # unhashable
        found = None
    if found is None:
        raise TypeError(f"{where}: {op!r} is not an nki.language operator / activation function "
                        f"(expected e.g. nl.add, nl.exp)")
    return found
