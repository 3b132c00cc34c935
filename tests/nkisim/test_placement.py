"""Manual SBUF placement, ``nl.ndarray(..., address=(partition, byte))``: placed tiles are views of their kernel
instance's SBUF bytes (tensor.py, "manual placement"), so tiles on the same bytes alias, a stale read sees the
later write, the memory a run holds follows the slots, not the tile objects, and each LNC=2 program has its own
SBUF. Expected values are computed by hand from the byte layout."""

from __future__ import annotations

import tracemalloc
import warnings

import ml_dtypes
import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import memory
from trnkit.nkisim.errors import NkiValidationError


@pytest.fixture
def ctx():
    c = memory.KernelContext()
    memory.push_context(c)
    yield c
    memory.pop_context()


def _f32(rows: int, cols: int, start: float = 0.0) -> np.ndarray:
    return (start + np.arange(rows * cols, dtype=np.float32)).reshape(rows, cols)


@nki.jit
def write_a_read_b(x, as_bf16=False):
    """DMA x (fp32) into A at (0, 64); read the same bytes back through B, another tile object on that address:
    fp32 [P, F] like A, or (as_bf16) bf16 [P, 2F], two bf16 per fp32."""
    p, f = x.shape
    shape, dtype = ((p, 2 * f), nl.bfloat16) if as_bf16 else ((p, f), nl.float32)
    a = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf, address=(0, 64))
    b = nl.ndarray(shape, dtype, buffer=nl.sbuf, address=(0, 64))
    nisa.dma_copy(dst=a, src=x)
    out = nl.ndarray(shape, dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=b)
    return out


def test_two_tiles_on_one_address_share_their_bytes():
    x = _f32(4, 8, 1.0)
    np.testing.assert_array_equal(write_a_read_b(x), x)


def test_a_placed_tile_reads_the_bytes_with_its_own_dtype():
    # fp32 1.0 = 0x3F800000, little-endian: bf16 words 0x0000 (low half, 0.0) then 0x3F80 (1.0); fp32 -2.5 =
    # 0xC0200000: 0x0000 then 0xC020 (-2.5 in bf16, same sign/exponent/top mantissa bits)
    x = np.array([[1.0, -2.5]] * 2, dtype=np.float32)
    out = np.asarray(write_a_read_b(x, as_bf16=True)).astype(np.float32)
    np.testing.assert_array_equal(out, [[0.0, 1.0, 0.0, -2.5]] * 2)


@nki.jit
def stale_read(x, y):
    """A and B on one slot: write x through A, then y through B, then read A (what a device returns: y)."""
    a = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=a, src=x)
    b = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=b, src=y)
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)
    return out


def test_reading_a_tile_after_a_later_tile_on_its_slot_overwrote_it_sees_the_new_data():
    x = np.ones((128, 16), np.float32)
    y = np.full((128, 16), 2.0, np.float32)
    with pytest.warns(memory.PlacedTileOverwrittenWarning):
        np.testing.assert_array_equal(stale_read(x, y), y)


@nki.jit
def overlapping(x):
    """A [4, 8] fp32 at (0, 0); B [4, 4] fp32 at (0, 16) = A's columns 4..7; C [2, 8] at (2, 0) = A's rows 2, 3;
    D [4, 2] fp32 at (0, 8) read through a column slice and computed on (x 10) then read back through A."""
    a = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf, address=(0, 0))
    b = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf, address=(0, 16))
    c = nl.ndarray((2, 8), nl.float32, buffer=nl.sbuf, address=(2, 0))
    d = nl.ndarray((4, 2), nl.float32, buffer=nl.sbuf, address=(0, 8))
    nisa.dma_copy(dst=a, src=x)
    ob = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
    oc = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=ob, src=b)
    nisa.dma_copy(dst=oc, src=c)
    nisa.tensor_scalar(dst=d[:, 1:2], data=d[:, 1:2], op0=nl.multiply, operand0=10.0)
    oa = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=oa, src=a)
    return ob, oc, oa


