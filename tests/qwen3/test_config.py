"""Qwen3Config <-> HF config.json (v4 / v5 layouts), the flavor registry and parameter counts."""

from __future__ import annotations

import json
import re

import pytest
import torch

from trnkit.errors import ConfigError
from trnkit.qwen3 import Qwen3Config, Qwen3Model, flavors, model_registry

# Published Qwen/Qwen3-0.6B config.json (transformers 4.51 layout: top-level rope_theta).
QWEN3_06B_V4 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
# Published Qwen/Qwen3-30B-A3B config.json.
QWEN3_30B_A3B_V4 = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def _arch(c: Qwen3Config) -> Qwen3Config:
    """Config without the run-time rope-cache length, for comparing architectures."""
    return c.replace(max_seq_len=1)


def test_from_hf_v4_published_configs_match_registry() -> None:
    c = Qwen3Config.from_hf(QWEN3_06B_V4)
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim) == (1024, 28, 16, 8, 128, 3072)
    assert c.tie_word_embeddings and c.rope_theta == 1e6 and c.max_seq_len == 40960 and not c.is_moe
    assert _arch(c) == _arch(model_registry("0.6B").config)
    m = Qwen3Config.from_hf(QWEN3_30B_A3B_V4)
    assert (m.num_experts, m.top_k, m.moe_inter_dim, m.norm_topk_prob, m.router_aux_loss_coef) == (
        128, 8, 768, True, 0.001)
    assert _arch(m) == _arch(model_registry("30B-A3B").config)


def test_from_hf_v5_layout_and_transformers_objects(tmp_path) -> None:
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(**{k: v for k, v in QWEN3_30B_A3B_V4.items() if k not in ("rope_theta", "rope_scaling")},
                        rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    d = hf.to_dict()
    assert "rope_theta" not in d and d["rope_parameters"]["rope_theta"] == 1e6  # v5 layout
    from_obj, from_dict = Qwen3Config.from_hf(hf), Qwen3Config.from_hf(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert from_obj == from_dict == Qwen3Config.from_hf(tmp_path) == Qwen3Config.from_hf(tmp_path / "config.json")
    assert _arch(from_obj) == _arch(model_registry("30B-A3B").config)


@pytest.mark.parametrize("flavor", flavors())
@pytest.mark.parametrize("version", [4, 5])
def test_to_hf_round_trip(flavor: str, version: int) -> None:
    cfg = model_registry(flavor).config
    d = cfg.to_hf(version=version)
    assert ("rope_parameters" in d) == (version == 5) and ("rope_theta" in d) == (version == 4)
    assert Qwen3Config.from_hf(json.loads(json.dumps(d))) == cfg


def test_to_hf_builds_transformers_config() -> None:
    from transformers import AutoConfig

    d = model_registry("debug-moe").config.to_hf()
    hf = AutoConfig.for_model(**d)
    assert type(hf).__name__ == "Qwen3MoeConfig"
    assert (hf.num_experts, hf.num_experts_per_tok, hf.mlp_only_layers, hf.rope_parameters["rope_theta"]) == (
        8, 2, [0], 1e6)


def test_eos_token_id_list_round_trips() -> None:
    """A config.json's list of stop tokens (Qwen3's instruct models stop at <|im_end|> and <|endoftext|>) is kept:
    from_hf kept only the first id, so to_hf and a save lost the second."""
    from transformers import AutoConfig

    d = {**QWEN3_06B_V4, "eos_token_id": [151645, 151643]}
    cfg = Qwen3Config.from_hf(d)
    assert cfg.eos_token_id == [151645, 151643]
    out = cfg.to_hf(version=4)
    assert out["eos_token_id"] == [151645, 151643] and Qwen3Config.from_hf(json.loads(json.dumps(out))) == cfg
    assert AutoConfig.for_model(**out).eos_token_id == [151645, 151643]


def test_from_hf_rejects_unsupported() -> None:
    with pytest.raises(ValueError, match="rope_type 'default'.*'yarn'"):
        Qwen3Config.from_hf({**QWEN3_06B_V4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type.*'llama'"):
        Qwen3Config.from_hf({**QWEN3_06B_V4, "model_type": "llama"})
    with pytest.raises(ValueError, match="attention_bias"):
        Qwen3Config.from_hf({**QWEN3_06B_V4, "attention_bias": True})
    with pytest.raises(ValueError, match="neither rope_parameters.rope_theta nor rope_theta"):
        Qwen3Config.from_hf({k: v for k, v in QWEN3_06B_V4.items() if k != "rope_theta"})


_PARTIAL = {"qwen3": dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=4, max_position_embeddings=64,
                          rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.05, eos_token_id=7,
                          rope_theta=1e6),
            "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=48,
                              num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=4,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                              decoder_sparse_step=2, router_aux_loss_coef=0.01, rope_theta=1e6)}


@pytest.mark.parametrize("model_type, left_out", [(t, k) for t, d in _PARTIAL.items() for k in d
                                                  if k not in ("model_type", "rope_theta")])
def test_from_hf_keys_left_out_take_transformers_defaults(model_type: str, left_out: str) -> None:
    """A config.json without a key builds what transformers builds from it (its config classes' defaults): before,
    a dense config without head_dim got hidden_size // num_attention_heads instead of 128 and a qwen3_moe config
    without num_experts a dense model instead of 128 experts."""
    from transformers import AutoConfig

    partial = {k: v for k, v in _PARTIAL[model_type].items() if k != left_out}
    assert Qwen3Config.from_hf(partial) == Qwen3Config.from_hf(AutoConfig.for_model(**partial).to_dict())


def test_config_json_without_head_dim_loads_as_transformers_does(tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from trnkit.qwen3 import load_hf_checkpoint

    partial = {k: v for k, v in _PARTIAL["qwen3"].items() if k != "head_dim"}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**partial)).eval()
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(partial))
    model = load_hf_checkpoint(tmp_path).eval()
    assert model.config.head_dim == hf.model.layers[0].self_attn.head_dim == 128
    toks = torch.randint(0, 96, (2, 5))
    with torch.no_grad():
        assert (model(toks) - hf(toks).logits).abs().max().item() <= 1e-5


