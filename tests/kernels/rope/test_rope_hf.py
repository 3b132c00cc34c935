"""rope_hf / rope_hf_bshd: NKI kernel (on trnkit's interpreter) against the fp64-oracle rule
(tests/tolerances.py) and bit-identical to the torch reference, and the reference vs transformers' Qwen3
rotary embedding (forward) and autograd (backward)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kernels import oracles as O
from tests.kernels.lnc_streams import assert_same_streams, recorded_streams
from tests.tolerances import F64, check_oracle
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.kernels.rope import constraints, rope_hf, rope_hf_bshd, rope_hf_bshd_ref, rope_hf_ref
from trnkit.kernels.rope.rope_kernel import rope_hf_kernel
from trnkit.nkisim import trace


def _tables(kind: str, B: int, S: int, D: int, extra: int, gen: torch.Generator) -> dict:
    """cos/sin (random, like nki-library's tests: exercises every element) as 2-D, 3-D or packed."""
    rows = S + extra
    shape = (B, rows, D) if kind.endswith("3d") else (rows, D)
    cos, sin = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if kind.startswith("packed"):
        return {"rope_cache": torch.cat([cos, sin], dim=-1)}
    return {"cos": cos, "sin": sin}


def _run(layout: str, B: int, Hq: int, Hk: int, S: int, D: int, dtype: torch.dtype, kind: str,
         backward: bool, extra: int = 0, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    shp = (lambda H: (B, H, S, D)) if layout == "bhsd" else (lambda H: (B, S, H, D))
    q = torch.randn(shp(Hq), generator=gen).to(dtype)
    k = torch.randn(shp(Hk), generator=gen).to(dtype)
    tabs = _tables(kind, B, S, D, extra, gen)
    kern, ref = (rope_hf, rope_hf_ref) if layout == "bhsd" else (rope_hf_bshd, rope_hf_bshd_ref)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    ret = kern(q, k, q_out, k_out, backward=backward, **tabs)
    assert ret[0] is q_out and ret[1] is k_out  # written in place and returned
    q_ref, k_ref = ref(q, k, torch.empty_like(q), torch.empty_like(k), backward=backward, **tabs)
    _check_oracle(q_out, k_out, q, k, tabs, dtype, backward, layout)
    # the kernel does the reference's operations in the activation dtype (two products, one sum; the
    # rotate-half sign sits in the table, negation is exact), so it is bit-identical
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def _check_oracle(q_out, k_out, q, k, tabs: dict, dtype: torch.dtype, backward: bool, layout: str = "bhsd") -> None:
    cos, sin = O.unpack(tabs["rope_cache"]) if "rope_cache" in tabs else (tabs["cos"], tabs["sin"])
    for name, x, out in (("q", q, q_out), ("k", k, k_out)):
        O.check_all((name,), out, lambda dt, x=x: O.rope(x, cos, sin, dt, backward, layout), dtype)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_gqa_head_dim_128(layout: str, backward: bool, dtype: torch.dtype) -> None:
    _run(layout, 1, 32, 8, 8, 128, dtype, "packed", backward, extra=5)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("kind", ["2d", "3d", "packed", "packed3d"])
def test_table_layouts_d64_odd_s(layout: str, kind: str) -> None:
    _run(layout, 2, 3, 1, 129, 64, torch.float32, kind, backward=False, extra=7)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_s423_multi_chunk_tail(layout: str, dtype: torch.dtype) -> None:
    # D=16: up to 128 rows per partition per chunk; S=423 -> chunks (0, 128, 3) (all partitions, 3 rows
    # each) and the tail (384, 39, 1) on 39 partitions
    _run(layout, 1, 2, 1, 423, 16, dtype, "2d", backward=True)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("S,D", [(1, 2), (1, 128), (2, 2)])
def test_smallest_shapes(layout: str, S: int, D: int) -> None:
    # one row on one partition; D=2: each half is a single element
    _run(layout, 2, 1, 1, S, D, torch.float32, "3d", backward=False)
    _run(layout, 1, 3, 2, S, D, torch.bfloat16, "packed", backward=True)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("backward", [False, True])
def test_engine_split_bf16(layout: str, backward: bool) -> None:
    """The design's engine split, on a shape with several head tiles: both products on the Vector
    engine with every operand bf16 in SBUF and contiguous (the trn2 performance-mode conditions, so the
    cost model prices each at N/2 cycles), the sum as three identity matmuls per slab on TensorE, the
    rounding PSUM -> SBUF copy on the Scalar engine; GpSimd only builds the identity."""
    from dataclasses import replace

    from trnkit.nkisim import cost, cost_params, trace  # the interpreter's trace and cost model

    H, S, D = 10, 1024, 128  # q 8 heads + k 2 heads
    with trace.record() as tr:
        _run(layout, 1, 8, 2, S, D, torch.bfloat16, "packed", backward)
    instrs = list(tr)
    products = [i for i in instrs if i.engine == "vector"][1:]  # (the first is the identity's memset)
    assert {i.op for i in products} == {"tensor_tensor"}
    assert all(o.buffer == "sbuf" and o.dtype == "bfloat16" for i in products for o in i.operands)
    assert all(i.attrs["contiguous"] for i in products)
    per_partition = H * S * D // 128
    formula = replace(cost_params.MID, access_init_cycles=0)  # the ISA formula, without the access set-up
    assert sum(cost.instr_cost(i, params=formula).cycles for i in products) == 2 * per_partition / 2
    matmuls = [i for i in instrs if i.op == "nc_matmul"]
    assert len(matmuls) == 3 * per_partition // 512 and all(i.engine == "tensor" for i in matmuls)
    copies = [i for i in instrs if i.engine == "scalar" and i.op == "tensor_copy" and i.operands[1].buffer == "psum"]
    assert sum(i.elems_per_partition for i in copies) == per_partition
    assert [i.op for i in instrs if i.engine == "gpsimd"] == ["affine_select"]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fp32_products_shared_with_gpsimd(layout: str) -> None:
    """fp32 (no Vector performance mode, so no shared-bus conflict): about a quarter of the products go
    to GpSimd (the share its slowest modelled rate can keep up with: 4.17 vs 13.3 ns per element), the
    rest to Vector; the result is still the reference's bit for bit (checked in _run)."""
    from trnkit.nkisim import trace

    with trace.record() as tr:
        _run(layout, 1, 8, 2, 512, 128, torch.float32, "packed", backward=True)
    n = {e: sum(i.elems_per_partition for i in tr if i.op == "tensor_tensor" and i.engine == e)
         for e in ("vector", "gpsimd")}
    assert 0.15 < n["gpsimd"] / (n["vector"] + n["gpsimd"]) < 0.3  # 0.24 in the limit; 2 of 10 slabs here


def test_long_sequence_several_chunks() -> None:
    # D=128: 2048-row chunks -> chunks (0,128,16), (2048,128,2), (2304,5,1)
    _run("bhsd", 1, 1, 1, 2309, 128, torch.bfloat16, "packed", backward=False)


def test_bf16_tables_and_in_place() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 40, 32, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 1, 40, 32, generator=gen).to(torch.bfloat16)
    cos = torch.randn(40, 32, generator=gen).to(torch.bfloat16)
    sin = torch.randn(40, 32, generator=gen).to(torch.bfloat16)
    q_ref, k_ref = rope_hf_ref(q, k, torch.empty_like(q), torch.empty_like(k), cos=cos, sin=sin)
    q0, k0 = q.clone(), k.clone()
    rope_hf(q, k, q, k, cos=cos, sin=sin)  # q_out is q: every tile is read before it is written
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    _check_oracle(q, k, q0, k0, {"cos": cos, "sin": sin}, torch.bfloat16, False)


@pytest.mark.parametrize("bshd", [False, True], ids=["bhsd", "bshd"])
def test_lnc2_grid_matches_single_program(bshd: bool) -> None:
    """S=300 is not a multiple of 128 * 2: the chunks that have no equal partner are computed by the
    second program as masked work, so both programs run the same instructions per engine."""
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 300, 32, generator=gen), torch.randn(1, 1, 300, 32, generator=gen)
    cache = torch.randn(300, 64, generator=gen)
    q_ref, k_ref = rope_hf_ref(q, k, torch.empty_like(q), torch.empty_like(k), rope_cache=cache)
    if bshd:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    with recorded_streams() as s:
        rope_hf_kernel[2](q, k, q_out, k_out, cache, cache, packed=True, backward=False, bshd=bshd)
    assert_same_streams(s)
    if bshd:
        q, k, q_out, k_out = (t.transpose(1, 2) for t in (q, k, q_out, k_out))
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    _check_oracle(q_out, k_out, q, k, {"rope_cache": cache}, torch.float32, False)


