"""Shared pieces of tune's unit tests: the synthetic job and facts of a made-up machine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAKE_JOB = HERE / "fake_job.py"
sys.path.insert(0, str(HERE))  # tune_helpers


@pytest.fixture
def fake_job() -> list[str]:
    return [sys.executable, str(FAKE_JOB)]


@pytest.fixture
def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("LOONGKIT_", "FAKE_"))}
