"""loongkit_core.lifecycle: features' exit callbacks (newest first, in the process that registered each,
isolated), then the Summary once, from the process that booted; the after-fork handler. SIGTERM arriving
during the exit callbacks: tests/unit/core/test_activity.py."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from loongkit_core import lifecycle
from loongkit_core.feature import State


@pytest.fixture
def blocks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The Summary blocks written to the log (and no log shut down under the other tests)."""
    written: list[str] = []
    monkeypatch.setattr(lifecycle.log, "write_block", written.append)
    monkeypatch.setattr(lifecycle.log, "shutdown", lambda: None)
    return written


def test_exit_callbacks_run_newest_first_isolated_and_only_in_their_process(booted: Any, feature: Any,
                                                                          blocks: list[str]) -> None:
    rt = booted({}, {}, (feature("a"), feature("b")))
    ran: list[str] = []

    def broken() -> None:
        ran.append("broken")
        raise RuntimeError("cannot flush")

    rt._register_exit(rt.records["a"], lambda: ran.append("first"))
    rt._register_exit(rt.records["b"], broken)
    rt._register_exit(rt.records["a"], lambda: ran.append("third"))
    rt._exit_callbacks.append((rt.records["a"], lambda: ran.append("parent's"), os.getpid() + 1))
    rt.run_exit_callbacks()
    assert ran == ["third", "broken", "first"] and rt._exit_callbacks == []
    assert [(f.where, f.feature) for f in rt.manager.faults] == [("exit callback", "b")]
    assert rt.records["b"].state == State.FAILED


def test_finish_writes_the_summary_once_and_names_unimported_targets(booted: Any, feature: Any,
                                                                    blocks: list[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rt = booted({}, {}, (feature("a", targets=("json", "csv")),))
    monkeypatch.setattr(rt.process, "role", "main")
    rt.records["a"].state, rt.records["a"].enabled = State.ARMED, True
    ran: list[str] = []
    rt._register_exit(rt.records["a"], lambda: ran.append("callback"))
    rt.finish()
    rt.finish()
    assert ran == ["callback"] and len(blocks) == 1 and rt._summary_done
    assert rt.records["a"].reason == "target not imported: json, csv"
    assert "target not imported: json, csv" in blocks[0]


def test_a_forked_child_runs_its_own_callbacks_but_writes_no_summary(booted: Any, feature: Any,
                                                                    blocks: list[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rt = booted({}, {}, (feature("a"),))
    monkeypatch.setattr(rt.process, "role", "main")
    monkeypatch.setattr(rt.process, "pid", os.getpid() + 1)  # booted in another process: its parent
    ran: list[str] = []
    rt._register_exit(rt.records["a"], lambda: ran.append("child's"))
    rt.finish()
    assert ran == ["child's"] and blocks == [] and not rt._summary_done


def test_after_fork_relabels_the_child_and_keeps_what_it_inherited(booted: Any, feature: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rt = booted({}, {}, (feature("a"), feature("b")))
    relabelled: list[Any] = []
    monkeypatch.setattr(lifecycle.process_mod, "mark_forked_child", relabelled.append)
    monkeypatch.setattr(lifecycle.log, "after_fork", relabelled.append)
    rt.records["a"].calls = 3
    rt._reporter = object()  # the parent's (a worker forking a worker)
    rt._after_fork()
    assert rt._fork_baseline == {"a": 3} and rt._reporter is None
    assert relabelled == [rt.process, rt.process]


TRAIN = """
import loongkit_core.all  # noqa: F401
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
print("trained")
"""
HELPER = "import loongkit_core.all\nimport torch\nprint('helper')\n"


def _run_script(tmp_path: Any, code: str, **variables: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOONGKIT_")}
    env.update(LOONGKIT_LOGDIR=str(tmp_path), **variables)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_training_job_whose_settings_enabled_nothing_is_told_why(tmp_path: Any) -> None:
    out = _run_script(tmp_path, TRAIN, LOONGKIT_ALL="on", LOONGKIT_FUSEDADAMW="1")
    assert out.startswith("trained\nloongkit: no feature was enabled"), out
    assert "LOONGKIT_ALL='on' is invalid" in out and "using the default 0" in out, out
    assert "unknown variable LOONGKIT_FUSEDADAMW; did you mean LOONGKIT_FUSED_ADAMW?" in out, out
    assert "LOONGKIT_ALL=1, 2 or 3" in out and "Log: " in out, out


def test_no_notice_without_settings_nor_in_a_helper_process(tmp_path: Any) -> None:
    assert _run_script(tmp_path, TRAIN) == "trained\n"
    assert _run_script(tmp_path, HELPER, LOONGKIT_ALL="on") == "helper\n"  # no optimizer step: not training
