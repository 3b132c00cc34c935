"""Conformance cases of nki-library's core/utils TensorView, written from ``test_tensor_view.py``.

The test defines its kernels itself; the run imports them from the checkout's test file
(``harness.load_test_module``):

- ``kernel_test_view_ops`` builds an ``nl.ndarray`` of the row's shape, dtype and buffer, applies the
  row's TensorView operations and ``kernel_assert``\\ s the view's shape, strides and offset against the
  expected values the test computes with torch views. Here they come from :func:`torch_view`: the same
  operations on a torch tensor, read back as its ``shape``, ``stride()`` and ``storage_offset()``. Rows
  the test expects to fail (``test_negative_chain``, the cross-size cast after a dynamic select) are
  negative cases.
- ``kernel_dynamic_ops`` moves data through a view with a dynamic (register / SBUF index) select or a
  ``vector_select`` gather: compared exactly with the torch view of the same input (inputs drawn as
  ``generate_dynamic_ops_inputs`` does: ``np.random.seed(42)``, ``randn``, then ``randint`` offsets).
- The constructor and reinterpret-cast kernels take only ``(dummy_out, shape)`` and assert inside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .harness import Case

__all__ = ["tensor_view_cases", "torch_view", "dummy_golden", "dynamic_view_golden"]

TESTS = "test/integration/nkilib/core/utils"
TV_TEST = f"{TESTS}/test_tensor_view.py"
HERE = "trnkit.conformance.cases_tensor_view"
KERNEL = "core/utils/tensor_view"


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _apply(t: Any, op: tuple, dynamic: int = 0, offsets: np.ndarray | None = None) -> Any:
    """One TensorView operation as a torch view (``vector_select``: the rows gathered, a copy)."""
    import torch

    name, args = op
    if name == "slice":
        dim, start, end, step = args
        index = [slice(None)] * t.dim()
        index[dim] = slice(start, end, step)
        return t[tuple(index)]
    if name == "permute":
        return t.permute(args[0])
    if name == "broadcast":
        dim, size = args
        return t.expand(*[size if d == dim else s for d, s in enumerate(t.shape)])
    if name == "reshape_dim":
        dim, parts = args
        return t.view(*t.shape[:dim], *parts, *t.shape[dim + 1:])
    if name == "reshape":
        return t.view(*args[0])
    if name == "flatten_dims":
        return t.flatten(*args)
    if name == "expand_dim":
        return t.unsqueeze(args[0])
    if name == "squeeze_dim":
        return t.squeeze(args[0])
    if name in ("select", "select_dynamic"):
        dim, index = args
        return t.select(dim, dynamic if name == "select_dynamic" and dynamic is not None else index)
    if name == "vector_select":
        return torch.from_numpy(t.numpy()[offsets.reshape(-1)])
    if name == "reinterpret_cast":
        return t.view(_torch_dtype(args[0]))
    raise ValueError(f"unknown TensorView operation {name!r}")


def torch_view(shape: tuple[int, ...], ops: tuple, dtype: str = "float32") -> tuple[tuple, tuple, int]:
    """``(shape, strides, offset)`` of the view the operations give on a fresh ``shape`` tensor, in
    elements of the final dtype (torch's view semantics: sliced ends clamp, broadcasts have stride 0)."""
    import torch

    t = torch.empty(shape, dtype=_torch_dtype(dtype))
    for op in ops:
        t = _apply(t, op, dynamic=None)
    return tuple(t.shape), tuple(t.stride()), int(t.storage_offset())


def _nki_ops(ops: tuple) -> tuple:
    """The row's operations with dtype names as the interpreter's ``nl`` dtypes (inside the run)."""
    import nki.language as nl

    return tuple((name, (getattr(nl, args[0]),) if name == "reinterpret_cast" else args) for name, args in ops)


def _view_inputs(shape: tuple[int, ...], buffer: str, ops: tuple, dtype: str, negative: bool) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        import nki.language as nl

        want = ((1,), (1,), 0) if negative else torch_view(shape, ops, dtype)
        return {"dummy_out": np.zeros((1,), np.float32), "shape": shape, "buffer": getattr(nl, buffer),
                "ops": _nki_ops(ops), "expected_shape": want[0], "expected_strides": want[1],
                "expected_offset": want[2], "src_dtype": getattr(nl, dtype)}
    return make


def dummy_golden(dummy_out: Any, **_: Any) -> dict[str, np.ndarray]:
    """The kernels assert the view inside and return their dummy output untouched."""
    return {"dummy_out": np.zeros((1,), np.float32)}


def _dynamic_result(x: np.ndarray, ops: tuple, dynamic: int, offsets: np.ndarray) -> np.ndarray:
    import torch

    t = torch.from_numpy(x)
    for op in ops:
        t = _apply(t, op, dynamic, offsets)
    return t.contiguous().numpy()


def _dynamic_inputs(shape: tuple[int, ...], ops: tuple) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        import torch

        np.random.seed(42)
        x = np.random.randn(*shape).astype(np.float32)
        dynamic = next((args[1] for name, args in ops if name == "select_dynamic"), 0)
        offsets = np.zeros((128, 1), np.int32)
        if any(name == "vector_select" for name, _ in ops):
            t = torch.from_numpy(x)
            for op in ops[:[name for name, _ in ops].index("vector_select")]:
                t = _apply(t, op, dynamic)
            offsets = np.random.randint(0, t.shape[0], size=(128, 1)).astype(np.int32)
        out_shape = _dynamic_result(x, ops, dynamic, offsets).shape
        return {"input_tensor": x, "dynamic_idx": np.array([[dynamic]], np.int32), "vector_offsets_hbm": offsets,
                "ops": ops, "out_shape": out_shape}
    return make


def dynamic_view_golden(input_tensor: Any, dynamic_idx: Any, vector_offsets_hbm: Any, ops: tuple,
                        **_: Any) -> dict[str, np.ndarray]:
    """The data the view addresses, read through torch's view of the same input."""
    return {"out": _dynamic_result(input_tensor.numpy(), ops, int(dynamic_idx[0, 0]),
                                   np.asarray(vector_offsets_hbm))}


# -- the test's parameter tables ------------------------------------------------------------------
S, H = "sbuf", "hbm"
_SLICES = [(0, 0, 64, 1), (0, 0, 64, 2), (0, 64, 256, 32), (1, 0, 32, 1), (1, 4, 16, 2), (1, 0, 100, 1)]
_PERMUTES = [((128, 64), (0, 1)), ((128, 64), (1, 0)), ((128, 32, 16), (0, 1, 2)), ((128, 32, 16), (0, 2, 1)),
             ((128, 32, 16), (1, 0, 2))]
_RESHAPES = [((128, 4, 6), (128, 24)), ((128, 24), (128, 4, 6)), ((128, 24, 8), (128, 4, 48)),
             ((128, 2, 3, 4), (128, 6, 4)), ((128, 64), (128, 64)), ((128, 1, 64), (128, 64)),
             ((128, 64, 1), (128, 64)), ((128, 1, 1, 64), (128, 64)), ((128, 64), (128, 1, 64)),
             ((128, 64), (128, 64, 1)), ((128, 1, 64), (128, 64, 1)), ((128, 1, 4, 6), (128, 24)),
             ((1, 128, 64), (1, 8192)), ((1, 1, 64, 1), (64,)), ((64,), (1, 64, 1))]
_CHAINS = [
    ((128, 64), (("slice", (1, 0, 32, 1)), ("expand_dim", (1,)))),
    ((128, 64), (("expand_dim", (1,)), ("squeeze_dim", (1,)))),
    ((128, 24), (("reshape_dim", (1, (4, 6))), ("flatten_dims", (1, 2)))),
    ((128, 32, 16), (("slice", (1, 0, 16, 1)), ("permute", ((0, 2, 1),)))),
    ((128, 24), (("reshape_dim", (1, (4, 6))), ("permute", ((0, 2, 1),)))),
    ((128, 1, 64), (("slice", (2, 0, 32, 1)), ("broadcast", (1, 8)))),
    ((128, 4, 6), (("reshape", ((128, 2, 12),)), ("permute", ((0, 2, 1),)))),
    ((128, 32, 16), (("slice", (1, 0, 16, 1)), ("reshape", ((128, 4, 4, 16),)))),
    ((128, 24), (("reshape", ((128, 4, 6),)), ("slice", (1, 0, 2, 1)))),
    ((128, 24), (("reshape_dim", (1, (4, 6))), ("reshape", ((128, 24),)))),
    ((128, 64), (("expand_dim", (1,)), ("reshape", ((128, 64),)))),
    ((128, 1, 24), (("broadcast", (1, 8)), ("reshape", ((128, 8, 4, 6),)))),
    ((128, 1, 64), (("reshape", ((128, 64),)), ("slice", (1, 0, 32, 1)))),
]
_CHAINS_HBM = [
    ((8, 2, 1), (("select", (0, 3)), ("select", (0, 0)), ("expand_dim", (0,)), ("broadcast", (0, 128)))),
    ((8, 2, 1), (("slice", (0, 3, 4, 1)), ("select", (1, 0)), ("broadcast", (0, 128)))),
]
_NEGATIVE = [  # shape, ops, buffer, the error the test expects
    ((128, 64), (("reshape", ((128, 32),)),), H, "size mismatch"),
    ((128, 64), (("reshape", ((64, 128),)),), S, "partition dim"),
    ((128, 4, 6), (("permute", ((0, 2, 1),)), ("reshape", ((128, 24),))), H, "non-contiguous layout"),
    ((128, 1, 64), (("broadcast", (1, 8)), ("reshape", ((128, 512),))), H, "non-contiguous layout"),
    ((128, 64), (("reshape", ((64, 2, 64),)),), S, "partition dim"),
    ((128, 64), (("reshape", ((128, 5, 13),)),), H, "size mismatch"),
]
_CASTS = [("float32", "uint8"), ("uint8", "float32"), ("float32", "bfloat16"), ("float32", "int32")]
_CAST_CHAINS = [
    ((128, 512), (("slice", (1, 0, 256, 1)), ("reinterpret_cast", ("uint8",)), ("reshape_dim", (1, (4, 256))))),
    ((128, 512), (("reinterpret_cast", ("bfloat16",)), ("slice", (1, 0, 128, 1)))),
    ((128, 512), (("slice", (1, 128, 256, 1)), ("reinterpret_cast", ("bfloat16",)))),
]
_DYNAMIC = [
    ((4, 2, 8), (("select", (0, 0)),)),
    ((4, 2, 8), (("select_dynamic", (0, 1)),)),
    ((4, 2, 8), (("select_dynamic", (0, 1)), ("permute", ((1, 0),)))),
    ((4, 2, 8), (("permute", ((1, 0, 2),)), ("select_dynamic", (0, 1)))),
    ((4, 8), (("reshape_dim", (0, (2, 2))), ("select_dynamic", (0, 1)))),
    ((8, 2, 4), (("slice", (0, 0, 8, 2)), ("select_dynamic", (0, 1)))),
    ((256, 8), (("vector_select", (0,)),)),
    ((256, 2, 8), (("vector_select", (0,)),)),
    ((256, 8), (("reshape_dim", (0, (128, 2))), ("vector_select", (0,)))),
    ((512, 2, 4), (("slice", (0, 0, 512, 2)), ("vector_select", (0,)))),
    ((256, 2, 8), (("vector_select", (0,)), ("permute", ((0, 2, 1),)))),
]
# the kernels that take (dummy_out, shape) and assert inside; True: the test expects a failure
_FIXED = [("kernel_test_tensorview_from_tensorview", False), ("kernel_test_chained_ops_on_tensorview_input", False),
          ("kernel_test_reinterpret_cast", False), ("kernel_test_reinterpret_cast_cross_size_indirect", True),
          ("kernel_test_reinterpret_cast_mxfp4", False), ("kernel_test_reinterpret_cast_mxfp8", False),
          ("kernel_test_reinterpret_cast_bf16_fp16", False)]


def _static_rows() -> list[tuple[str, tuple, str, tuple, str]]:
    """(test, shape, buffer, ops, source dtype) of every static row the test runs (its skips applied)."""
    rows = []
    for shape in ((128, 64), (128, 32, 16)):
        for buf in (S, H):
            rows += [("slice", shape, buf, (("slice", sl),), "float32") for sl in _SLICES]
            rows += [("expand_dim", shape, buf, (("expand_dim", (d,)),), "float32") for d in (1, 2)]
    for shape, dims in _PERMUTES:
        rows += [("permute", shape, buf, (("permute", (dims,)),), "float32") for buf in (S, H)
                 if not (buf == S and dims[0] != 0)]
    for shape, dim in (((128, 1, 64), 1), ((128, 1), 1), ((128, 64, 1), 2)):
        rows += [("broadcast", shape, buf, (("broadcast", (dim, n)),), "float32") for buf in (S, H) for n in (8, 16)]
    for shape, dim, parts in (((128, 24), 1, (4, 6)), ((128, 24), 1, (2, 3, 4)), ((128, 24, 8), 1, (4, 6))):
        rows += [("reshape_dim", shape, buf, (("reshape_dim", (dim, parts)),), "float32") for buf in (S, H)]
    for shape, new in _RESHAPES:
        rows += [("reshape", shape, buf, (("reshape", (new,)),), "float32") for buf in (S, H)
                 if not (buf == S and shape[0] != new[0])]
    for start, end in ((1, 2), (2, 3)):
        rows += [("flatten_dims", (128, 2, 3, 4), buf, (("flatten_dims", (start, end)),), "float32") for buf in (S, H)]
    for shape, dim in (((128, 1, 64), 1), ((128, 64, 1), 2), ((128, 1, 32, 1), 1)):
        rows += [("squeeze_dim", shape, buf, (("squeeze_dim", (dim,)),), "float32") for buf in (S, H)]
    for shape in ((128, 8, 64), (128, 16, 32)):
        rows += [("select", shape, buf, (("select", (dim, i)),), "float32") for buf in (S, H)
                 for dim, i in ((1, 0), (1, 4), (2, 0), (2, 8)) if i < shape[dim]]
    rows += [("chain", shape, buf, ops, "float32") for shape, ops in _CHAINS for buf in (S, H)]
    rows += [("chain_hbm", shape, H, ops, "float32") for shape, ops in _CHAINS_HBM]
    rows += [("reinterpret_cast", (128, 512), buf, (("reinterpret_cast", (dst,)),), src)
             for buf in (S, H) for src, dst in _CASTS]
    rows += [("chain_reinterpret_cast", shape, buf, ops, "float32") for shape, ops in _CAST_CHAINS for buf in (S, H)]
    rows += [("reinterpret_cast_cross_size", (128, 512), H, (("reinterpret_cast", ("uint8",)),), "float32"),
             ("reinterpret_cast_cross_size", (128, 2048), H, (("reinterpret_cast", ("float32",)),), "uint8"),
             ("reinterpret_cast_dynamic_select_same_size", (4, 2, 8), H,
              (("select_dynamic", (0, 1)), ("reinterpret_cast", ("int32",))), "float32")]
    return rows


def _ops_text(ops: tuple) -> str:
    return " -> ".join(f"{name}{args}".replace(" ", "") for name, args in ops)


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def tensor_view_cases() -> list[Case]:
    common = {"kernel": KERNEL, "lnc": 1, "rtol": 0.0, "atol": 0.0, "test_file": TV_TEST}
    cases = [Case(name=f"{test} {_ops_text(ops)} {buf} {dt}", shapes=_dims(shape),
                  entry=f"{TV_TEST}:kernel_test_view_ops", reference=f"{HERE}:dummy_golden",
                  inputs=_view_inputs(shape, buf, ops, dt, False), outputs=("dummy_out",), **common)
             for test, shape, buf, ops, dt in _static_rows()]
    cases += [Case(name=f"negative_chain {_ops_text(ops)} {buf} (must reject: {match})", shapes=_dims(shape),
                   entry=f"{TV_TEST}:kernel_test_view_ops", reference=f"{HERE}:dummy_golden",
                   inputs=_view_inputs(shape, buf, ops, "float32", True), outputs=("dummy_out",), negative=True,
                   **common) for shape, ops, buf, match in _NEGATIVE]
    cases += [Case(name=f"{kernel.removeprefix('kernel_test_')}" + " (must reject)" * negative, shapes="[128,64]",
                   entry=f"{TV_TEST}:{kernel}", reference=f"{HERE}:dummy_golden",
                   inputs=lambda: {"dummy_out": np.zeros((1,), np.float32), "shape": (128, 64)},
                   outputs=("dummy_out",), negative=negative, **common) for kernel, negative in _FIXED]
    cases += [Case(name=f"dynamic_select {_ops_text(ops)}", shapes=_dims(shape),
                   entry=f"{TV_TEST}:kernel_dynamic_ops", reference=f"{HERE}:dynamic_view_golden",
                   inputs=_dynamic_inputs(shape, ops), outputs=("out",), **common) for shape, ops in _DYNAMIC]
    return cases
