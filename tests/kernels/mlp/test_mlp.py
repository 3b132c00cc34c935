"""Dense SwiGLU MLP kernels: fp64-oracle parity of the output and of all three gradients (fp32 and bf16;
odd T, H and I, partial tiles, a leading batch shape), agreement with the torch reference and its rounding
points, LNC=2 bit-identical to one program, the SBUF plan, constraints. Slow tier: Qwen3-4B's H and I.

The oracle is ``F.silu(x @ Wg) * (x @ Wu) @ Wd`` with autograd, run at the test dtype (torch's own
result) and in float64 (tests/tolerances.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.oracles import leaves
from tests.tolerances import F64, OracleErr, check_oracle
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.kernels.mlp import from_linear, mlp, mlp_bwd, mlp_bwd_ref, mlp_constraints, mlp_ref, to_linear
from trnkit.kernels.mlp.tiling import plan

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(shape: tuple[int, ...], I: int, dtype: torch.dtype, seed: int = 0):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    H = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    w_gate_up = (torch.randn(H, 2 * I, generator=g) / H ** 0.5).to(dtype)
    w_down = (torch.randn(I, H, generator=g) / I ** 0.5).to(dtype)
    grad_y = torch.randn(shape, generator=g).to(dtype)
    return x, w_gate_up, w_down, grad_y


def _torch_mlp(x, w_gate_up, w_down, grad_y, dt):
    """The SwiGLU MLP in plain torch at dtype ``dt`` (fp64: the oracle) and its autograd gradients."""
    xl, gul, dl = leaves([x, w_gate_up, w_down], dt)
    gate, up = (xl @ gul).chunk(2, dim=-1)
    y = (F.silu(gate) * up) @ dl
    grads = torch.autograd.grad(y, (xl, gul, dl), grad_y.to(dt))
    return y.detach(), grads


def mlp_case(shape: tuple[int, ...], I: int, dtype: torch.dtype, lnc: int = 1, seed: int = 0) -> None:  # noqa: E741
    x, wgu, wd, gy = _inputs(shape, I, dtype, seed)
    y = mlp(x, wgu, wd, lnc=lnc)
    base_y, base_g = _torch_mlp(x, wgu, wd, gy, dtype)
    orc_y, orc_g = _torch_mlp(x, wgu, wd, gy, F64)
    assert y.dtype == dtype and y.shape == x.shape
    check_oracle("mlp y", y, base_y, orc_y)
    grads = mlp_bwd(x, wgu, wd, gy, lnc=lnc)
    for name, g, b, o, like in zip(("grad_x", "grad_w_gate_up", "grad_w_down"), grads, base_g, orc_g, (x, wgu, wd),
                                   strict=True):
        assert g.dtype == dtype and g.shape == like.shape, name
        check_oracle(f"mlp {name}", g, b, o)


# (x shape, I): one token; odd H and I; partial token, H and I tiles; several token tiles / I-blocks
FAST = [((1, 8), 5), ((5, 16), 24), ((130, 200), 300), ((2, 33, 96), 515), ((300, 130), 130)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, inter", FAST)
def test_oracle_fast(shape, inter, dtype):
    mlp_case(shape, inter, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_oracle_lnc2(dtype):
    mlp_case((260, 72), 200, dtype, lnc=2, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_reference_and_its_rounding(dtype):
    x, wgu, wd, gy = _inputs((140, 80), 150, dtype, seed=3)
    y, ry = mlp(x, wgu, wd), mlp_ref(x, wgu, wd)
    # the same rounding points; fp32 sums in another order (bf16: one ulp at a rounding tie)
    tol = 2e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(y.float(), ry.float(), rtol=tol, atol=tol * float(ry.abs().max()))
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for g, r in zip(mlp_bwd(x, wgu, wd, gy), mlp_bwd_ref(x, wgu, wd, gy), strict=True):
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol * float(r.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [700, 129, 1])
def test_lnc2_bit_identical_to_one_program(T, dtype):
    x, wgu, wd, gy = _inputs((T, 48), 100, dtype, seed=5)
    assert torch.equal(mlp(x, wgu, wd, lnc=1), mlp(x, wgu, wd, lnc=2))
    one, two = mlp_bwd(x, wgu, wd, gy, lnc=1), mlp_bwd(x, wgu, wd, gy, lnc=2)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_linear_layout_round_trip():
    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g)
    x = torch.randn(3, 4, generator=g)
    wgu, wd = from_linear(gate, up, down)
    expect = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    torch.testing.assert_close(mlp_ref(x, wgu, wd), expect, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(to_linear(wgu, wd), (gate, up, down), strict=True))


def test_plan():
    # (forward token tile, I-block, backward token tile, I-block), the widest that fit SBUF, the token
    # tile first: Qwen3-0.6B, Qwen3-4B, Qwen3-8B (bf16), 4B in fp32
    assert plan(1024, 3072, 2) == (512, 512, 256, 512)
    assert plan(2560, 9728, 2) == (512, 256, 256, 256)
    assert plan(4096, 12288, 2) == (256, 512, 128, 256)
    assert plan(2560, 9728, 4) == (256, 128, 128, 128)
    assert plan(2560, 9728, 2, tokens=256) == (256, 512, 256, 256)  # a core with 256 tokens: wider I-blocks
    assert plan(5120, 25600, 2) is None  # Qwen3-32B: a tile's dgu.T alone takes 100 KiB


def test_constraints():
    x, wgu, wd, gy = _inputs((4, 8), 6, torch.float32)
    with pytest.raises(KernelConstraintError, match=r"mlp: constraint 'w_down is \[I, H\]' violated \(got \(8, 8\)\)"):
        mlp(x, wgu, torch.zeros(8, 8))
    bad = mlp_constraints(x, wgu.bfloat16(), wd, gy.bfloat16())
    assert [v.constraint for v in bad] == ["w_gate_up.dtype == x.dtype", "grad_y has x's shape and dtype"]
    assert bad[0].kernel == "mlp_bwd"
    rules = [v.constraint for v in mlp_constraints(torch.empty(4, 5120, dtype=torch.bfloat16),
                                                   torch.empty(5120, 51200, dtype=torch.bfloat16),
                                                   torch.empty(25600, 5120, dtype=torch.bfloat16))]
    assert rules == ["a token tile's working set fits SBUF (128 tokens, 128-column I-blocks)"]
    assert [v.constraint for v in mlp_constraints(torch.empty(4, 8, dtype=torch.float16), torch.empty(8, 7),
                                                  torch.empty(3, 8))] == ["w_gate_up is [H, 2I] with x's H, I >= 1"]
    assert [v.constraint for v in mlp_constraints(torch.empty(4, 8, dtype=torch.float16), torch.empty(8, 6,
            dtype=torch.float16), torch.empty(3, 8, dtype=torch.float16))] == ["x.dtype in ('float32', 'bfloat16')"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_oracle_qwen3_4b(dtype):
    """Qwen3-4B's H = 2560, I = 9728 at 130 tokens (a partial second 128-row sub-tile), LNC=2; the weight
    gradients compared in parts (OracleErr)."""
    T, H, I = 130, 2560, 9728  # noqa: E741
    x, wgu, wd, gy = _inputs((T, H), I, dtype, seed=7)
    y = mlp(x, wgu, wd, lnc=2)
    base_y, base_g = _torch_mlp(x, wgu, wd, gy, dtype)
    orc_y, orc_g = _torch_mlp(x, wgu, wd, gy, F64)
    check_oracle("mlp y", y, base_y, orc_y)
    for name, g, b, o in zip(("grad_x", "grad_w_gate_up", "grad_w_down"), mlp_bwd(x, wgu, wd, gy, lnc=2), base_g,
                             orc_g, strict=True):
        err = OracleErr(f"mlp {name}", dtype)
        for part in range(0, g.shape[0], 512):
            err.add(g[part:part + 512], b[part:part + 512], o[part:part + 512])
        err.check()


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 300), H=st.integers(1, 520), I=st.integers(1, 600), dtype=st.sampled_from(DTYPES),
       lnc=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_oracle_random_shapes(T, H, I, dtype, lnc, seed):  # noqa: E741
    mlp_case((T, H), I, dtype, lnc, seed)
