"""Native Qwen3 (dense + MoE): model, flavor registry, HF config and safetensors I/O."""

from .config import Qwen3Config, rope_cache
from .model import (Attention, FeedForward, GroupedExperts, MoE, Qwen3Model, RMSNorm, RoPEApply, TopKRouter,
                    TransformerBlock, grouped_mm)
from .registry import ModelSpec, flavors, model_registry

__all__ = [
    "Attention", "FeedForward", "GroupedExperts", "MoE", "ModelSpec", "Qwen3Config", "Qwen3Model", "RMSNorm",
    "RoPEApply", "TopKRouter", "TransformerBlock", "flavors", "grouped_mm", "model_registry", "rope_cache",
]
