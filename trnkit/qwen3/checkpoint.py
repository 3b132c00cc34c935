"""Hugging Face safetensors checkpoints in and out of the native Qwen3Model.

`load_hf_checkpoint(path)` reads a folder with config.json and either `model.safetensors` or a sharded
set with `model.safetensors.index.json`. Tensors are read one at a time from the memory-mapped files
straight into the (already allocated) model parameters, so peak memory is the model plus one tensor.
`save_hf_checkpoint(model, path, max_shard_size=...)` writes the hub layout that
`transformers.AutoModelForCausalLM.from_pretrained(path)` loads with no missing or unexpected keys.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trnkit.errors import ConfigError

from .config import Qwen3Config
from .model import Qwen3Model
from .state_dict import CheckpointError, HFKey, check_keys, copy_hf_tensor, native_to_hf_items

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


# ------------------------------------------------------------------------------------ loading
def _open(path: str):  # -> safetensors handle
    if not os.path.isfile(path):
        raise CheckpointError(f"Qwen3 checkpoint: file {path} does not exist")
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"Qwen3 checkpoint: {path} is corrupt or truncated ({e})") from e


def _inside(folder: str, fname: Any, index: str, key: str) -> str:
    """The shard file `fname` named by the index, which must resolve (links followed) inside `folder`."""
    if not isinstance(fname, str) or not fname or os.path.isabs(fname):
        raise CheckpointError(f"Qwen3 checkpoint: {index} maps {key} to {fname!r}; a shard must be a file name "
                              "relative to the checkpoint folder")
    path = os.path.join(folder, fname)
    root = os.path.realpath(folder)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise CheckpointError(f"Qwen3 checkpoint: {index} maps {key} to {fname!r}, which resolves to "
                              f"{os.path.realpath(path)}, outside the checkpoint folder {root}; refusing to read it")
    return path


def shard_files(folder: str) -> dict[str, list[str]]:
    """{model.safetensors: []} (all keys), else {file path: [keys it should hold]} from the index: transformers'
    order, so a stale index beside model.safetensors (``save_pretrained`` leaves one when it saves a folder that
    was sharded unsharded) is ignored, as transformers ignores it."""
    single = os.path.join(folder, SINGLE_NAME)
    if os.path.isfile(single):
        return {single: []}
    index = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"Qwen3 checkpoint: {index} is not a valid safetensors index ({e!r})") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"Qwen3 checkpoint: {index}: weight_map must be an object, got "
                                  f"{type(weight_map).__name__}")
        files: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            files.setdefault(_inside(folder, fname, index, key), []).append(key)
        return files
    found = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if len(found) == 1:
        return {os.path.join(folder, found[0]): []}
    raise CheckpointError(f"Qwen3 checkpoint: {folder} has no {SINGLE_NAME} or {INDEX_NAME}"
                          + (f" (found {found})" if found else ""))


def _default_dtype(folder: str, stored: set[str]) -> torch.dtype:
    """config.json's `dtype` (v5) / `torch_dtype` (v4) if set, else the stored dtype if there is one, else fp32.
    A set value must name a floating-point torch dtype (the parameters are cast to it)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError):
        d = {}
    key = next((k for k in ("dtype", "torch_dtype") if isinstance(d, dict) and d.get(k) is not None), None)
    if key is not None:
        dtype = getattr(torch, d[key], None) if isinstance(d[key], str) else None
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise CheckpointError(f"Qwen3 checkpoint: {path}: {key} must name a floating-point torch dtype (e.g. "
                                  f"'bfloat16', 'float32'; or pass dtype=...), got {d[key]!r}")
        return dtype
    return _ST_DTYPES.get(next(iter(stored)), torch.float32) if len(stored) == 1 else torch.float32


def _read_into(dst: torch.Tensor, key: HFKey, handle: Any, hf_key: str, fpath: str) -> None:
    """Read one tensor from an open safetensors file and copy it into its native parameter. The file
    tensor lives only in this call, so the loader holds at most one at a time (peak memory = the model
    plus one tensor)."""
    try:
        src = handle.get_tensor(hf_key)
    except SafetensorError as e:
        raise CheckpointError(f"Qwen3 checkpoint: cannot read {hf_key} from {fpath} (corrupt or truncated: {e})") from e
    copy_hf_tensor(dst, key, src)


