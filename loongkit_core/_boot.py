"""The fast path every loader goes through: stdlib only, microseconds when nothing is requested.

It scans ``os.environ`` for a LOONGKIT_* variable that could enable something and stops there if
there is none; only then does it import the runtime. The product's rules for LOONGKIT_* values
(bools, empty = unset) live here too, stdlib only, so that a process reusing its job's resolution
(:mod:`loongkit_core.resolved`) reads its switches without importing pydantic;
:mod:`loongkit_core.settings` re-exports them.
"""

from __future__ import annotations

import os
import sys

# Variables that configure the core but enable nothing by themselves.
_PASSIVE = frozenset({
    "LOONGKIT_LOGLEVEL", "LOONGKIT_LOGDIR", "LOONGKIT_STRICT", "LOONGKIT_SUMMARY_JSON",
    "LOONGKIT_SYSFS_ROOT", "LOONGKIT_ACTIVATION_TIMEOUT", "LOONGKIT_DISABLE_PLUGINS", "LOONGKIT_KERNEL_CACHE",
    "LOONGKIT_KERNEL_ISA", "LOONGKIT_RESOLVE_ONCE",
})
_OFF = frozenset({"", "0", "off", "no"})

TRUE_WORDS = frozenset({"1", "on", "yes"})
FALSE_WORDS = frozenset({"0", "off", "no"})
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# Variables read by the core itself (not by a feature).
CORE_VARIABLES = (
    "LOONGKIT_ALL",
    "LOONGKIT_LOGLEVEL",
    "LOONGKIT_LOGDIR",
    "LOONGKIT_STRICT",
    "LOONGKIT_SUMMARY_JSON",
    "LOONGKIT_SYSFS_ROOT",
    "LOONGKIT_ACTIVATION_TIMEOUT",
    "LOONGKIT_DISABLE_PLUGINS",
    "LOONGKIT_KERNEL_CACHE",  # where plugins cache compiled kernels (read by loongkit_core.kernels)
    "LOONGKIT_KERNEL_ISA",  # a lower instruction set for the compiled kernels (read by loongkit_core.kernels)
    "LOONGKIT_RESOLVE_ONCE",  # 0: every process resolves in full (read by loongkit_core.resolved)
)

PRELUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prelude")


def parse_bool(value: object) -> bool:
    """The seed's bool rule; raises ValueError for an undefined value."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(f"{value!r} is not one of 1/on/yes/0/off/no")


def is_unset(value: str | None) -> bool:
    """The one rule for every LOONGKIT_* variable: absent, empty or all blank means unset."""
    return value is None or not value.strip()


def bool_or_none(value: str | None) -> tuple[bool | None, bool]:
    """Parse an optional bool variable: (value or None when unset/undefined, was_it_invalid)."""
    if is_unset(value):
        return None, False
    try:
        return parse_bool(value), False
    except ValueError:
        return None, True


def requested(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """True when some LOONGKIT_* variable may enable a feature (so the full boot is needed).

    Anything not plainly "off" counts, including invalid values: the full boot is what warns
    about them (and about misspelled names).
    """
    env = os.environ if environ is None else environ
    for name, value in env.items():
        if name.startswith("LOONGKIT_") and name not in _PASSIVE and value.strip().lower() not in _OFF:
            return True
    return False


def boot(source: str) -> object | None:
    """Boot loongkit in this process once; ``source`` is "prelude", "all" or "launcher".

    Never raises into the user's program unless LOONGKIT_STRICT=1.
    """
    state = sys.modules.get("loongkit_core.runtime")
    if state is not None and getattr(state, "_runtime", None) is not None:
        return state._runtime  # type: ignore[attr-defined]
    if not requested():
        return None
    from loongkit_core import process

    if process.classify(list(getattr(sys, "orig_argv", sys.argv))) in (process.LAUNCHER, process.HELPER):
        return None  # torchrun's agent, loongkit-run, forkserver: they train nothing
    try:
        from loongkit_core import runtime
    except Exception as exc:  # a broken install must not stop the user's program
        sys.stderr.write(f"loongkit: cannot load the runtime ({type(exc).__name__}: {exc}); continuing without it\n")
        return None
    try:
        rt = runtime.start()
    except runtime.LoongkitStrictError as exc:
        if source != "prelude":
            raise
        # Python's site.py swallows errors from sitecustomize; strict mode must fail the run.
        sys.stderr.write(f"loongkit (LOONGKIT_STRICT=1): {exc}\n")
        sys.stderr.flush()
        os._exit(3)
    if rt is not None:
        rt.log.debug("booted", source=source)
    return rt


def export_prelude_for_children() -> None:
    """Put the prelude on PYTHONPATH so spawned children (DataLoader spawn workers, torchrun ranks)
    load loongkit too, as they would under loongkit-run."""
    current = os.environ.get("PYTHONPATH", "")
    parts = [p for p in current.split(os.pathsep) if p]
    if not any(_same_dir(p, PRELUDE_DIR) for p in parts):
        os.environ["PYTHONPATH"] = os.pathsep.join([PRELUDE_DIR, *parts])


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False
