"""MoE kernels on a trn2 logical core (LNC=2): both physical cores split the experts, the results are
bit-identical to one core, each core loads only its own experts' weights, and both cores run the same
run-time loops and as many instructions per engine (tests/kernels/lnc_streams.py); the LNC switch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import GMM_CASES, assert_bit_identical, moe_inputs, rand, weight_dmas
from trnkit.kernels import lnc as lnc_mod
from trnkit.kernels import moe
from trnkit.kernels.moe import moe_fused
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.nki_api import nl
from tests.kernels.lnc_streams import assert_same_streams, recorded_streams

DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["tails", "T1", "all_to_one_expert", "empty_experts", "prime_E", "block_256",
                                  "tail_96", "two_experts_512"])
def test_moe_experts_lnc2_is_bit_identical_to_lnc1(case: str, dtype: torch.dtype) -> None:
    """tail_96 has E=1 (the second core has no expert), all_to_one_expert puts every block on core 0;
    two_experts_512: one expert per core, each a full 512-slot block and a 192-wide tail (the first
    core's last look-ahead gathers the second core's first block)."""
    x, idx, tw, wgu, wd, B = moe_inputs(case, dtype)
    one = moe.moe_experts(x, idx, tw, wgu, wd, block_size=B, lnc=1)
    with recorded_streams() as s:
        two = moe.moe_experts(x, idx, tw, wgu, wd, block_size=B, lnc=2)
    assert_bit_identical(two, one)
    assert_same_streams(s)
    if case in ("tails", "all_to_one_expert", "prime_E", "tail_96", "block_256"):
        g = rand(*x.shape, dtype=dtype, seed=11)
        with recorded_streams() as s:
            two = moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=B, lnc=2)
        assert_bit_identical(two, moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=B, lnc=1))
        assert_same_streams(s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(GMM_CASES))
def test_grouped_mm_lnc2_is_bit_identical_to_lnc1(case: str, dtype: torch.dtype) -> None:
    M, K, N, offs, B = GMM_CASES[case]
    x, w = rand(M, K, dtype=dtype, scale=K ** -0.5), rand(len(offs), K, N, dtype=dtype, seed=4)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    g = rand(M, N, dtype=dtype, seed=7, scale=N ** -0.5)
    with recorded_streams() as s:
        two = (moe.grouped_mm(x, w, offs_t, block_size=B, lnc=2),
               moe.grouped_mm_bwd(x, w, offs_t, g, block_size=B, lnc=2))
    assert_bit_identical(two[0], moe.grouped_mm(x, w, offs_t, block_size=B, lnc=1))
    assert_bit_identical(two[1], moe.grouped_mm_bwd(x, w, offs_t, g, block_size=B, lnc=1))
    assert_same_streams(s)


def test_each_core_loads_only_its_experts_and_meets_the_other_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """E=5: core 0 owns experts 0-2, core 1 experts 3-4 and a masked sixth (contiguous halves of the
    paired layout's 6 groups), which loads expert 4's weights again so both cores issue the same loads;
    one barrier per core before the combine, where core 1 sums a masked copy of core 0's one token tile."""
    x, idx, tw, wgu, wd, B = moe_inputs("tails", torch.bfloat16)  # T=24, K=2: 48 slots, H=160
    loaded = []
    real_load = moe_fused.load_weight

    def spy(w, g):
        loaded.append((nl.program_id(0) if nl.program_ndim() else 0, g))
        return real_load(w, g)

    monkeypatch.setattr(moe_fused, "load_weight", spy)

    def traced(lnc: int) -> tuple:
        with recorded_streams(trace_only=True) as s:
            moe.moe_experts(x, idx, tw, wgu, wd, block_size=B, lnc=lnc)
        return s, weight_dmas(s.trace)

    _, one = traced(1)
    s, two = traced(2)
    assert_same_streams(s)
    per_expert = len(one) // 5
    assert per_expert >= 1 and len(one) == 5 * per_expert
    assert [sum(i.program_id == p for i in two) for p in (0, 1)] == [3 * per_expert, 3 * per_expert]
    by_core = [sorted({g for p, g in loaded[10:] if p == core}) for core in (0, 1)]  # after the LNC=1 run
    assert by_core == [[0, 1, 2], [3, 4]]  # core 1's masked sixth group loads expert 4 again
    assert sum(p == 1 for p, _ in loaded[10:]) == 6  # w_gate_up and w_down of 3 groups
    assert [i.program_id for i in s.trace if i.op == "core_barrier"] in ([0, 1], [1, 0])
    # combine: T=24 tokens in tiles of 128 // K = 64 tokens -> one tile, on core 0; core 1 sums a masked
    # copy of it into a private scratch tensor
    sel_mm = [i for i in s.trace if i.op == "nc_matmul" and i.operands[1].shape[1] == 24]
    assert sorted(i.program_id for i in sel_mm) == [0, 1]
    stores = [(i.program_id, i.operands[0].buffer) for i in s.trace
              if i.op == "dma_copy" and i.operands[0].shape == (24, 160)]
    assert sorted(stores) == [(0, "shared_hbm"), (1, "private_hbm")]


def test_lnc_switch_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lnc_mod.ENV, raising=False)
    assert lnc_mod.default_lnc() == 1  # the interpreter: one core unless asked
    monkeypatch.setenv(lnc_mod.ENV, "2")
    assert lnc_mod.default_lnc() == 2 and lnc_mod.resolve_lnc(None) == 2
    assert lnc_mod.resolve_lnc(1) == 1  # an explicit argument wins over the env
    monkeypatch.setenv(lnc_mod.ENV, "4")
    with pytest.raises(KernelConstraintError, match=r"lnc: constraint 'TRNKIT_LNC in \(1, 2\)' violated \(got 4\)"):
        lnc_mod.default_lnc()


def test_detected_lnc_on_real_nki(monkeypatch: pytest.MonkeyPatch) -> None:
    import trnkit.nki_api

    monkeypatch.setattr(trnkit.nki_api, "REAL_NKI", True)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setattr(lnc_mod, "_instance_type", lambda: "trn2.48xlarge")
    assert lnc_mod.detected_lnc() == 2
    monkeypatch.setattr(lnc_mod, "_instance_type", lambda: "trn1.32xlarge")
    assert lnc_mod.detected_lnc() == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    monkeypatch.setattr(lnc_mod, "_instance_type", lambda: "trn2.48xlarge")
    assert lnc_mod.detected_lnc() == 1  # the runtime's own setting wins


@pytest.mark.parametrize("bad", [0, 3, True, "2"])
def test_bad_lnc_is_refused_by_every_wrapper(bad) -> None:
    x, idx, tw, wgu, wd, B = moe_inputs("T1", torch.float32)
    msg = r"lnc: constraint 'lnc in \(1, 2\)' violated"
    with pytest.raises(KernelConstraintError, match=msg):
        moe.moe_experts(x, idx, tw, wgu, wd, block_size=B, lnc=bad)
    with pytest.raises(KernelConstraintError, match=msg):
        moe.moe_experts_bwd(x, idx, tw, wgu, wd, x, block_size=B, lnc=bad)
    offs = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(KernelConstraintError, match=msg):
        moe.grouped_mm(x, wgu[:1], offs, lnc=bad)
    with pytest.raises(KernelConstraintError, match=msg):
        moe.grouped_mm_bwd(x, wgu[:1], offs, torch.zeros(1, wgu.shape[2]), lnc=bad)
    assert lnc_mod.lnc_violations(bad) and lnc_mod.lnc_violations(None) == []
