"""Flash attention forward with a fixed per-row softmax shift (``attention_fwd_shift_kernel``): the same
results as :func:`~trnkit.kernels.attention.flash_fwd.attention_fwd_kernel` to fp32 precision, without
the Vector engine's read of every score for the row max.

Any shift ``c_i`` gives the same softmax, ``o_i = sum_j exp(s_ij - c_i) v_j / l_i`` and ``lse_i = c_i +
log l_i`` with ``l_i = sum_j exp(s_ij - c_i)``, as long as nothing overflows and the exponentials keep
their precision. Here ``c_i`` is the row's maximum over its first 512 keys (one PSUM bank of the tile's
first step, read by Vector: 23% of the scores the exact row max reads at S = 4,096), so with
``delta_i = max_j s_ij - c_i >= 0`` every exponential is at most ``e^delta_i``, the largest at least 1
(nothing underflows that the exact path keeps), and ``e^delta_i <= l_i`` (the largest term of the sum).
With a fixed shift there is no running max: no correction of ``O`` and ``l`` between steps, and
Scalar's ``exp`` reads the scores straight from PSUM with the row sum in the same instruction.

**The certificate.** After the fast pass every row's ``l_i`` is compared with a bound ``S * e^nats``
(:mod:`~trnkit.kernels.attention.shift_rule`): ``nats`` = 32 for bf16 inputs, ``log 4`` for fp32 inputs,
a precision rule measured against the fp64 oracle (that module's docstring). If all pass, ``delta_i <= log
l_i <= log S + nats``: every exponential and ``l_i`` are at most ``S e^nats`` (2.6e18 at S = 32,768 for bf16,
far inside fp32's range), the ``P V`` partial sums at most that times ``max|v|``. A row whose ``l_i``
exceeds the bound, or is ``inf`` (an overflow), fails; a ``NaN`` ``l_i`` (only from non-finite inputs,
which the exact path turns into ``NaN`` too) does not. ``1 / l_i`` is the largest softmax probability among
the row's first 512 keys, so a bf16 row fails only when every one of those keys gets less than ``e^-32 /
S`` of its attention (3.1e-18 at S = 4,096; fp32: ``1 / 4S``). A row's ``l_i`` is at most ``(i + 1)
e^span`` (``span``: its largest score minus its smallest), so no bf16 row fails while ``span <= 32``:
with Qwen3's per-head q / k RMSNorm and scale ``D^-0.5``, ``span <= 2 sqrt(D) max|w_q| max|w_k|``, so
while ``max|w_q| * max|w_k| <= 1.41`` at D = 128 (2.0 at D = 64). If any row of the launch fails, the whole
launch runs the exact kernel's pipeline again (:func:`~trnkit.kernels.attention.flash_fwd._pipeline`,
overwriting ``o`` and ``lse``): one runtime decision per launch, a ``nl.fori_loop`` of 0 or 1 iterations
whose trip count is 1 when any row failed. On LNC=2 each core flags its own rows and the two cores swap
their flags with one ``sendrecv`` group and add them, so both cores take the same runtime control flow
(the LNC guide: control flow that differs between the cores is undefined). The fallback costs a whole
second pass; the fast pass is wasted.

**Schedule.** Per step, TensorE forms the scores in PSUM groups of at most 4 banks (:func:`_groups`:
two consecutive groups hold at most 7 of the 8 banks, the 8th the ``P V`` tiles, so TensorE writes one
group while Scalar reads the previous one); on the tile's first step Vector reads the first bank for
``-c_i`` (``tensor_scalar_reduce``: ``-scale * S`` and its row minimum) and Scalar then takes each group
in one ``exp(scale * S - scale * c_i)`` with its row sum. ``P^T`` (DMA and PE transposes), ``P V`` and
``o = O / l`` follow the exact kernel's stages a fixed number of steps behind (the launch's last
``PE_DRAIN_STEPS`` steps with every ``P^T`` block on the PE). A step's groups
depend only on its tile and its place in the head's visit order (:func:`_assign_groups`), so LNC=1
and LNC=2 run the same instructions per tile and give bit-identical results. One ``exp`` on a
constant before the first DMA completes loads Scalar's activation table off the critical path.
"""

from __future__ import annotations

from trnkit.kernels._common import cdiv
from trnkit.kernels.attention import flash_fwd as F
from trnkit.kernels.attention.shift_rule import certificate_bound
from trnkit.kernels.attention.tiling import (ACT_FIXED_NS, SCALAR_GHZ, VECTOR_GHZ, P, causal_mask, load_v)
from trnkit.kernels.tiles import identity
from trnkit.nki_api import nisa, nki, nl

