"""Published device measurements of NKI kernels that trnkit's cost model is checked against.

Each point: the kernel (ported in this folder), its shape, the device, the published figure and its unit,
where it was published (SDK version + the quoted words), its role and its tolerance. ``fit`` points
informed a fitted constant or a chosen rule (each names them: ``trnkit/nkisim/cost_params.py``,
``hardware.py``); ``check`` points are held out; ``context`` points are shown but not tested (their
published figure contains something the model does not, said in the note).

Sources searched (aws-neuron/aws-neuron-sdk at every release tag from 2.20 to HEAD 81ce03ae, its NKI
docs under ``general/nki/`` and ``nki/``; aws-neuron/nki-samples; nki-library's docs): the fused-Mamba
tutorial (times per version, trn1), the matrix-multiplication tutorial (latency table, trn1), the
kernel-optimization tutorial (profile screenshots with total times, trn2), the performance guide (one
measured initiation interval). Not used: the LayerNorm tutorial's two latencies (its text names a
(300, 1000) input, while ~2 ms only fits its script's default 4096 x 8192; shape unknown), the
performance guide's percentages without a kernel or shape ("close 70% DMA throughput utilization"),
nki-library's rmsnorm-quant "Performance Targets" (targets, not measurements), nki-samples' test
latency thresholds (upper bounds for CI, device unstated), the DMA bandwidth guide (thresholds in words,
no measured curve).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SDK = "aws-neuron-sdk"
MAMBA = f"{SDK} 2.20.0 general/nki/tutorials/fused_mamba.rst"
MATMUL = f"{SDK} 2.20.0 general/nki/tutorials/matrix_multiplication.rst (table unchanged to 2.27)"
KOPT = f"{SDK} 81ce03ae nki/guides/tutorials/kernel-optimization.rst"
PERF = f"{SDK} 81ce03ae nki/deep-dives/nki_perf_guide.rst (also 2.20.0 general/nki/nki_perf_guide.rst)"
MM_SHAPE = "lhsT [8192,4096] rhs [8192,8192]"


@dataclass(frozen=True)
class Point:
    name: str
    family: str  # "mamba" | "matmul" (2.20 tutorial) | "kernel_opt" | "scalar_chain"
    version: str  # the family's KERNELS key
    shape: str
    dims: dict = field(default_factory=dict, compare=False)  # sizes the runner builds inputs from
    dtype: str = "float32"
    published: float = 0.0
    unit: str = "ms"  # "ms" | "ns"
    role: str = "check"  # "fit" | "check" | "context"
    tolerance: float = 0.2  # |estimate mid / published - 1| allowed (tests/nkisim/test_calibration*.py)
    source: str = ""
    note: str = ""
    device: str = "trn1"
    constrains: str = ""  # what a mismatch at this point would say about the model
    metric: str = "total"  # "total" (kernel time) | "busy:<engine>" (that engine's instruction time)


def _mamba(name, version, channels, seq, ms, role, source, note="", tol=0.2):
    return Point(name, "mamba", version, f"b1 c{channels} s{seq} n16", dict(batch=1, channels=channels, seq_len=seq,
                 state_size=16), "float32", ms, "ms", role, tol, source, note, "trn1",
                 "VectorE formulas, dependent latency, compiler CSE")


def _mm(version, ms, role, quote, constrains):
    return Point(f"matmul {version}", "matmul", version, MM_SHAPE, dict(K=8192, M=4096, N=8192), "bfloat16", ms, "ms",
                 role, 0.15, f"{MATMUL} (\"{quote}\")", "", "trn1", constrains)


def _kopt(version, ms, role, note, constrains):
    return Point(f"kernel_opt {version}", "kernel_opt", version, MM_SHAPE, dict(K=8192, M=4096, N=8192), "float32",
                 ms, "ms", role, 0.15, f"{KOPT} (profile nki/img/how-to/{version}-full.png: \"{ms:.2f} ms\")", note,
                 "trn2", constrains)


POINTS: tuple[Point, ...] = (
    _mamba("mamba_v1", "v1", 4096, 512, 2.34, "fit", f"{MAMBA} (\"now 2.34 ms\")",
           "VectorE 92.16% active; the port reloads delta/u per state (16x), the compiler ~7x (profiler "
           "warning in the tutorial): the model's DMA time for v1 is ~2x the device's"),
    _mamba("mamba_v2", "v2", 4096, 512, 1.61, "fit", f"{MAMBA} (\"now 1.61 ms\")", "VectorE 99.63% active"),
    *(_mamba(f"mamba_v3 s{s}", "v3", 4096, s, ms, "check", f"{MAMBA} (seq_len scaling table)")
      for s, ms in ((1024, 3.3), (2048, 6.6), (4096, 13.3))),
    _mamba("mamba_v3", "v3", 4096, 8192, 27.8, "check", f"{MAMBA} (\"now takes 27.8 ms\")", "VectorE 94.85% active"),
    _mamba("mamba_v1 small", "v1", 256, 512, 0.17293, "context", f"{MAMBA} (\"172.93 usec\")",
           "includes NEFF start-up and tear-down, which a kernel-level model does not contain"),
    _mm("tiled", 51.80, "fit", "Original Tiled | 51.80", "DMA rate (256 B + 1 KiB rows): hardware.TRN1 sustained_fraction"),
    _mm("hoist_load", 42.96, "fit", "Optimization 1 | 42.96", "DMA rate (1 KiB rows): hardware.TRN1 sustained_fraction"),
    _mm("block_free_dimension", 22.07, "check", "Optimization 2 | 22.07", "DMA rate held out; box dependencies"),
    _mm("fully_optimized", 6.97, "check", "Optimization 3 | 6.97",
        "TensorE bf16 rate, PSUM accumulation issue, DMA/TensorE overlap"),
    _kopt("v2", 39.89, "check", "one NeuronCore (nc0); MBU 38.06%, DMA active 99.93%",
          "trn2 DMA rate (512 B + 2 KiB rows) at the documented 23 B/ns per engine"),
    _kopt("v3", 28.20, "check", "DMA active 99.73%, TensorE 99.85%", "TensorE fp32 rate (x4) with DMA near saturation"),
    _kopt("v4", 28.41, "check", "DMA active 95.70%, TensorE 99.52%", "TensorE fp32 rate (x4)"),
    _kopt("v5", 28.30, "check", "DMA active 21.54%, TensorE 99.50%, VectorE 10.55%",
          "TensorE fp32 rate, PSUM accumulation issue, VectorE PSUM add"),
    Point("kernel_opt v5 VectorE", "kernel_opt", "v5", MM_SHAPE, dict(K=8192, M=4096, N=8192), "float32", 3.08, "ms",
          "check", 0.15, f"{KOPT} (profile nki/img/how-to/v5-vec.png: \"Vector Engine Instruction Time 3.08 ms\")",
          "VectorE instruction time, not the kernel time: 4,096 fp32 PSUM + SBUF tensor_tensor adds, "
          "512 copies, 256 memsets (the profile counts 5,403 VectorE instructions)", "trn2",
          "PSUM operand read in one pass (two passes: ~4.9 ms)", "busy:vector"),
    Point("kernel_opt v5 TensorE", "kernel_opt", "v5", MM_SHAPE, dict(K=8192, M=4096, N=8192), "float32", 28.16, "ms",
          "check", 0.1, f"{KOPT} (profile nki/img/how-to/v5-pe.png: \"Tensor Engine Active Time 28.16 ms\")",
          "TensorE active time of 32,768 fp32 matmuls (the profile counts 65,536 matmul instructions: "
          "LoadStationary + MultiplyMoving)", "trn2", "nc_matmul cycles (fp32 x4), matmul_extra_cycles <= ~14",
          "busy:tensor"),
    Point("perf_guide scalar chain", "scalar_chain", "scalar_chain", "[128,1] x n, RAW-dependent", {}, "float32",
          189.0, "ns", "fit", 0.05,
          f"{PERF} (Opt #5a: \"around 189 ns (264 ScalarE cycles on NC-v2)\")",
          "initiation interval of back-to-back dependent one-element activations; no kernel source given",
          "trn1", "dependent_overhead_cycles (cost_params, mid fitted here)"),
)

# Published but not modelled: mamba_v2 at seq_len > 512 (53.33 ms at 8192 and the scaling table's v2
# column) spills SBUF to HBM on the device (qSyncSpillReload rows in the profile); the interpreter
# allocates what the kernel declares and has no spill model.
NOT_MODELLED = ("mamba_v2 at seq_len 1024..8192 (4.4 .. 52.2 ms): compiler SBUF spill/reload",)
