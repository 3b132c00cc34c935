"""The trnkit:: custom ops: opcheck (schema, fake, autograd registration, aot dispatch), numerics and
gradients of every impl against the independent references in ``_refs.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.overrides import _refs
from tests.tolerances import assert_close
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.nkisim import trace
from trnkit.overrides import get_impl, ops, register, unregister
from trnkit.overrides.ops import ImplOutputError

IMPLS = ["reference", "nki", "testref"]  # testref: the independent refs registered as a user impl
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rope_inputs(layout: str, dtype: torch.dtype, packed: bool, B=2, S=5, Hq=3, Hk=2, D=8):
    g = _gen()
    shape = (lambda h: (B, h, S, D)) if layout == "bhsd" else (lambda h: (B, S, h, D))
    q, k = (torch.randn(shape(h), generator=g).to(dtype) for h in (Hq, Hk))
    ang = torch.rand(S, D // 2, generator=g) * 3
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    tables = {"rope_cache": torch.cat([cos, sin], -1)} if packed else {"cos": cos.to(dtype), "sin": sin.to(dtype)}
    return q, k, cos, sin, tables


def _to_bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bshd" else x.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- rope


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("layout,packed", [("bhsd", False), ("bshd", True)])
def test_rope_hf_mutating_op(impl, layout, packed):
    q, k, cos, sin, tables = _rope_inputs(layout, torch.float32, packed)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    args = (q, k, q_out, k_out)
    kwargs = dict(tables, layout=layout, impl=impl)
    torch.library.opcheck(ops.rope_hf, args, kwargs, test_utils=OPCHECK_TESTS)
    ops.rope_hf(*args, **kwargs)
    for x, out in ((q, q_out), (k, k_out)):
        expected = _refs.rope_bshd(_to_bshd(x, layout), cos, sin)
        assert_close(_to_bshd(out, layout), expected)


def test_rope_hf_writes_strided_outputs():
    q, k, cos, sin, tables = _rope_inputs("bshd", torch.float32, packed=True)
    q_big = torch.zeros(q.shape[0], q.shape[1], q.shape[2], 2 * q.shape[3])
    q_out = q_big[..., ::2]  # non-contiguous destination
    k_out = torch.empty_like(k)
    ops.rope_hf(q, k, q_out, k_out, layout="bshd", impl="reference", **tables)
    assert_close(q_big[..., ::2], _refs.rope_bshd(q, cos, sin))
    assert (q_big[..., 1::2] == 0).all()


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_rope_hf_outputs_that_alias_the_other_input_or_misfit(impl):
    """rope_hf(q, k, q_out=k, k_out=q) (each output a view of the other input; q and k of one shape): both
    results are transformers' rotation of the original q and k (the reference wrote q's result over k and
    then rotated that: max error 29). q_out of another shape is refused before any work, by the op and its
    fake (the reference stopped in its copy with a broadcast error)."""
    q, k, cos, sin, _ = _rope_inputs("bshd", torch.float32, packed=False, Hq=2, Hk=2)
    want_q, want_k = _refs.rope_bshd(q, cos, sin), _refs.rope_bshd(k, cos, sin)
    qq, kk = q.clone(), k.clone()
    ops.rope_hf(qq, kk, kk, qq, cos, sin, None, False, "bshd", impl)
    assert_close(kk, want_q)
    assert_close(qq, want_k)
    for dev in ("cpu", "meta"):
        qd, kd = q.to(dev), k.to(dev)
        with pytest.raises(KernelConstraintError) as e:
            ops.rope_hf(qd, kd, qd.new_empty(2, 5, 2, 6), torch.empty_like(kd), cos.to(dev), sin.to(dev), None, False,
                        "bshd", impl)
        assert str(e.value) == ("trnkit::rope_hf: constraint 'q_out has q's shape' violated (got (2, 5, 2, 6)): "
                                "q: (2, 5, 2, 8)")


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_rope_tables_too_short_or_narrow_refused(impl):
    """cos / sin with fewer rows than S and a rope_cache of D columns (not 2D) are refused before any work, by the
    op and its fake, naming the table, the rule and the sizes (the reference stopped in a broadcast: 'The size
    of tensor a (5) must match the size of tensor b (3)'); a longer table (the model's whole cache) is served."""
    q, k, cos, sin, _ = _rope_inputs("bshd", torch.float32, packed=False)
    long = torch.cat([cos, cos])
    assert_close(ops.rope_hf_apply(q, k, long, torch.cat([sin, sin]), None, "bshd", False, impl)[0],
                 _refs.rope_bshd(q, cos, sin))
    cases = [((cos[:3], sin[:3], None), "'cos is [S', D] or [B, S', D] with S' >= S' violated (got (3, 8)): S = 5, "
              "D = 8; trnkit::rope_hf: constraint 'sin is [S', D] or [B, S', D] with S' >= S' violated (got (3, 8)): "
              "S = 5, D = 8"),
             ((None, None, cos), "'rope_cache is [S', 2D] or [B, S', 2D] with S' >= S' violated (got (5, 8)): S = 5, "
              "D = 8")]
    for tables, rule in cases:
        for dev in ("cpu", "meta"):
            on = [None if t is None else t.to(dev) for t in (q, k, *tables)]
            with pytest.raises(KernelConstraintError) as e:
                ops.rope_hf_apply(*on, "bshd", False, impl)
            assert str(e.value) == f"trnkit::rope_hf: constraint {rule}"


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_rope_tables_other_than_cos_sin_or_cache_refused(impl):
    """cos / sin together or the packed rope_cache, not both and not neither, for every impl, in both rope ops and
    their fakes: the reference used rope_cache and ignored a different cos / sin without a word (here the cache's
    tables are doubled), and stopped with a TypeError on neither or on cos alone. Each table alone gives
    transformers' rotation."""
    q, k, cos, sin, _ = _rope_inputs("bshd", torch.float32, packed=False)
    cache = torch.cat([2 * cos, 2 * sin], -1)
    assert_close(ops.rope_hf_apply(q, k, cos, sin, None, "bshd", False, impl)[0], _refs.rope_bshd(q, cos, sin))
    assert_close(ops.rope_hf_apply(q, k, None, None, cache, "bshd", False, impl)[0],
                 _refs.rope_bshd(q, 2 * cos, 2 * sin))
    for tables, got in [((cos, sin, cache), "both"), ((None, None, None), "neither"), ((cos, None, None),
                        "cos without sin"), ((None, sin, cache), "both")]:
        for dev in ("cpu", "meta"):
            on = [None if t is None else t.to(dev) for t in (q, k, *tables)]
            for call in (lambda: ops.rope_hf_apply(*on, "bshd", False, impl),
                         lambda: ops.rope_hf(on[0], on[1], torch.empty_like(on[0]), torch.empty_like(on[1]), *on[2:],
                                             False, "bshd", impl)):
                with pytest.raises(KernelConstraintError) as e:
                    call()
                assert str(e.value) == ("trnkit::rope_hf: constraint 'exactly one of (cos, sin) or rope_cache' "
                                        f"violated (got {got!r})")


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_hf_apply_forward_backward(impl, dtype):
    q, k, cos, sin, tables = _rope_inputs("bshd", dtype, packed=dtype == torch.float32)
    args = (q, k, tables.get("cos"), tables.get("sin"), tables.get("rope_cache"), "bshd", False, impl)
    if dtype == torch.float32:
        torch.library.opcheck(ops.rope_hf_apply, args, test_utils=OPCHECK_TESTS)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_out, k_out = ops.rope_hf_apply(qr, kr, *args[2:])
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    (q_out * gq).float().sum().add_((k_out * gk).float().sum()).backward()

    if "cos" in tables:  # the reference sees the same (possibly bf16-rounded) tables as the op
        cos, sin = tables["cos"], tables["sin"]
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    eq, ek = _refs.rope_bshd(q2, cos, sin), _refs.rope_bshd(k2, cos, sin)
    (eq * gq).float().sum().add_((ek * gk).float().sum()).backward()
    assert_close(q_out, eq.detach())
    assert_close(k_out, ek.detach())
    assert_close(qr.grad, q2.grad)
    assert_close(kr.grad, k2.grad)


