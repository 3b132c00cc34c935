"""Metrics: FLOPs per token (hand-computed), peak FLOPs table, the console line, step-1 note, plot."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from trnkit.harness.metrics import (ModelShape, count_params, flops_per_token, format_line, peak_flops,
                                    plot_loss, step1_sanity)
from trnkit.qwen3 import Qwen3Model, model_registry

from .helpers import TINY_MOE


def test_flops_per_token_moe_by_hand() -> None:
    c = model_registry("debug-moe", **{**TINY_MOE, "tie_word_embeddings": False}).config
    with torch.device("meta"):
        m = Qwen3Model(c)
    d, hd, V, E, K, I = c.dim, c.head_dim, c.vocab_size, c.num_experts, c.top_k, c.moe_inter_dim  # noqa: E741
    attn = d * hd * (2 * c.n_heads + 2 * c.n_kv_heads) + 2 * hd + 2 * d
    dense_ffn = 3 * d * c.hidden_dim
    experts = E * 3 * d * I
    router = E * d
    total = 2 * attn + dense_ffn + experts + router + d + 2 * V * d
    shape = ModelShape(c.n_layers, c.n_heads, hd, E, K)
    counts = count_params(m, shape)
    assert counts["total"] == total == c.num_params()
    assert counts["embedding"] == V * d and counts["experts"] == experts
    assert counts["active"] == total - experts + experts * K // E == c.num_active_params()
    fpt, _ = flops_per_token(m, shape, seq_len=32)
    assert fpt == 6 * (total - experts + experts * K // E - V * d) + 6 * c.n_layers * c.n_heads * 2 * hd * 32


def test_tied_lm_head_counts_as_matmul() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 8)
            self.head = nn.Linear(8, 100, bias=False)
            self.head.weight = self.emb.weight

    counts = count_params(Tied(), ModelShape(1, 1, 2))
    assert counts == {"total": 800, "embedding": 0, "experts": 0, "active": 800}


def test_peak_flops_table() -> None:
    assert peak_flops("cpu") is None
    assert peak_flops("neuron", "Trainium2 trn2") == 158e12
    assert peak_flops("neuron", "trn1") == 90e12
    assert peak_flops("neuron", "something-new") == 158e12  # torchtitan's neuron fallback


def test_console_line_matches_torchtitan() -> None:
    line = format_line(3, 10.123456, 1.5, 1.25, 6.5, 12345.4, 0.0123, None)
    assert line == ("step:  3  loss: 10.12346  grad_norm:  1.5000  memory:  1.25GiB(6.50%)  "
                    "tps: 12,345  tflops: 0.01  mfu: n/a")
    assert format_line(12, 1, 1, 1, 1, 1, 1, 42.0).endswith("mfu: 42.00%")
    colored = format_line(1, 1, 1, 1, 1, 1, 1, None, color=True)
    assert re.sub(r"\033\[\d+m", "", colored) == format_line(1, 1, 1, 1, 1, 1, 1, None)


def test_step1_sanity_notes() -> None:
    v = 151936
    assert "as expected for random init" in step1_sanity(math.log(v) + 0.1, v, loaded_weights=False)
    assert "WARNING" in step1_sanity(12.4, v, loaded_weights=True)
    assert "consistent with the loaded weights" in step1_sanity(6.5, v, loaded_weights=True)


def test_plot_writes_png(tmp_path: Path) -> None:
    out = plot_loss([{"step": i, "loss": 10 / i} for i in range(1, 6)], str(tmp_path / "l.png"), vocab_size=384)
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_runs_cli(tmp_path: Path) -> None:
    import json

    from trnkit.harness.plot import main, plot_runs

    paths = []
    for name in ("ref", "nki"):
        (tmp_path / name).mkdir()
        p = tmp_path / name / "metrics.jsonl"
        p.write_text("".join(json.dumps({"step": i, "loss": 5 - i / 10}) + "\n" for i in range(1, 6)))
        paths.append(str(p))
    out = tmp_path / "cmp.png"
    assert main([*paths, "-o", str(out), "--labels", "reference,nki"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        plot_runs(paths, str(out), ["only"])


def test_plot_runs_cli_answers_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing or malformed metrics file is one message and exit 2, not a traceback."""
    from trnkit.harness.plot import main

    out = str(tmp_path / "cmp.png")
    assert main([str(tmp_path / "none.jsonl"), "-o", out]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: plot_runs: each run must be a metrics.jsonl file; not a file: "
                   f"['{tmp_path / 'none.jsonl'}']\n")
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    assert main([str(tmp_path / "bad.jsonl"), "-o", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.jsonl:2" in err and "Traceback" not in err, err
    assert not Path(out).exists()


def test_plot_runs_cli_answers_bad_outputs_and_empty_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """-o a folder used to write '<folder>.png' beside it (and print the folder), -o x.txt / a path in a missing
    folder ended in tracebacks, an empty metrics.jsonl drew an empty plot with exit 0."""
    import json

    from trnkit.harness.plot import main

    run = tmp_path / "metrics.jsonl"
    run.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "empty.jsonl").write_text("")
    for out, message in ((tmp_path / "out", f"-o: {tmp_path / 'out'} is a folder; name the image file"),
                         (tmp_path / "cmp.txt", "-o: the image format must be one of"),
                         (tmp_path / "no" / "cmp.png", f"-o: cannot write {tmp_path / 'no' / 'cmp.png'} "
                                                       "(FileNotFoundError")):
        assert main([str(run), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: plot_runs {message}") and "Traceback" not in err, err
    assert not (tmp_path / "out.png").exists() and not (tmp_path / "cmp.txt").exists()
    assert main([str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "e.png")]) == 2
    assert capsys.readouterr().err == f"error: plot_runs: {tmp_path / 'empty.jsonl'} holds no loss records\n"
    assert not (tmp_path / "e.png").exists()
    (tmp_path / "noloss.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2}\n')  # used to be a KeyError
    assert main([str(tmp_path / "noloss.jsonl"), "-o", str(tmp_path / "e.png")]) == 2
    assert capsys.readouterr().err == (f"error: plot_runs: record 2 of {tmp_path / 'noloss.jsonl'} has no numeric "
                                       "loss, got {'step': 2}\n")
    (tmp_path / "bad.jsonl").write_text("garbage\n")  # the trainer's advice (move the file away) is not for plots
    assert main([str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "e.png")]) == 2
    assert capsys.readouterr().err.endswith("bad.jsonl:1 is not a metrics record (Expecting value: line 1 column 1 "
                                            "(char 0))\n")
