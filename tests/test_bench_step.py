"""``python -m trnkit.bench step``: the whole-step estimate adds its ops up as stated, its model FLOPs and MFU
match a hand count, every op of a layer is there, and bad input names the key and the value."""

from __future__ import annotations

import csv
import math
import time

import pytest

from trnkit.bench import step
from trnkit.bench.__main__ import main as bench_main
from trnkit.qwen3 import model_registry

# the debug flavor with a small vocabulary: the loss is traced whole (no straight-line fit)
CFG = model_registry("debug", vocab_size=4096).config
B, S = 1, 128
LAYER_OPS = ["attention_norm", "q_proj", "k_proj", "v_proj", "qk_norm", "rope", "attention", "o_proj", "ffn_norm"]


@pytest.fixture(scope="module")
def est() -> step.StepEstimate:
    return step.estimate_step("debug", S, B, lnc=2, config=CFG)


def test_every_op_of_a_dense_layer_and_the_head(est):
    dense = [(e.op.name, e.op.mode) for e in est.ops if e.op.part == "dense layer"]
    fwd = LAYER_OPS + ["mlp"]
    assert dense == [(n, "forward") for n in fwd] + [(n, "backward") for n in fwd[::-1]]
    head = [(e.op.name, e.op.mode) for e in est.ops if e.op.part == "head"]
    assert head == [("final_norm", "forward"), ("lm_head_loss", "forward"), ("lm_head_loss", "backward"),
                    ("final_norm", "backward")]
    assert est.layers == {"dense layer": CFG.n_layers}
    for e in est.ops:  # every kernel op was traced and costs something; the range brackets mid
        assert 0 < e.low_ns <= e.mid_ns <= e.high_ns, e.op.name
        assert e.busy_ns.get("tensor", 0) > 0 or e.op.name.endswith("norm"), e.op.name
    kernels = {e.op.kernel for e in est.ops}
    assert kernels == {"rmsnorm_qk", "rmsnorm_qk_bwd", "rmsnorm_residual", "rmsnorm_bwd", "grouped_mm", "rope_hf",
                       "attention", "mlp", "mlp_bwd", "linear_cross_entropy", "linear_cross_entropy_bwd"}
    # the default (recompute) loss: the forward kernel (2 T H V model FLOPs), the backward recomputes (4 T H V)
    fwd, bwd = [e for e in est.ops if e.op.name == "lm_head_loss"]
    T, H, V = B * S, CFG.dim, CFG.vocab_size
    assert (fwd.op.model_flops, bwd.op.model_flops) == (2 * T * H * V, 4 * T * H * V)


def test_fused_schedule_ops():
    """``loss_op(..., schedule="fused")`` (opt-in): the one-pass kernel (all 6 T H V model FLOPs in the forward);
    the backward scales the stored fp32 gradients, at its HBM bound (read 2 fp32 grad_hidden partials and
    grad_weight, write both in bf16, over 2 cores)."""
    T, H, V = 256, 64, 4096
    fwd, bwd = [step.loss_op(T, H, V, m, 2, False, schedule="fused") for m in ("forward", "backward")]
    assert [(o.kernel, o.model_flops) for o in (fwd, bwd)] == [("linear_cross_entropy_fwd_bwd", 6 * T * H * V),
                                                                ("grad scale (torch)", 0)]
    e = step.estimate_op(bwd, "trn2", {})
    nbytes = (2 * T * H + V * H) * 4 + (T * H + V * H) * 2
    assert e.mid_ns == e.low_ns == e.high_ns == pytest.approx(nbytes / (362.5 * 2))
    with pytest.raises(ValueError, match="step: loss schedule must be 'fused' or 'recompute', got 'x'"):
        step.loss_op(256, 64, 4096, "forward", 2, False, schedule="x")


