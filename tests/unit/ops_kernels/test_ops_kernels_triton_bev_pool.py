"""The Triton bev_pool kernel (kernels/triton/bev_pool.py), run by Triton's interpreter on CPU tensors.

A child process with TRITON_INTERPRET=1 runs the ops with their backend forced to 'triton' (so the
dispatch in kernels/ops/ is exercised too), forward and backward through autograd, with every
torch.empty / empty_like / new_empty poisoned (NaN, or -7 for integers) so an element the kernels
forget to write shows. The parent compares the results with the fp64 reference and with the C++
kernel. Fresh random inputs every run; the seed is in every failure message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from loongkit_ops.kernels.ops import bev_pool

SEED = int(torch.seed() % 2**31)
# (points, channels, B, Z, X, Y): 130 channels span two channel blocks; a single point; an empty grid axis.
CASES = [(40, 5, 2, 2, 3, 4), (1, 3, 1, 1, 2, 2), (24, 130, 1, 2, 2, 3), (30, 4, 3, 1, 1, 5), (6, 2, 1, 0, 2, 2)]

SCRIPT = """
    from loongkit_ops.kernels.ops import bev_pool
    bev_pool.backend = lambda t: ("triton", "")  # CPU tensors through the Triton branch
    seed, cases = ARGS
    gen = torch.Generator().manual_seed(seed)
    results = []
    for dtype in (torch.float32, torch.float64):
        for n, c, b, z, x, y in cases:
            feats = torch.randn(n, c, generator=gen, dtype=dtype)
            # One beyond each side of the grid too: those points must be dropped.
            coords = torch.stack([torch.randint(-1, d + 1, (n,), generator=gen) for d in (x, y, z, b)], 1)
            if n > 3:
                coords[1:3] = coords[0]  # several points in one voxel
            grad = torch.randn(b, c, z, x, y, generator=gen, dtype=dtype)
            f = feats.clone().requires_grad_()
            out = bev_pool.op(f, coords.to(torch.int32), b, z, x, y)
            out.backward(grad)
            results.append(dict(case=(n, c, b, z, x, y), feats=feats, coords=coords, grad=grad, out=out.detach(),
                                grad_feats=f.grad))
    save(results)
"""


def test_triton_kernel_interpreted(ext: Any, run_interpreted: Callable[..., Any]) -> None:
    results = run_interpreted(SCRIPT, SEED, CASES)
    assert len(results) == 2 * len(CASES)
    for r in results:
        feats, coords, grad, out, grad_feats = r["feats"], r["coords"], r["grad"], r["out"], r["grad_feats"]
        n, c, b, z, x, y = r["case"]
        dtype = feats.dtype
        msg = f"seed {SEED}, case {r['case']}, {dtype}"
        assert out.dtype == dtype and out.shape == (b, c, z, x, y), msg
        assert grad_feats.dtype == dtype and grad_feats.shape == (n, c), msg
        fd = feats.detach().double().requires_grad_()
        expected = bev_pool.reference(fd, coords, b, z, x, y)
        expected.backward(grad.double())
        tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-13, "atol": 1e-13}
        torch.testing.assert_close(out.double(), expected.detach(), **tol, msg=lambda m, s=msg: f"out {s}: {m}")
        # The backward is a gather: exact, zeros for dropped points.
        torch.testing.assert_close(grad_feats.double(), fd.grad, rtol=0, atol=0, msg=lambda m, s=msg: f"grad {s}: {m}")
        assert bev_pool.backend(feats)[0] == "cpu"
        cpu = bev_pool.op(feats, coords, b, z, x, y)
        torch.testing.assert_close(out, cpu, **tol, msg=lambda m, s=msg: f"vs C++ kernel {s}: {m}")
        torch.testing.assert_close(grad_feats, bev_pool.backward_op(grad, coords, b, z, x, y), rtol=0, atol=0,
                                   msg=lambda m, s=msg: f"grad vs C++ kernel {s}: {m}")
