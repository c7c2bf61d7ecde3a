"""Ranks report to local rank 0 (files) and to global rank 0 (the job's torch.distributed store).

Never a collective on the job's process group: a rank's report is a small JSON document

* written as ``mon-rank-<rank>.json`` in the node's activity channel (the directory torchrun's local
  ranks share, :func:`loongkit_core.activity.job_directory`), which local rank 0 reads; and
* set under ``loongkit-monitor/<torchrun restart>/rank/<rank>`` in the store ``init_process_group`` made (torchrun's
  agent store, a TCPStore), which global rank 0 reads, so ranks on other nodes are seen too.

The store is captured while the process group is up (the job may destroy it before exit; the
client object stays usable while its server, torchrun's agent, lives). At exit each rank publishes,
then rank 0 (local or global) polls for the others' reports with ``store.check`` (non-blocking) for
at most ``wait`` seconds, less when the wait cannot end well: a local rank whose process ended
without a report (the node channel's liveness, :func:`loongkit_core.activity.peer_state`) is not
waited for, and a node's local rank 0 says so in the store (``.../gone/<rank>``) for global rank 0;
once the job is being stopped (torchrun's SIGTERM), live ranks get :data:`activity.STOP_WAIT`. The
ranks that sent nothing are named with the reason (:attr:`Gatherer.silent`). Any failure loses only
the other ranks' figures.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

STORE_PREFIX = "loongkit-monitor/"
FILE_PREFIX = "mon-rank-"
WAIT = 5.0  # seconds rank 0 waits at exit for the other ranks' reports
POLL = 0.05


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"{FILE_PREFIX}{rank}.json")


def default_store() -> Any:
    """The store of torch.distributed's default process group, or None (not initialised, no torch)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


