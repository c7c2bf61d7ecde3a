"""Model classes found by name where projects register them, checked against an interface, then patched.

A model feature (BEVFORMER, UNIAD) names the classes it knows (:class:`Spec` per registry name) and
one patch function per kind of change; :class:`ModelClasses` watches the registries
(:mod:`.registry`) for those names, checks each registered class (:func:`interface_problem`) and
patches it, or leaves it alone with "interface differs: ..." in the Summary. Everything it does is
recorded through the feature's ``ctx.patcher``, so the default ``deactivate`` undoes it all.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_ops.patches import registry


@dataclass(frozen=True)
class Patched:
    """What a patch function did to a class: ``brief`` for the Summary's row (what the class runs on now,
    a few words), ``detail`` for the JSON's ``details.patched`` (how, and what stays upstream's)."""

    brief: str
    detail: str


# patch(ctx, registered name, class) -> what was done (raises NotApplicable: the class is left alone)
Patch = Callable[[ActivationContext, str, type], Patched]


@dataclass(frozen=True)
class Spec:
    """What a registered class must look like for its patch: ``kind`` says which patch."""

    kind: str  # the key of the feature's patch functions ("sca", "msda", "collision")
    forward: tuple[str, ...]  # the forward's parameters, "**" for **kwargs
    init: tuple[str, ...]  # __init__ parameters that must exist (they make the attributes used)
    uses: tuple[str, ...]  # names the forward's code must reference


def _params(fn: Any) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    return tuple("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else p.name for p in params)


def code_names(code: Any) -> set[str]:
    """Global/attribute names a code object and its nested ones (comprehensions, lambdas) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def forward_function(cls: type) -> Any:
    """The class's forward without decorators (mmcv's force_fp32 / deprecated_api_warning use wraps)."""
    return inspect.unwrap(getattr(cls, "forward", None))


def interface_problem(name: str, cls: type, spec: Spec) -> str | None:
    """None when ``cls`` has the upstream interface ``spec`` describes, else what differs."""
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return f"interface differs: {name} is not an nn.Module class"
    forward = forward_function(cls)
    code = getattr(forward, "__code__", None)
    if code is None:
        return f"interface differs: {name}.forward is not a Python function"
    try:
        fparams = _params(forward)
        iparams = set(_params(cls.__init__))
    except (TypeError, ValueError):
        return f"interface differs: cannot read {name}'s signatures"
    if fparams != spec.forward:
        return f"interface differs: {name}.forward{fparams}, expected {spec.forward}"
    missing = [p for p in spec.init if p not in iparams]
    if missing:
        return f"interface differs: {name}.__init__ lacks {missing}"
    used = code_names(code)
    unused = [n for n in spec.uses if n not in used]
    if unused:
        return f"interface differs: {name}.forward does not use {unused}"
    return None


def mark(forward: Any, ctx: ActivationContext, original: Any) -> Any:
    """Tag a replacement forward: the feature that installed it, and the forward it replaces."""
    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__loongkit_feature__ = ctx.feature.name
    forward.__loongkit_original__ = original
    return forward


class ModelClasses:
    """One activation's watch over the registries for ``specs``; what matched, what did not."""

    def __init__(self, ctx: ActivationContext, specs: dict[str, Spec], patches: dict[str, Patch]) -> None:
        self.ctx = ctx
        self.specs = specs
        self.patches = patches
        self.seen: set[type] = set()
        self.patched: dict[str, str] = {}  # "<name> (<module>)" -> detail
        self.problems: dict[str, str] = {}
        self.rows: dict[str, str] = {}  # the Summary row: what each patched class (or target) runs on
        self.registries: list[type] = []

    @classmethod
    def of(cls, ctx: ActivationContext, specs: dict[str, Spec], patches: dict[str, Patch]) -> ModelClasses:
        """This activation's ModelClasses (in ``ctx.scratch``): made on first use, forgotten at
        ``ctx.patcher.undo()`` (so a later activation starts afresh and patches every class again)."""
        found: ModelClasses | None = getattr(ctx.scratch, "model_classes", None)
        if found is None:
            found = ctx.scratch.model_classes = cls(ctx, specs, patches)
        return found

    def watch(self, module_name: str) -> None:
        """Watch the Registry of ``module_name`` (mmcv.utils.registry / mmengine.registry.registry)."""
        module = sys.modules[module_name]
        registry_cls = getattr(module, "Registry", None)
        if registry_cls in self.registries:
            return
        try:
            registry.watch(self.ctx, module, self.on_register, names=self.specs)
        except NotApplicable as exc:  # not raised on: that would also undo this feature's other targets
            self.problems[module_name] = f"registry hook not installed: {exc}"
            self.ctx.log.warning("registry not watched", target=module_name, reason=str(exc))
            self.refresh()
            return
        self.registries.append(registry_cls)  # type: ignore[arg-type]
        self.ctx.log.info("watching registrations", registry=f"{registry_cls.__module__}.Registry",
                          classes=sorted(self.specs), patched=sorted(self.patched))
        self.refresh()

    def on_register(self, name: str, cls: type) -> None:
        spec = self.specs.get(name)
        if spec is None or cls in self.seen:
            return
        self.seen.add(cls)
        label = f"{name} ({cls.__module__})"
        owner = getattr(forward_function(cls), "__loongkit_feature__", None)
        if owner is not None:  # BEVFORMER and UNIAD watch the same classes: the first one patches
            self.patched[label] = f"patched by LOONGKIT_{str(owner).upper()}"
            self.row(name, f"by LOONGKIT_{str(owner).upper()}")
            self.refresh()
            return
        problem = interface_problem(name, cls, spec)
        if problem is None:
            try:
                done = self.patches[spec.kind](self.ctx, name, cls)
            except NotApplicable as exc:
                problem = str(exc)
            else:
                self.patched[label] = done.detail
                self.problems.pop(label, None)
                self.row(name, done.brief)
                self.ctx.log.info("model class patched", cls=label, how=done.detail)
        if problem is not None:
            self.problems[label] = problem
            self.ctx.log.warning("model class not patched", cls=label, reason=problem)
        self.refresh()

    def row(self, key: str, brief: str) -> None:
        """Name ``key`` (a class, or another thing the feature patched) in the Summary's row; a second class
        of that name (a fork beside the original) that runs on something else adds its brief."""
        known = self.rows.get(key)
        if known is None or brief in known.split(" / "):
            self.rows[key] = known or brief
        else:
            self.rows[key] = f"{known} / {brief}"

    def refresh(self) -> None:
        """What the Summary shows: what each patched class runs on in the row (its configuration column),
        patched classes and mismatches in the JSON, mismatches as the reason."""
        self.ctx.set_config(dict(self.rows) or None)
        self.ctx.detail("patched", dict(self.patched))
        self.ctx.detail("not_applicable", dict(self.problems))
        self.ctx.waiting("; ".join(f"{k}: {v}" for k, v in self.problems.items()))
