"""fp64-oracle parity: every kernel (forward and backward, fp32 and bf16) is at least nearly as accurate
as torch itself (the rule and the error measure: tests/tolerances.py; the oracles: oracles.py).

Tiers: the fast tier runs small shapes; ``-m slow`` runs the production shapes with full arithmetic
(rope q [1,32,4096,128] + k [1,8,4096,128]; router T=8192, H=2048, E=128, K=8, softmax and the sigmoid /
selection-bias / routed-scaling variant; the Qwen3-30B-A3B MoE layer H=2048, I=768, E=128, K=8 at
T=2048, and its two grouped matmuls, gate_up [16384 x 2048] @ [128, 2048, 1536] and down
[16384 x 768] @ [128, 768, 2048]) and hypothesis properties with 50 examples each, bf16 included, whose
shape ranges reach every tiling path (partial tiles, several chunks / blocks, LNC=2). In fp32 the
30B-A3B expert weights exceed the kernels' SBUF constraint (moe: 147 KiB > 96 KiB per partition per
expert; grouped_mm gate_up backward: 96 KiB + 96 KiB for the transposed copy), so fp32 runs the layer's
TP=2 shard (I=384) there; everything else runs the full layer. docs/tests.md has the slow tier's wall time.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kernels import oracles as O
from tests.tolerances import F64, check_oracle
from trnkit.kernels import moe, rope, router
from trnkit.kernels.rope.rope_kernel import rope_hf_kernel
from trnkit.kernels.router.router_fwd import router_topk_kernel

DTYPES = [torch.float32, torch.bfloat16]
SLOW = settings(max_examples=50, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------- rope
def _angles(rows: int, D: int, start: int = 0) -> torch.Tensor:
    ang = torch.arange(start, start + rows, dtype=torch.float32)[:, None] * 1e4 ** (-torch.arange(0, D, 2) / D)
    return torch.cat([ang, ang], -1)


def rope_case(B: int, Hq: int, Hk: int, S: int, D: int, dtype: torch.dtype, backward: bool, lnc: int = 1,
              layout: str = "bhsd", table: str = "packed", table_dtype: torch.dtype = torch.float32,
              extra: int = 0, seed: int = 0) -> None:
    """Qwen3-style cos/sin tables of ``S + extra`` positions: 2-D, per-batch 3-D (shifted positions),
    or packed ``cat(cos, sin)``."""
    g = _g(seed)
    shape = (lambda H: (B, H, S, D)) if layout == "bhsd" else (lambda H: (B, S, H, D))
    q = torch.randn(shape(Hq), generator=g).to(dtype)
    k = torch.randn(shape(Hk), generator=g).to(dtype)
    ang = _angles(S + extra, D)
    if table.endswith("3d"):
        ang = torch.stack([_angles(S + extra, D, start=7 * b) for b in range(B)])
    cos, sin = ang.cos().to(table_dtype), ang.sin().to(table_dtype)
    tabs = {"rope_cache": torch.cat([cos, sin], -1)} if table.startswith("packed") else {"cos": cos, "sin": sin}
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if lnc > 1:
        c, s = (tabs["rope_cache"],) * 2 if "rope_cache" in tabs else (cos, sin)
        rope_hf_kernel[lnc](q, k, q_out, k_out, c, s, packed="rope_cache" in tabs, backward=backward,
                                 bshd=layout == "bshd")
    else:
        (rope.rope_hf if layout == "bhsd" else rope.rope_hf_bshd)(q, k, q_out, k_out, backward=backward, **tabs)
    for name, x, out in (("rope q", q, q_out), ("rope k", k, k_out)):
        O.check_all((name,), out, lambda dt, x=x: O.rope(x, cos, sin, dt, backward, layout), dtype)


# ------------------------------------------------------------------------------------------- router
def router_case(T: int, H: int, E: int, K: int, dtype: torch.dtype, backward: bool, norm: bool = True,
                lnc: int = 1, scoring: str = "softmax", bias: bool = False, scale: float = 1.0,
                grad_logits: bool = False, seed: int = 0) -> None:
    """Forward: logits and the weights of the kernel's own selection (a near-tie may select
    differently in fp64; the selection itself is tested exactly in test_router_topk.py)."""
    g = _g(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype)
    kw = dict(scoring=scoring, selection_bias=torch.randn(E, generator=g) * 0.2 if bias else None,
              routed_scaling_factor=scale)
    if lnc > 1:
        weights, idx, logits = router_topk_kernel[lnc](x, w, K, norm, False, **kw)
    else:
        weights, idx, logits = router.router_topk(x, w, K, norm, **kw)
    variant = dict(norm=norm, scoring=scoring, scale=scale)
    if not backward:
        O.check_all(("router logits", "router weights"), (logits, weights),
                    lambda dt: O.router_weights(x, w, idx, dt, **variant), dtype)
        return
    gw = torch.randn(T, K, generator=g)
    gl = torch.randn(T, E, generator=g) if grad_logits else None
    got = router.router_topk_bwd(x, w, logits, idx, gw, gl, norm, scoring=scoring, routed_scaling_factor=scale)
    O.check_all(("router grad_x", "router grad_w"), got,
                lambda dt: O.router_grads(x, w, idx, gw, gl, dt, **variant), dtype)


# ---------------------------------------------------------------------------------------------- moe
_LAST_INPUTS: dict[tuple, tuple] = {}


def cached(build: Callable[..., tuple]) -> Callable[..., tuple]:
    """The last inputs built, whatever the builder: a production case's fwd and bwd share their inputs
    (drawn once: ~10 s and ~1.3 GB for the bf16 MoE layer), and only one set is ever held."""
    def get(*key) -> tuple:
        full = (build.__name__, *key)
        if full not in _LAST_INPUTS:
            _LAST_INPUTS.clear()
            _LAST_INPUTS[full] = build(*key)
        return _LAST_INPUTS[full]

    return get


@cached
def moe_inputs(T: int, H: int, inter: int, E: int, K: int, dtype: torch.dtype, seed: int = 0):
    g = _g(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    idx, tw = O.routing(T, E, K, g)
    wgu = torch.randn(E, H, 2 * inter, generator=g).mul_(H ** -0.5).to(dtype)
    wd = torch.randn(E, inter, H, generator=g).mul_(inter ** -0.5).to(dtype)
    go = torch.randn(T, H, generator=g).to(dtype)
    return x, idx, tw, wgu, wd, go


def moe_case(T: int, H: int, inter: int, E: int, K: int, dtype: torch.dtype, backward: bool, lnc: int = 1,
             block_size: int = 128, seed: int = 0) -> None:
    x, idx, tw, wgu, wd, go = moe_inputs(T, H, inter, E, K, dtype, seed)
    if not backward:
        out = moe.moe_experts(x, idx, tw, wgu, wd, block_size=block_size, lnc=lnc)
        O.check_all(("moe out",), out, lambda dt: O.experts(x, idx, tw, wgu, wd, dt), dtype)
        return
    got = moe.moe_experts_bwd(x, idx, tw, wgu, wd, go, block_size=block_size, lnc=lnc)
    O.check_experts_bwd(got, x, idx, tw, wgu, wd, go, dtype)


@cached
def grouped_mm_inputs(M: int, Kd: int, N: int, G: int, dtype: torch.dtype, routed: bool, seed: int = 0):
    """``routed``: group sizes of a top-8 routing of M / 8 tokens (production); else random offsets,
    empty groups and rows past the last offset included."""
    g = _g(seed)
    x = torch.randn(M, Kd, generator=g).to(dtype)
    w = torch.randn(G, Kd, N, generator=g).mul_(Kd ** -0.5).to(dtype)
    if routed:
        offs = torch.bincount(O.routing(M // 8, G, 8, g)[0].reshape(-1).long(), minlength=G).cumsum(0)
    else:
        offs = torch.sort(torch.randint(0, M + 1, (G,), generator=g)).values
    go = torch.randn(M, N, generator=g).to(dtype)
    return x, w, offs.to(torch.int32), go


def grouped_mm_case(M: int, Kd: int, N: int, G: int, dtype: torch.dtype, backward: bool, lnc: int = 1,
                    block_size: int = 128, routed: bool = False, seed: int = 0) -> None:
    x, w, offs, go = grouped_mm_inputs(M, Kd, N, G, dtype, routed, seed)
    if not backward:
        out = moe.grouped_mm(x, w, offs, block_size=block_size, lnc=lnc)
        O.check_all(("grouped_mm out",), out, lambda dt: O.grouped_mm(x, w, offs, dt), dtype)
        return
    got = moe.grouped_mm_bwd(x, w, offs, go, block_size=block_size, lnc=lnc)
    O.check_grouped_mm_bwd(got, x, w, offs, go, dtype)


# ---------------------------------------------------------------------------------------- fast tier
SMALL = {
    "rope": lambda dt, bwd: rope_case(1, 3, 2, 130, 32, dt, bwd),
    "router": lambda dt, bwd: router_case(200, 256, 16, 4, dt, bwd),
    "router_sigmoid": lambda dt, bwd: router_case(70, 96, 20, 4, dt, bwd, scoring="sigmoid", bias=True, scale=2.5,
                                                  grad_logits=True),
    "moe": lambda dt, bwd: moe_case(40, 128, 64, 4, 2, dt, bwd),
    "grouped_mm": lambda dt, bwd: grouped_mm_case(70, 160, 96, 3, dt, bwd),
}


def _tp2(dt: torch.dtype, full: int) -> int:
    """bf16: the full layer dimension; fp32: its TP=2 shard (the SBUF constraint, module docstring)."""
    return full if dt == torch.bfloat16 else full // 2


PRODUCTION = {
    "rope": lambda dt, bwd: rope_case(1, 32, 8, 4096, 128, dt, bwd),
    "router": lambda dt, bwd: router_case(8192, 2048, 128, 8, dt, bwd),
    "router_sigmoid": lambda dt, bwd: router_case(8192, 2048, 128, 8, dt, bwd, scoring="sigmoid", bias=True,
                                                  scale=2.5, grad_logits=True),
    "moe": lambda dt, bwd: moe_case(2048, 2048, _tp2(dt, 768), 128, 8, dt, bwd),
    # fp32 gate_up: the forward fits the full layer (96 KiB), the backward (+ w^T: 192 KiB) runs the shard
    "grouped_mm_gate_up": lambda dt, bwd: grouped_mm_case(2048 * 8, 2048, _tp2(dt, 2 * 768) if bwd else 2 * 768,
                                                          128, dt, bwd, routed=True),
    "grouped_mm_down": lambda dt, bwd: grouped_mm_case(2048 * 8, 768, 2048, 128, dt, bwd, routed=True),
}
DIRECTIONS = pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
DTYPE_IDS = pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])


@DIRECTIONS
@DTYPE_IDS
@pytest.mark.parametrize("kernel", SMALL)
def test_small_shapes(kernel, dtype, backward) -> None:
    SMALL[kernel](dtype, backward)


def test_rule_fails_a_less_accurate_result() -> None:
    """The rule rejects a result 2x as far from the oracle as torch's (and names both errors)."""
    o = torch.randn(1000, dtype=F64)
    base = o + 1e-3 * torch.randn(1000, dtype=F64)  # (fp64: the eps/4 floor is ~5e-17)
    check_oracle("same as torch", base, base, o)
    with pytest.raises(AssertionError, match=r"worse: error vs the fp64 oracle .* > 1.5 x torch's .*max abs"):
        check_oracle("worse", o + 2 * (base - o), base, o)


