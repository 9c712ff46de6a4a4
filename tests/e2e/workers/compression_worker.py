"""Trains a small MLP with wrap_model(compression=...) and writes what every rank saw.

    compression_worker.py OUT --compression auto --steps 60 [--checkpoint-dir D --save-at 40 [--stop]]
                          [--no-compression-state] [--rounds 3 --steps-per-round 2 --phases 1 --close 0.25 --screen 1.0]

Each step's batch comes from the step number and rank alone, so a resumed run sees the same
data. After every backward this rank checks the gradient DDP delivered against the true average
(the local gradients of a plain copy of the model, all-reduced): exact for none, within fp16's
rounding for fp16; for powersgd the uncompressed tensors (biases) are exact. Writes OUT/rank<R>.json
with the candidate and the parameter hash after every step, the compression summary and the checks.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx
from phalanx.quick_exit import exit_quickly
from phalanx.runtime.checkpoint import restore_rng_state, rng_state
from phalanx.runtime.compression import AutoTrial
from phalanx.runtime.model import compression_of, parameters_sha256, unwrap, wrap_model

TOLERANCE = {"none": (1e-5, 1e-7), "fp16": (2e-2, 1e-4)}  # (rtol, atol) of the delivered gradient


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step * world + rank)
    images = torch.randn(32, 64, generator=generator)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    return images, (images @ teacher).argmax(1)


def true_average_gradients(reference: torch.nn.Module, model: torch.nn.Module, images, labels) -> list[torch.Tensor]:
    reference.load_state_dict(unwrap(model).state_dict())
    reference.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(reference(images), labels).backward()
    grads = [p.grad.clone() for p in reference.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return grads


def same_on_every_rank(tensor: torch.Tensor) -> bool:
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor.contiguous())
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--compression", default="auto")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--stop", action="store_true", help="exit right after the save")
    parser.add_argument(
        "--no-compression-state", action="store_true", help="control: resume without the checkpoint's compression state"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--phases", type=int, default=1, help="1: the trial's steps do not depend on its timings")
    parser.add_argument("--close", type=float, default=0.25)
    parser.add_argument("--screen", type=float, default=None, help="none by default: a trial of fixed length")
    parser.add_argument("--widths", default="128", help="hidden layer widths; 4096,2048 makes DDP use 2 buckets")
    args = parser.parse_args()

    context = phalanx.init()
    torch.manual_seed(0)
    widths = [64, *map(int, args.widths.split(",")), 10]
    layers: list[torch.nn.Module] = []
    for inputs, outputs in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(inputs, outputs), torch.nn.ReLU()]
    network = torch.nn.Sequential(*layers[:-1])
    reference = copy.deepcopy(network)
    model = wrap_model(network, context, compression=args.compression,
                       trial=AutoTrial(rounds=args.rounds, steps_per_round=args.steps_per_round,
                                       phases=args.phases, close=args.close, screen=args.screen))  # fmt: skip
    compression = compression_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoints = phalanx.CheckpointManager(args.checkpoint_dir, context) if args.checkpoint_dir else None
    step, resumed_from = 0, None
    latest = checkpoints.load_latest() if checkpoints else None
    if latest is not None:
        unwrap(model).load_state_dict(latest.state["model"])
        optimizer.load_state_dict(latest.state["optimizer"])
        if not args.no_compression_state:
            compression.load_state_dict(latest.state["compression"], latest.rank_state["compression"])
        restore_rng_state(latest.rank_state["rng"])
        step = resumed_from = latest.step

    record: dict = {
        "rank": context.rank,
        "used": {},
        "sha_after": {},
        "worst_error": {},
        "biases_exact": True,
        "losses": [],
    }
    while step < args.steps:
        images, labels = batch(step, context.rank, context.world_size)
        expected = true_average_gradients(reference, model, images, labels)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        used = compression.last_used
        record["used"][step] = used
        record["losses"].append(loss.item())
        for parameter, average in zip(model.parameters(), expected):
            assert same_on_every_rank(parameter.grad), f"step {step}: ranks hold different gradients ({used})"
            error = ((parameter.grad - average).abs() / (average.abs() + 1e-3)).max().item()
            record["worst_error"][used] = max(record["worst_error"].get(used, 0.0), error)
            if used in TOLERANCE:
                rtol, atol = TOLERANCE[used]
                torch.testing.assert_close(parameter.grad, average, rtol=rtol, atol=atol, msg=f"step {step} {used}")
            elif parameter.dim() == 1 and step > 5:  # powersgd sends biases uncompressed: their average is exact
                record["biases_exact"] &= torch.allclose(parameter.grad, average, rtol=1e-4, atol=1e-6)
        optimizer.step()
        record["sha_after"][step] = parameters_sha256(model)
        step += 1
        if checkpoints and step == args.save_at:
            state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                     "compression": compression.state_dict()}  # fmt: skip
            checkpoints.save(step, state, {"compression": compression.rank_state_dict(), "rng": rng_state()})
            if args.stop:
                break
    record.update(summary=compression.summary(), resumed_from=resumed_from, steps=step,
                  params_sha256=parameters_sha256(model))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{context.rank}.json").write_text(json.dumps(record, indent=1))
    context.close()


if __name__ == "__main__":
    main()
    exit_quickly(0)  # everything is written: skip the exit's search for cycles (seconds per test)
