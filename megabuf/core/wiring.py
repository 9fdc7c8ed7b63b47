"""`Wiring`: everything an engine builds on its bucket groups, as one record built by one function.

[Note: wired once, swapped whole]
An `Engine` (engine.py) is built in two parts. What lives as long as the engine (the module, its
params and their names, the plan's groups, collectives, ledger, residency, the sparse grads, the
auto-bucket watcher) is assigned once in its constructor. Everything built on the bucket groups
(the buffers and groups by kind, the grad sync, the grad hooks and their handles, the param-gather
hooks, the param side, the comm-hook registry, the plan they follow) is a `Wiring`, built by
`wire` with every collaborator and callback passed in at construction: nothing is patched into
a part afterwards. The bucket_size="auto" re-plan ([Note: auto bucket re-plan] in autobucket.py,
[Note: sharded auto bucket re-plan] in sharded_replan.py) does not re-assign the engine's parts
one by one: `rewire` retires the old record's hooks, builds a new record on the new plan, and the
engine swaps it in whole. Under ZeRO-3 the param side is replaced (`with_param_side`) once the
shard units exist, again by a new record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

from megabuf.buckets.bucket_group import BucketGroup, DispatchChain
from megabuf.buckets.buffer import _ParamAndGradBuffer
from megabuf.config import DistributedDataParallelConfig
from megabuf.core.assembly import Assembly, assemble, rebucket
from megabuf.fp8.masters import reseeded
from megabuf.planning.plan import Plan
from megabuf.replan.sharded_replan import release_old_groups, retire_old_params
from megabuf.sharding.ledger import MemoryLedger
from megabuf.sync.grad_sync import GradSync
from megabuf.sync.grads import ExposedGrads
from megabuf.sync.hook_registry import CommHookRegistry
from megabuf.sync.hooks import ParamGatherHooks, register_grad_hooks, remove_hooks_when_collected
from megabuf.sync.param_sync import GatheredParams
from megabuf.sync.sparse_grads import SparseGrads
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups

ParamToGroup = dict[nn.Parameter, BucketGroup]
T = TypeVar("T")


@dataclass(frozen=True)
class Wiring:
    """What `wire` built on one plan's bucket groups ([Note: wired once, swapped whole])."""

    plan: Plan
    buffers: list[_ParamAndGradBuffer]  # plan order (dense, then expert)
    dense_buffers: list[_ParamAndGradBuffer]
    expert_parallel_buffers: list[_ParamAndGradBuffer]
    bucket_groups: list[BucketGroup]  # dense
    expert_parallel_bucket_groups: list[BucketGroup]
    all_bucket_groups: list[BucketGroup]  # dense then expert
    param_to_bucket_group: ParamToGroup
    sync: GradSync
    grad_hook_handles: list[RemovableHandle]  # the engine's list: counted hooks swap in here
    gather_hooks: ParamGatherHooks
    param_side: GatheredParams  # UnitParams under optim_grads_params
    hooks: CommHookRegistry

    def with_param_side(self, param_side: GatheredParams) -> Wiring:
        """The same record with the ZeRO-3 param side (built once the shard units exist)."""
        return dataclasses.replace(self, param_side=param_side)


