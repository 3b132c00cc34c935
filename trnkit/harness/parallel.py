"""Process group, device mesh, FSDP2, and distributed helpers (grad clipping, reductions).

Under ``torchrun`` the usual env vars (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) are used; a
plain ``python -m trnkit.harness.train`` runs as a world of one (a gloo group is still created so
every code path, checkpoints included, is the same). Device: ``neuron`` when torch-neuronx is
importable, else CPU with gloo.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trnkit.errors import ConfigError
from trnkit.harness.config import ParallelismConfig, resolve_parallel_degrees


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dp: int
    tp: int
    mesh: Any            # DeviceMesh ("dp", "tp")
    dp_rank: int

    @property
    def dp_group(self) -> Any:
        return self.mesh["dp"].get_group()


def neuron_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None


def _integer(text: str) -> int | None:
    """``text`` as an int when it is ASCII digits with an optional sign, else None (``str.isdigit`` passes '²',
    which ``int`` refuses; ``int`` passes '1_0' and '١', which torchrun never writes)."""
    return int(text) if re.fullmatch(r"[+-]?[0-9]+", text) else None


def launch_ranks(environ: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's RANK, WORLD_SIZE and LOCAL_RANK in `environ` (0, 1, 0
    when unset); a value that is no such number is a ConfigError naming the variable, the rule and the value."""
    def number(name: str, default: int, rule: str, ok: Callable[[int], bool]) -> int:
        text = environ.get(name, str(default)).strip()
        value = _integer(text)
        if value is None or not ok(value):
            raise ConfigError(f"environment variable {name}: must be {rule} (torchrun sets it), got {text!r}")
        return value

    world = number("WORLD_SIZE", 1, "an integer >= 1", lambda v: v >= 1)
    rank = number("RANK", 0, f"an integer in [0, WORLD_SIZE - 1 = {world - 1}]", lambda v: 0 <= v < world)
    local_rank = number("LOCAL_RANK", 0, f"an integer in [0, RANK = {rank}]", lambda v: 0 <= v <= rank)
    return rank, world, local_rank


def ranks_on_host(environ: Mapping[str, str], world: int) -> int:
    """How many of the run's ``world`` ranks share this host: torchrun's LOCAL_WORLD_SIZE (``world`` when
    unset); a value that is not an integer in [1, world] is a ConfigError naming the variable."""
    text = environ.get("LOCAL_WORLD_SIZE", str(world)).strip()
    value = _integer(text)
    if value is None or not 1 <= value <= world:
        raise ConfigError(f"environment variable LOCAL_WORLD_SIZE: must be an integer in [1, WORLD_SIZE = {world}] "
                          f"(torchrun sets it), got {text!r}")
    return value


def init_distributed(pcfg: ParallelismConfig) -> DistEnv:
    rank, world, local_rank = launch_ranks(os.environ)
    dp, tp = resolve_parallel_degrees(pcfg, world)  # raises before any group is created
    if neuron_available():  # pragma: no cover - Trainium only
        # Native TorchNeuron registers the "neuron" device (PrivateUse1, module torch.neuron) and the
        # "neuron" process-group backend on import (awsdocs-neuron: torch/guides/torch-distributed).
        import torch_neuronx  # noqa: F401
        device, backend = torch.device("neuron", local_rank), "neuron"
        if hasattr(torch, "neuron") and hasattr(torch.neuron, "set_device"):
            torch.neuron.set_device(local_rank)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if world == 1 and "MASTER_PORT" not in os.environ:
            # an in-process store: no TCP port to pick (a port found free can be taken by another process
            # before the store listens on it: EADDRINUSE under parallel test runs)
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group(backend=backend, rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return DistEnv(rank, world, local_rank, device, dp, tp, mesh, mesh["dp"].get_local_rank())


def device_name(device: torch.device) -> str:
    if device.type != "neuron":
        return device.type
    try:  # pragma: no cover - Trainium only
        return str(torch.neuron.get_device_properties(device).name)
    except Exception:  # noqa: BLE001  # pragma: no cover - a name is cosmetic
        return "neuron"


def destroy(sync: bool = False) -> None:
    """Tear the process group down. ``sync=True`` (a clean finish) first waits for every rank: a rank
    that destroys its gloo group while a peer still uses it can abort at exit ("terminate called without
    an active exception"). Error paths skip the barrier, since a failed peer would never reach it."""
    if dist.is_initialized():
        if sync and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], dp_mesh: Any, param_dtype: torch.dtype | None) -> None:
    """FSDP2: one ``fully_shard`` unit per transformer block, then the root (embeddings, norm, head).

    FSDP averages gradients over the data-parallel ranks; the training loop therefore multiplies its
    loss (token sum / *global* token count) by the dp degree, so the averaged gradient is the gradient
    of the global loss. (torchtitan instead sets the divide factor to 1, which needs PREMUL_SUM, a
    reduce op gloo does not have.)
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Full activation checkpointing per block: each block's forward runs under non-reentrant
    ``torch.utils.checkpoint``, which keeps only the block's inputs and recomputes its activations in the
    backward. The forward is replaced on the instance, so parameter names, state dicts and FSDP2 / compile
    (applied to the block as before) are unchanged."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


@contextmanager
def local_shards(model: nn.Module) -> Iterator[None]:
    """Within the block, every DTensor parameter is replaced by a plain Parameter viewing its local
    shard, so initialisers that use ops DTensor lacks (nonzero, fancy indexing) write the shards in
    place. The DTensor parameters (ties included) are put back on exit."""
    saved = []
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and hasattr(p, "to_local"):
                saved.append((m, name, p))
                m._parameters[name] = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for m, name, p in saved:
            m._parameters[name] = p


def _full_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Total L2 grad norm over all params (DTensor or plain, mixed), clipped in place if max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = [_full_value(torch.linalg.vector_norm(g.float())) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        coef = min(max_norm / (float(total) + 1e-6), 1.0)  # a Python float works for DTensor grads too
        for g in grads:
            g.mul_(coef)
    return total


def all_reduce_sum(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    y = x.detach().clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


__all__ = ["DistEnv", "all_reduce_sum", "apply_fsdp", "clip_grad_norm", "destroy", "init_distributed", "launch_ranks",
           "local_shards", "neuron_available"]
