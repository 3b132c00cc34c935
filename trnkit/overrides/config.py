"""Kernel choices as configuration: :class:`KernelChoice` (one op: impl, policy, MoE block size, LNC, the
attention forward's fixed shift) and
:class:`OverrideConfig` (which ops, and their choices; the library's config and the trainer's
``[overrides]`` section).

A choice is plain data, checked when it is made. trnkit's native Qwen3 takes one per op from its config
(``Qwen3Config.kernels``); :func:`~trnkit.overrides.apply.apply_overrides` and the transformers entry
points (:mod:`trnkit.hf`) build them from an :class:`~trnkit.overrides.apply.OverrideConfig`. Each swap
point holds its choice bound to its module path (:class:`~trnkit.overrides.guard.BoundKernel`), which
passes ``impl``, ``block_size``, ``lnc`` and ``fixed_shift`` to the ``trnkit::`` op as arguments.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from trnkit.kernels.lnc import LNC_VALUES
from trnkit.kernels.moe.constraints import BLOCK_SIZES
from trnkit.overrides.registry import POLICIES, get_impl, shown

__all__ = ["DEFAULT_OPS", "FIXED_SHIFT_OP", "SWAPPABLE_OPS", "KernelChoice", "OverrideConfig", "choice_problems",
           "fixed_shift_problem"]

SWAPPABLE_OPS = ("rope_hf", "router_topk", "moe_experts", "rmsnorm", "linear_cross_entropy", "attention", "mlp")
DEFAULT_OPS = ("rope_hf", "router_topk", "moe_experts")  # OverrideConfig's default selection
FIXED_SHIFT_OP = "attention"  # the one op whose impls may take ``fixed_shift``


def choice_problems(policy: str, block_size: int, lnc: int | None,
                    fixed_shift: bool | None = None) -> list[tuple[str, str]]:
    """``(field, "<rule>, got <value>")`` for each setting outside its range; shared by
    :class:`KernelChoice`, :class:`~trnkit.overrides.apply.OverrideConfig` and the trainer's config check,
    which put the field's name in front."""
    out: list[tuple[str, str]] = []
    if policy not in POLICIES:
        out.append(("policy", f"must be one of {POLICIES}, got {policy!r}"))
    if isinstance(block_size, bool) or block_size not in (0, *BLOCK_SIZES):
        out.append(("block_size", f"must be one of {BLOCK_SIZES}, got {block_size!r} (or 0: the kernel's tuned "
                                  "sizes, forward 512 and backward 128)"))
    if lnc is not None and (isinstance(lnc, bool) or lnc not in (0, *LNC_VALUES)):
        out.append(("lnc", f"must be one of {LNC_VALUES} or None, got {lnc!r} (None or 0: the device default)"))
    if fixed_shift is not None and not isinstance(fixed_shift, bool):
        out.append(("fixed_shift", f"must be true or false (or unset: the impl's default), got {fixed_shift!r} "
                                   "(true: the attention forward with a fixed softmax shift per row, false: the "
                                   "exact row max; docs/kernels.md)"))
    return out


def fixed_shift_problem(op: str, impl: str) -> str | None:
    """Why a set ``fixed_shift`` cannot go with ``impl`` of ``op`` ("<rule>, got <value>"), or None: it is an
    option of the attention forward, and the impl's function must declare a ``fixed_shift`` parameter (the
    built-in ``nki`` impl does; ``reference`` computes the exact softmax and has none)."""
    if op != FIXED_SHIFT_OP:
        return f"applies to the {FIXED_SHIFT_OP!r} op only, got it for op {op!r}"
    if "fixed_shift" not in inspect.signature(get_impl(op, impl).fn).parameters:
        return (f"needs an {op} impl whose function takes fixed_shift (the built-in 'nki'), got impl {impl!r}, "
                "which does not")
    return None


@dataclass(frozen=True)
class KernelChoice:
    """Which implementation of one ``trnkit::`` op a swap point runs, and how.

    ``impl``: a registered impl name (``"nki"``, ``"reference"``, a user's). ``policy``: ``"strict"``
    raises on inputs the impl cannot serve, ``"fallback"`` runs the module's own code for them (warned
    once per reason). ``block_size``: ``moe_experts`` slots per expert block, 0 = the kernel's tuned
    sizes (forward 512, backward 128). ``lnc``: physical cores per launch (1 or 2), 0 = the device
    default (:func:`trnkit.kernels.lnc.default_lnc`). ``fixed_shift``: ``attention`` only, None (unset)
    leaves the impl's default (``nki``: the forward with a fixed softmax shift per row and a per-launch
    fallback to the exact forward, :mod:`trnkit.kernels.attention.flash_fwd_shift`; same results to fp32
    precision); True / False ask for that forward / the exact one and need an impl that takes the option
    (``nki``), checked by :meth:`check_impl`.
    """

    impl: str = "nki"
    policy: str = "strict"
    block_size: int = 0
    lnc: int = 0
    fixed_shift: bool | None = None

    def __post_init__(self) -> None:
        if self.policy == "off":
            raise ValueError("KernelChoice.policy must be 'strict' or 'fallback' (no choice = the module's own code)")
        bad = choice_problems(self.policy, self.block_size, self.lnc, self.fixed_shift)
        if bad:
            raise ValueError(f"KernelChoice.{bad[0][0]} {bad[0][1]}")

    def check_impl(self, op: str) -> None:
        """Unknown impl names fail here, listing the registered ones; so does a set ``fixed_shift`` for an op
        or impl without that option (:func:`fixed_shift_problem`)."""
        get_impl(op, self.impl)
        problem = fixed_shift_problem(op, self.impl) if self.fixed_shift is not None else None
        if problem:
            raise ValueError(f"KernelChoice.fixed_shift={self.fixed_shift} {problem}")