class WiredField(Generic[T]):
    """An engine attribute read from its current `Wiring` (`engine._wired`): the read API's
    buffers, groups and parts follow the record the re-plan swapped in."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> T:
        return getattr(engine._wired, self.name)  # type: ignore[no-any-return]

    def __set__(self, engine: Any, value: T) -> None:
        raise AttributeError(
            f"megabuf: Engine.{self.name} is read-only: it belongs to the engine's wiring, which "
            "only the engine builds and swaps ([Note: wired once, swapped whole] in wiring.py)"
        )


@dataclass(frozen=True)
class WiringParts:
    """What every `Wiring` of one engine is built from (fixed for the engine's life); the
    callbacks are the engine's, passed in here rather than patched in afterwards."""

    owner: object  # the engine: its hooks go when it is collected
    module: nn.Module
    params: list[nn.Parameter]  # trainable, in the buffers
    param_to_name: dict[nn.Parameter, str]
    config: DistributedDataParallelConfig
    process_groups: ProcessGroups
    collectives: Collectives
    ledger: MemoryLedger
    sparse_grads: SparseGrads
    rank: int
    exposed_grads: Callable[[Sequence[nn.Parameter], ParamToGroup], ExposedGrads]
    # (groups, chains, grads) -> the grad sync with the engine's callbacks
    make_sync: Callable[
        [list[BucketGroup], list[DispatchChain[BucketGroup]], ExposedGrads], GradSync
    ]
    on_grad: Callable[[], None]  # a backward's first grad ([Note: one bookkeeping per backward])


def wire(parts: WiringParts, plan: Plan, built: Assembly) -> Wiring:
    """Everything built on `built`'s bucket groups, at construction and at the re-plan."""
    expert = [planned.expert for planned in plan.buffers]
    dense_buffers = [b for b, e in zip(built.buffers, expert) if not e]
    expert_buffers = [b for b, e in zip(built.buffers, expert) if e]
    expert_group = [planned.expert for planned in plan.groups]
    dense_groups = [g for g, e in zip(built.groups, expert_group) if not e]
    expert_groups = [g for g, e in zip(built.groups, expert_group) if e]
    all_groups = dense_groups + expert_groups
    param_to_group = {p: g for g in built.groups for p in g.params_list}
    grads = parts.exposed_grads(parts.params, param_to_group)
    sync = parts.make_sync(all_groups, built.chains, grads)
    handles, gather_hooks = _install_hooks(parts, param_to_group, all_groups, grads, sync)
    return Wiring(
        plan=plan, buffers=built.buffers, dense_buffers=dense_buffers,
        expert_parallel_buffers=expert_buffers, bucket_groups=dense_groups,
        expert_parallel_bucket_groups=expert_groups, all_bucket_groups=all_groups,
        param_to_bucket_group=param_to_group, sync=sync, grad_hook_handles=handles,
        gather_hooks=gather_hooks,
        param_side=GatheredParams(all_groups, gather_hooks, parts.config),
        hooks=CommHookRegistry(all_groups, plan, parts.config, parts.ledger, parts.rank),
    )  # fmt: skip


def _install_hooks(
    parts: WiringParts,
    param_to_group: ParamToGroup,
    groups: list[BucketGroup],
    grads: ExposedGrads,
    sync: GradSync,
) -> tuple[list[RemovableHandle], ParamGatherHooks]:
    handles = register_grad_hooks(
        parts.params, param_to_group, set(grads.linked), parts.on_grad, sync.in_backward
    )
    # after the dense ones: _count_arrivals finds those by position
    handles += parts.sparse_grads.install_hooks(parts.on_grad, sync.in_backward)
    for group in groups:  # the hooks hold the views: a sharded storage guards the attribute
        names = [parts.param_to_name[p] for p in group.params_list]
        group.grads.guard_main_grads(group.params_list, names)
    gather_hooks = ParamGatherHooks(parts.module, param_to_group)
    if parts.config.overlap_param_gather:
        gather_hooks.enable()
    remove_hooks_when_collected(parts.owner, handles, gather_hooks)
    return handles, gather_hooks


def rewire(
    parts: WiringParts, old: Wiring, plan: Plan, sharded: bool
) -> tuple[Wiring, list[tuple[str, nn.Module]]]:
    """The re-plan's rebuild on `plan` ([Note: auto bucket re-plan]): the old record's hooks
    retired, a new record built (sharded: on new buffers, [Note: sharded auto bucket re-plan]),
    the timeline carried over. Returns it and the ZeRO-3 shard units to build again (else
    none); the engine swaps the record in whole."""
    for handle in old.grad_hook_handles:
        handle.remove()
    old.gather_hooks.disable()
    context = (parts.config, parts.process_groups, parts.collectives, parts.ledger,
               parts.param_to_name)  # fmt: skip
    units: list[tuple[str, nn.Module]] = []
    if sharded:  # new buffers, params copied in ([Note: sharded auto bucket re-plan])
        groups = old.all_bucket_groups
        units = release_old_groups(groups, old.param_side, parts.ledger, parts.rank)
        fp8 = reseeded([b.fp8 for b in old.buffers if b.fp8 is not None], parts.collectives,
                       parts.process_groups.shard_group)  # fmt: skip
        built = assemble(plan, parts.params, *context, [n for n, _ in units] or ("",), fp8)
        if fp8 is not None:  # [Note: FP8 params in checkpoints] (the re-plan, too)
            fp8.drop_seeds()
        retire_old_params(groups)
    else:  # the same buffers, other boundaries
        built = rebucket(plan, old.buffers, *context)
    new = wire(parts, plan, built)
    if old.sync.timeline is not None:
        new.sync.enable_timeline(old.sync.timeline)
    return new, units
