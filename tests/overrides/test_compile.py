"""torch.compile with trnkit ops swapped in: no graph breaks, same results as eager, guard still works."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.overrides.conftest import hf_moe_model, native_model
from tests.tolerances import assert_close
from trnkit.overrides import OverrideConfig, OverrideConstraintError, apply_overrides

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss_and_grads(fn, params, *args):
    for p in params.values():
        p.grad = None
    out = fn(*args)
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in params.items() if p.grad is not None}


def _assert_same(got, want):
    assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert_close(got[1][name], want[1][name], msg=name)


def test_native_model_compiles_without_graph_breaks():
    model = native_model(init_std=0.2)
    apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))
    params = dict(model.named_parameters())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: any break raises
    _assert_same(_loss_and_grads(compiled, params, TOKENS), _loss_and_grads(model, params, TOKENS))


def test_hf_moe_blocks_compile_fullgraph():
    model = hf_moe_model()
    apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))
    layer = model.model.layers[0]
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    params = dict(layer.named_parameters())
    pos = model.model.rotary_emb(x, torch.arange(8)[None])
    attn = lambda h: layer.self_attn(h, pos, None)[0]  # noqa: E731
    compiled_attn = torch.compile(attn, fullgraph=True, backend="aot_eager")
    _assert_same(_loss_and_grads(compiled_attn, params, x), _loss_and_grads(attn, params, x))
    compiled_moe = torch.compile(layer.mlp, fullgraph=True, backend="aot_eager")
    _assert_same(_loss_and_grads(compiled_moe, params, x), _loss_and_grads(layer.mlp, params, x))


def test_guard_runs_under_compile(short_rope):
    """A new shape retraces the swapped attention; the guard then applies the policy."""
    def attention(policy):
        model = native_model(num_experts=0, mlp_only_layers=[])
        original = copy.deepcopy(model.layers[0].attention)
        apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl=short_rope, policy=policy, seq_len=8))
        return model.layers[0].attention, original, model.rope_cache

    g = torch.Generator().manual_seed(3)
    short, long = torch.randn(1, 8, 32, generator=g), torch.randn(1, 12, 32, generator=g)
    attn, original, cache = attention("fallback")
    compiled = torch.compile(attn, backend="aot_eager")
    assert_close(compiled(short, cache[:8]), original(short, cache[:8]))
    with pytest.warns(UserWarning, match="'S <= 8'"):
        out = compiled(long, cache[:12])  # new shape: retraced, the guard picks the original code
    assert_close(out, original(long, cache[:12]))

    attn, _, cache = attention("strict")
    compiled = torch.compile(attn, backend="aot_eager")
    compiled(short, cache[:8])
    with pytest.warns(UserWarning, match="'S <= 8'"), pytest.raises(OverrideConstraintError, match="'S <= 8'"):
        compiled(long, cache[:12])  # graph break, then the eager raise
    # fullgraph=True cannot raise from a graph: dynamo fails, after a warning with the reason
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"rope_hf\[short\].*'S <= 8'"), pytest.raises(Exception):  # noqa: PT011 - dynamo's own error type
        torch.compile(attn, backend="aot_eager", fullgraph=True)(long, cache[:12])


@pytest.mark.slow
def test_native_model_inductor_matches_eager():
    model = native_model(init_std=0.2)
    apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))
    params = dict(model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, fullgraph=True)
        _assert_same(_loss_and_grads(compiled, params, TOKENS), _loss_and_grads(model, params, TOKENS))


def test_an_impl_not_declared_compile_safe_falls_back_under_compile():
    from trnkit.overrides import get_impl, register, unregister

    calls = []

    def eager_only(*args, **kwargs):
        calls.append(1)
        return get_impl("rope_hf", "reference").fn(*args, **kwargs)

    register("rope_hf", "eager_only", eager_only, has_backward=True, compile_ok=False)
    try:
        model = native_model(num_experts=0, mlp_only_layers=[])
        attn, original = model.layers[0].attention, copy.deepcopy(model.layers[0].attention)
        apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="eager_only", policy="fallback", seq_len=8))
        x, cache = torch.randn(1, 8, 32), model.rope_cache[:8]
        attn(x, cache)
        assert calls == [1]  # eager: served
        with pytest.warns(UserWarning, match="compile_ok"):
            out = torch.compile(attn, backend="aot_eager", fullgraph=True)(x, cache)
        assert calls == [1]  # compiled: the original code, traced into the graph
        assert_close(out, original(x, cache))
    finally:
        unregister("rope_hf", "eager_only")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_inductor_backward_of_a_permuted_input(impl):
    """An rmsnorm input whose strides are permuted (a transposed activation): inductor's backward checks the real
    rmsnorm_bwd output against its fake's strides; the fake said (1, 6) for a contiguous (16, 1) gradient and the
    backward stopped ('expected size 6==6, stride 16==1'). The gradient now matches eager's."""
    w = torch.randn(16, generator=torch.Generator().manual_seed(2))

    def f(xt):
        y, _ = torch.ops.trnkit.rmsnorm(xt * 2.0, w, 1e-6, impl)  # the product keeps xt's permuted strides
        return (y * torch.arange(16)).sum()

    base = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))
    grads = []
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would keep the old fake
        for fn in (f, torch.compile(f, backend="inductor")):
            xt = base.clone().T.requires_grad_()
            fn(xt).backward()
            grads.append(xt.grad)
    assert_close(grads[1], grads[0])


def test_swaps_apply_to_an_already_compiled_transformers_model():
    """``apply_overrides`` on what ``torch.compile`` returns (an ``OptimizedModule``, whose ``training`` is a
    property, not in its ``__dict__``): the dry run's restore read it from there (once: KeyError 'training');
    the compiled model then runs the kernels with transformers' logits, and reverts."""
    from trnkit.hf import revert

    original = hf_moe_model()
    compiled = torch.compile(copy.deepcopy(original), backend="eager")
    report = apply_overrides(compiled, OverrideConfig(ops=["rope_hf", "router_topk", "moe_experts", "rmsnorm"],
                                                      impl="nki", seq_len=8))
    assert report.rows and {r.status for r in report.rows} == {"swapped"}
    assert_close(compiled(input_ids=TOKENS).logits, original(input_ids=TOKENS).logits)
    assert revert(compiled) == len(report.rows)


def test_native_model_compiles_fullgraph_with_dynamic_shapes():
    """Every kernel op and the loss under torch.compile(dynamic=True, fullgraph=True): the constraint functions
    decide on symbolic sizes and scalars (they stopped dynamo: math.isfinite on a symbolic float, min(default=))."""
    model = native_model(init_std=0.2)
    ops = ["rope_hf", "rmsnorm", "attention", "mlp", "router_topk", "moe_experts", "linear_cross_entropy"]
    report = apply_overrides(model, OverrideConfig(impl="nki", seq_len=8, ops=ops))
    assert {row.op for row in report.rows if row.status == "swapped"} == set(ops)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    params = dict(model.named_parameters())
    for T in (8, 6):  # two lengths through one dynamic graph
        tokens = TOKENS[:, :T]
        got = _loss_and_grads(lambda t: compiled(t, labels=t), params, tokens)
        want = _loss_and_grads(lambda t: model(t, labels=t), params, tokens)
        _assert_same(got, want)
