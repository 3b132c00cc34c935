"""Benchmark sweeps for each kernel, as :class:`~trnkit.bench.harness.Case` lists.

Sweeps: sequence length (rope_hf), tokens (router_topk, moe_experts, grouped_mm), and Qwen3 model
configs from the flavor registry (0.6B, 4B, 30B-A3B, 235B-A22B) at a fixed length; forward and backward;
bf16. ``quick=True`` gives CI-size shapes. Kernels are imported lazily (DESIGN.md §3 APIs): a kernel
that is not there yet is reported by :func:`unavailable` instead of failing the whole run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import replace

import torch

from trnkit.bench.harness import Case, Prepared

DTYPE = torch.bfloat16
MODES = ("forward", "backward")
DTYPES = ("bfloat16", "float32")


def _rand(*shape: int, g: torch.Generator, scale: float = 1.0, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _kernel_module(name: str):
    """The kernel family ``trnkit.kernels.<name>`` (its host API)."""
    return importlib.import_module(f"trnkit.kernels.{name}")


def _flavor(name: str):
    from trnkit.qwen3 import model_registry

    return model_registry(name).config


def _grad_closure(out: torch.Tensor, inputs: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], object]:
    """Time only the backward pass of a torch reference (graph kept between calls)."""
    return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)


# --- matmul_tiled: the demo / tutorial kernel, always available -------------------------------------


def matmul_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    dt = getattr(torch, dtype)
    from trnkit.demo import matmul_tiled

    def build(n: int) -> Callable[[], Prepared]:
        def f() -> Prepared:
            g = torch.Generator().manual_seed(0)
            a, b = _rand(n, n, g=g, dtype=dt), _rand(n, n, g=g, dtype=dt)
            return Prepared(nki=lambda: matmul_tiled(a, b), ref=lambda: a.T @ b)
        return f

    sizes = [512, 1024] if quick else [512, 1024, 2048, 4096]
    return [Case("matmul_tiled", "forward", "M=N=K", n, build(n), {"dtype": dtype})
            for n in sizes if "forward" in modes]


# --- rope_hf ----------------------------------------------------------------------------------------


def _rope_build(B: int, Hq: int, Hk: int, S: int, D: int, backward: bool, dtype: torch.dtype) -> Callable[[], Prepared]:
    def f() -> Prepared:
        mod = _kernel_module("rope")

        g = torch.Generator().manual_seed(0)
        q, k = _rand(B, Hq, S, D, g=g, dtype=dtype), _rand(B, Hk, S, D, g=g, dtype=dtype)
        pos = torch.arange(S, dtype=torch.float32)[:, None]
        inv = 1e6 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        ang = torch.cat([pos * inv, pos * inv], dim=-1)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        r_q, r_k = torch.empty_like(q), torch.empty_like(k)
        return Prepared(
            nki=lambda: mod.rope_hf(q, k, q_out, k_out, cos=cos, sin=sin, backward=backward),
            ref=lambda: mod.rope_hf_ref(q, k, r_q, r_k, cos=cos, sin=sin, backward=backward))
    return f


def rope_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    dt = getattr(torch, dtype)
    cases = []
    for mode in modes:
        bwd = mode == "backward"
        c = _flavor("0.6B")
        seqs = [128, 256] if quick else [128, 512, 1024, 2048, 4096, 8192]
        for S in seqs:
            cfg = {"flavor": "0.6B", "B": 1, "Hq": c.n_heads, "Hk": c.n_kv_heads, "D": c.head_dim, "dtype": dtype}
            build = _rope_build(1, c.n_heads, c.n_kv_heads, S, c.head_dim, bwd, dt)
            cases.append(Case("rope_hf", mode, "S", S, build, cfg))
        if not quick:
            for fl in ("0.6B", "4B", "30B-A3B", "235B-A22B"):
                c = _flavor(fl)
                cfg = {"B": 1, "S": 2048, "Hq": c.n_heads, "Hk": c.n_kv_heads, "D": c.head_dim, "dtype": dtype}
                cases.append(Case("rope_hf", mode, "flavor", fl,
                                  _rope_build(1, c.n_heads, c.n_kv_heads, 2048, c.head_dim, bwd, dt), cfg))
    return cases


# --- router_topk ------------------------------------------------------------------------------------


def _router_build(T: int, H: int, E: int, K: int, backward: bool, dtype: torch.dtype) -> Callable[[], Prepared]:
    def f() -> Prepared:
        mod = _kernel_module("router")

        g = torch.Generator().manual_seed(0)
        x, w = _rand(T, H, g=g, dtype=dtype), _rand(E, H, g=g, scale=H ** -0.5, dtype=dtype)
        if not backward:
            return Prepared(nki=lambda: mod.router_topk(x, w, K, True), ref=lambda: mod.router_topk_ref(x, w, K, True))
        weights, idx, logits = mod.router_topk(x, w, K, True)
        gw = _rand(T, K, g=g, dtype=torch.float32)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref_w, _, _ = mod.router_topk_ref(xr, wr, K, True)
        return Prepared(nki=lambda: mod.router_topk_bwd(x, w, logits, idx, gw, None, True),
                        ref=_grad_closure(ref_w, [xr, wr], gw))
    return f


def router_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    dt = getattr(torch, dtype)
    cases = []
    for mode in modes:
        bwd = mode == "backward"
        c = _flavor("30B-A3B")
        for T in ([128, 256] if quick else [128, 512, 1024, 2048, 4096, 8192]):
            cfg = {"flavor": "30B-A3B", "H": c.dim, "E": c.num_experts, "K": c.top_k, "dtype": dtype}
            build = _router_build(T, c.dim, c.num_experts, c.top_k, bwd, dt)
            cases.append(Case("router_topk", mode, "T", T, build, cfg))
        if not quick:
            for fl in ("30B-A3B", "235B-A22B"):
                c = _flavor(fl)
                cfg = {"T": 2048, "H": c.dim, "E": c.num_experts, "K": c.top_k, "dtype": dtype}
                cases.append(Case("router_topk", mode, "flavor", fl,
                                  _router_build(2048, c.dim, c.num_experts, c.top_k, bwd, dt), cfg))
    return cases


# --- MoE: moe_experts and grouped_mm ----------------------------------------------------------------


def _routing(T: int, E: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(T, E, generator=g)
    w, idx = torch.softmax(logits, -1).topk(K, -1)
    return idx.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def _moe_build(T: int, H: int, I: int, E: int, K: int, backward: bool, dtype: torch.dtype,  # noqa: E741
               lnc: int = 1) -> Callable[[], Prepared]:
    def f() -> Prepared:
        mod = _kernel_module("moe")

        g = torch.Generator().manual_seed(0)
        x = _rand(T, H, g=g, dtype=dtype)
        idx, tw = _routing(T, E, K, g)
        wgu = _rand(E, H, 2 * I, g=g, scale=H ** -0.5, dtype=dtype)
        wd = _rand(E, I, H, g=g, scale=I ** -0.5, dtype=dtype)
        if not backward:
            return Prepared(nki=lambda: mod.moe_experts(x, idx, tw, wgu, wd, lnc=lnc),
                            ref=lambda: mod.moe_experts_ref(x, idx, tw, wgu, wd))
        go = _rand(T, H, g=g, dtype=dtype)
        leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
        out = mod.moe_experts_ref(leaves[0], idx, leaves[1], leaves[2], leaves[3])
        return Prepared(nki=lambda: mod.moe_experts_bwd(x, idx, tw, wgu, wd, go, lnc=lnc),
                        ref=_grad_closure(out, leaves, go))
    return f


def _moe_dims(quick: bool) -> tuple[str, int, int, int, int]:
    if quick:  # CI-size: a small MoE with the kernel's tile-friendly sizes
        return "tiny", 512, 256, 8, 2
    c = _flavor("30B-A3B")
    return "30B-A3B", c.dim, c.moe_inter_dim, c.num_experts, c.top_k


def moe_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    dt = getattr(torch, dtype)
    cases = []
    name, H, I, E, K = _moe_dims(quick)  # noqa: E741
    for mode in modes:
        bwd = mode == "backward"
        # backward at full size costs minutes per point on the interpreter: fewer points
        for T in ([128, 256] if quick else [128, 512] if bwd else [128, 512, 1024]):
            cfg = {"config": name, "H": H, "I": I, "E": E, "K": K, "dtype": dtype}
            cases.append(Case("moe_experts", mode, "T", T, _moe_build(T, H, I, E, K, bwd, dt), cfg))
        if not quick:
            for fl in ("30B-A3B", "235B-A22B"):
                c = _flavor(fl)
                cfg = {"T": 256, "H": c.dim, "I": c.moe_inter_dim, "E": c.num_experts, "K": c.top_k, "dtype": dtype}
                cases.append(Case("moe_experts", mode, "flavor", fl,
                                  _moe_build(256, c.dim, c.moe_inter_dim, c.num_experts, c.top_k, bwd, dt), cfg))
        cases += _moe_lnc_cases(quick, mode, dtype)
    return cases


# the LNC=1 vs LNC=2 comparison: T=512 tokens, Qwen3-30B-A3B expert sizes, E = 8 and 128
LNC_SHAPE = {"T": 512, "H": 2048, "I": 768, "K": 8}
LNC_EXPERTS = (8, 128)


def _moe_lnc_cases(quick: bool, mode: str, dtype: str) -> list[Case]:
    """One sweep over E per LNC (x_name ``E (LNC=n)``), so each LNC is its own line in the table."""
    T, H, I, K = (64, 512, 256, 2) if quick else tuple(LNC_SHAPE.values())  # noqa: E741
    experts = (4, 8) if quick else LNC_EXPERTS
    dt = getattr(torch, dtype)
    return [Case("moe_experts", mode, f"E (LNC={lnc})", E,
                 _moe_build(T, H, I, E, K, mode == "backward", dt, lnc),
                 {"T": T, "H": H, "I": I, "K": K, "lnc": lnc, "dtype": dtype})
            for lnc in (1, 2) for E in experts]


def _gmm_build(M: int, Kd: int, N: int, G: int, backward: bool, dtype: torch.dtype,
               lnc: int = 1) -> Callable[[], Prepared]:
    def f() -> Prepared:
        mod = _kernel_module("moe")

        g = torch.Generator().manual_seed(0)
        x, w = _rand(M, Kd, g=g, dtype=dtype), _rand(G, Kd, N, g=g, scale=Kd ** -0.5, dtype=dtype)
        # uneven groups: random split of the M rows over G experts
        counts = torch.multinomial(torch.ones(G), M, replacement=True, generator=g).bincount(minlength=G)
        offs = counts.cumsum(0).to(torch.int32)
        if not backward:
            return Prepared(nki=lambda: mod.grouped_mm(x, w, offs, lnc=lnc), ref=lambda: mod.grouped_mm_ref(x, w, offs))
        go = _rand(M, N, g=g, dtype=dtype)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = mod.grouped_mm_ref(xr, wr, offs)
        return Prepared(nki=lambda: mod.grouped_mm_bwd(x, w, offs, go, lnc=lnc), ref=_grad_closure(out, [xr, wr], go))
    return f


def gmm_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    dt = getattr(torch, dtype)
    name, H, I, E, K = _moe_dims(quick)  # noqa: E741
    cases = []
    for mode in modes:
        for T in ([128, 256] if quick else [128, 512] if mode == "backward" else [128, 512, 1024, 2048]):
            M = T * K  # token-expert slots after dispatch
            cfg = {"config": name, "K": H, "N": 2 * I, "G": E, "dtype": dtype, "T": T, "top_k": K}
            cases.append(Case("grouped_mm", mode, "M", M, _gmm_build(M, H, 2 * I, E, mode == "backward", dt), cfg))
        T = 128 if quick else 512  # LNC=2 rows: the cores split the groups
        cfg = {"config": name, "K": H, "N": 2 * I, "G": E, "dtype": dtype, "T": T, "top_k": K, "lnc": 2}
        cases.append(Case("grouped_mm", mode, "M (LNC=2)", T * K,
                          _gmm_build(T * K, H, 2 * I, E, mode == "backward", dt, 2), cfg))
    return cases


# --- rmsnorm ----------------------------------------------------------------------------------------


def _rmsnorm_build(rows: int, H: int, backward: bool, dtype: torch.dtype, lnc: int = 1,
                   residual: bool = False) -> Callable[[], Prepared]:
    def f() -> Prepared:
        mod = _kernel_module("rmsnorm")

        g = torch.Generator().manual_seed(0)
        x, w = _rand(rows, H, g=g, dtype=dtype), (1 + _rand(H, g=g, scale=0.1, dtype=torch.float32)).to(dtype)
        r = _rand(rows, H, g=g, dtype=dtype) if residual else None
        if not backward:
            if residual:
                return Prepared(nki=lambda: mod.rmsnorm_residual(x, r, w, lnc=lnc),
                                ref=lambda: mod.rmsnorm_residual_ref(x, r, w))
            return Prepared(nki=lambda: mod.rmsnorm(x, w, lnc=lnc), ref=lambda: mod.rmsnorm_ref(x, w))
        _, rstd = mod.rmsnorm_ref(x, w)
        gy = _rand(rows, H, g=g, dtype=dtype)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        yr, _ = mod.rmsnorm_ref(xr, wr)
        return Prepared(nki=lambda: mod.rmsnorm_bwd(gy, x, w, rstd, r, lnc=lnc), ref=_grad_closure(yr, [xr, wr], gy))
    return f


def _rmsnorm_qk_build(T: int, Hq: int, Hk: int, D: int, backward: bool, dtype: torch.dtype, lnc: int
                      ) -> Callable[[], Prepared]:
    """The q and k head norms in one launch (``rmsnorm_qk``): ``[T*Hq, D]`` and ``[T*Hk, D]`` rows, two weights."""
    def f() -> Prepared:
        mod = _kernel_module("rmsnorm")

        g = torch.Generator().manual_seed(0)
        q, k = _rand(T * Hq, D, g=g, dtype=dtype), _rand(T * Hk, D, g=g, dtype=dtype)
        wq, wk = ((1 + _rand(D, g=g, scale=0.1, dtype=torch.float32)).to(dtype) for _ in range(2))
        if not backward:
            return Prepared(nki=lambda: mod.rmsnorm_qk(q, k, wq, wk, lnc=lnc),
                            ref=lambda: mod.rmsnorm_qk_ref(q, k, wq, wk))
        _, _, rq, rk = mod.rmsnorm_qk_ref(q, k, wq, wk)
        gq, gk = _rand(T * Hq, D, g=g, dtype=dtype), _rand(T * Hk, D, g=g, dtype=dtype)
        leaves = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
        yq, yk, _, _ = mod.rmsnorm_qk_ref(*leaves)
        y = torch.cat([yq.reshape(-1), yk.reshape(-1)])
        return Prepared(nki=lambda: mod.rmsnorm_qk_bwd(gq, gk, q, k, wq, wk, rq, rk, lnc=lnc),
                        ref=_grad_closure(y, leaves, torch.cat([gq.reshape(-1), gk.reshape(-1)])))
    return f


def rmsnorm_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    """Tokens at Qwen3-4B's hidden size (LNC=1 and 2), the Qwen3 flavors at 8192 tokens, and the q head norm
    (rows = tokens x heads, H = head_dim) and the q and k head norms in one launch at 2048 tokens."""
    dt = getattr(torch, dtype)
    cases = []
    for mode in modes:
        bwd = mode == "backward"
        c = _flavor("4B")
        for lnc in (1, 2):
            for T in ([128, 256] if quick else [512, 2048, 8192]):
                cfg = {"flavor": "4B", "H": c.dim, "lnc": lnc, "dtype": dtype}
                cases.append(Case("rmsnorm", mode, f"T (LNC={lnc})", T, _rmsnorm_build(T, c.dim, bwd, dt, lnc), cfg))
        if quick:
            continue
        for fl in ("0.6B", "4B", "30B-A3B"):
            c = _flavor(fl)
            cfg = {"T": 8192, "H": c.dim, "lnc": 2, "dtype": dtype, "residual": True}
            cases.append(Case("rmsnorm", mode, "flavor (residual, LNC=2)", fl,
                              _rmsnorm_build(8192, c.dim, bwd, dt, 2, residual=True), cfg))
            cfg = {"T": 2048, "rows": 2048 * c.n_heads, "H": c.head_dim, "lnc": 2, "dtype": dtype}
            cases.append(Case("rmsnorm", mode, "q-norm flavor (LNC=2)", fl,
                              _rmsnorm_build(2048 * c.n_heads, c.head_dim, bwd, dt, 2), cfg))
            cfg = {"T": 2048, "rows": 2048 * (c.n_heads + c.n_kv_heads), "H": c.head_dim, "lnc": 2, "dtype": dtype,
                   "heads": f"{c.n_heads}+{c.n_kv_heads}"}
            cases.append(Case("rmsnorm", mode, "qk-norm flavor (one launch, LNC=2)", fl,
                              _rmsnorm_qk_build(2048, c.n_heads, c.n_kv_heads, c.head_dim, bwd, dt, 2), cfg))
    return cases


def _attention_build(S: int, Hq: int, Hk: int, D: int, backward: bool, dtype: torch.dtype, lnc: int
                     ) -> Callable[[], Prepared]:
    def f() -> Prepared:
        mod = _kernel_module("attention")

        g = torch.Generator().manual_seed(0)
        q, k, v = (_rand(1, S, h, D, g=g, dtype=dtype) for h in (Hq, Hk, Hk))
        if not backward:
            return Prepared(nki=lambda: mod.attention(q, k, v, lnc=lnc), ref=lambda: mod.attention_ref(q, k, v))
        o, lse = mod.attention_ref(q, k, v)
        go = _rand(1, S, Hq, D, g=g, dtype=dtype)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out, _ = mod.attention_ref(qr, kr, vr)
        return Prepared(nki=lambda: mod.attention_bwd(q, k, v, o, lse, go, lnc=lnc),
                        ref=_grad_closure(out, [qr, kr, vr], go))
    return f


def attention_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    """Causal attention, one batch row: sequence length at Qwen3-4B's heads (32 q / 8 kv, head_dim 128;
    LNC=2), and the Qwen3 flavors' heads at 2048 tokens (quick: 4 q / 1 kv heads, S = 256, 512)."""
    dt = getattr(torch, dtype)
    cases = []
    for mode in modes:
        bwd = mode == "backward"
        if quick:
            for S in (256, 512):
                cfg = {"Hq": 4, "Hk": 1, "D": 128, "lnc": 2, "dtype": dtype}
                build = _attention_build(S, 4, 1, 128, bwd, dt, 2)
                cases.append(Case("attention", mode, "S (4 q / 1 kv heads)", S, build, cfg))
            continue
        c = _flavor("4B")
        for S in (512, 1024, 2048, 4096):
            cfg = {"flavor": "4B", "Hq": c.n_heads, "Hk": c.n_kv_heads, "D": c.head_dim, "lnc": 2, "dtype": dtype}
            cases.append(Case("attention", mode, "S (4B heads, LNC=2)", S,
                              _attention_build(S, c.n_heads, c.n_kv_heads, c.head_dim, bwd, dt, 2), cfg))
        for fl in ("0.6B", "4B", "30B-A3B"):
            c = _flavor(fl)
            cfg = {"S": 2048, "Hq": c.n_heads, "Hk": c.n_kv_heads, "D": c.head_dim, "lnc": 2, "dtype": dtype}
            cases.append(Case("attention", mode, "flavor (S=2048, LNC=2)", fl,
                              _attention_build(2048, c.n_heads, c.n_kv_heads, c.head_dim, bwd, dt, 2), cfg))
    return cases


