"""MoE grouped expert matmul: refs vs independent oracles, NKI kernels (on the interpreter) vs the
fp64-oracle rule of ``tests/tolerances.py``.

Oracles: ``torch._grouped_mm`` (CPU), autograd of an obvious per-group / per-(token, k) loop, and
transformers' ``Qwen3MoeExperts`` / ``Qwen3MoeSparseMoeBlock`` on the same weights, each evaluated at the
test dtype (torch's own result) and in float64 (the oracle); the kernels against ``oracles.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import GMM_CASES, MOE_CASES, expert_weights, moe_inputs, rand, routing, weight_dmas
from tests.kernels import oracles as O
from tests.tolerances import F64, check_oracle
from trnkit.kernels import moe
from trnkit.kernels.moe import layout
from trnkit.kernels.constraints import KernelConstraintError, Violation

DTYPES = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------- converters
def test_layout_converters_round_trip_and_agree() -> None:
    E, H, inter = 3, 8, 5
    gate_up_proj, down_proj = rand(E, 2 * inter, H), rand(E, H, inter, seed=3)
    wgu, wd = moe.from_hf_v5(gate_up_proj, down_proj)
    assert wgu.shape == (E, H, 2 * inter) and wd.shape == (E, inter, H)
    # gate columns first: column i of w_gate_up[e] is row i of gate_up_proj[e]
    torch.testing.assert_close(wgu[1, :, 2], gate_up_proj[1, 2], rtol=0, atol=0)
    torch.testing.assert_close(wgu[1, :, inter + 2], gate_up_proj[1, inter + 2], rtol=0, atol=0)
    back = moe.to_hf_v5(wgu, wd)
    torch.testing.assert_close(back[0], gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(back[1], down_proj, rtol=0, atol=0)
    w1, w2, w3 = moe.to_torchtitan(wgu, wd)
    torch.testing.assert_close(w1, gate_up_proj[:, :inter], rtol=0, atol=0)
    torch.testing.assert_close(w3, gate_up_proj[:, inter:], rtol=0, atol=0)
    torch.testing.assert_close(w2, down_proj, rtol=0, atol=0)
    wgu2, wd2 = moe.from_torchtitan(w1, w2, w3)
    torch.testing.assert_close(wgu2, wgu, rtol=0, atol=0)
    torch.testing.assert_close(wd2, wd, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ block layout
@pytest.mark.parametrize("B", [1, 4, 32])
def test_block_layout_groups_every_item_once(B: int) -> None:
    g = torch.tensor([2, 0, 2, 2, 4, 0, 2, 2, 5])  # group 1 and 3 empty, 5 >= num_groups: dropped
    lay = moe.block_layout(g, num_groups=5, block_size=B, pad=99)
    table, starts = lay.table.long(), lay.block_start[0].long()
    counts = torch.bincount(g[g < 5], minlength=5)
    assert torch.equal(starts[1:] - starts[:-1], (counts + B - 1) // B)
    # static bound from the item count (the dropped item included: no host read of the values)
    assert lay.num_blocks == layout.max_blocks(9, 5, B) >= int(starts[-1])
    seen = []
    for grp in range(5):
        items = table[starts[grp]:starts[grp + 1]].reshape(-1)
        items = items[items != 99]
        assert torch.equal(g[items], torch.full_like(items, grp))
        assert torch.equal(items, items.sort().values)  # stable: original order kept
        seen += items.tolist()
    assert sorted(seen) == [i for i in range(9) if g[i] < 5]
    assert bool((table[int(starts[-1]):] == 99).all())


def test_max_blocks_is_the_worst_case() -> None:
    # one item in each of E-1 groups and the rest in one group
    n, G, B = 50, 7, 8
    g = torch.tensor([0, 1, 2, 3, 4, 5] + [6] * (n - 6))
    lay = moe.block_layout(g, G, B, pad=n)
    assert int(lay.block_start[0, -1]) == lay.num_blocks == layout.max_blocks(n, G, B)


# ---------------------------------------------------------------------------- grouped_mm reference
def _per_group_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[g])
        start = end
    out.append(torch.zeros(x.shape[0] - start, w.shape[2], dtype=x.dtype))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mm_ref_matches_torch_grouped_mm(dtype: torch.dtype) -> None:
    x, w = rand(29, 16, dtype=dtype), rand(4, 16, 24, dtype=dtype, seed=5)
    offs = torch.tensor([5, 5, 17, 26], dtype=torch.int32)  # an empty group, 3 rows past the end
    ref = moe.grouped_mm_ref(x, w, offs)
    torch_ = torch._grouped_mm(x, w, offs=offs)
    check_oracle("grouped_mm_ref", ref[:26], torch_[:26], _per_group_loop(x.double(), w.double(), offs)[:26])
    assert bool((ref[26:] == 0).all())


def test_grouped_mm_bwd_ref_matches_autograd() -> None:
    x = rand(29, 16).double().requires_grad_()
    w = rand(4, 16, 24, seed=5).double().requires_grad_()
    offs = torch.tensor([5, 5, 17, 26], dtype=torch.int32)
    g = rand(29, 24, seed=6)
    _per_group_loop(x, w, offs).backward(g.double())
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    _per_group_loop(x32, w32, offs).backward(g)
    gx, gw = moe.grouped_mm_bwd_ref(x.detach().float(), w.detach().float(), offs, g)
    check_oracle("grad_x", gx, x32.grad, x.grad)
    check_oracle("grad_w", gw, w32.grad, w.grad)
    assert bool((gx[26:] == 0).all()) and bool((gw[1] == 0).all())


# ---------------------------------------------------------------------------- moe reference oracles
def _naive_moe(x, idx, tw, wgu, wd):
    """Obvious per-(token, k) loop in the caller's precision."""
    inter = wd.shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            gu = x[t] @ wgu[e]
            out[t] = out[t] + tw[t, k] * ((torch.nn.functional.silu(gu[:inter]) * gu[inter:]) @ wd[e])
    return out


def _hf_experts(E: int, H: int, inter: int, wgu: torch.Tensor, wd: torch.Tensor):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(cfg).to(wgu.dtype)
    gate_up_proj, down_proj = moe.to_hf_v5(wgu, wd)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up_proj)
        experts.down_proj.copy_(down_proj)
    return experts


