"""Per-rank memory plan of a training run, before anything is allocated.

``python -m trnkit.harness.plan --config <toml|name> [--device trn2] [--world-size N] [--section.field value ...]``
prints what one rank holds at the peak of a training step: parameters, gradients, optimizer state, the
activations saved for the backward, the MoE dispatch buffers, the loss chunk, the FSDP / TP communication
buffers and the backward's working set, for the config's FSDP / TP degrees, and whether it fits the
device's memory, with the largest terms first. ``--layouts 64x1,16x4`` prints one row per FSDP x TP layout.

The model is the trainer's own (trnkit.qwen3, the same saved tensors as its forward): the terms are sums
of tensor sizes derived from its code, not fitted constants. What it does not count: the allocator's
fragmentation and caching, the framework's own memory (the Neuron runtime, compiled graphs), and the
host-side data pipeline. ``benchmarks/plan_check.py`` compares the plan with the measured peak on CPU.

Device memory per rank (one logical NeuronCore, the unit torchrun places a rank on):
* trn2: a Trainium2 chip has 96 GiB of HBM and 8 physical NeuronCores; with the default LNC=2 two physical
  cores form one logical core, so 4 per chip and 24 GiB each (a trn2.48xlarge: 16 chips, 64 logical cores,
  1.5 TiB). ``trn2-lnc1``: 8 ranks per chip, 12 GiB each. (AWS Trainium2 architecture page, Neuron docs.)
* trn1: a Trainium chip has 32 GiB of HBM and 2 NeuronCores: 16 GiB per core (a trn1.32xlarge: 16 chips,
  32 cores). (AWS Trainium architecture page, Neuron docs.)
* cpu: the host's physical memory shared by the ranks of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from trnkit.errors import ConfigError
from trnkit.harness.config import load_config, resolve_parallel_degrees
from trnkit.harness.models import build_spec
from trnkit.model_spec import CHUNKED_LOSS, LossForm, ModelSpec
from trnkit.packaged import resolve_config

GiB = 2**30

# Bytes per rank (logical core). Sources in the module docstring.
DEVICE_MEMORY: dict[str, int] = {
    "trn2": 96 * GiB // 4,
    "trn2-lnc1": 96 * GiB // 8,
    "trn1": 32 * GiB // 2,
}
INSTANCE_RANKS = {"trn2.48xlarge": 64, "trn1.32xlarge": 32}  # logical cores per instance (trn2: LNC=2)


FORWARD, BACKWARD = "end of forward", "end of backward"
BOTH = (FORWARD, BACKWARD)


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    note: str
    phases: tuple[str, ...] = BOTH  # when it is held: the activations at the end of the forward, the
    # gradients at the end of the backward (the activations are freed layer by layer as their gradients form)


@dataclass
class MemoryPlan:
    """One rank's memory at the peak of a training step."""
    model: str
    device: str
    capacity: int | None             # bytes per rank; None: unknown
    dp: int
    tp: int
    terms: list[Term] = field(default_factory=list)

    def phase_total(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if phase in t.phases)

    @property
    def peak_phase(self) -> str:
        return max(BOTH, key=self.phase_total)

    @property
    def total(self) -> int:
        """The peak: the larger of the two phases' sums."""
        return self.phase_total(self.peak_phase)

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    def largest(self, n: int = 3) -> list[Term]:
        """The largest terms held at the peak."""
        return sorted((t for t in self.terms if self.peak_phase in t.phases), key=lambda t: -t.bytes)[:n]

    def verdict(self) -> str:
        top = ", ".join(f"{t.name} {gib(t.bytes)}" for t in self.largest())
        if self.capacity is None:
            return f"needs {gib(self.total)} per rank (device memory unknown); largest: {top}"
        word = "fits" if self.fits else "does NOT fit"
        return (f"{word}: {gib(self.total)} of {gib(self.capacity)} per rank on {self.device} "
                f"({100 * self.total / self.capacity:.0f}%); largest: {top}")

    def table(self) -> str:
        lines = [f"memory plan per rank: {self.model}, dp_shard {self.dp} x tp {self.tp} on {self.device}"]
        w = max([len(t.name) for t in self.terms] + [len("at the " + phase) for phase in BOTH])
        for t in sorted(self.terms, key=lambda t: -t.bytes):
            when = "" if t.phases == BOTH else f" [{t.phases[0]} only]"
            lines.append(f"  {t.name:<{w}}  {gib(t.bytes):>10}  {t.note}{when}")
        for phase in BOTH:
            lines.append(f"  {'at the ' + phase:<{w}}  {gib(self.phase_total(phase)):>10}"
                         + ("  <- peak" if phase == self.peak_phase else ""))
        lines.append(self.verdict())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "device": self.device, "capacity_bytes": self.capacity, "dp": self.dp,
                "tp": self.tp, "total_bytes": self.total, "peak_phase": self.peak_phase, "fits": self.fits,
                "terms": [{"name": t.name, "bytes": t.bytes, "note": t.note, "phases": list(t.phases)}
                          for t in self.terms]}