BANK = F.BANK
GROUP_CAP = F.GROUP_BANKS  # banks per PSUM score group (one Scalar exp each)
LIVE = F.LIVE_SCORE_BANKS  # banks two consecutive groups may hold (the 8th: the P V tiles)
# Pipeline distances (in steps) of the P^T transposes, P V and o = O / l behind the scores + exp (chosen on
# the cost model at S = 4,096, 8 / 2 heads: 614.5 us at mid; 1 / 3 / 5 gives 827 us, 3 / 5 / 7 617.7 us)
LAG_T, LAG_PV, LAG_FINISH = 2, 4, 6
# The launch's last PE_DRAIN_STEPS steps make all their P^T blocks by PE transposes: after the last exp
# TensorE has room, and the DMA queues (about 90% busy) would hold the drain's P V back (LNC=2, 8 / 2 heads:
# 311.0 -> 310.3 us at mid; 1 to 4 steps give the same mid, 2 the best pessimistic end)
PE_DRAIN_STEPS = 2


def _groups(nb, prev):
    """The step's ``nb`` score banks as ``(first bank, banks)`` groups of at most GROUP_CAP banks, each
    with the group before it (``prev`` banks for the first) at most LIVE banks."""
    out = []
    b = 0
    while b < nb:
        n = min(GROUP_CAP, LIVE - prev, nb - b)
        out.append((b, n))
        b = b + n
        prev = n
    return out


def _assign_groups(steps):
    """Each step's score groups, from its own tile and its place in its head's visits only (not from
    the step issued before it, which depends on the work split): a tile visited first in its pair of
    :func:`~trnkit.kernels.attention.flash_fwd._tile_order` assumes a full group before it (its first
    group at most LIVE - GROUP_CAP banks, whatever ran before); its partner and a tile's later steps
    follow the head's previous step's last group. Every group is at most GROUP_CAP banks, so the
    assumption holds."""
    last = {}
    visits = {}
    for st in steps:
        key = (st["u"]["unit"], st["gi"])
        if st["first"]:
            visits[key] = visits.get(key, 0) + 1
        prev = GROUP_CAP
        if not (st["first"] and visits[key] % 2 == 1):
            prev = last[key]
        st["groups"] = _groups(cdiv(st["k1"] - st["k0"], BANK), prev)
        last[key] = st["groups"][-1][1]


