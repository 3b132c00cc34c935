"""Low-precision matmuls multiplied in fp32 on CPUs without native bf16 (trnkit/qwen3/precision.py).

The reference is exact: fp64 products of the same bf16-rounded operands, rounded to bf16 once. Both
torch's bf16 GEMM and the fp32 one accumulate in fp32 in their own order, so an output element may round
to the neighbouring bf16 value: each is compared with the exact result with one bf16 ulp of the largest
magnitude (2**-7 relative, tests/tolerances.py), and the fp32 path must be at least as close as torch's
bf16 path (which the chosen path replaces on such CPUs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trnkit.qwen3 import Qwen3Model, model_registry
from trnkit.qwen3 import precision
from trnkit.qwen3.precision import Linear, linear, matmul_dtype

BF16_ULP = 2**-7  # relative to the largest magnitude


def _force(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(precision, "native_matmul", lambda dt: native)


def _err(t: torch.Tensor, exact: torch.Tensor) -> float:
    return float((t.detach().double() - exact.detach()).abs().max()) / float(exact.detach().abs().max())


def test_matmul_dtype_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert matmul_dtype(torch.float32, cpu) == torch.float32
    assert matmul_dtype(torch.bfloat16, torch.device("meta")) == torch.bfloat16  # other devices: as asked
    _force(monkeypatch, native=False)
    assert matmul_dtype(torch.bfloat16, cpu) == torch.float32
    assert matmul_dtype(torch.float16, cpu) == torch.float32
    _force(monkeypatch, native=True)
    assert matmul_dtype(torch.bfloat16, cpu) == torch.bfloat16


def _linear_grads(fn, x, w, g):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    return y, x.grad, w.grad


@pytest.mark.parametrize("shape", [(2, 5, 48), (7, 33), (1, 1, 300)])  # odd sizes, a long reduction
def test_linear_under_autocast_matches_exact(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(shape[-1])
    x, w = torch.randn(*shape, generator=gen), torch.randn(40, shape[-1], generator=gen) * 0.1
    g = torch.randn(*shape[:-1], 40, generator=gen).bfloat16()
    xr, wr, gd = x.bfloat16().double(), w.bfloat16().double(), g.double()
    exact = ((xr @ wr.T).bfloat16().double(), (gd @ wr).bfloat16().double(),
             (gd.reshape(-1, 40).T @ xr.reshape(-1, shape[-1])).bfloat16().double())
    got = {}
    for native in (False, True):
        _force(monkeypatch, native)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got[native] = _linear_grads(linear, x, w, g)
    assert got[False][0].grad_fn.name() == "_RoundedLinearBackward"  # fp32 product of the rounded operands
    assert got[True][0].grad_fn.name() != "_RoundedLinearBackward"   # torch's own bf16 matmul
    for (y32, dx32, dw32), (y16, dx16, dw16) in [(got[False], got[True])]:
        assert y32.dtype == y16.dtype == torch.bfloat16
        assert dx32.dtype == torch.float32 and dw32.dtype == torch.float32  # grads in the parameters' dtype
        for a, b, e, name in zip((y32, dx32, dw32), (y16, dx16, dw16), exact, ("y", "dx", "dw")):
            assert _err(a, e) <= BF16_ULP, (name, _err(a, e))
            assert _err(a, e) <= _err(b, e) + 1e-12, (name, _err(a, e), _err(b, e))
            assert torch.equal(a.double(), a.bfloat16().double()), name  # rounded to bf16 like a bf16 GEMM


def test_pure_bf16_linear_and_fp32_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    _force(monkeypatch, native=False)
    lin = Linear(16, 8)
    x = torch.randn(3, 16)
    assert torch.equal(lin(x), F.linear(x, lin.weight))                       # fp32: F.linear itself
    lin16 = Linear(16, 8).to(torch.bfloat16)
    y = lin16(x.bfloat16())
    exact = (x.bfloat16().double() @ lin16.weight.double().T).bfloat16().double()
    assert y.dtype == torch.bfloat16 and _err(y, exact) <= BF16_ULP
    y.sum().backward()
    assert lin16.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_bf16_step_upcast_vs_bf16_matmuls(flavor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A whole autocast forward + backward of a small model both ways: the same loss to a few bf16
    # roundings of the logits (loss ~ln V ~ 4.6, bf16 spacing there 2**-5), gradients as close as that.
    cfg = model_registry(flavor, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
                         vocab_size=97, moe_inter_dim=16, num_experts=4, top_k=2).config
    toks = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    out = {}
    for native in (False, True):
        _force(monkeypatch, native)
        torch.manual_seed(0)
        model = Qwen3Model(cfg)
        model.init_weights()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(toks, labels=toks) / toks.numel()
        loss.backward()
        out[native] = (float(loss), model.tok_embeddings.weight.grad, model.layers[1].attention.wq.weight.grad)
    assert abs(out[False][0] - out[True][0]) <= 2**-5, (out[False][0], out[True][0])
    for a, b in zip(out[False][1:], out[True][1:]):
        assert float((a - b).norm() / b.norm()) <= 0.02
