"""Rank-side cases for test_join.py: uneven inputs under torch's Join (issue 40), world size 2.

Rank r trains on `counts[r]` batches. no_shard runs stock torch DDP + Join in the same ranks on
the same data as the reference (bitwise: fp32 on gloo); the distributed optimizer is checked
against a single-process reference that sums the active ranks' grads each iteration."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from moe_cases import groups
from torch import nn
from torch.distributed.algorithms.join import Join

import megabuf
from megabuf.comm_hooks import build as build_hook
from megabuf.transport.collectives import Collectives


def _batch(k: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * k + rank)
    return torch.randn(4, 6, generator=gen) * (1 + rank), torch.randn(4, 3, generator=gen)


def _net(norm: bool) -> nn.Module:
    torch.manual_seed(0)
    if norm:  # module buffers: broadcast_buffers under Join
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _state(net: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*net.parameters(), *net.buffers()]]


def _torch_loop(model: Any, counts: tuple[int, int], join: Any, accum: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with join(model):
        for k in range(counts[dist.get_rank()]):
            for micro in range(accum):
                x, y = _batch(k * accum + micro, dist.get_rank())
                if micro < accum - 1:
                    with model.no_sync():
                        nn.functional.mse_loss(model(x), y).backward()
                    continue
                nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def vs_torch_ddp(
    counts: tuple[int, int], divide: bool, cfg: dict[str, Any], accum: int = 1,
    args: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The same loop on torch DDP and on megabuf, each inside `model.join(divide...)`: every
    rank ends with bitwise torch's params and BatchNorm buffers."""

    def join(model: Any) -> Any:
        return model.join(divide_by_initial_world_size=divide)

    out = {}
    for name in ("torch", "megabuf"):
        net = _net(norm=True)
        if name == "torch":
            model: Any = nn.parallel.DistributedDataParallel(net, **(args or {}))
        else:
            model = megabuf.DistributedDataParallel(
                net, megabuf.DistributedDataParallelConfig(**cfg), **(args or {})
            )
        _torch_loop(model, counts, join, accum)
        out[name] = _state(net)
    pairs = list(zip(out["torch"], out["megabuf"], strict=True))
    return {
        "equal": all(torch.equal(a, b) for a, b in pairs),
        "max_diff": max((a - b).abs().max().item() for a, b in pairs),
        "config_left": model._join_config.enable,
    }


def _halving(step: int) -> float:
    return 0.5**step


def _reference(
    counts: tuple[int, int], divide: bool, clip: float, steps: int, schedule: bool
) -> list[torch.Tensor]:
    """One process: each iteration the active ranks' grads summed, divided by 2 or by the
    number active, clipped to `clip`, one SGD step."""
    net = _net(norm=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _halving) if schedule else None
    for k in range(steps):
        active = [r for r in range(2) if k < counts[r]]
        total = [torch.zeros_like(p) for p in net.parameters()]
        for r in active:
            net.zero_grad(set_to_none=True)
            x, y = _batch(k, r)
            nn.functional.mse_loss(net(x), y).backward()
            for t, p in zip(total, net.parameters(), strict=True):
                t.add_(p.grad / (2 if divide else len(active)))
        for t, p in zip(total, net.parameters(), strict=True):
            p.grad = t
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return [p.detach().clone() for p in net.parameters()]


