"""Whole-step estimate: one Qwen3 train step on trn2 from its NKI kernels under the cost model.

``python -m trnkit.bench step --flavor 0.6B --seq 4096 --batch 1 --lnc 2`` traces one decoder layer's
forward and backward, every op through a trnkit NKI kernel (the interpreter in trace-only mode), and the
loss once per step; :func:`trnkit.nkisim.cost.estimate` turns each launch into an estimated trn2 time
with its range (the optimistic / pessimistic settings of :mod:`trnkit.nkisim.cost_params`) and per-engine
busy time. The ops of a layer (``T = batch x seq`` tokens):

* ``attention_norm`` / ``ffn_norm``: :func:`~trnkit.kernels.rmsnorm.rmsnorm_residual` (the residual add
  fused; the backward adds the residual stream's gradient); ``qk_norm``: the q and k per-head norms in one
  launch (:func:`~trnkit.kernels.rmsnorm.rmsnorm_qk` / ``rmsnorm_qk_bwd``, as the models run them), rows = tokens
  x heads of each;
* ``q_proj`` ``k_proj`` ``v_proj`` ``o_proj``: plain matmuls through
  :func:`~trnkit.kernels.moe.grouped_mm` (one group per physical core, each with the whole weight and
  its share of the tokens; the weight in column slices that fit the kernel's SBUF budget, one launch
  per slice);
* ``rope``: :func:`~trnkit.kernels.rope.rope_kernel.rope_hf_kernel` on the ``[B, S, H, D]`` layout;
* ``attention``: :func:`~trnkit.kernels.attention.attention` / ``attention_bwd`` (causal, GQA);
* MoE layers: ``router`` (:func:`~trnkit.kernels.router.router_fwd.router_topk_kernel`) and ``experts``
  (:func:`~trnkit.kernels.moe.moe_experts`, balanced routing: every expert gets ``T x top_k / E`` slots);
  dense layers: ``mlp`` (:func:`~trnkit.kernels.mlp.mlp` / ``mlp_bwd``, the fused SwiGLU MLP).

Once per step: the final norm and the fused lm_head + loss in the trainer's default schedule, the forward /
backward kernel pair that recomputes the logits in the backward
(:func:`~trnkit.kernels.cross_entropy.linear_cross_entropy` / ``_bwd``); ``loss_schedule="fused"`` (CLI
``--loss-schedule fused``) takes the opt-in one-pass kernel instead
(:func:`~trnkit.kernels.cross_entropy.linear_cross_entropy_fwd_bwd`: the loss and both gradients in the
forward), whose backward only multiplies the stored fp32 gradients by the loss gradient and rounds them to
bf16 (a torch elementwise op, counted at its HBM bound: no kernel is traced for it). Not counted (no trnkit
kernel): the
embedding lookup and its gradient, the optimizer step, gradient reductions across devices, and the sums
of the partial input gradients of a matmul launched in column slices.

Scaled traces (said in the output, column ``traced``): a launch whose work repeats per unit is traced for
fewer units and its estimate multiplied: matmul column slices (identical launches), attention kv heads
(each core runs its kv heads one after the other), experts (same slots per expert). The loss is read on the
straight line through two traces at ``u`` and ``2u`` vocabulary rows, which counts its fixed work (per token
group: the target logits, the statistics, the stores) once. That line is only right where the traced sizes
are in the schedule's steady state, the fixed work already overlapped by the vocabulary loop as it is at the
full vocabulary; so the line is accepted only when its slopes are a steady state's (:func:`_steady`: the
optimistic end's slope at most mid's, the pessimistic end's at least mid's, and mid's at least the busiest
engine's busy time per row), and otherwise the sizes are doubled until they are. ``--full`` traces the whole
attention, experts and vocabulary (slow at real sizes).

Model FLOPs: the matmuls of the model (projections, MLP or the top-k experts, router, lm_head, and
attention's ``QK^T`` and ``PV`` with the causal half counted once), backward = 2 x forward; MFU = model
FLOPs per step / (step time x TensorE's peak bf16 FLOP/s per physical core x LNC cores), peak from
:attr:`trnkit.nkisim.hardware.Chip.tensor_flops_per_ns_bf16` (trn2: 128 x 128 PE x 2 FLOP x 2.4 GHz =
78.6 TFLOP/s per core), the same peak the cost model's compute bound uses.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import trnkit
from trnkit.bench import fingerprint
from trnkit.bench.harness import estimate_range
from trnkit.kernels.constraints import KernelConstraintError

DTYPE = torch.bfloat16
MODES = ("forward", "backward")
ATTN_HEADS_TRACED = 1  # kv heads per core traced when scaling attention
EXPERTS_TRACED = 8  # experts per core traced when scaling the MoE experts
VOCAB_TRACED = 2048  # vocabulary rows of the first of two loss traces (the second: twice as many), at least
STEADY_TOL = 0.005  # slopes closer than this (relative) count as equal in the steady-state check


@dataclass(frozen=True)
class StepOp:
    """One kernel launch (or launches) of the step."""

    name: str  # "q_proj"
    kernel: str  # the trnkit kernel
    mode: str  # "forward" | "backward"
    part: str  # "dense layer" | "moe layer" | "head"
    shape: str  # what the op computes, for the table
    model_flops: int  # model FLOPs of the whole op (0 for non-matmul work)
    run: Callable[[int], object]  # the traced launch for ``u`` units of the op's work
    units: int = 1  # units of work in the whole op (kv heads, experts, vocabulary rows, column slices)
    # units traced: (units,) = the whole op; (u,) = u units, the estimate times units / u; (u, 2u) = a
    # straight line through two traces, read at ``units`` (the launch's fixed part counted once), the sizes
    # doubled until the line is a steady state's (:func:`_steady`)
    traced_units: tuple[int, ...] = ()
    traced: str = ""  # what was traced when not the whole op (a line fit: what its units are, "vocabulary rows")
    key: tuple = ()  # identical launches share one trace
    check: Callable[[int], list] = lambda u: []  # the kernel's declared constraints at ``u`` units (meta tensors)
    # an op with no kernel (torch elementwise work): estimated at this HBM bound (ns, every end), not traced
    bound_ns: float = 0.0


@dataclass
class OpEstimate:
    """One op's estimated time (ns: low, mid, high end of the range) and per-engine busy time (ns, the
    busier core's, at mid), scaled to the whole op; ``trace_s``: seconds its traces took (0 if reused)."""

    op: StepOp
    low_ns: float
    mid_ns: float
    high_ns: float
    busy_ns: dict[str, float] = field(default_factory=dict)
    trace_s: float = 0.0
    traced: str = ""  # what was traced when not the whole op


