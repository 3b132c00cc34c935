"""router_topk / router_topk_bwd: NKI kernels (on trnkit's interpreter) against the fp64-oracle rule
(tests/tolerances.py) and the torch references' selections, and the references vs transformers' Qwen3-MoE
router (forward and autograd)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kernels import oracles as O
from tests.kernels.lnc_streams import assert_same_streams, recorded_streams
from tests.tolerances import F64, check_oracle
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.kernels.router import (constraints, router_topk, router_topk_bwd, router_topk_bwd_ref,
                                   router_topk_ref)
from trnkit.nkisim import trace


def _inputs(T: int, H: int, E: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = (torch.randn(E, H, generator=gen) / H ** 0.5).to(dtype)
    return x, w


def _check_forward(x: torch.Tensor, w: torch.Tensor, K: int, norm: bool) -> tuple:
    wk, ik, lg = router_topk(x, w, K, norm)
    wr, ir, lr = router_topk_ref(x, w, K, norm)
    assert wk.dtype == torch.float32 and ik.dtype == torch.int32 and lg.dtype == torch.float32
    assert wk.shape == ik.shape == (x.shape[0], K) and lg.shape == (x.shape[0], w.shape[0])
    # the tie rule on the kernel's own logits
    assert torch.equal(ik.long(), torch.sort(lg, dim=-1, descending=True, stable=True).indices[:, :K])
    if x.dtype == torch.float32:
        assert torch.equal(ik, ir), (ik, ir)  # random fp32 logits are tie-free: the reference's selection
    else:  # bf16 logits tie often, and one can round to the neighbouring value (another summation order)
        same = (lg == lr).all(dim=-1)
        assert 2 * same.sum() >= len(same), same.float().mean()
        assert torch.equal(ik[same], ir[same]), (ik, ir)
    O.check_all(("logits", "weights"), (lg, wk), lambda dt: O.router_weights(x, w, ik, dt, norm), x.dtype)
    return wk, ik, lg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("T,H,E,K", [
    (130, 256, 16, 8),   # two token tiles (tail of 2), two H blocks
    (1, 128, 8, 1),      # T=1, K=1
    (5, 64, 8, 8),       # K=E, H < 128
    (9, 200, 7, 3),      # prime E < 8 (max8 padding), odd H with a short last block
    (40, 384, 130, 4),   # E > 128: two E chunks of w^T, logits in one PSUM bank
])
def test_forward_matches_ref(T: int, H: int, E: int, K: int, dtype: torch.dtype, norm: bool) -> None:
    x, w = _inputs(T, H, E, dtype)
    _check_forward(x, w, K, norm)


@pytest.mark.parametrize("dtype,T,n_dma_t", [
    (torch.bfloat16, 2050, 1),  # block of 16 rows per partition (chunks of 4) + a 2-token tail
    (torch.bfloat16, 4200, 2),  # 32 rows per partition: sub-tiles 16 and 32 by DMA transpose
    (torch.float32, 2050, 0),   # the DMA transpose moves 2-byte elements only
])
def test_forward_x_transposes_split_between_dma_and_tensor_engine(dtype: torch.dtype, T: int, n_dma_t: int) -> None:
    from trnkit.nkisim import trace

    x, w = _inputs(T, 256, 16, dtype, seed=T)
    with trace.record() as tr:
        _check_forward(x, w, 4, True)
    ops = [i.op for i in tr]
    # one full 128-token sub-tile in every sixteen comes by one hardware-DGE DMA transpose
    assert ops.count("dma_transpose") == n_dma_t
    # the others (and the w^T blocks) by 128x128 Tensor-engine transposes: 2 H blocks per sub-tile
    n_sub = (T // 128) + (T % 128 > 0)
    assert ops.count("nc_transpose") == 2 * (n_sub - n_dma_t) + 2


def test_ties_go_to_lower_expert_index() -> None:
    # experts 1, 3 and 6 share a weight row, so their logits tie exactly for every token
    x, w = _inputs(6, 64, 8, torch.float32, seed=1)
    w[3] = w[1]
    w[6] = w[1]
    x += 10 * w[1] / w[1].square().sum()  # the tied experts lead by ~10: they are the top three
    wk, ik, lg = router_topk(x, w, 4)
    for t in range(6):
        order = sorted(range(8), key=lambda e: (-lg[t, e].item(), e))[:4]
        assert ik[t].tolist() == order, (ik[t], order)
    assert (ik[:, :3] == torch.tensor([1, 3, 6], dtype=torch.int32)).all()
    assert torch.equal(wk[:, 0], wk[:, 1]) and torch.equal(wk[:, 1], wk[:, 2])


@pytest.mark.parametrize("fn", [router_topk, router_topk_ref])
def test_bf16_routes_from_logits_rounded_to_bf16(fn) -> None:
    """bf16 operands: the logits are rounded to bf16 (what ``x @ w.T`` returns in bf16, transformers' and the
    native Qwen3's router logits) before the softmax and the top-K, so experts whose logits are equal in bf16 tie,
    and go to the lower index, even where the fp32-accumulated logits differ."""
    x, w = _inputs(64, 96, 8, torch.bfloat16, seed=21)
    w[0, 5] = 0.5
    w[1] = w[0]
    w[1, 5] = 0.5 + 2 ** -8  # one bf16 step up
    x[:, 5] = x[:, 5].abs() * 2 ** -6  # expert 1's logit exceeds expert 0's by a fraction of a bf16 step
    x += (8 * w[0].float() / w[0].float().square().sum()).to(torch.bfloat16)  # experts 0 and 1 lead
    wk, ik, lg = fn(x, w, 2)
    exact = x.float() @ w.float().T
    assert (exact[:, 1] > exact[:, 0]).all()
    assert torch.equal(lg, exact.to(torch.bfloat16).float())  # the logits are x @ w.T in bf16
    tied = lg[:, 0] == lg[:, 1]
    assert tied.sum() >= 32, tied.sum()  # most tokens: a tie in bf16, not in fp32
    assert (ik[tied] == torch.tensor([0, 1], dtype=torch.int32)).all()  # ties to the lower index
    assert torch.equal(wk[tied, 0], wk[tied, 1])
    assert (ik[~tied] == torch.tensor([1, 0], dtype=torch.int32)).all()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 140), H=st.integers(1, 300), E=st.integers(1, 40), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), norm=st.booleans())
def test_hypothesis_shapes(T, H, E, data, dtype, norm) -> None:
    K = data.draw(st.integers(1, min(8, E)))
    x, w = _inputs(T, H, E, dtype, seed=T * 1000 + H)
    _check_forward(x, w, K, norm)
    if data.draw(st.booleans(), label="return_affinities"):
        _check_affinities(x, w, K, norm)


@pytest.mark.parametrize("norm", [True, False])
def test_ref_matches_transformers_qwen3_moe_router(norm: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=16, num_experts=12, num_experts_per_tok=4,
                         norm_topk_prob=norm)
    block = Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(12, 64, generator=gen) / 8)
    x = torch.randn(21, 64, generator=gen)
    gen = torch.Generator().manual_seed(3)
    g_w, g_l = torch.randn(21, 4, generator=gen), torch.randn(21, 12, generator=gen)

    def hf(dt):  # transformers' router at dtype dt: (logits, weights, grad_x, grad_w) by its autograd
        gate = copy.deepcopy(block.gate).to(dt)
        xl = x.detach().to(dt).requires_grad_(True)
        logits, weights, idx = gate(xl)
        torch.autograd.backward((weights, logits), (g_w.to(dt), g_l.to(dt)))
        return logits.detach(), weights.detach(), idx, xl.grad, gate.weight.grad

    (hf_logits, hf_w, hf_i, hf_gx, hf_gW), (o_logits, o_w, o_i, o_gx, o_gW) = hf(torch.float32), hf(F64)
    assert torch.equal(o_i, hf_i)  # tie-free inputs: fp32 and fp64 choose alike
    for name, fn in (("ref", router_topk_ref), ("kernel", router_topk)):
        w_, i_, l_ = fn(x, block.gate.weight.detach(), 4, norm)
        assert torch.equal(i_.long(), hf_i), name
        check_oracle(f"{name} logits", l_, hf_logits, o_logits)
        check_oracle(f"{name} weights", w_, hf_w, o_w)
    # backward: autograd through HF's router vs the reference and the kernel
    _, i_ref, l_ref = router_topk_ref(x, block.gate.weight.detach(), 4, norm)
    for fn in (router_topk_bwd_ref, router_topk_bwd):
        gx, gW = fn(x, block.gate.weight.detach(), l_ref, i_ref, g_w, g_l, norm)
        check_oracle(f"{fn.__name__} grad_x", gx, hf_gx, o_gx)
        check_oracle(f"{fn.__name__} grad_w", gW, hf_gW, o_gW)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("with_logit_grad", [True, False])
# (grad_w accumulated during phase 1 when E <= 128 and H <= 2048, else in a second pass over a scratch)
@pytest.mark.parametrize("T,H,E,K", [(130, 200, 16, 8), (1, 64, 7, 1), (33, 640, 130, 3), (8, 128, 8, 8),
                                     (9, 2560, 16, 2)])
def test_backward_matches_ref(T, H, E, K, dtype, norm, with_logit_grad) -> None:
    x, w = _inputs(T, H, E, dtype, seed=5)
    _, idx, logits = router_topk_ref(x, w, K, norm)
    gen = torch.Generator().manual_seed(6)
    g_w = torch.randn(T, K, generator=gen)
    g_l = torch.randn(T, E, generator=gen) if with_logit_grad else None
    gx, gw = router_topk_bwd(x, w, logits, idx, g_w, g_l, norm)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    assert gx.shape == x.shape and gw.shape == w.shape
    if K == 1 and norm and g_l is None:  # the weight is 1 whatever x is: the exact gradient is 0
        _check_zero_gradient((gx, gw), lambda dt: O.router_grads(x, w, idx, g_w, None, dt, norm), dtype)
        return
    O.check_all(("grad_x", "grad_w"), (gx, gw), lambda dt: O.router_grads(x, w, idx, g_w, g_l, dt, norm), dtype)


def _check_zero_gradient(got: tuple, torch_grads, dtype: torch.dtype) -> None:
    """An exactly-zero gradient (no relative error exists): the kernel's rounding residue is no larger
    than 1.5x torch's own at the same dtype, plus eps/4 of the largest weight-gradient term."""
    for a, b in zip(got, torch_grads(dtype)):
        assert a.abs().max() <= 1.5 * b.abs().max() + torch.finfo(dtype).eps / 4, (a.abs().max(), b.abs().max())


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_backward_any_ids_permuted_or_repeated(norm: bool, scoring: str) -> None:
    # the gradient is computed on the K given ids (gathered, not re-derived from the logits): ids in any
    # order, not the top-K, or repeated, give autograd's gradient of gather -> renorm (repeats add up)
    x, w = _inputs(140, 128, 12, torch.float32, seed=12)
    logits = x @ w.T
    gen = torch.Generator().manual_seed(13)
    idx = torch.stack([torch.randperm(12, generator=gen)[:4] for _ in range(140)]).to(torch.int32)
    idx[::3, 1] = idx[::3, 0]  # every third token lists one expert twice
    g = torch.randn(140, 4, generator=gen)
    got = router_topk_bwd(x, w, logits, idx, g, None, norm, scoring=scoring)
    O.check_all(("grad_x", "grad_w"), got, lambda dt: O.router_grads(x, w, idx, g, None, dt, norm, scoring),
                torch.float32)


def test_backward_with_int64_indices_from_the_model() -> None:
    x, w = _inputs(10, 64, 9, torch.float32, seed=8)
    _, idx, logits = router_topk_ref(x, w, 2)
    g = torch.randn(10, 2)
    a = router_topk_bwd(x, w, logits, idx.long(), g)
    b = router_topk_bwd(x, w, logits, idx, g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # int64 indices = the int32 ones
    O.check_all(("grad_x", "grad_w"), a, lambda dt: O.router_grads(x, w, idx, g, None, dt), torch.float32)


# --- constraints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("x,w,k,rule", [
    (torch.zeros(4, 8, 2), torch.zeros(4, 8), 2, "x is 2-D [T, H]"),
    (torch.zeros(4, 8), torch.zeros(4), 2, "w_router is 2-D [E, H]"),
    (torch.zeros(4, 8), torch.zeros(4, 9), 2, "w_router.shape[1] == H"),
    (torch.zeros(0, 8), torch.zeros(4, 8), 2, "T, H, E >= 1"),
    (torch.zeros(4, 8), torch.zeros(513, 8), 2, "E <= 512"),
    (torch.zeros(4, 8), torch.zeros(16, 8), 9, "1 <= top_k <= 8"),
    (torch.zeros(4, 8), torch.zeros(16, 8), 0, "1 <= top_k <= 8"),
    (torch.zeros(4, 8), torch.zeros(3, 8), 4, "top_k <= E"),
    (torch.zeros(4, 8), torch.zeros(16, 8), 2.0, "top_k is an int"),
    (torch.zeros(4, 8), torch.zeros(16, 8), True, "top_k is an int"),
    (torch.zeros(4, 8, dtype=torch.float16), torch.zeros(4, 8, dtype=torch.float16), 2, "x.dtype in"),
    (torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16), 2, "w_router.dtype == x.dtype"),
    (torch.zeros(4, 16384), torch.zeros(512, 16384), 2, "SBUF per partition <= 200 KiB"),
])
def test_constraint_violations_raise(x, w, k, rule) -> None:
    with pytest.raises(KernelConstraintError) as ei:
        router_topk(x, w, k)
    msg = str(ei.value)
    assert msg.startswith("router_topk: constraint") and rule in msg and "(got " in msg, msg
    assert any(v.constraint.startswith(rule) for v in constraints(x, w, k))


