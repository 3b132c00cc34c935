"""NKI kernel of the router's backward, :func:`router_topk_bwd_kernel`.

Backward (``router_topk_bwd``): ``g_p = scatter(idx, g_s)`` with ``g_s`` the gradient of the selected
probabilities (through the renormalisation when ``norm_topk_prob``), ``g_logits = p * (g_p - <g_p, p>)
(+ grad_router_logits)`` in fp32. It is computed on the K selected logits first (gathered per partition
with ``nc_n_gather``; ``[tokens, K]`` arithmetic), then scattered to ``[tokens, E]`` by K one-hot
products (iota == id, any order of ``topk_idx``; repeated ids add up like autograd's scatter); then
``grad_x = g_logits @ w_router`` and ``grad_w = g_logits.T @ x`` on the
Tensor engine with fp32 accumulation. fp32 inputs: fp32 matmuls. bf16 inputs: ``g_logits`` is split into
two bf16 parts (``hi + lo``, ~16 significant bits) multiplied against the exact bf16 x / w, so the
gradients are as accurate as fp32 math rounded once to bf16, at 2x the bf16 matmul cost (still 2x
cheaper than fp32 matmuls). Sigmoid scoring: ``g_logits = m * s(1 - s) * (G - c) / D`` with
``D = <m, s> + 1e-20``, ``c = <G, m*s> / D`` (``norm_topk_prob``), else ``G * s(1 - s)``; the
routed scaling factor scales the upstream gradient; the selection bias has no gradient (a buffer).
"""

from __future__ import annotations

from trnkit.kernels._common import P_MAX, cdiv
from trnkit.kernels.router.constraints import SIGMOID_NORM_EPS, bwd_group
from trnkit.kernels.router.router_fwd import PSUM_FMAX, _copy_engine, _transpose_blocks
from trnkit.kernels.tiles import accumulate, accumulate_evacuate, evacuate_tiles, program_split, psum_tiles
from trnkit.nki_api import nisa, nki, nl


def _tiles(group, dtype, width=0):
    """One SBUF tile per token tile of ``group``: ``[P_i, width]``, or the shape of its logits when
    ``width`` is 0 (a module-level helper, not a closure: kernel code stays plain calls)."""
    out = []
    for g in group:
        out.append(nl.ndarray((g[0].shape[0], width if width > 0 else g[0].shape[1]), dtype=dtype, buffer=nl.sbuf))
    return out


def _group_tile(n, last_rows, K):
    """One fp32 ``[128, n, K]`` SBUF tile for the K-space values of a group's ``n`` token tiles (tile i in
    ``[:, i, :]``), so a K-space step is one instruction per group. When the last tile is short
    (``last_rows < 128``) the tile is zeroed first: the group-wide steps read the rows past its tokens
    (finite values, results never used)."""
    t = nl.ndarray((P_MAX, n, K), dtype=nl.float32, buffer=nl.sbuf)
    if last_rows < P_MAX:
        nisa.memset(dst=t, value=0.0, engine=nisa.engine.gpsimd)
    return t


def _gather_selected(group, gk_all):
    """``(ikf, lg_k, lg_k_all, gk_all)`` for the token tiles of ``group`` (see :func:`_selected_logit_grads`):
    the expert ids as fp32 and the K selected logits ``lg[idx_k]`` per tile (one per-partition
    ``nc_n_gather`` on GpSimd, into views of the group tile ``lg_k_all``); ``gk_all`` the group tile of
    the upstream gradients."""
    n = len(group)
    K = group[0][1].shape[1]
    idx_u, ikf = _tiles(group, nl.uint32, K), _tiles(group, nl.float32, K)
    lg_k_all = _group_tile(n, group[-1][0].shape[0], K)
    lg_k = []
    for i in range(n):
        nisa.tensor_copy(dst=idx_u[i], src=group[i][1], engine=nisa.engine.gpsimd)
        nisa.tensor_copy(dst=ikf[i], src=group[i][1], engine=nisa.engine.gpsimd)
    for i in range(n):
        lg_k.append(lg_k_all[0:group[i][0].shape[0], i, :])
        nisa.nc_n_gather(dst=lg_k[i], data=group[i][0], indices=idx_u[i])
    return ikf, lg_k, lg_k_all, gk_all


