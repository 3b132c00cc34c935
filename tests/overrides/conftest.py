"""Fixtures for the override tests."""

from __future__ import annotations

import pytest
import torch

from tests.overrides import _refs
from trnkit.kernels.constraints import Violation
from trnkit.overrides import get_impl, register, reset_warnings, unregister


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_warnings()  # every test sees its own first fallback warning
    yield


@pytest.fixture(scope="session")
def testref():
    """Registers the independent references of _refs.py as impl 'testref' of the three ops."""

    def router_bwd(x, w, logits, idx, g_w, g_logits, norm):
        _, vjp = torch.func.vjp(lambda a, b: tuple(_refs.router(a, b, idx.shape[1], norm)[i] for i in (0, 2)), x, w)
        return vjp((g_w, g_logits))

    def gmm_bwd(x, w, offs, g):
        return torch.func.vjp(lambda a, b: _refs.grouped_mm(a, b, offs), x, w)[1](g)

    def moe(x, idx, tw, wgu, wd, block_size=128):
        return _refs.moe_experts(x, idx, tw, wgu, wd)

    def moe_bwd(x, idx, tw, wgu, wd, g, block_size=128):
        return torch.func.vjp(lambda a, b, c, d: _refs.moe_experts(a, idx, b, c, d), x, tw, wgu, wd)[1](g)

    register("router_topk", "testref", _refs.router, backward=router_bwd)
    register("grouped_mm", "testref", _refs.grouped_mm, backward=gmm_bwd)
    register("moe_experts", "testref", moe, backward=moe_bwd)
    yield "testref"
    for op in ("router_topk", "grouped_mm", "moe_experts"):
        unregister(op, "testref")


def native_model(seed: int = 0, **overrides):
    """A tiny native Qwen3-MoE (2 layers: one MoE, one dense) in fp32."""
    from trnkit.qwen3.config import Qwen3Config
    from trnkit.qwen3.model import Qwen3Model

    kw = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=64, hidden_dim=48,
              max_seq_len=16, num_experts=4, top_k=2, moe_inter_dim=16, mlp_only_layers=[1])
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3Model(Qwen3Config(**kw))
    model.init_weights()
    return model


def hf_moe_model(seed: int = 0, **overrides):
    """A tiny transformers v5 Qwen3MoeForCausalLM (2 MoE layers) in fp32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
              num_experts_per_tok=2, max_position_embeddings=16, norm_topk_prob=True)
    kw.update(overrides)
    torch.manual_seed(seed)
    # transformers initialises the router to zeros: spread the weights to make routing non-trivial
    return spread_weights(Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)))


def hf_dense_model(seed: int = 0, **overrides):
    """A tiny transformers v5 Qwen3ForCausalLM (2 layers) in fp32, as transformers initialises it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=16)
    kw.update(overrides)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**kw))


def spread_weights(model):
    """Every weight matrix drawn from N(0, 0.2) (from the current torch seed), in place; returns the model."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    return model


def _logits_and_grads(model, tokens):
    model.zero_grad()
    out = model(tokens)
    logits = out if isinstance(out, torch.Tensor) else out.logits  # native model / transformers
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_swap_parity(model, original, tokens=None):
    """A swapped model's logits and every parameter gradient equal the original's at the fp32 tolerance
    (tokens: ``[2, 8]`` ids below 64 by default, the tiny models' vocabulary)."""
    from tests.tolerances import assert_close

    if tokens is None:
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    got_logits, got = _logits_and_grads(model, tokens)
    want_logits, want = _logits_and_grads(original, tokens)
    assert_close(got_logits, want_logits, torch.float32)
    assert got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name], torch.float32, msg=name)


def _short_rope(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False, layout="bhsd"):
    return get_impl("rope_hf", "reference").fn(q, k, q_out, k_out, cos=cos, sin=sin, rope_cache=rope_cache,
                                               backward=backward, layout=layout)


def _at_most_8_rows(q, k, layout="bhsd", **_):
    s = q.shape[1] if layout == "bshd" else q.shape[2]
    return [] if s <= 8 else [Violation("short_rope", "S <= 8", s, "test limit")]


@pytest.fixture
def short_rope():
    register("rope_hf", "short", _short_rope, constraints=_at_most_8_rows, has_backward=True)
    yield "short"
    unregister("rope_hf", "short")
