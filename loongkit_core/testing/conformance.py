"""Conformance of a plugin with the kit's contract: call it from the plugin's own tests.

::

    from loongkit_core.testing.conformance import assert_conforms

    def test_conforms() -> None:
        assert_conforms("mine")          # the entry-point name in the ``loongkit`` group

What it checks (each problem is one line of the assertion message):

* the entry point gives a :class:`~loongkit_core.kit.PluginSpec` whose ``name`` is the entry-point name
  (the name the core uses: Summary, ``Feature.plugin``, ``LOONGKIT_DISABLE_PLUGINS``), and whose
  ``distribution``, when given, is the distribution that registers the entry point;
* declaring is cheap: importing the declaration module, then each impl module (imported at boot when its
  feature is enabled), imports none of ``heavy`` (torch, numpy, the OpenMMLab packages...);
* every target is a dotted module name; every requirement parses (PEP 508); ``depends_on`` and
  ``disables`` name declared features; ``implemented=False`` comes without an impl;
* every impl path imports and names a :class:`~loongkit_core.kit.FeatureImpl` subclass;
* the variables the feature's configure step reads (every settings model it loads, with
  ``load_settings``) are exactly its declared ``options`` (a variable read but not declared is called
  "unknown, did you mean" at boot; one declared but not read is a dead name in the docs), and with
  every variable unset configure gives no warning (defaults are valid).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from loongkit_core import hookspecs

# What a declaration module or an impl module must not import at its top level: loongkit boots in every
# Python process of a job, and these cost 0.1-2 s each (import them inside activate()).
HEAVY_MODULES = ("torch", "numpy", "triton", "mmcv", "mmengine", "mmdet", "mmseg", "mmdet3d", "transformers",
                 "accelerate")

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_VARIABLE = re.compile(r"LOONGKIT_[A-Z0-9_]+\Z")


def entry_point(name: str) -> importlib.metadata.EntryPoint | None:
    """The installed ``loongkit`` entry point called ``name`` (None when there is none)."""
    for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep
    return None


def _entry_point_of(spec: Any) -> importlib.metadata.EntryPoint | None:
    """The installed entry point whose object is ``spec`` (only among modules already imported)."""
    for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        module = sys.modules.get(ep.module)
        if module is not None and ep.attr and getattr(module, ep.attr, None) is spec:
            return ep
    return None


def _module_of(spec: Any) -> str | None:
    """The module that holds ``spec`` at its top level (for a spec given as an object)."""
    for name, module in list(sys.modules.items()):
        try:
            if any(value is spec for value in vars(module).values()):
                return name
        except TypeError:
            continue
    return None


def plugin_problems(plugin: Any, *, heavy: Sequence[str] = HEAVY_MODULES, external: Iterable[str] = (),
                    imports: bool = True) -> list[str]:
    """Every way ``plugin`` breaks the kit's contract, one line each (empty: it conforms).

    ``plugin`` is an entry-point name (the installed plugin, as the core loads it) or a PluginSpec
    object (entry-point checks then run only if an installed entry point gives that object).
    ``external`` names features of other plugins that ``depends_on``/``disables`` may refer to;
    ``imports=False`` skips the subprocess that checks what declaring and impl modules import.
    """
    from loongkit_core.kit import PluginSpec

    problems: list[str] = []
    if isinstance(plugin, str):
        ep = entry_point(plugin)
        if ep is None:
            return [f"no entry point {plugin!r} in the {hookspecs.ENTRY_POINT_GROUP!r} group: is it installed?"]
        try:
            spec = ep.load()
        except Exception as exc:
            return [f"entry point {ep.name} = {ep.value} does not load: {type(exc).__name__}: {exc}"]
    else:
        spec, ep = plugin, _entry_point_of(plugin)
    if not isinstance(spec, PluginSpec):
        return [f"{spec!r} is not a loongkit_core.kit.PluginSpec (these checks cover kit plugins only)"]
    label = ep.name if ep is not None else spec.name
    if ep is not None:
        if ep.name != spec.name:
            problems.append(f"entry point {ep.name!r} gives PluginSpec({spec.name!r}): the core knows a plugin by "
                            "its entry-point name (Summary, LOONGKIT_DISABLE_PLUGINS); use one name")
        dist = getattr(getattr(ep, "dist", None), "name", None)
        if spec.distribution and dist and canonicalize_name(spec.distribution) != canonicalize_name(dist):
            problems.append(f"PluginSpec(distribution={spec.distribution!r}) but the entry point is "
                            f"registered by {dist!r}")
    features = spec.features
    if not features:
        problems.append(f"plugin {label!r} declares no feature")
    declared = {f.name for f in features} | set(external)
    switches = {f.env for f in features}
    impl_modules: list[str] = []
    for feature in features:
        problems.extend(_feature_problems(spec, feature, declared, switches, impl_modules))
    if imports:
        module = ep.module if ep is not None else _module_of(spec)
        problems.extend(_import_problems(module, impl_modules, heavy))
    return [f"{label}: {p}" for p in problems]


def assert_conforms(plugin: Any, **kwargs: Any) -> None:
    """Raise AssertionError listing every problem :func:`plugin_problems` finds."""
    problems = plugin_problems(plugin, **kwargs)
    assert not problems, "plugin does not conform:\n  " + "\n  ".join(problems)


def _feature_problems(spec: Any, feature: Any, declared: set[str], switches: set[str],
                      impl_modules: list[str]) -> list[str]:
    from loongkit_core.kit import FeatureImpl

    name = feature.name
    out: list[str] = []
    for target in feature.targets:
        if not _DOTTED.match(target):
            out.append(f"{name}: target {target!r} is not a dotted module name (e.g. 'mmdet.models.losses')")
    if len(set(feature.targets)) != len(feature.targets):
        out.append(f"{name}: a target is listed twice")
    for text in feature.requires:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            out.append(f"{name}: requirement {text!r} does not parse: {exc}")
            continue
        if req.marker is not None or req.extras:
            out.append(f"{name}: requirement {text!r}: markers and extras are not evaluated; use name and versions")
    for field in ("depends_on", "disables"):
        for other in getattr(feature, field):
            if other not in declared:
                out.append(f"{name}: {field} names {other!r}, which is not declared (pass external= for another "
                           "plugin's feature)")
    for var in feature.options:
        if not _VARIABLE.match(var):
            out.append(f"{name}: option {var!r} is not an upper-case LOONGKIT_* name")
        if var in switches:
            out.append(f"{name}: option {var} is also a feature's switch")
    if not feature.implemented:
        if spec.owns(feature):
            out.append(f"{name}: declared implemented=False but given an impl")
        return out
    try:
        impl = spec.impl(feature)
    except Exception as exc:
        return [*out, f"{name}: its impl does not import: {type(exc).__name__}: {exc}"]
    if not isinstance(impl, FeatureImpl):
        return [*out, f"{name}: its impl {type(impl).__qualname__} is not a loongkit_core.kit.FeatureImpl"]
    # The module named by the impl path is what the boot imports (the class may live elsewhere).
    module = spec._impl_paths.get(name, "").partition(":")[0] or type(impl).__module__
    if module not in impl_modules:
        impl_modules.append(module)
    read, warnings, error = _variables_read(impl)
    if error:
        return [*out, f"{name}: configure with every variable unset raised {error}"]
    for warning in warnings:
        out.append(f"{name}: with every variable unset, configure warns: {warning}")
    for var in sorted(read - set(feature.options)):
        out.append(f"{name}: reads {var} but does not declare it in options= (boot would call it unknown)")
    for var in sorted(set(feature.options) - read):
        out.append(f"{name}: declares option {var} that its configure step does not read (no settings model "
                   "loaded with load_settings has it)")
    return out


def _variables_read(impl: Any) -> tuple[set[str], list[str], str]:
    """Variables of every settings model ``impl.configure`` loads with an empty environment."""
    from loongkit_core import process, settings
    from loongkit_core.context import Environment

    core, _ = settings.load_settings(settings.CoreSettings, environ={})
    env = Environment(core, process.detect(), environ={})
    loaded: list[type[settings.LoongkitSettings]] = []
    token = settings._loaded.set(loaded)
    try:
        _config, warnings = impl.configure(env, None)
    except Exception as exc:
        return set(), [], f"{type(exc).__name__}: {exc}"
    finally:
        settings._loaded.reset(token)
    return {var for model in loaded for var in model.env_names()}, list(warnings), ""


_PROBE = """
import importlib, json, sys
heavy = set(sys.argv[1].split(","))
seen, report = set(), []
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        report.append([name, None, f"{type(exc).__name__}: {exc}"])
        continue
    now = {m.split(".")[0] for m in sys.modules} & heavy
    report.append([name, sorted(now - seen), None])
    seen |= now
print(json.dumps(report))
"""


def _import_problems(module: str | None, impl_modules: list[str], heavy: Sequence[str]) -> list[str]:
    """Import the declaration module, then each impl module, in a fresh interpreter: none may pull ``heavy``."""
    names = [m for m in [module, *impl_modules] if m]
    if not names or not heavy:
        return []
    from loongkit_core.testing import clean_environ

    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", _PROBE, ",".join(heavy), *names], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        return [f"importing {', '.join(names)} failed: {proc.stderr.strip()[-500:]}"]
    out = []
    for name, pulled, error in json.loads(proc.stdout):
        if error:
            out.append(f"module {name} does not import: {error}")
        elif pulled:
            role = "declaring" if name == module else "impl module"
            out.append(f"{role} {name} imports {', '.join(pulled)} at its top level: loongkit imports it at "
                       "boot in every process; import it inside activate()")
    return out
