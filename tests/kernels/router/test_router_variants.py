"""router_topk variants (DeepSeek-V3 / GLM-4-MoE style): sigmoid scoring, selection bias, sum + 1e-20
renormalisation, routed_scaling_factor, E up to 512; kernel vs the fp64-oracle rule (fwd + grads, selection
equal to the reference's), reference and kernel vs transformers' routers, and the constraints."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.kernels import oracles as O
from tests.tolerances import F64, check_oracle
from trnkit.kernels.constraints import KernelConstraintError

from trnkit.kernels import router as R

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
    variant = dict(norm=norm, scoring="sigmoid", scale=scale)
    O.check_all(("logits", "weights"), (l_k, w_k), lambda dt: O.router_weights(x, w, i_k, dt, **variant), dtype)
    gk, gl = torch.randn(w_k.shape, generator=g), torch.randn(l_k.shape, generator=g)
    for grad_logits in (None, gl):
        got = R.router_topk_bwd(x, w, l_k, i_k, gk, grad_logits, norm, scoring="sigmoid",
                                routed_scaling_factor=scale)
        assert got[0].dtype == got[1].dtype == dtype
        O.check_all(("grad_x", "grad_w"), got,
                    lambda dt, gl_=grad_logits: O.router_grads(x, w, i_k, gk, gl_, dt, **variant), dtype)


def test_selection_bias_chooses_but_does_not_weigh() -> None:
    """A large bias on expert 5 puts it in every token's top-K; its weight is still its own score."""
    x, w, bias, K, _ = _inputs("odd", torch.float32)
    bias = torch.zeros_like(bias)
    bias[5] = 10.0
    w_k, i_k, l_k = R.router_topk(x, w, K, False, scoring="sigmoid", selection_bias=bias)
    assert bool((i_k[:, 0] == 5).all())
    check_oracle("weight of the biased expert", w_k[:, 0], torch.sigmoid(x @ w[5]),
                 torch.sigmoid(x.double() @ w[5].double()))
    unbiased = R.router_topk(x, w, K, False, scoring="sigmoid")[1]
    assert not torch.equal(unbiased, i_k)


def test_softmax_with_routed_scaling_factor() -> None:
    x, w, _, K, g = _inputs("multi_tile", torch.float32)
    w_k, i_k, l_k, aff = R.router_topk(x, w, K, True, return_affinities=True, routed_scaling_factor=2.5)
    w_1 = R.router_topk(x, w, K, True)[0]
    # the scale folded into the kernel's normalisation vs a product after it: two roundings apart at most
    torch.testing.assert_close(w_k, 2.5 * w_1, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    assert torch.equal(aff.gather(1, i_k.long()), w_k)  # the dense form carries the same scaled weights
    O.check_all(("weights",), w_k, lambda dt: O.router_weights(x, w, i_k, dt, scale=2.5)[1], torch.float32)
    gk = torch.randn(w_k.shape, generator=g)
    O.check_all(("grad_x", "grad_w"), R.router_topk_bwd(x, w, l_k, i_k, gk, None, True, routed_scaling_factor=2.5),
                lambda dt: O.router_grads(x, w, i_k, gk, None, dt, scale=2.5), torch.float32)


def _hf_router(family: str, E: int, K: int, H: int, norm: bool, scale: float):
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
    else:
        from transformers import Glm4MoeConfig as Config
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
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
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    gk = torch.randn(T, K, generator=torch.Generator().manual_seed(5))

    def hf(dt):  # transformers' router at dtype dt, and its autograd for the upstream gradient gk per expert
        r = copy.deepcopy(router).to(dt)
        xl = x.detach().to(dt).requires_grad_(True)
        logits, weights, idx = r(xl)
        order = torch.argsort(idx, dim=-1)  # transformers' topk(sorted=False): compare per expert
        g_dense = torch.zeros(T, E, dtype=dt).scatter_(1, i_k.long(), gk.to(dt))
        (weights * g_dense.gather(1, idx)).sum().backward()
        return idx.gather(1, order), weights.detach().gather(1, order), logits.detach(), xl.grad, r.weight.grad

    kw = dict(scoring="sigmoid", selection_bias=router.e_score_correction_bias,
              routed_scaling_factor=router.routed_scaling_factor)
    w_k, i_k, l_k = R.router_topk(x, router.weight.detach(), K, norm, **kw)
    base, orc = hf(torch.float32), hf(F64)
    assert torch.equal(base[0], orc[0])  # tie-free: fp32 and fp64 choose alike
    for name, fn in (("ref", R.router_topk_ref), ("kernel", R.router_topk)):
        w_, i_, l_ = fn(x, router.weight.detach(), K, norm, **kw)
        mine = torch.argsort(i_.long(), dim=-1)
        assert torch.equal(i_.long().gather(1, mine), base[0]), name
        check_oracle(f"{name} weights", w_.gather(1, mine), base[1], orc[1])
        check_oracle(f"{name} logits", l_, base[2], orc[2])
    # gradients: the kernel's backward against autograd through transformers' router
    gx, gw = R.router_topk_bwd(x, router.weight.detach(), l_k, i_k, gk, None, norm, scoring="sigmoid",
                               routed_scaling_factor=router.routed_scaling_factor)
    check_oracle("kernel grad_x", gx, base[3], orc[3])
    check_oracle("kernel grad_w", gw, base[4], orc[4])


@pytest.mark.parametrize("kwargs, match", [
    (dict(scoring="tanh"), r"router_topk: constraint 'scoring in \('softmax', 'sigmoid'\)' violated \(got 'tanh'\)"),
    (dict(selection_bias=torch.zeros(16)), r"'selection_bias with scoring='sigmoid'' violated \(got 'softmax'\)"),
    (dict(scoring="sigmoid", selection_bias=torch.zeros(15)),
     r"'selection_bias.shape == \(E,\)' violated \(got \(15,\)\)"),
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
