"""The training loop: ``python -m trnkit.harness.train --config configs/X.toml [--section.field value ...]``.

Also under ``torchrun --nproc_per_node N -m trnkit.harness.train ...``. Order of operations (as in
torchtitan): build the model on the meta device -> parallelize (TP; FSDP2 here when each rank
initialises only its shards) -> materialise (``to_empty``) -> initialise or load weights -> swap in
kernels through the override registry (report printed, validated on this run's shapes) -> FSDP2
(replicated init) -> resume from the latest checkpoint if there is one -> train -> final checkpoint /
HF export / loss plot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import sys
import threading
import time
import typing
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from safetensors import SafetensorError

from trnkit import envinfo
from trnkit.harness import parallel
from trnkit.harness.aux_loss import MoEAuxLoss
from trnkit.errors import TrnkitError
from trnkit.harness.checkpoint import (MANIFEST, CheckpointSaveError, Checkpointer, RunIdentity, find_resumable,
                                       full_model_state_dict, human_bytes, load_full_model_state_dict, manifest_entry,
                                       on_rank0, utc_now, write_failed, written_by)
from trnkit.harness.config import (ConfigError, LRSchedulerConfig, OptimizerConfig, TrainerConfig, ValidationConfig,
                                   _suggest, check_log_rank, coerce, parse_args, to_toml)
from trnkit.harness.data import IGNORE_INDEX, build_loaders
from trnkit.harness.metrics import (MetricsLogger, device_memory, flops_per_token, peak_flops, plot_loss,
                                    resume_jsonl, step1_sanity)
from trnkit.harness.lnc import resolve_run_lnc
from trnkit.harness.logs import LOGGER, interrupt_message, setup_logging, trnkit_warnings_logged
from trnkit.harness.models import build_spec, has_hf_weights
from trnkit.harness.plan import check_at_startup, measured_vs_plan
from trnkit.harness.plugins import import_plugins
from trnkit.harness.rundir import (RunLock, archive_previous_run, check_run_files, creatable_folder,
                                   keep_changed_config, writable_inside, write_run_file)
from trnkit.harness.validation import Validator
from trnkit.model_spec import ModelSpec
from trnkit.qwen3.tp_experts import from_tp_layout, to_tp_layout

if TYPE_CHECKING:
    from trnkit.overrides import OverrideReport

DEBUG_ENV = "TRNKIT_DEBUG"
EXPORT_DIR = "hf_export"  # under job.dump_folder


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/inf; the last good checkpoint is kept."""


@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)   # step -> global average loss
    grad_norms: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss (all dp ranks)
    start_step: int = 0
    final_step: int = 0
    dump_folder: str = ""
    override_table: str = ""
    hf_export: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)
    model: Any = None                                          # the trained module (this rank's part)


