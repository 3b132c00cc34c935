"""Test helpers shared by more than one test module (test modules import from here, never from each other)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._library import custom_ops
from torch.utils._python_dispatch import TorchDispatchMode

from trnkit.nki_api import nisa, nki, nl
from trnkit.nkisim import hardware
from trnkit.nkisim.trace import TENSOR, Instr, Operand

# ------------------------------------------------------------------------- overrides: tiny HF models
TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def hf_logits_and_grads(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> tuple[torch.Tensor, dict]:
    """A transformers model's logits on ``tokens`` and the parameter gradients of ``mean(logits ** 2)``."""
    model.zero_grad()
    out = model(tokens).logits
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------ MoE kernels: inputs


def rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def expert_weights(E: int, H: int, inter: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return (rand(E, H, 2 * inter, dtype=dtype, scale=H ** -0.5, seed=seed),
            rand(E, inter, H, dtype=dtype, scale=inter ** -0.5, seed=seed + 1))


def routing(T: int, E: int, K: int, seed: int = 2, experts: list[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (drawn from ``experts``), renormalised softmax-like weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else list(range(E)))
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    return idx, w / w.sum(-1, keepdim=True)


GMM_CASES = {
    # name: (M, K, N, offsets, block_size)
    "tails_empty_group": (70, 200, 600, [10, 10, 63], 64),  # K, N not multiples of 128/512
    "one_group_all_rows": (33, 64, 48, [33], 32),
    "rows_past_end": (40, 96, 80, [0, 17, 30], 128),
    "many_k_chunks": (24, 800, 1100, [10, 24], 32),  # 3 PSUM passes of the weight-gradient kernel
}


MOE_CASES = {
    # name: (T, H, I, E, K, block_size, experts used or None)
    "tails": (24, 160, 96, 5, 2, 32, None),  # H % 128 = 32, I % 128 = 96
    "T1": (1, 64, 32, 4, 2, 32, None),
    "all_to_one_expert": (40, 64, 32, 4, 1, 32, [2]),  # 2 blocks of expert 2, others empty
    "empty_experts": (20, 64, 48, 6, 2, 32, [0, 2, 3, 5]),
    "K_equals_E": (10, 64, 32, 3, 3, 32, None),
    "prime_E": (20, 64, 32, 7, 2, 64, None),
    "odd_H_I": (12, 72, 20, 3, 2, 32, None),
    "block_256": (130, 64, 32, 2, 2, 256, None),  # 2 sub-tiles of 128 rows per block
    "half_tail_128": (40, 64, 32, 2, 2, 128, None),  # every expert's only block runs 64 wide
    "tail_96": (80, 64, 32, 1, 1, 128, None),  # 80 rows: one 96-wide block
    "full_plus_half_128": (150, 64, 32, 1, 1, 128, None),  # one 128-wide block + one 64-wide tail
    "half_tail_256": (100, 64, 32, 1, 1, 256, None),  # the tail runs as one 128-row sub-tile
    "block_512": (600, 64, 32, 1, 1, 512, None),  # 4 sub-tiles, 512 moving columns, + a 256 tail
    "two_experts_512": (700, 64, 32, 2, 2, 512, None),  # each: a 512 block + a 192 tail (look-ahead across)
    "big_I": (20, 64, 1100, 2, 1, 128, None),  # 9 I-chunks: 2 PSUM passes of gate/up
}


def moe_inputs(case: str, dtype: torch.dtype):
    T, H, inter, E, K, B, used = MOE_CASES[case]
    x = rand(T, H, dtype=dtype)
    wgu, wd = expert_weights(E, H, inter, dtype)
    idx, tw = routing(T, E, K, experts=used)
    return x, idx, tw, wgu, wd, B


def weight_dmas(tr) -> list:
    """The weight loads of a moe_experts trace with bf16 inputs: the plain (not indirect) HBM -> SBUF
    DMAs of bf16 data before a program's combine (which starts with its selection matrix's iota; x
    rows come by indirect DMA, block tables are int32, affinities fp32)."""
    out, combining = [], set()
    for i in tr:
        if i.op == "iota":
            combining.add(i.program_id)
        elif (i.op == "dma_copy" and i.program_id not in combining and not i.attrs["indirect"]
              and i.operands[0].buffer == "sbuf" and i.operands[0].dtype == "bfloat16"):
            out.append(i)
    return out


def assert_bit_identical(a: tuple | torch.Tensor, b: tuple | torch.Tensor) -> None:
    for k, (x, y) in enumerate(zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,))):
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x, y), f"output {k}: max diff {(x.float() - y.float()).abs().max().item()}"


