"""moe_block_tkg's routing check (``cases_moe_block.routing_projection``, ``routed_as_kernel``): a MISMATCH is
GOLDEN_GAP only where the kernel's router logits are within their bf16 bound of the exact logits, it routes
otherwise than the golden only at near ties, and nki-library's reference routed as the kernel routes reproduces
``out`` while the golden fails against it. Synthetic rows on nki-library's own reference (small shapes, in
milliseconds) and the two real model-config rows (slow)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from trnkit.conformance import harness
from trnkit.conformance.cases_moe_block import (BF16, FP8, ROUTER_TAP, ROUTING, ROUTING_BY_AFFINITIES, _router_tiles,
                                               moe_block_case, routing_projection)

ROOT = harness.nkilib_root()
needs_checkout = pytest.mark.skipif(ROOT is None, reason="no nki-library checkout or archive")
T, H, INTER, E, K = 2, 64, 8, 16, 4


def _row(gap: float) -> tuple:
    """Inputs of a 2-token row whose token 0 has its 4th and 5th exact logits ``gap`` apart (bias moved), its
    float64 exact logits, and the 4th / 5th experts of token 0."""
    case = moe_block_case(False, 1, T, H, None, INTER, E, E, K, "Swish", BF16, BF16, True, True, False, False, BF16)
    rng = np.random.default_rng(7)
    kw = dict(case.inputs())  # (the case's generator at these shapes, then the bias moved)
    x = kw["inp"].astype(np.float64).reshape(T, H)
    norm = x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-6) * kw["gamma"].astype(np.float64)
    base = norm @ kw["router_weights"].astype(np.float64)
    bias = rng.uniform(-0.1, 0.1, (1, E))
    order = np.argsort(-(base + bias)[0])
    a, b = int(order[K - 1]), int(order[K])
    bias[0, b] += (base[0, a] + bias[0, a]) - (base[0, b] + bias[0, b]) - gap
    kw["router_bias"] = bias.astype(BF16)
    exact = base + kw["router_bias"].astype(np.float64)
    return case, kw, exact, a, b


def _taps(logits: np.ndarray, index: np.ndarray) -> dict:
    return {ROUTER_TAP: [(0, p, (logits.astype(ml_dtypes.bfloat16), index.astype(np.uint32), None))
                         for p in (0, 1)]}


def _kernel_like(exact: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 logits of ``exact`` with token 0's experts a and b made equal (a tie the kernel resolves to b), and
    the kernel's choice: token 0 takes b for a, token 1 as the exact top-K."""
    logits = harness.cast_bf16(exact)
    logits[0, b] = logits[0, a]
    index = np.argsort(-exact, axis=1, kind="stable")[:, :K]
    index[0, K - 1] = b
    return logits, index


def _run(case: harness.Case, kw: dict):
    def run(fn):
        return harness.reference_outputs(dataclasses.replace(case, ref_inputs=fn), kw, ROOT)
    return run


def _tied_token_is_golden_gap_and_3_percent_off_is_not(case: harness.Case, kw: dict, logits: np.ndarray,
                                                        taps: dict) -> str:
    """Token 0 routed by the kernel-like ``logits`` and router ``taps`` otherwise than the golden: the routed
    reference took the kernel's experts (token 0's out is not the golden's, every other token's is), only ``out``
    fails, the row is GOLDEN_GAP (its reason returned), and with the kernel's out 3 % off on the tied token it no
    longer is."""
    run = _run(case, kw)
    golden = run(lambda k: k)
    with case.tapped_reference.during(ROOT, taps):
        routed = run(lambda k: k)
    assert not np.allclose(routed["out"][0], golden["out"][0], rtol=1e-2, atol=1e-5)
    np.testing.assert_array_equal(routed["out"][1:], golden["out"][1:])
    actual = {"out": routed["out"].astype(np.float64), "router_logits": logits}
    failing = {n: j for n in case.outputs if not (j := harness.judge(case, n, actual[n], golden[n])).ok}
    assert list(failing) == ["out"]
    ok, why = harness.tapped_golden_gap(case, ROOT, kw, actual, golden, failing, taps)
    assert ok, why
    perturbed = dict(actual, out=actual["out"].copy())
    perturbed["out"][0] *= 1.03
    ok, off = harness.tapped_golden_gap(case, ROOT, kw, perturbed, golden, failing, taps)
    assert not ok and off.startswith("out: the kernel is at cosine"), off
    return why