def test_rope_bad_layout_is_named():
    q, k, *_ , tables = _rope_inputs("bshd", torch.float32, packed=True)
    with pytest.raises(ValueError, match="trnkit::rope_hf: layout must be one of .* got 'sbhd'"):
        ops.rope_hf_apply(q, k, None, None, tables["rope_cache"], "sbhd", False, "reference")


# ----------------------------------------------------------------------- router / grouped_mm / moe


def _router_inputs(T=6, H=8, E=5):
    g = _gen(1)
    return torch.randn(T, H, generator=g), torch.randn(E, H, generator=g)


def _moe_inputs(T=5, H=8, I=4, E=3, K=2):  # noqa: E741
    g = _gen(2)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    tw = torch.rand(T, K, generator=g)
    return x, idx, tw, torch.randn(E, H, 2 * I, generator=g) * 0.3, torch.randn(E, I, H, generator=g) * 0.3


@pytest.mark.parametrize("impl", IMPLS)
def test_router_topk_op(impl, testref):
    x, w = _router_inputs()
    torch.library.opcheck(ops.router_topk, (x, w, 2, True, impl), test_utils=OPCHECK_TESTS)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    tw, idx, logits = ops.router_topk(xr, wr, 2, True, impl)
    assert (tw.dtype, idx.dtype, logits.dtype) == (torch.float32, torch.int32, torch.float32)
    gw, gl = torch.randn_like(tw), torch.randn_like(logits)
    ((tw * gw).sum() + (logits * gl).sum()).backward()

    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    etw, eidx, elog = _refs.router(x2, w2, 2)
    ((etw * gw).sum() + (elog * gl).sum()).backward()
    assert torch.equal(idx.long(), eidx)
    assert_close(tw, etw.detach())
    assert_close(logits, elog.detach())
    assert_close(xr.grad, x2.grad)
    assert_close(wr.grad, w2.grad)


