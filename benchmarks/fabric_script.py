"""A small Lightning Fabric DDP training script, as users write them: benchmarks/fabric_exits.py
runs it on two test-bed hosts (one process each, CPU, gloo).

Like every Fabric script it never destroys its process group: Fabric leaves that to interpreter
shutdown. It prints ``FABRIC_DONE rank R loss L`` once training is over, so that an abort after
that line is an abort at exit, not a failure of the training.

Usage (under a launcher): fabric_script.py [--steps 20] [--batch-size 16]
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=1, num_nodes=2)
    fabric.launch()
    fabric.seed_everything(0)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(args.steps * args.batch_size * fabric.world_size, 32, generator=generator)
    targets = inputs @ torch.randn(32, 1, generator=generator)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=args.batch_size, shuffle=True)

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)

    loss = torch.tensor(0.0)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
    print(f"FABRIC_DONE rank {fabric.global_rank} loss {loss.item():.4f}", flush=True)
    # No torch.distributed.destroy_process_group(): the group is left to interpreter shutdown.


if __name__ == "__main__":
    main()
