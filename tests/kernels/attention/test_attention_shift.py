"""The fixed-shift forward (``attention(..., fixed_shift=True)``, :mod:`trnkit.kernels.attention.flash_fwd_shift`):
its fast pass (a per-row shift from the first 512 keys, no running max) and its per-launch fallback to the
exact forward, each against the fp64 oracle (fwd + grads, fp32 and bf16, odd shapes, LNC=1 and LNC=2), the
certificate's boundary, and a launch whose shift would overflow. Which pass produced the outputs is read from
the trace: the fallback's exponentials read score tiles from SBUF, the fast pass's read PSUM."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch

from tests.kernels.attention.test_attention import DTYPES, _inputs, attention_errors, check_attention
from trnkit.kernels.attention import attention, attention_bwd
from trnkit.kernels.attention import flash_fwd_shift as fs
from trnkit.kernels.attention.shift_rule import certificate_bound
from trnkit.nkisim import trace


def _run(q, k, v, lnc=1, scale=None):
    """``(o, lse, fell_back)`` of the fixed-shift forward: fell_back when the exact pass ran (its
    exponentials read the scores from SBUF; the fast pass's, and the [128, 1] table warm-up's, do not)."""
    with trace.record() as tr:
        o, lse = attention(q, k, v, scale=scale, lnc=lnc, fixed_shift=True)
    exact = [i for i in tr if i.op == "activation" and i.attrs.get("op") == "exp"
             and any(x.role == "data" and x.buffer == "sbuf" and x.shape != (128, 1) for x in i.operands)]
    fast = [i for i in tr if i.op == "activation" and i.attrs.get("op") == "exp"
            and any(x.role == "data" and x.buffer == "psum" for x in i.operands)]
    assert fast, "the fast pass always runs"
    return o, lse, bool(exact)


# (B, S, Hq, Hk, D): S = 1, odd S, rows past the 512 keys of the shift (S > 512), group sizes 1 to 8
FAST = [(1, 1, 2, 1, 64), (1, 5, 2, 1, 16), (2, 130, 4, 2, 64), (1, 600, 2, 1, 32), (1, 1100, 2, 2, 128),
        (1, 257, 3, 1, 32), (1, 700, 8, 1, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", FAST, ids=[str(s) for s in FAST])
def test_fast_pass_oracle_parity(shape, dtype) -> None:
    """Random scores: every row passes the certificate, the fast pass's o and lse (and the backward from
    them) hold the fp64-oracle rule."""
    q, k, v, go = _inputs(*shape, dtype, seed=7)
    o, lse, fell_back = _run(q, k, v)
    assert not fell_back
    grads = attention_bwd(q, k, v, o, lse, go)
    check_attention(q, k, v, o, lse, shape[4] ** -0.5, grads, go)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_up_to_512_keys_is_the_exact_forward(dtype) -> None:
    """Rows of at most 512 keys are shifted by their exact max: the same instructions' arithmetic as the
    exact forward, bit for bit."""
    q, k, v, _ = _inputs(1, 300, 4, 2, 64, dtype, seed=2)
    o, lse, fell_back = _run(q, k, v)
    assert not fell_back
    ref = attention(q, k, v, fixed_shift=False)
    assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1])


LNC2 = [(1, 600, 4, 1, 64), (2, 530, 3, 1, 64), (1, 257, 3, 1, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", LNC2, ids=["split-heads", "split-kv", "padded"])
def test_lnc2_fast_pass_matches_lnc1(shape, dtype) -> None:
    """A step's score groups depend only on its tile, so both work splits give bit-identical results;
    LNC=2 against the oracle, fwd + grads."""
    q, k, v, go = _inputs(*shape, dtype, seed=1)
    one, two = _run(q, k, v, lnc=1), _run(q, k, v, lnc=2)
    assert not one[2] and not two[2]
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    check_attention(q, k, v, two[0], two[1], shape[4] ** -0.5, attention_bwd(q, k, v, two[0], two[1], go, lnc=2), go)


@pytest.mark.parametrize("lnc", [1, 2])
def test_scores_in_the_hundreds_fall_back(lnc) -> None:
    """Scores of a few hundred: rows whose max lies past their first 512 keys by far more than log 4S (the fp32
    rule) fail the certificate, and the launch reruns the exact forward: its outputs bit for bit, fwd + grads
    against the oracle."""
    q, k, v, _ = _inputs(1, 600, 2, 1, 64, torch.float32, seed=3, scale=6.0)
    o, lse, fell_back = _run(q, k, v, lnc=lnc, scale=0.3)
    assert fell_back and lse.max() > 100
    ref = attention(q, k, v, scale=0.3, lnc=lnc, fixed_shift=False)
    assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1])
    go = torch.randn(o.shape, generator=torch.Generator().manual_seed(4))
    check_attention(q, k, v, o, lse, 0.3, attention_bwd(q, k, v, o, lse, go, scale=0.3), go)


def _one_row(S: int, delta: float, dtype=torch.float32):
    """One head, D = 16, S keys: the last query row scores 0 against keys 0..511 except key 0 (score 0 too)
    and ``delta`` against key S - 2 (past the shift's 512 keys); every other score of that row is about
    -30 (its exponential under 1e-13). Other rows: small random scores. The row's l under the fast pass is
    ``1 + e^delta`` plus under 1e-9."""
    D = 16
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, S, 1, D, generator=g) * 0.1
    k = torch.randn(1, S, 1, D, generator=g) * 0.1
    v = torch.randn(1, S, 1, D, generator=g)
    scale = 1.0
    q[0, S - 1, 0] = 0.0
    q[0, S - 1, 0, 0] = 1.0  # the row's scores are k[:, 0] (scale 1)
    k[0, :, 0, 0] = -30.0
    k[0, 0, 0, 0] = 0.0
    k[0, S - 2, 0, 0] = delta
    return q.to(dtype), k.to(dtype), v.to(dtype), scale


def _around(limit: float, dtype: torch.dtype) -> tuple[float, float]:
    """Values of ``dtype`` just under and just over ``limit``: 0.05 off in fp32, the neighbouring bf16 values
    (8 significant bits) in bf16."""
    if dtype == torch.float32:
        return limit - 0.05, limit + 0.05
    step = 2.0 ** (math.floor(math.log2(limit)) - 7)
    down = math.floor(limit / step) * step
    return (down - step if down == limit else down), down + step


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_certificate_boundary(lnc, dtype) -> None:
    """The last row's l is 1 + e^delta: just under the dtype's bound (fp32: 4 S, bf16: S e^32,
    :mod:`~trnkit.kernels.attention.shift_rule`) the fast pass stands, just over it the launch falls back;
    both against the oracle. On LNC=2 only the second core's head has that row: its count reaches the first
    core, and both take the same path (the interpreter checks that their runtime control flow agrees)."""
    S = 700
    limit = math.log(certificate_bound(S, torch.tensor([], dtype=dtype).element_size()) - 1)
    for delta, expect in zip(_around(limit, dtype), (False, True), strict=True):
        q, k, v, scale = _one_row(S, delta, dtype)
        if lnc == 2:  # two query heads, one per core: only the second core's head has the row
            calm = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(dtype) * 0.1
            q = torch.cat([calm, q], dim=2)
        o, lse, fell_back = _run(q, k, v, lnc=lnc, scale=scale)
        assert fell_back == expect, (delta, limit)
        assert abs(lse[0, -1, -1].item() - math.log(1 + math.exp(delta))) < 1e-5
        check_attention(q, k, v, o, lse, scale)


def _far_past_the_shift(S: int, delta: float, dtype: torch.dtype, seed: int = 3):
    """Two query heads over one kv head, D = 16: every key past the first 512 scores about ``delta`` above the
    first 512 (q's first coordinate 1, k's 0 or ``delta``; the rest small random), so each row past key 512
    has its maximum ``delta`` past its shift with about ``i - 512`` keys sharing it (the backward's ``dP -
    delta`` then cancels, which magnifies rounding)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, 2, 16, generator=g) * 0.3
    k = torch.randn(1, S, 1, 16, generator=g) * 0.3
    v = torch.randn(1, S, 1, 16, generator=g)
    q[..., 0] = 1.0
    k[0, :, 0, 0] = 0.0
    k[0, 512:, 0, 0] = delta
    go = torch.randn(q.shape, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), go.to(dtype)


