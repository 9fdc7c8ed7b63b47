"""The one planner: which buffers, buckets, bucket groups and dispatch chains DDP builds.

Pure: it sees one `ParamSpec` per trainable param (name, numel, dtype, two markers), the config and
the group sizes, never a process group or an nn.Parameter, and returns frozen records.
`DistributedDataParallel` allocates exactly this plan and `megabuf inspect` prints it.

Rules, in order:
- Buffers: dense first, then expert; within each, one buffer per (param dtype, grad dtype) key in
  first-seen registration order (grad dtype is fp32 with `grad_reduce_in_fp32`, else the param's).
  Each buffer's layout is `megabuf.pure.layout.compute_layout` (see [Note: buffer layout]).
- Bucket size: `resolve_bucket_size`, one size for every buffer; or, once `bucket_size = "auto"`
  has measured a step, explicit boundaries per buffer (`build_plan(bucket_ends=...)`, [Note: auto
  bucket plan] in bucket_planner.py).
- Bucket groups: one per bucket, dense then expert, ids unique across both (they tag p2p messages);
  with `disable_bucketing` one group for all dense buckets and one for all expert buckets.
- Dispatch chains: see [Note: one chain per communicator].
- Under "optim_grads_params" (ZeRO-3): see [Note: unit-aligned plan].

[Note: unit-aligned plan]
ZeRO-3 gathers and releases params unit by unit ([Note: shard units] in
megabuf/sharding/units.py), so `build_plan(unit_of_param=...)` (the owning unit of each spec)
changes two rules, and only under
`data_parallel_sharding_strategy == "optim_grads_params"`; every other strategy ignores
`unit_of_param` and gets exactly the plan above.
- Layout: each buffer's params of one unit are contiguous and no bucket spans two units
  (`compute_layout(unit_ids=...)`, [Note: buffer layout]); a large unit may take several buckets,
  and without a bucket size each unit gets one bucket per buffer. Padding is unchanged.
- Bucket groups: one per unit holding all of that unit's buckets across the dense buffers (in
  buffer then bucket order), and one per unit across the expert buffers; `GroupPlan.unit` names
  the unit. Group ids: dense groups by unit index, then expert groups by unit index. A unit that
  owns no trainable param has no group. `disable_bucketing` cannot merge units: it only drops
  the bucket size (one bucket per unit per buffer).
- Chain order: a unit group is complete only when the grad of its earliest-registered param
  arrives, so the chain sorts unit groups by that param, last-registered first (the root, which
  usually owns the input embedding, comes last). Keying on the last-registered param, as for
  single-bucket groups, would put the root first and stall every other group behind it.
`unit_of_param=None` under "optim_grads_params" puts every param in unit 0 (the whole model one
unit), which is what `megabuf.sharding.units.plan_units` gives a model without shard units.

[Note: one chain per communicator]
Collectives on one communicator must be issued in the same order on every rank ([Note: dispatch
order] in bucket_group.py), and a `DispatchChain` guarantees that only for the groups it holds. So
the plan makes one chain per communicator, not one per kind of param: when expert params reduce over
the very same process group as dense ones (ep_size == 1, where `ProcessGroups.build` returns one
group object for both), every bucket group goes into a single chain. Otherwise dense and expert
groups get a chain each. Within a chain, groups holding the last-registered params come first (the
expected backward order), keyed on the common registration order of all trainable params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megabuf.config import DistributedDataParallelConfig
from megabuf.pure.layout import BufferLayout, compute_layout, default_bucket_size
from megabuf.pure.owners import OwnerBalance, assign_owners, owner_aligned_layout, owner_cost

DtypeKey = tuple[torch.dtype, torch.dtype]  # (param dtype, grad dtype)


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one trainable param."""

    name: str
    numel: int
    dtype: torch.dtype
    expert: bool = False
    """Expert-parallel (`param.allreduce is False`): reduced over expt_dp, in an expert buffer."""
    own_bucket: bool = False
    """`param.shared_embedding`: the param gets a bucket of its own (tied embeddings)."""
    shape: tuple[int, ...] | None = None
    """The param's shape, or None for a param no matrix optimizer orthogonalises (embedding
    weights); whole-param owners weigh 2-D shapes by their Newton-Schulz cost, the rest by
    numel ([Note: whole-param owners] in megabuf/pure/owners.py)."""
    fp8: bool = False
    """A float8 training weight ([Note: FP8 params] in megabuf/fp8/__init__.py): stored as
    uint8 where the strategy keeps a master copy."""


