"""README.md stays true: its feature table is what `loongkit features --markdown` prints, and "The two
commands" holds exactly the two set-up commands (main job, tests).

The table is regenerated in place by running this file: ``python tests/unit/test_readme.py --update``.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
START, END = "<!-- features:start -->", "<!-- features:end -->"
REGENERATE = "python tests/unit/test_readme.py --update"
# The table documents the core and the first-party plugins (entry-point name -> distribution).
FIRST_PARTY = {"data": "loongkit-data", "numa": "loongkit-numa", "ops": "loongkit-ops",
               "precision": "loongkit-precision", "monitor": "loongkit-monitor"}
NOX_PREFIX = "python3 -m pip install -q nox && python3 -m nox"


def _missing_first_party() -> list[str]:
    missing = []
    for dist in FIRST_PARTY.values():
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


def generated_table(workdir: Path) -> str:
    """`loongkit features --markdown` in a clean environment: no LOONGKIT_* setting of the caller's, and
    plugins other than the first-party ones (a developer's own, the example plugin) disabled."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOONGKIT_", "_LOONGKIT_"))}
    others = sorted({ep.name for ep in importlib.metadata.entry_points(group="loongkit")} - set(FIRST_PARTY))
    env.update(LOONGKIT_LOGDIR=str(workdir), LOONGKIT_RESOLVE_ONCE="0", LOONGKIT_DISABLE_PLUGINS=",".join(others))
    proc = subprocess.run([sys.executable, "-m", "loongkit_core.cli", "features", "--markdown"], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"`loongkit features --markdown` failed ({proc.returncode}):\n{proc.stderr}"
    return proc.stdout.strip()


def readme_block(text: str) -> str:
    assert text.count(START) == 1 and text.count(END) == 1, f"README.md needs one {START} and one {END}"
    return text[text.index(START) + len(START):text.index(END)].strip()


def test_feature_table_is_generated(tmp_path: Path) -> None:
    missing = _missing_first_party()
    if missing:
        pytest.skip(f"the README's table lists every first-party plugin; not installed: {', '.join(missing)}")
    expected = generated_table(tmp_path)
    actual = readme_block(README.read_text(encoding="utf-8"))
    if actual != expected:
        diff = "\n".join(difflib.unified_diff(actual.splitlines(), expected.splitlines(), "README.md",
                                              "loongkit features --markdown", lineterm=""))
        pytest.fail(f"README.md's feature table (between {START} and {END}) differs from what "
                    f"`loongkit features --markdown` prints. Regenerate it with `{REGENERATE}`.\n{diff}")


def test_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^## The two commands\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "README.md has no '## The two commands' section"
    blocks = [b.strip() for b in re.findall(r"^```[^\n]*\n(.*?)^```", match.group(1), re.M | re.S)]
    assert len(blocks) == 2, f"'The two commands' must hold exactly two fenced commands, found {len(blocks)}: {blocks}"
    for block in blocks:
        assert "\n" not in block and block.startswith(NOX_PREFIX), f"not a one-line `{NOX_PREFIX} ...`: {block!r}"
    main, tests = blocks
    assert main == f"{NOX_PREFIX} -s main", main
    assert tests.startswith(f"{NOX_PREFIX} -t test"), tests
    noxfile = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    assert "def main(session" in noxfile and 'tags=["test"]' in noxfile and 'tags=["lint"]' in noxfile


def _update() -> int:
    import tempfile

    text = README.read_text(encoding="utf-8")
    readme_block(text)
    with tempfile.TemporaryDirectory() as tmp:
        table = generated_table(Path(tmp))
    new = text[:text.index(START) + len(START)] + "\n" + table + "\n" + text[text.index(END):]
    README.write_text(new, encoding="utf-8")
    print("README.md: feature table " + ("unchanged" if new == text else "regenerated"))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {REGENERATE}")
    sys.exit(_update())
