"""benchmarks/blockwise_moe.py: the blockwise MoE design of the side-by-side computes the same experts
output as trnkit's reference (so the comparison is between two correct kernels) on both LNC settings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.tolerances import assert_close
from trnkit.kernels import moe

_spec = importlib.util.spec_from_file_location(
    "blockwise_moe", Path(__file__).resolve().parent.parent / "benchmarks" / "blockwise_moe.py")
blockwise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(blockwise)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("E,K,B", [(5, 2, 32), (3, 2, 64), (1, 1, 32)])  # E=1: core 1 has no block
def test_blockwise_matches_reference(E: int, K: int, B: int, lnc: int) -> None:
    x, idx, tw, wgu, wd = blockwise._inputs(E, torch.float32, T=40, H=160, inter=96, K=K)
    assert_close(blockwise.blockwise_moe(x, idx, tw, wgu, wd, B, lnc), moe.moe_experts_ref(x, idx, tw, wgu, wd),
                 torch.float32)
