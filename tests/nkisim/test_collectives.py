"""nki.collectives on a multi-rank run (collectives.run_ranks), against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from trnkit import nkisim as nki
from trnkit.nkisim import collectives as ncc
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim.errors import NkiValidationError


def _x(rank: int, rows: int = 4, cols: int = 8) -> np.ndarray:
    return (np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 100 * rank)


@nki.jit
def gather_hbm(x, groups):
    out = nl.ndarray((x.shape[0] * len(groups[0]), x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    ncc.all_gather(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), collective_dim=0)
    return out


@nki.jit
def gather_sbuf_columns(x, n):
    """topk_reduce's form: 2-D SBUF tiles gathered along the free dim."""
    rows, cols = x.shape
    t = nl.ndarray((rows, cols), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    g = nl.ndarray((rows, cols * n), x.dtype, buffer=nl.sbuf)
    ncc.all_gather(srcs=[t], dsts=[g], replica_group=ncc.ReplicaGroup([list(range(n))]), collective_dim=1)
    out = nl.ndarray((rows, cols * n), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=g)
    return out


@nki.jit
def ring(x, n):
    """Ring all-gather by n-1 implicit permutes (fgcc's pattern): each step stores the chunk it holds at
    its processing rank's slot, addressed by the rank register (``.ap(scalar_offset=...)``)."""
    rows, cols = x.shape
    rg = ncc.ReplicaGroup([list(range(n))])
    out = nl.ndarray((n * rows, cols), x.dtype, buffer=nl.shared_hbm)
    slots = out.reshape((n, rows * cols))
    cur = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=cur, src=x)
    for it in range(n):
        who = ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=it, replica_group=rg)
        nisa.dma_copy(dst=slots.ap([[cols, rows], [1, cols]], offset=0, scalar_offset=who, indirect_dim=0),
                      src=cur)
        if it < n - 1:
            nxt = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
            ncc.collective_permute_implicit(srcs_by_channel=[[cur]], dsts_by_channel=[[nxt]], replica_group=rg)
            cur = nxt
    return out


@nki.jit
def reduce_and_rank(x, groups):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    ncc.all_reduce(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), op=nl.add)
    r = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.register_store(dst=r, src=ncc.rank_id())
    rank = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=rank, src=r)
    return out, rank


@pytest.mark.parametrize("lnc", [1, 2])
def test_all_gather_hbm_in_two_rank_lists(lnc):
    groups = ((0, 1, 2, 3), (4, 5, 6, 7))  # a tuple: list kernel arguments are refused (NKI 0.3.0)
    outs = ncc.run_ranks(gather_hbm, 8, lambda r: {"x": _x(r), "groups": groups}, grid=lnc)
    for r, out in enumerate(outs):
        base = 0 if r < 4 else 4
        np.testing.assert_array_equal(out, np.concatenate([_x(base + i) for i in range(4)]))


def test_all_gather_sbuf_along_the_free_dim():
    outs = ncc.run_ranks(gather_sbuf_columns, 4, lambda r: {"x": _x(r), "n": 4})
    for out in outs:
        np.testing.assert_array_equal(out, np.concatenate([_x(i) for i in range(4)], axis=1))


def test_ring_permute_and_processing_rank_id():
    outs = ncc.run_ranks(ring, 4, lambda r: {"x": _x(r), "n": 4})
    for out in outs:
        np.testing.assert_array_equal(out, np.concatenate([_x(i) for i in range(4)]))


def test_all_reduce_and_rank_id_and_partition_op():
    groups = ncc.ReplicaGroup.from_partition_op(4, ncc.rg_partition_op.mod, 2).replica_groups
    assert groups == [[0, 2], [1, 3]]
    div_groups = ncc.ReplicaGroup.from_partition_op(8, ncc.rg_partition_op.div, 4).replica_groups
    assert div_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    outs = ncc.run_ranks(reduce_and_rank, 4, lambda r: {"x": _x(r), "groups": tuple(map(tuple, groups))})
    for r, (out, rank) in enumerate(outs):
        np.testing.assert_array_equal(out, _x(r % 2) + _x(r % 2 + 2))
        assert int(rank[0, 0]) == r