@dataclass(frozen=True)
class BufferPlan:
    """One contiguous buffer: `param_ids` index the specs, in registration order, and
    `layout.params[i]` is the slot of spec `param_ids[i]`."""

    index: int
    expert: bool
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    param_ids: tuple[int, ...]
    layout: BufferLayout
    dp_size: int  # size of the group it reduces over (dp, or expt_dp for expert buffers)

    def bucket_param_ids(self, bucket_id: int) -> tuple[int, ...]:
        """Spec indices of the params of one bucket, in buffer order."""
        return tuple(self.param_ids[i] for i in self.layout.buckets[bucket_id].param_ids)


@dataclass(frozen=True)
class GroupPlan:
    """One bucket group: buckets whose collectives are issued together."""

    group_id: int
    expert: bool
    members: tuple[tuple[int, int], ...]  # (buffer index, bucket id), in buffer then bucket order
    chain_id: int
    dispatch_position: int  # place in its chain's expected backward (dispatch) order
    unit: int | None = None  # the shard unit it holds ([Note: unit-aligned plan]); else None


@dataclass(frozen=True)
class Plan:
    """Everything DDP allocates, in the order it allocates it."""

    bucket_size: int | None  # resolved, in elements (None: one bucket per buffer)
    buffers: tuple[BufferPlan, ...]  # dense first, then expert
    groups: tuple[GroupPlan, ...]  # by group id
    chains: tuple[tuple[int, ...], ...]  # group ids of each chain, in dispatch order
    unit_of_spec: tuple[int, ...] | None = None  # owning unit per spec (optim_grads_params only)
    owner_balance: tuple[OwnerBalance, ...] = ()  # whole_param_owners: dense, then expert
    # explicit boundaries per buffer (placement positions closing a bucket), chosen by
    # bucket_size="auto" from a measured step; None: sized by `bucket_size`
    bucket_ends: tuple[tuple[int, ...], ...] | None = None


def dtype_key(
    dtype: torch.dtype, config: DistributedDataParallelConfig, fp8: bool = False
) -> DtypeKey:
    """(param dtype, grad dtype) of a param: the key of the buffer it lives in. An FP8 param
    is stored as uint8 where the strategy keeps a master copy ([Note: FP8 params])."""
    grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else dtype
    if fp8 and config.sharding.param_home != "module":
        return torch.uint8, grad_dtype
    return dtype, grad_dtype


def resolve_bucket_size(
    buffer_numels: Sequence[int],
    config: DistributedDataParallelConfig,
    dp_size: int,
    disable_bucketing: bool = False,
    largest_param_numel: int = 0,
) -> int | None:
    """None with disable_bucketing; else the explicit size; else one bucket per buffer without
    overlap; else the default sized by dp_size and the largest buffer (unpadded numel), and
    under whole_param_owners at least dp_size x the largest param ([Note: whole-param
    owners])."""
    if disable_bucketing:
        return None
    if isinstance(config.bucket_size, int):
        return config.bucket_size  # "auto" starts from the default until it has measured
    if not config.overlap_grad_reduce:
        return None
    size = default_bucket_size(dp_size, max(buffer_numels, default=0))
    if config.whole_param_owners:  # a bucket's shards pad to its largest param's
        size = max(size, dp_size * largest_param_numel)
    return size


