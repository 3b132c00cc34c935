"""Flash attention forward NKI kernel (``attention_fwd_kernel``): causal, GQA, online softmax, the
log-sum-exp saved for the backward; no ``[S, S]`` matrix anywhere but in on-chip tiles.

Layout ``[B, S, H, D]`` (q ``Hq`` heads, k / v ``Hk``); query head ``h`` reads kv head ``h // G``,
``G = Hq / Hk``. A work unit is one kv head of one batch row with (some of) its G query heads: its
``K^T [D, S]`` (DMA transpose) and ``V [128, S/128, D]`` stay resident in SBUF while every query tile
of those heads streams past them, so K and V are read from HBM once per unit. ``Q^T`` is loaded and
the output stored in chunks of eight query tiles (one DMA each), the log-sum-exp of the whole unit
at its end (one activation-table switch per unit for the ``log``).

A query tile is 128 rows (partitions); its keys ``0 .. r0 + 127`` (causal: the tiles above the
diagonal are skipped) go in steps of up to 1024 keys, two PSUM banks of fp32 scores:

1. Tensor: ``S = Q K^T`` per bank (``Q^T`` stationary, ``K^T`` moving, contraction over D); on the
   diagonal tile a second matmul adds the causal mask into the same PSUM (``I @ mask``).
   Vector: the row max per bank; ``-scale * m`` of the running max ``m`` (one op).
2. Scalar: ``P = exp(scale * S - scale * m)`` straight from PSUM (rounded to the input dtype) with the
   fp32 row sum of the step (accumulated over its banks in ScalarE's reduce registers); the correction
   ``exp(scale * (m_old - m))``. GpSimd: ``l = l * corr + rowsum``.
3. Tensor: ``P^T`` per 128-key block (PE transposes into one PSUM tile per step), copied to SBUF by
   Vector or Scalar, whichever has less work so far.
4. Tensor: ``O_step = P V`` accumulated over the step's keys in one PSUM bank; Vector
   ``O = O * corr + O_step``; after the last step
   ``o = O / l`` and ``l`` kept for the unit's ``lse = scale * m + log(l)``.

The steps of a unit are software-pipelined (six stages, :func:`_run_unit`) so that no engine's
in-order queue waits on work issued in the same iteration. LNC=2 (``kernel[2]``) splits the work
units between the two cores with one control flow (:func:`~trnkit.kernels.attention.tiling.work_units`).
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
    load_kv,
    needs_scratch,
    rows,
    tiles_view,
    work_units,
)
from trnkit.kernels.tiles import accumulate, identity, program_split
from trnkit.nki_api import nisa, nki, nl

BANK = 512  # keys per PSUM bank of fp32 scores (gemm_moving_fmax)
STEP = 1024  # keys per pipeline step of a query tile (two banks)
QCHUNK = 8  # query tiles per Q^T load and per output store
PSUM_READ_CYCLES = 60  # VectorE's PSUM access setup per instruction (performance guide; a range in the model)


def _steps(S, g0, ng, j, G):
    """The unit's pipeline steps: per query head and 128-row tile, its causal keys in STEP chunks."""
    out = []
    nqt = cdiv(S, P)
    for g in range(g0, g0 + ng):
        for qt in range(nqt):
            r0 = qt * P
            nq = min(P, S - r0)
            nkeys = r0 + nq
            nsec = cdiv(nkeys, STEP)
            ct = qt % QCHUNK
            for s in range(nsec):
                out.append({"h": j * G + g, "r0": r0, "nq": nq, "k0": s * STEP, "k1": min(nkeys, (s + 1) * STEP),
                            "first": s == 0, "last": s == nsec - 1, "col": (g - g0) * nqt + qt, "ct": ct,
                            "chunk_first": ct == 0 and s == 0,
                            "chunk_last": s == nsec - 1 and (ct == QCHUNK - 1 or qt == nqt - 1)})
    return out


