"""Conformance cases of nki-library's experimental/loss cross-entropy kernels, written from their tests.

``test/integration/nkilib/experimental/loss/test_cross_entropy_forward.py`` / ``_backward.py``: inputs
``np.random.seed(42)``, logits ``randn(B*T, V)`` cast to the test dtype, targets ``randint(0, V)``
int32; the backward's lse from nki-library's forward reference on those logits (in the test dtype).
The goldens run nki-library's torch references on the logits in the test dtype and round the outputs
to it (:func:`forward_golden`, :func:`backward_golden`, the tests' ``golden_cross_entropy_*_ref``).
Tolerances 1e-2 / 1e-2 (bf16), ``CompilerArgs()``: LNC 2. Only the rows whose B*T*V fits the
interpreter in seconds (the tests' minimal and smallest-sequence rows) run here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .harness import Case

__all__ = ["loss_cases", "forward_golden", "backward_golden"]

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
EXP = "nkilib_src.nkilib.experimental.loss"
TESTS = "test/integration/nkilib/experimental/loss"


def _ref(name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(f"{EXP}.cross_entropy_torch"), name)


def _torch_logits(logits: Any, dtype_name: str) -> Any:
    import torch

    t = logits if isinstance(logits, torch.Tensor) else torch.from_numpy(np.asarray(logits, np.float32))
    return t.to(torch.bfloat16 if dtype_name == "bfloat16" else torch.float32)


def _round(t: Any, dtype_name: str) -> np.ndarray:
    return t.float().numpy().astype(BF16 if dtype_name == "bfloat16" else F32)


def forward_golden(logits_hbm: Any, targets_hbm: Any, dtype_name: str = "bfloat16", **_: Any) -> dict:
    loss, lse = _ref("cross_entropy_forward_torch_ref")(_torch_logits(logits_hbm, dtype_name), targets_hbm.long())
    return {"loss_hbm": _round(loss, dtype_name), "lse_state_hbm": _round(lse, dtype_name)}


def backward_golden(logits_hbm: Any, targets_hbm: Any, reduction: str = "mean", dtype_name: str = "bfloat16",
                    **_: Any) -> dict:
    grad = _ref("cross_entropy_backward_torch_ref")(_torch_logits(logits_hbm, dtype_name), targets_hbm.long(),
                                                     reduction)
    return {"grad_logits_hbm": _round(grad, dtype_name)}


def _inputs(n: int, v: int, dtype_name: str, pb: int, cs: int, reduction: str | None) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        import nki.language as nl  # the interpreter, inside nki_is_interpreter
        import torch

        np.random.seed(42)
        logits = np.random.randn(n, v).astype(BF16 if dtype_name == "bfloat16" else F32)
        targets = np.random.randint(0, v, size=(n,), dtype=np.int32)
        out = {"logits_hbm": logits, "targets_hbm": targets}
        if reduction is not None:
            _, lse = _ref("cross_entropy_forward_torch_ref")(_torch_logits(logits.astype(np.float32), dtype_name),
                                                              torch.from_numpy(targets).long())
            out["lse_state_hbm"] = _round(lse, dtype_name)
            out["reduction"] = reduction
        return {**out, "positions_per_batch": pb, "chunk_size": cs,
                "dtype": nl.bfloat16 if dtype_name == "bfloat16" else nl.float32}
    return make


def _ref_inputs(dtype_name: str) -> Callable[[dict], dict]:
    return lambda inputs: {**inputs, "dtype_name": dtype_name}


# B, T, V, dtype, positions_per_batch, chunk_size (reduction for the backward), test function
_FORWARD = [(1, 1, 32128, "bfloat16", 1, 32128, "switch_transformers_fast"),
            (1, 128, 129280, "bfloat16", 64, 65535, "deepseek_v3_full"),
            (1, 256, 151936, "bfloat16", 64, 65535, "qwen3_8b_full")]
_BACKWARD = [(1, 1, 32128, "bfloat16", 1, 16384, "mean", "switch_transformers_fast"),
             (1, 128, 129280, "bfloat16", 128, 16384, "mean", "deepseek_v3_full"),
             (1, 256, 151936, "bfloat16", 128, 16384, "mean", "qwen3_8b_full")]


def loss_cases() -> list[Case]:
    tol = {"bfloat16": 1e-2, "float32": 1e-5}
    cases = [Case(
        kernel="experimental/loss/cross_entropy_forward", name=f"{test} {dt} PB={pb} CS={cs}",
        shapes=f"B={b} T={t} V={v}", entry=f"{EXP}:cross_entropy_forward",
        reference="trnkit.conformance.cases_loss:forward_golden", ref_inputs=_ref_inputs(dt),
        inputs=_inputs(b * t, v, dt, pb, cs, None), outputs=("loss_hbm", "lse_state_hbm"), lnc=2,
        rtol=tol[dt], atol=tol[dt], test_file=f"{TESTS}/test_cross_entropy_forward.py")
        for b, t, v, dt, pb, cs, test in _FORWARD]
    cases += [Case(
        kernel="experimental/loss/cross_entropy_backward", name=f"{test} {dt} PB={pb} CS={cs} {red}",
        shapes=f"B={b} T={t} V={v}", entry=f"{EXP}:cross_entropy_backward",
        reference="trnkit.conformance.cases_loss:backward_golden", ref_inputs=_ref_inputs(dt),
        inputs=_inputs(b * t, v, dt, pb, cs, red), outputs=("grad_logits_hbm",), lnc=2,
        rtol=tol[dt], atol=tol[dt], test_file=f"{TESTS}/test_cross_entropy_backward.py")
        for b, t, v, dt, pb, cs, red, test in _BACKWARD]
    return cases
