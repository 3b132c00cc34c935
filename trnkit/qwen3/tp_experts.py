"""Tensor parallelism for the native routed experts, sharded on the intermediate dimension I.

Each TP rank keeps, for every expert, an I/tp slice of the gate and up projections (column-parallel)
and the matching rows of the down projection (row-parallel), computes its partial expert outputs for
all tokens (inputs and routing are replicated under TP) and the partial outputs are summed over the TP
group (Megatron's f / g pair: identity forward + all-reduce backward on the inputs, all-reduce forward
+ identity backward on the output).

``w_gate_up [E, H, 2I]`` holds gate columns then up columns, so a plain ``Shard(2)`` would give rank 0
the gates and rank 1 the ups. The sharded parameter therefore uses the *TP layout*
``[g_0 u_0 | g_1 u_1 | ...]`` (``g_r``/``u_r`` = rank r's I/tp columns of gate/up), whose ``Shard(2)``
chunks are exactly ``[g_r u_r]``. :func:`to_tp_layout` / :func:`from_tp_layout` convert full state
dicts, so weights load and export in the natural layout; DCP checkpoints hold the TP layout (resume
with the same tensor_parallel_degree).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trnkit.errors import ConfigError

GATE_UP = re.compile(r"^layers\.\d+\.moe\.experts\.w_gate_up$")


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient over the TP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward sums the partial outputs over the TP group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g, None


def _columns(i: int, tp: int) -> torch.Tensor:
    """Natural-layout column index of every TP-layout column of a [.., 2I] gate|up tensor."""
    s = i // tp
    return torch.cat([torch.cat([torch.arange(r * s, (r + 1) * s), i + torch.arange(r * s, (r + 1) * s)])
                      for r in range(tp)])


def to_tp_layout(sd: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    """Full state dict, natural -> TP layout for every expert w_gate_up (other tensors unchanged)."""
    out = dict(sd)
    for k, v in sd.items():
        if GATE_UP.match(k):
            out[k] = v[..., _columns(v.shape[-1] // 2, tp)]
    return out


def from_tp_layout(sd: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_tp_layout`."""
    out = dict(sd)
    for k, v in sd.items():
        if GATE_UP.match(k):
            inv = torch.argsort(_columns(v.shape[-1] // 2, tp))
            out[k] = v[..., inv]
    return out


def shard_experts_on_i(experts: nn.Module, tp_mesh: Any) -> None:
    """Turn a native ``GroupedExperts`` into its TP-sharded form, in place (meta or real tensors)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = tp_mesh.size()
    inter = experts.w_down.shape[1]
    if inter % tp:
        raise ConfigError(f"parallelism.tp_experts 'shard_i': moe_inter_dim {inter} is not divisible by "
                         f"tensor_parallel_degree {tp}")
    # Values are (re)loaded in the TP layout after materialisation; only shapes/placements matter here.
    experts.w_gate_up = nn.Parameter(distribute_tensor(experts.w_gate_up.data, tp_mesh, [Shard(2)]))
    experts.w_down = nn.Parameter(distribute_tensor(experts.w_down.data, tp_mesh, [Shard(1)]))
    group = tp_mesh.get_group()
    names = ("w_gate_up", "w_down")

    def pre_hook(module: nn.Module, args: tuple) -> tuple:
        x, idx, weights = args
        # local shards shadow the DTensor parameters for this call (instance attributes win over
        # nn.Module's parameter lookup); to_local keeps the autograd link to the DTensor
        for n in names:
            module.__dict__[n] = module._parameters[n].to_local()
        return _CopyToTP.apply(x, group), idx, _CopyToTP.apply(weights, group)

    def post_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        for n in names:
            module.__dict__.pop(n, None)
        return _ReduceFromTP.apply(out, group)

    experts.register_forward_pre_hook(pre_hook)
    experts.register_forward_hook(post_hook)


__all__ = ["from_tp_layout", "shard_experts_on_i", "to_tp_layout"]
