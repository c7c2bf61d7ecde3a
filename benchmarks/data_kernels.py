"""LOONGKIT_IMNORMALIZE / LOONGKIT_DISTORTION: per-image time, one thread (as in a data worker).

Run in the stack2 venv (`nox -s stack2` makes it):  .nox/stack2/bin/python benchmarks/data_kernels.py [--quick]

Lines:
  BENCH imnormalize_<WxH> baseline=<mmcv s> ours=<kernel s> ratio=<mmcv/kernel>
  BENCH imnormalize_floor_<WxH> baseline=<copy floor s> ours=<kernel s> ratio=<floor/kernel>
      (the floor reads the uint8 input once and writes a fresh float32 output once:
       numpy astype(float32); ratio >= 0.67 means "within 1.5x of the floor")
  BENCH distortion_<WxH> baseline=<mmdet 3.x transform s> ours=<patched transform s> ratio=...
Distortion runs with every step on (brightness, contrast, saturation, hue, swap): the slowest path.
Each number is the median of repeated runs on a fresh random uint8 image; the first (build) call is
excluded and reported once as BUILD. Before a case is timed, ours must have run (not fallen back: the
kernel's calibration against this cv2 found no mode, or it declined the input) and given upstream's
bits; otherwise the case prints ``SKIP <name>: <reason>`` and no BENCH line.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _timing import bench_line, median_time

SIZES = ((1600, 900), (1333, 800), (640, 480))


def checked(name: str, result: tuple[np.ndarray | None, str], expected: np.ndarray) -> bool:
    """Whether ours ran and matched upstream bit for bit; a SKIP line saying why not otherwise."""
    out, why = result
    if out is None:
        print(f"SKIP {name}: the kernel fell back to upstream ({why})", flush=True)
        return False
    ours, theirs = np.ascontiguousarray(out), np.ascontiguousarray(expected)
    if ours.dtype != theirs.dtype or not np.array_equal(ours.view(np.uint8), theirs.view(np.uint8)):
        print(f"SKIP {name}: the kernel's result differs from upstream's", flush=True)
        return False
    return True



def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeat = 7 if args.quick else 31

    import cv2

    cv2.setNumThreads(1)
    from loongkit_data import kernels
    from loongkit_data.distortion import kernel_params
    from loongkit_data.kernels import ops
    from mmcv.image import photometric
    from mmdet.datasets.transforms.transforms import PhotoMetricDistortion

    start = time.perf_counter()
    if kernels.load() is None:
        print(f"kernels unavailable: {kernels.failure()}", file=sys.stderr)
        return 1
    print(f"BUILD load_or_build_s={time.perf_counter() - start:.2f} "
          f"compiled_now={kernels.LIBRARY.origin == 'built'} ({kernels.describe()})", flush=True)

    rng = np.random.default_rng(0)
    mean = np.array([123.675, 116.28, 103.53], np.float32)
    std = np.array([58.395, 57.12, 57.375], np.float32)
    for w, h in SIZES:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if not checked(f"imnormalize_{w}x{h}", ops.imnormalize(img, mean, std, True),
                       photometric.imnormalize(img, mean, std, True)):
            continue
        base = median_time(lambda img=img: photometric.imnormalize(img, mean, std, True), repeat, warmup=1)
        ours = median_time(lambda img=img: ops.imnormalize(img, mean, std, True), repeat, warmup=1)
        floor = median_time(lambda img=img: img.astype(np.float32), repeat, warmup=1)
        bench_line(f"imnormalize_{w}x{h}", base, ours)
        bench_line(f"imnormalize_floor_{w}x{h}", floor, ours)

    draws = (1, 1, 1, 1, 1, 1, 17.3, 1.21, 1.37, -7.9, np.array([2, 0, 1]))
    t = PhotoMetricDistortion()
    t._random_flags = lambda: draws  # same draws for both sides
    params = kernel_params(*draws[:6], *draws[6:10], draws[10], clip=True)
    assert params is not None
    for w, h in SIZES:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if not checked(f"distortion_{w}x{h}", ops.distort(img, **params),
                       PhotoMetricDistortion.transform(t, {"img": img})["img"]):
            continue
        base = median_time(lambda img=img: PhotoMetricDistortion.transform(t, {"img": img}), repeat, warmup=1)
        ours = median_time(lambda img=img: ops.distort(img, **params), repeat, warmup=1)
        bench_line(f"distortion_{w}x{h}", base, ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
