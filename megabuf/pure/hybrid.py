"""The replicate x shard split of the data-parallel group (hybrid sharding), as pure layout.

[Note: hybrid rank order]
A hybrid run splits each dense dp group (dp_size = R * S ranks, [Note: rank order] in
process_groups.py) into R replicas of an S-way shard, with the shard rank varying fastest:

    dp_rank = replicate_rank * S + shard_rank

so a shard group holds S consecutive dp ranks (with pp_size 1 and S = torchrun's
LOCAL_WORLD_SIZE: the ranks of one node, which share the fast links) and a replicate group
holds the R dp ranks with the same shard rank (stride S: one per node). Example, dp 4 as
R 2 x S 2: shard groups [0,1] [2,3], replicate groups [0,2] [1,3].
Grads are reduce-scattered inside the shard group (a bucket's shard is 1/S of it), then each
shard is all-reduced across the replicate group; params are gathered inside the shard group
only, and the optimizer state is sharded S = dp/R ways. R = 1 is the flat strategy (no
replicate group at all); S = 1 keeps whole buckets and all-reduces them over dp.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HybridSplit:
    """dp = replicate_size x shard_size ([Note: hybrid rank order])."""

    replicate_size: int  # R: Megatron's num_distributed_optimizer_instances
    shard_size: int  # S: the ranks one bucket's optimizer state is sharded over

    @property
    def dp_size(self) -> int:
        return self.replicate_size * self.shard_size

    @property
    def is_flat(self) -> bool:
        return self.replicate_size == 1


def split_for(dp_size: int, *, shard_size: int | None = None, replicas: int | None = None,
              what: str = "dp_shard_size") -> HybridSplit:  # fmt: skip
    """The split of `dp_size` ranks given either the shard size or the number of replicas
    (Megatron's num_distributed_optimizer_instances); raises naming `what` when it does not
    divide dp."""
    if (shard_size is None) == (replicas is None):
        raise ValueError("megabuf: give exactly one of shard_size and replicas for a hybrid split")
    given = shard_size if shard_size is not None else replicas
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ValueError(f"megabuf: {what}={given!r} must be an int >= 1")
    if dp_size % given != 0:
        raise ValueError(
            f"megabuf: {what}={given} does not divide the data-parallel size {dp_size}: a "
            "hybrid split needs dp = replicas x shard size ([Note: hybrid rank order]); pick a "
            f"divisor of {dp_size}"
        )
    other = dp_size // given
    if shard_size is not None:
        return HybridSplit(replicate_size=other, shard_size=shard_size)
    return HybridSplit(replicate_size=given, shard_size=other)


def node_shard_size(env: Mapping[str, str] | None = None) -> int:
    """The default shard size: the ranks of one node, torchrun's LOCAL_WORLD_SIZE."""
    env = os.environ if env is None else env
    value = env.get("LOCAL_WORLD_SIZE")
    if value is None or not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"megabuf: dp_shard_size='node' reads torchrun's LOCAL_WORLD_SIZE, which is "
            f"{value!r}; run under torchrun or give dp_shard_size as an int"
        )
    return int(value)


def hybrid_layout(
    dp_groups: Sequence[Sequence[int]], split: HybridSplit
) -> dict[str, list[list[int]]]:
    """Pure: the global ranks of every shard and every replicate group of the dp groups
    `dp_groups` (each in dp-rank order); see [Note: hybrid rank order]."""
    s, r = split.shard_size, split.replicate_size
    shard, replicate = [], []
    for ranks in dp_groups:
        if len(ranks) != split.dp_size:
            raise ValueError(
                f"megabuf: a dp group of {len(ranks)} ranks cannot split as {r} replicas x "
                f"{s} shards"
            )
        shard += [list(ranks[i * s : (i + 1) * s]) for i in range(r)]
        replicate += [list(ranks[j::s]) for j in range(s)]
    return {"dp_shard": shard, "dp_replicate": replicate}


def place(dp_rank: int, split: HybridSplit) -> tuple[int, int]:
    """(replicate_rank, shard_rank) of `dp_rank`."""
    return divmod(dp_rank, split.shard_size)


def planned_split(
    dp_size: int, *, shard_size: int | None, replicas: int, ep_size: int, strategy: str | None
) -> HybridSplit | None:
    """The split `megabuf inspect` plans at (None: flat): from `shard_size`, else from Megatron's
    `replicas`; `strategy` is the sharding strategy's name when it shards the optimizer."""
    if shard_size is None and replicas == 1:
        return None
    if ep_size > 1:
        raise ValueError("megabuf: hybrid sharding with ep_size > 1 is not supported")
    if shard_size is not None:
        split = split_for(dp_size, shard_size=shard_size, what="dp_shard_size")
    else:
        split = split_for(dp_size, replicas=replicas, what="num_distributed_optimizer_instances")
    if not split.is_flat and strategy is None:
        raise ValueError("megabuf: a hybrid split needs a strategy that shards the optimizer")
    return None if split.is_flat else split


def describe_split(split: HybridSplit | None) -> str:
    """One line's tail for `megabuf inspect`: both groups and what crosses each."""
    if split is None:
        return ""
    r, s = split.replicate_size, split.shard_size
    return (
        f" as {r} replicas x {s}-way shard (hybrid): dp_shard groups of {s} ranks "
        f"(reduce-scatter, param gathers, optimizer state / {s}), dp_replicate groups of {r} "
        "ranks (all-reduce of each reduced shard, once per step); buffers below are laid out "
        f"at dp {s}"
    )
