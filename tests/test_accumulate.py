"""A backward after finish_grad_sync() without zero_grad_buffer() accumulates on top exactly for
dense buffers, and raises (never a silent wrong result) where the reduction is not the identity on
already-reduced grads: expert-parallel buffers."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import megabuf


def accumulate_case(average: bool, expert: bool) -> float | str:
    """World 2, ep 2: `tail` is expert-parallel (reduced over expt_dp of size 1, scaled by 1/dp)
    and deliberately identical on both ranks, so its expected grad is the local grad / 2."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    if expert:
        megabuf.mark_expert_parallel(net[2].parameters())
    ref = copy.deepcopy(net)
    pgs = megabuf.ProcessGroups.build(ep_size=2)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=1, average_in_collective=average
    )
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    rank, world = dist.get_rank(), dist.get_world_size()
    expected: dict[str, torch.Tensor] = {}
    for step in range(2):
        x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(step))
        local = x[rank * 4 : (rank + 1) * 4]
        try:
            model(local).square().mean().backward()
        except RuntimeError as exc:
            return str(exc)
        model.finish_grad_sync()  # no zero_grad_buffer between the two iterations
        ref.zero_grad()
        ref(x).square().mean().backward()  # dense: global-batch grad
        ref_local = copy.deepcopy(ref)
        ref_local.zero_grad()
        ref_local(local).square().mean().backward()
        for name, p in ref.named_parameters():
            is_expert = expert and name.startswith("2.")
            g = ref_local.get_parameter(name).grad / world if is_expert else p.grad
            expected[name] = expected.get(name, torch.zeros_like(g)) + g
    return max(
        (p.main_grad - expected[name]).abs().max().item()
        for name, p in model.module.named_parameters()
    )


def all_modes() -> list[float | str]:
    return [accumulate_case(avg, expert) for expert in (False, True) for avg in (False, True)]


def test_accumulating_after_sync_is_exact_for_dense_and_raises_for_expert(pools: Any) -> None:
    for dense_sum, dense_avg, expert_sum, expert_avg in pools(2).run(all_modes):
        assert dense_sum <= 1e-6 and dense_avg <= 1e-6, (dense_sum, dense_avg)
        for msg in (expert_sum, expert_avg):
            assert isinstance(msg, str) and "without zero_grad_buffer" in msg, msg
            assert "'2.weight'" in msg or "2.weight" in msg or "2.bias" in msg, msg


class _TwoPaths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if use_b else h


def lazy_zero_case() -> dict[str, Any]:
    """zero_grad_buffer() is lazy: a param that gets no grad in the next iteration must read
    zero, and its .grad must be that zero main_grad view ([Note: grad contract]), never last
    iteration's value."""
    torch.manual_seed(0)
    net = _TwoPaths()
    ref = copy.deepcopy(net)
    model = megabuf.DistributedDataParallel(net)  # synchronous, one bucket
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x, True).sum().backward()
    model.finish_grad_sync()
    model.zero_grad_buffer()
    model(x, False).square().sum().backward()
    model.finish_grad_sync()
    ref(x, False).square().sum().backward()
    ref_grad = ref.a.weight.grad.clone()
    dist.all_reduce(ref_grad)
    return {
        "b_main_grad_max": net.b.weight.main_grad.abs().max().item(),
        "b_grad_is_zero_view": net.b.weight.grad is net.b.weight.main_grad,
        "a_error": (net.a.weight.grad - ref_grad / dist.get_world_size()).abs().max().item(),
        "a_linked": net.a.weight.grad is net.a.weight.main_grad,
    }


def test_lazy_zeroing_never_leaks_last_iterations_grads(pools: Any) -> None:
    for res in pools(2).run(lazy_zero_case):
        assert res["b_main_grad_max"] == 0.0 and res["b_grad_is_zero_view"], res
        assert res["a_error"] <= 1e-6 and res["a_linked"], res
