"""Implementation registry for trnkit's overridable ops.

Every op (``rope_hf``, ``router_topk``, ``grouped_mm``, ``moe_experts``, ``rmsnorm``, ``rmsnorm_qk``,
``linear_cross_entropy``,
``attention``, ``mlp``) has named implementations
("impls"): the built-in ``reference`` (torch) and ``nki`` (the NKI kernel: real NKI on a ``neuron``
device, trnkit's interpreter on CPU), plus any a user registers::

    from trnkit.overrides import register

    @register("rope_hf", "my_rope", constraints=my_checks, has_backward=True)
    def my_rope(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False, layout="bhsd"):
        ...

:func:`select` decides, for concrete (or fake/meta) inputs, whether an impl can serve them — device,
backward and torch.compile support, and the impl's own ``constraints(...)`` — and applies the policy:
``strict`` raises with the reasons, ``fallback`` returns the reference (the caller warns once),
``off`` always returns the reference.

Impl call conventions (the op's canonical signature; the kernels' signatures from DESIGN.md §3):

- ``rope_hf``: ``fn(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False,
  layout="bhsd")`` writes ``q_out``/``k_out`` or returns new ``(q', k')`` that trnkit copies into them
  (``layout`` is ``"bhsd"`` or ``"bshd"``); the backward is the same call with ``backward=True``
  (dy in, dx out).
- ``router_topk``: ``fn(x, w_router, top_k, norm_topk_prob=True) -> (weights f32, idx int32, logits f32)``;
  ``backward(x, w_router, router_logits, topk_idx, grad_topk_weights, grad_router_logits,
  norm_topk_prob) -> (grad_x, grad_w_router)``.
- ``grouped_mm``: ``fn(x, w, group_offsets) -> out``; ``backward(x, w, group_offsets, grad_out) ->
  (grad_x, grad_w)``.
- ``moe_experts``: ``fn(x, topk_idx, topk_weights, w_gate_up, w_down, block_size=128) -> out``;
  ``backward(x, topk_idx, topk_weights, w_gate_up, w_down, grad_out, block_size=128) ->
  (grad_x, grad_topk_weights, grad_w_gate_up, grad_w_down)``.
- ``rmsnorm``: ``fn(x, weight, eps=1e-6) -> (y, rstd [rows] f32)`` with ``y = weight * (x * rstd).to(x.dtype)``;
  ``backward(x, weight, rstd, grad_y, eps=1e-6) -> (grad_x, grad_weight)``.
- ``rmsnorm_qk`` (not a swap point of its own: the models run it for the q and k head norms when both are
  swapped in with an impl it has, :func:`trnkit.overrides.guard.head_norm_pair`): ``fn(q, k, weight_q, weight_k,
  eps=1e-6) -> (y_q, y_k, rstd_q, rstd_k)``, ``rmsnorm`` of each; ``backward(q, k, weight_q, weight_k, rstd_q,
  rstd_k, grad_yq, grad_yk, eps=1e-6) -> (grad_q, grad_k, grad_weight_q, grad_weight_k)``.
- ``linear_cross_entropy``: ``fn(hidden [T, H], weight [V, H], labels [T], ignore_index=-100) ->
  (loss f32, lse [T] f32)``, the cross-entropy of ``hidden @ weight.T`` summed over the tokens whose label
  is not ``ignore_index``; ``backward(hidden, weight, labels, lse, grad_loss, ignore_index=-100) ->
  (grad_hidden, grad_weight)``.
- ``attention``: ``fn(q, k, v, scale) -> (o, lse [B, Hq, S] f32)``, causal GQA attention, ``q [B, S, Hq, D]``,
  ``k, v [B, S, Hk, D]``; ``backward(q, k, v, o, lse, grad_o, scale) -> (grad_q, grad_k, grad_v)``.
- ``mlp``: ``fn(x [..., H], w_gate_up [H, 2I], w_down [I, H]) -> y``, the dense SwiGLU MLP ``(silu(x @ Wg) *
  (x @ Wu)) @ w_down`` (gate columns first); ``backward(x, w_gate_up, w_down, grad_y) -> (grad_x,
  grad_w_gate_up, grad_w_down)``.

``constraints(**inputs) -> list[Violation]`` receives the op's inputs by name (tensors may be fake or
meta: read shapes, dtypes and devices only, never values).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from trnkit.errors import TrnkitError, raised_at
from trnkit.kernels.constraints import KernelConstraintError, Violation

__all__ = [
    "OPS",
    "POLICIES",
    "REFERENCE",
    "ImplEntry",
    "OverrideConstraintError",
    "RegistrationError",
    "Selection",
    "get_impl",
    "list_impls",
    "register",
    "reset_warnings",
    "foreign_code",
    "select",
    "unregister",
    "warn_once",
]

# op name -> whether an impl's backward is a separate function (True) or the forward fn called with
# backward=True (False, rope_hf: the rotation's transpose is the same kernel).
OPS: dict[str, bool] = {"rope_hf": False, "router_topk": True, "grouped_mm": True, "moe_experts": True,
                        "rmsnorm": True, "rmsnorm_qk": True, "linear_cross_entropy": True,
                        "attention": True, "mlp": True}
POLICIES = ("strict", "fallback", "off")
REFERENCE = "reference"


class RegistrationError(TrnkitError, ValueError):
    """A registration that conflicts with an existing one, or names an unknown op."""


class ConstraintFunctionError(TrnkitError, RuntimeError):
    """An impl's own constraint function raised (``SystemExit`` included) or returned no list of Violation."""


