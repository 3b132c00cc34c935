"""Conformance cases of nki-library's experimental/conv kernels, written from their test files.

``test/integration/nkilib/experimental/conv/test_conv1d.py`` (conv1d against nki-library's
``conv1d_torch_ref``) and ``test_depthwise_conv1d.py`` (depthwise_conv1d_implicit_gemm against the
test's golden: torch ``conv2d`` with ``groups=C``, written here as :func:`depthwise_golden` because the
test module needs nki-library's test infrastructure). Inputs as the tests build them: one
``np.random.default_rng(0)`` normal generator, tensors drawn in the test's order and cast to the test
dtype. Both tests use ``CompilerArgs`` LNC 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["conv_cases", "depthwise_golden", "gaussian"]

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
EXP = "nkilib_src.nkilib.experimental"
TESTS = "test/integration/nkilib/experimental/conv"
_DT = {BF16: "bf16", F16: "fp16", F32: "fp32"}


def gaussian(*shapes: tuple[int, ...], dtype: np.dtype) -> list[np.ndarray]:
    """nki-library's ``gaussian_tensor_generator()`` (seed 0): one normal draw per shape, in order."""
    rng = np.random.default_rng(0)
    return [rng.normal(size=s).astype(dtype) for s in shapes]


# batch, C_in, C_out, L, K, stride, pad_left, pad_right, dilation, bias, activation, lnc_shard, dtype
_CONV1D = [  # CONV1D_BASIC_PARAMS
    (1, 16, 32, 20, 3, 1, 0, 0, 1, False, None, False, F32),
    (1, 16, 32, 20, 3, 1, 0, 0, 1, True, "SiLU", False, F32),
    (2, 64, 128, 40, 5, 2, 2, 2, 2, True, "GELU", False, F32),
    (1, 48, 96, 64, 3, 1, 1, 1, 1, False, None, False, F32),
    (1, 64, 128, 100, 5, 1, 2, 2, 1, True, "GELU", False, F32),
    (2, 96, 192, 80, 7, 2, 3, 3, 1, False, "SiLU", False, F32),
    (1, 256, 256, 200, 3, 1, 1, 1, 1, False, None, False, F32),
    (1, 192, 384, 300, 5, 1, 3, 3, 1, False, "SiLU", False, F32),
    (1, 256, 256, 512, 3, 1, 1, 1, 1, True, "GELU", False, F32),
    (1, 32, 64, 50, 1, 1, 0, 0, 1, False, None, False, F32),
    (1, 32, 64, 50, 8, 1, 3, 3, 1, True, "GELU", False, F32),
    (1, 48, 64, 128, 100, 1, 1, 1, 1, True, None, False, F32),
    (1, 64, 128, 100, 3, 2, 1, 1, 1, False, None, False, F32),
    (1, 64, 128, 100, 3, 3, 1, 1, 1, False, None, False, F32),
    (1, 64, 128, 100, 5, 10, 2, 2, 1, True, "GELU", False, F32),
    (1, 32, 64, 50, 3, 1, 2, 2, 2, False, None, False, F32),
    (1, 32, 64, 100, 3, 1, 3, 3, 3, True, "GELU", False, F32),
    (1, 64, 128, 150, 5, 2, 4, 6, 2, False, "SiLU", False, F32),
    (1, 32, 64, 50, 3, 1, 0, 2, 1, False, None, False, F32),
    (1, 64, 128, 80, 5, 2, 1, 3, 1, True, "GELU", False, F32),
    (1, 48, 96, 60, 7, 1, 2, 4, 1, False, "SiLU", False, F32),
    (1, 64, 128, 100, 3, 1, 1, 1, 1, False, None, False, F32),
    (2, 64, 128, 100, 3, 1, 1, 1, 1, False, None, False, F32),
    (8, 32, 64, 50, 3, 1, 1, 1, 1, False, "SiLU", False, F32),
    (1, 16, 32, 20, 3, 1, 0, 0, 1, False, None, True, F32),
    (1, 128, 256, 200, 5, 2, 2, 2, 1, True, "GELU", True, F32),
    (2, 96, 192, 150, 7, 1, 3, 3, 1, False, "SiLU", True, F32),
    (1, 16, 32, 20, 3, 1, 0, 0, 1, False, None, False, BF16),
    (1, 16, 32, 20, 3, 1, 0, 0, 1, True, "SiLU", False, BF16),
    (1, 64, 128, 100, 5, 1, 2, 2, 1, True, "GELU", False, BF16),
] + [  # CONV1D_WHISPER_PARAMS
    (2, 80, 384, 1500, 3, 1, 1, 1, 1, True, "GELU", False, F32),
    (1, 128, 1280, 1500, 3, 1, 1, 1, 1, True, "GELU", True, BF16),
    (2, 384, 384, 1500, 3, 2, 1, 1, 1, True, "GELU", False, F32),
    (1, 1280, 1280, 1500, 3, 2, 1, 1, 1, True, "GELU", True, BF16),
]


