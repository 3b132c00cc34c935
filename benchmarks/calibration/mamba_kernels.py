"""The fused-Mamba tutorial kernels ``mamba_v1``, ``mamba_v2``, ``mamba_v3``, ported to the current NKI API.

Adapted from the AWS Neuron SDK example ``general/nki/examples/fused_mamba/mamba_nki_kernels.py`` as
published with **Neuron SDK 2.20.0** (aws-neuron/aws-neuron-sdk commit 72825d50, Sept 2024; Copyright
(C) 2024 Amazon.com, the SDK examples are meant to be adapted). That is the version the tutorial
``general/nki/tutorials/fused_mamba.rst`` profiled on trn1; the copy at the repository's HEAD has a
different loop order in ``mamba_v1``.

What the port changes, and only that (same loops, same tiling, same shapes, fp32):

* ``nl.load`` / ``nl.store`` become ``nisa.dma_copy`` into / out of ``nl.ndarray`` tiles, and every
  ``nisa`` call writes an explicit ``dst`` (the 0.6 API).
* ``B_i.broadcast_to((128, n))`` is written out as what the 2.20 compiler lowered it to (the 2.20-era
  architecture guide): a TensorE matmul of a ones row against the one-partition tile, one fp32 matmul per
  512-column PSUM bank, the consumer reading the PSUM result directly.
* ``scanC_accum += scanC`` is a Vector ``tensor_tensor`` add into the accumulator.
* v1's ``scanC_accum`` of shape ``(n_channel_tile, par_dim(128), seq_len)`` is one SBUF tensor
  ``(128, n_channel_tile, seq_len)`` (same bytes per partition).
* the kernels return ``output`` (an ``nl.shared_hbm`` tensor) instead of writing a caller's array.
"""

from __future__ import annotations

from trnkit.nki_api import nisa, nki, nl

P = 128  # nl.tile_size.pmax: channels map to partitions
BANK = 512  # fp32 elements of one PSUM bank (nl.tile_size.psum_fmax)
SEQ_TILE = 512  # mamba_v3's seq_len_fsize ("magic number, decided through empirical profiling data")


def _broadcast_row(dst_psum, row, ones_row):
    """``row [1, n]`` -> ``dst_psum [128, n]``: a ones-vector matmul into one PSUM bank (2.20 lowering)."""
    nisa.nc_matmul(dst=dst_psum, stationary=ones_row, moving=row)


def _step(delta_t, u_t, A_col, B_hbm, C_hbm, acc, ones_row, n, scan_init):
    """Steps 1-6 of one (channel tile, state[, seq tile]): returns the scan result tile.

    ``n`` <= 512: the broadcast operands live in one PSUM bank. (v1/v2 at longer sequences split each
    broadcast consumer per bank in the compiler, and spill SBUF on the device; they are not ported.)"""
    assert n <= BANK, f"mamba port: seq chunk {n} > one PSUM bank ({BANK} fp32)"
    dt = delta_t.dtype
    deltaA = nl.ndarray((P, n), dtype=dt, buffer=nl.sbuf)
    nisa.activation(dst=deltaA, op=nl.exp, data=delta_t, scale=A_col)  # steps 1 & 2
    B_i = nl.ndarray((1, n), dtype=dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=B_i, src=B_hbm)
    deltaU = nl.ndarray((P, n), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=deltaU, data1=delta_t, data2=u_t, op=nl.multiply)  # step 3
    B_bcast = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum)
    _broadcast_row(B_bcast, B_i, ones_row)
    deltaBu = nl.ndarray((P, n), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=deltaBu, data1=deltaU, data2=B_bcast, op=nl.multiply)
    scan_res = nl.ndarray((P, n), dtype=dt, buffer=nl.sbuf)  # step 4
    nisa.tensor_tensor_scan(dst=scan_res, data0=deltaA, data1=deltaBu, initial=scan_init,
                            op0=nl.multiply, op1=nl.add)
    C_i = nl.ndarray((1, n), dtype=dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=C_i, src=C_hbm)
    C_bcast = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum)
    _broadcast_row(C_bcast, C_i, ones_row)
    scanC = nl.ndarray((P, n), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=scanC, data1=scan_res, data2=C_bcast, op=nl.multiply)  # step 5
    nisa.tensor_tensor(dst=acc, data1=acc, data2=scanC, op=nl.add)  # step 6
    return scan_res


def _ones_row(dtype):
    return nl.ones((1, P), dtype=dtype, buffer=nl.sbuf)


def _load_channels(x, i_batch, c0, seq_len):
    """``x[i_batch, c0:c0+128, 0:seq_len]`` (delta or u) into a new SBUF tile."""
    t = nl.ndarray((P, seq_len), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[i_batch, c0:c0 + P, 0:seq_len])
    return t


def _load_a(A, c0, i_state):
    """``A[c0:c0+128, i_state]`` as a [128, 1] tile (one scale per channel)."""
    t = nl.ndarray((P, 1), dtype=A.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=A[c0:c0 + P, i_state:i_state + 1])
    return t


