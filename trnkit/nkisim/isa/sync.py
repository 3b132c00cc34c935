"""Cross-core instructions of LNC=2 launches: ``core_barrier`` and ``sendrecv``.

A grid launch runs its programs as threads in lockstep (see :mod:`trnkit.nkisim.jit`); these
instructions synchronise them with the launch's barrier (``controlflow.Rendezvous``, which takes the
waiting program out of the lockstep rotation), as the official simulator does with "thread-safe
primitives". Both need exactly two programs (``kernel[2]``), per the NKI 0.6 docs
("Currently only cores=(0, 1) is supported"; ranks "must be either 0 or 1").
"""

from __future__ import annotations

import numpy as np

from .. import controlflow as _cf
from .. import memory as _mem
from ..errors import require
from ..tensor import NkiTensor
from . import common
from .common import dma_engine, engine

__all__ = ["core_barrier", "sendrecv"]

_GPSIMD_DMA_LIMIT = {4: 1024, 2: 512, 1: 256}  # bytes per partition, by element size


def _launch(op: str) -> _mem.LaunchContext:
    ctx = _mem.current()
    launch = ctx.launch
    require(launch.num_instances == 2 and launch.barrier is not None, op, "needs an LNC=2 launch "
            "(kernel[2](...)) with 2 programs, this launch has {n}", n=launch.num_instances)
    return launch


def core_barrier(data: NkiTensor, cores: tuple[int, ...], engine: engine = engine.gpsimd,
                 name: str | None = None) -> None:
    """Wait until both cores reach this point (after writing their parts of shared ``data``)."""
    op = "core_barrier"
    common.check_tensor(op, "data", data)
    # The docs ask for shared HBM data; AWS's bwmm_shard_on_I (nki-library core/moe/moe_cte/
    # bwmm_shard_on_I.py, dynamic "hybrid" loop, tested on trn2) also synchronises on an SBUF block
    # counter, so SBUF is accepted too. The barrier itself is a semaphore exchange (no data pass).
    require(data.buffer.name in ("shared_hbm", "sbuf"), op, "data must be in shared_hbm (or SBUF), "
            "got {buffer}", buffer=data.buffer.name)
    require(tuple(cores) == (0, 1), op, "only cores=(0, 1) is supported, got {cores}", cores=cores)
    launch = _launch(op)
    _cf.sync_event(op, f"cores={tuple(cores)}")
    launch.barrier.wait()
    common.emit(op, common.engine_name(engine, common.GPSIMD), srcs={"data": data},
                attrs={"name": name})


def sendrecv(src: NkiTensor, dst: NkiTensor, send_to_rank: int, recv_from_rank: int, pipe_id: int,
             dma_engine: dma_engine = dma_engine.dma, name: str | None = None) -> None:
    """Send ``src`` to core ``send_to_rank``'s ``dst`` while receiving ``recv_from_rank``'s ``src``
    into this core's ``dst`` (both SBUF, same dtype and layout)."""
    op = "sendrecv"
    common.check_on_chip(op, "src", src, common.SBUF)
    common.check_on_chip(op, "dst", dst, common.SBUF)
    require(src.dtype == dst.dtype, op, "src dtype {src_dtype} must equal dst dtype {dst_dtype}",
            src_dtype=src.dtype, dst_dtype=dst.dtype)
    require(src.shape == dst.shape, op, "src shape {src_shape} must equal dst shape {dst_shape}",
            src_shape=src.shape, dst_shape=dst.shape)
    require(send_to_rank in (0, 1) and recv_from_rank in (0, 1), op, "ranks must be 0 or 1, got "
            "send_to_rank={send_to_rank}, recv_from_rank={recv_from_rank}",
            send_to_rank=send_to_rank, recv_from_rank=recv_from_rank)
    if dma_engine is common.dma_engine.gpsimd_dma:
        limit = _GPSIMD_DMA_LIMIT.get(src.dtype.itemsize, 256)
        per_partition = src.free_size * src.dtype.itemsize
        require(per_partition <= limit, op, "gpsimd_dma moves at most {limit} bytes per partition "
                "for {bits}-bit types, got {bytes_}", limit=limit, bits=8 * src.dtype.itemsize,
                bytes_=per_partition)
    launch = _launch(op)
    _cf.sync_event(op, f"pipe_id={pipe_id}, {src.shape} {src.dtype}")
    me = _mem.current().flat_program_id
    with launch.lock:
        launch.mailbox[(pipe_id, me, send_to_rank)] = np.array(src.np())
    launch.barrier.wait()  # every core has posted its data
    with launch.lock:
        data = launch.mailbox.pop((pipe_id, recv_from_rank, me), None)
    require(data is not None, op, "core {me} expected data from core {peer} on pipe {pipe_id}, "
            "none was sent", me=me, peer=recv_from_rank, pipe_id=pipe_id)
    common.store(dst, data)
    launch.barrier.wait()  # the pipe is free again
    nbytes = src.nbytes
    common.emit(op, common.DMA, dst=dst, srcs={"src": src}, dma_bytes=nbytes,
                attrs={"dma_engine": dma_engine.name, "pipe_id": pipe_id, "name": name})
