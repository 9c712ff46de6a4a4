"""The tutorial's DDP script (examples/tutorial_ddp.py) on phalanx.Run: eight changed lines.

It gains exact mid-epoch resume (--checkpoint-dir; a relaunch continues at the next batch),
a stop on SIGTERM, SIGUSR1 or Ctrl-C after the same step on every rank, with a checkpoint, and global
metrics (loss, throughput, ETA) every 10 steps. `diff examples/tutorial_ddp.py
examples/tutorial_phalanx.py` shows the change.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=1000, help="size of the synthetic dataset (tutorial: 1000)")
    parser.add_argument("--image-size", type=int, default=224, help="side of the 3xSxS images (tutorial: 224)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process, as in the tutorial")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with CUDA, else gloo")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoints here; a relaunch resumes exactly")
    return parser.parse_args()


def synthetic_images(samples: int, size: int, classes: int, seed: int) -> TensorDataset:
    """The same images and labels on every rank: drawn from one fixed seed, not the global RNG.

    The labels are a fixed linear function of the pixels, so there is something to learn and
    the loss visibly falls (the tutorial's random labels cannot be learned).
    """
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 3, size, size, generator=generator)
    teacher = torch.randn(3 * size * size, classes, generator=generator)
    labels = (images.flatten(1) @ teacher).argmax(dim=1)
    return TensorDataset(images, labels)


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ  # torchrun (and phalanx run) set it; plain python does not
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group(backend=args.backend or ("nccl" if use_cuda else "gloo"))
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    run = phalanx.Run(args.checkpoint_dir)

    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    dataset = synthetic_images(args.samples, args.image_size, args.classes, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = run.setup_dataloader(DataLoader(dataset, batch_size=args.batch_size, sampler=sampler))

    model: torch.nn.Module = torch.nn.Linear(3 * args.image_size * args.image_size, args.classes).to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    run.track(model=model, optimizer=optimizer)

    if rank == 0:
        print(f"training on {world_size} process(es), {device.type}, {args.samples} samples, {args.epochs} epochs")
    started, trained = time.perf_counter(), 0  # samples trained by this run (a resumed one starts mid-epoch)
    for epoch in run.epochs(args.epochs):
        totals = torch.zeros(3, device=device)  # loss sum, correct, samples
        for images, labels in loader:
            images, labels = images.to(device).flatten(1), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            logits = model(images)
            loss_sum = loss_fn(logits, labels)
            (loss_sum / labels.numel()).backward()  # DDP averages these gradients across ranks
            optimizer.step()
            run.step(loss_sum.detach() / labels.numel())
            totals += torch.stack(
                [
                    loss_sum.detach(),
                    (logits.argmax(1) == labels).sum().float(),
                    torch.tensor(float(labels.numel()), device=device),
                ]
            )
        if distributed:
            dist.all_reduce(totals)  # global sums over every rank's batches
        loss, correct, seen = totals.tolist()
        resumed_here = trained == 0 and run.resumed_from is not None
        trained += int(seen)
        if rank == 0 and seen:
            elapsed = time.perf_counter() - started
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {loss / seen:.4f}  accuracy {correct / seen:.3f}  "
                f"({int(seen)} samples{' since the resume' if resumed_here else ''}, {trained / elapsed:.0f} samples/s)"
            )
    run.close()
    if distributed:
        # DDP keeps the process group alive through a reference cycle. Collect it now, so
        # that gloo's threads stop here and not during interpreter shutdown, where one of
        # them can abort the process ("terminate called without an active exception").
        del model, optimizer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
