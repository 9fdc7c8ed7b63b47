"""Rank side of tests/test_counted_arrivals.py: [Note: counted arrivals]
(megabuf/buckets/arrivals.py) on real gloo ranks. Each loop runs twice, once as built (small params'
hooks become counters after the first sync) and once with counting switched off (a Python hook per
param, as before), and returns every step's grads and params: the test compares the two bitwise, and
the first loop also against a single-process reference of the global batch. Rank 1 skips `spare` (a
param unused on one rank) and sees other data."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import megabuf

DIM = 8
BUCKET_NUMEL = 64  # a Linear(8, 8) (72 elements) per bucket group: 7 groups, all params small


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(6))
        self.spare = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, spare: bool = True, twice: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if spare:
            x = x + self.spare(x)
        if twice:  # the last layer's params get a second grad, from a nested (reentrant) backward
            top = self.layers[-1]
            x = x + checkpoint(top, x, use_reentrant=True)  # type: ignore[operator]
        return x


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _wrap(counting: bool, **fields: Any) -> Any:
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=fields.pop("overlap_grad_reduce", True),
        bucket_size=BUCKET_NUMEL,
        **fields,
    )
    model = megabuf.DistributedDataParallel(Tiny(), cfg)
    if not counting:
        model.engine.sync.drop_first_sync()
    return model


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.module.named_parameters():
        out[f"grad:{name}"] = param.grad.detach().clone()
        out[f"param:{name}"] = param.detach().clone()
    return out


def _turns(model: Any) -> list[int | None]:
    groups = model.engine.all_bucket_groups
    return [None if g.counted is None else g.counted.python_turns for g in groups]


# ---- the loops: model -> per-step snapshots ------------------------------------------------------
def _steps(
    model: Any, opt: Any, n: int, clear: Callable[[], None], out: Callable[[int], torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """`n` steps of clear(), backward of the loss of `out(step)` and the optimizer step."""
    steps = []
    for step in range(n):
        clear()
        _loss(out(step)).backward()
        steps.append(_snapshot(model))
        opt.step()
    return steps


def megabuf_loop(model: Any, rank: int) -> list[dict[str, torch.Tensor]]:
    """zero_grad_buffer(), forward through the wrapper, backward (synced at its end), SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _steps(
        model, opt, 4, model.zero_grad_buffer, lambda s: model(_batch(rank, s), rank == 0)
    )


def torch_loop(model: Any, rank: int) -> list[dict[str, torch.Tensor]]:
    """A torch-DDP loop: the optimizer's zero_grad() sets every .grad to None, never
    zero_grad_buffer(); backward then hands the small params tensors of their own."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return _steps(model, opt, 4, opt.zero_grad, lambda s: model(_batch(rank, s), rank == 0))


def microbatch_loop(model: Any, rank: int) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches under no_sync(), the third synced; then a backward accumulating on top
    of the synced grads (no zero_grad_buffer()), synced again."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(3):
        model.zero_grad_buffer()
        with model.no_sync():
            for micro in range(2):
                _loss(model(_batch(rank, 10 * step + micro))).backward()
        _loss(model(_batch(rank, 10 * step + 2), spare=rank == 0)).backward()
        steps.append(_snapshot(model))
        _loss(model(_batch(rank, 10 * step + 3))).backward()  # on top of the synced grads
        steps.append(_snapshot(model))
        opt.step()
    return steps


def module_loop(model: Any, rank: int) -> list[dict[str, torch.Tensor]]:
    """A loss from model.module, not through the wrapper's forward: the first counted arrival's
    bookkeeping arms the sync at backward's end."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _steps(
        model, opt, 3, model.zero_grad_buffer, lambda s: model.module(_batch(rank, s), rank == 0)
    )


