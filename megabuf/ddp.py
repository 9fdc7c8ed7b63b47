"""`DistributedDataParallel`: wraps any nn.Module with contiguous grad buffers and bucket groups.

Its parts ([Note: import layers] in tests/test_import_graph.py; docs/ARCHITECTURE.md): the plan
(model_plan.py) and its allocation (assembly.py), the grad sync (grad_sync.py, [Note: step
phase]; what `.grad` holds: [Note: grad contract] in grads.py), the param side (param_sync.py,
[Note: who waits for param gathers]) and the comm-hook registry (hook_registry.py). The methods
here are construction, `forward` and thin calls into those parts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from megabuf import torch_compat
from megabuf.assembly import Assembly, assemble, rebucket
from megabuf.autobucket import AutoBucket
from megabuf.bucket_group import BucketGroup, Timeline
from megabuf.buffer import _ParamAndGradBuffer
from megabuf.collectives import Collectives
from megabuf.comm_hooks import build as build_comm_hook
from megabuf.comm_hooks.telemetry import HookReport
from megabuf.config import DistributedDataParallelConfig
from megabuf.devices import params_device
from megabuf.grad_sync import GradSync
from megabuf.grads import ExposedGrads, raise_on_unused_params, refuse_foreign_optimizers
from megabuf.hook_registry import CommHookRegistry
from megabuf.hooks import ParamGatherHooks, register_grad_hooks, remove_hooks_when_collected
from megabuf.model_plan import plan_model
from megabuf.nan_check import raise_on_nonfinite_grads
from megabuf.param_sync import GatheredParams, UnitParams
from megabuf.param_units import ParamUnits, unit_modules
from megabuf.plan import Plan
from megabuf.process_groups import ProcessGroups
from megabuf.replicas import (
    ParamStructure,
    check_devices,
    check_replicas_match,
    is_expert_parallel,
)
from megabuf.sharding.ledger import MemoryLedger

logger = logging.getLogger(__name__)


class DistributedDataParallel(nn.Module):
    """Megatron-style data parallelism for any module: grads accumulate into contiguous
    buffers (`param.main_grad` views) and are reduced bucket group by bucket group.

    Per step: `zero_grad_buffer()` (or the optimizer's `zero_grad()`); forward; backward,
    which finishes the grad sync (`sync_grads_at_backward_end`; otherwise call
    `finish_grad_sync()`); optimizer step (README "Quickstart", docs/gradient-contract.md and
    docs/porting-from-torch-ddp.md). Construction is collective: every rank of the process groups
    must wrap the same model (checked; raises naming the first difference), and dp-rank 0's
    params and buffers are broadcast to the others.

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
            [Note: torch DDP arguments] in torch_compat.py and docs/porting-from-torch-ddp.md.
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
        self._disable_bucketing = disable_bucketing
        self.collectives = collectives if collectives is not None else Collectives()
        self._sync_buffers_in_forward = options.sync_buffers_in_forward
        self.rank = self.process_groups.topology.rank
        self._sharding = self.ddp_config.sharding  # [Note: sharding strategy objects]
        self.memory_ledger = MemoryLedger()  # [Note: sharded grad lifecycle]
        self._build(options.init_sync)
        if self.ddp_config.comm_hook is not None:
            spec = dict(self.ddp_config.comm_hook)
            buffers = spec.pop("buffers", "all")
            self.register_comm_hook(build_comm_hook(spec), buffers=buffers)
        if self.ddp_config.deterministic_reduction:
            self._hooks.install_deterministic()
        self._auto: AutoBucket | None = None  # [Note: auto bucket re-plan]
        if self.ddp_config.bucket_size == "auto":
            device = params_device(self.param_to_name, self.process_groups.dp)
            self._auto = AutoBucket(
                list((n, p) for p, n in self.param_to_name.items()), self.ddp_config,
                self.collectives, self.process_groups.dp, device, self,
            )  # fmt: skip
            self._sync.on_backward_end = self._auto.on_backward_end

    @property
    def all_bucket_groups(self) -> list[BucketGroup]:
        """Dense then expert bucket groups."""
        return self.bucket_groups + self.expert_parallel_bucket_groups

    # ---- construction -------------------------------------------------------------------------
    def _build(self, init_sync: bool) -> None:
        pgs = self.process_groups
        named = _unique_named_parameters(self.module)
        check_devices(named)
        check_replicas_match(named, pgs.dp, self.collectives)
        planned = plan_model(  # the same path as `megabuf inspect`
            self.module, self.ddp_config, dp_size=pgs.dp_size,
            expt_dp_size=pgs.topology.expt_dp_size, expert_shares_dp_group=pgs.expt_dp is pgs.dp,
            disable_bucketing=self._disable_bucketing,
        )  # fmt: skip
        trainable = planned.trainable
        self.param_to_name = {p: n for n, p in trainable}
        params = [p for _, p in trainable]
        self.plan: Plan = planned.plan
        # (name, module) per shard unit, the root first ([Note: shard units])
        units = unit_modules(self.module, planned.unit_plan)
        built = assemble(
            self.plan, params, self.ddp_config, pgs, self.collectives, self.memory_ledger,
            self.param_to_name, [name for name, _ in units],
        )  # fmt: skip
        self._all_buffers: list[_ParamAndGradBuffer] = built.buffers  # plan order
        expert = [planned.expert for planned in self.plan.buffers]
        # Megatron's attribute name. It would shadow nn.Module.buffers(), so the list is also
        # callable: `model.buffers` is the grad buffers, `model.buffers()` the module buffers.
        self.buffers = _BufferList(  # type: ignore[method-assign,assignment]
            [b for b, e in zip(self._all_buffers, expert) if not e], self
        )
        self.expert_parallel_buffers = [b for b, e in zip(self._all_buffers, expert) if e]
        self._module_buffers = list(self.module.buffers())
        self._wire(built, params)
        if init_sync:
            self.broadcast_params()
        if self._sharding.shards_params:
            runtime = ParamUnits.build(  # shards filled, full params released
                units, self.plan, self.all_bucket_groups, self.param_to_name, self.ddp_config,
                self.memory_ledger, self.rank,
            )  # fmt: skip
            self.param_side: GatheredParams = UnitParams(
                self.all_bucket_groups, self._param_gather_hooks, self.ddp_config, runtime
            )
        for buf in self._all_buffers:
            logger.debug("megabuf: %s", buf.describe())

    def _wire(self, built: Assembly, params: list[nn.Parameter]) -> None:
        """Everything built on the bucket groups: at construction, and again at the auto
        bucket re-plan ([Note: auto bucket re-plan] in autobucket.py)."""
        expert_group = [planned.expert for planned in self.plan.groups]
        self.bucket_groups = [g for g, e in zip(built.groups, expert_group) if not e]
        self.expert_parallel_bucket_groups = [g for g, e in zip(built.groups, expert_group) if e]
        self.param_to_bucket_group = {p: g for g in built.groups for p in g.params_list}
        chains = built.chains
        grads = self._exposed_grads(params)
        structure = ParamStructure(self.module)
        self._sync = GradSync(
            self.all_bucket_groups, chains, self.ddp_config, grads,
            before_sync=lambda: structure.check(self.rank), checks=self._sync_checks(),
        )  # fmt: skip
        self._grad_hook_handles = register_grad_hooks(
            params, self.param_to_bucket_group, set(grads.linked), self._on_grad
        )
        for group in self.all_bucket_groups:  # the hooks hold the views: guard the attribute
            if group.sharded_grads is not None:
                names = [self.param_to_name[p] for p in group.params_list]
                group.sharded_grads.guard_main_grads(group.params_list, names)
        self._param_gather_hooks = ParamGatherHooks(self.module, self.param_to_bucket_group)
        if self.ddp_config.overlap_param_gather:
            self._param_gather_hooks.enable()
        remove_hooks_when_collected(self, self._grad_hook_handles, self._param_gather_hooks)
        groups, hooks, cfg = self.all_bucket_groups, self._param_gather_hooks, self.ddp_config
        # the param side (megabuf/param_sync.py): what the optimizer tells before and after a
        # step (`before_step()`, `stepped()`) and what the param methods below call
        self.param_side = GatheredParams(groups, hooks, cfg)
        self._hooks = CommHookRegistry(
            self.all_bucket_groups, self.plan, self.ddp_config, self.memory_ledger, self.rank
        )

    def _replan_buckets(self) -> None:
        """bucket_size="auto": the one re-plan, at a step boundary (grads zero); see [Note: auto
        bucket re-plan] in autobucket.py. Collective over dp."""
        auto, self._auto = self._auto, None
        hooks = self._hooks.comm_hooks()
        if auto is None or hooks:
            raise RuntimeError(
                f'megabuf: bucket_size="auto" cannot re-plan buckets with comm hooks {hooks} '
                f"registered (their state follows the bucket boundaries; rank {self.rank}): "
                "register them after the warm-up, or give an int bucket_size"
            )
        pgs = self.process_groups
        if self._sync.timeline is not None:  # the overlap report says where the plan changed
            self._sync.timeline.record(-1, "replan")
        self._rebuild(auto.replan(
            self.plan, dp_size=pgs.dp_size, expt_dp_size=pgs.topology.expt_dp_size,
            expert_shares_dp_group=pgs.expt_dp is pgs.dp,
        ))  # fmt: skip

    def _rebuild(self, plan: Plan) -> None:
        """Rebuild the buckets of `plan` (boundaries only) in place; grads must be zero."""
        self.plan, pgs, sync = plan, self.process_groups, self._sync
        for handle in self._grad_hook_handles:
            handle.remove()
        self._param_gather_hooks.disable()
        built = rebucket(
            self.plan, self._all_buffers, self.ddp_config, pgs, self.collectives,
            self.memory_ledger, self.param_to_name,
        )  # fmt: skip
        self._wire(built, list(self.param_to_name))
        self._sync.require_sync = sync.require_sync
        if sync.timeline is not None:
            self._sync.enable_timeline(sync.timeline)

    def _exposed_grads(self, params: Sequence[nn.Parameter]) -> ExposedGrads:
        """[Note: grad contract]: nothing is exposed with the distributed optimizer."""
        if not self._sharding.exposes_grads:
            refuse_foreign_optimizers(self.param_to_name)
            return ExposedGrads([], [], self.param_to_bucket_group)
        same = [p for p in params if p.main_grad.dtype == p.dtype]  # type: ignore[attr-defined]
        other = [p for p in params if p.main_grad.dtype != p.dtype]  # type: ignore[attr-defined]
        return ExposedGrads(same, other, self.param_to_bucket_group)

    def _sync_checks(self) -> list[Callable[[], None]]:
        """What the grad sync checks once every reduction landed (each raises on every rank)."""
        checks: list[Callable[[], None]] = []
        if self.ddp_config.check_for_nan_in_grad:
            checks.append(self._raise_on_nonfinite_grads)
        if self.ddp_config.error_on_unused_params:
            checks.append(self._raise_on_unused_params)
        return checks

    def _raise_on_nonfinite_grads(self) -> None:
        pgs = self.process_groups
        raise_on_nonfinite_grads(
            self.all_bucket_groups, self.collectives, pgs.dp,
            dp_rank=pgs.dp_rank, dp_size=pgs.dp_size, rank=self.rank,
            pp_group=pgs.pp, pp_rank=pgs.pp_rank, pp_size=pgs.pp_size,
        )  # fmt: skip

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward. A training forward (grad enabled, grad sync on) first
        broadcasts dp-rank 0's module buffers (`broadcast_buffers`, torch's default; collective),
        and its outputs arm the end-of-backward grad sync."""
        self._before_forward(torch.compiler.is_compiling())
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._sync.watch(output)
        return output

    @torch.compiler.disable
    def _before_forward(self, compiling: bool) -> None:
        """Runs eagerly even when this model is compiled (`compiling`: it is being traced)."""
        self._sync.before_forward(torch.is_grad_enabled())
        self.param_side.before_forward(self.module, compiling)
        sync_on = self._sync.require_sync
        if self._sync_buffers_in_forward and torch.is_grad_enabled() and sync_on:
            with torch.no_grad():
                for tensor in self._module_buffers:
                    self.collectives.broadcast(tensor, 0, self.process_groups.dp)

    # ---- grad sync: thin calls into GradSync ([Note: step phase] in grad_sync.py) ------------
    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: False makes backward only accumulate (as inside `no_sync()`)."""
        return self._sync.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync.require_sync = value

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate grads without reducing (all micro-batches but the last)."""
        return self._sync.no_sync()

    def deferred_grad_sync(self) -> AbstractContextManager[None]:
        """Backwards ending inside this block leave the grad sync to `finish_grad_sync()` (the
        last buckets' reductions overlap whatever runs before it; pipeline schedules use it).
        See [Note: grad sync at backward end]."""
        return self._sync.deferred()

    def _on_grad(self) -> None:
        """Every param grad hook's first step (hot path)."""
        self._hooks.backward_seen = True
        self._sync.on_grad()

    def finish_microbatch(self) -> None:
        """optim_grads* with reduce_each_microbatch, a micro-batch inside no_sync(): dispatch
        what backward did not, wait, add every reduced shard into the grad shards and release
        the full buckets ([Note: sharded grad lifecycle]). Runs at the end of such a backward
        (or, when that backward's sync is deferred, at the next forward or finish_grad_sync);
        a no-op otherwise. Collective: every dp rank runs the same forwards."""
        self._sync.finish_microbatch()

    def start_grad_sync(self) -> None:
        """Dispatch every reduction not yet dispatched, in chain order (e.g. from a pipeline's
        grad_sync_func). Collective: every dp rank must call it."""
        self._sync.start()

    def finish_grad_sync(self) -> None:
        """Dispatch what backward did not (unused params are zero-filled), wait for every
        reduction, and hand out the grads: see [Note: grad contract]. Collective: every dp rank
        must call it once per iteration, unless backward already did (sync_grads_at_backward_end
        outside deferred_grad_sync()): it is a no-op while every group is synced."""
        self._sync.finish()

    def unsynced_group(self) -> BucketGroup | None:
        """A bucket group whose grads are not this iteration's reduced grads (its sync is not
        SYNCED: no finish_grad_sync() since zero_grad_buffer() or since a backward), or None."""
        return self._sync.unsynced_group()

    def _raise_on_unused_params(self) -> None:
        device = params_device(self.param_to_name, self.process_groups.dp)
        raise_on_unused_params(
            self.all_bucket_groups, self.param_to_name, self.process_groups, self.collectives,
            device, self.rank,
        )  # fmt: skip

    @property
    def timeline(self) -> Timeline | None:
        """The timeline `enable_timeline()` made, or None."""
        return self._sync.timeline

    def enable_timeline(self) -> Timeline:
        """Record when every bucket group became ready, was dispatched and finished, and a
        "backward_end" marker (group id -1) at the start of each finish_grad_sync(), into one
        shared `Timeline` (also `self.timeline`); `megabuf.overlap` turns it into a report.
        On CUDA params the events are timed CUDA events, resolved when `timeline.events` is
        read: see [Note: timeline on CUDA] in timeline.py."""
        timeline = Timeline(params_device(self.param_to_name, self.process_groups.dp))
        self._sync.enable_timeline(timeline)
        return timeline

    def zero_grad_buffer(self) -> None:
        """Start a new iteration's grads: lazily, see [Note: grad accumulation into main_grad]
        (no pass over the buffer; each param's first grad overwrites its main_grad). With
        bucket_size="auto", after the warm-up also the one re-plan ([Note: auto bucket re-plan])."""
        self._sync.zero()
        if self._auto is not None and self._auto.due:
            self._replan_buckets()

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
        self.param_side.reset()
        self._sync.abandon()

    def scale_gradients(self, scaling_factor: float) -> None:
        for buf in self._all_buffers:
            buf.scale_gradients(scaling_factor)

    # ---- params -------------------------------------------------------------------------------
    def broadcast_params(self) -> None:
        """Copy dp-rank-0's params (expert params: expt_dp-rank-0's) and buffers to all ranks.
        Collective: every rank must call it. Under optim_grads_params the params are gathered,
        broadcast and written back into the shards."""
        with self.summon_full_params(writeback=True):  # waits for gathers in flight
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
        """After an optimizer step (the step calls it): dispatch every group's param gather, in
        the order the next forward reads them, for the forward pre-hooks to wait on just in time
        ([Note: publishing params] in optimizer/distributed.py); without overlap_param_gather,
        or while torch.profiler records, gather synchronously (an async gloo collective started
        inside a profiled region and waited on after it crashes the process at exit).

        `force_sync=True` (Megatron's idiom before evaluation or checkpointing): on return every
        param on this rank holds the gathered values of the last step; gathers in flight are
        waited for, stale ones gathered now ([Note: who waits for param gathers]). Positional
        arguments (Megatron's schedules pass the chunk's params) and `force_dispatch` are
        accepted and change nothing: every gather is dispatched anyway. Collective when a group
        is stale (only inside the step); otherwise it only waits. Under optim_grads_params a
        no-op: params are shards between forwards, and forward, `state_dict()` and
        `summon_full_params()` gather them ([Note: who gathers when])."""
        del unused, force_dispatch
        self.param_side.start(force_sync)

    def publish_params(self) -> None:
        """Wait for every param gather in flight: call before reading params outside forward
        (evaluation code that bypasses forward, checkpoint saving); state_dict() calls it.
        Not collective: the step dispatched every gather on every rank, so one rank may call
        it alone (evaluation or saving on rank 0 only)."""
        self.param_side.publish()

    def reshard_params(self) -> None:
        """optim_grads_params: finish every gather in flight and release every unit's full
        params (the optimizer does it before writing the shards). Not collective; a no-op under
        the other strategies."""
        self.param_side.reshard()

    @contextmanager
    def summon_full_params(self, *, writeback: bool = False) -> Iterator[None]:
        """Every param readable inside (optim_grads_params: every unit gathered, released on
        exit; `writeback=True` copies what was written into the params back into the shards).
        Read or edit params outside forward inside it: a released param has a 0-byte storage
        and reading it fails (a RuntimeError, or a crash of the process for some CPU kernels).
        Collective under optim_grads_params; elsewhere it publishes params (not collective)."""
        with self.param_side.summon(writeback=writeback):
            yield

    def enable_forward_pre_hook(self) -> None:
        """Megatron's: forwards wait for each param gather just before its first reader again
        (overlap_param_gather)."""
        self._param_gather_hooks.enable()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Megatron's, before evaluation or checkpointing: no per-module waits in forward. With
        `param_sync=True` every param holds the last step's gathered values on return
        (`start_param_sync(force_sync=True)`); with False params are left as they are, and
        the next forward still waits for every gather in flight before running the module, so
        it never reads a param mid-gather ([Note: who waits for param gathers])."""
        self._param_gather_hooks.disable()
        if param_sync:
            self.start_param_sync(force_sync=True)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The wrapped module's state dict (its keys, no `module.` prefix), after publishing
        params (not collective: rank 0 may call it alone, see publish_params). Under
        optim_grads_params the params are gathered unit by unit and copied out: collective
        (every dp rank calls it), keyword arguments only."""
        return self.param_side.state_dict(self.module, args, kwargs)

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

    # ---- communication hooks ([Note: comm hook contract] in comm_hooks/contract.py) -----------
    def register_comm_hook(self, hook: object, *, buffers: str = "all") -> None:
        """Reduce the `buffers` ("dense", "expert" or "all") buckets with `hook` instead of the
        engine's collective (the built-ins: `megabuf.comm_hooks`). Once per kind, before the
        first backward; every rank must register the same hook."""
        self._hooks.register_comm_hook(hook, buffers=buffers)

    def comm_hooks(self) -> dict[str, object]:
        """The registered comm hooks: "dense" / "expert" -> hook (a hook registered for "all"
        appears under both; a kind without a hook or without buffers is absent).
        `save_checkpoint` saves the state of those with `state_dict()`."""
        return self._hooks.comm_hooks()

    def notify_comm_hooks_step_skipped(self) -> None:
        """The optimizer skipped the step whose grads the hooks just reduced (inf/NaN): each
        hook's optional `on_step_skipped()` runs (PowerSGD drops its residuals and Q). megabuf's
        optimizers call it; with torch's GradScaler, call it on every rank when
        `scaler.step(opt)` skipped."""
        self._hooks.notify_comm_hooks_step_skipped()

    def notify_comm_hooks_loss_scale_changed(self, ratio: float) -> None:
        """The loss scale was multiplied by `ratio` (new / old): each hook's optional
        `on_loss_scale_change(ratio)` runs (PowerSGD rescales its residuals). megabuf's
        optimizers call it; with torch's GradScaler, call it on every rank after
        `scaler.update()` changed `scaler.get_scale()`."""
        self._hooks.notify_comm_hooks_loss_scale_changed(ratio)

    def comm_hook_report(self, *, reset: bool = False) -> HookReport:
        """Wire bytes and calls each registered comm hook issued, per bucket, since the last
        reset ([Note: hook wire bytes] in megabuf/comm_hooks/telemetry.py)."""
        return self._hooks.comm_hook_report(reset=reset)


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
