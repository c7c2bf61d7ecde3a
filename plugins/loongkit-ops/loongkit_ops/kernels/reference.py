"""Independent references of the ops, written from the algorithms (not from upstream code).

They are differentiable with plain autograd, run in whatever dtype they are given (tests pass
float64), and serve as the custom ops' fallback when no compiled kernel can run.
"""

from __future__ import annotations

from collections.abc import Sequence

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



def ms_deform_attn_fused(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                         reference_points: Tensor, projection: Tensor, per_level: bool, queue: int) -> Tensor:
    """BEVFormer's TemporalSelfAttention / MSDeformableAttention3D sampling from the raw projections.

    value [NQ*queue, K, heads, C]; reference_points [NQ*queue, Q, R, 2]; projection [NQ, Q,
    heads*queue*L*P*3] = [sampling offsets | attention logits] as the modules' two query projections
    output them. Weights are the softmax of the logits over (L, P); the location of (level l, point p)
    is the reference point ``l`` (per_level) or ``p % R`` plus offset / (W_l, H_l). Returns the mean
    over the queue of the sampled sums of query batch n from value batches n*queue + t: [NQ, Q, heads*C].
    """
    nv, _, heads, c = value.shape
    nq, q = projection.shape[:2]
    levels = spatial_shapes.shape[0]
    points = projection.shape[2] // (heads * queue * levels * 3)
    anchors = reference_points.shape[2]
    n_off = heads * queue * levels * points * 2
    off = projection[..., :n_off].reshape(nq, q, heads, queue, levels, points, 2)
    weights = projection[..., n_off:].reshape(nq, q, heads, queue, levels * points).softmax(-1)
    shapes = spatial_shapes.to(device=value.device, dtype=torch.int64)
    off = off / torch.stack([shapes[:, 1], shapes[:, 0]], -1).to(value.dtype)[:, None, :]
    ref = reference_points.reshape(nq, queue, q, anchors, 2).permute(0, 2, 1, 3, 4)  # [NQ, Q, queue, R, 2]
    if per_level:
        loc = ref[:, :, None, :, :, None, :] + off
    else:
        loc = ref[:, :, None, :, None, None] + off.reshape(nq, q, heads, queue, levels, points // anchors, anchors, 2)
    loc = loc.reshape(nq, q, heads, queue, levels, points, 2).permute(0, 3, 1, 2, 4, 5, 6)
    weights = weights.reshape(nq, q, heads, queue, levels, points).permute(0, 3, 1, 2, 4, 5)
    out = ms_deform_attn(value, shapes, level_start_index, loc.reshape(nv, q, heads, levels, points, 2),
                         weights.reshape(nv, q, heads, levels, points))
    return out.reshape(nq, queue, q, heads * c).mean(1)

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


def dice_class_stats(logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    """Per-(sample, class) (sum p*t*valid, sum p^e, sum t^e) of mmseg 0.x DiceLoss; [N, C, 3].

    p = softmax over C of logits [N, C, S]; t = one-hot of clamp(target, 0, C-1) (an ignored label
    such as 255 lands in class C-1's t); valid = target != ignore_index masks the first sum only.
    """
    c = logits.shape[1]
    p = torch.softmax(logits, dim=1)
    onehot = (target.clamp(0, c - 1)[:, None, :] == torch.arange(c, device=logits.device)[None, :, None]).to(p.dtype)
    valid = (target != ignore_index).to(p.dtype)[:, None, :]
    a = (p * onehot * valid).sum(2)
    b = p.pow(exponent).sum(2)
    t = onehot.pow(exponent).sum(2)
    return torch.stack([a, b, t], 2)


def deformable_aggregation(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
                           sampling_location: Tensor, weights: Tensor, inside_only: bool = True) -> Tensor:
    """Sparse4D's deformable aggregation by explicit gathers of the four bilinear corners.

    mc_ms_feat [bs, num_feat, C] (camera-major, then level, row-major H*W); spatial_shape [cams,
    levels, 2] as (H, W); scale_start_index [cams, levels]; sampling_location [bs, anchors, pts,
    cams, 2] as (x, y) in [0, 1]; weights [bs, anchors, pts, cams, levels, groups]. Channel c is
    weighted by group c // (C / groups). Pixel coordinate u*S - 0.5, out-of-map corners read zero.
    inside_only: a sample whose x or y is not strictly inside (0, 1) contributes nothing (the
    upstream CUDA kernel's rule); otherwise every location is sampled like grid_sample.
    Returns [bs, anchors, C].
    """
    bs, _, C = mc_ms_feat.shape
    _, A, P, cams, _ = sampling_location.shape
    levels, groups = weights.shape[4], weights.shape[5]
    shapes = [[(int(h), int(w)) for h, w in row] for row in spatial_shape.tolist()]
    starts = [[int(s) for s in row] for row in scale_start_index.reshape(cams, levels).tolist()]
    x, y = sampling_location[..., 0], sampling_location[..., 1]  # [bs, A, P, cams]
    keep = (x > 0) & (x < 1) & (y > 0) & (y < 1) if inside_only else torch.ones_like(x, dtype=torch.bool)
    out = mc_ms_feat.new_zeros(bs, A, groups, C // groups)
    for cam in range(cams):
        for level in range(levels):
            h_l, w_l = shapes[cam][level]
            fm = mc_ms_feat[:, starts[cam][level]:starts[cam][level] + h_l * w_l]  # [bs, HW, C]
            px = x[..., cam] * w_l - 0.5  # [bs, A, P]
            py = y[..., cam] * h_l - 0.5
            # NaN or far locations never select a corner; their index is clamped only to stay legal.
            x0 = torch.floor(px.detach().nan_to_num(-10).clamp(-10, w_l + 10))
            y0 = torch.floor(py.detach().nan_to_num(-10).clamp(-10, h_l + 10))
            sample = mc_ms_feat.new_zeros(bs, A, P, C)
            for dy in (0.0, 1.0):
                for dx in (0.0, 1.0):
                    xi, yi = x0 + dx, y0 + dy
                    inside = (xi >= 0) & (xi < w_l) & (yi >= 0) & (yi < h_l) & keep[..., cam]
                    weight = torch.where(inside, (1 - (px - xi).abs()) * (1 - (py - yi).abs()), 0.0)
                    index = (yi.clamp(0, h_l - 1) * w_l + xi.clamp(0, w_l - 1)).long().reshape(bs, A * P, 1)
                    corner = torch.gather(fm, 1, index.expand(-1, -1, C)).reshape(bs, A, P, C)
                    sample = sample + weight[..., None] * corner
            w = weights[:, :, :, cam, level]  # [bs, A, P, groups]
            out = out + (sample.reshape(bs, A, P, groups, C // groups) * w[..., None]).sum(2)
    return out.reshape(bs, A, C)


def bev_pool(feats: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    """BEVFusion's bev_pool: sum of feats [N, C] per voxel coords [N, 4] = (x, y, z, batch) -> [B, C, Z, X, Y].

    Points outside the grid are dropped. Written as an index_add over flattened voxels (no sort).
    """
    C = feats.shape[1]
    x, y, z, b = coords.long().unbind(1)
    inside = (x >= 0) & (x < X) & (y >= 0) & (y < Y) & (z >= 0) & (z < Z) & (b >= 0) & (b < B)
    voxel = ((b * Z + z) * X + x) * Y + y
    out = feats.new_zeros(B * Z * X * Y, C)
    out = out.index_add(0, voxel[inside], feats[inside])
    return out.reshape(B, Z, X, Y, C).permute(0, 4, 1, 2, 3).contiguous()


def _voxel_coords(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float]) -> tuple[Tensor, Tensor]:
    """((z, y, x) int64 [N, 3], inside [N] bool) with mmcv's arithmetic: float32 grid values, computed
    in float32 for float32/float16 points and in float64 for float64 points."""
    size = torch.tensor(list(voxel_size), dtype=torch.float32)
    rng = torch.tensor(list(coors_range), dtype=torch.float32)
    grid = torch.round((rng[3:] - rng[:3]) / size).to(torch.int64)
    acc = torch.float64 if points.dtype == torch.float64 else torch.float32
    f = torch.floor((points[:, :3].to(acc) - rng[:3].to(acc)) / size.to(acc))
    inside = ((f >= 0) & (f < grid.to(acc))).all(1)  # NaN fails: dropped
    xyz = torch.where(inside[:, None], f, torch.zeros_like(f)).to(torch.int64)
    return xyz.flip(1), inside


def dynamic_voxelize(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float]) -> Tensor:
    """mmcv's dynamic voxelization: int32 (z, y, x) per point, -1 rows outside the range."""
    zyx, inside = _voxel_coords(points, voxel_size, coors_range)
    return torch.where(inside[:, None], zyx, torch.full_like(zyx, -1)).to(torch.int32)


def hard_voxelize(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float], max_points: int,
                  max_voxels: int) -> tuple[Tensor, Tensor, Tensor]:
    """mmcv's deterministic hard voxelization, by sorting instead of a sequential scan.

    A voxel's id is the rank of its first point's index among the voxels' first points (ids >=
    max_voxels are dropped with all their points); a point's slot is its rank among its voxel's
    points in input order (slots >= max_points are dropped); unused slots are zero.
    """
    n, feat = points.shape
    zyx, inside = _voxel_coords(points, voxel_size, coors_range)
    idx = torch.nonzero(inside).flatten()
    zyx = zyx[idx]
    keys, inverse = torch.unique(zyx, dim=0, return_inverse=True)
    first = torch.full((keys.shape[0],), n, dtype=torch.int64).scatter_reduce(0, inverse, idx, "amin")
    order = torch.argsort(first)  # voxel ids in order of their first point
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    vid = rank[inverse]  # voxel id of each kept point
    # Slot: the point's position among its voxel's points (a stable sort by voxel id keeps input order).
    by_voxel = torch.sort(vid, stable=True)
    starts = torch.searchsorted(by_voxel.values, by_voxel.values, right=False)
    slot = torch.empty_like(vid)
    slot[by_voxel.indices] = torch.arange(vid.numel()) - starts
    m = min(int(keys.shape[0]), max_voxels)
    keep = (vid < m) & (slot < max_points)
    voxels = points.new_zeros(m, max_points, feat)
    voxels[vid[keep], slot[keep]] = points[idx[keep]]
    counts = torch.bincount(vid[vid < m], minlength=m).clamp(max=max_points)
    coors = keys[order[:m]].to(torch.int32)
    return voxels, coors, counts.to(torch.int32)