def _scores(st, q, kT, ident, mask, load):
    """Stage 1: Q^T (first step of a chunk), the score banks, the causal mask, the per-bank row max
    (negated)."""
    b, h, r0, nq, k0, k1 = st["b"], st["h"], st["r0"], st["nq"], st["k0"], st["k1"]
    S, D = q.shape[1], q.shape[3]
    if st["chunk_first"]:
        n = min(QCHUNK * P, S - r0)
        qT = nl.ndarray((D, QCHUNK * P), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=qT[:, 0:n], src=rows(q, b, r0, n, h))
        st["qT"] = qT
        st["oc"] = nl.ndarray((P, QCHUNK, D), dtype=q.dtype, buffer=nl.sbuf)
    else:
        st["qT"], st["oc"] = st["before"]["qT"], st["before"]["oc"]
    c0 = st["ct"] * P
    nb = cdiv(k1 - k0, BANK)
    nbm = nl.ndarray((nq, nb), dtype=nl.float32, buffer=nl.sbuf)
    banks = []
    for i in range(nb):
        kb0 = k0 + i * BANK
        w = min(BANK, k1 - kb0)
        s_ps = nl.ndarray((nq, w), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=s_ps, stationary=st["qT"][:, c0:c0 + nq], moving=kT[0:D, kb0:kb0 + w], accumulate=False)
        if kb0 <= r0 and r0 < kb0 + w:  # the diagonal block: add the causal mask
            nisa.nc_matmul(dst=s_ps[:, r0 - kb0:r0 - kb0 + nq], stationary=ident[0:nq, 0:nq], moving=mask[0:nq, 0:nq],
                           accumulate=True)
        nisa.tensor_reduce(dst=nbm[:, i:i + 1], op=nl.maximum, data=s_ps, axis=1, negate=True)
        load[0] = load[0] + max(64, w) / VECTOR_GHZ
        banks.append([kb0, w, s_ps])
    st["banks"], st["nbm"] = banks, nbm


def _neg_max(st, negm_all, scale_col):
    """``-scale * m`` of the running row max ``m`` over the step's banks and the tile's earlier steps
    (the exponentials' bias; GpSimd: the operands are small SBUF columns). A tile's last step writes it
    into the unit's column ``col``."""
    nbm, prev, nq = st["nbm"], st["prev"], st["nq"]
    nm = nbm
    if nbm.shape[1] > 1:
        nm = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=nm, data1=nbm[:, 0:1], data2=nbm[:, 1:2], op=nl.minimum, engine=nisa.engine.gpsimd)
    if prev != None:  # noqa: E711 (NKI rejects `is`)
        nm2 = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=nm2, data1=nm, data2=prev["nm"], op=nl.minimum, engine=nisa.engine.gpsimd)
        nm = nm2
    negm = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
    if st["last"]:
        negm = negm_all[0:nq, st["col"]:st["col"] + 1]
    nisa.tensor_tensor(dst=negm, data1=nm, data2=scale_col[0:nq, :], op=nl.multiply, engine=nisa.engine.gpsimd)
    st["nm"], st["negm"] = nm, negm


