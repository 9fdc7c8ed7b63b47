"""Communication hooks on the second level of a hybrid reduction: which hooks may run there, and
the `GradBucket` views they run on.

[Note: comm hooks under hybrid]
Under a hybrid split ([Note: two-level reduction] in megabuf/sharding/replicate.py) a registered
hook reduces on both levels, with the same contract ([Note: comm hook contract]) at each:
  1. first level, exactly as flat: the bucket's `GradBucket` over its full grads, `group` the
     shard group (group_size S), reduce-scatter mode; the engine pre-scales `data` first;
  2. second level: a `GradBucket` over this rank's reduced shard of the bucket (`data` = the
     shard: the bucket's local shard of `grad_data` under "optim", its persistent `grad_shard`
     under "optim_grads*"), all-reduce mode, `group` the replicate group (group_size R,
     group_rank the replicate rank), `gradient_scaling_factor` 1 and no pre-scale (the first
     level's already scaled the grads), `average` as configured (the first level divided by
     S, this one by R), no params (`gradients()` is empty), the same `index` as the bucket.
     Built once at registration; `setup` sees only the first-level views.
The second level runs once per bucket per step, where the engine's own all-reduce of the shard
would run: when the group's first level has landed for the step's last micro-batch, in
dispatch-chain order. A hook's first level never reports completion to the chain (its work is
a `HookWork`: `first_level_completed` is False), so the chain's `progress_replicas` does not
issue a hooked group's second level during backward; it is issued when the group is finished
(its own `finish_grad_sync`, which the grad sync calls in chain order, or the chain's `finish`
of a later group, which first issues the owed ones before it in chain order), and the group's
own finish would wait for it right after. So the engine runs
every stage of the second-level hook when it is issued, buckets in order (each bucket's stage
one, then each one's later stages, every wait bounded: [Note: bounded hook wait]). That gives
up (almost) no overlap, and no stage of one group's second level can come after a later
group's collective on the replicate group, on any rank, whatever the timing (a stage left for
the group's finish could: a later group may be finished first).
A hook runs on the second level only if it declares `two_level = True`: it must keep no state
per bucket across calls (the two levels' views share an `index` but not a shape) and reduce
correctly in all-reduce mode on a view without params. `Reduce`, `Compress`, `Quantize` and
`Deterministic` do; PowerSGD and BatchedPowerSGD (error feedback and Q factors per bucket) and
`CompressWrapper` (copies keyed by bucket index) do not, and registering one under hybrid raises
`CommHookHybridError` naming the hook and why (`Noop` does not declare it either). LocalSGD and
torch hooks support all-reduce mode only, which no hybrid strategy's first level is: they raise
`CommHookModeError` as under any distributed optimizer. So the deterministic mode's sum is defined
hierarchically under hybrid: [Note: deterministic reduction under hybrid] in
megabuf/comm_hooks/fixed_order.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.comm_hooks.contract import (
    CommHookHybridError,
    GradBucket,
    HookTally,
    check_modes,
    hook_name,
)
from megabuf.transport.collectives import Collectives


def check_two_level(hook: object, *, group_id: int, rank: int) -> None:
    """Raise `CommHookHybridError` unless `hook` declares `two_level = True` and all-reduce
    mode (the second level's)."""
    if getattr(hook, "two_level", False) is not True:
        why = getattr(hook, "two_level_note", None)
        raise CommHookHybridError(
            f"megabuf: comm hook {hook_name(hook)} cannot run under hybrid sharding (bucket "
            f"group {group_id}, rank {rank}): a hybrid reduction runs the hook on both levels, "
            "inside the shard group and then across the replicate group on the reduced shard "
            "([Note: comm hooks under hybrid]), and it does not declare `two_level = True`"
            + (f" ({why})" if why else "")
            + ". Hooks that do: Reduce, Compress, Quantize, Deterministic (and "
            "deterministic_reduction); use flat process groups for this hook"
        )
    check_modes(hook, "all_reduce", f"the second level of a hybrid reduction (rank {rank})")


def replica_views(
    first_level: Sequence[GradBucket],
    shards: Sequence[Tensor],
    group: ProcessGroup,
    collectives: Collectives,
) -> list[GradBucket]:
    """The second-level view of each bucket: over `shards[i]`, this rank's reduced shard of
    bucket `first_level[i]`, in all-reduce mode over the replicate `group`."""
    if len(shards) != len(first_level):
        raise ValueError(
            f"megabuf: {len(first_level)} hooked buckets but {len(shards)} reduced shards"
        )
    size, group_rank = collectives.size(group), collectives.rank(group)
    fields: dict[str, Any] = {
        "mode": "all_reduce", "shard": None, "params": (), "param_names": (), "_grads": (),
        "group": group, "group_size": size, "group_rank": group_rank,
        "gradient_scaling_factor": 1.0,
    }  # fmt: skip
    return [
        dataclasses.replace(bucket, data=shard, _workspace={}, tally=HookTally(), **fields)
        for bucket, shard in zip(first_level, shards, strict=True)
    ]
