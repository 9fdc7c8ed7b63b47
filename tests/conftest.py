"""Session-wide pools of gloo ranks (see dist_pool.py), the GPU skip marker, and the programs
run beside the suite (background_jobs.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from background_jobs import Job, Runner
from dist_pool import DistPool

_POOLS: dict[tuple[int, str, tuple[tuple[str, str], ...]], DistPool] = {}


def get_pool(world_size: int, backend: str = "gloo", env: dict[str, str] | None = None) -> DistPool:
    """One pool per (world size, backend, extra environment), started on first use."""
    key = (world_size, backend, tuple(sorted((env or {}).items())))
    if key not in _POOLS:
        _POOLS[key] = DistPool(world_size, backend=backend, env=env)
    return _POOLS[key]


@pytest.fixture(scope="session")
def pools() -> Iterator[object]:
    yield get_pool
    for pool in _POOLS.values():
        pool.close()


# ---- background jobs (background_jobs.py, [Note: background jobs]) ------------------------------
_RUNNER = Runner()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "background(job): the test checks a background_jobs.Job run beside the suite"
    )


def _jobs(item: pytest.Item) -> list[Job]:
    return [job for mark in item.iter_markers("background") for job in mark.args]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of background jobs last: their jobs then run beside every other test."""
    items[:] = [i for i in items if not _jobs(i)] + [i for i in items if _jobs(i)]


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        _RUNNER.start([job for item in session.items for job in _jobs(item)])


def pytest_sessionfinish() -> None:
    _RUNNER.close()


@pytest.fixture(scope="session")
def background() -> Runner:
    return _RUNNER
