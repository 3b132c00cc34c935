"""Conformance cases of nki-library's core/moe_block kernel (token generation), written from its test file.

``test/integration/nkilib/core/moe_block/test_moe_block_tkg.py`` (``test_moe_block_kernel_unit``, the
``MANUAL_PARAMS`` rows whose expert weights are not MX, which only trn3 runs): ``moe_block_tkg``
(RMS norm, router top-k, the selected or all experts) against ``moe_block_tkg_torch_ref`` at rtol 1e-2
(5e-2 for low-precision fp8 weights) / atol 1e-5, LNC 2. Inputs as the test's ``generate_inputs``
draws them from ``default_rng(42)``: the input, gamma and router weights uniform in [-0.1, 0.1) (cast
to the input / router dtype), the expert gate-up and down weights normal (cast to the weight dtype),
then the router bias (uniform) and the expert biases (normal); with all experts on a rank, the rank
from ``RandomState(42).randint(0, ranks)``. Clamp limits as the test's ``_get_clamp_limits``: gate
at most 7, up in [-6, 8].
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .harness import FP32_UNIT, Case, TappedReference, TileCheck, _resolve, cast_bf16, drawn_array

__all__ = ["moe_block_case", "moe_block_cases", "norm_error", "rounded_once", "routed_as_kernel", "router_depth",
           "routing_projection"]

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core/moe_block"
_DT = {F16: "fp16", BF16: "bf16", FP8: "fp8"}
LNC = 2  # every row (the test's)


def _inputs(all_expert: bool, b: int, s: int, h: int, h_actual: int | None, i: int, e_global: int, e_local: int,
            k: int, act: str, w_dt: np.dtype, in_dt: np.dtype, bias: bool, clamp: bool, pre_norm: bool,
            norm_topk: bool, router_dt: np.dtype, router: str = "SOFTMAX") -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        types = importlib.import_module(f"{LIB}.utils.common_types")
        np.random.seed(42)
        rng = np.random.default_rng(42)
        uniform = lambda shape, dt: rng.uniform(low=-0.1, high=0.1, size=shape).astype(dt)  # noqa: E731
        out: dict[str, Any] = {"inp": uniform((b, s, h), in_dt), "gamma": uniform((1, h), in_dt),
                               "router_weights": uniform((h, e_global), router_dt)}
        # (drawn a chunk at a time: the same values and generator state as the one-shot draw, without its float64)
        out["expert_gate_up_weights"] = drawn_array(lambda n: rng.normal(size=n), (e_local, h, 2, i), w_dt, via=None)
        out["expert_down_weights"] = drawn_array(lambda n: rng.normal(size=n), (e_local, i, h), w_dt, via=None)
        out["expert_gate_up_weights_scale"] = out["expert_down_weights_scale"] = None
        out["router_bias"] = uniform((1, e_global), router_dt) if bias else None
        out["expert_gate_up_bias"] = rng.normal(size=(e_local, 2, i)).astype(in_dt) if bias else None
        out["expert_down_bias"] = rng.normal(size=(e_local, h)).astype(in_dt) if bias else None
        rank = np.random.RandomState(42).randint(0, e_global // e_local) if all_expert else None
        out.update(
            top_k=k, router_act_fn=getattr(types.RouterActFnType, router), router_pre_norm=pre_norm,
            norm_topk_prob=norm_topk, expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
            hidden_act_fn=getattr(types.ActFnType, act), gate_clamp_upper_limit=7.0 if clamp else None,
            gate_clamp_lower_limit=None, up_clamp_upper_limit=8.0 if clamp else None,
            up_clamp_lower_limit=-6.0 if clamp else None, router_mm_dtype=router_dt, hidden_actual=h_actual,
            skip_router_logits=False, is_all_expert=all_expert,
            rank_id=np.array([[rank]], dtype=np.uint32) if all_expert else None)
        return out
    return make


# MANUAL_PARAMS without MX weights: is_all_expert, batch, seqlen, hidden, hidden_actual, intermediate, global
# experts, local experts, top_k, activation, weight dtype, input dtype, bias, clamp, router_act_first,
# norm_topk_prob, router dtype (router softmax, post-scaling, no shared expert, router logits kept)
_SWISH = ("Swish", F16, F16, True, True, False, False, F16)
_SILU_BF16 = ("SiLU", BF16, BF16, False, False, True, True, BF16)
_SILU_FP8 = ("SiLU", FP8, BF16, False, False, True, True, BF16)
_ROWS = [
    (False, 1, 1, 3072, None, 384, 128, 128, 4, *_SWISH), (False, 1, 4, 3072, 2880, 384, 128, 128, 4, *_SWISH),
    (False, 1, 1, 3072, None, 192, 128, 128, 4, *_SWISH), (False, 1, 1, 3072, None, 576, 128, 128, 4, *_SWISH),
    (False, 1, 4, 3072, 2880, 192, 128, 128, 4, *_SWISH), (False, 1, 5, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 4, 1, 3072, 2880, 192, 128, 128, 4, *_SWISH), (False, 8, 1, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 16, 1, 3072, 2880, 128, 128, 128, 4, *_SWISH), (False, 19, 1, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 32, 1, 3072, None, 128, 128, 128, 4, *_SWISH), (False, 38, 1, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 120, 1, 3072, None, 128, 128, 128, 4, *_SWISH),
    (False, 1, 1, 4096, None, 384, 128, 128, 8, *_SILU_BF16), (False, 1, 1, 4096, None, 384, 128, 128, 8, *_SILU_FP8),
    (True, 19, 1, 3072, None, 128, 128, 1, 4, *_SWISH), (True, 32, 1, 3072, None, 128, 128, 1, 4, *_SWISH),
    (True, 32, 1, 3072, None, 384, 128, 1, 4, *_SWISH), (True, 32, 1, 3072, None, 768, 128, 1, 4, *_SWISH),
    (True, 32, 1, 3072, None, 768, 128, 4, 4, *_SWISH), (True, 32, 1, 3072, None, 1536, 128, 1, 4, *_SWISH),
    (True, 32, 1, 3072, None, 1536, 128, 2, 4, *_SWISH), (True, 32, 1, 3072, None, 3072, 128, 1, 4, *_SWISH),
    (True, 16, 1, 4096, None, 1536, 128, 2, 8, *_SILU_BF16), (True, 16, 1, 4096, None, 384, 128, 128, 8, *_SILU_BF16),
    (True, 16, 1, 4096, None, 384, 128, 8, 8, *_SILU_FP8),
]


def moe_block_case(all_e: bool, b: int, s: int, h: int, ha: int | None, i: int, eg: int, el: int, k: int, act: str,
                   w_dt: np.dtype, in_dt: np.dtype, bias: bool, clamp: bool, pre: bool, norm_topk: bool,
                   r_dt: np.dtype, router: str = "SOFTMAX") -> Case:
    """One row of ``test_moe_block_tkg.py`` without MX weights (post-scaling, router logits kept).

    A row with a bf16 input and router has the routing check (:data:`ROUTING`), selective or all experts; an
    all-experts row without ``router_act_first`` reads the kernel's chosen experts off its nonzero affinities
    (:data:`ROUTING_BY_AFFINITIES`): there the kernel writes no chosen-experts tile (``_router_topk``'s
    ``skip_store_expert_index``, as ``moe_block_tkg`` sets it for all experts without ``router_pre_norm``)."""
    flags = ["all experts" if all_e else "selective", act, f"{_DT[w_dt]} weights", f"{_DT[in_dt]} input"] \
        + [f"{router.lower()} router"] * (router != "SOFTMAX") + ["bias"] * bias + ["clamp"] * clamp \
        + ["router_act_first"] * pre + ["norm_topk_prob"] * norm_topk + ([f"hidden_actual={ha}"] if ha else [])
    return Case(
        kernel="core/moe_block/moe_block_tkg", name=" ".join(flags),
        shapes=f"B={b} S={s} H={h} I={i} E={eg}/{el} k={k}",
        entry=f"{LIB}.moe_block.moe_block_tkg:moe_block_tkg",
        reference=f"{LIB}.moe_block.moe_block_tkg_torch:moe_block_tkg_torch_ref",
        inputs=_inputs(all_e, b, s, h, ha, i, eg, el, k, act, w_dt, in_dt, bias, clamp, pre, norm_topk, r_dt, router),
        outputs=("out", "router_logits"), lnc=LNC, rtol=5e-2 if w_dt == FP8 else 1e-2, atol=1e-5,
        test_file=f"{TESTS}/test_moe_block_tkg.py",
        tapped_reference=None if in_dt != BF16 or r_dt != BF16 else ROUTING if pre or not all_e
        else ROUTING_BY_AFFINITIES)


ROUTER_TAP = f"{LIB}.moe_block.moe_block_tkg:_router_topk"  # (router_logits, expert_index [T, K], affinities, ...)
REFERENCE = f"{LIB}.moe_block.moe_block_tkg_torch:moe_block_tkg_torch_ref"
NORM_TAP = f"{LIB}.moe_block.moe_block_tkg:_rmsnorm_tkg"  # its output tile [128, T, H/128]: the router's bf16 input


def _router_tiles(taps: dict[str, list], by_affinities: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's router logits (bf16 [T, E]) and chosen experts ([T, K]) from the router tap: every program
    records the same (both LNC 2 programs hold every token's), else ValueError. Past 128 tokens (all experts) the
    chosen experts' SBUF tile is folded, [128, T/128, K], token ``n * 128 + p`` at ``[p, n]`` (``moe_block_tkg``'s
    ``get_sbuf_tensor_shape``; ``router_topk`` stores it to HBM through that view): unfolded here.

    ``by_affinities`` (all experts without ``router_pre_norm``, where ``router_topk`` leaves that tile unwritten,
    ``skip_store_expert_index``): each token's chosen experts are those with a nonzero affinity in the kernel's
    affinities ([T, E] float32 in HBM: its top-K values' softmax scattered into zeros), largest first; exactly K
    of them, else ValueError naming the token (K: the unwritten tile's last axis)."""
    calls = taps[ROUTER_TAP]

    def unfold(value: Any) -> np.ndarray:
        index = np.asarray(value[1], np.int64)
        if by_affinities:
            k, aff = index.shape[-1], np.asarray(value[2], np.float64)
            rows = []
            for tok, row in enumerate(aff):
                nonzero = np.flatnonzero(row)
                if len(nonzero) != k:
                    raise ValueError(f"moe_block_tkg router tap: token {tok} has {len(nonzero)} nonzero affinities, "
                                     f"not top_k = {k}: its chosen experts cannot be read off them")
                rows.append(nonzero[np.argsort(-row[nonzero], kind="stable")])
            return np.array(rows, np.int64).reshape(-1, k)
        return index.transpose(1, 0, 2).reshape(-1, index.shape[2]) if index.ndim == 3 else index

    logits, index = np.asarray(calls[0][2][0], np.float64), unfold(calls[0][2])
    for rank, program, value in calls[1:]:
        if not (np.array_equal(np.asarray(value[0], np.float64), logits)
                and np.array_equal(unfold(value), index)):
            raise ValueError(f"moe_block_tkg router tap: program {program} of rank {rank} holds other logits or "
                             "expert indices than program 0")
    if index.shape[0] != logits.shape[0]:
        raise ValueError(f"moe_block_tkg router tap: chosen experts of {index.shape[0]} tokens, logits of "
                         f"{logits.shape[0]}")
    return logits, index


