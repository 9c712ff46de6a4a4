"""Throughput, step time, ETA, and a progress display that reads well in a terminal and in a log.

:class:`StepMeter` turns the logging points of a run (step, global samples since the last one)
into rates; it needs no collective of its own: the global sample count comes with the global
loss (:class:`~phalanx.runtime.metrics.GlobalMean` returns it), and the ranks step in lockstep,
so rank 0's clock times the whole job. :class:`ProgressReporter` shows the result on rank 0: a
single redrawn line on a terminal, plain lines every K steps or T seconds in a file or a pipe.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

Clock = Callable[[], float]


@dataclass(frozen=True)
class StepReport:
    """One logging point: where the run is, the global loss and the rates since the previous one.

    Attributes:
        step, total_steps: the optimizer step reached, of the run's.
        epoch, epochs: the epoch (from 1), of the run's.
        loss: the global mean loss over the samples since the previous report.
        samples: the real samples of every rank since the previous report.
        samples_per_second, step_time_s: the global throughput and the mean step time since then.
        eta_s: the time left, estimated.
        grad_norm: the gradients' norm before clipping, when the loop clips.

    Example::

        report = phalanx.StepReport(step=10, total_steps=100, epoch=1, epochs=5, loss=0.42, samples=640,
                                    samples_per_second=3200.0, step_time_s=0.02, eta_s=1.8)
        progress.update(report)
        metrics.write(report.record())
    """

    step: int
    total_steps: int
    epoch: int
    epochs: int
    loss: float
    samples: int
    samples_per_second: float
    step_time_s: float
    eta_s: float
    grad_norm: float | None = None

    def record(self) -> dict[str, Any]:
        """The fields a metrics file keeps per logged step (the totals are the run's, not the step's).

        Returns:
            A dict of the report's fields without the totals (and without ``grad_norm`` when None).
        """
        kept = {name: value for name, value in vars(self).items() if name not in ("total_steps", "epochs")}
        if kept["grad_norm"] is None:
            del kept["grad_norm"]
        return kept


@dataclass(frozen=True)
class Rates:
    """What :meth:`StepMeter.measure` returns: throughput, step time and ETA."""

    samples_per_second: float
    step_time_s: float
    eta_s: float


class StepMeter:
    """Rates between logging points, and the ETA from the mean step time since the meter started.

    The ETA uses the whole span (first steps included, whose warm-up then fades out), not the
    last interval: one slow interval on a shared machine should not make the estimate jump.

    Args:
        total_steps: the run's steps, for the ETA.
        start_step: the step it starts at (a resumed run's).
        clock: a monotonic clock in seconds (a test passes its own).

    Example::

        meter = phalanx.StepMeter(total_steps=1000, start_step=run.global_step)
        ...
        rates = meter.measure(step, samples=means["samples"])
        print(f"{rates.samples_per_second:.0f} samples/s, ETA {rates.eta_s:.0f} s")
    """

    def __init__(self, total_steps: int, start_step: int = 0, clock: Clock = time.perf_counter) -> None:
        self.total_steps = total_steps
        self.clock = clock
        self._first_step = self._last_step = start_step
        self._started = self._last_time = clock()

    def measure(self, step: int, samples: float, at: float | None = None) -> Rates:
        """The rates since the previous call.

        Args:
            step: the step reached.
            samples: global samples trained since the previous call (or the start).
            at: the clock's reading when ``step`` ended; default now.

        Returns:
            The :class:`~phalanx.runtime.progress.Rates` since the previous call (NaN where
            nothing has passed).
        """
        now = self.clock() if at is None else at
        interval, steps = now - self._last_time, step - self._last_step
        self._last_time, self._last_step = now, step
        done = step - self._first_step
        mean_step = (now - self._started) / done if done > 0 else float("nan")
        return Rates(
            samples_per_second=samples / interval if interval > 0 else float("nan"),
            step_time_s=interval / steps if steps > 0 else float("nan"),
            eta_s=max(self.total_steps - step, 0) * mean_step if done > 0 else float("nan"),
        )


def format_duration(seconds: float) -> str:
    """1:02:03 for an hour and more, 2:03 below; ? when not known yet."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_report(report: StepReport) -> str:
    """The report as one line: step, epoch, loss, throughput, step time, (grad norm,) ETA."""
    percent = 100 * report.step / report.total_steps if report.total_steps else 100.0
    parts = [
        f"step {report.step}/{report.total_steps} ({percent:.0f}%)",
        f"epoch {report.epoch}/{report.epochs}",
        f"loss {report.loss:.4f}",
        f"{report.samples_per_second:.0f} samples/s",
        f"{report.step_time_s * 1e3:.1f} ms/step",
    ]
    if report.grad_norm is not None:
        parts.append(f"grad norm {report.grad_norm:.3g}")
    parts.append(f"ETA {format_duration(report.eta_s)}")
    return "  ".join(parts)


def progress_bar(fraction: float, width: int) -> str:
    """A bar of ``width`` characters between brackets, filled to ``fraction``."""
    filled = min(width, max(0, int(fraction * width)))
    return "[" + "#" * filled + "." * (width - filled) + "]"


class ProgressReporter:
    """Shows step reports on ``stream`` (rank 0 only; the others pass ``enabled=False``).

    On a terminal (``stream.isatty()``, or ``interactive=True``) one line is redrawn in place
    with a bar. Otherwise a plain line is printed for the first report, then whenever
    ``every_steps`` steps (default: a twentieth of the run) or ``every_seconds`` have passed
    since the last printed one, and for the last step. No colour codes either way.

    Args:
        total_steps: the run's steps (the bar's end; the last step is always shown).
        stream: where it writes; default stdout.
        enabled: False on every rank but 0: it shows nothing.
        interactive: redraw one line; default whether ``stream`` is a terminal.
        every_steps: plain lines this many steps apart; default a twentieth of the run.
        every_seconds: or this many seconds apart, whichever comes first.
        clock: a monotonic clock in seconds (a test passes its own).

    Example::

        progress = phalanx.ProgressReporter(total_steps=1000, enabled=context.is_main)
        progress.update(report)  # a StepReport
        progress.write("epoch 1: loss 0.42")
        progress.close()
    """

    BAR_WIDTH = 20

    def __init__(
        self, total_steps: int, stream: TextIO | None = None, *, enabled: bool = True, interactive: bool | None = None,
        every_steps: int | None = None, every_seconds: float = 60.0, clock: Clock = time.monotonic,
    ) -> None:  # fmt: skip
        self.stream = stream if stream is not None else sys.stdout
        self.enabled = enabled
        self.interactive = interactive if interactive is not None else _isatty(self.stream)
        self.total_steps = total_steps
        self.every_steps = every_steps if every_steps is not None else max(1, math.ceil(total_steps / 20))
        self.every_seconds = every_seconds
        self._clock = clock
        self._printed_step: int | None = None
        self._printed_at = 0.0
        self._bar = ""  # the line on screen now (interactive), to clear and redraw

    def update(self, report: StepReport) -> None:
        """Shows ``report``: redraws the bar, or prints a plain line when one is due.

        Args:
            report: the logging point's :class:`~phalanx.StepReport`.
        """
        if not self.enabled:
            return
        if self.interactive:
            bar = f"{progress_bar(report.step / max(report.total_steps, 1), self.BAR_WIDTH)} {format_report(report)}"
            self._draw(bar[: _columns() - 1])
            if report.step >= report.total_steps:
                self._finish_bar()
        elif self._due(report.step):
            self._printed_step, self._printed_at = report.step, self._clock()
            self.stream.write(format_report(report) + "\n")
            self.stream.flush()

    def write(self, line: str) -> None:
        """Prints a line of its own (an epoch summary, a notice) without breaking the bar.

        Args:
            line: the text, without a newline.
        """
        if not self.enabled:
            return
        bar = self._bar
        if bar:
            self._draw("")
            self.stream.write("\r")
        self.stream.write(line + "\n")
        if bar:
            self._draw(bar)
        self.stream.flush()

    def close(self) -> None:
        """Ends the bar's line, so that what is printed next starts a line of its own."""
        if self.enabled and self._bar:
            self._finish_bar()

    def _due(self, step: int) -> bool:
        if self._printed_step is None or step >= self.total_steps:
            return True
        return step - self._printed_step >= self.every_steps or self._clock() - self._printed_at >= self.every_seconds

    def _draw(self, text: str) -> None:
        padding = " " * max(0, len(self._bar) - len(text))  # blanks out the rest of a longer line
        self.stream.write("\r" + text + padding)
        self.stream.flush()
        self._bar = text

    def _finish_bar(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
        self._bar = ""


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _columns() -> int:
    return shutil.get_terminal_size(fallback=(120, 24)).columns