def build_plan(
    specs: Sequence[ParamSpec],
    config: DistributedDataParallelConfig,
    *,
    dp_size: int,
    expt_dp_size: int,
    expert_shares_dp_group: bool,
    disable_bucketing: bool = False,
    unit_of_param: Sequence[int] | None = None,
    bucket_ends: Sequence[Sequence[int]] | None = None,
) -> Plan:
    """Plan DDP for trainable params `specs` (registration order); see the module docstring.
    `unit_of_param`: the shard unit of each spec, read only under optim_grads_params.
    `bucket_ends`: explicit boundaries, one sequence per buffer (in plan order), instead of a
    bucket size."""
    _check_args(specs, dp_size, expt_dp_size, expert_shares_dp_group)
    units = _unit_of_spec(specs, config, unit_of_param)
    keyed = _buffer_params(specs, config)
    numels = [sum(specs[i].numel for i in ids) for _, _, ids in keyed]
    largest = max((s.numel for s in specs), default=0)
    bucket_size = resolve_bucket_size(numels, config, dp_size, disable_bucketing, largest)
    ends = _bucket_ends(bucket_ends, len(keyed), disable_bucketing)
    if ends is not None:
        bucket_size = None
    buffers = tuple(
        _buffer_plan(i, expert, key, ids, specs, config, bucket_size,
                     expt_dp_size if expert else dp_size, units, None if ends is None else ends[i])
        for i, (expert, key, ids) in enumerate(keyed)
    )  # fmt: skip
    balance: tuple[OwnerBalance, ...] = ()
    if config.whole_param_owners:
        buffers, balance = _owner_buffers(buffers, specs, config)
    if units is None:
        members = _group_members(buffers, disable_bucketing)
        group_units: list[int | None] = [None] * len(members)
    else:
        members, group_units = _unit_group_members(buffers, units)
    chains = _chains(members, buffers, merge=expert_shares_dp_group, by_unit=units is not None)
    place = {gid: (c, pos) for c, ids in enumerate(chains) for pos, gid in enumerate(ids)}
    groups = tuple(
        GroupPlan(gid, expert, pairs, *place[gid], group_units[gid])
        for gid, (expert, pairs) in enumerate(members)
    )
    return Plan(bucket_size, buffers, groups, chains, units, balance, ends)


def _owner_buffers(
    buffers: tuple[BufferPlan, ...],
    specs: Sequence[ParamSpec],
    config: DistributedDataParallelConfig,
) -> tuple[tuple[BufferPlan, ...], tuple[OwnerBalance, ...]]:
    """Every buffer re-laid with whole-param owners, loads carried over the buffers of one
    reduction group (dense, then expert); see [Note: whole-param owners]."""
    _check_owner_nbytes(specs, config.whole_param_max_nbytes)
    out: list[BufferPlan] = []
    balances: list[OwnerBalance] = []
    for expert in (False, True):
        loads: tuple[int, ...] | None = None
        for buf in (b for b in buffers if b.expert == expert):
            costs = [owner_cost(specs[i].shape or (specs[i].numel,)) for i in buf.param_ids]
            per_bucket = [[costs[p] for p in k.param_ids] for k in buf.layout.buckets]
            sizes = [[specs[buf.param_ids[p]].numel for p in k.param_ids]
                     for k in buf.layout.buckets]  # fmt: skip
            owners, balance = assign_owners(per_bucket, buf.dp_size, loads, sizes)
            loads = balance.loads
            owner_of = [0] * len(buf.param_ids)
            for k, ranks in zip(buf.layout.buckets, owners, strict=True):
                for p, r in zip(k.param_ids, ranks, strict=True):
                    owner_of[p] = r
            layout = owner_aligned_layout(
                buf.layout, [specs[i].numel for i in buf.param_ids], owner_of, buf.dp_size,
                high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
            )  # fmt: skip
            out.append(dataclasses.replace(buf, layout=layout))
        if loads is not None:
            balances.append(OwnerBalance(loads))
    return tuple(sorted(out, key=lambda b: b.index)), tuple(balances)


