"""Test double of mmcv 1.x's ``mmcv/utils/registry.py`` (1.3-1.7): what the registry hook relies on.

``Registry`` keeps ``_module_dict`` (exposed as the ``module_dict`` property), ``_children`` and a
parent; ``register_module(name=None, force=False, module=None)`` works as decorator or call and
routes through ``_register_module(module_class, module_name=None, force=False)`` with keyword
arguments, as mmcv 1.x does; ``build`` calls ``build_from_cfg``. Written for loongkit's tests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def build_from_cfg(cfg: dict[str, Any], registry: Registry, default_args: dict[str, Any] | None = None) -> Any:
    args = dict(cfg)
    obj_type = args.pop("type")
    obj_cls = registry.get(obj_type) if isinstance(obj_type, str) else obj_type
    if obj_cls is None:
        raise KeyError(f"{obj_type} is not in the {registry.name} registry")
    for key, value in (default_args or {}).items():
        args.setdefault(key, value)
    return obj_cls(**args)


class Registry:
    def __init__(self, name: str, build_func: Callable[..., Any] | None = None, parent: Registry | None = None,
                 scope: str | None = None) -> None:
        self._name = name
        self._module_dict: dict[str, type] = {}
        self._children: dict[str, Registry] = {}
        self._scope = scope or name
        self.build_func = build_func or (parent.build_func if parent is not None else build_from_cfg)
        self.parent = parent
        if parent is not None:
            parent._children[self._scope] = self

    @property
    def name(self) -> str:
        return self._name

    @property
    def module_dict(self) -> dict[str, type]:
        return self._module_dict

    @property
    def children(self) -> dict[str, Registry]:
        return self._children

    def get(self, key: str) -> type | None:
        if key in self._module_dict:
            return self._module_dict[key]
        return self.parent.get(key) if self.parent is not None else None

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return self.build_func(*args, **kwargs, registry=self)

    def _register_module(self, module_class: type, module_name: str | list[str] | None = None,
                         force: bool = False) -> None:
        if not inspect.isclass(module_class):
            raise TypeError(f"module must be a class, but got {type(module_class)}")
        if module_name is None:
            module_name = module_class.__name__
        for name in [module_name] if isinstance(module_name, str) else module_name:
            if not force and name in self._module_dict:
                raise KeyError(f"{name} is already registered in {self.name}")
            self._module_dict[name] = module_class

    def register_module(self, name: str | None = None, force: bool = False, module: type | None = None) -> Any:
        if module is not None:
            self._register_module(module_class=module, module_name=name, force=force)
            return module

        def _register(cls: type) -> type:
            self._register_module(module_class=cls, module_name=name, force=force)
            return cls

        return _register
