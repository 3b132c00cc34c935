"""transformers v5 modules as swap points: the adapters (a trnkit forward per matched class, checked against
transformers 5.24), their static checks, and how a forward is bound to one module instance.

A matched module keeps its object and class and gets the adapter's ``forward`` (and a repr naming the
kernel) as instance attributes, as Liger-Kernel swaps a module's forward: ``isinstance``, ``state_dict``
and transformers' class-keyed hooks (router-logit capture for the aux loss, ``_init_weights``) are
unchanged, and other instances and models are untouched. A trnkit module built from the weights in its
place would lose those class-keyed hooks.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from trnkit.kernels.constraints import Violation
from trnkit.kernels.moe import from_hf_v5
from trnkit.overrides import ops
from trnkit.overrides.guard import BoundKernel, paired_head_norms, wrapped_projections

__all__ = ["ModuleAdapter", "bind", "deinterleave", "dry_run_rotary", "hf_attention_static", "hf_experts_call",
           "hf_experts_static", "is_hf", "is_rope_attention", "module_adapter", "rope_attention_forward", "swapped",
           "unbind"]

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


def _linear_dtype(x: Tensor, w: Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, w)`` computes and returns: the autocast dtype under autocast, else the promoted one."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(x.dtype, w.dtype)


def _mlp_linears(module: nn.Module) -> tuple[Any, Any, Any]:
    """(gate, up, down) projections of transformers' Qwen3 MLPs."""
    return module.gate_proj, module.up_proj, module.down_proj


def _hf_mlp_forward(self: Any, x: Tensor) -> Tensor:
    """The dense SwiGLU MLP in the compute dtype (the autocast dtype under autocast, as the projections
    would run): ``w_gate_up = cat(gate, up).T`` and ``w_down = down.T`` are views / a copy that autograd
    differentiates back to the ``nn.Linear`` weights."""
    gate, up, down = _mlp_linears(self)
    wrapped = wrapped_projections("mlp[adapter]", {"gate_proj": gate, "up_proj": up, "down_proj": down})
    if wrapped:  # a wrapper set since the swap (LoRA, ...): only the module's own forward runs it
        self._trnkit_guard.refuse(wrapped)
        return _original(self, x)
    dt = _linear_dtype(x, gate.weight)
    xc = x.to(dt)
    w_gate_up = torch.cat([gate.weight, up.weight]).to(dt).T
    w_down = down.weight.to(dt).T
    impl = self._trnkit_guard.choose(x=xc, w_gate_up=w_gate_up, w_down=w_down)
    if impl is None:
        return _original(self, x)
    return ops.mlp(xc, w_gate_up, w_down, impl, lnc=self._trnkit_guard.lnc)


def mlp_static(module: nn.Module) -> list[Violation]:
    """The kernel is SiLU-gated with no biases: projections that are bias-free ``nn.Linear`` (not wrapped:
    :func:`~trnkit.overrides.guard.wrapped_projections`) and (transformers) ``hidden_act == "silu"``."""
    label = "mlp[adapter]"
    gate, up, down = _mlp_linears(module)
    out = wrapped_projections(label, {"gate_proj": gate, "up_proj": up, "down_proj": down})
    if not out and any(proj.bias is not None for proj in (gate, up, down)):
        out.append(Violation(label, "gate / up / down are nn.Linear without bias", "bias",
                             "the kernel reads the projections' weights and has no bias term"))
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act != "silu":
        out.append(Violation(label, "hidden_act == 'silu'", act, "the kernel's gate activation is SiLU"))
    return out


def _hf_router_forward(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' ``Qwen3MoeTopKRouter``: ``logits = F.linear(x, weight)`` in the compute dtype (the autocast
    dtype under autocast), softmax in fp32, top-K, renormalisation, ``(logits, weights, indices)`` in the
    logits' dtype. The kernel gets x and the weight in that dtype, as autocast hands them to ``F.linear``. In
    fp32 its selection and weights are returned. In a lower dtype the kernel routes from its logits rounded to
    it, as transformers does, but transformers picks among equal logits (frequent at bf16's 8 bits) in
    ``torch.topk``'s order, not the kernel's lower-index rule: its softmax / top-K / renormalisation run on the
    kernel's logits (T x E elementwise work; the gradient reaches x and the weight through the kernel's
    backward)."""
    x = hidden_states.reshape(-1, self.hidden_dim)
    dt = _linear_dtype(x, self.weight)
    xc, w = x.to(dt), self.weight.to(dt)
    impl = self._trnkit_guard.choose(x=xc, w_router=w, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob)
    if impl is None:
        return _original(self, hidden_states)
    weights, idx, logits = ops.router_topk(xc, w, self.top_k, self.norm_topk_prob, impl, lnc=self._trnkit_guard.lnc)
    if dt == logits.dtype:
        return logits, weights, idx.long()
    logits = logits.to(dt)  # exact: what transformers' F.linear returns
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, idx = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(dt), idx


def _hf_sigmoid_router_forward(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' DeepSeek-V3 / GLM-4-MoE ``TopkRouter``: fp32 logits, sigmoid scores, selection by
    ``scores + e_score_correction_bias``, ``sum + 1e-20`` renormalisation, ``routed_scaling_factor``."""
    x = hidden_states.reshape(-1, self.hidden_dim).float()  # transformers routes in fp32
    w, bias, scale = self.weight.float(), self.e_score_correction_bias, float(self.routed_scaling_factor)
    impl = self._trnkit_guard.choose(x=x, w_router=w, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                                     scoring="sigmoid", selection_bias=bias, routed_scaling_factor=scale)
    if impl is None:
        return _original(self, hidden_states)
    weights, idx, logits = ops.router_topk(x, w, self.top_k, self.norm_topk_prob, impl, "sigmoid", bias, scale,
                                           lnc=self._trnkit_guard.lnc)
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


