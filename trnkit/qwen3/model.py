"""Native Qwen3 / Qwen3-MoE in plain torch, numerically matching transformers' implementation.

Module tree (the override registry swaps the marked modules; keep the paths stable, DESIGN.md §4):

    Qwen3Model
      tok_embeddings: Embedding[V, dim]
      layers[i]: TransformerBlock
        attention_norm: RMSNorm
        attention: Attention (wq, wk, wv, wo, q_norm, k_norm, rope: RoPEApply  <- swap point)
        ffn_norm: RMSNorm
        feed_forward: FeedForward (w1 gate, w3 up, w2 down)     (dense layers; None on MoE layers)
        moe: MoE (router: TopKRouter <- swap point, experts: GroupedExperts <- swap point)  (None on dense)
      norm: RMSNorm
      lm_head: Linear[dim -> V]   (weight is tok_embeddings.weight when tied)
      loss: LinearCrossEntropy    (lm_head + summed cross-entropy, no parameters  <- swap point)
      rope_cache: buffer [max_seq_len, 2*head_dim] fp32 = cat(cos, sin)   (not in the state dict)

Numerics follow HF Qwen3: RMSNorm in fp32, cast to the input dtype, then times the weight; cos/sin
computed in fp32 and cast to the activation dtype before the rotation (HF rotates in the activation
dtype); router softmax in fp32, top-k, optional renorm, routing weights cast to the activation
dtype before they scale the expert outputs.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen3Config, rope_cache as _rope_cache
from .loss import DEFAULT_CHUNK_SIZE, linear_cross_entropy
from .precision import Linear, compute_dtype


class KernelSlot:
    """Mixin of the modules whose math a ``trnkit::`` op can compute (the swap points).

    ``kernel_op`` names the op; ``kernel`` is None (the module's own torch code) or the op's kernel
    choice bound to this module (:class:`trnkit.overrides.BoundKernel`, from ``Qwen3Config.kernels`` or
    :func:`trnkit.overrides.apply_overrides`). ``kernel.choose(**inputs)`` checks the op's constraints on
    these inputs and returns the impl to pass to the op, or None for the module's own code (``fallback``).
    """

    kernel_op: str = ""
    kernel = None

    def kernel_static(self) -> list[tuple[str, object, str]]:
        """``(rule, value, why)`` for each way this module's configuration differs from what the op
        computes (checked when a kernel is bound; the kernel is then not run on it)."""
        return []

    def _choose(self, **inputs: object) -> str | None:
        return None if self.kernel is None else self.kernel.choose(**inputs)

    def _wrapped(self, **projections: nn.Module) -> list:
        """The violations for the projections this module's kernel reads the weights of rather than calling
        them: one per projection that computes more than ``F.linear`` (a LoRA-style wrapper, ...; see
        :func:`trnkit.overrides.guard.linear_wrapper`), whose own computation the kernel would skip. Called only
        with a kernel bound (the overrides are loaded)."""
        from trnkit.overrides.guard import wrapped_projections

        return wrapped_projections(f"{self.kernel_op}[native adapter]", projections)

    def _wrapped_static(self, **projections: nn.Module) -> list[tuple[str, object, str]]:
        """:meth:`_wrapped` as :meth:`kernel_static`'s ``(rule, value, why)`` entries."""
        return [(v.constraint, v.value, v.reason) for v in self._wrapped(**projections)]

    def _kernel_reads(self, **projections: nn.Module) -> bool:
        """Whether the bound kernel may read these projections' weights: False (after the policy: a raise under
        strict, a warning once under fallback) when one was wrapped (LoRA, ...), so the module's own forward runs."""
        wrapped = self._wrapped(**projections)
        if wrapped:
            self.kernel.refuse(wrapped)
        return not wrapped


def _kernel_ops():
    """``trnkit.overrides.ops`` (already loaded whenever a kernel is bound; imported here, not at module
    level, so the plain torch model does not load the kernels)."""
    from trnkit.overrides import ops

    return ops


class RMSNorm(KernelSlot, nn.Module):
    """RMSNorm with HF's cast order: normalise in fp32, cast to the input dtype, then scale (op ``rmsnorm``)."""

    kernel_op = "rmsnorm"

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        impl = self._choose(x=x, weight=self.weight, eps=float(self.eps))
        if impl is not None:
            return _kernel_ops().rmsnorm(x, self.weight, float(self.eps), impl, lnc=self.kernel.lnc)[0]
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LinearCrossEntropy(KernelSlot, nn.Module):
    """The lm_head fused with the summed cross-entropy (swap point ``loss``, op ``linear_cross_entropy``, no
    parameters): the chunked torch implementation of :mod:`.loss`, vocab-parallel when ``weight`` is a vocab
    shard (a ``Shard(0)`` DTensor). The kernel runs in the compute dtype (the autocast dtype under autocast,
    as the lm_head would), fp32 out."""

    kernel_op = "linear_cross_entropy"
    SCHEDULES = ("fused", "recompute")

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_size: int = DEFAULT_CHUNK_SIZE, ignore_index: int = -100,
                schedule: str = "recompute") -> torch.Tensor:
        """``schedule`` (the kernel's, when one is bound and gradients are needed): ``"recompute"`` (default)
        computes the gradients in the backward (recomputes the logits; holds only the log-sum-exp, and nothing
        of the logits ever reaches HBM); ``"fused"`` computes them in the forward
        (``trnkit::linear_cross_entropy_fused``: no logits computed twice, a quarter fewer matmul FLOPs, but it
        holds fp32 gradients from forward to backward and passes one token group's exponentials, up to
        ``1,024 x V`` values, through an HBM scratch; opt-in)."""
        if schedule not in self.SCHEDULES:
            raise ValueError(f"linear_cross_entropy: schedule must be one of {self.SCHEDULES}, got {schedule!r}")
        if self.kernel is not None:
            dt = compute_dtype(h, weight)
            hidden, w, lab = h.reshape(-1, h.shape[-1]).to(dt), weight.to(dt), labels.reshape(-1)
            impl = self.kernel.choose(hidden=hidden, weight=w, labels=lab, ignore_index=ignore_index)
            if impl is not None:
                ops = _kernel_ops()
                grads = torch.is_grad_enabled() and (hidden.requires_grad or w.requires_grad)
                if grads and schedule == "fused":
                    return ops.linear_cross_entropy_fused(hidden, w, lab, ignore_index, impl, lnc=self.kernel.lnc)[0]
                return ops.linear_cross_entropy(hidden, w, lab, ignore_index, impl, lnc=self.kernel.lnc)[0]
        weight, group, vocab_start = _vocab_shard(weight)
        return linear_cross_entropy(h, weight, labels, chunk_size=chunk_size, ignore_index=ignore_index,
                                    group=group, vocab_start=vocab_start)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Pairs element i with i + D/2: cat(-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RoPEApply(KernelSlot, nn.Module):
    """Rotate-half RoPE (swap point `layers[i].attention.rope`, op ``rope_hf``).

    forward(q [B,S,Hq,D], k [B,S,Hk,D], rope_cache [S,2D] fp32 cos|sin) -> (q, k), dtype of the inputs.
    """

    kernel_op = "rope_hf"

    def forward(self, q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        impl = self._choose(q=q, k=k, rope_cache=rope_cache, layout="bshd")
        if impl is not None:
            return _kernel_ops().rope_hf_apply(q, k, None, None, rope_cache, "bshd", False, impl, lnc=self.kernel.lnc)
        S, D = q.shape[1], q.shape[-1]
        if rope_cache.shape != (S, 2 * D):
            raise ValueError(f"RoPEApply: rope_cache must have shape [S, 2D] = [{S}, {2 * D}] for q of shape "
                             f"{tuple(q.shape)}, got {tuple(rope_cache.shape)}")
        cos = rope_cache[:, :D].to(q.dtype)[None, :, None, :]
        sin = rope_cache[:, D:].to(q.dtype)[None, :, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class CausalAttention(KernelSlot, nn.Module):
    """Causal GQA softmax attention (swap point ``layers[i].attention.core``, op ``attention``).

    ``forward(q [B,S,Hq,D], k [B,S,Hk,D], v [B,S,Hk,D]) -> [B,S,Hq,D]`` (query head h reads kv head
    ``h // (Hq / Hk)``), scores scaled by ``scale``.
    """

    kernel_op = "attention"

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:  # under autocast: the dtype scaled_dot_product_attention would compute in
            from trnkit.overrides.guard import autocast_operands

            q, k, v = autocast_operands(q, k, v)
        impl = self._choose(q=q, k=k, v=v, scale=self.scale)
        if impl is not None:
            return _kernel_ops().attention(q, k, v, float(self.scale), impl, lnc=self.kernel.lnc,
                                           fixed_shift=self.kernel.fixed_shift)[0]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale,
            enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)


class Attention(nn.Module):
    """GQA causal self-attention with per-head q/k RMSNorm applied before RoPE."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim)
        self.wk = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wv = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.rope = RoPEApply()
        self.core = CausalAttention(cfg.head_dim ** -0.5)

    def _head_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_norm(q), k_norm(k)``: one ``trnkit::rmsnorm_qk`` call when both norms are swapped in with one
        impl that has it (:func:`trnkit.overrides.guard.paired_head_norms`; the same outputs as two calls)."""
        qn, kn = self.q_norm, self.k_norm
        if qn.kernel is not None and kn.kernel is not None:
            from trnkit.overrides.guard import paired_head_norms

            pair = paired_head_norms(qn.kernel, kn.kernel, q, k, qn.weight, kn.weight, float(qn.eps), float(kn.eps))
            if pair is not None:
                return pair
        return qn(q), kn(k)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim)
        q, k = self._head_norms(q, k)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim)
        q, k = self.rope(q, k, rope_cache)
        return self.wo(self.core(q, k, v).reshape(B, S, -1))


