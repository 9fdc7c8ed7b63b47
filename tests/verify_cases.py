"""Rank-side code for tests/test_verify.py (issue 47; 2 gloo ranks, one pool run) and the
verify="all" run of the combination matrix (tests/test_matrix2.py): each check of the verify mode
against a divergence of its class planted on one rank, named on every rank; the spike guards."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from dist_pool import run_each
from moe_cases import CFG, groups
from optimizer_cases import GLOBAL_BATCH, Net, loss_fn, make_data

import megabuf
import megabuf.optimizer.clip as clip
from megabuf.config import DistributedDataParallelConfig
from megabuf.optimizer.clip import NormPart
from megabuf.testing.moe import MoEModel, moe_batch
from megabuf.verify import VerifyError
from megabuf.verify.engine_checks import EngineVerifier
from megabuf.verify.fingerprint import CollectiveLog
from megabuf.verify.step_checks import StepChecks


def _build(strategy: str, verify: str, **ddp: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, bucket_size=40, verify=verify, **ddp
    )
    model = megabuf.DistributedDataParallel(Net(), cfg)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(lr=1e-2, clip_grad=1.0))
    return model, opt


def _step(model: Any, opt: Any, step: int, loss_scale: float = 1.0) -> Any:
    x, y = make_data(step)
    n = GLOBAL_BATCH // dist.get_world_size()
    x, y = x[dist.get_rank() * n :][:n], y[dist.get_rank() * n :][:n]
    opt.zero_grad()
    (loss_fn(model(x), y) * loss_scale).backward()
    model.finish_grad_sync()
    return opt.step()


def _named_error(run: Callable[[], Any]) -> str | None:
    """The VerifyError `run` raised (its message), or None."""
    try:
        run()
    except VerifyError as exc:
        return str(exc)
    return None


def clean_case(strategy: str, overlap: bool) -> dict[str, Any]:
    """verify="all", 3 steps: nothing raised; how many checks ran."""
    counts: dict[str, int] = {}
    with _counting(counts):
        model, opt = _build(strategy, "all", overlap_grad_reduce=overlap)
        for step in range(3):
            _step(model, opt, step)
    return {"counts": counts, "norm_checks": opt.step_checks.norm_checks}


def bucket_order_case(strategy: str) -> dict[str, Any]:
    """Rank 1 dispatches its bucket groups in the reverse order (its chain reordered)."""
    model, opt = _build(strategy, "collectives")
    _step(model, opt, 0)
    if dist.get_rank() == 1:
        for chain in {id(g.chain): g.chain for g in model.engine.all_bucket_groups}.values():
            chain.groups.reverse()
    return {"error": _named_error(lambda: _step(model, opt, 1)), "groups": len(
        model.engine.all_bucket_groups)}  # fmt: skip


def sequence_case(strategy: str) -> dict[str, Any]:
    """After step 0, rank 1's fingerprint hears of one more all-reduce on dp than rank 0's (as
    if it had issued one): the grad sync of step 1 names it."""
    model, opt = _build(strategy, "collectives")
    _step(model, opt, 0)
    if dist.get_rank() == 1:
        nbytes = {"input_nbytes": 16, "output_nbytes": 16, "ring_nbytes": 16}
        model.engine.collectives.observers.issued(model.process_groups.dp, "all_reduce", nbytes)
    return {"error": _named_error(lambda: _step(model, opt, 1))}


def ulp_case(strategy: str) -> dict[str, Any]:
    """After step 0, rank 1's `block.weight` moves by one ulp in one element."""
    model, opt = _build(strategy, "replicas")
    _step(model, opt, 0)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.module.block.weight.data.view(-1)[3:4].view(torch.int32).add_(1)
    return {"error": _named_error(lambda: _step(model, opt, 1))}


def _moe(strategy: str, verify: str) -> tuple[Any, Any]:
    pgs = groups(ep_size=2)
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, verify=verify
    )
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(lr=1e-2, clip_grad=1.0))
    return model, opt


