"""Reading a torch.distributed.checkpoint (DCP) folder without running code from it.

DCP's own reader unpickles ``.metadata`` with :func:`pickle.load` and its default load planner reads
every non-tensor value with ``torch.load(weights_only=False)``: a crafted checkpoint file could execute
anything on resume. :class:`SafeReader` unpickles ``.metadata`` with an unpickler that resolves only the
classes DCP writes there (its metadata dataclasses, ``torch.Size``, dtypes, layouts, paths), and
:class:`SafeLoadPlanner` reads the non-tensor values with ``weights_only=True`` (plain Python values
and tensors: what the trainer saves as bytes). Anything else is a :class:`UnsafeCheckpointError`
naming the file and the refused class.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from trnkit.errors import TrnkitError

METADATA = ".metadata"

# Every class DCP's FileSystemWriter pickles into .metadata (torch 2.4 - 2.13).
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeCheckpointError(TrnkitError, pickle.UnpicklingError):
    """A checkpoint file asks to construct something DCP never writes (a crafted or foreign file)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, path: str) -> None:
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"checkpoint: {self.path} refers to {module}.{name}, which DCP never writes "
                                    "into checkpoint metadata; refusing to load it (a crafted or foreign file)")


def read_metadata(path: str) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint folder `path`, unpickled with the restricted unpickler."""
    f = os.path.join(path, METADATA)
    with open(f, "rb") as fh:
        metadata = _MetadataUnpickler(fh, f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"checkpoint: {f} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"checkpoint: the value {fqn!r} is not plain data ({str(e).splitlines()[0]}); "
                                        "refusing to load it (a crafted or foreign file)") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


__all__ = ["METADATA", "SafeLoadPlanner", "SafeReader", "UnsafeCheckpointError", "read_metadata"]
