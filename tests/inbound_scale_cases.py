"""Rank side of tests/test_inbound_scale.py: [Note: scale on the way in]
(megabuf/buckets/grad_math.py) on gloo ranks, against the bucket pass (the same model with
sync_grads_at_backward_end=False, which scales whole buckets at dispatch) and a single-process
reference of the global batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.checkpoint import checkpoint

import megabuf
from megabuf.comm_hooks import from_torch

TOL = 1e-6
WIDTH = 96  # Linear weights of 9216 elements: large; biases, norm and `gate`: small


class Net(nn.Module):
    """`a.weight` reaches AccumulateGrad twice per backward (once in a reentrant checkpoint's
    inner backward, once in the outer one); `skip` is unused on rank 0 (asymmetric ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.skip = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.gate = nn.Parameter(torch.ones(WIDTH))
        self.rank = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=True)
        h = self.b(self.norm(h)) + x @ self.a.weight.t()
        if self.rank != 0:
            h = h + self.skip(x)
        return h * self.gate


def _batch(rank: int, step: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, WIDTH, generator=g).to(device).requires_grad_(True)  # checkpoint input


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _reference(net: Net, steps: list[int], world: int) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(net)
    device = str(next(net.parameters()).device)
    for step in steps:
        for rank in range(world):
            ref.rank = rank
            (_loss(ref, _batch(rank, step, device)) / world).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}  # type: ignore[union-attr]


def _wrapped(net: Net, at_backward_end: bool, hook: Any = None) -> Any:
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, sync_grads_at_backward_end=at_backward_end
    )
    model = megabuf.DistributedDataParallel(copy.deepcopy(net), cfg)
    model.module.rank = dist.get_rank()
    if hook is not None:
        model.register_comm_hook(hook)
    return model


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


def _run(model: Any, steps: list[int], micro: list[int]) -> tuple[dict[str, Any], dict[str, bool]]:
    """One iteration: `micro` steps under no_sync(), then `steps`; also, per param, whether its
    `.grad` was None right after megabuf's hook at its last arrival (taken in scaled)."""
    rank, device = dist.get_rank(), str(next(model.module.parameters()).device)
    none_after: dict[str, bool] = {}
    for name, param in model.module.named_parameters():  # registered after megabuf's hooks
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: none_after.__setitem__(name, p.grad is None)
        )
    model.zero_grad_buffer()
    with model.no_sync():
        for step in micro:
            _loss(model, _batch(rank, step, device)).backward()
    for step in steps:
        _loss(model, _batch(rank, step, device)).backward()
    model.finish_grad_sync()
    linked = all(p.grad is p.main_grad for p in model.module.parameters())
    return {"grads": _grads(model), "linked": linked}, none_after


def _compare(net: Net, micro: list[int], hook: Any = None) -> dict[str, Any]:
    world = dist.get_world_size()
    inbound, scaled = _run(_wrapped(net, True, hook), [2], micro)
    bucket_pass, _ = _run(_wrapped(net, False, hook), [2], micro)
    want = _reference(net, [*micro, 2], world)
    got = inbound["grads"]
    return {
        "scaled": sorted(n for n, v in scaled.items() if v),
        "bitwise": sorted(n for n in got if torch.equal(got[n], bucket_pass["grads"][n])),
        "names": sorted(got),
        "error": max((got[n] - want[n]).abs().max().item() for n in want),
        "linked": inbound["linked"] and bucket_pass["linked"],
    }


def run_cases(device: str = "cpu") -> dict[str, Any]:
    """Every case on `device` ("cuda": the GPU tier's gloo ranks sharing one GPU)."""
    net = Net().to(device)
    return {
        "one_backward": _compare(net, []),
        "microbatches": _compare(net, [0, 1]),
        "torch_hook": _compare(net, [], from_torch(allreduce_hook, None)),
    }


def _copied_in(rank: int) -> list[str]:
    """The large params this rank uses. Not `gate`: the first grad of the backward, whose hook
    links the other small params ([Note: small grads accumulate in place]), is itself copied,
    but unscaled, as small params are not scaled on the way in."""
    return sorted(["a.weight", "b.weight"] + (["skip.weight"] if rank != 0 else []))


def check_large_grads_scaled(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        case = res["one_backward"]
        assert case["scaled"] == _copied_in(rank), (rank, case["scaled"])
        # a.weight arrives twice: g1 * f + g2 * f, the bucket pass (g1 + g2) * f; the same bits
        # when f is a power of two (dp 2)
        twice = [] if len(results) == 2 else ["a.weight"]
        assert sorted(set(case["names"]) - set(twice)) == sorted(set(case["bitwise"]) - set(twice))
        assert case["error"] <= TOL and case["linked"], (rank, case)


def check_unscaled_paths(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        for name in ("microbatches", "torch_hook"):
            case = res[name]
            assert case["scaled"] == [], (rank, name, case["scaled"])
            assert case["bitwise"] == case["names"], (rank, name, case)
            assert case["error"] <= TOL and case["linked"], (rank, name, case)
