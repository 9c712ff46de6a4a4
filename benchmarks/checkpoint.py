"""Checkpoint save and load: phalanx's CheckpointManager against the rank-0 paths and bare DCP.

One launch per model size (`phalanx run --nproc-per-node 2`, gloo, CPU). Each rank builds the
same model (a stack of Linear layers of width 4096, or 1024 below 50M parameters, seeded alike:
the replicated state DDP would hold; no DDP wrapper, whose buckets would only add memory, as a
checkpoint holds the unwrapped module's state_dict) and an Adam whose state exists (one step,
taken a layer at a time so that at most one gradient is alive). Then --rounds rounds; each round
runs every method once, the order rotated from round to round (interleaved), and the medians
over the rounds are reported. The methods:

  phalanx        CheckpointManager(async_save=False).save(step, state, rank_state) and
                 load_latest(into=...) then load_state_dict, as phalanx.Run saves and restores
                 (state: model and optimizer; rank_state: the RNG states).
  phalanx-async  CheckpointManager(async_save=True): save() (the stall), then wait() (the wall
                 time). Its load is phalanx's (the same code) and is not timed again.
  rank0-old      the previous CheckpointManager (git show 9cf99d2:src/phalanx/runtime/checkpoint.py),
                 its steps reproduced here: RNGs all-gathered; rank 0 torch.save of everything to
                 a temp file, fsync, SHA-256 file, rename, fsync of the folder; a barrier. Load:
                 rank 0 checks the SHA-256, torch.load(weights_only=True), broadcast_object_list
                 to every rank; each rank load_state_dict.
  torch-save     plain rank-0 torch.save({model, optimizer}) (no fsync, as users write it), a
                 barrier; load: every rank torch.load(weights_only=True) of the file itself.
  dcp            bare torch.distributed.checkpoint.save/load of get_state_dict(model, optimizer),
                 then set_state_dict.

Figures, per method (times: the slowest rank's, from a barrier that starts every rank together):
  save stall   how long save() blocks the training thread (for the synchronous methods, the
               whole save; for phalanx-async, until save() returns: the copy to host memory).
  save wall    from the start of the save until it is on disk and committed (phalanx-async: until
               wait() returns; nothing else runs meanwhile, so this is its best case).
  load         from the start of the load until the model and optimizer hold the saved values in
               place (verified against a fingerprint taken before they were zeroed).
  peak extra   each rank's peak RSS during the save (phalanx-async: save and wait) or the load,
               minus its RSS just before; the maximum over the rounds. The kernel's own peak
               (VmHWM, reset through /proc/self/clear_refs before each measurement; where that is
               not allowed, RSS sampled every 2 ms in a thread, which can miss short peaks).
               Freed heap memory is handed back (malloc_trim) before each measurement. It counts
               what a rank holds beyond its own share (the state it already holds), so the
               memory target reads: peak extra <= the largest tensor (+ MEMORY_SLACK for the
               interpreter, thread stacks and DCP's metadata).

Between operations, outside the timers: os.sync(), and the checkpoint's files are dropped from
the page cache (posix_fadvise DONTNEED), so that every load reads from the disk and no method
pays for another's dirty pages; each checkpoint is deleted after its load.

Targets (issue 25): phalanx load and sync save each within 1.5x of bare DCP; the async stall at
most 0.25x of a rank-0 torch.save (torch-save's save); no rank's peak memory above its own share
plus one tensor.

Memory and disk: the machine this was written on has 24 GiB and 2 cores; a 500M-parameter model
with Adam is 6 GB of state per rank. Before each size, and again before each operation, the
memory an operation needs on top of the ranks' state (ESTIMATES) is checked against what is
available (psutil) less a margin; an operation that would not fit is skipped with the reason,
not run. A size whose checkpoint does not fit on the disk of --dir is skipped.

Usage: python benchmarks/checkpoint.py [--sizes 100M,500M] [--rounds 5] [--smoke] [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from targets import Target, write_report  # benchmarks/: a script's folder is on its path

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
METHODS = ("phalanx", "phalanx-async", "rank0-old", "torch-save", "dcp")
GIB = 2**30
#: Room left free on top of each estimate: a tenth of the RAM, at least 1.5 GiB.
MEMORY_MARGIN_FRACTION, MEMORY_MARGIN_MIN = 0.10, 1.5 * GIB
#: A worker's memory besides the model state (interpreter, torch, gloo).
PROCESS_OVERHEAD = 0.6 * GIB
#: Allowed above one tensor in the memory target: interpreter objects, thread stacks, metadata.
MEMORY_SLACK = 32 * 2**20
TARGET_LOAD, TARGET_SAVE, TARGET_STALL = 1.5, 1.5, 0.25
STALL_TIMEOUT_S = "7200"  # a 500M save takes a minute; phalanx's watchdog must not call it a stall


# -- sizes and estimates --------------------------------------------------------------------------


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def shape_for(parameters: int) -> tuple[int, int]:
    """(layers, width) of a Linear stack with about this many parameters."""
    width = 4096 if parameters >= 50 * 10**6 else 1024
    return max(1, round(parameters / (width * width + width))), width


class Size:
    def __init__(self, label: str) -> None:
        self.label = label
        self.layers, self.width = shape_for(parse_size(label))
        self.parameters = self.layers * (self.width * self.width + self.width)
        self.state_bytes = 12 * self.parameters  # fp32 weights + Adam's exp_avg and exp_avg_sq
        self.tensor_bytes = 4 * self.width * self.width  # the largest tensor


#: Memory an operation needs on top of the ranks' state, per rank (rank 0, rank 1), from the state
#: S, the largest tensor T and a fixed part; conservative. --smoke (10M) measured: the streaming
#: ones (phalanx, dcp, the saves) 0-56 MiB; phalanx-async S + 32 MiB; rank0-old's load 3.2 S on
#: rank 0 and 4.0 S on rank 1 (the state, its pickle and the pickle's copies); torch-save's load S.
def _streaming(s: Size) -> tuple[float, float]:
    return (3 * s.tensor_bytes + 0.1 * s.state_bytes + 128 * 2**20,) * 2


ESTIMATES: dict[tuple[str, str], Callable[[Size], tuple[float, float]]] = {
    ("phalanx", "save"): _streaming,
    ("phalanx", "load"): _streaming,
    ("phalanx-async", "save"): lambda s: tuple(s.state_bytes + x for x in _streaming(s)),  # the staging copy
    ("rank0-old", "save"): _streaming,
    ("rank0-old", "load"): lambda s: (4.5 * s.state_bytes, 4.5 * s.state_bytes),
    ("torch-save", "save"): _streaming,
    ("torch-save", "load"): lambda s: (1.3 * s.state_bytes,) * 2,  # each rank loads the whole file
    ("dcp", "save"): _streaming,
    ("dcp", "load"): _streaming,
}
PHASES = {"phalanx": ("save", "load"), "phalanx-async": ("save",), "rank0-old": ("save", "load"),
          "torch-save": ("save", "load"), "dcp": ("save", "load")}  # fmt: skip


def memory_margin() -> float:
    return max(MEMORY_MARGIN_MIN, MEMORY_MARGIN_FRACTION * psutil.virtual_memory().total)


def fits(size: Size, method: str, phase: str, available: float, resident: float) -> str | None:
    """Why the operation would not fit in ``available`` bytes with ``resident`` already held, or None."""
    need = sum(ESTIMATES[method, phase](size))
    room = available - resident - memory_margin()
    if need > room:
        return (f"needs about {need / GIB:.1f} GiB on top of the ranks' state, {max(room, 0) / GIB:.1f} GiB available "
                f"(less a margin of {memory_margin() / GIB:.1f} GiB)")  # fmt: skip
    return None


def plan(size: Size, available: float, free_disk: float) -> tuple[str | None, dict[str, str]]:
    """(why the whole size is skipped or None, {"method/phase": why it is skipped}) up front."""
    resident = WORLD_SIZE * (size.state_bytes + size.tensor_bytes + PROCESS_OVERHEAD)
    need_disk = 1.1 * size.state_bytes + GIB  # one checkpoint at a time
    if free_disk < need_disk:
        return f"a checkpoint needs about {need_disk / GIB:.1f} GiB of disk, {free_disk / GIB:.1f} GiB free", {}
    if resident + memory_margin() > available:
        return f"the ranks' state alone needs about {resident / GIB:.1f} GiB, {available / GIB:.1f} GiB available", {}
    skipped = {}
    for method in METHODS:
        for phase in PHASES[method]:
            reason = fits(size, method, phase, available, resident)
            if reason:
                skipped[f"{method}/{phase}"] = reason
    return None, skipped


# -- the driver -----------------------------------------------------------------------------------


def run_size(size: Size, rounds: int, folder: Path, skipped: dict[str, str], logs: Path) -> dict[str, Any]:
    result_file = folder / f"result-{size.label}.json"
    argv = [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", str(WORLD_SIZE), "--log-dir", str(logs),
            __file__, "--worker", json.dumps({"label": size.label, "rounds": rounds, "dir": str(folder / size.label),
                                              "skipped": skipped, "result": str(result_file)})]  # fmt: skip
    env = {
        **os.environ,
        "PHALANX_STALL_TIMEOUT": STALL_TIMEOUT_S,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    console = logs / f"console-{size.label}.txt"
    with console.open("wb") as output:
        done = subprocess.run(argv, env=env, stdout=output, stderr=subprocess.STDOUT, cwd=folder)
    if done.returncode != 0 or not result_file.exists():
        tail = console.read_text(errors="replace")[-4000:]
        raise SystemExit(f"the {size.label} run failed (exit {done.returncode}); its console:\n{tail}")
    return json.loads(result_file.read_text())


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(size: Size, raw: dict[str, Any], skipped: dict[str, str]) -> dict[str, Any]:
    methods = {}
    for method in METHODS:
        runs = raw["runs"][method]
        row: dict[str, Any] = {"skipped": {k.split("/")[1]: v for k, v in {**skipped, **raw["skipped"]}.items()
                                           if k.split("/")[0] == method}}  # fmt: skip
        for figure in ("save_stall_s", "save_wall_s", "load_s"):
            row[figure] = median_or_none([r[figure] for r in runs if r.get(figure) is not None])
        for figure in ("save_peak_extra_bytes", "load_peak_extra_bytes"):
            per_rank = [r[figure] for r in runs if r.get(figure) is not None]
            row[figure] = [max(values) for values in zip(*per_rank)] if per_rank else None
        row["runs"] = runs
        methods[method] = row
    return {"parameters": size.parameters, "layers": size.layers, "width": size.width, "state_bytes_per_rank": size.state_bytes,
            "largest_tensor_bytes": size.tensor_bytes, "rounds": raw["rounds"], "memory_peak_method": raw["memory_peak_method"],
            "methods": methods, "targets": targets(size, methods)}  # fmt: skip


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(size: Size, methods: dict[str, Any]) -> list[dict[str, Any]]:
    dcp, plain = methods["dcp"], methods["torch-save"]
    found = []

    def target(name: str, value: float | None, limit: float, unit: str = "x") -> None:
        found.append(Target(f"{name} ({size.label})", value, limit, at_least=False, unit=unit).as_dict())

    target("phalanx load / dcp load", ratio(methods["phalanx"]["load_s"], dcp["load_s"]), TARGET_LOAD)
    target("phalanx sync save / dcp save", ratio(methods["phalanx"]["save_wall_s"], dcp["save_wall_s"]), TARGET_SAVE)
    target("phalanx-async stall / torch-save save", ratio(methods["phalanx-async"]["save_stall_s"], plain["save_stall_s"]),
           TARGET_STALL)  # fmt: skip
    limit = size.tensor_bytes + MEMORY_SLACK
    for method, figure in (("phalanx", "save_peak_extra_bytes"), ("phalanx", "load_peak_extra_bytes"),
                           ("phalanx-async", "save_peak_extra_bytes")):  # fmt: skip
        peaks = methods[method][figure]
        target(f"{method} {figure.split('_')[0]} peak extra (max rank) <= 1 tensor + {MEMORY_SLACK // 2**20} MiB",
               max(peaks) if peaks else None, limit, "bytes")  # fmt: skip
    return found


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def mib(values: list[int] | None) -> str:
    return "-" if values is None else "/".join(f"{v / 2**20:.0f}" for v in values)


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def report(label: str, summary: dict[str, Any]) -> None:
    from phalanx.console import format_table

    methods = summary["methods"]
    dcp, plain = methods["dcp"], methods["torch-save"]
    print(f"\n{label}: {summary['parameters'] / 1e6:.1f}M parameters ({summary['layers']} x Linear({summary['width']})), "
          f"{summary['state_bytes_per_rank'] / GIB:.2f} GiB of state per rank, largest tensor "
          f"{summary['largest_tensor_bytes'] / 2**20:.0f} MiB; medians of {summary['rounds']} interleaved rounds; "
          f"peak memory by {summary['memory_peak_method']}")  # fmt: skip
    header = ["method", "stall s", "save s", "load s", "save/dcp", "load/dcp", "stall/torch.save", "save peak+ MiB",
              "load peak+ MiB"]  # fmt: skip
    rows = []
    for method in METHODS:
        row = methods[method]
        rows.append([method, seconds(row["save_stall_s"]), seconds(row["save_wall_s"]), seconds(row["load_s"]),
                     times(ratio(row["save_wall_s"], dcp["save_wall_s"])), times(ratio(row["load_s"], dcp["load_s"])),
                     times(ratio(row["save_stall_s"], plain["save_stall_s"])), mib(row["save_peak_extra_bytes"]),
                     mib(row["load_peak_extra_bytes"])])  # fmt: skip
    print(format_table(header, rows))
    print("(peak+: each rank's peak RSS above its RSS before the operation, rank 0/rank 1, the most of the rounds)")
    for method in METHODS:
        for phase, why in methods[method]["skipped"].items():
            print(f"skipped {method} {phase}: {why}")
    for found in summary["targets"]:
        value = found["value"]
        shown = "-" if value is None else (f"{value / 2**20:.0f} MiB" if found["unit"] == "bytes" else f"{value:.2f}x")
        limit = f"{found['limit'] / 2**20:.0f} MiB" if found["unit"] == "bytes" else f"{found['limit']}x"
        note = (
            " (async_save keeps a host copy of the whole share until the write ends: by design)"
            if (found["name"].startswith("phalanx-async save peak"))
            else ""
        )
        print(f"target {found['name']}: {shown} (limit {limit}): {found['verdict']}{note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", default="100M,500M", help="model sizes in parameters, comma-separated (default 100M,500M)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size (default 5)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="--sizes 10M --rounds 2 (seconds): proves that the benchmark runs, judges nothing",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp folder "
                        "beside /tmp's); removed afterwards")  # fmt: skip
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "checkpoint.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.smoke:
        args.sizes, args.rounds = "10M", 2
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    sizes = [Size(label.strip()) for label in args.sizes.split(",") if label.strip()]
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "world_size": WORLD_SIZE,
        "cpus": os.cpu_count(),
        "memory_total_bytes": psutil.virtual_memory().total,
        "sizes": {},
        "skipped_sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="phalanx-ckpt-bench-", dir=args.dir) as scratch:
        folder = Path(scratch)
        logs = folder / "logs"
        logs.mkdir()
        print(f"checkpoints under {folder}; {psutil.virtual_memory().available / GIB:.1f} GiB of memory available, "
              f"{shutil.disk_usage(folder).free / GIB:.1f} GiB of disk free", flush=True)  # fmt: skip
        for size in sizes:
            whole, skipped = plan(size, psutil.virtual_memory().available, shutil.disk_usage(folder).free)
            if whole:
                print(f"\n{size.label}: skipped: {whole}", flush=True)
                results["skipped_sizes"][size.label] = whole
                continue
            for key, why in skipped.items():
                print(f"{size.label}: skipping {key}: {why}", flush=True)
            started = time.monotonic()
            raw = run_size(size, args.rounds, folder, skipped, logs)
            summary = summarize(size, raw, skipped)
            summary["seconds"] = time.monotonic() - started
            results["sizes"][size.label] = summary
            report(size.label, summary)
    found = [Target(**{k: v for k, v in t.items() if k != "verdict"}) for size in results["sizes"].values()
             for t in size["targets"]]  # fmt: skip
    write_report(args.json, results, found, smoke=args.smoke)
    print(f"\nwritten {args.json}")


# -- the workers ----------------------------------------------------------------------------------


class PeakRss:
    """This process's peak RSS above its RSS at start(): the kernel's VmHWM, reset through
    /proc/self/clear_refs, or where that is refused, RSS sampled every 2 ms in a thread."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.kernel = self._hwm() is not None
        except OSError:
            self.kernel = False
        self.method = "the kernel's VmHWM (reset by clear_refs)" if self.kernel else "RSS sampled every 2 ms"
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None

    @staticmethod
    def _hwm() -> int | None:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None

    def start(self) -> None:
        if self._trim is not None:
            self._trim(0)
        self.before = self.process.memory_info().rss
        if self.kernel:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            return
        self.peak, self._stop = self.before, threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.002):
                self.peak = max(self.peak, self.process.memory_info().rss)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        if self.kernel:
            peak = self._hwm() or 0
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self.peak, self.process.memory_info().rss)
        return max(0, peak - self.before)


