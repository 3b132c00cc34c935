"""TensorE tiling modes: nc_matmul's tile in the trace, and tiled matmuls on disjoint PE tiles running at
the same time in the cost model's schedule (cost_params.pe_tiles_concurrent, a what-if: off at every
setting), hand-computed."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from trnkit.nkisim import cost, trace
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim.cost_params import HIGH, LOW, MID
from trnkit.nkisim.trace import TENSOR

BF16 = np.dtype(ml_dtypes.bfloat16)
RNG = np.random.default_rng(23)
MATMUL_NS = 512 / 2.4  # [128, 32] stationary x [128, 512] moving: max(min(64, 32), 512) cycles at 2.4 GHz
ISSUE_NS = 64 / 2.4  # tiled matmuls start 64 TensorE cycles apart
ON = replace(MID, pe_tiles_concurrent=True)  # the what-if at mid


def _sbuf(values: np.ndarray) -> nl.ndarray:
    t = nl.ndarray(values.shape, values.dtype, buffer=nl.sbuf)
    t.np()[...] = values
    return t


def _two_matmuls(columns: tuple[int, int] | None, tile_cols: int = 32):
    """Two independent [128, 32] x [128, 512] bf16 matmuls into their own PSUM tiles, at the given PE column
    starts (``None``: untiled); the trace, and each result against numpy."""
    a = [RNG.standard_normal((128, 32)).astype(BF16) for _ in range(2)]
    b = [RNG.standard_normal((128, 512)).astype(BF16) for _ in range(2)]
    dsts = [nl.ndarray((32, 512), nl.float32, buffer=nl.psum) for _ in range(2)]
    with trace.record() as tr:
        for k in range(2):
            tiling = ({} if columns is None else
                      {"tile_position": (0, columns[k]), "tile_size": (128, tile_cols)})
            nisa.nc_matmul(dsts[k], _sbuf(a[k]), _sbuf(b[k]), **tiling)
    for k in range(2):
        ref = a[k].astype(np.float64).T @ b[k].astype(np.float64)
        np.testing.assert_allclose(dsts[k].np(), ref, rtol=1e-5, atol=1e-3)
    return list(tr)


def _matmul_starts(instrs, chip: str = "trn2", params=MID) -> list[float]:
    return [t.start for t in cost.timeline(instrs, chip, params) if t.engine == TENSOR]


def test_the_trace_carries_the_pe_tile_only_in_tiling_mode():
    tiled = _two_matmuls((0, 64), tile_cols=64)
    assert [i.attrs["pe_tile"] for i in tiled] == [(0, 0, 128, 64), (0, 64, 128, 64)]
    assert all("pe_tile" not in i.attrs for i in _two_matmuls(None))
    # row tiling: (row start, column start, rows, columns)
    a = RNG.standard_normal((64, 32)).astype(BF16)
    b = RNG.standard_normal((64, 256)).astype(BF16)
    with trace.record() as tr:
        nisa.nc_matmul(nl.ndarray((32, 256), nl.float32, buffer=nl.psum), _sbuf(a), _sbuf(b),
                       tile_position=(64, 32), tile_size=(64, 32))
    assert tr.instrs[0].attrs["pe_tile"] == (64, 32, 64, 32)


def test_disjoint_tiles_overlap_with_the_what_if_on_and_not_at_any_setting():
    instrs = _two_matmuls((0, 32))
    for params in (ON, replace(LOW, pe_tiles_concurrent=True)):
        first, second = _matmul_starts(instrs, params=params)
        assert second - first == pytest.approx(ISSUE_NS)  # the second starts one issue interval later
    for params in (LOW, MID):  # off: the whole array, one after another
        assert _matmul_starts(instrs, params=params)[1] == pytest.approx(MATMUL_NS)
    first, second = _matmul_starts(instrs, params=HIGH)
    assert second - first == pytest.approx(MATMUL_NS + HIGH.matmul_extra_cycles / 2.4)
    # in program order (compute_reorder off) the issue interval still lets the second start under the first
    in_order = _matmul_starts(instrs, params=replace(ON, compute_reorder=False))
    assert in_order[1] - in_order[0] == pytest.approx(ISSUE_NS)


def test_the_same_tile_never_overlaps():
    first, second = _matmul_starts(_two_matmuls((64, 64)), params=ON)
    assert second - first == pytest.approx(MATMUL_NS)


def test_trn1_tiles_are_64_columns_so_two_32_column_tiles_in_one_of_them_do_not_overlap():
    ns = 512 / 2.8
    first, second = _matmul_starts(_two_matmuls((0, 32)), "trn1", ON)
    assert second - first == pytest.approx(ns)
    first, second = _matmul_starts(_two_matmuls((0, 64)), "trn1", ON)
    assert second - first == pytest.approx(64 / 2.8)


def test_tensor_busy_counts_overlapping_tiles_once():
    rep = cost.estimate(_two_matmuls((0, 32)), params=ON)
    assert rep.busy_ns[TENSOR] == pytest.approx(ISSUE_NS + MATMUL_NS)  # the union, not 2 x MATMUL_NS
    assert rep.active_ns[TENSOR] == pytest.approx(ISSUE_NS + MATMUL_NS)
    untiled = cost.estimate(_two_matmuls(None), params=ON)
    assert untiled.busy_ns[TENSOR] == pytest.approx(2 * MATMUL_NS)


def test_an_untiled_trace_is_scheduled_as_without_the_parameter():
    instrs = _two_matmuls(None)
    on = cost.estimate(instrs, params=ON)
    off = cost.estimate(instrs, params=MID)
    assert on.total_ns == off.total_ns and on.busy_ns == off.busy_ns
    assert _matmul_starts(instrs)[1] == pytest.approx(MATMUL_NS)


def test_a_whole_array_matmul_waits_for_every_tile():
    instrs = _two_matmuls((0, 32))
    a = RNG.standard_normal((128, 128)).astype(BF16)
    b = RNG.standard_normal((128, 512)).astype(BF16)
    with trace.record() as tr:
        nisa.nc_matmul(nl.ndarray((128, 512), nl.float32, buffer=nl.psum), _sbuf(a), _sbuf(b))
    starts = _matmul_starts(instrs + list(tr), params=ON)
    assert starts[2] == pytest.approx(ISSUE_NS + MATMUL_NS)  # after the second tile's end
