"""The all-kernels configs train and follow the reference (torch) path's loss curve.

Fast tier: each config's ``[overrides]`` (every kernel op that applies to the model, strict policy) on a
tiny model of its kind, 10 steps, within ``benchmarks/loss_track.py``'s tolerance floor alone (a tiny model's
trajectory is calm). Slow tier: the configs as shipped, 20 steps, within the full tolerance (the floor or a
multiple of the kernel-free witnesses' drift, whichever is larger; ``loss_track.tolerance`` derives both).
"""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import pytest

from trnkit.bench.paths import load_script
from trnkit.harness.train import run

from .helpers import REPO, TINY_MOE, tiny_config

loss_track = load_script(REPO / "benchmarks" / "loss_track.py", "loss_track")

TINY_DENSE = {k: v for k, v in TINY_MOE.items() if k not in ("num_experts", "top_k", "moe_inter_dim")}


def config_ops(name: str) -> list[str]:
    with open(REPO / "configs" / f"{name}.toml", "rb") as f:
        overrides = tomllib.load(f)["overrides"]
    assert overrides["policy"] == "strict" and overrides["impl"] == "nki"
    return overrides["ops"]


def swapped(table: str) -> Counter:
    """(op, impl, status) -> how many modules, from an override report table."""
    return Counter((r[1], r[2], r[3]) for r in (line.split() for line in table.splitlines()[2:]))


def test_configs_swap_every_kernel_op() -> None:
    every = {"rope_hf", "rmsnorm", "attention", "mlp", "linear_cross_entropy"}
    assert set(config_ops("debug_dense_nki")) == every
    assert set(config_ops("debug_moe_nki")) == every | {"router_topk", "moe_experts"}


# per op, the swap points of the 2-layer tiny models: 2 layers x (attention, ffn, q head, k head norms) + the
# final norm; a rope and an attention per layer; MoE: layer 0 dense (one MLP), layer 1 routed
TINY_SWAPS = {
    "debug_dense_nki": {"rmsnorm": 9, "rope_hf": 2, "attention": 2, "mlp": 2, "linear_cross_entropy": 1},
    "debug_moe_nki": {"rmsnorm": 9, "rope_hf": 2, "attention": 2, "mlp": 1, "linear_cross_entropy": 1,
                      "router_topk": 1, "moe_experts": 1},
}


@pytest.mark.parametrize("config, spec, model", [("debug_dense_nki", "qwen3:debug", TINY_DENSE),
                                                 ("debug_moe_nki", "qwen3:debug-moe", TINY_MOE)])
def test_all_kernels_run_matches_reference_run(tmp_path: Path, tiny_tokenizer: str, corpus_dir: Path,
                                               config: str, spec: str, model: dict) -> None:
    steps = 10
    common = {"model": {"spec": spec, "config": dict(model)}, "training": {"steps": steps}}
    ref = run(tiny_config(tmp_path / "ref", tiny_tokenizer, corpus_dir, **common))
    nki = run(tiny_config(tmp_path / "nki", tiny_tokenizer, corpus_dir, **common,
                         overrides={"ops": config_ops(config), "policy": "strict", "impl": "nki"}))
    assert ref.override_table == ""
    # every swap point of the tiny model runs its NKI kernel (strict: no silent fallback)
    assert swapped(nki.override_table) == Counter({(op, "nki", "swapped"): n for op, n in TINY_SWAPS[config].items()})

    losses = [nki.losses[s] for s in range(1, steps + 1)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.2  # it trains
    rtol, atol = loss_track.tolerance("float32", steps)
    for s in range(1, steps + 1):
        assert nki.losses[s] == pytest.approx(ref.losses[s], rel=rtol, abs=atol), s
    assert nki.losses != ref.losses  # the kernels ran: their fp32 summation order shows somewhere


@pytest.mark.slow  # the debug models at the real vocabulary on the interpreter: about 20 s per step
@pytest.mark.parametrize("config", ["debug_dense_nki", "debug_moe_nki"])
def test_shipped_config_tracks_reference_over_20_steps(tmp_path: Path, config: str) -> None:
    steps = 20
    tr = loss_track.track(config, steps, tmp_path)
    table = swapped(tr.override_table)
    assert {op for op, _, _ in table} == set(config_ops(config))  # every op of the config has swap points
    assert all((impl, status) == ("nki", "swapped") for _, impl, status in table)
    rows = tr.rows(steps)
    assert all(r["within"] for r in rows), [(r["step"], r["rel_diff"]) for r in rows if not r["within"]]
    assert tr.nki[steps] < tr.nki[1] - 1.0  # it trains