class OverrideConstraintError(KernelConstraintError):
    """Raised under the ``strict`` policy when the selected impl cannot serve the inputs."""

    def __init__(self, op: str, impl: str, violations: Iterable[Violation], where: str = "",
                 reason: str | None = None) -> None:
        self.op, self.impl, self.where = op, impl, where
        KernelConstraintError.__init__(self, violations)
        loc = f" at {where}" if where else ""
        reason = "; ".join(str(v) for v in self.violations) if reason is None else reason
        self.args = (f"trnkit override {op}[{impl}]{loc} cannot serve these inputs (policy 'strict'): {reason}",)


@dataclass(frozen=True)
class ImplEntry:
    """One registered implementation of an op."""

    op: str
    name: str
    fn: Callable[..., Any]
    constraints: Callable[..., list[Violation]] | None = None
    devices: tuple[str, ...] | None = None  # device types it runs on; None = any
    has_backward: bool = False
    compile_ok: bool = True  # traceable by torch.compile as an opaque custom op
    backward: Callable[..., Any] | None = None
    description: str = ""
    # Run the backward with autograd on and the op's differentiable inputs as fresh leaves that require
    # grad, so a backward written with torch.autograd.grad works inside the op (trnkit's own impls: off).
    autograd_backward: bool = True

    def check(self, *, device: str | None = None, needs_backward: bool = False, compiling: bool = False,
              **inputs: Any) -> list[Violation]:
        """All reasons this impl cannot serve ``inputs`` (empty list = it can)."""
        label = f"{self.op}[{self.name}]"
        out: list[Violation] = []
        if device is not None and self.devices is not None and device not in self.devices:
            out.append(Violation(label, f"device in {list(self.devices)}", device,
                                 "this implementation does not run on that device"))
        if needs_backward and not self.has_backward:
            out.append(Violation(label, "has_backward", False,
                                 "inputs require grad but this implementation has no backward"))
        if compiling and not self.compile_ok:
            out.append(Violation(label, "compile_ok", False,
                                 "this implementation is not declared torch.compile-safe"))
        if self.constraints is not None and inputs:
            out.extend(self._run_constraints(label, inputs))
        return out

    def _run_constraints(self, label: str, inputs: dict[str, Any]) -> list[Violation]:
        fn = self.constraints
        try:
            got = fn(**inputs)
        except (Exception, SystemExit) as e:  # a user's (plugin's) function: theirs to fix
            what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
            raise ConstraintFunctionError(f"trnkit overrides: the constraint function {_qualname(fn)} of {label} "
                                          f"{what}{raised_at(e, _source(fn))}{_fake_hint(e)}") from e
        if not isinstance(got, list) or not all(isinstance(v, Violation) for v in got):
            raise ConstraintFunctionError(f"trnkit overrides: the constraint function {_qualname(fn)} of {label} "
                                          f"must return a list of Violation, got {type(got).__name__} {got!r:.100}")
        return got


@dataclass(frozen=True)
class Selection:
    """What :func:`select` decided: ``impl`` runs; ``reasons`` say why ``requested`` was not used."""

    op: str
    requested: str
    impl: str
    reasons: tuple[Violation, ...] = field(default_factory=tuple)

    @property
    def fell_back(self) -> bool:
        return self.impl != self.requested

    @property
    def reason(self) -> str:
        return "; ".join(str(v) for v in self.reasons)


