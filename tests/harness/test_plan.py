"""The per-rank memory planner: terms against hand counts and the model's own parameters, the measured CPU
peak (benchmarks/plan_check.py's CSV), the CLI and the trainer's start-up check."""

from __future__ import annotations

import csv
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trnkit.bench.paths import load_script
from trnkit.errors import ConfigError
from trnkit.harness import plan as plan_mod
from trnkit.harness.config import load_config
from trnkit.harness.plan import DEVICE_MEMORY, GiB, plan
from trnkit.harness.train import run
from trnkit.packaged import resolve_config
from trnkit.qwen3 import Qwen3Model, model_registry

from .helpers import REPO, tiny_config

CSV = REPO / "benchmarks" / "data" / "plan_check.csv"


def _terms(p) -> dict[str, int]:
    return {t.name: t.bytes for t in p.terms}


def test_device_memory_per_rank_from_the_documented_sizes():
    assert DEVICE_MEMORY["trn2"] == 24 * GiB      # 96 GiB per Trainium2 chip / 4 logical cores (LNC=2)
    assert DEVICE_MEMORY["trn2-lnc1"] == 12 * GiB  # / 8 physical cores
    assert DEVICE_MEMORY["trn1"] == 16 * GiB      # 32 GiB per Trainium chip / 2 cores


@pytest.mark.parametrize("flavor", ["debug", "debug-moe", "0.6B"])
def test_parameter_terms_count_the_models_own_parameters(flavor):
    cfg = load_config(None, ["--model.spec", f"qwen3:{flavor}"])
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3Model(model_registry(flavor).config).parameters())
    terms = _terms(plan(cfg, 1, "trn2"))
    assert terms["parameters"] == 4 * n and terms["gradients"] == 4 * n and terms["optimizer state"] == 8 * n


def test_the_plan_reads_the_model_through_its_spec() -> None:
    """An hf: Qwen3-MoE folder is planned from its ModelSpec's plan_config (the parameter terms count the
    transformers model's own parameters); a family that is not Qwen3-shaped gets no plan."""
    from tests.harness.bigram_family import BigramSpec
    from trnkit.harness.models import build_spec

    cfg = load_config(resolve_config("debug_moe_hf"))
    spec = build_spec(cfg)
    with torch.device("meta"):
        n = sum(p.numel() for p in spec.build().parameters())
    p = plan(cfg, 1, "trn2", spec=spec)
    assert _terms(p)["parameters"] == 4 * n and p.model.startswith(f"{cfg.model.spec} (")
    assert plan(cfg, 1, "trn2").terms == p.terms  # the spec built from cfg when none is passed
    with pytest.raises(ConfigError, match=r"model.spec 'bigram:8' is not Qwen3-shaped"):
        plan(cfg, 1, "trn2", spec=BigramSpec("bigram:8", {"vocab": 16, "hidden": 8}))


def test_fsdp_and_tp_shard_what_they_shard():
    cfg = load_config(resolve_config("qwen3_30b_a3b"), ["--training.activation_checkpointing", "none"])
    mc = model_registry("30B-A3B").config
    one = _terms(plan(cfg, 1, "trn2"))
    cfg.parallelism.data_parallel_shard_degree = 8
    fsdp8 = _terms(plan(cfg, 8, "trn2"))
    assert fsdp8["optimizer state"] == pytest.approx(one["optimizer state"] / 8, rel=1e-6)
    cfg.parallelism.data_parallel_shard_degree = 2
    assert fsdp8["activations"] == _terms(plan(cfg, 2, "trn2"))["activations"]  # FSDP does not shard them
    # (bf16 under FSDP's mixed precision keeps a bf16 residual stream; one rank's autocast keeps it fp32)
    assert fsdp8["activations"] < one["activations"]
    cfg.parallelism.data_parallel_shard_degree, cfg.parallelism.tensor_parallel_degree = 2, 4
    tp4 = _terms(plan(cfg, 8, "trn2"))
    # replicated experts: TP shards attention, norms stay whole, the 48 x 128 experts are on every TP rank
    experts = 48 * 128 * 3 * mc.dim * mc.moe_inter_dim
    assert tp4["parameters"] > 4 * experts / 2 > fsdp8["parameters"]
    assert tp4["MoE dispatch buffers"] == one["MoE dispatch buffers"]  # tokens are not split by TP
    # hand count: 1 x 4096 tokens x 48 MoE layers x top-8 x dim 2048 x bf16 x (permuted in, out, weighted)
    assert one["MoE dispatch buffers"] == 4096 * 48 * 8 * 2048 * 2 * 3
    cfg.parallelism.tp_experts = "shard_i"
    assert _terms(plan(cfg, 8, "trn2"))["parameters"] < tp4["parameters"] / 2


