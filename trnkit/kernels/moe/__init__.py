"""MoE grouped expert matmul: ``grouped_mm`` and the fused SwiGLU expert MLP ``moe_experts``.

Public API (the host side; each entry point imports its kernel module on the first call):

* Weight layout of the kernels: ``w_gate_up [E, H, 2I]`` (gate columns ``[:I]``, up columns ``[I:]``;
  the contraction dim H leads, so an expert's weight rows land on SBUF partitions with one contiguous
  DMA) and ``w_down [E, I, H]``. Converters: :func:`from_hf_v5` / :func:`to_hf_v5` (transformers v5
  fused ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and :func:`from_torchtitan` /
  :func:`to_torchtitan` (``w1``/``w3 [E, I, H]``, ``w2 [E, H, I]``).
* ``grouped_mm(x [M, K], w [G, K, N], group_offsets [G] int32) -> [M, N]``: rows
  ``[offs[g-1], offs[g])`` of x are multiplied by ``w[g]`` (torch ``_grouped_mm`` ``offs`` contract:
  exclusive ends, non-decreasing, ``offs[-1] <= M``). Rows past ``offs[-1]`` are **zero** (torch leaves
  them uninitialised). ``grouped_mm_bwd(x, w, group_offsets, grad_out) -> (grad_x, grad_w)``.
* ``moe_experts(x [T, H], topk_idx [T, K], topk_weights [T, K], w_gate_up, w_down, block_size=512)
  -> [T, H]``: ``out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
  ``e = topk_idx[t, k]``. ``moe_experts_bwd(..., grad_out, block_size=128) -> (grad_x,
  grad_topk_weights, grad_w_gate_up, grad_w_down)``. Expert variants (trailing keyword arguments of
  both and of their refs): ``activation`` ``silu | gelu_tanh | swiglu_clamped`` (GPT-OSS, with
  ``limit`` / ``alpha``) and biases ``b_gate_up [E, 2I]`` / ``b_down [E, H]`` (:func:`activation_ref`).

How it runs (dropless, megablocks / nki-library style): the (token, k) *slots* are grouped by expert with
torch ops on the host (:func:`~trnkit.kernels.moe.layout.block_layout`: counting sort, no Python loop over
experts, no host sync) into blocks of ``block_size`` rows per expert, padding the last block of each expert.
The NKI kernels loop statically over experts (loading each expert's weights once) and, inside, run a
*run-time* loop (``nl.fori_loop`` with register bounds) over that expert's blocks; each block gathers its
token rows by indirect DMA, so no compute is spent on the padding blocks of the static worst-case table. The
kernels: :mod:`~trnkit.kernels.moe.moe_fused` (forward), :mod:`~trnkit.kernels.moe.moe_bwd` (backward data
path), :mod:`~trnkit.kernels.moe.moe_grouped_mm`; beside them the layout contract
:mod:`~trnkit.kernels.moe.layout`, the references :mod:`~trnkit.kernels.moe.moe_torch` and the constraints
:mod:`~trnkit.kernels.moe.constraints`.

Numerics (bf16): matmuls accumulate in fp32 PSUM; ``h = silu(gate) * up`` is rounded to the input
dtype (it is the down matmul's operand), each slot's scaled output ``w * y`` is rounded to the input
dtype (as nki-library's blockwise MoE does), and the K contributions of a token are summed in fp32 and
rounded once. The ``*_ref`` functions use the same rounding points, so kernel-vs-reference tolerances
stay at one bf16 ulp; HF's eager path rounds more often (bf16 weights, bf16 ``index_add_``).
"""

from __future__ import annotations

import torch

