"""Rank side of tests/test_hotpath.py: collectives per bucket group, and bf16 grad shards upcast
in windows ([Note: one collective per bucket group], [Note: bf16 grads without an fp32 copy])."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from grad_cases import Net, local_slice, loss_fn, make_data

import megabuf
from megabuf.optimizer.distributed import DistributedOptimizer
from megabuf.transport.collective_backends import CollectiveStrategy
from megabuf.transport.collectives import Collectives

NATIVE_COALESCED = {
    ("gloo", "cpu"): CollectiveStrategy(
        reduce_scatter="native", all_gather="native", has_avg=False, coalesce="manager"
    )
}


def _model(net: torch.nn.Module, case: dict[str, Any], disable: bool) -> Any:
    cfg = megabuf.DistributedDataParallelConfig(
        bucket_size=1, use_distributed_optimizer=case.get("distopt", False)
    )
    coll = Collectives(NATIVE_COALESCED) if case.get("coalesce") else Collectives()
    return megabuf.DistributedDataParallel(
        copy.deepcopy(net), cfg, disable_bucketing=disable, collectives=coll
    )


def _backward(model: Any) -> None:
    x, y = make_data(0)
    loss_fn(model(local_slice(x)), local_slice(y)).backward()


def coalesce_case(case: dict[str, Any]) -> dict[str, Any]:
    """One bucket group of two buffers (disable_bucketing), coalesced or not, against the same
    layout with the default strategy (no batching):
    collectives issued per group, and the reduced grads (this rank's shards) bitwise."""
    torch.manual_seed(0)
    net = Net(bf16_tail=True)  # two buffers: fp32 and bf16
    one, many = _model(net, case, True), _model(net, {**case, "coalesce": False}, True)
    stats = one.engine.collectives.stats
    stats.reset()
    _backward(one)
    one.finish_grad_sync()
    calls = dict(stats.calls)
    _backward(many)
    many.finish_grad_sync()
    same = all(torch.equal(_reduced(a), _reduced(b)) for a, b in zip(one.buffers, many.buffers))
    gathers = None
    if case.get("distopt"):
        stats.reset()
        (group,) = one.engine.all_bucket_groups
        group.mark_params_stale()
        group.start_param_sync(force_sync=True)
        gathers = stats.calls.get("all_gather", 0)
    return {
        "calls": calls,
        "gathers": gathers,
        "same": same,
        "n_groups": len(one.engine.all_bucket_groups),
        "n_buffers": len(one.buffers),
        "n_buckets": sum(len(b.buckets) for b in one.buffers),
    }


def _reduced(buffer: Any) -> torch.Tensor:
    """The buffer's reduced grads on this rank: all of it, or its shard of every bucket."""
    if buffer.param_data is None:
        return buffer.grad_data
    ranges = [buffer.shard_range(b.bucket_id) for b in buffer.buckets]
    return torch.cat([buffer.grad_data[lo:hi] for lo, hi in ranges])


def upcast_case(window: int) -> dict[str, Any]:
    """bf16 model, bf16 grad buffers, distributed optimizer: the same run with one full fp32
    grad copy and with upcast windows of `window` elements; params after 3 clipped AdamW steps."""
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    runs = []
    for numel in (None, window):
        cfg = megabuf.DistributedDataParallelConfig(bucket_size=64, use_distributed_optimizer=True)
        model = megabuf.DistributedDataParallel(copy.deepcopy(net), cfg)
        opt = DistributedOptimizer(model, torch.optim.AdamW, clip_grad=0.05, lr=1e-2)
        opt.grad_upcast_window_numel = numel
        norms = []
        for step in range(3):
            opt.zero_grad()
            x, y = make_data(step)
            loss_fn(model(local_slice(x.bfloat16())), local_slice(y)).backward()
            model.finish_grad_sync()
            norms.append(opt.step().grad_norm)
        params = torch.cat([b.param_data for b in model.buffers])
        runs.append((params, norms, opt.memory_report(), opt))
    (p0, n0, r0, opt0), (p1, n1, r1, _) = runs
    # a class megabuf cannot know to be per-param (a user's subclass) keeps the full copy
    user_cls = type("UserAdamW", (torch.optim.AdamW,), {})
    user_model = megabuf.DistributedDataParallel(copy.deepcopy(net), cfg)
    user_opt = DistributedOptimizer(user_model, user_cls, clip_grad=0.05, lr=1e-2)
    user_opt.grad_upcast_window_numel = window
    r2 = user_opt.memory_report()
    half_numel = sum(mp.numel for mp in opt0.main_params)
    largest = max(mp.numel for mp in opt0.main_params)
    return {
        "same_params": torch.equal(p0, p1),
        "same_norms": n0 == n1,
        "clipped": all(n > 0.05 for n in n0),
        "full": (r0.grad_copy_nbytes, r0.grad_copy_saved_nbytes),
        "windowed": (r1.grad_copy_nbytes, r1.grad_copy_saved_nbytes),
        "user_class": (r2.grad_copy_nbytes, r2.grad_copy_saved_nbytes),
        "half_numel": half_numel,
        "largest_numel": largest,
        "world": dist.get_world_size(),
    }


def reverse_wait_case(case: dict[str, Any]) -> dict[str, Any]:
    """Two coalesced reduce-scatters with AVG emulated (a division epilogue each), waited in
    reverse order: each shard must equal its own uncoalesced result."""
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs = [torch.arange(8.0) * (rank + 1), torch.arange(4.0, dtype=torch.bfloat16) + rank]
    outs = [torch.empty(t.numel() // world, dtype=t.dtype) for t in inputs]
    coalesced = Collectives(NATIVE_COALESCED).reduce_scatter_many(
        outs, inputs, None, average=True, scratches=[None, None], scales=[1.0, 1.0]
    )
    for pending in reversed(coalesced):
        pending.wait()
    want = [torch.empty_like(o) for o in outs]
    for w, t in zip(want, inputs):
        Collectives().reduce_scatter(w, t, None, average=True, async_op=False)
    return {"same": all(torch.equal(o, w) for o, w in zip(outs, want))}
