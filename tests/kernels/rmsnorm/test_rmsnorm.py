"""RMSNorm kernels: fp64-oracle parity (forward, residual form, backward with the weight gradient; fp32
and bf16; wide rows, narrow rows as Qwen3's q/k head norm, odd shapes), agreement with the torch
reference, LNC=2, constraints. Slow tier: Qwen3-4B and Qwen3-30B-A3B shapes.

The oracle is transformers' Qwen3RMSNorm arithmetic (normalise in fp32, cast, times the weight) written
in plain torch and run at the test dtype (torch's own result) and in float64 (tests/tolerances.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch

from tests.kernels.oracles import leaves
from tests.tolerances import F64, OracleErr, assert_close, check_oracle
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.kernels.rmsnorm import (rmsnorm, rmsnorm_bwd, rmsnorm_bwd_ref, rmsnorm_constraints, rmsnorm_ref,
                                    rmsnorm_residual, rmsnorm_residual_ref)
from trnkit.nkisim import trace

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def hf_rmsnorm(x: torch.Tensor, w: torch.Tensor, dt: torch.dtype, residual: torch.Tensor | None = None):
    """transformers' Qwen3RMSNorm at dtype ``dt`` (its internal fp32 is float64 for the oracle)."""
    x = x.to(dt)
    if residual is not None:
        x = x + residual.to(dt)
    inner = torch.promote_types(dt, torch.float32)
    h = x.to(inner)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w.to(dt) * h.to(dt), x


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    H = shape[-1]
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype)
    res = torch.randn(shape, generator=g).to(dtype)
    gy = torch.randn(shape, generator=g).to(dtype)
    gs = torch.randn(shape, generator=g).to(dtype)
    return x, w, res, gy, gs


def norm_case(shape: tuple[int, ...], dtype: torch.dtype, residual: bool, lnc: int = 1, seed: int = 0) -> None:
    """Forward and backward of the kernels against the fp64 oracle; in the residual form the backward
    also gets the residual stream's gradient (grad_s) and its result is the gradient of x and residual."""
    x, w, res, gy, gs = _inputs(shape, dtype, seed)
    if residual:
        y, s, rstd = rmsnorm_residual(x, res, w, EPS, lnc=lnc)
        check_oracle("rmsnorm s", s, x + res, x.to(F64) + res.to(F64))
    else:
        (y, rstd), s = rmsnorm(x, w, EPS, lnc=lnc), x
    base, _ = hf_rmsnorm(x, w, dtype, res if residual else None)
    orc, s64 = hf_rmsnorm(x, w, F64, res if residual else None)
    check_oracle("rmsnorm y", y, base, orc)
    check_oracle("rmsnorm rstd", rstd, torch.rsqrt(s.float().pow(2).mean(-1) + EPS).reshape(-1),
                 torch.rsqrt(s64.pow(2).mean(-1) + EPS).reshape(-1))
    g_s = gs if residual else None
    gx, gw = rmsnorm_bwd(gy, s, w, rstd, g_s, lnc=lnc)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype and gw.shape == w.shape
    grads = {}
    for dt in (dtype, F64):
        sl, wl = leaves([s, w], dt)
        out, _ = hf_rmsnorm(sl, wl, dt)
        outs, gos = [out], [gy.to(dt)]
        if residual:  # s also flows on down the residual stream
            outs.append(sl)
            gos.append(gs.to(dt))
        grads[dt] = torch.autograd.grad(outs, (sl, wl), gos)
    check_oracle("rmsnorm grad_x", gx, grads[dtype][0], grads[F64][0])
    check_oracle("rmsnorm grad_w", gw, grads[dtype][1], grads[F64][1])


# (3, 4096): few rows spread over the partitions (8 per row)
FAST = [(1, 2), (3, 7), (130, 96), (257, 640), (2, 3, 128), (2, 5, 4, 128), (129, 1030), (3, 4096)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", FAST, ids=[str(s) for s in FAST])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_oracle_parity(shape, dtype, residual) -> None:
    norm_case(shape, dtype, residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(300, 1024), (1030, 128), (1, 640), (21, 4096)],
                         ids=["wide", "narrow", "one-row", "spread"])
