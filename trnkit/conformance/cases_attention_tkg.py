"""Conformance cases of nki-library's token-generation attention kernels, written from their test files.

``test/integration/nkilib/core/attention/test_gen_mask_tkg.py``: ``TestGenMaskTkgHbm`` runs
``gen_mask_tkg_hbm`` (a library kernel) against ``gen_mask_tkg_hbm_torch_ref[lnc]`` at rtol = atol = 0,
on inputs drawn as the test's ``generate_gen_mask_inputs(lnc=1)`` draws them (``np.random.seed(42)``,
cache lengths ``randint(1, s_ctx)``, or ``randint(1, s_ctx - s_active)`` with a sliding window, whose
per-query start positions follow ``build_swa_positions``; the active mask is the causal
``[s_active, bs, q_head, s_active]`` lower triangle). The kernel writes its mask as
``[s_prior / 128, 128, bs, q_head, s_active]`` and the reference returns ``[s_prior, bs, q_head,
s_active]``; the test framework compares them element by element in that order, as here.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case, drawn_array

__all__ = ["attention_tkg_cases", "gen_mask_hbm_golden", "causal_active_mask", "swa_start_positions"]

F32 = np.dtype(np.float32)
FP8 = np.dtype(ml_dtypes.float8_e4m3)
LIB = "nkilib_src.nkilib.core"
TESTS = "test/integration/nkilib/core/attention"
HERE = "trnkit.conformance.cases_attention_tkg"


def causal_active_mask(bs: int, q_head: int, s_active: int) -> np.ndarray:
    """The causal mask of the active tokens, ``[s_active (key), bs, q_head, s_active (query)]``:
    1 where the key is at or before the query."""
    tril = np.tril(np.ones((s_active, s_active), dtype=F32))  # [query, key]
    return np.ascontiguousarray(np.broadcast_to(tril.T[:, None, None, :], (s_active, bs, q_head, s_active)))


def swa_start_positions(pos: np.ndarray, s_active: int, window: int, cache_len: int, block_len: int) -> np.ndarray:
    """First visible key per query ``[bs, s_active]`` for a sliding window of ``window`` keys:
    ``pos + i - window + 1``, clamped at 0 for a block cache, wrapped modulo ``cache_len`` for the flat
    (circular) one."""
    query = pos.reshape(-1, 1).astype(np.int64) + np.arange(s_active)
    start = query - window + 1
    return (np.maximum(start, 0) if block_len > 0 else start % cache_len).astype(F32)


def _mask_inputs(bs: int, q_head: int, s_ctx: int, s_active: int, block_len: int, window: int,
                 active: bool) -> dict[str, Any]:
    """pos ids (and start positions, active mask) as one ``[1, bs * s_active]`` row each."""
    np.random.seed(42)
    cache_lens = np.random.randint(1, s_ctx - s_active if window else s_ctx, size=(bs,)).astype(np.int32)
    if window:
        pos = (cache_lens.reshape(-1, 1) + np.arange(s_active)).reshape(1, -1).astype(F32)
    else:
        pos = np.repeat(cache_lens, s_active).reshape(1, -1).astype(F32)
    out: dict[str, Any] = {"pos_ids_hbm": pos}
    if window:
        start = swa_start_positions(cache_lens, s_active, window, s_ctx, block_len)
        out["start_pos_hbm"] = start.reshape(1, -1)
    if active:
        out["active_mask"] = causal_active_mask(bs, q_head, s_active)
    return out


def _hbm_inputs(bs: int, q_head: int, s_ctx: int, s_active: int, block_len: int, window: int, active: bool
                ) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        return {**_mask_inputs(bs, q_head, s_ctx, s_active, block_len, window, active),
                "bs": bs, "q_head": q_head, "s_active": s_active, "s_prior": s_ctx, "block_len": block_len}
    return make


def gen_mask_hbm_golden(lnc: int, **kw: Any) -> dict[str, Any]:
    """``gen_mask_tkg_hbm_torch_ref[lnc]`` (an LNC-subscripted reference)."""
    ref = importlib.import_module(f"{LIB}.attention.gen_mask_tkg_torch").gen_mask_tkg_hbm_torch_ref
    kw = {k: v.float() if hasattr(v, "float") else v for k, v in kw.items()}
    with contextlib.redirect_stdout(io.StringIO()):  # its block-length resize prints
        return {"mask_out_hbm": ref[lnc](**kw)}


def _with_lnc(lnc: int) -> Callable[[dict], dict]:
    return lambda inputs: {**inputs, "lnc": lnc}


def _flat_compare(inputs: dict, actual: dict, expected: dict) -> tuple[dict, dict]:
    """The test framework compares elements in order: the kernel's tiled layout flattened."""
    return ({k: v.reshape(expected[k].shape) for k, v in actual.items()}, expected)


# TestGenMaskTkgHbm rows: (batch, q_head, s_ctx, s_active, block_len, sliding_window, active_mask, lnc)
def _hbm_rows() -> list[tuple[int, int, int, int, int, int, bool, int]]:
    rows = []
    for b, q, s, a, strided, lnc in [  # test_flat_kv (strided_mm1 is implied by block_len == 0)
            (4, 1, 256, 1, True, 1), (4, 1, 1024, 5, True, 1), (4, 2, 2048, 7, True, 1), (16, 4, 4096, 5, True, 1),
            (4, 1, 256, 1, False, 1), (4, 1, 1024, 5, False, 1), (8, 2, 4096, 7, False, 1),
            (4, 1, 4096, 5, True, 2), (4, 2, 16384, 7, True, 2), (4, 1, 4096, 5, False, 2),
            (8, 8, 4096, 5, True, 2), (8, 8, 4096, 5, False, 2)]:
        rows.append((b, q, s, a, 0, 0, False, lnc))
    rows += [(b, q, s, a, bl, 0, False, lnc) for b, q, s, a, bl, lnc in [  # test_block_kv
        (4, 1, 256, 5, 16, 1), (4, 1, 2048, 5, 32, 1), (8, 2, 4096, 7, 16, 1), (4, 1, 4096, 5, 128, 1),
        (4, 1, 32768, 5, 128, 1), (4, 1, 8192, 5, 16, 2), (4, 1, 8192, 5, 128, 2), (4, 1, 32768, 5, 128, 2),
        (8, 8, 4096, 5, 16, 2), (8, 8, 4096, 5, 128, 2), (8, 8, 32768, 5, 128, 2)]]
    rows += [(b, q, s, a, bl, 0, True, lnc) for b, q, s, a, bl, _, lnc in [  # test_active_mask
        (4, 1, 256, 5, 0, True, 1), (4, 2, 512, 5, 0, True, 1), (4, 1, 256, 5, 0, False, 1),
        (4, 1, 256, 1, 0, True, 1), (4, 1, 2048, 5, 16, False, 1), (4, 2, 4096, 5, 16, False, 1),
        (4, 1, 4096, 5, 128, False, 1), (4, 1, 32768, 5, 128, False, 1), (16, 4, 4096, 5, 0, True, 1),
        (8, 2, 4096, 7, 16, False, 1), (4, 2, 4096, 5, 0, True, 2), (4, 1, 8192, 5, 16, False, 2),
        (4, 1, 8192, 5, 128, False, 2), (4, 1, 32768, 5, 128, False, 2), (8, 8, 256, 5, 0, True, 2),
        (8, 8, 4096, 5, 16, False, 2), (8, 8, 4096, 5, 128, False, 2), (8, 8, 32768, 5, 128, False, 2)]]
    rows += [(b, q, s, a, bl, sw, False, lnc) for b, q, s, a, sw, bl, _, lnc in [  # test_swa
        (4, 1, 1024, 5, 128, 0, True, 1), (4, 1, 1024, 5, 256, 0, True, 1), (4, 2, 2048, 7, 512, 0, True, 1),
        (4, 1, 1024, 5, 128, 0, False, 1), (4, 2, 2048, 7, 256, 0, False, 1), (4, 1, 2048, 5, 128, 16, False, 1),
        (4, 1, 2048, 5, 256, 16, False, 1), (4, 1, 4096, 5, 256, 128, False, 1),
        (4, 1, 4096, 5, 128, 0, True, 2), (4, 1, 8192, 5, 256, 128, False, 2),
        (8, 8, 4096, 5, 128, 0, True, 2), (8, 8, 4096, 5, 256, 128, False, 2)]]
    rows += [(b, q, s, a, bl, 0, False, lnc) for b, q, s, a, bl, _, lnc in [  # test_fa_tiling
        (8, 8, 8192, 5, 0, True, 1), (8, 8, 8192, 7, 0, True, 1), (8, 8, 8192, 5, 0, False, 1),
        (8, 8, 8192, 5, 16, False, 1), (8, 8, 8192, 5, 128, False, 1), (8, 8, 32768, 5, 128, False, 1),
        (8, 8, 8192, 5, 0, True, 2), (4, 4, 32768, 7, 0, True, 2), (4, 1, 32768, 5, 128, False, 2),
        (4, 4, 65536, 5, 128, False, 2), (8, 8, 32768, 5, 128, False, 2)]]
    rows += [(b, q, s, a, bl, 0, True, lnc) for b, q, s, a, bl, _, lnc in [  # test_fa_tiling_with_active_mask
        (8, 8, 8192, 5, 0, True, 1), (8, 8, 8192, 5, 0, False, 1), (8, 8, 8192, 5, 16, False, 1),
        (8, 8, 8192, 5, 128, False, 1), (8, 8, 32768, 5, 128, False, 1), (8, 8, 8192, 5, 0, True, 2),
        (8, 8, 32768, 5, 128, False, 2), (4, 4, 32768, 7, 0, True, 2), (4, 4, 65536, 5, 128, False, 2)]]
    rows += [(b, q, s, a, bl, sw, True, lnc) for b, q, s, a, sw, bl, _, lnc in [  # test_swa_with_active_mask
        (4, 2, 1024, 5, 256, 0, True, 1), (4, 1, 1024, 5, 128, 0, False, 1), (4, 1, 4096, 5, 256, 128, False, 1),
        (4, 2, 4096, 5, 128, 0, True, 2), (4, 1, 8192, 5, 256, 128, False, 2)]]
    for lnc in (1, 2):  # test_gen_mask_hbm_lnc_sweep
        rows += [(b, q, s, a, bl, sw, False, lnc) for b, q, s, a, bl, _, sw in [
            (4, 1, 4096, 5, 0, True, 0), (4, 2, 16384, 7, 0, True, 0), (4, 1, 4096, 5, 0, False, 0),
            (4, 1, 8192, 5, 16, False, 0), (4, 1, 12288, 5, 16, False, 0), (8, 8, 4096, 5, 16, False, 0),
            (4, 1, 8192, 5, 128, False, 0), (4, 1, 8192, 5, 16, False, 128), (4, 1, 12288, 5, 16, False, 128),
            (4, 1, 4096, 5, 0, True, 128), (4, 2, 4096, 7, 0, True, 256)]]
    # the HBM kernel picks strided_mm1 itself (block_len == 0): rows that differ only in the test's
    # strided_mm1 flag are the same run; keep one of each
    return list(dict.fromkeys(rows))


