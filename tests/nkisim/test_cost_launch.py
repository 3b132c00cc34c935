"""Cost model: a standalone launch's start-up / tear-down and LNC 2 core skew (cost_params.LaunchParams), added
only when asked (a kernel inside a larger graph pays none of it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.helpers import matmul
from trnkit.nkisim import cost
from trnkit.nkisim.cost_params import HIGH, LOW, STANDALONE_LAUNCH, LaunchParams, LaunchRange


def _mm(program_id: int = 0, launch: int = 0) -> cost.Instr:
    return replace(matmul(128, 128, 512), program_id=program_id, attrs={"launch": launch})


def test_the_standalone_range_is_the_documented_one():
    """Written out by hand from the sources in cost_params: low 0 (the nrtpy example), mid the fused-Mamba
    profile's 172.93 us less its first-trigger-to-last-transfer span (12.44 .. 168.50 us), 16.87 -> 16.9 us,
    high 33.3 + 4.4 us start-up and 33.3 us skew (the DMA overview's trn2 profiles)."""
    assert STANDALONE_LAUNCH.low == LaunchParams(0.0, 0.0)
    assert 172_930.0 - (168_500.0 - 12_440.0) == pytest.approx(16_870.0)
    assert STANDALONE_LAUNCH.mid == LaunchParams(startup_ns=16_900.0, core_skew_ns=0.0)
    assert STANDALONE_LAUNCH.high == LaunchParams(startup_ns=33_300.0 + 4_400.0, core_skew_ns=33_300.0,
                                                  hbm_stack_cores=2)
    # HBM: low and mid the launch's own programs on their stack, high the partner core streaming too
    assert STANDALONE_LAUNCH.low.hbm_stack_cores is None and STANDALONE_LAUNCH.mid.hbm_stack_cores is None


def test_overhead_per_launch_and_skew_only_with_two_programs():
    lp = LaunchParams(startup_ns=1_000.0, core_skew_ns=300.0)
    assert cost.launch_overhead_ns([1], lp) == 1_000.0
    assert cost.launch_overhead_ns([2], lp) == 1_300.0
    assert cost.launch_overhead_ns([1, 2, 2], lp) == 1_000.0 + 1_300.0 + 1_300.0
    assert cost.launch_overhead_ns([], lp) == 0.0


def test_default_estimate_is_the_kernel_in_a_graph():
    rep = cost.estimate([_mm()] * 4)
    assert rep.launch_ns == (0.0, 0.0, 0.0)
    assert "standalone launch" not in str(rep)


def test_standalone_lnc1_adds_each_settings_startup():
    """One program, 4 matmuls: 4 x 512 TensorE cycles at 2.4 GHz = 853.3 ns of work plus the pipeline fill;
    standalone adds 0 / 16,900 / 37,700 ns to low / mid / high."""
    instrs = [_mm()] * 4
    kernel = cost.estimate(instrs)
    standalone = cost.estimate(instrs, launch=STANDALONE_LAUNCH)
    assert standalone.launch_ns == (0.0, 16_900.0, 37_700.0)
    assert [s - k for s, k in zip(standalone.total_range_ns, kernel.total_range_ns)] == pytest.approx(
        [0.0, 16_900.0, 37_700.0]
    )
    assert standalone.total_ns == pytest.approx(kernel.total_ns + 16_900.0)
    assert kernel.total_ns > 4 * 512 / 2.4  # the kernel part is the matmuls' own schedule, not zero
    text = str(standalone)
    assert "standalone launch" in text and "16.900 us" in text and "37.700 us" in text
    assert standalone.as_dict()["launch_ns"] == [0.0, 16_900.0, 37_700.0]


def test_standalone_lnc2_adds_the_core_skew():
    """Two programs (LNC 2) in one launch: high = 37,700 start-up + 33,300 skew = 71,000 ns; mid and low have no
    skew."""
    instrs = [_mm(0)] * 3 + [_mm(1)] * 3
    kernel = cost.estimate(instrs)
    standalone = cost.estimate(instrs, launch=STANDALONE_LAUNCH)
    assert standalone.launch_ns == (0.0, 16_900.0, 71_000.0)
    assert standalone.total_range_ns[2] == pytest.approx(kernel.total_range_ns[2] + 71_000.0)


def test_each_launch_is_its_own_execution():
    """Two single-program launches in one trace: two start-ups (2 x 16,900 ns at mid)."""
    instrs = [_mm(0, launch=1)] * 2 + [_mm(0, launch=2)] * 2
    standalone = cost.estimate(instrs, launch=STANDALONE_LAUNCH)
    assert standalone.launch_ns[1] == 2 * 16_900.0


def test_explicit_params_take_one_launch_value():
    instrs = [_mm()] * 4
    lp = LaunchParams(startup_ns=5_000.0, core_skew_ns=7_000.0)
    for params in (LOW, HIGH):
        k = cost.estimate(instrs, params=params)
        s = cost.estimate(instrs, params=params, launch=lp)
        assert s.total_ns == pytest.approx(k.total_ns + 5_000.0)
        assert s.total_range_ns == pytest.approx((k.total_ns + 5_000.0,) * 3)
    with pytest.raises(ValueError, match=r"launch=LaunchRange .*params= names one setting"):
        cost.estimate(instrs, params=LOW, launch=STANDALONE_LAUNCH)


def test_launch_range_rejects_an_unknown_setting():
    with pytest.raises(ValueError, match=r"unknown setting 'max'"):
        LaunchRange(LaunchParams(), LaunchParams(), LaunchParams()).setting("max")
