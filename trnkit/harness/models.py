"""The two model backends behind one interface: native ``qwen3:<flavor>`` and transformers ``hf:<path>``.

A :class:`ModelHandle` knows how to build the module (on any device, meta included), initialise it,
run it (tokens -> logits, aux loss), which modules are transformer blocks (FSDP units), its tensor-
parallel plan, and how to read/write HF safetensors checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trnkit.harness.config import ConfigError, TrainerConfig, _suggest, coerce
from trnkit.harness.data import IGNORE_INDEX
from trnkit.harness.metrics import ModelShape


# Qwen3Config fields that change a model's function without changing any weight shape.
_MATH_FIELDS = ("rope_theta", "norm_eps", "norm_topk_prob", "tie_word_embeddings", "mlp_only_layers",
                "decoder_sparse_step", "top_k")


# Per model kind, the module names the TP plan targets: (attention, (q, k, v, o), dense FFN, (gate, up, down)).
_TP_MODULE_NAMES = {
    "native": ("attention", ("wq", "wk", "wv", "wo"), "feed_forward", ("w1", "w3", "w2")),
    "hf": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp", ("gate_proj", "up_proj", "down_proj")),
}


@dataclass
class ModelHandle:
    kind: str                 # "native" | "hf"
    name: str                 # for logs, e.g. "qwen3:debug-moe"
    config: Any               # Qwen3Config (native) or a transformers PretrainedConfig (hf)
    shape: ModelShape
    vocab_size: int
    is_moe: bool
    hf_path: str = ""         # hf: the source folder

    # ------------------------------------------------------------------ build / run
    def build(self) -> nn.Module:
        """The module, on the current default device (use ``with torch.device("meta")``)."""
        if self.kind == "native":
            from trnkit.qwen3 import Qwen3Model
            return Qwen3Model(self.config)
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_config(self.config, attn_implementation="sdpa")

    def init_weights(self, model: nn.Module) -> None:
        if self.kind == "native":
            model.init_weights()
        else:
            # transformers' own init (_init_weights for every module), re-tying embeddings if configured.
            for m in model.modules():
                model._init_weights(m)
            model.tie_weights()

    def reset_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Recompute non-persistent buffers (RoPE tables) that meta init + ``to_empty`` left as garbage."""
        if self.kind == "native":
            model.rope_cache = model._make_rope_cache(device)
            return
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        for m in model.modules():
            if hasattr(m, "inv_freq") and hasattr(m, "rope_type"):
                fn = m.compute_default_rope_parameters if m.rope_type == "default" else ROPE_INIT_FUNCTIONS[m.rope_type]
                inv_freq, m.attention_scaling = fn(m.config)  # computed on CPU, as in __init__
                m.inv_freq = inv_freq.to(device)
                m.original_inv_freq = m.inv_freq.clone()

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        if self.kind == "native":
            return model(tokens)
        out = model(input_ids=tokens, use_cache=False)
        self._last_hf_aux = getattr(out, "aux_loss", None)
        self._last_hf_router_logits = getattr(out, "router_logits", None)
        return out.logits

    def loss_sum(self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """Summed next-token cross-entropy (fp32) over labels != IGNORE_INDEX.

        Native: computed inside the model's forward by the chunked linear cross-entropy
        (``chunk_size`` tokens per chunk, 0 = full logits), vocab-parallel under TP. hf: full logits.
        """
        if self.kind == "native":
            return model(tokens, labels=labels, loss_chunk_size=chunk_size, ignore_index=IGNORE_INDEX)
        logits = self.logits(model, tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        """The weighted MoE load-balancing loss of the last training forward, or None."""
        if self.kind == "native":
            return getattr(model, "aux_loss", None)
        aux = getattr(self, "_last_hf_aux", None)
        coef = getattr(self.config, "router_aux_loss_coef", 0.0)
        if aux is None or not getattr(self.config, "output_router_logits", False) or coef == 0:
            return None
        return coef * aux  # HF returns the unweighted Switch loss

    @property
    def aux_coef(self) -> float:
        """The MoE load-balancing loss coefficient in effect (0: off)."""
        if self.kind == "native":
            return self.config.router_aux_loss_coef if self.is_moe else 0.0
        on = self.is_moe and getattr(self.config, "output_router_logits", False)
        return float(getattr(self.config, "router_aux_loss_coef", 0.0)) if on else 0.0

    def router_stats(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """``(selections per expert [E], router probabilities summed per expert [E] (with grad), rows)``
        over all MoE layers of the last training forward, or None (aux loss off). HF models: recomputed
        from the returned router logits as transformers' ``load_balancing_loss_func`` does."""
        if self.kind == "native":
            return model.router_stats()
        logits = getattr(self, "_last_hf_router_logits", None)
        if not logits or not self.aux_coef:
            return None
        probs = torch.softmax(torch.cat([chunk.float() for chunk in logits], 0), dim=-1)
        idx = torch.topk(probs, self.shape.top_k, dim=-1).indices
        counts = torch.bincount(idx.reshape(-1), minlength=probs.shape[-1]).float()
        return counts, probs.sum(0), probs.shape[0]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        layers = model.layers if self.kind == "native" else model.model.layers
        return list(layers)

    # ------------------------------------------------------------------ tensor parallel
    def apply_tp(self, model: nn.Module, tp_mesh: Any, experts: str = "replicate") -> None:
        """Megatron-style TP on attention and FFN (DTensor ``parallelize_module``).

        q/k/v (and gate/up) column-parallel, o (and down) row-parallel; the per-head q/k RMSNorms see
        head-sharded activations, so they run as SequenceParallel over the heads dim (their weight
        grads are then summed over TP ranks). Embeddings, final norm, lm_head and the router stay
        replicated; routed experts are replicated or (native, ``experts="shard_i"``) sharded on I by
        :func:`trnkit.harness.tp_experts.shard_experts_on_i`. Native models also shard the embedding and
        lm_head on the vocabulary (see :func:`_vocab_parallel`); hf models keep them replicated.
        """
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       parallelize_module)

        tp = tp_mesh.size()
        c = self.config
        n_heads = c.n_heads if self.kind == "native" else c.num_attention_heads
        n_kv = c.n_kv_heads if self.kind == "native" else c.num_key_value_heads
        if n_heads % tp or n_kv % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree: {tp} must divide n_heads ({n_heads}) and "
                              f"n_kv_heads ({n_kv})")
        a, (q, k, v, o), f, (gate, up, down) = _TP_MODULE_NAMES[self.kind]
        # the per-head q/k RMSNorms see [B, S, H_local, D]: "sequence" parallel over the head dim 2
        attn = {f"{a}.{q}": ColwiseParallel(), f"{a}.{k}": ColwiseParallel(), f"{a}.{v}": ColwiseParallel(),
                f"{a}.{o}": RowwiseParallel(),
                f"{a}.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                f"{a}.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
        ffn = {f"{f}.{gate}": ColwiseParallel(), f"{f}.{up}": ColwiseParallel(), f"{f}.{down}": RowwiseParallel()}
        for block in self.blocks(model):
            plan = dict(attn)
            dense = (block.feed_forward is not None) if self.kind == "native" else hasattr(block.mlp, "gate_proj")
            if dense:
                plan.update(ffn)
            parallelize_module(block, tp_mesh, plan)
            if not dense and experts == "shard_i":
                if self.kind != "native":
                    raise ConfigError("parallelism.tp_experts: 'shard_i' is implemented for qwen3: (native) "
                                      f"models only, not {self.name}; use 'replicate'")
                from trnkit.harness.tp_experts import shard_experts_on_i
                shard_experts_on_i(block.moe.experts, tp_mesh)
            if self.kind == "native":
                # The native attention reshapes with its head counts: make them the local ones.
                block.attention.n_heads = n_heads // tp
                block.attention.n_kv_heads = n_kv // tp
        if self.kind == "native":
            _vocab_parallel(model, tp_mesh)

    # ------------------------------------------------------------------ HF checkpoints
    def load_hf_state_dict(self, path: str) -> dict[str, torch.Tensor]:
        """A full state dict in this model's own key layout, read from an HF safetensors folder."""
        if self.kind == "native":
            from trnkit.qwen3 import Qwen3Config
            from trnkit.qwen3.checkpoint import load_hf_checkpoint

            if os.path.isfile(os.path.join(path, "config.json")):
                # shapes are checked key by key by the loader; these change the math without a shape
                theirs = Qwen3Config.from_hf(path)
                diffs = [f"{f}: model {getattr(self.config, f)!r} vs checkpoint {getattr(theirs, f)!r}"
                         for f in _MATH_FIELDS if getattr(self.config, f) != getattr(theirs, f)]
                if diffs:
                    raise ConfigError(f"checkpoint.initial_load_path: {path}/config.json disagrees with "
                                      f"{self.name} (set them in model.config): " + "; ".join(diffs))
            return load_hf_checkpoint(path, self.config, dtype=torch.float32).state_dict()
        from transformers import AutoModelForCausalLM
        _refuse_non_float(path)
        try:
            src = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"checkpoint.initial_load_path: transformers cannot load {path} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        return {k: v.detach() for k, v in src.state_dict().items()}

    def save_hf(self, state_dict: dict[str, torch.Tensor], path: str, dtype: torch.dtype) -> None:
        """Write a full state dict as an HF folder (config.json + model.safetensors) loadable by transformers."""
        with torch.device("meta"):
            shell = self.build()
        shell.to_empty(device="cpu")
        shell.load_state_dict(state_dict, strict=False)  # the native rope cache is not in the state dict
        if self.kind == "native":
            from trnkit.qwen3.checkpoint import save_hf_checkpoint
            if self.config.tie_word_embeddings:
                shell.lm_head.weight = shell.tok_embeddings.weight
            save_hf_checkpoint(shell, path, dtype=dtype)
            return
        shell.tie_weights()
        shell.to(dtype).save_pretrained(path)


def _vocab_parallel(model: nn.Module, tp_mesh: Any) -> None:
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


def _check_native_values(c: Any) -> None:
    """Value rules of the native model config beyond its types (Qwen3Config checks sizes and counts):
    finite positive RoPE base and norm epsilon (0 or less ends in a NaN loss naming nothing), layer
    indices inside the model."""
    def req(cond: bool, key: str, rule: str, value: Any) -> None:
        if not cond:
            raise ConfigError(f"model.config.{key}: {rule}, got {value!r}")

    req(math.isfinite(c.rope_theta) and c.rope_theta > 0, "rope_theta", "must be a finite number > 0 (the RoPE base)",
        c.rope_theta)
    req(math.isfinite(c.norm_eps) and c.norm_eps > 0, "norm_eps", "must be a finite number > 0 (RMSNorm divides by "
        "sqrt(mean(x^2) + eps))", c.norm_eps)
    for name in ("init_std", "router_aux_loss_coef"):
        req(math.isfinite(getattr(c, name)) and getattr(c, name) >= 0, name, "must be a finite number >= 0",
            getattr(c, name))
    outside = [i for i in c.mlp_only_layers if not 0 <= i < c.n_layers]
    req(not outside, "mlp_only_layers", f"layer indices must be in [0, n_layers - 1 = {c.n_layers - 1}]; "
        f"out of range: {outside}", c.mlp_only_layers)


def _hf_override(cfg: Any, key: str, value: Any) -> Any:
    """A model.config value for a transformers config, checked against the type of the field's current value."""
    current = getattr(cfg, key)
    tp = type(current) if isinstance(current, (bool, int, float, str, list)) else None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is None:
        return value
    hint = list[int] if tp is list and all(isinstance(x, int) for x in current) else tp
    value = coerce(f"model.config.{key}", hint, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"model.config.{key}: must be a finite number, got {value!r}")
    return value


def _hf_config_and_shape(path: str, overrides: dict[str, Any]) -> tuple[Any, ModelShape]:
    from transformers import AutoConfig

    if not os.path.exists(path):
        raise ConfigError(f"model.spec: hf: path {path!r} does not exist")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.spec: hf:{path} has no config.json (an hf: model is a folder with a transformers "
                          f"config.json and optionally *.safetensors; found {sorted(os.listdir(path))[:10]})")
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)  # never run code from the folder
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.spec: transformers cannot read the config of hf:{path} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            raise ConfigError(f"model.config: {type(cfg).__name__} has no field {k!r}")
        setattr(cfg, k, _hf_override(cfg, k, v))
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    E = getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0) or 0
    K = getattr(cfg, "num_experts_per_tok", 0) or 0
    # HF's layer rule (Qwen3MoeDecoderLayer); a "MoE" config whose layers are all dense is dense
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    outside = sorted(i for i in dense if not 0 <= i < cfg.num_hidden_layers)
    if outside:
        raise ConfigError(f"model.config.mlp_only_layers: layer indices must be in [0, num_hidden_layers - 1 = "
                          f"{cfg.num_hidden_layers - 1}]; out of range: {outside}")
    if E and not any(i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)):
        E = K = 0
    return cfg, ModelShape(cfg.num_hidden_layers, n_heads, head_dim, E, K)


