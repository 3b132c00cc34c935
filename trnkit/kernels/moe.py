"""MoE grouped expert matmul: ``grouped_mm`` and the fused SwiGLU expert MLP ``moe_experts``.

Public API (DESIGN.md §3):

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

How it runs (dropless, megablocks / nki-library style): the (token, k) *slots* are grouped by expert
with torch ops on the host (:func:`block_layout`: counting sort, no Python loop over experts, no host
sync) into blocks of ``block_size`` rows per expert, padding the last block of each expert. The NKI
kernels loop statically over experts (loading each expert's weights once) and, inside, run a
*run-time* loop (``nl.fori_loop`` with register bounds) over that expert's blocks; each block gathers
its token rows by indirect DMA, so no compute is spent on the padding blocks of the static worst-case
table. See :mod:`trnkit.kernels.moe_fused` (forward), :mod:`trnkit.kernels.moe_bwd` (backward data path)
and :mod:`trnkit.kernels.moe_grouped_mm`.

Numerics (bf16): matmuls accumulate in fp32 PSUM; ``h = silu(gate) * up`` is rounded to the input
dtype (it is the down matmul's operand), each slot's scaled output ``w * y`` is rounded to the input
dtype (as nki-library's blockwise MoE does), and the K contributions of a token are summed in fp32 and
rounded once. The ``*_ref`` functions use the same rounding points, so kernel-vs-reference tolerances
stay at one bf16 ulp; HF's eager path rounds more often (bf16 weights, bf16 ``index_add_``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trnkit.kernels._common import GELU_A, GELU_C
from trnkit.kernels.constraints import Violation, check
from trnkit.kernels.lnc import launch, resolve_lnc

__all__ = [
    "BlockLayout",
    "block_layout",
    "from_hf_v5",
    "to_hf_v5",
    "from_torchtitan",
    "to_torchtitan",
    "grouped_mm",
    "grouped_mm_bwd",
    "grouped_mm_ref",
    "grouped_mm_bwd_ref",
    "grouped_mm_constraints",
    "moe_experts",
    "moe_experts_bwd",
    "moe_experts_ref",
    "moe_experts_bwd_ref",
    "moe_experts_constraints",
    "grouped_mm_value_violations",
    "moe_experts_value_violations",
    "constraints",
    "ACTIVATIONS",
    "SWIGLU_LIMIT",
    "SWIGLU_ALPHA",
    "BLOCK_SIZES",
    "FWD_BLOCK_SIZE",
    "MAX_EXPERTS",
    "MAX_TOP_K",
    "WEIGHT_SBUF_BUDGET",
]

GROUPED_MM = "grouped_mm"
MOE_EXPERTS = "moe_experts"
BLOCK_SIZES = (32, 64, 128, 256, 512)  # rows per expert block; > 128 runs as 128-row sub-tiles
FWD_BLOCK_SIZE = 512  # moe_experts' default: 512 token columns per gate/up matmul (moving free size max)
MAX_EXPERTS = 512  # experts / groups per call (block table and block_start row fit one SBUF row)
MAX_TOP_K = 8  # router top-k (hardware max8)
# SBUF bytes per partition one expert's weights may take, so that the next expert's weights can be
# loaded while this one computes (2 x 96 KiB + working tiles < ~208 KiB usable on trn2).
WEIGHT_SBUF_BUDGET = 96 * 1024
_DTYPES = (torch.float32, torch.bfloat16)
# expert activations: h = act(gate) * up (silu, gelu_tanh) or GPT-OSS's clamped SwiGLU
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")
SWIGLU_LIMIT = 7.0  # GPT-OSS defaults (transformers GptOssConfig.swiglu_limit / swiglu_alpha)
SWIGLU_ALPHA = 1.702


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
# Dispatch metadata (torch ops before the kernel, as nki-library's callers do)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockLayout:
    """Items (slots or rows) grouped into fixed-size blocks, one group per block.

    ``table [num_blocks, block_size]`` int32: the item at each block position, ``pad`` where a block is
    not full (or the block is unused). ``block_start [1, G + 1]`` int32: group g owns blocks
    ``block_start[g] .. block_start[g + 1] - 1``. ``num_blocks`` is the static worst case for this many
    items, so shapes never depend on the routing (the kernels visit only the used blocks).
    """

    table: torch.Tensor
    block_start: torch.Tensor
    block_size: int
    pad: int

    @property
    def num_blocks(self) -> int:
        return self.table.shape[0]


def max_blocks(num_items: int, num_groups: int, block_size: int) -> int:
    """Worst case of ``sum_g ceil(count_g / B)`` over all ways to split ``num_items`` into groups."""
    nonempty = min(num_groups, num_items)
    return max(1, (num_items - nonempty) // block_size + nonempty)


def paired(per_group: torch.Tensor, lnc: int) -> torch.Tensor:
    """Per-group counts (``[G]`` or ``[G, n]``) as an LNC=``lnc`` launch runs them: unchanged for 1; for 2
    padded to an even number of groups (a last group of zeros: the masked group of
    ``moe_grouped_mm.masked_group``) and each group j of core 0 given the larger count of itself and
    its partner, group j of core 1 (``owned_groups``: contiguous halves), so both cores run the same
    run-time loops."""
    if lnc == 1:
        return per_group
    if per_group.shape[0] % 2:
        per_group = torch.cat([per_group, torch.zeros_like(per_group[:1])])
    half = per_group.shape[0] // 2
    both = torch.maximum(per_group[:half], per_group[half:])
    return torch.cat([both, both])


def block_layout(group_of_item: torch.Tensor, num_groups: int, block_size: int, pad: int,
                 lnc: int = 1) -> BlockLayout:
    """Group items by ``group_of_item`` (stable: items keep their order inside a group).

    Items whose group is ``>= num_groups`` are dropped (grouped_mm rows past the last offset). Pure
    torch on the items' device: no host read of any value (``num_blocks`` comes from the item count
    alone) and no Python loop over groups. ``lnc=2``: the groups' block counts are :func:`paired`
    (padding blocks at the end of a group; ``block_start`` has one more group for an odd count).
    """
    g = group_of_item.reshape(-1).long()
    dev = g.device
    n = g.numel()
    g = torch.clamp(g, max=num_groups)  # every dropped item -> the extra group num_groups
    counts = torch.bincount(g, minlength=num_groups + 1)  # [G + 1]; the last entry: dropped items
    blocks = paired((counts[:num_groups] + block_size - 1) // block_size, lnc)
    block_start = torch.zeros(blocks.shape[0] + 1, dtype=torch.int64, device=dev)
    block_start[1:] = torch.cumsum(blocks, 0)
    # >= the bound for the kept items (monotone in n); pairing at most doubles the blocks
    nb = lnc * max_blocks(n, num_groups, block_size)
    table = torch.full((nb * block_size + 1,), pad, dtype=torch.int64, device=dev)  # + 1 dump slot
    if n:
        order = torch.argsort(g, stable=True)
        sorted_g = g[order]
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(n, device=dev) - first[sorted_g]
        pos = torch.where(sorted_g < num_groups, block_start[sorted_g] * block_size + rank,
                          torch.full_like(rank, nb * block_size))  # dropped items -> the dump slot
        table[pos] = order
    return BlockLayout(table[:-1].view(nb, block_size).to(torch.int32),
                       block_start.view(1, -1).to(torch.int32), block_size, pad)


def _group_of_row(group_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group id of each row for exclusive-end offsets (rows past the last offset get G)."""
    rows = torch.arange(num_rows, device=group_offsets.device)
    return torch.searchsorted(group_offsets.long(), rows, right=True)