def test_sliding_window_refused_only_where_transformers_windows_a_layer(tmp_path) -> None:
    """use_sliding_window=True with max_window_layers >= num_hidden_layers windows no layer in transformers (the
    same logits as full attention): trnkit loads it and matches (before, it refused every use_sliding_window=True).
    A config that windows a layer is refused, naming the keys and the layers."""
    from transformers import AutoModelForCausalLM, Qwen3Config as HFQwen3Config

    from trnkit.qwen3 import load_hf_checkpoint

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, use_sliding_window=True, sliding_window=3)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(HFQwen3Config(**kw, max_window_layers=2)).eval()
    hf.save_pretrained(tmp_path)
    toks = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        assert (load_hf_checkpoint(tmp_path).eval()(toks) - hf(toks).logits).abs().max().item() <= 1e-5
    windowed = HFQwen3Config(**kw, max_window_layers=1)
    assert windowed.layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(ConfigError, match=re.escape(
            "sliding-window attention is not supported (trnkit's attention is full causal); use_sliding_window=True, "
            "sliding_window=3, max_window_layers=1 and layer_types make transformers window layers [1]")):
        Qwen3Config.from_hf(windowed)
    moe = {**QWEN3_30B_A3B_V4, "use_sliding_window": True, "sliding_window": 4096}  # Qwen3-MoE: every layer
    with pytest.raises(ConfigError, match=re.escape("make transformers window layers [0, 1, 2,")):
        Qwen3Config.from_hf(moe)


def test_attention_dropout_refused() -> None:
    """transformers drops attention weights in training; trnkit's attention has no dropout, so a config with it
    would train differently: refused, naming the key and the value."""
    from transformers import AutoModelForCausalLM, Qwen3Config as HFQwen3Config

    hf_cfg = HFQwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=0.5)
    hf_cfg._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(hf_cfg)
    toks = torch.randint(0, 64, (1, 9))
    torch.manual_seed(0)
    assert not torch.equal(hf.train()(toks).logits, hf.eval()(toks).logits)  # the dropout is live in transformers
    with pytest.raises(ConfigError, match=re.escape("attention_dropout must be 0 (trnkit's attention has no dropout, "
                                                    "transformers drops attention weights in training), got 0.5")):
        Qwen3Config.from_hf(hf_cfg)


