"""Swap trnkit ops into a model: :func:`apply_overrides` (and :func:`bind_kernels` for the native model).

Swap points (each becomes one report row):

=============  ===============================================  ==========================================
op             trnkit native Qwen3 (``kernel_op`` modules)      transformers v5 Qwen3 / Qwen3-MoE
=============  ===============================================  ==========================================
rope_hf        ``layers[i].attention.rope`` (``RoPEApply``)     ``layers[i].self_attn``: that module's own
                                                                forward is transformers' attention forward
                                                                with trnkit's rope at the rotary call site
router_topk    ``layers[i].moe.router`` (``TopKRouter``)        ``layers[i].mlp.gate`` (``*TopKRouter``)
moe_experts    ``layers[i].moe.experts`` (``GroupedExperts``)   ``layers[i].mlp.experts`` (``*Experts``,
                                                                fused ``gate_up_proj``/``down_proj``)
rmsnorm        every ``RMSNorm`` (``attention_norm``,           every ``Qwen3RMSNorm`` / ``Qwen3MoeRMSNorm``
               ``ffn_norm``, ``q_norm``, ``k_norm``, ``norm``)  (layer, q/k head and final norms)
linear_cross_  ``loss`` (``LinearCrossEntropy``: lm_head +      (transformers computes its loss outside a
entropy        summed cross-entropy)                            module: not swapped)

attention      ``layers[i].attention.core``                     ``layers[i].self_attn``: its own copy of
               (``CausalAttention``)                            the config selects the attention function
                                                                ``"trnkit"`` (transformers'
                                                                ``AttentionInterface``, see
                                                                :func:`~trnkit.overrides.hf.register_hf_attention`)
mlp            ``layers[i].feed_forward`` (``FeedForward``:     ``layers[i].mlp`` (``Qwen3MLP``; Qwen3-MoE's
               the dense layers' SwiGLU)                        dense ``Qwen3MoeMLP``)
=============  ===============================================  ==========================================

``rmsnorm``, ``linear_cross_entropy``, ``attention`` and ``mlp`` are swappable but not in the default
``ops`` (:data:`DEFAULT_OPS`): name them to swap the norms, the loss, the attention and the dense MLP.

A module whose class declares ``kernel_op`` (trnkit's native Qwen3: :class:`trnkit.qwen3.model.KernelSlot`)
takes the choice itself: its ``kernel`` attribute is set to the op's :class:`BoundKernel` and its own
forward calls the ``trnkit::`` op; nothing is rebuilt. A transformers module keeps its object and class
and gets a ``forward`` of its own (an instance attribute, bound to it; Liger-Kernel swaps modules the
same way): ``state_dict`` keys, checkpoints, ``isinstance`` checks and transformers' hooks keyed by class
(router-logit capture, ``_init_weights``) are unchanged, other models and other instances of the class
are untouched, and :func:`undo_swaps` just deletes the attribute. Replacing the module by a trnkit
module built from its weights would lose those class-keyed hooks. Before
returning, every swap point is validated against the model's real shapes and dtypes by a dry run
of the whole model on fake tensors (no memory, no kernel runs) plus static checks of the module
configuration (activation, weight layout, ...); on a model whose parameters are DTensors (FSDP2,
tensor parallelism) the dry run is skipped, and the report says so (``OverrideConfig.dry_run``). At
every call the same constraint functions run again (shape/dtype/device only), so a shape that changes
mid-run gets the policy's behaviour: ``strict`` raises, ``fallback`` warns once per reason and runs the
module's original code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trnkit.errors import TrnkitError
from trnkit.kernels.constraints import Violation
from trnkit.overrides.config import DEFAULT_OPS, SWAPPABLE_OPS, KernelChoice, OverrideConfig
from trnkit.overrides.guard import BoundKernel, Probe, dtensor_names, resolve_dtensor
from trnkit.overrides.hf import set_hf_attention, unset_hf_attention
from trnkit.overrides.hf_modules import ModuleAdapter, bind, dry_run_rotary, hf_attention_static, is_hf, \
    is_rope_attention, module_adapter, rope_attention_forward, unbind
from trnkit.overrides.registry import REFERENCE, OverrideConstraintError, foreign_code
from trnkit.overrides.report import OverrideReport, OverrideRow

__all__ = ["DEFAULT_OPS", "SWAPPABLE_OPS", "OverrideConfig", "apply_overrides", "bind_kernels", "undo_swaps"]

_STAND_IN_OPS = ("rope_hf", "router_topk", "moe_experts")  # ops given shape-only stand-ins in the dry run
ORIGINAL = "original"  # report name for "the module's own forward"
_STATE_ATTR = "_trnkit_overrides"  # a transformers model's applied swaps, for trnkit.hf.revert


# ------------------------------------------------------------------------------------ entry points


@dataclass
class _SwapPoint:
    """One applied swap, as data (so ``copy.deepcopy`` of a swapped model stays revertible)."""

    path: str
    op: str
    guard: BoundKernel
    module: nn.Module
    config: Any = None  # transformers attention swap: the module's original config
    slot: bool = False  # a kernel_op module: its kernel was set (to guard), previous is restored
    previous: Any = None

    def undo(self) -> None:
        if self.slot:
            self.module.kernel = self.previous
        elif self.config is not None:
            unset_hf_attention(self.module, self.config)
        else:
            unbind(self.module)


HF_ATTENTION = "hf-attention"  # _find_swap_points' marker of a transformers attention module
SLOT = "kernel-slot"  # _find_swap_points' marker of a module that takes its kernel choice itself


def kernel_op(module: nn.Module) -> str:
    """The op a module computes when its class declares one (``kernel_op``, trnkit's native modules), else ''."""
    return getattr(type(module), "kernel_op", "") or ""


def slot_static(module: nn.Module, op: str) -> list[Violation]:
    """A ``kernel_op`` module's own configuration checks (its ``kernel_static()``) as violations."""
    static = getattr(module, "kernel_static", None)
    return [Violation(f"{op}[native adapter]", *item) for item in static()] if static is not None else []


def _find_swap_points(model: nn.Module, wanted: Sequence[str]) -> Iterator[tuple[str, nn.Module, str, Any]]:
    for path, module in list(model.named_modules()):
        if not path:
            continue
        if kernel_op(module):
            if kernel_op(module) in wanted:
                yield path, module, kernel_op(module), SLOT
            continue
        adapter = module_adapter(module)
        if adapter is not None and adapter.op in wanted:
            yield path, module, adapter.op, adapter
            continue
        if "rope_hf" in wanted and is_rope_attention(module):
            yield path, module, "rope_hf", None
        if "attention" in wanted and is_hf(module, "Attention"):
            yield path, module, "attention", HF_ATTENTION


def _install(path: str, module: nn.Module, op: str, adapter: ModuleAdapter | str | None,
             choice: KernelChoice, probe_only: bool = False) -> _SwapPoint:
    if isinstance(adapter, ModuleAdapter):
        static = adapter.static(module)
    else:
        static = hf_attention_static(module) if adapter == HF_ATTENTION else slot_static(module, op)
    guard = BoundKernel(op, choice, path, static, probe_only)
    if adapter == SLOT:
        previous, module.kernel = module.kernel, guard
        return _SwapPoint(path, op, guard, module, slot=True, previous=previous)
    if adapter == HF_ATTENTION:
        return _SwapPoint(path, op, guard, module, config=set_hf_attention(module, guard))
    bind(module, adapter.forward if adapter is not None else rope_attention_forward, guard)
    return _SwapPoint(path, op, guard, module)


def _default_seq_len(model: nn.Module) -> tuple[int, str]:
    """The dry run's sequence length when ``OverrideConfig.seq_len`` is unset, and where it came from."""
    cfg = getattr(model, "config", None)
    for name in ("max_seq_len", "max_position_embeddings", "seq_len"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value, f"the model config's {name}"
    return 128, "a default"


def _seq_len_note(model: nn.Module, config: OverrideConfig) -> str:
    seq, source = _default_seq_len(model)
    return (f"the validation dry run ran tokens [{config.batch_size}, {seq}] (seq_len unset: {source}); pass "
            "seq_len, the length the model will run, to validate that (calls are checked again at their own shapes)")


def _dry_run_decision(model: nn.Module, config: OverrideConfig) -> tuple[bool, str]:
    """Whether the validation dry run runs (``config.dry_run``; None: unless the model holds DTensor
    parameters), and the report's note when it is skipped for that reason."""
    if config.dry_run is not None:
        return config.dry_run, ""
    sharded = dtensor_names(model.named_parameters())
    if not sharded:
        return True, ""
    # FSDP2's unshard hooks would leave fake unsharded parameters behind; a swap point fed DTensors runs its
    # module's own code, some of it data-dependent (expert dispatch, the chunked loss), which fake tensors cannot run
    return False, (f"validation dry run skipped: {len(sharded)} of the model's parameters are DTensors (sharded by "
                   f"FSDP2 or tensor parallelism; the first: {sharded[0]}), which a forward on fake tensors cannot "
                   "run; the static checks ran and every call checks its inputs (OverrideConfig.dry_run=True "
                   "forces the dry run)")


def _dry_run(model: nn.Module, config: OverrideConfig, points: list[_SwapPoint], device: str | None,
             needs_backward: bool) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    probe = Probe(device, needs_backward)
    seq = config.seq_len or _default_seq_len(model)[0]
    param = next(model.parameters(), None)
    # Swap points of ops that are not being overridden often hold data-dependent code (expert
    # dispatch); give them shape-only stand-ins for the dry run. The norms and the loss keep their own
    # (shape-only) code: a stand-in would run a trnkit op, which has no DTensor rule under tensor
    # parallelism. Eval mode skips aux statistics.
    stand_in = KernelChoice(REFERENCE, "strict")
    state = _module_state(model)
    others = [_install(path, module, op, adapter, stand_in, probe_only=True)
              for path, module, op, adapter in _find_swap_points(model, _STAND_IN_OPS)
              if op not in config.ops and getattr(module, "kernel", None) is None]
    model.eval()
    # every swap point of the model reports to this run's probe (native modules may hold kernels of
    # other ops, e.g. from Qwen3Config.kernels)
    guards = [pt.guard for pt in (*points, *others)]
    guards += [m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), BoundKernel)]
    for guard in guards:
        guard.probe = probe
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), dry_run_rotary(model):
            tokens = torch.zeros(config.batch_size, seq, dtype=torch.long,
                                 device=param.device if param is not None else "cpu")
            # the loss runs only when the forward gets labels
            model(tokens, **({"labels": tokens} if "linear_cross_entropy" in config.ops else {}))
    except TrnkitError:  # a strict impl that cannot serve, a user's constraint function that failed
        raise
    except Exception as exc:
        raise RuntimeError(
            f"trnkit apply_overrides: the validation dry run of {type(model).__name__} on fake tensors "
            f"(tokens [{config.batch_size}, {seq}]) failed: {type(exc).__name__}: {exc}. Pass "
            f"OverrideConfig(dry_run=False) to rely on the static and call-time checks only.") from exc
    finally:
        for guard in guards:
            guard.probe = None
        for pt in reversed(others):
            pt.undo()
        _restore_module_state(state)
    return probe.seen


