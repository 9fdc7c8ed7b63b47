"""Rank-side code for the gradient-equivalence tests (runs inside DistPool workers).

Every case builds the same model on every rank, computes a single-process reference on the
whole global batch with a deep copy, runs megabuf DDP on this rank's slice, and returns the
largest deviation per param so the parent test can assert on it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import megabuf
from megabuf.layout import shard_pieces

GLOBAL_BATCH = 16
DIM = 12


class Net(nn.Module):
    """Small model exercising the awkward cases: shared weight, reused module, frozen layer."""

    def __init__(self, *, bf16_tail: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.block = nn.Linear(DIM, DIM)  # used twice per forward
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(not frozen)
        self.head = nn.Linear(DIM, DIM, bias=False)
        self.head.weight = self.embed.weight  # tied: one param, two uses
        self.tail = nn.Linear(DIM, 3)
        self.scale = nn.Parameter(torch.ones(DIM))
        if bf16_tail:
            self.tail.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h) * self.scale)
        h = self.frozen(h) + self.head(h)
        return self.tail(h.to(self.tail.weight.dtype)).float()


def make_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def local_slice(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def build(case: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
    """(model to wrap, reference copy). Ranks other than 0 perturb their copy: construction's
    broadcast_params must make every rank start from rank 0's weights."""
    torch.manual_seed(0)
    net = Net(bf16_tail=case.get("bf16", False), frozen=case.get("frozen", False))
    ref = copy.deepcopy(net)
    if dist.get_rank() != 0:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    return net, ref


def reference_grads(ref: nn.Module, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    for step in range(case.get("backwards", 1)):
        x, y = make_data(step)
        loss_fn(ref(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def run_ddp(net: nn.Module, case: dict[str, Any]) -> megabuf.DistributedDataParallel:
    cfg = megabuf.DistributedDataParallelConfig.from_dict(case.get("config", {}))
    model = megabuf.DistributedDataParallel(
        net, cfg, disable_bucketing=case.get("disable_bucketing", False)
    )
    micro = case.get("micro_batches", 1)
    for step in range(case.get("backwards", 1)):
        x, y = make_data(step)
        xs, ys = local_slice(x).chunk(micro), local_slice(y).chunk(micro)
        for i in range(micro):
            last = i == micro - 1
            ctx = model.no_sync() if not last else _null()
            with ctx:
                # mean over micro-batches of per-micro-batch means = mean over the local batch
                (loss_fn(model(xs[i]), ys[i]) / micro).backward()
        model.finish_grad_sync()
    return model


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def grad_errors(
    model: megabuf.DistributedDataParallel,
    names: dict[Any, str],
    expected: dict[str, torch.Tensor],
) -> dict[str, float]:
    """Max |megabuf grad - expected[names[param]]| per param: whole main_grads, or with the
    distributed optimizer only the pieces of this rank's shards (the reduced part)."""
    errors: dict[str, float] = {}
    if model.ddp_config.use_distributed_optimizer:
        for buf in model.buffers + model.expert_parallel_buffers:
            for piece in shard_pieces(buf.layout, buf.dp_rank, buf.dp_size):
                param = buf.params[piece.param_id]
                got = buf.grad_data[piece.buffer_start : piece.buffer_start + piece.numel]
                want = expected[names[param]].flatten()[piece.param_start : piece.param_end]
                err = (got.float() - want.float()).abs().max().item()
                errors[names[param]] = max(errors.get(names[param], 0.0), err)
    else:
        for param, name in names.items():
            errors[name] = (param.main_grad.float() - expected[name].float()).abs().max().item()
    return errors


def grad_case(case: dict[str, Any]) -> dict[str, Any]:
    """Max |megabuf grad - reference grad| per param (full grads, or shards with distopt)."""
    net, ref = build(case)
    expected = reference_grads(ref, case)
    model = run_ddp(net, case)
    names = model.param_to_name
    errors = grad_errors(model, names, expected)
    # param.grad must be the main_grad view itself (no copy) when dtypes match
    linked = all(p.grad is p.main_grad for p in names if p.dtype == p.main_grad.dtype)
    frozen = list(net.frozen.parameters()) if case.get("frozen") else []
    frozen_ok = all(p.grad is None and not hasattr(p, "main_grad") for p in frozen)
    return {
        "errors": errors,
        "n_buffers": len(model.buffers),
        "n_groups": len(model.bucket_groups),
        "linked": linked,
        "frozen_ok": frozen_ok,
        "all_params": sorted(names.values()),
        "scale": max(v.abs().max().item() for v in expected.values()),
    }