def test_backward_shape_constraints() -> None:
    x, w = _inputs(4, 16, 6, torch.float32)
    _, idx, logits = router_topk_ref(x, w, 2)
    with pytest.raises(KernelConstraintError, match=r"router_topk_bwd: constraint 'grad_topk_weights.shape"):
        router_topk_bwd(x, w, logits, idx, torch.zeros(4, 3))
    with pytest.raises(KernelConstraintError, match=r"router_topk_bwd: constraint 'router_logits.shape"):
        router_topk_bwd(x, w, logits[:, :5], idx, torch.zeros(4, 2))
    with pytest.raises(KernelConstraintError, match=r"router_topk_bwd: constraint 'topk_idx.shape == \(4, 2\)' "
                                                    r"violated \(got \(3, 2\)\)"):
        router_topk_bwd(x, w, logits, idx[:3], torch.zeros(4, 2))
    with pytest.raises(KernelConstraintError, match=r"router_topk_bwd: constraint 'grad_router_logits.shape"):
        router_topk_bwd(x, w, logits, idx, torch.zeros(4, 2), torch.zeros(4, 7))
    with pytest.raises(KernelConstraintError, match=r"router_topk: constraint '1 <= top_k <= 8' violated \(got 9\)"):
        router_topk_bwd(x, w, logits, torch.zeros(4, 9, dtype=torch.int32), torch.zeros(4, 9))
    assert constraints(x, w, 2) == [] and constraints(x, w, np.int64(2)) == []  # e.g. a K read from a config