def test_moe_ref_matches_naive_loop_fp64() -> None:
    T, H, inter, E, K = 9, 12, 7, 5, 3
    x = rand(T, H).double()
    wgu, wd = (w.double() for w in expert_weights(E, H, inter, torch.float32))
    idx, tw = routing(T, E, K)
    expected = _naive_moe(x, idx, tw.double(), wgu, wd)
    got = moe.moe_experts_ref(x.float(), idx, tw, wgu.float(), wd.float())
    check_oracle("moe_experts_ref", got, _naive_moe(x.float(), idx, tw, wgu.float(), wd.float()), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_ref_matches_hf_qwen3_moe_experts(dtype: torch.dtype) -> None:
    T, H, inter, E, K = 16, 32, 24, 6, 2
    x = rand(T, H, dtype=dtype)
    wgu, wd = expert_weights(E, H, inter, dtype)
    idx, tw = routing(T, E, K)
    with torch.no_grad():
        hf = _hf_experts(E, H, inter, wgu, wd)(x, idx, tw.to(dtype))
        # the oracle: transformers' experts in fp64 on the same (dtype-valued) inputs
        hf64 = _hf_experts(E, H, inter, wgu.double(), wd.double())(x.double(), idx, tw.to(dtype).double())
    got = moe.moe_experts_ref(x, idx, tw.to(dtype), wgu, wd)
    # bf16: the reference rounds h and w*y to bf16 (the kernel's rounding points); transformers' bf16
    # path rounds more often (gate/up, every index_add_ step)
    check_oracle("moe_experts_ref", got, hf, hf64)


def test_moe_ref_matches_hf_sparse_moe_block_end_to_end() -> None:
    """Router from HF's Qwen3MoeSparseMoeBlock, experts from the reference on converted weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                         norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = rand(2, 5, 32)
    with torch.no_grad():
        expected = block(x).reshape(10, 32)
        expected64 = copy.deepcopy(block).double()(x.double()).reshape(10, 32)
        _, tw, idx = block.gate(x.reshape(10, 32))
        assert torch.equal(copy.deepcopy(block).double().gate(x.reshape(10, 32).double())[2], idx)  # same routing
    wgu, wd = moe.from_hf_v5(block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())
    check_oracle("moe_experts_ref", moe.moe_experts_ref(x.reshape(10, 32), idx, tw, wgu, wd), expected, expected64)


def test_moe_bwd_ref_matches_hf_autograd_fp32() -> None:
    T, H, inter, E, K = 12, 16, 10, 5, 2
    x = rand(T, H)
    wgu, wd = expert_weights(E, H, inter, torch.float32)
    idx, tw = routing(T, E, K)
    g = rand(T, H, seed=9)
    got = moe.moe_experts_bwd_ref(x, idx, tw, wgu, wd, g)
    for name, a, b, o in zip(("grad_x", "grad_topk_weights", "grad_w_gate_up", "grad_w_down"), got,
                             _hf_experts_grads(x, idx, tw, wgu, wd, g, torch.float32),
                             _hf_experts_grads(x, idx, tw, wgu, wd, g, F64)):
        check_oracle(f"moe_experts_bwd_ref {name}", a, b, o)


def _hf_experts_grads(x, idx, tw, wgu, wd, g, dt):
    """Autograd through transformers' experts at dtype dt: (grad_x, grad_topk_weights, grad_w_gate_up,
    grad_w_down), the weight gradients in the kernel layout."""
    hf = _hf_experts(wgu.shape[0], x.shape[1], wd.shape[1], wgu.to(dt), wd.to(dt))
    xl, twl = x.detach().to(dt).requires_grad_(), tw.detach().to(dt).requires_grad_()
    hf(xl, idx, twl).backward(g.to(dt))
    return (xl.grad, twl.grad, *moe.from_hf_v5(hf.gate_up_proj.grad, hf.down_proj.grad))


# ------------------------------------------------------------------------------ kernels vs refs
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GMM_CASES)
def test_grouped_mm_kernel_matches_ref(case: str, dtype: torch.dtype) -> None:
    M, K, N, offs, B = GMM_CASES[case]
    x, w = rand(M, K, dtype=dtype, scale=K ** -0.5), rand(len(offs), K, N, dtype=dtype, seed=4)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    g = rand(M, N, dtype=dtype, seed=7, scale=N ** -0.5)
    out = moe.grouped_mm(x, w, offs_t, block_size=B)
    O.check_all(("out",), out, lambda dt: O.grouped_mm(x, w, offs_t, dt), dtype)
    assert bool((out[offs[-1]:] == 0).all())  # rows past the last offset
    O.check_grouped_mm_bwd(moe.grouped_mm_bwd(x, w, offs_t, g, block_size=B), x, w, offs_t, g, dtype)


def test_tail_width_split() -> None:
    # expert: used rows -> blocks of 128 [full..., tail width]: 0: 150 -> [128, 64]; 1: 64 -> [64];
    # 2: 65 -> [96]; 3: 128 -> [128]; 4: empty; 5: 97 -> [128]
    idx = torch.tensor([0] * 150 + [1] * 64 + [2] * 65 + [3] * 128 + [5] * 97).view(-1, 1)
    lay, split = layout.tail_layout(idx, 6, 128)
    assert lay.table.equal(layout.moe_layout(idx, 6, 128)[0].table)  # LNC=1: the plain slot layout
    split = split[0].tolist()
    start, b96, b64 = split[:7], split[7:14], split[14:]
    assert start == [0, 2, 3, 4, 5, 5, 6]
    assert b96 == [1, 2, 3, 5, 5, 6, 6]  # end of the full-width blocks
    assert b64 == [1, 2, 4, 5, 5, 6, 6]  # end of the 96-wide blocks; then 64-wide up to start[e+1]


def test_flagged_block_tables() -> None:
    """The forward's per-block tables: the ids in the kernel's layout, then three flags from the
    block's run width r (r > 64 | r <= 64 | r > one 128-row sub-tile), the same on every partition;
    row NB (padding) and unused blocks count as 64 rows."""
    idx = torch.tensor([0] * 150 + [1] * 64 + [2] * 65 + [3] * 128 + [5] * 97).view(-1, 1)
    lay, token = layout.moe_layout(idx, 6, 128)  # run widths (test above): 128, 64 | 64 | 96 | 128 | 128
    NB = lay.table.shape[0]
    table = torch.cat([token, torch.zeros_like(token[:1])])
    got = layout.flagged(table, layout.tail_layout(idx, 6, 128)[1], 6)
    assert got.shape == (NB + 1, 128, 4)
    assert got[:, :, 1:].eq(got[:, :1, 1:]).all()
    assert got[:, 0, 1].tolist() == [1, 0, 0, 1, 1, 1] + [0] * (NB - 5)
    assert got[:, 0, 2].tolist() == [0, 1, 1, 0, 0, 0] + [1] * (NB - 5)
    assert got[:, 0, 3].tolist() == [0] * (NB + 1)  # no block is wider than one sub-tile
    assert got[:, :, 0].equal(table)  # [NB + 1, B] -> [NB + 1, rows, nsub] (one sub-tile here)
    # B = 512: expert 0 has 600 slots (a full block + a 128-wide tail), expert 1 40 (a 64-wide tail)
    idx = torch.tensor([0] * 600 + [1] * 40).view(-1, 1)
    lay, token = layout.moe_layout(idx, 2, 512)
    got = layout.flagged(torch.cat([token, token[:1]]), layout.tail_layout(idx, 2, 512)[1], 2)
    assert got.shape == (lay.table.shape[0] + 1, 128, 7)
    assert got[:4, 0, 4:].tolist() == [[1, 0, 1], [1, 0, 0], [0, 1, 0], [0, 1, 0]]
    assert got[0, :, :4].equal(token[0].view(4, 128).T)  # position sub*128 + p at [p, sub]


def test_moe_experts_gathers_only_what_each_block_reads() -> None:
    """Gathers and scatters move as many rows as their block runs at (64 or a multiple of 128): B = 512,
    expert 0 with 600 slots (a full block + a 128-wide tail), expert 1 with 40 (one 64-wide block);
    plus 64 padding rows each for the last block's look-ahead gather and the first block's scatter
    (of no block yet)."""
    from trnkit.nkisim import trace

    H, inter = 128, 64
    idx = torch.tensor([0] * 600 + [1] * 40).view(-1, 1)
    x = rand(640, H)
    wgu, wd = expert_weights(2, H, inter, torch.float32)
    with trace.record() as tr:
        out = moe.moe_experts(x, idx, torch.ones(640, 1), wgu, wd, block_size=512)
    moved = {"sbuf": 0, "shared_hbm": 0}
    for i in tr:
        if i.op == "dma_copy" and i.attrs["indirect"]:
            moved[i.operands[0].buffer] += max(o.shape[0] for o in i.operands if o.buffer == "sbuf")
    assert moved == {"sbuf": 512 + 128 + 64 + 64, "shared_hbm": 64 + 512 + 128 + 64}
    assert torch.allclose(out, moe.moe_experts_ref(x, idx, torch.ones(640, 1), wgu, wd), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_experts_kernel_matches_ref(case: str, dtype: torch.dtype) -> None:
    x, idx, tw, wgu, wd, B = moe_inputs(case, dtype)
    out = moe.moe_experts(x, idx, tw, wgu, wd, block_size=B)
    assert out.dtype == dtype and out.shape == x.shape
    O.check_all(("out",), out, lambda dt: O.experts(x, idx, tw, wgu, wd, dt), dtype)


def test_moe_experts_accepts_int32_topk_idx() -> None:
    """router_topk returns int32 indices; the kernel must route them exactly like int64 ones."""
    x, idx, tw, wgu, wd, B = moe_inputs("prime_E", torch.float32)
    out = moe.moe_experts(x, idx.to(torch.int32), tw, wgu, wd, block_size=B)
    assert torch.equal(out, moe.moe_experts(x, idx, tw, wgu, wd, block_size=B))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["tails", "T1", "all_to_one_expert", "empty_experts", "K_equals_E",
                                  "prime_E", "odd_H_I", "block_256", "full_plus_half_128", "block_512", "big_I"])
def test_moe_experts_bwd_kernel_matches_ref(case: str, dtype: torch.dtype) -> None:
    x, idx, tw, wgu, wd, B = moe_inputs(case, dtype)
    g = rand(*x.shape, dtype=dtype, seed=11)
    got = moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=B)
    ref = moe.moe_experts_bwd_ref(x, idx, tw, wgu, wd, g)
    for name, a, b in zip(("grad_x", "grad_topk_weights", "grad_w_gate_up", "grad_w_down"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
    O.check_experts_bwd(got, x, idx, tw, wgu, wd, g, dtype)
    if case == "empty_experts":  # experts 1 and 4 got no tokens
        assert bool((got[2][[1, 4]] == 0).all()) and bool((got[3][[1, 4]] == 0).all())


@pytest.mark.parametrize("case", ["empty_experts", "block_256"])
def test_moe_bwd_data_path_hands_exact_zero_padding_rows_to_the_weight_gradients(case: str, monkeypatch) -> None:
    """The data-path kernel's contract with the weight-gradient kernel: ``w*h`` and ``dgu`` in dispatch
    order, every used position equal to the reference's rows, every padding position of a used block an
    exact zero (the weight-gradient kernel sums over all rows of a tile)."""
    x, idx, tw, wgu, wd, B = moe_inputs(case, torch.float32)
    g = rand(*x.shape, seed=11)
    seen = {}
    real = moe._expert_weight_grads

    def spy(x_, go_, hw, dgu, lay, *rest):
        seen.update(hw=hw.clone(), dgu=dgu.clone(), lay=lay)
        return real(x_, go_, hw, dgu, lay, *rest)

    monkeypatch.setattr(moe, "_expert_weight_grads", spy)
    moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=B)
    lay = seen["lay"]
    T, K = idx.shape
    inter = wd.shape[1]
    slot = lay.table.long()
    nb_used = int(lay.block_start[0, -1])
    used = slot[:nb_used] < T * K
    # the reference's rows: w*h and dgu of each slot (fp32: the kernel's rounding points are exact)
    s = slot[:nb_used][used]
    tok, k = s // K, s % K
    e = idx.reshape(-1)[s]
    gu = torch.einsum("nh,nhj->nj", x[tok], wgu[e])
    h, dh_da, dh_du = moe.activation_ref(gu[:, :inter], gu[:, inter:])
    dA = torch.einsum("nh,nih->ni", g[tok], wd[e])
    w = tw[tok, k][:, None]
    for name, want in (("hw", w * h), ("dgu", torch.cat([w * dA * dh_da, w * dA * dh_du], 1))):
        got = seen[name][:nb_used]
        assert bool((got[~used] == 0).all()), f"{name}: padding rows must be exact zeros"
        torch.testing.assert_close(got[used], want, rtol=1e-4, atol=1e-5)


def test_moe_experts_bwd_kernel_matches_autograd_of_hf_fp32() -> None:
    """End to end: the NKI backward against autograd through transformers' experts."""
    x, idx, tw, wgu, wd, B = moe_inputs("tails", torch.float32)
    g = rand(*x.shape, seed=12)
    got = moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=B)
    for name, a, b, o in zip(("grad_x", "grad_topk_weights", "grad_w_gate_up", "grad_w_down"), got,
                             _hf_experts_grads(x, idx, tw, wgu, wd, g, torch.float32),
                             _hf_experts_grads(x, idx, tw, wgu, wd, g, F64)):
        check_oracle(name, a, b, o)