def _gen_mask_hbm_cases() -> list[Case]:
    cases = []
    for b, q, s, a, bl, sw, active, lnc in _hbm_rows():
        flags = ["flat" if bl == 0 else f"block_len={bl}"] + ([f"sw={sw}"] if sw else []) \
            + (["active_mask"] if active else [])
        cases.append(Case(
            kernel="core/attention/gen_mask_tkg_hbm", name=" ".join(flags),
            shapes=f"bs={b} q_head={q} s_prior={s} s_active={a}",
            entry=f"{LIB}.attention.gen_mask_tkg:gen_mask_tkg_hbm", reference=f"{HERE}:gen_mask_hbm_golden",
            inputs=_hbm_inputs(b, q, s, a, bl, sw, active), ref_inputs=_with_lnc(lnc), outputs=("mask_out_hbm",),
            lnc=lnc, rtol=0.0, atol=0.0, postprocess=_flat_compare, test_file=f"{TESTS}/test_gen_mask_tkg.py"))
    return cases


# -- gen_mask_tkg on SBUF (test_gen_mask_tkg.py, TestGenMaskTkg) -----------------------------------
def _gen_mask_wrapper(gen_mask_tkg: Callable[..., Any]) -> Callable[..., Any]:
    """The test's kernel is a wrapper in its module: it opens an auto-allocating SBUF manager, loads
    the position ids (and start positions) into SBUF, runs ``gen_mask_tkg`` into an SBUF mask (the
    active mask stays in HBM) and stores it: as it is at LNC 1, into its core's slot of an
    ``[lnc, ...]`` output at LNC 2. Written here from that description."""
    import nki.isa as nisa  # the interpreter, inside nki_is_interpreter
    import nki.language as nl

    sbuf_manager = importlib.import_module(f"{LIB}.utils.allocator").SbufManager
    logger = importlib.import_module(f"{LIB}.utils.logging").Logger
    sharding = importlib.import_module(f"{LIB}.utils.kernel_helpers").get_verified_program_sharding_info

    def wrapper(pos_ids_hbm, mask_out_hbm, bs, q_head, s_active, is_s_prior_sharded, s_prior_per_shard,
                start_pos_hbm=None, s_prior_offset=0, block_len=0, strided_mm1=True, active_mask_hbm=None,
                is_batch_sharded=False, batch_offset=0):
        _, lnc, shard = sharding("gen_mask_wrapper", (0, 1))
        tile_shape = mask_out_hbm.shape[-5:]
        sbm = sbuf_manager(0, 128 * math.prod(tile_shape[1:]) * 8, logger("gen_mask_wrapper"), use_auto_alloc=True)
        sbm.open_scope(name="gen_mask_wrapper")
        pos = sbm.alloc_stack((128, bs * s_active), dtype=pos_ids_hbm.dtype, buffer=nl.sbuf, name="pos_ids_sbuf")
        mask = sbm.alloc_stack(tile_shape, dtype=mask_out_hbm.dtype, buffer=nl.sbuf, name="mask_out_sbuf")
        nisa.dma_copy(dst=pos, src=pos_ids_hbm)
        start = None
        if start_pos_hbm is not None:
            start = sbm.alloc_stack((128, bs * s_active), dtype=start_pos_hbm.dtype, buffer=nl.sbuf,
                                    name="start_pos_sbuf")
            nisa.dma_copy(dst=start, src=start_pos_hbm)
        gen_mask_tkg(pos_ids=pos, mask_out=mask, bs=bs, q_head=q_head, s_active=s_active,
                     is_s_prior_sharded=is_s_prior_sharded, s_prior_per_shard=s_prior_per_shard, start_pos=start,
                     s_prior_offset=s_prior_offset, block_len=block_len, strided_mm1=strided_mm1,
                     active_mask=active_mask_hbm, sbm=sbm, is_batch_sharded=is_batch_sharded,
                     batch_offset=batch_offset)
        out = nl.ndarray(mask_out_hbm.shape, dtype=mask_out_hbm.dtype, buffer=nl.shared_hbm, name="golden_mask")
        nisa.dma_copy(dst=out if lnc == 1 else out[shard, :, :, :, :, :], src=mask)
        sbm.close_scope()
        return out
    return wrapper


def _sbuf_mask_inputs(bs: int, q_head: int, s_ctx: int, s_active: int, block_len: int, lnc: int, strided: bool,
                      sp_offset: int, fa_tile: int, window: int, active: bool, batch_offset: int,
                      bs_full: int | None) -> Callable[[], dict[str, Any]]:
    """The test's ``generate_gen_mask_inputs``: shard decisions and the block-length resize from the
    library's helpers, the rows above broadcast to 128 partitions."""
    def make() -> dict[str, Any]:
        utils = importlib.import_module(f"{LIB}.attention.attention_tkg_utils")
        sprior_sharded = lnc > 1 and utils.is_s_prior_sharded(bs, q_head, s_active, s_ctx, 128)
        per_shard = s_ctx // lnc if sprior_sharded else s_ctx
        n_tiles = (fa_tile if fa_tile else per_shard) // 128
        blk = block_len
        if block_len:
            with contextlib.redirect_stdout(io.StringIO()):
                blk, _ = utils.resize_cache_block_len_for_attention_tkg_kernel(
                    s_ctx // block_len, block_len, lnc, 128, bs, q_head, s_active,
                    enable_fa_s_prior_tiling=fa_tile > 0)
        rows = _mask_inputs(bs, q_head, s_ctx, s_active, block_len, window, False)
        out: dict[str, Any] = {"pos_ids_hbm": np.repeat(rows["pos_ids_hbm"], 128, axis=0)}
        if window:
            out["start_pos_hbm"] = np.repeat(rows["start_pos_hbm"], 128, axis=0)
        tile = (128, n_tiles, bs, q_head, s_active)
        out.update(mask_out_hbm=np.zeros(tile if lnc == 1 else (lnc, *tile), dtype=F32), bs=bs, q_head=q_head,
                   s_active=s_active, is_s_prior_sharded=sprior_sharded, s_prior_per_shard=per_shard,
                   s_prior_offset=sp_offset, block_len=blk, strided_mm1=strided)
        if active:
            batch_sharded = lnc > 1 and utils.is_batch_sharded(bs, q_head, s_active, s_ctx, 128)
            full = bs_full if bs_full is not None else (bs * lnc if batch_sharded else bs)
            out.update(active_mask_hbm=causal_active_mask(full, q_head, s_active), is_batch_sharded=batch_sharded,
                       batch_offset=batch_offset)
        return out
    return make


