"""MoE kernels on a trn2 logical core (LNC=2): both physical cores split the experts, the results are
bit-identical to one core, each core loads only its own experts' weights; the LNC switch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe import GMM_CASES, _moe_inputs, _rand, weight_dmas
from trnkit.kernels import lnc as lnc_mod
from trnkit.kernels import moe
from trnkit.kernels.constraints import KernelConstraintError
from trnkit.nkisim import trace

DTYPES = (torch.float32, torch.bfloat16)


def _equal(a: tuple | torch.Tensor, b: tuple | torch.Tensor) -> None:
    for k, (x, y) in enumerate(zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,))):
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x, y), f"output {k}: max diff {(x.float() - y.float()).abs().max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["tails", "T1", "all_to_one_expert", "empty_experts", "prime_E", "block_256",
                                  "tail_96", "two_experts_512"])
def test_moe_experts_lnc2_is_bit_identical_to_lnc1(case: str, dtype: torch.dtype) -> None:
    """tail_96 has E=1 (the second core has no expert), all_to_one_expert puts every block on core 0;
    two_experts_512: one expert per core, each a full 512-slot block and a 192-wide tail (the first
    core's last look-ahead gathers the second core's first block)."""
    x, idx, tw, wgu, wd, B = _moe_inputs(case, dtype)
    one = moe.moe_experts(x, idx, tw, wgu, wd, block_size=B, lnc=1)
    _equal(moe.moe_experts(x, idx, tw, wgu, wd, block_size=B, lnc=2), one)
    if case in ("tails", "all_to_one_expert", "prime_E", "tail_96", "block_256"):
        g = _rand(*x.shape, dtype=dtype, seed=11)
        _equal(moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=B, lnc=2),
               moe.moe_experts_bwd(x, idx, tw, wgu, wd, g, block_size=B, lnc=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(GMM_CASES))
def test_grouped_mm_lnc2_is_bit_identical_to_lnc1(case: str, dtype: torch.dtype) -> None:
    M, K, N, offs, B = GMM_CASES[case]
    x, w = _rand(M, K, dtype=dtype, scale=K ** -0.5), _rand(len(offs), K, N, dtype=dtype, seed=4)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    g = _rand(M, N, dtype=dtype, seed=7, scale=N ** -0.5)
    _equal(moe.grouped_mm(x, w, offs_t, block_size=B, lnc=2), moe.grouped_mm(x, w, offs_t, block_size=B, lnc=1))
    _equal(moe.grouped_mm_bwd(x, w, offs_t, g, block_size=B, lnc=2),
           moe.grouped_mm_bwd(x, w, offs_t, g, block_size=B, lnc=1))


def test_each_core_loads_only_its_experts_and_meets_the_other_once() -> None:
    """E=5: core 0 owns experts 0-2, core 1 experts 3-4 (contiguous halves); one barrier per core
    before the combine, whose token tiles alternate between the cores."""
    x, idx, tw, wgu, wd, B = _moe_inputs("tails", torch.bfloat16)  # T=24, K=2: 48 slots
    def traced(lnc: int) -> tuple:
        with trace.record(trace_only=True) as tr:
            moe.moe_experts(x, idx, tw, wgu, wd, block_size=B, lnc=lnc)
        return tr, weight_dmas(tr)

    _, one = traced(1)
    tr, two = traced(2)
    per_expert = len(one) // 5
    assert per_expert >= 1 and len(one) == 5 * per_expert
    assert [sum(i.program_id == p for i in two) for p in (0, 1)] == [3 * per_expert, 2 * per_expert]
    assert [i.program_id for i in tr if i.op == "core_barrier"] in ([0, 1], [1, 0])
    # combine: T=24 tokens in tiles of 128 // K = 64 tokens -> one tile, on core 0
    sel_mm = [i for i in tr if i.op == "nc_matmul" and i.operands[1].shape[1] == 24]
    assert sel_mm and {i.program_id for i in sel_mm} == {0}


def test_lnc_switch_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lnc_mod.ENV, raising=False)
    lnc_mod.set_lnc(None)
    assert lnc_mod.default_lnc() == 1  # the interpreter: one core unless asked
    monkeypatch.setenv(lnc_mod.ENV, "2")
    assert lnc_mod.default_lnc() == 2
    try:
        lnc_mod.set_lnc(1)  # the process setting (override config / trainer) wins over the env
        assert lnc_mod.default_lnc() == 1 and lnc_mod.resolve_lnc(2) == 2
    finally:
        lnc_mod.set_lnc(None)
    monkeypatch.setenv(lnc_mod.ENV, "4")
    with pytest.raises(KernelConstraintError, match=r"lnc: constraint 'TRNKIT_LNC in \(1, 2\)' violated \(got 4\)"):
        lnc_mod.default_lnc()


def test_detected_lnc_on_real_nki(monkeypatch: pytest.MonkeyPatch) -> None:
    import trnkit.nki_api  # noqa: PLC0415

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
    x, idx, tw, wgu, wd, B = _moe_inputs("T1", torch.float32)
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
    with pytest.raises(KernelConstraintError, match=msg):
        lnc_mod.set_lnc(bad)
