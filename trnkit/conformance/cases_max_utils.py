"""Conformance cases of nki-library's core/max cascaded_max_utils (``predicated_folded_load``, ``unfolded_store``),
written from ``test/integration/nkilib/core/max/test_cascaded_max_utils.py``.

The test's own kernels (``folded_load_store_kernel``, ``folded_load_store_dst_kernel``,
``folded_load_oversized_sb_kernel``) and torch references are imported from its file (``harness.load_test_module``);
every row of its four tables, at their LNC. Inputs as the test draws them: ``np.random.seed(42)``, a [b, n] fp32
``randn``; its validator's default tolerances (rtol 1e-5, atol 1e-8)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .harness import Case

__all__ = ["max_utils_cases"]

KERNEL = "core/max/cascaded_max_utils"
TEST = "test/integration/nkilib/core/max/test_cascaded_max_utils.py"

# lnc, b, n, fold_factor (full_batch_perms)
_FULL = [(1, 8, 256, 1), (2, 8, 256, 2), (1, 4, 1024, 4), (2, 16, 512, 8), (1, 1, 3168, 4), (2, 8, 4058, 8),
         (1, 4, 3999, 16), (1, 1, 25600, 32), (1, 1, 128, 1), (2, 2, 256, 128), (2, 3, 256, 2), (2, 5, 512, 4),
         (2, 7, 3168, 4), (2, 3, 4058, 8)]
# lnc, b, n, fold_factor, batch_start, batch_end (partial_batch_perms)
_PARTIAL = [(1, 16, 256, 2, 0, 8), (1, 16, 256, 2, 4, 12), (1, 16, 256, 2, 8, 16), (2, 32, 512, 4, 0, 16),
            (2, 32, 512, 4, 16, 32), (1, 16, 3168, 4, 0, 8), (1, 16, 3168, 4, 4, 12), (2, 32, 4058, 8, 0, 16),
            (2, 32, 4058, 8, 8, 24), (1, 8, 256, 2, 3, 4), (1, 8, 3168, 4, 5, 6), (2, 16, 256, 2, 0, 7),
            (2, 32, 3168, 4, 4, 15)]
# lnc, b, n, fold_factor, src_start, src_end, dst_start, dst_end (dst_batch_perms)
_DST = [(1, 16, 256, 2, 0, 8, 0, 8), (1, 16, 256, 2, 0, 8, 8, 16), (2, 16, 512, 4, 0, 8, 8, 16),
        (1, 16, 3168, 4, 0, 8, 8, 16), (2, 32, 4058, 8, 0, 8, 16, 24), (1, 16, 256, 2, 4, 8, 0, 4),
        (1, 16, 3168, 4, 8, 12, 0, 4)]
# lnc, b, n, fold_factor, batch_start, batch_end, sb_extra_cols (oversized_sb_perms)
_OVERSIZED = [(1, 8, 256, 2, 0, 8, 16), (2, 8, 512, 4, 0, 8, 32), (1, 4, 3168, 4, 0, 4, 8), (2, 8, 4058, 8, 0, 8, 16),
              (1, 16, 256, 2, 4, 12, 10), (2, 32, 3168, 4, 8, 24, 20), (2, 5, 512, 4, 0, 5, 12)]


def _inputs(b: int, n: int, **scalars: int) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        np.random.seed(42)
        return {"input_tensor": np.random.randn(b, n).astype(np.float32), **scalars}
    return make


# folded_load_store_dst_kernel zero-fills the whole output from each core, then each core writes its share of the
# rows, with no barrier between: which core's zeros land after the other's rows is timing, not a documented order
DST_RACE_NOTE = ("the test's kernel zero-fills the whole output on each core, with no barrier before the cores write "
                 "their rows: a race; the programs run in lockstep, as two cores started together, so both zero "
                 "fills land before either core's rows; on a device the result depends on the cores' timing")


def _case(test: str, kernel: str, lnc: int, b: int, n: int, name: str, **scalars: int) -> Case:
    race = kernel == "folded_load_store_dst" and lnc > 1
    return Case(kernel=KERNEL, name=f"{test} {name}", shapes=f"x[{b},{n}]", entry=f"{TEST}:{kernel}_kernel",
                reference=f"{TEST}:{kernel}_torch_ref", inputs=_inputs(b, n, **scalars), outputs=("output_tensor",),
                lnc=lnc, rtol=1e-5, atol=1e-8, note=DST_RACE_NOTE if race else "", test_file=TEST)


def max_utils_cases() -> list[Case]:
    cases = [_case("full_batch", "folded_load_store", lnc, b, n, f"fold={ff}", fold_factor=ff, batch_start=0,
                   batch_end=b) for lnc, b, n, ff in _FULL]
    cases += [_case("partial_batch", "folded_load_store", lnc, b, n, f"fold={ff} rows {s}:{e}", fold_factor=ff,
                    batch_start=s, batch_end=e) for lnc, b, n, ff, s, e in _PARTIAL]
    cases += [_case("dst_batch", "folded_load_store_dst", lnc, b, n, f"fold={ff} rows {s}:{e} to {ds}:{de}",
                    fold_factor=ff, src_batch_start=s, src_batch_end=e, dst_batch_start=ds, dst_batch_end=de)
              for lnc, b, n, ff, s, e, ds, de in _DST]
    cases += [_case("oversized_sb", "folded_load_oversized_sb", lnc, b, n, f"fold={ff} rows {s}:{e} +{x} columns",
                    fold_factor=ff, batch_start=s, batch_end=e, sb_extra_cols=x)
              for lnc, b, n, ff, s, e, x in _OVERSIZED]
    return cases