def gen_mask_sbuf_golden(mask_out_hbm: Any, lnc: int, **kw: Any) -> dict[str, Any]:
    """``gen_mask_tkg_torch_ref[lnc]`` into a zero mask per core (``shard_id`` 0..lnc-1), stacked at
    LNC 2, as the test's torch adapter calls it (it passes the batch offset at LNC 1 only)."""
    import torch

    ref = importlib.import_module(f"{LIB}.attention.gen_mask_tkg_torch").gen_mask_tkg_torch_ref
    kw = {k.removesuffix("_hbm"): v.float() if hasattr(v, "float") else v for k, v in kw.items()}
    if lnc > 1:
        kw.pop("batch_offset", None)
    tile = tuple(mask_out_hbm.shape[-5:])
    masks = []
    for shard in range(lnc):
        mask = torch.zeros(tile, dtype=torch.float32)
        ref.shard_id = shard
        with contextlib.redirect_stdout(io.StringIO()):
            ref[lnc](mask_out=mask, **kw)
        masks.append(mask)
    return {"golden_mask": masks[0] if lnc == 1 else torch.stack(masks)}


# TestGenMaskTkg rows: batch, q_head, s_ctx, s_active, block_len, sliding window, strided_mm1, s_prior_offset,
# FA tile, lnc, active mask, batch offset, bs_full
def _sbuf_rows() -> list[tuple]:
    rows = [(b, q, s, a, 0, sw, True, off, fa, lnc, False, 0, None) for b, q, s, a, sw, off, fa, lnc in [
        (4, 1, 256, 1, 0, 0, 0, 1), (4, 1, 512, 1, 0, 0, 0, 1), (4, 1, 1024, 5, 0, 0, 0, 1),
        (4, 2, 2048, 7, 0, 0, 0, 1), (4, 1, 4096, 5, 0, 0, 0, 1), (4, 1, 1024, 5, 0, 0, 256, 1),
        (4, 1, 1024, 5, 0, 256, 256, 1),
        (4, 1, 1024, 5, 0, 512, 256, 1), (4, 1, 1024, 5, 0, 768, 256, 1), (4, 2, 16384, 7, 0, 0, 0, 2),
        (4, 1, 4096, 5, 0, 0, 0, 2), (4, 1, 4096, 5, 0, 768, 256, 2), (8, 8, 4096, 5, 0, 1536, 256, 2)]]
    rows += [(b, q, s, a, 0, sw, False, off, fa, lnc, False, 0, None) for b, q, s, a, sw, off, fa, lnc in [
        (4, 1, 256, 1, 0, 0, 0, 1), (4, 1, 512, 1, 0, 0, 0, 1), (4, 1, 1024, 5, 0, 0, 0, 1),
        (4, 1, 1024, 5, 0, 256, 256, 1), (4, 1, 4096, 5, 0, 0, 0, 2), (4, 1, 4096, 5, 0, 512, 512, 2),
        (8, 8, 4096, 5, 0, 1536, 512, 2)]]
    rows += [(b, q, s, a, bl, sw, False, off, fa, lnc, False, 0, None) for b, q, s, a, bl, sw, off, fa, lnc in [
        (4, 1, 256, 5, 16, 0, 0, 0, 1), (4, 1, 512, 5, 16, 0, 0, 0, 1), (4, 1, 1024, 5, 16, 0, 0, 0, 1),
        (4, 1, 2048, 5, 32, 0, 0, 0, 1), (4, 1, 4096, 5, 16, 0, 0, 2048, 1), (4, 1, 4096, 5, 16, 0, 2048, 2048, 1),
        (4, 1, 10240, 5, 16, 0, 8192, 2048, 1), (4, 1, 8192, 5, 16, 0, 0, 0, 2), (4, 1, 4096, 5, 16, 0, 0, 0, 2),
        (4, 1, 20480, 5, 16, 0, 8192, 2048, 2), (8, 8, 10240, 5, 16, 0, 8192, 2048, 2)]]
    rows += [(b, q, s, a, bl, sw, st, off, fa, lnc, False, 0, None) for b, q, s, a, bl, sw, st, off, fa, lnc in [
        (4, 1, 1024, 5, 0, 64, True, 0, 0, 1), (4, 1, 1024, 5, 0, 128, True, 0, 0, 1),
        (4, 1, 1024, 5, 0, 256, True, 0, 0, 1), (4, 1, 1024, 5, 0, 512, True, 0, 0, 1),
        (4, 2, 2048, 7, 0, 128, True, 0, 0, 1), (4, 1, 4096, 5, 0, 128, True, 0, 0, 2),
        (4, 2, 4096, 7, 0, 256, True, 0, 0, 2), (4, 1, 1024, 5, 0, 128, False, 0, 0, 1),
        (4, 1, 1024, 5, 0, 256, False, 0, 0, 1), (4, 1, 4096, 5, 0, 128, False, 0, 0, 2),
        (4, 1, 1024, 5, 16, 128, False, 0, 0, 1), (4, 1, 2048, 5, 16, 256, False, 0, 0, 1),
        (4, 1, 2048, 5, 32, 512, False, 0, 0, 1), (4, 1, 4096, 5, 16, 128, False, 0, 0, 2),
        (4, 1, 8192, 5, 16, 256, False, 0, 0, 2), (4, 1, 1024, 5, 0, 128, True, 0, 256, 1),
        (4, 1, 1024, 5, 0, 128, True, 512, 256, 1), (4, 1, 1024, 5, 0, 128, True, 768, 256, 1),
        (4, 1, 4096, 5, 16, 128, False, 0, 2048, 1), (4, 1, 4096, 5, 16, 128, False, 2048, 2048, 1),
        (4, 1, 4096, 5, 0, 128, True, 0, 256, 2), (4, 1, 1024, 1, 0, 128, True, 0, 0, 1),
        (4, 1, 2048, 1, 16, 256, False, 0, 0, 1), (8, 8, 4096, 5, 0, 128, True, 0, 0, 2),
        (8, 8, 4096, 5, 16, 128, False, 0, 0, 2)]]
    rows += [(b, q, s, a, 0, sw, st, off, fa, lnc, True, bo, bf) for b, q, s, a, st, sw, off, fa, lnc, bo, bf in [
        (4, 1, 256, 5, True, 0, 0, 0, 1, 0, None), (4, 2, 512, 5, True, 0, 0, 0, 1, 0, None),
        (4, 1, 256, 5, False, 0, 0, 0, 1, 0, None), (4, 2, 512, 5, False, 0, 0, 0, 1, 0, None),
        (4, 1, 256, 1, True, 0, 0, 0, 1, 0, None), (4, 1, 256, 1, False, 0, 0, 0, 1, 0, None),
        (4, 1, 1024, 5, True, 0, 768, 256, 1, 0, None), (4, 1, 1024, 5, False, 0, 768, 256, 1, 0, None),
        (4, 2, 4096, 5, True, 0, 0, 0, 2, 0, None), (80, 8, 256, 8, True, 0, 0, 256, 2, 0, None),
        (4, 1, 256, 8, True, 0, 0, 0, 1, 0, None), (4, 2, 256, 4, True, 0, 0, 0, 1, 0, None),
        (80, 8, 256, 8, True, 0, 0, 0, 1, 0, None), (4, 1, 256, 7, True, 0, 0, 0, 1, 0, None),
        (80, 8, 256, 7, True, 0, 0, 0, 1, 0, None), (4, 1, 256, 1, True, 0, 0, 0, 1, 0, None),
        (80, 8, 256, 1, True, 0, 0, 0, 1, 0, None), (80, 8, 256, 4, True, 0, 0, 256, 2, 0, None),
        (32, 8, 256, 8, True, 0, 0, 256, 2, 0, None), (80, 8, 256, 7, True, 0, 0, 256, 2, 0, None),
        (32, 8, 256, 5, True, 0, 0, 256, 2, 0, None), (80, 8, 256, 1, True, 0, 0, 256, 2, 0, None),
        (80, 8, 256, 8, False, 0, 0, 256, 2, 0, None), (32, 8, 256, 5, False, 0, 0, 256, 2, 0, None),
        (4, 2, 4096, 8, True, 0, 0, 0, 2, 0, None), (4, 1, 4096, 16, True, 0, 0, 0, 2, 0, None),
        (80, 8, 512, 8, True, 0, 256, 256, 2, 0, None), (16, 1, 4096, 8, True, 0, 0, 0, 2, 0, None),
        (26, 1, 256, 5, True, 0, 0, 256, 2, 0, None), (4, 1, 1024, 5, True, 128, 768, 256, 1, 0, None),
        (4, 2, 1024, 5, True, 256, 0, 0, 1, 0, None), (4, 1, 1024, 5, False, 128, 768, 256, 1, 0, None),
        (4, 2, 4096, 5, True, 128, 0, 0, 2, 0, None), (2, 1, 256, 5, True, 0, 0, 0, 1, 2, 4),
        (3, 2, 512, 5, True, 0, 0, 0, 1, 3, 7), (1, 1, 256, 1, True, 0, 0, 0, 1, 3, 4),
        (2, 1, 256, 5, False, 0, 0, 0, 1, 2, 4), (2, 2, 4096, 5, True, 0, 0, 0, 2, 2, 4),
        (40, 8, 256, 8, True, 0, 0, 256, 2, 40, 160), (2, 1, 1024, 5, True, 0, 768, 256, 1, 2, 4),
        (2, 2, 4096, 5, True, 0, 1792, 256, 2, 2, 4), (2, 1, 1024, 5, True, 128, 768, 256, 1, 2, 4),
        (2, 1, 1024, 5, False, 128, 768, 256, 1, 2, 4), (2, 2, 4096, 5, True, 256, 0, 0, 2, 2, 4)]]
    rows += [(b, q, s, a, bl, sw, False, off, fa, lnc, True, bo, bf) for b, q, s, a, bl, sw, off, fa, lnc, bo, bf in [
        (4, 1, 2048, 5, 16, 0, 0, 0, 1, 0, None), (4, 2, 4096, 5, 16, 0, 0, 0, 1, 0, None),
        (4, 1, 2048, 1, 16, 0, 0, 0, 1, 0, None), (4, 1, 8192, 5, 16, 0, 0, 0, 2, 0, None),
        (4, 1, 4096, 5, 16, 0, 0, 0, 2, 0, None), (64, 8, 2048, 1, 16, 0, 0, 0, 2, 0, None),
        (8, 8, 4096, 5, 16, 0, 0, 0, 2, 0, None), (4, 8, 4096, 7, 16, 0, 0, 0, 2, 0, None),
        (4, 1, 8192, 5, 16, 0, 2048, 2048, 2, 0, None), (8, 8, 8192, 5, 16, 0, 6144, 2048, 2, 0, None),
        (2, 1, 2048, 5, 16, 0, 0, 0, 1, 2, 4), (3, 2, 4096, 5, 16, 0, 0, 0, 1, 3, 7),
        (2, 1, 8192, 5, 16, 0, 0, 0, 2, 2, 4), (4, 8, 4096, 5, 16, 0, 0, 0, 2, 4, 16),
        (2, 1, 4096, 5, 16, 0, 2048, 2048, 1, 2, 4), (2, 1, 2048, 5, 16, 128, 0, 0, 1, 2, 4),
        (2, 1, 8192, 5, 16, 128, 0, 0, 2, 2, 4)]]
    return list(dict.fromkeys(rows))


