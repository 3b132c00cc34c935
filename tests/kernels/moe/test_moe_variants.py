"""Expert variants of moe_experts: activation ``silu | gelu_tanh | swiglu_clamped`` (GPT-OSS) and the
optional biases ``b_gate_up [E, 2I]`` / ``b_down [E, H]``.

Oracles, independent of the kernels' refs: torch's own ``F.silu`` / ``F.gelu(approximate="tanh")`` and
GPT-OSS's clamped SwiGLU as transformers 5.24 writes it (``GptOssExperts._apply_gate``), differentiated
by autograd in fp64 over a per-(token, k) gather. Refs and kernels are held to the fp64-oracle rule of
``tests/tolerances.py`` against that oracle (as accurate as the same torch code at the test dtype), and
the kernels are bit-for-bit across LNC=1/2.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_bit_identical, expert_weights, gate, rand, routing, torch_experts
from tests.kernels.lnc_streams import assert_same_streams, recorded_streams
from tests.tolerances import check_oracle
from trnkit.kernels import moe
from trnkit.kernels.constraints import KernelConstraintError

DTYPES = (torch.float32, torch.bfloat16)
F64 = torch.float64
LIMIT, ALPHA = 1.25, 1.702  # a small limit so that the clamps bind on O(1) activations
VARIANTS = {
    "silu": dict(activation="silu"),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "swiglu_clamped": dict(activation="swiglu_clamped", limit=LIMIT, alpha=ALPHA),
}
GRADS = ("grad_x", "grad_topk_weights", "grad_w_gate_up", "grad_w_down", "grad_b_gate_up", "grad_b_down")


def _torch_and_oracle(x, idx, tw, wgu, wd, bgu, bd, kw, dtype, go=None):
    """``torch_experts`` at ``dtype`` (torch's own result) and in fp64 (the oracle): ``[out]``, or with ``go``
    the autograd gradients in GRADS order (None for an absent bias)."""
    def run(dt):
        if go is None:
            return [torch_experts(x, idx, tw, wgu, wd, bgu, bd, dt, **kw)]
        leaves = [None if t is None else t.detach().to(dt).requires_grad_() for t in (x, tw, wgu, wd, bgu, bd)]
        torch_experts(leaves[0], idx, *leaves[1:], dt, **kw).backward(go.to(dt))
        return [None if t is None else t.grad for t in leaves]

    return run(dtype), run(F64)


# Gradients through the clamp's derivative (0 past the limit): in bf16 a gate / up value within half an
# ulp of the limit is on either side of it depending on rounding alone, and one such value moves a
# token's grad_x by O(1) (odd_H_I, gate_up bias: 1.2534 in fp64 rounds to the limit 1.25 in the kernel
# and to 1.2578 through torch's two roundings: kernel 4.2e-2 vs torch 4.6e-3, where torch got lucky).
# There the error against fp64 measures rounding luck, not accuracy, so those outputs are held to the
# reference instead (same rounding points, fp32 sums in another order): within one bf16 ulp, as a
# relative Frobenius norm <= 2**-7.
CLAMP_DERIVED = ("grad_x", "grad_w_gate_up", "grad_b_gate_up")


def _check(names, got, dtype, *case, go=None, ref=None) -> None:
    """The oracle rule on each output of a kernel or ref (``got``; None = an absent bias, also absent in
    torch's); ``ref``: the reference's outputs, the kernel's comparison where a bf16 clamp decides."""
    clamped = dtype == torch.bfloat16 and case[-1].get("activation") == "swiglu_clamped" and go is not None
    base, orc = _torch_and_oracle(*case, dtype, go=go)
    got = list(got) + [None] * (len(base) - len(got))  # without biases the backward returns 4 gradients
    for i, (name, a, b, o) in enumerate(zip(names, got, base, orc, strict=True)):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.shape == b.shape, name
        if clamped and name.split()[-1] in CLAMP_DERIVED:
            r = ref[i].double()
            assert float((a.double() - r).norm() / r.norm()) <= 2**-7, name
        else:
            check_oracle(name, a, b, o)


def _inputs(T, H, inter, E, K, dtype, bias, seed=0):
    x = rand(T, H, dtype=dtype, seed=seed)
    wgu, wd = expert_weights(E, H, inter, dtype, seed=seed + 1)
    idx, tw = routing(T, E, K, seed=seed + 2)
    bgu = rand(E, 2 * inter, dtype=dtype, seed=seed + 3) if bias in ("both", "gate_up") else None
    bd = rand(E, H, dtype=dtype, seed=seed + 4, scale=0.5) if bias in ("both", "down") else None
    return x, idx, tw, wgu, wd, bgu, bd


# ------------------------------------------------------------------------------------ references
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_activation_ref_matches_autograd_of_torch_functions(activation: str) -> None:
    kw = VARIANTS[activation]
    a = torch.linspace(-4, 4, 401, dtype=F64)
    a = torch.cat([a, torch.tensor([LIMIT, -LIMIT], dtype=F64)])  # exactly on the clamp bounds
    u = torch.flip(a, [0]).clone()
    al, ul = a.clone().requires_grad_(), u.clone().requires_grad_()
    h = gate(al, ul, activation, kw.get("limit", 7.0), kw.get("alpha", 1.702))
    da, du = torch.autograd.grad(h.sum(), [al, ul])
    got_h, got_da, got_du = moe.activation_ref(a.float(), u.float(), **kw)
    for name, got, want in (("h", got_h, h), ("dh_da", got_da, da), ("dh_du", got_du, du)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-6, msg=name)
    if activation == "swiglu_clamped":  # the clamps really bind: no gradient past the limits
        assert bool((got_da[a.float() > LIMIT] == 0).all()) and bool((got_du[u.float().abs() > LIMIT] == 0).all())


@pytest.mark.parametrize("bias", ["none", "both"])
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_refs_match_fp64_autograd_oracle(activation: str, bias: str) -> None:
    kw = VARIANTS[activation]
    x, idx, tw, wgu, wd, bgu, bd = _inputs(14, 24, 10, 5, 2, torch.float32, bias)
    case = (x, idx, tw, wgu, wd, bgu, bd, kw)
    _check(("out",), [moe.moe_experts_ref(x, idx, tw, wgu, wd, b_gate_up=bgu, b_down=bd, **kw)], torch.float32, *case)
    g = rand(14, 24, seed=9)
    got = moe.moe_experts_bwd_ref(x, idx, tw, wgu, wd, g, b_gate_up=bgu, b_down=bd, **kw)
    assert len([t for t in got if t is not None]) == (4 if bias == "none" else 6)
    _check(GRADS, got, torch.float32, *case, go=g)


def test_default_variant_is_the_qwen3_swiglu() -> None:
    """activation='silu' without biases is the existing SwiGLU experts, bit for bit (ref and kernel)."""
    x, idx, tw, wgu, wd, _, _ = _inputs(20, 64, 32, 4, 2, torch.float32, "none")
    explicit = dict(activation="silu", limit=moe.SWIGLU_LIMIT, alpha=moe.SWIGLU_ALPHA, b_gate_up=None, b_down=None)
    assert torch.equal(moe.moe_experts(x, idx, tw, wgu, wd, 32, **explicit), moe.moe_experts(x, idx, tw, wgu, wd, 32))
    zero = dict(b_gate_up=torch.zeros(4, 64), b_down=torch.zeros(4, 64))
    _check(("out",), [moe.moe_experts(x, idx, tw, wgu, wd, 32, **zero)], torch.float32,
           x, idx, tw, wgu, wd, None, None, VARIANTS["silu"])


# ------------------------------------------------------------------------------- kernels vs refs
CASES = {
    # name: (T, H, I, E, K, block_size)
    "tails": (24, 160, 96, 5, 2, 32),  # H % 128 = 32, I % 128 = 96 (partial bias columns)
    "odd_H_I": (12, 72, 20, 3, 2, 32),
    "I_two_chunks": (40, 64, 200, 2, 2, 64),  # I = 128 + 72: a full and a partial bias column
    "full_plus_half_128": (150, 64, 32, 1, 1, 128),  # a 128-wide block and a 64-wide tail
}


def _kernel_vs_ref(case: str, dtype: torch.dtype, activation: str, bias: str, backward: bool = True) -> None:
    T, H, inter, E, K, B = CASES[case]
    kw = VARIANTS[activation]
    x, idx, tw, wgu, wd, bgu, bd = _inputs(T, H, inter, E, K, dtype, bias)
    var = dict(b_gate_up=bgu, b_down=bd, **kw)
    out = moe.moe_experts(x, idx, tw, wgu, wd, B, **var)
    assert out.dtype == dtype and out.shape == x.shape
    case = (x, idx, tw, wgu, wd, bgu, bd, kw)
    _check(("out",), [out], dtype, *case)
    if not backward:
        return
    g = rand(T, H, dtype=dtype, seed=11)
    got = moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, B, **var)
    ref = moe.moe_experts_bwd_ref(x, idx, tw, wgu, wd, g, **var)
    assert len(got) == len(ref) == (4 if bias == "none" else 6)
    for name, a, b in zip(GRADS, got, ref):
        assert (a is None) == (b is None), name
        assert a is None or (a.shape == b.shape and a.dtype == b.dtype), name
    _check(GRADS, got, dtype, *case, go=g, ref=ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", ["none", "both"])
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_kernels_match_refs(activation: str, bias: str, dtype: torch.dtype) -> None:
    _kernel_vs_ref("tails", dtype, activation, bias)


@pytest.mark.parametrize("case,activation,bias", [
    ("odd_H_I", "swiglu_clamped", "gate_up"), ("I_two_chunks", "gelu_tanh", "down"),
    ("I_two_chunks", "swiglu_clamped", "both"), ("full_plus_half_128", "silu", "both")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_match_refs_more_shapes(case: str, activation: str, bias: str, dtype: torch.dtype) -> None:
    _kernel_vs_ref(case, dtype, activation, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lnc2_is_bit_identical_to_lnc1(dtype: torch.dtype) -> None:
    x, idx, tw, wgu, wd, bgu, bd = _inputs(24, 160, 96, 5, 2, dtype, "both")
    var = dict(b_gate_up=bgu, b_down=bd, **VARIANTS["swiglu_clamped"])
    g = rand(24, 160, dtype=dtype, seed=11)
    with recorded_streams() as s:  # E=5: core 1 also runs a masked sixth expert (biases included)
        two = (moe.moe_experts(x, idx, tw, wgu, wd, 32, lnc=2, **var),
               moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, 32, lnc=2, **var))
    assert_same_streams(s)
    assert_bit_identical(two[0], moe.moe_experts(x, idx, tw, wgu, wd, 32, lnc=1, **var))
    assert_bit_identical(two[1], moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, 32, lnc=1, **var))


def test_empty_experts_get_zero_bias_gradients() -> None:
    x = rand(20, 64)
    wgu, wd = expert_weights(6, 64, 48, torch.float32)
    idx, tw = routing(20, 6, 2, experts=[0, 2, 3, 5])
    bgu, bd = rand(6, 96, seed=3), rand(6, 64, seed=4)
    grads = moe.moe_experts_bwd(x, idx, tw, wgu, wd, rand(20, 64, seed=5), 32, b_gate_up=bgu, b_down=bd,
                                activation="gelu_tanh")
    for g in grads[2:]:
        assert bool((g[[1, 4]] == 0).all())
        assert bool((g[[0, 2, 3, 5]] != 0).any())


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_fp64_oracle_rule(activation: str, dtype: torch.dtype, backward: bool) -> None:
    """err(kernel) <= 1.5 err(torch at the dtype) + floor against fp64 (tests/tolerances.py's rule)."""
    kw = VARIANTS[activation]
    T, H, inter, E, K = 40, 128, 64, 4, 2
    x, idx, tw, wgu, wd, bgu, bd = _inputs(T, H, inter, E, K, dtype, "both", seed=20)
    var = dict(b_gate_up=bgu, b_down=bd, **kw)
    case = (x, idx, tw, wgu, wd, bgu, bd, kw)
    if not backward:
        _check((f"{activation} out",), [moe.moe_experts(x, idx, tw, wgu, wd, **var)], dtype, *case)
        return
    go = rand(T, H, dtype=dtype, seed=21)
    _check([f"{activation} {n}" for n in GRADS], moe.moe_experts_bwd(x, idx, tw, wgu, wd, go, **var), dtype, *case,
           go=go, ref=moe.moe_experts_bwd_ref(x, idx, tw, wgu, wd, go, **var))


# ----------------------------------------------------------------------------------- constraints
def _args(**over):
    x, idx, tw, wgu, wd, _, _ = _inputs(4, 64, 32, 3, 2, torch.float32, "none")
    args = dict(x=x, topk_idx=idx, topk_weights=tw, w_gate_up=wgu, w_down=wd, block_size=32)
    args.update(over)
    return args


BAD = {
    "activation": (dict(activation="relu"), "activation in ('silu', 'gelu_tanh', 'swiglu_clamped')", "'relu'"),
    "limit_without_clamp": (dict(activation="gelu_tanh", limit=3.0), "limit / alpha only with", "3.0"),
    "limit_negative": (dict(activation="swiglu_clamped", limit=-1.0), "swiglu_clamped limit is finite and > 0", "-1.0"),
    "alpha_inf": (dict(activation="swiglu_clamped", alpha=float("inf")), "alpha is finite and > 0", "inf"),
    "b_gate_up_shape": (dict(b_gate_up=torch.zeros(3, 32)), "b_gate_up.shape == (E, 2I)", "(3, 32)"),
    "b_down_shape": (dict(b_down=torch.zeros(2, 64)), "b_down.shape == (E, H)", "(2, 64)"),
    "b_down_dtype": (dict(b_down=torch.zeros(3, 64, dtype=torch.bfloat16)), "b_down.dtype == x.dtype", "bfloat16"),
    "bias_sbuf": (dict(x=torch.zeros(4, 2048), w_gate_up=torch.zeros(3, 2048, 1024), w_down=torch.zeros(3, 512, 2048),
                       b_down=torch.zeros(3, 2048)), "fit 96 KiB of SBUF", "106496 bytes"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_unsupported_variants_are_rejected_by_name(bad: str) -> None:
    over, rule, value = BAD[bad]
    args = _args(**over)
    for fn in (moe.moe_experts, moe.moe_experts_ref):
        with pytest.raises(KernelConstraintError, match="moe_experts") as err:
            fn(**args)
        assert rule in str(err.value) and value in str(err.value), str(err.value)
    with pytest.raises(KernelConstraintError, match="moe_experts"):
        moe.moe_experts_bwd(grad_out=torch.zeros_like(args["x"]), **args)
    assert any(rule in str(v) for v in moe.moe_experts_constraints(**args))
