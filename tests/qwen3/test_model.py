"""Native Qwen3 modules against independent references: init, RoPE cache, router, grouped experts, aux loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import trnkit.qwen3.model as qm
from trnkit.qwen3 import (FeedForward, GroupedExperts, Qwen3Config, Qwen3Model, RoPEApply, TopKRouter, grouped_mm,
                          model_registry)
from tests.helpers import host_reads
from trnkit.qwen3.checkpoint import load_hf_checkpoint

from .hf_utils import hf_model, tokens


def _meta_init(cfg: Qwen3Config, seed: int = 0) -> Qwen3Model:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


# ----------------------------------------------------------------------------------- structure / init
def test_swap_points_and_layout() -> None:
    model = _meta_init(model_registry("debug-moe", vocab_size=512).config)
    assert isinstance(model.layers[0].feed_forward, FeedForward) and model.layers[0].moe is None
    for i in (1, 2, 3):
        layer = model.layers[i]
        assert layer.feed_forward is None and isinstance(layer.moe.router, TopKRouter)
        assert isinstance(layer.moe.experts, GroupedExperts)
        assert layer.moe.router.gate.weight.shape == (8, 256) and layer.moe.router.gate.bias is None
        assert layer.moe.experts.w_gate_up.shape == (8, 256, 256) and layer.moe.experts.w_down.shape == (8, 128, 256)
    assert all(isinstance(b.attention.rope, RoPEApply) for b in model.layers)
    assert model.rope_cache.shape == (2048, 128) and model.rope_cache.dtype == torch.float32
    assert "rope_cache" not in model.state_dict()


def test_meta_init_materialises_and_reties() -> None:
    cfg = model_registry("debug", n_layers=2, vocab_size=4096).config
    model = _meta_init(cfg)
    assert not any(p.is_meta for p in model.parameters()) and not model.rope_cache.is_meta
    assert model.lm_head.weight is model.tok_embeddings.weight
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    trunc = 0.98658  # std of a normal truncated at +-3 sigma, in units of sigma
    for p, s in [(model.tok_embeddings.weight, std), (model.layers[0].attention.wq.weight, std),
                 (model.layers[1].attention.wo.weight, out_std), (model.layers[1].feed_forward.w2.weight, out_std)]:
        assert abs(p.std().item() / (s * trunc) - 1) < 0.02 and p.abs().max().item() <= 3 * s
        assert abs(p.mean().item()) < 0.05 * s
    assert torch.equal(model.layers[0].attention.q_norm.weight, torch.ones(cfg.head_dim))
    # re-init with the same seed is deterministic
    assert torch.equal(_meta_init(cfg).layers[1].attention.wk.weight, model.layers[1].attention.wk.weight)


def test_trunc_normal_matches_torch_distribution() -> None:
    torch.manual_seed(0)
    ours = qm.trunc_normal_(torch.empty(400_000), 0.5)
    ref = torch.nn.init.trunc_normal_(torch.empty(400_000), std=0.5, a=-1.5, b=1.5)
    assert ours.abs().max() <= 1.5
    qs = torch.tensor([0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99])
    torch.testing.assert_close(torch.quantile(ours, qs), torch.quantile(ref, qs), atol=0.01, rtol=0)


def test_rope_cache_matches_numpy_and_survives_dtype_moves() -> None:
    cfg = model_registry("debug", n_layers=1, vocab_size=512, max_seq_len=64).config
    model = Qwen3Model(cfg)
    D = cfg.head_dim
    inv = 1.0 / (1e6 ** (np.arange(0, D, 2, dtype=np.float64) / D))
    ang = np.arange(64)[:, None] * np.concatenate([inv, inv])[None]
    ref = np.concatenate([np.cos(ang), np.sin(ang)], axis=1)
    np.testing.assert_allclose(model.rope_cache.numpy(), ref, atol=2e-5)  # fp32 angle rounding at pos 63
    model.to(torch.bfloat16)
    assert model.rope_cache.dtype == torch.float32 and model.tok_embeddings.weight.dtype == torch.bfloat16
    np.testing.assert_allclose(model.rope_cache.numpy(), ref, atol=2e-5)
    out = model.eval()(torch.zeros(1, 8, dtype=torch.long))
    assert out.dtype == torch.bfloat16


def test_rope_apply_rotate_half_by_hand() -> None:
    # D=4: pairs (0,2) and (1,3) rotate by angle pos*inv_freq[j]
    q = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    th = torch.tensor([0.3, 0.7])
    emb = torch.cat([th, th])
    cache = torch.cat([emb.cos(), emb.sin()]).view(1, 8)
    rq, rk = RoPEApply()(q, q.clone(), cache)
    c, s = th.cos(), th.sin()
    expect = torch.tensor([1 * c[0] - 3 * s[0], 2 * c[1] - 4 * s[1], 3 * c[0] + 1 * s[0], 4 * c[1] + 2 * s[1]])
    torch.testing.assert_close(rq.flatten(), expect)
    torch.testing.assert_close(rk.flatten(), expect)
    with pytest.raises(ValueError, match=r"RoPEApply: rope_cache must have shape \[S, 2D\] = \[1, 8\]"):
        RoPEApply()(q, q, cache[:, :4])


@pytest.mark.parametrize("flavor", ["0.6B", "debug-moe"])
def test_random_init_loss_near_log_vocab(flavor: str) -> None:
    # The real 0.6B vocab (151936) and width (1024): at init the logit scale is
    # init_std * sqrt(dim) (final RMSNorm output has unit RMS), which is what sets the step-1 loss;
    # depth does not (the final norm rescales the residual stream), so 2 layers keep it cheap.
    cfg = model_registry(flavor, n_layers=2).config
    model = _meta_init(cfg).eval()
    toks = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(toks)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), toks[:, 1:].flatten()).item()
    assert abs(loss - math.log(151936)) < 0.5, loss


# ----------------------------------------------------------------------------------------- router
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_hf_router(norm: bool, dtype: torch.dtype) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from .hf_utils import hf_config

    hc = hf_config("moe-norm")
    hc.norm_topk_prob = norm
    torch.manual_seed(0)
    hf = Qwen3MoeTopKRouter(hc).to(dtype)
    torch.nn.init.normal_(hf.weight)
    ours = TopKRouter(hc.hidden_size, hc.num_experts, hc.num_experts_per_tok, norm).to(dtype)
    ours.gate.weight.data.copy_(hf.weight.data)
    x = torch.randn(50, hc.hidden_size, dtype=dtype)
    ref_logits, ref_w, ref_idx = hf(x)
    w, idx, logits = ours(x)
    assert w.dtype == torch.float32 and logits.dtype == torch.float32 and idx.dtype == torch.int64
    assert torch.equal(idx, ref_idx) and torch.equal(logits, ref_logits.float())
    assert torch.equal(w.to(dtype), ref_w)  # HF casts the routing weights to the activation dtype
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(50))


def test_router_ties_go_to_lower_index() -> None:
    r = TopKRouter(4, 6, 3, norm_topk_prob=True)
    r.gate.weight.data.zero_()
    w, idx, _ = r(torch.randn(5, 4))
    assert torch.equal(idx, torch.tensor([[0, 1, 2]] * 5)) and torch.allclose(w, torch.full((5, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"TopKRouter: x must be \[T, 4\], got \(2, 5, 4\)"):
        r(torch.randn(2, 5, 4))


# ---------------------------------------------------------------------------------- grouped experts
def _experts_ref(x, idx, w, w_gate_up, w_down):
    """Independent reference: every (token, slot) pair through its expert with plain matmuls."""
    inter = w_down.shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            h = x[t] @ w_gate_up[e]
            out[t] = out[t] + w[t, k].to(x.dtype) * ((F.silu(h[:inter]) * h[inter:]) @ w_down[e])
    return out


def _routing(case: str, T: int, E: int, K: int, g: torch.Generator):
    if case == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    elif case == "one-expert":   # every token's first choice is expert E-1 (with K=1: the only one used)
        idx = torch.stack([torch.cat([torch.tensor([E - 1]), torch.randperm(E - 1, generator=g)[:K - 1]])
                           for _ in range(T)])
    elif case == "empty-experts":  # only experts 0 and 2 used
        idx = torch.tensor([[0, 2] if t % 2 else [2, 0] for t in range(T)])[:, :K]
    else:
        raise ValueError(case)
    w = torch.rand(T, K, generator=g)
    return idx, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("case,E,K", [("random", 6, 2), ("random", 4, 1), ("random", 4, 4), ("one-expert", 5, 2),
                                      ("one-expert", 5, 1), ("empty-experts", 5, 2)])
@pytest.mark.parametrize("H", [32, 30])  # H=30 (fp32): strides not 16-byte aligned -> padded-bmm path
def test_grouped_experts_forward_backward(case: str, E: int, K: int, H: int) -> None:
    g = torch.Generator().manual_seed(0)
    T, inter = 13, 8
    ex = GroupedExperts(H, inter, E)
    with torch.no_grad():
        ex.w_gate_up.copy_(torch.randn(E, H, 2 * inter, generator=g) * 0.3)
        ex.w_down.copy_(torch.randn(E, inter, H, generator=g) * 0.3)
    idx, w = _routing(case, T, E, K, g)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    w.requires_grad_(True)
    with host_reads() as r:
        y = ex(x, idx, w)
    assert r.reads == ["tolist"]  # one host read per call: the id range and the largest expert, together
    ref_params = [ex.w_gate_up.detach().clone().requires_grad_(), ex.w_down.detach().clone().requires_grad_()]
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _experts_ref(xr, idx, wr, *ref_params)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    with host_reads() as r:
        y.sum().backward()  # an expanded (zero-stride) grad, which CPU _grouped_mm's backward rejects alone
    assert r.reads == []
    ref.sum().backward()
    for a, b in [(x.grad, xr.grad), (w.grad, wr.grad), (ex.w_gate_up.grad, ref_params[0].grad),
                 (ex.w_down.grad, ref_params[1].grad)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_rows_per_token(K: int, dtype: torch.dtype) -> None:
    """The experts' combine: each token's sum of its K expert-sorted rows. Against a float64 sum by hand
    (rounded once to the rows' dtype), bitwise against the slot-order ``view(T, K, H).sum(1)`` of the
    un-sorted rows for K <= 2 (two additions commute), and its gradient: each row gets its token's."""
    g = torch.Generator().manual_seed(0)
    T, H = 37, 24
    order = torch.argsort(torch.randint(0, 5, (T * K,), generator=g), stable=True)  # rows sorted by expert
    rows = (torch.randn(T * K, H, generator=g) * 3).to(dtype).requires_grad_()
    out = qm.sum_rows_per_token(rows, order // K, T)
    assert out.dtype == dtype
    by_hand = torch.zeros(T, H, dtype=torch.float64)
    for j in range(T * K):
        by_hand[order[j] // K] += rows[j].double()
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # K = 4 sums in another order; bf16 rounds once at the end
    torch.testing.assert_close(out.double(), by_hand.to(dtype).double(), rtol=tol, atol=tol)
    if K <= 2:
        slot_order = torch.empty_like(rows).index_copy(0, order, rows).view(T, K, H).sum(1)
        assert torch.equal(out, slot_order)
    grad = torch.randn(T, H, generator=g).to(dtype)
    (row_grad,) = torch.autograd.grad(out, rows, grad)
    assert torch.equal(row_grad, grad[order // K])


def test_grouped_mm_both_paths_agree() -> None:
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 3, 10, 16], dtype=torch.int32)  # group 1 empty
    for K, N in [(8, 12), (6, 5)]:  # aligned -> torch._grouped_mm, unaligned -> padded bmm
        x, w = torch.randn(16, K, generator=g), torch.randn(4, K, N, generator=g)
        ref = torch.cat([x[0:3] @ w[0], x[3:10] @ w[2], x[10:16] @ w[3]])
        torch.testing.assert_close(grouped_mm(x, w, offs), ref)


# ---------------------------------------------------------------------------------------- aux loss
@pytest.mark.parametrize("name", ["moe-norm", "moe-mlp-only"])
def test_aux_loss_matches_hf(name: str, tmp_path) -> None:
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path).train()
    toks = tokens(hf.config.vocab_size, seed=11)
    ref = hf.train()(toks, output_router_logits=True)
    model(toks)
    coef = hf.config.router_aux_loss_coef
    assert model.config.router_aux_loss_coef == coef == 0.001
    torch.testing.assert_close(model.aux_loss, coef * ref.aux_loss, rtol=1e-5, atol=0)
    # differentiable through the router probabilities (counts are not)
    model.aux_loss.backward()
    assert model.layers[0].moe.router.gate.weight.grad.abs().sum() > 0
    model.eval()(toks)
    assert model.aux_loss is None


def test_aux_loss_none_without_coef_or_moe() -> None:
    toks = torch.randint(0, 64, (1, 8))
    base = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, vocab_size=64, hidden_dim=48,
                max_seq_len=16, num_experts=4, top_k=2, moe_inter_dim=16)
    for cfg in [Qwen3Config(**base, router_aux_loss_coef=0.0), Qwen3Config(**{**base, "num_experts": 0})]:
        model = _meta_init(cfg).train()
        model(toks)
        assert model.aux_loss is None


# ------------------------------------------------------------------------------------- bad input
def test_forward_input_errors() -> None:
    model = _meta_init(Qwen3Config(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, vocab_size=64,
                                   hidden_dim=48, max_seq_len=16))
    with pytest.raises(ValueError, match=r"tokens must be \[B, S\], got shape \(8,\)"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_grouped_experts_input_errors() -> None:
    ex = GroupedExperts(8, 4, 3)
    x, idx, w = torch.randn(5, 8), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)
    with pytest.raises(ValueError, match=r"GroupedExperts: expected x \[T, 8\].*got \(5, 6\)"):
        ex(torch.randn(5, 6), idx, w)
    with pytest.raises(ValueError, match=r"got \(5, 8\), \(5, 2\), \(5, 3\)"):
        ex(x, idx, torch.ones(5, 3))
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 3\), got \[0, 3\]"):
        ex(x, idx.index_fill(0, torch.tensor([2]), 3), w)