@settings(max_examples=6, deadline=None)
@given(T=st.integers(1, 40), H=st.integers(8, 140), inter=st.integers(4, 70), E=st.integers(1, 6),
       K=st.integers(1, 4), B=st.sampled_from([32, 64, 128]), seed=st.integers(0, 1000))
def test_moe_experts_kernel_hypothesis(T: int, H: int, inter: int, E: int, K: int, B: int, seed: int) -> None:
    K = min(K, E)
    x = rand(T, H, seed=seed)
    wgu, wd = expert_weights(E, H, inter, torch.float32, seed=seed + 1)
    idx, tw = routing(T, E, K, seed=seed + 2)
    O.check_all(("out",), moe.moe_experts(x, idx, tw, wgu, wd, block_size=B),
                lambda dt: O.experts(x, idx, tw, wgu, wd, dt), torch.float32)


@settings(max_examples=5, deadline=None)
@given(M=st.integers(1, 60), K=st.integers(1, 140), N=st.integers(1, 600), G=st.integers(1, 4),
       seed=st.integers(0, 1000), data=st.data())
def test_grouped_mm_kernel_hypothesis(M: int, K: int, N: int, G: int, seed: int, data) -> None:
    ends = sorted(data.draw(st.lists(st.integers(0, M), min_size=G, max_size=G)))
    offs = torch.tensor(ends, dtype=torch.int32)
    x, w = rand(M, K, seed=seed, scale=K ** -0.5), rand(G, K, N, seed=seed + 1)
    g = rand(M, N, seed=seed + 2, scale=N ** -0.5)
    O.check_all(("out",), moe.grouped_mm(x, w, offs, block_size=32), lambda dt: O.grouped_mm(x, w, offs, dt),
                torch.float32)
    O.check_grouped_mm_bwd(moe.grouped_mm_bwd(x, w, offs, g, block_size=32), x, w, offs, g, torch.float32)


