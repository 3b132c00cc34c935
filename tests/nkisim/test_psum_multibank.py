"""PSUM tiles over one bank (``memory.py`` module doc): up to the 8 banks per partition, each taking whole banks
of its own; one TensorE write, and so one accumulation group, inside one bank; groups counted per bank.

nki-library's ``core/topk`` ``_topk_rotated_core`` (k = 2,048 over 1,024 rows, tested on trn2) allocates
[P, 1024] fp32 PSUM tiles, each written by two 512-column matmuls, one per bank, and read back whole."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import memory
from trnkit.nkisim.errors import NkiValidationError

K, M, BANK = 128, 128, 512  # BANK: fp32 columns per PSUM bank


def _load(src):
    t = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    return t


def _inputs(k_steps, n_cols, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((K * k_steps, M)).astype(np.float32),
        rng.standard_normal((K * k_steps, n_cols)).astype(np.float32),
    )


@nki.jit
def banks_then_read(a, b, n_banks):
    """The topk pattern: one [M, 512 * n_banks] fp32 PSUM tile, one matmul per bank, read back whole by
    one Scalar-engine copy (what nki-library's ``insert`` does)."""
    out = nl.ndarray((M, BANK * n_banks), nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((M, BANK * n_banks), nl.float32, buffer=nl.psum, name="rotated")
    lhs = _load(a)
    for i in range(n_banks):
        cols = slice(i * BANK, (i + 1) * BANK)
        nisa.nc_matmul(dst=acc[:, cols], stationary=lhs, moving=_load(b[:, cols]))
    res = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc, engine=nisa.scalar_engine)
    nisa.dma_copy(dst=out, src=res)
    return out


def test_two_bank_tile_one_matmul_per_bank_runs_and_reads_back_whole():
    a, b = _inputs(1, 2 * BANK)
    out = banks_then_read(a, b, 2)
    # each element is one 128-term fp32 dot product, summed exactly (fp64) and rounded once
    np.testing.assert_array_equal(out, (a.T.astype(np.float64) @ b.astype(np.float64)).astype(np.float32))


def test_eight_bank_tile_is_the_largest():
    a, b = _inputs(1, 8 * BANK, seed=1)
    out = banks_then_read(a, b, 8)
    np.testing.assert_array_equal(out, (a.T.astype(np.float64) @ b.astype(np.float64)).astype(np.float32))
    with pytest.raises(
        NkiValidationError,
        match=r"^nl.ndarray: PSUM tile 'too_big' needs 16388 bytes per "
        r"partition, more than the whole PSUM \(8 banks x 2048 bytes = 16384 bytes; "
        r"nl.tile_size.psum_num_banks x psum_bank_fmax_bytes\)",
    ):
        nl.ndarray((128, 8 * BANK + 1), nl.float32, buffer=nl.psum, name="too_big")


@nki.jit
def crossing_matmul(a, b, lo):
    acc = nl.ndarray((M, 2 * BANK), nl.float32, buffer=nl.psum, name="rotated")
    nisa.nc_matmul(dst=acc[:, lo : lo + BANK], stationary=_load(a), moving=_load(b[:, 0:BANK]))
    return acc


def test_matmul_output_crossing_a_bank_boundary_is_rejected():
    a, b = _inputs(1, BANK)
    with pytest.raises(
        NkiValidationError,
        match=(
            r"^nc_matmul: dst 'rotated' covers bytes 1024..3071 of each partition of its 4096-byte PSUM tile, "
            r"across the bank boundary at byte 2048: one TensorE write lies inside one 2048-byte PSUM bank "
            r"\(trainium_inferentia2_arch.rst, PSUM accumulation: \"the first one writing to a PSUM bank and "
            r"more subsequent instructions accumulating into the same PSUM bank\"; "
            r"nl.tile_size.psum_bank_fmax: \"Maximum free dimension per PSUM bank per partition\", 512 fp32\)"
        ),
    ):
        crossing_matmul(a, b, 256)


def test_tensor_engine_transpose_crossing_a_bank_boundary_is_rejected():
    ctx = memory.KernelContext()
    memory.push_context(ctx)
    try:
        data = nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=data, value=1.0)
        acc = nl.ndarray((128, 2 * BANK), nl.float32, buffer=nl.psum, name="t")
        nisa.nc_transpose(dst=acc[:, BANK : BANK + 128], data=data)  # inside bank 1: fine
        assert (acc.np()[:, BANK : BANK + 128] == 1.0).all()
        with pytest.raises(
            NkiValidationError,
            match=r"^nc_transpose: dst 't' covers bytes 1792..2303 of each "
            r"partition of its 4096-byte PSUM tile, across the bank boundary at byte 2048",
        ):
            nisa.nc_transpose(dst=acc[:, 448:576], data=data)
    finally:
        memory.pop_context()


