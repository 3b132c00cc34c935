"""The host-side layout contract of the MoE kernels: how the (token, k) slots or the rows of a grouped
matmul are laid out in blocks per expert, and the tables the kernels read (torch ops on the host, before
a launch, as nki-library's callers do; no host read of a routed value).

* :func:`block_layout` / :class:`BlockLayout`: items grouped by expert into blocks of ``block_size``
  (the grouped matmuls and the backward); :func:`paired` gives both cores of an LNC=2 launch the same
  block counts.
* :func:`tail_layout` / :func:`flagged` / :func:`with_previous`: the forward's layout, whose expert's last
  block runs at a narrower width (:func:`tail_widths`) and whose per-block tables carry the run-width
  flags (``FLAG_*``) and the previous block's ids.
* :func:`per_block`, :func:`row_tiles`, :func:`wgrad_bounds`: the same tables re-shaped for one DMA per
  block, the weight-gradient kernels' row tiles and their loop bounds (``WGRAD_MAX_SLOTS``).

The kernel modules (:mod:`~trnkit.kernels.moe.moe_fused`, :mod:`~trnkit.kernels.moe.moe_bwd`,
:mod:`~trnkit.kernels.moe.moe_grouped_mm`) import the constants of this contract from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WGRAD_MAX_SLOTS = 8  # cached row tiles per group; the bounds row has WGRAD_MAX_SLOTS + 3 entries per group


def tail_widths(B: int) -> tuple[int, ...]:
    """Narrower widths an expert's last block may run at (widest first): a block with r used rows
    runs at the narrowest width >= r. Above 128 the multiples of 64 below B (B = 512: 448 .. 64; a
    gate/up matmul costs its moving width, so the last block wastes at most 63 columns there; the
    row-wise down matmul and x transposes work in sub-tiles of <= 128 rows); at B = 128, 96 and 64
    (narrower tiles leave the Tensor Engine idle, the 64-cycle matmul floor)."""
    if B == 128:
        return (96, 64)
    return tuple(range(B - 64, 0, -64)) if B > 128 else ()


# Columns after the ids in the forward's per-block tables (:func:`flagged`): 0/1 flags, the same on
# every partition, from the block's run width r: r > HALF rows | r <= HALF rows | r > one sub-tile.
FLAG_FULL0, FLAG_HALF0, FLAG_MORE = 0, 1, 2
NFLAGS = 3
HALF = 64  # rows of the narrowest piece of sub-tile 0 (the narrowest tail width at rows = 128)


@dataclass(frozen=True)
class BlockLayout:
    """Items (slots or rows) grouped into fixed-size blocks, one group per block.

    ``table [num_blocks, block_size]`` int32: the item at each block position, ``pad`` where a block is
    not full (or the block is unused). ``block_start [1, G + 1]`` int32: group g owns blocks
    ``block_start[g] .. block_start[g + 1] - 1``. ``num_blocks`` is the static worst case for this many
    items, so shapes never depend on the routing (the kernels visit only the used blocks).
    """

    table: torch.Tensor
    block_start: torch.Tensor
    block_size: int
    pad: int

    @property
    def num_blocks(self) -> int:
        return self.table.shape[0]


def max_blocks(num_items: int, num_groups: int, block_size: int) -> int:
    """Worst case of ``sum_g ceil(count_g / B)`` over all ways to split ``num_items`` into groups."""
    nonempty = min(num_groups, num_items)
    return max(1, (num_items - nonempty) // block_size + nonempty)


def paired(per_group: torch.Tensor, lnc: int) -> torch.Tensor:
    """Per-group counts (``[G]`` or ``[G, n]``) as an LNC=``lnc`` launch runs them: unchanged for 1; for 2
    padded to an even number of groups (a last group of zeros: the masked group of
    ``trnkit.kernels.tiles.masked_group``) and each group j of core 0 given the larger count of itself and
    its partner, group j of core 1 (``owned_groups``: contiguous halves), so both cores run the same
    run-time loops."""
    if lnc == 1:
        return per_group
    if per_group.shape[0] % 2:
        per_group = torch.cat([per_group, torch.zeros_like(per_group[:1])])
    half = per_group.shape[0] // 2
    both = torch.maximum(per_group[:half], per_group[half:])
    return torch.cat([both, both])


def counts_of(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[n]``: how many of ``ids`` (int64, each in ``[0, n)``) equal each value. ``torch.bincount``'s
    counts without its value-dependent output size (a read of the largest id back to the host on a device)."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def block_layout(group_of_item: torch.Tensor, num_groups: int, block_size: int, pad: int,
                 lnc: int = 1) -> BlockLayout:
    """Group items by ``group_of_item`` (stable: items keep their order inside a group).

    Items whose group is ``>= num_groups`` are dropped (grouped_mm rows past the last offset). Pure
    torch on the items' device: no host read of any value (``num_blocks`` comes from the item count
    alone) and no Python loop over groups. ``lnc=2``: the groups' block counts are :func:`paired`
    (padding blocks at the end of a group; ``block_start`` has one more group for an odd count).
    """
    g = group_of_item.reshape(-1).long()
    dev = g.device
    n = g.numel()
    g = torch.clamp(g, max=num_groups)  # every dropped item -> the extra group num_groups
    counts = counts_of(g, num_groups + 1)  # [G + 1]; the last entry: dropped items
    blocks = paired((counts[:num_groups] + block_size - 1) // block_size, lnc)
    block_start = torch.zeros(blocks.shape[0] + 1, dtype=torch.int64, device=dev)
    block_start[1:] = torch.cumsum(blocks, 0)
    # >= the bound for the kept items (monotone in n); pairing at most doubles the blocks
    nb = lnc * max_blocks(n, num_groups, block_size)
    table = torch.full((nb * block_size + 1,), pad, dtype=torch.int64, device=dev)  # + 1 dump slot
    if n:
        order = torch.argsort(g, stable=True)
        sorted_g = g[order]
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(n, device=dev) - first[sorted_g]
        pos = torch.where(sorted_g < num_groups, block_start[sorted_g] * block_size + rank,
                          torch.full_like(rank, nb * block_size))  # dropped items -> the dump slot
        table[pos] = order
    return BlockLayout(table[:-1].view(nb, block_size).to(torch.int32),
                       block_start.view(1, -1).to(torch.int32), block_size, pad)


def group_of_row(group_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group id of each row for exclusive-end offsets (rows past the last offset get G)."""
    rows = torch.arange(num_rows, device=group_offsets.device)
    return torch.searchsorted(group_offsets.long(), rows, right=True)