# ---------------------------------------------------------------------------------- constraints
def _good_moe() -> dict:
    x, idx, tw, wgu, wd, _ = moe_inputs("T1", torch.float32)
    return dict(x=x, topk_idx=idx, topk_weights=tw, w_gate_up=wgu, w_down=wd, block_size=32)


MOE_VALUE_RULES = ("idx_out_of_range", "idx_negative")  # data, checked at the entry, not by constraints()
MOE_BAD = {
    "block_size": (lambda a: a.update(block_size=48), "block_size in"),
    "E_too_big": (lambda a: a.update(w_gate_up=torch.zeros(513, 64, 4), w_down=torch.zeros(513, 2, 64),
                                     topk_idx=torch.zeros(1, 2, dtype=torch.int64)), "1 <= E <= 512"),
    "K_too_big": (lambda a: a.update(w_gate_up=torch.zeros(16, 64, 64), w_down=torch.zeros(16, 32, 64),
                                     topk_idx=torch.arange(9).view(1, 9), topk_weights=torch.ones(1, 9)),
                  "1 <= K <= min(8, E)"),
    "K_gt_E": (lambda a: a.update(topk_idx=torch.tensor([[0, 1, 2, 3, 0]]), topk_weights=torch.ones(1, 5)),
               "1 <= K <= min(8, E)"),  # E = 4
    "idx_out_of_range": (lambda a: a.update(topk_idx=torch.tensor([[0, 4]])), "0 <= topk_idx < E"),
    "idx_negative": (lambda a: a.update(topk_idx=torch.tensor([[-1, 2]])), "0 <= topk_idx < E"),
    "I2_odd": (lambda a: a.update(w_gate_up=torch.zeros(4, 64, 65)), "w_gate_up.shape[2] == 2 * I is even"),
    "T_zero": (lambda a: a.update(x=torch.zeros(0, 64), topk_idx=torch.zeros(0, 2, dtype=torch.int64),
                                  topk_weights=torch.zeros(0, 2)), "T >= 1"),
    "weights_dtype": (lambda a: a.update(topk_weights=a["topk_weights"].half()), "topk_weights.dtype"),
    "w_3d": (lambda a: a.update(w_down=torch.zeros(4, 32)), "w_down is 3-D"),
    "idx_dtype": (lambda a: a.update(topk_idx=a["topk_idx"].float()), "topk_idx.dtype"),
    "dtype_fp16": (lambda a: a.update(x=a["x"].half()), "x.dtype in (float32, bfloat16)' violated (got 'float16')"),
    "mixed_dtypes": (lambda a: a.update(w_down=a["w_down"].bfloat16()), "share one dtype"),
    "H_mismatch": (lambda a: a.update(x=torch.zeros(1, 65)), "w_gate_up.shape[1] == H"),
    "w_down_shape": (lambda a: a.update(w_down=torch.zeros(4, 31, 64)), "w_down.shape == (E, I, H)"),
    "x_3d": (lambda a: a.update(x=torch.zeros(1, 1, 64)), "x is 2-D"),
    "weights_shape": (lambda a: a.update(topk_weights=torch.ones(1, 3)), "topk_idx and topk_weights are [T, K]"),
    "sbuf_budget": (lambda a: a.update(x=torch.zeros(1, 2048), w_gate_up=torch.zeros(4, 2048, 1536),
                                       w_down=torch.zeros(4, 768, 2048)), "fit 96 KiB of SBUF"),
}


