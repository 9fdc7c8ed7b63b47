"""Rank side of tests/test_autobucket.py's torch-style loops: bucket_size="auto" driven by a
torch optimizer's `zero_grad()` and backward's own grad sync, never `zero_grad_buffer()` or
`finish_grad_sync()` ([Note: auto bucket re-plan in a torch-style loop] in
megabuf/replan/autobucket.py)."""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from autobucket_cases import (
    MODEL,
    STEPS,
    WARMUP,
    _local,
    _max_diff,
    _ready_events_per_step,
    fake_measurement,
)

import megabuf
import megabuf.replan.warmup
from megabuf.pure.bucket_planner import CollectiveModel
from megabuf.testing.models import build_model, loss_fn, make_batch

GLOBAL_BATCH = 8


def _torch_step(model: Any, opt: Any, step: int, micro: int, set_to_none: bool) -> None:
    """The torch-DDP loop: the optimizer clears the grads, no_sync() around all micro-batches
    but the last, backward syncs at its end."""
    opt.zero_grad(set_to_none=set_to_none)
    for m in range(micro):
        x, y = make_batch(MODEL, GLOBAL_BATCH, seed=100 * step + m)
        with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
            loss_fn(MODEL)(model(_local(x)), _local(y)).backward()
    opt.step()


def _train(model: Any, micro: int, set_to_none: bool) -> list[str]:
    """STEPS steps with torch AdamW; the warnings megabuf gave."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            _torch_step(model, opt, step, micro, set_to_none)
    return [str(w.message) for w in caught if "megabuf" in str(w.message)]


def torch_loop_case(micro: int, in_place_rank: int | None = None) -> dict[str, Any]:
    """`micro` micro-batches per step; rank `in_place_rank` zeroes its grads in place
    (`set_to_none=False`), so that rank never shows cleared grads. The measurement is injected
    (asymmetric, favouring a new plan); the real one is read too, for the quiet step."""
    base = build_model(MODEL, seed=0)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=WARMUP
    )
    model = megabuf.DistributedDataParallel(copy.deepcopy(base), cfg)
    timeline = model.enable_timeline()
    auto = model.engine.auto
    assert auto is not None
    n, rank = len(model.engine.param_to_name), dist.get_rank()
    real: dict[str, Any] = {}

    def measure(dtype: Any) -> megabuf.replan.warmup.Measurement:
        got = megabuf.replan.warmup.measured(auto.timeline.events, n, CollectiveModel(0.0, 0.0))
        real.update(steps=got.steps, quiet=(got.quiet_backward_s, got.quiet_exposed_s))
        return replace(fake_measurement(n, rank), quiet_backward_s=0.0)  # overlap: no weighing

    auto.measure = measure  # type: ignore[method-assign]
    default_groups = len(model.engine.all_bucket_groups)
    set_to_none = rank != in_place_rank
    said = _train(model, micro, set_to_none)
    fixed_cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True)
    fixed = megabuf.DistributedDataParallel(copy.deepcopy(base), fixed_cfg)
    fixed.engine.rebucket(model.engine.plan)  # the plan it ended on, from the start
    _train(fixed, micro, set_to_none)
    default = megabuf.DistributedDataParallel(copy.deepcopy(base), fixed_cfg)
    _train(default, micro, set_to_none)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, model.engine.plan.bucket_ends)
    return {
        "replanned": auto.replanned,
        "kept": auto.kept,
        "same_plan": all(e == everyone[0] for e in everyone),
        "default_groups": default_groups,
        "groups": len(model.engine.all_bucket_groups),
        "ready_per_step": _ready_events_per_step(timeline.events),
        "real": real,
        "warnings": said,
        "hooks_left": len(auto._handles),
        "events_left": len(auto.timeline.events),
        "max_diff": _max_diff(model, fixed),
        "vs_default": _max_diff(model, default),
        "moved": _max_diff(model, megabuf.DistributedDataParallel(copy.deepcopy(base), fixed_cfg)),
    }
