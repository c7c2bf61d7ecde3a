"""Step time with and without the prefetcher of LOONGKIT_DATA_PREFETCH / LOONGKIT_MMENGINE_DATA_PREFETCH.

A loop over pinned host batches (detection-sized images) whose step copies the batch to the GPU
(what cast_data / scatter do) and then computes; with the prefetcher the copy of batch k+1 runs on a
side stream during step k. Needs a CUDA device; prints a SKIP line otherwise.

    python benchmarks/gpu/data_prefetch.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from loongkit_data.prefetch import CudaLayer, Prefetcher


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP data_prefetch: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device())
    steps = 20 if args.quick else 100
    batches = [{"inputs": torch.rand(8, 3, 800, 1333).pin_memory(), "labels": torch.arange(64).pin_memory()}
               for _ in range(4)]
    weight = torch.rand(2048, 2048, device=dev)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["inputs"].to(dev, non_blocking=False)  # cast_data's copy; a no-op when prefetched
        acc = x.mean()
        for _ in range(30):
            acc = acc + (weight @ weight).mean()
        return acc

    def source() -> list[dict[str, torch.Tensor]]:
        return [batches[i % len(batches)] for i in range(steps)]

    def timed(iterable: object) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in iterable:  # type: ignore[attr-defined]
            step(batch)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(source()[:3])  # warm-up (cuBLAS, allocator)
    layer = CudaLayer(torch, dev)
    baseline = timed(source())
    ours = timed(Prefetcher(iter(source()), layer))
    print(f"BENCH data_prefetch_step baseline={baseline:.4f} ours={ours:.4f} ratio={baseline / ours:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
