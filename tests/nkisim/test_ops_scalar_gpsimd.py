"""Scalar Engine (activation) and GpSimd (iota, affine_select) instructions against numpy/torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trnkit.nkisim import ops as nl
from trnkit.nkisim import trace
from trnkit.nkisim.isa import gpsimd, scalar
from trnkit.nkisim.isa.common import reduce_cmd

from ._tiles import BF16, F16, F32, FLOATS, as_f32, empty, psum, ref_round, tile

RNG = np.random.default_rng(42)


def _rand(shape, dtype=F32, lo=-3.0, hi=3.0) -> np.ndarray:
    return RNG.uniform(lo, hi, size=shape).astype(np.float32).astype(dtype).astype(np.float32)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("name,ref", [
    ("exp", torch.exp), ("silu", torch.nn.functional.silu), ("gelu", torch.nn.functional.gelu),
    ("tanh", torch.tanh), ("sigmoid", torch.sigmoid), ("square", torch.square), ("copy", lambda t: t),
    ("relu", torch.relu)])
def test_activation_scale_column_bias_column(name, ref, dtype) -> None:
    x = _rand((128, 4, 64), dtype)
    scale, bias = _rand((128, 1), F32, 0.5, 1.5), _rand((128, 1), F32, -1, 1)
    dst = empty((128, 256), dtype)
    scalar.activation(dst, getattr(nl, name), tile(x, dtype), bias=tile(bias), scale=tile(scale))
    pre = x.reshape(128, -1) * scale + bias  # fp32, like the engine
    want = ref(torch.from_numpy(pre.astype(np.float64))).numpy()
    got = as_f32(dst)
    if dtype == F32:
        np.testing.assert_allclose(got, want, rtol=3e-6, atol=3e-6)
    else:  # one rounding to the output dtype on top of the fp32 result
        eps = 2.0**-8 if dtype == BF16 else 2.0**-11
        np.testing.assert_allclose(got, want, rtol=eps, atol=1e-6)


def test_activation_bf16_output_is_rne_of_fp32_result() -> None:
    x = _rand((64, 128))
    dst = empty((64, 128), BF16)
    scalar.activation(dst, nl.exp, tile(x), scale=0.5, bias=0.25)  # scalar bias: NeuronCore-v3+
    want = np.exp(x * np.float32(0.5) + np.float32(0.25))
    np.testing.assert_array_equal(as_f32(dst), ref_round(want, BF16))


def test_activation_reads_psum_writes_sbuf_and_numpy_op() -> None:
    x = _rand((32, 100))
    dst = empty((32, 100), F16)
    scalar.activation(dst, np.tanh, tile(x, F32, psum))
    np.testing.assert_array_equal(as_f32(dst), ref_round(np.tanh(x), F16))


def test_activation_reduce_cmds_accumulate_in_registers() -> None:
    x1, x2 = _rand((16, 40)), _rand((16, 40))
    d, res = empty((16, 40), F32), empty((16, 1), F32)
    scalar.activation(d, nl.exp, tile(x1), reduce_op=nl.add, reduce_cmd=reduce_cmd.reset_reduce)
    scalar.activation(d, nl.exp, tile(x2), reduce_op=nl.add, reduce_cmd=reduce_cmd.reduce, reduce_res=res)
    np.testing.assert_allclose(res.np()[:, 0], np.exp(x1).sum(1) + np.exp(x2).sum(1), rtol=1e-5)
    # idle keeps the registers; reset zeroes them
    scalar.activation(d, nl.exp, tile(x2), reduce_res=res)
    np.testing.assert_allclose(res.np()[:, 0], np.exp(x1).sum(1) + np.exp(x2).sum(1), rtol=1e-5)
    scalar.activation(d, nl.exp, tile(x2), reduce_cmd=reduce_cmd.reset, reduce_res=res)
    np.testing.assert_array_equal(res.np()[:, 0], np.zeros(16))


def test_activation_softmax_pattern_reduce_res_in_one_call() -> None:
    x = _rand((128, 512))
    neg_max = -x.max(axis=1, keepdims=True)
    e, s = empty((128, 512), BF16), empty((128, 1), F32)
    scalar.activation(e, nl.exp, tile(x), bias=tile(neg_max), reduce_op=nl.add, reduce_res=s,
                      reduce_cmd=reduce_cmd.reset_reduce)
    ex = np.exp(x + neg_max)
    np.testing.assert_allclose(s.np()[:, 0], ex.sum(1), rtol=1e-5)  # sums the fp32 values
    np.testing.assert_array_equal(as_f32(e), ref_round(ex, BF16))


def test_activation_reduce() -> None:
    x = _rand((100, 3, 30))
    d, res = empty((100, 90), F32), empty((100, 1), F32)
    scalar.activation_reduce(d, nl.square, tile(x), nl.add, res, scale=2.0)
    sq = np.square(x.reshape(100, -1) * np.float32(2.0))
    np.testing.assert_array_equal(as_f32(d), sq)
    np.testing.assert_allclose(res.np()[:, 0], np.sum(sq, axis=1), rtol=1e-5)


def test_activation_trace() -> None:
    x, r = tile(_rand((128, 64))), empty((128, 1), F32)
    with trace.record() as tr:
        scalar.activation(empty((128, 64), BF16), nl.exp, x, reduce_op=nl.add, reduce_res=r,
                          reduce_cmd=reduce_cmd.reset_reduce)
    (i,) = tr.instrs
    assert (i.engine, i.partitions, i.elems_per_partition, i.attrs["op"]) == ("scalar", 128, 64, "exp")
    assert i.attrs["reduce_res"] is True and len(i.attrs["writes"]) == 2


@pytest.mark.parametrize("dtype", [np.int32, np.float32, BF16, np.uint16], ids=lambda d: np.dtype(d).name)
def test_iota_2d_pattern_with_channel_multiplier(dtype) -> None:
    dst = empty((128, 4, 8), dtype)
    gpsimd.iota(dst, [[8, 4], [1, 8]], offset=5, channel_multiplier=32)
    want = 5 + 32 * np.arange(128)[:, None, None] + 8 * np.arange(4)[None, :, None] + np.arange(8)
    np.testing.assert_array_equal(dst.np(), want.astype(np.float32).astype(dtype))


def test_iota_negative_steps_and_4d() -> None:
    dst = empty((3, 2 * 3 * 2 * 2), np.int32)
    gpsimd.iota(dst, [[-100, 2], [10, 3], [0, 2], [-1, 2]], offset=0, channel_multiplier=-1)
    w, z, y, x = np.meshgrid(np.arange(2), np.arange(3), np.arange(2), np.arange(2), indexing="ij")
    pat = (-100 * w + 10 * z + 0 * y - x).reshape(-1)
    np.testing.assert_array_equal(dst.np(), -np.arange(3)[:, None] + pat[None, :])


def test_affine_select_causal_mask() -> None:
    # Keep scores[q, k] where q - k >= 0 (partition = query row), else -inf-like fill.
    P, K = 128, 200
    x = _rand((P, K))
    dst = empty((P, K), BF16)
    gpsimd.affine_select(dst, pattern=[[-1, K]], channel_multiplier=1, on_true_tile=tile(x),
                         on_false_value=-9984.0, cmp_op=nl.greater_equal)
    q, k = np.arange(P)[:, None], np.arange(K)[None, :]
    want = np.where(q - k >= 0, x, np.float32(-9984.0))
    np.testing.assert_array_equal(as_f32(dst), ref_round(want, BF16))


def test_affine_select_same_dtype_is_bit_exact_and_default_cmp_equal() -> None:
    bits = RNG.integers(0, 2**32, size=(4, 16), dtype=np.uint64).astype(np.uint32)
    bits[:, 0] = 0x7FC00123  # a NaN payload survives the selection
    src = tile(bits.view(np.float32))
    dst = empty((4, 16), F32)
    gpsimd.affine_select(dst, [[1, 16]], channel_multiplier=-1, on_true_tile=src, on_false_value=1.0)
    sel = (np.arange(16)[None, :] - np.arange(4)[:, None]) == 0
    np.testing.assert_array_equal(dst.np().view(np.uint32)[sel], bits[sel])
    np.testing.assert_array_equal(dst.np()[~sel], 1.0)
