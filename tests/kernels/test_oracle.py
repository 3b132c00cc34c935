"""fp64-oracle parity: every kernel (forward and backward, fp32 and bf16) is at least nearly as accurate
as torch itself.

Rule: ``err(kernel) <= 1.5 * err(torch at the same dtype) + eps/4`` (eps of the output dtype: a floor for
tiny outputs whose errors are rounding noise), both measured against an fp64 oracle, with
``err(a) = ||a - oracle|| / ||oracle||`` (Frobenius, so it scales with the reduction length instead of a
fixed element-wise tolerance). The oracle and the torch baseline are one plain-torch function written
here (independent of the kernels' ``*_ref``), evaluated once in float64 and once in the test dtype
(torch's own bf16 / fp32 ops, autograd for gradients). Inputs are the same dtype-rounded tensors for all
three.

Tiers: the fast tier runs small shapes; ``-m slow`` runs the production shapes with full arithmetic
(rope [1,32,4096,128] + k [1,8,4096,128]; router T=8192, H=2048, E=128, K=8; Qwen3-30B-A3B MoE layer with
T=2048, its TP=2 shard I=384 in fp32) and hypothesis properties with 50 examples each whose shape
ranges reach the tiling paths (partial tiles, several chunks, LNC=2). docs/tests.md has the slow tier's wall time.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trnkit.kernels import moe

rope = importlib.import_module("trnkit.kernels.rope_hf")  # (trnkit.kernels.rope_hf is also a function)
router = importlib.import_module("trnkit.kernels.router_topk")

DTYPES = [torch.float32, torch.bfloat16]
RATIO = 1.5
F64 = torch.float64
SLOW = settings(max_examples=50, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def rel_err(a: torch.Tensor, oracle: torch.Tensor) -> float:
    return float((a.to(F64) - oracle).norm() / oracle.norm().clamp_min(1e-300))


def check(name: str, kernel: torch.Tensor, baseline: torch.Tensor, oracle: torch.Tensor) -> None:
    """``err(kernel) <= 1.5 err(torch) + eps/4`` (eps of the kernel output's dtype: below a quarter ulp
    the two summation orders' rounding noise, not accuracy, decides the ratio on small outputs)."""
    ek, et = rel_err(kernel, oracle), rel_err(baseline, oracle)
    floor = torch.finfo(kernel.dtype).eps / 4 if kernel.dtype.is_floating_point else 0.0
    assert ek <= RATIO * et + floor, f"{name}: kernel error {ek:.3e} > {RATIO} x torch's {et:.3e} + {floor:.1e}"


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaves(ts: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.detach().to(dtype).requires_grad_(True) for t in ts]


# --------------------------------------------------------------------------------------------- rope
def _rot(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rope_case(B: int, Hq: int, Hk: int, S: int, D: int, dtype: torch.dtype, backward: bool, lnc: int = 1,
              seed: int = 0) -> None:
    g = _g(seed)
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, S, D, generator=g).to(dtype)
    ang = torch.arange(S, dtype=torch.float32)[:, None] * 1e4 ** (-torch.arange(0, D, 2) / D)
    ang = torch.cat([ang, ang], -1)
    cache = torch.cat([ang.cos(), ang.sin()], -1)  # packed fp32 [S, 2D]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if lnc > 1:
        rope.rope_hf_kernel[lnc](q, k, q_out, k_out, cache, cache, packed=True, backward=backward, bshd=False)
    else:
        rope.rope_hf(q, k, q_out, k_out, rope_cache=cache, backward=backward)
    c, s = cache[:, :D], cache[:, D:]

    def f(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        cc, ss = c.to(dt), s.to(dt)
        if not backward:
            return x.to(dt) * cc + _rot(x.to(dt)) * ss
        xl = _leaves([x], dt)[0]  # backward: x is the output gradient
        y = xl.detach().clone().requires_grad_(True)
        (y * cc + _rot(y) * ss).backward(xl.detach())
        return y.grad

    for name, x, out in (("q", q, q_out), ("k", k, k_out)):
        check(f"rope {name}", out, f(x, dtype), f(x, F64))


# ------------------------------------------------------------------------------------------- router
def _router_weights(x, w, idx, norm, dt):
    p = torch.softmax((x.to(dt) @ w.to(dt).T).to(dt), -1)
    sel = p.gather(1, idx.long())
    return sel / sel.sum(-1, keepdim=True) if norm else sel


def router_case(T: int, H: int, E: int, K: int, dtype: torch.dtype, backward: bool, norm: bool = True,
                lnc: int = 1, seed: int = 0) -> None:
    g = _g(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype)
    if lnc > 1:
        weights, idx, logits = router.router_topk_kernel[lnc](x, w, K, norm, False)
    else:
        weights, idx, logits = router.router_topk(x, w, K, norm)
    if not backward:
        check("router logits", logits, x @ w.T, x.to(F64) @ w.to(F64).T)
        # weights of the kernel's selection (a near-tie may select differently in fp64)
        check("router weights", weights, _router_weights(x, w, idx, norm, dtype),
              _router_weights(x, w, idx, norm, F64))
        return
    gw = torch.randn(T, K, generator=g)
    gx_k, gw_k = router.router_topk_bwd(x, w, logits, idx, gw, None, norm)

    def grads(dt):
        xl, wl = _leaves([x, w], dt)
        _router_weights(xl, wl, idx, norm, dt).backward(gw.to(dt))
        return xl.grad, wl.grad

    (bx, bw), (ox, ow) = grads(dtype), grads(F64)
    check("router grad_x", gx_k, bx, ox)
    check("router grad_w", gw_k, bw, ow)


# ---------------------------------------------------------------------------------------------- moe
def _experts(x, idx, tw, wgu, wd, dt):
    T, K = idx.shape
    inter = wd.shape[1]
    out = torch.zeros(T, x.shape[1], dtype=dt)
    xd = x.to(dt)
    for e in idx.unique().tolist():
        t, kk = (idx == e).nonzero(as_tuple=True)
        gu = xd[t] @ wgu[e].to(dt)
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        out = out.index_add(0, t, tw[t, kk].to(dt)[:, None] * (h @ wd[e].to(dt)))
    return out


def _routing(T: int, E: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.softmax(torch.randn(T, E, generator=g), -1)
    tw, idx = p.topk(K, -1)
    return idx.to(torch.int32), (tw / tw.sum(-1, keepdim=True))


def moe_case(T: int, H: int, inter: int, E: int, K: int, dtype: torch.dtype, backward: bool, lnc: int = 1,
             seed: int = 0) -> None:
    g = _g(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    idx, tw = _routing(T, E, K, g)
    wgu = (torch.randn(E, H, 2 * inter, generator=g) * H ** -0.5).to(dtype)
    wd = (torch.randn(E, inter, H, generator=g) * inter ** -0.5).to(dtype)
    if not backward:
        out = moe.moe_experts(x, idx, tw, wgu, wd, lnc=lnc)
        check("moe out", out, _experts(x, idx, tw, wgu, wd, dtype), _experts(x, idx, tw, wgu, wd, F64))
        return
    go = torch.randn(T, H, generator=g).to(dtype)
    kern = moe.moe_experts_bwd(x, idx, tw, wgu, wd, go, lnc=lnc)

    def grads(dt):
        leaves = _leaves([x, tw, wgu, wd], dt)
        _experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], dt).backward(go.to(dt))
        return [t.grad for t in leaves]

    for name, k_, b_, o_ in zip(("grad_x", "grad_topk_weights", "grad_w_gate_up", "grad_w_down"), kern,
                                grads(dtype), grads(F64)):
        check(f"moe {name}", k_, b_, o_)


def grouped_mm_case(M: int, Kd: int, N: int, G: int, dtype: torch.dtype, backward: bool, lnc: int = 1,
                    seed: int = 0) -> None:
    g = _g(seed)
    x = torch.randn(M, Kd, generator=g).to(dtype)
    w = (torch.randn(G, Kd, N, generator=g) * Kd ** -0.5).to(dtype)
    offs = torch.sort(torch.randint(0, M + 1, (G,), generator=g)).values.to(torch.int32)
    offs[-1] = M
    bounds = [0] + offs.tolist()

    def f(xx, ww, dt):  # torch's grouped matmul: one x[rows] @ w[g] per group
        parts = [xx[bounds[i]:bounds[i + 1]].to(dt) @ ww[i].to(dt) for i in range(G)]
        return torch.cat(parts)

    if not backward:
        check("grouped_mm out", moe.grouped_mm(x, w, offs, lnc=lnc), f(x, w, dtype), f(x, w, F64))
        return
    go = torch.randn(M, N, generator=g).to(dtype)
    gx_k, gw_k = moe.grouped_mm_bwd(x, w, offs, go, lnc=lnc)

    def grads(dt):
        xl, wl = _leaves([x, w], dt)
        f(xl, wl, dt).backward(go.to(dt))
        return xl.grad, wl.grad

    (bx, bw), (ox, ow) = grads(dtype), grads(F64)
    check("grouped_mm grad_x", gx_k, bx, ox)
    check("grouped_mm grad_w", gw_k, bw, ow)


# ---------------------------------------------------------------------------------------- fast tier
SMALL = {
    "rope": lambda dt, bwd: rope_case(1, 3, 2, 130, 32, dt, bwd),
    "router": lambda dt, bwd: router_case(200, 256, 16, 4, dt, bwd),
    "moe": lambda dt, bwd: moe_case(40, 128, 64, 4, 2, dt, bwd),
    "grouped_mm": lambda dt, bwd: grouped_mm_case(70, 160, 96, 3, dt, bwd),
}
PRODUCTION = {
    "rope": lambda dt, bwd: rope_case(1, 32, 8, 4096, 128, dt, bwd),
    "router": lambda dt, bwd: router_case(8192, 2048, 128, 8, dt, bwd),
    # Qwen3-30B-A3B MoE layer: T=2048, H=2048, I=768, E=128, K=8; in fp32 one expert's weights exceed the
    # kernel's SBUF constraint (147 KiB > 96 KiB per partition), so fp32 runs its TP=2 shard, I=384
    "moe": lambda dt, bwd: moe_case(2048, 2048, 768 if dt == torch.bfloat16 else 384, 128, 8, dt, bwd),
}
DIRECTIONS = pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
DTYPE_IDS = pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])


