"""Entry point of loongkit-data (data pipeline): declares its features; imports no torch or mmcv."""

from __future__ import annotations

from typing import Any

from loongkit_core.feature import Category
from loongkit_core.kit import PluginSpec

plugin = PluginSpec("data", distribution="loongkit-data", category=Category.DATA)

_MMCV1 = "mmcv>=1.7.0,<=1.8.0"

plugin.feature(
    "data_container",
    level=1,
    description="pin_memory support for mmcv DataContainer; turns on DataLoader pin_memory.",
    requires=(_MMCV1,),
    targets=("mmcv.parallel",),
    impl="loongkit_data.datacontainer:DataContainerPin",
)
plugin.feature(
    "data_prefetch",
    level=1,
    description="Prefetch the next batch to the GPU on a side stream (mmcv 1.x runners).",
    requires=(_MMCV1,),
    targets=("mmcv.runner",),
    depends_on=("data_container",),
    impl="loongkit_data.prefetch_mmcv:DataPrefetch",
)
plugin.feature(
    "mmengine_data_prefetch",
    level=1,
    description="Prefetch the next batch to the GPU in mmengine's loops (mmcv 2.x).",
    requires=("mmcv>=2.0.0", "mmengine>=0.8.0"),
    targets=("mmengine.runner",),
    impl="loongkit_data.prefetch_mmengine:MmengineDataPrefetch",
)

# LOONGKIT_IMNORMALIZE and LOONGKIT_DISTORTION (issue 6): bit-exact compiled CPU kernels.
plugin.feature(
    "imnormalize",
    level=3,
    description="Bit-exact compiled CPU kernel for mmcv imnormalize.",
    targets=("mmcv.image.photometric",),
    impl="loongkit_data.imnormalize:ImNormalize",
)
plugin.feature(
    "distortion",
    level=3,
    description="Bit-exact compiled CPU kernel for mmdet PhotoMetricDistortion.",
    targets=("mmdet.datasets.pipelines.transforms", "mmdet.datasets.transforms.transforms"),
    impl="loongkit_data.distortion:Distortion",
)


# LOONGKIT_PYTORCH and LOONGKIT_MALLOC (issues 5 and 12): DataLoader memory and allocator tuning.
plugin.feature(
    "pytorch",
    level=1,
    description="DataLoader memory: serialized dataset lists, worker allocator tuning, open-files limit.",
    targets=("torch.utils.data",),
    impl="loongkit_data.pytorch_memory:PytorchMemory",
)
plugin.feature(
    "malloc",
    level=2,
    description="Allocator tuning (or jemalloc/tcmalloc preload) in the training process.",
    options=("LOONGKIT_MALLOC_ALLOCATOR",),
    impl="loongkit_data.malloc:Malloc",
)


@plugin.summary
def _memory_summary(records: Any) -> list[str]:
    """Exit lines of pytorch/malloc: what was serialized, and the page faults that were measured."""
    lines: list[str] = []
    for record in records:
        if record.feature.name in ("pytorch", "malloc") and record.enabled and record.feature.plugin == "data" \
                and record.state.value in ("applied", "active"):
            lines.extend(plugin.impl(record.feature).summary_lines())  # type: ignore[attr-defined]
    return lines


@plugin.cli
def _malloc_cli(subparsers: Any) -> None:
    """``loongkit malloc-env [jemalloc|tcmalloc]``: the variables that preload an allocator library."""
    parser = subparsers.add_parser("malloc-env", help="print LD_PRELOAD (and MALLOC_CONF) for jemalloc/tcmalloc, "
                                   "for `env $(loongkit malloc-env jemalloc) loongkit-run ...`")
    parser.add_argument("allocator", nargs="?", default="jemalloc", choices=("jemalloc", "tcmalloc"))

    def run(args: Any) -> int:
        import os
        import sys

        from loongkit_data import allocator

        path = allocator.find_library(args.allocator)
        if path is None:
            sys.stderr.write(f"{args.allocator} is not installed\n")
            return 1
        changes = allocator.preload_environ(path, args.allocator, os.environ)
        print(" ".join(f"{k}={v}" for k, v in changes.items()))
        return 0

    parser.set_defaults(func=run)


@plugin.launch_env
def _malloc_preload(records: Any, environ: Any) -> dict[str, str]:
    """Under ``loongkit-run``, LOONGKIT_MALLOC with jemalloc/tcmalloc preloads the library for the whole job."""
    record = next((r for r in records if r.feature.name == "malloc" and r.feature.plugin == "data"), None)
    if record is None or not record.enabled or record.state.value != "armed":
        return {}
    from loongkit_data import allocator
    from loongkit_data.malloc import MallocOptions

    options = record.config if isinstance(record.config, MallocOptions) else None
    kind = options.allocator if options is not None else "glibc"
    if kind == "glibc" or allocator.preloaded_allocator(environ) == kind:
        return {}
    path = allocator.find_library(kind)
    return allocator.preload_environ(path, kind, environ) if path else {}
