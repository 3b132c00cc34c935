"""Every engine rule of the Vector/Scalar/GpSimd instructions, as a negative test on its message."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit.nkisim import ops as nl
from trnkit.nkisim.errors import NkiValidationError
from trnkit.nkisim.isa import gpsimd, scalar, vector
from trnkit.nkisim.isa.common import engine, reduce_cmd
from trnkit.nkisim.tensor import NkiTensor, Storage, allocate, hbm

from ._tiles import BF16, F32, empty, psum, sbuf, tile

RNG = np.random.default_rng(11)


def _raises(match: str):
    return pytest.raises(NkiValidationError, match=match)


def f32(*shape, buffer=sbuf):
    t = empty(shape, F32, buffer)
    t.np()[...] = 1.0
    return t


def test_operands_must_be_on_chip() -> None:
    h = allocate((8, 8), F32, hbm)
    with _raises(r"tensor_tensor: data1 must be in sbuf/psum, got hbm"):
        vector.tensor_tensor(f32(8, 8), h, f32(8, 8), op=nl.add)
    with _raises(r"activation: data must be in sbuf/psum, got hbm"):
        scalar.activation(f32(8, 8), nl.exp, h)
    with _raises(r"tensor_copy: src must be an NkiTensor, got ndarray"):
        vector.tensor_copy(f32(8, 8), np.ones((8, 8), np.float32))


def test_partition_limit_and_start_alignment() -> None:
    big = allocate((256, 4), F32, hbm)  # HBM may be taller; an on-chip view of it cannot exist
    with _raises(r"tensor_copy: src must be in sbuf/psum"):
        vector.tensor_copy(f32(128, 4), big)
    t = f32(128, 8)
    with _raises(r"tensor_tensor: dst starts at partition 16 with 64 partitions; allowed starts .*\(0, 64\)"):
        vector.tensor_tensor(t[16:80], t[0:64], t[64:128], op=nl.add)


def test_same_partitions_and_elements_per_partition() -> None:
    with _raises(r"tensor_tensor: data2 has 64 partitions but data1 has 128"):
        vector.tensor_tensor(f32(128, 8), f32(128, 8), f32(64, 8), op=nl.add)
    with _raises(r"tensor_tensor: dst has 16 elements per partition but data1 has 8"):
        vector.tensor_tensor(f32(128, 16), f32(128, 8), f32(128, 2, 4), op=nl.add)
    with _raises(r"activation: dst has 4 elements per partition but data has 8"):
        scalar.activation(f32(8, 4), nl.exp, f32(8, 8))
    with _raises(r"tensor_copy: dst has 2 partitions but src has 4"):
        vector.tensor_copy(f32(2, 8), f32(4, 4))


def test_tensor_tensor_inputs_not_both_in_psum() -> None:
    with _raises(r"tensor_tensor: data1 and data2 cannot both be in PSUM"):
        vector.tensor_tensor(f32(8, 8), f32(8, 8, buffer=psum), f32(8, 8, buffer=psum), op=nl.add)
    with _raises(r"scalar_tensor_tensor: data and operand1 cannot both be in PSUM"):
        vector.scalar_tensor_tensor(f32(8, 8), f32(8, 8, buffer=psum), nl.add, 1.0, nl.add,
                                    f32(8, 8, buffer=psum))


def test_gpsimd_cannot_access_psum() -> None:
    with _raises(r"tensor_copy: GpSimd engine cannot access PSUM \(src is in PSUM\)"):
        vector.tensor_copy(f32(8, 8), f32(8, 8, buffer=psum), engine=engine.gpsimd)
    with _raises(r"tensor_tensor: GpSimd engine cannot access PSUM \(dst is in PSUM\)"):
        vector.tensor_tensor(f32(8, 8, buffer=psum), f32(8, 8), f32(8, 8), op=nl.power)
    with _raises(r"memset: GpSimd engine cannot access PSUM"):
        vector.memset(f32(8, 8, buffer=psum), 0.0, engine=engine.gpsimd)


def test_iota_and_affine_select_sbuf_only() -> None:
    with _raises(r"iota: dst must be in sbuf, got psum"):
        gpsimd.iota(empty((8, 8), np.int32, psum), [[1, 8]])
    with _raises(r"affine_select: on_true_tile must be in sbuf, got psum"):
        gpsimd.affine_select(f32(8, 8), [[1, 8]], 1, f32(8, 8, buffer=psum), 0.0)


def test_iota_pattern_rules() -> None:
    with _raises(r"iota: pattern covers 6 elements but dst has 8 elements per partition"):
        gpsimd.iota(empty((4, 8), np.int32), [[1, 2], [2, 3]])
    with _raises(r"iota: pattern must be a list of 1 to 4 \[step, num\] pairs"):
        gpsimd.iota(empty((4, 32), np.int32), [[1, 2]] * 5)
    with _raises(r"affine_select: cmp_op must be a comparison operator, got nl.add"):
        gpsimd.affine_select(f32(4, 8), [[1, 8]], 0, f32(4, 8), 0.0, cmp_op=nl.add)


def test_free_size_limits_of_vector_and_scalar_engines() -> None:
    big = empty((2, 65537), BF16)  # (a PSUM tile cannot get near its 4K limit: one 2 KiB bank each)
    with _raises(r"tensor_copy: dst accesses 65537 elements per partition, over the vector engine "
                 r"limit of 65536 for sbuf"):
        vector.tensor_copy(big, big)
    with _raises(r"activation: dst accesses 65537 elements per partition, over the scalar engine limit"):
        scalar.activation(big, nl.exp, big)
    small = empty((2, 8), BF16)
    vector.tensor_copy(big[:, :8], small)  # views within the limit are fine


def test_psum_free_size_limit_counts_accessed_elements_not_broadcast_repeats() -> None:
    # layernorm_tkg (nki-library, AWS-tested) at [128, 5, 3072]: a [128, 5] PSUM mean broadcast over
    # 3072 columns is 15360 streamed elements but 5 accessed ones; accepted.
    mean = tile(RNG.standard_normal((128, 5)).astype(np.float32), buffer=psum)
    x = RNG.standard_normal((128, 5, 3072)).astype(np.float32)
    out = empty((128, 5, 3072), np.float32)
    vector.tensor_tensor(out, tile(x), mean.expand_dim(2).broadcast(2, 3072), nl.subtract)
    np.testing.assert_array_equal(out.np(), x - mean.np()[:, :, None])
    # A PSUM operand really accessing more than 4K elements per partition is rejected. (No PSUM
    # allocation reaches 4097 fp32, 16 KiB at most, so the view is bound to raw storage here.)
    st = Storage(np.zeros(2 * 4097, np.float32), (2, 4097), psum, "wide_psum")
    wide = NkiTensor((2, 4097), np.float32, storage=st)
    with _raises(r"tensor_copy: src accesses 4097 elements per partition, over the vector engine "
                 r"limit of 4096 for psum"):
        vector.tensor_copy(empty((2, 4097), np.float32), wide)


def test_bitvec_ops_need_integer_dtypes() -> None:
    with _raises(r"tensor_tensor: bitvec operator nl.bitwise_and needs integer dtypes, but dst is float32"):
        vector.tensor_tensor(f32(4, 4), empty((4, 4), np.int32), empty((4, 4), np.int32),
                             op=nl.bitwise_and)
    with _raises(r"tensor_scalar: op0 \(nl.bitwise_and\) and op1 \(nl.add\) must both be bitvec or both"):
        vector.tensor_scalar(empty((4, 4), np.int32), empty((4, 4), np.int32), nl.bitwise_and, 1,
                             op1=nl.add, operand1=1)
    with _raises(r"tensor_reduce: negate is only applicable to arithmetic operators"):
        vector.tensor_reduce(empty((4, 1), np.int32), nl.bitwise_or, empty((4, 4), np.int32), axis=1,
                             negate=True)


def test_operator_kind_rules() -> None:
    with _raises(r"tensor_tensor: op=nl.exp is not an ALU operator"):
        vector.tensor_tensor(f32(4, 4), f32(4, 4), f32(4, 4), op=nl.exp)
    with _raises(r"tensor_tensor: op=nl.abs must be a binary operator"):
        vector.tensor_tensor(f32(4, 4), f32(4, 4), f32(4, 4), op=nl.abs)
    with _raises(r"activation: op=nl.add is not an activation function"):
        scalar.activation(f32(4, 4), nl.add, f32(4, 4))
    with _raises(r"tensor_reduce: op=nl.equal is not a legal reduction operator"):
        vector.tensor_reduce(f32(4, 1), nl.equal, f32(4, 4), axis=1)
    with _raises(r"tensor_scalar: operand of unary operator nl.rsqrt must be None or 0, got 2.0"):
        vector.tensor_scalar(f32(4, 4), f32(4, 4), nl.rsqrt, 2.0)
    with _raises(r"tensor_scalar: operand1 must be None when op1 is None"):
        vector.tensor_scalar(f32(4, 4), f32(4, 4), nl.add, 1.0, operand1=2.0)


def test_tensor_scalar_operand_and_engine_rules() -> None:
    with _raises(r"tensor_scalar: operand0 must have shape \(8, 1\), got \(8, 2\)"):
        vector.tensor_scalar(f32(8, 4), f32(8, 4), nl.add, f32(8, 2))
    with _raises(r"tensor_scalar: operand0 tile must be float32, got bfloat16"):
        vector.tensor_scalar(f32(8, 4), f32(8, 4), nl.add, empty((8, 1), BF16))
    with _raises(r"Scalar engine supports only \(multiply, add\), \(multiply, None\), \(add, None\); got "
                 r"\('subtract', None\)"):
        vector.tensor_scalar(f32(8, 4), f32(8, 4), nl.subtract, 1.0, engine=engine.scalar)
    with _raises(r"tensor_scalar: engine=gpsimd is only allowed for rsqrt"):
        vector.tensor_scalar(f32(8, 4), f32(8, 4), nl.add, 1.0, engine=engine.gpsimd)
    with _raises(r"tensor_tensor: engine must be one of unknown/vector/gpsimd, got scalar"):
        vector.tensor_tensor(f32(4, 4), f32(4, 4), f32(4, 4), op=nl.add, engine=engine.scalar)


def test_tensor_reduce_axis_rules() -> None:
    x = f32(8, 2, 3, 4)
    with _raises(r"tensor_reduce: axis 0 \(the partition dim\) cannot be reduced"):
        vector.tensor_reduce(f32(8, 1), nl.add, f32(8, 4), axis=(0, 1))
    with _raises(r"tensor_reduce: axis \(1, 2\) must be the last contiguous free dims ending at dim 3"):
        vector.tensor_reduce(f32(8, 4), nl.add, x, axis=(1, 2))
    with _raises(r"tensor_reduce: dst has 4 elements per partition, but reducing axis 3 of \(8, 2, 3, 4\) "
                 r"leaves 6"):
        vector.tensor_reduce(f32(8, 4), nl.add, x, axis=3)
    with _raises(r"tensor_reduce: axis 5 is out of range for a 4-D tile"):
        vector.tensor_reduce(f32(8, 6), nl.add, x, axis=5)


def test_activation_rules() -> None:
    with _raises(r"activation: bias must have shape \(8, 1\), got \(8, 4\)"):
        scalar.activation(f32(8, 4), nl.exp, f32(8, 4), bias=f32(8, 4))
    with _raises(r"activation: scale tile must be float32, got bfloat16"):
        scalar.activation(f32(8, 4), nl.exp, f32(8, 4), scale=empty((8, 1), BF16))
    with _raises(r"activation: reduce_op must be nl.add, got nl.maximum"):
        scalar.activation(f32(8, 4), nl.exp, f32(8, 4), reduce_op=nl.maximum,
                          reduce_cmd=reduce_cmd.reset_reduce)
    with _raises(r"activation: reduce_cmd=reset_reduce needs reduce_op=nl.add"):
        scalar.activation(f32(8, 4), nl.exp, f32(8, 4), reduce_cmd=reduce_cmd.reset_reduce)
    with _raises(r"activation: reduce_res must have shape \(8, 1\), got \(4, 1\)"):
        scalar.activation(f32(8, 4), nl.exp, f32(8, 4), reduce_op=nl.add, reduce_res=f32(4, 1),
                          reduce_cmd=reduce_cmd.reset_reduce)
    for op in (nl.maximum, nl.minimum, nl.multiply):  # the registers only sum (NKI docs, activation_reduce)
        with _raises(rf"activation_reduce: reduce_op must be nl.add .*NKI docs.*got nl.{op.name}"):
            scalar.activation_reduce(f32(8, 4), nl.exp, f32(8, 4), op, f32(8, 1))


def test_topk_rules() -> None:
    with _raises(r"max8: src has 7 elements per partition, must be between 8 and 16384"):
        vector.max8(f32(4, 8), f32(4, 7))
    with _raises(r"max8: src has 16385 elements per partition, must be between 8 and 16384"):
        vector.max8(f32(1, 8), f32(1, 16385))
    with _raises(r"max8: src must be at most 3-D, got shape \(4, 2, 2, 4\)"):
        vector.max8(f32(4, 8), f32(4, 2, 2, 4))
    with _raises(r"max8: dst must have shape \(4, 8\), got \(4, 16\)"):
        vector.max8(f32(4, 16), f32(4, 32))
    with _raises(r"nc_find_index8: dst must be uint32 or uint16, got int32"):
        vector.nc_find_index8(empty((4, 8), np.int32), f32(4, 32), f32(4, 8))
    with _raises(r"nc_find_index8: vals must hold 8 elements on each of 4 partitions, got shape \(4, 4\)"):
        vector.nc_find_index8(empty((4, 8), np.uint32), f32(4, 32), f32(4, 4))
    with _raises(r"nc_match_replace8: dst has 16 elements per partition but data has 32"):
        vector.nc_match_replace8(f32(4, 16), f32(4, 32), f32(4, 8), imm=0.0)


def test_memset_value_must_match_dtype() -> None:
    with _raises(r"memset: value 1.5 \(float\) does not match integer dst dtype int32: pass an integer "
                 r"literal \(NKI 0.3.0 migration guide"):
        vector.memset(empty((4, 4), np.int32), 1.5)
    with _raises(r"memset: value 2.0 \(float\) does not match integer dst dtype int32"):
        vector.memset(empty((4, 4), np.int32), 2.0)  # integral, but a float literal (NKI 0.3.0+)
    t = empty((4, 4), np.int32)
    vector.memset(t, 2)  # the AWS form (nki-library bwmm_shard_on_I: memset(block_idx, value=N))
    np.testing.assert_array_equal(t.np(), 2)
    f = f32(4, 4)
    vector.memset(f, 0)  # an integer literal into a float tile (nki-library's memset(..., 0))
    np.testing.assert_array_equal(f.np(), 0.0)
    u = empty((4, 4), np.uint32)
    vector.memset(u, 0.0)  # +0.0 has the integer 0's bits (nki-library router_topk: uint32, value=0.0)
    np.testing.assert_array_equal(u.np(), 0)
    with _raises(r"memset: value -0.0 \(float\) does not match integer dst dtype uint32"):
        vector.memset(u, -0.0)
    with _raises(r"memset: value 300 is out of range for uint8"):
        vector.memset(empty((4, 4), np.uint8), 300)
    with _raises(r"memset: value must be a compile-time scalar, got NkiTensor"):
        vector.memset(f32(4, 4), f32(1, 1))


def test_predicated_copy_rules() -> None:
    with _raises(r"tensor_copy_predicated: predicate must be uint8, uint16 or uint32, got float32"):
        vector.tensor_copy_predicated(f32(4, 4), f32(4, 4), f32(4, 4))
    with _raises(r"tensor_copy_predicated: src and dst must share a dtype, got bfloat16 and float32"):
        vector.tensor_copy_predicated(f32(4, 4), empty((4, 4), BF16), empty((4, 4), np.uint8))


def test_accumulating_instruction_rules() -> None:
    with _raises(r"tensor_scalar_cumulative: src dtype int32 is not supported \(int32/uint32"):
        vector.tensor_scalar_cumulative(f32(4, 8), empty((4, 8), np.int32), nl.add, nl.add, 0.0)
    with _raises(r"tensor_scalar_cumulative: imm1 must be given exactly when reduce_cmd is load_reduce"):
        vector.tensor_scalar_cumulative(f32(4, 8), f32(4, 8), nl.add, nl.add, 0.0,
                                        reduce_cmd=reduce_cmd.load_reduce)
    with _raises(r"tensor_scalar_reduce: reduce_op must be add, multiply, maximum or minimum, got nl.subtract"):
        vector.tensor_scalar_reduce(f32(4, 8), f32(4, 8), nl.add, 1.0, nl.subtract, f32(4, 1))


def test_bn_stats_rules() -> None:
    with _raises(r"bn_stats: data has 513 elements per partition, must be at most bn_stats_fmax \(512\)"):
        vector.bn_stats(f32(4, 6), f32(4, 513))
    with _raises(r"bn_aggr: data has 10 elements per partition, not a multiple of 3"):
        vector.bn_aggr(f32(4, 2), f32(4, 10))
    with _raises(r"bn_aggr: dst must hold 2 elements on each of 4 partitions, got shape \(4, 3\)"):
        vector.bn_aggr(f32(4, 3), f32(4, 6))


def test_range_select_fill_is_an_fp32_immediate() -> None:
    """nki-library's attention kernels pass the literal -3.4028235e38 (a double one ulp away from
    finfo(float32).min that rounds to it): accepted; a value rounding elsewhere is refused."""
    src, lo, hi = f32(4, 8), f32(4, 1), f32(4, 1)
    src.np()[...] = np.arange(32, dtype=np.float32).reshape(4, 8)
    lo.np()[...], hi.np()[...] = 2.0, 5.0
    dst = f32(4, 8)
    vector.range_select(dst, src, nl.greater_equal, nl.less, lo, hi, on_false_value=-3.4028235e38)
    expect = np.where((np.arange(8) >= 2) & (np.arange(8) < 5), src.np(), np.finfo(np.float32).min)
    np.testing.assert_array_equal(dst.np(), expect)
    with _raises(r"range_select: on_false_value must be FP32_MIN \(.*\) as an fp32 immediate, got -3.4e\+38"):
        vector.range_select(f32(4, 8), src, nl.greater_equal, nl.less, lo, hi, on_false_value=-3.4e38)


def test_select_and_scan_rules() -> None:
    with _raises(r"range_select: on_false_value must be FP32_MIN"):
        vector.range_select(f32(4, 8), f32(4, 8), nl.less, nl.less, f32(4, 1), f32(4, 1), on_false_value=0.0)
    with _raises(r"range_select: comp_op0 must be one of equal/less/less_equal/greater/greater_equal, got nl.add"):
        vector.range_select(f32(4, 8), f32(4, 8), nl.add, nl.less, f32(4, 1), f32(4, 1))
    with _raises(r"select_reduce: predicate must be int8, uint8, int16 or uint16, got float32"):
        vector.select_reduce(f32(4, 8), f32(4, 8), f32(4, 8), 0.0)
    with _raises(r"select_reduce: reduce_op must be nl.maximum, got nl.add"):
        vector.select_reduce(f32(4, 8), empty((4, 8), np.uint8), f32(4, 8), 0.0, reduce_op=nl.add)
    with _raises(r"tensor_tensor_scan: data0 and data1 cannot both be in PSUM"):
        vector.tensor_tensor_scan(f32(4, 8), f32(4, 8, buffer=psum), f32(4, 8, buffer=psum), 0.0,
                                  nl.multiply, nl.add)


def test_topk_data_rank_limits() -> None:
    with _raises(r"nc_find_index8: data must be at most 5-D, got shape \(2, 2, 2, 2, 2, 2\)"):
        vector.nc_find_index8(empty((2, 8), np.uint32), f32(2, 2, 2, 2, 2, 2), f32(2, 8))
    with _raises(r"nc_match_replace8: vals must be at most 3-D, got shape \(2, 2, 2, 2\)"):
        vector.nc_match_replace8(f32(2, 16), f32(2, 16), f32(2, 2, 2, 2), imm=0.0)
