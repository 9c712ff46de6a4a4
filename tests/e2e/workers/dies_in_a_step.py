"""A phalanx.Run training that draws random numbers every step (dropout, noise on the inputs) and
has buffers (BatchNorm), and fails on purpose, in its first attempt only:

--fail-step N --fail-where backward: rank --fail-rank raises in the backward of step N + 1;
--fail-where optimizer: it raises after the optimizer step of step N + 1, before run.step();
--fail-where save: it SIGKILLs itself in the checkpoint save after step N (at --every's cadence,
the end's, or --save-each-epoch's), as DCP starts writing its files: the other ranks are then
inside the save's collectives;
--fail-where plan: it SIGKILLs itself in the checkpoint save after step N as it sends its part of
DCP's plan to the coordinator (rank 0): the other ranks, which sent theirs, wait on rank 0 alone;
--fail-where wait: it prints "waiting in step N + 1" and then waits for ever in the backward of
step N + 1, as a rank whose collective waits for a peer that went silent;
--kill-step N: rank --fail-rank SIGKILLs itself right after step N (--fail-rank 2,3: both do);
--kill-replacement-step N: so does the process that --heal started in its place.
--source-dies: rank 0, serving the heal of rank --fail-rank (not 0), SIGKILLs itself once it
started sending the state.
--replacement-dies-receiving: the first process that --heal started in place of rank --fail-rank
SIGKILLs itself as it waits for the state, a failure during the heal.
--replacement-sleeps S: a process that --heal started sleeps S seconds before it starts its
phalanx.Run (the surviving ranks wait for it as long as their group's timeout);
--timeout S: the process group's timeout (phalanx.init's), also how long a heal may take.
--save-each-epoch: the loop calls run.save() after each epoch, a checkpoint of the script's own.
--close-in-finally: the loop runs in a try whose finally calls run.close(), as many scripts do
(one process only: the summary comes after the close).

--out: rank 0 writes run.summary() there, with the SHA-256 of the parameters alone (without
the buffers) as parameters_only_sha256.
--pids DIR: each rank writes its PID to DIR/rankR-first once its first step ended (a replacement
finds it there and leaves it) and to DIR/rankR-last at the end.

The first attempt is the first start of the workers, and not a replacement that ``--heal``
started in place of a rank that died.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint
from torch.utils.data import TensorDataset

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", type=Path, required=True)
parser.add_argument("--every", type=int, default=10)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--fail-rank", type=lambda ranks: {int(rank) for rank in ranks.split(",")}, default={0})
parser.add_argument("--fail-step", type=int, default=None)
parser.add_argument("--fail-where", choices=["backward", "optimizer", "save", "plan", "wait"], default="backward")
parser.add_argument("--kill-step", type=int, default=None)
parser.add_argument("--kill-replacement-step", type=int, default=None)
parser.add_argument("--source-dies", action="store_true")
parser.add_argument("--replacement-dies-receiving", action="store_true")
parser.add_argument("--replacement-sleeps", type=float, default=0.0)
parser.add_argument("--timeout", type=float, default=None)
parser.add_argument("--close-in-finally", action="store_true")
parser.add_argument("--save-each-epoch", action="store_true")
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--pids", type=Path, default=None)
args = parser.parse_args()

first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and "PHALANX_REPLACEMENT" not in os.environ
if "PHALANX_REPLACEMENT" in os.environ:
    time.sleep(args.replacement_sleeps)
context = phalanx.init(timeout=args.timeout) if args.timeout is not None else None
run = phalanx.Run(args.checkpoint_dir, checkpoint_every=args.every, log_every=1000, context=context)
torch.manual_seed(0)
model = run.setup_model(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                            torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)))  # fmt: skip
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
run.track(optimizer=optimizer)
data = TensorDataset(torch.randn(240, 16, generator=torch.Generator().manual_seed(1)), torch.arange(240) % 4)
loader = run.setup_dataloader(data, batch_size=8)


if first_attempt and run.rank in args.fail_rank and args.fail_where == "save" and args.fail_step is not None:
    # Fault injection (test only): the save after step N, as it writes its files.
    write_data = torch.distributed.checkpoint.FileSystemWriter.write_data

    def dies_in_the_save(writer, plan, planner):
        if run.global_step == args.fail_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return write_data(writer, plan, planner)

    torch.distributed.checkpoint.FileSystemWriter.write_data = dies_in_the_save


if first_attempt and run.rank in args.fail_rank and args.fail_where == "plan":
    # Fault injection (test only): DCP gathers the ranks' plans with gather_object, whose gather
    # (after an all_gather of their sizes) is the first of a save; nothing else of a step gathers.
    import torch.distributed.distributed_c10d as c10d

    gather = c10d.gather

    def dies_in_the_plan(*arguments, **options):
        if run.global_step == args.fail_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return gather(*arguments, **options)

    c10d.gather = dies_in_the_plan


if args.source_dies and first_attempt and run.rank == 0:
    # Fault injection (test only): the heal's send of the state, its first wait a SIGKILL.
    import phalanx.runtime.heal.healing as healing

    send_state = healing.send_state
    healing.send_state = lambda state, receivers, wait, group: send_state(
        state, receivers, lambda works: os.kill(os.getpid(), signal.SIGKILL), group
    )


if args.replacement_dies_receiving and os.environ.get("PHALANX_REPLACEMENT") == "0" and run.rank in args.fail_rank:
    # Fault injection (test only): the heal's receive of the state, its first wait a SIGKILL.
    import phalanx.runtime.heal.healing as healing

    receive_state = healing.receive_state
    healing.receive_state = lambda source, wait, group: receive_state(
        source, lambda works: os.kill(os.getpid(), signal.SIGKILL), group
    )


class Injected(RuntimeError):
    """The failure this worker makes."""


def failing_now(where: str) -> bool:
    return (first_attempt and run.rank in args.fail_rank and args.fail_where == where
            and run.global_step == args.fail_step)  # fmt: skip


def train() -> None:
    for _ in run.epochs(args.epochs):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y)
            if failing_now("backward"):
                raise Injected(f"injected failure in the backward of step {run.global_step + 1}")
            if failing_now("wait"):
                print(f"waiting in step {run.global_step + 1}", flush=True)
                threading.Event().wait()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if failing_now("optimizer"):
                raise Injected(f"injected failure after the optimizer step of step {run.global_step + 1}")
            run.step(loss)
            if args.pids is not None and not (args.pids / f"rank{run.rank}-first").exists():
                (args.pids / f"rank{run.rank}-first").write_text(str(os.getpid()))
            if first_attempt and run.rank in args.fail_rank and run.global_step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            replacing = "PHALANX_REPLACEMENT" in os.environ
            if replacing and run.rank in args.fail_rank and run.global_step == args.kill_replacement_step:
                os.kill(os.getpid(), signal.SIGKILL)
        if args.save_each_epoch:
            run.save()


if args.close_in_finally:
    try:
        train()
    finally:
        run.close()
else:
    train()
summary = run.summary()  # a collective, or with --close-in-finally one process's figures
if args.pids is not None:
    (args.pids / f"rank{run.rank}-last").write_text(str(os.getpid()))
if run.is_main:
    parameters = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    args.out.write_text(json.dumps({**summary, "parameters_only_sha256": parameters}))
run.close()
