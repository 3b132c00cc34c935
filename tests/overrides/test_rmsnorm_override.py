"""trnkit::rmsnorm: the op (forward, autograd, fake, opcheck, torch.compile) and its swap into trnkit's
native Qwen3 and transformers' Qwen3 / Qwen3-MoE norms, against transformers' own RMSNorm math."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.overrides.conftest import assert_swap_parity, hf_dense_model, hf_moe_model, native_model
from tests.tolerances import assert_close, check_oracle
from trnkit.overrides import (
    DEFAULT_OPS,
    OverrideConfig,
    OverrideConstraintError,
    apply_overrides,
    bind_kernels,
    ops,
    select,
)



def _hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward (5.x), written out: the independent reference."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 32), (1, 1, 8), (7, 130), (2, 3, 4, 16)])
def test_op_forward_and_gradients_match_transformers_math(impl, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype)
    y, rstd = ops.rmsnorm(x, w, 1e-6, impl)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = _hf_rmsnorm(x2, w2, 1e-6)
    assert y.dtype == want.dtype and y.shape == want.shape and rstd.shape == (x.numel() // shape[-1],)
    if impl == "nki" and dtype == torch.bfloat16:
        # The kernel's bf16 forward on narrow rows rounds rstd to bf16 before n = x * rstd (docs/kernels.md,
        # RMSNorm numerics), an extra rounding HF's math does not make: held to the kernels' fp64-oracle rule
        # (error <= 1.5 x that of HF's bf16 math), and every element within 2 x bf16's eps (relative) of HF's.
        xd, wd = x.detach().double(), w.detach().double()
        oracle = wd * xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
        check_oracle("rmsnorm y", y.detach(), want.detach(), oracle)
        close = 2 * torch.finfo(dtype).eps * want.detach().float().abs().clamp_min(1e-3)
        assert torch.all((y.detach().float() - want.detach().float()).abs() <= close)
    else:
        assert_close(y, want, dtype)
    rows = x.detach().float().reshape(-1, shape[-1])
    assert_close(rstd, torch.rsqrt(rows.square().mean(-1) + 1e-6), torch.float32)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    wx, ww = torch.autograd.grad(want, (x2, w2), dy)
    assert_close(gx, wx, dtype)
    # the weight gradient sums over every row: compare at the scale of that sum
    torch.testing.assert_close(gw.float(), ww.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=(1e-2 if dtype == torch.bfloat16 else 1e-5) * rows.shape[0])


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_opcheck(impl):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 4, 16, generator=g, requires_grad=True), torch.randn(16, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.trnkit.rmsnorm, (x, w, 1e-5, impl))
    rstd = torch.rand(12, generator=g) + 0.5
    torch.library.opcheck(torch.ops.trnkit.rmsnorm_bwd,
                          (x.detach(), w.detach(), rstd, torch.randn(3, 4, 16), 1e-5, impl))


def test_compiles_fullgraph():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 8, 32, generator=g, requires_grad=True), torch.randn(32, generator=g, requires_grad=True)
    fn = lambda a, b: ops.rmsnorm(a, b, 1e-6, "nki")[0]  # noqa: E731
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, w)
    got.square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = fn(x, w)
    want.square().sum().backward()
    assert torch.equal(got, want) and torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


def test_native_model_every_norm_swapped_matches_and_switches_back():
    model = native_model(init_std=0.2)
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = apply_overrides(model, OverrideConfig(ops=["rmsnorm"], impl="nki", seq_len=8))
    paths = [f"layers.{i}.{n}" for i in (0, 1) for n in ("attention_norm", "attention.q_norm", "attention.k_norm",
                                                         "ffn_norm")] + ["norm"]
    assert {(r.module, r.op, r.status) for r in report.rows} == {(p, "rmsnorm", "swapped") for p in paths}
    assert list(model.state_dict()) == keys
    assert_swap_parity(model, original)
    assert bind_kernels(model, {"rmsnorm": None}) == len(paths)
    assert type(model.norm) is type(original.norm)


def test_default_ops_leave_the_norms_alone():
    assert "rmsnorm" not in DEFAULT_OPS
    report = apply_overrides(native_model(), OverrideConfig(impl="reference", seq_len=8))
    assert report.rows and all(r.op != "rmsnorm" for r in report.rows)


def test_transformers_qwen3_moe_norms_swapped_match():
    model = hf_moe_model()
    original = copy.deepcopy(model)
    report = apply_overrides(model, OverrideConfig(ops=["rmsnorm"], impl="nki", seq_len=8))
    swapped = {r.module for r in report.rows if r.status == "swapped"}
    # per layer: input / post-attention norms and the q / k head norms; plus the final norm
    assert len(swapped) == 2 * 4 + 1 and "model.norm" in swapped, report.table()
    assert {r.op for r in report.rows} == {"rmsnorm"}
    assert_swap_parity(model, original)


def test_transformers_dense_qwen3_norms_swapped_match():
    model = hf_dense_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from 1
    original = copy.deepcopy(model)
    report = apply_overrides(model, OverrideConfig(ops=["rmsnorm"], impl="nki", seq_len=8))
    assert sum(r.status == "swapped" for r in report.rows) == 9, report.table()
    assert_swap_parity(model, original)


def test_rows_too_wide_for_the_kernel_name_op_rule_and_value():
    """The backward keeps whole rows in SBUF (H <= 4096 fp32): its limit applies once x or the weight
    requires grad; a forward alone splits wide rows into equal pieces (H a multiple of their count)."""
    x, w = torch.empty(2, 4097), torch.empty(4097, requires_grad=True)
    with pytest.raises(OverrideConstraintError, match=r"rmsnorm_bwd: constraint 'H <= 4096 for float32'.*4097"):
        select("rmsnorm", "nki", policy="strict", x=x, weight=w, eps=1e-6)
    sel = select("rmsnorm", "nki", policy="fallback", x=x, weight=w, eps=1e-6)
    assert sel.impl == "reference" and any("H <= 4096" in str(r) for r in sel.reasons)
    assert select("rmsnorm", "nki", x=x.bfloat16(), weight=w.detach().bfloat16(), eps=1e-6).impl == "nki"
    with pytest.raises(OverrideConstraintError, match=r"rmsnorm: constraint 'H is a multiple of 2 .*4097"):
        select("rmsnorm", "nki", policy="strict", x=x, weight=w.detach(), eps=1e-6)
    wide = torch.empty(2, 8192)
    assert select("rmsnorm", "nki", x=wide, weight=torch.empty(8192), eps=1e-6).impl == "nki"
    assert select("rmsnorm", "nki", policy="fallback", x=wide, weight=torch.empty(8192, requires_grad=True),
                  eps=1e-6).impl == "reference"
