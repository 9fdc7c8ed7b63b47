"""Rank-side code for the memory planner's gloo tests (runs inside DistPool workers).

Each case plans a model with `megabuf.plan_for_budget` over the real process groups (so the
ranks' measurements are agreed and the decision broadcast, [Note: one plan on every rank]),
builds what was chosen, trains two steps and returns the planner's per-rank prediction next to
the memory report, the storage walk and `check_peak` ([Note: planner proof after the first
step])."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from memory_cases import Small
from moe_cases import groups
from torch import nn

import megabuf
from megabuf.planning.budget import plan_budget
from megabuf.sharding.formula import DEVICE_CATEGORIES
from megabuf.testing.models import build_model, loss_fn, make_batch
from megabuf.training.budget import PlanPeakWarning, check_peak, measure_step

BASE = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True)


def _model_and_step(name: str, rank: int) -> tuple[nn.Module, Any]:
    """A fresh bf16 module (so that sharding saves memory even at dp 2 on gloo, whose
    reduce-scatter keeps landing zones) and `step(module)`: one forward and backward of this
    rank's batch."""
    torch.manual_seed(0)
    if name == "small":
        module: nn.Module = Small().to(torch.bfloat16)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))

        def small_step(m: nn.Module) -> None:
            m(x).square().mean().backward()

        return module, small_step
    module = build_model(name, seed=0).to(torch.bfloat16)
    inputs, targets = make_batch(module, 4, seed=rank)
    loss = loss_fn(name)

    def step(m: nn.Module) -> None:
        loss(m(inputs).float(), targets).backward()

    return module, step


