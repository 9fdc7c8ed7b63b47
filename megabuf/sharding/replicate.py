"""The second level of a hybrid reduction: one bucket group's shards all-reduced across replicas.

[Note: two-level reduction]
Under a hybrid split ([Note: hybrid rank order] in megabuf/pure/hybrid.py) a bucket group reduces in
two levels: the reduce-scatter of each bucket inside the shard group (the bucket group's
`collective_group`, as flat), then an all-reduce of this rank's reduced shard across the
replicate group: the bucket's local shard of `grad_data` under "optim", the persistent
`grad_shard` under "optim_grads*" (after the reduce-scatter's result was copied or added into
it, so micro-batches reduced one by one are summed before anything crosses replicas). The wire
bytes are the flat strategy's reduce-scatter over S ranks plus a ring all-reduce of 1/S of the
bucket over R ranks: (S-1)/S + 2(R-1)/(R S) of a bucket per rank, of which only the second term
crosses the replicate (inter-node) links, against (RS-1)/(RS) for the flat reduce-scatter over
all of dp, most of which crosses them. (A reduce-scatter over R of the shard followed by an
all-gather moves the same bytes; the all-reduce is one collective and keeps every replica's
shard whole.)
- Once per step: the all-reduce runs only for a reduction that is the step's last micro-batch
  (`final`, set by the grad sync: require_sync, or an explicit finish_grad_sync()); under
  no_sync() with "accumulate_unsharded" nothing is reduced at all, with
  "reduce_each_microbatch" only inside the shard group.
- Order: the all-reduces of one dispatch chain are issued in chain order on every rank (the
  chain's `start_replicas_upto` / `progress_replicas`; [Note: dispatch order]), whatever order
  the reduce-scatters complete in, so the replicate communicator pairs the right shards; they
  overlap backward as soon as the head of the chain's reduce-scatter has landed.
- Scaling: the grads carry the flat factor (1/dp, or an AVG at each level with
  average_in_collective), so the two levels together are the flat mean.
- A registered comm hook runs on both levels, the second on a view of the reduced shard
  ([Note: comm hooks under hybrid] in megabuf/sharding/replica_hooks.py).
Flat groups have no second level: only under a hybrid split is their reduction wrapped in
the two-level one (`TwoLevel`, `reduction_for` in megabuf/buckets/reductions.py), which owns a
`ReplicaStage`; a stage without a replicate group is armed never and does nothing. Who carries
the all-reduce across replicas is the stage's `CrossReplica` ([Note: cross-replica level] in
megabuf/transport/cross_replica.py): the replicate group, or torchft's Manager.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from megabuf.comm_hooks.contract import GradBucket, HookWork, Waitable, hook_name
from megabuf.sharding.replica_hooks import check_two_level, replica_views
from megabuf.transport.collectives import Collectives
from megabuf.transport.cross_replica import CrossReplica, Handle


class ReplicaStage:
    """One bucket group's all-reduce across the replicate group; see [Note: two-level
    reduction]. `owed`: the group's first level was dispatched for a final micro-batch and its
    all-reduce is not issued yet."""

    def __init__(
        self,
        across: CrossReplica | None,
        collectives: Collectives,
        *,
        average: bool,
        group_id: int,
        rank: int,
    ) -> None:
        self.across = across  # None: flat, nothing to do ([Note: cross-replica level])
        self.collectives = collectives
        self.average = average
        self.group_id = group_id
        self.rank = rank
        self.owed = False
        self.crossed = False  # issued since the step began (reset by `new_step`)
        self._work: list[Waitable | Handle] = []  # the all-reduces, or the hook's works
        self.hook: object | None = None  # [Note: comm hooks under hybrid]
        self.hook_buckets: list[GradBucket] = []  # one per bucket: views of the reduced shards
        self.timeout_s: float | None = None

    def set_hook(
        self, hook: object, first_level: Sequence[GradBucket], shards: Sequence[Tensor],
        timeout_s: float | None,
    ) -> None:  # fmt: skip
        """Reduce with `hook` too ([Note: comm hooks under hybrid]); `shards` are the tensors
        `start` is given, each this rank's reduced shard of a bucket. A no-op when flat."""
        if self.across is None:
            return
        group = self.across.hook_group(hook_name(hook), group_id=self.group_id, rank=self.rank)
        check_two_level(hook, group_id=self.group_id, rank=self.rank)
        self.hook_buckets = replica_views(first_level, shards, group, self.collectives)
        self.hook, self.timeout_s = hook, timeout_s

    @property
    def active(self) -> bool:
        return self.across is not None

    def arm(self, final: bool) -> None:
        """The first level was dispatched: owe the all-reduce if this is the step's last
        micro-batch (and it has not crossed yet this step)."""
        if self._work:
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} (rank {self.rank}) was dispatched again "
                "while its replicate all-reduce is in flight ([Note: two-level reduction])"
            )
        self.owed = self.across is not None and final and not self.crossed

    def owe_at_sync(self) -> None:
        """The grad sync ends the step: a first level that ran as a non-final micro-batch (its
        reduction landed, or is in flight, before the sync knew it was the last) owes the
        all-reduce now."""
        if self.across is not None and not self.crossed:
            self.owed = True

    def new_step(self) -> None:
        self.owed = False
        self.crossed = False

    def start(self, shards: Sequence[Tensor]) -> None:
        """Issue the all-reduce of `shards` (this rank's reduced shards) across replicas."""
        if not self.owed:
            return
        self.owed = False
        self.crossed = True
        if self.hook is not None:  # every stage now: [Note: comm hooks under hybrid]
            self._work = [HookWork(self.hook, b, self.timeout_s) for b in self.hook_buckets]
            self.wait()
            return
        if self.across is not None:  # always, when owed
            self._work = list(
                self.across.start(shards, self.collectives, average=self.average,)
            )  # fmt: skip

    def completed(self) -> bool:
        """Nothing owed and the issued all-reduce (if any) has landed; never waits."""
        if self.owed:
            return False
        return all(
            hasattr(h, "is_completed") and h.is_completed()
            for w in self._work
            for h in getattr(w, "handles", (w,))  # a hook's work: never complete while held
        )

    def wait(self) -> None:
        while self._work:  # one at a time: after an error, abandon() waits for the rest
            self._work[0].wait()
            del self._work[0]

    def abandon(self) -> None:
        """After an exception: wait out what is in flight and owe nothing."""
        self.wait()
        self.new_step()