def test_lnc2_grid_splits_tokens() -> None:
    from trnkit.kernels.router.router_fwd import router_topk_kernel

    # tokens [0, 2304) and [2304, 4400): each program has a block with a DMA-transposed sub-tile; a tail
    x, w = _inputs(4400, 256, 16, torch.bfloat16, seed=9)
    with recorded_streams() as s:
        got = router_topk_kernel[2](x, w, 4, norm_topk_prob=True)
    assert_same_streams(s)  # [2096, 4400) on program 1: the same chunks, tokens 2096.. computed twice
    tr = s.trace
    assert sorted(i.program_id for i in tr if i.op == "dma_transpose") == [0, 1]
    assert torch.equal(got[1], router_topk_ref(x, w, 4, True)[1])
    for a, b in zip(got, router_topk(x, w, 4, True)):
        assert torch.equal(a, b)  # the programs split the tokens: bit-identical to one program
    O.check_all(("logits", "weights"), (got[2], got[0]), lambda dt: O.router_weights(x, w, got[1], dt), x.dtype)


def test_lnc2_wrapper_runs_both_programs_bit_identical() -> None:
    x, w = _inputs(300, 256, 16, torch.bfloat16, seed=14)
    with trace.record() as tr:
        got = router_topk(x, w, 4, True, lnc=2)
    assert {i.program_id for i in tr} == {0, 1}
    for a, b in zip(got, router_topk(x, w, 4, True, lnc=1)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,E,K,with_logit_grad", [
    (300, 256, 16, 4, True),   # grad_w in phase 1: program 1's first 2 tiles overlap program 0's (masked rows)
    (130, 200, 16, 8, False),  # shares of 128 tokens: tokens 2..127 computed by both
    (5, 64, 7, 2, False),      # T < 128: program 1 computes every token, owns none for grad_w
    (33, 640, 130, 3, True),   # E > 128: grad_w in phase 2, its 640 columns split 320 / 320
    (260, 2561, 16, 2, False), # H > 2048: phase 2, odd H (the halves share column 1280)
])
def test_lnc2_backward_splits_tokens(T, H, E, K, with_logit_grad, dtype) -> None:
    """router_topk_bwd at lnc=2: both programs take the same control flow; grad_x is the one-program result
    bit for bit, grad_w (two fp32 partials summed) meets the fp64-oracle rule."""
    x, w = _inputs(T, H, E, dtype, seed=15)
    _, idx, logits = router_topk_ref(x, w, K, True)
    gen = torch.Generator().manual_seed(16)
    g_w = torch.randn(T, K, generator=gen)
    g_l = torch.randn(T, E, generator=gen) if with_logit_grad else None
    with recorded_streams() as s:
        gx, gw = router_topk_bwd(x, w, logits, idx, g_w, g_l, lnc=2)
    assert_same_streams(s)
    assert {i.program_id for i in s.trace} == {0, 1}
    gx1, gw1 = router_topk_bwd(x, w, logits, idx, g_w, g_l, lnc=1)
    assert torch.equal(gx, gx1)
    O.check_all(("grad_x", "grad_w"), (gx, gw), lambda dt: O.router_grads(x, w, idx, g_w, g_l, dt), dtype)


