"""`Engine`: what one `DistributedDataParallel` is made of, built once, reachable as `model.engine`.

The wrapper (ddp.py) is the public face: `forward` and one thin door per act. Everything the
optimizer, checkpoints, pipelines, `megabuf inspect` and the tests need beyond that lives here,
as plain attributes of one object rather than members of the nn.Module:

    plan, topology, rank           the pure plan (plan.py) and this rank's place in the groups
    process_groups, collectives    the groups reduced over and the one collectives layer
    buffers                        every `_ParamAndGradBuffer`, plan order (dense and expert)
    dense_buffers, expert_parallel_buffers       the same split by kind (Megatron's names)
    bucket_groups, expert_parallel_bucket_groups, all_bucket_groups (dense then expert)
    param_to_name, param_to_bucket_group
    sparse_grads                   the params kept outside the buffers, their grads sparse
                                   ([Note: sparse grads outside the buffer] in sparse_grads.py)
    sync                           the grad sync (grad_sync.py, [Note: step phase])
    param_side                     the param side (param_sync.py, [Note: who waits for param
                                   gathers]); the optimizer calls `before_step()` / `stepped()`
    hooks                          the comm-hook registry (hook_registry.py): the registered hooks,
                                   their step-skipped / loss-scale notifications, the wire report
    memory_ledger                  device bytes by category ([Note: sharded grad lifecycle])
    residency                      whether the engine is offloaded; every entry point asks it
                                   ([Note: offloaded engine] in residency.py)
    auto                           bucket_size="auto": the warm-up watcher and, after its one
                                   re-plan, what it chose (autobucket.py, [Note: auto bucket
                                   re-plan]); else None

Construction order: plan (shared with `megabuf inspect`, model_plan.py) -> allocation
(assembly.py) -> grad sync + grad hooks -> param side (+ the ZeRO-3 units, after the initial
broadcast) -> comm hooks from the config. Everything built on the bucket groups (`_wire`) is
built again by the auto bucket re-plan (over the same buffers; sharded: new ones).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from megabuf.arrivals import countable, weak_callable
from megabuf.assembly import Assembly, assemble, rebucket
from megabuf.autobucket import AutoBucket
from megabuf.bucket_group import BucketGroup, Timeline
from megabuf.buffer import _ParamAndGradBuffer
from megabuf.collectives import Collectives
from megabuf.comm_hooks import build as build_comm_hook
from megabuf.config import DistributedDataParallelConfig
from megabuf.devices import params_device
from megabuf.dist_autograd import refuse_dist_autograd
from megabuf.grad_sync import GradSync, SyncPhase
from megabuf.grads import ExposedGrads, raise_on_unused_params, refuse_foreign_optimizers
from megabuf.hook_registry import CommHookRegistry
from megabuf.hooks import ParamGatherHooks, register_grad_hooks, remove_hooks_when_collected
from megabuf.microbatches import AgreementGroups, MicrobatchAgreement
from megabuf.model_plan import plan_model, trainable_params
from megabuf.nan_check import raise_on_nonfinite_grads
from megabuf.param_sync import GatheredParams, UnitParams
from megabuf.param_units import ParamUnits, unit_modules
from megabuf.plan import Plan
from megabuf.process_groups import ProcessGroups
from megabuf.replicas import ParamStructure, check_devices, check_replicas_match, is_expert_parallel
from megabuf.residency import Residency
from megabuf.sharded_replan import (
    ReplanListeners,
    release_old_groups,
    replan_shortfall,
    retire_old_params,
)
from megabuf.sharding.ledger import MemoryLedger
from megabuf.sparse_grads import SparseGrads

logger = logging.getLogger(__name__)


class Engine:
    """The parts of one wrapped model (see the module docstring). Built by
    `DistributedDataParallel`; collective (every rank of `process_groups` builds the same)."""

    def __init__(
        self,
        module: nn.Module,
        config: DistributedDataParallelConfig,
        process_groups: ProcessGroups,
        collectives: Collectives,
        *,
        disable_bucketing: bool,
        init_sync: bool,
        check_replicas: bool = True,
    ) -> None:
        self.module = module
        self.config = config
        self.process_groups = process_groups
        self.topology = process_groups.topology
        self.rank = self.topology.rank
        self.collectives = collectives
        collectives.name_groups(process_groups.named())  # [Note: wire accounting by group]
        self.memory_ledger = MemoryLedger()  # [Note: sharded grad lifecycle]
        self.residency = Residency(self.rank)  # [Note: offloaded engine]
        self.replan_listeners = ReplanListeners(self.rank)  # [Note: sharded auto bucket re-plan]
        self.disable_bucketing = disable_bucketing
        # False: an unpickled copy, built without a collective ([Note: pickling a wrapped model])
        self._check_replicas = check_replicas
        self._build(disable_bucketing, init_sync)
        if config.comm_hook is not None:
            spec = dict(config.comm_hook)
            buffers = spec.pop("buffers", "all")
            self.hooks.register_comm_hook(build_comm_hook(spec), buffers=buffers)
        if config.deterministic_reduction:
            self.hooks.install_deterministic()
        self.auto: AutoBucket | None = None  # [Note: auto bucket re-plan]
        if config.bucket_size == "auto":
            self.auto = AutoBucket(
                [(n, p) for p, n in self.param_to_name.items()], config, collectives,
                process_groups.dp, self.device, self,
            )  # fmt: skip
            self.sync.on_backward_end = self.auto.on_backward_end
            self.sync.on_synced = self.auto.on_synced

    # ---- construction -------------------------------------------------------------------------
    def _build(self, disable_bucketing: bool, init_sync: bool) -> None:
        pgs, cfg = self.process_groups, self.config
        named = list(self.module.named_parameters())  # shared params once, under their first name
        if self.topology.pp_size == 1:  # a pipeline's model chunk may hold no params
            trainable_params(self.module, self.rank)  # refused before the first collective
        check_devices(named)
        if self._check_replicas:
            check_replicas_match(named, pgs.dp, self.collectives)
        planned = plan_model(  # the same path as `megabuf inspect`
            # laid out over the group a buffer is sharded over: dp, or the shard group
            self.module, cfg, dp_size=self.topology.sharding(False)[1],
            expt_dp_size=self.topology.sharding(True)[1],
            expert_shares_dp_group=pgs.expt_dp is pgs.dp, disable_bucketing=disable_bucketing,
        )  # fmt: skip
        self.param_to_name: dict[nn.Parameter, str] = {p: n for n, p in planned.trainable}
        self._params = [p for _, p in planned.trainable]
        # [Note: sparse grads outside the buffer]: in no buffer, all-reduced at the sync
        self.sparse_grads = SparseGrads(planned.sparse, self.collectives, pgs.dp, pgs.dp_size)
        self.plan: Plan = planned.plan
        self.param_side: GatheredParams  # set by _wire (UnitParams under optim_grads_params)
        units = unit_modules(self.module, planned.unit_plan)  # (name, module), root first
        built = assemble(
            self.plan, self._params, cfg, pgs, self.collectives, self.memory_ledger,
            self.param_to_name, [name for name, _ in units],
        )  # fmt: skip
        self._module_buffers = list(self.module.buffers())  # what forward broadcasts
        self._wire(built)
        if init_sync:
            self.broadcast_params()
        if cfg.sharding.shards_params:
            self._shard_params(units)
        for buf in self.buffers:
            logger.debug("megabuf: %s", buf.describe())

    def _shard_params(self, units: list[tuple[str, nn.Module]]) -> None:
        """optim_grads_params: fill the shards from the whole params, release these, install the
        unit hooks; after the initial broadcast, and again at the auto bucket re-plan."""
        cfg, groups = self.config, self.all_bucket_groups
        built = ParamUnits.build(
            units, self.plan, groups, self.param_to_name, cfg, self.memory_ledger, self.rank
        )
        built.runtime.entry_guard = self.residency.check
        self.param_side = UnitParams(groups, self.gather_hooks, cfg, built)

    def _wire(self, built: Assembly) -> None:
        """Everything built on the bucket groups: at construction, and again at the auto bucket
        re-plan ([Note: auto bucket re-plan] in autobucket.py; [Note: sharded auto bucket
        re-plan] in sharded_replan.py)."""
        cfg = self.config
        self._split_by_kind(built.buffers, built.groups)
        grads = self._exposed_grads(self._params)
        structure = ParamStructure(self.module)
        self.sync = GradSync(
            self.all_bucket_groups, built.chains, cfg, grads,
            before_sync=lambda: structure.check(self.rank), checks=self._sync_checks(),
            agreement=self._microbatch_agreement(), outside=self.sparse_grads,
        )  # fmt: skip
        self._install_hooks(self._params, grads)
        self.param_side = GatheredParams(self.all_bucket_groups, self.gather_hooks, cfg)
        self.hooks: CommHookRegistry = CommHookRegistry(
            self.all_bucket_groups, self.plan, cfg, self.memory_ledger, self.rank
        )

    def zero_grad_buffer(self) -> None:
        """A new iteration's grads (lazily: [Note: grad accumulation into main_grad]); with
        bucket_size="auto", after the warm-up also the one re-plan."""
        quiet = self.auto is not None and self.auto.quiet_next
        self.sync.zero(defer_dispatch=quiet)
        if quiet:
            self.auto.begin_quiet()  # type: ignore[union-attr]
        # not inside no_sync(): its exit would restore the flag of the replaced grad sync
        if self.auto is not None and self.auto.due and self.sync.require_sync:
            self._replan_buckets(self.auto)

    def register_comm_hook(self, hook: object, buffers: str) -> None:
        """The registry's, refused while a bucket_size="auto" re-plan is pending (a hook's state
        follows the bucket boundaries the re-plan changes)."""
        if self.auto is not None and not self.auto.replanned:
            raise RuntimeError(
                f'megabuf: cannot register comm hook {hook!r} before the bucket_size="auto" '
                f"re-plan (after {self.config.auto_bucket_warmup_steps} steps; rank "
                f"{self.rank}): a hook's state follows the bucket boundaries; register it after "
                "the re-plan, before the next backward, or give an int bucket_size"
            )
        self.hooks.register_comm_hook(hook, buffers=buffers)

    def _replan_buckets(self, auto: AutoBucket) -> None:
        """The one re-plan, at a step boundary with every grad zero ([Note: auto bucket
        re-plan]); collective over dp."""
        hooks = self.hooks.comm_hooks()  # registered around `register_comm_hook`'s check
        if hooks:
            raise RuntimeError(
                f'megabuf: bucket_size="auto" cannot re-plan buckets with comm hooks {hooks} '
                f"registered (their state follows the bucket boundaries; rank {self.rank}): "
                "register them after the warm-up, or give an int bucket_size"
            )
        pgs = self.process_groups
        if self.sync.timeline is not None:  # the overlap report says where the plan changed
            self.sync.timeline.record(-1, "replan")
        plan = auto.replan(
            self.plan, dp_size=self.topology.sharding(False)[1],
            expt_dp_size=self.topology.sharding(True)[1],
            expert_shares_dp_group=pgs.expt_dp is pgs.dp,
        )  # fmt: skip
        if auto.kept:  # the boundaries that ran: nothing to rebuild
            return
        if self.config.sharding.shards_optimizer:  # new buffers beside the old ones
            short = replan_shortfall(
                self.buffers, self.all_bucket_groups, self.device, self.collectives, pgs.dp
            )
            if short:
                auto.keep(
                    f"the sharded re-plan needs {short / 2**30:.2f} GiB more device memory than "
                    "a dp rank has free (new buffers beside the old ones); give an int "
                    "bucket_size to silence this"
                )
                return
        self.rebucket(plan)

    def rebucket(self, plan: Plan) -> None:
        """Rebuild on `plan` (the same params; other bucket boundaries) at a step boundary with
        every grad zero: in place over the same buffers ([Note: auto bucket re-plan]), or, under
        a sharded strategy, on new buffers with the optimizer's state carried across ([Note:
        sharded auto bucket re-plan] in sharded_replan.py)."""
        if self.config.sharding.shards_optimizer:
            self.replan_listeners.run(lambda: self._rewire(plan, sharded=True))
        else:
            self._rewire(plan, sharded=False)

    def _rewire(self, plan: Plan, sharded: bool) -> None:
        timeline = self.sync.timeline
        for handle in self._grad_hook_handles:
            handle.remove()
        self.gather_hooks.disable()
        parts = (self.config, self.process_groups, self.collectives, self.memory_ledger,
                 self.param_to_name)  # fmt: skip
        units: list[tuple[str, nn.Module]] = []
        if sharded:  # new buffers, params copied in ([Note: sharded auto bucket re-plan])
            old = self.all_bucket_groups
            units = release_old_groups(old, self.param_side, self.memory_ledger, self.rank)
            built = assemble(plan, self._params, *parts, [name for name, _ in units] or ("",))
            retire_old_params(old)
        else:  # the same buffers, other boundaries
            built = rebucket(plan, self.buffers, *parts)
        self.plan = plan
        self._wire(built)
        if units:  # optim_grads_params: the new groups sharded, the unit hooks on them
            self._shard_params(units)
        if timeline is not None:
            self.sync.enable_timeline(timeline)

    def _split_by_kind(self, buffers: list[_ParamAndGradBuffer], groups: list[BucketGroup]) -> None:
        self.buffers = buffers  # plan order
        expert = [planned.expert for planned in self.plan.buffers]
        self.dense_buffers = [b for b, e in zip(buffers, expert) if not e]
        self.expert_parallel_buffers = [b for b, e in zip(buffers, expert) if e]
        expert_group = [planned.expert for planned in self.plan.groups]
        self.bucket_groups = [g for g, e in zip(groups, expert_group) if not e]
        self.expert_parallel_bucket_groups = [g for g, e in zip(groups, expert_group) if e]
        self.all_bucket_groups = self.bucket_groups + self.expert_parallel_bucket_groups
        self.param_to_bucket_group = {p: g for g in groups for p in g.params_list}

    def _install_hooks(self, params: Sequence[nn.Parameter], grads: ExposedGrads) -> None:
        self._grad_hook_handles = register_grad_hooks(
            params, self.param_to_bucket_group, set(grads.linked), self._on_grad,
            self.sync.in_backward,
        )  # fmt: skip
        # after the dense ones: _count_arrivals finds those by position
        self._grad_hook_handles += self.sparse_grads.install_hooks(
            self._on_grad, self.sync.in_backward
        )
        for group in self.all_bucket_groups:  # the hooks hold the views: guard the attribute
            if group.sharded_grads is not None:
                names = [self.param_to_name[p] for p in group.params_list]
                group.sharded_grads.guard_main_grads(group.params_list, names)
        self.gather_hooks = ParamGatherHooks(self.module, self.param_to_bucket_group)
        if self.config.overlap_param_gather:
            self.gather_hooks.enable()
        remove_hooks_when_collected(self, self._grad_hook_handles, self.gather_hooks)
        self.sync.on_first_sync = weak_callable(self._count_arrivals)  # no engine cycle

    def _count_arrivals(self) -> None:
        """After the first sync, the groups that can count their grads without a Python call
        each get counted hooks instead ([Note: counted arrivals] in arrivals.py)."""
        cfg, handles = self.config, self._grad_hook_handles
        small = {p for p, _ in self.sync.grads.small}
        position = {p: k for k, p in enumerate(self._params)}
        bookkeeping = weak_callable(self._on_grad)  # [Note: hooks hold the engine weakly]
        for group in self.all_bucket_groups:
            total = group.expected_total
            if not countable(group, small, cfg.error_on_unused_params) or (
                cfg.overlap_grad_reduce and not total
            ):
                continue
            hook = group.count_arrivals(total, bookkeeping, self.sync.in_backward)
            for param in group.params_list:
                handles[position[param]].remove()
                handles[position[param]] = param.register_post_accumulate_grad_hook(hook)

    def _exposed_grads(self, params: Sequence[nn.Parameter]) -> ExposedGrads:
        """[Note: grad contract]: nothing is exposed with the distributed optimizer."""
        if not self.config.sharding.exposes_grads:
            refuse_foreign_optimizers(self.param_to_name)
            return ExposedGrads([], [], self.param_to_bucket_group)
        same = [p for p in params if p.main_grad.dtype == p.dtype]  # type: ignore[attr-defined]
        other = [p for p in params if p.main_grad.dtype != p.dtype]  # type: ignore[attr-defined]
        return ExposedGrads(same, other, self.param_to_bucket_group)

    def _sync_checks(self) -> list[Callable[[], None]]:
        """What the grad sync checks once every reduction landed (each raises on every rank)."""
        checks: list[Callable[[], None]] = []
        if self.config.check_for_nan_in_grad:
            checks.append(self._raise_on_nonfinite_grads)
        if self.config.error_on_unused_params:
            checks.append(self._raise_on_unused_params)
        return checks

    def _microbatch_agreement(self) -> MicrobatchAgreement | None:
        """[Note: micro-batch agreement], in the modes that communicate every micro-batch."""
        cfg, pgs = self.config, self.process_groups
        each = (
            cfg.sharding.shards_grads and cfg.sharded_grad_accumulation == "reduce_each_microbatch"
        )
        group_rank, group_size = self.topology.sharding(False)
        if not (each or cfg.sharding.shards_params) or group_size == 1:
            return None
        mode = (
            "sharded_grad_accumulation='reduce_each_microbatch'" if each
            else f"data_parallel_sharding_strategy={cfg.sharding.name!r}"
        )  # fmt: skip
        groups = AgreementGroups(
            group=pgs.shard_group(False), group_rank=group_rank, group_size=group_size,
            dp=pgs.dp, dp_rank=pgs.dp_rank, dp_size=pgs.dp_size, hybrid=pgs.hybrid,
        )  # fmt: skip
        return MicrobatchAgreement(self.collectives, groups, self.device, rank=self.rank, mode=mode)

    def _raise_on_nonfinite_grads(self) -> None:
        pgs = self.process_groups
        raise_on_nonfinite_grads(
            self.all_bucket_groups, self.collectives, pgs.dp,
            dp_rank=pgs.dp_rank, dp_size=pgs.dp_size, rank=self.rank,
            pp_group=pgs.pp, pp_rank=pgs.pp_rank, pp_size=pgs.pp_size,
        )  # fmt: skip

    def _raise_on_unused_params(self) -> None:
        raise_on_unused_params(
            self.all_bucket_groups, self.param_to_name, self.process_groups, self.collectives,
            self.device, self.rank,
        )  # fmt: skip

    # ---- what the wrapper's doors call --------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return params_device(self.param_to_name, self.process_groups.dp)

    def _on_grad(self) -> None:
        """A backward's first param grad hook ([Note: one bookkeeping per backward])."""
        self.residency.check("backward (a param's grad hook)")
        self.hooks.backward_seen = True
        self.sync.on_grad()
        self.sync.skip_until_backward_ends()

    @torch.compiler.disable
    def before_forward(self, compiling: bool, sync_buffers: bool, buffer_src: int = 0) -> None:
        """Runs eagerly even when the model is compiled (`compiling`: it is being traced);
        module buffers come from dp rank `buffer_src` ([Note: uneven inputs] in join.py)."""
        self.residency.check("forward")
        if torch.is_grad_enabled():
            refuse_dist_autograd(self.rank)  # [Note: distributed autograd]
        auto = self.auto  # after its re-plan, nothing more per forward
        if auto is not None and not auto.replanned and torch.is_grad_enabled() and not compiling:
            self._auto_iteration_start(auto)
        self.sync.before_forward(torch.is_grad_enabled())
        self.param_side.before_forward(self.module, compiling)
        if sync_buffers and torch.is_grad_enabled() and self.sync.require_sync:
            self.broadcast_module_buffers(buffer_src)

    def broadcast_module_buffers(self, src_dp_rank: int) -> None:
        """dp rank `src_dp_rank`'s module buffers to every dp rank (broadcast_buffers)."""
        with torch.no_grad():
            for tensor in self._module_buffers:
                self.collectives.broadcast(tensor, src_dp_rank, self.process_groups.dp)

    def _auto_iteration_start(self, auto: AutoBucket) -> None:
        """A forward that starts an iteration whose grads every rank cleared runs
        `zero_grad_buffer()` first, for the warm-up's quiet step or re-plan ([Note: auto bucket
        re-plan in a torch-style loop] in autobucket.py); collective over dp while it waits."""
        if auto.overdue:
            auto.give_up(self.rank)
            return
        sync = self.sync
        starts = sync.require_sync and sync.phase is SyncPhase.SYNCED
        if not (auto.wants_iteration_start and starts and self.config.sharding.exposes_grads):
            return
        pending = torch.tensor([0.0 if sync.grads.cleared() else 1.0], device=self.device)
        self.collectives.all_reduce_max(pending, auto.group)
        if pending.item() == 0.0:
            self.zero_grad_buffer()

    def scale_gradients(self, factor: float) -> None:
        """Every grad, the buffers' and the sparse ones ([Note: gradient scaling])."""
        for buf in self.buffers:
            buf.scale_gradients(factor)
        self.sparse_grads.scale(factor)

    def enable_timeline(self) -> Timeline:
        timeline = Timeline(self.device)
        self.sync.enable_timeline(timeline)
        return timeline

    def broadcast_params(self) -> None:
        """dp-rank 0's params (expert params: expt_dp-rank 0's) and buffers to every rank."""
        pgs = self.process_groups
        with self.param_side.summon(writeback=True), torch.no_grad():  # waits for gathers
            for _, param in self.module.named_parameters():
                group = pgs.expt_dp if is_expert_parallel(param) else pgs.dp
                self.collectives.broadcast(param.data, 0, group)
                # tell fp32 main-param holders the values changed (see reload_model_params)
                torch.autograd.graph.increment_version(param)
            for tensor in self.module.buffers():
                self.collectives.broadcast(tensor, 0, pgs.dp)