def _selected_logit_grads(group, gathered, norm_topk_prob, scoring="softmax"):
    """First half of the backward's ``g_logits`` for each token tile of ``group``: a list of ``(lg [P, E]
    fp32 logits, ik [P, K] int32 expert ids, gk [P, K] fp32 upstream top-K weight gradients, gl_in [P, E]
    or None (gradient of the logits themselves))``, with ``gathered`` from :func:`_gather_selected`.
    Returns ``(ikf, v, dense)`` per tile for :func:`_logit_grad_tiles`.

    The gradient of the K selected weights lives on the K selected logits, so it is computed there
    ("K-space", ``[P, K]`` tiles): ``lg_k = lg[idx_k]``, then (softmax) ``q = softmax_k(lg_k)``, ``v_k = q_k (g_k -
    <g, q>)`` with norm_topk_prob
    (the softmax Jacobian term over E cancels exactly); without it ``p_k = exp(lg_k - max)/S`` over all E
    and ``g_logits = scatter(g * p) - <g, p> p``; sigmoid: ``s_k = sigmoid(lg_k)``, ``v_k = s_k(1 - s_k)
    (g_k - c) / D`` with ``D = sum s_k + 1e-20``, ``c = <g, s> / D`` (norm), else ``g_k s_k(1 - s_k)``.
    Every step is issued for all tiles of the group before the next step (independent instructions
    between dependent ones hide the engines' latency).
    """
    n = len(group)
    ikf, lg_k, lg_k_all, gk_all = gathered
    dense = [None] * n  # a dense [P, E] term added to the scatter (softmax without norm_topk_prob)
    if scoring == "sigmoid":
        v = _sigmoid_selected_grads(group, lg_k, norm_topk_prob)
    elif norm_topk_prob:
        v = _softmax_selected_grads(group, lg_k_all, gk_all)
    else:
        v, dense = _softmax_full_grads(group, lg_k)
    return ikf, v, dense


def _logit_grad_tiles(group, selected, iota_e):
    """fp32 ``g_logits [P, E]`` per tile of ``group`` from :func:`_selected_logit_grads`' ``(ikf, v,
    dense)``: ``sum_k onehot(idx_k) * v_k + dense (+ grad_router_logits)``; repeated ids add up, as
    autograd's scatter does."""
    ikf, v, dense = selected
    return _plus_logit_grads(group, _scatter_selected(group, iota_e, ikf, v, dense))


def _k_space_tiles(group, K):
    """Scratch per token tile of ``group``: five fp32 ``[P, 1]`` tiles, then three fp32 ``[P, K]``."""
    out = []
    for _ in range(5):
        out.append(_tiles(group, nl.float32, 1))
    for _ in range(3):
        out.append(_tiles(group, nl.float32, K))
    return out