@pytest.mark.parametrize("name", ["dense-tied-gqa2", "moe-norm"])
def test_bf16_error_no_worse_than_hf_bf16(name: str, tmp_path) -> None:
    """bf16 trnkit vs the fp32 reference deviates no more than transformers' own bf16 run does
    (same casts as HF; only accumulation order differs, so an exact bf16 match is not expected)."""
    hf = hf_model(name, attn="sdpa")
    hf.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16).eval()
    toks = tokens(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(toks).logits
        hf_err = (hf.to(torch.bfloat16)(toks).logits.float() - ref).abs().max().item()
        our_err = (model(toks).float() - ref).abs().max().item()
    assert 0 < hf_err < 0.05 * ref.abs().max().item()
    assert our_err <= 1.5 * hf_err + 1e-3, (our_err, hf_err)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_compile_matches_eager(dtype: torch.dtype) -> None:
    """Traceable by torch.compile (aot_eager: no C++ toolchain needed); fp32 grouped matmuls run
    eagerly inside the graph because the traced _grouped_mm accepts only bf16."""
    cfg = model_registry("debug-moe", vocab_size=512, n_layers=2).config
    model = _meta_init(cfg).to(dtype).train()
    toks = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = model(toks)
    ref.float().square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = torch.compile(model, backend="aot_eager")(toks)
    out.float().square().mean().backward()
    assert torch.equal(out, ref)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
