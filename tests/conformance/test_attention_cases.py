"""attention_cte's and attention_bwd's conformance cases: every row of their tests' tables, read from the checkout, and
the references run in pieces on the rows whose scores do not fit at once (nki-library needed)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from trnkit.conformance import cases, cases_attention, harness
from trnkit.conformance.cli import FETCH_HINT

ROOT = harness.nkilib_root()
pytestmark = pytest.mark.skipif(ROOT is None, reason=f"no nki-library checkout or archive: {FETCH_HINT}")

CTE, BWD = "core/attention/attention_cte", "core/attention/attention_bwd"


def _cases(kernel: str) -> dict[str, harness.Case]:
    return {cases.case_id(c): c for c in cases.all_cases(ROOT) if c.kernel == kernel}


def test_every_row_of_the_cte_tables_is_a_case():
    """test_attention_cte.py's twelve explicit tables hold 344 rows as their tests run them (the four CP tables under
    both Q slicings, the manual CP sweep under LNC 1 / 2, both slicings and cached softmax on / off); one row
    repeats another, so 343 cases."""
    rows = cases_attention.cte_rows(ROOT)
    assert collections.Counter(r.table for r in rows) == {
        "no_cp": 17, "apc": 40, "vnc": 46, "gqa": 22, "barometer": 8, "cp_apc": 26, "cp_bk": 42, "cp_gqa": 34,
        "cp_barometer": 10, "sweep_nocp_manual": 12, "sweep_cp_manual": 72, "seq_pack": 15}
    assert len(_cases(CTE)) == 343
    # the vnc table's "Test if single core works" row: its test passes CompilerArgs() (LNC 2 on trn2), not its
    # vnc_degree column, so it runs as the row above it does
    vnc = [r for r in rows if r.table == "vnc" and (r.bs, r.sq, r.skv, r.d, r.scale) == (3, 1024, 2048, 128, 0.125)]
    assert [r.lnc for r in vnc] == [2, 2] and vnc[0] == vnc[1]
    # the GQA table passes its vnc_degree column on
    assert sorted({r.lnc for r in rows if r.table == "gqa"}) == [1, 2]


def test_cte_rows_are_read_as_their_tests_run_them():
    rows = cases_attention.cte_rows(ROOT)
    first = rows[0]  # no_cp: [1, 9216, 4096, 64, 0.5, np.float32, False, True, False, 580e6]
    assert (first.lnc, first.bs, first.bs_kv, first.skv, first.sq, first.d, first.scale, first.dt, first.causal,
            first.tp_q, first.tp_out, first.tp_k, first.sink, first.prior) == (
        2, 1, 1, 9216, 4096, 64, 0.5, np.dtype(np.float32), False, True, False, False, False, None)
    manual = [r for r in rows if r.table == "sweep_cp_manual"]
    assert all(r.sq == r.skv // r.cp[0] for r in manual)
    assert collections.Counter((r.lnc, r.cp[2], r.cache) for r in manual) == {
        (n, s, c): 9 for n in (1, 2) for s in (False, True) for c in (False, True)}
    # seqlen_q = 25600 / 5 = 5120 and 17000 / 17 = 1000: the second is not a multiple of 128, so with cached softmax
    # its four rows are the test's negative cases
    assert sum(r.negative for r in manual) == 4
    nocp = [r for r in rows if r.table == "sweep_nocp_manual"]
    assert all(r.cache and r.lnc == 2 for r in nocp) and sum(r.negative for r in nocp) == 2
    # the test validates nothing above 4 x 16384^2 query-key pairs (it only runs the kernel): 10 rows, from no_cp's
    # 36,864^2 to bs 8 x 16,384^2 and bs 2 x 32,768^2
    assert sum(not r.validated for r in rows) == 10
    pack = [r for r in rows if r.table == "seq_pack"]
    assert [r.lnc for r in pack][:4] == [1, 1, 1, 2] and all(r.packed in (4, 8) for r in pack)


def test_every_row_of_the_bwd_tables_is_a_case():
    """test_attention_bwd.py: the fast test's 32 base rows (batch 1-2 x heads 1, 3 x bf16 / fp32 x causal x sinks 0, 2)
    and 4 negative rows, the model test's 27 rows, the sequence-packing test's 24 rows (2 negative)."""
    tables = cases_attention.bwd_rows(ROOT)
    assert {k: len(v) for k, v in tables.items()} == {
        "fast_test_cases": 36, "attention_bwd_test_cases": 27, "sequence_packing_test_cases": 24}
    bwd = _cases(BWD)
    assert len(bwd) == 87
    assert sum(c.negative for c in bwd.values()) == 6
    sink_pack = bwd["core/attention/attention_bwd|packed bf16 seqs=2048+2000+48 causal sinks=1|lnc2"
                    "|b=1 heads=2/2 S=4096 d=64"]
    assert sink_pack.outputs[-1] == "out_dsinks_ref"


def _ref_kwargs(case: harness.Case) -> dict:
    inputs = case.inputs()
    return {k: harness._to_torch(v, case.keep_low_precision) for k, v in case.ref_inputs(inputs).items()} \
        if case.ref_inputs else {k: harness._to_torch(v, case.keep_low_precision) for k, v in inputs.items()}


def _cloned(kw: dict) -> dict:
    """The keyword arguments with every tensor copied (a golden may write into its inputs)."""
    return {k: (v.clone() if hasattr(v, "clone") else v) for k, v in kw.items()}


def _assert_same(whole: dict, pieces: dict) -> None:
    assert whole.keys() == pieces.keys()
    for name in whole:
        a, b = whole[name].float().numpy(), pieces[name].float().numpy()
        assert a.shape == b.shape, name
        # each piece's float32 matmuls are smaller ones over the same values: at most a last-bit difference
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("cid", [
    # CP with strided Q, sink, prior, sliding window, Q and K transposed, output transposed
    "cp_apc bf16 causal sw=256 tp_q tp_k tp_out sink prior=450/1 cp=2 rank=0 strided|lnc2|bs=3/3 Sq=2048 Skv=4096 d=64",
    # GQA with a prior, Q as [bs, d, Sq]
    "gqa bf16 tp_out prior=1024/512|lnc1|bs=4/2 Sq=2048 Skv=2048 d=128",
    # cached softmax statistics, CP rank 10 of 32 (contiguous Q)
    "sweep_cp_manual bf16 causal cache_softmax cp=32 rank=10|lnc2|bs=1/1 Sq=1024 Skv=32768 d=128",
    # sequence packing (bounds per query row), GQA
    "seq_pack bf16 causal tp_out packed=4|lnc2|bs=6/2 Sq=2048 Skv=2048 d=96",
])
def test_the_cte_golden_in_pieces_is_the_whole_call(cid):
    case = _cases(CTE)[f"{CTE}|{cid}"]
    with harness.nki_is_interpreter(ROOT):
        kw = _ref_kwargs(case)
        whole = cases_attention.attention_cte_golden(**_cloned(kw))
        keys = kw["v"].shape[1] + (int(kw["prior_used_len"].item()) if kw["k_prior"] is not None else 0)
        pieces = cases_attention.attention_cte_golden(chunk_bytes=128 * keys * 4, **kw)  # 128 query rows a call
    _assert_same(whole, pieces)


@pytest.mark.slow
@pytest.mark.parametrize("cid", [
    "fast fp32 causal sinks=2|lnc2|b=2 heads=3/3 S=2048 d=128",  # batch 2, two sinks per head
    "packed bf16 seqs=512+512 causal|lnc2|b=1 heads=4/2 S=1024 d=128",  # GQA: dk / dv summed over 2 query heads
    "packed bf16 seqs=256+256 causal|lnc1|b=1 heads=8/1 S=512 d=128",  # one KV head for 8 query heads
])
def test_the_bwd_golden_in_pieces_is_the_whole_call(cid):
    case = _cases(BWD)[f"{BWD}|{cid}"]
    with harness.nki_is_interpreter(ROOT):
        kw = _ref_kwargs(case)
        whole = cases_attention.attention_bwd_golden(**_cloned(kw))
        pieces = cases_attention.attention_bwd_golden(chunk_bytes=1, **kw)  # one query head a call
    _assert_same(whole, pieces)


def test_o_and_lse_in_pieces_are_the_whole_call():
    """The bwd inputs' o and lse (nki-library's compute_o_lse) one query head at a time: GQA and a sink per head."""
    args = (1, 4, 2, 512, 64, cases_attention.BF16, True, None, 1, None, None, None)
    with harness.nki_is_interpreter(ROOT):
        whole = cases_attention._bwd_inputs(*args)()
        pieces = cases_attention._bwd_inputs(*args, chunk_bytes=1)()
    for name in ("o_ref", "lse_ref"):
        np.testing.assert_array_equal(pieces[name].astype(np.float32), whole[name].astype(np.float32), err_msg=name)
