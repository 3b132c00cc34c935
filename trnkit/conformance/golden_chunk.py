"""The batch chunk in which an ``attention_block_tkg`` case's reference runs: one home for the rule, which
``cases_transformer`` uses to run the reference and ``reduce`` to estimate a row's peak memory
(:func:`trnkit.conformance.reduce.estimate_peak_gb`). It imports nothing of the conformance package, so both
import it at module level.

A reference of a large KV cache runs a slice of the batch rows at a time; the kernel's mask layout depends on its
batch / S_prior sharding choice (nki-library's ``is_s_prior_sharded(bs, q_head, s_active, curr_sprior, p_max)``,
``core/attention/attention_tkg_utils.py``), so every chunk must make the whole batch's choice. The predicate is an
argument: ``cases_transformer`` passes nki-library's own (under the interpreter's modules), ``reduce`` its reading
of it (``reduce._lnc_sharding``)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["GOLDEN_BATCH_CHUNK", "block_golden_chunk", "kvdp_golden_chunk"]

# Batch rows the reference of a single-rank row with a block KV cache of more than 1 GiB (the test's three
# B = 255 rows at S_ctx = 10,240 to 32,768) takes at once (_golden_in_batch_chunks): its float32 gathers,
# clones and head-broadcast K would take 10 GB and more for the whole batch. 17 divides 255 and keeps every
# chunk odd, so the kernel's sharding choice (and so the mask layout) is the whole batch's. Other batches widen
# it where it does not (block_golden_chunk).
GOLDEN_BATCH_CHUNK = 17


def kvdp_golden_chunk(b: int, b_rank: int, q: int, s_tkg: int, s_ctx: int, d: int,
                      sharded: Callable[..., bool]) -> int:
    """Batch rows a KV-data-parallel rank's reference takes at once (0: the whole batch): for caches of more
    than 256 MiB, the largest divisor of the rank's batch rows whose float32 K cache slice is at most 256 MiB
    and with which every chunk keeps the kernel's batch / S_prior sharding choice (``sharded``, the
    ``is_s_prior_sharded`` predicate) of the whole batch, on which the mask layout depends; 0 when none does."""
    if 2 * b * s_ctx * d < 256 << 20:
        return 0
    target = max(1, (256 << 20) // (s_ctx * d * 4))
    for c in range(min(target, b_rank), 0, -1):
        if b_rank % c == 0 and sharded(c, q, s_tkg, s_ctx, 128) == sharded(b, q, s_tkg, s_ctx, 128):
            return c
    return 0


def block_golden_chunk(b: int, q: int, s_tkg: int, s_ctx: int, sharded: Callable[..., bool]) -> int:
    """The batch chunk of a single-rank block-cache row's reference (:data:`GOLDEN_BATCH_CHUNK` widened): the
    smallest chunk of at least 17 rows with which every chunk, the last partial one included, makes the kernel's
    batch / S_prior sharding choice (``sharded``, the ``is_s_prior_sharded`` predicate, on which the mask layout
    depends) the whole batch's; 0 (the whole batch at once) when none below ``b`` does. A batch-sharded batch (even,
    more than 128 query rows) needs even chunks of more than ``128 / (q * S_tkg)`` rows and an even last chunk as
    large: B = 256 at 4 q heads takes 44 (5 x 44 + 36; 34 would leave 18: 72 query rows), as confrun7 widened
    attention_tkg's chunk."""
    whole = sharded(b, q, s_tkg, s_ctx, 128)
    for c in range(GOLDEN_BATCH_CHUNK, b):
        if all(sharded(n, q, s_tkg, s_ctx, 128) == whole for n in {c, b % c} if n):
            return c
    return 0
