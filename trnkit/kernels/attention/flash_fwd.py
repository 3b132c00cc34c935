"""Flash attention forward NKI kernel (``attention_fwd_kernel``): causal, GQA, online softmax, the
log-sum-exp saved for the backward; no ``[S, S]`` matrix anywhere but in on-chip tiles.

Layout ``[B, S, H, D]`` (q ``Hq`` heads, k / v ``Hk``); query head ``h`` reads kv head ``h // G``,
``G = Hq / Hk``. A work unit is one kv head of one batch row with (some of) its G query heads: its
``K^T [D, S]`` (DMA transpose) and ``V [128, S/128, D]`` stay resident in SBUF while every query tile
of those heads streams past them, so K and V are read from HBM once per unit. The unit's heads take
their query tiles in turn (:func:`_steps`), so ``Q^T`` is loaded and the output stored per chunk of
about eight head-tiles, every head of the unit in one DMA each (the output's HBM rows then hold
``ng * D`` contiguous values, not one head's 256 bytes: fewer, longer DMA packets), the log-sum-exp of
the whole unit at its end (one activation-table switch per unit for the ``log``).

A query tile is 128 rows (partitions); its keys ``0 .. r0 + 127`` (causal: the tiles above the
diagonal are skipped) go in steps of up to :func:`step_keys` keys (4,096 while K, V and the step's
tiles fit SBUF: one step per tile at S = 4,096):

1. Tensor: ``S = Q K^T`` in PSUM tiles of up to 4 banks (:func:`_bank_groups`), one matmul per 512-key
   bank (``Q^T`` stationary, ``K^T`` moving); on the diagonal bank a second matmul adds the causal
   mask into the same PSUM (``I @ mask``). Vector empties each tile in ONE instruction while the next
   is written (one PSUM access set-up per up to 2,048 scores): ``-scale * S`` into the step's fp32
   SBUF tile and its row minimum (``-scale * max``) in the same pass (``tensor_scalar_reduce``).
   GpSimd: the tiles' minima pairwise, and the running ``-m`` over the tile's steps (small SBUF columns).
2. Scalar: ``P = exp(scale * S - m)`` of the whole step in ONE instruction from SBUF (its fixed time
   paid once per step, not per bank) with the fp32 row sum in the same pass; the correction
   ``exp(m_old - m)`` on later steps.
3. ``P^T`` per 128 keys: most blocks by DMA transposes (SBUF -> SBUF, up to 32 blocks each), the rest
   by PE transposes copied out of PSUM by Vector or Scalar; the split follows trace-time estimates of
   each engine's work so far (:func:`_pe_blocks`). GpSimd: ``l = l * corr + rowsum`` and ``1 / l``.
4. Tensor: ``O_step = P V`` accumulated over the step's keys in one PSUM bank; on a tile's later steps
   Vector ``O = O * corr + O_step``; after the last step ``o = O * (1 / l)``, rounded once, and ``l``,
   ``-m`` kept for the unit's ``lse = m + log(l)``.

All steps of a launch form one software pipeline (:func:`_pipeline`; per unit when two units' K / V
would not fit SBUF) in which each stage runs a fixed number of steps behind the scores, so that no
engine's in-order queue waits on work issued in the same iteration; a head's tiles alternate shortest
and longest (:func:`_tile_order`) so those distances stay about constant in time. The engine choices
(PSUM copies, the P^T split) follow trace-time estimates of each engine's work written with the cost
model's rates. The unit's ``lse`` is transposed on the PE and stored one row per query tile. LNC=2
(``kernel[2]``) gives each core whole (batch, kv head) units when they split evenly, else splits the
query heads of each group (:func:`~trnkit.kernels.attention.tiling.work_units`); every trace-time choice
depends on shapes only, so both cores issue the same instructions.

Why not 70% of TensorE's peak (trn2 cost model, mid, bf16, S = 4,096, 8 / 2 heads, LNC=1): Vector must
read every fp32 score from PSUM once for the row max (GpSimd and DMA cannot read PSUM, Scalar's
reduction only adds): 563 us of streaming plus its access set-ups, 591 us with these 4-bank reads, 579
us at the 8 banks one instruction may read, against the 621 us that 70% allows; Scalar's exponentials
take 540 us. The 4,224 ``P^T`` blocks (184 ns of DMA each, or a 53 ns PE transpose plus a 69 ns Vector /
116 ns Scalar copy at best) and the 256 output tiles do not fit the time the engines have left: the best
balance is 646.8 us (67.2%). Only forming ``S^T`` a second time on TensorE (the shift added there, so
Scalar's exp writes ``P^T`` itself) gets the balance under 621 us, to 609.5 us, with every engine busy
98% of the time; tried, it did not pay (docs/kernel-design.md "What bounds the forward": the arithmetic,
that trial and the other routes).
"""

from __future__ import annotations

from trnkit.kernels._common import cdiv
from trnkit.kernels.attention.tiling import (
    ACT_FIXED_NS,
    SCALAR_GHZ,
    VECTOR_GHZ,
    P,
    causal_mask,
    cheaper_engine,
    load_kT,
    load_v,
    needs_scratch,
    work_units,
)
from trnkit.kernels.tiles import accumulate, identity, program_split, psum_tiles
from trnkit.nki_api import nisa, nki, nl

