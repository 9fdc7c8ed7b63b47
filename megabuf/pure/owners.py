"""Whole-param owners for matrix optimizers (Muon and kin): pure layout math.

Sees shapes, numels and dp_size; never a process group or a Parameter. Returns frozen records.

[Note: whole-param owners]
A matrix optimizer (`torch.optim.Muon`: Newton-Schulz on the whole 2-D momentum) needs the
whole matrix of a param on one rank, which element shards ([Note: buffer layout]) never give.
With `DistributedDataParallelConfig(whole_param_owners=True)` each param is owned whole by one
dp rank, and the sharded machinery is otherwise untouched:
- Owners: bucket by bucket (the buckets of the plain sharded layout, so bucket membership and the
  overlap with backward are unchanged), each bucket's params in decreasing cost, each going to
  the rank where the larger of two loads stays smallest (params taken in decreasing larger share
  of the two): its cost so far over the mean cost per
  rank, and its elements in this bucket over the bucket's mean per rank (ties: the lesser cost,
  then the lower rank). Balancing cost alone would leave one rank's shard of a bucket much
  larger than the others', and every shard is padded to the largest. Cost (`owner_cost`) is one
  Newton-Schulz iteration on an m x n matrix, m*n*min(m, n) multiply-adds, plus the numel (the
  bytes of state and grad it brings, in elements); 1-D and other params, and embedding weights
  (AdamW's in the usual recipe: `ParamSpec.shape` is None), cost their numel. Bound (checked
  by `tests/test_owners.py`): the rank with the least sum of the two normalised loads always
  qualifies, and those sums total at most 2 per rank on average, so the largest cost load is at
  most 2 x the mean + the largest single cost, and a bucket's largest shard holds at most 2 x its
  mean + its largest param (in practice both ratios stay near 1: BENCHMARKS.md). The cost load
  continues over the buffers of one reduction group.
- Shards: within a bucket, rank r's shard holds exactly the params rank r owns (in buffer order,
  each starting at a multiple of PARAM_ALIGN_NUMEL); every shard of the bucket has the size of
  the largest, rounded up to OWNER_SHARD_ALIGN_NUMEL (2**16 for high NCCL bus bandwidth), so the
  bucket still splits into dp_size equal shards and the existing reduce-scatter leaves each
  param's full reduced grad on its owner, and the existing all-gather brings the updated param
  from its owner to every rank (overlapped as before). The price is padding: a bucket's
  unevenness in elements is sent and stored. A param larger than a bucket's mean share forces
  it, so the default bucket size under owners is at least dp_size x the largest param
  (`megabuf.planning.plan.resolve_bucket_size`); an explicit `bucket_size` is kept.
- Every rank computes the same table from the same plan; the distributed optimizer compares the
  tables across dp ranks at construction (an owner chosen differently on two ranks would send a
  param's grad to one rank and expect it on another) and raises naming the param.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megabuf.pure.layout import PARAM_ALIGN_NUMEL, BucketSlot, BufferLayout, ParamSlot

OWNER_SHARD_ALIGN_NUMEL = 128
HIGH_BUSBW_SHARD_ALIGN_NUMEL = 2**16


def owner_cost(shape: Sequence[int]) -> int:
    """Cost of owning a param of `shape`: see [Note: whole-param owners]."""
    numel = math.prod(shape)
    if len(shape) == 2:
        m, n = shape
        return m * n * min(m, n) + numel
    return numel


@dataclass(frozen=True)
class OwnerBalance:
    """Load of every rank after an owner assignment (cost units of `owner_cost`)."""

    loads: tuple[int, ...]

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0


def assign_owners(
    bucket_costs: Sequence[Sequence[int]],
    dp_size: int,
    start_loads: Sequence[int] | None = None,
    bucket_numels: Sequence[Sequence[int]] | None = None,
) -> tuple[tuple[tuple[int, ...], ...], OwnerBalance]:
    """Owner rank of every param of every bucket (same order as `bucket_costs`) and the loads;
    see [Note: whole-param owners]. `start_loads` carries loads from earlier buffers;
    `bucket_numels` (default: the costs) are what each bucket's shards must hold."""
    if dp_size < 1:
        raise ValueError(f"megabuf: dp_size must be >= 1, got {dp_size}")
    loads = list(start_loads) if start_loads is not None else [0] * dp_size
    if len(loads) != dp_size:
        raise ValueError(f"megabuf: start_loads has {len(loads)} entries for dp_size={dp_size}")
    numels = bucket_numels if bucket_numels is not None else bucket_costs
    cost_mean = max(1, sum(loads) + sum(sum(c) for c in bucket_costs)) / dp_size
    owners: list[tuple[int, ...]] = []
    for costs, sizes in zip(bucket_costs, numels, strict=True):
        mine = [0] * len(costs)
        held = [0] * dp_size  # elements of this bucket per rank
        numel_mean = max(1, sum(sizes)) / dp_size

        def weight(
            i: int, c: Sequence[int] = costs, n: Sequence[int] = sizes, m: float = numel_mean
        ) -> float:
            return max(c[i] / cost_mean, n[i] / m)

        for i in sorted(range(len(costs)), key=lambda i: (-weight(i), i)):
            rank = _best_rank(loads, held, costs[i] / cost_mean, sizes[i] / numel_mean,
                              cost_mean, numel_mean)  # fmt: skip
            mine[i] = rank
            loads[rank] += costs[i]
            held[rank] += sizes[i]
        owners.append(tuple(mine))
    return tuple(owners), OwnerBalance(tuple(loads))