class FeedForward(KernelSlot, nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (w1 = gate_proj, w3 = up_proj, w2 = down_proj; op ``mlp``).

    The kernel gets ``w_gate_up = cat(w1, w3).T [H, 2I]`` and ``w_down = w2.T [I, H]`` in the compute
    dtype (the autocast dtype under autocast); autograd takes the gradients back to the linears' weights.
    """

    kernel_op = "mlp"

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden_dim)
        self.w2 = Linear(hidden_dim, dim)
        self.w3 = Linear(dim, hidden_dim)

    def kernel_static(self) -> list[tuple[str, object, str]]:
        """The kernel computes the three projections from their weights: a wrapped one is not served."""
        return self._wrapped_static(w1=self.w1, w2=self.w2, w3=self.w3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self._kernel_reads(w1=self.w1, w2=self.w2, w3=self.w3):
            dt = compute_dtype(x, self.w1.weight)
            xc = x.to(dt)
            w_gate_up = torch.cat([self.w1.weight, self.w3.weight]).to(dt).T
            w_down = self.w2.weight.to(dt).T
            impl = self.kernel.choose(x=xc, w_gate_up=w_gate_up, w_down=w_down)
            if impl is not None:
                return _kernel_ops().mlp(xc, w_gate_up, w_down, impl, lnc=self.kernel.lnc)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TopKRouter(KernelSlot, nn.Module):
    """Qwen3-MoE router (swap point `layers[i].moe.router`): softmax(fp32) -> top-k -> optional renorm.

    forward(x [T,H]) -> (topk_weights [T,K] fp32, topk_idx [T,K] int64, router_logits [T,E] fp32).
    Ties go to the lower expert index.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = Linear(dim, num_experts)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob

    kernel_op = "router_topk"

    def kernel_static(self) -> list[tuple[str, object, str]]:
        """The kernel computes ``x @ gate.weight^T`` itself: anything else ``gate`` would do is not served."""
        wrapped = self._wrapped_static(gate=self.gate)
        if wrapped:
            return wrapped
        if self.gate.bias is not None:
            return [("gate without bias", "bias", "the kernel has no bias term")]
        return []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.kernel is None or not self._kernel_reads(gate=self.gate):
            return self._torch_forward(x)
        w = self.gate.weight
        # the kernel gets x and the weight in the dtype gate(x) computes in (the autocast dtype under autocast)
        dt = compute_dtype(x, w)
        xc, wc = x.to(dt), w.to(dt)
        impl = self._choose(x=xc, w_router=wc, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob)
        if impl is None:
            return self._torch_forward(x)
        # the kernel routes from its logits rounded to dt, as gate(x) returns them (ties to the lower expert)
        weights, idx, logits = _kernel_ops().router_topk(xc, wc, self.top_k, self.norm_topk_prob, impl,
                                                         lnc=self.kernel.lnc)
        return weights, idx.long(), logits

    def _torch_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.dim() != 2 or x.shape[1] != self.gate.in_features:
            raise ValueError(f"TopKRouter: x must be [T, {self.gate.in_features}], got {tuple(x.shape)}")
        return self._route(self.gate(x).float())  # HF: linear in the activation dtype, softmax in fp32

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1)
        # Chosen by logit with a stable descending sort: torch.topk's selection, except that ties go to
        # the lower expert index and experts whose probabilities underflowed to 0 are still ordered by
        # logit (torch.topk promises no order among ties). router_topk_ref and the NKI kernel agree.
        idx = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        weights = probs.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx, logits


