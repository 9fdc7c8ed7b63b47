"""Rank side of tests/test_create_graph.py: second-order autograd with megabuf on gloo ranks
against a single-process reference of the global batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import megabuf

WIDTH = 80  # the first Linear's weight (6400 elements) is large, the rest small


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))


def _penalized(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty (as in WGAN-GP): the input grad, taken with create_graph=True, enters
    the loss, so backward runs through the graph of a first backward."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.pow(2).mean() + dx.pow(2).sum(dim=1).mean()


def _reference(steps: int, world: int) -> dict[str, torch.Tensor]:
    """The params after `steps` SGD steps on the global batch."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            (_penalized(net, _batch(rank, step)) / world).backward()
        opt.step()
    return {n: p.detach() for n, p in net.named_parameters()}


def gradient_penalty_case(strategy: str) -> dict[str, Any]:
    """Three SGD steps with a gradient penalty under `strategy`: the params against the
    reference's, and how far they moved (so the comparison can fail)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, data_parallel_sharding_strategy=strategy
    )
    model = megabuf.DistributedDataParallel(_net(), cfg)
    plain_sgd = megabuf.OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0)
    opt = megabuf.build_optimizer(model, plain_sgd)
    for step in range(3):
        opt.zero_grad()
        _penalized(model, _batch(rank, step)).backward()
        model.finish_grad_sync()
        opt.step()
    got = model.state_dict()  # waits for param gathers, gathers ZeRO-3 units
    want, start = _reference(3, world), dict(_net().named_parameters())
    return {
        "error": max((got[n] - w).abs().max().item() for n, w in want.items()),
        "moved": max((got[n] - start[n]).abs().max().item() for n in want),
    }


def _raised(run: Any) -> str:
    """The message of the RuntimeError `run()` raises ("" if none)."""
    try:
        run()
    except RuntimeError as exc:
        return str(exc)
    return ""


def _plain_reference(world: int) -> nn.Module:
    """The reference net after a plain backward of step 1's global batch."""
    ref = _net()
    for r in range(world):
        (ref(_batch(r, 1)).pow(2).mean() / world).backward()
    return ref


def create_graph_refused_case() -> dict[str, Any]:
    """backward(create_graph=True) raises naming a param and the rank; after
    reset_iter_state() a plain step's grads equal the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = megabuf.DistributedDataParallel(
        copy.deepcopy(_net()), megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True)
    )
    error = _raised(lambda: model(_batch(rank, 0)).pow(2).mean().backward(create_graph=True))
    model.reset_iter_state()
    model.zero_grad_buffer()
    model(_batch(rank, 1)).pow(2).mean().backward()
    model.finish_grad_sync()
    ref = _plain_reference(world)
    got = dict(model.module.named_parameters())
    err = max((got[n].grad - p.grad).abs().max().item() for n, p in ref.named_parameters())  # type: ignore[operator]
    return {"error": error, "after": err}


def zero3_penalty_refused_case() -> dict[str, Any]:
    """Under optim_grads_params a create_graph backward raises by name (the graph it builds
    reads released unit params); after reset_iter_state() a plain step trains like the
    reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    model = megabuf.DistributedDataParallel(_net(), cfg)
    plain_sgd = megabuf.OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0)
    opt = megabuf.build_optimizer(model, plain_sgd)
    error = _raised(lambda: _penalized(model, _batch(rank, 0)))
    model.reset_iter_state()
    opt.zero_grad()
    model(_batch(rank, 1)).pow(2).mean().backward()
    model.finish_grad_sync()
    opt.step()
    ref = _plain_reference(world)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad  # type: ignore[operator]
    got = model.state_dict()
    return {
        "error": error,
        "after": max((got[n] - p).abs().max().item() for n, p in ref.named_parameters()),
    }


def no_param_backward_case() -> dict[str, Any]:
    """Rank 0's backward reaches no param (`torch.autograd.grad` of its input only, then no
    backward): it does not sync there, and its `finish_grad_sync()` pairs with rank 1's sync at
    backward end; both hold rank 1's grads / 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = megabuf.DistributedDataParallel(
        _net(), megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True)
    )
    model.zero_grad_buffer()
    x = _batch(rank, 0).requires_grad_(True)
    out = model(x)
    if rank == 0:
        torch.autograd.grad(out.sum(), x)
    else:
        out.pow(2).mean().backward()
    synced_at_backward_end = model.engine.sync.unsynced_group() is None
    model.finish_grad_sync()
    ref = _net()
    (ref(_batch(1, 0)).pow(2).mean() / world).backward()
    got = dict(model.module.named_parameters())
    err = max((got[n].grad - p.grad).abs().max().item() for n, p in ref.named_parameters())  # type: ignore[operator]
    return {"synced_at_backward_end": synced_at_backward_end, "error": err}
