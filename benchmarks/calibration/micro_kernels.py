"""Micro-kernels for single published device figures of the NKI performance guide.

``scalar_dependent_chain``: the guide's "Opt #5a" profile (aws-neuron/aws-neuron-sdk
``nki/deep-dives/nki_perf_guide.rst``, also ``general/nki/nki_perf_guide.rst`` since SDK 2.20): back-to-back
ScalarE ``activation`` instructions (IDENTITY with scale and bias) each reading **one** element per
partition, each reading the previous one's output (read-after-write), issue "around 189 ns (264 ScalarE
cycles on NC-v2)" apart. The guide gives no kernel source; this is the pattern it describes: ``n``
activations on a ``[128, 1]`` fp32 tile, each consuming the previous result.
"""

from __future__ import annotations

from trnkit.nki_api import nisa, nki, nl

P = 128


@nki.jit
def scalar_dependent_chain(x, n: int = 256):
    """``n`` dependent one-element ScalarE activations (``y = 1.0001 * y + bias``) on ``x [128, 1]`` fp32."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    y = nl.ndarray((P, 1), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=y, src=x)
    bias = nl.ndarray((P, 1), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=bias, src=x)
    for _ in range(n):
        nxt = nl.ndarray((P, 1), dtype=x.dtype, buffer=nl.sbuf)
        nisa.activation(dst=nxt, op=nl.copy, data=y, scale=1.0001, bias=bias)
        y = nxt
    nisa.dma_copy(dst=out, src=y)
    return out


@nki.jit
def dma_exp_roundtrip(in_tensor):
    """The DMA overview's profiled kernel ([SDK] nki/get-started/about/nki-dma-overview.rst, "Example 1"
    ``A[4, 4096]`` and "Example 2" ``A[128, 128]``, bf16, one NeuronCore-v3): one HBM -> SBUF load, one
    ScalarE ``activation`` (exp), one SBUF -> HBM store. The code is the page's, in the current API."""
    out_tensor = nl.ndarray(in_tensor.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
    sbuf_tensor = nl.ndarray(in_tensor.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    out_tile = nl.ndarray(in_tensor.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=sbuf_tensor, src=in_tensor)
    nisa.activation(dst=out_tile, op=nl.exp, data=sbuf_tensor)
    nisa.dma_copy(dst=out_tensor, src=out_tile)
    return out_tensor


@nki.jit
def dma_load_stream(in_tensor, n: int = 16):
    """``n`` back-to-back HBM -> SBUF loads of ``in_tensor [128, F]`` (bf16), each into its own tile, no
    compute: the pattern assumed for the DMA overview's throughput figure ("DMA Throughput varying Bytes per
    Partition for p_dim = 128", [SDK] nki/img/overviews/nki-dma-intro-1.jpg), whose kernel the page does not
    give. Returns one of the tiles so the loads are not dead code."""
    out = nl.ndarray(in_tensor.shape, dtype=in_tensor.dtype, buffer=nl.shared_hbm)
    tile = None
    for _ in range(n):
        tile = nl.ndarray(in_tensor.shape, dtype=in_tensor.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=in_tensor)
    nisa.dma_copy(dst=out, src=tile)
    return out
