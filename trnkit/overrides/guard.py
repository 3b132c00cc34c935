"""A swap point's kernel choice at call time: :class:`BoundKernel` (the choice bound to a module path, which
checks the op's constraints on each call's inputs and applies the policy) and the probe the validation dry
run collects what it sees with."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from trnkit.kernels.constraints import Violation
from trnkit.overrides import ops
from trnkit.overrides.config import KernelChoice
from trnkit.overrides.registry import REFERENCE, OverrideConstraintError, list_impls, select, warn_once

__all__ = ["PLAIN_LINEAR", "BoundKernel", "Probe", "head_norm_pair", "linear_wrapper", "paired_head_norms",
           "resolve_dtensor", "wrapped_projections"]

_DTensor: type | None = None  # torch.distributed.tensor.DTensor, resolved by resolve_dtensor (import is slow)


def autocast_operands(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` as torch's autocast hands them to an op it runs in the lower precision (such as
    ``scaled_dot_product_attention``): cast to their device's autocast dtype while autocast is on there, unchanged
    otherwise. A swap point whose torch code autocast would cast calls this before the kernel's constraints are
    checked, so the kernel gets what the torch op would (Qwen3's q and k leave their fp32-weighted head norms in
    fp32 while v is bf16)."""
    dev = tensors[0].device.type
    if not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) for t in tensors)


PLAIN_LINEAR = "_trnkit_plain_linear"  # class attribute: this nn.Linear subclass's forward is F.linear of its weight
_WRAPPED_REASON = ("the kernel reads the projection's weight and computes it itself, which would skip what the "
                   "wrapper adds (a LoRA delta, ...); the module's own forward runs it")


def linear_wrapper(module: nn.Module) -> str | None:
    """None when ``module`` computes just ``F.linear(x, weight, bias)``: an ``nn.Linear`` whose forward is
    ``nn.Linear``'s or that of a subclass declaring ``_trnkit_plain_linear = True`` (trnkit's native
    ``qwen3.precision.Linear``: the same product in its matmul dtype). Otherwise what it is instead: a wrapper of
    another class (a LoRA-style ``base(x) + B(A(x))``, a peft-style layer keeping the weight on ``.base_layer``),
    an ``nn.Linear`` subclass with a forward of its own, or a forward set on the instance. For the code that
    reads a projection's weight rather than calling it (kernel swap points, the fused lm_head + loss), which
    would skip such a module's own computation."""
    cls = type(module)
    if "forward" in module.__dict__:
        return f"{cls.__name__} with a forward set on the instance"
    if not isinstance(module, nn.Linear):
        return cls.__name__
    owner = next(c for c in cls.__mro__ if "forward" in c.__dict__)  # the class whose forward runs
    if owner is not nn.Linear and not owner.__dict__.get(PLAIN_LINEAR, False):
        return f"{cls.__name__} (an nn.Linear subclass with a forward of its own)"
    return None


def wrapped_projections(label: str, projections: Mapping[str, Any], reason: str = _WRAPPED_REASON
                        ) -> list[Violation]:
    """A violation per projection the swap point reads the weight of (rather than calling it) that computes more
    than ``F.linear`` (:func:`linear_wrapper`: a LoRA-style wrapper, a peft-style layer, a subclass or instance
    forward): the kernel would skip its own computation, so its module's own forward (which calls the
    projection) must run. Checked when the kernel is bound and at every call (a wrapper may come later)."""
    out = []
    for name, proj in projections.items():  # a loop: dynamo cannot trace a walrus in a comprehension
        what = linear_wrapper(proj)
        if what is not None:
            out.append(Violation(label, f"{name} computes only F.linear (nn.Linear's own forward, no wrapper)", what,
                                 reason))
    return out


def resolve_dtensor() -> None:
    """Make the guards recognise DTensor inputs (called when kernels are applied: the import is slow)."""
    global _DTensor  # noqa: PLW0603 - a lazily imported class, cached
    if _DTensor is None and torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        _DTensor = DTensor


@dataclass
class Probe:
    """Collects what the guards see during the fake-tensor dry run."""

    device: str | None
    needs_backward: bool
    seen: dict[tuple[str, str], list[Violation]] = field(default_factory=dict)  # (module path, op) -> reasons