def gate(a: torch.Tensor, u: torch.Tensor, activation: str, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """h = act(a) * u, written as torch / transformers write it."""
    if activation == "silu":
        return F.silu(a) * u
    if activation == "gelu_tanh":
        return F.gelu(a, approximate="tanh") * u
    a = a.clamp(min=None, max=limit)  # GptOssExperts._apply_gate, with gate / up as separate halves
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (a * torch.sigmoid(a * alpha))


def torch_experts(x, idx, tw, wgu, wd, bgu, bd, dt, activation="silu", limit=7.0, alpha=1.702):
    """out[t] = sum_k w[t,k] * (act(x_t W_gu[e] + b_gu[e]) W_d[e] + b_d[e]) in dtype dt (one gather per slot)."""
    T, K = idx.shape
    inter = wd.shape[1]
    e = idx.reshape(-1).long()
    xs = x.to(dt).repeat_interleave(K, 0)
    gu = torch.einsum("sh,shi->si", xs, wgu.to(dt)[e])
    if bgu is not None:
        gu = gu + bgu.to(dt)[e]
    h = gate(gu[:, :inter], gu[:, inter:], activation, limit, alpha)
    y = torch.einsum("si,sih->sh", h, wd.to(dt)[e])
    if bd is not None:
        y = y + bd.to(dt)[e]
    y = y * tw.reshape(-1, 1).to(dt)
    return y.view(T, K, -1).sum(1)


# ----------------------------------------------------------------------- cost model: hand-made traces
TRN2 = hardware.TRN2
ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1, "int32": 4}


def opnd(role: str, buffer: str, shape: tuple[int, ...], dtype: str = "bfloat16") -> Operand:
    n = math.prod(shape)
    onchip = buffer in ("sbuf", "psum")
    return Operand(role, buffer, shape, dtype, shape[0] if onchip else 1,
                   n // shape[0] if onchip else n, n * ITEM[dtype])


def matmul(k: int, m: int, n: int, dtype: str = "bfloat16", deps=None, **attrs) -> Instr:
    ops = (opnd("dst", "psum", (m, n), "float32"), opnd("stationary", "sbuf", (k, m), dtype),
           opnd("moving", "sbuf", (k, n), dtype))
    if deps:
        attrs.update(deps)
    return Instr("nc_matmul", TENSOR, ops, flops=2 * m * n * k, elems_per_partition=n, partitions=k, attrs=attrs)


# ----------------------------------------------------------------------------------- host reads
# ops whose result is a Python value or whose output size depends on the values: on an accelerator each one
# waits for the device and copies back (_local_scalar_dense: .item(), int(t), float(t), bool(t))
_READ_OPS = {"aten._local_scalar_dense", "aten.bincount", "aten.nonzero", "aten.masked_select", "aten._unique2",
             "aten.unique_dim", "aten.unique_consecutive", "aten.histc"}
_READ_METHODS = ("tolist", "numpy", "cpu")  # not dispatched on CPU tensors: counted by wrapping them


def _reads_values(name: str, args: tuple, kwargs: dict) -> bool:
    """repeat_interleave without ``output_size``; indexing by a boolean mask (its size is the mask's count)."""
    if name == "aten.repeat_interleave":
        return kwargs.get("output_size") is None
    if name in ("aten.index", "aten.index_put", "aten.index_put_"):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    return False


class HostReads(TorchDispatchMode):
    """Records every read of tensor values back to the host inside its ``with`` block (``reads``: the op or
    method names, in order); nothing is counted inside :meth:`paused`."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.counting = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        qualified = func.overloadpacket._qualified_op_name
        if qualified.startswith("trnkit::"):
            # a trnkit custom op: torch would run its body with this mode off, so run the body under it
            with self:
                return custom_ops.OPDEFS[qualified]._init_fn(*args, **(kwargs or {}))
        name = qualified.replace("::", ".")
        if self.counting and (name in _READ_OPS or _reads_values(name, args, kwargs or {})):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def outside(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run with counting paused (a kernel launch: on the device its work is not a host read)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.paused():
                return fn(*args, **kwargs)
        return call


@contextlib.contextmanager
def host_reads() -> Iterator[HostReads]:
    """``with host_reads() as r: ...`` then ``r.reads``: see :class:`HostReads`."""
    mode, saved = HostReads(), {name: getattr(torch.Tensor, name) for name in _READ_METHODS}

    def wrap(name: str) -> Callable[..., Any]:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if mode.counting:
                mode.reads.append(name)
            return saved[name](self, *args, **kwargs)
        return method

    for name in _READ_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        with mode:
            yield mode
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


# ------------------------------------------------------------------------- cost model: a DMA-only kernel
@nki.jit
def dma_round_trip(x):
    """``x`` HBM -> SBUF -> HBM in two whole-tile ``dma_copy``s (x: [<= 128, n]): a kernel of one load and one store."""
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out
