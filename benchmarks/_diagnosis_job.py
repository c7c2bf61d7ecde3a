"""One small training job of the planted-fault suite (benchmarks/diagnosis.py), configured by a JSON argument.

A plain PyTorch loop written for the suite, not by the monitor's authors' examples: an MLP on synthetic
data, a DataLoader, an optimizer. Each knob plants one cause (or leaves the job healthy):

* ``workers``, ``persistent``, ``epochs``, ``rebuild`` (a new DataLoader per epoch);
* ``numpy_ms`` per sample of numpy work, ``sleep_ms`` per sample of waiting (slow storage: a file read
  plus latency), ``collate_ms`` of CPU work per batch in the collate function;
* ``threads`` (torch.set_num_threads), ``width`` of the model (its compute);
* ``keep_mib`` per step kept by the main loop (a leak), ``worker_keep_kib`` per sample kept by each
  worker, ``records`` (a list of dicts the dataset indexes: copy-on-write in fork workers);
* ``sleep_rank`` / ``rank_sleep_ms``: one rank of a torchrun job slower than the others;
* ``print_loss``: a ``step N loss: X`` line per step (what ``loongkit tune`` compares results by).

It prints ``RESULT {...}``: its own mean step after the first (perf_counter around each step, the
job's own clock) and its own memory (main RSS and the workers' private memory at a third
of the run and at the end), the truth the suite compares planted and fixed runs by.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

CFG = {"steps": 60, "batch": 8, "workers": 0, "persistent": False, "epochs": 1, "rebuild": False, "numpy_ms": 0.0,
       "sleep_ms": 0.0, "collate_ms": 0.0, "threads": 1, "width": 256, "keep_mib": 0.0, "worker_keep_kib": 0.0,
       "records": 0, "tensor_dataset": False, "rank_sleep_ms": 0.0, "sleep_rank": 1, "files": "", "print_loss": False}

KEPT: list[object] = []  # what a leaking worker keeps (per process)


def busy_numpy(ms: float, seed: int) -> np.ndarray:
    """About ``ms`` of this thread's CPU time in numpy (sorts of a random array). CPU time, not wall time:
    work that a descheduled process finished by the clock alone would make more workers than CPUs look
    faster than they can be."""
    rng = np.random.default_rng(seed)
    end = time.thread_time() + ms / 1000
    out = rng.standard_normal(16)
    while time.thread_time() < end:
        out = np.sort(rng.standard_normal(4096))[:16]
    return out


class Planted(Dataset):
    def __init__(self, n: int, cfg: dict) -> None:
        self.n, self.cfg = n, cfg
        self.records = [{"id": i, "label": i % 10, "name": f"sample-{i:08d}-" + "x" * 40}
                        for i in range(int(cfg["records"]))]
        self.files = cfg["files"]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x = np.full(32, float(i % 7), dtype=np.float32)
        if self.records:
            # reading the sample's own records touches their reference counts: copy-on-write in fork workers,
            # page by page as the epoch goes on
            chunk = max(1, len(self.records) // self.n)
            label = sum(r["label"] + len(r["name"]) for r in self.records[i * chunk:(i + 1) * chunk])
            x[0] = label % 3
        if self.files:
            with open(os.path.join(self.files, f"{i % 64}.bin"), "rb") as fh:
                x[:8] = np.frombuffer(fh.read(32), dtype=np.float32)
        if cfg["sleep_ms"]:
            time.sleep(cfg["sleep_ms"] / 1000)  # the storage's latency
        if cfg["numpy_ms"]:
            x[:16] += busy_numpy(cfg["numpy_ms"], i).astype(np.float32)
        if cfg["worker_keep_kib"]:
            KEPT.append(np.ones(int(cfg["worker_keep_kib"] * 256), dtype=np.float32))
        return torch.from_numpy(x), torch.tensor(i % 2, dtype=torch.float32)


def collate(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    ms = CFG_RUN.get("collate_ms", 0.0)
    if ms:
        busy_numpy(ms, len(batch))
    return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])


CFG_RUN: dict = {}


def private_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return sum(int(line.split()[1]) * 1024 for line in fh
                       if line.startswith(("Private_Clean", "Private_Dirty")))
    except OSError:
        return 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    cfg = dict(CFG)
    cfg.update(json.loads(sys.argv[1]))
    CFG_RUN.update(cfg)
    torch.manual_seed(0)
    torch.set_num_threads(int(cfg["threads"]))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    width = int(cfg["width"])
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 1))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps, epochs = int(cfg["steps"]), int(cfg["epochs"])
    per_epoch = max(1, steps // epochs)
    n = per_epoch * int(cfg["batch"])
    if cfg["tensor_dataset"]:
        dataset: Dataset = TensorDataset(torch.randn(n, 32), torch.randint(0, 2, (n,)).float())
    else:
        dataset = Planted(n, cfg)

    def loader() -> DataLoader:
        workers = int(cfg["workers"])
        return DataLoader(dataset, batch_size=int(cfg["batch"]), num_workers=workers, collate_fn=collate,
                          persistent_workers=bool(cfg["persistent"]) and workers > 0)

    kept: list[torch.Tensor] = []
    walls: list[float] = []
    mem: dict[str, list[int]] = {"rss": [], "workers_private": []}
    built = loader()
    last = time.perf_counter()
    done = 0
    for _epoch in range(epochs):
        dl = loader() if cfg["rebuild"] else built
        it = iter(dl)
        for x, y in it:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if cfg["print_loss"] and rank == 0:
                print(f"step {done} loss: {loss.item():.8f}", flush=True)
            if cfg["rank_sleep_ms"] and rank == int(cfg["sleep_rank"]):
                time.sleep(cfg["rank_sleep_ms"] / 1000)
            if cfg["keep_mib"]:
                kept.append(torch.ones(int(cfg["keep_mib"] * (1 << 18))))  # kept for ever: a leak
            now = time.perf_counter()
            walls.append(now - last)
            last = now
            done += 1
            if done in (steps // 3, steps):
                mem["rss"].append(rss_bytes())
                pids = [w.pid for w in getattr(it, "_workers", [])]
                mem["workers_private"].append(int(sum(private_bytes(p) for p in pids) / max(1, len(pids))) if pids
                                              else 0)
    # the mean step after the first (which starts the first workers in every variant): epoch starts and
    # rebuilt loaders count where they happen
    out = {"step_s": statistics.fmean(walls[1:]), "median_s": statistics.median(walls[len(walls) // 2:]),
           "steps": done, "rank": rank,
           "rss_growth": mem["rss"][-1] - mem["rss"][0] if len(mem["rss"]) == 2 else 0,
           "worker_private_growth": (mem["workers_private"][-1] - mem["workers_private"][0]
                                     if len(mem["workers_private"]) == 2 else 0)}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
