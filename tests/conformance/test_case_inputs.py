"""A conformance row's inputs are a function of its case alone (harness.case_inputs), and the zero inputs a case
decides its refusal on (Case.zero_inputs) have its inputs' shapes and dtypes."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import random

import numpy as np
import pytest
import torch

from trnkit.conformance import cases, cases_model_config, cases_transformer, golden_chunk, harness, reduce

ROOT = harness.nkilib_root()
needs_checkout = pytest.mark.skipif(ROOT is None, reason="no nki-library checkout or archive")

# cheap cases of builders that draw from numpy's global generator after seeding it (moe_tkg's expert indices and
# affinities, attention_tkg's, attention_block_tkg's block tables), from fresh generators (qkv), with a KVDP split
REAL = (
    "core/moe/moe_tkg|all experts Swish post_scale clamp bias|lnc2|T=4 H=3072 I=64 E=4",
    "core/attention/attention_tkg|bf16 tp_k_prior qk_in_sb k_out_in_sb out_in_sb no_strided_mm1 sink|lnc1|bs=4 "
    "q_head=1 s_active=5 s_prior=8192/8192 d=128 block_len=16",
    "core/qkv/qkv_cte|no_dma_transpose bf16 no_norm BSD|lnc2|B=1 S=128 H=8192 heads=1/1 d=128",
    "experimental/transformer/attention_block_tkg|bf16 no_rmsnorm_X test_bias kv_quant block_len=32 KVDP=4|lnc2|"
    "B=8 q_heads=1/rank d=64 H=3072/2880 S_ctx=1024/1024 S=1 ranks=4",
)


def _digest(value, m=None):
    m = m or hashlib.sha256()
    if isinstance(value, np.ndarray):
        m.update(f"{value.dtype}{value.shape}".encode())
        m.update(np.ascontiguousarray(value).view(np.uint8).tobytes())
    elif isinstance(value, dict):
        for k in sorted(value):
            m.update(k.encode())
            _digest(value[k], m)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _digest(v, m)
    elif isinstance(value, (int, float, str, bool, type(None), np.generic, enum.Enum)):
        m.update(repr(value).encode())
    else:  # (a config object, a replica group: its type)
        m.update(type(value).__name__.encode())
    return m.hexdigest()


@pytest.fixture(scope="module")
def by_id():
    return {cases.case_id(c): c for c in cases.all_cases(ROOT)}


@needs_checkout
def test_real_cases_build_the_same_inputs_alone_and_after_other_cases(by_id):
    """Each case's inputs, built first in a state seeded one way, then after the other cases (each of which leaves
    the generators where its draws end) in a state seeded another way, hash the same."""
    def state(seed):
        np.random.seed(seed)
        torch.manual_seed(seed)
        random.seed(seed)

    with harness.nki_is_interpreter(ROOT):
        alone = {}
        for i in REAL:
            state(1)
            alone[i] = _digest(harness.case_inputs(by_id[i]))
        state(2)
        after = {i: _digest(harness.case_inputs(by_id[i])) for i in reversed(REAL)}
    assert after == alone


def _same_arguments(zero, real, path=""):
    """``zero`` has ``real``'s keys, array shapes and dtypes and non-array values (objects: their type)."""
    if isinstance(real, dict):
        assert sorted(zero) == sorted(real), path
        for k in real:
            _same_arguments(zero[k], real[k], f"{path}.{k}")
    elif isinstance(real, (list, tuple)):
        assert len(zero) == len(real), path
        for n, (z, r) in enumerate(zip(zero, real)):
            _same_arguments(z, r, f"{path}[{n}]")
    elif isinstance(real, np.ndarray):
        assert isinstance(zero, np.ndarray) and (zero.shape, zero.dtype) == (real.shape, real.dtype), path
    elif isinstance(real, (int, bool, str, type(None), enum.Enum)) or type(real).__name__ == "QuantizationType":
        assert zero == real, path
    else:  # (fp8 scales drawn as numbers, a replica group, the config: same type)
        assert type(zero) is type(real), path


