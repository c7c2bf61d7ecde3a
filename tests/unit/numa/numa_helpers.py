"""Helpers for the loongkit-numa tests: activation contexts without the runtime, and forked children.

Binding changes the CPUs of the process that calls it, so every test that applies a binding does it
in a forked child and ships the facts back through a pipe.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from loongkit_core.context import ActivationContext, Environment
from loongkit_core.feature import Feature, FeatureRecord
from loongkit_core.hardware import detect
from loongkit_core.process import MAIN, ProcessInfo
from loongkit_core.settings import CoreSettings, load_settings


class RecordingLogger:
    """Stands in for the core's logger: keeps (level, message) pairs."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def _log(self, level: str, msg: str, *args: Any, **kw: Any) -> None:
        self.lines.append((level, msg % args if args else msg))

    def debug(self, msg: str, *a: Any, **kw: Any) -> None:
        self._log("debug", msg, *a)

    def info(self, msg: str, *a: Any, **kw: Any) -> None:
        self._log("info", msg, *a)

    def warning(self, msg: str, *a: Any, **kw: Any) -> None:
        self._log("warning", msg, *a)

    def error(self, msg: str, *a: Any, **kw: Any) -> None:
        self._log("error", msg, *a)

    def text(self) -> str:
        return "\n".join(f"{lvl}: {m}" for lvl, m in self.lines)


def numa_feature() -> Feature:
    from loongkit_numa.plugin import plugin

    return next(f for f in plugin.loongkit_declare_features() if f.name == "numa_affinity")


def make_env(root: str, environ: Mapping[str, str] | None = None, *, role: str = MAIN,
             local_rank: int | None = None, local_world_size: int | None = None) -> Environment:
    env_vars = {"LOONGKIT_SYSFS_ROOT": root, **(environ or {})}
    settings, _ = load_settings(CoreSettings, environ=env_vars)
    process = ProcessInfo(role=role, pid=os.getpid(), host=socket.gethostname(), rank=local_rank,
                          local_rank=local_rank, world_size=local_world_size, local_world_size=local_world_size)
    return Environment(settings, process, environ=env_vars, hardware_loader=lambda: detect(root))


def make_ctx(env: Environment, config: object = None) -> tuple[ActivationContext, RecordingLogger]:
    logger = RecordingLogger()
    record = FeatureRecord(feature=numa_feature(), config=config)
    ctx = ActivationContext(record, env, logger, on_import=lambda module, cb: None)
    return ctx, logger


def torch_without_gpu_pci() -> tuple[int, int] | None:
    """This torch's (major, minor) when it cannot report a GPU's PCI address, else None.

    The numa_affinity feature's own check (``affinity._torch_version() < affinity.MIN_TORCH_PCI``):
    there, without LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1, a node with GPUs gets no plan.
    """
    from loongkit_numa import affinity

    version = affinity._torch_version()
    return version if version is not None and version < affinity.MIN_TORCH_PCI else None


def needs_pci_torch() -> None:
    """Skip a test that needs the plan to find its GPUs without LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX, on a
    torch that cannot report a GPU's PCI address (test_old_torch_* check the reason given there)."""
    from loongkit_numa import affinity

    version = torch_without_gpu_pci()
    if version is not None:
        needed = ".".join(map(str, affinity.MIN_TORCH_PCI))
        pytest.skip(f"torch {version[0]}.{version[1]} < {needed}: no GPU PCI address, NUMA affinity not applicable "
                    "without LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1")


def gpus_by_index() -> dict[str, str]:
    """The environment that lets a plan find its GPUs on this torch, for tests about what the plan does
    with them (rules, rendering, cgroups), not about where the GPU identity comes from.

    On torch < 2.5: LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1, the documented fallback (local rank N uses the
    N-th GPU in PCI order). On newer torch: nothing, so those tests run exactly as written; the GPUs are
    in index order there too (a fake sysfs root, or no CUDA device visible to torch).
    """
    return {"LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX": "1"} if torch_without_gpu_pci() else {}


def require_cpus_0_1() -> None:
    if not {0, 1} <= set(os.sched_getaffinity(0)):
        pytest.skip("needs CPUs 0 and 1 in this process's mask")


def run_forked(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Run ``fn`` in a forked child; return its JSON-able result, or re-raise its failure here."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        os.close(read_fd)
        try:
            payload = {"ok": fn()}
        except BaseException as exc:  # report everything, including assertion errors
            payload = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            with os.fdopen(write_fd, "w") as f:
                json.dump(payload, f, default=sorted)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child died: status {status}"
    result = json.loads(data)
    if "error" in result:
        pytest.fail(f"in forked child: {result['error']}")
    return result["ok"]
