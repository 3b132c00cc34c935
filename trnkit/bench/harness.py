"""The shared benchmark harness: kernel cases in, schema rows out.

A :class:`Case` names one point of a sweep (kernel, mode, swept quantity and value, configuration) and
knows how to :meth:`~Case.build` its inputs into a :class:`Prepared` pair of callables: the NKI kernel
call and the torch reference op on the same inputs. :func:`run_case` turns it into rows:

* on the interpreter (no real ``nki``): the kernel runs once under ``trace.record(trace_only=True)``
  (large matmuls skip their arithmetic) and the cost model gives the **estimated** trn2 time, the
  roofline bound, per-engine busy time and the fraction of roofline; the estimate's range (optimistic /
  pessimistic settings of :mod:`trnkit.nkisim.cost_params`) goes in the p20 / p80 columns;
* with the real ``nki`` on a Trainium host: the kernel's **measured** wall time (host timer around a
  synchronised call; p20/p50/p80) instead — no Trainium here: the tests exercise this branch with the
  interpreter standing in for the device;
* always: the torch reference op's **measured** wall time on the current device (p20/p50/p80).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

import trnkit
from trnkit.bench import fingerprint
from trnkit.bench.schema import Row

QUANTILES = (0.5, 0.2, 0.8)


@dataclass
class Prepared:
    """Ready-to-call closures over one case's inputs."""

    nki: Callable[[], object]  # the NKI kernel (interpreter or device)
    ref: Callable[[], object]  # the torch reference op, same inputs, on the current device


@dataclass
class Case:
    kernel: str
    mode: str  # "forward" | "backward"
    x_name: str
    x_value: int | float | str
    build: Callable[[], Prepared]
    config: dict = field(default_factory=dict)
    # the sources the kernel runs (trnkit.bench.fingerprint names: "trnkit/kernels/moe"); recorded with each
    # cost-model row's details (its fingerprint: cost_model, sources, computed)
    sources: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.kernel}/{self.mode} {self.x_name}={self.x_value}"


def time_quantiles(fn: Callable[[], object], warmup: int = 1, min_reps: int = 5, max_reps: int = 100,
                   budget_s: float = 1.0, sync: Callable[[], None] | None = None,
                   max_total_s: float = 60.0, info: dict | None = None) -> tuple[float, float, float]:
    """Wall time of ``fn`` in microseconds: (p50, p20, p80).

    Calls ``fn`` ``warmup`` times, then at least ``min_reps`` times and until ``budget_s`` is spent (at
    most ``max_reps``). A slow ``fn`` stops early once ``max_total_s`` is spent (at least one timed
    call); if the first warm-up call alone takes over ``max_total_s / 2``, that call is the only sample.
    ``info`` (if given) receives ``reps`` and ``cold`` so the row can say how it was measured."""

    def once() -> float:
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        return (time.perf_counter() - t0) * 1e6

    start = time.perf_counter()
    times: list[float] = []
    cold = False
    for k in range(warmup):
        t = once()
        if k == 0 and t * 1e-6 > max_total_s / 2:  # too slow to repeat: keep the cold call
            times, cold = [t], True
            break
    if not cold:
        t_end = time.perf_counter() + budget_s
        while len(times) < max_reps:
            times.append(once())
            now = time.perf_counter()
            if len(times) >= min_reps and now >= t_end:
                break
            if now - start >= max_total_s:
                break
    if info is not None:
        info.update(reps=len(times), cold=cold)
    p = np.quantile(np.asarray(times), QUANTILES)
    return float(p[0]), float(p[1]), float(p[2])


def estimate_range(total_range_ns: tuple[float, float, float]) -> tuple[float, float, float]:
    """``(low, mid, high)`` of an estimate from its totals at the optimistic, mid and pessimistic settings
    (``CostReport.total_range_ns``): low / high are the smallest / largest of the three, since a list
    schedule is not monotone in its parameters (a setting that speeds one engine up can reorder the
    queues and finish later)."""
    optimistic, mid, pessimistic = total_range_ns
    return min(optimistic, mid, pessimistic), mid, max(optimistic, mid, pessimistic)


def host_device() -> str:
    """Where torch reference ops run here: ``cpu: <processor>`` (or the accelerator's name)."""
    import torch

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    proc = platform.processor() or platform.machine()
    return f"cpu: {proc} x{torch.get_num_threads()} threads"


def _device_sync() -> Callable[[], None] | None:
    """A synchronisation callable for real-device timing (torch-xla), or None."""
    try:
        import torch_xla.core.xla_model as xm  # only on Neuron hosts
    except ImportError:
        return None
    return lambda: xm.wait_device_ops()