def test_max_experts_512_forward_and_backward() -> None:
    x, w = _inputs(130, 128, 512, torch.bfloat16, seed=10)
    _, idx, logits = _check_forward(x, w, 8, True)
    g = torch.randn(130, 8, generator=torch.Generator().manual_seed(11))
    gx, gw = router_topk_bwd(x, w, logits, idx, g)
    O.check_all(("grad_x", "grad_w"), (gx, gw), lambda dt: O.router_grads(x, w, idx, g, None, dt), torch.bfloat16)


# --- dense affinities (return_affinities=True) ---------------------------------------------------------


def _check_affinities(x: torch.Tensor, w: torch.Tensor, K: int, norm: bool) -> torch.Tensor:
    out = router_topk(x, w, K, norm, return_affinities=True)
    ref = router_topk_ref(x, w, K, norm, return_affinities=True)
    assert len(out) == len(ref) == 4
    wk, ik, lg, aff = out
    T, E = x.shape[0], w.shape[0]
    assert aff.dtype == torch.float32 and aff.shape == (T, E)
    # the first three outputs are those of the default call
    for a, b in zip(out[:3], router_topk(x, w, K, norm)):
        assert torch.equal(a, b)
    assert torch.equal(ik, ref[1])  # tie-free random inputs: the reference's selection
    dense = lambda dt: torch.zeros(T, E, dtype=dt).scatter_(1, ik.long(), O.router_weights(x, w, ik, dt, norm)[1])  # noqa: E731
    O.check_all(("affinities",), aff, dense, x.dtype)
    # on-chip scatter: each selected column holds exactly the kernel's weight, every other column 0
    assert torch.equal(aff.gather(1, ik.long()), wk)
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ik.long(), True)
    assert torch.equal(aff[~mask], torch.zeros_like(aff[~mask]))
    # the same K positive values plus zeros, summed in another order: within K fp32 ulps of the sum
    torch.testing.assert_close(aff.sum(dim=1), wk.sum(dim=1), rtol=K * torch.finfo(torch.float32).eps, atol=0)
    return aff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("T,H,E,K", [
    (130, 256, 16, 8),   # two token tiles (tail of 2)
    (1, 128, 8, 1),      # T=1, K=1
    (5, 64, 8, 8),       # K=E
    (9, 200, 7, 3),      # prime E < 8 (max8 padding)
    (33, 384, 130, 4),   # E > 128, odd T
    (517, 64, 12, 2),    # two chunks of 2 tokens per partition + a 5-token tail
])
def test_affinities_match_ref(T: int, H: int, E: int, K: int, dtype: torch.dtype, norm: bool) -> None:
    x, w = _inputs(T, H, E, dtype, seed=12)
    _check_affinities(x, w, K, norm)


