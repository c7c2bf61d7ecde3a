"""A BEVFusion-style camera view transform package for loongkit's tests and benchmarks (no OpenMMLab here).

``source()`` is the text of a vendored ``vtransforms.py`` (written for this project from the
published BEVFusion algorithm: same public interface and maths, no upstream code): ``BaseTransform``
with ``create_frustum``, ``get_geometry(camera2lidar_rots, camera2lidar_trans, intrins, post_rots,
post_trans, **kwargs)`` and ``bev_pool(geom_feats, x)``, a registered ``LSSTransform`` subclass, and a
CPU stand-in for the CUDA ``bev_pool`` extension (sort by voxel rank, cumulative-sum trick, scatter).
The registry class is imported from the module the caller names (mmengine's in the integration
tests, the mmcv 1.x double in ``benchmarks/models.py``). ``camera_inputs`` makes nuScenes-like
camera matrices with random image and lidar augmentations.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import torch

SOURCE = textwrap.dedent('''
    """BEVFusion-style view transforms written for loongkit's tests (interface and maths of the paper's code)."""
    import torch
    from torch import nn
    from {registry} import Registry

    VTRANSFORMS = Registry("vtransforms")


    def bev_pool(feats, coords, B, D, H, W):
        """CPU stand-in for the CUDA extension: per-voxel sums via sort + cumulative sums -> [B, C, D, H, W]."""
        ranks = coords[:, 0] * (W * D * B) + coords[:, 1] * (D * B) + coords[:, 2] * B + coords[:, 3]
        order = ranks.argsort()
        feats, coords, ranks = feats[order], coords[order], ranks[order]
        sums = feats.cumsum(0)
        last = torch.ones(sums.shape[0], dtype=torch.bool)
        last[:-1] = ranks[1:] != ranks[:-1]
        sums, coords = sums[last], coords[last]
        sums = torch.cat((sums[:1], sums[1:] - sums[:-1]))
        out = sums.new_zeros(B, D, H, W, feats.shape[1])
        out[coords[:, 3], coords[:, 2], coords[:, 0], coords[:, 1]] = sums
        return out.permute(0, 4, 1, 2, 3).contiguous()


    def gen_dx_bx(xbound, ybound, zbound):
        rows = [xbound, ybound, zbound]
        dx = torch.tensor([r[2] for r in rows])
        bx = torch.tensor([r[0] + r[2] / 2.0 for r in rows])
        nx = torch.tensor([int(round((r[1] - r[0]) / r[2])) for r in rows], dtype=torch.long)
        return dx, bx, nx


    class BaseTransform(nn.Module):
        def __init__(self, in_channels, out_channels, image_size, feature_size, xbound, ybound, zbound, dbound):
            super().__init__()
            self.in_channels, self.C = in_channels, out_channels
            self.image_size, self.feature_size = image_size, feature_size
            self.dbound = dbound
            dx, bx, nx = gen_dx_bx(xbound, ybound, zbound)
            self.dx = nn.Parameter(dx, requires_grad=False)
            self.bx = nn.Parameter(bx, requires_grad=False)
            self.nx = nn.Parameter(nx, requires_grad=False)
            self.frustum = self.create_frustum()
            self.D = self.frustum.shape[0]

        def create_frustum(self):
            """[D, fH, fW, 3]: (u, v) pixel of each feature cell in the input image, and a depth bin."""
            iH, iW = self.image_size
            fH, fW = self.feature_size
            depth = torch.arange(*self.dbound, dtype=torch.float).view(-1, 1, 1).expand(-1, fH, fW)
            D = depth.shape[0]
            u = torch.linspace(0, iW - 1, fW, dtype=torch.float).view(1, 1, fW).expand(D, fH, fW)
            v = torch.linspace(0, iH - 1, fH, dtype=torch.float).view(1, fH, 1).expand(D, fH, fW)
            return nn.Parameter(torch.stack((u, v, depth), -1), requires_grad=False)

        def get_geometry(self, camera2lidar_rots, camera2lidar_trans, intrins, post_rots, post_trans, **kwargs):
            B, N, _ = camera2lidar_trans.shape
            # the image augmentation undone: translation removed, then rotated back
            pts = self.frustum - post_trans.view(B, N, 1, 1, 1, 3)
            pts = torch.inverse(post_rots).view(B, N, 1, 1, 1, 3, 3).matmul(pts.unsqueeze(-1))
            # pixel times depth, then camera -> lidar
            pts = torch.cat((pts[:, :, :, :, :, :2] * pts[:, :, :, :, :, 2:3], pts[:, :, :, :, :, 2:3]), 5)
            cam2lidar = camera2lidar_rots.matmul(torch.inverse(intrins))
            pts = cam2lidar.view(B, N, 1, 1, 1, 3, 3).matmul(pts).squeeze(-1)
            pts += camera2lidar_trans.view(B, N, 1, 1, 1, 3)
            # the lidar (BEV) augmentation of this sample
            if "extra_rots" in kwargs:
                rot = kwargs["extra_rots"].view(B, 1, 1, 1, 1, 3, 3).repeat(1, N, 1, 1, 1, 1, 1)
                pts = rot.matmul(pts.unsqueeze(-1)).squeeze(-1)
            if "extra_trans" in kwargs:
                pts += kwargs["extra_trans"].view(B, 1, 1, 1, 1, 3).repeat(1, N, 1, 1, 1, 1)
            return pts

        def bev_pool(self, geom_feats, x):
            B, N, D, H, W, C = x.shape
            Nprime = B * N * D * H * W
            x = x.reshape(Nprime, C)
            geom_feats = ((geom_feats - (self.bx - self.dx / 2.0)) / self.dx).long()
            geom_feats = geom_feats.view(Nprime, 3)
            batch_ix = torch.cat([torch.full([Nprime // B, 1], ix, device=x.device, dtype=torch.long)
                                  for ix in range(B)])
            geom_feats = torch.cat((geom_feats, batch_ix), 1)
            kept = ((geom_feats[:, 0] >= 0) & (geom_feats[:, 0] < self.nx[0]) & (geom_feats[:, 1] >= 0)
                    & (geom_feats[:, 1] < self.nx[1]) & (geom_feats[:, 2] >= 0) & (geom_feats[:, 2] < self.nx[2]))
            x = x[kept]
            geom_feats = geom_feats[kept]
            x = bev_pool(x, geom_feats, B, self.nx[2], self.nx[0], self.nx[1])
            final = torch.cat(x.unbind(dim=2), 1)
            return final


    @VTRANSFORMS.register_module()
    class LSSTransform(BaseTransform):
        pass
''')


def source(registry: str = "mmengine.registry") -> str:
    """The vendored ``vtransforms.py``, its ``Registry`` imported from ``registry``."""
    return SOURCE.replace("{registry}", registry)


def write_project(root: Path, package: str, text: str) -> str:
    """Write ``root/package/vtransforms.py``; return the module name to import."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    (root / package / "vtransforms.py").write_text(text)
    return f"{package}.vtransforms"


