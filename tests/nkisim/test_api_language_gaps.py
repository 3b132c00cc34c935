"""nki / nl / nisa names AWS kernels use: nl.bool, nl.dynamic_range, nl.broadcast_to, nki.dtype,
nki.isa.constants, the x4 packed MX dtypes, nc_version ordering, NKIObject with keyword args."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import trnkit.nkisim as nki
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim.errors import NkiValidationError

RNG = np.random.default_rng(3)


def test_bool_and_dtype_type() -> None:
    assert nl.bool == nl.bool_ == np.dtype(np.bool_)
    assert isinstance(nl.bfloat16, nki.dtype) and isinstance(nl.float8_e4m3fn_x4, nki.dtype)

    def annotated(compute_dtype: nki.dtype = nl.bfloat16) -> Any:  # evaluated at def time
        return compute_dtype

    assert annotated() == nl.bfloat16


def test_nki_dtype_imports_as_a_module_of_the_dtypes() -> None:
    """``import nki.dtype as nt`` (nki-library's qkv test helpers) gives nl's dtype objects."""
    import importlib

    with nki.nki_installed():
        nt = importlib.import_module("nki.dtype")
        assert nt is nki.dtype and importlib.import_module("neuronxcc.nki.dtype") is nt
    assert nt.float8_e4m3 is nl.float8_e4m3 and nt.bfloat16 is nl.bfloat16 and nt.bool == nl.bool
    scaled = (np.array([1.0, 300.0, -0.3]) / 1.25).astype(nt.float8_e4m3)  # as the test casts weights
    assert scaled.dtype == nl.float8_e4m3 and float(scaled[1]) == 240.0  # fp8 e4m3's largest finite value
    with pytest.raises(AttributeError):
        nt.float64  # not an NKI dtype


def test_isa_constants_module_is_the_same_enums() -> None:
    from trnkit.nkisim.isa import constants
    from trnkit.nkisim.isa.constants import dge_mode, oob_mode

    assert constants is nisa.constants
    assert oob_mode is nisa.oob_mode and dge_mode.hwdge is nisa.dge_mode.hwdge


def test_nc_version_ordering() -> None:
    v = nisa.get_nc_version()
    assert v is nisa.nc_version.gen3
    assert v >= nisa.nc_version.gen3 and v > nisa.nc_version.gen2 and v < nisa.nc_version.gen4
    assert v <= nisa.nc_version.gen3 and not v <= nisa.nc_version.gen2
    assert v >= 3 and not v >= 4  # experimental/collectives/fgcc.py compares with the number
    assert sorted([nisa.nc_version.gen4, nisa.nc_version.gen2]) == [nisa.nc_version.gen2,
                                                                     nisa.nc_version.gen4]
    with pytest.raises(TypeError):
        _ = v < "gen4"


class SkipMode(nl.NKIObject):  # shapes of nki-library's moe_cte_utils.py / attention_cte.py classes
    skip_token: bool = False
    skip_weight: bool = False


class Configs(nl.NKIObject):
    compute_dtype: Any
    skip_dma: SkipMode
    checkpoint_activation: bool = False


@dataclasses.dataclass
class SectionParams(nl.NKIObject):
    section_idx = None
    section_offset = None


@dataclasses.dataclass
class Tile(nl.NKIObject):
    rows: int
    cols: int = 128


def test_nkiobject_keyword_construction_and_dataclasses() -> None:
    cfg = Configs(compute_dtype=nl.bfloat16, skip_dma=SkipMode(skip_token=True))
    assert cfg.compute_dtype == nl.bfloat16 and cfg.skip_dma.skip_token is True
    assert cfg.skip_dma.skip_weight is False and cfg.checkpoint_activation is False  # class defaults
    sp = SectionParams()
    assert sp.section_idx is None
    sp.section_idx = 3
    assert sp.section_idx == 3
    t = Tile(rows=4)
    assert (t.rows, t.cols) == (4, 128) and t == Tile(4, 128)
    with pytest.raises(TypeError):
        Configs(nl.bfloat16)  # keyword arguments only, as the documented __init__(**kwargs)


@nki.jit
def _dynamic_sum(x, n):
    """Add the rows of x[0:n] (n read into a register at run time) with nl.dynamic_range."""
    acc = nl.ndarray((1, x.shape[1]), nl.float32, buffer=nl.sbuf)
    nisa.memset(acc, 0.0)
    n_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n_sb, src=n)
    reg = nisa.register_alloc()
    nisa.register_load(reg, n_sb)
    row = nl.ndarray((1, x.shape[1]), nl.float32, buffer=nl.sbuf)
    for i in nl.dynamic_range(0, reg):
        nisa.dma_copy(dst=row, src=x.ap([[x.shape[1], 1], [1, x.shape[1]]], offset=0,
                                        scalar_offset=i, indirect_dim=0))
        nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)
    out = nl.ndarray((1, x.shape[1]), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


def test_dynamic_range_with_register_bound() -> None:
    x = RNG.standard_normal((6, 16)).astype(np.float32)
    got = _dynamic_sum(x, np.array([[4]], np.int32))
    np.testing.assert_allclose(got, x[:4].sum(axis=0, keepdims=True), rtol=1e-6)


def test_dynamic_range_rules() -> None:
    assert [r.value for r in nl.dynamic_range(2, 8, 3)] == [2, 5]
    assert [r.value for r in nl.dynamic_range(3)] == [0, 1, 2]
    with pytest.raises(NkiValidationError, match="step must be a compile-time positive int"):
        list(nl.dynamic_range(0, 4, nisa.register_alloc(1)))
    with pytest.raises(NkiValidationError, match="no compile-time value"):
        for i in nl.dynamic_range(2):
            _ = i + 1  # the loop variable is a runtime register


@nki.jit
def _broadcast(x, shape):
    t = nl.load(x)
    b = nl.broadcast_to(t, shape=shape, dtype=nl.float32)
    out = nl.ndarray(shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, b)
    return out


@pytest.mark.parametrize("src,shape", [((1, 8), (128, 8)), ((1, 1), (70, 5)), ((16, 1, 4), (16, 3, 4)),
                                       ((1, 2, 1), (40, 2, 6))])
def test_broadcast_to_matches_numpy(src, shape) -> None:
    x = RNG.standard_normal(src).astype(np.float32)
    np.testing.assert_array_equal(_broadcast(x, shape), np.broadcast_to(x, shape))


def test_broadcast_to_same_shape_is_identity_and_rules() -> None:
    t = nl.ndarray((4, 8), nl.bfloat16)
    assert nl.broadcast_to(t, (4, 8)) is t
    with pytest.raises(NkiValidationError, match="must have the rank of x"):
        nl.broadcast_to(t, (4, 8, 1))
    with pytest.raises(NkiValidationError, match="dim 1 of x has size 8, cannot broadcast to 16"):
        nl.broadcast_to(t, (4, 16))


@pytest.mark.parametrize("name,nbytes", [("float8_e4m3fn_x4", 4), ("float8_e5m2_x4", 4),
                                         ("float4_e2m1fn_x4", 2)])
def test_packed_x4_dtypes_allocate_move_and_refuse_arithmetic(name: str, nbytes: int) -> None:
    dt = getattr(nl, name)
    assert dt.itemsize == nbytes and str(dt) == str(getattr(nl, name))
    assert len({nl.float8_e4m3fn_x4, nl.float8_e5m2_x4, nl.float4_e2m1fn_x4}) == 3
    raw = RNG.integers(0, 2**16, size=(8, 6)).astype(np.uint16).view(np.uint8)
    hbm = raw.view(dt).reshape(8, -1)

    @nki.jit
    def roundtrip(src):
        t = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src)
        out = nl.ndarray(src.shape, src.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    got = roundtrip(hbm)
    np.testing.assert_array_equal(got.view(np.uint8), hbm.view(np.uint8))
    t = nl.ndarray((4, 2), dt)
    with pytest.raises(NkiValidationError, match="4x packed MX dtypes are only moved"):
        nisa.tensor_copy(dst=nl.ndarray((4, 2), nl.float32), src=t)
