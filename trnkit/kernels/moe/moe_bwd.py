"""NKI kernel of the MoE expert backward's data path, fused: :func:`moe_bwd_kernel`.

Per expert e (static loop; LNC=2: the experts of :func:`~trnkit.kernels.tiles.owned_groups`,
the j-th expert of both cores with as many blocks, padding ones on the core with fewer),
two run-time loops (``nl.fori_loop`` from ``block_start``) over e's blocks of B slots, per 128-row
sub-tile:

1. with ``w_gate_up[e]`` and ``w_down[e].T [H, I]`` (transposed once on the Tensor Engine) in SBUF:
   gather the slots' ``x`` and ``grad_out`` rows by indirect DMA (padding positions name token 0 and
   carry affinity 0, so every row is finite and every padding result is an exact zero) and transpose
   them on the Tensor Engine (the contraction dim H on partitions); per piece of <= 512 columns of I,
   three PSUM accumulation groups: ``gate``, ``up`` (the recompute, ``x.T`` chunk stationary,
   ``w_gate_up`` moving) and ``dA = grad_out @ w_down.T`` (``w_down.T`` moving); the activation
   backward on the rows (:func:`activation_grad_rows`) gives ``h``, ``w*h``, ``grad_topk_weights =
   <dA, h> (+ <grad_out, b_down>)`` and ``dgu = [w dA dh/dgate | w dA dh/dup]``. ``w*h [B, I]`` and
   ``dgu [B, 2I]`` go to HBM in dispatch order (the weight-gradient kernel's operands,
   :func:`~trnkit.kernels.moe.moe_grouped_mm.grouped_wgrad2_kernel`);
2. with ``w_gate_up[e].T [2I, H]`` (transposed once, after which ``w_gate_up[e]`` is dead and the
   next expert's weights load): read the ``dgu`` rows back, transpose them and compute ``dX [rows, H]
   = dgu @ w_gate_up.T`` (``dgu.T`` chunk stationary, 512-column pieces of ``w_gate_up.T`` moving),
   scattered to the slot buffer ``[T*K, H]`` one block later (as in the forward, so the scatter's
   software-DGE descriptors do not delay the next loads). Here the Vector Engine evacuates the ``dgu``
   transposes and the Scalar Engine the ``dX`` pieces, so the next block's transposes never queue
   behind this block's last evacuations.

The two phases keep SBUF for the next expert's weights (one expert's three sets of weight tiles take
120 KiB per partition at the Qwen3-30B-A3B shapes). After all experts (LNC=2: after a
``core_barrier``, a token's slots come from both cores) the selection-matrix
:func:`~trnkit.kernels.moe.moe_grouped_mm.combine` sums each token's K slot rows into ``grad_x``. Row
layout throughout: the moving operand of every big matmul is a weight (512 columns), so the block size
does not change the Tensor Engine's work; the affinity is a per-partition scalar and ``<dA, h>`` a
free-axis reduction. Engines issue in order, so the work is split to keep the Tensor Engine fed: the
Scalar Engine evacuates everything a phase-1 matmul waits on, the Vector Engine runs the activation backward,
GpSimd only writes DMA descriptors. Transposes share a PSUM tile four at a time, with one evacuation.
"""

from __future__ import annotations

from typing import Any

from trnkit.kernels._common import GELU_A, GELU_C
from trnkit.kernels.moe.moe_fused import block_row, move_rows, scatter_rows
from trnkit.kernels.moe.moe_grouped_mm import combine
from trnkit.kernels.tiles import (
    NMAX,
    P,
    accumulate,
    block_range,
    chunk_tile,
    chunks,
    load_bias_rows,
    load_block_start,
    load_weight,
    masked_group,
    owned_groups,
    program_split,
    psum_tiles,
    row_matmul,
    store_rows,
    tiles,
    transpose_rows_grouped,
    transposed_weight,
)
from trnkit.nki_api import nisa, nki, nl


