"""The scale agreement after a step: one amax all-reduce for every FP8 param together."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megabuf.fp8.shards import Fp8BufferPart
from megabuf.transport.collectives import Collectives, Group

AMAX_OP = "fp8_amax_all_reduce"  # the collectives' record name of the agreement


def agree_and_cast(parts: Sequence[Fp8BufferPart], collectives: Collectives, group: Group) -> None:
    """Every rank: its shards' amaxes, ONE all-reduce(MAX) of all of them over `group` (the
    group the buffers are sharded over), then each part's scales and cast ([Note: FP8
    params]). Collective: every rank of `group` calls it with the same parts."""
    if not parts:
        return
    with torch.profiler.record_function("megabuf::fp8_agree_and_cast"), torch.no_grad():
        amax = torch.cat([part.amaxes() for part in parts])
        collectives.all_reduce_max(amax, group, op=AMAX_OP)
        offset = 0
        for part in parts:
            part.cast(amax[offset : offset + part.numel])
            offset += part.numel


def agree_and_cast_by_kind(
    parts: Sequence[Fp8BufferPart], collectives: Collectives, shard_group: Callable[[bool], Group]
) -> None:
    """`agree_and_cast` of the dense parts over `shard_group(False)`, then of the expert parts
    over `shard_group(True)` (the expert shard group: an expert's replicas across expt_dp hold
    its shards); one all-reduce per kind present."""
    for expert in (False, True):
        mine = [part for part in parts if part.expert == expert]
        if mine:
            agree_and_cast(mine, collectives, shard_group(expert))