from trnkit.kernels.lnc import launch, resolve_lnc
from trnkit.kernels.moe.constraints import (
    ACTIVATIONS,
    BLOCK_SIZES,
    FWD_BLOCK_SIZE,
    MAX_EXPERTS,
    MAX_TOP_K,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    WEIGHT_SBUF_BUDGET,
    check_grouped_mm,
    check_moe_experts,
    constraints,
    fitting_block_size,
    grouped_mm_constraints,
    grouped_mm_value_violations,
    moe_experts_constraints,
    moe_experts_value_violations,
    zero_width_violations,
)
from trnkit.kernels.moe.layout import (
    BlockLayout,
    block_layout,
    counts_of,
    flagged,
    group_of_row,
    moe_layout,
    per_block,
    position_weights,
    row_tiles,
    slot_tokens,
    tail_layout,
    wgrad_bounds,
    with_previous,
)
from trnkit.kernels.moe.moe_torch import (
    activation_ref,
    grouped_mm_bwd_ref,
    grouped_mm_ref,
    moe_experts_bwd_ref,
    moe_experts_ref,
)

__all__ = [
    "ACTIVATIONS",
    "BLOCK_SIZES",
    "FWD_BLOCK_SIZE",
    "MAX_EXPERTS",
    "MAX_TOP_K",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "WEIGHT_SBUF_BUDGET",
    "BlockLayout",
    "activation_ref",
    "block_layout",
    "constraints",
    "fitting_block_size",
    "from_hf_v5",
    "from_torchtitan",
    "grouped_mm",
    "grouped_mm_bwd",
    "grouped_mm_bwd_ref",
    "grouped_mm_constraints",
    "grouped_mm_ref",
    "grouped_mm_value_violations",
    "moe_experts",
    "moe_experts_bwd",
    "moe_experts_bwd_ref",
    "moe_experts_constraints",
    "moe_experts_ref",
    "moe_experts_value_violations",
    "to_hf_v5",
    "to_torchtitan",
    "zero_width_violations",
]


# --------------------------------------------------------------------------------------------------
# Weight layout converters
# --------------------------------------------------------------------------------------------------
def from_hf_v5(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers v5 ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]`` ->
    kernel ``(w_gate_up [E, H, 2I], w_down [E, I, H])`` (contiguous copies)."""
    return gate_up_proj.transpose(1, 2).contiguous(), down_proj.transpose(1, 2).contiguous()


def to_hf_v5(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel layout -> transformers v5 ``(gate_up_proj [E, 2I, H], down_proj [E, H, I])``."""
    return w_gate_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()


def from_torchtitan(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan ``w1 [E, I, H]`` (gate), ``w2 [E, H, I]`` (down), ``w3 [E, I, H]`` (up) -> kernel layout."""
    return torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()


def to_torchtitan(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel layout -> torchtitan ``(w1 [E, I, H], w2 [E, H, I], w3 [E, I, H])``."""
    inter = w_gate_up.shape[-1] // 2
    gate_up = w_gate_up.transpose(1, 2)
    return (gate_up[:, :inter].contiguous(), w_down.transpose(1, 2).contiguous(),
            gate_up[:, inter:].contiguous())


# --------------------------------------------------------------------------------------------------
# NKI entry points
# --------------------------------------------------------------------------------------------------
def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor,
               block_size: int = 128, lnc: int | None = None) -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]`` on the NKI kernel; rows past ``offs[-1]`` are zero.

    ``lnc``: 1 or 2 physical cores (None: :func:`trnkit.kernels.lnc.default_lnc`); the cores split the
    groups, results are identical."""
    from trnkit.kernels.moe import moe_grouped_mm as K_  # imports the NKI backend lazily

    check_grouped_mm(x, w, group_offsets, nki=True)
    lnc = resolve_lnc(lnc)
    M = x.shape[0]
    lay = block_layout(group_of_row(group_offsets, M), w.shape[0], block_size, pad=M, lnc=lnc)
    out = torch.zeros(M, w.shape[2], dtype=x.dtype, device=x.device)
    return launch(K_.grouped_mm_kernel, lnc)(x.contiguous(), w.contiguous(), lay.table, lay.table,
                                             lay.block_start, out, False)


def grouped_mm_bwd(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, grad_out: torch.Tensor,
                   block_size: int = 128, lnc: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_w)`` of :func:`grouped_mm` on NKI kernels (grad_x: grouped matmul with
    ``w[g].T``; grad_w: per-group ``x_g.T @ grad_out_g`` accumulated over blocks in fp32)."""
    from trnkit.kernels.moe import moe_grouped_mm as K_

    check_grouped_mm(x, w, group_offsets, grad_out, nki=True)
    lnc = resolve_lnc(lnc)
    M = x.shape[0]
    lay = block_layout(group_of_row(group_offsets, M), w.shape[0], block_size, pad=M, lnc=lnc)
    x, w, grad_out = x.contiguous(), w.contiguous(), grad_out.contiguous()
    grad_x = torch.zeros(M, w.shape[1], dtype=x.dtype, device=x.device)
    grad_x = launch(K_.grouped_mm_kernel, lnc)(grad_out, w, lay.table, lay.table, lay.block_start, grad_x, True)
    grad_w = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    counts = torch.diff(group_offsets.long(), prepend=group_offsets.new_zeros(1).long())
    grad_w = launch(K_.grouped_wgrad_kernel, lnc)(x, grad_out, row_tiles(lay.table),
                                                  wgrad_bounds(lay, counts, lnc), grad_w, True)
    return grad_x, grad_w


def moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor, block_size: int = FWD_BLOCK_SIZE,
                lnc: int | None = None, activation: str = "silu", limit: float = SWIGLU_LIMIT,
                alpha: float = SWIGLU_ALPHA, b_gate_up: torch.Tensor | None = None,
                b_down: torch.Tensor | None = None) -> torch.Tensor:
    """Fused gated experts on the NKI kernel (see the module docstring); returns ``[T, H]`` in x.dtype.
    ``block_size``: slots per expert block (the result does not depend on it; 512 lets every gate/up
    matmul stream 512 token columns), narrowed to the widest that fits SBUF (:func:`fitting_block_size`).
    ``lnc``: 1 or 2 physical cores (None:
    :func:`trnkit.kernels.lnc.default_lnc`). ``activation`` (``silu | gelu_tanh | swiglu_clamped`` with ``limit``,
    ``alpha``) and the optional biases
    ``b_gate_up [E, 2I]``, ``b_down [E, H]``: :func:`activation_ref` / :func:`moe_experts_ref`."""
    from trnkit.kernels.moe import moe_fused as K_

    check_moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, nki=True, activation=activation,
                       limit=limit, alpha=alpha, b_gate_up=b_gate_up, b_down=b_down)
    lnc = resolve_lnc(lnc)
    T, K = topk_idx.shape
    E = w_gate_up.shape[0]
    block_size = _fitting_block(x, w_down, block_size, False, b_gate_up, b_down)
    lay, split = tail_layout(topk_idx, E, block_size, lnc)
    token = slot_tokens(lay, K)  # padding positions: token 0, results never stored
    weights = position_weights(topk_weights, lay)
    slots = torch.cat([lay.table, torch.full_like(lay.table[:1], T * K)])  # + the all-padding row NB
    token = torch.cat([token, torch.zeros_like(token[:1])])  # row NB: the last block's look-ahead
    slot_pages = with_previous(flagged(slots, split, E, lnc), lay.block_start, lnc)
    return launch(K_.moe_experts_kernel, lnc)(x.contiguous(), w_gate_up.contiguous(), w_down.contiguous(),
                                              flagged(token, split, E, lnc), slot_pages, split,
                                              per_block(weights), K, activation, float(limit), float(alpha),
                                              _dense(b_gate_up), _dense(b_down))


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _fitting_block(x: torch.Tensor, w_down: torch.Tensor, block_size: int, backward: bool,
                   b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None) -> int:
    """``block_size``, or the widest narrower one whose blocks fit SBUF (:func:`fitting_block_size`; the
    constraints refuse shapes where not even the narrowest does). The results do not depend on it."""
    fit = fitting_block_size(x.shape[1], w_down.shape[1], block_size, x.element_size(), backward,
                             b_gate_up is not None, b_down is not None)
    return block_size if fit is None else fit