def bias_columns(b: Any, g: int) -> Any:
    """Row ``b[g]`` of a bias ``[G, N]`` (HBM) as per-partition columns ``[P, ceil(N / P)]`` (element
    ``c*P + p`` at ``[p, c]``; the rest zero): the moving operand of a matmul contracting over N."""
    _, N = b.shape
    full = N // P
    cols = nl.ndarray((P, (N + P - 1) // P), dtype=b.dtype, buffer=nl.sbuf)
    nisa.memset(dst=cols, value=0.0)
    if full > 0:
        nisa.dma_copy(dst=cols[:, :full], src=b.ap(pattern=[[1, P], [P, full]], offset=g * N))
    if N % P:
        r = N % P
        nisa.dma_copy(dst=cols[:r, full:full + 1], src=b.ap(pattern=[[1, r], [1, 1]], offset=g * N + full * P))
    return cols


def _gather(src: Any, ids: Any, s: int, rows: int) -> Any:
    """Rows ``src[ids[:, s]]`` (HBM ``[R, W]``, all ids valid) -> a new SBUF tile ``[rows, W]``."""
    t = nl.ndarray((rows, src.shape[1]), dtype=src.dtype, buffer=nl.sbuf)
    move_rows(src, t, ids, s, rows, True)
    return t


def activation_grad_rows(a: Any, u: Any, dt: Any, activation: str, limit: float, alpha: float) -> tuple:
    """``(h [rows, I] in dt, dh/da, dh/du fp32)`` of the expert activation, rows on partitions.

    With ``g = gate_fn(a) = a' * s`` (``s`` a sigmoid) every variant has ``dg/da = s + g (1 - s) z'``:
    silu ``s = sigmoid(a)``, ``z' = 1``; gelu_tanh ``s = sigmoid(2C (a + A a^3))`` (tanh-GELU exactly),
    ``z' = 2C (1 + 3 A a^2)``; swiglu_clamped ``a' = min(a, limit)``, ``s = sigmoid(alpha a')``,
    ``z' = alpha``, zero where ``a > limit``, and ``up' = clamp(up, -limit, limit) + 1`` (gradient only
    inside the clamp). The sigmoid runs on the Scalar Engine, the rest on the Vector Engine: GpSimd stays
    free for the software-DGE descriptors of the next gathers, which would otherwise queue behind this
    chain on the in-order engine.
    """
    rows, inter = a.shape
    f32 = nl.float32
    clamped = activation == "swiglu_clamped"
    s = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)
    ac = a
    dz = None
    if clamped:
        ac = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ac, data=a, op0=nl.minimum, operand0=limit)
        nisa.activation(dst=s, op=nl.sigmoid, data=ac, scale=alpha)
    elif activation == "gelu_tanh":
        a2 = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=a2, data1=a, data2=a, op=nl.multiply)
        inner = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)  # a (1 + A a^2)
        nisa.tensor_scalar(dst=inner, data=a2, op0=nl.multiply, operand0=GELU_A, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=inner, data1=inner, data2=a, op=nl.multiply)
        nisa.activation(dst=s, op=nl.sigmoid, data=inner, scale=2.0 * GELU_C)
        dz = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)  # 2C (1 + 3 A a^2)
        nisa.tensor_scalar(dst=dz, data=a2, op0=nl.multiply, operand0=6.0 * GELU_A * GELU_C, op1=nl.add,
                           operand1=2.0 * GELU_C)
    else:
        nisa.activation(dst=s, op=nl.sigmoid, data=a)
    g = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=g, data1=ac, data2=s, op=nl.multiply)
    up = u
    if clamped:
        up = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=up, data=u, op0=nl.maximum, operand0=-limit, op1=nl.minimum, operand1=limit)
        nisa.tensor_scalar(dst=up, data=up, op0=nl.add, operand0=1.0)
    h = nl.ndarray((rows, inter), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=h, data1=g, data2=up, op=nl.multiply)
    dg = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)  # s + g (1 - s) z'
    nisa.tensor_scalar(dst=dg, data=s, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
    nisa.tensor_tensor(dst=dg, data1=dg, data2=g, op=nl.multiply)
    if clamped:
        nisa.tensor_scalar(dst=dg, data=dg, op0=nl.multiply, operand0=alpha)
    if dz != None:  # noqa: E711
        nisa.tensor_tensor(dst=dg, data1=dg, data2=dz, op=nl.multiply)
    nisa.tensor_tensor(dst=dg, data1=dg, data2=s, op=nl.add)
    dh_du = g
    if clamped:
        # the clamps: no gradient where gate > limit or |up| > limit
        nisa.scalar_tensor_tensor(dst=dg, data=a, op0=nl.less_equal, operand0=limit, op1=nl.multiply,
                                  operand1=dg)
        dh_du = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=dh_du, data=u, op0=nl.less_equal, operand0=limit, op1=nl.multiply,
                                  operand1=g)
        nisa.scalar_tensor_tensor(dst=dh_du, data=u, op0=nl.greater_equal, operand0=-limit, op1=nl.multiply,
                                  operand1=dh_du)
    dh_da = nl.ndarray((rows, inter), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dh_da, data1=up, data2=dg, op=nl.multiply)
    return h, dh_da, dh_du


