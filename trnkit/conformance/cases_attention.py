"""Conformance cases of nki-library's core/attention kernels, written from their test files.

``test/integration/nkilib/core/attention/test_attention_cte.py``: attention_cte against
``attention_cte_torch_ref`` at rtol 2e-2 / atol 1e-5. Inputs as the test's ``build_attention_cte_input``
draws them: one ``np_random_sample()`` generator (``np.random.seed(0)``, then ``random_sample`` per
tensor in the order q, k, v, k_prior, v_prior, cast to the test dtype), the sink from the same global
state (``uniform(15, 25)``), sequence-packing bounds from ``np.random.rand``. The golden casts the
output to the test dtype and the cached softmax statistics to fp32.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import math
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from . import harness
from .harness import Case

__all__ = ["attention_cases", "attention_cte_golden", "attention_bwd_golden", "cte_rows", "bwd_rows", "read_tables"]

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core/attention"
_DT = {BF16: "bf16", F16: "fp16", F32: "fp32"}


def _cte_inputs(bs: int, bs_kv: int, d: int, dt: np.dtype, sq: int, skv: int, prior: int | None,
                prior_used: int | None, tp_q: bool, tp_k: bool, tp_out: bool, sink: bool, scale: float,
                causal: bool, sw: int, cp: tuple[int, int, bool] | None, cache_softmax: bool,
                packed: int | None) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        np.random.seed(0)
        draw = lambda shape: np.random.random_sample(shape).astype(dt)  # noqa: E731
        q = draw((bs, sq, d) if tp_q else (bs, d, sq))
        k = draw((bs_kv, skv, d) if tp_k else (bs_kv, d, skv))
        v = draw((bs_kv, skv, d))
        k_prior = v_prior = used = None
        if prior is not None:
            k_prior = draw((bs_kv, prior, d) if tp_k else (bs_kv, d, prior))
            v_prior = draw((bs_kv, prior, d))
            used = np.full((1,), prior_used, dtype=np.int32)
        sink_t = np.random.uniform(low=15.0, high=25.0, size=(bs, 1)).astype(F32) if sink else None
        cp_offset = None
        if cp is not None:
            degree, rank, strided = cp
            cp_offset = np.full((1, 1), rank if strided else rank * sq, dtype=np.int32)
        bound_min = bound_max = None
        if packed is not None:
            cuts = np.concatenate(([0], np.sort(np.random.rand(packed - 1)), [1]))
            lens = np.round(np.diff(cuts) * sq).astype(int)
            lens[-1] += sq - lens.sum()
            ends = np.cumsum(lens)
            starts = np.concatenate(([0], ends[:-1]))
            lo, hi = np.zeros(sq, np.int32), np.zeros(sq, np.int32)
            for s, e in zip(starts, ends):
                lo[s:e], hi[s:e] = s, e
            bound_min, bound_max = lo.reshape(sq, 1).astype(F32), hi.reshape(sq, 1).astype(F32)
        return {"q": q, "k": k, "v": v, "scale": scale, "causal_mask": causal, "k_prior": k_prior,
                "v_prior": v_prior, "prior_used_len": used, "sink": sink_t, "sliding_window": sw,
                "tp_q": tp_q, "tp_k": tp_k, "tp_out": tp_out, "cp_offset": cp_offset,
                "global_cp_deg": cp[0] if cp else None, "cp_strided_q_slicing": bool(cp and cp[2]),
                "cache_softmax": cache_softmax, "softmax_dtype": "float32", "mm_out_dtype": "float32",
                "bound_min": bound_min, "bound_max": bound_max}
    return make


# float32 scores one reference call may hold ([rows, keys]; the references keep a few such arrays, masks and
# softmax included): a row above it runs the reference in pieces (per batch entry / query head, then per run of
# query rows), each computed as the whole-row call computes it
REF_CHUNK_BYTES = 1 << 28


def attention_cte_golden(out_dtype: Any = None, chunk_bytes: int = REF_CHUNK_BYTES, **kw: Any) -> dict[str, Any]:
    """The test's golden: ``attention_cte_torch_ref`` in fp32 softmax, the output rounded to the
    test dtype (``out_dtype``), the cached statistics kept fp32. Where its [bs, Sq, Skv] float32 scores
    exceed ``chunk_bytes``, it runs per batch entry and run of query rows (:func:`_cte_ref_pieces`)."""
    import torch

    ref = importlib.import_module(f"{LIB}.attention.attention_cte_torch").attention_cte_torch_ref
    kw.pop("mm_out_dtype", None)
    kw["softmax_dtype"] = torch.float32
    for key in ("bound_min", "bound_max"):  # the test passes these as numpy arrays
        if kw.get(key) is not None:
            kw[key] = kw[key].numpy()
    out = _cte_ref_pieces(ref, kw, chunk_bytes)
    names = ("out", "out_cached_negative_max", "out_cached_sum_reciprocal")
    outs = dict(zip(names, out if kw["cache_softmax"] else (out,)))
    outs["out"] = outs["out"].to(out_dtype).float()
    return outs


def _cte_ref_pieces(ref: Callable[..., Any], kw: dict[str, Any], chunk_bytes: int) -> Any:
    """``ref(**kw)``; when its float32 scores exceed ``chunk_bytes``, the same from calls on one batch entry
    (with its KV batch entry and sink) and a run of 128-multiple query rows at a time, concatenated. A run of
    rows from ``a`` passes the positions the whole call gives those rows: ``cp_offset`` + ``a`` (times the CP
    degree when Q is strided; offset ``a`` without CP) and its rows of the packing bounds; the reference uses
    the offset for nothing else. Each piece's float32 matmuls are smaller ones of the same values: at most
    the last bit of a sum may differ from the whole call's."""
    import torch

    q, tp_q = kw["q"], kw["tp_q"]
    bs, sq = q.shape[0], q.shape[1] if tp_q else q.shape[2]
    used = int(kw["prior_used_len"].item()) if kw.get("k_prior") is not None else 0
    keys = kw["v"].shape[1] + used
    if bs * sq * keys * 4 <= chunk_bytes:
        return ref(**kw)
    group = bs // kw["v"].shape[0]
    n = max(128, chunk_bytes // (keys * 4) // 128 * 128)
    offset = 0 if kw.get("cp_offset") is None else int(kw["cp_offset"].item())
    step = kw["global_cp_deg"] if kw.get("cp_offset") is not None and kw["cp_strided_q_slicing"] else 1
    batches = []
    for b in range(bs):
        kv = slice(b // group, b // group + 1)
        pieces = []
        for a in range(0, sq, n):
            rows = slice(a, min(a + n, sq))
            piece = {**kw, "q": q[b:b + 1, rows] if tp_q else q[b:b + 1, :, rows],
                     "k": kw["k"][kv], "v": kw["v"][kv],
                     "cp_offset": torch.tensor([[offset + a * step]], dtype=torch.int32),
                     "global_cp_deg": kw["global_cp_deg"] if kw.get("cp_offset") is not None else None,
                     "cp_strided_q_slicing": bool(kw.get("cp_offset") is not None and kw["cp_strided_q_slicing"])}
            for key in ("k_prior", "v_prior", "sink"):
                if kw.get(key) is not None:
                    piece[key] = kw[key][kv] if key != "sink" else kw[key][b:b + 1]
            for key in ("bound_min", "bound_max"):
                if kw.get(key) is not None:
                    piece[key] = kw[key][rows]
            out = ref(**piece)
            pieces.append(out if kw["cache_softmax"] else (out,))
        axes = (2 if kw["tp_out"] else 1, 2, 2)  # out [1, Sq, d] ([1, d, Sq]); statistics [1, 128, Sq / 128]
        batches.append([torch.cat([p[i] for p in pieces], dim=axes[i]) for i in range(len(pieces[0]))])
    outs = [torch.cat([b[i] for b in batches], dim=0) for i in range(len(batches[0]))]
    return tuple(outs) if kw["cache_softmax"] else outs[0]


def _cte_ref_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {**inputs, "out_dtype": {BF16: torch.bfloat16, F16: torch.float16, F32: torch.float32}[
        inputs["q"].dtype]}


# -- the tests' tables, read from the checkout -------------------------------------------------------
CTE_TEST = f"{TESTS}/test_attention_cte.py"
BWD_TEST = f"{TESTS}/test_attention_bwd.py"


def read_tables(root: Path, rel_path: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The values of the class-level assignments ``names`` of nki-library's test file ``rel_path``, read from the
    checkout ``root``: each assignment's expression evaluated in order (so one table may name another) with the
    test's dtypes as numpy dtypes (``nl.bfloat16`` -> bfloat16, ...) and ``pytest.param(*row, marks=.., id=..)`` as
    the row's values. The file itself is not imported (its sweep decorators draw from the global numpy state and
    need nki-library's test infrastructure); nothing is copied."""
    tree = ast.parse((root / rel_path).read_text())
    dtypes = types.SimpleNamespace(bfloat16=BF16, float16=F16, float32=F32)
    marks = types.SimpleNamespace(fast=None, xdist_group=lambda *a, **k: None)
    scope: dict[str, Any] = {"nl": dtypes, "np": dtypes, "__builtins__": {"range": range},
                             "pytest": types.SimpleNamespace(param=lambda *row, **_: tuple(row), mark=marks)}
    wanted = set(names)
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if not (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)):
                continue
            name = stmt.targets[0].id
            if name in wanted or name == "_heavy_mark":
                scope[name] = eval(compile(ast.Expression(stmt.value), rel_path, "eval"), scope)
    missing = wanted - scope.keys()
    if missing:
        raise ValueError(f"{rel_path}: no class-level table named {sorted(missing)}")
    return {n: scope[n] for n in names}


# attention_cte's explicit tables: (rows, their column names, the test that runs them, the case-name label, how
# that test sets LNC: "column" = CompilerArgs(logical_nc_config=<the row's vnc_degree / lnc_degree>), a tuple =
# its own parametrize values, 2 = CompilerArgs() on trn2), extra axes the test parametrizes the table over
_CTE_TABLES = (
    ("attention_cte_no_cp_unit_perms", "attention_cte_no_cp_unit_params", "test_attention_cte_no_cp_unit", "no_cp",
     2, ()),
    ("attention_cte_no_cp_vnc_apc_klr_unit_perms", "attention_cte_no_cp_vnc_apc_klr_unit_params",
     "test_attention_cte_no_cp_vnc_apc_klr_unit", "apc", "column", ()),
    # (its vnc_degree column is not passed on: CompilerArgs())
    ("attention_cte_no_cp_vnc_param_unit_perms", "attention_cte_no_cp_vnc_param_unit_params",
     "test_attention_cte_no_cp_vnc_unit", "vnc", 2, ()),
    ("attention_cte_no_cp_vnc_gqa_unit_perms", "attention_cte_no_cp_vnc_gqa_unit_params",
     "test_attention_cte_no_cp_vnc_gqa_unit", "gqa", "column", ()),
    ("attention_cte_no_cp_vnc_barometer_perms", "attention_cte_no_cp_vnc_barameter_params",
     "test_attention_cte_no_cp_vnc_barometer_unit", "barometer", "column", ()),
    ("attention_cte_cp_apc_klr_perms", "attention_cte_cp_apc_klr_params", "test_attention_cte_cp_apc_klr_unit",
     "cp_apc", 2, ("strided",)),
    ("attention_cte_cp_bk_klr_perms", "attention_cte_cp_bk_klr_params", "test_attention_cte_cp_bk_klr_unit",
     "cp_bk", 2, ("strided",)),
    ("attention_cte_cp_gqa_klr_perms", "attention_cte_cp_gqa_klr_params", "test_attention_cte_cp_gqa_klr_unit",
     "cp_gqa", 2, ("strided",)),
    ("attention_cte_cp_barometer_klr_perms", "attention_cte_cp_barometer_klr_params",
     "test_attention_cte_cp_barometer_klr_unit", "cp_barometer", 2, ("strided",)),
    ("attn_cte_sweep_manual_nocp_perms", "attn_cte_sweep_manual_nocp_params", "test_ranged_attn_cte_sweep_nocp_manual",
     "sweep_nocp_manual", (2,), ("cache",)),
    ("attn_cte_sweep_manual_cp_perms", "attn_cte_sweep_manual_cp_params", "test_ranged_attn_cte_sweep_cp_manual",
     "sweep_cp_manual", (1, 2), ("strided", "cache")),
    ("attention_cte_seq_pack_unit_perms", "attention_cte_seq_pack_unit_params", "test_attention_cte_seq_pack_unit",
     "seq_pack", "column", ()),
)
# test_attention_cte.py's run_attention_cte_test: no golden (the kernel only runs) when bs * seqlen_q * (seqlen_kv +
# seqlen_kv_prior) exceeds this (_MAX_BS_TIMES_SEQLEN_QK_VALIDATE, "to avoid OOM during testing")
CTE_VALIDATE_MAX = 4 * 16 * 1024 * 16 * 1024


@dataclasses.dataclass(frozen=True)
class CteRow:
    """One attention_cte test row as its test body passes it to ``run_attention_cte_test``."""

    table: str  # the case-name label of its table
    test: str
    lnc: int
    bs: int
    bs_kv: int
    skv: int
    sq: int
    prior: int | None
    used: int | None
    d: int
    scale: float
    dt: np.dtype
    causal: bool
    tp_q: bool
    tp_k: bool
    tp_out: bool
    sink: bool
    sw: int
    cache: bool
    cp: tuple[int, int, bool] | None  # (degree, rank, strided Q slicing)
    packed: int | None

    @property
    def negative(self) -> bool:
        """The manual sweeps' negative rule: cached softmax needs seqlen_q a multiple of 128."""
        return self.cache and self.sq % 128 != 0

    @property
    def validated(self) -> bool:
        """Whether the test compares the output with its golden (see :data:`CTE_VALIDATE_MAX`)."""
        return self.bs * self.sq * (self.skv + (self.prior or 0)) <= CTE_VALIDATE_MAX

    @property
    def scores(self) -> int:
        """Query x key pairs the kernel visits at most (bs x Sq x (Skv + prior used)): its work, for time estimates."""
        return self.bs * self.sq * (self.skv + (self.used or 0))


def _cte_row(table: str, test: str, lnc: Any, extra: dict[str, Any], r: dict[str, Any]) -> CteRow:
    pick = lambda *names, default=None: next((r[n] for n in names if n in r), default)  # noqa: E731
    bs = r["bs"]
    skv = pick("seqlen_kv", "kv_seqlen", "seqlen")
    cp = (r["cp_degree"], r["cp_rank_id"], extra["strided"]) if "cp_degree" in r else None
    sq = pick("seqlen_q", "q_seqlen_partial", "seqlen", default=skv // cp[0] if cp else None)
    bs_kv = pick("bs_kv", default=bs // r["gqa_factor"] if "gqa_factor" in r else bs)
    return CteRow(
        table=table, test=test, lnc=extra.get("lnc", pick("vnc_degree", "lnc_degree") if lnc == "column" else lnc),
        bs=bs, bs_kv=bs_kv, skv=skv, sq=sq, prior=pick("prior_len", "kv_seqlen_prior", "seqlen_kv_prior"),
        used=pick("prior_used_len", "kv_prior_used_len"), d=r["d"], scale=pick("softmax_scale", default=1.0),
        dt=np.dtype(pick("dtype", default=BF16)), causal=bool(pick("causal_mask", default=True)),
        tp_q=bool(r["tp_q"]), tp_k=bool(pick("tp_k", default=False)), tp_out=bool(r["tp_out"]),
        sink=bool(pick("sink", default=False)), sw=pick("sliding_window", default=0),
        cache=extra.get("cache", table == "sweep_nocp_manual"), cp=cp, packed=pick("n_packed_sequences"))


@functools.lru_cache(maxsize=2)
def cte_rows(root: Path) -> tuple[CteRow, ...]:
    """Every row of attention_cte's twelve explicit tables, as their tests run them (the context-parallel tables
    under both Q slicings, the manual CP sweep under its LNC, slicing and cached-softmax axes), in file order."""
    names = tuple(n for t in _CTE_TABLES for n in t[:2])
    tables = read_tables(root, CTE_TEST, names)
    rows = []
    for perms, params, test, label, lnc, axes in _CTE_TABLES:
        columns = [c.strip() for c in tables[params].split(",")]
        grid = [{}]
        for axis in axes:
            values = {"strided": (False, True), "cache": (False, True) if label == "sweep_cp_manual" else (True,)}
            grid = [{**g, axis: v} for g in grid for v in values[axis]]
        if isinstance(lnc, tuple):
            grid = [{**g, "lnc": n} for g in grid for n in lnc]
        for row in tables[perms]:
            rows += [_cte_row(label, test, lnc, g, dict(zip(columns, row))) for g in grid]
    return tuple(rows)


def _cte_name(r: CteRow) -> str:
    flags = (["causal"] * r.causal + [f"sw={r.sw}"] * bool(r.sw) + ["tp_q"] * r.tp_q + ["tp_k"] * r.tp_k
             + ["tp_out"] * r.tp_out + ["sink"] * r.sink + ["cache_softmax"] * r.cache
             + [f"prior={r.prior}/{r.used}"] * (r.prior is not None)
             + ([f"cp={r.cp[0]} rank={r.cp[1]}" + " strided" * r.cp[2]] if r.cp else [])
             + [f"packed={r.packed}"] * bool(r.packed) + [f"scale={r.scale:g}"] * (r.scale != 1.0))
    return f"{r.table} {_DT[r.dt]} " + " ".join(flags) + (" (must reject)" if r.negative else "")


def _cte_case(r: CteRow) -> Case:
    outputs = ("out", "out_cached_negative_max", "out_cached_sum_reciprocal") if r.cache else ("out",)
    return Case(
        kernel="core/attention/attention_cte", name=_cte_name(r),
        shapes=f"bs={r.bs}/{r.bs_kv} Sq={r.sq} Skv={r.skv} d={r.d}",
        entry=f"{LIB}.attention.attention_cte:attention_cte",
        reference="trnkit.conformance.cases_attention:attention_cte_golden", ref_inputs=_cte_ref_inputs,
        inputs=_cte_inputs(r.bs, r.bs_kv, r.d, r.dt, r.sq, r.skv, r.prior, r.used, r.tp_q, r.tp_k, r.tp_out, r.sink,
                           r.scale, r.causal, r.sw, r.cp, r.cache, r.packed),
        outputs=outputs, lnc=r.lnc, rtol=2e-2, atol=1e-5, negative=r.negative, test_file=CTE_TEST)


def _cte_cases(root: Path) -> list[Case]:
    """One case per distinct row (a row that repeats an earlier one, the same test values run the same way, once)."""
    cases: dict[str, Case] = {}
    for r in cte_rows(root):
        case = _cte_case(r)
        cases.setdefault(f"{case.name}|{case.lnc}|{case.shapes}", case)
    return list(cases.values())


# -- attention_bwd (test_attention_bwd.py) ---------------------------------------------------------
def _bwd_inputs(b: int, hq: int, hkv: int, s: int, d: int, dt: np.dtype, causal: bool, sw: int | None,
                sinks: int, scale: float | None, seqlens: list[int] | None, neg_case: str | None,
                chunk_bytes: int = REF_CHUNK_BYTES) -> Callable[[], dict[str, Any]]:
    """The test's ``generate_inputs``: q, k, v, dy (and the sinks) from one ``default_rng(0)`` normal
    generator in that order, o and lse from nki-library's ``compute_o_lse`` on them (bf16 inputs as
    bf16 torch tensors, mixed precision; one query head at a time above ``chunk_bytes`` of scores,
    :func:`_o_lse`), o rounded to the test dtype."""
    def make() -> dict[str, Any]:
        import torch

        np.random.seed(0)
        rng = np.random.default_rng(0)
        draw = lambda shape: rng.normal(size=shape).astype(dt)  # noqa: E731
        seq = sum(seqlens) if seqlens else s
        lo = hi = None
        if seqlens:
            cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
            lo, hi = np.zeros(seq, F32), np.zeros(seq, F32)
            for i in range(len(seqlens)):
                lo[cu[i]:cu[i + 1]], hi[cu[i]:cu[i + 1]] = cu[i], cu[i + 1]
        q, k, v, dy = draw((b, hq, d, seq)), draw((b, hkv, d, seq)), draw((b, hkv, d, seq)), draw((b, hq, d, seq))
        sink_t = None
        if sinks:
            sink_t = np.repeat(draw((1, hq) if sinks == 1 else (1, hq, sinks)), b, axis=0)
        torch_of = lambda x: (torch.from_numpy(x.astype(F32)).to(torch.bfloat16) if x.dtype == BF16  # noqa: E731
                              else torch.from_numpy(x))
        o, lse = _o_lse(torch_of(q), torch_of(k), torch_of(v), causal, torch_of(sink_t) if sinks else None,
                        chunk_bytes, softmax_scale=scale,
                        sliding_window=sw if sw is not None else -1 if seqlens else None,
                        bound_min=torch.from_numpy(lo) if lo is not None else None,
                        bound_max=torch.from_numpy(hi) if hi is not None else None)
        out = {"q_ref": q, "k_ref": k, "v_ref": v, "o_ref": o.float().numpy().astype(dt), "dy_ref": dy,
               "lse_ref": lse.float().numpy(), "sinks_ref": sink_t, "use_causal_mask": causal,
               "mixed_precision": True, "softmax_scale": scale,
               "sliding_window": sw if sw is not None else -1 if seqlens else None,
               "bound_min": lo, "bound_max": hi}
        if neg_case == "only_bound_min":
            out.pop("bound_max")
        elif neg_case == "wrong_dtype":
            out["bound_min"], out["bound_max"] = lo.astype(np.int32), hi.astype(np.int32)
        return out
    return make


def _o_lse(q: Any, k: Any, v: Any, causal: bool, sinks: Any, chunk_bytes: int, **kw: Any) -> tuple[Any, Any]:
    """nki-library's ``compute_o_lse(q, k, v, causal, mixed_precision=True, sinks=sinks, **kw)``'s o and lse; where
    its [B, Hq, S, S] float32 scores exceed ``chunk_bytes``, from one call per query head (with its KV head and
    sinks: every step of the function is per head), concatenated over the heads."""
    import torch

    fn = _lib_attr("attention.attention_bwd_torch:compute_o_lse")
    b, hq, _, s = q.shape
    if b * hq * s * s * 4 <= chunk_bytes:
        return fn(q, k, v, causal, True, sinks=sinks, **kw)[:2]
    group = hq // k.shape[1]
    parts = [fn(q[:, h:h + 1], k[:, h // group:h // group + 1], v[:, h // group:h // group + 1], causal, True,
                sinks=None if sinks is None else sinks[:, h:h + 1], **kw)[:2] for h in range(hq)]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)


def attention_bwd_golden(chunk_bytes: int = REF_CHUNK_BYTES, **kw: Any) -> dict[str, Any]:
    """The test's golden, nki-library's ``attention_bwd_torch_ref(**kw)``; where its [B, Hq, S, S] float32 scores
    exceed ``chunk_bytes``, from one call per query head (with its KV head, o, lse, dy and sinks), dq and dsinks
    concatenated over the heads, dk and dv (each head's, as the whole call computes them before its GQA sum)
    summed over each KV head's query heads by the module's own ``reduce_kv_grad``."""
    import torch

    ref = _lib_attr("attention.attention_bwd_torch:attention_bwd_torch_ref")
    q = kw["q_ref"]
    b, hq, _, s = q.shape
    if b * hq * s * s * 4 <= chunk_bytes:
        return ref(**kw)
    hkv = kw["k_ref"].shape[1]
    group = hq // hkv
    parts = []
    for h in range(hq):
        heads, kv = slice(h, h + 1), slice(h // group, h // group + 1)
        piece = {**kw, "q_ref": q[:, heads], "dy_ref": kw["dy_ref"][:, heads], "o_ref": kw["o_ref"][:, heads],
                 "lse_ref": kw["lse_ref"][:, heads], "k_ref": kw["k_ref"][:, kv], "v_ref": kw["v_ref"][:, kv]}
        if kw.get("sinks_ref") is not None:
            piece["sinks_ref"] = kw["sinks_ref"][:, heads]
        parts.append(ref(**piece))
    reduce = _lib_attr("attention.attention_bwd_torch:reduce_kv_grad")
    out = {"out_dq_ref": torch.cat([p["out_dq_ref"] for p in parts], dim=1)}
    for name, like in (("out_dk_ref", "k_ref"), ("out_dv_ref", "v_ref")):
        out[name] = reduce(torch.cat([p[name] for p in parts], dim=1), hkv, kw["mixed_precision"]).to(kw[like].dtype)
    if kw.get("sinks_ref") is not None:
        out["out_dsinks_ref"] = torch.cat([p["out_dsinks_ref"] for p in parts], dim=1)
    return out


def _lib_attr(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(f"{LIB}.{module}"), attr)


# test_attention_bwd.py's tables: test_attention_bwd_fast's (base cases: S=2048 d=128, softmax_scale 1.0 when causal,
# and its negative cases), test_attention_bwd's (the model configurations, softmax_scale None), and
# test_attention_bwd_sequence_packing's (batch 1, softmax_scale None)
BWD_TABLES = ("fast_test_cases", "attention_bwd_test_cases", "sequence_packing_test_cases")


@functools.lru_cache(maxsize=2)
def bwd_rows(root: Path) -> dict[str, tuple[tuple, ...]]:
    """attention_bwd's three tables, read from the checkout: (batch, q heads, kv heads, seq_len, head_dim, dtype,
    causal, sliding_window, sinks) rows for the first two, (q heads, kv heads, head_dim, dtype, sequence lengths,
    causal, sinks, sliding_window, negative case) for sequence packing."""
    names = ("test_cases_4K", "test_cases_8K", "test_cases_misc", "test_cases_sliding_window", "base_test_cases",
             "negative_test_cases", *BWD_TABLES)
    tables = read_tables(root, BWD_TEST, names)
    return {n: tuple(tuple(r) for r in tables[n]) for n in BWD_TABLES}


def _bwd_case(name: str, b: int, hq: int, hkv: int, s: int, d: int, dt: np.dtype, causal: bool, sw: int | None,
              sinks: int, scale: float | None, seqlens: list[int] | None, neg_case: str | None, lnc: int,
              negative: bool) -> Case:
    outputs = ("out_dq_ref", "out_dk_ref", "out_dv_ref") + (("out_dsinks_ref",) if sinks else ())
    return Case(
        kernel="core/attention/attention_bwd", name=name + (" (must reject)" if negative else ""),
        shapes=f"b={b} heads={hq}/{hkv} S={s} d={d}", entry=f"{LIB}.attention.attention_bwd:attention_bwd",
        reference="trnkit.conformance.cases_attention:attention_bwd_golden",
        inputs=_bwd_inputs(b, hq, hkv, s, d, dt, causal, sw, sinks, scale, seqlens, neg_case),
        outputs=outputs, lnc=lnc, rtol=2e-2, atol=1e-5, negative=negative,
        test_file=BWD_TEST)


def _bwd_cases(root: Path) -> list[Case]:
    tables = bwd_rows(root)
    cases = []
    for table, test in (("fast_test_cases", "fast"), ("attention_bwd_test_cases", "full")):
        for b, hq, hkv, s, d, dt, causal, sw, sinks in tables[table]:
            dt = np.dtype(dt)
            negative = (s % 128 != 0 or hq % hkv != 0 or d % math.ceil(d / 128) != 0
                        or (sw is not None and not causal))
            scale = (1.0 if causal else None) if test == "fast" else None
            name = (f"{test} {_DT[dt]}" + " causal" * causal + f" sw={sw}" * (sw is not None)
                    + f" sinks={sinks}" * bool(sinks))
            cases.append(_bwd_case(name, b, hq, hkv, s, d, dt, causal, sw, sinks, scale, None, None,
                                   2 if b * hkv % 2 == 0 else 1, negative))
    for hq, hkv, d, dt, seqlens, causal, sinks, sw, neg in tables["sequence_packing_test_cases"]:
        dt = np.dtype(dt)
        name = (f"packed {_DT[dt]} seqs={'+'.join(map(str, seqlens))}" + " causal" * causal
                + f" sw={sw}" * (sw is not None) + f" sinks={sinks}" * bool(sinks) + f" {neg}" * bool(neg))
        cases.append(_bwd_case(name, 1, hq, hkv, sum(seqlens), d, dt, causal, sw, sinks, None, list(seqlens), neg,
                               2 if hkv % 2 == 0 else 1, neg is not None))
    return cases


def attention_cases(root: Path | None = None) -> list[Case]:
    """Every row of attention_cte's and attention_bwd's test tables in the checkout ``root`` (default
    :func:`harness.nkilib_root`); none without one."""
    root = root if root is not None else harness.nkilib_root()
    return [] if root is None else _cte_cases(root) + _bwd_cases(root)