@dataclass
class StepEstimate:
    """Every op's estimate and how they add up: step = layers x per layer + head."""

    flavor: str
    seq: int
    batch: int
    lnc: int
    chip: str
    layers: dict[str, int]  # layer kind ("dense layer" | "moe layer") -> how many
    ops: list[OpEstimate]
    peak_flops_per_ns: float  # per physical core

    def part_total(self, part: str) -> tuple[float, float, float]:
        sel = [e for e in self.ops if e.op.part == part]
        return (sum(e.low_ns for e in sel), sum(e.mid_ns for e in sel), sum(e.high_ns for e in sel))

    def step_total(self) -> tuple[float, float, float]:
        tot = list(self.part_total("head"))
        for kind, n in self.layers.items():
            tot = [a + n * b for a, b in zip(tot, self.part_total(kind))]
        return tuple(tot)

    def model_flops(self) -> int:
        per = {p: sum(e.op.model_flops for e in self.ops if e.op.part == p) for p in (*self.layers, "head")}
        return per["head"] + sum(n * per[k] for k, n in self.layers.items())

    def mfu(self, step_ns: float) -> float:
        return self.model_flops() / (step_ns * self.peak_flops_per_ns * self.lnc)

    def busy_ns(self, part: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.ops:
            if e.op.part == part:
                for eng, b in e.busy_ns.items():
                    out[eng] = out.get(eng, 0.0) + b
        return out


# --------------------------------------------------------------------------------------- inputs
# Each builder makes its inputs with a generator (the traced launch) or with ``g=None``: meta tensors of
# the same shapes and dtypes, for the kernels' declared constraints before anything is traced.


def _t(*shape: int, g: torch.Generator | None, dtype: torch.dtype = DTYPE, positive: bool = False) -> torch.Tensor:
    """A random ``shape`` tensor (``positive``: in [0.5, 1.5)), or a meta tensor when ``g`` is None."""
    if g is None:
        return torch.empty(*shape, dtype=dtype, device="meta")
    t = torch.rand(*shape, generator=g) + 0.5 if positive else torch.randn(*shape, generator=g) * 0.1
    return t.to(dtype)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _op(name: str, kernel: str, mode: str, part: str, shape: str, flops: int,
        make: Callable[[int, torch.Generator | None], tuple], call: Callable[..., object],
        constraints: Callable[..., list], units: int = 1, traced_units: tuple[int, ...] = (1,),
        traced: str = "", key: tuple = ()) -> StepOp:
    """A StepOp from ``make(u, g) -> args`` (the inputs of ``u`` units), ``call(*args)`` (the kernel) and
    ``constraints(*args)`` (the kernel's declared constraints, shapes and dtypes only)."""
    return StepOp(name, kernel, mode, part, shape, flops, lambda u: call(*make(u, _gen())), units, traced_units,
                  traced, key=key or (kernel, shape, mode), check=lambda u: constraints(*make(u, None)))


# --------------------------------------------------------------------------------------- matmul


def _slice_cols(K: int, N: int, backward: bool) -> int:
    """Columns per launch of a ``[K, N]`` weight: the widest slice (N itself, or a multiple of 128 that
    divides N) whose weight (and, backward, its transpose) fits grouped_mm's SBUF budget."""
    from trnkit.kernels.moe.constraints import WEIGHT_SBUF_BUDGET, weight_sbuf_bytes

    isz = torch.finfo(DTYPE).bits // 8

    def fits(n: int) -> bool:
        need = weight_sbuf_bytes(K, n, isz) + (weight_sbuf_bytes(n, K, isz) if backward else 0)
        return need <= WEIGHT_SBUF_BUDGET

    for n in [N] + [c for c in range(N - N % 128, 0, -128) if N % c == 0]:
        if fits(n):
            return n
    raise ValueError(f"step: no column slice of a [{K}, {N}] weight fits grouped_mm's SBUF budget "
                     f"({WEIGHT_SBUF_BUDGET} bytes per partition)")


def matmul_op(name: str, part: str, T: int, K: int, N: int, mode: str, lnc: int) -> StepOp:
    """``[T, K] @ [K, N]`` through grouped_mm: ``lnc`` groups (one per core) of ``T / lnc`` token rows,
    each with the whole weight; one launch per column slice (one traced, times the slice count)."""
    from trnkit.kernels import moe

    bwd = mode == "backward"
    n = _slice_cols(K, N, bwd)
    slices = N // n

    def make(_: int, g: torch.Generator | None) -> tuple:
        offs = torch.tensor([T * (i + 1) // lnc for i in range(lnc)], dtype=torch.int32)
        w = _t(K, n, g=g).expand(lnc, K, n).contiguous()
        return (_t(T, K, g=g), w, offs) + ((_t(T, n, g=g),) if bwd else ())

    def call(*a: torch.Tensor) -> object:
        return moe.grouped_mm_bwd(*a, lnc=lnc) if bwd else moe.grouped_mm(*a, lnc=lnc)

    traced = f"1 of {slices} column slices [{K}, {n}], times {slices}" if slices > 1 else ""
    return _op(name, "grouped_mm", mode, part, f"[{T}, {K}] @ [{K}, {N}]", 2 * T * K * N * (2 if bwd else 1),
               make, call, moe.grouped_mm_constraints, slices, (1,), traced, ("grouped_mm", mode, T, K, n, lnc))


# --------------------------------------------------------------------------------------- norms, rope


def norm_op(name: str, part: str, rows: int, H: int, mode: str, lnc: int, residual: bool) -> StepOp:
    from trnkit.kernels import rmsnorm as mod

    bwd = mode == "backward"

    def make(_: int, g: torch.Generator | None) -> tuple:
        x, w = _t(rows, H, g=g), _t(H, g=g, positive=True)
        r = _t(rows, H, g=g) if residual else None
        if not bwd:
            return x, r, w
        return _t(rows, H, g=g), x, w, _t(rows, g=g, dtype=torch.float32, positive=True), r

    if bwd:
        call = lambda gy, x, w, rstd, r: mod.rmsnorm_bwd(gy, x, w, rstd, r, lnc=lnc)  # noqa: E731
        constraints = mod.rmsnorm_bwd_constraints
    elif residual:
        call = lambda x, r, w: mod.rmsnorm_residual(x, r, w, lnc=lnc)  # noqa: E731
        constraints = lambda x, r, w: mod.rmsnorm_constraints(x, w, 1e-6, r)  # noqa: E731
    else:
        call = lambda x, r, w: mod.rmsnorm(x, w, lnc=lnc)  # noqa: E731
        constraints = lambda x, r, w: mod.rmsnorm_constraints(x, w)  # noqa: E731
    kernel = "rmsnorm_bwd" if bwd else "rmsnorm_residual" if residual else "rmsnorm"
    return _op(name, kernel, mode, part, f"[{rows}, {H}]", 0, make, call, constraints,
               key=(kernel, rows, H, lnc, residual))


def qk_norm_op(part: str, T: int, Hq: int, Hk: int, D: int, mode: str, lnc: int) -> StepOp:
    """The q and k head norms in one launch: ``[T*Hq, D]`` and ``[T*Hk, D]`` rows, each with its weight."""
    from trnkit.kernels import rmsnorm as mod

    bwd = mode == "backward"

    def make(_: int, g: torch.Generator | None) -> tuple:
        q, k = _t(T * Hq, D, g=g), _t(T * Hk, D, g=g)
        wq, wk = _t(D, g=g, positive=True), _t(D, g=g, positive=True)
        if not bwd:
            return q, k, wq, wk
        rq, rk = (_t(n, g=g, dtype=torch.float32, positive=True) for n in (T * Hq, T * Hk))
        return _t(T * Hq, D, g=g), _t(T * Hk, D, g=g), q, k, wq, wk, rq, rk

    if bwd:
        call = lambda *a: mod.rmsnorm_qk_bwd(*a, lnc=lnc)  # noqa: E731
        constraints = mod.rmsnorm_qk_bwd_constraints
    else:
        call = lambda *a: mod.rmsnorm_qk(*a, lnc=lnc)  # noqa: E731
        constraints = mod.rmsnorm_qk_constraints
    kernel = "rmsnorm_qk_bwd" if bwd else "rmsnorm_qk"
    return _op("qk_norm", kernel, mode, part, f"[{T * Hq}, {D}] + [{T * Hk}, {D}]", 0, make, call, constraints,
               key=(kernel, T, Hq, Hk, D, lnc))


def rope_op(part: str, B: int, S: int, Hq: int, Hk: int, D: int, mode: str, lnc: int, theta: float) -> StepOp:
    from trnkit.kernels.lnc import launch
    from trnkit.qwen3.config import rope_cache

    from trnkit.kernels.rope.constraints import constraints as rope_constraints
    from trnkit.kernels.rope.rope_kernel import rope_hf_kernel

    def make(_: int, g: torch.Generator | None) -> tuple:
        cache = rope_cache(D, S, theta).to(DTYPE) if g is not None else _t(S, 2 * D, g=None)
        return _t(B, S, Hq, D, g=g), _t(B, S, Hk, D, g=g), cache

    def call(q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> object:
        return launch(rope_hf_kernel, lnc)(q, k, torch.empty_like(q), torch.empty_like(k), cache, cache,
                                          packed=True, backward=mode == "backward", bshd=True)

    def constraints(q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> list:
        return rope_constraints(q, k, rope_cache=cache, layout="bshd")

    return _op("rope", "rope_hf", mode, part, f"q [{B}, {S}, {Hq}, {D}], k [{B}, {S}, {Hk}, {D}]", 0, make, call,
               constraints, key=("rope", mode, B, S, Hq, Hk, D, lnc))


# --------------------------------------------------------------------------------------- attention


def attention_op(part: str, B: int, S: int, Hq: int, Hk: int, D: int, mode: str, lnc: int, full: bool) -> StepOp:
    from trnkit.kernels import attention as mod

    hk = Hk if full else min(Hk, ATTN_HEADS_TRACED * lnc)
    if Hk % hk:
        hk = Hk
    bwd = mode == "backward"

    def make(hk: int, g: torch.Generator | None) -> tuple:
        hq = Hq // Hk * hk
        q, k, v = _t(B, S, hq, D, g=g), _t(B, S, hk, D, g=g), _t(B, S, hk, D, g=g)
        if not bwd:
            return q, k, v
        return q, k, v, _t(B, S, hq, D, g=g), _t(B, hq, S, g=g, dtype=torch.float32, positive=True), \
            _t(B, S, hq, D, g=g)

    def call(*a: torch.Tensor) -> object:
        return mod.attention_bwd(*a, lnc=lnc) if bwd else mod.attention(*a, lnc=lnc)

    constraints = mod.attention_bwd_constraints if bwd else mod.attention_constraints
    flops = 2 * B * Hq * S * S * D * (2 if bwd else 1)  # QK^T + PV, causal half: 4 B Hq S^2 D / 2
    traced = f"{hk} of {Hk} kv heads ({Hq // Hk * hk} q heads), times {Hk // hk}" if hk < Hk else ""
    return _op("attention", "attention", mode, part, f"B={B} S={S} {Hq} q / {Hk} kv heads, D={D}", flops,
               make, call, constraints, Hk, (hk,), traced, ("attention", mode, B, S, Hq // Hk, D, lnc))


# --------------------------------------------------------------------------------------- MoE


def _balanced_routing(T: int, E: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t's experts ``(t * K + j) % E``: every expert gets ``T * K / E`` slots (rounded)."""
    idx = (torch.arange(T)[:, None] * K + torch.arange(K)[None, :]) % E
    return idx.to(torch.int32), torch.full((T, K), 1.0 / K)


def router_op(part: str, T: int, H: int, E: int, K: int, mode: str, lnc: int) -> StepOp:
    from trnkit.kernels.lnc import launch
    from trnkit.kernels.router.constraints import constraints
    from trnkit.kernels.router.router_bwd import router_topk_bwd_kernel
    from trnkit.kernels.router.router_fwd import router_topk_kernel

    bwd = mode == "backward"

    def make(_: int, g: torch.Generator | None) -> tuple:
        x, w = _t(T, H, g=g), _t(E, H, g=g)
        if not bwd:
            return x, w
        idx, _ = _balanced_routing(T, E, K)
        return x, w, _t(T, E, g=g, dtype=torch.float32), idx, _t(T, K, g=g, dtype=torch.float32)

    def call(x: torch.Tensor, w: torch.Tensor, *grad: torch.Tensor) -> object:
        if not bwd:
            return launch(router_topk_kernel, lnc)(x, w, K, True)
        return launch(router_topk_bwd_kernel, lnc)(x, w, *grad, None, has_grad_logits=False, norm_topk_prob=True)

    kernel = "router_topk_bwd" if bwd else "router_topk"
    return _op("router", kernel, mode, part, f"[{T}, {H}] x {E} experts, top {K}", 2 * T * H * E * (2 if bwd else 1),
               make, call, lambda x, w, *_: constraints(x, w, K), key=(kernel, T, H, E, K, lnc))


def experts_op(part: str, T: int, H: int, inter: int, E: int, K: int, mode: str, lnc: int, full: bool) -> StepOp:
    """The top-k experts with balanced routing; scaled: ``e`` experts with the same slots per expert
    (``T * K / E``) as the whole layer, the tokens cut to ``T * e / E`` (every token still picks K)."""
    from trnkit.kernels import moe

    bwd = mode == "backward"
    e = E if full else min(E, EXPERTS_TRACED * lnc)
    if E % e or (T * e) % E or K > e:
        e = E

    def make(e: int, g: torch.Generator | None) -> tuple:
        t = T * e // E
        idx, tw = _balanced_routing(t, e, K)
        args = (_t(t, H, g=g), idx, tw, _t(e, H, 2 * inter, g=g), _t(e, inter, H, g=g))
        return args + ((_t(t, H, g=g),) if bwd else ())

    def call(*a: torch.Tensor) -> object:
        return moe.moe_experts_bwd(*a, lnc=lnc) if bwd else moe.moe_experts(*a, lnc=lnc)

    def constraints(x, idx, tw, wgu, wd, *go: torch.Tensor) -> list:
        return moe.moe_experts_constraints(x, idx, tw, wgu, wd, grad_out=go[0] if go else None)

    flops = 6 * T * K * H * inter * (2 if bwd else 1)
    traced = f"{e} of {E} experts, {T * e // E} tokens ({T * K // E} slots per expert), times {E // e}" if e < E else ""
    kernel = "moe_experts_bwd" if bwd else "moe_experts"
    return _op("experts", kernel, mode, part, f"T={T} H={H} I={inter}, {E} experts, top {K}", flops, make, call,
               constraints, E, (e,), traced, (kernel, T, H, inter, E, K, lnc))


def mlp_op(part: str, T: int, H: int, inter: int, mode: str, lnc: int) -> StepOp:
    """The dense SwiGLU MLP (gate/up, SiLU x up, down) through the mlp kernels."""
    from trnkit.kernels import mlp as mod

    bwd = mode == "backward"

    def make(_: int, g: torch.Generator | None) -> tuple:
        return (_t(T, H, g=g), _t(H, 2 * inter, g=g), _t(inter, H, g=g)) + ((_t(T, H, g=g),) if bwd else ())

    def call(*a: torch.Tensor) -> object:
        return mod.mlp_bwd(*a, lnc=lnc) if bwd else mod.mlp(*a, lnc=lnc)

    kernel = "mlp_bwd" if bwd else "mlp"
    return _op("mlp", kernel, mode, part, f"T={T} H={H} I={inter}", 6 * T * H * inter * (2 if bwd else 1),
               make, call, mod.mlp_constraints, key=(kernel, T, H, inter, lnc))


# --------------------------------------------------------------------------------------- loss


HBM_BYTES_PER_NS = 362.5  # HBM bandwidth per physical core (trn2), the cost model's


def loss_op(T: int, H: int, V: int, mode: str, lnc: int, full: bool, schedule: str = "recompute") -> StepOp:
    """The lm_head + loss of one step, pass ``mode``: ``schedule="fused"`` (opt-in) is the
    one-pass kernel forward (all ``6 T H V`` model FLOPs) and, backward, the scaling of its stored fp32
    gradients by the loss gradient into bf16 (read ``lnc`` fp32 grad_hidden partials and the fp32 grad_weight,
    write both in bf16; its HBM bound over ``lnc`` cores); ``"recompute"`` the forward kernel and the
    backward kernel that recomputes the logits (the trainer's default)."""
    from trnkit.kernels import cross_entropy as mod

    if schedule not in ("fused", "recompute"):
        raise ValueError(f"step: loss schedule must be 'fused' or 'recompute', got {schedule!r}")
    traced_units = (V,) if full or V <= 2 * VOCAB_TRACED else (VOCAB_TRACED, 2 * VOCAB_TRACED)
    bwd = mode == "backward"
    isz = torch.finfo(DTYPE).bits // 8
    if schedule == "fused" and bwd:
        nbytes = (lnc * T * H + V * H) * 4 + (T * H + V * H) * isz
        return StepOp("lm_head_loss", "grad scale (torch)", mode, "head", f"[{T}, {H}] + [{V}, {H}] fp32",
                      0, lambda u: None, key=("lce_grad_scale", T, H, V, lnc),
                      bound_ns=nbytes / (HBM_BYTES_PER_NS * lnc))
    if schedule == "fused":
        def make_fused(v: int, g: torch.Generator | None) -> tuple:
            labels = torch.randint(0, v, (T,), generator=g) if g is not None else torch.empty(
                T, dtype=torch.int64, device="meta")
            return (_t(T, H, g=g), _t(v, H, g=g), labels)

        return _op("lm_head_loss", "linear_cross_entropy_fwd_bwd", mode, "head", f"[{T}, {H}] x [{V}, {H}]",
                   6 * T * H * V, make_fused, lambda *a: mod.linear_cross_entropy_fwd_bwd(*a, lnc=lnc),
                   lambda h, w, labels: mod.linear_cross_entropy_constraints(h, w, labels), V, traced_units,
                   "vocabulary rows" if len(traced_units) == 2 else "",
                   ("linear_cross_entropy_fwd_bwd", T, H, lnc))

    def make(v: int, g: torch.Generator | None) -> tuple:
        labels = torch.randint(0, v, (T,), generator=g) if g is not None else torch.empty(T, dtype=torch.int64,
                                                                                          device="meta")
        args = (_t(T, H, g=g), _t(v, H, g=g), labels)
        return args + ((_t(T, g=g, dtype=torch.float32, positive=True) + math.log(v),) if bwd else ())

    def call(*a: torch.Tensor) -> object:
        return mod.linear_cross_entropy_bwd(*a, lnc=lnc) if bwd else mod.linear_cross_entropy(*a, lnc=lnc)

    traced = "vocabulary rows" if len(traced_units) == 2 else ""
    kernel = "linear_cross_entropy_bwd" if bwd else "linear_cross_entropy"
    return _op("lm_head_loss", kernel, mode, "head", f"[{T}, {H}] x [{V}, {H}]", 2 * T * H * V * (2 if bwd else 1),
               make, call, lambda h, w, labels, *_: mod.linear_cross_entropy_constraints(h, w, labels),
               V, traced_units, traced, (kernel, T, H, lnc))


# --------------------------------------------------------------------------------------- the step


def _layer_ops(cfg, part: str, moe_layer: bool, B: int, S: int, lnc: int, full: bool) -> list[StepOp]:
    T, H, D = B * S, cfg.dim, cfg.head_dim
    Hq, Hk = cfg.n_heads, cfg.n_kv_heads

    def ops(mode: str) -> list[StepOp]:
        attn = [
            norm_op("attention_norm", part, T, H, mode, lnc, residual=True),
            matmul_op("q_proj", part, T, H, Hq * D, mode, lnc),
            matmul_op("k_proj", part, T, H, Hk * D, mode, lnc),
            matmul_op("v_proj", part, T, H, Hk * D, mode, lnc),
            qk_norm_op(part, T, Hq, Hk, D, mode, lnc),
            rope_op(part, B, S, Hq, Hk, D, mode, lnc, cfg.rope_theta),
            attention_op(part, B, S, Hq, Hk, D, mode, lnc, full),
            matmul_op("o_proj", part, T, Hq * D, H, mode, lnc),
            norm_op("ffn_norm", part, T, H, mode, lnc, residual=True),
        ]
        if moe_layer:
            ffn = [router_op(part, T, H, cfg.num_experts, cfg.top_k, mode, lnc),
                   experts_op(part, T, H, cfg.moe_inter_dim, cfg.num_experts, cfg.top_k, mode, lnc, full)]
        else:
            ffn = [mlp_op(part, T, H, cfg.hidden_dim, mode, lnc)]
        return attn + ffn

    return ops("forward") + ops("backward")[::-1]


def step_ops(cfg, batch: int, seq: int, lnc: int, full: bool = False,
             loss_schedule: str = "recompute") -> tuple[list[StepOp], dict[str, int]]:
    """Every op of one train step of ``cfg`` (a :class:`~trnkit.qwen3.config.Qwen3Config`) and the number
    of layers of each kind; ``loss_schedule``: the lm_head + loss schedule (:func:`loss_op`)."""
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) if cfg.is_moe else 0
    layers = {k: n for k, n in (("dense layer", cfg.n_layers - n_moe), ("moe layer", n_moe)) if n}
    ops: list[StepOp] = []
    for kind in layers:
        ops += _layer_ops(cfg, kind, kind == "moe layer", batch, seq, lnc, full)
    T = batch * seq
    ops += [norm_op("final_norm", "head", T, cfg.dim, "forward", lnc, residual=True),
            loss_op(T, cfg.dim, cfg.vocab_size, "forward", lnc, full, loss_schedule),
            loss_op(T, cfg.dim, cfg.vocab_size, "backward", lnc, full, loss_schedule),
            norm_op("final_norm", "head", T, cfg.dim, "backward", lnc, residual=True)]
    return ops, layers


def _trace(op: StepOp, units: int, chip: str) -> tuple[tuple[float, float, float], dict[str, float]]:
    from trnkit.nkisim import cost, trace

    try:
        with trace.record(trace_only=True) as tr:
            op.run(units)
    except KernelConstraintError as exc:
        raise ValueError(f"step: op {op.name} ({op.kernel}, {op.mode}, {op.shape}) is outside the kernel's "
                         f"constraints: {exc}") from exc
    rep = cost.estimate(tr, chip)
    return estimate_range(rep.total_range_ns), dict(rep.busy_ns)


def _steady(points: list[tuple[int, tuple[float, float, float], dict[str, float]]]) -> bool:
    """Whether the line through two traces ``(units, (low, mid, high) ns, busy ns)`` has a steady state's
    slopes: each added unit adds at least the busiest engine's busy time to mid, and no less at the
    pessimistic settings and no more at the optimistic ones than at mid (within ``STEADY_TOL``). A traced
    size whose fixed work is not yet overlapped breaks this (the fixed work shrinks as the size grows, so
    the slope comes out low, most at the pessimistic end where the fixed work is longest)."""
    (u1, y1, b1), (u2, y2, b2) = points
    low, mid, high = ((y2[i] - y1[i]) / (u2 - u1) for i in range(3))
    busy = max((b2.get(e, 0.0) - b1.get(e, 0.0)) / (u2 - u1) for e in b2)
    tol = STEADY_TOL * mid
    return low <= mid + tol and high >= mid - tol and mid >= busy - tol


def _at(units: int, points: list[tuple[int, float]]) -> float:
    """A quantity at ``units``: proportional to one traced point, or on the line through two."""
    if len(points) == 1:
        (u, y), = points
        return y * units / u
    (u1, y1), (u2, y2) = points
    return y1 + (y2 - y1) / (u2 - u1) * (units - u1)


def estimate_op(op: StepOp, chip: str, cache: dict) -> OpEstimate:
    """Trace ``op`` (or reuse an identical launch's trace) and estimate it on ``chip``."""
    if op.bound_ns:
        return OpEstimate(op, op.bound_ns, op.bound_ns, op.bound_ns, {"dma": op.bound_ns}, 0.0, "HBM bound")
    key = (op.key, op.traced_units)
    secs = 0.0
    if key not in cache:
        t0 = time.perf_counter()
        points = [(u, *_trace(op, u, chip)) for u in op.traced_units]
        while len(points) == 2 and not _steady(points) and points[1][0] < op.units:
            u = min(2 * points[1][0], op.units)  # at the op's size: the line reads off that trace
            points = [points[1], (u, *_trace(op, u, chip))]
        cache[key] = points
        secs = time.perf_counter() - t0
    points = cache[key]
    low, mid, high = (_at(op.units, [(u, lmh[i]) for u, lmh, _ in points]) for i in range(3))
    traced = op.traced
    if len(points) == 2 and points[1][0] == op.units:
        traced = f"all {op.units:,} {op.traced} (no steady state at fewer)"
    elif len(points) == 2:
        # steady slopes differ by less than STEADY_TOL: an end past mid is on mid's line
        low, high = min(low, mid), max(high, mid)
        traced = (f"{points[0][0]:,} and {points[1][0]:,} of {op.units:,} {op.traced}, the straight line through "
                  f"them at {op.units:,}")
    engines = points[0][2]
    busy = {e: _at(op.units, [(u, b.get(e, 0.0)) for u, _, b in points]) for e in engines}
    return OpEstimate(op, low, mid, high, busy, secs, traced)


def estimate_step(flavor: str, seq: int, batch: int = 1, lnc: int = 2, chip: str = "trn2", full: bool = False,
                  log: Callable[[str], None] | None = None, config=None,
                  loss_schedule: str = "recompute") -> StepEstimate:
    """The step estimate of a registry flavor (or of ``config``, a Qwen3Config, named ``flavor``), with the
    lm_head + loss in ``loss_schedule`` (:func:`loss_op`)."""
    from trnkit.nkisim import hardware
    from trnkit.qwen3 import model_registry

    for name, value in (("seq", seq), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"step: {name} must be an int >= 1, got {value!r}")
    if lnc not in (1, 2):
        raise ValueError(f"step: lnc must be 1 or 2, got {lnc!r}")
    if config is None:
        try:
            config = model_registry(flavor).config
        except KeyError as exc:
            raise ValueError(f"step: flavor: {exc.args[0]}") from None
    ops, layers = step_ops(config, batch, seq, lnc, full, loss_schedule)
    for op in ops:  # every kernel's declared constraints first: a bad shape fails before minutes of tracing
        bad = [v for u in op.traced_units for v in op.check(u)]
        if bad:
            raise ValueError(f"step: op {op.name} ({op.kernel}, {op.mode}, {op.shape}) is outside the kernel's "
                             f"constraints: {'; '.join(map(str, bad))}")
    cache: dict = {}
    out = []
    for op in ops:
        est = estimate_op(op, chip, cache)
        if log:
            log(f"  {op.part:<11} {op.name:<15} {op.mode:<8} {est.mid_ns / 1e3:>11,.1f} us"
                f"{'  (traced ' + est.traced + ')' if est.traced else ''}  [{est.trace_s:.1f} s]")
        out.append(est)
    peak = hardware.get_chip(chip).tensor_flops_per_ns_bf16
    return StepEstimate(flavor, seq, batch, lnc, chip, layers, out, peak)


# --------------------------------------------------------------------------------------- output

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")
CSV_COLUMNS = ("flavor", "seq", "batch", "lnc", "chip", "part", "op", "mode", "kernel", "shape", "count",
               "est_low_us", "est_mid_us", "est_high_us", *(f"busy_{e}_us" for e in ENGINES), "model_gflop",
               "mfu_low", "mfu_mid", "mfu_high", "traced", "timestamp", "trnkit_version", *fingerprint.FIELDS)
# an op's kernel name -> its trnkit kernel family (trnkit.bench.fingerprint source), by prefix
KERNEL_FAMILIES = (("rmsnorm", "rmsnorm"), ("grouped_mm", "moe"), ("moe_experts", "moe"), ("mlp", "mlp"),
                   ("rope", "rope"), ("attention", "attention"), ("linear_cross_entropy", "cross_entropy"),
                   ("router", "router"))


def op_sources(op: StepOp) -> tuple[str, ...]:
    """The kernel family an op's estimate ran (none for an op counted at its HBM bound)."""
    if op.bound_ns:
        return ()
    for prefix, fam in KERNEL_FAMILIES:
        if op.kernel.startswith(prefix):
            return (f"trnkit/kernels/{fam}",)
    raise ValueError(f"step: op {op.name} runs kernel {op.kernel!r}, which names no trnkit kernel family "
                     f"(KERNEL_FAMILIES: {', '.join(p for p, _ in KERNEL_FAMILIES)})")


def csv_rows(st: StepEstimate) -> list[dict]:
    """One row per op, one per layer kind and the head (count = how many per step), one for the step."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    base = dict(flavor=st.flavor, seq=st.seq, batch=st.batch, lnc=st.lnc, chip=st.chip, timestamp=stamp,
                trnkit_version=trnkit.__version__)

    def row(part: str, op: str, mode: str, kernel: str, shape: str, count: int, lmh: tuple, busy: dict,
            flops: int, traced: str = "", mfu: tuple = ("", "", "")) -> dict:
        us = [f"{t / 1e3:.3f}" for t in lmh]
        ops = [e.op for e in st.ops if (e.op.part, e.op.name, e.op.mode) == (part, op, mode)
               or (op == "total" and part in (e.op.part, "step"))]
        fp = fingerprint.stamp(sorted({s for o in ops for s in op_sources(o)}))
        return {**base, **fp, "part": part, "op": op, "mode": mode, "kernel": kernel, "shape": shape, "count": count,
                "est_low_us": us[0], "est_mid_us": us[1], "est_high_us": us[2],
                **{f"busy_{e}_us": f"{busy.get(e, 0.0) / 1e3:.3f}" for e in ENGINES},
                "model_gflop": f"{flops / 1e9:.3f}", "mfu_low": mfu[0], "mfu_mid": mfu[1], "mfu_high": mfu[2],
                "traced": traced}

    rows = [row(e.op.part, e.op.name, e.op.mode, e.op.kernel, e.op.shape, 1, (e.low_ns, e.mid_ns, e.high_ns),
                e.busy_ns, e.op.model_flops, e.traced)
            for e in st.ops]
    for part, n in (*st.layers.items(), ("head", 1)):
        flops = sum(e.op.model_flops for e in st.ops if e.op.part == part)
        rows.append(row(part, "total", "", "", "", n, st.part_total(part), st.busy_ns(part), flops))
    total = st.step_total()
    busy = {e: sum(n * st.busy_ns(p).get(e, 0.0) for p, n in (*st.layers.items(), ("head", 1))) for e in ENGINES}
    mfu = tuple(f"{st.mfu(t):.6f}" for t in (total[2], total[1], total[0]))  # low MFU at the slow end
    rows.append(row("step", "total", "", "", "", 1, total, busy, st.model_flops(), mfu=mfu))
    return rows


def write_csv(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` into ``path``, replacing the rows of the same (flavor, seq, batch, lnc, chip)."""
    keys = ("flavor", "seq", "batch", "lnc", "chip")
    new = {tuple(str(r[k]) for k in keys) for r in rows}
    old = []
    if path.exists():
        with path.open(newline="") as f:
            old = [r for r in csv.DictReader(f) if tuple(r[k] for k in keys) not in new]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(old + rows)
    return path


def report(st: StepEstimate) -> str:
    """The printed report: per op, per layer and per step, engines, MFU, what was scaled."""
    us = 1e-3
    lines = [f"Qwen3 {st.flavor}, batch {st.batch} x seq {st.seq}, LNC={st.lnc}, estimated {st.chip} time "
             f"(cost model; range = optimistic..pessimistic parameters)",
             f"{'part':<11} {'op':<15} {'mode':<8} {'kernel':<24} {'mid us':>11} {'low..high us':>23} "
             f"{'busiest engine':>16}  traced"]
    for e in st.ops:
        top = max(e.busy_ns, key=e.busy_ns.get) if e.busy_ns else "-"
        busiest = f"{top} {e.busy_ns.get(top, 0.0) / e.mid_ns:.0%}" if e.busy_ns else "-"
        lines.append(f"{e.op.part:<11} {e.op.name:<15} {e.op.mode:<8} {e.op.kernel:<24} {e.mid_ns * us:>11,.1f} "
                     f"{f'{e.low_ns * us:,.1f}..{e.high_ns * us:,.1f}':>23} {busiest:>16}  {e.traced}")
    lines.append("")
    for part, n in (*st.layers.items(), ("head", 1)):
        lo, mid, hi = st.part_total(part)
        busy = st.busy_ns(part)
        eng = ", ".join(f"{e} {busy.get(e, 0.0) * us:,.0f}" for e in ENGINES)
        lines.append(f"{part} (x{n}): {mid * us:,.1f} us ({lo * us:,.1f}..{hi * us:,.1f}); engine busy us "
                     f"(each op's busier core, at mid): {eng}")
    lo, mid, hi = st.step_total()
    flops = st.model_flops()
    lines += [f"step: {mid / 1e6:,.2f} ms ({lo / 1e6:,.2f}..{hi / 1e6:,.2f}) = "
              + " + ".join(f"{n} x {k}" for k, n in st.layers.items()) + " + head",
              f"model FLOPs per step: {flops / 1e12:,.3f} TFLOP; peak {st.peak_flops_per_ns / 1e3:.1f} TFLOP/s bf16 "
              f"per core (trnkit.nkisim.hardware, 128x128 PE x 2 x TensorE clock) x {st.lnc} cores",
              f"MFU: {st.mfu(mid):.1%} (range {st.mfu(hi):.1%}..{st.mfu(lo):.1%})",
              "not counted: embedding lookup and its gradient, optimizer step, cross-device gradient "
              "reductions, sums of partial input gradients of column-sliced matmuls"]
    scaled = [e for e in st.ops if e.traced]
    if scaled:
        lines.append("scaled traces: "
                     + "; ".join(sorted({f"{e.op.name} {e.op.mode}: {e.traced}" for e in scaled})))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m trnkit.bench step --flavor F --seq N [--batch B] [--lnc 2] [--full]
    [--loss-schedule recompute|fused] [--save-reference | --out DIR]``."""
    import argparse

    from trnkit.bench.paths import add_output_args, output_dir
    from trnkit.qwen3 import flavors

    p = argparse.ArgumentParser(prog="python -m trnkit.bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", required=True, help=f"Qwen3 flavor ({', '.join(flavors())})")
    p.add_argument("--seq", type=int, required=True, help="sequence length")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--lnc", type=int, default=2, choices=(1, 2), help="physical cores per logical core (default 2)")
    p.add_argument("--chip", default="trn2", choices=("trn2", "trn1"))
    p.add_argument("--full", action="store_true",
                   help="trace every kv head, expert and vocabulary row (slow at real sizes)")
    p.add_argument("--loss-schedule", default="recompute", choices=("recompute", "fused"),
                   help="lm_head + loss: the trainer's default 'recompute' pair or the opt-in one-pass 'fused'")
    add_output_args(p, "step.csv")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        st = estimate_step(args.flavor, args.seq, args.batch, args.lnc, args.chip, args.full, log=print,
                           loss_schedule=args.loss_schedule)
    except ValueError as exc:
        p.error(str(exc))
    print(report(st))
    path = write_csv(output_dir(args) / "step.csv", csv_rows(st))
    print(f"{len(st.ops) + len(st.layers) + 2} rows -> {path} ({time.perf_counter() - t0:.1f} s)")
    return 0
