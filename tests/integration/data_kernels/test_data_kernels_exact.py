"""LOONGKIT_IMNORMALIZE / LOONGKIT_DISTORTION against the real mmcv 2.x and mmdet 3.x functions.

Fresh random images and seeds on every run; the mismatch count (bitwise, float32 viewed as uint32)
must be 0. Widths cover multiples of 16 and not, odd sizes, 1-pixel images, strided views.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.integration

mmcv = pytest.importorskip("mmcv")
cv2 = pytest.importorskip("cv2")

from loongkit_data import kernels  # noqa: E402
from loongkit_data.kernels import ops  # noqa: E402
from loongkit_data.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext, NotApplicable  # noqa: E402
from loongkit_core.feature import FeatureRecord  # noqa: E402
from loongkit_core.log import get_logger  # noqa: E402

SEED = int(np.random.SeedSequence().entropy % 2**32)  # fresh each run; printed on failure
WIDTHS = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 47, 64, 100, 127, 641, 1333)  # SIMD blocks of 8/16 + tails


def mismatches(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32, (a.shape, b.shape, a.dtype, b.dtype)
    return int((a.view(np.uint32) != b.view(np.uint32)).sum())


def random_image(rng: np.random.Generator, h: int, w: int, dtype: Any) -> np.ndarray:
    if dtype == np.uint8:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        img[:, ::4] = img[:, ::4, :1]  # grey pixels: zero saturation, max/min ties
        return img
    return (rng.standard_normal((h, w, 3)) * 90 + 110).astype(np.float32)


def views(img: np.ndarray) -> list[np.ndarray]:
    """The image plus non-contiguous views a pipeline produces (crop, flips)."""
    out = [img, img[::-1], img[:, ::-1]]
    if img.shape[1] > 2:
        out.append(img[:, 1:-1])
    return out


@pytest.fixture(scope="module")
def kernel() -> Any:
    module = kernels.load()
    assert module is not None, kernels.failure()
    return module


def activation(name: str) -> tuple[Any, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == name)
    record = FeatureRecord(feature)
    ctx = ActivationContext(record, None, get_logger("test"), lambda module, cb: cb(sys.modules[module]))  # type: ignore[arg-type]
    from loongkit_data.distortion import Distortion
    from loongkit_data.imnormalize import ImNormalize

    impl = {"imnormalize": ImNormalize, "distortion": Distortion}[name](feature)  # fresh counters
    return impl, ctx


def assert_kernel_not_used(ctx: ActivationContext, calibration: tuple[Any, str | None], config_key: str) -> None:
    """Calibration found no mode: the kernel never ran and the row and config say why."""
    from loongkit_core.summary import status

    mode, failure = calibration
    assert mode is None and failure and "no kernel mode reproduces" in failure, failure
    assert ctx.record.calls == 0
    assert status(ctx.record).startswith("applied, kernel not used: no kernel mode reproduces"), status(ctx.record)
    assert ctx.record.config[config_key].startswith("not reproduced")


# ------------------------------------------------------------------------------------------------
# imnormalize


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("to_rgb", [True, False])
def test_imnormalize_bit_exact(kernel: Any, dtype: Any, to_rgb: bool) -> None:
    from mmcv.image import photometric

    rng = np.random.default_rng(SEED)
    bad = 0
    for w in WIDTHS:
        h = int(rng.integers(1, 9))
        mean = rng.uniform(0, 255, 3)
        std = rng.uniform(1, 80, 3).astype(np.float32)
        for img in views(random_image(rng, h, w, dtype)):
            ours, why = ops.imnormalize(img, mean, std, to_rgb)
            if img.shape[1] in ops.BROADCAST_WIDTHS:  # upstream's own call: the wrapper falls back
                assert ours is None and why.startswith(f"width {img.shape[1]}"), why
                continue
            assert ours is not None, why
            bad += mismatches(ours, photometric.imnormalize(img, mean, std, to_rgb))
            assert img.dtype == dtype  # input untouched
    assert bad == 0, f"seed {SEED}"


def test_imnormalize_inplace_bit_exact(kernel: Any) -> None:
    from mmcv.image import photometric

    rng = np.random.default_rng(SEED + 1)
    mean = np.array([123.675, 116.28, 103.53])
    std = np.array([58.395, 57.12, 57.375])
    bad = 0
    for w in WIDTHS:
        img = random_image(rng, 5, w, np.float32)
        theirs = photometric.imnormalize_(img.copy(), mean, std, bool(w % 2))
        mine = img.copy()
        out, why = ops.imnormalize_(mine, mean, std, bool(w % 2))
        if mine.shape[1] in ops.BROADCAST_WIDTHS:
            assert out is None, why
            continue
        assert out is mine, why
        bad += mismatches(mine, theirs)
    assert bad == 0, f"seed {SEED}"


def test_imnormalize_uint8_routes_bit_exact(kernel: Any) -> None:
    """uint8 input takes a float32-only product only when its exhaustive per-call check passes.

    A zero std (1/std = inf) makes that check fail: the call must then take the float64 route,
    and both routes must match mmcv bit for bit.
    """
    from mmcv.image import photometric

    rng = np.random.default_rng(SEED + 5)
    bad = 0
    for zero_std in (False, True):
        mean = rng.uniform(0, 255, 3)
        std = rng.uniform(1, 80, 3)
        if zero_std:
            std[int(rng.integers(3))] = 0.0
        m, s = ops._norm_params(mean, std)
        if zero_std:
            assert kernel.imnormalize_split(m, s) is False
        for w in (16, 47, 641):
            img = random_image(rng, 3, w, np.uint8)
            for to_rgb in (True, False):
                ours, why = ops.imnormalize(img, mean, std, to_rgb)
                if img.shape[1] in ops.BROADCAST_WIDTHS:  # upstream's own call: the wrapper falls back
                    assert ours is None and why.startswith(f"width {img.shape[1]}"), why
                    continue
                assert ours is not None, why
                with np.errstate(divide="ignore", invalid="ignore"):
                    theirs = photometric.imnormalize(img, mean, std, to_rgb)
                bad += mismatches(ours, theirs)
    assert bad == 0, f"seed {SEED}"


def test_imnormalize_patch_fallbacks_and_unpatch(kernel: Any) -> None:
    import mmcv.image
    from mmcv.image import photometric
    from mmcv.transforms import Normalize

    originals = (photometric.imnormalize, photometric.imnormalize_, mmcv.image.imnormalize, mmcv.imnormalize)
    rng = np.random.default_rng(SEED + 2)
    img = random_image(rng, 37, 53, np.uint8)
    cfg = {"mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375], "to_rgb": True}
    m, s = np.array(cfg["mean"]), np.array(cfg["std"])
    f64, gray = img.astype(np.float64), img[..., :1].copy()
    expected = {
        "normalize": Normalize(**cfg)({"img": img})["img"],
        "f64": mmcv.imnormalize(f64, m, s),
        "gray": mmcv.imnormalize(gray, m[:1], s[:1], False),
    }
    impl, ctx = activation("imnormalize")
    impl.activate(ctx, "mmcv.image.photometric")
    try:
        assert mmcv.imnormalize is not originals[3] and mmcv.image.imnormalize is not originals[2]
        assert mismatches(Normalize(**cfg)({"img": img})["img"], expected["normalize"]) == 0
        assert ctx.record.calls == 1
        # Inputs the kernel does not take run upstream, counted by reason. Upstream imnormalize
        # then calls the patched imnormalize_ on its float32 copy, which the kernel takes.
        assert mismatches(mmcv.imnormalize(f64, m, s), expected["f64"]) == 0
        assert ctx.record.calls == 2
        assert np.array_equal(mmcv.imnormalize(gray, m[:1], s[:1], False), expected["gray"])
        with pytest.raises(AssertionError):  # upstream's own check, unchanged
            mmcv.imnormalize_(img.copy(), m, s)
        assert ctx.record.calls == 2
        assert ctx.record.config["fallbacks"] == {"dtype float64": 1, "not HxWx3": 2, "in-place on uint8": 1}
    finally:
        impl.deactivate(ctx)
    assert (photometric.imnormalize, photometric.imnormalize_, mmcv.image.imnormalize, mmcv.imnormalize) == originals


def test_imnormalize_opencv_not_reproduced_falls_back(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OpenCV whose multiply no product mode reproduces (planted: one ulp above the float64 product, in
    cv2 itself, so mmcv and the calibration both see it): every call runs upstream, the result is
    upstream's bit for bit, and the Summary row says why the kernel is not used."""
    from mmcv.transforms import Normalize

    from loongkit_core.feature import State

    real = cv2.multiply

    def planted(src: Any, scalar: Any, dst: Any = None) -> Any:
        out = np.nextafter((src.astype(np.float64) * scalar).astype(np.float32), np.float32(np.inf))
        if dst is None:
            return out
        dst[...] = out
        return dst

    rng = np.random.default_rng(SEED + 3)
    img = random_image(rng, 21, 50, np.uint8)
    cfg = {"mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375], "to_rgb": True}
    monkeypatch.setattr(cv2, "multiply", planted)
    expected = Normalize(**cfg)({"img": img.copy()})["img"]
    assert mismatches(expected, (img[..., ::-1].astype(np.float64) - cfg["mean"]).astype(np.float32)) > 0
    ops.reset_calibration()
    impl, ctx = activation("imnormalize")
    impl.activate(ctx, "mmcv.image.photometric")
    ctx.record.state = State.APPLIED  # what the runtime does after activate
    try:
        got = Normalize(**cfg)({"img": img.copy()})["img"]
        assert mismatches(got, expected) == 0
        assert_kernel_not_used(ctx, ops.norm_mode(), "opencv")
    finally:
        impl.deactivate(ctx)
        monkeypatch.setattr(cv2, "multiply", real)
        ops.reset_calibration()
    assert ops.norm_mode()[0] is not None  # the real cv2 again: calibrated


def test_imnormalize_broken_target() -> None:
    import types

    impl, ctx = activation("imnormalize")
    fake = types.ModuleType("fake_photometric")
    fake.imnormalize = lambda img, mean: img  # type: ignore[attr-defined]
    fake.imnormalize_ = lambda img, mean: img  # type: ignore[attr-defined]
    sys.modules["fake_photometric"] = fake
    try:
        with pytest.raises(NotApplicable):
            impl.activate(ctx, "fake_photometric")
    finally:
        del sys.modules["fake_photometric"]
    assert len(ctx.patcher) == 0


# ------------------------------------------------------------------------------------------------
# PhotoMetricDistortion (mmdet 3.x)


def upstream_pixels(img: np.ndarray, mode: int, flags: tuple[int, ...], values: tuple[float, ...],
                    perm: np.ndarray) -> np.ndarray:
    """mmdet 3.x transform() with given draws, through the real class (draws replayed)."""
    from mmdet.datasets.transforms.transforms import PhotoMetricDistortion

    t = PhotoMetricDistortion()
    draws = (mode, *flags, *values, perm)
    t._random_flags = lambda: draws
    original = getattr(PhotoMetricDistortion.transform, "__loongkit_original__", PhotoMetricDistortion.transform)
    return original(t, {"img": img})["img"]


def test_distortion_kernel_bit_exact_all_branches(kernel: Any) -> None:
    rng = np.random.default_rng(SEED + 3)
    mode, failure = ops.hsv_mode()
    assert mode is not None, failure
    bad = 0
    for i in range(160):
        w = int(rng.choice(WIDTHS))
        h = int(rng.integers(1, 6))
        img = random_image(rng, h, w, np.uint8 if i % 3 else np.float32)
        if i % 5 == 0:
            img = img[:, ::-1].copy() if i % 2 else img
        mode_ = int(rng.integers(2))
        flags = tuple(int(x) for x in rng.integers(0, 2, 5))
        values = (rng.uniform(-32, 32), rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5), rng.uniform(-18, 18))
        perm = rng.permutation(3)
        from loongkit_data.distortion import kernel_params

        p = kernel_params(mode_, *flags, *values, perm, clip=True)
        assert p is not None
        ours, why = ops.distort(img, **p)
        assert ours is not None, why
        bad += mismatches(ours, upstream_pixels(img, mode_, flags, values, perm))
    assert bad == 0, f"seed {SEED}"