@needs_checkout
def test_a_near_tie_routed_as_the_kernel_is_golden_gap_and_a_perturbed_token_is_not():
    with harness.nki_is_interpreter(ROOT):
        case, kw, exact, a, b = _row(gap=2e-4)
        logits, index = _kernel_like(exact, a, b)
        why = _tied_token_is_golden_gap_and_3_percent_off_is_not(case, kw, logits, _taps(logits, index))
        assert f"1 of {T} tokens routed otherwise than the golden, each a near tie: token 0: golden [{a}] -> " \
            f"kernel [{b}]" in why, why


@needs_checkout
def test_a_selection_that_is_not_a_near_tie_or_logits_beyond_the_bound_stay_mismatch():
    with harness.nki_is_interpreter(ROOT):
        case, kw, exact, a, b = _row(gap=2e-4)
        bound = (2 + (H + 1) * 2.0 ** -16) * harness.BF16_UNIT * np.abs(exact[0]).max()
        run = _run(case, kw)
        # a choice the kernel's own logits do not make a top-K: refused before anything else
        logits, index = _kernel_like(exact, a, b)
        logits[0, b] = harness.cast_bf16(exact)[0, b] - 0.01
        check = routing_projection(kw, _taps(logits, index), run)[1]
        assert not check.ok and "are not a top-4 of its own router logits" in check.figures, check
        # a swap 1.5 bounds apart: logits within their bound can make it a top-K, but it is no near tie
        case, kw, exact, a, b = _row(gap=1.5 * bound)
        logits, index = _kernel_like(exact, a, b)
        mid = harness.cast_bf16(np.array([(exact[0, a] + exact[0, b]) / 2]))[0]
        logits[0, a] = logits[0, b] = mid
        check = routing_projection(kw, _taps(logits, index), _run(case, kw))[1]
        assert not check.ok and check.figures.startswith(f"not a near tie: token 0: golden [{a}] -> kernel [{b}]")
        assert 1.4 < check.worst < 1.6, check
        # router logits 3 % off on token 1: beyond the 2.05-rounding bound
        logits, index = _kernel_like(exact, a, b)
        logits[1] *= 1.03
        label, got, ref, roundings, fp8 = routing_projection(kw, _taps(logits, index), _run(case, kw))[0]
        ok, worst, figures = harness.within_roundings(got, ref, roundings, fp8)
        assert label == "router logits" and not ok and worst > 1, figures


@needs_checkout
@pytest.mark.slow
@pytest.mark.model_config
@pytest.mark.parametrize("b, s", [(4, 4), (16, 1)])
def test_the_two_hidden_actual_2880_rows_are_golden_gap_on_the_kernels_routing(b, s):
    """Token 2 (of the same 16 tokens in both rows): experts 24 and 119 at exact logits 0.36534 / 0.36443, 0.25 of
    the logits' bound apart; the kernel routes it to 119, the golden to 24."""
    case = moe_block_case(False, b, s, 3072, 2880, 360, 128, 128, 4, "Swish", BF16, BF16, True, True, False, False,
                          BF16)
    row = harness.run_case(case, ROOT)
    assert row.result == harness.GOLDEN_GAP and harness.row_ok(case, row), harness.format_row(row)
    assert "1 of 16 tokens routed otherwise than the golden, each a near tie: token 2: golden [24] -> kernel [119]" \
        in row.message, row.message


# -- all experts: every expert computes on its rank, affinities zero outside each token's top K ------------------
E_LOCAL = 4  # 16 experts on 4 ranks: the case's rank (RandomState(42)) holds 4 of them
T_ALL = 8  # (tokens: the logits' rms test needs more than 2 tokens' 32 values to be a test)


