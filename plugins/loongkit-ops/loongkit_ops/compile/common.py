"""What every compile feature shares: compile a module (or a callable) with torch.compile, fall back to
eager for that module when compiling fails, and measure what compiling cost.

How a module is compiled
    ``module._compiled_call_impl`` is torch's own slot for ``nn.Module.compile()``: ``Module.__call__``
    runs it instead of ``_call_impl`` when set. Using it (rather than wrapping in ``torch.compile(m)``)
    keeps ``state_dict`` keys, ``named_modules``, hooks and ``train()``/``eval()`` exactly as they were;
    and ``Module.__getstate__`` drops the slot, so ``copy.deepcopy`` (mmengine's EMA) and pickling give
    plain eager copies instead of copies that would call the original module's compiled code.

    What is compiled is ``entry(module, *args, **kwargs) -> module._call_impl(*args, **kwargs)``, with the
    module as an argument: with dynamo's inlined nn modules, instances of one structure (32 decoder
    layers) share one graph. Each *group* (a feature-chosen key such as "LlamaDecoderLayer" or
    "ResNet.layer2") gets its own copy of ``entry``'s code object, because dynamo keeps its cache (and its
    recompile limit, 8 entries) per code object: ResNet's four stages x train/eval would otherwise
    exhaust one shared cache and silently fall back to eager.

Fallback
    An exception out of the compiled call is a compile failure when a compile started during that call,
    or when it is one of dynamo's/inductor's own exceptions: the module is then switched to eager for
    good (logged, counted in the Summary under ``fallback``) and the call is rerun eagerly, so training
    goes on. Any other exception (the user's own error, which eager would raise too) and out-of-memory
    errors (mmdet/mmengine retry those) propagate unchanged.

Cost
    dynamo's compile start/end callbacks time every compile; the seconds and the growth of host RSS
    (and of CUDA reserved memory when CUDA is in use) across calls that compiled are added to the
    feature's Summary config. Backward graphs compile lazily at the first backward: that first backward
    is timed and added too.
"""

from __future__ import annotations

import time
import types
import weakref
from collections.abc import Callable
from typing import Any

from loongkit_core.context import ActivationContext
from loongkit_core.resident import resident_bytes

MARK = "__loongkit_compile__"  # attribute on our guarded callables: the feature that installed them
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch._subclasses", "torch.fx")
BACKEND = "inductor"  # the backend every feature compiles with (tests swap in a cheaper or failing one)


def host_rss() -> int:
    """Resident set size of this process in bytes (0 where /proc is not there)."""
    return resident_bytes() or 0


def device_reserved(torch: Any) -> int:
    """CUDA memory reserved by the caching allocator (0 when CUDA has not been initialised)."""
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return int(cuda.memory_reserved())
    except Exception:  # a broken device query must not break a training step
        pass
    return 0


def is_compiler_error(exc: BaseException) -> bool:
    """The exception comes from torch's compiler stack (dynamo, AOTAutograd, inductor, fx)."""
    for cls in type(exc).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module.startswith(COMPILER_MODULES):
            return True
    return False


