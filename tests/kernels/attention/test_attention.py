"""Flash attention kernels: fp64-oracle parity of the exact forward (``fixed_shift=False``, output and
log-sum-exp; the default fixed-shift forward, whose fallback it is: test_attention_shift.py) and of the
gradients (fp32 and bf16; S = 1, S not a multiple of 128, several 1024-key steps; Hq / Hk = 1, 2, 4, 8;
head dims 16 to 128; the log-sum-exp's store layouts), agreement with the torch reference, LNC=2 (all
three work splits), constraints, and the trace: no [S, S] tensor in HBM. Slow tier: Qwen3-4B and
Qwen3-30B-A3B shapes.

The oracle is plain causal softmax attention in torch (scores, softmax, ``P @ V`` at one dtype,
transformers' eager attention): at the test dtype it is torch's own result, in float64 the oracle
(tests/tolerances.py); gradients are autograd's. It is evaluated one kv head (and its query heads) at a
time and compared with :class:`~tests.tolerances.OracleErr`, so a production shape never holds the
fp64 scores of every head at once."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.oracles import leaves
from tests.tolerances import F64, OracleErr, assert_close
from trnkit.kernels.attention import (attention, attention_bwd, attention_bwd_constraints, attention_bwd_ref,
                                      attention_constraints, attention_ref)
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.nkisim import trace

DTYPES = [torch.float32, torch.bfloat16]


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dt: torch.dtype, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, S, G, D], lse [B, G, S])`` of query heads ``q [B, S, G, D]`` over one kv head
    ``k, v [B, S, D]`` at dtype dt."""
    s = causal_scores(q.to(dt), k.to(dt), scale)
    o = torch.einsum("bgij,bjd->bigd", torch.softmax(s, -1), v.to(dt))
    return o, torch.logsumexp(s, -1)


def causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q k^T`` [B, G, S, S] of ``q [B, S, G, D]`` over ``k [B, S, D]``, -inf above the diagonal."""
    S = q.shape[1]
    s = torch.einsum("bigd,bjd->bgij", q, k) * scale
    return s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))


def _inputs(B: int, S: int, Hq: int, Hk: int, D: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(B, S, h, D, generator=g) for h in (Hq, Hk, Hk, Hq))
    return (q * scale).to(dtype), (k * scale).to(dtype), v.to(dtype), go.to(dtype)


def check_attention(q, k, v, o, lse, scale: float, grads=None, go=None) -> None:
    """The fp64-oracle rule on o and lse (and on the gradients ``grads = (dq, dk, dv)`` for the output
    gradient ``go``), streamed over kv heads."""
    errs = attention_errors(q, k, v, o, lse, scale, grads, go)
    checked = tuple(errs)
    if q.shape[1] == 1 and grads is not None:  # one key: softmax is 1, dq = dk = 0 exactly (no relative error)
        checked = ("o", "lse", "grad_v")
        for g_ in grads[:2]:
            assert g_.abs().max() <= 1e-5 * go.abs().max() * v.abs().max() * q.shape[3]
    for n in checked:
        errs[n].check()


def delta_from_stored_o(q, k, o, o_exact, go, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The error of ``(grad_q, grad_k)`` [B, S, G, D], [B, S, D] (fp64) that the backward's ``delta = rowsum(dO · O)``
    brings when it reads the stored ``o`` (rounded to the output dtype) instead of the exact output ``o_exact``
    (FlashAttention's form, and torch's SDPA flash backward's): ``dS = P (dP - delta)`` moves by ``-P ε_i``,
    ``ε_i = dO_i · (o_i - o_exact_i)``, exactly (``delta`` is linear in ``O``). Where ``dP - delta`` cancels (rows of
    few keys, near-uniform scores) this is most of the gradients' error, in torch's SDPA as in the kernel."""
    q, k, o, o_exact, go = (t.to(F64) for t in (q, k, o, o_exact, go))
    p = torch.softmax(causal_scores(q, k, scale), -1)
    d_ds = -p * torch.einsum("bigd,bigd->bgi", go, o - o_exact)[..., None]
    return (torch.einsum("bgij,bjd->bigd", d_ds, k) * scale, torch.einsum("bgij,bigd->bjd", d_ds, q) * scale)