def _best_rank(
    loads: Sequence[int],
    held: Sequence[int],
    cost: float,
    size: float,
    cost_mean: float,
    numel_mean: float,
) -> int:
    """The rank where the larger normalised load after adding (cost, size) is least; ties: the
    lesser cost load, then the lower rank ([Note: whole-param owners])."""

    def after(r: int) -> tuple[float, int, int]:
        worst = max(loads[r] / cost_mean + cost, held[r] / numel_mean + size)
        return worst, loads[r], r

    return min(range(len(loads)), key=after)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def owner_aligned_layout(
    base: BufferLayout,
    numels: Sequence[int],
    owner_of: Sequence[int],
    dp_size: int,
    *,
    high_nccl_busbw: bool = False,
) -> BufferLayout:
    """`base` (a sharded layout: its buckets and their members) re-laid so that shard r of
    every bucket holds exactly the params with `owner_of[pid] == r`, whole; see
    [Note: whole-param owners]. `numels`/`owner_of` index the caller's params like `base`."""
    if len(numels) != len(base.params) or len(owner_of) != len(base.params):
        raise ValueError(
            f"megabuf: owner_aligned_layout got {len(numels)} numels and {len(owner_of)} owners "
            f"for {len(base.params)} params"
        )
    bad = [pid for pid, r in enumerate(owner_of) if not 0 <= r < dp_size]
    if bad:
        raise ValueError(f"megabuf: params {bad[:10]} have owners outside [0, {dp_size})")
    align = HIGH_BUSBW_SHARD_ALIGN_NUMEL if high_nccl_busbw else OWNER_SHARD_ALIGN_NUMEL
    slots: dict[int, ParamSlot] = {}
    buckets: list[BucketSlot] = []
    start = 0
    for bucket in base.buckets:
        by_rank = [[p for p in bucket.param_ids if owner_of[p] == r] for r in range(dp_size)]
        offsets = [_packed(pids, numels) for pids in by_rank]
        shard = _round_up(max((end for _, end in offsets), default=0), align)
        for rank, (local, _) in enumerate(offsets):
            for pid, lo in local.items():
                base_at = start + rank * shard + lo
                slots[pid] = ParamSlot(base_at, base_at + numels[pid], bucket.bucket_id)
        members = tuple(p for pids in by_rank for p in pids)
        end = start + shard * dp_size
        payload = sum(numels[p] for p in members)
        buckets.append(BucketSlot(bucket.bucket_id, start, end, payload, members))
        start = end
    params = tuple(slots[pid] for pid in range(len(numels)))
    return BufferLayout(params, tuple(buckets), start, sum(numels), True, tuple(owner_of))


def _packed(pids: Sequence[int], numels: Sequence[int]) -> tuple[dict[int, int], int]:
    """Offsets of `pids` packed in order, each aligned to PARAM_ALIGN_NUMEL, and the end."""
    out: dict[int, int] = {}
    cursor = 0
    for pid in pids:
        out[pid] = _round_up(cursor, PARAM_ALIGN_NUMEL)
        cursor = out[pid] + numels[pid]
    return out, cursor
