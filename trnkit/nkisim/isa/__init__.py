"""``nki.isa`` of the interpreter: one module per engine, re-exported here.

``dma`` (dma_copy, dma_transpose, dma_compute), ``tensor_engine`` (nc_matmul, nc_transpose),
``vector`` / ``scalar`` / ``gpsimd`` (the compute instructions), ``shuffle`` (nc_stream_shuffle),
``gather`` (nc_n_gather, local_gather, nonzero_with_count, tensor_partition_reduce), plus the enums of ``common``
(engine,
oob_mode, dge_mode, reduce_cmd, nc_version).
"""

from ..api_names import fill_missing
from ..errors import NkiValidationError  # noqa: F401  (nki.isa.NkiValidationError)
from . import constants  # noqa: F401  (nki.isa.constants)
from ..tensor import VirtualRegister  # noqa: F401  (nki.isa.VirtualRegister)
from .common import (  # noqa: F401  (the enums: nki.isa.engine, ...)
    dge_mode,
    dma_engine,
    engine,
    get_nc_version,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
)
from .dma import *  # noqa: F403
from .gather import *  # noqa: F403
from .gpsimd import *  # noqa: F403
from .registers import *  # noqa: F403
from .scalar import *  # noqa: F403
from .shuffle import *  # noqa: F403
from .sync import *  # noqa: F403
from .tensor_engine import *  # noqa: F403
from .vector import *  # noqa: F403
from .. import controlflow as _controlflow
from .. import memory as _memory

# every call of a public instruction (each engine module's __all__) is one step of the on-chip
# liveness clock (memory.py) and one instruction of its program's control-flow record
# (controlflow.py); `common` holds enums and operand checks, not instructions
for _module in [m for m in list(globals().values()) if getattr(m, "__name__", "").startswith(__name__ + ".")
                and hasattr(m, "__all__") and m.__name__.rsplit(".", 1)[1] not in ("common", "constants")]:
    for _name in _module.__all__:
        if callable(globals()[_name]) and not isinstance(globals()[_name], type):
            globals()[_name] = _controlflow.instruction(_memory.instruction(globals()[_name]))

# Engine-type aliases of the NKI stubs (nki.isa.tensor_engine, ...); nisa.dma_engine is the enum.
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


def get_nc_sub_version() -> int:
    """Silicon revision within the generation: 0 (first revision) for the trn2 the interpreter models."""
    return 0


# documented names not implemented here: placeholders raising NotImplementedError on use
fill_missing(globals(), "nki.isa")
