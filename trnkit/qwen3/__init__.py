"""Native Qwen3 (dense + MoE): model, flavor registry, HF config and safetensors I/O."""

from .checkpoint import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from .config import Qwen3Config, rope_cache
from .model import (Attention, FeedForward, GroupedExperts, MoE, Qwen3Model, RMSNorm, RoPEApply, TopKRouter,
                    TransformerBlock, grouped_mm)
from .registry import FlavorSpec, flavors, model_registry
from .state_dict import KEY_MAP, from_hf as state_dict_from_hf, to_hf as state_dict_to_hf

__all__ = [
    "Attention", "CheckpointError", "FeedForward", "GroupedExperts", "KEY_MAP", "MoE", "FlavorSpec", "Qwen3Config",
    "Qwen3Model", "RMSNorm", "RoPEApply", "TopKRouter", "TransformerBlock", "flavors", "grouped_mm",
    "load_hf_checkpoint", "model_registry", "rope_cache", "save_hf_checkpoint", "state_dict_from_hf",
    "state_dict_to_hf",
]
