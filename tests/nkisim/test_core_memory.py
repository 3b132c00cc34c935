"""Allocation: sentinels, SBUF/PSUM capacity over live allocations, partition and buffer rules."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import language as nl
from trnkit.nkisim import memory
from trnkit.nkisim.errors import NkiValidationError

KIB = 1024


def _fresh() -> memory.KernelContext:
    ctx = memory.KernelContext()
    memory.push_context(ctx)
    return ctx


@pytest.fixture
def ctx():
    c = _fresh()
    yield c
    memory.pop_context()


@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16, nl.float16, nl.float8_e4m3, nl.float8_e5m2])
def test_new_float_allocations_hold_nan(dtype):
    for buf in (nl.sbuf, nl.psum, nl.shared_hbm):
        t = nl.ndarray((4, 8), dtype, buffer=buf)
        assert np.isnan(t.np().astype(np.float32)).all()


@pytest.mark.parametrize("dtype", [nl.int8, nl.int16, nl.int32, nl.uint8, nl.uint16, nl.uint32])
def test_new_int_allocations_hold_4(dtype):
    assert (nl.ndarray((4, 8), dtype, buffer=nl.sbuf).np() == 4).all()


def test_zeros_ones_full():
    assert (nl.zeros((4, 8), nl.bfloat16).np().astype(np.float32) == 0).all()
    assert (nl.ones((4, 8), nl.int32, buffer=nl.psum).np() == 1).all()
    assert (nl.full((2, 2), 2.5, nl.float32).np() == 2.5).all()


def test_sbuf_capacity_tracks_live_allocations(ctx):
    usable = memory.SBUF_USABLE_BYTES
    assert usable == 208 * KIB and memory.SBUF_PARTITION_BYTES == 224 * KIB
    a = nl.ndarray((128, 100 * KIB // 4), nl.float32, buffer=nl.sbuf, name="a")  # 100 KiB/partition
    b = nl.ndarray((64, 100 * KIB // 2), nl.bfloat16, buffer=nl.sbuf, name="b")  # bytes per partition count
    assert ctx.memory.sbuf_used == 200 * KIB
    with pytest.raises(NkiValidationError, match=r"SBUF overflow allocating 'c': requested 16384 bytes "
                                                 r"per partition, 204800 in use, capacity 212992"):
        nl.ndarray((128, 4 * KIB), nl.float32, buffer=nl.sbuf, name="c")
    view = a[:, 0:10]  # a view keeps the allocation alive
    del a
    gc.collect()
    assert ctx.memory.sbuf_used == 200 * KIB
    del view
    gc.collect()
    assert ctx.memory.sbuf_used == 100 * KIB
    c = nl.ndarray((128, 4 * KIB), nl.float32, buffer=nl.sbuf, name="c")
    assert ctx.memory.sbuf_used == 116 * KIB
    assert ctx.memory.sbuf_peak == 200 * KIB
    del b, c


def test_psum_tile_must_fit_one_bank(ctx):
    nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    with pytest.raises(NkiValidationError, match=r"PSUM tile 'big' needs 2052 bytes per partition, more "
                                                 r"than one PSUM bank \(2048 bytes"):
        nl.ndarray((128, 513), nl.float32, buffer=nl.psum, name="big")


def test_psum_eight_banks_over_live_allocations(ctx):
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(7)]
    halves = [nl.ndarray((128, 256), nl.float32, buffer=nl.psum) for _ in range(2)]  # share bank 7
    assert ctx.memory.psum_used == 16 * KIB
    with pytest.raises(NkiValidationError, match=r"PSUM overflow allocating 'x': requested 64 bytes per "
                                                 r"partition, 16384 in use over 8 banks, capacity 16384"):
        nl.ndarray((128, 16), nl.float32, buffer=nl.psum, name="x")
    del tiles[3]
    gc.collect()
    nl.ndarray((128, 512), nl.float32, buffer=nl.psum)  # the freed bank is reused
    del halves


def test_partition_dim_limit_and_buffer_args():
    with pytest.raises(NkiValidationError, match=r"partition dim 129 exceeds pmax \(128\)"):
        nl.ndarray((129, 4), nl.float32, buffer=nl.sbuf)
    nl.ndarray((1024, 4), nl.float32, buffer=nl.shared_hbm)  # HBM has no partition limit
    with pytest.raises(NkiValidationError, match="string buffer names are rejected"):
        nl.ndarray((4, 4), nl.float32, buffer="sbuf")
    with pytest.raises(NkiValidationError, match="float64 is not an NKI dtype"):
        nl.ndarray((4, 4), np.float64)
    with pytest.raises(NkiValidationError, match="must be positive ints"):
        nl.ndarray((4, 0), nl.float32)


def test_kernel_memory_overflow_inside_jit():
    @nki.jit
    def hog(x):
        keep = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(9)]
        return keep

    with pytest.raises(NkiValidationError, match="PSUM overflow"):
        hog(np.zeros(4, np.float32))


def test_unreachable_cycles_do_not_count(ctx):
    class Holder:
        pass

    gc.disable()  # make sure only the allocator's own collection can free them
    try:
        for _ in range(3):  # tiles kept alive only by reference cycles: garbage, not live memory
            h = Holder()
            h.self = h
            h.tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]
            del h
        assert nl.ndarray((128, 512), nl.float32, buffer=nl.psum).shape == (128, 512)
    finally:
        gc.enable()