def _exp(st, load):
    """Stage 2: P = exp(scale * S - scale * m) per bank with the step's row sum; the correction factor."""
    nq, scale, banks, prev = st["nq"], st["scale"], st["banks"], st["prev"]
    nb = len(banks)
    rs = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
    probs = []
    for i in range(nb):
        kb0, w, s_ps = banks[i]
        p_sb = nl.ndarray((nq, w), dtype=st["pdt"], buffer=nl.sbuf)
        cmd = nisa.reduce_cmd.reset_reduce if i == 0 else nisa.reduce_cmd.reduce
        if i == nb - 1:  # the row sum over the step's banks accumulates in ScalarE's registers; read once
            nisa.activation(dst=p_sb, op=nl.exp, data=s_ps, bias=st["negm"], scale=scale, reduce_op=nl.add,
                            reduce_res=rs, reduce_cmd=cmd)
        else:
            nisa.activation(dst=p_sb, op=nl.exp, data=s_ps, bias=st["negm"], scale=scale, reduce_op=nl.add,
                            reduce_cmd=cmd)
        load[1] = load[1] + (max(64, w) + (64 if i == nb - 1 else 0)) / SCALAR_GHZ + ACT_FIXED_NS
        probs.append([kb0, w, p_sb])
    st["banks"] = None  # the score banks are dead: their PSUM accumulation groups close
    if prev != None:  # noqa: E711
        corr = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=corr, op=nl.exp, data=prev["negm"], scale=-1.0, bias=st["negm"])
        load[1] = load[1] + 64 / SCALAR_GHZ + ACT_FIXED_NS
        st["corr"] = corr
    st["probs"], st["rs"] = probs, rs


def _transpose(st, load):
    """Stage 3: P^T per 128-key block (PE transposes into as few PSUM tiles as fit a bank: one per step in
    bf16), copied to SBUF by Vector or Scalar (a tile's full blocks in one instruction)."""
    nq, pdt = st["nq"], st["pdt"]
    two_byte = pdt != nl.float32
    subs = []  # (first key, keys, probabilities, column) per 128-key block
    for i in range(len(st["probs"])):
        kb0, w, p_sb = st["probs"][i]
        for c in range(cdiv(w, P)):
            subs.append([kb0 + c * P, min(P, w - c * P), p_sb, c * P])
    per_tile = BANK * 4 // (P * (2 if two_byte else 4))  # blocks per PSUM bank
    blocks = []
    for g0 in range(0, len(subs), per_tile):
        n = min(per_tile, len(subs) - g0)
        pt_ps = nl.ndarray((P, n, nq), dtype=pdt, buffer=nl.psum)
        pt_sb = nl.ndarray((P, n, nq), dtype=pdt, buffer=nl.sbuf)
        for c in range(n):
            key0, kc, p_sb, col = subs[g0 + c]
            nisa.nc_transpose(dst=pt_ps[0:kc, c, :], data=p_sb[:, col:col + kc])
            blocks.append([key0, kc, pt_sb, c])
        nfull = n if subs[g0 + n - 1][1] == P else n - 1  # only the step's last block can be short
        parts = []
        if nfull > 0:
            parts.append([P, 0, nfull])
        if nfull < n:
            parts.append([subs[g0 + n - 1][1], nfull, n])
        for pi in range(len(parts)):
            kc, c0, c1 = parts[pi]
            if cheaper_engine(load, (c1 - c0) * nq, two_byte, PSUM_READ_CYCLES) == 0:
                nisa.tensor_copy(dst=pt_sb[0:kc, c0:c1, :], src=pt_ps[0:kc, c0:c1, :])
            else:
                nisa.activation(dst=pt_sb[0:kc, c0:c1, :], op=nl.copy, data=pt_ps[0:kc, c0:c1, :])
    st["probs"], st["blocks"] = None, blocks


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


