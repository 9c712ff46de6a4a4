"""Gradients between backward and the optimizer step: accumulation without all-reduce, clipping.

Loss scaling is the caller's, as in Lightning Fabric: :func:`accumulate` hands out the factor
(``micro.loss_scale``) and the loop multiplies its loss by it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from phalanx.errors import SettingsRefused


@dataclass(frozen=True)
class MicroStep:
    """Where a micro-batch falls in its accumulation window: whether it syncs, and its loss scale."""

    #: The last micro-batch of its window: its backward all-reduces, the optimizer steps after it.
    sync: bool
    #: 1 / the micro-batches in this window: the accumulated gradient is then their mean.
    loss_scale: float


#: Without accumulation every micro-batch is a whole step: the same (immutable) answer each time.
_WHOLE_STEP = MicroStep(sync=True, loss_scale=1.0)
_WHOLE_STEP_CONTEXT = contextlib.nullcontext(_WHOLE_STEP)  # holds no state: re-entered every step


def micro_step(index: int, every: int, total: int | None = None) -> MicroStep:
    """Where micro-batch ``index`` (0-based) falls in windows of ``every``.

    ``total`` is the number of micro-batches in the pass (an epoch); when it does not divide by
    ``every``, the last window is shorter and still ends in a sync, with its own loss scale.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise SettingsRefused(
            f"gradient accumulation every={every!r}", "it counts micro-batches per optimizer step",
            "use a whole number >= 1 (1: no accumulation)",
        )  # fmt: skip
    if total is not None and not 0 <= index < total:
        raise ValueError(f"micro-batch {index} is outside the pass of {total}")
    if every == 1:
        return _WHOLE_STEP
    window_start = index - index % every
    window = every if total is None else min(every, total - window_start)
    return MicroStep(sync=index - window_start == window - 1, loss_scale=1.0 / window)


@contextlib.contextmanager
def no_backward_sync(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """DDP's ``no_sync()`` when ``enabled`` and the model is in DDP; otherwise nothing.

    One code path for 1 and N processes (Fabric's ``no_backward_sync``): a model that is not
    wrapped has nothing to synchronise.

    Args:
        model: the model (DDP's wrapper, or a plain module).
        enabled: False: the backward all-reduces as usual (a loop's switch).

    Example::

        with phalanx.no_backward_sync(model, enabled=not last_micro_batch):
            loss.backward()
    """
    if enabled and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def accumulate(
    model: torch.nn.Module, index: int, every: int, total: int | None = None
) -> contextlib.AbstractContextManager[MicroStep]:
    """Runs a micro-batch's backward inside: all-reduces only when the window ends there.

    Accumulating ``every`` micro-batches per optimizer step, only each window's last
    backward all-reduces (the others run under DDP's ``no_sync()``): the result equals one
    batch ``every`` times as large, with a fraction of the traffic. Scaling the loss is the
    caller's: multiply it by ``micro.loss_scale``.

    Args:
        model: the model (DDP's wrapper, or a plain module: then nothing is synchronised).
        index: the micro-batch's index in the pass, from 0 (``enumerate(loader)``).
        every: micro-batches per optimizer step (1: no accumulation).
        total: micro-batches in the pass; when it does not divide by ``every``, the last
            window is shorter and still ends in a sync, with its own loss scale.

    Returns:
        A context manager giving a :class:`~phalanx.runtime.gradients.MicroStep`: ``sync``
        (step the optimizer after this micro-batch) and ``loss_scale`` (1 / the micro-batches
        of its window).

    Raises:
        SettingsRefused: ``every`` is not a whole number of at least 1.
        ValueError: ``index`` is outside the pass of ``total``.

    Example::

        for index, (inputs, labels) in enumerate(loader):
            with phalanx.accumulate(model, index, every=4, total=len(loader)) as micro:
                (F.cross_entropy(model(inputs), labels) * micro.loss_scale).backward()
            if micro.sync:
                optimizer.step()
                optimizer.zero_grad()
    """
    micro = micro_step(index, every, total)
    if micro is _WHOLE_STEP:  # every step without accumulation: nothing to enter, so nothing to pay
        return _WHOLE_STEP_CONTEXT
    if micro.sync:
        return contextlib.nullcontext(micro)
    return _without_sync(model, micro)


@contextlib.contextmanager
def _without_sync(model: torch.nn.Module, micro: MicroStep) -> Iterator[MicroStep]:
    with no_backward_sync(model):
        yield micro


def check_max_norm(max_norm: float) -> None:
    """Refuses a clipping bound that is not a positive number (nan included)."""
    if not max_norm > 0:
        raise SettingsRefused(
            f"gradient clipping max_norm={max_norm}", "a norm bound must be positive",
            "use a positive number (for example 1.0), or do not clip",
        )  # fmt: skip


def clip_gradients(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scales the gradients so that their global norm is at most ``max_norm``; returns the norm
    they had before (a 0-dim tensor: reading it with float() is the only device sync).

    Call it after the synchronising backward. In DDP the gradients are all-reduced by then, so
    every rank holds the same gradients, computes the same norm and clips them alike: no
    collective is needed here and the replicas stay identical. With fp16 and a GradScaler,
    unscale first (:meth:`phalanx.runtime.precision.MixedPrecision.unscale`), or use
    :meth:`phalanx.Run.clip_gradients`, which does.

    Args:
        model: the model whose parameters' gradients are clipped.
        max_norm: the largest global norm allowed; positive.
        norm_type: the norm's order (``float("inf")``: the largest absolute value).

    Returns:
        The gradients' global norm before clipping, a 0-dim tensor.

    Raises:
        SettingsRefused: ``max_norm`` is not positive.

    Example::

        loss.backward()
        grad_norm = phalanx.clip_gradients(model, max_norm=1.0)
        optimizer.step()
    """
    check_max_norm(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
