"""Process roles from argv, without importing multiprocessing."""

from __future__ import annotations

import pytest

from loongkit_core import process


@pytest.mark.parametrize(("argv", "role"), [
    (["python", "train.py"], process.MAIN),
    (["python", "-m", "mmdet.train"], process.MAIN),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
      "--multiprocessing-fork"], process.WORKER),
    (["python", "-c", "from multiprocessing.forkserver import main; main(3, 4, ['__main__'])"], process.WORKER),
    (["python", "-c", "from multiprocessing.resource_tracker import main;main(6)"], process.HELPER),
    (["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], process.LAUNCHER),
    (["python", "-m", "torch.distributed.run", "train.py"], process.LAUNCHER),
    (["/venv/bin/python", "/venv/bin/loongkit-run", "python", "t.py"], process.LAUNCHER),
    (["python", "/site-packages/torch/_inductor/compile_worker/__main__.py", "--pickler=x"], process.HELPER),
])
def test_classify(argv: list[str], role: str) -> None:
    assert process.classify(argv) == role


def test_summary_only_on_local_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    info = process.detect()
    assert (info.rank, info.local_rank) == (3, 1)
    assert info.writes_summary and not info.prints_summary
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert process.detect().prints_summary


def test_garbage_rank_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "zero")
    assert process.detect().local_rank is None