@DIRECTIONS
@DTYPE_IDS
@pytest.mark.parametrize("kernel", SMALL)
def test_small_shapes(kernel, dtype, backward) -> None:
    SMALL[kernel](dtype, backward)


def test_rule_fails_a_less_accurate_result() -> None:
    """The rule rejects a result 2x as far from the oracle as torch's."""
    o = torch.randn(1000, dtype=F64)
    base = o + 1e-3 * torch.randn(1000, dtype=F64)  # (fp64: the eps/4 floor is ~5e-17)
    check("same as torch", base, base, o)
    with pytest.raises(AssertionError, match="kernel error"):
        check("worse", o + 2 * (base - o), base, o)


# ---------------------------------------------------------------------------------------- slow tier
@pytest.mark.slow
@DIRECTIONS
@DTYPE_IDS
@pytest.mark.parametrize("kernel", PRODUCTION)
def test_production_shapes(kernel, dtype, backward) -> None:
    PRODUCTION[kernel](dtype, backward)


@pytest.mark.slow
@SLOW
@given(S=st.integers(1, 700), D=st.sampled_from([8, 64, 128]), Hq=st.integers(1, 4), Hk=st.integers(1, 3),
       dtype=st.sampled_from(DTYPES), backward=st.booleans(), lnc=st.sampled_from([1, 2]))