# --------------------------------------------------------------------------------------------------
# Constraints
# --------------------------------------------------------------------------------------------------
def _dtype_violations(kernel: str, **tensors: torch.Tensor) -> list[Violation]:
    out = []
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            out.append(Violation(kernel, f"{name}.dtype in (float32, bfloat16)", str(t.dtype)))
    dts = {t.dtype for t in tensors.values()}
    if len(dts) > 1:
        out.append(Violation(kernel, "all float inputs share one dtype",
                             {k: str(t.dtype) for k, t in tensors.items()},
                             "nc_matmul needs both operands in the same precision class"))
    return out


def _weight_sbuf_bytes(rows: int, cols: int, itemsize: int) -> int:
    """SBUF bytes per partition of a [rows, cols] weight laid out with rows on partitions."""
    return math.ceil(rows / 128) * cols * itemsize


def grouped_mm_constraints(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor,
                           grad_out: torch.Tensor | None = None) -> list[Violation]:
    """Violated constraints of :func:`grouped_mm` / :func:`grouped_mm_bwd` (empty = supported).

    Shapes and dtypes only: never reads a tensor value, so it works on fake / meta tensors and under
    torch.compile (the override registry's selection). The value rules on ``group_offsets``
    (non-decreasing, ``>= 0``, ``offs[-1] <= M``) are checked by the entry points
    (:func:`grouped_mm_value_violations`).
    """
    k = GROUPED_MM
    v: list[Violation] = []
    if x.dim() != 2:
        v.append(Violation(k, "x is 2-D [M, K]", tuple(x.shape)))
    if w.dim() != 3:
        v.append(Violation(k, "w is 3-D [G, K, N]", tuple(w.shape)))
    if group_offsets.dim() != 1:
        v.append(Violation(k, "group_offsets is 1-D [G]", tuple(group_offsets.shape)))
    if v:
        return v
    M, K = x.shape
    G, Kw, N = w.shape
    if Kw != K:
        v.append(Violation(k, "w.shape[1] == x.shape[1] (K)", (Kw, K)))
    if group_offsets.shape[0] != G:
        v.append(Violation(k, "len(group_offsets) == w.shape[0] (G)", (group_offsets.shape[0], G)))
    if not 1 <= G <= MAX_EXPERTS:
        v.append(Violation(k, f"1 <= G <= {MAX_EXPERTS}", G))
    if group_offsets.dtype != torch.int32:
        v.append(Violation(k, "group_offsets.dtype == int32", str(group_offsets.dtype),
                           "torch._grouped_mm offs contract"))
    v += _dtype_violations(k, x=x, w=w, **({} if grad_out is None else {"grad_out": grad_out}))
    if grad_out is not None and tuple(grad_out.shape) != (M, N):
        v.append(Violation(k, "grad_out.shape == (M, N)", tuple(grad_out.shape)))
    isz = x.element_size()
    need = _weight_sbuf_bytes(K, N, isz)
    if grad_out is not None:  # backward also holds w[g] transposed
        need += _weight_sbuf_bytes(N, K, isz)
    if need > WEIGHT_SBUF_BUDGET:
        v.append(Violation(k, f"one group's weights fit {WEIGHT_SBUF_BUDGET // 1024} KiB of SBUF per partition",
                           f"{need} bytes (K={K}, N={N}, {x.dtype})", "use smaller K*N or bfloat16"))
    return v


def variant_violations(x: torch.Tensor, w_gate_up: torch.Tensor, activation: str = "silu",
                       limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA,
                       b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None) -> list[Violation]:
    """The expert variant's rules: a known activation, ``limit``/``alpha`` (finite, > 0) only with
    ``swiglu_clamped``, biases ``b_gate_up [E, 2I]`` / ``b_down [E, H]`` in x's dtype."""
    k = MOE_EXPERTS
    v: list[Violation] = []
    if activation not in ACTIVATIONS:
        v.append(Violation(k, f"activation in {ACTIVATIONS}", activation))
    elif activation == "swiglu_clamped":
        for name, val in (("limit", limit), ("alpha", alpha)):
            if not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                v.append(Violation(k, f"swiglu_clamped {name} is finite and > 0", val))
    elif (limit, alpha) != (SWIGLU_LIMIT, SWIGLU_ALPHA):
        v.append(Violation(k, "limit / alpha only with activation='swiglu_clamped'",
                           {"activation": activation, "limit": limit, "alpha": alpha},
                           "the clamp and the sigmoid slope belong to GPT-OSS's clamped SwiGLU"))
    E, H, I2 = w_gate_up.shape
    for name, b, shape in (("b_gate_up", b_gate_up, (E, I2)), ("b_down", b_down, (E, H))):
        if b is None:
            continue
        if tuple(b.shape) != shape:
            v.append(Violation(k, f"{name}.shape == {('(E, 2I)' if name == 'b_gate_up' else '(E, H)')}",
                               (tuple(b.shape), shape)))
        if b.dtype != x.dtype:
            v.append(Violation(k, f"{name}.dtype == x.dtype", (str(b.dtype), str(x.dtype)),
                               "the bias is added in the kernel next to operands of x's dtype"))
    return v


