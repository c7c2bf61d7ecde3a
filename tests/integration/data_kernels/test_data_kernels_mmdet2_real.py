"""LOONGKIT_DISTORTION / LOONGKIT_IMNORMALIZE against the real mmdet 2.28 and mmcv-full 1.7 (nox -s stack1).

The same checks as the mmcv 2.x / mmdet 3.x module (and its mmdet 2.x stand-in), here on the real
``mmdet.datasets.pipelines.transforms.PhotoMetricDistortion``, ``mmcv.image.photometric.imnormalize`` /
``imnormalize_`` and mmdet 2.x ``pipelines.Normalize``. Fresh random images and seeds every run (seed in
failure messages); the mismatch count (bitwise, float32 viewed as uint32) must be 0.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.stack1]

mmcv = pytest.importorskip("mmcv")
if not mmcv.__version__.startswith("1."):
    pytest.skip(f"needs mmcv-full 1.x, found {mmcv.__version__}", allow_module_level=True)
pipelines = pytest.importorskip("mmdet.datasets.pipelines", reason="needs mmdet 2.x (mmdet.datasets.pipelines)")

from loongkit_data.distortion import V2, _Replay, draw_v2, kernel_params  # noqa: E402
from loongkit_data.kernels import ops  # noqa: E402


def _helpers() -> types.ModuleType:
    """The mmcv 2.x module's helpers (mismatches, random_image, views, activation, kernel fixture)."""
    path = Path(__file__).with_name("test_data_kernels_exact.py")
    spec = importlib.util.spec_from_file_location("lk_data_kernels_exact_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


h = _helpers()
kernel = h.kernel  # the module-scoped fixture: the compiled kernels, loaded once
mismatches, random_image, views, activation, WIDTHS = h.mismatches, h.random_image, h.views, h.activation, h.WIDTHS

SEED = int(np.random.SeedSequence().entropy % 2**32)  # fresh each run; printed on failure
DTYPES = (np.uint8, np.float32)


def _original(fn: Any) -> Any:
    return getattr(fn, "__loongkit_original__", fn)


@pytest.fixture
def v2_module() -> Any:
    module = sys.modules[V2]
    assert module is pipelines.transforms
    return module


@pytest.fixture
def distortion(v2_module: Any) -> Iterator[tuple[Any, Any, Any]]:
    """The feature activated on the real module; yields (class, upstream __call__, ctx); undone after."""
    cls = v2_module.PhotoMetricDistortion
    original = cls.__call__
    impl, ctx = activation("distortion")
    impl.activate(ctx, V2)
    try:
        assert cls.__call__ is not original and cls.__call__.__loongkit_original__ is original
        yield cls, original, ctx
    finally:
        impl.deactivate(ctx)
    assert cls.__call__ is original


# ------------------------------------------------------------------------------------------------
# imnormalize (mmcv-full 1.7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("to_rgb", [True, False])
def test_imnormalize_bit_exact(kernel: Any, dtype: Any, to_rgb: bool) -> None:
    from mmcv.image import photometric

    upstream = _original(photometric.imnormalize)
    rng = np.random.default_rng(SEED)
    bad = 0
    for w in WIDTHS:
        h_ = int(rng.integers(1, 9))
        mean = rng.uniform(0, 255, 3)
        std = rng.uniform(1, 80, 3).astype(np.float32)
        for img in views(random_image(rng, h_, w, dtype)):
            ours, why = ops.imnormalize(img, mean, std, to_rgb)
            if img.shape[1] in ops.BROADCAST_WIDTHS:  # upstream's own call: the wrapper falls back
                assert ours is None and why.startswith(f"width {img.shape[1]}"), why
                continue
            assert ours is not None, why
            bad += mismatches(ours, upstream(img, mean, std, to_rgb))
            assert img.dtype == dtype
    assert bad == 0, f"seed {SEED}"


def test_imnormalize_inplace_bit_exact(kernel: Any) -> None:
    from mmcv.image import photometric

    upstream = _original(photometric.imnormalize_)
    rng = np.random.default_rng(SEED + 1)
    bad = 0
    for w in WIDTHS:
        mean, std = rng.uniform(0, 255, 3), rng.uniform(1, 80, 3)
        img = random_image(rng, int(rng.integers(1, 6)), w, np.float32)
        theirs = upstream(img.copy(), mean, std, bool(w % 2))
        mine = img.copy()
        out, why = ops.imnormalize_(mine, mean, std, bool(w % 2))
        if mine.shape[1] in ops.BROADCAST_WIDTHS:
            assert out is None, why
            continue
        assert out is mine, why
        bad += mismatches(mine, theirs)
    assert bad == 0, f"seed {SEED}"


def test_imnormalize_patched_mmdet2_normalize(kernel: Any) -> None:
    """mmdet 2.x ``Normalize`` (calls ``mmcv.imnormalize``) through the patch, then unpatched again."""
    import mmcv.image
    from mmcv.image import photometric

    originals = (photometric.imnormalize, photometric.imnormalize_, mmcv.image.imnormalize, mmcv.imnormalize)
    rng = np.random.default_rng(SEED + 2)
    cases = []
    for i, w in enumerate(WIDTHS):
        img = random_image(rng, int(rng.integers(1, 7)), w, DTYPES[i % 2])
        cfg = {"mean": rng.uniform(0, 255, 3).tolist(), "std": rng.uniform(1, 80, 3).tolist(), "to_rgb": bool(i % 3)}
        cases.append((img, cfg, pipelines.Normalize(**cfg)({"img": img.copy()})["img"]))
    impl, ctx = activation("imnormalize")
    impl.activate(ctx, "mmcv.image.photometric")
    try:
        assert mmcv.imnormalize is not originals[3] and mmcv.image.imnormalize is not originals[2]
        bad = sum(mismatches(pipelines.Normalize(**cfg)({"img": img.copy()})["img"], expected)
                  for img, cfg, expected in cases)
        assert bad == 0, f"seed {SEED}"
        broadcast = [img.shape[1] for img, _, _ in cases if img.shape[1] in ops.BROADCAST_WIDTHS]  # upstream's
        assert ctx.record.calls == len(cases) - len(broadcast)
        # each: imnormalize and the imnormalize_ upstream's imnormalize calls on its copy
        fallbacks = ctx.record.config["fallbacks"]
        assert {why.split(":")[0]: n for why, n in fallbacks.items()} == {f"width {w}": 2 for w in broadcast}, fallbacks
    finally:
        impl.deactivate(ctx)
    assert (photometric.imnormalize, photometric.imnormalize_, mmcv.image.imnormalize, mmcv.imnormalize) == originals


# ------------------------------------------------------------------------------------------------
# PhotoMetricDistortion (mmdet 2.28)


class _Draws:
    """numpy.random-like source for draw_v2: coin flips and values from a seeded Generator."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def randint(self, n: int) -> int:
        return int(self.rng.integers(n))

    def uniform(self, low: float, high: float) -> float:
        return float(self.rng.uniform(low, high))

    def permutation(self, n: int) -> np.ndarray:
        return self.rng.permutation(n)


def test_distortion_kernel_bit_exact_all_branches(kernel: Any, v2_module: Any) -> None:
    """Kernel vs the real ``__call__`` fed the same draws (module ``random`` replayed), many branches."""
    mode, failure = ops.hsv_mode()
    assert mode is not None, failure
    cls = v2_module.PhotoMetricDistortion
    upstream = _original(cls.__call__)
    t = cls()
    rng = np.random.default_rng(SEED + 3)
    source = _Draws(rng)
    random = v2_module.random
    bad = 0
    for i in range(160):
        img = random_image(rng, int(rng.integers(1, 6)), int(rng.choice(WIDTHS)), np.uint8 if i % 3 else np.float32)
        if i % 5 == 0 and i % 2:
            img = img[:, ::-1].copy()
        draws, d = draw_v2(source, t)
        p = kernel_params(d["mode"], d["brightness"], d["contrast"], d["saturation"], d["hue"], d["swap"],
                          d["delta"], d["alpha"], d["sat"], d["hue_value"], d["perm"], clip=False)
        assert p is not None
        ours, why = ops.distort(img, **p)
        assert ours is not None, why
        replay = _Replay(draws)
        v2_module.random = replay
        try:
            theirs = upstream(t, {"img": img.copy()})["img"]
        finally:
            v2_module.random = random
        assert replay._draws == []  # upstream consumed exactly the draws made
        bad += mismatches(ours, theirs)
    assert bad == 0, f"seed {SEED}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_distortion_patched_call_same_draws_and_pixels(kernel: Any, distortion: Any, dtype: Any) -> None:
    cls, original, ctx = distortion
    rng = np.random.default_rng(SEED + 4 + DTYPES.index(dtype))
    t = cls()
    bad = n = 0
    for w in WIDTHS:
        for _ in range(3):
            img = random_image(rng, int(rng.integers(1, 7)), w, dtype)
            seed = int(rng.integers(2**31))
            np.random.seed(seed)
            ours = t({"img": img.copy(), "img_fields": ["img"]})["img"]
            after = np.random.get_state()[2]
            np.random.seed(seed)
            theirs = original(t, {"img": img.copy(), "img_fields": ["img"]})["img"]
            assert np.random.get_state()[2] == after, f"seed {SEED}: draws differ at width {w}"
            bad += mismatches(ours, theirs)
            n += 1
    assert bad == 0, f"seed {SEED}"
    assert ctx.record.calls == n
    assert ctx.record.config["fallbacks"] == {}


def test_distortion_patched_call_fallbacks(kernel: Any, distortion: Any) -> None:
    """Strided views and inputs the kernel does not take: same random stream and bits, counted by reason."""
    cls, original, ctx = distortion
    rng = np.random.default_rng(SEED + 6)
    t = cls()
    img4 = rng.integers(0, 256, (4, 9, 4), dtype=np.uint8)
    np.random.seed(7)
    ours = t({"img": img4.copy()})["img"]
    np.random.seed(7)
    assert np.array_equal(ours, original(t, {"img": img4.copy()})["img"])
    assert ctx.record.config["fallbacks"] == {"not HxWx3": 1}
    bad = 0
    for img in [*views(random_image(rng, 5, 33, np.uint8))[1:], random_image(rng, 5, 33, np.uint8)[:, :, ::-1]]:
        np.random.seed(11)
        ours = t({"img": img})["img"]
        after = np.random.get_state()[2]
        np.random.seed(11)
        bad += mismatches(ours, original(t, {"img": img})["img"])
        assert np.random.get_state()[2] == after
    assert bad == 0, f"seed {SEED}"
    # Row-flipped and column-cropped views keep pixel-contiguous rows (kernel); column-flipped and
    # channel-reversed ones do not (draws made, replayed through upstream).
    assert ctx.record.calls == 2
    assert ctx.record.config["fallbacks"] == {"not HxWx3": 1, "pixels not contiguous": 2}


# ------------------------------------------------------------------------------------------------
# The runtime: both features activate on import of the real modules


RUNTIME = r"""
import numpy as np
import mmcv
from mmdet.datasets.pipelines import Normalize, PhotoMetricDistortion
img = np.random.default_rng(0).integers(0, 256, (9, 21, 3), dtype=np.uint8)
out = PhotoMetricDistortion()({"img": img.copy()})["img"]
norm = Normalize(mean=[1., 2., 3.], std=[4., 5., 6.])({"img": img.copy()})["img"]
print("PATCHED", hasattr(PhotoMetricDistortion.__call__, "__loongkit_original__"),
      hasattr(mmcv.imnormalize, "__loongkit_original__"), out.dtype, norm.dtype)
"""


def test_features_activate_on_import_of_real_modules(run_loongkit: Any) -> None:
    result = run_loongkit(argv=[sys.executable, "-c", RUNTIME],
                          env={"LOONGKIT_IMNORMALIZE": "1", "LOONGKIT_DISTORTION": "1"})
    assert result.returncode == 0, result.stderr
    assert "PATCHED True True float32 float32" in result.stdout, result.stdout + result.stderr
    for name in ("distortion", "imnormalize"):
        row = result.feature(name)
        assert row["active"] and row["calls"] == 1, row
        assert row["config"]["fallbacks"] == {}, row
