"""`FullGrads`: the grad storage of a bucket group whose grads are not sharded, beside
`ShardedGrads` (megabuf/sharding/grads.py); see [Note: grad storage] there."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from megabuf.sharding.grads import ShardedGrads


class FullGrads:
    """The grad storage of a bucket group whose grads are not sharded: the buckets'
    `grad_data`, held for the model's life ([Note: grad storage]). Every transition of
    `ShardedGrads` is here a no-op; the reduce-scatter's all-to-all landing zone is kept by each
    bucket (`bucket.scratch`, made at the first reduction that needs it)."""

    releases = False
    released = False  # never: the group's first grad needs no refill
    shard_nbytes = 0

    def __init__(self, buckets: Sequence[Any], dp_rank: int, dp_size: int) -> None:
        self.buckets = list(buckets)  # _ParamAndGradBucket: grad_data, scratch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.scratch: list[Tensor] = []  # no landing zone released with the buckets

    def acquire(self) -> None:
        pass

    @contextmanager
    def materialized(self) -> Iterator[None]:
        yield

    def start(self, needs_scratch: bool) -> list[Tensor | None]:
        """The reduction is being issued: each bucket's landing zone (made when first needed)."""
        for bucket in self.buckets:
            if bucket.scratch is None and needs_scratch:
                bucket.scratch = torch.empty_like(bucket.grad_data)
        return [b.scratch for b in self.buckets]

    def finish(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def zero(self) -> None:
        pass

    def guard_main_grads(self, params: Sequence[Any], names: Sequence[str]) -> None:
        pass

    def reduced_shards(self) -> list[Tensor]:
        """This rank's reduced shard of each bucket: its local shard of `grad_data`."""
        shards = []
        for bucket in self.buckets:
            numel = bucket.grad_data.numel() // self.dp_size
            shards.append(bucket.grad_data[self.dp_rank * numel : (self.dp_rank + 1) * numel])
        return shards


GradStorage = FullGrads | ShardedGrads