BANK = 512  # keys per PSUM bank of fp32 scores (gemm_moving_fmax)
QCHUNK = 8  # head-tiles (query tiles x heads of the unit) per Q^T load and per output store
# Pipeline distances (in steps) of the exp, the P^T transposes, P V and o = O / l behind the scores:
# P^T of a step arrives by DMA several microseconds after its exp, while two consecutive steps (a
# short and a long tile) take about as long as one long tile's scores (chosen on the cost model)
LAG_EXP, LAG_T, LAG_PV, LAG_FINISH = 2, 4, 6, 8
DMA_BLOCKS = 32  # most 128-key blocks per DMA transpose (8 KiB rows: 97% packet efficiency)
KV_PIECES = 4  # DMAs per resident K^T / V load (the first tiles start on the first piece)
# Score banks per PSUM tile and Vector read (one access set-up per group, not per bank: the architecture
# guide's "up to ... 4K elements for PSUM" per instruction allows 8 fp32 banks), and the most banks two
# consecutive groups hold (the rest of the 8 banks: the P V tiles waiting for o = O / l)
GROUP_BANKS, LIVE_SCORE_BANKS = 4, 7
SHORT_STEP_BANKS = 2  # steps of at most this many banks are read bank by bank (:func:`_bank_groups`)
PSUM_READ_CYCLES = 60  # VectorE's PSUM access setup per instruction (performance guide; a range in the model)
SBUF_BUDGET = 160 * 1024  # bytes per partition the resident K / V and the pipelined step tiles may take
# Trace-time engine rates for the engine balancing (trn2): TensorE clock; DMA (:func:`_dma_ns`): 16
# engines of 23 B/ns, a transpose at 0.7 of a copy's rate from HBM and 0.5 SBUF -> SBUF, each packet
# at b / (b + 256) efficiency for b contiguous bytes (the DMA bandwidth guide's knee).
TENSOR_GHZ = 2.4
DMA_BYTES_PER_NS = 16 * 23
DMA_KNEE = 256
HBM_TRANSPOSE, SBUF_TRANSPOSE = 0.7, 0.5
# A P^T block goes to the PE path only if its engines would finish it before 98% of the DMA path's time:
# the DMA queues take each transfer once its data is ready, while Vector and Scalar run in order and also
# wait on dependencies, so the DMA side is planned slightly busier (chosen on the cost model at S = 4,096)
DMA_SHARE = 0.98


def _dma_ns(nbytes, run, factor=1.0):
    """Estimated DMA time of ``nbytes`` moved in contiguous runs of ``run`` bytes, at ``factor`` of a
    copy's rate."""
    return nbytes * (run + DMA_KNEE) / (run * DMA_BYTES_PER_NS * factor)


def _itemsize(dtype):
    """Bytes per element of the kernel's dtypes (fp32 or bf16)."""
    return 4 if dtype == nl.float32 else 2