@pytest.mark.parametrize("bad", MOE_BAD)
def test_moe_constraint_violations_raise_clear_errors(bad: str) -> None:
    args = _good_moe()
    assert moe.moe_experts_constraints(**args) == []
    mutate, text = MOE_BAD[bad]
    mutate(args)
    with pytest.raises(KernelConstraintError, match="moe_experts") as err:
        moe.moe_experts(**args)
    assert text in str(err.value)
    assert "got " in str(err.value)  # the offending value is named
    with pytest.raises(KernelConstraintError, match="moe_experts"):
        moe.moe_experts_ref(**args)
    shape_only = moe.moe_experts_constraints(**args)
    assert (shape_only == []) == (bad in MOE_VALUE_RULES)


ZERO_WIDTHS = {  # rule, widths, kernel entry points, their inputs; the references compute these (empty products)
    "gmm_N0": ("grouped_mm", "K, N >= 1", (4, 0), (moe.grouped_mm, moe.grouped_mm_bwd),
               (torch.zeros(3, 4), torch.zeros(2, 4, 0), torch.tensor([1, 3], dtype=torch.int32))),
    "gmm_K0": ("grouped_mm", "K, N >= 1", (0, 4), (moe.grouped_mm, moe.grouped_mm_bwd),
               (torch.zeros(3, 0), torch.zeros(2, 0, 4), torch.tensor([1, 3], dtype=torch.int32))),
    "moe_I0": ("moe_experts", "H, I >= 1", (4, 0), (moe.moe_experts, moe.moe_experts_bwd),
               (torch.zeros(3, 4), torch.tensor([[0], [1], [0]]), torch.ones(3, 1), torch.zeros(2, 4, 0),
                torch.zeros(2, 0, 4))),
    "moe_H0": ("moe_experts", "H, I >= 1", (0, 2), (moe.moe_experts, moe.moe_experts_bwd),
               (torch.zeros(3, 0), torch.tensor([[0], [1], [0]]), torch.ones(3, 1), torch.zeros(2, 0, 4),
                torch.zeros(2, 2, 0))),
}


@pytest.mark.parametrize("case", ZERO_WIDTHS)
def test_kernel_entry_points_refuse_zero_widths(case: str) -> None:
    """A width of 0 (grouped_mm's K or N, moe_experts' H or I) is refused by the NKI entry points themselves,
    naming the op, the rule and the widths, instead of stopping deep in the kernel ('nl.ndarray: ... shape
    (128, 0) must be positive ints'); the shape rules the references share let it through."""
    op, rule, widths, entries, args = ZERO_WIDTHS[case]
    x, w = args[0], args[1] if op == "grouped_mm" else args[3]
    assert moe.zero_width_violations(op, x, w) == [
        Violation(op, rule, widths, "a kernel tile row has at least one element")]
    assert moe.constraints(*args) == []
    grad_out = torch.zeros(3, w.shape[2]) if op == "grouped_mm" else torch.zeros_like(x)
    for entry, extra in zip(entries, ((), (grad_out,)), strict=True):
        with pytest.raises(KernelConstraintError) as err:
            entry(*args, *extra)
        assert str(err.value) == (f"{op}: constraint '{rule}' violated (got {widths}): "
                                  "a kernel tile row has at least one element")


def test_moe_bwd_checks_grad_out_shape_and_dtype() -> None:
    args = _good_moe()
    with pytest.raises(KernelConstraintError, match=r"moe_experts: .*grad_out.shape == \(T, H\)"):
        moe.moe_experts_bwd(grad_out=torch.zeros(2, 64), **args)
    with pytest.raises(KernelConstraintError, match=r"moe_experts: .*grad_out.dtype in \(float32, bfloat16\)"):
        moe.moe_experts_bwd(grad_out=torch.zeros(1, 64, dtype=torch.float16), **args)
    with pytest.raises(KernelConstraintError, match=r"moe_experts: .*share one dtype"):
        moe.moe_experts_bwd_ref(grad_out=torch.zeros(1, 64, dtype=torch.bfloat16), **args)


GMM_VALUE_RULES = ("offs_decreasing", "offs_past_M", "offs_negative")
GMM_BAD = {
    "offs_dtype": (dict(offs=torch.tensor([2, 5])), "group_offsets.dtype == int32' violated (got 'int64')"),
    "offs_decreasing": (dict(offs=torch.tensor([4, 2], dtype=torch.int32)), "non-decreasing"),
    "offs_past_M": (dict(offs=torch.tensor([2, 9], dtype=torch.int32)), "group_offsets[-1] <= M"),
    "offs_negative": (dict(offs=torch.tensor([-1, 2], dtype=torch.int32)), "non-decreasing and >= 0"),
    "offs_len": (dict(offs=torch.tensor([2], dtype=torch.int32)), "len(group_offsets) == w.shape[0]"),
    "offs_2d": (dict(offs=torch.tensor([[2, 5]], dtype=torch.int32)), "group_offsets is 1-D"),
    "w_2d": (dict(w=torch.zeros(8, 4)), "w is 3-D"),
    "G_too_big": (dict(w=torch.zeros(513, 8, 1), offs=torch.arange(513, dtype=torch.int32).clamp(max=6)),
                  "1 <= G <= 512"),
    "mixed_dtypes": (dict(w=torch.zeros(2, 8, 4, dtype=torch.bfloat16)), "share one dtype"),
    "K_mismatch": (dict(w=torch.zeros(2, 7, 4)), "w.shape[1] == x.shape[1]"),
    "x_1d": (dict(x=torch.zeros(8)), "x is 2-D"),
    "dtype": (dict(x=torch.zeros(6, 8).half()), "x.dtype in (float32, bfloat16)' violated (got 'float16')"),
    "sbuf_budget": (dict(x=torch.zeros(6, 4096), w=torch.zeros(2, 4096, 1024)), "fit 96 KiB of SBUF"),
}


