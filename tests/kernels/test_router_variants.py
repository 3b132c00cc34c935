"""router_topk variants (DeepSeek-V3 / GLM-4-MoE style): sigmoid scoring, selection bias, sum + 1e-20
renormalisation, routed_scaling_factor, E up to 512; kernel vs reference (fwd + grads), reference vs
transformers' routers, and the constraints."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.tolerances import assert_close
from trnkit.kernels.constraints import KernelConstraintError

R = importlib.import_module("trnkit.kernels.router_topk")  # the package re-exports a function of that name

CASES = {
    # name: (T, H, E, K)
    "small_E": (9, 64, 6, 2),  # E < 8: padded max8
    "odd": (37, 96, 16, 4),  # H not a multiple of 128 (Tensor-engine transposes)
    "multi_tile": (130, 256, 64, 8),  # two token tiles, DMA-transposed x
    "E_256": (20, 128, 256, 8),  # DeepSeek-V3's expert count
    "E_512": (12, 128, 512, 8),  # the maximum
}


def _inputs(case: str, dtype: torch.dtype, seed: int = 0):
    T, H, E, K = CASES[case]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype)
    bias = torch.randn(E, generator=g) * 0.2
    return x, w, bias, K, g


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_bias, norm, scale", [(False, True, 1.0), (True, True, 2.5), (True, False, 1.0),
                                                    (False, False, 16.0)])
def test_sigmoid_router_kernel_matches_reference(case: str, dtype: torch.dtype, with_bias: bool, norm: bool,
                                                 scale: float) -> None:
    x, w, bias, K, g = _inputs(case, dtype)
    kw = dict(scoring="sigmoid", selection_bias=bias if with_bias else None, routed_scaling_factor=scale)
    w_k, i_k, l_k = R.router_topk(x, w, K, norm, **kw)
    w_r, i_r, l_r = R.router_topk_ref(x, w, K, norm, **kw)
    assert torch.equal(i_k.long(), i_r.long())
    assert_close(l_k, l_r, torch.float32)
    assert_close(w_k, w_r, torch.float32)
    gk, gl = torch.randn(w_k.shape, generator=g), torch.randn(l_k.shape, generator=g)
    for grad_logits in (None, gl):
        got = R.router_topk_bwd(x, w, l_k, i_k, gk, grad_logits, norm, scoring="sigmoid",
                                routed_scaling_factor=scale)
        ref = R.router_topk_bwd_ref(x, w, l_k, i_k, gk, grad_logits, norm, scoring="sigmoid",
                                    routed_scaling_factor=scale)
        for name, a, b in zip(("grad_x", "grad_w"), got, ref):
            assert a.dtype == b.dtype == dtype
            assert_close(a, b, dtype, msg=name)


def test_selection_bias_chooses_but_does_not_weigh() -> None:
    """A large bias on expert 5 puts it in every token's top-K; its weight is still its own score."""
    x, w, bias, K, _ = _inputs("odd", torch.float32)
    bias = torch.zeros_like(bias)
    bias[5] = 10.0
    w_k, i_k, l_k = R.router_topk(x, w, K, False, scoring="sigmoid", selection_bias=bias)
    assert bool((i_k[:, 0] == 5).all())
    assert_close(w_k[:, 0], torch.sigmoid(l_k[:, 5]), torch.float32)
    unbiased = R.router_topk(x, w, K, False, scoring="sigmoid")[1]
    assert not torch.equal(unbiased, i_k)


def test_softmax_with_routed_scaling_factor() -> None:
    x, w, _, K, g = _inputs("multi_tile", torch.float32)
    w_k, i_k, l_k, aff = R.router_topk(x, w, K, True, return_affinities=True, routed_scaling_factor=2.5)
    w_1 = R.router_topk(x, w, K, True)[0]
    assert_close(w_k, 2.5 * w_1, torch.float32)
    assert torch.equal(aff.gather(1, i_k.long()), w_k)  # the dense form carries the same scaled weights
    gk = torch.randn(w_k.shape, generator=g)
    for a, b in zip(R.router_topk_bwd(x, w, l_k, i_k, gk, None, True, routed_scaling_factor=2.5),
                    R.router_topk_bwd_ref(x, w, l_k, i_k, gk, None, True, routed_scaling_factor=2.5)):
        assert_close(a, b, torch.float32)


