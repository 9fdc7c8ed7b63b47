"""optim_grads (ZeRO-2): [Note: sharded grad lifecycle] in megabuf/sharding/grads.py.

Pure tests of the lifecycle (no process group): padding ranges, the guarded state machine, the
ledger, released storages, the error-feedback refusal. Multi-process tests (zero2_cases.py):
N AdamW steps on gloo ranks against a single-process reference on the global batch, bitwise
equality with "optim", released storages and ledger bounds, wire bytes, named errors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megabuf.comm_hooks import PowerSGD
from megabuf.layout import compute_layout
from megabuf.sharding.grads import (
    GradBucketState,
    ShardedGrads,
    allocate_bucket_grads,
    bucket_padding_ranges,
    check_error_feedback,
    error_feedback_nbytes,
    shards_grads,
)
from megabuf.sharding.ledger import MemoryLedger


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(1, 300), min_size=1, max_size=8),
    dp_size=st.sampled_from([1, 2, 4]),
    bucket_size=st.one_of(st.none(), st.integers(50, 600)),
)
def test_padding_ranges_and_param_slots_tile_every_bucket(
    numels: list[int], dp_size: int, bucket_size: int | None
) -> None:
    layout = compute_layout(numels, bucket_size=bucket_size, dp_size=dp_size, sharded=True)
    for bucket in layout.buckets:
        covered = [0] * bucket.numel
        for lo, hi in bucket_padding_ranges(layout, bucket.bucket_id):
            assert 0 <= lo < hi <= bucket.numel
            for k in range(lo, hi):
                covered[k] += 1
        for i in bucket.param_ids:
            slot = layout.params[i]
            for k in range(slot.start - bucket.start, slot.end - bucket.start):
                covered[k] += 1
        assert covered == [1] * bucket.numel  # every element: one param or padding, once


def _params(numels: list[int]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(n)) for n in numels]


def _lifecycle(numels: list[int], dp_size: int, dp_rank: int) -> tuple[ShardedGrads, list, object]:
    layout = compute_layout(numels, bucket_size=None, dp_size=dp_size, sharded=True)
    params = _params(numels)
    full = allocate_bucket_grads(layout, torch.float32, torch.device("cpu"), params)
    n = full[0].numel() // dp_size
    shard = torch.zeros(n)
    ledger = MemoryLedger()
    grads = ShardedGrads(
        full,
        [(dp_rank * n, (dp_rank + 1) * n)],
        [shard],
        [bucket_padding_ranges(layout, 0)],
        ledger,
        group_id=7,
        rank=3,
    )
    return grads, params, ledger


def test_buckets_start_released_and_main_grad_views_survive_refills() -> None:
    grads, params, ledger = _lifecycle([100, 30, 5], dp_size=2, dp_rank=1)
    full = grads.full[0]
    assert grads.state is GradBucketState.RELEASED
    assert full.untyped_storage().nbytes() == 0
    assert ledger.now("grad_buckets") == 0
    assert ledger.now("grad_shard") == 4 * full.numel() // 2
    views = [p.main_grad for p in params]
    grads.acquire()
    assert full.untyped_storage().nbytes() == 4 * full.numel()
    assert ledger.now("grad_buckets") == 4 * full.numel()
    for p, v in zip(params, views, strict=True):
        assert p.main_grad is v  # created once
        assert v.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        v.fill_(2.0)
    used = sum(p.numel() for p in params)
    assert full.sum().item() == 2.0 * used  # the padding was zeroed at acquire


def test_first_reduction_is_copied_later_ones_added_then_released() -> None:
    grads, _, ledger = _lifecycle([100, 30], dp_size=2, dp_rank=0)
    full, shard = grads.full[0], grads.shards[0]
    shard.fill_(-0.0)
    grads.zero()
    for step, value in enumerate((-0.0, 1.5, 2.0)):
        grads.acquire()
        grads.full[0].fill_(9.0)
        grads.landing[0].fill_(value)  # what the reduce-scatter lands
        assert grads.start(needs_scratch=True)[0] is not None
        assert ledger.now("grad_scratch") == 4 * full.numel()
        grads.finish()
        assert full.untyped_storage().nbytes() == 0
        assert grads.scratch[0].untyped_storage().nbytes() == 0
        if step == 0:  # copied, so -0.0 stays -0.0 (bitwise "optim" at one micro-batch)
            assert torch.equal(
                shard.view(torch.int32), torch.full_like(shard, -0.0).view(torch.int32)
            )
    assert torch.equal(shard, torch.full_like(shard, 3.5))
    assert ledger.now("grad_buckets") == 0 and ledger.now("grad_scratch") == 0
    assert ledger.peak("grad_buckets") == 4 * full.numel()
    grads.zero()
    assert torch.count_nonzero(shard) == 0


@pytest.mark.parametrize(
    ("steps", "states"),
    [
        (["start"], "RELEASED, expected ACCUMULATING"),
        (["finish"], "RELEASED, expected REDUCING"),
        (["acquire", "acquire"], "ACCUMULATING, expected RELEASED"),
        (["acquire", "start", "zero"], "REDUCING, expected RELEASED or ACCUMULATING"),
    ],
)
def test_illegal_transition_names_group_rank_and_states(steps: list[str], states: str) -> None:
    grads, _, _ = _lifecycle([10], dp_size=1, dp_rank=0)
    calls = {
        "acquire": grads.acquire,
        "start": lambda: grads.start(needs_scratch=False),
        "finish": grads.finish,
        "zero": grads.zero,
    }
    with pytest.raises(RuntimeError, match=rf"bucket group 7 grad buckets are {states} \(rank 3\)"):
        for step in steps:
            calls[step]()


def test_zero_and_abandon_release_a_group_that_holds_grads() -> None:
    grads, _, ledger = _lifecycle([10], dp_size=1, dp_rank=0)
    grads.acquire()
    grads.zero()  # e.g. a no_sync backward dropped by zero_grad_buffer()
    assert grads.released and ledger.now("grad_buckets") == 0
    grads.acquire()
    grads.start(needs_scratch=True)
    grads.abandon()  # after an exception mid-reduction
    assert grads.released and ledger.now("grad_buckets") == 0 and ledger.now("grad_scratch") == 0


def test_materialized_holds_storage_only_inside() -> None:
    grads, _, ledger = _lifecycle([10, 20], dp_size=2, dp_rank=0)
    with grads.materialized():
        assert grads.full[0].untyped_storage().nbytes() > 0
        assert grads.full[0][3:5].numel() == 2  # views can be made now
    assert grads.released and ledger.now("grad_buckets") == 0


def test_shards_must_match_the_buckets() -> None:
    layout = compute_layout([10], bucket_size=None, dp_size=2, sharded=True)
    full = allocate_bucket_grads(layout, torch.float32, torch.device("cpu"), _params([10]))
    with pytest.raises(ValueError, match=r"bucket group 4 .rank 1.: grad shards do not match"):
        ShardedGrads(full, [(0, 64)], [torch.zeros(3)], [()], MemoryLedger(), group_id=4, rank=1)


def test_strategies_that_shard_grads() -> None:
    assert [
        s for s in ("no_shard", "optim", "optim_grads", "optim_grads_params") if shards_grads(s)
    ] == [
        "optim_grads",
        "optim_grads_params",
    ]


def test_full_size_error_feedback_is_refused_unless_opted_in() -> None:
    with pytest.raises(
        ValueError, match=r"PowerSGD with error_feedback=True .*=.optim_grads. .rank 5"
    ):
        check_error_feedback(PowerSGD(rank=1), "optim_grads", 5)
    check_error_feedback(PowerSGD(rank=1, error_feedback=False), "optim_grads", 5)
    hook = PowerSGD(rank=1)
    hook.allow_full_size_error_feedback = True
    check_error_feedback(hook, "optim_grads", 5)
    assert error_feedback_nbytes(hook) == 0  # nothing set up yet
    assert error_feedback_nbytes(object()) == 0
