"""Outputs come back through the kernels' return values: the wrappers use what a kernel returns (on a
device that is the tensor to use), and kernels that take their outputs as arguments return exactly
those (declared ``nt.mutable_tensor``: tests/kernels/test_nki_source_rules.py)."""

from __future__ import annotations


import pytest
import torch

from trnkit.kernels import moe
from trnkit.kernels.moe import moe_bwd, moe_fused, moe_grouped_mm

from trnkit.kernels import rope as rope_hf

KERNELS = [(moe_grouped_mm, "grouped_mm_kernel"), (moe_grouped_mm, "grouped_wgrad_kernel"),
           (moe_grouped_mm, "grouped_wgrad2_kernel"),
           (moe_fused, "moe_experts_kernel"),
           (moe_bwd, "moe_bwd_kernel")]


def _returning_copies(monkeypatch) -> list:
    """Wrap each MoE kernel so it returns fresh copies of its results; returns the list of copies."""
    made = []

    def wrap(real):
        def kernel(*args):
            res = real(*args)
            copies = tuple(r.clone() for r in res) if isinstance(res, tuple) else res.clone()
            made.extend(copies if isinstance(copies, tuple) else (copies,))
            return copies
        return kernel

    for mod, name in KERNELS:
        monkeypatch.setattr(mod, name, wrap(getattr(mod, name)))
    return made


def _moe_inputs():
    g = torch.Generator().manual_seed(3)
    T, H, inter, E, K = 6, 128, 64, 4, 2
    x = torch.randn(T, H, generator=g)
    wgu, wd = torch.randn(E, H, 2 * inter, generator=g) * 0.1, torch.randn(E, inter, H, generator=g) * 0.1
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, K, generator=g)
    return x, idx, tw, wgu, wd


def test_moe_wrappers_use_the_kernels_returned_tensors(monkeypatch) -> None:
    x, idx, tw, wgu, wd = _moe_inputs()
    go = torch.randn_like(x)
    expected_fwd = moe.moe_experts(x, idx, tw, wgu, wd)
    expected_bwd = moe.moe_experts_bwd(x, idx, tw, wgu, wd, go)
    offs = torch.tensor([2, 4, 4, 6], dtype=torch.int32)
    expected_gmm = moe.grouped_mm(x, wd.transpose(1, 2).contiguous(), offs)
    g_out = torch.randn(6, 64)
    expected_gmm_bwd = moe.grouped_mm_bwd(x, wd.transpose(1, 2).contiguous(), offs, g_out)

    made = _returning_copies(monkeypatch)
    out = moe.moe_experts(x, idx, tw, wgu, wd)
    assert any(out is m for m in made) and torch.equal(out, expected_fwd)
    grads = moe.moe_experts_bwd(x, idx, tw, wgu, wd, go)
    for g, e in zip(grads, expected_bwd):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert any(grads[0] is m for m in made) and any(grads[2] is m for m in made)
    # the data-path kernel's returned hw / dgu feed the weight-gradient kernel: a wrapper that read its own
    # buffers instead would see garbage here, since the copies are the only written tensors
    made.clear()
    out = moe.grouped_mm(x, wd.transpose(1, 2).contiguous(), offs)
    assert out is made[-1] and torch.equal(out, expected_gmm)
    made.clear()
    gx, gw = moe.grouped_mm_bwd(x, wd.transpose(1, 2).contiguous(), offs, g_out)
    assert gx is made[0] and gw is made[1]
    assert torch.equal(gx, expected_gmm_bwd[0]) and torch.equal(gw, expected_gmm_bwd[1])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_rope_hf_returns_the_outputs_passed_in(layout: str) -> None:
    B, H, S, D = 1, 2, 5, 8
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    q, k = torch.randn(shape), torch.randn(shape)
    q_out, k_out = torch.empty(shape), torch.empty(shape)
    cos, sin = torch.randn(S, D), torch.randn(S, D)
    fn = rope_hf.rope_hf if layout == "bhsd" else rope_hf.rope_hf_bshd
    ref = rope_hf.rope_hf_ref if layout == "bhsd" else rope_hf.rope_hf_bshd_ref
    res = fn(q, k, q_out, k_out, cos, sin)
    assert res[0] is q_out and res[1] is k_out  # aliased: written in place, the same objects back
    rq, rk = torch.empty(shape), torch.empty(shape)
    ref(q, k, rq, rk, cos, sin)
    torch.testing.assert_close(q_out, rq, rtol=0, atol=0)
    torch.testing.assert_close(k_out, rk, rtol=0, atol=0)
