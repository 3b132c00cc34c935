"""SBUF beyond capacity in program order: an error by default (trnkit's kernels must fit), a recorded
spill under ``memory.sbuf_spills()`` (how neuronx-cc's default allocator compiles AWS's kernels)."""

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
    with memory.sbuf_spills(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", memory.SbufSpillWarning)
        out = two_big_tiles(x, 32768)
    np.testing.assert_allclose(out[:, 0], 2 * x.astype(np.float64).sum(axis=1), rtol=1e-4, atol=1e-2)
    spills = [w.message for w in caught if issubclass(w.category, memory.SbufSpillWarning)]
    assert len(spills) == 1 and spills[0].excess == 262144 - 212992
    assert "262144 bytes per partition live at the peak, 49152 more than the capacity 212992" in str(spills[0])


def test_fitting_kernels_do_not_warn_and_psum_still_cannot_spill():
    x = np.ones((64, 8192), np.float32)
    with memory.sbuf_spills(), warnings.catch_warnings():
        warnings.simplefilter("error", memory.SbufSpillWarning)
        np.testing.assert_array_equal(two_big_tiles(x, 8192)[:, 0], np.full(64, 16384.0))

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

    with memory.sbuf_spills(), pytest.raises(NkiValidationError, match="PSUM overflow"):
        nine_banks(np.ones((4, 128), np.float32))


@nki.jit
def gate_up_tiles(x, w, evacuate_each: bool):
    """AWS's moe_cte dropping kernel's shape of work: nine [128, 512] fp32 PSUM tiles, one matmul group
    each; its form allocates and fills every tile before it reads any (``evacuate_each=False``)."""
    xs = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=x)
    ws = nl.ndarray((128, 9 * 128), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ws, src=w)
    res = nl.ndarray((128, 9, 512), nl.float32, buffer=nl.sbuf)
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(9)]
    for i, acc in enumerate(tiles):
        nisa.nc_matmul(dst=acc, stationary=ws[:, i * 128:(i + 1) * 128], moving=xs)
        if evacuate_each:
            nisa.tensor_copy(dst=res[:, i, :], src=acc)
    if not evacuate_each:
        for i, acc in enumerate(tiles):
            nisa.tensor_copy(dst=res[:, i, :], src=acc)
    out = nl.ndarray((128, 9, 512), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res)
    return out


def test_psum_is_checked_in_program_order_where_the_compiler_may_reorder():
    """neuronx-cc places tiles and orders instructions after tracing (nki-compile-config.rst), so it may
    interleave each tile's evacuation with the matmuls and compile the all-first form in 8 banks; the
    interpreter checks PSUM in program order and rejects it (docs/interpreter.md, "Differences from the
    real compiler"). The interleaved form of the same work runs and gives the product."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((128, 512), np.float32), rng.standard_normal((128, 9 * 128), np.float32)
    want = np.stack([w[:, i * 128:(i + 1) * 128].T @ x for i in range(9)], axis=1)
    np.testing.assert_allclose(gate_up_tiles(x, w, True), want, rtol=1e-4, atol=1e-3)
    with memory.sbuf_spills(), pytest.raises(NkiValidationError, match=r"PSUM overflow: 9 live PSUM tiles "
                                             r"\(18432 bytes per partition\) need 9 banks"):
        gate_up_tiles(x, w, False)