@pytest.mark.parametrize("impl", IMPLS)
def test_router_topk_top_k_outside_one_to_e_is_refused(impl, testref):
    """top_k = E is every expert (weights against the independent reference); 0, -1 and E + 1 are refused
    before any impl runs, naming the op, the rule and the value, on real and meta tensors alike (the
    reference's sort sliced them to E, E - 1 or 0 columns: an impl output error or an empty top-K)."""
    x, w = _router_inputs(E=5)
    tw, idx, _ = ops.router_topk(x, w, 5, False, impl)
    etw, eidx, _ = _refs.router(x, w, 5, norm=False)
    assert torch.equal(idx.long(), eidx)
    assert_close(tw, etw)
    for top_k in (0, -1, 6):
        for dev in ("cpu", "meta"):
            with pytest.raises(KernelConstraintError) as e:
                ops.router_topk(x.to(dev), w.to(dev), top_k, True, impl)
            assert str(e.value) == (f"trnkit::router_topk: constraint '1 <= top_k <= E' violated (got {top_k}): "
                                    "E = 5 experts (w_router rows)")


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_mm_op(impl, testref):
    g = _gen(3)
    x, w = torch.randn(7, 8, generator=g), torch.randn(3, 8, 4, generator=g)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # includes an empty group
    torch.library.opcheck(ops.grouped_mm, (x, w, offs, impl), test_utils=OPCHECK_TESTS)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = ops.grouped_mm(xr, wr, offs, impl)
    go = torch.randn_like(out)
    (out * go).sum().backward()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = _refs.grouped_mm(x2, w2, offs)
    (expected * go).sum().backward()
    assert_close(out, expected.detach())
    assert_close(xr.grad, x2.grad)
    assert_close(wr.grad, w2.grad)


@pytest.mark.parametrize("op,rule,got", [("grouped_mm", "K, N >= 1", ((4, 0), (0, 4))),
                                         ("moe_experts", "H, I >= 1", ((4, 0), (0, 2)))])
