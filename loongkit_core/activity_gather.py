"""Activity across processes, the runtime's side (the channel itself is :mod:`loongkit_core.activity`):
a main process opens the channel its DataLoader workers report to, a worker starts its reporter, and
at the Summary the main folds its workers' counts into its records and, under torchrun, publishes its
own for local rank 0, which collects the node's view. Also the signs that a process is a training job
(whether its Summary goes to stdout).
"""

from __future__ import annotations

import os

from loongkit_core import activity, importhooks
from loongkit_core.feature import FeatureRecord

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

    from loongkit_core.process import ProcessInfo

# Set by ``loongkit-run`` to its own pid, which the command it execs keeps: "this is the command the user
# put loongkit in front of" (its children and a script's inner Pythons have other pids).
LAUNCHED_ENV = "_LOONGKIT_LAUNCHED"


class ActivityGather:
    """Runtime's cross-process activity (a mixin: the state lives on the
    :class:`~loongkit_core.runtime.Runtime`)."""

    process: ProcessInfo
    records: dict[str, FeatureRecord]
    channel: activity.MainChannel | None
    targets_seen: list[str]
    optimizer_stepped: bool
    node_silent: dict[int, str]
    log: Any
    _fork_baseline: dict[str, int]
    _reporter: activity.WorkerReporter | None

    def is_training_job(self) -> bool:
        """Whether this process prints its Summary on stdout: an optimizer stepped, the program called a
        patched function, features ran in its DataLoader workers (or, for local rank 0, in the node's
        ranks), or it is the very command
        ``loongkit-run`` started and it imported a feature's target. Other processes under a
        container-wide ``PYTHONPATH`` (``pip``, helper scripts, ``NGPU=$(python -c "import torch; ...")``,
        the prelude-path recipe) keep their stdout clean: their Summary goes to their log only."""
        # Calls made while activating are no sign: some features act on import in every process
        # (CONFIG_GUARDS checks the CPU budget when torch loads). Calls the program made later are.
        if self.optimizer_stepped or any(r.calls > r.activation_calls or r.worker_calls or r.node
                                         for r in self.records.values()):
            return True
        launched = os.environ.get(LAUNCHED_ENV) == str(self.process.pid)
        return launched and bool(self.targets_seen)

    def _watch_optimizer_steps(self) -> None:
        """One-shot: the first optimizer step marks this process as training, then the hook removes
        itself (nothing left on the step path)."""
        def on_optim(module: ModuleType) -> None:
            register = getattr(module, "register_optimizer_step_post_hook", None)
            if register is None:
                return
            handle: list[Any] = []

            def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
                self.optimizer_stepped = True
                if handle:
                    handle.pop().remove()

            handle.append(register(stepped))

        importhooks.when_imported("torch.optim.optimizer", on_optim)

    def records_have_node_view(self) -> bool:
        return any(r.node is not None for r in self.records.values())

    def gather_activity(self) -> None:
        """Fold this main process's workers' reports into its records; under torchrun, publish them
        for local rank 0, which collects the node's view. Never raises."""
        channel = self.channel
        if channel is None or os.getpid() != channel.pid:
            return
        try:
            for name, totals in channel.worker_totals().items():
                record = self.records.get(name)
                if record is not None:
                    record.worker_calls, record.workers = totals.worker_calls, totals.workers
            own = activity.merged(self.records.values())
            channel.publish_rank(own, self.process.rank)
            if channel.local_world_size > 1 and channel.local_rank == 0:
                view = channel.node_view()
                for record in self.records.values():  # by global rank: node 1 of 2x2 shows ranks 2,3
                    if record.enabled:
                        record.node = {rank: totals.get(record.feature.name, activity.Totals()).to_json()
                                       for rank, totals in sorted(view.ranks.items())}
                if view.silent:
                    self.log.warning("no activity report from ranks", ranks=view.silent)
                    self.node_silent = dict(view.silent)
        except Exception as exc:
            self.log.warning("cannot gather activity from other processes", error=repr(exc))

    def _open_channel(self) -> None:
        channel = activity.MainChannel.open(self.process.pid, self.process.local_rank,
                                            self.process.local_world_size, rank=self.process.rank)
        if channel is None:
            self.log.info("no directory for DataLoader workers' activity reports; the Summary counts this "
                          "process only")
            return
        self.channel = channel
        os.environ[activity.ENV] = channel.handoff()

    def _worker_started(self, worker_id: int) -> None:
        handoff = activity.parse_handoff(os.environ.get(activity.ENV))
        if handoff is None or self._reporter is not None:
            return
        records = self.records
        reporter = activity.WorkerReporter(
            handoff[0], handoff[1], worker_id,
            lambda: {name: r.calls for name, r in records.items() if r.calls}, self._fork_baseline)
        self._reporter = reporter
        reporter.start()

    def _worker_stopping(self, worker_id: int) -> None:
        if self._reporter is not None:
            self._reporter.stop()