class BoundKernel:
    """One swap point's :class:`KernelChoice`, bound to its module path: the call-time decision
    (:meth:`choose`: the impl to run, or None for the module's own code) and the options the swap
    point passes to its op (``lnc``: 0 = the device default; ``block_size``: 0 = the kernel's tuned sizes;
    ``fixed_shift``: the attention forward's fixed softmax shift)."""

    def __init__(self, op: str, choice: KernelChoice, path: str, static: Sequence[Violation] = (),
                 probe_only: bool = False) -> None:
        self.op, self.choice, self.path, self.static = op, choice, path, list(static)
        self.probe_only = probe_only  # a shape-only stand-in used during the dry run
        self.probe: Probe | None = None  # set while a validation dry run collects what this swap point sees
        self.impl, self.policy = choice.impl, choice.policy
        self.lnc, self.block_size, self.fixed_shift = choice.lnc or 0, choice.block_size, choice.fixed_shift

    def __repr__(self) -> str:
        return f"BoundKernel({self.op!r}, {self.choice!r}, path={self.path!r})"

    def choose(self, extra: Sequence[Violation] = (), **inputs: Any) -> str | None:
        probe = self.probe
        if probe is not None:
            if self.probe_only:
                return REFERENCE
            sharded = _dtensor_violations(self.op, inputs)
            if sharded:  # the op cannot even be traced on a mix of DTensors and tensors
                if self.policy == "strict":
                    raise OverrideConstraintError(self.op, self.impl, sharded, self.path)
                raise RuntimeError(f"{self.path}: {sharded[0]}")
            sel = select(self.op, self.impl, policy="fallback", device=probe.device,
                         needs_backward=probe.needs_backward, **inputs)
            probe.seen.setdefault((self.path, self.op), []).extend([*extra, *sel.reasons])
            return REFERENCE  # under FakeTensorMode the op's fake impl runs: shapes only
        reasons = [*self.static, *extra, *_dtensor_violations(self.op, inputs)]
        if not reasons:
            needs_backward = torch.is_grad_enabled() and any(
                isinstance(t, Tensor) and t.requires_grad for t in inputs.values())
            sel = select(self.op, self.impl, policy="fallback", needs_backward=needs_backward,
                         compiling=torch.compiler.is_compiling(), **inputs)
            if not sel.fell_back:
                return sel.impl
            reasons = list(sel.reasons)
        self._enforce(reasons)
        return None

    def refuse(self, reasons: Sequence[Violation]) -> None:
        """The policy for a call whose kernel inputs cannot even be formed (a projection wrapped since the swap,
        :func:`wrapped_projections`): recorded by a validation dry run, raised under ``strict``, warned once under
        ``fallback``; the caller then runs the module's own code."""
        if self.probe is not None:
            if not self.probe_only:
                self.probe.seen.setdefault((self.path, self.op), []).extend(reasons)
            return
        self._enforce(reasons)

    def _enforce(self, reasons: Sequence[Violation]) -> None:
        """The policy for a call the kernel does not serve: raise under ``strict``, warn once under ``fallback``."""
        if self.policy == "strict":
            if torch.compiler.is_compiling():
                # torch.compile(fullgraph=True) cannot raise from a graph ("Observed exception");
                # say why first. Without fullgraph dynamo breaks the graph and this raise runs eagerly.
                _announce_strict(self.op, self.impl, "; ".join(str(v) for v in reasons), self.path)
            raise OverrideConstraintError(self.op, self.impl, list(reasons), self.path)
        self.warn_fallback(reasons)

    def warn_fallback(self, reasons: Sequence[Violation]) -> str:
        """Warn once per distinct (op, impl, reason) — not per layer or call; returns the reason."""
        reason = "; ".join(str(v) for v in reasons)
        _emit_fallback_warning(self.op, self.impl, reason, self.path)
        return reason


