"""Reduced model-config rows (trnkit.conformance.reduce): token counts reduced for CPU time on the same kernel route.

The expected reductions below are worked out by hand from nki-library's source (attention_tkg_utils.py's
is_batch_sharded / is_s_prior_sharded, uses_flash_attention with its 8,192-token tile, uses_batch_tiling,
resize_cache_block_len_for_attention_tkg_kernel; attention_block_tkg's bxs tiles; qkv_tkg's array tiling), with a
stand-in estimate passed as the argument, so that the numbers do not depend on the fitted one."""

from __future__ import annotations

import re

import pytest

from trnkit.conformance import cases_model_config, harness, reduce
from trnkit.conformance.cases_transformer import attention_block_case

KERNEL = "experimental/transformer/attention_block_tkg"
ROOT = harness.nkilib_root()
needs_checkout = pytest.mark.skipif(ROOT is None, reason="no nki-library checkout or archive")


def _row(b, q, s_ctx, ranks=1, block_len=32, lnc=2, **more):
    """An AttnBlkTestConfig row as the table gives it: (field, value) pairs (the fields reduction reads)."""
    return (("batch", b), ("q_heads", q), ("d_head", 128), ("H", 4096), ("H_actual", None), ("S_ctx", s_ctx),
            ("S_max_ctx", s_ctx), ("S_tkg", 1), ("block_len", block_len), ("lnc", lnc), ("KVDP", ranks),
            ("enable_fa_s_prior_tiling", True), ("K_cache_transposed", False), *more.items())


def _shapes(b, q, s_ctx, ranks=1):
    heads = f"{q}/rank" if ranks > 1 else f"{q}"
    return f"B={b} q_heads={heads} d=128 H=4096 S_ctx={s_ctx}/{s_ctx} S=1" + (f" ranks={ranks}" if ranks > 1 else "")


def _no_peak(kernel, name, shapes):
    """A stand-in memory estimate that never binds (the tests of the CPU reduction)."""
    return 0.0


def _by_tokens(per_second):
    """A stand-in estimate: B x S_ctx / ``per_second`` seconds."""
    def estimate(kernel, name, shapes):
        d = dict(re.findall(r"(\w+)=(\d+)", shapes))
        return int(d["B"]) * int(d["S_ctx"]) / per_second
    return estimate


def test_s_ctx_is_reduced_to_the_largest_that_keeps_three_flash_attention_tiles_whole():
    """B = 8, 8 q heads, LNC 2, block cache of 32: B x q = 64 <= 128, so the kernel shards S_ctx over the two cores
    (s_prior = 65,536: 8 flash-attention tiles of 8,192, none partial). A reduced S_ctx must keep s_prior a multiple
    of 8,192 with at least 3 tiles (a middle tile runs code neither the first nor the last does): 49,152 or 65,536
    ... ; 57,344 would leave a partial last tile. Estimate S_ctx / 1,000 s: 49,152 is the largest within 60 s."""
    red = reduce.reduction(KERNEL, "bf16 model_config", _shapes(8, 8, 131072), _row(8, 8, 131072), 60.0,
                           _by_tokens(8000), peak=_no_peak)
    assert red.sizes == {"S_ctx": (131072, 49152)} and red.estimate_s == pytest.approx(131.072)
    assert red.reduced_estimate_s == pytest.approx(49.152)
    red = reduce.reduction(KERNEL, "bf16 model_config", _shapes(8, 8, 131072), _row(8, 8, 131072), 70.0,
                           _by_tokens(8000), peak=_no_peak)
    assert red.sizes == {"S_ctx": (131072, 65536)}
    # within 10 s nothing on the route fits: the smallest on it (49,152; B stays 8, since below 8 the PSUM batch
    # interleave min(B, 8) changes), its estimate over the cap, said so
    red = reduce.reduction(KERNEL, "bf16 model_config", _shapes(8, 8, 131072), _row(8, 8, 131072), 10.0,
                           _by_tokens(8000), peak=_no_peak)
    assert red.sizes == {"S_ctx": (131072, 49152)} and red.reduced_estimate_s == pytest.approx(49.152)
    assert "still over the cap of 10 s" in red.why
    route = reduce.attention_route(8, 8, 131072, 1, 1, 2, 32)
    assert reduce.attention_route(8, 8, 57344, 1, 1, 2, 32) != route  # partial last tile
    assert reduce.attention_route(8, 8, 32768, 1, 1, 2, 32) != route  # two tiles: no middle one
    assert reduce.attention_route(8, 8, 49152, 1, 1, 2, 32) == route


