"""Rank side of tests/test_engine_lifetime.py ([Note: hooks hold the engine weakly])."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch import nn

import megabuf


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)


def dropped_engine_case(strategy: str, gather: bool = False) -> dict[str, Any]:
    """Train one step, drop the engine and its optimizer (keeping the module), collect: is the
    engine gone, and does the kept module train as a plain module afterwards?"""
    module = _module()
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True,
        overlap_param_gather=gather,
    )  # fmt: skip
    model = megabuf.DistributedDataParallel(module, cfg)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adamw", lr=1e-3))
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    model.finish_grad_sync()
    opt.step()
    engine, group = weakref.ref(model), weakref.ref(model.engine.all_bucket_groups[0])
    # overlap_param_gather: the step left the gathers in flight ([Note: gathers outlive a
    # dropped group] in megabuf/buckets/dispatch.py); kept here only to see whether they were waited
    # for
    gathers = [g.param_gather for g in model.engine.all_bucket_groups]
    works = [gather.work for gather in gathers if gather.work is not None]
    in_flight = [p for work in works for p in work.pending]
    del model, opt, works, gathers
    gc.collect()  # the engine; its finalizer removes the kept module's hooks (the Note)
    gc.collect()  # what those hooks held
    out: dict[str, Any] = {"engine_alive": engine() is not None, "group_alive": group() is not None}
    out["in_flight"] = len(in_flight)
    out["unwaited"] = sum(len(p.handles) for p in in_flight)  # wait() empties them
    if strategy == "optim_grads_params":  # the kept module holds this rank's shards
        return out
    for p in module.parameters():
        p.grad = None
    plain = _module()
    plain.load_state_dict({k: v.detach().clone() for k, v in module.state_dict().items()})
    grads = []
    for m in (module, plain):
        nn.functional.mse_loss(m(x), y).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
    return out | {"grads_after": grads[0], "plain_grads": grads[1]}