def test_lnc2_matches_lnc1(shape, dtype) -> None:
    """LNC=2 splits the rows: y, s, rstd and grad_x bit-identical to LNC=1; grad_w sums two partials (the
    same fp32 terms in another order); the oracle rule holds on both."""
    x, w, res, gy, gs = _inputs(shape, dtype, seed=1)
    one, two = rmsnorm_residual(x, res, w, EPS, lnc=1), rmsnorm_residual(x, res, w, EPS, lnc=2)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    b1, b2 = rmsnorm_bwd(gy, one[1], w, one[2], gs, lnc=1), rmsnorm_bwd(gy, one[1], w, one[2], gs, lnc=2)
    assert torch.equal(b1[0], b2[0])
    assert_close(b2[1], b1[1], dtype)
    norm_case(shape, dtype, True, lnc=2, seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_reference_has_the_kernels_rounding_points(dtype) -> None:
    """The torch reference rounds where the wide-row kernels do: equal up to fp32 summation order (a rounding-
    boundary case may differ by one ulp of the output dtype)."""
    x, w, res, gy, gs = _inputs((257, 640), dtype, seed=2)
    y, s, rstd = rmsnorm_residual(x, res, w, EPS)
    yr, sr, rr = rmsnorm_residual_ref(x, res, w, EPS)
    assert torch.equal(s, sr)
    torch.testing.assert_close(rstd, rr, rtol=2e-7, atol=0)
    assert_close(y, yr, dtype)
    gx, gw = rmsnorm_bwd(gy, s, w, rstd, gs)
    gxr, gwr = rmsnorm_bwd_ref(gy, s, w, rr, gs)
    assert_close(gx, gxr, dtype)
    assert_close(gw, gwr, dtype)


@pytest.mark.parametrize("H", [640, 128], ids=["wide", "head-norm"])
def test_fp32_weight_with_bf16_activations(H) -> None:
    """A fp32 weight (fp32 master params) with bf16 activations: y is fp32 (HF: fp32 weight * bf16 h),
    grad_w fp32, grad_x bf16. Wide rows round where the torch reference does (equal within the output's
    tolerance); the head norm's forward rounds rstd to bf16 and its backward sums ``w * (dy * x)``
    (docs/kernels.md, numerics), so there both gradients are held to the oracle rule against HF's math."""
    x, _, _, gy, _ = _inputs((130, H), torch.bfloat16, seed=3)
    w = 1 + 0.2 * torch.randn(H, generator=torch.Generator().manual_seed(4))
    y, rstd = rmsnorm(x, w, EPS)
    assert y.dtype == torch.float32
    gx, gw = rmsnorm_bwd(gy.float(), x, w, rstd)
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    if H >= 512:
        yr, _ = rmsnorm_ref(x, w, EPS)
        torch.testing.assert_close(y, yr, rtol=2e-6, atol=1e-6)
        gxr, gwr = rmsnorm_bwd_ref(gy.float(), x, w, rstd)
        assert_close(gx, gxr, torch.bfloat16)
        assert_close(gw, gwr, torch.float32)
        return
    grads = {}
    for dt, wdt in ((torch.bfloat16, torch.float32), (F64, F64)):
        xl, wl = x.to(dt).clone().requires_grad_(), w.to(wdt).clone().requires_grad_()
        h = xl.to(torch.promote_types(dt, torch.float32))
        out = wl * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dt)  # HF: fp32 weight * bf16 n
        grads[dt] = torch.autograd.grad(out, (xl, wl), gy.to(out.dtype))
    check_oracle("rmsnorm grad_x", gx, grads[torch.bfloat16][0], grads[F64][0])
    check_oracle("rmsnorm grad_w", gw, grads[torch.bfloat16][1], grads[F64][1])