def test_b_is_reduced_when_no_smaller_s_ctx_keeps_the_route():
    """B = 512, 4 q heads, one rank, LNC 2, S_ctx = 10,240, block 32. B x q = 2,048 > 128 and B even: batch-sharded,
    s_prior = 10,240: 2 flash-attention tiles, the last partial (2,048); the block cache is read at a block length
    of 16 (10,240 / 128 = 80 blocks of 128, gcd(80, 64, 16) = 16): two K transpose groups of 8. Every smaller S_ctx
    with 2 tiles and a partial last one reads a shorter block (9,216: gcd(72, 64, 8) = 8, one transpose group; 9,472:
    2), so S_ctx stays. Then B: B x S_tkg stays a multiple of 128 above it (bxs tiles whole), each core's 256 batch
    rows stay whole batch tiles of 64 (16 MiB / (8 x 4 x 8,192)), and the cache update's batch tiles of 128 whole:
    B in {256, 384}. Estimate B x S_ctx / 50,000: 384 gives 79 s, 256 gives 52 s."""
    red = reduce.reduction(KERNEL, "bf16 model_config", _shapes(512, 4, 10240), _row(512, 4, 10240), 60.0,
                           _by_tokens(50000), peak=_no_peak)
    assert red.sizes == {"B": (512, 256)} and not red.why
    assert red.reduced_estimate_s == pytest.approx(256 * 10240 / 50000)
    assert reduce.attention_route(512, 4, 9216, 1, 1, 2, 32) != reduce.attention_route(512, 4, 10240, 1, 1, 2, 32)
    # S_ctx first where it keeps the route: 131,072 -> 49,152 (test above), then B on top of it
    red = reduce.reduction(KERNEL, "bf16 model_config", _shapes(8, 8, 131072), _row(8, 8, 131072), 60.0,
                           _by_tokens(8000), peak=_no_peak)
    assert red.sizes == {"S_ctx": (131072, 49152)}


def test_a_row_no_smaller_shape_keeps_on_its_route_is_not_reduced_and_says_why():
    """B = 256 on 8 KV-data-parallel ranks, 8 q heads a rank, S_ctx = 1,024, block 32: B x S_tkg = 256 runs
    qkv_cte in two whole bxs tiles, so B stays a multiple of 128 above 128 (256 only); S_ctx = 1,024 reads blocks of
    8 (1,024 / 128 = 8), and 768 or 512 would read blocks of 2 or 4 (below 8: no DMA transpose). Nothing smaller
    keeps the route: the row stays not run, its estimate in the reason."""
    red = reduce.reduction(KERNEL, "fp8 static kv_quant KVDP=8 model_config", _shapes(256, 8, 1024, 8),
                           _row(256, 8, 1024, 8), 60.0, lambda *_: 100.0)
    assert not red.reduced and red.estimate_s == 100.0
    assert red.why == "estimate 100 s over the cap of 60 s and no smaller S_ctx or B keeps the route"
    assert not reduce.reduction(KERNEL, "x model_config", _shapes(256, 8, 1024, 8), _row(256, 8, 1024, 8), 60.0,
                                lambda *_: 59.0).reduced  # within the cap: run in full


def test_the_reduced_shapes_are_written_full_to_reduced_and_the_name_is_marked():
    red = reduce.Reduction(100.0, {"S_ctx": (131072, 49152), "B": (64, 48)}, 50.0)
    full = attention_block_case(64, 1, 128, 4096, None, 131072, 131072, 1, block_len=32, KVDP=2)
    built = attention_block_case(48, 1, 128, 4096, None, 49152, 49152, 1, block_len=32, KVDP=2)
    full = full.__class__(**{**full.__dict__, "name": f"{full.name} model_config OPTIMAL"})
    case = reduce.reduced_case(full, built, red)
    assert case.shapes == "B=64->48 q_heads=1/rank d=128 H=4096 S_ctx=131072->49152/131072->49152 S=1 ranks=2"
    assert case.name == full.name.replace(" model_config", " reduced model_config")
    assert harness.case_id(case) != harness.case_id(full) and harness.case_seed(case) != harness.case_seed(full)
    assert "S_ctx 131,072 -> 49,152, B 64 -> 48" in case.note
    assert case.inputs is built.inputs  # the reduced row's inputs