def _gen_mask_sbuf_cases() -> list[Case]:
    cases = []
    for b, q, s, a, bl, sw, strided, off, fa, lnc, active, bo, bf in _sbuf_rows():
        flags = ["flat" if bl == 0 else f"block_len={bl}"] + (["strided_mm1"] if strided else []) \
            + ([f"sw={sw}"] if sw else []) + ([f"fa_tile={off}+{fa}"] if fa else []) \
            + (["active_mask"] if active else []) + ([f"batch {bo} of {bf}"] if bo or bf else [])
        cases.append(Case(
            kernel="core/attention/gen_mask_tkg", name=" ".join(flags),
            shapes=f"bs={b} q_head={q} s_prior={s} s_active={a}",
            entry=f"{LIB}.attention.gen_mask_tkg:gen_mask_tkg", wrap_kernel=_gen_mask_wrapper,
            reference=f"{HERE}:gen_mask_sbuf_golden",
            inputs=_sbuf_mask_inputs(b, q, s, a, bl, lnc, strided, off, fa, sw, active, bo, bf),
            ref_inputs=_with_lnc(lnc), outputs=("golden_mask",), lnc=lnc, rtol=0.0, atol=0.0,
            test_file=f"{TESTS}/test_gen_mask_tkg.py"))
    return cases


# -- attention_tkg (test_attention_tkg.py, test_attn_tkg_fast) ------------------------------------
def _attn_wrapper(attention_tkg: Callable[..., Any]) -> Callable[..., Any]:
    """The test's kernel is a wrapper in its module: it checks the tile parameters, opens an SBUF
    manager over the usable SBUF (less 16 KiB for the compiler), allocates the outputs (in SBUF or
    HBM as the config says), loads q and k_active into SBUF when ``qk_in_sb``, runs attention_tkg and
    copies SBUF outputs back to HBM. Written here from that description, calling the library's own
    helpers; the debug tensors (``DBG=True``) are not built (the fast rows run without them)."""
    import nki.isa as nisa  # the interpreter, inside nki_is_interpreter
    import nki.language as nl

    mod = importlib.import_module(f"{LIB}.attention.attention_tkg")
    sbuf_manager = importlib.import_module(f"{LIB}.utils.allocator").SbufManager
    logger = importlib.import_module(f"{LIB}.utils.logging").Logger

    def wrapper(q, k_active, v_active, k_prior, v_prior, mask, inv_freqs, rope_pos_ids, start_pos_ids, sink,
                active_blocks_table, attn_out_shape, k_out_shape, cfg, dtype):
        mod._compute_tile_params(cfg, mod.TileConstants.get_tile_constants(), q, k_prior, v_prior, k_active,
                                 v_active, active_blocks_table)
        sbm = sbuf_manager(0, nl.tile_size.total_available_sbuf_size - 16 * 1024, logger("SBM"))
        sbm.open_scope()

        def output(shape, in_sb):
            return sbm.alloc_stack(shape, dtype=dtype, buffer=nl.sbuf) if in_sb \
                else nl.ndarray(shape, dtype=dtype, buffer=nl.shared_hbm)

        out = output(attn_out_shape, cfg.out_in_sb)
        k_out = output(k_out_shape, cfg.k_out_in_sb) if cfg.fuse_rope else None
        if cfg.qk_in_sb:
            q_sb = sbm.alloc_stack(q.shape, dtype=q.dtype, buffer=nl.sbuf)
            k_sb = sbm.alloc_stack(k_active.shape, dtype=k_active.dtype, buffer=nl.sbuf)
            nisa.dma_copy(q_sb, q)
            nisa.dma_copy(k_sb, k_active)
            q, k_active = q_sb, k_sb
        attn_out, k_out = attention_tkg(q, k_active, v_active, k_prior, v_prior, mask, out, cfg, sbm, inv_freqs,
                                        rope_pos_ids, start_pos_ids, sink, active_blocks_table, k_out)
        results = [attn_out] + ([k_out] if cfg.fuse_rope else [])
        for i, (t, in_sb) in enumerate(zip(results, (cfg.out_in_sb, cfg.k_out_in_sb))):
            if in_sb:
                hbm = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
                nisa.dma_copy(dst=hbm, src=t)
                results[i] = hbm
        sbm.close_scope()
        return tuple(results)
    return wrapper


