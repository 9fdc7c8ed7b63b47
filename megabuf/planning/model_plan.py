"""`plan_model`: from a module and a config to the plan every engine and `megabuf inspect` use.

One path for both, so what `megabuf inspect` prints is what `DistributedDataParallel` builds:
the trainable params in registration order (shared params once), the shard units under
optim_grads_params ([Note: shard units] in units.py) and the planner's buffers, buckets, groups
and chains (plan.py). Params whose grads are sparse stay out of the plan ([Note: sparse grads
outside the buffer] in sparse_grads.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.plan import Plan, build_plan
from megabuf.planning.replicas import embedding_weights, param_specs
from megabuf.sharding.units import UnitPlan, plan_units

# modules whose `sparse=True` makes their weight's grad a sparse COO tensor (as torch DDP)
SPARSE_GRAD_MODULES = (nn.Embedding, nn.EmbeddingBag)


@dataclass(frozen=True)
class ModelPlan:
    trainable: tuple[tuple[str, nn.Parameter], ...]  # (name, param), registration order; dense
    sparse: tuple[tuple[str, nn.Parameter], ...]  # trainable, sparse grads: outside the buffers
    unit_plan: UnitPlan | None  # optim_grads_params only
    plan: Plan


def trainable_params(
    module: nn.Module, rank: int | None = None
) -> tuple[tuple[str, nn.Parameter], ...]:
    """`module`'s params that require grad, (name, param) in registration order (shared params
    once). None is refused, as torch DDP refuses it: there would be nothing to reduce. Pure, so
    the engine checks it before its first collective and every rank raises alike (`plan_model`
    itself plans whatever it is given)."""
    named = list(module.named_parameters())
    trainable = tuple((n, p) for n, p in named if p.requires_grad)
    if not trainable:
        where = "" if rank is None else f" (rank {rank})"
        what = f"all {len(named)} of its params are frozen" if named else "it has no params"
        raise RuntimeError(
            f"megabuf: DistributedDataParallel got a {type(module).__name__} with no parameter "
            f"that requires a gradient{where}: {what}, so there is nothing to reduce. Wrap a "
            "module with trainable params (set requires_grad=True on those to train before "
            "wrapping), or run an untrained module without DistributedDataParallel"
        )
    return trainable


def plan_model(
    module: nn.Module,
    config: DistributedDataParallelConfig,
    *,
    dp_size: int,
    expt_dp_size: int,
    expert_shares_dp_group: bool,
    disable_bucketing: bool = False,
    bucket_ends: Sequence[Sequence[int]] | None = None,
) -> ModelPlan:
    """The plan of `module`'s trainable params at `dp_size` (expert params at `expt_dp_size`);
    `bucket_ends`: explicit boundaries per buffer (an auto plan, [Note: auto bucket plan])."""
    sparse_ids = {id(p) for p in sparse_grad_params(module, config)}
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    trainable = tuple((n, p) for n, p in named if id(p) not in sparse_ids)
    sparse = tuple((n, p) for n, p in named if id(p) in sparse_ids)
    # [Note: strategies build their parts] in megabuf/sharding/strategies.py
    unit_plan = config.sharding.unit_plan(_Units(module, config, list(trainable)))
    specs = param_specs(trainable, embedding_weights(module))
    plan = build_plan(
        specs, config, dp_size=dp_size, expt_dp_size=expt_dp_size,
        expert_shares_dp_group=expert_shares_dp_group, disable_bucketing=disable_bucketing,
        unit_of_param=unit_plan.unit_ids([n for n, _ in trainable]) if unit_plan else None,
        bucket_ends=bucket_ends,
    )  # fmt: skip
    return ModelPlan(trainable, sparse, unit_plan, plan)


@dataclass(frozen=True)
class _Units:
    """The `UnitPlanKit` of the sharding strategy."""

    module: nn.Module
    config: DistributedDataParallelConfig
    trainable: list[tuple[str, nn.Parameter]]

    def plan_units(self) -> UnitPlan:
        return plan_units(self.module, self.config.shard_units, self.trainable)


def sparse_grad_params(
    module: nn.Module, config: DistributedDataParallelConfig
) -> list[nn.Parameter]:
    """The trainable params of the `nn.Embedding` / `nn.EmbeddingBag(sparse=True)` modules
    of `module`; a sharded strategy refuses them, naming the first module ([Note: sparse grads
    outside the buffer] in sparse_grads.py)."""
    found: list[nn.Parameter] = []
    for name, sub in module.named_modules():
        if not (isinstance(sub, SPARSE_GRAD_MODULES) and sub.sparse):
            continue
        if not sub.weight.requires_grad:
            continue
        if config.sharding.shards_optimizer:
            raise ValueError(
                f"megabuf: module {name or '<root>'!r} ({type(sub).__name__}(sparse=True)) "
                "produces sparse grads, which the distributed optimizer cannot shard "
                f"(data_parallel_sharding_strategy={config.sharding.name!r}); use "
                'data_parallel_sharding_strategy="no_shard" or sparse=False'
            )
        found.append(sub.weight)  # type: ignore[arg-type]
    return found
