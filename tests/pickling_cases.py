"""Rank-side cases for test_pickling.py: a wrapped model pickled, saved with torch.save or
deep-copied, then trained in the same gloo ranks against stock torch DDP ([Note: pickling a
wrapped model] in megabuf/core/pickling.py)."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from sparse_cases import SparseNet
from sparse_cases import batch as sparse_batch
from torch import nn

import megabuf
from megabuf.transport import process_groups

STEPS = 3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _x(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())  # ranks differ
    return torch.randn(4, 6, generator=gen)


def _train(model: nn.Module, steps: int = STEPS, batch: Callable[[int], Any] = _x) -> list[Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(batch(step)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _round_trip(model: nn.Module, how: str) -> nn.Module:
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))  # type: ignore[no-any-return]
    if how == "torch_save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)  # type: ignore[no-any-return]
    return copy.deepcopy(model)


def round_trip_trains_like_torch(how: str) -> dict[str, Any]:
    """Train the wrapped model 2 steps, copy it, train the copy; the reference is stock torch
    DDP over a module holding the copied values, trained on the same data. The original keeps
    training too (its buffers are not the copy's)."""
    model = megabuf.DistributedDataParallel(_mlp())
    _train(model, 2)
    copied = _round_trip(model, how)
    plain = copy.deepcopy(copied.module)  # the values the copy starts from
    ref = _train(nn.parallel.DistributedDataParallel(plain))
    got = _train(copied)
    original = _train(model)
    module_bytes = len(pickle.dumps(copy.deepcopy(plain)))
    return {
        "equal": [torch.equal(a, b) for a, b in zip(got, ref)],
        "original_equal": [torch.equal(a, b) for a, b in zip(original, ref)],
        "shares_storage": any(
            a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            for a, b in zip(copied.parameters(), model.parameters())
        ),
        "main_grad": all(hasattr(p, "main_grad") for p in copied.parameters()),
        "payload_ratio": len(pickle.dumps(model)) / module_bytes,
    }


def sparse_model_round_trip() -> dict[str, Any]:
    """Sparse grads (kept outside the buffers) survive the copy: trains like torch DDP."""
    model = megabuf.DistributedDataParallel(SparseNet())
    copied = pickle.loads(pickle.dumps(model))

    def batch(step: int) -> torch.Tensor:
        return sparse_batch(step, 0)

    ref = _train_sparse(nn.parallel.DistributedDataParallel(copy.deepcopy(copied.module)), batch)
    got = _train_sparse(copied, batch)
    return {"equal": [torch.equal(a, b) for a, b in zip(got, ref)]}


def _train_sparse(model: nn.Module, batch: Callable[[int], torch.Tensor]) -> list[Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(batch(step)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def distributed_optimizer_round_trip() -> dict[str, Any]:
    """optim strategy with overlap_param_gather (forward pre-hooks on the modules) and
    megabuf's optimizer: the copy drops the engine's hooks, gets its own, and trains exactly
    like the original trained in the same steps."""
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim", overlap_param_gather=True
    )
    opt_cfg = megabuf.OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0)
    model = megabuf.DistributedDataParallel(_mlp(), cfg)
    copied = copy.deepcopy(model)
    results = []
    for m in (model, copied):
        opt = megabuf.build_optimizer(m, opt_cfg)
        for step in range(STEPS):
            opt.zero_grad()
            m(_x(step)).square().mean().backward()
            opt.step()
        m.start_param_sync(force_sync=True)
        results.append([p.detach().clone() for p in m.parameters()])
    hooks = sum(len(sub._forward_pre_hooks) for sub in copied.module.modules())
    return {"equal": [torch.equal(a, b) for a, b in zip(*results)], "pre_hooks": hooks}


def rank_local_unpickle() -> dict[str, Any]:
    """Only rank 0 unpickles and deep-copies (no collective may run); it evaluates the copies.
    Once more with megabuf's cache of process groups emptied, as in a fresh job that never
    wrapped a model: building the groups must not be collective either."""
    model = megabuf.DistributedDataParallel(_mlp())
    _train(model, 1)
    payload = pickle.dumps(model)
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        x = torch.ones(2, 6)
        with torch.no_grad():
            want = model(x)
            out["pickle"] = torch.equal(pickle.loads(payload)(x), want)
            out["deepcopy"] = torch.equal(copy.deepcopy(model)(x), want)
            cache = process_groups._GROUP_CACHE
            saved = dict(cache)
            cache.clear()
            cache["world"] = None
            counted = dist.distributed_c10d._world.group_count  # names the next shared group
            try:
                out["fresh_groups"] = torch.equal(pickle.loads(payload)(x), want)
                # a group made by one rank under a counted name shifts its later groups' names
                out["group_count_kept"] = dist.distributed_c10d._world.group_count == counted
            finally:
                cache.clear()
                cache.update(saved)
    dist.barrier()
    return out


def registered_hook_dropped() -> dict[str, Any]:
    model = megabuf.DistributedDataParallel(_mlp())
    model.register_comm_hook(megabuf.comm_hooks.Reduce())
    copied = copy.deepcopy(model)
    return {"original": sorted(model.comm_hooks()), "copy": sorted(copied.comm_hooks())}


def refused(kind: str) -> str:
    if kind == "optim_grads_params":
        cfg = megabuf.DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params"
        )
        model = megabuf.DistributedDataParallel(_mlp(), cfg)
    else:
        groups = megabuf.ProcessGroups.build(ep_size=2)
        model = megabuf.DistributedDataParallel(_mlp(), process_groups=groups)
    try:
        pickle.dumps(model)
    except RuntimeError as exc:
        return str(exc)
    return "pickled"
