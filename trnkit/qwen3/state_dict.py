"""State-dict adapter between trnkit's native Qwen3 names and Hugging Face names — one key-map table.

HF layouts understood on load:
- hub / on-disk (what `save_pretrained` writes, and every published checkpoint): per-expert
  `model.layers.{L}.mlp.experts.{E}.{gate,up}_proj.weight [I, H]`, `...down_proj.weight [H, I]`;
- transformers v5 in-memory (`model.state_dict()`): fused `mlp.experts.gate_up_proj [E, 2I, H]`
  (gate rows first) and `mlp.experts.down_proj [E, H, I]`.
Native experts: `w_gate_up [E, H, 2I]` (gate columns first), `w_down [E, I, H]`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from .config import Qwen3Config

# (HF pattern, native pattern, kind). {L} = layer index, {E} = expert index.
# kind: "param" copies the tensor; "gate"/"up"/"down" are per-expert slices of a native expert tensor
# (transposed); "fused_gate_up"/"fused_down" are v5 fused tensors (transposed); "ignore" is dropped.
KEY_MAP: list[tuple[str, str | None, str]] = [
    ("model.embed_tokens.weight", "tok_embeddings.weight", "param"),
    ("model.norm.weight", "norm.weight", "param"),
    ("lm_head.weight", "lm_head.weight", "param"),
    ("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight", "param"),
    ("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight", "param"),
    ("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.wq.weight", "param"),
    ("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.attention.wk.weight", "param"),
    ("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.attention.wv.weight", "param"),
    ("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight", "param"),
    ("model.layers.{L}.self_attn.q_norm.weight", "layers.{L}.attention.q_norm.weight", "param"),
    ("model.layers.{L}.self_attn.k_norm.weight", "layers.{L}.attention.k_norm.weight", "param"),
    ("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.feed_forward.w1.weight", "param"),
    ("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.feed_forward.w3.weight", "param"),
    ("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.feed_forward.w2.weight", "param"),
    ("model.layers.{L}.mlp.gate.weight", "layers.{L}.moe.router.gate.weight", "param"),
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "layers.{L}.moe.experts.w_gate_up", "gate"),
    ("model.layers.{L}.mlp.experts.{E}.up_proj.weight", "layers.{L}.moe.experts.w_gate_up", "up"),
    ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "layers.{L}.moe.experts.w_down", "down"),
    ("model.layers.{L}.mlp.experts.gate_up_proj", "layers.{L}.moe.experts.w_gate_up", "fused_gate_up"),
    ("model.layers.{L}.mlp.experts.down_proj", "layers.{L}.moe.experts.w_down", "fused_down"),
    ("model.layers.{L}.self_attn.rotary_emb.inv_freq", None, "ignore"),  # old checkpoints carry it
]


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)") + "$")


_HF_RE = [(_compile(h), n, k) for h, n, k in KEY_MAP]


@dataclass(frozen=True)
class HFKey:
    """Where one HF tensor goes: `native` (None for ignored keys), `kind`, the expert index if any."""
    native: str | None
    kind: str
    layer: int | None = None
    expert: int | None = None


def map_hf_key(key: str) -> HFKey | None:
    """Native destination of an HF key; None if the key is not a Qwen3 key at all."""
    for rx, native, kind in _HF_RE:
        m = rx.match(key)
        if m:
            layer = int(m["L"]) if "L" in rx.groupindex else None
            expert = int(m["E"]) if "E" in rx.groupindex else None
            name = None if native is None else native.replace("{L}", str(layer))
            return HFKey(name, kind, layer, expert)
    return None


def expected_hf_shape(key: HFKey, native_shape: torch.Size) -> tuple[int, ...]:
    """Shape the HF tensor must have, given the native parameter's shape."""
    if key.kind == "param":
        return tuple(native_shape)
    E, a, b = native_shape        # w_gate_up [E, H, 2I] / w_down [E, I, H]
    if key.kind in ("gate", "up"):
        return (b // 2, a)         # [I, H]
    if key.kind == "down":
        return (b, a)              # [H, I]
    if key.kind == "fused_gate_up":
        return (E, b, a)           # [E, 2I, H]
    if key.kind == "fused_down":
        return (E, b, a)           # [E, H, I]
    raise ValueError(f"expected_hf_shape: no shape for kind {key.kind!r}")


def copy_hf_tensor(dst: torch.Tensor, key: HFKey, src: torch.Tensor) -> None:
    """Write one HF tensor into its native parameter (in place, casting to dst's dtype)."""
    if key.kind == "param":
        dst.copy_(src)
    elif key.kind in ("gate", "up"):
        inter = dst.shape[-1] // 2
        cols = slice(0, inter) if key.kind == "gate" else slice(inter, 2 * inter)
        dst[key.expert, :, cols].copy_(src.t())
    elif key.kind == "down":
        dst[key.expert].copy_(src.t())
    elif key.kind in ("fused_gate_up", "fused_down"):
        dst.copy_(src.transpose(1, 2))
    else:
        raise ValueError(f"copy_hf_tensor: cannot copy kind {key.kind!r}")


def native_to_hf_items(native: Mapping[str, torch.Tensor], config: Qwen3Config,
                       fused_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF key, tensor view) for a native state dict. Tied models drop lm_head.weight.

    `fused_experts=False` writes the hub per-expert layout; True the v5 fused layout. Expert tensors
    are yielded as (non-contiguous) views; callers copy what they write.
    """
    inverse = {n: (h, k) for h, n, k in KEY_MAP if n is not None and k in ("param",)}
    for name, t in native.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        m = re.match(r"^layers\.(\d+)\.(.*)$", name)
        layer, rest = (m[1], m[2]) if m else (None, name)
        generic = f"layers.{{L}}.{rest}" if m else name
        pre = f"model.layers.{layer}.mlp.experts" if m else ""
        if generic == "layers.{L}.moe.experts.w_gate_up":
            if fused_experts:
                yield f"{pre}.gate_up_proj", t.transpose(1, 2)
            else:
                inter = t.shape[-1] // 2
                for e in range(t.shape[0]):
                    yield f"{pre}.{e}.gate_proj.weight", t[e, :, :inter].t()
                    yield f"{pre}.{e}.up_proj.weight", t[e, :, inter:].t()
        elif generic == "layers.{L}.moe.experts.w_down":
            if fused_experts:
                yield f"{pre}.down_proj", t.transpose(1, 2)
            else:
                for e in range(t.shape[0]):
                    yield f"{pre}.{e}.down_proj.weight", t[e].t()
        elif generic in inverse:
            hf = inverse[generic][0]
            yield (hf.replace("{L}", layer) if layer is not None else hf), t
        else:
            raise KeyError(f"Qwen3 state-dict adapter: native key {name!r} has no HF mapping")


def to_hf(native: Mapping[str, torch.Tensor], config: Qwen3Config,
          fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Native state dict -> HF state dict (contiguous tensors)."""
    return {k: v.contiguous() for k, v in native_to_hf_items(native, config, fused_experts)}


def from_hf(hf: Mapping[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """HF state dict (hub per-expert or v5 fused layout) -> native state dict, validated.

    Builds the native tensors on the meta device first to know every shape, then fills them.
    """
    from .checkpoint import check_keys  # shared validation (one place for the error messages)
    from .model import Qwen3Model

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3Model(config).state_dict().items()}
    plan = check_keys({k: tuple(v.shape) for k, v in hf.items()}, shapes, config, source="state dict")
    dtype = next(iter(hf.values())).dtype if hf else torch.float32
    out = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    for hf_key, key in plan.items():
        copy_hf_tensor(out[key.native], key, hf[hf_key])
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["tok_embeddings.weight"]
    return out
