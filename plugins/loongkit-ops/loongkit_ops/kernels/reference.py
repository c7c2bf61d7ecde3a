"""Independent references of the ops, written from the algorithms (not from upstream code).

They are differentiable with plain autograd, run in whatever dtype they are given (tests pass
float64), and serve as the custom ops' fallback when no compiled kernel can run.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ms_deform_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                   sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """Multi-scale deformable attention by explicit gathers of the four bilinear corners.

    value [bs, K, heads, C]; sampling_locations [bs, Lq, heads, L, P, 2] as (x, y) in [0, 1];
    attention_weights [bs, Lq, heads, L, P]. Pixel coordinate of u on an axis of size S is u*S - 0.5
    (align_corners=False); corners outside the map contribute zero. Returns [bs, Lq, heads*C].
    """
    bs, _, heads, C = value.shape
    _, Lq, _, _, P, _ = sampling_locations.shape
    shapes = [(int(h), int(w)) for h, w in spatial_shapes.tolist()]
    starts = [int(s) for s in level_start_index.tolist()]
    out = value.new_zeros(bs, Lq, heads, C)
    by_head = value.permute(0, 2, 1, 3)  # [bs, heads, K, C]
    for level, (h_l, w_l) in enumerate(shapes):
        v = by_head[:, :, starts[level]:starts[level] + h_l * w_l]
        x = sampling_locations[:, :, :, level, :, 0] * w_l - 0.5  # [bs, Lq, heads, P]
        y = sampling_locations[:, :, :, level, :, 1] * h_l - 0.5
        x0, y0 = torch.floor(x).detach(), torch.floor(y).detach()
        a = attention_weights[:, :, :, level]
        for dy in (0.0, 1.0):
            for dx in (0.0, 1.0):
                xi, yi = x0 + dx, y0 + dy
                weight = (1 - (x - xi).abs()) * (1 - (y - yi).abs())
                inside = (xi >= 0) & (xi < w_l) & (yi >= 0) & (yi < h_l)
                index = (yi.clamp(0, h_l - 1) * w_l + xi.clamp(0, w_l - 1)).long()  # [bs, Lq, heads, P]
                index = index.permute(0, 2, 1, 3).reshape(bs, heads, Lq * P, 1).expand(-1, -1, -1, C)
                corner = torch.gather(v, 2, index).reshape(bs, heads, Lq, P, C).permute(0, 2, 1, 3, 4)
                coeff = (a * weight * inside)[..., None]
                out = out + (coeff * corner).sum(3)
    return out.reshape(bs, Lq, heads * C)


def dice_stats(logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    """Per-sample (sum p*t, sum p^2 or sum p, sum t^2) of mmseg 1.x DiceLoss; logits [N, C, S], target [N, S].

    activation: 0 identity, 1 sigmoid, 2 softmax over C. t is the one-hot of clamp(target, 0, C)
    without the extra class C; class ``drop_class`` (if in range) is left out of every sum.
    """
    n, c, _ = logits.shape
    if activation == 1:
        p = torch.sigmoid(logits)
    elif activation == 2:
        p = torch.softmax(logits, dim=1)
    else:
        p = logits
    labels = target.clamp(0, c)
    onehot = (labels[:, None, :] == torch.arange(c, device=logits.device)[None, :, None]).to(p.dtype)
    keep = torch.ones(c, dtype=p.dtype, device=p.device)
    if 0 <= drop_class < c:
        keep[drop_class] = 0
    keep = keep[None, :, None]
    a = (p * onehot * keep).sum((1, 2))
    b = ((p if naive else p * p) * keep).sum((1, 2))
    t = (onehot * keep).sum((1, 2))
    return torch.stack([a, b, t], 1).reshape(n, 3)
