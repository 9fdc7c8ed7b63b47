"""`assemble`: allocate a plan's buffers and wire its bucket groups and dispatch chains.

What `DistributedDataParallel` builds from `plan_model(...)` (model_plan.py): one
`_ParamAndGradBuffer` per planned buffer (params move into it), one `BucketGroup` per planned
group over its buckets, with the strategy's sharded grad / param storages ([Note: sharded grad
lifecycle], [Note: sharded param lifecycle]), and the dispatch chains in plan order ([Note: one
chain per communicator] in plan.py). Ranks and sizes come from the `Topology`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from megabuf.buckets.bucket_group import BucketGroup, DispatchChain
from megabuf.buckets.buffer import _ParamAndGradBuffer
from megabuf.buckets.full_grads import FullGrads, GradStorage
from megabuf.config import DistributedDataParallelConfig
from megabuf.fp8 import Fp8Params
from megabuf.planning.plan import GroupPlan, Plan
from megabuf.sharding.grads import ShardedGrads, bucket_padding_ranges
from megabuf.sharding.ledger import MemoryLedger
from megabuf.sharding.param_units import unit_of
from megabuf.sharding.params import ShardedParams
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups


@dataclass
class Assembly:
    buffers: list[_ParamAndGradBuffer]  # plan order: dense first, then expert
    groups: list[BucketGroup]  # plan order
    chains: list[DispatchChain[BucketGroup]]


@dataclass(frozen=True)
class _Context:
    plan: Plan
    config: DistributedDataParallelConfig
    pgs: ProcessGroups
    collectives: Collectives
    ledger: MemoryLedger
    param_to_name: dict[nn.Parameter, str]
    unit_names: Sequence[str]  # shard unit names by unit index (optim_grads_params)
    fp8: Fp8Params | None = None  # the engine's FP8 params ([Note: FP8 params])


def assemble(
    plan: Plan,
    params: Sequence[nn.Parameter],
    config: DistributedDataParallelConfig,
    pgs: ProcessGroups,
    collectives: Collectives,
    ledger: MemoryLedger,
    param_to_name: dict[nn.Parameter, str],
    unit_names: Sequence[str] = ("",),
    fp8: Fp8Params | None = None,
) -> Assembly:
    """`params`: the trainable params the plan's param ids index."""
    ctx = _Context(plan, config, pgs, collectives, ledger, param_to_name, unit_names, fp8)
    return _make_groups(ctx, _make_buffers(ctx, params))


def rebucket(
    plan: Plan,
    buffers: list[_ParamAndGradBuffer],
    config: DistributedDataParallelConfig,
    pgs: ProcessGroups,
    collectives: Collectives,
    ledger: MemoryLedger,
    param_to_name: dict[nn.Parameter, str],
) -> Assembly:
    """`plan`'s buckets over the existing (unsharded) buffers, and new groups and chains on
    them ([Note: auto bucket re-plan] in megabuf/replan/autobucket.py)."""
    if len(plan.buffers) != len(buffers):
        raise ValueError(f"megabuf: re-plan has {len(plan.buffers)} buffers, not {len(buffers)}")
    for buf, planned in zip(buffers, plan.buffers, strict=True):
        buf.rebucket(planned.layout)
    ctx = _Context(plan, config, pgs, collectives, ledger, param_to_name, ("",))
    return _make_groups(ctx, buffers)


def _make_groups(ctx: _Context, buffers: list[_ParamAndGradBuffer]) -> Assembly:
    plan = ctx.plan
    chains: list[DispatchChain[BucketGroup]] = [DispatchChain() for _ in plan.chains]
    groups = [_make_group(ctx, buffers, p, chains[p.chain_id]) for p in plan.groups]
    for chain, group_ids in zip(chains, plan.chains, strict=True):
        chain.set_order([groups[i] for i in group_ids])
    return Assembly(buffers, groups, chains)


def scaling_factors(
    config: DistributedDataParallelConfig, pgs: ProcessGroups
) -> tuple[float, float]:
    """(dense, expert) gradient scaling factors. Every grad ends up averaged over the dense dp
    group: expert grads already hold the contributions of the ep ranks (token all-to-all), so
    they too are scaled by 1/dp_size and summed over expt_dp (dp_size = ep_size *
    expt_dp_size). Under a hybrid split the two levels together sum over all of dp, so the
    factors are the flat ones ([Note: hybrid rank order])."""
    dp_size = pgs.dp_size
    if config.average_in_collective:
        return 1.0, pgs.topology.expt_dp_size / dp_size
    return 1.0 / dp_size, 1.0 / dp_size