@needs_checkout
def test_reduced_cases_have_ids_of_their_own_and_cost_less_than_their_full_rows():
    model = {harness.case_id(c) for c in cases_model_config.model_config_cases(ROOT)}
    reduced = cases_model_config.reduced_cases(ROOT)
    assert reduced and all(c.kernel == KERNEL and " reduced model_config" in c.name and "->" in c.shapes
                           for c in reduced)
    for c in reduced:
        assert harness.case_id(c) not in model
        full = re.sub(r"(\d+)->\d+", r"\1", c.shapes)
        assert f"{c.kernel}|{c.name.replace(' reduced', '')}|lnc{c.lnc}|{full}" in model
        plain = re.sub(r"\d+->(\d+)", r"\1", c.shapes)
        est, est_full = (reduce.estimate_cpu_s(c.kernel, c.name, x) for x in (plain, full))
        assert reduce.CAP_S < est_full and est < est_full
        assert est <= reduce.CAP_S or "still over the cap" in c.note


@needs_checkout
@pytest.mark.slow
@pytest.mark.parametrize(("full", "other"), [
    ((8, 8, 131072, {}), (8, 8, 49152, {})),  # S_ctx: 8 flash-attention tiles on each core -> 3
    ((8, 8, 131072, {}), (8, 8, 32768, {})),  # -> 2 tiles: no middle tile (a different route)
    ((64, 2, 10240, {}), (48, 2, 10240, {})),  # B: qkv_tkg's 64-column tiling either way
    ((64, 2, 10240, {}), (32, 2, 10240, {})),  # B = 32: its 32-column tiling (a different route)
])
def test_route_equal_exactly_when_the_kernel_runs_the_same_lines_and_instruction_kinds(full, other):
    """The kernel run on zero inputs (trace-only) executes the same nki-library source lines and instruction kinds
    for the full and the reduced shape exactly when attention_route says their routes are equal."""
    sig, route = [], []
    for b, q, s_ctx, flags in (full, other):
        case = attention_block_case(b, q, 128, 4096, None, s_ctx, s_ctx, 1, block_len=32, **flags)
        sig.append(reduce.route_signature(case, ROOT))
        route.append(reduce.attention_route(b, q, s_ctx, 1, flags.get("KVDP", 1), 2, 32))
    assert len(sig[0][0]) > 1000 and len(sig[0][1]) > 5
    assert (sig[0] == sig[1]) == (route[0] == route[1])


def _peak_by_tokens(per_gb):
    """A stand-in memory estimate: B x S_ctx / ``per_gb`` GB."""
    def peak(kernel, name, shapes):
        d = dict(re.findall(r"(\w+)=(\d+)", shapes))
        return int(d["B"]) * int(d["S_ctx"]) / per_gb
    return peak


def test_s_ctx_goes_further_down_the_route_where_the_memory_estimate_passes_its_cap():
    """The first row above at a 70 s cap reduces to S_ctx 65,536 for CPU alone; with a stand-in peak of B x S_ctx /
    100,000 GB (5.2 GB there) and a 5 GB memory cap, to the next S_ctx on the route, 49,152 (3.9 GB)."""
    args = (KERNEL, "bf16 model_config", _shapes(8, 8, 131072), _row(8, 8, 131072), 70.0, _by_tokens(8000))
    assert reduce.reduction(*args, mem_cap_gb=6.0, peak=_peak_by_tokens(100000)).sizes == {"S_ctx": (131072, 65536)}
    red = reduce.reduction(*args, mem_cap_gb=5.0, peak=_peak_by_tokens(100000))
    assert red.sizes == {"S_ctx": (131072, 49152)} and red.reduced_peak_gb == pytest.approx(8 * 49152 / 1e5)
    assert not red.why


def test_b_goes_further_down_the_route_where_the_memory_estimate_passes_its_cap():
    """The B = 512, S_ctx = 10,240 row above (B on its route: 256 or 384) at a 100 s cap: 384 fits the CPU cap
    (78.6 s); a stand-in peak of B x S_ctx / 10^6 GB puts it at 3.9 GB, over a 3 GB memory cap: B 256 (2.6 GB)."""
    args = (KERNEL, "bf16 model_config", _shapes(512, 4, 10240), _row(512, 4, 10240), 100.0, _by_tokens(50000))
    assert reduce.reduction(*args, mem_cap_gb=6.0, peak=_peak_by_tokens(10**6)).sizes == {"B": (512, 384)}
    red = reduce.reduction(*args, mem_cap_gb=3.0, peak=_peak_by_tokens(10**6))
    assert red.sizes == {"B": (512, 256)} and red.reduced_peak_gb == pytest.approx(2.62144)
    # under a 2 GB memory cap nothing on the route fits: the smallest on it, the memory cap and its peak said
    red = reduce.reduction(*args, mem_cap_gb=2.0, peak=_peak_by_tokens(10**6))
    assert red.sizes == {"B": (512, 256)}
    assert red.why == "the smallest S_ctx and B on the route, still over the memory cap of 2 GB (estimated peak 2.6 GB)"
    # a row within the CPU cap is not reduced for memory alone
    assert not reduce.reduction(*args[:4], 200.0, _by_tokens(50000), 2.0, _peak_by_tokens(10**6)).reduced