def test_moe_zero_width_refused_by_nki_computed_by_reference(op, rule, got):
    """grouped_mm with K or N = 0 and moe_experts with H or I = 0: the nki impl refuses them (the call and its
    declared constraints) naming the rule and the widths, where the interpreter stopped deep in the kernel
    ('nl.ndarray: ... shape (128, 0) must be positive ints'); the reference computes the empty product,
    which the independent reference gives too."""
    x_k0, x = torch.randn(3, 0), torch.randn(3, 4)
    if op == "grouped_mm":
        offs = torch.tensor([1, 3], dtype=torch.int32)
        cases = [(x, torch.randn(2, 4, 0), offs), (x_k0, torch.randn(2, 0, 4), offs)]
        expected = [_refs.grouped_mm(*args) for args in cases]
    else:
        idx, tw = torch.tensor([[0], [1], [0]], dtype=torch.int32), torch.rand(3, 1)
        cases = [(x, idx, tw, torch.randn(2, 4, 0), torch.randn(2, 0, 4)),
                 (x_k0, idx, tw, torch.randn(2, 0, 4), torch.randn(2, 2, 0))]
        expected = [_refs.moe_experts(*args) for args in cases]
    fn = getattr(ops, op)
    for args, want, widths in zip(cases, expected, got, strict=True):
        message = f"{op}: constraint '{rule}' violated (got {widths}): a kernel tile row has at least one element"
        assert [str(v) for v in get_impl(op, "nki").constraints(*args)] == [message]
        with pytest.raises(KernelConstraintError) as e:
            fn(*args, impl="nki")
        assert str(e.value) == message
        assert torch.equal(fn(*args, impl="reference"), want)


@pytest.mark.parametrize("impl", IMPLS)
def test_moe_experts_op(impl, testref):
    x, idx, tw, wgu, wd = _moe_inputs()
    torch.library.opcheck(ops.moe_experts, (x, idx, tw, wgu, wd, 128, impl), test_utils=OPCHECK_TESTS)
    leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
    out = ops.moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], 128, impl)
    go = torch.randn_like(out)
    (out * go).sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
    expected = _refs.moe_experts(ref_leaves[0], idx, *ref_leaves[1:])
    (expected * go).sum().backward()
    assert_close(out, expected.detach())
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert_close(got.grad, want.grad)


def test_missing_backward_is_a_clear_error(testref):
    register("grouped_mm", "fwd_only", _refs.grouped_mm)
    try:
        assert not get_impl("grouped_mm", "fwd_only").has_backward
        x = torch.randn(3, 2, requires_grad=True)
        out = ops.grouped_mm(x, torch.randn(1, 2, 2), torch.tensor([3], dtype=torch.int32), "fwd_only")
        with pytest.raises(RuntimeError, match=r"trnkit::grouped_mm: impl 'fwd_only' has no backward"):
            out.sum().backward()
    finally:
        unregister("grouped_mm", "fwd_only")


@pytest.mark.parametrize("impl,runs_kernel", [("nki", True), ("reference", False)])
def test_nki_impl_runs_the_kernel_on_cpu(impl, runs_kernel):
    q, k, _, _, tables = _rope_inputs("bshd", torch.float32, packed=True)
    with trace.record() as tr:
        ops.rope_hf_apply(q, k, None, None, tables["rope_cache"], "bshd", False, impl)
    assert (len(tr.instrs) > 0) == runs_kernel


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_backward_ops_opcheck(impl):
    """The backward kernels are ops of their own (opaque in compiled backward graphs)."""
    schema_fake = OPCHECK_TESTS[:3]  # they are not differentiated themselves
    x, w = _router_inputs()
    tw, idx, logits = ops.router_topk(x, w, 2, True, impl)
    torch.library.opcheck(ops.router_topk_bwd, (x, w, logits, idx, torch.randn_like(tw), torch.randn_like(logits),
                                                True, impl), test_utils=schema_fake)
    g = _gen(4)
    xg, wg = torch.randn(7, 8, generator=g), torch.randn(3, 8, 4, generator=g)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    torch.library.opcheck(ops.grouped_mm_bwd, (xg, wg, offs, torch.randn(7, 4, generator=g), impl),
                          test_utils=schema_fake)
    xm, idxm, twm, wgu, wd = _moe_inputs()
    torch.library.opcheck(ops.moe_experts_bwd, (xm, idxm, twm, wgu, wd, torch.randn_like(xm), 128, impl),
                          test_utils=schema_fake)


