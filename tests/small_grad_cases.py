"""Rank side of tests/test_small_grads.py: [Note: small grads accumulate in place] in
megabuf/sync/grads.py against a single-process reference of the same global batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import megabuf
from megabuf.sync.grads import SMALL_GRAD_NUMEL

WIDTH = 128  # the Linear weights (16384 elements) are large, the biases and norms small


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.norm(self.a(x)))) * self.scale


def _batch(rank: int, step: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, WIDTH, generator=g).to(device)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _reference(net: nn.Module, steps: list[int], world: int) -> dict[str, torch.Tensor]:
    """Grads of the dp-averaged loss over every rank's batch, accumulated over `steps`."""
    ref = copy.deepcopy(net)
    device = str(next(net.parameters()).device)
    for step in steps:
        for rank in range(world):
            (_loss(ref, _batch(rank, step, device)) / world).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}  # type: ignore[union-attr]


def _wrapped(device: str = "cpu") -> tuple[Mixed, Any]:
    net = Mixed().to(device)
    cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True)
    return net, megabuf.DistributedDataParallel(copy.deepcopy(net), cfg)


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


def _error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[n] - want[n]).abs().max().item() for n in want)


def run_cases(device: str = "cpu") -> dict[str, Any]:
    """Every case on `device` ("cuda": the GPU tier's gloo ranks sharing one GPU)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}

    # 1. zero_grad_buffer(): small grads zeroed but still None until a backward, so a torch
    #    optimizer stepped without a backward skips every param, as after torch's zero_grad()
    net, model = _wrapped(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    _loss(model, _batch(rank, 0, device)).backward()
    model.finish_grad_sync()
    opt.step()
    model.zero_grad_buffer()
    before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    none_after_zero = all(p.grad is None for p in model.module.parameters())
    opt.step()
    out["no_backward"] = {
        "grads_none": none_after_zero,
        "unchanged": all(torch.equal(before[n], p) for n, p in model.module.named_parameters()),
    }

    # 2. a backward: the small params' .grad is their main_grad before their hook runs (autograd
    #    accumulated in place), the large ones' after it (copied); both equal the reference
    net, model = _wrapped(device)
    seen: dict[str, bool] = {}
    for name, param in model.module.named_parameters():
        param.register_hook(  # runs before AccumulateGrad: what .grad is then
            lambda g, name=name, param=param: seen.__setitem__(name, param.grad is param.main_grad)
        )
    model.zero_grad_buffer()
    _loss(model, _batch(rank, 0, device)).backward()
    model.finish_grad_sync()
    small = {n for n, p in model.module.named_parameters() if p.numel() <= SMALL_GRAD_NUMEL}
    out["linked"] = {
        "small": sorted(small),
        "linked_before_accumulation": sorted(n for n, v in seen.items() if v),
        "all_linked_after": all(p.grad is p.main_grad for p in model.module.parameters()),
        "error": _error(_grads(model), _reference(net, [0], world)),
    }

    # 3. after an iteration, zero_grad_buffer(), micro-batches under no_sync(), then the synced
    #    one: the sum of the three (nothing of the iteration before leaks)
    net, model = _wrapped(device)
    _loss(model, _batch(rank, 5, device)).backward()
    model.finish_grad_sync()
    model.zero_grad_buffer()
    with model.no_sync():
        for step in (0, 1):
            _loss(model, _batch(rank, step, device)).backward()
    _loss(model, _batch(rank, 2, device)).backward()
    model.finish_grad_sync()
    out["microbatches"] = _error(_grads(model), _reference(net, [0, 1, 2], world))

    # 4. a small param's .grad the user set between zero_grad_buffer() and backward: backward
    #    accumulates on top of it, as torch would (and the average over ranks keeps it)
    net, model = _wrapped(device)
    model.zero_grad_buffer()
    own = torch.full((WIDTH,), 0.5, device=device)
    model.module.scale.grad = own.clone()
    _loss(model, _batch(rank, 0, device)).backward()
    model.finish_grad_sync()
    want = _reference(net, [0], world)
    want["scale"] = want["scale"] + own
    out["user_grad"] = _error(_grads(model), want)

    # 5. grads set to None after a sync without zero_grad_buffer() (torch's zero_grad on the
    #    optimizer): the next backward's grads are fresh, not added to the reduced ones; also
    #    when that sync came right after zero_grad_buffer() with no backward (disarmed there)
    for name, backward_first in (("fresh_after_sync", True), ("fresh_after_empty_sync", False)):
        net, model = _wrapped(device)
        model.zero_grad_buffer()
        if backward_first:
            _loss(model, _batch(rank, 0, device)).backward()
        model.finish_grad_sync()
        for param in model.module.parameters():
            param.grad = None
        for step in (1, 2):  # the second backward follows the first's sync, as in torch
            if step == 2:
                for param in model.module.parameters():
                    param.grad = None
            _loss(model, _batch(rank, step, device)).backward()
            model.finish_grad_sync()
        out[name] = _error(_grads(model), _reference(net, [2], world))
    out["bookkeeping"] = bookkeeping_counts(rank, device)
    return out


def bookkeeping_counts(rank: int, device: str) -> dict[str, int]:
    """How often the per-backward bookkeeping ran ([Note: one bookkeeping per backward]): once
    per backward, also under no_sync(), over a retained graph, and after a backward that raised
    in a hook (its end-of-backward callback never ran: the next forward reopens)."""
    _, model = _wrapped(device)
    calls = [0]
    inner = model.engine.sync.on_grad

    def counting() -> None:
        calls[0] += 1
        inner()

    model.engine.sync.on_grad = counting
    counts: dict[str, int] = {}

    def count(name: str, run: Any) -> None:
        calls[0] = 0
        run()
        counts[name] = calls[0]

    model.zero_grad_buffer()
    count("one_backward", lambda: _loss(model, _batch(rank, 0, device)).backward())
    model.finish_grad_sync()
    model.zero_grad_buffer()

    def micro() -> None:
        with model.no_sync():
            for step in (0, 1):
                _loss(model, _batch(rank, step, device)).backward()

    count("two_no_sync_backwards", micro)

    def retained() -> None:
        loss = _loss(model, _batch(rank, 2, device))
        with model.no_sync():
            loss.backward(retain_graph=True)
            loss.backward()

    count("two_backwards_one_graph", retained)
    model.finish_grad_sync()
    model.zero_grad_buffer()
    handle = model.module.b.bias.register_post_accumulate_grad_hook(_raise)
    with pytest.raises(RuntimeError, match="planted"):
        _loss(model, _batch(rank, 3, device)).backward()
    handle.remove()
    model.reset_iter_state()
    count("after_a_raised_backward", lambda: _loss(model, _batch(rank, 4, device)).backward())
    model.finish_grad_sync()
    return counts


def _raise(param: Any) -> None:
    raise RuntimeError("planted")


TOL = 1e-6  # dp 2: megabuf averages (g0 + g1) / 2, the reference adds g0 / 2 + g1 / 2
REFERENCE_CASES = ["microbatches", "user_grad", "fresh_after_sync", "fresh_after_empty_sync"]


def check_no_backward(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert res["no_backward"] == {"grads_none": True, "unchanged": True}, rank


def check_linked(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        linked = res["linked"]
        assert linked["small"] == ["a.bias", "b.bias", "norm.bias", "norm.weight", "scale"]
        # all but the first param to get its grad (scale: the last in forward), whose hook is
        # where the others are linked
        assert linked["linked_before_accumulation"] == linked["small"][:-1], (rank, linked)
        assert linked["all_linked_after"] and linked["error"] <= TOL, (rank, linked)


def check_reference(results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(results):
        assert res[case] <= TOL, (rank, case, res[case])


def check_bookkeeping(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert res["bookkeeping"] == {
            "one_backward": 1,
            "two_no_sync_backwards": 2,
            "two_backwards_one_graph": 2,
            "after_a_raised_backward": 1,
        }, rank


def check_all(results: list[dict[str, Any]]) -> None:
    check_no_backward(results)
    check_linked(results)
    for case in REFERENCE_CASES:
        check_reference(results, case)
    check_bookkeeping(results)
