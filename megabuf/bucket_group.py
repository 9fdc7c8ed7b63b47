"""`BucketGroup`: buckets whose collectives are issued together, and its two lifecycles.

Grad lifecycle (per iteration):  IDLE --start_grad_sync--> DISPATCHED --finish_grad_sync--> SYNCED
                                 SYNCED/IDLE --reset--> IDLE
Param lifecycle (distributed optimizer only):
                                 VALID --mark_params_stale--> STALE --start_param_sync-->
                                 DISPATCHED --finish_param_sync--> VALID

[Note: dispatch order]
Collectives on one process group must be issued in the same order on every rank, or gloo/NCCL
pair up the wrong buffers. Readiness order comes from autograd and can differ between ranks (or
between buffers of different dtypes), so groups are dispatched strictly in the order of their
`DispatchChain`: a group that becomes ready early waits until every group before it has been
dispatched. The chain is ordered by expected backward order, so in practice nothing waits.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megabuf.buffer import _ParamAndGradBucket, _ParamAndGradBuffer
from megabuf.collectives import Collectives, PendingCollective
from megabuf.config import DistributedDataParallelConfig


class GradSyncState(enum.Enum):
    IDLE = "idle"
    DISPATCHED = "dispatched"
    SYNCED = "synced"


class ParamSyncState(enum.Enum):
    VALID = "valid"
    STALE = "stale"
    DISPATCHED = "dispatched"


@dataclass
class SyncWork:
    """In-flight collectives of one group (one per bucket) and when they were dispatched."""

    pending: list[PendingCollective]
    dispatched_at: float


@dataclass
class Timeline:
    """Optional event recorder for the overlap report: (group_id, event, perf_counter time)."""

    events: list[tuple[int, str, float]] = field(default_factory=list)

    def record(self, group_id: int, event: str) -> None:
        self.events.append((group_id, event, time.perf_counter()))


class DispatchChain:
    """Dispatches bucket groups strictly in order; see [Note: dispatch order]."""

    def __init__(self, groups: Sequence[BucketGroup]) -> None:
        self.groups = list(groups)
        self.next_index = 0
        for group in self.groups:
            group.chain = self

    def on_ready(self) -> None:
        while self.next_index < len(self.groups) and self.groups[self.next_index].all_ready:
            self.groups[self.next_index].start_grad_sync()
            self.next_index += 1

    def reset(self) -> None:
        self.next_index = 0


class BucketGroup:
    """Buckets (possibly of several buffers) reduced together over one group."""

    def __init__(
        self,
        buckets: Sequence[_ParamAndGradBucket],
        ddp_config: DistributedDataParallelConfig,
        collective_group: ProcessGroup,
        collectives: Collectives,
        *,
        group_id: int = 0,
    ) -> None:
        self.buckets = list(buckets)
        self.ddp_config = ddp_config
        self.collective_group = collective_group
        self.collective_group_size = dist.get_world_size(collective_group)
        self.dp_rank = dist.get_rank(collective_group)
        self.collectives = collectives
        self.group_id = group_id
        self.params_list = [p for b in self.buckets for p in b.params_list]
        self.params = set(self.params_list)
        self._index = {p: i for i, p in enumerate(self.params_list)}
        self.param_to_name: dict[torch.nn.Parameter, str] = {}
        self.next_param_gather_bucket_group: BucketGroup | None = None
        self.chain: DispatchChain | None = None
        self.timeline: Timeline | None = None
        self.grad_state = GradSyncState.IDLE
        self.param_state = ParamSyncState.VALID
        self._grad_work: SyncWork | None = None
        self._param_work: SyncWork | None = None
        self.reset()

    # ---- lifecycle guards -------------------------------------------------------------------
    def _expect(self, *states: GradSyncState) -> None:
        if self.grad_state not in states:
            wanted = " or ".join(s.name for s in states)
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} grad sync is {self.grad_state.name}, "
                f"expected {wanted} (rank {dist.get_rank()}); did you call zero_grad_buffer() "
                "between iterations and finish_grad_sync() after backward?"
            )

    def reset(self) -> None:
        """Forget readiness and any finished sync; ready for the next iteration."""
        if self.grad_state is GradSyncState.DISPATCHED:
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} was reset while its grad reduction is "
                f"in flight (rank {dist.get_rank()}); call finish_grad_sync() first"
            )
        self._clear_readiness()
        self.is_last_microbatch = True
        # 1 = main_grad holds stale values (see [Note: grad accumulation into main_grad])
        self.fresh = bytearray(b"\x01" * len(self.params_list))

    def index_of(self, param: torch.nn.Parameter) -> int:
        """Position of `param` in `params_list` (identity, not tensor equality)."""
        return self._index[param]

    def zero_unwritten_grads(self) -> None:
        """Zero the main_grad of params that got no grad since zero_grad_buffer()."""
        i = self.fresh.find(1)
        while i != -1:
            self.params_list[i].main_grad.zero_()  # type: ignore[attr-defined]
            self.fresh[i] = 0
            i = self.fresh.find(1, i + 1)

    def _clear_readiness(self) -> None:
        self._ready = bytearray(len(self.params_list))
        self._num_ready = 0
        self.grad_state = GradSyncState.IDLE

    # ---- grad sync ----------------------------------------------------------------------------
    @property
    def all_ready(self) -> bool:
        return self._num_ready == len(self.params_list)

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Mark `param`'s grad as complete for this iteration."""
        self.register_grad_ready_at(self._index[param], param)

    def register_grad_ready_at(self, i: int, param: torch.nn.Parameter) -> None:
        """The backward hook's entry (it knows `i`, the param's position in `params_list`).
        O(1), allocation-free in steady state."""
        if self.grad_state is not GradSyncState.IDLE:
            self._on_grad_outside_idle(param)
        if not self.ddp_config.overlap_grad_reduce or not self.is_last_microbatch:
            return  # synchronous reduction, or inside no_sync(): accumulate only
        if not self._ready[i]:
            self._ready[i] = 1
            self._num_ready += 1
            if self._num_ready == len(self.params_list):
                if self.timeline is not None:
                    self.timeline.record(self.group_id, "ready")
                if self.chain is not None:
                    self.chain.on_ready()
                else:
                    self.start_grad_sync()

    def _on_grad_outside_idle(self, param: torch.nn.Parameter) -> None:
        if self.grad_state is GradSyncState.DISPATCHED:
            raise RuntimeError(
                f"megabuf: {self._name(param)} produced a gradient after bucket group "
                f"{self.group_id} was dispatched (rank {dist.get_rank()}); a second backward "
                "in one iteration needs no_sync() around all but the last one"
            )
        # SYNCED: a new backward without zero_grad_buffer(): accumulate on top, as torch does.
        if self.ddp_config.use_distributed_optimizer:
            raise RuntimeError(
                f"megabuf: backward after finish_grad_sync() without zero_grad_buffer() (rank "
                f"{dist.get_rank()}, {self._name(param)}); with use_distributed_optimizer only "
                "this rank's shard of the buffer is reduced, so grads cannot be accumulated "
                "across syncs. Use no_sync() for gradient accumulation"
            )
        groups = self.chain.groups if self.chain is not None else [self]
        if any(g.reduction_gain != 1.0 for g in groups):
            raise RuntimeError(
                f"megabuf: backward after finish_grad_sync() without zero_grad_buffer() (rank "
                f"{dist.get_rank()}, {self._name(param)}): this bucket group's reduction does not "
                "map already-reduced grads to themselves (expert-parallel params are scaled by "
                "1/dp_size but summed over expt_dp only), so accumulating across syncs would be "
                "wrong. Use no_sync() for gradient accumulation"
            )
        for group in groups:
            if group.grad_state is GradSyncState.SYNCED:
                group._clear_readiness()
        if self.chain is not None:
            self.chain.reset()

    @property
    def reduction_gain(self) -> float:
        """What one reduction multiplies grads that are equal on every rank by: dense buckets 1
        (1/dp summed over dp); expert buckets 1/ep_size (1/dp summed over expt_dp only)."""
        bucket = self.buckets[0]
        gain = bucket.gradient_scaling_factor
        if not self.ddp_config.average_in_collective:
            gain *= self.collective_group_size
        return gain

    def start_grad_sync(self) -> None:
        """Dispatch every bucket's reduction (async when overlapping), scaled by the bucket's
        gradient_scaling_factor: before an all-reduce, after a reduce-scatter (shard only)."""
        self._expect(GradSyncState.IDLE)
        self.zero_unwritten_grads()
        if self.ddp_config.check_for_nan_in_grad:
            self.check_grads_finite()
        async_op = self.ddp_config.overlap_grad_reduce
        average = self.ddp_config.average_in_collective
        pending = []
        for bucket in self.buckets:
            if self.ddp_config.use_distributed_optimizer:
                # Scale after the reduce-scatter: only the shard, 1/dp of the elements.
                shard = self._local_shard(bucket, bucket.grad_data)
                if bucket.scratch is None and self._needs_scratch():
                    bucket.scratch = torch.empty_like(bucket.grad_data)
                work = self.collectives.reduce_scatter(
                    shard, bucket.grad_data, self.collective_group,
                    average=average, async_op=async_op, scratch=bucket.scratch,
                    scale=bucket.gradient_scaling_factor,
                )  # fmt: skip
            else:
                # Pre-scale as torch DDP does, so results match it bit for bit.
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data.mul_(bucket.gradient_scaling_factor)
                work = self.collectives.all_reduce(
                    bucket.grad_data, self.collective_group, average=average, async_op=async_op
                )
            pending.append(work)
        self._grad_work = SyncWork(pending, time.perf_counter())
        self.grad_state = GradSyncState.DISPATCHED
        if self.timeline is not None:
            self.timeline.record(self.group_id, "dispatch")

    def finish_grad_sync(self) -> None:
        """Wait for the reduction; without overlap, dispatch it first (synchronously)."""
        if self.grad_state is GradSyncState.SYNCED:
            return
        if self.grad_state is GradSyncState.IDLE:
            if self.ddp_config.overlap_grad_reduce:
                raise_missing_grads([self])
            self.start_grad_sync()
        work = self._grad_work
        if work is None:
            raise RuntimeError(f"megabuf: bucket group {self.group_id} has no grad sync work")
        for pending in work.pending:
            pending.wait()
        self._grad_work = None
        self.grad_state = GradSyncState.SYNCED
        if self.timeline is not None:
            self.timeline.record(self.group_id, "finish")

    def missing_grad_params(self) -> list[str]:
        """Names of params not yet ready, if this group is waiting for grads to dispatch."""
        if self.grad_state is not GradSyncState.IDLE or not self.is_last_microbatch:
            return []
        return [self._name(p) for i, p in enumerate(self.params_list) if not self._ready[i]]

    def check_grads_finite(self) -> None:
        """Raise on every rank if any rank's bucket holds NaN/Inf (one small MAX all-reduce, so
        a rank with clean grads never waits forever for a rank that raised)."""
        device = self.buckets[0].grad_data.device
        flags = torch.zeros(len(self.buckets), self.collective_group_size, device=device)
        for b, bucket in enumerate(self.buckets):
            flags[b, self.dp_rank] = 0.0 if _finite(bucket.grad_data) else 1.0
        self.collectives.all_reduce_max(flags, self.collective_group)
        for b, bucket in enumerate(self.buckets):
            bad_ranks = [
                dist.get_global_rank(self.collective_group, r) if self.collective_group else r
                for r in flags[b].nonzero().flatten().tolist()
            ]
            if not bad_ranks:
                continue
            mine = [self._name(p) for p in bucket.params_list if not _finite(p.main_grad)]  # type: ignore[attr-defined]
            raise RuntimeError(
                f"megabuf: NaN or Inf in gradients of bucket {bucket.bucket_id} (bucket group "
                f"{self.group_id}, params: {', '.join(self._name(p) for p in bucket.params_list)})"
                f" on rank(s) {bad_ranks}, before reduction; this rank ({dist.get_rank()}) has "
                f"non-finite grads in: {', '.join(mine) or 'none'}"
            )

    # ---- param sync (distributed optimizer) -------------------------------------------------
    def mark_params_stale(self) -> None:
        """The optimizer updated this rank's shards; other ranks' shards must be gathered."""
        self.param_state = ParamSyncState.STALE

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather each bucket's param shards; async when overlap_param_gather."""
        if self.param_state is not ParamSyncState.STALE:
            return  # nothing to gather, or already in flight
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        pending = []
        for bucket in self.buckets:
            if bucket.param_data is None:
                raise RuntimeError("megabuf: param sync needs use_distributed_optimizer=True")
            shard = self._local_shard(bucket, bucket.param_data)
            work = self.collectives.all_gather(
                bucket.param_data, shard, self.collective_group, async_op=async_op,
                tag=self.group_id,
            )  # fmt: skip
            pending.append(work)
        self._param_work = SyncWork(pending, time.perf_counter())
        self.param_state = ParamSyncState.DISPATCHED
        if not async_op:
            self.finish_param_sync(skip_next_bucket_dispatch=True)

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Make params valid (dispatching the gather if nobody has), then prefetch the next
        group's gather so it overlaps with this group's forward compute."""
        if self.param_state is ParamSyncState.STALE:
            self.start_param_sync()
        if self.param_state is ParamSyncState.DISPATCHED and self._param_work is not None:
            for pending in self._param_work.pending:
                pending.wait()
            self._param_work = None
        self.param_state = ParamSyncState.VALID
        nxt = self.next_param_gather_bucket_group
        if not skip_next_bucket_dispatch and nxt is not None:
            nxt.start_param_sync()

    # ---- helpers ----------------------------------------------------------------------------
    def _local_shard(self, bucket: _ParamAndGradBucket, data: torch.Tensor) -> torch.Tensor:
        shard_numel = data.numel() // self.collective_group_size
        return data[self.dp_rank * shard_numel : (self.dp_rank + 1) * shard_numel]

    def _needs_scratch(self) -> bool:
        return self.collectives.strategy(self.collective_group).reduce_scatter == "all_to_all"

    def _name(self, param: torch.nn.Parameter) -> str:
        return self.param_to_name.get(param, f"<param of shape {tuple(param.shape)}>")


def raise_missing_grads(groups: Sequence[BucketGroup]) -> None:
    """With overlap_grad_reduce, a group dispatches only when every param got a grad: name the
    params that did not, so finish_grad_sync() raises instead of waiting forever."""
    missing = [name for group in groups for name in group.missing_grad_params()]
    if not missing:
        return
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    shown = ", ".join(missing[:10]) + more
    raise RuntimeError(
        f"megabuf: finish_grad_sync() on rank {dist.get_rank()}: {len(missing)} trainable "
        f"param(s) got no gradient this iteration, so their buckets were never reduced: {shown}."
        " Freeze them (requires_grad=False), use them in forward, or turn off overlap_grad_reduce"
    )


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def partition_buckets(
    buffers: Sequence[_ParamAndGradBuffer],
    force_single_bucket_group: bool = False,
    *,
    collectives: Collectives | None = None,
) -> list[BucketGroup]:
    """One BucketGroup per bucket, or a single group for everything (all buffers must then share
    one data-parallel group)."""
    if not buffers:
        return []
    collectives = collectives or Collectives()
    config = buffers[0].ddp_config
    if force_single_bucket_group:
        groups = {id(b.data_parallel_group) for b in buffers}
        if len(groups) != 1:
            raise ValueError(
                "megabuf: force_single_bucket_group needs buffers that share one data-parallel "
                "group; dense and expert buffers must be partitioned separately"
            )
        all_buckets = [bucket for b in buffers for bucket in b.buckets]
        return [BucketGroup(all_buckets, config, buffers[0].data_parallel_group, collectives)]
    result: list[BucketGroup] = []
    for buf in buffers:
        for bucket in buf.buckets:
            result.append(
                BucketGroup(
                    [bucket], config, buf.data_parallel_group, collectives, group_id=len(result)
                )
            )
    return result
