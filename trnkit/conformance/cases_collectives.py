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

__all__ = ["collective_cases", "gathered", "matmul_columns", "summed", "gathered_rows", "scattered_sums",
           "exchanged", "own_slice", "batch_shard"]

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
    return cases + test_collectives_cases()


def _fgcc_inputs(m: int, k: int, n: int, tp: int) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        lhs = np.random.randn(m * tp, k).astype(BF16)
        rhs = np.random.randn(k, n).astype(BF16)
        w = n // tp
        return {"ranks": [{"lhs": lhs[r * m:(r + 1) * m], "rhs": np.ascontiguousarray(rhs[:, r * w:(r + 1) * w]),
                           "tp_degree": tp, "num_groups": 1, "force_hbm_cc": False} for r in range(tp)]}
    return make


# -- test_collectives.py: the kernels its test module defines, run from the checkout's test file -------
COLL_TEST = f"{TESTS}/test_collectives.py"


def _same_on_every_rank(n: int, make: Callable[[], dict[str, Any]]) -> Callable[[], dict]:
    def inputs() -> dict[str, Any]:
        kw = make()
        return {"ranks": [dict(kw) for _ in range(n)]}
    return inputs


def _group(n: int) -> Any:
    return importlib.import_module("nki.collectives").ReplicaGroup([list(range(n))])


def summed(ranks: list[dict[str, Any]], **_: Any) -> dict[str, np.ndarray]:
    """all_reduce (add): every rank holds the sum of all ranks' inputs."""
    total = sum(_np(r["input"]) for r in ranks)
    return {"out": np.stack([total] * len(ranks))}


def gathered_rows(ranks: list[dict[str, Any]], **_: Any) -> dict[str, np.ndarray]:
    """all_gather along dim 0: every rank holds all inputs concatenated in rank order."""
    return {"out": gathered(ranks, axis=0, key="input")["result"]}


def scattered_sums(ranks: list[dict[str, Any]], **_: Any) -> dict[str, np.ndarray]:
    """reduce_scatter (add, dim 0): rank ``r`` holds chunk ``r`` of the sum of all inputs."""
    chunks = np.split(sum(_np(r["input"]) for r in ranks), len(ranks), axis=0)
    return {"out": np.stack(chunks)}


def exchanged(ranks: list[dict[str, Any]], **_: Any) -> dict[str, np.ndarray]:
    """all_to_all (dim 0): rank ``r`` holds chunk ``r`` of every rank's input, in rank order."""
    n = len(ranks)
    parts = [np.split(_np(r["input"]), n, axis=0) for r in ranks]
    return {"out": np.stack([np.concatenate([p[r] for p in parts]) for r in range(n)])}


def own_slice(ranks: list[dict[str, Any]], **_: Any) -> dict[str, np.ndarray]:
    """rank_id as a DMA scalar offset: rank ``r`` copies ``in_tensor[r]``."""
    return {"out": np.stack([_np(kw["in_tensor"])[r] for r, kw in enumerate(ranks)])}


