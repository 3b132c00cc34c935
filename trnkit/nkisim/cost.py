"""trn2 / trn1 cost model: instruction trace -> estimated time per engine, total, roofline.

``estimate(trace, chip="trn2") -> CostReport``; ``report.total_range_ns`` = (low, mid, high) under the
optimistic / mid / pessimistic settings of the uncertain parameters (:mod:`trnkit.nkisim.cost_params`),
``sensitivity(trace)`` moves one parameter at a time. Calibrated against published device figures of NKI
kernels: the SDK's fused-Mamba and matrix-multiplication tutorials (trn1), the kernel-optimization
tutorial's profiles (trn2), the performance guide's dependent-instruction interval
(``benchmarks/calibration/``; docs/cost-model.md).

Per instruction the model computes two numbers (constants in :mod:`trnkit.nkisim.hardware`):

* **busy** — how long the instruction occupies its engine (its initiation interval). Compute engines use
  the "Estimated instruction cost" formulas of the NKI ISA reference (cycles of the engine named, N =
  elements per partition, ``MIN_II`` = 64 cycles): ``nc_matmul`` ``max(min(64, N_stationary), N_moving)``
  cycles (x4 for fp32 inputs, /2 for fp8 ``double_row``), Vector/Scalar ``max(MIN_II, N)`` or
  ``max(MIN_II, 2N)``, GpSimd at its own rate (see :func:`_compute_cycles`). A DMA occupies the core's
  DMA bandwidth for ``bytes / (rate * eff)``, ``rate`` = 16 engines x 23 B/ns (trn2; trn1 16 x 17 B/ns
  x its fitted sustained fraction, ``hardware.DmaSpec.sustained_fraction``), capped by the core's HBM
  share when it touches HBM, ``eff = b / (b + knee)`` for ``b`` contiguous bytes per packet (the
  small-transfer penalty of the DMA bandwidth guide; trn1's knee x its sustained fraction: the per-packet
  overhead is a fixed time, :func:`dma_efficiency`); a ``dma_transpose`` further scales it by the
  transpose factor; an indirect DMA first takes GpSimd time for its descriptors (software DGE). Knee,
  factor, GpSimd rate and descriptor cost are :mod:`cost_params` values.
* **latency** — from issue to result: busy plus the fixed costs that do not occupy the engine
  (compute: the dependent-instruction overhead, + matmul pipeline fill; DMA: the ~1.3 us
  semaphore-to-start fixed cost, ~600 ns with hardware DGE, and the single transfer's own speed, which
  uses only the DMA engines of its partitions, started ``dma_engine_stagger_ns`` apart, completing after
  all 16 engines' semaphore writes: :func:`_dma_span`).

Engines run concurrently; the total uses one of two schedules, named in ``CostReport.model``:

* ``"list-schedule"`` when every instruction carries its data dependencies (``attrs["reads"]`` and
  ``attrs["writes"]``: sequences of ``(storage_key, lo, hi)`` flat element ranges). Each engine executes
  its own instructions in program order (in-order queues, like the hardware's per-engine instruction
  streams); an instruction starts when its engine is free and every earlier instruction it depends on
  (read-after-write, write-after-read, write-after-write on overlapping partition x free boxes, the
  interpreter's ``read_boxes`` / ``write_boxes``) has finished, except that a matmul does not wait for the
  earlier matmuls of its PSUM accumulation group (TensorE issues them back to back); DMA
  transfers start moving bytes ``fixed`` after they become ready, in the earliest gap of the core's DMA
  bandwidth (first fit: the 16 DMA queues let a ready transfer pass one still waiting), at most
  ``dma_max_inflight`` of them between issue and finish; engines that share an access path (trn1: Vector
  and GpSimd on SBUF, Vector and Scalar on PSUM; trn2: VectorE perf mode and GpSimd, Vector and Scalar on
  one PSUM bank) do not overlap there; a pure compute instruction recomputing an earlier result from
  unchanged inputs is free (``compiler_cse``). The total is the last finish time: a critical path
  through data dependencies and engine queues.
  Each ``nl.ndarray`` the compiler allocates is its own buffer, as written in the kernel (no extra
  dependencies from address reuse), so for those this is the schedule a perfectly double-buffered
  compilation would reach. Tiles the kernel places itself (``nl.ndarray(..., address=)``) sit on their
  bytes: tiles on overlapping bytes are one storage (``cost_params.placed_slots_shared``; the trace's
  ``slot_read_boxes`` / ``slot_write_boxes``), so a tile written on a slot waits for the last read of the
  tile it replaces there, as the compiler enforces, and a reload into a placed tile is dropped only onto the
  slot an earlier load of the same data went to, still unwritten since (:class:`_PlacedReloads`).
* ``"overlap-bound"`` otherwise: every engine runs back-to-back once its first input has arrived, so
  ``total = max over engines of (head + busy + tail)``, where for a compute engine ``head`` is the latency
  of the first DMA issued before its first instruction (the load it waits for) and ``tail`` the latency
  of the last DMA issued after its last instruction (the store of the result) or else its own last
  fixed latency; for the DMA queue ``head`` is one fixed cost. This is the prologue/epilogue that no
  overlap can hide.

Both lie between the roofline bound and the serialized sum (every latency added one after the other), by
construction. The roofline bound is ``max(sum FLOPs / TensorE peak for their dtype, HBM bytes / HBM
bandwidth)``; ``fraction_of_roofline = roofline / total``. Program instances (``program_id``, LNC=2
launches) run on separate physical cores: each is scheduled on its own engines and HBM share; they
synchronise at every ``core_barrier`` and launch boundary, so each such phase takes as long as its
slowest program and the phases add up (:func:`_sync_phases`).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from trnkit.nkisim import hardware
from trnkit.nkisim.cost_params import MID, SETTINGS, LaunchParams, LaunchRange, ModelParams, one_at_a_time
from trnkit.nkisim.hardware import Chip
from trnkit.nkisim.trace import DMA, ENGINES, GPSIMD, SCALAR, TENSOR, VECTOR, Instr, Operand, Trace

_HBM_BUFFERS = ("hbm", "shared_hbm", "private_hbm")
_ONCHIP = ("sbuf", "psum")
_FAST_ALU = ("add", "subtract", "multiply")  # VectorE single-pass ops on bf16 (ISA cost table)
_TWO_BYTE_FLOATS = ("bfloat16", "float16")
_FP8 = ("float8_e4m3", "float8_e4m3fn", "float8_e5m2")  # nc_matmul's fp8 inputs (the _x4 packings are MX's)
_ACTIVATE_OPS = ("activation", "activation_reduce")
# Activation functions that need no table (assumed: the pass-through functions); any other function
# needs its table loaded on ScalarE when it is not the one loaded (the DMA overview's profiles show an
# ACT_TABLE_LOAD before the first exp).
_NO_TABLE = frozenset(("", "copy", "identity", "bypass"))


@dataclass(frozen=True)
class InstrCost:
    """Cost of one instruction: engine occupancy and issue-to-result latency, in ns."""

    engine: str
    busy_ns: float
    latency_ns: float  # = fixed_ns + the time the work itself takes (>= busy_ns)
    fixed_ns: float = 0.0  # latency that does not occupy the engine (DMA fixed cost, static overheads)
    cycles: float = 0.0  # compute engines: busy in engine cycles
    gpsimd_ns: float = 0.0  # DMA: GpSimd time generating its descriptors (software DGE) before it starts
    dma_engines: tuple[int, int] = (0, 0)  # DMA: the DMA engines [first, last + 1) it moves bytes on
    transfer_ns: float = 0.0  # DMA: first byte to last byte (each of its engines busy this long)


@dataclass
class CostReport:
    """What :func:`estimate` returns. Times in ns."""

    chip: str
    model: str  # "list-schedule" | "overlap-bound" | "empty"
    n_instrs: int
    n_programs: int
    busy_ns: dict[str, float]  # per engine, the busiest program instance's
    count: dict[str, int]  # instructions per engine (all programs)
    total_ns: float
    serial_ns: float
    compute_bound_ns: float
    memory_bound_ns: float
    flops: int
    hbm_bytes: int  # HBM traffic at mid: the trace's, less the reloads the mid setting drops (resident)
    dma_bytes: int
    by_op: dict[str, tuple[int, float]] = field(default_factory=dict)  # op -> (count, busy ns summed)
    # total under the optimistic / mid / pessimistic parameter settings (cost_params); all three equal
    # when estimate() ran without ranges
    total_range_ns: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # per engine, the time it is active as a profiler shows it (list schedule only; :func:`_active`): a
    # compute engine while one of its instructions holds it, the DMA while any transfer is between trigger
    # and last byte
    active_ns: dict[str, float] = field(default_factory=dict)
    # per engine, the active time under the narrow and the wide definition (ACTIVE_DEFINITIONS)
    active_range_ns: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the standalone launch's cost (cost_params.LaunchParams) at the (low, mid, high) setting, included in
    # total_ns and total_range_ns; all zero for a kernel inside a larger graph (estimate()'s default)
    launch_ns: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def fraction_range(self) -> tuple[float, float, float]:
        """roofline / total at the (pessimistic, mid, optimistic) end: (low, mid, high) fraction."""
        lo, mid, hi = self.total_range_ns
        return tuple(self.roofline_ns / t if t > 0 else 0.0 for t in (hi, mid, lo))

    @property
    def roofline_ns(self) -> float:
        return max(self.compute_bound_ns, self.memory_bound_ns)

    @property
    def fraction_of_roofline(self) -> float:
        """roofline bound / estimate (1.0 = at the roofline)."""
        return self.roofline_ns / self.total_ns if self.total_ns > 0 else 0.0

    @property
    def utilization(self) -> dict[str, float]:
        """Per engine: busy time / total (how much of the kernel each engine is working)."""
        return {e: (b / self.total_ns if self.total_ns > 0 else 0.0) for e, b in self.busy_ns.items()}

    @property
    def active(self) -> dict[str, float]:
        """Per engine: active time / total, the profiler's "engine active %" (as a fraction)."""
        return {e: (a / self.total_ns if self.total_ns > 0 else 0.0) for e, a in self.active_ns.items()}

    @property
    def bottleneck(self) -> str:
        return max(self.busy_ns, key=self.busy_ns.get) if self.busy_ns else ""

    def as_dict(self) -> dict:
        return {
            "chip": self.chip,
            "model": self.model,
            "n_instrs": self.n_instrs,
            "n_programs": self.n_programs,
            "total_ns": self.total_ns,
            "serial_ns": self.serial_ns,
            "roofline_ns": self.roofline_ns,
            "compute_bound_ns": self.compute_bound_ns,
            "memory_bound_ns": self.memory_bound_ns,
            "fraction_of_roofline": self.fraction_of_roofline,
            "total_range_ns": list(self.total_range_ns),
            "launch_ns": list(self.launch_ns),
            "fraction_range": list(self.fraction_range),
            "flops": self.flops,
            "hbm_bytes": self.hbm_bytes,
            "dma_bytes": self.dma_bytes,
            "bottleneck": self.bottleneck,
            "busy_ns": dict(self.busy_ns),
            "utilization": self.utilization,
            "active": self.active,
            "count": dict(self.count),
            "by_op": {k: {"count": c, "busy_ns": b} for k, (c, b) in self.by_op.items()},
        }

    def __str__(self) -> str:
        lines = [
            f"estimated {self.chip} time: {_fmt_ns(self.total_ns)} ({self.model}, {self.n_instrs} instructions, "
            f"{self.n_programs} program instance{'s' if self.n_programs != 1 else ''})",
            f"range (optimistic .. pessimistic parameters): {_fmt_ns(self.total_range_ns[0])} .. "
            f"{_fmt_ns(self.total_range_ns[2])}",
        ]
        if any(self.launch_ns):
            lines.append(f"standalone launch (NEFF start-up / tear-down, LNC 2 core skew) included: "
                         f"{_fmt_ns(self.launch_ns[1])} (range {_fmt_ns(self.launch_ns[0])} .. "
                         f"{_fmt_ns(self.launch_ns[2])})")
        lines.append(f"{'engine':<8} {'instrs':>7} {'busy':>11} {'util':>6} {'active':>7}")
        for e in ENGINES:
            if self.count.get(e):
                lines.append(f"{e:<8} {self.count[e]:>7} {_fmt_ns(self.busy_ns.get(e, 0.0)):>11} "
                             f"{self.utilization.get(e, 0.0):>6.1%} {self.active.get(e, 0.0):>7.1%}")
        lines += [
            f"serialized sum      {_fmt_ns(self.serial_ns)}",
            f"roofline bound      {_fmt_ns(self.roofline_ns)} (compute {_fmt_ns(self.compute_bound_ns)}, "
            f"HBM {_fmt_ns(self.memory_bound_ns)}; {self.flops / 1e9:.3g} GFLOP, {self.hbm_bytes / 1e6:.3g} MB)",
            f"fraction of roofline {self.fraction_of_roofline:.1%} (range {self.fraction_range[0]:.1%} .. "
            f"{self.fraction_range[2]:.1%})  (bottleneck: {self.bottleneck or '-'})",
        ]
        return "\n".join(lines)


def _fmt_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.3f} us"
    return f"{ns:.1f} ns"


# ---------------------------------------------------------------------------------------------------
# per-instruction costs


def _role(instr: Instr, *roles: str) -> Operand | None:
    for op in instr.operands:
        if op.role in roles:
            return op
    return None


