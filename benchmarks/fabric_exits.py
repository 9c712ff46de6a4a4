"""Do scripts that never destroy their process group exit cleanly? A Lightning Fabric DDP script
(benchmarks/fabric_script.py), N times on two test-bed hosts, under `phalanx run` and, with
--torchrun, under plain torchrun.

Each run starts the same launcher line on both hosts (network namespaces on a bridge, one worker
per host, CPU and gloo) and gets a hard timeout, after which both process groups are SIGKILLed.
Per launcher it counts:
  ok       both hosts exited 0
  aborts   a host's output (or a rank log) says "terminate called", SIGABRT or signal 6
  hangs    a host had not exited at the timeout
  failed   any run that is not ok (aborts and hangs included)
  trained  runs in which both ranks printed FABRIC_DONE (training over, before any exit trouble)
and the exit codes seen. Processes still in a host once its launcher has ended are counted as
leftovers and killed, so that every run starts on empty hosts.

The launchers' lines: `phalanx run --nnodes 2 --nproc-per-node 1 --rdzv-endpoint H1:PORT`; plain
torchrun gets by hand what phalanx works out (the store's host, each host's address, gloo's
interface): `--rdzv-backend c10d --rdzv-conf is_host=0|1 --local-addr ADDR`,
GLOO_SOCKET_IFNAME=eth0. Each run uses its own port.

Needs root (network namespaces) and lightning (pip install -e '.[fabric]'). Nothing is left
behind: the bed, its namespaces and every process in them go at the end, on an error, on Ctrl-C
and on SIGTERM.

Target: no phalanx run fails (every run exits 0 on both hosts).

Usage: sudo .venv/bin/python benchmarks/fabric_exits.py [--runs 30] [--torchrun] [--timeout 120]
       [--steps 20] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # phalanx.testbed, also from a checkout that is not installed

from targets import Target, write_report  # noqa: E402  (benchmarks/: a script's folder is on its path)

from phalanx.testbed import run_together  # noqa: E402

SCRIPT = REPO / "benchmarks" / "fabric_script.py"
HOSTS = ["h1", "h2"]
FIRST_PORT = 29400
ABORT = re.compile(r"terminate called|SIGABRT|[Ss]ignal 6\b|core dumped")
DONE = re.compile(r"FABRIC_DONE rank (\d+)")


@dataclass
class HostResult:
    host: str
    returncode: int | None  # None: still running at the timeout (then killed)
    seconds: float
    aborted: bool
    done_ranks: list[int]
    leftovers: int  # processes still in the host after its launcher had ended
    evidence: list[str] = field(default_factory=list)  # the lines that show an abort
    tail: str = ""  # the end of the output, for runs that were not ok


@dataclass
class Run:
    launcher: str
    index: int
    hosts: list[HostResult]

    @property
    def ok(self) -> bool:
        return all(h.returncode == 0 and not h.aborted for h in self.hosts)

    @property
    def aborted(self) -> bool:
        return any(h.aborted for h in self.hosts)

    @property
    def hung(self) -> bool:
        return any(h.returncode is None for h in self.hosts)

    @property
    def trained(self) -> bool:
        return sorted({r for h in self.hosts for r in h.done_ranks}) == [0, 1]


def refuse_unless_possible() -> None:
    from phalanx.errors import PhalanxError
    from phalanx.testbed.bed import check_can_build

    try:
        check_can_build()
    except PhalanxError as error:
        raise SystemExit(f"fabric_exits: {error}\n(it builds two hosts as network namespaces: run it as root, "
                         f"e.g. sudo {sys.executable} {' '.join(sys.argv)})") from None  # fmt: skip
    try:
        import lightning  # noqa: F401
    except ImportError:
        raise SystemExit(f"fabric_exits: lightning is not installed for {sys.executable}\n"
                         "install it with: pip install -e '.[fabric]'") from None  # fmt: skip


def launcher_lines(launcher: str, bed, port: int, logs: Path, steps: int) -> list[list[str]]:
    main = bed.hosts[0]
    script = [str(SCRIPT), "--steps", str(steps)]
    lines = []
    for k, host in enumerate(bed.hosts):
        if launcher == "phalanx":
            argv = [sys.executable, "-m", "phalanx", "run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-endpoint", f"{main.address}:{port}", "--log-dir", str(logs / host.name), *script]  # fmt: skip
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{main.address}:{port}",
                    "--rdzv-conf", f"is_host={int(k == 0)}", "--local-addr", host.address, *script]  # fmt: skip
        lines.append(host.command(argv))
    return lines


def rank_logs(folder: Path) -> str:
    """Every per-rank log phalanx wrote under ``folder`` (an abort may show only there)."""
    if not folder.is_dir():
        return ""
    return "".join(path.read_text(errors="replace") for path in sorted(folder.rglob("*")) if path.is_file())


def empty_host(bed, name: str) -> int:
    """Kills whatever still runs in a host; returns how many processes that was."""
    pids = bed.processes(name)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while bed.processes(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids)


def one_run(launcher: str, index: int, bed, timeout: float, steps: int, work: Path) -> Run:
    folder = work / f"{launcher}-{index:03d}"
    folder.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if launcher == "torchrun":
        env["GLOO_SOCKET_IFNAME"] = bed.hosts[0].device
    port = FIRST_PORT + index % 500
    outcomes = run_together(launcher_lines(launcher, bed, port, folder / "logs", steps), timeout, cwd=folder, env=env)
    results = []
    for host, outcome in zip(bed.hosts, outcomes):
        text = outcome.output + rank_logs(folder / "logs" / host.name)
        evidence = [line.strip() for line in text.splitlines() if ABORT.search(line)]
        code = outcome.returncode
        aborted = bool(evidence) or code in (-signal.SIGABRT, 128 + signal.SIGABRT)
        results.append(HostResult(host.name, code, round(outcome.seconds, 1), aborted,
                                  sorted({int(r) for r in DONE.findall(text)}), 0, evidence[:10]))  # fmt: skip
        results[-1].tail = "" if code == 0 and not aborted else outcome.output[-4000:]
    for result in results:
        result.leftovers = empty_host(bed, result.host)
    return Run(launcher, index, results)


def describe(run: Run) -> str:
    codes = " ".join(f"{h.host}={'timeout' if h.returncode is None else h.returncode}" for h in run.hosts)
    verdict = "ok" if run.ok else "ABORT" if run.aborted else "HANG" if run.hung else "FAILED"
    seconds = max(h.seconds for h in run.hosts)
    extra = f"  leftovers {sum(h.leftovers for h in run.hosts)}" if any(h.leftovers for h in run.hosts) else ""
    return (
        f"{run.launcher:8s} run {run.index + 1:3d}: {verdict:6s} {codes}  trained={run.trained}  {seconds:.1f} s{extra}"
    )


def summary(runs: list[Run]) -> dict[str, dict]:
    table = {}
    for launcher in dict.fromkeys(r.launcher for r in runs):
        mine = [r for r in runs if r.launcher == launcher]
        codes = Counter("timeout" if h.returncode is None else str(h.returncode) for r in mine for h in r.hosts)
        seconds = sorted(max(h.seconds for h in r.hosts) for r in mine)
        table[launcher] = {
            "runs": len(mine),
            "ok": sum(r.ok for r in mine),
            "failed": sum(not r.ok for r in mine),
            "aborts": sum(r.aborted for r in mine),
            "hangs": sum(r.hung for r in mine),
            "trained": sum(r.trained for r in mine),
            "leftover_processes": sum(h.leftovers for r in mine for h in r.hosts),
            "exit_codes": dict(codes),
            "median_s": seconds[len(seconds) // 2],
        }
    return table


def print_table(table: dict[str, dict]) -> None:
    print(f"\n{'launcher':10s} {'runs':>5s} {'ok':>5s} {'failed':>7s} {'aborts':>7s} {'hangs':>6s} {'trained':>8s} "
          f"{'leftover':>9s} {'median s':>9s}  exit codes (per host)")  # fmt: skip
    for launcher, row in table.items():
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(row["exit_codes"].items()))
        print(f"{launcher:10s} {row['runs']:5d} {row['ok']:5d} {row['failed']:7d} {row['aborts']:7d} {row['hangs']:6d} "
              f"{row['trained']:8d} {row['leftover_processes']:9d} {row['median_s']:9.1f}  {codes}")  # fmt: skip


def _stop_on_sigterm(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the bed's clean-up like Ctrl-C


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per launcher (default 30)")
    parser.add_argument("--torchrun", action="store_true", help="also run plain torchrun, alternating with phalanx")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per run before both hosts are killed")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--smoke", action="store_true", help="one run of 2 steps (seconds): proves that the benchmark "
                        "runs, judges nothing")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.steps = 1, 2
    if args.runs < 1 or args.steps < 1:
        parser.error(f"--runs {args.runs} --steps {args.steps}: at least one of each")
    refuse_unless_possible()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)

    from phalanx.testbed import test_bed

    launchers = ["phalanx", "torchrun"] if args.torchrun else ["phalanx"]
    runs: list[Run] = []
    interrupted = False
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="fabric-exits-") as work,
        test_bed(f"fx{os.getpid() % 100000}", HOSTS) as bed,
    ):
        print(f"two hosts: {', '.join(f'{h.name} {h.address}' for h in bed.hosts)}; {args.runs} runs of "
              f"{', '.join(launchers)}, {args.timeout:.0f} s each at most", flush=True)  # fmt: skip
        try:
            for index in range(args.runs):
                for launcher in launchers:  # alternating: the machine's noise hits both alike
                    run = one_run(launcher, index, bed, args.timeout, args.steps, Path(work))
                    runs.append(run)
                    print(describe(run), flush=True)
                    for host in run.hosts:
                        for line in host.evidence:
                            print(f"    {host.host}: {line[:200]}", flush=True)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: removing the test bed and everything running in it", file=sys.stderr)
    if not runs:
        raise SystemExit(130 if interrupted else 1)
    table = summary(runs)
    print_table(table)
    print(f"\n{len(runs)} runs in {time.monotonic() - started:.0f} s" + (" (interrupted)" if interrupted else ""))
    if args.json:
        data = {
            "command": [sys.executable, *sys.argv],
            "interrupted": interrupted,
            "timeout_s": args.timeout,
            "steps": args.steps,
            "summary": table,
            "runs": [
                {**asdict(r), "ok": r.ok, "aborted": r.aborted, "hung": r.hung, "trained": r.trained} for r in runs
            ],
        }
        mine = table["phalanx"]
        target = Target(f"failed runs of a Fabric script under phalanx run, of {mine['runs']} (two hosts)", mine["failed"],
                        0, at_least=False, unit="runs")  # fmt: skip
        write_report(args.json, data, [target], smoke=args.smoke)
        print(f"wrote {args.json}")
    if interrupted:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
