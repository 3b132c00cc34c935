"""Published device measurements of NKI kernels that trnkit's cost model is checked against.

Each point: the kernel (ported in this folder), its shape, the device, the published figure and its unit,
where it was published (SDK version + the quoted words, or the profile screenshot it was read off), the
quantity it measures (``metric``) and its tolerance. Its **role** is not written here: the fit / check /
context split is fixed in ``split.csv`` (read by :func:`role` and by ``fit.py``, which sees fit points
only). ``fit`` points informed a fitted constant or a chosen rule (split.csv names it); ``check`` points
are held out; ``context`` points are shown but not tested (their figure holds something the model does
not). ``changes.csv`` lists the published version-to-version changes the model must predict.

Sources searched (aws-neuron/aws-neuron-sdk at every release tag from 2.20 to HEAD 81ce03ae, its NKI
docs under ``general/nki/`` and ``nki/``; aws-neuron/nki-samples; nki-library's docs): the fused-Mamba
tutorial (times and VectorE-active shares per version, trn1), the matrix-multiplication tutorial (latency
table, trn1), the kernel-optimization tutorial (profile screenshots with total times and engine-active
shares, trn2), the performance guide (one measured initiation interval), the DMA overview (two profiled
kernels on trn2 with their instruction and transfer times, and a relative throughput curve). Figures read
off a screenshot's time axis (pixel positions of the bars against the axis ticks; a few ns of error) say
so in their source. Not used: the LayerNorm tutorial's two latencies (its text names a (300, 1000) input,
while ~2 ms only fits its script's default 4096 x 8192; shape unknown), the performance guide's
percentages without a kernel or shape ("close 70% DMA throughput utilization"), nki-library's
rmsnorm-quant "Performance Targets" (targets, not measurements), nki-samples' test latency thresholds
(upper bounds for CI, device unstated), the profiling guide's MLP screenshots (no times legible).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDK = "aws-neuron-sdk"
MAMBA = f"{SDK} 2.20.0 general/nki/tutorials/fused_mamba.rst"
MATMUL = f"{SDK} 2.20.0 general/nki/tutorials/matrix_multiplication.rst (table unchanged to 2.27)"
KOPT = f"{SDK} 81ce03ae nki/guides/tutorials/kernel-optimization.rst"
PERF = f"{SDK} 81ce03ae nki/deep-dives/nki_perf_guide.rst (also 2.20.0 general/nki/nki_perf_guide.rst)"
DMA_INTRO = f"{SDK} 81ce03ae nki/get-started/about/nki-dma-overview.rst"
EX1_PNG = "nki/img/overviews/nki-dma-intro-3.png"  # Example 1 profile, A[4, 4096] bf16
EX2_PNG = "nki/img/overviews/nki-dma-intro-5.png"  # Example 2 profile, A[128, 128] bf16
CURVE_JPG = "nki/img/overviews/nki-dma-intro-1.jpg"
MM_SHAPE = "lhsT [8192,4096] rhs [8192,8192]"
MM_DIMS = {"K": 8192, "M": 4096, "N": 8192}


@dataclass(frozen=True)
class Point:
    name: str
    family: str  # "mamba" | "matmul" (2.20 tutorial) | "kernel_opt" | "scalar_chain" | "dma_intro" | "dma_curve"
    version: str  # the family's KERNELS key
    shape: str
    dims: dict = field(default_factory=dict, compare=False)  # sizes the runner builds inputs from
    dtype: str = "float32"
    published: float = 0.0
    unit: str = "ms"  # "ms" | "us" | "ns" | "%" | "x" (a ratio)
    tolerance: float = 0.2  # |estimate mid / published - 1| allowed (tests/nkisim/test_calibration*.py)
    source: str = ""
    note: str = ""
    device: str = "trn1"
    constrains: str = ""  # what a mismatch at this point would say about the model
    # "total" (kernel time), "busy:<engine>" (that engine's summed instruction time), "active:<engine>"
    # (the share of the kernel time the profiler shows the engine active, %), "op:<op>" (the duration of the
    # first instruction of that op), "dma_engine" (the first load's time on one DMA engine), "dma_issue:<k>"
    # (DMA k's trigger to first byte), "dma_wake" (the first load's completion to its consumer's start),
    # "rel_throughput" (DMA throughput relative to the 32 KiB-per-partition point)
    metric: str = "total"
    # The published figure is a whole standalone execution (the tutorials' nki.benchmark latency, a profile's
    # full length): its start-up / tear-down is added to the kernel's estimate (cost_params.STANDALONE_LAUNCH).
    # False: a span read between instructions of a profile, a ratio or a share.
    standalone: bool = False

    @property
    def role(self) -> str:
        return role(self.name)


def _read_split() -> dict[str, dict]:
    with (HERE / "split.csv").open(newline="") as f:
        return {r["point"]: r for r in csv.DictReader(f)}


SPLIT: dict[str, dict] = _read_split()


def role(name: str) -> str:
    """The point's role as fixed in split.csv ("fit" | "check" | "context")."""
    try:
        return SPLIT[name]["role"]
    except KeyError:
        raise ValueError(f"calibration: point {name!r} has no row in split.csv") from None