def _all_experts_row(gap: float, local: bool, act_first: bool = True) -> tuple:
    """Inputs of an 8-token all-experts row (SiLU, router_act_first, norm_topk_prob, as the SiLU fp8 model rows,
    with bf16 weights and a router bias to move) whose token 0 has an expert ``b`` ``gap`` below its K-th exact
    logit (expert ``a``, another rank's): ``b`` one of the rank's own experts (``local``) or another rank's too.
    Returns the case, its inputs, the exact logits, a, b and the rank's experts. ``act_first=False``: Swish,
    clamp, neither router_act_first nor norm_topk_prob, as the all-experts Swish bf16 model rows."""
    case = moe_block_case(True, 1, T_ALL, H, None, INTER, E, E_LOCAL, K, *(
        ("SiLU", BF16, BF16, True, False, True, True) if act_first else
        ("Swish", BF16, BF16, True, True, False, False)), BF16)
    kw = dict(case.inputs())
    rank = int(kw["rank_id"][0, 0])
    own = range(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    x = kw["inp"].astype(np.float64).reshape(T_ALL, H)
    norm = x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-6) * kw["gamma"].astype(np.float64)
    base = norm @ kw["router_weights"].astype(np.float64)
    bias = np.zeros((1, E))
    order = [int(e) for e in np.argsort(-base[0])]
    a = next(e for e in order[:K][::-1] if e not in own)  # the lowest of the top K on another rank ...
    bias[0, a] = base[0, order[K - 1]] - base[0, a] + 1e-3  # ... made the K-th
    b = next(e for e in order[K:] if (e in own) == local)
    bias[0, b] = (base[0, a] + bias[0, a]) - base[0, b] - gap
    kw["router_bias"] = bias.astype(BF16)
    exact = base + kw["router_bias"].astype(np.float64)
    ranked = np.argsort(-exact[0])
    assert int(ranked[K - 1]) == a and int(ranked[K]) == b, (ranked, a, b)  # (the row is what it says)
    return case, kw, exact, a, b, own


