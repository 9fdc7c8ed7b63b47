"""Rank-side code for the gradient-equivalence tests (runs inside DistPool workers).

Every case builds the same model on every rank, computes a single-process reference on the
whole global batch with a deep copy, runs megabuf DDP on this rank's slice, and returns the
largest deviation per param and its ratio to a per-element bound so the parent test can assert
on it.

[Note: bf16 grad bound]
With bf16 params and `grad_reduce_in_fp32`, rank r's local grad is a bf16 backward on its slice:
its exact mean grad L_r, rounded once (the CPU bf16 kernels accumulate in fp32 and round the
result), and megabuf's main_grad is the fp32 mean over ranks of those rounded values. The
reference is the global-batch grad G = mean_r L_r, also rounded once to bf16. With the bf16 unit
roundoff u = 2**-8 (round to nearest) that gives, per element,
    |main_grad - G_ref| <= u * |G| + u * mean_r |L_r|  (+ fp32 terms, ~2**-24 relative),
so the bound used is BF16_GRAD_C * u * (|G_ref| + mean_r |L_r|) with BF16_GRAD_C = 1.25
(|G_ref| and |L_r| are themselves rounded values, and the fp32 accumulation and dp-sum add
O(2**-16) relative to that). A grad perturbed by 2**-6 of itself fails it; the old tolerance
(2e-2 of the case's largest grad) let any grad below 2 % of the largest be arbitrarily wrong.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from case_devices import case_device, race_window, to_device
from torch import nn

import megabuf
from megabuf.pure.layout import shard_pieces
from megabuf.transport.collective_backends import CollectiveStrategy
from megabuf.transport.collectives import Collectives

GLOBAL_BATCH = 16
DIM = 12
FP32_ATOL = 1e-6  # fp32 grads: summation order only
BF16_U = 2.0**-8  # bf16 unit roundoff (8 significand bits, round to nearest)
BF16_GRAD_C = 1.25  # [Note: bf16 grad bound]
# gloo forced onto the path NCCL takes: native reduce-scatter / all-gather, AVG emulated
NATIVE_GLOO = {
    ("gloo", "cpu"): CollectiveStrategy(reduce_scatter="native", all_gather="native", has_avg=False)
}


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


def case_data(case: dict[str, Any], step: int) -> tuple[torch.Tensor, ...]:
    """`make_data(step)` (drawn on CPU: the same numbers everywhere) on the case's device."""
    return to_device(case, *make_data(step))


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
    net.to(case_device(case))
    ref = copy.deepcopy(net)
    if dist.get_rank() != 0:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    return net, ref


