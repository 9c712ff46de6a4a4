"""Global metrics: means over every rank's samples, not rank 0's last batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.runtime.context import DistributedContext


#: Kept per-batch values are summed into the totals this often: a bounded list, one reduction per many steps.
_FOLD_EVERY = 256


class GlobalMean:
    """Sums of named values and a sample count, all-reduced in one collective on demand."""

    def __init__(self, context: DistributedContext, *names: str) -> None:
        self.context = context
        self.names = names
        self.reset()

    def reset(self) -> None:
        self._sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.context.device)
        self._pending: list[list[torch.Tensor | float]] = [[] for _ in self.names]
        self._samples = 0.0

    def add(self, samples: int, **sums: torch.Tensor | float) -> None:
        """Adds per-batch sums (for a mean loss: the loss summed over the batch's real samples).

        Called every step, so it only keeps the values (detached; no device work, no sync):
        they are summed in float64 every ``_FOLD_EVERY`` additions and when :meth:`compute` reads them.
        """
        for pending, name in zip(self._pending, self.names):
            value = sums[name]
            pending.append(value.detach() if isinstance(value, torch.Tensor) else value)
        self._samples += samples
        if self._pending and len(self._pending[0]) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Moves the kept values into the float64 sums."""
        for index, pending in enumerate(self._pending):
            if pending:  # each value converts exactly to float64 (a Python number never passes float32)
                values = [torch.as_tensor(v, dtype=torch.float64, device=self.context.device).reshape(()) for v in pending]
                self._sums[index] += torch.stack(values).sum()
                pending.clear()

    def compute(self) -> dict[str, float]:
        """Global means (identical on every rank) and the global sample count; a collective."""
        self._fold()
        samples_so_far = torch.tensor([self._samples], dtype=torch.float64, device=self.context.device)
        totals = torch.cat([self._sums, samples_so_far])
        if self.context.is_distributed and dist.is_initialized():
            dist.all_reduce(totals)
        *sums, samples = totals.tolist()
        means = {name: (value / samples if samples else float("nan")) for name, value in zip(self.names, sums)}
        return {**means, "samples": samples}
