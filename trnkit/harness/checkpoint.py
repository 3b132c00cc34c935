"""Checkpoints: torch.distributed.checkpoint (DCP) of the full training state, written atomically.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/`` (a DCP directory plus ``trnkit.json``, the
manifest). A save goes to ``step-<N>.tmp`` first; when every rank has finished writing, rank 0 writes
the manifest and renames the folder, so a run killed mid-save never leaves a half-written
``step-<N>``. State: model and optimizer (sharded, via ``torch.distributed.checkpoint.state_dict``;
a tied weight is stored once), lr scheduler, data-loader position, step, every rank's torch RNG state.

A checkpoint knows its run: the manifest holds the resolved model config and a fingerprint of the
parameter names and shapes (:class:`RunIdentity`), plus the size (and, up to ``CHECKSUM_MAX_BYTES``,
the CRC-32) of every file (``.metadata`` always with its CRC). Resuming picks the newest checkpoint that
verifies (:func:`find_resumable`): the manifest is checked first and every file it lists must have its
recorded size and checksum before DCP's ``.metadata`` is unpickled, and that only through the restricted
unpickler of :mod:`trnkit.harness.dcp_safe` (a checkpoint without a valid manifest is refused unless
``checkpoint.trust_unverified``); broken ones are warned about and skipped, and a checkpoint of another
model is refused before anything is written. Pruning (``keep_latest_k``) runs only after the new
checkpoint is complete, only ever deletes checkpoints with the same fingerprint, renames each to
``step-<N>.pruned`` before deleting it (no partial ``step-<N>`` is ever left) and never follows a
symbolic link.

A save has two halves: ``state(step)`` written by DCP into ``tmp_path(step)``, then ``commit(step)`` on
every rank. :meth:`Checkpointer.save` does both at once; with ``checkpoint.async_mode = "async"``,
:meth:`Checkpointer.save_async` copies the state (DCP's staging) and starts the write in a background
thread (``dcp.async_save``, on a process group of its own so its collectives never interleave with the
training's), and the commit happens later, on every rank, once every rank's write has finished
(:meth:`Checkpointer.poll` each step, :meth:`Checkpointer.wait` before the next save and at the end).
At most one save is in flight. A run killed during a background write leaves ``step-N.tmp`` (ignored by
resume, replaced by the next save of that step) and the previous complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from trnkit.errors import ConfigError, DiskWriteError
from trnkit.harness.dcp_safe import METADATA, SafeLoadPlanner, SafeReader, UnsafeCheckpointError, read_metadata

_STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "trnkit.json"
PRUNED = ".pruned"  # step-<N>.pruned: a checkpoint that pruning is deleting
# Files are checksummed (CRC-32, ~1 GB/s) when the checkpoint is at most this big; above it only sizes
# are recorded and verified (a multi-GB re-read at every save would stall the run).
CHECKSUM_MAX_BYTES = 2 * 2**30
# Model-config fields that may change between a run and its resume: they change neither the weights
# nor the function the weights compute (loss coefficient, init, rope-cache length, HF bookkeeping).
RESUMABLE_FIELDS = frozenset({
    "router_aux_loss_coef", "init_std", "max_seq_len", "kernels",  # native Qwen3Config (kernels: which code runs)
    "output_router_logits", "initializer_range", "max_position_embeddings", "transformers_version",
    "_name_or_path", "dtype", "torch_dtype", "architectures", "use_cache",  # transformers configs
})


class CheckpointSaveError(DiskWriteError):
    """A checkpoint could not be written (disk full, folder gone); the previous one is intact."""


# What a failed DCP read or write raises: DCP reports a rank's I/O error as a CheckpointException, which is a
# BaseException (so `except Exception` would let it through as a traceback).
DCP_ERRORS = (Exception, CheckpointException)


def root_error(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (else `err`)."""
    failures = getattr(err, "failures", None) if isinstance(err, CheckpointException) else None
    if failures:
        return failures[min(failures)][0]
    return err


def _reraise_interrupt(err: BaseException) -> None:
    """Raise the Ctrl-C / SIGTERM that DCP wrapped in its CheckpointException (it catches BaseException around
    each rank's read and write): an interrupted save or load is an interruption, not a failed write or a bad
    checkpoint."""
    root = root_error(err)
    if isinstance(root, KeyboardInterrupt):
        raise root from None


