"""Conformance cases of nki-library's experimental/dynamic_shapes kernel, written from its test file.

``test/integration/nkilib/experimental/dynamic_shapes/test_dynamic_elementwise_add.py``: bf16 input_a and
input_b [M, H] drawn in that order from one ``gaussian_tensor_generator()`` (``default_rng(0)`` normal),
``num_m_tiles = [[M // 128]]`` (the runtime trip count of the kernel's ``nl.dynamic_range``), under
``CompilerArgs()`` (LNC 2 on trn2). Its golden (:func:`elementwise_add_golden`): nki-library's
``dynamic_elementwise_add_torch_ref`` in fp32, cast to bf16. ``test_dynamic_elementwise_add_fast``
compares at rtol 1e-2 / atol 1e-3; ``test_dynamic_elementwise_add_commutativity`` runs the kernel on
(input_b, input_a) and compares with the golden of (input_a, input_b) exactly. Both take their rows from
``coverage_parametrize(coverage="singles")`` without a filter: the value lists zipped cyclically.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .cases_conv import gaussian
from .harness import Case

__all__ = ["dynamic_shapes_cases", "elementwise_add_golden"]

BF16 = np.dtype(ml_dtypes.bfloat16)
EXP = "nkilib_src.nkilib.experimental.dynamic_shapes"
TEST = "test/integration/nkilib/experimental/dynamic_shapes/test_dynamic_elementwise_add.py"
P_MAX = 128  # the kernel's M tile (rows per dynamic_range iteration)

_FAST = [(128, 512), (256, 1024), (1024, 2048)]  # m_dim [128, 256, 1024] x h_dim [512, 1024, 2048], zipped
_COMMUTATIVITY = [(128, 512), (256, 1024)]  # m_dim [128, 256] x h_dim [512, 1024], zipped


def elementwise_add_golden(input_a, input_b, **_: Any) -> dict[str, Any]:
    """The test's ``golden_elementwise_add``: the torch reference on fp32 copies (the harness casts the
    result back to bf16, the inputs' dtype)."""
    ref = importlib.import_module(f"{EXP}.dynamic_elementwise_add_torch").dynamic_elementwise_add_torch_ref
    return {"result": ref(input_a.float(), input_b.float())}


def _inputs(m: int, h: int, swapped: bool) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        a, b = gaussian((m, h), (m, h), dtype=BF16)
        if swapped:
            a, b = b, a
        return {"input_a": a, "input_b": b, "num_m_tiles": np.array([[m // P_MAX]], dtype=np.int32)}
    return make


def _unswap(inputs: dict[str, Any]) -> dict[str, Any]:
    """The commutativity test's golden takes the inputs in their drawn order."""
    return {"input_a": inputs["input_b"], "input_b": inputs["input_a"]}


def _case(m: int, h: int, commutativity: bool) -> Case:
    return Case(kernel="experimental/dynamic_shapes/dynamic_elementwise_add",
                name="add(b, a) == a + b exactly" if commutativity else "add bf16", shapes=f"[{m},{h}]",
                entry=f"{EXP}.dynamic_elementwise_add:dynamic_elementwise_add",
                reference=f"{__name__}:elementwise_add_golden", inputs=_inputs(m, h, commutativity),
                ref_inputs=_unswap if commutativity else None, outputs=("result",), lnc=2,
                rtol=0.0 if commutativity else 1e-2, atol=0.0 if commutativity else 1e-3,
                keep_low_precision=True, test_file=TEST)


def dynamic_shapes_cases() -> list[Case]:
    return [_case(m, h, False) for m, h in _FAST] + [_case(m, h, True) for m, h in _COMMUTATIVITY]
