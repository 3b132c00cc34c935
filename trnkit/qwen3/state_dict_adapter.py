"""The native Qwen3's state dict in and out of Hugging Face safetensors folders (the ModelSpec adapter)."""

from __future__ import annotations

import os

import torch

from trnkit.errors import ConfigError

from .checkpoint import load_hf_checkpoint, save_hf_checkpoint
from .config import Qwen3Config
from .model import Qwen3Model

__all__ = ["MATH_FIELDS", "Qwen3StateDictAdapter"]

# Qwen3Config fields that change a model's function without changing any weight shape.
MATH_FIELDS = ("rope_theta", "norm_eps", "norm_topk_prob", "tie_word_embeddings", "mlp_only_layers",
               "decoder_sparse_step", "top_k")


class Qwen3StateDictAdapter:
    """Reads and writes HF folders for the model ``name`` of ``config``; the key map is
    :mod:`trnkit.qwen3.state_dict`'s, the I/O :mod:`trnkit.qwen3.checkpoint`'s."""

    def __init__(self, config: Qwen3Config, name: str) -> None:
        self.config, self.name = config, name

    def load_hf(self, path: str) -> dict[str, torch.Tensor]:
        """A full native state dict (fp32) from an HF folder; a config.json whose math differs from the
        model's (same shapes, other function) is refused, naming each field."""
        if os.path.isfile(os.path.join(path, "config.json")):
            # shapes are checked key by key by the loader; these change the math without a shape
            theirs = Qwen3Config.from_hf(path)
            diffs = [f"{f}: model {getattr(self.config, f)!r} vs checkpoint {getattr(theirs, f)!r}"
                     for f in MATH_FIELDS if getattr(self.config, f) != getattr(theirs, f)]
            if diffs:
                raise ConfigError(f"checkpoint.initial_load_path: {path}/config.json disagrees with "
                                  f"{self.name} (set them in model.config): " + "; ".join(diffs))
        return load_hf_checkpoint(path, self.config, dtype=torch.float32).state_dict()

    def save_hf(self, state_dict: dict[str, torch.Tensor], path: str, dtype: torch.dtype) -> None:
        """Write a full native state dict as an HF folder (config.json + model.safetensors)."""
        with torch.device("meta"):
            shell = Qwen3Model(self.config)
        shell.to_empty(device="cpu")
        shell.load_state_dict(state_dict, strict=False)  # the rope cache is not in the state dict
        if self.config.tie_word_embeddings:
            shell.lm_head.weight = shell.tok_embeddings.weight
        save_hf_checkpoint(shell, path, dtype=dtype)