@needs_checkout
@pytest.mark.parametrize(("case_id", "chunked"), [
    ("experimental/transformer/attention_block_tkg|bf16 K_cache_transposed no_rmsnorm_X test_bias|lnc2|B=1 q_heads=1 "
     "d=64 H=3072 S_ctx=128/128 S=1", False),
    ("experimental/transformer/attention_block_tkg|fp8 static block_len=32|lnc2|B=255 q_heads=2 d=128 H=8192 "
     "S_ctx=1024/1024 S=1", False),
    (REAL[-1], False), (REAL[-1], True),
])
def test_attention_block_zero_inputs_have_the_inputs_shapes_and_dtypes(by_id, monkeypatch, case_id, chunked):
    """The kernel's arguments of attention_block_tkg's zero inputs are its inputs' (every key, shape, dtype, flag and
    enum; per rank on KV-data-parallel rows), their weights and caches zero; ``chunked``: the mask built in batch
    chunks (the zero inputs: not built, its documented shape)."""
    case = by_id[case_id]
    if chunked:
        monkeypatch.setattr(cases_transformer, "_mask_chunk",
                            lambda b, q, s_tkg, s_ctx, kvdp: max(kvdp, b // 4 // kvdp * kvdp))
    with harness.nki_is_interpreter(ROOT):
        real = harness.case_inputs(case)
        zero = harness.case_inputs(case, case.zero_inputs)
    real = real["ranks"] if case.ranks else [real]
    zero = zero["ranks"] if case.ranks else [zero]
    _same_arguments(zero, real)
    for kw in zero:
        assert not any(kw[k].astype(np.float32).any() for k in ("X", "W_qkv", "W_out", "K_cache", "V_cache"))


@needs_checkout
def test_a_qk_norm_row_is_refused_on_its_zero_inputs(by_id):
    """A model-config row refused at the QK norm (ATTN_NORM_MOVING): the kernel refuses its zero inputs, so the row
    is REJECTED with the kernel's own message, without building its inputs or reference."""
    case = by_id["experimental/transformer/attention_block_tkg|bf16 no_rmsnorm_X qk_norm_pre_rope "
                 "qk_norm_pre_rope_gamma block_len=32 model_config OPTIMAL|lnc2|B=128 q_heads=8 d=128 H=5120 "
                 "S_ctx=1024/1024 S=1"]
    assert case.rejected_by == cases_model_config.ATTN_NORM_MOVING.format(1024)

    def never():
        raise AssertionError("inputs() built")
    row = harness.run_case(dataclasses.replace(case, inputs=never), ROOT)
    assert row.result == harness.REJECTED and harness.row_ok(case, row), row.message
    assert row.message.startswith(f"{harness.ZERO_INPUTS_NOTE}: nc_matmul: moving free size 1024 exceeds "
                                  "gemm_moving_fmax (512)"), row.message
    assert row.message.endswith(f"({case.note})")


@needs_checkout
def test_moe_weights_drawn_in_chunks_are_the_one_shot_draws(by_id, monkeypatch):
    """moe_tkg's and moe_block_tkg's expert weights and biases, drawn a chunk at a time (harness.drawn_array), are
    the values of the builders' one-shot draws (``default_rng(seed).normal(size=shape).astype(dtype)``, in order on
    one generator for moe_block_tkg), chunk boundaries anywhere."""
    monkeypatch.setattr(harness, "COMPARE_CHUNK", 1000)
    same = lambda a, b: a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()  # noqa: E731
    with harness.nki_is_interpreter(ROOT):
        got = harness.case_inputs(by_id[REAL[0]])
    fresh = lambda shape: np.random.default_rng(0).normal(size=shape).astype(np.float16)  # noqa: E731
    assert same(got["hidden_input"], fresh((4, 3072)))
    assert same(got["expert_gate_up_weights"], fresh((4, 3072, 2, 64)))
    assert same(got["expert_down_weights"], fresh((4, 64, 3072)))
    assert same(got["expert_gate_up_bias"], fresh((4, 2, 64))) and same(got["expert_down_bias"], fresh((4, 3072)))
    case = by_id["core/moe_block/moe_block_tkg|all experts Swish fp16 weights fp16 input bias clamp|lnc2|B=19 S=1 "
                 "H=3072 I=128 E=128/1 k=4"]
    with harness.nki_is_interpreter(ROOT):
        got = harness.case_inputs(case)
    rng = np.random.default_rng(42)
    for name, shape in (("inp", (19, 1, 3072)), ("gamma", (1, 3072)), ("router_weights", (3072, 128))):
        assert same(got[name], rng.uniform(-0.1, 0.1, size=shape).astype(got[name].dtype)), name
    assert same(got["expert_gate_up_weights"], rng.normal(size=(1, 3072, 2, 128)).astype(np.float16))
    assert same(got["expert_down_weights"], rng.normal(size=(1, 128, 3072)).astype(np.float16))
    assert same(got["router_bias"], rng.uniform(-0.1, 0.1, size=(1, 128)).astype(got["router_bias"].dtype))
    assert same(got["expert_gate_up_bias"], rng.normal(size=(1, 2, 128)).astype(np.float16))  # (state after: same)


def _batch_sharded(n: int, q: int, s: int, s_ctx: int) -> bool:
    """attention_tkg's LNC-2 choice as its docstring states it: shard the batch when it is even and holds more than
    128 query rows (or S_prior is under 256), else S_prior when S_prior is at least 256."""
    return n % 2 == 0 and (n * q * s > 128 or s_ctx < 256)


@needs_checkout
@pytest.mark.parametrize(("b", "q", "s_ctx", "chunk"), [
    (255, 2, 32768, 17),   # the test's B = 255 block rows: 15 odd chunks of 17, S_prior sharded like the batch
    (256, 4, 24576, 44),   # batch-sharded: 34 leaves 18 (72 query rows), 36 / 38 / 40 / 42 leave 4 / 28 / 16 / 4
    (256, 2, 24576, 86),   # more than 64 rows a chunk: 66 leaves 58, ... 86 leaves 84 (168 query rows)
    (768, 2, 10240, 70),   # 66 / 68 leave 42 / 20; 70 leaves 68 (136 query rows)
    (64, 4, 10240, 0),     # no chunk of 17 to 63 keeps the whole batch's choice: the whole batch at once
])
def test_a_block_rows_golden_chunk_keeps_the_whole_batchs_sharding_choice(b, q, s_ctx, chunk):
    with harness.nki_is_interpreter(ROOT):
        assert golden_chunk.block_golden_chunk(b, q, 1, s_ctx, cases_transformer._s_prior_sharded) == chunk
    if chunk:
        sizes = {chunk, b % chunk} - {0}
        assert all(_batch_sharded(n, q, 1, s_ctx) == _batch_sharded(b, q, 1, s_ctx) for n in sizes)
        assert not any(all(_batch_sharded(n, q, 1, s_ctx) == _batch_sharded(b, q, 1, s_ctx) for n in {c, b % c} - {0})
                       for c in range(17, chunk))


@needs_checkout
@pytest.mark.parametrize(("b", "ranks", "q", "d", "s_ctx", "chunk"), [
    (2048, 8, 8, 64, 10240, 64),  # 256 MiB / (10,240 x 64 x 4 B) = 102 rows; 64 the largest divisor of 256 within
    (256, 4, 2, 64, 10240, 0),    # 102 again, but no divisor of a rank's 64 rows holds more than 128 query rows:
                                  # S_prior sharded, where the whole batch is batch-sharded
    (8, 4, 1, 64, 1048576, 1),    # 1 row; S_prior sharded, as for the whole batch (8 query rows)
    (8, 4, 1, 64, 1024, 0),       # a 32 MiB cache: no chunk
])
def test_a_kvdp_rows_golden_chunk(b, ranks, q, d, s_ctx, chunk):
    """The KV-data-parallel golden's chunk (golden_chunk.kvdp_golden_chunk) against hand-worked values, with
    nki-library's predicate and with reduce's reading of it (the one the memory estimate uses)."""
    ours = lambda n, q_, s_, sp, _p: reduce._lnc_sharding(n, q_, s_, sp)[1]  # noqa: E731
    nkilib = cases_transformer._s_prior_sharded
    with harness.nki_is_interpreter(ROOT):
        assert golden_chunk.kvdp_golden_chunk(b, b // ranks, q, 1, s_ctx, d, nkilib) == chunk
    assert golden_chunk.kvdp_golden_chunk(b, b // ranks, q, 1, s_ctx, d, ours) == chunk


@needs_checkout
def test_a_block_rows_golden_in_widened_chunks_is_the_whole_call():
    """An even batch of a block-cache row (B = 80, 4 q heads: batch-sharded), whose chunk of 17 the golden refuses
    (odd chunks shard S_prior), in the widened chunks of 40: the same outputs as one call on the whole batch."""
    case = cases_transformer.attention_block_case(80, 4, 64, 256, None, 512, 512, 1, block_len=16)
    with harness.nki_is_interpreter(ROOT):
        chunk = golden_chunk.block_golden_chunk(80, 4, 1, 512, cases_transformer._s_prior_sharded)
        assert chunk == 40
        inputs = case.inputs()
        kw = {k: harness._to_torch(v, case.keep_low_precision) for k, v in case.ref_inputs(inputs).items()}
        kw.pop("batch_chunk")
        whole = cases_transformer.attention_block_golden(**kw)
        pieces = cases_transformer.attention_block_golden(**kw, batch_chunk=chunk)
        with pytest.raises(ValueError, match="a chunk of 17 of the 80 batch rows changes the kernel's batch / "
                                             "S_prior sharding choice"):
            cases_transformer.attention_block_golden(**kw, batch_chunk=17)
    assert whole.keys() == pieces.keys() == set(case.outputs)
    for name in whole:
        assert whole[name].dtype == pieces[name].dtype and whole[name].shape == pieces[name].shape, name
        a, p = whole[name].astype(np.float32), pieces[name].astype(np.float32)
        assert np.array_equal(a, p), (name, float(np.abs(a - p).max()))


def _assert_same_arrays(whole: dict, pieces: dict) -> None:
    assert whole.keys() == pieces.keys()
    for name in whole:
        if not isinstance(whole[name], np.ndarray):
            assert whole[name] == pieces[name], name
            continue
        a, p = np.asarray(whole[name], np.float64), np.asarray(pieces[name], np.float64)
        assert a.shape == p.shape and np.array_equal(a, p), (name, a.shape, p.shape)


@needs_checkout
@pytest.mark.parametrize("block_len", [0, 16])
def test_the_tapped_golden_in_batch_chunks_is_the_whole_call(block_len):
    """The reference fed the kernel's tapped tiles (the QKV projection, the Q / K / V attention reads, the attention
    output) batch chunk by batch chunk: the same outputs, the same captured Q / K / V and RoPE products and the same
    exact attention and bound as one call on the whole batch (STATIC fp8 weights, fp8 KV cache, flat and block
    caches), the tiles drawn at random so that a chunk cut from the wrong rows shows."""
    b, q, d = 8, 2, 64
    case = cases_transformer.attention_block_case(b, q, d, 256, None, 512, 512, 2, block_len=block_len,
                                                  quantization_type="STATIC", kv_quant=True)
    rng = np.random.default_rng(1)
    with harness.nki_is_interpreter(ROOT):
        kw = {k: harness._to_torch(v, case.keep_low_precision) for k, v in case.ref_inputs(case.inputs()).items()}
        kw.pop("batch_chunk")
        qkv_out = torch.from_numpy(rng.normal(0, 1, (b * 2, d * (q + 2))).astype(np.float32))
        attention_in = (rng.normal(0, 1, (d, b * q * 2)), rng.uniform(-200, 200, (d, b * 2)),
                        rng.uniform(-200, 200, (b * 2, d)))
        attention_out = rng.normal(0, 1, (d, b, q, 2))
        runs = {}
        for chunk in (0, 2):
            captured, exact = {}, {}
            first = cases_transformer.attention_block_golden(**kw, batch_chunk=chunk, qkv_out=qkv_out,
                                                             capture=captured)
            second = cases_transformer.attention_block_golden(**kw, batch_chunk=chunk, attention_in=attention_in,
                                                              attention_exact=exact, tile_rounding=True)
            third = cases_transformer.attention_block_golden(**kw, batch_chunk=chunk, attention_in=attention_in,
                                                             attention_out=attention_out, tile_rounding=True)
            runs[chunk] = first, captured, second, exact, third
    assert {"Q", "K", "V", "Q_products", "K_products"} <= set(runs[0][1]) and {"exact", "bound"} <= set(runs[0][3])
    assert runs[0][1]["Q"].shape == (d, b, q, 2) and runs[0][3]["exact"].shape == (b, q, d, 2)
    for whole, pieces in zip(runs[0], runs[2]):
        _assert_same_arrays(whole, pieces)
    # the fed tiles reached the reference: the output projection's input differs, so does X_out
    assert not np.array_equal(runs[0][0]["X_out"].astype(np.float32), runs[0][4]["X_out"].astype(np.float32))
