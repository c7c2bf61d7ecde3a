"""Which kind of Python process this is, decided once and cheaply from argv and the environment.

Never imports multiprocessing or torch: ``sys.orig_argv`` tells a spawn/forkserver child
(``--multiprocessing-fork``, ``multiprocessing.forkserver``), a torchrun agent
(``torch.distributed.run``) or an inductor compile worker apart from a main training process.
Forked children inherit the parent's state; :func:`mark_forked_child` is called after fork.
"""

from __future__ import annotations

import os
import sys

from loongkit_core.record import Record

MAIN = "main"  # a training process (one per rank under torchrun)
WORKER = "worker"  # a multiprocessing child: DataLoader workers (fork, spawn, forkserver) and the forkserver
LAUNCHER = "launcher"  # torchrun's elastic agent or loongkit-run itself: starts others, trains nothing
HELPER = "helper"  # resource tracker, compile workers: loongkit does not boot there
SUBPROCESS = "subprocess"  # a Python program started by a main process (evaluation script, tool)

# Set by a booted main process for its children: "<pid>:<rank>:<local_rank>". A child Python with the
# same ranks is that main's subprocess (its Summary goes to its log only, so stdout shows one Summary);
# torchrun ranks started below a main process have ranks of their own and stay mains.
MAIN_MARKER = "_LOONGKIT_MAIN"


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


class ProcessInfo(Record):
    __slots__ = ("role", "pid", "host", "rank", "local_rank", "world_size", "local_world_size")  # noqa: RUF023  # repr order

    def __init__(self, role: str, pid: int, host: str, rank: int | None, local_rank: int | None,
                 world_size: int | None, local_world_size: int | None) -> None:
        self.role = role
        self.pid = pid
        self.host = host
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.local_world_size = local_world_size

    @property
    def prints_summary(self) -> bool:
        """The Summary goes to stdout from local rank 0 of each node only (every rank logs it)."""
        return self.role == MAIN and (self.local_rank in (None, 0))

    @property
    def writes_summary(self) -> bool:
        return self.role in (MAIN, SUBPROCESS)

    def marker(self) -> str:
        return f"{self.pid}:{self.rank}:{self.local_rank}"

    def to_json(self) -> dict[str, object]:
        return {n: getattr(self, n) for n in self._fields}


def classify(argv: list[str]) -> str:
    """The role of a process started with ``argv`` (``sys.orig_argv``)."""
    joined = " ".join(argv)
    if "--multiprocessing-fork" in argv:
        return WORKER
    if "multiprocessing.forkserver" in joined:
        return WORKER  # the forkserver only forks workers; they inherit what it loaded
    if "multiprocessing.resource_tracker" in joined:
        return HELPER
    if "torch._inductor.compile_worker" in joined or "compile_worker" in joined.replace("/", "."):
        return HELPER
    if "torch.distributed.run" in joined or "torch.distributed.launch" in joined:
        return LAUNCHER
    if argv and len(argv) > 1 and os.path.basename(argv[1]) in ("torchrun", "loongkit-run"):
        return LAUNCHER
    if argv and os.path.basename(argv[0]) == "torchrun":
        return LAUNCHER
    return MAIN


def _hostname() -> str:
    try:
        return os.uname().nodename  # what socket.gethostname() returns, without importing socket
    except AttributeError:  # no uname (Windows)
        import socket

        return socket.gethostname()


def detect() -> ProcessInfo:
    argv = list(getattr(sys, "orig_argv", sys.argv))
    info = ProcessInfo(
        role=classify(argv),
        pid=os.getpid(),
        host=_hostname(),
        rank=_int_env("RANK"),
        local_rank=_int_env("LOCAL_RANK"),
        world_size=_int_env("WORLD_SIZE"),
        local_world_size=_int_env("LOCAL_WORLD_SIZE"),
    )
    parent = os.environ.get(MAIN_MARKER, "")
    pid, _, ranks = parent.partition(":")
    if info.role == MAIN and pid and pid != str(info.pid) and ranks == f"{info.rank}:{info.local_rank}":
        info.role = SUBPROCESS
    return info


def mark_forked_child(info: ProcessInfo) -> None:
    """After ``fork()``: the child is a worker (DataLoader workers fork from the trainer)."""
    info.role = WORKER
    info.pid = os.getpid()
