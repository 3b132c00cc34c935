"""The q and k head norms in one launch (``rmsnorm_qk`` / ``rmsnorm_qk_bwd``): fp64-oracle parity (forward,
both gradients, both weight gradients; fp32 and bf16, odd shapes, an fp32 weight with bf16 rows), every output
bit-identical to the two separate ``rmsnorm`` / ``rmsnorm_bwd`` launches (hashed) at LNC=1 and LNC=2, the two
LNC=2 programs running the same instruction streams, the torch reference, constraints. Slow tier: Qwen3
flavors' q and k heads."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch

from tests.kernels.lnc_streams import assert_same_streams, recorded_streams
from tests.kernels.oracles import leaves
from tests.kernels.rmsnorm.test_rmsnorm import EPS, hf_rmsnorm
from tests.tolerances import F64, check_oracle
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.kernels.rmsnorm import (rmsnorm, rmsnorm_bwd, rmsnorm_qk, rmsnorm_qk_bwd, rmsnorm_qk_bwd_constraints,
                                    rmsnorm_qk_bwd_ref, rmsnorm_qk_constraints, rmsnorm_qk_ref)

DTYPES = [torch.float32, torch.bfloat16]


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _inputs(T: int, hq: int, hk: int, D: int, dtype: torch.dtype, wdtype: torch.dtype | None = None, seed: int = 0):
    """q ``[T, hq, D]``, k ``[T, hk, D]`` (k at another scale, as a k projection's output may be), their own
    weights, and output gradients."""
    g = torch.Generator().manual_seed(seed)
    wdtype = wdtype or dtype
    q = torch.randn(T, hq, D, generator=g).to(dtype)
    k = (4 * torch.randn(T, hk, D, generator=g)).to(dtype)
    wq = (1 + 0.2 * torch.randn(D, generator=g)).to(wdtype)
    wk = (0.5 + 0.3 * torch.rand(D, generator=g)).to(wdtype)
    out_dt = torch.promote_types(dtype, wdtype)
    gq = torch.randn(T, hq, D, generator=g).to(out_dt)
    gk = torch.randn(T, hk, D, generator=g).to(out_dt)
    return q, k, wq, wk, gq, gk


def _pair_case(T, hq, hk, D, dtype, lnc, wdtype=None, seed=0):
    """Forward and backward of the pair against the fp64 oracle and hashed against the two separate launches."""
    q, k, wq, wk, gq, gk = _inputs(T, hq, hk, D, dtype, wdtype, seed)
    yq, yk, rq, rk = rmsnorm_qk(q, k, wq, wk, EPS, lnc=lnc)
    sq, sk = rmsnorm(q, wq, EPS, lnc=lnc), rmsnorm(k, wk, EPS, lnc=lnc)
    assert [_digest(t) for t in (yq, rq, yk, rk)] == [_digest(t) for t in (*sq, *sk)]
    for name, x, w, y, r in (("q", q, wq, yq, rq), ("k", k, wk, yk, rk)):
        check_oracle(f"rmsnorm_qk y_{name}", y, hf_rmsnorm(x, w, dtype)[0], hf_rmsnorm(x, w, F64)[0])
        check_oracle(f"rmsnorm_qk rstd_{name}", r, torch.rsqrt(x.float().pow(2).mean(-1) + EPS).reshape(-1),
                     torch.rsqrt(x.to(F64).pow(2).mean(-1) + EPS).reshape(-1))
    grads = rmsnorm_qk_bwd(gq, gk, q, k, wq, wk, rq, rk, lnc=lnc)
    bq, bk = rmsnorm_bwd(gq, q, wq, rq, lnc=lnc), rmsnorm_bwd(gk, k, wk, rk, lnc=lnc)
    assert [_digest(t) for t in grads] == [_digest(t) for t in (bq[0], bk[0], bq[1], bk[1])]
    assert [t.dtype for t in grads] == [q.dtype, k.dtype, wq.dtype, wk.dtype]
    for name, x, w, gy, gx, gw in (("q", q, wq, gq, grads[0], grads[2]), ("k", k, wk, gk, grads[1], grads[3])):
        want = {}
        for dt in (dtype, F64):
            xl, wl = leaves([x, w], dt)
            want[dt] = torch.autograd.grad(hf_rmsnorm(xl, wl, dt)[0], (xl, wl), gy.to(dt))
        check_oracle(f"rmsnorm_qk grad_{name}", gx, want[dtype][0], want[F64][0])
        check_oracle(f"rmsnorm_qk grad_weight_{name}", gw, want[dtype][1], want[F64][1])


# (T, q heads, k heads, head_dim): odd token counts (a tail on fewer partitions, uneven halves at LNC=2), k
# with fewer heads, a narrower head_dim, one token
FAST = [(300, 5, 3, 128), (41, 2, 1, 64), (1, 1, 1, 128), (257, 4, 2, 96)]


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", FAST, ids=[f"T{s[0]}x{s[1]}+{s[2]}x{s[3]}" for s in FAST])
def test_pair_oracle_and_bit_identical_to_two_launches(shape, dtype, lnc) -> None:
    _pair_case(*shape, dtype, lnc)


def test_fp32_weights_with_bf16_heads() -> None:
    """fp32 weights make y and grad_y fp32 (the promoted dtype); still bit-identical to two launches."""
    _pair_case(130, 3, 2, 128, torch.bfloat16, 2, wdtype=torch.float32, seed=3)


def test_several_chunks_per_core_and_same_streams_at_lnc2() -> None:
    """Enough rows for several chunks of each tensor per core (2,048 x 6 q rows: 48 row slots per core, k a third
    of that): bit-identical to two launches, and the two programs of each LNC=2 launch run the same number of
    instructions per engine."""
    q, k, wq, wk, gq, gk = _inputs(2048, 6, 2, 128, torch.bfloat16, seed=5)
    with recorded_streams() as s:
        yq, yk, rq, rk = rmsnorm_qk(q, k, wq, wk, EPS, lnc=2)
        grads = rmsnorm_qk_bwd(gq, gk, q, k, wq, wk, rq, rk, lnc=2)
    assert_same_streams(s)
    sq, sk = rmsnorm(q, wq, EPS, lnc=2), rmsnorm(k, wk, EPS, lnc=2)
    bq, bk = rmsnorm_bwd(gq, q, wq, rq, lnc=2), rmsnorm_bwd(gk, k, wk, rk, lnc=2)
    assert [_digest(t) for t in (yq, rq, yk, rk, *grads)] == [
        _digest(t) for t in (*sq, *sk, bq[0], bk[0], bq[1], bk[1])]
    one = rmsnorm_qk(q, k, wq, wk, EPS, lnc=1)  # LNC=1: the same rows, the same arithmetic
    assert [_digest(t) for t in one] == [_digest(t) for t in (yq, yk, rq, rk)]


def test_every_stored_rstd_from_the_same_instruction_as_in_two_launches() -> None:
    """Each tensor's stored fp32 rstd is formed by the instructions of its own launch: Scalar's rsqrt activation
    for the runs of its last three chunks, Vector's rsqrt ALU op for the others (on a device the two engines'
    rsqrt need not round alike): the pair's rsqrt instructions (engine, shapes) are the two launches'."""
    from collections import Counter

    from trnkit.nkisim import trace

    q, k, wq, wk, _, _ = _inputs(2048, 6, 2, 128, torch.bfloat16, seed=7)

    def kinds(tr):
        return Counter((i.engine, i.op, i.attrs.get("op"), tuple(o.shape for o in i.operands)) for i in tr
                       if i.attrs.get("op") == "rsqrt")

    with trace.record(trace_only=True) as two:
        rmsnorm(q, wq, EPS, lnc=1)
        rmsnorm(k, wk, EPS, lnc=1)
    with trace.record(trace_only=True) as one:
        rmsnorm_qk(q, k, wq, wk, EPS, lnc=1)
    assert kinds(one) == kinds(two) and sum(n for (e, *_), n in kinds(one).items() if e == "scalar") >= 4


def test_reference_is_the_two_references() -> None:
    q, k, wq, wk, gq, gk = _inputs(7, 3, 2, 128, torch.bfloat16)
    yq, yk, rq, rk = rmsnorm_qk_ref(q, k, wq, wk, EPS)
    from trnkit.kernels.rmsnorm import rmsnorm_bwd_ref, rmsnorm_ref

    two = (*rmsnorm_ref(q, wq, EPS), *rmsnorm_ref(k, wk, EPS))
    assert all(torch.equal(a, b) for a, b in zip((yq, rq, yk, rk), two))
    got = rmsnorm_qk_bwd_ref(gq, gk, q, k, wq, wk, rq, rk)
    bq, bk = rmsnorm_bwd_ref(gq, q, wq, rq), rmsnorm_bwd_ref(gk, k, wk, rk)
    assert all(torch.equal(a, b) for a, b in zip(got, (bq[0], bk[0], bq[1], bk[1])))


def test_constraints_name_the_rule_and_value() -> None:
    q, k = torch.randn(4, 2, 128), torch.randn(4, 1, 128)
    w = torch.ones(128)
    cases = [
        (dict(q=q, k=torch.randn(4, 1, 64), weight_q=w, weight_k=torch.ones(64)), "rmsnorm_qk",
         "q and k have one H", ((4, 2, 128), (4, 1, 64))),
        (dict(q=torch.randn(2, 512), k=torch.randn(2, 512), weight_q=torch.ones(512), weight_k=torch.ones(512)),
         "rmsnorm_qk", "H < 512", 512),
        (dict(q=q, k=k.bfloat16(), weight_q=w, weight_k=w.bfloat16()), "rmsnorm_qk", "q.dtype == k.dtype",
         ("float32", "bfloat16")),
        (dict(q=q.bfloat16(), k=k.bfloat16(), weight_q=w, weight_k=w.bfloat16()), "rmsnorm_qk",
         "weight_q.dtype == weight_k.dtype", ("float32", "bfloat16")),
        (dict(q=q, k=k, weight_q=w, weight_k=torch.ones(64)), "rmsnorm_qk", "k: weight is [H]", (64,)),
        (dict(q=q.half(), k=k, weight_q=w.half(), weight_k=w), "rmsnorm_qk", "q: x.dtype in", "float16"),
        (dict(q=q, k=k, weight_q=w, weight_k=w, eps=-1.0), "rmsnorm_qk", "q: eps is a finite float >= 0", -1.0),
    ]
    for kw, kernel, rule, value in cases:
        v = rmsnorm_qk_constraints(**kw)
        assert v and (v[0].kernel, v[0].value) == (kernel, value) and rule in v[0].constraint, (kw.keys(), v)
    with pytest.raises(KernelConstraintError, match=r"rmsnorm_qk: constraint 'H < 512 .*' violated \(got 512\)"):
        rmsnorm_qk(torch.randn(2, 512), torch.randn(2, 512), torch.ones(512), torch.ones(512))
    rq, rk = torch.ones(8), torch.ones(3)
    v = rmsnorm_qk_bwd_constraints(q, k, q, k, w, w, rq, rk)
    assert [(b.kernel, b.constraint, b.value) for b in v] == [
        ("rmsnorm_qk_bwd", "k: rstd is [rows] float32 (the forward's)", ((3,), "float32"))]
    with pytest.raises(KernelConstraintError, match=r"rmsnorm_qk_bwd: constraint 'k: rstd is \[rows\] float32"):
        rmsnorm_qk_bwd(q, k, q, k, w, w, rq, rk)


SLOW = [("0.6B", 2048, 16, 8), ("4B", 2048, 32, 8), ("30B-A3B", 2048, 32, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SLOW, ids=[c[0] for c in SLOW])
def test_pair_production(case, dtype) -> None:
    _pair_case(case[1], case[2], case[3], 128, dtype, 2)


@settings(max_examples=12, deadline=None)
@given(T=st.integers(1, 200), hq=st.integers(1, 6), hk=st.integers(1, 3), D=st.sampled_from([8, 64, 96, 128, 256]),
       dtype=st.sampled_from(DTYPES), lnc=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_pair_random_shapes(T, hq, hk, D, dtype, lnc, seed) -> None:
    _pair_case(T, hq, hk, D, dtype, lnc, seed=seed)
