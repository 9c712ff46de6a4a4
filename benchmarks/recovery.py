"""A host's workers lost mid-run: the steps trained again and the seconds to train again, phalanx
against torchrun with torch.distributed.checkpoint; and what keeping the last step costs.

Setup: --hosts test-bed hosts (network namespaces on a bridge; root), each link shaped to --rate;
one worker per host (gloo, CPU). The model (benchmarks/recovery_worker.py): an MLP whose
parameters and Adam's two moments come to about --state-mb; a checkpoint every
--checkpoint-every steps.

Each trial draws a step K between the first checkpoint and the second (uniformly, seeded by
--seed: on average half a checkpoint interval after the first) and runs each side (--sides)
with --max-restarts 1, one after the other in an order that rotates:
  phalanx-heal  `phalanx run --heal 1`: the same loop; the killed workers are replaced and heal
                from a live peer, the other hosts' workers keep their processes
  phalanx       `phalanx run`, the loop on phalanx.Run (keep_last_step on, the default)
  torchrun      `torchrun --rdzv-backend c10d`, the loop in plain DDP; dcp.save every
                --checkpoint-every steps, and dcp.load of the newest at the start
Once rank 0 (on the first host) has completed step K, every training process of the last host is
SIGKILLed (under --heal the worker that supervises it lives); its launcher lives and restarts the workers on every host (phalanx-heal: its own
workers), which train to step K + 5. From rank 0's timeline:
  steps trained again  the newest step the first attempt completed (rank 0 may complete one
                       after the kill: the killed rank had done its part of it), minus the
                       step the restart resumed from (the first step it completed, minus one);
                       0 where the restart resumed after it (the state was kept inside the
                       run.step() of the next step, before rank 0 wrote that step down)
  seconds to train     from the kill to the first step completed after it
  seconds to regain    from the kill to the first step completed past the newest step the first
                       attempt completed: the progress is back (the steps again included)
phalanx-heal's rank 0 keeps its process: its timeline goes on, and its log's line "healed in ..."
names the step it went on after (the one resumed from). Also for phalanx-heal:
  replacement's start  from the kill to the moment the last replacement's imports are done (its
                       own start: the worker noticing, the process, the imports)
  survivors' idle      from rank 0's last step before the kill to its first after the heal, less
                       its median step before the kill for each step trained in between
  heal's seconds, MiB  from rank 0's line: from its noticing the failure to the state sent
A job whose launchers have not exited a minute after its last step is killed and counted as
hung at its exit; what it trained counts all the same.
Steady state: --steady-steps steps without a fault, phalanx with keep_last_step on and off,
--steady-runs runs each, interleaved; the median step time of each run (after its first 5
steps), the ratio of the medians on/off.

Targets: phalanx trains at most 1 step again after any kill (the largest over the trials);
keeping the last step costs at most 3% of the steady-state step time; phalanx-heal trains its next
step at most 3 s after its replacement's own start (the median over the trials).

Usage: sudo python benchmarks/recovery.py [--trials 10] [--hosts 3] [--rate 1gbit] [--state-mb 200]
       [--checkpoint-every 100] [--sides phalanx-heal,phalanx,torchrun] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from targets import Target, write_report  # benchmarks/: a script's folder is on its path

from phalanx.launch.node_setup import FRESH_STORE_VARIABLE
from phalanx.testbed import Shaping, test_bed

HERE = Path(__file__).resolve().parent
WORKER = HERE / "recovery_worker.py"
FIRST_PORT = 29400
#: Adam holds two moments per parameter: parameters and state are 3 float32 per parameter.
BYTES_PER_PARAMETER = 12
TARGET_STEPS_AGAIN, TARGET_STEADY_COST, TARGET_HEAL_S = 1, 1.03, 3.0
SIDES = ("phalanx-heal", "phalanx", "torchrun")
#: Rank 0's line after a heal (phalanx.Run's): its seconds, the state's size, the step resumed from.
HEALED = re.compile(r"healed in (?P<seconds>[\d.]+) s .*?(?P<mib>[\d.]+) MiB of state from rank .*?; "
                    r"going on after step (?P<step>\d+)")  # fmt: skip
#: Steps of each steady run left out of its median (the first ones build DDP's buckets).
WARM_STEPS = 5
#: Seconds a job may take to exit after its last step, before its processes are killed (and the
#: job is recorded as hung at exit; what it trained is measured all the same).
EXIT_GRACE_S = 60.0


def width_for(state_mb: float) -> int:
    """The MLP width whose parameters and Adam state come to about ``state_mb`` MB."""
    parameters = state_mb * 1e6 / BYTES_PER_PARAMETER  # width**2 + (1024 + 10 + 2) * width
    return max(8, int((-1036 + math.sqrt(1036**2 + 4 * parameters)) / 2))


def launch_line(side: str, bed, host, args: argparse.Namespace, folder: Path, steps: int, restarts: int,
                port: int) -> list[str]:  # fmt: skip
    endpoint = f"{bed.hosts[0].address}:{port}"
    nodes = str(len(bed.hosts))
    worker = [str(WORKER), "--mode", "phalanx" if side == "phalanx-heal" else side, "--width", str(args.width), "--steps", str(steps), "--checkpoint-every",
              str(args.checkpoint_every), "--checkpoint-dir", str(folder / "ck"), "--timeline", str(folder / "timeline"),
              "--starts", str(folder / "starts")]  # fmt: skip
    env = [f"GLOO_SOCKET_IFNAME={host.device}"]
    if side == "torchrun":  # a test-bed host is not its own hostname: which one holds the store is said
        # torchrun's workers share the agent's store across restarts (torch >= 2.4): a restarted
        # rank that reaches init_process_group before rank 0 reads rank 0's previous address and
        # the restart fails (3 of 3 smoke runs here). torch's switch for a fresh store per attempt,
        # which phalanx run sets too, makes the baseline the one that restarts.
        env.append(f"{FRESH_STORE_VARIABLE}=1")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nodes, "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", folder.name,
                    "--rdzv-conf", f"is_host={int(host is bed.hosts[0])}", "--local-addr", host.address,
                    "--max-restarts", str(restarts)]  # fmt: skip
    else:
        launcher = [sys.executable, "-m", "phalanx", "run", "--nnodes", nodes, "--rdzv-endpoint", endpoint,
                    "--max-restarts", str(restarts), "--log-dir", str(folder / f"logs-{host.name}"),
                    *(["--heal", "1"] if side == "phalanx-heal" else [])]  # fmt: skip
    return host.command(["env", *env, *launcher, *worker])


def timeline(folder: Path) -> list[tuple[int, int, float]]:
    """Rank 0's completed steps as (attempt, step, unix time); attempt 0 is the first process."""
    path = folder / "timeline"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    rows = [row for row in rows if len(row) == 3]  # a last line half-written
    attempts = {pid: attempt for attempt, pid in enumerate(dict.fromkeys(row[0] for row in rows))}
    return [(attempts[row[0]], int(row[1]), float(row[2])) for row in rows]


