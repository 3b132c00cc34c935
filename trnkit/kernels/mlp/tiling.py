"""Tile sizes of the dense SwiGLU MLP kernels (host-side plain Python: the constraints and the host API
use them without loading the kernels)."""

from __future__ import annotations

from collections.abc import Callable

from trnkit.kernels._common import P_MAX as P
from trnkit.kernels._common import cdiv

TB_OPTIONS = (512, 256, 128)  # forward token tile widths, widest first (the gate / up moving size)
IB_OPTIONS = (512, 256, 128)  # I-block widths (the backward's gate / up / dA PSUM width)
BWD_TB_OPTIONS = (256, 128)  # backward token tiles: 128-row sub-tiles sharing each weight block load
# SBUF bytes per partition :func:`plan` lets a kernel's long-lived tiles take (of 208 KiB usable), so the
# next block's weight loads and the elementwise temporaries fit beside them
SBUF_PLAN_BYTES = 168 * 1024


def _fwd_bytes(H: int, I: int, TB: int, IB: int, isz: int) -> int:  # noqa: E741
    """Forward SBUF per partition: x.T and h.T of a token tile, one weight block, the output rows."""
    sub = cdiv(TB, P)
    return (cdiv(H, P) * TB + cdiv(I, P) * TB + cdiv(H, P) * 2 * IB + 2 * sub * H) * isz


def _bwd_bytes(H: int, I: int, TB: int, IB: int, isz: int) -> int:  # noqa: E741
    """Backward data path SBUF per partition: x.T, grad_out.T, the tile's dgu.T, one block of w_gate_up and
    w_down.T, the rows and ~10 fp32 elementwise tiles of a block."""
    return ((2 * cdiv(H, P) * TB + 2 * cdiv(I, P) * TB + cdiv(H, P) * 3 * IB + 3 * H * cdiv(TB, P)) * isz
            + 10 * IB * 4)


def plan(H: int, I: int, itemsize: int, tokens: int = 512) -> tuple[int, int, int, int] | None:  # noqa: E741
    """``(TB, IB, TB_bwd, IB_bwd)``: the forward's and the backward data path's token tile and I-block
    widths, the widest that fit ``SBUF_PLAN_BYTES`` (the token tile first: it sets how often the weights
    stream; no wider than one core's ``tokens`` need, so that a wider I-block can fit instead); None when
    even 128 / 128 does not (the kernels' SBUF constraint)."""
    tbs = []
    for tb in TB_OPTIONS:
        narrower_holds_all = False
        for o in TB_OPTIONS:
            narrower_holds_all = narrower_holds_all or tokens <= o < tb
        if not narrower_holds_all:
            tbs.append(tb)
    fwd = _widest(tuple(tbs), lambda tb, ib: _fwd_bytes(H, I, tb, ib, itemsize))
    bwd = _widest(BWD_TB_OPTIONS, lambda tb, ib: _bwd_bytes(H, I, tb, ib, itemsize))
    if fwd == None or bwd == None:  # noqa: E711
        return None
    return fwd[0], fwd[1], bwd[0], bwd[1]


def _widest(tb_options: tuple, need: Callable[[int, int], int]) -> tuple[int, int] | None:
    """The first ``(tb, ib)`` (widest token tile, then I-block) whose ``need(tb, ib)`` bytes fit."""
    for tb in tb_options:
        for ib in IB_OPTIONS:
            if need(tb, ib) <= SBUF_PLAN_BYTES:
                return tb, ib
    return None
