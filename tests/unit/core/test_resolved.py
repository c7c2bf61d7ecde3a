"""loongkit_core.resolved, its parts on their own: when a process may reuse a resolution, what the key
holds, which reads count, which files are ours, and a worker finding its main's resolution. Whole jobs
(ranks, workers, re-runs, an edited plugin): tests/e2e/test_resolved.py; the replay: test_replay.py."""

from __future__ import annotations

import marshal
import os
from pathlib import Path
from typing import Any

import pytest

from loongkit_core import resolved
from loongkit_core.process import ProcessInfo


def info(role: str) -> ProcessInfo:
    return ProcessInfo(role, os.getpid(), "host", None, None, None, None)


def test_wanted_unless_switched_off_or_under_a_fake_root(tmp_path: Path) -> None:
    assert resolved.wanted({})
    assert resolved.wanted({"LOONGKIT_SYSFS_ROOT": "/"})
    assert not resolved.wanted({resolved.SWITCH: "0"})
    assert not resolved.wanted({"LOONGKIT_SYSFS_ROOT": str(tmp_path)})


def test_the_key_holds_the_loongkit_variables_and_the_role() -> None:
    main, worker = info("main"), info("worker")
    key = resolved.material({"LOONGKIT_B": "1", "HOME": "/root", "LOONGKIT_A": "2"}, main)
    assert key["env"] == (("LOONGKIT_A", "2"), ("LOONGKIT_B", "1")) and key["role"] == "main"
    assert key["format"] == resolved.FORMAT
    other = resolved.material({"LOONGKIT_B": "1", "LOONGKIT_A": "2"}, main)
    assert resolved._file_name(other) == resolved._file_name(key)  # HOME is no part of it
    assert resolved._file_name(resolved.material({"LOONGKIT_A": "2"}, main)) != resolved._file_name(key)
    assert resolved._file_name(resolved.material({"LOONGKIT_B": "1", "LOONGKIT_A": "2"}, worker)) != \
        resolved._file_name(key)


def test_reads_by_name_count_and_a_scan_does_not() -> None:
    env = resolved.RecordingEnviron({"CUDA_VISIBLE_DEVICES": "0", "LOONGKIT_ALL": "1", "PATH": "/bin"})
    assert env.get("CUDA_VISIBLE_DEVICES") == "0" and env.get("NCCL_X") is None and "OMP_NUM_THREADS" not in env
    assert env["LOONGKIT_ALL"] == "1"  # in the key already
    assert sorted(env) == ["CUDA_VISIBLE_DEVICES", "LOONGKIT_ALL", "PATH"] and len(env) == 3
    assert dict(env.items())["PATH"] == "/bin"
    assert env.reads == {"CUDA_VISIBLE_DEVICES": "0", "NCCL_X": None, "OMP_NUM_THREADS": None}


def test_still_valid_while_reads_and_files_are_as_recorded(tmp_path: Path) -> None:
    file = tmp_path / "plugin.py"
    file.write_text("x = 1\n")
    data: Any = {"reads": {"CUDA_VISIBLE_DEVICES": "0"}, "stats": [(str(file), *resolved._stat(str(file)))]}
    assert resolved._still_valid(data, {"CUDA_VISIBLE_DEVICES": "0"})
    assert not resolved._still_valid(data, {"CUDA_VISIBLE_DEVICES": "1"})
    assert resolved._still_valid(data, {}, reads=False)  # a worker serves its main, whatever it reads
    file.write_text("x = 22\n")
    assert not resolved._still_valid(data, {"CUDA_VISIBLE_DEVICES": "0"})


def _write(path: Path, payload: Any, mode: int = 0o600) -> str:
    path.write_bytes(marshal.dumps(payload))
    path.chmod(mode)
    return str(path)


def test_only_our_own_well_formed_files_are_read(tmp_path: Path) -> None:
    good = {"format": resolved.FORMAT, "variants": []}
    assert resolved._read(_write(tmp_path / "good.bin", good)) == good
    assert resolved._read(_write(tmp_path / "open.bin", good, 0o622)) is None  # writable by others
    assert resolved._read(_write(tmp_path / "old.bin", {"format": resolved.FORMAT - 1, "variants": []})) is None
    (tmp_path / "garbage.bin").write_bytes(b"\x00not marshal")
    assert resolved._read(str(tmp_path / "garbage.bin")) is None
    os.symlink(tmp_path / "good.bin", tmp_path / "link.bin")
    assert resolved._read(str(tmp_path / "link.bin")) is None
    assert resolved._read(str(tmp_path / "missing.bin")) is None


def test_a_worker_finds_its_mains_variant_by_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolved, "directory", lambda: None)  # no node-wide lookup here
    worker = info("worker")
    key = resolved.material({"LOONGKIT_ALL": "1"}, worker)
    mains = dict(key, role="main", cpus=(0,), path=("elsewhere",))  # a worker's own may differ there
    variant = {"key": mains, "pid": 4242, "reads": {"X": "1"}, "stats": []}
    path = _write(tmp_path / "r.bin", {"format": resolved.FORMAT, "variants": [variant]})
    found = resolved.load({resolved.ENV: f"{path}:4242"}, worker, key)
    assert found is not None and found["pid"] == 4242 and found["path"] == path
    assert resolved.handoff(found) == f"{path}:4242"
    assert resolved.load({resolved.ENV: f"{path}:4243"}, worker, key) is None  # another main's
    assert resolved.load({resolved.ENV: f"{path}:4242"}, worker,
                         resolved.material({"LOONGKIT_ALL": "2"}, worker)) is None  # other variables
    assert resolved.load({resolved.ENV: f"{path}:4242"}, info("main"), key) is None  # a main looks by key
