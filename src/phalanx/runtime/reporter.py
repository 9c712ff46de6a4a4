"""A run's logging points and epoch lines: global losses that cost one shared all-reduce.

:class:`Reporter` is what :class:`phalanx.Run` shows and logs; it is not part of the public API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from phalanx.runtime.context import DistributedContext
from phalanx.runtime.metrics import GlobalMean, PendingMeans, RunningSums
from phalanx.runtime.metrics_log import MetricsLog
from phalanx.runtime.progress import ProgressReporter, StepMeter, StepReport
from phalanx.runtime.shared_reduction import SharedReduction


class EpochEnd(NamedTuple):
    """An epoch that ended since the last logging point: its global loss comes with the next one."""

    epoch: int
    step: int
    totals: torch.Tensor  # this rank's running totals when it ended (GlobalMean.snapshot)


class LoggingPoint(NamedTuple):
    """A logging point whose all-reduce is in flight."""

    totals: PendingMeans
    epoch_ends: tuple[EpochEnd, ...]  # reduced in the same collective, shown first
    step: int | None = None  # None: it only reduces epoch ends (before a checkpoint or a stop)
    epoch: int = 0
    ended_at: float = 0.0  # the meter's clock when the step ended
    values: dict[str, torch.Tensor | float] | None = None  # the loop's own (Run.log), grad_norm among them


class Reporter:
    """The logging points: every ``log_every`` steps and at the last, the global loss of the steps
    since the previous one, rates, the progress display and the metrics files; and the global
    loss of each epoch. One running sum for the whole run, reduced in the step boundary's shared
    all-reduce and shown at the next boundary (docs/runtime-design.md).
    """

    def __init__(
        self, context: DistributedContext, *, epochs: int, total_steps: int, step: int, boundary: SharedReduction,
        metrics_jsonl: str | Path | None = None, tensorboard: str | Path | None = None,
    ) -> None:  # fmt: skip
        self.context, self.epochs, self.total_steps, self.boundary = context, epochs, total_steps, boundary
        self.totals = GlobalMean(context, "loss")
        self._logged = self._epoch_logged = RunningSums()  # the running sums at the last point, at the last epoch end
        self._logged_step: int | None = None
        self._carried = RunningSums()  # the running sums of the run resumed from, when it stopped
        self._measured = 0.0  # the running sample count at the meter's last reading
        self._pending: LoggingPoint | None = None
        self._epoch_ends: list[EpochEnd] = []
        self.meter = StepMeter(total_steps, start_step=step)
        self._files = {"jsonl": metrics_jsonl, "tensorboard": tensorboard}
        self._outputs(step)

    def _outputs(self, step: int) -> None:
        """The progress lines and the metrics files, on rank 0 only (from ``step`` on)."""
        self._main = self.context.is_main
        self.progress = ProgressReporter(self.total_steps, enabled=self._main)
        self.files = MetricsLog(**self._files, continue_from_step=step, enabled=self._main)

    def end_epoch(self, epoch: int, step: int) -> None:
        """No collective: the epoch's loss is shown with the next logging point."""
        self._epoch_ends.append(EpochEnd(epoch, step, self.totals.snapshot()))

    def start(self, step: int, epoch: int, values: dict[str, torch.Tensor | float] | None = None) -> None:
        """Adds the sums to the boundary's all-reduce (every rank reaches the same logging points)."""
        self.finish()
        ended_at = self.meter.clock()
        point = self._reduce(self.boundary)
        self._pending = point._replace(step=step, epoch=epoch, ended_at=ended_at, values=values)

    def _reduce(self, shared: SharedReduction | None = None) -> LoggingPoint:
        """The sums now and at the epoch ends since the last point, in ``shared`` or reduced at once."""
        ends, self._epoch_ends = tuple(self._epoch_ends), []
        return LoggingPoint(self.totals.compute_async(*(end.totals for end in ends), shared=shared), ends)

    def finish(self) -> None:
        """Shows the logging point in flight, if any: call it at every step boundary."""
        if self._pending is None:
            return
        point, self._pending = self._pending, None
        *ends, now = map(self._carried.plus, point.totals.running_sums("loss"))
        for end, running in zip(point.epoch_ends, ends):
            epoch_loss = running.mean_since(self._epoch_logged)
            self._epoch_logged = running
            self.progress.write(f"epoch {end.epoch + 1}/{self.epochs}  step {end.step}  loss {epoch_loss:.4f}")
        if point.step is None:
            return
        values = dict(point.values or {})
        grad_norm = values.pop("grad_norm", None)
        loss, samples = now.mean_since(self._logged), now.samples - self._logged.samples
        self._logged, self._logged_step = now, point.step
        # the rate counts only the samples this run trained, not those carried from a checkpoint
        rates = self.meter.measure(point.step, now.samples - self._measured, at=point.ended_at)
        self._measured = now.samples
        report = StepReport(
            step=point.step, total_steps=self.total_steps, epoch=point.epoch + 1, epochs=self.epochs, loss=loss,
            samples=int(samples), samples_per_second=rates.samples_per_second, step_time_s=rates.step_time_s,
            eta_s=rates.eta_s, grad_norm=None if grad_norm is None else float(grad_norm),
        )  # fmt: skip
        self.progress.update(report)
        self.files.write({**report.record(), "world_size": self.context.world_size, **_plain(values)})

    def settle(self, reduce_totals: bool = False) -> RunningSums | None:
        """Shows everything up to now, before a checkpoint or a stop: the logging point in flight,
        then the epochs ended since (a collective of their own, on every rank alike). With
        ``reduce_totals`` always a collective; the running sums now, when reduced."""
        self.finish()
        if not (self._epoch_ends or reduce_totals):
            return None
        point = self._pending = self._reduce()
        self.finish()
        return self._carried.plus(point.totals.running_sums("loss")[-1])

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """:meth:`settle`, then the global running sums a resumed run continues from: now, at the
        last logging point and at the last epoch end. One collective (the settling's, when epoch
        ends wait), none at a logging point, whose sums are known: the same on every rank, which
        step in lockstep."""
        self.finish()  # first: it moves _logged_step
        now = self.settle(reduce_totals=step != self._logged_step)
        return _state(self._logged if now is None else now, self._logged, self._epoch_logged, self._logged_step)

    def known_state(self) -> dict[str, Any]:
        """The sums of :meth:`checkpoint_state` as far as this rank knows them without a
        collective (for a survivor of a failure, whose peers may be gone): up to the last
        logging point. The steps since count in no later report's mean, nor in the next epoch
        line's where an epoch end was reduced after that point (a checkpoint settles it): its
        sums are newer than the point's, and that line covers the steps after the failure."""
        newer = self._epoch_logged.samples > self._logged.samples  # the running count only grows
        return _state(self._logged, self._logged, self._logged if newer else self._epoch_logged, self._logged_step)

    def regroup(self, total_steps: int, step: int) -> None:
        """Heal mode's world shrank in the process, after ``step``: the run's steps changed, and
        rank 0 may be another process (the lowest survivor), which prints and writes the files
        from here on."""
        self.total_steps = self.meter.total_steps = self.progress.total_steps = total_steps
        if self.context.is_main != self._main:
            self.files.close()
            self._outputs(step)

    def start_over(self, state: dict[str, Any], boundary: SharedReduction) -> None:
        """After a heal: a logging point in flight in the old group is dropped, and the sums go
        on from ``state`` (:meth:`known_state` of the rank the state came from, or this rank's
        own where it held the same step: rank 0, which reports, is the source or receives), as
        a replacement rank's do."""
        self._pending, self._epoch_ends, self.boundary = None, [], boundary
        self.totals = GlobalMean(self.context, "loss")
        self.load_checkpoint_state(state)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Continues the sums of :meth:`checkpoint_state`: the next report and epoch line cover the
        steps since the last ones before the checkpoint."""
        self._carried, self._logged, self._epoch_logged = (
            RunningSums(*state[key]) for key in ("running", "logged", "epoch_logged")
        )
        # Whether the next checkpoint's settling is a collective: alike on a replacement and the
        # ranks it joins, which may save at once (at the end of the training).
        self._logged_step = state["logged_step"]
        self._measured = self._carried.samples

    def close(self) -> None:
        """:meth:`settle` (a collective when epoch ends wait), then closes the display and files."""
        self.settle()
        self.progress.close()
        self.files.close()


def _state(running: RunningSums, logged: RunningSums, epoch_logged: RunningSums, logged_step: int | None) -> dict:
    """The sums a run goes on from, as plain tuples: a checkpoint and a heal's exchange store them."""
    sums = {"running": running, "logged": logged, "epoch_logged": epoch_logged}
    return {**{key: tuple(value) for key, value in sums.items()}, "logged_step": logged_step}


def _plain(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """The loop's values as numbers for the metrics files (a tensor is read here, at a logging point)."""
    return {name: float(value) for name, value in values.items()}