def _aux_output_cases() -> dict[str, tuple]:
    """op -> (call(x), the independent reference of its differentiable output, that output's index, the
    indices of the outputs that carry no gradient); x is the op's first input."""
    g = _gen(7)
    w_norm, w_head = torch.randn(8, generator=g), torch.randn(5, 8, generator=g)
    labels = torch.tensor([0, 4, -100, 2])

    def rms(x):
        return w_norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def causal(x):
        s = (x.transpose(1, 2) @ x.transpose(1, 2).transpose(-1, -2)) * 0.3
        s = s.masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
        return (torch.softmax(s, -1) @ x.transpose(1, 2)).transpose(1, 2)

    return {
        "attention": ((1, 4, 2, 8), lambda x, impl: ops.attention(x, x, x, 0.3, impl), causal, 0, (1,)),
        "rmsnorm": ((4, 8), lambda x, impl: ops.rmsnorm(x, w_norm, 1e-6, impl), rms, 0, (1,)),
        "rmsnorm_qk": ((4, 8), lambda x, impl: ops.rmsnorm_qk(x, x, w_norm, w_norm, 1e-6, impl), rms, 0, (2, 3)),
        "linear_cross_entropy": ((4, 8), lambda x, impl: ops.linear_cross_entropy(x, w_head, labels, -100, impl),
                                 lambda x: F.cross_entropy(x @ w_head.T, labels, reduction="sum"), 0, (1,)),
        "linear_cross_entropy_fused": ((4, 8), lambda x, impl: ops.linear_cross_entropy_fused(x, w_head, labels,
                                                                                               -100, impl),
                                       lambda x: F.cross_entropy(x @ w_head.T, labels, reduction="sum"), 0, (1, 2, 3)),
    }


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("op", sorted(_aux_output_cases()))
def test_outputs_without_gradient_are_non_differentiable(op, impl):
    """lse / rstd (and the fused op's stored gradients) are marked non-differentiable, as torch marks sort's
    indices: they do not require grad, and a loss of them alone is refused by autograd. Before, they required
    grad and a backward through them gave zeros without a word (the gradient of sum(lse) is not zero: a
    z-loss on the cross-entropy's lse trained nothing). The differentiable output's gradient still matches the
    independent reference."""
    shape, call, reference, main, aux = _aux_output_cases()[op]
    x = torch.randn(shape, generator=_gen(8), requires_grad=True)
    outs = call(x, impl)
    assert [t.requires_grad for t in outs] == [i not in aux for i in range(len(outs))]
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(outs[aux[0]].sum(), x)
    x2 = x.detach().clone().requires_grad_()
    got, = torch.autograd.grad(outs[main].sum(), x)
    want, = torch.autograd.grad(reference(x2).sum(), x2)
    assert_close(got, want)


_MALFORMED = {  # op -> (inputs as shapes, the other arguments, the message after the op's name)
    "router_topk": (((3, 8), (4, 9)), (2, True),
                    "constraint 'x is [T, H] and w_router [E, H]' violated (got ((3, 8), (4, 9)))"),
    "rmsnorm": (((3, 8), (1,)), (1e-6,), "constraint 'weight is [H] with H = x.shape[-1]' violated (got (1,)): "
                                         "x: (3, 8)"),
    "rmsnorm_qk": (((3, 8), (3, 8), (8,), (9,)), (1e-6,),
                   "constraint 'k: weight is [H] with H = x.shape[-1]' violated (got (9,)): x: (3, 8)"),
    "mlp": (((3, 8), (8, 6), (2, 8)), (),
            "constraint 'x is [..., H], w_gate_up [H, 2I] and w_down [I, H]' violated (got ((3, 8), (8, 6), (2, 8)))"),
}


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("op", sorted(_MALFORMED))
def test_malformed_weights_refused_by_the_op_and_its_fake(op, impl):
    """A weight whose shape does not fit x (router [E, H + 1]; a norm weight [1], broadcast by the reference
    without a word; k's norm weight of another H; w_down [2, H] for w_gate_up [H, 2 * 3]) is refused before
    any impl runs, naming the op, the rule and the shapes, on real and meta tensors alike (the reference
    stopped in a matmul or a broadcast)."""
    shapes, rest, message = _MALFORMED[op]
    for dev in ("cpu", "meta"):
        tensors = [torch.randn(s, device=dev) for s in shapes]
        with pytest.raises(KernelConstraintError) as e:
            getattr(ops, op)(*tensors, *rest, impl=impl)
        assert str(e.value) == f"trnkit::{op}: {message}"


