"""Session-wide pools of gloo ranks (see dist_pool.py) and the GPU skip marker."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

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