def _check_owner_nbytes(specs: Sequence[ParamSpec], limit: int | None) -> None:
    big = [(s.name, s.numel * s.dtype.itemsize) for s in specs]
    big = [(n, b) for n, b in big if limit is not None and b > limit]
    if big:
        raise ValueError(
            f"megabuf: params {big[:5]} (name, bytes) are larger than "
            f"DistributedDataParallelConfig.whole_param_max_nbytes={limit}, and under "
            "whole_param_owners one rank holds each param whole; raise the limit, or split or "
            "shard those params another way (e.g. tensor parallelism)"
        )


def _bucket_ends(
    bucket_ends: Sequence[Sequence[int]] | None, n_buffers: int, disable_bucketing: bool
) -> tuple[tuple[int, ...], ...] | None:
    if bucket_ends is None:
        return None
    if disable_bucketing:
        raise ValueError(
            "megabuf: build_plan(bucket_ends=...) cannot be used with disable_bucketing"
        )
    if len(bucket_ends) != n_buffers:
        raise ValueError(
            f"megabuf: build_plan(bucket_ends=...) needs one entry per buffer: got "
            f"{len(bucket_ends)} for {n_buffers} buffers"
        )
    return tuple(tuple(e) for e in bucket_ends)


def _unit_of_spec(
    specs: Sequence[ParamSpec],
    config: DistributedDataParallelConfig,
    unit_of_param: Sequence[int] | None,
) -> tuple[int, ...] | None:
    """The unit of each spec under optim_grads_params ([Note: unit-aligned plan]), else None."""
    if unit_of_param is not None:
        bad = [s.name for s, u in zip(specs, unit_of_param) if isinstance(u, bool) or
               not isinstance(u, int) or u < 0]  # fmt: skip
        if len(unit_of_param) != len(specs) or bad:
            raise ValueError(
                f"megabuf: build_plan(unit_of_param=...) needs one unit index >= 0 per trainable "
                f"param: got {len(unit_of_param)} for {len(specs)} params"
                + (f", bad entries for {bad}" if bad else "")
            )
    # [Note: strategies build their parts] in megabuf/sharding/strategies.py
    return config.sharding.unit_plan(_UnitOfSpec(len(specs), unit_of_param))


@dataclass(frozen=True)
class _UnitOfSpec:
    """The `UnitPlanKit` of the planner: each spec's unit, unit 0 (the root) unless given."""

    n_specs: int
    unit_of_param: Sequence[int] | None

    def plan_units(self) -> tuple[int, ...]:
        if self.unit_of_param is None:
            return (0,) * self.n_specs
        return tuple(self.unit_of_param)


def _check_args(
    specs: Sequence[ParamSpec], dp_size: int, expt_dp_size: int, expert_shares_dp_group: bool
) -> None:
    if dp_size < 1 or expt_dp_size < 1:
        raise ValueError(
            f"megabuf: dp_size and expt_dp_size must be >= 1, got {dp_size} and {expt_dp_size}"
        )
    if expert_shares_dp_group and expt_dp_size != dp_size:
        raise ValueError(
            f"megabuf: expert params share the dp group, yet expt_dp_size={expt_dp_size} != "
            f"dp_size={dp_size}"
        )
    empty = [s.name for s in specs if s.numel <= 0]
    if empty:
        raise ValueError(
            f"megabuf: trainable params {empty} have no elements; drop them or freeze them "
            "(requires_grad=False)"
        )