def chunk_tiles(ng):
    """Query tiles per chunk of a unit of ``ng`` query heads: a chunk is those tiles of every head of the
    unit (each head's Q^T of them one DMA, the output of all heads one store whose HBM rows are the
    heads' consecutive ``ng * D`` values), about QCHUNK head-tiles in all."""
    return max(1, QCHUNK // ng)


def _budget_used(S, itemsize, D, step, ng=1):
    """SBUF bytes per partition of one unit's resident ``K^T`` / ``V``, two open chunks (each head's Q^T
    and output tiles) and the pipelined tiles of ``step``-key steps (two fp32 score tiles, two of
    probabilities, three of ``P^T`` in flight)."""
    spad = cdiv(S, P) * P
    chunks = 2 * ng * chunk_tiles(ng) * (P + D) * itemsize
    resident = spad * itemsize + cdiv(S, P) * D * itemsize + chunks
    return resident + (2 * 4 + 5 * itemsize) * step


def step_keys(S: int, itemsize: int, D: int, ng: int = 1) -> int:
    """Keys per pipeline step: the largest of 4096 / 2048 / 1024 / 512 whose tiles fit
    (:func:`_budget_used` within ``SBUF_BUDGET``)."""
    for step in (4096, 2048, 1024):
        if _budget_used(S, itemsize, D, step, ng) <= SBUF_BUDGET:
            return step
    return BANK


# ``load``: estimated busy ns per engine so far (trace time, shapes only), indexed by these; the first
# two are the [Vector, Scalar] pair :func:`cheaper_engine` updates.
VEC, ACT, PE, DMA = 0, 1, 2, 3


def _tile_order(nqt):
    """Query tiles in the order a head visits them: longest and shortest alternating (n-1, 0, n-2, 1,
    ...), so every two consecutive tiles hold about the same work and the pipeline's stages keep a
    steady distance in time (in index order the work per step would ramp up along each head); the launch
    ends on middle-length tiles (long-first measured 3 us shorter than short-first at S = 4,096)."""
    out = []
    for i in range(nqt // 2):
        out.append(nqt - 1 - i)
        out.append(i)
    if nqt % 2 == 1:
        out.append(nqt // 2)
    return out


def _steps(S, g0, ng, j, G, step):
    """The unit's pipeline steps: its query tiles in pairs of :func:`_tile_order` (a short and a long
    one), each pair for every head of the unit in turn, each tile's causal keys in ``step`` chunks. A
    chunk (:func:`chunk_tiles` consecutive tiles of every head) loads a head's Q^T at that head's first
    step in it and is stored, all heads in one DMA, after its last visited tile."""
    out = []
    nqt = cdiv(S, P)
    order = _tile_order(nqt)
    qc = chunk_tiles(ng)
    seen = [0] * cdiv(nqt, qc)
    for i0 in range(0, nqt, 2):
        for g in range(g0, g0 + ng):
            for qt in order[i0:i0 + 2]:
                r0 = qt * P
                nq = min(P, S - r0)
                nkeys = r0 + nq
                nsec = cdiv(nkeys, step)
                ch = qt // qc
                ntiles = min(qc, nqt - ch * qc)
                seen[ch] = seen[ch] + 1
                for s in range(nsec):
                    out.append({"h": j * G + g, "gi": g - g0, "r0": r0, "nq": nq, "k0": s * step,
                                "k1": min(nkeys, (s + 1) * step), "first": s == 0, "last": s == nsec - 1,
                                "col": (g - g0) * nqt + qt, "ct": qt % qc, "chunk": ch,
                                "chunk_r0": ch * qc * P, "chunk_tiles": ntiles,
                                "chunk_last": seen[ch] == ntiles * ng and s == nsec - 1,
                                "all_pe": False})  # (the fixed-shift forward sets it on its last steps)
    return out


def _load_chunk(st, q):
    """The chunk's Q^T ``[D, ng, tiles * P]`` (every head of the unit: one DMA transpose) and output tile
    ``[P, tiles, ng * D]``, at the chunk's first step."""
    u = st["u"]
    S, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    ng = u["unit"][3]
    qc = chunk_tiles(ng)
    if st["chunk"] not in u["qT"]:
        n = min(qc * P, S - st["chunk_r0"])
        qT = nl.ndarray((D, ng, qc * P), dtype=q.dtype, buffer=nl.sbuf)
        src = q.ap(pattern=[[Hq * D, n], [1, 1], [D, ng], [1, D]],
                   offset=((st["b"] * S + st["chunk_r0"]) * Hq + u["heads"][0]) * D)
        nisa.dma_transpose(dst=qT.ap(pattern=[[ng * qc * P, D], [1, 1], [qc * P, ng], [1, n]]), src=src)
        isz = _itemsize(q.dtype)
        st["load"][DMA] = st["load"][DMA] + _dma_ns(n * ng * D * isz, n * ng * isz, HBM_TRANSPOSE)
        u["qT"][st["chunk"]] = qT
        u["oc"][st["chunk"]] = nl.ndarray((P, qc, ng * D), dtype=q.dtype, buffer=nl.sbuf)
    st["qT"], st["oc"] = u["qT"][st["chunk"]][:, st["gi"], :], u["oc"][st["chunk"]]


def _bank_groups(nb):
    """The step's ``nb`` score banks in groups ``(first bank, banks)``, one PSUM tile and one Vector read
    each: at most GROUP_BANKS banks, and two consecutive groups (the one Vector reads while TensorE
    writes the next) at most LIVE_SCORE_BANKS together. A step of at most SHORT_STEP_BANKS banks goes
    bank by bank (Vector starts on its first bank while TensorE forms the next: a short launch, where
    such steps are most of the work, is bound by that latency, not by Vector's set-ups)."""
    cap = GROUP_BANKS
    if nb <= SHORT_STEP_BANKS:
        cap = 1
    out = []
    b = 0
    prev = 0
    while b < nb:
        n = min(cap, LIVE_SCORE_BANKS - prev, nb - b)
        out.append((b, n))
        b = b + n
        prev = n
    return out


def score_group(st, kT, ident, mask, D, g0, nbg, gw, load):
    """One PSUM score group of a step (Tensor): a matmul per bank of the tile's ``Q^T`` against ``K^T``
    columns ``g0 .. g0 + gw``, and the causal mask added on the diagonal bank. Returns the group's PSUM tile."""
    r0, nq, k1 = st["r0"], st["nq"], st["k1"]
    c0 = st["ct"] * P
    s_ps = nl.ndarray((nq, gw), dtype=nl.float32, buffer=nl.psum)
    for bi in range(nbg):  # one matmul per bank of the group's tile
        kb0 = g0 + bi * BANK
        wb = min(BANK, k1 - kb0)
        c = bi * BANK
        nisa.nc_matmul(dst=s_ps[:, c:c + wb], stationary=st["qT"][:, c0:c0 + nq],
                       moving=kT[0:D, kb0:kb0 + wb], accumulate=False)
        load[PE] = load[PE] + max(64, wb) / TENSOR_GHZ
        if kb0 <= r0 and r0 < kb0 + wb:  # the diagonal block: add the causal mask
            nisa.nc_matmul(dst=s_ps[:, c + r0 - kb0:c + r0 - kb0 + nq], stationary=ident[0:nq, 0:nq],
                           moving=mask[0:nq, 0:nq], accumulate=True)
            load[PE] = load[PE] + max(64, nq) / TENSOR_GHZ
    return s_ps


def _scores(st, q, kT, ident, mask, negm_all, load):
    """Stage 1: Q^T (first step of a chunk), the score banks and the causal mask (Tensor); each bank
    emptied into ``scale * S`` (fp32, SBUF) with its row max (Vector), then the step's ``-max``."""
    nq, k0, k1, scale = st["nq"], st["k0"], st["k1"], st["scale"]
    D = q.shape[3]
    _load_chunk(st, q)
    w = k1 - k0
    nb = cdiv(w, BANK)
    s_sb = nl.ndarray((nq, w), dtype=nl.float32, buffer=nl.sbuf)
    nm = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
    if st["first"] and st["last"]:  # the tile's only step: its -max is final
        nm = negm_all[0:nq, st["col"]:st["col"] + 1]
    groups = _bank_groups(nb)
    ng = len(groups)
    bm = nm
    if ng > 1:
        bm = nl.ndarray((nq, ng), dtype=nl.float32, buffer=nl.sbuf)
    pending = None
    for i in range(ng + 1):
        if i < ng:
            b0, nbg = groups[i]
            g0 = k0 + b0 * BANK
            gw = min(nbg * BANK, k1 - g0)
            s_ps = score_group(st, kT, ident, mask, D, g0, nbg, gw, load)
        if pending != None:  # noqa: E711 (NKI rejects `is`); the previous group, while this one is formed
            pi, pg0, pw, p_ps = pending
            # -scale * S and its row min (= -scale * max: the exp's bias needs no negation), all of the
            # group's banks in one instruction
            nisa.tensor_scalar_reduce(dst=s_sb[:, pg0 - k0:pg0 - k0 + pw], data=p_ps, op0=nl.multiply,
                                      operand0=-scale, reduce_op=nl.minimum, reduce_res=bm[:, pi:pi + 1])
            load[VEC] = load[VEC] + (max(64, pw) + PSUM_READ_CYCLES) / VECTOR_GHZ
        pending = None
        if i < ng:
            pending = (i, g0, gw, s_ps)
    n = ng
    while n > 1:  # the groups' minima pairwise on GpSimd (small SBUF columns), the last pair into nm
        h = n // 2
        dst = nm if n == 2 else bm[:, 0:h]
        nisa.tensor_tensor(dst=dst, data1=bm[:, 0:h], data2=bm[:, n - h:n], op=nl.minimum, engine=nisa.engine.gpsimd)
        n = n - h
    st["s_sb"], st["nm"] = s_sb, nm


def _neg_max(st, negm_all):
    """``-m`` of the running row max over the tile's steps so far (GpSimd; small SBUF columns), written
    into the unit's column ``col`` by the tile's last step."""
    prev, nq = st["prev"], st["nq"]
    negm = st["nm"]
    if prev != None:  # noqa: E711
        negm = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        if st["last"]:
            negm = negm_all[0:nq, st["col"]:st["col"] + 1]
        nisa.tensor_tensor(dst=negm, data1=st["nm"], data2=prev["negm"], op=nl.minimum, engine=nisa.engine.gpsimd)
    st["negm"] = negm


def _exp(st, load):
    """Stage 2: ``P = exp(scale * S - m)`` of the step (one instruction) with its row sum; the
    correction factor ``exp(m_old - m)`` on a tile's later steps."""
    nq, prev = st["nq"], st["prev"]
    w = st["k1"] - st["k0"]
    p_sb = nl.ndarray((nq, w), dtype=st["pdt"], buffer=nl.sbuf)
    rs = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p_sb, op=nl.exp, data=st["s_sb"], bias=st["negm"], scale=-1.0, reduce_op=nl.add,
                    reduce_res=rs, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    load[ACT] = load[ACT] + (max(64, w) + 64) / SCALAR_GHZ + ACT_FIXED_NS
    if prev != None:  # noqa: E711
        corr = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=corr, op=nl.exp, data=prev["negm"], scale=-1.0, bias=st["negm"])
        load[ACT] = load[ACT] + 64 / SCALAR_GHZ + ACT_FIXED_NS
        st["corr"] = corr
    st["s_sb"], st["p"], st["rs"] = None, p_sb, rs


def _blocks_per_bank(itemsize):
    """128-key ``P^T`` blocks of ``itemsize``-byte elements per PSUM bank (2 KiB per partition)."""
    return BANK * 4 // (P * itemsize)


def _pe_blocks(load, nfull, nq, itemsize, step):
    """How many of a step's ``nfull`` full 128-key blocks go to PE transposes (the rest: one DMA
    transpose): each block to whichever path's engines would finish it first given the work so far
    (the DMA side weighted by ``DMA_SHARE``), the count then rounded to whole PSUM banks where the
    launch's steps (``step`` keys, at most S) span two banks or more."""
    dma_ns = _dma_ns(P * nq * itemsize, DMA_BLOCKS * nq * itemsize, SBUF_TRANSPOSE)  # (a full transfer's rate)
    pe_ns = max(64, nq) / TENSOR_GHZ
    copy_v = max(64, nq / 2 if itemsize == 2 else nq) / VECTOR_GHZ
    copy_s = nq / SCALAR_GHZ + ACT_FIXED_NS / 8
    d, t, v, s = load[DMA], load[PE], load[VEC], load[ACT]
    n_pe = 0
    for _ in range(nfull):
        by_pe = max(t + pe_ns, min(v + copy_v, s + copy_s))
        if by_pe < (d + dma_ns) * DMA_SHARE:
            n_pe = n_pe + 1
            t = t + pe_ns
            if v + copy_v <= s + copy_s:
                v = v + copy_v
            else:
                s = s + copy_s
        else:
            d = d + dma_ns
    # whole PSUM banks of PE blocks (8 bf16 / 4 fp32), rounded to the nearer: each copy out of PSUM pays
    # its fixed time (Scalar's ACTIVATE, Vector's access set-up) for a full bank, not for a few blocks
    per_bank = _blocks_per_bank(itemsize)
    if step < 2 * per_bank * P:  # short steps (S <= 1,024): too few blocks to fill banks; a short
        load[DMA] = d  # launch is latency-bound and the rounding would move its blocks to the DMA queues
        return n_pe
    whole = n_pe // per_bank * per_bank
    if n_pe - whole >= per_bank // 2 and whole + per_bank <= nfull:
        whole = whole + per_bank
    load[DMA] = d + (n_pe - whole) * dma_ns
    return whole


def _transpose(st, load):
    """Stage 3: ``P^T [keys, nsub, q]`` per 128-key block: the first blocks by one DMA transpose
    (SBUF -> SBUF), the others (and a short last block) by PE transposes into PSUM tiles of up to a
    bank, each copied out by Vector or Scalar, whichever has less work (every block by the PE on a step
    marked ``all_pe``: the fixed-shift forward's drain)."""
    nq, pdt, p_sb = st["nq"], st["pdt"], st["p"]
    w = st["k1"] - st["k0"]
    nsub = cdiv(w, P)
    nfull = w // P
    two_byte = pdt != nl.float32
    itemsize = 2 if two_byte else 4
    pt = nl.ndarray((P, nsub, nq), dtype=pdt, buffer=nl.sbuf)
    n_pe = nfull if st["all_pe"] else _pe_blocks(load, nfull, nq, itemsize, st["step_keys"])
    n_dma = nfull - n_pe
    for d0 in range(0, n_dma, DMA_BLOCKS):
        nd = min(DMA_BLOCKS, n_dma - d0)
        # (_pe_blocks counted a full transfer's rate; a shorter one has shorter packets)
        load[DMA] = load[DMA] + _dma_ns(nd * P * nq * itemsize, nd * nq * itemsize, SBUF_TRANSPOSE) \
            - nd * _dma_ns(P * nq * itemsize, DMA_BLOCKS * nq * itemsize, SBUF_TRANSPOSE)
        nisa.dma_transpose(dst=pt.ap(pattern=[[nsub * nq, P], [1, 1], [nq, nd], [1, nq]], offset=d0 * nq),
                           src=p_sb.ap(pattern=[[w, nq], [1, 1], [P, nd], [1, P]], offset=d0 * P))
    per_tile = _blocks_per_bank(itemsize)
    for c0 in range(n_dma, nsub, per_tile):
        n = min(per_tile, nsub - c0)
        pt_ps = nl.ndarray((P, n, nq), dtype=pdt, buffer=nl.psum)
        for c in range(n):
            kc = min(P, w - (c0 + c) * P)
            nisa.nc_transpose(dst=pt_ps[0:kc, c, :], data=p_sb[:, (c0 + c) * P:(c0 + c) * P + kc])
            load[PE] = load[PE] + max(64, nq) / TENSOR_GHZ
        nfull_here = n if (c0 + n) * P <= w else n - 1  # only the step's last block can be short
        parts = []
        if nfull_here > 0:
            parts.append([P, 0, nfull_here])
        if nfull_here < n:
            parts.append([w - (c0 + n - 1) * P, nfull_here, n])
        for pi in range(len(parts)):
            kc, a, z = parts[pi]
            if cheaper_engine(load, (z - a) * nq, two_byte, PSUM_READ_CYCLES) == 0:
                nisa.tensor_copy(dst=pt[0:kc, c0 + a:c0 + z, :], src=pt_ps[0:kc, a:z, :])
            else:
                nisa.activation(dst=pt[0:kc, c0 + a:c0 + z, :], op=nl.copy, data=pt_ps[0:kc, a:z, :])
    st["p"], st["pt"] = None, pt


def _row_sum(st, l_all):
    """The running sum ``l = l * corr + rowsum`` (GpSimd; a tile's last step writes it into the unit's
    column ``col``)."""
    nq, step, prev = st["nq"], st["rs"], st["prev"]
    ls = step
    if prev != None:  # noqa: E711
        ls = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=ls, data1=prev["l"], data2=st["corr"], op=nl.multiply, engine=nisa.engine.gpsimd)
    if st["last"]:
        dst = l_all[0:nq, st["col"]:st["col"] + 1]
        if prev != None:  # noqa: E711
            nisa.tensor_tensor(dst=dst, data1=ls, data2=step, op=nl.add, engine=nisa.engine.gpsimd)
        else:
            nisa.tensor_copy(dst=dst, src=step, engine=nisa.engine.gpsimd)
        ls = dst
    elif prev != None:  # noqa: E711
        nisa.tensor_tensor(dst=ls, data1=ls, data2=step, op=nl.add, engine=nisa.engine.gpsimd)
    st["l"] = ls
    if st["last"]:  # 1 / l for the tile's output, long before it is needed (no ALU divide: NKI's operator table)
        rl = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=rl, data=ls)
        st["rl"] = rl


