"""phalanx.Run in one process: what a checkpoint restores, and what it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import phalanx
from phalanx.errors import SettingsRefused


class Counter:
    """A user's own Stateful object."""

    def __init__(self) -> None:
        self.seen, self.history = 0, (0, "start")

    def state_dict(self) -> dict:
        return {"seen": self.seen, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.history = state["seen"], state["history"]


def train(folder, epochs: int, counter: Counter, context) -> tuple[phalanx.Run, torch.nn.Module]:
    run = phalanx.Run(folder, checkpoint_every=3, log_every=100, context=context)
    torch.manual_seed(0)
    model = run.setup_model(torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    run.track(optimizer=optimizer, scheduler=scheduler, counter=counter)
    loader = run.setup_dataloader(TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))), batch_size=8)
    for _ in run.epochs(epochs):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            counter.seen += len(y)
            counter.history = (run.global_step + 1, f"step {run.global_step + 1}")
            run.step(loss)
    return run, model


def test_a_registered_stateful_object_and_the_scheduler_round_trip(tmp_path, context):
    first, model = train(tmp_path, 2, Counter(), context)
    first.close()
    restored = Counter()
    again, resumed = train(tmp_path, 2, restored, context)  # finished: restores, trains nothing
    assert again.resumed_from == 10 and again.global_step == 10
    assert (restored.seen, restored.history) == (80, (10, "step 10"))  # the tuple comes back a tuple
    assert torch.equal(resumed.weight, model.weight)
    more, _ = train(tmp_path, 3, restored, context)  # one epoch more, from there
    assert more.global_step == 15 and restored.seen == 120
    for run in (again, more):
        run.close()


def test_tracking_after_the_restore_is_refused(tmp_path, context):
    run = phalanx.Run(tmp_path, context=context)
    run.restore()
    with pytest.raises(RuntimeError, match="before run.epochs"):
        run.track(counter=Counter())
    with pytest.raises(TypeError, match="has no state_dict"):
        phalanx.Run(context=context).track(thing=object())


def test_set_up_after_the_restore_and_loop_calls_outside_the_loop_are_refused(tmp_path, context):
    run = phalanx.Run(tmp_path, context=context)
    with pytest.raises(RuntimeError, match=r"run.step\(\) belongs inside the loop over run.epochs\(\)"):
        run.step()
    run.restore()
    with pytest.raises(RuntimeError, match=r"run.setup_dataloader\(\) after the run was restored"):
        run.setup_dataloader(TensorDataset(torch.zeros(4, 1)), batch_size=2)


class Stop(Exception):
    """A crash, raised after a step."""


def train_with_dropout(folder, context, crash_after: int | None = None) -> torch.Tensor:
    """Dropout draws from the global RNG every step: a resume is exact only if nothing else
    (a DataLoader iterator's seed draw) moved that RNG differently in the resumed run."""
    run = phalanx.Run(folder, checkpoint_every=3, log_every=100, context=context)
    torch.manual_seed(0)
    model = run.setup_model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(optimizer=optimizer)
    loader = run.setup_dataloader(TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))), batch_size=8)
    try:
        for _ in run.epochs(3):
            for x, y in loader:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                run.step()
                if run.global_step == crash_after:
                    raise Stop
    except Stop:
        pass
    run.close()
    return model[0].weight.detach().clone()


def test_a_resume_mid_epoch_with_dropout_is_bit_identical(tmp_path, context):
    whole = train_with_dropout(tmp_path / "whole", context)
    train_with_dropout(tmp_path / "resumed", context, crash_after=8)  # the checkpoint at step 6, mid-epoch 2
    assert torch.equal(train_with_dropout(tmp_path / "resumed", context), whole)


