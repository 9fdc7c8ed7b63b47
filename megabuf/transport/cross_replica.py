"""The cross-replica level of a reduction, as one replaceable part: who all-reduces a reduced
shard across replicas.

[Note: cross-replica level]
A two-level reduction ([Note: two-level reduction] in megabuf/sharding/replicate.py) reduces a
bucket inside its own group first, then all-reduces this rank's reduced shard across replicas.
The second act is a `CrossReplica`, chosen once when the process groups are made
(`ProcessGroups.replicas()`) and handed to every bucket group at assembly:
- `ReplicateGroup`: hybrid sharding's replicate group, through `Collectives` (averaging when
  the config averages in the collective, summing the pre-scaled grads otherwise);
- `megabuf.ft.ManagerReplicas`: torchft's `Manager.allreduce`, the only path across replica
  groups under fault tolerance ([Note: fault-tolerant replicas] in megabuf/ft/__init__.py),
  which always averages over the live participant count.
Both return work handles the stage waits for; neither is told which bucket group it serves.
A comm hook runs on the second level only where `hook_group` names a group for its views;
the Manager's level refuses hooks by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.transport.collectives import Collectives


class Handle(Protocol):
    def wait(self) -> Any: ...


class CrossReplica(Protocol):
    """[Note: cross-replica level]"""

    name: str  # for messages

    def start(
        self, shards: Sequence[Tensor], collectives: Collectives, *, average: bool
    ) -> Sequence[Handle]:
        """All-reduce every shard in place across replicas, asynchronously."""
        ...

    def hook_group(self, hook_name: str, *, group_id: int, rank: int) -> ProcessGroup:
        """The group a second-level comm hook's views name; raises if hooks cannot run here."""
        ...


class ReplicateGroup:
    """Hybrid sharding's replicate group ([Note: hybrid rank order] in megabuf/pure/hybrid.py)."""

    name = "dp_replicate"

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def start(
        self, shards: Sequence[Tensor], collectives: Collectives, *, average: bool
    ) -> Sequence[Handle]:
        return collectives.all_reduce_many(shards, self.group, average=average, async_op=True)

    def hook_group(self, hook_name: str, *, group_id: int, rank: int) -> ProcessGroup:
        return self.group
