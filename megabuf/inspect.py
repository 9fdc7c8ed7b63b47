"""`megabuf inspect`: the buffers, buckets and bucket groups megabuf would build for a model.

A thin layer over `megabuf.plan`, the planner `DistributedDataParallel` allocates from: it turns
a model's trainable params into `ParamSpec`s, plans them at a given fake `dp_size` (no process
group) and formats the result. `tests/test_inspect.py` checks it against a real wrapped model.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.layout import BufferLayout
from megabuf.plan import BufferPlan, ParamSpec, Plan, build_plan
from megabuf.replicas import param_specs
from megabuf.sharding.memory_table import StrategyMemory, format_memory_table, memory_per_strategy

MiB = 1 << 20


@dataclass(frozen=True)
class BucketInfo:
    bucket_id: int
    start: int
    end: int
    numel_unpadded: int
    param_names: tuple[str, ...]  # buffer order
    shard_ranges: tuple[tuple[int, int], ...]  # per dp rank; empty when not sharded

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def padding_numel(self) -> int:
        return self.numel - self.numel_unpadded


@dataclass(frozen=True)
class BufferInfo:
    index: int
    expert: bool
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    dp_size: int
    param_names: tuple[str, ...]  # registration order
    layout: BufferLayout
    buckets: tuple[BucketInfo, ...]

    @property
    def grad_nbytes(self) -> int:
        return self.layout.numel * _itemsize(self.grad_dtype)

    @property
    def param_nbytes(self) -> int:
        """The contiguous param buffer (distributed optimizer only)."""
        return self.layout.numel * _itemsize(self.param_dtype) if self.layout.sharded else 0


@dataclass(frozen=True)
class GroupInfo:
    group_id: int
    buffer_index: int
    bucket_id: int
    dispatch_position: int  # place in the expected backward (dispatch) order of its chain
    chain_id: int  # the dispatch chain (one per communicator) the group belongs to


@dataclass(frozen=True)
class Inspection:
    model_name: str
    config: DistributedDataParallelConfig
    dp_size: int
    bucket_size: int | None  # resolved, in elements (None: one bucket per buffer)
    numel_total: int  # every param, trainable or not
    buffers: tuple[BufferInfo, ...]
    groups: tuple[GroupInfo, ...]  # one row per (bucket group, member bucket)
    plan: Plan  # what DistributedDataParallel allocates
    memory: tuple[StrategyMemory, ...] = ()  # persistent bytes per sharding strategy (Adam)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _import_from_cwd(module_name: str) -> ModuleType:
    """Import `module_name` the way `python -m` would see it: the current directory first (a
    console script like `megabuf` does not put it on sys.path)."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(cwd)


def load_model(spec: str, seed: int = 0) -> nn.Module:
    """A preset name of `megabuf.testing` ("gpt_small", ...) or "package.module:factory"."""
    if ":" not in spec:
        from megabuf.testing.models import build_model

        return build_model(spec, seed=seed)
    module_name, _, factory_name = spec.partition(":")
    factory = getattr(_import_from_cwd(module_name), factory_name, None)
    if not callable(factory):
        raise ValueError(f"megabuf: {spec!r}: {module_name} has no callable {factory_name!r}")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"megabuf: {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _buffer_info(buf: BufferPlan, specs: Sequence[ParamSpec]) -> BufferInfo:
    layout, dp_size = buf.layout, buf.dp_size
    buckets = tuple(
        BucketInfo(
            b.bucket_id,
            b.start,
            b.end,
            b.numel_unpadded,
            tuple(specs[i].name for i in buf.bucket_param_ids(b.bucket_id)),
            tuple(b.shard_range(r, dp_size) for r in range(dp_size)) if layout.sharded else (),
        )
        for b in layout.buckets
    )
    names = tuple(specs[i].name for i in buf.param_ids)
    return BufferInfo(
        buf.index, buf.expert, buf.param_dtype, buf.grad_dtype, dp_size, names, layout, buckets
    )


def _group_infos(plan: Plan) -> tuple[GroupInfo, ...]:
    """One row per (bucket group, member bucket), in group id order."""
    return tuple(
        GroupInfo(g.group_id, buffer_index, bucket_id, g.dispatch_position, g.chain_id)
        for g in plan.groups
        for buffer_index, bucket_id in g.members
    )


def inspect_model(
    model: nn.Module,
    config: DistributedDataParallelConfig,
    dp_size: int,
    *,
    model_name: str = "model",
    ep_size: int = 1,
    disable_bucketing: bool = False,
) -> Inspection:
    """What `DistributedDataParallel(model, config)` would build at `dp_size` ranks."""
    if dp_size < 1 or ep_size < 1 or dp_size % ep_size:
        raise ValueError(
            f"megabuf: need dp_size >= 1 divisible by ep_size; got {dp_size}, {ep_size}"
        )
    named = list(model.named_parameters())
    specs = param_specs([(n, p) for n, p in named if p.requires_grad])
    plan = build_plan(
        specs, config, dp_size=dp_size, expt_dp_size=dp_size // ep_size,
        expert_shares_dp_group=ep_size == 1, disable_bucketing=disable_bucketing,
    )  # fmt: skip
    buffers = tuple(_buffer_info(b, specs) for b in plan.buffers)
    numel_total = sum(p.numel() for _, p in named)
    memory = memory_per_strategy(
        specs, config, dp_size=dp_size, expt_dp_size=dp_size // ep_size,
        expert_shares_dp_group=ep_size == 1, disable_bucketing=disable_bucketing,
    )  # fmt: skip
    return Inspection(
        model_name, config, dp_size, plan.bucket_size, numel_total, buffers, _group_infos(plan),
        plan, memory,
    )  # fmt: skip


