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
  every variable unset configure gives no warning (defaults are valid);
* the seam between a plugin and the core (:func:`seam_problems`, read from the source of every module of
  the plugin's packages, functions included): it never writes a feature record (``record.state = ...``,
  ``ctx.record.calls += 1``, ``record.details[k] = v``, ``setattr(record, ...)``, a ``State`` member
  assigned anywhere): the runtime owns the records, a feature says what happened through the
  ActivationContext verbs; no impl overrides ``deactivate`` (every change goes through ``ctx.patcher``,
  undone by the default); it imports no other loongkit plugin's package (plugins meet only through the
  core); it imports none of the core's :data:`RUNTIME_INTERNALS` (``runtime.current()`` and the rest of
  the machinery that loads plugins and runs features) and no private (``_``) name of a core module.
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

# The core's machinery that loads plugins and runs features: no plugin imports these. What a feature
# needs of it comes through its ActivationContext (ctx.features(), ctx.log, ctx.on_import, ctx.at_exit),
# its Environment (ctx.env: settings, process, hardware) and the core's other modules (context, kit,
# feature, settings, log, hardware, process, workers, activity, requirements, resident, kernels,
# kernelbuild, cgroupfs, compare, testing).
RUNTIME_INTERNALS = ("loongkit_core.runtime", "loongkit_core.resolution", "loongkit_core.replay",
                     "loongkit_core.lifecycle", "loongkit_core.activity_gather", "loongkit_core.resolved",
                     "loongkit_core.manager", "loongkit_core.importhooks", "loongkit_core._boot", "loongkit_core.all",
                     "loongkit_core.prelude", "loongkit_core.launcher")
# The fields of a FeatureRecord (loongkit_core.feature): written by the runtime and the context's verbs only.
RECORD_FIELDS = frozenset({"state", "reason", "explicit", "enabled", "config", "calls", "activation_calls",
                           "worker_calls", "workers", "node", "applied_targets", "policy", "details"})
_MUTATORS = frozenset({"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault",
                       "__setitem__", "__delitem__"})

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
    problems.extend(reference_problems(spec))
    module = ep.module if ep is not None else _module_of(spec)
    if imports:
        problems.extend(_import_problems(module, impl_modules, heavy))
    problems.extend(seam_problems(spec, [m for m in [module, *impl_modules] if m]))
    return [f"{label}: {p}" for p in problems]


def reference_problems(spec: Any) -> list[str]:
    """The spec's handles on other plugins' features (``PluginSpec.refer``) that the installed
    referenced plugin does not declare. A referenced plugin that is not installed cannot be
    checked here (the core checks the handle again at boot wherever both are installed)."""
    from loongkit_core.kit import PluginSpec

    problems: list[str] = []
    for ref in spec.references:
        if ref.plugin == spec.name:
            names = [f.name for f in spec.features]
        else:
            ep = entry_point(ref.plugin)
            if ep is None:
                continue
            try:
                other = ep.load()
            except Exception as exc:
                problems.append(f"refers to {ref.plugin}:{ref.name}, whose plugin does not load: {exc}")
                continue
            if not isinstance(other, PluginSpec):
                continue
            names = [f.name for f in other.features]
        problem = ref.problem({ref.plugin: names})
        if problem is not None:
            problems.append(problem)
    return problems


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


# -- the seam ---------------------------------------------------------------------------------------------


def seam_problems(spec: Any, modules: Sequence[str]) -> list[str]:
    """What breaks the seam between plugin ``spec`` and the core: its impls' ``deactivate`` overrides, then
    record writes, State assignments and imports of another plugin or of the core's internals anywhere in
    the source of ``modules``' top-level packages (the declaration and impl modules: the plugin's code)."""
    import inspect

    from loongkit_core.kit import FeatureImpl

    out: list[str] = []
    for feature in spec.features:
        if not feature.implemented or not spec.owns(feature):
            continue
        try:
            cls = type(spec.impl(feature))
        except Exception:  # reported by the impl check
            continue
        for klass in cls.__mro__:
            if klass is FeatureImpl:
                break
            if "deactivate" in vars(klass):
                where = ""
                try:
                    where = f" ({os.path.basename(inspect.getsourcefile(klass) or '')}:"
                    where += f"{inspect.getsourcelines(klass.deactivate)[1]})"
                except (OSError, TypeError):
                    pass
                out.append(f"{feature.name}: {klass.__qualname__} overrides deactivate{where}: make every change "
                           "through ctx.patcher, which the default deactivate undoes")
                break
    own = {m.partition(".")[0] for m in modules}
    others = _plugin_packages() - own
    for path, rel in _source_files(sorted(own)):
        out.extend(f"{rel}:{line}: {text}" for line, text in _file_seam_problems(path, own, others))
    return out


def _plugin_packages() -> set[str]:
    """Top-level packages of every installed loongkit plugin (its entry point's module)."""
    found = set()
    for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        found.add(ep.value.partition(":")[0].strip().partition(".")[0])
    return found


def _source_files(tops: Sequence[str]) -> list[tuple[str, str]]:
    """(path, path shown) of every ``.py`` file of the top-level modules/packages ``tops``."""
    import importlib.util

    files: list[tuple[str, str]] = []
    for top in tops:
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if found is None:
            continue
        for location in found.submodule_search_locations or ():
            base = os.path.dirname(os.path.abspath(location))
            for directory, dirs, names in os.walk(location):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                files.extend((os.path.join(directory, n), os.path.relpath(os.path.join(directory, n), base))
                             for n in sorted(names) if n.endswith(".py"))
        if not found.submodule_search_locations and found.origin and found.origin.endswith(".py"):
            files.append((found.origin, os.path.basename(found.origin)))
    return files


