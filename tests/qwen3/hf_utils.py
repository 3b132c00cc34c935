"""Tiny random transformers Qwen3 / Qwen3-MoE models for parity tests (fixed seeds, offline)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from trnkit.qwen3 import Qwen3Config

# name -> kwargs for transformers' Qwen3Config / Qwen3MoeConfig (MoE when "num_experts" is present).
TINY: dict[str, dict] = {
    "dense-tied-gqa2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "dense-untied-mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "dense-gqa4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
    "moe-norm": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "moe-nonorm-tied": dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                            tie_word_embeddings=True),
    "moe-mlp-only": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                         num_key_value_heads=1),
    "moe-sparse-step": dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2),
}

_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, tie_word_embeddings=False,
             moe_intermediate_size=32)


def hf_config(name: str):
    from transformers import Qwen3Config as HFDense, Qwen3MoeConfig as HFMoe

    kw = {**_BASE, **TINY[name]}
    if "num_experts" in kw:
        return HFMoe(**kw)
    kw.pop("moe_intermediate_size")
    return HFDense(**kw)


def hf_model(name: str, seed: int = 0, attn: str = "eager"):
    """Random transformers model (eval mode, fp32). Weights drawn with a fixed seed; norms perturbed so
    that a wrong norm mapping cannot hide behind all-ones weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(name)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def native_config(name: str) -> Qwen3Config:
    return Qwen3Config.from_hf(hf_config(name).to_dict())


def tokens(vocab: int, batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
