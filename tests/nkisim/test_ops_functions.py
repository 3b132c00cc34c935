"""The nl.* operator / activation objects against independent references (torch, numpy, hand values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trnkit.nkisim import ops

RNG = np.random.default_rng(42)
X = RNG.uniform(-6, 6, size=4096).astype(np.float32)
XPOS = RNG.uniform(0.01, 50, size=4096).astype(np.float32)


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x.astype(np.float64))


# activation name -> (input, independent fp64 torch reference)
ACT_REFS = {
    "copy": (X, lambda t: t),
    "square": (X, lambda t: t * t),
    "sigmoid": (X, torch.sigmoid),
    "relu": (X, torch.relu),
    "gelu": (X, lambda t: F.gelu(t)),
    "gelu_dx": (X, lambda t: torch.autograd.functional.jacobian(
        lambda u: F.gelu(u).sum(), t)),
    "gelu_apprx_tanh": (X, lambda t: F.gelu(t, approximate="tanh")),
    "gelu_apprx_sigmoid": (X, lambda t: t * torch.sigmoid(1.702 * t)),
    "gelu_apprx_sigmoid_dx": (X, lambda t: torch.autograd.functional.jacobian(
        lambda u: (u * torch.sigmoid(1.702 * u)).sum(), t)),
    "silu": (X, F.silu),
    "silu_dx": (X, lambda t: torch.autograd.functional.jacobian(lambda u: F.silu(u).sum(), t)),
    "tanh": (X, torch.tanh),
    "softplus": (X, F.softplus),
    "mish": (X, F.mish),
    "erf": (X, torch.erf),
    "erf_dx": (X, lambda t: torch.autograd.functional.jacobian(lambda u: torch.erf(u).sum(), t)),
    "exp": (X, torch.exp),
    "log": (XPOS, torch.log),
    "sin": (X, torch.sin),
    "cos": (X, torch.cos),
    "arctan": (X, torch.atan),
    "sqrt": (XPOS, torch.sqrt),
    "rsqrt": (XPOS, torch.rsqrt),
    "reciprocal": (XPOS, torch.reciprocal),
    "sign": (X, torch.sign),
    "abs": (X, torch.abs),
}


def test_every_activation_has_a_reference() -> None:
    assert set(ACT_REFS) == set(ops.ACTIVATION_OPS)


@pytest.mark.parametrize("name", sorted(ACT_REFS))
def test_activation_matches_torch_fp64(name: str) -> None:
    x, ref = ACT_REFS[name]
    op = ops.ACTIVATION_OPS[name]
    got = op(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    want = ref(_t(x).requires_grad_(name.endswith("_dx"))).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_activation_hand_values() -> None:
    assert ops.gelu(np.float32(0.0)) == 0.0
    assert ops.silu_dx(np.float32(0.0)) == pytest.approx(0.5)
    assert ops.sigmoid(np.float32(-200.0)) == 0.0  # no overflow warning / nan for large |x|
    assert ops.sigmoid(np.float32(200.0)) == 1.0
    assert ops.softplus(np.float32(100.0)) == pytest.approx(100.0)
    assert np.isinf(ops.rsqrt(np.float32(0.0)))


BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power,
    "equal": np.equal, "not_equal": np.not_equal, "greater": np.greater,
    "greater_equal": np.greater_equal, "less": np.less, "less_equal": np.less_equal,
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor,
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)),
    "abs_min": lambda a, b: np.minimum(np.abs(a), np.abs(b)),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_arithmetic_in_fp32(name: str) -> None:
    a = RNG.integers(-4, 5, size=512).astype(np.float32)  # small ints: many equal pairs and zeros
    b = RNG.integers(-4, 5, size=512).astype(np.float32)
    if name == "power":
        a = np.abs(a) + 0.5
    op = ops.ALU_OPS[name]
    got = op(a, b)
    with np.errstate(all="ignore"):
        want = np.asarray(BINARY[name](a, b), dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_comparisons_and_logicals_return_one_zero() -> None:
    assert ops.greater(np.float32(2), np.float32(1)) == 1.0
    assert ops.logical_and(np.float32(0.5), np.float32(-3)) == 1.0
    assert ops.logical_xor(np.float32(0.5), np.float32(-3)) == 0.0
    assert ops.logical_not(np.float32(0.0)) == 1.0


def test_bitvec_ops_on_raw_bits() -> None:
    a = np.array([0x0F0F, -1, 5, -8], dtype=np.int32)
    b = np.array([0x00FF, 0x1234, 3, 1], dtype=np.int32)
    np.testing.assert_array_equal(ops.bitwise_and(a, b), [0x000F, 0x1234, 1, 0])
    np.testing.assert_array_equal(ops.bitwise_or(a, b), [0x0FFF, -1, 7, -7])
    np.testing.assert_array_equal(ops.bitwise_xor(a, b), [0x0FF0, ~0x1234, 6, -7])
    np.testing.assert_array_equal(ops.invert(np.array([0, 255], dtype=np.uint8)), [255, 0])
    # logical right shift: -8 (0xFFFFFFF8) >> 1 = 0x7FFFFFFC
    np.testing.assert_array_equal(ops.right_shift(np.array([-8], np.int32), np.array([1])), [0x7FFFFFFC])
    np.testing.assert_array_equal(ops.right_shift(np.array([0xF0], np.uint8), np.array([4])), [0x0F])
    # left shift drops the bits pushed out of the type's width
    np.testing.assert_array_equal(ops.left_shift(np.array([0x81], np.uint8), np.array([1])), [0x02])
    np.testing.assert_array_equal(ops.left_shift(np.array([1], np.int32), np.array([31])), [-(2**31)])
    np.testing.assert_array_equal(ops.left_shift(np.array([1], np.int32), np.array([32])), [0])


@pytest.mark.parametrize("name,ufunc", [("add", np.add), ("multiply", np.multiply),
                                        ("maximum", np.max), ("minimum", np.min),
                                        ("subtract", np.subtract)])
def test_reductions(name: str, ufunc) -> None:
    x = RNG.uniform(-2, 2, size=(4, 3, 5)).astype(np.float32)
    got = ops.ALL_OPS[name].reduce(x, axis=(2,))
    want = (ufunc.reduce(x, axis=2) if isinstance(ufunc, np.ufunc) else ufunc(x, axis=2))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    kd = ops.ALL_OPS[name].reduce(x, axis=(1, 2), keepdims=True)
    assert kd.shape == (4, 1, 1)


def test_logical_and_bitvec_reductions() -> None:
    x = np.array([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]], dtype=np.float32)
    np.testing.assert_array_equal(ops.logical_and.reduce(x, axis=(1,)), [0.0, 1.0])
    np.testing.assert_array_equal(ops.logical_or.reduce(x * 0, axis=(1,)), [0.0, 0.0])
    b = np.array([[0b1100, 0b1010, 0b1000]], dtype=np.int32)
    np.testing.assert_array_equal(ops.bitwise_and.reduce(b, axis=(1,)), [0b1000])
    np.testing.assert_array_equal(ops.bitwise_or.reduce(b, axis=(1,)), [0b1110])
    with pytest.raises(ValueError, match="equal is not a legal reduction"):
        ops.equal.reduce(x, axis=(1,))


def test_families_follow_the_docs_tables() -> None:
    # ALU table of nki.api.shared.rst
    for n in ["invert", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"]:
        assert ops.ALL_OPS[n].is_bitvec and ops.ALL_OPS[n].alu
    for n in ["add", "subtract", "multiply", "maximum", "minimum", "equal", "rsqrt", "reciprocal",
              "abs", "power", "logical_xor"]:
        assert ops.ALL_OPS[n].alu and not ops.ALL_OPS[n].is_bitvec
    assert not ops.exp.alu and ops.exp.activation
    assert ops.rsqrt.activation and ops.rsqrt.alu
    assert {n for n, o in ops.ALL_OPS.items() if o.reducible} == {
        "bitwise_and", "bitwise_or", "bitwise_xor", "add", "subtract", "multiply", "maximum",
        "minimum", "logical_and", "logical_or", "logical_xor"}


def test_resolve_numpy_aliases_and_errors() -> None:
    assert ops.resolve(np.add) is ops.add
    assert ops.resolve(np.exp) is ops.exp
    assert ops.resolve(ops.silu) is ops.silu
    assert ops.resolve(None) is None
    with pytest.raises(TypeError, match="tensor_tensor.op: .* is not an nki.language operator"):
        ops.resolve(len, "tensor_tensor.op")
    with pytest.raises(TypeError, match="nl.add: takes 2 operand"):
        ops.add(np.float32(1))
    assert repr(ops.add) == "nl.add" and ops.add.name == "add"


def test_wired_into_nki_language_and_isa() -> None:
    from trnkit.nki_api import REAL_NKI, nisa, nl
    from trnkit.nkisim.isa import gpsimd, scalar, vector

    if REAL_NKI:
        pytest.skip("the real nki is installed")
    for name, op in ops.ALL_OPS.items():
        assert getattr(nl, name) is op
    for mod in (vector, scalar, gpsimd):
        for name in mod.__all__:  # each instruction wrapped as one liveness step (memory.py) and one
            wrapped = getattr(nisa, name)  # step of its program's control-flow record (controlflow.py)
            assert wrapped.__wrapped__.__wrapped__ is getattr(mod, name)
