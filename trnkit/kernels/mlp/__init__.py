"""Dense SwiGLU MLP (Qwen3's dense feed-forward) as NKI kernels: the forward and the backward with both
weight gradients.

``mlp(x, w_gate_up, w_down)`` -> ``y = (silu(x @ Wg) * (x @ Wu)) @ w_down``; ``mlp_bwd(x, w_gate_up, w_down,
grad_y)`` -> ``(grad_x, grad_w_gate_up, grad_w_down)``. ``x [..., H]`` (any leading shape), ``w_gate_up [H,
2I]`` (gate columns first: the MoE experts' layout of one expert), ``w_down [I, H]``; every output in x's
dtype. :func:`from_linear` / :func:`to_linear` convert from / to ``nn.Linear`` weights (transformers'
``gate_proj`` / ``up_proj`` / ``down_proj``). The torch references of the same signatures are in
:mod:`trnkit.kernels.mlp.mlp_torch`; the kernels and their design in :mod:`trnkit.kernels.mlp.mlp_kernels`
(imported, with the NKI backend, on the first call), the tile sizes in :mod:`trnkit.kernels.mlp.tiling`.
"""

from __future__ import annotations

from typing import Any

import torch

from trnkit.kernels._common import dense
from trnkit.kernels.constraints import check
from trnkit.kernels.lnc import launch, resolve_lnc
from trnkit.kernels.mlp.constraints import mlp_constraints
from trnkit.kernels.mlp.mlp_torch import mlp_bwd_ref, mlp_ref
from trnkit.kernels.mlp.tiling import plan

__all__ = ["from_linear", "mlp", "mlp_bwd", "mlp_bwd_ref", "mlp_constraints", "mlp_ref", "to_linear"]


def from_linear(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``nn.Linear`` weights ``gate [I, H]``, ``up [I, H]``, ``down [H, I]`` -> the kernels' ``(w_gate_up [H, 2I],
    w_down [I, H])`` (contiguous copies)."""
    return torch.cat([w_gate, w_up]).T.contiguous(), w_down.T.contiguous()


def to_linear(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' layout -> ``nn.Linear`` weights ``(gate [I, H], up [I, H], down [H, I])``."""
    gate, up = w_gate_up.T.chunk(2)
    return gate.contiguous(), up.contiguous(), w_down.T.contiguous()


def _plan(x: Any, w_down: Any, lnc: int) -> tuple[int, int, int, int]:
    """The tiles of :func:`~trnkit.kernels.mlp.tiling.plan` for one core's share of x's rows."""
    per_core = -(-(x.numel() // x.shape[-1]) // lnc)
    return plan(x.shape[-1], w_down.shape[0], x.element_size(), per_core)


def mlp(x: Any, w_gate_up: Any, w_down: Any, lnc: int | None = None) -> Any:
    """``y [x.shape] = (silu(x @ Wg) * (x @ Wu)) @ w_down`` in x's dtype (NKI kernel).

    Raises :class:`~trnkit.kernels.constraints.KernelConstraintError` on inputs outside the constraints.
    """
    from trnkit.kernels.mlp.mlp_kernels import mlp_fwd_kernel

    check(mlp_constraints(x, w_gate_up, w_down))
    lnc = resolve_lnc(lnc)
    tb, ib, _, _ = _plan(x, w_down, lnc)
    rows = dense(x).reshape(-1, x.shape[-1])
    y = launch(mlp_fwd_kernel, lnc)(rows, dense(w_gate_up), dense(w_down), tb, ib)
    return y.reshape(x.shape)


def mlp_bwd(x: Any, w_gate_up: Any, w_down: Any, grad_y: Any, lnc: int | None = None) -> tuple[Any, Any, Any]:
    """``(grad_x [x.shape], grad_w_gate_up [H, 2I], grad_w_down [I, H])`` of :func:`mlp` for the output
    gradient ``grad_y`` (NKI kernels: the data path, then both weight gradients; activations recomputed)."""
    from trnkit.kernels.mlp.mlp_kernels import mlp_bwd_kernel, mlp_wgrad_kernel

    check(mlp_constraints(x, w_gate_up, w_down, grad_y))
    lnc = resolve_lnc(lnc)
    _, _, tb, ib = _plan(x, w_down, lnc)
    rows = dense(x).reshape(-1, x.shape[-1])
    dy = dense(grad_y).reshape(rows.shape)
    w_gate_up, w_down = dense(w_gate_up), dense(w_down)
    grad_x, h, dgu = launch(mlp_bwd_kernel, lnc)(rows, dy, w_gate_up, w_down.T.contiguous(),
                                                 w_gate_up.T.contiguous(), tb, ib)
    grad_wgu, grad_wd = launch(mlp_wgrad_kernel, lnc)(rows, dgu, h, dy)
    return grad_x.reshape(x.shape), grad_wgu, grad_wd
