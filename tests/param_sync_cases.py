"""Rank side of tests/test_param_sync.py: Megatron's ways to read params after an overlapped
distributed-optimizer step ([Note: who waits for param gathers] in ddp.py).

Each case trains `Net` (optimizer_cases) with `build_optimizer` AdamW under overlap_grad_reduce
and overlap_param_gather, with small buckets (several bucket groups), and after every step runs
one idiom and records what it read next to the single-process `Reference` after the same step.
The last rank sleeps before its step (`SLOW_S`), so on every other rank the step's gathers are
still in flight (their peer has not joined them yet) when the idiom runs: a call that returns
without waiting reads stale shards there every time, not by chance."""

from __future__ import annotations

import io
import time
from typing import Any

import torch
import torch.distributed as dist
from optimizer_cases import (
    DIM,
    Reference,
    build_model,
    build_opt,
    local_slice,
    loss_fn,
    make_data,
)

from megabuf.buckets.bucket_group import ParamSyncState

SLOW_S = 0.15
STEPS = 2
CASE: dict[str, Any] = {
    "optimizer": "adamw",
    "builder": True,
    "ddp": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
        "bucket_size": 50,
    },
}
IDIOMS = (
    "start_param_sync_force_sync",
    "disable_eval_enable",
    "disable_without_param_sync_eval",
    "disable_hand_rolled_checkpoint_enable",
    "broadcast_params",
)


def _probe() -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(7))


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _read(model: Any, idiom: str) -> dict[str, torch.Tensor]:
    """What a Megatron user reads with `idiom` right after the step."""
    if idiom == "start_param_sync_force_sync":
        model.start_param_sync(force_sync=True)
        return _params(model.module)
    if idiom == "broadcast_params":  # writes into params: no gather may land on top
        model.broadcast_params()
        return _params(model.module)
    if idiom == "disable_hand_rolled_checkpoint_enable":
        model.disable_forward_pre_hook()
        blob = io.BytesIO()
        torch.save(model.module.state_dict(), blob)  # not megabuf's: nothing of ours waits
        model.enable_forward_pre_hook()
        blob.seek(0)
        return torch.load(blob)
    model.disable_forward_pre_hook(param_sync=idiom == "disable_eval_enable")
    with torch.no_grad():
        out = model(_probe())
    model.enable_forward_pre_hook()
    return {"eval_output": out}


def _expected(ref: Reference, idiom: str) -> dict[str, torch.Tensor]:
    if idiom in ("disable_eval_enable", "disable_without_param_sync_eval"):
        with torch.no_grad():
            return {"eval_output": ref.model(_probe())}
    return _params(ref.model)


def idiom_case(idiom: str) -> list[dict[str, Any]]:
    """Per step: whether a gather was in flight before the idiom, the largest deviation of what
    it read from the reference, and the group states after it."""
    model, ref = build_model(CASE), Reference(CASE)
    opt = build_opt(model, CASE)
    slow = dist.get_rank() == dist.get_world_size() - 1
    out = []
    for step in range(STEPS):
        x, y = make_data(step)
        opt.zero_grad()
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
        if slow:
            time.sleep(SLOW_S)  # the peers' gathers cannot complete before this rank's step
        opt.step()
        ref.step(step)
        in_flight = any(
            g.param_state is ParamSyncState.DISPATCHED for g in model.engine.all_bucket_groups
        )
        got, want = _read(model, idiom), _expected(ref, idiom)
        errors = {k: (got[k].float() - want[k].float()).abs().max().item() for k in want}
        states = sorted({g.param_state.value for g in model.engine.all_bucket_groups})
        out.append({"in_flight": in_flight, "errors": errors, "states_after": states})
    return out
