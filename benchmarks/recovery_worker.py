"""One rank of benchmarks/recovery.py: the same training loop on phalanx.Run or in plain DDP with
torch.distributed.checkpoint, writing a timeline of its completed steps.

  --mode phalanx       phalanx.Run (checkpoints every --checkpoint-every steps; keep_last_step on)
  --mode phalanx-off   the same with keep_last_step=False: the steady-state baseline
  (recovery.py's heal side runs --mode phalanx under `phalanx run --heal 1`)
  --mode torchrun      plain DDP under torchrun: dcp.save of get_state_dict every
                       --checkpoint-every steps (a marker file names the newest complete one,
                       written by rank 0 after every rank saved), and at the start dcp.load of it

The model: an MLP of width --width (inputs of 1024, 10 classes) with Adam. Each step trains one
batch of --batch samples per rank, drawn from a generator seeded by (step, rank): the data
position is the step, in every mode. Rank 0 appends "pid step unix_time" to --timeline after
every step it completes: the process id tells the attempts apart (TORCHELASTIC_RESTART_COUNT does
not: an agent that restarts its workers because another node's failed does not count it). With
--starts, every phalanx process appends "pid rank ready": the moment (unix time) its imports are
done and it creates phalanx.Run (a replacement's heal begins there).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

FEATURES, CLASSES = 1024, 10


def model_of(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, CLASSES))  # fmt: skip


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1_000_003 + rank)
    return torch.randn(size, FEATURES, generator=generator), torch.randint(0, CLASSES, (size,), generator=generator)


class Timeline:
    """Rank 0's record of the steps it completed."""

    def __init__(self, path: Path, rank: int) -> None:
        self.handle = path.open("a") if rank == 0 else None
        self.pid = os.getpid()

    def completed(self, step: int) -> None:
        if self.handle is not None:
            self.handle.write(f"{self.pid} {step} {time.time():.6f}\n")
            self.handle.flush()


def train_phalanx(args: argparse.Namespace) -> None:
    import phalanx

    if args.starts is not None:
        with args.starts.open("a") as starts:
            starts.write(f"{os.getpid()} {os.environ['RANK']} {time.time():.6f}\n")
    run = phalanx.Run(args.checkpoint_dir, checkpoint_every=args.checkpoint_every, log_every=10**9,
                      keep_last_step=args.mode == "phalanx")  # fmt: skip
    model = run.setup_model(model_of(args.width))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    run.track(optimizer=optimizer)
    # One sample per step and rank: the loader's position is the step; each batch is drawn from it.
    steps = torch.arange(args.steps * run.world_size)
    loader = run.setup_dataloader(TensorDataset(steps), batch_size=1, shuffle=False)
    timeline = Timeline(args.timeline, run.rank)
    done = run.restore() or 0
    for _ in run.epochs(1):
        for _index in loader:
            inputs, labels = batch(run.global_step + 1, run.rank, args.batch)
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.step()
            if run.global_step > done:  # (a step that healed instead goes on from a completed one)
                done = run.global_step
                timeline.completed(done)
    run.close()


def train_torchrun(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    module = model_of(args.width)
    model = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    marker, start = args.checkpoint_dir / "latest", 0
    if marker.exists():
        start = int(marker.read_text())
        model_state, optimizer_state = get_state_dict(module, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(args.checkpoint_dir / f"step-{start}"))
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    timeline = Timeline(args.timeline, rank)
    for step in range(start + 1, args.steps + 1):
        inputs, labels = batch(step, rank, args.batch)
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.checkpoint_every == 0:
            model_state, optimizer_state = get_state_dict(module, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state},
                     checkpoint_id=str(args.checkpoint_dir / f"step-{step}"))  # fmt: skip
            dist.barrier()
            if rank == 0:
                marker.with_suffix(".tmp").write_text(str(step))
                marker.with_suffix(".tmp").replace(marker)
        timeline.completed(step)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["phalanx", "phalanx-off", "torchrun"], required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--checkpoint-every", type=int, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--timeline", type=Path, required=True)
    parser.add_argument("--starts", type=Path, default=None)
    args = parser.parse_args()
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (train_torchrun if args.mode == "torchrun" else train_phalanx)(args)


if __name__ == "__main__":
    main()