def _hf_router(family: str, E: int, K: int, H: int, norm: bool, scale: float):
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config as Config  # noqa: PLC0415
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router  # noqa: PLC0415
    else:
        from transformers import Glm4MoeConfig as Config  # noqa: PLC0415
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router  # noqa: PLC0415
    cfg = Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=1, topk_group=1,
                 norm_topk_prob=norm, routed_scaling_factor=scale)
    router = Router(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) * H ** -0.5)
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.2)
    return router


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("norm", [True, False])
def test_reference_and_kernel_match_transformers_routers(family: str, norm: bool) -> None:
    T, H, E, K = 40, 64, 16, 4
    router = _hf_router(family, E, K, H, norm, 2.5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4), requires_grad=True)
    hf_logits, hf_w, hf_i = router(x)
    order = torch.argsort(hf_i, dim=-1)  # transformers' topk(sorted=False): compare per expert
    kw = dict(scoring="sigmoid", selection_bias=router.e_score_correction_bias,
              routed_scaling_factor=router.routed_scaling_factor)
    for fn in (R.router_topk_ref, R.router_topk):
        w_, i_, l_ = fn(x.detach(), router.weight.detach(), K, norm, **kw)
        mine = torch.argsort(i_.long(), dim=-1)
        assert torch.equal(i_.long().gather(1, mine), hf_i.gather(1, order))
        assert_close(w_.gather(1, mine), hf_w.detach().gather(1, order), torch.float32)
        assert_close(l_, hf_logits.detach(), torch.float32)
    # gradients: the kernel's backward against autograd through transformers' router
    gk = torch.randn(T, K, generator=torch.Generator().manual_seed(5))
    w_, i_, l_ = R.router_topk(x.detach(), router.weight.detach(), K, norm, **kw)
    g_dense = torch.zeros(T, E).scatter_(1, i_.long(), gk)  # the same upstream gradient per expert
    (hf_w * g_dense.gather(1, hf_i)).sum().backward()
    gx, gw = R.router_topk_bwd(x.detach(), router.weight.detach(), l_, i_, gk, None, norm, scoring="sigmoid",
                               routed_scaling_factor=router.routed_scaling_factor)
    assert_close(gx, x.grad, torch.float32)
    assert_close(gw, router.weight.grad, torch.float32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(scoring="tanh"), r"router_topk: constraint 'scoring in \('softmax', 'sigmoid'\)' violated \(got 'tanh'\)"),
    (dict(selection_bias=torch.zeros(16)), r"'selection_bias with scoring='sigmoid'' violated \(got 'softmax'\)"),
    (dict(scoring="sigmoid", selection_bias=torch.zeros(15)), r"'selection_bias.shape == \(E,\)' violated \(got \(15,\)\)"),
    (dict(scoring="sigmoid", selection_bias=torch.zeros(16, dtype=torch.bfloat16)),
     r"'selection_bias.dtype == float32' violated \(got 'bfloat16'\)"),
    (dict(scoring="sigmoid", return_affinities=True), r"'return_affinities with scoring='softmax'' violated"),
    (dict(routed_scaling_factor=float("nan")), r"'routed_scaling_factor is a finite number' violated"),
])
def test_variant_constraints_name_the_rule(kwargs: dict, match: str) -> None:
    x, w = torch.zeros(4, 64), torch.zeros(16, 64)
    with pytest.raises(KernelConstraintError, match=match):
        R.router_topk(x, w, 2, True, **kwargs)
    with pytest.raises(KernelConstraintError, match=match):
        R.router_topk_ref(x, w, 2, True, **kwargs)


def test_more_than_512_experts_is_refused() -> None:
    x, w = torch.zeros(4, 64), torch.zeros(513, 64)
    with pytest.raises(KernelConstraintError, match=r"constraint 'E <= 512' violated \(got 513\)"):
        R.router_topk(x, w, 8, True, scoring="sigmoid", selection_bias=torch.zeros(513))
