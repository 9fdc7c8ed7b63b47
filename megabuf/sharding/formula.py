"""Exact persistent bytes per rank for each sharding strategy, from the padded layout (pure).

[Note: memory formula]
What one rank keeps for the whole run, per category, for a `Plan` (megabuf/planning/plan.py) under
`strategy`. Per buffer: n = its padded numel (every bucket incl. padding), p / g = param / grad
dtype bytes, d = its dp size (expt_dp for expert buffers), `owned` = the param elements of this
rank's shards (`layout.shard_pieces`: shard padding excluded; every element when unsharded),
`tensors` = the main-param tensors the inner optimizer steps (one per shard piece; one per param
when unsharded):

    category         no_shard      optim        optim_grads   optim_grads_params
    params           n * p         n * p        n * p         n / d * p   (the param shard)
    grads            n * g         n * g        n / d * g     n / d * g   (the grad shard)
    main_params      4 * owned if p != 4 (an fp32 copy), else 0 (the buffer is stepped in place)
    optimizer_state  4 * states * owned + scalar_nbytes * tensors
    comm_scratch     0             n * g        0             0

An FP8 buffer (param dtype uint8, [Note: FP8 params] in megabuf/fp8/__init__.py) has p = 1, adds
4 bytes of scale per param to "params", and its fp32 master is this rank's padded shard:
main_params = 4 * n / d.

(no_shard's layout has no padding, so there n is the params' numel.) `comm_scratch` is the
all-to-all landing zone a gloo reduce-scatter keeps per bucket (`reduce_scatter_scratch`; NCCL's
native reduce-scatter needs none); under optim_grads* the full grad bucket is released after
its reduction and its scratch is taken to go with it. With `cpu_offload` the main params and the
optimizer state are host memory (`host_main_params`, `host_optimizer_state`): the main params are
then an fp32 copy for every dtype (the buffer stays on the device), and the grads of this
rank's pieces get a host copy in the grad dtype (`host_grads`).

Summed over the buffers this is the design notes' table (§2.6) with the exact padding: bf16
params, fp32 grads and Adam give 18, 6 + 12/d, 2 + 16/d and 18/d bytes per param (`textbook`).
Frozen params and module buffers are not in the plan: `memory_report()` adds them as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megabuf.planning.plan import BufferPlan, Plan
from megabuf.pure.layout import shard_pieces
from megabuf.sharding.strategies import ShardingStrategy, sharding_strategy

FP32_NBYTES = 4
DEVICE_CATEGORIES = ("params", "grads", "main_params", "optimizer_state", "comm_scratch")
HOST_CATEGORIES = ("host_main_params", "host_optimizer_state", "host_grads")


@dataclass(frozen=True)
class OptimizerStateSpec:
    """What an inner optimizer keeps per main-param tensor."""

    name: str
    elementwise: int  # fp32 tensors of one value per element (Adam: exp_avg, exp_avg_sq)
    scalar_nbytes: int  # bytes of per-tensor scalars (Adam's fp32 `step`: 4)


ADAM = OptimizerStateSpec("adam", 2, FP32_NBYTES)
SGD_MOMENTUM = OptimizerStateSpec("sgd_momentum", 1, 0)
SGD = OptimizerStateSpec("sgd", 0, 0)
OPTIMIZER_SPECS = {s.name: s for s in (ADAM, SGD_MOMENTUM, SGD)}


def optimizer_spec(optimizer: torch.optim.Optimizer) -> OptimizerStateSpec:
    """The spec of a torch optimizer instance (Adam, AdamW, SGD with or without momentum)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        return OptimizerStateSpec("adam", 3, FP32_NBYTES) if amsgrad else ADAM
    if isinstance(optimizer, torch.optim.SGD):
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return SGD_MOMENTUM if momentum else SGD
    raise ValueError(
        f"megabuf: no memory formula for {type(optimizer).__name__}; pass an "
        "OptimizerStateSpec(name, elementwise, scalar_nbytes) describing its per-param state"
    )


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def buffer_bytes(
    buf: BufferPlan,
    strategy: str,
    optimizer: OptimizerStateSpec,
    *,
    dp_rank: int,
    reduce_scatter_scratch: bool = False,
    cpu_offload: bool = False,
) -> dict[str, int]:
    """One buffer's persistent bytes on dp rank `dp_rank` of its group; see [Note: memory
    formula]."""
    rules = sharding_strategy(strategy)  # [Note: sharding strategy objects]
    layout, d = buf.layout, buf.dp_size
    sharded = rules.shards_optimizer
    if sharded != layout.sharded:
        raise ValueError(
            f"megabuf: buffer {buf.index} was planned {'with' if layout.sharded else 'without'} "
            f"sharding padding, which does not fit strategy {strategy!r}; plan it with a config "
            "of that strategy"
        )
    n, p, g = layout.numel, itemsize(buf.param_dtype), itemsize(buf.grad_dtype)
    if sharded:
        pieces = shard_pieces(layout, dp_rank, d)
        owned, tensors = sum(x.numel for x in pieces), len(pieces)
    else:
        owned, tensors = layout.numel_unpadded, len(layout.params)
    copy = cpu_offload or buf.param_dtype != torch.float32
    main = FP32_NBYTES * owned if copy else 0
    fp8 = buf.param_dtype == torch.uint8  # FP8 params: scales, masters of the padded shard
    scales = FP32_NBYTES * len(buf.param_ids) if fp8 else 0
    main = FP32_NBYTES * n // d if fp8 and sharded else main
    state = FP32_NBYTES * optimizer.elementwise * owned + optimizer.scalar_nbytes * tensors
    out = {
        "params": rules.param_nbytes(n, p, d) + scales,
        "grads": rules.grad_nbytes(n, g, d),
        "main_params": 0 if cpu_offload else main,
        "optimizer_state": 0 if cpu_offload else state,
        "comm_scratch": n * g if rules.keeps_scratch and reduce_scatter_scratch else 0,
        "host_main_params": main if cpu_offload else 0,
        "host_optimizer_state": state if cpu_offload else 0,
        "host_grads": owned * g if cpu_offload else 0,
    }
    return out