def _piece_to_sbuf(g_ps: Any, u_ps: Any, d_ps: Any, p0: int, bgu: Any, dt: Any) -> tuple:
    """``(a, u, dA)`` of one I-piece (columns ``p0 ..``) from PSUM into SBUF, rounded to the input dtype
    ``dt`` as the reference's are (a clamp of ``swiglu_clamped`` then binds where it does there); the
    gate / up get ``b_gate_up[e]`` (``bgu [P, 2I]``, then added by the Vector Engine). Otherwise on the
    Scalar Engine, which then runs only work that waits on the Tensor Engine, never on the Vector
    Engine's elementwise chain."""
    rows, pw = g_ps.shape
    out = []
    for _ in range(3):
        out.append(nl.ndarray((rows, pw), dtype=dt, buffer=nl.sbuf))
    if bgu == None:  # noqa: E711
        nisa.activation(dst=out[0], op=nl.copy, data=g_ps)
        nisa.activation(dst=out[1], op=nl.copy, data=u_ps)
    else:
        inter = bgu.shape[1] // 2
        nisa.tensor_tensor(dst=out[0], data1=g_ps, data2=bgu[:rows, p0:p0 + pw], op=nl.add)
        nisa.tensor_tensor(dst=out[1], data1=u_ps, data2=bgu[:rows, inter + p0:inter + p0 + pw], op=nl.add)
    nisa.activation(dst=out[2], op=nl.copy, data=d_ps)
    return out[0], out[1], out[2]


def _transpose(src: Any, dst: Any) -> None:
    """SBUF ``src [rows, W]`` -> column chunk c of src on the partitions of ``dst[:, c, :rows]`` (a
    :func:`~trnkit.kernels.tiles.chunk_tile`): Tensor Engine transposes, four per PSUM tile,
    evacuated by the Scalar Engine as everything that feeds a matmul here."""
    transpose_rows_grouped(src, dst, scalar=True)