def _prologue(delta, A):
    """The shapes every version reads, its output tensor and the ones row of the broadcasts."""
    batch_size, channels, seq_len = delta.shape
    assert channels % P == 0
    output = nl.ndarray(delta.shape, dtype=delta.dtype, buffer=nl.shared_hbm)
    return batch_size, channels // P, seq_len, A.shape[1], output, _ones_row(delta.dtype)


@nki.jit
def mamba_v1(delta, u, A, B, C):
    """2.20 ``mamba_v1``: state loop outside the channel-tile loop; delta/u loaded per (state, tile)."""
    batch_size, n_channel_tile, seq_len, state_size, output, ones_row = _prologue(delta, A)
    for i_batch in nl.affine_range(batch_size):
        scanC_accum = nl.zeros((P, n_channel_tile, seq_len), dtype=delta.dtype, buffer=nl.sbuf)
        for i_state in nl.affine_range(state_size):
            for i_channel_tile in nl.affine_range(n_channel_tile):
                c0 = i_channel_tile * P
                delta_i = _load_channels(delta, i_batch, c0, seq_len)
                A_i = _load_a(A, c0, i_state)
                u_i = _load_channels(u, i_batch, c0, seq_len)
                _step(delta_i, u_i, A_i, B[i_batch, i_state:i_state + 1, 0:seq_len],
                      C[i_batch, i_state:i_state + 1, 0:seq_len], scanC_accum[:, i_channel_tile, :],
                      ones_row, seq_len, 0.0)
        for i_channel_tile in nl.affine_range(n_channel_tile):
            c0 = i_channel_tile * P
            nisa.dma_copy(dst=output[i_batch, c0:c0 + P, 0:seq_len], src=scanC_accum[:, i_channel_tile, :])
    return output


@nki.jit
def mamba_v2(delta, u, A, B, C):
    """2.20 ``mamba_v2``: channel-tile loop outside; delta/u loaded once per tile and reused over states."""
    batch_size, n_channel_tile, seq_len, state_size, output, ones_row = _prologue(delta, A)
    for i_batch in nl.affine_range(batch_size):
        for i_channel_tile in nl.affine_range(n_channel_tile):
            c0 = i_channel_tile * P
            scanC_accum = nl.zeros((P, seq_len), dtype=delta.dtype, buffer=nl.sbuf)
            delta_i = _load_channels(delta, i_batch, c0, seq_len)  # reused by every state
            u_i = _load_channels(u, i_batch, c0, seq_len)
            for i_state in nl.affine_range(state_size):
                A_i = _load_a(A, c0, i_state)
                _step(delta_i, u_i, A_i, B[i_batch, i_state:i_state + 1, 0:seq_len],
                      C[i_batch, i_state:i_state + 1, 0:seq_len], scanC_accum, ones_row, seq_len, 0.0)
            nisa.dma_copy(dst=output[i_batch, c0:c0 + P, 0:seq_len], src=scanC_accum)
    return output


@nki.jit
def mamba_v3(delta, u, A, B, C):
    """2.20 ``mamba_v3``: v2 with the sequence tiled by 512 inside the state loop, the scan carried."""
    batch_size, n_channel_tile, seq_len, state_size, output, ones_row = _prologue(delta, A)
    assert seq_len % SEQ_TILE == 0
    n_seq_len_tile = seq_len // SEQ_TILE
    for i_batch in nl.affine_range(batch_size):
        for i_channel_tile in nl.affine_range(n_channel_tile):
            c0 = i_channel_tile * P
            scanC_accum = nl.zeros((P, seq_len), dtype=delta.dtype, buffer=nl.sbuf)
            delta_i = _load_channels(delta, i_batch, c0, seq_len)  # reused by every state
            u_i = _load_channels(u, i_batch, c0, seq_len)
            for i_state in nl.affine_range(state_size):
                A_i = _load_a(A, c0, i_state)
                scan_init = nl.zeros((P, 1), dtype=delta.dtype, buffer=nl.sbuf)
                for i_seq_len_tile in nl.static_range(n_seq_len_tile):
                    s0 = i_seq_len_tile * SEQ_TILE
                    s1 = s0 + SEQ_TILE
                    scan_res = _step(delta_i[:, s0:s1], u_i[:, s0:s1], A_i,
                                     B[i_batch, i_state:i_state + 1, s0:s1],
                                     C[i_batch, i_state:i_state + 1, s0:s1],
                                     scanC_accum[:, s0:s1], ones_row, SEQ_TILE, scan_init)
                    nisa.tensor_copy(dst=scan_init, src=scan_res[:, SEQ_TILE - 1:SEQ_TILE])
            nisa.dma_copy(dst=output[i_batch, c0:c0 + P, 0:seq_len], src=scanC_accum)
    return output


KERNELS = {"v1": mamba_v1, "v2": mamba_v2, "v3": mamba_v3}
