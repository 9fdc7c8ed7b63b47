"""Rank side of tests/test_deterministic.py ([Note: deterministic reduction]): one model and
batch per case, built under several engine variants (bucket size, overlap, a repeat), whose
reduced grads are compared bitwise in param space; a single-process emulation of the fixed-order
sum; `verify_reproducible` on the mode and on a deliberately bucket-size-dependent hook."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist
from comm_hook_cases import _raises
from grad_cases import NATIVE_GLOO
from torch import nn

import megabuf
from megabuf.comm_hooks import Compress, Deterministic, GradBucket, Reduce, fixed_order_sum
from megabuf.training.reproducible import _param_space_grads
from megabuf.transport.collectives import Collectives

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SMALL, LARGE = 300, 100_000  # elements: several buckets (one group each with overlap) vs one
# (bucket_size, overlap_grad_reduce); the last is a repeat of the first
VARIANTS = [(SMALL, False), (SMALL, True), (LARGE, False), (LARGE, True), (SMALL, False)]
STEPS = 2  # the second step dispatches during backward under overlap ([Note: grad readiness])


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 5)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.to(self.layers[0].weight.dtype)).float()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a global batch of 32."""
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 5, generator=g)
    n = 32 // dist.get_world_size()
    rows = slice(dist.get_rank() * n, (dist.get_rank() + 1) * n)
    return x[rows].to(_device()), y[rows].to(_device())


def _factory(dtype: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return MLP().to(DTYPES[dtype]).to(_device())

    return make


def _loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _device() -> torch.device:
    """cuda:<this rank's device> in an NCCL pool (the GPU tier), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dense(dtype: str, config: dict[str, Any], hook: Any = None) -> Any:
    """`config` may hold "native": gloo forced onto NCCL's native reduce-scatter."""
    config = dict(config)
    collectives = Collectives(NATIVE_GLOO) if config.pop("native", False) else None
    cfg = megabuf.DistributedDataParallelConfig(**config)
    net = _factory(dtype)().to(_device())
    model = megabuf.DistributedDataParallel(net, cfg, collectives=collectives)
    if hook is not None:
        model.register_comm_hook(hook)
    return model


def _dense_step(model: Any, step: int) -> None:
    model.zero_grad_buffer()
    _loss(model, _batch(step)).backward()
    model.finish_grad_sync()


def _moe(ep: int, config: dict[str, Any]) -> Any:
    from moe_cases import CFG, groups

    from megabuf.testing.moe import MoEModel

    pgs = groups(ep_size=ep)
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    model = megabuf.DistributedDataParallel(
        net, megabuf.DistributedDataParallelConfig(**config), process_groups=pgs
    )
    net.moe.collectives = model.engine.collectives
    return model


def _moe_step(model: Any, step: int) -> None:
    from moe_cases import run_step

    model.zero_grad_buffer()
    run_step(model, step, per_token=False)


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).float() for g in grads])


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def sweep_case(model_kind: str, arg: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The same 2 steps under every VARIANTS entry: are the reduced grads (param space) bitwise
    those of the first variant? `model_kind` "dense" (arg: dtype name) or "moe" (arg: ep)."""
    grads, n_buckets, hooks = [], [], set()
    for bucket_size, overlap in VARIANTS:
        cfg = {**config, "bucket_size": bucket_size, "overlap_grad_reduce": overlap}
        model = _dense(arg, cfg) if model_kind == "dense" else _moe(arg, cfg)
        step = _dense_step if model_kind == "dense" else _moe_step
        for i in range(STEPS):
            step(model, i)
        n_buckets.append(sum(len(g.buckets) for g in model.engine.all_bucket_groups))
        hooks |= {getattr(g.comm_hook, "name", None) for g in model.engine.all_bucket_groups}
        grads.append(_param_space_grads(model)[1])
    base = grads[0]
    return {
        "same": [_bits_equal(base, g) for g in grads[1:]],
        "max_diff": max((_flat(base) - _flat(g)).abs().max().item() for g in grads[1:]),
        "n_buckets": n_buckets,
        "hooks": sorted(map(str, hooks)),
        "grad_dtypes": sorted({str(g.dtype) for g in base}),
        "n_expert_buffers": len(model.engine.expert_parallel_buffers),
    }


class Capture:
    """Deterministic, keeping each bucket's pre-scaled data as the hook received it."""

    name = "Capture(Deterministic)"
    modes = Deterministic.modes
    deterministic = True

    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor] = {}
        self.buckets: list[GradBucket] = []

    def setup(self, buckets: list[GradBucket]) -> None:
        self.buckets += buckets

    def __call__(self, bucket: GradBucket) -> Any:
        self.seen[bucket.index] = bucket.data.clone()
        return Deterministic()(bucket)


