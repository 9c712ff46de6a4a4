"""A complete training program on phalanx.Run: correct, resumable, one code path.

Trains a small MLP on scikit-learn's handwritten digits (shipped inside the package), or on the
tutorial's synthetic images, with plain ``python``, ``phalanx run`` or torchrun. With
--checkpoint-dir it resumes exactly where it stopped, also after the workers were restarted; a
finished run's last step is checkpointed, so a larger --epochs continues from there.

    phalanx run --nproc-per-node 2 examples/train.py --epochs 5 --checkpoint-dir ckpt

Every --log-every steps rank 0 shows the global loss, throughput, step time and ETA, and each
epoch's global loss; --metrics-jsonl keeps them, one JSON object per logged step.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import phalanx


def positive(kind: type, *, or_zero: bool = False) -> Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` above zero (or zero too, with ``or_zero``)."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not (value > 0 or (or_zero and value == 0)):
            raise argparse.ArgumentTypeError(f"{text} is not {'zero or ' if or_zero else ''}a positive number")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--dataset", choices=["digits", "synthetic"], default="digits")
    add("--samples", type=positive(int), default=None, help="use the first N samples (default: all)")
    add(
        "--epochs",
        type=positive(int, or_zero=True),
        default=5,
        help="default 5; 0 trains nothing (with --save-model and no checkpoint: saves the initial parameters)",
    )
    add("--batch-size", type=positive(int), default=32, help="per process, as in the tutorial")
    add("--lr", type=positive(float, or_zero=True), default=0.05)
    add("--compression", choices=["none", "fp16", "bf16", "powersgd", "auto"], default="none")
    add("--checkpoint-dir", type=Path, help="save checkpoints here and resume from the newest valid one")
    add(
        "--checkpoint-every",
        type=positive(int),
        default=50,
        metavar="STEPS",
        help="with --checkpoint-dir: a checkpoint every STEPS optimizer steps, at a preemption and at the end (default 50)",
    )
    add("--async-checkpoints", action="store_true", help="write checkpoints in the background")
    add("--seed", type=int, default=0)
    add(
        "--workers",
        type=positive(int, or_zero=True),
        default=0,
        metavar="N",
        help="DataLoader worker processes per rank (default 0); a resume stays exact with any number",
    )
    add(
        "--accumulate",
        type=positive(int),
        default=1,
        metavar="N",
        help="micro-batches of --batch-size per optimizer step (default 1); the gradients all-reduce on the last only. "
        "Global batch: batch size x N x processes",
    )
    add(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="bf16: autocast on CPU or a GPU with bf16; fp16: autocast and loss scaling, CUDA only",
    )
    add(
        "--clip-grad",
        type=positive(float),
        default=None,
        metavar="NORM",
        help="clip the global gradient norm to NORM (the norm before clipping is logged)",
    )
    add(
        "--log-every",
        type=positive(int),
        default=10,
        metavar="STEPS",
        help="report the global loss, throughput and ETA every STEPS optimizer steps (default 10)",
    )
    add(
        "--metrics-jsonl",
        type=Path,
        default=None,
        metavar="PATH",
        help="rank 0 writes one JSON object per logged step; a resumed run continues the file, a fresh run starts it over",
    )
    add(
        "--tensorboard",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write the logged metrics as TensorBoard events (needs the tensorboard package)",
    )
    add("--metrics-json", type=Path, default=None, help="rank 0 writes the final metrics here (run.summary() and more)")
    add("--save-model", type=Path, help="rank 0 saves the final state_dict here")
    args = parser.parse_args()
    for flag in ("metrics_json", "metrics_jsonl", "save_model"):  # before training, not at the end; rank 0 writes them
        path = getattr(args, flag) if os.environ.get("RANK", "0") == "0" else None
        if path is not None and not path.parent.is_dir():
            parser.error(f"--{flag.replace('_', '-')} {path}: the folder {path.parent} does not exist")
    return args


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 handwritten digits (8x8 pixels of 0 to 16, scaled to [0, 1]) and their
    labels, as ``sklearn.datasets.load_digits`` gives them. Read straight from the file the package
    ships: importing scikit-learn costs every process more than a second, as much as torch's own
    import, for a table of 115 KB."""
    package = importlib.util.find_spec("sklearn")
    shipped = Path(package.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if package else None
    if shipped is None or not shipped.is_file():  # another layout: the public, slower way
        from sklearn.datasets import load_digits as load

        digits = load()
        return torch.tensor(digits.data, dtype=torch.float32) / 16.0, torch.tensor(digits.target)
    with gzip.open(shipped, "rt") as table:
        rows = torch.tensor([[int(value) for value in line.split(",")] for line in table if line.strip()])
    return rows[:, :-1].float() / 16.0, rows[:, -1]


def load_dataset(name: str, samples: int | None, seed: int) -> TensorDataset:
    if name == "digits":
        images, labels = load_digits()
    else:  # the tutorial's 3x224x224 images, drawn from a fixed seed so every rank has the same
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(samples or 1000, 3 * 224 * 224, generator=generator)
        labels = (images @ torch.randn(images.shape[1], 10, generator=generator)).argmax(1)
    return TensorDataset(images[:samples], labels[:samples])


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, dataset: TensorDataset, run: phalanx.Run, precision: phalanx.MixedPrecision
) -> dict:
    """Loss and accuracy over the whole dataset, each rank taking its share: a global mean."""
    (images, labels), totals = dataset.tensors, phalanx.GlobalMean(run.context, "loss", "correct")
    for part in torch.arange(len(labels)).tensor_split(run.world_size)[run.rank].split(256):
        with precision.autocast():
            logits = model(images[part].to(run.device)).float()
        target = labels[part].to(run.device)
        totals.add(len(part), loss=torch.nn.functional.cross_entropy(logits, target, reduction="sum"),
                   correct=(logits.argmax(1) == target).sum())  # fmt: skip
    return {"final_loss": (result := totals.compute())["loss"], "accuracy": result["correct"]}


