"""Communication hooks on an engine's bucket groups: checking and installing a hook
(`install_hook`) and `CommHookRegistry`, which `DistributedDataParallel` holds and whose
methods its comm-hook API calls. See [Note: comm hook contract] in megabuf/comm_hooks/contract.py.

It lives beside the engine, not in the hook library (`megabuf.comm_hooks`): it needs the bucket
groups, and the library sits below them ([Note: import layers] in tests/test_import_graph.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import ExitStack

from megabuf.buckets.bucket_group import BucketGroup
from megabuf.buckets.buffer import _ParamAndGradBucket
from megabuf.comm_hooks.contract import (
    CommHookRegistrationError,
    GradBucket,
    Mode,
    check_modes,
    hook_name,
)
from megabuf.comm_hooks.fixed_order import Deterministic, require_deterministic
from megabuf.comm_hooks.telemetry import HookReport, hook_report
from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.plan import Plan
from megabuf.sharding.grads import check_error_feedback, error_feedback_nbytes
from megabuf.sharding.ledger import MemoryLedger

logger = logging.getLogger("megabuf.ddp")

KINDS = ("dense", "expert", "all")


def bucket_indices(plan: Plan) -> dict[tuple[int, int], int]:
    """(buffer index, bucket id) -> stable global bucket index, in plan order (dense buffers
    first, then expert; each buffer's buckets in order)."""
    indices: dict[tuple[int, int], int] = {}
    for buf in plan.buffers:
        for slot in buf.layout.buckets:
            indices[(buf.index, slot.bucket_id)] = len(indices)
    return indices


def selected_kinds(buffers: str) -> tuple[bool, ...]:
    """The `expert` flags `buffers` ("dense" | "expert" | "all") selects."""
    if buffers not in KINDS:
        raise ValueError(
            f"megabuf: register_comm_hook buffers must be one of {KINDS}, got {buffers!r}"
        )
    return {"dense": (False,), "expert": (True,), "all": (False, True)}[buffers]


def install_hook(
    hook: object,
    groups: Sequence[BucketGroup],
    plan: Plan,
    *,
    expert_kinds: tuple[bool, ...],
    mode: Mode,
    strategy_name: str,
    average: bool,
    rank: int,
    replaceable: object | None = None,
) -> list[GradBucket]:
    """Check `hook` against the mode and the selected groups, build their `GradBucket` views,
    let the hook see them (`setup`, optional) and attach it. Nothing is attached if any check
    fails. A group's hook that is `replaceable` (the one deterministic_reduction installed) is
    replaced, not "registered twice". Returns the views."""
    what = f"this model (data_parallel_sharding_strategy={strategy_name!r}, rank {rank})"
    check_modes(hook, mode, what)
    plans = {g.group_id: g for g in plan.groups}
    chosen = [g for g in groups if plans[g.group_id].expert in expert_kinds]
    if not chosen:
        kinds = " or ".join("expert" if e else "dense" for e in expert_kinds)
        raise ValueError(
            f"megabuf: register_comm_hook({hook_name(hook)}): this model has no {kinds} "
            f"buffers (rank {rank}); nothing would use the hook"
        )
    for group in chosen:
        if group.comm_hook is not None and group.comm_hook is not replaceable:
            kind = "expert" if plans[group.group_id].expert else "dense"
            raise CommHookRegistrationError(
                f"megabuf: a comm hook ({hook_name(group.comm_hook)}) is already registered "
                f"for the {kind} buffers (rank {group.rank}); register once, before the first "
                "backward (a new hook needs a new DistributedDataParallel)"
            )
    indices = bucket_indices(plan)
    views = {}
    for g in chosen:
        planned = plans[g.group_id]
        views[g.group_id] = [
            _view(g, bucket, indices[member], mode, average, planned.expert)
            for bucket, member in zip(g.buckets, planned.members, strict=True)
        ]
    setup = getattr(hook, "setup", None)
    all_views = [v for g in chosen for v in views[g.group_id]]
    if setup is not None:
        setup(all_views)
    for group in chosen:
        group.set_comm_hook(hook, views[group.group_id])
    return all_views


def _view(
    group: BucketGroup,
    bucket: _ParamAndGradBucket,
    index: int,
    mode: Mode,
    average: bool,
    expert: bool,
) -> GradBucket:
    data = bucket.grad_data
    return GradBucket(
        index=index,
        group_id=group.group_id,
        expert=expert,
        mode=mode,
        data=data,
        shard=group.local_shard(data) if mode == "reduce_scatter" else None,
        params=tuple(bucket.params_list),
        param_names=tuple(group.name_of(p) for p in bucket.params_list),
        group=group.collective_group,
        group_size=group.dp_size,
        group_rank=group.dp_rank,
        rank=group.rank,
        average=average,
        collectives=group.collectives,
        gradient_scaling_factor=bucket.gradient_scaling_factor,
    )


class CommHookRegistry:
    """The comm hooks of one engine: registration (once per buffer kind, before the first
    backward), the registered hooks, their skip / loss-scale notifications, the deterministic
    mode's replaceable hook and the wire-byte report."""

    def __init__(
        self,
        groups: list[BucketGroup],
        plan: Plan,
        config: DistributedDataParallelConfig,
        ledger: MemoryLedger,
        rank: int,
    ) -> None:
        self.all_bucket_groups = groups  # dense then expert, as the engine's
        self.plan = plan
        self.ddp_config = config
        self.memory_ledger = ledger
        self.rank = rank
        self.backward_seen = False  # registration must come before the first backward
        self._mode_hook: Deterministic | None = None  # deterministic_reduction's, replaceable

    def saw_backward(self) -> None:
        """A backward ran: registration is closed (the engine's first grad hook calls this)."""
        self.backward_seen = True

    def register_comm_hook(self, hook: object, *, buffers: str = "all") -> None:
        """Reduce the `buffers` ("dense", "expert" or "all") buckets with `hook` instead of the
        engine's collective: see [Note: comm hook contract] in megabuf/comm_hooks/contract.py
        and the built-ins in `megabuf.comm_hooks`. Once per kind, before the first backward;
        every rank must register the same hook."""
        if self.backward_seen:
            raise CommHookRegistrationError(
                f"megabuf: register_comm_hook({hook_name(hook)}) after a backward (rank "
                f"{self.rank}); register before the first backward, as torch DDP requires"
            )
        cfg = self.ddp_config
        if cfg.deterministic_reduction:  # [Note: deterministic reduction]
            require_deterministic(hook, self.rank)
        strategy = cfg.sharding
        if strategy.shards_grads:
            check_error_feedback(hook, strategy.name, self.rank)
        with ExitStack() as stack:  # optim_grads*: views into the buckets need their storage
            for group in self.all_bucket_groups:
                stack.enter_context(group.grads.materialized())
            install_hook(
                hook, self.all_bucket_groups, self.plan, expert_kinds=selected_kinds(buffers),
                mode=strategy.reduction, strategy_name=strategy.name,
                average=cfg.average_in_collective, rank=self.rank, replaceable=self._mode_hook,
            )  # fmt: skip
        nbytes = error_feedback_nbytes(hook) if strategy.shards_grads else 0
        if nbytes:
            self.memory_ledger.alloc("comm_hook_error_feedback", nbytes)
            logger.warning(
                "megabuf: %s keeps full-size error feedback under %s: %d bytes on rank %d "
                "(allow_full_size_error_feedback=True)", hook_name(hook), strategy.name, nbytes,
                self.rank,
            )  # fmt: skip

    def comm_hooks(self) -> dict[str, object]:
        """The registered comm hooks: "dense" / "expert" -> hook (a hook registered for "all"
        appears under both; a kind without a hook or without buffers is absent).
        `save_checkpoint` saves the state of those with `state_dict()`: [Note: comm hook state
        in checkpoints] in megabuf/checkpoint/hook_state.py."""
        hooks: dict[str, object] = {}
        expert_of = {g.group_id: g.expert for g in self.plan.groups}
        for kind, expert in (("dense", False), ("expert", True)):
            groups = [g for g in self.all_bucket_groups if expert_of[g.group_id] == expert]
            hook = next((g.comm_hook for g in groups if g.comm_hook is not None), None)
            if hook is not None:
                hooks[kind] = hook
        return hooks

    def unique_hooks(self) -> list[object]:
        hooks: list[object] = []
        for hook in self.comm_hooks().values():
            if not any(hook is h for h in hooks):
                hooks.append(hook)
        return hooks

    def notify_comm_hooks_step_skipped(self) -> None:
        """Tell the registered comm hooks that the optimizer skipped the step whose grads they
        just reduced (inf/NaN): each hook's optional `on_step_skipped()` runs (PowerSGD drops
        its residuals and Q). megabuf's optimizers call it; with torch's GradScaler, call it on
        every rank when `scaler.step(opt)` skipped (e.g. the scale went down)."""
        for hook in self.unique_hooks():
            method = getattr(hook, "on_step_skipped", None)
            if method is not None:
                method()

    def notify_comm_hooks_loss_scale_changed(self, ratio: float) -> None:
        """Tell the registered comm hooks that the loss scale was multiplied by `ratio` (new /
        old): each hook's optional `on_loss_scale_change(ratio)` runs (PowerSGD rescales its
        residuals). megabuf's optimizers call it; with torch's GradScaler, call it on every
        rank after `scaler.update()` changed `scaler.get_scale()`."""
        for hook in self.unique_hooks():
            method = getattr(hook, "on_loss_scale_change", None)
            if method is not None:
                method(ratio)

    def install_deterministic(self) -> None:
        """deterministic_reduction: `Deterministic` on each buffer kind that has no hook yet;
        a deterministic hook registered later replaces it."""
        expert_of = {g.group_id: g.expert for g in self.plan.groups}
        free = {expert_of[g.group_id] for g in self.all_bucket_groups if g.comm_hook is None}
        if free:
            self._mode_hook = Deterministic()
            buffers = "all" if len(free) == 2 else ("expert" if True in free else "dense")
            self.register_comm_hook(self._mode_hook, buffers=buffers)

    def comm_hook_report(self, *, reset: bool = False) -> HookReport:
        """Wire bytes and calls each registered comm hook issued, per bucket, since the last
        reset ([Note: hook wire bytes] in megabuf/comm_hooks/telemetry.py)."""
        return hook_report(self, reset=reset)
