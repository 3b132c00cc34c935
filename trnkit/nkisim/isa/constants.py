"""``nki.isa.constants``: the ISA enums as a module of their own.

AWS kernels import them from here (``from nki.isa.constants import oob_mode``,
``from nki.isa import constants`` then ``constants.dge_mode.hwdge``: nki-library
core/moe/moe_cte/moe_cte_utils.py, core/subkernels/find_nonzero_indices.py); the objects are the
same as ``nki.isa.oob_mode`` etc.
"""

from .common import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd

__all__ = ["dge_mode", "dma_engine", "engine", "matmul_perf_mode", "nc_version", "oob_mode",
           "reduce_cmd"]
