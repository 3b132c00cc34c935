"""Fused linear cross-entropy kernels: fp64-oracle parity of the loss, the log-sum-exp and both gradients
(fp32 and bf16; odd T, H and V, partial tiles, ignored tokens, mean and sum), agreement with the torch
reference, LNC=2 bit-identical to one program, no [T, V] tensor in HBM, constraints. Slow tier: a
Qwen3 vocabulary.

The oracle is ``torch.nn.functional.cross_entropy(hidden @ weight.T, labels)`` with autograd, run at the
test dtype (torch's own result) and in float64 (tests/tolerances.py)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.oracles import leaves
from tests.tolerances import F64, check_oracle
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.kernels.cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_bwd,
    linear_cross_entropy_bwd_ref,
    linear_cross_entropy_constraints,
    linear_cross_entropy_fwd_bwd,
    linear_cross_entropy_fwd_bwd_ref,
    linear_cross_entropy_ref,
)
from trnkit.kernels.cross_entropy.cross_entropy_fused import plan
from trnkit.nkisim import trace

DTYPES = [torch.float32, torch.bfloat16]
IGNORE = -100


def _inputs(T: int, H: int, V: int, dtype: torch.dtype, seed: int = 0, n_ignored: int = 1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H ** 0.5 * 2).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.randperm(T, generator=g)[:min(n_ignored, T - 1)]] = IGNORE
    return h, w, labels


def _torch_ce(h, w, labels, dt, reduction):
    """``F.cross_entropy(h @ w.T)`` at dtype ``dt`` (fp64: the oracle), with its gradients."""
    hl, wl = leaves([h, w], dt)
    loss = F.cross_entropy(hl @ wl.T, labels, ignore_index=IGNORE, reduction=reduction)
    grads = torch.autograd.grad(loss, (hl, wl))
    return loss.detach(), grads


def _lse_allowances(h, w, labels, lse, reduction, oracle_loss, oracle_grads) -> tuple[float, float, float]:
    """Derived bounds of the errors the design adds beyond torch's (docs/kernels.md, "Numerics"), as relative
    Frobenius norms over the oracle's loss, grad_hidden and grad_weight. The loss (``lse - z_y``) and each
    probability (``exp(z - lse)``, formed on its own: they need not sum to one as torch's normalised softmax does)
    come from the kernel's fp32 ``lse`` and logits, so a token's terms carry its ``lse`` error ``d_i`` (measured
    against the fp64 one) and each logit's, ``dz_ij <= u |z_ij| + gamma_H sum_k |h_ik w_jk|`` (an fp32 dot product of
    H terms in any order; u = 2^-24, gamma_H = H u / (1 - H u)): the loss ``s sum_i (d_i + dz_iy)``, every
    probability relatively ``e_ij = d_i + dz_ij + 2u`` (and its exp), so grad_hidden ``s sum_j p_ij e_ij |w_jk|``
    and grad_weight ``s sum_i p_ij e_ij |h_ik|`` (``s``: 1 / tokens counted under ``mean``, 1 under ``sum``;
    ignored tokens none). Where torch's error sits far below these (one near-certain token: ``p_y - 1`` cancels
    to a few ulps of the other probabilities) the kernel may sit above it, within them."""
    h64, w64 = h.to(F64), w.to(F64)
    z = h64 @ w64.T
    u = 2.0 ** -24
    gamma = h.shape[1] * u / (1 - h.shape[1] * u)
    dz = u * z.abs() + gamma * (h64.abs() @ w64.abs().T)
    d = (lse.to(F64) - torch.logsumexp(z, -1)).abs()
    valid = (labels != IGNORE).to(F64)
    counted = valid / max(float(valid.sum()), 1.0) if reduction == "mean" else valid
    weights = torch.softmax(z, -1) * (d[:, None] + dz + 2 * u) * counted[:, None]
    loss_bound = ((d + dz.gather(1, labels.clamp(min=0)[:, None])[:, 0]) * counted).sum()

    def rel(bound: torch.Tensor, oracle: torch.Tensor) -> float:
        return float(torch.linalg.norm(bound)) / max(float(torch.linalg.norm(oracle)), 1e-300)

    return (rel(loss_bound.reshape(1), oracle_loss.reshape(1)), rel(weights @ w64.abs(), oracle_grads[0]),
            rel(weights.T @ h64.abs(), oracle_grads[1]))


def ce_case(T: int, H: int, V: int, dtype: torch.dtype, reduction: str = "mean", lnc: int = 1, seed: int = 0,
            n_ignored: int = 1) -> None:
    h, w, labels = _inputs(T, H, V, dtype, seed, n_ignored)
    loss, lse = linear_cross_entropy(h, w, labels, IGNORE, reduction, lnc=lnc)
    base_loss, base_g = _torch_ce(h, w, labels, dtype, reduction)
    orc_loss, orc_g = _torch_ce(h, w, labels, F64, reduction)
    extra = _lse_allowances(h, w, labels, lse, reduction, orc_loss, orc_g)
    check_oracle("lce loss", loss.reshape(1), base_loss.reshape(1), orc_loss.reshape(1), extra[0])
    check_oracle("lce lse", lse, torch.logsumexp(h.float() @ w.float().T, -1),
                 torch.logsumexp(h.to(F64) @ w.to(F64).T, -1))
    gh, gw = linear_cross_entropy_bwd(h, w, labels, lse, 1.0, IGNORE, reduction, lnc=lnc)
    assert gh.dtype == h.dtype and gw.dtype == w.dtype and gh.shape == h.shape and gw.shape == w.shape
    check_oracle("lce grad_hidden", gh, base_g[0], orc_g[0], extra[1])
    check_oracle("lce grad_weight", gw, base_g[1], orc_g[1], extra[2])


FAST = [(1, 8, 5), (5, 16, 40), (130, 200, 700), (64, 96, 515), (200, 130, 1030)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FAST)
def test_oracle_fast(shape, dtype):
    ce_case(*shape, dtype)


def test_grad_weight_token_chunks():
    """More tokens than one chunk of the backward (fp32 at H=2048: 2 tiles of 128), so the chunks' PSUM sums
    meet in grad_weight's fp32 SBUF accumulator; V=130 is one vocabulary group with a 2-row tile, which the
    second program computes masked (its grad_hidden partial all zero)."""
    ce_case(1100, 2048, 130, torch.float32, lnc=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_hidden_partials_over_many_groups(dtype):
    """Five vocabulary groups at LNC=2 (the fifth, 276 rows, masked on the second program): each program's
    grad_hidden partial is written by its first group and added to by the rest, in token chunks."""
    ce_case(700, 320, 2324, dtype, lnc=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_reduction_and_many_ignored(dtype):
    ce_case(150, 64, 300, dtype, reduction="sum", n_ignored=40)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_reference_and_its_rounding(dtype):
    h, w, labels = _inputs(130, 72, 600, dtype, seed=3, n_ignored=5)
    loss, lse = linear_cross_entropy(h, w, labels, IGNORE)
    rloss, rlse = linear_cross_entropy_ref(h, w, labels, IGNORE)
    torch.testing.assert_close(loss, rloss, rtol=2e-6, atol=0)
    torch.testing.assert_close(lse, rlse, rtol=2e-6, atol=2e-6)
    gh, gw = linear_cross_entropy_bwd(h, w, labels, lse, 0.5, IGNORE)
    rgh, rgw = linear_cross_entropy_bwd_ref(h, w, labels, rlse, 0.5, IGNORE)
    # the same rounding points (dl rounded to the operands' dtype); fp32 sums in another order
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gh.float(), rgh.float(), rtol=tol, atol=tol * float(rgh.abs().max()))
    torch.testing.assert_close(gw.float(), rgw.float(), rtol=tol, atol=tol * float(rgw.abs().max()))
    # ignored tokens get no gradient
    assert torch.all(gh[labels == IGNORE] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, V", [(300, 700), (129, 260), (1, 9), (200, 1900)])
def test_lnc2_bit_identical_to_one_program(T, V, dtype):
    """The loss, lse and grad_weight bit for bit; grad_hidden too up to two vocabulary groups (one per
    program: the host's sum of the two partials is the one program's sum). With more groups each program
    sums its own groups first, so the fp32 sum runs in another order: equal to fp32 rounding."""
    h, w, labels = _inputs(T, 48, V, dtype, seed=5)
    one = linear_cross_entropy(h, w, labels, lnc=1)
    two = linear_cross_entropy(h, w, labels, lnc=2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    g1 = linear_cross_entropy_bwd(h, w, labels, one[1], lnc=1)
    g2 = linear_cross_entropy_bwd(h, w, labels, one[1], lnc=2)
    assert torch.equal(g1[1], g2[1])
    if V <= 2 * 512:
        assert torch.equal(g1[0], g2[0])
    else:  # fp32 sums in another order (to ~1e-6 of the largest term), then one rounding to the dtype
        a, b = g1[0].float(), g2[0].float()
        bound = torch.finfo(g1[0].dtype).eps * a.abs() + 1e-6 * float(a.abs().max())
        assert torch.all((a - b).abs() <= bound) and not torch.equal(a, torch.zeros_like(a))


def test_no_logits_tensor_in_hbm():
    T, H, V = 256, 64, 1100
    h, w, labels = _inputs(T, H, V, torch.bfloat16)
    with trace.record() as tr:
        _, lse = linear_cross_entropy(h, w, labels)
        linear_cross_entropy_bwd(h, w, labels, lse)
    hbm = {op.nbytes for i in tr for op in i.operands if op.buffer in ("hbm", "shared_hbm", "private_hbm")}
    # the largest HBM operand any instruction touches is a parameter or gradient, never T x V
    assert max(hbm) < T * V * 2 and (T * V * 4) not in hbm
    psum_tiles = {op.shape for i in tr if i.op == "nc_matmul" for op in i.operands if op.role == "dst"}
    assert all(s[0] <= 128 and s[-1] <= 512 for s in psum_tiles)


def test_labels_out_of_range_and_constraints():
    h, w, labels = _inputs(4, 8, 10, torch.float32)
    labels[2] = 10
    with pytest.raises(KernelConstraintError, match=r"linear_cross_entropy: constraint '0 <= label < V = 10 or "
                                                    r"label == ignore_index \(-100\)' violated \(got 10\)"):
        linear_cross_entropy(h, w, labels)
    rules = [v.constraint for v in linear_cross_entropy_constraints(torch.empty(4, 3073), torch.empty(9, 3073),
                                                              torch.empty(4, dtype=torch.long))]
    assert rules == ["H <= 3072"]
    bad = linear_cross_entropy_constraints(torch.empty(4, 8), torch.empty(9, 8, dtype=torch.bfloat16),
                                           torch.empty(4), reduction="max")
    assert [v.constraint for v in bad] == ["weight.dtype == hidden.dtype", "labels is an integer tensor",
                                     "reduction in ('mean', 'sum')"]
    with pytest.raises(KernelConstraintError, match="lse is"):
        linear_cross_entropy_bwd(h, w, torch.zeros(4, dtype=torch.long), torch.zeros(3))


def fused_case(T: int, H: int, V: int, dtype: torch.dtype, reduction: str = "mean", lnc: int = 1, seed: int = 0,
               n_ignored: int = 1) -> None:
    """The one-pass kernel: loss, lse and both gradients (fp32, at a loss gradient of 1) by the fp64-oracle
    rule, the gradients compared after rounding to the inputs' dtype as the op's backward rounds them."""
    h, w, labels = _inputs(T, H, V, dtype, seed, n_ignored)
    loss, lse, gh, gw = linear_cross_entropy_fwd_bwd(h, w, labels, IGNORE, reduction, lnc=lnc)
    assert gh.dtype == gw.dtype == torch.float32 and gh.shape == h.shape and gw.shape == w.shape
    base_loss, base_g = _torch_ce(h, w, labels, dtype, reduction)
    orc_loss, orc_g = _torch_ce(h, w, labels, F64, reduction)
    extra = _lse_allowances(h, w, labels, lse, reduction, orc_loss, orc_g)
    check_oracle("lce fused loss", loss.reshape(1), base_loss.reshape(1), orc_loss.reshape(1), extra[0])
    check_oracle("lce fused lse", lse, torch.logsumexp(h.float() @ w.float().T, -1),
                 torch.logsumexp(h.to(F64) @ w.to(F64).T, -1))
    check_oracle("lce fused grad_hidden", gh.to(dtype), base_g[0], orc_g[0], extra[1])
    check_oracle("lce fused grad_weight", gw.to(dtype), base_g[1], orc_g[1], extra[2])


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FAST)
def test_fused_oracle_fast(shape, dtype, lnc):
    fused_case(*shape, dtype, lnc=lnc)


@pytest.mark.parametrize("T, H, V, lnc, want", [
    (1100, 2048, 130, 2, (5, 1)),  # two groups (640 + 460 tokens); one vocabulary tile, masked on program 1
    (1100, 2560, 600, 1, (7, 2)),  # two groups (896 + 204 tokens), pass B over two column pieces of H
    (300, 3072, 1030, 2, (3, 2)),  # pieces at LNC=2; the 6-row third tile masked on program 1
])
def test_fused_groups_pieces_and_masked_tiles(T, H, V, lnc, want):
    """Token groups after the first add into grad_weight in HBM; pass B's column pieces; a vocabulary tile
    another program computes again (its sum, dl and grad_weight kept out)."""
    assert plan(T, H, V, 4, lnc) == want
    fused_case(T, H, V, torch.float32, lnc=lnc)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_label_terms_at_tile_edges_and_shared_labels(dtype, lnc):
    """The label part of the gradient (``-scale`` at each token's label): labels at both ends of each
    vocabulary tile (0, 511, 512, 1023, 1024 and V - 1 in the short last tile; at LNC=2 on program 0 or 1,
    program 1 computing the last tile again masked), many tokens sharing a label, ignored tokens in between;
    against the fp64 oracle, and the labels' grad_weight rows (where a missing or doubled label term is off
    by the tokens' summed scale) against it directly."""
    T, H, V = 260, 64, 1100
    h, w, _ = _inputs(T, H, V, dtype)
    edges = torch.tensor([0, 511, 512, 1023, 1024, V - 1, 7, 7, IGNORE, 7])
    labels = edges.repeat(T // len(edges))
    loss, lse, gh, gw = linear_cross_entropy_fwd_bwd(h, w, labels, IGNORE, lnc=lnc)
    base_loss, base_g = _torch_ce(h, w, labels, dtype, "mean")
    orc_loss, orc_g = _torch_ce(h, w, labels, F64, "mean")
    check_oracle("lce fused edges loss", loss.reshape(1), base_loss.reshape(1), orc_loss.reshape(1))
    check_oracle("lce fused edges grad_hidden", gh.to(dtype), base_g[0], orc_g[0])
    check_oracle("lce fused edges grad_weight", gw.to(dtype), base_g[1], orc_g[1])
    rows = edges[edges != IGNORE].unique()
    torch.testing.assert_close(gw[rows].double(), orc_g[1][rows], rtol=0.02, atol=1e-3 * float(orc_g[1].abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_sum_reduction_and_many_ignored(dtype):
    fused_case(150, 64, 300, dtype, reduction="sum", n_ignored=40)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_matches_its_reference(dtype):
    """Against ``linear_cross_entropy_fwd_bwd_ref`` (dl rounded once to the dtype): the kernel rounds ``e`` to
    the dtype as well (its HBM scratch), so bf16 agrees to about one bf16 rounding of dl."""
    h, w, labels = _inputs(130, 72, 600, dtype, seed=3, n_ignored=5)
    loss, lse, gh, gw = linear_cross_entropy_fwd_bwd(h, w, labels, IGNORE)
    rloss, rlse, rgh, rgw = linear_cross_entropy_fwd_bwd_ref(h, w, labels, IGNORE)
    torch.testing.assert_close(loss, rloss, rtol=2e-6, atol=0)
    torch.testing.assert_close(lse, rlse, rtol=2e-6, atol=2e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gh, rgh, rtol=tol, atol=tol * float(rgh.abs().max()))
    torch.testing.assert_close(gw, rgw, rtol=tol, atol=tol * float(rgw.abs().max()))
    assert torch.all(gh[labels == IGNORE] == 0)


def test_fused_next_group_operands_fit_beside_the_last_pass_b_step(monkeypatch):
    """fp32 H = 3072 over several token groups: pass B's last step loads the next group's hT columns and first
    wT tile (24 x (gw + 512) fp32 per partition) beside its own h rows, grad_hidden columns, dl and weight rows.
    The plan sized the groups for pass B alone (7 tiles, 2 pieces: 241,800 bytes live, over SBUF); it now counts
    that step (6 tiles, 3 pieces). bf16 and narrower H keep their plans."""
    import trnkit.kernels.cross_entropy.cross_entropy_fused as fused
    from trnkit.nkisim.errors import NkiValidationError

    assert plan(2100, 3072, 600, 4, 1) == (6, 3)
    assert plan(2100, 2560, 600, 4, 1) == (7, 2) and plan(8192, 2560, 151936, 2, 2) == (8, 2)
    h, w, labels = _inputs(2100, 3072, 600, torch.float32)
    with trace.record(trace_only=True):  # fits (the values: the slow test below)
        linear_cross_entropy_fwd_bwd(h, w, labels)
    monkeypatch.setattr(fused, "_last_step_bytes", lambda *_: 0)  # the plan without the last step
    assert fused.plan(2100, 3072, 600, 4, 1) == (7, 2)
    with pytest.raises(NkiValidationError, match="SBUF overflow"), trace.record(trace_only=True):
        linear_cross_entropy_fwd_bwd(h, w, labels)


@pytest.mark.slow
def test_fused_oracle_several_groups_of_fp32_h3072():
    """The plan of the test above (6 token tiles, 3 pieces of H) by the fp64-oracle rule."""
    fused_case(2100, 3072, 600, torch.float32)


def test_fused_hbm_holds_one_group_of_exp_values(monkeypatch):
    """No [T, V] tensor: the largest HBM tensor the one-pass kernel allocates is its exp scratch of one token
    group (1,024 tokens x V rounded up to 512-column tiles, in the operands' dtype), a third of T x V here;
    no operand any instruction touches is T x V either."""
    from trnkit.nki_api import nl

    T, H, V = 3000, 64, 1100
    h, w, labels = _inputs(T, H, V, torch.bfloat16)
    sizes = []
    real = nl.ndarray

    def ndarray(shape, dtype, buffer=None, **kw):
        if buffer is not None and "hbm" in str(getattr(buffer, "name", buffer)):
            n = 1
            for d in shape:
                n *= d
            sizes.append((tuple(shape), n))
        return real(shape, dtype=dtype, buffer=buffer, **kw)

    monkeypatch.setattr(nl, "ndarray", ndarray)
    with trace.record() as tr:
        linear_cross_entropy_fwd_bwd(h, w, labels)
    biggest = max(n for _, n in sizes)
    assert biggest == 1024 * 1536 < T * V
    assert sorted(sizes, key=lambda s: -s[1])[0][0] == (1, 3, 128, 8, 512)  # [programs, tiles, 128, 8, 512]
    hbm = {op.nbytes for i in tr for op in i.operands if op.buffer in ("hbm", "shared_hbm", "private_hbm")}
    assert max(hbm) < T * V * 2


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_oracle_qwen3_vocabulary(dtype):
    ce_case(256, 256, 151936, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_oracle_qwen3_vocabulary(dtype):
    fused_case(256, 256, 151936, dtype, lnc=2)


@settings(max_examples=20, deadline=None)
# a draw that failed the rule before the derived lse allowance (grad_hidden 2.1 x torch's error: p_1 - 1 near 0)
@example(T=1, H=104, V=2, dtype=torch.float32, reduction="mean", lnc=1, fused=False, n_ignored=0, seed=0)
@given(T=st.integers(1, 300), H=st.integers(1, 300), V=st.integers(2, 2100), dtype=st.sampled_from(DTYPES),
       reduction=st.sampled_from(["mean", "sum"]), lnc=st.sampled_from([1, 2]), fused=st.booleans(),
       n_ignored=st.integers(0, 3), seed=st.integers(0, 1000))
def test_oracle_random_shapes(T, H, V, dtype, reduction, lnc, fused, n_ignored, seed):
    """Both schedules at random shapes. V >= 2: with one class every loss is 0 in torch exactly and a few ulps of the
    logit here (docs/kernels.md, "Numerics"), which a rule relative to torch's error cannot weigh."""
    (fused_case if fused else ce_case)(T, H, V, dtype, reduction, lnc, seed, n_ignored)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_label_ignored_gives_torchs_loss_and_zero_gradients(reduction: str) -> None:
    """torch's cross-entropy over all-ignored labels: the mean is 0 / 0 (NaN), the sum 0, and the gradients are 0
    either way; the kernels and the references gave NaN gradients for the mean."""
    h, w, _ = _inputs(5, 8, 12, torch.float32)
    labels = torch.full((5,), -100)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.cross_entropy(hh @ ww.T, labels, reduction=reduction)
    want.backward()
    assert hh.grad is not None and not hh.grad.any() and not ww.grad.any()  # torch: zero gradients
    for fwd, bwd in ((linear_cross_entropy, linear_cross_entropy_bwd),
                     (linear_cross_entropy_ref, linear_cross_entropy_bwd_ref)):
        loss, lse = fwd(h, w, labels, reduction=reduction)
        torch.testing.assert_close(loss, want.detach(), equal_nan=True)
        gh, gw = bwd(h, w, labels, lse, 1.0, reduction=reduction)
        assert torch.equal(gh, torch.zeros_like(h)) and torch.equal(gw, torch.zeros_like(w)), fwd.__name__
    for fused in (linear_cross_entropy_fwd_bwd, linear_cross_entropy_fwd_bwd_ref):
        loss, _, gh, gw = fused(h, w, labels, reduction=reduction)
        torch.testing.assert_close(loss, want.detach(), equal_nan=True)
        assert not gh.any() and not gw.any() and gh.isfinite().all(), fused.__name__


def test_references_refuse_a_reduction_the_kernels_do_not_have() -> None:
    h, w, labels = _inputs(4, 8, 10, torch.float32)
    with pytest.raises(KernelConstraintError, match=r"^linear_cross_entropy_ref: constraint "
                                                    r"'reduction in \('mean', 'sum'\)' violated \(got 'none'\)$"):
        linear_cross_entropy_ref(h, w, labels, reduction="none")  # it returned the sum
    _, lse = linear_cross_entropy_ref(h, w, labels)
    with pytest.raises(KernelConstraintError, match="linear_cross_entropy_bwd_ref: constraint 'reduction in"):
        linear_cross_entropy_bwd_ref(h, w, labels, lse, 1.0, reduction="none")
    with pytest.raises(KernelConstraintError, match="linear_cross_entropy_ref: constraint 'reduction in"):
        linear_cross_entropy_fwd_bwd_ref(h, w, labels, reduction="none")
