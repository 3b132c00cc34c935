"""``nki.collectives``: communication between devices (ranks), for multi-rank runs on the interpreter.

A collective needs peers, so it runs inside :func:`run_ranks`, which launches the same kernel on
``n_ranks`` simulated devices at once (threads), each with its own inputs, HBM and grid (LNC); a
kernel launched alone has no peers and its collectives raise. Semantics, from the NKI API reference
(``nki/api/nki/collectives``):

* ``ReplicaGroup([[0, 1, 2, 3], [4, 5, 6, 7]])``: the collective runs independently within each
  rank-list; a rank is in at most one list. ``ReplicaGroup.from_partition_op(world, op, operand)``
  groups the ranks with equal ``op(rank, operand)`` (``bitwise_and``, ``div``, ``mod``).
* ``all_gather(srcs, dsts, replica_group, collective_dim)``: each dst is the rank-list's srcs
  concatenated in rank-list order along ``collective_dim`` (HBM: 0 only; SBUF: 2-D, 0 or 1; several
  tensors only on HBM; all tensors in one kind of memory).
* ``all_reduce(srcs, dsts, replica_group, op)``: ``op`` (add / minimum / maximum) over the rank-list,
  in fp32.
* ``reduce_scatter(srcs, dsts, replica_group, collective_dim, op)``: the ``op`` reduction over the
  rank-list (fp32), split along ``collective_dim`` (0 only) into one chunk per rank; the rank at
  position ``i`` of its rank-list receives chunk ``i`` (HBM or SBUF; several tensors only on HBM).
* ``all_to_all(srcs, dsts, replica_group, collective_dim)``: each src is split along
  ``collective_dim`` (0 only) into one chunk per rank; the rank at position ``i`` receives chunk ``i``
  of every rank's src, concatenated in rank-list order (HBM only).
* ``collective_permute(srcs, dsts, source_target_pairs)``: HBM, one tensor each; the target's dst
  receives the source's src.
* ``collective_permute_implicit(srcs_by_channel, dsts_by_channel, replica_group, channel_ids)``: in the
  ring of the rank-list each rank sends to its successor and receives its predecessor's src (``channel_ids``
  consecutive from 0, "Currently must be consecutive integers starting from 0");
  ``collective_permute_implicit_reduce`` sends ``op(srcs0, srcs1)`` instead.
* ``collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group, channel_id)``:
  the rank whose data a rank holds after ``iteration_id`` ring steps (its own at 0, then its
  predecessors'), as a register; ``rank_id()``: this rank, as a register.

With LNC=2 each rank runs two programs; the peers of a program are the programs with the same program
id on the other ranks of its rank-list (each core talks to its counterpart). Every participant must
make the same collective calls in the same order; one that never arrives is reported after
:data:`TIMEOUT_S`. ``priority=`` ("NeuronCore-v4+ only") raises: the interpreter is trn2. The collectives
are not traced for the cost model.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import controlflow as _cf
from . import memory as _mem
from .api_names import fill_missing
from .errors import NkiValidationError, fail, require
from .language import NKIObject
from .tensor import NkiTensor, VirtualRegister

__all__ = ["PeerFailed", "ReplicaGroup", "rg_partition_op", "all_gather", "all_reduce", "reduce_scatter",
           "all_to_all", "collective_permute",
           "collective_permute_implicit", "collective_permute_implicit_reduce",
           "collective_permute_implicit_current_processing_rank_id", "rank_id", "run_ranks", "TIMEOUT_S"]

TIMEOUT_S = 120.0  # how long a participant waits for its peers at a collective


class rg_partition_op(enum.Enum):  # noqa: N801
    """How :meth:`ReplicaGroup.from_partition_op` maps a rank to its rank-list."""

    bitwise_and = 0
    div = 1
    mod = 2


@dataclass
class ReplicaGroup(NKIObject):
    """The rank-lists a collective runs on (independently within each list)."""

    replica_groups: list = field(default_factory=list)

    @staticmethod
    def from_partition_op(world_size: int, op: rg_partition_op, operand: int) -> ReplicaGroup:
        key = {rg_partition_op.bitwise_and: lambda r: r & operand, rg_partition_op.div: lambda r: r // operand,
               rg_partition_op.mod: lambda r: r % operand}[op]
        lists: dict[int, list[int]] = {}
        for r in range(world_size):
            lists.setdefault(key(r), []).append(r)
        return ReplicaGroup([lists[k] for k in sorted(lists)])

    def rank_list(self, op: str, rank: int) -> list[int]:
        """The rank-list containing ``rank`` (checked: no rank in two lists)."""
        lists = [list(map(int, g)) for g in self.replica_groups]
        flat = [r for g in lists for r in g]
        require(len(flat) == len(set(flat)), op, "replica group {groups} has a rank in more than one "
                "rank-list", groups=lists)
        for g in lists:
            if rank in g:
                return g
        fail(op, "rank {rank} is in no rank-list of the replica group {groups}", rank=rank, groups=lists)


class PeerFailed(NkiValidationError):
    """A collective could not complete because a peer failed or never arrived."""


@dataclass
class _World:
    """The devices of one :func:`run_ranks` call and the mailbox their collectives exchange through."""

    n_ranks: int
    programs: int  # per rank (the grid size)
    barrier: threading.Barrier
    mailbox: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class _Rank:
    rank: int
    world: _World


def run_ranks(kernel: Any, n_ranks: int, make_inputs: Callable[[int], dict[str, Any]],
              grid: int | tuple[int, ...] = ()) -> list[Any]:
    """Run ``kernel`` on ``n_ranks`` devices at once, rank ``r`` with ``make_inputs(r)`` as keyword
    arguments and ``grid`` programs (e.g. 2 for LNC=2); returns each rank's result, in rank order. Every
    rank runs under the kernel's launch rules (``nki.simulate(kernel, capacity=...)``; a plain function or
    ``@nki.jit`` kernel: the defaults)."""
    from .jit import Kernel, _launch, simulate
    from .trace import recording

    kernel = kernel if isinstance(kernel, Kernel) else simulate(kernel)
    g = (grid if isinstance(grid, tuple) else (grid,)) or kernel.grid
    programs = math.prod(g) if g else 1
    world = _World(n_ranks, programs, threading.Barrier(n_ranks * programs, timeout=TIMEOUT_S))
    inputs = [make_inputs(r) for r in range(n_ranks)]
    results: list[Any] = [None] * n_ranks
    errors: list[BaseException | None] = [None] * n_ranks
    tr = recording()  # the caller's trace.record block: the rank threads start without it

    def run(r: int) -> None:
        try:
            results[r] = _launch(kernel.fn, g, (), inputs[r], kernel.rules, rank=_Rank(r, world), recording=tr)
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            errors[r] = exc
            world.barrier.abort()  # peers waiting at a collective stop too

    threads = [threading.Thread(target=run, args=(r,), name=f"nki-rank-{r}") for r in range(n_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in errors if e is not None]
    if failed:  # the cause first, not a peer that stopped waiting for it
        raise next((e for e in failed if not isinstance(e, (PeerFailed, threading.BrokenBarrierError))), failed[0])
    return results


def _me(op: str) -> tuple[_Rank, _mem.KernelContext]:
    ctx = _mem.current()
    me = ctx.launch.rank
    if me is None:
        fail(op, "a collective needs peer devices: run the kernel with nki.collectives.run_ranks (a "
             "kernel launched alone has no other ranks)")
    return me, ctx


def _exchange(op: str, payload: Any) -> dict[tuple[int, int], Any]:
    """Deposit ``payload`` for this collective call and return every participant's, keyed by
    ``(rank, program)``, once all have arrived."""
    me, ctx = _me(op)
    key = (ctx.collective_seq, op)
    ctx.collective_seq += 1
    _cf.sync_event(op, f"collective #{key[0]}", counted=False)  # compared between the programs of an LNC=2 launch
    world = me.world
    with world.lock:
        world.mailbox.setdefault(key, {})[(me.rank, ctx.flat_program_id)] = payload
    try:
        with _cf.parked():  # this launch's other programs take their turns meanwhile
            world.barrier.wait()
        got = dict(world.mailbox[key])
        with _cf.parked():
            last = world.barrier.wait() == 0
        if last:  # everyone has read it
            del world.mailbox[key]
    except threading.BrokenBarrierError:
        raise PeerFailed(f"{op}: collective #{key[0]} did not complete: a peer failed or did "
                                 f"not make the same collective call within {TIMEOUT_S:.0f} s "
                                 "(every rank of the run must issue the same collectives in order)") from None
    return got


def _peers(op: str, replica_group: ReplicaGroup, got: dict) -> tuple[list[int], int]:
    me, ctx = _me(op)
    ranks = replica_group.rank_list(op, me.rank)
    for r in ranks:
        require((r, ctx.flat_program_id) in got, op, "rank {rank} of the rank-list {ranks} is not in this "
                "run of {n} ranks", rank=r, ranks=ranks, n=me.world.n_ranks)
    return ranks, ctx.flat_program_id


def _check_memories(op: str, tensors: Sequence[NkiTensor], hbm_only: bool = False) -> bool:
    """All HBM or all SBUF (docs); returns True for HBM."""
    for t in tensors:
        require(isinstance(t, NkiTensor), op, "expected NKI tensors, got {type}", type=type(t).__name__)
    kinds = {t.buffer.is_hbm for t in tensors}
    require(len(kinds) == 1, op, "tensors must all be in HBM or all in SBUF, got {buffers}",
            buffers=[t.buffer.name for t in tensors])
    on_hbm = kinds.pop()
    require(on_hbm or not hbm_only, op, "tensors must be in HBM (SBUF is not supported), got {buffers}",
            buffers=[t.buffer.name for t in tensors])
    require(on_hbm or all(t.buffer.name == "sbuf" for t in tensors), op, "on-chip collective tensors "
            "must be in SBUF, got {buffers}", buffers=[t.buffer.name for t in tensors])
    return on_hbm


def _write(op: str, dst: NkiTensor, value: np.ndarray) -> None:
    require(tuple(dst.shape) == value.shape, op, "dst {name!r} has shape {shape}, the result is "
            "{want}", name=dst.name, shape=tuple(dst.shape), want=value.shape)
    dst.np()[...] = value.astype(dst.dtype)


@_mem.instruction
def all_gather(srcs: list, dsts: list, replica_group: ReplicaGroup, collective_dim: int,
               priority: int | None = None, name: str | None = None) -> None:
    op = "all_gather"
    _no_priority(op, priority)
    require(len(srcs) == len(dsts) and len(srcs) >= 1, op, "srcs and dsts must be lists of equal "
            "length, got {n_src} and {n_dst}", n_src=len(srcs), n_dst=len(dsts))
    on_hbm = _check_memories(op, list(srcs) + list(dsts))
    require(on_hbm or len(srcs) == 1, op, "several tensors (coalesced) are only supported in HBM")
    if on_hbm:
        require(collective_dim == 0, op, "collective_dim must be 0 for HBM tensors, got {dim}", dim=collective_dim)
    else:
        require(collective_dim in (0, 1) and all(t.ndim == 2 for t in list(srcs) + list(dsts)), op,
                "SBUF collectives take 2-D tensors and collective_dim 0 or 1, got dim {dim}",
                dim=collective_dim)
    got = _exchange(op, [s.np().copy() for s in srcs])
    ranks, pid = _peers(op, replica_group, got)
    for i, dst in enumerate(dsts):
        _write(op, dst, np.concatenate([got[(r, pid)][i] for r in ranks], axis=collective_dim))


_REDUCE = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum}


def _reducer(op: str, fn: Any) -> Any:
    name = getattr(fn, "__name__", getattr(fn, "name", str(fn)))
    require(name in _REDUCE, op, "op must be nl.add, nl.maximum or nl.minimum, got {fn}", fn=name)
    return _REDUCE[name]


@_mem.instruction
def all_reduce(srcs: list, dsts: list, replica_group: ReplicaGroup, op: Any, priority: int | None = None,
               name: str | None = None) -> None:
    opname = "all_reduce"
    _no_priority(opname, priority)
    reduce = _reducer(opname, op)
    require(len(srcs) == len(dsts) and len(srcs) >= 1, opname, "srcs and dsts must be lists of equal length")
    on_hbm = _check_memories(opname, list(srcs) + list(dsts))
    require(on_hbm or len(srcs) == 1, opname, "several tensors (coalesced) are only supported in HBM")
    got = _exchange(opname, [s.np().astype(np.float32) for s in srcs])
    ranks, pid = _peers(opname, replica_group, got)
    for i, dst in enumerate(dsts):
        _write(opname, dst, reduce.reduce(np.stack([got[(r, pid)][i] for r in ranks]), axis=0))


def _chunks(op: str, value: np.ndarray, n: int, name: str) -> list[np.ndarray]:
    """``value`` split along dim 0 into ``n`` equal chunks (the rank-list's size)."""
    require(value.shape[0] % n == 0, op, "src {name!r} has {rows} rows along collective_dim 0, not a multiple "
            "of the {n} ranks of the rank-list", name=name, rows=value.shape[0], n=n)
    return np.split(value, n, axis=0)


def _dim0_only(op: str, collective_dim: int) -> None:
    # API reference (reduce_scatter, all_to_all): "collective_dim ... Currently only 0 is supported."
    require(collective_dim == 0, op, "collective_dim must be 0 (the only dimension the NKI API reference "
            "supports), got {dim}", dim=collective_dim)


def _no_priority(op: str, priority: int | None) -> None:
    # API reference, every collective: "priority: DMA quality-of-service priority level 0-3 where lower is
    # higher priority (NeuronCore-v4+ only)"; the interpreter is trn2 (NeuronCore-v3)
    require(priority is None, op, "priority={priority} is NeuronCore-v4+ only (nki.collectives API reference: "
            "\"DMA quality-of-service priority level 0-3 ... (NeuronCore-v4+ only)\"); the interpreter models "
            "trn2 (NeuronCore-v3)", priority=priority)


@_mem.instruction
def reduce_scatter(srcs: list, dsts: list, replica_group: ReplicaGroup, collective_dim: int, op: Any,
                   priority: int | None = None, name: str | None = None) -> None:
    """API reference ``nki.collectives.reduce_scatter``: HBM or SBUF (not mixed), several tensors only
    on HBM, ``collective_dim`` 0 only, ``op`` add / minimum / maximum."""
    opname = "reduce_scatter"
    _no_priority(opname, priority)
    reduce = _reducer(opname, op)
    require(len(srcs) == len(dsts) and len(srcs) >= 1, opname, "srcs and dsts must be lists of equal "
            "length, got {n_src} and {n_dst}", n_src=len(srcs), n_dst=len(dsts))
    on_hbm = _check_memories(opname, list(srcs) + list(dsts))
    require(on_hbm or len(srcs) == 1, opname, "several tensors (coalesced) are only supported in HBM")
    _dim0_only(opname, collective_dim)
    got = _exchange(opname, [s.np().astype(np.float32) for s in srcs])
    ranks, pid = _peers(opname, replica_group, got)
    me, _ = _me(opname)
    for i, dst in enumerate(dsts):
        total = reduce.reduce(np.stack([got[(r, pid)][i] for r in ranks]), axis=0)
        _write(opname, dst, _chunks(opname, total, len(ranks), srcs[i].name)[ranks.index(me.rank)])


@_mem.instruction
def all_to_all(srcs: list, dsts: list, replica_group: ReplicaGroup, collective_dim: int,
               priority: int | None = None, name: str | None = None) -> None:
    """API reference ``nki.collectives.all_to_all``: "Tensors must reside on HBM", ``collective_dim`` 0
    only ("split and ... concatenated" along it)."""
    op = "all_to_all"
    _no_priority(op, priority)
    require(len(srcs) == len(dsts) and len(srcs) >= 1, op, "srcs and dsts must be lists of equal "
            "length, got {n_src} and {n_dst}", n_src=len(srcs), n_dst=len(dsts))
    _check_memories(op, list(srcs) + list(dsts), hbm_only=True)
    _dim0_only(op, collective_dim)
    got = _exchange(op, [s.np().copy() for s in srcs])
    ranks, pid = _peers(op, replica_group, got)
    me, _ = _me(op)
    mine = ranks.index(me.rank)
    for i, dst in enumerate(dsts):
        parts = [_chunks(op, got[(r, pid)][i], len(ranks), srcs[i].name)[mine] for r in ranks]
        _write(op, dst, np.concatenate(parts, axis=0))


@_mem.instruction
def collective_permute(srcs: list, dsts: list, source_target_pairs: list, priority: int | None = None,
                       name: str | None = None) -> None:
    op = "collective_permute"
    _no_priority(op, priority)
    require(len(srcs) == 1 and len(dsts) == 1, op, "exactly one src and one dst tensor (coalesced "
            "communication is not supported), got {n_src} and {n_dst}", n_src=len(srcs), n_dst=len(dsts))
    _check_memories(op, [srcs[0], dsts[0]], hbm_only=True)
    got = _exchange(op, srcs[0].np().copy())
    me, ctx = _me(op)
    sources = [int(s) for s, t in source_target_pairs if int(t) == me.rank]
    require(len(sources) <= 1, op, "rank {rank} is the target of several pairs {pairs}", rank=me.rank,
            pairs=source_target_pairs)
    if sources:
        require((sources[0], ctx.flat_program_id) in got, op, "source rank {src} is not in this run",
                src=sources[0])
        _write(op, dsts[0], got[(sources[0], ctx.flat_program_id)])


def _ring_step(op: str, replica_group: ReplicaGroup, srcs_by_channel: list, dsts_by_channel: list,
               channel_ids: Sequence[int], payload: list) -> None:
    require(len(srcs_by_channel) == len(dsts_by_channel) == len(channel_ids), op, "one src list, one dst "
            "list and one channel id per channel, got {a}, {b} and {c}", a=len(srcs_by_channel),
            b=len(dsts_by_channel), c=len(channel_ids))
    # API reference (collective_permute_implicit / _reduce): "channel_ids: ... Currently must be consecutive
    # integers starting from 0"
    require([int(c) for c in channel_ids] == list(range(len(channel_ids))), op, "channel_ids {ids} must be "
            "consecutive integers starting from 0 (nki.collectives API reference: \"Currently must be consecutive "
            "integers starting from 0\")", ids=list(channel_ids))
    got = _exchange(op, payload)
    ranks, pid = _peers(op, replica_group, got)
    me, _ = _me(op)
    pred = ranks[(ranks.index(me.rank) - 1) % len(ranks)]
    for i, dsts in enumerate(dsts_by_channel):
        _write(op, dsts[0], got[(pred, pid)][i])


def _one_each(op: str, lists: list) -> list[NkiTensor]:
    for inner in lists:
        require(len(inner) == 1, op, "each channel's list must hold exactly one tensor, got {n}", n=len(inner))
    tensors = [inner[0] for inner in lists]
    _check_memories(op, tensors)
    return tensors


@_mem.instruction
def collective_permute_implicit(srcs_by_channel: list, dsts_by_channel: list, replica_group: ReplicaGroup,
                                channel_ids: Sequence[int] = (0,), priority: int | None = None,
                                name: str | None = None) -> None:
    op = "collective_permute_implicit"
    _no_priority(op, priority)
    srcs = _one_each(op, srcs_by_channel)
    _one_each(op, dsts_by_channel)
    _ring_step(op, replica_group, srcs_by_channel, dsts_by_channel, channel_ids, [s.np().copy() for s in srcs])


@_mem.instruction
def collective_permute_implicit_reduce(srcs0_by_channel: list, srcs1_by_channel: list, dsts_by_channel: list,
                                       replica_group: ReplicaGroup, op: Any, channel_ids: Sequence[int] = (0,),
                                       priority: int | None = None, name: str | None = None) -> None:
    opname = "collective_permute_implicit_reduce"
    _no_priority(opname, priority)
    reduce = _reducer(opname, op)
    a, b = _one_each(opname, srcs0_by_channel), _one_each(opname, srcs1_by_channel)
    _one_each(opname, dsts_by_channel)
    payload = [reduce(x.np().astype(np.float32), y.np().astype(np.float32)) for x, y in zip(a, b)]
    _ring_step(opname, replica_group, srcs0_by_channel, dsts_by_channel, channel_ids, payload)


def collective_permute_implicit_current_processing_rank_id(iteration_id: int | VirtualRegister,
                                                           replica_group: ReplicaGroup, channel_id: int = 0,
                                                           num_channels: int = 1,
                                                           name: str | None = None) -> VirtualRegister:
    op = "collective_permute_implicit_current_processing_rank_id"
    me, _ = _me(op)
    ranks = replica_group.rank_list(op, me.rank)
    step = iteration_id.value if isinstance(iteration_id, VirtualRegister) else int(iteration_id)
    return VirtualRegister(ranks[(ranks.index(me.rank) - step) % len(ranks)])


def rank_id(name: str | None = None) -> VirtualRegister:
    """This device's rank, as a register."""
    me, _ = _me("rank_id")
    return VirtualRegister(me.rank)


fill_missing(globals(), "nki.collectives")