def test_partly_overlapping_placements_address_the_same_bytes():
    x = _f32(4, 8)  # x[p, j] = 8p + j
    with pytest.warns(memory.PlacedTileOverwrittenWarning, match="reads placed tile .* after tensor_scalar wrote"):
        ob, oc, oa = overlapping(x)  # (A read after D wrote over part of it)
    np.testing.assert_array_equal(ob, x[:, 4:8])  # byte 16 = fp32 column 4
    np.testing.assert_array_equal(oc, x[2:4])  # partition 2
    want = x.copy()
    want[:, 3] *= 10  # D starts at byte 8 (column 2); its column 1 is A's column 3
    np.testing.assert_array_equal(oa, want)


def test_fresh_placed_bytes_hold_the_dtype_sentinel_and_keep_what_a_tile_wrote(ctx):
    a = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf, address=(0, 0))
    assert np.isnan(a.np()).all()
    i = nl.ndarray((2, 4), nl.int32, buffer=nl.sbuf, address=(0, 64))  # fresh bytes: the int sentinel 4
    assert (i.np() == 4).all()
    nisa.memset(dst=a, value=3.0)
    again = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf, address=(0, 0))  # no new sentinel over a's bytes
    np.testing.assert_array_equal(again.np(), np.full((2, 4), 3.0, np.float32))
    wider = nl.ndarray((2, 8), nl.float32, buffer=nl.sbuf, address=(0, 0))  # half old bytes, half fresh
    got = wider.np()
    np.testing.assert_array_equal(got[:, :4], 3.0)
    assert np.isnan(got[:, 4:]).all()


def test_an_automatic_tile_never_aliases_a_placed_one(ctx):
    placed = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf, address=(0, 0))
    auto = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=placed, value=1.0)
    nisa.memset(dst=auto, value=2.0)
    np.testing.assert_array_equal(placed.np(), 1.0)


def test_views_and_partition_offsets_of_a_placed_tile(ctx):
    t = nl.ndarray((32, 16), nl.float32, buffer=nl.sbuf, address=(32, 128))
    assert t.partition_start == 32 and t[4:8, :].partition_start == 36
    nisa.memset(dst=t, value=0.0)
    nisa.memset(dst=t.ap([[16, 32], [2, 4]], offset=1), value=5.0)  # columns 1, 3, 5, 7 of every partition
    row = np.zeros(16, np.float32)
    row[[1, 3, 5, 7]] = 5.0
    alias = nl.ndarray((1, 16), nl.float32, buffer=nl.sbuf, address=(40, 128))  # physical partition 40 = t[8]
    np.testing.assert_array_equal(alias.np()[0], row)
    wide = nl.ndarray((64, 16), nl.float32, buffer=nl.sbuf, address=(32, 128))
    with pytest.raises(NkiValidationError, match="starts at partition 32 with 64 partitions"):
        nisa.memset(dst=wide, value=1.0)  # 33..64 partitions start at 0 or 64 (arch guide)


@pytest.mark.parametrize(
    "buffer, address, shape, match",
    [
        (nl.sbuf, (100, 0), (64, 4), r"spans partitions \[100, 164\); SBUF has partitions \[0, 128\)"),
        (nl.sbuf, (-1, 0), (4, 4), r"spans partitions \[-1, 3\)"),
        (nl.sbuf, (0, -2), (4, 4), r"address=\(0, -2\): the free offset must be >= 0"),
        (nl.sbuf, (0, 229370), (4, 4), r"needs bytes \[229370, 229386\) of each partition; SBUF has 229376 "
         r"bytes per partition \(trainium2_arch.rst"),
        (nl.sbuf, (0,), (4, 4), r"address must be a \(partition_offset, free_offset\) pair of ints, got \(0,\)"),
        (nl.sbuf, (0, 1.5), (4, 4), r"pair of ints, got \(0, 1.5\)"),
        (nl.psum, (0, 1024), (2, 4), r"address=\(0, 1024\): the free offset must be a bank boundary, a multiple "
         r"of 2048 bytes"),
        (nl.psum, (0, 7 * 2048), (2, 1024), r"needs bytes \[14336, 18432\) of each partition; PSUM has 16384 "
         r"bytes per partition"),
        (nl.psum, (127, 0), (2, 4), r"spans partitions \[127, 129\); PSUM has partitions \[0, 128\)"),
    ],
)
def test_placements_outside_the_sbuf_or_psum_or_off_a_bank_are_rejected(ctx, buffer, address, shape, match):
    with pytest.raises(NkiValidationError, match=match) as e:
        nl.ndarray(shape, nl.float32, buffer=buffer, name="t", address=address)
    assert str(e.value).startswith("nl.ndarray") and "'t'" in str(e.value)