def attention_errors(q, k, v, o, lse, scale: float, grads=None, go=None) -> dict[str, OracleErr]:
    """``{output: OracleErr}`` of o and lse (and the gradients ``grads`` for ``go``) against the fp64 oracle
    and torch at the test dtype, streamed over kv heads (:func:`check_attention` checks them). ``grad_q`` and
    ``grad_k`` are allowed the error of ``delta`` formed from the stored ``o`` (:func:`delta_from_stored_o`)."""
    dtype = q.dtype
    Hq, Hk = q.shape[2], k.shape[2]
    G = Hq // Hk
    names = ("o", "lse", "grad_q", "grad_k", "grad_v")
    errs = {n: OracleErr(f"attention {n}", torch.float32 if n == "lse" else dtype) for n in names}
    for j in range(Hk):
        hs = slice(j * G, (j + 1) * G)
        per = {}
        for dt in (dtype, F64):
            ql, kl, vl = leaves([q[:, :, hs], k[:, :, j], v[:, :, j]], dt)
            out, ls = eager_attention(ql, kl, vl, dt, scale)
            g_ = torch.autograd.grad(out, (ql, kl, vl), go[:, :, hs].to(dt)) if grads is not None else None
            per[dt] = (out.detach(), ls.detach(), g_)
        errs["o"].add(o[:, :, hs], per[dtype][0], per[F64][0])
        errs["lse"].add(lse[:, hs], per[dtype][1], per[F64][1])
        if grads is not None:
            d_q, d_k = delta_from_stored_o(q[:, :, hs], k[:, :, j], o[:, :, hs], per[F64][0], go[:, :, hs], scale)
            errs["grad_q"].add(grads[0][:, :, hs], per[dtype][2][0], per[F64][2][0], derived=d_q)
            errs["grad_k"].add(grads[1][:, :, j], per[dtype][2][1], per[F64][2][1], derived=d_k)
            errs["grad_v"].add(grads[2][:, :, j], per[dtype][2][2], per[F64][2][2])
    return {n: errs[n] for n in names[: 5 if grads is not None else 2]}


def attention_case(shape: tuple[int, int, int, int, int], dtype: torch.dtype, lnc: int = 1, seed: int = 0,
                   backward: bool = False) -> None:
    q, k, v, go = _inputs(*shape, dtype, seed)
    scale = shape[4] ** -0.5
    o, lse = attention(q, k, v, lnc=lnc, fixed_shift=False)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (shape[0], shape[2], shape[1])
    assert lse.dtype == torch.float32
    grads = None
    if backward:
        grads = attention_bwd(q, k, v, o, lse, go, lnc=lnc)
        for g_, x in zip(grads, (q, k, v), strict=True):
            assert g_.shape == x.shape and g_.dtype == dtype
    check_attention(q, k, v, o, lse, scale, grads, go)