def _refuse_non_float(path: str) -> None:
    """transformers casts integer / bool tensors into float parameters without a word: refuse them first."""
    from safetensors import safe_open

    from trnkit.qwen3.checkpoint import INDEX_NAME, shard_files
    from trnkit.qwen3.state_dict import CheckpointError

    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        shard_files(path)  # every file the index names must resolve inside the folder
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    dtype = f.get_slice(key).get_dtype()
                    if not dtype.startswith(("F", "BF")):
                        raise CheckpointError(f"checkpoint: {key} in {os.path.join(path, name)} has dtype {dtype}; "
                                              "a float parameter needs a floating-point tensor, refusing to cast")


def build_handle(cfg: TrainerConfig) -> ModelHandle:
    spec = cfg.model.spec
    kind, arg = spec.split(":", 1)
    coef = cfg.training.moe_aux_loss_coef
    if kind == "qwen3":
        from trnkit.qwen3 import Qwen3Config, model_registry

        overrides = dict(cfg.model.config)
        known = [f.name for f in dataclasses.fields(Qwen3Config) if f.name != "kernels"]  # from [overrides]
        unknown = [k for k in overrides if k not in known]
        if unknown:
            raise ConfigError(f"model.config: unknown Qwen3Config field {unknown[0]!r}{_suggest(unknown[0], known)}; "
                              f"fields: {known}")
        hints = typing.get_type_hints(Qwen3Config)
        overrides = {k: coerce(f"model.config.{k}", hints[k], v) for k, v in overrides.items()}  # the typed schema
        if coef is not None:
            overrides["router_aux_loss_coef"] = coef
        if cfg.overrides.policy != "off":  # the kernel choices, bound to the swap points when the model is built
            overrides["kernels"] = cfg.overrides.kernels()
        try:
            mspec = model_registry(arg, **overrides)
        except KeyError as e:
            raise ConfigError(f"model.spec: {e.args[0]}") from None
        except TypeError as e:
            raise ConfigError(f"model.config: bad Qwen3Config field ({e})") from None
        except ValueError as e:  # Qwen3Config.validate
            raise ConfigError(f"model.config: {e}") from None
        c = mspec.config
        _check_native_values(c)
        if cfg.training.seq_len > c.max_seq_len:
            raise ConfigError(f"training.seq_len: {cfg.training.seq_len} exceeds the model's max_seq_len "
                              f"{c.max_seq_len}")
        shape = ModelShape(c.n_layers, c.n_heads, c.head_dim, c.num_experts, c.top_k if c.is_moe else 0)
        return ModelHandle("native", spec, c, shape, c.vocab_size, c.is_moe)
    if kind == "hf":
        from trnkit.packaged import shipped_path

        arg = shipped_path(arg)  # configs/hf/... of a shipped config, from any folder
        hcfg, shape = _hf_config_and_shape(arg, cfg.model.config)
        max_pos = getattr(hcfg, "max_position_embeddings", None)
        if isinstance(max_pos, int) and cfg.training.seq_len > max_pos:
            raise ConfigError(f"training.seq_len: {cfg.training.seq_len} exceeds the model's max_position_embeddings "
                              f"{max_pos} (hf:{arg}/config.json)")
        is_moe = shape.num_experts > 0
        if is_moe and coef is not None:
            hcfg.router_aux_loss_coef = coef
        if is_moe:
            hcfg.output_router_logits = bool(getattr(hcfg, "router_aux_loss_coef", 0.0))
        return ModelHandle("hf", spec, hcfg, shape, hcfg.vocab_size, is_moe, hf_path=arg)
    raise ConfigError(f"model.spec: must be 'qwen3:<flavor>' or 'hf:<path>', got {spec!r}")


def has_hf_weights(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names


__all__ = ["ModelHandle", "build_handle", "has_hf_weights"]
