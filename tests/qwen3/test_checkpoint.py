"""safetensors save/load: bit-exact round trips, sharding, dtype control, HF interop, bad checkpoints."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from trnkit.errors import ConfigError
from trnkit.qwen3 import Qwen3Model, state_dict_from_hf
from trnkit.qwen3.checkpoint import CheckpointError, load_hf_checkpoint, parse_size, save_hf_checkpoint

from .hf_utils import hf_model, native_config


def _random_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen3Model:
    torch.manual_seed(seed)
    model = Qwen3Model(native_config(name))
    model.init_weights()
    return model.to(dtype)


def _assert_bit_exact(a: Qwen3Model, b: Qwen3Model) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
    assert torch.equal(a.rope_cache, b.rope_cache) and b.rope_cache.dtype == torch.float32


@pytest.mark.parametrize("name", ["dense-tied-gqa2", "moe-mlp-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bit_exact(name: str, dtype: torch.dtype, tmp_path) -> None:
    model = _random_model(name, dtype=dtype)
    files = save_hf_checkpoint(model, tmp_path)
    assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    loaded = load_hf_checkpoint(tmp_path)
    _assert_bit_exact(model, loaded)
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in load_file(files[0])
        assert loaded.lm_head.weight is loaded.tok_embeddings.weight


def test_sharded_save_reloads_in_trnkit_and_hf(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = _random_model("moe-norm", seed=1)
    files = save_hf_checkpoint(model, tmp_path, max_shard_size="100KB")
    shards = [f for f in files if f.endswith(".safetensors")]
    n = len(shards)
    assert n > 3 and [os.path.basename(f) for f in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors"
                                                                for i in range(1, n + 1)]
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    on_disk = {k: os.path.basename(f) for f in shards for k in load_file(f)}
    assert index["weight_map"] == on_disk
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for f in shards for t in load_file(f).values())
    # every shard but those holding a single oversized tensor respects the limit
    for f in shards:
        tensors = load_file(f)
        assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors.values()) <= 100_000
    _assert_bit_exact(model, load_hf_checkpoint(tmp_path))
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # re-saving unsharded removes the stale shards and index
    save_hf_checkpoint(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_hf_sharded_checkpoint_loads(tmp_path) -> None:
    hf = hf_model("moe-mlp-only")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_hf_checkpoint(tmp_path)
    one = tmp_path / "one"
    hf.save_pretrained(one)
    _assert_bit_exact(model, load_hf_checkpoint(one))


def test_stale_index_beside_single_file_is_ignored_as_transformers_does(tmp_path) -> None:
    """save_pretrained into a folder that held a sharded save leaves the old index beside the new
    model.safetensors; transformers reads model.safetensors first, and so does trnkit (before, it followed the
    stale index to shards that were gone)."""
    from transformers import AutoModelForCausalLM

    hf_model("dense-gqa4", seed=1).save_pretrained(tmp_path, max_shard_size="50KB")
    hf_model("dense-gqa4", seed=2).save_pretrained(tmp_path)
    assert {"model.safetensors", "model.safetensors.index.json"} <= set(os.listdir(tmp_path))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    toks = torch.randint(0, ref.config.vocab_size, (2, 7))
    with torch.no_grad():
        assert (load_hf_checkpoint(tmp_path).eval()(toks) - ref(toks).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["dense-tied-gqa2", "moe-nonorm-tied"])
def test_bare_base_model_checkpoint_loads_as_transformers_does(name: str, tmp_path) -> None:
    """A bare Qwen3Model's checkpoint (AutoModel's save_pretrained: keys without the 'model.' prefix; tied, so
    complete) loads into transformers' *ForCausalLM with the prefix added; trnkit reads it the same way (before:
    'the weights look like: nothing recognisable', every key missing and unexpected)."""
    from transformers import AutoModel, AutoModelForCausalLM

    hf_model(name).model.save_pretrained(tmp_path)  # the base model of a tied *ForCausalLM, saved alone
    assert "embed_tokens.weight" in load_file(tmp_path / "model.safetensors")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(ref.model.norm.weight, AutoModel.from_pretrained(tmp_path).norm.weight)
    toks = torch.randint(0, ref.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert (load_hf_checkpoint(tmp_path).eval()(toks) - ref(toks).logits).abs().max().item() <= 1e-5
    _edit(tmp_path, lambda sd: sd.pop("norm.weight"))
    with pytest.raises(CheckpointError, match=r"the weights look like: a bare Qwen3Model's keys \(no 'model.' "
                                              r"prefix\), vocab_size=160, dim=64, n_layers=3(?s:.*)missing keys "
                                              r"\(1\):\n    model.norm.weight"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("stored", ["lm_head equal", "lm_head only", "lm_head different"])
def test_tied_checkpoint_storing_lm_head(stored: str, tmp_path) -> None:
    """A tied config's checkpoint may hold the embedding, lm_head or both (transformers 5 ties whichever is there,
    and loads two different tensors untied): trnkit gives transformers' logits, or refuses where it would
    have to untie (before, it dropped a differing lm_head and gave other logits)."""
    from transformers import AutoModelForCausalLM

    hf = hf_model("dense-tied-gqa2")
    hf.save_pretrained(tmp_path)
    emb = "model.embed_tokens.weight"
    edit = {"lm_head equal": lambda sd: sd.update({"lm_head.weight": sd[emb].clone()}),
            "lm_head only": lambda sd: sd.update({"lm_head.weight": sd.pop(emb)}),
            "lm_head different": lambda sd: sd.update({"lm_head.weight": torch.randn_like(sd[emb])})}
    _edit(tmp_path, edit[stored])
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    toks = torch.randint(0, hf.config.vocab_size, (2, 9))
    if stored == "lm_head different":
        assert ref.lm_head.weight.data_ptr() != ref.model.embed_tokens.weight.data_ptr()  # untied by transformers
        with pytest.raises(CheckpointError, match=r"tie_word_embeddings=True makes lm_head.weight the embedding, "
                                                  r"but the checkpoint's lm_head.weight differs from "
                                                  r"model.embed_tokens.weight \(max \|diff\| [0-9.e+-]+\); "
                                                  "transformers loads such a checkpoint untied"):
            load_hf_checkpoint(tmp_path)
        with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
            state_dict_from_hf(load_file(tmp_path / "model.safetensors"), native_config("dense-tied-gqa2"))
        return
    model = load_hf_checkpoint(tmp_path).eval()
    assert model.lm_head.weight is model.tok_embeddings.weight
    with torch.no_grad():
        assert (model(toks) - ref(toks).logits).abs().max().item() <= 1e-5


def test_dtype_control_and_fused_layout(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = _random_model("moe-nonorm-tied", seed=2)
    save_hf_checkpoint(model, tmp_path, fused_experts=True, dtype=torch.bfloat16)
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert json.load(open(tmp_path / "config.json"))["dtype"] == "bfloat16"
    as_bf16 = load_hf_checkpoint(tmp_path)  # default: config.json's dtype
    assert all(p.dtype == torch.bfloat16 for p in as_bf16.parameters())
    cfg = json.load(open(tmp_path / "config.json"))
    json.dump({k: v for k, v in cfg.items() if k != "dtype"}, open(tmp_path / "config.json", "w"))
    assert load_hf_checkpoint(tmp_path).tok_embeddings.weight.dtype == torch.bfloat16  # else the stored one
    json.dump({**cfg, "dtype": "float16"}, open(tmp_path / "config.json", "w"))
    assert load_hf_checkpoint(tmp_path).tok_embeddings.weight.dtype == torch.float16
    as_f32 = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    for (n, p), q in zip(model.named_parameters(), as_f32.parameters()):
        assert q.dtype == torch.float32
        assert torch.equal(q, p.to(torch.bfloat16).float()), n
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    sd = hf.state_dict()
    e = model.layers[0].moe.experts
    assert torch.equal(sd["model.layers.0.mlp.experts.gate_up_proj"], e.w_gate_up.transpose(1, 2).bfloat16().float())
    assert torch.equal(sd["model.layers.0.mlp.experts.down_proj"], e.w_down.transpose(1, 2).bfloat16().float())


def test_config_versions_round_trip(tmp_path) -> None:
    model = _random_model("dense-untied-mha")
    save_hf_checkpoint(model, tmp_path, config_version=4)
    d = json.load(open(tmp_path / "config.json"))
    assert d["rope_theta"] == 10000.0 and "rope_parameters" not in d and d["torch_dtype"] == "float32"
    assert load_hf_checkpoint(tmp_path).config == model.config
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path)  # transformers reads the legacy v4 layout too
    assert hf.config.rope_parameters["rope_theta"] == 10000.0
    toks = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        assert (hf.eval()(toks).logits - model.eval()(toks)).abs().max().item() <= 1e-4


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("200MiB") == 200 * 2**20 and parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


@pytest.mark.parametrize("size, rule", [
    ("0GB", "max_shard_size must be at least 1 byte, got '0GB'"),
    ("0.1B", "max_shard_size must be at least 1 byte, got '0.1B'"),
    (0, "max_shard_size must be at least 1 byte, got 0"),
    (True, "cannot parse max_shard_size True"),
    (0.5, "cannot parse max_shard_size 0.5"),
])
def test_parse_size_refuses_no_bytes(size: object, rule: str) -> None:
    """A size of no bytes (before: '0GB' and 0.5 gave 0, True gave 1, each silently one tensor per shard) is
    refused, naming the argument and the value."""
    with pytest.raises(ConfigError, match=re.escape(f"save_hf_checkpoint: {rule}")):
        parse_size(size)


# ----------------------------------------------------------------------------- bad checkpoints
@pytest.fixture
def saved(tmp_path):
    model = _random_model("moe-mlp-only", seed=4)
    save_hf_checkpoint(model, tmp_path)
    return tmp_path


def _edit(folder, fn) -> None:
    path = folder / "model.safetensors"
    sd = load_file(path)
    fn(sd)
    save_file(sd, path, metadata={"format": "pt"})


@pytest.mark.parametrize("key, value", [("dtype", "int32"), ("torch_dtype", "float17"), ("dtype", ["bfloat16"])])
def test_config_dtype_must_be_a_float_dtype(saved, key: str, value: object) -> None:
    """config.json's dtype is what the parameters are cast to: an integer dtype (before: nn.Module.to's TypeError)
    or a name of no dtype (before: ignored) is refused, naming the file, the key and the value."""
    cfg = json.load(open(saved / "config.json"))
    cfg.pop("dtype", None)
    cfg[key] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(
            f"{saved / 'config.json'}: {key} must name a floating-point torch dtype (e.g. 'bfloat16', 'float32'; "
            f"or pass dtype=...), got {value!r}")):
        load_hf_checkpoint(saved)
    assert load_hf_checkpoint(saved, dtype=torch.bfloat16).norm.weight.dtype == torch.bfloat16


def test_missing_keys_listed(saved) -> None:
    _edit(saved, lambda sd: (sd.pop("model.norm.weight"), sd.pop("model.layers.0.mlp.experts.2.up_proj.weight")))
    with pytest.raises(CheckpointError, match=r"missing keys \(2\)") as e:
        load_hf_checkpoint(saved)
    assert "model.norm.weight" in str(e.value) and "model.layers.0.mlp.experts.2.up_proj.weight" in str(e.value)


def test_unexpected_keys_listed(saved) -> None:
    def add(sd):
        sd["model.layers.0.mlp.experts.4.up_proj.weight"] = sd["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
        sd["vision_tower.weight"] = torch.zeros(3)
    _edit(saved, add)
    with pytest.raises(CheckpointError, match=r"unexpected keys \(2\)") as e:
        load_hf_checkpoint(saved)
    assert "vision_tower.weight" in str(e.value) and "expert 4 >= num_experts 4" in str(e.value)


def test_misshaped_keys_listed(saved) -> None:
    _edit(saved, lambda sd: sd.update({"model.layers.2.self_attn.k_proj.weight": torch.zeros(8, 64)}))
    with pytest.raises(CheckpointError, match=r"model.layers.2.self_attn.k_proj.weight: expected \[16, 64\], "
                                              r"got \[8, 64\]"):
        load_hf_checkpoint(saved)


def test_config_weights_mismatch(saved) -> None:
    cfg = json.load(open(saved / "config.json"))
    cfg["num_hidden_layers"] = 4
    cfg["hidden_size"] = 32
    json.dump(cfg, open(saved / "config.json", "w"))
    with pytest.raises(CheckpointError, match="does not match the config") as e:
        load_hf_checkpoint(saved)
    msg = str(e.value)
    assert "dim=32, n_layers=4" in msg and "the weights look like: vocab_size=160, dim=64, n_layers=3" in msg
    assert "missing keys" in msg and "model.layers.3.input_layernorm.weight" in msg
    assert "mis-shaped keys" in msg and "model.embed_tokens.weight: expected [160, 32], got [160, 64]" in msg


def test_in_memory_state_dict_errors_name_the_keys() -> None:
    from trnkit.qwen3.state_dict import from_hf, to_hf

    model = _random_model("moe-mlp-only", seed=5)
    hf = to_hf(model.state_dict(), model.config)
    assert from_hf(hf, model.config).keys() == model.state_dict().keys()
    hf.pop("model.layers.0.mlp.experts.1.down_proj.weight")
    hf["model.layers.0.mlp.gate.weight"] = torch.zeros(3, 64)
    with pytest.raises(CheckpointError, match="Qwen3 checkpoint state dict does not match") as e:
        from_hf(hf, model.config)
    assert "model.layers.0.mlp.experts.1.down_proj.weight" in str(e.value)
    assert "model.layers.0.mlp.gate.weight: expected [4, 64], got [3, 64]" in str(e.value)


@pytest.mark.parametrize("value, what", [(torch.zeros(64, dtype=torch.int32), "dtype torch.int32"),
                                         ([1.0] * 64, "a list, not a tensor")])
def test_in_memory_state_dict_of_no_float_tensor_is_refused(value: object, what: str) -> None:
    """As load_hf_checkpoint refuses an integer tensor in a file: before, an int32 norm weight was cast silently
    (an int32 first tensor made every native tensor int32), and a list ended in an AttributeError."""
    from trnkit.qwen3.state_dict import from_hf, to_hf

    model = _random_model("moe-mlp-only", seed=5)
    hf = {**to_hf(model.state_dict(), model.config), "model.norm.weight": value}
    with pytest.raises(CheckpointError) as e:
        from_hf(hf, model.config)
    assert str(e.value) == (f"state_dict_from_hf: model.norm.weight is {what}; its parameter needs a floating-point "
                            "tensor, refusing to cast")


@pytest.mark.parametrize("call, message", [
    (lambda p, m: save_hf_checkpoint(m, p / "out", dtype=torch.int8),  # before: wrote int8 weights
     "save_hf_checkpoint: dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, got torch.int8"),
    (lambda p, m: load_hf_checkpoint(p, dtype=torch.int8),  # before: nn.Module.to's TypeError
     "load_hf_checkpoint: dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, got torch.int8"),
    (lambda p, m: load_hf_checkpoint(p, dtype="bfloat16"),
     "load_hf_checkpoint: dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, got 'bfloat16'"),
    (lambda p, m: load_hf_checkpoint(p, config=m.config.to_hf()),  # before: AttributeError
     "load_hf_checkpoint: config must be a Qwen3Config or None (None: the folder's config.json), got dict"),
])
def test_io_arguments_are_checked(saved, call, message: str) -> None:
    model = _random_model("moe-mlp-only", seed=4)
    with pytest.raises(ConfigError) as e:
        call(saved, model)
    assert str(e.value) == message
    assert not (saved / "out").exists()


def test_corrupt_and_truncated_files(saved) -> None:
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_hf_checkpoint(saved)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_hf_checkpoint(saved)


def test_bad_index_and_folder(saved, tmp_path_factory) -> None:
    os.replace(saved / "model.safetensors", saved / "model-00001-of-00002.safetensors")  # else read, not the index
    json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}},
              open(saved / "model.safetensors.index.json", "w"))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors does not exist"):
        load_hf_checkpoint(saved)
    (saved / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        load_hf_checkpoint(saved)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_checkpoint(empty)
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        load_hf_checkpoint(empty, config=native_config("dense-gqa4"))


class _ReadTracker:
    """Wraps ``safe_open``; at every ``get_tensor`` it counts the earlier reads whose memory the LOADER
    still holds: a storage of an earlier read that some tensor reachable from the loader's call stack
    (every frame between the test and the read; through locals, containers and object ``__dict__``s)
    or from the loader modules' globals still uses — the tensor itself or any view of it.

    Reachability, not just "still alive": an earlier tensor can outlive the loader's last reference for
    reasons outside the loader (a full-suite ``-n 2`` run once saw a second live tensor while the
    loader held none), whereas what this proves is the loader's own footprint. ``held_peak`` counts
    the tensor being read too: a loader that lets go of each tensor before the next read has 1.
    """

    def __init__(self, real_open, modules=()) -> None:
        import sys
        import weakref

        self._weakref = weakref
        self._outer = sys._getframe(1)  # the test's frame: it and the frames above are not the loader
        self._roots = [vars(m) for m in modules]
        self.reads: list = []  # weakrefs to the storages of the tensors read so far
        self.held_peak = 0
        tracker = self

        class Handle:
            def __init__(self, *a, **kw):
                self._h = real_open(*a, **kw)

            def __getattr__(self, name):
                return getattr(self._h, name)

            def get_tensor(self, key):
                t = self._h.get_tensor(key)
                tracker._read(t)
                return t

        self.open = Handle

    def _loader_storages(self) -> set:
        """ids of the storages of every tensor reachable from the loader (frames and module globals)."""
        import sys
        import types

        frame, todo = sys._getframe(3), list(self._roots)  # skip _loader_storages, _read, get_tensor
        while frame is not None and frame is not self._outer:
            todo.append(dict(frame.f_locals))
            frame = frame.f_back
        seen, storages = set(), set()
        while todo:
            o = todo.pop()
            if id(o) in seen or isinstance(o, (types.ModuleType, type, types.FunctionType, str, bytes)):
                continue
            seen.add(id(o))
            if isinstance(o, torch.Tensor):
                storages.add(id(o.untyped_storage()))
            elif isinstance(o, dict):
                todo += list(o.values())
            elif isinstance(o, (list, tuple, set, frozenset)):
                todo += list(o)
            elif hasattr(o, "__dict__"):
                todo.append(vars(o))
        return storages

    def _read(self, t: torch.Tensor) -> None:
        alive = [s for s in (r() for r in self.reads) if s is not None]
        held = 0
        if alive:
            reachable = self._loader_storages()
            held = sum(id(s) in reachable for s in alive)
        self.reads.append(self._weakref.ref(t.untyped_storage()))
        self.held_peak = max(self.held_peak, held + 1)


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_index_paths_must_stay_inside_the_folder(saved, tmp_path_factory, where: str) -> None:
    """A shard named by the index that resolves outside the checkpoint folder is refused, not read."""
    outside = tmp_path_factory.mktemp("outside")
    os.replace(saved / "model.safetensors", outside / "x.safetensors")
    name = {"parent": os.path.relpath(outside / "x.safetensors", saved), "absolute": str(outside / "x.safetensors"),
            "symlink": "link.safetensors"}[where]
    if where == "symlink":
        (saved / "link.safetensors").symlink_to(outside / "x.safetensors")
    keys = list(load_file(outside / "x.safetensors"))
    json.dump({"weight_map": {k: name for k in keys}}, open(saved / "model.safetensors.index.json", "w"))
    rule = ("a shard must be a file name relative to the checkpoint folder" if where == "absolute" else
            f"which resolves to {outside / 'x.safetensors'}, outside the checkpoint folder")
    with pytest.raises(CheckpointError, match=re.escape(f"maps {keys[0]} to {name!r}")) as e:
        load_hf_checkpoint(saved)
    assert rule in str(e.value)


def test_load_reads_one_tensor_at_a_time(tmp_path, monkeypatch) -> None:
    """Lazy loading: each tensor read from the file is released by the loader before the next is read,
    so peak memory is the model plus one tensor (no second full copy of the weights)."""
    import trnkit.qwen3.checkpoint as ck
    import trnkit.qwen3.state_dict as sd

    save_hf_checkpoint(_random_model("moe-norm"), tmp_path, max_shard_size="100KB")
    tracker = _ReadTracker(ck.safe_open, modules=(ck, sd))
    monkeypatch.setattr(ck, "safe_open", tracker.open)
    model = load_hf_checkpoint(tmp_path)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and len(tracker.reads) == sum(len(load_file(f)) for f in shards)
    assert tracker.held_peak == 1
    assert not any(p.is_meta for p in model.parameters())


def test_read_tracker_sees_a_loader_that_keeps_tensors(tmp_path, monkeypatch) -> None:
    """The accounting above can fail: a read loop that keeps the previous tensor bound while it reads
    the next (the bug the loader once had), one that keeps only views of what it read, and tensors
    stashed in a loader module's global are all counted."""
    import trnkit.qwen3.checkpoint as ck

    save_file({f"t{i}": torch.randn(4, 4) for i in range(3)}, tmp_path / "x.safetensors")

    def bound_across_reads(h):
        for k in ("t0", "t1", "t2"):
            src = h.get_tensor(k)  # noqa: F841 (still bound during the next read)

    def keeps_a_view(h):
        views = []
        for k in ("t0", "t1", "t2"):
            views.append(h.get_tensor(k).t())

    for loader in (bound_across_reads, keeps_a_view):
        tracker = _ReadTracker(ck.safe_open)
        loader(tracker.open(str(tmp_path / "x.safetensors"), framework="pt"))
        assert tracker.held_peak == (2 if loader is bound_across_reads else 3), loader.__name__
    monkeypatch.setattr(ck, "_stash", [], raising=False)
    tracker = _ReadTracker(ck.safe_open, modules=(ck,))
    h = tracker.open(str(tmp_path / "x.safetensors"), framework="pt")
    for k in ("t0", "t1", "t2"):
        ck._stash.append(h.get_tensor(k))
    assert tracker.held_peak == 3
