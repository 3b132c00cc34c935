"""A toy model family for tests/harness/test_model_spec.py: ``bigram:<hidden size>``, a next-token
model that reads only the current token (embedding -> ReLU MLP block -> lm_head), implementing
:class:`trnkit.model_spec.ModelSpec` with a safetensors state-dict adapter and no TP plan."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from trnkit.errors import ConfigError
from trnkit.model_spec import IGNORE_INDEX, ModelShape


class Bigram(nn.Module):
    """Next token from the current one only: embedding -> ReLU MLP block -> lm_head."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.block(h))


class BigramAdapter:
    def __init__(self, spec: BigramSpec) -> None:
        self.spec = spec

    def load_hf(self, path: str) -> dict[str, torch.Tensor]:
        return load_file(os.path.join(path, "model.safetensors"))

    def save_hf(self, state_dict: dict[str, torch.Tensor], path: str, dtype: torch.dtype) -> None:
        os.makedirs(path, exist_ok=True)
        save_file({k: v.to(dtype).contiguous() for k, v in state_dict.items()}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.spec.config, f)


@dataclass
class BigramSpec:
    name: str
    config: dict[str, int]
    hf_path: str = ""

    shape = ModelShape(n_layers=1, n_heads=1, head_dim=1)
    is_moe = False
    aux_coef = 0.0

    @property
    def vocab_size(self) -> int:
        return self.config["vocab"]

    @property
    def state_dict_adapter(self) -> BigramAdapter:
        return BigramAdapter(self)

    def build(self) -> nn.Module:
        return Bigram(self.config["vocab"], self.config["hidden"])

    def init_weights(self, model: nn.Module) -> None:
        for p in model.parameters():
            nn.init.normal_(p, std=0.02)

    def reset_buffers(self, model: nn.Module, device: torch.device) -> None:
        pass  # no buffers

    def tie_weights(self, model: nn.Module) -> None:
        pass

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [model.block]

    def parallelize(self, model: nn.Module, tp_mesh: Any, experts: str) -> str:
        raise ConfigError(f"parallelism.tensor_parallel_degree: {self.name} has no TP plan")

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens)

    def loss_sum(self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                 schedule: str = "recompute") -> torch.Tensor:
        if schedule != "recompute":  # a family of its own decides what it runs; this one has one loss
            raise ConfigError(f"config training.loss_schedule: the bigram family has one loss (full logits), got "
                              f"{schedule!r}")
        return F.cross_entropy(model(tokens).float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        return None

    def router_stats(self, model: nn.Module) -> None:
        return None

    def plan_config(self) -> None:
        return None  # not Qwen3-shaped: the trainer skips the memory plan


def build_spec(hidden: str, overrides: dict[str, Any], *, name: str, seq_len: int, aux_loss_coef: float | None,
               kernels: dict[str, Any]) -> BigramSpec:
    if not hidden.isdigit():
        raise ConfigError(f"model.spec: bigram:<hidden size> needs a number, got {hidden!r}")
    return BigramSpec(name, {"vocab": int(overrides.get("vocab", 384)), "hidden": int(hidden)})