def test_affinities_max_experts_512() -> None:
    x, w = _inputs(3, 128, 512, torch.bfloat16, seed=13)
    _check_affinities(x, w, 8, True)


@pytest.mark.parametrize("norm", [True, False])
def test_affinities_ref_matches_hand_scatter(norm: bool) -> None:
    # independent oracle: softmax, torch.topk, renormalise, then a per-entry python scatter
    x, w = _inputs(11, 48, 9, torch.float32, seed=14)
    _, _, _, aff = router_topk_ref(x, w, 3, norm, return_affinities=True)

    def hand(dt):
        probs = torch.softmax(x.to(dt) @ w.to(dt).T, dim=-1)
        vals, idx = torch.topk(probs, 3, dim=-1)
        if norm:
            vals = vals / vals.sum(dim=-1, keepdim=True)
        expect = torch.zeros(11, 9, dtype=dt)
        for t in range(11):
            for k in range(3):
                expect[t, int(idx[t, k])] = vals[t, k]
        return expect, vals.sum(dim=1)

    (aff32, sum32), (aff64, sum64) = hand(torch.float32), hand(F64)
    check_oracle("ref affinities", aff, aff32, aff64)
    check_oracle("ref row sums", aff.sum(dim=1), sum32, sum64)
    if norm:  # the sums are 1 up to fp32 rounding of 3 terms
        torch.testing.assert_close(aff.sum(dim=1), torch.ones(11), rtol=0, atol=3 * torch.finfo(torch.float32).eps)
    # the default call is unchanged: three outputs
    assert len(router_topk_ref(x, w, 3, norm)) == 3 and len(router_topk(x, w, 3, norm)) == 3


