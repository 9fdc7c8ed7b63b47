"""Pure tests of `GradSync` ([Note: step phase] in megabuf/sync/grad_sync.py): its phase, its doors
and the order of its collectives, with bucket groups over a recording fake of the collectives
(tests/test_bucket_state.py's) and no process group."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from test_bucket_state import OVERLAP, RecordingCollectives, dispatched, grad, make_chain

from megabuf.buckets.bucket_group import BucketGroup, GradSyncState
from megabuf.config import DistributedDataParallelConfig as Config
from megabuf.sync.grad_sync import GradSync, SyncPhase
from megabuf.sync.grads import ExposedGrads

ACC, OWED, SYNCED = SyncPhase.ACCUMULATING, SyncPhase.MICROBATCH_OWED, SyncPhase.SYNCED
REDUCE_EACH = Config(
    data_parallel_sharding_strategy="optim_grads",
    sharded_grad_accumulation="reduce_each_microbatch",
)


def make_sync(
    n: int = 3, cfg: Config = OVERLAP, order: Sequence[int] | None = None, checks: int = 0
) -> tuple[GradSync, list[BucketGroup], RecordingCollectives, list[str]]:
    coll = RecordingCollectives()
    chain, groups = make_chain(n, coll, cfg=Config(overlap_grad_reduce=True), order=order)
    seen: list[str] = []
    sync = GradSync(
        groups, [chain], cfg, ExposedGrads([], [], {}),
        before_sync=lambda: seen.append("before"),
        checks=[lambda k=k: seen.append(f"check{k}") for k in range(checks)],
    )  # fmt: skip
    return sync, groups, coll, seen


def backward(groups: Sequence[BucketGroup]) -> None:
    for g in groups:
        for i in range(len(g.params_list)):
            grad(g, i)


def test_finish_dispatches_in_chain_order_runs_checks_then_is_synced() -> None:
    sync, groups, coll, seen = make_sync(order=[2, 0, 1], checks=2)
    assert sync.phase is ACC
    backward(groups)
    sync.finish()
    assert dispatched(coll, groups) == [2, 0, 1]
    assert seen == ["before", "check0", "check1"]
    assert sync.phase is SYNCED and sync.unsynced_group() is None
    sync.finish()  # every group synced: a no-op, no second collective, no second check
    assert len(coll.calls) == 3 and seen == ["before", "check0", "check1"]


def test_zero_starts_a_new_iteration_and_unsynced_group_names_a_group() -> None:
    sync, groups, _, _ = make_sync()
    backward(groups)
    sync.finish()
    sync.zero()
    assert sync.phase is ACC
    assert sync.unsynced_group() is groups[0]
    assert {g.grad_state for g in groups} == {GradSyncState.IDLE}


def test_a_check_that_raises_leaves_the_grads_unexposed_and_the_phase_accumulating() -> None:
    coll = RecordingCollectives()
    chain, groups = make_chain(2, coll)

    def boom() -> None:
        raise RuntimeError("nan")

    exposed = ExposedGrads([], [], {})
    sync = GradSync(groups, [chain], OVERLAP, exposed, checks=[boom])
    backward(groups)
    with pytest.raises(RuntimeError, match="nan"):
        sync.finish()
    assert sync.phase is ACC and not exposed.exposed


def test_require_sync_sets_every_groups_last_microbatch_flag() -> None:
    sync, groups, _, _ = make_sync()
    with sync.no_sync():
        assert not sync.require_sync
        assert not any(g.is_last_microbatch for g in groups)
    assert sync.require_sync and all(g.is_last_microbatch for g in groups)


def test_a_deferred_iteration_reduces_after_backward_even_past_a_no_sync_exit() -> None:
    """[Note: quiet step] (megabuf/replan/warmup.py): zero(defer_dispatch=True) makes backward only
    accumulate, also for the last micro-batch after a no_sync() block; finish() then dispatches
    every group in chain order; the next zero() dispatches in backward again."""
    sync, groups, coll, _ = make_sync(order=[2, 0, 1])
    backward(groups)  # the first iteration learns the arrivals
    sync.finish()
    sync.zero()
    backward(groups)
    assert len(coll.calls) == 6  # learned: each group dispatched from its last grad
    sync.finish()
    sync.zero(defer_dispatch=True)
    with sync.no_sync():
        backward(groups)
    assert not any(g.is_last_microbatch for g in groups)  # the exit kept the deferral
    backward(groups)
    assert len(coll.calls) == 6 and {g.grad_state for g in groups} == {GradSyncState.IDLE}
    sync.finish()
    assert dispatched(coll, groups)[-3:] == [2, 0, 1] and sync.phase is SYNCED
    sync.zero()
    backward(groups)
    assert len(coll.calls) == 12 and all(g.is_last_microbatch for g in groups)


def test_reduce_each_microbatch_owes_a_no_sync_micro_batch_and_pays_it_at_the_next_forward() -> (
    None
):
    sync, groups, coll, _ = make_sync(cfg=REDUCE_EACH)
    assert sync.reduce_each
    with sync.no_sync():
        sync.before_forward(grad_enabled=True)
        assert sync.phase is OWED
        assert all(g.is_last_microbatch for g in groups)  # every micro-batch reduces
        backward(groups)
    sync.before_forward(grad_enabled=True)  # deferred backward end: the forward pays it
    assert sync.phase is ACC and len(coll.calls) == 3
    assert {g.grad_state for g in groups} == {GradSyncState.IDLE}  # next_microbatch
    sync.finish_microbatch()  # nothing owed: a no-op
    assert len(coll.calls) == 3


def test_without_reduce_each_a_no_sync_forward_owes_nothing() -> None:
    sync, _, coll, _ = make_sync()
    with sync.no_sync():
        sync.before_forward(grad_enabled=True)
    assert sync.phase is ACC
    sync.finish_microbatch()
    assert coll.calls == []


def test_finish_pays_an_owed_micro_batch_with_the_sync() -> None:
    sync, groups, coll, _ = make_sync(cfg=REDUCE_EACH)
    with sync.no_sync():
        sync.before_forward(grad_enabled=True)
    backward(groups)
    sync.finish()
    assert sync.phase is SYNCED and len(coll.calls) == 3  # one reduction per group, not two


def test_abandon_waits_out_reductions_leaves_no_sync_and_zeroes() -> None:
    sync, groups, coll, _ = make_sync()
    sync.set_require_sync(False)
    backward(groups)
    sync.start()  # in flight
    assert {g.grad_state for g in groups} == {GradSyncState.DISPATCHED}
    sync.abandon()
    assert all(c.pending is not None and c.pending.waits >= 1 for c in coll.calls)
    assert sync.require_sync and sync.phase is ACC
    assert {g.grad_state for g in groups} == {GradSyncState.IDLE}


def test_groups_that_backward_finished_on_its_own_still_get_the_checks() -> None:
    """optim_grads* finishes landed reductions during backward: every group may be SYNCED
    before finish() on one rank and not on another; the checks (collectives) must run anyway."""
    sync, groups, _, seen = make_sync(checks=1)
    backward(groups)
    sync.start()
    for g in groups:
        g.finish_grad_sync()  # as a released bucket's reduction finishes inside backward
    sync.finish()
    assert seen == ["before", "check0"] and sync.phase is SYNCED
    with sync.deferred():  # (outside a real backward: queue no end-of-backward callback)
        sync.on_grad()  # a later backward owes the sync again
    assert sync.phase is ACC
