"""moe_block_tkg's routing check (``cases_moe_block.routing_projection``, ``routed_as_kernel``): a MISMATCH is
GOLDEN_GAP only where the kernel's router input is its exact RMS norm's bf16 rounding and its router logits that
input's exact logits' (derived bounds; the logits' float32 error at the accumulation depth counted from the router's
own taps, ``router_depth``), it routes otherwise than the golden only at near ties, and nki-library's reference routed
as the kernel routes reproduces ``out`` while the golden fails against it. Synthetic rows on nki-library's own
reference with the router's accumulation taps from the kernel's run at their shapes (small shapes, in milliseconds),
and real model-config rows (slow)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re

import ml_dtypes
import numpy as np
import pytest

from trnkit.conformance import harness
from trnkit.conformance.cases_moe_block import (BF16, FP8, NORM_TAP, ROUTER_ADD_TAPS, ROUTER_COPY_TAPS,
                                               ROUTER_MATMUL_TAPS, ROUTER_TAP, ROUTING, ROUTING_BY_AFFINITIES,
                                               _bf16_half_step, _gamma, _router_input, _router_tiles, moe_block_case,
                                               norm_error, rounded_once, router_depth, routing_projection)

ROOT = harness.nkilib_root()
needs_checkout = pytest.mark.skipif(ROOT is None, reason="no nki-library checkout or archive")
T, H, INTER, E, K = 2, 256, 8, 16, 4


def _near_tie(case: harness.Case, t: int, share: float = 0.5, gap: float | None = None, own: range | None = None,
              local: bool = False) -> tuple:
    """The case's inputs (its generator at these shapes) with a float32 router bias that makes token 0 a near tie
    the kernel's bf16 router input decides: experts a (the golden's K-th) and b (the (K+1)-th) placed ``gap``
    apart between the other experts' (K-1)-th and K-th logits, a and b the pair whose bf16 input's rounding moves
    b furthest above a (that move ``lift``; ``own``: a on another rank than the row's, b on it (``local``) or not);
    ``gap`` ``share`` of ``lift`` unless given. Returns the inputs, the bf16 input ``x_hat`` [t, H], its exact
    logits (``x_hat @ w + bias``, float64), a, b, ``lift`` and the room below a (the largest ``gap`` that keeps b
    above the other experts). (A float32 bias: the router adds it in float32, and a
    bf16 one would move the logits in steps coarser than the input's effect.)"""
    kw = dict(case.inputs())
    x = kw["inp"].astype(np.float64).reshape(t, H)
    norm = x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-6) * kw["gamma"].astype(np.float64)
    x_hat = harness.cast_bf16(norm)
    w = kw["router_weights"].astype(np.float64)
    exact, fed = (norm @ w)[0], (x_hat @ w)[0]
    move = fed - exact  # (the input's rounding's effect on token 0's logits)
    pairs = [(move[b] - move[a], a, b) for a in range(E) for b in range(E) if a != b
             and (own is None or (a not in own and (b in own) == local))]
    lift, a, b = max(pairs)
    gap = share * lift if gap is None else gap
    others = np.sort(np.delete(exact, [a, b]))[::-1]
    level = (others[K - 2] + others[K - 1]) / 2
    room = level - others[K - 1]
    assert lift > 0 and 0 < gap < room, (lift, gap, room)  # (b stays above the other experts' K-th)
    bias = np.zeros((1, E))
    bias[0, a], bias[0, b] = level - exact[a], level - gap - exact[b]
    kw["router_bias"] = bias.astype(np.float32)
    fed_logits = x_hat @ w + kw["router_bias"].astype(np.float64)
    ranked = np.argsort(-(norm @ w + kw["router_bias"].astype(np.float64))[0])
    assert int(ranked[K - 1]) == a and int(ranked[K]) == b, (ranked, a, b)  # (the row is what it says)
    return kw, x_hat, fed_logits, a, b, lift, room


def _kernel_like(fed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bf16 logits of the tapped input's exact logits ``fed`` (each its round to nearest) and the kernel's
    choice, a top-K of them (ties broken by ``fed``)."""
    logits = harness.cast_bf16(fed)
    index = np.stack([np.lexsort((-fed[tok], -logits[tok]))[:K] for tok in range(fed.shape[0])])
    return logits, index


def _norm_tile(x_hat: np.ndarray, single_core: bool) -> np.ndarray:
    """``x_hat`` [T, H] as the RMS-norm tile [128, T, H/128] (``cases_moe_block._router_input``'s layout)."""
    n, t = 1 if single_core else 2, x_hat.shape[0]
    return x_hat.reshape(t, n, 128, H // (128 * n)).transpose(2, 0, 1, 3).reshape(128, t, H // 128)


_STRUCTURE: dict[str, dict] = {}


def _router_structure(case: harness.Case) -> dict:
    """The router's accumulation taps (where its matmuls' and sums' operands lie: ``ROUTER_MATMUL_TAPS``,
    ``ROUTER_ADD_TAPS``, ``ROUTER_COPY_TAPS``) of the case's kernel run on its own inputs: the structure (which
    tokens and hidden tiles each matmul reads, its PSUM group, the adds after it), the same at any values."""
    key = harness.case_id(case)
    if key not in _STRUCTURE:
        kernel = harness._resolve(case.entry, ROOT)
        with contextlib.redirect_stdout(io.StringIO()), harness.tap(
                ROUTER_MATMUL_TAPS + ROUTER_ADD_TAPS + ROUTER_COPY_TAPS, ROOT) as tapped:
            harness._launch(case, kernel, harness._copies([harness.case_inputs(case)])[0])
        _STRUCTURE[key] = tapped
    return _STRUCTURE[key]


def _taps(case: harness.Case, logits: np.ndarray, index: np.ndarray, x_hat: np.ndarray) -> dict:
    """The routing check's taps: the router input ``x_hat`` and ``logits`` / ``index`` as the kernel would record
    them, and the router's accumulation structure from the case's own kernel run (:func:`_router_structure`)."""
    kw = case.inputs()
    single_core = not kw["is_all_expert"] and x_hat.shape[0] > 1
    tile = _norm_tile(x_hat, single_core).astype(ml_dtypes.bfloat16)
    return {**_router_structure(case), NORM_TAP: [(0, p, tile) for p in (0, 1)],
            ROUTER_TAP: [(0, p, (logits.astype(ml_dtypes.bfloat16), index.astype(np.uint32), None))
                         for p in (0, 1)]}


def _selective_row(**tie: float) -> tuple:
    case = moe_block_case(False, 1, T, H, None, INTER, E, E, K, "Swish", BF16, BF16, True, True, False, False, BF16)
    return (case, *_near_tie(case, T, **tie))


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
        case, kw, x_hat, fed, a, b, lift, room = _selective_row()
        logits, index = _kernel_like(fed)
        assert b in index[0] and a not in index[0]
        why = _tied_token_is_golden_gap_and_3_percent_off_is_not(case, kw, logits, _taps(case, logits, index, x_hat))
        assert f"1 of {T} tokens routed otherwise than the golden, each a near tie: token 0: golden [{a}] -> " \
            f"kernel [{b}]" in why, why
        assert "input: 1 tile(s) within their bound" in why and "logits: 1 tile(s) within their bound" in why, why


def _step_away(value: float, exact: float) -> float:
    """``value`` (a bf16 value) one bf16 step further from ``exact``."""
    spacing = 2.0 ** (np.floor(np.log2(abs(value))) - 7)
    return value + spacing * (1.0 if value >= exact else -1.0)


def _truncated(x: np.ndarray) -> np.ndarray:
    """``x`` rounded toward zero to bf16 (float32's low 16 bits dropped), back in float64."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)


@needs_checkout
def test_an_input_or_logits_one_bf16_step_off_or_truncated_stay_mismatch_naming_tile_value_and_rule():
    """(a1) the tapped input is its exact RMS norm's round to nearest within the float32 error, (a2) the logits the
    tapped input's exact logits' within gamma_H: one value one bf16 step off or a truncating rounding fails,
    naming the tile, the element, its value and the rule."""
    with harness.nki_is_interpreter(ROOT):
        case, kw, x_hat, fed, a, b, lift, room = _selective_row()
        logits, index = _kernel_like(fed)
        run = _run(case, kw)
        golden = run(lambda k: k)
        actual = {"out": golden["out"].astype(np.float64) * 1.5, "router_logits": logits}
        failing = {"out": harness.judge(case, "out", actual["out"], golden["out"])}

        def refused(x_in: np.ndarray, lg: np.ndarray) -> str:
            ok, why = harness.tapped_golden_gap(case, ROOT, kw, dict(actual, router_logits=lg), golden, failing,
                                                _taps(case, lg, index, x_in))
            assert not ok, why
            return why

        x = kw["inp"].astype(np.float64).reshape(T, H)
        norm = x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-6) * kw["gamma"].astype(np.float64)
        off = x_hat.copy()
        off[1, 77] = _step_away(off[1, 77], norm[1, 77])
        why = refused(off, logits)
        assert why.startswith("tapped router input: 1 of 512 values beyond one bf16 round to nearest of a float32 "
                              f"value within the derived float32 error: the first at token 1, feature 77: "
                              f"{off[1, 77]!r} against the exact RMS norm") and why.endswith("beyond its bound"), why
        why = refused(_truncated(norm), logits)
        assert why.startswith("tapped router input: ") and "values beyond one bf16 round to nearest" in why, why
        lg = logits.copy()
        lg[1, 5] = _step_away(lg[1, 5], fed[1, 5])
        why = refused(x_hat, lg)
        assert why.startswith("tapped router logits: 1 of 32 values beyond one bf16 round to nearest of a float32 "
                              f"value within the derived float32 error: the first at token 1, feature 5: "
                              f"{lg[1, 5]!r} against the tapped input's exact logit"), why
        why = refused(x_hat, _truncated(fed))
        assert why.startswith("tapped router logits: ") and "values beyond one bf16 round to nearest" in why, why
        # router logits 3 % off on token 1
        lg = logits.copy()
        lg[1] *= 1.03
        assert refused(x_hat, lg).startswith("tapped router logits: ")
        # and unperturbed, the same taps are within both bounds (the check is what refused them)
        checks = routing_projection(kw, _taps(case, logits, index, x_hat), run)
        assert [c.label for c in checks] == ["router input", "router logits", "routing"]
        assert all(c.ok for c in checks), checks
        assert checks[0].worst <= 1 and checks[1].worst <= 1


@needs_checkout
def test_a_selection_that_is_not_a_top_k_or_not_a_near_tie_stays_mismatch():
    with harness.nki_is_interpreter(ROOT):
        case, kw, x_hat, fed, a, b, lift, room = _selective_row()
        run = _run(case, kw)
        # a choice the kernel's own logits do not make a top-K: refused
        logits, index = _kernel_like(fed)
        logits[0, b] = logits[0, b] - 0.01
        check = routing_projection(kw, _taps(case, logits, index, x_hat), run)[2]
        assert not check.ok and "are not a top-4 of its own router logits" in check.figures, check
        # a swap well outside the window (its logits then beyond (a2) as well: the window is implied by (a2) and
        # the top-K), logits tied at the midpoint
        case, kw, x_hat, fed, a, b, lift, room = _selective_row(gap=0.9 * room)
        logits, index = _kernel_like(fed)
        index[0, list(index[0]).index(a)] = b
        mid = harness.cast_bf16(np.array([(fed[0, a] + fed[0, b]) / 2]))[0]
        logits[0, a] = logits[0, b] = mid
        a1, a2, check = routing_projection(kw, _taps(case, logits, index, x_hat), _run(case, kw))
        assert a1.ok and not a2.ok and "the first at token 0" in a2.figures, a2
        assert not check.ok and check.figures.startswith(f"not a near tie: token 0: golden [{a}] -> kernel [{b}]")
        assert check.worst > 1, check


def test_the_norms_float32_error_bound():
    """norm_error(H): (1 - gamma_{H+2})^(-1/2) (1 + u)^2 / (1 - u) - 1, about (H / 2 + 4) u."""
    u = 2.0 ** -24
    for h in (256, 3072, 4096, 8192):
        assert norm_error(h) == pytest.approx((h / 2 + 4) * u, rel=1e-3)
        assert norm_error(h) >= (h / 2 + 4) * u


@needs_checkout
def test_the_router_input_is_read_in_the_kernels_layout():
    """Selective experts with more than one token: rmsnorm_tkg single_core_forced, [128, T, H/128] with h = p H/128 +
    j; otherwise the LNC's two H shards, h = s H/2 + p H/256 + j; programs that differ are refused."""
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (3, 512))
    for single_core, n in ((True, 1), (False, 2)):
        tile = np.zeros((128, 3, 4))
        for tok in range(3):
            for h in range(512):
                s, rest = divmod(h, 512 // n)
                p, j = divmod(rest, 512 // (128 * n))
                tile[p, tok, s * (4 // n) + j] = x[tok, h]
        taps = {NORM_TAP: [(0, 0, tile), (0, 1, tile)]}
        np.testing.assert_array_equal(_router_input(taps, 3, 512, single_core), x)
    other = tile.copy()
    other[3, 1, 2] += 1
    with pytest.raises(ValueError, match="program 1 of rank 0 holds another router input than program 0"):
        _router_input({NORM_TAP: [(0, 0, tile), (0, 1, other)]}, 3, 512, False)


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
    assert "counted from the router's taps: d = 127 + 5 + 1 + 3 = 136" in row.message, row.message


# -- all experts: every expert computes on its rank, affinities zero outside each token's top K ------------------
E_LOCAL = 4  # 16 experts on 4 ranks: the case's rank (RandomState(42)) holds 4 of them
T_ALL = 8


def _all_experts_row(local: bool, act_first: bool = True, **tie: float) -> tuple:
    """An 8-token all-experts row (SiLU, router_act_first, norm_topk_prob, as the SiLU fp8 model rows, with bf16
    weights) whose token 0 is a near tie (:func:`_near_tie`) between another rank's a (the golden's K-th) and b,
    one of the rank's own experts (``local``) or another rank's too. Returns the case, its inputs, the bf16 input,
    its exact logits, a, b, the lift, the room and the rank's experts. ``act_first=False``: Swish, clamp, neither
    router_act_first nor norm_topk_prob, as the all-experts Swish bf16 model rows."""
    case = moe_block_case(True, 1, T_ALL, H, None, INTER, E, E_LOCAL, K, *(
        ("SiLU", BF16, BF16, True, False, True, True) if act_first else
        ("Swish", BF16, BF16, True, True, False, False)), BF16)
    rank = int(case.inputs()["rank_id"][0, 0])
    own = range(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    return (case, *_near_tie(case, T_ALL, own=own, local=local, **tie), own)


@needs_checkout
def test_all_experts_a_near_tie_onto_the_ranks_own_expert_is_golden_gap_and_a_perturbed_token_is_not():
    """Token 0 routed to the rank's own expert b for another rank's a, half the input's lift below it: the kernel's
    out gains b's MLP on token 0 (the golden's has none of a's), the routed reference reproduces it."""
    with harness.nki_is_interpreter(ROOT):
        case, kw, x_hat, fed, a, b, lift, room, own = _all_experts_row(local=True)
        assert case.tapped_reference is not None
        logits, index = _kernel_like(fed)
        why = _tied_token_is_golden_gap_and_3_percent_off_is_not(case, kw, logits, _taps(case, logits, index, x_hat))
        assert f"token 0: golden [{a}] -> kernel [{b}]" in why and f"of them on this rank [{b}]" in why, why


@needs_checkout
def test_all_experts_a_near_tie_between_other_ranks_experts_does_not_excuse_an_out_error():
    """Token 0 routed to another rank's b for a: the rank's out changes only by the top-K normalization, so an out
    3 % off on token 0 is the kernel's own error: the reference routed as the kernel routes fails it."""
    with harness.nki_is_interpreter(ROOT):
        case, kw, x_hat, fed, a, b, lift, room, own = _all_experts_row(local=False)
        logits, index = _kernel_like(fed)
        taps = _taps(case, logits, index, x_hat)
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
        check = routing_projection(kw, taps, run)[2]
        assert check.ok and f"token 0: golden [{a}] -> kernel [{b}]" in check.figures, check
        assert "of them on this rank []" in check.figures, check


@needs_checkout
def test_all_experts_a_swap_onto_the_ranks_own_expert_outside_the_window_stays_mismatch():
    with harness.nki_is_interpreter(ROOT):
        case, kw, x_hat, fed, a, b, lift, room, own = _all_experts_row(local=True)
        case, kw, x_hat, fed, a, b, lift, room, own = _all_experts_row(local=True, gap=0.9 * room)
        logits, index = _kernel_like(fed)
        index[0, list(index[0]).index(a)] = b
        logits[0, a] = logits[0, b] = harness.cast_bf16(np.array([(fed[0, a] + fed[0, b]) / 2]))[0]
        a1, a2, check = routing_projection(kw, _taps(case, logits, index, x_hat), _run(case, kw))
        assert a1.ok and not a2.ok, a2
        assert not check.ok and check.figures.startswith(f"not a near tie: token 0: golden [{a}] -> kernel [{b}]")
        assert check.worst > 1 and f"of them on this rank [{b}]" in check.figures, check


def _affinity_taps(case: harness.Case, logits: np.ndarray, index: np.ndarray, x_hat: np.ndarray) -> dict:
    """The taps of an all-experts kernel without router_act_first: its router input, its chosen-experts tile
    unwritten (zeros here), its affinities the softmax of each token's chosen logits scattered into zeros."""
    aff = np.zeros(logits.shape, np.float32)
    for tok, chosen in enumerate(index):
        top = np.exp(logits[tok, chosen] - logits[tok, chosen].max())
        aff[tok, chosen] = top / top.sum()
    return {**_taps(case, logits, index, x_hat),
            ROUTER_TAP: [(0, p, (logits.astype(ml_dtypes.bfloat16), np.zeros(index.shape, np.uint32), aff))
                         for p in (0, 1)]}


@needs_checkout
def test_all_experts_without_router_act_first_reads_the_kernels_choice_off_its_affinities():
    """The kernel writes no chosen-experts tile there: the check reads each token's K nonzero affinities. A near
    tie onto the rank's own expert is GOLDEN_GAP, that token 3 % off is not; a token with K + 1 nonzero affinities
    is refused."""
    with harness.nki_is_interpreter(ROOT):
        case, kw, x_hat, fed, a, b, lift, room, own = _all_experts_row(local=True, act_first=False)
        assert case.tapped_reference is ROUTING_BY_AFFINITIES
        logits, index = _kernel_like(fed)
        taps = _affinity_taps(case, logits, index, x_hat)
        why = _tied_token_is_golden_gap_and_3_percent_off_is_not(case, kw, logits, taps)
        assert "read off its nonzero affinities" in why and f"token 0: golden [{a}] -> kernel [{b}]" in why, why
        # the same taps read as a chosen-experts tile: all zeros, not K distinct experts
        check = routing_projection(kw, taps, _run(case, kw))[2]
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
    assert "counted from the router's taps: d = 127 + 31 + 0 = 158" in row.message, row.message


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
    assert "counted from the router's taps: d = 127 + 23 + 1 + 0 = 151" in row.message, row.message


# -- (a2)'s depth, counted from the router's own taps ----------------------------------------------------------------
def _row(all_e: bool, t: int, h: int, bias: bool) -> harness.Case:
    """A small row: all experts (SiLU, router_act_first, norm_topk_prob, as the SiLU fp8 model rows, with bf16
    weights) or selective experts (Swish, clamp), ``t`` tokens of hidden size ``h``, 16 experts, I = 8."""
    if all_e:
        return moe_block_case(True, 1, t, h, None, INTER, E, E_LOCAL, K, "SiLU", BF16, BF16, bias, False, True, True,
                              BF16)
    return moe_block_case(False, 1, t, h, None, INTER, E, E, K, "Swish", BF16, BF16, bias, True, False, False, BF16)


@needs_checkout
@pytest.mark.parametrize("all_e, t, h, bias, how", [
    (False, 2, 256, True, "d = 127 + 0 + 1 + 1 = 129 (128-row matmuls, 1 into a PSUM group, the bias add, 1 "
                          "column-tile merge)"),
    (True, 8, 4096, False, "d = 127 + 7 + 3 = 137 (128-row matmuls, 8 into a PSUM group, 3 column-tile merges)"),
    (True, 128, 4096, False, "d = 127 + 31 + 0 = 158 (128-row matmuls, 32 into a PSUM group, 0 column-tile "
                             "merges)"),
    (True, 256, 3072, True, "d = 127 + 23 + 1 + 0 = 151 (128-row matmuls, 24 into a PSUM group, the bias add, 0 "
                            "column-tile merges)"),
])
def test_the_router_depth_is_counted_from_its_taps(all_e, t, h, bias, how):
    """By hand from router_topk: each matmul contracts one 128-row hidden tile (127 additions); a core with at most 32
    tokens splits the PE array into 4 column tiles of 32 (64: 2, else 1), hidden tile j accumulating into column
    tile j % 4 of its PSUM tile, so each PSUM group takes H/128/4 matmuls (at most H/128, one group for hidden tiles
    < 4); the first column tile is copied (or added to the float32 bias: one rounding) into the float32 logits and
    each other one added onto them. Selective experts with T > 1 shard the tokens over the two programs (one token
    each at T = 2: 2 hidden tiles, 2 of the 4 column tiles used); all experts compute every token on both; past 128
    tokens a core works on 128-token tiles, each its own PSUM tile."""
    with harness.nki_is_interpreter(ROOT):
        depth, got = router_depth(_router_structure(_row(all_e, t, h, bias)), t, h)
    assert got == how
    np.testing.assert_array_equal(depth, np.full(t, int(how.split(" = ")[-1].split()[0])))


@needs_checkout
def test_a_router_structure_the_count_does_not_cover_is_refused_naming_it():
    """A matmul missing (its hidden tile never contracted for its token), a column-tile merge missing (a PSUM group
    read by no instruction), a program missing (its token computed by nothing): ValueError naming the program, the
    token or the group; a zero-depth guess is never used."""
    with harness.nki_is_interpreter(ROOT):
        taps = _router_structure(_row(False, 2, 256, True))

    def without(specs: tuple[str, ...], program: int, k: int | None = None) -> dict:
        out = dict(taps)
        for spec in specs:
            mine = [i for i, (_, p, _) in enumerate(taps[spec]) if p == program]
            drop = set(mine) if k is None else {mine[k]}
            out[spec] = [c for i, c in enumerate(taps[spec]) if i not in drop]
        return out

    with pytest.raises(ValueError, match=r"program 0 of rank 0: token 0's hidden tile 1 contracted 0 times"):
        router_depth(without(ROUTER_MATMUL_TAPS, 0, 1), 2, 256)
    with pytest.raises(ValueError, match=r"program 1 of rank 0: a PSUM group of the router's matmuls read by 0 "):
        router_depth(without(ROUTER_ADD_TAPS, 1, 1), 2, 256)
    with pytest.raises(ValueError, match=r"token 1's logits computed by no router matmul"):
        router_depth(without(ROUTER_MATMUL_TAPS + ROUTER_ADD_TAPS + ROUTER_COPY_TAPS, 1), 2, 256)
    with pytest.raises(ValueError, match=r"program 0 of rank 0 recorded 1 nc_matmul\(dst:where\), 2 "):
        router_depth({**taps, ROUTER_MATMUL_TAPS[0]: without(ROUTER_MATMUL_TAPS, 0, 1)[ROUTER_MATMUL_TAPS[0]]}, 2, 256)


def _with_logits(taps: dict, logits: np.ndarray) -> dict:
    """``taps`` with the kernel's router logits replaced (every program's)."""
    return {**taps, ROUTER_TAP: [(r, p, (logits.astype(ml_dtypes.bfloat16), *v[1:])) for r, p, v in taps[ROUTER_TAP]]}


def _kernel_row(t: int = 8, h: int = 4096) -> tuple:
    """The all-experts row at ``t`` tokens of hidden size ``h`` (:func:`_row`, no bias) run on the kernel with the
    routing check's taps: the case, its inputs, the taps, the tapped input's exact logits, sum|x_hat w| and the
    tokens' counted depth."""
    case = _row(True, t, h, False)
    kw = harness.case_inputs(case)
    kernel = harness._resolve(case.entry, ROOT)
    with contextlib.redirect_stdout(io.StringIO()), harness.tap(ROUTING.taps, ROOT) as taps:
        harness._launch(case, kernel, harness._copies([kw])[0])
    x_hat = _router_input(taps, t, h, single_core=False)
    w = kw["router_weights"].astype(np.float64)
    depth, _ = router_depth(taps, t, h)
    return case, kw, taps, x_hat @ w, np.abs(x_hat) @ np.abs(w), depth


@needs_checkout
def test_an_evenly_spread_1_percent_logits_error_or_one_step_off_passed_gamma_h_and_fails_the_counted_depth():
    """H = 4,096, the kernel's own taps (d = 137 on every token): its logits pass (a2); an error of 0.9 % of the
    logits' rms on every logit (signs alternating; the former bound's float32 part gamma_H sum|x_hat w| is 0.94-1.0 %
    of that rms here, gamma_137's 0.03 %), and one logit one bf16 step off, lie within the former bound (asserted:
    the check before let them through) and fail gamma_d's, naming the tile, the element, its value and the rule."""
    with harness.nki_is_interpreter(ROOT):
        case, kw, taps, fed, abs_sum, depth = _kernel_row()
        run = _run(case, kw)
        assert all(c.ok for c in routing_projection(kw, taps, run)[:2])
        assert np.all(depth == 137)
        former = (_gamma(4096) + _gamma(4097, 2.0 ** -53)) * abs_sum  # (a2) until this check: gamma_H

        def judged(logits: np.ndarray) -> tuple:
            before = rounded_once(logits, fed, former, "router logits", "the tapped input's exact logit")
            return before, routing_projection(kw, _with_logits(taps, logits), run)[1]

        sign = (-1.0) ** np.add.outer(np.arange(fed.shape[0]), np.arange(fed.shape[1]))
        rms = np.sqrt(np.mean(fed ** 2))
        assert 0.0094 < (_gamma(4096) * abs_sum).min() / rms < (_gamma(4096) * abs_sum).max() / rms < 0.01
        spread = harness.cast_bf16(fed + 0.009 * rms * sign)
        before, after = judged(spread)
        assert before.ok, before
        assert not after.ok and after.label == "router logits", after
        assert re.match(r"1\d\d of 128 values beyond one bf16 round to nearest of a float32 value within the derived "
                        r"float32 error: the first at token \d+, feature \d+: .* against the tapped input's exact "
                        r"logit .*counted from the router's taps: d = 127 \+ 7 \+ 3 = 137", after.figures), after
        # one logit one bf16 step further from its exact value, where that is beyond the counted bound only
        logits = harness.cast_bf16(fed)
        err = np.abs(np.vectorize(_step_away)(logits, fed) - fed)
        counted = (_gamma(depth).reshape(-1, 1) + _gamma(4097, 2.0 ** -53)) * abs_sum
        bound = {k: _bf16_half_step(np.abs(fed) + v) + v for k, v in (("counted", counted), ("former", former))}
        tok, f = (int(i) for i in np.argwhere((err > bound["counted"]) & (err <= bound["former"]))[0])
        logits[tok, f] = _step_away(logits[tok, f], fed[tok, f])
        before, after = judged(logits)
        assert before.ok, before
        assert not after.ok and after.figures.startswith(
            f"1 of 128 values beyond one bf16 round to nearest of a float32 value within the derived float32 error: "
            f"the first at token {tok}, feature {f}: {logits[tok, f]!r}"), after


def _toward_zero(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b`` (float32) rounded toward zero to float32, as a truncating adder would."""
    exact = a.astype(np.float64) + b.astype(np.float64)
    r = exact.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(exact)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r


@needs_checkout
def test_a_truncating_float32_accumulation_at_the_counted_depth_is_within_the_bound():
    """What (a2) cannot see (docs/interpreter.md says why): the kernel's logits computed with every one of the d = 137
    counted float32 additions rounded toward zero (each 128-row matmul's sum one product at a time, the PSUM
    accumulation of its column tile's 8 matmuls, the 3 column-tile merges; the products exact), then rounded to
    nearest bf16, pass (a2): the bound must hold for round to nearest in any order, where the partial sums can be as
    large as sum|x_hat w|, and a truncating sum of these terms, whose partial sums stay near the logits (a median
    |logit| 1/48 of it here), errs far less (0.0035 of gamma_d sum|x_hat w| at most, measured)."""
    t, h, tiles = 8, 4096, 4
    with harness.nki_is_interpreter(ROOT):
        case, kw, taps, fed, abs_sum, depth = _kernel_row(t, h)
        x_hat = _router_input(taps, t, h, single_core=False)
        w = kw["router_weights"].astype(np.float64)
        columns = []
        for c in range(tiles):  # (hidden tile j of core shard s: h = s H/2 + p H/256 + j', _router_input's layout)
            acc = None
            for j in range(c, h // 128, tiles):
                s, jj = divmod(j, h // 256)
                rows = s * h // 2 + np.arange(128) * (h // 256) + jj
                products = (x_hat[:, rows, None] * w[None, rows, :]).astype(np.float32)  # (exact: bf16 x bf16)
                mm = products[:, 0]
                for p in range(1, 128):
                    mm = _toward_zero(mm, products[:, p])
                acc = mm if acc is None else _toward_zero(acc, mm)
            columns.append(acc)
        total = columns[0]
        for c in columns[1:]:
            total = _toward_zero(total, c)
        share = np.abs(total - fed) / (_gamma(depth).reshape(-1, 1) * abs_sum)
        assert 0 < share.max() < 0.02, share.max()
        a2 = routing_projection(kw, _with_logits(taps, harness.cast_bf16(total)), _run(case, kw))[1]
        assert a2.ok and "d = 127 + 7 + 3 = 137" in a2.figures, a2
