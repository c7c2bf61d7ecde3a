"""The torch 2.8 compat row's job (noxfile compat-torch2.8, LOONGKIT_DONATED_BUFFER_FIX): run with
`torchrun --nproc-per-node 2`, gloo on the CPU.

Each rank trains the same MLP (six 512x512 Linear + ReLU layers) twice on the same batches, in one process
group: eagerly under DDP, and compiled (`DDP(torch.compile(model))`, inductor) with 1 MiB DDP buckets, so that
DDPOptimizer splits the dynamo graph into several AOTAutograd graphs. On torch 2.6-2.8 each split
graph's backward then uses the last graph's `bw_donated_idxs` (pytorch/pytorch#160745): where that index
names a buffer still live in another graph, inductor writes into it and weights go wrong. With this MLP on
torch 2.8.0 (CPU) the misdonated index names a middle graph's incoming gradient (`tangents_1`, dead after
its use), so the bare run still equals eager: the job shows the fix applied, starred and harmless, not the
corruption itself.

Prints one line per rank: `rank R: max weight diff compiled vs eager X (relative Y) sha256 S` (S: the
compiled model's final weights, for comparing runs bitwise). `DONATED_BUFFER_OFF=1` applies upstream's
manual workaround (`torch._functorch.config.donated_buffer = False`) before anything compiles.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS = 5
WIDTH = 512
LAYERS = 6


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


def train(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def main() -> None:
    if os.environ.get("DONATED_BUFFER_OFF") == "1":
        import torch._functorch.config as fconfig

        fconfig.donated_buffer = False
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as in training
    batches = [(torch.randn(16, WIDTH, generator=generator), torch.randn(16, 1, generator=generator))
               for _ in range(STEPS)]

    eager = make_model()
    train(DistributedDataParallel(eager), batches)

    compiled = make_model()
    # 1 MiB buckets (DDPOptimizer wants none smaller than DDP's 1 MiB first bucket), one 512x512 Linear each:
    # DDPOptimizer splits the graph into several.
    # DDP around the compiled model: DDP's forward runs eagerly and marks itself the active DDP module, so
    # dynamo hands the model's frame to DDPOptimizer.
    train(DistributedDataParallel(torch.compile(compiled, backend="inductor"), bucket_cap_mb=1), batches)

    # The largest difference of any weight, relative to that tensor's largest eager value.
    pairs = list(zip(compiled.parameters(), eager.parameters(), strict=True))
    diff = max((a - b).abs().max().item() for a, b in pairs)
    relative = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in compiled.parameters())).hexdigest()
    print(f"rank {rank}: max weight diff compiled vs eager {diff:.3g} (relative {relative:.3g}) "
          f"sha256 {digest[:16]} torch {torch.__version__}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
