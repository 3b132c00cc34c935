"""The memory planner (trnkit.harness.plan) against measured CPU peak memory and against torchtitan's approach.

For each case one fresh process runs the trainer (``trnkit.harness.train.run``, 3 steps: from the second
step on the optimizer state is held during the forward) and samples its resident memory every 2 ms; the
measured peak is the largest resident size minus the size just before the model is built (imports,
tokenizer and token stream are already there). The same case is also counted the way torchtitan's
``scripts/estimate/estimation.py`` does, with ``torch.distributed._tools.mem_tracker.MemTracker`` over two
training steps (tensor bytes by category, peak of the second step). torchtitan runs it under
``FakeTensorMode`` to allocate nothing; trnkit's model has data-dependent shapes (``nonzero`` in the
chunked loss, expert counts in the MoE routing), which fake tensors reject, so here it tracks real tensors.

    python benchmarks/plan_check.py                    # prints the table, writes outputs/bench/plan_check.csv
    python benchmarks/plan_check.py --save-reference   # the tracked benchmarks/data/plan_check.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: use its trnkit

from trnkit.bench.paths import add_output_args, output_dir  # noqa: E402

GiB = 2**30

# (case, config, overrides): the debug sizes of the shipped configs and Qwen3-0.6B's widths (dim 1024,
# 16 heads, FFN 3072, vocabulary 151,936) with 2 of its 28 layers, so that it trains on a small CPU box.
CASES = [
    ("debug-moe fp32 2x128", "debug_moe", []),
    ("debug dense fp32 2x128", "debug_moe", ["--model.spec", "qwen3:debug"]),
    ("0.6B widths, 2 layers, fp32 1x512", "qwen3_0.6b",
     ["--model.config", '{"n_layers": 2, "max_seq_len": 4096}', "--training.seq_len", "512",
      "--training.dtype", "float32", "--overrides.policy", "off", "--parallelism.replicated_init", "true"]),
]
COMMON = ["--training.steps", "3", "--checkpoint.enable", "false", "--checkpoint.export_hf", "false",
          "--metrics.plot", "false", "--metrics.progress_bar", "false", "--overrides.policy", "off",
          "--validation.enabled", "false", "--lr_scheduler.warmup_steps", "1"]

MEASURE = r"""
import json, sys, threading, time
from trnkit.harness import train
from trnkit.harness.config import load_config
from trnkit.packaged import resolve_config

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

state = {"base": None, "peak": 0, "stop": False}
def sample():
    while not state["stop"]:
        if state["base"] is not None:
            state["peak"] = max(state["peak"], rss())
        time.sleep(0.002)
build = train._build_model
def measured_build(*a, **k):
    state["base"] = rss()
    return build(*a, **k)
train._build_model = measured_build
cfg = load_config(resolve_config(sys.argv[1]), sys.argv[2:])
t = threading.Thread(target=sample, daemon=True)
t.start()
train.run(cfg)
state["stop"] = True
t.join()
print("RESULT " + json.dumps({"measured": state["peak"] - state["base"]}))
"""

TORCHTITAN = r"""
import json, sys
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from trnkit.harness.config import load_config
from trnkit.harness.models import build_spec
from trnkit.packaged import resolve_config

cfg = load_config(resolve_config(sys.argv[1]), sys.argv[2:])
t = cfg.training
spec = build_spec(cfg)
model = spec.build()
spec.init_weights(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
tokens = torch.randint(0, spec.vocab_size, (t.local_batch_size, t.seq_len))
tracker = MemTracker()
tracker.track_external(model, opt)
amp = t.dtype == "bfloat16"
with tracker:
    for i in range(2):  # torchtitan: the second iteration holds the optimizer state
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = spec.loss_sum(model, tokens, tokens, t.loss_chunk_size)
        loss.backward()
        opt.step()
        if i == 0:
            tracker.reset_mod_stats()
peak = tracker.get_tracker_snapshot("peak")
print("RESULT " + json.dumps({"torchtitan": max(v["Total"] for v in peak.values())}))
"""


def _run(code: str, args: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"{args}: rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def check(case: str, config: str, overrides: list[str], dump: Path) -> dict:
    from trnkit.harness.config import load_config
    from trnkit.harness.plan import plan
    from trnkit.packaged import resolve_config

    args = [config, *COMMON, *overrides, "--job.dump_folder", str(dump)]
    cfg = load_config(resolve_config(config), args[1:])
    p = plan(cfg, 1, "cpu")
    measured = _run(MEASURE, args)["measured"]
    titan = _run(TORCHTITAN, args)["torchtitan"]
    return {"case": case, "plan_gib": p.total / GiB, "measured_gib": measured / GiB,
            "plan_error": p.total / measured - 1, "torchtitan_gib": titan / GiB,
            "torchtitan_error": titan / measured - 1, "peak_phase": p.peak_phase}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated case numbers (default: all)")
    add_output_args(parser, "plan_check.csv")
    args = parser.parse_args(argv)
    import tempfile

    args.out = output_dir(args, ROOT) / "plan_check.csv"
    args.out.parent.mkdir(parents=True, exist_ok=True)

    picked = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    # with --cases, the other cases keep their rows from the existing file
    kept = {r["case"]: r for r in csv.DictReader(args.out.open())} if args.cases and args.out.exists() else {}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (case, config, overrides) in enumerate(picked):
            rows.append(check(case, config, overrides, Path(tmp) / f"run{i}"))
            r = rows[-1]
            print(f"{r['case']}: plan {r['plan_gib']:.3f} GiB ({r['peak_phase']}), measured {r['measured_gib']:.3f} "
                  f"GiB, error {r['plan_error']:+.1%}; torchtitan-style {r['torchtitan_gib']:.3f} GiB "
                  f"({r['torchtitan_error']:+.1%})", flush=True)
            done = {row["case"]: {k: f"{v:.4f}" if isinstance(v, float) else v for k, v in row.items()}
                    for row in rows}
            with open(args.out, "w", newline="") as f:  # after every case: a long run keeps what it measured
                w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
                w.writeheader()
                for name, _, _ in CASES:
                    if name in done or name in kept:
                        w.writerow(done.get(name) or kept[name])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