def batch_shard(ranks: list[dict[str, Any]], **_: Any) -> dict[str, np.ndarray]:
    """attn_q_batch_shard: rank ``r`` of DP group ``g = r // G`` holds the heads of its group's ranks
    (all-gathered along dim 0) for its own batch slice ``r % G`` of ``B / G`` rows."""
    out = []
    for r, kw in enumerate(ranks):
        g = kw["gqa_group_size"]
        heads = np.concatenate([_np(ranks[p]["input"]) for p in range(r // g * g, (r // g + 1) * g)])
        nbsd = kw["layout"] == "NBSd"
        b = (heads.shape[1] if nbsd else heads.shape[1]) // g
        b0 = (r % g) * b
        if nbsd:  # [G*n, B, S, d] -> [G*n, B/G, S, d]
            out.append(heads[:, b0:b0 + b])
        else:  # [G*d, B, 1, S] -> [G, d, B/G, S]
            d = heads.shape[0] // g
            out.append(heads.reshape(g, d, heads.shape[1], heads.shape[3])[:, :, b0:b0 + b])
    return {"q_out": np.stack(out)}


def _with_test_layout(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``layout`` given by name, passed as the test module's own ``AttnQBatchShardLayout`` member (the
    kernel compares it with that enum); the jit kernel's body runs in the launch's programs."""
    body = getattr(kernel, "fn", kernel)
    layouts = body.__globals__["AttnQBatchShardLayout"]

    def wrapper(**kw: Any) -> Any:
        return body(**{**kw, "layout": layouts[kw["layout"]]})
    return wrapper


def _batch_shard_inputs(n: int, g: int, heads: int, batch: int, layout: str, input_rank: bool) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        s, d = 1, 64
        nbsd = layout == "NBSd"
        q = np.random.randn(n, batch, s, d) if nbsd else np.random.randn(n, d, batch, s)
        q = q.astype(np.float32)
        rg = importlib.import_module("nki.collectives").ReplicaGroup(
            [[i * g + j for j in range(g)] for i in range(n // g)])
        buf = (g, heads, batch, s, d) if nbsd else (g, d, batch, heads, s)
        ranks = []
        for r in range(n):
            kw = {"input": q[r:r + 1] if nbsd else q[r:r + 1].reshape(d, batch, heads, s),
                  "iota_workers": np.array([(p % g) * (batch // g) for p in range(n)], np.int32).reshape(1, n),
                  "gathered_buf": np.zeros(buf, np.float32), "gqa_group_size": g, "replica_group": rg,
                  "layout": layout}
            if input_rank:
                kw["rank_id_in"] = np.array([[r]], np.int32)
            ranks.append(kw)
        return {"ranks": ranks}
    return make


def _seeded(shape: tuple[int, ...]) -> np.ndarray:
    np.random.seed(42)
    return np.random.randn(*shape).astype(np.float32)


def test_collectives_cases() -> list[Case]:
    """Every enabled row of ``test_collectives.py`` (its TP64 batch-shard row needs 64 devices and is
    disabled in the test itself). The kernels come from the test file; the goldens above are written
    from the test's golden generators."""
    kernel = "experimental/collectives/test_collectives"
    tol = {"rtol": 1e-3, "atol": 1e-3, "test_file": COLL_TEST, "postprocess": _flat_compare}
    cases = []
    for n, lnc in ((2, 2), (2, 1)):
        cases += [
            Case(kernel=kernel, name="all_reduce add fp32", shapes=f"[128,512] ranks={n}",
                 entry=f"{COLL_TEST}:all_reduce_hbm_kernel", reference=f"{HERE}:summed",
                 inputs=_same_on_every_rank(n, lambda n=n: {"input": _seeded((128, 512)), "replica_group": _group(n)}),
                 outputs=("out",), lnc=lnc, ranks=n, **tol),
            Case(kernel=kernel, name="all_gather dim 0 fp32", shapes=f"[128,512] ranks={n}",
                 entry=f"{COLL_TEST}:all_gather_hbm_kernel", reference=f"{HERE}:gathered_rows",
                 inputs=_sliced(F32, (n, 128, 512), lambda x, r, n=n: {"input": x[r], "num_ranks": n}, n,
                                lambda n=n: {"replica_group": _group(n)}),
                 outputs=("out",), lnc=lnc, ranks=n, **tol),
            Case(kernel=kernel, name="reduce_scatter add dim 0 fp32", shapes=f"[{128 * n},512] ranks={n}",
                 entry=f"{COLL_TEST}:reduce_scatter_hbm_kernel", reference=f"{HERE}:scattered_sums",
                 inputs=_sliced(F32, (n, 128 * n, 512), lambda x, r, n=n: {"input": x[r], "num_ranks": n}, n,
                                lambda n=n: {"replica_group": _group(n)}),
                 outputs=("out",), lnc=lnc, ranks=n, **tol),
            Case(kernel=kernel, name="rank_id scalar_offset fp32", shapes=f"[{n},128,512] ranks={n}",
                 entry=f"{COLL_TEST}:rank_id_kernel", reference=f"{HERE}:own_slice",
                 inputs=_same_on_every_rank(n, lambda n=n: {"in_tensor": _seeded((n, 128, 512))}),
                 outputs=("out",), lnc=lnc, ranks=n, **tol),
            Case(kernel=kernel, name="rank_id via SBUF lookup fp32", shapes=f"[{n},128,64] ranks={n}",
                 entry=f"{COLL_TEST}:dma_copy_rank_id_kernel", reference=f"{HERE}:own_slice",
                 inputs=_same_on_every_rank(n, lambda n=n: {
                     "in_tensor": _seeded((n, 128, 64)), "rank_id_lookup": np.arange(n, dtype=np.int32).reshape(1, n)}),
                 outputs=("out",), lnc=lnc, ranks=n, **tol),
        ]
    for n, lnc in ((4, 2), (8, 1)):  # all_to_all "requires Mesh algorithm: 4 ranks lnc2 or 8 ranks lnc1"
        cases.append(Case(
            kernel=kernel, name="all_to_all dim 0 fp32", shapes=f"[{128 * n},512] ranks={n}",
            entry=f"{COLL_TEST}:all_to_all_hbm_kernel", reference=f"{HERE}:exchanged",
            inputs=_same_on_every_rank(n, lambda n=n: {"input": _seeded((128 * n, 512)), "replica_group": _group(n)}),
            outputs=("out",), lnc=lnc, ranks=n, **tol))
    for layout in ("NBSd", "dBnS"):
        for input_rank in (False, True):
            cases.append(Case(
                kernel=kernel, name=f"attn_q_batch_shard TP2DP2 {layout} {'input' if input_rank else 'ncc'}_rank",
                shapes="ranks=4 G=2 heads=1 B=8 S=1 d=64",
                entry=f"{COLL_TEST}:attn_q_batch_shard", reference=f"{HERE}:batch_shard",
                inputs=_batch_shard_inputs(4, 2, 1, 8, layout, input_rank), outputs=("q_out",), lnc=2, ranks=4,
                wrap_kernel=_with_test_layout, **tol))
    return cases
