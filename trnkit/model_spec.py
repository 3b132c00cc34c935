"""What the trainer needs from a model family: the :class:`ModelSpec` protocol (a leaf module).

A family (trnkit's native Qwen3 in ``trnkit.qwen3.spec``, transformers models in
``trnkit.harness.hf_spec``) implements it; the trainer only calls these methods, never asks which family
it holds. torchtitan's ``ModelSpec`` bundles the same parts (model config, build, parallelize function,
state-dict adapter); here each is a method of one object that holds the resolved model config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["CHUNKED_LOSS", "IGNORE_INDEX", "LossForm", "ModelShape", "ModelSpec", "StateDictAdapter"]

IGNORE_INDEX = -100  # a label the loss skips (padding, a document's last token)


@dataclass
class ModelShape:
    """What the FLOPs formula needs to know about a model."""
    n_layers: int
    n_heads: int
    head_dim: int
    num_experts: int = 0
    top_k: int = 0


@dataclass(frozen=True)
class LossForm:
    """How a family's ``loss_sum`` forms the loss, as the memory plan (``trnkit.harness.plan``) counts it."""
    full_logits: bool = False         # True: [tokens, vocab] logits at once, then an fp32 log-softmax (as
    # transformers' models do); False: training.loss_chunk_size rows at a time (trnkit.qwen3.loss; 0 = full)
    vocab_sharded_by_tp: bool = True  # the embedding and lm_head are split over the TP group


CHUNKED_LOSS = LossForm()  # trnkit's native Qwen3, and the plan of a family that does not say


@runtime_checkable
class StateDictAdapter(Protocol):
    """The model's full state dict in and out of a Hugging Face safetensors folder."""

    def load_hf(self, path: str) -> dict[str, torch.Tensor]:
        """A full state dict in the model's own key layout, read from an HF folder (fp32)."""

    def save_hf(self, state_dict: dict[str, torch.Tensor], path: str, dtype: torch.dtype) -> None:
        """Write a full state dict as an HF folder (config.json + safetensors) that transformers loads."""


@runtime_checkable
class ModelSpec(Protocol):
    """One resolved model: how to build, initialise, parallelize, run and checkpoint it.

    Optional (not a protocol member, so a family written without it still satisfies the protocol):
    ``loss_form``, a :class:`LossForm` saying how ``loss_sum`` forms the loss and whether TP shards the
    vocabulary; the memory plan reads it, and uses :data:`CHUNKED_LOSS` when a family has none.
    """

    name: str             # for logs and checkpoint identity, e.g. "qwen3:debug-moe"
    config: Any           # the model config: a dataclass, a dict or an object with to_dict() (a transformers config)
    shape: ModelShape
    vocab_size: int
    is_moe: bool
    hf_path: str          # the folder published weights load from ("" when none)

    @property
    def state_dict_adapter(self) -> StateDictAdapter: ...

    @property
    def aux_coef(self) -> float:
        """The MoE load-balancing loss coefficient in effect (0: off)."""

    def build(self) -> nn.Module:
        """The module, on the current default device (use ``with torch.device("meta")``)."""

    def init_weights(self, model: nn.Module) -> None:
        """Random initialisation of every parameter (under the caller's seed)."""

    def reset_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Recompute non-persistent buffers (RoPE tables) that a meta build + ``to_empty`` left as garbage."""

    def tie_weights(self, model: nn.Module) -> None:
        """Re-tie shared parameters (tied embeddings) after a state dict was loaded into ``model``."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer blocks (FSDP units, compile units)."""

    def parallelize(self, model: nn.Module, tp_mesh: Any, experts: str) -> str:
        """Tensor parallelism over ``tp_mesh`` in place (routed experts ``"replicate"`` or ``"shard_i"``);
        returns what was sharded, for the log."""

    def loss_sum(self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                 schedule: str = "recompute") -> torch.Tensor:
        """Summed next-token cross-entropy (fp32) over the labels that are not :data:`IGNORE_INDEX`;
        ``chunk_size`` and ``schedule`` are ``training.loss_chunk_size`` / ``training.loss_schedule`` (a family
        that cannot run a schedule raises a ConfigError naming the key)."""

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, S, V]`` logits of a forward."""

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        """The weighted MoE load-balancing loss of the last training forward, or None."""

    def router_stats(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """``(selections per expert [E], router probabilities summed per expert [E] (with grad), rows)`` over
        all MoE layers of the last training forward, or None (aux loss off)."""

    def plan_config(self) -> Any | None:
        """The model as a ``trnkit.qwen3.Qwen3Config``, the shape the memory planner
        (``trnkit.harness.plan``) counts, or None for a model that is not Qwen3-shaped (no plan)."""