def _pv(st, v_sb):
    """Stage 4: O_step = P V over the step's keys, one PSUM accumulation group."""
    nq, D = st["nq"], v_sb.shape[2]
    pv_ps = nl.ndarray((nq, D), dtype=nl.float32, buffer=nl.psum)
    operands = []
    for key0, kc, pt_sb, c in st["blocks"]:
        operands.append([(pt_sb[0:kc, c, :], v_sb[0:kc, key0 // P, :])])
    accumulate([pv_ps], operands)
    st["blocks"], st["pv"] = None, pv_ps


def _o_update(st, load):
    """Stage 5: the running output ``O = O * corr + O_step`` (fp32, SBUF; a tile's only step stays in PSUM)."""
    nq, pv_ps, prev = st["nq"], st["pv"], st["prev"]
    acc = pv_ps
    if prev != None:  # noqa: E711
        acc = nl.ndarray((nq, pv_ps.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=acc, data=prev["o"], op0=nl.multiply, operand0=st["corr"], op1=nl.add,
                                  operand1=pv_ps)
        load[0] = load[0] + 2 * pv_ps.shape[1] / VECTOR_GHZ
        prev["o"] = None
    elif not st["last"]:
        acc = nl.ndarray((nq, pv_ps.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        if cheaper_engine(load, pv_ps.shape[1], False, PSUM_READ_CYCLES) == 0:
            nisa.tensor_copy(dst=acc, src=pv_ps)
        else:
            nisa.activation(dst=acc, op=nl.copy, data=pv_ps)
    st["pv"], st["o"] = None, acc


def _finish(st, outs, load, ones_col):
    """Stage 6 (a tile's last step): ``o = O / l`` rounded once into the chunk's output tile; the
    chunk's last tile stores it."""
    o = outs[0]
    nq, ct = st["nq"], st["ct"]
    rl = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=rl, data1=ones_col[0:nq, :], data2=st["l"], op=nl.divide, engine=nisa.engine.gpsimd)
    dst = st["oc"][0:nq, ct, :]
    if cheaper_engine(load, o.shape[3], False, PSUM_READ_CYCLES) == 0:
        nisa.tensor_scalar(dst=dst, data=st["o"], op0=nl.multiply, operand0=rl)
    else:
        nisa.activation(dst=dst, op=nl.copy, data=st["o"], scale=rl)
    st["o"] = None  # (may be the PSUM tile: its accumulation group closes)
    if st["chunk_last"]:  # the chunk's full tiles in one DMA, a short last tile (S % 128) in another
        nfull = ct + 1 if nq == P else ct
        if nfull > 0:
            nisa.dma_copy(dst=tiles_view(o, st["ob"], st["r0"] - ct * P, nfull, st["h"]), src=st["oc"][:, 0:nfull, :])
        if nq < P:
            nisa.dma_copy(dst=rows(o, st["ob"], st["r0"], nq, st["h"]), src=st["oc"][0:nq, ct, :])


def _store_lse(unit_heads, l_all, negm_all, lse, ob, S):
    """``lse = log(l) - (-scale * m)`` of every tile of the unit (one ``log``: one activation-table
    switch per unit), stored per head."""
    lg = nl.ndarray(l_all.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lg, op=nl.log, data=l_all)
    lse_t = nl.ndarray(l_all.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lse_t, data1=lg, data2=negm_all, op=nl.subtract)
    nqt = cdiv(S, P)
    nfull = S // P
    for hi in range(len(unit_heads)):
        base = (ob * lse.shape[1] + unit_heads[hi]) * S
        if nfull > 0:
            nisa.dma_copy(dst=lse.ap(pattern=[[1, P], [P, nfull]], offset=base),
                          src=lse_t[:, hi * nqt:hi * nqt + nfull])
        if nfull < nqt:
            rem = S - nfull * P
            nisa.dma_copy(dst=lse.ap(pattern=[[1, rem], [1, 1]], offset=base + nfull * P),
                          src=lse_t[0:rem, hi * nqt + nfull:hi * nqt + nqt])


def _at(steps, t):
    """``steps[t]`` when t is a step index, else None (pipeline fill and drain)."""
    if 0 <= t and t < len(steps):
        return steps[t]
    return None


def _run_unit(unit, q, k, v, scale, outs, ident, mask):
    """One work unit: load its kv head, then the software-pipelined steps of its query tiles.

    Iteration t issues, per engine in this order, so that each instruction's inputs were produced at
    least one stage earlier: Tensor S(t), P^T(t-2), PV(t-3); Vector the bank maxima (t), P^T copies
    (t-2), -scale*m (t), O (t-4), l (t-2), o = O / l (t-5); Scalar exp (t-1), P^T copies (t-2).
    """
    b, j, g0, ng, _ = unit
    S, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    G = Hq // k.shape[2]
    nqt = cdiv(S, P)
    kT, v_sb = load_kv(k, v, b, j, D)
    steps = _steps(S, g0, ng, j, G)
    ob = b if outs[0].shape[0] > 1 else 0  # the scratch outputs hold one batch row
    # per tile of the unit (column (head - g0) * nqt + tile): the final row sum and -scale * max
    l_all = nl.ndarray((P, ng * nqt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=l_all, value=1.0)  # (rows past S of a short last tile: log(1))
    negm_all = nl.ndarray((P, ng * nqt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=negm_all, value=0.0)
    cols = (nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf), nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf))
    nisa.memset(dst=cols[0], value=scale)
    nisa.memset(dst=cols[1], value=1.0)
    for i in range(len(steps)):
        steps[i]["b"], steps[i]["ob"], steps[i]["scale"], steps[i]["pdt"] = b, ob, scale, q.dtype
        steps[i]["prev"] = None if steps[i]["first"] else steps[i - 1]
        steps[i]["before"] = None if i == 0 else steps[i - 1]
    load = [0.0, 0.0]  # Vector / Scalar ns so far (engine choice of the P^T copies)
    for t in range(len(steps) + 5):
        cur = _at(steps, t)
        if cur != None:  # noqa: E711
            _scores(cur, q, kT, ident, mask, load)
        if _at(steps, t - 1) != None:  # noqa: E711
            _exp(steps[t - 1], load)
        if _at(steps, t - 2) != None:  # noqa: E711
            _transpose(steps[t - 2], load)
        if cur != None:  # noqa: E711
            _neg_max(cur, negm_all, cols[0])
        if _at(steps, t - 3) != None:  # noqa: E711
            _pv(steps[t - 3], v_sb)
        if _at(steps, t - 4) != None:  # noqa: E711
            _o_update(steps[t - 4], load)
        if _at(steps, t - 2) != None:  # noqa: E711
            _row_sum(steps[t - 2], l_all)
        if _at(steps, t - 5) != None and steps[t - 5]["last"]:  # noqa: E711
            _finish(steps[t - 5], outs, load, cols[1])
        if _at(steps, t - 5) != None:  # noqa: E711
            steps[t - 5]["before"] = None  # (the chunk's tiles travel one step further)
    heads = []
    for g in range(g0, g0 + ng):
        heads.append(j * G + g)
    _store_lse(heads, l_all, negm_all, outs[1], ob, S)


@nki.jit
def attention_fwd_kernel(q, k, v, scale):
    """``(o [B, S, Hq, D] q.dtype, lse [B, Hq, S] fp32)``: causal attention of ``q [B, S, Hq, D]`` over
    ``k, v [B, S, Hk, D]`` (fp32 or bf16, one dtype), ``o_i = sum_j softmax_j(scale * q_i . k_j) v_j``
    over ``j <= i``, ``lse_i = log(sum_j exp(scale * q_i . k_j))``."""
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    G = Hq // Hk
    o = nl.ndarray((B, S, Hq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, S), dtype=nl.float32, buffer=nl.shared_hbm)
    n_prog, pid = program_split()
    scratch = None
    if needs_scratch(B, Hk, G, n_prog, True):
        scratch = (nl.ndarray((1, S, Hq, D), dtype=q.dtype, buffer=nl.private_hbm),
                   nl.ndarray((1, Hq, S), dtype=nl.float32, buffer=nl.private_hbm))
    ident = identity(nl.bfloat16)
    mask = causal_mask(nl.bfloat16)
    units = work_units(B, Hk, G, n_prog, pid, True)
    for u in range(len(units)):
        outs = (o, lse) if units[u][4] else scratch
        _run_unit(units[u], q, k, v, float(scale), outs, ident, mask)
    return o, lse
