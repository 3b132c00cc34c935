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
configuration (activation, weight layout, ...). At every call the same constraint functions run again
(shape/dtype/device only), so a shape that changes mid-run gets the policy's behaviour: ``strict``
raises, ``fallback`` warns once per reason and runs the module's original code.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from trnkit.errors import TrnkitError
from trnkit.kernels.constraints import Violation
from trnkit.kernels.moe import from_hf_v5
from trnkit.overrides import ops
from trnkit.overrides.config import DEFAULT_OPS, SWAPPABLE_OPS, KernelChoice, OverrideConfig
from trnkit.overrides.registry import (
    REFERENCE,
    OverrideConstraintError,
    select,
    warn_once,
)
from trnkit.overrides.report import OverrideReport, OverrideRow

_DTensor: type | None = None  # torch.distributed.tensor.DTensor, resolved by apply_overrides (import is slow)


def _resolve_dtensor() -> None:
    global _DTensor  # noqa: PLW0603 - a lazily imported class, cached
    if _DTensor is None and torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        _DTensor = DTensor

__all__ = ["DEFAULT_OPS", "SWAPPABLE_OPS", "BoundKernel", "OverrideConfig", "apply_overrides", "bind_kernels",
           "undo_swaps"]

_STAND_IN_OPS = ("rope_hf", "router_topk", "moe_experts")  # ops given shape-only stand-ins in the dry run
ORIGINAL = "original"  # report name for "the module's own forward"
_STATE_ATTR = "_trnkit_overrides"  # a transformers model's applied swaps, for trnkit.hf.revert


# ------------------------------------------------------------------------------------------ guard


@dataclass
class _Probe:
    """Collects what the guards see during the fake-tensor dry run."""

    device: str | None
    needs_backward: bool
    seen: dict[str, list[Violation]] = field(default_factory=dict)



class BoundKernel:
    """One swap point's :class:`KernelChoice`, bound to its module path: the call-time decision
    (:meth:`choose`: the impl to run, or None for the module's own code) and the options the swap
    point passes to its op (``lnc``: 0 = the device default; ``block_size``: 0 = the kernel's tuned sizes)."""

    def __init__(self, op: str, choice: KernelChoice, path: str, static: Sequence[Violation] = (),
                 probe_only: bool = False) -> None:
        self.op, self.choice, self.path, self.static = op, choice, path, list(static)
        self.probe_only = probe_only  # a shape-only stand-in used during the dry run
        self.probe: _Probe | None = None  # set while a validation dry run collects what this swap point sees
        self.impl, self.policy = choice.impl, choice.policy
        self.lnc, self.block_size = choice.lnc or 0, choice.block_size

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
            probe.seen.setdefault(self.path, []).extend([*extra, *sel.reasons])
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
        if self.policy == "strict":
            if torch.compiler.is_compiling():
                # torch.compile(fullgraph=True) cannot raise from a graph ("Observed exception");
                # say why first. Without fullgraph dynamo breaks the graph and this raise runs eagerly.
                _announce_strict(self.op, self.impl, "; ".join(str(v) for v in reasons), self.path)
            raise OverrideConstraintError(self.op, self.impl, reasons, self.path)
        self.warn_fallback(reasons)
        return None

    def warn_fallback(self, reasons: Sequence[Violation]) -> str:
        """Warn once per distinct (op, impl, reason) — not per layer or call; returns the reason."""
        reason = "; ".join(str(v) for v in reasons)
        _emit_fallback_warning(self.op, self.impl, reason, self.path)
        return reason


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


def _dtensor_violations(op: str, inputs: Mapping[str, Any]) -> list[Violation]:
    """Sharded (DTensor) inputs, e.g. tensor-parallel expert weights: the kernels see whole tensors."""
    if _DTensor is None:
        return []
    sharded = [name for name, t in inputs.items() if isinstance(t, _DTensor)]
    return [Violation(f"{op}[adapter]", "plain (non-DTensor) inputs", sharded,
                      "the kernels compute on whole local tensors; sharded inputs would need collectives")
            ] if sharded else []


# --------------------------------------------------------------------------------- module adapters


_GUARD = "_trnkit_guard"  # a swapped transformers module's BoundKernel, in its __dict__ beside its forward


def swapped(module: nn.Module) -> bool:
    """Whether ``module`` (a transformers module) runs a trnkit forward bound to it by :func:`apply_overrides`."""
    return _GUARD in module.__dict__


