"""A bucket group's grad reduction: one owned object, chosen once (`reduction_for`).

[Note: reductions]
What a bucket group does to reduce its buckets differs by strategy and by what is registered,
and each variant is one class with the same acts:
- `start(async_op, final)`: issue the reduction (async when overlapping); `final`: this is the
  step's last micro-batch (only the two-level reduction cares);
- `finish()`: wait for all of it and land it in the group's grad storage;
- `abandon()`: after an exception, wait out whatever is in flight, its result dropped;
- `completed()`: it has landed (never waits; False when unknown, a comm hook's work);
and, for the dispatch chain's ordering of a second level, `owed` / `start_second_level()`.
The variants: `AllReduce` (every bucket pre-scaled, summed over the group: [Note: scale on
the way in]), `ReduceScatter` (this rank's shard of each bucket, scaled after unless the
strategy pre-scales, landing through the grad storage's all-to-all zone when the backend needs
one: [Note: grad storage] in megabuf/sharding/grads.py), `HookReduction` (a registered comm
hook per bucket: [Note: comm hook contract], [Note: bounded hook wait]) and `TwoLevel`, the
hybrid wrapper around any of those: its second level all-reduces the reduced shards across
replicas ([Note: two-level reduction] in megabuf/sharding/replicate.py). Registering a comm
hook is `with_hook`: the group replaces its reduction by the hooked one (a two-level one keeps
its wrapper and runs the hook on both levels).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.buckets.buffer import _ParamAndGradBucket
from megabuf.buckets.dispatch import SyncWork
from megabuf.buckets.full_grads import GradStorage
from megabuf.buckets.grad_math import InboundScale, completed, foreach_scale
from megabuf.comm_hooks.contract import GradBucket, HookWork, Waitable
from megabuf.sharding.replicate import ReplicaStage
from megabuf.transport.collectives import Collectives
from megabuf.transport.cross_replica import CrossReplica


@dataclass(frozen=True)
class ReductionParts:
    """What every reduction of one bucket group works on, given at assembly."""

    buckets: Sequence[_ParamAndGradBucket]
    grads: GradStorage
    collectives: Collectives
    group: ProcessGroup | None  # the group's own collective group (the shard group)
    strategy: Any  # the ShardingStrategy: which dtypes it pre-scales
    inbound: InboundScale  # [Note: scale on the way in]
    params_list: Sequence[torch.nn.Parameter]
    average: bool  # average_in_collective
    dp_rank: int
    dp_size: int
    group_id: int
    rank: int

    @classmethod
    def of(cls, group: Any) -> ReductionParts:
        """A `BucketGroup`'s (its grad storage and inbound scale already built)."""
        cfg = group.ddp_config
        return cls(
            group.buckets, group.grads, group.collectives, group.collective_group, cfg.sharding,
            group.inbound, group.params_list, cfg.average_in_collective, group.dp_rank,
            group.dp_size, group.group_id, group.rank,
        )  # fmt: skip

    def local_shard(self, data: Tensor) -> Tensor:
        numel = data.numel() // self.dp_size
        return data[self.dp_rank * numel : (self.dp_rank + 1) * numel]


class Reduction(Protocol):
    """[Note: reductions]"""

    hook: object | None  # the registered comm hook, if any
    hook_buckets: Sequence[GradBucket]
    replicas: ReplicaStage | None  # the second level, if any
    scales_inbound: bool  # grads may be scaled on their way into main_grad

    @property
    def owed(self) -> bool: ...

    def start(self, async_op: bool, final: bool) -> None: ...

    def finish(self) -> None: ...

    def abandon(self) -> None: ...

    def completed(self) -> bool: ...

    def first_level_completed(self) -> bool: ...

    def start_second_level(self) -> None: ...

    def owe_at_sync(self) -> None: ...

    def new_step(self) -> None: ...

    def with_hook(
        self, hook: object, views: Sequence[GradBucket], timeout_s: float | None
    ) -> Reduction: ...


