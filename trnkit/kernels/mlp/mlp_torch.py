"""Torch references of the dense SwiGLU MLP kernels, same signatures as :mod:`trnkit.kernels.mlp`.

Rounding points as the kernels: every matmul accumulates in fp32; ``h = silu(gate) * up`` is formed in
fp32 from the fp32 gate / up and rounded to the input dtype (the down matmul's operand, and the
``grad_w_down`` operand); the backward's ``dgate = dA * up * silu'(gate)`` and ``dup = dA * silu(gate)``
(``dA = grad_y @ w_down.T`` in fp32) are rounded to the input dtype (the operands of ``grad_x`` and
``grad_w_gate_up``); each output is rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gate_up(x: torch.Tensor, w_gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gu = x.reshape(-1, x.shape[-1]).float() @ w_gate_up.float()
    return gu.chunk(2, dim=-1)


def mlp_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``y [..., H] = (silu(x @ Wg) * (x @ Wu)) @ w_down`` in x's dtype; ``w_gate_up [H, 2I]`` (gate columns
    first), ``w_down [I, H]``."""
    gate, up = _gate_up(x, w_gate_up)
    h = (F.silu(gate) * up).to(x.dtype)
    return (h.float() @ w_down.float()).to(x.dtype).reshape(x.shape)


def mlp_bwd_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, grad_y: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x [x.shape], grad_w_gate_up [H, 2I], grad_w_down [I, H])`` of :func:`mlp_ref`, in x's dtype."""
    dt = x.dtype
    rows = x.reshape(-1, x.shape[-1]).float()
    dy = grad_y.reshape(rows.shape).float()
    gate, up = _gate_up(x, w_gate_up)
    s = torch.sigmoid(gate)
    silu = gate * s
    h = (silu * up).to(dt)
    d_a = dy @ w_down.float().T
    dgu = torch.cat([d_a * up * (s + silu * (1 - s)), d_a * silu], dim=-1).to(dt).float()
    grad_x = (dgu @ w_gate_up.float().T).to(dt).reshape(x.shape)
    return grad_x, (rows.T @ dgu).to(dt), (h.float().T @ dy).to(dt)


__all__ = ["mlp_bwd_ref", "mlp_ref"]
