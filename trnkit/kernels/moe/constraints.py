"""Declared input constraints of the MoE kernels (:func:`~trnkit.kernels.moe.grouped_mm`,
:func:`~trnkit.kernels.moe.moe_experts` and their backwards) and the limits they are built from.

The ``*_constraints`` functions read shapes, dtypes and settings only (fake / meta tensors and
torch.compile are fine: the override registry's selection); the ``*_value_violations`` read the routing
values and run in the entry points (``check_*``), which add for the NKI kernels the widths of
:func:`zero_width_violations` (the references compute those).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trnkit.kernels._common import dtype_name
from trnkit.kernels.constraints import Violation, check

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


def _dtype_violations(kernel: str, **tensors: torch.Tensor) -> list[Violation]:
    out = []
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            out.append(Violation(kernel, f"{name}.dtype in (float32, bfloat16)", dtype_name(t)))
    dts = {t.dtype for t in tensors.values()}
    if len(dts) > 1:
        out.append(Violation(kernel, "all float inputs share one dtype",
                             {k: dtype_name(t) for k, t in tensors.items()},
                             "nc_matmul needs both operands in the same precision class"))
    return out


def weight_sbuf_bytes(rows: int, cols: int, itemsize: int) -> int:
    """SBUF bytes per partition of a [rows, cols] weight laid out with rows on partitions."""
    return math.ceil(rows / 128) * cols * itemsize


# The expert kernels' SBUF per partition (moe_fused.SBUF_BYTES, the interpreter's nki-library budget) and the
# bytes the estimates below leave for their small tiles (block tables, affinities, PSUM evacuations): the
# forward needs 8 KiB (moe_fused._prefetch_fits); the backward data path's fp32 activation temporaries ~18 KiB.
BLOCK_SBUF_BYTES = 208 * 1024
FWD_SMALL_TILES = 8 * 1024
BWD_SMALL_TILES = 24 * 1024


def block_sbuf_bytes(H: int, inter: int, block_size: int, itemsize: int, backward: bool = False,
                     b_gate_up: bool = False, b_down: bool = False) -> int:
    """SBUF bytes per partition an expert kernel needs at ``block_size`` slots per block, without the second
    expert's prefetched weights (which the kernels load only when they fit). Besides one expert's weights the
    blocks' token rows scale with H: the forward keeps a block's x.T (``ceil(H/128) * B``), h.T and two sets of
    ``B / 128`` row tiles of H (the next block's gathered rows, the last block's outputs), ``moe_fused``'s
    ``_prefetch_fits`` without the prefetch; the backward data path (``moe_bwd``) keeps ``B / 128`` row tiles of
    H and of 2I across its phases, phase 1 the weights, ``w_down.T`` and a sub-tile's x.T and grad_out.T,
    phase 2 ``w_gate_up.T``, the next expert's weights and a block's dgu.T. Checked against the interpreter's
    SBUF peak (tests/kernels/moe/test_moe.py, ``test_block_size_narrows_to_the_sbuf``)."""
    rows, nsub = min(block_size, 128), max(1, block_size // 128)
    HC, IC, IC2 = math.ceil(H / 128), math.ceil(inter / 128), math.ceil(2 * inter / 128)
    weights = weight_sbuf_bytes(H, 2 * inter, itemsize) + weight_sbuf_bytes(inter, H, itemsize)
    if not backward:
        bias = (H * itemsize if b_down else 0) + (2 * IC * (4 + itemsize) if b_gate_up else 0)
        work = (HC * block_size + IC * block_size + 2 * nsub * H) * itemsize
        return weights + bias + work + FWD_SMALL_TILES
    bias = 2 * inter * itemsize if b_gate_up else 0
    rows_held = nsub * (H + 2 * inter) * itemsize
    phase1 = weights + (HC * inter + 2 * HC * rows) * itemsize
    phase2 = weights + (IC2 * H + nsub * IC2 * rows) * itemsize
    return rows_held + max(phase1, phase2) + bias + BWD_SMALL_TILES


def fitting_block_size(H: int, inter: int, block_size: int, itemsize: int, backward: bool = False,
                       b_gate_up: bool = False, b_down: bool = False) -> int | None:
    """The widest block size of :data:`BLOCK_SIZES` up to ``block_size`` whose blocks fit SBUF
    (:func:`block_sbuf_bytes`), None if not even the narrowest does. The results do not depend on the block
    size, so the entry points run at this one: a block of 512 slots of a wide H (fp32 H = 3072 near the weight
    budget, H = 7168) would overflow SBUF where 128 fits."""
    for b in sorted(BLOCK_SIZES, reverse=True):
        if b <= block_size and block_sbuf_bytes(H, inter, b, itemsize, backward, b_gate_up, b_down) \
                <= BLOCK_SBUF_BYTES:
            return b
    return None


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
        v.append(Violation(k, "group_offsets.dtype == int32", dtype_name(group_offsets),
                           "torch._grouped_mm offs contract"))
    v += _dtype_violations(k, x=x, w=w, **({} if grad_out is None else {"grad_out": grad_out}))
    if grad_out is not None and tuple(grad_out.shape) != (M, N):
        v.append(Violation(k, "grad_out.shape == (M, N)", tuple(grad_out.shape)))
    isz = x.element_size()
    need = weight_sbuf_bytes(K, N, isz)
    if grad_out is not None:  # backward also holds w[g] transposed
        need += weight_sbuf_bytes(N, K, isz)
    if need > WEIGHT_SBUF_BUDGET:
        v.append(Violation(k, f"one group's weights fit {WEIGHT_SBUF_BUDGET // 1024} KiB of SBUF per partition",
                           f"{need} bytes (K={K}, N={N}, {dtype_name(x)})", "use smaller K*N or bfloat16"))
    return v


def variant_violations(x: torch.Tensor, w_gate_up: torch.Tensor, activation: str = "silu",
                       limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA,
                       b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None) -> list[Violation]:
    """The expert variant's rules: a known activation, ``limit``/``alpha`` (finite numbers > 0) only with
    ``swiglu_clamped``, biases ``b_gate_up [E, 2I]`` / ``b_down [E, H]`` in x's dtype."""
    k = MOE_EXPERTS
    v: list[Violation] = []
    if activation not in ACTIVATIONS:
        v.append(Violation(k, f"activation in {ACTIVATIONS}", activation))
    elif activation == "swiglu_clamped":
        for name, val in (("limit", limit), ("alpha", alpha)):
            # comparisons, not math.isfinite: under torch.compile(dynamic=True) they are symbolic floats
            # (NaN fails the comparison)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0 < val < math.inf:
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
            v.append(Violation(k, f"{name}.dtype == x.dtype", (dtype_name(b), dtype_name(x)),
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
        v.append(Violation(k, "topk_idx.dtype in (int32, int64)", dtype_name(topk_idx)))
    if topk_weights.dtype not in _DTYPES:
        v.append(Violation(k, "topk_weights.dtype in (float32, bfloat16)", dtype_name(topk_weights)))
    v += _dtype_violations(k, x=x, w_gate_up=w_gate_up, w_down=w_down,
                           **({} if grad_out is None else {"grad_out": grad_out}))
    if grad_out is not None and tuple(grad_out.shape) != (T, H):
        v.append(Violation(k, "grad_out.shape == (T, H)", tuple(grad_out.shape)))
    v += variant_violations(x, w_gate_up, activation, limit, alpha, b_gate_up, b_down)
    isz = x.element_size()
    # + the biases: b_down broadcast over the partitions [P, H], b_gate_up as fp32 columns [P, 2 IC]
    need = (weight_sbuf_bytes(H, I2, isz) + weight_sbuf_bytes(inter, H, isz)
            + (H * isz if b_down is not None else 0) + (2 * math.ceil(inter / 128) * 4 if b_gate_up is not None else 0))
    if need > WEIGHT_SBUF_BUDGET:
        v.append(Violation(k, f"one expert's weights fit {WEIGHT_SBUF_BUDGET // 1024} KiB of SBUF per partition",
                           f"{need} bytes (H={H}, I={inter}, {dtype_name(x)})",
                           "ceil(H/128)*2I + ceil(I/128)*H elements; use bfloat16 or shard I"))
    if grad_out is not None:  # backward: a weight and its transpose (weight grads accumulate in PSUM)
        bwd = max(weight_sbuf_bytes(H, I2, isz) + weight_sbuf_bytes(I2, H, isz)
                  + (I2 * isz if b_gate_up is not None else 0),  # gate/up recompute: bias [P, 2I]
                  weight_sbuf_bytes(inter, H, isz) + weight_sbuf_bytes(H, inter, isz))
        if bwd > WEIGHT_SBUF_BUDGET:
            v.append(Violation(k, f"backward working set fits {WEIGHT_SBUF_BUDGET // 1024} KiB per partition",
                               f"{bwd} bytes (H={H}, I={inter}, {dtype_name(x)})"))
    if v or min(H, inter) < 1:
        return v
    # the token rows of a block scale with H: the entry points narrow the blocks until they fit
    # (fitting_block_size); refused where not even the narrowest block does
    smallest = min(BLOCK_SIZES)
    for backward in (False, True) if grad_out is not None else (False,):
        need = block_sbuf_bytes(H, inter, smallest, isz, backward, b_gate_up is not None, b_down is not None)
        if need > BLOCK_SBUF_BYTES:
            what = "backward" if backward else "forward"
            v.append(Violation(k, f"the {what}'s weights and a block of {smallest} slots fit "
                                  f"{BLOCK_SBUF_BYTES // 1024} KiB of SBUF per partition",
                               f"{need} bytes (H={H}, I={inter}, {dtype_name(x)})",
                               "a block's token rows of H elements stay in SBUF: use bfloat16 or a smaller H"))
    return v


def zero_width_violations(kernel: str, x: torch.Tensor, w: torch.Tensor) -> list[Violation]:
    """The NKI kernels' rule ``K, N >= 1`` (``grouped_mm``: x ``[M, K]``, w ``[G, K, N]``) / ``H, I >= 1``
    (``moe_experts``: x ``[T, H]``, ``w_gate_up [E, H, 2I]``).

    A width of 0 would stop the interpreter deep in the kernel (``nl.ndarray: ... shape (128, 0) must be
    positive ints``); the references compute it (an empty product), so the rule is not in the
    ``*_constraints`` the references share: the kernels' entry checks add it (``nki=True``) and the override
    registry's ``nki`` impls declare it. Shapes only (fake tensors and torch.compile are fine).
    """
    if x.dim() != 2 or w.dim() != 3:
        return []  # the shape rules name the malformed shapes
    gmm = kernel == GROUPED_MM
    names, widths = ("K, N", (x.shape[1], w.shape[2])) if gmm else ("H, I", (x.shape[1], w.shape[2] // 2))
    if min(widths) >= 1:
        return []
    return [Violation(kernel, f"{names} >= 1", widths, "a kernel tile row has at least one element")]


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


def check_grouped_mm(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor,
                      grad_out: torch.Tensor | None = None, *, nki: bool = False) -> None:
    """Entry check of the grouped_mm functions: shape/dtype rules (``nki``: and the kernels' widths,
    :func:`zero_width_violations`), then (if those hold) the values."""
    v = grouped_mm_constraints(x, w, group_offsets, grad_out)
    v += zero_width_violations(GROUPED_MM, x, w) if nki else []
    check(v or grouped_mm_value_violations(x, group_offsets))


def check_moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor, block_size: int,
                       grad_out: torch.Tensor | None = None, *, nki: bool = False, **variant: Any) -> None:
    """Entry check of the moe_experts functions: shape/dtype rules (``nki``: and the kernels' widths,
    :func:`zero_width_violations`), then (if those hold) the values."""
    v = moe_experts_constraints(x, topk_idx, topk_weights, w_gate_up, w_down, block_size, grad_out, **variant)
    v += zero_width_violations(MOE_EXPERTS, x, w_gate_up) if nki else []
    check(v or moe_experts_value_violations(topk_idx, w_gate_up.shape[0]))


def constraints(x: torch.Tensor, *args, **kwargs) -> list[Violation]:
    """Dispatch on the arguments: ``(x, w, group_offsets[, grad_out])`` -> grouped_mm,
    ``(x, topk_idx, topk_weights, w_gate_up, w_down[, block_size][, grad_out])`` -> moe_experts."""
    # by the argument count, not by a shape (a malformed w must still reach grouped_mm's own checks)
    if len(args) >= 4 or {"topk_idx", "topk_weights", "w_gate_up", "w_down", "block_size", "activation",
                          "b_gate_up", "b_down"} & kwargs.keys():
        return moe_experts_constraints(x, *args, **kwargs)
    return grouped_mm_constraints(x, *args, **kwargs)