def test_bf16_rows_far_past_their_shift_are_as_accurate_as_the_exact_forward() -> None:
    """bf16 rows 30 nats past their shift keep the fast pass (``l`` about 190 e^30, under S e^32) and its
    outputs and gradients are within 1.4x of the exact forward's error against fp64 (measured 1.09x here;
    at 8, 16 and 30 nats over three seeds at most 1.33x, grad_q; ``lse``, an fp32 output, up to 1.56x, its
    error under 1e-5 of the oracle rule's bf16 allowance): the fast pass's own roundings hide under bf16's."""
    q, k, v, go = _far_past_the_shift(700, 30.0, torch.bfloat16)
    errors = {}
    for name, fixed_shift in (("exact", False), ("shift", True)):
        o, lse = attention(q, k, v, scale=1.0, fixed_shift=fixed_shift)
        grads = attention_bwd(q, k, v, o, lse, go, scale=1.0)
        errors[name] = {n: e.errors()[0] for n, e in attention_errors(q, k, v, o, lse, 1.0, grads, go).items()}
    assert not _run(q, k, v, scale=1.0)[2]  # the fast pass stood
    for n in ("o", "grad_q", "grad_k", "grad_v"):
        assert errors["shift"][n] <= 1.4 * errors["exact"][n], (n, errors["shift"][n], errors["exact"][n])
    assert errors["shift"]["lse"] <= 2.0 * errors["exact"]["lse"]