def _budgets(module: nn.Module, activation_nbytes: int) -> list[int]:
    """Huge, half-way between the least feasible and what no_shard needs, and the least
    feasible (local plans): different choices of one model."""
    kw: dict[str, Any] = {"dp_size": groups().dp_size, "activation_nbytes": activation_nbytes}
    low = megabuf.plan_for_budget(module, 1, config=BASE, **kw).plan.needed_budget_nbytes
    high = megabuf.plan_for_budget(module, 10**12, config=BASE, **kw).chosen
    if low is None or high is None:
        raise RuntimeError("nothing fits")
    return [10**12, max(low, (low + int(high.device_nbytes / 0.9)) // 2), low]


def exact_case(name: str) -> list[dict[str, Any]]:
    """For each budget: the chosen config trained two steps; prediction against measurement."""
    out = []
    pgs = groups()
    module, step = _model_and_step(name, pgs.dp_rank)
    mine, _ = measure_step(module, step)  # as plan_for_budget will measure it (same shapes)
    agreed = torch.tensor([mine])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    budgets = _budgets(module, int(agreed.item()))
    for budget in budgets:
        module, step = _model_and_step(name, pgs.dp_rank)
        choice = megabuf.plan_for_budget(
            module, budget, process_groups=pgs, step_fn=step, config=BASE
        )
        chosen = choice.chosen
        if chosen is None:
            raise RuntimeError(f"{name} at {budget}: {choice.format()}")
        model = megabuf.DistributedDataParallel(module, choice.config, process_groups=pgs)
        opt = megabuf.build_optimizer(model, choice.optimizer_config)
        for _ in range(2):
            opt.zero_grad()
            step(model)
            opt.step()
        report = opt.memory_report()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check = check_peak(choice, model, opt)
        out.append({
            "budget": budget,
            "usable": int(budget * (1 - choice.plan.inputs.margin)),
            "candidate": chosen.candidate.describe(),
            "strategy": model.ddp_config.sharding.name,
            "predicted": {c: chosen.persistent_per_rank[pgs.dp_rank][c] for c in DEVICE_CATEGORIES},
            "measured": {c: report.persistent[c] for c in DEVICE_CATEGORIES},
            "fixed_predicted": chosen.device["frozen_and_buffers"],
            "fixed_measured": report.persistent["frozen_params"]
            + report.persistent["module_buffers"],
            "activations": chosen.device["activations"],
            "check": dataclasses.asdict(check),
            "warned": [str(w.message) for w in caught if issubclass(w.category, PlanPeakWarning)],
        })  # fmt: skip
    return out


def disagree_case() -> dict[str, Any]:
    """Ranks measure different activations, chosen so that each rank alone would decide
    differently; the agreed decision is one, planned from the MAX."""
    pgs = groups()
    module, _ = _model_and_step("gpt_tiny", pgs.dp_rank)
    huge = megabuf.plan_for_budget(module, 10**12, config=BASE, dp_size=pgs.dp_size)
    chosen = huge.chosen
    if chosen is None:
        raise RuntimeError("nothing fits at 10**12")
    # no_shard fits exactly with rank 0's activations and not with the larger ones
    mine = 1000 * (1 + pgs.dp_rank)
    budget = chosen.device_nbytes + 1000
    margin = 0.0
    local = plan_budget(
        dataclasses.replace(
            huge.plan.inputs, device_budget_nbytes=budget, margin=margin, activation_nbytes=mine
        )
    )
    agreed = megabuf.plan_for_budget(
        module, budget, process_groups=pgs, activation_nbytes=mine, config=BASE, margin=margin
    )
    return {
        "local": local.chosen.candidate.describe() if local.chosen else None,
        "agreed": agreed.chosen.candidate.describe() if agreed.chosen else None,
        "agreed_activations": agreed.plan.inputs.activation_nbytes,
        "mine": mine,
    }


def construction_case(fraction: float) -> dict[str, Any]:
    """`memory_budget` in the config: the engine plans at construction; returns its choice and
    the offline plan's for the same budget."""
    pgs = groups()
    module, step = _model_and_step("gpt_tiny", pgs.dp_rank)
    high = megabuf.plan_for_budget(module, 10**12, process_groups=pgs, config=BASE)
    low = megabuf.plan_for_budget(module, 1, process_groups=pgs, config=BASE)
    top, least = high.chosen.device_nbytes, low.plan.needed_budget_nbytes  # type: ignore[union-attr]
    budget = int(least + fraction * (top / 0.9 - least))  # type: ignore[operator]
    offline = megabuf.plan_for_budget(module, budget, process_groups=pgs, config=BASE)
    cfg = BASE.replace(memory_budget=budget)
    model = megabuf.DistributedDataParallel(module, cfg, process_groups=pgs)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adam", bf16=True))
    opt.zero_grad()
    step(model)
    opt.step()
    fields = ("data_parallel_sharding_strategy", "bucket_size", "prefetch_units",
              "num_distributed_optimizer_instances", "cpu_offload")  # fmt: skip
    return {
        "built": {f: getattr(model.ddp_config, f) for f in fields},
        "offline": {f: getattr(offline.config, f) for f in fields},
        "persistent": sum(opt.memory_report().persistent.values()),
        "budget": budget,
    }


def peak_warning_case() -> dict[str, Any]:
    """`check_peak` against a plan whose prediction is off by half: a PlanPeakWarning."""
    pgs = groups()
    module, step = _model_and_step("small", pgs.dp_rank)
    choice = megabuf.plan_for_budget(module, 10**9, process_groups=pgs, step_fn=step, config=BASE)
    model = megabuf.DistributedDataParallel(module, choice.config, process_groups=pgs)
    opt = megabuf.build_optimizer(model, choice.optimizer_config)
    opt.zero_grad()
    step(model)
    opt.step()
    chosen = choice.chosen
    assert chosen is not None
    wrong = dataclasses.replace(
        chosen, device={**chosen.device, "frozen_and_buffers": chosen.device_nbytes},
    )  # fmt: skip
    bad = dataclasses.replace(choice.plan, chosen=wrong)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = check_peak(bad, model, opt)
    return {
        "within": check.within_margin,
        "warned": [str(w.message) for w in caught if issubclass(w.category, PlanPeakWarning)],
    }
