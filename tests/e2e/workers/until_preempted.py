"""A phalanx.Run training that only a preemption can end on its first start: a fresh start trains
on with no end, and a resumed start trains --more steps past the step it resumed from, then ends
with its metrics. A test of a scheduler's signal then cannot lose the race to a fast machine that
finishes a fixed training before the signal comes.

    until_preempted.py --checkpoint-dir DIR --metrics-json PATH [--more STEPS]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", type=Path, required=True)
parser.add_argument("--metrics-json", type=Path, required=True)
parser.add_argument("--more", type=int, default=200, help="steps a resumed start trains before it ends")
args = parser.parse_args()

run = phalanx.Run(args.checkpoint_dir, checkpoint_every=500, log_every=100)
torch.manual_seed(0)
model = run.setup_model(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
run.track(optimizer=optimizer)
data = TensorDataset(torch.randn(256, 16, generator=torch.Generator().manual_seed(1)), torch.arange(256) % 4)
loader = run.setup_dataloader(data, batch_size=8)


def trained_enough() -> bool:
    return run.resumed_from is not None and run.global_step >= run.resumed_from + args.more


for _ in run.epochs(10**9):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        run.step(loss)
        if trained_enough():
            break
    if trained_enough():
        break
summary = run.summary()
if run.is_main:
    args.metrics_json.write_text(json.dumps(summary))
run.close()
