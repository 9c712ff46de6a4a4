"""Rates, ETA and the progress display: a bar redrawn on a terminal, sparse plain lines in a log."""

from __future__ import annotations

import io

import pytest

from phalanx.runtime.progress import ProgressReporter, StepMeter, StepReport, format_duration


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def report(step: int, total: int = 100, **changes: object) -> StepReport:
    fields = dict(step=step, total_steps=total, epoch=1, epochs=2, loss=0.5, samples=64, samples_per_second=640.0,
                  step_time_s=0.05, eta_s=90.0)  # fmt: skip
    return StepReport(**{**fields, **changes})


def test_rates_and_eta_follow_the_clock():
    clock = FakeClock()
    meter = StepMeter(total_steps=100, start_step=20, clock=clock)  # resumed at step 20
    clock.now += 2.0
    first = meter.measure(step=30, samples=320)
    assert first.samples_per_second == pytest.approx(160.0)
    assert first.step_time_s == pytest.approx(0.2)
    assert first.eta_s == pytest.approx(70 * 0.2)  # 70 steps left at 0.2 s each
    clock.now += 1.0  # a faster interval: the rate follows it, the ETA uses the mean since the start
    second = meter.measure(step=40, samples=320)
    assert second.samples_per_second == pytest.approx(320.0)
    assert second.step_time_s == pytest.approx(0.1)
    assert second.eta_s == pytest.approx(60 * 3.0 / 20)
    clock.now += 1.0
    assert meter.measure(step=100, samples=1920).eta_s == 0.0


def test_rates_before_any_time_passed_are_unknown_not_a_crash():
    meter = StepMeter(total_steps=10, clock=FakeClock())
    rates = meter.measure(step=0, samples=0)
    assert all(value != value for value in (rates.samples_per_second, rates.step_time_s, rates.eta_s))  # NaN
    assert format_duration(rates.eta_s) == "?"


@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (59.6, "1:00"), (125, "2:05"), (3723, "1:02:03")])
def test_durations_read_as_clock_times(seconds, text):
    assert format_duration(seconds) == text


def test_a_log_file_gets_plain_lines_every_k_steps_and_the_last():
    stream, clock = io.StringIO(), FakeClock()
    progress = ProgressReporter(100, stream, every_steps=25, every_seconds=1e9, clock=clock)
    assert not progress.interactive
    for step in range(10, 101, 10):
        progress.update(report(step))
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["10/100", "40/100", "70/100", "100/100"]
    assert "\r" not in stream.getvalue() and "[" not in stream.getvalue()
    assert lines[0] == "step 10/100 (10%)  epoch 1/2  loss 0.5000  640 samples/s  50.0 ms/step  ETA 1:30"


def test_a_log_file_gets_a_line_every_t_seconds_between_the_steps():
    stream, clock = io.StringIO(), FakeClock()
    progress = ProgressReporter(1000, stream, every_steps=500, every_seconds=30, clock=clock)
    for step in range(1, 10):
        clock.now += 10
        progress.update(report(step, total=1000))
    assert [line.split()[1] for line in stream.getvalue().splitlines()] == ["1/1000", "4/1000", "7/1000"]


# The bar is cut to the terminal's width, which shutil.get_terminal_size reads from COLUMNS first:
# each test sets it, rather than take the width of whatever terminal pytest runs in.


def test_a_terminal_gets_one_line_redrawn_in_place_with_a_bar(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    stream = Terminal()
    progress = ProgressReporter(100, stream, every_steps=1000)  # the step gate is for logs only
    assert progress.interactive
    progress.update(report(10, grad_norm=1.25))
    progress.update(report(50))
    shown = render(stream.getvalue())  # the shorter line blanked out the longer one's tail
    assert len(shown) == 1 and shown[0].endswith("50.0 ms/step  ETA 1:30") and "grad norm" not in shown[0]
    progress.write("epoch 1/2  step 50  loss 0.5000")
    progress.update(report(100, eta_s=0.0))
    out = stream.getvalue()
    assert out.count("\n") == 2  # the epoch line and the end of the finished bar, nothing else
    assert "[##..................] step 10/100 (10%)" in out and "grad norm 1.25" in out
    screen = render(out)
    assert len(screen) == 2
    assert screen[0] == "epoch 1/2  step 50  loss 0.5000"
    assert screen[1].startswith("[####################] step 100/100 (100%)") and screen[1].endswith("ETA 0:00")


def test_a_narrow_terminal_gets_the_line_cut_short_of_its_last_column(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    stream = Terminal()
    ProgressReporter(100, stream).update(report(50))
    [shown] = render(stream.getvalue())
    assert shown == "[##########..........] step 50/100 (50%"  # 39 characters: no wrap onto a second line


def test_rank_0_only():
    stream = Terminal()
    progress = ProgressReporter(10, stream, enabled=False)
    progress.update(report(5, total=10))
    progress.write("epoch 1/1")
    progress.close()
    assert stream.getvalue() == ""


def render(output: str) -> list[str]:
    """What a terminal shows: a carriage return goes back to the start of the line, text overwrites."""
    screen, line, column = [], [], 0
    for char in output:
        if char == "\n":
            screen.append("".join(line).rstrip())
            line, column = [], 0
        elif char == "\r":
            column = 0
        else:
            line[column : column + 1] = [char]
            column += 1
    if line:
        screen.append("".join(line).rstrip())
    return screen
