"""trnkit's own warnings (an override falling back, ...) are trainer log lines during a run; others are not."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import trnkit.overrides.guard
from trnkit.harness.logs import setup_logging, trnkit_warnings_logged
from trnkit.harness.train import run
from trnkit.overrides.registry import reset_warnings

from .helpers import TINY_MOE, tiny_config


def test_trnkit_warning_is_a_log_line_and_others_are_not(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(0, 1)
    in_trnkit = trnkit.overrides.guard.__file__
    shown: list[str] = []  # the process's own warning display
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_args, **_kw: shown.append(str(message))
        with trnkit_warnings_logged():
            warnings.warn_explicit("trnkit says so", UserWarning, in_trnkit, 1)
            warnings.warn_explicit("someone else says so", UserWarning, __file__, 2)  # a file outside the package
        warnings.warn_explicit("outside the context", UserWarning, in_trnkit, 3)  # the display is back
    out, _ = capsys.readouterr()
    assert out.splitlines() == ["[trnkit] WARNING: trnkit says so"]
    assert shown == ["someone else says so", "outside the context"]


def test_a_run_logs_an_override_fallback(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    reset_warnings()
    model = {**TINY_MOE, "num_experts": 10, "top_k": 9}  # router_topk's kernel takes top_k <= 8
    run(tiny_config(tmp_path / "run", tiny_tokenizer, corpus_dir, model={"config": model}, training={"steps": 1},
                    overrides={"ops": ["router_topk"], "policy": "fallback", "impl": "nki"}))
    out, err = capsys.readouterr()
    line = "[trnkit] WARNING: trnkit override router_topk[nki] falls back to the original module code"
    assert line in out and "falls back" not in err
    reset_warnings()