def test_distortion_patched_transform_same_draws_and_pixels(kernel: Any) -> None:
    pytest.importorskip("mmdet")
    from mmdet.datasets.transforms.transforms import PhotoMetricDistortion

    original = PhotoMetricDistortion.transform
    impl, ctx = activation("distortion")
    impl.activate(ctx, "mmdet.datasets.transforms.transforms")
    try:
        assert PhotoMetricDistortion.transform is not original
        rng = np.random.default_rng(SEED + 4)
        t = PhotoMetricDistortion()
        bad = 0
        for w in WIDTHS:
            img = random_image(rng, int(rng.integers(1, 7)), w, np.uint8)
            seed = int(rng.integers(2**31))
            np.random.seed(seed)
            ours = t.transform({"img": img.copy()})["img"]
            after_ours = np.random.get_state()[2]
            np.random.seed(seed)
            theirs = original(t, {"img": img.copy()})["img"]
            assert np.random.get_state()[2] == after_ours  # same number of draws
            bad += mismatches(ours, theirs)
        assert bad == 0, f"seed {SEED}"
        assert ctx.record.calls == len(WIDTHS)
        # Not taken by the kernel: upstream runs (here: a 4-channel image), counted.
        img4 = rng.integers(0, 256, (4, 9, 4), dtype=np.uint8)
        np.random.seed(7)
        ours = t.transform({"img": img4.copy()})["img"]
        np.random.seed(7)
        assert np.array_equal(ours, original(t, {"img": img4.copy()})["img"])
        assert ctx.record.config["fallbacks"] == {"not HxWx3": 1}
        # Non-contiguous pixels: draws made, then replayed through upstream; same stream, same bits.
        img = random_image(rng, 5, 33, np.uint8)[:, :, ::-1]
        np.random.seed(11)
        ours = t.transform({"img": img})["img"]
        np.random.seed(11)
        assert mismatches(ours, original(t, {"img": img})["img"]) == 0
        assert ctx.record.config["fallbacks"]["pixels not contiguous"] == 1
    finally:
        impl.deactivate(ctx)
    assert PhotoMetricDistortion.transform is original


