"""Tensor Engine instructions: ``nc_matmul`` and ``nc_transpose`` (NKI 0.6 semantics, trn2 limits).

``nc_matmul(dst, stationary, moving)``: ``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]``,
contracting over the partition dim of both inputs (``nki/api/nki/isa/__init__.py`` ``nc_matmul``;
``nki-facts.md`` section 2). Inputs in SBUF, dst fp32 in PSUM on trn2, K <= 128, M <= 128
(``gemm_stationary_fmax``), N <= 512 (``gemm_moving_fmax``, one PSUM bank of fp32). Arithmetic is
fp32 (products of bf16/fp8 inputs are exact in fp32; accumulation in fp32).
"""

from __future__ import annotations


import numpy as np

from .. import controlflow as _cf
from .. import dtypes as _dt
from .. import memory as _mem
from .. import trace
from ..errors import fail, require
from ..tensor import NkiTensor
from . import common
from .common import engine, matmul_perf_mode

__all__ = ["nc_matmul", "nc_transpose", "matmul_perf_mode"]

# Matmul input dtypes (nc_matmul docstring): fp8_e4m3 / fp8_e5m2 / bf16 / fp16 / tf32 / fp32.
# (float8_e4m3fn, OCP fp8, only from NeuronCore-v4 on.)
_MM_IN = frozenset({_dt.float8_e4m3, _dt.float8_e5m2, _dt.bfloat16, _dt.float16, _dt.float32})
_FP8 = frozenset({_dt.float8_e4m3, _dt.float8_e5m2})
_PE_TILE_SIZES = (32, 64, 128)  # row / column tiles of the 128x128 PE array (32 needs v3+)
_TRACE_ONLY_MIN_MACS = 128 * 128 * 128  # a trace-only launch skips the arithmetic from this size up

