"""Shared tiling of the flash attention kernels: the SPMD work split, HBM row views of the
``[B, S, H, D]`` tensors, the causal-mask tile."""

from __future__ import annotations

from trnkit.kernels._common import P_MAX
from trnkit.nki_api import nisa, nl

P = P_MAX
# Engine clocks and ScalarE's fixed ACTIVATE time, for the kernels' trace-time engine balancing
VECTOR_GHZ, SCALAR_GHZ = 0.96, 1.2
ACT_FIXED_NS = 295  # trn2 profile; see docs/cost-model.md
# The causal mask value: the most negative finite bf16 (exact in bf16 and fp32). Added to a score it
# leaves a finite fp32 number whose exp is 0, and a row max is never taken from it (the diagonal is
# always unmasked), so no inf - inf can arise.
NEG = -3.3895313892515355e38


def work_units(B, Hk, G, n_prog, pid, split_heads):
    """This program's work units ``(b, kv head j, first query head of the group g0, heads ng, real)``.

    Every program gets the same number of units of the same size, so both programs of an LNC=2 launch
    run the same control flow (divergent control flow between the programs is undefined in NKI): with
    ``split_heads`` the query heads of each group are split in halves when the group size G is even,
    else the (b, kv head) pairs when there is an even number of them; otherwise the second program's
    list is padded with a copy of the first program's last unit (``real`` False: its results go to a
    scratch buffer).
    """
    units = []
    if n_prog == 1:
        for b in range(B):
            for j in range(Hk):
                units.append((b, j, 0, G, True))
    elif split_heads and G % 2 == 0:
        half = G // n_prog
        for b in range(B):
            for j in range(Hk):
                units.append((b, j, pid * half, half, True))
    else:
        n = B * Hk
        per = (n + n_prog - 1) // n_prog
        for i in range(per):
            u = pid * per + i
            real = u < n
            if not real:
                u = n - 1
            units.append((u // Hk, u % Hk, 0, G, real))
    return units


def needs_scratch(B, Hk, G, n_prog, split_heads):
    """Whether :func:`work_units` pads a program's list with a duplicate unit."""
    return n_prog > 1 and (G % 2 == 1 or not split_heads) and (B * Hk) % n_prog == 1


def rows(t, b, s0, n, h):
    """HBM ``t [B, S, H, D]``: sequence rows ``s0 .. s0 + n`` of head ``h`` as an ``[n, D]`` view."""
    _, S, H, D = t.shape
    return t.ap(pattern=[[H * D, n], [1, D]], offset=((b * S + s0) * H + h) * D)


def tiles_view(t, b, s0, nt, h):
    """HBM ``t [B, S, H, D]``: ``nt`` full 128-row tiles of head ``h`` from row ``s0`` as ``[P, nt, D]``
    (row ``s0 + i*P + p`` at ``[p, i]``)."""
    _, S, H, D = t.shape
    return t.ap(pattern=[[H * D, P], [P * H * D, nt], [1, D]], offset=((b * S + s0) * H + h) * D)


def cheaper_engine(load, n, two_byte, psum_read_cycles=0):
    """Engine for a PSUM -> SBUF copy of n elements per partition: 0 (Vector) or 1 (Scalar), whichever
    finishes first given the work so far (``load`` = [Vector ns, Scalar ns], updated). ``psum_read_cycles``:
    VectorE's per-instruction PSUM access setup, where the caller counts it."""
    vec = (max(64, n / 2 if two_byte else n) + psum_read_cycles) / VECTOR_GHZ
    act = max(64, n) / SCALAR_GHZ + ACT_FIXED_NS
    if load[0] + vec <= load[1] + act:
        load[0] = load[0] + vec
        return 0
    load[1] = load[1] + act
    return 1


def causal_mask(dtype):
    """``[P, P]`` additive mask in ``dtype``: 0 where column <= partition (key <= query), else NEG."""
    zeros = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    mask = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
    nisa.affine_select(dst=mask, pattern=[[1, P]], channel_multiplier=-1, on_true_tile=zeros,
                       on_false_value=NEG, cmp_op=nl.less_equal)
    return mask


def _pieces(S, pieces):
    """``(first tile, tiles, first key, keys)`` of ``pieces`` runs of whole 128-key tiles covering S."""
    nkt = (S + P - 1) // P
    per = (nkt + pieces - 1) // pieces
    out = []
    for t0 in range(0, nkt, per):
        t1 = min(nkt, t0 + per)
        out.append((t0, t1 - t0, t0 * P, min(S, t1 * P) - t0 * P))
    return out


def load_kT(k, b, j, kT_rows, pieces=1):
    """``K^T [kT_rows, ceil(S/P)*P]`` of kv head j resident in SBUF (rows 0..D-1 filled), by DMA
    transposes of ``pieces`` runs of consecutive keys (the first keys' work need not wait for the last)."""
    _, S, Hk, D = k.shape
    kT = nl.ndarray((kT_rows, (S + P - 1) // P * P), dtype=k.dtype, buffer=nl.sbuf)
    for t0, nt, s0, n in _pieces(S, pieces):
        nisa.dma_transpose(dst=kT[0:D, s0:s0 + n], src=rows(k, b, s0, n, j))
    return kT


def load_v(v, b, j, pieces=1):
    """``V [P, ceil(S/P), D]`` of kv head j resident in SBUF (key ``t*P + p`` on partition p of tile t),
    in ``pieces`` DMAs of whole tiles (a short last tile in its own)."""
    _, S, Hk, D = v.shape
    v_sb = nl.ndarray((P, (S + P - 1) // P, D), dtype=v.dtype, buffer=nl.sbuf)
    for t0, nt, s0, n in _pieces(S, pieces):
        nfull = n // P
        if nfull > 0:
            nisa.dma_copy(dst=v_sb[:, t0:t0 + nfull, :], src=tiles_view(v, b, s0, nfull, j))
        if nfull < nt:
            rem = n - nfull * P
            nisa.dma_copy(dst=v_sb[0:rem, t0 + nfull, :], src=rows(v, b, s0 + nfull * P, rem, j))
    return v_sb
