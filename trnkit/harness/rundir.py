"""The dump folder of a run: one run at a time, and a fresh run never overwrites an earlier run's files.

A run holds :class:`RunLock` (an advisory ``flock`` on ``<dump_folder>/.trnkit.lock``, with its pid,
host and start time in the file) for its whole life; a second run on the same folder is refused with the
holder named. The kernel drops the lock when its process dies, so the lock file of a killed run is
taken over with a warning.

A run that starts from step 0 (``--checkpoint.resume false``, checkpoints off, or nothing to resume)
in a folder that holds an earlier run's ``metrics.jsonl`` or checkpoints first moves that run's files
into ``<dump_folder>/previous-<UTC time>/``; nothing is deleted. A resume with other settings keeps the
earlier ``config.toml`` as ``config_history/until-step-<N>.toml`` (:func:`keep_changed_config`). What a
run writes or replaces under its folder (the HF export) must not be a symbolic link nor resolve outside
the folder (:func:`writable_inside`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
from typing import Any, Callable

from trnkit.errors import ConfigError
from trnkit.harness.checkpoint import aside_path, list_checkpoints, open_fresh, probe_write, utc_now
from trnkit.packaged import load_toml, parse_toml

CONFIG_HISTORY = "config_history"  # a resumed run's earlier config.toml files: until-step-<N>.toml
# What a run writes directly under its dump folder (the checkpoint folder is added by the caller).
RUN_FILES = ("metrics.jsonl", "config.toml", CONFIG_HISTORY, "stack.lock", "loss.png", "hf_export")
RUN_FOLDERS = (CONFIG_HISTORY, "hf_export")  # of RUN_FILES, those that are folders
PREVIOUS_PREFIX = "previous-"  # an earlier run's files, moved aside by a fresh start: previous-<UTC time>


def archive_previous_run(dump: str, checkpoint_folder: str, log: Callable[[str], None]) -> str | None:
    """Move an earlier run's files out of the way: checkpoints, and any of RUN_FILES (a config.toml or stack.lock
    alone included: the user's own, or a run's that stopped before its first step; the run would overwrite them).
    Returns the archive folder (None: nothing to move)."""
    ckpt_dir = os.path.join(dump, checkpoint_folder)
    if not (any(os.path.lexists(os.path.join(dump, f)) for f in RUN_FILES) or list_checkpoints(ckpt_dir)):
        return None
    # the earlier run's own checkpoint folder too, when its config.toml names another one (it would stay beside
    # this run, and a later resume with that checkpoint.folder would mix the two runs' metrics)
    folders = [os.path.normpath(checkpoint_folder), *_earlier_checkpoint_folder(dump, checkpoint_folder)]
    # an empty checkpoint folder (e.g. made by the run's own write check) holds nothing to keep: it stays
    keep = [f for f in folders if os.path.lexists(os.path.join(dump, f))
            and not (os.path.isdir(os.path.join(dump, f)) and not os.listdir(os.path.join(dump, f)))]
    for folder in keep:
        path = os.path.join(dump, folder)
        if os.lstat(path).st_dev != os.stat(dump).st_dev:
            # reached through a link to another filesystem (a bigger disk): a rename cannot move it into the run folder
            raise ConfigError(f"checkpoint.folder: {path} is on another filesystem than job.dump_folder {dump} "
                              f"(through a symbolic link), so a fresh start cannot move the earlier run's checkpoints "
                              f"into {dump}/{PREVIOUS_PREFIX}<time>/ without copying them. Nothing was moved: move or "
                              "delete them yourself, or resume them (--checkpoint.resume true)")
    dest = aside_path(os.path.join(dump, PREVIOUS_PREFIX))
    os.makedirs(dest)
    # inside dump: the config refuses absolute paths and ".." (and so does _earlier_checkpoint_folder); checkpoints
    # first, so a run stopped while moving never leaves checkpoints to resume without their metrics.jsonl
    moves = [(os.path.join(dump, f), os.path.join(dest, f)) for f in keep]
    moves += [(os.path.join(dump, f), os.path.join(dest, f)) for f in RUN_FILES]
    for src, dst in moves:
        if os.path.lexists(src):  # a link is moved, not followed
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
    log(f"fresh start: the earlier run's files in {dump} were moved to {dest} (nothing was deleted)")
    return dest


def write_run_file(path: str, text: str, key: str = "job.dump_folder") -> None:
    """Write a file of the run folder (config.toml, stack.lock, a rewritten metrics.jsonl) whole or not at all: into
    ``<path>.tmp``, made anew (:func:`~trnkit.harness.checkpoint.open_fresh`: never written through a link), then
    renamed over ``path``, so a run stopped or killed while writing leaves the earlier file as it was. ``key``: the
    setting a refusal names (a folder in the way of ``<path>.tmp``)."""
    tmp = path + ".tmp"
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        raise ConfigError(f"{key}: {tmp} is a folder; the run writes {os.path.basename(path)} through that "
                          "name: move it away and rerun. Nothing was written")
    fd = open_fresh(tmp)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def _earlier_checkpoint_folder(dump: str, checkpoint_folder: str) -> list[str]:
    """``[checkpoint.folder]`` of the run folder's config.toml (the earlier run's) where it names another subfolder
    of ``dump`` than ``checkpoint_folder`` that holds checkpoints; else []."""
    try:
        folder = load_toml(os.path.join(dump, "config.toml")).get("checkpoint", {}).get("folder")
    except (ConfigError, AttributeError):
        return []
    if not isinstance(folder, str) or not folder or os.path.isabs(folder):
        return []
    folder = os.path.normpath(folder)
    if folder in (".", os.path.normpath(checkpoint_folder)) or folder.split(os.sep)[0] in (os.pardir, *RUN_FILES):
        return []
    return [folder] if list_checkpoints(os.path.join(dump, folder)) else []


def keep_changed_config(dump: str, new_text: str, step: int, log: Callable[[str], None]) -> str | None:
    """On a resume at ``step``: when the run folder's config.toml holds other settings than ``new_text`` (the
    resuming run's), move it to ``config_history/until-step-<step>.toml`` and log each changed key, so the
    folder keeps what every part of the run ran with. Returns the kept file (None: nothing changed)."""
    path = os.path.join(dump, "config.toml")
    if not os.path.isfile(path):
        return None
    try:
        old = _flat(load_toml(path))
    except ConfigError:
        old = None  # not a config this trainer wrote: kept as it is, without a list of changes
    new = _flat(parse_toml(new_text))
    if old == new:
        return None
    kept = os.path.join(dump, CONFIG_HISTORY, f"until-step-{step}.toml")
    n = 1
    while os.path.lexists(kept):  # resumed at this step before: until-step-<N>-2.toml, ...
        n += 1
        kept = os.path.join(dump, CONFIG_HISTORY, f"until-step-{step}-{n}.toml")
    os.makedirs(os.path.dirname(kept), exist_ok=True)
    os.replace(path, kept)
    if old is None:
        log(f"config: the run folder's config.toml is not a readable TOML file; kept as {kept}")
        return kept
    changes = [f"{k} {_shown(old.get(k))} -> {_shown(new.get(k))}" for k in sorted(old.keys() | new.keys())
               if old.get(k) != new.get(k)]
    log(f"config: this run resumes step {step} with {len(changes)} setting{'s' if len(changes) != 1 else ''} "
        f"changed: {', '.join(changes)}; the earlier config.toml is kept as {kept}")
    return kept


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    """``{"section.key": value}`` of a parsed config.toml."""
    return {f"{sec}.{k}": v for sec, table in config.items() for k, v in table.items()}


def _shown(value: Any) -> str:
    return "(unset)" if value is None else repr(value)


LOCK_NAME = ".trnkit.lock"


class RunLock:
    """The advisory lock on a dump folder, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, dump: str, log: Callable[[str], None]) -> None:
        self.dump, self.log = dump, log
        self.path = os.path.join(dump, LOCK_NAME)
        self._fd: int | None = None
        self._made_folder = False

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigError` naming the run that holds it."""
        self._make_folder()
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read_holder(fd))
                os.close(fd)
                self._remove_folder()
                raise ConfigError(
                    f"job.dump_folder: {self.dump} is in use by another run ({holder}; lock {self.path}). Two "
                    "runs in one folder would overwrite each other's checkpoints and metrics: wait for it to "
                    "finish, stop it, or use another --job.dump_folder") from None
            try:  # the holder may have released (and unlinked) the file between our open and our flock
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read_holder(fd)
        if stale:
            self.log(f"WARNING: taking over the lock of a run that ended without releasing it ({_describe(stale)}, "
                     f"no longer running); {self.path}")
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "start": utc_now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _open(self) -> int:
        """The lock file, created if missing; never through a symbolic link (the run writes its pid, host and start
        into it: through a link they would replace a file outside the run folder)."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            self._remove_folder()
            what = (f"a symbolic link (to {os.readlink(self.path)})" if os.path.islink(self.path) else
                    "a folder" if os.path.isdir(self.path) else f"not openable ({e.strerror})")
            raise ConfigError(f"job.dump_folder: {self.path} is {what}; the run keeps its lock file there: move it "
                              "away and rerun. Nothing was written") from None

    def release(self) -> None:
        if self._fd is None:
            return
        os.unlink(self.path)  # while still locked: a run waiting on the old file sees the swap and retries
        os.close(self._fd)
        self._fd = None
        self._remove_folder()

    def _make_folder(self) -> None:
        if os.path.exists(self.dump) and not os.path.isdir(self.dump):
            raise ConfigError(f"job.dump_folder: {self.dump} is a file, not a folder; point job.dump_folder at a "
                              "folder (it is created if missing)")
        try:
            if not os.path.isdir(self.dump):
                try:
                    os.makedirs(self.dump)
                    self._made_folder = True
                except FileExistsError:  # made by a run started at the same moment: the lock decides
                    if not os.path.isdir(self.dump):
                        raise
            probe_write(self.dump)
        except OSError as e:
            raise ConfigError(f"job.dump_folder: cannot write to {self.dump} ({type(e).__name__}: "
                              f"{e.strerror or e}); point job.dump_folder at a writable folder") from None

    def _remove_folder(self) -> None:
        """A run that created the dump folder and wrote nothing into it leaves no trace."""
        if self._made_folder:
            try:
                os.rmdir(self.dump)
            except OSError:
                pass  # not empty: the run wrote its files


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {"pid": "?", "host": "?", "start": "? (unreadable lock file)"}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown: the lock file is empty"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('start')}"


def check_run_files(dump: str) -> None:
    """What the run writes in its folder (:data:`RUN_FILES` but the HF export, checked by :func:`writable_inside`
    when it is written) must be what the run wrote there before: a file (a folder for config_history), and not a
    symbolic link, through which the run would overwrite or append to a file outside its folder; and writable by
    this process (a read-only metrics.jsonl or stack.lock ended the run in a traceback). Else a
    :class:`ConfigError` naming the path, before anything is written."""
    for name in RUN_FILES:
        path = os.path.join(dump, name)
        if name == "hf_export" or not os.path.lexists(path):
            continue
        kind = "folder" if name in RUN_FOLDERS else "file"
        if os.path.islink(path):
            what = f"a symbolic link (to {os.readlink(path)})"
        elif not (os.path.isdir(path) if kind == "folder" else os.path.isfile(path)):
            what = "a folder" if os.path.isdir(path) else f"not a {kind}"
        elif not os.access(path, os.W_OK | (os.X_OK if kind == "folder" else 0)):
            raise ConfigError(f"job.dump_folder: {path} is not writable (mode {stat.filemode(os.stat(path).st_mode)}); "
                              f"the run writes its {name} there: make it writable (chmod u+w) or move it away, and "
                              "rerun. Nothing was written")
        else:
            continue
        raise ConfigError(f"job.dump_folder: {path} is {what}; the run writes its {name} there, which must be a {kind} "
                          f"of its own in {dump}: move it away and rerun. Nothing was written")


def creatable_folder(path: str, key: str) -> None:
    """A ConfigError naming ``key`` (the setting that chose ``path``) where ``path``, or a folder above it, exists
    but is not a folder (a file, a dangling link): the run could neither create nor use it."""
    here = os.path.abspath(path)
    while not os.path.isdir(here):
        if os.path.lexists(here):
            kind = "a dangling link" if os.path.islink(here) else "a file"
            above = "" if here == os.path.abspath(path) else f" (it would hold {path})"
            raise ConfigError(f"{key}: {here} is {kind}, not a folder{above}; move it away or set {key} to another "
                              "folder")
        here = os.path.dirname(here)


def writable_inside(path: str, dump: str, key: str) -> str:
    """`path`, after checking that writing or deleting there stays inside the run folder `dump`: neither
    `path` nor a folder between `dump` and it is a symbolic link, and it resolves inside `dump`.
    Else a :class:`ConfigError` naming `key` (the setting that chose the path)."""
    root = os.path.realpath(dump)
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(dump))
    if rel.startswith(os.pardir) or os.path.isabs(rel):
        raise ConfigError(f"{key}: {path} is outside the run folder {dump}")
    here = os.path.abspath(dump)
    for part in rel.split(os.sep):
        here = os.path.join(here, part)
        if os.path.islink(here):
            raise ConfigError(f"{key}: {here} is a symbolic link (to {os.readlink(here)}); the run writes and "
                              f"deletes files there, so it must be a real folder inside {dump}: remove the link")
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise ConfigError(f"{key}: {path} resolves to {os.path.realpath(path)}, outside the run folder {root}")
    return path


__all__ = ["LOCK_NAME", "PREVIOUS_PREFIX", "RUN_FILES", "RUN_FOLDERS", "RunLock", "archive_previous_run",
           "check_run_files", "creatable_folder", "writable_inside", "write_run_file"]