class FirstLevel(abc.ABC):
    """A reduction inside the group's own collective group; `_issue` is what differs."""

    hook: object | None = None
    hook_buckets: Sequence[GradBucket] = ()
    replicas: ReplicaStage | None = None
    scales_inbound = True
    owed = False

    def __init__(self, parts: ReductionParts) -> None:
        self.parts = parts
        self.work: SyncWork | None = None

    @abc.abstractmethod
    def _issue(self, async_op: bool) -> Sequence[Waitable]:
        """Issue the collectives (or the hook's first stage), one per bucket or fewer."""

    def start(self, async_op: bool, final: bool) -> None:
        self.work = SyncWork(self._issue(async_op))

    def finish(self) -> None:
        if self.work is None:
            raise RuntimeError(f"megabuf: bucket group {self.parts.group_id} has no grad sync work")
        self.land()

    def land(self) -> None:
        """Wait for the collectives and land them in the grad storage (under optim_grads*:
        into the grad shards, the full buckets released)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.parts.grads.finish()

    def abandon(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def completed(self) -> bool:
        work = self.work
        return work is not None and all(completed(w) for w in work.pending)

    def first_level_completed(self) -> bool:
        work = self.work
        return work is None or all(completed(w) for w in work.pending)

    def start_second_level(self) -> None:
        return None  # one level: nothing to do

    def owe_at_sync(self) -> None:
        return None  # one level: nothing to do

    def new_step(self) -> None:
        return None  # one level: nothing to do

    def with_hook(
        self, hook: object, views: Sequence[GradBucket], timeout_s: float | None
    ) -> Reduction:
        return HookReduction(self.parts, hook, views, timeout_s)

    def _prescale(self) -> tuple[list[Tensor], list[float], list[bool]]:
        """Pre-scale what the strategy scales before the collective ([Note: scale on the way
        in]); the buckets' grads, their factors and which were pre-scaled."""
        p = self.parts
        grads = [b.grad_data for b in p.buckets]
        scales = [b.gradient_scaling_factor for b in p.buckets]
        pre = [p.strategy.prescales(g.dtype) for g in grads]
        chosen = [(g, f) for g, f, q in zip(grads, scales, pre) if q]
        p.inbound.prescale([g for g, _ in chosen], [f for _, f in chosen], p.params_list)
        return grads, scales, pre


class AllReduce(FirstLevel):
    def _issue(self, async_op: bool) -> Sequence[Waitable]:
        p = self.parts
        p.grads.start(needs_scratch=False)
        grads, _, _ = self._prescale()
        return p.collectives.all_reduce_many(grads, p.group, average=p.average, async_op=async_op)


class ReduceScatter(FirstLevel):
    def _issue(self, async_op: bool) -> Sequence[Waitable]:
        p = self.parts
        device = p.buckets[0].grad_data.device
        needs = p.collectives.strategy(p.group, device).reduce_scatter == "all_to_all"
        scratches = p.grads.start(needs_scratch=needs)
        grads, scales, pre = self._prescale()
        return p.collectives.reduce_scatter_many(
            [p.local_shard(g) for g in grads], grads, p.group, average=p.average,
            async_op=async_op, scratches=scratches,
            scales=[1.0 if q else f for q, f in zip(pre, scales)],
        )  # fmt: skip


class HookReduction(FirstLevel):
    """A registered comm hook's reduction, per bucket ([Note: comm hook contract])."""

    scales_inbound = False  # a hook may want unscaled grads

    def __init__(
        self,
        parts: ReductionParts,
        hook: object,
        views: Sequence[GradBucket],
        timeout_s: float | None,
    ) -> None:
        super().__init__(parts)
        self.hook = hook
        self.hook_buckets = list(views)  # one per bucket, built at registration
        self.timeout_s = timeout_s

    def _issue(self, async_op: bool) -> Sequence[Waitable]:
        """Pre-scale every bucket (both modes; not for a hook with `prescaled = False`), then
        hand each to the hook, which issues stage one now; `finish` waits for the rest, each
        wait bounded ([Note: bounded hook wait])."""
        p = self.parts
        p.grads.start(needs_scratch=False)
        if getattr(self.hook, "prescaled", True):
            grads = [b.grad_data for b in p.buckets]
            foreach_scale(grads, [b.gradient_scaling_factor for b in p.buckets])
        return [HookWork(self.hook, bucket, self.timeout_s) for bucket in self.hook_buckets]


