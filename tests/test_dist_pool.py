"""The test pool itself: a case cannot see what an earlier one left in a worker ([Note: clean
worker state] in dist_pool.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from dist_pool import CaseFailure, DistPool, run_each


@pytest.fixture(scope="module")
def pool() -> Iterator[DistPool]:
    # a pool of its own with a short timeout: without the cleanup the next case hangs
    p = DistPool(2, timeout_s=30.0)
    yield p
    p.close()


def raise_after_async_all_reduce() -> None:
    """Rank 0 leaves an all-reduce in flight that rank 1 never issues, then raises."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.full((4,), 100.0), async_op=True)
        raise RuntimeError("planted failure")


def sum_of_ones() -> list[float]:
    ones = torch.ones(4)
    dist.all_reduce(ones)
    return ones.tolist()


def test_a_run_after_a_failed_run_with_a_collective_in_flight_is_clean(pool: DistPool) -> None:
    assert pool.run(sum_of_ones) == [[2.0] * 4] * 2
    with pytest.raises(RuntimeError, match="planted failure"):
        pool.run(raise_after_async_all_reduce)
    # rank 1's all-reduce would pair with rank 0's leftover one (101s, then a hang)
    assert pool.run(sum_of_ones) == [[2.0] * 4] * 2


def raise_everywhere() -> None:
    raise ValueError("planted failure on every rank")


def test_a_case_failing_on_every_rank_hides_no_other(pool: DistPool) -> None:
    cases = {"bad": (raise_everywhere,), "good": (sum_of_ones,)}
    for results in pool.run(run_each, cases):
        assert isinstance(results["bad"], CaseFailure), results
        assert results["good"] == [2.0] * 4, results


def test_a_sweep_stops_after_a_case_failed_on_some_ranks_and_the_next_run_is_clean(
    pool: DistPool,
) -> None:
    cases = {"bad": (raise_after_async_all_reduce,), "good": (sum_of_ones,)}
    per_rank = pool.run(run_each, cases)
    assert isinstance(per_rank[0]["bad"], CaseFailure)
    assert per_rank[1]["bad"] is None  # rank 1 returned normally, rank 0 raised
    for results in per_rank:
        assert isinstance(results["good"], CaseFailure)
        assert "not run: case 'bad' failed on ranks [0]" in results["good"].traceback
    assert pool.run(run_each, {"good": (sum_of_ones,)}) == [{"good": [2.0] * 4}] * 2
