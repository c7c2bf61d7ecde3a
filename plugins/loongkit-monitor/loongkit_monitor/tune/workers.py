"""LOONGKIT_DATALOADER_WORKERS: every DataLoader of the job uses LOONGKIT_DATALOADER_WORKERS_COUNT workers.

The knob ``loongkit tune`` turns for the worker count, with no change to the user's code (a
script's ``--workers`` flag, an mmengine config's ``num_workers``): ``DataLoader.__init__`` gets the
count in place of the job's own. Explicit only: ``LOONGKIT_ALL`` enables it, but without a count it
is not applicable (nothing to set). With 0 workers the options that only exist for worker processes
(``persistent_workers``, ``prefetch_factor``, ``multiprocessing_context``) are dropped, since
DataLoader rejects them then; a ``worker_init_fn`` then never runs (the Summary says so).
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_core.process import HELPER, LAUNCHER, WORKER
from loongkit_core.settings import LoongkitSettings

COUNT_ENV = "LOONGKIT_DATALOADER_WORKERS_COUNT"
WORKER_ONLY = {"persistent_workers": False, "prefetch_factor": None, "multiprocessing_context": None}


class WorkersOptions(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_DATALOADER_WORKERS_", extra="ignore",
                                      case_sensitive=False)

    count: int | None = Field(None, ge=0, le=1024, description="num_workers for every DataLoader of the job.")


def override(bound: inspect.BoundArguments, count: int) -> tuple[int, list[str]]:
    """Set ``num_workers`` in ``bound`` to ``count``; (the job's own count, what else changed)."""
    old = bound.arguments.get("num_workers", 0)
    bound.arguments["num_workers"] = count
    notes: list[str] = []
    if count == 0:
        for name, neutral in WORKER_ONLY.items():
            if bound.arguments.get(name, neutral) not in (neutral, False, None):
                bound.arguments[name] = neutral
                notes.append(f"{name} dropped")
        if bound.arguments.get("worker_init_fn") is not None:
            notes.append("worker_init_fn not run (no workers)")
    return old if isinstance(old, int) else -1, notes


class DataLoaderWorkers(FeatureImpl):
    options = WorkersOptions

    def detect(self, env: Environment) -> str | None:
        if env.process.role in (LAUNCHER, HELPER, WORKER):
            return f"no DataLoader to set in a {env.process.role} process"
        if not (env.environ.get(COUNT_ENV) or "").strip():
            return f"{COUNT_ENV} is not set (the worker count to use)"
        return None

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        options = ctx.config if isinstance(ctx.config, WorkersOptions) else None
        count = options.count if options is not None else None
        if count is None:
            raise NotApplicable(f"{COUNT_ENV} is invalid (see the warning): nothing to set")
        import torch.utils.data as data

        loader_cls = data.DataLoader
        original = loader_cls.__init__
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError) as exc:
            raise NotApplicable(f"DataLoader.__init__ has no readable signature: {exc}") from exc
        if "num_workers" not in signature.parameters:
            raise NotApplicable("DataLoader.__init__ has no num_workers parameter")
        seen: set[str] = set()
        ctx.set_config({"count": count})

        def __init__(loader: Any, *args: Any, **kwargs: Any) -> None:
            try:
                bound = signature.bind(loader, *args, **kwargs)
                old, notes = override(bound, count)
                args, kwargs = tuple(bound.args[1:]), dict(bound.kwargs)
                ctx.count()
                change = f"num_workers {old} -> {count}" + (f" ({', '.join(notes)})" if notes else "")
                if change not in seen:
                    seen.add(change)
                    ctx.detail("changes", sorted(seen))
                    ctx.log.info(f"dataloader_workers: {change}")
            except Exception as exc:  # never stop the user's DataLoader: the job's own count stays
                ctx.log.info(f"dataloader_workers: left as is: {type(exc).__name__}: {exc}")
            original(loader, *args, **kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        __init__.__qualname__ = original.__qualname__
        __init__.__doc__ = original.__doc__
        ctx.patcher.patch(loader_cls, "__init__", __init__)