def emulation_case(model_kind: str, arg: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Each bucket's result vs a single-process emulation from every rank's pre-scaled data
    (gathered): sum in fp32 in group-rank order, / group size under average_in_collective,
    one rounding to the grad dtype. The Capture hook, registered by hand, replaces the one
    deterministic_reduction installed."""
    cfg = {"deterministic_reduction": True, "bucket_size": SMALL, **config}
    hook = Capture()
    if model_kind == "dense":
        model = _dense(arg, cfg, hook)
        model.engine.collectives.stats.reset()
        _dense_step(model, 0)
    else:
        model = _moe(arg, cfg)
        model.register_comm_hook(hook)
        _moe_step(model, 0)
    bitwise, sizes = [], set()
    for bucket in hook.buckets:
        mine = hook.seen[bucket.index].float()  # exact for bf16
        seen = [torch.empty_like(mine) for _ in range(bucket.group_size)]
        dist.all_gather(seen, mine, group=bucket.group)
        total = seen[0].clone()
        for other in seen[1:]:
            total = total + other
        if bucket.average:
            total = total / bucket.group_size
        want = total.to(bucket.data.dtype)
        lo, hi = bucket.shard_range if bucket.shard is not None else (0, want.numel())
        bitwise.append(_bits_equal([bucket.target], [want[lo:hi]]))
        sizes.add(bucket.group_size)
    return {
        "bitwise": bitwise,
        "ring_nbytes": dict(model.engine.collectives.stats.ring_nbytes),
        "want_ring_nbytes": sum(_ring_nbytes(b) for b in hook.buckets),
        "workspaces": sorted({name for b in hook.buckets for _, name, _ in b._workspace}),
        "group_sizes": sorted(sizes),
        "hooks": sorted({getattr(g.comm_hook, "name", "") for g in model.engine.all_bucket_groups}),
        "expert": sorted({b.expert for b in hook.buckets}),
    }


def _ring_nbytes(bucket: GradBucket) -> int:
    """What a ring reduce-scatter (all-reduce: twice that) of the grad dtype moves per rank, for
    the bucket padded to a multiple of the group size."""
    size = bucket.group_size
    padded = -(-bucket.data.numel() // size) * size
    once = (size - 1) * (padded // size) * bucket.data.element_size()
    return once if bucket.shard is not None else 2 * once


# ---- verify_reproducible ------------------------------------------------------------------------
TARGET = "layers.4.weight"


class BucketSizeNoise:
    """A test-only hook that lies: it declares `deterministic` but adds to TARGET's first
    grad element a value that depends on its bucket's size (all-reduce mode)."""

    name = "BucketSizeNoise"
    modes = frozenset({"all_reduce"})
    deterministic = True

    def __call__(self, bucket: GradBucket) -> Generator[Any, Any, None]:
        yield from fixed_order_sum(bucket, bucket.data.dtype)
        for param, name in zip(bucket.params, bucket.param_names, strict=True):
            if name == TARGET:
                param.main_grad.view(-1)[0] += bucket.data.numel() * 1e-3  # type: ignore[attr-defined]


def _report(report: Any) -> dict[str, Any]:
    return {
        "identical": report.identical,
        "variants": {
            v.name: (v.identical, v.param, v.rank, v.max_abs_diff) for v in report.variants
        },
        "text": str(report),
    }


def verify_case(dtype: str, config: dict[str, Any], noisy: bool = False) -> dict[str, Any]:
    """verify_reproducible on the MLP with `config` (and the noisy hook if `noisy`); with the
    noisy hook, also what raise_on_difference raises."""
    cfg = megabuf.DistributedDataParallelConfig(**config)
    hook = BucketSizeNoise if noisy else None
    args = (_factory(dtype), _batch, _loss, cfg)
    report = megabuf.verify_reproducible(*args, comm_hook=hook)
    out = _report(report)
    if noisy:
        try:
            megabuf.verify_reproducible(*args, comm_hook=hook, raise_on_difference=True)
            out["raised"] = None
        except Exception as exc:  # the test checks class and message
            out["raised"] = (type(exc).__name__, str(exc))
    return out


# ---- optimizer steps ---------------------------------------------------------------------------
def optimizer_case(config: dict[str, Any], clip: float, exact: bool = True) -> dict[str, Any]:
    """2 Adam steps with clip_grad under each VARIANTS entry: params (and grad norms) bitwise
    those of the first variant? `exact=False`: with the ordinary float norm instead of
    [Note: exact grad norm] (patched in, to show what it fixes)."""
    from megabuf.optimizer import base

    saved = base.exact_grad_norm
    if not exact:
        base.exact_grad_norm = base.global_grad_norm  # type: ignore[assignment]
    try:
        return _optimizer_steps(config, clip)
    finally:
        base.exact_grad_norm = saved  # type: ignore[assignment]


def _optimizer_steps(config: dict[str, Any], clip: float) -> dict[str, Any]:
    params, norms = [], []
    for bucket_size, overlap in VARIANTS:
        cfg = {**config, "bucket_size": bucket_size, "overlap_grad_reduce": overlap}
        model = _dense("fp32", cfg)
        opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(lr=1e-2, clip_grad=clip))
        step_norms = []
        for i in range(STEPS):
            opt.zero_grad()
            _loss(model, _batch(i)).backward()
            model.finish_grad_sync()
            result = opt.step()
            step_norms.append(result.grad_norm)
        model.publish_params()
        params.append([p.detach().clone() for p in model.module.parameters()])
        norms.append(step_norms)
    return {
        "params_same": [_bits_equal(params[0], p) for p in params[1:]],
        "norms_same": [n == norms[0] for n in norms[1:]],
        "clipped": all(n > clip for n in norms[0]),
    }


