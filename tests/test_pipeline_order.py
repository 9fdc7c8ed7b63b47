"""Pure tests of the schedule orders (no processes): every step once, forward before backward,
bounded in-flight activations, and no deadlock across all ranks."""

from __future__ import annotations

import pytest

from megabuf.pipeline import interleaved_order, one_f_one_b_order, simulate_pipeline
from megabuf.pipeline.chunks import single_bucket_group


def _check_complete(order: list, num_microbatches: int, num_chunks: int) -> None:
    steps = [(a.phase, a.chunk, a.microbatch) for a in order]
    want = {(p, c, m) for p in "FB" for c in range(num_chunks) for m in range(num_microbatches)}
    assert len(steps) == len(want) and set(steps) == want
    for c in range(num_chunks):
        for m in range(num_microbatches):
            assert steps.index(("F", c, m)) < steps.index(("B", c, m))


@pytest.mark.parametrize("pp_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_microbatches", [1, 2, 5, 8])
def test_1f1b(pp_size: int, num_microbatches: int) -> None:
    orders = [one_f_one_b_order(num_microbatches, pp_size, r) for r in range(pp_size)]
    for rank, order in enumerate(orders):
        _check_complete(order, num_microbatches, 1)
        in_flight, peak = 0, 0
        for a in order:
            in_flight += 1 if a.phase == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(pp_size - rank, num_microbatches)  # 1F1B's memory bound
    simulate_pipeline(orders, 1)


@pytest.mark.parametrize("pp_size,num_chunks", [(2, 2), (2, 3), (4, 2), (3, 2)])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved(pp_size: int, num_chunks: int, groups: int) -> None:
    m = pp_size * groups
    orders = [interleaved_order(m, pp_size, r, num_chunks) for r in range(pp_size)]
    for order in orders:
        _check_complete(order, m, num_chunks)
        for chunk in range(num_chunks):  # each chunk sees micro-batches in order, both phases
            for phase in "FB":
                seen = [a.microbatch for a in order if a.chunk == chunk and a.phase == phase]
                assert seen == sorted(seen)
    simulate_pipeline(orders, num_chunks)


def test_interleaved_rejects_ragged_microbatches() -> None:
    with pytest.raises(ValueError, match="multiple of pp_size"):
        interleaved_order(3, 2, 0, 2)


def test_simulation_detects_deadlock() -> None:
    bad = [list(reversed(one_f_one_b_order(2, 2, 0))), one_f_one_b_order(2, 2, 1)]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate_pipeline(bad, 1)


def test_bucketing_rule() -> None:
    assert not single_bucket_group(0, 0)
    assert single_bucket_group(1, 0) and single_bucket_group(0, 1)
