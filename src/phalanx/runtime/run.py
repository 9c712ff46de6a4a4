"""``phalanx.Run``: one object that sets up, logs, checkpoints and resumes a training loop.

It composes the runtime's parts (context, DDP wrapping, resumable data, shared all-reduce of the
logging points and the preemption vote, sharded checkpoints) behind a few calls, so that a
plain DDP script gains exact mid-epoch resume, agreed preemption and global metrics with about
about ten changed lines. Each part stays public for loops that need another shape.
"""

from __future__ import annotations

import atexit
import gc
import math
import numbers
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from phalanx.errors import SettingsRefused
from phalanx.exit_codes import ExitCode
from phalanx.runtime.checkpoint import CheckpointManager, restore_rng_state, rng_state
from phalanx.runtime.consistency import check_consistency
from phalanx.runtime.context import DistributedContext, init
from phalanx.runtime.data import ResumableLoader, ResumableSampler
from phalanx.runtime.gradients import MicroStep, accumulate, check_max_norm, clip_gradients
from phalanx.runtime.heal.hook import PeerFailed, raised_by_a_collective, share_buffers
from phalanx.runtime.heal.rollback import check_settings, rollback_states
from phalanx.runtime.model import compression_of, parameters_sha256, unwrap, wrap_model
from phalanx.runtime.precision import MixedPrecision
from phalanx.runtime.preemption import PreemptionGuard
from phalanx.runtime.reporter import Reporter
from phalanx.runtime.shared_reduction import SharedReduction
from phalanx.runtime.survivor import STATELESS_COMPRESSIONS, StepKeeper, StepMark, StepSeeding, agreed_start, described
from phalanx.worker_env import WorkerEnv, heal_armed_of, launcher_takeover

#: What run.setup_dataloader() takes over from a DataLoader, besides its dataset, batch size and shuffling.
_LOADER_OPTIONS = ("num_workers", "collate_fn", "pin_memory", "drop_last", "worker_init_fn", "generator",
                   "persistent_workers", "prefetch_factor", "timeout", "multiprocessing_context")  # fmt: skip
