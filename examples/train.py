"""A complete training program on the phalanx runtime: correct, resumable, one code path.

Trains a small MLP on scikit-learn's handwritten digits (1797 images of 8x8, shipped inside the
package: nothing is downloaded), or on the tutorial's synthetic images. Run it with plain
``python`` (1 process), ``phalanx run`` or torchrun; with --checkpoint-dir it resumes exactly
where it stopped, also after torchrun restarted the workers (``--max-restarts``). A finished run
leaves a checkpoint of its last step: the same command again trains nothing, and a larger
--epochs continues from there.

    phalanx run --nproc-per-node 2 examples/train.py --epochs 5 --checkpoint-dir ckpt

Every --log-every optimizer steps and at the last, rank 0 shows the global mean loss of the steps
since the previous report, the global throughput, the step time and the ETA (one step later: the
all-reduce runs during that step): a progress bar on a terminal, plain lines in a log. Each
epoch's global loss is shown with the first report after the epoch ended. --metrics-jsonl keeps
the same numbers, one JSON object per logged step (step, epoch counted from 1, loss, samples,
samples_per_second, step_time_s, eta_s, world_size, and grad_norm before clipping with
--clip-grad).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import TensorDataset

import phalanx
from phalanx.exit_codes import ExitCode, exit_quickly
from phalanx.runtime.consistency import check_consistency
from phalanx.runtime.metrics import PendingMeans
from phalanx.runtime.model import COMPRESSIONS, compression_of, parameters_sha256, unwrap, wrap_model
from phalanx.runtime.precision import PRECISIONS
from phalanx.runtime.preemption import PreemptionGuard
from phalanx.runtime.progress import StepMeter, StepReport


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
    parser.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    parser.add_argument("--samples", type=positive(int), default=None, help="use the first N samples (default: all)")
    parser.add_argument("--epochs", type=positive(int, or_zero=True), default=5,
                        help="default 5; 0 trains nothing (with --save-model and no checkpoint: saves the initial parameters)")
    parser.add_argument("--batch-size", type=positive(int), default=32, help="per process, as in the tutorial")
    parser.add_argument("--lr", type=positive(float, or_zero=True), default=0.05)
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="save checkpoints here and resume from the newest valid one on start")
    parser.add_argument("--checkpoint-every", type=positive(int), default=50, metavar="STEPS",
                        help="with --checkpoint-dir: a checkpoint every STEPS optimizer steps, at a preemption and "
                             "at the end (default 50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=positive(int, or_zero=True), default=0, metavar="N",
                        help="DataLoader worker processes per rank (default 0); a resume stays exact with any number")
    parser.add_argument("--accumulate", type=positive(int), default=1, metavar="N",
                        help="micro-batches of --batch-size per optimizer step (default 1); the gradients all-reduce on "
                             "the last only. Global batch: batch size x N x processes")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="bf16: autocast on CPU or a GPU with bf16; fp16: autocast and loss scaling, CUDA only")
    parser.add_argument("--clip-grad", type=positive(float), default=None, metavar="NORM",
                        help="clip the global gradient norm to NORM (the norm before clipping is logged)")
    parser.add_argument("--log-every", type=positive(int), default=10, metavar="STEPS",
                        help="report the global loss, throughput and ETA every STEPS optimizer steps (default 10)")
    parser.add_argument("--metrics-jsonl", type=Path, default=None, metavar="PATH",
                        help="rank 0 writes one JSON object per logged step; a resumed run continues the file, "
                             "a fresh run starts it over")
    parser.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                        help="also write the logged metrics as TensorBoard events (needs the tensorboard package)")
    parser.add_argument("--metrics-json", type=Path, default=None,
                        help="rank 0 writes the final metrics here (samples_per_second: null when the run trained no step; "
                             "compression: what ran and, for auto, what its trial measured)")
    parser.add_argument("--save-model", type=Path, default=None, help="rank 0 saves the final state_dict here")
    args = parser.parse_args()
    for flag in ("metrics_json", "metrics_jsonl", "save_model"):  # before training, not at the end; rank 0 writes them
        path = getattr(args, flag) if os.environ.get("RANK", "0") == "0" else None
        if path is not None and not path.parent.is_dir():
            parser.error(f"--{flag.replace('_', '-')} {path}: the folder {path.parent} does not exist")
    return args


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


def build_model(dataset: TensorDataset) -> torch.nn.Module:
    features, classes = dataset.tensors[0].shape[1], int(dataset.tensors[1].max()) + 1
    return torch.nn.Sequential(torch.nn.Linear(features, 128), torch.nn.ReLU(), torch.nn.Linear(128, classes))


def real_mean_loss(loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, real: int) -> torch.Tensor:
    """The mean loss over a batch's first ``real`` samples, for the metrics. Only a rank's last
    batch of an epoch can hold padding (the samples that even out the shards), which would
    otherwise count twice; the loop calls this for such a batch only, and every other batch
    reuses the mean loss the gradient came from, at no cost."""
    if real == 0:  # GlobalMean.add_mean leaves a batch of 0 real samples out
        return loss
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(logits[:real].float(), labels[:real])


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, dataset: TensorDataset, context: phalanx.DistributedContext, precision: phalanx.MixedPrecision
) -> dict[str, float]:
    """Loss and accuracy over the whole dataset, each rank taking its share: a global mean."""
    totals = phalanx.GlobalMean(context, "loss", "correct")
    images, labels = dataset.tensors
    for part in torch.arange(len(labels)).tensor_split(context.world_size)[context.rank].split(256):
        with precision.autocast():
            logits = model(images[part].to(context.device)).float()
        target = labels[part].to(context.device)
        loss = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
        totals.add(len(part), loss=loss, correct=(logits.argmax(1) == target).sum())
    result = totals.compute()
    return {"loss": result["loss"], "accuracy": result["correct"]}


class EpochEnd(NamedTuple):
    """An epoch that ended since the last logging point: its global loss comes with the next one."""

    epoch: int
    step: int
    first_sample: int  # where the epoch began on this rank (not 0: resumed mid-epoch)
    totals: torch.Tensor  # this rank's running totals when it ended (GlobalMean.snapshot)


class LoggingPoint(NamedTuple):
    """A logging point whose all-reduce is in flight."""

    totals: PendingMeans
    epoch_ends: tuple[EpochEnd, ...]  # reduced in the same collective, shown first
    step: int | None = None  # None: it only reduces epoch ends (before a checkpoint or a stop)
    epoch: int = 0
    ended_at: float = 0.0  # the meter's clock when the step ended
    grad_norm: torch.Tensor | None = None


class Reporter:
    """The logging points: every --log-every steps and at the last, the global loss of the steps
    since the previous one, rates, the progress display and the metrics files; and the global
    loss of each epoch.

    One running sum for the whole run; adding to it is the only per-batch cost. A logging point
    adds its sums to the boundary's shared all-reduce (:meth:`start`; the preemption vote joins
    it, and the loop starts it) and is shown at the next step boundary (:meth:`finish`), so the
    round trip overlaps a step instead of holding every rank. Consecutive sums differ by
    the window's loss, the sums at two epoch ends by the epoch's. An epoch's end only keeps this
    rank's sums aside (:meth:`end_epoch`); they are reduced with the next logging point's, in the
    same collective: on a small model with short epochs, a collective per epoch was a measurable
    share of the step time.

    A checkpoint carries the global running sums (:meth:`checkpoint_state`), so that a resumed
    run's first report and epoch line cover the same steps, with the same loss, as an
    uninterrupted run's, also after a stop between two logging points.
    """

    def __init__(
        self, args: argparse.Namespace, context: phalanx.DistributedContext, total_steps: int, step: int,
        boundary: phalanx.SharedReduction,
    ) -> None:  # fmt: skip
        self.context, self.epochs, self.total_steps, self.boundary = context, args.epochs, total_steps, boundary
        self.totals = phalanx.GlobalMean(context, "loss")
        self._logged = self._epoch_logged = (0.0, 0.0)  # (loss sum, samples) at the last point, at the last epoch end
        self._logged_step: int | None = None
        self._carried: tuple[float, float] | None = None  # the running sums of the run resumed from, when it stopped
        self._measured = 0.0  # the running sample count at the meter's last reading
        self._pending: LoggingPoint | None = None
        self._epoch_ends: list[EpochEnd] = []
        self.meter = StepMeter(total_steps, start_step=step)
        self.progress = phalanx.ProgressReporter(total_steps, enabled=context.is_main)
        self.files = phalanx.MetricsLog(jsonl=args.metrics_jsonl, tensorboard=args.tensorboard,
                                        continue_from_step=step, enabled=context.is_main)  # fmt: skip

    def end_epoch(self, epoch: int, step: int, first_sample: int) -> None:
        """No collective: the epoch's loss is shown with the next logging point."""
        self._epoch_ends.append(EpochEnd(epoch, step, first_sample, self.totals.snapshot()))

    def start(self, step: int, epoch: int, grad_norm: torch.Tensor | None) -> None:
        """Adds the sums to the boundary's all-reduce (every rank reaches the same logging points)."""
        self.finish()
        ended_at = self.meter.clock()
        point = self._reduce(self.boundary)
        self._pending = point._replace(step=step, epoch=epoch, ended_at=ended_at, grad_norm=grad_norm)

    def _reduce(self, shared: phalanx.SharedReduction | None = None) -> LoggingPoint:
        """The sums now and at the epoch ends since the last point, in ``shared`` or reduced at once."""
        ends, self._epoch_ends = tuple(self._epoch_ends), []
        return LoggingPoint(self.totals.compute_async(*(end.totals for end in ends), shared=shared), ends)

    def finish(self) -> None:
        """Shows the logging point in flight, if any: call it at every step boundary."""
        if self._pending is None:
            return
        point, self._pending = self._pending, None
        for end, totals in zip(point.epoch_ends, point.totals.snapshot_results()):
            running = self._running(totals)
            epoch_loss, _ = mean_between(self._epoch_logged, running)
            self._epoch_logged = running
            # A checkpoint without the sums (an older one): the loss covers only the resumed part.
            resumed_without_sums = end.first_sample and self._carried is None
            note = f" (resumed at sample {end.first_sample}; the loss covers the samples from there)" if resumed_without_sums else ""
            self.progress.write(f"epoch {end.epoch + 1}/{self.epochs}  step {end.step}  loss {epoch_loss:.4f}{note}")
        if point.step is None:
            return
        running = self._running(point.totals.result())
        loss, samples = mean_between(self._logged, running)
        self._logged, self._logged_step = running, point.step
        # the rate counts only the samples this run trained, not those carried from a checkpoint
        rates = self.meter.measure(point.step, running[1] - self._measured, at=point.ended_at)
        self._measured = running[1]
        report = StepReport(
            step=point.step, total_steps=self.total_steps, epoch=point.epoch + 1, epochs=self.epochs, loss=loss,
            samples=int(samples), samples_per_second=rates.samples_per_second, step_time_s=rates.step_time_s,
            eta_s=rates.eta_s, grad_norm=None if point.grad_norm is None else float(point.grad_norm),
        )  # fmt: skip
        self.progress.update(report)
        self.files.write({**report.record(), "world_size": self.context.world_size})

    def settle(self) -> None:
        """Shows everything up to now, before a checkpoint or a stop: the logging point in flight,
        then the epochs ended since (a collective of their own, on every rank alike)."""
        self._settle(reduce_totals=False)

    def _settle(self, reduce_totals: bool) -> tuple[float, float] | None:
        """:meth:`settle`; with ``reduce_totals`` always a collective. The running sums now, when reduced."""
        self.finish()
        if not (self._epoch_ends or reduce_totals):
            return None
        point = self._pending = self._reduce()
        self.finish()
        return self._running(point.totals.result())

    def checkpoint_state(self, step: int) -> dict[str, tuple[float, float]]:
        """:meth:`settle`, then the global running sums a resumed run continues from: now, at the
        last logging point and at the last epoch end. One collective (the settling's, when epoch
        ends wait), none at a logging point, whose sums are known: the same on every rank, which
        step in lockstep."""
        self.finish()
        now = self._settle(reduce_totals=step != self._logged_step)
        return {"running": self._logged if now is None else now, "logged": self._logged, "epoch_logged": self._epoch_logged}

    def load_checkpoint_state(self, state: dict[str, tuple[float, float]]) -> None:
        """Continues the sums of :meth:`checkpoint_state`: the next report and epoch line cover the
        steps since the last ones before the checkpoint."""
        self._carried, self._logged, self._epoch_logged = state["running"], state["logged"], state["epoch_logged"]
        self._measured = self._carried[1]

    def _running(self, totals: dict[str, float]) -> tuple[float, float]:
        """The run's running (loss sum, samples) from a GlobalMean result, the carried ones included."""
        loss_sum, samples = running_sums(totals)
        carried_loss, carried_samples = self._carried or (0.0, 0.0)
        return carried_loss + loss_sum, carried_samples + samples

    def close(self) -> None:
        """:meth:`settle` (a collective when epoch ends wait), then closes the display and files."""
        self.settle()
        self.progress.close()
        self.files.close()


