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
        self._sums = [torch.zeros((), dtype=torch.float64, device=self.context.device) for _ in self.names]
        self._samples = 0.0

    @torch.no_grad()
    def add(self, samples: int, **sums: torch.Tensor | float) -> None:
        """Adds per-batch sums (for a mean loss: the loss summed over the batch's real samples).

        Called every step, so it stays a single in-place add per value on the device, with no
        host-device sync: the values are read only when :meth:`compute` all-reduces them.
        """
        for total, name in zip(self._sums, self.names):
            total.add_(sums[name])
        self._samples += samples

    def compute(self) -> dict[str, float]:
        """Global means (identical on every rank) and the global sample count; a collective."""
        samples_so_far = torch.tensor([self._samples], dtype=torch.float64, device=self.context.device)
        totals = torch.cat([torch.stack(self._sums), samples_so_far]) if self._sums else samples_so_far
        if self.context.is_distributed and dist.is_initialized():
            dist.all_reduce(totals)
        *sums, samples = totals.tolist()
        means = {name: (value / samples if samples else float("nan")) for name, value in zip(self.names, sums)}
        return {**means, "samples": samples}
