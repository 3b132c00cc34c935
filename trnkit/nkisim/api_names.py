"""The documented NKI API names, and clear placeholders for the ones the interpreter lacks.

The name lists are the public names of the NKI 0.6+ API reference stubs in aws-neuron/aws-neuron-sdk at
commit 81ce03ae: ``nki/api/nki/__init__.py``, ``nki/api/nki/language/__init__.py``,
``nki/api/nki/isa/__init__.py``, ``nki/api/nki/collectives/__init__.py``. Every documented name the
interpreter does not implement is bound to a :class:`MissingApi` placeholder, so importing it works
(a kernel module that imports ``nki.isa.rng`` but never calls it still runs) and the first use raises
``NotImplementedError`` naming the API, instead of an ``AttributeError`` from deep inside.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["DOCUMENTED", "MissingApi", "fill_missing", "missing_names"]

DOCUMENTED: dict[str, tuple[str, ...]] = {
    "nki": ("jit", "simulate", "language", "isa", "collectives"),
    "nki.language": (
        "bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32",
        "bfloat16", "tfloat32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e5m2_x4",
        "float8_e4m3fn_x4", "float8_e8m0fnu", "float4_e2m1fn_x4", "sbuf", "psum", "hbm",
        "private_hbm", "shared_hbm", "tile_size", "average", "prelu", "bypass", "MemoryRegion",
        "NKIObject", "NkiTensor", "is_hbm", "is_on_chip", "is_psum", "is_sbuf", "add", "subtract",
        "multiply", "divide", "maximum", "minimum", "abs_max", "abs_min", "abs", "square", "power",
        "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "bitwise_and",
        "bitwise_or", "bitwise_xor", "invert", "left_shift", "right_shift", "logical_and",
        "logical_or", "logical_xor", "logical_not", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid",
        "relu", "gelu", "gelu_apprx_sigmoid", "gelu_apprx_tanh", "gelu_dx", "gelu_apprx_sigmoid_dx",
        "silu", "silu_dx", "softplus", "mish", "erf", "erf_dx", "reciprocal", "copy", "sin", "cos",
        "tan", "arctan", "ceil", "floor", "trunc", "negative", "sign", "fmod", "mod", "sum", "max",
        "min", "mean", "prod", "var", "all", "softmax", "rms_norm", "where", "dropout", "ones",
        "full", "zeros_like", "empty_like", "random_seed", "expand_dims", "broadcast_to",
        "transpose", "matmul", "no_reorder", "load_transpose2d", "gather_flattened", "ds",
        "affine_range", "sequential_range", "static_range", "dynamic_range", "fori_loop",
        "while_loop", "ndarray", "zeros", "load", "store", "program_id", "num_programs",
        "program_ndim", "shared_constant", "shared_identity_matrix", "device_print", "rand",
    ),
    "nki.isa": (
        "tensor_engine", "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine",
        "engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version",
        "dma_engine", "NkiInstruction", "NkiValidationError", "VirtualRegister",
        "get_nc_sub_version", "get_nc_version", "dma_copy", "tensor_copy", "memset",
        "tensor_copy_predicated", "nc_matmul", "nc_matmul_mx", "nc_transpose", "dma_transpose",
        "tensor_tensor", "tensor_scalar", "tensor_reduce", "tensor_partition_reduce",
        "tensor_scalar_cumulative", "activation", "activation_reduce", "activate2", "iota",
        "affine_select", "local_gather", "nc_n_gather", "bn_stats", "bn_aggr", "tensor_tensor_scan",
        "nc_stream_shuffle", "rng", "dropout", "set_rng_seed", "rand_set_state", "rand_get_state",
        "rand2", "exponential", "reciprocal", "max8", "sequence_bounds", "scalar_tensor_tensor",
        "tensor_scalar_reduce", "core_barrier", "dma_compute", "quantize_mx", "range_select",
        "select_reduce", "sendrecv", "register_alloc", "register_move", "register_load",
        "register_store", "nc_find_index8", "nc_match_replace8", "nonzero_with_count", "topk",
    ),
    "nki.collectives": (
        "ReplicaGroup", "all_reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all",
        "all_to_all_v", "collective_permute", "collective_permute_implicit",
        "collective_permute_implicit_reduce",
        "collective_permute_implicit_current_processing_rank_id", "rank_id",
    ),
}


class MissingApi:
    """Placeholder for a documented NKI name the interpreter does not implement: calling it, or
    using any of its attributes, raises ``NotImplementedError`` naming the API."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def fail(self) -> NoReturn:
        raise NotImplementedError(
            f"{self.qualname} is part of the documented NKI API, but trnkit's interpreter "
            f"(trnkit.nkisim) does not implement it yet; run this kernel with the real Neuron "
            f"compiler, or avoid {self.qualname} on the interpreter")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self.fail()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # keep hasattr()/inspect/copy working on the placeholder itself
            raise AttributeError(name)
        self.fail()

    def __repr__(self) -> str:
        return f"<{self.qualname}: not implemented by trnkit's interpreter>"


def fill_missing(namespace: dict[str, Any], module: str) -> None:
    """Bind a :class:`MissingApi` for every documented name of ``module`` absent from ``namespace``."""
    for name in DOCUMENTED[module]:
        if name not in namespace:
            namespace[name] = MissingApi(f"{module}.{name}")


def missing_names(namespace: dict[str, Any], module: str) -> list[str]:
    """The documented names of ``module`` that ``namespace`` binds to a placeholder."""
    return [n for n in DOCUMENTED[module] if isinstance(namespace.get(n), MissingApi)]
