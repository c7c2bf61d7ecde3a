"""One trial: a fresh process with the candidate's variables; crash, hang and figures told apart."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from loongkit_monitor.tune import space, trial


def setup(tmp_path: Path, command: list[str], env: dict[str, str], steps: int = 6) -> trial.Setup:
    return trial.Setup(command, env, steps, tmp_path, launcher=[])


def test_a_trial_gets_the_monitor_and_the_candidate(tmp_path: Path, fake_job: list[str],
                                                   clean_env: dict[str, str]) -> None:
    rules = [{"when": {"LOONGKIT_DATALOADER_WORKERS_COUNT": "3"}, "step": 0.04}]
    s = setup(tmp_path, fake_job, {**clean_env, "FAKE_RULES": json.dumps(rules)})
    candidate = space.Candidate("workers=3", (("LOONGKIT_DATALOADER_WORKERS", "1"),
                                              ("LOONGKIT_DATALOADER_WORKERS_COUNT", "3")), space.WORKERS, 0)
    r = trial.run(s, candidate, 0, 1, timeout=60)
    assert r.ok, r.error
    assert r.step_s == 0.04 and r.figures is not None and r.figures.workers == 3
    assert r.losses == [round(2.0 / (i + 1), 6) for i in range(6)]
    env = trial.trial_environ(s, candidate, Path("x.json"))
    assert env["LOONGKIT_MONITOR"] == "1" and env["LOONGKIT_MONITOR_MAX_STEPS"] == "6"
    assert env["LOONGKIT_SUMMARY_JSON"] == "x.json"


def test_crash_is_reported_with_the_exception(tmp_path: Path, fake_job: list[str], clean_env: dict[str, str]) -> None:
    s = setup(tmp_path, fake_job, {**clean_env, "FAKE_RULES": json.dumps([{"crash": True}])})
    r = trial.run(s, space.baseline(), 0, 1, timeout=60)
    assert not r.ok and r.kind == "crash"
    assert r.error == "crashed: exit code 1 (RuntimeError: planted crash)"


def test_hang_is_ended_with_everything_it_started(tmp_path: Path, clean_env: dict[str, str]) -> None:
    pidfile = tmp_path / "child.pid"
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
            "print('loss: 1.0', flush=True)\n"
            "time.sleep(600)\n")
    s = setup(tmp_path, [sys.executable, "-c", code], clean_env)
    start = time.monotonic()
    r = trial.run(s, space.baseline(), 0, 1, timeout=3)
    assert time.monotonic() - start < 3 + trial.KILL_GRACE_S + 5
    assert r.kind == "hang" and r.error == "hangs: no exit within 3 s"
    assert r.losses == [1.0]
    child = int(pidfile.read_text())
    for _ in range(50):  # the grandchild was in the trial's process group: gone too
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)
    cut = trial.run(s, space.baseline(), 1, 1, timeout=1, budget_cut=True)
    assert cut.kind == "budget" and "budget ran out" in cut.error


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (reaped later by init) counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_no_figures_without_the_monitor(tmp_path: Path, clean_env: dict[str, str]) -> None:
    s = setup(tmp_path, [sys.executable, "-c", "print('loss: 0.5')"], clean_env)
    r = trial.run(s, space.baseline(), 0, 1, timeout=60)
    assert r.kind == "no figures" and "no JSON Summary" in r.error


def test_base_environ_drops_feature_switches_keeps_core_settings() -> None:
    env, dropped = trial.base_environ({"PATH": "/bin", "LOONGKIT_ALL": "2", "LOONGKIT_MALLOC": "1",
                                       "LOONGKIT_SYSFS_ROOT": "/x", "_LOONGKIT_ACTIVITY": "/d:1"},
                                      ("LOONGKIT_SYSFS_ROOT",))
    assert env == {"PATH": "/bin", "LOONGKIT_SYSFS_ROOT": "/x"}
    assert dropped == ["LOONGKIT_ALL", "LOONGKIT_MALLOC"]


def test_the_exception_not_the_summary_names_a_crash() -> None:
    text = ("step 1 loss: 2.0\nTraceback (most recent call last):\n  File \"x.py\", line 3\n"
            "RuntimeError: planted crash\n" + trial.SUMMARY_START + " ======\nmonitor  *\n"
            "Training monitor: no steps seen (no optimizer step ran)\n" + "=" * 80 + "\n")
    assert trial._last_line(text) == "RuntimeError: planted crash"
    assert trial._last_line("warming up\nkilled\n") == "killed"
    assert trial._last_line("") == ""


def test_ctrl_c_ends_the_running_trial(tmp_path: Path, clean_env: dict[str, str]) -> None:
    """The trial has its own session, so the terminal's SIGINT reaches tune only: tune ends it."""
    import signal
    import subprocess

    pidfile = tmp_path / "job.pid"
    job = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    # Python turns SIGINT into KeyboardInterrupt only where it was not ignored at its start, and a process
    # started in the background by a non-interactive shell inherits it ignored (the CI replica's nox had
    # SigIgn bit 1 set): there the driver never saw the signal and this waited out its 60 s. The driver
    # takes the handling a tune run from a terminal has.
    driver = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from pathlib import Path\nfrom loongkit_monitor.tune import space, trial\n"
              f"s = trial.Setup([sys.executable, '-c', {job!r}], {{}}, 5, Path({str(tmp_path)!r}), launcher=[])\n"
              "trial.run(s, space.baseline(), 0, 1, timeout=600)\n")
    proc = subprocess.Popen([sys.executable, "-c", driver], env=clean_env, stderr=subprocess.PIPE, text=True)
    for _ in range(300):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    child = int(pidfile.read_text())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def test_ctrl_c_before_the_wait_still_ends_the_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands between starting the job and waiting for it (here: while the output reader
    starts; CI hit it on a loaded machine) ends the trial too: a job left running kept its pipe open and
    hung tune's exit on the reader's lock."""
    pidfile = tmp_path / "job.pid"
    job = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"

    class InterruptedStart(trial.threading.Thread):  # type: ignore[name-defined,misc]
        def start(self) -> None:
            for _ in range(300):  # the job is up: the interrupt lands with it running
                if pidfile.exists() and pidfile.read_text():
                    break
                time.sleep(0.1)
            raise KeyboardInterrupt

    monkeypatch.setattr(trial.threading, "Thread", InterruptedStart)
    s = trial.Setup([sys.executable, "-c", job], {**os.environ}, 5, tmp_path, launcher=[])
    with pytest.raises(KeyboardInterrupt):
        trial.run(s, space.baseline(), 0, 1, timeout=600)
    child = int(pidfile.read_text())
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)