def test_constraints_name_the_rule_and_value() -> None:
    x = torch.randn(4, 64)
    cases = [
        (dict(x=x, weight=torch.ones(32)), "weight is [H]"),
        (dict(x=x.half(), weight=torch.ones(64).half()), "x.dtype in"),
        (dict(x=x.bfloat16(), weight=torch.ones(64).half()), "weight.dtype == x.dtype or float32"),
        (dict(x=x, weight=torch.ones(64), eps=-1.0), "eps is a finite float >= 0"),
        (dict(x=x, weight=torch.ones(64), residual=torch.randn(4, 32)), "residual has x's shape"),
        (dict(x=torch.randn(2, 9001).bfloat16(), weight=torch.ones(9001).bfloat16()), "H is a multiple of 2"),
        (dict(x=torch.randn(2, 65537), weight=torch.ones(65537)), "H <= 65536"),
        (dict(x=torch.randn(2, 9000).bfloat16(), weight=torch.ones(9000).bfloat16(), backward=True), "H <= 8192"),
        # a fp32 weight makes grad_y fp32: the backward's rows are fp32-wide
        (dict(x=torch.randn(2, 8192).bfloat16(), weight=torch.ones(8192), backward=True), "H <= 4096 for float32"),
        # one element per row: the forward runs, the backward's two terms cancel past its precision
        (dict(x=torch.randn(127, 1), weight=torch.ones(1), backward=True), "H >= 2"),
    ]
    for kw, rule in cases:
        v = rmsnorm_constraints(**kw)
        assert v and rule in v[0].constraint, (kw.keys(), v)
    with pytest.raises(KernelConstraintError, match="rmsnorm: constraint 'weight is"):
        rmsnorm(x, torch.ones(32))
    with pytest.raises(KernelConstraintError, match=r"rmsnorm_bwd: constraint 'rstd is \[rows\] float32"):
        rmsnorm_bwd(x, x, torch.ones(64), torch.ones(3))
    with pytest.raises(KernelConstraintError, match="rmsnorm_bwd: constraint 'grad_y has x's shape and the output"):
        rmsnorm_bwd(x.bfloat16(), x, torch.ones(64), torch.ones(4))
    one = torch.randn(127, 1).bfloat16()
    assert not rmsnorm_constraints(one, torch.ones(1).bfloat16())
    with pytest.raises(KernelConstraintError, match=r"rmsnorm_bwd: constraint 'H >= 2' violated \(got 1\)"):
        rmsnorm_bwd(one, one, torch.ones(1).bfloat16(), torch.ones(127))
    wide = torch.randn(2, 9000).bfloat16()  # the forward splits it, the backward keeps whole rows
    assert not rmsnorm_constraints(wide, torch.ones(9000).bfloat16())
    v = rmsnorm_constraints(wide, torch.ones(9000).bfloat16(), backward=True)
    assert [(b.kernel, b.constraint, b.value) for b in v] == [("rmsnorm_bwd", "H <= 8192 for bfloat16", 9000)]
    with pytest.raises(KernelConstraintError,
                       match=r"rmsnorm_bwd: constraint 'H <= 8192 for bfloat16' violated \(got 9000"):
        rmsnorm_bwd(wide, wide, torch.ones(9000).bfloat16(), torch.ones(2))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_head_norm_chunk_ramp(dtype) -> None:
    """The head norm (H = 128) over enough rows for several chunks per core plus a short tail (4,133 x 2
    rows: 64 row slots of 128 and 74 rows at LNC=1, 32 slots and 37 rows per core at LNC=2): forward and
    backward within the oracle rule; per chunk one Vector rsqrt of its sums straight into the operand the
    normalisation reads (bf16 rows: rounded once to bf16, so n runs in Vector's 2-byte mode; fp32 rows: in
    PSUM), no GpSimd work; loads triggered from Scalar's DMA queue but the first five chunks' (except the
    second's) from Sync's, which is idle at the start (Scalar's sequencer would wait for its queue before
    its first squares), every store from Sync's, except the last runs' rstd, which Scalar forms and stores
    itself; LNC=2 bit-identical to LNC=1."""
    from trnkit.kernels.rmsnorm.rmsnorm_kernels import _narrow_sizes

    assert _narrow_sizes(128, 16) == [4, 8, 16, 16, 16, 16, 16, 16, 12, 8]
    assert _narrow_sizes(64, 16) == [4, 8, 16, 16, 12, 8] and sum(_narrow_sizes(257, 16)) == 257
    assert _narrow_sizes(64, 8) == [2, 4, 8, 8, 8, 8, 8, 8, 6, 4] and _narrow_sizes(3, 16) == [3]
    x, w, _, _, _ = _inputs((4133, 2, 128), dtype, seed=6)
    with trace.record() as tr:
        y1, r1 = rmsnorm(x, w, EPS, lnc=1)
    chunks = len(_narrow_sizes(64, 16 if dtype == torch.bfloat16 else 8)) + 1  # + the 74-row tail
    operand = ("bfloat16", "sbuf") if dtype == torch.bfloat16 else ("float32", "psum")
    rsqrts = [i for i in tr if i.op == "tensor_scalar" and i.attrs.get("op") == "rsqrt"
              and (i.operands[0].dtype, i.operands[0].buffer) == operand]
    assert len(rsqrts) == chunks
    assert tr.by_engine().get("gpsimd", 0) == 0
    dmas = [i for i in tr if i.engine == "dma"]
    loads = [i for i in dmas if i.operands[0].buffer == "sbuf"]
    stores = [i for i in dmas if i.operands[0].buffer != "sbuf"]
    assert len(loads) == chunks + 1  # one per chunk and the weight
    # the weight and chunks 0, 2, 3, 4 (in program order: chunks 0-3, the weight, chunk 4)
    assert [i.attrs["engine"] for i in loads][:6] == ["sync", "scalar", "sync", "sync", "sync", "sync"]
    assert [i.attrs["engine"] for i in loads].count("sync") == 5
    queues = [i.attrs["engine"] for i in stores]  # the last three chunks' runs: Scalar's rstd
    assert queues.count("scalar") == 3 and queues.count("sync") == len(stores) - 3
    y2, r2 = rmsnorm(x, w, EPS, lnc=2)
    assert torch.equal(y1, y2) and torch.equal(r1, r2)
    norm_case((4133, 2, 128), dtype, residual=False, seed=6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(257, 3, 128), (130, 96)], ids=["head-norm", "H=96"])
