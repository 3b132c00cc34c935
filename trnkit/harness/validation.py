"""Validation loss: the mean next-token cross-entropy over held-out batches, every ``validation.freq`` steps.

Each evaluation rewinds the validation loader and reads the same ``validation.steps`` global batches
(each data-parallel rank its share), runs the model in ``eval()`` mode under ``torch.no_grad()``,
and reduces the summed loss and the token count over the data-parallel ranks, so the result is the
token-weighted mean over all ranks' batches: the same number a single process would compute. The
training state is untouched: the training loader is not read, the RNG state is restored and the
model is put back in ``train()`` mode, so a run with validation trains exactly as one without.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trnkit.harness import parallel
from trnkit.harness.data import IGNORE_INDEX, PackedLoader

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, labels) -> summed CE


class Validator:
    def __init__(self, loader: PackedLoader, steps: int, freq: int, last_step: int, dp_group: Any = None) -> None:
        self.loader, self.steps, self.freq, self.last_step, self.dp_group = loader, steps, freq, last_step, dp_group

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    def evaluate(self, model: torch.nn.Module, loss_sum: LossSum) -> float:
        """Mean cross-entropy per label token over this evaluation's batches, over all dp ranks."""
        self.loader.position = 0
        rng = torch.get_rng_state()
        was_training = model.training
        model.eval()
        ce = torch.zeros((), dtype=torch.float64)
        tokens = 0
        try:
            with torch.no_grad():
                for _ in range(self.steps):
                    batch = self.loader.next_batch()
                    ce += loss_sum(batch.tokens, batch.labels).double().cpu()
                    tokens += int((batch.labels != IGNORE_INDEX).sum())
        finally:
            model.train(was_training)
            torch.set_rng_state(rng)
        totals = parallel.all_reduce_sum(torch.stack([ce, torch.tensor(float(tokens), dtype=torch.float64)]),
                                         self.dp_group)
        return float(totals[0] / totals[1])


__all__ = ["Validator"]