def test_loss_chunk_is_one_block_not_the_full_logits():
    cfg = load_config(resolve_config("debug_moe"))
    chunked = _terms(plan(cfg, 1, "cpu"))["loss chunk"]
    # [256, 151,936] fp32 block + fp32 dW [151,936, 256] + the final norm / dh per token (2 x 128 tokens)
    assert chunked == 256 * 151936 * 4 + 151936 * 256 * 4 + 256 * (4 * 256 + 4 + 2 * 4 * 256 + 4 * 256)
    cfg.training.loss_chunk_size = 0
    assert _terms(plan(cfg, 1, "cpu"))["loss chunk"] > 2 * 256 * 151936 * 4


def test_plan_is_within_15_percent_of_the_measured_cpu_peak():
    """benchmarks/plan_check.py measured each case's peak resident memory; its plan column is the planner's
    figure today (a planner change without a rerun of the benchmark fails here)."""
    rows = list(csv.DictReader(CSV.open()))
    assert {r["case"] for r in rows} >= {"debug-moe fp32 2x128", "0.6B widths, 2 layers, fp32 1x512"}
    check = load_script(REPO / "benchmarks" / "plan_check.py", "plan_check")
    by_case = {case: (config, overrides) for case, config, overrides in check.CASES}
    for r in rows:
        assert abs(float(r["plan_error"])) < 0.15, r
        config, overrides = by_case[r["case"]]
        cfg = load_config(resolve_config(config), [*check.COMMON, *overrides])
        assert plan(cfg, 1, "cpu").total / GiB == pytest.approx(float(r["plan_gib"]), abs=1e-4), \
            f"{r['case']}: rerun python benchmarks/plan_check.py --save-reference"


