"""Version requirements checked from installed distribution metadata, never by importing.

Requirements are written with the *module* name users know (``mmseg``, ``mmcv``), mapped here to
the distributions that provide it (``mmsegmentation``; ``mmcv``, ``mmcv-full`` or ``mmcv-lite``).
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# module name -> distributions that install it, in the order they are looked for
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "mmcv": ("mmcv", "mmcv-full", "mmcv-lite"),
    "mmengine": ("mmengine", "mmengine-lite"),
    "mmdet": ("mmdet",),
    "mmseg": ("mmsegmentation",),
    "mmdet3d": ("mmdet3d",),
    "transformers": ("transformers",),
    "accelerate": ("accelerate",),
    "triton": ("triton", "pytorch-triton"),
    "cv2": ("opencv-python", "opencv-python-headless", "opencv-contrib-python",
            "opencv-contrib-python-headless"),
}


@dataclass(frozen=True)
class Installed:
    module: str
    distribution: str
    version: str


@functools.cache
def installed(module: str) -> Installed | None:
    """The installed distribution providing ``module``, from metadata only (cached per process)."""
    for dist in DISTRIBUTIONS.get(module, (module,)):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # broken metadata: treat as not installed
            continue
        if version:
            return Installed(module, dist, version)
    return None


def _release(version: str) -> Version:
    """Drop the local label (``2.13.0+cpu`` -> ``2.13.0``) so ``<=1.8.0`` admits ``1.8.0+cu121``."""
    parsed = Version(version)
    return Version(parsed.public)


def check(requirement: str) -> str | None:
    """Return None when ``requirement`` holds here, else a reason for the Summary."""
    try:
        req = Requirement(requirement)
    except InvalidRequirement as exc:
        return f"invalid requirement {requirement!r}: {exc}"
    found = installed(req.name)
    if found is None:
        return f"{req.name} not installed (needs {req.name}{req.specifier})"
    if not req.specifier:
        return None
    try:
        version = _release(found.version)
    except InvalidVersion:
        return f"{found.distribution} version {found.version!r} cannot be parsed"
    spec = SpecifierSet(str(req.specifier), prereleases=True)
    if version in spec:
        return None
    return f"{req.name} {found.version} outside {req.specifier}"


def check_all(requirements: tuple[str, ...] | list[str]) -> str | None:
    """First failing requirement's reason, or None when all hold."""
    for requirement in requirements:
        reason = check(requirement)
        if reason is not None:
            return reason
    return None