def test_moe_layers_use_router_and_experts():
    cfg = model_registry("debug-moe").config  # layer 0 dense (mlp_only_layers), layers 1-3 MoE
    ops, layers = step.step_ops(cfg, 1, 128, 2)
    assert layers == {"dense layer": 1, "moe layer": 3}
    moe = [(o.name, o.mode, o.kernel) for o in ops if o.part == "moe layer"]
    assert ("router", "forward", "router_topk") in moe and ("router", "backward", "router_topk_bwd") in moe
    assert ("experts", "forward", "moe_experts") in moe and ("experts", "backward", "moe_experts_bwd") in moe
    assert not any(n == "mlp" for n, _, _ in moe)
    assert ("mlp", "forward", "mlp") in [(o.name, o.mode, o.kernel) for o in ops if o.part == "dense layer"]
    # 30B-A3B: 128 experts traced as 16 with the layer's 256 slots per expert, times 8
    big = model_registry("30B-A3B").config
    ex = step.experts_op("moe layer", 4096, big.dim, big.moe_inter_dim, 128, 8, "forward", 2, full=False)
    assert (ex.units, ex.traced_units) == (128, (16,)) and "256 slots per expert" in ex.traced


def test_router_is_traced_as_its_entry_points_launch_it():
    """At LNC=2 the router's forward and backward split the tokens over the two programs, as router_topk /
    router_topk_bwd(lnc=2) launch them (the backward traced as one program before it had an LNC split);
    at LNC=1 one program."""
    from trnkit.nkisim import trace

    programs = {}
    for lnc in (1, 2):
        for mode in ("forward", "backward"):
            with trace.record(trace_only=True) as tr:
                step.router_op("moe layer", 512, 256, 16, 4, mode, lnc).run(1)
            programs[lnc, mode] = {i.program_id for i in tr}
    assert programs == {(1, "forward"): {0}, (1, "backward"): {0}, (2, "forward"): {0, 1}, (2, "backward"): {0, 1}}


def test_step_total_is_layers_times_layer_plus_head(est):
    layer = [sum(getattr(e, f) for e in est.ops if e.op.part == "dense layer") for f in ("low_ns", "mid_ns", "high_ns")]
    head = [sum(getattr(e, f) for e in est.ops if e.op.part == "head") for f in ("low_ns", "mid_ns", "high_ns")]
    total = est.step_total()
    for i in range(3):
        assert total[i] == pytest.approx(CFG.n_layers * layer[i] + head[i], rel=1e-12)
    assert total[0] < total[1] < total[2]


def test_model_flops_and_mfu_by_hand(est):
    T, H, D, Hq, Hk, F, V = B * S, CFG.dim, CFG.head_dim, CFG.n_heads, CFG.n_kv_heads, CFG.hidden_dim, CFG.vocab_size
    # q 256x256, k+v 2 x 256x128, o 256x256, MLP 3 x 256x768; causal attention 2 B Hq S^2 D
    layer_fwd = 2 * T * (H * Hq * D + 2 * H * Hk * D + Hq * D * H + 3 * H * F) + 2 * B * Hq * S * S * D
    step_flops = 3 * (CFG.n_layers * layer_fwd + 2 * T * H * V)  # backward = 2 x forward
    assert step_flops == 3 * (4 * (2 * 128 * (65536 + 65536 + 65536 + 589824) + 2 * 4 * 128 * 128 * 64)
                              + 2 * 128 * 256 * 4096)
    assert est.model_flops() == step_flops
    peak = 128 * 128 * 2 * 2.4  # FLOP/ns per trn2 core: the 128x128 PE array at 2.4 GHz
    mid = est.step_total()[1]
    assert est.mfu(mid) == pytest.approx(step_flops / (mid * peak * 2), rel=1e-12)
    assert 0 < est.mfu(mid) < 1


def test_scaled_traces_read_off_a_proportion_or_a_line():
    assert step._at(16, [(4, 10.0)]) == 40.0
    assert step._at(10, [(2, 5.0), (4, 9.0)]) == 21.0  # 1 + 2 per unit
    op = step.loss_op(128, 256, 151936, "forward", 2, full=False)
    assert op.traced_units == (2048, 4096) and op.traced == "vocabulary rows"
    attn = step.attention_op("dense layer", 1, 4096, 32, 8, 128, "backward", 2, full=False)
    assert (attn.units, attn.traced_units) == (8, (2,)) and "2 of 8 kv heads (8 q heads)" in attn.traced
    # a weight too big for one grouped_mm launch goes in column slices: 4B's q_proj backward
    mm = step.matmul_op("q_proj", "dense layer", 4096, 2560, 32 * 128, "backward", 2)
    assert mm.units == 4 and mm.model_flops == 4 * 4096 * 2560 * 4096
    assert "1 of 4 column slices [2560, 1024]" in mm.traced