@dataclass
class OverrideConfig:
    """Which ops get a kernel, with which impl, under which policy: the one config of kernel choices,
    used by :func:`~trnkit.overrides.apply.apply_overrides`, the transformers entry points and the
    trainer (its ``[overrides]`` section; there ``seq_len`` and ``batch_size`` are the run's own).

    ``impl`` is one name for every op or ``{op: name}``; ``seq_len``/``batch_size`` size the dry-run
    validation (default: the model config's maximum sequence length, batch 1); ``dry_run``: whether that
    validation runs: None (unset) unless the model holds DTensor parameters (FSDP2 or tensor parallelism, where a
    forward on fake tensors cannot run; the report says it was skipped), True always, False never (the static
    and call-time checks only). ``block_size``:
    ``moe_experts`` slots per expert block, 0 = the kernel's tuned sizes (forward 512, backward 128).
    ``lnc``: physical cores per kernel launch (1, or 2 = a trn2 logical core), passed by each swap point
    to its op; None (or 0): the device default (:func:`trnkit.kernels.lnc.default_lnc`: 2 on a trn2
    logical core, 1 on the interpreter). Both belong to the swap points' :class:`KernelChoice`
    (:meth:`choice`): no process-wide setting is left behind. ``fixed_shift``: the ``attention`` op's
    forward (:class:`KernelChoice`): None (unset) the impl's default (``nki``: a fixed softmax shift per row),
    True that forward, False the exact row max; set, it needs ``"attention"`` in ``ops`` with an impl that
    takes it (``nki``). ``plugins``: modules imported first (they register
    their own impls with :func:`trnkit.overrides.register`).
    """

    ops: list[str] = field(default_factory=lambda: list(DEFAULT_OPS))
    impl: str | dict[str, str] = "nki"
    policy: Literal["strict", "fallback", "off"] = "strict"
    seq_len: int | None = None
    batch_size: int = 1
    dry_run: bool | None = None
    block_size: int = 0
    lnc: int | None = None
    fixed_shift: bool | None = None
    plugins: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.ops, str):  # list("rope_hf") would be its letters
            raise ValueError(f"OverrideConfig.ops must be a list of op names (e.g. [{self.ops!r}]), got str "
                             f"{self.ops!r}")
        self.ops = list(self.ops)
        if isinstance(self.plugins, str) or not all(isinstance(p, str) for p in self.plugins):
            raise ValueError(f"OverrideConfig.plugins must be a list of module names (e.g. ['examples.my_kernels']), "
                             f"got {shown(self.plugins)}")
        if not (isinstance(self.impl, str) or (isinstance(self.impl, Mapping)
                                               and all(isinstance(v, str) for v in self.impl.values()))):
            raise ValueError(f"OverrideConfig.impl must be an impl name or {{op: impl name}}, got {shown(self.impl)}")
        for name in self.plugins:  # user modules that register impls, before the impl names are checked
            importlib.import_module(name)
        problems = dict(choice_problems(self.policy, self.block_size, self.lnc, self.fixed_shift))
        for name in ("lnc", "block_size", "policy", "fixed_shift"):  # the order of the checks' messages
            if name in problems:
                raise ValueError(f"OverrideConfig.{name} {problems[name]}")
        bad = [op for op in self.ops if op not in SWAPPABLE_OPS]
        if bad:
            raise ValueError(f"OverrideConfig.ops: unknown op(s) {bad}; swappable ops are {list(SWAPPABLE_OPS)}")
        twice = sorted({op for op in self.ops if self.ops.count(op) > 1})
        if twice:
            raise ValueError(f"OverrideConfig.ops must name each op once, got {twice} more than once in {self.ops}")
        if self.seq_len is not None and not (isinstance(self.seq_len, int) and self.seq_len >= 1):
            raise ValueError(f"OverrideConfig.seq_len must be a positive int or None, got {self.seq_len!r}")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"OverrideConfig.batch_size must be a positive int, got {self.batch_size!r}")
        if isinstance(self.impl, Mapping):
            extra = sorted(set(self.impl) - set(self.ops))
            if extra:
                raise ValueError(f"OverrideConfig.impl names ops that are not in ops: {extra}")
        for op in self.ops:
            get_impl(op, self.impl_for(op))  # unknown impl names fail here, with the registered ones
        problem = self.fixed_shift_problem()
        if problem:
            raise ValueError(f"OverrideConfig.fixed_shift={self.fixed_shift} {problem}")

    def fixed_shift_problem(self) -> str | None:
        """Why a set ``fixed_shift`` cannot apply to this config's ops ("<rule>, got <value>"), or None."""
        if self.fixed_shift is None or self.policy == "off":
            return None
        if FIXED_SHIFT_OP not in self.ops:
            return f"applies to the {FIXED_SHIFT_OP!r} op, which must be in ops, got ops {self.ops}"
        return fixed_shift_problem(FIXED_SHIFT_OP, self.impl_for(FIXED_SHIFT_OP))

    def impl_for(self, op: str) -> str:
        return self.impl if isinstance(self.impl, str) else self.impl.get(op, "nki")

    def choice(self, op: str) -> KernelChoice:
        """``op``'s :class:`KernelChoice` under this config (policy ``off`` has none)."""
        return KernelChoice(self.impl_for(op), self.policy, self.block_size, self.lnc or 0,
                            self.fixed_shift if op == FIXED_SHIFT_OP else None)

    def kernels(self) -> dict[str, KernelChoice]:
        """``{op: KernelChoice}`` for every op of ``ops`` (empty under policy ``off``): the value of
        ``Qwen3Config.kernels`` that builds a native model with these kernels."""
        return {} if self.policy == "off" else {op: self.choice(op) for op in self.ops}