def moe_experts_bwd(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, grad_out: torch.Tensor,
                    block_size: int = 128, lnc: int | None = None, activation: str = "silu",
                    limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA,
                    b_gate_up: torch.Tensor | None = None,
                    b_down: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """Backward of :func:`moe_experts` on NKI kernels (activations are recomputed):
    ``(grad_x, grad_topk_weights, grad_w_gate_up, grad_w_down)``, followed by ``(grad_b_gate_up,
    grad_b_down)`` when a bias is given (None for an absent one).

    1. the fused data path (:func:`trnkit.kernels.moe.moe_bwd.moe_bwd_kernel`): per block of an expert's
       slots the gate/up recompute, ``grad_out @ w_down.T``, the activation backward,
       ``grad_topk_weights``, ``w*h`` and ``dgu`` (written in dispatch order for step 2), ``dgu @
       w_gate_up.T`` per slot and the sum over each token's K slots (``grad_x``);
    2. weight gradients ``grad_w_down[e] = sum (w h).T grad_out``, ``grad_w_gate_up[e] = sum x.T dgu``
       and the bias gradients ``grad_b_down[e] = sum w grad_out``, ``grad_b_gate_up[e] = sum dgu``
       (:func:`_expert_weight_grads`).

    ``lnc=2``: every kernel runs on both cores, each on the same half of the experts (step 2 only reads
    what the same core wrote in step 1); the data path's combine waits at one ``core_barrier``.
    """
    from trnkit.kernels.moe import moe_bwd as KB

    check_moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, grad_out, nki=True,
                       activation=activation, limit=limit, alpha=alpha, b_gate_up=b_gate_up, b_down=b_down)
    lnc = resolve_lnc(lnc)
    T = x.shape[0]
    K = topk_idx.shape[1]
    E = w_gate_up.shape[0]
    block_size = _fitting_block(x, w_down, block_size, True, b_gate_up, b_down)
    x, grad_out = x.contiguous(), grad_out.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    lay, token = moe_layout(topk_idx, E, block_size, lnc)
    NB, B = lay.table.shape
    dev = x.device
    slot = lay.table.long()
    used = slot < T * K
    weights = topk_weights.reshape(-1, 1).float()
    # padding positions gather token 0 (finite rows) with affinity 0, so their w*h and dgu are exact zeros
    block_weights = position_weights(weights, lay)
    slots = torch.cat([lay.table, torch.full_like(lay.table[:1], T * K)])  # + the all-padding row NB
    # every kernel's outputs are taken from its return value (on a device the returned tensors are the
    # ones to use)
    hw, dgu, gw_blocks, grad_x = launch(KB.moe_bwd_kernel, lnc)(
        x, grad_out, w_gate_up, w_down, per_block(token), per_block(slots), lay.block_start,
        per_block(block_weights), K, activation, float(limit), float(alpha), _dense(b_gate_up), _dense(b_down))
    dgu = dgu[:NB]  # (slab NB: the kernel's read-ahead margin)
    gw_disp = gw_blocks.transpose(1, 2).reshape(NB, B)  # back from the per-block layout of per_block
    gw = torch.zeros(T * K + 1, dtype=torch.float32, device=dev)  # + a dump slot for the padding positions
    gw[torch.where(used, slot, T * K)] = gw_disp  # (a boolean-mask index would read the mask back to the host)
    gw = gw[:T * K]
    grad_wgu, grad_wd, grad_bgu, grad_bd = _expert_weight_grads(x, grad_out, hw, dgu, lay, topk_idx, lnc,
                                                                weights, b_gate_up, b_down, E)
    grads = (grad_x, gw.view(T, K).to(topk_weights.dtype), grad_wgu, grad_wd)
    if b_gate_up is None and b_down is None:
        return grads
    return (*grads, grad_bgu, grad_bd)


