"""max8 / nc_find_index8 / nc_match_replace8: ordering and tie rules (hand cases) and random data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trnkit.nkisim.isa import vector as nisa

from ._tiles import BF16, F32, as_f32, empty, psum, tile

RNG = np.random.default_rng(42)
U32_NONE = np.iinfo(np.uint32).max


def _find8(data: np.ndarray, vals: np.ndarray) -> np.ndarray:
    d, v = tile(data.astype(np.float32)), tile(vals.astype(np.float32))
    dst = empty((data.shape[0], 8), np.uint32)
    nisa.nc_find_index8(dst, d, v)
    return dst.np().astype(np.int64)


def test_max8_descending_with_duplicates() -> None:
    row = np.array([3, 9, 1, 9, 7, 2, 8, 9, 0, 5, 6, 4], np.float32)
    dst = empty((1, 8), F32)
    nisa.max8(dst, tile(row[None]))
    np.testing.assert_array_equal(dst.np()[0], [9, 9, 9, 8, 7, 6, 5, 4])


@pytest.mark.parametrize("shape", [(128, 8), (128, 64), (17, 4, 100), (3, 16384)])
def test_max8_random_matches_sorted(shape) -> None:
    x = RNG.standard_normal(shape).astype(np.float32)
    dst = empty((shape[0], 8), F32)
    nisa.max8(dst, tile(x))
    want = -np.sort(-x.reshape(shape[0], -1), axis=1)[:, :8]
    np.testing.assert_array_equal(dst.np(), want)


def test_max8_bf16_in_psum_compares_in_fp32_and_casts_output() -> None:
    x = RNG.standard_normal((8, 40)).astype(np.float32)
    dst = empty((8, 8), BF16)
    nisa.max8(dst, tile(x, F32, psum))
    want = (-np.sort(-x, axis=1)[:, :8]).astype(BF16)
    np.testing.assert_array_equal(dst.np(), want)


def test_find_index8_first_occurrence_and_duplicates_advance() -> None:
    data = np.array([[5, 1, 5, 3, 5, 2, 9, 9, 1, 0]], np.float32)
    vals = np.array([[5, 5, 9, 1, 5, 3, 9, 1]], np.float32)
    # 5 -> 0, then the next 5 -> 2, 9 -> 6, 1 -> 1, third 5 -> 4, 3 -> 3, second 9 -> 7, second 1 -> 8
    np.testing.assert_array_equal(_find8(data, vals)[0], [0, 2, 6, 1, 4, 3, 7, 8])


def test_find_index8_missing_value_gives_all_ones() -> None:
    data = np.array([[4, 4, 2, 7, 1, 1, 1, 1]], np.float32)
    vals = np.array([[4, 4, 4, 8, 2, 7, 1, 1]], np.float32)
    got = _find8(data, vals)[0]
    np.testing.assert_array_equal(got, [0, 1, U32_NONE, U32_NONE, 2, 3, 4, 5])
    dst16 = empty((1, 8), np.uint16)
    nisa.nc_find_index8(dst16, tile(data), tile(vals))
    assert dst16.np()[0, 2] == 0xFFFF


def test_find_index8_of_max8_is_the_top8_argsort_with_lower_index_first() -> None:
    # Router top-k pattern: max8 then find_index8; ties resolve to the lower index.
    x = RNG.integers(0, 6, size=(128, 64)).astype(np.float32)  # many ties
    m = empty((128, 8), F32)
    nisa.max8(m, tile(x))
    idx = empty((128, 8), np.uint32)
    nisa.nc_find_index8(idx, tile(x), m)
    want = np.argsort(-x, axis=1, kind="stable")[:, :8]
    np.testing.assert_array_equal(idx.np(), want)


def test_find_index8_3d_data_flattens_free_dims() -> None:
    x = RNG.standard_normal((4, 8, 16)).astype(np.float32)
    flat = x.reshape(4, -1)
    pos = np.stack([RNG.choice(128, size=8, replace=False) for _ in range(4)])
    vals = np.take_along_axis(flat, pos, axis=1)
    idx = empty((4, 8), np.uint32)
    nisa.nc_find_index8(idx, tile(x), tile(vals))
    np.testing.assert_array_equal(idx.np(), pos)


def test_match_replace8_reverse_order_duplicates() -> None:
    # The documented example: data [1,2,3,4,8 x 7], vals [3, 8 x 7] -> idx [2,10,9,8,7,6,5,4]
    data = np.array([[1, 2, 3, 4] + [8] * 7], np.float32)
    vals = np.array([[3] + [8] * 7], np.float32)
    dst = empty(data.shape, F32)
    idx = empty((1, 8), np.uint32)
    nisa.nc_match_replace8(dst, tile(data), tile(vals), imm=-1.0, dst_idx=idx)
    np.testing.assert_array_equal(idx.np()[0], [2, 10, 9, 8, 7, 6, 5, 4])
    np.testing.assert_array_equal(dst.np()[0], [1, 2, -1, 4] + [-1] * 7)


def test_match_replace8_partial_duplicates_and_missing() -> None:
    data = np.array([[7, 3, 7, 0, 7, 5, 6, 9, 2]], np.float32)
    vals = np.array([[7, 9, 7, 4, 5, 6, 2, 3]], np.float32)
    dst = empty(data.shape, F32)
    idx = empty((1, 8), np.uint32)
    nisa.nc_match_replace8(dst, tile(data), tile(vals), imm=-100.0, dst_idx=idx)
    # processed vals[7]..vals[0]: slot 2 (the later 7) takes index 0, slot 0 takes index 2; 4 is absent
    np.testing.assert_array_equal(idx.np()[0], [2, 7, 0, U32_NONE, 5, 6, 8, 1])
    np.testing.assert_array_equal(dst.np()[0], [-100, -100, -100, 0, 7, -100, -100, -100, -100])


def test_match_replace8_iterated_top_k_beyond_8() -> None:
    # Top-16 by two rounds of max8 + match_replace8 (the nki-library router pattern).
    x = RNG.standard_normal((32, 100)).astype(np.float32)
    work = tile(x)
    got = []
    for _ in range(2):
        m = empty((32, 8), F32)
        nisa.max8(m, work)
        nxt = empty((32, 100), F32)
        nisa.nc_match_replace8(nxt, work, m, imm=-np.inf)
        got.append(as_f32(m))
        work = nxt
    np.testing.assert_array_equal(np.concatenate(got, axis=1), -np.sort(-x, axis=1)[:, :16])


def _find8_reference(row: list[float], vals: list[float]) -> list[int]:
    """The documented semantics, one value at a time in plain Python (independent of the numpy code)."""
    taken: set[int] = set()
    out = []
    for v in vals:
        hit = next((i for i, x in enumerate(row) if x == v and i not in taken), None)
        if hit is None:
            out.append(U32_NONE)
        else:
            taken.add(hit)
            out.append(hit)
    return out


def _replace8_reference(row: list[float], vals: list[float], imm: float) -> tuple[list[float], list[int]]:
    row = list(row)
    idx = [0] * 8
    done: set[int] = set()
    for k in range(7, -1, -1):
        hit = next((i for i, x in enumerate(row) if x == vals[k] and i not in done), None)
        idx[k] = U32_NONE if hit is None else hit
        if hit is not None:
            done.add(hit)
            row[hit] = imm
    return row, idx


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=8, max_size=40), st.lists(st.integers(0, 6), min_size=8, max_size=8))
def test_find_and_replace8_match_sequential_reference(row, vals) -> None:
    data = np.array([row], np.float32)
    v = np.array([vals], np.float32)
    assert _find8(data, v)[0].tolist() == _find8_reference(row, vals)
    dst, idx = empty(data.shape, F32), empty((1, 8), np.uint32)
    nisa.nc_match_replace8(dst, tile(data), tile(v), imm=-1.0, dst_idx=idx)
    want_row, want_idx = _replace8_reference(row, vals, -1.0)
    assert dst.np()[0].tolist() == want_row and idx.np()[0].tolist() == want_idx


def test_find_index8_and_match_replace8_accept_up_to_5d_data() -> None:
    x = RNG.standard_normal((2, 2, 2, 2, 4)).astype(np.float32)
    flat = x.reshape(2, -1)
    vals = flat[:, [3, 0, 31, 7, 8, 9, 10, 11]]
    idx = empty((2, 8), np.uint32)
    nisa.nc_find_index8(idx, tile(x), tile(vals))
    np.testing.assert_array_equal(idx.np(), np.tile([3, 0, 31, 7, 8, 9, 10, 11], (2, 1)))
    out = empty(x.shape, F32)
    nisa.nc_match_replace8(out, tile(x), tile(vals), imm=0.0)
    want = flat.copy()
    want[:, [3, 0, 31, 7, 8, 9, 10, 11]] = 0.0
    np.testing.assert_array_equal(out.np().reshape(2, -1), want)
