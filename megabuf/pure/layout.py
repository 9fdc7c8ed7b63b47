"""Pure layout math: where every param and bucket lives inside a contiguous buffer.

Sees only numels, bucket sizes and dp_size; never a process group or a Parameter. Every function
returns frozen dataclasses so a layout can be printed, compared and unit-tested without processes.

[Note: buffer layout]
- Params are laid out in *reverse* of the order given (registration order), because backward
  produces grads roughly last-layer-first; bucket 0 therefore fills first during backward.
- A param is never split across buckets. A bucket is closed right after the param that brings it
  to >= bucket_size elements (or after a param that asked for a bucket of its own).
- Sharded layout (distributed optimizer): each param starts at a multiple of PARAM_ALIGN_NUMEL and
  each bucket's end is padded to a multiple of lcm(dp_size, 128) (and 2**16 for high NCCL bus
  bandwidth), so every bucket splits into dp_size equal contiguous shards; shard r of a bucket is
  owned by dp rank r. Unsharded layout: no padding at all.
- `numel_unpadded` always means the sum of param numels (payload); padding = numel - that.
- Unit-aligned layout (`unit_ids`, ZeRO-3, [Note: shard units] in megabuf/sharding/units.py):
  each unit's params are placed together, units in reverse order of their last-registered param
  and each unit's params in reverse registration order (with units already contiguous in
  registration order this is exactly the plain reverse order); a bucket is also closed before a
  param of another unit, so no bucket spans two units, and a large unit takes several buckets.
- Explicit boundaries (`bucket_ends`, chosen by `bucket_size = "auto"`, [Note: auto bucket plan]
  in megabuf/pure/bucket_planner.py): instead of a size, the placement positions after which a
  bucket closes; the rules above (own bucket, unit change, padding) still close buckets too. Without
  padding (unsharded) params sit at the same offsets whatever the boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PARAM_ALIGN_NUMEL = 64
BUCKET_ALIGN_NUMEL = 128
HIGH_BUSBW_ALIGN_NUMEL = 2**16
DEFAULT_MIN_BUCKET_NUMEL = 40_000_000
DEFAULT_BUCKET_NUMEL_PER_DP_RANK = 1_000_000


@dataclass(frozen=True)
class ParamSlot:
    """Where one param lives: elements [start, end) of the buffer, inside bucket `bucket_id`."""

    start: int
    end: int
    bucket_id: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BucketSlot:
    """Elements [start, end) of the buffer; `param_ids` index the caller's param list."""

    bucket_id: int
    start: int
    end: int
    numel_unpadded: int
    param_ids: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """Buffer range [start, end) of dp_rank's shard of this bucket."""
        if self.numel % dp_size != 0:
            raise ValueError(
                f"megabuf: bucket {self.bucket_id} has {self.numel} elements, not divisible by "
                f"dp_size={dp_size}; it was not laid out for sharding"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"megabuf: dp_rank={dp_rank} outside [0, {dp_size})")
        shard = self.numel // dp_size
        return self.start + dp_rank * shard, self.start + (dp_rank + 1) * shard


@dataclass(frozen=True)
class BufferLayout:
    """The whole buffer: `params[i]` is the slot of the caller's i-th param."""

    params: tuple[ParamSlot, ...]
    buckets: tuple[BucketSlot, ...]
    numel: int
    numel_unpadded: int
    sharded: bool
    owner_of: tuple[int, ...] | None = None
    """Whole-param owners: the dp rank owning each param whole ([Note: whole-param owners]
    in megabuf/pure/owners.py); None for element shards."""

    @property
    def padding_numel(self) -> int:
        return self.numel - self.numel_unpadded


@dataclass(frozen=True)
class ShardPiece:
    """The part of param `param_id` inside one rank's shard.

    `param_start:param_end` index the flattened param; `buffer_start` is where that piece sits
    in the buffer; `shard_offset` is where it sits inside the rank's concatenated shards.
    """

    param_id: int
    bucket_id: int
    param_start: int
    param_end: int
    buffer_start: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


def bucket_pad_multiple(dp_size: int, high_nccl_busbw: bool) -> int:
    """Multiple every sharded bucket's numel is padded to."""
    multiple = math.lcm(dp_size, BUCKET_ALIGN_NUMEL)
    return math.lcm(multiple, HIGH_BUSBW_ALIGN_NUMEL) if high_nccl_busbw else multiple