def write_failed(what: str, folder: str, err: BaseException, need: str, kept: str,
                 cls: type[DiskWriteError] = DiskWriteError) -> DiskWriteError:
    """The message of every failed write of a run (checkpoint, HF export, metrics): what failed and why,
    the bytes needed (`need`, e.g. "a checkpoint needs ~1.2 GiB", or "") and free, what was kept
    (`kept`), and the way out."""
    try:
        free = human_bytes(shutil.disk_usage(folder).free)
    except OSError:
        free = "unknown"
    err = root_error(err)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    space = f"{need[0].upper()}{need[1:]}; the disk has {free} free" if need else f"The disk has {free} free"
    return cls(f"{what} failed ({type(err).__name__}: {first[:300]}). {space}. {kept}; the run stopped. "
               "Free some space (or point job.dump_folder elsewhere) and rerun to resume.")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# --------------------------------------------------------------------------- run identity
@dataclass
class RunIdentity:
    """What a checkpoint records about the model that wrote it."""
    model_spec: str
    model_config: dict[str, Any]
    params: dict[str, list[int]]        # parameter name -> global shape (tied weights once)

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(sorted(self.params.items()), separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def of(cls, model_spec: str, config: Any, model: nn.Module) -> "RunIdentity":
        """From a resolved config (a dataclass, a transformers config or a plain dict) and the (meta) model."""
        if dataclasses.is_dataclass(config):
            cfg = dataclasses.asdict(config)
        else:
            cfg = dict(config) if isinstance(config, dict) else config.to_dict()
        cfg = json.loads(json.dumps(cfg, default=str))  # plain JSON values (dtypes etc. as strings)
        params = {name: list(p.shape) for name, p in model.named_parameters()}  # DTensor: global shape
        return cls(model_spec, cfg, params)

    def to_dict(self) -> dict[str, Any]:
        return {"model_spec": self.model_spec, "model_config": self.model_config, "params": self.params,
                "fingerprint": self.fingerprint}

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """Human-readable differences from a manifest's identity ([] = the same model). Another model family
        (``model.spec`` before the ``:``) is one difference: its config fields and parameter names do not compare."""
        spec = saved.get("model_spec")
        if isinstance(spec, str) and spec.partition(":")[0] != self.model_spec.partition(":")[0]:
            return [f"model.spec: checkpoint {spec!r}, this run {self.model_spec!r} (another model family: their "
                    "configs and parameter names are not comparable)"]
        theirs = saved.get("model_config", {})
        diffs = [f"{k}: checkpoint {theirs.get(k)!r}, this run {self.model_config.get(k)!r}"
                 for k in sorted(set(theirs) | set(self.model_config))
                 if k not in RESUMABLE_FIELDS and theirs.get(k) != self.model_config.get(k)]
        if saved.get("fingerprint") != self.fingerprint:
            p_theirs = saved.get("params", {})
            shape_diffs = [f"{k}: checkpoint {p_theirs.get(k)}, this run {self.params.get(k)}"
                           for k in sorted(set(p_theirs) | set(self.params)) if p_theirs.get(k) != self.params.get(k)]
            if not diffs:  # the configs agree but the parameters differ: name the parameters
                diffs = shape_diffs[:6] + ([f"... ({len(shape_diffs) - 6} more)"] if len(shape_diffs) > 6 else [])
        return diffs


# --------------------------------------------------------------------------- listing and verifying
def open_fresh(path: str) -> int:
    """A new file at ``path``, opened for writing (a file descriptor), never through a link: whatever of that name
    is not a folder (a stale file, a symbolic link, which may lead out of the run folder) is removed first; a
    folder stays, and the open fails (``OSError``)."""
    if os.path.lexists(path) and not (os.path.isdir(path) and not os.path.islink(path)):
        os.remove(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def probe_write(folder: str) -> None:
    """Write and remove a small file in ``folder`` (:func:`open_fresh`): raises ``OSError`` where the folder is not
    writable."""
    probe = os.path.join(folder, f".write-test-{os.getpid()}")
    fd = open_fresh(probe)
    try:
        os.write(fd, b"ok")
    finally:
        os.close(fd)
        os.remove(probe)


def list_checkpoints(folder: str) -> list[tuple[int, str]]:
    """Complete (renamed) checkpoints in `folder`, as (step, path), oldest first."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, METADATA)):
            out.append((int(m.group(1)), os.path.join(folder, name)))
    return sorted(out)


def _step_folders(folder: str) -> list[tuple[int, str]]:
    """Every ``step-<N>`` folder in `folder` (a complete checkpoint or not), as (step, path), oldest first: a
    ``step-N`` only ever appears by a complete save's rename, so one that :func:`list_checkpoints` leaves out
    (no ``.metadata``, or a folder the run may not read) is a damaged checkpoint, not nothing."""
    if not os.path.isdir(folder):
        return []
    return sorted((int(m.group(1)), os.path.join(folder, name)) for name in os.listdir(folder)
                  if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(folder, name)))


def latest_checkpoint(folder: str) -> tuple[int, str] | None:
    ckpts = list_checkpoints(folder)
    return ckpts[-1] if ckpts else None


def aside_path(prefix: str) -> str:
    """Where to move something aside without replacing anything: ``<prefix><UTC time>`` (e.g.
    ``previous-20261206-144000``), or that with ``-2``, ``-3``, ... : the first that does not exist."""
    base = prefix + time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, n = base, 1
    while os.path.lexists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def utc_now() -> str:
    """The current UTC time as the manifests and the run lock record it, e.g. ``2026-12-06T14:40:00Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_manifest(path: str) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None when the checkpoint has none. A manifest that is not a JSON object,
    or whose run description (``identity`` and its ``model_config`` / ``params``, ``schedule``, ``run``, ``data``)
    is not made of objects where the trainer reads them, raises ValueError naming the field: the manifest
    itself carries no checksum, so those fields are checked before anything reads them."""
    f = os.path.join(path, MANIFEST)
    if not os.path.exists(f):
        return None
    with open(f) as fh:
        try:
            manifest = json.load(fh)
        except RecursionError:  # arrays or objects nested thousands deep: no manifest trnkit writes
            raise ValueError("its JSON is nested too deeply to parse") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"not a JSON object but {type(manifest).__name__} {str(manifest)[:40]!r}")
    identity = manifest.get("identity")
    fields = {"identity": identity, **{k: manifest.get(k) for k in ("schedule", "run", "data")}}
    if isinstance(identity, dict):
        fields.update({f"identity.{k}": identity.get(k) for k in ("model_config", "params")})
    for name, value in fields.items():
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"its {name} must be a JSON object, got {type(value).__name__} {str(value)[:40]!r}")
    return manifest


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _readable(path: str) -> None:
    """Raises OSError where ``path`` cannot be opened for reading."""
    with open(path, "rb"):
        pass


def _data_files(path: str) -> dict[str, int]:
    return {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path)) if n != MANIFEST}


def file_records(path: str) -> dict[str, dict[str, Any]]:
    """The manifest's record of every file of a written checkpoint: size, and CRC-32 when the whole
    checkpoint is at most CHECKSUM_MAX_BYTES (``.metadata``, which is unpickled, always has one)."""
    files = _data_files(path)
    checksum = sum(files.values()) <= CHECKSUM_MAX_BYTES
    return {n: {"size": s, **({"crc32": _crc32(os.path.join(path, n))} if checksum or n == METADATA else {})}
            for n, s in files.items()}


def _is_plain_name(name: Any) -> bool:
    """A file name that stays inside its folder: no separator, not '.', '..' or absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and not os.path.isabs(name))


def _manifest_problem(path: str, manifest: Any) -> str | None:
    """Why a parsed manifest cannot vouch for the checkpoint's files (None: it can)."""
    f = os.path.join(path, MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{f} lists no files, so nothing can be verified"
    for name, rec in files.items():
        if not _is_plain_name(name):
            return f"{f} lists the file {name!r}, which is outside the checkpoint folder"
        if not (isinstance(rec, dict) and isinstance(rec.get("size"), int) and not isinstance(rec["size"], bool)):
            return f"{f} has no size for {name!r}"
    if METADATA not in files:  # its CRC is checked when recorded (always, since .metadata has been CRC'd)
        return f"{f} does not list {METADATA}"
    return None


def _check_files(path: str, files: dict[str, dict[str, Any]]) -> str | None:
    for name, rec in sorted(files.items()):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return f"{f} is missing"
        size = os.path.getsize(f)
        if size < rec["size"]:
            return f"{f} is truncated ({size} bytes, {rec['size']} were written)"
        if size > rec["size"]:
            return f"{f} has {size} bytes, {rec['size']} were written"
        try:  # a file the run may not read (permissions) is as unusable as a corrupt one
            crc = _crc32(f) if rec.get("crc32") else _readable(f)
        except OSError as e:
            return f"{f} cannot be read ({type(e).__name__}: {e.strerror or e})"
        if crc and crc != rec["crc32"]:
            return f"{f} is corrupt (CRC-32 {crc}, {rec['crc32']} was written)"
    return None


def verify_checkpoint(path: str, trust_unverified: bool = False) -> str | None:
    """None if the checkpoint at `path` looks loadable, else why not (naming the file).

    Integrity before parsing: the manifest (JSON) must list every file with its size and CRC-32
    (``.metadata`` included); those are checked before DCP's ``.metadata`` is unpickled (with the
    restricted unpickler of :mod:`trnkit.harness.dcp_safe`). Then every file the metadata refers to must
    be a plain name inside the folder, exist and be long enough for the byte ranges it records.
    ``trust_unverified``: a checkpoint without a (valid) manifest is accepted on the metadata checks alone.
    """
    try:
        os.listdir(path)
    except OSError as e:
        return f"its folder cannot be read ({type(e).__name__}: {e.strerror or e})"
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as e:
        manifest, problem = None, f"{os.path.join(path, MANIFEST)} is unreadable ({type(e).__name__}: {e})"
    else:
        problem = (f"it has no manifest {MANIFEST}, so its files cannot be verified" if manifest is None
                   else _manifest_problem(path, manifest))
    if problem is not None and not trust_unverified:
        return problem + " (--checkpoint.trust_unverified true loads it unverified)"
    named = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if problem is None and named and isinstance(manifest.get("step"), int) and manifest["step"] != int(named[1]):
        # a renamed or copied folder: resume would order it by its name and train on from another step
        return f"{os.path.join(path, MANIFEST)} records step {manifest['step']}, not {named[1]} (a renamed folder)"
    listed = manifest["files"] if problem is None else {}
    why = _check_files(path, listed)
    if why is not None:
        return why
    try:
        metadata = read_metadata(path)
        ends: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except UnsafeCheckpointError as e:
        return str(e).removeprefix("checkpoint: ")
    except Exception as e:  # noqa: BLE001 - a corrupt pickle can raise almost anything
        return f"{os.path.join(path, METADATA)} is unreadable ({type(e).__name__}: {e})"
    for name, end in sorted(ends.items()):
        f = os.path.join(path, str(name))
        if not _is_plain_name(name) or (listed and name not in listed):
            return f"{os.path.join(path, METADATA)} refers to {name!r}, which is not a file of this checkpoint"
        if not os.path.isfile(f):
            return f"{f} is missing"
        if os.path.getsize(f) < end:
            return f"{f} is truncated ({os.path.getsize(f)} bytes, the metadata needs {end})"
    return None


def _readable_manifest(path: str) -> dict[str, Any]:
    """The manifest of the (verified) checkpoint at ``path``; {} without a readable one (an unverified
    checkpoint, ``checkpoint.trust_unverified``, may have none)."""
    try:
        return read_manifest(path) or {}
    except (OSError, ValueError):
        return {}


def manifest_entry(path: str, key: str) -> Any:
    """``key`` of the manifest of the (verified) checkpoint at ``path``; None without one or without the key."""
    return _readable_manifest(path).get(key)


def written_by(path: str) -> str:
    """Which run saved the checkpoint at `path`, from its manifest: ``saved <time> by job '<name>' (run started
    <time>)``; what an older manifest records of it, or "" without a readable one."""
    manifest = _readable_manifest(path)
    run = manifest.get("run") or {}
    saved = f"saved {manifest['time']}" if isinstance(manifest.get("time"), str) else ""
    job = f"by job {run['job.name']!r} (run started {run.get('started', '?')})" if "job.name" in run else ""
    return " ".join(part for part in (saved, job) if part)


def mismatch_message(folder: str, path: str, diffs: list[str]) -> str:
    return (f"checkpoint: {path} was written by another model, so this run cannot resume from it:\n  "
            + "\n  ".join(diffs)
            + f"\nNothing was written. To train this model, use another --job.dump_folder (or delete {folder}); "
              "to resume the old run, use its model settings (see its config.toml).")


def find_resumable(folder: str, identity: RunIdentity | None, warn: Callable[[str], None] = print,
                   trust_unverified: bool = False) -> tuple[int, str] | None:
    """The newest checkpoint in `folder` that verifies and belongs to this model, or None if there is none.

    A broken (or unverifiable) checkpoint is reported through `warn` and skipped for the next older one;
    a checkpoint of another model raises :class:`ConfigError` naming the differing fields; if checkpoints
    exist but none verifies, :class:`ConfigError` lists them all.
    """
    problems = []
    for step, path in reversed(_step_folders(folder)):
        why = verify_checkpoint(path, trust_unverified)
        if why is not None:
            warn(f"WARNING: checkpoint {path} is not usable: {why}; trying the next older checkpoint")
            problems.append(f"step-{step}: {why}")
            continue
        try:
            manifest = read_manifest(path)
        except (OSError, ValueError):  # trusted unverified
            manifest = None
        if identity is not None and isinstance(manifest, dict):
            diffs = identity.differences(manifest.get("identity") or {})
            if diffs:
                raise ConfigError(mismatch_message(folder, path, diffs))
        return step, path
    if problems:
        raise ConfigError(f"checkpoint: no usable checkpoint in {folder}:\n  " + "\n  ".join(problems)
                          + "\nMove the broken folders away (or use another --job.dump_folder) and rerun.")
    return None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's value of `obj` on every rank (exceptions travel too, so every rank raises the same)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0 only and give its result (or its exception) to every rank."""
    out: Any = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            out = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            out = ("err", e)
    kind, val = _broadcast(out)
    if kind == "err":
        raise val
    return val


# --------------------------------------------------------------------------- the checkpointer
def _tensor_key(t: torch.Tensor) -> tuple:
    """Same key <=> same memory (state dicts hand out a fresh detached tensor per key, so `is` fails)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(),
            local.dtype)


def _dedup_tied(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Drop keys whose tensor shares memory with an earlier key's (a tied weight): (state, {alias: kept})."""
    seen: dict[tuple, str] = {}
    out, aliases = {}, {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.numel():
            key = _tensor_key(v)
            if key in seen:
                aliases[k] = seen[key]
                continue
            seen[key] = k
        out[k] = v
    return out, aliases


@dataclass
class _InFlight:
    """A background save: its step, its future (the manifest's file records on rank 0 once written),
    when it started and how long the step loop waited to start it."""
    step: int
    future: Future
    t0: float
    blocked_s: float


class Checkpointer:
    def __init__(self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 loader: Any, rank: int, world_size: int, keep_latest_k: int = 2, expert_tp_layout: int = 1,
                 identity: RunIdentity | None = None, log: Callable[[str], None] | None = None,
                 schedule: dict[str, Any] | None = None, run: dict[str, str] | None = None,
                 data: dict[str, Any] | None = None) -> None:
        self.folder, self.model, self.optimizer = folder, model, optimizer
        self.scheduler, self.loader = scheduler, loader
        self.rank, self.world_size, self.keep_latest_k = rank, world_size, keep_latest_k
        self.expert_tp_layout = expert_tp_layout  # experts' w_gate_up column layout (tp_experts.py)
        self.identity = identity
        self.schedule = schedule  # the learning-rate schedule's settings, recorded in the manifest
        self.run = run  # which run writes (job name, start time), recorded in the manifest: resume names it
        self.data = data  # the training data's identity (PackedLoader.identity), recorded in the manifest
        self.log = log or (lambda msg: print(f"[trnkit] {msg}", flush=True) if rank == 0 else None)
        self._aliases: dict[str, str] = {}
        self._in_flight: _InFlight | None = None
        self.last_committed: tuple[int, str] | None = None  # (step, path) of the newest checkpoint this run committed
        self._async_group: Any = None  # the background writer's own process group, made at the first save

    # ------------------------------------------------------------------ size and space
    def expected_bytes(self) -> int:
        """A checkpoint's size estimate: every parameter (once) plus AdamW's two moments, in fp32."""
        n = sum(p.numel() if not hasattr(p, "full_tensor") else torch.Size(p.shape).numel()
                for p in self.model.parameters())
        return 3 * 4 * n

    def check_space(self) -> None:
        """Up front: the folder must be writable (else ConfigError); warn when the disk looks too small
        for the checkpoints that coexist during a save (keep_latest_k + the one being written)."""
        def check() -> str | None:
            try:
                os.makedirs(self.folder, exist_ok=True)
                probe_write(self.folder)
            except OSError as e:
                raise ConfigError(f"checkpoint.folder: cannot write checkpoints to {self.folder} "
                                  f"({type(e).__name__}: {e.strerror or e}); point job.dump_folder / "
                                  "checkpoint.folder at a writable folder") from None
            need = self.expected_bytes()
            coexist = self.keep_latest_k + 1 if self.keep_latest_k else 1
            free = shutil.disk_usage(self.folder).free
            if free < need * coexist:
                return (f"WARNING: checkpoint folder {self.folder} has {human_bytes(free)} free; each checkpoint "
                        f"needs ~{human_bytes(need)} and up to {coexist} coexist during a save: saves may fail")
            return None

        warning = on_rank0(check)
        if warning:
            self.log(warning)

    # ------------------------------------------------------------------ save
    def state(self, step: int) -> dict[str, Any]:
        """The DCP state dict of this rank (tied weights once; their aliases are kept in self._aliases)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        model_sd, self._aliases = _dedup_tied(model_sd)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "train": {"step": step, "expert_tp_layout": self.expert_tp_layout},
            # per-rank keys: DCP keeps one copy of same-named plain tensors, RNG streams differ per rank
            "rng": {f"rank{self.rank}": torch.get_rng_state()},
        }

    def tmp_path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}.tmp")

    def _clear_tmp(self, step: int) -> str:
        tmp = self.tmp_path(step)
        os.makedirs(self.folder, exist_ok=True)
        if self.rank == 0 and os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp)  # left by a run killed mid-save
        elif self.rank == 0 and os.path.lexists(tmp):
            os.remove(tmp)  # a link (removed, never followed) or a file of the save's scratch name
        _barrier()
        return tmp

    def save(self, step: int) -> str:
        """Write step-N synchronously; raises CheckpointSaveError (every rank) if the write fails."""
        t0 = time.perf_counter()
        tmp = self._clear_tmp(step)
        try:
            try:
                dcp.save(self.state(step), checkpoint_id=tmp)
            except DCP_ERRORS as e:  # DCP wraps I/O errors in many types; all mean "not saved"
                self._save_failed(step, e)
            return self.commit(step, t0)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM outside DCP's own wrapping, or before the rename
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed: only a partial step-N.tmp is removed
            raise

    # ------------------------------------------------------------------ asynchronous save
    def save_async(self, step: int) -> tuple[int, str] | None:
        """Start writing step-N in the background (every rank). Waits for (and commits) the save still in
        flight first; returns that one's (step, path), or None. The state is copied before this returns,
        so training may change the weights at once."""
        committed = self.wait()
        t0 = time.perf_counter()
        tmp = self._clear_tmp(step)
        if self._async_group is None:
            # gloo on CPU, which async_save requires; a group of its own: the writer thread's collectives
            # must never interleave with the training's on the default group
            self._async_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        try:
            written = dcp.async_save(self.state(step), checkpoint_id=tmp, process_group=self._async_group,
                                     no_dist=not dist.is_initialized())
        except DCP_ERRORS as e:  # staging or the start of the write failed
            self._save_failed(step, e)
        self._in_flight = _InFlight(step, self._then_records(written, tmp), t0, time.perf_counter() - t0)
        return committed

    def _then_records(self, written: Future, tmp: str) -> Future:
        """A future of the manifest's file records, computed (rank 0: sizes, CRC-32 re-read) in the writer
        thread right after the write, so the commit in the step loop only writes the manifest and renames.
        Rank 0's write completes after every rank's (DCP gathers them before writing .metadata)."""
        records: Future = Future()

        def done(f: Future) -> None:
            try:
                f.result()
                records.set_result(file_records(tmp) if self.rank == 0 else None)
            except BaseException as e:  # noqa: BLE001 - handed to the step loop, which reports it
                records.set_exception(e)

        written.add_done_callback(done)
        return records

    @property
    def in_flight(self) -> int | None:
        """The step of the background save not yet committed, or None."""
        return self._in_flight.step if self._in_flight else None

    def poll(self) -> tuple[int, str] | None:
        """Commit the background save if every rank's write has finished (every rank calls this, e.g. once
        per step: with several ranks it is one small all-reduce while a save is in flight). Returns the
        committed (step, path), or None."""
        if self._in_flight is None:
            return None
        done = torch.tensor([int(self._in_flight.future.done())])
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.wait() if int(done) else None

    def wait(self) -> tuple[int, str] | None:
        """Block until the background save (if any) is written, then commit it (every rank). A failed write
        raises CheckpointSaveError naming the step; returns the committed (step, path), or None."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return None
        t_wait = time.perf_counter()
        try:
            files = pending.future.result()
        except DCP_ERRORS as e:  # the writer thread's error, whatever its type
            self._save_failed(pending.step, e, background=True)
        return pending.step, self.commit(pending.step, pending.t0, files, waiting=(pending.blocked_s, t_wait))

    def _save_failed(self, step: int, err: BaseException, background: bool = False) -> None:
        if self.rank == 0:
            shutil.rmtree(self.tmp_path(step), ignore_errors=True)
        _reraise_interrupt(err)
        prev = latest_checkpoint(self.folder)
        kept = f"the previous checkpoint {prev[1]} is intact" if prev else "no earlier checkpoint exists"
        where = "in the background " if background else ""
        raise write_failed(f"checkpoint: saving step-{step} {where}to {self.folder}", self.folder, err,
                           f"a checkpoint needs ~{human_bytes(self.expected_bytes())}",
                           f"The partial step-{step}.tmp was removed and {kept}",
                           CheckpointSaveError) from root_error(err)

    def commit(self, step: int, t0: float | None = None, files: dict[str, dict] | None = None,
               waiting: tuple[float, float] | None = None) -> str:
        """Every rank, after the DCP write of `step` finished: manifest -> rename -> prune -> log line.
        `files`: the manifest's file records if already computed (:func:`file_records`). `waiting`: for a
        background save, (seconds the step loop had waited, when it started waiting again) for the log."""
        _barrier()
        final = os.path.join(self.folder, f"step-{step}")
        if self.rank == 0:
            tmp = self.tmp_path(step)
            files = files if files is not None else file_records(tmp)
            total = sum(r["size"] for r in files.values())
            manifest = {
                "step": step, "time": utc_now(),
                "identity": self.identity.to_dict() if self.identity else None,
                "schedule": self.schedule,
                "run": self.run,
                "data": self.data,
                "world_size": self.world_size,
                "tied": self._aliases,
                "files": files,
            }
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if os.path.islink(final):  # never delete through a link (it may point outside the run folder)
                os.remove(final)
            elif os.path.exists(final):  # a step-N that resume skipped (unusable, or another run's): kept
                aside = aside_path(f"{final}.replaced-")
                os.replace(final, aside)
                self.log(f"checkpoint: {final} was not a usable checkpoint of this run; moved to {aside} "
                         "(nothing was deleted)")
            os.replace(tmp, final)  # atomic on POSIX: the checkpoint appears complete or not at all
            self.last_committed = (step, final)  # before pruning, which may delete the one committed before it
            self._prune(step)
            secs = f", {time.perf_counter() - t0:.1f} s" if t0 is not None else ""
            if waiting is not None:
                blocked = waiting[0] + time.perf_counter() - waiting[1]
                secs += f" in the background, the step loop waited {blocked:.2f} s"
            self.log(f"saved checkpoint step-{step} ({human_bytes(total)}{secs}) to {final}")
        _barrier()
        self.last_committed = (step, final)
        return final

    def _prune(self, saved: int) -> None:
        """Keep the newest keep_latest_k checkpoints of this model up to ``saved``, the step just committed; never
        touch another model's, nor a later step's: resume picks the newest checkpoint that verifies, so a later
        one is one it skipped as unusable, and counting it would delete the checkpoint just written."""
        if self.keep_latest_k <= 0 or self.identity is None:
            return
        mine = []
        for step, path in list_checkpoints(self.folder):
            if step > saved or os.path.islink(path):  # pruning never follows a link (it may lead out of the run)
                continue
            try:
                manifest = read_manifest(path)
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict) and (manifest.get("identity") or {}).get("fingerprint") == \
                    self.identity.fingerprint:
                mine.append(path)
        for path in mine[:-self.keep_latest_k]:
            # renamed first (atomic), so a run stopped while deleting never leaves a partial step-N behind
            shutil.rmtree(path + PRUNED, ignore_errors=True)
            try:
                os.replace(path, path + PRUNED)
            except OSError:
                continue
        for name in os.listdir(self.folder):  # this prune's, and any a stopped run left
            path = os.path.join(self.folder, name)
            if name.endswith(PRUNED) and _STEP_DIR.match(name[:-len(PRUNED)]) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: str) -> int:
        """Restore everything from `path`; returns the step it was saved at.

        Another world size than the checkpoint's is resharded by DCP (model and optimizer shards, the
        global data position); a rank the checkpoint has no RNG state for keeps its own (seeded) one.
        """
        state = self.state(0)
        saved_ranks = sorted(int(k.removeprefix("rng.rank")) for k in read_metadata(path).state_dict_metadata
                             if k.startswith("rng.rank") and k.removeprefix("rng.rank").isdigit())
        if len(saved_ranks) != self.world_size:
            self.log(f"WARNING: checkpoint {path} was written by a world size of {len(saved_ranks)} process(es), "
                     f"this run has world size {self.world_size}: model and optimizer state are resharded; "
                     "the data position is global, so no sample is skipped or repeated; RNG states of ranks the "
                     "checkpoint does not have stay as seeded (the resumed run is not bit-exact to an "
                     "uninterrupted one)")
        if self.rank not in saved_ranks:
            state["rng"] = {}
        try:
            # the restricted reader and planner: nothing in the folder can run code (dcp_safe.py)
            dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
        except DCP_ERRORS as e:
            _reraise_interrupt(e)
            root = root_error(e)
            if isinstance(root, UnsafeCheckpointError):
                raise root from None
            first = (str(root).strip().splitlines() or [type(root).__name__])[0]
            raise ConfigError(f"checkpoint {path}: cannot be loaded into this run's model ({type(root).__name__}: "
                              f"{first[:400]}); resume with the model settings that wrote it, or use another "
                              "--job.dump_folder") from e
        for alias, kept in self._aliases.items():  # a tied weight was stored once
            state["model"][alias] = state["model"][kept]
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        # The checkpoint's param groups came with the optimizer settings that wrote it: the state (moments, step
        # counts) is the checkpoint's, the settings (betas, eps, weight_decay, fused / foreach) this run's config;
        # the learning rate is the scheduler's.
        settings = {k: v for k, v in self.optimizer.defaults.items() if k != "lr"}
        for group in self.optimizer.param_groups:
            group.update(settings)
        saved = int(state["train"].get("expert_tp_layout", 1))
        if saved != self.expert_tp_layout:
            raise ConfigError(f"checkpoint {path}: its expert weights use the tp_experts='shard_i' layout of "
                              f"tensor_parallel_degree {saved}, this run expects {self.expert_tp_layout} "
                              "(resume with the same parallelism settings)")
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.loader.load_state_dict(state["data"])
        rng = state["rng"].get(f"rank{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng)
        return int(state["train"]["step"])


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded state dict (collective: every rank must call it; complete on every rank)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def load_full_model_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load an unsharded state dict (present on every rank) into a possibly sharded model."""
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))


__all__ = ["CHECKSUM_MAX_BYTES", "write_failed", "CheckpointSaveError", "Checkpointer", "MANIFEST", "RunIdentity",
           "aside_path", "file_records", "find_resumable", "full_model_state_dict", "human_bytes", "latest_checkpoint",
           "list_checkpoints", "load_full_model_state_dict", "manifest_entry", "on_rank0", "read_manifest", "utc_now",
           "verify_checkpoint", "written_by"]