def moe_experts_constraints(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            w_gate_up: torch.Tensor, w_down: torch.Tensor, block_size: int = 128,
                            grad_out: torch.Tensor | None = None, activation: str = "silu",
                            limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA,
                            b_gate_up: torch.Tensor | None = None,
                            b_down: torch.Tensor | None = None) -> list[Violation]:
    """Violated constraints of :func:`moe_experts` / :func:`moe_experts_bwd` (empty = supported).

    Shapes, dtypes, ``block_size`` and the expert variant (:func:`variant_violations`) only: never
    reads a tensor value (fake / meta tensors and torch.compile are fine). The range ``0 <= topk_idx
    < E`` is data; the entry points check it (:func:`moe_experts_value_violations`).
    """
    k = MOE_EXPERTS
    v: list[Violation] = []
    for name, t, nd in (("x", x, 2), ("topk_idx", topk_idx, 2), ("topk_weights", topk_weights, 2),
                        ("w_gate_up", w_gate_up, 3), ("w_down", w_down, 3)):
        if t.dim() != nd:
            v.append(Violation(k, f"{name} is {nd}-D", tuple(t.shape)))
    if v:
        return v
    T, H = x.shape
    E, Hw, I2 = w_gate_up.shape
    inter = I2 // 2
    K = topk_idx.shape[1]
    if block_size not in BLOCK_SIZES:
        v.append(Violation(k, f"block_size in {BLOCK_SIZES}", block_size))
    if Hw != H:
        v.append(Violation(k, "w_gate_up.shape[1] == H", (Hw, H), "kernel layout is [E, H, 2I]"))
    if I2 % 2:
        v.append(Violation(k, "w_gate_up.shape[2] == 2 * I is even", I2))
    if tuple(w_down.shape) != (E, inter, H):
        v.append(Violation(k, "w_down.shape == (E, I, H)", tuple(w_down.shape)))
    if not 1 <= E <= MAX_EXPERTS:
        v.append(Violation(k, f"1 <= E <= {MAX_EXPERTS}", E))
    if not 1 <= K <= min(MAX_TOP_K, E):
        v.append(Violation(k, f"1 <= K <= min({MAX_TOP_K}, E)", K))
    if T < 1:
        v.append(Violation(k, "T >= 1", T))
    if topk_idx.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_idx.shape):
        v.append(Violation(k, "topk_idx and topk_weights are [T, K]",
                           (tuple(topk_idx.shape), tuple(topk_weights.shape))))
    if topk_idx.dtype not in (torch.int32, torch.int64):
        v.append(Violation(k, "topk_idx.dtype in (int32, int64)", str(topk_idx.dtype)))
    if topk_weights.dtype not in _DTYPES:
        v.append(Violation(k, "topk_weights.dtype in (float32, bfloat16)", str(topk_weights.dtype)))
    v += _dtype_violations(k, x=x, w_gate_up=w_gate_up, w_down=w_down,
                           **({} if grad_out is None else {"grad_out": grad_out}))
    if grad_out is not None and tuple(grad_out.shape) != (T, H):
        v.append(Violation(k, "grad_out.shape == (T, H)", tuple(grad_out.shape)))
    v += variant_violations(x, w_gate_up, activation, limit, alpha, b_gate_up, b_down)
    isz = x.element_size()
    # + the biases: b_down broadcast over the partitions [P, H], b_gate_up as fp32 columns [P, 2 IC]
    need = (_weight_sbuf_bytes(H, I2, isz) + _weight_sbuf_bytes(inter, H, isz)
            + (H * isz if b_down is not None else 0) + (2 * math.ceil(inter / 128) * 4 if b_gate_up is not None else 0))
    if need > WEIGHT_SBUF_BUDGET:
        v.append(Violation(k, f"one expert's weights fit {WEIGHT_SBUF_BUDGET // 1024} KiB of SBUF per partition",
                           f"{need} bytes (H={H}, I={inter}, {x.dtype})",
                           "ceil(H/128)*2I + ceil(I/128)*H elements; use bfloat16 or shard I"))
    if grad_out is not None:  # backward: a weight and its transpose (weight grads accumulate in PSUM)
        bwd = max(_weight_sbuf_bytes(H, I2, isz) + _weight_sbuf_bytes(I2, H, isz)
                  + (I2 * isz if b_gate_up is not None else 0),  # gate/up recompute: bias [P, 2I]
                  _weight_sbuf_bytes(inter, H, isz) + _weight_sbuf_bytes(H, inter, isz))
        if bwd > WEIGHT_SBUF_BUDGET:
            v.append(Violation(k, f"backward working set fits {WEIGHT_SBUF_BUDGET // 1024} KiB per partition",
                               f"{bwd} bytes (H={H}, I={inter}, {x.dtype})"))
    return v


def grouped_mm_value_violations(x: torch.Tensor, group_offsets: torch.Tensor) -> list[Violation]:
    """Value rules of ``group_offsets [G]`` int32 (non-decreasing, ``>= 0``, ``offs[-1] <= M``).

    Reads the offsets (one host read of two flags); run by the entry points after the shape checks.
    """
    offs = group_offsets.long()
    M = x.shape[0]
    bad_order, past_end = torch.stack([(offs[1:] < offs[:-1]).any() | (offs[0] < 0), offs[-1] > M]).tolist()
    v = []
    if bad_order:
        v.append(Violation(GROUPED_MM, "group_offsets non-decreasing and >= 0", group_offsets.tolist()))
    if past_end:
        v.append(Violation(GROUPED_MM, "group_offsets[-1] <= M", (int(offs[-1]), M)))
    return v