def _softmax_selected_grads(group, lg_k_all, gk_all):
    """norm_topk_prob: ``v_k = q_k (g_k - <g, q>)``, ``q = softmax over the K selected logits``; every step
    but the per-tile ``exp`` (its bias is a column) and the per-tile ``(g - c) / den`` one instruction
    over the group tiles ``[128, n, K]``."""
    n = len(group)
    f32 = nl.float32
    K = lg_k_all.shape[2]
    neg_m = nl.ndarray((P_MAX, n), dtype=f32, buffer=nl.sbuf)
    den = nl.ndarray((P_MAX, n), dtype=f32, buffer=nl.sbuf)
    rden = nl.ndarray((P_MAX, n), dtype=f32, buffer=nl.sbuf)
    dot = nl.ndarray((P_MAX, n), dtype=f32, buffer=nl.sbuf)
    neg_c = nl.ndarray((P_MAX, n), dtype=f32, buffer=nl.sbuf)
    e_k = nl.ndarray((P_MAX, n, K), dtype=f32, buffer=nl.sbuf)
    ge = nl.ndarray((P_MAX, n, K), dtype=f32, buffer=nl.sbuf)
    v_all = nl.ndarray((P_MAX, n, K), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_m, op=nl.maximum, data=lg_k_all, axis=2, negate=True)
    for i in range(n):
        nisa.activation(dst=e_k[:, i, :], op=nl.exp, data=lg_k_all[:, i, :], bias=neg_m[:, i:i + 1],
                        reduce_op=nl.add, reduce_res=den[:, i:i + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.reciprocal(dst=rden, data=den)
    nisa.tensor_tensor(dst=ge, data1=gk_all, data2=e_k, op=nl.multiply)
    nisa.tensor_reduce(dst=dot, op=nl.add, data=ge, axis=2)
    # -<g, q> = -(<g, e> / den)
    nisa.tensor_tensor(dst=neg_c, data1=dot, data2=rden, op=nl.multiply)
    nisa.tensor_scalar(dst=neg_c, data=neg_c, op0=nl.multiply, operand0=-1.0)
    for i in range(n):  # v = ((g - c) / den) * e
        nisa.tensor_scalar(dst=v_all[:, i, :], data=gk_all[:, i, :], op0=nl.add, operand0=neg_c[:, i:i + 1],
                           op1=nl.multiply, operand1=rden[:, i:i + 1])
    nisa.tensor_tensor(dst=v_all, data1=v_all, data2=e_k, op=nl.multiply)
    v = []
    for i in range(n):
        v.append(v_all[0:group[i][0].shape[0], i, :])
    return v


def _softmax_full_grads(group, lg_k):
    """Without norm_topk_prob: ``g_logits = scatter(g * p_sel) - <g, p_sel> p`` with ``p`` the softmax over
    all E; returns the K-space ``g * p_sel`` and the dense ``-<g, p_sel> p`` tiles."""
    n = len(group)
    neg_m, den, rden, dot, coef, e_k, ge, v = _k_space_tiles(group, lg_k[0].shape[1])
    e_all, dense = _tiles(group, nl.float32), _tiles(group, nl.float32)
    for i in range(n):
        nisa.tensor_reduce(dst=neg_m[i], op=nl.maximum, data=group[i][0], axis=1, negate=True)
    for i in range(n):
        nisa.activation(dst=e_all[i], op=nl.exp, data=group[i][0], bias=neg_m[i], reduce_op=nl.add,
                        reduce_res=den[i], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=e_k[i], op=nl.exp, data=lg_k[i], bias=neg_m[i])
    for i in range(n):
        nisa.reciprocal(dst=rden[i], data=den[i])
        nisa.tensor_tensor(dst=ge[i], data1=group[i][2], data2=e_k[i], op=nl.multiply)
    for i in range(n):
        nisa.tensor_reduce(dst=dot[i], op=nl.add, data=ge[i], axis=1)
        nisa.tensor_scalar(dst=v[i], data=ge[i], op0=nl.multiply, operand0=rden[i])  # g * p_sel
    for i in range(n):  # -<g, p_sel> / den = -dot / den^2
        nisa.tensor_scalar(dst=coef[i], data=dot[i], op0=nl.multiply, operand0=rden[i], op1=nl.multiply,
                           operand1=-1.0)
        nisa.tensor_scalar(dst=coef[i], data=coef[i], op0=nl.multiply, operand0=rden[i])
    for i in range(n):
        nisa.tensor_scalar(dst=dense[i], data=e_all[i], op0=nl.multiply, operand0=coef[i], engine=nisa.engine.scalar)
    return v, dense


def _sigmoid_selected_grads(group, lg_k, norm_topk_prob):
    """Sigmoid scores: ``v_k = s_k(1 - s_k) (g_k - c) / D`` (norm_topk_prob; ``D = sum_k s_k + 1e-20``,
    ``c = <g, s> / D``), else ``g_k s_k(1 - s_k)``."""
    n = len(group)
    K = lg_k[0].shape[1]
    f32 = nl.float32
    s_k, jac, v = _tiles(group, f32, K), _tiles(group, f32, K), _tiles(group, f32, K)
    den = _tiles(group, f32, 1)
    for i in range(n):
        nisa.activation(dst=s_k[i], op=nl.sigmoid, data=lg_k[i], reduce_op=nl.add, reduce_res=den[i],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
    for i in range(n):  # s (1 - s)
        nisa.tensor_scalar(dst=jac[i], data=s_k[i], op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=jac[i], data1=jac[i], data2=s_k[i], op=nl.multiply)
    if not norm_topk_prob:
        for i in range(n):
            nisa.tensor_tensor(dst=v[i], data1=group[i][2], data2=jac[i], op=nl.multiply)
        return v
    rden, dot, neg_c, gs = _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32, 1), _tiles(group, f32, K)
    for i in range(n):
        nisa.tensor_scalar(dst=den[i], data=den[i], op0=nl.add, operand0=SIGMOID_NORM_EPS)
        nisa.tensor_tensor(dst=gs[i], data1=group[i][2], data2=s_k[i], op=nl.multiply)
    for i in range(n):
        nisa.reciprocal(dst=rden[i], data=den[i])
        nisa.tensor_reduce(dst=dot[i], op=nl.add, data=gs[i], axis=1)
    for i in range(n):  # -<g, s> / D
        nisa.tensor_scalar(dst=neg_c[i], data=dot[i], op0=nl.multiply, operand0=rden[i], op1=nl.multiply,
                           operand1=-1.0)
    for i in range(n):  # v = ((g - c) / D) * s(1 - s)
        nisa.tensor_scalar(dst=v[i], data=group[i][2], op0=nl.add, operand0=neg_c[i], op1=nl.multiply,
                           operand1=rden[i])
        nisa.tensor_tensor(dst=v[i], data1=v[i], data2=jac[i], op=nl.multiply)
    return v


def _scatter_selected(group, iota_e, ikf, v, dense):
    """Dense ``[P, E]`` fp32 ``sum_k onehot(idx_k) * v_k (+ dense)`` per tile: the K one-hot products on
    Vector into one ``[P, K, E]`` tile, summed over k by one Vector ``tensor_reduce`` over its
    ``[P, E, K]`` view (one pass over K*E elements instead of K - 1 adds of 2E cycles each). With
    distinct ids every column has at most one non-zero product, so the sum is exact in any order."""
    n = len(group)
    K = v[0].shape[1]
    f32 = nl.float32
    prods = []
    for i in range(n):
        rows, E = group[i][0].shape
        prods.append(nl.ndarray((rows, K, E), dtype=f32, buffer=nl.sbuf))
    for k in range(K):
        for i in range(n):
            rows = group[i][0].shape[0]
            nisa.tensor_scalar(dst=prods[i][:, k, :], data=iota_e[0:rows, :], op0=nl.equal,
                               operand0=ikf[i][:, k:k + 1], op1=nl.multiply, operand1=v[i][:, k:k + 1])
    g = []
    for i in range(n):
        rows, E = group[i][0].shape
        g.append(nl.ndarray((rows, E), dtype=f32, buffer=nl.sbuf))
        nisa.tensor_reduce(dst=g[i], op=nl.add, data=prods[i].permute((0, 2, 1)), axis=2)
    for i in range(n):
        if dense[i] != None:  # noqa: E711 (the NKI compiler rejects `is not`)
            nisa.tensor_tensor(dst=g[i], data1=g[i], data2=dense[i], op=nl.add)
    return g


def _plus_logit_grads(group, g):
    """``g += grad_router_logits`` for the tiles that have one (the logits are an output too)."""
    for i in range(len(group)):
        if group[i][3] != None:  # noqa: E711 (the NKI compiler rejects `is`)
            nisa.tensor_tensor(dst=g[i], data1=g[i], data2=group[i][3], op=nl.add)
    return g


def _evacuate_row_blocks(dst, accs, load):
    """``dst [rows, H]`` <- the PSUM tiles ``accs`` of consecutive 512-column blocks of it, each copied by
    the engine with less queued work (:func:`~trnkit.kernels.router.router_fwd._copy_engine`)."""
    dsts, engines = [], []
    for a in range(len(accs)):
        h0 = a * PSUM_FMAX
        dsts.append(dst[:, h0:h0 + accs[a].shape[1]])
        engines.append(_copy_engine(load, accs[a].shape[1]))
    evacuate_tiles(dsts, accs, engines=engines)


def _blocks(n_e, h_lo, width):
    """``(E chunk, first column)`` of phase 2's grad_w blocks: 4 PSUM banks of columns ``[h_lo, h_lo +
    width)`` per chunk of 128 experts."""
    out = []
    for c in range(n_e):
        for hg in range(h_lo, h_lo + width, 4 * PSUM_FMAX):
            out.append((c, hg))
    return out


def _owned_rows(parts, offset):
    """Copies of the g_logits parts ``[tp, E]`` with row p zeroed where ``offset + p < 0`` (a token this
    program computes for grad_x but the other program owns for grad_w; one GpSimd ``affine_select`` each)."""
    out = []
    for part in parts:
        tp, E = part.shape
        t = nl.ndarray((tp, E), dtype=part.dtype, buffer=nl.sbuf)
        nisa.affine_select(dst=t, pattern=[[0, E]], channel_multiplier=1, on_true_tile=part, on_false_value=0.0,
                           cmp_op=nl.greater_equal, offset=offset)
        out.append(t)
    return out


def _sum_partials(grad_w, w_accs, pid, load):
    """LNC=2 (two programs): ``grad_w`` = the sum of both programs' fp32 partials (the PSUM tiles ``w_accs`` of
    consecutive 512-column blocks), exchanged through a shared HBM scratch and one barrier; each program
    adds and stores one half of the columns (an odd H's halves share a column: both programs compute the same
    sum for it, fp32 addition being commutative)."""
    E, H = grad_w.shape
    part = nl.ndarray((E, H), dtype=nl.float32, buffer=nl.sbuf)
    _evacuate_row_blocks(part, w_accs, load)
    scratch = nl.ndarray((2, E, H), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=scratch[pid, :, :], src=part)
    nisa.core_barrier(scratch, (0, 1))
    Hh = cdiv(H, 2)
    h0 = min(H - Hh, pid * Hh)
    other = nl.ndarray((E, Hh), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=other, src=scratch[1 - pid, :, h0:h0 + Hh])
    out = nl.ndarray((E, Hh), dtype=grad_w.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=out, data1=part[:, h0:h0 + Hh], data2=other, op=nl.add)
    nisa.dma_copy(dst=grad_w[:, h0:h0 + Hh], src=out)


@nki.jit
def router_topk_bwd_kernel(x, w_router, router_logits, topk_idx, grad_topk_weights, grad_router_logits,
                           has_grad_logits=False, norm_topk_prob=True, scoring="softmax",
                           routed_scaling_factor=1.0):
    """NKI kernel behind :func:`router_topk_bwd`. Phase 1 (per group of token tiles, see the loop):
    ``g_logits`` and ``grad_x = g_logits @ w``; ``grad_w = g_logits.T @ x`` accumulated over token tiles in PSUM, during
    phase 1 when it fits 4 PSUM banks, else in a phase 2 over a g_logits scratch.
    The matmuls take ``x.dtype`` operands (bf16 like autograd of a bf16 linear; fp32 accumulation).
    LNC=2 (``router_topk_bwd_kernel[2]``): the programs split the tokens as the forward does; phase 1's
    grad_w partials are summed through a shared scratch (:func:`_sum_partials`), phase 2 splits grad_w's
    columns."""
    T, H = x.shape
    E = w_router.shape[0]
    K = topk_idx.shape[1]
    n_e = cdiv(E, P_MAX)
    mm = x.dtype
    grad_x = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    grad_w = nl.ndarray((E, H), dtype=w_router.dtype, buffer=nl.shared_hbm)
    split = mm != nl.float32
    # grad_w fits 4 PSUM banks (E <= 128, H <= 2048, e.g. Qwen3-30B-A3B): accumulate it during phase 1
    # (no second pass over x, no g_logits scratch); else phase 2 re-reads g_logits from an HBM scratch
    fused_w = n_e == 1 and H <= 4 * PSUM_FMAX
    n_parts = 2 if split else 1
    if fused_w:
        w_shapes = []
        for h0 in range(0, H, PSUM_FMAX):
            w_shapes.append((E, min(PSUM_FMAX, H - h0)))
        w_accs = psum_tiles(w_shapes)
    else:
        g_hbm = nl.ndarray((n_parts, T, E), dtype=mm, buffer=nl.shared_hbm)  # bf16: hi and lo parts
    load = [0.0, 0.0]
    # w resident in SBUF [128, n_e, H]: E on partitions = the contraction of grad_x
    w_sb = nl.ndarray((P_MAX, n_e, H), dtype=mm, buffer=nl.sbuf)
    for c in range(n_e):
        ec = min(P_MAX, E - c * P_MAX)
        nisa.dma_copy(dst=w_sb[0:ec, c, :], src=w_router[c * P_MAX:c * P_MAX + ec, :])
    iota_e = nl.ndarray((P_MAX, E), dtype=nl.float16, buffer=nl.sbuf)  # 0..E-1 on every partition (exact)
    nisa.iota(dst=iota_e, pattern=[[1, E]], offset=0, channel_multiplier=0)
    # SPMD (``router_topk_bwd_kernel[2]`` on LNC=2): program i takes the i-th contiguous share of the
    # tokens (a multiple of 128) and the last share ends at T, overlapping the one before it, as in the
    # forward: both programs issue the same instructions (the same control flow on both cores, NKI LNC
    # guide). grad_x rows of the overlap are written twice with the same values; grad_w counts a token
    # once: on the program that owns it (tokens >= own0), the overlap's tiles masked on the other.
    n_prog, pid = program_split()
    share = min(T, cdiv(cdiv(T, n_prog), P_MAX) * P_MAX)
    T0 = min(T - share, pid * share)
    own0 = pid * share
    n_masked = cdiv(n_prog * share - T, P_MAX)  # leading tiles that may hold the overlap (same on both)
    tiles = []
    for t0 in range(T0, T0 + share, P_MAX):
        tiles.append((t0, min(P_MAX, T0 + share - t0)))
    gs = bwd_group(E, K)
    groups = []
    for g0 in range(0, len(tiles), gs):
        groups.append(list(range(g0, min(len(tiles), g0 + gs))))
    n = len(groups)
    ins = [None] * n  # stage L -> G
    sel = [None] * n  # stage K -> G
    glT = [None] * n  # stage G -> M
    # phase 1, software-pipelined over groups of token tiles: L(i) loads + gathers of the selected logits,
    # K(i-1) the gradient on them, G(i-2) its dense scatter + transposes, M(i-3) grad_x / grad_w matmuls; each engine
    # works on a different group than the one its inputs are still being produced for (in-order queues)
    stores = []  # (t0, tp, grad_x tile) of the last M stage
    for step in range(n + 4):
        if step < n:
            ins[step] = []
            gk_all = _group_tile(len(groups[step]), tiles[groups[step][-1]][1], K)
            for gi in range(len(groups[step])):
                ti = groups[step][gi]
                t0, tp = tiles[ti]
                lg = nl.ndarray((tp, E), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=lg, src=router_logits[t0:t0 + tp, :], dge_mode=nisa.dge_mode.hwdge)
                ik = nl.ndarray((tp, K), dtype=nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=ik, src=topk_idx[t0:t0 + tp, :], dge_mode=nisa.dge_mode.hwdge)
                gk = gk_all[0:tp, gi, :]
                nisa.dma_copy(dst=gk, src=grad_topk_weights[t0:t0 + tp, :], dge_mode=nisa.dge_mode.hwdge)
                gl_in = None
                if has_grad_logits:
                    gl_in = nl.ndarray((tp, E), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=gl_in, src=grad_router_logits[t0:t0 + tp, :])
                ins[step].append((lg, ik, gk, gl_in))
            if routed_scaling_factor != 1.0:  # weights = scale * w': the upstream gradient of w'
                nisa.tensor_scalar(dst=gk_all, data=gk_all, op0=nl.multiply, operand0=routed_scaling_factor)
            sel[step] = _gather_selected(ins[step], gk_all)
        for t0, tp, gx_sb in stores:  # the previous step's grad_x tiles, queued behind this step's loads
            nisa.dma_copy(dst=grad_x[t0:t0 + tp, :], src=gx_sb, dge_mode=nisa.dge_mode.hwdge)
        stores = []
        i_k = step - 1
        if 0 <= i_k < n:
            sel[i_k] = _selected_logit_grads(ins[i_k], sel[i_k], norm_topk_prob, scoring)
        i_m = step - 3
        if 0 <= i_m < n:  # grad_x [tp, H] = g_l [tp, E] @ w [E, H]; the H blocks' chains interleaved
            for gi in range(len(groups[i_m])):
                ti = groups[i_m][gi]
                t0, tp = tiles[ti]
                gT, parts, x_sb = glT[i_m][gi]
                gx_sb = nl.ndarray((tp, H), dtype=x.dtype, buffer=nl.sbuf)
                nb = 2 if fused_w else 4  # grad_x PSUM banks in flight (fused: 4 hold grad_w)
                for hq in range(0, H, nb * PSUM_FMAX):
                    blocks = []
                    for h0 in range(hq, min(H, hq + nb * PSUM_FMAX), PSUM_FMAX):
                        blocks.append((h0, min(PSUM_FMAX, H - h0)))
                    operands = []  # contraction chunks: (E chunk c, g_logits part i)
                    for c in range(n_e):
                        ec = min(P_MAX, E - c * P_MAX)
                        for i in range(len(gT)):
                            row = []
                            for h0, hc in blocks:
                                row.append((gT[i][0:ec, c, :], w_sb[0:ec, c, h0:h0 + hc]))
                            operands.append(row)
                    dsts, engines = [], []
                    for h0, hc in blocks:
                        dsts.append(gx_sb[:, h0:h0 + hc])
                        engines.append(nisa.engine.scalar)
                    accumulate_evacuate(dsts, operands, engines=engines)
                stores.append((t0, tp, gx_sb))
                if fused_w:  # grad_w [E, H] += g_l^T x: contraction over this tile's tokens
                    operands = []
                    for i in range(len(parts)):
                        row = []
                        for a in range(len(w_accs)):
                            h0 = a * PSUM_FMAX
                            row.append((parts[i], x_sb[:, h0:h0 + w_accs[a].shape[1]]))
                        operands.append(row)
                    accumulate(w_accs, operands, start=ti == 0)
            glT[i_m] = None
        i_g = step - 2
        if 0 <= i_g < n:
            g_ls = _logit_grad_tiles(ins[i_g], sel[i_g], iota_e)
            ins[i_g] = None
            sel[i_g] = None
            glT[i_g] = []
            for gi in range(len(g_ls)):
                t0, tp = tiles[groups[i_g][gi]]
                g_l = g_ls[gi]
                if split:  # g = hi + lo, both bf16: ~16 significant bits through bf16 matmuls
                    hi = nl.ndarray((tp, E), dtype=mm, buffer=nl.sbuf)
                    parts = [hi, nl.ndarray((tp, E), dtype=mm, buffer=nl.sbuf)]
                    nisa.tensor_copy(dst=parts[0], src=g_l, engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=parts[1], data1=g_l, data2=parts[0], op=nl.subtract)
                else:
                    parts = [g_l]
                x_sb = None
                w_parts = parts
                if fused_w:
                    x_sb = nl.ndarray((tp, H), dtype=mm, buffer=nl.sbuf)
                    nisa.dma_copy(dst=x_sb, src=x[t0:t0 + tp, :], dge_mode=nisa.dge_mode.hwdge)
                    if groups[i_g][gi] < n_masked:
                        w_parts = _owned_rows(parts, t0 - own0)
                else:
                    for i in range(len(parts)):
                        nisa.dma_copy(dst=g_hbm[i, t0:t0 + tp, :], src=parts[i])
                # grad_x needs g_l^T (E on partitions: the contraction)
                gT = []
                pairs = []
                for i in range(len(parts)):
                    gT.append(nl.ndarray((P_MAX, n_e, tp), dtype=mm, buffer=nl.sbuf))
                    pairs.append((gT[i], parts[i]))
                _transpose_blocks(pairs, tp, E, mm, load)
                glT[i_g].append((gT, w_parts, x_sb))
    if fused_w:
        if n_prog == 1:
            gw_sb = nl.ndarray((E, H), dtype=w_router.dtype, buffer=nl.sbuf)
            _evacuate_row_blocks(gw_sb, w_accs, load)
            nisa.dma_copy(dst=grad_w, src=gw_sb)
        else:
            _sum_partials(grad_w, w_accs, pid, load)
        return grad_x, grad_w
    # phase 2: grad_w [E, H] = sum over all token tiles of g_l^T x, per block of (E chunk, 4 PSUM banks of
    # H); on LNC=2 each program takes as many columns (the halves of an odd H share one, written twice with
    # the same values), after both have written their g_logits rows
    if n_prog > 1:
        nisa.core_barrier(g_hbm, (0, 1))
    Hh = cdiv(H, n_prog)
    h_lo = min(H - Hh, pid * Hh)
    for c, hg in _blocks(n_e, h_lo, Hh):
        e0 = c * P_MAX
        ec = min(P_MAX, E - e0)
        hw = min(4 * PSUM_FMAX, h_lo + Hh - hg)
        shapes = []
        for h0 in range(hg, hg + hw, PSUM_FMAX):
            shapes.append((ec, min(PSUM_FMAX, hg + hw - h0)))
        accs = psum_tiles(shapes)
        for t0 in range(0, T, P_MAX):
            tp = min(P_MAX, T - t0)
            g_sb = []
            for i in range(n_parts):
                g_sb.append(nl.ndarray((tp, ec), dtype=mm, buffer=nl.sbuf))
            for i in range(len(g_sb)):
                nisa.dma_copy(dst=g_sb[i], src=g_hbm[i, t0:t0 + tp, e0:e0 + ec])
            x_sb = nl.ndarray((tp, hw), dtype=mm, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x[t0:t0 + tp, hg:hg + hw])
            operands = []
            for i in range(len(g_sb)):
                row = []
                for a in range(len(accs)):
                    h0 = a * PSUM_FMAX
                    row.append((g_sb[i], x_sb[:, h0:h0 + accs[a].shape[1]]))
                operands.append(row)
            accumulate(accs, operands, start=t0 == 0)
        gw_sb = nl.ndarray((ec, hw), dtype=w_router.dtype, buffer=nl.sbuf)
        _evacuate_row_blocks(gw_sb, accs, load)
        nisa.dma_copy(dst=grad_w[e0:e0 + ec, hg:hg + hw], src=gw_sb)
    return grad_x, grad_w
