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
from trnkit.conformance.cases_moe_block import BF16, ROUTER_TAP, moe_block_case, routing_projection

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


@needs_checkout
def test_a_near_tie_routed_as_the_kernel_is_golden_gap_and_a_perturbed_token_is_not():
    with harness.nki_is_interpreter(ROOT):
        case, kw, exact, a, b = _row(gap=2e-4)
        logits, index = _kernel_like(exact, a, b)
        taps = _taps(logits, index)
        run = _run(case, kw)
        golden = run(lambda k: k)
        with case.tapped_reference.during(ROOT, taps):
            routed = run(lambda k: k)
        # the routed reference took the kernel's experts: token 0's out is not the golden's, token 1's is
        assert not np.allclose(routed["out"][0], golden["out"][0], rtol=1e-2, atol=1e-5)
        np.testing.assert_array_equal(routed["out"][1:], golden["out"][1:])
        actual = {"out": routed["out"].astype(np.float64), "router_logits": logits}
        failing = {n: j for n in case.outputs if not (j := harness.judge(case, n, actual[n], golden[n])).ok}
        assert list(failing) == ["out"]
        ok, why = harness.tapped_golden_gap(case, ROOT, kw, actual, golden, failing, taps)
        assert ok, why
        assert f"1 of {T} tokens routed otherwise than the golden, each a near tie: token 0: golden [{a}] -> " \
            f"kernel [{b}]" in why, why
        # the kernel's out off on the tied token by 3 %: the reference routed as it routes no longer matches it
        perturbed = dict(actual, out=actual["out"].copy())
        perturbed["out"][0] *= 1.03
        ok, why = harness.tapped_golden_gap(case, ROOT, kw, perturbed, golden, failing, taps)
        assert not ok and why.startswith("out: the kernel is at cosine"), why


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