def test_distortion_opencv_not_reproduced_falls_back(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OpenCV whose float BGR->HSV no mode reproduces (planted in cv2 itself: hue one ulp up): the
    patched transform gives upstream's pixels and draws, the kernel never runs, the row says why."""
    pytest.importorskip("mmdet")
    from mmdet.datasets.transforms.transforms import PhotoMetricDistortion

    from loongkit_core.feature import State

    real = cv2.cvtColor

    def planted(src: Any, code: int, *args: Any) -> Any:
        out = real(src, code, *args)
        if code == cv2.COLOR_BGR2HSV and out.dtype == np.float32:
            out[..., 0] = np.nextafter(out[..., 0], np.float32(np.inf))
        return out

    monkeypatch.setattr(cv2, "cvtColor", planted)
    ops.reset_calibration()
    original = PhotoMetricDistortion.transform
    impl, ctx = activation("distortion")
    impl.activate(ctx, "mmdet.datasets.transforms.transforms")
    ctx.record.state = State.APPLIED  # what the runtime does after activate
    try:
        rng = np.random.default_rng(SEED + 6)
        t = PhotoMetricDistortion()
        for w in (33, 641):
            img = random_image(rng, 4, w, np.uint8)
            np.random.seed(w)
            ours = t.transform({"img": img.copy()})["img"]
            np.random.seed(w)
            assert mismatches(ours, original(t, {"img": img.copy()})["img"]) == 0, f"seed {SEED}"
        assert_kernel_not_used(ctx, ops.hsv_mode(), "hsv")
    finally:
        impl.deactivate(ctx)
        monkeypatch.setattr(cv2, "cvtColor", real)
        ops.reset_calibration()


def test_distortion_mmdet2_style_lazy_draws(kernel: Any) -> None:
    """mmdet 2.x's __call__ (not installed here): a module with its verbatim pixel/draw code."""
    import types

    from loongkit_data.distortion import V2

    source = '''
import numpy as np
import mmcv
from numpy import random

class PhotoMetricDistortion:
    def __init__(self, brightness_delta=32, contrast_range=(0.5, 1.5), saturation_range=(0.5, 1.5),
                 hue_delta=18):
        self.brightness_delta = brightness_delta
        self.contrast_lower, self.contrast_upper = contrast_range
        self.saturation_lower, self.saturation_upper = saturation_range
        self.hue_delta = hue_delta

    def __call__(self, results):
        if 'img_fields' in results:
            assert results['img_fields'] == ['img'], 'Only single img_fields is allowed'
        img = results['img']
        img = img.astype(np.float32)
        if random.randint(2):
            delta = random.uniform(-self.brightness_delta, self.brightness_delta)
            img += delta
        mode = random.randint(2)
        if mode == 1:
            if random.randint(2):
                alpha = random.uniform(self.contrast_lower, self.contrast_upper)
                img *= alpha
        img = mmcv.bgr2hsv(img)
        if random.randint(2):
            img[..., 1] *= random.uniform(self.saturation_lower, self.saturation_upper)
        if random.randint(2):
            img[..., 0] += random.uniform(-self.hue_delta, self.hue_delta)
            img[..., 0][img[..., 0] > 360] -= 360
            img[..., 0][img[..., 0] < 0] += 360
        img = mmcv.hsv2bgr(img)
        if mode == 0:
            if random.randint(2):
                alpha = random.uniform(self.contrast_lower, self.contrast_upper)
                img *= alpha
        if random.randint(2):
            img = img[..., random.permutation(3)]
        results['img'] = img
        return results
'''
    module = types.ModuleType(V2)
    exec(compile(source, "<mmdet2 transforms>", "exec"), module.__dict__)
    original = module.PhotoMetricDistortion.__call__
    sys.modules[V2] = module
    impl, ctx = activation("distortion")
    try:
        impl.activate(ctx, V2)
        rng = np.random.default_rng(SEED + 5)
        t = module.PhotoMetricDistortion()
        bad = 0
        for w in WIDTHS:
            img = random_image(rng, 3, w, np.uint8 if w % 2 else np.float32)
            seed = int(rng.integers(2**31))
            np.random.seed(seed)
            ours = t({"img": img.copy()})["img"]
            after = np.random.get_state()[2]
            np.random.seed(seed)
            theirs = original(t, {"img": img.copy()})["img"]
            assert np.random.get_state()[2] == after
            bad += mismatches(ours, theirs)
        assert bad == 0, f"seed {SEED}"
        assert ctx.record.calls == len(WIDTHS)
    finally:
        impl.deactivate(ctx)
        del sys.modules[V2]
    assert module.PhotoMetricDistortion.__call__ is original