def _make_buffers(ctx: _Context, params: Sequence[nn.Parameter]) -> list[_ParamAndGradBuffer]:
    dense_scale, expert_scale = scaling_factors(ctx.config, ctx.pgs)
    return [
        _ParamAndGradBuffer(
            ctx.config, planned.param_dtype, planned.grad_dtype,
            [params[i] for i in planned.param_ids],
            ctx.pgs.shard_group(planned.expert), planned.layout, ctx.param_to_name,
            expert_scale if planned.expert else dense_scale, dp_size=planned.dp_size,
            dp_rank=ctx.pgs.topology.sharding(planned.expert)[0], fp8=ctx.fp8,
        )
        for planned in ctx.plan.buffers
    ]  # fmt: skip


def _make_group(
    ctx: _Context,
    buffers: list[_ParamAndGradBuffer],
    planned: GroupPlan,
    chain: DispatchChain[BucketGroup],
) -> BucketGroup:
    pgs = ctx.pgs
    dp_rank, dp_size = pgs.topology.sharding(planned.expert)
    return BucketGroup(
        [buffers[b].buckets[k] for b, k in planned.members], ctx.config,
        pgs.shard_group(planned.expert), ctx.collectives, replicas=pgs.replicas(),
        group_id=planned.group_id, dp_rank=dp_rank, dp_size=dp_size, rank=pgs.topology.rank,
        param_to_name=ctx.param_to_name, chain=chain,
        sharded_params=_sharded_params(ctx, buffers, planned),
        grads=grad_storage_for(ctx, buffers, planned),
    )  # fmt: skip


def grad_storage_for(
    ctx: _Context, buffers: list[_ParamAndGradBuffer], planned: GroupPlan
) -> GradStorage:
    """The strategy's grad storage for the group ([Note: grad storage] in
    megabuf/sharding/grads.py; [Note: strategies build their parts])."""
    storage: GradStorage = ctx.config.sharding.grad_storage(_GroupParts(ctx, buffers, planned))
    return storage


def _sharded_params(
    ctx: _Context, buffers: list[_ParamAndGradBuffer], planned: GroupPlan
) -> ShardedParams | None:
    """The strategy's param storage for the group ([Note: strategies build their parts])."""
    return ctx.config.sharding.param_storage(_GroupParts(ctx, buffers, planned))


@dataclass(frozen=True)
class _GroupParts:
    """The per-bucket-group kit of [Note: strategies build their parts]: how each part a
    strategy may choose for one group is built."""

    ctx: _Context
    buffers: list[_ParamAndGradBuffer]
    planned: GroupPlan

    def full_grads(self) -> GradStorage:
        dp_rank, dp_size = self.ctx.pgs.topology.sharding(self.planned.expert)
        buckets = [self.buffers[b].buckets[k] for b, k in self.planned.members]
        return FullGrads(buckets, dp_rank, dp_size)

    def sharded_grads(self) -> GradStorage:
        """optim_grads*: full buckets only while they accumulate and reduce ([Note: sharded
        grad lifecycle])."""
        ctx, planned = self.ctx, self.planned
        dp_rank, dp_size = ctx.pgs.topology.sharding(planned.expert)
        members = [(self.buffers[b], k) for b, k in planned.members]
        full = [buf.buckets[k].grad_data for buf, k in members]
        shards = [s for buf, k in members if (s := buf.buckets[k].grad_shard) is not None]
        sizes = [t.numel() // dp_size for t in full]
        return ShardedGrads(
            full, [(dp_rank * n, (dp_rank + 1) * n) for n in sizes], shards,
            [bucket_padding_ranges(buf.layout, k) for buf, k in members],
            ctx.ledger, group_id=planned.group_id, rank=ctx.pgs.topology.rank,
        )  # fmt: skip

    def sharded_params(self) -> ShardedParams:
        """optim_grads_params: the group's full params and shards ([Note: sharded param
        lifecycle] in megabuf/sharding/params.py)."""
        return _new_sharded_params(self.ctx, self.buffers, self.planned)


def _new_sharded_params(
    ctx: _Context, buffers: list[_ParamAndGradBuffer], planned: GroupPlan
) -> ShardedParams:
    dp_rank, dp_size = ctx.pgs.topology.sharding(planned.expert)
    buckets = [buffers[b].buckets[k] for b, k in planned.members]
    return ShardedParams(
        [b.param_data for b in buckets if b.param_data is not None],
        [b.param_shard for b in buckets if b.param_shard is not None],
        ctx.collectives, ctx.pgs.shard_group(planned.expert), ctx.ledger,
        group_id=planned.group_id, unit_name=ctx.unit_names[unit_of(planned)],
        rank=ctx.pgs.topology.rank, poison=ctx.config.verify_param_access,
        dp_rank=dp_rank, dp_size=dp_size,
    )  # fmt: skip