# The router's own float32 accumulation, for (a2)'s depth (:func:`router_depth`), where each operand lies only (no
# copies): router_topk's nc_matmuls (the PSUM destination, and the stationary operand: a [128, t] read of the router
# input tile [128, T, H/128], whose columns name each product's token and hidden tile), and the instructions that
# read those PSUM tiles into its float32 SBUF logits, each with its destination: tensor_tensor (the bias add, data1 in
# PSUM; each column-tile merge, data2 in PSUM) and tensor_copy (the first column tile's copy, without a bias). Either
# may be absent from a run (optional taps).
_ROUTER = f"{LIB}.router_topk.router_topk:nisa."
ROUTER_MATMUL_TAPS = tuple(f"{_ROUTER}nc_matmul({a}:where)" for a in ("dst", "stationary"))
ROUTER_ADD_TAPS = tuple(f"{_ROUTER}tensor_tensor({a}:where)" for a in ("dst", "data1", "data2"))
ROUTER_COPY_TAPS = tuple(f"{_ROUTER}tensor_copy({a}:where)" for a in ("dst", "src"))


def _calls(taps: dict[str, list], specs: tuple[str, ...]) -> dict[tuple[int, int], list[tuple]]:
    """One instruction's calls per (rank, program) in call order, each the tuple of its operands' records (``specs``:
    one tap per operand), else ValueError where the operands' counts differ."""
    per: dict[tuple[int, int], list[list]] = {}
    for k, spec in enumerate(specs):
        for rank, program, op in taps.get(spec) or []:
            per.setdefault((rank, program), [[] for _ in specs])[k].append(op)
    out = {}
    for (rank, program), lists in per.items():
        if len({len(ops) for ops in lists}) != 1:
            raise ValueError(f"moe_block_tkg router taps: program {program} of rank {rank} recorded "
                             + ", ".join(f"{len(ops)} {spec.rpartition('.')[2]}" for ops, spec in zip(lists, specs))
                             + " (one of each per call)")
        out[(rank, program)] = list(zip(*lists))
    return out