_INTEGER_INPUTS = {  # op -> (call on x, an int64 [1, 3, 1, 8] tensor; the message after the op's name)
    "mlp": (lambda x, impl: ops.mlp(x, torch.randn(8, 4), torch.randn(2, 8), impl),
            "trnkit::mlp: constraint 'x is floating point' violated (got 'int64')"),
    "rmsnorm": (lambda x, impl: ops.rmsnorm(x, torch.ones(8), 1e-6, impl),
                "trnkit::rmsnorm: constraint 'x is floating point' violated (got 'int64')"),
    "rmsnorm_qk": (lambda x, impl: ops.rmsnorm_qk(x.float(), x, torch.ones(8), torch.ones(8), 1e-6, impl),
                   "trnkit::rmsnorm_qk: constraint 'k: x is floating point' violated (got 'int64')"),
    "attention": (lambda x, impl: ops.attention(x.float(), x.float(), x, 0.3, impl),
                  "trnkit::attention: constraint 'v is floating point' violated (got 'int64')"),
    "rope_hf_apply": (lambda x, impl: ops.rope_hf_apply(x, x.float(), torch.randn(3, 8), torch.randn(3, 8), None,
                                                        "bshd", False, impl),
                      "trnkit::rope_hf: constraint 'q is floating point' violated (got 'int64')"),
}


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("op", sorted(_INTEGER_INPUTS))
def test_integer_inputs_refused_where_the_output_takes_their_dtype(op, impl):
    """An integer tensor where the op computes in floating point and returns the input's dtype is refused before
    any impl runs, by the op and its fake: the reference computed it in fp32 and cast the result back, so an
    rmsnorm of int64 rows gave 0 / +-1 and mlp, attention and rope truncated their outputs without a word."""
    call, message = _INTEGER_INPUTS[op]
    x = torch.randint(-3, 4, (1, 3, 1, 8), generator=_gen(9))
    for dev in ("cpu", "meta"):
        with torch.device(dev), pytest.raises(KernelConstraintError) as e:
            call(x.to(dev), impl)
        assert str(e.value) == message


def _bwd_cases(impl: str) -> dict[str, tuple]:
    """Each backward op's arguments with x, the weights and the grads as transposed (dense, permuted) views."""
    g = _gen(10)
    x = torch.randn(8, 6, generator=g).T  # [6, 8] with strides (1, 6)

    def t(*shape):
        return torch.randn(*reversed(shape), generator=g).T

    w_router, w_head = t(4, 8), t(5, 8)
    _, idx, logits = ops.router_topk(x, w_router, 2, True, impl)
    labels = torch.tensor([0, 1, -100, 3, 4, 2])
    _, lse = ops.linear_cross_entropy(x, w_head, labels, -100, impl)
    wgu, wd = torch.randn(4, 6, 8, generator=g).transpose(1, 2), torch.randn(4, 8, 3, generator=g).transpose(1, 2)
    return {
        "router_topk_bwd": (x, w_router, logits, idx, t(6, 2), t(6, 4), True, impl),
        "grouped_mm_bwd": (x, wgu, torch.tensor([1, 3, 3, 6], dtype=torch.int32), t(6, 6), impl),
        "moe_experts_bwd": (x, idx, t(6, 2), wgu, wd, t(6, 8), 0, impl),
        "rmsnorm_bwd": (x, torch.randn(8, generator=g), torch.rand(6, generator=g), t(6, 8), 1e-6, impl),
        "rmsnorm_qk_bwd": (x, t(6, 8), torch.randn(8, generator=g), torch.randn(8, generator=g),
                           torch.rand(6, generator=g), torch.rand(6, generator=g), t(6, 8), t(6, 8), 1e-6, impl),
        "linear_cross_entropy_bwd": (x, w_head, labels, lse, torch.tensor(1.0), -100, impl),
    }


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_backward_ops_fakes_match_the_real_strides_of_permuted_inputs(impl):
    """The backward ops return contiguous gradients and their fakes say so: the fakes were empty_like of a
    transposed x (strides (1, 6)) while the real outputs were contiguous, so opcheck's fake-tensor test failed
    and torch.compile's inductor backward stopped with 'expected size 6==6, stride 16==1' on an rmsnorm of a
    transposed input (test_compile.py)."""
    for op, args in _bwd_cases(impl).items():
        torch.library.opcheck(getattr(torch.ops.trnkit, op).default, args, test_utils="test_faketensor")


