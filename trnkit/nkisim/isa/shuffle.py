"""``nc_stream_shuffle``: cross-partition data movement within 32-partition quadrants (Vector Engine).

Semantics and rules from the NKI 0.6 API reference (``nki/api/nki/isa/__init__.py``,
``nc_stream_shuffle``) and its example test (``nki/test/test_nki_isa_nc_stream_shuffle.py``):
``shuffle_mask`` has 32 entries; output partition ``i`` of every quadrant copies input partition
``shuffle_mask[i]`` of the same quadrant, 255 leaves it unmodified, the same mask is applied to each
quadrant. ``src`` / ``dst`` in SBUF or PSUM, same dtype, same elements per partition; in place allowed.
``num_active_partitions = ceil(max(src_parts, dst_parts) / 32) * 32`` fixes the allowed start
partitions (96/128: 0; 64: 0 or 64; 32: 0/32/64/96).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import fail, require
from ..tensor import NkiTensor
from .vector import check_tile, emit, read_raw, write

__all__ = ["nc_stream_shuffle"]

QUADRANT = 32
MASK_KEEP = 255  # "the output tensor in partition [i] will be unmodified"
_STARTS = {32: (0, 32, 64, 96), 64: (0, 64), 96: (0,), 128: (0,)}


def _check_mask(op: str, shuffle_mask: Any) -> list[int]:
    require(isinstance(shuffle_mask, (list, tuple)) and len(shuffle_mask) == QUADRANT, op,
            "shuffle_mask must be a list of {n} ints, got {mask!r}", n=QUADRANT, mask=shuffle_mask)
    mask = []
    for i, m in enumerate(shuffle_mask):
        ok = isinstance(m, (int, np.integer)) and not isinstance(m, bool)
        require(ok and (0 <= int(m) < QUADRANT or int(m) == MASK_KEEP), op,
                "shuffle_mask[{i}] must be a partition in [0, 32) or 255 (keep), got {m!r}", i=i, m=m)
        mask.append(int(m))
    return mask


def nc_stream_shuffle(dst: NkiTensor, src: NkiTensor, shuffle_mask: Any,
                      name: str | None = None) -> None:
    """Per quadrant ``q``: ``dst[32q + i] = src[32q + shuffle_mask[i]]`` (255: ``dst[32q + i]`` kept)."""
    op = "nc_stream_shuffle"
    check_tile(op, "src", src, "vector")
    check_tile(op, "dst", dst, "vector")
    require(src.dtype == dst.dtype, op, "dst dtype {dst_dtype} must equal src dtype {src_dtype}",
            dst_dtype=dst.dtype.name, src_dtype=src.dtype.name)
    require(src.free_size == dst.free_size, op, "dst has {n_dst} elements per partition, src has "
            "{n_src}; they must match", n_dst=dst.free_size, n_src=src.free_size)
    mask = _check_mask(op, shuffle_mask)
    p_src, p_dst = src.shape[0], dst.shape[0]
    active = -(-max(p_src, p_dst) // QUADRANT) * QUADRANT
    for role, t in (("src", src), ("dst", dst)):
        if t.partition_start not in _STARTS[active]:
            fail(op, "{role} starts at partition {start}; with {active} active partitions the start "
                 "must be one of {allowed}", role=role, start=t.partition_start, active=active,
                 allowed=_STARTS[active])
    data = read_raw(src)  # a copy: dst may be src
    out = read_raw(dst)
    for q in range(active // QUADRANT):
        for i, m in enumerate(mask):
            d = q * QUADRANT + i
            if m == MASK_KEEP or d >= p_dst:
                continue
            s = q * QUADRANT + m
            if s >= p_src:
                fail(op, "shuffle_mask[{i}] = {m} reads partition {s} of src, which has {p} "
                     "partitions", i=i, m=m, s=s, p=p_src)
            out[d] = data[s]
    write(dst, out)
    emit(op, "vector", {"dst": dst, "src": src}, name=name)