def test_rope_property(S, D, Hq, Hk, dtype, backward, lnc) -> None:
    """S up to 700: full 128-row chunks, a partial chunk and a tail of < 128 rows; LNC=2 splits chunks."""
    rope_case(1, Hq, Hk, S, D, dtype, backward, lnc=lnc)


@pytest.mark.slow
@SLOW
@given(T=st.integers(1, 1100), H=st.sampled_from([64, 128, 200, 384]), E=st.integers(1, 160),
       data=st.data(), dtype=st.sampled_from(DTYPES), backward=st.booleans(), norm=st.booleans(),
       lnc=st.sampled_from([1, 2]))
def test_router_property(T, H, E, data, dtype, backward, norm, lnc) -> None:
    """T past 2 x 512-token chunks with tails not a multiple of 16 (Tensor-engine path), H a multiple of
    128 (bf16: DMA transposes) or not, E > 128 (two expert blocks), LNC=2 for the forward."""
    K = data.draw(st.integers(1, min(8, E)))
    router_case(T, H, E, K, dtype, backward, norm=norm, lnc=1 if backward else lnc)


@pytest.mark.slow
@SLOW
@given(T=st.integers(1, 300), H=st.sampled_from([128, 256, 320]), inter=st.sampled_from([64, 128, 192, 640]),
       E=st.integers(1, 6), data=st.data(), dtype=st.sampled_from(DTYPES), backward=st.booleans(),
       lnc=st.sampled_from([1, 2]))
def test_moe_property(T, H, inter, E, data, dtype, backward, lnc) -> None:
    """Blocks of one expert past 128 slots (several blocks + narrower tail blocks), I past 4 chunks (two
    swiglu passes), H not a multiple of 128, LNC=2 (experts split between the cores)."""
    K = data.draw(st.integers(1, min(8, E)))
    moe_case(T, H, inter, E, K, dtype, backward, lnc=lnc)


@pytest.mark.slow
@SLOW
@given(M=st.integers(1, 400), Kd=st.sampled_from([64, 128, 200, 640]), N=st.sampled_from([32, 512, 600]),
       G=st.integers(1, 5), dtype=st.sampled_from(DTYPES), backward=st.booleans(), lnc=st.sampled_from([1, 2]))
def test_grouped_mm_property(M, Kd, N, G, dtype, backward, lnc) -> None:
    grouped_mm_case(M, Kd, N, G, dtype, backward, lnc=lnc)
