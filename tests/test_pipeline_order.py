"""Pure tests of the schedule orders and their point-to-point steps (no processes): every step
once, forward before backward, bounded in-flight activations, and, run the way NCCL would
(messages matched in issue order, sends waiting for their receives), every message matched and no
deadlock across all ranks."""

from __future__ import annotations

import pytest

from megabuf.pipeline import (
    Action,
    interleaved_order,
    one_f_one_b_order,
    p2p_steps,
    simulate_pipeline,
)
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
    # stage 0 without warm-up waits for the grad of micro-batch 0 while the last stage, with a
    # warm-up forward, waits for micro-batch 1's activation first
    bad = [one_f_one_b_order(2, 2, 1), one_f_one_b_order(2, 2, 0)]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate_pipeline(bad, 1)


def test_simulation_detects_mismatched_messages() -> None:
    # the last stage runs micro-batch 1 first: its first receive would get micro-batch 0
    swapped = [Action(p, 0, m, i) for i, m in enumerate((1, 0)) for p in "FB"]
    with pytest.raises(RuntimeError, match="do not match in issue order"):
        simulate_pipeline([one_f_one_b_order(2, 2, 0), swapped], 1)


@pytest.mark.parametrize("pp_size", [2, 4])
def test_interleaved_deadlocks_without_paired_steps(pp_size: int) -> None:
    """One action per group (the old per-message model) deadlocks once sends wait for their
    receives, as on NCCL above the eager size; pairing the steady state's steps does not."""
    orders = [interleaved_order(2 * pp_size, pp_size, r, 2) for r in range(pp_size)]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate_pipeline(orders, 2, paired=False)
    simulate_pipeline(orders, 2, paired=True)


@pytest.mark.parametrize(
    ("pp_size", "num_chunks", "m"), [(2, 1, 4), (4, 1, 6), (2, 2, 4), (4, 2, 8)]
)
@pytest.mark.parametrize("forward_only", [False, True])
def test_steps_carry_each_tensor_once_between_compute(
    pp_size: int, num_chunks: int, m: int, forward_only: bool
) -> None:
    """Flattened, the steps are the order; each input arrives in a group before its compute and
    each result leaves in the group after it; a group lists activations before grads."""
    paired = num_chunks > 1
    for rank in range(pp_size):
        order = (
            interleaved_order(m, pp_size, rank, num_chunks)
            if paired
            else one_f_one_b_order(m, pp_size, rank)
        )
        if forward_only:
            order = [a for a in order if a.phase == "F"]
        steps = p2p_steps(order, pp_size, rank, num_chunks, paired=paired)
        assert [a for s in steps for a in s.compute] == order
        for i, step in enumerate(steps):
            phases = [t.phase for t in step.transfers]
            assert phases == sorted(phases, key=lambda p: p != "F"), step
            for t in step.transfers:
                key = (t.phase, t.chunk, t.microbatch)
                done = {(a.phase, a.chunk, a.microbatch) for a in step.compute}
                before = (
                    {(a.phase, a.chunk, a.microbatch) for a in steps[i - 1].compute} if i else set()
                )
                assert key in (before if t.send else done), (rank, i, str(t))
    if paired and not forward_only:
        assert any(len(s.compute) == 2 for s in steps)  # the steady state is paired


def test_all_warmup_interleaved_pairs_nothing() -> None:
    """num_microbatches == pp_size: every forward is warm-up; the last one is not paired with
    the first backward (that would deadlock)."""
    orders = [interleaved_order(2, 2, r, 2) for r in range(2)]
    for r, order in enumerate(orders):
        assert all(len(s.compute) <= 1 for s in p2p_steps(order, 2, r, 2, paired=True))
    simulate_pipeline(orders, 2)


def test_bucketing_rule() -> None:
    assert not single_bucket_group(0, 0)
    assert single_bucket_group(1, 0) and single_bucket_group(0, 1)