def _cross_entropy_build(T: int, H: int, V: int, backward: bool, dtype: torch.dtype, lnc: int
                         ) -> Callable[[], Prepared]:
    def f() -> Prepared:
        mod = _kernel_module("cross_entropy")

        g = torch.Generator().manual_seed(0)
        h, w = _rand(T, H, g=g, dtype=dtype), _rand(V, H, g=g, scale=H ** -0.5, dtype=dtype)
        labels = torch.randint(0, V, (T,), generator=g)
        if not backward:
            return Prepared(nki=lambda: mod.linear_cross_entropy(h, w, labels, lnc=lnc),
                            ref=lambda: mod.linear_cross_entropy_ref(h, w, labels))
        _, lse = mod.linear_cross_entropy_ref(h, w, labels)
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy(hr.float() @ wr.float().T, labels)
        return Prepared(nki=lambda: mod.linear_cross_entropy_bwd(h, w, labels, lse, lnc=lnc),
                        ref=_grad_closure(loss, [hr, wr], torch.ones(())))
    return f


CE_VOCAB = 16384  # the sweeps' vocabulary: the kernels' cost is linear in V (one loop over its tiles)


def cross_entropy_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    """The fused lm_head + loss: tokens at Qwen3-30B-A3B's H (2048) over a 16,384 vocabulary (the cost is
    linear in V: multiply by 151,936 / 16,384 = 9.27 for Qwen3's), LNC=1 and 2."""
    dt = getattr(torch, dtype)
    cases = []
    for mode in modes:
        bwd = mode == "backward"
        H = _flavor("30B-A3B").dim
        for lnc in (1, 2):
            for T in ([128, 256] if quick else [512, 1024, 2048]):
                cfg = {"flavor": "30B-A3B", "H": H, "V": CE_VOCAB, "lnc": lnc, "dtype": dtype}
                cases.append(Case("cross_entropy", mode, f"T (LNC={lnc})", T,
                                  _cross_entropy_build(T, H, CE_VOCAB, bwd, dt, lnc), cfg))
    return cases