@pytest.mark.parametrize("bad", GMM_BAD)
def test_grouped_mm_constraint_violations_raise_clear_errors(bad: str) -> None:
    args = dict(x=torch.zeros(6, 8), w=torch.zeros(2, 8, 4), offs=torch.tensor([2, 5], dtype=torch.int32))
    assert moe.grouped_mm_constraints(args["x"], args["w"], args["offs"]) == []
    change, text = GMM_BAD[bad]
    args.update(change)
    with pytest.raises(KernelConstraintError, match="grouped_mm") as err:
        moe.grouped_mm(args["x"], args["w"], args["offs"])
    assert text in str(err.value) and "got " in str(err.value)
    with pytest.raises(KernelConstraintError, match="grouped_mm"):
        moe.grouped_mm_ref(args["x"], args["w"], args["offs"])
    # constraints() is shape/dtype-only; the value rules are the entry's own check
    shape_only = moe.constraints(args["x"], args["w"], args["offs"])  # the dispatching entry
    assert shape_only == moe.grouped_mm_constraints(args["x"], args["w"], args["offs"])
    assert (shape_only == []) == (bad in GMM_VALUE_RULES)
    if bad in GMM_VALUE_RULES:
        assert moe.grouped_mm_value_violations(args["x"], args["offs"])


def test_constraints_read_no_values() -> None:
    """constraints(...) must work on meta tensors (no storage; any value read raises): what the
    override registry's selection sees under fake tensors / torch.compile."""
    m = dict(device="meta")
    x, idx, tw = torch.empty(5, 64, **m), torch.empty(5, 2, dtype=torch.int64, **m), torch.empty(5, 2, **m)
    wgu, wd = torch.empty(4, 64, 64, **m), torch.empty(4, 32, 64, **m)
    assert moe.moe_experts_constraints(x, idx, tw, wgu, wd, 32, torch.empty(5, 64, **m)) == []
    assert moe.constraints(x, idx, tw, wgu, wd) == []
    offs = torch.empty(4, dtype=torch.int32, **m)
    assert moe.grouped_mm_constraints(x, wgu, offs, torch.empty(5, 64, **m)) == []
    assert moe.constraints(x, wgu, offs) == []
    bad = moe.moe_experts_constraints(x, idx, tw, wgu, wd, 48)
    assert [v.constraint for v in bad] == ["block_size in (32, 64, 128, 256, 512)"]


# --------------------------------------------------------------------------------- cost model
def _cost_of_moe_experts(T: int, H: int, inter: int, E: int, K: int, block_size: int = moe.FWD_BLOCK_SIZE,
                         idx: torch.Tensor | None = None):
    from trnkit.nkisim import cost, trace

    x = rand(T, H, dtype=torch.bfloat16)
    wgu, wd = expert_weights(E, H, inter, torch.bfloat16)
    probs = torch.softmax(rand(T, E, seed=3), -1)
    tw, top = probs.topk(K, -1)
    idx = top if idx is None else idx
    with trace.record(trace_only=True) as tr:
        moe.moe_experts(x, idx, tw, wgu, wd, block_size=block_size)
    rep = cost.estimate(tr, chip="trn2")
    tensor_bound_ns = 2 * T * K * 3 * H * inter / 79e3  # useful FLOPs / 79 TFLOPS (bf16, one NeuronCore)
    return tr, rep, tensor_bound_ns


def test_moe_experts_trace_visits_only_used_blocks() -> None:
    """Balanced routing, 128 slots per expert: one block per expert, no padding work, weights once."""
    T, H, inter, E, K = 256, 256, 128, 4, 2
    idx = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1)
    tr, rep, bound = _cost_of_moe_experts(T, H, inter, E, K, block_size=128, idx=idx)
    ops = tr.by_op()
    # per block: H/128 chunks of x transposed on the Tensor Engine (the first block's by the prologue,
    # block i+1's by block i, the last block's look-ahead padding row too); 2 (gate, up) x H/128 x I/128 +
    # I/128 x ceil(H/512) matmuls; combine: T / (128 // K) tiles x ceil(H/512) matmuls
    pe = [i for i in tr if i.op == "nc_transpose" and i.engine == "tensor"]
    dve = [i for i in tr if i.op == "nc_transpose" and i.engine == "vector"]
    assert len(pe) == (E + 1) * 2 and not dve
    assert ops["nc_matmul"] == E * (2 * 2 * 1 + 1 * 1) + T // 64
    # weights: one DMA per 128-row chunk of w_gate_up[e] (H/128 = 2) and w_down[e] (I/128 = 1)
    assert len(weight_dmas(tr)) == 3 * E
    assert rep.total_ns >= bound


def test_expert_weight_grads_gather_each_row_once() -> None:
    """Both weight gradients in one launch: per 128-row tile of an expert, x and grad_out rows are
    gathered once (not once per PSUM pass), no gathered tile is zero-filled, no zero matmul opens an
    accumulation group, and only an empty expert writes zeros."""
    from trnkit.nkisim import trace

    T, H, inter, E, B = 200, 256, 192, 4, 128
    idx = torch.stack([torch.arange(T) % 3, (torch.arange(T) + 1) % 3], 1)  # top-2; expert 3 empty
    x, g = rand(T, H, dtype=torch.bfloat16), rand(T, H, dtype=torch.bfloat16, seed=5)
    lay, _ = layout.moe_layout(idx, E, B)
    hw = rand(lay.num_blocks, B, inter, dtype=torch.bfloat16, seed=6)
    dgu = rand(lay.num_blocks, B, 2 * inter, dtype=torch.bfloat16, seed=7)
    with trace.record() as tr:
        moe._expert_weight_grads(x, g, hw, dgu, lay, idx, lnc=1)
    tiles = 3 * 2  # 133 or 134 slots per used expert: 2 row tiles each
    per_tile = 2 * 1 + 2 * 1  # output tiles: down 2 I-chunks x 1 H-piece; gate/up 2 H-chunks x 1 2I-piece
    ops = tr.by_op()
    gathers = [i for i in tr if i.op == "dma_copy" and i.attrs["indirect"]]
    assert len(gathers) == 2 * tiles
    assert ops["nc_matmul"] == per_tile * tiles
    assert all(i.partitions == 128 or i.op != "nc_matmul" for i in tr)  # no 1-row zero matmuls
    assert ops.get("memset", 0) == 2  # the two zero tiles of empty experts, nothing else
    stores = [i for i in tr if i.op == "dma_copy" and i.operands[0].buffer != "sbuf"]
    assert len(stores) == 4 * 4  # per expert 2 + 2 row chunks of 128; expert 3's are zeros