def router_depth(taps: dict[str, list], t: int, h: int) -> tuple[np.ndarray, str]:
    """Each token's float32 accumulation depth in ``router_topk``'s logits, counted from its taps
    (:data:`ROUTER_MATMUL_TAPS`, :data:`ROUTER_ADD_TAPS`, :data:`ROUTER_COPY_TAPS`): ``(depth [t], how)``, ``d`` the
    most float32 additions any term of the token's logits (its H products ``x_hat_h w_h``, exact in float32, and the
    bias) goes through, and ``how`` the count in words.

    Per program: each ``nc_matmul``'s PSUM destination (storage, first element) is an accumulation group; its
    stationary operand is a [K, M] read of the router input tile [128, T, H/128] (K = 128 contraction rows), so
    column ``m`` (the destination's row ``m``) is token ``c // (H/128)`` and hidden tile ``c % (H/128)`` of its
    element ``c`` in the tile. A product goes through at most ``K - 1`` additions inside its matmul ("The matmul
    accumulation and results are always in float32", ``nki.isa.nc_matmul``; any order of the PE's sum) and ``n -
    1`` PSUM accumulations for ``n`` matmuls into its group (the first writes, the others add): ``d_g = K - 1 + n -
    1``. Each group is read once into a float32 SBUF tile (the token tile of ``router_logits_sb``): by a
    ``tensor_copy`` (exact, float32 to float32) or the bias add (``tensor_tensor``, data1 in PSUM: one float32
    rounding, "performs the element-wise operation in float32 math", ``nki.isa.tensor_tensor``), which starts that
    tile, and then by each column-tile merge (``tensor_tensor`` into the same tile, data1 that tile, data2 the
    group: one rounding of everything summed so far). So every term of the tile goes through at most ``d = max_g
    d_g + [bias] + merges`` additions (the bias itself ``1 + merges``). Every row of a merged group must carry the
    tile's tokens, every group must be read exactly once, and every token of a tile must have each of its H/128
    hidden tiles contracted exactly once; a token no program computes, or anything else, is a ValueError naming
    it. A token two programs compute (all experts: both LNC programs compute every token) takes the larger depth."""
    ht = h // 128
    depth = np.zeros(t, np.int64)
    hows: set[str] = set()
    matmuls = _calls(taps, ROUTER_MATMUL_TAPS)
    adds, copies = _calls(taps, ROUTER_ADD_TAPS), _calls(taps, ROUTER_COPY_TAPS)
    if not matmuls:
        raise ValueError("moe_block_tkg router taps: no router_topk nc_matmul recorded")
    for (rank, program), calls in sorted(matmuls.items()):
        name = f"moe_block_tkg router taps: program {program} of rank {rank}"
        groups: dict[tuple[int, int], list] = {}  # PSUM place -> [matmuls, K, tokens per row, hidden tiles [M, ht]]
        for k, (dst, stat) in enumerate(calls):
            if stat.value.ndim != 2 or stat.row != t * ht:
                raise ValueError(f"{name}: matmul {k}'s stationary operand {stat.value.shape} is not a [K, M] read "
                                 f"of the router input tile [128, {t}, {ht}]")
            token, tile = np.divmod(stat.columns()[..., 1], ht)  # [K, M]
            if np.any(token != token[:1]) or np.any(tile != tile[:1]):
                raise ValueError(f"{name}: matmul {k} reads more than one token or hidden tile in a column")
            g = groups.setdefault((dst.storage, dst.offset), [0, 0, token[0], np.zeros((token.shape[1], ht), int)])
            if not np.array_equal(g[2], token[0]):
                raise ValueError(f"{name}: matmul {k} accumulates tokens {token[0].tolist()} into a PSUM group of "
                                 f"tokens {g[2].tolist()}")
            g[0], g[1] = g[0] + 1, max(g[1], stat.value.shape[0])
            g[3][np.arange(token.shape[1]), tile[0]] += 1
        read = dict.fromkeys(groups, 0)
        chains: dict[tuple[int, int], list] = {}  # SBUF tile -> [tokens, hidden tiles, (d_g, K, n) max, bias, merges]

        def group(op: Any, what: str) -> list | None:
            if op.buffer != "psum" or (op.storage, op.offset) not in groups:
                return None  # (a PSUM tile no router matmul wrote: not the logits)
            g = groups[(op.storage, op.offset)]
            if op.value.shape[0] != len(g[2]):
                raise ValueError(f"{name}: {what} reads {op.value.shape[0]} rows of a PSUM group of {len(g[2])}")
            read[(op.storage, op.offset)] += 1
            return g

        def start(dst: Any, g: list, bias: int, what: str) -> None:
            if dst.value.dtype != np.float32 or (dst.storage, dst.offset) in chains:
                raise ValueError(f"{name}: {what} writes {dst.value.dtype} logits (float32 expected) or a tile "
                                 "another group started")
            chains[(dst.storage, dst.offset)] = [g[2], g[3].copy(), (g[1] - 1 + g[0] - 1, g[1], g[0]), bias, 0]

        merges = []
        for k, (dst, src) in enumerate(copies.get((rank, program), [])):
            g = group(src, f"tensor_copy {k}")
            if g is not None:
                start(dst, g, 0, f"tensor_copy {k}")
        for k, (dst, d1, d2) in enumerate(adds.get((rank, program), [])):
            if (g := group(d1, f"tensor_tensor {k}")) is not None:  # (the bias add: PSUM + the bias tile)
                start(dst, g, 1, f"tensor_tensor {k}")
            elif (g := group(d2, f"tensor_tensor {k}")) is not None:  # (a column-tile merge)
                merges.append((k, dst, d1, g))
        for k, dst, d1, g in merges:
            chain = chains.get((dst.storage, dst.offset))
            if chain is None or (d1.storage, d1.offset) != (dst.storage, dst.offset):
                raise ValueError(f"{name}: tensor_tensor {k} adds a PSUM group to a tile no copy or bias add "
                                 "started, or not onto that tile")
            if not np.array_equal(chain[0], g[2]):
                raise ValueError(f"{name}: tensor_tensor {k} merges tokens {g[2].tolist()} into a tile of tokens "
                                 f"{chain[0].tolist()}")
            chain[1] += g[3]
            chain[2], chain[4] = max(chain[2], (g[1] - 1 + g[0] - 1, g[1], g[0])), chain[4] + 1
        unread = [key for key, n in read.items() if n != 1]
        if unread:
            raise ValueError(f"{name}: a PSUM group of the router's matmuls read by {read[unread[0]]} instructions "
                             "(once expected)")
        for tokens, tiles, (d_g, k, n), bias, m in chains.values():
            if np.any(tiles != 1):
                row, j = (int(v) for v in np.argwhere(tiles != 1)[0])
                raise ValueError(f"{name}: token {int(tokens[row])}'s hidden tile {j} contracted {tiles[row, j]} "
                                 "times (once expected)")
            d = d_g + bias + m
            depth[tokens] = np.maximum(depth[tokens], d)
            hows.add(f"d = {k - 1} + {n - 1}" + " + 1" * bias + f" + {m} = {d} ({k}-row matmuls, {n} into a PSUM "
                     "group" + ", the bias add" * bias + f", {m} column-tile merge" + "s" * (m != 1) + ")")
    if np.any(depth == 0):
        raise ValueError(f"moe_block_tkg router taps: token {int(np.argmin(depth))}'s logits computed by no router "
                         "matmul")
    return depth, "; ".join(sorted(hows))


