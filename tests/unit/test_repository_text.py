"""The repository speaks of the project alone: no tracked file names a particular machine's paths or tells
who ran what when.

A reader has only the repository: commands are ones anyone can run (``nox -s <session>``, the venvs the
noxfile makes under ``.nox/``, ``python benchmarks/...`` from the root), and a measuring machine is
described (cores, load, GPU or not), never named by its paths or its history.

Checked with ``git grep`` over every tracked file (binary files skipped), this file excluded: it has to
spell the patterns out. Nothing else is excluded.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Absolute paths under /work/ (a development machine's checkout and venvs), and numbered sessions
# ("session 5": a history of who ran what). nox's sessions are named (tests, stack2, plugin-ops), never
# numbered, so a digit after "session" is history wherever it appears.
MACHINE_OR_SESSION = r"/work/|session [0-9]"
# Phrases of the project's own history found in the tree when this test was written (extended regular
# expressions, matched case-insensitively). "session" alone is not one: nox sessions and process sessions
# (setsid) are the code's own words.
HISTORY = (
    r"this session",
    r"the sessions? that wrote",
    r"the session before",
    r"same session",
    r"other engineers",
    r"engineers' (jobs|builds|work)",
    r"\blent\b",  # "no device was lent to ..."; a whole word, so "equivalent" does not match
    r"device tool",
    r"fetch tool",
)


def _git_grep(root: Path, patterns: tuple[str, ...], exclude: str | None = None) -> list[str]:
    """'path:line: text' for each line of a tracked text file under ``root`` matching any pattern
    (extended regular expressions, case-insensitive)."""
    args = [arg for pattern in patterns for arg in ("-e", pattern)]
    spec = ["--", ".", f":(exclude){exclude}"] if exclude else []
    proc = subprocess.run(["git", "grep", "-n", "-I", "-i", "-E", *args, *spec], cwd=root, capture_output=True,
                          text=True)
    if proc.returncode not in (0, 1):  # 1: nothing found
        raise AssertionError(f"git grep failed ({proc.returncode}): {proc.stderr}")
    hits = []
    for line in proc.stdout.splitlines():
        path, number, text = line.split(":", 2)
        hits.append(f"{path}:{number}: {text.strip()[:160]}")
    return hits


def _tree() -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (the rule is about the tracked files)")
    return ROOT


def test_no_machine_paths_or_numbered_sessions() -> None:
    hits = _git_grep(_tree(), (MACHINE_OR_SESSION,), exclude=HERE)
    assert not hits, ("a machine's paths or a numbered session in the tracked files (write `nox -s ...`, "
                      "`.nox/<session>/bin/python` or describe the machine instead):\n" + "\n".join(hits))


def test_no_history_phrases() -> None:
    hits = _git_grep(_tree(), HISTORY, exclude=HERE)
    assert not hits, ("the project's own history in the tracked files (say what the code does and what was "
                      "measured, not who ran it when):\n" + "\n".join(hits))


def test_the_rule_finds_what_it_looks_for(tmp_path: Path) -> None:
    """Each pattern catches its kind of hit, and only those, in a throwaway repository (so that the checks
    above cannot pass vacuously); the failure names file:line."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    samples = {"a.md": "intro\nrun /work/venv/bin/python x.py\n", "b.py": "# measured in Session 5\n",
               "c.md": "no device was lent to this session\n", "d.md": "load from other engineers' jobs\n",
               "ok.md": "nox -s stack2; .nox/stack2/bin/python benchmarks/ops.py; the trial's own session;\n"
                        "equivalent to the reference\n"}
    for name, text in samples.items():
        (tmp_path / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    assert _git_grep(tmp_path, (MACHINE_OR_SESSION,)) == ["a.md:2: run /work/venv/bin/python x.py",
                                                          "b.py:1: # measured in Session 5"]
    assert [hit.split(":")[0] for hit in _git_grep(tmp_path, HISTORY)] == ["c.md", "d.md"]
    assert _git_grep(tmp_path, (MACHINE_OR_SESSION,), exclude="a.md") == ["b.py:1: # measured in Session 5"]