def running_sums(totals: dict[str, float]) -> tuple[float, float]:
    """(loss sum, samples) from a GlobalMean result."""
    return (totals["loss"] * totals["samples"] if totals["samples"] else 0.0), totals["samples"]


def mean_between(earlier: tuple[float, float], later: tuple[float, float]) -> tuple[float, float]:
    """The mean loss and the sample count between two running (loss sum, samples) totals."""
    samples = later[1] - earlier[1]
    return ((later[0] - earlier[0]) / samples if samples else float("nan")), samples


def main() -> None:
    args = parse_args()
    context = phalanx.init()
    torch.manual_seed(args.seed)
    dataset = load_dataset(args.dataset, args.samples, args.seed)
    network = build_model(dataset)
    check_consistency(context, model=network, dataset=dataset)  # before DDP could hang on a mismatch
    precision = phalanx.MixedPrecision(args.precision, context.device)  # refuses what the device cannot do
    model = wrap_model(network, context, compression=args.compression)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = phalanx.ResumableSampler(len(dataset), rank=context.rank, world_size=context.world_size, seed=args.seed)
    loader = phalanx.ResumableLoader(dataset, sampler, batch_size=args.batch_size, num_workers=args.workers)
    checkpoints = phalanx.CheckpointManager(args.checkpoint_dir, context) if args.checkpoint_dir else None

    step, resumed_from = 0, None
    latest = checkpoints.load_latest() if checkpoints else None
    if latest is not None:
        unwrap(model).load_state_dict(latest.state["model"])
        optimizer.load_state_dict(latest.state["optimizer"])
        loader.load_state_dict(latest.state["sampler"])
        precision.load_state_dict(latest.state.get("precision", {}))
        if "compression" in latest.state:  # auto's choice, PowerSGD's error feedback
            compression_of(model).load_state_dict(latest.state["compression"])
        if latest.rng is not None:
            phalanx.runtime.checkpoint.restore_rng_state(latest.rng)
        step = resumed_from = latest.step

    micro_batches_per_epoch = math.ceil(sampler.num_samples / args.batch_size)
    total_steps = args.epochs * math.ceil(micro_batches_per_epoch / args.accumulate)
    # The logging points' global loss and the preemption vote share one all-reduce per boundary.
    boundary = phalanx.SharedReduction(context)
    reporter = Reporter(args, context, total_steps, step, boundary)
    if latest is not None:
        if "reporter" in latest.state:
            reporter.load_checkpoint_state(latest.state["reporter"])
        finished = loader.resume_point[0] >= args.epochs
        done = "; the training had finished: nothing is left to train (a larger --epochs trains on)" if finished else ""
        reporter.progress.write(f"resumed from step {step} ({latest.path}){done}")
    preemption = PreemptionGuard(context)  # SIGTERM / SIGUSR1: every rank stops after the same step

    def save_checkpoint() -> None:
        """A collective: every rank saves after the same step."""
        reporter_state = reporter.checkpoint_state(step)  # settles: every logged step and epoch to here is shown
        checkpoints.save(step, {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                                "sampler": loader.state_dict(), "precision": precision.state_dict(),
                                "compression": compression_of(model).state_dict(), "reporter": reporter_state})  # fmt: skip

    started, trained, saved_step, stop = time.perf_counter(), 0, step, False
    while loader.resume_point[0] < args.epochs:
        epoch, epoch_start = loader.resume_point  # (epoch, sample) where this pass starts
        # Checkpoints fall on optimizer steps, so a resumed epoch starts at a window boundary.
        micro_batches = math.ceil((sampler.num_samples - epoch_start) / args.batch_size)
        real_before = loader.real_delivered
        for index, (images, labels) in enumerate(loader):
            images, labels = images.to(context.device), labels.to(context.device)
            with phalanx.accumulate(model, index, args.accumulate, total=micro_batches) as micro:
                with precision.autocast():
                    logits = model(images)
                    loss = torch.nn.functional.cross_entropy(logits, labels)
                precision.backward(loss, scale=micro.loss_scale)  # all-reduces on the window's last only
            batch = labels.shape[0]  # (len() of a tensor runs Python code: this is read every step)
            trained += batch
            real = loader.real_delivered - real_before
            real_before += real
            reporter.totals.add_mean(real, loss=loss if real == batch else real_mean_loss(loss, logits, labels, real))
            if not micro.sync:
                continue
            grad_norm = None
            if args.clip_grad:
                precision.unscale(optimizer)
                grad_norm = phalanx.clip_gradients(model, args.clip_grad)
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            context.mark_step(step)
            reporter.finish()  # the previous boundary's logging point: its all-reduce ran during this step
            if index + 1 == micro_batches:
                reporter.end_epoch(epoch, step, epoch_start)
            if step % args.log_every == 0 or step == total_steps:
                reporter.start(step, epoch, grad_norm)
            # A stop agreed on after the last step finds the training complete: the run ends as a
            # finished one does (exit 0, final metrics) instead of asking for a relaunch.
            stop = preemption.should_stop(boundary)
            boundary.start()  # the all-reduce of the logging point and the vote runs during the next step
            preempted = stop and loader.resume_point[0] < args.epochs
            if checkpoints and (preempted or step % args.checkpoint_every == 0):
                save_checkpoint()
                saved_step = step
            if preempted:
                reporter.settle()  # without --checkpoint-dir too: every logged step before the notice
                saved = "checkpoint saved" if checkpoints else "no --checkpoint-dir, nothing saved"
                reporter.progress.write(f"preempted by {preemption.received.name if preemption.received else 'another rank'} "
                                        f"after step {step}; {saved}")  # fmt: skip
                reporter.close()
                context.close()
                raise SystemExit(ExitCode.PREEMPTED)
    if checkpoints and saved_step != step:  # the end too: the same command again trains nothing
        save_checkpoint()
    if stop or preemption.received is not None:  # (a stop before the end left the loop above)
        signal_name = preemption.received.name if preemption.received else "a preemption signal (to another rank)"
        reporter.progress.write(f"{signal_name} came after the last step: the training is complete, "
                                "so it finishes instead of stopping")  # fmt: skip
    reporter.close()

    elapsed = time.perf_counter() - started
    final = evaluate(unwrap(model), dataset, context, precision)
    throughput = torch.tensor([trained / elapsed if elapsed > 0 else 0.0], device=context.device)
    if context.is_distributed:
        torch.distributed.all_reduce(throughput)  # every rank's samples/s add up
    if context.is_main:
        rate = None if step == (resumed_from or 0) else throughput.item()  # None: this run trained no step
        metrics = {
            "world_size": context.world_size, "steps": step, "final_loss": final["loss"],
            "accuracy": final["accuracy"], "samples_per_second": rate,
            "resumed_from_step": resumed_from, "params_sha256": parameters_sha256(model),
            "compression": compression_of(model).summary(),  # what ran; for auto, what its trial measured
        }  # fmt: skip
        speed = "no step trained in this run" if rate is None else f"{rate:.0f} samples/s"
        print(f"final: loss {final['loss']:.4f}  accuracy {final['accuracy']:.3f}  {speed}")
        if args.metrics_json:
            args.metrics_json.write_text(json.dumps(metrics, indent=1))
        if args.save_model:
            torch.save(unwrap(model).state_dict(), args.save_model)
    context.close()


if __name__ == "__main__":
    main()
    # Everything is closed and written: skip the exit's search of every live object for cycles,
    # about 2 s of CPU per process with torch imported (phalanx.exit_codes.exit_quickly).
    exit_quickly(ExitCode.OK)
