"""Test helper: do the two programs of an LNC=2 launch run the same control flow?

On a logical core of two, both physical cores must take the same run-time control flow: "different
control flow on the two cores is undefined, and you will likely receive an error at runtime" (NKI LNC
guide); a kernel gives the core with less to do empty or masked work instead (nki-library's moe_cte).
:func:`recorded_streams` records, per program of every grid launch, its instruction count per engine
and the trip count of every ``nl.fori_loop`` / ``nl.while_loop`` it ran, in order;
:func:`assert_same_streams` compares the programs and names the first difference.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from trnkit.nkisim import language, memory, trace


@dataclass
class Streams:
    """Per (launch, program): ``trips`` (run-time loop trip counts in order) and ``engines`` (instruction
    count per engine), filled by :func:`recorded_streams`."""

    trips: dict = field(default_factory=lambda: defaultdict(list))
    engines: dict = field(default_factory=lambda: defaultdict(Counter))
    trace: trace.Trace | None = None


def _key() -> tuple[int, int]:
    ctx = memory.current()
    return ctx.launch.seq, ctx.flat_program_id


@contextlib.contextmanager
def recorded_streams(trace_only: bool = False) -> Iterator[Streams]:
    """Record the control flow of every program launched inside the block (see the module doc)."""
    out = Streams()
    fori, while_ = language.fori_loop, language.while_loop

    def counted_fori(lower, upper, body_fun, step=1):
        lo, hi = language._reg_value(lower), language._reg_value(upper)
        out.trips[_key()].append(len(range(lo, hi, step)))
        return fori(lower, upper, body_fun, step)

    def counted_while(init_reg, body_fun):
        n = [0]

        def body():
            n[0] += 1
            return body_fun()

        while_(init_reg, body)
        out.trips[_key()].append(n[0])

    language.fori_loop, language.while_loop = counted_fori, counted_while
    try:
        with trace.record(trace_only=trace_only) as tr:
            yield out
    finally:
        language.fori_loop, language.while_loop = fori, while_
    out.trace = tr
    for i in tr:
        out.engines[(i.attrs.get("launch"), i.program_id)][i.engine] += 1


def divergences(s: Streams) -> list[str]:
    """The first difference between the programs of each grid launch ([] when they all agree)."""
    found = []
    launches = defaultdict(set)
    for seq, pid in s.trips:
        launches[("trips", seq)].add(pid)
    for seq, pid in s.engines:
        launches[("engines", seq)].add(pid)
    for (kind, seq), pids in sorted(launches.items(), key=str):
        if len(pids) < 2 and max(pids) == 0:
            continue  # a launch without a grid
        table = s.trips if kind == "trips" else s.engines
        ref = table.get((seq, 0), [] if kind == "trips" else Counter())
        for pid in sorted(pids):
            got = table.get((seq, pid), [] if kind == "trips" else Counter())
            if got == ref:
                continue
            if kind == "trips":
                k = next((j for j in range(min(len(ref), len(got))) if ref[j] != got[j]), min(len(ref), len(got)))
                found.append(f"launch {seq}: program {pid} loop #{k}: trips {got[k:k + 3]} vs program 0 "
                             f"{ref[k:k + 3]} ({len(got)} vs {len(ref)} loops)")
            else:
                found.append(f"launch {seq}: program {pid} instructions per engine {dict(got)} vs program 0 "
                             f"{dict(ref)}")
    return found


def assert_same_streams(s: Streams) -> None:
    """Fail naming the first divergence of any grid launch recorded in ``s``."""
    bad = divergences(s)
    assert not bad, "LNC=2 programs diverge: " + "; ".join(bad)
