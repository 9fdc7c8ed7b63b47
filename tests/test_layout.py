"""Pure layout math: no process group, no Parameter objects."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megabuf.pure.layout import (
    PARAM_ALIGN_NUMEL,
    compute_layout,
    default_bucket_size,
    shard_pieces,
)


def test_reverse_order_and_bucket_closing() -> None:
    # params registered as a(4) b(3) c(5) d(2); laid out d c b a; buckets close at >= 6
    layout = compute_layout([4, 3, 5, 2], bucket_size=6)
    starts = [slot.start for slot in layout.params]
    assert starts == [10, 7, 2, 0]  # d first
    assert [(b.start, b.end, b.param_ids) for b in layout.buckets] == [
        (0, 7, (3, 2)),  # d(2) + c(5) = 7 >= 6 closes
        (7, 14, (1, 0)),  # b(3) + a(4)
    ]
    assert layout.numel == layout.numel_unpadded == 14
    assert not layout.sharded


def test_boundaries_by_hand() -> None:
    # closes at exactly bucket_size: c(7) + b(7) = 14 >= 14; a(7) alone
    layout = compute_layout([7, 7, 7], bucket_size=14)
    assert [(b.start, b.end, b.param_ids) for b in layout.buckets] == [
        (0, 14, (2, 1)),
        (14, 21, (0,)),
    ]
    # sharded, already aligned: 64-element params need no padding, 128 is a whole bucket
    layout = compute_layout([64, 64], bucket_size=None, dp_size=2, sharded=True)
    assert [(s.start, s.end) for s in layout.params] == [(64, 128), (0, 64)]
    assert layout.numel == 128 and layout.padding_numel == 0
    # one element past 64: the next param starts at 128; the bucket ends at lcm(3, 128) = 384
    layout = compute_layout([1, 65], bucket_size=None, dp_size=3, sharded=True)
    assert [(s.start, s.end) for s in layout.params] == [(128, 129), (0, 65)]
    assert layout.numel == 384
    # dp 3's shards of [0, 384) are 128 each: rank 1's is [128, 256), starting with param 0;
    # rank 2's holds only padding
    pieces = [(p.param_id, p.param_end, p.buffer_start, p.shard_offset)
              for p in shard_pieces(layout, 1, 3)]  # fmt: skip
    assert pieces == [(0, 1, 128, 0)]
    assert shard_pieces(layout, 2, 3) == ()


def test_one_bucket_when_bucket_size_none() -> None:
    layout = compute_layout([10, 20, 30], bucket_size=None)
    assert len(layout.buckets) == 1 and layout.buckets[0].numel == 60


def test_sharded_padding_rules() -> None:
    layout = compute_layout([3, 70, 5], bucket_size=None, dp_size=3, sharded=True)
    assert all(slot.start % PARAM_ALIGN_NUMEL == 0 for slot in layout.params)
    (bucket,) = layout.buckets
    assert bucket.numel % math.lcm(3, 128) == 0
    assert layout.numel_unpadded == 78 and layout.padding_numel == layout.numel - 78


def test_high_busbw_padding() -> None:
    layout = compute_layout([1000], bucket_size=None, dp_size=8, sharded=True, high_nccl_busbw=True)
    assert layout.numel % 2**16 == 0


def test_own_bucket_param_is_alone() -> None:
    layout = compute_layout([4, 4, 4], bucket_size=None, own_bucket=[True, False, False])
    assert [b.param_ids for b in layout.buckets] == [(2, 1), (0,)]


def test_default_bucket_size_capped_at_quarter_of_largest_buffer() -> None:
    assert default_bucket_size(2, 1000) == 250
    assert default_bucket_size(2, 10**9) == 40_000_000
    assert default_bucket_size(64, 10**10) == 64_000_000


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="bucket_size"):
        compute_layout([4], bucket_size=0)
    with pytest.raises(ValueError, match="positions \\[1\\]"):
        compute_layout([4, 0], bucket_size=None)
    with pytest.raises(ValueError, match="dp_size"):
        compute_layout([4], bucket_size=None, dp_size=0)


numels_st = st.lists(st.integers(1, 300), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(
    numels=numels_st,
    bucket_size=st.one_of(st.none(), st.integers(1, 700)),
    dp_size=st.integers(1, 8),
    sharded=st.booleans(),
    data=st.data(),
)
def test_layout_properties(
    numels: list[int], bucket_size: int | None, dp_size: int, sharded: bool, data: st.DataObject
) -> None:
    own = data.draw(st.lists(st.booleans(), min_size=len(numels), max_size=len(numels)))
    layout = compute_layout(
        numels, bucket_size=bucket_size, dp_size=dp_size, sharded=sharded, own_bucket=own
    )
    # buckets tile the buffer exactly, in order
    assert layout.buckets[0].start == 0 and layout.buckets[-1].end == layout.numel
    for a, b in zip(layout.buckets, layout.buckets[1:]):
        assert a.end == b.start
    # params never overlap, each lies inside its bucket, sizes preserved
    spans = sorted((s.start, s.end) for s in layout.params)
    for (_, e1), (s2, _) in itertools.pairwise(spans):
        assert e1 <= s2
    for pid, slot in enumerate(layout.params):
        bucket = layout.buckets[slot.bucket_id]
        assert bucket.start <= slot.start < slot.end <= bucket.end
        assert slot.numel == numels[pid] and pid in bucket.param_ids
    # reverse registration order
    order = sorted(range(len(numels)), key=lambda i: layout.params[i].start)
    assert order == list(reversed(range(len(numels))))
    assert layout.numel_unpadded == sum(numels)
    if not sharded:
        assert layout.numel == sum(numels)
        return
    # sharded: every element owned by exactly one rank's shard; pieces cover every param once
    owners = [0] * layout.numel
    covered = [0] * len(numels)
    for rank in range(dp_size):
        for bucket in layout.buckets:
            lo, hi = bucket.shard_range(rank, dp_size)
            for i in range(lo, hi):
                owners[i] += 1
        for piece in shard_pieces(layout, rank, dp_size):
            covered[piece.param_id] += piece.numel
            slot = layout.params[piece.param_id]
            assert piece.buffer_start == slot.start + piece.param_start
    assert all(o == 1 for o in owners)
    assert covered == numels