def gib(n: int | float) -> str:
    return f"{n / GiB:,.2f} GiB"


def planned_config(spec: ModelSpec) -> Any:
    """The Qwen3Config the plan counts, from the model's :class:`ModelSpec`; a ConfigError when it has none."""
    mc = spec.plan_config()
    if mc is None:
        raise ConfigError(f"plan: model.spec {spec.name!r} is not Qwen3-shaped (its ModelSpec has no plan_config)")
    return mc


def loss_form(spec: ModelSpec) -> LossForm:
    """The spec's optional ``loss_form``; :data:`~trnkit.model_spec.CHUNKED_LOSS` for a family without one."""
    form = getattr(spec, "loss_form", CHUNKED_LOSS)
    if not isinstance(form, LossForm):
        raise ConfigError(f"plan: model.spec {spec.name!r}: ModelSpec.loss_form must be a "
                          f"trnkit.model_spec.LossForm, got {form!r}")
    return form


def plan(cfg: Any, world_size: int, device: str = "trn2", capacity: int | None = None,
         activation_checkpointing: str | None = None, spec: ModelSpec | None = None) -> MemoryPlan:
    """The per-rank memory plan of ``cfg`` (a TrainerConfig) on ``world_size`` ranks of ``device``, for the
    model of ``spec`` (default: ``cfg.model``'s, built by ``harness.models.build_spec``).
    ``activation_checkpointing`` ("none" or "full": per-block recompute) defaults to the config's
    ``training.activation_checkpointing``."""
    dp, tp = resolve_parallel_degrees(cfg.parallelism, world_size)
    spec = spec if spec is not None else build_spec(cfg)
    mc = planned_config(spec)
    form = loss_form(spec)
    t = cfg.training
    activation_checkpointing = activation_checkpointing or t.activation_checkpointing
    if capacity is None:
        capacity = DEVICE_MEMORY.get(device)
    bf16 = t.dtype == "bfloat16"
    a = 2 if bf16 else 4                       # activation bytes (autocast / FSDP param_dtype)
    r = 2 if bf16 and dp > 1 else 4            # residual stream: bf16 under FSDP mixed precision, fp32 under autocast
    tokens = t.local_batch_size * t.seq_len    # per microbatch per rank
    shard_i = cfg.parallelism.tp_experts == "shard_i" and tp > 1
    aux = (t.moe_aux_loss_coef if t.moe_aux_loss_coef is not None else mc.router_aux_loss_coef) > 0

    # ---- parameters, split by how TP shards them (native models: attention, dense FFN, vocab are TP-sharded)
    d, hd = mc.dim, mc.head_dim
    attn = d * hd * (2 * mc.n_heads + 2 * mc.n_kv_heads)
    norms_per_layer = 2 * hd + 2 * d
    experts_per_moe_layer = mc.num_experts * 3 * d * mc.moe_inter_dim
    router_per_moe_layer = mc.num_experts * d
    n_moe = sum(mc.is_moe_layer(i) for i in range(mc.n_layers))
    n_dense = mc.n_layers - n_moe
    vocab = mc.vocab_size * d * (1 if mc.tie_word_embeddings else 2)
    vocab_tp = tp if form.vocab_sharded_by_tp else 1
    tp_sharded = mc.n_layers * attn + n_dense * 3 * d * mc.hidden_dim
    experts = n_moe * experts_per_moe_layer
    replicated = mc.n_layers * norms_per_layer + n_moe * router_per_moe_layer + d
    per_rank = tp_sharded / tp + vocab / vocab_tp + (experts / tp if shard_i else experts) + replicated
    params_local = per_rank / dp                   # FSDP shards every parameter over dp
    total_params = mc.num_params()

    terms = [
        Term("parameters", int(4 * params_local), f"fp32, {total_params / 1e9:.3f} B in all, 1/{dp} per FSDP "
             f"shard{(', TP-sharded attention/FFN' + ('/vocab' if vocab_tp > 1 else '')) if tp > 1 else ''}"),
        Term("gradients", int(4 * params_local), "fp32, sharded as the parameters (set to None before each step)",
             (BACKWARD,)),
        Term("optimizer state", int(8 * params_local), "AdamW exp_avg + exp_avg_sq, fp32"),
    ]

    # ---- the largest block, unsharded (FSDP all-gathers one block and prefetches the next)
    block_moe = (attn / tp + (experts_per_moe_layer / tp if shard_i else experts_per_moe_layer)
                 + router_per_moe_layer + norms_per_layer)
    block_dense = (attn + 3 * d * mc.hidden_dim) / tp + norms_per_layer
    root = vocab / vocab_tp + d                       # FSDP's root unit: embedding, lm_head, final norm
    block_local = max(block_moe if n_moe else 0, block_dense if n_dense else 0, root)
    if dp > 1:
        terms.append(Term("FSDP all-gather buffers", int(2 * a * block_local),
                          f"largest FSDP unit (a block, or the embedding + lm_head) unsharded in "
                          f"{'bf16' if bf16 else 'fp32'}, current + prefetched"))
        terms.append(Term("FSDP reduce-scatter buffers", int(4 * block_local * (1 + 1 / dp)),
                          "largest unit's gradients, fp32 (reduce_dtype), input + output shard", (BACKWARD,)))
    elif bf16:
        terms.append(Term("autocast weight copies",
                          int(2 * (tp_sharded / tp + vocab / vocab_tp + (experts / tp if shard_i else experts))),
                          "bf16 casts of the matmul weights, kept for the backward"))

    # ---- activations saved for the backward (per token, per layer), in the model's own order
    q, kv = mc.n_heads * hd / tp, mc.n_kv_heads * hd / tp
    norm_saved = r * d + 4 + 2 * a * d                         # input (residual), rstd, normed, scaled output
    # q, k: proj, q/k-norm (normed, out), rotate_half, rope out
    attn_tok = (norm_saved + 5 * a * q + 5 * a * kv + a * kv
                + 2 * a * q + 4 * mc.n_heads / tp)             # SDPA out (+ its reshape copy), logsumexp
    ffn_norm_tok = norm_saved
    dense_tok = 4 * a * mc.hidden_dim / tp                     # w1, silu, w3, product
    inter = mc.moe_inter_dim / tp if shard_i else mc.moe_inter_dim
    k = mc.top_k
    router_tok = 4 * mc.num_experts * (2 + (1 if aux else 0)) + 8 * k + 8 * k
    expert_tok = k * a * 4 * inter + 8 * k                     # gate_up (2I), silu, product; sort order
    dispatch_tok = k * a * d * 3                               # permuted input, expert output, weighted output
    # gradient accumulation frees each microbatch's activations in its own backward: one microbatch counts
    layer_tok = [attn_tok + ffn_norm_tok + (router_tok + expert_tok if mc.is_moe_layer(i) else dense_tok)
                 for i in range(mc.n_layers)]
    dispatch = tokens * dispatch_tok
    if activation_checkpointing == "none":
        act, n_dispatch = tokens * sum(layer_tok), n_moe
        how = "no activation checkpointing: every layer's are kept"
    else:  # full, per block: each block's input is kept, one block's activations are recomputed at a time
        act, n_dispatch = tokens * (mc.n_layers * r * d + max(layer_tok)), min(n_moe, 1)
        how = "full activation checkpointing: each block's input, one block's recomputed at a time"
    terms.append(Term("activations", int(act), f"saved for the backward: {t.local_batch_size} x {t.seq_len} "
                      f"tokens, {mc.n_layers} layers, {'bf16' if bf16 else 'fp32'}; {how}", (FORWARD,)))
    if n_moe:
        terms.append(Term("MoE dispatch buffers", int(n_dispatch * dispatch),
                          f"top-{k} tokens permuted to their experts and back, {n_dispatch} MoE layer"
                          f"{'s' if n_dispatch != 1 else ''}", (FORWARD,)))

    # ---- the loss: final norm, and the chunked linear cross-entropy (or full logits)
    v_local = mc.vocab_size / vocab_tp
    chunk = 0 if form.full_logits else t.loss_chunk_size
    if chunk > 0:
        rows = min(chunk, tokens)
        loss = (tokens * (norm_saved + a * d)               # final norm saved tensors, dh [tokens, dim]
                + 4 * v_local * d                           # dW of the lm_head, fp32, held until the backward
                + (2 * 2 * v_local * d if bf16 else 0)      # the lm_head weight cast to bf16, the bf16 dW product
                + rows * v_local * (4 + (2 if bf16 else 0)))  # one [chunk, vocab] block (fp32; + bf16 logits)
        note = f"chunked cross-entropy: a [{rows}, {v_local:,.0f}] block, dW and dh held from the forward"
    else:
        # the peak is the log-softmax's backward: its saved fp32 output, incoming gradient and result (the
        # forward holds at most the logits in bf16, their fp32 copy and the fp32 log-softmax: 10 bytes)
        loss = tokens * (norm_saved + v_local * 3 * 4)
        note = f"full logits [{tokens}, {v_local:,.0f}] + fp32 log-softmax and its backward"
    terms.append(Term("loss chunk", int(loss), note, (FORWARD,)))

    if mc.tie_word_embeddings:
        # the embedding's backward forms a dense [vocab, dim] gradient and adds it to the one the lm_head
        # already left in the shared weight's .grad: both exist at once near the end of the backward
        terms.append(Term("tied embedding gradient", int(4 * v_local * d), "the embedding's dense "
                          "gradient before it is added to the tied lm_head's", (BACKWARD,)))

    # ---- the backward's working set: gradients of one layer's activations (in flight at once)
    widest = max(mc.hidden_dim / tp if n_dense else 0, k * 2 * inter if n_moe else 0, q + 2 * kv)
    work = tokens * (3 * 4 * d + 2 * a * widest)
    if tp > 1:
        work += tokens * 2 * a * d                   # TP all-reduce of block outputs / input grads
    terms.append(Term("backward working set", int(work), "one layer's activation gradients"
                      + (" + TP all-reduce buffers" if tp > 1 else ""), (BACKWARD,)))
    name = f"{spec.name} ({total_params / 1e9:.2f} B params)"
    return MemoryPlan(name, device, capacity, dp, tp, terms)


