"""`TwoLevelReduction`: the end of `BucketGroup`'s grad reduction, with its hybrid half
([Note: two-level reduction] in megabuf/sharding/replicate.py): finishing the first level (the
reduction inside the group's own collective group, the shard group under hybrid), issuing the
all-reduce of the reduced shards across replicas in dispatch-chain order, whether it completed,
abandoning it. Flat groups carry a `ReplicaStage` that never arms, so every method here is then
the flat behaviour (or a no-op)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from megabuf.comm_hooks.contract import GradBucket
from megabuf.dispatch import GradSyncState, SyncWork
from megabuf.grad_math import completed
from megabuf.sharding.grads import ShardedGrads
from megabuf.sharding.replicate import ReplicaStage
from megabuf.timeline import Timeline


class TwoLevelReduction:
    """Mixed into `BucketGroup`, whose constructor sets these attributes."""

    replicas: ReplicaStage
    chain: Any  # its DispatchChain, or None
    grad_state: GradSyncState
    sharded_grads: ShardedGrads | None
    is_final_microbatch: bool
    group_id: int
    rank: int
    timeline: Timeline | None
    _grad_work: SyncWork | None
    _unwritten: bytearray
    _all_unwritten: bytes

    def local_shard(self, data: Tensor) -> Tensor:
        raise NotImplementedError

    def _full_grads(self) -> Sequence[Tensor]:
        raise NotImplementedError

    def _clear_iteration(self) -> None:
        raise NotImplementedError

    def attach_replica_hook(
        self, hook: object, first_level: Sequence[GradBucket], timeout_s: float | None
    ) -> None:
        """Hybrid: run `hook` on the second level too, over views of the reduced shards
        ([Note: comm hooks under hybrid]); raises naming a hook that cannot. Flat: a no-op."""
        self.replicas.set_hook(hook, first_level, self._reduced_shards(), timeout_s)

    def _reduced_shards(self) -> list[Tensor]:
        """This rank's reduced shard of each bucket: what crosses the replicate group."""
        if self.sharded_grads is not None:
            return list(self.sharded_grads.shards)
        return [self.local_shard(g) for g in self._full_grads()]

    def end_step_at_sync(self) -> None:
        """The grad sync that ends the step begins: every later reduction is final, and one
        that already ran (or runs) as a non-final micro-batch owes its replicate all-reduce."""
        self.is_final_microbatch = True
        if self.grad_state is not GradSyncState.IDLE:
            self.replicas.owe_at_sync()

    def _issue_owed_replicas(self) -> None:
        """Before waiting: this group's owed all-reduce, and every earlier one of its chain."""
        if self.replicas.owed:
            if self.chain is not None:
                self.chain.start_replicas_upto(self)
            else:
                self.start_replica_sync()

    def _finish_first_level(self) -> None:
        """Wait for the reduction in the group's own collective group (the reduce-scatter
        inside the shard group under hybrid) and, under optim_grads*, land it in the shards."""
        if self._grad_work is None:
            if self.replicas.active and self.grad_state is not GradSyncState.IDLE:
                return  # landed already (start_replica_sync, or a non-final micro-batch)
            raise RuntimeError(f"megabuf: bucket group {self.group_id} has no grad sync work")
        self._grad_work.wait()
        self._grad_work = None
        if self.sharded_grads is not None:
            self.sharded_grads.finish()  # into the grad shards; the buckets are released
            self._unwritten[:] = self._all_unwritten  # their contents are gone

    def start_replica_sync(self) -> None:
        """Hybrid, a final micro-batch: finish the first level and issue the all-reduce of
        this rank's reduced shards across replicas. Only the dispatch chain calls it, in chain
        order; a no-op when nothing is owed."""
        if not self.replicas.owed:
            return
        self._finish_first_level()
        if self.timeline is not None:  # the second level's dispatch; "finish" covers both
            self.timeline.record(self.group_id, "replicate_dispatch")  # (a hook's runs in start)
        self.replicas.start(self._reduced_shards())

    def first_level_completed(self) -> bool:
        """The reduction in the group's own collective group has landed (never waits)."""
        work = self._grad_work
        return work is None or all(completed(w) for w in work.pending)

    def grad_sync_completed(self) -> bool:
        """The dispatched reduction has landed, both levels under hybrid (finish_grad_sync would
        not wait); False when unknown (a comm hook's work)."""
        work = self._grad_work
        if self.replicas.active:
            return (
                self.grad_state is GradSyncState.DISPATCHED
                and self.first_level_completed()
                and self.replicas.completed()
            )
        return work is not None and all(completed(w) for w in work.pending)

    def abandon_grad_sync(self) -> None:
        """After an exception mid-iteration: wait out an in-flight reduction (its result is
        dropped) and return to IDLE with nothing written."""
        if self._grad_work is not None:
            self._grad_work.wait()
            self._grad_work = None
        self.replicas.abandon()
        if self.sharded_grads is not None:
            self.sharded_grads.abandon()
        self.grad_state = GradSyncState.IDLE
        self._clear_iteration()
