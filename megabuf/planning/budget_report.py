"""`megabuf plan`'s output: a `BudgetPlan` as a readable table or as JSON-ready dicts (pure)."""

from __future__ import annotations

from typing import Any

from megabuf.planning.budget import SEARCHED_FIELDS, BudgetPlan, Evaluation

MiB = 1 << 20


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:9.3f}"


def evaluation_to_dict(ev: Evaluation) -> dict[str, Any]:
    c = ev.candidate
    return {
        "candidate": {
            "strategy": c.strategy, "shard_size": c.shard_size, "cpu_offload": c.cpu_offload,
            "bucket_size": c.bucket_size, "prefetch_units": c.prefetch_units,
            "grad_reduce_in_fp32": c.grad_reduce_in_fp32,
        },
        "fits": ev.fits,
        "device_nbytes": ev.device_nbytes if ev.config is not None else None,
        "host_nbytes": ev.host_nbytes if ev.config is not None else None,
        "device": dict(ev.device),
        "host": dict(ev.host),
        "exposed_comm_s": ev.exposed_comm_s if ev.config is not None else None,
        "step_s": ev.step_s if ev.config is not None else None,
        "reason": ev.reason,
    }  # fmt: skip


def plan_to_dict(plan: BudgetPlan) -> dict[str, Any]:
    """Everything `megabuf plan --json` prints."""
    inputs, chosen = plan.inputs, plan.chosen
    config = None
    if chosen is not None and chosen.config is not None:
        config = {name: getattr(chosen.config, name) for name in SEARCHED_FIELDS}
    return {
        "device_budget_nbytes": inputs.device_budget_nbytes,
        "host_budget_nbytes": inputs.host_budget_nbytes,
        "margin": inputs.margin,
        "dp_size": inputs.dp_size,
        "ep_size": inputs.ep_size,
        "optimizer": inputs.optimizer.name,
        "activation_nbytes": inputs.activation_nbytes,
        "step_compute_s": inputs.step_compute_s,
        "chosen": None if chosen is None else evaluation_to_dict(chosen),
        "config": config,
        "needed_budget_nbytes": plan.needed_budget_nbytes,
        "advice": list(plan.advice),
        "rejected": [evaluation_to_dict(e) for e in plan.rejected],
    }


def _row(ev: Evaluation, mark: str) -> str:
    if ev.config is None:
        return f"{mark} {ev.candidate.describe():<52} {'-':>9} {'-':>9} {'-':>9}  {ev.reason}"
    return (
        f"{mark} {ev.candidate.describe():<52} {_mib(ev.device_nbytes)} {_mib(ev.host_nbytes)} "
        f"{ev.exposed_comm_s * 1e3:9.3f}  {ev.reason or 'chosen'}"
    )


def format_plan(plan: BudgetPlan) -> str:
    """The table `megabuf plan` prints: the choice, its ledger, then every candidate."""
    inputs, chosen = plan.inputs, plan.chosen
    host = "" if inputs.host_budget_nbytes is None else f", host {inputs.host_budget_nbytes:,} B"
    lines = [
        f"budget: device {inputs.device_budget_nbytes:,} B{host}, margin {inputs.margin:.0%}; "
        f"dp {inputs.dp_size}, ep {inputs.ep_size}; optimizer {inputs.optimizer.name}; "
        f"activations {inputs.activation_nbytes:,} B; compute {inputs.step_compute_s * 1e3:.3f} ms"
    ]
    if chosen is None:
        lines.append(
            f"NOTHING FITS. Smallest device budget that would: {plan.needed_budget_nbytes or 0:,} "
            "B."
        )
        lines.extend(f"  - {a}" for a in plan.advice)
    else:
        lines.append(
            f"chosen: {chosen.candidate.describe()}; predicted step {chosen.step_s * 1e3:.3f} ms "
            f"(exposed communication {chosen.exposed_comm_s * 1e3:.3f} ms)"
        )
        lines.append("  device ledger (busiest rank; transient rows are upper bounds), MiB:")
        lines.extend(f"    {k:<20} {_mib(v)}" for k, v in chosen.device.items() if v)
        lines.append(f"    {'total':<20} {_mib(chosen.device_nbytes)}")
        lines.extend(f"  host {k:<15} {_mib(v)}" for k, v in chosen.host.items() if v)
    lines.append(f"  {'candidate':<52} {'dev MiB':>9} {'host MiB':>9} {'comm ms':>9}  reason")
    lines.extend(_row(e, "*" if e is chosen else " ") for e in plan.evaluations)
    return "\n".join(lines)
