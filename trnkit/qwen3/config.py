"""`Qwen3Config`: one dataclass for dense Qwen3 and Qwen3-MoE, with HF config.json conversion.

Field names follow torchtitan (`dim`, `n_layers`, ...); `from_hf` / `to_hf` translate to and from the
transformers `Qwen3Config` / `Qwen3MoeConfig` layouts (v4: top-level `rope_theta`; v5:
`rope_parameters = {"rope_theta": ..., "rope_type": "default"}`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trnkit.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass
class Qwen3Config:
    # --- transformer body ---
    dim: int = 1024                 # hidden_size
    n_layers: int = 28              # num_hidden_layers
    n_heads: int = 16               # num_attention_heads
    n_kv_heads: int = 8             # num_key_value_heads
    head_dim: int = 128             # NOT dim // n_heads for Qwen3 (0.6B: 16 * 128 != 1024)
    vocab_size: int = 151936
    hidden_dim: int = 3072          # intermediate_size of the dense SwiGLU FFN
    norm_eps: float = 1e-6          # rms_norm_eps
    rope_theta: float = 1e6
    max_seq_len: int = 4096         # length of the rope cache (HF: max_position_embeddings)
    tie_word_embeddings: bool = False
    # --- MoE (num_experts == 0: dense model) ---
    num_experts: int = 0
    top_k: int = 8                  # num_experts_per_tok
    moe_inter_dim: int = 768        # moe_intermediate_size
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.0
    # --- init (torchtitan style, see Qwen3Model.init_weights) ---
    init_std: float = 0.02
    # --- token ids (carried through to/from config.json) ---
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645  # a list as config.json may give it (generation stops at any)
    # transformers' padding_idx: lookups of this token send no gradient to its embedding row (None: every row learns)
    pad_token_id: int | None = None
    # --- kernels: {op: trnkit.overrides.KernelChoice} for the swap points (empty: the torch code).
    # Bound to the modules when the model is built; not part of config.json.
    kernels: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def req(cond: bool, what: str) -> None:
            if not cond:
                raise ConfigError(f"Qwen3Config: {what}")

        for name, tp in _field_types().items():  # the types first: the checks below compare and divide them
            problem = _type_problem(name, tp, getattr(self, name))
            req(problem is None, str(problem))
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len"):
            v = getattr(self, name)
            req(isinstance(v, int) and v > 0, f"{name} must be a positive int, got {v!r}")
        req(self.n_heads % self.n_kv_heads == 0,
            f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        req(self.head_dim % 2 == 0, f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        req(self.num_experts >= 0, f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            req(1 <= self.top_k <= self.num_experts,
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
            req(self.moe_inter_dim > 0, f"moe_inter_dim must be > 0, got {self.moe_inter_dim}")
            req(self.decoder_sparse_step >= 1, f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if any(not self.is_moe_layer(i) for i in range(self.n_layers)):
            req(self.hidden_dim > 0, f"hidden_dim must be > 0 for dense layers, got {self.hidden_dim}")
        # values beyond sizes and counts: 0 or less (or NaN) here ends in a NaN loss that names nothing
        req(math.isfinite(self.rope_theta) and self.rope_theta > 0,
            f"rope_theta must be a finite number > 0 (the RoPE base), got {self.rope_theta!r}")
        req(math.isfinite(self.norm_eps) and self.norm_eps > 0,
            f"norm_eps must be a finite number > 0 (RMSNorm divides by sqrt(mean(x^2) + eps)), got {self.norm_eps!r}")
        for name in ("init_std", "router_aux_loss_coef"):
            v = getattr(self, name)
            req(math.isfinite(v) and v >= 0, f"{name} must be a finite number >= 0, got {v!r}")
        req(self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size,
            f"pad_token_id must be None or in [0, vocab_size = {self.vocab_size}), got {self.pad_token_id!r}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        req(not outside, f"mlp_only_layers: layer indices must be in [0, n_layers - 1 = {self.n_layers - 1}]; "
            f"out of range: {outside}")

    # ----------------------------------------------------------------- layout
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """HF Qwen3MoeDecoderLayer's rule: MoE unless in mlp_only_layers or off the sparse step."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def replace(self, **changes: Any) -> "Qwen3Config":
        names = [f.name for f in dataclasses.fields(self)]
        unknown = [k for k in changes if k not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            raise ConfigError(f"Qwen3Config: unknown field {unknown[0]!r}"
                              f"{f' (did you mean {close[0]!r}?)' if close else ''}; fields: {names}")
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ param count
    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count computed from the config (matches ``sum(p.numel())`` of the model)."""
        d, hd = self.dim, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 2 * hd + 2 * d  # q,k,v,o + q/k norm + 2 norms
        total = 0
        for i in range(self.n_layers):
            if self.is_moe_layer(i):
                ffn = self.num_experts * 3 * d * self.moe_inter_dim + self.num_experts * d
            else:
                ffn = 3 * d * self.hidden_dim
            total += attn + ffn
        emb = self.vocab_size * d
        total += d + (0 if exclude_embedding else emb)
        if not self.tie_word_embeddings:
            total += emb
        return total

    def num_active_params(self) -> int:
        """Parameters touched per token (experts scaled by top_k / num_experts), embeddings included."""
        if not self.is_moe:
            return self.num_params()
        n_moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        inactive = n_moe * (self.num_experts - self.top_k) * 3 * self.dim * self.moe_inter_dim
        return self.num_params() - inactive

    # ------------------------------------------------------------- HF configs
    @classmethod
    def from_hf(cls, hf: Any, **overrides: Any) -> "Qwen3Config":
        """From a transformers config object, a config.json dict, or a path to config.json / its folder.

        Accepts v4 (`rope_theta` at top level) and v5 (`rope_parameters`) layouts. Only default RoPE
        (no rope_scaling), no attention bias or dropout and no sliding-window layer are supported; anything else
        raises.
        Keys left out take transformers' defaults for the model_type (`_HF_DEFAULTS`); the RoPE base is required.
        """
        given = _as_dict(hf)
        source = "Qwen3Config.from_hf" + (f" ({_config_path(hf)})" if isinstance(hf, (str, os.PathLike)) else "")
        model_type = given.get("model_type", "qwen3")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise ConfigError(f"Qwen3Config.from_hf: model_type must be 'qwen3' or 'qwen3_moe', got {model_type!r}")
        if "num_local_experts" in given:  # v5's name (Qwen3MoeConfig.attribute_map: num_experts -> num_local_experts)
            given["num_experts"] = given.pop("num_local_experts")
        d = {**_HF_DEFAULTS[model_type], **given}
        for key in ("rope_parameters", "rope_scaling"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise ConfigError(f"{source}: {key} must be an object or null, got {type(d[key]).__name__} {d[key]!r}")
        rope_params = d.get("rope_parameters") or {}
        rope_scaling = d.get("rope_scaling")
        rope_type = rope_params.get("rope_type") or (rope_scaling or {}).get("rope_type") or (
            rope_scaling or {}).get("type") or "default"
        if rope_type != "default":
            raise ConfigError(f"Qwen3Config.from_hf: only rope_type 'default' is supported, got {rope_type!r}")
        theta = rope_params.get("rope_theta", d.get("rope_theta"))
        if theta is None:
            raise ConfigError("Qwen3Config.from_hf: config has neither rope_parameters.rope_theta nor rope_theta")
        d["rope_theta"] = theta
        _check_hf_types(d, source)  # before any value is compared or divided (no TypeError, no "false" read as true)
        if d.get("attention_bias", False):
            raise ConfigError("Qwen3Config.from_hf: attention_bias=True is not supported (Qwen3 has no biases)")
        windowed = _sliding_window_layers(d, model_type)
        if windowed:
            raise ConfigError(
                f"Qwen3Config.from_hf: sliding-window attention is not supported (trnkit's attention is full causal); "
                f"use_sliding_window={d.get('use_sliding_window')!r}, sliding_window={d.get('sliding_window')!r}, "
                f"max_window_layers={d.get('max_window_layers')!r} and layer_types make transformers window "
                f"layers {windowed}")
        if d.get("attention_dropout"):
            raise ConfigError("Qwen3Config.from_hf: attention_dropout must be 0 (trnkit's attention has no dropout, "
                              f"transformers drops attention weights in training), got {d['attention_dropout']!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"Qwen3Config.from_hf: hidden_act must be 'silu', got {d.get('hidden_act')!r}")
        n_heads = d["num_attention_heads"]
        num_experts = d.get("num_experts") or 0
        is_moe = model_type == "qwen3_moe" and num_experts != 0  # a negative count is refused by validate()
        # transformers' rules for the keys that may be null: head_dim = hidden_size // num_attention_heads,
        # num_key_value_heads = num_attention_heads (a 0 is kept, and refused by validate(), as transformers keeps it)
        head_dim = d.get("head_dim")
        if head_dim is None:
            if n_heads <= 0:
                raise ConfigError(f"{source}: num_attention_heads must be a positive int (head_dim is null: "
                                  f"hidden_size // num_attention_heads), got {n_heads!r}")
            head_dim = d["hidden_size"] // n_heads
        eos = d.get("eos_token_id")
        kw: dict[str, Any] = dict(
            dim=d["hidden_size"],
            n_layers=d["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=n_heads if d["num_key_value_heads"] is None else d["num_key_value_heads"],
            head_dim=head_dim,  # Qwen3MoeConfig has no head_dim default
            vocab_size=d["vocab_size"],
            hidden_dim=d["intermediate_size"],
            norm_eps=d["rms_norm_eps"],
            rope_theta=float(theta),
            max_seq_len=d["max_position_embeddings"],
            tie_word_embeddings=d["tie_word_embeddings"],
            init_std=d["initializer_range"],
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=list(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
        )
        if is_moe:
            kw.update(
                num_experts=num_experts,
                top_k=d["num_experts_per_tok"],
                moe_inter_dim=d["moe_intermediate_size"],
                norm_topk_prob=d["norm_topk_prob"],
                decoder_sparse_step=1 if d["decoder_sparse_step"] is None else d["decoder_sparse_step"],
                mlp_only_layers=_layers_of(d.get("mlp_only_layers") or [], d["num_hidden_layers"]),
                router_aux_loss_coef=d["router_aux_loss_coef"],
            )
        kw.update(overrides)
        try:
            return cls(**kw)
        except ConfigError as e:  # the rule in the native field's name; say which config.json key holds it
            rule = str(e).removeprefix("Qwen3Config: ")
            raise ConfigError(f"{source}: {rule}{_hf_names_in(rule, set(kw) - set(overrides))}") from None

    def to_hf(self, version: int = 5) -> dict[str, Any]:
        """config.json dict for transformers (`version=5`: rope_parameters; `4`: top-level rope_theta)."""
        if version not in (4, 5):
            raise ConfigError(f"Qwen3Config.to_hf: version must be 4 or 5, got {version!r}")
        d: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "intermediate_size": self.hidden_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.init_std,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if version == 5:
            d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        else:
            d["rope_theta"] = self.rope_theta
            d["rope_scaling"] = None
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.top_k,
                moe_intermediate_size=self.moe_inter_dim,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                output_router_logits=False,
            )
        return d


# What transformers 5 builds where a config.json leaves a key out: the field defaults of its Qwen3Config and
# Qwen3MoeConfig (not this dataclass's; e.g. a dense head_dim of 128, not hidden_size // num_attention_heads, and
# 128 experts, not a dense model). Qwen3MoeConfig has no head_dim field (hidden_size // num_attention_heads).
# rope_theta is the exception: transformers falls back to 10000, from_hf asks for it (Qwen3 uses 1e6).
_HF_COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  initializer_range=0.02)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(_HF_COMMON, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, head_dim=128),
    "qwen3_moe": dict(_HF_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
                      router_aux_loss_coef=0.001),
}


# The config.json key of each field from_hf reads (rope_theta: also rope_parameters.rope_theta).
_HF_KEYS = dict(dim="hidden_size", n_layers="num_hidden_layers", n_heads="num_attention_heads",
                n_kv_heads="num_key_value_heads", head_dim="head_dim", vocab_size="vocab_size",
                hidden_dim="intermediate_size", norm_eps="rms_norm_eps", rope_theta="rope_theta",
                max_seq_len="max_position_embeddings", tie_word_embeddings="tie_word_embeddings",
                init_std="initializer_range", bos_token_id="bos_token_id", eos_token_id="eos_token_id",
                pad_token_id="pad_token_id", num_experts="num_experts", top_k="num_experts_per_tok",
                moe_inter_dim="moe_intermediate_size", norm_topk_prob="norm_topk_prob",
                decoder_sparse_step="decoder_sparse_step", mlp_only_layers="mlp_only_layers",
                router_aux_loss_coef="router_aux_loss_coef")
# config.json keys that may be null (from_hf fills them in as transformers does)
_HF_NULLABLE = {"num_key_value_heads", "head_dim", "num_experts", "decoder_sparse_step", "mlp_only_layers"}
_WORDS = {int: "an int", float: "a number", bool: "a bool", type(None): "null", dict: "a dict"}


@functools.cache
def _field_types() -> dict[str, Any]:
    """Qwen3Config's field annotations (resolved)."""
    return typing.get_type_hints(Qwen3Config)


def _fits(tp: Any, value: Any) -> bool:
    """Whether ``value`` is of annotation ``tp``, as JSON types are: a bool is no number, an int is a valid float."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_fits(arg, value) for arg in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return isinstance(value, list) and all(_fits(typing.get_args(tp)[0], v) for v in value)
    if typing.get_origin(tp) is dict:  # kernels: its values are checked where the model binds them
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _described(tp: Any) -> str:
    """``int | list[int] | None`` -> "an int, a list of ints or null"."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    words = ["a list of ints" if typing.get_origin(a) is list else _WORDS[typing.get_origin(a) or a] for a in args]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _type_problem(name: str, tp: Any, value: Any) -> str | None:
    """``"<name> must be <type>, got <type> <value>"`` where ``value`` is not of annotation ``tp``, else None."""
    if _fits(tp, value):
        return None
    return f"{name} must be {_described(tp)}, got {type(value).__name__} {value!r}"


def _check_hf_types(d: dict[str, Any], source: str) -> None:
    """Every config.json value from_hf reads has its field's type, checked under the config.json key's name."""
    field_types = _field_types()
    for name, key in _HF_KEYS.items():
        if key in d:
            tp = field_types[name] | None if key in _HF_NULLABLE else field_types[name]
            problem = _type_problem(key, tp, d[key])
            if problem:
                raise ConfigError(f"{source}: {problem}")


def _hf_names_in(message: str, fields: set[str]) -> str:
    """`` (config.json: n_layers is num_hidden_layers)`` for the fields read from config.json that ``message``
    names and whose config.json key has another name."""
    named = [f"{f} is {key}" for f, key in _HF_KEYS.items()
             if f in fields and f != key and re.search(rf"\b{f}\b", message)]
    return f" (config.json: {', '.join(named)})" if named else ""


def _config_path(hf: str | os.PathLike) -> str:
    path = os.fspath(hf)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def _sliding_window_layers(d: dict[str, Any], model_type: str) -> list[int]:
    """The layers transformers 5 builds with sliding-window attention from config dict ``d``: a window exists only
    with ``use_sliding_window`` (default width 4096); Qwen3-MoE then windows every layer, Qwen3 the layers
    ``layer_types`` marks ``sliding_attention`` (by default those from ``max_window_layers``, 28, on)."""
    n_layers = d["num_hidden_layers"]
    window = d.get("sliding_window", 4096) if d.get("use_sliding_window") else None
    if model_type == "qwen3_moe":
        return list(range(n_layers)) if window is not None else []
    types = d.get("layer_types") or ["sliding_attention" if window is not None and i >= d.get("max_window_layers", 28)
                                     else "full_attention" for i in range(n_layers)]
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _layers_of(indices: list[int], n_layers: int) -> list[int]:
    """A transformers config's ``mlp_only_layers`` less the indices of no layer: transformers accepts them and
    never selects them (``layer_idx in mlp_only_layers``), so they are dropped, with a warning naming them."""
    outside = [i for i in indices if not 0 <= i < n_layers]
    if outside:
        warnings.warn(f"Qwen3Config.from_hf: mlp_only_layers {outside} name no layer of this {n_layers}-layer model "
                      "(transformers never selects them); dropped", stacklevel=3)
    return [i for i in indices if 0 <= i < n_layers]


def _as_dict(hf: Any) -> dict[str, Any]:
    if isinstance(hf, dict):
        return dict(hf)
    if isinstance(hf, (str, os.PathLike)):
        path = os.fspath(hf)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"Qwen3Config.from_hf: {path} is not valid JSON ({e})") from e
    if hasattr(hf, "to_dict"):
        return hf.to_dict()
    raise TypeError(f"Qwen3Config.from_hf: expected a dict, a path or a transformers config, got {type(hf).__name__}")


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device: Any = None) -> "torch.Tensor":
    """Packed fp32 RoPE cache `[max_seq_len, 2*head_dim]` = cat(cos, sin), computed like HF in fp32."""
    import torch

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(max_seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.cat([emb.cos(), emb.sin()], dim=-1)


__all__ = ["Qwen3Config", "rope_cache"]
