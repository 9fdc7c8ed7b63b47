"""The planner's inputs from a module, and one decision for every rank (`plan_for_budget`).

[Note: one plan on every rank]
Each rank measures its own activation bytes and compute time, and they differ (data, layout,
noise); ranks that planned from their own numbers could choose different strategies and pair
collectives of different kinds and sizes (a hang or wrong sums), as [Note: auto bucket re-plan]
says of bucket boundaries. So every measured number goes through one all-reduce MAX over the
whole dp group (every replica of a hybrid split included) before deciding: every rank then plans
from the most pessimistic figures. The decision itself is made once, on dp rank 0, and
broadcast (the pickled `BudgetPlan`): even a planner that depended on something rank-local
(a float's last bit on another CPU) could not split the ranks. At dp 1 nothing is sent.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import torch
from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.budget import (
    SHARDED,
    BudgetInputs,
    BudgetPlan,
    check_inputs,
    plan_budget,
)
from megabuf.planning.model_plan import sparse_grad_params
from megabuf.planning.replicas import embedding_weights, param_specs
from megabuf.pure.bucket_planner import CollectiveModel
from megabuf.sharding.formula import ADAM, OptimizerStateSpec
from megabuf.sharding.units import plan_units
from megabuf.transport.collectives import Collectives, Group
from megabuf.transport.devices import params_device
from megabuf.transport.process_groups import ProcessGroups

logger = logging.getLogger(__name__)
NS = 1e9  # measured seconds travel as integer nanoseconds; pico-seconds per byte likewise
PS = 1e12


def fixed_nbytes(module: nn.Module) -> int:
    """Frozen params and module buffers: kept as they are, outside the plan."""
    frozen = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
    return frozen + sum(b.numel() * b.element_size() for b in module.buffers())


def module_inputs(
    module: nn.Module,
    config: DistributedDataParallelConfig,
    *,
    device_budget_nbytes: int,
    dp_size: int,
    ep_size: int = 1,
    optimizer: OptimizerStateSpec = ADAM,
    **fields: object,
) -> BudgetInputs:
    """`BudgetInputs` for `module` (on any device, the meta device included): its trainable
    params as the engine plans them (sparse-grad params excluded, shared params once) and their
    ZeRO-3 units under `config.shard_units`; `fields`: other `BudgetInputs` fields."""
    sparse = {id(p) for p in sparse_grad_params(module, config)}
    trainable = [
        (n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) not in sparse
    ]
    with warnings.catch_warnings():  # the one-unit warning is for runs, not for plans
        warnings.simplefilter("ignore")
        units = plan_units(module, config.shard_units, trainable)
    return BudgetInputs(
        specs=param_specs(trainable, embedding_weights(module)),
        optimizer=optimizer,
        device_budget_nbytes=device_budget_nbytes,
        dp_size=dp_size,
        ep_size=ep_size,
        fixed_nbytes=fixed_nbytes(module),
        unit_of_param=units.unit_ids([n for n, _ in trainable]),
        base=config,
        **fields,  # type: ignore[arg-type]
    )


def agree_inputs(
    inputs: BudgetInputs, collectives: Collectives, group: Group, device: torch.device
) -> BudgetInputs:
    """`inputs` with every measured number replaced by its MAX over `group` ([Note: one plan on
    every rank])."""
    link, host = inputs.collective, inputs.host_link
    numbers = [
        inputs.activation_nbytes, round(inputs.step_compute_s * NS), round(link.latency_s * NS),
        round(link.seconds_per_byte * PS), round(host.latency_s * NS),
        round(host.seconds_per_byte * PS),
    ]  # fmt: skip
    tensor = torch.tensor(numbers, dtype=torch.int64, device=device)
    collectives.all_reduce_max(tensor, group)
    act, step, lat, spb, host_lat, host_spb = tensor.tolist()
    return dataclasses.replace(
        inputs, activation_nbytes=act, step_compute_s=step / NS,
        collective=CollectiveModel(lat / NS, spb / PS),
        host_link=CollectiveModel(host_lat / NS, host_spb / PS),
    )  # fmt: skip


def decide(
    inputs: BudgetInputs, collectives: Collectives, group: Group, device: torch.device
) -> BudgetPlan:
    """One `BudgetPlan` on every rank of `group`: inputs agreed by MAX, planned on group rank
    0, broadcast ([Note: one plan on every rank])."""
    check_inputs(inputs)  # on every rank: a refusal on rank 0 alone would leave the others waiting
    if Collectives.size(group) == 1:
        return plan_budget(inputs)
    agreed = agree_inputs(inputs, collectives, group, device)
    plan = plan_budget(agreed) if Collectives.rank(group) == 0 else None
    out = collectives.broadcast_object(plan, 0, group)
    if not isinstance(out, BudgetPlan):
        raise RuntimeError(f"megabuf: the budget plan broadcast from dp rank 0 was {out!r}")
    return out


def planned_config(
    module: nn.Module,
    config: DistributedDataParallelConfig,
    pgs: ProcessGroups,
    collectives: Collectives,
) -> DistributedDataParallelConfig:
    """`config` as given, or with `memory_budget` set the planner's choice for `module` over
    `pgs` (collective over dp; raises naming the smallest budget that would fit)."""
    if config.memory_budget is None:
        return config
    topo = pgs.topology
    device = params_device(list(module.parameters()), None)
    fields: dict[str, Any] = {}
    if pgs.hybrid:  # the groups are split already: plan within that split
        fields.update(shard_sizes=(topo.dp_shard_size,), strategies=SHARDED)
    scratch = collectives.strategy(pgs.dp, device).reduce_scatter == "all_to_all"
    inputs = module_inputs(
        module, config, device_budget_nbytes=config.memory_budget, dp_size=topo.dp_size,
        ep_size=topo.ep_size, accelerator=device.type != "cpu", reduce_scatter_scratch=scratch,
        **fields,
    )  # fmt: skip
    plan = decide(inputs, collectives, pgs.dp, device)
    chosen = plan.config
    if topo.rank == 0 and plan.chosen is not None:
        logger.info("megabuf: memory_budget %d B: chose %s", config.memory_budget,
                    plan.chosen.candidate.describe())  # fmt: skip
    return chosen
