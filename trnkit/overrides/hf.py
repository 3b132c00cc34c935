"""trnkit's ``moe_experts`` as a transformers v5 *experts implementation*.

transformers 5.x dispatches every ``@use_experts_implementation`` experts module (``Qwen3MoeExperts``,
...) through ``ALL_EXPERTS_FUNCTIONS`` keyed by ``config._experts_implementation``. After
:func:`register_hf_experts`, a model can select trnkit by name, with no module swapping::

    register_hf_experts()                                   # registers "trnkit"
    model = Qwen3MoeForCausalLM.from_pretrained(path, experts_implementation="trnkit")
    # or: model.set_experts_implementation("trnkit")

The same guard as :func:`~trnkit.overrides.apply.apply_overrides` runs at every call (module
configuration and the kernel's constraints, warn-once fallback to the module's own eager forward, or
a raise under ``strict``). The choice is config-wide (every experts module of the model), there is no
validation dry run and no report; use ``apply_overrides`` for per-module validation and reporting.
"""

from __future__ import annotations

from torch import Tensor, nn

from trnkit.overrides.apply import _Guard, _resolve_dtensor, hf_experts_call, hf_experts_static
from trnkit.overrides.registry import POLICIES, get_impl

__all__ = ["register_hf_experts"]

_GUARD_ATTR = "_trnkit_interface_guards"


def register_hf_experts(name: str = "trnkit", impl: str = "nki", policy: str = "fallback",
                        block_size: int = 128) -> str:
    """Register ``name`` in transformers' ``ALL_EXPERTS_FUNCTIONS``; returns ``name``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: PLC0415  (optional dependency)

    if policy not in POLICIES[:2]:
        raise ValueError(f"register_hf_experts: policy must be 'strict' or 'fallback', got {policy!r}")
    get_impl("moe_experts", impl)  # unknown impl names fail now, listing the registered ones
    _resolve_dtensor()

    def trnkit_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                               top_k_weights: Tensor) -> Tensor:
        guards: dict[str, _Guard] = self.__dict__.setdefault(_GUARD_ATTR, {})
        guard = guards.get(name)
        if guard is None:
            guard = guards[name] = _Guard("moe_experts", impl, policy, type(self).__name__,
                                          hf_experts_static(self))
        out = hf_experts_call(self, guard, block_size, hidden_states, top_k_index, top_k_weights)
        if out is None:  # the class's own (eager) forward, under use_experts_implementation's wrapper
            return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
        return out

    trnkit_experts_forward.__qualname__ = f"trnkit_experts_forward[{name}]"
    ALL_EXPERTS_FUNCTIONS.register(name, trnkit_experts_forward)
    return name
