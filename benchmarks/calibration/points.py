"""Published device measurements of NKI kernels that trnkit's cost model is checked against.

Each point: the kernel (ported in this folder), its shape, the device, the published time, where it was
published, and its role: ``fit`` points may have informed a fitted parameter (named in
``trnkit/nkisim/cost_params.py``), ``check`` points are held out. The only published per-kernel device
times for NKI kernels we found are the fused-Mamba tutorial's (aws-neuron-sdk
``general/nki/tutorials/fused_mamba.rst`` at Neuron SDK 2.20.0, commit 72825d50; kept at
``nki/guides/tutorials/fused_mamba.rst``); the NKI performance guide, the kernel-optimization and matmul
tutorials, the nki-library docs and design specs give engine-utilisation percentages or none, not times.
"""

from __future__ import annotations

from dataclasses import dataclass

TUTORIAL = "aws-neuron-sdk 2.20.0 general/nki/tutorials/fused_mamba.rst"


@dataclass(frozen=True)
class Point:
    name: str
    version: str  # mamba_kernels.KERNELS key
    batch: int
    channels: int
    seq_len: int
    state_size: int
    published_ms: float
    role: str  # "fit" | "check" | "context"
    source: str
    note: str = ""
    device: str = "trn1"

    @property
    def shape(self) -> str:
        return f"b{self.batch} c{self.channels} s{self.seq_len} n{self.state_size}"


POINTS: tuple[Point, ...] = (
    Point("mamba_v1", "v1", 1, 4096, 512, 16, 2.34, "fit", f"{TUTORIAL} (\"now 2.34 ms\")",
          "VectorE 92.16% active; delta/u reloaded per state"),
    Point("mamba_v2", "v2", 1, 4096, 512, 16, 1.61, "fit", f"{TUTORIAL} (\"now 1.61 ms\")",
          "VectorE 99.63% active"),
    *(Point(f"mamba_v3 s{s}", "v3", 1, 4096, s, 16, ms, "check", f"{TUTORIAL} (seq_len scaling table)")
      for s, ms in ((1024, 3.3), (2048, 6.6), (4096, 13.3))),
    Point("mamba_v3", "v3", 1, 4096, 8192, 16, 27.8, "check", f"{TUTORIAL} (\"now takes 27.8 ms\")",
          "VectorE 94.85% active"),
    Point("mamba_v1 small", "v1", 1, 256, 512, 16, 0.17293, "context", f"{TUTORIAL} (\"172.93 usec\")",
          "includes NEFF start-up and tear-down, which a kernel-level model does not contain"),
)

# Published but not modelled: mamba_v2 at seq_len > 512 (53.33 ms at 8192 and the scaling table's v2
# column) spills SBUF to HBM on the device (qSyncSpillReload rows in the profile); the interpreter
# allocates what the kernel declares and has no spill model.
NOT_MODELLED = ("mamba_v2 at seq_len 1024..8192 (4.4 .. 52.2 ms): compiler SBUF spill/reload",)