def _mlp_build(T: int, H: int, I: int, backward: bool, dtype: torch.dtype, lnc: int) -> Callable[[], Prepared]:  # noqa: E741
    def f() -> Prepared:
        mod = _kernel_module("mlp")

        g = torch.Generator().manual_seed(0)
        x = _rand(T, H, g=g, dtype=dtype)
        wgu, wd = _rand(H, 2 * I, g=g, scale=H ** -0.5, dtype=dtype), _rand(I, H, g=g, scale=I ** -0.5, dtype=dtype)
        if not backward:
            return Prepared(nki=lambda: mod.mlp(x, wgu, wd, lnc=lnc), ref=lambda: mod.mlp_ref(x, wgu, wd))
        gy = _rand(T, H, g=g, dtype=dtype)
        graph: list = []  # the reference's forward graph, built at its first timed call (not for --no-torch)

        def ref() -> object:
            if not graph:
                xr, wgur, wdr = (t.clone().requires_grad_() for t in (x, wgu, wd))
                gate, up = (xr @ wgur).chunk(2, dim=-1)
                graph.append(_grad_closure((torch.nn.functional.silu(gate) * up) @ wdr, [xr, wgur, wdr], gy))
            return graph[0]()

        return Prepared(nki=lambda: mod.mlp_bwd(x, wgu, wd, gy, lnc=lnc), ref=ref)
    return f


