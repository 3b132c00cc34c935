"""trnkit's native Qwen3 as a :class:`trnkit.model_spec.ModelSpec` (``model.spec = "qwen3:<flavor>"``).

The trainer reaches the family through :func:`build_spec` (``CONFIG_CLASS`` types the ``model.config``
overrides) and then only through the spec's methods: build, init, parallelize (:mod:`.parallelize`),
the state-dict adapter (:mod:`.state_dict_adapter`) and the loss (the chunked linear cross-entropy
inside the model's forward, :mod:`.loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trnkit.errors import ConfigError
from trnkit.model_spec import CHUNKED_LOSS, IGNORE_INDEX, ModelShape

from .config import Qwen3Config
from .model import Qwen3Model
from .parallelize import parallelize_qwen3
from .registry import model_registry
from .state_dict_adapter import Qwen3StateDictAdapter

__all__ = ["CONFIG_CLASS", "Qwen3Spec", "build_spec"]

CONFIG_CLASS = Qwen3Config  # the schema of model.config's overrides (field names and types)


@dataclass
class Qwen3Spec:
    name: str                 # e.g. "qwen3:debug-moe"
    config: Qwen3Config
    hf_path: str = ""         # native flavors have no published folder of their own
    loss_form = CHUNKED_LOSS  # training.loss_chunk_size rows at a time (0: full logits), vocab-parallel under TP

    @property
    def shape(self) -> ModelShape:
        c = self.config
        return ModelShape(c.n_layers, c.n_heads, c.head_dim, c.num_experts, c.top_k if c.is_moe else 0)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def is_moe(self) -> bool:
        return self.config.is_moe

    @property
    def state_dict_adapter(self) -> Qwen3StateDictAdapter:
        return Qwen3StateDictAdapter(self.config, self.name)

    @property
    def aux_coef(self) -> float:
        return self.config.router_aux_loss_coef if self.is_moe else 0.0

    def build(self) -> nn.Module:
        return Qwen3Model(self.config)

    def init_weights(self, model: nn.Module) -> None:
        model.init_weights()

    def reset_buffers(self, model: nn.Module, device: torch.device) -> None:
        model.rope_cache = model._make_rope_cache(device)

    def tie_weights(self, model: nn.Module) -> None:
        if self.config.tie_word_embeddings and model.lm_head.weight is not model.tok_embeddings.weight:
            model.lm_head.weight = model.tok_embeddings.weight

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.layers)

    def plan_config(self) -> Qwen3Config:
        return self.config

    def parallelize(self, model: nn.Module, tp_mesh: Any, experts: str) -> str:
        return parallelize_qwen3(model, tp_mesh, experts)

    def loss_sum(self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                 schedule: str = "recompute") -> torch.Tensor:
        """Computed inside the model's forward by the chunked linear cross-entropy (``chunk_size`` tokens per
        chunk, 0 = full logits), vocab-parallel under TP; ``schedule``: the swapped-in loss kernel's
        (``Qwen3Model.forward``'s ``loss_schedule``)."""
        return model(tokens, labels=labels, loss_chunk_size=chunk_size, ignore_index=IGNORE_INDEX,
                     loss_schedule=schedule)

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens)

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        return getattr(model, "aux_loss", None)

    def router_stats(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        return model.router_stats()


def build_spec(flavor: str, overrides: dict[str, Any], *, name: str, seq_len: int, aux_loss_coef: float | None,
               kernels: dict[str, Any]) -> Qwen3Spec:
    """The spec of flavor ``flavor`` with ``overrides`` (typed Qwen3Config fields) applied, checked for a
    run of ``seq_len`` tokens; ``aux_loss_coef`` (when not None) replaces the config's
    ``router_aux_loss_coef``; ``kernels`` ({op: KernelChoice}) are bound to the swap points when the model
    is built (``Qwen3Config.kernels``). Errors name the config key, the rule and the value."""
    overrides = dict(overrides)
    if aux_loss_coef is not None:
        overrides["router_aux_loss_coef"] = aux_loss_coef
    if kernels:
        overrides["kernels"] = kernels
    try:
        config = model_registry(flavor, **overrides).config
    except KeyError as e:
        raise ConfigError(f"model.spec: {e.args[0]}") from None
    except TypeError as e:
        raise ConfigError(f"model.config: bad Qwen3Config field ({e})") from None
    except ValueError as e:  # Qwen3Config.validate
        raise ConfigError(f"model.config: {e}") from None
    if seq_len > config.max_seq_len:
        raise ConfigError(f"training.seq_len: {seq_len} exceeds the model's max_seq_len {config.max_seq_len}")
    return Qwen3Spec(name, config)