def _slot_rows(x_T: list, go_T: list, wgu: list, wd_T: list, rows: int, w: Any, hw_t: Any, dgu_t: Any,
               gw_col: Any, var: dict) -> None:
    """Phase 1's work on one sub-tile of ``rows`` slots (module doc): fills ``hw_t [rows, I]``, ``dgu_t
    [rows, 2I]`` (input dtype) and ``gw_col [rows, 1]`` fp32 from the transposed rows ``x_T``, ``go_T``
    (H-chunk tiles ``[P, rows]``), the expert's weight tiles ``wgu`` and ``w_down.T`` grid ``wd_T`` and
    the slots' affinities ``w [rows, 1]`` fp32."""
    inter = dgu_t.shape[1] // 2
    dt = dgu_t.dtype
    f32 = nl.float32
    HC = len(x_T)
    H = var["H"]
    pieces = chunks(inter, NMAX)
    parts = nl.ndarray((rows, len(pieces)), dtype=f32, buffer=nl.sbuf)
    for k in range(len(pieces)):
        p0, pw = pieces[k]
        g_ps, u_ps, d_ps = psum_tiles([(rows, pw), (rows, pw), (rows, pw)])
        gate_up, down = [], []
        for c in range(HC):
            hk = min(P, H - c * P)
            gate_up.append([(x_T[c][:hk, :rows], wgu[c][:hk, p0:p0 + pw]),
                            (x_T[c][:hk, :rows], wgu[c][:hk, inter + p0:inter + p0 + pw])])
            down.append([(go_T[c][:hk, :rows], wd_T[c][k][:hk, :pw])])
        accumulate([g_ps, u_ps], gate_up)
        accumulate([d_ps], down)
        a, u, d = _piece_to_sbuf(g_ps, u_ps, d_ps, p0, var["bgu"], dt)
        h, dh_da, dh_du = activation_grad_rows(a, u, dt, var["activation"], var["limit"], var["alpha"])
        nisa.tensor_scalar(dst=hw_t[:, p0:p0 + pw], data=h, op0=nl.multiply, operand0=w)  # w * h
        prod = nl.ndarray((rows, pw), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod, data1=d, data2=h, op=nl.multiply)
        nisa.tensor_reduce(dst=parts[:, k:k + 1], op=nl.add, data=prod, axis=1)  # <dA, h> over the piece
        # dgu = [w dA dh/da | w dA dh/du]
        nisa.scalar_tensor_tensor(dst=dgu_t[:, p0:p0 + pw], data=d, op0=nl.multiply, operand0=w, op1=nl.multiply,
                                  operand1=dh_da)
        nisa.scalar_tensor_tensor(dst=dgu_t[:, inter + p0:inter + p0 + pw], data=d, op0=nl.multiply, operand0=w,
                                  op1=nl.multiply, operand1=dh_du)
    nisa.tensor_reduce(dst=gw_col, op=nl.add, data=parts, axis=1)
    if var["bd_cols"] != None:  # noqa: E711  <grad_out, b_down[e]>: b_down[e] as an [H, 1] moving column
        b_ps = nl.ndarray((rows, 1), dtype=f32, buffer=nl.psum)
        operands = []
        for c in range(HC):
            hk = min(P, H - c * P)
            operands.append([(go_T[c][:hk, :rows], var["bd_cols"][:hk, c:c + 1])])
        accumulate([b_ps], operands)
        nisa.tensor_tensor(dst=gw_col, data1=gw_col, data2=b_ps, op=nl.add)