def _pv(st, v_sb, load):
    """Stage 4: ``O_step = P V`` over the step's keys, one PSUM accumulation group."""
    nq, D, pt = st["nq"], v_sb.shape[2], st["pt"]
    k0, w = st["k0"], st["k1"] - st["k0"]
    nsub = cdiv(w, P)
    operands = []
    for c in range(nsub):
        kc = min(P, w - c * P)
        operands.append([(pt[0:kc, c, :], v_sb[0:kc, k0 // P + c, :])])
    pv_ps = psum_tiles([(nq, D)])[0]
    accumulate([pv_ps], operands)
    load[PE] = load[PE] + nsub * max(64, D) / TENSOR_GHZ
    st["pt"], st["pv"] = None, pv_ps


def _o_update(st, load):
    """Stage 5: the running output ``O = O * corr + O_step`` (fp32, SBUF; a tile's only step stays in PSUM)."""
    nq, pv_ps, prev = st["nq"], st["pv"], st["prev"]
    acc = pv_ps
    if prev != None:  # noqa: E711
        acc = nl.ndarray((nq, pv_ps.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=acc, data=prev["o"], op0=nl.multiply, operand0=st["corr"], op1=nl.add,
                                  operand1=pv_ps)
        load[VEC] = load[VEC] + 2 * pv_ps.shape[1] / VECTOR_GHZ
        prev["o"] = None
    elif not st["last"]:
        acc = nl.ndarray((nq, pv_ps.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        if cheaper_engine(load, pv_ps.shape[1], False, PSUM_READ_CYCLES) == 0:
            nisa.tensor_copy(dst=acc, src=pv_ps)
        else:
            nisa.activation(dst=acc, op=nl.copy, data=pv_ps)
    st["pv"], st["o"] = None, acc


def _finish(st, outs, load):
    """Stage 6 (a tile's last step): ``o = O / l`` rounded once into the chunk's output tile; the
    chunk's last tile stores it, every head of the unit in one DMA (HBM rows of ``ng * D`` values)."""
    o = outs[0]
    S, Hq, D = o.shape[1], o.shape[2], o.shape[3]
    nq, ct, rl, gi = st["nq"], st["ct"], st["rl"], st["gi"]
    dst = st["oc"][0:nq, ct, gi * D:(gi + 1) * D]
    if cheaper_engine(load, D, False, PSUM_READ_CYCLES) == 0:
        nisa.tensor_scalar(dst=dst, data=st["o"], op0=nl.multiply, operand0=rl)
    else:
        nisa.activation(dst=dst, op=nl.copy, data=st["o"], scale=rl)
    st["o"] = None  # (may be the PSUM tile: its accumulation group closes)
    if st["chunk_last"]:  # the chunk's full tiles in one DMA, a short last tile (S % 128) in another
        n = st["chunk_tiles"]
        c0 = st["chunk_r0"]
        ng = st["u"]["unit"][3]
        h0 = st["u"]["heads"][0]
        nfull = min(n, (S - c0) // P)
        base = ((st["ob"] * S + c0) * Hq + h0) * D
        if nfull > 0:
            nisa.dma_copy(dst=o.ap(pattern=[[Hq * D, P], [P * Hq * D, nfull], [1, ng * D]], offset=base),
                          src=st["oc"][:, 0:nfull, :])
        if nfull < n:
            rem = S - c0 - nfull * P
            nisa.dma_copy(dst=o.ap(pattern=[[Hq * D, rem], [1, ng * D]], offset=base + nfull * P * Hq * D),
                          src=st["oc"][0:rem, nfull, :])
        row = ng * D * _itemsize(o.dtype)  # the unit's heads of one row: the contiguous run in HBM
        load[DMA] = load[DMA] + _dma_ns(n * P * row, row)


def _store_lse(unit_heads, l_all, negm_all, lse, ob, S, load):
    """``lse = log(l) - (-m)`` of every tile of the unit (one ``log``: one activation-table switch per
    unit), transposed on the PE (tiles on partitions, 128 rows of up to 128 tiles at a time) so that each
    stored row is one tile's 128 contiguous fp32 values (a store from the query-on-partition layout would
    write 4-byte runs). The unit's heads are consecutive, so with S a multiple of 128 each transposed
    block is one DMA; otherwise each head's full tiles and its short last tile go separately."""
    lg = nl.ndarray(l_all.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lg, op=nl.log, data=l_all)
    lse_t = nl.ndarray(l_all.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lse_t, data1=lg, data2=negm_all, op=nl.subtract)
    nqt = cdiv(S, P)
    ncols = len(unit_heads) * nqt
    base = (ob * lse.shape[1] + unit_heads[0]) * S
    for c0 in range(0, ncols, P):
        n = min(P, ncols - c0)
        t_ps = nl.ndarray((n, P), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=t_ps, data=lse_t[:, c0:c0 + n])
        t_sb = nl.ndarray((n, P), dtype=nl.float32, buffer=nl.sbuf)
        if cheaper_engine(load, P, False, PSUM_READ_CYCLES) == 0:
            nisa.tensor_copy(dst=t_sb, src=t_ps)
        else:
            nisa.activation(dst=t_sb, op=nl.copy, data=t_ps)
        if S % P == 0:  # row r (head r // nqt, tile r % nqt) at base + r * P
            nisa.dma_copy(dst=lse.ap(pattern=[[P, n], [1, P]], offset=base + c0 * P), src=t_sb)
            continue
        for hi in range(c0 // nqt, cdiv(c0 + n, nqt)):
            r0 = max(c0, hi * nqt)
            r1 = min(c0 + n, (hi + 1) * nqt)
            full = min(r1, (hi + 1) * nqt - 1) - r0  # the head's last tile is the short one
            if full > 0:
                nisa.dma_copy(dst=lse.ap(pattern=[[P, full], [1, P]], offset=base + hi * S + (r0 - hi * nqt) * P),
                              src=t_sb[r0 - c0:r0 - c0 + full, :])
            if r1 == (hi + 1) * nqt:
                rem = S - (nqt - 1) * P
                nisa.dma_copy(dst=lse.ap(pattern=[[rem, 1], [1, rem]], offset=base + hi * S + (nqt - 1) * P),
                              src=t_sb[r1 - 1 - c0:r1 - c0, 0:rem])


def _at(steps, t):
    """``steps[t]`` when t is a step index, else None (pipeline fill and drain)."""
    if 0 <= t and t < len(steps):
        return steps[t]
    return None


def _open_unit(st, q, k, v):
    """A unit's first step: its first Q^T chunk, then its resident ``K^T`` (in pieces) and its per-tile
    columns ``l`` (row sums) and ``-m`` (column ``(head - g0) * nqt + tile``). ``V`` follows the second
    step's Q^T chunk (:func:`_pipeline`): P V needs it only steps later."""
    u = st["u"]
    b, j, _, ng, _ = u["unit"]
    S, D = q.shape[1], q.shape[3]
    nqt = cdiv(S, P)
    _load_chunk(st, q)
    u["kT"] = load_kT(k, b, j, D, KV_PIECES)
    isz = _itemsize(q.dtype)
    per = cdiv(cdiv(S, P), KV_PIECES) * P  # keys per K^T piece: its bytes per partition
    st["load"][DMA] = st["load"][DMA] + _dma_ns(S * D * isz, per * isz, HBM_TRANSPOSE) + _dma_ns(S * D * isz, D * isz)
    u["l_all"] = nl.ndarray((P, ng * nqt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=u["l_all"], value=1.0)  # (rows past S of a short last tile: log(1))
    u["negm_all"] = nl.ndarray((P, ng * nqt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=u["negm_all"], value=0.0)


def pipeline_steps(units, q, k, scale, outs_of, load, unit0=0):
    """Every step of one software pipeline over ``units``, in issue order: each carries its unit (``u``: the
    unit, its outputs, its query heads, its column ``bad_col = unit0 + i`` of the fixed-shift forward's
    certificate tile), the step before it in its tile and its place in the unit. Shared by both forwards."""
    S, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    G = Hq // k.shape[2]
    step = step_keys(S, _itemsize(q.dtype), D, units[0][3])
    steps = []
    for ui in range(len(units)):
        b, j, g0, ng, _ = units[ui]
        outs = outs_of[ui]
        heads = []
        for g in range(g0, g0 + ng):
            heads.append(j * G + g)
        u = {"unit": units[ui], "outs": outs, "heads": heads, "qT": {}, "oc": {}, "bad_col": unit0 + ui,
             "ob": b if outs[0].shape[0] > 1 else 0}  # (the scratch outputs hold one batch row)
        us = _steps(S, g0, ng, j, G, step)
        for i in range(len(us)):
            us[i]["u"], us[i]["b"], us[i]["ob"], us[i]["scale"], us[i]["pdt"] = u, b, u["ob"], scale, q.dtype
            us[i]["load"], us[i]["step_keys"] = load, min(step, S)
            us[i]["prev"] = None if us[i]["first"] else us[i - 1]
            us[i]["unit_first"], us[i]["unit_last"] = i == 0, i == len(us) - 1
            us[i]["load_v"] = i == min(1, len(us) - 1)
            steps.append(us[i])
    return steps


def _pipeline(units, q, k, v, scale, outs_of, ident, mask, load):
    """The software-pipelined steps of one or more work units (one continuous pipeline: the next unit's
    first steps overlap the last ones' drain).

    Iteration t issues, per engine in this order, so that each instruction's inputs were produced at
    least one stage earlier: Tensor S(t), P^T(t-2), PV(t-LAG_PV); Vector the banks of S(t), P^T copies
    (t-2), O (t-LAG_PV-1), o = O / l (t-LAG_FINISH); GpSimd -m (t), l (t-2); Scalar exp (t-1), P^T
    copies (t-2); DMA P^T (t-2).
    """
    S = q.shape[1]
    steps = pipeline_steps(units, q, k, scale, outs_of, load)
    for t in range(len(steps) + LAG_FINISH):
        cur = _at(steps, t)
        if cur != None:  # noqa: E711
            if cur["unit_first"]:
                _open_unit(cur, q, k, v)
            _scores(cur, q, cur["u"]["kT"], ident, mask, cur["u"]["negm_all"], load)
            if cur["load_v"]:
                cur["u"]["v"] = load_v(v, cur["b"], cur["u"]["unit"][1], KV_PIECES)
            _neg_max(cur, cur["u"]["negm_all"])
        if _at(steps, t - LAG_EXP) != None:  # noqa: E711
            _exp(steps[t - LAG_EXP], load)
        if _at(steps, t - LAG_T) != None:  # noqa: E711
            _transpose(steps[t - LAG_T], load)
            _row_sum(steps[t - LAG_T], steps[t - LAG_T]["u"]["l_all"])
        if _at(steps, t - LAG_PV) != None:  # noqa: E711
            _pv(steps[t - LAG_PV], steps[t - LAG_PV]["u"]["v"], load)
        if _at(steps, t - LAG_PV - 1) != None:  # noqa: E711
            _o_update(steps[t - LAG_PV - 1], load)
        done = _at(steps, t - LAG_FINISH)
        if done != None and done["last"]:  # noqa: E711
            _finish(done, done["u"]["outs"], load)
        if done != None and done["unit_last"]:  # noqa: E711
            u = done["u"]
            _store_lse(u["heads"], u["l_all"], u["negm_all"], u["outs"][1], u["ob"], S, load)


def one_pipeline(S: int, itemsize: int, D: int, ng: int = 1) -> bool:
    """Whether two units' resident ``K^T`` and ``V`` fit SBUF next to the step tiles, so that all units
    of a launch run as one pipeline (else each unit drains before the next one loads)."""
    spad = cdiv(S, P) * P
    resident = spad * itemsize + cdiv(S, P) * D * itemsize
    return resident + _budget_used(S, itemsize, D, step_keys(S, itemsize, D, ng), ng) <= SBUF_BUDGET


def launch_outputs(q, k):
    """A forward launch's outputs and work: ``(o, lse, units, outs_of, (n_prog, pid))``, where ``units``
    are this program's work units and ``outs_of[u]`` the ``(o, lse)`` pair unit ``u`` writes (the
    scratch pair for an LNC=2 padding unit). Shared by both forwards."""
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    G = Hq // Hk
    o = nl.ndarray((B, S, Hq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, S), dtype=nl.float32, buffer=nl.shared_hbm)
    n_prog, pid = program_split()
    # LNC=2: whole (batch, kv head) units per core when they split evenly (each core loads only its own
    # K and V), else the query heads of each group split between the cores
    split = (B * Hk) % n_prog != 0
    scratch = None
    if needs_scratch(B, Hk, G, n_prog, split):
        scratch = (nl.ndarray((1, S, Hq, D), dtype=q.dtype, buffer=nl.private_hbm),
                   nl.ndarray((1, Hq, S), dtype=nl.float32, buffer=nl.private_hbm))
    units = work_units(B, Hk, G, n_prog, pid, split)
    outs_of = []
    for u in range(len(units)):
        outs_of.append((o, lse) if units[u][4] else scratch)
    return o, lse, units, outs_of, (n_prog, pid)


@nki.jit
def attention_fwd_kernel(q, k, v, scale):
    """``(o [B, S, Hq, D] q.dtype, lse [B, Hq, S] fp32)``: causal attention of ``q [B, S, Hq, D]`` over
    ``k, v [B, S, Hk, D]`` (fp32 or bf16, one dtype), ``o_i = sum_j softmax_j(scale * q_i . k_j) v_j``
    over ``j <= i``, ``lse_i = log(sum_j exp(scale * q_i . k_j))``."""
    o, lse, units, outs_of, _ = launch_outputs(q, k)
    S, D = q.shape[1], q.shape[3]
    ident = identity(nl.bfloat16)
    mask = causal_mask(nl.bfloat16)
    load = [0.0, 0.0, 0.0, 0.0]
    if one_pipeline(S, _itemsize(q.dtype), D, units[0][3]):
        _pipeline(units, q, k, v, float(scale), outs_of, ident, mask, load)
    else:
        for u in range(len(units)):
            _pipeline([units[u]], q, k, v, float(scale), [outs_of[u]], ident, mask, load)
    return o, lse