@pytest.mark.parametrize("impl", ["reference", "nki"])
@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_qk"])
def test_norm_eps_outside_finite_non_negative_refused(op, impl):
    """eps = -1e-6, -1 or NaN is refused before any impl runs, by the op and its fake (the reference computed
    rsqrt(mean(x^2) + eps) with it: NaN rows for eps = -1, NaN everywhere for NaN); eps = 0 is served, and equals
    the plain x / rms(x) * weight."""
    x, w = torch.randn(3, 8, generator=_gen(11)), torch.randn(8, generator=_gen(12))

    def call(t, weight, eps):
        return ops.rmsnorm(t, weight, eps, impl) if op == "rmsnorm" else ops.rmsnorm_qk(t, t, weight, weight, eps, impl)

    assert_close(call(x, w, 0.0)[0], w * x / x.pow(2).mean(-1, keepdim=True).sqrt())
    for eps in (-1e-6, -1.0, float("nan")):
        for dev in ("cpu", "meta"):
            with pytest.raises(KernelConstraintError) as e:
                call(x.to(dev), w.to(dev), eps)
            assert str(e.value) == f"trnkit::{op}: constraint 'eps is a finite float >= 0' violated (got {eps!r})"


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values in transposed (column-major) storage, as a kernel writing columns might return them."""
    return t.T.contiguous().T if t.dim() == 2 else t


def test_user_impl_outputs_of_any_strides_come_back_contiguous():
    """An impl returning column-major outputs (rmsnorm's y, grouped_mm's out, router_topk's three) gets contiguous
    outputs from the op, as its fake declares: they were passed through, so opcheck's fake-tensor test failed
    ('Stride mismatch') and inductor would assert on them. The values are the impl's."""
    def rms(x, weight, eps=1e-6):
        r = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        return _column_major(weight * (x.float() * r[:, None]).to(x.dtype)), r

    impls = {"rmsnorm": rms, "grouped_mm": lambda x, w, offs: _column_major(_refs.grouped_mm(x, w, offs)),
             "router_topk": lambda *a: tuple(_column_major(t) for t in _refs.router(*a))}
    x, w_router = _router_inputs()
    cases = {"rmsnorm": (x, torch.randn(8, generator=_gen(13)), 1e-6),
             "grouped_mm": (x, torch.randn(2, 8, 4, generator=_gen(14)), torch.tensor([2, 6], dtype=torch.int32)),
             "router_topk": (x, w_router, 2, True)}
    for op, fn in impls.items():
        register(op, "colmajor", fn)
        try:
            torch.library.opcheck(getattr(torch.ops.trnkit, op).default, (*cases[op], "colmajor"),
                                  test_utils="test_faketensor")
            outs = getattr(ops, op)(*cases[op], impl="colmajor")
            for got, want in zip(_as_tuple(outs), _as_tuple(fn(*cases[op])), strict=True):
                assert got.is_contiguous() and torch.equal(got, want.to(got.dtype))
        finally:
            unregister(op, "colmajor")


def _as_tuple(out: torch.Tensor | tuple) -> tuple:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_forward_mode_ad_refused_instead_of_a_zero_tangent(impl):
    """torch.func.jvp through an op gave a zero tangent (|jvp| 0 where the torch formula's is 60) and
    torch.autograd.forward_ad none, without a word: the ops have reverse-mode derivatives only. Now the forward
    ops refuse forward-mode AD naming the op; reverse mode still gives the torch formula's gradient."""
    x, w = torch.randn(5, 16, generator=_gen(15)), torch.randn(16, generator=_gen(16))

    def f(t):
        return ops.rmsnorm(t, w, 1e-6, impl)[0]

    def torch_rms(t):
        return w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))

    message = r"trnkit::rmsnorm: forward-mode AD \(torch.func.jvp / jacfwd, torch.autograd.forward_ad\) is not"
    with pytest.raises(RuntimeError, match=message):
        torch.func.jvp(f, (x,), (torch.ones_like(x),))
    with torch.autograd.forward_ad.dual_level(), pytest.raises(RuntimeError, match=message):
        f(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert_close(torch.autograd.grad(f(x1).sum(), x1)[0], torch.autograd.grad(torch_rms(x2).sum(), x2)[0])


def test_user_impl_per_row_outputs_of_another_length_refused():
    """An impl's rstd (rmsnorm) or lse (linear_cross_entropy) of another length than the op's rows is an
    ImplOutputError naming op, impl, output and both shapes, as for the other outputs: the op's reshape(-1)
    took any length (an rstd of 2T values came back as the op's, against its fake's [T])."""
    def rms(x, weight, eps=1e-6):
        r = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        return weight * (x.float() * r[:, None]).to(x.dtype), torch.cat([r, r])

    def lce(hidden, weight, labels, ignore_index=-100):
        logits = hidden.float() @ weight.float().T
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum"), logits.logsumexp(-1)[:1]

    register("rmsnorm", "long_rstd", rms)
    register("linear_cross_entropy", "short_lse", lce)
    try:
        with pytest.raises(ImplOutputError, match=r"trnkit::rmsnorm: impl 'long_rstd' returned rstd of shape \[8\], "
                                                  r"the op declares \[4\]"):
            ops.rmsnorm(torch.randn(4, 8), torch.ones(8), 1e-6, "long_rstd")
        args = (torch.randn(3, 8), torch.randn(5, 8), torch.tensor([0, 1, 2]), -100, "short_lse")
        for op in ("linear_cross_entropy", "linear_cross_entropy_fused"):
            with pytest.raises(ImplOutputError, match=rf"trnkit::{op}: impl 'short_lse' returned lse of shape \[1\], "
                                                      r"the op declares \[3\]"):
                getattr(ops, op)(*args)
    finally:
        unregister("rmsnorm", "long_rstd")
        unregister("linear_cross_entropy", "short_lse")


def test_user_attention_impl_in_the_other_layout_refused():
    """An attention impl returning o as [B, Hq, S, D] (the heads-first layout many kernels use) was reshaped to
    [B, S, Hq, D] without a word, scrambling rows and heads; o and lse must now have the declared shapes
    (ImplOutputError naming both). An impl in the declared layout gives the reference's result."""
    q, k, v = (torch.randn(1, 5, h, 8, generator=_gen(17 + h)) for h in (2, 1, 1))
    ref = get_impl("attention", "reference").fn

    def heads_first(q, k, v, scale):
        o, lse = ref(q, k, v, scale)
        return o.transpose(1, 2).contiguous(), lse

    register("attention", "heads_first", heads_first)
    register("attention", "declared", ref)
    try:
        with pytest.raises(ImplOutputError, match=r"trnkit::attention: impl 'heads_first' returned o of shape "
                                                  r"\[1, 2, 5, 8\], the op declares \[1, 5, 2, 8\]"):
            ops.attention(q, k, v, 0.3, "heads_first")
        for got, want in zip(ops.attention(q, k, v, 0.3, "declared"), ops.attention(q, k, v, 0.3, "reference"),
                             strict=True):
            assert torch.equal(got, want)
    finally:
        unregister("attention", "heads_first")
        unregister("attention", "declared")


@pytest.mark.parametrize("op", ["rmsnorm", "mlp"])
def test_user_impl_output_transposed_refused_not_reshaped(op):
    """A y of x's size in another shape ([H, T] for x [T, H]) was reshaped into scrambled rows; it is now an
    ImplOutputError. y as x's rows ([T, H] for x [2, 3, H]) is still reshaped to x's shape, with the reference's
    values."""
    ref = get_impl(op, "reference").fn

    def transposed(x, *rest):
        out = ref(x, *rest)
        y = out[0] if op == "rmsnorm" else out
        y = y.reshape(-1, x.shape[-1]).T.contiguous()
        return (y, out[1]) if op == "rmsnorm" else y

    def rows(x, *rest):
        out = ref(x, *rest)
        return (out[0].reshape(-1, x.shape[-1]), out[1]) if op == "rmsnorm" else out.reshape(-1, x.shape[-1])

    x = torch.randn(2, 3, 8, generator=_gen(20))
    args = (torch.ones(8), 1e-6) if op == "rmsnorm" else (torch.randn(8, 4, generator=_gen(21)),
                                                           torch.randn(2, 8, generator=_gen(22)))
    register(op, "transposed", transposed)
    register(op, "rows", rows)
    try:
        with pytest.raises(ImplOutputError, match=rf"trnkit::{op}: impl 'transposed' returned y of shape \[8, 6\], "
                                                  r"the op declares \[2, 3, 8\]"):
            getattr(ops, op)(x, *args, impl="transposed")
        got, want = getattr(ops, op)(x, *args, impl="rows"), getattr(ops, op)(x, *args, impl="reference")
        assert torch.equal(_as_tuple(got)[0], _as_tuple(want)[0])
    finally:
        unregister(op, "transposed")
        unregister(op, "rows")