def _attr_name(value: object) -> str:
    """Name of an ALU / activation attribute: a string, or a function object with ``.name``/``__name__``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return str(getattr(value, "name", None) or getattr(value, "__name__", value))


def _free_size(instr: Instr) -> int:
    if instr.elems_per_partition:
        return int(instr.elems_per_partition)
    return max((o.free_elems for o in instr.operands if o.buffer in _ONCHIP), default=1)


# How a packet's overhead combines with a sustained fraction below 1 (cost_params.dma_overhead_form): the
# three forms, and the two range ends that take, per transfer, the fastest or the slowest of them
DMA_OVERHEAD_FORMS = ("scaled", "fixed", "hidden")
DMA_OVERHEAD_ENDS = ("fastest", "slowest")


def dma_efficiency(bytes_per_row: float, params: ModelParams = MID, sustained_fraction: float = 1.0) -> float:
    """Fraction of a DMA engine's sustained rate reached with ``bytes_per_row`` contiguous bytes per packet.

    A packet's overhead is ``params.dma_knee_bytes`` at the documented per-engine rate ([SDK]
    nki-dma-bandwidth-guide states its payload thresholds for TRN1 and TRN2 alike: "per-packet overhead",
    the "DMA packet rate"; the Neuron Explorer DMA guide: "each packet pays a setup latency before its
    bytes move"). How it combines with a chip whose engines sustain only ``sustained_fraction`` of that
    rate (trn1, ``hardware.DmaSpec``) is ``params.dma_overhead_form`` (one of :data:`DMA_OVERHEAD_FORMS`):
    "fixed" (mid), a fixed time on top of the slower bytes, worth ``knee x fraction`` bytes at the
    sustained rate (``b / (b + knee x f)``); "scaled", slowed with the bytes (``b / (b + knee)``);
    "hidden", behind the sustained limit, the slower of the two (``min(1, b / (f (b + knee)))``). At
    fraction 1 (trn2) the three agree. (The range ends "fastest" / "slowest" pick a form per transfer,
    :func:`_dma_cost`.)"""
    if bytes_per_row <= 0:
        return 1.0
    form, knee, f = params.dma_overhead_form, params.dma_knee_bytes, sustained_fraction
    if form == "fixed":
        return bytes_per_row / (bytes_per_row + knee * f)
    if form == "scaled":
        return bytes_per_row / (bytes_per_row + knee)
    if form == "hidden":
        return min(1.0, bytes_per_row / (f * (bytes_per_row + knee)))
    raise ValueError(f"cost: dma_overhead_form must be one of {DMA_OVERHEAD_FORMS} for one transfer's "
                     f"efficiency, got {form!r}")


def _overhead_forms(params: ModelParams) -> tuple[str, ...]:
    """The forms a transfer is priced under: one, or all three at a range end (it then takes the fastest
    or the slowest)."""
    form = params.dma_overhead_form
    if form in DMA_OVERHEAD_ENDS:
        return DMA_OVERHEAD_FORMS
    if form in DMA_OVERHEAD_FORMS:
        return (form,)
    raise ValueError(f"cost: dma_overhead_form must be one of {DMA_OVERHEAD_FORMS + DMA_OVERHEAD_ENDS}, "
                     f"got {form!r}")


def _pick(params: ModelParams, times: Iterable[float]) -> float:
    """The time a range end takes of a transfer's times under the three forms (one form: its time)."""
    return max(times) if params.dma_overhead_form == "slowest" else min(times)


def _dma_geometry(instr: Instr) -> tuple[int, int, float, bool]:
    """(bytes moved, HBM bytes, contiguous bytes per row, touches HBM) of a DMA instruction."""
    nbytes = instr.dma_bytes or max((o.nbytes for o in instr.operands), default=0)
    touches_hbm = bool(instr.hbm_bytes) or any(o.buffer in _HBM_BUFFERS for o in instr.operands)
    hbm = instr.hbm_bytes or (nbytes if touches_hbm else 0)
    onchip = [o for o in instr.operands if o.buffer in _ONCHIP and o.partitions > 0]
    if onchip:  # at most one partition's bytes per descriptor row
        o = onchip[0]
        row = o.nbytes / o.partitions
    else:  # HBM -> HBM: rows of the destination's last dim
        o = _role(instr, "dst") or instr.operands[0]
        n = math.prod(o.shape) or 1
        row = o.nbytes / n * (o.shape[-1] if o.shape else 1)
    contiguous = instr.attrs.get("contiguous_bytes")  # the interpreter's longest contiguous run
    if instr.attrs.get("transpose") and _transpose_friendly(instr):
        contiguous = None  # a DMA transpose's native unit is [128, 16] (trn2 guide), not a long run
    if contiguous:
        row = min(row, contiguous) if onchip else contiguous
    return nbytes, hbm, float(row), touches_hbm


def _transpose_friendly(instr: Instr) -> bool:
    """Whether a dma_transpose writes the hardware-friendly geometry: "the 16x DMA engines should write
    into a single [nl.par_dim(128), 16] SBUF tile in parallel at a time, where the 16 elements along
    free dimension must be contiguous. Having a multiple of 128 and a multiple of 16 in the output SBUF
    partition and inner-most free dimension sizes is a pre-requisite to achieve best DMA throughput"
    ([SDK] nki/guides/architecture/trainium2_arch.rst "DMA Transpose"). Its 32-byte runs are then the
    engines' native unit, not a small-transfer penalty; other geometries keep the contiguous-run one."""
    dst = _role(instr, "dst")
    return bool(dst and dst.shape and dst.partitions % 128 == 0 and dst.shape[-1] % 16 == 0)


def _dma_engines(instr: Instr, nbytes: int, row: float, chip: Chip) -> tuple[int, int]:
    """The DMA engines ``[first, last + 1)`` a transfer moves its bytes on. With an SBUF / PSUM side, the
    engines of the partitions it touches, 8 partitions each ([SDK] nki/get-started/about/nki-dma-overview:
    "each DMA engine corresponds to 8 partition lanes"; a [4, 4096] load runs on one engine, a [128, 128]
    one on all 16). HBM -> HBM: one engine per row, up to 16 ("parallelized up to 16 DMA engines,
    depending on the shape")."""
    d = chip.dma
    dst = _role(instr, "dst")
    sides = [o for o in instr.operands if o.buffer in _ONCHIP and o.partitions > 0]
    if sides:
        side = dst if dst is not None and dst.buffer in _ONCHIP else sides[0]
        # the side operand's own box: a store-side dma_compute also reads HBM views, whose "partitions" are rows
        box = next((b for o, b, _ in _paired(instr, instr.attrs.get("write_boxes", ()),
                                             instr.attrs.get("read_boxes", ())) if o is side), ())
        p0 = box[1] if len(box) == 5 else 0
        p1 = p0 + side.partitions
        first = p0 // d.partitions_per_engine
        last = (p1 - 1) // d.partitions_per_engine
        return first, min(d.engines, last + 1)
    rows = math.ceil(nbytes / row) if row > 0 else 1
    return 0, max(1, min(d.engines, rows))


def _dma_cost(instr: Instr, chip: Chip, params: ModelParams, hbm_per_core: float) -> InstrCost:
    d = chip.dma
    nbytes, hbm, row, touches_hbm = _dma_geometry(instr)
    first, last = _dma_engines(instr, nbytes, row, chip)
    engines = last - first
    contiguous = instr.attrs.get("contiguous_bytes")
    if touches_hbm and contiguous and params.dma_merge_rows \
            and not (instr.attrs.get("transpose") and _transpose_friendly(instr)) \
            and any(o.buffer in _ONCHIP for o in instr.operands):
        # the payload of one packet: the contiguous run in HBM, up to one engine's share (partition rows
        # adjacent in HBM merge: the DMA overview's [128, 128] load moves 2 KiB per engine in 97 ns);
        # the bandwidth guide's "large contiguous payloads (>=4 KiB)" are HBM-side runs
        row = min(float(contiguous), nbytes / engines)
    factor = 1.0
    if instr.attrs.get("transpose"):  # dma_transpose: a fraction of a copy's throughput (cost_params)
        factor = params.dma_transpose_factor if touches_hbm else min(params.dma_transpose_factor,
                                                                      d.transpose_sbuf_factor)

    def transfer_ns(form: str) -> float:
        sustained = d.sustained(form)
        p = params if form == params.dma_overhead_form else replace(params, dma_overhead_form=form)
        eff = dma_efficiency(row, p, sustained) * factor
        # each engine moves its share at its own rate (cost_params.dma_engine_rate_factor: the sources
        # disagree); HBM traffic is capped at the HBM bandwidth the core has (``hbm_per_core``: its share of
        # its stack, hardware.Chip.hbm_bytes_per_ns_streaming) over the engines the transfer uses (one
        # engine alone is not held to a sixteenth of it)
        rate = d.bytes_per_ns_per_engine * sustained * params.dma_engine_rate_factor
        if touches_hbm and hbm:  # HBM -> HBM crosses HBM twice per byte moved
            rate = min(rate, hbm_per_core / engines * nbytes / hbm)
        return nbytes / (engines * rate * eff)

    transfer = _pick(params, (transfer_ns(f) for f in _overhead_forms(params)))
    # what the transfer takes of the core's whole DMA bandwidth (the engine-busy sum the report shows)
    busy = transfer * engines / d.engines
    # Indirect (gather / scatter) DMAs have no hardware DGE ([SDK] trainium2_arch "DGE"): GpSimd writes
    # one descriptor per row first (software DGE), occupying GpsimdE.
    rows = max((o.partitions for o in instr.operands if o.buffer in _ONCHIP), default=0) or \
        (math.ceil(nbytes / row) if row > 0 else 1)
    gpsimd = rows * params.swdge_cycles_per_row / chip.clocks.gpsimd if instr.attrs.get("indirect") else 0.0
    fixed = params.dma_fixed_ns
    c = InstrCost(DMA, busy, 0.0, fixed, gpsimd_ns=gpsimd, dma_engines=(first, last), transfer_ns=transfer)
    return replace(c, latency_ns=fixed + _dma_span(c, chip, params) + params.dma_wake_ns)


def _tensor_operands(instr: Instr, params: ModelParams) -> list:
    """The operands VectorE streams for ``instr``'s cost: all of them, except a ``scalar_tensor_tensor``'s
    ``operand0`` when it is priced as a ``tensor_tensor`` (:func:`_stt_as_tensor_tensor`): its scalar
    broadcast comes "at no additional performance cost"."""
    if _stt_as_tensor_tensor(instr, params):
        return [o for o in instr.operands if o.role != "operand0"]
    return list(instr.operands)


def _stt_as_tensor_tensor(instr: Instr, params: ModelParams) -> bool:
    """Whether ``instr`` is a ``scalar_tensor_tensor`` priced as the ``tensor_tensor`` of ``data`` and
    ``operand1`` (``ModelParams.stt_as_tensor_tensor``)."""
    return instr.op == "scalar_tensor_tensor" and params.stt_as_tensor_tensor


def _vector_perf_speedup(instr: Instr, chip: Chip, params: ModelParams = MID,
                         operands: list | None = None) -> float:
    """VectorE's trn2 performance-mode speed-up over NeuronCore-v2 ([SDK] nki/guides/architecture/
    trainium2_arch "Vector Engine Performance Mode"; every tensor BF16/FP16, condition 1b):

    * ``tensor_copy`` / ``tensor_scalar``: 4x with input and output in SBUF and the inner-most free
      dimension contiguous (1a + 1c); 2x in SBUF without 1c, or contiguous with one of them in PSUM;
    * ``tensor_tensor`` (and a ``scalar_tensor_tensor`` priced as one): 2x with both inputs in SBUF (no
      contiguity condition);
    * anything else: 1x.

    ``operands``: :func:`_tensor_operands` of ``instr``, when the caller has them.
    """
    operands = _tensor_operands(instr, params) if operands is None else operands
    if instr.engine != VECTOR or chip.vector_fast_copy <= 1.0 or not operands:
        return 1.0
    if not all(o.dtype in _TWO_BYTE_FLOATS for o in operands):
        return 1.0
    in_psum = sum(o.buffer == "psum" for o in operands)
    if instr.op == "tensor_tensor" or _stt_as_tensor_tensor(instr, params):
        inputs = [o for o in operands if o.role != "dst"]
        return chip.vector_fast_tensor_tensor if all(o.buffer == "sbuf" for o in inputs) else 1.0
    if instr.op in ("tensor_copy", "tensor_scalar"):
        inner = instr.attrs.get("inner_contiguous", instr.attrs.get("contiguous", True))
        if in_psum == 0:
            return chip.vector_fast_copy if inner else chip.vector_fast_copy / 2
        return chip.vector_fast_copy / 2 if in_psum == 1 and inner else 1.0
    return 1.0


def _vector_perf_mode(instr: Instr, chip: Chip, params: ModelParams = MID) -> bool:
    """Whether VectorE runs this instruction in its trn2 performance mode (it then uses the SBUF bus it
    shares with GpSimdE, [SDK] trainium2_arch "memory hierarchy")."""
    return _vector_perf_speedup(instr, chip, params) > 1.0


def _gpsimd_cycles(instr: Instr, n: int, chip: Chip, params: ModelParams) -> float:
    """GpSimd elementwise work: one pass per input tile at ``params.gpsimd_elems_per_cycle`` (the beta-1
    formulas are VectorE's and are not used for GpSimd, except iota / affine_select's own ``150 + N``)."""
    if instr.op in ("iota", "affine_select"):
        return 150.0 + n
    passes = max(1, sum(1 for o in instr.operands if o.role != "dst"))
    return max(chip.min_ii_cycles, passes * n / params.gpsimd_elems_per_cycle)


