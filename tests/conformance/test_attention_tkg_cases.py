"""attention_tkg's conformance cases at the sizes that do not fit at once: K / V drawn a chunk at a time straight into
their dtype (the same bytes as the test's one-shot draw) and the reference run on a few batch rows a call (the same
golden, bit for bit, as one call). nki-library needed."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit.conformance import cases, cases_attention_tkg, harness
from trnkit.conformance.cli import FETCH_HINT

ROOT = harness.nkilib_root()
pytestmark = pytest.mark.skipif(ROOT is None, reason=f"no nki-library checkout or archive: {FETCH_HINT}")
KERNEL = "core/attention/attention_tkg"


def _case(cid: str) -> harness.Case:
    return next(c for c in cases.all_cases(ROOT) if cases.case_id(c) == f"{KERNEL}|{cid}")


def _one_shot(inputs: dict, fp8: bool) -> dict:
    """The test's input_generator as it draws: np.random.seed(0), then one random_sample per tensor of its whole shape,
    cast to the dtype (q to bf16 and then fp8 for fp8 KV; K / V of fp8 KV as random_sample * 480 - 240 cast to fp8)."""
    np.random.seed(0)
    dt = inputs["dtype"]
    q = np.random.random_sample(inputs["q"].shape).astype(dt)
    out = {"q": q.astype(cases_attention_tkg.FP8) if fp8 else q}
    for name in ("k_active", "v_active", "k_prior", "v_prior"):
        x = np.random.random_sample(inputs[name].shape)
        out[name] = (x * 480.0 - 240.0).astype(cases_attention_tkg.FP8) if fp8 else x.astype(dt)
    return out


@pytest.mark.parametrize("cid", [
    "bf16 tp_k_prior use_pos_id fuse_rope|lnc2|bs=4 q_head=1 s_active=5 s_prior=1024/10240 d=128 block_len=0",
    "fp8_kv qk_in_sb no_strided_mm1|lnc2|bs=4 q_head=1 s_active=5 s_prior=1024/10240 d=128 block_len=0",
    "fp32 tp_k_prior use_pos_id fuse_rope sink|lnc2|bs=4 q_head=4 s_active=5 s_prior=1024/10240 d=64 block_len=0",
])
def test_kv_drawn_in_chunks_are_the_tests_one_shot_draw(cid, monkeypatch):
    case = _case(cid)
    monkeypatch.setattr(harness, "COMPARE_CHUNK", 65_537)  # many chunks, the last one short
    for large in (1 << 40, 4096):  # in memory, then each K / V cache on disk
        monkeypatch.setattr(harness, "LARGE_ARRAY_BYTES", large)
        with harness.nki_is_interpreter(ROOT):
            inputs = case.inputs()
        after = np.random.random_sample()  # the generator where the case left it
        expected = _one_shot(inputs, fp8="fp8_kv" in cid)
        assert harness._file_backed(inputs["k_prior"]) == (large == 4096)
        for name, want in expected.items():
            got = np.asarray(inputs[name])
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name
        cfg = inputs["cfg"]  # what the test draws after K and V (no block table in these rows), from the same state
        if cfg.fuse_rope:
            assert np.array_equal(inputs["inv_freqs"], np.random.random(size=(cfg.d_head // 2, 1)).astype(np.float32))
        if inputs["sink"] is not None:
            assert np.array_equal(inputs["sink"], np.random.random_sample((cfg.q_head, 1)).astype(np.float32))
        assert np.random.random_sample() == after  # and the generator ends where the one-shot draws leave it


def _golden(case: harness.Case, **kw: object) -> dict:
    inputs = case.inputs()
    ref_in = {k: harness._to_torch(v, case.keep_low_precision) for k, v in case.ref_inputs(inputs).items()}
    return cases_attention_tkg.attention_tkg_golden(**ref_in, **kw)


def _assert_bitwise(cid: str) -> None:
    case = _case(cid)
    with harness.nki_is_interpreter(ROOT):
        whole = _golden(case)
        pieces = _golden(case, chunk_bytes=1)  # as few batch rows a call as the layout allows
    assert whole.keys() == pieces.keys() == set(case.outputs)
    for name in whole:
        assert whole[name].dtype == pieces[name].dtype and whole[name].shape == pieces[name].shape, name
        assert np.array_equal(whole[name].view(np.uint8), pieces[name].view(np.uint8)), name


@pytest.mark.parametrize("cid", [
    # HBM q / outputs with fused RoPE (k_out too), one batch row a call
    "bf16 tp_k_prior use_pos_id fuse_rope|lnc2|bs=4 q_head=1 s_active=5 s_prior=1024/10240 d=128 block_len=0",
    # SBUF layouts (batch-major columns), sink, 4 active tokens, batch-sharded at LNC 2
    "bf16 tp_k_prior qk_in_sb k_out_in_sb out_in_sb sink|lnc2|bs=8 q_head=4 s_active=4 s_prior=128/256 d=64 "
    "block_len=0",
    # fp8 KV, flat cache [B, 1, d, S] (not transposed), loaded mask
    "fp8_kv qk_in_sb no_strided_mm1|lnc2|bs=4 q_head=1 s_active=5 s_prior=1024/10240 d=128 block_len=0",
])
def test_the_golden_in_batch_chunks_is_the_whole_call(cid):
    _assert_bitwise(cid)


@pytest.mark.slow
@pytest.mark.parametrize("cid", [
    # block cache with a loaded mask: the chunk widened to keep the mask layout's block length (22 of 64 rows)
    "bf16 tp_k_prior qk_in_sb k_out_in_sb out_in_sb no_strided_mm1|lnc2|bs=64 q_head=8 s_active=1 s_prior=2048/2048 "
    "d=128 block_len=16",
    # fp8 KV block cache
    "fp8_kv tp_k_prior qk_in_sb k_out_in_sb out_in_sb no_strided_mm1|lnc2|bs=4 q_head=8 s_active=7 s_prior=4096/10240 "
    "d=64 block_len=16",
    # block cache, sliding window (start positions per row), mask from position ids, sink
    "bf16 tp_k_prior use_pos_id qk_in_sb k_out_in_sb out_in_sb no_strided_mm1 sink sw=128|lnc2|bs=4 q_head=8 "
    "s_active=7 s_prior=4096/10240 d=64 block_len=16",
    # sliding window on a flat cache with fused RoPE
    "bf16 tp_k_prior use_pos_id fuse_rope sw=128|lnc2|bs=4 q_head=1 s_active=5 s_prior=1024/10240 d=128 block_len=0",
])
def test_the_golden_in_batch_chunks_is_the_whole_call_block_and_window(cid):
    _assert_bitwise(cid)


def test_a_loaded_block_mask_keeps_the_whole_batchs_sharding_choice():
    """bs = 64, 8 q heads, one active token, block cache, mask loaded: the whole batch is batch-sharded at LNC 2 (even
    and 64 x 8 > 128 query rows), so every chunk must be even with more than 16 rows: 17, 19, 21 are odd, 18 leaves a
    last chunk of 10 and 20 one of 4; 22 gives 22 + 22 + 20. Without the loaded mask any chunk size does."""
    case = _case("bf16 tp_k_prior qk_in_sb k_out_in_sb out_in_sb no_strided_mm1|lnc2|bs=64 q_head=8 s_active=1 "
                 "s_prior=2048/2048 d=128 block_len=16")
    with harness.nki_is_interpreter(ROOT):
        cfg = case.inputs()["cfg"]
        assert cases_attention_tkg._chunk_rows(cfg, 2, 1) == 22
        assert cases_attention_tkg._chunk_rows(cfg, 2, 1 << 40) == 64  # all fit: one call
        cfg.use_pos_id = True
        assert cases_attention_tkg._chunk_rows(cfg, 2, 1) == 1


@pytest.mark.parametrize("cid", [
    "fp8_kv qk_in_sb no_strided_mm1|lnc2|bs=4 q_head=1 s_active=5 s_prior=1024/10240 d=128 block_len=0",  # [B, 1, d, S]
    "bf16 tp_k_prior use_pos_id fuse_rope|lnc2|bs=4 q_head=1 s_active=5 s_prior=1024/10240 d=128 block_len=0",
])
def test_a_flat_cache_read_in_chunks_is_never_copied_whole(cid, monkeypatch):
    """Where the reference runs in chunks, a flat K / V cache goes to it as the case drew it (no float32 copy of the
    whole, the harness's conversion) and each chunk's rows are converted on their own: the same golden, bit for bit."""
    case = _case(cid)
    with harness.nki_is_interpreter(ROOT):
        whole = _golden(case)
        inputs = case.inputs()
        assert not isinstance(case.ref_inputs(inputs)["k_prior"], cases_attention_tkg._CacheRows)  # fits: as before
        monkeypatch.setattr(cases_attention_tkg, "REF_CHUNK_BYTES", 1)
        ref_in = case.ref_inputs(inputs)
        held = ref_in["k_prior"], ref_in["v_prior"]
        assert all(isinstance(h, cases_attention_tkg._CacheRows) for h in held)
        assert held[0].array is inputs["k_prior"] and held[1].array is inputs["v_prior"]
        kw = {k: harness._to_torch(v, case.keep_low_precision) for k, v in ref_in.items()}
        assert kw["k_prior"] is held[0]  # (the harness hands a non-array through as it is)
        pieces = cases_attention_tkg.attention_tkg_golden(chunk_bytes=1, **kw)
        again = cases_attention_tkg.attention_tkg_golden(chunk_bytes=1 << 40, **kw)  # held, but one call: whole
    for name in whole:
        assert np.array_equal(whole[name].view(np.uint8), pieces[name].view(np.uint8)), name
        assert np.array_equal(whole[name].view(np.uint8), again[name].view(np.uint8)), name