def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a.T @ b`` for fp32 ``a [K, M]``, ``b [K, N]``: the exact products summed in fp64, rounded once to fp32.

    An fp32 BLAS sums in an order that depends on the operand shapes (OpenBLAS picks its kernels by M and
    N; on some CPUs a column's value changes with N), so one tile's result would depend on how the
    kernel tiled its neighbours, and a split over LNC=2 programs would not be bit-identical to one
    program. fp32 x fp32 products are exact in fp64 and K <= 128 of them sum there with negligible
    error, so every element gets one value whatever the tile shape.
    """
    return (a.astype(np.float64).T @ b.astype(np.float64)).astype(np.float32)


def _psum_bank(op: str, dst: NkiTensor) -> int:
    """Bank (counted from the tile's start) that a TensorE write to PSUM view ``dst`` lies in; raise if
    its range in a partition crosses a bank boundary of a multi-bank tile (``memory.py`` module doc)."""
    st = dst.storage
    if st.buffer.name != "psum" or st.free_bytes <= _mem.PSUM_BANK_BYTES:
        return 0  # a tile of at most one bank lies inside one bank
    isz = dst.dtype.itemsize
    lo = hi = dst.resolve_offset(op) % dst.partition_stride  # elements into the partition
    for n, stride in zip(dst.shape[1:], dst.strides[1:]):
        if n == 0:
            return 0
        lo += min(0, (n - 1) * stride)
        hi += max(0, (n - 1) * stride)
    first, last = lo * isz, (hi + 1) * isz - 1
    bank = first // _mem.PSUM_BANK_BYTES
    if last // _mem.PSUM_BANK_BYTES != bank:
        fail(op, "dst {name!r} covers bytes {first}..{last} of each partition of its {nbytes}-byte PSUM "
             "tile, across the bank boundary at byte {boundary}: one TensorE write lies inside one "
             "{bank_bytes}-byte PSUM bank (trainium_inferentia2_arch.rst, PSUM accumulation: \"the first "
             "one writing to a PSUM bank and more subsequent instructions accumulating into the same PSUM "
             "bank\"; nl.tile_size.psum_bank_fmax: \"Maximum free dimension per PSUM bank per partition\", "
             "512 fp32)", name=dst.name, first=first, last=last, nbytes=st.free_bytes,
             boundary=(bank + 1) * _mem.PSUM_BANK_BYTES, bank_bytes=_mem.PSUM_BANK_BYTES)
    return bank


def nc_matmul(dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor,
              is_stationary_onezero: bool = False, is_moving_onezero: bool = False,
              is_transpose: bool = False, accumulate: bool | None = None,
              tile_position: tuple = (), tile_size: tuple = (),
              perf_mode: matmul_perf_mode | str = matmul_perf_mode.none,
              name: str | None = None) -> None:
    """``dst[M,N] = stationary[K,M].T @ moving[K,N]`` on the Tensor Engine, fp32 in PSUM.

    ``accumulate=None``: each PSUM element's first matmul write overwrites, later ones add (tracked
    per element since the allocation or since a non-matmul write); ``False``: overwrite; ``True``:
    add (warns when an element was not written by a matmul before: undefined on trn2).
    """
    op = "nc_matmul"
    common.check_on_chip(op, "dst", dst, common.PSUM)
    common.check_on_chip(op, "stationary", stationary, common.SBUF)
    common.check_on_chip(op, "moving", moving, common.SBUF)
    perf_mode = getattr(perf_mode, "value", perf_mode) or "none"
    if perf_mode != "none" and perf_mode != "double_row":
        fail(op, "perf_mode must be matmul_perf_mode.none or .double_row, got {perf_mode!r}",
             perf_mode=perf_mode)
    double = perf_mode == "double_row"
    # double_row: the contraction is split over the partitions and a first free dim of size 2
    # ([K, 2, M] x [K, 2, N] -> [M, N], 2K contracted elements)
    split = 2 if double else 1
    k, m = stationary.shape[0] * split, stationary.free_size // split
    k2, n = moving.shape[0] * split, moving.free_size // split
    if double:
        for role, t in (("stationary", stationary), ("moving", moving)):
            require(t.ndim >= 3 and t.shape[1] == 2, op, "perf_mode=double_row needs {role} shaped "
                    "[K, 2, ...], got {shape}", role=role, shape=t.shape)
            require(t.dtype in _FP8, op, "perf_mode=double_row needs fp8 (float8_e4m3 / float8_e5m2) "
                    "inputs, {role} is {dtype}", role=role, dtype=t.dtype)
        require(not tile_size or int(tile_size[1]) == 128, op, "perf_mode=double_row cannot be "
                "combined with column tiling (tile_size {tile_size})", tile_size=tile_size)
    rows, cols = _pe_tile(op, tile_position, tile_size)
    # the tile in tiling mode, for the cost model's PE blocks: (row start, column start, rows, columns)
    tile_attrs = ({"pe_tile": (int(tile_position[0]), int(tile_position[1]), rows, cols)}
                  if tile_position else {})
    rows *= split
    # (plain ifs: require()'s keyword values would be built on every call, ~0.3 us each)
    if k != k2:
        fail(op, "contraction (partition) sizes differ: stationary has {k_stationary} partitions, "
             "moving has {k_moving}", k_stationary=k, k_moving=k2)
    if k > rows:
        fail(op, "contraction size {k} exceeds the PE tile's {rows} rows", k=k, rows=rows)
    if m > 128:
        fail(op, "stationary free size {m} exceeds gemm_stationary_fmax (128)", m=m)
    if m > cols:
        fail(op, "stationary free size {m} exceeds the PE tile's {cols} columns", m=m, cols=cols)
    if n > 512:
        fail(op, "moving free size {n} exceeds gemm_moving_fmax (512)", n=n)
    if dst.shape[0] != m:
        fail(op, "dst partition dim {p} must equal the stationary free size {m}", p=dst.shape[0], m=m)
    if dst.free_size != n:
        fail(op, "dst free size {f} must equal the moving free size {n}", f=dst.free_size, n=n)
    common.check_dtype(op, "stationary", stationary, _MM_IN)
    common.check_dtype(op, "moving", moving, _MM_IN)
    f32 = _dt.float32
    if (stationary.dtype == f32) != (moving.dtype == f32):
        fail(op, "if one input is fp32/tf32 both must be: stationary {stationary_dtype}, moving "
             "{moving_dtype}", stationary_dtype=stationary.dtype.name, moving_dtype=moving.dtype.name)
    if accumulate is not None and accumulate is not True and accumulate is not False:
        fail(op, "accumulate must be None, True or False, got {accumulate!r}", accumulate=accumulate)
    bank = _psum_bank(op, dst)
    if is_transpose:
        require(not double, op, "is_transpose=True cannot use perf_mode=double_row")
        _transpose_mode(op, dst, stationary, moving, k, m)
        common.emit(op, common.TENSOR, dst=dst, srcs={"stationary": stationary, "moving": moving},
                    flops=2 * k * m * n, attrs={"M": m, "N": n, "K": k, "is_transpose": True,
                                                "dtype": _dt.dtype_name(stationary.dtype),
                                                "perf_mode": "none", "name": name, **tile_attrs})
        return
    if dst.dtype != f32:
        fail(op, "dst must be float32 in PSUM on trn2, got {dtype}", dtype=dst.dtype)

    flags = dst.matmul_flags()
    all_written = bool(flags.all())
    any_written = all_written or bool(flags.any())
    if accumulate is not False and not all_written:
        _check_accumulation_start(op, dst, flags, accumulate)
    # at most 8 outstanding accumulation groups: memory.py tracks them, checked at the kernel's end
    _mem.current().memory.matmul_write(dst.storage.alloc, starts=accumulate is False or not any_written, bank=bank)
    out = dst.np()
    tr = trace.active()
    if k * m * n >= _TRACE_ONLY_MIN_MACS and trace.trace_only():
        # A trace-only launch (memory.LaunchRules.trace_only) skips the arithmetic (shapes, checks and
        # bookkeeping still run). A fresh accumulation reads as zeros, not the allocation's NaN sentinel,
        # so values later derived from it (top-k indices used as DMA addresses) stay finite and in range.
        # The operands are still read (np() records the access), so on-chip liveness and the memory
        # check stay exact.
        stationary.np()
        moving.np()
        if accumulate is False or (accumulate is None and not any_written):
            out[...] = 0.0
    else:
        res = _dot(common.read_f32(stationary).reshape(k, m), common.read_f32(moving).reshape(k, n))
        res = res.reshape(out.shape)
        if accumulate is False or (accumulate is None and not any_written):
            out[...] = res
        elif accumulate is True or all_written:
            out += res
        else:  # accumulate=None over a partly written region: per element
            np.copyto(out, np.where(flags, out + res, res))
    flags[...] = True
    common.set_value_initialised(dst, False)
    if tr is None:
        return
    # "continue": this matmul adds onto an open accumulation group (the cost model streams those)
    group = "continue" if accumulate is True or (accumulate is None and any_written) else "start"
    common.emit(op, common.TENSOR, dst=dst, srcs={"stationary": stationary, "moving": moving},
                flops=2 * k * m * n,
                attrs={"M": m, "N": n, "K": k, "dtype": _dt.dtype_name(stationary.dtype),
                       "accumulate": accumulate, "acc_group": group,
                       "perf_mode": perf_mode, "name": name, **tile_attrs})


def _check_accumulation_start(op: str, dst: NkiTensor, flags: np.ndarray, accumulate: bool | None) -> None:
    """Undefined accumulation starts (``accumulate`` None or True onto PSUM elements that no matmul
    has written since their last other write), from the ``nc_matmul`` docstring (NKI 0.6):

    * "Using ``accumulate=True`` on an uninitialized PSUM location is undefined behavior on all
      targets";
    * "On NeuronCore-v2 and NeuronCore-v3, matmul accumulating into a PSUM location that was
      value-initialized by a non-matmul instruction (e.g., ``memset``, ``tensor_copy``) is not
      supported and is undefined behavior on hardware". With ``accumulate=True`` that is an error;
      with ``accumulate=None`` the compiler decides whether such a write starts or continues the
      accumulation, which is undefined unless both give the same sum: PSUM set to 0 (AWS's tested
      nki-library experimental/conv/depthwise_conv1d memsets its PSUM tile to 0 and accumulates onto
      it with accumulate=None, on trn2), so only non-zero values there are refused.

    Start an accumulation over such elements with ``accumulate=False``.
    """
    value_init = common.value_initialised(dst)
    mask = value_init & ~flags if value_init is not None else None
    if mask is not None and mask.any() and (accumulate is True or bool((dst.np()[mask] != 0).any())):
        _cf.undefined(op, "accumulate={acc} onto PSUM tile {name!r} whose elements hold {what} written "
                      "by a non-matmul instruction (memset, tensor_copy, ...): undefined on trn2 "
                      "(nc_matmul docs: \"matmul accumulating into a PSUM location that was "
                      "value-initialized by a non-matmul instruction ... is undefined behavior on "
                      "hardware\" on NeuronCore-v2/v3); start the accumulation with accumulate=False",
                      acc=accumulate, name=dst.name,
                      what="values" if accumulate is True else "non-zero values")
    elif accumulate is True and not (mask is not None and mask.any()):
        _cf.undefined(op, "accumulate=True onto PSUM tile {name!r} elements no matmul has written "
                      "(nc_matmul docs: \"Using accumulate=True on an uninitialized PSUM location is "
                      "undefined behavior on all targets\"); start the accumulation with "
                      "accumulate=False", name=dst.name)


def _pe_tile(op: str, tile_position: tuple, tile_size: tuple) -> tuple[int, int]:
    """(rows, columns) of the PE-array tile a matmul uses (row / column tiling mode)."""
    if not tile_position and not tile_size:
        return 128, 128
    require(len(tile_position) == 2 and len(tile_size) == 2, op, "tiling mode needs both "
            "tile_position=(start_row, start_column) and tile_size=(row_size, column_size), got "
            "{tile_position} and {tile_size}", tile_position=tile_position, tile_size=tile_size)
    for what, start, size in (("row", *map(int, (tile_position[0], tile_size[0]))),
                              ("column", *map(int, (tile_position[1], tile_size[1])))):
        require(size in _PE_TILE_SIZES, op, "tile_size {what} size {size} must be 32, 64 or 128",
                what=what, size=size)
        require(start % size == 0 and start + size <= 128, op, "tile_position start {what} {start} "
                "must be a multiple of the {what} size {size} inside the 128x128 array",
                what=what, start=start, size=size)
    return int(tile_size[0]), int(tile_size[1])


def _transpose_mode(op: str, dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor, k: int,
                    m: int) -> None:
    """``is_transpose=True``: stationary times an identity moving tile, bit-exact (v3+)."""
    require(moving.free_size == k, op, "is_transpose=True needs a square identity moving tile "
            "[{k}, {k}], got shape {shape}", k=k, shape=moving.shape)
    require(np.array_equal(moving.np().reshape(k, k), np.eye(k, dtype=moving.dtype)), op,
            "is_transpose=True needs the identity matrix as the moving tile")
    require(dst.dtype == stationary.dtype, op, "is_transpose=True: dst dtype {dst_dtype} must equal "
            "the stationary dtype {dtype}", dst_dtype=dst.dtype, dtype=stationary.dtype)
    common.store(dst, stationary.np().reshape(k, m).T.reshape(dst.shape))
    dst.matmul_flags()[...] = True
    common.set_value_initialised(dst, False)


def nc_transpose(dst: NkiTensor, data: NkiTensor, engine: engine = engine.unknown,
                 name: str | None = None) -> None:
    """Swap partition and free axes: ``dst[F, P] = data[P, F]`` (free dims flattened).

    Tensor Engine: SBUF -> PSUM, up to 128 x 128. Vector Engine: SBUF/PSUM -> SBUF/PSUM, up to
    32 x 32. ``engine=unknown`` picks the Tensor Engine when dst is in PSUM and data in SBUF, else the
    Vector Engine. dst dtype must equal data dtype.
    """
    op = "nc_transpose"
    common.check_tensor(op, "dst", dst)
    common.check_tensor(op, "data", data)
    if engine is common.engine.unknown:
        use_tensor = dst.buffer.name == "psum" and data.buffer.name == "sbuf"
    else:
        require(engine in (common.engine.tensor, common.engine.vector), op, "engine must be tensor "
                "or vector, got {engine}", engine=engine)
        use_tensor = engine is common.engine.tensor
    p, f = data.shape[0], data.free_size
    if use_tensor:
        common.check_on_chip(op, "data", data, common.SBUF)
        common.check_on_chip(op, "dst", dst, common.PSUM)
        require(p <= 128 and f <= 128, op, "Tensor Engine transpose supports up to 128x128, data is "
                "{p}x{f}", p=p, f=f)
        _psum_bank(op, dst)
    else:
        common.check_on_chip(op, "data", data)
        common.check_on_chip(op, "dst", dst)
        require(p <= 32 and f <= 32, op, "Vector Engine transpose supports up to 32x32, data is "
                "{p}x{f}", p=p, f=f)
    require(dst.shape[0] == f and dst.free_size == p, op, "dst must be [{f}, {p}] for data [{p}, "
            "{f}], got shape {shape}", f=f, p=p, shape=dst.shape)
    # NKI ISA reference, nki.isa.nc_transpose, "Data types": "The output dst tile must have the same data type
    # as that of data." (no cast on either engine, unlike nc_matmul's PSUM output)
    require(dst.dtype == data.dtype, op, "dst dtype {dst_dtype} must equal data dtype {data_dtype}",
            dst_dtype=dst.dtype, data_dtype=data.dtype)
    res = data.np().reshape(p, f).T
    common.store(dst, res.reshape(dst.shape))
    if use_tensor:  # a TensorE transpose is a matmul (is_transpose), not a value initialisation
        common.set_value_initialised(dst, False)
    common.emit(op, common.TENSOR if use_tensor else common.VECTOR, dst=dst, srcs={"data": data},
                flops=2 * p * p * f if use_tensor else 0, attrs={"P": p, "F": f, "name": name})