def test_narrow_backward_cancelling_gradient(shape, dtype) -> None:
    """grad_y nearly parallel to y (0.5 y + 1e-3 noise): dx = rstd * (gw + b * x) is a small difference of
    two large terms, so a rounded b shows. The narrow backward takes b as bf16 hi + lo parts (fp32 for
    fp32 rows): grad_x within 1.15 x torch's own error (1.02 x measured for bf16; b rounded to bf16 alone
    gives 1.30 and 1.48 x at these two shapes, against the oracle rule's 1.5 x)."""
    x, w, _, _, _ = _inputs(shape, dtype, seed=7)
    y, rstd = rmsnorm(x, w, EPS)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(8), dtype=F64)
    gy = (hf_rmsnorm(x, w, F64)[0] * 0.5 + 1e-3 * noise).to(y.dtype)
    gx, gw = rmsnorm_bwd(gy, x, w, rstd)
    grads = {}
    for dt in (dtype, F64):
        xl, wl = leaves([x, w], dt)
        out, _ = hf_rmsnorm(xl, wl, dt)
        grads[dt] = torch.autograd.grad(out, (xl, wl), gy.to(dt))
    check_oracle("rmsnorm grad_x", gx, grads[dtype][0], grads[F64][0])
    check_oracle("rmsnorm grad_w", gw, grads[dtype][1], grads[F64][1])
    err = OracleErr("rmsnorm grad_x", gx.dtype)
    err.add(gx, grads[dtype][0], grads[F64][0])
    ek, et = err.errors()
    assert ek <= 1.15 * et, (ek, et)


