"""loongkit_core.resident: the one reader of this process's resident memory."""

from __future__ import annotations

import mmap
from pathlib import Path

from loongkit_core import resident


def test_reads_this_process() -> None:
    now = resident.resident_bytes()
    assert now is not None and now > 0
    # A fresh anonymous mapping, every page written: 64 MiB more resident whatever the heap holds (a
    # bytearray could be served from free heap pages that are already resident, as in the full suite's
    # process, or from untouched zero pages).
    block = mmap.mmap(-1, 64 << 20)
    try:
        for offset in range(0, len(block), resident.PAGE_SIZE):
            block[offset] = 1
        grown = resident.resident_bytes()
        assert grown is not None and grown - now >= 60 << 20
    finally:
        block.close()


def test_second_field_in_pages(tmp_path: Path) -> None:
    (tmp_path / "statm").write_text("5000 1200 300 10 0 900 0\n")
    assert resident.resident_bytes(str(tmp_path / "statm")) == 1200 * resident.PAGE_SIZE


def test_unreadable_or_malformed_is_none(tmp_path: Path) -> None:
    assert resident.resident_bytes(str(tmp_path / "missing")) is None
    (tmp_path / "short").write_text("5000\n")
    assert resident.resident_bytes(str(tmp_path / "short")) is None
    (tmp_path / "junk").write_text("a b c\n")
    assert resident.resident_bytes(str(tmp_path / "junk")) is None