class CompileTracker:
    """Counts and times dynamo compiles through ``torch._dynamo.callback.callback_handler``.

    One per process. ``torch._dynamo.reset()`` clears the handler's callbacks, so every guarded call
    checks (a list membership test) that ours are still registered.
    """

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.rss_at_start: int | None = None  # host RSS at the first compile start since the caller reset it
        self.cuda_at_start: int | None = None
        self._depth = 0
        self._t0 = 0.0
        self._handler: Any = None
        self._torch: Any = None

    def _start(self, *args: Any) -> None:
        if self._depth == 0:
            self._t0 = time.perf_counter()
            if self.rss_at_start is None:
                self.rss_at_start = host_rss()
                self.cuda_at_start = device_reserved(self._torch)
        self._depth += 1
        self.count += 1

    def _end(self, *args: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0

    def ensure(self, torch: Any) -> bool:
        """Make sure our callbacks are registered; False where torch has no callback API."""
        handler = self._handler
        if handler is None:
            try:
                from torch._dynamo.callback import callback_handler as handler
            except Exception:
                return False
            if not hasattr(handler, "register_start_callback"):
                return False
            self._handler, self._torch = handler, torch
        starts = getattr(handler, "start_callbacks", None)
        if starts is None or self._start not in starts:
            handler.register_start_callback(self._start)
            handler.register_end_callback(self._end)
        return True


TRACKER = CompileTracker()


class _Unit:
    __slots__ = ("backward_timed", "compiled_once", "failed", "group", "name")

    def __init__(self, name: str, group: str) -> None:
        self.name = name
        self.group = group
        self.failed: str | None = None
        self.compiled_once = False
        self.backward_timed = False


def _entry(module: Any, *args: Any, **kwargs: Any) -> Any:
    return module._call_impl(*args, **kwargs)


class Compiler:
    """One feature's compiles: install, guard, fall back, account. Its ``config`` is the Summary config."""

    def __init__(self, ctx: ActivationContext, *, backend: Any = None, mode: str | None = None,
                 dynamic: bool | None = None, extra: dict[str, Any] | None = None) -> None:
        import torch

        self.torch = torch
        self.ctx = ctx
        backend = BACKEND if backend is None else backend
        self.kwargs: dict[str, Any] = {"backend": backend, "mode": mode, "dynamic": dynamic}
        self.config: dict[str, Any] = {
            "backend": backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend)),
            "compiled": {},  # group -> number of modules/callables compiled
            "eager": {},  # name -> why it was kept eager on purpose
            "fallback": {},  # name -> the compile error that switched it back to eager
            "compiles": 0,
            "compile_seconds": 0.0,
            "extra_memory_mb": 0.0,
            **(extra or {}),
        }
        ctx.set_config(self.config)
        self._groups: dict[tuple[str, types.CodeType], Callable[..., Any]] = {}
        self._modules: weakref.WeakSet[Any] = weakref.WeakSet()
        self._feature = ctx.feature.name
        # Modules are compiled in place (their _compiled_call_impl slot) and held weakly, not through
        # the patcher (which would keep every model alive): the feature's undo runs uncompile.
        ctx.patcher.defer(self.uncompile)

    # -- installing ------------------------------------------------------------------------------
    def _group_entry(self, group: str, entry: Callable[..., Any] = _entry) -> Callable[..., Any]:
        key = (group, entry.__code__)
        compiled = self._groups.get(key)
        if compiled is None:
            code = entry.__code__
            tag = "".join(c if c.isalnum() else "_" for c in group)
            names = {"co_name": f"loongkit_{tag}"}  # its own code object: its own dynamo cache
            if hasattr(code, "co_qualname"):  # Python 3.11+; 3.10's code objects have no qualname
                names["co_qualname"] = names["co_name"]
            fresh = code.replace(**names)
            fn = types.FunctionType(fresh, entry.__globals__, fresh.co_name, None, entry.__closure__)
            compiled = self._groups[key] = self.torch.compile(fn, **self.kwargs)
        return compiled

    def compile_module(self, module: Any, name: str, group: str | None = None) -> bool:
        """Compile ``module``'s call in place; False (and the reason in the Summary) when it stays eager."""
        existing = getattr(module, "_compiled_call_impl", None)
        if existing is not None:
            why = "compiled by this feature" if getattr(existing, MARK, None) else "already compiled"
            self.keep_eager(name, why)
            return False
        group = group or type(module).__name__
        compiled = self._group_entry(group)

        def compiled_call(*args: Any, **kwargs: Any) -> Any:
            return compiled(module, *args, **kwargs)

        module._compiled_call_impl = self.guard(compiled_call, module._call_impl, name, group)
        self._modules.add(module)
        return True

    def compile_method(self, function: Callable[..., Any], name: str, group: str) -> Callable[..., Any]:
        """A compiled, guarded ``function(obj, *args, **kwargs)``: for a method the training loop calls
        directly (``model.forward(...)``, which bypasses ``nn.Module.__call__`` and so the compiled slot).

        The instance is an argument, as in :func:`_entry`, so instances share the group's graphs; the
        caller decides which instances take this path (see ``_patch.compiled_method``).
        """

        def method_entry(obj: Any, *args: Any, **kwargs: Any) -> Any:
            return function(obj, *args, **kwargs)

        return self.guard(self._group_entry(group, method_entry), function, name, group)

    def guard(self, compiled: Callable[..., Any], eager: Callable[..., Any], name: str,
              group: str | None = None) -> Callable[..., Any]:
        """``compiled`` with fallback to ``eager``, accounting and the Summary's '*'."""
        torch = self.torch
        unit = _Unit(name, group or name)
        counts = self.config["compiled"]
        counts[unit.group] = counts.get(unit.group, 0) + 1
        run = self.ctx.counted(self._run)
        is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)

        def call(*args: Any, **kwargs: Any) -> Any:
            if unit.failed is not None or is_compiling():
                # Inside a user's own torch.compile, dynamo inlines the eager module.
                return eager(*args, **kwargs)
            return run(unit, compiled, eager, args, kwargs)

        setattr(call, MARK, self._feature)
        return call

    def keep_eager(self, name: str, reason: str) -> None:
        self.config["eager"][name] = reason
        self.ctx.log.info("kept eager", module=name, reason=reason)

    # -- running ---------------------------------------------------------------------------------
    def _run(self, unit: _Unit, compiled: Callable[..., Any], eager: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        torch = self.torch
        tracker = TRACKER
        timed = tracker.ensure(torch)
        before_count, before_seconds = tracker.count, tracker.seconds
        tracker.rss_at_start = tracker.cuda_at_start = None
        t0 = time.perf_counter()
        first = not unit.compiled_once
        if first and not timed:
            rss0, cuda0 = host_rss(), device_reserved(torch)
        try:
            out = compiled(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
                raise
            if tracker.count == before_count and not is_compiler_error(exc):
                raise  # not a compile failure: the eager module would raise it too
            self._fallback(unit, exc)
            return eager(*args, **kwargs)
        compiled_now = tracker.count != before_count if timed else first
        if compiled_now:
            if timed:
                seconds = tracker.seconds - before_seconds
                rss = host_rss() - (tracker.rss_at_start or 0)
                cuda = device_reserved(torch) - (tracker.cuda_at_start or 0)
            else:
                seconds = time.perf_counter() - t0
                rss = host_rss() - rss0
                cuda = device_reserved(torch) - cuda0
            self._account(unit, tracker.count - before_count if timed else 1, seconds, max(0, rss) + max(0, cuda))
        unit.compiled_once = True
        if not unit.backward_timed and torch.is_grad_enabled():
            self._time_first_backward(unit, out)
        return out

    def _time_first_backward(self, unit: _Unit, out: Any) -> None:
        """AOTAutograd compiles the backward graph at the first backward: time that one backward."""
        torch = self.torch
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not tensors:
            return
        unit.backward_timed = True
        state: dict[str, float] = {}

        def pre(grads: Any) -> None:
            state["t0"] = time.perf_counter()
            state["rss0"] = host_rss()

        def post(grads_in: Any, grads_out: Any) -> None:
            if "t0" in state:
                self._account(unit, 0, time.perf_counter() - state["t0"], max(0, host_rss() - int(state["rss0"])),
                              backward=True)
            for h in handles:
                h.remove()

        try:
            node = tensors[0].grad_fn
            handles = [node.register_prehook(pre), node.register_hook(post)]
        except (AttributeError, RuntimeError):  # an old torch without node hooks: the backward is not timed
            return

    def _account(self, unit: _Unit, compiles: int, seconds: float, extra_bytes: int, backward: bool = False) -> None:
        cfg = self.config
        cfg["compiles"] += compiles
        cfg["compile_seconds"] = round(cfg["compile_seconds"] + seconds, 3)
        cfg["extra_memory_mb"] = round(cfg["extra_memory_mb"] + extra_bytes / 2**20, 1)
        self.ctx.log.info("compiled backward" if backward else "compiled", module=unit.name, group=unit.group,
                          seconds=round(seconds, 3), extra_memory_mb=round(extra_bytes / 2**20, 1),
                          total_seconds=cfg["compile_seconds"])

    def _fallback(self, unit: _Unit, exc: BaseException) -> None:
        lines = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        inner = getattr(exc, "inner_exception", None) or exc.__cause__  # BackendCompilerFailed wraps the real one
        if inner is not None:
            text += f" {type(inner).__name__}: {inner}"
        text = text[:200]
        unit.failed = text
        self.config["fallback"][unit.name] = text
        self.ctx.log.error("compile failed; running this module eagerly from now on", module=unit.name,
                           error=text)

    # -- undo ------------------------------------------------------------------------------------
    def uncompile(self) -> None:
        """Give every module this compiler compiled its eager call back (at the feature's undo)."""
        for module in list(self._modules):
            impl = module.__dict__.get("_compiled_call_impl")
            if impl is not None and getattr(impl, MARK, None) == self._feature:
                module._compiled_call_impl = None
        self._modules = weakref.WeakSet()