def main() -> None:
    args = parse_args()
    run = phalanx.Run(args.checkpoint_dir, checkpoint_every=args.checkpoint_every, async_checkpoints=args.async_checkpoints,
                      log_every=args.log_every, metrics_jsonl=args.metrics_jsonl, tensorboard=args.tensorboard,
                      accumulate=args.accumulate)  # fmt: skip
    torch.manual_seed(args.seed)
    dataset = load_dataset(args.dataset, args.samples, args.seed)
    network = torch.nn.Sequential(torch.nn.Linear(dataset.tensors[0].shape[1], 128), torch.nn.ReLU(),
                                  torch.nn.Linear(128, int(dataset.tensors[1].max()) + 1))  # fmt: skip
    precision = phalanx.MixedPrecision(args.precision, run.device)  # refuses what the device cannot do
    model = run.setup_model(network, compression=args.compression)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    run.track(optimizer=optimizer, precision=precision)
    loader = run.setup_dataloader(dataset, batch_size=args.batch_size, seed=args.seed, num_workers=args.workers)
    for _epoch in run.epochs(args.epochs):
        for index, (images, labels) in enumerate(loader):
            with run.accumulate(model, index) as micro:
                with precision.autocast():
                    losses = torch.nn.functional.cross_entropy(model(images.to(run.device)), labels.to(run.device),
                                                               reduction="none")  # fmt: skip
                precision.backward(losses.mean(), scale=micro.loss_scale)  # all-reduces on the window's last only
            run.record(losses)  # the padding that evens out the shards is left out of the global loss
            if not micro.sync:
                continue
            if args.clip_grad:
                run.clip_gradients(args.clip_grad)  # unscales fp16 first; the norm is logged
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            run.step()

    metrics = {**run.summary(), **evaluate(network, dataset, run, precision)}
    if run.is_main:
        speed = (
            "no step trained in this run"
            if metrics["samples_per_second"] is None
            else f"{metrics['samples_per_second']:.0f} samples/s"
        )
        print(f"final: loss {metrics['final_loss']:.4f}  accuracy {metrics['accuracy']:.3f}  {speed}")
        if args.metrics_json:
            args.metrics_json.write_text(json.dumps(metrics, indent=1))
        if args.save_model:
            torch.save(network.state_dict(), args.save_model)
    run.close()


if __name__ == "__main__":
    main()