def megabuf_opt_vs_reference(
    counts: tuple[int, int], divide: bool, cfg: dict[str, Any], clip: float,
    loss_scale: float | None = None, schedule: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """A megabuf optimizer in Join([model, opt]); with use_distributed_optimizer (ZeRO-1) the
    joined rank shadows the reduce-scatter, its shard's step (zero contribution, clip norm)
    and the param all-gather; with a loss scale the found-inf all-reduce. Every rank's params
    match the single-process reference."""
    net = _net(norm=False)
    model = megabuf.DistributedDataParallel(net, megabuf.DistributedDataParallelConfig(**cfg))
    opt = megabuf.build_optimizer(
        model,
        megabuf.OptimizerConfig(
            optimizer="sgd", lr=0.1, sgd_momentum=0.9, clip_grad=clip, loss_scale=loss_scale
        ),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _halving) if schedule else None
    with Join([model, opt], divide_by_initial_world_size=divide):
        for k in range(counts[dist.get_rank()]):
            opt.zero_grad()
            x, y = _batch(k, dist.get_rank())
            opt.scale_loss(nn.functional.mse_loss(model(x), y)).backward()
            opt.step()
            if sched is not None:
                sched.step()
    model.publish_params()
    left = model._join_config.enable or opt._join_config.enable
    ref = _reference(counts, divide, clip, max(counts), schedule)
    diffs = [(p - q).abs().max().item() for p, q in zip(net.parameters(), ref, strict=True)]
    return {
        "max_diff": max(diffs), "params": [p.detach().clone() for p in net.parameters()],
        "join_mode_left": not left,
    }  # fmt: skip


def throws(counts: tuple[int, int]) -> dict[str, Any]:
    """throw_on_early_termination=True: every rank raises once one ran out."""
    model = megabuf.DistributedDataParallel(_net(norm=False))
    steps = 0
    try:
        with model.join(throw_on_early_termination=True):
            for k in range(counts[dist.get_rank()]):
                x, y = _batch(k, dist.get_rank())
                nn.functional.mse_loss(model(x), y).backward()
                steps += 1
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    return {"message": message, "steps": steps}


class _Counting(Collectives):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().all_reduce(*args, **kwargs)

    def all_reduce_many(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().all_reduce_many(*args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        super().broadcast(*args, **kwargs)

    def notify_join(self, joinable: Any) -> Any:
        self.calls += 1
        return super().notify_join(joinable)


def disabled() -> dict[str, Any]:
    """enable=False with even inputs: the same collectives and params as with no Join."""
    out = {}
    for name in ("plain", "disabled"):
        counting = _Counting()
        net = _net(norm=True)
        model = megabuf.DistributedDataParallel(net, collectives=counting)
        counting.calls = 0
        join = model.join(enable=False) if name == "disabled" else _Nothing()
        with join:
            for k in range(2):
                x, y = _batch(k, dist.get_rank())
                nn.functional.mse_loss(model(x), y).backward()
        out[name] = (counting.calls, _state(net))
    (calls_a, a), (calls_b, b) = out.values()
    return {"calls": (calls_a, calls_b), "equal": all(torch.equal(x, y) for x, y in zip(a, b))}


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def refusal(kind: str) -> str:
    """What building the Join raises (on every rank, before any collective)."""
    if kind in ("optim_grads", "optim_grads_params"):
        cfg = megabuf.DistributedDataParallelConfig(data_parallel_sharding_strategy=kind)
        model = megabuf.DistributedDataParallel(_net(norm=False), cfg)
        make = model.join
    elif kind == "comm_hook":
        model = megabuf.DistributedDataParallel(_net(norm=False))
        model.register_comm_hook(build_hook({"name": "reduce"}))
        make = model.join
    elif kind in ("error_on_unused_params", "auto_bucket", "pipeline"):
        cfg = megabuf.DistributedDataParallelConfig(
            error_on_unused_params=kind == "error_on_unused_params",
            bucket_size="auto" if kind == "auto_bucket" else None,
            overlap_grad_reduce=kind == "auto_bucket",
        )
        pgs = groups(pp_size=2) if kind == "pipeline" else None
        model = megabuf.DistributedDataParallel(_net(norm=False), cfg, process_groups=pgs)
        make = model.join
    elif kind == "two_models":
        first = megabuf.DistributedDataParallel(_net(norm=False))
        second = megabuf.DistributedDataParallel(_net(norm=False))
        make = lambda: Join([first, second])  # noqa: E731
    else:
        cfg = megabuf.DistributedDataParallelConfig(use_distributed_optimizer=True)
        model = megabuf.DistributedDataParallel(_net(norm=False), cfg)
        opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(lr=0.1))
        make = {
            "optimizer_left_out": model.join,
            "optimizer_first": lambda: Join([opt, model]),
        }[kind]
    try:
        make()
    except ValueError as exc:
        return str(exc)
    return "no error"


def first_forward_missing() -> str:
    """overlap_param_gather, a rank with no batch at all: it cannot know the forward read order
    the step's gathers follow; every rank raises at the first exchange (no hang)."""
    cfg = megabuf.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True
    )
    model = megabuf.DistributedDataParallel(_net(norm=False), cfg)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(lr=0.1))
    try:
        with Join([model, opt]):
            for k in range((0, 2)[dist.get_rank()]):
                x, y = _batch(k, dist.get_rank())
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"
