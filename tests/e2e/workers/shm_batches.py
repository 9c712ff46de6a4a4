"""A DataLoader whose worker hands over batches of 8 MiB, through /dev/shm as torch does."""

import torch
from torch.utils.data import DataLoader, Dataset


class Large(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.ones(2 * 1024**2)  # 8 MiB of float32


for batch in DataLoader(Large(), batch_size=1, num_workers=1):
    print(f"batch of {batch.numel() * 4 // 1024**2} MiB")