class TwoLevel:
    """The hybrid reduction: `first` inside the shard group, then this rank's reduced shards
    all-reduced across replicas (`replicas`), in dispatch-chain order ([Note: two-level
    reduction]). The chain issues the second level (`start_second_level`) when the first has
    landed; `finish` issues it itself when still owed."""

    def __init__(self, first: FirstLevel, replicas: ReplicaStage) -> None:
        self.first = first
        self.replicas: ReplicaStage | None = replicas
        self._replicas = replicas
        self.hook = first.hook
        self.hook_buckets = first.hook_buckets
        self.scales_inbound = first.scales_inbound

    @property
    def owed(self) -> bool:
        return self._replicas.owed

    def start(self, async_op: bool, final: bool) -> None:
        self.first.start(async_op, final)
        self._replicas.arm(final)

    def start_second_level(self) -> None:
        """A final micro-batch: land the first level and issue the all-reduce of this rank's
        reduced shards across replicas; a no-op when nothing is owed."""
        if not self._replicas.owed:
            return
        self.first.land()
        self._replicas.start(self._crossing())

    def _crossing(self) -> list[Tensor]:
        """What crosses replicas: this rank's reduced shard of each bucket, or the whole bucket
        where every rank steps whole params (no_shard, only under megabuf.ft: [Note:
        fault-tolerant replicas])."""
        parts = self.first.parts
        if parts.strategy.shards_optimizer:
            return parts.grads.reduced_shards()
        return [b.grad_data for b in parts.buckets]

    def finish(self) -> None:
        self.start_second_level()
        self.first.land()  # a no-op when it landed already (a non-final micro-batch)
        self._replicas.wait()

    def abandon(self) -> None:
        self.first.abandon()
        self._replicas.abandon()

    def completed(self) -> bool:
        return self.first.first_level_completed() and self._replicas.completed()

    def first_level_completed(self) -> bool:
        return self.first.first_level_completed()

    def owe_at_sync(self) -> None:
        self._replicas.owe_at_sync()

    def new_step(self) -> None:
        self._replicas.new_step()

    def with_hook(
        self, hook: object, views: Sequence[GradBucket], timeout_s: float | None
    ) -> Reduction:
        """The hook on both levels ([Note: comm hooks under hybrid]); raises naming a hook
        that cannot run on the second, before anything changes."""
        first = HookReduction(self.first.parts, hook, views, timeout_s)
        shards = self.first.parts.grads.reduced_shards()
        self._replicas.set_hook(hook, views, shards, timeout_s)
        return TwoLevel(first, self._replicas)


def reduction_for(strategy: Any, parts: ReductionParts, replicas: CrossReplica | None) -> Reduction:
    """The reduction a bucket group starts with: the strategy's first level ([Note: strategies
    build their parts] in sharding/strategies.py), wrapped in the two-level reduction under a
    hybrid split or under fault tolerance (`replicas`: [Note: cross-replica level])."""
    first: FirstLevel = strategy.first_reduction(_FirstLevels(parts))
    if replicas is None:
        return first
    stage = ReplicaStage(
        replicas, parts.collectives, average=parts.average, group_id=parts.group_id,
        rank=parts.rank,
    )  # fmt: skip
    return TwoLevel(first, stage)


@dataclass(frozen=True)
class _FirstLevels:
    """The strategy's `ReductionKit` for one group: how each first level is built."""

    parts: ReductionParts

    def all_reduce(self) -> FirstLevel:
        return AllReduce(self.parts)

    def reduce_scatter(self) -> FirstLevel:
        return ReduceScatter(self.parts)