def _mamba(name, version, channels, seq, value, source, note="", tol=0.2, metric="total", unit="ms"):
    return Point(name, "mamba", version, f"b1 c{channels} s{seq} n16", dict(batch=1, channels=channels, seq_len=seq,
                 state_size=16), "float32", value, unit, tol, source, note, "trn1",
                 "VectorE formulas, dependent latency, compiler CSE", metric, standalone=metric == "total")


def _mm(version, ms, quote, constrains):
    return Point(f"matmul {version}", "matmul", version, MM_SHAPE, MM_DIMS, "bfloat16", ms, "ms", 0.15,
                 f"{MATMUL} (\"{quote}\")", "", "trn1", constrains, standalone=True)


def _kopt(version, ms, note, constrains):
    return Point(f"kernel_opt {version}", "kernel_opt", version, MM_SHAPE, MM_DIMS, "float32", ms, "ms", 0.15,
                 f"{KOPT} (profile nki/img/how-to/{version}-full.png: \"{ms:.2f} ms\")", note, "trn2", constrains,
                 standalone=True)


def _kopt_active(version, engine, pct, quote):
    label = {"tensor": "TensorE", "dma": "DMA", "vector": "VectorE"}[engine]
    return Point(f"kernel_opt {version} {label} active", "kernel_opt", version, MM_SHAPE, MM_DIMS, "float32", pct,
                 "%", 0.2, f"{KOPT} (\"{quote}\")", "profiler's engine-active share of the kernel time", "trn2",
                 "engine-active definition (docs/cost-model.md)", f"active:{engine}")


def _intro(ex, name, value, unit, metric, where, constrains, tol=0.2):
    shape = "A[4,4096]" if ex == "ex1" else "A[128,128]"
    png = EX1_PNG if ex == "ex1" else EX2_PNG
    dims = {"rows": 4, "cols": 4096} if ex == "ex1" else {"rows": 128, "cols": 128}
    return Point(f"dma_intro {ex}{' ' + name if name else ''}", "dma_intro", ex, f"{shape} load, exp, store",
                 dims, "bfloat16", value, unit, tol, f"{DMA_INTRO} (profile {png}: {where})", "", "trn2", constrains,
                 metric)


# The DMA overview's throughput figure has no y-axis labels: the values are each point's height over the
# 32 KiB point's (read off the image), i.e. throughput relative to the 32 KiB-per-partition transfer.
CURVE = {32: 0.016, 64: 0.026, 128: 0.053, 256: 0.103, 512: 0.209, 1024: 0.424, 2048: 0.814, 4096: 0.968,
         8192: 0.983, 16384: 0.992, 32768: 1.0}


def _curve(nbytes, rel):
    return Point(f"dma_curve {nbytes}", "dma_curve", str(nbytes), f"[128, {nbytes} B] HBM -> SBUF loads",
                 {"bytes": nbytes}, "bfloat16", rel, "x", 0.2,
                 f"{DMA_INTRO} (figure {CURVE_JPG}, \"DMA Throughput varying Bytes per Partition for p_dim = 128\": "
                 "point height relative to the 32768 B point, read off the image)",
                 "the benchmark kernel is not given: modelled as back-to-back loads (micro_kernels.dma_load_stream)",
                 "trn2", "per-DMA fixed cost vs per-engine bandwidth", "rel_throughput")