def _expert_weight_grads(x: torch.Tensor, grad_out: torch.Tensor, hw: torch.Tensor, dgu: torch.Tensor,
                         lay: BlockLayout, topk_idx: torch.Tensor, lnc: int, weights: torch.Tensor | None = None,
                         b_gate_up: torch.Tensor | None = None,
                         b_down: torch.Tensor | None = None,
                         num_experts: int | None = None) -> tuple[torch.Tensor | None, ...]:
    """The expert weight gradients of the backward: ``(grad_w_gate_up, grad_w_down, grad_b_gate_up,
    grad_b_down)`` (a bias gradient only for a given bias, else None).

    ``grad_w_down[e] = sum (w h).T grad_out[tok]`` and ``grad_w_gate_up[e] = sum x[tok].T dgu`` over
    expert e's slots in one launch of ``grouped_wgrad2_kernel`` (each row tile's x / grad_out rows are
    gathered once for both); ``hw [NB, B, I]`` and ``dgu [NB, B, 2I]`` in dispatch order of ``lay`` (the
    slot layout of ``topk_idx``) with **zero padding rows**; padding positions gather token 0. The bias
    gradients ``grad_b_gate_up[e] = sum dgu`` (ones column) and ``grad_b_down[e] = sum w grad_out[tok]``
    (``weights [T*K, 1]`` fp32, rounded to x's dtype) are a second launch. ``num_experts``: E (default: the
    groups of ``lay``, which an LNC=2 layout rounds up to even) (of ``grouped_wgrad_kernel``
    when only one bias is given).
    """
    from trnkit.kernels.moe import moe_grouped_mm as KG

    T, H = x.shape
    K = topk_idx.shape[1]
    I = hw.shape[2]  # noqa: E741
    E = lay.block_start.shape[1] - 1 if num_experts is None else num_experts
    dt, dev = x.dtype, x.device
    table = row_tiles(slot_tokens(lay, K))
    bounds = wgrad_bounds(lay, counts_of(topk_idx.reshape(-1).long(), E), lnc)
    wgrad2 = launch(KG.grouped_wgrad2_kernel, lnc)
    grad_wgu = torch.empty(E, H, 2 * I, dtype=dt, device=dev)
    grad_wd = torch.empty(E, I, H, dtype=dt, device=dev)
    grad_wd, grad_wgu = wgrad2(row_tiles(hw), grad_out, x, row_tiles(dgu), table, bounds, grad_wd, grad_wgu)
    if b_gate_up is None and b_down is None:
        return grad_wgu, grad_wd, None, None
    # biases: sum of dgu (a ones column) and of w * grad_out over the expert's slots, one launch
    ops, grads = [], []
    if b_gate_up is not None:
        ops += [torch.ones(T, 1, dtype=dt, device=dev), row_tiles(dgu)]
        grads.append(torch.empty(E, 1, 2 * I, dtype=dt, device=dev))
    if b_down is not None:
        ops += [row_tiles(position_weights(weights, lay).to(dt).unsqueeze(-1)), grad_out]
        grads.append(torch.empty(E, 1, H, dtype=dt, device=dev))
    if len(grads) == 2:
        grads = list(wgrad2(*ops, table, bounds, *grads))
    else:
        grads = [launch(KG.grouped_wgrad_kernel, lnc)(*ops, table, bounds, grads[0])]
    grad_bgu = None if b_gate_up is None else grads[0].view(E, 2 * I)
    grad_bd = None if b_down is None else grads[-1].view(E, H)
    return grad_wgu, grad_wd, grad_bgu, grad_bd