@pytest.mark.parametrize("backward", [False, True])
def test_lnc2_wrapper_runs_both_programs_bit_identical(backward: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 300, 3, 64, generator=gen), torch.randn(2, 300, 1, 64, generator=gen)
    cache = torch.randn(300, 128, generator=gen)
    out = {}
    for lnc in (1, 2):
        with trace.record() as tr:
            out[lnc] = rope_hf_bshd(q, k, torch.empty_like(q), torch.empty_like(k), rope_cache=cache,
                                    backward=backward, lnc=lnc)
        assert {i.program_id for i in tr} == set(range(lnc))
    assert all(torch.equal(a, b) for a, b in zip(out[1], out[2]))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Hq=st.integers(1, 3), Hk=st.integers(1, 2), S=st.integers(1, 140),
       half=st.integers(1, 64), kind=st.sampled_from(["2d", "3d", "packed", "packed3d"]),
       layout=st.sampled_from(["bhsd", "bshd"]), backward=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), extra=st.integers(0, 3))
def test_hypothesis_shapes(B, Hq, Hk, S, half, kind, layout, backward, dtype, extra) -> None:
    _run(layout, B, Hq, Hk, S, 2 * half, dtype, kind, backward, extra=extra)


# --- the reference against independent oracles -------------------------------------------------------