def test_a_shift_that_would_overflow_falls_back() -> None:
    """delta = 100: under the fast pass the row's exponentials overflow fp32 (e^100); the certificate sees
    l = inf, the launch takes the exact forward, and o, lse are finite and right."""
    q, k, v, scale = _one_row(600, 100.0)
    o, lse, fell_back = _run(q, k, v, scale=scale)
    assert fell_back and torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert abs(lse[0, 0, -1].item() - 100.0) < 1e-5
    check_attention(q, k, v, o, lse, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fast_pass_steps_past_one(monkeypatch, dtype) -> None:
    """Tiles whose keys take several pipeline steps: one shift for all of a tile's steps, O and l summed over
    them without rescaling; against the oracle, and LNC=2 bit for bit."""
    import importlib
    kf = importlib.import_module("trnkit.kernels.attention.flash_fwd")
    monkeypatch.setattr(kf, "step_keys", lambda S, itemsize, D, ng=1: 512)
    q, k, v, _ = _inputs(1, 1100, 4, 2, 64, dtype, seed=3)
    o, lse, fell_back = _run(q, k, v)
    assert not fell_back
    check_attention(q, k, v, o, lse, 64 ** -0.5)
    two = _run(q, k, v, lnc=2)
    assert torch.equal(two[0], o) and torch.equal(two[1], lse)


def test_fixed_shift_must_be_a_bool() -> None:
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="attention: argument fixed_shift must be a bool, got 'yes'"):
        attention(q, q[:, :, :1], q[:, :, :1], fixed_shift="yes")


def test_lnc2_cores_without_the_exchange_diverge(monkeypatch) -> None:
    """Why the counts are exchanged: with each core deciding on its own rows, the core whose rows pass skips
    the exact pass while the other runs it, and the interpreter rejects the launch (LNC guide: control flow
    that differs between the cores is undefined)."""
    from trnkit.nkisim import NkiValidationError
    own = fs._failing_rows
    monkeypatch.setattr(fs, "_failing_rows", lambda bad, ones_col, n_prog, pid: own(bad, ones_col, 1, 0))
    S = 700
    q, k, v, scale = _one_row(S, math.log(certificate_bound(S, 4)) + 1.0)
    calm = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)) * 0.1
    with pytest.raises(NkiValidationError, match="LNC=2 divergence"):
        attention(torch.cat([calm, q], dim=2), k, v, scale=scale, lnc=2, fixed_shift=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fast_pass_production_shape(dtype) -> None:
    """Qwen3-4B's heads at S = 2,048 (LNC=2): the fast pass holds, fwd + grads against the oracle."""
    q, k, v, go = _inputs(1, 2048, 32, 8, 128, dtype, seed=0)
    o, lse, fell_back = _run(q, k, v, lnc=2)
    assert not fell_back
    check_attention(q, k, v, o, lse, 128 ** -0.5, attention_bwd(q, k, v, o, lse, go, lnc=2), go)


def test_torch_certificate_predicts_the_fallback() -> None:
    """``fixed_shift_failures`` (torch) names the rows that make a launch fall back: none on random scores,
    only the last row just past the boundary (not just under it), some rows past 512 keys with scores in
    the hundreds; each time the kernel's decision (read from its trace) agrees, under each dtype's bound."""
    from trnkit.kernels.attention import fixed_shift_failures

    assert fs.BANK == 512
    q, k, v, _ = _inputs(1, 600, 2, 1, 32, torch.float32, seed=7)
    assert not fixed_shift_failures(q, k).any() and not _run(q, k, v)[2]
    S = 700
    for dtype, itemsize in ((torch.float32, 4), (torch.bfloat16, 2)):
        limit = math.log(certificate_bound(S, itemsize) - 1)
        for delta, expect in zip(_around(limit, dtype), (False, True), strict=True):
            q, k, v, scale = _one_row(S, delta, dtype)
            bad = fixed_shift_failures(q, k, scale)
            assert bad.sum().item() == int(expect) and bad[0, 0, -1].item() == expect
            assert _run(q, k, v, scale=scale)[2] == expect
    q, k, v, _ = _inputs(1, 600, 2, 1, 64, torch.float32, seed=3, scale=6.0)
    bad = fixed_shift_failures(q, k, 0.3)
    assert bad[:, :, 512:].any() and not bad[:, :, :512].any() and _run(q, k, v, scale=0.3)[2]


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 2), S=st.integers(1, 700), Hk=st.integers(1, 2), G=st.integers(1, 4),
       D=st.sampled_from([8, 16, 32, 64, 80, 128]), dtype=st.sampled_from(DTYPES), lnc=st.sampled_from([1, 2]),
       fixed_shift=st.booleans(), scale=st.sampled_from([0.3, 1.0, 3.0]), seed=st.integers(0, 1000))
def test_both_forwards_and_the_backward_random_shapes(B, S, Hk, G, D, dtype, lnc, fixed_shift, scale, seed) -> None:
    """Either forward (the default fixed shift, its fallback included on sharp inputs, or the exact one) and the
    backward at random shapes, by the fp64-oracle rule."""
    q, k, v, go = _inputs(B, S, Hk * G, Hk, D, dtype, seed, scale)
    o, lse = attention(q, k, v, lnc=lnc, fixed_shift=fixed_shift)
    check_attention(q, k, v, o, lse, D ** -0.5, attention_bwd(q, k, v, o, lse, go, lnc=lnc), go)
