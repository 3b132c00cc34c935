"""trnkit's ops inside transformers v5 through its registries: ``moe_experts`` as an *experts
implementation* and ``attention`` as an *attention function*.

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

import copy
import sys
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from trnkit.kernels.constraints import Violation, check
from trnkit.kernels.lnc import lnc_violations
from trnkit.overrides import ops
from trnkit.overrides.guard import BoundKernel, autocast_operands, resolve_dtensor
from trnkit.overrides.hf_modules import hf_experts_call, hf_experts_static
from trnkit.overrides.config import KernelChoice
from trnkit.overrides.registry import POLICIES, get_impl

__all__ = ["register_hf_attention", "register_hf_experts"]

_GUARD_ATTR = "_trnkit_interface_guards"


def _named_guard(module: nn.Module, name: str, op: str, choice: KernelChoice,
                 static: Callable[[nn.Module], list[Violation]] | None = None) -> BoundKernel:
    """The guard of ``module`` for the function registered as ``name``: one per module and name, made anew when
    ``name`` was registered again with another choice (impl, policy, ...) since the module last ran."""
    guards: dict[str, BoundKernel] = module.__dict__.setdefault(_GUARD_ATTR, {})
    guard = guards.get(name)
    if guard is None or guard.choice != choice:
        guard = guards[name] = BoundKernel(op, choice, type(module).__name__, static(module) if static else ())
    return guard


def register_hf_experts(name: str = "trnkit", impl: str = "nki", policy: str = "fallback",
                        block_size: int = 0, lnc: int | None = None) -> str:
    """Register ``name`` in transformers' ``ALL_EXPERTS_FUNCTIONS``; returns ``name``. ``block_size`` (0: the
    kernel's tuned sizes) and ``lnc`` (physical cores per launch; None: the device default) are passed to
    ``trnkit::moe_experts``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # optional dependency

    if policy not in POLICIES[:2]:
        raise ValueError(f"register_hf_experts: policy must be 'strict' or 'fallback', got {policy!r}")
    get_impl("moe_experts", impl)  # unknown impl names fail now, listing the registered ones
    check(lnc_violations(lnc))
    choice = KernelChoice(impl, policy, block_size, lnc or 0)
    resolve_dtensor()

    def trnkit_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                               top_k_weights: Tensor) -> Tensor:
        guard = _named_guard(self, name, "moe_experts", choice, hf_experts_static)
        out = hf_experts_call(self, guard, hidden_states, top_k_index, top_k_weights)
        if out is None:  # the class's own (eager) forward, under use_experts_implementation's wrapper
            return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
        return out

    trnkit_experts_forward.__qualname__ = f"trnkit_experts_forward[{name}]"
    ALL_EXPERTS_FUNCTIONS.register(name, trnkit_experts_forward)
    return name


# ----------------------------------------------------------------------------------------- attention
# transformers' attention modules (Qwen3Attention, ...) call
# ``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)(self, q, k, v, mask, ...)``
# with q, k, v in [B, H, S, D]; the function returns ``(o [B, S, H, D], weights or None)``.

_ATTN_GUARD = "_trnkit_attention_guard"  # set on a module by apply_overrides (its own guard)
_ATTN_FALLBACK = "_trnkit_attention_fallback"  # the attention implementation the module had
_ATTN_MARK = "_trnkit_attention"  # set on the attention functions register_hf_attention registers


