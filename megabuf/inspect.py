"""`megabuf inspect`: the buffers, buckets and bucket groups megabuf would build for a model.

Pure: it applies the same rules as `DistributedDataParallel` (trainable params, dense vs expert,
one buffer per (param dtype, grad dtype), bucket size resolution, `megabuf.layout`) at a given
fake `dp_size`, without any process group. `tests/test_inspect.py` checks it against a real
wrapped model so the two cannot drift apart silently.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.layout import BufferLayout, compute_layout, default_bucket_size
from megabuf.replicas import is_expert_parallel

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


@dataclass(frozen=True)
class Inspection:
    model_name: str
    config: DistributedDataParallelConfig
    dp_size: int
    bucket_size: int | None  # resolved, in elements (None: one bucket per buffer)
    numel_total: int  # every param, trainable or not
    buffers: tuple[BufferInfo, ...]
    groups: tuple[GroupInfo, ...]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def load_model(spec: str, seed: int = 0) -> nn.Module:
    """A preset name of `megabuf.testing` ("gpt_small", ...) or "package.module:factory"."""
    if ":" not in spec:
        from megabuf.testing.models import build_model

        return build_model(spec, seed=seed)
    module_name, _, factory_name = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), factory_name, None)
    if not callable(factory):
        raise ValueError(f"megabuf: {spec!r}: {module_name} has no callable {factory_name!r}")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"megabuf: {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _dtype_key(p: nn.Parameter, cfg: DistributedDataParallelConfig) -> tuple[torch.dtype, ...]:
    return p.dtype, torch.float32 if cfg.grad_reduce_in_fp32 else p.dtype


def resolve_bucket_size(
    numels_by_buffer: Sequence[int],
    cfg: DistributedDataParallelConfig,
    dp_size: int,
    disable_bucketing: bool = False,
) -> int | None:
    """Same rule as `DistributedDataParallel`: explicit size, else one bucket without overlap,
    else the default sized by the largest buffer."""
    if disable_bucketing:
        return None
    if cfg.bucket_size is not None:
        return cfg.bucket_size
    if not cfg.overlap_grad_reduce:
        return None
    return default_bucket_size(dp_size, max(numels_by_buffer, default=0))


def _group_params(
    trainable: Sequence[tuple[str, nn.Parameter]], cfg: DistributedDataParallelConfig
) -> list[tuple[bool, tuple[torch.dtype, ...], list[tuple[str, nn.Parameter]]]]:
    """(expert?, dtype key, params) per buffer, in DistributedDataParallel's buffer order."""
    out: list[tuple[bool, tuple[torch.dtype, ...], list[tuple[str, nn.Parameter]]]] = []
    for expert in (False, True):
        by_key: dict[tuple[torch.dtype, ...], list[tuple[str, nn.Parameter]]] = {}
        for name, p in trainable:
            if is_expert_parallel(p) == expert:
                by_key.setdefault(_dtype_key(p, cfg), []).append((name, p))
        out.extend((expert, key, params) for key, params in by_key.items())
    return out


def _buffer_info(
    index: int,
    expert: bool,
    key: tuple[torch.dtype, ...],
    named: list[tuple[str, nn.Parameter]],
    cfg: DistributedDataParallelConfig,
    bucket_size: int | None,
    dp_size: int,
) -> BufferInfo:
    layout = compute_layout(
        [p.numel() for _, p in named],
        bucket_size=bucket_size,
        dp_size=dp_size,
        sharded=cfg.use_distributed_optimizer,
        high_nccl_busbw=cfg.pad_buckets_for_high_nccl_busbw,
        own_bucket=[bool(getattr(p, "shared_embedding", False)) for _, p in named],
    )
    buckets = tuple(
        BucketInfo(
            b.bucket_id,
            b.start,
            b.end,
            b.numel_unpadded,
            tuple(named[i][0] for i in b.param_ids),
            tuple(b.shard_range(r, dp_size) for r in range(dp_size)) if layout.sharded else (),
        )  # fmt: skip
        for b in layout.buckets
    )
    names = tuple(n for n, _ in named)
    return BufferInfo(index, expert, key[0], key[1], dp_size, names, layout, buckets)


def _groups(
    buffers: Sequence[BufferInfo], registration: dict[str, int], disable_bucketing: bool
) -> tuple[GroupInfo, ...]:
    """One group per bucket (dense first, then expert); dispatch order = last-registered first."""
    if disable_bucketing:  # one group for dense buffers, one for expert buffers
        expert_id = 1 if any(not b.expert for b in buffers) else 0
        return tuple(
            GroupInfo(expert_id if b.expert else 0, b.index, bucket.bucket_id, 0)
            for b in buffers
            for bucket in b.buckets
        )
    pairs = [(b, bucket) for expert in (False, True) for b in buffers if b.expert == expert
             for bucket in b.buckets]  # fmt: skip
    result: list[GroupInfo] = []
    for expert in (False, True):
        ids = [i for i, (b, _) in enumerate(pairs) if b.expert == expert]
        order = sorted(ids, key=lambda i: -max(registration[n] for n in pairs[i][1].param_names))
        position = {gid: pos for pos, gid in enumerate(order)}
        result.extend(
            GroupInfo(i, pairs[i][0].index, pairs[i][1].bucket_id, position[i]) for i in ids
        )
    return tuple(result)


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
    trainable = [(n, p) for n, p in named if p.requires_grad]
    per_buffer = _group_params(trainable, config)
    numels = [sum(p.numel() for _, p in params) for _, _, params in per_buffer]
    bucket_size = resolve_bucket_size(numels, config, dp_size, disable_bucketing)
    buffers = tuple(
        _buffer_info(i, expert, key, params, config, bucket_size,
                     dp_size // ep_size if expert else dp_size)
        for i, (expert, key, params) in enumerate(per_buffer)
    )  # fmt: skip
    registration = {n: i for i, (n, _) in enumerate(trainable)}
    groups = _groups(buffers, registration, disable_bucketing)
    numel_total = sum(p.numel() for _, p in named)
    return Inspection(model_name, config, dp_size, bucket_size, numel_total, buffers, groups)


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
    lines.append(f"bucket groups ({len(info.groups)}), in dispatch order:")
    for g in sorted(info.groups, key=lambda g: (g.dispatch_position, g.group_id)):
        lines.append(f"  {g.dispatch_position}: group {g.group_id} = buffer {g.buffer_index} "
                     f"bucket {g.bucket_id}")  # fmt: skip
    return "\n".join(lines)


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
        ],  # fmt: skip
        "groups": [g.__dict__ for g in info.groups],
    }
