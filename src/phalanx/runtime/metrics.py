"""Global metrics: means over every rank's samples, not rank 0's last batch."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from phalanx.runtime.context import DistributedContext
from phalanx.runtime.shared_reduction import ReducedPart, SharedReduction

#: Kept per-batch values are summed into the totals this often: a bounded list, one reduction per many steps.
_FOLD_EVERY = 256
#: A snapshot's rows of a value per name: the finite sums, the +inf counts, the -inf counts (then the samples).
_ROWS = 3
_CPU = torch.device("cpu")


class GlobalMean:
    """Sums of named values and a sample count, all-reduced in one collective on demand.

    A tensor value is kept as it is, without its graph, and read only when the kept values are
    summed, in float64, every few hundred additions and before a reduction: a training step pays
    for no tensor operation of its own. Values in host memory (Python numbers, CPU tensors) are
    summed on the host, where reading them waits for nothing; values on an accelerator are summed
    on the context's device, so that nothing before the all-reduce waits for it. So a tensor
    handed over must not be changed in place afterwards (a loss never is). NaN and infinities
    propagate as they would in a tensor sum, until :meth:`reset`; they are counted apart from
    the finite sum, so a running sum that took one still gives finite means over later spans.

    Args:
        context: the job (:func:`phalanx.init`).
        names: the values' names.

    Example::

        losses = phalanx.GlobalMean(context, "loss")
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            ...
            losses.add_mean(len(labels), loss=loss)
        means = losses.compute()  # the same on every rank: {"loss": ..., "samples": ...}
        losses.reset()
    """

    def __init__(self, context: DistributedContext, *names: str) -> None:
        self.context = context
        self.names = names
        self.reset()

    def reset(self) -> None:
        """Forgets every value added: the next means start from nothing (an epoch's start)."""
        self._host_sums = [0.0] * len(self.names)  # the finite values in host memory
        self._host_infinite = [0.0] * 2 * len(self.names)  # how many +inf, then -inf (NaN: one of each)
        self._device_sums: torch.Tensor | None = None  # the values on an accelerator, once there is one
        self._device_infinite: torch.Tensor | None = None
        self._pending: list[tuple[int, list[torch.Tensor | float]]] = []  # (weight, a value per name)
        self._samples = 0.0

    def add(self, samples: int, **sums: torch.Tensor | float) -> None:
        """Adds per-batch sums (for a mean loss: the loss summed over the batch's real samples).

        Args:
            samples: the batch's real samples (the count the means divide by).
            sums: a value per name: a number or a 0-dim tensor.
        """
        self._keep(1, samples, sums)

    def add_mean(self, samples: int, **means: torch.Tensor | float) -> None:
        """Adds per-batch means over ``samples`` samples (a loss with reduction="mean"), each
        weighted by its sample count. In a training loop this is the cheaper call: it keeps the
        mean the gradient came from, with no operation of its own per step. A batch of no
        samples adds nothing: its mean is not defined (and would be NaN).

        Args:
            samples: the batch's real samples, the weight of its means.
            means: a value per name: a number or a 0-dim tensor.
        """
        if samples:
            self._keep(samples, samples, means)

    def _keep(self, weight: int, samples: int, values: dict[str, torch.Tensor | float]) -> None:
        # Called every step, so it reads nothing. A tensor is kept as its ``.data``: the same
        # storage without the autograd graph, cheaper than ``detach()``; kept values are never written.
        kept: list[torch.Tensor | float] = []
        for name in self.names:
            value = values[name]
            kept.append(value.data if isinstance(value, torch.Tensor) else value)
        self._pending.append((weight, kept))
        self._samples += samples
        if len(self._pending) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Moves the kept values, times their weights, into the float64 sums: those in host
        memory on the host, those on an accelerator on the context's device (the class docstring)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for index in range(len(self.names)):
            on_host: list[tuple[int, float]] = []
            on_cpu: list[tuple[int, torch.Tensor]] = []
            on_device: list[tuple[int, torch.Tensor]] = []
            for weight, values in pending:
                value = values[index]
                if not isinstance(value, torch.Tensor):
                    on_host.append((weight, value))
                else:
                    (on_cpu if value.is_cpu else on_device).append((weight, value))
            if on_cpu:  # read in one conversion
                read = _float64_column([value for _, value in on_cpu], _CPU).tolist()
                on_host += zip([weight for weight, _ in on_cpu], read)
            if on_host:  # Python floats: float64
                products = torch.tensor([weight * value for weight, value in on_host], dtype=torch.float64)
                total, positive, negative = (part.item() for part in _split(products))
                self._host_sums[index] += total
                self._host_infinite[index] += positive
                self._host_infinite[len(self.names) + index] += negative
            if on_device:
                self._add_on_device(index, on_device)

    def _add_on_device(self, index: int, kept: list[tuple[int, torch.Tensor]]) -> None:
        device, width = self.context.device, len(self.names)
        if self._device_sums is None:
            self._device_sums = torch.zeros(width, dtype=torch.float64, device=device)
            self._device_infinite = torch.zeros(2 * width, dtype=torch.float64, device=device)
        weights = _to_device(torch.tensor([weight for weight, _ in kept], dtype=torch.float64), device)
        total, positive, negative = _split(_float64_column([value for _, value in kept], device) * weights)
        self._device_sums[index] += total
        self._device_infinite[index] += positive
        self._device_infinite[width + index] += negative

    def compute(self) -> dict[str, float]:
        """Global means (identical on every rank) and the global sample count; a collective.

        Returns:
            A mean per name (NaN when no sample was added) and ``samples``, the global count.
        """
        return self.compute_async().result()

    def snapshot(self) -> torch.Tensor:
        """This rank's totals so far, kept aside: no collective. The finite sums, the counts of
        +inf and of -inf values (a row each, a value per name), then the sample count.

        Hand it to a later :meth:`compute_async`, which reduces it in the same collective as
        the totals then: the global mean up to a point between two logging points (the end of
        an epoch) at no round trip of its own.

        Returns:
            A float64 tensor on the context's device.
        """
        self._fold()
        host = [*self._host_sums, *self._host_infinite, self._samples]
        totals = _to_device(torch.tensor(host, dtype=torch.float64), self.context.device)
        if self._device_sums is not None:
            width = len(self.names)
            totals[:width] += self._device_sums
            totals[width:-1] += self._device_infinite
        return totals  # a tensor of its own: later additions do not reach it

    def compute_async(self, *snapshots: torch.Tensor, shared: SharedReduction | None = None) -> PendingMeans:
        """:meth:`compute`, started: the all-reduce runs while the caller goes on (a training step),
        and ``.result()`` waits for it. Values added after this call are not in its result.
        ``snapshots`` (from :meth:`snapshot` of this object) are reduced in the same collective:
        ``.snapshot_results()`` has their global means. With ``shared``, the totals are added to
        that reduction, which the caller starts, instead of an all-reduce of their own.

        Started at one step boundary and read at the next, the round trip overlaps the step's
        compute. It is a collective: every rank starts it at the same point, with as many
        snapshots, in the same order as its other collectives.

        Args:
            snapshots: earlier :meth:`snapshot` results of this object, reduced alongside.
            shared: a :class:`~phalanx.SharedReduction` to add the totals to (the caller starts it).

        Returns:
            A :class:`~phalanx.runtime.metrics.PendingMeans`: ``.result()``, ``.snapshot_results()``.

        Example::

            pending = losses.compute_async()
            ...  # the next step's forward and backward
            print(pending.result()["loss"])
        """
        now = self.snapshot()
        for snapshot in snapshots:
            if snapshot.shape != now.shape:
                raise ValueError(f"a snapshot of {(snapshot.numel() - 1) // _ROWS} value(s) handed to a GlobalMean of "
                                 f"{len(self.names)} ({', '.join(self.names)}): take it with this one's snapshot()")  # fmt: skip
        reduction = shared if shared is not None else SharedReduction(self.context)
        totals = reduction.add(torch.cat([*snapshots, now]) if snapshots else now)
        if shared is None:
            reduction.start()
        return PendingMeans(self.names, totals)


class PendingMeans:
    """The result of :meth:`GlobalMean.compute_async`, once its all-reduce is done."""

    def __init__(self, names: tuple[str, ...], totals: ReducedPart) -> None:
        self.names, self._totals = names, totals
        self._values: list[list[float]] | None = None
        self._results: list[dict[str, float]] | None = None

    def result(self) -> dict[str, float]:
        """Global means and the global sample count; waits for the all-reduce (a device sync on CUDA)."""
        return self._read()[-1]

    def snapshot_results(self) -> list[dict[str, float]]:
        """The same for each snapshot handed to ``compute_async``, in order."""
        return self._read()[:-1]

    def running_sums(self, name: str) -> list[RunningSums]:
        """One name's reduced sums, for each snapshot and then the totals now: the means of spans
        between two of them come from these (:meth:`RunningSums.mean_since`)."""
        return [self._sums(row, self.names.index(name)) for row in self._rows()]

    def _read(self) -> list[dict[str, float]]:
        if self._results is None:
            means = [{name: self._sums(row, index).mean_since(RunningSums()) for index, name in enumerate(self.names)}
                     for row in self._rows()]  # fmt: skip
            self._results = [{**row_means, "samples": row[-1]} for row_means, row in zip(means, self._rows())]
        return self._results

    def _rows(self) -> list[list[float]]:
        """The reduced totals, a row per snapshot and one for now (:meth:`GlobalMean.snapshot`'s layout)."""
        if self._values is None:
            values, width = self._totals.wait().tolist(), _ROWS * len(self.names) + 1
            self._values = [values[start : start + width] for start in range(0, len(values), width)]
        return self._values

    def _sums(self, row: list[float], index: int) -> RunningSums:
        width = len(self.names)
        return RunningSums(row[index], row[-1], row[width + index], row[2 * width + index])


class RunningSums(NamedTuple):
    """One name's reduced sums up to a point: the finite values' sum, the samples, and how many
    +inf and -inf values were added (a NaN counts as one of each, as it behaves in a sum)."""

    total: float = 0.0
    samples: float = 0.0
    positive_infinite: float = 0.0
    negative_infinite: float = 0.0

    def mean_since(self, earlier: RunningSums) -> float:
        """The mean of the values added after ``earlier``: what a tensor sum of them would give,
        NaN or an infinity where one was added; NaN over no sample."""
        samples = self.samples - earlier.samples
        positive = self.positive_infinite > earlier.positive_infinite
        negative = self.negative_infinite > earlier.negative_infinite
        if not samples or (positive and negative):
            return math.nan
        if positive or negative:
            return math.inf if positive else -math.inf
        return (self.total - earlier.total) / samples

    def plus(self, other: RunningSums) -> RunningSums:
        """These sums and ``other``'s together (a resumed run's, after the ones it resumed from)."""
        return RunningSums(*(mine + theirs for mine, theirs in zip(self, other)))


def _split(products: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The finite values' sum, and how many are +inf and -inf: a NaN counts as one of each, as it
    behaves in a sum (:class:`RunningSums`)."""
    nan = products.isnan()
    return (
        products.where(products.isfinite(), 0.0).sum(),
        (nan | (products == math.inf)).sum(),
        (nan | (products == -math.inf)).sum(),
    )


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on ``device``. non_blocking: from pageable memory CUDA stages the copy
    at once and does not wait for the work queued on the device, as a blocking copy would."""
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _float64_column(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Tensors of one element each as one float64 vector on ``device``. Each converts exactly:
    a float32 or an integer never passes through a narrower type on the way."""
    first = values[0]
    if all(v.dtype == first.dtype and v.shape == first.shape for v in values):
        # the usual case, one loss tensor per step: one stack, one conversion
        return torch.stack(values).reshape(len(values)).to(device=device, dtype=torch.float64)
    return torch.stack([v.reshape(()).to(device=device, dtype=torch.float64) for v in values])
