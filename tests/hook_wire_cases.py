"""Rank side of tests/test_comm_hook_telemetry.py ([Note: hook wire bytes]): the same model with
no hook, Reduce, Compress(bf16) and Noop, a few steps each; what the engine's counter and each
model's `comm_hook_report()` saw, and `wire_formula` for every hooked bucket."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from grad_cases import Net, local_slice, loss_fn, make_data

import megabuf
from megabuf.comm_hooks import build, wire_formula

STEPS = 3
SPECS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "reduce": {"name": "reduce"},
    "bf16_wire": {"name": "compress", "dtype": "bfloat16"},
    "bf16_fp32": {"name": "compress", "dtype": "bfloat16", "accumulate": "fp32"},
    "noop": {"name": "noop"},
}


def _run(net: torch.nn.Module, spec: dict[str, Any] | None, config: dict[str, Any]) -> Any:
    model = megabuf.DistributedDataParallel(
        copy.deepcopy(net), megabuf.DistributedDataParallelConfig(**config)
    )
    if spec is not None:
        model.register_comm_hook(build(spec))
    model.engine.collectives.stats.reset()  # drop the start-up broadcast
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Noop's warning
        for step in range(STEPS):
            model.zero_grad_buffer()
            x, y = make_data(step)
            loss_fn(model(local_slice(x)), local_slice(y)).backward()
            model.finish_grad_sync()
    return model


def wire_case(config: dict[str, Any]) -> dict[str, Any]:
    """Per hook: the engine's ring bytes per op and step; the report's per-op ring bytes per
    step (summed over buckets), its per-step total, per-bucket dispatches, and the formula's
    per-step total; and a report after `reset=True` (empty counts)."""
    net = Net()
    out: dict[str, Any] = {}
    for label, spec in SPECS.items():
        model = _run(net, spec, config)
        engine = {op: v // STEPS for op, v in model.engine.collectives.stats.ring_nbytes.items()}
        report = model.engine.hooks.comm_hook_report()
        by_op: dict[str, int] = {}
        for b in report.buckets:
            for op, v in b.ring_nbytes.items():
                by_op[op] = by_op.get(op, 0) + v // b.dispatches
        buckets = [bucket for g in model.engine.all_bucket_groups for bucket in g.hook_buckets]
        formula = [wire_formula(spec, bucket) for bucket in buckets]
        out[label] = {
            "engine": engine,
            "report_by_op": by_op,
            "report_per_step": report.ring_nbytes_per_step,
            "dispatches": [b.dispatches for b in report.buckets],
            "formula_per_step": None if None in formula else sum(f or 0 for f in formula),
            "per_bucket_equal": [
                b.ring_nbytes_per_dispatch == f for b, f in zip(report.buckets, formula)
            ],
            "n_buckets": len(report.buckets),
            "numels": [b.numel for b in report.buckets],
            "hooks": sorted(report.by_hook()),
            "table_lines": len(report.table().splitlines()),
        }
        if spec is None:  # formula of the engine's own reduction, over the plain buckets
            out[label]["formula_per_step"] = _plain_formula(model)
        model.engine.hooks.comm_hook_report(reset=True)
        out[label]["after_reset"] = [
            (b.dispatches, b.total_ring_nbytes)
            for b in model.engine.hooks.comm_hook_report().buckets
        ]
    return out


def _plain_formula(model: Any) -> int:
    """`wire_formula(None, view)` over views of a model without a hook: register a Reduce on a
    twin only to get the views (GradBucket), never step it."""
    twin = megabuf.DistributedDataParallel(
        copy.deepcopy(model.module), model.ddp_config, process_groups=model.process_groups
    )
    twin.register_comm_hook(build({"name": "reduce"}))
    views = [b for g in twin.engine.all_bucket_groups for b in g.hook_buckets]
    return sum(wire_formula(None, v) or 0 for v in views)
