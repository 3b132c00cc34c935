"""Chunked linear cross-entropy: the lm_head matmul fused with the loss, never holding [tokens, vocab].

``linear_cross_entropy(h, weight, labels)`` equals ``F.cross_entropy((h @ weight.T).float(), labels,
reduction="sum")`` (ignored labels skipped) and its gradients, but computes them ``chunk_size``
tokens at a time: per chunk the fp32 logits, their log-sum-exp and loss, and at once (the loss is a
scalar, so its gradient needs only one scale factor later) the gradients ``dh = (softmax - onehot) @ W``
and ``dW += (softmax - onehot).T @ h``. The largest temporary is one chunk's [chunk, vocab] fp32 block;
the backward only scales the stored ``dh``/``dW`` by the incoming gradient. This is the scheme of
Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` (gradients in the forward pass, three matmuls
per chunk as in the unfused forward + backward), written in plain torch.

Vocab-parallel (tensor parallel): with ``group`` set, ``weight`` is this rank's rows
``[vocab_start, vocab_start + V_local)`` of the vocabulary. The row max, the sum of exponentials and
the target logit are all-reduced over ``group`` (Megatron's vocab-parallel cross-entropy), each rank
computes ``dW`` for its own rows only and the partial ``dh`` are summed over the group.

Precision: logits are formed in the compute dtype (the autocast dtype under autocast, else the
inputs' dtype; as the unfused ``lm_head`` would) and the softmax / loss in fp32. On a CPU without native
bf16 / fp16 matmul (:func:`trnkit.qwen3.precision.matmul_dtype`) the operands are rounded to the compute
dtype and multiplied in fp32: the logits, the logit gradients and ``dh`` (rounded to the compute dtype
after the product, as a low-precision GEMM's output is) carry the same roundings, and ``dW`` sums the
per-chunk products in fp32 without rounding each one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .precision import compute_dtype, matmul_dtype

DEFAULT_CHUNK_SIZE = 256  # tokens; measured on CPU at vocab 151,936 (docs/benchmarks.md)


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                ignore_index: int, group: Any, vocab_start: int) -> torch.Tensor:
        dt = compute_dtype(h, weight)
        mm_dt = matmul_dtype(dt, h.device)
        x = h.reshape(-1, h.shape[-1])
        y = labels.reshape(-1)
        w = weight.to(dt).to(mm_dt)                                         # rounded to dt, multiplied in mm_dt
        v_local = w.shape[0]
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty(x.shape, dtype=mm_dt, device=x.device) if need_dh else None
        dw = torch.empty(w.shape, dtype=torch.float32, device=w.device) if need_dw else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        if group is None:
            bad = y[(y != ignore_index) & ((y < 0) | (y >= v_local))]
            if bad.numel():
                raise ValueError(f"linear_cross_entropy: label {int(bad[0])} is outside the vocabulary "
                                 f"[0, {v_local}) (and is not ignore_index {ignore_index})")
        bufs = _ChunkBuffers(min(chunk_size, max(x.shape[0], 1)), w, dt)
        for s in range(0, x.shape[0], chunk_size):
            xc, yc = x[s:s + chunk_size].to(dt).to(mm_dt), y[s:s + chunk_size]
            logits, probs = bufs.logits(xc, w)                              # [c, V_local] in dt, in fp32
            valid = yc != ignore_index
            local_t = yc - vocab_start
            here = valid & (local_t >= 0) & (local_t < v_local)             # target in this rank's rows
            rows = here.nonzero().squeeze(1)
            target = torch.zeros(yc.shape, dtype=torch.float32, device=x.device)
            target[rows] = probs[rows, local_t[rows]]
            m = _all_reduce(probs.amax(dim=1), dist.ReduceOp.MAX, group)
            probs.sub_(m[:, None]).exp_()
            sumexp = _all_reduce(probs.sum(dim=1), dist.ReduceOp.SUM, group)
            target = _all_reduce(target, dist.ReduceOp.SUM, group)
            total += torch.where(valid, m + sumexp.log() - target, 0.0).sum()
            if not (need_dh or need_dw):
                continue
            probs.div_(sumexp[:, None])                                     # softmax
            probs[rows, local_t[rows]] -= 1.0                               # - onehot(target)
            ignored = (~valid).nonzero().squeeze(1)
            if ignored.numel():
                probs.index_fill_(0, ignored, 0.0)                          # ignored tokens: no grad
            g = bufs.gradient(logits, probs)                                # softmax - onehot, dt-rounded
            if need_dh:
                torch.mm(g, w, out=dh[s:s + chunk_size])
            if need_dw:
                bufs.add_weight_grad(dw, g, xc, first=s == 0)
        if need_dh and group is not None:
            dist.all_reduce(dh, group=group)  # each rank's dh covers its vocabulary rows only
        if need_dh:
            dh = dh.to(dt)                                                  # a dt matmul's output rounding
        if need_dw and x.shape[0] == 0:
            dw.zero_()
        ctx.save_for_backward(dh, dw)
        ctx.shapes = (h.shape, h.dtype, weight.dtype)
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.used:
            raise RuntimeError("linear_cross_entropy: backward can run only once per forward (the gradients "
                               "are computed in the forward and scaled in place)")
        ctx.used = True
        dh, dw = ctx.saved_tensors
        h_shape, h_dtype, w_dtype = ctx.shapes
        # scaled in place: no second [V, H] buffer next to the one autograd accumulates into .grad
        gh = None if dh is None else _scaled(dh, grad).to(h_dtype).view(h_shape)
        gw = None if dw is None else _scaled(dw, grad).to(w_dtype)
        return gh, gw, None, None, None, None, None


class _ChunkBuffers:
    """The per-chunk working memory, allocated once and reused by every chunk.

    A fresh block of many MiB costs a page fault per 4 KiB page on every chunk (measured on CPU at vocab
    151,936: a [256, V] fp32 copy into a new tensor takes 67 ms, into a reused one 23 ms), so the logits,
    their fp32 copy and the low-precision weight-gradient product each have one buffer for the whole call.
    The gradient ``softmax - onehot`` in the compute dtype overwrites the logits it came from. With
    low-precision operands multiplied in fp32 (``w`` fp32, ``dt`` not), the fp32 block holds the product,
    the probabilities and the gradient, and the ``dt`` block only rounds them (``dt`` and back).
    """

    _ROWS_PER_BLOCK = 1024  # fp32 staging rows for the low-precision dW sum (about 1 MiB at H = 256)

    def __init__(self, rows: int, w: torch.Tensor, dt: torch.dtype) -> None:
        v, hidden = w.shape
        self._logits = torch.empty((rows, v), dtype=dt, device=w.device)
        self._fp32 = self._logits if dt == torch.float32 else torch.empty((rows, v), dtype=torch.float32,
                                                                           device=w.device)
        self._rounds = dt != w.dtype                     # dt operands multiplied in fp32
        self._product: torch.Tensor | None = None        # [V, H] in dt, for dt != fp32
        self._stage: torch.Tensor | None = None          # [block, H] fp32
        self._hidden = hidden

    def logits(self, xc: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``xc @ w.T`` in the compute dtype and the same values in fp32 (one tensor when dt is fp32)."""
        n = xc.shape[0]
        logits, fp32 = self._logits[:n], self._fp32[:n]
        if self._rounds:
            torch.mm(xc, w.T, out=fp32)
            return fp32, self._round(fp32)
        torch.mm(xc, w.T, out=logits)
        if fp32 is not logits:
            fp32.copy_(logits)
        return logits, fp32

    def gradient(self, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``probs`` (softmax - onehot, fp32) rounded to the compute dtype, in the matmul dtype."""
        if self._rounds:
            return self._round(probs)
        if probs is logits:
            return probs
        return logits.copy_(probs)

    def _round(self, fp32: torch.Tensor) -> torch.Tensor:
        """``fp32`` rounded to the compute dtype in place (through the compute-dtype block)."""
        return fp32.copy_(self._logits[:fp32.shape[0]].copy_(fp32))

    def add_weight_grad(self, dw: torch.Tensor, g: torch.Tensor, xc: torch.Tensor, first: bool) -> None:
        """``dw (fp32) += g.T @ xc``: fp32 operands accumulate in place; low-precision ones form their
        product in their dtype (as the unfused lm_head backward would) and are summed in fp32."""
        if g.dtype == torch.float32:
            if first:
                torch.mm(g.T, xc, out=dw)
            else:
                dw.addmm_(g.T, xc)                                          # no [V, H] temporary
            return
        if self._product is None:
            self._product = torch.empty(dw.shape, dtype=g.dtype, device=dw.device)
        torch.mm(g.T, xc, out=self._product)
        if first:
            dw.copy_(self._product)
            return
        # A mixed-dtype add_ takes torch's slow path (measured 4x a same-dtype one): convert through a
        # small cache-resident fp32 block instead.
        if self._stage is None:
            self._stage = torch.empty((self._ROWS_PER_BLOCK, self._hidden), dtype=torch.float32,
                                      device=dw.device)
        for r in range(0, dw.shape[0], self._ROWS_PER_BLOCK):
            part = self._product[r:r + self._ROWS_PER_BLOCK]
            stage = self._stage[:part.shape[0]]
            dw[r:r + part.shape[0]].add_(stage.copy_(part))


def _scaled(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return t if bool(grad == 1) else t.mul_(grad.to(t.dtype))


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         chunk_size: int = DEFAULT_CHUNK_SIZE, ignore_index: int = -100,
                         group: Any = None, vocab_start: int = 0) -> torch.Tensor:
    """Sum over non-ignored tokens of ``cross_entropy(h @ weight.T, labels)``, fp32 scalar, chunked.

    ``h`` [..., H] (any leading shape), ``weight`` [V, H] (or this rank's [V_local, H] rows starting at
    ``vocab_start`` when ``group`` is a tensor-parallel process group), ``labels`` h's leading shape.
    """
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: weight must be [V, {h.shape[-1]}] for h of shape "
                         f"{tuple(h.shape)}, got {tuple(weight.shape)}")
    if labels.shape != h.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: labels must have h's leading shape {tuple(h.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    return _LinearCrossEntropy.apply(h, weight, labels, chunk_size, ignore_index, group, vocab_start)


__all__ = ["DEFAULT_CHUNK_SIZE", "linear_cross_entropy"]