def _scores_exp(st, q, kT, ident, mask, negm_all, load):
    """Stage 1: the step's score groups (Tensor; the causal mask added on the diagonal bank); on the
    tile's first step ``-scale * c`` from the first bank (Vector, into the tile's column of ``negm_all``);
    each group's ``P = exp(scale * S - scale * c)`` straight from PSUM with its row sum (Scalar), issued
    after the next group's matmuls (TensorE fills one group while Scalar reads the other)."""
    nq, k0, k1, scale = st["nq"], st["k0"], st["k1"], st["scale"]
    D = q.shape[3]
    F._load_chunk(st, q)
    w = k1 - k0
    groups = st["groups"]
    ng = len(groups)
    p_sb = nl.ndarray((nq, w), dtype=st["pdt"], buffer=nl.sbuf)
    rs = nl.ndarray((nq, ng), dtype=nl.float32, buffer=nl.sbuf)
    nm = negm_all[0:nq, st["col"]:st["col"] + 1]
    pending = None
    for i in range(ng + 1):
        if i < ng:
            b0, nbg = groups[i]
            g0 = k0 + b0 * BANK
            gw = min(nbg * BANK, k1 - g0)
            s_ps = F.score_group(st, kT, ident, mask, D, g0, nbg, gw, load)
            if i == 0 and st["first"]:  # the shift: -scale * (max over the tile's first 512 keys)
                wb = min(BANK, gw)
                scaled = nl.ndarray((nq, wb), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar_reduce(dst=scaled, data=s_ps[:, 0:wb], op0=nl.multiply, operand0=-scale,
                                          reduce_op=nl.minimum, reduce_res=nm)
                load[F.VEC] = load[F.VEC] + (max(64, wb) + F.PSUM_READ_CYCLES) / VECTOR_GHZ
        if pending != None:  # noqa: E711 (NKI rejects `is`); the previous group, while this one is formed
            pi, pg0, pw, p_ps = pending
            nisa.activation(dst=p_sb[:, pg0 - k0:pg0 - k0 + pw], op=nl.exp, data=p_ps, bias=nm, scale=scale,
                            reduce_op=nl.add, reduce_res=rs[:, pi:pi + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            load[F.ACT] = load[F.ACT] + (max(64, pw) + 64) / SCALAR_GHZ + ACT_FIXED_NS
        pending = None
        if i < ng:
            pending = (i, g0, gw, s_ps)
    st["p"], st["rs"] = p_sb, rs


def _row_sum(st, l_all):
    """``l`` of the step (its groups' sums, Vector) added to the tile's earlier steps' (GpSimd); a tile's
    last step writes it into the unit's column ``col`` and forms ``1 / l``."""
    nq, rs, prev = st["nq"], st["rs"], st["prev"]
    ls = rs
    if rs.shape[1] > 1:
        ls = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=ls, op=nl.add, data=rs, axis=1)
    dst = ls
    if st["last"]:
        dst = l_all[0:nq, st["col"]:st["col"] + 1]
    elif prev != None:  # noqa: E711
        dst = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
    if prev != None:  # noqa: E711
        nisa.tensor_tensor(dst=dst, data1=prev["l"], data2=ls, op=nl.add, engine=nisa.engine.gpsimd)
    elif st["last"]:
        nisa.tensor_copy(dst=dst, src=ls, engine=nisa.engine.gpsimd)
    st["l"], st["rs"] = dst, None
    if st["last"]:  # 1 / l for the tile's output, long before it is needed (no ALU divide: NKI's operator table)
        rl = nl.ndarray((nq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=rl, data=dst)
        st["rl"] = rl


def _o_update(st, load):
    """Stage 5: ``O = O + O_step`` over a tile's steps (fp32, SBUF; the shift is fixed, so nothing is
    rescaled; a tile's only step stays in PSUM)."""
    nq, pv_ps, prev = st["nq"], st["pv"], st["prev"]
    acc = pv_ps
    if prev != None:  # noqa: E711
        acc = nl.ndarray((nq, pv_ps.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=acc, data1=prev["o"], data2=pv_ps, op=nl.add)
        load[F.VEC] = load[F.VEC] + (max(64, pv_ps.shape[1]) + F.PSUM_READ_CYCLES) / VECTOR_GHZ
        prev["o"] = None
    elif not st["last"]:
        acc = nl.ndarray((nq, pv_ps.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        if F.cheaper_engine(load, pv_ps.shape[1], False, F.PSUM_READ_CYCLES) == 0:
            nisa.tensor_copy(dst=acc, src=pv_ps)
        else:
            nisa.activation(dst=acc, op=nl.copy, data=pv_ps)
    st["pv"], st["o"] = None, acc


def _certify(u, bad, col, S, itemsize):
    """``bad[:, col]``: 1.0 on the partitions where a tile of the unit has ``l`` above the certificate's bound
    (Vector; :func:`~trnkit.kernels.attention.shift_rule.certificate_bound`)."""
    flags = nl.ndarray(u["l_all"].shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=flags, data=u["l_all"], op0=nl.greater, operand0=certificate_bound(S, itemsize),
                              reduce_op=nl.maximum, reduce_res=bad[:, col:col + 1])


def _fast_pipeline(units, q, k, v, scale, outs_of, ident, mask, ones_col, load, bad, unit0, decide=None):
    """The fast pass over ``units`` (one software pipeline), each unit's certificate into ``bad[:, unit0
    + i]`` once its last row sum is formed; with ``decide`` (the launch's last pipeline) the launch's
    decision (:func:`_failing_rows`) right after the last certificate, as ``decide["redo"]``."""
    S = q.shape[1]
    steps = F.pipeline_steps(units, q, k, scale, outs_of, load, unit0)
    _assign_groups(steps)
    for st in steps[max(0, len(steps) - PE_DRAIN_STEPS):]:
        st["all_pe"] = True
    for t in range(len(steps) + LAG_FINISH):
        cur = F._at(steps, t)
        if cur != None:  # noqa: E711
            if cur["unit_first"]:
                F._open_unit(cur, q, k, v)
            _scores_exp(cur, q, cur["u"]["kT"], ident, mask, cur["u"]["negm_all"], load)
            if cur["load_v"]:
                cur["u"]["v"] = load_v(v, cur["b"], cur["u"]["unit"][1], F.KV_PIECES)
        if F._at(steps, t - LAG_T) != None:  # noqa: E711
            st = steps[t - LAG_T]
            F._transpose(st, load)
            _row_sum(st, st["u"]["l_all"])
            if st["unit_last"]:  # every l of the unit is final: its certificate
                _certify(st["u"], bad, st["u"]["bad_col"], S, F._itemsize(q.dtype))
            if t - LAG_T == len(steps) - 1 and decide != None:  # noqa: E711
                # the launch's decision, in program order ahead of the drain (it overlaps the last
                # steps' P V, o and lse instead of following them)
                decide["redo"] = _failing_rows(bad, ones_col, decide["n_prog"], decide["pid"])
        if F._at(steps, t - LAG_PV) != None:  # noqa: E711
            F._pv(steps[t - LAG_PV], steps[t - LAG_PV]["u"]["v"], load)
        if F._at(steps, t - LAG_PV - 1) != None:  # noqa: E711
            _o_update(steps[t - LAG_PV - 1], load)
        done = F._at(steps, t - LAG_FINISH)
        if done != None and done["last"]:  # noqa: E711
            F._finish(done, done["u"]["outs"], load)
        if done != None and done["unit_last"]:  # noqa: E711
            u = done["u"]
            F._store_lse(u["heads"], u["l_all"], u["negm_all"], u["outs"][1], u["ob"], S, load)


def _failing_rows(bad, ones_col, n_prog, pid):
    """``[1, 1]`` int32: 1 if a row of the launch failed its certificate (either core's), else 0. The
    flags of ``bad`` reduced on GpSimd, over partitions (``tensor_partition_reduce``, max) and then over
    the core's units, so that the decision waits in no TensorE or Vector queue (they still hold the
    drain's ``P V`` and ``o = O / l``); on LNC=2 the two cores swap their flags (``sendrecv``, one group:
    each core's value is complete only once both transfers are) and add them, so both hold the same
    value."""
    cols = nl.ndarray((1, bad.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(dst=cols, op=nl.maximum, data=bad)
    cnt = cols[0:1, 0:1]
    for c in range(1, bad.shape[1]):  # (the core's units: a few [1, 1] maxima)
        folded = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=folded, data1=cnt, data2=cols[0:1, c:c + 1], op=nl.maximum,
                           engine=nisa.engine.gpsimd)
        cnt = folded
    if n_prog > 1:  # each core sends its count to the other and receives the other's (one group)
        other = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=cnt, dst=other, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        both = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=both, data1=cnt, data2=other, op=nl.add, engine=nisa.engine.gpsimd)
        cnt = both
    # (GpSimd from here: Vector's in-order queue still has the drain's o = O / l to issue)
    redo = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=redo, data1=cnt, data2=ones_col[0:1, :], op=nl.minimum, engine=nisa.engine.gpsimd)
    return redo


@nki.jit
def attention_fwd_shift_kernel(q, k, v, scale):
    """``(o [B, S, Hq, D] q.dtype, lse [B, Hq, S] fp32)`` as
    :func:`~trnkit.kernels.attention.flash_fwd.attention_fwd_kernel` computes them: the fast pass with a
    fixed shift per row, and the exact kernel's pass again if any row of the launch fails the
    certificate (module docstring)."""
    o, lse, units, outs_of, (n_prog, pid) = F.launch_outputs(q, k)
    S, D = q.shape[1], q.shape[3]
    ones_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_col, value=1.0)
    warm = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)  # loads the exp table while DMAs run
    nisa.activation(dst=warm, op=nl.exp, data=ones_col)
    ident = identity(nl.bfloat16)
    mask = causal_mask(nl.bfloat16)
    bad = nl.ndarray((P, len(units)), dtype=nl.float32, buffer=nl.sbuf)
    load = [0.0, 0.0, 0.0, 0.0]
    one = F.one_pipeline(S, F._itemsize(q.dtype), D, units[0][3])
    decide = {"n_prog": n_prog, "pid": pid}
    if one:
        _fast_pipeline(units, q, k, v, float(scale), outs_of, ident, mask, ones_col, load, bad, 0, decide)
    else:
        for u in range(len(units)):
            _fast_pipeline([units[u]], q, k, v, float(scale), [outs_of[u]], ident, mask, ones_col, load, bad, u,
                           decide if u == len(units) - 1 else None)
    redo = decide["redo"]
    trips = nisa.register_alloc()
    nisa.register_load(trips, redo)

    def exact(i):  # the exact kernel's pass (0 or 1 iterations)
        load2 = [0.0, 0.0, 0.0, 0.0]
        if one:
            F._pipeline(units, q, k, v, float(scale), outs_of, ident, mask, load2)
        else:
            for u in range(len(units)):
                F._pipeline([units[u]], q, k, v, float(scale), [outs_of[u]], ident, mask, load2)

    nl.fori_loop(0, trips, exact)
    return o, lse
