"""A small but real PyTorch training job: a CNN classifier on synthetic images, DataLoader workers,
AdamW, optional DDP under torchrun. Nothing in it knows about loongkit.

    python examples/train_classifier.py --steps 60
    LOONGKIT_ALL=1 loongkit-run python examples/train_classifier.py
    LOONGKIT_ALL=1 loongkit-run torchrun --nproc-per-node 2 examples/train_classifier.py

The dataset is generated (no downloads): each class is a noisy oriented stripe pattern, so the
loss really falls. Prints the loss every 10 steps and a final line with the median step time.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Stripes(Dataset):
    """Class k = stripes at angle k*pi/classes, plus noise; a list of per-sample dicts like a detector's."""

    def __init__(self, n: int, classes: int = 8, size: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.samples = [{"label": int(torch.randint(classes, (1,), generator=g)), "seed": seed * 1_000_003 + i}
                        for i in range(n)]
        self.classes, self.size = classes, size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        info = self.samples[index]
        g = torch.Generator().manual_seed(info["seed"])
        angle = math.pi * info["label"] / self.classes
        ys, xs = torch.meshgrid(torch.arange(self.size), torch.arange(self.size), indexing="ij")
        phase = float(torch.rand((), generator=g)) * 6.28
        wave = torch.sin((xs * math.cos(angle) + ys * math.sin(angle)) * 0.8 + phase)
        image = wave.expand(3, -1, -1) + 0.5 * torch.randn(3, self.size, self.size, generator=g)
        return image.float(), info["label"]


class Net(nn.Module):
    def __init__(self, classes: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1)
    args = parser.parse_args()

    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)

    world = torch.distributed.get_world_size() if distributed else 1
    dataset = Stripes(args.steps * args.batch_size * world)  # every rank gets `steps` full batches
    sampler = DistributedSampler(dataset, seed=args.seed) if distributed else None
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler,
                        num_workers=args.workers, generator=torch.Generator().manual_seed(args.seed))
    model = Net().to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    times = []
    step = 0
    start = time.perf_counter()
    for images, labels in loader:
        data_time = time.perf_counter() - start
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        now = time.perf_counter()
        times.append(now - start)
        start = now
        if rank == 0 and step % args.log_every == 0:
            print(f"step {step:4d} loss: {loss.item():.6f} time: {times[-1]:.4f} data_time: {data_time:.4f}",
                  flush=True)
        step += 1
        if step >= args.steps:
            break
    if rank == 0:
        warm = times[len(times) // 5:] or times
        # (no loss on this line: log parsers such as `loongkit compare` would count it as a step)
        print(f"done: {step} steps, median step {statistics.median(warm) * 1000:.1f} ms")
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