def _is_other_plugin(name: str, own: set[str], others: set[str]) -> bool:
    top = name.partition(".")[0]
    return top not in own and (top in others or (top.startswith("loongkit_") and top != "loongkit_core"))


def _internal(name: str) -> str | None:
    """Why the dotted ``name`` is the core's internals (None: it is public)."""
    for internal in RUNTIME_INTERNALS:
        if name == internal or name.startswith(internal + "."):
            return (f"{name}: the core's runtime internals (conformance.RUNTIME_INTERNALS); a plugin reads what "
                    "it needs through its ActivationContext, its Environment and the core's public modules")
    if name.startswith("loongkit_core."):
        private = [p for p in name.split(".")[1:] if p.startswith("_") and not p.startswith("__")]
        if private:
            return f"{name}: a private name of the core"
    return None


def _file_seam_problems(path: str, own: set[str], others: set[str]) -> list[tuple[int, str]]:
    import ast

    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError) as exc:
        return [(0, f"cannot be read for the seam check: {type(exc).__name__}: {exc}")]
    found: dict[tuple[int, str], None] = {}

    def add(node: Any, text: str) -> None:
        found[(getattr(node, "lineno", 0), text)] = None

    def imported(node: Any, name: str) -> None:
        if _is_other_plugin(name, own, others):
            add(node, f"imports {name}, another loongkit plugin's package: plugins meet only through the core")
        why = _internal(name)
        if why:
            add(node, f"imports {why}")

    aliases: dict[str, str] = {}  # local name -> the dotted core name it is bound to
    states: set[str] = set()  # local names of loongkit_core.feature.State
    records: set[str] = {"record"}  # local names of a feature record
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                imported(node, a.name)
                if a.name.startswith("loongkit_core"):
                    aliases[a.asname or a.name.partition(".")[0]] = a.name if a.asname else "loongkit_core"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                imported(node, full if node.module == "loongkit_core" else node.module)
                if node.module.startswith("loongkit_core"):
                    aliases[a.asname or a.name] = full
                    if full == "loongkit_core.feature.State":
                        states.add(a.asname or a.name)
                    if node.module != "loongkit_core" and not _internal(node.module) and _internal(full):
                        add(node, f"imports {_internal(full)}")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "record":
            records.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def dotted(node: Any) -> str | None:
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in aliases:
            return ".".join([aliases[node.id], *reversed(parts)])
        return None

    def recordish(node: Any) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "record") or (
            isinstance(node, ast.Name) and (node.id in records or node.id.endswith("_record")))

    def record_target(node: Any) -> bool:
        """A target that writes a record: record.<field>, record.<field>[...] (and deeper)."""
        while isinstance(node, ast.Subscript):
            node = node.value
        return isinstance(node, ast.Attribute) and node.attr in RECORD_FIELDS and recordish(node.value)

    def is_state(node: Any) -> bool:
        return isinstance(node, ast.Attribute) and (
            (isinstance(node.value, ast.Name) and node.value.id in states)
            or dotted(node.value) == "loongkit_core.feature.State")

    def targets(node: Any) -> list[Any]:
        if isinstance(node, ast.Assign):
            raw = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            raw = [node.target]
        elif isinstance(node, ast.Delete):
            raw = node.targets
        else:
            return []
        flat: list[Any] = []
        while raw:
            t = raw.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                raw.extend(t.elts)
            else:
                flat.append(t.value if isinstance(t, ast.Starred) else t)
        return flat

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            why = _internal(name) if name else None
            if why:
                add(node, f"uses {why}")
        for target in targets(node):
            if record_target(target):
                add(node, f"writes the feature record ({ast.unparse(target)}): the runtime owns it; say what "
                          "happened through the ActivationContext verbs (ctx.count, ctx.waiting, ctx.detail, ...)")
        value = getattr(node, "value", None) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) else None
        if value is not None and any(is_state(n) for n in ast.walk(value)):
            add(node, "assigns a State member: a feature's state follows its ActivationContext verbs "
                      "(ctx.not_applicable, ctx.applied)")
        if isinstance(node, ast.Call):
            func = node.func
            first = node.args[0] if node.args else None
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname == "setattr" and first is not None and len(node.args) > 1 and recordish(first) and \
                    isinstance(node.args[1], ast.Constant) and node.args[1].value in RECORD_FIELDS:
                add(node, f"writes the feature record (setattr(..., {node.args[1].value!r})): the runtime owns it")
            if isinstance(func, ast.Attribute) and func.attr in _MUTATORS and isinstance(func.value, ast.Attribute) \
                    and func.value.attr in RECORD_FIELDS and recordish(func.value.value):
                add(node, f"writes the feature record ({ast.unparse(func)}(...)): the runtime owns it; "
                          "use ctx.detail / ctx.fallback")
            module_name = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            by_modules = isinstance(func, ast.Attribute) and func.attr == "get" and \
                ast.unparse(func.value) == "sys.modules"
            if module_name and (fname in ("import_module", "__import__") or by_modules):
                imported(node, module_name)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules" and \
                isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            imported(node, node.slice.value)
    return sorted(found)
