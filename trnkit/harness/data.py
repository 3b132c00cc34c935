"""Text data: local files -> HF `tokenizers` tokenizer -> one packed token stream -> sharded batches.

Packing: all documents are tokenized (EOS appended to each) and concatenated into one stream of N
tokens. Sample ``i`` is the window ``stream[i*S : i*S + S + 1]`` (input = first S, labels = last S),
so every token is a label once per epoch. With ``shuffle`` the samples are visited in a seeded random
order (one permutation per epoch). Global step ``t`` uses positions ``[t*G, (t+1)*G)`` of that order
with ``G = dp_degree * local_batch_size``; data-parallel rank ``r`` takes the r-th contiguous slice of
``local_batch_size``. The loader state is the number of global samples consumed (the same on every
rank), so resuming is exact and independent of the number of processes.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator

import numpy as np
import torch

from trnkit.datafiles import qwen3_tokenizer_path, shakespeare_files  # re-exported: the bundled data
from trnkit.errors import ConfigError
from trnkit.model_spec import IGNORE_INDEX  # re-exported: the label the loss skips


# --------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with the EOS id resolved."""

    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"data.tokenizer: no tokenizer.json at {path!r}")
        self.path = path
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
            raise ConfigError(f"data.tokenizer: {path} is not a valid tokenizers tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size()  # includes added tokens
        self.eos_id = next((i for i in (self._tok.token_to_id(t) for t in self.EOS_CANDIDATES) if i is not None),
                           None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str) -> Tokenizer:
    return Tokenizer(qwen3_tokenizer_path() if spec == "qwen3" else spec)


# --------------------------------------------------------------------------- documents
DATA_EXTENSIONS = (".txt", ".md", ".jsonl", ".parquet")


def _files(dataset: str, key: str = "data.dataset", run_folder: str = "") -> list[str]:
    """The data files of a dataset setting (`key` names it in errors), each checked to be a readable file, none of
    them inside ``run_folder`` (the run's job.dump_folder; "": not checked)."""
    if dataset == "shakespeare":
        return shakespeare_files()
    if os.path.isdir(dataset):
        files = _walk(dataset, key)
    elif any(c in dataset for c in "*?["):
        files = sorted(glob.glob(dataset, recursive=True))
    else:
        files = [dataset] if os.path.lexists(dataset) else []
    if run_folder and (os.path.isdir(dataset) and _inside(run_folder, dataset)
                       or any(_inside(f, run_folder) for f in files)):
        # checked on the folder too: a first run finds no file of its own there yet, and its resume would
        raise ConfigError(f"{key}: {dataset!r} holds the run folder (job.dump_folder {run_folder!r}): the files the "
                          "run writes there (metrics.jsonl, ...) would become its data, and the next run's data would "
                          f"differ from this one's; point {key} or job.dump_folder elsewhere")
    if not files:
        raise ConfigError(f"{key}: no .txt/.md/.jsonl/.parquet files found for {dataset!r}")
    first: dict[str, str] = {}
    for path in files:
        if os.path.islink(path) and not os.path.exists(path):
            raise ConfigError(f"{key}: {path} is a dangling symbolic link (to {os.readlink(path)}); restore its "
                              "target or remove the link")
        if not os.path.isfile(path):
            what = "a folder" if os.path.isdir(path) else "not a regular file"
            raise ConfigError(f"{key}: {path} is {what}; data entries must be .txt/.md/.jsonl/.parquet files")
        real = first.setdefault(os.path.realpath(path), path)
        if real != path:  # e.g. a recursive glob through a link back to an enclosing folder
            raise ConfigError(f"{key}: {path} is the file {real} again (through a symbolic link); every file would "
                              "be read more than once: remove the link or narrow the pattern")
    return files


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or inside it, links resolved."""
    root = os.path.realpath(folder)
    return os.path.commonpath([os.path.realpath(path), root]) == root


def _walk(folder: str, key: str) -> list[str]:
    """Data files under `folder` (links followed, hidden names skipped, as ``glob('**')``), sorted. A folder
    reached twice (a link back to an enclosing folder, or a second way into one) is a ConfigError: its
    files would be read again and again."""
    files, seen = [], {}
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            cycle = _inside(folder, real)
            raise ConfigError(f"{key}: {root} is {seen[real]} again (a symbolic link to "
                              f"{'an enclosing folder: a cycle' if cycle else 'a folder read already'}); its files "
                              "would be read more than once: remove the link")
        seen[real] = root
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [os.path.join(root, n) for n in names
                  if not n.startswith(".") and os.path.splitext(n)[1].lower() in DATA_EXTENSIONS]
    return sorted(files)


_JSON_TYPES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "a list",
               dict: "an object"}


def _text(path: str, where: str, field: str, value: Any) -> str:
    """A document's text from a jsonl / parquet field, which must be a string (never "None" or "[1, 2]")."""
    if isinstance(value, str):
        return value
    kind = _JSON_TYPES.get(type(value), type(value).__name__)
    raise ConfigError(f"data.text_field: {where} field {field!r} is {kind} ({str(value)[:40]}), not a string; "
                      "every document's text must be a string")


def _decode(path: str, raw: bytes, line: int | None = None, key: str = "data.dataset") -> str:
    """UTF-8 text, or a ConfigError naming the file (and line) and the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{line}" if line is not None else path
        binary = b"\0" in raw[:8192]
        what = ("a binary file, not text" if binary
                else f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})")
        raise ConfigError(f"{key}: {where} is {what}; data files must be UTF-8 "
                          f"(convert it, e.g. iconv -f latin1 -t utf-8, or remove it from the dataset)") from None


def _read_jsonl(path: str, text_field: str, key: str = "data.dataset") -> Iterator[str]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = _decode(path, raw, n, key)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                why = f"{e.msg.removesuffix(' at')}, column {e.colno}"
                raise ConfigError(f"{key}: {path}:{n} is not valid JSON ({why}); each line of a .jsonl "
                                  "file must be one JSON object") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{key}: {path}:{n} is a JSON {type(row).__name__}, not an object "
                                  f"with a {text_field!r} field")
            if text_field not in row:
                raise ConfigError(f"data.text_field: {path}:{n} has no field {text_field!r} "
                                  f"(fields: {sorted(row)})")
            yield _text(path, f"{path}:{n}", text_field, row[text_field])


def read_documents(dataset: str, text_field: str = "text", max_documents: int = 0,
                   key: str = "data.dataset", run_folder: str = "") -> list[str]:
    """Documents in a deterministic order: one per .txt/.md file, one per jsonl line / parquet row.
    `key`: the setting that named `dataset` (``data.dataset`` or ``validation.dataset``), for errors;
    `run_folder`: the run's job.dump_folder, which the dataset must not hold ("": not checked)."""
    docs: list[str] = []
    for path in _files(dataset, key, run_folder):
        ext = os.path.splitext(path)[1].lower()
        if ext in (".txt", ".md"):
            with open(path, "rb") as f:
                docs.append(_decode(path, f.read(), key=key))
        elif ext == ".jsonl":
            docs.extend(_read_jsonl(path, text_field, key))
        elif ext == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ConfigError(f"{key}: reading {path} needs pyarrow, which trnkit does not depend "
                                  "on (pip install pyarrow), or convert it to jsonl") from None
            try:
                table = pq.read_table(path)
            except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types for bad files
                raise ConfigError(f"{key}: {path} is not a readable parquet file ({e})") from None
            if text_field not in table.column_names:
                raise ConfigError(f"data.text_field: {path} has no column {text_field!r} "
                                  f"(columns: {table.column_names})")
            docs.extend(_text(path, f"{path} row {i}", text_field, x)
                        for i, x in enumerate(table.column(text_field).to_pylist()))
        else:
            raise ConfigError(f"{key}: unsupported file type {ext!r} ({path}); use txt, md, jsonl or parquet")
        if max_documents and len(docs) >= max_documents:
            return docs[:max_documents]
    return docs


def tokenize_stream(docs: list[str], tokenizer: Tokenizer, add_eos: bool = True) -> np.ndarray:
    ids = tokenizer.encode_batch(docs)
    if add_eos:
        if tokenizer.eos_id is None:
            raise ConfigError(f"data.add_eos: tokenizer {tokenizer.path} has no EOS token "
                              f"(looked for {list(Tokenizer.EOS_CANDIDATES)}); set data.add_eos = false")
        ids = [x + [tokenizer.eos_id] for x in ids]
    return np.fromiter((t for x in ids for t in x), dtype=np.int64)


# --------------------------------------------------------------------------- loader
@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64, IGNORE_INDEX where no label


class PackedLoader:
    """Deterministic, resumable, data-parallel-sharded loader over a packed token stream."""

    def __init__(self, stream: np.ndarray, seq_len: int, local_batch_size: int, dp_rank: int = 0,
                 dp_degree: int = 1, shuffle: bool = False, seed: int = 0) -> None:
        self.num_samples = max(len(stream) - 1, 0) // seq_len  # an empty stream has no sample (not -1)
        global_batch = local_batch_size * dp_degree
        if self.num_samples < global_batch:
            raise ConfigError(f"data: the corpus has {len(stream)} tokens = {self.num_samples} samples of "
                              f"seq_len {seq_len}, fewer than one global batch ({global_batch}); use more data "
                              "or a smaller training.seq_len / local_batch_size")
        self.stream = torch.from_numpy(np.ascontiguousarray(stream))
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.shuffle, self.seed = shuffle, seed
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache
        self.position = 0  # global samples consumed

    @property
    def epoch(self) -> int:
        return self.position // self.num_samples

    def sample_index(self, position: int) -> int:
        """Which packed sample the global `position` (counting over all epochs) reads."""
        epoch, i = divmod(position, self.num_samples)
        if not self.shuffle:
            return i
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
        return int(self._order[1][i])

    def next_batch(self) -> Batch:
        start = self.position + self.dp_rank * self.local_batch_size
        idx = [self.sample_index(start + j) for j in range(self.local_batch_size)]
        self.position += self.local_batch_size * self.dp_degree
        S = self.seq_len
        windows = torch.stack([self.stream[i * S: i * S + S + 1] for i in idx])
        return Batch(tokens=windows[:, :-1].contiguous(), labels=windows[:, 1:].contiguous())

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    @cached_property
    def identity(self) -> dict[str, Any]:
        """The training data as a checkpoint's manifest records it (``data``): the packed stream's token count
        and the SHA-256 of its tokens as little-endian int64. The stream is what tokenization, EOS, the
        document cap and the validation split left, so the hash changes with any of them and with the files'
        contents; it costs one pass over 8 bytes per token (the stream is in memory already)."""
        tokens = np.ascontiguousarray(self.stream.numpy(), dtype="<i8")
        return {"tokens": len(tokens), "sha256": hashlib.sha256(memoryview(tokens).cast("B")).hexdigest()}

    def check_identity(self, saved: Any, path: str) -> str | None:
        """Refuse (ConfigError) a resume from the checkpoint at ``path`` whose recorded data identity ``saved``
        (:attr:`identity`) differs from this run's; a warning for a checkpoint that records none (written
        before trnkit recorded it: only its sample count is then compared, by :meth:`load_state_dict`)."""
        if not (isinstance(saved, dict) and isinstance(saved.get("sha256"), str)):
            return (f"WARNING: checkpoint {path} records no identity of its training data (an older checkpoint): "
                    "only its sample count is compared with this run's corpus")
        if (saved.get("tokens"), saved["sha256"]) == (self.identity["tokens"], self.identity["sha256"]):
            return None

        def show(d: dict[str, Any]) -> str:
            tokens = f"{d['tokens']:,}" if isinstance(d.get("tokens"), int) else repr(d.get("tokens"))
            return f"{tokens} tokens, sha256 {str(d['sha256'])[:16]}"

        raise ConfigError(
            f"data: the checkpoint's data position reads other samples in this run (the training token stream: "
            f"checkpoint {path} {show(saved)}, this run {show(self.identity)}; data.dataset's files or their "
            "contents, data.tokenizer, data.text_field, data.add_eos, data.max_documents or "
            "validation.split_fraction changed). Nothing was written. Resume with the checkpoint's data (see its "
            "run's config.toml), or start fresh: another --job.dump_folder, or --checkpoint.resume false (this "
            "run's files are first moved to previous-<time>/ in the dump folder)")

    # Stateful protocol (torch.distributed.checkpoint)
    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "num_samples": self.num_samples, "seq_len": self.seq_len,
                "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the checkpoint's position; refused (ConfigError naming the settings) when the checkpoint's
        sample order or corpus differs from this run's, since its position would then read other samples."""
        saved = {"training.seq_len": int(state["seq_len"]), "data.shuffle": bool(state.get("shuffle", False)),
                 "job.seed": int(state.get("seed", 0))}
        now = {"training.seq_len": self.seq_len, "data.shuffle": self.shuffle, "job.seed": self.seed}
        diffs = [f"{k}: checkpoint {saved[k]!r}, this run {now[k]!r}" for k in saved if saved[k] != now[k]]
        if not diffs and int(state["num_samples"]) != self.num_samples:
            diffs = [f"the training corpus: checkpoint {int(state['num_samples']):,} samples of {self.seq_len} "
                     f"tokens, this run {self.num_samples:,} (data.dataset, data.tokenizer, data.add_eos, "
                     "data.max_documents or validation.split_fraction changed)"]
        if diffs:
            raise ConfigError("data: the checkpoint's data position reads other samples in this run (" +
                              "; ".join(diffs) + "). Resume with the checkpoint's settings (see its run's "
                              "config.toml), or use another --job.dump_folder")
        self.position = int(state["position"])


def build_loader(data_cfg: Any, seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int,
                 seed: int = 0, tokenizer: Tokenizer | None = None) -> tuple[PackedLoader, Tokenizer]:
    train, _, tokenizer = build_loaders(data_cfg, None, seq_len, local_batch_size, dp_rank, dp_degree, seed,
                                        tokenizer)
    return train, tokenizer


def split_holdout(stream: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) parts of a packed token stream: the held-out part is its last
    ``round(fraction * N)`` tokens. No token position is in both, so no training sample's window
    (inputs or labels) reaches a held-out token."""
    n_val = int(round(fraction * len(stream)))
    return stream[:len(stream) - n_val], stream[len(stream) - n_val:]


def build_loaders(data_cfg: Any, val_cfg: Any, seq_len: int, local_batch_size: int, dp_rank: int,
                  dp_degree: int, seed: int = 0, tokenizer: Tokenizer | None = None, run_folder: str = ""
                  ) -> tuple[PackedLoader, PackedLoader | None, Tokenizer]:
    """(training loader, validation loader or None, tokenizer) for ``[data]`` and ``[validation]``.

    Validation reads ``val_cfg.dataset`` when set, else the tail of the training corpus
    (:func:`split_holdout`). Its loader is sharded like the training one, in corpus order (no
    shuffle); the trainer rewinds it before each evaluation, so every evaluation sees the same batches.
    """
    tokenizer = tokenizer or load_tokenizer(data_cfg.tokenizer)
    docs = read_documents(data_cfg.dataset, data_cfg.text_field, data_cfg.max_documents, run_folder=run_folder)
    stream = tokenize_stream(docs, tokenizer, data_cfg.add_eos)
    global_batch = local_batch_size * dp_degree
    val_stream = None
    if val_cfg is not None and val_cfg.enabled:
        if val_cfg.dataset:
            docs = read_documents(val_cfg.dataset, data_cfg.text_field, key="validation.dataset",
                                  run_folder=run_folder)
            val_stream = tokenize_stream(docs, tokenizer, data_cfg.add_eos)
            source = f"validation.dataset {val_cfg.dataset!r} ({len(val_stream):,} tokens)"
            fix = "use more validation data"
        else:
            total = len(stream)
            stream, val_stream = split_holdout(stream, val_cfg.split_fraction)
            train_samples = max(len(stream) - 1, 0) // seq_len
            if train_samples < global_batch:
                raise ConfigError(
                    f"validation.split_fraction: holding out {val_cfg.split_fraction} of the corpus "
                    f"({len(val_stream):,} of {total:,} tokens) leaves {train_samples} training samples of seq_len "
                    f"{seq_len}, fewer than one global batch ({global_batch}); lower validation.split_fraction, "
                    "use more data or set validation.dataset")
            source = (f"the held-out last {val_cfg.split_fraction} of the corpus ({len(val_stream):,} of "
                      f"{total:,} tokens)")
            fix = "raise validation.split_fraction"
        val_samples = max(len(val_stream) - 1, 0) // seq_len
        need = val_cfg.steps * global_batch
        if val_samples < need:
            raise ConfigError(
                f"validation: {source} holds {val_samples} samples of seq_len {seq_len}; validation.steps "
                f"({val_cfg.steps}) x global batch ({global_batch}) needs {need}; lower validation.steps or {fix}")
    train = PackedLoader(stream, seq_len, local_batch_size, dp_rank, dp_degree, data_cfg.shuffle, seed)
    val = None if val_stream is None else PackedLoader(val_stream, seq_len, local_batch_size, dp_rank, dp_degree)
    return train, val, tokenizer


__all__ = ["Batch", "IGNORE_INDEX", "PackedLoader", "Tokenizer", "build_loader", "build_loaders",
           "load_tokenizer", "qwen3_tokenizer_path", "read_documents", "shakespeare_files", "split_holdout",
           "tokenize_stream"]