def _conv1d_inputs(b, cin, cout, length, k, stride, pl, pr, dil, bias, act, lnc_shard, dt) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        import importlib

        shapes = [(b, cin, length), (k, cin, cout)] + ([(cout,)] if bias else [])
        drawn = gaussian(*shapes, dtype=dt)
        act_types = importlib.import_module("nkilib_src.nkilib.core.utils.common_types").ActFnType
        return {"x_in": drawn[0], "filters": drawn[1], "bias": drawn[2] if bias else None,
                "stride": stride, "padding": (pl, pr), "dilation": dil,
                "activation_fn": getattr(act_types, act) if act else None, "lnc_shard": lnc_shard}
    return make


def _conv1d_cases() -> list[Case]:
    cases = []
    for b, cin, cout, length, k, stride, pl, pr, dil, bias, act, shard, dt in _CONV1D:
        flags = [f"stride={stride}"] * (stride > 1) + [f"pad={pl},{pr}"] * bool(pl or pr) \
            + [f"dilation={dil}"] * (dil > 1) + ["bias"] * bias + [act] * bool(act) + ["lnc_shard"] * shard
        tol = 5e-2 if dt == BF16 else 1e-5
        cases.append(Case(
            kernel="experimental/conv/conv1d", name=f"conv1d {_DT[dt]} " + " ".join(flags),
            shapes=f"x[{b},{cin},{length}] w[{k},{cin},{cout}]",
            entry=f"{EXP}.conv.conv1d:conv1d", reference=f"{EXP}.conv.conv1d_torch:conv1d_torch_ref",
            inputs=_conv1d_inputs(b, cin, cout, length, k, stride, pl, pr, dil, bias, act, shard, dt),
            outputs=("out",), lnc=2, rtol=tol, atol=tol, test_file=f"{TESTS}/test_conv1d.py"))
    return cases