def _buffer_params(
    specs: Sequence[ParamSpec], config: DistributedDataParallelConfig
) -> list[tuple[bool, DtypeKey, tuple[int, ...]]]:
    """(expert?, dtype key, spec indices) per buffer, dense first, keys in first-seen order."""
    out: list[tuple[bool, DtypeKey, tuple[int, ...]]] = []
    for expert in (False, True):
        by_key: dict[DtypeKey, list[int]] = {}
        for i, spec in enumerate(specs):
            if spec.expert == expert:
                by_key.setdefault(dtype_key(spec.dtype, config, spec.fp8), []).append(i)
        out.extend((expert, key, tuple(ids)) for key, ids in by_key.items())
    return out


def _buffer_plan(
    index: int,
    expert: bool,
    key: DtypeKey,
    param_ids: tuple[int, ...],
    specs: Sequence[ParamSpec],
    config: DistributedDataParallelConfig,
    bucket_size: int | None,
    dp_size: int,
    units: tuple[int, ...] | None,
    bucket_ends: tuple[int, ...] | None = None,
) -> BufferPlan:
    layout = compute_layout(
        [specs[i].numel for i in param_ids],
        bucket_size=bucket_size,
        dp_size=dp_size,
        sharded=config.sharding.shards_optimizer,
        high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
        own_bucket=[specs[i].own_bucket for i in param_ids],
        unit_ids=None if units is None else [units[i] for i in param_ids],
        bucket_ends=bucket_ends,
    )
    return BufferPlan(index, expert, key[0], key[1], param_ids, layout, dp_size)


def _group_members(
    buffers: Sequence[BufferPlan], disable_bucketing: bool
) -> list[tuple[bool, tuple[tuple[int, int], ...]]]:
    """(expert?, members) per bucket group, in group id order (dense groups first)."""
    out: list[tuple[bool, tuple[tuple[int, int], ...]]] = []
    for expert in (False, True):
        pairs = [(b.index, k.bucket_id) for b in buffers if b.expert == expert
                 for k in b.layout.buckets]  # fmt: skip
        if disable_bucketing and pairs:
            out.append((expert, tuple(pairs)))
        elif not disable_bucketing:
            out.extend((expert, (pair,)) for pair in pairs)
    return out


def _unit_group_members(
    buffers: Sequence[BufferPlan], units: tuple[int, ...]
) -> tuple[list[tuple[bool, tuple[tuple[int, int], ...]]], list[int | None]]:
    """One group per (kind, unit): dense groups by unit index, then expert ones; see
    [Note: unit-aligned plan]."""
    members: list[tuple[bool, tuple[tuple[int, int], ...]]] = []
    group_units: list[int | None] = []
    for expert in (False, True):
        by_unit: dict[int, list[tuple[int, int]]] = {}
        for b in buffers:
            if b.expert != expert:
                continue
            for k in b.layout.buckets:
                unit = units[b.param_ids[k.param_ids[0]]]
                by_unit.setdefault(unit, []).append((b.index, k.bucket_id))
        for unit in sorted(by_unit):
            members.append((expert, tuple(by_unit[unit])))
            group_units.append(unit)
    return members, group_units


def _chains(
    members: Sequence[tuple[bool, tuple[tuple[int, int], ...]]],
    buffers: Sequence[BufferPlan],
    *,
    merge: bool,
    by_unit: bool = False,
) -> tuple[tuple[int, ...], ...]:
    """Group ids per chain in dispatch order; see [Note: one chain per communicator] (and
    [Note: unit-aligned plan] for unit groups, keyed on their earliest-registered param)."""
    pick = min if by_unit else max

    def backward_key(gid: int) -> int:  # last-registered params first
        _, pairs = members[gid]
        return -pick(pick(buffers[b].bucket_param_ids(k)) for b, k in pairs)

    kinds = [(False, True)] if merge else [(False,), (True,)]
    chains = []
    for kind in kinds:
        ids = [gid for gid, (expert, _) in enumerate(members) if expert in kind]
        if ids:
            chains.append(tuple(sorted(ids, key=backward_key)))
    return tuple(chains)