def moe_layout(topk_idx: torch.Tensor, num_experts: int, block_size: int,
                lnc: int = 1) -> tuple[BlockLayout, torch.Tensor]:
    """Slot layout (pad = T*K) and the token id of each block position (:func:`slot_tokens`)."""
    T, K = topk_idx.shape
    lay = block_layout(topk_idx.reshape(-1), num_experts, block_size, pad=T * K, lnc=lnc)
    return lay, slot_tokens(lay, K)


def slot_tokens(lay: BlockLayout, K: int) -> torch.Tensor:
    """``[NB, B]`` int32 token id of each position of a slot layout; padding positions name token 0, so
    every gathered row is finite (a Tensor Engine transpose would spread a NaN of an unwritten row over
    the whole tile) and, with affinity 0 (:func:`position_weights`), contributes exact zeros."""
    slot = lay.table.long()
    return torch.where(slot < lay.pad, slot // K, torch.zeros_like(slot)).to(torch.int32)


def position_weights(topk_weights: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """``[NB, B]`` fp32 affinity of each position of a slot layout (``topk_weights`` flattened in slot
    order); 0 at padding positions."""
    slot = lay.table.long()
    w = topk_weights.reshape(-1).float()
    return torch.where(slot < lay.pad, w[slot.clamp(max=lay.pad - 1)], torch.zeros((), device=w.device))


def tail_layout(topk_idx: torch.Tensor, num_experts: int, block_size: int,
                 lnc: int = 1) -> tuple[BlockLayout, torch.Tensor]:
    """The forward's slot layout and its ``[1, (n + 1)(E' + 1)]`` int32 row ``[block_start | b_1 | .. |
    b_n]`` for the kernel's n narrower tail widths (:func:`tail_widths`): an expert's last block
    moves to the narrowest width that holds its used rows (its *class* j, 0: full width B), and its
    blocks are ``start .. b_1 - 1`` at width B, then ``b_j .. b_(j+1) - 1`` (0 or 1 block) at width j.

    ``lnc=2`` (E' = E rounded up to even): expert j of core 0 and expert j of core 1 get the larger
    full-width block count of the two and a block in every class either has (:func:`paired`), so both
    cores run every segment's loop the same number of times; the extra blocks are padding. With
    ``lnc=1`` this is :func:`block_layout`'s layout (each expert's blocks, its tail block last)."""
    T, K = topk_idx.shape
    B = block_size
    widths = tail_widths(B)
    g = topk_idx.reshape(-1).long()
    dev = g.device
    counts = counts_of(g, num_experts)
    rem = counts % B
    cls = torch.zeros_like(counts)  # 0: full width (or no partial block); j: widths[j-1]
    for j, w in enumerate(widths, start=1):
        cls = torch.where((rem > 0) & (rem <= w), torch.full_like(cls, j), cls)
    own_full = (counts + B - 1) // B - (cls > 0).long()  # the expert's own full-width blocks
    classes = torch.arange(1, len(widths) + 1, device=dev)
    full = paired(own_full, lnc)
    has = paired((cls[:, None] == classes[None, :]).long(), lnc)  # [E', n]: a block of class j
    blocks = full + has.sum(1)
    start = torch.zeros(blocks.shape[0] + 1, dtype=torch.int64, device=dev)
    start[1:] = torch.cumsum(blocks, 0)
    rows = [start]
    b_j = start[:-1] + full
    for j in range(len(widths)):
        rows.append(torch.cat([b_j, start[-1:]]))
        b_j = b_j + has[:, j]
    split = torch.cat(rows).view(1, -1).to(torch.int32)  # one SBUF partition row
    # items: rank r of expert e -> its full-width blocks, the rest (r >= own_full * B) to its class block
    nb = lnc * max_blocks(g.numel(), num_experts, B)
    table = torch.full((nb * B,), T * K, dtype=torch.int64, device=dev)
    if g.numel():
        order = torch.argsort(g, stable=True)
        e = g[order]
        rank = torch.arange(g.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[e]
        before = torch.cat([torch.zeros_like(full[:, None]), torch.cumsum(has, 1)], 1)  # classes < j present
        tail_blk = start[:-1][e] + full[e] + before[e, cls[e].clamp(min=1) - 1]
        in_full = rank < own_full[e] * B
        pos = torch.where(in_full, start[e] * B + rank, tail_blk * B + rank - own_full[e] * B)
        table[pos] = order
    lay = BlockLayout(table.view(nb, B).to(torch.int32), start.view(1, -1).to(torch.int32), B, T * K)
    return lay, split


def flagged(table: torch.Tensor, split: torch.Tensor, num_experts: int, lnc: int = 1) -> torch.Tensor:
    """A per-block id table ``[NB + 1, B]`` (row NB: padding) -> ``moe_experts_kernel``'s layout
    ``[NB + 1, rows, nsub + 3]``: the ids as :func:`per_block` lays them out, then the flags that tell
    ``moe_fused.move_block_rows`` how many rows the block runs at (the same on every partition):
    "wider than 64 rows", "at most 64 rows", "wider than one 128-row sub-tile" (``rows`` instead of 64
    when rows <= 64). A block's run width comes from ``split`` (:func:`tail_layout`): B, or its
    expert's tail width for an expert's narrower last block; unused blocks and row NB count as 64
    (their ids are padding). ``lnc=2``: the first unused row (core 1's look-ahead past its last block)
    gets the flags of core 1's first block (core 0's look-ahead past its last), so both cores' gathers
    run the same 0/1-trip loops."""
    num_experts = split.shape[1] // (len(tail_widths(table.shape[1])) + 1) - 1  # the layout's (LNC=2: even)
    NB = table.shape[0] - 1
    B = table.shape[1]
    rows = min(B, 128)
    half = min(HALF, rows)
    widths = (B,) + tail_widths(B)
    bounds = split.view(len(widths), num_experts + 1).long()
    start = bounds[0]
    run = torch.full((NB + 1,), half, dtype=torch.int64, device=table.device)
    run[:NB] = torch.where(torch.arange(NB, device=table.device) < start[-1], B, half)
    for j in range(1, len(widths)):  # an expert's class-j tail block (at most one): b_j .. b_(j+1) - 1
        end = bounds[j + 1, :-1] if j + 1 < len(widths) else start[1:]
        first = bounds[j, :-1]
        run[torch.where(first < end, first, torch.full_like(first, NB))] = widths[j]
    run[NB] = half
    if lnc == 2:  # core 1's look-ahead past its last block runs like core 0's into core 1's first block
        run[start[-1]] = run[start[num_experts // 2]]
    flags = torch.stack([run > half, run <= half, run > rows], 1).to(torch.int32)  # FLAG_FULL0, FLAG_HALF0, FLAG_MORE
    return torch.cat([per_block(table), flags[:, None, :].expand(NB + 1, rows, 3)], 2).contiguous()


def row_tiles(t: torch.Tensor) -> torch.Tensor:
    """``[NB, B, ...]`` (a block table or a dispatch-order tensor) viewed as row tiles ``[NB * B / rows,
    rows, ...]``, rows = min(B, 128): the weight-gradient kernels' unit of work."""
    NB, B = t.shape[:2]
    rows = min(B, 128)
    return t.view(NB * B // rows, rows, *t.shape[2:])


def wgrad_bounds(lay: BlockLayout, counts: torch.Tensor, lnc: int = 1) -> torch.Tensor:
    """``[1, G * (S + 3)]`` int32 (S = ``WGRAD_MAX_SLOTS``), per group g with n row tiles
    (of :func:`row_tiles`) from tile lo: ``e_j = lo + min(j, n)`` for j = 0..S, ``hi = lo + n``, ``z = lo +
    (n == 0)`` -- the bounds of the weight-gradient kernels' 0/1-trip loops (cache slot j holds tile
    e_j when e_j < e_(j+1); tiles e_S .. hi-1 are gathered per pass; z: an empty group writes zeros).
    ``lnc=2``: the tile counts :func:`paired` like the blocks of ``lay`` (a layout made for LNC=2), so
    both cores run the same loops (a group's padding tiles add zero rows)."""
    rows = min(lay.block_size, 128)
    lo = lay.block_start[0, :-1].long() * (lay.block_size // rows)
    n = paired((counts.long() + rows - 1) // rows, lnc)
    j = torch.arange(WGRAD_MAX_SLOTS + 1, device=lo.device)
    e = lo[:, None] + torch.minimum(j[None, :], n[:, None])
    cols = [e, (lo + n)[:, None], (lo + (n == 0).long())[:, None]]
    return torch.cat(cols, 1).reshape(1, -1).to(torch.int32)  # one SBUF partition row


def per_block(table: torch.Tensor) -> torch.Tensor:
    """``[NB, B]`` -> ``[NB, rows, B // rows]`` (rows = min(B, 128); position ``sub*rows + p`` at
    ``[p, sub]``): a block's values load with one DMA, one column per 128-row sub-tile."""
    NB, B = table.shape
    rows = min(B, 128)
    return table.view(NB, B // rows, rows).transpose(1, 2).contiguous()


def with_previous(table: torch.Tensor, block_start: torch.Tensor, lnc: int) -> torch.Tensor:
    """A flagged slot table ``[NB + 1, ...]`` (row NB: padding) and below it its second page: row r = the
    row of the block before r, the padding row for the first block of each core's part (``block_start
    [1, E' + 1]``, E' / ``lnc`` experts per core), so block r scatters the rows its predecessor left
    without a block id carried across loop iterations (``moe_fused._expert_blocks``)."""
    NB = table.shape[0] - 1
    start = block_start[0].long()
    prev = torch.cat([table[NB:], table[:NB]])  # row r <- row r - 1; row 0 <- the padding row
    E = start.shape[0] - 1
    firsts = torch.clamp(start[torch.arange(lnc, device=start.device) * (E // lnc)], max=NB)
    prev[firsts] = table[NB]
    return torch.cat([table, prev]).contiguous()
