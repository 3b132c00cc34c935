"""Trainium hardware constants for the cost model (:mod:`trnkit.nkisim.cost`).

All figures are **per physical NeuronCore** unless a name says ``chip``. A logical NeuronCore with LNC=2
(the trn2 default) is two physical cores: a ``kernel[2]`` launch runs one program instance on each, so
the cost model charges each ``program_id`` to its own core (HBM share included) and LNC=2 doubles the
bandwidth and FLOPs a kernel can use.

Source shorthand, as in ``../shared/notes/nki-facts.md``: ``[SDK] <path>`` is the page
``https://awsdocs-neuron.readthedocs-hosted.com/en/latest/<path>.html`` of the public Neuron docs
(repository ``aws-neuron/aws-neuron-sdk``). ``[SDK-old]`` is the same repository's legacy beta-1 NKI API
reference (``general/nki/api/nki/isa``), whose docstrings carry the "Estimated instruction cost"
formulas. Where public sources disagree the comment says so and names the value chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KiB = 1024


@dataclass(frozen=True)
class EngineClocks:
    """Engine clock frequencies in GHz (cycles per ns)."""

    tensor: float
    vector: float
    scalar: float
    gpsimd: float

    def ghz(self, engine: str) -> float:
        try:
            return getattr(self, engine)
        except AttributeError:
            raise ValueError(f"hardware: no clock for engine {engine!r} "
                             "(expected tensor, vector, scalar or gpsimd)") from None


@dataclass(frozen=True)
class DmaSpec:
    """DMA engines of one NeuronCore."""

    engines: int  # DMA engines (queues) per NeuronCore
    bytes_per_ns_per_engine: float  # B/ns = GB/s per engine
    # the bandwidth guide's "~1300 ns cross-engine" semaphore-to-start latency; the model uses it for a
    # cross-core semaphore (core_barrier). A transfer's own trigger-to-first-byte time is the profiled
    # cost_params.dma_fixed_ns.
    fixed_ns: float
    # SBUF partitions one DMA engine serves: a transfer uses the engines of the partitions it touches
    # ([SDK] nki/get-started/about/nki-dma-overview: "each DMA engine corresponds to 8 partition lanes";
    # its Example 1, 4 partitions, runs on "a single DMA engine").
    partitions_per_engine: int = 8
    # DMA transpose throughput from SBUF as a fraction of a copy's (1.0 where absent); from HBM it is a
    # range parameter, cost_params.dma_transpose_factor.
    transpose_sbuf_factor: float = 1.0
    # Fraction of ``engines * bytes_per_ns_per_engine`` the DMA queues sustain on HBM <-> SBUF copies
    # (on top of the small-row efficiency): 1.0 = the documented rate.
    sustained_fraction: float = 1.0
    # The fraction refitted under the other forms of cost_params.dma_overhead_form ((form, fraction)
    # pairs); "fixed" and any form not listed use ``sustained_fraction``.
    sustained_fraction_by_form: tuple[tuple[str, float], ...] = ()

    def sustained(self, form: str) -> float:
        """The sustained fraction fitted under packet-overhead form ``form``."""
        return dict(self.sustained_fraction_by_form).get(form, self.sustained_fraction)

    @property
    def peak_bytes_per_ns(self) -> float:
        return self.engines * self.bytes_per_ns_per_engine


@dataclass(frozen=True)
class Chip:
    """One NeuronCore generation (all figures per physical NeuronCore)."""

    name: str  # "trn2"
    core: str  # "NeuronCore-v3"
    cores_per_chip: int
    clocks: EngineClocks
    pe_rows: int  # systolic array rows (= contraction / partition dim)
    pe_cols: int  # systolic array columns (= stationary free size)
    tensor_tflops_bf16: float  # documented peak, dense BF16/FP16/TF32, per core
    fp8_speedup: float  # FP8 "double row" throughput factor over BF16
    fp32_slowdown: float  # fp32 matmul inputs run this many times slower
    fp32_transpose_slowdown: float  # an fp32 TensorE transpose takes this many times a bf16 one's time
    hbm_bytes_per_ns_chip: float  # HBM bandwidth of the whole chip, GB/s
    hbm_bytes_chip: int
    hbm_stacks: int  # HBM stacks per chip; each serves cores_per_chip / hbm_stacks physical cores
    dma: DmaSpec
    sbuf_partitions: int
    sbuf_bytes_per_partition: int
    sbuf_usable_bytes_per_partition: int
    psum_bytes_per_partition: int
    psum_banks: int
    min_ii_cycles: int  # minimum initiation interval of a Vector/Scalar/GpSimd instruction
    static_overhead_cycles: int  # fixed latency of an instruction whose result another one waits on
    access_init_cycles: int  # SBUF/PSUM access initialisation per instruction
    mm_init_latency_cycles: int  # TensorE matmul pipeline fill
    # ScalarE ACTIVATE: fixed time per instruction on top of N / clock, and the activation-table load
    # when the function needs a table other than the loaded one (ns; see the values for their sources)
    act_fixed_ns: float
    act_table_load_ns: float
    vector_fast_copy: float  # VectorE speed-up for bf16/fp16 SBUF tensor_copy / tensor_scalar
    vector_fast_tensor_tensor: float  # same, for tensor_tensor
    # Engine access rules ([SDK] nki/guides/architecture/trainium2_arch, "memory hierarchy": both were
    # "disallowed in NeuronCore-v2" and lifted in v3): VectorE and GpSimdE reading/writing SBUF at the same
    # time (v3: yes, except VectorE's perf mode, which uses the bus it shares with GpSimdE), and VectorE
    # and ScalarE accessing PSUM at the same time (v3: yes, unless both touch the same PSUM bank).
    vector_gpsimd_sbuf_parallel: bool = False
    vector_scalar_psum_parallel: bool = False
    # TensorE delta-current (dI/dt) throttling ([SDK] tools/neuron-explorer/overview-summary-page,
    # "Understanding throttling", and tools/neuron-explorer/glossary, "dI/dt (delta current) throttling"):
    # "On Trn2 and Trn3 the Tensor Engine starts at roughly 50% utilization of maximum utilization and
    # ramps to full over about the first ~3 microseconds after work begins. If utilization drops below
    # 50% over any ~3 microsecond window ... the limit re-engages". ``didt_threshold``: the utilization
    # below which it re-engages (0: no such throttle; trn1, the page names Trn2 and Trn3);
    # ``didt_start_limit``: the limit it starts at; ``didt_ramp_ns``: the ramp to full, also the window
    # the utilization is measured over. Applied when cost_params.didt_throttle is on.
    didt_threshold: float = 0.0
    didt_start_limit: float = 1.0
    didt_ramp_ns: float = 0.0
    # The smallest PE tile of TensorE's tiling mode, rows and columns ([SDK] nki.isa.nc_matmul, "Tiling
    # mode": "Row tiling mode slices the 128 PE rows into 2x 64 row tiles (NeuronCore-v2 or newer), or 4x 32
    # row tiles (NeuronCore-v3 or newer). Column tiling mode slices the 128 PE columns in the same
    # fashion"): the array is (128 / this)^2 blocks that matmuls on disjoint tiles hold at once (128: none).
    pe_tile_block: int = 128
    notes: dict = field(default_factory=dict, compare=False)

    @property
    def hbm_bytes_per_ns(self) -> float:
        """HBM bandwidth available to one physical core when every core of the chip streams at once (a
        kernel inside a compiled graph that runs on all cores): the chip's, split evenly."""
        return self.hbm_bytes_per_ns_chip / self.cores_per_chip

    @property
    def cores_per_hbm_stack(self) -> int:
        """Physical cores that share one HBM stack (trn2: 2, trn1: 1)."""
        return max(1, self.cores_per_chip // self.hbm_stacks)

    def hbm_bytes_per_ns_streaming(self, cores: int) -> float:
        """HBM bandwidth available to one physical core when ``cores`` of its stack's cores stream at once
        (its stack's bandwidth split among them; at most the stack's cores). HBM is a per-stack resource:
        a core reads and writes the stack it shares with its LNC partner, so a core whose partner is idle
        may use the whole stack (:data:`TRN2`'s comment gives the sources)."""
        if cores < 1:
            raise ValueError(f"hardware: hbm_bytes_per_ns_streaming needs at least 1 streaming core, got {cores}")
        return self.hbm_bytes_per_ns_chip / self.hbm_stacks / min(cores, self.cores_per_hbm_stack)

    @property
    def tensor_flops_per_ns_bf16(self) -> float:
        """Peak TensorE FLOP/ns from the array: rows x cols MACs x 2 FLOPs per cycle."""
        return self.pe_rows * self.pe_cols * 2 * self.clocks.tensor

    def tensor_flops_per_ns(self, dtype: str = "bfloat16", transpose: bool = False) -> float:
        """Peak TensorE FLOP/ns for the input dtype (``transpose``: of a PE transpose, whose fp32 rate is
        :attr:`fp32_transpose_slowdown`'s)."""
        base = self.tensor_flops_per_ns_bf16
        if dtype in ("float32",):
            return base / (self.fp32_transpose_slowdown if transpose else self.fp32_slowdown)
        if dtype.startswith("float8"):
            return base * self.fp8_speedup
        return base


TRN2 = Chip(
    name="trn2",
    core="NeuronCore-v3",
    # [SDK] about-neuron/arch/neuron-hardware/trainium2: "Every Trainium2 chip contains eight NeuronCore-V3".
    cores_per_chip=8,
    # [SDK] nki/guides/architecture/trainium2_arch (engine table): Tensor 2.4 GHz, Vector 0.96 GHz,
    # Scalar 1.2 GHz, GpSimd 1.2 GHz.
    clocks=EngineClocks(tensor=2.4, vector=0.96, scalar=1.2, gpsimd=1.2),
    # [SDK] nki/guides/architecture/trainium_inferentia2_arch: TensorE is a 128x128 PE systolic array
    # (unchanged in v3). 128*128*2*2.4 GHz = 78.6 TFLOPS, matching the documented 79.
    pe_rows=128,
    pe_cols=128,
    pe_tile_block=32,  # nc_matmul tiling mode: 4x 32 row / column tiles on NeuronCore-v3 (Chip.pe_tile_block)
    # [SDK] about-neuron/arch/neuron-hardware/neuron-core-v3: "158 cFP8 TFLOPS, and 79 BF16/FP16/TF32
    # TFLOPS". DISAGREE: the chip page [SDK] about-neuron/arch/neuron-hardware/trainium2 says 667 BF16 /
    # 1299 FP8 for 8 cores (83 / 162 per core); the per-core figures are used.
    tensor_tflops_bf16=79.0,
    fp8_speedup=2.0,  # 158 / 79, via nc_matmul perf_mode=double_row ([SDK] nki/api/nki/isa nc_matmul)
    # [SDK-old] general/nki/api/nki/isa nc_matmul "Estimated instruction cost": fp32 inputs 4x cycles
    # (neuron-core-v3 trainium2_arch table: 20 FP32 TFLOPS = 79/4).
    fp32_slowdown=4.0,
    # [SDK] nki/guides/architecture/trainium2_arch, TensorE transpose mode (NeuronCore-v3; nc_matmul(
    # is_transpose=True) or nc_transpose on TensorE): "2x speedup in FP32 transpose, vs. no transpose mode
    # enabled", i.e. half an fp32 matmul's 4x.
    fp32_transpose_slowdown=2.0,
    # [SDK] about-neuron/arch/neuron-hardware/trainium2: 96 GiB, 2.9 TB/s per chip. DISAGREE:
    # [SDK] nki/guides/architecture/trainium2_arch says 3 TB/s. 2.9 TB/s is used: 362.5 GB/s per core.
    hbm_bytes_per_ns_chip=2900.0,
    hbm_bytes_chip=96 * 1024**3,
    # HBM is per stack, two cores to a stack: [SDK] nki/guides/architecture/trainium2_arch: "4 HBM stacks
    # with a total device memory capacity of 96GiB and bandwidth of 2.9TB/s" (725 GB/s a stack, the stacks
    # taken as equal); [SDK] about-neuron/arch/neuron-features/logical-neuroncore-config: "Trainium2 devices
    # contain four 24GB HBM banks. Each bank is shared by two physical NeuronCore-v3"; [SDK] nki.isa
    # core_barrier: LNC 2 synchronises "exactly two NeuronCores that share the same HBM stack"; [SDK]
    # tools/neuron-explorer/profile-schema-reference: the profiler's hbm_max_bandwidth "is the maximum HBM
    # bandwidth of a HBM stack. For LNC1 and LNC2, the hbm_max_bandwidth is the same". So 362.5 GB/s a core
    # when both cores of a stack stream (hbm_bytes_per_ns), 725 GB/s for a core whose partner is idle
    # (hbm_bytes_per_ns_streaming(1); cost_params.LaunchParams.hbm_stack_cores).
    hbm_stacks=4,
    dma=DmaSpec(
        # [SDK] nki/about/nki-dma-overview: "Each NeuronCore (v2-v4) is paired with 16 DMA engines".
        engines=16,
        # [SDK] nki/deep-dives/nki-dma-bandwidth-guide: 23 B/ns per engine on trn2 (368 GB/s per core).
        # DISAGREE: [SDK] nki/about/nki-dma-overview gives 27.2 GB/s per engine for v2 and v3.
        bytes_per_ns_per_engine=23.0,
        # [SDK] nki/deep-dives/nki-dma-bandwidth-guide: ~1300 ns semaphore-to-start fixed cost per transfer.
        fixed_ns=1300.0,
        # [SDK] nki/guides/architecture/trainium2_arch ("DMA transpose"): throughput at most 90% of a
        # copy's for HBM -> SBUF and 50% for SBUF -> SBUF (the SBUF bound is used here; the HBM one is
        # the optimistic end of cost_params.dma_transpose_factor).
        transpose_sbuf_factor=0.5,
    ),
    # [SDK] nki/guides/architecture/trainium2_arch: SBUF 24 MiB -> 28 MiB = 128 partitions x 224 KiB.
    sbuf_partitions=128,
    sbuf_bytes_per_partition=224 * KiB,
    # nki-library budgets 224 KiB - 16 KiB - 264 B per partition ([LIB] core/mlp/mlp_cte/mlp_cte_constants.py:47,
    # https://github.com/aws-neuron/nki-library).
    sbuf_usable_bytes_per_partition=224 * KiB - 16384 - 8 - 256,
    # [SDK] nki/api/nki.language.tile_size + trainium_inferentia2_arch: PSUM 2 MiB = 128 x 16 KiB, 8 banks of 2 KiB.
    psum_bytes_per_partition=16 * KiB,
    psum_banks=8,
    # [SDK-old] general/nki/api/nki/isa (cost formulas): MIN_II ~ 64 cycles.
    min_ii_cycles=64,
    # [SDK] nki/deep-dives/nki_perf_guide (~L416-430): ~100-cycle static overhead per dependent/tiny
    # instruction, ~60-cycle SBUF/PSUM access init; MM_INIT_LATENCY 64 TensorE cycles (~L679).
    static_overhead_cycles=100,
    access_init_cycles=60,
    mm_init_latency_cycles=64,
    # FITTED on the DMA overview's Example 1 profile ([SDK] nki/get-started/about/nki-dma-overview,
    # nki-dma-intro-3.png): the exp ACTIVATE of a [4, 4096] bf16 tile runs 3,708 ns, 4096 / 1.2 GHz =
    # 3,413 ns of it per element: 295 ns fixed (benchmarks/calibration/fit.py; Example 2, N = 128, held out).
    act_fixed_ns=295.0,
    # FITTED on the same profile: the ACT_TABLE_LOAD before the first exp runs 1,283 ns.
    act_table_load_ns=1283.0,
    # [SDK] nki/guides/architecture/trainium2_arch: VectorE perf mode (SBUF, bf16/fp16, contiguous):
    # 4x tensor_copy / tensor_scalar and 2x tensor_tensor throughput versus NeuronCore-v2.
    vector_fast_copy=4.0,
    vector_fast_tensor_tensor=2.0,
    vector_gpsimd_sbuf_parallel=True,  # [SDK] trainium2_arch (perf-mode VectorE still shares GpSimdE's bus)
    vector_scalar_psum_parallel=True,  # [SDK] trainium2_arch (per PSUM bank)
    # [SDK] tools/neuron-explorer/overview-summary-page ("Understanding throttling"), Trn2 and Trn3:
    # "starts at roughly 50% utilization ... ramps to full over about the first ~3 microseconds";
    # "If utilization drops below 50% over any ~3 microsecond window ... the limit re-engages".
    didt_threshold=0.5,
    didt_start_limit=0.5,
    didt_ramp_ns=3000.0,
    notes={
        "lnc": "LNC=2 (default on trn2) pairs two physical cores: a kernel[2] launch gets 2x HBM/DMA/FLOPs "
               "([SDK] about-neuron/arch/neuron-features/logical-neuroncore-config)",
    },
)

TRN1 = Chip(
    name="trn1",
    core="NeuronCore-v2",
    # [SDK] nki/guides/architecture/trainium_inferentia2_arch: 2 NeuronCores (v2) per device.
    cores_per_chip=2,
    # [SDK] nki/guides/architecture/trainium_inferentia2_arch: Tensor 2.8 GHz, Vector 1.12 GHz,
    # Scalar 1.4 GHz, GpSimd 1.4 GHz.
    clocks=EngineClocks(tensor=2.8, vector=1.12, scalar=1.4, gpsimd=1.4),
    pe_rows=128,
    pe_cols=128,
    pe_tile_block=64,  # nc_matmul tiling mode: 2x 64 row / column tiles on NeuronCore-v2 (Chip.pe_tile_block)
    # [SDK] about-neuron/arch/neuron-hardware/neuron-core-v2 / trainium_inferentia2_arch: "92 TFLOPS"
    # BF16/FP16 per core (= 128*128*2*2.8 GHz = 91.8). DISAGREE: chip page [SDK] .../trainium says
    # 190 per chip (95 per core).
    tensor_tflops_bf16=92.0,
    fp8_speedup=1.0,  # cFP8 runs at the BF16 rate on v2 (same 92 TFLOPS figure); no double_row
    fp32_slowdown=4.0,  # 23 FP32 TFLOPS = 92 / 4 (trainium_inferentia2_arch)
    fp32_transpose_slowdown=4.0,  # no transpose mode on NeuronCore-v2: a transpose is a plain matmul
    # [SDK] nki/guides/architecture/trainium_inferentia2_arch: 32 GiB, 820 GB/s per device.
    # DISAGREE: [SDK] about-neuron/arch/neuron-hardware/trainium writes "820 GiB/sec"; 820 GB/s is used.
    hbm_bytes_per_ns_chip=820.0,
    hbm_bytes_chip=32 * 1024**3,
    # [SDK] trainium_inferentia2_arch: "2 HBM stacks" for 2 NeuronCores: one core a stack, so a core's HBM
    # bandwidth does not depend on what the other core does.
    hbm_stacks=2,
    dma=DmaSpec(
        engines=16,  # [SDK] nki/about/nki-dma-overview
        # [SDK] nki/deep-dives/nki-dma-bandwidth-guide: 17 B/ns per engine on trn1. DISAGREE: arch guide
        # says 27 GiB/s per engine, the DMA overview 27.2 GB/s.
        bytes_per_ns_per_engine=17.0,
        fixed_ns=1300.0,  # [SDK] nki/deep-dives/nki-dma-bandwidth-guide
        # FITTED on the SDK 2.20 matrix-multiplication tutorial's trn1 latencies of its two DMA-bound
        # kernels (nki_matmul_tiled_ 51.80 ms, nki_matmul_hoist_load_ 42.96 ms at [4096,8192]@[8192,8192]
        # bf16: ~104 GB/s moved, for 256 B and 1 KiB rows alike; benchmarks/calibration/fit.py, at their
        # published shapes); held out: block_free_dimension (22.07 ms), fully_optimized (6.97 ms) and the
        # fused-Mamba points. It slows the bytes, not the per-packet overhead (cost.dma_efficiency). The
        # cause is not documented (the compiler's DMA queue use is one candidate); trn2's profiles agree
        # with the documented rate (kernel-optimization v2/v3, the DMA overview's engine times).
        sustained_fraction=0.44,
        # refitted the same way under the two other forms of cost_params.dma_overhead_form
        # (fit.trn1_dma_sustained_fraction(form=...)): overhead slowed with the bytes 0.51 (0.509),
        # hidden behind the sustained limit 0.38
        sustained_fraction_by_form=(("scaled", 0.51), ("hidden", 0.38)),
    ),
    # [SDK] nki/guides/architecture/trainium_inferentia2_arch: SBUF 24 MiB = 128 x 192 KiB; PSUM 2 MiB.
    sbuf_partitions=128,
    sbuf_bytes_per_partition=192 * KiB,
    sbuf_usable_bytes_per_partition=192 * KiB - 16384 - 8 - 256,  # same reserve as trn2 (assumed)
    psum_bytes_per_partition=16 * KiB,
    psum_banks=8,
    min_ii_cycles=64,  # [SDK-old] general/nki/api/nki/isa
    static_overhead_cycles=100,  # [SDK] nki/deep-dives/nki_perf_guide
    access_init_cycles=60,
    mm_init_latency_cycles=64,
    # No trn1 profile of an ACTIVATE's fixed cost: the performance guide's 264-cycle interval of dependent
    # one-element activations on trn1 holds the whole instruction, so none is added there (assumed).
    act_fixed_ns=0.0,
    act_table_load_ns=1283.0,  # the trn2 profile's figure (no trn1 one; assumed the same)
    vector_fast_copy=1.0,  # the trn2 perf mode is relative to v2
    vector_fast_tensor_tensor=1.0,
    vector_gpsimd_sbuf_parallel=False,  # [SDK] trainium2_arch: "disallowed in NeuronCore-v2"
    vector_scalar_psum_parallel=False,  # [SDK] trainium2_arch: "disallowed in NeuronCore-v2"
)

CHIPS: dict[str, Chip] = {"trn2": TRN2, "trn1": TRN1}


def get_chip(chip: str | Chip) -> Chip:
    """Look up a chip by name ("trn2", "trn1"); a :class:`Chip` passes through."""
    if isinstance(chip, Chip):
        return chip
    try:
        return CHIPS[chip.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"hardware: unknown chip {chip!r} (known: {', '.join(CHIPS)})") from None