def test_odd_byte_offsets_are_accepted_as_the_tested_qkv_cte_places_them(ctx):
    # nki-library core/qkv/qkv_cte.py (fp8 static quantization): SbufManager.alloc_stack without align puts a
    # [128, 1] fp8 tile at byte 0 and the next one at byte 1, although nl.tile_size.sbuf_min_align is 2
    first = nl.ndarray((4, 1), nl.float8_e4m3, buffer=nl.sbuf, address=(0, 0))
    second = nl.ndarray((4, 2), nl.bfloat16, buffer=nl.sbuf, address=(0, 1))
    nisa.memset(dst=second, value=1.0)  # bf16 1.0 = 0x3F80: bytes 0x80, 0x3F little-endian, from byte 1
    nisa.memset(dst=first, value=0.0)
    both = nl.ndarray((4, 5), nl.uint8, buffer=nl.sbuf, address=(0, 0))
    np.testing.assert_array_equal(both.np(), [[0x00, 0x80, 0x3F, 0x80, 0x3F]] * 4)


def test_the_last_bytes_of_a_partition_can_be_placed(ctx):
    t = nl.ndarray((128, 4), nl.float32, buffer=nl.sbuf, address=(0, 224 * 1024 - 16))
    nisa.memset(dst=t, value=7.0)
    np.testing.assert_array_equal(t.np(), 7.0)


def test_a_slot_counts_once_and_overlaps_count_their_union(ctx):
    a = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf, address=(0, 0))  # 2 KiB per partition
    b = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf, address=(0, 0))
    c = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf, address=(0, 1024))  # overlaps a's second KiB
    for t in (a, b, c, a, b, c):
        nisa.memset(dst=t, value=1.0)
    ctx.memory.check()
    assert ctx.memory.sbuf_peak == 3 * 1024  # [0, 2 KiB) and [1, 3 KiB) cover 3 KiB, not 6 KiB
    assert sum(al.span is not None for al in ctx.memory.allocations) == 2  # (0, 0) and (0, 1024): 2 slots


def _many_tiles(n: int, slots: int) -> list:
    kept = []
    for i in range(n):  # nki-library's ModularAllocator: logical tile i on slot i % slots
        t = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf, address=(0, (i % slots) * 2048))
        nisa.memset(dst=t, value=float(i))
        kept.append(t)
    return kept


def test_ten_thousand_placed_tiles_on_four_slots_hold_four_slots_of_memory(ctx):
    _many_tiles(8, 4)  # warm-up: the space is as wide as the four slots need
    tracemalloc.start()
    kept = _many_tiles(10_000, 4)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    ctx.memory.check()
    assert ctx.memory.sbuf_peak == 4 * 2048  # the four slots, not 10,000 x 2 KiB
    assert len(ctx.memory.allocations) == 4
    # each kept tile's own storage would be 10,000 x 128 x 2 KiB = 2.6 GB; what remains is the Python objects
    # (a tile and its storage record, ~0.5 KiB each) and the one 128 x 8 KiB space
    assert peak < 16 * 2**20, peak
    # the last tile written on each slot is what every tile on that slot reads
    np.testing.assert_array_equal(kept[0].np(), 9996.0)
    np.testing.assert_array_equal(kept[3].np(), 9999.0)


@nki.jit
def per_core_slot(x):
    """Both programs place a tile at (0, 0) and write their program id into it; in lockstep program 1's write
    lands between program 0's write and read, so program 0 reads 1 if the two shared one SBUF."""
    pid = nl.program_id(0)
    t = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf, address=(0, 0))
    nisa.memset(dst=t, value=float(pid))
    out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid : pid + 1, :], src=t)
    return out