def _moe_step(model: Any, opt: Any, step: int) -> Any:
    pgs = model.process_groups
    x, y = moe_batch(CFG, GLOBAL_BATCH, seed=100 + step)
    n = GLOBAL_BATCH // pgs.dp_size
    rows = slice(pgs.dp_rank * n, (pgs.dp_rank + 1) * n)
    opt.zero_grad()
    ((model(x[rows]) - y[rows]) ** 2).mean().backward()
    model.finish_grad_sync()
    return opt.step()


def expert_norm_case(strategy: str) -> dict[str, Any]:
    """ep 2: the optimizer's norm leaves the expert grads out (its expert part emptied)."""
    model, opt = _moe(strategy, "norms")
    clean = _moe_step(model, opt, 0)
    parts_of = opt._norm_parts

    def without_experts() -> list[NormPart]:
        parts = parts_of()
        return [p if k == "dense" else NormPart([], p.groups) for k, p in zip(opt._norm_kinds,
                                                                             parts)]  # fmt: skip

    opt._norm_parts = without_experts
    return {
        "clean": clean.update_successful,
        "error": _named_error(lambda: _moe_step(model, opt, 1)),
    }


def size1_twice_case(strategy: str) -> dict[str, Any]:
    """ep 2 (expert dp 1): the norm's sum over a group of one rank counts the rank twice."""
    model, opt = _moe(strategy, "norms")
    original = clip._sum_over

    def doubled(value: torch.Tensor, groups_: Any, collectives: Any) -> None:
        original(value, groups_, collectives)
        for group in groups_:
            if collectives.size(group) == 1:
                value.mul_(2.0)

    clip._sum_over = doubled
    try:
        return {"error": _named_error(lambda: _moe_step(model, opt, 0))}
    finally:
        clip._sum_over = original


def spike_case(large: Any, threshold: float | None) -> dict[str, Any]:
    """6 steps at loss scale 1, then one at 1e4: skipped or raised on every rank."""
    model, opt = _build("optim", "off", check_for_large_grads=large,
                        grad_norm_skip_threshold=threshold)  # fmt: skip
    applied = [_step(model, opt, step).update_successful for step in range(6)]
    error = _named_error(lambda: applied.append(_step(model, opt, 6, 1e4).update_successful))
    return {"applied": applied, "error": error, "skipped": dict(opt.step_checks.skipped)}


# ---- the combination matrix with verify="all" (tests/test_matrix2.py) --------------------------
COUNTED = ("CollectiveLog.check", "EngineVerifier.check_replicas", "StepChecks.skip")


@contextlib.contextmanager
def _counting(counts: dict[str, int]) -> Iterator[None]:
    """The verify checks that run inside are counted in `counts` (by COUNTED name)."""
    counted = [(CollectiveLog, "check"), (EngineVerifier, "check_replicas"), (StepChecks, "skip")]
    originals = [getattr(cls, name) for cls, name in counted]

    def counting(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] = counts.get(key, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    for (cls, name), fn in zip(counted, originals):
        setattr(cls, name, counting(f"{cls.__name__}.{name}", fn))
    try:
        yield
    finally:
        for (cls, name), fn in zip(counted, originals):
            setattr(cls, name, fn)


@contextlib.contextmanager
def _verify_all(counts: dict[str, int]) -> Iterator[None]:
    """Every DistributedDataParallelConfig built inside gets verify="all" (unless it set a
    level); the checks that run are counted."""
    post_init = DistributedDataParallelConfig.__post_init__

    def forced(self: DistributedDataParallelConfig) -> None:
        if self.verify == "off":
            object.__setattr__(self, "verify", "all")
        post_init(self)

    DistributedDataParallelConfig.__post_init__ = forced  # type: ignore[method-assign]
    try:
        with _counting(counts):
            yield
    finally:
        DistributedDataParallelConfig.__post_init__ = post_init  # type: ignore[method-assign]


def _verified(fn: Callable[..., Any], *args: Any) -> Any:
    counts: dict[str, int] = {}
    with _verify_all(counts):
        result = fn(*args)
    if isinstance(result, dict):
        result["verify_counts"] = counts
    return result


def run_each_verified(cases: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """`run_each` with every case under verify="all" (its result dict gains "verify_counts")."""
    return run_each({name: (_verified, *case) for name, case in cases.items()})