def test_streamed_error_equals_the_whole() -> None:
    """OracleErr over parts gives the error of the whole output."""
    from tests.tolerances import OracleErr

    o = torch.randn(6, 50, dtype=F64)
    r, b = o + 1e-3 * torch.randn(6, 50, dtype=F64), o + 1e-3 * torch.randn(6, 50, dtype=F64)
    whole, parts = OracleErr("w", F64), OracleErr("p", F64)
    whole.add(r, b, o)
    for i in range(6):
        parts.add(r[i], b[i], o[i])
    assert whole.errors() == pytest.approx(parts.errors(), rel=1e-12)


# ---------------------------------------------------------------------------------------- slow tier
@pytest.mark.slow
@DIRECTIONS
@DTYPE_IDS
@pytest.mark.parametrize("kernel", PRODUCTION)
def test_production_shapes(kernel, dtype, backward) -> None:
    PRODUCTION[kernel](dtype, backward)


@pytest.mark.slow
@SLOW
@given(B=st.integers(1, 2), S=st.integers(1, 700), D=st.sampled_from([2, 16, 64, 128]), Hq=st.integers(1, 4),
       Hk=st.integers(1, 3), dtype=st.sampled_from(DTYPES), backward=st.booleans(), lnc=st.sampled_from([1, 2]),
       layout=st.sampled_from(["bhsd", "bshd"]), table=st.sampled_from(["2d", "3d", "packed", "packed3d"]),
       table_dtype=st.sampled_from(DTYPES), extra=st.integers(0, 3))
