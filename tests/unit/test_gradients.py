"""Accumulation windows, clipping and mixed precision in one process (DDP's side: tests/e2e)."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import SettingsRefused
from phalanx.runtime.gradients import accumulate, clip_gradients, micro_step
from phalanx.runtime.precision import MixedPrecision


def test_windows_end_in_a_sync_and_a_short_last_window_scales_by_its_own_size():
    steps = [micro_step(index, every=3, total=8) for index in range(8)]
    assert [s.sync for s in steps] == [False, False, True, False, False, True, False, True]
    assert [s.loss_scale for s in steps] == [1 / 3] * 6 + [1 / 2] * 2
    assert all(micro_step(index, every=1).sync for index in range(5))  # no accumulation: every one syncs


@pytest.mark.parametrize("every", [0, -2, 1.5, True])
def test_a_window_that_is_not_a_positive_count_is_refused(every):
    with pytest.raises(SettingsRefused, match="use a whole number >= 1"):
        micro_step(0, every)


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_batch():
    torch.manual_seed(0)
    model, inputs, target = torch.nn.Linear(5, 3), torch.randn(12, 5), torch.randn(12, 3)
    torch.nn.functional.mse_loss(model(inputs), target).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for index, part in enumerate(range(0, 12, 4)):  # a plain module: accumulate is a no-op context
        with accumulate(model, index, every=3, total=3) as micro:
            (
                torch.nn.functional.mse_loss(model(inputs[part : part + 4]), target[part : part + 4]) * micro.loss_scale
            ).backward()
    assert micro.sync
    for accumulated, expected in zip((p.grad for p in model.parameters()), whole):
        torch.testing.assert_close(accumulated, expected)


def test_clipping_bounds_the_norm_and_returns_the_norm_before():
    model = torch.nn.Linear(4, 4)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 3.0)  # norm 3 * sqrt(20)
    before = clip_gradients(model, max_norm=1.0)
    assert float(before) == pytest.approx(3.0 * 20**0.5)
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float(after) == pytest.approx(1.0, rel=1e-5)
    assert float(clip_gradients(model, max_norm=5.0)) == pytest.approx(1.0, rel=1e-5)  # under the bound: untouched


@pytest.mark.parametrize("bound", [0.0, -1.0, float("nan")])
def test_a_bound_that_is_not_positive_is_refused(bound):
    with pytest.raises(SettingsRefused, match="a norm bound must be positive"):
        clip_gradients(torch.nn.Linear(2, 2), bound)


def test_bf16_autocast_on_cpu_and_fp32_untouched():
    layer = torch.nn.Linear(4, 4)
    with MixedPrecision("bf16", torch.device("cpu")).autocast():
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    fp32 = MixedPrecision("fp32", torch.device("cpu"))
    with fp32.autocast():
        assert layer(torch.randn(2, 4)).dtype == torch.float32
    assert fp32.scaler is None and fp32.state_dict() == {}


def test_fp16_on_cpu_is_refused_with_what_to_use():
    with pytest.raises(SettingsRefused) as refused:
        MixedPrecision("fp16", torch.device("cpu"))
    text = str(refused.value)
    assert "precision fp16 on device cpu" in text and "HINT: use precision bf16" in text


def test_an_unknown_precision_is_refused():
    with pytest.raises(SettingsRefused, match="precision 'int8' is not one of fp32, bf16, fp16"):
        MixedPrecision("int8", torch.device("cpu"))


def test_backward_applies_the_window_scale():
    weight = torch.ones(3, requires_grad=True)
    fp32 = MixedPrecision("fp32", torch.device("cpu"))
    fp32.backward((weight * 4).sum(), scale=0.25)
    assert torch.equal(weight.grad, torch.ones(3))
    loss = (weight * 2).sum()
    weight.grad = None
    fp32.backward(loss)
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
