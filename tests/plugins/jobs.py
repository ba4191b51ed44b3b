"""``no_job_left``: the jobs a test starts through tests/job_runs.py end with the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperpod_sim.infra.node_processes import end_marked
from tests.job_runs import MARK


@pytest.fixture
def no_job_left(tmp_path: Path) -> Iterator[None]:
    """A failed test leaves no supervisor or rank behind (each carries the test's mark)."""
    yield
    end_marked([str(tmp_path)], name=MARK)
