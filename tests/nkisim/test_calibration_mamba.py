"""Calibration against published device times: the SDK fused-Mamba tutorial kernels (trn1).

The ported kernels (benchmarks/calibration/mamba_kernels.py) must compute the Mamba selective scan (checked
against a numpy recurrence), and the cost model must reproduce the tutorial's measured times. The full
shapes (4096 channels) take minutes on the interpreter, so the test runs 2 channel tiles and compares with
the published time per (channel tile, state[, seq tile]) step: each kernel's steps are independent work of
the same shape, so the device time is that count times the per-step time. ``benchmarks/calibration/run.py``
runs the full shapes (table in calibration.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from trnkit.nkisim import cost, trace
from trnkit.nkisim.cost_params import HIGH, LOW, MID

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "calibration"))
import mamba_kernels
import run
from points import POINTS

TOL = 0.20  # the acceptance band


def selective_scan_ref(delta, u, A, B, C):
    """out[b, c, t] = sum_n C[b, n, t] * h_n[t], h_n[t] = exp(delta A_n) h_n[t-1] + delta u B[b, n, t]."""
    out = np.zeros(delta.shape, np.float64)
    for n in range(A.shape[1]):
        dA = np.exp(delta * A[None, :, n, None])
        dBu = delta * u * B[:, n][:, None, :]
        h = np.zeros(delta.shape[:2])
        for t in range(delta.shape[2]):
            h = dA[:, :, t] * h + dBu[:, :, t]
            out[:, :, t] += h * C[:, n, t][:, None]
    return out


def inputs(channels: int, seq: int, states: int):
    rng = np.random.default_rng(1)
    delta = rng.random((1, channels, seq), dtype=np.float32) * 0.1
    u = rng.standard_normal((1, channels, seq), dtype=np.float32)
    A = -rng.random((channels, states), dtype=np.float32)
    B = rng.standard_normal((1, states, seq), dtype=np.float32)
    C = rng.standard_normal((1, states, seq), dtype=np.float32)
    return delta, u, A, B, C


@pytest.mark.parametrize("version,seq", [("v1", 512), ("v2", 512), ("v3", 1024)])
def test_ported_mamba_kernels_compute_the_selective_scan(version, seq):
    args = inputs(256, seq, 3)
    out = mamba_kernels.KERNELS[version](*args)
    np.testing.assert_allclose(np.asarray(out), selective_scan_ref(*args), rtol=1e-4, atol=1e-4)


def _published(version: str, seq: int) -> tuple[float, int]:
    p = next(p for p in POINTS if p.family == "mamba" and p.version == version and p.dims["seq_len"] == seq
             and p.dims["channels"] == 4096)
    d = p.dims
    steps = d["channels"] // 128 * d["state_size"] * (d["seq_len"] // 512 if version == "v3" else 1)
    return p.published * 1e6, steps


def _estimate(version: str, seq: int) -> tuple[cost.CostReport, tuple[float, float], int]:
    """Two channel tiles of the 4,096-channel kernel, estimated with the full shape's reload decision
    (run.slice_params: v1's 4,096 channels of delta and u do not stay resident, two tiles' would)."""
    channels, states = 256, 16
    with trace.record(trace_only=True) as tr:
        mamba_kernels.KERNELS[version](*inputs(channels, seq, states))
    steps = channels // 128 * states * (seq // 512 if version == "v3" else 1)
    full = next(p for p in POINTS if p.family == "mamba" and p.version == version and p.dims["seq_len"] == seq
                and p.dims["channels"] == 4096)
    ends = tuple(cost.estimate_total(list(tr), "trn1", run.slice_params(full, s)) for s in (LOW, HIGH))
    return cost.estimate(tr, "trn1", params=run.slice_params(full, MID)), ends, steps


@pytest.fixture(scope="module")
def estimates():
    return {v: _estimate(v, s) for v, s in (("v1", 512), ("v2", 512), ("v3", 8192))}


@pytest.mark.parametrize("version,seq", [("v1", 512), ("v2", 512), ("v3", 8192)])
def test_mamba_versions_within_20_percent_of_the_published_device_time(estimates, version, seq):
    pub_ns, pub_steps = _published(version, seq)
    rep, (low, high), steps = estimates[version]
    per_step = rep.total_ns / steps
    assert per_step == pytest.approx(pub_ns / pub_steps, rel=TOL)
    assert low <= rep.total_ns <= high


def test_v1_to_v2_improvement_predicted_and_at_least_half_its_size(estimates):
    (v1_pub, n1), (v2_pub, n2) = _published("v1", 512), _published("v2", 512)
    (r1, _, s1), (r2, _, s2) = estimates["v1"], estimates["v2"]
    published_gain = (v1_pub - v2_pub) / n1
    predicted_gain = (r1.total_ns - r2.total_ns) / s1
    assert s1 == s2 and n1 == n2
    assert predicted_gain >= 0.5 * published_gain
    # v2: VectorE is the bottleneck, as the tutorial's profile shows (99.6% active). v1 (92% active,
    # waiting on loads) is DMA-bound in the model: the port reloads delta and u for each of the 16
    # states as written, where the tutorial's profiler reports the compiler reloading them "around 7
    # times", so the model's v1 DMA time is about twice the device's (its total is still within 3%).
    assert r2.bottleneck == "vector"
    assert r1.busy_ns["vector"] > r2.busy_ns["vector"] and r1.busy_ns["dma"] > 4 * r2.busy_ns["dma"]