def mlp_cases(quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    """The dense SwiGLU MLP, LNC=2: tokens at Qwen3-4B's H and I (2560, 9728), and Qwen3-0.6B at 2048
    tokens (quick: H = 256, I = 768)."""
    dt = getattr(torch, dtype)
    cases = []
    for mode in modes:
        bwd = mode == "backward"
        if quick:
            for T in (128, 256):
                cfg = {"H": 256, "I": 768, "lnc": 2, "dtype": dtype}
                cases.append(Case("mlp", mode, "T (H=256, I=768, LNC=2)", T, _mlp_build(T, 256, 768, bwd, dt, 2), cfg))
            continue
        c = _flavor("4B")
        for T in (512, 1024, 2048):
            cfg = {"flavor": "4B", "H": c.dim, "I": c.hidden_dim, "lnc": 2, "dtype": dtype}
            cases.append(Case("mlp", mode, "T (4B, LNC=2)", T, _mlp_build(T, c.dim, c.hidden_dim, bwd, dt, 2), cfg))
        for fl in ("0.6B",):  # 4B at T=2048 is the T sweep's last case
            c = _flavor(fl)
            cfg = {"T": 2048, "H": c.dim, "I": c.hidden_dim, "lnc": 2, "dtype": dtype}
            cases.append(Case("mlp", mode, "flavor (T=2048, LNC=2)", fl,
                              _mlp_build(2048, c.dim, c.hidden_dim, bwd, dt, 2), cfg))
    return cases


# kernel name -> (module under trnkit.kernels that must import, names it must have, case builder)
KERNELS: dict[str, tuple[str | None, tuple[str, ...], Callable[..., list[Case]]]] = {
    "matmul_tiled": (None, (), matmul_cases),
    "rope_hf": ("rope", ("rope_hf", "rope_hf_ref"), rope_cases),
    "router_topk": ("router", ("router_topk", "router_topk_ref", "router_topk_bwd"), router_cases),
    "moe_experts": ("moe", ("moe_experts", "moe_experts_ref", "moe_experts_bwd"), moe_cases),
    "grouped_mm": ("moe", ("grouped_mm", "grouped_mm_ref", "grouped_mm_bwd"), gmm_cases),
    "rmsnorm": ("rmsnorm", ("rmsnorm", "rmsnorm_ref", "rmsnorm_bwd"), rmsnorm_cases),
    "attention": ("attention", ("attention", "attention_ref", "attention_bwd"), attention_cases),
    "cross_entropy": ("cross_entropy", ("linear_cross_entropy", "linear_cross_entropy_ref",
                                        "linear_cross_entropy_bwd"), cross_entropy_cases),
    "mlp": ("mlp", ("mlp", "mlp_ref", "mlp_bwd"), mlp_cases),
}


def unavailable(kernel: str) -> str | None:
    """Why ``kernel`` cannot be benchmarked now (its module or functions are missing), else None."""
    if kernel not in KERNELS:
        return f"unknown kernel {kernel!r} (known: {', '.join(KERNELS)})"
    module, names, _ = KERNELS[kernel]
    if module is None:
        return None
    try:
        mod = importlib.import_module(f"trnkit.kernels.{module}")
    except ImportError as exc:
        return f"trnkit.kernels.{module} does not import ({exc})"
    missing = [n for n in names if not hasattr(mod, n)]
    return f"trnkit.kernels.{module} lacks {', '.join(missing)}" if missing else None


def cases_for(kernel: str, quick: bool, modes: tuple[str, ...] = MODES, dtype: str = "bfloat16") -> list[Case]:
    why = unavailable(kernel)
    if why:
        raise ValueError(f"bench: cannot benchmark {kernel}: {why}")
    if dtype not in DTYPES:
        raise ValueError(f"bench: dtype must be one of {DTYPES}, got {dtype!r}")
    return [replace(c, sources=kernel_sources(kernel)) for c in KERNELS[kernel][2](quick, modes, dtype)]


def kernel_sources(kernel: str) -> tuple[str, ...]:
    """What a benchmark of ``kernel`` runs, as trnkit.bench.fingerprint sources: its family's folder
    (``matmul_tiled``: the demo module)."""
    module = KERNELS[kernel][0]
    return (f"trnkit/kernels/{module}",) if module else ("trnkit/demo.py",)
