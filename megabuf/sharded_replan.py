"""The bucket_size="auto" re-plan under the sharded strategies "optim" and "optim_grads".

[Note: sharded auto bucket re-plan]
Under "optim" (ZeRO-1) and "optim_grads" (ZeRO-2) every bucket is padded to a multiple of the
shard group size and each rank owns one shard of it, so new bucket boundaries move every param's
offset, the param buffer, the grad shards and the distributed optimizer's fp32 main-param shards
and their state. The buffers cannot change in place (as the unsharded path does, [Note: auto
bucket re-plan] in autobucket.py); the re-plan is a model-space round trip instead, the one a
checkpoint makes when it loads at another dp size ([Note: model-space optimizer state]):
1. Capture: the megabuf optimizer attached to the model (it registers itself here, by weak
   reference, when it is built) copies its own model-space pieces (fp32 main values and
   optimizer state per param range) to the host.
2. Rebuild: every param gather in flight is finished (the params are whole and current), the
   old groups' grad shards leave the memory ledger, and `assemble` allocates the buffers of the
   new plan: params are copied into the new param buffer, `param.data` and `main_grad` re-linked,
   grad shards allocated (zero, as every grad is at a step boundary); the engine rewires
   everything built on the bucket groups as the unsharded re-plan does.
3. Restore: the optimizer builds its main params on the new buffers' shards; every dp rank's
   pieces are broadcast in turn and each rank keeps only their overlap with the ranges it now
   steps (`exchanged_state`), then loads them, exactly (fp32 values are copied, never
   recomputed). A rank's host holds its old pieces, one rank's in transit and its new ranges'
   state: never the whole optimizer state, which at scale would not fit.
It runs where the unsharded re-plan runs (`Engine.zero_grad_buffer`), so the optimizer's
`zero_grad()` and a direct `model.zero_grad_buffer()` do the same. A model with no megabuf
optimizer (none built yet) only rebuilds; under these strategies no other optimizer can step the
model (`refuse_foreign_optimizers`). The optimizer's cpu_offload host copies are not rebuilt: it
refuses by name. "optim_grads_params" (ZeRO-3: shard units that gather and release the params)
stays refused by config.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from megabuf.bucket_group import BucketGroup
from megabuf.config import DistributedDataParallelConfig
from megabuf.sharding.grads import GRAD_SHARD
from megabuf.sharding.ledger import MemoryLedger

# the optimizer's side: called with the engine's rebuild, it captures, rebuilds, restores
AroundRebuild = Callable[[Callable[[], None]], None]


class ReplanListeners:
    """Who must follow a sharded re-plan: the megabuf optimizer stepping this model, held by
    weak reference (an optimizer dropped by the user is not kept alive by its model)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._refs: list[weakref.WeakMethod[AroundRebuild]] = []

    def add(self, around: AroundRebuild) -> None:
        self._refs.append(weakref.WeakMethod(around))  # type: ignore[arg-type]

    def run(self, rebuild: Callable[[], None]) -> None:
        """`rebuild()` inside the live listener's capture and restore ([Note: sharded auto
        bucket re-plan]); raises if two live optimizers step the same model."""
        live = [m for ref in self._refs if (m := ref()) is not None]
        self._refs = [weakref.WeakMethod(m) for m in live]  # type: ignore[arg-type]
        if len(live) > 1:
            raise RuntimeError(
                f'megabuf: bucket_size="auto" cannot re-plan a model that {len(live)} megabuf '
                f"optimizers step (rank {self.rank}): each would have to carry its state across "
                "the re-plan; keep one optimizer per model, or give an int bucket_size"
            )
        if live:
            live[0](rebuild)
        else:
            rebuild()


def release_old_groups(
    groups: list[BucketGroup],
    config: DistributedDataParallelConfig,
    ledger: MemoryLedger,
    rank: int,
) -> None:
    """Step 2's start ([Note: sharded auto bucket re-plan]): the params whole and current before
    `assemble` copies them into the new buffers, the old grad shards off the ledger."""
    if config.sharding.shards_params:
        raise RuntimeError(f"megabuf: optim_grads_params cannot re-plan buckets (rank {rank})")
    for group in groups:
        group.finish_param_sync(skip_next_bucket_dispatch=True)
        if group.sharded_grads is not None:  # released at a step boundary: only shards held
            ledger.free(GRAD_SHARD, group.sharded_grads.shard_nbytes)
