"""Rank 1 builds a dataset one sample longer than the others' and a wider model."""

import torch

import phalanx
from phalanx.runtime.consistency import check_consistency

context = phalanx.init()
extra = int(context.rank == 1)
model = torch.nn.Linear(4 + extra, 2)
check_consistency(context, model=model, dataset=range(100 + extra))
print("consistent")  # never reached