def persistent_bytes(
    plan: Plan,
    strategy: str,
    optimizer: OptimizerStateSpec,
    *,
    dp_rank: int,
    expt_dp_rank: int | None = None,
    reduce_scatter_scratch: bool = False,
    cpu_offload: bool = False,
) -> dict[str, int]:
    """Persistent bytes per category (DEVICE_CATEGORIES then HOST_CATEGORIES) that dp rank
    `dp_rank` (expt_dp rank `expt_dp_rank` for expert buffers, default the same) keeps for
    `plan` under `strategy`; see [Note: memory formula]."""
    total = dict.fromkeys(DEVICE_CATEGORIES + HOST_CATEGORIES, 0)
    expt_rank = dp_rank if expt_dp_rank is None else expt_dp_rank
    for buf in plan.buffers:
        figures = buffer_bytes(
            buf, strategy, optimizer, dp_rank=expt_rank if buf.expert else dp_rank,
            reduce_scatter_scratch=reduce_scatter_scratch, cpu_offload=cpu_offload,
        )  # fmt: skip
        for key, value in figures.items():
            total[key] += value
    return total


def bytes_per_param(figures: Mapping[str, int], numel: int) -> float:
    """Total bytes of `figures` per param element (`numel`: the params the plan holds)."""
    return sum(figures.values()) / max(1, numel)


def textbook(
    strategy: str,
    dp_size: int,
    *,
    param_nbytes: int = 2,
    grad_nbytes: int = 4,
    states: int = 2,
    main_copy: bool = True,
) -> float:
    """Bytes per param without padding (the design notes' §2.6 table): bf16 params, fp32
    grads and Adam give 18, 6 + 12/d, 2 + 16/d, 18/d; fp32 params and Adam (no main copy)
    16, 8 + 8/d, 4 + 12/d, 16/d."""
    rules = sharding_strategy(strategy)
    if dp_size < 1:
        raise ValueError(f"megabuf: dp_size must be >= 1, got {dp_size}")
    optim = FP32_NBYTES * (states + (1 if main_copy else 0))
    return rules.textbook(param_nbytes, grad_nbytes, optim, dp_size)


def group_nbytes(plan: Plan, group_id: int, *, grads: bool) -> int:
    """Full (unsharded) bytes of one bucket group's buckets: grads, or params."""
    total = 0
    for b, k in plan.groups[group_id].members:
        buf = plan.buffers[b]
        dtype = buf.grad_dtype if grads else buf.param_dtype
        total += buf.layout.buckets[k].numel * itemsize(dtype)
    return total


def transient_bounds(
    plan: Plan,
    strategy: str | ShardingStrategy,
    *,
    prefetch_units: int = 1,
    reshard_after_forward: bool = True,
) -> dict[str, int]:
    """Upper bounds of the transient categories' high-water marks (design notes §2.6):
    "grad_buckets" (optim_grads*): every group's full grad bucket may be alive at once (no
    overlap: all accumulate until the end of backward), so the bound is their sum, and the same
    for "grad_scratch" (gloo's reduce-scatter landing zones, released with their buckets);
    "unsharded_params" (optim_grads_params): the strategy's `unsharded_params_bound` over the
    root unit's groups and the others (the root plus (1 + prefetch_units) times the largest
    other group, at most all other groups, when units reshard after forward; every group
    otherwise). Units nested in another unit (not the root) are not covered by the first bound.
    Strategies that release nothing have no transients. `strategy`: a config's `sharding`, or a
    `data_parallel_sharding_strategy` name with its `reshard_after_forward`."""
    rules = (
        strategy
        if isinstance(strategy, ShardingStrategy)
        else sharding_strategy(strategy, reshard_after_forward=reshard_after_forward)
    )
    out: dict[str, int] = {}
    grads = sum(group_nbytes(plan, g.group_id, grads=True) for g in plan.groups)
    if (bound := rules.grad_buckets_bound(grads)) is not None:
        out["grad_buckets"] = bound
        out["grad_scratch"] = bound  # gloo: one landing zone per bucket reducing
    sizes = {g.group_id: group_nbytes(plan, g.group_id, grads=False) for g in plan.groups}
    root = [g.group_id for g in plan.groups if g.unit == 0]
    others = [size for gid, size in sizes.items() if gid not in root]
    bound = rules.unsharded_params_bound(sum(sizes[g] for g in root), others, prefetch_units)
    if bound is not None:
        out["unsharded_params"] = bound
    return out