# ---- misuse -------------------------------------------------------------------------------------


def _twice() -> None:
    model = _dense("fp32", {"deterministic_reduction": True})
    model.register_comm_hook(Compress(torch.bfloat16, "fp32"))  # replaces Deterministic
    model.register_comm_hook(Deterministic())


def errors_case() -> dict[str, Any]:
    det = {"deterministic_reduction": True}
    wire = {"name": "compress", "dtype": "bfloat16", "accumulate": "wire"}
    fp32 = {"name": "compress", "dtype": "bfloat16", "accumulate": "fp32"}
    allowed = _dense("fp32", {**det, "comm_hook": fp32})
    plain = _dense("fp32", det)
    return {
        "reduce_hook": _raises(lambda: _dense("fp32", det).register_comm_hook(Reduce())),
        "wire_from_config": _raises(lambda: _dense("fp32", {**det, "comm_hook": wire})),
        "twice": _raises(_twice),
        "bad_steps": _raises(
            lambda: megabuf.verify_reproducible(_factory("fp32"), _batch, _loss, steps=0)
        ),
        "allowed_hooks": sorted({g.comm_hook.name for g in allowed.engine.all_bucket_groups}),
        "installed": sorted({g.comm_hook.name for g in plain.engine.all_bucket_groups}),
    }