def expert_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[n]``: how many of ``ids`` (each in ``[0, n)``; an id outside raises) equal each value. What
    ``torch.bincount(ids, minlength=n)`` gives, without its output size depending on the values (which
    reads the largest id back to the host on an accelerator)."""
    ones = torch.ones_like(ids, dtype=torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, ids, ones)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming grad contiguous (CPU `_grouped_mm` backward rejects
    expanded/zero-stride grads, e.g. from `y.sum()`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


def _aligned_for_grouped_mm(*tensors: torch.Tensor) -> bool:
    # CPU _grouped_mm needs every non-unit stride (in bytes) to be a multiple of 16.
    return all(all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
    """Rows `offs[g-1]:offs[g]` of x [M,K] times w[g] [K,N] -> [M,N] (offs: int32 exclusive ends).

    Uses `torch._grouped_mm` when the strides allow it (it has CPU fwd+bwd kernels in torch 2.13);
    otherwise a padded batched matmul (each group's rows scattered into a [G, max_rows, K] buffer),
    which is also a single batched op, never a loop over groups. ``max_rows``: the most rows of one
    group when the caller has read it already (else the padded path reads it from ``offs``).
    """
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return _grouped_mm_eager(x, w, offs)  # the traced (fake/meta) _grouped_mm accepts only bf16
    if _aligned_for_grouped_mm(x, w) and x.dtype == w.dtype:
        return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))
    return _padded_bmm(x, w, offs, max_rows)


@torch.compiler.disable
def _grouped_mm_eager(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grouped_mm(x, w, offs)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, max_rows: int | None) -> torch.Tensor:
    G, M = w.shape[0], x.shape[0]
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    starts = offs.long() - counts
    group_of_row = torch.repeat_interleave(torch.arange(G, device=x.device), counts, output_size=M)
    slot = torch.arange(M, device=x.device) - starts[group_of_row]
    cap = 0 if M == 0 else max_rows if max_rows is not None else int(counts.max())
    padded = x.new_zeros(G, cap, x.shape[1]).index_put((group_of_row, slot), x)
    return torch.bmm(padded, w)[group_of_row, slot]


def sum_rows_per_token(rows: torch.Tensor, token: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """``[n_tokens, H]``: each token's sum of the ``rows [M, H]`` whose ``token`` entry names it (its K expert
    outputs), summed in fp32 for a lower-precision ``rows`` (as ``Tensor.sum`` accumulates) and returned in
    ``rows``' dtype.

    One ``index_add`` straight from the expert-sorted rows: no un-sorted ``[M, H]`` copy to reduce, and a
    backward that is one row gather (``index_select``), where un-sort + ``view(T, K, H).sum(1)`` has to
    materialise the expanded gradient before gathering it (measured on CPU at 8,192 x 256 fp32 rows: 0.4
    ms forward and 0.3 ms backward against 2 ms and 10 ms). The K contributions of a token are added in
    expert order: for K <= 2 that is the same value as the slot-order sum (addition commutes), for more a
    different summation order.
    """
    acc = rows.dtype if rows.dtype in (torch.float32, torch.float64) else torch.float32
    out = rows.new_zeros((n_tokens, rows.shape[1]), dtype=acc).index_add(0, token, rows.to(acc))
    return out.to(rows.dtype)


class GroupedExperts(KernelSlot, nn.Module):
    """Routed SwiGLU experts (swap point `layers[i].moe.experts`), kernel weight layout.

    w_gate_up [E, H, 2I] (gate columns first), w_down [E, I, H].
    forward(x [T,H], topk_idx [T,K], topk_weights [T,K]) -> [T,H]: the T*K (token, expert) pairs are
    sorted by expert (stable), run through two grouped matmuls, scaled by the routing weight (cast to
    the activation dtype, as HF does) and summed back per token.
    """

    def __init__(self, dim: int, inter_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts, self.dim, self.inter_dim = num_experts, dim, inter_dim
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, dim, 2 * inter_dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, inter_dim, dim))

    kernel_op = "moe_experts"

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            ops, bs = _kernel_ops(), self.kernel.block_size  # block_size 0: the kernel's tuned sizes
            impl = self.kernel.choose(x=x, topk_idx=topk_idx, topk_weights=topk_weights, w_gate_up=self.w_gate_up,
                                      w_down=self.w_down, **ops.block_size_kw(bs))
            if impl is not None:
                return ops.moe_experts(x, topk_idx, topk_weights, self.w_gate_up, self.w_down, bs, impl,
                                       lnc=self.kernel.lnc)
        if x.dim() != 2 or x.shape[1] != self.dim or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] \
                or topk_weights.shape != topk_idx.shape:
            raise ValueError(f"GroupedExperts: expected x [T, {self.dim}], topk_idx [T, K] and topk_weights [T, K]; "
                             f"got {tuple(x.shape)}, {tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}")
        T, K = topk_idx.shape
        E, flat_idx = self.num_experts, topk_idx.reshape(-1)
        max_rows = None
        if not torch.compiler.is_compiling() and flat_idx.numel():
            counts = expert_counts(flat_idx.clamp(0, E - 1), E)  # = the counts once the range below holds
            # the call's one host read: the id range and the most rows of one expert (the padded matmul's size)
            lo, hi, max_rows = torch.stack([*torch.aminmax(flat_idx.long()), counts.max()]).tolist()
            if not (0 <= lo and hi < E):
                raise ValueError(f"GroupedExperts: expert ids must be in [0, {E}), got [{lo}, {hi}]")
        else:
            counts = expert_counts(flat_idx, E)
        order = torch.argsort(flat_idx, stable=True)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        token = order // K                                  # the token of each expert-sorted row
        xs = x.index_select(0, token)
        gate, up = grouped_mm(xs, self.w_gate_up, offs, max_rows).chunk(2, dim=-1)
        ys = grouped_mm(F.silu(gate) * up, self.w_down, offs, max_rows)
        ys = ys * topk_weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
        return sum_rows_per_token(ys, token, T)


class _DropsForwardState:
    """Mixin: tensors kept from the last forward (autograd graph nodes) are not module state, so
    ``copy.deepcopy`` and pickling work after a training forward (the copy has them as None)."""

    _forward_state: tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in self._forward_state:
            state[name] = None
        return state


def load_balancing_loss(counts: torch.Tensor, prob_sum: torch.Tensor, rows: float | torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """HF's Switch load-balancing loss from router statistics: ``E * sum_e (counts_e / rows) * (prob_sum_e / rows)``.

    ``counts``: top-k selections per expert (no gradient), ``prob_sum``: router probabilities summed per
    expert, ``rows``: (token, MoE layer) rows. With all three from one forward this is transformers'
    ``load_balancing_loss_func``. For global-batch balancing pass the counts and rows of the whole step
    (all microbatches and data-parallel ranks) with this microbatch's ``prob_sum``: the step's loss is then
    the sum of the microbatches' values.
    """
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


class MoE(_DropsForwardState, nn.Module):
    """Router + grouped experts: forward(x [B,S,dim]) -> [B,S,dim]. In training with the aux loss on,
    keeps ``aux_stats = (tokens per expert [E], summed router probabilities [E], rows)`` for
    :meth:`Qwen3Model.router_stats`."""

    _forward_state = ("aux_stats",)

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.router = TopKRouter(cfg.dim, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob)
        self.experts = GroupedExperts(cfg.dim, cfg.moe_inter_dim, cfg.num_experts)
        self.collect_aux = cfg.router_aux_loss_coef > 0
        self.aux_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        flat = x.reshape(-1, H)
        weights, idx, logits = self.router(flat)
        if self.training and self.collect_aux:
            E = logits.shape[-1]
            counts = expert_counts(idx.reshape(-1), E).float()
            self.aux_stats = (counts, torch.softmax(logits.float(), dim=-1).sum(0), flat.shape[0])
        else:
            self.aux_stats = None
        return self.experts(flat, idx, weights).view(B, S, H)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h = x + attention(attention_norm(x)); out = h + ffn(ffn_norm(h))`` with
    ffn the MoE block on MoE layers (``cfg.is_moe_layer(layer_id)``), else the dense SwiGLU.
    forward(x [B,S,dim], rope_cache [S,2*head_dim] fp32) -> [B,S,dim]."""

    def __init__(self, cfg: Qwen3Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe_enabled = cfg.is_moe_layer(layer_id)
        self.moe = MoE(cfg) if self.moe_enabled else None
        self.feed_forward = None if self.moe_enabled else FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


@torch.no_grad()
def trunc_normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """Normal(0, std) truncated to +-3 std, drawn by resampling the tails: the same distribution as
    `nn.init.trunc_normal_(t, 0, std, -3std, 3std)`, ~6x faster on CPU (no erfinv over every element;
    a 151936 x 1024 embedding takes ~2 s instead of ~12 s)."""
    t.normal_(0.0, std)
    flat = t.view(-1)
    bad = (flat.abs() > 3 * std).nonzero().squeeze(1)
    while bad.numel():
        flat[bad] = torch.randn(bad.numel(), dtype=t.dtype, device=t.device) * std
        bad = bad[flat[bad].abs() > 3 * std]
    return t


def _vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, object, int]:
    """(local rows, process group or None, first vocabulary row) of an lm_head weight: a plain tensor,
    a replicated DTensor, or a vocab-sharded (``Shard(0)`` on one mesh dim) tensor-parallel DTensor."""
    if not hasattr(weight, "to_local"):
        return weight, None, 0
    from torch.distributed.tensor import Shard

    shard = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard)]
    if not shard:
        return weight.to_local(), None, 0
    if len(shard) != 1 or weight.placements[shard[0]].dim != 0:
        raise ValueError(f"Qwen3Model: lm_head weight placements {weight.placements} are not a vocab "
                         "(dim 0) sharding over one mesh dimension")
    mesh_dim = shard[0]
    local = weight.to_local()
    # torch.chunk semantics (DTensor's Shard): every rank but the last holds ceil(V / n) rows
    n, r = weight.device_mesh.size(mesh_dim), weight.device_mesh.get_local_rank(mesh_dim)
    start = min(r * -(-weight.shape[0] // n), weight.shape[0])
    return local, weight.device_mesh.get_group(mesh_dim), start


class Qwen3Model(_DropsForwardState, nn.Module):
    """Qwen3 causal LM: forward(tokens [B,S] int64) -> logits [B,S,V].

    Build on the meta device and materialise with `to_empty` + `init_weights()`:

        with torch.device("meta"):
            model = Qwen3Model(cfg)
        model.to_empty(device="cpu"); model.init_weights()
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = Linear(config.dim, config.vocab_size)
        self.loss = LinearCrossEntropy()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self._make_rope_cache(), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        if config.kernels:  # {op: KernelChoice}: each swap point calls its trnkit:: op with its choice
            from trnkit.overrides import bind_kernels

            bind_kernels(self, config.kernels)

    _forward_state = ("aux_loss",)

    def _make_rope_cache(self, device: torch.device | str | None = None) -> torch.Tensor:
        c = self.config
        return _rope_cache(c.head_dim, c.max_seq_len, c.rope_theta, device=device)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # Keep the rope cache fp32 and valid across .to(dtype) / to_empty (DESIGN §4: fp32 buffer).
        was_meta = self.rope_cache.is_meta
        super()._apply(fn, recurse)
        if not self.rope_cache.is_meta and (was_meta or self.rope_cache.dtype != torch.float32):
            self.rope_cache = self._make_rope_cache(self.rope_cache.device)
        return self

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                loss_chunk_size: int = DEFAULT_CHUNK_SIZE, ignore_index: int = -100,
                loss_schedule: str = "recompute") -> torch.Tensor:
        """``tokens [B,S]`` -> logits [B,S,V]; with ``labels [B,S]``: the summed cross-entropy (fp32 scalar)
        over labels != ``ignore_index``, from the chunked linear cross-entropy (``loss_chunk_size``
        tokens per chunk; 0 = full logits + ``F.cross_entropy``), so [B*S, V] logits never exist.
        ``loss_schedule``: the swapped-in loss kernel's schedule (:class:`LinearCrossEntropy`).

        The loss is computed here, inside ``forward``, so FSDP2's forward hooks have gathered the
        lm_head weight. Under tensor parallelism with a vocab-sharded lm_head (a ``Shard(0)`` DTensor
        weight) the loss is vocab-parallel.
        """
        if tokens.dim() != 2:
            raise ValueError(f"Qwen3Model.forward: tokens must be [B, S], got shape {tuple(tokens.shape)}")
        S = tokens.shape[1]
        if S > self.rope_cache.shape[0]:
            raise ValueError(f"Qwen3Model.forward: sequence length {S} exceeds max_seq_len "
                             f"{self.rope_cache.shape[0]} (the rope cache length)")
        h = self.tok_embeddings(tokens)
        pad = self.config.pad_token_id
        if pad is not None:  # transformers' padding_idx: the pad row gets no gradient from its lookups (not
            # nn.Embedding's padding_idx, which would name a local row of a vocab-sharded embedding under TP)
            h = torch.where((tokens == pad).unsqueeze(-1), h.detach(), h)
        rope = self.rope_cache[:S]
        for layer in self.layers:
            h = layer(h, rope)
        h = self.norm(h)
        self.aux_loss = self._aux_loss() if self.training else None
        if labels is None:
            return self.lm_head(h)
        if labels.shape != tokens.shape:
            raise ValueError(f"Qwen3Model.forward: labels must have the tokens' shape {tuple(tokens.shape)}, "
                             f"got {tuple(labels.shape)}")
        if loss_chunk_size and self._lm_head_wrapped():
            loss_chunk_size = 0  # the fused loss reads lm_head.weight: the wrapper's part would be skipped
        if loss_chunk_size == 0:
            logits = self.lm_head(h).float()
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index,
                                   reduction="sum")
        return self.loss(h, self.lm_head.weight, labels, loss_chunk_size, ignore_index, schedule=loss_schedule)

    def _lm_head_wrapped(self) -> bool:
        """Whether ``lm_head`` computes more than ``F.linear`` (a LoRA-style wrapper, ...: see
        :func:`trnkit.overrides.guard.linear_wrapper`). The loss (the chunked torch loss and the swapped-in loss
        kernel alike) reads its weight, so the loss then runs the lm_head and ``F.cross_entropy``: under a loss
        kernel after its policy (``strict`` raises, ``fallback`` warns once), else with a warning (once)."""
        if type(self.lm_head) is Linear and "forward" not in vars(self.lm_head):
            return False  # the model's own projection (the check below loads the overrides package)
        from trnkit.overrides.guard import wrapped_projections

        wrapped = wrapped_projections(
            "linear_cross_entropy[native adapter]" if self.loss.kernel is not None else "Qwen3Model",
            {"lm_head": self.lm_head},
            "the fused lm_head + loss reads lm_head.weight, which would skip what the wrapper adds (a LoRA "
            "delta, ...); the loss runs lm_head and F.cross_entropy on the full logits")
        if not wrapped:
            return False
        if self.loss.kernel is not None:
            self.loss.kernel.refuse(wrapped)
        elif not torch.compiler.is_compiling():
            warnings.warn(str(wrapped[0]), UserWarning, stacklevel=3)
        return True

    def router_stats(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """``(selections per expert [E], router probabilities summed per expert [E], rows)`` over all MoE
        layers of the last training forward (None when the aux loss is off or in eval mode)."""
        stats = [b.moe.aux_stats for b in self.layers if b.moe_enabled and b.moe.aux_stats is not None]
        if not stats:
            return None
        return (torch.stack([s[0] for s in stats]).sum(0), torch.stack([s[1] for s in stats]).sum(0),
                sum(s[2] for s in stats))

    def _aux_loss(self) -> torch.Tensor | None:
        """HF's Switch-style load-balancing loss over all MoE layers, times router_aux_loss_coef.

        HF `load_balancing_loss_func`: concat the layers' router logits, p = softmax, top-k one-hot;
        loss = E * sum_e(mean_tokens_e * mean_prob_e), means over all (layer, token) rows.
        """
        stats = self.router_stats()
        if stats is None:
            return None
        counts, prob_sum, rows = stats
        return self.config.router_aux_loss_coef * load_balancing_loss(counts, prob_sum, rows, self.config.num_experts)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """torchtitan-style init: truncated normal(init_std, +-3 std) for all projections, embeddings and
        router; residual-output projections (wo, w2, expert w_down) use init_std / sqrt(2 * n_layers)
        (the depth-scaled "Megatron" rule of torchtitan's current decoder); norms = 1. Re-ties the
        tied lm_head (meta -> to_empty breaks the tie) and rebuilds the rope cache."""
        c = self.config
        std, out_std = c.init_std, c.init_std / math.sqrt(2 * c.n_layers)

        tn = trunc_normal_
        device = buffer_device if buffer_device is not None else self.tok_embeddings.weight.device
        self.rope_cache = self._make_rope_cache(device)
        tn(self.tok_embeddings.weight, std)
        for layer in self.layers:
            a = layer.attention
            for lin in (a.wq, a.wk, a.wv):
                tn(lin.weight, std)
            tn(a.wo.weight, out_std)
            for norm in (a.q_norm, a.k_norm, layer.attention_norm, layer.ffn_norm):
                norm.reset_parameters()
            if layer.moe_enabled:
                tn(layer.moe.router.gate.weight, std)
                tn(layer.moe.experts.w_gate_up, std)
                tn(layer.moe.experts.w_down, out_std)
            else:
                ff = layer.feed_forward
                tn(ff.w1.weight, std)
                tn(ff.w3.weight, std)
                tn(ff.w2.weight, out_std)
        self.norm.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        else:
            tn(self.lm_head.weight, std)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (a tied lm_head counts once)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n
