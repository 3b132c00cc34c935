"""Conformance cases of nki-library's core/subkernels find_nonzero_indices and indexed_flatten.

``test/integration/nkilib/core/subkernels/test_find_nonzero_indices.py``: a sparse [T, E] input with
``T * top_k // E`` ones per expert column (``np.random.seed(42)``, one permutation; float32 inputs
use 0.1 for the nonzeros), optionally a column window (``col_start_id``, ``n_cols``), LNC 2, exact
comparison. ``test_indexed_flatten.py``: an [E, T] ``arange`` input scattered in ``f_len`` chunks at
``row_offsets`` (optionally from ``row_offsets_start``), padding -1, LNC 2, exact. Both against
nki-library's torch references.

``test/integration/nkilib/experimental/subkernels/test_topk_reduce.py``: T * K bf16 rows (``randn``
after ``np.random.seed(42)``) with their token id packed as an int32 in two bf16 columns, scattered by
one permutation into a [ranks * T, H + 2] buffer of -1, reduced per token; rtol / atol 5e-2. The test
imports ``nkilib.experimental.subkernels.topk_reduce``, which is ``experimental/collectives/topk_reduce.py``
at d2ad3a5 (the test module does not import there); the cases run that file's kernel and reference.

``test/integration/nkilib/experimental/benchmark/test_find_nonzero_indices_with_count.py``: a [1, T] float32
input with ``int(T * pct_nonzero)`` values uniform in [0, 1) at distinct random positions (its
``sparse_nonzero_tensor_generator``: ``default_rng(0)``, positions then values), under ``CompilerArgs`` for
trn2 (LNC 2), compared exactly with the test's golden (``golden_output_validator``, written here as
:func:`nonzero_with_count_golden`: the test module imports ``neuron_dtypes``, which is not installable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["nonzero_with_count_golden", "subkernel_cases"]

LIB = "nkilib_src.nkilib.core.subkernels"
EXP = "nkilib_src.nkilib.experimental.collectives"
BENCH = "nkilib_src.nkilib.experimental.benchmark"
BENCH_TEST = "test/integration/nkilib/experimental/benchmark/test_find_nonzero_indices_with_count.py"
BF16 = np.dtype(ml_dtypes.bfloat16)
TESTS = "test/integration/nkilib/core/subkernels"


def _nonzero_inputs(t: int, e: int, top_k: int, chunk: int, dtype: str, window: tuple[int, int] | None
                    ) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        k = t * top_k // e
        flat = np.random.permutation(np.concatenate([np.ones(k * e), np.zeros((t - k) * e)]))
        x = flat.reshape(e, t).T.astype(dtype)
        if dtype == "float32":
            x[x > 0] = 0.1
        out = {"input_tensor": x, "chunk_size": chunk}
        if window is not None:
            out.update(col_start_id=np.array([window[0]], dtype=np.int32), n_cols=window[1])
        return out
    return make


def _sparse_inputs(t: int, n_nonzero: int) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        rng = np.random.default_rng(0)
        x = np.zeros(t, dtype=np.float32)
        if n_nonzero:
            at = rng.choice(t, size=n_nonzero, replace=False)
            x[at] = rng.uniform(0.0, 1.0, size=n_nonzero).astype(np.float32)
        return {"input_tensor": x.reshape(1, t)}
    return make


def nonzero_with_count_golden(input_tensor: Any) -> dict[str, np.ndarray]:
    """The test's ``golden_output_validator``: [1, T + 1] int32, the indices of the non-zeros of row 0 in
    order, -1 after them, their count last."""
    row = np.asarray(input_tensor)[0]
    found = np.flatnonzero(row)
    out = np.full((1, row.size + 1), -1, dtype=np.int32)
    out[0, :found.size] = found
    out[0, -1] = found.size
    return {"output": out}


def _flatten_inputs(t: int, e: int, f_len: int, n: int, start: int | None) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        return {"input_tensor": np.arange(e * t, dtype=np.int32).reshape(e, t), "f_len": f_len,
                "output_len": (n * t + 1024 + 127) // 128 * 128,
                "row_offsets": np.array([t // f_len * i for i in range(n)], dtype=np.int32),
                "row_offsets_start": None if start is None else np.array([start], dtype=np.int32),
                "padding_val": -1}
    return make


def _topk_reduce_inputs(t: int, k: int, h: int, ranks: int) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        buf = np.full((ranks * t, h + 2), -1, dtype=BF16)
        values = np.random.randn(t * k, h).astype(BF16)
        ids = np.arange(t, dtype=np.int32).repeat(k).reshape(t * k, 1).view(BF16)  # [T*K, 2]
        buf[np.random.permutation(ranks * t)[:t * k]] = np.concatenate([values, ids], axis=1)
        return {"input": buf, "T": t, "K": k}
    return make


# lnc, source ranks, T, K, H (all 9 rows of TOPK_REDUCE_PARAMS)
_TOPK_REDUCE = [(1, 8, 4, 4, 2880), (2, 8, 4, 4, 2880), (2, 8, 4, 8, 4096), (2, 8, 128, 4, 2880),
                (2, 8, 128, 8, 4096), (2, 128, 4, 4, 2880), (2, 128, 4, 8, 4096), (2, 128, 128, 4, 2880),
                (2, 128, 128, 8, 4096)]
# T, E, top_k, chunk_size, dtype, (E_offset, E_local) or None: all 6 rows of FULL_TEST_PARAMS, all 7 of
# SUBSET_TEST_PARAMS
_NONZERO = [(t, 128, k, chunk, dt, None) for t, k, chunk in ((4096, 8, 4096), (10240, 4, 10240), (65536, 4, 16384))
            for dt in ("int32", "float32")] \
    + [(t, 128, k, chunk, dt, w) for t, k, w, chunk in ((4096, 8, (0, 4), 4096), (10240, 4, (16, 16), 10240),
                                                     (65536, 4, (32, 16), 16384)) for dt in ("int32", "float32")] \
    + [(10240, 128, 4, 10240, "float32", (120, 8))]
# T, E, f_len, rows N (= E without row_offsets_start), row_offsets_start: all 11 rows of FAST_TEST_PARAMS, all 3
# of ROW_OFFSET_TEST_PARAMS
_FLATTEN = [(t, e, f, e, None) for t, e, f in ((4096, 1, 128), (4096, 2, 128), (4096, 2, 256), (4096, 3, 128),
                                               (10240, 16, 128), (10240, 17, 128), (65536, 4, 128), (65536, 4, 256),
                                               (4096, 64, 128), (4096, 128, 128), (4096, 256, 128))] \
    + [(4096, 2, 128, 4, 2), (4096, 3, 128, 5, 1), (10240, 8, 128, 16, 8)]
# T, fraction non-zero (find_nonzero_indices_perms: every T for each fraction)
_NONZERO_WITH_COUNT = [(t, pct) for pct in (0.0, 1 / 32, 5 / 32, 1.0) for t in (32, 64, 128, 256, 512, 1024, 2048)]


def subkernel_cases() -> list[Case]:
    cases = [Case(
        kernel="core/subkernels/find_nonzero_indices",
        name=f"{dt} chunk={chunk}" + (f" columns {w[0]}+{w[1]}" if w else ""), shapes=f"T={t} E={e} top_k={k}",
        entry=f"{LIB}.find_nonzero_indices:find_nonzero_indices",
        reference=f"{LIB}.find_nonzero_indices_torch:find_nonzero_indices_torch_ref",
        inputs=_nonzero_inputs(t, e, k, chunk, dt, w), outputs=("indices", "nonzero_counts"), lnc=2, rtol=0.0,
        atol=0.0, test_file=f"{TESTS}/test_find_nonzero_indices.py") for t, e, k, chunk, dt, w in _NONZERO]
    cases += [Case(
        kernel="core/subkernels/indexed_flatten", name=f"f_len={f}" + (f" rows={n} from {s}" if s is not None else ""),
        shapes=f"T={t} E={e}", entry=f"{LIB}.indexed_flatten:indexed_flatten",
        reference=f"{LIB}.indexed_flatten_torch:indexed_flatten_torch_ref", inputs=_flatten_inputs(t, e, f, n, s),
        outputs=("flattened_array",), lnc=2, rtol=0.0, atol=0.0, test_file=f"{TESTS}/test_indexed_flatten.py")
        for t, e, f, n, s in _FLATTEN]
    cases += [Case(
        kernel="experimental/collectives/topk_reduce", name=f"bf16 from {ranks} ranks", shapes=f"T={t} K={k} H={h}",
        entry=f"{EXP}.topk_reduce:topk_reduce", reference=f"{EXP}.topk_reduce_torch:topk_reduce_torch_ref",
        inputs=_topk_reduce_inputs(t, k, h, ranks), outputs=("out",), lnc=lnc, rtol=5e-2, atol=5e-2,
        note="test module imports experimental.subkernels.topk_reduce; the kernel is in experimental/collectives",
        test_file="test/integration/nkilib/experimental/subkernels/test_topk_reduce.py")
        for lnc, ranks, t, k, h in _TOPK_REDUCE]
    cases += [Case(
        kernel="experimental/benchmark/find_nonzero_indices_with_count", name=f"fp32 {int(t * pct)} non-zero",
        shapes=f"[1,{t}]", entry=f"{BENCH}.find_nonzero_indices_with_count:find_nonzero_indices_with_count",
        reference=f"{__name__}:nonzero_with_count_golden",
        inputs=_sparse_inputs(t, int(t * pct)), outputs=("output",), lnc=2, rtol=0.0, atol=0.0,
        test_file=BENCH_TEST) for t, pct in _NONZERO_WITH_COUNT]
    return cases