def load_hf_checkpoint(path: str | os.PathLike, config: Qwen3Config | None = None,
                       dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> Qwen3Model:
    """Build a Qwen3Model from an HF checkpoint folder (config.json + safetensors [+ index]).

    `config`: use this instead of config.json. `dtype`: parameter dtype (None: config.json's dtype, else
    the stored dtype);
    the rope cache stays fp32. Accepts the hub per-expert and the v5 fused expert layouts.
    """
    folder = os.fspath(path)
    _check_dtype("load_hf_checkpoint", dtype)
    if config is not None and not isinstance(config, Qwen3Config):
        raise ConfigError(f"load_hf_checkpoint: config must be a Qwen3Config or None (None: the folder's config.json), "
                          f"got {type(config).__name__}")
    if not os.path.isdir(folder):
        raise CheckpointError(f"Qwen3 checkpoint: {folder} is not a directory")
    if config is None:
        cfg_path = os.path.join(folder, "config.json")
        if not os.path.isfile(cfg_path):
            raise CheckpointError(f"Qwen3 checkpoint: {folder} has no config.json (pass config=...)")
        config = Qwen3Config.from_hf(cfg_path)

    handles, hf_shapes, stored_dtypes = {}, {}, set()
    owner: dict[str, str] = {}
    try:
        for fpath, listed in shard_files(folder).items():
            h = handles[fpath] = _open(fpath)
            keys = list(h.keys())
            absent = sorted(set(listed) - set(keys))
            if absent:
                raise CheckpointError(f"Qwen3 checkpoint: index lists keys that {fpath} does not hold: "
                                      f"{absent[:10]}" + (" ..." if len(absent) > 10 else ""))
            for k in keys:
                if k in owner:
                    raise CheckpointError(f"Qwen3 checkpoint: key {k} is stored twice ({owner[k]}, {fpath})")
                owner[k] = fpath
                sl = h.get_slice(k)
                hf_shapes[k] = tuple(sl.get_shape())
                if sl.get_dtype() not in _ST_DTYPES:  # every native parameter is floating point
                    raise CheckpointError(f"Qwen3 checkpoint: {k} in {fpath} has dtype {sl.get_dtype()}; its "
                                          f"parameter needs a floating-point tensor ({', '.join(_ST_DTYPES)}), "
                                          "refusing to cast")
                stored_dtypes.add(sl.get_dtype())

        with torch.device("meta"):
            model = Qwen3Model(config)
        native_shapes = {k: v.shape for k, v in model.state_dict().items()}
        plan = check_keys(hf_shapes, native_shapes, config, source=folder)

        if dtype is None:
            dtype = _default_dtype(folder, stored_dtypes)
        model.to(dtype=dtype)
        model.to_empty(device=device)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.tok_embeddings.weight
        params = dict(model.named_parameters())
        with torch.no_grad():
            for hf_key, key in plan.items():
                _read_into(params[key.native], key, handles[owner[hf_key]], hf_key, owner[hf_key])
        return model
    finally:
        handles.clear()


def _check_dtype(fn: str, dtype: Any) -> None:
    """``dtype`` (the parameters' dtype) is None or a floating-point torch dtype: every Qwen3 parameter is one."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"{fn}: dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, "
                          f"got {dtype!r}")


# ------------------------------------------------------------------------------------ saving
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB" (10^9) / "500MiB" (2^20), as HF's max_shard_size."""
    m = _SIZE_RE.match(size) if isinstance(size, str) else None
    if not (m or isinstance(size, int)) or isinstance(size, bool):
        raise ConfigError(f"save_hf_checkpoint: cannot parse max_shard_size {size!r} (e.g. '5GB', '200MiB', 10**9)")
    nbytes = int(float(m[1]) * _UNITS[(m[2] or "B").upper()]) if m else size
    if nbytes <= 0:
        raise ConfigError(f"save_hf_checkpoint: max_shard_size must be at least 1 byte, got {size!r}")
    return nbytes


def _shards(items: Iterable[tuple[str, torch.Tensor]], limit: int, dtype: torch.dtype | None
            ) -> list[list[tuple[str, torch.Tensor]]]:
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for k, t in items:
        nbytes = t.numel() * (t.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((k, t))
        size += nbytes
    return shards


def save_hf_checkpoint(model: Qwen3Model, path: str | os.PathLike, max_shard_size: int | str = "5GB",
                       dtype: torch.dtype | None = None, fused_experts: bool = False,
                       config_version: int = 5) -> list[str]:
    """Write config.json + safetensors (+ index when sharded) in the HF hub layout; return the files.

    One shard is `model.safetensors`; more are `model-0000i-of-0000N.safetensors` with
    `model.safetensors.index.json`. Tied models do not store lm_head.weight. `fused_experts=True`
    writes the v5 in-memory expert layout instead of per-expert keys. Shards are materialised one at a
    time (expert slices are transposed copies).
    """
    folder = os.fspath(path)
    _check_dtype("save_hf_checkpoint", dtype)
    limit = parse_size(max_shard_size)
    os.makedirs(folder, exist_ok=True)
    cfg = model.config
    items = list(native_to_hf_items(model.state_dict(), cfg, fused_experts))
    shards = _shards(items, limit, dtype)
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        tensors = {}
        for k, t in shard:
            t = (t.detach().to(dtype) if dtype is not None else t.detach()).contiguous()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # save_file refuses views into a larger storage (e.g. an expert slice)
            tensors[k] = t
            total += tensors[k].numel() * tensors[k].element_size()
            weight_map[k] = name
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        del tensors
    # Remove stale files of an earlier save with a different sharding.
    for f in os.listdir(folder):
        if (f == INDEX_NAME or re.match(r"^model(-\d{5}-of-\d{5})?\.safetensors$", f)) and f not in names:
            os.remove(os.path.join(folder, f))
    if n > 1:
        with open(os.path.join(folder, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                      indent=2)
    out_dtype = dtype or next(model.parameters()).dtype
    hf_cfg = cfg.to_hf(version=config_version)
    hf_cfg["dtype" if config_version == 5 else "torch_dtype"] = str(out_dtype).removeprefix("torch.")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    return [os.path.join(folder, x) for x in names] + ([os.path.join(folder, INDEX_NAME)] if n > 1 else [])
