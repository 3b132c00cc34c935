"""Side by side under the trn2 cost model: trnkit's ``moe_experts`` forward and a *blockwise* MoE forward
built from the public description of AWS nki-library's ``moe_cte`` (``bwmm_shard_on_block``'s docstring
and pseudocode: blocks of B token slots, one expert per block, the expert's weights loaded for every
block, every block computed at its full width, outputs accumulated per token, blocks dealt to the two
cores ping-pong, a cross-core reduction at the end). No nki-library code is used; the blockwise kernel
below is written with trnkit's own tile helpers, so the two designs differ only in how they organise the
work, not in how a tile is multiplied.

Differences that the figures measure:

* weights: blockwise loads an expert's weights once per *block*; trnkit once per *expert* (static expert
  loop, run-time loop over the expert's blocks);
* padding: blockwise computes every block at width B; trnkit runs an expert's partly used last block
  at a narrower width (96 / 64 at B=128);
* LNC=2: blockwise deals blocks to the cores (ping-pong), each core loading the weights of its blocks;
  trnkit splits the experts, so each core loads only half of the weights;
* combine: blockwise adds each block's rows into a per-core ``[T, H]`` accumulator (gather, add,
  scatter) and sums the two accumulators; trnkit writes slots and sums a token's K slots with a
  selection-matrix matmul.

The blockwise kernel visits only the used blocks (its dynamic loop's early exit at its best: no static
worst-case blocks are computed), which favours it; at LNC=2 a core with one block fewer runs one
all-padding block, so that both cores take the same trip count.

Usage: ``python benchmarks/blockwise_moe.py [--save]`` (T=512, H=2048, I=768, K=8, E in 8, 128, bf16,
block 128, LNC 1 and 2); ``--save`` writes ``benchmarks/data/blockwise_moe.csv`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trnkit.bench import fingerprint
from trnkit.kernels import moe
from trnkit.kernels.lnc import launch
from trnkit.kernels.moe.moe_fused import expert_act, swiglu_T
from trnkit.kernels.tiles import P, chunks, load_rows, program_split, row_matmul, store_rows, tiles, transpose_rows
from trnkit.nki_api import nisa, nki, nl

CSV = Path(__file__).parent / "data" / "blockwise_moe.csv"
SHAPE = dict(T=512, H=2048, I=768, K=8, B=128)


# ----------------------------------------------------------------------------------------- kernel
def load_weight_dynamic(w: Any, e: Any) -> list:
    """``w[e] [R, C]`` -> SBUF ``[P, ceil(R/P), C]`` for a run-time expert id ``e`` (a register), returned
    as its ``[P, C]`` chunk views (the weight layout of trnkit's swiglu_T / row_matmul)."""
    _, R, C = w.shape
    t = nl.ndarray((P, (R + P - 1) // P, C), dtype=w.dtype, buffer=nl.sbuf)
    full = R // P
    for c0, n in chunks(full, 4):
        nisa.dma_copy(dst=t[:, c0:c0 + n, :], src=w.ap(pattern=[[C, P], [P * C, n], [1, C]], offset=c0 * P * C,
                                                     scalar_offset=e, indirect_dim=0))
    if R % P:
        r = R % P
        nisa.dma_copy(dst=t[:r, full, :], src=w.ap(pattern=[[C, r], [1, C]], offset=full * P * C,
                                                   scalar_offset=e, indirect_dim=0))
    out = []
    for c in range((R + P - 1) // P):
        out.append(t[:, c, :])
    return out


@nki.jit
def blockwise_moe_kernel(x, w_gate_up, w_down, token_table, acc_table, slot_table, block_expert, bounds,
                         slot_weights):
    """Blockwise MoE forward: for each used block i of this core (``bounds [1, 2 * n_prog]``: lo, hi per
    core), expert ``block_expert[i]``: load its weights, gather the block's B token rows, gate/up, SiLU,
    down, scale by the affinities and add the rows into this core's accumulator (``acc_table``: the
    token ids offset by core * T). LNC=2: one barrier, then the two accumulators are summed."""
    T, H = x.shape
    inter = w_down.shape[1]
    B = token_table.shape[1]
    rows = min(B, P)
    dt = x.dtype
    n_prog, pid = program_split()
    HC = (H + P - 1) // P
    IC = (inter + P - 1) // P
    out = nl.ndarray((T, H), dtype=dt, buffer=nl.shared_hbm)
    acc = out
    if n_prog > 1:
        acc = nl.ndarray((n_prog * T, H), dtype=dt, buffer=nl.shared_hbm)
    zero = nl.ndarray((P, H), dtype=dt, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    for t0, nt in chunks(T, P):
        nisa.dma_copy(dst=acc[pid * T + t0:pid * T + t0 + nt, :], src=zero[:nt, :])
    bsb = nl.ndarray(bounds.shape, dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=bsb, src=bounds)
    lo = nisa.register_alloc()
    nisa.register_load(lo, bsb[0:1, 2 * pid:2 * pid + 1])
    hi = nisa.register_alloc()
    nisa.register_load(hi, bsb[0:1, 2 * pid + 1:2 * pid + 2])
    act = expert_act("silu", 7.0, 1.702, None, 0, inter)

    def block(i):
        e_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=e_sb, src=block_expert.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=i,
                                                    indirect_dim=0))
        e = nisa.register_alloc()
        nisa.register_load(e, e_sb)
        wgu = load_weight_dynamic(w_gate_up, e)
        wd = load_weight_dynamic(w_down, e)
        x_T = tiles(HC, (P, B), dt)
        for sub in range(B // rows):
            x_sb = nl.ndarray((rows, H), dtype=dt, buffer=nl.sbuf)
            load_rows(x_sb, x, token_table, i, sub, zero_pad=True)
            transpose_rows(x_sb, x_T, col0=sub * rows)
        h_T = tiles(IC, (P, B), dt)
        swiglu_T(h_T, x_T, wgu, H, inter, B, act)
        for sub in range(B // rows):
            w_col = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
            load_rows(w_col, slot_weights, slot_table, i, sub, zero_pad=True)
            y_sb = nl.ndarray((rows, H), dtype=dt, buffer=nl.sbuf)
            row_matmul(y_sb, h_T, rows, wd, inter, col0=sub * rows, scale=w_col)
            a_sb = nl.ndarray((rows, H), dtype=dt, buffer=nl.sbuf)
            load_rows(a_sb, acc, acc_table, i, sub, zero_pad=True)
            nisa.tensor_tensor(dst=a_sb, data1=a_sb, data2=y_sb, op=nl.add)
            store_rows(acc, a_sb, acc_table, i, sub)

    nl.fori_loop(lo, hi, block)
    if n_prog > 1:
        nisa.core_barrier(acc, (0, 1))
        tok_tiles = chunks(T, P)
        for k in range(pid, len(tok_tiles), n_prog):
            t0, nt = tok_tiles[k]
            s = nl.ndarray((nt, H), dtype=nl.float32, buffer=nl.sbuf)
            a0 = nl.ndarray((nt, H), dtype=dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=a0, src=acc[t0:t0 + nt, :])
            a1 = nl.ndarray((nt, H), dtype=dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=a1, src=acc[T + t0:T + t0 + nt, :])
            nisa.tensor_tensor(dst=s, data1=a0, data2=a1, op=nl.add)
            o = nl.ndarray((nt, H), dtype=dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o, src=s)
            nisa.dma_copy(dst=out[t0:t0 + nt, :], src=o)
    return out


# ------------------------------------------------------------------------------------------- host
def blockwise_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, block_size: int = 128, lnc: int = 1) -> torch.Tensor:
    """The blockwise design's forward (same contract as :func:`trnkit.kernels.moe.moe_experts`, SiLU)."""
    T, K = topk_idx.shape
    E = w_gate_up.shape[0]
    lay = moe.block_layout(topk_idx.reshape(-1), E, block_size, pad=T * K)
    N = lay.num_blocks
    starts = lay.block_start[0].long()
    used = int(starts[-1])
    expert_of_block = torch.searchsorted(starts[1:], torch.arange(N), right=True).clamp(max=E - 1)
    # ping-pong: used block j goes to core j % lnc; each core's blocks become contiguous rows of the tables.
    # Both cores run the same trip count (LNC=2 programs must take the same control flow): a core with one
    # block fewer runs a padding block (row N: every slot padding, so nothing is gathered or stored).
    per_core = -(-used // lnc)
    mine = [list(range(p, used, lnc)) for p in range(lnc)]
    order = torch.tensor([j for blocks in mine for j in blocks + [N] * (per_core - len(blocks))], dtype=torch.long)
    table = torch.cat([lay.table.long(), torch.full((1, block_size), T * K)])
    expert_of_block = torch.cat([expert_of_block, torch.zeros(1, dtype=torch.long)])
    bounds = torch.tensor([v for p in range(lnc) for v in (p * per_core, (p + 1) * per_core)])
    slot = table[order]
    token = torch.where(slot < T * K, slot // K, torch.full_like(slot, T))
    core = torch.arange(lnc).repeat_interleave(per_core).view(-1, 1)
    acc_ids = torch.where(slot < T * K, token + core * T, torch.full_like(slot, lnc * T))
    return launch(blockwise_moe_kernel, lnc)(
        x.contiguous(), w_gate_up.contiguous(), w_down.contiguous(), token.to(torch.int32), acc_ids.to(torch.int32),
        slot.to(torch.int32), expert_of_block[order].view(-1, 1).to(torch.int32), bounds.view(1, -1).to(torch.int32),
        topk_weights.reshape(-1, 1).float())


# ------------------------------------------------------------------------------------ side by side
def _inputs(E: int, dtype: torch.dtype = torch.bfloat16, T: int = SHAPE["T"], H: int = SHAPE["H"],
            inter: int = SHAPE["I"], K: int = SHAPE["K"], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    wgu = (torch.randn(E, H, 2 * inter, generator=g) * H ** -0.5).to(dtype)
    wd = (torch.randn(E, inter, H, generator=g) * inter ** -0.5).to(dtype)
    probs = torch.softmax(torch.randn(T, E, generator=g), -1)  # near-uniform routing, as a trained router
    tw, idx = probs.topk(K, -1)
    return x, idx.to(torch.int32), tw / tw.sum(-1, keepdim=True), wgu, wd


# what each design runs (trnkit.bench.fingerprint sources): the blockwise kernel is this script's own
DESIGN_SOURCES = {"trnkit": "trnkit/kernels/moe", "blockwise": "benchmarks/blockwise_moe.py"}


def estimate(fn) -> dict:
    from trnkit.nkisim import cost, trace  # interpreter only

    t0 = time.perf_counter()
    with trace.record(trace_only=True) as tr:
        fn()
    rep = cost.estimate(tr, "trn2")
    low, mid, high = (t * 1e-3 for t in rep.total_range_ns)
    return dict(est_us=mid, est_low_us=low, est_high_us=high, flops=rep.flops, hbm_bytes=rep.hbm_bytes,
                bottleneck=rep.bottleneck, interp_s=round(time.perf_counter() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", action="store_true", help="write benchmarks/data/blockwise_moe.csv")
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 128])
    args = ap.parse_args(argv)
    rows = []
    for E in args.experts:
        x, idx, tw, wgu, wd = _inputs(E)
        for lnc in (1, 2):
            for design, fn in (("trnkit", lambda: moe.moe_experts(x, idx, tw, wgu, wd, SHAPE["B"], lnc=lnc)),
                               ("blockwise", lambda: blockwise_moe(x, idx, tw, wgu, wd, SHAPE["B"], lnc))):
                r = dict(design=design, E=E, lnc=lnc, **SHAPE, dtype="bfloat16", **estimate(fn),
                         **fingerprint.stamp([DESIGN_SOURCES[design]]))
                print(r, flush=True)
                rows.append(r)
    if args.save:
        with CSV.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