def test_invalid_collectives_raise():
    with pytest.raises(NkiValidationError, match="all_gather: a collective needs peer devices"):
        gather_hbm(_x(0), ((0,),))
    with pytest.raises(NkiValidationError, match="collective_dim must be 0 for HBM tensors, got 1"):
        @nki.jit
        def bad_dim(x):
            out = nl.ndarray((4, 16), x.dtype, buffer=nl.shared_hbm)
            ncc.all_gather(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=1)
            return out
        ncc.run_ranks(bad_dim, 2, lambda r: {"x": _x(r)})
    with pytest.raises(NkiValidationError, match=r"dst 'out' has shape \(4, 8\), the result is \(8, 8\)"):
        @nki.jit
        def small_dst(x):
            out = nl.ndarray((4, 8), x.dtype, buffer=nl.shared_hbm, name="out")
            ncc.all_gather(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=0)
            return out
        ncc.run_ranks(small_dst, 2, lambda r: {"x": _x(r)})
    with pytest.raises(NkiValidationError, match="more than one rank-list"):
        ncc.run_ranks(gather_hbm, 2, lambda r: {"x": _x(r), "groups": ((0, 1), (1,))})


@nki.jit
def scatter_sums(x, groups, dim=0):
    """AWS's test_collectives reduce_scatter form: dst rows = src rows / ranks of the rank-list."""
    n = len(groups[0])
    out = nl.ndarray((x.shape[0] // n, x.shape[1]), x.dtype, buffer=nl.shared_hbm, name="out")
    ncc.reduce_scatter(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), collective_dim=dim, op=nl.add)
    return out


@nki.jit
def scatter_max_sbuf(x, n):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    r = nl.ndarray((x.shape[0] // n, x.shape[1]), x.dtype, buffer=nl.sbuf)
    ncc.reduce_scatter(srcs=[t], dsts=[r], replica_group=ncc.ReplicaGroup([list(range(n))]), collective_dim=0,
                       op=nl.maximum)
    out = nl.ndarray(r.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=r)
    return out


@nki.jit
def exchange(x, groups):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    ncc.all_to_all(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), collective_dim=0)
    return out


@pytest.mark.parametrize("lnc", [1, 2])
def test_reduce_scatter_sums_and_hands_out_chunk_by_rank_list_position(lnc):
    groups = ((0, 2), (1, 3))  # rank 2 is position 1 of its rank-list: it gets the second chunk
    outs = ncc.run_ranks(scatter_sums, 4, lambda r: {"x": _x(r), "groups": groups}, grid=lnc)
    for r, out in enumerate(outs):
        total = _x(r % 2) + _x(r % 2 + 2)
        np.testing.assert_array_equal(out, total[:2] if r < 2 else total[2:])


def test_reduce_scatter_in_sbuf_with_maximum():
    outs = ncc.run_ranks(scatter_max_sbuf, 2, lambda r: {"x": _x(1 - r) * (1 if r else -1), "n": 2})
    both = np.maximum(-_x(1), _x(0))
    np.testing.assert_array_equal(outs[0], both[:2])
    np.testing.assert_array_equal(outs[1], both[2:])


@pytest.mark.parametrize("lnc", [1, 2])
def test_all_to_all_sends_chunk_i_to_rank_i(lnc):
    outs = ncc.run_ranks(exchange, 4, lambda r: {"x": _x(r), "groups": ((0, 1, 2, 3),)}, grid=lnc)
    for r, out in enumerate(outs):  # 4 rows over 4 ranks: rank r gets row r of every rank
        np.testing.assert_array_equal(out, np.stack([_x(p)[r] for p in range(4)]))


def test_invalid_reduce_scatter_and_all_to_all_raise():
    # API reference: reduce_scatter / all_to_all "collective_dim ... Currently only 0 is supported"
    with pytest.raises(NkiValidationError, match=r"reduce_scatter: collective_dim must be 0 .* got 1"):
        ncc.run_ranks(scatter_sums, 2, lambda r: {"x": _x(r), "groups": ((0, 1),), "dim": 1})
    with pytest.raises(NkiValidationError, match=r"reduce_scatter: src .* has 3 rows along collective_dim 0, "
                       r"not a multiple of the 2 ranks"):
        ncc.run_ranks(scatter_sums, 2, lambda r: {"x": _x(r, rows=3), "groups": ((0, 1),)})

    # API reference, all_to_all: "Tensors must reside on HBM. SBUF is not currently supported"
    @nki.jit
    def exchange_sbuf(x):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        ncc.all_to_all(srcs=[t], dsts=[t], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=0)
        return x
    with pytest.raises(NkiValidationError, match=r"all_to_all: tensors must be in HBM \(SBUF is not supported\)"):
        ncc.run_ranks(exchange_sbuf, 2, lambda r: {"x": _x(r)})
    with pytest.raises(NkiValidationError, match="reduce_scatter: op must be nl.add, nl.maximum or nl.minimum"):
        @nki.jit
        def scatter_mul(x):
            out = nl.ndarray((2, 8), x.dtype, buffer=nl.shared_hbm)
            ncc.reduce_scatter(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=0,
                               op=nl.multiply)
            return out
        ncc.run_ranks(scatter_mul, 2, lambda r: {"x": _x(r)})


@nki.jit
def _reduce_with(x, groups, priority=None):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    ncc.all_reduce(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), op=nl.add, priority=priority)
    return out


@nki.jit
def _permute_on(x, channel_ids, priority=None):
    rg = ncc.ReplicaGroup([[0, 1]])
    halves = (x[0:2, :], x[2:4, :])
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    ncc.collective_permute_implicit(srcs_by_channel=[[h] for h in halves[:len(channel_ids)]],
                                    dsts_by_channel=[[out[2 * i:2 * i + 2, :]] for i in range(len(channel_ids))],
                                    replica_group=rg, channel_ids=list(channel_ids), priority=priority)
    return out


def test_collective_priority_and_implicit_permute_channel_ids():
    """nki.collectives API reference: every collective's "priority: DMA quality-of-service priority level 0-3
    ... (NeuronCore-v4+ only)" (the interpreter is trn2), and collective_permute_implicit's "channel_ids: ...
    Currently must be consecutive integers starting from 0". Before, both were accepted (and priority= of the
    implicit permutes was a TypeError)."""
    np.testing.assert_array_equal(ncc.run_ranks(_reduce_with, 2, lambda r: {"x": _x(r), "groups": ((0, 1),)})[0],
                                  _x(0) + _x(1))
    with pytest.raises(NkiValidationError, match=r"all_reduce: priority=1 is NeuronCore-v4\+ only"):
        ncc.run_ranks(_reduce_with, 2, lambda r: {"x": _x(r), "groups": ((0, 1),), "priority": 1})
    two = ncc.run_ranks(_permute_on, 2, lambda r: {"x": _x(r), "channel_ids": (0, 1)})
    np.testing.assert_array_equal(two[0], _x(1))  # each rank receives its predecessor's chunks, per channel
    with pytest.raises(NkiValidationError, match=r"collective_permute_implicit: channel_ids \[1\] must be "
                       r"consecutive integers starting from 0"):
        ncc.run_ranks(_permute_on, 2, lambda r: {"x": _x(r), "channel_ids": (1,)})
    with pytest.raises(NkiValidationError, match=r"collective_permute_implicit: priority=0 is NeuronCore-v4\+ only"):
        ncc.run_ranks(_permute_on, 2, lambda r: {"x": _x(r), "channel_ids": (0,), "priority": 0})
