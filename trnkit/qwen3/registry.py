"""Flavor registry: `model_registry(flavor) -> FlavorSpec(name, flavor, config)`.

Published values from the Qwen3 config.json files on the HF Hub (see ../shared/notes/qwen3.md and
anchors.md §2.5; torchtitan's qwen3 flavor table has the same numbers, 235B-A22B rope_theta 5e6 per
torchtitan). `max_seq_len` (the rope-cache length) is 4096 for all production flavors; the published
max_position_embeddings is 40960 — pass `max_seq_len=` to `model_registry` to change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import Qwen3Config


@dataclass(frozen=True)
class FlavorSpec:
    """A named model: ``name`` ("qwen3"), the canonical ``flavor`` (aliases resolved) and its config."""

    name: str
    flavor: str
    config: Qwen3Config


def _dense(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tie: bool) -> Qwen3Config:
    return Qwen3Config(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128,
                       hidden_dim=hidden_dim, tie_word_embeddings=tie, rope_theta=1e6)


def _moe(dim: int, n_layers: int, n_heads: int, moe_inter: int, theta: float) -> Qwen3Config:
    # Published Qwen3-MoE configs: intermediate_size (6144 / 12288) is unused (no dense layers).
    return Qwen3Config(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128,
                       hidden_dim=6144 if dim == 2048 else 12288, num_experts=128, top_k=8,
                       moe_inter_dim=moe_inter, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[], router_aux_loss_coef=0.001, tie_word_embeddings=False,
                       rope_theta=theta)


_FLAVORS: dict[str, Any] = {
    # Small flavors for tests and CPU training runs. vocab 151936 so the real Qwen3 tokenizer works;
    # tied embeddings keep the 151936 x 256 table from being stored twice.
    "debug": lambda: Qwen3Config(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=768,
                                 vocab_size=151936, tie_word_embeddings=True, max_seq_len=2048),
    "debug-moe": lambda: Qwen3Config(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=768,
                                     vocab_size=151936, tie_word_embeddings=True, max_seq_len=2048,
                                     num_experts=8, top_k=2, moe_inter_dim=128, norm_topk_prob=True,
                                     mlp_only_layers=[0], router_aux_loss_coef=0.001),
    "0.6B": lambda: _dense(1024, 28, 16, 3072, True),
    "1.7B": lambda: _dense(2048, 28, 16, 6144, True),
    "4B": lambda: _dense(2560, 36, 32, 9728, True),
    "8B": lambda: _dense(4096, 36, 32, 12288, False),
    "14B": lambda: _dense(5120, 40, 40, 17408, False),
    "32B": lambda: _dense(5120, 64, 64, 25600, False),
    "30B-A3B": lambda: _moe(2048, 48, 32, 768, 1e6),
    "235B-A22B": lambda: _moe(4096, 94, 64, 1536, 5e6),
}


# torchtitan spells its small flavors "debugmodel" / "debugmodel_moe"; accept those names too.
_ALIASES = {"debugmodel": "debug", "debugmodel_moe": "debug-moe"}


def flavors() -> list[str]:
    """Canonical flavor names, smallest first (aliases such as "debugmodel" are not listed)."""
    return list(_FLAVORS)


def model_registry(flavor: str, **overrides: Any) -> FlavorSpec:
    """Spec for a named flavor; keyword overrides replace config fields (e.g. `max_seq_len=8192`)."""
    flavor = _ALIASES.get(flavor, flavor)
    if flavor not in _FLAVORS:
        raise KeyError(f"model_registry: unknown Qwen3 flavor {flavor!r}; known: {', '.join(_FLAVORS)}")
    cfg = _FLAVORS[flavor]()
    if overrides:
        cfg = cfg.replace(**overrides)
    return FlavorSpec(name="qwen3", flavor=flavor, config=cfg)
