"""The Triton fused deformable attention (kernels/triton/msda_fused.py), run by Triton's interpreter on CPU tensors.

A child process with TRITON_INTERPRET=1 runs ``loongkit::ms_deform_attn_fused`` with the MSDA backend
forced to 'triton' (so the dispatch in kernels/ops/ is exercised too), forward and backward through
autograd, with every torch.empty / empty_like / new_empty poisoned (NaN) so an element the kernels
forget to write shows. The parent compares the output and the gradients of value, projection (offsets
and logits) and reference points with the fp64 reference and with the C++ kernel. Fresh random inputs
every run; the seed is in every failure message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from loongkit_ops.kernels.ops import msda, msda_fused

SEED = int(torch.seed() % 2**31)
# (NQ, queue, Q, heads, C, level shapes, points, reference points R, per_level): TSA-like (queue 2, one
# reference point per level), two levels with odd C, MSDA3D-like (Z anchors dividing the points; 33
# channels leave most of a 64-lane block masked), one anchor per point, and queue 2 with anchors.
CASES = [
    (1, 2, 5, 2, 8, [(5, 6)], 4, 1, True),
    (2, 2, 3, 2, 5, [(4, 7), (2, 3)], 3, 2, True),
    (2, 1, 4, 2, 33, [(6, 3), (3, 2)], 4, 2, False),
    (1, 1, 3, 3, 6, [(4, 5)], 4, 4, False),
    (1, 2, 4, 1, 4, [(3, 3)], 2, 1, False),
]

SCRIPT = """
    from loongkit_ops.kernels.ops import msda, msda_fused
    msda.backend = lambda t: ("triton", "")  # CPU tensors through the Triton branch
    seed, cases = ARGS
    gen = torch.Generator().manual_seed(seed)
    results = []
    for dtype in (torch.float32, torch.float64):
        for nq, queue, q, heads, c, shapes, points, anchors, per_level in cases:
            shapes_t = torch.tensor(shapes)
            areas = shapes_t[:, 0] * shapes_t[:, 1]
            starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
            value = torch.randn(nq * queue, int(areas.sum()), heads, c, generator=gen, dtype=dtype)
            r = len(shapes) if per_level else anchors
            ref = torch.rand(nq * queue, q, r, 2, generator=gen, dtype=dtype) * 1.2 - 0.1
            n = heads * queue * len(shapes) * points
            # Rows 3n + 5 apart (the modules pass a slice); offsets of a few pixels, so samples inside,
            # across the border and beyond the maps; the first sample of each row far off every map.
            base = torch.randn(nq, q, 3 * n + 5, generator=gen, dtype=dtype)
            base[..., :2 * n] *= 3
            base[..., 0] = 40.0
            grad = torch.randn(nq, q, heads * c, generator=gen, dtype=dtype)
            v, rf, b = (t.clone().requires_grad_() for t in (value, ref, base))
            out = msda_fused.op(v, shapes_t, starts, rf, b[..., :3 * n], per_level, queue)
            out.backward(grad)
            results.append(dict(case=(nq, queue, q, heads, c, shapes, points, anchors, per_level), value=value,
                                shapes=shapes_t, starts=starts, ref=ref, proj=base[..., :3 * n], grad=grad,
                                out=out.detach(), grad_value=v.grad, grad_ref=rf.grad, grad_proj=b.grad,
                                backend=msda_fused.backend(value)[0]))
    save(results)
"""


def test_triton_kernel_interpreted(ext: Any, run_interpreted: Callable[..., Any]) -> None:
    results = run_interpreted(SCRIPT, SEED, CASES)
    assert len(results) == 2 * len(CASES)
    for r in results:
        value, shapes, starts, ref, proj, grad = r["value"], r["shapes"], r["starts"], r["ref"], r["proj"], r["grad"]
        nq, queue, q, heads, c, _, _, _, per_level = r["case"]
        dtype = value.dtype
        msg = f"seed {SEED}, case {r['case']}, {dtype}"
        assert r["backend"] == "triton", msg
        n = proj.shape[2]
        # The padding columns after the slice get no gradient; the slice's part is the op's grad_proj.
        assert torch.equal(r["grad_proj"][..., n:], torch.zeros(nq, q, 5, dtype=dtype)), msg
        got = {"out": r["out"], "grad_value": r["grad_value"], "grad_ref": r["grad_ref"],
               "grad_proj": r["grad_proj"][..., :n]}
        shapes_want = {"out": (nq, q, heads * c), "grad_value": value.shape, "grad_ref": ref.shape,
                       "grad_proj": proj.shape}
        for name, t in got.items():
            assert t.dtype == dtype and t.shape == shapes_want[name] and not t.isnan().any(), f"{name} {msg}"

        v, rf, p = (t.to(torch.float64, copy=True).requires_grad_() for t in (value, ref, proj))
        expected = msda_fused.reference(v, shapes, starts, rf, p, per_level, queue)
        expected.backward(grad.double())
        want = {"out": expected.detach(), "grad_value": v.grad, "grad_ref": rf.grad, "grad_proj": p.grad}
        eps = 1e-5 if dtype == torch.float32 else 1e-12
        for name, t in got.items():
            scale = float(want[name].abs().max()) or 1.0
            torch.testing.assert_close(t.double(), want[name], rtol=eps, atol=eps * scale,
                                       msg=lambda m, s=f"{name} {msg}": f"{s}: {m}")

        assert msda.backend(value)[0] == "cpu"
        cv, cr, cp = (t.clone().requires_grad_() for t in (value, ref, proj))  # proj: contiguous copy
        cpu = msda_fused.op(cv, shapes, starts, cr, cp, per_level, queue)
        cpu.backward(grad)
        theirs = {"out": cpu.detach(), "grad_value": cv.grad, "grad_ref": cr.grad, "grad_proj": cp.grad}
        for name, t in got.items():
            scale = float(theirs[name].abs().max()) or 1.0
            torch.testing.assert_close(t, theirs[name], rtol=eps, atol=eps * scale,
                                       msg=lambda m, s=f"{name} vs C++ kernel {msg}": f"{s}: {m}")