def _hf_cos_sin(B: int, S: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=D,
                      max_position_embeddings=1024)
    pos = torch.arange(S)[None].expand(B, S)
    return Qwen3RotaryEmbedding(cfg)(torch.zeros(1), pos)  # [B, S, D] fp32


@pytest.mark.parametrize("D", [64, 128])
def test_ref_and_kernel_match_transformers_apply_rotary_pos_emb(D: int) -> None:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    B, S = 2, 37
    cos, sin = _hf_cos_sin(B, S, D)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(B, 4, S, D, generator=gen), torch.randn(B, 2, S, D, generator=gen)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    q64, k64 = apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim=1)
    q_ref, k_ref = rope_hf_ref(q, k, torch.empty_like(q), torch.empty_like(k), cos=cos, sin=sin)
    check_oracle("ref q", q_ref, q_hf, q64)
    check_oracle("ref k", k_ref, k_hf, k64)
    # torchtitan-style packed cache [S, 2D] = cat(cos, sin) in the model's [B, S, H, D] layout
    cache = torch.cat([cos[0], sin[0]], dim=-1)
    qb, kb = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    q_out, k_out = rope_hf_bshd(qb, kb, torch.empty_like(qb), torch.empty_like(kb), rope_cache=cache)
    check_oracle("kernel q", q_out.transpose(1, 2), q_hf, q64)
    check_oracle("kernel k", k_out.transpose(1, 2), k_hf, k64)


def test_ref_backward_matches_autograd_of_transformers() -> None:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    B, S, D = 1, 19, 64
    gen = torch.Generator().manual_seed(6)
    cos, sin = torch.randn(B, S, D, generator=gen), torch.randn(B, S, D, generator=gen)  # general tables
    q, k = torch.randn(B, 3, S, D, generator=gen), torch.randn(B, 1, S, D, generator=gen)
    dq, dk = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)

    def hf_grads(dt):
        ql, kl = q.to(dt).requires_grad_(True), k.to(dt).requires_grad_(True)
        out = apply_rotary_pos_emb(ql, kl, cos.to(dt), sin.to(dt), unsqueeze_dim=1)
        return torch.autograd.grad(out, (ql, kl), (dq.to(dt), dk.to(dt)))

    (hq, hk), (oq, ok) = hf_grads(torch.float32), hf_grads(F64)
    gq, gk = rope_hf_ref(dq, dk, torch.empty_like(dq), torch.empty_like(dk), cos=cos, sin=sin, backward=True)
    check_oracle("ref grad q", gq, hq, oq)
    check_oracle("ref grad k", gk, hk, ok)
    kq, kk = rope_hf(dq, dk, torch.empty_like(dq), torch.empty_like(dk), cos=cos, sin=sin, backward=True)
    check_oracle("kernel grad q", kq, hq, oq)
    check_oracle("kernel grad k", kk, hk, ok)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_bf16_equals_transformers_bf16_bit_for_bit(layout: str) -> None:
    """bf16 activations: the kernel does transformers' bf16 arithmetic (cos/sin rounded to bf16, each
    product rounded to bf16, the sum rounded once), forward and autograd backward, bit for bit. (Its
    accuracy against fp64 is then torch's own: tests/kernels/test_oracle.py.)"""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    B, S, D = 1, 300, 64
    cos, sin = _hf_cos_sin(B, S, D)  # fp32, as Qwen3RotaryEmbedding returns them for fp32 inputs
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, 4, S, D, generator=gen).bfloat16().requires_grad_(True)
    k = torch.randn(B, 2, S, D, generator=gen).bfloat16().requires_grad_(True)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos.bfloat16(), sin.bfloat16(), unsqueeze_dim=1)
    dq, dk = torch.randn(q.shape, generator=gen).bfloat16(), torch.randn(k.shape, generator=gen).bfloat16()
    torch.autograd.backward((q_hf, k_hf), (dq, dk))
    cache = torch.cat([cos[0], sin[0]], dim=-1)  # fp32 packed cache: the kernel rounds it like HF
    kern = rope_hf if layout == "bhsd" else rope_hf_bshd
    io = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2).contiguous())
    for backward, (xq, xk), (want_q, want_k) in ((False, (q, k), (q_hf, k_hf)), (True, (dq, dk), (q.grad, k.grad))):
        xq, xk = io(xq.detach()), io(xk.detach())
        got_q, got_k = kern(xq, xk, torch.empty_like(xq), torch.empty_like(xk), rope_cache=cache, backward=backward)
        assert torch.equal(io(got_q), want_q.detach()) and torch.equal(io(got_k), want_k.detach())


