"""`BucketGroup`: buckets whose collectives are issued together, and its two lifecycles.

Grad lifecycle (per iteration):  IDLE --start_grad_sync--> DISPATCHED --finish_grad_sync--> SYNCED
                                 SYNCED/IDLE --reset--> IDLE
Param lifecycle (distributed optimizer only):
                                 VALID --mark_params_stale--> STALE --start_param_sync-->
                                 DISPATCHED --finish_param_sync--> VALID

A group never asks torch.distributed anything: its ranks, sizes and the `Collectives` it issues
through are given at construction, so its state machines run under a recording fake in tests.
The states and the `DispatchChain` ([Note: dispatch order], [Note: grad readiness]) are in
dispatch.py.
"""

from __future__ import annotations

import array
import enum
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.arrivals import CountedArrivals, GradReadiness
from megabuf.buffer import _ParamAndGradBucket
from megabuf.collectives import Collectives
from megabuf.comm_hooks.contract import GradBucket, HookWork, Waitable
from megabuf.config import DistributedDataParallelConfig
from megabuf.dispatch import (  # re-exported
    DispatchChain,
    GradSyncState,
    ParamSyncState,
    SyncWork,
    wait_dropped,
)
from megabuf.grad_math import InboundScale, NonfiniteFlags, by_dtype, foreach_scale
from megabuf.sharding.grads import GradBucketState, ShardedGrads
from megabuf.sharding.params import ShardedParams
from megabuf.sharding.replicate import ReplicaStage
from megabuf.timeline import Timeline  # re-exported: ddp.py and users import it from here
from megabuf.two_level import TwoLevelReduction


