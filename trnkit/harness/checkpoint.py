"""Checkpoints: torch.distributed.checkpoint (DCP) of the full training state, written atomically.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/`` (a DCP directory). A save goes to
``step-<N>.tmp`` first and is renamed by rank 0 after every rank has finished writing, so a run killed
mid-save never leaves a half-written ``step-<N>``; resuming picks the highest complete ``step-<N>``.
State: model and optimizer (sharded, via ``torch.distributed.checkpoint.state_dict``), lr scheduler,
data-loader position, step, and every rank's torch RNG state.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from trnkit.harness.config import ConfigError

_STEP_DIR = re.compile(r"^step-(\d+)$")


def list_checkpoints(folder: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `folder`, as (step, path), oldest first."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
            out.append((int(m.group(1)), os.path.join(folder, name)))
    return sorted(out)


def latest_checkpoint(folder: str) -> tuple[int, str] | None:
    ckpts = list_checkpoints(folder)
    return ckpts[-1] if ckpts else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    def __init__(self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 loader: Any, rank: int, world_size: int, keep_latest_k: int = 2, expert_tp_layout: int = 1) -> None:
        self.folder, self.model, self.optimizer, self.scheduler, self.loader = folder, model, optimizer, scheduler, loader
        self.rank, self.world_size, self.keep_latest_k = rank, world_size, keep_latest_k
        self.expert_tp_layout = expert_tp_layout  # experts' w_gate_up column layout (tp_experts.py)

    def _state(self, step: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "train": {"step": step, "expert_tp_layout": self.expert_tp_layout},
            # per-rank keys: DCP keeps one copy of same-named plain tensors, RNG streams differ per rank
            "rng": {f"rank{self.rank}": torch.get_rng_state()},
        }

    def save(self, step: int) -> str:
        os.makedirs(self.folder, exist_ok=True)
        final = os.path.join(self.folder, f"step-{step}")
        tmp = final + ".tmp"
        if self.rank == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp)
        _barrier()
        dcp.save(self._state(step), checkpoint_id=tmp)
        _barrier()
        if self.rank == 0:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)  # atomic on POSIX: the checkpoint appears complete or not at all
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for _, path in list_checkpoints(self.folder)[:-self.keep_latest_k]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: str) -> int:
        """Restore everything from `path`; returns the step it was saved at."""
        state = self._state(0)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        saved = int(state["train"].get("expert_tp_layout", 1))
        if saved != self.expert_tp_layout:
            raise ConfigError(f"checkpoint {path}: its expert weights use the tp_experts='shard_i' layout of "
                              f"tensor_parallel_degree {saved}, this run expects {self.expert_tp_layout} "
                              "(resume with the same parallelism settings)")
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.loader.load_state_dict(state["data"])
        rng = state["rng"].get(f"rank{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng)
        return int(state["train"]["step"])


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded state dict (collective: every rank must call it; complete on every rank)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def load_full_model_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load an unsharded state dict (present on every rank) into a possibly sharded model."""
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))


__all__ = ["Checkpointer", "full_model_state_dict", "latest_checkpoint", "list_checkpoints",
           "load_full_model_state_dict"]