def _compute_cycles(instr: Instr, chip: Chip, params: ModelParams = MID) -> float:
    """Engine cycles of a compute instruction (the ISA reference's estimated instruction cost)."""
    op, eng, min_ii = instr.op, instr.engine, chip.min_ii_cycles
    n = _free_size(instr)
    ins = [o for o in instr.operands if o.role != "dst"]
    dst = _role(instr, "dst")
    if op == "nc_matmul":
        st, mv = _role(instr, "stationary"), _role(instr, "moving")
        n_st = st.free_elems if st else min(128, n)
        n_mv = mv.free_elems if mv else n
        double_row = _attr_name(instr.attrs.get("perf_mode")).lower() == "double_row"
        if mv is not None and mv.dtype in _FP8 and not double_row:  # the issue floor stays, the stream speeds up
            n_mv /= min(params.fp8_moving_cols_per_cycle, chip.fp8_speedup)
        cycles = float(max(min(64, n_st), n_mv))
        dtype = (st or mv or (ins[0] if ins else None))
        if dtype is not None and dtype.dtype == "float32":
            cycles *= chip.fp32_transpose_slowdown if _is_pe_transpose(instr) else chip.fp32_slowdown
        if double_row:
            cycles /= chip.fp8_speedup
        return cycles + params.matmul_extra_cycles
    if op == "nc_transpose" and eng == TENSOR:
        src = ins[0] if ins else dst
        p = src.partitions if src else 128
        f = src.free_elems if src else n
        fp32 = src is not None and src.dtype == "float32"
        return float(max(p, min(64, f))) * (chip.fp32_transpose_slowdown if fp32 else 1.0) \
            + params.matmul_extra_cycles
    if eng == GPSIMD:
        return _gpsimd_cycles(instr, n, chip, params)
    operands = _tensor_operands(instr, params)
    two_byte = bool(operands) and all(o.dtype in _TWO_BYTE_FLOATS for o in operands)
    speedup = _vector_perf_speedup(instr, chip, params, operands)
    alu = _attr_name(instr.attrs.get("op") or instr.attrs.get("alu_op")).lower()
    psum_in = params.psum_single_pass and any(o.buffer == "psum" for o in operands if o.role != "dst")
    if op == "tensor_tensor" or _stt_as_tensor_tensor(instr, params):  # stt: alu is op1, the tensor op
        single = psum_in or (two_byte and alu in _FAST_ALU)
        cycles = n if single else 2 * n
        cycles /= speedup
        return max(min_ii, cycles)
    if op == "tensor_tensor_scan":  # [SDK-old] beta-1 ISA: 2N (two input tiles)
        return max(min_ii, 2 * n)
    if op == "scalar_tensor_tensor":  # [SDK-old] beta-1 ISA cost table: N only in its one listed case
        data, operand1 = _role(instr, "data"), _role(instr, "operand1")
        fast = (data is not None and operand1 is not None and data.dtype == operand1.dtype == "bfloat16"
                and _attr_name(instr.attrs.get("op0")).lower() == "subtract" and alu == "multiply"
                and n % 2 == 0)
        return max(min_ii, n if fast else 2 * n)
    if op in ("tensor_copy", "tensor_scalar"):
        return max(min_ii, n / speedup)
    if op == "tensor_reduce":
        red = _attr_name(instr.attrs.get("op")).lower()
        src = ins[0] if ins else None
        half = src is not None and src.dtype == "bfloat16" and red in ("add", "max", "maximum")
        return max(min_ii, n / 2 if half else n)
    if op == "memset":
        zero = instr.attrs.get("value", None) == 0 and dst is not None and dst.dtype in _TWO_BYTE_FLOATS
        return max(min_ii, n / 2 if zero else n)
    if op == "reciprocal":
        return max(min_ii, 8 * n)
    if op in ("activation", "activation_reduce"):
        readout = (op == "activation_reduce" or _role(instr, "reduce_res") is not None
                   or instr.attrs.get("reduce_res"))
        return max(min_ii, n) + (min_ii if readout else 0)
    # max8, nc_find_index8, nc_match_replace8 (documented "min(MIN_II, N)" read as the usual floor),
    # select, tensor_copy_predicated, Vector nc_transpose, ...: one pass over N elements.
    return float(max(min_ii, n))


def instr_cost(instr: Instr, chip: str | Chip = "trn2", params: ModelParams = MID,
               hbm_per_core: float | None = None) -> InstrCost:
    """Busy time and latency of one instruction on ``chip`` under ``params`` (default: the mid values).
    ``hbm_per_core``: the HBM bandwidth (B/ns) its core has; default ``chip.hbm_bytes_per_ns``, every core of
    the chip streaming (a kernel inside a graph; see :func:`hbm_per_core`)."""
    chip = hardware.get_chip(chip)
    if instr.engine == DMA:
        return _dma_cost(instr, chip, params, chip.hbm_bytes_per_ns if hbm_per_core is None else hbm_per_core)
    if instr.engine not in (TENSOR, VECTOR, SCALAR, GPSIMD):
        raise ValueError(f"cost: instruction {instr.op!r} has unknown engine {instr.engine!r} "
                         f"(expected one of {ENGINES})")
    ghz = chip.clocks.ghz(instr.engine)
    cycles = _compute_cycles(instr, chip, params)
    if instr.engine != TENSOR and any(o.buffer == "psum" for o in instr.operands):
        cycles += params.psum_access_cycles  # the PSUM access bubble (cost_params)
    if instr.engine in (VECTOR, GPSIMD):
        cycles += params.access_init_cycles  # SBUF/PSUM access set-up per instruction (cost_params)
    fixed = params.dependent_overhead_cycles
    if instr.op == "nc_matmul":
        fixed += chip.mm_init_latency_cycles
    if instr.op == "core_barrier":
        # a semaphore exchange between the two cores, not a pass over ``data``: the engine issues one
        # instruction; the wait is one cross-core semaphore round trip, taken as the DMA guide's
        # semaphore-to-start fixed cost (~1300 ns, nki-dma-bandwidth-guide.rst, = chip.dma.fixed_ns;
        # assumption: no public figure for the barrier itself)
        busy = chip.static_overhead_cycles / ghz
        return InstrCost(instr.engine, busy, busy + chip.dma.fixed_ns, chip.dma.fixed_ns,
                         chip.static_overhead_cycles)
    busy = cycles / ghz
    if instr.engine == SCALAR:
        # The ACTIVATE's fixed time (hardware.Chip.act_fixed_ns, profiled), paid by every ScalarE
        # instruction: ScalarE runs each one through its activation pipeline ([SDK] nki.isa.activate2:
        # "a three-stage pipeline per partition: tensor-scalar operations, activation function, optional
        # reduction"; a tensor_scalar / tensor_copy on ScalarE is that pipeline with the activation
        # bypassed), so moving a copy to ScalarE does not dodge it.
        busy += chip.act_fixed_ns + (params.act_fixed_offset_ns if chip.act_fixed_ns else 0.0)
    return InstrCost(instr.engine, busy, busy + fixed / ghz, fixed / ghz, cycles)


# ---------------------------------------------------------------------------------------------------
# schedules


def _has_deps(instrs: Sequence[Instr]) -> bool:
    return bool(instrs) and all("reads" in i.attrs and "writes" in i.attrs for i in instrs)