# batch, channels, width, kernel_size, stride, padding, dtype (fast_test_cases + all_test_cases, once each)
_DEPTHWISE = [
    (1, 16, 512, 64, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 512, 64, (1, 1), ((0, 0), (10, 10)), BF16),
    (1, 256, 512, 64, (1, 2), ((0, 0), (0, 0)), BF16),
    (1, 256, 512, 64, (1, 2), ((0, 0), (5, 5)), BF16),
    (1, 512, 5000, 8, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 16, 512, 3, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 16, 512, 7, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 512, 64, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 16, 512, 200, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 512, 256, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 1024, 512, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 1024, 1024, 128, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 2048, 128, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 4096, 256, (1, 1), ((0, 0), (0, 0)), BF16),
    (2, 256, 512, 64, (1, 1), ((0, 0), (0, 0)), BF16),
    (4, 256, 512, 128, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 2, 512, 64, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 256, 128, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 129, 128, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 256, 512, 64, (1, 1), ((0, 0), (0, 0)), F32),
    (1, 256, 512, 128, (1, 1), ((0, 0), (0, 0)), F16),
    (1, 16, 512, 3, (1, 1), ((0, 0), (1, 1)), BF16),
    (1, 16, 512, 7, (1, 1), ((0, 0), (3, 3)), BF16),
    (1, 16, 512, 200, (1, 1), ((0, 0), (10, 10)), BF16),
    (1, 1024, 1024, 128, (1, 1), ((0, 0), (5, 5)), BF16),  # the test skips it (SKIPPED here, run anyway)
    (1, 256, 2048, 128, (1, 1), ((0, 0), (10, 10)), BF16),
    (2, 256, 512, 64, (1, 1), ((0, 0), (5, 5)), BF16),
    (1, 256, 128, 128, (1, 1), ((0, 0), (1, 1)), BF16),
    (1, 16, 512, 3, (1, 2), ((0, 0), (0, 0)), BF16),
    (1, 256, 512, 64, (1, 4), ((0, 0), (0, 0)), BF16),
    (1, 16, 512, 200, (1, 2), ((0, 0), (0, 0)), BF16),
    (1, 256, 1024, 256, (1, 3), ((0, 0), (0, 0)), BF16),
    (1, 256, 4096, 256, (1, 16), ((0, 0), (0, 0)), BF16),
    (1, 256, 512, 64, (1, 2), ((0, 0), (0, 0)), F32),
    (1, 16, 512, 3, (1, 2), ((0, 0), (1, 1)), BF16),
    (1, 256, 512, 64, (1, 2), ((0, 0), (10, 10)), BF16),
    (1, 16, 512, 200, (1, 2), ((0, 0), (10, 10)), BF16),
    (1, 1024, 1024, 128, (1, 2), ((0, 0), (5, 5)), BF16),
    (1, 2048, 2048, 256, (1, 1), ((0, 0), (0, 0)), BF16),
    (1, 2048, 2048, 256, (1, 4), ((0, 0), (0, 0)), BF16),
    (1, 8192, 4096, 4093, (1, 1), ((0, 0), (0, 0)), BF16),
]


def depthwise_golden(img_ref, filter_ref, padding, stride, **_: Any) -> dict[str, Any]:
    """The depthwise test's golden: torch ``conv2d(groups=C)`` in fp32 with the width padding, cast to
    the image dtype (the harness passes fp32 torch tensors; the dtype comes back through the case)."""
    import torch

    out = torch.nn.functional.conv2d(img_ref.float(), filter_ref.float(), bias=None, stride=stride,
                                     padding=(0, padding[1][0]), groups=img_ref.shape[1])
    return {"output": out}


def _depthwise_inputs(b: int, c: int, w: int, k: int, stride: tuple, padding: tuple, dt: np.dtype
                      ) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        img, filt = gaussian((b, c, 1, w), (c, 1, 1, k), dtype=dt)
        return {"img_ref": img, "filter_ref": filt, "padding": padding, "stride": stride,
                "rhs_dilation": (1, 1), "lhs_dilation": (1, 1), "feature_group_count": c,
                "batch_group_count": 1}
    return make


# test_depthwise_conv1d_all's pytest.param mark for its [1, 1024, 1024, 128] row with padding 5
DEPTHWISE_SKIP = "Skipped: neuron-profile view OOM on 128GB TRN instance during JSON generation"


def _depthwise_cases() -> list[Case]:
    cases = []
    for b, c, w, k, stride, padding, dt in _DEPTHWISE:
        pad = padding[1]
        name = f"depthwise {_DT[dt]}" + (f" stride={stride[1]}" if stride[1] > 1 else "") \
            + (f" pad={pad[0]},{pad[1]}" if any(pad) else "")
        cases.append(Case(
            kernel="experimental/conv/depthwise_conv1d", name=name, shapes=f"img[{b},{c},1,{w}] k={k}",
            entry=f"{EXP}.conv.depthwise_conv1d:depthwise_conv1d_implicit_gemm",
            reference="trnkit.conformance.cases_conv:depthwise_golden",
            inputs=_depthwise_inputs(b, c, w, k, stride, padding, dt), outputs=("output",), lnc=2,
            rtol=1e-2, atol=1e-2, keep_low_precision=True, test_file=f"{TESTS}/test_depthwise_conv1d.py",
            skipped_by=DEPTHWISE_SKIP if (c, w, k, pad) == (1024, 1024, 128, (5, 5)) else ""))
    return cases


def conv_cases() -> list[Case]:
    return _conv1d_cases() + _depthwise_cases()
