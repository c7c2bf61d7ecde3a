"""Total PSS growth of a training process and 4 forked DataLoader workers over one epoch.

The dataset holds N annotation dicts (mmdet 2.x ``data_infos`` style) and each item reads one. The
script runs itself twice under the loongkit prelude in the same run: LOONGKIT_PYTORCH=0 (baseline:
the plain list, copied page by page into every worker as they read it) and =1 (ours: the list is
serialized into one buffer and the parent's objects are gc-frozen before the workers fork).
Growth = PSS of main + workers after the epoch (workers still alive: persistent_workers) minus the
main process's PSS just before the DataLoader iterator was created.

    python benchmarks/dataloader_memory.py [--quick]      # 1,000,000 records (--quick: 100,000)

Prints ``BENCH dataloader_pss_growth baseline=<bytes> ours=<bytes> ratio=<baseline/ours>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


def pss(pid: int) -> int:
    """Proportional set size in bytes, from /proc/<pid>/smaps_rollup."""
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


class Annotations:
    """A torch-style map dataset over a list of mmdet-like annotation dicts."""

    def __init__(self, n: int) -> None:
        self.data_infos = [{"filename": f"images/{i:08d}.jpg", "width": 1600, "height": 900,
                            "ann": {"bboxes": [[float(i % 97), 2.0, 30.0 + i % 13, 40.0]],
                                    "labels": [i % 80], "bboxes_ignore": []}} for i in range(n)]

    def __len__(self) -> int:
        return len(self.data_infos)

    def __getitem__(self, i: int) -> int:
        info = self.data_infos[i]
        return info["width"] + len(info["ann"]["labels"])


def collate(batch: list[int]) -> int:
    return sum(batch)


def child(n: int, workers: int) -> None:
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    dataset = Annotations(n)
    loader = DataLoader(dataset, batch_size=1000, shuffle=True, num_workers=workers, collate_fn=collate,
                        persistent_workers=True, multiprocessing_context="fork",
                        generator=torch.Generator().manual_seed(0))
    before = pss(os.getpid())
    total = sum(loader)  # one epoch
    pids = [w.pid for w in loader._iterator._workers]  # workers alive: persistent_workers
    after = pss(os.getpid()) + sum(pss(p) for p in pids)
    print("RESULT " + json.dumps({"before": before, "after": after, "checksum": total,
                                  "type": type(dataset.data_infos).__name__}))


def run(variant: str, n: int, workers: int) -> dict[str, Any]:
    from loongkit_core.prelude import PATH

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOONGKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([PATH, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env["LOONGKIT_PYTORCH"] = "1" if variant == "ours" else "0"
    env["LOONGKIT_LOGDIR"] = "stderr"
    proc = subprocess.run([sys.executable, __file__, "--child", "--n", str(n), "--workers", str(workers)],
                          env=env, capture_output=True, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 records (< 1 min)")
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = args.n or (100_000 if args.quick else 1_000_000)
    if args.child:
        child(n, args.workers)
        return
    base, ours = run("baseline", n, args.workers), run("ours", n, args.workers)
    assert base["checksum"] == ours["checksum"], "the two epochs read different data"
    assert base["type"] == "list" and ours["type"] == "SerializedList", (base["type"], ours["type"])
    grow_b, grow_o = base["after"] - base["before"], ours["after"] - ours["before"]
    mib = 2**20
    print(f"# {n:,} records, {args.workers} fork workers: main PSS before {base['before'] / mib:,.0f} / "
          f"{ours['before'] / mib:,.0f} MiB; total after the epoch {base['after'] / mib:,.0f} / "
          f"{ours['after'] / mib:,.0f} MiB; growth {grow_b / mib:+,.0f} / {grow_o / mib:+,.0f} MiB (baseline / ours)")
    # Growth can be negative with the feature (serializing frees the list's objects); the ratio is
    # then reported against 1 MiB so it stays finite and conservative.
    print(f"BENCH dataloader_pss_growth baseline={grow_b} ours={grow_o} ratio={grow_b / max(grow_o, mib):.2f}")
    print(f"BENCH dataloader_pss_total baseline={base['after']} ours={ours['after']} "
          f"ratio={base['after'] / ours['after']:.2f}")


if __name__ == "__main__":
    main()
