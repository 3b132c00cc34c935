"""The MoE load-balancing (aux) loss of one training step, per microbatch or over the global batch.

transformers' Qwen3-MoE computes ``E * sum_e f_e * P_e`` per forward (``f_e``: fraction of the (token,
layer) rows routed to expert e, no gradient; ``P_e``: mean router probability of e). With gradient
accumulation or data parallelism that is a per-microbatch statistic, so splitting a batch changes
the loss. ``scope = "global_batch"`` (the default; Qwen's global-batch balancing, Qiu et al. 2025,
"Demons in the Detail", arXiv:2501.11873) takes ``f_e`` and the row count over every microbatch and
data-parallel rank of the step. Microbatch m on rank r adds
``coef * E * sum_e (C_e / R) * (p_{m,r,e} / R)`` (``C, R``: the step's counts and rows, ``p``: its own
probability sums); summed over microbatches and ranks that is exactly the loss of the whole batch in
one forward. The counts must be known before the first backward: with one microbatch per step they
come from an all-reduce after the forward; with accumulation a no-grad forward of each microbatch
counts them first (one extra forward per microbatch, only while the aux loss is on).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trnkit.harness import parallel
from trnkit.model_spec import ModelSpec
from trnkit.qwen3.model import load_balancing_loss


class MoEAuxLoss:
    def __init__(self, spec: ModelSpec, scope: str, dp: int, dp_group: Any) -> None:
        self.spec, self.scope, self.dp, self.dp_group = spec, scope, dp, dp_group
        self.coef = spec.aux_coef
        self._totals: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sum = 0.0
        self._accum = 1

    def _reduce(self, counts: torch.Tensor, rows: float) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.cat([counts.detach().float().cpu(), torch.tensor([float(rows)])])
        packed = parallel.all_reduce_sum(packed, self.dp_group)
        return packed[:-1], packed[-1]

    def start_step(self, model: torch.nn.Module, n_microbatches: int, forward: Callable[[int], Any]) -> None:
        """Before the step's first microbatch; `forward(i)` runs microbatch i's forward."""
        self._sum, self._totals, self._accum = 0.0, None, n_microbatches
        if self.scope != "global_batch" or not self.coef or n_microbatches == 1:
            return
        counts, rows = torch.zeros(()), 0
        with torch.no_grad():
            for i in range(n_microbatches):
                forward(i)
                stats = self.spec.router_stats(model)
                if stats is None:
                    return
                counts, rows = counts + stats[0].detach().cpu(), rows + stats[2]
        self._totals = self._reduce(counts, rows)

    def term(self, model: torch.nn.Module) -> torch.Tensor | None:
        """This microbatch's contribution to the loss to backpropagate (after its forward), or None."""
        if not self.coef:
            return None
        if self.scope == "microbatch":
            aux = self.spec.aux_loss(model)
            if aux is None:
                return None
            self._sum += float(aux.detach()) / self._accum
            return aux / self._accum  # mean over microbatches (and, through FSDP's averaging, over ranks)
        stats = self.spec.router_stats(model)
        if stats is None:
            return None
        counts, prob_sum, rows = stats
        total_counts, total_rows = self._totals or self._reduce(counts, rows)
        dev = prob_sum.device
        aux = self.coef * load_balancing_loss(total_counts.to(dev), prob_sum, total_rows.to(dev),
                                              self.spec.shape.num_experts)
        self._sum += float(aux.detach())
        return aux * self.dp  # FSDP averages gradients over the dp ranks; the step's loss is their sum

    def value(self) -> float:
        """The step's aux loss as reported (global_batch: the whole batch's value; collective)."""
        if self.scope == "global_batch" and self.coef:
            return float(parallel.all_reduce_sum(torch.tensor(self._sum, dtype=torch.float64), self.dp_group))
        return self._sum


__all__ = ["MoEAuxLoss"]
