"""`BucketGroup`: buckets whose collectives are issued together, and its two lifecycles.

Grad lifecycle (per iteration):  IDLE --start_grad_sync--> DISPATCHED --finish_grad_sync--> SYNCED
                                 SYNCED/IDLE --reset--> IDLE
Param lifecycle (distributed optimizer only):
                                 VALID --mark_params_stale--> STALE --start_param_sync-->
                                 DISPATCHED --finish_param_sync--> VALID

A group never asks torch.distributed anything: its ranks, sizes and the `Collectives` it issues
through are given at construction, so its state machines run under a recording fake in tests.
The states and the `DispatchChain` ([Note: dispatch order], [Note: grad readiness]) are in
dispatch.py. The group owns its parts, each chosen once and never tested for None: its
readiness (`GradReadiness`, readiness.py), its grad storage ([Note: grad storage] in
megabuf/sharding/grads.py) and its reduction ([Note: reductions] in reductions.py). Its chain
drives it; the group calls its chain only to report that it is ready or must reopen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed import ProcessGroup

from megabuf.buckets.arrivals import CountedArrivals, GradHook
from megabuf.buckets.buffer import _ParamAndGradBucket
from megabuf.buckets.dispatch import (  # re-exported
    DispatchChain,
    GradSyncState,
    ParamSyncState,
    refuse_reaccumulation,
)
from megabuf.buckets.full_grads import FullGrads, GradStorage
from megabuf.buckets.grad_math import InboundScale, NonfiniteFlags, WrittenGrads
from megabuf.buckets.param_gather import ParamGather
from megabuf.buckets.readiness import GradReadiness
from megabuf.buckets.reductions import Reduction, ReductionParts, reduction_for
from megabuf.comm_hooks.contract import GradBucket
from megabuf.config import DistributedDataParallelConfig
from megabuf.pure.timeline import Timeline  # re-exported: ddp.py and users import it from here
from megabuf.sharding.grads import ShardedGrads
from megabuf.sharding.params import ShardedParams
from megabuf.sharding.replicate import ReplicaStage
from megabuf.transport.collectives import Collectives
from megabuf.transport.cross_replica import CrossReplica
from megabuf.transport.observers import issue_descriptor


class BucketGroup:
    """Buckets (possibly of several buffers) reduced together over one group.

    Built whole: ranks and sizes (`dp_rank`/`dp_size` in `collective_group`, the global `rank`
    for messages), the `Collectives` it issues through, its id, the param names and its
    `DispatchChain` are all given here; nothing is patched in later. `grads`: its grad storage
    (default: the full one); `replicas`: the second level ([Note: cross-replica level]).
    """

    def __init__(
        self,
        buckets: Sequence[_ParamAndGradBucket],
        ddp_config: DistributedDataParallelConfig,
        collective_group: ProcessGroup | None,
        collectives: Collectives,
        *,
        group_id: int,
        dp_rank: int,
        dp_size: int,
        rank: int,
        param_to_name: Mapping[torch.nn.Parameter, str],
        chain: DispatchChain[BucketGroup] | None = None,
        sharded_params: ShardedParams | None = None,
        grads: GradStorage | None = None,
        replicas: CrossReplica | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.ddp_config = ddp_config
        self.collective_group = collective_group
        self.collectives = collectives
        self.group_id = group_id  # unique across a model's dense and expert groups
        self.dp_rank = dp_rank  # this rank's index in collective_group
        self.dp_size = dp_size  # size of collective_group
        self.rank = rank  # global rank, for messages
        self.param_to_name = param_to_name
        self.chain = chain
        # optim_grads_params: the full params and shards ([Note: sharded param lifecycle])
        self.sharded_params = sharded_params
        self.params_list = [p for b in self.buckets for p in b.params_list]
        self.params = set(self.params_list)
        self._index = {p: i for i, p in enumerate(self.params_list)}
        # [Note: grad storage] in megabuf/sharding/grads.py
        self.grads: GradStorage = grads or FullGrads(self.buckets, dp_rank, dp_size)
        self.releases_buckets = self.grads.releases
        self.inbound = InboundScale.of(self.buckets, ddp_config.sharding)
        self.reduction: Reduction = reduction_for(  # [Note: reductions] in reductions.py
            ddp_config.sharding, ReductionParts.of(self), replicas
        )
        self.readiness = GradReadiness(  # [Note: grad readiness] in dispatch.py
            self.params_list, overlap=ddp_config.overlap_grad_reduce,
            on_ready=self._on_ready, on_reopen=self._reopen, name_of=self.name_of,
            keeps_across_syncs=not ddp_config.sharding.shards_optimizer, group_id=group_id,
            rank=rank,
        )  # fmt: skip
        # the parts' per-grad entries: their bound methods, published as the group's own
        self.register_grad_ready_at = self.readiness.register_grad_ready_at
        self.is_final_microbatch = True  # this backward ends the step
        self.timeline: Timeline | None = None
        self.param_gather = ParamGather(  # param_gather.py
            self.buckets, collectives, collective_group, self.local_shard,
            overlap=ddp_config.overlap_param_gather, group_id=group_id, rank=rank,
        )  # fmt: skip
        self.written = WrittenGrads(self.params_list, self.grads, self._before_refill)
        self.mark_written = self.written.mark_written  # per grad: no call more
        self.mark_unwritten = self.written.mark_unwritten
        self.set_unwritten = self.written.set  # [Note: counted arrivals]
        self.nonfinite = NonfiniteFlags(  # [Note: NaN check] in nan_check.py
            self.params_list, [len(b.params_list) for b in self.buckets], self.name_of,
            keep_across_microbatches=self.releases_buckets,
        )  # fmt: skip
        self._clear_iteration()

    # ---- the parts' state, as the grad sync and the tests read it -----------------------------
    @property
    def grad_state(self) -> GradSyncState:
        return self.readiness.state

    @grad_state.setter
    def grad_state(self, state: GradSyncState) -> None:
        self.readiness.state = state

    @property
    def is_last_microbatch(self) -> bool:
        """This backward's grads make the group ready (not inside no_sync())."""
        return self.readiness.is_last_microbatch

    @is_last_microbatch.setter
    def is_last_microbatch(self, value: bool) -> None:
        self.readiness.is_last_microbatch = value

    @property
    def is_final_microbatch(self) -> bool:
        """This backward ends the step (set by the grad sync)."""
        return self._final

    @is_final_microbatch.setter
    def is_final_microbatch(self, value: bool) -> None:
        self._final = value  # [Note: two-level reduction]; [Note: scale on the way in]: only
        cfg, scales = self.ddp_config, self.reduction.scales_inbound  # when its end reduces
        self._inbound_allowed = value and scales and cfg.sync_grads_at_backward_end

    @property
    def counted(self) -> CountedArrivals | None:
        """Its counted arrivals once switched to them ([Note: counted arrivals]), else None."""
        counter = self.readiness.counter
        return counter if isinstance(counter, CountedArrivals) else None

    @property
    def sharded_grads(self) -> ShardedGrads | None:
        """Its grad storage when sharded, for the layers that ask (offload, the re-plan)."""
        return self.grads if isinstance(self.grads, ShardedGrads) else None

    @property
    def comm_hook(self) -> object | None:
        return self.reduction.hook  # [Note: comm hook contract]

    @property
    def hook_buckets(self) -> Sequence[GradBucket]:
        return self.reduction.hook_buckets  # one per bucket, built at registration

    @property
    def replicas(self) -> ReplicaStage | None:
        return self.reduction.replicas  # hybrid's second level; None when flat

    @property
    def all_ready(self) -> bool:
        return self.readiness.all_ready

    @property
    def expected_total(self) -> int:
        return self.readiness.expected_total

    def learn_arrivals(self) -> None:
        self.readiness.learn()

    def count_arrivals(
        self, total: int, bookkeeping: Callable[[], Callable[[], None] | None],
        in_backward: list[bool],
    ) -> GradHook:  # fmt: skip
        """Count this group's arrivals from now on ([Note: counted arrivals] in arrivals.py):
        `total` learned grads an iteration, `bookkeeping` the engine's per-backward call. The
        hook to register on each of its params."""
        counted = CountedArrivals(self, total, bookkeeping, in_backward)
        self.readiness.counter = counted
        return counted.hook

    # ---- observers learned or enabled at run time ------------------------------------------
    def set_timeline(self, timeline: Timeline | None) -> None:
        """Record ready/dispatch/finish events into `timeline` (None: stop recording)."""
        self.timeline = timeline

    def set_comm_hook(self, hook: object, buckets: Sequence[GradBucket]) -> None:
        """Reduce with `hook` from now on, per bucket and level ([Note: comm hook contract])."""
        if len(buckets) != len(self.buckets):
            raise ValueError(
                f"megabuf: bucket group {self.group_id} has {len(self.buckets)} buckets, "
                f"got {len(buckets)} hook views"
            )
        timeout = self.ddp_config.comm_hook_timeout_s
        self.reduction = self.reduction.with_hook(hook, buckets, timeout)
        self.is_final_microbatch = self._final  # a hook takes no grad scaled on the way in

    # ---- readiness events ([Note: grad readiness] in dispatch.py) ----------------------------
    def on_all_arrived(self) -> None:
        """A counted group's learned total arrived ([Note: counted arrivals])."""
        self.readiness.all_arrived()

    def _on_ready(self) -> None:
        """Every grad this iteration brings arrived: dispatch, in chain order."""
        if self.timeline is not None:
            self.timeline.record(self.group_id, "ready")
        if self.chain is not None:
            self.chain.on_ready()
        else:
            self.start_grad_sync()

    @property
    def accepts_grads(self) -> bool:
        """Not dispatched or synced: a grad accumulates into this iteration's reduction."""
        return self.readiness.state is GradSyncState.IDLE

    @property
    def counts_arrivals(self) -> bool:
        """This backward's grads make the group ready (overlap on, not inside no_sync())."""
        return self.readiness.counting

    def on_counted_grad_outside_idle(self) -> None:
        """A counted arrival ([Note: counted arrivals]) found the group dispatched or synced."""
        self.readiness.late(None, None)

    def _reopen(self, name: str) -> None:
        """A grad (of `name`) found the group SYNCED: accumulate on top ([Note: grad readiness])."""
        if self.chain is not None:
            self.chain.reopen(self, name)
        else:
            refuse_reaccumulation([self], name, self.rank)
            self.readiness.clear()

    def set_next_param_gather(self, group: BucketGroup | None) -> None:
        """The group whose param gather `finish_param_sync` prefetches (learned forward order)."""
        self.param_gather.next = group.param_gather if group is not None else None

    # ---- iteration bookkeeping ----------------------------------------------------------------
    def reset(self) -> None:
        """Forget readiness, written grads and any finished sync; ready for the next iteration."""
        if self.grad_state is GradSyncState.DISPATCHED:
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} was reset while its grad reduction is "
                f"in flight (rank {self.rank}); call finish_grad_sync() (or, after an "
                "exception, model.reset_iter_state()) first"
            )
        self.grads.zero()
        self.reduction.new_step()
        self._clear_iteration()

    def next_microbatch(self) -> None:
        """reduce_each_microbatch: this micro-batch's reduction finished (SYNCED) and was added
        into the grad shards; accept the next micro-batch's grads (IDLE). Unlike reset(), the
        shards and the NaN flags are kept."""
        self.readiness.expect(GradSyncState.SYNCED)
        self.readiness.clear()

    def _clear_iteration(self) -> None:
        self.readiness.clear()
        self.is_last_microbatch = True
        self.written.clear()
        self.inbound.clear()
        self.nonfinite.clear()

    def index_of(self, param: torch.nn.Parameter) -> int:
        """Position of `param` in `params_list` (identity, not tensor equality)."""
        return self._index[param]

    def _before_refill(self, i: int) -> None:
        """A grad arrives for a released group, which refills its buckets, unless it is a
        backward after finish_grad_sync() without zero_grad_buffer() (raises, naming param i)."""
        if self.grad_state is GradSyncState.SYNCED:
            self.readiness.late(i, self.params_list[i])

    def copy_factor(self, i: int, first: bool) -> float:
        """Param `i`'s grad's factor into main_grad: [Note: scale on the way in] (grad_math.py)."""
        return self.inbound.factor_for(i, first, self._inbound_allowed)

    @property
    def unused_indices(self) -> tuple[int, ...]:
        """Params unwritten when dispatched (zero-filled)."""
        return self.written.unused_indices

    @property
    def reduction_gain(self) -> float:
        """What one reduction multiplies grads that are equal on every rank by: dense buckets 1
        (1/dp summed over dp); expert buckets 1/ep_size (1/dp summed over expt_dp only)."""
        gain = self.buckets[0].gradient_scaling_factor
        if not self.ddp_config.average_in_collective:
            gain *= self.dp_size
        return gain

    # ---- grad sync ----------------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Dispatch every bucket's reduction (async when overlapping), scaled by the bucket's
        gradient_scaling_factor: before an all-reduce, after a reduce-scatter (shard only)."""
        self.readiness.expect(GradSyncState.IDLE)
        if self.grads.released:  # no grad since the release: all zero-filled below
            self.written.refill()
        counter = self.readiness.counter
        counter.reconcile()
        self.written.zero_unwritten()
        if self.ddp_config.check_for_nan_in_grad:
            self.nonfinite.record(self.buckets[0].grad_data.device)
        with self.collectives.observers.issuing(self._issue_descriptor):  # [Note: verify mode]
            self.reduction.start(self.ddp_config.overlap_grad_reduce, self._final)
        self.grad_state = GradSyncState.DISPATCHED
        counter.reset()  # a later arrival checks the state
        if self.timeline is not None:
            self.timeline.record(self.group_id, "dispatch")

    def _issue_descriptor(self) -> tuple[str, ProcessGroup | None, tuple[int, ...]]:
        """What every rank of the group issues as this reduction ([Note: collective observers])."""
        numel, dtype = sum(b.numel_unpadded for b in self.buckets), self.buckets[0].grad_data.dtype
        return (
            f"bucket group {self.group_id}",
            self.collective_group,
            issue_descriptor(self.group_id, dtype, numel),
        )

    def finish_grad_sync(self) -> None:
        """Wait for the reduction; if nobody dispatched it yet, dispatch it first. Under hybrid
        a group SYNCED as a non-final micro-batch may still owe its replicate all-reduce, which
        is issued here (its chain issued the earlier groups' first: [Note: two-level
        reduction])."""
        if self.grad_state is GradSyncState.SYNCED and not self.reduction.owed:
            return
        if self.grad_state is GradSyncState.IDLE:
            self.start_grad_sync()
        self.start_replica_sync()  # when owed
        self.reduction.finish()
        self.grad_state = GradSyncState.SYNCED
        self.readiness.counter.reset()  # a later arrival checks the state
        if self.timeline is not None:
            self.timeline.record(self.group_id, "finish")

    def start_replica_sync(self) -> None:
        """Hybrid, a final micro-batch: land the first level and issue the all-reduce across
        replicas. Only the dispatch chain calls it, in chain order; a no-op when nothing is
        owed."""
        if not self.reduction.owed:
            return
        self.reduction.start_second_level()
        if self.timeline is not None:  # the second level's dispatch; "finish" covers both
            self.timeline.record(self.group_id, "replicate_dispatch")

    @property
    def replica_owed(self) -> bool:
        return self.reduction.owed

    def end_step_at_sync(self) -> None:
        """The grad sync that ends the step begins: every later reduction is final, and one
        that already ran (or runs) as a non-final micro-batch owes its replicate all-reduce."""
        self.is_final_microbatch = True
        if self.grad_state is not GradSyncState.IDLE:
            self.reduction.owe_at_sync()

    def first_level_completed(self) -> bool:
        """The reduction in the group's own collective group has landed (never waits)."""
        return self.reduction.first_level_completed()

    def grad_sync_completed(self) -> bool:
        """The dispatched reduction has landed, both levels under hybrid (finish_grad_sync would
        not wait); False when unknown (a comm hook's work)."""
        return self.grad_state is GradSyncState.DISPATCHED and self.reduction.completed()

    def abandon_grad_sync(self) -> None:
        """After an exception mid-iteration: wait out an in-flight reduction (its result is
        dropped) and return to IDLE with nothing written."""
        self.reduction.abandon()
        self.grads.abandon()
        self.grad_state = GradSyncState.IDLE
        self._clear_iteration()

    # ---- param sync (distributed optimizer): its ParamGather, param_gather.py ----------------
    @property
    def param_state(self) -> ParamSyncState:
        return self.param_gather.state

    def mark_params_stale(self) -> None:
        """The optimizer updated this rank's shards; other ranks' shards must be gathered."""
        self.param_gather.mark_stale()

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather each bucket's param shards (`ParamGather.start`)."""
        self.param_gather.start(force_sync)

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Make params valid, then prefetch the next group's gather (`ParamGather.finish`)."""
        self.param_gather.finish(skip_next_bucket_dispatch)

    # ---- helpers ----------------------------------------------------------------------------
    def local_shard(self, data: torch.Tensor) -> torch.Tensor:
        shard_numel = data.numel() // self.dp_size
        return data[self.dp_rank * shard_numel : (self.dp_rank + 1) * shard_numel]

    def name_of(self, param: torch.nn.Parameter) -> str:
        """`param`'s name in the wrapped module (for messages)."""
        return self.param_to_name.get(param, f"<param of shape {tuple(param.shape)}>")