_REGISTRY: dict[str, dict[str, ImplEntry]] = {op: {} for op in OPS}
_BUILTIN: dict[tuple[str, str], ImplEntry] = {}  # trnkit's own entries, as trnkit.overrides.builtins registered them
_LOCK = threading.Lock()
_WARNED: set[tuple[str, ...]] = set()


def _check_op(op_name: str) -> None:
    if op_name not in OPS:
        raise RegistrationError(f"trnkit overrides: unknown op {op_name!r}; known ops: {sorted(OPS)}")


def register(op_name: str, impl_name: str, fn: Callable[..., Any] | None = None, *,
             constraints: Callable[..., list[Violation]] | None = None,
             devices: Iterable[str] | None = None, has_backward: bool = False, compile_ok: bool = True,
             backward: Callable[..., Any] | None = None, description: str = "",
             replace: bool = False, autograd_backward: bool = True) -> Any:
    """Register ``fn`` as implementation ``impl_name`` of ``op_name``; without ``fn``, a decorator.

    Registering the same (op, impl) again with an identical entry is a no-op; with a different one it
    raises :class:`RegistrationError` unless ``replace=True``. For ops whose backward is a separate
    function (all but ``rope_hf``), ``has_backward=True`` needs ``backward=``.

    The backward runs inside a custom op, where torch records no graph; with ``autograd_backward=True``
    (default) trnkit turns autograd back on for it and passes the op's differentiable inputs as
    detached leaves with ``requires_grad=True``, so ``torch.autograd.grad(fwd(x, w), (x, w), grad_out)``
    works as well as ``torch.func.vjp``. ``False`` skips that (a backward that needs no autograd).
    """
    if fn is None:
        def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
            register(op_name, impl_name, f, constraints=constraints, devices=devices,
                     has_backward=has_backward, compile_ok=compile_ok, backward=backward,
                     description=description, replace=replace, autograd_backward=autograd_backward)
            return f
        return decorator

    _check_op(op_name)
    if not isinstance(impl_name, str) or not impl_name.isidentifier():
        raise RegistrationError(f"trnkit overrides: impl name for {op_name!r} must be an identifier, "
                                f"got {impl_name!r}")
    if not callable(fn):
        raise RegistrationError(f"trnkit overrides: {op_name}[{impl_name}]: fn must be callable, got {fn!r}")
    if devices is not None and not isinstance(devices, str):
        devices = tuple(devices)  # read once (a generator), checked below
    _check_arguments(f"trnkit overrides: {op_name}[{impl_name}]", devices=devices, constraints=constraints,
                     backward=backward, has_backward=has_backward, compile_ok=compile_ok,
                     autograd_backward=autograd_backward)
    if OPS[op_name] and has_backward and backward is None:
        raise RegistrationError(f"trnkit overrides: {op_name}[{impl_name}]: has_backward=True needs "
                                f"backward= (this op's backward is a separate function)")
    if backward is not None and not OPS[op_name]:
        raise RegistrationError(f"trnkit overrides: {op_name}[{impl_name}]: backward= is not used for "
                                f"{op_name}; its backward is fn(..., backward=True)")
    entry = ImplEntry(op_name, impl_name, fn, constraints, devices,
                      bool(has_backward or backward is not None), compile_ok, backward, description,
                      autograd_backward)
    with _LOCK:
        old = _REGISTRY[op_name].get(impl_name)
        if old is not None and old != entry and not replace:
            raise RegistrationError(
                f"trnkit overrides: {op_name}[{impl_name}] is already registered to "
                f"{_qualname(old.fn)}; refusing to replace it with {_qualname(fn)} "
                f"(pick another impl name, or pass replace=True)")
        _REGISTRY[op_name][impl_name] = entry
    return entry


def shown(value: Any) -> str:
    """A value in an error message: a container as written, anything else with its type (``str 'cpu'``)."""
    return repr(value) if isinstance(value, (list, tuple, dict)) else f"{type(value).__name__} {value!r}"


def _check_arguments(label: str, *, devices: Any, constraints: Any, backward: Any, **flags: Any) -> None:
    """Refuse registration arguments of the wrong kind now, not when the impl is first selected or run."""
    def fail(what: str, value: Any) -> None:
        raise RegistrationError(f"{label}: {what}, got {shown(value)}")

    if devices is not None and (isinstance(devices, str) or not all(isinstance(d, str) for d in devices)):
        fail("devices must be a list of device types such as ['cpu', 'neuron']",
             devices if isinstance(devices, str) else list(devices))
    if constraints is not None and not callable(constraints):
        fail("constraints must be callable (inputs by name -> list of Violation) or None", constraints)
    if backward is not None and not callable(backward):
        fail("backward must be callable or None", backward)
    for name, value in flags.items():
        if not isinstance(value, bool):
            fail(f"{name} must be True or False", value)