@pytest.mark.parametrize(("case", "measured_gb"), [
    # the runners' measured peak anonymous RSS of rows that ran to a result (/tmp/confrun{4..8}/peaks.txt)
    ("fp8 static transposed_out kv_quant block_len=32 reduced model_config OPTIMAL|B=16 q_heads=8 d=128 H=8192 "
     "S_ctx=65536/65536 S=1", 7.87),
    ("fp8 static kv_quant block_len=32 KVDP=8 model_config OPTIMAL|B=512 q_heads=8/rank d=128 H=8192 "
     "S_ctx=1024/1024 S=1 ranks=8", 6.00),
    ("bf16 test_bias block_len=32 KVDP=4|B=256 q_heads=2/rank d=64 H=3072/2880 S_ctx=10240/10240 S=1 ranks=4", 4.83),
    # a reduced one-device row with a 2 GB bf16 block cache (its golden in chunks of 70)
    ("bf16 block_len=32 reduced model_config GENERALITY|B=768 q_heads=2 d=64 H=3072/2880 S_ctx=10240/10240 S=1", 1.95),
    ("fp8 static transposed_out kv_quant block_len=32 model_config OPTIMAL|B=8 q_heads=1 d=128 H=8192 "
     "S_ctx=10240/10240 S=1", 0.57),
    ("bf16 qk_norm_pre_rope qk_norm_pre_rope_gamma transposed_out block_len=32 model_config OPTIMAL|B=2 q_heads=1 "
     "d=128 H=5376 S_ctx=32768/32768 S=1", 0.47),
])
def test_the_memory_estimate_is_near_the_measured_peaks(case, measured_gb):
    """Within the range of the fit's error on the rows it was fitted on (estimate / measured 0.51-1.69 over 1.5 GB,
    0.57-1.54 below)."""
    name, shapes = case.split("|")
    est = reduce.estimate_peak_gb(KERNEL, name, shapes)
    lo, hi = (0.51, 1.69) if measured_gb > 1.5 else (0.57, 1.54)
    assert lo <= est / measured_gb <= hi, est


def test_a_row_estimated_over_8_gb_is_said_so():
    """A stand-in-free check of the rows that passed the runner's 8 GB cap (over8g.txt): the estimate puts the one
    single-device bf16 row (flat cache of 3.2 GB, its golden on the whole batch) well over it."""
    est = reduce.estimate_peak_gb(KERNEL, "bf16 qk_norm_pre_rope qk_norm_pre_rope_gamma reduced model_config "
                                  "GENERALITY", "B=256 q_heads=4 d=128 H=4096 S_ctx=24576/24576 S=1")
    assert est > 8.0
    with pytest.raises(ValueError, match="core/moe/moe_tkg: only attention_block_tkg rows have a memory estimate"):
        reduce.estimate_peak_gb("core/moe/moe_tkg", "x", "T=4 H=3072 I=64 E=4")


@needs_checkout
def test_the_reduce_modules_sharding_predicate_is_nki_librarys():
    """reduce's reading of is_batch_sharded / is_s_prior_sharded (used by the route and, outside the interpreter,
    by the memory estimate's golden chunk) against nki-library's own functions on a grid."""
    with harness.nki_is_interpreter(ROOT):
        utils = __import__("importlib").import_module("nkilib_src.nkilib.core.attention.attention_tkg_utils")
        for b in (1, 2, 3, 16, 17, 32, 33, 64, 255, 256):
            for q in (1, 2, 4, 8, 16):
                for s in (1, 4, 5):
                    for sp in (128, 255, 256, 1024, 24576):
                        got = reduce._lnc_sharding(b, q, s, sp)
                        assert got == (utils.is_batch_sharded(b, q, s, sp, 128),
                                       utils.is_s_prior_sharded(b, q, s, sp, 128)), (b, q, s, sp)