def _tied(exact: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`_kernel_like`, the tie at the bf16 rounding of a and b's midpoint (each moved half the gap)."""
    logits, index = _kernel_like(exact, a, b)
    logits[0, a] = logits[0, b] = harness.cast_bf16(np.array([(exact[0, a] + exact[0, b]) / 2]))[0]
    return logits, index


@needs_checkout
def test_all_experts_a_near_tie_onto_the_ranks_own_expert_is_golden_gap_and_a_perturbed_token_is_not():
    """Token 0 routed to the rank's own expert b for another rank's a, 2e-4 below it: the kernel's out gains b's
    MLP on token 0 (the golden's has none of a's), the routed reference reproduces it."""
    with harness.nki_is_interpreter(ROOT):
        case, kw, exact, a, b, own = _all_experts_row(gap=2e-4, local=True)
        assert case.tapped_reference is not None
        logits, index = _tied(exact, a, b)
        why = _tied_token_is_golden_gap_and_3_percent_off_is_not(case, kw, logits, _taps(logits, index))
        assert f"token 0: golden [{a}] -> kernel [{b}]" in why and f"of them on this rank [{b}]" in why, why


@needs_checkout
def test_all_experts_a_near_tie_between_other_ranks_experts_does_not_excuse_an_out_error():
    """Token 0 routed to another rank's b for a: the rank's out changes only by the top-K normalization, so an out
    3 % off on token 0 is the kernel's own error: the reference routed as the kernel routes fails it."""
    with harness.nki_is_interpreter(ROOT):
        case, kw, exact, a, b, own = _all_experts_row(gap=2e-4, local=False)
        logits, index = _tied(exact, a, b)
        taps = _taps(logits, index)
        run = _run(case, kw)
        golden = run(lambda k: k)
        with case.tapped_reference.during(ROOT, taps):
            routed = run(lambda k: k)
        np.testing.assert_allclose(routed["out"], golden["out"], rtol=1e-2, atol=1e-5)  # (normalization only)
        actual = {"out": golden["out"].astype(np.float64), "router_logits": logits}
        actual["out"][0] *= 1.03
        failing = {n: j for n in case.outputs if not (j := harness.judge(case, n, actual[n], golden[n])).ok}
        assert list(failing) == ["out"]
        ok, why = harness.tapped_golden_gap(case, ROOT, kw, actual, golden, failing, taps)
        assert not ok and why.startswith("out: the kernel is at cosine"), why
        check = routing_projection(kw, taps, run)[1]
        assert check.ok and f"token 0: golden [{a}] -> kernel [{b}]" in check.figures, check
        assert "of them on this rank []" in check.figures, check


@needs_checkout
def test_all_experts_a_swap_onto_the_ranks_own_expert_beyond_the_bound_stays_mismatch():
    with harness.nki_is_interpreter(ROOT):
        case, kw, exact, a, b, own = _all_experts_row(gap=2e-4, local=True)
        bound = (2 + (H + 1) * 2.0 ** -16) * harness.BF16_UNIT * np.abs(exact[0]).max()
        case, kw, exact, a, b, own = _all_experts_row(gap=1.5 * bound, local=True)
        logits, index = _tied(exact, a, b)
        check = routing_projection(kw, _taps(logits, index), _run(case, kw))[1]
        assert not check.ok and check.figures.startswith(f"not a near tie: token 0: golden [{a}] -> kernel [{b}]")
        assert 1.4 < check.worst < 1.6 and f"of them on this rank [{b}]" in check.figures, check


def _affinity_taps(logits: np.ndarray, index: np.ndarray) -> dict:
    """The router tap of an all-experts kernel without router_act_first: its chosen-experts tile unwritten (zeros
    here), its affinities the softmax of each token's chosen logits scattered into zeros."""
    aff = np.zeros(logits.shape, np.float32)
    for tok, chosen in enumerate(index):
        top = np.exp(logits[tok, chosen] - logits[tok, chosen].max())
        aff[tok, chosen] = top / top.sum()
    return {ROUTER_TAP: [(0, p, (logits.astype(ml_dtypes.bfloat16), np.zeros(index.shape, np.uint32), aff))
                         for p in (0, 1)]}


@needs_checkout
def test_all_experts_without_router_act_first_reads_the_kernels_choice_off_its_affinities():
    """The kernel writes no chosen-experts tile there: the check reads each token's K nonzero affinities. A near
    tie onto the rank's own expert is GOLDEN_GAP, that token 3 % off is not; a token with K + 1 nonzero affinities
    is refused."""
    with harness.nki_is_interpreter(ROOT):
        case, kw, exact, a, b, own = _all_experts_row(gap=2e-4, local=True, act_first=False)
        assert case.tapped_reference is ROUTING_BY_AFFINITIES
        logits, index = _tied(exact, a, b)
        taps = _affinity_taps(logits, index)
        why = _tied_token_is_golden_gap_and_3_percent_off_is_not(case, kw, logits, taps)
        assert "read off its nonzero affinities" in why and f"token 0: golden [{a}] -> kernel [{b}]" in why, why
        # the same taps read as a chosen-experts tile: all zeros, not K distinct experts
        check = routing_projection(kw, taps, _run(case, kw))[1]
        assert not check.ok and "are not 4 distinct experts" in check.figures, check
        wide = {ROUTER_TAP: [(r, p, (v[0], v[1], v[2].copy())) for r, p, v in taps[ROUTER_TAP]]}
        for _, _, v in wide[ROUTER_TAP]:
            v[2][3, int(np.argmin(v[2][3]))] = 1e-3
        with pytest.raises(ValueError, match="token 3 has 5 nonzero affinities, not top_k = 4"):
            _router_tiles(wide, by_affinities=True)


def test_which_rows_have_the_routing_check():
    """bf16 input and router, selective or all experts; all experts without router_act_first read the kernel's
    choice off its affinities (no chosen-experts tile: router_topk's skip_store_expert_index); not fp16."""
    row = (1, 4, 4096, None, 192, 128, 16, 8, "SiLU", BF16, BF16, False, False)
    assert moe_block_case(True, *row, True, True, BF16).tapped_reference is ROUTING
    assert moe_block_case(False, *row, True, True, BF16).tapped_reference is ROUTING
    assert moe_block_case(False, *row, False, False, BF16).tapped_reference is ROUTING
    assert moe_block_case(True, *row, False, False, BF16).tapped_reference is ROUTING_BY_AFFINITIES
    f16 = np.dtype(np.float16)
    assert moe_block_case(True, *row[:9], BF16, f16, False, False, True, True, f16).tapped_reference is None


def test_a_folded_chosen_experts_tile_is_unfolded_token_by_token():
    """Past 128 tokens the kernel's chosen experts lie in SBUF as [128, T/128, K], token n * 128 + p at [p, n]."""
    t = 384
    rng = np.random.default_rng(3)
    index = np.stack([rng.permutation(E)[:K] for _ in range(t)])
    folded = np.zeros((128, t // 128, K), np.uint32)
    for tok in range(t):
        folded[tok % 128, tok // 128] = index[tok]
    logits = rng.uniform(-1, 1, (t, E)).astype(ml_dtypes.bfloat16)
    taps = {ROUTER_TAP: [(0, p, (logits, folded, None)) for p in (0, 1)]}
    got_logits, got = _router_tiles(taps)
    np.testing.assert_array_equal(got, index)
    other = folded.copy()
    other[5, 2, 0] = (other[5, 2, 0] + 1) % E
    with pytest.raises(ValueError, match="program 1 of rank 0 holds other logits or expert indices"):
        _router_tiles({ROUTER_TAP: [(0, 0, (logits, folded, None)), (0, 1, (logits, other, None))]})


@needs_checkout
@pytest.mark.slow
@pytest.mark.model_config
def test_the_all_experts_fp8_row_of_128_tokens_is_golden_gap_on_the_kernels_routing():
    """Token 23: experts 120 (another rank's, the golden's K-th) and 97 (rank 6's own) at exact logits 0.27051 /
    0.27040, 0.03 of the logits' bound apart; the kernel's bf16 router input puts 97 above (0.27092 / 0.27044 from
    it), so its out gains expert 97's MLP on that token (60 off the golden)."""
    case = moe_block_case(True, 128, 1, 4096, None, 192, 128, 16, 8, "SiLU", FP8, BF16, False, False, True, True,
                          BF16)
    row = harness.run_case(case, ROOT)
    assert row.result == harness.GOLDEN_GAP and harness.row_ok(case, row), harness.format_row(row)
    assert "4 of 128 tokens routed otherwise than the golden, each a near tie: token 23: golden [120] -> kernel " \
        "[97]" in row.message and "of them on this rank [97]" in row.message, row.message


@needs_checkout
@pytest.mark.slow
@pytest.mark.model_config
def test_an_all_experts_row_without_router_act_first_is_golden_gap_on_the_routing_read_off_its_affinities():
    """All experts Swish bf16, B=64 S=4 (256 tokens), 16 experts on rank 6: token 36's golden expert 106 (the rank's
    own) and the kernel's 35 at exact logits 0.34981 / 0.34958, 0.05 of the bound apart (out 109 off the golden)."""
    case = moe_block_case(True, 64, 4, 3072, 2880, 360, 128, 16, 4, "Swish", BF16, BF16, True, True, False, False,
                          BF16)
    row = harness.run_case(case, ROOT)
    assert row.result == harness.GOLDEN_GAP and harness.row_ok(case, row), harness.format_row(row)
    assert "read off its nonzero affinities" in row.message and "2 of 256 tokens routed otherwise than the golden, " \
        "each a near tie: token 36: golden [106] -> kernel [35]" in row.message, row.message