def test_weight_grad_passes_hold_whole_row_chunks() -> None:
    """PSUM passes of at most 4 output tiles [128, 512]; whole 128-row chunks where they fit, so every
    chunk is stored as full rows (Qwen3-30B-A3B: grad_w_down 6 passes of 4, grad_w_gate_up 16 of 3)."""
    from trnkit.kernels.moe import moe_grouped_mm as KG

    class G:  # only .shape is read
        def __init__(self, *shape):
            self.shape = shape

    passes = KG.wgrad_passes([G(128, 768, 2048), G(128, 2048, 1536), G(4, 300, 100), G(4, 128, 2600)])
    sizes = [(p, len(tl)) for p, tl in passes]
    assert sizes == [(0, 4)] * 6 + [(1, 3)] * 16 + [(2, 3)] + [(3, 4), (3, 2)]
    for p, tl in passes:
        if p < 3:  # whole chunks: every chunk in a pass has all its pieces
            for k0, kw, n0, nw in tl:
                assert sum(t[3] for t in tl if t[0] == k0) == [2048, 1536, 100][p]
    tiles = [(p, *t) for p, tl in passes for t in tl]
    assert len(tiles) == len(set(tiles)) == 6 * 4 + 16 * 3 + 3 * 1 + 1 * 6  # every tile once


@pytest.mark.parametrize("cache", ["none", "two_slots"])
def test_weight_grads_do_not_depend_on_the_row_cache(monkeypatch: pytest.MonkeyPatch, cache: str) -> None:
    """The weight-gradient kernels keep up to WGRAD_MAX_SLOTS row tiles of a group in SBUF and gather
    the rest again in every pass (all of them when no tile fits): the fp32 sums run in the same order,
    so the gradients are bit-identical to the default -- for groups with more tiles than slots (10
    tiles of 32 rows; 5 of 128), partial tiles, empty groups."""
    from trnkit.kernels.moe import moe_grouped_mm as KG

    M, Kd, N, offs, B = 330, 96, 600, [0, 300, 300, 330], 32
    x, w = rand(M, Kd, scale=Kd ** -0.5), rand(len(offs), Kd, N, seed=4)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    go = rand(M, N, seed=7, scale=N ** -0.5)
    xm, idx, tw, wgu, wd, Bm = moe_inputs("block_512", torch.bfloat16)
    gm = rand(*xm.shape, dtype=torch.bfloat16, seed=11)
    want_gmm = moe.grouped_mm_bwd(x, w, offs_t, go, block_size=B)
    want_moe = moe.moe_experts_bwd(xm, idx, tw, wgu, wd, gm, block_size=Bm)
    row_bytes = (Kd + N) * 4 + 4  # grouped_mm fp32: one tile of x and grad_out rows + its id
    monkeypatch.setattr(KG, "WGRAD_CACHE_BYTES", 1 if cache == "none" else 2 * row_bytes)
    assert KG.wgrad_slots(row_bytes) == (0 if cache == "none" else 2)
    got_gmm = moe.grouped_mm_bwd(x, w, offs_t, go, block_size=B)
    assert torch.equal(got_gmm[1], want_gmm[1])
    got_moe = moe.moe_experts_bwd(xm, idx, tw, wgu, wd, gm, block_size=Bm)
    assert torch.equal(got_moe[2], want_moe[2]) and torch.equal(got_moe[3], want_moe[3])
    O.check_grouped_mm_bwd(got_gmm, x, w, offs_t, go, torch.float32)


@pytest.mark.slow
def test_moe_experts_cost_qwen3_30b_a3b() -> None:
    """moe_experts at Qwen3-30B-A3B shapes vs the TensorE bound (a minute or two). The target is 70%
    at the pessimistic end of the range; the per-engine bound there is 76.2% (docs/kernel-design.md,
    "Feasibility of moe_experts at the pessimistic end"). The kernel reached 75.2% / 78.7% (pessimistic /
    mid) with this test's routing when written; this guards both ends a little below, so a
    regression of the tiling (128-column matmuls, GpSimd zero fills, a scatter in front of the next
    gather, gathers not one block ahead, scatters of padding sub-tiles, late weight loads) fails it."""
    _, rep, bound = _cost_of_moe_experts(T=8192, H=2048, inter=768, E=128, K=8)
    low, mid, high = rep.total_range_ns
    print(rep, f"\nuseful-FLOP TensorE bound {bound / 1e6:.3f} ms -> {bound / high:.1%} / {bound / mid:.1%} / "
          f"{bound / low:.1%} (pessimistic / mid / optimistic)")
    assert bound / high >= 0.72 and bound / mid >= 0.76  # 128-slot-block kernel: 32.8% pessimistic, 47.3% mid


def test_backward_sbuf_constraints_are_checked() -> None:
    """Shapes whose forward fits but whose backward (a weight plus its transpose) does not."""
    bf = torch.bfloat16
    x, g = torch.zeros(2, 2048, dtype=bf), torch.zeros(2, 2048, dtype=bf)
    wgu, wd = torch.zeros(2, 2048, 2048, dtype=bf), torch.zeros(2, 1024, 2048, dtype=bf)
    idx, tw = torch.tensor([[0, 1], [1, 0]]), torch.ones(2, 2)
    assert moe.moe_experts_constraints(x, idx, tw, wgu, wd) == []
    with pytest.raises(KernelConstraintError, match="moe_experts: constraint 'backward working set fits 96 KiB"):
        moe.moe_experts_bwd(x, idx, tw, wgu, wd, g)
    xg, w = torch.zeros(4, 2048, dtype=bf), torch.zeros(2, 2048, 2048, dtype=bf)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    assert moe.grouped_mm_constraints(xg, w, offs) == []
    with pytest.raises(KernelConstraintError, match="grouped_mm: constraint 'one group's weights fit 96 KiB"):
        moe.grouped_mm_bwd(xg, w, offs, torch.zeros(4, 2048, dtype=bf))
    with pytest.raises(KernelConstraintError, match=r"grad_out.shape == \(M, N\)"):
        moe.grouped_mm_bwd(xg, w, offs, torch.zeros(3, 2048, dtype=bf))