BASE_POINTS: tuple[Point, ...] = (
    _mamba("mamba_v1", "v1", 4096, 512, 2.34, f"{MAMBA} (\"now 2.34 ms\")",
           "VectorE 92.16% active; the port reloads delta/u per state (16x), the compiler ~7x (profiler "
           "warning in the tutorial): the model's DMA time for v1 is ~2x the device's"),
    _mamba("mamba_v2", "v2", 4096, 512, 1.61, f"{MAMBA} (\"now 1.61 ms\")", "VectorE 99.63% active"),
    *(_mamba(f"mamba_v3 s{s}", "v3", 4096, s, ms, f"{MAMBA} (seq_len scaling table)")
      for s, ms in ((1024, 3.3), (2048, 6.6), (4096, 13.3))),
    _mamba("mamba_v3", "v3", 4096, 8192, 27.8, f"{MAMBA} (\"now takes 27.8 ms\")", "VectorE 94.85% active"),
    _mamba("mamba_v1 small", "v1", 256, 512, 0.17293, f"{MAMBA} (\"172.93 usec\")",
           "includes NEFF start-up and tear-down, which a kernel-level model does not contain"),
    _mm("tiled", 51.80, "Original Tiled | 51.80", "DMA rate (256 B + 1 KiB rows): hardware.TRN1 sustained_fraction"),
    _mm("hoist_load", 42.96, "Optimization 1 | 42.96", "DMA rate (1 KiB rows): hardware.TRN1 sustained_fraction"),
    _mm("block_free_dimension", 22.07, "Optimization 2 | 22.07", "DMA rate held out; box dependencies"),
    _mm("fully_optimized", 6.97, "Optimization 3 | 6.97",
        "TensorE bf16 rate, PSUM accumulation issue, DMA/TensorE overlap"),
    _kopt("v2", 39.89, "one NeuronCore (nc0); MBU 38.06%, DMA active 99.93%",
          "trn2 DMA: per-transfer fixed cost, queues, 23 B/ns per engine"),
    _kopt("v3", 28.20, "DMA active 99.73%, TensorE 99.85%", "TensorE fp32 rate (x4) with DMA near saturation"),
    _kopt("v4", 28.41, "DMA active 95.70%, TensorE 99.52%", "TensorE fp32 rate (x4)"),
    _kopt("v5", 28.30, "DMA active 21.54%, TensorE 99.50%, VectorE 10.55%",
          "TensorE fp32 rate, PSUM accumulation issue, VectorE PSUM add"),
    Point("kernel_opt v5 VectorE", "kernel_opt", "v5", MM_SHAPE, MM_DIMS, "float32", 3.08, "ms", 0.15,
          f"{KOPT} (profile nki/img/how-to/v5-vec.png: \"Vector Engine Instruction Time 3.08 ms\")",
          "VectorE instruction time, not the kernel time: 4,096 fp32 PSUM + SBUF tensor_tensor adds, "
          "512 copies, 256 memsets (the profile counts 5,403 VectorE instructions)", "trn2",
          "PSUM operand read in one pass (two passes: ~4.9 ms); per-instruction fixed cost", "busy:vector"),
    Point("kernel_opt v5 TensorE", "kernel_opt", "v5", MM_SHAPE, MM_DIMS, "float32", 28.16, "ms", 0.1,
          f"{KOPT} (profile nki/img/how-to/v5-pe.png: \"Tensor Engine Active Time 28.16 ms\")",
          "TensorE active time of 32,768 fp32 matmuls (the profile counts 65,536 matmul instructions: "
          "LoadStationary + MultiplyMoving)", "trn2", "nc_matmul cycles (fp32 x4), matmul_extra_cycles <= ~14",
          "busy:tensor"),
    Point("perf_guide scalar chain", "scalar_chain", "scalar_chain", "[128,1] x n, RAW-dependent", {}, "float32",
          189.0, "ns", 0.05, f"{PERF} (Opt #5a: \"around 189 ns (264 ScalarE cycles on NC-v2)\")",
          "initiation interval of back-to-back dependent one-element activations; no kernel source given",
          "trn1", "dependent_overhead_cycles (cost_params, mid fitted here)"),
)

# Engine-active shares the profiler reported (the same runs as the kernel-time points).
ACTIVE_POINTS: tuple[Point, ...] = (
    _mamba("mamba_v1 VectorE active", "v1", 4096, 512, 92.16,
           f"{MAMBA} (\"VectorE active duration has dropped to 92.16% during the core execution "
           "period\")", "profiler's engine-active share", metric="selection:vector", unit="%"),
    _mamba("mamba_v1 small VectorE active", "v1", 256, 512, 98.71, f"{MAMBA} (\"compared to 98.71% previously with "
           "the toy example\")", "profiler's engine-active share during the core execution period",
           metric="selection:vector", unit="%"),
    _mamba("mamba_v2 VectorE active", "v2", 4096, 512, 99.63, f"{MAMBA} (\"VectorE active duration is back up to "
           "99.63%\")", "profiler's engine-active share", metric="selection:vector", unit="%"),
    _mamba("mamba_v3 VectorE active", "v3", 4096, 8192, 94.85, f"{MAMBA} (\"VectorE is now 94.85% active\")",
           "profiler's engine-active share", metric="selection:vector", unit="%"),
    _kopt_active("v2", "tensor", 87.28, "the TensorE was only active 87.28% of the run"),
    _kopt_active("v2", "dma", 99.93, "the DMA engines were active 99.93% of the time"),
    _kopt_active("v3", "tensor", 99.85, "the TensorE is busy 99.85% of the time"),
    _kopt_active("v3", "dma", 99.73, "the DMA engines are now busy 99.73% of the time"),
    _kopt_active("v4", "tensor", 99.52, "dropping to 99.52% of the time"),
    _kopt_active("v4", "dma", 95.70, "the DMA engines hitting 95.70%"),
    _kopt_active("v5", "tensor", 99.50, "the TensorE is now active 99.50%"),
    _kopt_active("v5", "dma", 21.54, "the DMA engines are now active only 21.54% of the time"),
    _kopt_active("v5", "vector", 10.55, "the Vector Engine (VectorE) active 10.55% of the time"),
)

