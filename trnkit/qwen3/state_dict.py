"""State-dict adapter between trnkit's native Qwen3 names and Hugging Face names — one key-map table.

HF layouts understood on load:
- hub / on-disk (what `save_pretrained` writes, and every published checkpoint): per-expert
  `model.layers.{L}.mlp.experts.{E}.{gate,up}_proj.weight [I, H]`, `...down_proj.weight [H, I]`;
- transformers v5 in-memory (`model.state_dict()`): fused `mlp.experts.gate_up_proj [E, 2I, H]`
  (gate rows first) and `mlp.experts.down_proj [E, H, I]`.
Native experts: `w_gate_up [E, H, 2I]` (gate columns first), `w_down [E, I, H]`.
`check_keys` validates HF keys/shapes against the native model (one place for the error messages of
both the in-memory `from_hf` and `checkpoint.load_hf_checkpoint`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trnkit.errors import TrnkitError

from .config import Qwen3Config

# (HF pattern, native pattern, kind). {L} = layer index, {E} = expert index.
# kind: "param" copies the tensor; "gate"/"up"/"down" are per-expert slices of a native expert tensor
# (transposed); "fused_gate_up"/"fused_down" are v5 fused tensors (transposed); "ignore" is dropped.
# check_keys adds one more kind, "tied": a tied model's stored lm_head, checked against the embedding.
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
    if key.kind in ("param", "tied"):
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
    """Write one HF tensor into its native parameter (in place, casting to dst's dtype); for a "tied" key, check
    the stored lm_head against the embedding already written (:func:`check_keys` orders it after it)."""
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
    elif key.kind == "tied":
        _check_tied_head(dst, src)
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


class CheckpointError(TrnkitError, ValueError):
    """A checkpoint that cannot be loaded: bad file, or keys/shapes that do not fit the config."""


def _check_tied_head(embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
    """A tied model's stored ``lm_head.weight`` must equal the embedding already loaded (in the model's dtype):
    transformers 5 loads a tied config whose checkpoint holds two different tensors untied, so dropping the
    head would give other logits."""
    head = lm_head.to(embedding.dtype)
    if not torch.equal(embedding, head):
        diff = (embedding.float() - head.float()).abs().max().item()
        raise CheckpointError(
            "Qwen3 checkpoint: tie_word_embeddings=True makes lm_head.weight the embedding, but the checkpoint's "
            f"lm_head.weight differs from model.embed_tokens.weight (max |diff| {diff:.3g}); transformers loads "
            "such a checkpoint untied: set tie_word_embeddings to false in its config.json (or pass config=...)")


def _describe(config: Qwen3Config) -> str:
    c = config
    s = (f"dim={c.dim}, n_layers={c.n_layers}, n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads}, "
         f"head_dim={c.head_dim}, vocab_size={c.vocab_size}, hidden_dim={c.hidden_dim}")
    if c.is_moe:
        s += f", num_experts={c.num_experts}, moe_inter_dim={c.moe_inter_dim}, mlp_only_layers={c.mlp_only_layers}"
    return s


def _listing(title: str, items: list[str], limit: int = 20) -> str:
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {x}" for x in items[:limit]) + more


def _inferred(hf_shapes: Mapping[str, tuple[int, ...]], bare: bool = False) -> str:
    """What the weights themselves say about the architecture (for config/weights mismatch errors); ``bare``: the
    keys of a bare Qwen3Model (no ``model.`` prefix)."""
    pre = "" if bare else r"model\."
    facts = ["a bare Qwen3Model's keys (no 'model.' prefix)"] if bare else []
    emb = hf_shapes.get("embed_tokens.weight" if bare else "model.embed_tokens.weight")
    if emb is not None and len(emb) == 2:
        facts += [f"vocab_size={emb[0]}", f"dim={emb[1]}"]
    layers = {int(m[1]) for k in hf_shapes if (m := re.match(rf"^{pre}layers\.(\d+)\.", k))}
    if layers:
        facts.append(f"n_layers={max(layers) + 1}")
    experts = {int(m[1]) for k in hf_shapes if (m := re.match(rf"^{pre}layers\.\d+\.mlp\.experts\.(\d+)\.", k))}
    if experts:
        facts.append(f"num_experts={max(experts) + 1}")
    return ", ".join(facts)


def _bare_base_model(keys: Iterable[str]) -> bool:
    """Whether ``keys`` are a bare ``Qwen3Model``'s (``embed_tokens.weight``, ``layers.0...``: what
    ``AutoModel.from_pretrained(...).save_pretrained`` writes): none has the ``model.`` prefix, some are Qwen3 keys
    with it. transformers adds the prefix when it loads them into a ``*ForCausalLM``."""
    keys = list(keys)
    return not any(k.startswith("model.") for k in keys) and any(map_hf_key("model." + k) for k in keys)


def check_keys(hf_shapes: Mapping[str, tuple[int, ...]], native_shapes: Mapping[str, torch.Size],
               config: Qwen3Config, source: str) -> dict[str, HFKey]:
    """Validate HF keys/shapes against the native model; return {hf_key: HFKey} for the keys to copy.

    A bare ``Qwen3Model`` checkpoint (keys without the ``model.`` prefix) is read as transformers'
    ``*ForCausalLM`` reads it, with the prefix. Raises CheckpointError listing every unexpected, missing and
    mis-shaped key by name.
    """
    bare = _bare_base_model(hf_shapes)
    plan: dict[str, HFKey] = {}
    unexpected, bad_shape = [], []
    covered: dict[str, set[Any]] = {}
    for hf_key, shape in hf_shapes.items():
        key = map_hf_key("model." + hf_key if bare and not hf_key.startswith("lm_head.") else hf_key)
        if key is not None and key.kind == "ignore":
            continue
        if key is None or key.native not in native_shapes:
            unexpected.append(hf_key)
            continue
        if key.native == "lm_head.weight" and config.tie_word_embeddings:
            key = HFKey("tok_embeddings.weight", "tied")  # tied: lm_head is the embedding (see below)
        native_shape = native_shapes[key.native]
        if key.expert is not None and key.expert >= native_shape[0]:
            unexpected.append(f"{hf_key} (expert {key.expert} >= num_experts {native_shape[0]})")
            continue
        if key.kind != "tied":
            covered.setdefault(key.native, set()).add("all" if key.expert is None else (key.kind, key.expert))
        want = expected_hf_shape(key, native_shape)
        if tuple(shape) != want:
            bad_shape.append(f"{hf_key}: expected {list(want)}, got {list(shape)}")  # present: not "missing"
            continue
        plan[hf_key] = key
    # A tied checkpoint may store the embedding, lm_head or both (transformers ties either to the other): a lone
    # lm_head is read into the embedding; next to the embedding it is checked against it, after it (last in plan).
    for hf_key in [k for k, v in plan.items() if v.kind == "tied"]:
        del plan[hf_key]
        if "tok_embeddings.weight" in covered:
            plan[hf_key] = HFKey("tok_embeddings.weight", "tied")
        else:
            plan[hf_key] = HFKey("tok_embeddings.weight", "param")
            covered["tok_embeddings.weight"] = {"all"}

    missing = []
    for name, shape in native_shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        got = covered.get(name, set())
        if "all" in got:
            continue
        m = re.match(r"^layers\.(\d+)\.moe\.experts\.(w_gate_up|w_down)$", name)
        if m:
            parts = ("gate", "up") if m[2] == "w_gate_up" else ("down",)
            missing += [f"model.layers.{m[1]}.mlp.experts.{e}.{p}_proj.weight"
                        for e in range(shape[0]) for p in parts if (p, e) not in got]
        else:
            missing.append(next(h for h, _ in native_to_hf_items({name: torch.empty(0)}, config)))
    if unexpected or missing or bad_shape:
        parts = [f"Qwen3 checkpoint {source} does not match the config ({_describe(config)}); "
                 f"the weights look like: {_inferred(hf_shapes, bare) or 'nothing recognisable'}"]
        if missing:
            parts.append(_listing("missing keys", missing))
        if unexpected:
            parts.append(_listing("unexpected keys", unexpected))
        if bad_shape:
            parts.append(_listing("mis-shaped keys", bad_shape))
        raise CheckpointError("\n".join(parts))
    return plan


def to_hf(native: Mapping[str, torch.Tensor], config: Qwen3Config,
          fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Native state dict -> HF state dict (contiguous tensors)."""
    return {k: v.contiguous() for k, v in native_to_hf_items(native, config, fused_experts)}


def from_hf(hf: Mapping[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """HF state dict (hub per-expert or v5 fused layout) -> native state dict, validated.

    Builds the native tensors on the meta device first to know every shape, then fills them.
    """
    from .model import Qwen3Model

    for k, v in hf.items():  # as load_hf_checkpoint: every parameter is floating point, nothing is cast to it
        if not (isinstance(v, torch.Tensor) and v.is_floating_point()):
            what = f"dtype {v.dtype}" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}, not a tensor"
            raise CheckpointError(f"state_dict_from_hf: {k} is {what}; its parameter needs a floating-point tensor, "
                                  "refusing to cast")
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
