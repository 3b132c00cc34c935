"""transformers v5 models as a :class:`trnkit.model_spec.ModelSpec` (``model.spec = "hf:<folder>"``).

Any ``AutoModelForCausalLM`` whose folder holds a config.json (and optionally *.safetensors): built
with sdpa attention, initialised by transformers' own ``_init_weights``, tensor-parallel with the
Qwen3 block plan on transformers' module names (embeddings and lm_head replicated), checkpoints
through ``from_pretrained`` / ``save_pretrained``, and the full-logits cross-entropy.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trnkit.errors import ConfigError
from trnkit.harness.config import coerce
from trnkit.model_spec import IGNORE_INDEX, LossForm, ModelShape
from trnkit.packaged import shipped_path

__all__ = ["HFSpec", "HFStateDictAdapter", "build_spec"]


class HFStateDictAdapter:
    """The identity adapter: a transformers model's state dict is already in HF's key layout."""

    def __init__(self, spec: "HFSpec") -> None:
        self.spec = spec

    def load_hf(self, path: str) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForCausalLM

        _refuse_non_float(path)
        try:
            # safetensors only: a folder's pytorch_model.bin is a pickle, never read (not even by torch's
            # weights-only unpickler)
            src = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False,
                                                       use_safetensors=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"checkpoint.initial_load_path: transformers cannot load {path} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        return {k: v.detach() for k, v in src.state_dict().items()}

    def save_hf(self, state_dict: dict[str, torch.Tensor], path: str, dtype: torch.dtype) -> None:
        with torch.device("meta"):
            shell = self.spec.build()
        shell.to_empty(device="cpu")
        shell.load_state_dict(state_dict, strict=False)
        shell.tie_weights()
        shell.to(dtype).save_pretrained(path)


@dataclass
class HFSpec:
    name: str                 # e.g. "hf:configs/hf/qwen3-moe-debug"
    config: Any               # a transformers PretrainedConfig
    shape: ModelShape
    hf_path: str              # the source folder
    _last: dict[str, Any] = field(default_factory=dict, repr=False)  # the last forward's aux loss, router logits

    # full [tokens, vocab] logits and F.cross_entropy (loss_sum); embeddings and lm_head replicated (parallelize)
    loss_form = LossForm(full_logits=True, vocab_sharded_by_tp=False)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def is_moe(self) -> bool:
        return self.shape.num_experts > 0

    @property
    def state_dict_adapter(self) -> HFStateDictAdapter:
        return HFStateDictAdapter(self)

    @property
    def aux_coef(self) -> float:
        on = self.is_moe and getattr(self.config, "output_router_logits", False)
        return float(getattr(self.config, "router_aux_loss_coef", 0.0)) if on else 0.0

    def build(self) -> nn.Module:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_config(self.config, attn_implementation="sdpa")

    def init_weights(self, model: nn.Module) -> None:
        # transformers' own init (_init_weights for every module), re-tying embeddings if configured.
        for m in model.modules():
            model._init_weights(m)
        model.tie_weights()

    def reset_buffers(self, model: nn.Module, device: torch.device) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        for m in model.modules():
            if hasattr(m, "inv_freq") and hasattr(m, "rope_type"):
                fn = m.compute_default_rope_parameters if m.rope_type == "default" else ROPE_INIT_FUNCTIONS[m.rope_type]
                inv_freq, m.attention_scaling = fn(m.config)  # computed on CPU, as in __init__
                m.inv_freq = inv_freq.to(device)
                m.original_inv_freq = m.inv_freq.clone()

    def tie_weights(self, model: nn.Module) -> None:
        model.tie_weights()

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)

    def parallelize(self, model: nn.Module, tp_mesh: Any, experts: str) -> str:
        """The Qwen3 block plan on transformers' names; embeddings, lm_head and routed experts replicated."""
        from torch.distributed.tensor.parallel import parallelize_module

        from trnkit.qwen3.parallelize import block_tp_plan, check_tp_heads

        tp, c = tp_mesh.size(), self.config
        check_tp_heads(tp, c.num_attention_heads, c.num_key_value_heads)
        if self.is_moe and experts == "shard_i":
            raise ConfigError("parallelism.tp_experts: 'shard_i' is implemented for qwen3: (native) models only, "
                              f"not {self.name}; use 'replicate'")
        for block in self.blocks(model):
            dense = hasattr(block.mlp, "gate_proj")
            plan = block_tp_plan("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp" if dense else None,
                                 ("gate_proj", "up_proj", "down_proj"))
            parallelize_module(block, tp_mesh, plan)
        return "attention + dense FFN"

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=tokens, use_cache=False)
        self._last["aux"] = getattr(out, "aux_loss", None)
        self._last["router_logits"] = getattr(out, "router_logits", None)
        return out.logits

    def loss_sum(self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                 schedule: str = "recompute") -> torch.Tensor:
        """Full logits, then ``F.cross_entropy`` (``chunk_size`` is not used; no loss kernel runs, so the only
        ``schedule`` is ``"recompute"``, which the config check also enforces)."""
        if schedule != "recompute":
            raise ConfigError(f"config training.loss_schedule: transformers models compute their loss from full "
                              f"logits, with no loss kernel to schedule; use 'recompute', got {schedule!r}")
        logits = self.logits(model, tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        aux = self._last.get("aux")
        coef = getattr(self.config, "router_aux_loss_coef", 0.0)
        if aux is None or not getattr(self.config, "output_router_logits", False) or coef == 0:
            return None
        return coef * aux  # HF returns the unweighted Switch loss

    def router_stats(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Recomputed from the returned router logits as transformers' ``load_balancing_loss_func`` does."""
        logits = self._last.get("router_logits")
        if not logits or not self.aux_coef:
            return None
        probs = torch.softmax(torch.cat([chunk.float() for chunk in logits], 0), dim=-1)
        idx = torch.topk(probs, self.shape.top_k, dim=-1).indices
        counts = torch.bincount(idx.reshape(-1), minlength=probs.shape[-1]).float()
        return counts, probs.sum(0), probs.shape[0]

    def plan_config(self) -> Any | None:
        """transformers' Qwen3 / Qwen3-MoE as trnkit's Qwen3Config (a ConfigError for features it lacks)."""
        if getattr(self.config, "model_type", None) not in ("qwen3", "qwen3_moe"):
            return None
        from trnkit.qwen3 import Qwen3Config

        return Qwen3Config.from_hf(self.config)


def build_spec(path: str, overrides: dict[str, Any], *, name: str, seq_len: int, aux_loss_coef: float | None,
               kernels: dict[str, Any]) -> HFSpec:
    """The spec of the transformers model in ``path`` (a shipped ``configs/hf/...`` path resolves from any
    folder) with ``overrides`` applied to its config (checked against each field's current type). ``kernels``
    are not bound at build: transformers' modules get them from ``apply_overrides`` after the weights."""
    path = shipped_path(path)
    hcfg, shape = _config_and_shape(path, overrides)
    max_pos = getattr(hcfg, "max_position_embeddings", None)
    if isinstance(max_pos, int) and seq_len > max_pos:
        raise ConfigError(f"training.seq_len: {seq_len} exceeds the model's max_position_embeddings "
                          f"{max_pos} (hf:{path}/config.json)")
    if shape.num_experts > 0:
        if aux_loss_coef is not None:
            hcfg.router_aux_loss_coef = aux_loss_coef
        hcfg.output_router_logits = bool(getattr(hcfg, "router_aux_loss_coef", 0.0))
    return HFSpec(name, hcfg, shape, hf_path=path)


def _override(cfg: Any, key: str, value: Any) -> Any:
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


def _config_and_shape(path: str, overrides: dict[str, Any]) -> tuple[Any, ModelShape]:
    from huggingface_hub.errors import StrictDataclassError  # transformers' configs check their fields' types
    from transformers import AutoConfig

    if not os.path.exists(path):
        raise ConfigError(f"model.spec: hf: path {path!r} does not exist")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.spec: hf:{path} has no config.json (an hf: model is a folder with a transformers "
                          f"config.json and optionally *.safetensors; found {sorted(os.listdir(path))[:10]})")
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)  # never run code from the folder
    except (OSError, ValueError, KeyError, StrictDataclassError) as e:
        # a field's type error spans lines (field, then rule and value); the others' first line is their reason
        why = " ".join(str(e).split()) if isinstance(e, StrictDataclassError) else (str(e).splitlines() or [""])[0]
        raise ConfigError(f"model.spec: transformers cannot read the config of hf:{path} "
                          f"({type(e).__name__}: {why})") from None
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            raise ConfigError(f"model.config: {type(cfg).__name__} has no field {k!r}")
        try:
            setattr(cfg, k, _override(cfg, k, v))
        except StrictDataclassError as e:  # a field whose value is None in config.json: transformers checks the type
            raise ConfigError(f"model.config.{k}: {type(cfg).__name__} refuses the value ({' '.join(str(e).split())}), "
                              f"got {v!r}") from None
    _check_trainable(cfg, path)
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


_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "moe_intermediate_size")


def _check_trainable(cfg: Any, path: str) -> None:
    """Values transformers accepts in a config but no model of them trains with (a torch error at the first
    step, or NaN): refused before anything is built, naming the key, the rule and the value."""
    def fail(key: str, rule: str, value: Any) -> None:
        raise ConfigError(f"model.config.{key}: {rule}, got {value!r} (hf:{path}/config.json)")

    for key in _POSITIVE:
        value = getattr(cfg, key, None)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            fail(key, "must be an integer >= 1", value)
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
    if kv and heads % kv:
        fail("num_attention_heads", f"must be a multiple of num_key_value_heads ({kv})", heads)
    experts_key = next((k for k in ("num_experts", "num_local_experts") if getattr(cfg, k, None)), None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if experts_key and isinstance(top_k, int) and top_k > getattr(cfg, experts_key):
        fail("num_experts_per_tok", f"must be <= {experts_key} ({getattr(cfg, experts_key)})", top_k)
    eps = getattr(cfg, "rms_norm_eps", None)
    if isinstance(eps, (int, float)) and not eps > 0:
        fail("rms_norm_eps", "must be > 0", eps)


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