def _original(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's own code: its class's forward."""
    return type(self).forward(self, *args, **kwargs)


def _extra_repr(self: Any) -> str:
    g = self._trnkit_guard
    own = type(self).extra_repr(self)
    return f"{own + ', ' if own else ''}trnkit {g.op}[{g.impl}] policy={g.policy}"


def _rmsnorm_forward(self: Any, x: Tensor) -> Tensor:
    """transformers' Qwen3 norms (``variance_epsilon``)."""
    eps = float(self.variance_epsilon)
    impl = self._trnkit_guard.choose(x=x, weight=self.weight, eps=eps)
    if impl is None:
        return _original(self, x)
    return ops.rmsnorm(x, self.weight, eps, impl, lnc=self._trnkit_guard.lnc)[0]


def _mlp_linears(module: nn.Module) -> tuple[Any, Any, Any]:
    """(gate, up, down) projections of transformers' Qwen3 MLPs."""
    return module.gate_proj, module.up_proj, module.down_proj


def _hf_mlp_forward(self: Any, x: Tensor) -> Tensor:
    """The dense SwiGLU MLP in the compute dtype (the autocast dtype under autocast, as the projections
    would run): ``w_gate_up = cat(gate, up).T`` and ``w_down = down.T`` are views / a copy that autograd
    differentiates back to the ``nn.Linear`` weights."""
    gate, up, down = _mlp_linears(self)
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(x.dtype,
                                                                                                 gate.weight.dtype)
    xc = x.to(dt)
    w_gate_up = torch.cat([gate.weight, up.weight]).to(dt).T
    w_down = down.weight.to(dt).T
    impl = self._trnkit_guard.choose(x=xc, w_gate_up=w_gate_up, w_down=w_down)
    if impl is None:
        return _original(self, x)
    return ops.mlp(xc, w_gate_up, w_down, impl, lnc=self._trnkit_guard.lnc)


def mlp_static(module: nn.Module) -> list[Violation]:
    """The kernel is SiLU-gated with no biases: projections that are bias-free ``nn.Linear`` and (transformers)
    ``hidden_act == "silu"``."""
    label = "mlp[adapter]"
    out = []
    for proj in _mlp_linears(module):
        if not isinstance(proj, nn.Linear) or proj.bias is not None:
            out.append(Violation(label, "gate / up / down are nn.Linear without bias", type(proj).__name__,
                                 "the kernel reads the projections' weights and has no bias term"))
            break
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act != "silu":
        out.append(Violation(label, "hidden_act == 'silu'", act, "the kernel's gate activation is SiLU"))
    return out


def _hf_router_forward(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x = hidden_states.reshape(-1, self.hidden_dim)
    impl = self._trnkit_guard.choose(x=x, w_router=self.weight, top_k=self.top_k,
                                     norm_topk_prob=self.norm_topk_prob)
    if impl is None:
        return _original(self, hidden_states)
    weights, idx, logits = ops.router_topk(x, self.weight, self.top_k, self.norm_topk_prob, impl)
    # transformers returns (logits, scores, indices) in the activation dtype.
    return logits.to(x.dtype), weights.to(x.dtype), idx.long()


def _hf_sigmoid_router_forward(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' DeepSeek-V3 / GLM-4-MoE ``TopkRouter``: fp32 logits, sigmoid scores, selection by
    ``scores + e_score_correction_bias``, ``sum + 1e-20`` renormalisation, ``routed_scaling_factor``."""
    x = hidden_states.reshape(-1, self.hidden_dim).float()  # transformers routes in fp32
    w, bias, scale = self.weight.float(), self.e_score_correction_bias, float(self.routed_scaling_factor)
    impl = self._trnkit_guard.choose(x=x, w_router=w, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                                     scoring="sigmoid", selection_bias=bias, routed_scaling_factor=scale)
    if impl is None:
        return _original(self, hidden_states)
    weights, idx, logits = ops.router_topk(x, w, self.top_k, self.norm_topk_prob, impl, "sigmoid", bias, scale)
    return logits, weights, idx.long()  # as transformers: (logits, weights, indices), fp32


def hf_sigmoid_router_static(module: nn.Module) -> list[Violation]:
    """Group-limited routing (``n_group > 1`` groups of which only ``topk_group`` are searched) is not
    in the kernel; with one group, or every group searched, the selection is the plain top-K."""
    n_group, topk_group = getattr(module, "num_group", 1), getattr(module, "topk_group", 1)
    if n_group > 1 and topk_group < n_group:
        return [Violation("router_topk[hf adapter]", "n_group == 1 or topk_group == n_group",
                          {"n_group": n_group, "topk_group": topk_group},
                          "group-limited routing (top-K only inside the best topk_group expert groups) is "
                          "not implemented by the kernel")]
    return []


def hf_experts_call(module: nn.Module, guard: BoundKernel, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor | None:
    """trnkit::moe_experts for a transformers v5 experts module; None = the guard chose its own code."""
    # [E, 2I, H] / [E, H, I] -> kernel layout [E, H, 2I] / [E, I, H]; views for the check, copies to run.
    impl = guard.choose(x=hidden_states, topk_idx=top_k_index, topk_weights=top_k_weights,
                        w_gate_up=module.gate_up_proj.transpose(1, 2), w_down=module.down_proj.transpose(1, 2),
                        **ops.block_size_kw(guard.block_size))
    if impl is None:
        return None
    w_gate_up, w_down = from_hf_v5(module.gate_up_proj, module.down_proj)  # the one layout converter
    return ops.moe_experts(hidden_states, top_k_index, top_k_weights, w_gate_up, w_down, guard.block_size, impl,
                           lnc=guard.lnc)


def _hf_experts_forward(self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    out = hf_experts_call(self, self._trnkit_guard, hidden_states, top_k_index, top_k_weights)
    return _original(self, hidden_states, top_k_index, top_k_weights) if out is None else out


def deinterleave(t: Tensor) -> Tensor:
    """GPT-OSS's interleaved last dim ``[g0, u0, g1, u1, ...]`` -> the kernel's halves ``[g | u]``
    (a differentiable copy: gradients reach the module's own parameters)."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _hf_gpt_oss_experts_forward(self: Any, hidden_states: Tensor, router_indices: Tensor | None = None,
                                routing_weights: Tensor | None = None) -> Tensor:
    """transformers' ``GptOssExperts``: ``gate_up_proj [E, H, 2I]`` with interleaved gate / up columns
    and ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]`` + ``down_proj_bias [E, H]``, clamped
    SwiGLU ``(clamp(up) + 1) * gate * sigmoid(alpha * gate)`` (``self.limit``, ``self.alpha``); the
    routing weights scale the biased expert output, as transformers does."""
    variant = dict(activation="swiglu_clamped", limit=float(self.limit), alpha=float(self.alpha))
    w_gate_up, b_gate_up = self.gate_up_proj, self.gate_up_proj_bias
    guard = self._trnkit_guard
    impl = guard.choose(x=hidden_states, topk_idx=router_indices, topk_weights=routing_weights,
                        w_gate_up=w_gate_up, w_down=self.down_proj, **ops.block_size_kw(guard.block_size),
                        b_gate_up=b_gate_up, b_down=self.down_proj_bias, **variant)
    if impl is None:
        return _original(self, hidden_states, router_indices, routing_weights)
    return ops.moe_experts(hidden_states, router_indices, routing_weights, deinterleave(w_gate_up), self.down_proj,
                           guard.block_size, impl, variant["activation"], variant["limit"], variant["alpha"],
                           deinterleave(b_gate_up), self.down_proj_bias, lnc=guard.lnc)


def gpt_oss_experts_static(module: nn.Module) -> list[Violation]:
    """The GPT-OSS adapter reads the interleaved fused layout with biases; expert parallelism is not served."""
    if getattr(module, "_is_expert_parallel", False):
        return [Violation("moe_experts[gpt-oss adapter]", "no expert parallelism", True,
                          "expert-parallel dispatch is not supported by this adapter")]
    return []


def hf_experts_static(module: nn.Module) -> list[Violation]:
    """Module-configuration checks of the fused-[gate;up] SiLU adapter (Qwen3-MoE, DeepSeek-V3, GLM-4-MoE)."""
    label = "moe_experts[hf adapter]"
    cfg = getattr(module, "config", None)
    act = getattr(cfg, "hidden_act", "silu")
    checks = [
        (act in ("silu", "swish"), "hidden_act == 'silu'", act, "this adapter passes activation='silu'"),
        (not getattr(module, "has_bias", False), "no expert bias", True,
         "this adapter passes no biases (GPT-OSS experts are swapped by apply_overrides)"),
        (getattr(module, "has_gate", True), "gated experts", False, "the kernel needs gate_up_proj"),
        (getattr(module, "is_concatenated", True), "gate_up_proj = [gate; up]", "interleaved",
         "the kernel splits gate and up as two halves"),
        (not getattr(module, "is_transposed", False), "gate_up_proj [E, 2I, H]", "transposed",
         "from_hf_v5 expects the untransposed v5 layout"),
        (not getattr(module, "_is_expert_parallel", False), "no expert parallelism", True,
         "expert-parallel dispatch is not supported by this adapter"),
    ]
    return [Violation(label, rule, value, why) for ok, rule, value, why in checks if not ok]


@dataclass(frozen=True)
class _ModuleAdapter:
    op: str
    forward: Callable[..., Any]
    static: Callable[[nn.Module], list[Violation]] = lambda m: []


# transformers classes whose math the adapters were checked against (5.24). Other models' look-alike
# classes (Qwen3-Next partial rotary, VL mrope, ...) are left alone rather than guessed at.
_HF_CLASSES = {
    "RMSNorm": {("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
                ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeRMSNorm")},
    "Attention": {("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"),
                  ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention")},
    "TopKRouter": {("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter")},
    "MLP": {("transformers.models.qwen3.modeling_qwen3", "Qwen3MLP"),
            ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeMLP")},
    "SigmoidRouter": {("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter"),
                      ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeTopkRouter")},
    # GPT-OSS's router is not matched: its logits have a bias (router.bias), which router_topk has no
    # term for (top-K of the logits + softmax over the K equals softmax + top-K + renormalisation)
    "GptOssExperts": {("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts")},
    "Experts": {("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts"),
                ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Experts"),
                ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeExperts")},
}


def _is_hf(module: nn.Module, kind: str) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__name__) in _HF_CLASSES[kind]


def _module_adapter(module: nn.Module) -> _ModuleAdapter | None:
    if swapped(module):
        return None
    if _is_hf(module, "MLP"):
        return _ModuleAdapter("mlp", _hf_mlp_forward, mlp_static)
    if _is_hf(module, "RMSNorm"):
        return _ModuleAdapter("rmsnorm", _rmsnorm_forward)
    if _is_hf(module, "TopKRouter"):
        return _ModuleAdapter("router_topk", _hf_router_forward)
    if _is_hf(module, "SigmoidRouter"):
        return _ModuleAdapter("router_topk", _hf_sigmoid_router_forward, hf_sigmoid_router_static)
    if _is_hf(module, "Experts"):
        return _ModuleAdapter("moe_experts", _hf_experts_forward, hf_experts_static)
    if _is_hf(module, "GptOssExperts"):
        return _ModuleAdapter("moe_experts", _hf_gpt_oss_experts_forward, gpt_oss_experts_static)
    return None


def _bind(module: nn.Module, forward: Callable[..., Any], guard: BoundKernel) -> None:
    """``forward`` (and a repr naming the kernel) as this one module's own methods, as Liger-Kernel swaps a
    module's forward: the class, the parameters and ``state_dict`` stay, other instances are untouched."""
    module.__dict__.update(forward=types.MethodType(forward, module), extra_repr=types.MethodType(_extra_repr, module))
    module.__dict__[_GUARD] = guard


def _unbind(module: nn.Module) -> None:
    for name in ("forward", "extra_repr", _GUARD):
        module.__dict__.pop(name, None)


# ------------------------------------------------------------------------- transformers' rotary call site


def _is_hf_rope_attention(module: nn.Module) -> bool:
    return _is_hf(module, "Attention") and not swapped(module)


def _hf_rope(self: Any, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """trnkit's ``rope_hf`` at the rotary call site of a transformers attention module: q/k ``[B, S, H, D]``
    (the projections' own layout: the kernel's bshd form reads it with no copy), cos/sin ``[B, S, D]``;
    returns q/k ``[B, H, S, D]`` as transformers' ``apply_rotary_pos_emb`` does."""
    tables = (cos, sin)
    if cos.dim() == 3 and cos.shape[0] == 1:  # positions shared by the batch: [1, S, D] -> [S, D]
        cos, sin = cos[0], sin[0]
    impl = self._trnkit_guard.choose(q=q, k=k, cos=cos, sin=sin, layout="bshd")
    if impl is None:
        return _hf_modeling(self).apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *tables)
    q_out, k_out = ops.rope_hf_apply(q, k, cos, sin, None, "bshd", False, impl)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _hf_modeling(module: nn.Module) -> Any:
    """The transformers modeling module of ``module``'s class (its ``apply_rotary_pos_emb``, attention registry)."""
    return sys.modules[type(module).__module__]


def _hf_rope_attention_forward(self: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                               attention_mask: Tensor | None, cache: Any = None, **kwargs: Any) -> tuple[Tensor, Any]:
    """transformers' ``Qwen3Attention`` / ``Qwen3MoeAttention`` forward (5.24, the classes of
    ``_HF_CLASSES["Attention"]``; the parity tests compare it with theirs) with :func:`_hf_rope` at the
    rotary call site, bound to one module: transformers' module-level ``apply_rotary_pos_emb`` stays
    theirs, so other models are untouched."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the argument's old name (transformers maps it until 5.40)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
    k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    q, k = _hf_rope(self, q, k, *position_embeddings)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    modeling = _hf_modeling(self)
    attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                               modeling.eager_attention_forward)
    dropout = 0.0 if not self.training else self.attention_dropout
    out, weights = attention(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling,
                             sliding_window=self.sliding_window, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


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
            from trnkit.overrides.hf import unset_hf_attention  # hf imports this module

            unset_hf_attention(self.module, self.config)
        else:
            _unbind(self.module)


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
        adapter = _module_adapter(module)
        if adapter is not None and adapter.op in wanted:
            yield path, module, adapter.op, adapter
            continue
        if "rope_hf" in wanted and _is_hf_rope_attention(module):
            yield path, module, "rope_hf", None
        if "attention" in wanted and _is_hf(module, "Attention"):
            yield path, module, "attention", HF_ATTENTION


def _install(path: str, module: nn.Module, op: str, adapter: _ModuleAdapter | str | None,
             choice: KernelChoice, probe_only: bool = False) -> _SwapPoint:
    static = adapter.static(module) if isinstance(adapter, _ModuleAdapter) else slot_static(module, op)
    guard = BoundKernel(op, choice, path, static, probe_only)
    if adapter == SLOT:
        previous, module.kernel = module.kernel, guard
        return _SwapPoint(path, op, guard, module, slot=True, previous=previous)
    if adapter == HF_ATTENTION:
        from trnkit.overrides.hf import set_hf_attention  # hf imports this module

        return _SwapPoint(path, op, guard, module, config=set_hf_attention(module, guard))
    _bind(module, adapter.forward if adapter is not None else _hf_rope_attention_forward, guard)
    return _SwapPoint(path, op, guard, module)


def _default_seq_len(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for name in ("max_seq_len", "max_position_embeddings", "seq_len"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 128


def _dry_run(model: nn.Module, config: OverrideConfig, points: list[_SwapPoint], device: str | None,
             needs_backward: bool) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    probe = _Probe(device, needs_backward)
    seq = config.seq_len or _default_seq_len(model)
    param = next(model.parameters(), None)
    # Swap points of ops that are not being overridden often hold data-dependent code (expert
    # dispatch); give them shape-only stand-ins for the dry run. The norms and the loss keep their own
    # (shape-only) code: a stand-in would run a trnkit op, which has no DTensor rule under tensor
    # parallelism. Eval mode skips aux statistics.
    stand_in = KernelChoice(REFERENCE, "strict")
    others = [_install(path, module, op, adapter, stand_in, probe_only=True)
              for path, module, op, adapter in _find_swap_points(model, _STAND_IN_OPS)
              if op not in config.ops and getattr(module, "kernel", None) is None]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    # every swap point of the model reports to this run's probe (native modules may hold kernels of
    # other ops, e.g. from Qwen3Config.kernels)
    guards = [pt.guard for pt in (*points, *others)]
    guards += [m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), BoundKernel)]
    for guard in guards:
        guard.probe = probe
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
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
        for m, training in modes:
            m.training = training
        for pt in reversed(others):
            pt.undo()
    return probe.seen


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
    config = config if config is not None else OverrideConfig(**kwargs)
    if choices is not None:
        for op, choice in choices.items():
            choice.check_impl(op)
        config = dataclasses.replace(config, ops=list(choices), impl={op: c.impl for op, c in choices.items()})
    else:
        choices = config.kernels()
    _resolve_dtensor()
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
        seen = _dry_run(model, config, points, device, needs_backward) if config.dry_run and points else {}
        problems = [(pt, [*pt.guard.static, *_unique(seen.get(pt.path, []))]) for pt in points]
        _raise_if_any(problems)
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
            report.rows.append(OverrideRow(pt.path, pt.op, pt.guard.impl, pt.guard.impl, "swapped"))
    return report


def _raise_if_any(problems: list[tuple[_SwapPoint, list[Violation]]]) -> None:
    """Raise for the swap points under ``strict`` that have problems."""
    bad = [(pt, rs) for pt, rs in problems if rs and pt.guard.policy == "strict"]
    if bad:
        pt, _ = bad[0]
        raise OverrideConstraintError(pt.op, pt.guard.impl, [v for _, rs in bad for v in rs],
                                      ", ".join(p.path for p, _ in bad))


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
