"""The tutorial kernels (tests/nkisim/tutorial_kernels.py) through @nki.jit on numpy inputs vs numpy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from trnkit.nkisim import trace

from . import tutorial_kernels as tk

BF16 = np.dtype(ml_dtypes.bfloat16)
RNG = np.random.default_rng(42)


def _rand(shape, dtype=np.float32, scale=1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def _f32(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


@pytest.mark.parametrize("shape", [(256, 1024), (300, 700), (5, 3)])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_tensor_add(shape, dtype) -> None:
    a, b = _rand(shape, dtype), _rand(shape, dtype)
    out = tk.tensor_add(a, b)
    assert out.shape == shape and out.dtype == np.dtype(dtype)
    want = (_f32(a) + _f32(b)).astype(dtype)  # fp32 add, one RNE rounding
    np.testing.assert_array_equal(out, want)


def test_tensor_add_torch_inputs_come_back_as_torch() -> None:
    a, b = torch.randn(130, 40), torch.randn(130, 40)
    out = tk.tensor_add(a, b)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, a + b, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(128, 16, 24), (7, 5, 3)])
def test_transpose2d(shape) -> None:
    x = _rand(shape, BF16)
    out = tk.transpose2d(x)
    np.testing.assert_array_equal(out, np.transpose(x, (0, 2, 1)))


@pytest.mark.parametrize("shape", [(256, 128), (200, 130)])
def test_transpose_matrix_tensor_engine(shape) -> None:
    x = _rand(shape)
    np.testing.assert_array_equal(tk.transpose_matrix(x), x.T)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_matmul_basic(dtype) -> None:
    lhsT, rhs = _rand((128, 64), dtype), _rand((128, 512), dtype)
    out = tk.matmul_basic(lhsT, rhs)
    want = _f32(lhsT).T.astype(np.float64) @ _f32(rhs)
    rtol = 1e-5 if dtype == np.float32 else 2**-7
    np.testing.assert_allclose(_f32(out), want, rtol=rtol, atol=rtol * 4)


@pytest.mark.parametrize("k,m,n", [(256, 256, 1024), (300, 130, 600), (1, 1, 1)])
def test_matmul_tiled(k, m, n) -> None:
    lhsT, rhs = _rand((k, m), BF16), _rand((k, n), BF16)
    with trace.record() as tr:
        out = tk.matmul_tiled(lhsT, rhs)
    want = _f32(lhsT).T.astype(np.float64) @ _f32(rhs).astype(np.float64)
    np.testing.assert_allclose(_f32(out), want, rtol=2**-7, atol=2**-7 * np.sqrt(k))
    ceil = lambda a, b: -(-a // b)  # noqa: E731
    assert tr.by_op()["nc_matmul"] == ceil(m, 128) * ceil(n, 512) * ceil(k, 128)


def _rmsnorm_ref(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * g.astype(np.float64)


@pytest.mark.parametrize("t,d", [(256, 512), (200, 96), (3, 8)])
def test_rmsnorm_fp32(t, d) -> None:
    x, g = _rand((t, d)), _rand((d,))
    out = tk.rmsnorm(x, g)
    np.testing.assert_allclose(out, _rmsnorm_ref(x, g, 1e-6), rtol=2e-5, atol=2e-6)


def test_rmsnorm_bf16_matches_torch_rms_norm() -> None:
    x, g = _rand((130, 256), BF16), _rand((256,), BF16)
    out = tk.rmsnorm(x, g, 1e-5)
    ref = torch.nn.functional.rms_norm(torch.from_numpy(_f32(x)), (256,), torch.from_numpy(_f32(g)),
                                       eps=1e-5)
    np.testing.assert_allclose(_f32(out), ref.numpy(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("t,c", [(256, 512), (129, 1000), (2, 8)])
def test_softmax(t, c) -> None:
    x = _rand((t, c), scale=4.0)
    out = tk.softmax(x)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=2e-6, atol=1e-7)


def test_softmax_bf16_rows_sum_to_one_and_instruction_mix() -> None:
    x = _rand((128, 256), BF16, scale=3.0)
    with trace.record() as tr:
        out = tk.softmax(x)
    ref = torch.softmax(torch.from_numpy(_f32(x)), -1).numpy()
    np.testing.assert_allclose(_f32(out), ref, rtol=2**-7, atol=1e-4)
    ops = tr.by_op()
    assert ops["tensor_reduce"] == ops["activation"] == ops["reciprocal"] == ops["tensor_scalar"] == 1
    assert tr.by_engine()["scalar"] == 1


@pytest.mark.parametrize("t,d,dtype", [(256, 1100, np.float32), (130, 96, BF16)])
def test_layernorm_matches_torch(t, d, dtype) -> None:
    x, g, b = _rand((t, d), dtype, 2.0) + 1, _rand((d,), dtype), _rand((d,), dtype)
    x = x.astype(dtype)
    out = tk.layernorm(x, g, b, 1e-5)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(_f32(x)).double(), (d,),
                                         torch.from_numpy(_f32(g)).double(),
                                         torch.from_numpy(_f32(b)).double(), eps=1e-5).numpy()
    rtol, atol = (2e-5, 2e-5) if dtype == np.float32 else (2**-7, 2e-2)
    np.testing.assert_allclose(_f32(out), ref, rtol=rtol, atol=atol)
