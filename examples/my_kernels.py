"""An example trnkit plugin: your own kernels for two of trnkit's ops, picked from the trainer's config.

    [overrides]
    plugins = ["examples.my_kernels"]      # imported before `impl` is resolved
    ops = ["router_topk", "moe_experts"]
    impl = "example"
    policy = "strict"

Importing this module registers an ``example`` impl of ``router_topk`` and of ``moe_experts`` (plain
torch here; a real plugin would call its own NKI kernel or library). The two backwards show both styles
trnkit supports inside an op: ``torch.autograd.grad`` through a recomputed forward (router), and
``torch.func.vjp`` (experts). trnkit passes the differentiable inputs to a backward as leaves that
require grad and runs it with autograd on, so neither needs any ``detach``/``enable_grad`` of its own.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

from trnkit.kernels.constraints import Violation
from trnkit.overrides import register

CALLS: Counter[str] = Counter()  # how often each function ran (the tests read it)


# ------------------------------------------------------------------------------------------ router
def _router_weights(x: Tensor, w_router: Tensor, idx: Tensor, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    logits = x.float() @ w_router.float().T
    weights = torch.softmax(logits, dim=-1).gather(1, idx)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, logits


def router_fwd(x: Tensor, w_router: Tensor, top_k: int, norm_topk_prob: bool = True):
    """``(topk_weights [T,K] f32, topk_idx [T,K], router_logits [T,E] f32)``; ties go to the lower expert."""
    CALLS["router_fwd"] += 1
    logits = x.float() @ w_router.float().T
    idx = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights, _ = _router_weights(x, w_router, idx, norm_topk_prob)
    return weights, idx, logits


def router_bwd(x, w_router, router_logits, topk_idx, grad_topk_weights, grad_router_logits, norm_topk_prob):
    """torch.autograd.grad style: recompute the forward from the inputs trnkit hands over (they require grad)."""
    CALLS["router_bwd"] += 1
    weights, logits = _router_weights(x, w_router, topk_idx.long(), norm_topk_prob)
    return torch.autograd.grad((weights, logits), (x, w_router), (grad_topk_weights, grad_router_logits))


def router_constraints(x, w_router, top_k, **_) -> list[Violation]:
    """Shapes and dtypes only (inputs may be fake tensors)."""
    if top_k > w_router.shape[0]:
        return [Violation("router_topk[example]", "top_k <= num_experts", top_k)]
    return []


# ----------------------------------------------------------------------------------------- experts
def _experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """SwiGLU experts, one expert at a time over the tokens routed to it (fp32 accumulation)."""
    inter = w_down.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok].float() @ w_gate_up[e].float()
        y = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w_down[e].float()
        out = out.index_add(0, tok, topk_weights[tok, slot, None].float() * y)
    return out.to(x.dtype)


def experts_fwd(x, topk_idx, topk_weights, w_gate_up, w_down, block_size=128) -> Tensor:
    CALLS["experts_fwd"] += 1
    return _experts(x, topk_idx, topk_weights, w_gate_up, w_down)


def experts_bwd(x, topk_idx, topk_weights, w_gate_up, w_down, grad_out, block_size=128):
    """torch.func.vjp style: ``(grad_x, grad_topk_weights, grad_w_gate_up, grad_w_down)``."""
    CALLS["experts_bwd"] += 1
    _, vjp = torch.func.vjp(lambda a, tw, gu, d: _experts(a, topk_idx, tw, gu, d), x, topk_weights, w_gate_up,
                            w_down)
    return vjp(grad_out)


register("router_topk", "example", router_fwd, backward=router_bwd, constraints=router_constraints,
         description="examples/my_kernels.py: torch, autograd.grad backward")
register("moe_experts", "example", experts_fwd, backward=experts_bwd,
         description="examples/my_kernels.py: torch, torch.func.vjp backward")