def test_cli_layouts_of_a_trn2_48xlarge():
    r = subprocess.run([sys.executable, "-m", "trnkit.harness.plan", "--config", "qwen3_30b_a3b", "--layouts",
                        "64x1,16x4,8x8"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and " x " in line[:12]]
    assert [row.split("|")[1].strip() for row in rows] == ["64 x 1", "16 x 4", "8 x 8"]
    assert "24.00 GiB per rank" in r.stdout
    for row in rows:
        total = float(row.split("|")[-3].split()[0].replace(",", ""))
        assert row.split("|")[-2].strip() == ("yes" if total <= 24 else "**no**")


def test_cli_single_plan_and_errors():
    r = subprocess.run([sys.executable, "-m", "trnkit.harness.plan", "--config", "debug_moe_nki", "--device",
                        "trn1", "--training.seq_len", "64"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dp_shard 1 x tp 1 on trn1" in r.stdout and "fits:" in r.stdout and "of 16.00 GiB per rank" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "trnkit.harness.plan", "--config", "debug_moe_nki",
                          "--training.seq_len", "0"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "training.seq_len: must be >= 1" in bad.stderr


def test_trainer_stops_by_default_on_cpu_or_warns_when_the_plan_does_not_fit(
        tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(plan_mod, "cpu_capacity", lambda ranks: 1 << 20)  # a 1 MiB "device"
    for mode, name in (({}, "'auto' (the default)"), ({"memory_check": "stop"}, "'stop'")):
        dump = tmp_path / f"stop{len(mode)}"
        with pytest.raises(ConfigError) as e:
            run(tiny_config(dump, tiny_tokenizer, corpus_dir, job=mode))
        assert re.fullmatch(rf"job.memory_check = {re.escape(name)}: the run does not fit: does NOT fit: \S+ GiB of "
                            r"0.00 GiB per rank on cpu \(\d+%\); largest: .*\. Nothing was written\. Lower "
                            r"training.local_batch_size / seq_len or the model size, raise the FSDP or TP degree, or "
                            r"start it anyway with --job.memory_check warn \(the plan counts tensors only\)",
                            str(e.value)), str(e.value)
        assert not dump.exists()
    caplog.set_level(logging.INFO, logger="trnkit.harness")
    res = run(tiny_config(tmp_path / "warn", tiny_tokenizer, corpus_dir, training={"steps": 1},
                          job={"memory_check": "warn"}))
    assert res.final_step == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("memory plan: the run does not fit") for w in warnings), warnings
    caplog.clear()
    monkeypatch.undo()
    run(tiny_config(tmp_path / "fits", tiny_tokenizer, corpus_dir, training={"steps": 1}))  # the default: it fits
    assert any(r.getMessage().startswith("memory plan (end of") and "fits:" in r.getMessage()
               for r in caplog.records)


def test_the_default_warns_on_a_device() -> None:
    """"auto" stops on CPU only: on a neuron device the plan has not been checked against a measured peak."""
    cfg = load_config(resolve_config("qwen3_4b"))
    spec = plan_mod.build_spec(cfg)
    logged: list[str] = []
    p = plan_mod.check_at_startup(cfg, spec, 1, "neuron", "trn2", "auto", logged.append)
    assert p is not None and p.fits is False and p.capacity == DEVICE_MEMORY["trn2"]
    with pytest.raises(ConfigError, match=r"^job.memory_check = 'stop': the run does not fit: does NOT fit: "):
        plan_mod.check_at_startup(cfg, spec, 1, "neuron", "trn2", "stop", logged.append)


def test_cpu_capacity_is_shared_by_the_ranks_on_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU run over several hosts: the host's memory is divided by its own ranks (LOCAL_WORLD_SIZE), not all."""
    from trnkit.harness.parallel import ranks_on_host

    assert ranks_on_host({}, 4) == 4 and ranks_on_host({"LOCAL_WORLD_SIZE": "2"}, 4) == 2
    for bad in ("0", "5", "x", "", "\u00b2"):  # '²': str.isdigit passes it, int refuses it
        with pytest.raises(ConfigError, match=r"^environment variable LOCAL_WORLD_SIZE: must be an integer in "
                                              rf"\[1, WORLD_SIZE = 4\] \(torchrun sets it\), got '{bad}'$"):
            ranks_on_host({"LOCAL_WORLD_SIZE": bad}, 4)
    seen: list[int] = []
    monkeypatch.setattr(plan_mod, "cpu_capacity", lambda ranks: seen.append(ranks) or 64 * GiB)
    cfg = load_config(resolve_config("debug_moe"))
    cfg.parallelism.data_parallel_shard_degree = 4
    spec = plan_mod.build_spec(cfg)
    p = plan_mod.check_at_startup(cfg, spec, 4, "cpu", "cpu", "auto", lambda msg: None, ranks_on_host=2)
    assert seen == [2] and p.capacity == 64 * GiB and p.dp == 4


def test_an_hf_config_of_only_a_model_type_is_refused_not_oom_killed(tmp_path: Path) -> None:
    """transformers' Qwen3-MoE defaults are the 30B-A3B shape; this run used to start and be OOM-killed (rc 137).
    The child's address space is capped, so a regression fails with a MemoryError instead of the OOM killer."""
    import resource

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}')
    cap = 8 << 30

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    r = subprocess.run([sys.executable, "-m", "trnkit.harness.train", "--config", "debug_moe_hf", "--model.spec",
                        f"hf:{folder}", "--job.dump_folder", str(tmp_path / "run")], capture_output=True, text=True,
                       cwd=REPO, timeout=300, preexec_fn=limit)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: job.memory_check = 'auto' (the default): the run does not fit: does NOT fit: ")
    assert "--job.memory_check warn" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()
    # trainer.md shows this message (from a 24 GiB host): the same words, the host's memory aside
    host = r"of [\d.]+ GiB per rank on cpu \(\d+%\)"
    shown = next(line for line in (REPO / "docs" / "trainer.md").read_text().splitlines()
                 if line.startswith("error: job.memory_check = 'auto'"))
    printed = r.stderr.splitlines()[0].removesuffix(" (--debug or TRNKIT_DEBUG=1 shows the traceback)")
    assert re.sub(host, "", printed) == re.sub(host, "", shown)


def test_measured_vs_plan_line():
    p = plan(load_config(resolve_config("debug_moe")), 1, "trn2")
    assert plan_mod.measured_vs_plan(p, p.total * 1.1).endswith(f"plan {plan_mod.gib(p.total)} (+10%)")


def _tiny_hf_folder(root: Path, vocab: int, tie: bool = False) -> Path:
    """A one-layer transformers Qwen3 of width 16 whose [tokens, vocab] loss tensors dominate its memory."""
    from transformers import Qwen3Config

    folder = root / "hf-wide-vocab"
    Qwen3Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                intermediate_size=32, vocab_size=vocab, tie_word_embeddings=tie).save_pretrained(folder)
    return folder


def _measured_peak_bytes(spec, tokens: torch.Tensor, amp: bool) -> int:
    """Peak tensor bytes of two training steps (forward, backward, AdamW), as benchmarks/plan_check.py's
    torchtitan column counts them (torch's MemTracker over real tensors; the second step holds AdamW state)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = spec.build()
    spec.init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = spec.loss_sum(model, tokens, tokens, 256)
            loss.backward()
            opt.step()
            if step == 0:
                tracker.reset_mod_stats()
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_models_are_planned_with_the_full_logits_transformers_allocates(tmp_path: Path, dtype: str) -> None:
    """transformers forms [tokens, vocab] logits, an fp32 copy and an fp32 log-softmax whose backward holds
    three [tokens, vocab] fp32 tensors at once: at vocab 32,768 and width 16 they are most of the step's
    memory. The plan follows the measured peak (it used to count one chunk of 256 rows: a third of it)."""
    from trnkit.harness.models import build_spec

    folder = _tiny_hf_folder(tmp_path, vocab=32768)
    cfg = load_config(None, ["--model.spec", f"hf:{folder}", "--training.local_batch_size", "2",
                             "--training.seq_len", "256", "--training.dtype", dtype])
    spec = build_spec(cfg)
    tokens = torch.randint(0, 32768, (2, 256), generator=torch.Generator().manual_seed(0))
    measured = _measured_peak_bytes(spec, tokens, amp=dtype == "bfloat16")
    planned = plan(cfg, 1, "cpu", spec=spec).total
    assert planned == pytest.approx(measured, rel=0.05), (planned / GiB, measured / GiB)


def test_hf_vocabulary_is_not_sharded_by_tp(tmp_path: Path) -> None:
    """hf: models keep the embedding and lm_head whole on every TP rank (hf_spec's plan shards attention and
    the dense FFN only): hand count of one rank's parameters at TP 2."""
    from trnkit.harness.models import build_spec

    V, d, hd, heads, kv, inter = 32768, 16, 8, 2, 1, 32
    cfg = load_config(None, ["--model.spec", f"hf:{_tiny_hf_folder(tmp_path, V)}",
                             "--parallelism.tensor_parallel_degree", "2"])
    spec = build_spec(cfg)
    attn, ffn = d * hd * (2 * heads + 2 * kv), 3 * d * inter
    norms = 2 * hd + 2 * d + d                     # q/k norms, the block's two norms, the final norm
    per_rank = 2 * V * d + norms + (attn + ffn) / 2
    assert _terms(plan(cfg, 2, "trn2", spec=spec))["parameters"] == int(4 * per_rank)


def test_a_family_without_loss_form_is_planned_with_the_chunked_loss() -> None:
    """ModelSpec.loss_form is optional: a family written before it existed keeps its plan (the chunked loss,
    vocabulary sharded by TP) and still satisfies the protocol."""
    from tests.harness.bigram_family import BigramSpec
    from trnkit.harness.models import build_spec
    from trnkit.model_spec import ModelSpec

    cfg = load_config(resolve_config("debug_moe"))
    native = build_spec(cfg)

    class OlderSpec:  # delegates everything to the native spec but has no loss_form attribute
        def __getattr__(self, name: str):
            if name == "loss_form":
                raise AttributeError(name)
            return getattr(native, name)

    assert _terms(plan(cfg, 1, "cpu", spec=OlderSpec())) == _terms(plan(cfg, 1, "cpu", spec=native))
    assert isinstance(BigramSpec("bigram:8", {"vocab": 16, "hidden": 8}), ModelSpec)
    odd = OlderSpec()
    odd.__dict__["loss_form"] = "full"
    with pytest.raises(ConfigError, match=r"^plan: model.spec 'qwen3:debug-moe': ModelSpec.loss_form must be a "
                                          r"trnkit.model_spec.LossForm, got 'full'"):
        plan(cfg, 1, "cpu", spec=odd)


@pytest.mark.parametrize("args, message", [
    # a negative world size used to print a negative plan ("fits: -23.41 GiB"), a 0 in a layout a ZeroDivisionError
    (["--world-size", "-4"], "plan --world-size: must be >= 1 (or 0: the config's degrees), got -4"),
    (["--layouts", "0x1"], "plan --layouts: dp_shard and tp must be >= 1, got '0x1'"),
    (["--layouts", "64x1,64x0"], "plan --layouts: dp_shard and tp must be >= 1, got '64x0'"),
])
def test_cli_refuses_world_sizes_and_layouts_below_one(args: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_mod.main(["--config", "qwen3_30b_a3b", *args]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("args, message", [
    # before: --world-size won over --instance, and --layouts over both, silently
    (["--world-size", "8", "--instance", "trn2.48xlarge"], "plan --world-size 8 and --instance trn2.48xlarge: each "
                                                           "sets the world size"),
    (["--layouts", "64x1", "--instance", "trn2.48xlarge"], "plan --instance trn2.48xlarge and --layouts: each sets "
                                                           "the world size (a --layouts item DPxTP: DP x TP ranks)"),
    (["--layouts", "64x1", "--world-size", "8"], "plan --world-size 8 and --layouts: each sets the world size"),
])
def test_cli_refuses_two_world_sizes(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_mod.main(["--config", "qwen3_30b_a3b", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.endswith("; give one\n"), err


def test_a_world_size_below_one_is_refused_by_the_planner() -> None:
    cfg = load_config(resolve_config("debug_moe"))
    with pytest.raises(ConfigError, match=r"^config parallelism: the world size must be >= 1, got 0$"):
        plan(cfg, 0, "trn2")
