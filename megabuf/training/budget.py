"""`megabuf.plan_for_budget`: which configuration fits this many bytes, and how fast it is.

The pure planner ([Note: memory planner] in megabuf/planning/budget.py) fed from a module:
its params (a module on the meta device works: nothing is allocated), the optimizer, the
budget and the dp topology, and one step's activation bytes, measured here by running
`step_fn` once on this rank or given. With process groups the measurements are agreed and the
decision broadcast ([Note: one plan on every rank] in budget_agree.py).

[Note: planner proof after the first step]
`check_peak(choice, model, optimizer)` compares, after the first real step, what the planner
predicted for this rank with what the step held: on a GPU `torch.cuda.max_memory_allocated`
against the whole device prediction (activations included); on CPU, where no allocator keeps
a high-water mark, the engine's own bytes: the storage walk's persistent bytes (the walk less
what the ledger holds transiently now, [Note: storage walk]) plus the ledger's transient
high-water marks, against the prediction less activations. The persistent part is exact by
construction (the planner uses the formula the ledger is tested against); a gap beyond the
margin (of the prediction) raises a `PlanPeakWarning` naming both figures.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.optimizer.config import OptimizerConfig
from megabuf.planning.budget import DEFAULT_MARGIN, BudgetPlan, Evaluation, plan_budget
from megabuf.planning.budget_agree import decide, module_inputs
from megabuf.planning.budget_report import format_plan, plan_to_dict
from megabuf.pure.bucket_planner import CollectiveModel
from megabuf.sharding.formula import ADAM, SGD, SGD_MOMENTUM, OptimizerStateSpec
from megabuf.sharding.walk import storage_walk
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups


class PlanPeakWarning(UserWarning):
    """The measured peak of the first step differs from the planner's prediction by more than
    the margin ([Note: planner proof after the first step])."""


@dataclass(frozen=True)
class BudgetChoice:
    """What `plan_for_budget` returns: the plan and the optimizer config to build with it."""

    plan: BudgetPlan
    optimizer_config: OptimizerConfig

    @property
    def config(self) -> DistributedDataParallelConfig:
        """The chosen DDP config; raises naming the smallest budget that fits when none does."""
        return self.plan.config

    @property
    def chosen(self) -> Evaluation | None:
        return self.plan.chosen

    def format(self) -> str:
        return format_plan(self.plan)

    def to_dict(self) -> dict[str, Any]:
        return plan_to_dict(self.plan)


@dataclass(frozen=True)
class PeakCheck:
    """Predicted against measured bytes of this rank's first step."""

    predicted_nbytes: int
    measured_nbytes: int
    predicted_persistent_nbytes: int
    measured_persistent_nbytes: int
    source: str  # "cuda max_memory_allocated" or "ledger + storage walk"
    within_margin: bool

    @property
    def gap_nbytes(self) -> int:
        return self.predicted_nbytes - self.measured_nbytes


def optimizer_state_spec(
    optimizer: str | OptimizerConfig | OptimizerStateSpec,
) -> OptimizerStateSpec:
    """The per-param state of an optimizer choice ("adam", "adamw", "sgd", an `OptimizerConfig`
    or an explicit `OptimizerStateSpec`)."""
    if isinstance(optimizer, OptimizerStateSpec):
        return optimizer
    name = optimizer.optimizer if isinstance(optimizer, OptimizerConfig) else optimizer
    if name in ("adam", "adamw"):
        return ADAM
    if name == "sgd":
        momentum = optimizer.sgd_momentum if isinstance(optimizer, OptimizerConfig) else 0.9
        return SGD_MOMENTUM if momentum else SGD
    raise ValueError(
        f"megabuf: plan_for_budget has no state formula for optimizer {name!r}; pass "
        "'adam', 'adamw', 'sgd', an OptimizerConfig of those, or an OptimizerStateSpec"
    )


def measure_step(module: nn.Module, step_fn: Callable[[nn.Module], Any]) -> tuple[int, float]:
    """(activation bytes, seconds) of one `step_fn(module)` (forward and backward) on this rank:
    the bytes autograd saves for backward (unique storages), and on CUDA at least the rise of
    the allocator's peak over what was allocated before, less the grads the backward left
    (which the engine's buffers hold instead); the grads are dropped."""
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[(t.device.type, storage.data_ptr())] = storage.nbytes()
        return t

    cuda = torch.cuda.is_available() and any(p.is_cuda for p in module.parameters())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step_fn(module)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    nbytes = sum(saved.values())
    if cuda:  # the rise of the peak, less the grads the backward left (not activations)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters()
                    if p.grad is not None)  # fmt: skip
        nbytes = max(nbytes, torch.cuda.max_memory_allocated() - before - grads)
    for p in module.parameters():
        p.grad = None
    return nbytes, seconds