def test_from_hf_drops_mlp_only_layers_of_no_layer(tmp_path) -> None:
    """transformers accepts indices past the last layer in mlp_only_layers and never selects them; from_hf drops
    them with a warning (a Qwen3Config built directly still refuses them: test_values_that_would_train_to_nan)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hf_cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1, 2, 7])
    with pytest.warns(UserWarning, match=r"mlp_only_layers \[2, 7\] name no layer of this 2-layer model"):
        cfg = Qwen3Config.from_hf(hf_cfg)
    assert cfg.mlp_only_layers == [1] and [cfg.is_moe_layer(i) for i in range(2)] == [True, False]
    hf = AutoModelForCausalLM.from_config(hf_cfg)
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"]


def test_config_validation_messages() -> None:
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"):
        Qwen3Config(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
        Qwen3Config(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="head_dim must be even"):
        Qwen3Config(head_dim=7)
    with pytest.raises(KeyError, match="unknown Qwen3 flavor '7B'"):
        model_registry("7B")


@pytest.mark.parametrize("field, value, rule", [
    ("norm_eps", -1.0, "norm_eps must be a finite number > 0 (RMSNorm divides by sqrt(mean(x^2) + eps)), got -1.0"),
    ("norm_eps", 0.0, "norm_eps must be a finite number > 0 (RMSNorm divides by sqrt(mean(x^2) + eps)), got 0.0"),
    ("rope_theta", float("nan"), "rope_theta must be a finite number > 0 (the RoPE base), got nan"),
    ("init_std", float("inf"), "init_std must be a finite number >= 0, got inf"),
    ("router_aux_loss_coef", -0.5, "router_aux_loss_coef must be a finite number >= 0, got -0.5"),
    ("mlp_only_layers", [5], "mlp_only_layers: layer indices must be in [0, n_layers - 1 = 1]; out of range: [5]"),
])
def test_values_that_would_train_to_nan_are_refused(field: str, value: object, rule: str) -> None:
    """The library's own config checks these (not only the trainer): each would end in NaNs or a silently dense
    layer that names nothing."""
    with pytest.raises(ConfigError) as exc:
        Qwen3Config(n_layers=2, num_experts=4, top_k=2, **{field: value})
    assert str(exc.value) == f"Qwen3Config: {rule}"


@pytest.mark.parametrize("key, value, rule", [
    # before: bool("false") is True, a tied model built from an untied config
    ("tie_word_embeddings", "false", "tie_word_embeddings must be a bool, got str 'false'"),
    ("norm_topk_prob", 0, "norm_topk_prob must be a bool, got int 0"),
    # before: TypeError / ValueError / AttributeError naming no key
    ("num_experts", "8", "num_experts must be an int or null, got str '8'"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a number, got str '1e-6'"),
    ("rope_parameters", {"rope_theta": "1e6", "rope_type": "default"}, "rope_theta must be a number, got str '1e6'"),
    ("rope_parameters", ["default"], "rope_parameters must be an object or null, got list ['default']"),
    ("mlp_only_layers", 0, "mlp_only_layers must be a list of ints or null, got int 0"),
    ("intermediate_size", None, "intermediate_size must be an int, got NoneType None"),
    # before: accepted, a float top-k or width
    ("num_experts_per_tok", 2.5, "num_experts_per_tok must be an int, got float 2.5"),
    ("vocab_size", True, "vocab_size must be an int, got bool True"),
    # before: replaced by a default (num_key_value_heads 0 by num_attention_heads, decoder_sparse_step 0 by 1),
    # or a negative expert count read as a dense model
    ("num_key_value_heads", 0, "n_kv_heads must be a positive int, got 0 (config.json: n_kv_heads is "
                               "num_key_value_heads)"),
    ("decoder_sparse_step", 0, "decoder_sparse_step must be >= 1, got 0"),
    ("num_experts", -1, "num_experts must be >= 0, got -1"),
    ("num_hidden_layers", 0, "n_layers must be a positive int, got 0 (config.json: n_layers is num_hidden_layers)"),
])
def test_from_hf_names_the_config_json_key(tmp_path, key: str, value: object, rule: str) -> None:
    """A config.json value of the wrong type or range is refused naming the file, its config.json key (and the
    native field it sets), the rule and the value."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN3_30B_A3B_V4, key: value}))
    with pytest.raises(ConfigError) as exc:
        Qwen3Config.from_hf(tmp_path)
    assert str(exc.value) == f"Qwen3Config.from_hf ({path}): {rule}"


def test_from_hf_null_head_dim_needs_heads() -> None:
    """head_dim null is hidden_size // num_attention_heads, as transformers computes it (before: ZeroDivisionError
    with num_attention_heads 0)."""
    with pytest.raises(ConfigError, match=re.escape(
            "Qwen3Config.from_hf: num_attention_heads must be a positive int (head_dim is null: hidden_size // "
            "num_attention_heads), got 0")):
        Qwen3Config.from_hf({**QWEN3_30B_A3B_V4, "head_dim": None, "num_attention_heads": 0})
    assert Qwen3Config.from_hf({**QWEN3_30B_A3B_V4, "head_dim": None}).head_dim == 2048 // 32


