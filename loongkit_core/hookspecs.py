"""Hook specifications of the ``loongkit`` pluggy project.

A plugin is any object or module with functions marked ``@hookimpl`` (below), registered through
the ``loongkit`` entry-point group::

    [project.entry-points.loongkit]
    myplugin = "my_package.plugin"

The core calls the feature hooks (detect, configure, activate, deactivate) only on the plugin that
declared the feature, one plugin at a time, each call isolated: an exception is logged with its
traceback, recorded against that plugin's feature, shown in the Feature Summary, and the run goes on
(``LOONGKIT_STRICT=1`` turns it into an error). Hook wrappers are therefore not supported.

Most plugins do not implement these hooks by hand: :class:`loongkit_core.kit.PluginSpec` implements
them by dispatching to one :class:`loongkit_core.kit.FeatureImpl` per feature.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from loongkit_core.context import ActivationContext, Environment
    from loongkit_core.feature import Feature, FeatureRecord, FeatureRef, PolicyDecision
    from loongkit_core.hardware import Hardware

PROJECT = "loongkit"
ENTRY_POINT_GROUP = "loongkit"
# The hookspec version; a plugin declares the range it was built for (``LOONGKIT_CORE_API`` in its
# plugin object or module). An incompatible plugin is refused and named in the Summary.
CORE_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def loongkit_declare_features() -> Sequence[Feature]:
    """Return the features this plugin provides.

    Called once per job when loongkit boots with at least one feature requested: the job's other
    processes reuse the declarations (:mod:`loongkit_core.resolved`). Must be
    cheap: import nothing heavy (no torch, no target library). Declare features that are not built
    yet with ``implemented=False``: the Summary then says "not implemented".
    """


@hookspec
def loongkit_feature_references() -> Sequence[FeatureRef]:
    """Return handles on other plugins' features this plugin reads or names (optional).

    Checked by the core at boot against every plugin's declarations: a handle whose plugin is
    loaded but declares no such feature is this plugin's fault (logged, in the Summary), never a
    silent no-op. Must be as cheap as :func:`loongkit_declare_features`.
    """


@hookspec
def loongkit_hardware_policy(hardware: Hardware, features: Sequence[Feature]) -> Mapping[str, PolicyDecision]:
    """Return hardware-aware default policies, keyed by feature name.

    Called on every plugin (a plugin may set policy for another plugin's feature, e.g. a vendor
    plugin). ``hardware`` is the core's detected topology (CPU vendor, NUMA nodes, GPUs). A decision
    changes defaults only: an explicit ``LOONGKIT_X`` variable always wins.
    """


@hookspec
def loongkit_detect(feature: Feature, env: Environment) -> str | None:
    """Decide whether ``feature`` can apply in this environment beyond its declared ``requires``.

    Return ``None`` when it can, or a short reason when it cannot ("no NVIDIA GPU", "cgroup v2
    memory.reclaim missing"). Never import the target library to decide; use ``env.version()``,
    ``env.hardware`` and files. Read variables through ``env.environ`` (a process reusing the job's
    resolution checks that those have the values they had), not ``os.environ``. In a process that
    reuses the resolution, ``detect`` and ``configure`` of a feature run right before its first
    activation there, on the same implementation object as ``activate``.
    """


@hookspec
def loongkit_configure(feature: Feature, env: Environment, policy: PolicyDecision | None) -> tuple[object, list[str]]:
    """Parse and validate the feature's options from the environment.

    Return ``(config, warnings)``: ``config`` is what activation receives and what the Summary's
    "Configurations" column shows (``None`` when the feature has no options); ``warnings`` lists
    invalid values that reverted to their defaults. ``policy`` carries hardware-policy defaults.
    """


@hookspec
def loongkit_activate(feature: Feature, target: str | None, ctx: ActivationContext) -> None:
    """Apply the feature.

    Called once for each target module in ``feature.targets`` right after it finishes importing
    (or at once if it already had), with ``target`` set to its name; or once at boot with
    ``target=None`` for a feature without targets. Install patches through ``ctx.patcher`` so
    they can be undone, count real use with ``ctx.count()`` or ``ctx.counted(fn)``, and
    raise :class:`loongkit_core.context.NotApplicable` when the target's structure is not the one
    the patch expects.
    """


@hookspec
def loongkit_deactivate(feature: Feature, ctx: ActivationContext) -> None:
    """Undo what activation did (restore patched objects). ``ctx.patcher.undo()`` is the default."""


@hookspec
def loongkit_summary(records: Sequence[FeatureRecord]) -> Sequence[str]:
    """Return extra lines for the end of the Feature Summary (called on every plugin loaded in this
    process).

    A process that boots in full loads every plugin. One that reuses its job's resolution
    (:mod:`loongkit_core.resolved`: a DataLoader worker, a torchrun rank, a re-run) loads a plugin
    only when one of its features activates there, so report on features that ran in this process
    (``record.state`` applied/active, ``record.calls``); a plugin none of whose features ran is not
    asked.
    """


@hookspec
def loongkit_launch_environment(records: Sequence[FeatureRecord], environ: Mapping[str, str]) -> Mapping[str, str]:
    """Return variables ``loongkit-run`` sets for the command before it execs it.

    For what must be in place before the process starts, e.g. ``LD_PRELOAD`` of an allocator for an
    enabled malloc feature. ``records`` are resolved (enabled, applicable, configured) but nothing is
    armed; ``environ`` is the command's environment. A value the user already set wins, except
    ``LD_PRELOAD``, whose entries are prepended. Called only when a feature is requested.
    """


@hookspec
def loongkit_add_cli(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add subcommands to the ``loongkit`` command line (e.g. ``loongkit numa plan``)."""
