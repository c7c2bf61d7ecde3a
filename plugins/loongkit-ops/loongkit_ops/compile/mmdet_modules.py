"""LOONGKIT_MMDET_MODULES: torch.compile chosen modules registered in mmdet 2.x's ``mmdet.models.builder.MODELS``.

``LOONGKIT_COMPILE_MMDET_MODULES_FILTER`` names them (comma-separated registry names, default
``CollisionLoss``). Such modules usually live in the user's project and register themselves *after*
mmdet is imported, so two paths lead to the same patch: classes already in ``MODELS.module_dict`` when
``mmdet.models.builder`` finishes importing, and classes registered later (``MODELS._register_module``,
the mmcv 1.x method behind ``register_module`` and its decorator form, is wrapped). Each matching class
gets its ``__init__`` wrapped so every instance, however it is built (``MODELS.build``, ``build_loss``,
a child registry, or directly), gets a compiled call (see :mod:`.common`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_settings import SettingsConfigDict

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_core.settings import LoongkitSettings
from loongkit_ops.compile._patch import after_init
from loongkit_ops.compile.common import Compiler


def _names(value: object) -> str:
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    if not names or not all(n.isidentifier() for n in names):
        raise ValueError(f"{value!r} is not a comma-separated list of module names")
    return ",".join(names)


class MMDetModulesOptions(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_COMPILE_MMDET_MODULES_", extra="ignore",
                                      case_sensitive=False)

    filter: Annotated[str, BeforeValidator(_names)] = Field(
        "CollisionLoss", description="Registry names of the modules to compile, comma-separated.")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.filter.split(","))


class CompileMMDetModules(FeatureImpl):
    options = MMDetModulesOptions

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import torch

        assert target is not None
        module = sys.modules.get(target) or importlib.import_module(target)
        registry = getattr(module, "MODELS", None)
        module_dict = getattr(registry, "module_dict", None)
        if not isinstance(module_dict, dict) or not callable(getattr(registry, "_register_module", None)):
            raise NotApplicable(f"{target}.MODELS is not an mmcv 1.x Registry (module_dict/_register_module)")
        options = ctx.config if isinstance(ctx.config, MMDetModulesOptions) else MMDetModulesOptions()
        names = options.names
        compiler = Compiler(ctx, extra={"filter": list(names), "patched": []})  # eager again at undo
        patched: set[type] = set()

        def patch_class(name: str, cls: Any) -> None:
            if name not in names or cls in patched:
                return
            if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
                compiler.keep_eager(name, "not an nn.Module class")
                return
            patched.add(cls)
            if "__init__" not in cls.__dict__:  # patch on the class itself, not on its base
                ctx.patcher.patch(cls, "__init__", cls.__init__, require=True)
            after_init(ctx, cls, compiler, lambda obj: compiler.compile_module(obj, name, group=name))
            compiler.config["patched"].append(name)
            ctx.log.info("mmdet module will be compiled at construction", module=name, cls=cls.__qualname__)

        original_register = registry._register_module

        def _register_module(*args: Any, **kwargs: Any) -> Any:
            before = dict(registry.module_dict)
            result = original_register(*args, **kwargs)
            for name, cls in registry.module_dict.items():
                if before.get(name) is not cls:
                    patch_class(name, cls)
            return result

        ctx.patcher.patch(registry, "_register_module", _register_module)
        for name, cls in list(module_dict.items()):
            patch_class(name, cls)
        missing = [n for n in names if n not in module_dict]
        ctx.log.info("mmdet modules filter armed", filter=list(names), registered_later=missing)
