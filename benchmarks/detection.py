"""A host cut off for good (no socket closes, nothing raises): the seconds until the other nodes
name it, at a given --heartbeat-timeout; and whether that bound holds without false alarms while
every core is saturated by other processes.

Setup: --hosts test-bed hosts (network namespaces on a bridge; root), one worker per host
(benchmarks/detection_worker.py: a matrix product and a 1 MiB gloo all-reduce per step), started
by `phalanx run --heartbeat-timeout B` on each.

Each trial starts the job and waits for its first steps. In the first trial only, one busy
process per core (outside the test bed) then runs for --saturate-minutes while the job trains: a
false alarm is a node that counts another lost, or a launcher that ends, meanwhile. Then the last
host's link is cut (its bridge port down: its packets vanish, no socket closes), and from the cut:
  named     the first line of a surviving node that names the cut host ("sent no sign of life")
  stopped   the last surviving launcher's exit (its workers stopped, the verdict posted)
  cut side  the cut host's launcher's exit (it lost the store's host)
Between trials the link comes back and every process of the hosts is killed.

Targets (issue 36): the cut host is named within 5 s in every trial (at --heartbeat-timeout 3);
no false alarm in the saturated run (30 minutes in the full run).

Usage: sudo python benchmarks/detection.py [--trials 10] [--hosts 3] [--heartbeat-timeout 3]
       [--saturate-minutes 30] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from targets import Target, write_report  # benchmarks/: a script's folder is on its path

from phalanx.testbed import test_bed

HERE = Path(__file__).resolve().parent
WORKER = HERE / "detection_worker.py"
FIRST_PORT = 29400
TARGET_NAMED_S, TARGET_FALSE_ALARMS = 5.0, 0
#: What a launcher prints when it counts a node lost: the watcher's verdict, or the store's host.
ALARMS = ("sent no sign of life", "did not answer for")
#: Seconds a job may take to train its first steps, and the launchers to end after a cut.
START_BOUND_S, END_BOUND_S = 180.0, 120.0


class Job:
    """`phalanx run` on every host, each launcher's output read as it comes, with the time each
    line arrived (this process's monotonic clock, as the cut's)."""

    def __init__(self, bed, args: argparse.Namespace, port: int, folder: Path) -> None:
        self.bed = bed
        self.lines: dict[str, list[tuple[float, str]]] = {host.name: [] for host in bed.hosts}
        self.ended: dict[str, float] = {}
        endpoint = f"{bed.hosts[0].address}:{port}"
        self.processes = {
            host.name: subprocess.Popen(
                host.command([sys.executable, "-m", "phalanx", "run", "--nnodes", str(len(bed.hosts)),
                              "--rdzv-endpoint", endpoint, "--heartbeat-timeout", f"{args.heartbeat_timeout:g}",
                              "--log-dir", str(folder / f"logs-{host.name}"), str(WORKER)]),
                cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                start_new_session=True,
            )
            for host in bed.hosts
        }  # fmt: skip
        self.readers = [threading.Thread(target=self._read, args=(name,), daemon=True) for name in self.processes]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str) -> None:
        process = self.processes[name]
        assert process.stdout is not None
        for line in process.stdout:
            self.lines[name].append((time.monotonic(), line.rstrip("\n")))
        process.wait()
        self.ended[name] = time.monotonic()

    def first(self, names: list[str], words: tuple[str, ...], after: float = 0.0) -> tuple[float, str] | None:
        """The first line of those hosts that holds one of ``words``, and when it came."""
        found = [(at, line) for name in names for at, line in self.lines[name] if at >= after and
                 any(word in line for word in words)]  # fmt: skip
        return min(found) if found else None

    def wait_for(self, found: Callable[[], object], bound_s: float) -> object:
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            result = found()
            if result:
                return result
            time.sleep(0.05)
        return None

    def output(self) -> str:
        return "\n".join(f"== {name}\n" + "\n".join(line for _, line in lines[-40:])
                         for name, lines in self.lines.items())  # fmt: skip

    def stop(self) -> None:
        for host in self.bed.hosts:  # every process on the hosts, whatever process group it made
            for pid in self.bed.processes(host.name):
                _kill(pid)
        for reader in self.readers:
            reader.join(timeout=10)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g}-minute" if seconds >= 60 else f"{seconds:g}-second"


def saturated(job: Job, seconds: float) -> dict:
    """One busy process per core for ``seconds`` while the job trains: the first alarm or
    launcher exit meanwhile, and the steps rank 0 reported."""
    first = job.bed.hosts[0].name
    steps_before = sum("step " in line for _, line in job.lines[first])
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    started, alarm = time.monotonic(), None
    try:
        while time.monotonic() - started < seconds and alarm is None:
            said = job.first(list(job.lines), ALARMS, after=started)
            gone = [name for name in job.processes if name in job.ended]
            alarm = said[1] if said else (f"the launcher on {gone[0]} ended" if gone else None)
            time.sleep(0.5)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return {"seconds": round(time.monotonic() - started, 1), "busy_processes": len(spinners), "false_alarm": alarm,
            "steps_reported": 20 * (sum("step " in line for _, line in job.lines[first]) - steps_before)}  # fmt: skip


def trial(bed, args: argparse.Namespace, port: int, folder: Path, saturate_s: float) -> dict:
    folder.mkdir(parents=True)
    job = Job(bed, args, port, folder)
    cut = bed.hosts[-1].name
    survivors = [host.name for host in bed.hosts[:-1]]
    result: dict = {}
    try:
        if not job.wait_for(lambda: job.first([bed.hosts[0].name], ("step ",)), START_BOUND_S):
            raise SystemExit(f"the job trained no step within {START_BOUND_S:g} s:\n{job.output()}")
        if saturate_s:
            result["saturated"] = saturated(job, saturate_s)
            if result["saturated"]["false_alarm"]:
                return result
        cut_at = time.monotonic()
        bed.cut_link(cut)
        named = job.wait_for(lambda: job.first(survivors, ALARMS[:1], after=cut_at), END_BOUND_S)
        job.wait_for(lambda: all(name in job.ended for name in job.processes), END_BOUND_S)
        if not named:
            raise SystemExit(f"no survivor named {cut} within {END_BOUND_S:g} s:\n{job.output()}")
        assert isinstance(named, tuple)
        result.update(
            named_s=round(named[0] - cut_at, 2),
            line=named[1],
            stopped_s=round(max(job.ended[name] for name in survivors) - cut_at, 2)
            if all(name in job.ended for name in survivors)
            else None,
            cut_side_s=round(job.ended[cut] - cut_at, 2) if cut in job.ended else None,
        )
        return result
    finally:
        bed.restore_link(cut)
        job.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="SECONDS")
    parser.add_argument("--saturate-minutes", type=float, default=30.0, help="in the first trial; 0: none")
    parser.add_argument("--smoke", action="store_true", help="two hosts, one trial, 10 s saturated: proves it runs")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.trials, args.hosts, args.saturate_minutes = 1, 2, 10 / 60
    if os.geteuid() != 0:
        raise SystemExit("detection.py builds test-bed hosts (network namespaces): run it as root")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the bed comes down on a kill too
    trials: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="phalanx-detection-") as scratch,
        test_bed(f"d{os.getpid() % 100000}", [f"h{n + 1}" for n in range(args.hosts)]) as bed,
    ):
        for index in range(args.trials):
            saturate_s = args.saturate_minutes * 60 if index == 0 else 0.0
            row = trial(bed, args, FIRST_PORT + index, Path(scratch) / f"t{index}", saturate_s)
            trials.append(row)
            load = row.get("saturated")
            if load:
                print(f"saturated {load['seconds']:.0f} s ({load['busy_processes']} busy processes): "
                      f"{load['steps_reported']} steps, false alarm: {load['false_alarm'] or 'none'}", flush=True)  # fmt: skip
            if "named_s" in row:
                print(f"trial {index + 1}/{args.trials}: named {row['named_s']:.1f} s after the cut, survivors "
                      f"stopped after {row['stopped_s']} s, the cut side after {row['cut_side_s']} s: {row['line']}",
                      flush=True)  # fmt: skip
    named = [row["named_s"] for row in trials if "named_s" in row]
    load = trials[0].get("saturated", {})
    false_alarms = int(bool(load.get("false_alarm")))
    results = {
        "setup": {"hosts": args.hosts, "heartbeat_timeout_s": args.heartbeat_timeout,
                  "saturate_minutes": args.saturate_minutes, "trials": args.trials},
        "trials": trials,
        "named_s": {"median": statistics.median(named), "max": max(named), "min": min(named)} if named else None,
    }  # fmt: skip
    if named:
        print(f"named after the cut: median {statistics.median(named):.1f} s, {min(named):.1f} to {max(named):.1f} s "
              f"over {len(named)} trials (--heartbeat-timeout {args.heartbeat_timeout:g})")  # fmt: skip
    targets = [
        Target(f"seconds from a host's cut to its naming, --heartbeat-timeout {args.heartbeat_timeout:g} (largest of "
               f"{len(named)} trial{'s' if len(named) != 1 else ''})", max(named) if named else None, TARGET_NAMED_S,
               at_least=False, unit="s"),
        Target(f"false alarms in a {_duration(args.saturate_minutes * 60)} run with every core busy elsewhere",
               false_alarms if load else None, TARGET_FALSE_ALARMS, at_least=False, unit="runs"),
    ]  # fmt: skip
    if args.json:
        write_report(args.json, results, targets, smoke=args.smoke)


if __name__ == "__main__":
    main()