def cpu_capacity(ranks_on_host: int) -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(ranks_on_host, 1)
    except (ValueError, OSError):  # pragma: no cover
        return None


def device_of(device_type: str, device_name: str = "") -> str:
    """The plan's device name for a torch device type and name (neuron: trn1 or trn2 from its name)."""
    if device_type != "neuron":
        return "cpu"
    return "trn1" if "trn1" in device_name.lower() else "trn2"


def check_at_startup(cfg: Any, spec: ModelSpec, world_size: int, device_type: str, device_name: str, mode: str,
                     log: Any, ranks_on_host: int | None = None) -> MemoryPlan | None:
    """The trainer's start-up check (``job.memory_check``): log the plan's verdict; when it does not fit,
    warn ("warn") or raise ConfigError ("stop"; "auto" is "stop" on CPU, "warn" on a device). On CPU the
    host's memory is shared by ``ranks_on_host`` ranks (default: all of them). A model the planner cannot read
    is logged and skipped."""
    if mode == "off":
        return None
    device = device_of(device_type, device_name)
    setting = f"job.memory_check = {mode!r}" + (" (the default)" if mode == "auto" else "")
    if mode == "auto":
        mode = "stop" if device == "cpu" else "warn"
    try:
        capacity = cpu_capacity(ranks_on_host or world_size) if device == "cpu" else None
        p = plan(cfg, world_size, device, capacity, spec=spec)
    except ConfigError as e:
        log(f"memory plan: skipped ({e})")
        return None
    log(f"memory plan ({p.peak_phase}): {p.verdict()} (python -m trnkit.harness.plan --config ... shows every term)")
    if p.fits is False:
        if mode == "stop":
            raise ConfigError(f"{setting}: the run does not fit: {p.verdict()}. Nothing was written. Lower "
                              "training.local_batch_size / seq_len or the model size, raise the FSDP or TP degree, "
                              "or start it anyway with --job.memory_check warn (the plan counts tensors only)")
        from trnkit.harness.logs import LOGGER

        LOGGER.warning(f"memory plan: the run does not fit: {p.verdict()}")
    return p


