"""Training metrics: FLOPs per token, peak FLOPs table, memory, torchtitan's console line, JSONL, plot.

The console line is torchtitan's (``torchtitan/components/metrics.py``):
``step: N  loss: L  grad_norm: G  memory: XGiB(P%)  tps: T  tflops: F  mfu: M%``. tps is tokens per
second per device; tflops = flops_per_token * tps / 1e12; mfu = achieved / peak. There is no honest
peak for a CPU, so on CPU mfu prints ``n/a`` (tflops is still the achieved figure).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Any, Iterable

import torch
from torch import nn

from trnkit.errors import ConfigError
from trnkit.harness.logs import LOGGER, ProgressLine
from trnkit.harness.rundir import write_run_file
from trnkit.model_spec import ModelShape  # re-exported

# Dense BF16 peak per device as torchtitan's get_peak_flops counts it (PR #2382: trn1/inf2 90e12 per
# NeuronCore-v2; trn2/trn3 79e12 x 2 per LNC=2 logical device). CPU: unknown -> None.
PEAK_FLOPS: dict[str, float] = {
    "trn1": 90e12,
    "trn1n": 90e12,
    "inf2": 90e12,
    "trn2": 79e12 * 2,
    "trn2n": 79e12 * 2,
    "trn2u": 79e12 * 2,
    "trn3": 79e12 * 2,
    "trn3u": 79e12 * 2,
}


def peak_flops(device_type: str, device_name: str = "") -> float | None:
    """Peak dense BF16 FLOP/s of one device, or None when not known (CPU)."""
    if device_type != "neuron":
        return None
    name = device_name.lower()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key]
    return PEAK_FLOPS["trn2"]  # torchtitan's fallback for an unrecognised neuron device


def count_params(model: nn.Module, shape: ModelShape) -> dict[str, int]:
    """Parameter counts: total, embedding, experts (routed) and active (experts scaled by K/E).

    Classified by module type / name: nn.Embedding weights are "embedding" (lookups, no FLOPs) unless
    tied to the lm_head, whose matmul is real work; parameters whose name has an ``experts`` component
    are routed experts (native ``moe.experts``, HF ``mlp.experts``). A tied weight counts once.
    """
    # A weight shared by an Embedding and a Linear (tied lm_head) is a real matmul: not "embedding".
    linear_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - linear_ids
    total = emb = experts = 0
    for name, p in model.named_parameters():
        n = p.numel() if not hasattr(p, "full_tensor") else math.prod(p.shape)  # DTensor: global size
        total += n
        if id(p) in emb_ids:
            emb += n
        elif "experts" in name.split("."):
            experts += n
    frac = shape.top_k / shape.num_experts if shape.num_experts else 1.0
    active = total - experts + round(experts * frac)
    return {"total": total, "embedding": emb, "experts": experts, "active": active}


def flops_per_token(model: nn.Module, shape: ModelShape, seq_len: int) -> tuple[int, dict[str, int]]:
    """Training FLOPs per token, torchtitan's formula made MoE-aware.

    ``6 * (active params - embedding params) + 6 * n_layers * n_heads * (2 * head_dim) * seq_len``: the
    first term is the fwd+bwd matmuls of every weight a token touches (experts weighted by top_k /
    num_experts, the lm_head included), the second the attention scores and weighted values (causal
    sparsity not discounted, as in torchtitan).
    """
    counts = count_params(model, shape)
    dense = 6 * (counts["active"] - counts["embedding"])
    attn = 6 * shape.n_layers * shape.n_heads * 2 * shape.head_dim * seq_len
    return dense + attn, counts


# --------------------------------------------------------------------------- memory
def device_memory(device: torch.device) -> tuple[float, float]:
    """(peak GiB, percent of capacity) of this process: device memory on neuron, peak RSS on CPU."""
    if device.type == "neuron":  # pragma: no cover - needs torch-neuronx
        mod = getattr(torch, "neuron", None)
        try:
            peak = mod.max_memory_allocated() / 2**30
            cap = mod.get_device_properties(device).total_memory / 2**30
            return peak, 100 * peak / cap
        except Exception:  # noqa: BLE001 - a backend without memory stats: fall back to the process RSS
            pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    try:
        cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):  # pragma: no cover
        cap = float("nan")
    return peak, 100 * peak / cap


# --------------------------------------------------------------------------- logging
_COLORS = {"red": "\033[31m", "green": "\033[32m", "yellow": "\033[33m", "blue": "\033[34m",
           "magenta": "\033[35m", "cyan": "\033[36m", "reset": "\033[39m"}


def format_line(step: int, loss: float, grad_norm: float, mem_gib: float, mem_pct: float, tps: float,
                tflops: float, mfu: float | None, color: bool = False, val_loss: float | None = None) -> str:
    c = _COLORS if color else {k: "" for k in _COLORS}
    mfu_s = "n/a" if mfu is None else f"{mfu:.2f}%"
    val_s = "" if val_loss is None else f"val_loss: {val_loss:8.5f}  "
    return (f"{c['red']}step: {step:2}  {c['green']}loss: {loss:8.5f}  {val_s}"
            f"{c['yellow']}grad_norm: {grad_norm:7.4f}  "
            f"{c['blue']}memory: {mem_gib:5.2f}GiB({mem_pct:.2f}%)  {c['cyan']}tps: {round(tps):,}  "
            f"{c['magenta']}tflops: {tflops:,.2f}  mfu: {mfu_s}{c['reset']}")


def step1_sanity(loss: float, vocab_size: int, loaded_weights: bool) -> str:
    """A note on the first loss: ~ln(vocab) means random predictions (torchtitan issue #2053)."""
    ref = math.log(vocab_size)
    looks_random = loss > 0.9 * ref
    note = f"step-1 loss {loss:.4f} vs ln(vocab={vocab_size}) = {ref:.4f}: "
    if loaded_weights and looks_random:
        return note + ("WARNING: weights were loaded but the loss looks like random init -- "
                       "check the checkpoint path / key mapping")
    if loaded_weights:
        return note + "below random, consistent with the loaded weights"
    return note + ("as expected for random init" if looks_random else
                   "below random already (resumed or non-random init)")


class MetricsLogger:
    """Console line (through logging) + JSONL (rank 0) + a progress bar that advances every step."""

    def __init__(self, dump_folder: str, cfg: Any, steps: int, start_step: int, rank: int,
                 flops_per_tok: int, peak: float | None, device: torch.device,
                 non_dp_size: int = 1, history: list[dict[str, Any]] | None = None) -> None:
        """``history``: the records kept from an earlier part of the run (:func:`resume_jsonl`, which the caller
        runs on rank 0 and shares, so that a refusal stops every rank); rank 0 appends to the file."""
        self.cfg, self.rank, self.device = cfg, rank, device
        self.flops_per_tok, self.peak, self.non_dp_size = flops_per_tok, peak, non_dp_size
        self.history: list[dict[str, Any]] = list(history or [])
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self._jsonl = None
        self.dump_folder = dump_folder
        if rank == 0 and cfg.jsonl:
            os.makedirs(dump_folder, exist_ok=True)
            self._jsonl = open(self.jsonl_path, "a")
        self._bar = None
        if rank == 0 and cfg.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm
            # redrawn every step (steps take far longer than a redraw); tqdm computes the ETA
            self._bar = tqdm(total=steps, initial=start_step, desc="train", unit="step", leave=False,
                             file=sys.stderr, mininterval=0, miniters=1, dynamic_ncols=True)
        self._line = None
        if rank == 0 and cfg.progress_freq > 0 and self._bar is None and not sys.stderr.isatty():
            self._line = ProgressLine(steps, start_step, cfg.progress_freq)
        self._t_last = self._t_bar = time.perf_counter()
        self._tokens_since = self._tokens_bar = 0
        self._val_loss: float | None = None

    def validation(self, val_loss: float, seconds: float) -> None:
        """This step's validation loss (goes into the next log line and record); the `seconds` it took
        are left out of the tokens/s of the step."""
        self._val_loss = val_loss
        self._t_last += seconds
        self._t_bar += seconds

    def add_tokens(self, n: int) -> None:
        self._tokens_since += n
        self._tokens_bar += n

    def progress(self, step: int, loss: float) -> None:
        """Advance the bar to ``step`` (call every step) with the last step's tokens/s and loss; without a
        terminal, a progress line every ``progress_freq`` steps."""
        if self._line is not None:
            self._line.update(step, loss, self._tokens_bar)
            self._tokens_bar = 0
        if self._bar is None:
            return
        now = time.perf_counter()
        tps = self._tokens_bar / (max(now - self._t_bar, 1e-9) * self.non_dp_size)
        self._t_bar, self._tokens_bar = now, 0
        self._bar.set_postfix_str(f"{tps:,.0f} tok/s, loss {loss:.4f}", refresh=False)
        self._bar.update(step - self._bar.n)

    def log(self, step: int, loss: float, grad_norm: float, extra: dict[str, Any]) -> dict[str, Any]:
        now = time.perf_counter()
        dt = max(now - self._t_last, 1e-9)
        # tokens/s per device (torchtitan divides by the non-data-parallel size, e.g. TP)
        tps = self._tokens_since / (dt * self.non_dp_size)
        tflops = self.flops_per_tok * tps / 1e12
        mfu = None if self.peak is None else 100 * self.flops_per_tok * tps / self.peak
        mem_gib, mem_pct = device_memory(self.device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # the console line shows this rank's peak; the record also keeps the largest over ranks
            peak = torch.tensor([mem_gib])
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            extra = {**extra, "memory_max_rank_gib": float(peak)}
        rec = {"step": step, "loss": loss, "grad_norm": grad_norm, "memory_gib": mem_gib, "memory_pct": mem_pct,
               "tps": tps, "tflops": tflops, "mfu": mfu, "time_s": dt, **extra}
        val_loss, self._val_loss = self._val_loss, None
        if val_loss is not None:
            rec["val_loss"] = val_loss
        self.history.append(rec)
        if self.rank == 0:
            line = format_line(step, loss, grad_norm, mem_gib, mem_pct, tps, tflops, mfu, self.cfg.color, val_loss)
            LOGGER.info(line)
            if self._jsonl is not None:
                self._append(rec)
        self._t_last = time.perf_counter()
        self._tokens_since = 0
        return rec

    def _append(self, rec: dict[str, Any]) -> None:
        """One line per record, flushed; a failed write (disk full) stops the run with the save's message."""
        try:
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        except OSError as e:
            from trnkit.harness.checkpoint import write_failed

            last = self.history[-2]["step"] if len(self.history) > 1 else None
            kept = (f"{self.jsonl_path} keeps the records up to step {last}" if last is not None else
                    f"{self.jsonl_path} has no complete record yet")
            raise write_failed(f"metrics: appending the record of step {rec['step']} to {self.jsonl_path}",
                               self.dump_folder, e, "", kept) from e

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            try:
                self._jsonl.close()
            except OSError as e:  # the write that failed has already been reported
                LOGGER.warning(f"could not close {self.jsonl_path}: {e}")
            self._jsonl = None


def plot_loss(records: Iterable[dict[str, Any]], path: str, title: str = "training loss",
              vocab_size: int | None = None) -> str:
    """Loss per logged step as a PNG, the validation loss (records with ``val_loss``) as a second curve;
    with `vocab_size`, a dashed line at ln(vocab) (random guessing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    recs = list(records)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], marker=".", lw=1.2, label="training loss")
    val = [r for r in recs if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], marker="o", ms=4, lw=1.2,
                label="validation loss")
    if vocab_size:
        ax.axhline(math.log(vocab_size), ls="--", lw=0.8, color="gray", label=f"ln(vocab = {vocab_size:,})")
    if val or vocab_size:
        ax.legend(loc="upper right", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def read_jsonl(path: str, repair_tail: bool = False) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file. `repair_tail`: a last line cut off by a killed run (no newline
    after it, not valid JSON) is dropped with a warning; any other bad line is a ConfigError naming it."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    out = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a record with an integer step")
        except ValueError as e:
            if repair_tail and n == len(lines):  # the last line has no newline: the write was cut off
                LOGGER.warning(f"metrics: the last line of {path} was cut off (a run killed while writing it); "
                               f"dropping it: {raw[:60]!r}")
                break
            advice = "; move the file away to let the run start a new one" if repair_tail else ""
            raise ConfigError(f"metrics: {path}:{n} is not a metrics record ({e}){advice}") from None
        out.append(rec)
    return out


def resume_jsonl(path: str, start_step: int) -> list[dict[str, Any]]:
    """The records a (resumed) run keeps: those of steps <= start_step. The file is rewritten (to a temporary
    file, then renamed: :func:`~trnkit.harness.rundir.write_run_file`, never through a link) only when it holds
    more than that or a torn last line; else it is appended to."""
    if not os.path.exists(path):
        return []
    records = read_jsonl(path, repair_tail=True)
    kept = [r for r in records if r["step"] <= start_step]
    with open(path, "rb") as f:
        clean_end = f.read().endswith(b"\n") or os.path.getsize(path) == 0
    if kept != records or not clean_end:
        write_run_file(path, "".join(json.dumps(r) + "\n" for r in kept), key="metrics")
    return kept


__all__ = ["MetricsLogger", "ModelShape", "PEAK_FLOPS", "count_params", "device_memory", "flops_per_token",
           "format_line", "peak_flops", "plot_loss", "read_jsonl", "resume_jsonl", "step1_sanity"]