# --- constraints: every rule raises with kernel, rule and value --------------------------------------


def _ok() -> dict:
    return {"q": torch.zeros(1, 2, 8, 16), "k": torch.zeros(1, 1, 8, 16), "cos": torch.zeros(8, 16),
            "sin": torch.zeros(8, 16)}


def _bad_cases() -> list[tuple[str, dict, str]]:
    z = torch.zeros
    return [
        ("q 3-D", {"q": z(2, 8, 16)}, "q is 4-D"),
        ("k 3-D", {"k": z(1, 8, 16)}, "k is 4-D"),
        ("S mismatch", {"k": z(1, 1, 9, 16)}, "q and k share B, S and D"),
        ("odd D", {"q": z(1, 2, 8, 15), "k": z(1, 1, 8, 15), "cos": z(8, 15), "sin": z(8, 15)}, "D even"),
        ("D 130", {"q": z(1, 2, 8, 130), "k": z(1, 1, 8, 130), "cos": z(8, 130), "sin": z(8, 130)}, "D <= 128"),
        ("fp16", {"q": z(1, 2, 8, 16, dtype=torch.float16), "k": z(1, 1, 8, 16, dtype=torch.float16)},
         "q.dtype in"),
        ("k dtype", {"k": z(1, 1, 8, 16, dtype=torch.bfloat16)}, "k.dtype == q.dtype"),
        ("both tables", {"rope_cache": z(8, 32)}, "exactly one of (cos, sin) or rope_cache"),
        ("no tables", {"cos": None, "sin": None}, "exactly one of (cos, sin) or rope_cache"),
        ("cos only", {"sin": None}, "cos and sin given together"),
        ("cos/sin shapes", {"sin": z(9, 16)}, "cos.shape == sin.shape"),
        ("cos width", {"cos": z(8, 8), "sin": z(8, 8)}, "cos.shape[-1] == D"),
        ("cos rows", {"cos": z(7, 16), "sin": z(7, 16)}, "cos rows >= S"),
        ("cos batch", {"cos": z(3, 8, 16), "sin": z(3, 8, 16)}, "cos.shape[0] == B"),
        ("cos 4-D", {"cos": z(1, 1, 8, 16), "sin": z(1, 1, 8, 16)}, "cos is 2-D"),
        ("cos int", {"cos": z(8, 16, dtype=torch.int32), "sin": z(8, 16, dtype=torch.int32)}, "cos.dtype in"),
        ("cache width", {"cos": None, "sin": None, "rope_cache": z(8, 16)}, "rope_cache.shape[-1] == 2*D"),
        ("cache rows", {"cos": None, "sin": None, "rope_cache": z(4, 32)}, "rope_cache rows >= S"),
        ("S 0", {"q": z(1, 2, 0, 16), "k": z(1, 1, 0, 16)}, "all dimensions >= 1"),
    ]