ModuleState = list[tuple[nn.Module, bool, dict[str, Any], dict[str, Any], dict[str, Any]]]


def _module_state(model: nn.Module) -> ModuleState:
    """Each module's attributes, parameters and buffers (the objects, not copies), for the dry run to leave no
    tensor of its own behind: a module may cache what its forward computed (transformers' longrope rotary
    embedding keeps ``long_inv_freq``, which would be a FakeTensor) or register a buffer; the run also sets
    eval mode. Other state it sets stays, as after a first real forward (transformers' output-capturing hooks
    and the flag saying they are installed)."""
    return [(m, m.training, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in model.modules()]


def _restore_module_state(state: ModuleState) -> None:
    for module, training, attrs, params, buffers in state:
        for name, value in list(module.__dict__.items()):
            if isinstance(value, torch.Tensor) and attrs.get(name) is not value:
                if name in attrs:
                    module.__dict__[name] = attrs[name]
                else:
                    del module.__dict__[name]
        module.training = training  # (a property of torch.compile's OptimizedModule, not in its __dict__)
        for table, saved in ((module._parameters, params), (module._buffers, buffers)):
            table.clear()
            table.update(saved)


def bind_kernels(model: nn.Module, kernels: Mapping[str, KernelChoice | None]) -> int:
    """Give every module of ``model`` that declares a ``kernel_op`` in ``kernels`` that op's choice, bound
    to its path (no dry run: the model may still be on the meta device); ``None`` gives the modules of that
    op back their own torch code. Returns how many modules were set. trnkit's native Qwen3 calls this when
    it is built with ``Qwen3Config.kernels``; it is also how a built native model switches kernels."""
    for op, choice in kernels.items():
        if op not in SWAPPABLE_OPS:
            raise ValueError(f"kernels: unknown op {op!r}; swappable ops are {list(SWAPPABLE_OPS)}")
        if choice is None:
            continue
        if not isinstance(choice, KernelChoice):
            raise TypeError(f"kernels[{op!r}]: expected a KernelChoice, got {type(choice).__name__} "
                            "(or None: the module's own torch code)")
        choice.check_impl(op)
    n = 0
    for path, module in model.named_modules():
        op = kernel_op(module)
        if op in kernels:
            choice = kernels[op]
            module.kernel = None if choice is None else BoundKernel(op, choice, path, slot_static(module, op))
            n += 1
    return n


def apply_overrides(model: nn.Module, config: OverrideConfig | None = None, *,
                    choices: Mapping[str, KernelChoice] | None = None, **kwargs: Any) -> OverrideReport:
    """Give ``model``'s swap points the configured kernels and validate them; returns the report.

    ``kwargs`` build an :class:`OverrideConfig` when ``config`` is omitted. ``choices``: ``{op:
    KernelChoice}`` in place of ``config.ops`` and its impl / policy / block size / lnc (``config`` then
    sizes the dry run only). Under ``strict`` a violated constraint raises
    :class:`OverrideConstraintError` (naming module, op, impl, rule and value) and leaves the model
    unchanged; under ``fallback`` the module keeps its original code for inputs the impl cannot serve
    (warned once per reason); ``off`` swaps nothing.

    trnkit's native modules (``kernel_op``) just take the new choice: applying again switches them, and
    :func:`bind_kernels` with ``None`` gives them their torch code back. transformers' modules are
    swapped; :func:`trnkit.hf.revert` undoes that, and applying again before it is an error.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_overrides: model must be a torch.nn.Module, got {type(model).__name__} {model!r:.80}")
    config = config if config is not None else OverrideConfig(**kwargs)
    if choices is not None:
        for op, choice in choices.items():
            choice.check_impl(op)
        config = dataclasses.replace(config, ops=list(choices), impl={op: c.impl for op, c in choices.items()})
    else:
        choices = config.kernels()
    resolve_dtensor()
    if getattr(model, _STATE_ATTR, None):
        raise RuntimeError("trnkit apply_overrides: overrides are already applied to this model; "
                           "call trnkit.hf.revert(model) first")
    report = OverrideReport(config.policy)
    found = list(_find_swap_points(model, config.ops))
    if config.policy == "off":
        report.rows.extend(OverrideRow(p, op, ORIGINAL, config.impl_for(op), "off", "policy 'off'")
                           for p, _, op, _ in found)
        return report

    points = [_install(path, module, op, adapter, choices[op]) for path, module, op, adapter in found]

    try:  # under strict: configuration problems first, before any dry run
        _raise_if_any([(pt, pt.guard.static) for pt in points])
        params = list(model.parameters())
        device = params[0].device.type if params else None
        needs_backward = any(p.requires_grad for p in params)
        dry_run, skipped = _dry_run_decision(model, config)
        if skipped and points:
            report.notes.append(skipped)
        seen = _dry_run(model, config, points, device, needs_backward) if dry_run and points else {}
        problems = [(pt, [*pt.guard.static, *_unique(seen.get((pt.path, pt.op), []))]) for pt in points]
        if config.seq_len is None and any(seen.values()):  # the refusals may be for a length never run
            report.notes.append(_seq_len_note(model, config))
        _raise_if_any(problems, report.notes)
    except BaseException:
        _undo(points)
        raise
    swaps = [pt for pt in points if not pt.slot]  # a native module just holds its new choice: nothing to undo
    if swaps:
        model.__dict__[_STATE_ATTR] = swaps

    for pt, reasons in problems:
        if reasons:
            reason = pt.guard.warn_fallback(reasons)
            report.rows.append(OverrideRow(pt.path, pt.op, ORIGINAL, pt.guard.impl, "fallback", reason))
        else:
            report.rows.append(OverrideRow(pt.path, pt.op, pt.guard.impl, pt.guard.impl, "swapped",
                                           code=foreign_code(pt.op, pt.guard.impl)))
    return report


def _raise_if_any(problems: list[tuple[_SwapPoint, list[Violation]]], notes: Sequence[str] = ()) -> None:
    """Raise for the swap points under ``strict`` that have problems: the error of the first refused op and
    impl (its modules, its rules), its message then naming each other refused one with its modules and rules,
    and ending with ``notes`` (the report's)."""
    groups: dict[str, list[tuple[_SwapPoint, list[Violation]]]] = {}
    for pt, rs in problems:
        if rs and pt.guard.policy == "strict":
            groups.setdefault(f"{pt.op}[{pt.guard.impl}]", []).append((pt, rs))
    if not groups:
        return
    (_, first), *others = groups.items()
    paths, violations = _where(first)
    reason = "; ".join(str(v) for v in violations)
    for label, group in others:
        other_paths, other = _where(group)
        reason += f". Also refused under strict: {label} at {other_paths}: " + "; ".join(str(v) for v in other)
    reason += "".join(f". Note: {note}" for note in notes)
    pt = first[0][0]
    raise OverrideConstraintError(pt.op, pt.guard.impl, violations, paths, reason)


def _where(group: list[tuple[_SwapPoint, list[Violation]]]) -> tuple[str, list[Violation]]:
    """The refused swap points' paths and their distinct violations."""
    return ", ".join(pt.path for pt, _ in group), _unique([v for _, rs in group for v in rs])


def _unique(vs: list[Violation]) -> list[Violation]:
    return list({str(v): v for v in vs}.values())  # values may be unhashable (shapes as lists)


def _undo(points: Sequence[_SwapPoint]) -> int:
    for pt in reversed(points):
        pt.undo()
    return len(points)


def undo_swaps(model: nn.Module) -> int:
    """Restore every transformers module :func:`apply_overrides` swapped; returns how many were restored
    (public as :func:`trnkit.hf.revert`)."""
    return _undo(model.__dict__.pop(_STATE_ATTR, None) or [])