def test_affinities_follow_the_tie_rule() -> None:
    # experts 1, 3 and 6 tie; with K=2 only the two lower ones (1, 3) get a weight
    x, w = _inputs(6, 64, 8, torch.float32, seed=1)
    w[3] = w[1]
    w[6] = w[1]
    x += 10 * w[1] / w[1].square().sum()
    wk, ik, _, aff = router_topk(x, w, 2, return_affinities=True)
    assert (ik == torch.tensor([1, 3], dtype=torch.int32)).all()
    assert torch.equal(aff[:, 1], wk[:, 0]) and torch.equal(aff[:, 3], wk[:, 1])
    assert (aff[:, 6] == 0).all() and ((aff != 0).sum(dim=1) == 2).all()


def test_affinities_lnc2_grid() -> None:
    from trnkit.kernels.router.router_fwd import router_topk_kernel

    x, w = _inputs(700, 128, 16, torch.bfloat16, seed=15)  # both programs get chunks
    with recorded_streams() as s:
        got = router_topk_kernel[2](x, w, 4, norm_topk_prob=True, return_affinities=True)
    assert_same_streams(s)
    assert len(got) == 4
    assert torch.equal(got[1], router_topk_ref(x, w, 4, True)[1])
    for a, b in zip(got, router_topk(x, w, 4, True, return_affinities=True)):
        assert torch.equal(a, b)  # the programs split the token chunks: bit-identical to one program
    assert torch.equal(got[3].gather(1, got[1].long()), got[0])