def _fmt_range(lo: int, hi: int) -> str:
    return f"[{lo:,}, {hi:,})"


def _format_bucket(bucket: BucketInfo, show_params: bool) -> list[str]:
    share = 100.0 * bucket.padding_numel / max(1, bucket.numel)
    lines = [
        f"    bucket {bucket.bucket_id}: {_fmt_range(bucket.start, bucket.end)} "
        f"{bucket.numel:,} elements, {len(bucket.param_names)} params, "
        f"padding {bucket.padding_numel:,} ({share:.2f}%)"
    ]
    if bucket.shard_ranges:
        shards = "  ".join(f"r{r} {_fmt_range(*s)}" for r, s in enumerate(bucket.shard_ranges))
        lines.append(f"      dp shards: {shards}")
    if show_params:
        lines.extend(f"      - {name}" for name in bucket.param_names)
    else:
        first, last = bucket.param_names[0], bucket.param_names[-1]
        lines.append(
            f"      params: {first} ... {last}" if first != last else f"      params: {first}"
        )
    return lines


def format_inspection(info: Inspection, *, show_params: bool = False) -> str:
    """The human-readable report `megabuf inspect` prints."""
    cfg = info.config
    size = "one bucket per buffer" if info.bucket_size is None else f"{info.bucket_size:,} elements"
    lines = [
        f"model {info.model_name}: {info.numel_total:,} params, dp_size={info.dp_size}",
        f"config: overlap_grad_reduce={cfg.overlap_grad_reduce} "
        f"use_distributed_optimizer={cfg.use_distributed_optimizer} "
        f"overlap_param_gather={cfg.overlap_param_gather} "
        f"grad_reduce_in_fp32={cfg.grad_reduce_in_fp32}; bucket size: {size}",
    ]
    for b in info.buffers:
        pad = b.layout.padding_numel
        share = 100.0 * pad / max(1, b.layout.numel)
        kind = "expert" if b.expert else "dense"
        lines.append(
            f"buffer {b.index} ({kind}, param {str(b.param_dtype).removeprefix('torch.')}, "
            f"grad {str(b.grad_dtype).removeprefix('torch.')}): {len(b.param_names)} params, "
            f"{len(b.buckets)} buckets, {b.layout.numel:,} elements, padding {pad:,} "
            f"({share:.2f}%); grad buffer {b.grad_nbytes / MiB:.2f} MiB, "
            f"param buffer {b.param_nbytes / MiB:.2f} MiB"
        )
        for bucket in b.buckets:
            lines.extend(_format_bucket(bucket, show_params))
    lines.append(f"bucket groups ({len(info.plan.groups)}), in dispatch order:")
    lines.extend(_format_chains(info))
    lines.extend(format_memory_table(info.memory, info.dp_size, "Adam"))
    return "\n".join(lines)


def _format_chains(info: Inspection) -> list[str]:
    """Each dispatch chain (one per communicator, see [Note: one chain per communicator]) and
    its groups in dispatch order, one line per member bucket."""
    lines = []
    for chain_id, group_ids in enumerate(info.plan.chains):
        kinds = sorted({info.plan.groups[g].expert for g in group_ids})
        what = " + ".join("expert" if expert else "dense" for expert in kinds)
        over = "expt_dp" if kinds == [True] else "dp"
        count = f"{len(group_ids)} group" + ("s" if len(group_ids) != 1 else "")
        lines.append(f" chain {chain_id} ({what}, over {over}): {count}")
        rows = [g for g in info.groups if g.chain_id == chain_id]
        for g in sorted(rows, key=lambda g: (g.dispatch_position, g.group_id)):
            lines.append(f"  {g.dispatch_position}: group {g.group_id} = buffer {g.buffer_index} "
                         f"bucket {g.bucket_id}")  # fmt: skip
    return lines


def inspection_to_dict(info: Inspection) -> dict[str, object]:
    """A JSON-serialisable form (for `megabuf inspect --json`)."""
    return {
        "model": info.model_name,
        "dp_size": info.dp_size,
        "bucket_size": info.bucket_size,
        "numel_total": info.numel_total,
        "buffers": [
            {
                "index": b.index,
                "expert": b.expert,
                "param_dtype": str(b.param_dtype),
                "grad_dtype": str(b.grad_dtype),
                "numel": b.layout.numel,
                "numel_unpadded": b.layout.numel_unpadded,
                "grad_nbytes": b.grad_nbytes,
                "param_nbytes": b.param_nbytes,
                "buckets": [
                    {
                        "bucket_id": k.bucket_id,
                        "start": k.start,
                        "end": k.end,
                        "numel_unpadded": k.numel_unpadded,
                        "params": list(k.param_names),
                        "shard_ranges": [list(s) for s in k.shard_ranges],
                    }
                    for k in b.buckets
                ],
            }
            for b in info.buffers
        ],
        "groups": [g.__dict__ for g in info.groups],
        "chains": [list(chain) for chain in info.plan.chains],
        "memory": [_memory_dict(m) for m in info.memory],
    }


def _memory_dict(m: StrategyMemory) -> dict[str, object]:
    return {
        "strategy": m.strategy,
        "dp_rank": m.dp_rank,
        "bytes_per_param": m.bytes_per_param,
        "textbook_bytes_per_param": m.textbook_bytes_per_param,
        "nbytes": dict(m.nbytes),
    }
