"""Token counts reduced where CPU time forces it (issue #22: "token counts reduced only where CPU time forces it,
and said"): the model-config rows too costly to run on the interpreter in full, run with fewer tokens on the
same kernel route.

The rule (docs/interpreter.md, "Reduced rows"):

- A model-config row whose estimated whole-case CPU (:func:`estimate_cpu_s`: inputs, reference and interpreter,
  one core) exceeds the cap (:data:`CAP_S`, 60 s) is *reduced*: its token counts are lowered, in a fixed order,
  to the largest values whose estimate fits the cap and whose *route* is the full row's (where none fits, to the
  smallest on the route, its estimate still over the cap, said in its note). Only
  ``attention_block_tkg`` rows are reduced: the cached context S_ctx first (S_max_ctx with it), then the batch B.
  The other families' rows over the cap (``moe_tkg``, ``moe_block_tkg``, ``qkv_cte``) cost their weights, not their
  tokens (the fit grows as T^0.24, (B x S)^0.2-0.35, and falls short of the cap at one token for most), and no route
  is derived for them here: they stay not run.
- Memory: the reduced shape must also keep the row's estimated peak resident memory (:func:`estimate_peak_gb`)
  within :data:`MEM_CAP_GB`, so that it runs under the conformance runner's 8 GB cap; a row within the CPU cap is
  not reduced for memory alone (the issue allows fewer tokens where CPU time forces them).
- The route (:func:`attention_route`) is every shape predicate the kernel's code branches on, read off nki-library's
  source (each names the function and condition it comes from). A reduced shape must give every predicate the value
  the full shape gives; where none below the full shape does, the row is not reduced (:func:`reduction` says why)
  and stays "not run: CPU" with its estimate.
- The reduced case (tier :data:`~trnkit.conformance.harness.REDUCED`: ``--tier reduced``, listed after the
  model-config cases) keeps the full row's name with ``reduced`` before ``model_config`` and records both shapes
  (``S_ctx=131072->24576/131072->24576``): its case id is its own, never the full row's, and the CSV and the docs
  count reduced rows apart from the full ones.
- :func:`route_signature` runs a case's kernel on its zero inputs and returns the set of nki-library source lines it
  executed and the instruction kinds it issued: the tests check that a reduced row and its full row (where the full
  one is affordable) give the same signature, i.e. take the same branches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .golden_chunk import block_golden_chunk, kvdp_golden_chunk
from .harness import MODEL_CONFIG, REDUCED, Case

__all__ = ["CAP_S", "MEM_CAP_GB", "REDUCED", "Reduction", "attention_route", "estimate_cpu_s", "estimate_peak_gb",
           "reduced_case", "reduced_row", "reduction", "route_signature"]

CAP_S = 60.0  # whole-case CPU seconds above which a row is reduced

# -- the estimate ----------------------------------------------------------------------------------------------
# log(CPU s) = c0 + sum_k c_k log(size_k) (+ c_fp8, + c_all_experts), ridge-fitted (lambda 0.3) on the whole-case
# child CPU of 754 model-config rows run on this machine by the conformance runners of 2026-12-04/05
# (/tmp/confrun{4,5,6,7}/peaks.txt: inputs, reference and interpreter, niced); rms error of the log on those rows:
# attention_block_tkg 0.52 (279 rows), moe_block_tkg 0.29 (129), moe_tkg 0.41 (173), mlp_tkg 0.31 (118), qkv_cte
# 0.38 (55): a factor of 1.3-1.7
SIZES = {"attention_block_tkg": ("B", "q_heads", "S_ctx", "H", "d", "ranks"),
         "moe_block_tkg": ("B", "S", "H", "I", "Eloc", "k"), "moe_tkg": ("T", "H", "I", "E"),
         "mlp_tkg": ("B", "S", "H", "I"), "qkv_cte": ("S", "H", "heads", "d")}
# (c0, one per SIZES entry, fp8, all experts)
COEF = {"attention_block_tkg": (-10.8203, 0.6129, 0.2697, 0.598, 0.8613, -0.4666, 0.6145, 0.397, 0.0),
        "moe_block_tkg": (-9.9883, 0.2075, 0.1799, 0.0901, 1.0656, 1.1505, 0.217, 0.3131, 0.1772),
        "moe_tkg": (-19.5444, 0.2404, 1.5102, 0.877, 1.1434, 0.0, -0.1679),
        "mlp_tkg": (-11.4081, 0.235, 0.3513, 0.7828, 0.6368, -0.1595, 0.0),
        "qkv_cte": (-12.1852, 0.9189, 0.7482, 0.4446, -0.2197, 0.0, 0.0)}


def _sizes(shapes: str) -> dict[str, str]:
    return dict(re.findall(r"([A-Za-z_]+)=([0-9/x+]+)", shapes))


def _first(v: str) -> int:
    return int(re.split(r"[/x+]", v)[0])


def estimate_cpu_s(kernel: str, name: str, shapes: str) -> float:
    """The estimated whole-case CPU seconds of a model-config row (see :data:`COEF`); ``shapes`` as the case
    writes them."""
    fam = kernel.rpartition("/")[2]
    coef = COEF[fam]
    d = _sizes(shapes)
    x = [1.0]
    for k in SIZES[fam]:
        if k == "Eloc":
            v = int(d.get("E", "1/1").split("/")[-1])
        else:
            v = _first(d[k]) if k in d else 1
        x.append(math.log(v))
    x.append(1.0 if " fp8" in " " + name or "x fp8" in name else 0.0)
    x.append(1.0 if "all experts" in name else 0.0)
    return math.exp(sum(a * b for a, b in zip(coef, x)))


# -- the memory estimate -------------------------------------------------------------------------------------------
# An attention_block_tkg row's peak anonymous resident memory (GB; the runner's cap is on it) is linear in the bytes
# of its large arrays: m0 + m1 raw [one device] + m2 raw [KVDP] + m3 gold + m4 gold [STATIC fp8] + m5 weights
# + m6 ranks x gold [KVDP] + m7 cache32 [one device], where raw is the K and V caches as drawn (bf16, or fp8 with
# kv_quant; KV-data-parallel rows hold the ranks' slices too), gold one reference call's K broadcast over a rank's q
# heads in float32 (batch rows per call: the golden's chunk, else the whole batch), weights the ranks' Q weights in
# float32, the seventh term the ranks' goldens, and cache32 one reference call's K and V caches in float32 (a
# one-device row whose golden no chunk fits runs its whole batch at once). Fitted (non-negative least squares on
# relative error; rows stopped at the cap counted as at least 8 GB) on the peaks of 341 attention_block_tkg rows
# that ran to a result, and 12 stopped at 8 GB, by the conformance runners of 2026-12-04/06
# (/tmp/confrun{4..9}/peaks.txt, over8g.txt): estimate / measured 0.51-1.69 (rms of the log 0.22) on the 60 rows
# over 1.5 GB, 0.57-1.54 (0.17) below.
MEM_COEF = (0.292, 0.424, 2.555, 0.934, 0.186, 2.622, 0.162, 1.896)
MEM_CAP_GB = 6.0  # estimated peak a reduced row may reach: the runner's 8 GB over e^(1.3 x 0.22)


def _lnc_sharding(b: int, q: int, s_tkg: int, s_ctx: int, lnc: int = 2) -> tuple[bool, bool]:
    """attention_tkg_utils' ``is_batch_sharded`` / ``is_s_prior_sharded`` (``_get_lnc_sharding``, LNC 2 only): the
    batch when it is even and holds more than pmax query rows (or S_prior is under 2 x pmax), else S_prior from
    2 x pmax up."""
    bs = lnc > 1 and b % 2 == 0 and (b * q * s_tkg > P_MAX or s_ctx < 2 * P_MAX)
    return bs, lnc > 1 and not bs and s_ctx >= 2 * P_MAX


def estimate_peak_gb(kernel: str, name: str, shapes: str) -> float:
    """The estimated peak resident memory (GB) of an ``attention_block_tkg`` case (see :data:`MEM_COEF`), its
    golden's batch chunk as ``cases_transformer`` chooses it; ``shapes`` as the case writes them (reduced values
    alone)."""
    if not kernel.endswith("/attention_block_tkg"):
        raise ValueError(f"reduce.estimate_peak_gb: {kernel}: only attention_block_tkg rows have a memory estimate")
    d = _sizes(shapes)
    b, q, s_ctx, dh, h = (_first(d[k]) for k in ("B", "q_heads", "S_ctx", "d", "H"))
    s_tkg, ranks = _first(d.get("S", "1")), _first(d.get("ranks", "1"))
    kv_bytes = 1 if " kv_quant" in f" {name}" else 2
    sharded = lambda n, q_, s_, sp, _p: _lnc_sharding(n, q_, s_, sp)[1]  # noqa: E731
    if ranks > 1:
        chunk = kvdp_golden_chunk(b, b // ranks, q, s_tkg, s_ctx, dh, sharded)
    else:
        big = "block_len=" in name and 2 * b * s_ctx * dh * kv_bytes > 1 << 30
        chunk = block_golden_chunk(b, q, s_tkg, s_ctx, sharded) if big else 0
    raw = 2 * b * s_ctx * dh * kv_bytes / 1e9
    gold = (chunk or b) * q * s_ctx * dh * 4 / 1e9
    kvdp = ranks > 1
    cache32 = 2 * (chunk or b) * s_ctx * dh * 4 / 1e9 * (not kvdp)
    x = (1.0, raw * (not kvdp), raw * kvdp, gold, gold * name.startswith("fp8 static"), ranks * h * q * dh * 4 / 1e9,
         ranks * gold * kvdp, cache32)
    return sum(a * v for a, v in zip(MEM_COEF, x))


# -- the routes --------------------------------------------------------------------------------------------------
P_MAX = 128  # nl.tile_size.pmax
PSUM_BANKS = 8  # TileConstants.psum_b_max (core/attention/attention_tkg_utils.py)
FA_TILE = 8 * 1024  # _FA_TILE_SIZE (attention_tkg_utils.py): flash attention's threshold and tile over s_prior
BATCH_TILE_BUDGET = 16 * 1024 * 1024  # _BATCH_TILE_SBUF_BUDGET (attention_tkg_utils.py)


def attention_route(b: int, q: int, s_ctx: int, s_tkg: int, ranks: int, lnc: int, block_len: int,
                    fa_tiling: bool = True, k_transposed: bool = False) -> tuple[tuple[str, Any], ...]:
    """The shape predicates ``attention_block_tkg`` (nki-library d2ad3a5) and the ``attention_tkg`` it calls branch
    on, for batch ``b``, q heads ``q`` (a rank's, with KVDP), context ``s_ctx``, ``s_tkg`` new tokens, ``ranks``
    KV-data-parallel devices (1: none), ``lnc`` cores and a block cache of ``block_len`` (0: flat): (name, value)
    pairs; two shapes take the same branches when the tuples are equal. Loop trip counts are in it only where the
    code treats the first, last or a middle trip differently."""
    t = b * s_tkg
    bxs_tile = min(t, P_MAX // s_tkg * s_tkg)  # attention_block_tkg: bxs_tile, n_bxs_tiles (B x S_tkg > pmax)
    n_bxs = -(-t // bxs_tile)
    b_attn, q_attn = (b // ranks, q * ranks) if ranks > 1 else (b, q)  # KVDP: batch split, q heads gathered
    if ranks > 1 and b % ranks:
        return (("B % KVDP", b % ranks),)  # the kernel refuses it (kernel_assert B % KVDP == 0)
    bs_shard, sp_shard = _lnc_sharding(b_attn, q_attn, s_tkg, s_ctx, lnc)
    sp_n, bs_n = (2 if sp_shard else 1), (2 if bs_shard else 1)
    s_prior = s_ctx // sp_n
    use_fa = fa_tiling and s_prior > FA_TILE  # uses_flash_attention
    fa_tile = FA_TILE if use_fa else s_prior
    n_fa = -(-s_prior // FA_TILE) if use_fa else 1
    bs_nc = b_attn // bs_n
    bt = min(bs_nc, BATCH_TILE_BUDGET // (8 * q_attn * s_tkg * fa_tile))  # uses_batch_tiling
    if bt < 1:
        return (("one batch fits the batch-tile budget", False),)  # the kernel refuses it (kernel_assert)
    n_bt = -(-bs_nc // bt)
    bt_last = bs_nc - (n_bt - 1) * bt
    tiles = []
    for tb in sorted({bt, bt_last}):  # _update_atp_for_batch_tile, per batch tile size
        sab = tb * q_attn * s_tkg
        tiles.append((sab % P_MAX > 0, sab // P_MAX > 0, -(-sab // P_MAX) > 1, min(tb, PSUM_BANKS)))
    route = [("qkv_cte (B*S_tkg > pmax)", t > P_MAX),
             # qkv_tkg: its PE array tiling, 32 / 64 / 128 columns for BxS <= 32, <= 64, above
             ("qkv_tkg array tiling", 32 if t <= 32 else 64 if t <= 64 else 128),
             ("bxs tiles > 1", n_bxs > 1),
             ("last bxs tile partial", t % bxs_tile != 0), ("KVDP", ranks > 1), ("B % KVDP", b % max(ranks, 1)),
             ("batch sharded", bs_shard), ("s_prior sharded", sp_shard), ("s_prior % (sharding x pmax)",
                                                                          s_ctx % (sp_n * P_MAX)),
             ("flash attention", use_fa), ("FA tiles (1, 2, >= 3)", min(n_fa, 3)),
             ("last FA tile partial", use_fa and s_prior % FA_TILE != 0), ("batch tiles > 1", n_bt > 1),
             ("last batch tile partial", bt_last != bt), ("per batch tile: bqh % pmax > 0, full bqh tiles, "
                                                         "bqh tiles > 1, PSUM batch interleave", tuple(tiles)),
             # the cache update: _update_flat_cache_batched when S_tkg == 1 and B > 1 (and B > 16 if K is
             # transposed), over batch tiles of pmax
             ("cache update batched", s_tkg == 1 and b_attn > 1 and (not k_transposed or b_attn > 16)),
             ("cache update B > 16", b_attn > 16), ("cache update batch tiles > 1", b_attn > P_MAX),
             ("cache update last tile partial", b_attn > P_MAX and b_attn % P_MAX != 0)]
    if block_len:  # resize_cache_block_len_for_attention_tkg_kernel: the block length the kernel reads with
        blk = _resized_block_len(block_len, s_ctx, sp_n, use_fa)
        route += [("block cache resized", blk != block_len), ("resized block < 8 (no DMA transpose)", blk < 8),
                  ("blocks a batch % pmax", (s_ctx // blk) % (sp_n * P_MAX)),
                  # _compute_qk_matmul's PE-transpose path (no DMA transpose): block_len // min(8, block_len)
                  # transpose groups, the odd ones copied on Scalar; the active tokens' last block partly covered
                  ("K transpose groups (1, >= 2)", min(blk // min(8, blk), 2) if blk else 0),
                  ("last active block partly covered", blk > 0 and -(-s_tkg // blk) * blk > s_tkg)]
    return tuple(route)


def _resized_block_len(block_len: int, bucket: int, sp_n: int, use_fa: bool) -> int:
    """The block length attention_tkg reads a block cache with: the largest divisor of ``block_len`` that divides
    the blocks of each s_prior shard into folds of pmax, and, with flash attention, its tile and last tile."""
    if bucket % (sp_n * P_MAX):
        return 0  # the kernel refuses it (kernel_assert); no reduced shape is allowed to differ here
    g = bucket // (sp_n * P_MAX)
    if use_fa:
        g = math.gcd(g, FA_TILE // P_MAX)
        last = bucket // sp_n % FA_TILE
        if last:
            g = math.gcd(g, last // P_MAX)
    return math.gcd(block_len, g)


# -- the reduction -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Reduction:
    """What :func:`reduction` decided for one row: ``sizes`` maps each reduced size to (full, reduced); empty
    with ``why`` set where the row is not reduced."""

    estimate_s: float  # the full row's estimate
    sizes: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    reduced_estimate_s: float = 0.0
    why: str = ""
    reduced_peak_gb: float = 0.0  # the reduced row's estimated peak memory

    @property
    def reduced(self) -> bool:
        return bool(self.sizes)


def _attention_sizes(row: dict[str, Any]) -> tuple:
    return (row["batch"], row["q_heads"], row["S_ctx"], row["S_tkg"], row.get("KVDP", 1), row.get("lnc", 2),
            row.get("block_len", 0), row.get("enable_fa_s_prior_tiling", True), row.get("K_cache_transposed", False))


def reduction(kernel: str, name: str, shapes: str, row: Any, cap_s: float = CAP_S,
              estimate: Callable[[str, str, str], float] = estimate_cpu_s, mem_cap_gb: float = MEM_CAP_GB,
              peak: Callable[[str, str, str], float] = estimate_peak_gb) -> Reduction:
    """Whether and how the model-config row ``row`` (its table row: (field, value) pairs for
    ``attention_block_tkg``) of the case ``kernel`` / ``name`` / ``shapes`` is reduced under ``cap_s`` (see the
    module doc), its reduced shape's ``peak`` memory within ``mem_cap_gb`` too. Only ``attention_block_tkg`` rows
    are reduced: the other families' costs are their weights (``estimate_cpu_s`` grows with T or B x S at a power of
    0.2-0.35), so fewer tokens seldom reach the cap, and their routes are not derived here; such a row over the cap
    stays not run."""
    full = estimate(kernel, name, shapes)
    if full <= cap_s:
        return Reduction(full, why=f"estimate {full:.0f} s is within the cap of {cap_s:.0f} s")
    if not kernel.endswith("/attention_block_tkg"):
        return Reduction(full, why=f"estimate {full:.0f} s over the cap of {cap_s:.0f} s; only attention_block_tkg "
                                   "rows are reduced")
    r = dict(row)
    if r["S_ctx"] != r["S_max_ctx"]:
        return Reduction(full, why="S_ctx differs from S_max_ctx: no reduction defined")
    b, q, s, s_tkg, ranks, lnc, blk, fa, kt = _attention_sizes(r)
    route = attention_route(b, q, s, s_tkg, ranks, lnc, blk, fa, kt)
    shaped = lambda b2, s2: _reshape(shapes, {"B": (b, b2), "S_ctx": (s, s2)}, arrow=False)  # noqa: E731
    step = math.lcm(2 * P_MAX, blk or 1)
    same_s = [s2 for s2 in range(s - step, 0, -step)
              if attention_route(b, q, s2, s_tkg, ranks, lnc, blk, fa, kt) == route]
    for s2 in same_s:
        est, mem = estimate(kernel, name, shaped(b, s2)), peak(kernel, name, shaped(b, s2))
        if est <= cap_s and mem <= mem_cap_gb:
            return Reduction(full, {"S_ctx": (s, s2)}, est, reduced_peak_gb=mem)
    s2 = same_s[-1] if same_s else s
    b_min = b
    for b2 in range(b - 1, 0, -1):
        if attention_route(b2, q, s2, s_tkg, ranks, lnc, blk, fa, kt) != route:
            continue
        b_min = b2
        est, mem = estimate(kernel, name, shaped(b2, s2)), peak(kernel, name, shaped(b2, s2))
        if est <= cap_s and mem <= mem_cap_gb:
            return Reduction(full, {k: v for k, v in (("S_ctx", (s, s2)), ("B", (b, b2))) if v[0] != v[1]}, est,
                             reduced_peak_gb=mem)
    if (b_min, s2) == (b, s):
        return Reduction(full, why=f"estimate {full:.0f} s over the cap of {cap_s:.0f} s and no smaller S_ctx or B "
                                   "keeps the route")
    # the smallest shape on the route, still over a cap: run it (cheaper than the full row), said so
    est, mem = estimate(kernel, name, shaped(b_min, s2)), peak(kernel, name, shaped(b_min, s2))
    over = [f"the cap of {cap_s:.0f} s"] * (est > cap_s) + [f"the memory cap of {mem_cap_gb:g} GB (estimated peak "
                                                            f"{mem:.1f} GB)"] * (mem > mem_cap_gb)
    return Reduction(full, {k: v for k, v in (("S_ctx", (s, s2)), ("B", (b, b_min))) if v[0] != v[1]}, est,
                     why=f"the smallest S_ctx and B on the route, still over {' and '.join(over)}",
                     reduced_peak_gb=mem)


def _reshape(shapes: str, sizes: dict[str, tuple[int, int]], arrow: bool = True) -> str:
    """``shapes`` with each size in ``sizes`` (and the S_max_ctx after an S_ctx) written ``full->reduced``
    (``arrow``) or as the reduced value alone."""
    for key, (old, new) in sizes.items():
        if old == new:
            continue
        val = f"{old}->{new}" if arrow else str(new)
        pat = rf"(?<![\w]){key}={old}/{old}\b" if key == "S_ctx" else rf"(?<![\w]){key}={old}\b"
        rep = f"{key}={val}/{val}" if key == "S_ctx" else f"{key}={val}"
        shapes, n = re.subn(pat, rep, shapes)
        if n != 1:
            raise ValueError(f"reduce: shapes {shapes!r}: expected one {key}={old}, found {n}")
    return shapes


def reduced_row(row: Any, sizes: dict[str, tuple[int, int]]) -> tuple:
    """The table row with the reduced sizes (``attention_block_tkg``: batch, S_ctx and S_max_ctx)."""
    field = {"B": ("batch",), "S_ctx": ("S_ctx", "S_max_ctx")}
    new = {f: v[1] for k, v in sizes.items() for f in field[k]}
    return tuple((k, new.get(k, v)) for k, v in row)


def reduced_case(case: Case, built: Case, red: Reduction, cap_s: float = CAP_S) -> Case:
    """``built`` (the case of the reduced row) named as the full ``case`` with :data:`REDUCED` before
    ``model_config`` and both shapes in its shapes; its note says what was reduced and why."""
    if f" {MODEL_CONFIG}" not in case.name:
        raise ValueError(f"reduce: {case.name!r} is not a model-config case")
    what = ", ".join(f"{k} {a:,} -> {b:,}" for k, (a, b) in red.sizes.items())
    note = (f"token counts reduced for CPU time ({what}): the full row's estimate {red.estimate_s:.0f} s is over the "
            f"{cap_s:.0f} s cap, the reduced row's {red.reduced_estimate_s:.0f} s (peak {red.reduced_peak_gb:.1f} GB)"
            + (f" ({red.why})" if red.why else "") + "; same kernel route (trnkit.conformance.reduce)")
    return dataclasses.replace(built, name=case.name.replace(f" {MODEL_CONFIG}", f" {REDUCED} {MODEL_CONFIG}", 1),
                               shapes=_reshape(case.shapes, red.sizes), note=f"{built.note}; {note}", tier=REDUCED)


# -- the check ---------------------------------------------------------------------------------------------------
def route_signature(case: Case, root: Path) -> tuple[frozenset[tuple[str, int]], frozenset[str]]:
    """What a run of ``case``'s kernel on its zero inputs (``Case.zero_inputs``; no reference) does: the set of
    (file, line) of nki-library's source it executes (under ``root/src``) and the set of instruction kinds
    (``nisa`` ops) it issues. Two runs with equal signatures took the same branches of the kernel's code."""
    from . import harness

    src = str(root / "src")
    lines: set[tuple[str, int]] = set()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            lines.add((frame.f_code.co_filename[len(src):], frame.f_lineno))
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(src) else None

    if case.zero_inputs is None:
        raise ValueError(f"route_signature: case {harness.case_id(case)} has no zero inputs")
    with harness.nki_is_interpreter(root):
        return _signature(case, root, src, tracer, lines)


def _signature(case: Case, root: Path, src: str, tracer: Callable, lines: set) -> tuple:
    from trnkit.nkisim import trace

    from . import harness

    with contextlib.redirect_stdout(io.StringIO()):
        for module in harness.REPAIRED_MODULES:
            harness._load_repaired(module)
        inputs = harness.case_inputs(case, case.zero_inputs)
    kernel = harness._resolve(case.entry, root)
    if case.wrap_kernel is not None:
        kernel = case.wrap_kernel(kernel)
    old = sys.gettrace()
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        with trace.record(trace_only=True) as tr, contextlib.redirect_stdout(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            harness._launch(case, kernel, inputs["ranks"] if case.ranks else inputs)
    finally:
        sys.settrace(old)
        threading.settrace(None)  # type: ignore[arg-type]
    return frozenset(lines), frozenset(tr.by_op())