class Gatherer:
    """One rank's side of the exchange."""

    def __init__(self, directory: str | None, rank: int, local_rank: int, world_size: int,
                 local_world_size: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.directory = directory
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = max(1, world_size)
        self.local_world_size = max(1, local_world_size)
        self.store: Any = None
        self.clock = clock
        self.sleep = sleep
        self.notes: list[str] = []
        # A torchrun restart starts a new round on the same agent store: keys of earlier rounds are stale.
        self.round_prefix = f"{STORE_PREFIX}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.key_prefix = f"{self.round_prefix}rank/"
        self.silent: dict[int, str] = {}  # after collect(): ranks that sent no report, and why
        self._announced: set[int] = set()

    @property
    def collects_node(self) -> bool:
        return self.local_rank == 0 and self.local_world_size > 1

    @property
    def collects_job(self) -> bool:
        return self.rank == 0 and self.world_size > 1

    def capture_store(self, store: Any = None) -> None:
        """Keep the job's store (call while the process group is initialised)."""
        if self.store is None:
            self.store = store if store is not None else default_store()

    def publish(self, report: dict[str, Any]) -> None:
        payload = json.dumps(report)
        if self.directory is not None and self.local_world_size > 1:
            from loongkit_core import activity

            try:
                activity.write_report(rank_file(self.directory, self.rank), report)
            except OSError as exc:
                self.notes.append(f"cannot write the rank report: {exc}")
        if self.store is not None and self.world_size > 1:
            try:
                self.store.set(f"{self.key_prefix}{self.rank}", payload)
            except Exception as exc:
                self.notes.append(f"torch.distributed store unusable: {exc}")
                self.store = None

    def _from_files(self, found: dict[int, dict[str, Any]]) -> None:
        if self.directory is None:
            return
        from loongkit_core import activity

        try:
            names = [n for n in os.listdir(self.directory) if n.startswith(FILE_PREFIX) and n.endswith(".json")]
        except OSError:
            return
        for name in names:
            try:
                rank = int(name[len(FILE_PREFIX):-len(".json")])
            except ValueError:
                continue
            if rank in found:
                continue
            data = activity.read_report(os.path.join(self.directory, name))
            if data is not None:
                found[rank] = data

    def _from_store(self, found: dict[int, dict[str, Any]]) -> None:
        if self.store is None:
            return
        try:
            for rank in range(self.world_size):
                key = f"{self.key_prefix}{rank}"
                if rank in found or not self.store.check([key]):
                    continue
                data = json.loads(self.store.get(key))
                if isinstance(data, dict):
                    found[rank] = data
        except Exception as exc:
            self.notes.append(f"torch.distributed store unusable: {exc}")
            self.store = None

    def expected(self) -> int:
        if self.collects_job and self.store is not None:
            return self.world_size
        return self.local_world_size

    def expected_ranks(self) -> range:
        if self.collects_job and self.store is not None:
            return range(self.world_size)
        base = self.rank - self.local_rank  # torchrun numbers a node's ranks consecutively
        return range(base, base + self.local_world_size)

    def _is_local(self, rank: int) -> bool:
        return 0 <= rank - (self.rank - self.local_rank) < self.local_world_size

    def _states(self, missing: list[int]) -> dict[int, str]:
        """Each missing rank's state: a local one from the node channel (ALIVE, GONE, ABSENT), a
        remote one GONE when its node's local rank 0 said so in the store, else ALIVE (unknown)."""
        from loongkit_core import activity

        states: dict[int, str] = {}
        for rank in missing:
            if self.directory is not None and self._is_local(rank) and self.local_world_size > 1:
                states[rank] = activity.peer_state(self.directory, rank=rank)
            elif self.store is not None and self._gone_in_store(rank):
                states[rank] = activity.GONE
            else:
                states[rank] = activity.UNKNOWN  # on another node: only its report or a marker tells
        return states

    def _gone_in_store(self, rank: int) -> bool:
        try:
            return bool(self.store.check([f"{self.round_prefix}gone/{rank}"]))
        except Exception:
            return False

    def _announce(self, states: dict[int, str]) -> None:
        """A node's local rank 0 tells global rank 0 (through the store) which of its ranks ended
        without a report, so that it does not wait for them either."""
        if self.store is None or self.world_size <= 1 or not self.collects_node:
            return
        from loongkit_core import activity

        for rank, state in states.items():
            if state == activity.GONE and rank not in self._announced and self._is_local(rank):
                self._announced.add(rank)
                try:
                    self.store.set(f"{self.round_prefix}gone/{rank}", state)
                except Exception:
                    return

    def _read(self, found: dict[int, dict[str, Any]]) -> None:
        if self.collects_node:
            self._from_files(found)
        if self.collects_job:
            self._from_store(found)

    def collect(self, own: dict[str, Any], wait: float = WAIT) -> dict[int, dict[str, Any]]:
        """Rank 0 (local or global): every rank's report it can get within ``wait`` seconds; none for
        a rank known to have ended without one, at most ``activity.STOP_WAIT`` for the others once
        the job is being stopped. The others are named in :attr:`silent` and a note."""
        from loongkit_core import activity

        found: dict[int, dict[str, Any]] = {self.rank: own}
        if not (self.collects_node or self.collects_job):
            return found
        deadline = self.clock() + wait
        stop_at: float | None = None
        states: dict[int, str] = {}
        while True:
            self._read(found)
            missing = [r for r in self.expected_ranks() if r not in found]
            if not missing:
                break
            states = self._states(missing)
            self._announce(states)
            now = self.clock()
            if stop_at is None and activity.stopping() is not None:
                stop_at = now + activity.STOP_WAIT
            ended = all(s == activity.GONE for s in states.values())
            if ended or now >= deadline or (stop_at is not None and now >= stop_at):
                self._read(found)  # a last look: a rank may have reported, then ended
                break
            self.sleep(POLL)
        for rank in self.expected_ranks():
            if rank not in found:
                self.silent[rank] = activity.silence_reason(states.get(rank, activity.UNKNOWN), wait)
        by_reason: dict[str, list[int]] = {}
        for rank, why in sorted(self.silent.items()):
            by_reason.setdefault(why, []).append(rank)
        for why, ranks in by_reason.items():
            several = len(ranks) > 1
            self.notes.append(f"rank{'s' if several else ''} {', '.join(map(str, ranks))} sent no monitor report: "
                              + (why.replace("its process", "their processes") if several else why))
        return found