def run_case(case: Case, chip: str = "trn2", measure_torch: bool = True, budget_s: float = 0.5,
             torch_threads: int | None = None) -> list[Row]:
    """Benchmark one case; returns its rows (see the module docstring). ``torch_threads`` fixes torch's
    intra-op thread count while the reference op is timed (None: leave it)."""
    from trnkit.nki_api import REAL_NKI  # resolving imports the interpreter

    prepared = case.build()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    base = dict(kernel=case.kernel, mode=case.mode, x_name=case.x_name, x_value=case.x_value,
                timestamp=stamp, trnkit_version=trnkit.__version__)
    cfg = json.dumps(case.config, sort_keys=True)
    rows: list[Row] = []

    def row(impl: str, metric: str, unit: str, p: tuple[float, float, float], device: str,
            extra: dict | None = None) -> None:
        # the case's configuration at the top level, what this number adds under "details"
        ex = json.dumps({**case.config, "details": extra}, sort_keys=True) if extra else cfg
        rows.append(Row(impl=impl, metric=metric, unit=unit, p50=p[0], p20=p[1], p80=p[2], extra=ex,
                        device=device, **base))

    if REAL_NKI:
        sync = _device_sync()
        how = {}
        p = time_quantiles(prepared.nki, warmup=3, budget_s=budget_s, sync=sync, info=how)
        row("nki", "wall_time", "us", p, "trainium", {"timer": "host perf_counter around a synced call", **how})
    else:
        from trnkit.nkisim import cost, trace  # interpreter only

        t0 = time.perf_counter()
        with trace.record(trace_only=True) as tr:
            prepared.nki()
        interp_s = time.perf_counter() - t0
        rep = cost.estimate(tr, chip)
        dev = f"{chip} (cost model)"
        details = {**fingerprint.stamp(case.sources), "model": rep.model, "n_instrs": rep.n_instrs,
                   "bottleneck": rep.bottleneck, "flops": rep.flops, "hbm_bytes": rep.hbm_bytes,
                   "interp_trace_only_s": round(interp_s, 4)}
        us = 1e-3
        # the model's range in the quantile columns: p50 mid, p20 / p80 the low / high end
        low, mid, high = (t * us for t in estimate_range(rep.total_range_ns))
        row("nki", "est_time", "us", (mid, low, high), dev, {**details, "range": "optimistic..pessimistic "
                                                              "parameters of trnkit.nkisim.cost_params"})
        fp = {k: details[k] for k in fingerprint.FIELDS}  # on every cost-model row
        row("roofline", "est_time", "us", (rep.roofline_ns * us,) * 3, dev,
            {**fp, "compute_bound_us": rep.compute_bound_ns * us, "memory_bound_us": rep.memory_bound_ns * us})
        row("nki", "serial_time", "us", (rep.serial_ns * us,) * 3, dev, fp)
        fractions = tuple(rep.roofline_ns * us / t if t > 0 else 0.0 for t in (mid, high, low))
        row("nki", "fraction_of_roofline", "ratio", fractions, dev, fp)
        for eng, busy in rep.busy_ns.items():
            row("nki", f"busy_{eng}", "us", (busy * us,) * 3, dev,
                {**fp, "utilization": rep.utilization[eng], "count": rep.count.get(eng, 0)})
    if measure_torch:
        import torch

        saved = torch.get_num_threads()
        if torch_threads:  # a fixed thread count keeps shared-CPU timings reproducible
            torch.set_num_threads(torch_threads)
        try:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            how: dict = {}
            p = time_quantiles(prepared.ref, budget_s=budget_s, info=how)
            # the 1-minute load average says how shared the CPU was while timing
            row("torch", "wall_time", "us", p, host_device(),
                {"torch_threads": torch.get_num_threads(), "load_avg_1m": load, **how})
        finally:
            torch.set_num_threads(saved)
    return rows


def run_cases(cases: Iterable[Case], chip: str = "trn2", measure_torch: bool = True, budget_s: float = 0.5,
              torch_threads: int | None = None, log: Callable[[str], None] | None = print,
              sink: Callable[[list[Row]], object] | None = None,
              failures: list[str] | None = None) -> list[Row]:
    """Run every case in order. A case the kernel declares unsupported (its entry check raises
    ``KernelConstraintError``) is logged and skipped. Any other error propagates, unless ``failures`` is
    a list: then the error is logged, appended to it as ``"<case>: <error>"``, and the run goes on.
    ``sink`` gets each case's rows as soon as they exist (e.g. to append them to the CSV)."""
    from trnkit.kernels.constraints import KernelConstraintError

    rows: list[Row] = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            case_rows = run_case(case, chip=chip, measure_torch=measure_torch, budget_s=budget_s,
                                 torch_threads=torch_threads)
        except KernelConstraintError as exc:
            if log:
                log(f"  {case.label}: skipped, outside the kernel's constraints: {exc}")
            continue
        except Exception as exc:  # only with failures= (keep going), else re-raised
            if failures is None:
                raise
            failures.append(f"{case.label}: {type(exc).__name__}: {exc}")
            if log:
                log(f"  {case.label}: FAILED: {type(exc).__name__}: {exc}")
            continue
        rows += case_rows
        if sink is not None:
            sink(case_rows)
        if log:
            est = next((r.p50 for r in case_rows if r.metric in ("est_time", "wall_time") and r.impl == "nki"), None)
            log(f"  {case.label}: nki {est:.2f} us ({time.perf_counter() - t0:.1f} s)" if est is not None
                else f"  {case.label}: done")
    return rows