def test_narrow_backward_engines() -> None:
    """The head-norm backward (bf16, H = 128) on whole chunks: per chunk two GpSimd diagonals (b's hi and
    lo parts) and nothing else on GpSimd; on the Tensor engine per 128-row slot one dw matmul, two transposes
    (dy * x, and dy for gw), one sum over H and three dx matmuls (gw^T against the identity, diag(b_hi) @ x,
    diag(b_lo) @ x); Scalar copies each PSUM bank of transposed slots out (those of dy scaled by w's fp32
    column: gw^T) and the dw column sums (issued right after the last dw matmuls; fp32, exact); Vector runs
    one 2-byte pass per chunk (dy * x: gw is off the SBUF port GpSimd shares with Vector's 2-byte mode), five
    [P, NT] per-row instructions (each with an fp32 operand, so off that port) and one pass per PSUM bank of
    dx (trace)."""
    x, w, _, gy, _ = _inputs((4096, 128), torch.bfloat16, seed=9)
    _, rstd = rmsnorm(x, w, EPS)
    with trace.record() as tr:
        rmsnorm_bwd(gy, x, w, rstd, lnc=1)
    slots = 4096 // 128
    diags = [i for i in tr if i.op == "affine_select" and len(i.operands[0].shape) == 3]
    chunks = len(diags) // 2
    assert chunks >= 3 and len(diags) == 2 * chunks
    assert sum(i.operands[0].shape[1] for i in diags) == 2 * slots
    by = tr.by_op()
    assert by["nc_transpose"] == 2 * slots
    assert by["nc_matmul"] == 5 * slots  # dw, the sum over H, gw^T @ I, diag(b_hi) @ x, diag(b_lo) @ x
    nts = [i.operands[0].shape[1] for i in diags[::2]]  # each chunk's slots
    scalar = [i for i in tr if i.engine == "scalar"]
    assert len(scalar) == 2 * sum((nt + 7) // 8 for nt in nts) + 1  # 8 bf16 slots a bank, + the dw sums
    scaled = [i for i in scalar if i.op == "activation" and any(o.role == "scale" for o in i.operands)]
    assert len(scaled) == sum((nt + 7) // 8 for nt in nts)  # gw^T = (dy^T) * w, per bank
    assert all(o.dtype == "float32" for i in scaled for o in i.operands if o.role == "scale")
    dw_copy = scalar[-1]
    assert dw_copy.op == "tensor_copy" and [o.buffer for o in dw_copy.operands] == ["sbuf", "psum"]
    assert dw_copy.operands[0].dtype == "float32"
    # issued before the last chunk's dx (its last Tensor engine matmuls come after it)
    assert tr.instrs.index(dw_copy) < max(k for k, i in enumerate(tr.instrs) if i.op == "nc_matmul")
    vector = [i for i in tr if i.engine == "vector"]
    two_byte = [i for i in vector if all(o.dtype == "bfloat16" for o in i.operands) and len(i.operands[0].shape) == 3]
    assert len(two_byte) == chunks  # dy * x only
    stats = [i for i in vector if len(i.operands[0].shape) == 2 and i.operands[0].shape[1] in nts]
    assert len(stats) == 5 * chunks  # rstd rounded for the dw matmuls, rstd^2, b, hi, lo: [P, NT] each
    assert all(any(o.dtype == "float32" for o in i.operands) for i in stats)
    assert len(vector) <= 6 * chunks + sum((nt + 3) // 4 for nt in nts) + 4
    gpsimd = [i for i in tr if i.engine == "gpsimd"]
    assert all(i.op == "affine_select" for i in gpsimd) and len(gpsimd) == len(diags) + 1  # + the identity


def test_narrow_backward_non_finite() -> None:
    """Where a NaN reaches in the head-norm backward (bf16, H = 128, 2,048 rows: one chunk's partition p holds
    rows r0 + p*NT + j): a NaN in dy at (300, 7) stays in row 300 of dx, as in the reference (gw^T's slot
    against the identity sums each row's own values); a NaN in x at (300, 7) makes column 7 of every row of its
    128-row slot NaN (diag(b) @ x: 0 x NaN), the documented spread (docs/kernels.md, RMSNorm "NaN"); dw's
    column 7 is NaN in both, as in the reference."""
    x, w, _, gy, _ = _inputs((2048, 128), torch.bfloat16, seed=11)
    _, rstd = rmsnorm_ref(x, w)
    for which in ("dy", "x"):
        dy, xx = gy.clone(), x.clone()
        (dy if which == "dy" else xx)[300, 7] = float("nan")
        dx, dw = rmsnorm_bwd(dy, xx, w, rstd, lnc=1)
        ref_dx, ref_dw = rmsnorm_bwd_ref(dy, xx, w, rstd)
        bad = (~torch.isfinite(dx.float())).nonzero().tolist()
        assert (~torch.isfinite(dw.float())).nonzero().flatten().tolist() == [7], which
        assert (~torch.isfinite(ref_dw.float())).nonzero().flatten().tolist() == [7], which
        if which == "dy":
            assert sorted({r for r, _ in bad}) == [300] and len(bad) == 128, (which, len(bad))
            assert torch.equal(torch.isfinite(dx.float()), torch.isfinite(ref_dx.float()))
        else:
            rows = sorted({r for r, _ in bad})
            assert len(rows) == 128 and 300 in rows, (which, len(rows))
            assert {c for r, c in bad if r != 300} == {7}, which
            assert len({r % 6 for r in rows}) == 1  # one slot j of a chunk of NT = 6: rows r0 + 6p + j


# Rows wider than 16 KiB split into 2^k pieces (one per partition); few rows spread over the partitions.
WIDE_FWD = [((70, 16384), torch.bfloat16), ((9, 8192), torch.float32), ((5, 2, 12288), torch.bfloat16),
            ((33, 8192), torch.bfloat16), ((2, 2048), torch.float32)]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", WIDE_FWD, ids=[f"{s}-{d}" for s, d in WIDE_FWD])
def test_forward_split_rows(case, residual) -> None:
    """Forward beyond the backward's H (and few rows spread over the partitions): y, s and rstd within
    the oracle rule, LNC=2 bit-identical to LNC=1."""
    shape, dtype = case
    x, w, res, _, _ = _inputs(shape, dtype, seed=5)
    r = res if residual else None
    outs = {}
    for lnc in (1, 2):
        if residual:
            y, s, rstd = rmsnorm_residual(x, res, w, EPS, lnc=lnc)
            check_oracle("rmsnorm s", s, x + res, x.to(F64) + res.to(F64))
        else:
            (y, rstd), s = rmsnorm(x, w, EPS, lnc=lnc), x
        outs[lnc] = (y, s, rstd)
        base, _ = hf_rmsnorm(x, w, dtype, r)
        orc, s64 = hf_rmsnorm(x, w, F64, r)
        check_oracle("rmsnorm y", y, base, orc)
        check_oracle("rmsnorm rstd", rstd, torch.rsqrt(s.float().pow(2).mean(-1) + EPS).reshape(-1),
                     torch.rsqrt(s64.pow(2).mean(-1) + EPS).reshape(-1))
    for a, b in zip(outs[1], outs[2], strict=True):
        assert torch.equal(a, b)


def test_split_factor_and_tensor_engine_sums() -> None:
    """Pieces per row: wide rows to 16 KiB, few rows until one core's rows fill the partitions (pieces
    >= 512); the split forward sums each row's pieces on the Tensor engine (trace)."""
    from trnkit.kernels.rmsnorm.rmsnorm_kernels import split_factor
    from trnkit.nki_api import nl

    assert split_factor(8192, 2560, nl.bfloat16) == 1
    assert split_factor(2048, 16384, nl.bfloat16) == 2
    assert split_factor(2048, 16384, nl.float32) == 4
    assert split_factor(32, 8192, nl.bfloat16) == 8  # 16 rows per core x 8 pieces of 1024
    assert split_factor(32, 640, nl.bfloat16) == 1  # pieces would be under 512
    assert split_factor(1, 2048, nl.bfloat16) == 4
    x, w, _, _, _ = _inputs((32, 8192), torch.bfloat16)
    with trace.record() as tr:
        rmsnorm(x, w, lnc=2)
    assert tr.by_op()["nc_matmul"] == 2 * 2  # per core: the pieces' sum and rstd back to the pieces


def test_kernels_run_on_both_engines_and_tensor_engine_sums() -> None:
    """The wide forward balances the n pass between Vector and Scalar; the backward's row sums over
    partitions (dw) and the wide dx sums run on the Tensor engine (trace)."""
    x, w, _, gy, _ = _inputs((512, 1024), torch.bfloat16)
    with trace.record() as tr:
        y, rstd = rmsnorm(x, w)
    by = tr.by_op()
    assert by["activation_reduce"] == 512 // 128 * 1 * (512 // 512)  # one per row slot: 4 chunks x NT rows
    ops = {(i.engine, i.op) for i in tr}
    assert ("vector", "tensor_scalar") in ops and ("scalar", "activation") in ops
    with trace.record() as tr:
        rmsnorm_bwd(gy, x, w, rstd)
    assert tr.by_engine()["tensor"] > 0


# --------------------------------------------------------------------------------------------- slow
SLOW = [("4B norm", (8192, 2560)), ("4B q-norm", (2048, 32, 128)), ("4B k-norm", (2048, 8, 128)),
        ("30B-A3B norm", (8192, 2048)), ("30B-A3B q-norm", (2048, 32, 128))]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SLOW, ids=[c[0] for c in SLOW])
def test_oracle_parity_production(case, dtype) -> None:
    norm_case(case[1], dtype, residual=case[0].endswith(" norm"))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 300), H=st.integers(2, 700), dtype=st.sampled_from(DTYPES), residual=st.booleans(),
       lnc=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_oracle_parity_random_shapes(rows, H, dtype, residual, lnc, seed) -> None:
    """Forward and backward at random row counts and widths (narrow and wide rows, any H from 2: a one-element
    row is refused by the backward's constraints)."""
    norm_case((rows, H), dtype, residual, lnc, seed)
