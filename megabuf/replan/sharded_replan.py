"""The bucket_size="auto" re-plan under the sharded strategies.

[Note: sharded auto bucket re-plan]
Under "optim" (ZeRO-1), "optim_grads" (ZeRO-2) and "optim_grads_params" (ZeRO-3) every bucket
is padded to a multiple of the shard group size and each rank owns one shard of it, so new
bucket boundaries move every param's offset, the param buffer (ZeRO-3: the per-bucket full
params and the param shards), the grad shards and the distributed optimizer's fp32 main-param
shards and their state. The buffers cannot change in place (as the unsharded path does, [Note:
auto bucket re-plan] in autobucket.py); the re-plan is a model-space round trip instead, the one
a checkpoint makes when it loads at another dp size ([Note: model-space optimizer state]):
1. Capture: the megabuf optimizer attached to the model (it registers itself here, by weak
   reference, when it is built) copies its own model-space pieces (fp32 main values and
   optimizer state per param range) to the host.
2. Rebuild: the params are made whole and current by the engine's param side
   (`whole_for_replan`): every param gather in flight is finished; under ZeRO-3, where only the
   shards persist between forwards, every shard unit is gathered (collective) and its hooks are
   removed. The old groups' grad shards leave the memory ledger, and `assemble` allocates the
   buffers of the new plan: params are copied into the new param storage, `param.data` and
   `main_grad` re-linked, grad shards allocated (zero, as every grad is at a step boundary);
   the engine rewires everything built on the bucket groups as the unsharded re-plan does.
   Under ZeRO-3 the old groups' gathered params and param shards are then retired (off the
   ledger, storage resized to 0: `ShardedParams.retire`), and the shard units are built again
   on the new groups exactly as at construction (`ParamUnits.build`: the new shards filled from
   the whole params, these released, the unit hooks installed, peaks reset), so the ledger then
   holds what a model built on the new plan holds. The transient peak is the whole model's
   params twice (the old gathered and the new full storages) plus both sets of shards.
   Under every sharded strategy the new buffers exist beside the old ones for a moment (under
   ZeRO-3 with the whole params twice), which a model sharded because it barely fits cannot
   afford: before anything changes the engine asks each dp rank's free device memory (CUDA;
   unknown on the host) and, if any rank is short (agreed by MAX, so no rank goes on into the
   collectives alone), keeps the plan that ran and warns (`replan_shortfall`). Moving the
   param shards by the same range exchange as the optimizer state (step 3) would need no whole
   params; not built yet.
3. Restore: the optimizer builds its main params on the new buffers' shards; every dp rank's
   pieces are broadcast in turn and each rank keeps only their overlap with the ranges it now
   steps (`exchanged_state`), then loads them, exactly (fp32 values are copied, never
   recomputed). A rank's host holds its old pieces, one rank's in transit and its new ranges'
   state: never the whole optimizer state, which at scale would not fit. Under ZeRO-3 the new
   shards already hold the rounded values of those main params, copied through the gather.
It runs where the unsharded re-plan runs (`Engine.zero_grad_buffer`), so the optimizer's
`zero_grad()` and a direct `model.zero_grad_buffer()` do the same. A model with no megabuf
optimizer (none built yet) only rebuilds; under these strategies no other optimizer can step the
model (`refuse_foreign_optimizers`). The optimizer's cpu_offload host copies are not rebuilt: it
refuses by name, before anything changes, and the model goes on training on its old plan.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from megabuf.buckets.bucket_group import BucketGroup
from megabuf.buckets.buffer import _ParamAndGradBuffer
from megabuf.sharding.grads import GRAD_SHARD
from megabuf.sharding.ledger import MemoryLedger
from megabuf.sharding.params import ParamShardState
from megabuf.sync.param_sync import GatheredParams
from megabuf.transport.collectives import Collectives, Group

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
    groups: list[BucketGroup], param_side: GatheredParams, ledger: MemoryLedger, rank: int
) -> list[tuple[str, nn.Module]]:
    """Step 2's start ([Note: sharded auto bucket re-plan]): the params whole and current before
    `assemble` copies them into the new buffers (ZeRO-3: every unit gathered, its hooks gone),
    the old grad shards off the ledger. Returns the shard units to build again (ZeRO-3; else
    none). Collective under optim_grads_params."""
    units = param_side.whole_for_replan()
    for group in groups:  # a released param has no storage: copying it would read freed memory
        params = group.sharded_params
        if params is not None and params.state is not ParamShardState.UNSHARDED:
            raise RuntimeError(
                f"megabuf: bucket group {group.group_id}'s params are {params.state.name} at the "
                f'bucket_size="auto" re-plan (rank {rank}), not gathered: a megabuf bug; give an '
                "int bucket_size meanwhile"
            )
        if group.grads.shard_nbytes:  # released at a step boundary: only the shards held
            ledger.free(GRAD_SHARD, group.grads.shard_nbytes)
    return units


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory on `device` (CUDA); None where megabuf does not know it (host memory)."""
    return int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None


def replan_shortfall(
    buffers: list[_ParamAndGradBuffer],
    groups: list[BucketGroup],
    device: torch.device,
    collectives: Collectives,
    group: Group,
) -> int:
    """Bytes a sharded re-plan needs at once beyond what is free, on the dp rank worst off
    (agreed by MAX over `group`, so every rank decides alike; 0 where it fits or the memory is
    not known; [Note: sharded auto bucket re-plan]): the new buffers while the old ones still
    exist (as much as the param and grad storages and grad shards held now), and under ZeRO-3
    the whole params twice (the old ones gathered, the new full storages) and the new param
    shards. Collective over `group`."""
    storages = [t for b in buffers for t in (b.param_data, b.grad_storage) if t is not None]
    need = sum(t.untyped_storage().nbytes() for t in storages)
    for g in groups:
        need += g.grads.shard_nbytes  # 0 for a full grad storage
        if g.sharded_params is not None:
            shards = sum(s.numel() * s.element_size() for s in g.sharded_params.shards)
            need += 2 * g.sharded_params.full_nbytes + shards
    free = free_device_bytes(device)
    short = torch.tensor([0.0 if free is None else float(max(0, need - free))], device=device)
    collectives.all_reduce_max(short, group)
    return int(short.item())


def retire_old_params(groups: list[BucketGroup]) -> None:
    """After `assemble` copied the params out: the old groups' gathered params and param shards
    (ZeRO-3) leave the ledger and their memory."""
    for group in groups:
        if group.sharded_params is not None:
            group.sharded_params.retire()