def worker(settings: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import phalanx
    from phalanx.runtime.checkpoint import CheckpointManager, restore_rng_state, rng_state
    from phalanx.runtime.checkpoint.folder import committed_name

    context = phalanx.init(
        timeout=float(STALL_TIMEOUT_S)
    )  # also gloo's limit for each collective: a 500M save takes minutes
    rank = context.rank
    size = Size(settings["label"])
    root = Path(settings["dir"])
    skipped: dict[str, str] = dict(settings["skipped"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(size.width, size.width) for _ in range(size.layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for parameter in model.parameters():  # Adam's state, one gradient alive at a time
        parameter.grad = torch.full_like(parameter, 1e-3)
        optimizer.step()
        parameter.grad = None
    peak = PeakRss()

    def tensors() -> list[torch.Tensor]:
        found = list(model.state_dict().values())
        for state in optimizer.state.values():
            found += [value for value in state.values() if isinstance(value, torch.Tensor)]
        return found

    def fingerprint() -> float:
        return sum(float(t.reshape(-1)[::4099].double().sum()) for t in tensors())

    expected = fingerprint()

    def everyone(value: Any) -> list[Any]:
        gathered: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(gathered, value)
        return gathered

    def settle(path: Path) -> None:
        """On disk and out of the page cache: no dirty pages of one method slow another, every load reads the disk."""
        if rank == 0:
            os.sync()
            for file in [path] if path.is_file() else path.rglob("*") if path.exists() else []:
                if file.is_file():
                    descriptor = os.open(file, os.O_RDONLY)
                    try:
                        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(descriptor)
        dist.barrier()

    def remove(path: Path) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        dist.barrier()

    def still_fits(method: str, phase: str) -> bool:
        """Rank 0 checks the memory available now; every rank learns its verdict."""
        key = f"{method}/{phase}"
        if key in skipped:
            return False
        why = None
        if rank == 0:
            why = fits(size, method, phase, psutil.virtual_memory().available, 0.0)
        why = everyone(why)[0]
        if why:
            skipped[key] = f"at run time: {why}"
            print(f"rank {rank}: skipping {key}: {why}", file=sys.stderr, flush=True)
        return why is None

    def timed(operation: Callable[[], Any]) -> tuple[float, int, Any]:
        """(the slowest rank's seconds, this rank's peak extra bytes, what it returned)."""
        dist.barrier()
        peak.start()
        started = time.perf_counter()
        value = operation()
        elapsed = time.perf_counter() - started
        extra = peak.stop()
        return max(everyone(elapsed)), extra, value

    def resumed(load: Callable[[], None]) -> tuple[float, int]:
        """Zeroes the state, then times ``load`` putting it back; checks it did."""
        with torch.no_grad():
            for t in tensors():
                t.zero_()
        elapsed, extra, _ = timed(load)
        if fingerprint() != expected:
            raise SystemExit(f"rank {rank}: the load did not restore the state")
        return elapsed, extra

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def measure(
        method: str, path: Path, save: Callable[[], None], load: Callable[[], None] | None, removals: list[Path]
    ) -> dict[str, Any]:
        """A synchronous method's save, then its load into the zeroed state; its files removed after."""
        row: dict[str, Any] = {}
        if still_fits(method, "save"):
            elapsed, extra, _ = timed(save)
            row.update(save_stall_s=elapsed, save_wall_s=elapsed, save_peak_extra_bytes=everyone(extra))
            settle(path)
            if load is not None and still_fits(method, "load"):
                row["load_s"], extra = resumed(load)
                row["load_peak_extra_bytes"] = everyone(extra)
        for removal in removals:
            remove(removal)
        return row

    # phalanx -------------------------------------------------------------------------------------
    managers = {name: CheckpointManager(root / name, context, keep=1, async_save=name == "phalanx-async")
                for name in ("phalanx", "phalanx-async")}  # fmt: skip

    def phalanx_sync(step: int) -> dict[str, Any]:
        manager = managers["phalanx"]

        def load() -> None:
            latest = manager.load_latest(into=state())
            assert latest is not None and latest.step == step, latest
            model.load_state_dict(latest.state["model"])
            optimizer.load_state_dict(latest.state["optimizer"])
            restore_rng_state(latest.rank_state["rng"])

        path = manager.directory / committed_name(step)
        return measure("phalanx", path, lambda: manager.save(step, state(), {"rng": rng_state()}), load, [path])

    def phalanx_async(step: int) -> dict[str, Any]:
        """The stall (save() returns) and the wall time (wait() returns) of one save."""
        manager, row = managers["phalanx-async"], {}
        if still_fits("phalanx-async", "save"):
            dist.barrier()
            peak.start()
            started = time.perf_counter()
            manager.save(step, state(), {"rng": rng_state()})
            stall = time.perf_counter() - started
            manager.wait()
            wall = time.perf_counter() - started
            row["save_peak_extra_bytes"] = everyone(peak.stop())
            row["save_stall_s"], row["save_wall_s"] = max(everyone(stall)), max(everyone(wall))
        remove(manager.directory / committed_name(step))
        return row

    # the previous rank-0 manager (9cf99d2), its steps -------------------------------------------
    def rank0_old(step: int) -> dict[str, Any]:
        path = root / "rank0-old" / f"step-{step:09d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)

        def write_atomically(target: Path, write: Callable[[Any], None]) -> None:
            temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            with temporary.open("wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)

        def save() -> None:
            rngs: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(rngs, {"torch": torch.get_rng_state(), "python": random.getstate()})
            if rank == 0:
                payload = {"format": 1, "step": step, "world_size": WORLD_SIZE, "state": state(), "rng": rngs}
                staging = path.with_name(f".{path.name}.staging-{os.getpid()}")
                write_atomically(staging, lambda handle: torch.save(payload, handle))
                write_atomically(path.with_suffix(".sha256"), lambda handle: handle.write(sha256(staging).encode()))
                os.replace(staging, path)
                descriptor = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(descriptor)
                finally:
                    os.close(descriptor)
            dist.barrier()

        def load() -> None:
            found = None
            if rank == 0:
                assert path.with_suffix(".sha256").read_text().strip() == sha256(path)
                found = (step, str(path), torch.load(path, map_location="cpu", weights_only=True))
            box = [found]
            dist.broadcast_object_list(box, src=0)
            payload = box[0][2]
            model.load_state_dict(payload["state"]["model"])
            optimizer.load_state_dict(payload["state"]["optimizer"])
            rng = payload["rng"][rank]
            torch.set_rng_state(rng["torch"])
            version, internal, gauss = rng["python"]
            random.setstate((version, tuple(internal), gauss))

        return measure("rank0-old", path, save, load, [path, path.with_suffix(".sha256")])

    # plain torch.save / torch.load ---------------------------------------------------------------
    def torch_save(step: int) -> dict[str, Any]:
        path = root / "torch-save" / f"step-{step}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)

        def save() -> None:
            if rank == 0:
                torch.save(state(), path)
            dist.barrier()

        def load() -> None:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])

        return measure("torch-save", path, save, load, [path])

    # bare DCP --------------------------------------------------------------------------------------
    def bare_dcp(step: int) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = root / "dcp" / f"step-{step}"

        def save() -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)

        def load() -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

        return measure("dcp", path, save, load, [path])

    run_method = {"phalanx": phalanx_sync, "phalanx-async": phalanx_async, "rank0-old": rank0_old,
                  "torch-save": torch_save, "dcp": bare_dcp}  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {method: [] for method in METHODS}
    for round_ in range(settings["rounds"]):
        order = METHODS[round_ % len(METHODS) :] + METHODS[: round_ % len(METHODS)]
        for method in order:
            row = run_method[method](round_ + 1)
            row["round"], row["position"] = round_, order.index(method)
            runs[method].append(row)
            if rank == 0:
                done = ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_s"))
                print(f"round {round_ + 1} {method}: {done or 'skipped'}", flush=True)
    for manager in managers.values():
        manager.close()
    if rank == 0:
        Path(settings["result"]).write_text(
            json.dumps(
                {
                    "rounds": settings["rounds"],
                    "runs": runs,
                    "skipped": {k: v for k, v in skipped.items() if k not in settings["skipped"]},
                    "memory_peak_method": peak.method,
                }
            )
        )
    context.close()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


if __name__ == "__main__":
    main()