def test_rope_property(B, S, D, Hq, Hk, dtype, backward, lnc, layout, table, table_dtype, extra) -> None:
    """S up to 700 with D down to 2: full 128-partition chunks of several rows each, several chunks, a
    partial chunk on fewer partitions; both layouts, every table form and dtype, LNC=2 splits chunks.
    (The GpSimd share of the slabs appears at production size: test_production_shapes.)"""
    rope_case(B, Hq, Hk, S, D, dtype, backward, lnc=lnc, layout=layout, table=table, table_dtype=table_dtype,
              extra=extra)


@pytest.mark.slow
@SLOW
@given(T=st.integers(1, 1100), H=st.sampled_from([64, 128, 200, 384]),
       E=st.one_of(st.integers(1, 160), st.sampled_from([256, 512])), data=st.data(),
       dtype=st.sampled_from(DTYPES), backward=st.booleans(), norm=st.booleans(), lnc=st.sampled_from([1, 2]),
       variant=st.sampled_from(["softmax", "softmax_scaled", "sigmoid", "sigmoid_bias"]))
def test_router_property(T, H, E, data, dtype, backward, norm, lnc, variant) -> None:
    """T past 2 x 512-token chunks with tails not a multiple of 16 (Tensor-engine path), H a multiple of
    128 (bf16: DMA transposes) or not, E > 128 (several expert blocks; the backward's second phase)
    up to 512, every scoring variant, the logits' own gradient, LNC=2 for the forward."""
    K = data.draw(st.integers(1, min(8, E)), label="K")
    router_case(T, H, E, K, dtype, backward, norm=norm, lnc=1 if backward else lnc,
                scoring="sigmoid" if variant.startswith("sigmoid") else "softmax", bias=variant == "sigmoid_bias",
                scale=2.5 if variant in ("softmax_scaled", "sigmoid_bias") else 1.0,
                grad_logits=data.draw(st.booleans(), label="grad_logits"))


