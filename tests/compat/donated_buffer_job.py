"""The torch 2.8 compat row's job (noxfile compat-torch2.8, LOONGKIT_DONATED_BUFFER_FIX): run with
`torchrun --nproc-per-node 2`, gloo on the CPU.

Each rank trains the same monotone MLP (every Linear's weight clamped to >= 0 in forward, the usual way to keep
a regression net monotone in its inputs; 32 -> 5 x 1536 -> 1, ReLU) twice on the same batches, in one process
group: eagerly under DDP, and as `DDP(torch.compile(model))` (inductor) with DDP's default buckets, so that
DDPOptimizer splits the dynamo graph into three AOTAutograd graphs: [layer 1], [layers 2-4] (a 25 MiB bucket),
[layer 5, head] (DDP's 1 MiB first bucket). On torch 2.6-2.8 every backward graph then uses the last graph's
`bw_donated_idxs` (pytorch/pytorch#160745). The last graph's backward takes [layer 5's weight, its input, the
head's weight, the ReLU output, the two clamped weights, the incoming gradient]: it donates indices 3-5, its
own intermediates. In the [layers 2-4] graph's backward, index 3 is layer 4's weight itself (saved because the
clamp's backward, `where(weight >= 0, grad, 0)`, reads it): taken for a donated buffer, it is the storage that
kernel writes layer 4's weight gradient into. That weight ends up a (masked) gradient, about 100 % off eager's,
while upstream's workaround and the fix leave the compiled weights equal to eager's up to float32 reordering.

Prints one line per rank: `rank R: max weight diff compiled vs eager X (relative Y) sha256 S torch V` (Y: the
largest difference of any parameter relative to that tensor's largest eager value; S: the compiled model's
final weights, for comparing runs bitwise). `DONATED_BUFFER_OFF=1` applies upstream's manual workaround
(`torch._functorch.config.donated_buffer = False`) before anything compiles.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

STEPS = 5
BATCH = 16
FEATURES = 32
WIDTH = 1536  # 9 MiB per hidden weight: three of them fill one of DDP's default 25 MiB buckets
HIDDEN = 5


class NonNegativeLinear(torch.nn.Linear):
    """A Linear whose effective weight is clamped to >= 0: with ReLU, the net is monotone in every input."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        # Non-negative from the start, mean 1 / fan_in: activations keep their scale from layer to layer.
        torch.nn.init.uniform_(self.weight, 0.0, 2.0 / self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.clamp(min=0), self.bias)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    width = FEATURES
    for _ in range(HIDDEN):
        layers += [NonNegativeLinear(width, WIDTH), torch.nn.ReLU()]
        width = WIDTH
    return torch.nn.Sequential(*layers, NonNegativeLinear(width, 1))


def train(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def main() -> None:
    if os.environ.get("DONATED_BUFFER_OFF") == "1":
        import torch._functorch.config as fconfig

        fconfig.donated_buffer = False
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as in training
    batches = [(torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 1, generator=generator))
               for _ in range(STEPS)]

    eager = make_model()
    train(DistributedDataParallel(eager), batches)

    compiled = make_model()
    # DDP around the compiled model, default buckets: DDP's forward runs eagerly and marks itself the active
    # DDP module, so dynamo hands the model's frame to DDPOptimizer, which splits it at the bucket boundaries.
    train(DistributedDataParallel(torch.compile(compiled, backend="inductor")), batches)

    pairs = list(zip(compiled.parameters(), eager.parameters(), strict=True))
    diff = max((a - b).abs().max().item() for a, b in pairs)
    relative = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in compiled.parameters())).hexdigest()
    print(f"rank {rank}: max weight diff compiled vs eager {diff:.3g} (relative {relative:.3g}) "
          f"sha256 {digest[:16]} torch {torch.__version__}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
