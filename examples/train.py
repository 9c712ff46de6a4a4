"""A complete training program on the phalanx runtime: correct, resumable, one code path.

Trains a small MLP on scikit-learn's handwritten digits (1797 images of 8x8, shipped inside the
package: nothing is downloaded), or on the tutorial's synthetic images. Run it with plain
``python`` (1 process), ``phalanx run`` or torchrun; with --checkpoint-dir it resumes exactly
where it stopped, also after torchrun restarted the workers (``--max-restarts``).

    phalanx run --nproc-per-node 2 examples/train.py --epochs 5 --checkpoint-dir ckpt
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.exit_codes import ExitCode
from phalanx.runtime.consistency import check_consistency
from phalanx.runtime.model import COMPRESSIONS, parameters_sha256, unwrap, wrap_model
from phalanx.runtime.preemption import PreemptionGuard


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    parser.add_argument("--samples", type=int, default=None, help="use the first N samples (default: all)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process, as in the tutorial")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics-json", type=Path, default=None, help="rank 0 writes the final metrics here")
    parser.add_argument("--save-model", type=Path, default=None, help="rank 0 saves the final state_dict here")
    return parser.parse_args()


def load_dataset(name: str, samples: int | None, seed: int) -> TensorDataset:
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
    else:  # the tutorial's 3x224x224 images, drawn from a fixed seed so every rank has the same
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(samples or 1000, 3 * 224 * 224, generator=generator)
        labels = (images @ torch.randn(images.shape[1], 10, generator=generator)).argmax(1)
    if samples is not None:
        images, labels = images[:samples], labels[:samples]
    return TensorDataset(images, labels)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: TensorDataset, context: phalanx.DistributedContext) -> dict[str, float]:
    """Loss and accuracy over the whole dataset, each rank taking its share: a global mean."""
    totals = phalanx.GlobalMean(context, "loss", "correct")
    images, labels = dataset.tensors
    for part in torch.arange(len(labels)).tensor_split(context.world_size)[context.rank].split(256):
        logits = model(images[part].to(context.device))
        target = labels[part].to(context.device)
        loss = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
        totals.add(len(part), loss=loss, correct=(logits.argmax(1) == target).sum())
    result = totals.compute()
    return {"loss": result["loss"], "accuracy": result["correct"]}


def main() -> None:
    args = parse_args()
    context = phalanx.init()
    torch.manual_seed(args.seed)
    dataset = load_dataset(args.dataset, args.samples, args.seed)
    features, classes = dataset.tensors[0].shape[1], int(dataset.tensors[1].max()) + 1
    network = torch.nn.Sequential(torch.nn.Linear(features, 128), torch.nn.ReLU(), torch.nn.Linear(128, classes))
    check_consistency(context, model=network, dataset=dataset)  # before DDP could hang on a mismatch
    model = wrap_model(network, context, compression=args.compression)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = phalanx.ResumableSampler(len(dataset), rank=context.rank, world_size=context.world_size, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    checkpoints = phalanx.CheckpointManager(args.checkpoint_dir, context) if args.checkpoint_dir else None

    step, resumed_from = 0, None
    latest = checkpoints.load_latest() if checkpoints else None
    if latest is not None:
        unwrap(model).load_state_dict(latest.state["model"])
        optimizer.load_state_dict(latest.state["optimizer"])
        sampler.load_state_dict(latest.state["sampler"])
        if latest.rng is not None:
            phalanx.runtime.checkpoint.restore_rng_state(latest.rng)
        step = resumed_from = latest.step
        if context.is_main:
            print(f"resumed from step {step} ({latest.path})")

    preemption = PreemptionGuard(context)  # SIGTERM / SIGUSR1: stop together after this step
    epoch_metrics = phalanx.GlobalMean(context, "loss")
    started, trained = time.perf_counter(), 0
    while sampler.epoch < args.epochs:
        epoch, epoch_start = sampler.epoch, sampler.position
        epoch_metrics.reset()
        real_before = sampler.real_handed_out
        for images, labels in loader:
            images, labels = images.to(context.device), labels.to(context.device)
            optimizer.zero_grad(set_to_none=True)
            per_sample = torch.nn.functional.cross_entropy(model(images), labels, reduction="none")
            per_sample.mean().backward()
            optimizer.step()
            step += 1
            trained += len(labels)
            # The metric counts real samples only: the padding that evens out the shards (the
            # last samples of a rank's epoch) would otherwise count twice.
            real, real_before = sampler.real_handed_out - real_before, sampler.real_handed_out
            epoch_metrics.add(real, loss=per_sample[:real].detach().sum())
            preempted = preemption.should_stop()
            if checkpoints and (preempted or step % args.checkpoint_every == 0):
                checkpoints.save(step, {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                                        "sampler": sampler.state_dict()})  # fmt: skip
            if preempted:
                if context.is_main:
                    saved = "checkpoint saved" if checkpoints else "no --checkpoint-dir, nothing saved"
                    print(f"preempted by {preemption.received.name if preemption.received else 'another rank'} "
                          f"after step {step}; {saved}", flush=True)  # fmt: skip
                context.close()
                raise SystemExit(ExitCode.PREEMPTED)
        summary = epoch_metrics.compute()  # the mean over every rank's samples of this epoch
        if context.is_main:
            note = f" (resumed at sample {epoch_start})" if epoch_start else ""
            print(f"epoch {epoch + 1}/{args.epochs}  step {step}  loss {summary['loss']:.4f}{note}", flush=True)

    elapsed = time.perf_counter() - started
    final = evaluate(unwrap(model), dataset, context)
    throughput = torch.tensor([trained / elapsed if elapsed > 0 else 0.0], device=context.device)
    if context.is_distributed:
        torch.distributed.all_reduce(throughput)  # every rank's samples/s add up
    if context.is_main:
        metrics = {
            "world_size": context.world_size, "steps": step, "final_loss": final["loss"],
            "accuracy": final["accuracy"], "samples_per_second": throughput.item(),
            "resumed_from_step": resumed_from, "params_sha256": parameters_sha256(model),
        }  # fmt: skip
        print(f"final: loss {final['loss']:.4f}  accuracy {final['accuracy']:.3f}  {throughput.item():.0f} samples/s")
        if args.metrics_json:
            args.metrics_json.write_text(json.dumps(metrics, indent=1))
        if args.save_model:
            torch.save(unwrap(model).state_dict(), args.save_model)
    context.close()


if __name__ == "__main__":
    main()