def test_report_and_csv(est, tmp_path):
    text = step.report(est)
    lo, mid, hi = est.step_total()
    assert f"step: {mid / 1e6:,.2f} ms ({lo / 1e6:,.2f}..{hi / 1e6:,.2f}) = 4 x dense layer + head" in text
    assert f"MFU: {est.mfu(mid):.1%}" in text and "78.6 TFLOP/s bf16" in text
    path = step.write_csv(tmp_path / "step.csv", step.csv_rows(est))
    step.write_csv(path, step.csv_rows(est))  # the same configuration replaces its rows
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(est.ops) + 3  # ops, the layer, the head, the step
    total = rows[-1]
    assert (total["part"], total["op"]) == ("step", "total")
    assert float(total["est_mid_us"]) == pytest.approx(mid / 1e3, abs=1e-3)
    assert float(total["mfu_mid"]) == pytest.approx(est.mfu(mid), abs=1e-4)
    layer = next(r for r in rows if r["part"] == "dense layer" and r["op"] == "total")
    assert layer["count"] == "4"
    busy = sum(float(r["busy_tensor_us"]) for r in rows if r["part"] == "dense layer" and r["op"] != "total")
    assert float(layer["busy_tensor_us"]) == pytest.approx(busy, abs=0.01)


def test_bad_input_names_the_key_and_value(capsys):
    with pytest.raises(ValueError, match=r"step: flavor: .*unknown Qwen3 flavor 'nope'.*known: debug"):
        step.estimate_step("nope", 128)
    with pytest.raises(ValueError, match=r"step: seq must be an int >= 1, got 0"):
        step.estimate_step("debug", 0)
    with pytest.raises(ValueError, match=r"step: lnc must be 1 or 2, got 3"):
        step.estimate_step("debug", 128, lnc=3)
    with pytest.raises(SystemExit):
        bench_main(["step", "--flavor", "nope", "--seq", "128"])
    assert "unknown Qwen3 flavor 'nope'" in capsys.readouterr().err
    # head_dim 256 is past rope_hf's (and attention's) D <= 128: the first such op, its kernel and rule are named
    wide = model_registry("debug", head_dim=256, vocab_size=4096).config
    with pytest.raises(ValueError, match=r"op rope \(rope_hf, forward.*rope_hf_bshd: constraint 'D <= 128'.*got 256"):
        step.estimate_step("debug", 128, config=wide)
    # Qwen3-8B's hidden size 4096 is past the fused loss's H <= 3072; found by the declared constraints
    # before anything is traced (a trace of 8B's layer would take minutes)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"op lm_head_loss \(linear_cross_entropy, forward.*H <= 3072.*got 4096"):
        step.estimate_step("8B", 4096)
    assert time.perf_counter() - t0 < 30


def test_no_column_slice_fits():
    with pytest.raises(ValueError, match=r"no column slice of a \[65536, 128\] weight fits"):
        step.matmul_op("x", "dense layer", 128, 65536, 128, "forward", 2)
    assert math.isfinite(step._slice_cols(1024, 3072, backward=True))


def test_cli_prints_the_report_and_writes_the_csv(est, tmp_path, monkeypatch, capsys):
    calls = []

    def fake(*args, **kw):  # the estimate of the fixture: the CLI's wiring, not a second trace
        calls.append((args, kw))
        return est

    monkeypatch.setattr(step, "estimate_step", fake)
    assert bench_main(["step", "--flavor", "debug", "--seq", "128", "--batch", "1", "--lnc", "2",
                       "--out", str(tmp_path)]) == 0
    assert calls == [(("debug", 128, 1, 2, "trn2", False), {"log": print, "loss_schedule": "recompute"})]
    calls.clear()  # --loss-schedule reaches the estimate
    assert bench_main(["step", "--flavor", "debug", "--seq", "128", "--loss-schedule", "fused",
                       "--out", str(tmp_path)]) == 0
    assert calls[0][1]["loss_schedule"] == "fused"
    out = capsys.readouterr().out
    assert step.report(est) in out and f"-> {tmp_path / 'step.csv'}" in out
    rows = list(csv.DictReader((tmp_path / "step.csv").open()))
    assert rows[-1]["part"] == "step" and rows[-1]["flavor"] == "debug"


