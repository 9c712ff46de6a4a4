"""The models `phalanx bench ddp` trains: small enough for CPUs, different enough to compare.

Each maps a batch of synthetic samples to 10 class scores, so one loss serves them all. The
descriptions are torch-free (``phalanx --help`` must not import torch); tests check their counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CLASSES = 10
IMAGE = (3, 224, 224)  # the tutorial's images
SMALL_IMAGE = (3, 32, 32)  # CIFAR-sized, for the conv net
MLP_WIDTH = 1024
TOKENS, D_MODEL, HEADS, FEEDFORWARD = 32, 128, 4, 512


@dataclass(frozen=True)
class BenchModel:
    name: str
    #: What it is, for --help and the report.
    summary: str
    #: Trainable parameters (what DDP all-reduces each step).
    parameters: int
    #: The shape of one sample; a batch is (batch size, *sample_shape).
    sample_shape: tuple[int, ...]
    #: Makes a fresh torch.nn.Module (initialised from torch's current random state).
    build: Callable[[], Any]


def _linear() -> Any:
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(IMAGE[0] * IMAGE[1] * IMAGE[2], CLASSES))


def _mlp() -> Any:
    from torch import nn

    return nn.Sequential(
        nn.Linear(MLP_WIDTH, MLP_WIDTH),
        nn.ReLU(),
        nn.Linear(MLP_WIDTH, MLP_WIDTH),
        nn.ReLU(),
        nn.Linear(MLP_WIDTH, CLASSES),
    )


def _conv() -> Any:
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32x32 -> 16x16
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # -> 8x8
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, CLASSES),
    )  # fmt: skip


def _transformer() -> Any:
    import torch
    from torch import nn

    class TransformerClassifier(nn.Module):
        """One encoder block over the tokens, their mean, a linear head."""

        def __init__(self) -> None:
            super().__init__()
            # dropout 0: a benchmark step should not depend on random masks
            self.block = nn.TransformerEncoderLayer(D_MODEL, HEADS, FEEDFORWARD, dropout=0.0, batch_first=True)
            self.head = nn.Linear(D_MODEL, CLASSES)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(tokens).mean(dim=1))

    return TransformerClassifier()


MODELS: dict[str, BenchModel] = {
    model.name: model
    for model in (
        BenchModel("linear", "the tutorial's Linear(3*224*224, 10) on 3x224x224 images", 1_505_290, IMAGE, _linear),
        BenchModel("mlp", f"3 Linear layers {MLP_WIDTH}-{MLP_WIDTH}-{MLP_WIDTH}-10 with ReLU on {MLP_WIDTH} features",
                   2_109_450, (MLP_WIDTH,), _mlp),
        BenchModel("conv", "2 conv layers (32, 64 channels, 3x3, max-pool) and 2 Linear on 3x32x32 images", 545_098,
                   SMALL_IMAGE, _conv),
        BenchModel("transformer", f"nn.TransformerEncoderLayer (d_model {D_MODEL}, {HEADS} heads, feed-forward "
                   f"{FEEDFORWARD}), Linear head; {TOKENS} tokens", 199_562, (TOKENS, D_MODEL), _transformer),
    )
}  # fmt: skip