def _block_table(bs: int, s_prior: int, s_active: int, pos: np.ndarray, block_len: int) -> np.ndarray:
    """Distinct cache blocks per batch row (``np.random.choice`` without replacement from the global
    state), zero past the blocks that hold the row's context and active tokens."""
    n_blocks = bs * s_prior // block_len
    table = np.random.choice(n_blocks, size=bs * (s_prior // block_len), replace=False)
    table = table.reshape(bs, s_prior // block_len).astype(np.uint32)
    for b in range(bs):
        table[b, -(-(int(pos[b, 0]) + s_active) // block_len):] = 0
    return table


def _attn_inputs(cfg_args: tuple, cfg_kw: dict, dt_name: str, sink: bool, window: int, lnc: int
                 ) -> Callable[[], dict[str, Any]]:
    """The test's ``input_generator``. ``fp8_kv`` rows: dtype bf16, q drawn as the others and cast to
    fp8 e4m3; k / v active and prior from its ``np_random_sample_fp8()`` (which reseeds 0 on the same
    global generator): ``random_sample * 480 - 240`` cast to fp8 (round-to-nearest-even, ml_dtypes)."""
    def make() -> dict[str, Any]:
        import nki.language as nl
        import torch

        utils = importlib.import_module(f"{LIB}.attention.attention_tkg_utils")
        cfg = utils.AttnTKGConfig(*cfg_args, **cfg_kw)
        dt = {"bf16": nl.bfloat16, "fp32": nl.float32, "fp8_kv": nl.bfloat16}[dt_name]
        block = cfg.block_len != 0
        bsq = cfg.bs * cfg.q_head * cfg.s_active
        q_shape = (cfg.d_head, bsq) if cfg.qk_in_sb else (cfg.bs, cfg.q_head, cfg.s_active, cfg.d_head)
        k_shape = (cfg.d_head, cfg.bs * cfg.s_active) if cfg.qk_in_sb else (cfg.bs, 1, cfg.s_active, cfg.d_head)
        if block:
            k_prior_shape = v_prior_shape = (cfg.bs * cfg.curr_sprior // cfg.block_len, cfg.block_len, cfg.d_head)
        else:
            k_prior_shape = (cfg.bs, 1, cfg.full_sprior, cfg.d_head) if cfg.tp_k_prior \
                else (cfg.bs, 1, cfg.d_head, cfg.full_sprior)
            v_prior_shape = (cfg.bs, 1, cfg.full_sprior, cfg.d_head)
        pos = ((np.arange(cfg.bs) * 3 + cfg.curr_sprior // 4 * 3) % (cfg.curr_sprior - cfg.s_active))[:, None]
        np.random.seed(0)  # the test's np_random_sample(): random_sample per tensor, cast to the dtype
        draw = lambda shape, d=dt: np.random.random_sample(shape).astype(d)  # noqa: E731
        # K and V drawn a chunk at a time straight into their dtype (the same values and generator state as the
        # one-shot draw: the largest caches' float64 draw alone is 2-16 GiB; a large one lands on disk)
        kv_draw = lambda shape: drawn_array(np.random.random_sample, shape, dt, via=None)  # noqa: E731
        out = {"q": draw(q_shape)}
        if dt_name == "fp8_kv":
            out["q"] = out["q"].astype(FP8)
            kv_draw = lambda shape: drawn_array(lambda n: np.random.random_sample(n) * 480.0 - 240.0,  # noqa: E731
                                                shape, FP8, via=None)
        out.update(k_active=kv_draw(k_shape), v_active=kv_draw((cfg.bs, 1, cfg.s_active, cfg.d_head)),
                   k_prior=kv_draw(k_prior_shape), v_prior=kv_draw(v_prior_shape))
        if cfg.use_pos_id:
            mask = causal_active_mask(cfg.bs, cfg.q_head, cfg.s_active)
        else:
            full = importlib.import_module(f"{LIB}.attention.gen_mask_tkg_torch").build_full_attention_mask
            with contextlib.redirect_stdout(io.StringIO()):
                mask = full(cache_lens=torch.from_numpy(pos.flatten()).to(torch.float32), batch=cfg.bs,
                            num_heads=cfg.q_head, s_active=cfg.s_active, s_ctx=cfg.curr_sprior, lnc=lnc,
                            block_len=cfg.block_len, include_active_mask=True, transposed=True,
                            enable_fa_s_prior_tiling=cfg.enable_fa_s_prior_tiling).numpy()
        out["mask"] = mask.astype(np.bool_).astype(np.uint8)
        out["inv_freqs"] = np.random.random(size=(cfg.d_head // 2, 1)).astype(F32) if cfg.fuse_rope else None
        out["start_pos_ids"] = out["rope_pos_ids"] = None
        if cfg.fuse_rope or cfg.use_pos_id:
            rope = np.broadcast_to(pos, (cfg.bs, cfg.s_active)) + (np.arange(cfg.s_active) if window else 0)
            out["rope_pos_ids"] = np.ascontiguousarray(rope).astype(F32)
            if window:
                out["start_pos_ids"] = swa_start_positions(pos, cfg.s_active, window, cfg.curr_sprior, cfg.block_len)
        out["active_blocks_table"] = _block_table(cfg.bs, cfg.curr_sprior, cfg.s_active, pos, cfg.block_len) \
            if block else None
        out["sink"] = np.random.random_sample((cfg.q_head, 1)).astype(F32) if sink else None
        out.update(attn_out_shape=(cfg.d_head, bsq) if cfg.out_in_sb
                   else (cfg.bs, cfg.q_head, cfg.d_head, cfg.s_active),
                   k_out_shape=(cfg.d_head, cfg.bs * cfg.s_active) if cfg.k_out_in_sb
                   else (cfg.bs, 1, cfg.d_head, cfg.s_active), cfg=cfg, dtype=dt)
        return out
    return make


# The reference's float32 working set per call above which it runs on a few batch rows at a time
REF_CHUNK_BYTES = 1 << 30


def _ref_bytes_per_row(cfg: Any) -> int:
    """The float32 bytes nki-library's reference holds per batch row at its peak: its score matmul broadcasts the
    row's K over the query heads (``q_head`` copies of ``[s_prior, d]``, the probability matmul V likewise), a block
    cache is first gathered into a flat ``[full_sprior, d]`` K and V, and both caches are cloned."""
    return 4 * cfg.d_head * (2 * cfg.q_head * cfg.curr_sprior + 4 * cfg.full_sprior)


class _CacheRows:
    """A flat K or V cache ``[bs, 1, ...]`` handed to the reference as the case drew it (bf16 / fp8, a large one on
    disk) instead of the harness's float32 copy of the whole: indexing batch rows gives those rows as float32 torch
    (every bf16 / fp8 value is exact in float32, as in the harness's copy). The chunked golden (:func:`_golden_rows`)
    reads one chunk's rows at a time."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __getitem__(self, rows: Any) -> Any:
        import torch

        return torch.from_numpy(np.asarray(self.array[rows], dtype=np.float32))


def _attn_ref_inputs(lnc: int) -> Callable[[dict], dict]:
    """The reference's inputs: the case's and ``lnc``; a flat cache the reference reads a few batch rows at a time
    (:func:`_chunk_rows` below the batch at :data:`REF_CHUNK_BYTES`) as :class:`_CacheRows`, so no float32 copy of
    the whole cache is made (the largest, bs = 1,024 at S = 16,384 in fp8, would be two 8 GiB files)."""
    def ref_inputs(inputs: dict) -> dict:
        out = {**inputs, "lnc": lnc}
        cfg = inputs["cfg"]
        if not cfg.block_len and _chunk_rows(cfg, lnc, REF_CHUNK_BYTES) < cfg.bs:
            out.update(k_prior=_CacheRows(inputs["k_prior"]), v_prior=_CacheRows(inputs["v_prior"]))
        return out
    return ref_inputs


def attention_tkg_golden(lnc: int, attn_out_shape: tuple, k_out_shape: tuple, dtype: Any,
                         chunk_bytes: int = REF_CHUNK_BYTES, **kw: Any) -> dict[str, Any]:
    """``attention_tkg_torch_ref[lnc]`` into fp32 outputs, rounded to the test dtype (the test's golden). Where its
    working set (:func:`_ref_bytes_per_row` x batch) passes ``chunk_bytes``, from calls on a few batch rows at a
    time (:func:`_golden_rows`)."""
    import torch

    ref = importlib.import_module(f"{LIB}.attention.attention_tkg_torch").attention_tkg_torch_ref
    cfg = kw["cfg"]
    rows = _chunk_rows(cfg, lnc, chunk_bytes)
    if rows < cfg.bs:
        out, k_out = _golden_rows(ref[lnc], rows, attn_out_shape, k_out_shape, kw)
    else:
        kw = {k: v[:] if isinstance(v, _CacheRows) else v for k, v in kw.items()}  # (a larger chunk_bytes: whole)
        out = torch.zeros(attn_out_shape, dtype=torch.float32)
        k_out = torch.zeros(k_out_shape, dtype=torch.float32) if cfg.fuse_rope else None
        with contextlib.redirect_stdout(io.StringIO()):
            out, k_out = ref[lnc](out=out, k_out=k_out, sbm=None, DBG_TENSORS=None, **kw)
    result = {"out": out.numpy().astype(dtype)}
    if cfg.fuse_rope:
        result["k_out"] = k_out.numpy().astype(dtype)
    return result


def _chunk_rows(cfg: Any, lnc: int, chunk_bytes: int) -> int:
    """Batch rows per reference call: as many as fit ``chunk_bytes`` (at least one). A block cache's mask, when
    loaded rather than generated (``use_pos_id`` off), is laid out with the block length
    ``resize_cache_block_len_for_attention_tkg_kernel`` reduces it to, which depends on the batch through the
    kernel's batch / S_prior sharding choice: the chunk is widened until it makes the whole batch's choice."""
    rows = max(1, min(cfg.bs, chunk_bytes // _ref_bytes_per_row(cfg)))
    if rows >= cfg.bs or not cfg.block_len or cfg.use_pos_id:
        return rows
    utils = importlib.import_module(f"{LIB}.attention.attention_tkg_utils")

    def reduced(bs: int) -> tuple[int, int]:
        with contextlib.redirect_stdout(io.StringIO()):
            return utils.resize_cache_block_len_for_attention_tkg_kernel(
                cfg.curr_sprior // cfg.block_len, cfg.block_len, lnc, 128, bs, cfg.q_head, cfg.s_active,
                full_sprior=cfg.full_sprior, enable_fa_s_prior_tiling=cfg.enable_fa_s_prior_tiling)
    whole = reduced(cfg.bs)
    while rows < cfg.bs and not all(reduced(min(rows, cfg.bs - b0)) == whole for b0 in range(0, cfg.bs, rows)):
        rows += 1
    return rows


def _golden_rows(ref: Callable[..., Any], rows: int, attn_out_shape: tuple, k_out_shape: tuple,
                 kw: dict[str, Any]) -> tuple[Any, Any]:
    """The reference's ``(out, k_out)`` for the whole batch from one call per ``rows`` batch rows. Every step of
    it works on each batch row alone (the row's Q and active K / V, its cache or the blocks its table names, its
    mask slice or the mask built from its position ids, RoPE at its positions; the sink and RoPE frequencies are
    per head), so a call on rows ``b0:b1`` takes those rows of every batched input (a block cache whole: the
    chunk's table rows pick its blocks) and a config with ``bs = b1 - b0``; the outputs are put together along
    their batch axis (the SBUF layouts' columns are batch-major)."""
    import torch

    cfg = kw["cfg"]
    sa, qh = cfg.s_active, cfg.q_head
    out = torch.zeros(attn_out_shape, dtype=torch.float32)
    k_out = torch.zeros(k_out_shape, dtype=torch.float32) if cfg.fuse_rope else None

    def part(t: Any, b0: int, b1: int, columns: int, in_sb: bool) -> Any:
        """Rows b0:b1 of a batched tensor: ``columns`` columns per row of an SBUF layout, else its first axis."""
        return t[:, b0 * columns:b1 * columns] if in_sb else t[b0:b1]

    for b0 in range(0, cfg.bs, rows):
        b1 = min(cfg.bs, b0 + rows)
        sub_cfg = copy.copy(cfg)
        sub_cfg.bs = b1 - b0
        sub = {**kw, "cfg": sub_cfg,
               "q": part(kw["q"], b0, b1, qh * sa, cfg.qk_in_sb), "k_active": part(kw["k_active"], b0, b1, sa,
                                                                                     cfg.qk_in_sb),
               "v_active": kw["v_active"][b0:b1], "mask": kw["mask"][:, b0:b1]}
        for name in ("rope_pos_ids", "start_pos_ids"):
            if kw.get(name) is not None:
                sub[name] = kw[name][b0:b1]
        if kw.get("active_blocks_table") is not None:
            sub["active_blocks_table"] = kw["active_blocks_table"][b0:b1]
        else:
            sub["k_prior"], sub["v_prior"] = kw["k_prior"][b0:b1], kw["v_prior"][b0:b1]
        o = torch.zeros(part(out, b0, b1, qh * sa, cfg.out_in_sb).shape, dtype=torch.float32)
        ko = torch.zeros(part(k_out, b0, b1, sa, cfg.k_out_in_sb).shape, dtype=torch.float32) \
            if cfg.fuse_rope else None
        with contextlib.redirect_stdout(io.StringIO()):
            o, ko = ref(out=o, k_out=ko, sbm=None, DBG_TENSORS=None, **sub)
        part(out, b0, b1, qh * sa, cfg.out_in_sb).copy_(o)
        if cfg.fuse_rope:
            part(k_out, b0, b1, sa, cfg.k_out_in_sb).copy_(ko)
        del sub, o, ko
    return out, k_out


_T = dict(tp_k_prior=True)
_ROPE = dict(use_pos_id=True, fuse_rope=True)
_SB = dict(qk_in_sb=True, k_out_in_sb=True, out_in_sb=True)
_BLOCK = dict(tp_k_prior=True, strided_mm1=False, **_SB)
# attention_tkg_fast_configs: (AttnTKGConfig args, kwargs, dtype, sink, sliding window); "fp8_kv": bf16 with
# fp8 q, k and v (the test's AttnTKGTestParams(fp8_kv=True))
_ATTN_ROWS: list[tuple[tuple, dict, str, bool, int]] = [
    *[((4, 1, 5, s, 10240, 128, 0), {**_T, **_ROPE}, "bf16", False, 0)
      for s in (1024, 1536, 3072, 4608, 7168, 8704, 10240)],
    *[((4, 1, 5, s, 24576, 128, 0), {**_T, **_ROPE}, "bf16", False, 0) for s in (14336, 18432, 22528, 24576)],
    ((4, 1, 5, 16384, 16384, 128, 0), {**_T, **_ROPE}, "bf16", False, 0),
    ((4, 2, 7, 16384, 16384, 128, 0), {**_T, **_ROPE}, "bf16", False, 0),
    *[((4, 2, 7, s, 16384, 128, 0), {**_T, **_ROPE}, "bf16", False, 0) for s in (256, 512, 1024, 2048, 4096)],
    ((4, 2, 7, 512, 16384, 64, 0), {**_T, **_ROPE}, "bf16", False, 0),
    ((4, 3, 7, 16384, 16384, 64, 0), {**_T, **_ROPE}, "bf16", False, 0),
    ((4, 1, 5, 10240, 10240, 64, 0), {**_T, **_ROPE}, "bf16", False, 0),
    ((4, 1, 5, 18432, 24576, 64, 0), {**_T, **_ROPE}, "bf16", False, 0),
    *[((4, 1, 5, s, 10240, 128, 0), _ROPE, "bf16", False, 0) for s in (1024, 1536, 3072, 4608, 7168, 8704, 10240)],
    *[((4, 1, 5, s, 24576, 128, 0), _ROPE, "bf16", False, 0) for s in (14336, 18432, 22528, 24576)],
    ((4, 1, 5, 16384, 16384, 128, 0), _ROPE, "bf16", False, 0),
    ((4, 2, 7, 16384, 16384, 128, 0), _ROPE, "bf16", False, 0),
    *[((4, 2, 7, s, 16384, 128, 0), _ROPE, "bf16", False, 0) for s in (256, 512, 1024, 2048, 4096)],
    ((4, 2, 7, 512, 16384, 64, 0), _ROPE, "bf16", False, 0),
    ((4, 3, 7, 16384, 16384, 64, 0), _ROPE, "bf16", False, 0),
    ((4, 1, 5, 10240, 10240, 64, 0), _ROPE, "bf16", False, 0),
    ((4, 1, 5, 18432, 24576, 64, 0), _ROPE, "bf16", False, 0),
    # input / output in SBUF
    ((4, 1, 5, 10240, 10240, 128, 0), dict(qk_in_sb=True), "bf16", False, 0),
    ((4, 1, 5, 10240, 10240, 128, 0), dict(**_ROPE, qk_in_sb=True), "bf16", False, 0),
    ((4, 1, 5, 10240, 10240, 128, 0), _SB, "bf16", False, 0),
    ((4, 1, 5, 10240, 10240, 128, 0), dict(use_pos_id=True, **_SB), "bf16", False, 0),
    ((4, 1, 5, 10240, 10240, 128, 0), dict(fuse_rope=True, **_SB), "bf16", False, 0),
    # sink (bf16, fp32)
    *[(cfg, {**_T, **_ROPE}, dt, True, 0) for dt in ("bf16", "fp32")
      for cfg in ((8, 8, 1, 1024, 10240, 64, 0), (128, 1, 1, 1024, 10240, 64, 0), (4, 4, 5, 1024, 10240, 64, 0))],
    # LNC-shard on batch
    ((8, 4, 4, 128, 256, 64, 0), {**_T, **_SB}, "bf16", True, 0),
    ((32, 8, 1, 128, 256, 64, 0), {**_T, **_SB}, "bf16", True, 0),
    ((128, 1, 1, 128, 256, 64, 0), dict(qk_in_sb=True), "bf16", True, 0),
    ((1, 1, 1, 128, 256, 64, 0), {**_T, **_SB}, "bf16", False, 0),
    ((16, 8, 1, 8192, 8192, 64, 0), _SB, "bf16", False, 0),
    ((4, 8, 7, 3072, 10240, 64, 0), {**_T, **_SB}, "bf16", True, 0),
    ((4, 8, 7, 128, 10240, 64, 0), {**_T, **_SB}, "bf16", True, 0),
    ((64, 8, 1, 2048, 2048, 128, 0), _SB, "bf16", False, 0),
    # block KV
    ((4, 1, 5, 8192, 8192, 128, 16), _BLOCK, "bf16", True, 0),
    ((4, 1, 5, 10240, 10240, 128, 16), _BLOCK, "bf16", True, 0),
    ((4, 8, 7, 4096, 10240, 64, 16), _BLOCK, "bf16", True, 0),
    ((4, 8, 7, 3072, 10240, 64, 16), _BLOCK, "bf16", True, 0),
    ((64, 8, 1, 2048, 2048, 128, 16), _BLOCK, "bf16", False, 0),
    ((4, 1, 5, 12288, 12288, 128, 16), _BLOCK, "bf16", True, 0),
    ((4, 1, 5, 12288, 12288, 128, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 128),
    ((8, 8, 5, 12288, 12288, 64, 16), _BLOCK, "bf16", True, 0),
    # block KV with the mask generated in the kernel (use_pos_id)
    ((4, 1, 5, 8192, 8192, 128, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 0),
    ((4, 1, 5, 10240, 10240, 128, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 0),
    ((4, 8, 7, 4096, 10240, 64, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 0),
    ((4, 8, 7, 3072, 10240, 64, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 0),
    ((64, 8, 1, 2048, 2048, 128, 16), dict(use_pos_id=True, **_BLOCK), "bf16", False, 0),
    ((4, 1, 5, 12288, 12288, 128, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 0),
    # fp8 KV cache (fuse_rope off, q / k in SBUF), flat and block
    *[(args, dict(strided_mm1=False, **layout, **kw), "fp8_kv", False, 0) for layout in ({}, _T)
      for args, kw in (((4, 1, 5, 1024, 10240, 128, 0), dict(qk_in_sb=True)),
                       ((4, 1, 5, 8192, 8192, 128, 0), dict(qk_in_sb=True)), ((4, 2, 7, 4096, 16384, 128, 0), _SB))],
    ((4, 1, 5, 8192, 8192, 128, 16), _BLOCK, "fp8_kv", False, 0),
    ((4, 8, 7, 4096, 10240, 64, 16), _BLOCK, "fp8_kv", False, 0),
    ((1, 2, 5, 26624, 36896, 128, 32), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True,
                                            enable_fa_s_prior_tiling=False), "fp8_kv", False, 0),
    ((128, 1, 1, 2048, 2048, 128, 16), _BLOCK, "fp8_kv", False, 0),
    # strided_mm1 off
    ((4, 1, 5, 1024, 10240, 128, 0), dict(tp_k_prior=True, strided_mm1=False, **_ROPE), "bf16", False, 0),
    ((4, 1, 5, 1536, 10240, 128, 0), dict(tp_k_prior=True, strided_mm1=False, **_ROPE), "bf16", False, 0),
    ((4, 10, 5, 5376, 5376, 64, 0), dict(strided_mm1=False, qk_in_sb=True), "bf16", False, 0),
    # s_prior sharding with B * q_head * s_active > 128
    ((5, 7, 7, 24576, 24576, 64, 0), dict(use_pos_id=True, qk_in_sb=True), "bf16", True, 0),
    # sliding window
    ((4, 1, 5, 1024, 10240, 128, 0), {**_T, **_ROPE}, "bf16", False, 128),
    ((4, 1, 5, 1024, 10240, 128, 0), {**_T, **_ROPE}, "bf16", False, 256),
    ((4, 2, 7, 2048, 16384, 128, 0), {**_T, **_ROPE}, "bf16", False, 512),
    ((4, 1, 5, 4096, 16384, 128, 0), {**_T, **_ROPE}, "bf16", False, 128),
    ((4, 1, 5, 1024, 10240, 128, 0), dict(tp_k_prior=True, strided_mm1=False, **_ROPE), "bf16", False, 128),
    ((4, 2, 7, 2048, 16384, 128, 0), dict(tp_k_prior=True, strided_mm1=False, **_ROPE), "bf16", False, 256),
    ((4, 1, 5, 8192, 8192, 128, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 128),
    ((4, 1, 5, 8192, 8192, 128, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 256),
    ((4, 8, 7, 4096, 10240, 64, 16), dict(use_pos_id=True, **_BLOCK), "bf16", True, 128),
    ((4, 1, 5, 1024, 10240, 128, 0), {**_T, **_ROPE}, "bf16", True, 128),
    ((4, 1, 5, 1024, 10240, 128, 0), dict(strided_mm1=False, use_pos_id=True, qk_in_sb=True), "fp8_kv", False, 128),
    ((4, 1, 5, 8192, 8192, 128, 16), dict(use_pos_id=True, **_BLOCK), "fp8_kv", False, 128),
    ((4, 2, 7, 1024, 16384, 64, 0), {**_T, **_ROPE}, "bf16", False, 128),
    ((4, 8, 7, 3072, 10240, 64, 0), dict(tp_k_prior=True, use_pos_id=True, qk_in_sb=True, k_out_in_sb=True,
                                          out_in_sb=True), "bf16", True, 256),
    ((4, 1, 5, 10240, 10240, 128, 0), {**_T, **_ROPE}, "bf16", False, 256),
    ((4, 1, 5, 10240, 10240, 128, 16), dict(use_pos_id=True, **_BLOCK), "bf16", False, 256),
]
# attention_tkg_slow_configs (test_attn_tkg_slow: CompilerArgs(), LNC 2 on trn2), all 44 rows, in the same form;
# S_prior up to 524,288, batch x q heads x s_active up to 4,096
_ATTN_SLOW_ROWS: list[tuple[tuple, dict, str, bool, int]] = [
    ((4, 1, 5, 16640, 16640, 128, 0), dict(use_pos_id=True, fuse_rope=True), "bf16", False, 0),
    ((4, 1, 5, 20480, 20480, 128, 0), dict(strided_mm1=False, use_pos_id=True, fuse_rope=True), "bf16", False, 0),
    ((4, 1, 5, 20480, 20480, 128, 0), dict(use_pos_id=True, fuse_rope=True), "bf16", False, 0),
    ((4, 1, 5, 82432, 82432, 128, 0), dict(use_pos_id=True, fuse_rope=True), "bf16", True, 0),
    ((4, 1, 5, 82432, 82432, 128, 0), dict(use_pos_id=True, fuse_rope=True), "bf16", False, 0),
    ((4, 1, 5, 82432, 82432, 128, 0), dict(use_pos_id=True, qk_in_sb=True), "fp8_kv", False, 0),
    ((4, 1, 5, 262144, 262144, 128, 0), dict(tp_k_prior=True, qk_in_sb=True), "fp8_kv", False, 0),
    ((8, 8, 5, 16384, 16384, 128, 0), dict(strided_mm1=False, qk_in_sb=True, k_out_in_sb=True, out_in_sb=True),
     "bf16", False, 0),
    ((8, 8, 5, 16384, 16384, 128, 0), dict(qk_in_sb=True, k_out_in_sb=True, out_in_sb=True), "fp8_kv", False, 0),
    ((8, 8, 5, 16640, 16640, 128, 0), dict(strided_mm1=False, qk_in_sb=True, k_out_in_sb=True, out_in_sb=True),
     "bf16", False, 0),
    ((8, 8, 5, 82432, 82432, 128, 0), dict(qk_in_sb=True, k_out_in_sb=True, out_in_sb=True), "bf16", False, 0),
    ((8, 8, 5, 82432, 82432, 128, 0), dict(qk_in_sb=True, k_out_in_sb=True, out_in_sb=True), "bf16", True, 0),
    ((8, 8, 5, 262144, 262144, 128, 0), dict(tp_k_prior=True, use_pos_id=True, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", False, 0),
    ((4, 1, 5, 16640, 16640, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", True, 0),
    ((4, 1, 5, 20480, 20480, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", True, 0),
    ((4, 1, 5, 82432, 82432, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True), "bf16", True, 0),
    ((4, 1, 5, 82432, 82432, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "fp8_kv", True, 0),
    ((4, 1, 5, 82432, 82432, 128, 16), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, fuse_rope=True,
     qk_in_sb=True, k_out_in_sb=True, out_in_sb=True), "bf16", True, 0),
    ((4, 1, 5, 524288, 524288, 128, 16), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, qk_in_sb=True,
     k_out_in_sb=True, out_in_sb=True), "fp8_kv", True, 0),
    ((8, 8, 5, 16640, 16640, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "fp8_kv", True, 0),
    ((8, 8, 5, 20480, 20480, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", True, 0),
    ((8, 8, 5, 82432, 82432, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "fp8_kv", True, 0),
    ((8, 8, 5, 82432, 82432, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", True, 0),
    ((8, 8, 5, 262144, 262144, 128, 16), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, qk_in_sb=True,
     k_out_in_sb=True, out_in_sb=True), "bf16", True, 0),
    ((4, 8, 7, 102400, 131072, 64, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", True, 0),
    ((4, 8, 7, 128, 131072, 64, 0), dict(tp_k_prior=True, qk_in_sb=True, k_out_in_sb=True, out_in_sb=True), "bf16",
     True, 0),
    ((4, 2, 7, 102400, 131072, 128, 0), dict(tp_k_prior=True, use_pos_id=True, fuse_rope=True), "bf16", False, 0),
    ((128, 4, 1, 8192, 8192, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "fp8_kv", False, 0),
    ((1024, 4, 1, 8192, 16384, 64, 16), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, qk_in_sb=True,
     k_out_in_sb=True, out_in_sb=True), "fp8_kv", False, 0),
    ((4, 128, 2, 8192, 8192, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", True, 0),
    ((7, 128, 2, 8448, 8448, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True), "fp8_kv", False, 0),
    ((3, 59, 7, 4096, 4096, 64, 16), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, qk_in_sb=True,
     k_out_in_sb=True, out_in_sb=True), "bf16", True, 0),
    ((256, 4, 1, 16640, 16640, 128, 16), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", True, 0),
    ((128, 4, 1, 8192, 8192, 64, 0), dict(tp_k_prior=True, qk_in_sb=True, k_out_in_sb=True, out_in_sb=True),
     "fp8_kv", False, 0),
    ((1024, 4, 1, 8192, 16384, 128, 0), dict(strided_mm1=False, use_pos_id=True, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "fp8_kv", False, 0),
    ((4, 128, 2, 8192, 8192, 128, 0), dict(tp_k_prior=True, qk_in_sb=True, k_out_in_sb=True, out_in_sb=True),
     "bf16", True, 0),
    ((7, 128, 2, 8448, 8448, 128, 0), dict(strided_mm1=False, qk_in_sb=True), "fp8_kv", False, 0),
    ((3, 59, 7, 4096, 4096, 128, 0), dict(use_pos_id=True, qk_in_sb=True, k_out_in_sb=True, out_in_sb=True), "bf16",
     True, 0),
    ((256, 4, 1, 16640, 16640, 64, 0), dict(tp_k_prior=True, strided_mm1=False, qk_in_sb=True, k_out_in_sb=True,
     out_in_sb=True), "bf16", True, 0),
    ((128, 4, 1, 8192, 8192, 128, 16), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, qk_in_sb=True,
     k_out_in_sb=True, out_in_sb=True), "bf16", False, 128),
    ((4, 128, 2, 8192, 8192, 128, 0), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, qk_in_sb=True,
     k_out_in_sb=True, out_in_sb=True), "bf16", False, 256),
    ((7, 128, 2, 8448, 8448, 128, 16), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, qk_in_sb=True),
     "fp8_kv", False, 128),
    ((3, 59, 7, 4096, 4096, 128, 0), dict(use_pos_id=True, qk_in_sb=True, k_out_in_sb=True, out_in_sb=True), "bf16",
     True, 256),
    ((256, 4, 1, 16640, 16640, 128, 16), dict(tp_k_prior=True, strided_mm1=False, use_pos_id=True, qk_in_sb=True,
     k_out_in_sb=True, out_in_sb=True), "bf16", True, 128),
]
_FLAG_NAMES = ("tp_k_prior", "use_pos_id", "fuse_rope", "qk_in_sb", "k_out_in_sb", "out_in_sb")


def _attn_cases() -> list[Case]:
    cases = []
    fast = {repr(row) for row in _ATTN_ROWS}
    slow = [(row, (2,)) for row in _ATTN_SLOW_ROWS if repr(row) not in fast]  # a slow row the fast table has too
    for (args, kw, dt, sink, window), lncs in [(row, (1, 2)) for row in _ATTN_ROWS] + slow:
        bs, qh, sa, sp, spf, d, bl = args
        flags = [dt] + [f for f in _FLAG_NAMES if kw.get(f)] + ([] if kw.get("strided_mm1", True) else
                                                                ["no_strided_mm1"]) \
            + (["sink"] if sink else []) + ([f"sw={window}"] if window else []) \
            + ([] if kw.get("enable_fa_s_prior_tiling", True) else ["no_fa_tiling"])
        for lnc in lncs:
            cases.append(Case(
                kernel="core/attention/attention_tkg", name=" ".join(flags),
                shapes=f"bs={bs} q_head={qh} s_active={sa} s_prior={sp}/{spf} d={d} block_len={bl}",
                entry=f"{LIB}.attention.attention_tkg:attention_tkg", wrap_kernel=_attn_wrapper,
                reference=f"{HERE}:attention_tkg_golden", inputs=_attn_inputs(args, kw, dt, sink, window, lnc),
                ref_inputs=_attn_ref_inputs(lnc), outputs=("out", "k_out") if kw.get("fuse_rope") else ("out",),
                lnc=lnc, rtol=3e-2 if dt == "fp8_kv" else 1e-2, atol=3e-2 if dt == "fp8_kv" else 1e-5,
                note="fp8 casts taken as round-to-nearest-even (ml_dtypes)" if dt == "fp8_kv" else "",
                test_file=f"{TESTS}/test_attention_tkg.py"))
    return cases


def attention_tkg_cases() -> list[Case]:
    return _gen_mask_hbm_cases() + _gen_mask_sbuf_cases() + _attn_cases()
