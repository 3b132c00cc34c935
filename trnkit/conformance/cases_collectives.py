"""Conformance cases of nki-library's experimental/collectives kernels, on several simulated devices.

Written from ``test/integration/nkilib/experimental/collectives/``: ``test_fg_allgather.py``
(fine_grained_allgather), ``test_sb2sb_allgather.py`` (allgather_sb2sb, allgather_sb2sb_tiled) and
``test_fgcc.py`` (allgather_compute_matmul), at their enabled parameter rows. Each runs on
``collective_ranks`` devices with ``nki.collectives.run_ranks`` (harness ``Case.ranks``); inputs as the
tests build them (``np.random.seed(42)``, one global ``randn`` tensor sliced per rank). The tests'
goldens live in their test modules (which need nki-library's test infrastructure), so they are
written here from the tests: :func:`gathered` and :func:`matmul_columns`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["collective_cases", "gathered", "matmul_columns"]

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
EXP = "nkilib_src.nkilib.experimental.collectives"
TESTS = "test/integration/nkilib/experimental/collectives"
_DT = {BF16: "bf16", F16: "fp16", F32: "fp32"}
HERE = "trnkit.conformance.cases_collectives"


def _np(v: Any) -> np.ndarray:
    return v.float().numpy() if hasattr(v, "numpy") else np.asarray(v, dtype=np.float32)


def gathered(ranks: list[dict[str, Any]], axis: int = 0, key: str = "lhs", **_: Any) -> dict[str, np.ndarray]:
    """Every rank's result is all ranks' inputs concatenated along ``axis`` (stacked per rank)."""
    full = np.concatenate([_np(r[key]) for r in ranks], axis=axis)
    return {"result": np.stack([full] * len(ranks))}


def _gather_columns(ranks: list[dict[str, Any]], **_: Any) -> dict[str, np.ndarray]:
    return gathered(ranks, axis=1, key="inp")


def matmul_columns(ranks: list[dict[str, Any]], **_: Any) -> dict[str, np.ndarray]:
    """fgcc: the full product of the row-gathered lhs, each rank's column shard of it."""
    lhs = np.concatenate([_np(r["lhs"]) for r in ranks])
    return {"result": np.stack([lhs @ _np(r["rhs"]) for r in ranks])}


def _flat_compare(inputs: dict, actual: dict, expected: dict) -> tuple[dict, dict]:
    """The test framework compares elements in order: the kernel's result layout flattened per rank."""
    return ({k: v.reshape(expected[k].shape) for k, v in actual.items()}, expected)


def _sliced(dt: np.dtype, shape: tuple[int, ...], per_rank: Callable[[np.ndarray, int], dict], n: int,
            extra: Callable[[], dict] | None = None) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        x = np.random.randn(*shape).astype(dt)
        more = extra() if extra else {}
        return {"ranks": [{**per_rank(x, r), **more} for r in range(n)]}
    return make


def _replica_group(n: int) -> Callable[[], dict]:
    return lambda: {"replica_groups": importlib.import_module("nki.collectives").ReplicaGroup([list(range(n))])}


def collective_cases() -> list[Case]:
    cases = []
    m, k, tp = 1024, 4096, 4
    cases.append(Case(
        kernel="experimental/collectives/fg_allgather", name="ring all-gather bf16", shapes=f"m={m} K={k} tp={tp}",
        entry=f"{EXP}.fg_allgather:fine_grained_allgather", reference=f"{HERE}:gathered",
        inputs=_sliced(BF16, (m * tp, k), lambda x, r: {"lhs": x[r * m:(r + 1) * m], "tp_degree": tp,
                                                        "num_groups": 1, "force_hbm_cc": False}, tp),
        outputs=("result",), lnc=2, ranks=tp, rtol=1e-3, atol=1e-3, postprocess=_flat_compare,
        test_file=f"{TESTS}/test_fg_allgather.py"))
    for entry, rows in (("allgather_sb2sb", [(128, 512, BF16, 8, 1), (64, 1024, BF16, 8, 1), (128, 2048, BF16, 8, 1),
                                             (96, 512, BF16, 16, 1), (128, 512, F32, 8, 1), (64, 1024, F16, 8, 1),
                                             (128, 256, BF16, 64, 1), (128, 256, BF16, 32, 1),
                                             (128, 384, BF16, 16, 1)]),
                        ("allgather_sb2sb_tiled", [(128, 512, BF16, 4, 2), (64, 1024, BF16, 4, 2),
                                                   (256, 512, BF16, 8, 1),
                                                   (256, 512, BF16, 4, 2), (512, 1024, BF16, 8, 1),
                                                   (512, 1024, BF16, 8, 2), (256, 512, F32, 8, 1),
                                                   (512, 1024, F16, 4, 2), (256, 512, BF16, 8, 2)])):
        for rows_, cols, dt, n, lnc in rows:
            cases.append(Case(
                kernel="experimental/collectives/sb2sb_allgather", name=f"{entry} {_DT[dt]}",
                shapes=f"m={rows_} k={cols} tp={n}", entry=f"{EXP}.sb2sb_allgather:{entry}",
                reference=f"{HERE}:_gather_columns",
                inputs=_sliced(dt, (n, rows_, cols), lambda x, r, n=n: {"inp": x[r], "tp_degree": n}, n,
                               _replica_group(n)),
                outputs=("result",), lnc=lnc, ranks=n, rtol=1e-3, atol=1e-3, postprocess=_flat_compare,
                test_file=f"{TESTS}/test_sb2sb_allgather.py"))
    n_cols = 4096
    cases.append(Case(
        kernel="experimental/collectives/fgcc", name="all-gather + matmul bf16",
        shapes=f"m={m} K={k} N={n_cols} tp={tp}",
        entry=f"{EXP}.fgcc:allgather_compute_matmul", reference=f"{HERE}:matmul_columns",
        inputs=_fgcc_inputs(m, k, n_cols, tp), outputs=("result",), lnc=2, ranks=tp, rtol=1e-2, atol=1e-2,
        postprocess=_flat_compare, test_file=f"{TESTS}/test_fgcc.py"))
    return cases


def _fgcc_inputs(m: int, k: int, n: int, tp: int) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        lhs = np.random.randn(m * tp, k).astype(BF16)
        rhs = np.random.randn(k, n).astype(BF16)
        w = n // tp
        return {"ranks": [{"lhs": lhs[r * m:(r + 1) * m], "rhs": np.ascontiguousarray(rhs[:, r * w:(r + 1) * w]),
                           "tp_degree": tp, "num_groups": 1, "force_hbm_cc": False} for r in range(tp)]}
    return make
