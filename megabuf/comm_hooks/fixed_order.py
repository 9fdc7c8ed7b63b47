"""The fixed-order fp32 sum of a bucket, and the `Deterministic` hook built on it.

[Note: deterministic reduction]
With `DistributedDataParallelConfig(deterministic_reduction=True)` every bucket (dense and
expert, all-reduce and reduce-scatter mode) is reduced by `fixed_order_sum`: an all-to-all of
`wire_dtype` chunks of the pre-scaled bucket, then, for each element of this rank's chunk, the
sum over the group in fp32 in group-rank order (((v0 + v1) + v2) + ...), divided by the group
size under average_in_collective, rounded once to the grad dtype; in all-reduce mode the result
is cast to `wire_dtype` and all-gathered. Each v_r is rank r's pre-scaled grad in the grad dtype
(an elementwise product, [Note: comm hook contract] step 2) and every later step is elementwise,
so each element's result depends only on the values the ranks hold for it: not on bucket
boundaries, bucket-group composition, overlap_grad_reduce, the dispatch time, or the backend's
algorithm (all-to-all and all-gather only move bytes). Ring or tree all-reduces and NCCL's
reduce-scatter sum in an order set by the element's position in the message and the topology.
The mode costs the bytes of the grad dtype's ring all-reduce (reduce-scatter: the same bytes as
a ring reduce-scatter) but the sum is a separate local pass after the transfer, not pipelined
into it. The optimizers' grad norm, whose shard pieces move with the bucket size under the
distributed optimizer, is summed exactly under the mode ([Note: exact grad norm]), so clipped
steps are bitwise too. Not covered: what the user's own code does with the grads (another
reduction of them in float, e.g. its own norm) and anything before the reduction (a
nondeterministic kernel in forward or backward changes the inputs of the sum).
A hook may stand in for `Deterministic` under the mode only if it declares `deterministic =
True` (`Compress(accumulate="fp32")` does: the same sum of low-precision chunks).

[Note: deterministic reduction under hybrid]
Under a hybrid split (R replicas x S shard ranks, dp_rank = replicate_rank * S + shard_rank:
[Note: hybrid rank order] in megabuf/pure/hybrid.py) the mode's hook runs on both levels ([Note:
comm hooks under hybrid] in megabuf/sharding/replica_hooks.py), so the sum is defined
hierarchically: with v_{r,s} the pre-scaled grad of the rank at replicate rank r, shard rank s,
    x_r    = round_g( fp32 sum over s = 0..S-1 in shard-rank order of v_{r,s} [/ S] )
    result = round_g( fp32 sum over r = 0..R-1 in replicate-rank order of x_r [/ R] )
(round_g: one rounding to the grad dtype; [/ k] under average_in_collective). With micro-batches
under "reduce_each_microbatch" each micro-batch's x_r is added into the grad shard (grad dtype,
micro-batch order) before the second level. Every term is elementwise in a fixed order, so the
result is reproducible bitwise run to run and independent of bucket size, overlap and timing,
like the flat mode; it is NOT bitwise the flat rank-order sum ((v_0 + v_1) + v_2) + ... over dp
(fp32 grads at 2 x 2: (v_0 + v_1) + (v_2 + v_3)), and it changes when R x S changes. An exact
flat order would need each replica to pass an fp32 running sum to the next, R - 1 sequential
inter-node hops (and fp32 partial sums: twice a bf16 grad's wire bytes), against one all-to-all
and one all-gather per level here.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from megabuf.comm_hooks.contract import MODES, CommHookError, GradBucket, hook_name
from megabuf.transport.collectives import sum_chunks


class DeterministicReductionError(CommHookError, ValueError):
    """A comm hook that does not declare `deterministic = True` under deterministic_reduction."""


def fixed_order_sum(bucket: GradBucket, wire_dtype: torch.dtype) -> Generator[Any, Any, None]:
    """Reduce `bucket` by [Note: deterministic reduction] with `wire_dtype` on the wire: one
    stage (all-to-all) in reduce-scatter mode, two (then all-gather) in all-reduce mode. An
    all-reduce bucket is not padded for the group, so its wire copy is (zero-padded to a
    multiple of group_size); a reduce-scatter bucket already in `wire_dtype` is sent as is."""
    coll, group, size = bucket.collectives, bucket.group, bucket.group_size
    data, numel = bucket.data, bucket.data.numel()
    padded = -(-numel // size) * size  # == numel in reduce-scatter mode
    if bucket.shard is not None and data.dtype == wire_dtype:
        wire = data
    else:
        wire = bucket.workspace(wire_dtype, "wire", padded)
        wire[:numel].copy_(data)
        wire[numel:].zero_()
    received = bucket.workspace(wire_dtype, "scratch", padded)
    yield coll.all_to_all(received, wire, group)
    total = bucket.shard
    if total is None or total.dtype != torch.float32:
        total = bucket.workspace(torch.float32, "sum", padded // size)
    sum_chunks(received, total)  # fp32, group-rank order
    if bucket.average:
        total.div_(size)
    if bucket.shard is not None:
        if total is not bucket.shard:
            bucket.shard.copy_(total)  # the one rounding to the grad dtype
        return
    lo = bucket.group_rank * total.numel()
    mine = wire[lo : lo + total.numel()]
    mine.copy_(total)  # rounded once to wire_dtype
    yield coll.all_gather(wire, mine, group)
    data.copy_(wire[:numel])


class Deterministic:
    """Reduce every bucket by a fixed-order fp32 sum of the grad-dtype values ([Note:
    deterministic reduction]): bitwise the same grads across bucket sizes, overlap on/off and
    repeated runs, on any backend. Installed by the engine under
    `deterministic_reduction=True`; registering it by hand does the same for the chosen
    buffers. Memory, per bucket and persistent: a landing zone of the bucket's size; in
    all-reduce mode also a padded copy; an fp32 shard in all-reduce mode or where the grads
    are not fp32. Wire: the grad dtype's ring all-reduce (reduce-scatter) bytes."""

    name = "Deterministic"
    modes = MODES
    deterministic = True
    two_level = True  # hierarchical under hybrid: [Note: deterministic reduction under hybrid]

    def __call__(self, bucket: GradBucket) -> Generator[Any, Any, None]:
        return fixed_order_sum(bucket, bucket.data.dtype)


def require_deterministic(hook: object, rank: int) -> None:
    """Raise `DeterministicReductionError` unless `hook` declares `deterministic = True`."""
    if getattr(hook, "deterministic", False) is not True:
        raise DeterministicReductionError(
            f"megabuf: comm hook {hook_name(hook)} together with "
            "DistributedDataParallelConfig.deterministic_reduction=True (rank "
            f"{rank}): the hook does not declare `deterministic = True`, so the mode could not "
            "keep its promise. Drop the hook (the mode installs megabuf.comm_hooks."
            "Deterministic), use a deterministic one (Compress(accumulate='fp32')), or turn "
            "deterministic_reduction off"
        )
