"""GpSimd data-movement instructions: ``nc_n_gather``, ``local_gather``, ``nonzero_with_count`` and
``tensor_partition_reduce`` (NKI 0.6 API reference, ``nki/api/nki/isa/__init__.py``).

GpSimd is eight cores, each wired to 16 contiguous SBUF partitions; it cannot access PSUM, so every
operand here is in SBUF. Indices that the docs call undefined behaviour when out of range are
rejected with the index and the bound.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes
from .. import ops as _ops
from ..errors import fail, require
from ..tensor import NkiTensor
from . import common
from .vector import check_tile, emit, get_op, read, read_raw, write

__all__ = ["nc_n_gather", "local_gather", "nonzero_with_count", "tensor_partition_reduce"]

PARTITIONS_PER_CORE = 16  # "each of the eight GpSimd cores ... connects to 16 contiguous SBUF partitions"
LOCAL_GATHER_ELEMS = (1, 2, 4, 8, 16, 32)  # allowed num_elem_per_idx
LOCAL_GATHER_MAX_INDICES = 4096  # "number of indices for gather per core must be <= 4096"


def _sbuf(op: str, **tiles: Any) -> None:
    for role, t in tiles.items():
        check_tile(op, role, t, "gpsimd")
        common.check_buffer(op, role, t, common.SBUF)


def _check_index_range(op: str, role: str, idx: np.ndarray, bound: int) -> None:
    bad = (idx < 0) | (idx >= bound)
    if bad.any():
        p, j = (int(v[0]) for v in np.nonzero(bad))
        fail(op, "{role}[{p}, {j}] = {value} is out of range [0, {bound})", role=role, p=p, j=j,
             value=int(idx[p, j]), bound=bound)


def nc_n_gather(dst: NkiTensor, data: NkiTensor, indices: NkiTensor, name: str | None = None) -> None:
    """Per partition ``p``: ``dst[p, j] = data[p].flatten()[indices[p].flatten()[j]]``."""
    op = "nc_n_gather"
    _sbuf(op, dst=dst, data=data, indices=indices)
    common.check_same_partitions(op, {"data": data, "indices": indices, "dst": dst})
    require(dst.dtype == data.dtype, op, "dst dtype {dst_dtype} must equal data dtype {data_dtype}",
            dst_dtype=dst.dtype.name, data_dtype=data.dtype.name)
    common.check_dtype(op, "indices", indices, (dtypes.uint32,))
    require(dst.free_size == indices.free_size, op, "dst has {n_dst} elements per partition, indices "
            "has {n_idx}; they must match", n_dst=dst.free_size, n_idx=indices.free_size)
    idx = read_raw(indices).astype(np.int64)
    _check_index_range(op, "indices", idx, data.free_size)
    write(dst, np.take_along_axis(read_raw(data), idx, axis=1))
    emit(op, "gpsimd", {"dst": dst, "data": data, "indices": indices}, name=name)


def local_gather(dst: NkiTensor, src_buffer: NkiTensor, index: NkiTensor, num_elem_per_idx: int = 1,
                 num_valid_indices: int | None = None, name: str | None = None) -> None:
    """Each GpSimd core (16 partitions) flattens its slice of ``index`` partition-first and, for
    every partition ``p`` it owns, writes ``num_elem_per_idx`` contiguous elements of ``src_buffer[p]``
    (free dims flattened) starting at each of the first ``num_valid_indices`` indices to ``dst[p]``.

    Exact semantics: the numpy reference of ``nki/test/test_nki_isa_local_gather.py`` (aws-neuron-sdk):
    ``indices_1d = index[core].flatten(order='F')[:num_valid_indices]`` and the index values are
    element offsets into the partition (the test passes ``index * num_elem_per_idx``).
    """
    op = "local_gather"
    _sbuf(op, dst=dst, src_buffer=src_buffer, index=index)
    p = src_buffer.shape[0]
    require(index.shape[0] == p and p % PARTITIONS_PER_CORE == 0, op, "src_buffer and index must "
            "have the same partition count, a multiple of 16; got {p_src} and {p_idx}", p_src=p,
            p_idx=index.shape[0])
    common.check_dtype(op, "index", index, (dtypes.uint16,))
    require(dst.dtype == src_buffer.dtype, op, "dst dtype {dst_dtype} must equal src_buffer dtype "
            "{src_dtype} (no casting)", dst_dtype=dst.dtype.name, src_dtype=src_buffer.dtype.name)
    require(num_elem_per_idx in LOCAL_GATHER_ELEMS, op, "num_elem_per_idx must be one of {allowed}, "
            "got {n!r}", allowed=LOCAL_GATHER_ELEMS, n=num_elem_per_idx)
    per_core = index.free_size * PARTITIONS_PER_CORE
    n_valid = per_core if num_valid_indices is None else num_valid_indices
    require(isinstance(n_valid, (int, np.integer)) and 1 <= n_valid <= per_core, op,
            "num_valid_indices must be in [1, {per_core}] (the indices of one core's 16 partitions), "
            "got {n!r}", per_core=per_core, n=num_valid_indices)
    require(n_valid <= LOCAL_GATHER_MAX_INDICES, op, "{n} indices per core exceed the limit of "
            "{limit}", n=n_valid, limit=LOCAL_GATHER_MAX_INDICES)
    require(dst.shape[0] == p and dst.free_size == n_valid * num_elem_per_idx, op,
            "dst must have {p} partitions x {n} elements (num_valid_indices x num_elem_per_idx), got "
            "shape {shape}", p=p, n=n_valid * num_elem_per_idx, shape=dst.shape)
    src = read_raw(src_buffer)
    idx = read_raw(index).astype(np.int64)
    per_core_idx = idx.reshape(p // PARTITIONS_PER_CORE, PARTITIONS_PER_CORE, -1)
    flat = per_core_idx.transpose(0, 2, 1).reshape(p // PARTITIONS_PER_CORE, -1)[:, :n_valid]
    starts = np.repeat(flat, PARTITIONS_PER_CORE, axis=0)  # [P, n_valid]: each core's indices
    _check_index_range(op, "index (+ num_elem_per_idx - 1)", starts + (num_elem_per_idx - 1),
                       src_buffer.free_size)
    cols = (starts[:, :, None] + np.arange(num_elem_per_idx)).reshape(p, -1)
    write(dst, np.take_along_axis(src, cols, axis=1))
    emit(op, "gpsimd", {"dst": dst, "src_buffer": src_buffer, "index": index}, name=name,
         num_elem_per_idx=num_elem_per_idx)


def nonzero_with_count(dst: NkiTensor, src: NkiTensor, index_offset: int = 0, padding_val: int = -1,
                       name: str | None = None) -> None:
    """On partitions 0, 16, ..., 112 only: ``dst[p] = [indices of non-zeros + index_offset...,
    padding_val..., count]`` (``dst`` has one more element per partition than ``src``)."""
    op = "nonzero_with_count"
    _sbuf(op, dst=dst, src=src)
    common.check_same_partitions(op, {"src": src, "dst": dst})
    common.check_dtype(op, "src", src, (dtypes.float32, dtypes.int32))
    common.check_dtype(op, "dst", dst, (dtypes.int32,))
    require(dst.free_size == src.free_size + 1, op, "dst must have one more element per partition "
            "than src ({n}), got {n_dst}", n=src.free_size + 1, n_dst=dst.free_size)
    info = np.iinfo(np.int32)
    for role, v in (("index_offset", index_offset), ("padding_val", padding_val)):
        ok = isinstance(v, (int, np.integer)) and not isinstance(v, bool)
        require(ok and info.min <= int(v) <= info.max, op, "{role} must be an int32 value, got "
                "{v!r}", role=role, v=v)
    x = read_raw(src)
    out = read_raw(dst)
    first = dst.partition_start
    for p in range(0, x.shape[0]):
        if (first + p) % PARTITIONS_PER_CORE:
            continue  # each GpSimd core reads and writes only its 0-th partition
        nz = np.flatnonzero(x[p] != 0)
        row = np.full(x.shape[1] + 1, padding_val, dtype=np.int64)
        row[:nz.size] = nz + int(index_offset)
        row[-1] = nz.size
        out[p] = row
    write(dst, out)
    emit(op, "gpsimd", {"dst": dst, "src": src}, name=name)


_PARTITION_REDUCE_OPS = ("add", "average", "maximum", "bitwise_or", "bitwise_and")


def tensor_partition_reduce(dst: NkiTensor, op: Any, data: NkiTensor, name: str | None = None) -> None:
    """``dst[0, ...] = reduce(op, data[p, ...] over partitions p)``; ``dst`` has one partition.

    ``op`` is one of add, average, max, bitwise_or, bitwise_and (the documented list); arithmetic in
    fp32, bitwise operators on the raw integer bits.
    """
    OP = "tensor_partition_reduce"
    _sbuf(OP, dst=dst, data=data)
    f = get_op(OP, "op", op)
    require(f.name in _PARTITION_REDUCE_OPS, OP, "op must be one of {allowed}, got {f}",
            allowed=", ".join(_PARTITION_REDUCE_OPS), f=f)
    require(dst.shape[0] == 1, OP, "dst must have 1 partition, got {p}", p=dst.shape[0])
    require(dst.free_size == data.free_size, OP, "dst has {n_dst} elements per partition, data has "
            "{n}; they must match", n_dst=dst.free_size, n=data.free_size)
    if f.is_bitvec:
        for role, t in (("data", data), ("dst", dst)):
            require(dtypes.is_int(t.dtype), OP, "bitvec operator {f} needs integer dtypes, but {role} "
                    "is {dtype}", f=f, role=role, dtype=t.dtype.name)
        result = f.reduce(read_raw(data).astype(np.int64), axis=(0,), keepdims=True)
        write(dst, result, bits=True)
    elif f is _ops.average:
        write(dst, read(data).mean(axis=0, keepdims=True, dtype=np.float32))
    else:
        write(dst, f.reduce(read(data), axis=(0,), keepdims=True))
    emit(OP, "gpsimd", {"dst": dst, "data": data}, op=f.name, name=name)
