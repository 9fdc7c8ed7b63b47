"""The bucket groups' lifecycle states and the chain that dispatches them in one order.

[Note: dispatch order]
Collectives on one process group must be issued in the same order on every rank, or gloo/NCCL
pair up the wrong buffers. Readiness order comes from autograd and can differ between ranks (or
between buffers of different dtypes), so groups are dispatched strictly in the order of their
`DispatchChain`: a group that becomes ready early waits until every group before it has been
dispatched. The chain is ordered by expected backward order, so in practice nothing waits. Dense
and expert groups that reduce over the same process group share one chain.

[Note: grad readiness]
With overlap_grad_reduce a group dispatches during backward once every one of its params has
received all of its gradients for the iteration. How many arrivals that is per param is learned
on the first iteration (the learning iteration dispatches nothing during backward, only at
finish_grad_sync): a param used inside two reentrant activation-checkpointed regions, or a module
called twice under reentrant checkpointing, accumulates its grad more than once per backward,
and its group must wait for the last arrival. A param that gets fewer arrivals than learned
(unused this iteration, on this rank) keeps its group waiting until `finish_grad_sync()`, which
dispatches every remaining group in chain order on every rank, zero-filling unwritten grads: no
rank waits for a collective another rank never issues. A gradient that arrives after its group
was dispatched is an error (a second backward without no_sync(), or more arrivals than learned).
A group whose params are all small and linked counts, once learned, the sum of its params'
arrivals without a Python call per grad instead ([Note: counted arrivals] in arrivals.py): the
group's readiness part (`GradReadiness`, readiness.py) is switched to it by
`BucketGroup.count_arrivals`. A grad after the group's sync (a new backward without
zero_grad_buffer()) reopens the group's whole chain (`DispatchChain.reopen`).

[Note: gathers outlive a dropped group]
With overlap_param_gather the step leaves every group's param all-gather in flight for the next
forward to wait on. A model dropped before that forward (a run that ends, a test that builds
the next model) left them un-waited, and on gloo an un-waited point-to-point gather whose
record is garbage collected can wedge the pair: the next collective of the process group then
hung, or not, depending on when each rank's garbage collector happened to free the old model
(seen in tests/test_drop_in.py once allocation timing changed). So the gather's record waits
for its collectives when it is dropped without a wait (a finalizer; after a normal wait there
is nothing left to wait for). Every rank issued them at the step, so the wait returns; it is
bounded all the same (DROPPED_WAIT_S), since a finalizer must not hang a process, and a
timeout is reported with the rank.
"""

from __future__ import annotations

import datetime
import enum
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from megabuf.comm_hooks.contract import Waitable
from megabuf.sharding.grads import REDUCING_GROUPS_LIMIT
from megabuf.transport.comm_records import PendingCollective


class ChainMember(Protocol):
    """What a `DispatchChain` needs of a group (`BucketGroup` in bucket_group.py). The chain
    drives its groups; a group calls its chain only to report an event (`on_ready`, `reopen`)."""

    chain: Any  # the DispatchChain it belongs to, or None
    grad_state: GradSyncState
    releases_buckets: bool  # [Note: grad storage] in megabuf/sharding/grads.py

    @property
    def all_ready(self) -> bool: ...

    def start_grad_sync(self) -> None: ...

    def finish_grad_sync(self) -> None: ...

    def next_microbatch(self) -> None: ...

    def grad_sync_completed(self) -> bool: ...

    @property
    def replica_owed(self) -> bool: ...  # [Note: two-level reduction]

    def first_level_completed(self) -> bool: ...

    def start_replica_sync(self) -> None: ...

    rank: int

    @property
    def reduction_gain(self) -> float: ...


M = TypeVar("M", bound=ChainMember)


class GradSyncState(enum.Enum):
    IDLE = "idle"
    DISPATCHED = "dispatched"
    SYNCED = "synced"


class ParamSyncState(enum.Enum):
    VALID = "valid"
    STALE = "stale"
    DISPATCHED = "dispatched"


@dataclass
class SyncWork:
    """In-flight collectives of one group, one per bucket (or a comm hook's work per bucket)."""

    pending: Sequence[Waitable]

    def wait(self) -> None:
        for work in self.pending:
            work.wait()


DROPPED_WAIT_S = 60.0
"""How long a dropped gather record waits for its collectives ([Note: gathers outlive a
dropped group])."""


def expect_state(
    state: enum.Enum, allowed: Sequence[enum.Enum], what: str, group_id: int, rank: int, hint: str
) -> None:
    """A bucket group lifecycle's one guard (its grad and its param side both ask it): raise
    naming both states unless `state` is one of `allowed`."""
    if state not in allowed:
        wanted = " or ".join(s.name for s in allowed)
        raise RuntimeError(
            f"megabuf: bucket group {group_id} {what} is {state.name}, expected {wanted} "
            f"(rank {rank}); {hint}"
        )