def _rot_z(angle: torch.Tensor) -> torch.Tensor:
    c, s, z, o = angle.cos(), angle.sin(), torch.zeros_like(angle), torch.ones_like(angle)
    return torch.stack([torch.stack([c, -s, z], -1), torch.stack([s, c, z], -1), torch.stack([z, z, o], -1)], -2)


def _small_rotation(n: int, gen: torch.Generator, degrees: float) -> torch.Tensor:
    """[n, 3, 3] rotations of a few degrees about random axes (camera mounting tolerance)."""
    axis = torch.nn.functional.normalize(torch.randn(n, 3, generator=gen, dtype=torch.float64), dim=1)
    angle = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * math.radians(degrees)
    k = torch.zeros(n, 3, 3, dtype=torch.float64)
    k[:, 0, 1], k[:, 0, 2], k[:, 1, 2] = -axis[:, 2], axis[:, 1], -axis[:, 0]
    k = k - k.transpose(1, 2)
    return torch.linalg.matrix_exp(k * angle[:, None, None])


def camera_inputs(bs: int, dtype: torch.dtype, gen: torch.Generator, cams: int = 6,
                  image_size: tuple[int, int] = (256, 704)) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """(camera2lidar_rots, camera2lidar_trans, intrins, post_rots, post_trans), {extra_rots, extra_trans}.

    nuScenes-like rig: cameras at yaw 0, -55, 55, 180, -110, 110 degrees (x right, y down, z forward),
    1600x900 intrinsics with random focal lengths; BEVFusion's image augmentation (resize 0.38-0.55,
    crop to ``image_size``, rotation within 5.4 degrees) and lidar augmentation (yaw within 22.5
    degrees, scale 0.9-1.1, translation sd 0.5 m), random per sample and camera.
    """
    f64 = torch.float64
    yaw = torch.tensor([0.0, -55.0, 55.0, 180.0, -110.0, 110.0], dtype=f64)[:cams].deg2rad()
    fwd = torch.stack([yaw.cos(), yaw.sin(), torch.zeros_like(yaw)], -1)
    right = torch.stack([yaw.sin(), -yaw.cos(), torch.zeros_like(yaw)], -1)
    down = torch.tensor([0.0, 0.0, -1.0], dtype=f64).expand(cams, 3)
    mount = torch.stack([right, down, fwd], -1)  # columns: the camera axes in the lidar frame
    rots = _small_rotation(bs * cams, gen, 2.0).view(bs, cams, 3, 3) @ mount
    trans = torch.cat([fwd[:, :2] * 1.2, torch.full((cams, 1), 1.6, dtype=f64)], 1) \
        + torch.randn(bs, cams, 3, generator=gen, dtype=f64) * 0.1
    intrins = torch.zeros(bs, cams, 3, 3, dtype=f64)
    focal = 1260 + torch.randn(bs, cams, generator=gen, dtype=f64) * 20
    intrins[..., 0, 0], intrins[..., 1, 1] = focal, focal
    intrins[..., 0, 2] = 800 + torch.randn(bs, cams, generator=gen, dtype=f64) * 5
    intrins[..., 1, 2] = 450 + torch.randn(bs, cams, generator=gen, dtype=f64) * 5
    intrins[..., 2, 2] = 1.0
    scale = 0.38 + torch.rand(bs, cams, generator=gen, dtype=f64) * 0.17
    angle = (torch.rand(bs, cams, generator=gen, dtype=f64) * 2 - 1) * math.radians(5.4)
    h, w = image_size
    crop = torch.stack([(1600 * scale - w) * torch.rand(bs, cams, generator=gen, dtype=f64),
                        (900 * scale - h) * torch.rand(bs, cams, generator=gen, dtype=f64)], -1)
    rot2 = _rot_z(angle)[..., :2, :2]
    centre = torch.tensor([w / 2, h / 2], dtype=f64)
    post_rots = torch.eye(3, dtype=f64).repeat(bs, cams, 1, 1)
    post_rots[..., :2, :2] = rot2 * scale[..., None, None]
    post_trans = torch.zeros(bs, cams, 3, dtype=f64)
    post_trans[..., :2] = (rot2 @ (-crop - centre)[..., None])[..., 0] + centre
    extra_rots = _rot_z((torch.rand(bs, generator=gen, dtype=f64) * 2 - 1) * math.radians(22.5)) \
        * (0.9 + torch.rand(bs, generator=gen, dtype=f64) * 0.2)[:, None, None]
    extra_trans = torch.randn(bs, 3, generator=gen, dtype=f64) * 0.5
    args = tuple(t.to(dtype) for t in (rots, trans, intrins, post_rots, post_trans))
    return args, {"extra_rots": extra_rots.to(dtype), "extra_trans": extra_trans.to(dtype)}
