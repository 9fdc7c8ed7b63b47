"""`DistributedDataParallel`: wraps any nn.Module with contiguous grad buffers and bucket groups.

[Note: grad contract]
After `finish_grad_sync()` (without the distributed optimizer), every trainable param on every
dp rank has `.grad` equal to the reduced (dp-averaged) gradient: the `main_grad` view itself when
dtypes match, a copy of it in the param's dtype otherwise. Never None, identical on every rank,
whether or not the param was used on that rank (unused ones are zero-filled before their bucket
is reduced, [Note: grad readiness] in bucket_group.py). It stays so until `zero_grad_buffer()`;
a forward (evaluation, metrics) in between changes nothing. A backward in between accumulates
on top, as plain PyTorch would: the copies are dropped by a one-shot hook just before that
backward's first grad reaches them. With `error_on_unused_params` a param that got no gradient
on some rank instead makes `finish_grad_sync()` raise on every rank, naming it and the ranks.
With the distributed optimizer only this rank's shard of each bucket is reduced, so `.grad`
stays None (a torch optimizer or `clip_grad_norm_` cannot see partial grads; a torch optimizer
stepping such params raises, see grads.py); megabuf's optimizer reads the shard from the buffer.
When the grad sync finishes: with `sync_grads_at_backward_end` (default) at the end of every
backward run with grad sync on, as torch DDP; otherwise at `finish_grad_sync()`. What a later
backward does with grads the user cleared or changed: [Note: grads the user changed].
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megabuf import torch_compat
from megabuf.backward_sync import BackwardEndSync
from megabuf.bucket_group import BucketGroup, DispatchChain, GradSyncState, ParamSyncState, Timeline
from megabuf.buffer import _ParamAndGradBuffer
from megabuf.collectives import Collectives
from megabuf.comm_hooks import build as build_comm_hook
from megabuf.comm_hooks.engine_api import CommHookMethods
from megabuf.comm_hooks.fixed_order import Deterministic
from megabuf.config import DistributedDataParallelConfig
from megabuf.devices import params_device
from megabuf.grads import ExposedGrads, raise_on_unused_params, refuse_foreign_optimizers
from megabuf.hooks import ParamGatherHooks, has_compiled, profiler_recording, register_grad_hooks
from megabuf.nan_check import raise_on_nonfinite_grads
from megabuf.plan import GroupPlan, Plan, build_plan
from megabuf.process_groups import ProcessGroups
from megabuf.replicas import (
    ParamStructure,
    check_devices,
    check_replicas_match,
    is_expert_parallel,
    param_specs,
)
from megabuf.sharding.grads import (
    ShardedGrads,
    bucket_padding_ranges,
    shards_grads,
)
from megabuf.sharding.ledger import MemoryLedger
from megabuf.sharding.params import ShardedParams, shards_params
from megabuf.sharding.zero3 import ParamUnits
from megabuf.units import UnitPlan, plan_units

logger = logging.getLogger(__name__)

BACKWARD_END_GROUP_ID = -1  # group id of the timeline's "backward_end" marker


class DistributedDataParallel(CommHookMethods, nn.Module):
    """Megatron-style data parallelism for any module: grads accumulate into contiguous
    buffers (`param.main_grad` views) and are reduced bucket group by bucket group.

    Per step: `zero_grad_buffer()` (or the optimizer's `zero_grad()`); forward; backward,
    which finishes the grad sync (`sync_grads_at_backward_end`; otherwise call
    `finish_grad_sync()`); optimizer step (README "Using it", "The gradient contract" and
    "Porting from torch DDP"). Construction is collective: every rank of the process groups must
    wrap the same model (checked; raises naming the first difference), and dp-rank 0's params
    and buffers are broadcast to the others.

    Args:
        module: the model, all params on one device. Params are bound at wrapping: replacing,
            adding, freezing or unfreezing one afterwards raises at the next grad sync.
        ddp_config: a `DistributedDataParallelConfig` (default: all fields at their defaults,
            i.e. synchronous all-reduce, one bucket per buffer, sync at backward end). torch's
            second positional argument, `device_ids`, is also accepted here.
        process_groups: the `ProcessGroups` to reduce over (default: `ProcessGroups.default()`,
            the whole world as dp; build with `ProcessGroups.build(pp_size=, ep_size=)`).
        disable_bucketing: one bucket group per kind (dense / expert) instead of one per bucket.
        collectives: the layer every collective goes through (default: a new `Collectives`);
            tests pass a subclass to count or intercept calls.
        **torch_ddp_args: any argument of `torch.nn.parallel.DistributedDataParallel`
            (`device_ids`, `output_device`, `broadcast_buffers`, `process_group`,
            `bucket_cap_mb`, `find_unused_parameters`, `static_graph`, ...): honoured, accepted
            where megabuf already behaves so, or rejected naming the megabuf way; see
            [Note: torch DDP arguments] in torch_compat.py and README "Porting from torch DDP".
    """

    def __init__(
        self,
        module: nn.Module,
        ddp_config: DistributedDataParallelConfig | None = None,
        *,
        process_groups: ProcessGroups | None = None,
        disable_bucketing: bool = False,
        collectives: Collectives | None = None,
        **torch_ddp_args: Any,
    ) -> None:
        super().__init__()
        options = torch_compat.resolve(module, ddp_config, process_groups, torch_ddp_args)
        self.module = module
        self.ddp_config = options.ddp_config
        self.process_groups = options.process_groups or ProcessGroups.default()
        self.disable_bucketing = disable_bucketing
        self.collectives = collectives if collectives is not None else Collectives()
        self.sync_buffers_in_forward = options.sync_buffers_in_forward
        self.rank = dist.get_rank()
        self._backward_seen = False  # register_comm_hook() must come before the first backward
        self._backward_sync = BackwardEndSync(
            self.ddp_config.sync_grads_at_backward_end, self._finish_backward
        )
        # optim_grads*, reduce_each_microbatch: every backward reduces into the grad shards
        cfg = self.ddp_config
        self._reduce_each = shards_grads(cfg.data_parallel_sharding_strategy) and (
            cfg.sharded_grad_accumulation == "reduce_each_microbatch"
        )
        self._backward_sync.every_backward = self._reduce_each
        self._microbatch_pending = False  # a no_sync forward whose reduction is not finished
        self._sync_finished = False  # finish_grad_sync ran since the last grad (see there)
        self.memory_ledger = MemoryLedger()  # [Note: sharded grad lifecycle]
        self.param_units: ParamUnits | None = None  # optim_grads_params: the unit runtime
        self._build(options.init_sync)
        self._mode_hook: Deterministic | None = None  # deterministic_reduction's, replaceable
        if self.ddp_config.comm_hook is not None:
            spec = dict(self.ddp_config.comm_hook)
            buffers = spec.pop("buffers", "all")
            self.register_comm_hook(build_comm_hook(spec), buffers=buffers)
        if self.ddp_config.deterministic_reduction:
            self._install_deterministic()

    # ---- construction -------------------------------------------------------------------------
    def _build(self, init_sync: bool) -> None:
        pgs = self.process_groups
        named = _unique_named_parameters(self.module)
        check_devices(named)
        check_replicas_match(named, pgs.dp, self.collectives)
        trainable = [(n, p) for n, p in named if p.requires_grad]
        self.param_to_name = {p: n for n, p in trainable}
        params = [p for _, p in trainable]
        self.unit_plan: UnitPlan | None = None  # optim_grads_params: [Note: shard units]
        if shards_params(self.ddp_config.data_parallel_sharding_strategy):
            self.unit_plan = plan_units(self.module, self.ddp_config.shard_units, trainable)
        self.plan: Plan = build_plan(
            param_specs(trainable),
            self.ddp_config,
            dp_size=pgs.dp_size,
            expt_dp_size=dist.get_world_size(pgs.expt_dp),
            expert_shares_dp_group=pgs.expt_dp is pgs.dp,
            disable_bucketing=self.disable_bucketing,
            unit_of_param=self.unit_plan.unit_ids([n for n, _ in trainable])
            if self.unit_plan is not None
            else None,
        )
        self._all_buffers: list[_ParamAndGradBuffer] = self._make_buffers(params)  # plan order
        expert = [planned.expert for planned in self.plan.buffers]
        # Megatron's attribute name. It would shadow nn.Module.buffers(), so the list is also
        # callable: `model.buffers` is the grad buffers, `model.buffers()` the module buffers.
        self.buffers = _BufferList(  # type: ignore[method-assign,assignment]
            [b for b, e in zip(self._all_buffers, expert) if not e], self
        )
        self.expert_parallel_buffers = [b for b, e in zip(self._all_buffers, expert) if e]
        self._wire_groups()
        self._grads = self._exposed_grads(params)
        self._grad_hook_handles = register_grad_hooks(
            params, self.param_to_bucket_group, set(self._grads.linked), self._on_grad
        )
        for group in self.all_bucket_groups:  # the hooks hold the views: guard the attribute
            if group.sharded_grads is not None:
                names = [self.param_to_name[p] for p in group.params_list]
                group.sharded_grads.guard_main_grads(group.params_list, names)
        self._module_buffers = list(self.module.buffers())
        self.param_gather_hooks = ParamGatherHooks(self.module, self.param_to_bucket_group)
        if self.ddp_config.overlap_param_gather:
            self.param_gather_hooks.enable()
        self._structure = ParamStructure(self.module)
        if init_sync:
            self.broadcast_params()
        if shards_params(self.ddp_config.data_parallel_sharding_strategy):
            self.param_units = ParamUnits.build(self)  # shards filled, full params released
        for buf in self._all_buffers:
            logger.debug("megabuf: %s", buf.describe())

    def _exposed_grads(self, params: Sequence[nn.Parameter]) -> ExposedGrads:
        """[Note: grad contract]: nothing is exposed with the distributed optimizer."""
        if self.ddp_config.use_distributed_optimizer:
            refuse_foreign_optimizers(self.param_to_name)
            return ExposedGrads([], [], self.param_to_bucket_group)
        same = [p for p in params if p.main_grad.dtype == p.dtype]  # type: ignore[attr-defined]
        other = [p for p in params if p.main_grad.dtype != p.dtype]  # type: ignore[attr-defined]
        return ExposedGrads(same, other, self.param_to_bucket_group)

    def _scaling_factors(self) -> tuple[float, float]:
        """Every grad ends up averaged over the dense dp group: expert grads already hold the
        contributions of the ep ranks (token all-to-all), so they too are scaled by 1/dp_size
        and summed over expt_dp (dp_size = ep_size * expt_dp_size)."""
        dp_size = self.process_groups.dp_size
        if self.ddp_config.average_in_collective:
            return 1.0, dist.get_world_size(self.process_groups.expt_dp) / dp_size
        return 1.0 / dp_size, 1.0 / dp_size

    def _make_buffers(self, params: Sequence[nn.Parameter]) -> list[_ParamAndGradBuffer]:
        """One buffer per planned buffer, in plan order (dense first, then expert); `params` are
        the trainable params the plan's param ids index."""
        pgs = self.process_groups
        dense_scale, expert_scale = self._scaling_factors()
        buffers = []
        for planned in self.plan.buffers:
            group = pgs.expt_dp if planned.expert else pgs.dp
            buffers.append(
                _ParamAndGradBuffer(
                    self.ddp_config,
                    planned.param_dtype,
                    planned.grad_dtype,
                    [params[i] for i in planned.param_ids],
                    group,
                    planned.layout,
                    self.param_to_name,
                    expert_scale if planned.expert else dense_scale,
                    dp_size=planned.dp_size,
                    dp_rank=dist.get_rank(group),
                )
            )
        return buffers

    def _wire_groups(self) -> None:
        """The planned bucket groups and dispatch chains ([Note: one chain per communicator])."""
        chains = [DispatchChain() for _ in self.plan.chains]
        groups = [
            self._make_group(planned, chains[planned.chain_id]) for planned in self.plan.groups
        ]
        for chain, group_ids in zip(chains, self.plan.chains, strict=True):
            chain.set_order([groups[i] for i in group_ids])
        self._chains: list[DispatchChain] = chains
        self.bucket_groups = [g for g, p in zip(groups, self.plan.groups) if not p.expert]
        self.expert_parallel_bucket_groups = [
            g for g, p in zip(groups, self.plan.groups) if p.expert
        ]
        self.timeline: Timeline | None = None
        self.param_to_bucket_group = {p: g for g in groups for p in g.params_list}

    def _make_group(self, planned: GroupPlan, chain: DispatchChain) -> BucketGroup:
        group = self.process_groups.expt_dp if planned.expert else self.process_groups.dp
        dp_rank, dp_size = dist.get_rank(group), dist.get_world_size(group)
        return BucketGroup(
            [self._all_buffers[b].buckets[k] for b, k in planned.members],
            self.ddp_config,
            group,
            self.collectives,
            group_id=planned.group_id,
            dp_rank=dp_rank,
            dp_size=dp_size,
            rank=self.rank,
            param_to_name=self.param_to_name,
            chain=chain,
            sharded_params=self._sharded_params(planned),
            sharded_grads=self._sharded_grads(planned, dp_rank, dp_size),
        )

    def _sharded_grads(self, planned: GroupPlan, dp_rank: int, dp_size: int) -> ShardedGrads | None:
        """optim_grads*: the group's grad storages ([Note: sharded grad lifecycle])."""
        if not shards_grads(self.ddp_config.data_parallel_sharding_strategy):
            return None
        members = [(self._all_buffers[b], k) for b, k in planned.members]
        full = [buf.buckets[k].grad_data for buf, k in members]
        shards = [s for buf, k in members if (s := buf.buckets[k].grad_shard) is not None]
        sizes = [t.numel() // dp_size for t in full]
        return ShardedGrads(
            full, [(dp_rank * n, (dp_rank + 1) * n) for n in sizes], shards,
            [bucket_padding_ranges(buf.layout, k) for buf, k in members],
            self.memory_ledger, group_id=planned.group_id, rank=self.rank,
        )  # fmt: skip

    def _sharded_params(self, planned: GroupPlan) -> ShardedParams | None:
        """optim_grads_params: the group's full params and shards ([Note: sharded param
        lifecycle] in megabuf/sharding/params.py)."""
        if not shards_params(self.ddp_config.data_parallel_sharding_strategy):
            return None
        group = self.process_groups.expt_dp if planned.expert else self.process_groups.dp
        buckets = [self._all_buffers[b].buckets[k] for b, k in planned.members]
        return ShardedParams(
            [b.param_data for b in buckets if b.param_data is not None],
            [b.param_shard for b in buckets if b.param_shard is not None],
            self.collectives, group, self.memory_ledger, group_id=planned.group_id,
            unit_name=ParamUnits.unit_name_of(self, planned), rank=self.rank,
            dp_rank=dist.get_rank(group), dp_size=dist.get_world_size(group),
            poison=self.ddp_config.verify_param_access,
        )  # fmt: skip

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward. A training forward (grad enabled, grad sync on) first
        broadcasts dp-rank 0's module buffers (`broadcast_buffers`, torch's default; collective),
        and its outputs arm the end-of-backward grad sync."""
        self._before_forward(torch.compiler.is_compiling())
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self._backward_sync.wanted():
            self._backward_sync.watch(output)
        return output

    @torch.compiler.disable
    def _before_forward(self, compiling: bool) -> None:
        """Runs eagerly even when this model is compiled (`compiling`: it is being traced)."""
        self._backward_sync.queued = False  # callbacks never run after a backward that raised
        if self._microbatch_pending:
            self.finish_microbatch()  # its backward ended without the callback (deferred)
        if self._reduce_each and torch.is_grad_enabled() and not self._backward_sync.require_sync:
            self._microbatch_pending = True
        if self.param_gather_hooks.enabled and (compiling or has_compiled(self.module)):
            self.param_gather_hooks.gather_at_root()  # [Note: compiled modules]
        if self.param_gather_hooks.at_root:
            self.publish_params()
        sync_on = self._backward_sync.require_sync
        if self.sync_buffers_in_forward and torch.is_grad_enabled() and sync_on:
            with torch.no_grad():
                for tensor in self._module_buffers:
                    self.collectives.broadcast(tensor, 0, self.process_groups.dp)

    # ---- grad sync ----------------------------------------------------------------------------
    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: False makes backward only accumulate (as inside `no_sync()`)."""
        return self._backward_sync.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._backward_sync.require_sync = bool(value)
        for group in self.all_bucket_groups:
            group.is_last_microbatch = bool(value) or self._reduce_each

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads without reducing (all micro-batches but the last)."""
        before = self._backward_sync.require_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def deferred_grad_sync(self) -> AbstractContextManager[None]:
        """Backwards ending inside this block leave the grad sync to `finish_grad_sync()` (the
        last buckets' reductions overlap whatever runs before it; pipeline schedules use it).
        See [Note: grad sync at backward end]."""
        return self._backward_sync.deferred()

    def _on_grad(self) -> None:
        """Every param grad hook's first step: see [Note: grads the user changed] and [Note:
        grad sync at backward end]."""
        self._backward_seen = True
        self._sync_finished = False
        if self._grads.exposed:
            self._grads.begin_backward()
        self._backward_sync.on_grad()

    def _finish_backward(self) -> None:
        """The end-of-backward callback ([Note: grad sync at backward end]): the grad sync, or
        under reduce_each_microbatch inside no_sync() this micro-batch's reduction."""
        if self._backward_sync.require_sync:
            self.finish_grad_sync()
        else:
            self._microbatch_pending = True  # also when its forward ran with sync on
            self.finish_microbatch()

    def finish_microbatch(self) -> None:
        """optim_grads* with reduce_each_microbatch, a micro-batch inside no_sync(): dispatch
        what backward did not, wait, add every reduced shard into the grad shards and release
        the full buckets ([Note: sharded grad lifecycle]). Runs at the end of such a backward
        (or, when that backward's sync is deferred, at the next forward or finish_grad_sync);
        a no-op otherwise. Collective: every dp rank runs the same forwards."""
        if not self._microbatch_pending:
            return
        self._microbatch_pending = False
        self._reduce_and_wait()
        for group in self.all_bucket_groups:
            group.next_microbatch()
        for chain in self._chains:
            chain.reset()

    def _reduce_and_wait(self) -> None:
        """Dispatch what is left in chain order, wait for every group, learn arrival counts."""
        self.start_grad_sync()
        for chain in self._chains:
            for group in chain.groups:
                group.finish_grad_sync()
        for group in self.all_bucket_groups:
            group.learn_arrivals()

    def start_grad_sync(self) -> None:
        """Dispatch every reduction not yet dispatched, in chain order (e.g. from a pipeline's
        grad_sync_func). Collective: every dp rank must call it."""
        for chain in self._chains:
            chain.dispatch_rest()

    def finish_grad_sync(self) -> None:
        """Dispatch what backward did not (unused params are zero-filled), wait for every
        reduction, and hand out the grads: see [Note: grad contract]. Collective: every dp rank
        must call it once per iteration, unless backward already did (sync_grads_at_backward_end
        outside deferred_grad_sync()): it is a no-op while every group is synced."""
        self._microbatch_pending = False  # its grads are reduced with this sync's
        groups = self.all_bucket_groups
        # Every group SYNCED is not enough: under optim_grads* backward itself finishes the
        # groups whose reduction already landed (a race), and the agreements below (NaN check,
        # unused params) are collectives every dp rank must run once per iteration.
        if groups and self._sync_finished and self.unsynced_group() is None:
            return
        if self.timeline is not None:
            self.timeline.record(BACKWARD_END_GROUP_ID, "backward_end")
        self._structure.check(self.rank)
        self._reduce_and_wait()
        if self.ddp_config.check_for_nan_in_grad:
            pgs = self.process_groups
            raise_on_nonfinite_grads(
                self.all_bucket_groups, self.collectives, pgs.dp,
                dp_rank=pgs.dp_rank, dp_size=pgs.dp_size, rank=self.rank,
            )  # fmt: skip
        if self.ddp_config.error_on_unused_params:
            self._raise_on_unused_params()
        self._grads.expose()
        self._sync_finished = True

    def unsynced_group(self) -> BucketGroup | None:
        """A bucket group whose grads are not this iteration's reduced grads (its sync is not
        SYNCED: no finish_grad_sync() since zero_grad_buffer() or since a backward), or None."""
        return next(
            (g for g in self.all_bucket_groups if g.grad_state is not GradSyncState.SYNCED), None
        )

    def _raise_on_unused_params(self) -> None:
        device = params_device(self.param_to_name, self.process_groups.dp)
        raise_on_unused_params(
            self.all_bucket_groups, self.param_to_name, self.process_groups, self.collectives,
            device, self.rank,
        )  # fmt: skip

    def enable_timeline(self) -> Timeline:
        """Record when every bucket group became ready, was dispatched and finished, and a
        "backward_end" marker (group id -1) at the start of each finish_grad_sync(), into one
        shared `Timeline` (also `self.timeline`); `megabuf.overlap` turns it into a report.
        On CUDA params the events are timed CUDA events, resolved when `timeline.events` is
        read: see [Note: timeline on CUDA] in timeline.py."""
        timeline = Timeline(params_device(self.param_to_name, self.process_groups.dp))
        self.timeline = timeline
        for group in self.all_bucket_groups:
            group.set_timeline(timeline)
        return timeline

    def zero_grad_buffer(self) -> None:
        """Start a new iteration's grads: lazily, see [Note: grad accumulation into main_grad]
        (no pass over the buffer; each param's first grad overwrites its main_grad)."""
        for group in self.all_bucket_groups:
            group.reset()
        for chain in self._chains:
            chain.reset()
        for group in self.all_bucket_groups:
            group.is_last_microbatch = self._backward_sync.require_sync or self._reduce_each
        self._grads.clear()
        self._backward_sync.queued = False
        self._sync_finished = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as zero_grad_buffer(): grads live in the buffers, see [Note: grad accumulation
        into main_grad]."""
        del set_to_none
        self.zero_grad_buffer()

    def reset_iter_state(self) -> None:
        """Bring the engine back to a clean iteration start after an exception in forward,
        backward or between them (a bad batch, a caught OOM), without rebuilding it: in-flight
        grad reductions and param gathers are waited for (their grads are dropped), grads are
        zeroed and no_sync is left. Every dp rank must call it at the same point, like any
        other step of the loop, so the collectives already issued pair up."""
        for group in self.all_bucket_groups:
            group.abandon_grad_sync()
            if group.param_state is ParamSyncState.DISPATCHED:
                group.finish_param_sync(skip_next_bucket_dispatch=True)
        if self.param_units is not None:
            self.param_units.runtime.reset()
        self._backward_sync.require_sync = True
        self._microbatch_pending = False
        self.zero_grad_buffer()

    def scale_gradients(self, scaling_factor: float) -> None:
        for buf in self._all_buffers:
            buf.scale_gradients(scaling_factor)

    # ---- params -------------------------------------------------------------------------------
    def broadcast_params(self) -> None:
        """Copy dp-rank-0's params (expert params: expt_dp-rank-0's) and buffers to all ranks.
        Collective: every rank must call it. Under optim_grads_params the params are gathered,
        broadcast and written back into the shards."""
        if self.param_units is not None:
            with self.summon_full_params(writeback=True):
                self._broadcast_params()
            return
        self._broadcast_params()

    def _broadcast_params(self) -> None:
        pgs = self.process_groups
        with torch.no_grad():
            for _, param in _unique_named_parameters(self.module):
                group = pgs.expt_dp if is_expert_parallel(param) else pgs.dp
                self.collectives.broadcast(param.data, 0, group)
                # tell fp32 main-param holders the values changed (see reload_model_params)
                torch.autograd.graph.increment_version(param)
            for tensor in self.module.buffers():
                self.collectives.broadcast(tensor, 0, pgs.dp)

    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """After an optimizer step: gather params now (no overlap, or force_sync), or dispatch
        every group's gather, in the order the next forward reads them, and let the forward
        pre-hooks wait for each just in time ([Note: publishing params] in
        optimizer/distributed.py). `force_dispatch` is accepted for Megatron's callers; every
        gather is dispatched anyway. While torch.profiler records, gathers are synchronous: an
        async gloo collective started inside a profiled region and waited on after it crashes
        the process at exit. Collective: every dp rank calls it (the step does). A no-op under
        optim_grads_params: units gather lazily in forward ([Note: who gathers when])."""
        del unused, force_dispatch
        if self.param_units is not None:
            return
        if force_sync or not self.ddp_config.overlap_param_gather or profiler_recording():
            for group in self.all_bucket_groups:
                group.start_param_sync(force_sync=True)
            return
        for group in self.param_gather_hooks.forward_order or self.all_bucket_groups:
            group.start_param_sync()

    def publish_params(self) -> None:
        """Wait for every param gather in flight: call before reading params outside forward
        (evaluation code that bypasses forward, checkpoint saving); state_dict() calls it.
        Not collective: the step dispatched every gather on every rank, so one rank may call
        it alone (evaluation or saving on rank 0 only)."""
        for group in self.all_bucket_groups:
            group.finish_param_sync(skip_next_bucket_dispatch=True)

    def reshard_params(self) -> None:
        """optim_grads_params: finish every gather in flight and release every unit's full
        params (the optimizer does it before writing the shards). Not collective; a no-op under
        the other strategies."""
        if self.param_units is not None:
            self.param_units.runtime.release_all()

    @contextmanager
    def summon_full_params(self, *, writeback: bool = False) -> Iterator[None]:
        """Every param readable inside (optim_grads_params: every unit gathered, released on
        exit; `writeback=True` copies what was written into the params back into the shards).
        Read or edit params outside forward inside it: a released param has a 0-byte storage
        and reading it fails (a RuntimeError, or a crash of the process for some CPU kernels).
        Collective under optim_grads_params; elsewhere it publishes params (not collective)."""
        if self.param_units is None:
            self.publish_params()
            yield
            return
        with self.param_units.summon_full_params(writeback=writeback):
            yield

    def enable_forward_pre_hook(self) -> None:
        self.param_gather_hooks.enable()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        self.param_gather_hooks.disable()
        if param_sync:
            self.start_param_sync(force_sync=True)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The wrapped module's state dict (its keys, no `module.` prefix), after publishing
        params (not collective: rank 0 may call it alone, see publish_params). Under
        optim_grads_params the params are gathered unit by unit and copied out: collective
        (every dp rank calls it), keyword arguments only."""
        if self.param_units is not None:
            if args:
                raise ValueError(
                    "megabuf: state_dict() under optim_grads_params takes keyword arguments "
                    "only (destination=, prefix=)"
                )
            return self.param_units.state_dict(self.module, **kwargs)
        self.publish_params()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Copy values into the wrapped module's params and buffers (its keys). megabuf's
        optimizers notice the change (param versions) and reload their fp32 main params.
        Every dp rank must call it with the same state dict, or replicas differ. Under
        optim_grads_params every unit is gathered around the load (a full param copy at the
        peak) and the loaded values are written into the shards."""
        if assign:
            raise ValueError(
                "megabuf: load_state_dict(assign=True) would detach params from the buffers; "
                "use assign=False (values are copied into the existing params)"
            )
        with self.summon_full_params(writeback=True):
            return self.module.load_state_dict(state_dict, strict=strict)


def as_model_chunks(
    model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel], user: str
) -> list[DistributedDataParallel]:
    """One chunk or a list of chunks, each a megabuf DistributedDataParallel; `user` names the
    caller in the error."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError(f"megabuf: {user} got no model chunks")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, DistributedDataParallel):
            raise ValueError(
                f"megabuf: {user}: model chunk {i} is a {type(chunk).__name__}, not a "
                "megabuf.DistributedDataParallel; wrap every chunk before training"
            )
    return chunks


class _BufferList(list):  # type: ignore[type-arg]
    """A list of `_ParamAndGradBuffer` that, called, behaves like `nn.Module.buffers()`."""

    def __init__(self, items: list[_ParamAndGradBuffer], owner: nn.Module) -> None:
        super().__init__(items)
        self._owner = owner

    def __call__(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return nn.Module.buffers(self._owner, recurse)


def _unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """named_parameters() already drops shared params after their first name."""
    return list(module.named_parameters())
