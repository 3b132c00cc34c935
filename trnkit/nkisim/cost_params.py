"""The cost model's uncertain parameters, and the three settings that give every estimate a range.

:mod:`trnkit.nkisim.hardware` holds figures the public Neuron documentation states (clocks, bandwidths,
array sizes). This module holds what it does not pin down: rates and rules the model had to assume,
each with its optimistic / mid / pessimistic value and where the value comes from. ``estimate()`` runs
the schedule once per setting: ``low`` (all optimistic: shortest time), ``mid``, ``high`` (all
pessimistic). :data:`SENSITIVITY` moves one parameter at a time from mid to each end.

Calibration (``benchmarks/calibration/``, table in docs/cost-model.md): published device figures of NKI
kernels, each a ``fit`` point (informed a value or rule) or a held-out ``check`` point. Chosen or fitted
here: ``compiler_cse`` (on the Mamba v1/v2 fit points; v3 held out), ``dependent_overhead_cycles`` mid
(the performance guide's measured 264-cycle interval of dependent one-element ScalarE instructions);
``psum_single_pass`` is confirmed at every end by the kernel-optimization tutorial's VectorE time (a
check point). ``hardware.TRN1.dma.sustained_fraction`` is fitted on the matmul tutorial's two DMA-bound
trn1 kernels. The DMA transpose rate, knee, transfers in flight, GpSimd rate, software-DGE cost and the
matmul overhead stay documented or assumed values: no published point constrains them. Names below say
"[SDK] page" for the public Neuron docs, as in hardware.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class ModelParams:
    """One setting of the uncertain parameters (the defaults are the mid values)."""

    # DMA transpose throughput from HBM as a fraction of a copy's (trn2; trn1 has none). [SDK]
    # nki/guides/architecture/trainium2_arch: "up to 90%" (optimistic); nki_perf_guide warns DMA
    # transposes "can degrade bandwidth significantly": 0.7 mid and 0.5 (the SBUF->SBUF figure) assumed.
    dma_transpose_factor: float = 0.7
    # Bytes of per-packet overhead of a DMA: a packet's efficiency is b / (b + knee) for a payload of b
    # contiguous bytes (the HBM-side run, up to one engine's share of the transfer). [SDK]
    # nki/deep-dives/nki-dma-bandwidth-guide: payloads <256 B are "severely overhead-bound", >=2 KiB
    # approach peak, "large payloads (>=4 KiB) are required to saturate HBM bandwidth": 256 fits those
    # words (50% / 89% / 94% at 256 B / 2 KiB / 4 KiB); 128 / 512 bracket the fit (assumed).
    dma_knee_bytes: int = 256
    # DMA trigger to first byte, per transfer, ns. Profiled on trn2 ([SDK] nki/get-started/about/
    # nki-dma-overview, profiles nki-dma-intro-3/-5.png: 1013 / 904 / 740 / 619 ns for its four
    # transfers, fit points "dma_intro ... issue"): the shortest and longest are the ends. Mid: the DMA
    # overview's throughput curve in its overhead-bound part (256 B and 1 KiB per partition, fit points
    # "dma_curve 256 / 1024"): back-to-back loads from one queue run one per ~853 ns (fit.py; the curve is a
    # one-core run, so its 32 KiB reference moves at the 16 engines' 368 GB/s, its core having its HBM stack to
    # itself: 866 ns when that reference was taken at the 362.5 GB/s in-graph share).
    dma_fixed_ns: float = 853.0
    # A DMA's completion (its semaphore update) to the start of the instruction waiting on it, ns.
    # [SDK] nki-dma-overview: each transfer "ends with a semaphore update from the DMA engine to signal
    # the completion"; profiled 312 ns (Example 1, fit point "dma_intro ex1 wake"); -20% / +20% at the
    # ends (assumed).
    dma_wake_ns: float = 312.0
    # DMA queues the compiler spreads a kernel's transfers over, each executed in order ([SDK]
    # nki-dma-overview: "DMA transfers within a queue on the same DMA engine are executed in order"); a
    # transfer's fixed cost holds its queue, so one queue starts one transfer per dma_fixed_ns. Documented:
    # "DMA transfers can be triggered by any engine sequencer" (5 of them) and hardware DGE has "two
    # instances ... commanded through either SyncE or ScalarE sequencer" ([SDK] trainium2_arch "DGE").
    # Which the compiler uses is not documented: 5 optimistic, 2 mid (the two DGE queues), 1 pessimistic.
    dma_queues: int = 2
    # Whether the compiler issues an independent DMA ahead of earlier, unrelated transfers of its queue
    # (a load ahead of the previous tile's store). [SDK] nki/guides/how-to-scheduling-apis: instructions
    # without data dependencies "could execute in any order"; dependency edges "constrain the reordering
    # that the automatic scheduler will do". How far it hoists is not documented: hoisted (a queue takes
    # each transfer once its data is ready, within SBUF capacity) optimistic and mid; program order
    # (a transfer waits for every earlier one of its queue to be issued) pessimistic.
    dma_hoist: bool = True
    # Whether hoisting is bounded by SBUF capacity: an instruction that allocates a tile waits until the
    # tiles live in program order, its own and the dead tiles not yet freed fit the device's SBUF (the
    # compiler allocates every tile in SBUF; [SDK] nki/guides/architecture/trainium2_arch: 24 MiB, 128
    # partitions). How the compiler packs, splits and reuses tiles is not documented: unbounded ("every
    # nl.ndarray its own buffer", the model's earlier assumption) optimistic and mid, bounded pessimistic.
    hoist_bounded_by_sbuf: bool = False
    # GpSimd elementwise throughput, elements per partition per cycle per input pass. [SDK]
    # trainium_inferentia2_arch: 8 processors x 512-bit SIMD = 128 fp32 lanes, so 1.0 is the ceiling;
    # no published rate for the NKI ISA kernels on it: 0.5 mid, 0.25 pessimistic (assumed).
    gpsimd_elems_per_cycle: float = 0.5
    # GpSimd engine time to generate one DMA descriptor row of an indirect (gather / scatter) DMA:
    # software DGE, which "occupies GpsimdE" ([SDK] trainium2_arch "DGE"; hardware DGE "does not support
    # indirect DMA operations"). No public figure: its 8 processors (512-bit SIMD each) can write a
    # descriptor each every few cycles, so ~1 cycle of engine time per row at best; 4 mid, 32
    # pessimistic (assumed).
    swdge_cycles_per_row: float = 4.0
    # Vector reads a PSUM operand in one pass (tensor_tensor costs N, not 2N): the beta-1 ISA cost
    # table ([SDK-old] general/nki/api/nki/isa tensor_tensor). Measured at every end: the
    # kernel-optimization tutorial's v5 profile on trn2 ([SDK] nki/guides/tutorials/kernel-optimization,
    # nki/img/how-to/v5-vec.png: "Vector Engine Instruction Time 3.08 ms", 5,403 instructions) runs
    # 4,096 fp32 tensor_tensor adds of a [128, 512] PSUM tile into SBUF; one pass each gives 2.7 ms of
    # VectorE time in all, two passes 4.9 ms (calibration point "kernel_opt v5 VectorE", held out).
    # The pessimistic setting was "two passes" before that point was found.
    psum_single_pass: bool = True
    # A scalar_tensor_tensor ((data op0 operand0) op1 operand1) costs what a tensor_tensor of data and
    # operand1 with op1 costs (one pass with an input in PSUM or on bf16 add / subtract / multiply, else
    # two; the trn2 performance mode's 2x with both inputs bf16 in SBUF): the current ISA reference ([SDK]
    # nki/api/generated/nki.isa.scalar_tensor_tensor: "The scalar broadcasting in the first operation is
    # performed at no additional performance cost, making this instruction have approximately the same
    # latency as a regular tensor_tensor instruction"), optimistic and mid. Pessimistic: the beta-1 ISA's
    # own table ([SDK-old] nki.isa.scalar_tensor_tensor "Estimated instruction cost": N with both tiles
    # bf16, op0 subtract and op1 multiply, else 2N, whatever the buffers). Not fitted: no calibration point
    # constrains it.
    stt_as_tensor_tensor: bool = True
    # Fixed latency of a compute instruction whose result another waits on. Documented: static overhead
    # 100 + SBUF/PSUM access init 60 cycles ([SDK] nki_perf_guide, trainium_inferentia2_arch "add a
    # static instruction overhead of 100 engine cycles") = 160, the optimistic end. Measured: the perf
    # guide's "Opt #5a" profile shows read-after-write-dependent one-element ScalarE instructions issuing
    # "around 189 ns (264 ScalarE cycles on NC-v2)" apart, i.e. 264 - MIN_II 64 = 200 cycles (mid; the
    # calibration point perf_guide_scalar_chain, a fit point); 240 pessimistic (assumed).
    dependent_overhead_cycles: int = 200
    # Extra engine cycles of a Vector / Scalar / GpSimd instruction with an operand in PSUM (a PSUM access
    # bubble, holding the engine). [SDK] nki/deep-dives/nki_perf_guide gives "~60 cycles" of SBUF/PSUM
    # access initialisation per instruction, as latency (in dependent_overhead_cycles). As engine time: 0
    # optimistic and mid (the fit point mamba_v1, on trn1 VectorE with PSUM operands at every step, has no
    # room for it: 60 cycles would put it 24% above its published time), 120 pessimistic (assumed).
    psum_access_cycles: int = 0
    # Engine cycles per Vector / GpSimd instruction for its SBUF/PSUM access set-up, on top of the ISA
    # formula. [SDK] nki/deep-dives/nki_perf_guide: "~60 cycles" of access initialisation per instruction
    # (whether it holds the engine is not said). Chosen at 60 (mid) on the fit point mamba_v2: VectorE-bound
    # on trn1, 99.63 % VectorE active in 1.61 ms, while its 2,593 VectorE instructions' formulas add up
    # to 1.45 ms: 60 cycles each is 0.14 ms more. 0 optimistic (the formula alone), 100 pessimistic (the
    # documented static overhead; assumed). ScalarE's own fixed time is hardware.Chip.act_fixed_ns.
    access_init_cycles: int = 60
    # Extra TensorE cycles per matmul beyond max(N, 64) (issue overhead not in the documented formula):
    # 0 documented ([SDK] trainium_inferentia2_arch "Cost Model"; nki_perf_guide "Opt #7": matmuls with
    # a short moving tensor issue "roughly every 64 cycles", the formula's floor). Measured bound: the
    # kernel-optimization tutorial's v5 profile (nki/img/how-to/v5-pe.png, "Tensor Engine Active Time
    # 28.16 ms") for 32,768 fp32 [128x128]x[128x512] matmuls = 2,062 cycles each at 2.4 GHz against
    # 4 x 512 = 2,048 documented: at most ~14 extra cycles (point "kernel_opt v5 TensorE"). 16
    # pessimistic (was 32, assumed, before that point).
    matmul_extra_cycles: int = 0
    # The compiler removes a compute instruction that recomputes an earlier result from unchanged
    # on-chip inputs (loop-invariant code motion / CSE). Chosen on Mamba v2 (fit point): without it v2
    # as written needs 2.1 ms of VectorE time, above its measured 1.61 ms at 99.6% VectorE activity; v3
    # (held out) agrees. Pessimistic: no such pass.
    compiler_cse: bool = True
    # TensorE moving columns a cycle for an nc_matmul whose moving operand is fp8 and whose perf_mode is not
    # double_row (capped at hardware.Chip.fp8_speedup: trn1's cFP8 runs at the BF16 rate). The public figures
    # disagree: [SDK] about-neuron/arch/neuron-hardware/neuron-core-v3, "A NeuronCore-v3 Tensor Engine delivers
    # 158 cFP8 TFLOPS, and 79 BF16/FP16/TF32 TFLOPS" (2x for fp8, no mode named: optimistic 2); [SDK]
    # nki.isa.matmul_perf_mode, "double_row: Double FP8 mode, 2x matmul throughput by packing two FP8
    # weight/ifmap element pairs", and nki.isa.nc_matmul, "Tensor Engine supports FP8 double performance mode,
    # enabled by setting performance mode to double_row" (the 2x named only for that mode: mid and pessimistic
    # 1). nki-library's mlp_tkg streams fp8 weights without the mode (docs/cost-model.md, "fp8 without
    # double_row").
    fp8_moving_cols_per_cycle: float = 1.0
    # Whether nc_matmuls in TensorE's tiling mode (tile_size below [128, 128]) on disjoint PE tiles run at the
    # same time. [SDK] nki.isa.nc_matmul, "Tiling mode": "Tensor Engine supports both row and column tiling
    # modes, which allow multiple nc_matmul instructions with a stationary tile size smaller than [128, 128]
    # to run in parallel to improve hardware utilization". How the sequencer interleaves them is not
    # documented: on, each tiled matmul holds only its PE blocks (hardware.Chip.pe_tile_block) for its
    # formula's cycles, and tiled matmuls start at least 64 TensorE cycles apart (the issue rate of short
    # matmuls, [SDK] nki_perf_guide Opt #7: "roughly every 64 cycles"); off, every matmul holds the whole
    # array, one after another. Off at every setting (a what-if): on at low and mid failed its criterion,
    # written before the held-out rows were re-estimated (4 mlp_tkg LNC 2 check points left +-20 %;
    # docs/cost-model.md, "TensorE tiling modes").
    pe_tiles_concurrent: bool = False
    # Whether the compiler issues a compute instruction ahead of earlier, independent instructions of the
    # same engine (each engine still runs its queue in order; the freedom is the order the compiler
    # writes): [SDK] nki/guides/how-to-scheduling-apis, instructions without data dependencies "could
    # execute in any order" and the automatic scheduler reorders them; nki.language.no_reorder, "Without
    # this directive, the compiler scheduler is free to reorder independent operations for better hardware
    # utilization"; nki/deep-dives/nki-compile-config, the order in which the engines run the instructions
    # is a decision neuronx-cc "makes ... after NKI traces the kernel" by default. Off: every engine runs the
    # kernel's instructions in program order, so a dependent instruction's latency leaves its engine idle;
    # on: a later independent instruction fills that gap. On at low and mid, off at the pessimistic end:
    # how far the scheduler goes is not documented (docs/cost-model.md, "Engines run concurrently").
    compute_reorder: bool = True
    # Whether an instruction that reads a result of the instruction before it on the same engine may start
    # as that result streams out (elementwise engines process a partition's elements in order) rather than
    # a full dependent-instruction latency after its end: the interval is then max(its busy time, MIN_II +
    # dependent_overhead_cycles), which keeps the perf guide's measured 264-cycle interval for one-element
    # instructions. Not documented for long instructions; chosen on the fit points mamba_v1 / mamba_v2
    # (VectorE-bound, 92 / 99.6 % VectorE active on the device, which gaps of the full latency after each
    # of their dependent VectorE instructions would rule out); off pessimistic.
    same_engine_streaming: bool = True

    # Per-engine DMA rate as a multiple of hardware.DmaSpec.bytes_per_ns_per_engine. The public sources
    # disagree: [SDK] nki/deep-dives/nki-dma-bandwidth-guide gives 23 B/ns per engine on trn2 (used), [SDK]
    # nki/get-started/about/nki-dma-overview "a theoretical bandwidth of 27.2 GB/s" per engine for
    # NeuronCore-v2 and -v3: 27.2 / 23 optimistic, 1.0 mid and pessimistic.
    dma_engine_rate_factor: float = 1.0
    # Whether a DMA engine reads the partition rows it serves that are adjacent in HBM as one packet: the
    # DMA overview's Example 2 says each engine does "a single 2KiB read (8 rows x 128 elements x 2B)"
    # (optimistic, mid); whether it also does so for the 4 - 32 KiB rows of its throughput figure is not
    # said, and its guidance is per partition ("transfers maximizing the number of partitions with 4KiB or
    # larger per partition"): one packet per partition row pessimistic (assumed).
    dma_merge_rows: bool = True
    # Time between one DMA engine's start on a transfer and the next engine's: [SDK] nki-dma-overview,
    # Example 1 profile (nki-dma-intro-3.png), the 15 idle engines' 4-byte semaphore writes start one after
    # another from E65 (~23,040 ns) to E79 (~23,270 ns), ~16 ns apart; the page: "the remaining 15 DMA
    # engines ... also perform a small 4B semaphore update ... the NeuronCore [can] always monitor a
    # semaphore increment of 16", so a transfer completes after the 16th engine's write, at least
    # 15 x this after its first byte. 8 / 24 ns at the ends (reading precision of the profile, assumed).
    dma_engine_stagger_ns: float = 16.0
    # Offset on hardware.Chip.act_fixed_ns (ScalarE's fixed time per instruction, fitted on one profiled
    # ACTIVATE): the bar's two ends are read off the profile to ~5 ns each, so the fixed time is known to
    # ~+-10 ns (assumed from the reading, not fitted). Applied only where the chip has a fixed time.
    act_fixed_offset_ns: float = 0.0
    # How the compiler counts SBUF liveness when it decides to spill: [SDK] nki/get-started/about/
    # memory-hierarchy-overview: "If the total size of the live data ... overflows the capacity of any
    # on-chip memory, the Neuron compiler will insert the necessary spills or refills"; [SDK]
    # nki/deep-dives/nki_perf_guide "Optimization Gotchas": "buffers sometimes need to be declared within
    # the inner loop to avoid spilling", i.e. a tile is live as the kernel orders it, not from its latest
    # possible load. True (mid, pessimistic): tiles live from first to last access in program order;
    # False (optimistic): loads sunk to their first read, spills only what that cannot avoid.
    spill_in_program_order: bool = True
    # Whether the compiler keeps part of SBUF for itself, so tiles spill above the budget AWS's own kernels
    # use ([LIB] nki-library budgets 224 KiB - 16 KiB - 264 B per partition, core/mlp/mlp_cte/
    # mlp_cte_constants.py; hardware.Chip.sbuf_usable_bytes_per_partition, also the interpreter's capacity
    # check) rather than above the device's 224 KiB ([SDK] trainium2_arch). True mid and pessimistic,
    # False optimistic. trnkit's kernels pass the interpreter's check at that budget, so neither spills them.
    sbuf_reserved: bool = True
    # Which reloads of unchanged HBM data the compiler drops. [SDK] nki/guides/tutorials/fused_mamba: the
    # compiler unrolls the loops and would "load delta/u across all channels in the first state, and then
    # likely reload them again in the later states due to a large total memory size in delta and u (16MB
    # in this case)", reloading being "inevitable when we don't have sufficient on-chip memory (SBUF) to
    # allow full reuse of the input data tensors"; its profiler reports them reloaded "around 7 times" of
    # 16 at 4,096 channels, and its 256-channel toy profile (nki/img/mamba_v1_profile_zoomed.png) shows no
    # reload at all (DMA throughput only while the inputs load and for the final store). [SDK]
    # nki_perf_guide: "Input tensor reloading could be avoided if the same data stay in SBUF". But the
    # matrix-multiplication tutorial's tiled kernel (trn1) is 17 % slower than its hoisted-loads version,
    # which dropping its lhsT reloads (16 KiB per partition at a time, 512 KiB over the kernel) would
    # erase. "resident" (mid): every reload is dropped when the distinct data the kernel reloads fits in
    # SBUF next to its peak of live tiles, none otherwise ("full reuse", cost.resident_loads); "fits"
    # (optimistic): each reload whose data can be kept until its use (cost.reused_loads); "none"
    # (pessimistic): every load moves its bytes.
    reuse_loads: str = "resident"
    # How a DMA packet's overhead combines with a chip's sustained fraction of its documented DMA rate
    # (trn1's, hardware.DmaSpec; trn2's is 1, where every choice gives the same number). Not documented:
    # [SDK] nki-dma-bandwidth-guide calls it "per-packet overhead" with the same payload thresholds for
    # TRN1 and TRN2, the Neuron Explorer DMA guide says "each packet pays a setup latency before its bytes
    # move", neither says what limits trn1's bytes. Three forms (cost.dma_efficiency), each with its own
    # fraction refitted on the matmul tutorial's two fit points (hardware.DmaSpec.sustained): "fixed" (a
    # fixed time on top of the slower bytes; mid), "scaled" (slowed with the bytes), "hidden" (behind the
    # sustained limit). Which is faster depends on the row size and the knee, so the ends take, per
    # transfer, the fastest ("fastest", optimistic) or the slowest ("slowest", pessimistic) of the three.
    # trn2 does not move under any choice (every form is the same number at its fraction 1).
    dma_overhead_form: str = "fixed"
    # TensorE dI/dt throttling (trn2; hardware.Chip.didt_*): [SDK] tools/neuron-explorer/
    # overview-summary-page, "Understanding throttling": TensorE "starts at roughly 50% utilization of
    # maximum utilization and ramps to full over about the first ~3 microseconds after work begins. If
    # utilization drops below 50% over any ~3 microsecond window ... the limit re-engages". Documented
    # hardware behaviour, off at every setting for now: which utilization it measures (the PE array's
    # time, or FLOPs against the bf16 peak, which an fp32 matmul never exceeds 25 % of) is not said, no
    # calibration point separates the two (docs/cost-model.md), and switching it on moves every trn2
    # figure with TensorE work, which have to be regenerated with it.
    didt_throttle: bool = False
    # How the compiler maps a kernel's PSUM tiles onto the PSUM banks. PSUM is 2 MiB per core, 8 banks of
    # 2 KiB per partition ([SDK] trainium2_arch: "PSUM capacity remains the same at 2MiB"; nki.language
    # tile_size psum_fmax 512 fp32 elements, one bank; hardware.Chip.psum_banks): every nl.ndarray PSUM tile
    # lives in one or more of them, so a tile that takes a bank another tile held waits for that tile's last
    # access (cost.psum_bank_plan). Whether the compiler assigns the banks in program order, and which, is not
    # documented: "rotate" (the first free banks after the last ones given, round robin, as nki-library's
    # kernels rotate their own PSUM tiles, e.g. core/mlp/mlp_cte/mlp_cte_projection.py's psum_bank index) and
    # "lowest" (the lowest free banks) assign them in program order; "unbounded" gives each tile its own
    # storage, as a compiler that assigns banks after scheduling, where they are free, would. "unbounded" at
    # every setting: program-order rotation, tried at mid and pessimistic, moved 2 of 255 held-out check
    # points inside +-20 % but sent the kernel-optimization v4 -> v5 change the wrong way and moved every
    # in-graph figure (docs/cost-model.md, "PSUM banks"); the others are what-ifs.
    psum_banks: str = "unbounded"
    # Whether a dependency between two compute engines costs a semaphore wake-up. An instruction waiting for
    # another compute engine waits on a semaphore: "These semaphores are associated with instruction
    # completion on the corresponding compute engine" ([SDK] nki_perf_guide, Opt #3; nki-dma-overview: an
    # instruction "may wait on any semaphore condition which is signaled by other compute engines"), and the
    # one profiled wake-up is a DMA completion's: 312 ns to the waiting ScalarE instruction (dma_wake_ns, fit
    # point dma_intro ex1 wake). On: an instruction that reads (or overwrites) another compute engine's result
    # starts no earlier than that instruction's end + dma_wake_ns (or its dependent-instruction latency, if
    # later; that latency was measured on a same-engine chain, perf guide, where no semaphore is involved).
    # Off: the dependent-instruction latency only (a forward without a semaphore round trip). Same-engine and
    # DMA edges are not affected (docs/cost-model.md, "Semaphores").
    compute_semaphores: bool = False
    # Whether tiles a kernel places itself on overlapping SBUF / PSUM bytes (``nl.ndarray(..., address=)``,
    # nki-library's SbufManager / ModularAllocator) are one storage for the schedule's dependencies: a tile
    # written on a slot waits for the earlier tile's last read there (WAR), and so on. NKI docs:
    # nki.language.NkiStreamBuffers, "The compiler enforces memory dependencies, including waits before a slot
    # is overwritten"; nki.language.alloc_stream_buffers, "The compiler enforces dependencies between
    # operations that use the same storage"; nki.compiler.AllocationMode, "a tile can take the address of a
    # tile freed shortly before, so a DMA into it waits for the compute that reads the earlier tile";
    # nki.compiler.force_auto_alloc "will ignore any direct allocation inside the kernel" (so without it the
    # addresses stand). The same holds for the data a placed tile holds: a reload into a placed tile is
    # dropped (reuse_loads) only onto the very slot an earlier load of the data went to, with no write on
    # that slot since (cost._PlacedReloads). On at every setting (the placement is the kernel's, not a
    # compiler choice); off is the earlier model (each placed tile its own storage, for the dependencies and
    # for the reloads), a diagnostic (docs/cost-model.md, "Placed tiles").
    placed_slots_shared: bool = True


MID = ModelParams()
LOW = ModelParams(dma_transpose_factor=0.9, dma_knee_bytes=128, dma_fixed_ns=619.0, dma_wake_ns=250.0, dma_queues=5,
                  dma_hoist=True, hoist_bounded_by_sbuf=False, gpsimd_elems_per_cycle=1.0,
                  swdge_cycles_per_row=1.0, psum_single_pass=True, stt_as_tensor_tensor=True, psum_access_cycles=0,
                  access_init_cycles=0, dependent_overhead_cycles=160,
                  matmul_extra_cycles=0, compiler_cse=True, fp8_moving_cols_per_cycle=2.0, pe_tiles_concurrent=False,
                  compute_reorder=True,
                  same_engine_streaming=True, dma_engine_rate_factor=27.2 / 23.0, dma_merge_rows=True,
                  dma_engine_stagger_ns=8.0, act_fixed_offset_ns=-10.0, spill_in_program_order=False,
                  sbuf_reserved=False, reuse_loads="fits", dma_overhead_form="fastest", didt_throttle=False,
                  psum_banks="unbounded")
HIGH = ModelParams(dma_transpose_factor=0.5, dma_knee_bytes=512, dma_fixed_ns=1013.0, dma_wake_ns=375.0, dma_queues=1,
                   dma_hoist=False, hoist_bounded_by_sbuf=True, gpsimd_elems_per_cycle=0.25,
                   swdge_cycles_per_row=32.0, psum_single_pass=True, stt_as_tensor_tensor=False, psum_access_cycles=120,
                   access_init_cycles=100, dependent_overhead_cycles=240,
                   matmul_extra_cycles=16, compiler_cse=False, fp8_moving_cols_per_cycle=1.0, pe_tiles_concurrent=False,
                   compute_reorder=False,
                   same_engine_streaming=False, dma_engine_rate_factor=1.0, dma_merge_rows=False,
                   dma_engine_stagger_ns=24.0, act_fixed_offset_ns=10.0, spill_in_program_order=True,
                   sbuf_reserved=True, reuse_loads="none", dma_overhead_form="slowest", didt_throttle=False,
                   psum_banks="unbounded")
SETTINGS: dict[str, ModelParams] = {"low": LOW, "mid": MID, "high": HIGH}

PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in fields(ModelParams))


def one_at_a_time(name: str) -> tuple[ModelParams, ModelParams]:
    """``mid`` with only ``name`` moved to its optimistic and to its pessimistic value."""
    if name not in PARAM_NAMES:
        raise ValueError(f"cost_params: unknown parameter {name!r} (known: {', '.join(PARAM_NAMES)})")
    return replace(MID, **{name: getattr(LOW, name)}), replace(MID, **{name: getattr(HIGH, name)})


@dataclass(frozen=True)
class LaunchParams:
    """What a standalone launch (one NEFF execution holding only the kernel: nki-library's tests, the SDK
    tutorials' ``nki.benchmark`` / ``nki.profile``) costs beyond the kernel's own instructions, ns. A kernel
    inside a larger compiled graph (torch-neuronx, the training step) shares its graph's one execution with
    every other op, so it pays none of it: :func:`trnkit.nkisim.cost.estimate` adds it only when asked
    (``launch=``).

    ``startup_ns``: the execution's start-up and tear-down around the kernel, once per launch. [SDK]
    nki/guides/tutorials/fused_mamba: "every NEFF execution involves certain start-up and tear-down
    overhead"; [SDK] tools/neuron-explorer/profile-schema-reference, Summary: ``total_time`` is "from
    explicit TPB start/stop notifications ... including any idle gaps", ``total_exec_time`` leaves out the
    "setup/teardown opcodes (NOP, SET_ORDERING_MODE, EVENT_SEMAPHORE, ..., TENSOR_LOAD, MODIFY_POOL_CONFIG)".
    ``core_skew_ns``: at LNC 2, how far the second physical core's start trails the first's, which the
    first waits out at the kernel's first cross-core synchronisation and which nki-library's figure (the
    larger of the two cores' counts) holds in full; not documented (the ranges in :data:`STANDALONE_LAUNCH`).
    ``hbm_stack_cores``: how many physical cores stream from the kernel's HBM stack at once, which sets each
    core's HBM bandwidth (:meth:`trnkit.nkisim.hardware.Chip.hbm_bytes_per_ns_streaming`: HBM is a per-stack
    resource shared by the two cores of an LNC 2 pair). ``None``: the launch's own programs, so an LNC 1
    kernel has its stack to itself (its partner core idle) and an LNC 2 kernel shares it between its two
    cores; ``2``: the partner core streams too. Inside a graph (``launch=None``) every core of the chip
    streams and each has its even share of the chip's bandwidth.
    """

    startup_ns: float = 0.0
    core_skew_ns: float = 0.0
    hbm_stack_cores: int | None = None

    def __post_init__(self):
        if self.hbm_stack_cores is not None and self.hbm_stack_cores < 1:
            raise ValueError(f"LaunchParams: hbm_stack_cores must be None (the launch's own programs) or at "
                             f"least 1 streaming core, got {self.hbm_stack_cores!r}")


@dataclass(frozen=True)
class LaunchRange:
    """A :class:`LaunchParams` per setting: ``estimate(..., launch=LaunchRange)`` adds ``low`` to the
    optimistic total, ``mid`` to the mid and ``high`` to the pessimistic one."""

    low: LaunchParams
    mid: LaunchParams
    high: LaunchParams

    def setting(self, name: str) -> LaunchParams:
        if name not in SETTINGS:
            raise ValueError(f"LaunchRange.setting: unknown setting {name!r} (known: {', '.join(SETTINGS)})")
        return getattr(self, name)


# The standalone launch's range. startup_ns: low 0: the [SDK] nrtpy tutorial (neuron-runtime/nrtpy/
# tutorial-validate-benchmark, "Device-side benchmark (NeuronCore execution only)") times a [4, 3] fp16
# add kernel's NEFF at 3.2 us mean (3.0 min), which the model's mid estimate of that kernel (two loads, a
# tensor_tensor, a store: 3.16 us) already fills. Mid 16.9 us: read off the one published profile of a
# whole standalone NKI execution, the fused-Mamba toy's (nki/img/mamba_v1_profile.png, trn1, SDK 2.20,
# 172.93 us): the first DMA trigger (Pending DMA Count rising) at 12.44 us, the last transfer's end at
# 168.50 us, so 172.93 - (168.50 - 12.44) = 16.87 us around the kernel (read off the image at 8.6 px/us,
# +-0.2 us; not fitted to any point, and a trn1 figure: no trn2 profile shows a whole standalone run).
# High 37.7 us: the DMA overview's trn2 profiles (nki/img/overviews/nki-dma-intro-3/-5.png) start the
# kernel's first DMA 22.3 / 33.3 us into the profile: 33.3 us of start-up (those NEFFs are torch-xla
# graphs around the kernel, so the span may hold more than a launch) plus the Mamba profile's 4.4 us
# tear-down. core_skew_ns: no published figure: 0 low and mid; high 33.3 us, a second core being at most
# one such start-up behind the first (argued, not documented). hbm_stack_cores: low and mid None (a
# standalone launch is one NEFF execution on its own cores, as the tutorials' profiles run it: at LNC 1 the
# stack's other core is idle); high 2: nki-library's harness runs tests in parallel on the other physical
# cores of the host, locking cores one by one ([LIB] test/utils/core_lock_manager.py, host_management.py
# __allocate_cores__), so an LNC 1 row's partner core may be streaming another test's data at the time.
STANDALONE_LAUNCH = LaunchRange(low=LaunchParams(startup_ns=0.0, core_skew_ns=0.0),
                                mid=LaunchParams(startup_ns=16_900.0, core_skew_ns=0.0),
                                high=LaunchParams(startup_ns=37_700.0, core_skew_ns=33_300.0,
                                                  hbm_stack_cores=2))
