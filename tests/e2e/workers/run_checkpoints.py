"""A phalanx.Run training whose checkpoints the tests interfere with.

--checkpoint-dir BASE --node-local: each node has its own folder, BASE/node{K}, where K is its
node rank (GROUP_RANK) shifted by --shift: with --shift 1 the node that holds rank 0 uses the
folder the other node had, as when a restart puts rank 0 on another machine.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", type=Path, required=True)
parser.add_argument("--node-local", action="store_true")
parser.add_argument("--shift", type=int, default=0)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--every", type=int, default=5)
parser.add_argument("--width", type=int, default=32, help="hidden width: 4096 makes a checkpoint of about 130 MB")
parser.add_argument("--async-checkpoints", action="store_true")
parser.add_argument("--crash-after", type=int, default=None, help="exit 1 right after this step (a crash)")
parser.add_argument("--crash-rank", type=int, default=None, help="only this rank crashes (default: every rank)")
parser.add_argument("--no-keep-last-step", dest="keep_last_step", action="store_false")
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

folder = args.checkpoint_dir
if args.node_local:
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    folder = folder / f"node{(int(os.environ['GROUP_RANK']) + args.shift) % nodes}"
run = phalanx.Run(folder, checkpoint_every=args.every, async_checkpoints=args.async_checkpoints, log_every=1000,
                  keep_last_step=args.keep_last_step)  # fmt: skip
torch.manual_seed(0)
model = run.setup_model(
    torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 4))
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
run.track(optimizer=optimizer)
data = TensorDataset(torch.randn(200, 16, generator=torch.Generator().manual_seed(1)), torch.arange(200) % 4)
loader = run.setup_dataloader(data, batch_size=8)  # 13 steps per epoch with 2 ranks: checkpoints fall mid-epoch
for _ in run.epochs(args.epochs):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        run.step(loss)
        if run.global_step == args.crash_after and args.crash_rank in (None, run.rank):
            os._exit(1)
summary = run.summary()
if run.is_main:
    args.out.write_text(json.dumps({**summary, "node_local": run.checkpoints.node_local}))
run.close()
