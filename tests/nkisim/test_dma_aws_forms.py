"""DMA forms AWS's tested kernels use (nki-library d2ad3a5), and their invalid neighbours."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import trace
from trnkit.nkisim.errors import NkiValidationError
from trnkit.nkisim.tensor import from_array

RNG = np.random.default_rng(11)
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_4d_transpose_a_1_b_f_with_the_default_dge_mode(dtype):
    """qkv_cte's input load: x[s, H] viewed as [s, 1, H/128, 128] and transposed to
    [128, 1, H/128, s] (``.ap`` on HBM and SBUF, default dge_mode)."""
    s, h = 96, 3 * 128
    x = RNG.standard_normal((s, h)).astype(dtype)
    src = from_array(x, nl.hbm, "x").ap(pattern=[[h, s], [1, 1], [128, 3], [1, 128]], offset=0)
    dst = nl.ndarray((128, 3 * s), dtype, buffer=nl.sbuf, name="xT")
    nisa.dma_transpose(dst=dst.ap(pattern=[[3 * s, 128], [1, 1], [s, 3], [1, s]], offset=0), src=src)
    for j in range(3):  # dst[c, j*s + r] = x[r, j*128 + c]
        np.testing.assert_array_equal(dst.np()[:, j * s:(j + 1) * s], x[:, j * 128:(j + 1) * 128].T)


def test_a_transpose_with_a_non_unit_second_dim_is_still_refused():
    src = from_array(np.zeros((128, 2, 3, 128), BF16), nl.hbm, "x")
    with pytest.raises(NkiValidationError, match=r"dma_transpose: dge_mode=unknown: src shape \(128, 2, 3, 128\) "
                       r"meets neither the hardware-DGE rules .* nor a form AWS's tested kernels use"):
        nisa.dma_transpose(dst=nl.ndarray((128, 2, 3, 128), BF16, buffer=nl.sbuf), src=src)


def test_transpose_with_static_dma_dge_mode_none():
    """mlp_tkg's gate/up bias load (run by moe_tkg, tested on trn2): a [n, 1, 1, I0] view transposed
    to [I0, 1, 1, n] with ``dge_mode=3`` (none); swdge without an indirect src stays refused, none keeps
    unknown's shape rules."""
    b = RNG.standard_normal((3, 128)).astype(BF16)
    src = from_array(b, nl.hbm, "bias").ap(pattern=[[128, 3], [1, 1], [1, 1], [1, 128]], offset=0)
    dst = nl.ndarray((128, 3), BF16, buffer=nl.sbuf, name="biasT")
    nisa.dma_transpose(dst=dst.ap(pattern=[[3, 128], [1, 1], [1, 1], [1, 3]], offset=0), src=src, dge_mode=3)
    np.testing.assert_array_equal(dst.np(), b.T)
    with pytest.raises(NkiValidationError, match=r"dma_transpose: dge_mode=none: src shape \(128, 2, 3, 128\)"):
        nisa.dma_transpose(dst=nl.ndarray((128, 2, 3, 128), BF16, buffer=nl.sbuf), dge_mode=3,
                           src=from_array(np.zeros((128, 2, 3, 128), BF16), nl.hbm, "x"))
    with pytest.raises(NkiValidationError, match=r"dma_transpose: the only valid dge_modes are unknown, hwdge and "
                       r"none \(static\); swdge needs an indirect \(vector_offset\) src, got dge_mode.swdge"):
        nisa.dma_transpose(dst=nl.ndarray((128, 3), BF16, buffer=nl.sbuf), src=from_array(b.T.copy(), nl.hbm, "b"),
                           dge_mode=nisa.dge_mode.swdge)


@pytest.mark.parametrize("mode", [nisa.dge_mode.swdge, nisa.dge_mode.unknown])
def test_indirect_transpose_gathers_rows_then_transposes(mode):
    """attention_tkg's block-KV K^T load: a [blocks * block_len * d] cache viewed as [128, 1, block_len, d]
    with partition p reading block ``idx[p]`` (vector_offset), transposed to [d, 1, block_len, 128] at
    dge_mode=swdge (the DGE guide: software DGE is the mode for indirect gathers)."""
    blocks, blk, d = 300, 4, 64
    cache = RNG.standard_normal((blocks, 1, blk, d)).astype(BF16)
    idx_np = RNG.choice(blocks, size=128, replace=False).astype(np.uint32).reshape(128, 1)
    idx = from_array(idx_np, nl.sbuf, "blocks")
    src = from_array(cache, nl.hbm, "k").ap([[blk * d, 128], [1, 1], [d, blk], [1, d]], offset=0,
                                            vector_offset=idx, indirect_dim=0)
    dst = nl.ndarray((d, 1, blk, 128), BF16, buffer=nl.sbuf, name="kT")
    with trace.record() as tr:
        nisa.dma_transpose(dst=dst, src=src, axes=(3, 1, 2, 0), dge_mode=mode)
    np.testing.assert_array_equal(dst.np(), np.transpose(cache[idx_np[:, 0]], (3, 1, 2, 0)))
    assert tr.instrs[0].attrs["indirect"] is True
    # oob_mode=skip leaves the columns of out-of-range rows untouched
    idx.np()[5, 0] = blocks + 7
    before = dst.np().copy()
    nisa.dma_transpose(dst=dst, src=src, dge_mode=mode, oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(dst.np()[..., 5], before[..., 5])
    with pytest.raises(NkiValidationError, match=r"dma_transpose: .* out of bounds"):
        nisa.dma_transpose(dst=dst, src=src, dge_mode=mode)


def test_indirect_transpose_rules():
    idx = from_array(np.zeros((128, 1), np.uint32), nl.sbuf, "blocks")
    src = from_array(np.zeros((8, 1, 4, 64), BF16), nl.hbm, "k").ap([[256, 128], [1, 1], [64, 4], [1, 64]],
                                                                   offset=0, vector_offset=idx, indirect_dim=0)
    dst = nl.ndarray((64, 1, 4, 128), BF16, buffer=nl.sbuf)
    for mode in (nisa.dge_mode.hwdge, 3):  # descriptors fixed at compile time cannot follow SBUF indices
        with pytest.raises(NkiValidationError, match=r"dma_transpose: the only valid dge_modes are unknown and "
                           r"swdge for an indirect \(vector_offset\) src, got dge_mode.(hwdge|none)"):
            nisa.dma_transpose(dst=dst, src=src, dge_mode=mode)


def test_dge_mode_given_as_its_raw_value():
    """norm_tkg_utils.py / qkv_tkg.py / mlp_tkg: ``_DGE_MODE_NONE = 3`` passed as dge_mode."""
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    dst = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    with trace.record() as tr:
        nisa.dma_copy(dst=dst, src=from_array(x, nl.hbm, "x"), dge_mode=3)
    np.testing.assert_array_equal(dst.np(), x)
    assert tr.instrs[0].attrs["dge_mode"] == "none"
    with pytest.raises(NkiValidationError, match=r"dge_mode=hwdge needs equal dtypes"):  # 2 is hwdge
        nisa.dma_copy(dst=nl.ndarray((4, 8), BF16, buffer=nl.sbuf), src=from_array(x, nl.hbm, "x"), dge_mode=2)
    with pytest.raises(NkiValidationError, match=r"dma_copy: dge_mode must be one of unknown \(0\), swdge \(1\), "
                       r"hwdge \(2\), none \(3\), got 7"):
        nisa.dma_copy(dst=dst, src=from_array(x, nl.hbm, "x"), dge_mode=7)