def mark_builtin(entry: ImplEntry) -> None:
    """Record ``entry`` as trnkit's own (``trnkit.overrides.builtins``), for :func:`foreign_code`."""
    _BUILTIN[(entry.op, entry.name)] = entry


def foreign_code(op_name: str, impl_name: str) -> str:
    """Whose code ``impl_name`` of ``op_name`` runs when it is not trnkit's built-in: its function's
    ``module.qualname`` (and its backward's), noting a built-in name that a registration with ``replace=True``
    took over; "" for trnkit's own impls."""
    entry = get_impl(op_name, impl_name)
    builtin = _BUILTIN.get((op_name, impl_name))
    if builtin is not None and builtin == entry:
        return ""
    code = _qualname(entry.fn)
    if entry.backward is not None:
        code += f", backward {_qualname(entry.backward)}"
    if builtin is not None:
        code += f" (registered with replace=True in place of trnkit's built-in {impl_name!r})"
    return code


def unregister(op_name: str, impl_name: str) -> None:
    """Remove a registration (built-ins included; mainly for tests)."""
    _check_op(op_name)
    with _LOCK:
        if _REGISTRY[op_name].pop(impl_name, None) is None:
            raise KeyError(f"trnkit overrides: {op_name}[{impl_name}] is not registered")


def get_impl(op_name: str, impl_name: str) -> ImplEntry:
    """The registered entry, or a KeyError naming the registered impls."""
    _check_op(op_name)
    try:
        return _REGISTRY[op_name][impl_name]
    except KeyError:
        raise KeyError(f"trnkit overrides: no implementation {impl_name!r} registered for op "
                       f"{op_name!r}; registered: {sorted(_REGISTRY[op_name])}") from None


def list_impls(op_name: str | None = None) -> dict[str, list[str]]:
    """``{op: [impl names]}`` (one op if ``op_name`` is given)."""
    ops = [op_name] if op_name is not None else sorted(OPS)
    for op in ops:
        _check_op(op)
    return {op: sorted(_REGISTRY[op]) for op in ops}


def select(op_name: str, impl: str = "nki", *, policy: str = "strict", device: str | None = None,
           needs_backward: bool = False, compiling: bool = False, where: str = "",
           **inputs: Any) -> Selection:
    """Choose the impl that runs ``op_name`` on ``inputs`` under ``policy``.

    ``inputs`` are the op's inputs by name (real, fake or meta tensors); ``device`` defaults to the
    device type of the first tensor input. ``strict`` raises :class:`OverrideConstraintError` with every
    unmet constraint; ``fallback`` returns the reference impl with the reasons; ``off`` returns the
    reference without checking.
    """
    if policy not in POLICIES:
        raise ValueError(f"trnkit overrides: policy must be one of {POLICIES}, got {policy!r}")
    entry = get_impl(op_name, impl)
    if policy == "off":
        return Selection(op_name, impl, REFERENCE)
    if device is None:
        device = next((v.device.type for v in inputs.values() if hasattr(v, "device")), None)
    reasons = entry.check(device=device, needs_backward=needs_backward, compiling=compiling, **inputs)
    if not reasons:
        return Selection(op_name, impl, impl)
    if policy == "strict":
        raise OverrideConstraintError(op_name, impl, reasons, where)
    return Selection(op_name, impl, REFERENCE, tuple(reasons))


def warn_once(*key: str, message: str) -> bool:
    """Emit ``message`` as a UserWarning the first time ``key`` is seen; True if it warned."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    warnings.warn(message, UserWarning, stacklevel=3)
    return True


def reset_warnings() -> None:
    """Forget which fallbacks were already warned about (tests)."""
    _WARNED.clear()


def _source(fn: Callable[..., Any]) -> str | None:
    """The file ``fn`` is defined in (None for builtins and callables without code)."""
    return getattr(getattr(fn, "__code__", None), "co_filename", None)


def _fake_hint(e: BaseException) -> str:
    """Why reading a value fails: the validation dry run and torch.compile pass fake tensors."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
        return ("; constraint functions also get fake tensors (the validation dry run, torch.compile): read "
                "shapes, dtypes and devices only, never values")
    return ""


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