def test_drop_last_counts_only_whole_batches(tmp_path, context):
    run = phalanx.Run(tmp_path, accumulate=2, log_every=100, context=context)
    model = run.setup_model(torch.nn.Linear(1, 1))
    loader = run.setup_dataloader(TensorDataset(torch.zeros(100, 1)), batch_size=32, drop_last=True)
    synced = []
    for _ in run.epochs(1):
        for index, (x,) in enumerate(loader):
            with run.accumulate(model, index) as micro:
                model(x).sum().backward()
            synced.append(micro.sync)
            if micro.sync:
                run.step()
    assert synced == [False, True, True] and run.total_steps == run.global_step == 2
    run.close()


class Holder:
    """A Stateful object whose state holds something a checkpoint cannot."""

    def state_dict(self) -> dict:
        return {"dtype": torch.float16}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_what_the_first_save_would_fail_on_is_refused_before_the_first_step(tmp_path, context):
    run = phalanx.Run(tmp_path, context=context)
    run.track(holder=Holder())
    with pytest.raises(SettingsRefused, match="the checkpoint cannot hold state/holder/dtype: a torch.dtype"):
        run.restore()


def test_a_loader_whose_sampling_would_be_dropped_is_refused(tmp_path, context):
    data = TensorDataset(torch.zeros(8, 1))
    weighted = torch.utils.data.DataLoader(
        data, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 8, 8)
    )
    with pytest.raises(SettingsRefused, match="a DataLoader with a WeightedRandomSampler"):
        phalanx.Run(context=context).setup_dataloader(weighted)
    kept = phalanx.Run(context=context).setup_dataloader(
        torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, timeout=5)
    )
    assert kept.timeout == 5 and kept.sampler.shuffle and kept.batch_size == 2


def test_clip_gradients_unscales_loss_scaled_gradients_first_and_logs_the_norm(tmp_path, context):
    # fp16 autocast is CUDA only; the GradScaler that fp16 uses scales on the CPU alike.
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    reference = torch.nn.Linear(4, 2)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    true_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in reference.parameters()]))

    run = phalanx.Run(context=context, log_every=1, metrics_jsonl=tmp_path / "metrics.jsonl")
    model = run.setup_model(torch.nn.Linear(4, 2))
    model.load_state_dict(reference.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run.track(optimizer=optimizer, scaler=scaler)
    loader = run.setup_dataloader(TensorDataset(x, y), batch_size=16, shuffle=False)
    for _ in run.epochs(1):
        for batch_x, batch_y in loader:
            scaler.scale(torch.nn.functional.cross_entropy(model(batch_x), batch_y)).backward()
            norm = run.clip_gradients(true_norm.item() / 2)
            clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
            scaler.step(optimizer)  # no second unscale: torch would raise
            scaler.update()
            optimizer.zero_grad()
            run.step()
    run.close()
    assert torch.allclose(norm, true_norm), (norm, true_norm)  # the norm of the unscaled gradients
    assert torch.allclose(clipped, true_norm / 2, rtol=1e-4)
    assert not torch.equal(model.weight, reference.weight)  # the step was taken, not skipped
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["grad_norm"] == pytest.approx(true_norm.item(), rel=1e-5), logged


def test_clip_gradients_needs_a_model_and_with_loss_scaling_a_tracked_optimizer(context):
    run = phalanx.Run(context=context)
    with pytest.raises(ValueError, match="setup_model"):
        run.clip_gradients(1.0)
    run.setup_model(torch.nn.Linear(4, 2))
    run.track(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="no tracked optimizer"):
        run.clip_gradients(1.0)
    run.close()


def small_loop(run: phalanx.Run, loader, epochs: int, *, stop_after: int | None = None, loss=None) -> list[int]:
    """A loop of one Linear model; each epoch's loop leaves after ``stop_after`` batches."""
    yielded = []
    for epoch in run.epochs(epochs):
        yielded.append(epoch)
        for index, _ in enumerate(loader):
            run.step(torch.tensor(1.0) if loss is None else loss)
            if stop_after is not None and index + 1 == stop_after:
                break
    return yielded


def test_a_loop_over_another_loader_is_stopped_with_the_reason(context):
    run = phalanx.Run(context=context, log_every=100)
    plain = torch.utils.data.DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=2)
    run.setup_dataloader(plain)
    with pytest.raises(RuntimeError, match="took no batch from the loader that run.setup_dataloader"):
        small_loop(run, plain, 2)  # the DataLoader given, not the one returned: it never ended before