def head_norm_pair(q_guard: BoundKernel | None, k_guard: BoundKernel | None, q: Tensor, k: Tensor, weight_q: Tensor,
                   weight_k: Tensor, eps_q: float, eps_k: float) -> str | None:
    """The impl that runs the q and k head norms as one ``trnkit::rmsnorm_qk`` call, or None (each norm runs its
    own swap point's choice). One call when both norms are swapped in with the same impl, ``lnc`` and eps,
    each norm's own choice (its policy and constraints, :meth:`BoundKernel.choose`) runs that impl,
    ``rmsnorm_qk`` has an impl of that name, and the pair's constraints hold (otherwise a warning once per
    reason, and the two calls, whose outputs are the same). Not during the validation dry run, which checks
    each norm's swap point."""
    if q_guard is None or k_guard is None or q_guard.probe is not None or k_guard.probe is not None:
        return None
    if (q_guard.impl, q_guard.lnc, eps_q) != (k_guard.impl, k_guard.lnc, eps_k):
        return None
    if q_guard.impl not in list_impls("rmsnorm_qk")["rmsnorm_qk"]:
        return None
    impl = q_guard.choose(x=q, weight=weight_q, eps=eps_q)
    if impl is None or impl != k_guard.choose(x=k, weight=weight_k, eps=eps_k):
        return None
    needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, weight_q, weight_k))
    sel = select("rmsnorm_qk", impl, policy="fallback", needs_backward=needs_backward,
                 compiling=torch.compiler.is_compiling(), q=q, k=k, weight_q=weight_q, weight_k=weight_k, eps=eps_q)
    if sel.fell_back:
        _emit_pair_warning(impl, "; ".join(str(v) for v in sel.reasons), q_guard.path)
        return None
    return impl


def paired_head_norms(q_guard: BoundKernel | None, k_guard: BoundKernel | None, q: Tensor, k: Tensor,
                      weight_q: Tensor, weight_k: Tensor, eps_q: float, eps_k: float) -> tuple[Tensor, Tensor] | None:
    """``(q_norm(q), k_norm(k))`` from one ``trnkit::rmsnorm_qk`` call when :func:`head_norm_pair` picks an impl,
    else None (the caller runs the two norms). Both models' attention forwards call this."""
    impl = head_norm_pair(q_guard, k_guard, q, k, weight_q, weight_k, eps_q, eps_k)
    if impl is None:
        return None
    yq, yk, _, _ = ops.rmsnorm_qk(q, k, weight_q, weight_k, eps_q, impl, lnc=q_guard.lnc)
    return yq, yk


@torch.compiler.assume_constant_result
def _emit_pair_warning(impl: str, reason: str, path: str) -> bool:
    return warn_once("fallback", "rmsnorm_qk", impl, reason,
                     message=f"trnkit override rmsnorm_qk[{impl}] does not serve these head norms (first seen at "
                             f"{path}): {reason}; q_norm and k_norm run as two rmsnorm calls")


@torch.compiler.assume_constant_result
def _announce_strict(op: str, impl: str, reason: str, path: str) -> bool:
    warnings.warn(f"{OverrideConstraintError(op, impl, [], path, reason)}", UserWarning, stacklevel=2)
    return True


# Under torch.compile the guard runs while dynamo traces it; a warnings.warn call there would break
# the graph. assume_constant_result makes dynamo run this for real at trace time (constant string
# arguments) and bake in the result, so the warning is emitted when the fallback is compiled in.
@torch.compiler.assume_constant_result
def _emit_fallback_warning(op: str, impl: str, reason: str, path: str) -> bool:
    return warn_once("fallback", op, impl, reason,
                     message=f"trnkit override {op}[{impl}] falls back to the original module code "
                             f"(first seen at {path}): {reason}")


def dtensor_names(named: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the DTensors among ``named`` (after :func:`resolve_dtensor`; none before it)."""
    return [name for name, t in named if _DTensor is not None and isinstance(t, _DTensor)]


def _dtensor_violations(op: str, inputs: Mapping[str, Any]) -> list[Violation]:
    """Sharded (DTensor) inputs, e.g. tensor-parallel expert weights: the kernels see whole tensors."""
    sharded = dtensor_names(inputs.items())
    return [Violation(f"{op}[adapter]", "plain (non-DTensor) inputs", sharded,
                      "the kernels compute on whole local tensors; sharded inputs would need collectives")
            ] if sharded else []
