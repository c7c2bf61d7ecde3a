"""LOONGKIT_FUSED_ADAMW / LOONGKIT_FUSED_ADAM: torch.optim.AdamW / Adam with ``fused=True``.

The patch is on the class (``AdamW.__init__``), not on the name, so optimizers built by mmengine's or
mmcv's registries (which hold a reference to the class taken when they registered torch.optim) and
subclasses get it too. After the original ``__init__`` has run, the optimizer is switched to the fused
implementation exactly as ``fused=True`` would have done (every group's ``"fused"``, ``defaults`` for
groups added later, ``_step_supports_amp_scaling`` for GradScaler), unless a rule says it must not be:

* ``differentiable=True``, ``foreach=True`` or ``fused=False`` given by the user (for the optimizer or a
  param group): the user chose an implementation;
* sparse or complex parameters, non floating-point parameters, or a device without fused kernels
  (torch raises for those at the first step);
* a subclass that overrides ``step`` (it may not run torch's step at all).

A fallback is whole-optimizer: GradScaler hands ``grad_scale``/``found_inf`` to every group of an
optimizer whose ``_step_supports_amp_scaling`` is set, and torch's non-fused paths reject them.

``load_state_dict`` restores each param group's ``"fused"`` from the checkpoint (None for one saved
without fused), which would switch fused off again: a load post-hook switches it back on and moves
``step`` to the parameter's device as float32, as fused ``_init_group`` would have created it.
``state_dict`` writes the user's ``"fused"`` (None), so checkpoints are the same as without loongkit.
"""

from __future__ import annotations

import inspect
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl

