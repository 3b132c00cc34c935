"""AWS nki-library's kernels on the interpreter, against nki-library's own references.

The checkout comes from ``NKILIB_SRC``, else the archive ``nki-library-<commit>.tar.gz`` in
``shared/thirdparty/`` next to the source tree (or ``NKILIB_TARBALL``) is extracted to the temp dir
(:func:`trnkit.conformance.harness.nkilib_root`). Every case of ``trnkit.conformance.cases`` must PASS
(a negative case: be rejected as nki-library's test expects). Two tiers: the cases of
``cases.FAST`` (at least one per kernel, seconds) run in the fast suite, so a new interpreter rule
that breaks an AWS kernel fails CI; every other case is ``slow`` (the rows of nki-library's
model-config tables among them). A case nki-library's test marks ``xfail(strict=False)`` ends xfailed only
when its mismatch is the cause the case checks (XFAIL; any other mismatch fails); a mismatch whose cause is
nki-library's golden, checked per row (GOLDEN_GAP, ``harness.golden_gap``), ends xfailed too, as does one whose cause is
the kernel's own placement, checked per row (STALE_READ: it read placed tiles another tile overwrote, and passes
with each placed tile on storage of its own); a case whose inputs make
the kernel break a documented hardware rule, or fail nki-library's own kernel check (``Case.rejected_by``),
must fail with that message; a row nki-library's test skips runs, is checked the same way, and is then
reported skipped. ``python -m trnkit conformance``
prints the same cases as a table.
"""

from __future__ import annotations

import pytest

from trnkit.conformance import cases, harness
from trnkit.conformance.cli import FETCH_HINT

ROOT = harness.nkilib_root()
CASES = cases.all_cases()
FAST = set(cases.FAST)

pytestmark = pytest.mark.skipif(ROOT is None, reason=f"no nki-library checkout or archive: {FETCH_HINT}")


def _param(case: harness.Case):
    cid = cases.case_id(case)
    marks = [] if cid in FAST else [pytest.mark.slow]
    if case.tier in (harness.MODEL_CONFIG, harness.REDUCED):  # hours: deselect with -m "slow and not model_config"
        marks.append(pytest.mark.model_config)
    return pytest.param(case, id=cid, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_nkilib_case(case):
    row = harness.run_case(case, ROOT)
    assert harness.row_ok(case, row), harness.format_row(row)
    # a failure whose cause is checked: nki-library's xfail mark, its golden out of reach of the kernel's declared
    # roundings, or the kernel's own placement (it reads tiles it overwrote)
    if row.result in (harness.XFAIL, harness.GOLDEN_GAP, harness.STALE_READ):
        pytest.xfail(row.message)
    if row.result == harness.SKIPPED:  # as nki-library's test does, after checking how the row runs
        pytest.skip(row.message)