def test_affinities_sbuf_constraint() -> None:
    # fits without the affinity tiles, not with them (fp32, E=512: 15 KiB more per partition)
    x, w = torch.zeros(4, 5400), torch.zeros(512, 5400)
    assert constraints(x, w, 8) == []
    v = constraints(x, w, 8, return_affinities=True)
    assert [c.constraint for c in v] == ["SBUF per partition <= 200 KiB"]
    with pytest.raises(KernelConstraintError, match="SBUF per partition <= 200 KiB"):
        router_topk(x, w, 8, return_affinities=True)


def _tie_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """All-equal logits (every expert ties), and logits spread so wide that most probabilities underflow
    to exactly 0 in fp32 while the logits still order the experts."""
    T, H, E = 5, 16, 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g)
    equal = torch.zeros(E, H)  # every logit is 0
    wide = torch.zeros(E, H)
    wide[:, 0] = -200.0 * torch.randperm(E, generator=g).float()  # logits 0, -200 * k: exp underflows
    x_wide = x.clone()
    x_wide[:, 0] = 1.0
    return {"all_equal": (x, equal), "underflow": (x_wide, wide)}


@pytest.mark.parametrize("case", ["all_equal", "underflow"])
def test_tie_rule_agrees_everywhere(case: str) -> None:
    """Reference, kernel, the native model's router and the registry's two impls choose the same experts:
    by logit, ties to the lower index (all-equal logits -> experts 0..K-1)."""
    from trnkit.overrides import ops
    from trnkit.qwen3.model import TopKRouter

    x, w = _tie_cases()[case]
    K = 8
    logits = x @ w.T
    expect = torch.tensor([sorted(range(w.shape[0]), key=lambda e: (-logits[t, e].item(), e))[:K]
                           for t in range(x.shape[0])], dtype=torch.int32)
    if case == "all_equal":
        assert (expect == torch.arange(K, dtype=torch.int32)).all()
    else:
        assert (torch.softmax(logits, -1) == 0).sum(-1).min() >= 8  # underflow really happens
    router = TopKRouter(x.shape[1], w.shape[0], K, True)
    with torch.no_grad():
        router.gate.weight.copy_(w)
    ref, kernel = router_topk_ref(x, w, K), router_topk(x, w, K)
    picks = {"ref": ref[1], "kernel": kernel[1], "native": router(x)[1],
             "registry reference": ops.router_topk(x, w, K, True, "reference")[1],
             "registry nki": ops.router_topk(x, w, K, True, "nki")[1]}
    for name, idx in picks.items():
        assert torch.equal(idx.to(torch.int32), expect), (name, idx, expect)
    O.check_all(("weights",), kernel[0], lambda dt: O.router_weights(x, w, kernel[1], dt)[1], torch.float32)
