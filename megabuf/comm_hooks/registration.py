"""Installing a communication hook on a model's bucket groups ([Note: comm hook contract]).

Kept out of `megabuf.comm_hooks.__init__`: it imports `megabuf.bucket_group`, which imports the
contract, so the package's top level must not import it.
"""

from __future__ import annotations

from collections.abc import Sequence

from megabuf.bucket_group import BucketGroup
from megabuf.buffer import _ParamAndGradBucket
from megabuf.comm_hooks.contract import (
    CommHookRegistrationError,
    GradBucket,
    Mode,
    check_modes,
    hook_name,
)
from megabuf.plan import Plan

KINDS = ("dense", "expert", "all")


def bucket_indices(plan: Plan) -> dict[tuple[int, int], int]:
    """(buffer index, bucket id) -> stable global bucket index, in plan order (dense buffers
    first, then expert; each buffer's buckets in order)."""
    indices: dict[tuple[int, int], int] = {}
    for buf in plan.buffers:
        for slot in buf.layout.buckets:
            indices[(buf.index, slot.bucket_id)] = len(indices)
    return indices


def selected_kinds(buffers: str) -> tuple[bool, ...]:
    """The `expert` flags `buffers` ("dense" | "expert" | "all") selects."""
    if buffers not in KINDS:
        raise ValueError(
            f"megabuf: register_comm_hook buffers must be one of {KINDS}, got {buffers!r}"
        )
    return {"dense": (False,), "expert": (True,), "all": (False, True)}[buffers]


def install(
    hook: object,
    groups: Sequence[BucketGroup],
    plan: Plan,
    *,
    expert_kinds: tuple[bool, ...],
    mode: Mode,
    strategy_name: str,
    average: bool,
    rank: int,
    replaceable: object | None = None,
) -> list[GradBucket]:
    """Check `hook` against the mode and the selected groups, build their `GradBucket` views,
    let the hook see them (`setup`, optional) and attach it. Nothing is attached if any check
    fails. A group's hook that is `replaceable` (the one deterministic_reduction installed) is
    replaced, not "registered twice". Returns the views."""
    what = f"this model (data_parallel_sharding_strategy={strategy_name!r}, rank {rank})"
    check_modes(hook, mode, what)
    plans = {g.group_id: g for g in plan.groups}
    chosen = [g for g in groups if plans[g.group_id].expert in expert_kinds]
    if not chosen:
        kinds = " or ".join("expert" if e else "dense" for e in expert_kinds)
        raise ValueError(
            f"megabuf: register_comm_hook({hook_name(hook)}): this model has no {kinds} "
            f"buffers (rank {rank}); nothing would use the hook"
        )
    for group in chosen:
        if group.comm_hook is not None and group.comm_hook is not replaceable:
            kind = "expert" if plans[group.group_id].expert else "dense"
            raise CommHookRegistrationError(
                f"megabuf: a comm hook ({hook_name(group.comm_hook)}) is already registered "
                f"for the {kind} buffers (rank {group.rank}); register once, before the first "
                "backward (a new hook needs a new DistributedDataParallel)"
            )
    indices = bucket_indices(plan)
    views = {}
    for g in chosen:
        planned = plans[g.group_id]
        views[g.group_id] = [
            _view(g, bucket, indices[member], mode, average, planned.expert)
            for bucket, member in zip(g.buckets, planned.members, strict=True)
        ]
    setup = getattr(hook, "setup", None)
    all_views = [v for g in chosen for v in views[g.group_id]]
    if setup is not None:
        setup(all_views)
    for group in chosen:
        group.set_comm_hook(hook, views[group.group_id])
    return all_views


def _view(
    group: BucketGroup,
    bucket: _ParamAndGradBucket,
    index: int,
    mode: Mode,
    average: bool,
    expert: bool,
) -> GradBucket:
    data = bucket.grad_data
    return GradBucket(
        index=index,
        group_id=group.group_id,
        expert=expert,
        mode=mode,
        data=data,
        shard=group.local_shard(data) if mode == "reduce_scatter" else None,
        params=tuple(bucket.params_list),
        param_names=tuple(group.name_of(p) for p in bucket.params_list),
        group=group.collective_group,
        group_size=group.dp_size,
        group_rank=group.dp_rank,
        rank=group.rank,
        average=average,
        collectives=group.collectives,
        gradient_scaling_factor=bucket.gradient_scaling_factor,
    )