def test_each_lnc2_program_places_into_its_own_sbuf():
    out = per_core_slot[2](np.zeros(1, np.float32))
    np.testing.assert_array_equal(out, [[0.0] * 8, [1.0] * 8])


def test_hbm_addresses_are_still_storage_of_their_own(ctx):
    a = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm, address=(0, 0))
    b = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm, address=(0, 0))
    src = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=src, value=1.0)
    nisa.dma_copy(dst=a, src=src)
    assert np.isnan(b.np()).all()


def _psum_tile(name: str, bank: int, shape=(2, 4)):
    return nl.ndarray(shape, nl.float32, buffer=nl.psum, name=name, address=(0, bank * 2048))


def _operands(k: int = 3, m: int = 2, n: int = 4):
    """stationary [k, m] = 1, moving [k, n] = j + 1 in column j: every output element (s.T @ mv)[i, j] = k(j + 1)."""
    s = nl.ndarray((k, m), nl.float32, buffer=nl.sbuf)
    mv = nl.ndarray((k, n), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=s, value=1.0)
    for j in range(n):
        nisa.memset(dst=mv[:, j : j + 1], value=float(j + 1))
    return s, mv


def test_psum_tiles_on_one_bank_share_it(ctx):
    s, mv = _operands()
    a = _psum_tile("a", 3)
    nisa.nc_matmul(dst=a, stationary=s, moving=mv)
    b = _psum_tile("b", 3)  # the same bank: reads a's sums
    np.testing.assert_array_equal(b.np(), [[3.0, 6.0, 9.0, 12.0]] * 2)
    other = _psum_tile("other", 4)  # the next bank: fresh
    assert np.isnan(other.np()).all()


def test_accumulate_none_starts_fresh_per_tile_and_the_bank_keeps_the_last_write(ctx):
    # nc_matmul docs: accumulate=None "The compiler automatically infers the correct flag - first write
    # overwrites, subsequent writes accumulate": inferred per tensor, so b's first matmul overwrites a's sums
    s, mv = _operands()
    a = _psum_tile("a", 0)
    nisa.nc_matmul(dst=a, stationary=s, moving=mv)
    nisa.nc_matmul(dst=a, stationary=s, moving=mv)  # a's second write accumulates: 2 x 3(j + 1)
    np.testing.assert_array_equal(a.np(), [[6.0, 12.0, 18.0, 24.0]] * 2)
    b = _psum_tile("b", 0)
    nisa.nc_matmul(dst=b, stationary=s, moving=mv)  # b's first write overwrites the bank
    np.testing.assert_array_equal(a.np(), [[3.0, 6.0, 9.0, 12.0]] * 2)  # a reads the bank: b's sums


def test_accumulation_groups_follow_the_bank_not_the_tile_object(ctx):
    # nine tile objects on bank 0, each written twice in turn: one accumulation group in bank 0, not nine
    # outstanding ones (trainium_inferentia2_arch.rst: up to eight, one per PSUM bank). Round 1 overwrites
    # nine times (each tile's first write); round 2 adds nine times: 10 x 3(j + 1)
    s, mv = _operands()
    tiles = [_psum_tile(f"t{i}", 0) for i in range(9)]
    for accumulate in (None, True):
        for t in tiles:
            nisa.nc_matmul(dst=t, stationary=s, moving=mv, accumulate=accumulate)
    ctx.memory.check()
    np.testing.assert_array_equal(tiles[0].np(), [[30.0, 60.0, 90.0, 120.0]] * 2)
    assert ctx.memory.psum_peak_banks == 1


def test_nine_banks_of_separate_tiles_still_count_nine_groups(ctx):
    s, mv = _operands()
    tiles = [nl.ndarray((2, 4), nl.float32, buffer=nl.psum, name=f"t{i}") for i in range(9)]  # automatic
    for accumulate in (None, True):
        for t in tiles:
            nisa.nc_matmul(dst=t, stationary=s, moving=mv, accumulate=accumulate)
    with pytest.raises(NkiValidationError, match="would be the 9th outstanding one"):
        ctx.memory.check()


