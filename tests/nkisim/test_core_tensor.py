"""NkiTensor views: indexing rules, view primitives and .ap() checked against numpy on random data."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim.errors import NkiValidationError
from trnkit.nkisim.tensor import NkiTensor, VirtualRegister, from_array

RNG = np.random.default_rng(0)


def sb(values: np.ndarray, buffer=nl.sbuf) -> NkiTensor:
    t = nl.ndarray(values.shape, values.dtype, buffer=buffer)
    t.np()[...] = values
    return t


def hb(values: np.ndarray) -> NkiTensor:
    return from_array(np.ascontiguousarray(values), nl.hbm, "x")


# -- __getitem__ -----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [
    (slice(None), slice(3, 17)),
    (slice(8, 40), slice(0, 64, 3)),
    (slice(None), slice(-10, None)),
    (Ellipsis, slice(1, 5)),
    (slice(0, 128, 1), Ellipsis),
])
def test_slices_match_numpy(key):
    a = RNG.standard_normal((128, 64)).astype(np.float32)
    t = sb(a)
    np.testing.assert_array_equal(t[key].np(), a[key])


def test_ds_and_chained_slicing():
    a = RNG.standard_normal((64, 8, 32)).astype(np.float32)
    t = sb(a)
    v = t[nl.ds(16, 32), :, nl.ds(4, 8)][:, 2:6, ::2]
    np.testing.assert_array_equal(v.np(), a[16:48, :, 4:12][:, 2:6, ::2])
    assert v.partition_start == 16


def test_views_alias_storage():
    t = sb(np.zeros((4, 8), np.float32))
    t[:, 2:4].np()[...] = 7.0
    assert (t.np()[:, 2:4] == 7).all() and (t.np()[:, :2] == 0).all()


def test_on_chip_int_index_rules():
    a = RNG.standard_normal((64, 64, 64)).astype(np.float32)
    t = sb(a)
    # language guide: t[:,0,10] on (64,64,64) -> (64,1); t[0,0,10] -> (1,1)
    v = t[:, 0, 10]
    assert v.shape == (64, 1)
    np.testing.assert_array_equal(v.np()[:, 0], a[:, 0, 10])
    w = t[0, 0, 10]
    assert w.shape == (1, 1) and w.np()[0, 0] == a[0, 0, 10]
    assert t[3].shape == (1, 64, 64)  # an int on the partition dim keeps a size-1 dim
    assert t[:, 5].shape == (64, 64)
    np.testing.assert_array_equal(t[:, 5].np(), a[:, 5])


def test_hbm_int_index_rules():
    a = RNG.standard_normal((4, 6, 8)).astype(np.float32)
    t = hb(a)
    assert t[1].shape == (6, 8)
    np.testing.assert_array_equal(t[1, :, 3].np(), a[1, :, 3])
    assert t[1, 2, 3].shape == (1,) and t[1, 2, 3].np()[0] == a[1, 2, 3]
    np.testing.assert_array_equal(t[-1, -2].np(), a[-1, -2])


@pytest.mark.parametrize("key, msg", [
    ((slice(None), 64), "index 64 out of bounds for dim 1 of size 64"),
    ((slice(0, 129),), "slice 0:129 out of bounds"),
    ((slice(None), slice(60, 70)), "slice 60:70 out of bounds"),
    ((slice(None), slice(0, 0)), r"slice 0:0 out of bounds \(or empty\)"),  # nl.ds(0, 0)
])
def test_out_of_range_views_raise_when_an_instruction_accesses_them(key, msg):
    """Views are checked at the first access, not when built: AWS's kernels build out-of-range views
    (an .ap past the end, an empty nl.ds(0, 0)) that only a guard keeps from being used."""
    t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, name="tile_a")
    view = t[key]  # built: fine
    with pytest.raises(NkiValidationError, match="^memset: .*'tile_a'"):  # its own rules, or bounds
        nisa.memset(dst=view, value=0.0)
    with pytest.raises(NkiValidationError, match=f"^access: {msg}.*tensor 'tile_a', accessed"):
        view.np()


def test_an_in_range_subview_of_an_out_of_range_view_is_usable():
    t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, name="tile_a")
    wide = t[:, 0:100]  # past the end, never accessed whole
    nisa.memset(dst=wide[:, 0:64], value=2.0)
    assert (t.np() == 2.0).all()


@pytest.mark.parametrize("key, msg", [
    ((0, 0, 0), "too many indices"),
    ((slice(None), slice(0, 8, -1)), "slice step must be >= 1"),
    ((slice(0, 128, 2),), "partition access must be contiguous"),
])
def test_structural_index_errors_raise_when_built(key, msg):
    t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, name="tile_a")
    with pytest.raises(NkiValidationError, match=msg):
        t[key]


def test_assignment_and_operators_refused():
    t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
    with pytest.raises(NkiValidationError, match="written only by nki.isa"):
        t[0] = 1.0
    for f in (lambda: t + t, lambda: t * 2.0, lambda: 1.0 - t, lambda: -t, lambda: t @ t):
        with pytest.raises(NkiValidationError, match="use nki.isa"):
            f()
    assert (t != None) is True  # noqa: E711  (nki-library writes `rope_cache != None`)


# -- view primitives --------------------------------------------------------------------------------
def test_view_primitives_match_numpy():
    a = RNG.standard_normal((16, 4, 6)).astype(np.float32)
    t = sb(a)
    np.testing.assert_array_equal(t.permute((0, 2, 1)).np(), a.transpose(0, 2, 1))
    np.testing.assert_array_equal(t.reshape((16, 24)).np(), a.reshape(16, 24))
    np.testing.assert_array_equal(t.reshape_dim(2, (2, -1)).np(), a.reshape(16, 4, 2, 3))
    np.testing.assert_array_equal(t.flatten_dims(1, 2).np(), a.reshape(16, 24))
    np.testing.assert_array_equal(t.slice(1, 1, 4, 2).np(), a[:, 1:4:2])
    np.testing.assert_array_equal(t.select(2, 5).np(), a[:, :, 5])
    e = t[:, 0:1, :].broadcast(1, 3)
    np.testing.assert_array_equal(e.np(), np.broadcast_to(a[:, 0:1], (16, 3, 6)))
    assert t.expand_dim(1).shape == (16, 1, 4, 6)
    assert t.expand_dim(1).squeeze_dim(1).shape == (16, 4, 6)
    u = sb(RNG.standard_normal((8, 24)).astype(np.float32))
    r = u.rearrange(("b", ("h", "w")), ("b", "w", "h"), {"h": 4})
    np.testing.assert_array_equal(r.np(), u.np().reshape(8, 4, 6).transpose(0, 2, 1))
    assert t.get_pattern() == [[24, 16], [6, 4], [1, 6]]
    assert t.is_contiguous() and not t.permute((0, 2, 1)).is_contiguous()


def test_reshape_refuses_copying_layouts_and_partition_changes():
    t = nl.ndarray((16, 4, 6), nl.float32, buffer=nl.sbuf, name="r")
    with pytest.raises(NkiValidationError, match="partition dim"):
        t.reshape((32, 12))
    with pytest.raises(NkiValidationError, match="without a copy"):
        t.permute((0, 2, 1)).reshape((16, 24))
    with pytest.raises(NkiValidationError, match="partition dim"):
        t.permute((1, 0, 2))
    with pytest.raises(NkiValidationError, match="partition dim"):
        t.broadcast(0, 4)
    with pytest.raises(NkiValidationError, match="only size-1 dims"):
        t.broadcast(1, 8)
    h = hb(np.arange(24, dtype=np.float32).reshape(4, 6))
    np.testing.assert_array_equal(h.reshape((3, 8)).np(), np.arange(24).reshape(3, 8))
    np.testing.assert_array_equal(h.permute((1, 0)).np(), np.arange(24).reshape(4, 6).T)


def test_view_dtype_reinterprets_bytes():
    a = RNG.standard_normal((8, 16)).astype(np.float32)
    t = sb(a)
    u = t.view(nl.uint8)
    assert u.shape == (8, 64)
    np.testing.assert_array_equal(u.np(), a.view(np.uint8))
    b = t.view(nl.bfloat16)
    np.testing.assert_array_equal(b.np().view(np.uint16), a.view(np.uint16))
    np.testing.assert_array_equal(u.view(nl.float32).np(), a)
    np.testing.assert_array_equal(t[:, 4:8].view(nl.int16).np(), a[:, 4:8].view(np.int16))
    with pytest.raises(NkiValidationError, match="last dim must be contiguous"):
        t[:, ::2].view(nl.bfloat16)


# -- .ap ----------------------------------------------------------------------------------------------
def test_ap_doc_example_and_ignores_view():
    a = RNG.standard_normal((16, 16)).astype(np.float32)
    t = sb(a)
    # nki-aps.rst: t[0:16, 8:16] == t.ap([[16, 16], [1, 8]], offset=8)
    v = t.ap(pattern=[[16, 16], [1, 8]], offset=8)
    np.testing.assert_array_equal(v.np(), a[:, 8:16])
    # .ap addresses the storage, not the view it is called on; offset=None inherits the view offset
    w = t[:, 4:8].ap(pattern=[[16, 16], [2, 4]])
    np.testing.assert_array_equal(w.np(), a[:, 4:12:2])


def test_ap_hbm_any_pattern_matches_as_strided():
    a = RNG.standard_normal((4, 8, 32)).astype(np.float32)
    t = hb(a)
    flat = a.reshape(-1)
    pattern = [[32, 8], [256, 4], [1, 32]]  # [S, B, D] view of a [B, S, D] tensor
    v = t.ap(pattern, offset=0)
    ref = np.lib.stride_tricks.as_strided(flat, (8, 4, 32), (128, 1024, 4))
    np.testing.assert_array_equal(v.np(), ref)
    np.testing.assert_array_equal(v.np(), a.transpose(1, 0, 2))
    w = t.ap([[64, 4], [2, 16]], offset=5)
    np.testing.assert_array_equal(w.np(), np.lib.stride_tricks.as_strided(flat[5:], (4, 16), (256, 8)))


def test_ap_dtype_reinterpret():
    a = RNG.integers(-(2**31), 2**31 - 1, size=(8, 16), dtype=np.int32)
    t = sb(a)
    v = t.ap(pattern=[[32, 8], [1, 32]], offset=0, dtype=nl.bfloat16)
    np.testing.assert_array_equal(v.np().view(np.int16), a.view(np.int16))


def test_ap_rules():
    t = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf, name="apt")
    # nki-aps.rst: reading every other partition is illegal
    with pytest.raises(NkiValidationError, match=r"first pattern pair's step must equal .* \(32\), got 64"):
        t.ap(pattern=[[64, 8], [1, 32]], offset=0)
    # out of range: built, raised when accessed (here: read by a test, outside an instruction)
    with pytest.raises(NkiValidationError,
                       match="access: tensor 'apt': free-dim access .* out of bounds for 32 elements"):
        t.ap(pattern=[[32, 16], [1, 33]], offset=0).np()
    with pytest.raises(NkiValidationError, match=r"partitions \[8, 24\) out of bounds for 16"):
        t.ap(pattern=[[32, 16], [1, 32]], offset=8 * 32).np()
    h = hb(np.zeros((4, 8), np.float32))
    with pytest.raises(NkiValidationError, match="access .* out of bounds for storage of 32 elements"):
        h.ap([[8, 4], [1, 9]], offset=0).np()
    with pytest.raises(NkiValidationError, match="mutually exclusive"):
        idx = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
        h.ap([[8, 4], [1, 8]], scalar_offset=idx[0:1, :], vector_offset=idx)


def test_ap_on_a_column_view_is_relative_to_the_view():
    # AWS's core/mlp/mlp_tkg: a [T, 2I] SBUF tile, a .ap view of its second half (the up projection),
    # then TensorView(view).slice(1, o, o + n).get_view(): a pattern stepping by the view's own row (I)
    a = RNG.standard_normal((8, 32)).astype(np.float32)
    t = sb(a)
    up = t.ap(pattern=[[32, 8], [1, 16]], offset=16)
    v = up.ap(pattern=[[16, 8], [1, 6]], offset=4)
    np.testing.assert_array_equal(v.np(), a[:, 20:26])
    nisa.tensor_scalar(dst=v, data=v, op0=nl.multiply, operand0=2.0)  # writes land in the view's columns
    expect = a.copy()
    expect[:, 20:26] *= 2
    np.testing.assert_array_equal(t.np(), expect)
    # a slice of columns is a view of its own too; the storage's step keeps addressing the storage
    np.testing.assert_array_equal(t[2:6, 8:16].ap(pattern=[[8, 3], [2, 4]], offset=9).np(), a[3:6, 9:16:2])
    np.testing.assert_array_equal(up.ap(pattern=[[32, 8], [1, 4]], offset=0).np(), a[:, 0:4])


def test_ap_on_a_column_view_rules():
    t = nl.ndarray((8, 32), nl.float32, buffer=nl.sbuf, name="cv")
    up = t.ap(pattern=[[32, 8], [1, 16]], offset=16)
    # nki-aps.rst: the partition access must be continuous (neither the view's nor the storage's row)
    with pytest.raises(NkiValidationError, match=r"first pattern pair's step must equal .* \(32\) or of the view "
                       r".* \(16\), got 8"):
        up.ap(pattern=[[8, 8], [1, 8]], offset=0)
    # a free pattern past the view's row would need a different pattern per partition
    with pytest.raises(NkiValidationError, match=r"ap: tensor 'cv': .* stay inside the view's row; offset 12 .*"
                       r"reaches element 17"):
        up.ap(pattern=[[16, 8], [1, 6]], offset=12)
    with pytest.raises(NkiValidationError, match=r"partitions \[2, 10\) of a view with 8 partitions"):
        up.ap(pattern=[[16, 8], [1, 4]], offset=32)
    # a strided column view is not a tensor of its own: only the storage's step applies
    with pytest.raises(NkiValidationError, match="first pattern pair's step"):
        t[:, ::2].ap(pattern=[[16, 8], [1, 4]], offset=0)


def test_ap_scalar_offset_resolved_at_use():
    a = RNG.standard_normal((4, 128, 8)).astype(np.float32)
    t = hb(a)
    idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    # nki-aps.rst: start = offset + value * prod(base.shape[indirect_dim+1:])
    v = t.ap([[8, 128], [1, 8]], offset=0, scalar_offset=idx, indirect_dim=0)
    assert v.is_indirect()
    for i in (3, 1):
        idx.np()[...] = i
        np.testing.assert_array_equal(v.np(), a[i])
    idx.np()[...] = 4
    with pytest.raises(NkiValidationError, match="out of bounds .*dynamic scalar_offset value 4"):
        v.np()
    r = VirtualRegister(2)
    np.testing.assert_array_equal(t.ap([[1, 8]], offset=5, scalar_offset=r, indirect_dim=1).np(),
                                  a.reshape(-1)[2 * 8 + 5:2 * 8 + 13])
    # select(dim, tensor): dynamic selection
    idx.np()[...] = 2
    np.testing.assert_array_equal(t.select(0, idx).np(), a[2])


def test_vector_offset_views_only_for_dma():
    t = hb(np.zeros((8, 4), np.float32))
    idx = nl.ndarray((3, 1), nl.int32, buffer=nl.sbuf)
    v = t.ap([[4, 3], [1, 4]], vector_offset=idx, indirect_dim=0)
    with pytest.raises(NkiValidationError, match="only nisa.dma_copy"):
        v.np()
    s = nl.ndarray((3, 4), nl.float32, buffer=nl.sbuf)
    with pytest.raises(NkiValidationError, match="needs an HBM tensor"):
        s.ap([[4, 3], [1, 4]], vector_offset=idx)
    with pytest.raises(NkiValidationError, match="only indirect_dim=0"):
        t.ap([[4, 3], [1, 4]], vector_offset=idx, indirect_dim=1)
    with pytest.raises(NkiValidationError, match="vector_offset has 3 partitions, the pattern's first pair has 2"):
        t.ap([[4, 2], [1, 4]], vector_offset=idx)


def test_virtual_register_refuses_python_arithmetic():
    r = VirtualRegister(3)
    with pytest.raises(NkiValidationError, match="no compile-time value"):
        r + 1
    with pytest.raises(NkiValidationError, match="no compile-time value"):
        range(r)


def test_on_chip_partition_access_must_be_contiguous():
    t = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf, name="pc")
    with pytest.raises(NkiValidationError, match=r"tensor 'pc': partition access must be contiguous "
                                                 r"\(partition step 16 elements, storage partition "
                                                 r"stride 8\)"):
        t[0:128:2, :]
    h = hb(np.arange(64, dtype=np.float32).reshape(8, 8))  # HBM: any step
    np.testing.assert_array_equal(h[::2, ::3].np(), np.arange(64).reshape(8, 8)[::2, ::3])


# -- property test: random index chains agree with numpy ------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _index(draw, shape):
    key = []
    for d, n in enumerate(shape):
        kind = draw(st.sampled_from(["all", "slice", "int"] if d else ["all", "slice"]))
        if kind == "all":
            key.append(slice(None))
        elif kind == "int":
            key.append(draw(st.integers(-n, n - 1)))
        else:
            start = draw(st.integers(0, n - 1))
            stop = draw(st.integers(start + 1, n))
            key.append(slice(start, stop, draw(st.integers(1, 3))))
    return tuple(key)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_index_chains_match_numpy(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=2, max_size=4)))
    on_chip = data.draw(st.booleans())
    a = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
    t = sb(a) if on_chip else hb(a)
    ref = a
    for _ in range(2):
        key = data.draw(_index(ref.shape))
        if on_chip:
            key = (slice(None),) + key[1:]  # keep partitions contiguous
        t = t[key]
        ref = ref[key]
        # NKI rules: on-chip results stay >= 2-D (the last int-indexed dim is kept, size 1);
        # HBM results stay >= 1-D
        if ref.ndim < (2 if on_chip else 1):
            ref = ref.reshape(ref.shape + (1,))
        assert t.shape == ref.shape
        np.testing.assert_array_equal(t.np(), ref)
        if ref.ndim < 2:
            break


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_ap_matches_as_strided(data):
    """HBM .ap(pattern, offset) == numpy as_strided over the flat storage; out of range raises."""
    n = 240
    flat = np.arange(n, dtype=np.float32)
    t = hb(flat.reshape(6, 40))
    ndim = data.draw(st.integers(1, 3))
    pattern = [[data.draw(st.integers(0, 30)), data.draw(st.integers(1, 6))] for _ in range(ndim)]
    offset = data.draw(st.integers(0, n - 1))
    hi = offset + sum(s * (c - 1) for s, c in pattern)
    if hi >= n:
        view = t.ap(pattern, offset=offset)  # built; the access raises
        with pytest.raises(NkiValidationError, match="out of bounds for storage of 240 elements"):
            view.np()
        return
    ref = np.lib.stride_tricks.as_strided(flat[offset:], [c for _, c in pattern],
                                          [4 * s for s, _ in pattern])
    np.testing.assert_array_equal(t.ap(pattern, offset=offset).np(), ref)