def twice_loop(model: Any, rank: int) -> list[dict[str, torch.Tensor]]:
    """The last layer gets two grads per iteration from the start (a nested backward)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _steps(
        model, opt, 3, model.zero_grad_buffer, lambda s: model(_batch(rank, s), twice=True)
    )


LOOPS: dict[str, Callable[[Any, int], list[dict[str, torch.Tensor]]]] = {
    "megabuf": megabuf_loop,
    "torch": torch_loop,
    "microbatches": microbatch_loop,
    "module": module_loop,
    "twice": twice_loop,
}


def loop_case(name: str, overlap: bool = True) -> dict[str, Any]:
    """`name`'s loop counted and not: the largest difference between the two over every grad
    and param of every step, whether counting was on (its Python turns per group), and, for
    the first step of the megabuf loop, the error against a single-process reference."""
    rank = dist.get_rank()
    runs, turns = [], []
    for counting in (True, False):
        model = _wrap(counting, overlap_grad_reduce=overlap)
        runs.append(LOOPS[name](model, rank))
        turns.append(_turns(model))
    diff = max((a[k] - b[k]).abs().max().item() for a, b in zip(*runs, strict=True) for k in a)
    out = {"diff": diff, "turns": turns[0], "turns_off": turns[1], "steps": len(runs[0])}
    if name == "megabuf":
        out["reference_error"] = _reference_error(runs[0][0])
    return out


def _reference_error(first: dict[str, torch.Tensor]) -> float:
    """First step's grads against the dp-averaged loss over every rank's batch, one process."""
    world = dist.get_world_size()
    ref = Tiny()
    for rank in range(world):
        (_loss(ref(_batch(rank, 0), spare=rank == 0)) / world).backward()
    errors = []
    for name, param in ref.named_parameters():
        want = param.grad if param.grad is not None else torch.zeros_like(param)
        errors.append((first[f"grad:{name}"] - want).abs().max().item())
    return max(errors)


# ---- refusals and lifetime -----------------------------------------------------------------------
def refusal_case() -> dict[str, Any]:
    """After the learning iteration: (1) a param that now gets a second grad, after its group
    was dispatched, raises naming the group's params; reset_iter_state() recovers and the
    next iteration equals the uncounted run's; (2) backward(create_graph=True) is refused
    naming a param."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    after = []
    for counting in (True, False):
        model = _wrap(counting)
        model.zero_grad_buffer()
        _loss(model(_batch(rank, 0))).backward()  # learns one grad per param
        model.zero_grad_buffer()
        try:
            _loss(model(_batch(rank, 1), twice=True)).backward()
            out[f"extra_{counting}"] = "no error"
        except RuntimeError as exc:
            out[f"extra_{counting}"] = str(exc)
        model.reset_iter_state()
        model.zero_grad_buffer()
        _loss(model(_batch(rank, 2))).backward()
        after.append(_snapshot(model))
        model.zero_grad_buffer()
        try:
            _loss(model(_batch(rank, 3))).backward(create_graph=True)
            out[f"create_graph_{counting}"] = "no error"
        except RuntimeError as exc:
            out[f"create_graph_{counting}"] = str(exc)
        model.reset_iter_state()
    out["after_diff"] = max((after[0][k] - after[1][k]).abs().max().item() for k in after[0])
    return out


def lifetime_case() -> dict[str, Any]:
    """Counted hooks go with the engine: after `del` and a collection no param keeps one."""
    rank = dist.get_rank()
    model = _wrap(True)
    megabuf_loop(model, rank)
    counted = sum(g.counted is not None for g in model.engine.all_bucket_groups)
    net = model.module
    del model
    gc.collect()
    left = sum(len(p._post_accumulate_grad_hooks or {}) for p in net.parameters())  # type: ignore[attr-defined]
    for param in net.parameters():
        param.grad = None
    _loss(net(_batch(rank, 0))).backward()  # a plain module again: torch's own grads
    plain = all(p.grad is not None for p in net.parameters())
    return {"counted_groups": counted, "hooks_left": left, "plain": plain}


CASES: dict[str, tuple[Any, ...]] = {
    **{f"loop_{name}": (loop_case, name) for name in LOOPS},
    "loop_megabuf_sync": (loop_case, "megabuf", False),
    "loop_torch_sync": (loop_case, "torch", False),
    "refusals": (refusal_case,),
    "lifetime": (lifetime_case,),
}