def test_a_break_goes_on_in_the_same_epoch_and_says_so_once(context, capsys):
    run = phalanx.Run(context=context, log_every=100)
    loader = run.setup_dataloader(TensorDataset(torch.arange(8)), batch_size=2)
    seen: dict[int, list[int]] = {}
    for epoch in run.epochs(2):  # 4 batches an epoch, 2 a loop
        for index, (batch,) in enumerate(loader):
            seen.setdefault(epoch, []).extend(batch.tolist())
            run.step(torch.tensor(1.0))
            if index == 1:
                break
    assert run.global_step == 8
    assert [sorted(samples) for samples in seen.values()] == [list(range(8))] * 2  # each sample once an epoch
    said = capsys.readouterr().out
    assert said.count("epoch 1 goes on from where its loop left it (a break)") == 1, said


def test_an_epoch_of_no_batch_is_refused(context):
    run = phalanx.Run(context=context)
    run.setup_dataloader(TensorDataset(torch.zeros(4, 1)), batch_size=8, drop_last=True)
    with pytest.raises(SettingsRefused, match="no batch an epoch: 4 samples a rank, batches of 8 with drop_last"):
        next(run.epochs(1))


@pytest.mark.parametrize("count", ["3", 2.5, -1, True, np.float64(2.0)])
def test_epochs_takes_a_whole_number(context, count):
    run = phalanx.Run(context=context)
    run.setup_dataloader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    with pytest.raises(ValueError, match=r"a whole number of epochs, 0 or more"):
        next(run.epochs(count))


def test_a_loss_as_a_number_is_taken_and_other_values_are_refused_at_the_call(context, capsys):
    run = phalanx.Run(context=context, log_every=2)
    loader = run.setup_dataloader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    small_loop(run, loader, 1, loss=0.5)  # loss.item(), say
    assert "epoch 1/1  step 2  loss 0.5000" in capsys.readouterr().out
    run.close()
    with pytest.raises(TypeError, match="run.log\\(phase=...\\): a number or a one-element tensor, not 'warmup'"):
        run.log(phase="warmup")
    with pytest.raises(TypeError, match=r"not a tensor of shape \(3,\)"):
        run.log(norms=torch.zeros(3))
    run.log(lr=0.1, scale=torch.tensor(2.0), step_scaled=np.float32(0.5), clipped=True)


def test_the_model_tracked_through_ddp_is_saved_under_its_own_keys(tmp_path, context):
    class Wrapped(torch.nn.parallel.DistributedDataParallel):  # DDP as the tutorial wraps it, without a group
        def __init__(self, module: torch.nn.Module) -> None:
            torch.nn.Module.__init__(self)
            self.module = module

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    run = phalanx.Run(tmp_path, context=context)
    run.track(model=Wrapped(model))
    small_loop(run, run.setup_dataloader(TensorDataset(torch.zeros(4, 1)), batch_size=2), 1)
    run.close()
    resumed = phalanx.Run(tmp_path, context=context)
    plain = torch.nn.Linear(2, 2)  # a run of one process: no wrapper, keys "weight", not "module.weight"
    resumed.track(model=plain)
    resumed.setup_dataloader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    assert resumed.restore() == 2 and torch.equal(plain.weight, model.weight)
    resumed.close()


def test_a_tracked_name_the_run_would_replace_and_a_class_are_refused(context):
    run = phalanx.Run(context=context)
    run.track(model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"run.setup_model\(\) after run.track\(model=...\)"):
        run.setup_model(torch.nn.Linear(2, 2))
    same = phalanx.Run(context=context)
    model = torch.nn.Linear(2, 2)
    same.track(model=model)
    assert same.setup_model(model) is model  # the same module: nothing replaced (one process: no wrapper)
    with pytest.raises(TypeError, match=r"the class StepLR, not an object of it: pass StepLR\(...\)"):
        run.track(scheduler=torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match="keep=1.5: a whole number of checkpoints"):
        phalanx.Run("ckpt", keep=1.5, context=context)