# (B, S, Hq, Hk, D): S = 1, odd S, S past two PSUM banks; group sizes 1, 2, 3, 4, 8
FAST = [(1, 1, 2, 1, 64), (1, 5, 2, 1, 16), (2, 130, 4, 2, 64), (1, 200, 4, 1, 32), (1, 129, 8, 1, 128),
        (1, 1100, 2, 2, 128), (1, 300, 3, 3, 64), (1, 257, 3, 1, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", FAST, ids=[str(s) for s in FAST])
def test_oracle_parity(shape, dtype) -> None:
    """Forward (o, lse) and backward (grad_q, grad_k, grad_v) against the fp64 oracle."""
    attention_case(shape, dtype, backward=True)


# LNC=2 work splits of the forward: query heads of a group (B * Hk odd, G even), (b, kv head) pairs, a
# padded duplicate unit
LNC2 = [(1, 300, 4, 1, 64), (2, 130, 3, 1, 64), (1, 257, 3, 1, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", LNC2, ids=["split-heads", "split-kv", "padded"])
def test_lnc2_matches_lnc1(shape, dtype) -> None:
    """Each query tile (forward) and kv head (backward) runs the same instructions on either core:
    bit-identical results."""
    q, k, v, go = _inputs(*shape, dtype, seed=1)
    one, two = attention(q, k, v, lnc=1, fixed_shift=False), attention(q, k, v, lnc=2, fixed_shift=False)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    g1, g2 = attention_bwd(q, k, v, *one, go, lnc=1), attention_bwd(q, k, v, *one, go, lnc=2)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)
    attention_case(shape, dtype, lnc=2, seed=1, backward=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_reference_has_the_kernels_rounding_points(dtype) -> None:
    q, k, v, go = _inputs(1, 300, 4, 2, 64, dtype, seed=2)
    o, lse = attention(q, k, v, fixed_shift=False)
    ro, rl = attention_ref(q, k, v)
    torch.testing.assert_close(lse, rl, rtol=2e-6, atol=2e-6)
    assert_close(o, ro, dtype)
    for a, b in zip(attention_bwd(q, k, v, o, lse, go), attention_bwd_ref(q, k, v, o, lse, go), strict=True):
        assert_close(a, b, dtype)


def test_large_scores_and_a_custom_scale() -> None:
    """Scores of a few hundred (exp would overflow without the running max) and scale != D^-0.5."""
    q, k, v, _ = _inputs(1, 600, 2, 1, 64, torch.float32, seed=3, scale=6.0)
    o, lse = attention(q, k, v, scale=0.3, fixed_shift=False)
    assert torch.isfinite(o).all() and lse.max() > 100
    go = torch.randn(o.shape, generator=torch.Generator().manual_seed(4))
    check_attention(q, k, v, o, lse, 0.3, attention_bwd(q, k, v, o, lse, go, scale=0.3), go)


def test_delta_from_the_stored_o_is_torch_sdpas_error_too() -> None:
    """Two keys, near-uniform scores (q, k x 0.3), bf16: ``dP - delta`` cancels, and the gradients' error is
    ``delta`` formed from the bf16-rounded ``o`` (17 % of grad_q here, 6x torch's eager bf16 error). torch's own
    bf16 SDPA backward (flash, the path transformers' "sdpa" takes) errs the same; :func:`delta_from_stored_o`
    gives the error, so the rule allows it once, and not twice over."""
    q, k, v, go = _inputs(1, 2, 1, 1, 64, torch.bfloat16, seed=280, scale=0.3)
    o, lse = attention(q, k, v)
    grads = attention_bwd(q, k, v, o, lse, go)
    errs = attention_errors(q, k, v, o, lse, 64 ** -0.5, grads, go)
    leaf = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    sdpa = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*leaf, is_causal=True),
                               leaf[:2], go.transpose(1, 2))
    for n, ours, theirs in zip(("grad_q", "grad_k"), grads[:2], sdpa, strict=True):
        kernel, eager = errs[n].errors()
        assert kernel > 4 * eager and kernel > 0.05
        oracle = errs[n].sq["oracle"] ** 0.5  # torch's SDPA within 1 % of the kernel, both 17 % off the oracle
        assert float((theirs.transpose(1, 2).double() - ours.double()).norm()) / oracle < 0.01
        errs[n].check()
    exact_o = eager_attention(*leaves([q, k[:, :, 0], v[:, :, 0]], F64), F64, 64 ** -0.5)[0].detach()
    d_q = delta_from_stored_o(q, k[:, :, 0], o, exact_o, go, 64 ** -0.5)[0]
    twice = (grads[0].double() + d_q).to(grads[0].dtype)  # the design's error, twice over
    with pytest.raises(AssertionError, match="grad_q: error vs the fp64 oracle"):
        attention_errors(q, k, v, o, lse, 64 ** -0.5, (twice, *grads[1:]), go)["grad_q"].check()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_backward_head_passes(monkeypatch, dtype) -> None:
    """When the dQ accumulators of a group do not fit SBUF together the heads go in passes whose dK / dV
    partial sums meet in an fp32 HBM scratch: same results as one pass (up to summation order). fp32: one
    head's accumulator per pass, q-side tiles loaded per key block; bf16: one head with its cached q-side
    tiles per pass."""
    import importlib
    kb = importlib.import_module("trnkit.kernels.attention.flash_bwd")
    q, k, v, go = _inputs(1, 300, 4, 1, 64, dtype, seed=5)
    o, lse = attention(q, k, v, fixed_shift=False)
    one = attention_bwd(q, k, v, o, lse, go)
    itemsize = 4 if dtype == torch.float32 else 2
    budget = 3 * 64 * 4 if dtype == torch.float32 else 3 * 64 * (4 + 4 * itemsize)  # 3 query tiles per head
    monkeypatch.setattr(kb, "DQ_BUDGET", budget)
    assert kb.heads_per_pass(300, 64, 4, itemsize) == 1
    assert kb.cache_q_side(300, 64, itemsize) == (dtype == torch.bfloat16)
    passes = attention_bwd(q, k, v, o, lse, go)
    assert torch.equal(passes[0], one[0])
    # fp32 partial sums in another order: equal up to fp32 rounding, which can flip one bf16 rounding (1 ulp)
    rtol = 1e-6 if dtype == torch.float32 else 2 ** -7
    for a, b in zip(passes[1:], one[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6)
    check_attention(q, k, v, o, lse, 64 ** -0.5, passes, go)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_forward_steps_past_one(monkeypatch, dtype) -> None:
    """Tiles whose keys take several pipeline steps (the running max, the correction of O and l, and P^T
    split between DMA and PE transposes in each step): same rule against the oracle, at LNC=1 and, bit
    for bit, at LNC=2. The default step (4,096 keys up to S = 8,192) is shrunk to 512 keys."""
    import importlib
    kf = importlib.import_module("trnkit.kernels.attention.flash_fwd")
    assert kf.step_keys(4096, 2, 128) == 4096 and kf.step_keys(32768, 2, 128) == 1024
    monkeypatch.setattr(kf, "step_keys", lambda S, itemsize, D, ng=1: 512)
    q, k, v, _ = _inputs(1, 1100, 4, 2, 64, dtype, seed=3)
    o, lse = attention(q, k, v, fixed_shift=False)
    check_attention(q, k, v, o, lse, 64 ** -0.5)
    two = attention(q, k, v, lnc=2, fixed_shift=False)
    assert torch.equal(two[0], o) and torch.equal(two[1], lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 256, 4, 2, 32), (1, 1100, 16, 1, 16)], ids=["whole-tiles", "two-blocks"])
def test_forward_lse_store(shape, dtype) -> None:
    """The log-sum-exp leaves the chip transposed (one row per query tile): S a multiple of 128 (one DMA
    per block of tiles), and a unit of more than 128 tiles (two transposed blocks, a head's tiles split
    between them, each head's short last tile stored on its own). Forward only, against the oracle."""
    attention_case(shape, dtype)


@pytest.mark.parametrize("fixed_shift", [True, False], ids=["fixed-shift", "exact"])
def test_no_square_tensor_in_hbm(fixed_shift) -> None:
    """Every HBM access of either forward is at most one head's rows: no [S, S] scores or probabilities."""
    S, Hq, D = 1100, 2, 64
    q, k, v, _ = _inputs(1, S, Hq, 1, D, torch.bfloat16)
    with trace.record() as tr:
        attention(q, k, v, fixed_shift=fixed_shift)
    hbm = [o.nbytes for i in tr for o in i.operands if o.buffer in ("hbm", "shared_hbm", "private_hbm")]
    assert hbm and max(hbm) <= S * D * 2 < S * S


def test_the_bf16_backward_transposes_dk_and_dv_in_bf16_on_tensor_engine() -> None:
    """dK / dV are rounded to bf16 before their PE transposes (the same values: the transpose is exact), so
    no TensorE transpose of the bf16 backward is fp32: an fp32 one takes twice a bf16 one's time on trn2."""
    q, k, v, go = _inputs(1, 300, 2, 1, 64, torch.bfloat16)
    o, lse = attention(q, k, v, fixed_shift=False)
    with trace.record() as tr:
        attention_bwd(q, k, v, o, lse, go)
    pe = [i for i in tr if i.op == "nc_transpose" and i.engine == trace.TENSOR]
    assert pe and {o.dtype for i in pe for o in i.operands} == {"bfloat16"}


def test_constraints_name_the_rule_and_value() -> None:
    q, k = torch.randn(1, 8, 4, 64), torch.randn(1, 8, 2, 64)
    cases = [
        (dict(q=q[0], k=k, v=k), "q is [B, S, Hq, D]"),
        (dict(q=q, k=k[:, :4], v=k[:, :4]), "k is [B, S, Hk, D]"),
        (dict(q=q, k=k, v=k[..., :32]), "v has k's shape"),
        (dict(q=torch.randn(1, 8, 3, 64), k=k, v=k), "Hq % Hk == 0"),
        (dict(q=q.half(), k=k.half(), v=k.half()), "q.dtype in"),
        (dict(q=q, k=k.bfloat16(), v=k), "q, k, v share one dtype"),
        (dict(q=torch.randn(1, 8, 4, 256), k=torch.randn(1, 8, 2, 256), v=torch.randn(1, 8, 2, 256)), "D <= 128"),
        (dict(q=q, k=k, v=k, scale=-1.0), "scale is None or a finite float > 0"),
        (dict(q=torch.empty(1, 20000, 1, 8, device="meta"), k=torch.empty(1, 20000, 1, 8, device="meta"),
              v=torch.empty(1, 20000, 1, 8, device="meta")), "S <= 16384 for float32"),
    ]
    for kw, rule in cases:
        found = attention_constraints(**kw)
        assert found and rule in found[0].constraint, (rule, found)
    with pytest.raises(KernelConstraintError, match=r"attention: constraint 'Hq % Hk == 0"):
        attention(torch.randn(1, 8, 3, 64), k, k)
    lse = torch.zeros(1, 4, 8)
    assert not attention_bwd_constraints(q, k, k, q, lse, q)
    found = attention_bwd_constraints(q, k, k, q.bfloat16(), lse[..., :4], q)
    assert [f.constraint for f in found] == ["o has q's shape and dtype", "lse is [B, Hq, S] float32 (the forward's)"]
    with pytest.raises(KernelConstraintError, match=r"attention_bwd: constraint 'grad_o has q's shape"):
        attention_bwd(q, k, k, q, lse, q[:, :4])


# --------------------------------------------------------------------------------------------- slow
SLOW = [("4B", (1, 2048, 32, 8, 128)), ("30B-A3B", (1, 2048, 32, 4, 128))]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SLOW, ids=[c[0] for c in SLOW])
def test_oracle_parity_production(case, dtype) -> None:
    attention_case(case[1], dtype, lnc=2, backward=True)


