"""nisa.dma_copy: plain copies, casts (bf16 RNE vs ml_dtypes/torch), gathers/scatters, rules, trace."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim import trace
from trnkit.nkisim.errors import NkiValidationError
from trnkit.nkisim.tensor import from_array

RNG = np.random.default_rng(1)
BF16 = np.dtype(ml_dtypes.bfloat16)


def hb(values: np.ndarray, name: str = "x"):
    return from_array(np.ascontiguousarray(values), nl.hbm, name)


def test_hbm_sbuf_roundtrip_and_reshaped_copy():
    a = RNG.standard_normal((256, 64)).astype(np.float32)
    src = hb(a)
    out = np.zeros((64, 256), np.float32)
    dst = hb(out, "out")
    t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src[128:256, :])
    np.testing.assert_array_equal(t.np(), a[128:])
    # element counts match, shapes differ: row-major order of each view
    nisa.dma_copy(dst=dst[0:32, :], src=t)
    np.testing.assert_array_equal(out[0:32].reshape(-1), a[128:].reshape(-1))
    # SBUF -> SBUF and strided HBM views
    u = nl.ndarray((128, 32), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=u, src=t[:, ::2])
    np.testing.assert_array_equal(u.np(), a[128:, ::2])


def test_cast_bf16_round_to_nearest_even_matches_ml_dtypes_and_torch():
    # values straddling bf16 rounding boundaries, incl. exact ties
    base = RNG.standard_normal(4096).astype(np.float32)
    bits = base.view(np.uint32) & np.uint32(0xFFFF0000)
    ties = (bits | np.uint32(0x8000)).view(np.float32)  # exactly halfway between two bf16 values
    a = np.concatenate([base, ties]).reshape(64, 128)
    t = nl.ndarray((64, 128), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=hb(a))
    got = t.np().view(np.uint16)
    np.testing.assert_array_equal(got, a.astype(BF16).view(np.uint16))
    ref = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, ref)


def test_cast_to_int_via_fp32_rne_saturating():
    a = np.array([[0.5, 1.5, 2.5, -0.5, -1.5, 1e10, -1e10, 3.7]], np.float32)
    t = nl.ndarray((1, 8), nl.int8, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=hb(a))
    np.testing.assert_array_equal(t.np()[0], [0, 2, 2, 0, -2, 127, -128, 4])
    # bf16 -> fp32 is exact
    b = RNG.standard_normal((4, 16)).astype(BF16)
    f = nl.ndarray((4, 16), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=f, src=hb(b))
    np.testing.assert_array_equal(f.np(), b.astype(np.float32))


def test_indirect_gather_rows_doc_example():
    # dma_copy docstring "Indirect gather example": partition p reads row idx[p]
    data = RNG.standard_normal((50, 24)).astype(np.float32)
    rows = RNG.integers(0, 50, size=(96, 1)).astype(np.uint32)
    idx = nl.ndarray((96, 1), nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=hb(rows, "rows"))
    dst = nl.ndarray((96, 24), nl.bfloat16, buffer=nl.sbuf)
    x = hb(data, "data")
    nisa.dma_copy(dst=dst, src=x.ap(pattern=[[24, 96], [1, 24]], vector_offset=idx, indirect_dim=0))
    np.testing.assert_array_equal(dst.np().view(np.uint16),
                                  data[rows[:, 0]].astype(BF16).view(np.uint16))
    # a column window of the rows (offset shifts within the row; leading step is ignored)
    d2 = nl.ndarray((96, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=d2, src=x.ap(pattern=[[0, 96], [2, 8]], offset=3, vector_offset=idx))
    np.testing.assert_array_equal(d2.np(), data[rows[:, 0]][:, 3:19:2])


def test_indirect_gather_3d_base_rows():
    # row stride comes from the base tensor's shape: prod(shape[1:])
    data = RNG.standard_normal((10, 4, 8)).astype(np.float32)
    rows = np.array([[9], [0], [3]], np.int32)
    idx = nl.ndarray((3, 1), nl.int32, buffer=nl.sbuf)
    idx.np()[...] = rows
    dst = nl.ndarray((3, 4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=dst, src=hb(data).ap([[32, 3], [8, 4], [1, 8]], vector_offset=idx))
    np.testing.assert_array_equal(dst.np(), data[rows[:, 0]])


def test_indirect_scatter_rows():
    out = np.zeros((40, 16), np.float32)
    o = hb(out, "out")
    vals = RNG.standard_normal((8, 16)).astype(np.float32)
    src = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
    src.np()[...] = vals
    rows = np.array([5, 39, 0, 17, 2, 30, 11, 8], np.int32)
    idx = nl.ndarray((8, 1), nl.int32, buffer=nl.sbuf)
    idx.np()[:, 0] = rows
    nisa.dma_copy(dst=o.ap(pattern=[[16, 8], [1, 16]], vector_offset=idx, indirect_dim=0), src=src)
    ref = np.zeros_like(out)
    ref[rows] = vals
    np.testing.assert_array_equal(out, ref)  # written in place in the caller's array


def test_indirect_oob_error_and_skip():
    data = RNG.standard_normal((6, 4)).astype(np.float32)
    x = hb(data, "table")
    idx = nl.ndarray((3, 1), nl.int32, buffer=nl.sbuf)
    idx.np()[:, 0] = [1, 6, 2]
    dst = nl.ndarray((3, 4), nl.float32, buffer=nl.sbuf)
    view = x.ap([[4, 3], [1, 4]], vector_offset=idx)
    with pytest.raises(NkiValidationError, match=r"indirect index 6 \(partition 1\) out of bounds for "
                                                 r"6 rows of tensor 'table'"):
        nisa.dma_copy(dst=dst, src=view)
    nisa.memset(dst, 0.0)
    nisa.dma_copy(dst=dst, src=view, oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(dst.np(), np.stack([data[1], np.zeros(4), data[2]]))
    # skip keeps the integer bit patterns of the destination rows it leaves alone
    out = np.full((6, 4), -7, np.int32)
    src = nl.ndarray((3, 4), nl.int32, buffer=nl.sbuf)
    nisa.memset(src, 1)
    nisa.dma_copy(dst=hb(out).ap([[4, 3], [1, 4]], vector_offset=idx), src=src,
                  oob_mode=nisa.oob_mode.skip)
    assert (out[[1, 2]] == 1).all() and (out[[0, 3, 4, 5]] == -7).all()


def test_scalar_offset_dma_and_skip():
    a = RNG.standard_normal((512, 512)).astype(np.float32)
    x = hb(a, "A")
    b = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.memset(b, 3 * 128)
    res = nl.ndarray((128, 256), nl.float32, buffer=nl.sbuf)
    # nki-aps.rst "Scalar Dynamic Access": starts at 0 + batch_idx * 512
    nisa.dma_copy(dst=res, src=x.ap(pattern=[[512, 128], [1, 256]], offset=0, scalar_offset=b,
                                    indirect_dim=0))
    np.testing.assert_array_equal(res.np(), a[384:512, 0:256])
    nisa.memset(b, 500)
    with pytest.raises(NkiValidationError, match="dynamic scalar_offset value 500"):
        nisa.dma_copy(dst=res, src=x.ap(pattern=[[512, 128], [1, 256]], scalar_offset=b))
    before = res.np().copy()
    nisa.dma_copy(dst=res, src=x.ap(pattern=[[512, 128], [1, 256]], scalar_offset=b),
                  oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(res.np(), before)


def test_dma_rules():
    s = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, name="s")
    p = nl.ndarray((128, 64), nl.float32, buffer=nl.psum, name="p")
    h = hb(np.zeros((128, 64), np.float32))
    with pytest.raises(NkiValidationError, match="dma_copy: src cannot be in PSUM"):
        nisa.dma_copy(dst=h, src=p)
    with pytest.raises(NkiValidationError, match="dma_copy: dst cannot be in PSUM"):
        nisa.dma_copy(dst=p, src=h)
    with pytest.raises(NkiValidationError, match=r"element counts differ: dst \(128, 32\) has 4096, "
                                                 r"src \(128, 64\) has 8192"):
        nisa.dma_copy(dst=s[:, 0:32], src=h)
    b = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
    with pytest.raises(NkiValidationError, match="hwdge needs equal dtypes, got dst bfloat16 and "
                                                 "src float32"):
        nisa.dma_copy(dst=b, src=h, dge_mode=nisa.dge_mode.hwdge)
    nisa.dma_copy(dst=b.view(nl.int16), src=h.view(nl.int16)[:, 0:64], dge_mode=nisa.dge_mode.hwdge)
    with pytest.raises(NkiValidationError, match="src must be an NkiTensor"):
        nisa.dma_copy(dst=s, src=np.zeros((128, 64), np.float32))


def test_dma_trace_record():
    a = RNG.standard_normal((128, 64)).astype(BF16)
    t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    with trace.record() as tr:
        nisa.dma_copy(dst=t, src=hb(a))
    (ins,) = tr.instrs
    assert ins.op == "dma_copy" and ins.engine == "dma"
    assert ins.hbm_bytes == 128 * 64 * 2  # read bf16 from HBM
    assert ins.dma_bytes == 128 * 64 * 4
    assert ins.partitions == 128 and ins.elems_per_partition == 64
    assert [o.role for o in ins.operands] == ["dst", "src"]
    assert ins.attrs["contiguous_bytes"] == 128 * 64 * 2
    assert ins.attrs["writes"][0][1:] == (0, 128 * 64)


def test_dma_engine_only_with_hwdge():
    s = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
    with pytest.raises(NkiValidationError, match="engine= is only valid with dge_mode=hwdge"):
        nisa.dma_copy(dst=s, src=hb(np.zeros((4, 4), np.float32)), engine=nisa.engine.scalar)


def test_dependency_boxes_separate_disjoint_slices():
    from trnkit.nkisim.isa import common

    t = nl.ndarray((128, 4, 64), nl.float32, buffer=nl.sbuf)
    key = common.box(t)[0]
    assert common.box(t) == (key, 0, 128, 0, 256)
    assert common.box(t[:, 1, 32:]) == (key, 0, 128, 96, 128)
    assert common.box(t[64:96, :, 0:8]) == (key, 64, 96, 0, 200)
    assert common.box(t.view(nl.bfloat16)[:, :, 10:20]) == (key, 0, 128, 5, 202)  # storage units
    y = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    lo_half, hi_half = y[:, :32], y[:, 32:]
    # flat spans of the two column halves overlap (they cross every partition), the boxes do not
    assert common.span(lo_half)[2] > common.span(hi_half)[1]
    assert common.box(lo_half)[4] <= common.box(hi_half)[3]
    h = hb(np.zeros((8, 8), np.float32))
    hkey = common.box(h)[0]
    assert common.box(h) == (hkey, 0, 8, 0, 8)  # HBM: rows x columns of the last dimension
    assert common.box(h[2:4, 1:3]) == (hkey, 2, 4, 1, 3)
    assert common.span(h[2:4, 1:3])[1:] == (17, 27)  # the flat span crosses columns 3..8 of row 2
    # an access whose columns leave one row window gets the whole rows its flat span touches (a superset)
    assert common.box(h.reshape((1, 64))[:, 4:12]) == (hkey, 0, 2, 0, 8)
    assert common.box(h.view(nl.bfloat16)[2:3, 2:6]) == (hkey, 2, 3, 0, 8)  # other dtype than the storage
    with trace.record() as tr:
        nisa.dma_copy(dst=t[64:96, 0, :], src=h.reshape((1, 64)).broadcast(0, 32))
    assert tr.instrs[0].attrs["write_boxes"][0][1:] == (64, 96, 0, 64)


def test_dma_compute_sum_and_read_modify_write():
    a = RNG.standard_normal((16, 8)).astype(np.float32)
    b = RNG.standard_normal((16, 8)).astype(BF16)
    ta = nl.ndarray((16, 8), nl.float32, buffer=nl.sbuf)
    ta.np()[...] = a
    dst = nl.ndarray((16, 8), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_compute(dst, [ta, hb(b)], reduce_op=nl.add)  # fp32 sum, one RNE cast
    np.testing.assert_array_equal(dst.np(), (a + b.astype(np.float32)).astype(BF16))
    # scatter RMW: out[idx] += rows
    out = RNG.standard_normal((10, 8)).astype(np.float32)
    ref = out.copy()
    o = hb(out)
    idx = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
    idx.np()[:, 0] = [7, 2, 9, 0]
    view = o.ap([[8, 4], [1, 8]], vector_offset=idx)
    rows = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    rows.np()[...] = a[:4]
    nisa.dma_compute(view, [view, rows], reduce_op=nl.add)
    ref[[7, 2, 9, 0]] += a[:4]
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    # gather RMW: acc += table[idx]
    acc = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    acc.np()[...] = 1.0
    nisa.dma_compute(acc, [acc, o.ap([[8, 4], [1, 8]], vector_offset=idx)], reduce_op=nl.add)
    np.testing.assert_allclose(acc.np(), 1.0 + ref[[7, 2, 9, 0]], rtol=1e-6)
    idx.np()[:, 0] = [1, 1, 2, 3]
    with pytest.raises(NkiValidationError, match="indices must be unique"):
        nisa.dma_compute(view, [view, rows], reduce_op=nl.add)
    with pytest.raises(NkiValidationError, match="only reduce_op=nl.add"):
        nisa.dma_compute(dst, [ta, ta], reduce_op=nl.multiply)
    with pytest.raises(NkiValidationError, match="all scales must be 1.0"):
        nisa.dma_compute(dst, [ta, ta], reduce_op=nl.add, scales=[1.0, 2.0])


def test_vector_offset_rows_come_from_the_viewed_tensor_shape():
    # router_topk's indirect scatter (nki-library core/router_topk/router_topk.py): the [T, E] output
    # reshaped to 1-D, so vector_offset values are flat element offsets (row stride prod(()) = 1).
    T, E = 6, 5
    out = np.zeros((T, E), np.float32)
    flat = hb(out, "affinities").reshape((T * E,))
    pos = np.array([0, 7, 14, 29], np.int32)  # 29 * E would be out of bounds with the [T, E] rows
    idx = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
    idx.np()[:, 0] = pos
    vals = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
    vals.np()[:, 0] = [1, 2, 3, 4]
    nisa.dma_copy(dst=flat.ap([[1, 4], [1, 1]], offset=0, vector_offset=idx, indirect_dim=0), src=vals)
    want = np.zeros(T * E, np.float32)
    want[pos] = [1, 2, 3, 4]
    np.testing.assert_array_equal(out.reshape(-1), want)


def test_dynamic_offsets_on_a_reshaped_view_address_its_rows():
    # An in-bounds reshape: (8, 6) viewed as (4, 12). Rows of the view are 12 elements long; using
    # the allocation's 6 would silently read the wrong (but in-bounds) elements.
    a = np.arange(48, dtype=np.float32).reshape(8, 6)
    v = hb(a, "A").reshape((4, 12))
    idx = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
    idx.np()[:, 0] = [1, 3]
    got = nl.ndarray((2, 12), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=got, src=v.ap([[12, 2], [1, 12]], offset=0, vector_offset=idx))
    np.testing.assert_array_equal(got.np(), a.reshape(4, 12)[[1, 3]])
    reg = nisa.register_alloc(2)
    one = nl.ndarray((1, 12), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=one, src=v.ap([[12, 1], [1, 12]], offset=0, scalar_offset=reg, indirect_dim=0))
    np.testing.assert_array_equal(one.np(), a.reshape(4, 12)[2:3])
    # the row-gather view primitive keeps the view's own row step for a column window
    cols = nl.ndarray((2, 5), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=cols, src=v[:, 2:7].vector_select(0, idx))
    np.testing.assert_array_equal(cols.np(), a.reshape(4, 12)[[1, 3], 2:7])
