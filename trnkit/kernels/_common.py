"""Small helpers shared by the kernel families: host-side dtype / layout helpers and the trace-time
tilings (plain Python: no NKI import, so constraints and references load without the NKI backend; the
kernel-side helpers are :mod:`trnkit.kernels.tiles`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

P_MAX = 128  # SBUF / PSUM partitions
# tanh-GELU: 0.5 a (1 + tanh(C (a + A a^3))) = a * sigmoid(2C (a + A a^3)), C = sqrt(2 / pi)
GELU_C = 0.7978845608028654
GELU_A = 0.044715


def dtype_name(t: Any) -> str:
    """'float32', 'bfloat16', ... for torch tensors, numpy arrays and NKI tensors alike."""
    dt = t.dtype
    if isinstance(dt, torch.dtype):
        return str(dt).removeprefix("torch.")
    return np.dtype(dt).name


def shape(t: Any) -> tuple[int, ...]:
    """``t``'s shape as a tuple of ints (torch, numpy and NKI tensors alike)."""
    return tuple(int(n) for n in t.shape)


def dense(t: Any) -> Any:
    """``t`` as a contiguous tensor (a copy only when it is strided); None and device tensors pass."""
    if isinstance(t, torch.Tensor):
        return t.contiguous()
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t)
    return t


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def row_chunks(n_rows: int, nt_max: int) -> tuple:
    """Split ``n_rows`` rows into chunks ``(r0, P, NT)``: P partitions x NT *consecutive* rows each
    (row ``r0 + p*NT + t``), so a partition's rows are one contiguous run in a row-major HBM tensor.
    Full chunks have P=128, NT=nt_max; then one P=128 chunk with fewer rows per partition; a short tail
    uses P < 128 partitions with NT=1 (any row count works)."""
    chunk = P_MAX * nt_max
    n_full = n_rows // chunk
    chunks = []
    for i in range(n_full):
        chunks.append((i * chunk, P_MAX, nt_max))
    r0 = n_full * chunk
    nt_rest = (n_rows - r0) // P_MAX
    if nt_rest:
        chunks.append((r0, P_MAX, nt_rest))
        r0 = r0 + P_MAX * nt_rest
    if r0 < n_rows:
        chunks.append((r0, n_rows - r0, 1))
    return tuple(chunks)


def program_share(items: list, keys: list, n_prog: int, pid: int) -> list:
    """This program's part of an SPMD split of ``items``: ``[(item, masked), ...]``. Runs of consecutive
    items with equal ``keys`` (their shapes) go to the programs in groups of ``n_prog``, one each; in a
    group short of a member the programs without one repeat the group's first item as masked work (the
    caller computes it and stores it to a scratch tensor), so every program runs the same instructions:
    both cores of a logical core must take the same control flow ("different control flow on the two
    cores is undefined", NKI LNC guide)."""
    out = []
    i = 0
    while i < len(items):
        n = 1
        while n < n_prog and i + n < len(items) and keys[i + n] == keys[i]:
            n += 1
        if pid < n:
            out.append((items[i + pid], False))
        else:
            out.append((items[i], True))
        i += n
    return out
