"""`ParamGather`: a bucket group's param lifecycle (distributed optimizer only), a part the
group owns:

    VALID --mark_stale--> STALE --start--> DISPATCHED --finish--> VALID

The all-gather of each bucket's param shards into its full `param_data`, async when
overlap_param_gather, and the prefetch of the next group's gather ([Note: who waits for param
gathers] in ddp.py, [Note: gathers outlive a dropped group] in dispatch.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.buckets.buffer import _ParamAndGradBucket
from megabuf.buckets.dispatch import ParamSyncState, SyncWork, expect_state, wait_dropped
from megabuf.transport.collectives import Collectives


class ParamGather:
    """One bucket group's param gathers; `local_shard` cuts this rank's shard of a bucket."""

    def __init__(
        self,
        buckets: Sequence[_ParamAndGradBucket],
        collectives: Collectives,
        group: ProcessGroup | None,
        local_shard: Callable[[Tensor], Tensor],
        *,
        overlap: bool,  # overlap_param_gather
        group_id: int,
        rank: int,
    ) -> None:
        self.buckets = list(buckets)
        self.collectives = collectives
        self.group = group
        self.local_shard = local_shard
        self.overlap = overlap
        self.group_id = group_id
        self.rank = rank
        self.state = ParamSyncState.VALID
        self.work: SyncWork | None = None
        self.next: ParamGather | None = None  # prefetched by `finish` (learned forward order)

    def expect(self, *states: ParamSyncState) -> None:
        hint = "finish in-flight param gathers (model.publish_params()) before changing params"
        expect_state(self.state, states, "param sync", self.group_id, self.rank, hint)

    def mark_stale(self) -> None:
        """The optimizer updated this rank's shards; other ranks' shards must be gathered."""
        self.expect(ParamSyncState.VALID)
        self.state = ParamSyncState.STALE

    def start(self, force_sync: bool = False) -> None:
        """All-gather each bucket's param shards; async when overlap_param_gather. Without
        `force_sync` nothing is done when params are valid or their gather is in flight. With
        `force_sync` the params hold the gathered values on return, from any state: a stale
        group gathers synchronously and a gather in flight is waited for ([Note: who waits for
        param gathers] in ddp.py)."""
        if force_sync and self.state is ParamSyncState.DISPATCHED:
            self.finish(skip_next=True)
            return
        if self.state is not ParamSyncState.STALE:
            return
        async_op = self.overlap and not force_sync
        params = [b.param_data for b in self.buckets]
        if any(p is None for p in params):
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} has no param_data to gather into: param "
                "sync needs a strategy that shards the optimizer (use_distributed_optimizer=True)"
            )
        full = [p for p in params if p is not None]
        pending = self.collectives.all_gather_many(
            full, [self.local_shard(p) for p in full], self.group,
            async_op=async_op, tag=self.group_id,
        )  # fmt: skip
        self.work = SyncWork(pending)
        self.state = ParamSyncState.DISPATCHED
        if not async_op:
            self.finish(skip_next=True)
            return
        # [Note: gathers outlive a dropped group]: waited for when the record is dropped
        weakref.finalize(self.work, wait_dropped, pending, self.rank)

    def finish(self, skip_next: bool = False) -> None:
        """Make params valid (dispatching the gather if nobody has), then prefetch the next
        group's gather so it overlaps with this group's forward compute."""
        if self.state is ParamSyncState.STALE:
            self.start()
        if self.state is ParamSyncState.DISPATCHED:
            if self.work is None:
                raise RuntimeError(f"megabuf: bucket group {self.group_id} has no gather work")
            self.work.wait()
            self.work = None
        self.state = ParamSyncState.VALID
        if not skip_next and self.next is not None:
            self.next.start()