def reference_grads(ref: nn.Module, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    for step in range(case.get("backwards", 1)):
        x, y = case_data(case, step)
        loss_fn(ref(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def grad_bounds(
    ref: nn.Module, expected: dict[str, torch.Tensor], case: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Per-element bound on |megabuf grad - expected| (one backward, no micro-batches): fp32
    grads FP32_ATOL; bf16 grads [Note: bf16 grad bound], from every rank's local grad, each
    computed here on a fresh copy of the reference model and that rank's slice."""
    world = dist.get_world_size()
    local_abs: dict[str, torch.Tensor] = {
        n: torch.zeros_like(g, dtype=torch.float32) for n, g in expected.items()
    }
    x, y = case_data(case, 0)
    n = GLOBAL_BATCH // world
    for r in range(world):
        local = copy.deepcopy(ref)
        local.zero_grad(set_to_none=True)
        loss_fn(local(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n]).backward()
        for name, p in local.named_parameters():
            if name in local_abs and p.grad is not None:
                local_abs[name] += p.grad.float().abs() / world
    bounds = {}
    for name, g in expected.items():
        if g.dtype == torch.bfloat16:
            bounds[name] = BF16_GRAD_C * BF16_U * (g.float().abs() + local_abs[name])
        else:
            bounds[name] = torch.full(g.shape, FP32_ATOL, device=g.device)
    return bounds


def run_ddp(net: nn.Module, case: dict[str, Any]) -> megabuf.DistributedDataParallel:
    cfg = megabuf.DistributedDataParallelConfig.from_dict(case.get("config", {}))
    collectives = Collectives(NATIVE_GLOO) if case.get("native") else None
    model = megabuf.DistributedDataParallel(
        net, cfg, disable_bucketing=case.get("disable_bucketing", False), collectives=collectives
    )
    micro = case.get("micro_batches", 1)
    for step in range(case.get("backwards", 1)):
        x, y = case_data(case, step)
        xs, ys = local_slice(x).chunk(micro), local_slice(y).chunk(micro)
        for i in range(micro):
            last = i == micro - 1
            ctx = model.no_sync() if not last else _null()
            with ctx:
                # mean over micro-batches of per-micro-batch means = mean over the local batch
                (loss_fn(model(xs[i]), ys[i]) / micro).backward()
        race_window(case, "finish_grad_sync")  # [Note: race windows]
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
    """Max |megabuf grad - expected[names[param]]| per param (see `grad_deviations`)."""
    bounds = {name: torch.full(g.shape, FP32_ATOL, device=g.device) for name, g in expected.items()}
    return grad_deviations(model, names, expected, bounds)[0]


def grad_deviations(
    model: megabuf.DistributedDataParallel,
    names: dict[Any, str],
    expected: dict[str, torch.Tensor],
    bounds: dict[str, torch.Tensor],
) -> tuple[dict[str, float], dict[str, float]]:
    """Per param: max |megabuf grad - expected| and max of that over the element's bound, on
    whole main_grads, or with the distributed optimizer only the pieces of this rank's shards
    (the reduced part)."""
    errors: dict[str, float] = {}
    ratios: dict[str, float] = {}

    def record(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
        diff = (got.float() - want.float()).abs()
        errors[name] = max(errors.get(name, 0.0), diff.max().item())
        ratios[name] = max(ratios.get(name, 0.0), (diff / bound).max().item())

    if model.ddp_config.use_distributed_optimizer:
        for buf in model.buffers + model.engine.expert_parallel_buffers:
            for piece in shard_pieces(buf.layout, buf.dp_rank, buf.dp_size):
                name = names[buf.params[piece.param_id]]
                got = buf.grad_data[piece.buffer_start : piece.buffer_start + piece.numel]
                span = slice(piece.param_start, piece.param_end)
                record(name, got, expected[name].flatten()[span], bounds[name].flatten()[span])
    else:
        for param, name in names.items():
            record(name, param.main_grad, expected[name], bounds[name])
    return errors, ratios


def grad_copies(model: megabuf.DistributedDataParallel) -> dict[str, bool]:
    """[Note: grad contract], params whose dtype differs from their main_grad's: after
    finish_grad_sync() `.grad` is exactly main_grad in the param's dtype (non-distopt only)."""
    return {
        name: p.grad is not None
        and p.grad is not p.main_grad
        and p.grad.dtype == p.dtype
        and torch.equal(p.grad, p.main_grad.to(p.dtype))
        for p, name in model.engine.param_to_name.items()
        if p.dtype != p.main_grad.dtype
    }


def grad_case(case: dict[str, Any]) -> dict[str, Any]:
    """Max |megabuf grad - reference grad| per param (full grads, or shards with distopt)."""
    net, ref = build(case)
    fresh_ref = copy.deepcopy(ref)
    expected = reference_grads(ref, case)
    if case.get("bf16"):
        bounds = grad_bounds(fresh_ref, expected, case)
    else:
        bounds = {
            name: torch.full(g.shape, FP32_ATOL, device=g.device) for name, g in expected.items()
        }
    model = run_ddp(net, case)
    names = model.engine.param_to_name
    device = case_device(case).type
    errors, ratios = grad_deviations(model, names, expected, bounds)
    # param.grad must be the main_grad view itself (no copy) when dtypes match; with the
    # distributed optimizer it is never exposed (only a shard is reduced)
    distopt = model.ddp_config.use_distributed_optimizer
    if distopt:
        linked = all(p.grad is None for p in names)
    else:
        linked = all(p.grad is p.main_grad for p in names if p.dtype == p.main_grad.dtype)
    frozen = list(net.frozen.parameters())
    frozen_ok = all(p.grad is None and not hasattr(p, "main_grad") for p in frozen)
    return {
        "errors": errors,
        "ratios": ratios,
        "n_buffers": len(model.buffers),
        "n_groups": len(model.engine.bucket_groups),
        "linked": linked,
        "frozen_ok": frozen_ok,
        "grad_copies": {} if distopt else grad_copies(model),
        "reduce_scatter": model.engine.collectives.strategy(
            model.process_groups.dp, device
        ).reduce_scatter,
        "all_params": sorted(names.values()),
        "device": str(next(iter(names)).main_grad.device),
        # every main_grad, for comparing runs with each other ([Note: race windows])
        "main_grads": {n: p.main_grad.detach().cpu() for p, n in names.items()}
        if case.get("keep_grads")
        else {},
    }
