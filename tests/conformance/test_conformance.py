"""AWS nki-library's core kernels on the interpreter, against nki-library's own references.

Runs only with a local checkout: ``NKILIB_SRC=/path/to/nki-library`` (git clone of
https://github.com/aws-neuron/nki-library); CI has no network, so these are skipped there. Every case of
``trnkit.conformance.cases`` must PASS (a negative case: be rejected as nki-library's test expects).
``python -m trnkit conformance`` prints the same cases as a table.
"""

from __future__ import annotations

import pytest

from trnkit.conformance import cases, harness
from trnkit.conformance.cli import FETCH_HINT

ROOT = harness.nkilib_root()
CASES = cases.all_cases()

pytestmark = [
    pytest.mark.slow,  # minutes for the whole table
    pytest.mark.skipif(ROOT is None, reason=f"no nki-library checkout: {FETCH_HINT}"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kernel}|{c.name}|lnc{c.lnc}|{c.shapes}" for c in CASES])
def test_nkilib_case(case):
    row = harness.run_case(case, ROOT)
    assert row.result == harness.PASS, harness.format_row(row)
