"""Allocation: sentinels, SBUF/PSUM capacity by data liveness (first to last access), partition and
buffer rules."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import isa as nisa
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


def _write(t):
    nisa.memset(dst=t, value=1.0)


def _read(t):
    """An instruction reading ``t`` (into a scratch tile of the same shape in SBUF)."""
    nisa.tensor_copy(dst=nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf, name="scratch"), src=t)


def _read_after_all(tiles):
    """Read every tile after a column that depends on all of them: ``g`` sums each tile's first column,
    then each tile is read with ``g`` added. No tile's last read can move above the last tile's write,
    so all are live at once in any order the compiler may choose."""
    g = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf, name="g")
    nisa.memset(dst=g, value=0.0)
    for t in tiles:
        nisa.tensor_tensor(dst=g, data1=g, data2=t[:, 0:1], op=nl.add)
    for t in tiles:
        nisa.tensor_scalar(dst=nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf, name="scratch"), data=t,
                           op0=nl.add, operand0=g)


def _line(marker):
    """``test_core_memory.py:N`` of the line of this file that contains ``marker``."""
    lines = open(__file__).read().splitlines()
    return f"test_core_memory.py:{1 + next(i for i, x in enumerate(lines) if marker in x)}"


def test_sbuf_overflow_when_live_bytes_exceed_capacity(ctx):
    usable = memory.SBUF_USABLE_BYTES
    assert usable == 208 * KIB and memory.SBUF_PARTITION_BYTES == 224 * KIB
    a = nl.ndarray((128, 100 * KIB // 4), nl.float32, buffer=nl.sbuf, name="a")  # 100 KiB/partition
    b = nl.ndarray((64, 100 * KIB // 2), nl.bfloat16, buffer=nl.sbuf, name="b")  # per partition: 100 KiB
    c = nl.ndarray((128, 4 * KIB), nl.float32, buffer=nl.sbuf, name="c")  # site-c
    _write(a)
    _write(b)
    _write(c)  # a, b and c live together: 216 KiB > 208 KiB
    nisa.tensor_copy(dst=a[0:64, 0:16], src=b[0:64, 0:16])
    nisa.tensor_copy(dst=a[:, 0:16], src=c[:, 0:16])
    with pytest.raises(NkiValidationError) as err:
        ctx.memory.check()
    msg = str(err.value)
    assert msg.startswith("SBUF overflow: 221184 bytes per partition live at instruction 2 (memset), "
                          "capacity 212992; becoming live: 'c' 16384 B allocated at ")
    assert _line("# site-c") + ", instructions 2..4" in msg
    assert "'a' 102400 B" in msg and "'b' 102400 B" in msg


def test_sbuf_dead_allocation_still_referenced_takes_no_space(ctx):
    a = nl.ndarray((128, 100 * KIB // 4), nl.float32, buffer=nl.sbuf, name="a")
    b = nl.ndarray((128, 100 * KIB // 4), nl.float32, buffer=nl.sbuf, name="b")
    _write(a)
    _write(b)
    nisa.tensor_copy(dst=b[:, 0:16], src=a[:, 0:16])  # last use of a; the Python object stays alive
    c = nl.ndarray((128, 100 * KIB // 4), nl.float32, buffer=nl.sbuf, name="c")
    _write(c)
    nisa.tensor_copy(dst=c[:, 0:16], src=b[:, 0:16])
    ctx.memory.check()
    assert ctx.memory.sbuf_peak == 200 * KIB  # a + b, then b + c: never all three
    assert a.shape == (128, 25600)  # still referenced


def test_sbuf_source_and_destination_of_one_instruction_are_live_together(ctx):
    a = nl.ndarray((128, 120 * KIB // 4), nl.float32, buffer=nl.sbuf, name="a")
    b = nl.ndarray((128, 120 * KIB // 4), nl.float32, buffer=nl.sbuf, name="b")
    _write(a)
    nisa.tensor_copy(dst=b, src=a)  # a's last read and b's first write: 240 KiB at that instruction
    with pytest.raises(NkiValidationError, match=r"SBUF overflow: 245760 bytes per partition live at "
                                                 r"instruction 1 \(tensor_copy\)"):
        ctx.memory.check()


def test_never_accessed_allocations_take_no_space(ctx):
    keep = [nl.ndarray((128, 100 * KIB // 4), nl.float32, buffer=nl.sbuf) for _ in range(5)]
    psum = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(20)]
    ctx.memory.check()
    assert ctx.memory.sbuf_peak == 0 and ctx.memory.psum_peak_banks == 0
    assert len(keep) + len(psum) == 25


def test_sbuf_tile_larger_than_capacity_rejected_at_allocation(ctx):
    with pytest.raises(NkiValidationError, match=r"nl.ndarray: SBUF tile 'huge' needs 217088 bytes per "
                                                 r"partition, more than the SBUF capacity \(212992\)"):
        nl.ndarray((128, 212 * KIB // 4), nl.float32, buffer=nl.sbuf, name="huge")


def test_psum_tile_up_to_the_eight_banks(ctx):
    # over one bank is allowed (whole banks of its own; tests/nkisim/test_psum_multibank.py), over 16 KiB is not
    assert nl.ndarray((128, 513), nl.float32, buffer=nl.psum, name="big").shape == (128, 513)
    nl.ndarray((128, 4096), nl.float32, buffer=nl.psum)
    with pytest.raises(NkiValidationError, match=r"PSUM tile 'huge' needs 16388 bytes per partition, more "
                                                 r"than the whole PSUM \(8 banks x 2048 bytes"):
        nl.ndarray((128, 4097), nl.float32, buffer=nl.psum, name="huge")


def _psum_banks_scenario(extra: bool) -> memory.Memory:
    """Seven full-bank tiles and two half-bank tiles (sharing bank 7) all live at once, plus, when
    ``extra``, a 64-byte tile live with them."""
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"full{i}") for i in range(7)]
    tiles += [nl.ndarray((128, 256), nl.float32, buffer=nl.psum, name=f"half{i}") for i in range(2)]
    if extra:
        tiles.append(nl.ndarray((128, 16), nl.float32, buffer=nl.psum, name="x"))  # site-x
    for t in tiles:
        _write(t)
    _read_after_all(tiles)
    return memory.current().memory


def test_psum_eight_banks_over_live_tiles(ctx):
    mem = _psum_banks_scenario(extra=False)
    mem.check()
    assert mem.psum_peak_banks == 8
    memory.pop_context()
    mem = _fresh().memory
    _psum_banks_scenario(extra=True)  # 8 banks full: one more tile of any size does not fit
    with pytest.raises(NkiValidationError) as err:
        mem.check()
    msg = str(err.value)
    assert msg.startswith("PSUM overflow: 10 live PSUM tiles (16448 bytes per partition) need 9 banks "
                          "of 2048 bytes at instruction 9 (memset), capacity 8 banks, also with every "
                          "instruction that reads PSUM moved up to the last instruction it depends on "
                          "(nki.language.no_reorder: without it \"the compiler scheduler is free to "
                          "reorder independent operations\"); becoming live: 'x' 64 B allocated at ")
    assert _line("# site-x") in msg and "'full0' 2048 B" in msg and "'half1' 1024 B" in msg


def test_psum_dead_tiles_kept_in_a_list_do_not_count(ctx):
    """nki-library's pattern (bwmm_shard_on_block, attention_cte): a list holds every PSUM tile of a
    loop, each used only in its iteration; the compiler allocates by liveness, so 12 full-bank tiles
    referenced at once are fine while at most two are live."""
    tiles = []
    for i in range(12):
        tiles.append(nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"acc{i}"))
        _write(tiles[i])
        if i:
            _read(tiles[i - 1])
    _read(tiles[-1])
    ctx.memory.check()
    assert ctx.memory.psum_peak_banks == 2


def test_psum_tiles_live_across_a_loop_overflow(ctx):
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"acc{i}") for i in range(9)]
    for t in tiles:  # written first, all read after a value that needs all nine: nine banks live at once
        _write(t)
    _read_after_all(tiles)
    with pytest.raises(NkiValidationError, match=r"PSUM overflow: 9 live PSUM tiles .* need 9 banks"):
        ctx.memory.check()


def test_psum_reads_move_up_to_the_instructions_they_depend_on(ctx):
    """Nine tiles written first and each read at the end, independently: in program order nine banks
    are live, but each read depends only on its tile's write, so the compiler may run it right after
    that write (one or two banks): accepted, and recorded as needing the reordering."""
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"acc{i}") for i in range(9)]
    for t in tiles:
        _write(t)
    for t in tiles:
        _read(t)
    with pytest.warns(memory.PsumReorderWarning, match=r"PSUM: 9 banks live at once in program order, 1 with "
                      r"each PSUM read moved up"):
        ctx.memory.check()
    assert ctx.memory.psum_peak_banks == 9 and ctx.memory.psum_reordered_banks == 1


def test_psum_reads_do_not_move_out_of_no_reorder_or_a_loop_iteration(ctx):
    """A read inside ``nl.no_reorder()`` keeps program order ("guarantee that operations inside the block
    execute in program order"), and nothing moves across a runtime loop iteration's start (the body is
    one block of code)."""
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"acc{i}") for i in range(9)]
    for t in tiles:
        _write(t)
    with nl.no_reorder():
        for t in tiles:
            _read(t)
    with pytest.raises(NkiValidationError, match=r"PSUM overflow: 9 live PSUM tiles .* need 9 banks"):
        ctx.memory.check()
    memory.pop_context()
    ctx = _fresh()
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"acc{i}") for i in range(9)]
    for t in tiles:
        _write(t)


    def body(_):  # one iteration: the reads sit in the loop body
        for t in tiles:
            _read(t)

    nl.fori_loop(0, 1, body)
    with pytest.raises(NkiValidationError, match=r"PSUM overflow: 9 live PSUM tiles .* need 9 banks"):
        ctx.memory.check()


def test_outside_a_kernel_nothing_is_recorded():
    default = memory.current()
    assert not default.memory.track
    t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    assert t.storage.alloc is None and default.memory.allocations == []


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
        for t in keep:
            nisa.memset(dst=t, value=0.0)
        _read_after_all(keep)  # all nine accumulators read after a value that needs all of them
        return x

    with pytest.raises(NkiValidationError, match="PSUM overflow: 9 live PSUM tiles"):
        hog(np.zeros(4, np.float32))


def test_kernel_with_dead_psum_tiles_in_an_enclosing_scope_runs():
    """The same nine tiles, each read right after it is written: at most one is live."""
    @nki.jit
    def ok(x):
        keep = []
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=out, value=0.0)

        def step():
            t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            keep.append(t)  # the enclosing scope keeps every tile referenced
            nisa.memset(dst=t, value=1.0)
            nisa.tensor_tensor(dst=out, data1=out, data2=t, op=nl.add)

        for _ in range(9):
            step()
        y = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=y, src=out)
        return y

    assert (ok(np.zeros(4, np.float32)) == 9.0).all()


def test_each_grid_program_is_checked_on_its_own():
    seen = []

    @nki.jit
    def k(x):
        ctx = memory.current()
        seen.append(ctx)
        n = 5 if ctx.flat_program_id == 1 else 4  # program 1 holds five 50 KiB tiles at once
        tiles = [nl.ndarray((128, 50 * KIB // 4), nl.float32, buffer=nl.sbuf) for _ in range(n)]
        for t in tiles:
            nisa.memset(dst=t, value=0.0)
        for t in tiles:
            nisa.tensor_copy(dst=t[:, 0:1], src=t[:, 1:2])
        return x

    with pytest.raises(NkiValidationError, match=r"SBUF overflow: 256000 bytes") as err:
        k[2](np.zeros(4, np.float32))
    assert "(in program (1,) of grid (2,))" in "".join(getattr(err.value, "__notes__", []))
    assert seen[0].memory.sbuf_peak == 200 * KIB


def test_every_isa_call_is_one_instruction_untraced_dma_included(ctx):
    """Twelve 20 KiB tiles moved HBM -> SBUF -> HBM one after another (DMA only, nothing recording):
    at most one is live, so 240 KiB of tiles fit; each dma_copy advances the clock."""
    src = nl.ndarray((128, 5 * KIB), nl.float32, buffer=nl.shared_hbm)
    dst = nl.ndarray((128, 5 * KIB), nl.float32, buffer=nl.shared_hbm)
    tiles = []
    for _ in range(12):
        t = nl.ndarray((128, 5 * KIB), nl.float32, buffer=nl.sbuf)
        tiles.append(t)
        nisa.dma_copy(dst=t, src=src)
        nisa.dma_copy(dst=dst, src=t)
    assert ctx.memory.clock == 24 and ctx.memory.ops[:2] == ["dma_copy", "dma_copy"]
    ctx.memory.check()
    assert ctx.memory.sbuf_peak == 20 * KIB


def test_capacity_unchecked_measures_instead_of_raising():
    contexts = []

    @nki.jit
    def two_big(x):
        contexts.append(memory.current())
        a = nl.ndarray((128, 30 * 1024), nl.float32, buffer=nl.sbuf)  # 120 KiB per partition
        b = nl.ndarray((128, 30 * 1024), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a, value=0.0)
        nisa.memset(dst=b, value=0.0)
        nisa.tensor_copy(dst=a[:, 0:1], src=b[:, 0:1])  # both live here: 240 KiB
        return x

    with pytest.raises(NkiValidationError, match="SBUF overflow: 245760 bytes"):
        two_big(np.zeros(4, np.float32))
    nki.simulate(two_big, capacity="unchecked")(np.zeros(4, np.float32))
    assert contexts[-1].memory.sbuf_peak == 240 * 1024
    with pytest.raises(NkiValidationError, match="SBUF overflow: 245760 bytes"):  # the kernel itself: checked
        two_big(np.zeros(4, np.float32))


def test_full_on_chip_takes_memsets_value_rule():
    """On the chip nl.full / nl.zeros / nl.ones are a nisa.memset, whose value must match the dtype (NKI 0.3.0
    migration guide, "nisa.memset -- strict type matching"): an integer tile takes an integer in its range
    (+0.0 as memset takes it); before, nl.full(..., 2.5, nl.int32) raised numpy's ValueError from the cast and
    nl.full(..., 300, nl.int8) saturated to 127 where nisa.memset refuses 300."""
    assert (nl.full((2, 2), 7, nl.int8).np() == 7).all()
    assert (nl.full((2, 2), 0.0, nl.uint32).np() == 0).all()
    assert (nl.zeros((2, 2), nl.int32, buffer=nl.psum).np() == 0).all()
    with pytest.raises(NkiValidationError, match=r"nl.full: fill value 2.5 \(float\) does not match integer "
                       r"dtype int32: on the chip this is a nisa.memset"):
        nl.full((2, 2), 2.5, nl.int32)
    with pytest.raises(NkiValidationError, match=r"nl.full: fill value 300 is out of range for int8 \[-128, 127\]"):
        nl.full((2, 2), 300, nl.int8)
    with pytest.raises(NkiValidationError, match=r"nl.full: fill value -1 is out of range for uint32"):
        nl.full((2, 2), -1, nl.uint32, buffer=nl.psum)
    # an HBM tensor is no memset: the value is cast (rounded, saturated) as every other write
    assert (nl.full((2, 2), 2.5, nl.int32, buffer=nl.shared_hbm).np() == 2).all()
    assert (nl.full((2, 2), float("nan"), nl.int32, buffer=nl.shared_hbm).np() == 0).all()
