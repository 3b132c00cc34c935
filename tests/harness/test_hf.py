"""The transformers backend (hf:<folder>), loading HF weights into the native model, and HF export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.tolerances import assert_close
from trnkit.harness.config import ConfigError
from trnkit.harness.data import build_loader
from trnkit.harness.train import run

from .helpers import TINY_MOE, tiny_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random transformers Qwen3-MoE saved with save_pretrained (per-expert hub layout on disk)."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=64, router_aux_loss_coef=0.001,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    path = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    model.save_pretrained(path)
    return path


def _first_batch_loss(hf_dir: Path, cfg) -> float:
    """Mean next-token CE of transformers' own model on the trainer's first batch (independent reference)."""
    loader, _ = build_loader(cfg.data, cfg.training.seq_len, cfg.training.local_batch_size, 0, 1, cfg.job.seed)
    b = loader.next_batch()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=b.tokens).logits
    return float(F.cross_entropy(logits.flatten(0, 1), b.labels.flatten()))


def test_hf_backend_pretrained_matches_transformers_and_trains(tmp_path: Path, hf_moe_dir: Path,
                                                               tiny_tokenizer: str, corpus_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir, model={"spec": f"hf:{hf_moe_dir}", "config": {},
                                                                   "hf_pretrained": True},
                      training={"steps": 12})
    res = run(cfg)
    assert res.losses[1] == pytest.approx(_first_batch_loss(hf_moe_dir, cfg), abs=1e-5)
    assert sum(res.losses[s] for s in (10, 11, 12)) / 3 < res.losses[1] - 0.3
    assert all(r["aux_loss"] > 0 for r in res.records)  # output_router_logits switched on by the coef


def test_hf_backend_random_init_from_config(tmp_path: Path, hf_moe_dir: Path, tiny_tokenizer: str,
                                            corpus_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir,
                      model={"spec": f"hf:{hf_moe_dir}", "config": {"num_hidden_layers": 1, "mlp_only_layers": []}},
                      training={"steps": 3})
    res = run(cfg)
    assert len(res.model.model.layers) == 1 and type(res.model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert abs(res.losses[1] - torch.log(torch.tensor(384.0)).item()) < 0.3


def test_native_initial_load_from_hf(tmp_path: Path, hf_moe_dir: Path, tiny_tokenizer: str, corpus_dir: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    native = {**TINY_MOE, "tie_word_embeddings": False}
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir, model={"spec": "qwen3:debug-moe", "config": native},
                      checkpoint={"initial_load_path": str(hf_moe_dir)}, training={"steps": 2})
    with pytest.raises(ConfigError, match=r"disagrees with qwen3:debug-moe .* rope_theta: model 1000000.0 vs "
                                          r"checkpoint 10000.0"):
        run(cfg)
    cfg.model.config["rope_theta"] = 1e4  # transformers' default, as in the tiny checkpoint
    res = run(cfg)
    assert res.losses[1] == pytest.approx(_first_batch_loss(hf_moe_dir, cfg), abs=1e-5)
    # random HF weights: loaded, yet the loss looks random -> the sanity note warns
    assert "WARNING: weights were loaded but the loss looks like random init" in capsys.readouterr().out


def test_native_hf_export_loads_in_transformers(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_tokenizer, corpus_dir, training={"steps": 3},
                      checkpoint={"export_hf": True, "export_dtype": "float32"})
    res = run(cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(res.hf_export, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    tokens = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    res.model.eval()
    with torch.no_grad():
        ours, theirs = res.model(tokens), hf(input_ids=tokens).logits
    assert_close(theirs, ours, torch.float32)  # fp32: the kernel tolerance of tests/tolerances.py


def test_hf_backend_with_nki_kernels_matches_reference(tmp_path: Path, hf_moe_dir: Path, tiny_tokenizer: str,
                                                       corpus_dir: Path) -> None:
    common = {"model": {"spec": f"hf:{hf_moe_dir}", "config": {}}, "training": {"steps": 3}}
    ref = run(tiny_config(tmp_path / "ref", tiny_tokenizer, corpus_dir, **common))
    nki = run(tiny_config(tmp_path / "nki", tiny_tokenizer, corpus_dir, **common,
                         overrides={"ops": ["rope_hf", "router_topk", "moe_experts"], "policy": "strict"}))
    assert "(policy strict): 4 swapped" in nki.override_table
    assert "model.layers.1.mlp.experts  moe_experts  nki   swapped" in nki.override_table
    for s in (1, 2, 3):
        assert nki.losses[s] == pytest.approx(ref.losses[s], rel=1e-5, abs=1e-5)


def test_hf_router_stats_give_transformers_aux_loss(tmp_path: Path, hf_moe_dir: Path, tiny_tokenizer: str,
                                                    corpus_dir: Path) -> None:
    # the global-batch aux loss reads the HF model's router logits; over one forward it is HF's own aux loss
    from trnkit.harness.models import build_spec
    from trnkit.qwen3.model import load_balancing_loss

    spec = build_spec(tiny_config(tmp_path, tiny_tokenizer, corpus_dir,
                                    model={"spec": f"hf:{hf_moe_dir}", "config": {}}))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_moe_dir, dtype=torch.float32,
                                                              output_router_logits=True)
    model.train()
    spec.logits(model, torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0)))
    counts, prob_sum, rows = spec.router_stats(model)
    assert rows == 2 * 16 and float(counts.sum()) == 2 * 16 * 2  # one MoE layer, top-2
    assert spec.aux_coef == 0.001
    torch.testing.assert_close(spec.aux_coef * load_balancing_loss(counts, prob_sum, rows, 4),
                               spec.aux_loss(model), rtol=1e-6, atol=0)


def test_hf_backend_refuses_non_float_weights(tmp_path: Path, hf_moe_dir: Path, tiny_tokenizer: str,
                                              corpus_dir: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(hf_moe_dir, bad)
    (f,) = bad.glob("*.safetensors")
    sd = load_file(f)
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
    save_file(sd, f, metadata={"format": "pt"})
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, model={"spec": f"hf:{bad}", "config": {},
                                                                        "hf_pretrained": True})
    from trnkit.qwen3 import CheckpointError

    with pytest.raises(CheckpointError, match=r"model.norm.weight in .*model.safetensors has dtype I32; "
                                          r"a float parameter needs a floating-point tensor"):
        run(cfg)


@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_an_op_without_a_swap_point_is_refused_under_strict(tmp_path: Path, hf_moe_dir: Path, tiny_tokenizer: str,
                                                           corpus_dir: Path, policy: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """transformers computes its loss outside any module: ops = ["linear_cross_entropy"] used to train with no kernel
    at all under 'strict' (the report said 'no swap points found', exit 0)."""
    cfg = tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, model={"spec": f"hf:{hf_moe_dir}", "config": {}},
                      training={"steps": 1},
                      overrides={"ops": ["rope_hf", "linear_cross_entropy"], "policy": policy})
    what = (f"overrides.ops: ['linear_cross_entropy'] match no module of model 'hf:{hf_moe_dir}' (transformers models "
            "compute their loss outside any module), so no kernel of them would run")
    if policy == "strict":
        with pytest.raises(ConfigError) as e:
            run(cfg)
        assert str(e.value) == (f"config {what}; under policy 'strict' every listed op must be swapped in. Nothing was "
                                "written. Remove them from overrides.ops (or use policy 'fallback', which warns)")
        assert not (tmp_path / "run" / "config.toml").exists()
        return
    assert run(cfg).final_step == 1
    assert what in [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_native_checkpoint_resumed_as_an_hf_model_names_the_family(tmp_path: Path, hf_moe_dir: Path,
                                                                     tiny_tokenizer: str, corpus_dir: Path) -> None:
    """Same shapes, other family: refused with one line naming both model.spec values (it used to list every
    config field of both schemas, e.g. 'hidden_size: checkpoint None, this run 32', 20+ lines)."""
    ckpt = {"checkpoint": {"enable": True, "interval": 1}}
    run(tiny_config(tmp_path, tiny_tokenizer, corpus_dir, training={"steps": 1}, **ckpt))
    with pytest.raises(ConfigError) as e:
        run(tiny_config(tmp_path, tiny_tokenizer, corpus_dir, model={"spec": f"hf:{hf_moe_dir}", "config": {}},
                        training={"steps": 2}, **ckpt))
    assert str(e.value).splitlines()[1:3] == [
        f"  model.spec: checkpoint 'qwen3:debug-moe', this run 'hf:{hf_moe_dir}' (another model family: their "
        "configs and parameter names are not comparable)",
        "Nothing was written. To train this model, use another --job.dump_folder (or delete "
        f"{tmp_path / 'checkpoint'}); to resume the old run, use its model settings (see its config.toml)."]


@pytest.mark.parametrize("override, message", [
    ({"vocab_size": -1}, "model.config.vocab_size: must be an integer >= 1, got -1"),
    ({"hidden_size": 0}, "model.config.hidden_size: must be an integer >= 1, got 0"),
    ({"head_dim": 0}, "model.config.head_dim: must be an integer >= 1, got 0"),
    ({"num_attention_heads": 3}, "model.config.num_attention_heads: must be a multiple of num_key_value_heads (2), "
                                 "got 3"),
    ({"num_experts_per_tok": 9}, "model.config.num_experts_per_tok: must be <= num_experts (4), got 9"),
    ({"rms_norm_eps": -1.0}, "model.config.rms_norm_eps: must be > 0, got -1.0"),
])
def test_hf_model_config_values_transformers_accepts_but_cannot_train_are_refused(
        override: dict, message: str, hf_moe_dir: Path) -> None:
    """Each used to start the run (config.toml and metrics.jsonl written) and end in a torch error at the
    first step (rc 1), or in a NaN stop (negative eps)."""
    from trnkit.harness.config import load_config
    from trnkit.harness.models import build_spec

    cfg = load_config(None, ["--model.spec", f"hf:{hf_moe_dir}", "--model.config", __import__("json").dumps(override)])
    with pytest.raises(ConfigError) as e:
        build_spec(cfg)
    assert str(e.value) == f"{message} (hf:{hf_moe_dir}/config.json)"


def test_hf_config_values_of_the_wrong_type_are_refused_naming_the_key(tmp_path: Path, hf_moe_dir: Path) -> None:
    """transformers' configs check their fields' types with errors of their own (huggingface_hub's
    StrictDataclassError, no TypeError): a config.json value of the wrong type, and a model.config value for a key
    that config.json leaves null (not checked against a type of its own), ended the run in a traceback (rc 1)."""
    import json
    import shutil

    from trnkit.harness.config import load_config
    from trnkit.harness.models import build_spec

    folder = Path(shutil.copytree(hf_moe_dir, tmp_path / "hf"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "2"}))
    with pytest.raises(ConfigError) as e:
        build_spec(load_config(None, ["--model.spec", f"hf:{folder}"]))
    assert str(e.value) == (f"model.spec: transformers cannot read the config of hf:{folder} "
                            "(StrictDataclassFieldValidationError: Validation error for field 'num_hidden_layers': "
                            "TypeError: Field 'num_hidden_layers' expected int, got str (value: '2'))")
    assert config["pad_token_id"] is None
    with pytest.raises(ConfigError) as e:
        build_spec(load_config(None, ["--model.spec", f"hf:{hf_moe_dir}", "--model.config.pad_token_id", "x"]))
    assert str(e.value).startswith("model.config.pad_token_id: Qwen3MoeConfig refuses the value (Validation error for "
                                   "field 'pad_token_id': TypeError: Field 'pad_token_id' with value 'x' doesn't match")
    assert str(e.value).endswith("got 'x'")
