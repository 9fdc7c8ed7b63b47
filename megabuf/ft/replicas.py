"""torchft's Manager as the cross-replica level of every bucket group's reduction.

See [Note: fault-tolerant replicas] in megabuf/ft/__init__.py and [Note: cross-replica level]
in megabuf/transport/cross_replica.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp

from megabuf.ft.fingerprint import LayoutCheck
from megabuf.transport.collectives import Collectives
from megabuf.transport.cross_replica import Handle


class _Averaged:
    """A Manager all-reduce (a sum) and its division by the step's contributor count, applied
    when waited for ([Note: layout fingerprint]: the step's first all-reduce counts them)."""

    def __init__(self, work: Any, tensor: Tensor, layout: LayoutCheck) -> None:
        self.work, self.tensor, self.layout = work, tensor, layout

    def wait(self) -> None:
        self.work.wait()  # never raises: the Manager records an error and votes the step down
        n = self.layout.contributors()
        if n > 1:
            self.tensor.div_(n)

    def is_completed(self) -> bool:
        return False  # the chain learns nothing early; finish waits ([Note: reductions])


class ManagerReplicas:
    """[Note: fault-tolerant replicas]: the reduced shards of every bucket group cross replica
    groups only through `manager.allreduce`, a sum divided by the number of groups that
    contributed (a healing group contributes zeros and receives the average of the others).
    The first all-reduce a step issues carries the layout fingerprint and that count
    (`LayoutCheck`)."""

    name = "torchft Manager"

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.layout = LayoutCheck(manager)

    def start(
        self, shards: Sequence[Tensor], collectives: Collectives, *, average: bool
    ) -> Sequence[Handle]:
        """`average` is ignored: the first level already averaged (or pre-scaled) inside the
        group, and this level always averages over the participants."""
        self.layout.issue_once()
        with torch.profiler.record_function("megabuf::ft_allreduce"):
            return [
                _Averaged(self.manager.allreduce(s, reduce_op=ReduceOp.SUM), s, self.layout)
                for s in shards
            ]

    def hook_group(self, hook_name: str, *, group_id: int, rank: int) -> ProcessGroup:
        raise ValueError(
            f"megabuf: comm hook {hook_name} cannot run under megabuf.ft (bucket group "
            f"{group_id}, rank {rank}): the cross-replica level is torchft's Manager, whose "
            "all-reduce is the only path between replica groups and whose voted-down steps "
            "would leave a hook's state (error feedback, ...) changed. Register no comm hook "
            "under fault tolerance"
        )