def test_bf16_reinterpretation_matches_numpy_bytes(ctx):
    t = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf, address=(0, 0))
    v = nl.ndarray((2, 8), nl.bfloat16, buffer=nl.sbuf, address=(0, 0))
    nisa.memset(dst=t, value=3.0)  # 0x40400000: bf16 0x0000, 0x4040 = 3.0
    np.testing.assert_array_equal(v.np().view(np.uint16), np.tile(np.array([0, 0x4040], np.uint16), (2, 4)))
    assert v.np().dtype == ml_dtypes.bfloat16


@nki.jit
def placed_reader(out):
    """A @nki.jit helper: reads the slot (0, 0) into out."""
    t = nl.ndarray(out.shape, nl.float32, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=out, src=t)


@nki.jit
def caller(x):
    """Writes x at slot (0, 0), then a nested @nki.jit helper reads that slot: one program, one SBUF."""
    t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=t, src=x)
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    placed_reader(out)
    return out


def test_a_nested_jit_helper_places_into_its_callers_sbuf():
    x = _f32(2, 4, 5.0)
    np.testing.assert_array_equal(caller(x), x)


def test_a_read_of_an_overwritten_placed_tile_is_reported_once_per_overwrite():
    x = np.ones((128, 16), np.float32)
    y = np.full((128, 16), 2.0, np.float32)
    with pytest.warns(memory.PlacedTileOverwrittenWarning) as caught:
        out = stale_read(x, y)
    np.testing.assert_array_equal(out, y)
    msgs = [str(w.message) for w in caught if issubclass(w.category, memory.PlacedTileOverwrittenWarning)]
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("dma_copy reads placed tile ") and "(sbuf partitions [0, 128), bytes [0, 64)) after " \
        "dma_copy wrote tile " in msgs[0] and "as a device does" in msgs[0], msgs[0]


@nki.jit
def reuse_in_turn(x, y):
    """A and B on one slot used one after the other (A written and read, then B written and read), then A written
    again and read: every read sees its own tile's data, nothing to report."""
    out = nl.ndarray((3, 128, 16), nl.float32, buffer=nl.shared_hbm)
    a = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf, address=(0, 0))
    b = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=out[0], src=a)
    nisa.dma_copy(dst=b, src=y)
    nisa.dma_copy(dst=out[1], src=b)
    nisa.tensor_scalar(dst=a, data=b, op0=nl.multiply, operand0=3.0)  # reads B (its own data), rewrites A
    nisa.dma_copy(dst=out[2], src=a)
    return out


def test_tiles_that_take_turns_on_a_slot_are_not_reported():
    x = np.ones((128, 16), np.float32)
    y = np.full((128, 16), 2.0, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memory.PlacedTileOverwrittenWarning)
        out = np.asarray(reuse_in_turn(x, y))
    np.testing.assert_array_equal(out, np.stack([x, y, 3.0 * y]))


def test_a_write_to_disjoint_bytes_does_not_take_a_tiles_bytes(ctx):
    # A [4, 8] fp32 = bytes [0, 32); B [4, 4] at byte 32 (next to it); C [4, 4] at byte 16 (A's columns 4..7)
    a = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf, address=(0, 0))
    b = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf, address=(0, 32))
    c = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf, address=(0, 16))
    o = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=a, value=1.0)
    nisa.memset(dst=b, value=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memory.PlacedTileOverwrittenWarning)
        nisa.tensor_copy(dst=o, src=a)  # B's bytes are beside A's: A still holds its own
    nisa.memset(dst=c, value=3.0)
    with pytest.warns(memory.PlacedTileOverwrittenWarning, match="tensor_copy reads placed tile .* after memset "
                      "wrote tile"):
        nisa.tensor_copy(dst=o, src=a)
    np.testing.assert_array_equal(o.np(), [[1.0] * 4 + [3.0] * 4] * 4)


def test_placement_false_gives_each_placed_tile_its_own_storage():
    x = np.ones((128, 16), np.float32)
    y = np.full((128, 16), 2.0, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memory.PlacedTileOverwrittenWarning)
        out = nki.simulate(stale_read, placement=False)(x, y)
    np.testing.assert_array_equal(out, x)  # A kept x: the unplaced reading, not a device's (y, test above)
