"""The tutorial's DDP training script, fixed and portable.

Same structure as the tutorial (shared/seed): a synthetic image dataset, one linear layer,
DistributedDataParallel, DistributedSampler with set_epoch, SGD, cross-entropy, printing on
rank 0. Fixed where the tutorial is wrong:

- the device comes from LOCAL_RANK, not ``rank % device_count()``;
- the dataset is drawn from a fixed seed, so every rank holds the same data and the sampler's
  shards really partition it;
- the printed loss is the global mean over all ranks and batches of the epoch, weighted by
  samples, not rank 0's last batch;
- gloo on CPU, nccl on GPU: it runs on a machine without GPUs;
- one code path for 1 process (plain ``python``) and N processes (torchrun or phalanx run).

Runs unchanged under ``torchrun --nproc-per-node 2 examples/tutorial_ddp.py`` and
``phalanx run --simulate-nodes 2 examples/tutorial_ddp.py``. Checkpointing comes with the
phalanx runtime; this script stays a plain torch.distributed program.
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

    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    dataset = synthetic_images(args.samples, args.image_size, args.classes, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model: torch.nn.Module = torch.nn.Linear(3 * args.image_size * args.image_size, args.classes).to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")

    if rank == 0:
        print(f"training on {world_size} process(es), {device.type}, {args.samples} samples, {args.epochs} epochs")
    started = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        totals = torch.zeros(3, device=device)  # loss sum, correct, samples
        for images, labels in loader:
            images, labels = images.to(device).flatten(1), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            logits = model(images)
            loss_sum = loss_fn(logits, labels)
            (loss_sum / labels.numel()).backward()  # DDP averages these gradients across ranks
            optimizer.step()
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
        if rank == 0:
            elapsed = time.perf_counter() - started
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {loss / seen:.4f}  accuracy {correct / seen:.3f}  "
                f"({int(seen)} samples, {seen * (epoch + 1) / elapsed:.0f} samples/s)"
            )
    if distributed:
        # DDP keeps the process group alive through a reference cycle. Collect it now, so
        # that gloo's threads stop here and not during interpreter shutdown, where one of
        # them can abort the process ("terminate called without an active exception").
        del model, optimizer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