def _live_together(shapes):
    """PSUM tiles of ``shapes`` (fp32) all written, then all read after a value that needs every one
    (no read can move above the last write), in a fresh kernel context; returns its memory."""
    ctx = memory.KernelContext()
    memory.push_context(ctx)
    tiles = [nl.ndarray(s, nl.float32, buffer=nl.psum, name=f"p{i}") for i, s in enumerate(shapes)]
    for t in tiles:
        nisa.memset(dst=t, value=1.0)
    g = nl.ndarray((128, len(tiles)), nl.float32, buffer=nl.sbuf)
    for i, t in enumerate(tiles):
        nisa.tensor_copy(dst=g[:, i : i + 1], src=t[:, 0:1])
    for t in tiles:
        res = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=res, data1=t, data2=g[:, 0:1].broadcast(1, t.shape[1]), op=nl.add)
    return ctx.memory


def test_a_multi_bank_tile_takes_whole_banks_of_its_own():
    # 4,400 bytes: three whole banks (the last 1,744 bytes of the third one are no other tile's), five
    # one-bank tiles: 8 banks
    mem = _live_together([(128, 1100)] + [(128, BANK)] * 5)
    try:
        mem.check()
        assert mem.psum_peak_banks == 8
    finally:
        memory.pop_context()
    # a 64-byte tile more would fit the third bank's free 1,744 bytes if banks were shared: rejected
    mem = _live_together([(128, 1100)] + [(128, BANK)] * 5 + [(128, 16)])
    try:
        with pytest.raises(
            NkiValidationError,
            match=r"^PSUM overflow: 7 live PSUM tiles \(14704 bytes per "
            r"partition\) need 9 banks of 2048 bytes at instruction \d+ \(memset\), capacity 8 "
            r"banks",
        ):
            mem.check()
    finally:
        memory.pop_context()


def test_more_than_eight_banks_of_multi_bank_tiles_live_is_rejected():
    mem = _live_together([(128, 3 * BANK)] * 3)  # 3 x 3 banks
    try:
        with pytest.raises(
            NkiValidationError,
            match=r"^PSUM overflow: 3 live PSUM tiles \(18432 bytes per "
            r"partition\) need 9 banks of 2048 bytes",
        ):
            mem.check()
    finally:
        memory.pop_context()


@nki.jit
def interleaved_banks(a, b, n_banks, n_small):
    """The contraction outermost over a tile of ``n_banks`` banks (one group per bank) and ``n_small``
    half-bank tiles: every group stays open until the last k."""
    out = nl.ndarray((M, BANK * n_banks + 256 * n_small), nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((M, BANK * n_banks), nl.float32, buffer=nl.psum, name="wide")
    small = [nl.ndarray((M, 256), nl.float32, buffer=nl.psum, name=f"small{j}") for j in range(n_small)]
    for k in range(2):
        lhs = _load(a[k * K : (k + 1) * K, :])
        for i in range(n_banks):
            cols = slice(i * BANK, (i + 1) * BANK)
            nisa.nc_matmul(dst=acc[:, cols], stationary=lhs, moving=_load(b[k * K : (k + 1) * K, cols]))
        for j, s in enumerate(small):
            cols = slice(BANK * n_banks + 256 * j, BANK * n_banks + 256 * (j + 1))
            nisa.nc_matmul(dst=s, stationary=lhs, moving=_load(b[k * K : (k + 1) * K, cols]))
    for tile, cols in [(acc, slice(0, BANK * n_banks))] + [
        (s, slice(BANK * n_banks + 256 * j, BANK * n_banks + 256 * (j + 1))) for j, s in enumerate(small)
    ]:
        res = nl.ndarray(tile.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=tile)
        nisa.dma_copy(dst=out[:, cols], src=res)
    return out


def test_accumulation_groups_are_counted_per_bank():
    # 4 groups in the wide tile's banks + 4 in half-bank tiles (two banks): 8 outstanding, 6 banks
    a, b = _inputs(2, 4 * BANK + 5 * 256, seed=2)
    n = 4 * BANK + 4 * 256
    ref = a.T.astype(np.float64) @ b[:, :n].astype(np.float64)
    np.testing.assert_allclose(interleaved_banks(a, b[:, :n], 4, 4), ref, rtol=1e-5, atol=1e-5)
    # a fifth half-bank tile (7 banks, within capacity): the 9th outstanding group, counted per bank of
    # the wide tile (one group per tile would make it 6)
    with pytest.raises(
        NkiValidationError,
        match=r"^nc_matmul: the matmul accumulation group on '.*' at "
        r"instruction \d+ \(until instruction \d+\) would be the 9th outstanding one; TensorE "
        r"has at most 8 .*'wide\[bank 3\]'",
    ):
        interleaved_banks(a, b, 4, 5)
