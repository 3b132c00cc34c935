"""Constraint-checked kernel swaps as ``torch.library`` ops, with user-attachable kernels.

- :mod:`.registry`: ``register`` / ``select`` / ``list_impls`` (impls per op, policies).
- :mod:`.ops`: the ``trnkit::`` custom ops (``torch.ops.trnkit.*``).
- :mod:`.config`: ``KernelChoice`` (impl, policy, MoE block size, LNC: one op's kernel, as data) and
  ``OverrideConfig`` (the one config of kernel choices: the library's and the trainer's ``[overrides]``).
- :mod:`.apply`: ``apply_overrides(model, config) -> OverrideReport`` and ``bind_kernels`` (a native model's
  kernel choices); ``trnkit.hf.revert`` undoes the swaps of a transformers model.
- :mod:`.guard`: ``BoundKernel``, a swap point's choice at call time (constraints, policy).
- :mod:`.hf_modules`: the transformers module adapters and the per-instance forward they are bound as.
- :mod:`.hf`: ``register_hf_experts()`` / ``register_hf_attention()`` — trnkit as a transformers v5
  ``experts_implementation`` / ``attn_implementation``.
"""

from trnkit.overrides.registry import (  # registry first: the others build on it
    OPS,
    POLICIES,
    REFERENCE,
    ImplEntry,
    OverrideConstraintError,
    RegistrationError,
    Selection,
    get_impl,
    list_impls,
    register,
    reset_warnings,
    select,
    unregister,
)
from trnkit.overrides import ops
from trnkit.overrides.builtins import NKI, register_builtins
from trnkit.overrides.config import KernelChoice
from trnkit.overrides.guard import BoundKernel
from trnkit.overrides.apply import (
    DEFAULT_OPS,
    SWAPPABLE_OPS,
    OverrideConfig,
    apply_overrides,
    bind_kernels,
)
from trnkit.overrides.report import OverrideReport, OverrideRow
from trnkit.overrides.hf import register_hf_attention, register_hf_experts

register_builtins()

__all__ = [
    "NKI",
    "OPS",
    "POLICIES",
    "REFERENCE",
    "DEFAULT_OPS",
    "SWAPPABLE_OPS",
    "BoundKernel",
    "ImplEntry",
    "KernelChoice",
    "OverrideConfig",
    "OverrideConstraintError",
    "OverrideReport",
    "OverrideRow",
    "RegistrationError",
    "Selection",
    "apply_overrides",
    "bind_kernels",
    "get_impl",
    "list_impls",
    "ops",
    "register",
    "register_hf_attention",
    "register_hf_experts",
    "reset_warnings",
    "select",
    "unregister",
]