def run_job(
    side: str, bed, args: argparse.Namespace, folder: Path, steps: int, kill_after: int | None, port: int
) -> dict:
    """One job on every host; with ``kill_after``, the last host's workers SIGKILLed after that
    step. Each job has a port of its own: the previous job's may still be in TIME_WAIT."""
    folder.mkdir(parents=True)
    logs = [(folder / f"{host.name}.log").open("w") for host in bed.hosts]  # files: a worker left behind holds no pipe
    processes = [subprocess.Popen(launch_line(side, bed, host, args, folder, steps, 1 if kill_after else 0, port),
                                  cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                 for host, log in zip(bed.hosts, logs)]  # fmt: skip
    killed_at, deadline, hung_at_exit = None, time.monotonic() + args.timeout, False
    try:
        while kill_after is not None and killed_at is None:
            done = [row for row in timeline(folder) if row[0] == 0]
            if done and done[-1][1] >= kill_after:
                victims = _training_processes(bed.processes(bed.hosts[-1].name))
                killed_at = time.time()  # before: this process may run again after the replacement starts
                for pid in victims:
                    os.kill(pid, signal.SIGKILL)
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                raise SystemExit(f"{side}: step {kill_after} never came:\n{_outputs(bed, folder)}")
            time.sleep(0.01)
        trained_at = None  # the launchers' exit is not measured: a job that trained its last step and
        while any(p.poll() is None for p in processes):  # hangs on its way out is a result, said
            if trained_at is None and any(row[1] == steps for row in timeline(folder)):
                trained_at = time.monotonic()
            if trained_at is not None and time.monotonic() - trained_at > EXIT_GRACE_S:
                hung_at_exit = True
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{side}: did not end within {args.timeout} s:\n{_outputs(bed, folder)}")
            time.sleep(0.1)
    finally:
        for host in bed.hosts:  # every process on the hosts, whatever process group or session it made
            for pid in bed.processes(host.name):
                _kill(pid)
        for log in logs:
            log.close()
    if not hung_at_exit and any(p.returncode != 0 for p in processes):
        raise SystemExit(f"{side} failed:\n{_outputs(bed, folder)}")
    rows = timeline(folder)
    if side == "phalanx-heal" and killed_at is not None:
        result = {"hung_at_exit": hung_at_exit, **_healed(bed, folder, rows, killed_at)}
        shutil.rmtree(folder / "ck", ignore_errors=True)
        return result
    if kill_after is not None and not any(attempt == 1 for attempt, _, _ in rows):
        raise SystemExit(f"{side}: no step after the kill (did it land after the last step?):\n{_outputs(bed, folder)}")
    result: dict = {"step_times_s": [b[2] - a[2] for a, b in zip(rows, rows[1:]) if a[0] == b[0]],
                    "hung_at_exit": hung_at_exit}  # fmt: skip
    if killed_at is not None:  # rank 0 may complete a step after the kill: the killed rank had done its part
        last = max(step for attempt, step, _ in rows if attempt == 0)
        first = next(row for row in rows if row[0] == 1)
        # A state kept inside run.step() of the step after ``last`` is past the timeline: none again.
        result.update(last_step_before=last, resumed_from=first[1] - 1, steps_again=max(0, last - (first[1] - 1)),
                      seconds_to_train=first[2] - killed_at,
                      seconds_to_regain=next((t - killed_at for attempt, step, t in rows if attempt > 0 and step > last),
                                             None))  # fmt: skip
    shutil.rmtree(folder / "ck", ignore_errors=True)
    return result


def _healed(bed, folder: Path, rows: list[tuple[int, int, float]], killed_at: float) -> dict:
    """A heal side's trial, from rank 0's timeline and line and the replacement's start."""
    found = HEALED.search((folder / f"{bed.hosts[0].name}.log").read_text(errors="replace"))
    if found is None:
        raise SystemExit(f"phalanx-heal: no heal was said:\n{_outputs(bed, folder)}")
    healed = int(found["step"])
    first = next((t for _, step, t in rows if step == healed + 1), None)
    if first is None:
        raise SystemExit(f"phalanx-heal: no step after the heal:\n{_outputs(bed, folder)}")
    last = max(step for _, step, t in rows if t < first)  # (a step rank 0 was behind on is written at the heal)
    done, done_at = max((step, t) for _, step, t in rows if t <= killed_at)
    before = [b - a for (_, _, a), (_, _, b) in zip(rows, rows[1:]) if b <= killed_at]
    ready = [at - killed_at for at in _replacements_ready(folder / "starts")]
    # From rank 0's last step before the kill to its first after the heal, less the steps in it.
    trained = (healed + 1 - done) * (statistics.median(before) if before else 0.0)
    return {"last_step_before": last, "resumed_from": healed, "steps_again": max(0, last - healed),
            "seconds_to_train": first - killed_at, "seconds_to_regain": first - killed_at,
            "replacement_start_s": max(ready) if ready else None, "survivors_idle_s": first - done_at - trained,
            "heal_s": float(found["seconds"]), "heal_mib": float(found["mib"]),
            "step_times_s": []}  # fmt: skip


def _replacements_ready(starts: Path) -> list[float]:
    """When each replacement was ready (unix times): a rank's rows after its first one (told by
    rank: a process's start is known to a clock tick only, and the kill's time is not exact)."""
    ranks: set[str] = set()
    ready = []
    for row in (line.split() for line in starts.read_text().splitlines()):
        if len(row) == 3:  # (a last line half-written)
            if row[1] in ranks:
                ready.append(float(row[2]))
            ranks.add(row[1])
    return ready


def _heal_figures(trial: dict) -> str:
    """A heal side's own figures, for its trial's line."""
    if "heal_s" not in trial:
        return ""
    return (
        f"; the replacement started in {_seconds(trial['replacement_start_s'])}, the survivors idle "
        f"{trial['survivors_idle_s']:.1f} s, the heal {trial['heal_s']:.1f} s for {trial['heal_mib']:.1f} MiB"
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _median_of(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _training_processes(pids: list[int]) -> list[int]:
    """The workers that train: under --heal, a worker supervises the process that trains (its
    child, which a fault such as an out-of-memory kill or a crash ends), elsewhere it trains."""
    workers = [pid for pid in pids if _is_worker(pid)]
    parents = {_parent(pid) for pid in workers}
    return [pid for pid in workers if pid not in parents]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _is_worker(pid: int) -> bool:
    try:
        return WORKER.name in Path(f"/proc/{pid}/cmdline").read_text() and not _is_launcher(pid)
    except OSError:
        return False


def _is_launcher(pid: int) -> bool:
    line = Path(f"/proc/{pid}/cmdline").read_text()
    return "torch.distributed.run" in line or "\0phalanx\0run\0" in line


def _outputs(bed, folder: Path) -> str:
    """The end of every host's launcher output."""
    return "\n".join(f"== {host.name}\n{(folder / f'{host.name}.log').read_text(errors='replace')[-3000:]}"
                     for host in bed.hosts)  # fmt: skip


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--rate", default="1gbit", help="each host's link, as tc writes it ('' for unshaped)")
    parser.add_argument("--state-mb", type=float, default=200.0)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--sides", default=",".join(SIDES), help="the sides of each trial, of " + ", ".join(SIDES))
    parser.add_argument("--steps-after-kill", type=int, default=5, help="steps the job trains past the kill's")
    parser.add_argument("--steady-steps", type=int, default=60)
    parser.add_argument("--steady-runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a job may take")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one trial, seconds: proves it runs")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.trials, args.hosts, args.rate, args.state_mb, args.steps_after_kill = 1, 2, "", 1.0, 300
        args.checkpoint_every, args.steady_steps, args.steady_runs, args.timeout = 10, 12, 1, 120.0
    args.sides = tuple(side for side in args.sides.split(",") if side)
    if not args.sides or set(args.sides) - set(SIDES):
        parser.error(f"--sides {','.join(args.sides)}: a comma-separated list of {', '.join(SIDES)}")
    if os.geteuid() != 0:
        raise SystemExit("recovery.py builds test-bed hosts (network namespaces): run it as root")
    # The bed comes down on a kill too: as on Ctrl-C (a SystemExit would count as one job's failure).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args.width = width_for(args.state_mb)
    draw, ports = random.Random(args.seed), itertools.count(FIRST_PORT)
    trials: list[dict] = []
    steady: dict[str, list[float]] = {"phalanx": [], "phalanx-off": []}
    with (
        tempfile.TemporaryDirectory(prefix="phalanx-recovery-") as scratch,
        test_bed(
            f"r{os.getpid() % 100000}",
            [f"h{n + 1}" for n in range(args.hosts)],
            shaping=Shaping(rate=args.rate or None),
        ) as bed,
    ):
        for trial in range(args.trials):
            # The smoke's steps take milliseconds: its kill comes right after the first checkpoint,
            # so that it lands well before the second (a kill during a save is another trial).
            first = args.checkpoint_every + 1
            kill_after = first if args.smoke else draw.randint(first, 2 * args.checkpoint_every - 1)
            steps = kill_after + args.steps_after_kill  # the restart's first steps are all a trial needs
            shift = trial % len(args.sides)
            sides = args.sides[shift:] + args.sides[:shift]
            row: dict = {"kill_after_step": kill_after}
            for side in sides:
                try:
                    row[side] = run_job(
                        side, bed, args, Path(scratch) / f"t{trial}-{side}", steps, kill_after, next(ports)
                    )
                except SystemExit as failed:  # a restart that never trained again is a result too
                    row[side] = {"failed": str(failed)[-3000:]}
                    print(f"trial {trial + 1}/{args.trials} {side}: FAILED: {str(failed).splitlines()[0]}", flush=True)
                    continue
                print(f"trial {trial + 1}/{args.trials} {side}: the last step before the kill {row[side]['last_step_before']}, "
                      f"resumed from {row[side]['resumed_from']}: {row[side]['steps_again']} step(s) again, "
                      f"{row[side]['seconds_to_train']:.1f} s to train again, "
                      f"{_seconds(row[side]['seconds_to_regain'])} to pass the step reached before the kill"
                      f"{_heal_figures(row[side])}"
                      f"{'; hung at its exit, killed' if row[side]['hung_at_exit'] else ''}", flush=True)  # fmt: skip
                del row[side]["step_times_s"]
            trials.append(row)
        for run_index in range(args.steady_runs):
            for side in ("phalanx", "phalanx-off") if run_index % 2 == 0 else ("phalanx-off", "phalanx"):
                times = run_job(
                    side, bed, args, Path(scratch) / f"s{run_index}-{side}", args.steady_steps, None, next(ports)
                )
                steady[side].append(statistics.median(times["step_times_s"][WARM_STEPS:]))
                print(
                    f"steady {run_index + 1}/{args.steady_runs} {side}: {steady[side][-1] * 1e3:.1f} ms/step",
                    flush=True,
                )
    recovered = {side: [row[side] for row in trials if "failed" not in row[side]] for side in args.sides}
    again = {side: [trial["steps_again"] for trial in done] for side, done in recovered.items()}
    cost = statistics.median(steady["phalanx"]) / statistics.median(steady["phalanx-off"]) if args.steady_runs else None
    heals = recovered.get("phalanx-heal", [])
    over_start = [trial["seconds_to_train"] - trial["replacement_start_s"] for trial in heals
                  if trial["replacement_start_s"] is not None]  # fmt: skip
    results = {
        "setup": {"hosts": args.hosts, "rate": args.rate or "unshaped", "state_mb": args.state_mb, "width": args.width,
                  "checkpoint_every": args.checkpoint_every, "trials": args.trials},
        "trials": trials,
        "failed": {side: args.trials - len(done) for side, done in recovered.items()},
        "hung_at_exit": {side: sum(trial["hung_at_exit"] for trial in done) for side, done in recovered.items()},
        "steps_again": {f"{side}_{name}": figure(values) if values else None for side, values in again.items()
                        for name, figure in (("median", statistics.median), ("max", max))},
        "seconds_to_train": {side: statistics.median(trial["seconds_to_train"] for trial in done) if done else None
                             for side, done in recovered.items()},
        "seconds_to_regain": {side: _median_of([trial["seconds_to_regain"] for trial in done])
                             for side, done in recovered.items()},
        "heal": {name: _median_of([trial[name] for trial in heals]) for name in
                 ("replacement_start_s", "survivors_idle_s", "heal_s", "heal_mib")} if heals else None,
        "heal_over_replacement_start_s": statistics.median(over_start) if over_start else None,
        "steady_step_s": {side: statistics.median(times) for side, times in steady.items() if times},
        "steady_cost": cost,
    }  # fmt: skip
    shown = (
        "failed",
        "hung_at_exit",
        "steps_again",
        "seconds_to_train",
        "seconds_to_regain",
        "heal",
        "heal_over_replacement_start_s",
        "steady_step_s",
        "steady_cost",
    )
    print(json.dumps({key: results[key] for key in shown}, indent=1))
    worst = max(again["phalanx"]) if again.get("phalanx") and not results["failed"]["phalanx"] else None
    heal_failed = results["failed"].get("phalanx-heal", 0)
    targets = [
        Target("steps trained again after a host's workers were killed, phalanx (largest of the trials)",
               worst, TARGET_STEPS_AGAIN, at_least=False, unit="steps"),
        Target("steady-state step time, keep_last_step on / off", cost, TARGET_STEADY_COST, at_least=False),
        Target("seconds from the kill to the next step, phalanx-heal, past its replacement's own start (median)",
               None if heal_failed else results["heal_over_replacement_start_s"], TARGET_HEAL_S, at_least=False,
               unit="s"),
    ]  # fmt: skip
    if args.json:
        write_report(args.json, results, targets, smoke=args.smoke)


if __name__ == "__main__":
    main()