def moe_experts_value_violations(topk_idx: torch.Tensor, num_experts: int) -> list[Violation]:
    """Value rule ``0 <= topk_idx < E`` (one host read of the min and max); run by the entry points."""
    lo, hi = torch.stack([topk_idx.min(), topk_idx.max()]).tolist()
    if lo < 0 or hi >= num_experts:
        return [Violation(MOE_EXPERTS, "0 <= topk_idx < E", (lo, hi, num_experts),
                          "an index outside [0, E) would gather another expert's rows or none")]
    return []


def _check_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor,
                      grad_out: torch.Tensor | None = None) -> None:
    """Entry check of the grouped_mm functions: shape/dtype rules, then (if those hold) the values."""
    v = grouped_mm_constraints(x, w, group_offsets, grad_out)
    check(v or grouped_mm_value_violations(x, group_offsets))


def _check_moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor, block_size: int,
                       grad_out: torch.Tensor | None = None, **variant: Any) -> None:
    """Entry check of the moe_experts functions: shape/dtype rules, then (if those hold) the values."""
    v = moe_experts_constraints(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, grad_out, **variant)
    check(v or moe_experts_value_violations(topk_idx, w_gate_up.shape[0]))


def constraints(x: torch.Tensor, *args, **kwargs) -> list[Violation]:
    """Dispatch on the arguments: ``(x, w, group_offsets[, grad_out])`` -> grouped_mm,
    ``(x, topk_idx, topk_weights, w_gate_up, w_down[, block_size][, grad_out])`` -> moe_experts."""
    # by the argument count, not by a shape (a malformed w must still reach grouped_mm's own checks)
    if len(args) >= 4 or {"topk_idx", "topk_weights", "w_gate_up", "w_down", "block_size", "activation",
                          "b_gate_up", "b_down"} & kwargs.keys():
        return moe_experts_constraints(x, *args, **kwargs)
    return grouped_mm_constraints(x, *args, **kwargs)


# --------------------------------------------------------------------------------------------------
# References (plain torch; the oracles of the kernels)
# --------------------------------------------------------------------------------------------------
def _per_group_f32(x: torch.Tensor, w: torch.Tensor, counts: list[int], transpose_w: bool = False) -> torch.Tensor:
    """fp32 ``x_g @ w[g]`` (or ``@ w[g].T``) over consecutive row groups of sizes ``counts``."""
    n_out = w.shape[1] if transpose_w else w.shape[2]
    out = x.new_zeros(x.shape[0], n_out, dtype=torch.float32)
    start = 0
    for g, c in enumerate(counts):
        if c:
            wg = w[g].float()
            out[start:start + c] = x[start:start + c].float() @ (wg.T if transpose_w else wg)
        start += c
    return out


def _group_counts(group_offsets: torch.Tensor) -> list[int]:
    offs = [0] + group_offsets.long().tolist()
    return [b - a for a, b in zip(offs[:-1], offs[1:])]


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`grouped_mm`: fp32 accumulation, output in x.dtype, zero rows past the end."""
    _check_grouped_mm(x, w, group_offsets)
    counts = _group_counts(group_offsets)
    return _per_group_f32(x, w, counts).to(x.dtype)


def grouped_mm_bwd_ref(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor,
                       grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`grouped_mm_bwd`: ``grad_x = grad_out_g @ w[g].T``, ``grad_w[g] = x_g.T @ grad_out_g``."""
    _check_grouped_mm(x, w, group_offsets, grad_out)
    counts = _group_counts(group_offsets)
    grad_x = _per_group_f32(grad_out, w, counts, transpose_w=True).to(x.dtype)
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    start = 0
    for g, c in enumerate(counts):
        grad_w[g] = x[start:start + c].float().T @ grad_out[start:start + c].float()
        start += c
    return grad_x, grad_w.to(w.dtype)


