"""Version-gated workarounds for torch.compile bugs: LOONGKIT_DONATED_BUFFER_FIX, LOONGKIT_DYNAMIC_SHAPE_FIX.

Each one switches off the mechanism that fails, only where it fails, and looks every flag up by
attribute: a torch that moved or renamed a flag gets "not applicable" with the reason, never a guess.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.kit import FeatureImpl

# The upstream fix of the DDPOptimizer / donated-buffer bug keeps one fw_metadata per bucket in a
# DDPOptimizerContext on the TracingContext (pytorch/pytorch#160745, first released in 2.9.0).
DDP_FIX_MARKERS = ("DDPOptimizerContext", "ddp_optimizer_ctx")
DDP_MODULE = "torch._dynamo.backends.distributed"


def torch_source(relpath: str) -> str | None:
    """Text of a file of the installed torch package, found without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for base in locations:
        try:
            with open(os.path.join(base, relpath), encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            continue
    return None


def has_ddp_fix(source: str | None) -> bool:
    return source is not None and any(marker in source for marker in DDP_FIX_MARKERS)


class DonatedBufferFix(FeatureImpl):
    """torch 2.6-2.8: DDPOptimizer + donated buffers silently overwrite weights.

    The bug (pytorch/pytorch#160745): DDPOptimizer splits one dynamo graph into N AOT graphs but
    AOTAutograd stashes each graph's ``fw_metadata`` on the one TracingContext, so graph i clobbers
    graph i-1's. Backward graphs compile lazily, last first, and all reuse the last graph's
    ``bw_donated_idxs``: inductor then writes into buffers that are still live (weights among them).
    Upstream's workaround is ``torch._functorch.config.donated_buffer = False``.

    DDPOptimizer runs when dynamo compiles a frame with ``optimize_ddp`` in "ddp_optimizer" mode (the
    default, True) inside the forward of a DistributedDataParallel module
    (``DistributedDataParallel._get_active_ddp_module()``, see ``torch/_dynamo/convert_frame.py`` /
    ``eval_frame.py``); it then imports ``torch._dynamo.backends.distributed`` and builds a
    ``DDPOptimizer`` whose ``compile_fn`` splits and compiles the graph. Wrapping ``compile_fn`` is that
    exact condition: the flag goes off before the first split graph's forward is compiled (where
    ``bw_donated_idxs`` is computed) and stays off, since the backward graphs compile later, lazily.
    Compiles without DDP keep donated buffers.
    """

    def detect(self, env: Environment) -> str | None:
        if has_ddp_fix(torch_source(os.path.join("_dynamo", "backends", "distributed.py"))):
            return f"torch {env.version('torch')} has the upstream fix (DDPOptimizerContext, pytorch#160745)"
        return None

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        module = sys.modules.get(DDP_MODULE) or importlib.import_module(DDP_MODULE)
        if any(hasattr(module, marker) for marker in DDP_FIX_MARKERS):
            raise NotApplicable("torch has the upstream fix (DDPOptimizerContext, pytorch#160745)")
        ddp_optimizer = getattr(module, "DDPOptimizer", None)
        if ddp_optimizer is None or not callable(getattr(ddp_optimizer, "compile_fn", None)):
            raise NotApplicable(f"{DDP_MODULE} has no DDPOptimizer.compile_fn")
        fconfig = importlib.import_module("torch._functorch.config")
        if not hasattr(fconfig, "donated_buffer"):
            raise NotApplicable("torch._functorch.config has no donated_buffer flag")

        original = ddp_optimizer.compile_fn
        state: dict[str, Any] = {"donated_buffer_before": None, "switched_off": False}
        ctx.set_config(state)
        count = ctx.count

        def compile_fn(self: Any, *args: Any, **kwargs: Any) -> Any:
            if fconfig.donated_buffer:
                # Through the patcher: the default deactivate puts the flag back as it was.
                state["donated_buffer_before"] = ctx.patcher.assign(fconfig, "donated_buffer", False)
                state["switched_off"] = True
                ctx.log.warning("DDPOptimizer is compiling a DDP model: torch._functorch.config.donated_buffer "
                                "switched off (pytorch#160745)")
            count()
            return original(self, *args, **kwargs)

        compile_fn.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(ddp_optimizer, "compile_fn", compile_fn)
        ctx.log.info("donated_buffer fix armed on DDPOptimizer.compile_fn",
                     donated_buffer=bool(fconfig.donated_buffer))


class DynamicShapeFix(FeatureImpl):
    """torch 2.9.x: two mechanisms that crash compiles with dynamic shapes, switched off.

    * ``torch._dynamo.config.enable_cpp_symbolic_shape_guards``: turned on by default in 2.9.0
      (pytorch/pytorch#140756, "Dynamic shape guards in C++"): symbolic shape guards are then
      compiled to C++ with the host compiler at every dynamic-shape compile (a gcc run per guard set).
      The crash it causes (reproduced on the CPU, tests/compat/dynamic_shape_job.py): the C++ shape
      guard runs only once every value it reads has been fed; a module float (an attention scale: a
      symbol, floats not specialized with dynamic shapes) is read from the module's guard subtree,
      which dynamo skips while the module's dicts are unchanged, so the whole shape guard, stride
      relations included, never runs, and a graph compiled for a contiguous input runs on a slice
      (inductor's ``assert_size_stride``: "expected size 2==2, stride 192==160"). The Python shape
      guard rejects the slice and dynamo recompiles. Upstream reverted the default to False
      (pytorch/pytorch#166427). Changed only where it is still True.
    * ``torch._inductor.config.triton.coalesce_tiling_analysis``: the coalesce tiling analysis
      (pytorch/pytorch#158872) "does not yet apply to dynamic shapes" (its own config comment) yet runs
      for them, and ``tiling_utils.get_pw_red_splits`` raises AssertionError on symbolic sizes
      (roboflow/rf-detr#1455 "disable Inductor coalesce tiling"; pytorch/pytorch#197077). With it off
      inductor picks tilings the 2.8 way; results are unchanged. An explicit
      ``TORCHINDUCTOR_COALESCE_TILING_ANALYSIS`` is the user's choice and is kept.
    """

    FLAGS: dict[str, tuple[str, str]] = {
        # target module -> (attribute path inside it, label in the Summary)
        "torch._dynamo.config": ("enable_cpp_symbolic_shape_guards", "cpp_symbolic_shape_guards"),
        "torch._inductor.config": ("triton.coalesce_tiling_analysis", "coalesce_tiling_analysis"),
    }

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        if target not in self.FLAGS:
            raise NotApplicable(f"unexpected target {target!r}")
        module = sys.modules.get(target) or importlib.import_module(target)
        path, label = self.FLAGS[target]
        owner: Any = module
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name, None)
            if owner is None:
                break
        if owner is None or not hasattr(owner, attr):
            # All or nothing: the runtime's undo of this activation restores what an earlier target switched.
            raise NotApplicable(f"{target} has no {path}: not the torch 2.9 layout this fix targets")
        config = ctx.config if isinstance(ctx.config, dict) else {}  # both targets report into one dict
        ctx.set_config(config)
        value = getattr(owner, attr)
        if label == "coalesce_tiling_analysis" and os.environ.get("TORCHINDUCTOR_COALESCE_TILING_ANALYSIS"):
            config[label] = "kept (TORCHINDUCTOR_COALESCE_TILING_ANALYSIS set by user)"
        elif value:
            ctx.patcher.assign(owner, attr, False)
            config[label] = "off"
            self._count_compiles(ctx)
        else:
            config[label] = "already off"
        ctx.log.info("dynamic shape fix", flag=f"{target}.{path}", was=value, now=getattr(owner, attr))

    def _count_compiles(self, ctx: ActivationContext) -> None:
        """The '*' means a compile ran with the fix in place: dynamo's compile-start hook counts.

        The hook is the handler's own ``run_start_callbacks``, which dynamo calls at the start of
        every outermost compile (``callback_handler.install_callbacks`` in convert_frame), wrapped on
        the handler instance. A callback registered with ``register_start_callback`` would not do:
        ``torch._dynamo.reset()`` clears the registered callbacks (``callback_handler.clear()``),
        and scripts reset between compiles (torch 2.9's dynamic-shape probe did before each case),
        so such a counter stopped before the first compile and the row read ``calls=0``.
        """
        scratch = ctx.scratch  # once per activation; dead at undo: a registration still pending then must not happen
        if getattr(scratch, "counting", False):
            return
        scratch.counting = True
        count = ctx.count

        def register(module: Any) -> None:
            if not scratch.live:
                return
            handler = getattr(module, "callback_handler", None)
            run_start = getattr(handler, "run_start_callbacks", None)
            if run_start is None:
                count()  # no compile-start hook to count with: the switched flag is all there is
                return

            def run_start_callbacks(*args: Any, **kwargs: Any) -> Any:
                count()
                return run_start(*args, **kwargs)

            ctx.patcher.patch(handler, "run_start_callbacks", run_start_callbacks)  # undo: the class's again

        # Registered once torch._dynamo.callback has finished importing: the config module is
        # imported from inside torch._dynamo's own import, where pulling in more of it is unsafe.
        ctx.on_import("torch._dynamo.callback", register)
