"""Tensor parallelism for the native Qwen3: the TP plan of its blocks, the vocabulary and the experts.

Megatron-style (DTensor ``parallelize_module``): q/k/v and gate/up column-parallel, o and down
row-parallel; the per-head q/k RMSNorms see head-sharded activations, so they run as SequenceParallel
over the heads dim (their weight grads are then summed over TP ranks). The router stays replicated;
routed experts are replicated or sharded on I (:func:`trnkit.qwen3.tp_experts.shard_experts_on_i`).
The embedding and lm_head are sharded on the vocabulary (:func:`vocab_parallel`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trnkit.errors import ConfigError

__all__ = ["block_tp_plan", "check_tp_heads", "parallelize_qwen3", "vocab_parallel"]


def check_tp_heads(tp: int, n_heads: int, n_kv_heads: int) -> None:
    """The TP degree must divide both head counts (each rank holds whole heads)."""
    if n_heads % tp or n_kv_heads % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree: {tp} must divide n_heads ({n_heads}) and "
                          f"n_kv_heads ({n_kv_heads})")


def block_tp_plan(attention: str, qkvo: tuple[str, str, str, str], ffn: str | None,
                  gate_up_down: tuple[str, str, str]) -> dict[str, Any]:
    """The ``parallelize_module`` plan of one Qwen3 block, by module names (the same plan fits the native
    block and transformers' ``Qwen3DecoderLayer``); ``ffn=None`` leaves the FFN out (an MoE block)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    a, (q, k, v, o) = attention, qkvo
    # the per-head q/k RMSNorms see [B, S, H_local, D]: "sequence" parallel over the head dim 2
    plan: dict[str, Any] = {
        f"{a}.{q}": ColwiseParallel(), f"{a}.{k}": ColwiseParallel(), f"{a}.{v}": ColwiseParallel(),
        f"{a}.{o}": RowwiseParallel(),
        f"{a}.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        f"{a}.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
    if ffn is not None:
        gate, up, down = gate_up_down
        plan.update({f"{ffn}.{gate}": ColwiseParallel(), f"{ffn}.{up}": ColwiseParallel(),
                     f"{ffn}.{down}": RowwiseParallel()})
    return plan


def parallelize_qwen3(model: nn.Module, tp_mesh: Any, experts: str = "replicate") -> str:
    """TP on every block of a native ``Qwen3Model`` (meta or real tensors) and on its vocabulary, in place.
    Returns what was sharded (for the log)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from .tp_experts import shard_experts_on_i

    tp = tp_mesh.size()
    c = model.config
    check_tp_heads(tp, c.n_heads, c.n_kv_heads)
    for block in model.layers:
        dense = block.feed_forward is not None
        plan = block_tp_plan("attention", ("wq", "wk", "wv", "wo"), "feed_forward" if dense else None,
                             ("w1", "w3", "w2"))
        parallelize_module(block, tp_mesh, plan)
        if not dense and experts == "shard_i":
            shard_experts_on_i(block.moe.experts, tp_mesh)
        # The native attention reshapes with its head counts: make them the local ones.
        block.attention.n_heads = c.n_heads // tp
        block.attention.n_kv_heads = c.n_kv_heads // tp
    vocab_parallel(model, tp_mesh)
    return "attention + dense FFN + vocab (embedding, lm_head, loss)"


def vocab_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Shard the native model's embedding and lm_head on the vocabulary (rows) over TP.

    The embedding looks up its local rows and all-reduces (RowwiseParallel on an Embedding); the
    chunked loss reads the lm_head's ``Shard(0)`` weight and runs vocab-parallel, so no rank holds more
    than V/tp logit columns; a logits forward (evaluation, ``loss_chunk_size`` 0) all-gathers them.
    A tied weight stays one parameter (both plans shard it the same way).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tied = model.lm_head.weight is model.tok_embeddings.weight
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    if tied:
        model.lm_head.weight = model.tok_embeddings.weight