def test_block_size_narrows_to_the_sbuf(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 H = 7168 (one expert's weights 68 KiB, inside the weight budget): a block of 512 slots keeps x.T
    (56 x 512) and two sets of four row tiles of H in SBUF, past its 208 KiB, and the backward data path its
    four dX and dgu row tiles next to the second expert's weights. The entry points narrow the block to the
    widest that fits (the results do not
    depend on it): the forward at its default 512 and the backward asked for 512 run at 128 (both used to
    stop on the interpreter's SBUF overflow at these accepted shapes)."""
    from trnkit.nkisim.errors import NkiValidationError

    T, H, inter = 1100, 7168, 91  # two experts, each a full 512-slot block and a tail
    x = rand(T, H, seed=3)
    wgu, wd = expert_weights(2, H, inter, torch.float32)
    idx, tw = routing(T, 2, 1)
    assert moe.moe_experts_constraints(x, idx, tw, wgu, wd, 512, x) == []
    assert [moe.fitting_block_size(H, inter, 512, 4, bwd) for bwd in (False, True)] == [128, 128]
    assert moe.fitting_block_size(2048, 768, 512, 2) == 512  # Qwen3-30B-A3B: the tuned sizes stay
    assert moe.fitting_block_size(2048, 768, 128, 2, True) == 128
    out = moe.moe_experts(x, idx, tw, wgu, wd)
    O.check_all(("out",), out, lambda dt: O.experts(x, idx, tw, wgu, wd, dt), torch.float32)
    g = rand(T, H, seed=11)
    O.check_experts_bwd(moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=512), x, idx, tw, wgu, wd, g,
                        torch.float32)
    monkeypatch.setattr(moe, "fitting_block_size", lambda H, inter, block_size, *_: block_size)  # no narrowing
    with pytest.raises(NkiValidationError, match="SBUF overflow"):
        moe.moe_experts(x, idx, tw, wgu, wd)
    with pytest.raises(NkiValidationError, match="SBUF overflow"):
        moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=512)


def test_block_sbuf_constraint_refuses_rows_no_block_fits() -> None:
    """fp32 H = 16384, I = 1: the weights take 65 KiB, but even a block of 32 slots' row tiles of H do not fit
    beside them (the kernel overflows SBUF at block_size=32): refused, naming the rule and the bytes."""
    x = torch.zeros(4, 16384)
    wgu, wd = torch.zeros(2, 16384, 2), torch.zeros(2, 1, 16384)
    idx, tw = torch.tensor([[0], [1], [0], [1]]), torch.ones(4, 1)
    with pytest.raises(KernelConstraintError, match=r"moe_experts: constraint 'the forward's weights and a block of 32 "
                       r"slots fit 208 KiB of SBUF per partition' violated \(got '222336 bytes \(H=16384, I=1, "
                       r"float32\)'\)"):
        moe.moe_experts(x, idx, tw, wgu, wd)
    assert moe.moe_experts_constraints(x.bfloat16(), idx, tw, wgu.bfloat16(), wd.bfloat16()) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_token_spreads_to_its_combine_tile_only(value: float, dtype: torch.dtype) -> None:
    """The documented contract (docs/kernels.md, "Non-finite inputs"): a non-finite value in one token's
    row of x makes the outputs (forward) and grad_x rows (backward) of the tokens that share a combine
    tile with its slots non-finite (the selection-matrix matmul multiplies 0 x NaN), never a finite
    value; every other row is exactly the NaN-free result. grad_topk_weights stays per row, and the
    weight gradients are non-finite exactly for the experts the token is routed to, as in the reference.
    Here K=1 (combine tiles of 128 tokens) and tokens 0..127 all go to expert 0, one block: its
    128-row sub-tile is tile 0, so the transposes' spread on the hardware stays inside it too."""
    T, H, inter, E = 300, 64, 32, 4
    x = rand(T, H, dtype=dtype)
    wgu, wd = expert_weights(E, H, inter, dtype)
    idx = torch.cat([torch.zeros(128, dtype=torch.long), 1 + torch.arange(T - 128) % 3]).view(T, 1)
    tw = torch.rand(T, 1, generator=torch.Generator().manual_seed(3)) + 0.1
    g = rand(T, H, dtype=dtype, seed=4)
    clean = moe.moe_experts(x, idx, tw, wgu, wd, block_size=128)
    clean_b = moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=128)
    x[5, 7] = value
    ref = moe.moe_experts_ref(x, idx, tw, wgu, wd)
    assert (~torch.isfinite(ref).all(1)).nonzero().flatten().tolist() == [5]  # the reference: its row only
    out = moe.moe_experts(x, idx, tw, wgu, wd, block_size=128)
    tile = torch.arange(T) < 128
    assert (~torch.isfinite(out).all(1)).equal(tile)
    assert torch.equal(out[~tile], clean[~tile])
    gx, gtw, gwgu, gwd = moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=128)
    assert (~torch.isfinite(gx).all(1)).equal(tile) and torch.equal(gx[~tile], clean_b[0][~tile])
    row5 = torch.arange(T) == 5
    assert (~torch.isfinite(gtw).all(1)).equal(row5) and torch.equal(gtw[~row5], clean_b[1][~row5])
    expert0 = torch.arange(E) == 0
    for got, before in ((gwgu, clean_b[2]), (gwd, clean_b[3])):
        assert (~torch.isfinite(got).flatten(1).all(1)).equal(expert0) and torch.equal(got[1:], before[1:])