def measured_vs_plan(p: MemoryPlan, measured_bytes: float) -> str:
    """The line the trainer logs on a neuron device after the first step."""
    return (f"device memory after step 1: measured peak {gib(measured_bytes)}, plan {gib(p.total)} "
            f"({measured_bytes / p.total - 1:+.0%})")


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            dp, tp = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ConfigError(f"plan --layouts: expected DPxTP items such as 64x1,16x4, got {item!r}") from None
        if dp < 1 or tp < 1:
            raise ConfigError(f"plan --layouts: dp_shard and tp must be >= 1, got {item!r}")
        out.append((dp, tp))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trnkit.harness.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a trainer TOML file or a shipped config's name")
    parser.add_argument("--device", default="trn2", choices=[*DEVICE_MEMORY, "cpu"],
                        help="memory per rank: trn2 (LNC=2 logical core, 24 GiB), trn2-lnc1, trn1, cpu (host RAM)")
    parser.add_argument("--world-size", type=int, default=0,
                        help="ranks (default: the config's degrees, or the whole --instance)")
    parser.add_argument("--instance", choices=sorted(INSTANCE_RANKS), help="world size of one instance")
    parser.add_argument("--layouts", help="one row per FSDP x TP layout, e.g. 64x1,32x2,16x4,8x8")
    parser.add_argument("--activation-checkpointing", choices=("none", "full"), default=None,
                        help="training.activation_checkpointing for this plan (default: the config's)")
    parser.add_argument("--json", action="store_true")
    args, rest = parser.parse_known_args(argv)
    try:
        if args.world_size < 0:
            raise ConfigError(f"plan --world-size: must be >= 1 (or 0: the config's degrees), got {args.world_size}")
        given = [f"{flag} {value}" for flag, value in (("--world-size", args.world_size), ("--instance", args.instance))
                 if value]
        if len(given) > 1 or (given and args.layouts):  # one of them would be ignored
            raise ConfigError(f"plan {' and '.join(given)}{' and --layouts' if args.layouts else ''}: each sets the "
                              "world size (a --layouts item DPxTP: DP x TP ranks); give one")
        cfg = load_config(resolve_config(args.config), rest)
        if args.layouts:
            plans = []
            for dp, tp in parse_layouts(args.layouts):
                cfg.parallelism.data_parallel_shard_degree, cfg.parallelism.tensor_parallel_degree = dp, tp
                plans.append(plan(cfg, dp * tp, args.device, cpu_capacity(dp * tp) if args.device == "cpu" else None,
                                  args.activation_checkpointing))
            if args.json:
                print(json.dumps([p.to_dict() for p in plans], indent=2))
            else:
                print(layouts_table(plans))
            return 0
        p = cfg.parallelism
        world = args.world_size or INSTANCE_RANKS.get(args.instance or "", 0) or \
            (max(p.data_parallel_shard_degree, 1) * p.tensor_parallel_degree)
        result = plan(cfg, world, args.device, cpu_capacity(world) if args.device == "cpu" else None,
                      args.activation_checkpointing)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


def layouts_table(plans: list[MemoryPlan]) -> str:
    names = list(dict.fromkeys(t.name for p in plans for t in p.terms))
    head = "| dp_shard x tp | " + " | ".join(names) + " | total per rank | fits |"
    lines = [f"memory plan per rank: {plans[0].model} on {plans[0].device}"
             f" ({gib(plans[0].capacity) if plans[0].capacity else 'unknown'} per rank)", head,
             "|" + "---|" * (len(names) + 3)]
    for p in plans:
        by_name = {t.name: t.bytes for t in p.terms}
        cells = [gib(by_name[n]) if n in by_name else "-" for n in names]
        fits = "-" if p.fits is None else ("yes" if p.fits else "**no**")
        lines.append(f"| {p.dp} x {p.tp} | " + " | ".join(cells) + f" | {gib(p.total)} | {fits} |")
    lines.append("total per rank: the larger of the sums at the end of the forward (activations, dispatch buffers, "
                 "loss chunk) and at the end of the backward (gradients, reduce-scatter buffers, working set)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