def _gamma(n: int, unit: float = FP32_UNIT) -> float:
    """Higham's gamma_n = n u / (1 - n u): a sum in which each term goes through at most n roundings of unit u is
    within gamma_n times the sum of the terms' magnitudes of the exact sum, in any order of the additions
    (Accuracy and Stability of Numerical Algorithms, Lemma 3.1)."""
    return n * unit / (1 - n * unit)


def _bf16_half_step(v: np.ndarray) -> np.ndarray:
    """Half the spacing of bf16 values (8 significant bits) in the binade of ``v`` (>= 0): a round to nearest of a
    value of magnitude at most ``v`` moves it by at most this (subnormals: bf16's smallest normal's spacing)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.asarray(v, np.float64), 2.0 ** -126))) - 8)


def norm_error(h: int) -> float:
    """The relative error bound of ``_rmsnorm_tkg``'s float32 value ``y`` (before its one rounding to the bf16
    output tile) against the exact RMS norm ``x / sqrt(sum(x^2) / hidden_actual + eps) * gamma``, for ``h`` hidden
    values (nki-library's ``_process_rmsnorm_tile``, float32 math throughout: "performs the element-wise operation
    in float32 math. The float32 results are cast to" the output's dtype, NKI ISA reference):

    - ``x^2`` of a bf16 value and ``x * gamma`` of two are exact in float32 (8 significant bits squared fit 24);
    - the sum of the h squares (``tensor_reduce`` over the free axis, then the ones-matmul over the 128
      partitions into PSUM) is ``S (1 + t)``, ``|t| <= gamma_{h-1}``: each term goes through at most h - 1
      additions in any order;
    - ``activation(rsqrt, data=S, scale=1/hidden_actual, bias=eps)``: the scale and eps are float32 roundings of
      theirs (one each), the product and the sum one each, so the mean is ``m (1 + t')``, ``|t'| <=
      gamma_{h+2}`` (both terms positive); rsqrt as ``1 / sqrt`` in float32 (the interpreter's ``ops.rsqrt``):
      two roundings;
    - the product ``(x gamma) * rsqrt``: one rounding.

    So ``y = exact (1 + t')^(-1/2) (1 + d_b)(1 + d_c) / (1 + d_a)``, ``|d| <= u = 2^-24``: the worst case is
    ``(1 - gamma_{h+2})^(-1/2) (1 + u)^2 / (1 - u) - 1`` (the other sign is smaller)."""
    u = FP32_UNIT
    return (1 - _gamma(h + 2)) ** -0.5 * (1 + u) ** 2 / (1 - u) - 1


def rounded_once(tapped: np.ndarray, value: np.ndarray, slack: np.ndarray, label: str, what: str) -> TileCheck:
    """Whether ``tapped`` (a bf16 tile, [tokens, features]) is the round to nearest of some value within
    ``slack`` (>= 0, per element) of ``value`` (float64): each element within ``half_step(|value| + slack) +
    slack`` of ``value`` (``half_step``: half the bf16 spacing in that magnitude's binade, :func:`_bf16_half_step`),
    a derived bound with no statistical part. A :class:`TileCheck` labelled ``label``; its figures give the
    largest error as a share of its element's bound, how many values are ``value``'s own nearest bf16, and for a
    tile beyond the bound the first element beyond it (token, feature, tapped and ``what`` values, bound)."""
    t, x, s = (np.asarray(v, np.float64) for v in (tapped, value, slack))
    if t.shape != x.shape or not np.all(np.isfinite(t)):
        return TileCheck(label, False, float("inf"), f"shape {t.shape} vs {x.shape}" if t.shape != x.shape
                         else "non-finite values")
    s = np.broadcast_to(s, x.shape)
    bound = _bf16_half_step(np.abs(x) + s) + s
    share = np.abs(t - x) / bound
    worst = float(share.max()) if share.size else 0.0
    nearest = float(np.mean(t == cast_bf16(x))) if t.size else 1.0
    # (the float32 part used: an error past half a bf16 step, as a share of the slack)
    past = np.divide(np.abs(t - x) - (bound - s), s, out=np.zeros_like(s), where=s > 0)
    rule = "one bf16 round to nearest of a float32 value within the derived float32 error"
    if worst <= 1.0:
        return TileCheck(label, True, worst, (
            f"max|err| {worst:.3f} of its bound ({rule}: half a bf16 step at the value plus that error; "
            f"{nearest:.4%} of the values {what}'s nearest bf16, the largest error past half a step "
            f"{max(float(past.max()), 0.0):.2g} of the float32 error bound)"))
    beyond = np.argwhere(share > 1.0)
    tok, f = (int(i) for i in beyond[0])
    return TileCheck(label, False, worst, (
        f"{len(beyond)} of {t.size} values beyond {rule}: the first at token {tok}, feature {f}: {t[tok, f]!r} "
        f"against {what} {x[tok, f]:.8g} (error {abs(t[tok, f] - x[tok, f]):.3g} > bound {bound[tok, f]:.3g}, "
        f"{share[tok, f]:.2f} of it); max|err| {worst:.2f} of its element's bound"))


def _router_input(taps: dict[str, list], t: int, h: int, single_core: bool) -> np.ndarray:
    """The router's bf16 input as [T, H] float64, from the RMS-norm tap (``_rmsnorm_tkg``'s output tile, the
    router's ``x`` with a bf16 router: ``moe_block_tkg`` copies it only to another ``router_mm_dtype``): every
    program records the same tile ([128, T, H/128]; both LNC 2 programs hold every token's), else ValueError.
    Its layout is ``load_input_to_sbuf``'s without ``hidden_dim_tp``: ``n`` H shards, the tile's element
    ``[p, t, s * H/(128 n) + j]`` is ``h = s * H/n + p * H/(128 n) + j``; ``n`` is 1 where ``rmsnorm_tkg`` runs
    ``single_core_forced`` (selective experts, T > 1, no MX weights: router layout ``XSBLayout_tp102__0``), else
    the LNC (2: ``XSBLayout_tp2013__1``, whose weight rows ``router_topk_input_w_load`` lays out the same way)."""
    calls = taps.get(NORM_TAP) or []
    if not calls:
        raise ValueError("moe_block_tkg RMS-norm tap: no router input recorded")
    tile = np.asarray(calls[0][2], np.float64)
    for rank, program, value in calls[1:]:
        if not np.array_equal(np.asarray(value, np.float64), tile):
            raise ValueError(f"moe_block_tkg RMS-norm tap: program {program} of rank {rank} holds another router "
                             "input than program 0")
    n = 1 if single_core else LNC
    if tile.shape != (128, t, h // 128) or h % (128 * n):
        raise ValueError(f"moe_block_tkg RMS-norm tap: tile of shape {tile.shape}, expected (128, {t}, {h // 128})")
    return tile.reshape(128, t, n, h // (128 * n)).transpose(1, 2, 0, 3).reshape(t, h)


def routing_projection(inputs: dict[str, Any], taps: dict[str, list], run: Callable[..., dict],
                       by_affinities: bool = False) -> list:
    """The kernel's router input and logits against derived bounds, and its routing against the golden's.

    (a1) ``router input``: the tapped RMS-norm tile (:func:`_router_input`) is the bf16 round to nearest of a
    float32 value within :func:`norm_error` (relative) of the exact RMS norm of the kernel's inputs (float64: ``inp``
    over ``hidden_actual``, eps 1e-6, times ``gamma``; float64's own error, ``gamma^(53)_{H+8}`` relative, added):
    :func:`rounded_once`. (a2) ``router logits``: the kernel's bf16 logits are the round to nearest of a float32
    value within ``gamma_d * (sum_h |x_hat w| + |b|)`` of the tapped input's exact logits ``x_hat @ w + b`` (H bf16
    products, exact in float32, and the float32 bias: H + 1 terms, each through at most ``d`` float32 additions in
    any order, Higham, Lemma 3.1; ``d`` each token's depth counted from the router's own taps, :func:`router_depth`:
    within its matmuls, across PSUM accumulation, the bias add and the column-tile merges; float64's error on
    ``x_hat @ w`` added as ``gamma^(53)_{H+1}`` of the same sum). No statistical test.

    The routing (a :class:`TileCheck`): each token's chosen experts are K distinct experts and a top-K of the
    kernel's own logits (none unchosen above a chosen one); where the chosen set differs from the golden's (top-K of
    nki-library's float32 logits ``G``), every expert ``e`` in the difference has ``|G_e - G_K| <= D_e + max D``
    over the difference (``G_K`` the token's K-th largest golden logit), ``D_e`` (a2)'s bound of ``e`` plus the
    input's actual effect ``|x_hat w + b - G|_e``: from (a2) and the top-K, ``|L - G| <= D``, so a kernel-chosen
    ``e`` the golden leaves out lies within ``D_e + D_e'`` below ``G_K`` for an ``e'`` the golden takes and the
    kernel leaves out, and the reverse. Every other token is routed as the golden routes.

    All experts (``is_all_expert``): the same conditions on every token and expert, the rank's own or not (a swap
    between two other ranks' experts changes only the top-K normalization of the rank's affinities); each differing
    token's message names the experts of the difference that are the rank's own, the ones whose MLPs change its
    ``out``. ``by_affinities``: the chosen experts read off the kernel's nonzero affinities (:func:`_router_tiles`).
    """
    x = np.asarray(inputs["inp"], np.float64)
    t, h = x.shape[0] * x.shape[1], x.shape[2]
    x = x.reshape(t, h)
    h_actual = inputs.get("hidden_actual") or h
    rms = np.sqrt((x ** 2).sum(axis=1, keepdims=True) / h_actual + 1e-6)
    norm = x / rms * np.asarray(inputs["gamma"], np.float64).reshape(1, h)
    w = np.asarray(inputs["router_weights"], np.float64)
    b = np.zeros((1, w.shape[1])) if inputs.get("router_bias") is None \
        else np.asarray(inputs["router_bias"], np.float64).reshape(1, -1)
    x_hat = _router_input(taps, t, h, single_core=not inputs.get("is_all_expert") and t > 1)
    f64 = 2.0 ** -53
    a1 = rounded_once(x_hat, norm, (norm_error(h) + _gamma(h + 8, f64)) * np.abs(norm), "router input",
                      "the exact RMS norm")
    fed = x_hat @ w + b  # (the tapped input's logits: H exact products and the bias, summed in float64)
    abs_sum = np.abs(x_hat) @ np.abs(w) + np.abs(b)
    depth, how = router_depth(taps, t, h)
    slack = (_gamma(depth).reshape(t, 1) + _gamma(h + 1, f64)) * abs_sum
    logits, index = _router_tiles(taps, by_affinities)
    a2 = rounded_once(logits, fed, slack, "router logits", "the tapped input's exact logit")
    a2 = dataclasses.replace(a2, figures=f"{a2.figures} (float32 error gamma_d sum|x_hat w|, counted from the "
                             f"router's taps: {how})")
    k = index.shape[1]
    golden = np.asarray(run(lambda kw: kw)["router_logits"], np.float64).reshape(t, -1)
    gold_sel = np.argsort(-golden, axis=1, kind="stable")[:, :k]
    reach = _bf16_half_step(np.abs(fed) + slack) + slack + np.abs(fed - golden)  # D: |L - G| <= D given (a2)
    kth = -np.sort(-golden, axis=1)[:, k - 1]
    worst, differ = 0.0, []
    local = range(0)  # all experts: the rank's own experts, the only ones whose MLPs add to its out
    if inputs.get("is_all_expert"):
        e_local = np.asarray(inputs["expert_gate_up_weights"]).shape[0]
        rank = int(np.asarray(inputs["rank_id"]).reshape(-1)[0])
        local = range(rank * e_local, (rank + 1) * e_local)
    for tok in range(t):
        chosen = set(index[tok].tolist())
        if len(chosen) != k or not all(0 <= e < logits.shape[1] for e in chosen):
            return [a1, a2, TileCheck("routing", False, float("inf"), f"token {tok}: chosen experts "
                                      f"{index[tok].tolist()} are not {k} distinct experts of {logits.shape[1]}")]
        rest = np.setdiff1d(np.arange(logits.shape[1]), index[tok])
        if logits[tok, index[tok]].min() < logits[tok, rest].max():
            return [a1, a2, TileCheck("routing", False, float("inf"), f"token {tok}: the kernel's experts "
                                      f"{index[tok].tolist()} are not a top-{k} of its own router logits (chosen min "
                                      f"{logits[tok, index[tok]].min():.5g} < unchosen max "
                                      f"{logits[tok, rest].max():.5g})")]
        swapped = sorted(chosen ^ set(gold_sel[tok].tolist()))
        if swapped:
            widest = max(reach[tok, e] for e in swapped)
            shares = {e: abs(golden[tok, e] - kth[tok]) / (reach[tok, e] + widest) for e in swapped}
            share = max(shares.values())
            worst = max(worst, share)
            differ.append(f"token {tok}: golden {sorted(set(gold_sel[tok].tolist()) - chosen)} -> kernel "
                          f"{sorted(chosen - set(gold_sel[tok].tolist()))}, golden logits "
                          + ", ".join(f"{golden[tok, e]:.5f}" for e in swapped) + f" against its K-th "
                          f"{kth[tok]:.5f}, from the kernel's input " + ", ".join(f"{fed[tok, e]:.5f}" for e in swapped)
                          + f" ({share:.2f} of the window {max(reach[tok, e] + widest for e in swapped):.2g})"
                          + (f", of them on this rank {[e for e in swapped if e in local]}" if local else ""))
            if share > 1:
                return [a1, a2, TileCheck("routing", False, share, "not a near tie: " + differ[-1])]
    figures = (f"{len(differ)} of {t} tokens routed otherwise than the golden, each a near tie: " + "; ".join(differ)
               if differ else f"all {t} tokens routed as the golden")
    return [a1, a2, TileCheck("routing", True, worst, figures)]


@contextlib.contextmanager
def routed_as_kernel(root: Path, taps: dict[str, list], by_affinities: bool = False) -> Iterator[None]:
    """Inside the block nki-library's router reference (``router_topk_torch_ref``, as ``moe_block_tkg_torch_ref``
    calls it) takes each token's experts as the kernel chose them: its one ``torch.argsort`` of the logits returns,
    per token, the kernel's K experts first (in the kernel's order), then the others in the reference's own order.
    Everything after the selection (the affinities from the float32 logits, the experts' MLPs) is the reference's
    own arithmetic: exact for any token and any number of tokens, where nudging a shared router bias would move
    other tokens' logits too."""
    import torch

    router = _resolve(REFERENCE, root).__globals__["router_topk_torch_ref"]
    module = router.__globals__
    _, index = _router_tiles(taps, by_affinities)

    class Routed:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def argsort(values: Any, dim: int = -1, **kw: Any) -> Any:
            order = torch.argsort(values, dim=dim, **kw)
            if dim not in (-1, 1) or tuple(order.shape) != (index.shape[0], order.shape[-1]):
                raise ValueError(f"moe_block_tkg routed reference: argsort of shape {tuple(order.shape)} on dim "
                                 f"{dim}, expected [{index.shape[0]}, E] on the experts' axis")
            rows = []
            for tok, first in enumerate(index.tolist()):
                rest = [e for e in order[tok].tolist() if e not in first]
                rows.append(first + rest)
            return torch.tensor(rows, dtype=order.dtype)

    saved = module["torch"]
    module["torch"] = Routed()
    try:
        yield
    finally:
        module["torch"] = saved


_ROUTING_TAPS = (NORM_TAP, ROUTER_TAP) + ROUTER_MATMUL_TAPS + ROUTER_ADD_TAPS + ROUTER_COPY_TAPS
ROUTING = TappedReference(
    what="router input, logits and routing (the reference routed each token as the kernel routes it)",
    taps=_ROUTING_TAPS, optional=ROUTER_ADD_TAPS + ROUTER_COPY_TAPS, projection=routing_projection,
    ref_inputs=lambda kw, taps: kw, during=routed_as_kernel)
# all experts without router_act_first: the kernel's chosen experts read off its nonzero affinities
ROUTING_BY_AFFINITIES = TappedReference(
    what="router input, logits and routing (the kernel's chosen experts read off its nonzero affinities; the reference "
         "routed each token as the kernel routes it)",
    taps=_ROUTING_TAPS, optional=ROUTER_ADD_TAPS + ROUTER_COPY_TAPS,
    projection=functools.partial(routing_projection, by_affinities=True),
    ref_inputs=lambda kw, taps: kw, during=functools.partial(routed_as_kernel, by_affinities=True))


def moe_block_cases() -> list[Case]:
    return [moe_block_case(*row) for row in _ROWS]
