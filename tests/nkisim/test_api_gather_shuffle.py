"""nc_stream_shuffle, nc_n_gather, local_gather, nonzero_with_count, tensor_partition_reduce against
numpy (the references of the NKI docs' example tests), with a negative test per documented rule."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit.nkisim import ops as nl
from trnkit.nkisim import trace
from trnkit.nkisim.errors import NkiValidationError
from trnkit.nkisim.isa import gather, shuffle

from ._tiles import BF16, F32, empty, psum, tile

RNG = np.random.default_rng(7)
I32, U16, U32 = np.dtype(np.int32), np.dtype(np.uint16), np.dtype(np.uint32)


def _rand(shape, dtype=F32):
    return (RNG.random(shape) * 100).astype(dtype)


# -- nc_stream_shuffle -----------------------------------------------------------------------------
def test_stream_shuffle_in_place_rotation_like_the_docs_example() -> None:
    x = _rand((32, 128))
    t = tile(x)
    mask = [(i - 1) % 32 for i in range(32)]
    shuffle.nc_stream_shuffle(dst=t, src=t, shuffle_mask=mask)
    np.testing.assert_array_equal(t.np(), x[mask])


def test_stream_shuffle_broadcasts_one_partition() -> None:
    x = _rand((1, 128))
    dst = empty((32, 128), F32)
    shuffle.nc_stream_shuffle(dst=dst, src=tile(x), shuffle_mask=[0] * 32)
    np.testing.assert_array_equal(dst.np(), np.repeat(x, 32, axis=0))


def test_stream_shuffle_applies_the_mask_per_quadrant_and_255_keeps() -> None:
    x = _rand((128, 64))
    before = _rand((128, 64))
    dst = tile(before)
    mask = [(i + 5) % 32 for i in range(32)]
    mask[3] = 255
    shuffle.nc_stream_shuffle(dst=dst, src=tile(x, buffer=psum), shuffle_mask=mask)
    want = before.copy()
    for q in range(4):
        for i, m in enumerate(mask):
            if m != 255:
                want[32 * q + i] = x[32 * q + m]
    np.testing.assert_array_equal(dst.np(), want)


def test_stream_shuffle_to_partition_32_reads_the_src_quadrant() -> None:
    big = empty((64, 16), BF16)
    src = _rand((1, 16), BF16)
    shuffle.nc_stream_shuffle(dst=big[32:64], src=tile(src), shuffle_mask=[0] * 32)
    np.testing.assert_array_equal(big.np()[32:64], np.repeat(src, 32, axis=0))


@pytest.mark.parametrize("case,match", [
    ("dtype", "must equal src dtype"),
    ("free", "elements per partition"),
    ("mask_len", "list of 32 ints"),
    ("mask_value", r"shuffle_mask\[0\] must be a partition"),
    ("reads_missing", "reads partition 1 of src, which has 1 partitions"),
    ("start", "src starts at partition 32; with 64 active partitions the start must be one of"),
])
def test_stream_shuffle_rules(case: str, match: str) -> None:
    src, dst, mask = tile(_rand((32, 8))), empty((32, 8), F32), list(range(32))
    if case == "dtype":
        dst = empty((32, 8), BF16)
    elif case == "free":
        dst = empty((32, 9), F32)
    elif case == "mask_len":
        mask = mask[:31]
    elif case == "mask_value":
        mask[0] = 32
    elif case == "reads_missing":
        src = tile(_rand((1, 8)))
    elif case == "start":
        big = tile(_rand((64, 8)))  # a 1-partition src at 32 is fine alone, not with a 64-partition dst
        src, dst, mask = big[32:33], empty((64, 8), F32), [0] * 32
    with pytest.raises(NkiValidationError, match=match):
        shuffle.nc_stream_shuffle(dst=dst, src=src, shuffle_mask=mask)


# -- nc_n_gather -----------------------------------------------------------------------------------
def test_n_gather_per_partition_over_flattened_free_dims() -> None:
    data = _rand((64, 4, 32), BF16)
    idx = RNG.integers(0, 128, size=(64, 3, 10)).astype(U32)
    dst = empty((64, 30), BF16)
    with trace.record() as tr:
        gather.nc_n_gather(dst=dst, data=tile(data), indices=tile(idx))
    want = np.take_along_axis(data.reshape(64, -1), idx.reshape(64, -1).astype(np.int64), axis=1)
    np.testing.assert_array_equal(dst.np(), want)
    assert tr.instrs[-1].engine == "gpsimd"


@pytest.mark.parametrize("case,match", [
    ("idx_dtype", "indices dtype int32 not supported"),
    ("range", r"out of range \[0, 16\)"),
    ("dst_dtype", "must equal data dtype"),
    ("count", "dst has 5 elements per partition, indices has 4"),
    ("psum", "GpSimd engine cannot access PSUM"),
])
def test_n_gather_rules(case: str, match: str) -> None:
    data, idx, dst = tile(_rand((8, 16))), np.arange(4, dtype=U32)[None].repeat(8, 0), empty((8, 4), F32)
    if case == "idx_dtype":
        idx = idx.astype(I32)
    elif case == "range":
        idx[3, 2] = 16
    elif case == "dst_dtype":
        dst = empty((8, 4), BF16)
    elif case == "count":
        dst = empty((8, 5), F32)
    elif case == "psum":
        data = tile(_rand((8, 16)), buffer=psum)
    with pytest.raises(NkiValidationError, match=match):
        gather.nc_n_gather(dst=dst, data=data, indices=tile(idx))


# -- local_gather ----------------------------------------------------------------------------------
def _local_gather_ref(src: np.ndarray, index: np.ndarray, k: int, n_valid: int) -> np.ndarray:
    """The numpy semantics block of nki/test/test_nki_isa_local_gather.py (aws-neuron-sdk), with the
    element-offset indices (``index * k``) the kernel receives divided back."""
    out = np.empty((src.shape[0], n_valid, k), src.dtype)
    for core in range(src.shape[0] // 16):
        sl = slice(16 * core, 16 * core + 16)
        rows = index[sl].reshape(16, -1).flatten(order="F")[:n_valid]
        out[sl] = np.take(src[sl].reshape(16, -1, k), rows, axis=1)
    return out


@pytest.mark.parametrize("k,n_valid", [(4, 64), (4, 50), (1, None), (32, 7)])
def test_local_gather_matches_the_docs_numpy_reference(k: int, n_valid: int | None) -> None:
    src = _rand((128, 64, k))
    per_core = RNG.integers(0, 64, size=(16, 4)).astype(U16)
    index = np.tile(per_core, (8, 1))
    nv = n_valid or 64
    dst = empty((128, nv * k), F32)
    gather.local_gather(dst, tile(src), tile((index * k).astype(U16)), num_elem_per_idx=k,
                        num_valid_indices=n_valid)
    np.testing.assert_array_equal(dst.np(), _local_gather_ref(src, index, k, nv).reshape(128, -1))


def test_local_gather_cores_use_their_own_indices() -> None:
    src = _rand((32, 16))
    index = RNG.integers(0, 16, size=(32, 2)).astype(U16)  # different per core
    dst = empty((32, 32), F32)
    gather.local_gather(dst, tile(src), tile(index))
    np.testing.assert_array_equal(dst.np(), _local_gather_ref(src, index, 1, 32).reshape(32, -1))


@pytest.mark.parametrize("case,match", [
    ("parts", "multiple of 16"),
    ("idx_dtype", "index dtype uint32 not supported"),
    ("elems", "num_elem_per_idx must be one of"),
    ("valid", r"num_valid_indices must be in \[1, 64\]"),
    ("max", "exceed the limit of 4096"),
    ("oob", "out of range"),
    ("dst_dtype", "no casting"),
])
def test_local_gather_rules(case: str, match: str) -> None:
    p, f, k, nv = 16, 4, 1, None
    src = tile(_rand((p, 64)))
    idx = np.zeros((p, f), U16)
    dst = empty((p, 64), F32)
    if case == "parts":
        src, idx, dst = tile(_rand((8, 64))), np.zeros((8, 4), U16), empty((8, 32), F32)
    elif case == "idx_dtype":
        idx = idx.astype(U32)
    elif case == "elems":
        k = 3
    elif case == "valid":
        nv = 65
    elif case == "max":
        idx, dst = np.zeros((p, 257), U16), empty((p, 4112), F32)
    elif case == "oob":
        idx[0, 0] = 64
    elif case == "dst_dtype":
        dst = empty((p, 64), BF16)
    with pytest.raises(NkiValidationError, match=match):
        gather.local_gather(dst, src, tile(idx), num_elem_per_idx=k, num_valid_indices=nv)


# -- nonzero_with_count ----------------------------------------------------------------------------
def test_nonzero_with_count_docs_example_and_only_core_partitions() -> None:
    x = np.zeros((32, 8), F32)
    x[0] = [0, 1, 1, 0, 0, 1, 0, 0]  # the docs' example row
    x[16] = [-0.0, 2, 0, 0, 0, 0, 0, 3]
    x[5] = 1  # partition 5 belongs to core 0 but is not its 0-th partition: ignored
    before = np.full((32, 9), 77, I32)
    dst = tile(before)
    gather.nonzero_with_count(dst, tile(x), index_offset=16, padding_val=-1)
    got = dst.np()
    np.testing.assert_array_equal(got[0], [17, 18, 21, -1, -1, -1, -1, -1, 3])
    np.testing.assert_array_equal(got[16], [17, 23, -1, -1, -1, -1, -1, -1, 2])
    others = [p for p in range(32) if p % 16]
    np.testing.assert_array_equal(got[others], before[others])


def test_nonzero_with_count_int32_against_numpy() -> None:
    x = RNG.integers(-2, 3, size=(128, 100)).astype(I32) * (RNG.random((128, 100)) < 0.3)
    x = x.astype(I32)
    dst = empty((128, 101), I32)
    gather.nonzero_with_count(dst, tile(x), padding_val=-7)
    for p in range(0, 128, 16):
        nz = np.flatnonzero(x[p])
        want = np.concatenate([nz, np.full(100 - nz.size, -7), [nz.size]])
        np.testing.assert_array_equal(dst.np()[p], want)


@pytest.mark.parametrize("case,match", [
    ("src_dtype", "src dtype bfloat16 not supported"),
    ("dst_dtype", "dst dtype float32 not supported"),
    ("size", "one more element per partition"),
    ("offset", "index_offset must be an int32 value"),
])
def test_nonzero_with_count_rules(case: str, match: str) -> None:
    src, dst, off = tile(np.ones((16, 4), F32)), empty((16, 5), I32), 0
    if case == "src_dtype":
        src = tile(np.ones((16, 4), BF16))
    elif case == "dst_dtype":
        dst = empty((16, 5), F32)
    elif case == "size":
        dst = empty((16, 4), I32)
    elif case == "offset":
        off = 2**31
    with pytest.raises(NkiValidationError, match=match):
        gather.nonzero_with_count(dst, src, index_offset=off)


# -- tensor_partition_reduce -----------------------------------------------------------------------
@pytest.mark.parametrize("op,ref", [("add", np.sum), ("maximum", np.max), ("average", np.mean)])
def test_partition_reduce_arithmetic(op: str, ref) -> None:
    x = _rand((128, 32, 4))
    dst = empty((1, 32, 4), F32)
    gather.tensor_partition_reduce(dst, getattr(nl, op), tile(x))
    np.testing.assert_allclose(dst.np(), ref(x, axis=0, keepdims=True), rtol=1e-6)


def test_partition_reduce_numpy_op_and_bitwise() -> None:
    x = RNG.integers(0, 2**20, size=(64, 10)).astype(I32)
    dst = empty((1, 10), I32)
    gather.tensor_partition_reduce(dst, nl.bitwise_or, tile(x))
    np.testing.assert_array_equal(dst.np()[0], np.bitwise_or.reduce(x, axis=0))
    f = _rand((16, 6))
    out = empty((1, 6), BF16)
    gather.tensor_partition_reduce(out, np.add, tile(f))  # old-style numpy op, bf16 output
    np.testing.assert_array_equal(out.np(), f.sum(axis=0, keepdims=True).astype(BF16))


@pytest.mark.parametrize("case,match", [
    ("op", "op must be one of"),
    ("parts", "dst must have 1 partition"),
    ("free", "dst has 5 elements per partition"),
    ("bitvec_float", "needs integer dtypes"),
])
def test_partition_reduce_rules(case: str, match: str) -> None:
    x, dst, op = tile(_rand((8, 4))), empty((1, 4), F32), nl.add
    if case == "op":
        op = nl.multiply
    elif case == "parts":
        dst = empty((2, 4), F32)
    elif case == "free":
        dst = empty((1, 5), F32)
    elif case == "bitvec_float":
        op = nl.bitwise_and
    with pytest.raises(NkiValidationError, match=match):
        gather.tensor_partition_reduce(dst, op, x)
