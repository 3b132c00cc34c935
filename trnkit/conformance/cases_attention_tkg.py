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
import importlib
import io
from collections.abc import Callable
from typing import Any

import numpy as np

from .harness import Case

__all__ = ["attention_tkg_cases", "gen_mask_hbm_golden", "causal_active_mask", "swa_start_positions"]

F32 = np.dtype(np.float32)
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


def attention_tkg_cases() -> list[Case]:
    return _gen_mask_hbm_cases()