#: The names run.track() leaves to the Run itself.
_RESERVED = ("compression", "reporter", "step_seed", "buffers_rank")


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint can hold: an object with ``state_dict()`` and ``load_state_dict()``.

    Models, optimizers, LR schedulers and GradScalers are Stateful; so is any object of yours
    with the two methods. ``state_dict()`` returns tensors and plain values (numbers, strings,
    lists, tuples, dicts); ``load_state_dict(state)`` restores them in place.

    Example::

        class EMA:
            def __init__(self, decay: float) -> None:
                self.decay, self.value = decay, torch.zeros(())

            def state_dict(self) -> dict:
                return {"decay": self.decay, "value": self.value}

            def load_state_dict(self, state: dict) -> None:
                self.decay, self.value = state["decay"], state["value"]

        assert isinstance(EMA(0.99), phalanx.Stateful)
        run.track(ema=EMA(0.99))
    """

    def state_dict(self) -> dict[str, Any]:
        """The object's state to checkpoint.

        Returns:
            A dict of tensors and plain values (numbers, strings, lists, tuples, dicts).
        """
        ...

    def load_state_dict(self, state: dict[str, Any]) -> Any:
        """Restores the object in place from what its :meth:`state_dict` returned.

        Args:
            state: the dict a checkpoint saved.
        """
        ...


class Run:
    """A training run: the model in DDP, resumable data, global metrics, checkpoints, preemption.

    Args:
        checkpoint_dir: where checkpoints go and the run resumes from (the newest complete one).
            None: no checkpoints; a preemption still stops every rank after the same step.
        checkpoint_every: a checkpoint every this many optimizer steps; also at a preemption
            and after the last step.
        keep: complete checkpoints kept.
        async_checkpoints: write checkpoints in the background; the step waits only for a copy
            of the state to host memory.
        log_every: a logging point every this many steps, and at the last: the global mean
            loss since the previous one, throughput, step time and ETA, shown on rank 0 and
            written to ``metrics_jsonl`` and ``tensorboard``.
        metrics_jsonl: a file of one JSON object per logging point (rank 0 writes it; a
            resumed run continues it).
        tensorboard: a folder for TensorBoard events (needs the tensorboard package).
        accumulate: micro-batches per optimizer step (see :meth:`accumulate`).
        keep_last_step: with a checkpoint folder, when a step fails (a peer died), the ranks
            that survive keep the state after the last completed step in it, and a restart
            resumes there: the failed step is trained again, not everything since the last
            checkpoint. The random state is then seeded from (seed, rank, step) after every
            step, so that a restart rebuilds it for the ranks that died (from (seed, step) where
            every rank started with the same random state: they keep drawing alike). Off with
            PowerSGD or auto compression, whose per-rank state no survivor holds.
        context: the job; default :func:`phalanx.init` (it joins the process group, or uses the
            one the script created).

    Raises:
        SettingsRefused: the checkpoint folder cannot be used (a file, not writable, a full
            disk), before the first step.

    Example::

        run = phalanx.Run(checkpoint_dir="ckpt")
        model = run.setup_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        run.track(optimizer=optimizer)
        loader = run.setup_dataloader(dataset, batch_size=32)
        for epoch in run.epochs(5):
            for images, labels in loader:
                loss = F.cross_entropy(model(images.to(run.device)), labels.to(run.device))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                run.step(loss)
        run.close()
    """

    def __init__(
        self, checkpoint_dir: str | Path | None = None, *, checkpoint_every: int = 50, keep: int = 3,
        async_checkpoints: bool = False, log_every: int = 10, metrics_jsonl: str | Path | None = None,
        tensorboard: str | Path | None = None, accumulate: int = 1, keep_last_step: bool = True,
        context: DistributedContext | None = None,
    ) -> None:  # fmt: skip
        for name, value in (
            ("checkpoint_every", checkpoint_every),
            ("log_every", log_every),
            ("accumulate", accumulate),
        ):
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r}: a number of steps of at least 1")
        self._owns_context = context is None
        self.context = context or init()
        self.checkpoint_every, self.log_every, self.micro_batches = checkpoint_every, log_every, accumulate
        self._files = {"metrics_jsonl": metrics_jsonl, "tensorboard": tensorboard}
        self.checkpoints = (CheckpointManager(checkpoint_dir, self.context, keep=keep, async_save=async_checkpoints)
                            if checkpoint_dir is not None else None)  # fmt: skip
        self._tracked: dict[str, Stateful] = {}
        self._model: torch.nn.Module | None = None
        self._loader: ResumableLoader | None = None
        self._boundary = SharedReduction(self.context)
        self._preemption = PreemptionGuard(self.context)  # every rank stops after the same step
        self._reporter: Reporter | None = None
        self._values: dict[str, torch.Tensor | float] = {}
        self.global_step = 0
        self.resumed_from: int | None = None
        self.total_steps = 0
        self._restored = self._closed = self._stop = self._said_unfinished = False
        self._said_no_loss = self._said_no_forward = False
        self._forwards: _Forwards | None = None  # with DDP's wrapper
        self._epoch, self._epochs = 0, 0
        self._saved_step: int | None = None  # the step of the newest checkpoint this run saved or resumed from
        self._real_seen = self._trained = 0
        self._started = 0.0
        self._carried_reporter: dict[str, Any] | None = None
        self._resumed_path: Path | None = None
        self._keep_last_step = keep_last_step
        self._carried_seeding: dict[str, Any] | None = None  # the per-step random state's, from a checkpoint
        self._keeper: StepKeeper | None = None
        #: Whether this process replaces a rank that died, until its restore healed it from a peer.
        self._replacing = self.context.healing is not None and self.context.healing.replacement
        self._heal_launch: int | None = None  # a replacement's launch token, from the heal
        if self.context.healing is not None:
            check_settings(self.checkpoints is not None, keep_last_step, async_checkpoints, accumulate)
            # A signal ends a wait for a generation (a replacement's restore may heal again too).
            self.context.healing.generations.stopping = lambda: self._preemption.received is not None

    # -- properties ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """This rank's device: its GPU (LOCAL_RANK), or the CPU."""
        return self.context.device

    @property
    def rank(self) -> int:
        """This process's global rank, from 0 to ``world_size - 1``."""
        return self.context.rank

    @property
    def world_size(self) -> int:
        """The number of processes in the job (1 for a plain ``python train.py``)."""
        return self.context.world_size

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the rank that prints and writes files."""
        return self.context.is_main

    # -- set-up -------------------------------------------------------------------------------

    def setup_model(self, module: torch.nn.Module, *, compression: str = "none") -> torch.nn.Module:
        """The model on this rank's device, in DDP with more than one process, and checkpointed.

        The ranks first compare their models (structure and parameter shapes) and stop with a
        report that names the ones that differ, where DDP would hang or fail obscurely.

        Args:
            module: the model.
            compression: the gradients' compression in the all-reduce: none, fp16, bf16,
                powersgd, or auto (times them on the first steps and keeps the fastest).

        Returns:
            The module to train (DDP's wrapper with more than one process).

        Raises:
            SettingsRefused: an unknown compression, or one the backend cannot run.
            InconsistentRanks: the ranks' models differ (structure, parameter shapes).

        Example::

            model = run.setup_model(torch.nn.Linear(10, 2), compression="fp16")
        """
        self._refuse_after_restore("setup_model")
        self._refuse_tracked("model", self._model, "setup_model", module)
        if not self._replacing:
            check_consistency(self.context, model=module)
        self._model = wrap_model(module, self.context, compression=compression)
        self._tracked["model"] = unwrap(self._model)
        if self._model is not self._tracked["model"]:  # DDP's wrapper: a forward around it averages nothing
            self._forwards = _Forwards()
            self._model.register_forward_pre_hook(self._forwards)
        return self._model

    def setup_dataloader(self, data: Dataset | DataLoader, batch_size: int | None = None, *,
                         shuffle: bool | None = None, seed: int | None = None, drop_last: bool | None = None,
                         **loader_options: Any) -> ResumableLoader:  # fmt: skip
        """A loader over this rank's shard that resumes at the exact next batch.

        Args:
            data: a map-style Dataset, or a DataLoader whose dataset, batch size, shuffling
                (with a DistributedSampler: its seed), drop_last and workers are taken over.
            batch_size: samples per batch and process (required with a Dataset).
            shuffle, seed, drop_last: as torch's DistributedSampler; given, they replace a
                DataLoader's (default: the DataLoader's, else shuffled, seed 0, no drop).
            loader_options: other DataLoader arguments (num_workers, collate_fn, pin_memory...).

        Returns:
            A :class:`~phalanx.ResumableLoader`; its position is checkpointed, and each epoch
            reshuffles by itself (no ``set_epoch`` needed).

        Raises:
            InconsistentRanks: the ranks' datasets have different lengths.
            SettingsRefused: an IterableDataset, or a DataLoader with another sampling.

        Example::

            loader = run.setup_dataloader(dataset, batch_size=32, num_workers=2)
        """
        self._refuse_after_restore("setup_dataloader")
        self._refuse_tracked("data", self._loader, "setup_dataloader")
        if isinstance(data, IterableDataset) or isinstance(getattr(data, "dataset", None), IterableDataset):
            raise SettingsRefused(
                "run.setup_dataloader() with an IterableDataset",
                "the run's loader shards a dataset by index and resumes at the exact next batch, which an iterable "
                "dataset cannot do.",
                "give a map-style Dataset (with __len__ and __getitem__), or keep your loader and checkpoint its "
                "position yourself (run.track)",
            )
        if isinstance(data, DataLoader):
            sampler = data.sampler
            if (
                not isinstance(sampler, (RandomSampler, SequentialSampler, DistributedSampler))
                or data.batch_size is None
            ):
                batching = (
                    ""
                    if data.batch_size is not None
                    else (
                        " and a batch_sampler"
                        if data.batch_sampler is not None
                        else " and batch_size=None (no batches)"
                    )
                )
                raise SettingsRefused(
                    f"a DataLoader with a {type(sampler).__name__}{batching}",
                    "the loader from run.setup_dataloader() shards the data as DistributedSampler does, shuffled or not, "
                    "to resume at the exact next batch: another sampling would be dropped without a word.",
                    "pass the dataset and batch size to run.setup_dataloader(), or keep your loader and checkpoint its "
                    "position yourself (run.track)",
                )  # fmt: skip
            if shuffle is None:
                shuffle = isinstance(sampler, RandomSampler) or (
                    isinstance(sampler, DistributedSampler) and sampler.shuffle
                )
            if seed is None and isinstance(sampler, DistributedSampler):
                seed = sampler.seed
            taken = {name: getattr(data, name) for name in _LOADER_OPTIONS}
            if data.num_workers == 0:
                taken.pop("prefetch_factor")  # DataLoader refuses it without workers
            batch_size = batch_size or data.batch_size
            drop_last = data.drop_last if drop_last is None else drop_last
            loader_options = {**taken, **loader_options}
            data = data.dataset
        shuffle, seed, drop_last = True if shuffle is None else bool(shuffle), seed or 0, bool(drop_last)
        loader_options["drop_last"] = drop_last
        if batch_size is None:
            raise ValueError("batch_size: how many samples per batch and process (a Dataset has no batch size)")
        if not self._replacing:
            check_consistency(self.context, dataset=data)
        sampler = ResumableSampler(len(data), rank=self.rank, world_size=self.world_size, seed=seed, shuffle=shuffle,
                                   drop_last=drop_last)  # type: ignore[arg-type]  # fmt: skip
        self._loader = ResumableLoader(data, sampler, batch_size=batch_size, **loader_options)
        self._tracked["data"] = self._loader
        return self._loader

    def track(self, **objects: Stateful) -> None:
        """Adds objects to the checkpoint, each under its name; restored in place on resume.

        Args:
            objects: Stateful objects: an optimizer, an LR scheduler, a GradScaler, a
                :class:`~phalanx.MixedPrecision`, or your own (see :class:`Stateful`).

        Example::

            run.track(optimizer=optimizer, scheduler=scheduler, ema=ema)
        """
        self._refuse_after_restore("track")
        for name, value in objects.items():
            if name in _RESERVED or (name in ("model", "data") and name in self._tracked):
                raise ValueError(
                    f"track({name}=...): the run keeps its own {name!r} in the checkpoint; pick another name"
                )
            if isinstance(value, type):
                raise TypeError(f"{name}: the class {value.__name__}, not an object of it: pass {value.__name__}(...)")
            if not isinstance(value, Stateful):
                raise TypeError(f"{name}: a {type(value).__name__} has no state_dict()/load_state_dict() to checkpoint")
            # DDP's wrapper saves its module's keys under "module.": a run of one process would not find them
            self._tracked[name] = unwrap(value) if isinstance(value, torch.nn.Module) else value
            if self.context.healing is not None:
                self.context.healing.guard(value)

    # -- the loop -----------------------------------------------------------------------------

    def restore(self) -> int | None:
        """Restores every tracked object, the RNGs and the logging from the newest checkpoint.

        :meth:`epochs` calls it first; call it yourself to know the step before the loop.

        Returns:
            The step resumed from, or None for a fresh start. Once per run.

        Raises:
            SettingsRefused: the checkpoint cannot be resumed with these settings (another
                batch size; node-local folders of which some lack the newest checkpoint).

        Example::

            start = run.restore()
            print("fresh start" if start is None else f"resuming after step {start}")
        """
        if self._restored:
            return self.resumed_from
        self._restored = True
        if self._replacing:
            return self._restore_from_peer()
        if self.checkpoints is None:
            return None
        state = self._state_to_save()
        self.checkpoints.check(state, self._rank_state())
        latest = self.checkpoints.load_latest(into=state)
        if latest is None:
            return None
        missing = [name for name in self._tracked if name not in latest.state]
        if missing:  # a renamed track() name would start that object afresh without a word
            self.print(f"phalanx: the checkpoint has no {', '.join(missing)} (it has {', '.join(sorted(latest.state))}): "
                       f"{'they start' if len(missing) > 1 else 'it starts'} afresh")  # fmt: skip
        self._load_tracked(latest.state, source=latest.path)
        if latest.world_size != self.world_size:
            self._say_world_changed(latest.world_size)
        own = latest.rank_state
        if self._model is not None and "compression" in latest.state:
            compression_of(self._model).load_state_dict(latest.state["compression"], own and own.get("compression"))
        if own is not None:
            restore_rng_state(own["rng"])
        if "buffers_rank" in latest.state:
            self.print(f"phalanx: the state after step {latest.step} was kept by rank {latest.state['buffers_rank']} before "
                       "the next forward shared rank 0's buffers: its buffers (BatchNorm's running statistics) are that "
                       "rank's, which may differ from rank 0's by one batch's update; the parameters are exact")  # fmt: skip
        self._carried_reporter = latest.state.get("reporter")
        self._carried_seeding = latest.state.get("step_seed")
        self.global_step = self.resumed_from = latest.step
        # A survivor's state is no checkpoint: the step is saved again at its cadence.
        self._saved_step = None if latest.survivor else latest.step
        self._resumed_path = latest.path
        return latest.step

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs left to train, from where the newest checkpoint stopped.

        Restores first (:meth:`restore`). After the last epoch it saves a final checkpoint, so
        the same command again trains nothing and a larger ``count`` continues.

        Args:
            count: the number of epochs of the whole training.

        Yields:
            Epoch numbers from 0; a resumed epoch continues at its next batch. An epoch whose
            loop ended before its last batch (a ``break``) is yielded again, to go on from there.

        Raises:
            RuntimeError: a loop over the epoch took no batch from the run's loader.
            SettingsRefused: an epoch has no batch on this rank.
        """
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"run.epochs({count!r}): a whole number of epochs, 0 or more")
        count = int(count)
        if self._loader is None:
            raise RuntimeError("run.epochs() needs the loader from run.setup_dataloader()")
        if _batches(self._loader, 0) == 0:
            sampler = self._loader.sampler
            raise SettingsRefused(
                f"the loader gives this rank no batch an epoch: {sampler.num_samples} samples a rank, batches of "
                f"{self._loader.batch_size} with drop_last",
                "an epoch would train nothing.",
                "give the loader more samples or a smaller batch size, or drop_last=False",
            )
        self.restore()
        self._epochs = count
        self.total_steps = self._steps_to_the_end()
        self._reporter = Reporter(self.context, epochs=count, total_steps=self.total_steps, step=self.global_step,
                                  boundary=self._boundary, **self._files)  # fmt: skip
        if self._carried_reporter is not None:
            self._reporter.load_checkpoint_state(self._carried_reporter)
        if self.resumed_from is not None and self._resumed_path is not None:  # (a heal said its own line)
            done = (
                "; the training had finished: nothing is left to train (more epochs train on)" if self._finished else ""
            )
            self.print(f"resumed from step {self.resumed_from} ({self._resumed_path}){done}")
        if self._keeper is not None:  # an earlier run.epochs() left by a break
            self._keeper.release()
        self._keeper = self._start_keeping()
        self._real_seen, self._started = self._loader.real_delivered, time.perf_counter()
        while not self._finished:
            self._epoch, before = self._loader.resume_point[0], self._loader.resume_point
            yield self._epoch
            if self._finished or self._loader.resume_point[0] != self._epoch:
                continue
            if self._loader.resume_point == before:
                raise RuntimeError(
                    f"run.epochs(): the loop over epoch {self._epoch + 1} took no batch from the loader that "
                    "run.setup_dataloader() returned last, and epochs() yields an epoch until that loader has "
                    "delivered all its batches: iterate that loader, not the DataLoader given to setup_dataloader"
                )
            if not self._said_unfinished:
                self._said_unfinished = True
                self.print(f"phalanx: epoch {self._epoch + 1} goes on from where its loop left it (a break): "
                           "run.epochs() yields an epoch until its loader delivered every batch; to train fewer "
                           "batches an epoch, give setup_dataloader fewer samples (torch.utils.data.Subset)")  # fmt: skip
        self._end()

    def _steps_to_the_end(self) -> int:
        """The run's steps: those done, and those the epochs left take in this world (a resume
        with another world size, or a world that shrank in heal mode, changes the count)."""
        assert self._loader is not None
        epoch, position = self._loader.resume_point
        if epoch >= self._epochs:
            return self.global_step
        per_epoch = math.ceil(_batches(self._loader, 0) / self.micro_batches)
        return (self.global_step + math.ceil(_batches(self._loader, position) / self.micro_batches)
                + (self._epochs - epoch - 1) * per_epoch)  # fmt: skip

    def accumulate(self, model: torch.nn.Module, index: int) -> AbstractContextManager[MicroStep]:
        """A context for a micro-batch's forward and backward: DDP all-reduces only on the last
        micro-batch of a window of ``accumulate`` (and of an epoch).

        Args:
            model: the model from :meth:`setup_model`.
            index: the batch's index in this pass over the loader (``enumerate(loader)``).

        Returns:
            A context manager giving a :class:`~phalanx.runtime.gradients.MicroStep`: ``sync``
            (call :meth:`step` after the optimizer's step only then) and ``loss_scale``.

        Example::

            for index, (inputs, labels) in enumerate(loader):
                with run.accumulate(model, index) as micro:
                    loss = F.cross_entropy(model(inputs.to(run.device)), labels.to(run.device))
                    (loss * micro.loss_scale).backward()
                run.record(loss)
                if micro.sync:
                    optimizer.step()
                    optimizer.zero_grad()
                    run.step()
        """
        _, loader = self._in_loop("accumulate")
        if self.context.healing is not None:  # a heal replays a step's batches, which the loop's count does not see
            index = loader.batch_index
        return accumulate(model, index, self.micro_batches, total=_batches(loader, loader.pass_start))

    def record(self, loss: torch.Tensor | float) -> None:
        """Adds a batch's loss to the global mean loss of the logging points and epochs.

        Args:
            loss: the batch's mean loss, or its per-sample losses (``reduction="none"``): then
                the padding samples that even out an epoch's last batches count exactly zero
                times. Weighted by the batch's real samples. No device sync, no collective
                (a number, such as ``loss.item()``, is taken too, but that read waited for the device).
        """
        reporter, loader = self._in_loop("record")
        if isinstance(loss, numbers.Real):
            loss = torch.tensor(float(loss))
        elif not isinstance(loss, torch.Tensor):
            raise TypeError(f"the loss: a tensor or a number, not a {type(loss).__name__}")
        real = loader.real_delivered - self._real_seen
        self._real_seen += real
        loss = loss.detach()
        if loss.dim() == 0:
            self._trained += real
            reporter.totals.add_mean(real, loss=loss)
            return
        self._trained += len(loss)
        reporter.totals.add_mean(real, loss=loss.mean() if real == len(loss) or real == 0 else loss[:real].mean())

    def log(self, **values: torch.Tensor | float) -> None:
        """Values of this rank (a learning rate, a gradient norm) for the next logging point's
        line and metrics files; a tensor is read only there. ``grad_norm`` is also shown.

        Args:
            values: numbers or 0-dim tensors, by name; a later value of a name replaces an
                earlier one until the logging point.

        Example::

            run.log(lr=scheduler.get_last_lr()[0])
        """
        for name, value in values.items():
            if not (isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)):
                shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
                raise TypeError(f"run.log({name}=...): a number or a one-element tensor, not {shown}")
        self._values.update(values)

    def clip_gradients(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the model's gradients to a global norm of at most ``max_norm``, unscaling fp16
        loss-scaled gradients first, and logs the norm they had as ``grad_norm``.

        With fp16, the gradients are scaled by the GradScaler until its step: clipping them as
        they are would clip ``scale`` times too hard. So the tracked optimizers are unscaled
        first, by the tracked :class:`~phalanx.MixedPrecision` (or GradScaler): do not call
        ``unscale`` yourself. Call it where the optimizer would step (on an accumulation
        window's last micro-batch), before that step.

        Args:
            max_norm: the largest global norm allowed; positive.
            norm_type: the norm's order (``float("inf")``: the largest absolute value).

        Returns:
            The gradients' global norm before clipping, a 0-dim tensor (read only at the
            logging point, so no device sync here).

        Raises:
            SettingsRefused: ``max_norm`` is not positive.
            ValueError: no model was set up (:meth:`setup_model` first).

        Example::

            precision.backward(loss)
            run.clip_gradients(1.0)
            precision.step(optimizer)
        """
        if self._model is None:
            raise ValueError("run.clip_gradients(): no model to clip; call run.setup_model(model) first")
        check_max_norm(max_norm)  # before the gradients are unscaled
        optimizers = [value for value in self._tracked.values() if isinstance(value, torch.optim.Optimizer)]
        scalers = [value.scaler if isinstance(value, MixedPrecision) else value for value in self._tracked.values()]
        for scaler in scalers:
            if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled():
                if not optimizers:
                    raise ValueError(
                        "run.clip_gradients(): the gradients are loss-scaled (fp16), and no tracked optimizer says "
                        "which ones to unscale; run.track(optimizer=optimizer) first"
                    )
                for optimizer in optimizers:
                    scaler.unscale_(optimizer)
        norm = clip_gradients(self._model, max_norm, norm_type)
        self._values["grad_norm"] = norm
        return norm

    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Marks an optimizer step done: the logging point, the preemption vote, the checkpoint.

        Call it on every rank after each optimizer step. At a preemption (SIGTERM or SIGUSR1
        to any rank) every rank saves after the same step and the process exits with code 75
        (PREEMPTED), which ``phalanx run`` reports as a stop to relaunch, not a failure.

        Under ``phalanx run --heal``, a step that a peer's failure broke is not completed: the
        ranks heal, ``run.global_step`` (the steps completed) does not move, and the loader
        gives the step's batches again: count steps with ``run.global_step``, not with calls.

        Args:
            loss: the last batch's loss, recorded as by :meth:`record` (leave it out when you
                call :meth:`record` for each micro-batch yourself).

        Raises:
            CheckpointNotSaved: a checkpoint due at this step could not be written.
            SettingsRefused: with ``accumulate=N``, a step before a window's last micro-batch.
        """
        reporter, loader = self._in_loop("step")
        healing = self.context.healing
        if healing is not None and healing.health.failed and not (self._keeper and self._keeper.optimizer_stepped):
            self._heal()  # the step failed before its optimizer step: trained again after the heal
            return
        index = loader.batch_index  # a window's last micro-batch, or the pass's last batch
        if (index + 1) % self.micro_batches and index + 1 != _batches(loader, loader.pass_start):
            raise SettingsRefused(
                f"run.step() after micro-batch {index + 1} of the pass, with Run(accumulate={self.micro_batches})",
                f"an optimizer step takes {self.micro_batches} micro-batches: a step after each batch counts the "
                "run's steps wrong and accumulates nothing.",
                "put each micro-batch's forward and backward in `with run.accumulate(model, index) as micro:`, "
                "and call run.step() only where micro.sync",
            )
        if loss is not None:
            self.record(loss)
        elif loader.real_delivered != self._real_seen and not self._said_no_loss:
            self._said_no_loss = True
            self.print("phalanx: run.step() without a loss, and no run.record() since the last step: the progress "
                       "lines' loss and samples/s count recorded batches only; pass the loss, run.step(loss)")  # fmt: skip
        if self._forwards is not None and self._forwards.none_since_last_step() and not self._said_no_forward:
            self._said_no_forward = True
            self.print(f"phalanx: WARNING: step {self.global_step + 1} had no forward pass through the model that "
                       "run.setup_model() returned, so DDP averaged none of its gradients across the ranks and the "
                       "replicas drift apart; call the returned model, not the module given to setup_model")  # fmt: skip
        self.global_step += 1
        step = self.global_step
        if self._keeper is not None:
            self._mark(self._keeper, step)
        if healing is not None:
            loader.step_ended()
        self.context.mark_step(step)
        try:
            reporter.finish()  # the previous boundary's logging point: its all-reduce ran during this step
            if loader.resume_point[0] > self._epoch:
                reporter.end_epoch(self._epoch, step)
            if step % self.log_every == 0 or step == self.total_steps:
                reporter.start(step, self._epoch, self._values)
                self._values = {}
            # A stop agreed on after the last step finds the training complete: it ends as a finished run does.
            self._stop = self._preemption.should_stop(self._boundary)
        except PeerFailed:  # heal mode: a peer failed after this step completed here
            self._heal()
            return
        self._boundary.start()  # the logging point's all-reduce and the vote run during the next step
        preempted = self._stop and not self._finished
        due = self.checkpoints is not None and (preempted or step % self.checkpoint_every == 0)
        if due and not self._saved_or_healed(preempted):
            self._say_save_healed(f"and the next checkpoint is due after step {step + self.checkpoint_every}")
            return  # the next step follows
        if preempted:
            reporter.settle()
            if self.checkpoints:
                self.checkpoints.wait()  # committed before it is said
            saved = "checkpoint saved" if self.checkpoints else "no checkpoint folder, nothing saved"
            received = self._preemption.received
            why = ("stopped by Ctrl-C (SIGINT)" if received == signal.SIGINT else
                   f"preempted by {received.name if received else 'another rank'}")  # fmt: skip
            self.print(f"{why} after step {step}; {saved}")
            os.environ.update(WorkerEnv(stopped=f"after step {step}; {saved}").to_env())  # for the launcher
            self.close()
            raise SystemExit(ExitCode.PREEMPTED)
        if self._keeper is not None:
            self._keeper.seeding.after(step)

    def save(self) -> None:
        """A checkpoint of everything tracked, after the current step; a collective.

        :meth:`step` saves at its cadence already; call it for a checkpoint of your own. Under
        ``phalanx run --heal``, a rank that fails in it is replaced and the ranks heal; this
        checkpoint is then not saved (the replacement goes on from the last step, and does not
        make this call), which a line says.

        Raises:
            CheckpointNotSaved: it could not be written; the previous checkpoints are intact.
        """
        if self.checkpoints is None:
            raise RuntimeError("run.save() without a checkpoint folder: give Run(checkpoint_dir=...)")
        if not self._saved_or_healed(preempted=False):
            self._say_save_healed("and this checkpoint of the script's is not saved")

    def _save(self) -> None:
        """:meth:`save`'s checkpoint, whose failure is the caller's to heal."""
        assert self.checkpoints is not None
        if self._saved_step == self.global_step:
            return  # this step is saved already (the end of run.epochs(), or the checkpoint resumed from)
        if self._model is not None and self.context.is_distributed:
            # Buffers (BatchNorm's statistics) differ per rank until DDP broadcasts rank 0's at the
            # next forward; saved now, a replicated buffer could come from any rank.
            healing = self.context.healing
            if healing is None:
                for buffer in unwrap(self._model).buffers():
                    torch.distributed.broadcast(buffer, src=0)
            else:  # as at a forward: a wait that a peer's failure ends
                share_buffers(unwrap(self._model), healing.health)
                if healing.health.failed:
                    raise PeerFailed(f"before the checkpoint save, {described(healing.health.failure)}")
            if self._keeper is not None:  # a failure in this save keeps them, as the checkpoint would
                self._keeper.took_rank_0s_buffers()
        self.checkpoints.save(self.global_step, self._state_to_save(), self._rank_state())
        self._saved_step = self.global_step

    def _saved_or_healed(self, preempted: bool) -> bool:
        """The checkpoint after this step; False where a peer failed inside it (heal mode): the
        ranks healed instead, and the checkpoint is not saved (a replacement joins the others at
        their next step, where no save is due; or, at the end, in :meth:`_end`'s save).

        Raises:
            CheckpointNotSaved: it could not be written (on every rank: none failed in it).
        """
        healing = self.context.healing
        if healing is None or preempted:  # (the job stops after a preemption's: a failure in it is the restart's)
            self._save()
            return True
        try:
            self._save()
            if not healing.health.failed:
                return True
            failure = healing.health.failure  # saved here, but another rank failed in it and opened the next generation
        except RuntimeError as error:
            if not raised_by_a_collective(error):
                raise
            failure = (
                error if isinstance(error, PeerFailed) else PeerFailed(f"in the checkpoint save, {described(error)}")
            )
        # Healed out of the ``except``: the error's frames hold the save's group, which the heal frees.
        assert failure is not None
        healing.health.note(failure)
        self._heal()
        return False

    def _say_save_healed(self, then: str) -> None:
        self.print(
            f"phalanx: a rank failed in the checkpoint save after step {self.global_step}: the ranks healed, {then}"
        )

    def print(self, line: str) -> None:
        """Prints a line on rank 0, above the progress bar on a terminal.

        Args:
            line: the text, without a newline.
        """
        if self._reporter is not None:
            self._reporter.progress.write(line)
        elif self.is_main:
            print(line, flush=True)

    def summary(self) -> dict[str, Any]:
        """The run's figures for a metrics file; a collective (the throughput is summed).

        Returns:
            world_size, steps, resumed_from_step; samples_per_second: every rank's samples per
            second in this run's loop, added up (None when it trained no step); with a model
            from :meth:`setup_model`, params_sha256 (its parameters' SHA-256: equal across
            runs means bit-identical) and compression (what ran; for auto, what it measured).
        """
        elapsed = time.perf_counter() - self._started
        rate = torch.tensor([self._trained / elapsed if elapsed > 0 else 0.0], device=self.device)
        if self.context.is_distributed:
            torch.distributed.all_reduce(rate)
        trained = self.global_step != (self.resumed_from or 0)
        summary = {"world_size": self.world_size, "steps": self.global_step, "resumed_from_step": self.resumed_from,
                   "samples_per_second": rate.item() if trained else None}  # fmt: skip
        if self._model is not None:
            summary.update(
                params_sha256=parameters_sha256(self._model), compression=compression_of(self._model).summary()
            )
        return summary

    def close(self) -> None:
        """Ends the run: the logging, a checkpoint still being written, the process group it made.

        At exit, once no process group is left, the interpreter's last garbage collection is
        skipped (it costs seconds of CPU with torch loaded); nothing changes before that.
        """
        if self._closed:
            return
        self._closed = True
        if self._keeper is not None:
            self._keeper.keep_if_failing()  # a close() in a finally comes before sys.excepthook
            self._keeper.release()
        try:
            if self._reporter is not None:
                self._reporter.close()
        finally:
            try:
                if self.checkpoints is not None:
                    self.checkpoints.close()
            finally:
                if self._owns_context:
                    self.context.close()
                atexit.register(_skip_the_last_collection)

    # -- inside -------------------------------------------------------------------------------

    def _refuse_after_restore(self, what: str) -> None:
        """What is set up after the restore would start afresh, silently: refused."""
        if self._restored:
            raise RuntimeError(f"run.{what}() after the run was restored: call it before run.epochs() or run.restore()")

    def _refuse_tracked(self, name: str, own: object, what: str, new: object = None) -> None:
        """A ``track(NAME=...)`` of the user's that the run's own setup would replace with ``new``,
        silently: refused."""
        if name in self._tracked and own is None and self._tracked[name] is not new:
            raise ValueError(f"run.{what}() after run.track({name}=...): the run checkpoints its own {name!r}, which "
                             f"would replace yours; drop {name}= from track()")  # fmt: skip

    def _in_loop(self, what: str) -> tuple[Reporter, ResumableLoader]:
        """The logging and the loader, which exist inside :meth:`epochs`; a clear error elsewhere."""
        if self._reporter is None or self._loader is None:
            raise RuntimeError(
                f"run.{what}() belongs inside the loop over run.epochs(), which needs run.setup_dataloader()"
            )
        return self._reporter, self._loader

    @property
    def _finished(self) -> bool:
        assert self._loader is not None
        return self._loader.resume_point[0] >= self._epochs

    def _say_world_changed(self, saved: int) -> None:
        """What a resume with another number of processes keeps (the data position) and what not."""
        replayed = self._loader.sampler.replayed if self._loader is not None else 0
        again = f"; the epoch's last {replayed} samples before it are trained once more" if replayed else ""
        self.print(f"phalanx: the checkpoint was written by {saved} processes, this run has {self.world_size}: the epoch "
                   f"goes on after the samples it trained{again}. Each rank's random state starts from the seed, so the "
                   "parameters are not those of a run without the change")  # fmt: skip

    def _rank_state(self) -> dict[str, Any]:
        """This rank's own part of a checkpoint: its RNG states and PowerSGD's error feedback."""
        own: dict[str, Any] = {"rng": rng_state()}
        if self._model is not None:
            own["compression"] = compression_of(self._model).rank_state_dict()
        return own

    def _tracked_state(self) -> dict[str, Any]:
        """Every tracked object's state, the compression's and the per-step seeding's: no collective."""
        state = {name: target.state_dict() for name, target in self._tracked.items()}
        if self._model is not None:
            state["compression"] = compression_of(self._model).state_dict()
        if self._keeper is not None:
            state["step_seed"] = self._keeper.seeding.state_dict()
        return state

    def _state_to_save(self) -> dict[str, Any]:
        state = self._tracked_state()
        if self._reporter is not None:
            state["reporter"] = self._reporter.checkpoint_state(self.global_step)  # settles: all shown up to here
        return state

    def _start_keeping(self) -> StepKeeper | None:
        """The keeper of the last step's state (``keep_last_step``), from the current step on."""
        compression = compression_of(self._model).mode if self._model is not None else "none"
        if not (self._keep_last_step and self.checkpoints is not None and compression in STATELESS_COMPRESSIONS):
            return None
        if self._heal_launch is not None:  # a replacement: its peers agreed long ago
            assert self._carried_seeding is not None
            seeding = StepSeeding(
                int(self._carried_seeding["seed"]), bool(self._carried_seeding["per_rank"]), self.rank
            )
            launch = self._heal_launch
        else:
            seeding, launch = agreed_start(self.context, self._carried_seeding)
        keeper = StepKeeper(self.checkpoints, self.context, self._state_of_step, seeding, launch)
        optimizers = [value for value in self._tracked.values() if isinstance(value, torch.optim.Optimizer)]
        module = unwrap(self._model) if self._model is not None else None
        keeper.watch(module, self._model if self._model is not module else None, optimizers)
        self._mark(keeper, self.global_step)
        keeper.listen(WorkerEnv.from_env(os.environ).keep_request)  # with a mark to keep
        seeding.after(self.global_step)
        if self.context.healing is not None:
            self._loader.keep_step_batches()
            request = WorkerEnv.from_env(os.environ).keep_request
            if request is not None:  # for its supervisor: a failure from now on is healed
                heal_armed_of(request).touch()
        return keeper

    def _load_tracked(self, state: dict[str, Any], *skipped: str, source: Path | None = None) -> None:
        """Loads each tracked object's state; from a checkpoint (``source``), one that does not fit
        its object (a model of another shape, another optimizer) is refused with what differs."""
        for name, target in self._tracked.items():
            if name in state and name not in skipped:
                try:
                    target.load_state_dict(state[name])
                except (RuntimeError, KeyError, ValueError) as error:
                    if source is None or not _does_not_fit(target, error):
                        raise
                    said = " ".join(line.strip() for line in str(error).splitlines()[:2])
                    raise SettingsRefused(
                        f"the checkpoint {source} does not fit this run's {name} ({type(target).__name__}): "
                        f"{type(error).__name__}: {said[:300]}",
                        f"its {name} was saved from another one (a model of another shape, another optimizer).",
                        "resume with what the checkpoint was saved with, or start a new training in another "
                        "checkpoint folder",
                    ) from error

    def _mark(self, keeper: StepKeeper, step: int) -> None:
        """Marks ``step`` complete: the data position, and in heal mode the states a failed step rolls back."""
        assert self._loader is not None
        others = rollback_states(self._tracked) if self.context.healing is not None else None
        keeper.mark(step, self._loader.state_dict(), others)

    def _state_of_step(self, mark: StepMark) -> dict[str, Any]:
        """What a checkpoint of the marked step would hold, built without a collective (for a
        survivor of a failure): the mark's data position and buffers, the logging as known."""
        state = self._tracked_state()
        if mark.data is not None:
            state["data"] = mark.data
        for name, marked in (mark.others or {}).items():
            if isinstance(self._tracked[name], torch.optim.Optimizer):  # the marked hyperparameters
                groups = [{**group, **hyper} for group, hyper in zip(state[name]["param_groups"], marked, strict=True)]
                state[name] = {**state[name], "param_groups": groups}
            else:
                state[name] = marked
        if "model" in state:
            state["model"] = {**state["model"], **{name: copy for name, copy in mark.buffers.items()
                                                    if name in state["model"]}}  # fmt: skip
        if self._reporter is not None:
            state["reporter"] = self._reporter.known_state()
        if mark.buffers and mark.buffers_rank != 0:
            state["buffers_rank"] = mark.buffers_rank
        return state

    def _heal(self) -> None:
        """A survivor after a failure: the next generation of the group, every rank on the state
        after the last step a survivor completed, and the failed step's batches again (the loop
        trains that step once more, as the uninterrupted run did)."""
        healing, keeper, (reporter, loader) = self.context.healing, self._keeper, self._in_loop("step")
        assert healing is not None and keeper is not None
        mark = keeper.last_mark
        assert mark is not None
        assert self.checkpoints is not None
        node_local = self.checkpoints.node_local
        try:
            payload, healed = healing.heal(
                lambda: {"state": self._state_of_step(mark), "launch": keeper.launch, "node_local": node_local},
                mark.step,
            )
        except Exception as error:  # RuntimeError, DistError: the state is kept, the launcher restarts all
            self._heal_failed(error)
        state = payload["state"]
        if healed.behind:  # the source completed this rank's step in progress: its state, no step again
            self._load_tracked(state, "data")
            loader.step_ended()  # its batches were trained (their all-reduce completed on the source)
            self.global_step = healed.step
        else:
            # The parameters are the source's already; the buffers go back to this rank's own at
            # the mark (the next forward shares rank 0's); the data position stays: the loop replays.
            self._load_tracked(state, "model", "data")
            keeper.restore_buffers(mark)
            if not healed.shrank:
                loader.replay()
        if healed.shrank:  # the rest of the epoch from the source's position, in this rank's new shard
            self.context.regroup(healing.generations.rank, healing.generations.world_size)
            loader.reshard(self.rank, self.world_size, state["data"])
            self._real_seen = loader.real_delivered
            keeper.seeding.rank = self.rank
            self.total_steps = self._steps_to_the_end()
            reporter.regroup(self.total_steps, healed.step)
        if healed.behind or healed.shrank:
            self._mark(keeper, healed.step)
        self._boundary = SharedReduction(self.context)
        reporter.start_over(state["reporter"], self._boundary)
        self._preemption.start_votes_over()
        self._values = {}
        keeper.seeding.after(healed.step)
        self.print(healed.line())

    def _restore_from_peer(self) -> int:
        """A replacement's restore: the state after the survivors' last completed step, sent by one
        of them over the group it formed with them (:meth:`_heal` on their side)."""
        healing = self.context.healing
        assert healing is not None
        try:
            payload, healed = healing.heal(lambda: None, -1)
        except Exception as error:
            self._heal_failed(error)
        state = payload["state"]
        self._load_tracked(state)
        self._carried_reporter = state.get("reporter")
        self._carried_seeding = state.get("step_seed")
        self._heal_launch = int(payload["launch"])
        assert self.checkpoints is not None
        self.checkpoints.joined(bool(payload["node_local"]))
        self._replacing = False
        self.global_step = self.resumed_from = healed.step
        self.print(healed.line())
        return healed.step

    def _heal_failed(self, error: Exception) -> NoReturn:
        """The ranks could not heal: a survivor keeps the state after the last step (inside the
        ``except``, as a failure would), and the process ends with HEAL_FAILED, which its
        supervisor leaves to the launcher's restart of every worker."""
        lost = (": the launch's store, which the ranks heal through, is unreachable (its host may be lost)"
                if isinstance(error, torch.distributed.DistNetworkError) else "")  # fmt: skip
        print(f"phalanx: the ranks could not heal ({type(error).__name__}: {str(error).strip()[:200]}){lost}; leaving "
              f"the job to {launcher_takeover(os.environ)}", file=sys.stderr, flush=True)  # fmt: skip
        if self._keeper is not None:
            self._keeper.keep_if_failing()
        raise SystemExit(ExitCode.HEAL_FAILED) from error

    def _end(self) -> None:
        """After the last epoch: the final checkpoint, a late preemption said, the logging closed."""
        if self.checkpoints and (self._saved_step or 0) != self.global_step:
            # Heal mode: a rank that fails in it is replaced, and the replacement, past the last
            # epoch, comes to this save too: saved again (each failure spends a replacement).
            while not self._saved_or_healed(preempted=False):
                self._say_save_healed("and they save it again")
        if self.context.healing is not None:
            self._loader.keep_step_batches(False)  # type: ignore[union-attr]
        if self._keeper is not None:
            self._keeper.release()
        self._preemption.release_interrupt()
        received = self._preemption.received
        if self._stop or received is not None:
            name = received.name if received else "a preemption signal (to another rank)"
            self.print(f"{name} came after the last step: the training is complete, so it finishes instead of stopping")
        assert self._reporter is not None
        self._reporter.close()  # before the script's own final lines
        self._reporter = None


def _does_not_fit(target: Stateful, error: Exception) -> bool:
    """Whether ``target.load_state_dict``'s error says the state is another object's: a module's
    keys or shapes, an optimizer's groups or kind (not an out-of-memory or a device's error)."""
    if isinstance(target, torch.nn.Module):
        return isinstance(error, RuntimeError) and str(error).startswith("Error(s) in loading state_dict")
    return isinstance(target, torch.optim.Optimizer) and isinstance(error, (KeyError, ValueError))


def _batches(loader: ResumableLoader, start: int) -> int:
    """The batches a pass over ``loader`` delivers from sample position ``start`` of its epoch."""
    left = loader.sampler.num_samples - start
    return left // loader.batch_size if loader.drop_last else math.ceil(left / loader.batch_size)


def _skip_the_last_collection() -> None:
    """At exit: exempts what is alive from the interpreter's last garbage collection, which with
    torch loaded costs seconds of CPU per process. Only once no process group is left: a script
    that never destroys its group has it torn down after this (phalanx run's worker entry
    point), by a collection that must still find the DDP model's reference cycle."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        gc.freeze()


class _Forwards:
    """Counts the forward passes through DDP's wrapper (a forward pre-hook): a step after none
    trained the module inside, whose gradients DDP does not average."""

    def __init__(self) -> None:
        self.count = self._at_last_step = 0

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.count += 1

    def none_since_last_step(self) -> bool:
        none, self._at_last_step = self.count == self._at_last_step, self.count
        return none
