"""`Engine`: what one `DistributedDataParallel` is made of, built once, reachable as `model.engine`.

[Note: the engine's read API]
The wrapper (ddp.py) is the public face. The optimizer, checkpoints, pipelines, the weights
package, `megabuf inspect` and the tests read the engine only through these names (pinned by
tests/test_engine_read_api.py; everything else is private; docs/ARCHITECTURE.md):
    module, config, disable_bucketing     what it wraps and how it was built
    rank, topology, process_groups, collectives, device     this rank's place; the one transport
    plan, param_to_name, sparse_grads     the pure plan; the params outside the buffers
    buffers, dense_buffers, expert_parallel_buffers, bucket_groups,
    expert_parallel_bucket_groups, all_bucket_groups       by kind (Megatron's names)
    memory_ledger                         device bytes by category
    sync, param_side, hooks, gather_hooks, auto, replan_listeners    the parts a step drives
    offloaded, offload, restore, check_resident, watch_outputs  residency ([Note: offloaded engine])
    before_forward, zero_grad_buffer, scale_gradients, broadcast_params,
    broadcast_module_buffers, register_comm_hook, enable_timeline, rebucket   the doors' acts
What is built on the bucket groups (plan, buffers, groups, sync, param side, hooks) is one
`Wiring` record, read through these names and swapped whole by the auto re-plan ([Note: wired
once, swapped whole] in wiring.py); nothing is patched into a part after it is built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from megabuf.buckets.arrivals import countable, weak_callable
from megabuf.buckets.bucket_group import BucketGroup, DispatchChain, Timeline
from megabuf.buckets.buffer import _ParamAndGradBuffer
from megabuf.comm_hooks import build as build_comm_hook
from megabuf.config import DistributedDataParallelConfig
from megabuf.core.assembly import assemble
from megabuf.core.wiring import ParamToGroup, WiredField, Wiring, WiringParts, rewire, wire
from megabuf.fp8 import Fp8Params, broadcast_tensors, convert_fp8_params
from megabuf.planning.model_plan import plan_model, trainable_params
from megabuf.planning.plan import Plan
from megabuf.planning.replicas import (
    ParamStructure,
    check_devices,
    check_replicas_match,
    is_expert_parallel,
)
from megabuf.replan.autobucket import AutoBucket
from megabuf.replan.sharded_replan import ReplanListeners, replan_shortfall
from megabuf.sharding.ledger import MemoryLedger
from megabuf.sharding.param_units import unit_modules
from megabuf.sharding.parts import ExposedGradsParts, ParamSideParts
from megabuf.sync.grad_sync import GradSync, SyncPhase
from megabuf.sync.grads import ExposedGrads, raise_on_unused_params
from megabuf.sync.hook_registry import CommHookRegistry
from megabuf.sync.hooks import ParamGatherHooks
from megabuf.sync.microbatches import AgreementGroups, MicrobatchAgreement
from megabuf.sync.nan_check import raise_on_nonfinite_grads
from megabuf.sync.param_sync import GatheredParams
from megabuf.sync.residency import Residency
from megabuf.sync.sparse_grads import SparseGrads
from megabuf.transport.collectives import Collectives
from megabuf.transport.devices import params_device
from megabuf.transport.dist_autograd import refuse_dist_autograd
from megabuf.transport.process_groups import ProcessGroups
from megabuf.verify.engine_checks import EngineVerifier

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
        self._residency = Residency(self.rank)  # [Note: offloaded engine]
        self.replan_listeners = ReplanListeners(self.rank)  # [Note: sharded auto bucket re-plan]
        self._verifier = EngineVerifier(self)  # [Note: verify mode]; its checks join the sync's
        self.disable_bucketing = disable_bucketing
        # False: an unpickled copy, built without a collective ([Note: pickling a wrapped model])
        self._check_replicas = check_replicas
        self.auto: AutoBucket | None = None  # [Note: auto bucket re-plan]; built last
        self._build(disable_bucketing, init_sync)
        if config.comm_hook is not None:
            spec = dict(config.comm_hook)
            buffers = spec.pop("buffers", "all")
            self.hooks.register_comm_hook(build_comm_hook(spec), buffers=buffers)
        if config.deterministic_reduction:
            self.hooks.install_deterministic()
        if config.bucket_size == "auto":  # its hooks after the engine's grad hooks
            self.auto = AutoBucket(
                [(n, p) for p, n in self.param_to_name.items()], config, collectives,
                process_groups.dp, self.device, self,
            )  # fmt: skip

    # ---- construction -------------------------------------------------------------------------
    def _convert_fp8(self, init_sync: bool) -> Fp8Params:
        """The model's float8 weights become FP8 params ([Note: FP8 params])."""
        pgs, collectives = self.process_groups, self.collectives
        return convert_fp8_params(
            self.module, self.config.sharding.param_home != "module",
            broadcast=(lambda t, expert: collectives.broadcast(
                t, 0, pgs.expt_dp if expert else pgs.dp)) if init_sync else None,
        )  # fmt: skip

    def _build(self, disable_bucketing: bool, init_sync: bool) -> None:
        pgs, cfg = self.process_groups, self.config
        named = list(self.module.named_parameters())  # shared params once, under their first name
        if self.topology.pp_size == 1:  # a pipeline's model chunk may hold no params
            trainable_params(self.module, self.rank)  # refused before the first collective
        check_devices(named)
        if self._check_replicas:
            check_replicas_match(named, pgs.dp, self.collectives)
        fp8 = self._convert_fp8(init_sync)  # [Note: FP8 params]
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
        units = unit_modules(self.module, planned.unit_plan)  # (name, module), root first
        built = assemble(
            planned.plan, self._params, cfg, pgs, self.collectives, self.memory_ledger,
            self.param_to_name, [name for name, _ in units], fp8,
        )  # fmt: skip
        fp8.drop_seeds()
        self._module_buffers = list(self.module.buffers())  # what forward broadcasts
        self._parts = self._wiring_parts()
        self._wired: Wiring = wire(self._parts, planned.plan, built)  # [Note: wired once, ...]
        if init_sync:
            self.broadcast_params()
        self._shard_params(units)
        for buf in self.buffers:
            logger.debug("megabuf: %s", buf.describe())

    def _shard_params(self, units: list[tuple[str, nn.Module]]) -> None:
        """The strategy's param side ([Note: strategies build their parts]); optim_grads_params
        fills the shards from the whole params, releases these and installs the unit hooks.
        After the initial broadcast, and again at the auto bucket re-plan."""
        kit = ParamSideParts(
            self.all_bucket_groups, self._wired.gather_hooks, self.config, self.plan, units,
            self.param_to_name, self.memory_ledger, self.rank, self._residency.check,
        )  # fmt: skip
        self._wired = self._wired.with_param_side(self.config.sharding.param_side(kit))

    def _wiring_parts(self) -> WiringParts:
        """What every `Wiring` of this engine is built from, callbacks included ([Note: wired
        once, swapped whole] in wiring.py)."""
        pgs = self.process_groups
        return WiringParts(
            owner=self, module=self.module, params=self._params, param_to_name=self.param_to_name,
            config=self.config, process_groups=pgs, collectives=self.collectives,
            ledger=self.memory_ledger, sparse_grads=self.sparse_grads, rank=self.rank,
            exposed_grads=self._exposed_grads, make_sync=self._make_sync, on_grad=self._on_grad,
        )  # fmt: skip

    def _make_sync(
        self,
        groups: list[BucketGroup],
        chains: list[DispatchChain[BucketGroup]],
        grads: ExposedGrads,
    ) -> GradSync:
        structure = ParamStructure(self.module)
        # bucket_size="auto": told of each sync until the re-plan ([Note: auto bucket re-plan])
        watch = self.config.bucket_size == "auto" and (self.auto is None or not self.auto.replanned)
        return GradSync(
            groups, chains, self.config, grads,
            before_sync=lambda: structure.check(self.rank), checks=self._sync_checks(),
            agreement=self._microbatch_agreement(), outside=self.sparse_grads,
            on_backward_end=self._auto_backward_end if watch else None,
            on_synced=self._auto_synced if watch else None,
            on_first_sync=weak_callable(self._count_arrivals),  # no engine cycle
        )  # fmt: skip

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
        self._wired, units = rewire(self._parts, self._wired, plan, sharded)
        if units:  # optim_grads_params: the new groups sharded, the unit hooks on them
            self._shard_params(units)

    def _count_arrivals(self) -> None:
        """After the first sync, the groups that can count their grads without a Python call
        each get counted hooks instead ([Note: counted arrivals] in arrivals.py)."""
        cfg, handles = self.config, self._wired.grad_hook_handles
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

    def _exposed_grads(
        self, params: Sequence[nn.Parameter], param_to_bucket_group: ParamToGroup
    ) -> ExposedGrads:
        """[Note: grad contract]: the strategy's ([Note: strategies build their parts])."""
        kit = ExposedGradsParts(params, self.param_to_name, param_to_bucket_group)
        return self.config.sharding.exposed_grads(kit)

    def _auto_backward_end(self) -> None:
        if self.auto is not None:
            self.auto.on_backward_end()

    def _auto_synced(self) -> None:
        if self.auto is not None:
            self.auto.on_synced()

    def _sync_checks(self) -> list[Callable[[], None]]:
        """What the grad sync checks once every reduction landed (each raises on every rank)."""
        checks: list[Callable[[], None]] = []
        if self.config.check_for_nan_in_grad:
            checks.append(self._raise_on_nonfinite_grads)
        if self.config.error_on_unused_params:
            checks.append(self._raise_on_unused_params)
        return checks + self._verifier.sync_checks()

    def _microbatch_agreement(self) -> MicrobatchAgreement | None:
        """[Note: micro-batch agreement], in the modes that communicate every micro-batch."""
        cfg, pgs = self.config, self.process_groups
        mode = cfg.sharding.agreement_mode(cfg.sharded_grad_accumulation)
        group_rank, group_size = self.topology.sharding(False)
        if mode is None or group_size == 1:
            return None
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

    # ---- the read API: what the layers above read ([Note: the engine's read API]) -------------
    plan = WiredField[Plan]("plan")
    buffers = WiredField[list[_ParamAndGradBuffer]]("buffers")  # plan order (dense, expert)
    dense_buffers = WiredField[list[_ParamAndGradBuffer]]("dense_buffers")
    expert_parallel_buffers = WiredField[list[_ParamAndGradBuffer]]("expert_parallel_buffers")
    bucket_groups = WiredField[list[BucketGroup]]("bucket_groups")
    expert_parallel_bucket_groups = WiredField[list[BucketGroup]]("expert_parallel_bucket_groups")
    all_bucket_groups = WiredField[list[BucketGroup]]("all_bucket_groups")  # dense, then expert
    sync = WiredField[GradSync]("sync")
    param_side = WiredField[GatheredParams]("param_side")
    hooks = WiredField[CommHookRegistry]("hooks")
    gather_hooks = WiredField[ParamGatherHooks]("gather_hooks")

    # ---- residency: the engine's own acts ([Note: offloaded engine] in residency.py) ----------
    @property
    def offloaded(self) -> object:
        """The record of the offload in force (megabuf.weights.offload), or None."""
        return self._residency.offloaded

    def offload(self, record: object) -> None:
        """From now on every entry point raises until `restore()` (the weights package released
        the memory; `record` is what it needs to refill it)."""
        self._residency.enter(record)

    def restore(self) -> object:
        """The offload's record, which the weights package refills the memory from; usable
        again."""
        return self._residency.leave()

    def check_resident(self, entry: str) -> None:
        """Raise `EngineOffloadedError` naming `entry` while offloaded."""
        self._residency.check(entry)

    def watch_outputs(self, output: object) -> None:
        """The offload check at the start of the backward of a forward's `output`."""
        self._residency.watch(output)

    # ---- what the wrapper's doors call --------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return params_device(self.param_to_name, self.process_groups.dp)

    def _on_grad(self) -> None:
        """A backward's first param grad hook ([Note: one bookkeeping per backward])."""
        self._residency.check("backward (a param's grad hook)")
        wired = self._wired
        wired.hooks.saw_backward()
        wired.sync.on_grad()
        wired.sync.skip_until_backward_ends()

    @torch.compiler.disable
    def before_forward(self, compiling: bool, sync_buffers: bool, buffer_src: int = 0) -> None:
        """Runs eagerly even when the model is compiled (`compiling`: it is being traced);
        module buffers come from dp rank `buffer_src` ([Note: uneven inputs] in join.py)."""
        self._residency.check("forward")
        if torch.is_grad_enabled():
            refuse_dist_autograd(self.rank)  # [Note: distributed autograd]
        auto = self.auto  # after its re-plan, nothing more per forward
        if auto is not None and not auto.replanned and torch.is_grad_enabled() and not compiling:
            self._auto_iteration_start(auto)
        wired = self._wired
        wired.sync.before_forward(torch.is_grad_enabled())
        wired.param_side.before_forward(self.module, compiling)
        if sync_buffers and torch.is_grad_enabled() and wired.sync.require_sync:
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
                for tensor in broadcast_tensors(param):  # [Note: FP8 params]
                    self.collectives.broadcast(tensor, 0, group)
                # tell fp32 main-param holders the values changed (see reload_model_params)
                torch.autograd.graph.increment_version(param)
            for tensor in self.module.buffers():
                self.collectives.broadcast(tensor, 0, pgs.dp)