# Instance attribute naming the feature that fused an optimizer (checked by the hooks below).
MARK = "_loongkit_fused"
FALLBACK_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def fused_devices(torch: Any) -> tuple[str, ...]:
    """Device types with fused optimizer kernels, as torch itself lists them."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except Exception:  # private helper moved: the list torch 2.4-2.13 has
        return FALLBACK_DEVICES


def torch_step(cls: type) -> bool:
    """``cls.step`` is torch.optim's own (under Optimizer's profiling wrapper and grad decorators)."""
    fn = getattr(cls, "step", None)
    for _ in range(16):  # a __wrapped__ chain, bounded against cycles
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return str(getattr(fn, "__module__", "")).startswith("torch.optim")


def fallback_reason(optimizer: Any, torch: Any, devices: tuple[str, ...], check_step: bool = True) -> str | None:
    """Why ``optimizer`` (already initialised) must stay unfused; None when it can be fused."""
    if check_step and not torch_step(type(optimizer)):
        return f"{type(optimizer).__name__} overrides step()"
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "differentiable=True"
        if group.get("fused") is False:
            return "fused=False set by user"
        if group.get("foreach"):
            return "foreach=True set by user"
        for p in group["params"]:
            if p.is_sparse:
                return "sparse parameters"
            if torch.is_complex(p):
                return "complex parameters"
            if not torch.is_floating_point(p):
                return f"{p.dtype} parameters"
            if p.device.type not in devices:
                return f"device {p.device.type} has no fused kernel"
    return None


def group_reason(group: dict[str, Any], torch: Any, devices: tuple[str, ...]) -> str | None:
    """The per-group part of :func:`fallback_reason` (for ``add_param_group``)."""
    class _One:
        param_groups = (group,)

    return fallback_reason(_One(), torch, devices, check_step=False)


class FusedAdamBase(FeatureImpl):
    """Shared by both features; ``class_name`` is the torch.optim class each one patches."""

    class_name = ""

    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self.counts: dict[str, Any] = {"fused": 0, "fallback": {}}

    # -- activation ------------------------------------------------------------------------------
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import torch
        import torch.optim

        cls = getattr(torch.optim, self.class_name, None)
        if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
            raise NotApplicable(f"torch.optim has no optimizer class {self.class_name}")
        try:
            params = inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError) as exc:
            raise NotApplicable(f"cannot read the signature of torch.optim.{self.class_name}.__init__: {exc}") from exc
        if "fused" not in params:
            raise NotApplicable(f"torch.optim.{self.class_name}.__init__ has no 'fused' parameter")
        for hook in ("register_step_post_hook", "register_load_state_dict_post_hook", "register_state_dict_post_hook"):
            if not hasattr(cls, hook):
                raise NotApplicable(f"torch.optim.{self.class_name} has no {hook}")
        if getattr(cls.__init__, "__loongkit_feature__", None) == self.feature.name:
            return  # already patched by this feature (a second activation of the same target)

        devices = fused_devices(torch)
        self.counts = {"fused": 0, "fallback": {}}  # per activation (the impl object outlives a runtime)
        original_init = cls.__init__
        original_add = cls.add_param_group
        ctx.set_config(self.counts)
        ctx.detail("fused_devices", list(devices))
        impl = self

        def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            original_init(optimizer, *args, **kwargs)
            if impl.owns(optimizer, torch):
                impl.maybe_fuse(ctx, optimizer, torch, devices)

        def add_param_group(optimizer: Any, param_group: dict[str, Any]) -> None:
            original_add(optimizer, param_group)
            if getattr(optimizer, MARK, None) != impl.feature.name:
                return
            reason = group_reason(optimizer.param_groups[-1], torch, devices)
            if reason is not None:
                impl.unfuse(optimizer)
                impl.count(ctx, optimizer, f"add_param_group: {reason}", fused=False, undo=True)

        __init__.__loongkit_feature__ = self.feature.name  # type: ignore[attr-defined]
        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        for attr in ("__doc__", "__qualname__", "__module__", "__name__"):
            setattr(__init__, attr, getattr(original_init, attr, None))
        __init__.__signature__ = inspect.signature(original_init)  # type: ignore[attr-defined]
        ctx.patcher.patch(cls, "__init__", __init__)
        ctx.patcher.patch(cls, "add_param_group", add_param_group)
        ctx.log.info("fused optimizer patch installed", cls=f"torch.optim.{self.class_name}", devices=list(devices))

    def owns(self, optimizer: Any, torch: Any) -> bool:
        """This feature's class is the closest of Adam/AdamW in the MRO (AdamW subclasses Adam)."""
        own = getattr(torch.optim, self.class_name)
        if not isinstance(optimizer, own):
            return False
        if self.class_name == "Adam":
            adamw = getattr(torch.optim, "AdamW", None)
            return not (isinstance(adamw, type) and isinstance(optimizer, adamw))
        return True

    def maybe_fuse(self, ctx: ActivationContext, optimizer: Any, torch: Any, devices: tuple[str, ...]) -> None:
        try:
            if any(g.get("fused") for g in optimizer.param_groups):
                self.count(ctx, optimizer, "fused=True set by user", fused=False)
                return
            reason = fallback_reason(optimizer, torch, devices)
            if reason is not None:
                self.count(ctx, optimizer, reason, fused=False)
                return
            self.fuse(ctx, optimizer)
            self.count(ctx, optimizer, None, fused=True)
        except Exception as exc:  # a fault here must leave the user's optimizer as torch built it
            self.unfuse(optimizer)
            ctx.log.error("fused optimizer setup failed; left unfused", error=repr(exc))
            self.counts["fallback"]["error"] = self.counts["fallback"].get("error", 0) + 1

    def fuse(self, ctx: ActivationContext, optimizer: Any) -> None:
        """What ``fused=True`` does in Adam.__init__, plus the hooks that keep it on."""
        for group in optimizer.param_groups:
            group["fused"] = True
        optimizer.defaults["fused"] = True
        optimizer._step_supports_amp_scaling = True
        setattr(optimizer, MARK, self.feature.name)
        count = ctx.count

        def stepped(opt: Any, args: Any, kwargs: Any) -> None:
            if getattr(opt, MARK, None) is not None:
                count()  # the Summary's '*': a fused step ran

        def saving(opt: Any, state_dict: dict[str, Any]) -> None:
            if getattr(opt, MARK, None) is not None:
                for group in state_dict.get("param_groups", ()):
                    group["fused"] = None  # what the user's code asked for (param_groups here are copies)

        def loaded(opt: Any) -> None:
            if getattr(opt, MARK, None) is not None:
                refuse(opt)

        optimizer.register_step_post_hook(stepped)
        optimizer.register_state_dict_post_hook(saving)
        optimizer.register_load_state_dict_post_hook(loaded)

    @staticmethod
    def unfuse(optimizer: Any) -> None:
        if getattr(optimizer, MARK, None) is None:
            return
        for group in optimizer.param_groups:
            group["fused"] = None
        optimizer.defaults["fused"] = None
        optimizer._step_supports_amp_scaling = False
        setattr(optimizer, MARK, None)

    def count(self, ctx: ActivationContext, optimizer: Any, reason: str | None, *, fused: bool,
              undo: bool = False) -> None:
        name = type(optimizer).__name__
        if undo:
            self.counts["fused"] -= 1
        if fused:
            self.counts["fused"] += 1
            ctx.log.info("optimizer fused", optimizer=name, groups=len(optimizer.param_groups))
        else:
            fallback = self.counts["fallback"]
            fallback[reason] = fallback.get(reason, 0) + 1
            ctx.log.info("optimizer left unfused", optimizer=name, reason=reason)


def refuse(optimizer: Any) -> None:
    """Re-apply fused after load_state_dict restored the checkpoint's groups and state."""
    import torch

    for group in optimizer.param_groups:
        group["fused"] = True
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                state["step"] = step.to(device=p.device, dtype=torch.float32)
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True


class FusedAdamW(FusedAdamBase):
    class_name = "AdamW"


class FusedAdam(FusedAdamBase):
    class_name = "Adam"