def _sorted_slots(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Slots ``t*K + k`` sorted (stably) by expert, the slot count of each expert, and the expert of
    each sorted slot."""
    flat = topk_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist(), flat[order]


def activation_ref(a: torch.Tensor, u: torch.Tensor, activation: str = "silu", limit: float = SWIGLU_LIMIT,
                   alpha: float = SWIGLU_ALPHA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, dh/da, dh/du)`` in fp32 for gate pre-activations ``a`` and up projections ``u`` (biases
    included), with the kernels' association order.

    * ``silu``: ``h = a sigmoid(a) * u``; ``gelu_tanh``: ``h = gelu_tanh(a) * u`` (written as
      ``a sigmoid(2C (a + A a^3))``, the same function); derivative ``u (s + g (1 - s) z')``.
    * ``swiglu_clamped`` (GPT-OSS): ``ac = min(a, limit)``, ``uc = clamp(u, -limit, limit)``,
      ``h = (uc + 1) * ac sigmoid(alpha ac)``; the clamps pass gradient where the bound is not
      exceeded (bounds inclusive, as ``torch.clamp``).
    """
    a, u = a.float(), u.float()
    if activation == "swiglu_clamped":
        ac = a.clamp(max=limit)
        s = torch.sigmoid(alpha * ac)
        g = ac * s
        up1 = u.clamp(-limit, limit) + 1
        dg = (g * (1 - s) * alpha + s) * (a <= limit)
        return g * up1, up1 * dg, g * ((u >= -limit) & (u <= limit))
    if activation == "gelu_tanh":
        s = torch.sigmoid(a * (a * a * GELU_A + 1) * (2 * GELU_C))
        dz = a * a * (6 * GELU_A * GELU_C) + 2 * GELU_C
    else:
        s, dz = torch.sigmoid(a), 1.0
    g = a * s
    return g * u, u * (g * (1 - s) * dz + s), g


def _variant_kw(activation: str, limit: float, alpha: float) -> dict[str, Any]:
    return {"activation": activation, "limit": limit, "alpha": alpha}


def moe_experts_ref(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, block_size: int = 128,
                    activation: str = "silu", limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA,
                    b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`moe_experts` (same rounding points as the kernel; block_size is ignored:
    padding does not change the result). Biases are added in fp32 before the activation / before the
    affinity scaling: ``out[t] = sum_k w * (act(x W_gu + b_gu) @ W_d + b_d)``."""
    var = _variant_kw(activation, limit, alpha)
    _check_moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, b_gate_up=b_gate_up,
                       b_down=b_down, **var)
    T, H = x.shape
    K = topk_idx.shape[1]
    inter = w_down.shape[1]
    order, counts, exp = _sorted_slots(topk_idx, w_gate_up.shape[0])
    xs = x[order // K]
    gu = _per_group_f32(xs, w_gate_up, counts)
    if b_gate_up is not None:
        gu = gu + b_gate_up[exp].float()
    h = activation_ref(gu[:, :inter], gu[:, inter:], **var)[0].to(x.dtype)
    y = _per_group_f32(h, w_down, counts)
    if b_down is not None:
        y = y + b_down[exp].float()
    ys = (topk_weights.reshape(-1)[order].float()[:, None] * y).to(x.dtype)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    out.index_add_(0, order // K, ys.float())
    return out.to(x.dtype)


def _sum_per_group(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """fp32 ``[G, W]``: the sum of each group's consecutive rows."""
    return torch.stack([part.sum(0) for part in rows.float().split(counts)])


def moe_experts_bwd_ref(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        w_gate_up: torch.Tensor, w_down: torch.Tensor, grad_out: torch.Tensor,
                        block_size: int = 128, activation: str = "silu", limit: float = SWIGLU_LIMIT,
                        alpha: float = SWIGLU_ALPHA, b_gate_up: torch.Tensor | None = None,
                        b_down: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """Reference of :func:`moe_experts_bwd` -> (grad_x, grad_topk_weights, grad_w_gate_up, grad_w_down)
    and, when a bias is given, (grad_b_gate_up, grad_b_down) after them (None for an absent bias).

    Mirrors the kernels' rounding points: the recomputed gate/up (bias added), ``grad_out @ w_down.T``,
    ``h``, ``w * h`` and the gate/up gradients are rounded to the input dtype (the data-path kernel
    rounds them there too; ``<grad_out, b_down>``, rounded here, stays fp32 in the kernel); ``grad_b_down``
    sums ``w * grad_out`` with ``w`` in the input dtype.
    """
    var = _variant_kw(activation, limit, alpha)
    _check_moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, grad_out, b_gate_up=b_gate_up,
                       b_down=b_down, **var)
    T, H = x.shape
    K = topk_idx.shape[1]
    inter = w_down.shape[1]
    dt = x.dtype
    order, counts, exp = _sorted_slots(topk_idx, w_gate_up.shape[0])
    tok = order // K
    xs, gs = x[tok], grad_out[tok]
    ws = topk_weights.reshape(-1)[order].float()[:, None]
    gu = _per_group_f32(xs, w_gate_up, counts)
    if b_gate_up is not None:
        gu = gu + b_gate_up[exp].float()
    gu = gu.to(dt).float()
    ghp = _per_group_f32(gs, w_down, counts, transpose_w=True).to(dt).float()  # grad_out @ w_down[e].T
    h, dh_da, dh_du = activation_ref(gu[:, :inter], gu[:, inter:], **var)
    h = h.to(dt).float()
    gw = (ghp * h).sum(-1)  # d out / d w = <grad_out, y> = <grad_out @ w_down.T, h> (+ <grad_out, b_down>)
    if b_down is not None:
        gw = gw + (gs.float() * b_down[exp].float()).sum(-1).to(dt).float()
    hw = (ws * h).to(dt).float()
    gh = ws * ghp
    dgu = torch.cat([(gh * dh_da).to(dt), (gh * dh_du).to(dt)], dim=1).float()
    grad_wd = torch.zeros(w_down.shape, dtype=torch.float32, device=x.device)
    grad_wgu = torch.zeros(w_gate_up.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        sl = slice(start, start + c)
        grad_wd[e] = hw[sl].T @ gs[sl].float()
        grad_wgu[e] = xs[sl].float().T @ dgu[sl]
        start += c
    gxs = _per_group_f32(dgu, w_gate_up, counts, transpose_w=True).to(dt)
    grad_x = torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, tok, gxs.float()).to(dt)
    grad_tw = torch.empty(T * K, dtype=torch.float32, device=x.device)
    grad_tw[order] = gw
    grads = (grad_x, grad_tw.view(T, K).to(topk_weights.dtype), grad_wgu.to(w_gate_up.dtype),
             grad_wd.to(w_down.dtype))
    if b_gate_up is None and b_down is None:
        return grads
    grad_bgu = None if b_gate_up is None else _sum_per_group(dgu, counts).to(b_gate_up.dtype)
    grad_bd = None if b_down is None else _sum_per_group(ws.to(dt).float() * gs.float(), counts).to(b_down.dtype)
    return (*grads, grad_bgu, grad_bd)


# --------------------------------------------------------------------------------------------------
# NKI entry points
# --------------------------------------------------------------------------------------------------
def _moe_layout(topk_idx: torch.Tensor, num_experts: int, block_size: int,
                lnc: int = 1) -> tuple[BlockLayout, torch.Tensor]:
    """Slot layout (pad = T*K) and the token id of each block position (:func:`_slot_tokens`)."""
    T, K = topk_idx.shape
    lay = block_layout(topk_idx.reshape(-1), num_experts, block_size, pad=T * K, lnc=lnc)
    return lay, _slot_tokens(lay, K)


def _slot_tokens(lay: BlockLayout, K: int) -> torch.Tensor:
    """``[NB, B]`` int32 token id of each position of a slot layout; padding positions name token 0, so
    every gathered row is finite (a Tensor Engine transpose would spread a NaN of an unwritten row over
    the whole tile) and, with affinity 0 (:func:`_position_weights`), contributes exact zeros."""
    slot = lay.table.long()
    return torch.where(slot < lay.pad, slot // K, torch.zeros_like(slot)).to(torch.int32)


def _position_weights(topk_weights: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """``[NB, B]`` fp32 affinity of each position of a slot layout (``topk_weights`` flattened in slot
    order); 0 at padding positions."""
    slot = lay.table.long()
    w = topk_weights.reshape(-1).float()
    return torch.where(slot < lay.pad, w[slot.clamp(max=lay.pad - 1)], torch.zeros((), device=w.device))


def _tail_layout(topk_idx: torch.Tensor, num_experts: int, block_size: int,
                 lnc: int = 1) -> tuple[BlockLayout, torch.Tensor]:
    """The forward's slot layout and its ``[1, (n + 1)(E' + 1)]`` int32 row ``[block_start | b_1 | .. |
    b_n]`` for the kernel's n narrower tail widths (``moe_fused.tail_widths``): an expert's last block
    moves to the narrowest width that holds its used rows (its *class* j, 0: full width B), and its
    blocks are ``start .. b_1 - 1`` at width B, then ``b_j .. b_(j+1) - 1`` (0 or 1 block) at width j.

    ``lnc=2`` (E' = E rounded up to even): expert j of core 0 and expert j of core 1 get the larger
    full-width block count of the two and a block in every class either has (:func:`paired`), so both
    cores run every segment's loop the same number of times; the extra blocks are padding. With
    ``lnc=1`` this is :func:`block_layout`'s layout (each expert's blocks, its tail block last)."""
    from trnkit.kernels.moe_fused import tail_widths

    T, K = topk_idx.shape
    B = block_size
    widths = tail_widths(B)
    g = topk_idx.reshape(-1).long()
    dev = g.device
    counts = torch.bincount(g, minlength=num_experts)
    rem = counts % B
    cls = torch.zeros_like(counts)  # 0: full width (or no partial block); j: widths[j-1]
    for j, w in enumerate(widths, start=1):
        cls = torch.where((rem > 0) & (rem <= w), torch.full_like(cls, j), cls)
    own_full = (counts + B - 1) // B - (cls > 0).long()  # the expert's own full-width blocks
    classes = torch.arange(1, len(widths) + 1, device=dev)
    full = paired(own_full, lnc)
    has = paired((cls[:, None] == classes[None, :]).long(), lnc)  # [E', n]: a block of class j
    blocks = full + has.sum(1)
    start = torch.zeros(blocks.shape[0] + 1, dtype=torch.int64, device=dev)
    start[1:] = torch.cumsum(blocks, 0)
    rows = [start]
    b_j = start[:-1] + full
    for j in range(len(widths)):
        rows.append(torch.cat([b_j, start[-1:]]))
        b_j = b_j + has[:, j]
    split = torch.cat(rows).view(1, -1).to(torch.int32)  # one SBUF partition row
    # items: rank r of expert e -> its full-width blocks, the rest (r >= own_full * B) to its class block
    nb = lnc * max_blocks(g.numel(), num_experts, B)
    table = torch.full((nb * B,), T * K, dtype=torch.int64, device=dev)
    if g.numel():
        order = torch.argsort(g, stable=True)
        e = g[order]
        rank = torch.arange(g.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[e]
        before = torch.cat([torch.zeros_like(full[:, None]), torch.cumsum(has, 1)], 1)  # classes < j present
        tail_blk = start[:-1][e] + full[e] + before[e, cls[e].clamp(min=1) - 1]
        in_full = rank < own_full[e] * B
        pos = torch.where(in_full, start[e] * B + rank, tail_blk * B + rank - own_full[e] * B)
        table[pos] = order
    lay = BlockLayout(table.view(nb, B).to(torch.int32), start.view(1, -1).to(torch.int32), B, T * K)
    return lay, split


def _flagged(table: torch.Tensor, split: torch.Tensor, num_experts: int, lnc: int = 1) -> torch.Tensor:
    """A per-block id table ``[NB + 1, B]`` (row NB: padding) -> ``moe_experts_kernel``'s layout
    ``[NB + 1, rows, nsub + 3]``: the ids as :func:`_per_block` lays them out, then the flags that tell
    ``moe_fused.move_block_rows`` how many rows the block runs at (the same on every partition):
    "wider than 64 rows", "at most 64 rows", "wider than one 128-row sub-tile" (``rows`` instead of 64
    when rows <= 64). A block's run width comes from ``split`` (:func:`_tail_layout`): B, or its
    expert's tail width for an expert's narrower last block; unused blocks and row NB count as 64
    (their ids are padding). ``lnc=2``: the first unused row (core 1's look-ahead past its last block)
    gets the flags of core 1's first block (core 0's look-ahead past its last), so both cores' gathers
    run the same 0/1-trip loops."""
    from trnkit.kernels.moe_fused import HALF, tail_widths

    num_experts = split.shape[1] // (len(tail_widths(table.shape[1])) + 1) - 1  # the layout's (LNC=2: even)
    NB = table.shape[0] - 1
    B = table.shape[1]
    rows = min(B, 128)
    half = min(HALF, rows)
    widths = (B,) + tail_widths(B)
    bounds = split.view(len(widths), num_experts + 1).long()
    start = bounds[0]
    run = torch.full((NB + 1,), half, dtype=torch.int64, device=table.device)
    run[:NB] = torch.where(torch.arange(NB, device=table.device) < start[-1], B, half)
    for j in range(1, len(widths)):  # an expert's class-j tail block (at most one): b_j .. b_(j+1) - 1
        end = bounds[j + 1, :-1] if j + 1 < len(widths) else start[1:]
        first = bounds[j, :-1]
        run[torch.where(first < end, first, torch.full_like(first, NB))] = widths[j]
    run[NB] = half
    if lnc == 2:  # core 1's look-ahead past its last block runs like core 0's into core 1's first block
        run[start[-1]] = run[start[num_experts // 2]]
    flags = torch.stack([run > half, run <= half, run > rows], 1).to(torch.int32)  # moe_fused.FLAG_*
    return torch.cat([_per_block(table), flags[:, None, :].expand(NB + 1, rows, 3)], 2).contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor,
               block_size: int = 128, lnc: int | None = None) -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]`` on the NKI kernel; rows past ``offs[-1]`` are zero.

    ``lnc``: 1 or 2 physical cores (None: :func:`trnkit.kernels.lnc.default_lnc`); the cores split the
    groups, results are identical."""
    from trnkit.kernels import moe_grouped_mm as K_  # imports the NKI backend lazily

    _check_grouped_mm(x, w, group_offsets)
    lnc = resolve_lnc(lnc)
    M = x.shape[0]
    lay = block_layout(_group_of_row(group_offsets, M), w.shape[0], block_size, pad=M, lnc=lnc)
    out = torch.zeros(M, w.shape[2], dtype=x.dtype, device=x.device)
    return launch(K_.grouped_mm_kernel, lnc)(x.contiguous(), w.contiguous(), lay.table, lay.table,
                                             lay.block_start, out, False)


def grouped_mm_bwd(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, grad_out: torch.Tensor,
                   block_size: int = 128, lnc: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_w)`` of :func:`grouped_mm` on NKI kernels (grad_x: grouped matmul with
    ``w[g].T``; grad_w: per-group ``x_g.T @ grad_out_g`` accumulated over blocks in fp32)."""
    from trnkit.kernels import moe_grouped_mm as K_

    _check_grouped_mm(x, w, group_offsets, grad_out)
    lnc = resolve_lnc(lnc)
    M = x.shape[0]
    lay = block_layout(_group_of_row(group_offsets, M), w.shape[0], block_size, pad=M, lnc=lnc)
    x, w, grad_out = x.contiguous(), w.contiguous(), grad_out.contiguous()
    grad_x = torch.zeros(M, w.shape[1], dtype=x.dtype, device=x.device)
    grad_x = launch(K_.grouped_mm_kernel, lnc)(grad_out, w, lay.table, lay.table, lay.block_start, grad_x, True)
    grad_w = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    counts = torch.diff(group_offsets.long(), prepend=group_offsets.new_zeros(1).long())
    grad_w = launch(K_.grouped_wgrad_kernel, lnc)(x, grad_out, _row_tiles(lay.table),
                                                  _wgrad_bounds(lay, counts, lnc), grad_w, True)
    return grad_x, grad_w


def _row_tiles(t: torch.Tensor) -> torch.Tensor:
    """``[NB, B, ...]`` (a block table or a dispatch-order tensor) viewed as row tiles ``[NB * B / rows,
    rows, ...]``, rows = min(B, 128): the weight-gradient kernels' unit of work."""
    NB, B = t.shape[:2]
    rows = min(B, 128)
    return t.view(NB * B // rows, rows, *t.shape[2:])


def _wgrad_bounds(lay: BlockLayout, counts: torch.Tensor, lnc: int = 1) -> torch.Tensor:
    """``[1, G * (S + 3)]`` int32 (S = ``moe_grouped_mm.WGRAD_MAX_SLOTS``), per group g with n row tiles
    (of :func:`_row_tiles`) from tile lo: ``e_j = lo + min(j, n)`` for j = 0..S, ``hi = lo + n``, ``z = lo +
    (n == 0)`` -- the bounds of the weight-gradient kernels' 0/1-trip loops (cache slot j holds tile
    e_j when e_j < e_(j+1); tiles e_S .. hi-1 are gathered per pass; z: an empty group writes zeros).
    ``lnc=2``: the tile counts :func:`paired` like the blocks of ``lay`` (a layout made for LNC=2), so
    both cores run the same loops (a group's padding tiles add zero rows)."""
    from trnkit.kernels.moe_grouped_mm import WGRAD_MAX_SLOTS

    rows = min(lay.block_size, 128)
    lo = lay.block_start[0, :-1].long() * (lay.block_size // rows)
    n = paired((counts.long() + rows - 1) // rows, lnc)
    j = torch.arange(WGRAD_MAX_SLOTS + 1, device=lo.device)
    e = lo[:, None] + torch.minimum(j[None, :], n[:, None])
    cols = [e, (lo + n)[:, None], (lo + (n == 0).long())[:, None]]
    return torch.cat(cols, 1).reshape(1, -1).to(torch.int32)  # one SBUF partition row


def _per_block(table: torch.Tensor) -> torch.Tensor:
    """``[NB, B]`` -> ``[NB, rows, B // rows]`` (rows = min(B, 128); position ``sub*rows + p`` at
    ``[p, sub]``): a block's values load with one DMA, one column per 128-row sub-tile."""
    NB, B = table.shape
    rows = min(B, 128)
    return table.view(NB, B // rows, rows).transpose(1, 2).contiguous()


def moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor, block_size: int = FWD_BLOCK_SIZE,
                lnc: int | None = None, activation: str = "silu", limit: float = SWIGLU_LIMIT,
                alpha: float = SWIGLU_ALPHA, b_gate_up: torch.Tensor | None = None,
                b_down: torch.Tensor | None = None) -> torch.Tensor:
    """Fused gated experts on the NKI kernel (see the module docstring); returns ``[T, H]`` in x.dtype.
    ``block_size``: slots per expert block (the result does not depend on it; 512 lets every gate/up
    matmul stream 512 token columns). ``lnc``: 1 or 2 physical cores (None:
    :func:`trnkit.kernels.lnc.default_lnc`). ``activation`` (``silu | gelu_tanh | swiglu_clamped`` with ``limit``,
    ``alpha``) and the optional biases
    ``b_gate_up [E, 2I]``, ``b_down [E, H]``: :func:`activation_ref` / :func:`moe_experts_ref`."""
    from trnkit.kernels import moe_fused as K_

    _check_moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, activation=activation,
                       limit=limit, alpha=alpha, b_gate_up=b_gate_up, b_down=b_down)
    lnc = resolve_lnc(lnc)
    T, K = topk_idx.shape
    E = w_gate_up.shape[0]
    lay, split = _tail_layout(topk_idx, E, block_size, lnc)
    token = _slot_tokens(lay, K)  # padding positions: token 0, results never stored
    weights = _position_weights(topk_weights, lay)
    slots = torch.cat([lay.table, torch.full_like(lay.table[:1], T * K)])  # + the all-padding row NB
    token = torch.cat([token, torch.zeros_like(token[:1])])  # row NB: the last block's look-ahead
    slot_pages = _with_previous(_flagged(slots, split, E, lnc), lay.block_start, lnc)
    return launch(K_.moe_experts_kernel, lnc)(x.contiguous(), w_gate_up.contiguous(), w_down.contiguous(),
                                              _flagged(token, split, E, lnc), slot_pages, split,
                                              _per_block(weights), K, activation, float(limit), float(alpha),
                                              _dense(b_gate_up), _dense(b_down))


def _with_previous(table: torch.Tensor, block_start: torch.Tensor, lnc: int) -> torch.Tensor:
    """A flagged slot table ``[NB + 1, ...]`` (row NB: padding) and below it its second page: row r = the
    row of the block before r, the padding row for the first block of each core's part (``block_start
    [1, E' + 1]``, E' / ``lnc`` experts per core), so block r scatters the rows its predecessor left
    without a block id carried across loop iterations (``moe_fused._expert_blocks``)."""
    NB = table.shape[0] - 1
    start = block_start[0].long()
    prev = torch.cat([table[NB:], table[:NB]])  # row r <- row r - 1; row 0 <- the padding row
    E = start.shape[0] - 1
    firsts = torch.clamp(start[torch.arange(lnc, device=start.device) * (E // lnc)], max=NB)
    prev[firsts] = table[NB]
    return torch.cat([table, prev]).contiguous()


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def moe_experts_bwd(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, grad_out: torch.Tensor,
                    block_size: int = 128, lnc: int | None = None, activation: str = "silu",
                    limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA,
                    b_gate_up: torch.Tensor | None = None,
                    b_down: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """Backward of :func:`moe_experts` on NKI kernels (activations are recomputed):
    ``(grad_x, grad_topk_weights, grad_w_gate_up, grad_w_down)``, followed by ``(grad_b_gate_up,
    grad_b_down)`` when a bias is given (None for an absent one).

    1. the fused data path (:func:`trnkit.kernels.moe_bwd.moe_bwd_kernel`): per block of an expert's
       slots the gate/up recompute, ``grad_out @ w_down.T``, the activation backward,
       ``grad_topk_weights``, ``w*h`` and ``dgu`` (written in dispatch order for step 2), ``dgu @
       w_gate_up.T`` per slot and the sum over each token's K slots (``grad_x``);
    2. weight gradients ``grad_w_down[e] = sum (w h).T grad_out``, ``grad_w_gate_up[e] = sum x.T dgu``
       and the bias gradients ``grad_b_down[e] = sum w grad_out``, ``grad_b_gate_up[e] = sum dgu``
       (:func:`_expert_weight_grads`).

    ``lnc=2``: every kernel runs on both cores, each on the same half of the experts (step 2 only reads
    what the same core wrote in step 1); the data path's combine waits at one ``core_barrier``.
    """
    from trnkit.kernels import moe_bwd as KB

    _check_moe_experts(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, grad_out, activation=activation,
                       limit=limit, alpha=alpha, b_gate_up=b_gate_up, b_down=b_down)
    lnc = resolve_lnc(lnc)
    T = x.shape[0]
    K = topk_idx.shape[1]
    E = w_gate_up.shape[0]
    x, grad_out = x.contiguous(), grad_out.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    lay, token = _moe_layout(topk_idx, E, block_size, lnc)
    NB, B = lay.table.shape
    dev = x.device
    slot = lay.table.long()
    used = slot < T * K
    weights = topk_weights.reshape(-1, 1).float()
    # padding positions gather token 0 (finite rows) with affinity 0, so their w*h and dgu are exact zeros
    block_weights = _position_weights(weights, lay)
    slots = torch.cat([lay.table, torch.full_like(lay.table[:1], T * K)])  # + the all-padding row NB
    # every kernel's outputs are taken from its return value (on a device the returned tensors are the
    # ones to use)
    hw, dgu, gw_blocks, grad_x = launch(KB.moe_bwd_kernel, lnc)(
        x, grad_out, w_gate_up, w_down, _per_block(token), _per_block(slots), lay.block_start,
        _per_block(block_weights), K, activation, float(limit), float(alpha), _dense(b_gate_up), _dense(b_down))
    dgu = dgu[:NB]  # (slab NB: the kernel's read-ahead margin)
    gw_disp = gw_blocks.transpose(1, 2).reshape(NB, B)  # back from the per-block layout of _per_block
    gw = torch.zeros(T * K, dtype=torch.float32, device=dev)
    gw[slot[used]] = gw_disp[used]
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
    from trnkit.kernels import moe_grouped_mm as KG

    T, H = x.shape
    K = topk_idx.shape[1]
    I = hw.shape[2]  # noqa: E741
    E = lay.block_start.shape[1] - 1 if num_experts is None else num_experts
    dt, dev = x.dtype, x.device
    table = _row_tiles(_slot_tokens(lay, K))
    bounds = _wgrad_bounds(lay, torch.bincount(topk_idx.reshape(-1).long(), minlength=E), lnc)
    wgrad2 = launch(KG.grouped_wgrad2_kernel, lnc)
    grad_wgu = torch.empty(E, H, 2 * I, dtype=dt, device=dev)
    grad_wd = torch.empty(E, I, H, dtype=dt, device=dev)
    grad_wd, grad_wgu = wgrad2(_row_tiles(hw), grad_out, x, _row_tiles(dgu), table, bounds, grad_wd, grad_wgu)
    if b_gate_up is None and b_down is None:
        return grad_wgu, grad_wd, None, None
    # biases: sum of dgu (a ones column) and of w * grad_out over the expert's slots, one launch
    ops, grads = [], []
    if b_gate_up is not None:
        ops += [torch.ones(T, 1, dtype=dt, device=dev), _row_tiles(dgu)]
        grads.append(torch.empty(E, 1, 2 * I, dtype=dt, device=dev))
    if b_down is not None:
        ops += [_row_tiles(_position_weights(weights, lay).to(dt).unsqueeze(-1)), grad_out]
        grads.append(torch.empty(E, 1, H, dtype=dt, device=dev))
    if len(grads) == 2:
        grads = list(wgrad2(*ops, table, bounds, *grads))
    else:
        grads = [launch(KG.grouped_wgrad_kernel, lnc)(*ops, table, bounds, grads[0])]
    grad_bgu = None if b_gate_up is None else grads[0].view(E, 2 * I)
    grad_bd = None if b_down is None else grads[-1].view(E, H)
    return grad_wgu, grad_wd, grad_bgu, grad_bd