@pytest.mark.parametrize("fixed_shift", [True, False], ids=["shift", "exact"])
def test_non_finite_key_or_value_reaches_the_earlier_rows_of_its_query_tile(fixed_shift) -> None:
    """A NaN at key j (in k or v) makes the rows of j's 128-query tile before j non-finite too (the tile's scores
    and P @ V are computed whole, then masked: 0 x NaN), besides rows >= j; earlier tiles stay finite and
    exact. The reference's P @ V multiplies the masked zeros too, so a NaN in v makes its every row NaN: the
    one case where the kernel is finite (rows < 128) where the reference is not (docs/kernels.md, Non-finite
    inputs); those rows equal causal attention over a v with the NaN zeroed, which they never read."""
    q, k, v, _ = _inputs(1, 300, 2, 1, 16, torch.float32, seed=5)
    for name in ("k", "v"):
        kk, vv = k.clone(), v.clone()
        (kk if name == "k" else vv)[0, 200, 0, 3] = float("nan")
        o, _ = attention(q, kk, vv, scale=0.25, fixed_shift=fixed_shift)
        bad = ~torch.isfinite(o).all(-1).all(-1)[0]
        assert torch.equal(bad, torch.arange(300) >= 128), name
        ref_bad = ~torch.isfinite(attention_ref(q, kk, vv, 0.25)[0]).all(-1).all(-1)[0]
        assert torch.equal(ref_bad, torch.arange(300) >= (200 if name == "k" else 0)), name
        want, _ = attention_ref(q, k, v.index_fill(1, torch.tensor([200]), 0.0) if name == "v" else v, 0.25)
        assert_close(o[:, :128], want[:, :128])
