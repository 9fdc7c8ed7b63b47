"""`megabuf inspect`: the buffers, buckets and bucket groups megabuf would build for a model.

A thin layer over `megabuf.planning.plan`, the planner `DistributedDataParallel` allocates from: it
turns a model's trainable params into `ParamSpec`s, plans them at a given fake `dp_size` (no process
group) and formats the result. `tests/test_inspect.py` checks it against a real wrapped model.
Under optim_grads_params it also plans the shard units (`megabuf.sharding.units.plan_units`) and
shows each unit: its owned params, padded elements, gathered bytes, buckets and bucket group.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.fp8 import param_dtype_label
from megabuf.planning.model_plan import plan_model
from megabuf.planning.plan import BufferPlan, ParamSpec, Plan
from megabuf.planning.replicas import param_specs
from megabuf.pure.bucket_planner import format_bucket_ends
from megabuf.pure.hybrid import HybridSplit, describe_split, planned_split
from megabuf.pure.layout import BufferLayout
from megabuf.sharding.memory_table import StrategyMemory, format_memory_table, memory_per_strategy
from megabuf.sharding.units import UnitPlan, plan_units

MiB = 1 << 20


@dataclass(frozen=True)
class BucketInfo:
    bucket_id: int
    start: int
    end: int
    numel_unpadded: int
    param_names: tuple[str, ...]  # buffer order
    shard_ranges: tuple[tuple[int, int], ...]  # per dp rank; empty when not sharded
    unit: int | None = None  # the shard unit it belongs to (optim_grads_params only)

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
    unit: int | None = None  # the shard unit it gathers (optim_grads_params only)


@dataclass(frozen=True)
class UnitInfo:
    """One shard unit (optim_grads_params): what it owns and what gathering it costs."""

    index: int
    name: str  # dotted module path; "" for the root
    class_name: str
    parent: int | None
    param_names: tuple[str, ...]  # owned trainable params, registration order
    numel_unpadded: int  # elements of the owned params
    numel: int  # padded: all of the unit's buckets, across buffers
    param_nbytes: int  # the unit's gathered (unsharded) params, each bucket in its param dtype
    grad_nbytes: int  # the unit's full grad buckets, each in its grad dtype
    buckets: tuple[tuple[int, int], ...]  # (buffer index, bucket id), dense then expert
    group_ids: tuple[int, ...]  # its bucket groups (dense, expert); none if it owns nothing


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
    units: tuple[UnitInfo, ...] = ()  # optim_grads_params only, by unit index
    memory: tuple[StrategyMemory, ...] = ()  # persistent bytes per sharding strategy (Adam)
    split: HybridSplit | None = None  # hybrid: dp = replicas x shard ([Note: hybrid rank order])


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


def _buffer_info(
    buf: BufferPlan, specs: Sequence[ParamSpec], units: Sequence[int] | None
) -> BufferInfo:
    layout, dp_size = buf.layout, buf.dp_size
    buckets = tuple(
        BucketInfo(
            b.bucket_id,
            b.start,
            b.end,
            b.numel_unpadded,
            tuple(specs[i].name for i in buf.bucket_param_ids(b.bucket_id)),
            tuple(b.shard_range(r, dp_size) for r in range(dp_size)) if layout.sharded else (),
            None if units is None else units[buf.bucket_param_ids(b.bucket_id)[0]],
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
        GroupInfo(g.group_id, buffer_index, bucket_id, g.dispatch_position, g.chain_id, g.unit)
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
    dp_shard_size: int | None = None,
    bucket_ends: Sequence[Sequence[int]] | None = None,
) -> Inspection:
    """What `DistributedDataParallel(model, config)` would build at `dp_size` ranks: with
    `dp_shard_size` (or the config's num_distributed_optimizer_instances) as a hybrid split,
    whose buffers are laid out, sharded and gathered over the shard group; with `bucket_ends`
    (what a bucket_size="auto" re-plan logged), the plan it re-planned to."""
    if dp_size < 1 or ep_size < 1 or dp_size % ep_size:
        raise ValueError(
            f"megabuf: need dp_size >= 1 divisible by ep_size; got {dp_size}, {ep_size}"
        )
    strategy = config.sharding.name if config.sharding.shards_optimizer else None
    split = planned_split(
        dp_size, shard_size=dp_shard_size, replicas=config.num_distributed_optimizer_instances,
        ep_size=ep_size, strategy=strategy,
    )  # fmt: skip
    full_dp, dp_size = dp_size, split.shard_size if split is not None else dp_size
    named = list(model.named_parameters())
    planned = plan_model(
        model, config, dp_size=dp_size, expt_dp_size=dp_size // ep_size,
        expert_shares_dp_group=ep_size == 1, disable_bucketing=disable_bucketing,
        bucket_ends=bucket_ends,
    )  # fmt: skip
    trainable, unit_plan, plan = list(planned.trainable), planned.unit_plan, planned.plan
    specs = param_specs(trainable)
    buffers = tuple(_buffer_info(b, specs, plan.unit_of_spec) for b in plan.buffers)
    numel_total = sum(p.numel() for _, p in named)
    units = _unit_infos(unit_plan, plan, specs) if unit_plan else ()
    memory = memory_per_strategy(
        specs, config, dp_size=dp_size, expt_dp_size=dp_size // ep_size,
        expert_shares_dp_group=ep_size == 1, disable_bucketing=disable_bucketing,
        unit_of_param=_zero3_units(model, unit_plan, trainable),
    )  # fmt: skip
    return Inspection(
        model_name, config, full_dp, plan.bucket_size, numel_total, buffers, _group_infos(plan),
        plan, units, memory, split,
    )  # fmt: skip


def _zero3_units(
    model: nn.Module, unit_plan: UnitPlan | None, trainable: Sequence[tuple[str, nn.Parameter]]
) -> tuple[int, ...]:
    """The shard unit of each trainable param for the memory table's optim_grads_params row:
    the configured units, else the default policy's (its one-unit warning is for runs, not for
    a table row)."""
    if unit_plan is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            unit_plan = plan_units(model, (), trainable)
    return unit_plan.unit_ids([n for n, _ in trainable])


def _unit_infos(units: UnitPlan, plan: Plan, specs: Sequence[ParamSpec]) -> tuple[UnitInfo, ...]:
    """Each unit's owned params and, from the plan's unit groups, its buckets and bytes."""
    numel_of = {s.name: s.numel for s in specs}
    out = []
    for unit in units.units:
        groups = [g for g in plan.groups if g.unit == unit.index]
        buckets = tuple(pair for g in groups for pair in g.members)
        slots = [(plan.buffers[b], plan.buffers[b].layout.buckets[k]) for b, k in buckets]
        out.append(
            UnitInfo(
                unit.index,
                unit.name,
                type(unit.module).__name__,
                unit.parent,
                unit.param_names,
                sum(numel_of[n] for n in unit.param_names),
                sum(k.numel for _, k in slots),
                sum(k.numel * _itemsize(buf.param_dtype) for buf, k in slots),
                sum(k.numel * _itemsize(buf.grad_dtype) for buf, k in slots),
                buckets,
                tuple(g.group_id for g in groups),
            )
        )
    return tuple(out)


def _fmt_nbytes(nbytes: int) -> str:
    return f"{nbytes / MiB:.2f} MiB" if nbytes >= MiB // 100 else f"{nbytes:,} B"


def _fmt_range(lo: int, hi: int) -> str:
    return f"[{lo:,}, {hi:,})"


def _format_bucket(bucket: BucketInfo, show_params: bool) -> list[str]:
    share = 100.0 * bucket.padding_numel / max(1, bucket.numel)
    unit = "" if bucket.unit is None else f", unit {bucket.unit}"
    lines = [
        f"    bucket {bucket.bucket_id}: {_fmt_range(bucket.start, bucket.end)} "
        f"{bucket.numel:,} elements, {len(bucket.param_names)} params, "
        f"padding {bucket.padding_numel:,} ({share:.2f}%){unit}"
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
    if info.plan.bucket_ends is not None:
        size = f"chosen boundaries (bucket_ends {format_bucket_ends(info.plan.bucket_ends)})"
    elif cfg.bucket_size == "auto":  # [Note: auto bucket re-plan]
        size = f"auto: {size} until the re-plan after {cfg.auto_bucket_warmup_steps} steps"
    lines = [
        f"model {info.model_name}: {info.numel_total:,} params, dp_size={info.dp_size}"
        + describe_split(info.split),
        f"config: overlap_grad_reduce={cfg.overlap_grad_reduce} "
        f"use_distributed_optimizer={cfg.sharding.shards_optimizer} "
        f"overlap_param_gather={cfg.overlap_param_gather} "
        f"grad_reduce_in_fp32={cfg.grad_reduce_in_fp32}; bucket size: {size}",
    ]
    for b in info.buffers:
        pad = b.layout.padding_numel
        share = 100.0 * pad / max(1, b.layout.numel)
        kind = "expert" if b.expert else "dense"
        lines.append(
            f"buffer {b.index} ({kind}, param {param_dtype_label(b.param_dtype)}, "
            f"grad {str(b.grad_dtype).removeprefix('torch.')}): {len(b.param_names)} params, "
            f"{len(b.buckets)} buckets, {b.layout.numel:,} elements, padding {pad:,} "
            f"({share:.2f}%); grad buffer {b.grad_nbytes / MiB:.2f} MiB, "
            f"param buffer {b.param_nbytes / MiB:.2f} MiB"
        )
        for bucket in b.buckets:
            lines.extend(_format_bucket(bucket, show_params))
    lines.extend(_format_units(info, show_params))
    lines.append(f"bucket groups ({len(info.plan.groups)}), in dispatch order:")
    lines.extend(_format_chains(info))
    shard = info.split.shard_size if info.split is not None else info.dp_size
    lines.extend(format_memory_table(info.memory, shard, "Adam"))
    return "\n".join(lines)


def _format_units(info: Inspection, show_params: bool) -> list[str]:
    """The shard units (optim_grads_params): one line each, then their params."""
    if not info.units:
        return []
    cfg = info.config
    reshard = cfg.sharding.reshards_after_forward
    lines = [
        f"shard units ({len(info.units)}; reshard_after_forward={reshard}, "
        f"prefetch_units={cfg.prefetch_units}), gathered and released together:"
    ]
    for u in info.units:
        where = "root" if u.parent is None else f"in unit {u.parent}"
        buckets = ", ".join(f"buffer {b} bucket {k}" for b, k in u.buckets) or "none"
        groups = ", ".join(map(str, u.group_ids)) or "none"
        lines.append(
            f" unit {u.index} {u.name or '<root>'} ({u.class_name}, {where}): "
            f"{len(u.param_names)} params, {u.numel_unpadded:,} elements, padded {u.numel:,}; "
            f"gathered params {_fmt_nbytes(u.param_nbytes)}; buckets: {buckets}; group {groups}"
        )
        if show_params:
            lines.extend(f"      - {name}" for name in u.param_names)
        elif u.param_names:
            first, last = u.param_names[0], u.param_names[-1]
            lines.append(f"      params: {first} ... {last}" if first != last
                         else f"      params: {first}")  # fmt: skip
    return lines


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
            unit = "" if g.unit is None else f" (unit {g.unit} {_unit_name(info, g.unit)})"
            lines.append(f"  {g.dispatch_position}: group {g.group_id} = buffer {g.buffer_index} "
                         f"bucket {g.bucket_id}{unit}")  # fmt: skip
    return lines


def _unit_name(info: Inspection, index: int) -> str:
    return (info.units[index].name if index < len(info.units) else "") or "<root>"


def inspection_to_dict(info: Inspection) -> dict[str, object]:
    """A JSON-serialisable form (for `megabuf inspect --json`)."""
    return {
        "model": info.model_name,
        "dp_size": info.dp_size,
        "dp_replicate_size": info.split.replicate_size if info.split else 1,
        "dp_shard_size": info.split.shard_size if info.split else info.dp_size,
        "bucket_size": info.bucket_size,
        "bucket_ends": info.plan.bucket_ends,
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
                        "unit": k.unit,
                    }
                    for k in b.buckets
                ],
            }
            for b in info.buffers
        ],
        "groups": [g.__dict__ for g in info.groups],
        "chains": [list(chain) for chain in info.plan.chains],
        "units": [
            {
                "index": u.index,
                "name": u.name,
                "class": u.class_name,
                "parent": u.parent,
                "params": list(u.param_names),
                "numel_unpadded": u.numel_unpadded,
                "numel": u.numel,
                "param_nbytes": u.param_nbytes,
                "grad_nbytes": u.grad_nbytes,
                "buckets": [list(pair) for pair in u.buckets],
                "groups": list(u.group_ids),
            }
            for u in info.units
        ],
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
