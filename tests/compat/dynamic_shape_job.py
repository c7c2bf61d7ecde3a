"""A training-style job for the torch 2.9 compat row (noxfile compat-torch2.9): three dynamic-shape inductor
compiles, each after torch._dynamo.reset() (as torch 2.9's dynamic-shape probe did before each case).
Under LOONGKIT_DYNAMIC_SHAPE_FIX=1 the Summary's dynamic_shape_fix row must be starred with 3 calls
(before the fix of issue 26 it read "applied, its code did not run": reset cleared the counter)."""

from __future__ import annotations

import torch
import torch._dynamo


def step(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sin().sum(0)


for n in (3, 5, 7):
    torch._dynamo.reset()  # as the 2.9 probe did before each case
    fn = torch.compile(step, dynamic=True, backend="inductor")
    torch.testing.assert_close(fn(torch.ones(n, 4)), step(torch.ones(n, 4)))
print("compiled 3 cases, torch", torch.__version__)