def default_bucket_size(dp_size: int, largest_buffer_numel: int) -> int:
    """Megatron's overlap default, capped at a quarter of the largest buffer (>= 1 element)."""
    megatron = max(DEFAULT_MIN_BUCKET_NUMEL, DEFAULT_BUCKET_NUMEL_PER_DP_RANK * dp_size)
    return max(1, min(megatron, math.ceil(largest_buffer_numel / 4)))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def compute_layout(
    numels: Sequence[int],
    *,
    bucket_size: int | None,
    dp_size: int = 1,
    sharded: bool = False,
    high_nccl_busbw: bool = False,
    own_bucket: Sequence[bool] | None = None,
    unit_ids: Sequence[int] | None = None,
    bucket_ends: Sequence[int] | None = None,
) -> BufferLayout:
    """Lay out params (given in registration order) into one buffer; see [Note: buffer layout].

    bucket_size None means one bucket for the whole buffer (apart from `own_bucket` params), or
    with `unit_ids` (the shard unit of each param) one bucket per unit. `bucket_ends` (with
    bucket_size None): close a bucket after these many params in placement order.
    """
    _check_layout_args(numels, bucket_size, dp_size, own_bucket)
    _check_unit_ids(unit_ids, len(numels))
    ends = _check_bucket_ends(bucket_ends, bucket_size, len(numels))
    own = own_bucket if own_bucket is not None else [False] * len(numels)
    pad_multiple = bucket_pad_multiple(dp_size, high_nccl_busbw) if sharded else 1
    slots: dict[int, ParamSlot] = {}
    buckets: list[BucketSlot] = []
    members: list[int] = []
    bucket_start, cursor, payload = 0, 0, 0

    def close_bucket() -> None:
        nonlocal bucket_start, cursor, members, payload
        end = _round_up(cursor, pad_multiple)
        buckets.append(BucketSlot(len(buckets), bucket_start, end, payload, tuple(members)))
        bucket_start, cursor, members, payload = end, end, [], 0

    for position, pid in enumerate(placement_order(len(numels), unit_ids), start=1):
        new_unit = unit_ids is not None and members and unit_ids[pid] != unit_ids[members[0]]
        if members and (own[pid] or new_unit):
            close_bucket()  # a param with its own bucket, or of another unit, starts a fresh one
        start = _round_up(cursor, PARAM_ALIGN_NUMEL) if sharded else cursor
        cursor = start + numels[pid]
        slots[pid] = ParamSlot(start, cursor, len(buckets))
        members.append(pid)
        payload += numels[pid]
        full = bucket_size is not None and cursor - bucket_start >= bucket_size
        if full or own[pid] or position in ends:
            close_bucket()
    if members or not buckets:
        close_bucket()
    params = tuple(slots[pid] for pid in range(len(numels)))
    return BufferLayout(params, tuple(buckets), bucket_start, sum(numels), sharded)


def _check_layout_args(
    numels: Sequence[int],
    bucket_size: int | None,
    dp_size: int,
    own_bucket: Sequence[bool] | None,
) -> None:
    if dp_size < 1:
        raise ValueError(f"megabuf: dp_size must be >= 1, got {dp_size}")
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"megabuf: bucket_size must be > 0 elements or None, got {bucket_size}")
    bad = [i for i, n in enumerate(numels) if n <= 0]
    if bad:
        raise ValueError(f"megabuf: params at positions {bad} have no elements; drop them")
    if own_bucket is not None and len(own_bucket) != len(numels):
        raise ValueError(
            f"megabuf: own_bucket has {len(own_bucket)} entries for {len(numels)} params"
        )


def _check_unit_ids(unit_ids: Sequence[int] | None, n_params: int) -> None:
    if unit_ids is not None and len(unit_ids) != n_params:
        raise ValueError(f"megabuf: unit_ids has {len(unit_ids)} entries for {n_params} params")


def _check_bucket_ends(
    bucket_ends: Sequence[int] | None, bucket_size: int | None, n_params: int
) -> frozenset[int]:
    if bucket_ends is None:
        return frozenset()
    if bucket_size is not None:
        raise ValueError("megabuf: give a layout bucket_size or bucket_ends, not both")
    ends = list(bucket_ends)
    if any(isinstance(e, bool) or not isinstance(e, int) or not 0 < e <= n_params for e in ends):
        raise ValueError(
            f"megabuf: bucket_ends {ends} must be param counts in (0, {n_params}] (placement order)"
        )
    return frozenset(ends)


def placement_order(n_params: int, unit_ids: Sequence[int] | None) -> list[int]:
    """Param ids in buffer order: reverse registration order, each unit's params kept together
    (a unit is placed where its last-registered param would be); see [Note: buffer layout]."""
    if unit_ids is None:
        return list(reversed(range(n_params)))
    by_unit: dict[int, list[int]] = {}
    for pid in reversed(range(n_params)):
        by_unit.setdefault(unit_ids[pid], []).append(pid)
    return [pid for pids in by_unit.values() for pid in pids]


def shard_pieces(layout: BufferLayout, dp_rank: int, dp_size: int) -> tuple[ShardPiece, ...]:
    """Every (param, shard) intersection owned by dp_rank, in buffer order."""
    pieces: list[ShardPiece] = []
    shard_offset = 0
    for bucket in layout.buckets:
        lo, hi = bucket.shard_range(dp_rank, dp_size)
        for pid in bucket.param_ids:  # already in buffer order
            slot = layout.params[pid]
            start, end = max(slot.start, lo), min(slot.end, hi)
            if start < end:
                pieces.append(
                    ShardPiece(
                        pid,
                        bucket.bucket_id,
                        start - slot.start,
                        end - slot.start,
                        start,
                        shard_offset + start - lo,
                    )
                )
        shard_offset += hi - lo
    return tuple(pieces)
