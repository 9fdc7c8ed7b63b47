"""Checks that every data-parallel rank holds the same model; the param markers megabuf reads
(expert-parallel, shared embedding) and the planner's `ParamSpec`s built from them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from megabuf.collectives import Collectives
from megabuf.plan import ParamSpec


def is_expert_parallel(param: nn.Parameter) -> bool:
    """Megatron's marker: `param.allreduce is False` means the param belongs to one expert-
    parallel rank and is reduced over the expert data-parallel group only."""
    return getattr(param, "allreduce", True) is False


def mark_expert_parallel(params: Iterable[nn.Parameter]) -> None:
    """Mark params (e.g. `expert.parameters()`) as expert-parallel; call before wrapping."""
    for param in params:
        param.allreduce = False  # type: ignore[attr-defined]


def param_specs(trainable: Sequence[tuple[str, nn.Parameter]]) -> tuple[ParamSpec, ...]:
    """The planner's view of trainable params (registration order): numel, dtype, and the two
    markers megabuf reads, `allreduce is False` (expert) and `shared_embedding` (own bucket)."""
    return tuple(
        ParamSpec(
            name,
            p.numel(),
            p.dtype,
            expert=is_expert_parallel(p),
            own_bucket=bool(getattr(p, "shared_embedding", False)),
        )
        for name, p in trainable
    )


def check_devices(named: Sequence[tuple[str, nn.Parameter]]) -> None:
    """All params of a rank must live on one device (each buffer is a single tensor)."""
    if not named:
        return
    first_name, first = named[0]
    for name, param in named:
        if param.device != first.device:
            raise ValueError(
                f"megabuf: params are on different devices: {first_name!r} on {first.device}, "
                f"{name!r} on {param.device}; move the whole module to one device before "
                "wrapping it in DistributedDataParallel"
            )


def _signature(named: Sequence[tuple[str, nn.Parameter]]) -> list[tuple]:
    return [
        (name, tuple(p.shape), str(p.dtype), bool(p.requires_grad), is_expert_parallel(p))
        for name, p in named
    ]


def check_replicas_match(
    named: Sequence[tuple[str, nn.Parameter]], group: ProcessGroup, collectives: Collectives
) -> None:
    """Raise on every rank, naming the first difference, if the dp ranks' models differ."""
    mine = _signature(named)
    everyone = collectives.all_gather_object(mine, group)
    reference = everyone[0]
    for group_rank, theirs in enumerate(everyone[1:], start=1):
        problem = first_difference(reference, theirs)
        if problem is not None:
            global_rank = dist.get_global_rank(group, group_rank) if group else group_rank
            raise ValueError(
                f"megabuf: data-parallel ranks hold different models (seen on rank "
                f"{dist.get_rank()}): rank {global_rank} differs from dp rank 0: {problem}. "
                "Build the same model on every rank before wrapping it"
            )


def first_difference(reference: list[tuple], theirs: list[tuple]) -> str | None:
    """Pure: describe the first entry where two signatures differ, or None if equal."""
    for i, (a, b) in enumerate(zip(reference, theirs)):
        if a != b:
            return f"param #{i}: {_describe(a)} vs {_describe(b)}"
    if len(reference) != len(theirs):
        longer = reference if len(reference) > len(theirs) else theirs
        extra = longer[min(len(reference), len(theirs))][0]
        return f"{len(reference)} params vs {len(theirs)} (first unmatched: {extra!r})"
    return None


def _describe(entry: tuple) -> str:
    name, shape, dtype, trainable, expert = entry
    return f"{name!r} shape {shape} {dtype} trainable={trainable} expert={expert}"
