"""Global metrics: means over every rank's samples, not rank 0's last batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.runtime.context import DistributedContext


class GlobalMean:
    """Sums of named values and a sample count, all-reduced in one collective on demand."""

    def __init__(self, context: DistributedContext, *names: str) -> None:
        self.context = context
        self.names = names
        self.reset()

    def reset(self) -> None:
        self._sums = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=self.context.device)

    def add(self, samples: int, **sums: torch.Tensor | float) -> None:
        """Adds per-batch sums (for a mean loss: the loss summed over the batch's real samples)."""
        values = [torch.as_tensor(sums[name], dtype=torch.float64, device=self.context.device).detach() for name in self.names]
        self._sums += torch.stack([*values, torch.tensor(float(samples), dtype=torch.float64, device=self.context.device)])

    def compute(self) -> dict[str, float]:
        """Global means (identical on every rank) and the global sample count; a collective."""
        totals = self._sums.clone()
        if self.context.is_distributed and dist.is_initialized():
            dist.all_reduce(totals)
        *sums, samples = totals.tolist()
        means = {name: (value / samples if samples else float("nan")) for name, value in zip(self.names, sums)}
        return {**means, "samples": samples}