def _grad_blocks(lo: Any, hi: Any, x: Any, grad_out: Any, token_table: Any, block_weights: Any, wgu: list,
                 wd_T: list, outs: dict, var: dict) -> None:
    """Phase 1 of an expert (module doc): run-time loop over its blocks lo..hi-1 writing ``hw``, ``dgu``
    and ``gw``."""
    H = x.shape[1]
    _, rows, nsub = token_table.shape
    HC = (H + P - 1) // P
    I2 = outs["dgu"].shape[2]
    dt = x.dtype

    def block(i):
        ids = block_row(token_table, i, 0)
        w = block_row(block_weights, i, 0)  # fp32 affinities
        gw_blk = nl.ndarray((rows, nsub), dtype=nl.float32, buffer=nl.sbuf)
        for s in range(nsub):
            x_big, x_T = chunk_tile(HC, rows, dt)
            _transpose(_gather(x, ids, s, rows), x_big)
            go_big, go_T = chunk_tile(HC, rows, dt)
            _transpose(_gather(grad_out, ids, s, rows), go_big)
            hw_t = nl.ndarray((rows, I2 // 2), dtype=dt, buffer=nl.sbuf)
            dgu_t = nl.ndarray((rows, I2), dtype=dt, buffer=nl.sbuf)
            _slot_rows(x_T, go_T, wgu, wd_T, rows, w[:, s:s + 1], hw_t, dgu_t, gw_blk[:, s:s + 1], var)
            store_rows(outs["hw"], hw_t, None, i, s)
            store_rows(outs["dgu"], dgu_t, None, i, s)
        nisa.dma_copy(dst=outs["gw"].ap(pattern=[[nsub, rows], [1, nsub]], offset=0, scalar_offset=i,
                                        indirect_dim=0), src=gw_blk)

    nl.fori_loop(lo, hi, block)


def _load_dgu(pend: list, dgu: Any, blk: Any, ahead: int) -> None:
    """Slab ``blk + ahead`` (``blk`` a register, ``ahead`` 0 or 1) of ``dgu [NB + 1, B, 2I]`` into the
    sub-tiles ``pend[s] [rows, 2I]``."""
    _, B, I2 = dgu.shape
    rows = pend[0].shape[0]
    for s in range(len(pend)):
        nisa.dma_copy(dst=pend[s], src=dgu.ap(pattern=[[I2, rows], [1, I2]], offset=(ahead * B + s * rows) * I2,
                                              scalar_offset=blk, indirect_dim=0))


def _dx_blocks(lo: Any, hi: Any, wgu_T: list, outs: dict, pend: list, dx_prev: list, slot_table: Any,
               prev_ids: Any) -> None:
    """Phase 2 of an expert: run-time loop over its blocks lo..hi-1 computing ``dX = dgu @ w_gate_up.T``
    per slot from the ``dgu`` rows phase 1 wrote (module doc). ``pend`` holds block i's
    ``dgu`` rows when its iteration starts (loaded by the kernel before the loop or by iteration i-1, right
    after that one's transposes: the loads then never queue behind the next expert's weight loads);
    block i's ``dX`` rows wait in ``dx_prev`` and are scattered after block i+1's transposes (``prev_ids``:
    the pending block's slot ids, an SBUF tile, not a register carried across iterations), as in the
    forward."""
    dgu = outs["dgu"]
    I2 = dgu.shape[2]
    rows = dx_prev[0].shape[0]
    IC2 = (I2 + P - 1) // P

    def block(i):
        dgu_T = []
        for s in range(len(pend)):
            big, views = chunk_tile(IC2, rows, dgu.dtype)
            transpose_rows_grouped(pend[s], big)  # evacuated by Vector, idle in phase 2
            dgu_T.append(views)
        _load_dgu(pend, dgu, i, 1)  # the next block's rows (past the expert's last block: unused)
        scatter_rows(outs["gx_slots"], dx_prev, prev_ids)  # the previous block's rows
        block_row(slot_table, i, 0, prev_ids)  # this block's, scattered by the next iteration
        for s in range(len(pend)):
            # evacuated by Scalar (scale 1.0), so that Vector's queue is free for the next block's dgu.T
            row_matmul(dx_prev[s], dgu_T[s], rows, None, I2, scale=1.0, grid=wgu_T)

    nl.fori_loop(lo, hi, block)


@nki.jit
def moe_bwd_kernel(x, grad_out, w_gate_up, w_down, token_table, slot_table, block_start, block_weights, top_k,
                   activation="silu", limit=7.0, alpha=1.702, b_gate_up=None, b_down=None):
    """Data path of the MoE expert backward -> ``(hw, dgu, gw, grad_x)`` (see the module doc).

    x, grad_out ``[T, H]``; w_gate_up ``[E, H, 2I]``; w_down ``[E, I, H]``; per block of B positions,
    laid out ``[NB, rows, B // rows]`` (position ``sub*rows + p`` at ``[p, sub]``, rows = min(B, 128)):
    token_table int32 (padding: any valid token), block_weights fp32 (the slot's affinity, 0 for
    padding), slot_table ``[NB + 1, ...]`` int32 (slot t*K+k, T*K for padding; row NB all padding);
    block_start ``[1, E + 1]`` int32. Outputs: ``hw = w*h [NB, B, I]`` and ``dgu [NB + 1, B, 2I]`` (input
    dtype, dispatch order, padding rows zero; used blocks only; slab NB is phase 2's read-ahead margin), ``gw [NB,
    rows, B // rows]`` fp32 (the
    gradient of each position's affinity, block layout as the tables) and ``grad_x [T, H]``.
    activation / limit / alpha / b_gate_up ``[E, 2I]`` / b_down ``[E, H]``: as the forward.
    """
    T, H = x.shape
    E_w, _, I2 = w_gate_up.shape
    E = block_start.shape[1] - 1  # the layout's experts (E_w, or + 1 masked one: moe_grouped_mm.masked_group)
    inter = I2 // 2
    NB, rows, nsub = token_table.shape
    B = rows * nsub
    K = top_k
    dt = x.dtype
    # shared: on LNC=2 each core writes its experts' blocks / slots, the combine reads both cores' slots
    outs = {"hw": nl.ndarray((NB, B, inter), dtype=dt, buffer=nl.shared_hbm),
            # + slab NB: phase 2 reads one slab ahead (unused past an expert's last block)
            "dgu": nl.ndarray((NB + 1, B, I2), dtype=dt, buffer=nl.shared_hbm),
            "gw": nl.ndarray((NB, rows, nsub), dtype=nl.float32, buffer=nl.shared_hbm),
            "gx_slots": nl.ndarray((T * K, H), dtype=dt, buffer=nl.shared_hbm)}
    dx_prev = tiles(nsub, (rows, H), dt)  # the last computed block's dX rows, not yet scattered
    pend = tiles(nsub, (rows, I2), dt)  # the dgu rows of phase 2's next block
    # the slot ids of the block in dx_prev (row NB, all padding: none yet)
    prev_ids = block_row(slot_table, nisa.register_alloc(NB), 0)
    bs = load_block_start(block_start)
    mine = owned_groups(E)
    nxt = None
    if len(mine):
        ew = masked_group(mine.start, E_w)
        nxt = (load_weight(w_gate_up, ew), load_weight(w_down, ew))
    for e in mine:
        wgu, wd = nxt  # HC tiles [P, 2I], IC tiles [P, H]
        ew = masked_group(e, E_w)
        wd_T = transposed_weight(wd, inter, H)  # [H-chunk][I-piece] [P, 512]
        var = {"H": H, "activation": activation, "limit": limit, "alpha": alpha, "bgu": None, "bd_cols": None}
        if b_gate_up != None:  # noqa: E711
            var["bgu"] = load_bias_rows(b_gate_up, ew)  # [P, 2I]: added to every row
        if b_down != None:  # noqa: E711
            var["bd_cols"] = bias_columns(b_down, ew)
        lo, hi = block_range(block_start, e, bs)
        _grad_blocks(lo, hi, x, grad_out, token_table, block_weights, wgu, wd_T, outs, var)
        _load_dgu(pend, outs["dgu"], lo, 0)  # phase 2's first block, before the weight loads below
        # [2I-chunk][H-piece] [P, 512]; w_gate_up[e] is free again. The first two chunk rows, which phase 2's
        # first matmuls read, are evacuated on Scalar: Vector still runs phase 1's last activation backward
        wgu_T = transposed_weight(wgu, H, I2, scalar_rows=2)
        if e + 1 < mine.stop:
            # the next expert's weights load during phase 2, which holds only w_gate_up[e].T
            nxt = (load_weight(w_gate_up, masked_group(e + 1, E_w)), load_weight(w_down, masked_group(e + 1, E_w)))
        _dx_blocks(lo, hi, wgu_T, outs, pend, dx_prev, slot_table, prev_ids)
    scatter_rows(outs["gx_slots"], dx_prev, prev_ids)  # the last block
    grad_x = nl.ndarray((T, H), dtype=dt, buffer=nl.shared_hbm)
    if program_split()[0] > 1:
        nisa.core_barrier(outs["gx_slots"], (0, 1))  # both cores' slots are written before any combine
    combine(outs["gx_slots"], grad_x, K)
    return outs["hw"], outs["dgu"], outs["gw"], grad_x
