"""Global metrics: means over every rank's samples, not rank 0's last batch."""

from __future__ import annotations

import math
from typing import Any

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
        self._pending: list[tuple[float, list[torch.Tensor | float]]] = []  # (weight, a value per name)
        self._samples = 0.0

    def add(self, samples: int, **sums: torch.Tensor | float) -> None:
        """Adds per-batch sums (for a mean loss: the loss summed over the batch's real samples)."""
        self._keep(1.0, samples, sums)

    def add_mean(self, samples: int, **means: torch.Tensor | float) -> None:
        """Adds per-batch means over ``samples`` samples (a loss with reduction="mean"), each
        weighted by its sample count. In a training loop this is the cheaper call: it keeps the
        mean the gradient came from, with no operation of its own per step. A batch of no
        samples adds nothing: its mean is not defined (and would be NaN)."""
        if samples:
            self._keep(float(samples), samples, means)

    def _keep(self, weight: float, samples: int, values: dict[str, torch.Tensor | float]) -> None:
        # Called every step. A value on the CPU is read at once (a Python float costs less to keep
        # and to sum than a tensor, and there is no device to wait for); one on a GPU is only
        # kept (detached: no device work, no sync). They are summed in float64 every
        # _FOLD_EVERY additions and when compute() reads them.
        kept = [_host_or_detached(value) for value in map(values.__getitem__, self.names)]
        self._pending.append((weight, kept))
        self._samples += samples
        if len(self._pending) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Moves the kept values, times their weights, into the float64 sums."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        device = self.context.device
        if not any(isinstance(value, torch.Tensor) for _, values in pending for value in values):  # all read on the CPU
            columns = [math.fsum(weight * values[index] for weight, values in pending) for index in range(len(self.names))]
            self._sums += torch.tensor(columns, dtype=torch.float64, device=device)
            return
        weights = torch.tensor([weight for weight, _ in pending], dtype=torch.float64, device=device)
        for index in range(len(self.names)):
            column = _float64_column([values[index] for _, values in pending], device)
            self._sums[index] += (column * weights).sum()

    def compute(self) -> dict[str, float]:
        """Global means (identical on every rank) and the global sample count; a collective."""
        return self.compute_async().result()

    def snapshot(self) -> torch.Tensor:
        """This rank's totals so far (the sums, then the sample count), kept aside: no collective.

        Hand it to a later :meth:`compute_async`, which reduces it in the same collective as
        the totals then: the global mean up to a point between two logging points (the end of
        an epoch) at no round trip of its own.
        """
        self._fold()
        samples_so_far = torch.tensor([self._samples], dtype=torch.float64, device=self.context.device)
        return torch.cat([self._sums, samples_so_far])  # a copy: later additions do not reach it

    def compute_async(self, *snapshots: torch.Tensor) -> PendingMeans:
        """:meth:`compute`, started: the all-reduce runs while the caller goes on (a training step),
        and ``.result()`` waits for it. Values added after this call are not in its result.
        ``snapshots`` (from :meth:`snapshot`) are reduced in the same collective:
        ``.earlier()`` has their global means.

        A blocking all-reduce at every logging point holds every rank for a network round
        trip (about a millisecond on gloo here, more across nodes); started at one step boundary
        and read at the next, it overlaps the step's compute. It is a collective: every rank
        starts it at the same point, with as many snapshots, in the same order as its other
        collectives.
        """
        now = self.snapshot()
        totals = torch.cat([*snapshots, now]) if snapshots else now
        work = None
        if self.context.is_distributed and dist.is_initialized():
            work = dist.all_reduce(totals, async_op=True)
        return PendingMeans(self.names, totals, work)


class PendingMeans:
    """The result of :meth:`GlobalMean.compute_async`, once its all-reduce is done."""

    def __init__(self, names: tuple[str, ...], totals: torch.Tensor, work: Any) -> None:
        self.names, self._totals, self._work = names, totals, work
        self._results: list[dict[str, float]] | None = None

    def result(self) -> dict[str, float]:
        """Global means and the global sample count; waits for the all-reduce (a device sync on CUDA)."""
        return self._read()[-1]

    def earlier(self) -> list[dict[str, float]]:
        """The same for each snapshot handed to ``compute_async``, in order."""
        return self._read()[:-1]

    def _read(self) -> list[dict[str, float]]:
        if self._results is None:
            if self._work is not None:
                self._work.wait()
            values, width = self._totals.tolist(), len(self.names) + 1
            self._results = [self._means(values[start : start + width]) for start in range(0, len(values), width)]
        return self._results

    def _means(self, row: list[float]) -> dict[str, float]:
        *sums, samples = row
        means = {name: (value / samples if samples else float("nan")) for name, value in zip(self.names, sums)}
        return {**means, "samples": samples}


def _host_or_detached(value: torch.Tensor | float) -> torch.Tensor | float:
    """A CPU tensor's value as a Python number (exact: float64 holds every float32 and every
    integer below 2**53); a GPU tensor detached, to be summed on its device without a sync."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.is_cpu else value.detach()
    return value


def _float64_column(values: list[torch.Tensor | float], device: torch.device) -> torch.Tensor:
    """The values as one float64 vector. Each converts exactly: a float32 or an integer never
    passes through a narrower type on the way (Python numbers go straight to float64)."""
    first = values[0]
    if isinstance(first, torch.Tensor) and first.numel() == 1 and all(
        isinstance(v, torch.Tensor) and v.dtype == first.dtype and v.shape == first.shape for v in values
    ):  # the usual case, one loss tensor per step: one stack, one conversion
        return torch.stack(values).reshape(len(values)).to(device=device, dtype=torch.float64)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
