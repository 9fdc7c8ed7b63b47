"""The publish group and the sends in flight on it ([Note: publish protocol] in transfer.py,
[Note: asynchronous publish] below)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed import ProcessGroup

from megabuf.sharding.ledger import MemoryLedger
from megabuf.transport.collectives import PendingCollective
from megabuf.transport.process_groups import new_group_with_timeout
from megabuf.weights.transfer import Transfer

PUBLISH_CATEGORY = "weight_publish"
"""Ledger category: the slice copy (cast, packed or moved to the host) held while it is sent."""


@dataclass(frozen=True)
class PublishGroup:
    """Trainers (global ranks, in dp-rank order) and consumers, and their process group."""

    group: ProcessGroup
    trainers: tuple[int, ...]
    consumers: tuple[int, ...]
    timeout: datetime.timedelta

    def group_rank(self, global_rank: int) -> int:
        return sorted(self.trainers + self.consumers).index(global_rank)


def publish_group(
    trainer_ranks: Sequence[int], consumer_ranks: Sequence[int], *, timeout_s: float = 300.0
) -> PublishGroup:
    """A gloo group of `trainer_ranks` (the dp ranks of the model, in dp-rank order; under a
    hybrid split replicate rank 0's shard group, [Note: publishing from replicas]) and
    `consumer_ranks`; every collective on it fails after `timeout_s`. Collective over the
    whole world: every rank calls it, in the same order relative to its other group creations."""
    both = set(trainer_ranks) & set(consumer_ranks)
    if both or not trainer_ranks or not consumer_ranks:
        raise ValueError(
            f"megabuf: publish_group needs disjoint, non-empty trainer and consumer ranks; got "
            f"trainers {list(trainer_ranks)}, consumers {list(consumer_ranks)}"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    group = new_group_with_timeout([*trainer_ranks, *consumer_ranks], timeout)
    return PublishGroup(group, tuple(trainer_ranks), tuple(consumer_ranks), timeout)


@dataclass
class Sending:
    """One bucket's sends in flight and the slice copy they read (counted in the ledger)."""

    index: int
    works: list[PendingCollective]
    ledger: MemoryLedger
    nbytes: int
    group: PublishGroup | None = None
    rank: int = -1

    def wait(self) -> None:
        try:
            if self.group is not None:
                what = f"sending bucket {self.index} to the consumers"
                wait_all(self.works, self.group, what, self.rank)
        finally:
            self.ledger.free(PUBLISH_CATEGORY, self.nbytes)
            self.nbytes, self.works = 0, []


@dataclass
class PendingPublish:
    """An asynchronous publish in flight ([Note: asynchronous publish]).

    [Note: asynchronous publish]
    `Publisher.start_publish` exchanges the headers (a short collective over the publish
    group), then copies every slice it sends to the host (casts and no_shard packs are copies
    already; a view of the model's own shard is cloned) and starts the sends. The copies are
    this version's snapshot: the next step may overwrite the params at once, and the
    consumers still get exactly this version, never a mix. Training collectives run on the
    model's own groups, the sends on the publish group's gloo pairs, so they cannot deadlock
    each other. The cost is memory: this rank's whole share of the sent buckets is held (the
    ledger's "weight_publish") until `wait()`, instead of one slice at a time. `wait()` is
    bounded by the group's timeout; a publish refuses while one is in flight.
    """

    transfer: Transfer
    sends: list[Sending]
    finished: bool = False

    def wait(self) -> Transfer:
        try:
            for sending in self.sends:
                sending.wait()
        finally:
            self.finished = True
        return self.transfer


def wait_all(pending: list[PendingCollective], group: PublishGroup, what: str, rank: int) -> None:
    try:
        for work in pending:
            work.wait(group.timeout)
    except RuntimeError as e:
        raise RuntimeError(
            f"megabuf: weight publish on rank {rank}: {what} did not finish within "
            f"{group.timeout.total_seconds():.0f}s (a peer died or stopped publishing?): {e}"
        ) from e
