"""Conformance cases of nki-library's core/utils subkernels, written from their test files.

The tests run each subkernel inside a small kernel defined in the test module; the wrappers here do
what those kernels do and call the library's subkernel the same way:

- ``test_cross_partition_copy.py``: load ``[partitions, free]`` fp32 (``np.random.seed(42)``, ``randn``)
  into SBUF, zero a destination tile with ``memset``, ``cross_partition_copy`` a partition range to
  another start partition, store the destination; against the slice copy, at the framework's default
  rtol 1e-5 / atol 1e-8.
- ``test_tp_broadcast.py``: load the source (``np_random_sample()``: seed 0, ``random_sample``, fp32)
  into SBUF, optionally select one index of its middle dimension (``TensorView.select``),
  ``tp_broadcast`` column ``src_offset`` onto ``broadcast_count`` partitions, store; exact (rtol = atol = 0).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .harness import Case

__all__ = ["utils_cases", "partition_copy_golden", "tp_broadcast_golden"]

LIB = "nkilib_src.nkilib.core.utils"
TESTS = "test/integration/nkilib/core/utils"
HERE = "trnkit.conformance.cases_utils"


def _partition_copy_wrapper(cross_partition_copy: Callable[..., Any]) -> Callable[..., Any]:
    import nki.isa as nisa  # the interpreter, inside nki_is_interpreter
    import nki.language as nl

    def wrapper(input_data, output, src_start_partition, dst_start_partition, num_partitions_to_copy,
                free_dim_size, total_partitions):
        src = nl.ndarray((total_partitions, free_dim_size), dtype=input_data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=src, src=input_data)
        dst = nl.ndarray((total_partitions, free_dim_size), dtype=input_data.dtype, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=0.0)
        cross_partition_copy(src=src, dst=dst, src_start_partition=src_start_partition,
                             dst_start_partition=dst_start_partition, num_partitions_to_copy=num_partitions_to_copy,
                             free_dim_size=free_dim_size)
        nisa.dma_copy(dst=output, src=dst)
        return output
    return wrapper


def _partition_copy_inputs(src: int, dst: int, n: int, free: int, total: int) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        data = np.random.randn(total, free).astype(np.float32)
        return {"input_data": data, "output": np.zeros_like(data), "src_start_partition": src,
                "dst_start_partition": dst, "num_partitions_to_copy": n, "free_dim_size": free,
                "total_partitions": total}
    return make


def partition_copy_golden(input_data: Any, src_start_partition: int, dst_start_partition: int,
                          num_partitions_to_copy: int, free_dim_size: int, **_: Any) -> dict[str, np.ndarray]:
    """Zeros but the copied partitions."""
    x = input_data.numpy()
    out = np.zeros_like(x)
    s, d, n = src_start_partition, dst_start_partition, num_partitions_to_copy
    out[d:d + n, :free_dim_size] = x[s:s + n, :free_dim_size]
    return {"output": out}


def _tp_broadcast_wrapper(tp_broadcast: Callable[..., Any]) -> Callable[..., Any]:
    import nki.isa as nisa
    import nki.language as nl

    tensor_view = importlib.import_module(f"{LIB}.tensor_view").TensorView

    def wrapper(src_hbm, src_offset, broadcast_count, src_select_index):
        dst_shape = (broadcast_count, src_hbm.shape[0])
        src_sbuf = nl.ndarray(src_hbm.shape, src_hbm.dtype, nl.sbuf)
        dst_sbuf = nl.ndarray(dst_shape, src_hbm.dtype, nl.sbuf)
        dst_hbm = nl.ndarray(dst_shape, src_hbm.dtype, nl.shared_hbm)
        nisa.dma_copy(src_sbuf, src_hbm)
        src_in = src_sbuf if src_select_index is None else tensor_view(src_sbuf).select(1, src_select_index)
        tp_broadcast(src_in, dst_sbuf, src_offset)
        nisa.dma_copy(dst_hbm, dst_sbuf)
        return dst_hbm
    return wrapper


def _tp_broadcast_inputs(shape: tuple[int, ...], offset: int, count: int, select: int | None
                         ) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        np.random.seed(0)
        return {"src_hbm": np.random.random_sample(shape).astype(np.float32), "src_offset": offset,
                "broadcast_count": count, "src_select_index": select}
    return make


def tp_broadcast_golden(src_hbm: Any, src_offset: int, broadcast_count: int, src_select_index: int | None
                        ) -> dict[str, np.ndarray]:
    """Column ``src_offset`` of the (selected) source, as a row repeated ``broadcast_count`` times."""
    x = src_hbm.numpy()
    if src_select_index is not None:
        x = x[:, src_select_index]
    return {"out": np.repeat(x.reshape(x.shape[0], -1)[None, :, src_offset], broadcast_count, axis=0)}


# src_start, dst_start, partitions, free size, total partitions (test_cross_partition_copy's rows)
_COPY = [(0, 0, 32, 8, 128), (0, 64, 32, 8, 128), (0, 0, 64, 8, 64), (0, 5, 10, 8, 128), (0, 16, 8, 8, 64),
         (0, 28, 20, 8, 128), (0, 60, 10, 8, 96), (0, 1, 63, 8, 64), (5, 0, 16, 8, 128), (33, 64, 16, 8, 128),
         (17, 0, 15, 8, 32), (5, 10, 8, 8, 128), (3, 2, 4, 8, 32), (5, 28, 20, 8, 128), (10, 55, 30, 8, 96),
         (28, 64, 32, 8, 128), (25, 5, 20, 8, 64), (0, 5, 10, 2, 128), (5, 0, 16, 32, 128), (0, 28, 20, 128, 128)]
# source shape, column, broadcast count, selected middle index (test_tp_broadcast's rows)
_TP = [((5, 7), 0, 1, None), ((3, 8, 11), 1, 2, 4), ((8, 6), 5, 7, None), ((13, 3, 13), 9, 12, 2)]


def utils_cases() -> list[Case]:
    cases = [Case(
        kernel="core/utils/cross_partition_copy", name=f"fp32 partitions {s}..{s + n - 1} -> {d}..{d + n - 1}",
        shapes=f"[{total},{free}]", entry=f"{LIB}.cross_partition_copy:cross_partition_copy",
        wrap_kernel=_partition_copy_wrapper, reference=f"{HERE}:partition_copy_golden",
        inputs=_partition_copy_inputs(s, d, n, free, total), outputs=("output",), lnc=1,
        test_file=f"{TESTS}/test_cross_partition_copy.py") for s, d, n, free, total in _COPY]
    cases += [Case(
        kernel="core/utils/tp_broadcast", name=f"fp32 column {off} x {count}" + (f" select {sel}" if sel else ""),
        shapes="[" + ",".join(map(str, shape)) + "]", entry=f"{LIB}.tp_broadcast:tp_broadcast",
        wrap_kernel=_tp_broadcast_wrapper, reference=f"{HERE}:tp_broadcast_golden",
        inputs=_tp_broadcast_inputs(shape, off, count, sel), outputs=("out",), lnc=1, rtol=0.0, atol=0.0,
        test_file=f"{TESTS}/test_tp_broadcast.py") for shape, off, count, sel in _TP]
    return cases
