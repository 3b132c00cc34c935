"""The all-kernels configs train and follow the reference (torch) path's loss curve.

Fast tier: each config's ``[overrides]`` (every kernel op that applies to the model, strict policy) on a
tiny model of its kind, 10 steps, within ``benchmarks/loss_track.py``'s tolerance floor alone (a tiny model's
trajectory is calm). Slow tier: the configs as shipped, 20 steps, within the full tolerance (the floor or a
multiple of the kernel-free witnesses' drift, whichever is larger; ``loss_track.tolerance`` derives both), and
the known-bad control path (one op's output rounded to bf16) outside it.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import pytest
import torch

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
    assert all(r["within"] for r in rows), [(r["step"], r["rel_diff"], r["rtol"]) for r in rows if not r["within"]]
    assert not rows[-1]["control_within"]  # the tolerance refuses a bf16 output: it can tell one from the kernels
    assert tr.losses["nki"][steps] < tr.losses["nki"][1] - 1.0  # it trains


def test_loss_track_rows_bound_each_step_by_the_floor_or_the_witnesses_spread() -> None:
    """Hand-computed: the spread is the running max over the three witnesses, the tolerance the larger of the
    floor and SPREAD_FACTOR times it, and the nki path and the control are judged against it step by step."""
    def path(*rel: float) -> dict[int, float]:
        return {s: 10.0 * (1 + r) for s, r in enumerate(rel, start=1)}

    floor = 2.0 ** -13
    tr = loss_track.Track("cfg", "float32", {
        "reference": path(0, 0, 0, 0), "reference_reordered": path(0, 1e-5, 0, 0),
        "reference_impls": path(0, 0, 2e-4, 0), "reference_threads": path(0, 0, 0, 3e-5),
        "nki": path(0, 1e-4, 1.7e-3, 1.5e-3), "control": path(0, 2e-4, 0, 0)}, "", "mlp")
    rows = tr.rows(4)
    assert loss_track.SPREAD_FACTOR == 8
    assert [r["spread"] for r in rows[:4]] == pytest.approx([0, 1e-5, 2e-4, 2e-4])
    assert [r["rtol"] for r in rows[:4]] == pytest.approx([floor, floor, 1.6e-3, 1.6e-3])  # 8 x 1e-5 < floor
    assert [r["within"] for r in rows[:4]] == [True, True, False, True]  # 1.7e-3 > 1.6e-3 >= 1.5e-3
    assert [r["control_within"] for r in rows[:4]] == [True, False, True, True]  # 2e-4 > the floor
    assert [r["rel_diff_threads"] for r in rows[:4]] == pytest.approx([0, 0, 0, 3e-5])
    top = rows[4]
    assert top["step"] == "max" and top["within"] is False and top["control_within"] is False
    assert top["rel_diff"] == pytest.approx(1.7e-3) and top["rtol"] == pytest.approx(1.6e-3)  # the worst step's


def test_loss_track_control_rounds_the_feed_forward_output_to_bf16() -> None:
    from trnkit.overrides import registry

    assert loss_track.control_op(["rmsnorm", "mlp", "moe_experts"]) == "moe_experts"
    assert loss_track.control_op(["mlp", "attention"]) == "mlp"
    with pytest.raises(ValueError, match=r"overrides.ops \['attention'\] has none"):
        loss_track.control_op(["attention"])
    loss_track.register_control("mlp")
    loss_track.register_control("mlp")  # again: a no-op (the track runs it once per path)
    try:
        g = torch.Generator().manual_seed(0)
        x, w_gu, w_d = (torch.randn(*s, generator=g) for s in ((5, 16), (16, 2 * 24), (24, 16)))
        ref = registry.get_impl("mlp", "reference").fn(x, w_gu, w_d)
        got = registry.get_impl("mlp", loss_track.CONTROL_IMPL).fn(x, w_gu, w_d)
        assert got.dtype == torch.float32 and torch.equal(got, ref.to(torch.bfloat16).float())
        assert not torch.equal(got, ref)
    finally:
        registry.unregister("mlp", loss_track.CONTROL_IMPL)


def test_loss_schedule_key_runs_its_kernel_and_both_train_alike(tmp_path: Path, tiny_tokenizer: str,
                                                                corpus_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """``training.loss_schedule``: "recompute" (default) runs the forward op and its backward kernel, "fused" the
    one-pass op, in a 2-step run with the loss kernel swapped in (strict); both give the torch loss's losses."""
    from trnkit.overrides import ops

    calls: Counter = Counter()
    for name in ("linear_cross_entropy", "linear_cross_entropy_fused"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name, **k: calls.update([_n]) or _r(*a, **k))
    common = {"model": {"spec": "qwen3:debug", "config": dict(TINY_DENSE)}}
    kernel = {"ops": ["linear_cross_entropy"], "policy": "strict", "impl": "nki"}
    torch_loss = run(tiny_config(tmp_path / "torch", tiny_tokenizer, corpus_dir, **common, training={"steps": 2}))
    assert not calls
    runs = {}
    for schedule in ("recompute", "fused"):
        calls.clear()
        runs[schedule] = run(tiny_config(tmp_path / schedule, tiny_tokenizer, corpus_dir, **common, overrides=kernel,
                                         training={"steps": 2, "loss_schedule": schedule}))
        # one call per training forward (2 steps); the override validation's dry run (no grad) the forward op
        want = {"linear_cross_entropy": 3} if schedule == "recompute" else {"linear_cross_entropy": 1,
                                                                            "linear_cross_entropy_fused": 2}
        assert calls == Counter(want), (schedule, calls)
    assert runs["recompute"].losses.keys() == runs["fused"].losses.keys() == {1, 2}
    for s in (1, 2):  # the gradients' scale (grad_output = dp / global tokens) shows in the norm
        for key in ("losses", "grad_norms"):
            got, want, torch_ref = (getattr(r, key)[s] for r in (runs["fused"], runs["recompute"], torch_loss))
            assert got == pytest.approx(want, rel=1e-5) and got == pytest.approx(torch_ref, rel=1e-5), (key, s)
    assert runs["fused"].losses[2] < runs["fused"].losses[1]
    recompute = dict(runs["recompute"].model.named_parameters())
    for name, p in runs["fused"].model.named_parameters():  # the same 2 updates (weights ~0.07, lr 1e-2)
        torch.testing.assert_close(p, recompute[name], rtol=0, atol=2e-6, msg=name)