class BucketGroup(GradReadiness, TwoLevelReduction):
    """Buckets (possibly of several buffers) reduced together over one group.

    Built whole: ranks and sizes (`dp_rank`/`dp_size` in `collective_group`, the global `rank`
    for messages), the `Collectives` it issues through, its id, the param names and its
    `DispatchChain` are all given here; nothing is patched in later.
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
        sharded_grads: ShardedGrads | None = None,
        replicate_group: ProcessGroup | None = None,
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
        # optim_grads*: the buckets' grad storages ([Note: sharded grad lifecycle]); else None
        self.sharded_grads = sharded_grads
        # hybrid: the all-reduce of the reduced shards across replicas ([Note: two-level
        # reduction]); flat: a stage that never arms
        self.replicas = ReplicaStage(
            replicate_group, collectives, average=ddp_config.average_in_collective,
            group_id=group_id, rank=rank,
        )  # fmt: skip
        self.is_final_microbatch = True  # this backward ends the step (set by the grad sync)
        self.params_list = [p for b in self.buckets for p in b.params_list]
        self.params = set(self.params_list)
        self._index = {p: i for i, p in enumerate(self.params_list)}
        self.next_param_gather_bucket_group: BucketGroup | None = None
        self.timeline: Timeline | None = None
        self.grad_state = GradSyncState.IDLE
        self.param_state = ParamSyncState.VALID
        self._grad_work: SyncWork | None = None
        self._param_work: SyncWork | None = None
        self.comm_hook: object | None = None  # [Note: comm hook contract]
        self.hook_buckets: list[GradBucket] = []  # one per bucket, built at registration
        # grad arrivals per param per iteration; None until learned ([Note: grad readiness])
        self._expected_arrivals: list[int] | None = None
        self.counted: CountedArrivals | None = None  # [Note: counted arrivals] in arrivals.py
        n = len(self.params_list)
        self._all_unwritten = b"\x01" * n
        self._no_arrivals = array.array("H", bytes(2 * n))  # a count > 65535 raises
        # 1 = main_grad holds stale values ([Note: grad accumulation into main_grad]); both reset
        # in place each iteration; flat arrays: a list of 2000 ints took 0.4-2.3 ms to reset
        self._unwritten = bytearray(self._all_unwritten)
        self._arrivals = array.array("H", self._no_arrivals)
        self.inbound = InboundScale.of(self.buckets, ddp_config.sharding)
        self.is_last_microbatch = True
        self.nonfinite = NonfiniteFlags(  # [Note: NaN check] in nan_check.py
            self.params_list, [len(b.params_list) for b in self.buckets], self.name_of,
            keep_across_microbatches=self.sharded_grads is not None,
        )  # fmt: skip
        self._clear_iteration()

    # ---- lifecycle guards -------------------------------------------------------------------
    def _expect(self, *states: GradSyncState) -> None:
        hint = "did you call zero_grad_buffer() between iterations and finish_grad_sync() "
        hint += "after backward?"
        self._guard("grad sync", self.grad_state, states, hint)

    def _expect_param(self, *states: ParamSyncState) -> None:
        hint = "finish in-flight param gathers (model.publish_params()) before changing params"
        self._guard("param sync", self.param_state, states, hint)

    def _guard(self, what: str, state: enum.Enum, allowed: Sequence[enum.Enum], hint: str) -> None:
        if state not in allowed:
            wanted = " or ".join(s.name for s in allowed)
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} {what} is {state.name}, expected "
                f"{wanted} (rank {self.rank}); {hint}"
            )

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
        self.attach_replica_hook(hook, buckets, self.ddp_config.comm_hook_timeout_s)
        self.comm_hook = hook
        self.hook_buckets = list(buckets)

    def set_next_param_gather(self, group: BucketGroup | None) -> None:
        """The group whose param gather `finish_param_sync` prefetches (learned forward order)."""
        self.next_param_gather_bucket_group = group

    # ---- iteration bookkeeping ----------------------------------------------------------------
    def reset(self) -> None:
        """Forget readiness, written grads and any finished sync; ready for the next iteration."""
        if self.grad_state is GradSyncState.DISPATCHED:
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} was reset while its grad reduction is "
                f"in flight (rank {self.rank}); call finish_grad_sync() (or, after an "
                "exception, model.reset_iter_state()) first"
            )
        if self.sharded_grads is not None:
            self.sharded_grads.zero()
        self.replicas.new_step()
        self._clear_iteration()

    def next_microbatch(self) -> None:
        """reduce_each_microbatch: this micro-batch's reduction finished (SYNCED) and was added
        into the grad shards; accept the next micro-batch's grads (IDLE). Unlike reset(), the
        shards and the NaN flags are kept."""
        self._expect(GradSyncState.SYNCED)
        self._clear_readiness()

    def _clear_iteration(self) -> None:
        self._clear_readiness()
        self.is_last_microbatch = True
        self._unwritten[:] = self._all_unwritten
        self.inbound.clear()
        self.unused_indices: tuple[int, ...] = ()  # unwritten when dispatched (zero-filled)
        self.nonfinite.clear()

    def _clear_readiness(self) -> None:
        self._arrivals[:] = self._no_arrivals
        if self.counted is not None:
            self.counted.reset()
        self._num_pending = len(self.params_list)
        self.grad_state = GradSyncState.IDLE

    def index_of(self, param: torch.nn.Parameter) -> int:
        """Position of `param` in `params_list` (identity, not tensor equality)."""
        return self._index[param]

    def mark_written(self, i: int) -> bool:
        """Record that param `i` got a grad; True if it is the first since zero_grad_buffer()
        (the hook then overwrites main_grad instead of adding to it). Under optim_grads* the
        group's first grad since its release refills its buckets first."""
        sharded = self.sharded_grads
        if sharded is not None and sharded.state is GradBucketState.RELEASED:
            self._acquire_for_grad(i)
        first = self._unwritten[i]
        if first:
            self._unwritten[i] = 0
        return bool(first)

    def _acquire_for_grad(self, i: int) -> None:
        """A grad arrives for a released group: refill its buckets, unless it is a backward
        after finish_grad_sync() without zero_grad_buffer() (which raises, naming param i)."""
        if self.grad_state is GradSyncState.SYNCED:
            self._on_grad_outside_idle(i, self.params_list[i])
        if self.sharded_grads is not None:
            self.sharded_grads.acquire()

    def mark_unwritten(self, i: int) -> None:
        """Param `i`'s main_grad no longer counts as written (its exposed `.grad` was set to
        None): its next grad overwrites it, and without one it is zero-filled at dispatch."""
        self._unwritten[i] = 1

    def copy_factor(self, i: int, first: bool) -> float:
        """Param `i`'s grad's factor into main_grad: [Note: scale on the way in] (grad_math.py)."""
        cfg = self.ddp_config
        ok = self.is_final_microbatch and self.comm_hook is None and cfg.sync_grads_at_backward_end
        return self.inbound.factor_for(i, first, ok)

    def zero_unwritten_grads(self) -> None:
        """Zero the main_grad of params that got no grad since zero_grad_buffer(), and remember
        which they were (`unused_indices`). One `_foreach_zero_` per dtype, not one call each."""
        unused = []
        i = self._unwritten.find(1)
        while i != -1:
            self._unwritten[i] = 0
            unused.append(i)
            i = self._unwritten.find(1, i + 1)
        self.unused_indices = tuple(unused)
        grads = [self.params_list[i].main_grad for i in unused]  # type: ignore[attr-defined]
        for same_dtype in by_dtype(grads):
            torch._foreach_zero_(same_dtype)

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
        self._expect(GradSyncState.IDLE)
        if self.sharded_grads is not None and self.sharded_grads.released:
            self.sharded_grads.acquire()  # no grad since the release: all zero-filled below
        if self.counted is not None:
            self.counted.reconcile()
        self.zero_unwritten_grads()
        if self.ddp_config.check_for_nan_in_grad:
            self.nonfinite.record(self.buckets[0].grad_data.device)
        self._grad_work = SyncWork(self._reduce(self.ddp_config.overlap_grad_reduce))
        self.replicas.arm(self.is_final_microbatch)
        self.grad_state = GradSyncState.DISPATCHED
        if self.counted is not None:  # a later arrival checks the state
            self.counted.reset()
        if self.timeline is not None:
            self.timeline.record(self.group_id, "dispatch")

    def _reduce(self, async_op: bool) -> Sequence[Waitable]:
        """Every bucket's reduction, with as few collectives as the strategy allows ([Note: one
        collective per bucket group] in collectives.py)."""
        if self.comm_hook is not None:
            if self.sharded_grads is not None:
                self.sharded_grads.start(needs_scratch=False)
            return self._reduce_with_hook()
        cfg, strategy = self.ddp_config, self.ddp_config.sharding
        grads = [b.grad_data for b in self.buckets]
        scales = [b.gradient_scaling_factor for b in self.buckets]
        pre = [strategy.prescales(g.dtype) for g in grads]
        chosen = [(g, f) for g, f, p in zip(grads, scales, pre) if p]
        self.inbound.prescale([g for g, _ in chosen], [f for _, f in chosen], self.params_list)
        group, average = self.collective_group, cfg.average_in_collective
        if strategy.reduction == "all_reduce":
            return self.collectives.all_reduce_many(
                grads, group, average=average, async_op=async_op
            )
        scratches = self._scratches()
        return self.collectives.reduce_scatter_many(
            [self.local_shard(g) for g in grads], grads, group, average=average,
            async_op=async_op, scratches=scratches,
            scales=[1.0 if p else f for p, f in zip(pre, scales)],
        )  # fmt: skip

    def _scratches(self) -> list[Tensor | None]:
        """Each bucket's all-to-all landing zone when the reduce-scatter needs one: kept by the
        bucket, or under optim_grads* refilled and released with the bucket."""
        needs = self._needs_scratch(self.buckets[0].grad_data.device)
        if self.sharded_grads is not None:
            return self.sharded_grads.start(needs_scratch=needs)
        for bucket in self.buckets:
            if bucket.scratch is None and needs:
                bucket.scratch = torch.empty_like(bucket.grad_data)
        return [b.scratch for b in self.buckets]

    def _reduce_with_hook(self) -> list[HookWork]:
        """Pre-scale every bucket (both modes; not for a hook with `prescaled = False`), then
        hand each to the hook, which issues stage one now ([Note: comm hook contract]);
        `finish_grad_sync` waits for the rest, each wait bounded ([Note: bounded hook wait])."""
        if getattr(self.comm_hook, "prescaled", True):
            grads = [b.grad_data for b in self.buckets]
            foreach_scale(grads, [b.gradient_scaling_factor for b in self.buckets])
        timeout = self.ddp_config.comm_hook_timeout_s
        return [HookWork(self.comm_hook, bucket, timeout) for bucket in self.hook_buckets]

    def finish_grad_sync(self) -> None:
        """Wait for the reduction; if nobody dispatched it yet, dispatch it first. Under hybrid
        a group SYNCED as a non-final micro-batch may still owe its replicate all-reduce."""
        if self.grad_state is GradSyncState.SYNCED and not self.replicas.owed:
            return
        if self.grad_state is GradSyncState.IDLE:
            self.start_grad_sync()
        self._issue_owed_replicas()
        self._finish_first_level()
        self.replicas.wait()
        self.grad_state = GradSyncState.SYNCED
        if self.counted is not None:  # a later arrival checks the state
            self.counted.reset()
        if self.timeline is not None:
            self.timeline.record(self.group_id, "finish")

    # ---- param sync (distributed optimizer) -------------------------------------------------
    def mark_params_stale(self) -> None:
        """The optimizer updated this rank's shards; other ranks' shards must be gathered."""
        self._expect_param(ParamSyncState.VALID)
        self.param_state = ParamSyncState.STALE

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather each bucket's param shards; async when overlap_param_gather. Without
        `force_sync` nothing is done when params are valid or their gather is in flight. With
        `force_sync` the params hold the gathered values on return, from any state: a stale
        group gathers synchronously and a gather in flight is waited for ([Note: who waits for
        param gathers] in ddp.py)."""
        if force_sync and self.param_state is ParamSyncState.DISPATCHED:
            self.finish_param_sync(skip_next_bucket_dispatch=True)
            return
        if self.param_state is not ParamSyncState.STALE:
            return
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        params = [b.param_data for b in self.buckets]
        if any(p is None for p in params):
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} has no param_data to gather into: param "
                "sync needs a strategy that shards the optimizer (use_distributed_optimizer=True)"
            )
        full = [p for p in params if p is not None]
        pending = self.collectives.all_gather_many(
            full, [self.local_shard(p) for p in full], self.collective_group,
            async_op=async_op, tag=self.group_id,
        )  # fmt: skip
        self._param_work = SyncWork(pending)
        self.param_state = ParamSyncState.DISPATCHED
        if not async_op:
            self.finish_param_sync(skip_next_bucket_dispatch=True)
            return
        # [Note: gathers outlive a dropped group]: waited for when the record is dropped
        weakref.finalize(self._param_work, wait_dropped, pending, self.rank)

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Make params valid (dispatching the gather if nobody has), then prefetch the next
        group's gather so it overlaps with this group's forward compute."""
        if self.param_state is ParamSyncState.STALE:
            self.start_param_sync()
        if self.param_state is ParamSyncState.DISPATCHED:
            if self._param_work is None:
                raise RuntimeError(f"megabuf: bucket group {self.group_id} has no gather work")
            self._param_work.wait()
            self._param_work = None
        self.param_state = ParamSyncState.VALID
        nxt = self.next_param_gather_bucket_group
        if not skip_next_bucket_dispatch and nxt is not None:
            nxt.start_param_sync()

    # ---- helpers ----------------------------------------------------------------------------
    def _full_grads(self) -> list[Tensor]:
        return [b.grad_data for b in self.buckets]

    def local_shard(self, data: torch.Tensor) -> torch.Tensor:
        shard_numel = data.numel() // self.dp_size
        return data[self.dp_rank * shard_numel : (self.dp_rank + 1) * shard_numel]

    def _needs_scratch(self, device: torch.device) -> bool:
        return (
            self.collectives.strategy(self.collective_group, device).reduce_scatter == "all_to_all"
        )

    def name_of(self, param: torch.nn.Parameter) -> str:
        """`param`'s name in the wrapped module (for messages)."""
        return self.param_to_name.get(param, f"<param of shape {tuple(param.shape)}>")