@pytest.mark.slow
@SLOW
@given(T=st.integers(1, 300), H=st.sampled_from([128, 320, 640]), inter=st.sampled_from([64, 192, 640]),
       E=st.integers(1, 6), data=st.data(), dtype=st.sampled_from(DTYPES), backward=st.booleans(),
       lnc=st.sampled_from([1, 2]), block_size=st.sampled_from(moe.BLOCK_SIZES))
def test_moe_property(T, H, inter, E, data, dtype, backward, lnc, block_size) -> None:
    """Experts with several blocks and a partial block, every block size (> 128: 128-row sub-tiles),
    I past 4 chunks (two swiglu passes), H not a multiple of 128 and past one 512-column PSUM bank,
    LNC=2 (experts split between the cores), K up to 8."""
    K = data.draw(st.integers(1, min(8, E)), label="K")
    moe_case(T, H, inter, E, K, dtype, backward, lnc=lnc, block_size=block_size)


@pytest.mark.slow
@SLOW
@given(M=st.integers(1, 400), Kd=st.sampled_from([64, 200, 640]), N=st.sampled_from([32, 512, 600]),
       G=st.integers(1, 5), dtype=st.sampled_from(DTYPES), backward=st.booleans(), lnc=st.sampled_from([1, 2]),
       block_size=st.sampled_from(moe.BLOCK_SIZES))
def test_grouped_mm_property(M, Kd, N, G, dtype, backward, lnc, block_size) -> None:
    """Random offsets (empty groups, rows past the last offset), K past and short of 128-row chunks, N
    past one PSUM bank, every block size, LNC=2."""
    grouped_mm_case(M, Kd, N, G, dtype, backward, lnc=lnc, block_size=block_size)