@pytest.mark.parametrize("name,change,rule", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_constraint_violations_raise(name: str, change: dict, rule: str) -> None:
    args = {**_ok(), **change}
    q, k = args.pop("q"), args.pop("k")
    with pytest.raises(KernelConstraintError) as ei:
        rope_hf(q, k, torch.empty_like(q), torch.empty_like(k), **args)
    msg = str(ei.value)
    assert msg.startswith("rope_hf: constraint") and rule in msg and "(got " in msg, msg
    assert constraints(q, k, layout="bhsd", **args)  # the registry sees the same violations


def test_output_constraints_and_bshd_name() -> None:
    a = _ok()
    q, k = a["q"], a["k"]
    with pytest.raises(KernelConstraintError, match=r"rope_hf: constraint 'q_out has the shape"):
        rope_hf(q, k, torch.empty(1, 2, 8, 8), torch.empty_like(k), cos=a["cos"], sin=a["sin"])
    with pytest.raises(KernelConstraintError, match=r"rope_hf: constraint 'k_out has the shape and dtype of k'"):
        rope_hf(q, k, torch.empty_like(q), torch.empty_like(k, dtype=torch.bfloat16), cos=a["cos"], sin=a["sin"])
    strided = torch.empty(1, 8, 2, 16).transpose(1, 2)
    with pytest.raises(KernelConstraintError, match="q_out is contiguous"):
        rope_hf(q, k, strided, torch.empty_like(k), cos=a["cos"], sin=a["sin"])
    with pytest.raises(KernelConstraintError, match="k_out is contiguous"):
        rope_hf(q, k, torch.empty_like(q), torch.empty(1, 1, 8, 32)[..., :16], cos=a["cos"], sin=a["sin"])
    with pytest.raises(KernelConstraintError, match=r"rope_hf_bshd: constraint 'D even' violated \(got 15\)"):
        qb = torch.zeros(1, 8, 2, 15)
        rope_hf_bshd(qb, torch.zeros(1, 8, 1, 15), torch.empty_like(qb), torch.zeros(1, 8, 1, 15),
                     cos=torch.zeros(8, 15), sin=torch.zeros(8, 15))
    assert constraints(q, k, layout="nope")[0].constraint.startswith("layout in")
    wide = torch.zeros(1, 1, 129, 128)  # [B, S, H, D] fp32: 3 * 129 * 128 * 4 bytes > 192 KiB
    with pytest.raises(KernelConstraintError, match=r"rope_hf_bshd: constraint '3 \* max\(Hq, Hk\)"):
        rope_hf_bshd(wide, wide, torch.empty_like(wide), torch.empty_like(wide), cos=torch.zeros(1, 128),
                     sin=torch.zeros(1, 128))
    ok = torch.zeros(1, 1, 128, 128)
    rope_hf_bshd(ok, ok, torch.empty_like(ok), torch.empty_like(ok), cos=torch.zeros(1, 128),
                 sin=torch.zeros(1, 128))  # the largest allowed slab runs
    assert constraints(q, k, cos=a["cos"], sin=a["sin"]) == []


def test_row_chunks_cover_every_row_once() -> None:
    from trnkit.kernels._common import row_chunks

    assert row_chunks(2309, 16) == ((0, 128, 16), (2048, 128, 2), (2304, 5, 1))
    for n, nt in ((1, 16), (128, 1), (129, 4), (4096, 16), (5000, 3)):
        rows = [r0 + p * NT + t for r0, P, NT in row_chunks(n, nt) for p in range(P) for t in range(NT)]
        assert sorted(rows) == list(range(n))


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_spreads_along_its_partition_column(dtype: torch.dtype, backward: bool) -> None:
    """The documented contract (docs/kernels.md, "Non-finite inputs"): a NaN at row s, dim d of one
    (batch, head) makes that head's rows ``r0 + p*NT + t`` of its chunk (every partition p, the same
    offset t of s in its partition) non-finite in dims d and d +- D/2 (the identity matmuls that sum
    the products multiply 0 x NaN); the reference has only row s. Everything else is the NaN-free result.
    S=256, D=64: one chunk of 128 partitions x NT=2 rows, so s=5 spreads to every odd row."""
    S, D = 256, 64
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 2, S, D, generator=gen).to(dtype), torch.randn(1, 1, S, D, generator=gen).to(dtype)
    cos, sin = torch.randn(S, D, generator=gen), torch.randn(S, D, generator=gen)
    clean = rope_hf(q, k, torch.empty_like(q), torch.empty_like(k), cos=cos, sin=sin, backward=backward)
    q[0, 1, 5, 3] = float("nan")
    ref = rope_hf_ref(q, k, torch.empty_like(q), torch.empty_like(k), cos=cos, sin=sin, backward=backward)
    assert sorted(set((~torch.isfinite(ref[0])).nonzero()[:, 2].tolist())) == [5]
    q_out, k_out = rope_hf(q, k, torch.empty_like(q), torch.empty_like(k), cos=cos, sin=sin, backward=backward)
    spread = torch.zeros_like(q_out, dtype=torch.bool)
    spread[0, 1, 1::2, 3] = spread[0, 1, 1::2, 3 + D // 2] = True
    assert (~torch.isfinite(q_out)).equal(spread)
    assert torch.equal(q_out[~spread], clean[0][~spread]) and torch.equal(k_out, clean[1])