class _DepTracker:
    """Finish times of earlier accesses per storage, for RAW / WAR / WAW dependencies.

    Accesses are boxes ``(key, p0, p1, lo, hi)``: partitions ``[p0, p1)`` x per-partition free elements
    ``[lo, hi)`` (the interpreter's ``read_boxes`` / ``write_boxes``; on HBM, rows x a column window of the
    tensor's last dimension). Two accesses conflict only if both intervals overlap, so DMAs into disjoint
    slices of one tile (``t[:, k, :]`` for each ``k``) or of one HBM tensor's columns do not wait for each
    other, as they would on flat ranges.

    A matmul writing PSUM that earlier matmuls wrote (an accumulation group) does not wait for their
    results: TensorE issues them in order and PSUM accumulates as the moving data streams in ([SDK]
    nki/deep-dives/nki_perf_guide "Opt #7": a matrix-vector product's K-tiles, accumulated into one PSUM
    tile, issue "roughly every 64 cycles", not every dependent-instruction latency)."""

    def __init__(self, same_engine_streaming: bool = False) -> None:
        # per storage key: (p0, p1, lo, hi, finish, written by nc_matmul, engine, finish for its own engine,
        # finish for another compute engine)
        self.writes: dict[object, list[tuple]] = defaultdict(list)
        self.reads: dict[object, list[tuple]] = defaultdict(list)
        self.streaming = same_engine_streaming

    def _latest(self, entries: Iterable[tuple], p0: int, p1: int, lo: int, hi: int, engine: str,
                skip_matmul: bool = False) -> float:
        t = 0.0
        for e in entries:
            if e[0] < p1 and p0 < e[1] and e[2] < hi and lo < e[3] and not (skip_matmul and e[5]):
                if e[6] == engine:
                    t = max(t, e[7] if self.streaming else e[4])
                else:  # another engine's access: a compute consumer of a compute result waits its semaphore
                    t = max(t, e[8] if engine != DMA else e[4])
        return t

    # a placement space (cost._boxes' slot boxes: one storage for every placed tile of a kernel instance) is
    # tracked in byte buckets of this width: an access is listed in each bucket it touches, so a lookup scans
    # the accesses near its bytes, not every placed tile's (the same dependencies, found faster)
    _SLOT_BUCKET = 2048

    @classmethod
    def _keys(cls, key: object, lo: int, hi: int) -> Iterable[object]:
        if isinstance(key, tuple) and key and key[0] == "placed":
            w = cls._SLOT_BUCKET
            return [(key, b) for b in range(lo // w, max(lo, hi - 1) // w + 1)]
        return (key,)

    def ready(self, reads: Iterable, writes: Iterable, matmul: bool = False, engine: str = "") -> float:
        t = 0.0
        for key, p0, p1, lo, hi in reads:
            for k in self._keys(key, lo, hi):
                t = max(t, self._latest(self.writes.get(k, ()), p0, p1, lo, hi, engine))
        for key, p0, p1, lo, hi in writes:
            for k in self._keys(key, lo, hi):
                t = max(t, self._latest(self.writes.get(k, ()), p0, p1, lo, hi, engine, skip_matmul=matmul),
                        self._latest(self.reads.get(k, ()), p0, p1, lo, hi, engine))
        return t

    def commit(self, reads: Iterable, writes: Iterable, finish: float, matmul: bool = False, engine: str = "",
               own: float | None = None, cross: float | None = None) -> None:
        """``finish``: when another engine may use the result; ``own``: when the next instruction of the
        same engine may (``same_engine_streaming``), default ``finish``; ``cross``: when an instruction of
        another compute engine may (``compute_semaphores``), default ``finish``."""
        own = finish if own is None else own
        cross = finish if cross is None else max(cross, finish)
        for key0, p0, p1, lo, hi in writes:
            for key in self._keys(key0, lo, hi):
                # an access fully covered by this write that is done by the time this one is can never be
                # the one a later access waits for (it overlaps this write, which finishes no earlier). One
                # that finishes later stays: an accumulating matmul does not wait for its group's earlier
                # matmuls, so with ``compute_reorder`` it may run before them, and a reader of the tile still
                # needs their sums
                for table in (self.writes, self.reads):
                    if key in table:
                        table[key] = [e for e in table[key]
                                      if not (p0 <= e[0] and e[1] <= p1 and lo <= e[2] and e[3] <= hi
                                              and e[4] <= finish and e[7] <= own)]
                self.writes[key].append((p0, p1, lo, hi, finish, matmul, engine, own, cross))
        for key0, p0, p1, lo, hi in reads:
            for key in self._keys(key0, lo, hi):
                self.reads[key].append((p0, p1, lo, hi, finish, False, engine, own, cross))


def _boxes(ins: Instr, slots: bool = False) -> tuple[Sequence, Sequence]:
    """(read boxes, write boxes) of an instruction; flat spans as one-partition boxes where it has none.
    ``slots``: an access to a placed tile (``nl.ndarray(..., address=)``) as its box on the kernel instance's
    placement space (the trace's ``slot_read_boxes`` / ``slot_write_boxes``), so tiles placed on overlapping
    bytes are one storage (``cost_params.placed_slots_shared``)."""
    a = ins.attrs
    if slots and "slot_read_boxes" in a:
        return a["slot_read_boxes"], a["slot_write_boxes"]
    if "read_boxes" in a and "write_boxes" in a:
        return a["read_boxes"], a["write_boxes"]
    return (tuple((k, 0, 1, lo, hi) for k, lo, hi in a["reads"]),
            tuple((k, 0, 1, lo, hi) for k, lo, hi in a["writes"]))


class _Timeline:
    """Busy intervals of a shared resource (DMA bandwidth, an SBUF bus, a PSUM bank); first fit."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def fit(self, earliest: float, dur: float) -> float:
        """The earliest start at or after ``earliest`` with ``dur`` ns free (nothing reserved)."""
        k = bisect.bisect_right(self.ends, earliest)
        t = earliest
        while k < len(self.starts) and self.starts[k] < t + dur:
            t = max(t, self.ends[k])
            k += 1
        return t

    def place(self, earliest: float, dur: float) -> float:
        """Reserve ``dur`` ns at the earliest gap starting at or after ``earliest``; return the start."""
        t = self.fit(earliest, dur)
        if dur <= 0:
            return t
        k = bisect.bisect_right(self.ends, t)
        # merge with touching neighbours to keep the list short
        if k > 0 and self.ends[k - 1] >= t:
            self.ends[k - 1] = t + dur
            if k < len(self.starts) and self.starts[k] <= t + dur:
                self.ends[k - 1] = self.ends[k]
                del self.starts[k], self.ends[k]
        elif k < len(self.starts) and self.starts[k] <= t + dur:
            self.starts[k] = t
        else:
            self.starts.insert(k, t)
            self.ends.insert(k, t + dur)
        return t


class _PeArray:
    """TensorE as PE blocks (``cost_params.pe_tiles_concurrent``): a matmul in tiling mode (the trace's
    ``pe_tile``, ``nki.isa.nc_matmul`` "Tiling mode") holds only the ``chip.pe_tile_block``-square blocks its
    tile covers, so matmuls on disjoint tiles run at the same time; any other TensorE instruction holds the
    whole array (``whole``: the engine's timeline, as without tiles). Tiled matmuls start at least
    ``issue_ns`` apart (one sequencer issues them)."""

    def __init__(self, chip: Chip, issue_ns: float) -> None:
        self.side = chip.pe_rows // chip.pe_tile_block
        self.block_size = chip.pe_tile_block
        self.blocks = [_Timeline() for _ in range(self.side * self.side)]
        self.issue = _Timeline()
        self.issue_ns = issue_ns
        self.whole_free = 0.0  # the end of the last whole-array instruction
        self.last_start = -math.inf  # the start of the last TensorE instruction

    def blocks_of(self, ins: Instr) -> tuple[int, ...] | None:
        """The blocks a tiled matmul holds; ``None``: the whole array (untiled, or a tile covering it)."""
        tile = ins.attrs.get("pe_tile")
        if tile is None:
            return None
        r0, c0, rows, cols = tile
        b = self.block_size
        held = tuple(r * self.side + c for r in range(r0 // b, (r0 + rows - 1) // b + 1)
                     for c in range(c0 // b, (c0 + cols - 1) // b + 1))
        return None if len(held) == len(self.blocks) else held

    def in_order_start(self, ready: float, blocks: tuple[int, ...] | None, engine_free: float) -> float:
        """Program order (no ``compute_reorder``): a whole-array instruction after every earlier TensorE
        instruction's end; a tiled matmul after the last whole-array one's end and ``issue_ns`` after the
        previous TensorE instruction's start."""
        if blocks is None:
            return max(ready, engine_free, self.last_start)
        return max(ready, self.whole_free, self.last_start + self.issue_ns)

    def fit(self, whole: _Timeline, earliest: float, dur: float, blocks: tuple[int, ...] | None) -> float:
        """The first time at or after ``earliest`` the instruction's blocks (and the whole-array timeline and,
        tiled, an issue slot) are free for it."""
        lines = self.blocks if blocks is None else [self.blocks[b] for b in blocks]
        t = earliest
        while True:
            t2 = max(whole.fit(t, dur), max(line.fit(t, dur) for line in lines))
            if blocks is not None:
                t2 = max(t2, self.issue.fit(t, self.issue_ns))
            if t2 == t:
                return t
            t = t2

    def place(self, whole: _Timeline, t: float, dur: float, blocks: tuple[int, ...] | None) -> None:
        if blocks is None:
            whole.place(t, dur)
            self.whole_free = max(self.whole_free, t + dur)
        else:
            for b in blocks:
                self.blocks[b].place(t, dur)
            self.issue.place(t, self.issue_ns)
        self.last_start = max(self.last_start, t)


def _pe_array(instrs: Sequence[Instr], chip: Chip, params: ModelParams) -> _PeArray | None:
    """TensorE's PE blocks when tiled matmuls run concurrently in this trace, else ``None`` (the engine is
    one timeline, so a trace without a tiled matmul is scheduled exactly as before)."""
    if not params.pe_tiles_concurrent or chip.pe_tile_block >= chip.pe_rows:
        return None
    if not any("pe_tile" in i.attrs for i in instrs if i.op == "nc_matmul"):
        return None
    return _PeArray(chip, _TILED_ISSUE_CYCLES / chip.clocks.ghz(TENSOR))


# Compute instructions the recompute check may drop: pure functions of their tile and scalar operands
# (no engine registers, no PSUM accumulation).
_PURE_OPS = frozenset(("tensor_tensor", "tensor_scalar", "tensor_copy", "tensor_reduce", "nc_transpose",
                       "tensor_tensor_scan", "scalar_tensor_tensor", "reciprocal", "select"))
_NOT_KEYED = frozenset(("reads", "writes", "read_boxes", "write_boxes", "name"))


class _Recompute:
    """Finds compute instructions that recompute an earlier result from unchanged on-chip inputs (what the
    compiler's loop-invariant code motion / CSE removes; ``ModelParams.compiler_cse``). Reloads of
    unchanged HBM data are a separate rule (``ModelParams.reuse_loads``: :func:`resident_loads`,
    :func:`reused_loads`)."""

    def __init__(self) -> None:
        self.version: dict[object, int] = defaultdict(int)  # writes seen per storage
        self.seen: dict[tuple, float] = {}  # key -> finish time of the first computation

    def key(self, ins: Instr) -> tuple | None:
        reads = ins.attrs["reads"]
        if ins.op not in _PURE_OPS or ins.engine == DMA or not reads:
            return None
        if ins.op == "activation" and _attr_name(ins.attrs.get("reduce_cmd")) not in ("", "idle"):
            return None
        if any(o.buffer not in _ONCHIP for o in ins.operands):
            return None
        attrs = tuple(sorted((k, repr(v)) for k, v in ins.attrs.items() if k not in _NOT_KEYED))
        shapes = tuple((o.role, o.shape, o.dtype, o.buffer) for o in ins.operands)
        return (ins.op, ins.engine, attrs, shapes, tuple((r, self.version[r[0]]) for r in reads))

    def wrote(self, ins: Instr) -> None:
        for key, _, _ in ins.attrs["writes"]:
            self.version[key] += 1


def _resources(ins: Instr, c: InstrCost, chip: Chip, params: ModelParams) -> list[object]:
    """Shared resources a compute instruction holds while busy (hardware.Chip access rules)."""
    res: list[object] = []
    if ins.engine == GPSIMD or (ins.engine == VECTOR and (not chip.vector_gpsimd_sbuf_parallel
                                                          or _vector_perf_mode(ins, chip, params))):
        res.append("sbuf:vector+gpsimd")
    if ins.engine in (VECTOR, SCALAR):
        banks = {k[0] for o, k, _ in _paired(ins, ins.attrs["writes"], ins.attrs["reads"]) if o.buffer == "psum"}
        if banks:
            res.extend(["psum:vector+scalar"] if not chip.vector_scalar_psum_parallel
                       else [("psum", b) for b in sorted(banks, key=repr)])
    return res


@dataclass
class _Tile:
    """One SBUF storage as the trace uses it: bytes per partition, first / last access, how it is filled."""

    nbytes: int = 0  # bytes per partition (the largest free-element end seen x item size)
    first: int = -1  # program index of the first access
    last: int = -1  # of the last access
    first_read: int = -1  # of the first read
    last_write: int = -1  # of the last write
    loaded: bool = True  # every write is a DMA from HBM (the compiler can sink the load to its use)


# Operand roles the interpreter records as writes (isa/vector.py ``emit``: "every output role (dst, dst_idx,
# reduce_res) is a write"; every other emitter writes only its ``dst``).
_WRITE_ROLES = frozenset(("dst", "dst_idx", "reduce_res"))


def _paired(ins: Instr, writes: Sequence, reads: Sequence) -> list[tuple[Operand, tuple, bool]]:
    """``(operand, its box or span, written?)`` of each operand of ``ins``. The interpreter lists an
    instruction's writes, then its reads, each in its operands' order, while ``ins.operands`` is dst first,
    then the others in their order (a ``reduce_res`` or ``dst_idx`` may come after sources): so an operand
    is paired with the next box of its side (written iff its role is a write role), not by position."""
    out = []
    sides = {True: iter(writes), False: iter(reads)}
    for o in ins.operands:
        written = o.role in _WRITE_ROLES
        box = next(sides[written], None)
        if box is not None:
            out.append((o, box, written))
    return out


def _accesses(ins: Instr) -> list[tuple[object, int, bool]]:
    """(storage key, bytes per partition up to the access's end, written?) of the instruction's SBUF
    operands, each operand with its own box (:func:`_paired`). Traces without partition boxes (flat
    ranges only) give none: their per-partition sizes are unknown."""
    if "read_boxes" not in ins.attrs or "write_boxes" not in ins.attrs:
        return []
    out = []
    for o, box, written in _paired(ins, ins.attrs["write_boxes"], ins.attrs["read_boxes"]):
        if o.buffer != "sbuf" or len(box) != 5 or not o.partitions or not o.free_elems:
            continue
        item = o.nbytes / (o.partitions * o.free_elems)
        out.append((box[0], int(box[4] * item), written))
    return out


def _sbuf_tiles(instrs: Sequence[Instr]) -> dict[object, _Tile]:
    tiles: dict[object, _Tile] = defaultdict(_Tile)
    for k, ins in enumerate(instrs):
        from_hbm = ins.engine == DMA and any(o.buffer in _HBM_BUFFERS for o in ins.operands)
        for key, nbytes, written in _accesses(ins):
            t = tiles[key]
            t.nbytes = max(t.nbytes, nbytes)
            if t.first < 0:
                t.first = k
            t.last = k
            if written:
                t.last_write = k
                t.loaded = t.loaded and from_hbm
            elif t.first_read < 0:
                t.first_read = k
    return tiles


@dataclass(frozen=True)
class SbufPlan:
    """What SBUF capacity does to a schedule (:func:`sbuf_plan`), bytes per partition.

    ``allocates[k]``: bytes of the tiles instruction ``k`` accesses first; ``older_live[k]``: bytes of
    earlier tiles still live at ``k`` in program order; ``dies[k]``: bytes of the tiles whose last access
    is ``k``; ``spill[k]``: bytes the compiler must spill (store, reload later) before ``k`` can allocate,
    because even with every load sunk to its first use the tiles live there exceed capacity."""

    allocates: dict[int, int]
    older_live: dict[int, int]
    dies: dict[int, int]
    spill: dict[int, int]
    peak_bytes: int  # the most bytes live at once (in program order, or with loads sunk to their first use)


def _live_from(t: _Tile, program_order: bool) -> int:
    """The program index an SBUF tile of :func:`_sbuf_tiles` is live from: its first access in program
    order; otherwise, for a tile filled only by loads from HBM, its first read (the load sunk to its use)."""
    return t.first_read if t.loaded and t.first_read >= 0 and not program_order else t.first


def sbuf_plan(instrs: Sequence[Instr], capacity: int, program_order: bool = False) -> SbufPlan:
    """Per-instruction SBUF allocations and deaths, and the spills the compiler inserts.

    ``program_order`` (cost_params.spill_in_program_order): every tile is live from its first to its last
    access as the kernel orders them. Otherwise a tile filled only by DMAs from HBM is live from its first
    read (the compiler can issue the load just before it) and any other from its first write, so only
    the spills that sinking loads cannot avoid remain. Both end at the last access."""
    tiles = _sbuf_tiles(instrs)
    allocates: dict[int, int] = defaultdict(int)
    dies: dict[int, int] = defaultdict(int)
    sunk: dict[int, int] = defaultdict(int)  # live-bytes change at each program index, loads sunk
    for t in tiles.values():
        allocates[t.first] += t.nbytes
        dies[t.last] += t.nbytes
        start = _live_from(t, program_order)
        sunk[start] += t.nbytes
        sunk[t.last + 1] -= t.nbytes
    older_live: dict[int, int] = {}
    live = 0
    for k in sorted(set(allocates) | set(dies)):
        if k in allocates:
            older_live[k] = live
            live += allocates[k]
        live -= dies.get(k, 0)
    spill: dict[int, int] = {}
    live = peak = 0
    for k in sorted(sunk):
        before = live
        live += sunk[k]
        peak = max(peak, live)
        if live > capacity and live > before:
            spill[k] = live - max(before, capacity)
    return SbufPlan(dict(allocates), older_live, dict(dies), spill, peak)


PSUM_BANK_RULES = ("unbounded", "rotate", "lowest")  # cost_params.psum_banks: how the compiler picks banks


def _psum_tiles(instrs: Sequence[Instr]) -> dict[object, list]:
    """PSUM storage key -> [bytes per partition, first access, last access, item size] in program order.

    A key is a PSUM tile's when a TensorE instruction writes it (its first write box is its ``dst`` operand,
    in PSUM): an instruction's boxes do not follow its operands' order (``range_select`` lists its
    ``reduce_res`` among the writes), so other accesses are found by key. A box's free range counts the
    tile's elements, so its bytes are that range x the item size of the TensorE write's ``dst``."""
    tiles: dict[object, list] = {}
    for ins in instrs:
        if ins.engine != TENSOR or not ins.attrs.get("write_boxes"):
            continue
        dst = ins.operands[0] if ins.operands else None
        if dst is None or dst.role != "dst" or dst.buffer != "psum" or not dst.partitions or not dst.free_elems:
            continue
        key = ins.attrs["write_boxes"][0][0]
        tiles.setdefault(key, [0, -1, -1, dst.nbytes / (dst.partitions * dst.free_elems)])
    for k, ins in enumerate(instrs):
        for box in (*ins.attrs.get("write_boxes", ()), *ins.attrs.get("read_boxes", ())):
            t = tiles.get(box[0]) if len(box) == 5 else None
            if t is not None:
                t[0] = max(t[0], int(box[4] * t[3]))
                t[1] = k if t[1] < 0 else t[1]
                t[2] = k
    return {key: t for key, t in tiles.items() if t[1] >= 0}


def psum_bank_plan(instrs: Sequence[Instr], chip: Chip, rule: str) -> dict[object, tuple[int, float]]:
    """PSUM storage key -> (byte offset per partition of the first of the contiguous banks the compiler gives
    the tile, the tile's item size) for one program.

    Each tile is live from its first to its last access in program order and takes ceil(bytes per partition /
    bank) contiguous banks of ``chip.psum_banks`` (trn2: 8 of 2 KiB) while live. ``rule`` (cost_params.psum_banks):
    ``"rotate"``, the first free banks at or after the ones given last, wrapping; ``"lowest"``, the lowest free
    banks; ``"unbounded"``, none (each tile its own storage). A tile for which no banks are free in program
    order (the kernel's live PSUM exceeds the banks) keeps its own storage."""
    if rule not in PSUM_BANK_RULES:
        raise ValueError(f"cost: psum_banks must be one of {PSUM_BANK_RULES}, got {rule!r}")
    if rule == "unbounded" or not chip.psum_banks:
        return {}
    bank = chip.psum_bytes_per_partition // chip.psum_banks
    tiles = _psum_tiles(instrs)
    starts: dict[int, list[object]] = defaultdict(list)
    ends: dict[int, list[object]] = defaultdict(list)
    for key, (_, first, last, _) in tiles.items():
        starts[first].append(key)
        ends[last].append(key)
    free = [True] * chip.psum_banks
    held: dict[object, tuple[int, int]] = {}
    plan: dict[object, tuple[int, float]] = {}
    nxt = 0  # "rotate": where the search for the next tile's banks starts
    for k in sorted(set(starts) | set(ends)):
        for key in starts.get(k, ()):
            n = -(-tiles[key][0] // bank) or 1
            order = [(nxt + j) % chip.psum_banks for j in range(chip.psum_banks)] if rule == "rotate" \
                else range(chip.psum_banks)
            first = next((b for b in order if b + n <= chip.psum_banks and all(free[b:b + n])), None)
            if first is None:
                continue
            free[first:first + n] = [False] * n
            held[key] = (first, n)
            plan[key] = (first * bank, tiles[key][3])
            nxt = (first + n) % chip.psum_banks
        for key in ends.get(k, ()):
            if key in held:
                first, n = held.pop(key)
                free[first:first + n] = [True] * n
    return plan


def _bank_boxes(boxes: Sequence, plan: Mapping[object, tuple[int, float]]) -> tuple:
    """``boxes`` with each access to a planned PSUM tile moved onto the core's PSUM banks: one storage
    ("psum banks"), the access's bytes per partition from its tile's first bank on, so tiles that share a
    bank overlap there and a later one waits for the earlier one's accesses (WAR / WAW / RAW)."""
    out = []
    for box in boxes:
        if len(box) == 5 and box[0] in plan:
            base, item = plan[box[0]]
            out.append((_PSUM_BANKS, box[1], box[2], base + int(box[3] * item), base + int(box[4] * item)))
        else:
            out.append(box)
    return tuple(out)


_PSUM_BANKS = ("psum banks",)  # the storage key of a core's PSUM banks in the dependency tracker


class _MaxTree:
    """Range add / range max over per-instruction live bytes (a segment tree with lazy adds)."""

    def __init__(self, values: Sequence[int]) -> None:
        self.n = size = max(1, len(values))
        self.top = [0] * (4 * size)
        self.lazy = [0] * (4 * size)
        self._build(1, 0, size - 1, values)

    def _build(self, node: int, lo: int, hi: int, values: Sequence[int]) -> None:
        if lo == hi:
            self.top[node] = values[lo] if lo < len(values) else 0
            return
        mid = (lo + hi) // 2
        self._build(2 * node, lo, mid, values)
        self._build(2 * node + 1, mid + 1, hi, values)
        self.top[node] = max(self.top[2 * node], self.top[2 * node + 1])

    def add(self, a: int, b: int, v: int, node: int = 1, lo: int = 0, hi: int | None = None) -> None:
        hi = self.n - 1 if hi is None else hi
        if b < lo or hi < a:
            return
        if a <= lo and hi <= b:
            self.top[node] += v
            self.lazy[node] += v
            return
        mid = (lo + hi) // 2
        self.add(a, b, v, 2 * node, lo, mid)
        self.add(a, b, v, 2 * node + 1, mid + 1, hi)
        self.top[node] = max(self.top[2 * node], self.top[2 * node + 1]) + self.lazy[node]

    def max(self, a: int, b: int, node: int = 1, lo: int = 0, hi: int | None = None) -> int:
        hi = self.n - 1 if hi is None else hi
        if b < lo or hi < a:
            return 0
        if a <= lo and hi <= b:
            return self.top[node]
        mid = (lo + hi) // 2
        return max(self.max(a, b, 2 * node, lo, mid), self.max(a, b, 2 * node + 1, mid + 1, hi)) + self.lazy[node]


REUSE_RULES = ("fits", "resident", "none")  # cost_params.reuse_loads: which reloads the compiler drops


def _load_key(ins: Instr, version: dict) -> tuple | None:
    """What makes two SBUF loads the same data: the HBM ranges read (unchanged since), the destination's
    shape, dtype and partitions. None for anything but a plain (not indirect) HBM -> SBUF load."""
    reads, writes = _boxes(ins)
    dst = _role(ins, "dst")
    if not (ins.engine == DMA and dst is not None and dst.buffer == "sbuf" and len(writes) == 1
            and not ins.attrs.get("indirect") and reads
            and all(o.buffer in _HBM_BUFFERS for o in ins.operands if o.role != "dst")):
        return None
    w = writes[0]
    return (tuple((r, version[r[0]]) for r in reads), dst.shape, dst.dtype, w[1], w[2])


def _is_slot(box: tuple) -> bool:
    """Whether a trace box is a placed tile's slot box (its key a placement space's, ``("placed", ...)``)."""
    key = box[0]
    return isinstance(key, tuple) and bool(key) and key[0] == "placed"


def _load_slot(ins: Instr) -> tuple | None:
    """The slot box a plain load writes when its destination is a placed tile (``nl.ndarray(..., address=)``),
    else None."""
    boxes = ins.attrs.get("slot_write_boxes")
    return boxes[0] if boxes and _is_slot(boxes[0]) else None


class _SlotWrites:
    """Every write to a placed tile's bytes (the trace's slot write boxes), by placement space and 2 KiB of
    bytes (``_DepTracker._SLOT_BUCKET``): whether a slot was written between two instructions."""

    def __init__(self, instrs: Sequence[Instr]) -> None:
        self.by: dict[tuple, list[tuple[int, tuple]]] = defaultdict(list)
        for k, ins in enumerate(instrs):
            for b in ins.attrs.get("slot_write_boxes", ()):
                if _is_slot(b):
                    for key in _DepTracker._keys(b[0], b[3], b[4]):
                        self.by[key].append((k, b))

    def written(self, box: tuple, after: int, before: int, skip: Callable[[int], bool]) -> bool:
        """Whether an instruction strictly between ``after`` and ``before`` wrote a byte of ``box``, other
        than those ``skip`` names."""
        space, p0, p1, lo, hi = box
        for key in _DepTracker._keys(space, lo, hi):
            entries = self.by.get(key, ())
            i = bisect.bisect_right(entries, after, key=lambda e: e[0])
            while i < len(entries) and entries[i][0] < before:
                m, b = entries[i]
                if b[1] < p1 and p0 < b[2] and b[3] < hi and lo < b[4] and not skip(m):
                    return True
                i += 1
        return False


class _PlacedReloads:
    """Which reloads into a placed tile the compiler can drop (``cost_params.placed_slots_shared``). The kernel
    fixed the tile's address ("nki.compiler.force_auto_alloc ... will ignore any direct allocation inside the
    kernel": otherwise the addresses stand), so the consumers of a reload read its slot: the reload is dropped
    only when an earlier load of the same data went to exactly that slot and no instruction has written a byte
    of the slot since ("The compiler enforces memory dependencies, including waits before a slot is
    overwritten", nki.language.NkiStreamBuffers: a tile written on the slot replaces the data). A reload that
    moves its bytes holds the data for the next one. Data kept on its own slot takes no SBUF beyond the kernel's
    own tiles. A load into a tile the compiler allocates never reuses a placed tile's data, nor the reverse
    (the consumers of one read an address the other's data is not at)."""

    def __init__(self, instrs: Sequence[Instr]) -> None:
        self.instrs = instrs
        self.writes: _SlotWrites | None = None  # built on the first placed reload
        self.holder: dict[tuple, int] = {}  # (load key, slot box) -> the load whose data the slot holds
        self.dropped: dict[int, int] = {}

    def reload(self, k: int, key: tuple, slot: tuple) -> int | None:
        """The load whose data placed load ``k`` (of ``key``, on ``slot``) reuses, or None (it moves its bytes)."""
        j = self.holder.get((key, slot))
        if j is not None:
            if self.writes is None:
                self.writes = _SlotWrites(self.instrs)
            if not self.writes.written(slot, j, k, lambda m: self.dropped.get(m) == j):
                self.dropped[k] = j
                return j
        self.holder[(key, slot)] = k
        return None


def _plain_loads(instrs: Sequence[Instr], tiles: dict[object, _Tile]) -> Iterable[tuple[int, tuple, object]]:
    """``(index, load key, destination tile)`` of each plain HBM -> SBUF load into a tile of ``tiles``, in
    program order (:func:`_load_key`: the key changes once the HBM data it reads is written)."""
    version: dict[object, int] = defaultdict(int)  # writes seen per storage
    for k, ins in enumerate(instrs):
        writes = _boxes(ins)[1]
        key = _load_key(ins, version)
        if key is not None and writes[0][0] in tiles:
            yield k, key, writes[0][0]
        for b in writes:
            version[b[0]] += 1


def _loads_not_by_slot(instrs: Sequence[Instr], tiles: dict[object, _Tile], by_slot: bool,
                       dropped: dict[int, int]) -> Iterable[tuple[int, tuple, object]]:
    """The plain loads (:func:`_plain_loads`) whose reuse the caller decides. With ``by_slot``, a load into a
    placed tile is decided by its slot instead (:class:`_PlacedReloads`): not yielded, and recorded in
    ``dropped`` (load index -> the load whose data it reuses) when the compiler can drop it."""
    placed = _PlacedReloads(instrs) if by_slot else None
    for k, key, dst in _plain_loads(instrs, tiles):
        slot = _load_slot(instrs[k]) if placed is not None else None
        if slot is None:
            yield k, key, dst
            continue
        j = placed.reload(k, key, slot)
        if j is not None:
            dropped[k] = j


def reused_loads(instrs: Sequence[Instr], capacity: int, program_order: bool = False,
                 by_slot: bool = True) -> dict[int, int]:
    """Loads the compiler can drop because the same HBM data is still in SBUF (``cost_params.reuse_loads``):
    load index -> index of the earlier load whose data it reuses.

    A load matches an earlier one of the same HBM range (unchanged since), shape, dtype and partitions. The
    compiler keeps the earlier tile's data from its last access to the new load's first use when the tiles
    live there (``sbuf_plan``'s liveness) plus the kept bytes fit ``capacity``; the kept bytes then count as
    live there for later decisions. The fused-Mamba tutorial ([SDK] nki/guides/tutorials/fused_mamba,
    "Minimizing data reloading"): the unrolled loops "load delta/u across all channels in the first state,
    and then likely reload them again in the later states due to a large total memory size in delta and u
    (16MB in this case)"; its profiler reports them reloaded "around 7 times" of 16. ``by_slot``: loads into
    placed tiles by their slots (:class:`_PlacedReloads`; off, by tile as any other)."""
    tiles = _sbuf_tiles(instrs)
    n = len(instrs)
    delta = [0] * (n + 1)
    starts: dict[object, int] = {}
    for key, t in tiles.items():
        start = starts[key] = _live_from(t, program_order)
        delta[start] += t.nbytes
        delta[t.last + 1] -= t.nbytes
    live, acc = [], 0
    for d in delta[:n]:
        acc += d
        live.append(acc)
    tree = _MaxTree(live)
    resident: dict[tuple, tuple[int, int, int]] = {}  # load key -> (load holding the data, its last use, bytes)
    out: dict[int, int] = {}
    for k, key, dst in _loads_not_by_slot(instrs, tiles, by_slot, out):
        tile = tiles[dst]
        hit = resident.get(key)
        if hit is not None:
            j, last, nbytes = hit
            a, b = last + 1, starts[dst] - 1
            if a > b or tree.max(a, b) + nbytes <= capacity:
                if a <= b:
                    tree.add(a, b, nbytes)
                out[k] = j
                resident[key] = (j, max(last, tile.last), nbytes)
        if k not in out:
            resident[key] = (k, tile.last, tile.nbytes)
    return out


def resident_loads(instrs: Sequence[Instr], capacity: int, program_order: bool = False,
                   peak_bytes: int | None = None, by_slot: bool = True) -> dict[int, int]:
    """Reloads the compiler drops by keeping every reloaded input resident for the whole kernel
    (``cost_params.reuse_loads == "resident"``): load index -> the first load of the same data, for every
    reload, when the distinct data the kernel loads more than once (bytes per partition) fits in
    ``capacity`` next to the kernel's peak of live tiles (``sbuf_plan``); else none.

    The fused-Mamba tutorial ([SDK] nki/guides/tutorials/fused_mamba, "Minimizing data reloading"): v1 at
    4,096 channels reloads delta/u "due to a large total memory size in delta and u (16MB in this case)";
    reloading "could be inevitable when we don't have sufficient on-chip memory (SBUF) to allow full reuse
    of the input data tensors". At its toy shape (256 channels, delta and u 1 MB) the same kernel reloads
    nothing: the profile (nki/img/mamba_v1_profile_zoomed.png) shows DMA throughput only while the inputs
    load at the start and for the final store. ``peak_bytes``: that peak when the caller has the plan.
    ``by_slot``: loads into placed tiles by their slots (:class:`_PlacedReloads`: their kept data takes no
    bytes beyond the kernel's own tiles); off, by tile as any other."""
    tiles = _sbuf_tiles(instrs)
    first: dict[tuple, tuple[int, object]] = {}  # load key -> (the load that brings the data in, its tile)
    out: dict[int, int] = {}
    reloaded: set[int] = set()  # the first loads of the data loaded more than once
    kept = 0  # their bytes per partition
    for k, key, dst in _loads_not_by_slot(instrs, tiles, by_slot, out):
        if key not in first:
            first[key] = (k, dst)
            continue
        j, tile = first[key]
        if j not in reloaded:
            reloaded.add(j)
            kept += tiles[tile].nbytes
        out[k] = j
    if not out:
        return {}
    if peak_bytes is None:
        peak_bytes = sbuf_plan(instrs, capacity, program_order).peak_bytes
    return out if kept + peak_bytes <= capacity else {}


class _FreedSpace:
    """SBUF space of tiles dead in program order, by the time their last access ends: when can ``n`` more
    bytes be allocated with ``live`` bytes of program-order-live tiles held (hoisting bounded by SBUF)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.ends: list[float] = []  # sorted end times of dead tiles' last accesses
        self.sizes: list[int] = []
        self.total = 0

    def add(self, end: float, nbytes: int) -> None:
        k = bisect.bisect_right(self.ends, end)
        self.ends.insert(k, end)
        self.sizes.insert(k, nbytes)
        self.total += nbytes
        while self.sizes and self.total - self.sizes[0] > self.capacity:  # too old to matter
            self.total -= self.sizes.pop(0)
            self.ends.pop(0)

    def earliest(self, live: int, nbytes: int) -> float:
        """The first time ``live + nbytes`` plus the dead tiles not yet freed fit the capacity."""
        budget = self.capacity - live - nbytes
        if budget < 0:  # program order itself overflows: the spill model prices it
            return 0.0
        held = 0
        for k in range(len(self.ends) - 1, -1, -1):
            held += self.sizes[k]
            if held > budget:
                return self.ends[k]
        return 0.0


class _Didt:
    """TensorE's dI/dt throttle on one core (hardware.Chip.didt_threshold; [SDK] tools/neuron-explorer/
    overview-summary-page, "Understanding throttling"): the engine "starts at roughly 50% utilization of
    maximum utilization and ramps to full over about the first ~3 microseconds after work begins. If
    utilization drops below 50% over any ~3 microsecond window — for example during an idle gap — the
    limit re-engages, so the next burst again runs at roughly 50%".

    The limit is ``start + (1 - start) x (t - r) / ramp`` from a ramp that began at ``r``, 1 after it
    (linear: "ramps to full"). A TensorE instruction that starts after an idle gap re-engages it (the
    ramp begins at its start) when TensorE's work over the ``ramp`` before its start is below the
    threshold; the kernel's first one always does ("after work begins"). An instruction's work (its busy
    time at full rate) is done at the limit, so a throttled instruction holds the engine longer.
    Utilization counts work, not time held: an engine held at the 50 % limit is at 50 %, not below."""

    def __init__(self, threshold: float, start: float, ramp_ns: float) -> None:
        self.threshold, self.start, self.ramp = threshold, start, ramp_ns
        self.ramp_from = -math.inf  # when the ramp in effect began
        self.spans: list[tuple[float, float, float]] = []  # (start, end, work) of TensorE instructions
        self.last_end = -math.inf

    def _work(self, lo: float, hi: float) -> float:
        """TensorE work (full-rate ns) done in [lo, hi], each instruction's spread evenly over its span."""
        out = 0.0
        for s, e, w in reversed(self.spans):
            if e <= lo:
                break
            if e > s:
                out += w * (min(e, hi) - max(s, lo)) / (e - s) if min(e, hi) > max(s, lo) else 0.0
        return out

    def engages(self, t: float) -> bool:
        """Whether an instruction starting at ``t`` re-engages the limit: the first one, or one after an
        idle gap with the window before ``t`` below the threshold."""
        if not self.spans:
            return True
        if t <= self.last_end + 1e-9:
            return False
        return self._work(t - self.ramp, t) < self.threshold * self.ramp - 1e-6

    def duration(self, t: float, work: float) -> float:
        """How long an instruction of ``work`` ns at full rate holds TensorE when it starts at ``t``."""
        r = t if self.engages(t) else self.ramp_from
        x = t - r  # time into the ramp
        if x >= self.ramp or work <= 0:
            return work
        slope = (1.0 - self.start) / self.ramp
        rate = self.start + slope * x
        rest = (self.ramp - x) * (rate + 1.0) / 2  # work the ramp still allows before it ends
        if work >= rest:
            return (self.ramp - x) + (work - rest)
        return (-rate + math.sqrt(rate * rate + 2 * slope * work)) / slope

    def place(self, t: float, dur: float, work: float) -> None:
        if self.engages(t):
            self.ramp_from = t
        self.spans.append((t, t + dur, work))
        self.last_end = max(self.last_end, t + dur)
        if len(self.spans) > 4096:
            del self.spans[:2048]


@dataclass(frozen=True)
class Timing:
    """When one instruction ran in a list schedule (ns from the kernel's first instruction).

    ``start``: a compute instruction's start on its engine, a DMA's trigger; ``end``: the end of its engine
    time (a DMA: its last byte); ``ready``: when a dependent instruction may start (compute: + the
    dependent-instruction latency; DMA: + the completion semaphore's wake-up); ``table_load``: the
    activation-table load ScalarE ran just before it, if any; ``first_byte``: a DMA's first byte."""

    index: int
    engine: str
    start: float
    end: float
    ready: float
    first_byte: float = 0.0
    table_load: tuple[float, float] | None = None
    dropped: bool = False
    spill: tuple[float, float] | None = None  # the spill store + reload the compiler put before it (DMA)
    throttled_ns: float = 0.0  # how much longer TensorE's dI/dt limit held it than its busy time


# The engines whose sequencers trigger the compiler's DMA queues, in the order the model fills them: SyncE
# and ScalarE command the two hardware DGE instances ([SDK] trainium2_arch "DGE"), then the other
# sequencers ("DMA transfers can be triggered by any engine sequencer", [SDK] nki-dma-overview).
_QUEUE_ENGINES = ("sync", SCALAR, TENSOR, VECTOR, GPSIMD)

# How long a hardware-DGE DMA instruction holds the sequencer that triggers it: "Each DGE-based DMA
# instruction takes about 600 ns to execute on NeuronCore-v3" ([SDK] trainium2_arch "DGE"; nki-dge: "Each
# hardware-DGE DMA instruction takes approximately 600 ns to execute"). Only transfers that name their
# trigger engine (``engine=``, hardware DGE only) are charged to that engine's instruction stream.
_HWDGE_INSTR_NS = 600.0

# The interval between two tiled matmuls' starts on TensorE (cost_params.pe_tiles_concurrent): short matmuls
# issue "roughly every 64 cycles" ([SDK] nki_perf_guide Opt #7).
_TILED_ISSUE_CYCLES = 64.0


def _dma_queue(ins: Instr, k: int, params: ModelParams) -> str:
    """The engine whose DMA queue a transfer goes to: the trigger engine named in the kernel
    (``engine=``), GpSimd (software DGE) for an indirect DMA, else the compiler's choice, round robin over
    the first ``params.dma_queues`` of :data:`_QUEUE_ENGINES` in program order (k = the DMA's position)."""
    named = _attr_name(ins.attrs.get("engine")).lower()
    if named and named not in ("unknown", "none", "dma"):
        return named
    if ins.attrs.get("indirect"):
        return GPSIMD
    n = min(len(_QUEUE_ENGINES), max(1, params.dma_queues))
    return _QUEUE_ENGINES[k % n]


def _sbuf_capacity(chip: Chip, params: ModelParams) -> int:
    """SBUF bytes per partition the compiler allocates from under ``params`` (cost_params.sbuf_reserved)."""
    return chip.sbuf_usable_bytes_per_partition if params.sbuf_reserved else chip.sbuf_bytes_per_partition


def _dma_span(c: InstrCost, chip: Chip, params: ModelParams) -> float:
    """First byte to completion of a transfer: its engines start ``dma_engine_stagger_ns`` apart, so the
    last of them ends (engines - 1) x stagger after its share's time, and every one of the chip's 16
    engines writes the completion semaphore ([SDK] nki-dma-overview: "the remaining 15 DMA engines ...
    also perform a small 4B semaphore update"; cost_params.dma_engine_stagger_ns), the last at least
    15 x stagger after the first byte. The engines' occupancy is not staggered (throughput unchanged)."""
    used = max(1, c.dma_engines[1] - c.dma_engines[0])
    stagger = params.dma_engine_stagger_ns
    return max((used - 1) * stagger + c.transfer_ns, (chip.dma.engines - 1) * stagger)


def _fit_all(timelines: Sequence[_Timeline], earliest: float, dur: float) -> float:
    """The first time at or after ``earliest`` when every timeline is free for ``dur``."""
    t = earliest
    while True:
        t2 = max(tl.fit(t, dur) for tl in timelines)
        if t2 == t:
            return t
        t = t2


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals``."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def _list_schedule(instrs: Sequence[Instr], costs: Sequence[InstrCost], chip: Chip,
                   params: ModelParams = MID, floors: Mapping[int, float] | None = None, *,
                   hbm_per_core: float) -> list[Timing]:
    """Each instruction's :class:`Timing` in the list schedule (recomputed ones ``dropped``). ``floors``:
    instruction index -> the earliest its result may be read (a ``sendrecv``'s received tile: its group's
    completion, :func:`_phase_runs`); the instruction's engine and queue are not held until then.
    ``hbm_per_core``: the core's HBM bandwidth for spill traffic (:func:`hbm_per_core`)."""
    deps = _DepTracker(params.same_engine_streaming)
    # the 16 DMA engines' busy intervals; one timeline for all when every transfer uses all of them
    per_engine = any(c.dma_engines[1] - c.dma_engines[0] not in (0, chip.dma.engines)
                     for i, c in zip(instrs, costs) if i.engine == DMA)
    engines = [_Timeline() for _ in range(chip.dma.engines if per_engine else 1)]
    queues: dict[object, _Timeline] = defaultdict(_Timeline)  # each DMA queue's trigger-to-first-byte phases
    queue_last: dict[object, float] = defaultdict(float)  # last trigger per queue (program-order issue)
    shared: dict[object, _Timeline] = defaultdict(_Timeline)
    recompute = _Recompute() if params.compiler_cse else None
    engine_free: dict[str, float] = defaultdict(float)  # the end of each engine's last instruction
    engine_time: dict[str, _Timeline] = defaultdict(_Timeline)  # each compute engine's busy intervals
    # when each engine's sequencer can take its next instruction in program order (no compute_reorder):
    # after its last compute instruction started, and after a DMA trigger it runs has issued and executed
    sequencer_free: dict[str, float] = defaultdict(float)
    writer: dict[object, str] = {}  # storage key -> engine of its last writer
    table = ""  # the activation table loaded on ScalarE
    n_dma = 0
    out: list[Timing] = []
    # the device's SBUF per partition: what the compiler allocates from (the interpreter's capacity check
    # keeps nki-library's smaller budget for kernels, hardware.Chip.sbuf_usable_bytes_per_partition)
    capacity = _sbuf_capacity(chip, params)
    plan = sbuf_plan(instrs, capacity, params.spill_in_program_order)
    if params.reuse_loads not in REUSE_RULES:
        raise ValueError(f"cost: reuse_loads must be one of {REUSE_RULES}, got {params.reuse_loads!r}")
    if params.reuse_loads == "fits":
        reused = reused_loads(instrs, capacity, params.spill_in_program_order, params.placed_slots_shared)
    elif params.reuse_loads == "resident":
        reused = resident_loads(instrs, capacity, params.spill_in_program_order, plan.peak_bytes,
                                params.placed_slots_shared)
    else:
        reused = {}
    load_finish: dict[int, float] = {}  # DMA index -> when its data is ready (for the loads reused later)
    freed = _FreedSpace(capacity)
    didt = (_Didt(chip.didt_threshold, chip.didt_start_limit, chip.didt_ramp_ns)
            if params.didt_throttle and chip.didt_threshold > 0 else None)
    # spills move whole tiles (no packet penalty): the range ends take the fastest / slowest fraction
    fractions = [chip.dma.sustained(f) for f in _overhead_forms(params)]
    sustained = min(fractions) if params.dma_overhead_form == "slowest" else max(fractions)
    spill_rate = chip.dma.engines * min(chip.dma.bytes_per_ns_per_engine * sustained,
                                        hbm_per_core / chip.dma.engines)
    banks = psum_bank_plan(instrs, chip, params.psum_banks)  # the PSUM banks each tile takes
    pe = _pe_array(instrs, chip, params)
    for k, (ins, c) in enumerate(zip(instrs, costs)):
        reads, writes = _boxes(ins, params.placed_slots_shared)  # placed tiles: by the bytes they sit on
        if banks and any(o.buffer == "psum" for o in ins.operands):
            reads, writes = _bank_boxes(reads, banks), _bank_boxes(writes, banks)
        matmul = ins.op == "nc_matmul"
        ready = deps.ready(reads, writes, matmul, ins.engine)
        spill = None
        if params.hoist_bounded_by_sbuf and k in plan.allocates:  # the space it takes must be free by then
            ready = max(ready, freed.earliest(plan.older_live[k], plan.allocates[k]))
        if k in plan.spill:  # live tiles exceed SBUF even with loads sunk: spill, reload later
            dur = chip.sbuf_partitions * plan.spill[k] / spill_rate
            t = _fit_all(engines, ready, dur)
            for e in engines:
                e.place(t, 2 * dur)  # the store now, the reload later: both on the DMA engines
            spill = (t, t + 2 * dur)
            ready = t + dur
        if k in reused:  # the same HBM data is still in SBUF: the compiler drops the reload
            finish = load_finish[k] = max(ready, load_finish[reused[k]])
            deps.commit(reads, writes, finish)
            if recompute is not None:
                recompute.wrote(ins)
            if k in plan.dies:
                freed.add(finish, plan.dies[k])
            out.append(Timing(k, ins.engine, finish, finish, finish, dropped=True, spill=spill))
            continue
        key = recompute.key(ins) if recompute is not None else None
        if key is not None and key in recompute.seen:  # the compiler reuses the first result
            finish = max(ready, recompute.seen[key])
            recompute.wrote(ins)
            deps.commit(reads, writes, finish, matmul)
            if k in plan.dies:
                freed.add(finish, plan.dies[k])
            out.append(Timing(k, ins.engine, finish, finish, finish, dropped=True, spill=spill))
            continue
        table_load = None
        cross = None  # when another compute engine may use this result (compute_semaphores)
        if ins.engine == DMA:
            if c.gpsimd_ns:  # software DGE: descriptors written on GpSimd first
                g0 = ready if params.compute_reorder else max(ready, engine_free[GPSIMD])
                g0 = _fit_all((engine_time[GPSIMD], shared["sbuf:vector+gpsimd"]), g0, c.gpsimd_ns)
                engine_time[GPSIMD].place(g0, c.gpsimd_ns)
                shared["sbuf:vector+gpsimd"].place(g0, c.gpsimd_ns)
                engine_free[GPSIMD] = max(engine_free[GPSIMD], g0 + c.gpsimd_ns)
                ready = g0 + c.gpsimd_ns
            q = _dma_queue(ins, n_dma, params)
            n_dma += 1
            # the trigger waits on a semaphore from another engine's result ([SDK] nki-dma-overview: "The
            # sequencer instruction to trigger the transfer may wait on any semaphore condition which is
            # signaled by other compute engines"): one wake-up, as a DMA's completion costs its consumer
            if any(writer.get(b[0], q) not in (q, DMA) for b in _boxes(ins)[0]):
                ready += params.dma_wake_ns
            # the queue holds each transfer from its trigger to its first byte; hoisted: the first gap
            # after the data is ready, program order: not before the queue's previous trigger
            # a transfer that names its trigger engine is an instruction of that engine's in-order stream
            # ("The sequencer instruction to trigger the transfer may wait on any semaphore condition",
            # DMA overview): not issued before the engine's earlier instructions have started (a DGE
            # instruction "could be hidden behind earlier compute instructions ... in program order",
            # trainium2_arch "DGE"), and the engine's later instructions wait while it waits for its data
            # and its queue, then for its execution (_HWDGE_INSTR_NS). With compute_reorder the compiler
            # places it, like a compute instruction, where its data is ready, and the engine's compute
            # pipeline is not held ("DGE and the compute pipeline of ScalarE are independent").
            in_stream = not params.compute_reorder and _attr_name(ins.attrs.get("engine")).lower() == q
            if in_stream:
                ready = max(ready, sequencer_free[q])
            earliest = ready if params.dma_hoist else max(ready, queue_last[q])
            start = queues[q].place(earliest, c.fixed_ns)
            queue_last[q] = max(queue_last[q], start)
            if in_stream:
                sequencer_free[q] = start + _HWDGE_INSTR_NS
            first, last = c.dma_engines
            used = (engines[first:last] if per_engine else engines) or engines[:1]
            t = _fit_all(used, start + c.fixed_ns, c.transfer_ns)
            for e in used:
                e.place(t, c.transfer_ns)
            end = t + _dma_span(c, chip, params)
            finish = own = end + params.dma_wake_ns
            if floors and k in floors:  # the received tile: when the other core's transfer has landed
                finish = max(finish, floors[k])
            load_finish[k] = finish
            out_first = t
        else:
            busy = c.busy_ns
            pre = 0.0  # an activation-table load ScalarE runs first
            if ins.op in _ACTIVATE_OPS and ins.engine == SCALAR:
                fn = _attr_name(ins.attrs.get("op")).lower()
                if fn not in _NO_TABLE and fn != table:
                    pre, table = chip.act_table_load_ns, fn
            # in program order on its engine, or (compute_reorder) in the first gap of the engine after
            # its inputs are ready: the compiler's scheduler moves an independent instruction ahead
            tiles = pe if ins.engine == TENSOR else None  # TensorE as PE blocks (tiled matmuls in the trace)
            blocks = tiles.blocks_of(ins) if tiles is not None else None
            t = ready if params.compute_reorder else max(ready, engine_free[ins.engine],
                                                         sequencer_free[ins.engine])
            if tiles is not None and not params.compute_reorder:
                t = max(sequencer_free[ins.engine], tiles.in_order_start(ready, blocks, engine_free[ins.engine]))
            res = [shared[r] for r in _resources(ins, c, chip, params)]
            mine = engine_time[ins.engine]
            throttle = didt if ins.engine == TENSOR else None
            work = busy
            tries = 0
            while True:  # the first time the engine and every shared resource are free for it
                if throttle is not None:  # held at the dI/dt limit in effect when it starts
                    busy = throttle.duration(t, work)
                t = mine.fit(t, pre + busy) if tiles is None else tiles.fit(mine, t, busy, blocks)
                t2 = max((r.fit(t + pre, busy) - pre for r in res), default=t)
                tries += 1
                # t2 < t only by rounding ((t + pre) - pre): the engine and resources are free at t
                if t2 <= t and (throttle is None or throttle.duration(t, work) == busy or tries > 16):
                    break
                t = t2
            if throttle is not None:
                throttle.place(t, busy, work)
            if tiles is None:
                mine.place(t, pre + busy)
            else:
                tiles.place(mine, t, busy, blocks)
            for r in res:
                r.place(t + pre, busy)
            if pre:
                table_load = (t, t + pre)
            start = t + pre
            end = start + busy
            engine_free[ins.engine] = max(engine_free[ins.engine], end)
            sequencer_free[ins.engine] = max(sequencer_free[ins.engine], t)
            finish = start + c.latency_ns + (busy - work)
            # the next instruction of the same engine may start once this one's data streams out: not
            # before its end, nor before its dependent-instruction interval (MIN_II + fixed latency, the
            # perf guide's measured 264 cycles for one-element instructions) has passed
            own = start + max(busy, chip.min_ii_cycles / chip.clocks.ghz(ins.engine) + c.fixed_ns)
            # an instruction of another compute engine that reads (or overwrites) this result waits on this
            # engine's semaphore ([SDK] nki_perf_guide Opt #3: "These semaphores are associated with
            # instruction completion on the corresponding compute engine"), which wakes it dma_wake_ns after
            # this one ends, as a DMA's completion wakes its consumer (ModelParams.compute_semaphores)
            if params.compute_semaphores:
                cross = end + params.dma_wake_ns
            out_first = 0.0
        if recompute is not None:
            if key is not None:
                recompute.seen[key] = finish
            recompute.wrote(ins)
        deps.commit(reads, writes, finish, matmul, ins.engine, own, cross)
        for b in _boxes(ins)[1]:  # by tile, as the trace keys them
            writer[b[0]] = ins.engine
        if k in plan.dies:
            freed.add(end, plan.dies[k])
        out.append(Timing(k, ins.engine, start, end, finish, out_first, table_load, spill=spill,
                          throttled_ns=0.0 if ins.engine == DMA else busy - work))
    return out


def _schedule_end(times: Sequence[Timing], instrs: Sequence[Instr]) -> float:
    """The kernel's end: the last DMA's last byte or the last compute result."""
    return max((t.end if i.engine == DMA else t.ready for t, i in zip(times, instrs)), default=0.0)


# How the profiler counts an engine "active" is not documented; the model reports three definitions
# (ACTIVE_DEFINITIONS), the middle one as ``CostReport.active``, and the narrow / wide ones as its range.
ACTIVE_DEFINITIONS = ("narrow", "mid", "wide")


def _active(times: Sequence[Timing]) -> dict[str, tuple[float, float, float]]:
    """Per engine, the time it is active as a profiler shows it, under the (narrow, mid, wide) definitions.

    Compute engines: narrow and mid, while one of its instructions holds it (its busy time, and an
    activation-table load): the kernel-optimization tutorial's v5 profile gives VectorE 3.08 ms of
    "instruction time" and 10.55 % active of 28.30 ms (10.9 %), so the profiler's share is instruction
    time, not instruction time plus the dependent latency; wide, from an instruction's start to its result
    (the pipeline still works on it). DMA: narrow, while bytes move (first to last byte); mid, while any
    transfer is between its trigger and its last byte ("DMA active" counts time with any transfer in
    flight); wide, from its trigger to its completion semaphore's wake-up."""
    spans: dict[str, list[list[tuple[float, float]]]] = defaultdict(lambda: [[], [], []])
    for t in times:
        if t.spill:  # spill traffic keeps the DMA engines active under every definition
            for v in spans[DMA]:
                v.append(t.spill)
        if t.dropped:
            continue
        s = spans[t.engine]
        if t.engine == DMA:
            s[0].append((t.first_byte, t.end))
            s[1].append((t.start, t.end))
            s[2].append((t.start, t.ready))
            continue
        s[0].append((t.start, t.end))
        s[1].append((t.start, t.end))
        s[2].append((t.start, max(t.end, t.ready)))
        if t.table_load:
            for v in s:
                v.append(t.table_load)
    return {e: tuple(_union(v) for v in s) for e, s in spans.items()}


def _overlap_bound(instrs: Sequence[Instr], costs: Sequence[InstrCost]) -> float:
    busy: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    dma_idx = [k for k, i in enumerate(instrs) if i.engine == DMA]
    for k, (i, c) in enumerate(zip(instrs, costs)):
        busy[i.engine] += c.busy_ns
        first.setdefault(i.engine, k)
        last[i.engine] = k
    total = 0.0
    for e in busy:
        if e == DMA:
            head = costs[first[e]].fixed_ns
            # a last transfer on few rows runs slower than its share of the bandwidth
            c = costs[last[e]]
            tail = c.transfer_ns - c.busy_ns
        else:
            before = [k for k in dma_idx if k < first[e]]
            after = [k for k in dma_idx if k > last[e]]
            head = costs[before[0]].latency_ns if before else 0.0
            # the engine's last instruction's fixed latency, or the store that follows it
            tail = (costs[after[-1]].fixed_ns + costs[after[-1]].transfer_ns) if after else costs[last[e]].fixed_ns
        total = max(total, head + busy[e] + tail)
    return total


def _sync_phases(instrs: Sequence[Instr], n_programs: int) -> dict[tuple, list[int]]:
    """One program's instructions (indices) by synchronisation phase ``(launch, barriers passed)``.

    With several programs (an LNC=2 grid) every program waits for the others at a ``core_barrier`` and
    at the start of the next launch, so each phase takes as long as its slowest program and phases add
    up (no overlap across a sync point). A single program is one phase: consecutive launches on one
    core overlap as far as their data dependencies allow, as before.
    """
    if n_programs == 1:
        return {(): list(range(len(instrs)))}
    phases: dict[tuple, list[int]] = defaultdict(list)
    launch, passed = None, 0
    for k, i in enumerate(instrs):
        if i.attrs.get("launch") != launch:
            launch, passed = i.attrs.get("launch"), 0
        phases[(launch, passed)].append(k)
        if i.op == "core_barrier":
            passed += 1
    return phases



@dataclass(frozen=True)
class _Run:
    """One schedule of one program instance under one parameter setting."""

    total: float
    serial: float
    busy: dict[str, float]
    active: dict[str, tuple[float, float, float]]  # per engine, active time (narrow, mid, wide definition)


def _run(instrs: Sequence[Instr], chip: Chip, params: ModelParams, model: str,
         floors: Mapping[int, float] | None, hbm_per_core: float) -> tuple[_Run, list[InstrCost], list[Timing]]:
    """One program's schedule: its run, each instruction's cost and (list schedule) its timings. ``floors``:
    instruction index -> the earliest its result may be read (a ``sendrecv``'s group completion);
    ``hbm_per_core``: its core's HBM bandwidth (:func:`hbm_per_core`)."""
    costs = [instr_cost(i, chip, params, hbm_per_core) for i in instrs]
    dropped: set[int] = set()
    active: dict[str, tuple[float, float, float]] = {}
    busy: dict[str, float] = defaultdict(float)
    times: list[Timing] = []
    if model == "list-schedule":
        times = _list_schedule(instrs, costs, chip, params, floors, hbm_per_core=hbm_per_core)
        total = _schedule_end(times, instrs)
        dropped = {t.index for t in times if t.dropped}
        active = _active(times)
        for t in times:  # TensorE held longer at its dI/dt limit
            if t.throttled_ns:
                busy[t.engine] += t.throttled_ns
    else:
        total = _overlap_bound(instrs, costs)
    serial = 0.0
    for k, (i, c) in enumerate(zip(instrs, costs)):
        if k in dropped:
            continue
        busy[i.engine] += c.busy_ns
        if c.gpsimd_ns:
            busy[GPSIMD] += c.gpsimd_ns
        serial += c.latency_ns + c.gpsimd_ns
    if times and _pe_array(instrs, chip, params) is not None:
        # tiled matmuls overlap: TensorE is busy while any PE block works (the union, so busy <= the total)
        busy[TENSOR] = _union([(t.start, t.end) for t in times if t.engine == TENSOR and not t.dropped])
    return _Run(total, serial, dict(busy), active), costs, times


def timeline(trace: Trace | Iterable[Instr], chip: str | Chip = "trn2", params: ModelParams = MID,
             launch: LaunchParams | None = None) -> list[Timing]:
    """The list schedule of a one-program trace: one :class:`Timing` per instruction, in program order
    (what a profile's timeline shows; the calibration reads single instructions' times from it).
    ``launch``: as in :func:`estimate_total` (a standalone launch's HBM condition; no start-up)."""
    chip = hardware.get_chip(chip)
    instrs = list(trace)
    if len(_programs(instrs)) > 1 or not _has_deps(instrs):
        raise ValueError("cost.timeline: needs a one-program trace with data dependencies "
                         f"({len(_programs(instrs))} programs)")
    hbm = hbm_per_core(chip, launch, 1)
    costs = [instr_cost(i, chip, params, hbm) for i in instrs]
    return _list_schedule(instrs, costs, chip, params, hbm_per_core=hbm)


def _programs(instrs: Sequence[Instr]) -> list[list[Instr]]:
    programs: dict[int, list[Instr]] = defaultdict(list)
    for i in instrs:
        programs[i.program_id].append(i)
    return list(programs.values())


def _sendrecv_groups(segments: Sequence[Sequence[Instr]]) -> list[list[tuple[int, int]]]:
    """The ``sendrecv`` groups of one sync phase: the n-th ``sendrecv`` on a ``pipe_id`` of each program, as
    ``(program, index in its segment)`` pairs; only groups with more than one program."""
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for p, seg in enumerate(segments):
        seen: dict[object, int] = defaultdict(int)
        for k, i in enumerate(seg):
            if i.op == "sendrecv":
                pipe = i.attrs.get("pipe_id")
                groups[(pipe, seen[pipe])].append((p, k))
                seen[pipe] += 1
    return [g for g in groups.values() if len({p for p, _ in g}) > 1]


def _phase_runs(segments: Sequence[Sequence[Instr]], chip: Chip, params: ModelParams,
                model: str, hbm_per_core: float) -> list[tuple[_Run, list[InstrCost]]]:
    """Schedule one sync phase's segment of every program (all start together at the phase's start).

    A ``sendrecv``'s received tile exists only once every transfer of its group has completed
    (``nki.isa.sendrecv``: "Operations with the same pipe_id form a logical group where all operations in the
    group must complete before any can proceed"): its readers on each core wait for the group's last
    transfer (the other core's send), while the rest of each core's instructions go on. The programs are
    scheduled with each group's completion as a floor on its transfers' results, again until the floors no
    longer change (a later group can only move later)."""
    groups = _sendrecv_groups(segments) if model == "list-schedule" else []
    floors: list[dict[int, float]] = [{} for _ in segments]
    for _ in range(len(groups) + 2):
        runs = [_run(seg, chip, params, model, floors[p] or None, hbm_per_core) for p, seg in enumerate(segments)]
        if not groups:
            break
        new: list[dict[int, float]] = [{} for _ in segments]
        for g in groups:  # each transfer's own completion: its last byte + the semaphore wake-up
            done = max(runs[p][2][k].end + params.dma_wake_ns for p, k in g)
            for p, k in g:
                new[p][k] = done
        if new == floors:
            break
        floors = new
    return [(run, costs) for run, costs, _ in runs]


def hbm_per_core(chip: str | Chip, launch: LaunchParams | None, programs: int) -> float:
    """HBM bandwidth (B/ns) each physical core of a launch of ``programs`` programs has.

    ``launch=None`` (a kernel inside a compiled graph): every core of the chip streams, each with its even
    share (``chip.hbm_bytes_per_ns``, trn2 362.5 GB/s). A standalone launch: HBM is a per-stack resource
    (hardware.TRN2's sources), so each core has its stack's bandwidth over the stack's cores streaming at
    once, ``launch.hbm_stack_cores`` or else the launch's own programs: trn2 725 GB/s at LNC 1 with the
    partner core idle, 362.5 GB/s at LNC 2 (the pair shares one stack); trn1 410 GB/s either way (one core
    a stack)."""
    chip = hardware.get_chip(chip)
    if launch is None:
        return chip.hbm_bytes_per_ns
    cores = programs if launch.hbm_stack_cores is None else max(programs, launch.hbm_stack_cores)
    return chip.hbm_bytes_per_ns_streaming(cores)


def _launch(instrs: Sequence[Instr], chip: Chip, params: ModelParams, model: str,
            launch: LaunchParams | None = None) -> tuple[
        float, float, list[tuple[list[Instr], dict[str, float], dict[str, float]]], dict[int, InstrCost]]:
    """Schedule a launch: (total, serialized sum, (program, its busy, its active time per engine) triples,
    cost per instr id).

    Each program runs on its own core; programs synchronise at every sync phase (:func:`_sync_phases`),
    so a phase takes as long as its slowest program and the phases add up; within a phase a ``sendrecv``'s
    readers wait for the other core's transfer (:func:`_phase_runs`). ``launch``: ``None`` in a graph, or the
    standalone launch's :class:`~cost_params.LaunchParams`, which set each core's HBM bandwidth
    (:func:`hbm_per_core`, from the programs of the phase's launch)."""
    programs = _programs(instrs)
    per_launch = _programs_by_launch(instrs)
    phases = [_sync_phases(p_instrs, len(programs)) for p_instrs in programs]
    busy: list[dict[str, float]] = [defaultdict(float) for _ in programs]
    active: list[dict[str, tuple]] = [defaultdict(lambda: (0.0, 0.0, 0.0)) for _ in programs]
    total = serial = 0.0
    costs: dict[int, InstrCost] = {}
    for phase in dict.fromkeys(ph for p_phases in phases for ph in p_phases):
        members = [p for p, p_phases in enumerate(phases) if phase in p_phases]
        segments = [[programs[p][k] for k in phases[p][phase]] for p in members]
        # one program: one phase over all its launches, each of one program; else phase = (launch, barriers)
        n = 1 if len(programs) == 1 else per_launch[phase[0]]
        runs = _phase_runs(segments, chip, params, model, hbm_per_core(chip, launch, n))
        total += max(run.total for run, _ in runs)
        serial += max(run.serial for run, _ in runs)
        for p, seg, (run, s_costs) in zip(members, segments, runs):
            costs.update((id(i), c) for i, c in zip(seg, s_costs))
            for e, b in run.busy.items():
                busy[p][e] += b
            for e, b in run.active.items():
                active[p][e] = tuple(x + y for x, y in zip(active[p][e], b))
    per_program = [(p_instrs, dict(busy[p]), dict(active[p])) for p, p_instrs in enumerate(programs)]
    return total, serial, per_program, costs


def _resident_reload_bytes(instrs: Sequence[Instr], chip: Chip) -> int:
    """HBM bytes of the reloads the mid setting drops (``cost_params.reuse_loads == "resident"``: every
    reloaded input stays in SBUF). The roofline counts the HBM traffic the kernel moves at mid, so a kernel
    whose reloaded data fits is bounded by its distinct bytes, not by the reloads it asks for."""
    if MID.reuse_loads != "resident" or not _has_deps(instrs):
        return 0
    reloads = resident_loads(instrs, _sbuf_capacity(chip, MID), MID.spill_in_program_order,
                             by_slot=MID.placed_slots_shared)
    return sum(instrs[k].hbm_bytes for k in reloads)


def estimate_total(instrs: Sequence[Instr], chip: str | Chip, params: ModelParams,
                   launch: LaunchParams | None = None) -> float:
    """Estimated time in ns of a launch's instructions (its programs synchronised per phase) under
    ``params``; ``launch`` (a standalone launch's :class:`~cost_params.LaunchParams`) sets only each core's
    HBM bandwidth (:func:`hbm_per_core`), its start-up is not included (:func:`launch_overhead_ns`)."""
    chip = hardware.get_chip(chip)
    instrs = list(instrs)
    model = "list-schedule" if _has_deps(instrs) else "overlap-bound"
    return _launch(instrs, chip, params, model, launch)[0] if instrs else 0.0


def launch_overhead_ns(programs_per_launch: Sequence[int], launch: LaunchParams) -> float:
    """What the trace's launches cost beyond their instructions when each is its own NEFF execution: per
    launch, ``launch.startup_ns``, plus ``launch.core_skew_ns`` when it runs more than one program (LNC 2)."""
    return sum(launch.startup_ns + (launch.core_skew_ns if n > 1 else 0.0) for n in programs_per_launch)


def _programs_by_launch(instrs: Sequence[Instr]) -> dict[object, int]:
    """Launch (instructions' ``launch`` attr; ``None`` when none is set) -> the number of its programs."""
    programs: dict[object, set] = defaultdict(set)
    for i in instrs:
        programs[i.attrs.get("launch")].add(i.program_id)
    return {k: len(p) for k, p in programs.items()}


def programs_per_launch(instrs: Sequence[Instr]) -> list[int]:
    """The number of programs of each launch in the trace (instructions' ``launch`` attr; one launch when
    none is set)."""
    return list(_programs_by_launch(instrs).values())


def estimate(trace: Trace | Iterable[Instr], chip: str | Chip = "trn2", params: ModelParams | None = None,
             ranges: bool = True, launch: LaunchParams | LaunchRange | None = None) -> CostReport:
    """Estimate the run time of a recorded instruction trace on ``chip`` ("trn2" or "trn1").

    Everything in the report is for ``params`` (default: the mid values of :mod:`cost_params`); with
    ``ranges`` (and no explicit ``params``) ``total_range_ns`` also holds the totals under the optimistic
    and pessimistic settings: ``(low, mid, high)``.

    ``launch``: ``None`` (default) prices the kernel as it runs inside a larger compiled graph, its own
    instructions only. For a standalone launch (each of the trace's launches its own NEFF execution, as
    nki-library's tests and the tutorials measure them) pass :data:`cost_params.STANDALONE_LAUNCH` (a
    :class:`~cost_params.LaunchRange`: each setting's own value, added to that setting's total) or one
    :class:`~cost_params.LaunchParams` (the same value at every setting; needed with explicit ``params``).
    ``report.launch_ns`` holds what was added. A standalone launch also sets each core's HBM bandwidth
    (:func:`hbm_per_core`: its stack's, over the stack's cores streaming at once), which moves the DMA
    transfers and the roofline's HBM bound of an LNC 1 kernel on trn2; in a graph every core streams."""
    if isinstance(launch, LaunchRange) and params is not None:
        raise ValueError("cost.estimate: launch=LaunchRange gives a value per setting (low / mid / high), but "
                         "params= names one setting: pass launch=LaunchParams (e.g. STANDALONE_LAUNCH.mid) "
                         "with explicit params")
    chip = hardware.get_chip(chip)
    instrs = list(trace)
    setting = params or MID
    model = "empty" if not instrs else ("list-schedule" if _has_deps(instrs) else "overlap-bound")
    # the launch's parameters at each setting (None: in a graph)
    by_setting = {k: (launch.setting(k) if isinstance(launch, LaunchRange) else launch) for k in SETTINGS}

    busy: dict[str, float] = {}
    active: dict[str, tuple[float, float, float]] = {}
    compute_bound = memory_bound = 0.0
    hbm_bytes = 0
    total, serial, per_program, costs = (_launch(instrs, chip, setting, model, by_setting["mid"]) if instrs
                                         else (0.0, 0.0, [], {}))
    # the roofline's HBM bound: the most HBM bandwidth a core has at any setting (a bound for every end)
    n_by_launch = _programs_by_launch(instrs)
    roof_hbm = max(hbm_per_core(chip, lp, min(n_by_launch.values(), default=1)) for lp in by_setting.values())
    for p_instrs, p_busy, p_active in per_program:
        for e, b in p_busy.items():
            busy[e] = max(busy.get(e, 0.0), b)
        for e, b in p_active.items():
            active[e] = tuple(max(x, y) for x, y in zip(active.get(e, (0.0, 0.0, 0.0)), b))
        p_compute = sum(i.flops / chip.tensor_flops_per_ns(_matmul_dtype(i), _is_pe_transpose(i))
                        for i in p_instrs if i.flops)
        p_bytes = sum(i.hbm_bytes for i in p_instrs) - _resident_reload_bytes(p_instrs, chip)
        hbm_bytes += p_bytes
        p_memory = p_bytes / roof_hbm
        compute_bound = max(compute_bound, p_compute)
        memory_bound = max(memory_bound, p_memory)
    if ranges and params is None and instrs:
        total_range = (estimate_total(instrs, chip, SETTINGS["low"], by_setting["low"]), total,
                       estimate_total(instrs, chip, SETTINGS["high"], by_setting["high"]))
    else:
        total_range = (total, total, total)
    launch_ns = (0.0, 0.0, 0.0)
    if launch is not None and instrs:
        per_launch = programs_per_launch(instrs)
        if isinstance(launch, LaunchRange):
            launch_ns = tuple(launch_overhead_ns(per_launch, launch.setting(k)) for k in ("low", "mid", "high"))
        else:
            launch_ns = (launch_overhead_ns(per_launch, launch),) * 3
        if not (ranges and params is None):  # one setting: its own launch value at every position
            launch_ns = (launch_ns[1],) * 3
        total += launch_ns[1]
        total_range = tuple(t + x for t, x in zip(total_range, launch_ns))

    count: dict[str, int] = defaultdict(int)
    by_op: dict[str, list] = {}
    for i in instrs:
        count[i.engine] += 1
        entry = by_op.setdefault(i.op, [0, 0.0])
        entry[0] += 1
        entry[1] += costs[id(i)].busy_ns
    return CostReport(
        chip=chip.name,
        model=model,
        n_instrs=len(instrs),
        n_programs=len(_programs(instrs)) if instrs else 0,
        busy_ns={e: busy[e] for e in ENGINES if e in busy},
        count=dict(count),
        total_ns=total,
        serial_ns=serial,
        compute_bound_ns=compute_bound,
        memory_bound_ns=memory_bound,
        flops=sum(i.flops for i in instrs),
        hbm_bytes=hbm_bytes,
        dma_bytes=sum(i.dma_bytes for i in instrs),
        by_op={k: (v[0], v[1]) for k, v in by_op.items()},
        total_range_ns=total_range,
        active_ns={e: active[e][1] for e in ENGINES if e in active},
        active_range_ns={e: (active[e][0], active[e][2]) for e in ENGINES if e in active},
        launch_ns=launch_ns,
    )


def sensitivity(trace: Trace | Iterable[Instr], chip: str | Chip = "trn2",
                launch: LaunchParams | None = None) -> dict[str, tuple[float, float]]:
    """Per uncertain parameter: the total with only it at its optimistic and at its pessimistic value
    (every other parameter at mid), largest swing first; ``launch`` as in :func:`estimate_total`."""
    from trnkit.nkisim.cost_params import PARAM_NAMES

    chip = hardware.get_chip(chip)
    instrs = list(trace)
    out = {}
    for name in PARAM_NAMES:
        lo, hi = one_at_a_time(name)
        out[name] = (estimate_total(instrs, chip, lo, launch), estimate_total(instrs, chip, hi, launch))
    return dict(sorted(out.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])))


def _is_pe_transpose(instr: Instr) -> bool:
    """Whether ``instr`` is a TensorE transpose (``nc_transpose`` on TensorE or ``nc_matmul(is_transpose=True)``:
    the same transpose mode on NeuronCore-v3, :attr:`Chip.fp32_transpose_slowdown`)."""
    return instr.engine == TENSOR and (instr.op == "nc_transpose" or bool(instr.attrs.get("is_transpose")))


def _matmul_dtype(instr: Instr) -> str:
    st = _role(instr, "stationary", "moving")
    if st is not None:
        return st.dtype
    ins = [o for o in instr.operands if o.role != "dst"]
    return ins[0].dtype if ins else "bfloat16"