def test_explicit_loader_settings_replace_the_dataloaders(context):
    given = torch.utils.data.DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=2, shuffle=False, drop_last=True)
    loader = phalanx.Run(context=context).setup_dataloader(given, shuffle=True, drop_last=False, seed=5)
    assert (loader.sampler.shuffle, loader.drop_last, loader.sampler.seed) == (True, False, 5)
    kept = phalanx.Run(context=context).setup_dataloader(given)
    assert (kept.sampler.shuffle, kept.drop_last, kept.sampler.seed) == (False, True, 0)
    in_order = phalanx.Run(context=context).setup_dataloader(TensorDataset(torch.zeros(8, 1)), 2, shuffle=0)
    assert in_order.sampler.shuffle is False


def test_an_iterable_dataset_is_refused_with_the_reason(context):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(4)

    for data in (Stream(), torch.utils.data.DataLoader(Stream(), batch_size=2)):
        with pytest.raises(SettingsRefused, match="with an IterableDataset"):
            phalanx.Run(context=context).setup_dataloader(data, batch_size=2)
    unbatched = torch.utils.data.DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=None)
    with pytest.raises(SettingsRefused, match=r"a SequentialSampler and batch_size=None \(no batches\)"):
        phalanx.Run(context=context).setup_dataloader(unbatched)


def test_a_checkpoint_of_another_model_is_refused_naming_it(tmp_path, context):
    def run_of(width: int):
        run = phalanx.Run(tmp_path, context=context)
        run.setup_model(torch.nn.Linear(4, width))
        return run, run.setup_dataloader(TensorDataset(torch.zeros(4, 1)), batch_size=2)

    first, loader = run_of(8)
    small_loop(first, loader, 1)
    first.close()
    wider, _ = run_of(16)
    with pytest.raises(
        SettingsRefused, match=r"does not fit this run's model \(Linear\): RuntimeError: .*size mismatch"
    ):
        wider.restore()
    wider.close()


def test_a_step_after_each_batch_with_accumulation_is_stopped_at_the_first(context):
    run = phalanx.Run(context=context, accumulate=2)
    loader = run.setup_dataloader(TensorDataset(torch.zeros(4, 1)), batch_size=1)
    with pytest.raises(
        SettingsRefused, match=r"run.step\(\) after micro-batch 1 of the pass, with Run\(accumulate=2\)"
    ):
        small_loop(run, loader, 1)  # a step per batch: the progress would pass 100%


def test_a_step_every_window_is_taken_however_the_loop_accumulates(context):
    run = phalanx.Run(context=context, accumulate=2, log_every=100)
    loader = run.setup_dataloader(TensorDataset(torch.zeros(5, 1)), batch_size=1)  # windows of 2, 2 and 1
    for _ in run.epochs(1):
        for index, _ in enumerate(loader):  # its own count, not run.accumulate
            if (index + 1) % 2 == 0 or index == 4:
                run.step(torch.tensor(1.0))
    assert run.global_step == run.total_steps == 3


def test_a_step_without_a_loss_says_once_that_the_progress_lines_miss_it(context, capsys):
    for recorded in (True, False):
        run = phalanx.Run(context=context, log_every=2)
        loader = run.setup_dataloader(TensorDataset(torch.zeros(8, 1)), batch_size=2)
        for _ in run.epochs(1):
            for _ in loader:
                if recorded:
                    run.record(torch.tensor(1.0))  # by hand, as for micro-batches: nothing to say
                run.step()
        run.close()
        said = capsys.readouterr().out
        assert said.count("run.step() without a loss, and no run.record() since the last step") == (not recorded), said
