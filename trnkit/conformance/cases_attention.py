"""Conformance cases of nki-library's core/attention kernels, written from their test files.

``test/integration/nkilib/core/attention/test_attention_cte.py``: attention_cte against
``attention_cte_torch_ref`` at rtol 2e-2 / atol 1e-5. Inputs as the test's ``build_attention_cte_input``
draws them: one ``np_random_sample()`` generator (``np.random.seed(0)``, then ``random_sample`` per
tensor in the order q, k, v, k_prior, v_prior, cast to the test dtype), the sink from the same global
state (``uniform(15, 25)``), sequence-packing bounds from ``np.random.rand``. The golden casts the
output to the test dtype and the cached softmax statistics to fp32.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["attention_cases", "attention_cte_golden"]

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


def attention_cte_golden(out_dtype: Any = None, **kw: Any) -> dict[str, Any]:
    """The test's golden: ``attention_cte_torch_ref`` in fp32 softmax, the output rounded to the
    test dtype (``out_dtype``), the cached statistics kept fp32."""
    import torch

    ref = importlib.import_module(f"{LIB}.attention.attention_cte_torch").attention_cte_torch_ref
    kw.pop("mm_out_dtype", None)
    kw["softmax_dtype"] = torch.float32
    for key in ("bound_min", "bound_max"):  # the test passes these as numpy arrays
        if kw.get(key) is not None:
            kw[key] = kw[key].numpy()
    out = ref(**kw)
    names = ("out", "out_cached_negative_max", "out_cached_sum_reciprocal")
    outs = dict(zip(names, out if kw["cache_softmax"] else (out,)))
    outs["out"] = outs["out"].to(out_dtype).float()
    return outs


def _cte_ref_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {**inputs, "out_dtype": {BF16: torch.bfloat16, F16: torch.float16, F32: torch.float32}[
        inputs["q"].dtype]}


# lnc, bs, bs_kv, seqlen_kv, seqlen_q, prior_len, prior_used_len, d, scale, dtype, causal, tp_q, tp_k, tp_out,
# sink, sliding_window, cache_softmax, cp (degree, rank, strided) or None, packed sequences or None, test
_CTE = [
    # test_attention_cte_no_cp_unit (CompilerArgs(): LNC 2)
    (2, 3, 3, 1024, 512, None, None, 128, 1.0, F16, False, False, False, True, False, 0, False, None, None, "no_cp"),
    (2, 1, 1, 128, 128, None, None, 128, 1.0, BF16, True, False, False, True, False, 0, False, None, None, "no_cp"),
    (2, 3, 3, 2048, 2048, None, None, 128, 1.0, F16, True, True, False, False, False, 0, False, None, None, "no_cp"),
    (2, 1, 1, 9216, 4096, None, None, 64, 0.5, F32, False, True, False, False, False, 0, False, None, None, "no_cp"),
    # test_attention_cte_no_cp_vnc_apc_klr_unit (prefix caching)
    (2, 2, 2, 2048, 2048, 4096, 0, 64, 1.0, BF16, False, False, False, True, True, 0, False, None, None, "apc"),
    (2, 2, 2, 2048, 2048, 4096, 4095, 64, 1.0, BF16, True, False, False, True, True, 0, False, None, None, "apc"),
    (1, 3, 3, 2048, 2048, 512, 500, 128, 1.0, BF16, False, False, False, False, False, 0, False, None, None, "apc"),
    (2, 2, 2, 2048, 2048, 4096, 2048, 64, 1.0, BF16, True, True, True, True, True, 0, False, None, None, "apc"),
    (2, 2, 2, 2048, 2048, 512, 500, 64, 1.0, BF16, True, False, False, True, True, 1024, False, None, None, "apc"),
    (2, 3, 3, 2001, 2001, 3555, 3555, 64, 1.0, BF16, True, False, False, True, False, 0, False, None, None, "apc"),
    (2, 1, 1, 256, 256, 2048, 1920, 128, 1.0, BF16, True, True, True, True, False, 0, False, None, None, "apc"),
    # test_attention_cte_no_cp_vnc_unit
    (2, 1, 1, 8192, 4096, None, None, 64, 0.125, F32, False, True, False, False, False, 0, False, None, None, "vnc"),
    (2, 3, 3, 2048, 1024, None, None, 128, 0.125, BF16, False, False, False, False, False, 0, False, None, None,
     "vnc"),
    (1, 3, 3, 2048, 1024, None, None, 128, 0.125, BF16, False, False, False, False, False, 0, False, None, None,
     "vnc"),
    (2, 2, 2, 1024, 1024, None, None, 128, 1.0, BF16, True, True, False, True, False, 0, False, None, None, "vnc"),
    (2, 2, 2, 577, 577, None, None, 88, 1.0, F32, False, True, False, False, False, 0, False, None, None, "vnc"),
    (2, 3, 3, 729, 729, None, None, 128, 1.0, F32, True, True, False, True, False, 0, False, None, None, "vnc"),
    (2, 2, 2, 2048, 2048, None, None, 64, 1.0, BF16, True, False, False, True, True, 128, False, None, None, "vnc"),
    # test_attention_cte_no_cp_vnc_gqa_unit
    (2, 9, 3, 2048, 2048, None, None, 128, 1.0, BF16, True, False, False, True, False, 0, False, None, None, "gqa"),
    (2, 5, 1, 2048, 2048, 1024, 512, 128, 1.0, BF16, False, False, False, True, False, 0, False, None, None, "gqa"),
    (1, 4, 2, 2048, 2048, 1024, 512, 128, 1.0, BF16, False, False, False, True, False, 0, False, None, None, "gqa"),
    (2, 9, 3, 2048, 2048, 1024, 512, 128, 1.0, BF16, True, True, False, True, False, 0, False, None, None, "gqa"),
    # test_attention_cte_cp_apc_klr_unit (causal, CompilerArgs(): LNC 2), both Q slicings
    (2, 4, 4, 1024, 512, 512, 256, 128, 1.0, BF16, True, True, False, False, False, 0, False, (2, 1, False), None,
     "cp_apc"),
    (2, 4, 4, 1024, 512, 512, 256, 128, 1.0, BF16, True, True, False, False, False, 0, False, (2, 1, True), None,
     "cp_apc"),
    (2, 3, 3, 8192, 512, 2047, 1024, 128, 1.0, BF16, True, False, True, False, False, 0, False, (16, 6, False),
     None, "cp_apc"),
    (2, 3, 3, 4096, 2048, 450, 1, 64, 1.0, BF16, True, True, True, True, True, 256, False, (2, 0, True), None,
     "cp_apc"),
    # test_ranged_attn_cte_sweep_nocp_manual (LNC 2, cache_softmax)
    (2, 2, 1, 123, 123, 30909, 30000, 128, 1.0, BF16, True, False, True, False, True, 0, True, None, None,
     "sweep_nocp_manual"),
    # test_ranged_attn_cte_sweep_cp_manual (bf16, scale 1, seqlen_q = seqlen_kv / cp degree)
    (2, 1, 1, 32768, 1024, None, None, 128, 1.0, BF16, True, False, False, False, False, 0, True, (32, 10, False),
     None, "sweep_cp_manual"),
    (1, 1, 1, 32768, 1024, None, None, 128, 1.0, BF16, True, False, False, False, False, 2, True, (32, 31, True),
     None, "sweep_cp_manual"),
    (2, 2, 1, 32768, 1024, None, None, 128, 1.0, BF16, True, True, True, False, True, 0, False, (32, 16, False),
     None, "sweep_cp_manual"),
    (1, 1, 1, 32768, 1024, None, None, 128, 1.0, BF16, True, True, True, True, False, 127, True, (32, 31, False),
     None, "sweep_cp_manual"),
    (2, 3, 1, 17000, 1000, 15000, 500, 127, 1.0, BF16, True, True, True, True, True, 0, False, (17, 16, True),
     None, "sweep_cp_manual"),
    (2, 3, 1, 17000, 1000, 15000, 500, 127, 1.0, BF16, True, True, True, True, True, 0, True, (17, 16, True),
     None, "sweep_cp_manual"),
    # test_attention_cte_seq_pack_unit
    (1, 1, 1, 2048, 2048, None, None, 96, 1.0, F32, False, True, False, False, False, 0, False, None, 4, "seq_pack"),
    (1, 1, 1, 512, 512, None, None, 128, 1.0, BF16, True, False, False, True, False, 0, False, None, 4, "seq_pack"),
    (2, 2, 2, 2048, 2048, None, None, 96, 1.0, BF16, True, False, False, True, False, 0, False, None, 4, "seq_pack"),
    (2, 6, 2, 2048, 2048, None, None, 96, 1.0, BF16, True, False, False, True, False, 0, False, None, 4, "seq_pack"),
    (2, 4, 2, 2048, 2048, None, None, 96, 1.0, BF16, True, True, False, False, False, 256, False, None, 4,
     "seq_pack"),
]


def _cte_cases() -> list[Case]:
    cases = []
    for (lnc, bs, bs_kv, skv, sq, prior, used, d, scale, dt, causal, tp_q, tp_k, tp_out, sink, sw, cache, cp,
         packed, test) in _CTE:
        flags = (["causal"] * causal + [f"sw={sw}"] * bool(sw) + ["tp_q"] * tp_q + ["tp_k"] * tp_k
                 + ["tp_out"] * tp_out + ["sink"] * sink + ["cache_softmax"] * cache
                 + [f"prior={prior}/{used}"] * (prior is not None)
                 + ([f"cp={cp[0]} rank={cp[1]}" + " strided" * cp[2]] if cp else [])
                 + [f"packed={packed}"] * bool(packed) + [f"scale={scale:g}"] * (scale != 1.0))
        negative = cache and sq % 128 != 0
        outputs = ("out", "out_cached_negative_max", "out_cached_sum_reciprocal") if cache else ("out",)
        cases.append(Case(
            kernel="core/attention/attention_cte", name=f"{test} {_DT[dt]} " + " ".join(flags)
            + (" (must reject)" if negative else ""),
            shapes=f"bs={bs}/{bs_kv} Sq={sq} Skv={skv} d={d}",
            entry=f"{LIB}.attention.attention_cte:attention_cte",
            reference="trnkit.conformance.cases_attention:attention_cte_golden", ref_inputs=_cte_ref_inputs,
            inputs=_cte_inputs(bs, bs_kv, d, dt, sq, skv, prior, used, tp_q, tp_k, tp_out, sink, scale, causal,
                               sw, cp, cache, packed),
            outputs=outputs, lnc=lnc, rtol=2e-2, atol=1e-5, negative=negative,
            test_file=f"{TESTS}/test_attention_cte.py"))
    return cases


# -- attention_bwd (test_attention_bwd.py) ---------------------------------------------------------
def _bwd_inputs(b: int, hq: int, hkv: int, s: int, d: int, dt: np.dtype, causal: bool, sw: int | None,
                sinks: int, scale: float | None, seqlens: list[int] | None, neg_case: str | None
                ) -> Callable[[], dict[str, Any]]:
    """The test's ``generate_inputs``: q, k, v, dy (and the sinks) from one ``default_rng(0)`` normal
    generator in that order, o and lse from nki-library's ``compute_o_lse`` on them (bf16 inputs as
    bf16 torch tensors, mixed precision), o rounded to the test dtype."""
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
        o, lse, _ = _lib_attr("attention.attention_bwd_torch:compute_o_lse")(
            torch_of(q), torch_of(k), torch_of(v), causal, True, softmax_scale=scale,
            sliding_window=sw if sw is not None else -1 if seqlens else None,
            sinks=torch_of(sink_t) if sinks else None,
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


def _lib_attr(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(f"{LIB}.{module}"), attr)


# batch, q heads, kv heads, seq_len, head_dim, dtype, causal, sliding_window, sinks, test (fast / full)
_BWD = [
    # test_attention_bwd_fast: base cases (S=2048 d=128, softmax_scale 1.0 when causal) ...
    *[(b, h, h, 2048, 128, dt, causal, None, sinks, "fast") for b, h, dt, causal, sinks in [
        (1, 1, BF16, True, 0), (1, 1, BF16, False, 2), (1, 3, BF16, True, 2), (2, 1, F32, True, 0),
        (2, 3, BF16, False, 0), (2, 3, F32, True, 2), (1, 3, F32, False, 0), (2, 1, BF16, True, 2)]],
    # ... and its negative cases
    (1, 2, 2, 2040, 128, BF16, True, None, 0, "fast"), (1, 3, 2, 2048, 128, BF16, True, None, 0, "fast"),
    (1, 2, 2, 2048, 260, BF16, True, None, 0, "fast"), (1, 2, 2, 2048, 128, BF16, False, 128, 0, "fast"),
    # test_attention_bwd (softmax_scale None)
    (1, 4, 2, 4096, 128, BF16, True, None, 0, "full"), (1, 8, 1, 4096, 128, BF16, True, None, 0, "full"),
    (1, 12, 12, 1024, 64, BF16, True, None, 0, "full"), (1, 16, 16, 1024, 64, BF16, False, None, 0, "full"),
]
# q heads, kv heads, head_dim, dtype, sequence lengths, causal, sinks, sliding window, negative case
_BWD_PACKED = [
    (1, 1, 128, BF16, [128, 128], True, 0, None, None), (1, 1, 64, BF16, [128, 256, 128], True, 0, None, None),
    (1, 1, 128, BF16, [128, 384], True, 0, None, None), (1, 1, 128, F32, [128, 128], False, 0, None, None),
    (8, 1, 128, BF16, [256, 256], True, 0, None, None), (4, 2, 128, BF16, [512, 512], True, 0, None, None),
    (1, 1, 128, BF16, [127, 129, 255, 513], True, 0, None, None),
    (1, 1, 128, BF16, [256, 256], True, 0, 128, None), (1, 1, 128, BF16, [128, 384], True, 0, 64, None),
    (1, 1, 128, BF16, [128, 128], True, 0, None, "only_bound_min"),
    (1, 1, 128, BF16, [128, 128], True, 0, None, "wrong_dtype"),
]


def _bwd_case(name: str, b: int, hq: int, hkv: int, s: int, d: int, dt: np.dtype, causal: bool, sw: int | None,
              sinks: int, scale: float | None, seqlens: list[int] | None, neg_case: str | None, lnc: int,
              negative: bool) -> Case:
    outputs = ("out_dq_ref", "out_dk_ref", "out_dv_ref") + (("out_dsinks_ref",) if sinks else ())
    return Case(
        kernel="core/attention/attention_bwd", name=name + (" (must reject)" if negative else ""),
        shapes=f"b={b} heads={hq}/{hkv} S={s} d={d}", entry=f"{LIB}.attention.attention_bwd:attention_bwd",
        reference=f"{LIB}.attention.attention_bwd_torch:attention_bwd_torch_ref",
        inputs=_bwd_inputs(b, hq, hkv, s, d, dt, causal, sw, sinks, scale, seqlens, neg_case),
        outputs=outputs, lnc=lnc, rtol=2e-2, atol=1e-5, negative=negative,
        test_file=f"{TESTS}/test_attention_bwd.py")


def _bwd_cases() -> list[Case]:
    cases = []
    for b, hq, hkv, s, d, dt, causal, sw, sinks, test in _BWD:
        negative = s % 128 != 0 or hq % hkv != 0 or d % math.ceil(d / 128) != 0 or (sw is not None and not causal)
        scale = (1.0 if causal else None) if test == "fast" else None
        name = (f"{test} {_DT[dt]}" + " causal" * causal + f" sw={sw}" * (sw is not None)
                + f" sinks={sinks}" * bool(sinks))
        cases.append(_bwd_case(name, b, hq, hkv, s, d, dt, causal, sw, sinks, scale, None, None,
                               2 if b * hkv % 2 == 0 else 1, negative))
    for hq, hkv, d, dt, seqlens, causal, sinks, sw, neg in _BWD_PACKED:
        name = f"packed {_DT[dt]} seqs={'+'.join(map(str, seqlens))}" + " causal" * causal \
            + f" sw={sw}" * (sw is not None) + f" {neg}" * bool(neg)
        cases.append(_bwd_case(name, 1, hq, hkv, sum(seqlens), d, dt, causal, sw, sinks, None, seqlens, neg,
                               2 if hkv % 2 == 0 else 1, neg is not None))
    return cases


def attention_cases() -> list[Case]:
    return _cte_cases() + _bwd_cases()