def _fallback_forward(module: nn.Module, implementation: str) -> Any:
    """transformers' attention function ``implementation`` (its module's own eager one for "eager")."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


def _attention_guard(module: nn.Module, name: str, choice: KernelChoice) -> BoundKernel:
    guard = module.__dict__.get(_ATTN_GUARD)  # set by apply_overrides; else selected by name (attn_implementation=...)
    return guard if guard is not None else _named_guard(module, name, "attention", choice)


def _call_violations(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None, dropout: float,
                     sliding_window: int | None, kwargs: dict[str, Any]) -> list[Violation]:
    """What of one transformers attention call the kernel (causal softmax attention of q, k, v of one length,
    no mask, no weights returned) does not compute."""
    if kwargs.get("s_aux") is not None:  # sdpa, the fallback, ignores them too: no policy gives a right result
        raise ValueError(f"trnkit attention: {type(module).__name__} passes attention sinks (s_aux), which neither "
                         "trnkit::attention nor its sdpa fallback computes; select attn_implementation='eager' for "
                         "this model")
    out = []
    if attention_mask is not None:
        out.append(Violation("attention", "attention_mask is None (causal, no padding mask)",
                             f"a {tuple(attention_mask.shape)} mask", "the kernel applies the causal mask "
                             "itself; pad-free batches under sdpa / 'trnkit' masks pass None"))
    if dropout:
        out.append(Violation("attention", "dropout == 0", dropout))
    if sliding_window:
        out.append(Violation("attention", "sliding_window is None", sliding_window))
    if key.shape[-2] != query.shape[-2]:
        out.append(Violation("attention", "query and key of one length (no KV-cache decoding step)",
                             {"query": query.shape[-2], "key": key.shape[-2]}, "the op's q, k and v share S: "
                             "the kernel's causal mask aligns query i with key i"))
    is_causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        out.append(Violation("attention", "is_causal", False, "the kernel computes causal attention only; "
                             "this call's is not (the module's is_causal or the is_causal argument)"))
    for term in ("softcap", "position_bias"):  # sdpa, the fallback, raises for a softcap itself
        value = kwargs.get(term)
        if value is not None:
            out.append(Violation("attention", f"{term} is None", f"a {tuple(value.shape)} tensor"
                                 if isinstance(value, Tensor) else value, "the kernel has no such term"))
    if kwargs.get("output_attentions"):
        out.append(Violation("attention", "output_attentions is False", True, "the kernel returns no weights"))
    return out


def _attention_forward(name: str, choice: KernelChoice) -> Any:
    """transformers' attention function ``name``: each module's own guard (set by apply_overrides), else one
    per module built from ``choice`` (register_hf_attention's arguments, held here rather than in a global)."""
    def trnkit_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                 attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                                 sliding_window: int | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        guard = _attention_guard(module, name, choice)
        extra = _call_violations(module, query, key, attention_mask, dropout, sliding_window, kwargs)
        q, k, v = autocast_operands(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        impl = guard.choose(extra, q=q, k=k, v=v, scale=scale)
        if impl is None:
            fallback = _fallback_forward(module, module.__dict__.get(_ATTN_FALLBACK, "sdpa"))
            return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            sliding_window=sliding_window, **kwargs)
        return ops.attention(q, k, v, scale, impl, lnc=guard.lnc, fixed_shift=guard.fixed_shift)[0], None

    trnkit_attention_forward.__qualname__ = f"trnkit_attention_forward[{name}]"
    setattr(trnkit_attention_forward, _ATTN_MARK, True)
    return trnkit_attention_forward


def register_hf_attention(name: str = "trnkit", impl: str = "nki", policy: str = "fallback",
                          lnc: int | None = None, fixed_shift: bool | None = None) -> str:
    """Register ``name`` in transformers' ``AttentionInterface`` (and sdpa's causal mask under the same
    name, so pad-free causal batches pass no mask); returns ``name``. Then
    ``from_pretrained(..., attn_implementation="trnkit")`` runs every attention through ``trnkit::attention``
    with ``impl``; a call it cannot serve (a padding mask, dropout, a sliding window, non-causal attention, a
    KV-cache decoding step, a softcap or position bias, ``output_attentions``, a constraint) raises under
    ``strict`` or falls back to sdpa with a warning under ``fallback``; attention sinks (``s_aux``) raise.
    ``lnc``: physical cores per launch (None: the device default). ``fixed_shift``: None the impl's default
    (``nki``: a fixed softmax shift per row), True / False that forward / the exact row max
    (:class:`~trnkit.overrides.KernelChoice`; set, it needs an impl that takes it, ``nki``)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if policy not in POLICIES[:2]:
        raise ValueError(f"register_hf_attention: policy must be 'strict' or 'fallback', got {policy!r}")
    get_impl("attention", impl)  # unknown impl names fail now, listing the registered ones
    check(lnc_violations(lnc))
    resolve_dtensor()
    choice = KernelChoice(impl, policy, lnc=lnc or 0, fixed_shift=fixed_shift)
    choice.check_impl("attention")
    ALL_ATTENTION_FUNCTIONS.register(name, _attention_forward(name, choice))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


def set_hf_attention(module: nn.Module, guard: BoundKernel) -> Any:
    """apply_overrides' swap of one transformers attention module: its own config copy selects
    ``"trnkit"`` and ``guard`` decides each call; returns the original config (for the undo)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = "trnkit"
    if name not in ALL_ATTENTION_FUNCTIONS:
        register_hf_attention(name)
    original = module.__dict__["config"]
    own = copy.copy(original)
    own._attn_implementation = name
    fallback = original._attn_implementation or "sdpa"
    if getattr(ALL_ATTENTION_FUNCTIONS.get(fallback), _ATTN_MARK, False):
        fallback = "sdpa"  # a model that selected trnkit's attention by name: its fallback, not itself
    module.__dict__.update({"config": own, _ATTN_GUARD: guard, _ATTN_FALLBACK: fallback})
    return original


def unset_hf_attention(module: nn.Module, original: Any) -> None:
    module.__dict__["config"] = original
    module.__dict__.pop(_ATTN_GUARD, None)
    module.__dict__.pop(_ATTN_FALLBACK, None)
