"""SBUF beyond capacity in program order: an error by default (trnkit's kernels must fit), a recorded
spill when launched with ``nki.simulate(kernel, capacity="sbuf_spills")`` (how neuronx-cc's default allocator
compiles AWS's kernels)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import memory
from trnkit.nkisim.errors import NkiValidationError


@nki.jit
def two_big_tiles(x, cols):
    """Two [64, cols] fp32 tiles live at once (cols=32768: 256 KiB per partition, as an AWS test's)."""
    out = nl.ndarray((64, 1), nl.float32, buffer=nl.shared_hbm)
    a = nl.ndarray((64, cols), nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((64, cols), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=b, src=x)
    nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
    s = nl.ndarray((64, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=s, op=nl.add, data=a, axis=1)
    nisa.dma_copy(dst=out, src=s)
    return out


def test_overflow_raises_by_default_naming_the_tiles():
    x = np.ones((64, 32768), np.float32)
    with pytest.raises(NkiValidationError, match=r"SBUF overflow: 262144 bytes per partition live at "
                       r"instruction 1 \(dma_copy\), capacity 212992"):
        two_big_tiles(x, 32768)


def test_under_sbuf_spills_it_runs_and_records_the_excess():
    x = np.random.default_rng(0).standard_normal((64, 32768)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", memory.SbufSpillWarning)
        out = nki.simulate(two_big_tiles, capacity="sbuf_spills")(x, 32768)
    np.testing.assert_allclose(out[:, 0], 2 * x.astype(np.float64).sum(axis=1), rtol=1e-4, atol=1e-2)
    spills = [w.message for w in caught if issubclass(w.category, memory.SbufSpillWarning)]
    assert len(spills) == 1 and spills[0].excess == 262144 - 212992
    assert "262144 bytes per partition live at the peak, 49152 more than the capacity 212992" in str(spills[0])


def test_fitting_kernels_do_not_warn_and_psum_still_cannot_spill():
    x = np.ones((64, 8192), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memory.SbufSpillWarning)
        np.testing.assert_array_equal(nki.simulate(two_big_tiles, capacity="sbuf_spills")(x, 8192)[:, 0],
                                      np.full(64, 16384.0))

    @nki.jit
    def nine_banks(a):
        lhs = nl.ndarray((4, 128), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=lhs, src=a)
        accs = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(9)]
        rhs = nl.ndarray((4, 512), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=rhs, value=1.0)
        for acc in accs:
            nisa.nc_matmul(dst=acc, stationary=lhs, moving=rhs)
        for acc in accs:
            nisa.tensor_copy(dst=rhs, src=acc[0:4, :])
        return a

    with pytest.raises(NkiValidationError, match="PSUM overflow"):
        nki.simulate(nine_banks, capacity="sbuf_spills")(np.ones((4, 128), np.float32))


@nki.jit
def gate_up_tiles(x, w, evacuate_each: bool, read_after_all: bool = False):
    """AWS's moe_cte shard_on_I kernels' shape of work: nine [128, 512] fp32 PSUM tiles, one accumulation
    group of two matmuls (K = 256) each; its form allocates and fills every tile before it reads any
    (``evacuate_each=False``). ``read_after_all``: each tile is read with a column ``g`` added that sums
    every tile's first column, so no read can run before the last tile is written."""
    xs = nl.ndarray((128, 2, 512), nl.float32, buffer=nl.sbuf)
    ws = nl.ndarray((128, 2, 9 * 128), nl.float32, buffer=nl.sbuf)
    for k in range(2):  # the two K halves, on the partitions
        nisa.dma_copy(dst=xs[:, k, :], src=x[k * 128:(k + 1) * 128, :])
        nisa.dma_copy(dst=ws[:, k, :], src=w[k * 128:(k + 1) * 128, :])
    res = nl.ndarray((128, 9, 512), nl.float32, buffer=nl.sbuf)
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(9)]
    for i, acc in enumerate(tiles):
        for k in range(2):
            nisa.nc_matmul(dst=acc, stationary=ws[:, k, i * 128:(i + 1) * 128], moving=xs[:, k, :])
        if evacuate_each:
            nisa.tensor_copy(dst=res[:, i, :], src=acc)
    if read_after_all:
        g = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=g, value=0.0)
        for acc in tiles:
            nisa.tensor_tensor(dst=g, data1=g, data2=acc[:, 0:1], op=nl.add)
        for i, acc in enumerate(tiles):
            nisa.tensor_scalar(dst=res[:, i, :], data=acc, op0=nl.add, operand0=g)
    elif not evacuate_each:
        for i, acc in enumerate(tiles):
            nisa.tensor_copy(dst=res[:, i, :], src=acc)
    out = nl.ndarray((128, 9, 512), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res)
    return out


def test_psum_reads_move_up_to_the_instructions_they_depend_on():
    """neuronx-cc orders the instructions after tracing ("the compiler scheduler is free to reorder
    independent operations", nki.language.no_reorder), so it may run each tile's evacuation right after
    the tile's last matmul: the fill-first form, nine banks in program order, compiles in two and runs
    here, with the same product as the interleaved form. When every read needs a value computed from all
    nine tiles, no order fits them in eight banks: rejected."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((256, 512), np.float32), rng.standard_normal((256, 9 * 128), np.float32)
    want = np.stack([w[:, i * 128:(i + 1) * 128].T @ x for i in range(9)], axis=1)
    np.testing.assert_allclose(gate_up_tiles(x, w, True), want, rtol=1e-4, atol=1e-3)
    with pytest.warns(memory.PsumReorderWarning, match="9 banks live at once in program order, 1 with"):
        np.testing.assert_allclose(gate_up_tiles(x, w, False), want, rtol=1e-4, atol=1e-3)
    with pytest.raises(NkiValidationError, match=r"PSUM overflow: 9 live PSUM tiles \(18432 bytes per partition\) "
                       r"need 9 banks .* also with every instruction that reads PSUM moved up"):
        nki.simulate(gate_up_tiles, capacity="sbuf_spills")(x, w, False, read_after_all=True)
