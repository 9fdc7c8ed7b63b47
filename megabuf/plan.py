"""The one planner: which buffers, buckets, bucket groups and dispatch chains DDP builds.

Pure: it sees one `ParamSpec` per trainable param (name, numel, dtype, two markers), the config and
the group sizes, never a process group or an nn.Parameter, and returns frozen records.
`DistributedDataParallel` allocates exactly this plan and `megabuf inspect` prints it.

Rules, in order:
- Buffers: dense first, then expert; within each, one buffer per (param dtype, grad dtype) key in
  first-seen registration order (grad dtype is fp32 with `grad_reduce_in_fp32`, else the param's).
  Each buffer's layout is `megabuf.layout.compute_layout` (see [Note: buffer layout]).
- Bucket size: `resolve_bucket_size`, one size for every buffer.
- Bucket groups: one per bucket, dense then expert, ids unique across both (they tag p2p messages);
  with `disable_bucketing` one group for all dense buckets and one for all expert buckets.
- Dispatch chains: see [Note: one chain per communicator].

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megabuf.config import DistributedDataParallelConfig
from megabuf.layout import BufferLayout, compute_layout, default_bucket_size

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


@dataclass(frozen=True)
class Plan:
    """Everything DDP allocates, in the order it allocates it."""

    bucket_size: int | None  # resolved, in elements (None: one bucket per buffer)
    buffers: tuple[BufferPlan, ...]  # dense first, then expert
    groups: tuple[GroupPlan, ...]  # by group id
    chains: tuple[tuple[int, ...], ...]  # group ids of each chain, in dispatch order


def dtype_key(dtype: torch.dtype, config: DistributedDataParallelConfig) -> DtypeKey:
    """(param dtype, grad dtype) of a param: the key of the buffer it lives in."""
    return dtype, torch.float32 if config.grad_reduce_in_fp32 else dtype


def resolve_bucket_size(
    buffer_numels: Sequence[int],
    config: DistributedDataParallelConfig,
    dp_size: int,
    disable_bucketing: bool = False,
) -> int | None:
    """None with disable_bucketing; else the explicit size; else one bucket per buffer without
    overlap; else the default sized by dp_size and the largest buffer (unpadded numel)."""
    if disable_bucketing:
        return None
    if config.bucket_size is not None:
        return config.bucket_size
    if not config.overlap_grad_reduce:
        return None
    return default_bucket_size(dp_size, max(buffer_numels, default=0))


def build_plan(
    specs: Sequence[ParamSpec],
    config: DistributedDataParallelConfig,
    *,
    dp_size: int,
    expt_dp_size: int,
    expert_shares_dp_group: bool,
    disable_bucketing: bool = False,
) -> Plan:
    """Plan DDP for trainable params `specs` (registration order); see the module docstring."""
    _check_args(specs, dp_size, expt_dp_size, expert_shares_dp_group)
    keyed = _buffer_params(specs, config)
    numels = [sum(specs[i].numel for i in ids) for _, _, ids in keyed]
    bucket_size = resolve_bucket_size(numels, config, dp_size, disable_bucketing)
    buffers = tuple(
        _buffer_plan(i, expert, key, ids, specs, config, bucket_size,
                     expt_dp_size if expert else dp_size)
        for i, (expert, key, ids) in enumerate(keyed)
    )  # fmt: skip
    members = _group_members(buffers, disable_bucketing)
    chains = _chains(members, buffers, merge=expert_shares_dp_group)
    place = {gid: (c, pos) for c, ids in enumerate(chains) for pos, gid in enumerate(ids)}
    groups = tuple(
        GroupPlan(gid, expert, pairs, *place[gid]) for gid, (expert, pairs) in enumerate(members)
    )
    return Plan(bucket_size, buffers, groups, chains)


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
                by_key.setdefault(dtype_key(spec.dtype, config), []).append(i)
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
) -> BufferPlan:
    layout = compute_layout(
        [specs[i].numel for i in param_ids],
        bucket_size=bucket_size,
        dp_size=dp_size,
        sharded=bool(config.use_distributed_optimizer),
        high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
        own_bucket=[specs[i].own_bucket for i in param_ids],
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


def _chains(
    members: Sequence[tuple[bool, tuple[tuple[int, int], ...]]],
    buffers: Sequence[BufferPlan],
    *,
    merge: bool,
) -> tuple[tuple[int, ...], ...]:
    """Group ids per chain in dispatch order; see [Note: one chain per communicator]."""

    def backward_key(gid: int) -> int:  # last-registered params first
        _, pairs = members[gid]
        return -max(max(buffers[b].bucket_param_ids(k)) for b, k in pairs)

    kinds = [(False, True)] if merge else [(False,), (True,)]
    chains = []
    for kind in kinds:
        ids = [gid for gid, (expert, _) in enumerate(members) if expert in kind]
        if ids:
            chains.append(tuple(sorted(ids, key=backward_key)))
    return tuple(chains)
