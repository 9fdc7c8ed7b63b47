"""Sharded params (`optim_grads_params`, ZeRO-3): one bucket group's param storages and their
lifecycle. See [Note: sharded param lifecycle].

[Note: sharded param lifecycle]
Under optim_grads_params every bucket has two param tensors (megabuf/buckets/buffer.py allocates
them):
- `param_shard`: this dp rank's shard of the bucket (1-D, param dtype, padded numel / dp), the
  only persistent copy. The optimizer writes its updated fp32 main shard into it (rounded) and
  nothing is gathered at step time.
- `param_data`: the full bucket (1-D, param dtype, padded numel) with a storage of its own.
  Every param of the bucket is a view of it (`param.data`), made once at wrapping; while the
  group is SHARDED the storage is resized to 0 bytes, so the params keep their objects, names and
  shapes (state_dict keys, `numel()`, optimizer references) but hold no memory.
States of a group (`ShardedParams.state`), with one guard that names the group, its unit and
the rank on any other transition:

    SHARDED --start_param_gather--> GATHERING --finish_param_gather--> UNSHARDED
    UNSHARDED --release_params--> SHARDED

`start_param_gather` resizes the storage back and all-gathers the shards into it in place
(megabuf.transport.collectives' `all_gather_many`), so tensors autograd saved in forward (the
params, views of them) see the gathered values again in backward. Which unit gathers when is decided
by the unit runtime (megabuf/sharding/units_runtime.py); this module only owns the bytes.
With `verify_param_access` the storage is never resized: a release fills it with NaN, so a stray
read outside the unit's forward/backward gives NaN instead of stale values (and
`check_for_nan_in_grad` names the bucket).
Every refill and release is recorded in the engine's `MemoryLedger`: "param_shard" (persistent,
at construction) and "unsharded_params" (transient).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.sharding.ledger import MemoryLedger
from megabuf.transport.collectives import Collectives, PendingCollective

PARAM_SHARD = "param_shard"
UNSHARDED_PARAMS = "unsharded_params"
POISONED_PARAMS = "verify_param_access"


class ParamShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


@dataclass
class GatherWork:
    """The in-flight all-gather of one group: its collectives and the full tensors they fill."""

    pending: Sequence[PendingCollective]
    full: Sequence[Tensor]

    def wait(self) -> None:
        for work in self.pending:
            work.wait()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class ShardedParams:
    """The full param tensors and persistent shards of one bucket group; see [Note: sharded
    param lifecycle]. Built UNSHARDED (the wrapped values, before the initial broadcast);
    `release_params(writeback=True)` then fills the shards."""

    def __init__(
        self,
        full: Sequence[Tensor],
        shards: Sequence[Tensor],
        collectives: Collectives,
        group: ProcessGroup | None,
        ledger: MemoryLedger,
        *,
        group_id: int,
        unit_name: str,
        rank: int,
        dp_rank: int,
        dp_size: int,
        poison: bool = False,
    ) -> None:
        self.full = list(full)  # 1-D, param dtype, padded bucket numel; own storage each
        self.shards = list(shards)  # 1-D, param dtype, padded bucket numel / dp_size
        self.collectives = collectives
        self.group = group
        self.ledger = ledger
        self.group_id = group_id
        self.unit_name = unit_name  # for messages ("" is the root unit)
        self.rank = rank
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.poison = poison  # verify_param_access
        self.full_nbytes = sum(_nbytes(t) for t in self.full)
        self._storage_nbytes = [t.untyped_storage().nbytes() for t in self.full]
        self.state = ParamShardState.UNSHARDED
        self._work: GatherWork | None = None
        self.gathers = 0  # all-gathers started (tests and reports)
        ledger.alloc(PARAM_SHARD, sum(_nbytes(s) for s in self.shards))
        ledger.alloc(POISONED_PARAMS if poison else UNSHARDED_PARAMS, self.full_nbytes)

    # ---- guard --------------------------------------------------------------------------------
    def _expect(self, *states: ParamShardState) -> None:
        if self.state not in states:
            wanted = " or ".join(s.name for s in states)
            unit = repr(self.unit_name) if self.unit_name else "the root unit"
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} (shard unit {unit}) params are "
                f"{self.state.name}, expected {wanted} (rank {self.rank}); params are gathered "
                "and released by the unit's forward/backward hooks: read them outside forward "
                "inside model.summon_full_params()"
            )

    # ---- transitions ----------------------------------------------------------------------------
    def start_param_gather(self, *, async_op: bool = True) -> None:
        """Refill the full storages and all-gather every rank's shard into them. Collective:
        every dp rank starts the same groups' gathers in the same order."""
        self._expect(ParamShardState.SHARDED)
        if not self.poison:
            for tensor, nbytes in zip(self.full, self._storage_nbytes, strict=True):
                tensor.untyped_storage().resize_(nbytes)
            self.ledger.alloc(UNSHARDED_PARAMS, self.full_nbytes)
        with torch.profiler.record_function("megabuf::param_gather"):
            pending = self.collectives.all_gather_many(
                self.full, self.shards, self.group, async_op=async_op, tag=self.group_id
            )
        self._work = GatherWork(pending, self.full)
        self.state = ParamShardState.GATHERING
        self.gathers += 1

    def finish_param_gather(self) -> None:
        """Wait for the gather; the params are then readable."""
        self._expect(ParamShardState.GATHERING)
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.state = ParamShardState.UNSHARDED

    def release_params(self, *, writeback: bool = False) -> None:
        """Drop the full params (storage resized to 0, or NaN-filled with verify_param_access).
        `writeback`: first copy this rank's slice of the full params into the shard (after the
        full params were written: the initial broadcast, `load_state_dict`)."""
        self._expect(ParamShardState.UNSHARDED)
        if writeback:
            with torch.no_grad():
                for tensor, shard in zip(self.full, self.shards, strict=True):
                    shard.copy_(self.local_slice(tensor))
        if self.poison:
            for tensor in self.full:
                tensor.fill_(float("nan"))
        else:
            for tensor in self.full:
                tensor.untyped_storage().resize_(0)
            self.ledger.free(UNSHARDED_PARAMS, self.full_nbytes)
        self.state = ParamShardState.SHARDED

    def retire(self) -> None:
        """A bucket re-plan replaced this group after copying its gathered params into the new
        buffers ([Note: sharded auto bucket re-plan] in megabuf/replan/sharded_replan.py): the full
        params and the shard leave the ledger and give their memory back. Nothing may read
        them afterwards."""
        self._expect(ParamShardState.UNSHARDED)
        self.ledger.free(POISONED_PARAMS if self.poison else UNSHARDED_PARAMS, self.full_nbytes)
        self.ledger.free(PARAM_SHARD, sum(_nbytes(s) for s in self.shards))
        for tensor in [*self.full, *self.shards]:
            tensor.untyped_storage().resize_(0)
        self.state = ParamShardState.SHARDED

    # ---- conveniences used by the runtime -------------------------------------------------------
    def ensure_gathered(self) -> None:
        """Gather if sharded, wait if gathering: the params are readable afterwards."""
        if self.state is ParamShardState.SHARDED:
            self.start_param_gather()
        if self.state is ParamShardState.GATHERING:
            self.finish_param_gather()

    def ensure_released(self) -> None:
        """Finish a gather in flight, then release; nothing to do when sharded. Not collective."""
        if self.state is ParamShardState.GATHERING:
            self.finish_param_gather()
        if self.state is ParamShardState.UNSHARDED:
            self.release_params()

    def local_slice(self, tensor: Tensor) -> Tensor:
        numel = tensor.numel() // self.dp_size
        return tensor[self.dp_rank * numel : (self.dp_rank + 1) * numel]

    @property
    def holds_full(self) -> bool:
        """The full storages hold memory now (always, with verify_param_access)."""
        return all(t.untyped_storage().nbytes() > 0 for t in self.full)