def lr_lambda(cfg: LRSchedulerConfig, steps: int) -> Callable[[int], float]:
    """Multiplier for optimizer step i (0-based): linear warmup to 1, then cosine/linear decay to min."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_factor
    decay_steps = max(steps - warmup, 1)

    def fn(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min((i - warmup) / decay_steps, 1.0)
        if cfg.decay_type == "constant":
            return 1.0
        if cfg.decay_type == "linear":
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


class _Log:
    def __call__(self, msg: str) -> None:
        LOGGER.info(msg)  # which ranks print is set_logging's rank filter (metrics.log_rank)


def override_config(cfg: TrainerConfig, lnc: int = 0) -> Any:
    """The registry's ``OverrideConfig`` for ``[overrides]`` (None when off); errors name the config keys.
    ``lnc``: the run's resolved LNC (:func:`~trnkit.harness.lnc.resolve_run_lnc`); 0 keeps ``overrides.lnc``.

    Built before anything heavy runs, so an unknown op or impl name stops the run at once.
    """
    o = cfg.overrides
    if o.policy == "off":
        return None
    try:
        # checked again (fields set one by one from TOML / CLI); the dry-run validation sees this run's
        # real shapes: [local_batch_size, seq_len] tokens
        return dataclasses.replace(o, seq_len=cfg.training.seq_len, batch_size=cfg.training.local_batch_size,
                                   lnc=lnc or o.lnc or None)
    except (ValueError, KeyError) as e:  # unknown op / impl names, from the registry
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise ConfigError(f"config overrides (ops = {list(o.ops)}, impl = {o.impl!r}): {msg}") from e


def _apply_overrides(model: torch.nn.Module, cfg: TrainerConfig, log: _Log, lnc: int) -> OverrideReport | None:
    # On a model already sharded (FSDP2 first, or tensor parallelism) the registry skips its validation dry run
    # (its parameters are DTensors) and its report, logged below, says so.
    ocfg = override_config(cfg, lnc)
    if ocfg is None:
        if cfg.overrides.ops:  # (policy "off", the default: a run that names ops without a policy swaps nothing)
            log(f"overrides: policy 'off' swaps nothing; overrides.ops {list(cfg.overrides.ops)} unused "
                "(overrides.policy = 'strict' or 'fallback' swaps them)")
        return None
    from trnkit.overrides import apply_overrides

    report = apply_overrides(model, ocfg)
    log("kernel overrides:\n" + report.table())
    _check_every_op_found(ocfg, {row.op for row in report.rows}, cfg.model.spec)
    return report


def _keys_set(v: ValidationConfig) -> list[str]:
    """``validation.<key> = <value>`` for each key other than ``enabled`` that differs from its default."""
    default = ValidationConfig()
    return [f"validation.{f.name} = {getattr(v, f.name)!r}" for f in dataclasses.fields(v)
            if f.name != "enabled" and getattr(v, f.name) != getattr(default, f.name)]


def _code_note(report: OverrideReport | None) -> str:
    """config.toml's closing comment: the code each impl name that is not trnkit's built-in ran (a plugin's
    impl, or a plugin's replacement of ``nki`` / ``reference``), so the run folder says what ran."""
    lines = report.code_lines() if report is not None else []
    if not lines:
        return ""
    return ("\n# kernel code that is not trnkit's built-ins (overrides.impl names, resolved at the start of this "
            "run):\n" + "".join(f"# {line}\n" for line in lines))


def _check_every_op_found(ocfg: Any, found: set[str], spec: str) -> None:
    """An op of ``overrides.ops`` that no module of the model runs: refused under ``strict`` (which promises every
    listed kernel runs), warned about under ``fallback``."""
    missing = [op for op in ocfg.ops if op not in found]
    if not missing:
        return
    why = (" (transformers models compute their loss outside any module)"
           if "linear_cross_entropy" in missing and spec.startswith("hf:") else "")
    what = f"overrides.ops: {missing} match no module of model {spec!r}{why}, so no kernel of them would run"
    if ocfg.policy == "strict":
        raise ConfigError(f"config {what}; under policy 'strict' every listed op must be swapped in. Nothing was "
                          "written. Remove them from overrides.ops (or use policy 'fallback', which warns)")
    LOGGER.warning(what)


def _build_model(spec: ModelSpec, cfg: TrainerConfig, env: parallel.DistEnv, log: _Log,
                 lnc: int = 0, load_path: str = "") -> tuple[Any, str, bool, str]:
    """Build, parallelize, materialise, initialise or load, swap kernels (at ``lnc`` cores per launch, the
    run's resolved LNC). Returns (model, override report (None: none applied), loaded, what TP sharded).
    ``load_path``: the HF folder the weights are loaded from (:func:`_initial_weights`; "" = initialise them).

    meta build -> TP -> [FSDP2 when each rank initialises only its shards] -> to_empty -> init or load
    -> kernel overrides -> [FSDP2 otherwise]. The overrides come after the weights so their
    validation dry run sees real devices and dtypes, and (with replicated init) before FSDP2, whose
    unshard hooks a fake-tensor dry run must not trigger and whose sharded parameters the kernels'
    static checks refuse. Swapped modules share the originals' parameter dicts, so TP and FSDP2
    handle their parameters as usual.
    """
    torch.manual_seed(cfg.job.seed)
    with torch.device("meta"):
        model = spec.build()
    bf16 = cfg.training.dtype == "bfloat16"
    fsdp_first = env.dp > 1 and not cfg.parallelism.replicated_init

    def fsdp() -> None:
        parallel.apply_fsdp(model, spec.blocks(model), env.mesh["dp"], torch.bfloat16 if bf16 else None)

    tp_desc = "off"
    if env.tp > 1:
        tp_desc = spec.parallelize(model, env.mesh["tp"], cfg.parallelism.tp_experts)
    if fsdp_first:
        fsdp()
    model.to_empty(device=env.device)
    spec.reset_buffers(model, env.device)

    loaded = bool(load_path)
    if load_path:
        log(f"loading HF weights from {load_path}")
        _load_full(model, spec, spec.state_dict_adapter.load_hf(load_path), _expert_tp(cfg, env))
    elif fsdp_first:
        log(f"init: each rank initialises its own shards (seed {cfg.job.seed} + rank)")
        with torch.no_grad(), parallel.local_shards(model):
            torch.manual_seed(cfg.job.seed + env.rank)  # independent values per shard
            spec.init_weights(model)
    elif env.tp == 1:
        # plain (not yet sharded) model: the same init as a single-process run
        with torch.no_grad():
            torch.manual_seed(cfg.job.seed)
            spec.init_weights(model)
    else:
        # TP-sharded: initialise the full model on CPU with the job seed on every rank and load the
        # shards, so the weights equal a single-process run's (sharded random init would not).
        torch.manual_seed(cfg.job.seed)
        full = spec.build()
        with torch.no_grad():
            torch.manual_seed(cfg.job.seed)
            spec.init_weights(full)
        _load_full(model, spec, full.state_dict(), _expert_tp(cfg, env))
        del full
    report = _apply_overrides(model, cfg, log, lnc=lnc)
    if env.dp > 1 and not fsdp_first:
        fsdp()
    return model, report, loaded, tp_desc


def _initial_weights(cfg: TrainerConfig, spec: ModelSpec, resuming: bool, log: _Log) -> str:
    """The HF folder a fresh start loads its weights from (checkpoint.initial_load_path, or the hf: model's own
    folder with model.hf_pretrained), "" for none; checked before the data and the model are built. A resume
    (``resuming``) takes every weight from its checkpoint, so the folder is not read (and may have moved)."""
    load_path = cfg.checkpoint.initial_load_path or (spec.hf_path if cfg.model.hf_pretrained else "")
    if load_path and resuming:
        log(f"initial weights {load_path} not read: this run resumes from a checkpoint, which holds its weights")
        return ""
    if not load_path or has_hf_weights(load_path):
        return load_path
    if not cfg.checkpoint.initial_load_path:  # model.hf_pretrained: the hf: folder exists (model.spec is checked)
        raise ConfigError(f"config model.hf_pretrained: true loads the weights of the model's folder {load_path!r}, "
                          "which holds no *.safetensors (set it false to start from random weights); got true")
    why = ("no such folder" if not os.path.lexists(load_path) else
           "a file, not a folder" if not os.path.isdir(load_path) else "no *.safetensors in it")
    raise ConfigError(f"checkpoint.initial_load_path: must be an HF checkpoint folder (config.json and *.safetensors); "
                      f"{why}, got {load_path!r}")


def _expert_tp(cfg: TrainerConfig, env: parallel.DistEnv) -> int:
    """TP degree of the experts' TP weight layout (1 = natural layout, see tp_experts.py)."""
    return env.tp if env.tp > 1 and cfg.parallelism.tp_experts == "shard_i" else 1


def _load_full(model: torch.nn.Module, spec: ModelSpec, sd: dict[str, torch.Tensor], expert_tp: int = 1) -> None:
    if expert_tp > 1:
        sd = to_tp_layout(sd, expert_tp)
    load_full_model_state_dict(model, sd, strict=True)  # a missing key would leave to_empty garbage
    spec.tie_weights(model)


def lr_schedule(cfg: TrainerConfig) -> dict[str, Any]:
    """The settings that decide the learning rate of every step (recorded in each checkpoint's manifest)."""
    s = cfg.lr_scheduler
    return {"training.steps": cfg.training.steps, "optimizer.lr": cfg.optimizer.lr,
            "lr_scheduler.warmup_steps": s.warmup_steps, "lr_scheduler.decay_type": s.decay_type,
            "lr_scheduler.min_lr_factor": s.min_lr_factor}


def _lr_of(schedule: dict[str, Any], i: int) -> float:
    """The learning rate of optimizer step i (0-based) under a recorded schedule (see :func:`lr_schedule`)."""
    s = LRSchedulerConfig(warmup_steps=schedule["lr_scheduler.warmup_steps"],
                          decay_type=schedule["lr_scheduler.decay_type"],
                          min_lr_factor=schedule["lr_scheduler.min_lr_factor"])
    return schedule["optimizer.lr"] * lr_lambda(s, schedule["training.steps"])(i)


def _schedule_changed(cfg: TrainerConfig, resume_from: tuple[int, str], log: _Log) -> bool:
    """Whether this run resumes with another learning rate than its checkpoint's schedule would give for
    any step still to train: refused (ConfigError, before anything is written) unless
    ``checkpoint.reschedule``, which follows the new schedule from the next step on. Settings that change
    no step's learning rate (e.g. more steps at a constant rate) resume as they are."""
    step, path = resume_from
    saved = manifest_entry(path, "schedule")
    now = lr_schedule(cfg)
    if not isinstance(saved, dict) or not set(now) <= set(saved):
        return False
    problem = _schedule_problem(saved, cfg)
    if problem:  # the manifest carries no checksum: a value of the wrong type is an edited or damaged manifest
        what = f"{os.path.join(path, MANIFEST)} records a learning-rate schedule that cannot be read ({problem})"
        if not cfg.checkpoint.reschedule:
            raise ConfigError(f"checkpoint: {what}. Nothing was written. Pass --checkpoint.reschedule true to follow "
                              f"this run's schedule from step {step + 1} on, or resume from another checkpoint.")
        log(f"WARNING: checkpoint.reschedule: {what}; the learning rate follows this run's schedule from step "
            f"{step + 1} on")
        return True
    changed = next((i for i in range(step, cfg.training.steps)
                    if not math.isclose(_lr_of(saved, i), _lr_of(now, i), rel_tol=1e-9)), None)
    if changed is None:
        return False
    diffs = "; ".join(f"{k}: checkpoint {saved[k]!r}, this run {v!r}" for k, v in now.items() if saved[k] != v)
    lrs = f"step {changed + 1} would train at lr {_lr_of(now, changed):.3g} instead of {_lr_of(saved, changed):.3g}"
    if not cfg.checkpoint.reschedule:
        raise ConfigError(
            f"checkpoint: {path} (step {step}) was written with another learning-rate schedule ({diffs}): {lrs}. "
            "Nothing was written. Resume with the checkpoint's settings (see its run's config.toml), or pass "
            f"--checkpoint.reschedule true to follow this run's schedule from step {step + 1} on.")
    log(f"WARNING: checkpoint.reschedule: the learning rate follows this run's schedule from step {step + 1} on "
        f"({diffs}): {lrs}")
    return True


def _schedule_problem(saved: dict[str, Any], cfg: TrainerConfig) -> str | None:
    """Why a manifest's recorded schedule (:func:`lr_schedule`'s keys) is not one this trainer could have written:
    the first value that is not of its config field's type (None: every value is)."""
    for key in lr_schedule(cfg):
        sec, name = key.split(".")
        try:
            coerce(key, typing.get_type_hints(type(getattr(cfg, sec)))[name], saved[key])
        except ConfigError as e:
            return str(e).removeprefix("config ")
    return None


def _finished_message(ckpt_path: str, ckpt_step: int, steps: int, dump: str) -> str:
    """What a resume prints when its checkpoint leaves no step to train: a rerun of a finished job (the
    checkpoint at training.steps), or training.steps set below a checkpoint's step."""
    why = "this job has already finished" if ckpt_step == steps else \
        f"training.steps is below the checkpoint's step {ckpt_step}"
    return (f"nothing to train: checkpoint {ckpt_path} is at step {ckpt_step} and training.steps = {steps} "
            f"({why})\n"
            f"  to train longer:  --training.steps N with N > {ckpt_step} and --checkpoint.reschedule true (the "
            f"learning rate then follows the schedule of N steps from step {ckpt_step + 1} on)\n"
            f"  to start fresh:   use another --job.dump_folder, or --checkpoint.resume false (trains from step 1; "
            f"this run's files are first moved to {dump}/previous-<time>/)")


def run(cfg: TrainerConfig) -> RunResult:
    """Train according to `cfg` (in this process; one rank of a torchrun job or a world of one)."""
    cfg.validate()
    env = parallel.init_distributed(cfg.parallelism)
    check_log_rank(cfg.metrics.log_rank, env.world_size)
    setup_logging(env.rank, env.world_size, cfg.metrics.log_rank)
    prev_det = torch.are_deterministic_algorithms_enabled()
    finished = False
    lock = RunLock(cfg.job.dump_folder, _Log())
    try:
        torch.use_deterministic_algorithms(cfg.job.deterministic)
        with _sigterm_raises(), trnkit_warnings_logged():
            on_rank0(lock.acquire)  # one run per dump folder, for the run's whole life
            try:
                result = _train(cfg, env)
            finally:
                lock.release()
        finished = True
        return result
    finally:
        torch.use_deterministic_algorithms(prev_det)
        parallel.destroy(sync=finished)


def _train(cfg: TrainerConfig, env: parallel.DistEnv) -> RunResult:
    """Build the :class:`Trainer` and train. A Ctrl-C / SIGTERM carries where it stopped the run, for main()'s
    message: while starting (``before_training``: nothing trained), or later (``kept_checkpoint``: the newest
    committed checkpoint, a background save committed on the way out included; the HF export too)."""
    try:
        trainer = Trainer(cfg, env)
    except KeyboardInterrupt as e:
        e.before_training = True  # type: ignore[attr-defined]
        raise
    try:
        return trainer.train()
    except KeyboardInterrupt as e:
        # a checkpoint committed while the interruption came (e.g. while pruning the older ones) is the kept one
        e.kept_checkpoint = trainer.ckpt.last_committed or trainer.last_good  # type: ignore[attr-defined]
        raise


class Terminated(KeyboardInterrupt):
    """SIGTERM (torchrun stopping the job, a scheduler, ``kill``) as an exception, so the run's cleanup
    (loss plot, process group) runs as it does for Ctrl-C."""

    signal_name = "SIGTERM"


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_identity(spec: ModelSpec) -> RunIdentity:
    """This run's model as its checkpoints record it (config + parameter shapes, from a meta build)."""
    with torch.device("meta"):
        meta = spec.build()
    return RunIdentity.of(spec.name, spec.config, meta)


@dataclass
class StepStats:
    """What one optimizer step reports (global over the data-parallel ranks)."""
    loss: float          # mean next-token cross-entropy over the step's tokens
    grad_norm: float     # total gradient L2 norm before clipping
    lr: float            # the learning rate the step applied
    aux_loss: float      # the MoE load-balancing loss (0 when off)
    local_tokens: int    # this rank's trained (non-ignored) tokens


def build_optimizer(model: torch.nn.Module, o: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (fused on CPU, foreach elsewhere)."""
    params = [p for p in model.parameters() if p.requires_grad]
    # CPU: the fused AdamW kernel, several times faster per step than foreach=True / False on qwen3:debug-moe
    # (benchmarks/cpu_overhead.py; the figures in docs/trainer.md, "Loss and optimizer"). Other devices: foreach.
    impl = {"fused": True} if device.type == "cpu" else {"foreach": True}
    # one param group per kind: the fused kernel takes DTensors or plain tensors, never a mix (TP)
    groups = [{"params": g} for g in ([p for p in params if hasattr(p, "placements")],
                                      [p for p in params if not hasattr(p, "placements")]) if g]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                             **impl)


class Trainer:
    """One rank's training job, in torchtitan's shape.

    ``__init__`` checks everything that can refuse the run, then builds the data loaders, the model
    (:func:`_build_model`), optimizer, LR scheduler, checkpointer (resuming from the latest checkpoint)
    and metrics; it writes the run's first files (config.toml, stack.lock) only once nothing can refuse
    the run any more. :meth:`train` runs the steps (:meth:`train_step`, each one
    :meth:`forward_backward_step` per microbatch), saves, validates and logs, and ends with the HF export.
    The caller holds the run folder's lock (:func:`run`).
    """

    def __init__(self, cfg: TrainerConfig, env: parallel.DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.log = log = _Log()
        t = cfg.training
        dump = cfg.job.dump_folder

        # Everything that can refuse the run happens before the first file is written.
        import_plugins(cfg.overrides.plugins)  # user kernels register themselves before impl names are checked
        override_config(cfg)  # fail fast on bad [overrides] names, before data and model are built
        self.lnc, lnc_source = 0, ""
        if cfg.overrides.policy != "off":  # resolved once here and passed to every swap point
            self.lnc, lnc_source = resolve_run_lnc(cfg.overrides.lnc, os.environ)
        _check_compile_backend(cfg)
        if cfg.job.stack:
            envinfo.check_stack(cfg.job.stack)  # a ConfigError naming each difference
        on_rank0(lambda: check_run_files(dump))  # no link or folder where the run writes its files
        if cfg.checkpoint.export_hf:
            writable_inside(os.path.join(dump, EXPORT_DIR), dump, "checkpoint.export_hf")
        if cfg.checkpoint.enable:
            on_rank0(lambda: creatable_folder(os.path.join(dump, cfg.checkpoint.folder), "checkpoint.folder"))
        self.spec = spec = build_spec(cfg, lnc=self.lnc)
        _check_pretrained(cfg, spec)
        identity = run_identity(spec)
        self.memory_plan = check_at_startup(cfg, spec, env.world_size, env.device.type,
                                            parallel.device_name(env.device), cfg.job.memory_check, log,
                                            parallel.ranks_on_host(os.environ, env.world_size))
        ckpt_dir = os.path.join(dump, cfg.checkpoint.folder)
        resume_from = None
        if cfg.checkpoint.enable and cfg.checkpoint.resume:
            resume_from = on_rank0(lambda: find_resumable(ckpt_dir, identity, warn=log,
                                                          trust_unverified=cfg.checkpoint.trust_unverified))
        load_path = _initial_weights(cfg, spec, resume_from is not None, log)
        self.loader, val_loader, tok = build_loaders(cfg.data, cfg.validation, t.seq_len, t.local_batch_size,
                                                     env.dp_rank, env.dp, cfg.job.seed, run_folder=dump)
        if tok.vocab_size > spec.vocab_size:
            raise ConfigError(f"data.tokenizer: tokenizer has {tok.vocab_size} tokens but model {spec.name} has "
                              f"vocab_size {spec.vocab_size}")
        if resume_from is not None:  # the same data (its identity in the manifest), then the same schedule
            warning = on_rank0(lambda: self.loader.check_identity(manifest_entry(resume_from[1], "data"),
                                                                  resume_from[1]))
            if warning:
                log(warning)
        reschedule = resume_from is not None and on_rank0(lambda: _schedule_changed(cfg, resume_from, log))

        if cfg.lr_scheduler.warmup_steps > t.steps:
            LOGGER.warning(f"lr_scheduler.warmup_steps ({cfg.lr_scheduler.warmup_steps}) > training.steps "
                           f"({t.steps}): the learning rate never reaches optimizer.lr (it ends at "
                           f"{t.steps / cfg.lr_scheduler.warmup_steps:.0%} of it) and never decays")
        log(f"job {cfg.job.name}: world {env.world_size} (dp_shard {env.dp} x tp {env.tp}) on {env.device.type}"
            f"{' + gloo' if env.device.type == 'cpu' else ''}; dump folder {dump}")
        if self.lnc:
            log(f"kernels: lnc {self.lnc} physical core{'s' if self.lnc > 1 else ''} per launch, from {lnc_source}")
        log(f"data: {cfg.data.dataset} -> {len(self.loader.stream):,} tokens ({self.loader.num_samples:,} samples "
            f"of {t.seq_len}) with tokenizer {tok.path} (vocab {tok.vocab_size:,})")
        self.validator = None
        unused = _keys_set(cfg.validation) if val_loader is None else []
        if unused:  # (enabled = false, the default: a run that sets only validation.dataset evaluates nothing)
            log(f"validation: validation.enabled is false; {', '.join(unused)} unused (validation.enabled = true "
                "evaluates)")
        if val_loader is not None:
            v = cfg.validation
            self.validator = Validator(val_loader, v.steps, v.freq, t.steps, env.dp_group)
            source = v.dataset or f"the last {v.split_fraction:.0%} of {cfg.data.dataset}"
            log(f"validation: every {v.freq} steps and at the last, {v.steps} batches of "
                f"{t.local_batch_size * env.dp} x {t.seq_len} tokens from {source} ({len(val_loader.stream):,} "
                "tokens, not trained on)")

        model, report, self.loaded, tp_desc = _build_model(spec, cfg, env, log, self.lnc, load_path)
        self.model = model
        if env.world_size > 1:
            n_dt = sum(hasattr(p, "placements") for p in model.parameters())
            log(f"parallelized: {n_dt} of {len(list(model.parameters()))} parameters are DTensors "
                f"(tp {env.tp}: {tp_desc}; "
                f"fsdp {env.dp}: {'per block + root' if env.dp > 1 else 'off'})")
        if t.activation_checkpointing == "full":
            parallel.apply_activation_checkpointing(spec.blocks(model))
            log(f"activation checkpointing: full, {len(spec.blocks(model))} blocks (each keeps its input and "
                "recomputes its forward in the backward)")
        if cfg.compile.enable:
            for block in spec.blocks(model):
                block.compile(backend=cfg.compile.backend)
        model.train()

        fpt, counts = flops_per_token(model, spec.shape, t.seq_len)
        n_dense = counts["total"] - counts["experts"]
        log(f"model {spec.name}: total parameter count: dense {n_dense:,}, sparse {counts['experts']:,}, "
            f"active {counts['active']:,}; {fpt / 1e9:.3f} GFLOP/token (fwd+bwd)")

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, cfg.optimizer, env.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.lr_scheduler, t.steps))
        self.ckpt = Checkpointer(ckpt_dir, model, self.optimizer, self.scheduler, self.loader, env.rank,
                                 env.world_size, cfg.checkpoint.keep_latest_k, expert_tp_layout=_expert_tp(cfg, env),
                                 identity=identity, log=log, schedule=lr_schedule(cfg),
                                 run={"job.name": cfg.job.name, "started": utc_now()}, data=self.loader.identity)
        if cfg.checkpoint.enable:
            self.ckpt.check_space()
        self.start_step = 0
        if resume_from is not None:
            self.start_step = self._resume(resume_from, reschedule)
        else:  # a fresh start moves an earlier run's files aside, once nothing can refuse this run any more
            on_rank0(lambda: archive_previous_run(dump, cfg.checkpoint.folder, log))
        peak = peak_flops(env.device.type, parallel.device_name(env.device))
        # before config.toml: a resumed run's metrics.jsonl with a bad line refuses the run, which then changes
        # nothing; rank 0 reads it and every rank raises its refusal (the others would wait in the first step)
        start = self.start_step
        kept = on_rank0(lambda: resume_jsonl(os.path.join(dump, "metrics.jsonl"), start) if cfg.metrics.jsonl else [])
        self.metrics = MetricsLogger(dump, cfg.metrics, t.steps, start, env.rank, fpt, peak, env.device,
                                     non_dp_size=env.tp, history=kept)
        if env.rank == 0:  # written once the checkpoint (if any) has been accepted: a refused run changes nothing
            os.makedirs(dump, exist_ok=True)
            text = to_toml(cfg) + _code_note(report)
            if resume_from is not None:  # the earlier part of the run's settings are kept, when they differ
                keep_changed_config(dump, text, self.start_step, log)
            write_run_file(os.path.join(dump, "config.toml"), text)  # whole or not at all: a kill keeps the old one
            write_run_file(os.path.join(dump, "stack.lock"), envinfo.lock_text(envinfo.current_stack()))

        self.result = RunResult(start_step=self.start_step, dump_folder=dump,
                                override_table=report.table() if report is not None else "")
        self.use_autocast = t.dtype == "bfloat16" and env.dp == 1  # FSDP casts through its MixedPrecisionPolicy
        self.aux_loss = MoEAuxLoss(spec, t.moe_aux_loss_scope, env.dp, env.dp_group)
        self.last_good = resume_from  # (step, path) of the newest committed checkpoint

    def _resume(self, resume_from: tuple[int, str], reschedule: bool) -> int:
        """Load the checkpoint into model, optimizer, scheduler and loader; returns its step."""
        o, steps = self.cfg.optimizer, self.cfg.training.steps
        start_step = self.ckpt.load(resume_from[1])
        if reschedule:  # the checkpoint's scheduler state carries its base lr: follow this run's schedule
            optimizer, scheduler = self.optimizer, self.scheduler
            scheduler.base_lrs = [o.lr for _ in optimizer.param_groups]
            for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas):
                group["initial_lr"], group["lr"] = o.lr, o.lr * fn(scheduler.last_epoch)
            scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
        by = written_by(resume_from[1])
        self.log(f"resumed from {resume_from[1]} (step {start_step}){': ' + by if by else ''}")
        if start_step >= steps:
            self.log(_finished_message(resume_from[1], start_step, steps, self.cfg.job.dump_folder))
        return start_step

    def loss_sum(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of one microbatch (the model's training forward, or eval's under no_grad)."""
        device = self.env.device
        amp = torch.autocast(device.type, dtype=torch.bfloat16) if self.use_autocast else nullcontext()
        with amp:
            t = self.cfg.training
            return self.spec.loss_sum(self.model, tokens.to(device), labels.to(device), t.loss_chunk_size,
                                      schedule=t.loss_schedule)

    def forward_backward_step(self, batch: Any, global_tokens: torch.Tensor) -> torch.Tensor:
        """One microbatch: forward, its share of the step's loss (summed CE over the global token count,
        plus its MoE aux term), backward. Returns the microbatch's summed CE (detached, fp64, CPU)."""
        ce = self.loss_sum(batch.tokens, batch.labels)
        # FSDP averages grads over the dp ranks: scale by dp so they are those of the global loss
        loss = ce * self.env.dp / global_tokens
        aux = self.aux_loss.term(self.model)
        if aux is not None:
            loss = loss + aux
        loss.backward()
        return ce.detach().double().cpu()

    def train_step(self, step: int) -> StepStats:
        """One optimizer step over ``gradient_accumulation_steps`` microbatches. Raises
        :class:`TrainingDiverged` (the update not applied, or not saved) on a non-finite loss, gradient
        norm or, at a step that saves or exports, parameter / optimizer state."""
        cfg, env, t = self.cfg, self.env, self.cfg.training
        self.optimizer.zero_grad(set_to_none=True)
        batches = [self.loader.next_batch() for _ in range(t.gradient_accumulation_steps)]
        local_tokens = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
        global_tokens = parallel.all_reduce_sum(torch.tensor(float(local_tokens)), env.dp_group)
        self.aux_loss.start_step(self.model, len(batches), lambda i: self.loss_sum(batches[i].tokens,
                                                                                   batches[i].labels))
        ce_sum = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            ce_sum += self.forward_backward_step(batch, global_tokens)
        grad_norm = float(parallel.clip_grad_norm(self.params, t.max_norm))
        aux_value = self.aux_loss.value()
        global_loss = float(parallel.all_reduce_sum(ce_sum, env.dp_group) / global_tokens.double())
        if not (math.isfinite(global_loss) and math.isfinite(grad_norm)):
            self.last_good = self.ckpt.wait() or self.last_good  # a background save of an earlier step is good
            raise TrainingDiverged(f"train: step {step}: loss {global_loss} / grad_norm {grad_norm} is not "
                                   f"finite -- stopping without applying the update; last good checkpoint: "
                                   f"{_where(self.last_good)}")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        saving = cfg.checkpoint.enable and (step % cfg.checkpoint.interval == 0 or step == t.steps)
        if saving or (step == t.steps and cfg.checkpoint.export_hf):
            # a non-finite update (e.g. a huge lr) never becomes a checkpoint or an export
            bad = _non_finite_state(self.model, self.optimizer)
            if int(parallel.all_reduce_sum(torch.tensor(len(bad)))):
                self.last_good = self.ckpt.wait() or self.last_good
                raise TrainingDiverged(
                    f"train: step {step}: after the update (lr {lr:g}) {len(bad)} parameter / optimizer-state "
                    f"tensors on rank {env.rank} are not finite (first: {', '.join(bad[:3]) or 'on another rank'})"
                    f" -- step {step} is neither saved nor exported; last good checkpoint: {_where(self.last_good)}")
        return StepStats(global_loss, grad_norm, lr, aux_value, local_tokens)

    def train(self) -> RunResult:
        """Run the remaining steps (logging, validation, checkpoints), then the HF export when configured.
        On every exit of the step loop the background save settles, metrics close and the loss plot is drawn."""
        cfg, t, result, metrics, log = self.cfg, self.cfg.training, self.result, self.metrics, self.log
        outcome = "stopped by an error"
        try:
            for step in range(self.start_step + 1, t.steps + 1):
                s = self.train_step(step)
                metrics.add_tokens(s.local_tokens)
                metrics.progress(step, s.loss)
                result.losses[step] = s.loss
                result.grad_norms[step] = s.grad_norm
                if step == self.start_step + 1 and self.start_step == 0:
                    log(step1_sanity(s.loss, self.spec.vocab_size, self.loaded))
                    if self.memory_plan is not None and self.env.device.type == "neuron":  # pragma: no cover
                        log(measured_vs_plan(self.memory_plan, device_memory(self.env.device)[0] * 2**30))
                if self.validator is not None and self.validator.due(step):
                    t_val = time.perf_counter()
                    val_loss = self.validator.evaluate(self.model, self.loss_sum)
                    metrics.validation(val_loss, time.perf_counter() - t_val)
                    result.val_losses[step] = val_loss
                if step % cfg.metrics.log_freq == 0 or step == t.steps or step in result.val_losses:
                    extra = {"lr": s.lr, "aux_loss": s.aux_loss, "n_tokens_seen": self.loader.position * t.seq_len}
                    result.records.append(metrics.log(step, s.loss, s.grad_norm, extra))
                if cfg.checkpoint.enable:
                    self.last_good = _checkpoint(self.ckpt, step, cfg) or self.last_good
                result.final_step = step
            self.last_good = self.ckpt.wait() or self.last_good  # the last background save
            outcome = "finished"
        except TrainingDiverged:
            outcome = "diverged"
            raise
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (see _sigterm_raises)
            outcome = f"interrupted ({getattr(e, 'signal_name', 'SIGINT')})"
            raise
        finally:
            if self.ckpt.in_flight is not None:
                self.last_good = _settle_background_save(self.ckpt, self.env.world_size, log) or self.last_good
            metrics.close()
            if self.env.rank == 0 and cfg.metrics.plot:
                _write_loss_plot(metrics.history, cfg, self.spec, outcome, log)

        if cfg.checkpoint.export_hf:
            sd = from_tp_layout(full_model_state_dict(self.model), _expert_tp(cfg, self.env))
            on_rank0(lambda: _write_export(self.spec, sd, cfg, self.last_good, log))
            result.hf_export = os.path.join(cfg.job.dump_folder, EXPORT_DIR)
        result.model = self.model
        return result


def _write_export(spec: ModelSpec, sd: dict[str, torch.Tensor], cfg: TrainerConfig,
                  last_good: tuple[int, str] | None, log: _Log) -> None:
    """Write the HF export into ``hf_export.tmp`` and swap it in, so a failed write (disk full) leaves
    the previous export (if any) and removes its partial files. Never writes through a link."""
    dump = cfg.job.dump_folder
    out = writable_inside(os.path.join(dump, EXPORT_DIR), dump, "checkpoint.export_hf")
    tmp, old = (writable_inside(out + suffix, dump, "checkpoint.export_hf") for suffix in (".tmp", ".old"))
    dtype = getattr(torch, cfg.checkpoint.export_dtype)
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        spec.state_dict_adapter.save_hf(sd, tmp, dtype)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        need = sum(t.numel() for t in sd.values()) * torch.empty((), dtype=dtype).element_size()
        kept = (f"The partial export was removed; the last checkpoint {last_good[1]} holds the trained weights "
                "(a rerun resumes from it and writes the export)" if last_good else
                "The partial export was removed; checkpoints are off (checkpoint.enable = false), so the trained "
                "weights were not saved anywhere")
        raise write_failed(f"checkpoint.export_hf: writing the HF export to {out}", dump, e,
                           f"the export needs ~{human_bytes(need)}", kept) from e
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the partial export goes too; an earlier export stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(out):
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    log(f"exported HF safetensors to {out}")


def _where(last_good: tuple[int, str] | None) -> str:
    return f"{last_good[1]} (step {last_good[0]})" if last_good else "none written"


def _non_finite_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of this rank's parameters and optimizer-state tensors (local shards) holding a NaN or inf."""
    def finite(t: torch.Tensor) -> bool:
        local = t.to_local() if hasattr(t, "to_local") else t
        return not local.is_floating_point() or bool(torch.isfinite(local).all())

    names = {id(p): n for n, p in model.named_parameters()}
    bad = [n for n, p in model.named_parameters() if not finite(p.detach())]
    for p, state in optimizer.state.items():
        bad += [f"{key} of {names.get(id(p), '?')}" for key, v in state.items()
                if isinstance(v, torch.Tensor) and not finite(v)]
    return bad


def _checkpoint(ckpt: Checkpointer, step: int, cfg: TrainerConfig) -> tuple[int, str] | None:
    """Save at the checkpoint steps (synchronously, or start a background save); with background saves,
    commit one whose write has finished. Returns the (step, path) committed now, if any."""
    c = cfg.checkpoint
    due = step % c.interval == 0 or step == cfg.training.steps
    if c.async_mode == "disabled":
        return (step, ckpt.save(step)) if due else None
    return ckpt.save_async(step) if due else ckpt.poll()


def _settle_background_save(ckpt: Checkpointer, world_size: int, log: _Log) -> tuple[int, str] | None:
    """The step loop stopped (an error, Ctrl-C, SIGTERM) with a background save in flight. One process
    waits for the write and commits it; several cannot (the commit is collective and a peer may be
    gone): the partial step-N.tmp stays, resume uses the previous checkpoint and a later save of that
    step replaces it. Returns the committed (step, path), if any."""
    step = ckpt.in_flight
    if world_size > 1:
        log(f"checkpoint step-{step} was still being written in the background: not committed "
            f"(step-{step}.tmp is ignored by resume)")
        return None
    log(f"waiting for the background save of checkpoint step-{step}")
    try:
        return ckpt.wait()
    except CheckpointSaveError as e:  # never hide why the run stopped behind the save's error
        LOGGER.warning(str(e))
        return None


def _write_loss_plot(history: list[dict[str, Any]], cfg: TrainerConfig, spec: ModelSpec, outcome: str,
                     log: _Log) -> None:
    """loss.png on every exit of the step loop (finished, diverged, interrupted, an error)."""
    if not history:
        log(f"no loss curve: the run {outcome} before its first logged step")
        return
    title = f"{cfg.job.name}: {spec.name}" + ("" if outcome == "finished" else f" ({outcome})")
    try:
        png = plot_loss(history, os.path.join(cfg.job.dump_folder, "loss.png"), title=title,
                        vocab_size=spec.vocab_size)
    except Exception as e:  # noqa: BLE001 - never hide why the run stopped behind a plotting error
        LOGGER.warning(f"could not write the loss curve: {type(e).__name__}: {e}")
        return
    log(f"loss curve ({outcome} at step {history[-1]['step']}): {png}")


def _check_pretrained(cfg: TrainerConfig, spec: ModelSpec) -> None:
    """``model.hf_pretrained`` loads the published weights of the model's own folder (``spec.hf_path``: ``hf:``
    models): refused where the model has none (it would start from random weights) and beside
    ``checkpoint.initial_load_path``, which names other weights."""
    if not cfg.model.hf_pretrained:
        return
    if not spec.hf_path:
        raise ConfigError(f"config model.hf_pretrained: true loads the published weights of the model's folder "
                          f"(an hf: model.spec); model.spec {cfg.model.spec!r} has none, so the run would start from "
                          "random weights. Set checkpoint.initial_load_path to an HF folder to start from its weights; "
                          "got true")
    if cfg.checkpoint.initial_load_path:
        raise ConfigError(f"config model.hf_pretrained: true loads the weights of {spec.hf_path}, and "
                          f"checkpoint.initial_load_path {cfg.checkpoint.initial_load_path!r} names other weights: set "
                          "one of them; got true")


def _check_compile_backend(cfg: TrainerConfig) -> None:
    if not cfg.compile.enable:
        return
    import torch._dynamo

    known = sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"})
    if cfg.compile.backend not in known:
        raise ConfigError(f"config compile.backend: unknown torch.compile backend {cfg.compile.backend!r}"
                          f"{_suggest(cfg.compile.backend, known)}; available: {known}")


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def debug_env(environ: Mapping[str, str]) -> bool:
    """Whether ``TRNKIT_DEBUG`` asks for tracebacks; a value that is neither on nor off is a ConfigError (it
    used to count as on, ``false`` included)."""
    value = environ.get(DEBUG_ENV, "").strip().lower()
    if value not in _ON + _OFF:
        raise ConfigError(f"environment variable {DEBUG_ENV}: must be one of {list(_ON)} (tracebacks on) or "
                          f"{list(_OFF[1:])} (off), got {environ[DEBUG_ENV]!r}")
    return value in _ON


def main(argv: list[str] | None = None) -> int:
    """The CLI. Exit codes: 0 done, 2 a mistake to fix (message on stderr), 3 training diverged,
    130 / 143 interrupted by SIGINT (Ctrl-C) / SIGTERM."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    cfg = None
    try:
        debug = debug_env(os.environ) or debug
        cfg = parse_args(argv)
        run(cfg)
    except (TrnkitError, TrainingDiverged) as e:  # every user error (trnkit.errors): one paragraph, exit 2
        if debug:
            import traceback
            traceback.print_exc()
        hint = "" if debug else f" (--debug or {DEBUG_ENV}=1 shows the traceback)"
        print(f"error: {e}{hint}", file=sys.stderr)
        return 3 if isinstance(e, TrainingDiverged) else 2
    except KeyboardInterrupt as e:
        name = getattr(e, "signal_name", "SIGINT")
        if cfg is None:
            print(f"interrupted ({name}) before the run started", file=sys.stderr)
        else:
            outputs = tuple(f for f, on in (("metrics.jsonl", cfg.metrics.jsonl), ("loss.png", cfg.metrics.plot)) if on)
            print(interrupt_message(name, getattr(e, "kept_checkpoint", None), cfg.checkpoint.enable,
                                    cfg.checkpoint.resume, cfg.job.dump_folder, argv,
                                    started=not getattr(e, "before_training", False), outputs=outputs),
                  file=sys.stderr)
        return 128 + getattr(signal, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