def wait_dropped(pending: Sequence[PendingCollective], rank: int) -> None:
    """A gather record was dropped: wait, bounded, for its collectives that nobody waited for
    (a wait empties `handles`); see [Note: gathers outlive a dropped group]."""
    timeout = datetime.timedelta(seconds=DROPPED_WAIT_S)
    try:
        for work in pending:
            if work.handles:
                work.wait(timeout)
    except RuntimeError as exc:  # a finalizer cannot raise: say so and go on
        print(f"megabuf: rank {rank}: a dropped model's param gather did not finish: {exc}",
              file=sys.stderr)  # fmt: skip


class DispatchChain(Generic[M]):
    """Dispatches bucket groups strictly in order; see [Note: dispatch order].

    Created empty, handed to each `BucketGroup` at construction, then given the order once."""

    def __init__(self) -> None:
        self.groups: list[M] = []
        self.next_index = 0
        self.next_replica = 0  # the next group whose replicate all-reduce may be issued
        self._ordered = False

    def set_order(self, groups: Sequence[M]) -> None:
        if self._ordered:
            raise RuntimeError("megabuf: DispatchChain.set_order() called twice")
        if any(g.chain is not self for g in groups) or len(set(map(id, groups))) != len(groups):
            raise ValueError("megabuf: a dispatch chain's order must list its own groups once")
        self.groups = list(groups)
        self._ordered = True

    def on_ready(self) -> None:
        """Dispatch every group at the head of the chain that is ready."""
        while self.next_index < len(self.groups) and self.groups[self.next_index].all_ready:
            self.groups[self.next_index].start_grad_sync()
            self.next_index += 1
            self.progress_replicas()
            if self.groups[0].releases_buckets:
                self._bound_reducing()

    def progress_replicas(self) -> None:
        """Issue, in chain order, the replicate all-reduces whose reduce-scatter has landed,
        stopping at the first that has not (never waits; [Note: two-level reduction])."""
        while self.next_replica < self.next_index:
            group = self.groups[self.next_replica]
            if group.replica_owed and not group.first_level_completed():
                return
            group.start_replica_sync()
            self.next_replica += 1

    def start_replicas_upto(self, group: M) -> None:
        """Issue every owed replicate all-reduce up to and including `group`'s, in chain order
        (waiting for their reduce-scatters)."""
        stop = self.groups.index(group) + 1
        for earlier in self.groups[:stop]:  # from the head: a sync may re-owe any of them
            earlier.start_replica_sync()
        self.next_replica = max(self.next_replica, stop)

    def _bound_reducing(self) -> None:
        """optim_grads*: finish the reductions in flight that already completed (no wait), and
        the oldest beyond REDUCING_GROUPS_LIMIT (waiting), so their full buckets are released
        during backward ([Note: sharded grad lifecycle])."""
        dispatched = [
            g for g in self.groups[: self.next_index] if g.grad_state is GradSyncState.DISPATCHED
        ]
        excess = len(dispatched) - REDUCING_GROUPS_LIMIT
        for i, group in enumerate(dispatched):
            if i < excess or group.grad_sync_completed():
                self.finish(group)

    def finish(self, group: M) -> None:
        """Finish `group`'s reduction, issuing first every owed replicate all-reduce before
        it in chain order ([Note: two-level reduction])."""
        if group.replica_owed:
            self.start_replicas_upto(group)
        group.finish_grad_sync()

    def reopen(self, late: M, name: str) -> None:
        """A grad (of `name`) reached `late` after the chain's sync: a new backward without
        zero_grad_buffer() accumulates on top, as torch does, where every reduction of the
        chain allows it; the synced groups accept grads again."""
        refuse_reaccumulation(self.groups, name, late.rank)
        for group in self.groups:
            if group.grad_state is GradSyncState.SYNCED:
                group.next_microbatch()
        self.reset()

    def dispatch_rest(self) -> None:
        """Dispatch every group not yet dispatched, in order, ready or not ([Note: grad
        readiness]: unwritten grads are zero-filled)."""
        for group in self.groups[self.next_index :]:
            if group.grad_state is GradSyncState.IDLE:
                group.start_grad_sync()
        self.next_index = len(self.groups)

    def reset(self) -> None:
        self.next_index = 0
        self.next_replica = 0


def refuse_reaccumulation(groups: Sequence[ChainMember], name: str, rank: int) -> None:
    """Raise if a reduction of `groups` does not map already-reduced grads to themselves (a
    grad of `name` arrived after their sync)."""
    if any(g.reduction_gain != 1.0 for g in groups):
        raise RuntimeError(
            f"megabuf: backward after finish_grad_sync() without zero_grad_buffer() (rank "
            f"{rank}, {name}): this bucket group's reduction does not "
            "map already-reduced grads to themselves (expert-parallel params are scaled by "
            "1/dp_size but summed over expt_dp only), so accumulating across syncs would be "
            "wrong. Use no_sync() for gradient accumulation"
        )


def build_chain(groups: Sequence[M], order_key: Callable[[M], int]) -> None:
    """Give the groups' shared chain its order (groups sorted by `order_key`)."""
    if groups and groups[0].chain is not None:
        groups[0].chain.set_order(sorted(groups, key=order_key))
