"""Version requirements checked from installed distribution metadata, never by importing.

Requirements are written with the *module* name users know (``mmseg``, ``mmcv``), mapped here to
the distributions that provide it (``mmsegmentation``; ``mmcv``, ``mmcv-full`` or ``mmcv-lite``).
"""

from __future__ import annotations

import functools
import importlib  # noqa: F401  # the package (loaded at start-up anyway); tests patch importlib.metadata here

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from packaging.version import Version

# importlib.metadata and packaging are imported at the first check: a process that
# reuses its job's resolution (loongkit_core.resolved) never checks a requirement.

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


class Installed(tuple):  # type: ignore[type-arg]  # a plain tuple subclass: no dataclass to build at boot
    """The distribution that provides ``module``, at ``version`` (immutable, compares as its fields)."""

    __slots__ = ()

    def __new__(cls, module: str, distribution: str, version: str) -> Installed:
        return tuple.__new__(cls, (module, distribution, version))

    @property
    def module(self) -> str:
        return str(self[0])

    @property
    def distribution(self) -> str:
        return str(self[1])

    @property
    def version(self) -> str:
        return str(self[2])

    def __repr__(self) -> str:
        return f"Installed(module={self[0]!r}, distribution={self[1]!r}, version={self[2]!r})"


@functools.cache
def installed(module: str) -> Installed | None:
    """The installed distribution providing ``module``, from metadata only (cached per process)."""
    import importlib.metadata

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
    from packaging.version import Version

    parsed = Version(version)
    return Version(parsed.public)


def check(requirement: str) -> str | None:
    """Return None when ``requirement`` holds here, else a reason for the Summary."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

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