def _fake_trace(fixed_ns: float, hidden_per_unit: float):
    """A stand-in for ``step._trace``: every unit costs 1.0 ns on the busiest engine at mid (0.9 optimistic,
    1.1 pessimistic) plus a fixed tail that the growing loop overlaps ``hidden_per_unit`` ns per unit until
    none of it shows (at the pessimistic settings the tail is three times longer)."""
    def trace(op, u, chip):
        tail = [max(0.0, f - hidden_per_unit * u) for f in (fixed_ns, fixed_ns, 3 * fixed_ns)]
        return (0.9 * u + 100 + tail[0], 1.0 * u + 100 + tail[1], 1.1 * u + 100 + tail[2]), {"tensor": 1.0 * u}
    return trace


def test_line_fit_doubles_the_traced_sizes_until_the_fixed_work_is_overlapped(monkeypatch):
    # a pessimistic tail of 3,000 ns, hidden 0.4 ns per unit: gone from 7,500 units on. Through 2,048 and
    # 4,096 the pessimistic slope is 1.1 - 0.4 = 0.7 < mid's 1.0: read at 151,936 that end would come out
    # ~45 us below mid. The steady line (8,192 and 16,384) reads 1.1 x 151,936 + 100 there.
    monkeypatch.setattr(step, "_trace", _fake_trace(1000.0, 0.4))
    op = step.loss_op(128, 256, 151936, "forward", 2, full=False)
    e = step.estimate_op(op, "trn2", {})
    assert (e.low_ns, e.mid_ns, e.high_ns) == pytest.approx((0.9 * 151936 + 100, 151936 + 100, 1.1 * 151936 + 100))
    assert e.low_ns <= e.mid_ns <= e.high_ns
    assert e.busy_ns["tensor"] == pytest.approx(151936)
    assert e.traced == "8,192 and 16,384 of 151,936 vocabulary rows, the straight line through them at 151,936"
    assert step._steady([(2048, (2048.0, 2148.0, 2300.0), {"tensor": 2048.0}),
                         (4096, (4096.0, 4196.0, 4600.0), {"tensor": 4096.0})])
    assert not step._steady([(2048, (2048.0, 2148.0, 2300.0), {"tensor": 2048.0}),  # pessimistic slope low
                             (4096, (4096.0, 4196.0, 3800.0), {"tensor": 4096.0})])
    assert not step._steady([(2048, (2048.0, 2148.0, 2300.0), {"tensor": 2100.0}),  # mid slope under the busy one
                             (4096, (4000.0, 4100.0, 4600.0), {"tensor": 4096.0})])


def test_line_fit_with_no_steady_state_below_the_op_traces_the_whole_op(monkeypatch):
    monkeypatch.setattr(step, "_trace", _fake_trace(1e9, 1.0))  # the tail never hidden below the op's size
    op = step.loss_op(128, 256, 20000, "forward", 2, full=False)
    e = step.estimate_op(op, "trn2", {})
    assert e.traced == "all 20,000 vocabulary rows (no steady state at fewer)"
    assert e.mid_ns == pytest.approx(20000 + 100 + 1e9 - 20000)  # the trace at 20,000 itself


def test_fused_loss_ends_bracket_mid_at_the_full_vocabulary():
    # the real kernel: where the forward's pessimistic end still shows the per-group fixed work (the target
    # logits on GpSimd) at the smaller traces, a line through them put that end below mid at V; the line
    # is taken only from a steady state (which trace sizes reach it depends on the cost model)
    e = step.estimate_op(step.loss_op(2048, 512, 151936, "forward", 2, full=False), "trn2", {})
    assert e.low_ns <= e.mid_ns <= e.high_ns
    assert "of 151,936 vocabulary rows, the straight line through them" in e.traced
    assert e.mid_ns >= e.busy_ns["tensor"] > 0