def hf_attention_static(module: nn.Module) -> list[Violation]:
    """The ``attention`` swap point of a transformers attention module: the kernel has no dropout, and the module
    drops attention weights with ``attention_dropout`` whenever it is in training mode. The validation dry run
    runs in eval mode (no dropout), so this is checked here, on the module's configuration."""
    p = float(getattr(module, "attention_dropout", 0.0) or 0.0)
    if p:
        return [Violation("attention[hf adapter]", "attention_dropout == 0", p,
                          "the kernel has no dropout; transformers drops attention weights with this probability "
                          "in training mode (for eval-only use set the module's attention_dropout to 0: eval "
                          "never drops)")]
    return []


@dataclass(frozen=True)
class ModuleAdapter:
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


def is_hf(module: nn.Module, kind: str) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__name__) in _HF_CLASSES[kind]


def module_adapter(module: nn.Module) -> ModuleAdapter | None:
    if swapped(module):
        return None
    if is_hf(module, "MLP"):
        return ModuleAdapter("mlp", _hf_mlp_forward, mlp_static)
    if is_hf(module, "RMSNorm"):
        return ModuleAdapter("rmsnorm", _rmsnorm_forward)
    if is_hf(module, "TopKRouter"):
        return ModuleAdapter("router_topk", _hf_router_forward)
    if is_hf(module, "SigmoidRouter"):
        return ModuleAdapter("router_topk", _hf_sigmoid_router_forward, hf_sigmoid_router_static)
    if is_hf(module, "Experts"):
        return ModuleAdapter("moe_experts", _hf_experts_forward, hf_experts_static)
    if is_hf(module, "GptOssExperts"):
        return ModuleAdapter("moe_experts", _hf_gpt_oss_experts_forward, gpt_oss_experts_static)
    return None


def bind(module: nn.Module, forward: Callable[..., Any], guard: BoundKernel) -> None:
    """``forward`` (and a repr naming the kernel) as this one module's own methods, as Liger-Kernel swaps a
    module's forward: the class, the parameters and ``state_dict`` stay, other instances are untouched. Bound as
    ``functools.partial`` (not a bound method, which pickles as ``getattr(module, name)`` and so cannot be
    loaded back), so ``torch.save(model)`` of a swapped model loads."""
    module.__dict__.update(forward=functools.partial(forward, module),
                           extra_repr=functools.partial(_extra_repr, module))
    module.__dict__[_GUARD] = guard


def unbind(module: nn.Module) -> None:
    for name in ("forward", "extra_repr", _GUARD):
        module.__dict__.pop(name, None)


@contextmanager
def dry_run_rotary(model: nn.Module) -> Iterator[None]:
    """transformers' dynamic-NTK rotary embeddings (``rope_type`` "dynamic") first update their frequencies from
    the values of ``position_ids``, which a fake-tensor dry run cannot read; within this context each runs its
    forward without that update (``dynamic_rope_update``'s wrapped function: the same shapes)."""
    bound = []
    for module in model.modules():
        forward = type(module).forward
        if "dynamic" in str(getattr(module, "rope_type", "")) and hasattr(forward, "__wrapped__"):
            bound.append((module, module.__dict__.get("forward")))
            module.__dict__["forward"] = functools.partial(forward.__wrapped__, module)
    try:
        yield
    finally:
        for module, previous in bound:
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous


# ------------------------------------------------------------------------- transformers' rotary call site


def is_rope_attention(module: nn.Module) -> bool:
    return is_hf(module, "Attention") and not swapped(module)


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
    q_out, k_out = ops.rope_hf_apply(q, k, cos, sin, None, "bshd", False, impl, lnc=self._trnkit_guard.lnc)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _hf_modeling(module: nn.Module) -> Any:
    """The transformers modeling module of ``module``'s class (its ``apply_rotary_pos_emb``, attention registry)."""
    return sys.modules[type(module).__module__]


def _hf_head_norms(self: Any, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """``self.q_norm(q), self.k_norm(k)``: one ``trnkit::rmsnorm_qk`` call when both of transformers' head norms
    are swapped in with one impl that has it (:func:`trnkit.overrides.guard.paired_head_norms`)."""
    qn, kn = self.q_norm, self.k_norm
    if swapped(qn) and swapped(kn):
        pair = paired_head_norms(qn._trnkit_guard, kn._trnkit_guard, q, k, qn.weight, kn.weight,
                                 float(qn.variance_epsilon), float(kn.variance_epsilon))
        if pair is not None:
            return pair
    return qn(q), kn(k)


def rope_attention_forward(self: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                               attention_mask: Tensor | None, cache: Any = None, **kwargs: Any) -> tuple[Tensor, Any]:
    """transformers' ``Qwen3Attention`` / ``Qwen3MoeAttention`` forward (5.24, the classes of
    ``_HF_CLASSES["Attention"]``; the parity tests compare it with theirs) with :func:`_hf_rope` at the
    rotary call site, bound to one module: transformers' module-level ``apply_rotary_pos_emb`` stays
    theirs, so other models are untouched."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the argument's old name (transformers maps it until 5.40)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k = _hf_head_norms(self, self.q_proj(hidden_states).view(hidden_shape),
                          self.k_proj(hidden_states).view(hidden_shape))
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