DMA_POINTS: tuple[Point, ...] = (
    # The DMA overview's two profiled kernels (trn2). Times read off the screenshots' time axes, except the
    # hover boxes' "Duration" fields (quoted).
    _intro("ex1", "", 9.93, "us", "total", "first DMA trigger 22,279 ns to the store's completion 32,210 ns",
           "DMA fixed costs, one engine for 4 partitions, ACT table load, ACTIVATE cost"),
    _intro("ex2", "", 4.98, "us", "total", "first DMA trigger 33,301 ns to the store's completion 38,282 ns",
           "DMA fixed costs, 16 engines, ACT table load, ACTIVATE cost"),
    _intro("ex1", "load engine", 1416.0, "ns", "dma_engine", "DMA-E64 hover \"Duration: 1,416ns\", 32 KiB",
           "4 partitions use one DMA engine (8 partitions per engine) at 23 B/ns"),
    _intro("ex2", "load engine", 97.0, "ns", "dma_engine", "DMA-E64 hover \"Duration: 97ns\", 2 KiB",
           "16 engines, 8 partitions (2 KiB) each"),
    _intro("ex1", "activation", 3708.0, "ns", "op:activation", "ScalarE exp bar 26,352 - 30,060 ns, N = 4096",
           "ACTIVATE fixed cost (hardware act_fixed_ns)"),
    _intro("ex2", "activation", 398.0, "ns", "op:activation", "ScalarE exp bar 36,140 - 36,538 ns, N = 128",
           "ACTIVATE fixed cost"),
    _intro("ex1", "table load", 1283.0, "ns", "op:act_table_load", "ScalarE bar before the exp, 25,057 - 26,340 ns",
           "activation-table load (hardware act_table_load_ns)"),
    _intro("ex2", "table load", 1283.0, "ns", "op:act_table_load", "ScalarE bar before the exp, 34,845 - 36,128 ns",
           "activation-table load"),
    _intro("ex1", "load issue", 1013.0, "ns", "dma_issue:0", "Pending DMA Count rises 22,279 ns, first byte 23,292 ns",
           "DMA trigger to first byte (cost_params dma_fixed_ns)"),
    _intro("ex1", "store issue", 904.0, "ns", "dma_issue:1", "Pending DMA Count rises 30,088 ns, first byte 30,992 ns",
           "DMA trigger to first byte"),
    _intro("ex2", "load issue", 740.0, "ns", "dma_issue:0", "Pending DMA Count rises 33,301 ns, first bytes ~34,040 ns",
           "DMA trigger to first byte"),
    _intro("ex2", "store issue", 619.0, "ns", "dma_issue:1", "Pending DMA Count rises 37,418 ns, first byte 38,037 ns",
           "DMA trigger to first byte"),
    _intro("ex1", "wake", 312.0, "ns", "dma_wake", "load complete 24,703 ns, first ScalarE instruction 25,015 ns",
           "DMA completion semaphore to the waiting engine (cost_params dma_wake_ns)"),
    _intro("ex2", "wake", 292.0, "ns", "dma_wake", "load complete 34,510 ns, first ScalarE instruction 34,802 ns",
           "DMA completion semaphore to the waiting engine"),
    *(_curve(b, r) for b, r in CURVE.items()),
)

def _grouped(points: tuple[Point, ...]) -> tuple[Point, ...]:
    """``points`` with the points of one kernel run next to each other (in the order kernels first appear),
    so the runner traces each kernel once."""
    def kernel(p: Point) -> tuple:
        return p.family, p.version, tuple(sorted(p.dims.items()))
    first: dict[tuple, int] = {}
    for p in points:
        first.setdefault(kernel(p), len(first))
    return tuple(sorted(points, key=lambda p: first[kernel(p)]))


# Every point run and tested.
POINTS: tuple[Point, ...] = _grouped((*BASE_POINTS, *DMA_POINTS, *ACTIVE_POINTS))

# Published but not modelled: mamba_v2 at seq_len > 512 (53.33 ms at 8192 and the scaling table's v2
# column, 4.4 / 8.9 / 13.1 / 17.6 ms at 1024 - 4096) does not fit its broadcast operands in one PSUM bank
# (the compiler splits them, in a lowering the tutorial does not show) and spills SBUF on the device while
# the profile shows SBUF "peaking at merely 50%" (fragmentation, which a capacity model does not see).
NOT_MODELLED = ("mamba_v2 at seq_len 1024..8192 (4.4 .. 53.33 ms): PSUM-bank split of the broadcasts and SBUF "
                "fragmentation spills",)