@pytest.mark.parametrize("field, value, rule", [
    ("norm_eps", "1e-6", "norm_eps must be a number, got str '1e-6'"),        # before: TypeError in math.isfinite
    ("num_experts", "4", "num_experts must be an int, got str '4'"),          # before: TypeError in a comparison
    ("top_k", 1.5, "top_k must be an int, got float 1.5"),                    # before: accepted
    ("tie_word_embeddings", "no", "tie_word_embeddings must be a bool, got str 'no'"),  # before: accepted, truthy
    ("dim", True, "dim must be an int, got bool True"),                       # before: accepted as 1
    ("init_std", None, "init_std must be a number, got NoneType None"),
    ("mlp_only_layers", [0.5], "mlp_only_layers must be a list of ints, got list [0.5]"),
    ("eos_token_id", "</s>", "eos_token_id must be an int, a list of ints or null, got str '</s>'"),
    ("kernels", ["rope_hf"], "kernels must be a dict, got list ['rope_hf']"),  # before: AttributeError at the build
])
def test_config_field_types_are_checked(field: str, value: object, rule: str) -> None:
    """Qwen3Config (the library's own API) checks each field against its annotation before any range check."""
    with pytest.raises(ConfigError) as exc:
        Qwen3Config(**{"n_layers": 2, "num_experts": 4, "top_k": 2, field: value})
    assert str(exc.value) == f"Qwen3Config: {rule}"


def test_replace_and_registry_overrides_name_an_unknown_field() -> None:
    """Before: dataclasses.replace's TypeError ('unexpected keyword argument')."""
    with pytest.raises(ConfigError, match=re.escape("Qwen3Config: unknown field 'n_layerz' (did you mean 'n_layers'?); "
                                                    "fields: ['dim', 'n_layers',")):
        model_registry("debug", n_layerz=2)


def test_registry_published_values() -> None:
    # (dim, layers, heads, kv, ffn, tie) from the published config.json files (shared/notes/qwen3.md)
    dense = {"0.6B": (1024, 28, 16, 8, 3072, True), "1.7B": (2048, 28, 16, 8, 6144, True),
             "4B": (2560, 36, 32, 8, 9728, True), "8B": (4096, 36, 32, 8, 12288, False),
             "14B": (5120, 40, 40, 8, 17408, False), "32B": (5120, 64, 64, 8, 25600, False)}
    for f, v in dense.items():
        c = model_registry(f).config
        assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.hidden_dim, c.tie_word_embeddings) == v, f
        assert (c.head_dim, c.vocab_size, c.rope_theta, c.norm_eps, c.num_experts) == (128, 151936, 1e6, 1e-6, 0)
    moe = {"30B-A3B": (2048, 48, 32, 4, 768, 1e6), "235B-A22B": (4096, 94, 64, 4, 1536, 5e6)}
    for f, v in moe.items():
        c = model_registry(f).config
        assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.moe_inter_dim, c.rope_theta) == v, f
        assert (c.num_experts, c.top_k, c.norm_topk_prob, c.tie_word_embeddings) == (128, 8, True, False)
        assert all(c.is_moe_layer(i) for i in range(c.n_layers))
    dm = model_registry("debug-moe").config
    assert [dm.is_moe_layer(i) for i in range(dm.n_layers)] == [False, True, True, True]
    assert model_registry("debug", max_seq_len=512).config.max_seq_len == 512
    alias = model_registry("debugmodel_moe")
    assert alias.flavor == "debug-moe" and alias.config == dm


# Published totals (HF model cards): Qwen3-0.6B "0.6B" (non-embedding 0.44B), Qwen3-4B "4.0B"
# (non-embedding 3.6B), Qwen3-30B-A3B "30.5B in total and 3.3B activated" (non-embedding 29.9B).
# "Non-embedding" on the cards excludes the input embedding and, when untied, the lm_head.
@pytest.mark.parametrize("flavor,total,non_emb", [("0.6B", 0.6e9, 0.44e9), ("4B", 4.0e9, 3.6e9),
                                                  ("30B-A3B", 30.5e9, 29.9e9)])
def test_param_counts_on_meta_match_published(flavor: str, total: float, non_emb: float) -> None:
    cfg = model_registry(flavor).config
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    n = sum(p.numel() for p in model.parameters())  # unique parameters: a tied lm_head counts once
    assert all(p.is_meta for p in model.parameters())
    assert n == model.num_params() == cfg.num_params()
    assert abs(n - total) / total < 0.01, n
    tables = cfg.vocab_size * cfg.dim * (1 if cfg.tie_word_embeddings else 2)
    assert abs(n - tables - non_emb) / non_emb < 0.01, n - tables
    if cfg.is_moe:  # 3.3B activated; the card rounds to 0.1B, so allow 2%
        assert abs(cfg.num_active_params() - 3.3e9) / 3.3e9 < 0.02, cfg.num_active_params()