def plan_for_budget(
    model: nn.Module,
    device_budget_nbytes: int,
    *,
    optimizer: str | OptimizerConfig | OptimizerStateSpec = "adam",
    dp_size: int | None = None,
    ep_size: int = 1,
    process_groups: ProcessGroups | None = None,
    host_budget_nbytes: int | None = None,
    activation_nbytes: int | None = None,
    step_fn: Callable[[nn.Module], Any] | None = None,
    step_compute_s: float = 0.0,
    config: DistributedDataParallelConfig | None = None,
    margin: float = DEFAULT_MARGIN,
    dp_shard_sizes: Sequence[int] | None = None,
    collective: CollectiveModel | None = None,
    vary_grad_reduce_in_fp32: bool = False,
    gloo: bool | None = None,
    accelerator: bool | None = None,
) -> BudgetChoice:
    """The configuration of `model` that fits `device_budget_nbytes` per rank with `margin` to
    spare, with the least predicted exposed communication, then the least memory; every other
    candidate with its reason; see [Note: memory planner]. Activations: `activation_nbytes`, or
    measured by running `step_fn(model)` (forward and backward) once on this rank, or 0. With
    `process_groups` (collective over dp) every rank gets the same decision, planned from the
    MAX of the ranks' measurements; else `dp_size` ranks are assumed. `gloo`: the
    reduce-scatter keeps landing zones (default: the params are on the CPU); `accelerator`: the
    params will live on an accelerator, so cpu_offload moves bytes (default: they are on one)."""
    config = config or DistributedDataParallelConfig(overlap_grad_reduce=True)
    measured_s = step_compute_s
    if activation_nbytes is None:
        activation_nbytes = 0
        if step_fn is not None:
            activation_nbytes, measured_s = measure_step(model, step_fn)
    device = next(model.parameters()).device
    topo = process_groups.topology if process_groups is not None else None
    fields: dict[str, Any] = dict(
        host_budget_nbytes=host_budget_nbytes, activation_nbytes=activation_nbytes,
        margin=margin,
        accelerator=device.type not in ("cpu", "meta") if accelerator is None else accelerator,
        reduce_scatter_scratch=device.type in ("cpu", "meta") if gloo is None else gloo,
        step_compute_s=measured_s, vary_grad_reduce_in_fp32=vary_grad_reduce_in_fp32,
        shard_sizes=tuple(dp_shard_sizes) if dp_shard_sizes else None,
    )  # fmt: skip
    if collective is not None:
        fields["collective"] = collective
    inputs = module_inputs(
        model, config, device_budget_nbytes=device_budget_nbytes,
        dp_size=topo.dp_size if topo else (dp_size or 1), ep_size=topo.ep_size if topo else ep_size,
        optimizer=optimizer_state_spec(optimizer), **fields,
    )  # fmt: skip
    if process_groups is None:
        plan = plan_budget(inputs)
    else:
        plan = decide(inputs, Collectives(), process_groups.dp, device)
    return BudgetChoice(plan, _optimizer_config(optimizer, model))


def _optimizer_config(
    optimizer: str | OptimizerConfig | OptimizerStateSpec, model: nn.Module
) -> OptimizerConfig:
    """The optimizer config to build with: the one given, or one of the named optimizer, with
    `bf16` / `fp16` from the params' dtype."""
    if isinstance(optimizer, OptimizerConfig):
        return optimizer
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    name = optimizer if isinstance(optimizer, str) else "adam"
    return OptimizerConfig(
        optimizer=name, bf16=torch.bfloat16 in dtypes, fp16=torch.float16 in dtypes
    )


def check_peak(choice: BudgetChoice | BudgetPlan, model: Any, optimizer: Any) -> PeakCheck:
    """After the first real step: this rank's predicted against measured bytes, and a
    `PlanPeakWarning` when they differ by more than the margin ([Note: planner proof after the
    first step])."""
    plan = choice.plan if isinstance(choice, BudgetChoice) else choice
    chosen = plan.chosen
    if chosen is None:
        raise ValueError("megabuf: check_peak needs a plan that chose a configuration")
    topo = model.process_groups.topology
    rank = topo.dp_shard_rank if model.process_groups.hybrid else topo.dp_rank
    mine = chosen.persistent_per_rank[rank]
    persistent = sum(v for c, v in mine.items() if c in chosen.device)
    persistent += chosen.device["frozen_and_buffers"]
    predicted = _predicted_for_rank(chosen, rank)
    report = optimizer.memory_report()
    device = next(model.parameters()).device
    if device.type == "cuda":
        measured, source = torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
        target, measured_persistent = predicted, sum(report.persistent.values())
    else:
        now = sum(report.transient_now.values())
        measured_persistent = storage_walk(model, optimizer).get(device.type, 0) - now
        measured = measured_persistent + sum(report.transient_peak.values())
        measured += report.transient_now.get("grad_copies", 0)
        source, target = "ledger + storage walk", predicted - chosen.device["activations"]
    within = abs(target - measured) <= plan.inputs.margin * target
    check = PeakCheck(target, measured, persistent, measured_persistent, source, within)
    if not within:
        warnings.warn(
            f"megabuf: the first step held {measured:,} B ({source}) where the planner "
            f"predicted {target:,} B for dp rank {topo.dp_rank}: a gap of "
            f"{target - measured:,} B, beyond the {plan.inputs.margin:.0%} margin",
            PlanPeakWarning,
            stacklevel=2,
        )
    return check


def _predicted_for_rank(chosen: Evaluation, rank: int) -> int:
    """The chosen candidate's device total with this rank's persistent figures."""
    mine = chosen.persistent_per_rank[rank]
    return sum(mine.get(c, v) for c, v in chosen.device.items())
